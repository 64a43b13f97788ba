"""Example inputs read from files: what ``--example-inputs`` and ``--sample`` give the command line.

The Python API takes ``example_inputs=`` directly; on the command line a model whose inputs normswap
cannot build (a vision-language model wanting image tokens in its prompt, a time-series model, a
detection head) gets them from a file instead:

- :func:`from_safetensors`: a ``.safetensors`` file of named tensors, passed to ``forward`` as keyword
  arguments (``save_file({"input_ids": ids, "pixel_values": px}, "inputs.safetensors")``). The names are
  checked against the forward signature: unknown or missing ones are refused in one line.
- :func:`from_samples`: files the model's own processor turns into inputs (its tokenizer for a text
  file, its image processor for an image, read with Pillow, its feature extractor for audio: WAV through
  the standard library's ``wave``, other formats through ``soundfile`` when installed). The processor is
  the one loaded with the model, else the one saved in the model's directory (``AutoProcessor``,
  ``AutoTokenizer``, ``AutoImageProcessor``, ``AutoFeatureExtractor``, offline).

Both return a :data:`InputsFor`: a function of the loaded model and its processor, called once the model
is loaded (the checkpoint conversion, ``inspect`` and ``verify`` load it themselves). Every problem is a
:class:`~normswap.errors.UsageError` (exit code 2) naming the file.
"""

from __future__ import annotations

import inspect
import os
import wave
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap.errors import UsageError, first_line

InputsFor = Callable[[nn.Module, Any], dict[str, Any]]

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm"}
AUDIO_SUFFIXES = {".wav", ".wave", ".flac", ".ogg", ".mp3", ".m4a", ".aiff", ".aif"}
TEXT_SUFFIXES = {".txt", ".text", ".md", ".prompt", ""}


def from_safetensors(path: str | os.PathLike, option: str = "--example-inputs") -> InputsFor:
    """The named tensors of the safetensors file ``path`` as ``forward``'s keyword arguments (the file is
    read now, so a bad one fails before any model loads; the names are checked once the model is)."""
    tensors = read_safetensors(path, option)

    def build(model: nn.Module, processor: Any = None) -> dict[str, Any]:
        check_names(model, tensors, f"{option} {path}")
        return no_cache(model, to_model(model, tensors))

    return build


def read_safetensors(path: str | os.PathLike, option: str = "--example-inputs") -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path``, by name; a one-line :class:`UsageError` for a file
    that is missing, not safetensors, or empty."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = Path(path).expanduser()
    if not file.is_file():
        raise UsageError(f"{option} {path}: no such file")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise UsageError(f"{option} {path} is not a readable safetensors file ({first_line(exc, 120)}); "
                         "write one with safetensors.torch.save_file({'input_ids': ids, ...}, PATH)") from None
    if not tensors:
        raise UsageError(f"{option} {path} holds no tensors; it needs one per input of the model's forward")
    return tensors


def no_cache(model: nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``use_cache=False`` and ``return_loss=False`` where the forward takes them and the inputs do not
    say: one forward builds no key/value cache and computes no loss (as the inputs normswap builds itself
    say; FLAVA pre-training's config asks for a loss, which needs labels a file of inputs rarely holds)."""
    params = inspect.signature(model.forward).parameters
    flags = {k: False for k in ("use_cache", "return_loss") if k in params and k not in kwargs}
    return {**kwargs, **flags} if flags else kwargs


def check_names(model: nn.Module, given: dict[str, Any], what: str) -> None:
    """Refuse, in one line, inputs whose names ``model.forward`` does not take, or that leave out an
    argument it requires (no default). A transformers model's ``**kwargs`` (attention options, not inputs)
    take no input names; a custom model's do."""
    from normswap.inputs import is_hf_model

    params = inspect.signature(model.forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) and not is_hf_model(model)
    named = {n for n, p in params.items() if p.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                             inspect.Parameter.VAR_KEYWORD)}
    unknown = sorted(n for n in given if n not in named)
    if unknown and not takes_any:
        raise UsageError(f"{what}: {type(model).__name__}.forward takes no input named "
                         f"{', '.join(map(repr, unknown))}; it takes {', '.join(sorted(named)) or 'nothing by name'}")
    missing = [n for n, p in params.items() if n not in given and p.default is inspect.Parameter.empty
               and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    if missing:
        raise UsageError(f"{what}: {type(model).__name__}.forward requires {', '.join(map(repr, missing))}, "
                         "which the file does not hold")


def to_model(model: nn.Module, tensors: dict[str, Any]) -> dict[str, Any]:
    """``tensors`` on the model's device, floating ones in its floating dtype (ids and masks as given)."""
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    if p is None:
        return dict(tensors)
    return {k: (v.to(p.device, p.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point()
                else v.to(p.device) if isinstance(v, torch.Tensor) else v) for k, v in tensors.items()}


# ------------------------------------------------------------------------------------ samples
def sample_kind(path: str | os.PathLike) -> str:
    """``"image"``, ``"audio"`` or ``"text"``, from the file name's suffix (any other suffix: text)."""
    suffix = Path(path).suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        return "image"
    if suffix in AUDIO_SUFFIXES:
        return "audio"
    return "text"


def from_samples(paths: Sequence[str | os.PathLike], option: str = "--sample") -> InputsFor:
    """The model's processor applied to the sample files ``paths`` (read now, so a bad file fails before
    any model loads): one text file, image and/or audio clip per modality. One modality goes through that
    part of the processor (its tokenizer, image processor or feature extractor); several through the
    whole processor, together (``processor(text=..., images=..., audio=...)``)."""
    samples: dict[str, Any] = {}
    for path in paths:
        kind = sample_kind(path)
        if kind in samples:
            raise UsageError(f"{option}: two {kind} samples ({samples[kind][0]}, {path}); pass one per modality")
        samples[kind] = (path, _read_sample(path, kind, option))

    def build(model: nn.Module, processor: Any = None) -> dict[str, Any]:
        what = f"{option} {', '.join(str(p) for p, _ in samples.values())}"
        proc = processor if processor is not None else load_processor_for(model)
        if proc is None:
            raise UsageError(f"{what}: no processor or tokenizer was found for {type(model).__name__} (none in "
                             "the model's directory); pass --example-inputs FILE.safetensors instead")
        encoded = _encode(proc, {k: v for k, (_, v) in samples.items()}, what, _text_limit(model, proc))
        return no_cache(model, to_model(model, _fit_forward(model, encoded, what)))

    return build


def _read_sample(path: str | os.PathLike, kind: str, option: str) -> Any:
    file = Path(path).expanduser()
    if not file.is_file():
        raise UsageError(f"{option} {path}: no such file")
    if kind == "text":
        try:
            text = file.read_text(encoding="utf-8").strip()
        except (UnicodeDecodeError, OSError) as exc:
            raise UsageError(f"{option} {path} is not UTF-8 text ({first_line(exc, 80)}); images and audio are "
                             f"read by suffix ({', '.join(sorted(IMAGE_SUFFIXES | AUDIO_SUFFIXES))})") from None
        if not text:
            raise UsageError(f"{option} {path} is empty")
        return text
    if kind == "image":
        try:
            from PIL import Image
        except ImportError:
            raise UsageError(f"{option} {path}: reading images needs Pillow (pip install pillow)") from None
        try:
            with Image.open(file) as img:
                return img.convert("RGB")
        except (OSError, ValueError) as exc:
            raise UsageError(f"{option} {path} is not a readable image ({first_line(exc, 100)})") from None
    return read_audio(file, option)


def read_audio(file: Path, option: str = "--sample") -> tuple[torch.Tensor, int]:
    """``(mono float32 waveform in [-1, 1], sampling rate)``: WAV (8/16/24/32-bit PCM) with the standard
    library, anything else with ``soundfile`` when it is installed."""
    if file.suffix.lower() in (".wav", ".wave"):
        try:
            with wave.open(str(file), "rb") as w:
                channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
                raw = w.readframes(w.getnframes())
        except (wave.Error, EOFError, OSError) as exc:
            raise UsageError(f"{option} {file} is not a readable WAV file ({first_line(exc, 100)}); "
                             "WAV is read as PCM (8, 16, 24 or 32 bit)") from None
        return _pcm(raw, width, channels, file, option), rate
    try:
        import soundfile
    except ImportError:
        raise UsageError(f"{option} {file}: reading {file.suffix} audio needs soundfile (pip install soundfile); "
                         "WAV needs nothing") from None
    try:
        data, rate = soundfile.read(str(file), dtype="float32", always_2d=True)
    except Exception as exc:  # noqa: BLE001 - soundfile's own error types vary with its backend
        raise UsageError(f"{option} {file} is not readable audio ({first_line(exc, 100)})") from None
    return torch.from_numpy(data).mean(1), int(rate)


def _pcm(raw: bytes, width: int, channels: int, file: Path, option: str) -> torch.Tensor:
    if width == 1:  # 8-bit WAV is unsigned
        samples = torch.frombuffer(bytearray(raw), dtype=torch.uint8).float().sub(128.0).div(128.0)
    elif width == 2:
        samples = torch.frombuffer(bytearray(raw), dtype=torch.int16).float().div(32768.0)
    elif width == 3:
        b = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(-1, 3).long()
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        samples = torch.where(v >= 1 << 23, v - (1 << 24), v).float().div(float(1 << 23))
    elif width == 4:
        samples = torch.frombuffer(bytearray(raw), dtype=torch.int32).float().div(float(1 << 31))
    else:
        raise UsageError(f"{option} {file}: {8 * width}-bit WAV samples are not read; save it as 16-bit PCM")
    if samples.numel() == 0:
        raise UsageError(f"{option} {file} holds no audio frames")
    return samples.reshape(-1, channels).mean(1)


def load_processor_for(model: nn.Module) -> Any | None:
    """The processor saved in the directory ``model`` was loaded from (offline), else None."""
    path = getattr(getattr(model, "config", None), "_name_or_path", None)
    if not path or not os.path.isdir(str(path)):
        return None
    import transformers

    from normswap.inputs import has_vocabulary

    for cls in ("AutoProcessor", "AutoTokenizer", "AutoImageProcessor", "AutoFeatureExtractor"):
        try:
            proc = getattr(transformers, cls).from_pretrained(str(path), local_files_only=True)
        except Exception:  # noqa: BLE001, S112 - no such files for this kind: try the next one
            continue
        # transformers 5 builds a tokenizer of special tokens alone from a config.json without tokenizer
        # files: it turns any text into no tokens at all, so it is no tokenizer
        if not (hasattr(proc, "encode") and callable(proc) and not has_vocabulary(proc)):
            return proc
    return None


_PARTS = {"text": ("tokenizer", "a tokenizer"), "image": ("image_processor", "an image processor"),
          "audio": ("feature_extractor", "a feature extractor")}


def _text_limit(model: nn.Module, proc: Any) -> int | None:
    """The most tokens a text sample may have: the model's positions (its config's), or its tokenizer's
    ``model_max_length`` where that is lower (RoBERTa's 514 positions hold 512 tokens); None: no limit."""
    from normswap.inputs.builder import max_positions

    limits = [max_positions(getattr(model, "config", None))]
    tok = getattr(proc, "tokenizer", proc)
    given = getattr(tok, "model_max_length", None)
    limits.append(given if isinstance(given, int) and 0 < given < 1_000_000 else None)
    known = [n for n in limits if n]
    return min(known) if known else None


def _encode(proc: Any, samples: dict[str, Any], what: str, text_limit: int | None = None) -> dict[str, Any]:
    """``samples`` (text, an image, ``(waveform, rate)``) through ``proc`` as PyTorch tensors; a text sample
    alone is cut to ``text_limit`` tokens (a whole file is read as one sequence, and a model given more
    tokens than it has positions fails on an index, far from the cause)."""
    try:
        if len(samples) == 1:
            kind, value = next(iter(samples.items()))
            attr, name = _PARTS[kind]
            part = getattr(proc, attr, proc)
            if kind == "text":
                if not callable(part) or not hasattr(part, "encode"):
                    raise UsageError(f"{what}: the model's processor ({type(proc).__name__}) has no tokenizer")
                cut = {"truncation": True, "max_length": text_limit} if text_limit else {}
                out = part(value, return_tensors="pt", **cut)
            elif kind == "image":
                out = part(images=value, return_tensors="pt")
            else:
                wave_, rate = value
                wave_, rate = _resampled(wave_, rate, getattr(part, "sampling_rate", None))
                out = part(wave_.numpy(), sampling_rate=rate, return_tensors="pt")
        else:
            has = [kind for kind, (attr, _) in _PARTS.items() if getattr(proc, attr, None) is not None]
            if any(kind not in has for kind in samples):  # a feature extractor alone would fail on `text=`
                takes = f"takes {' and '.join(has)} samples" if has else "takes one kind of sample"
                raise UsageError(f"{what}: the model's processor ({type(proc).__name__}) {takes}, not "
                                 f"{' and '.join(samples)} together; pass only the samples it takes")
            args: dict[str, Any] = {}
            if "text" in samples:
                args["text"] = samples["text"]
            if "image" in samples:
                args["images"] = samples["image"]
            if "audio" in samples:
                wave_, rate = samples["audio"]
                fe = getattr(proc, "feature_extractor", None)
                wave_, rate = _resampled(wave_, rate, getattr(fe, "sampling_rate", None))
                args["audio"], args["sampling_rate"] = wave_.numpy(), rate
            out = proc(**args, return_tensors="pt")
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - the processor's own refusal, whatever its type
        raise UsageError(f"{what}: the model's processor ({type(proc).__name__}) could not encode it "
                         f"({type(exc).__name__}: {first_line(exc, 140)})") from None
    tensors = {k: v for k, v in dict(out).items() if isinstance(v, torch.Tensor)}
    empty = sorted(k for k, v in tensors.items() if v.numel() == 0)
    if empty:  # a tokenizer without a vocabulary, say: the model would fail on it, far from the cause
        raise UsageError(f"{what}: the model's processor ({type(proc).__name__}) made an empty "
                         f"{', '.join(empty)} of it (no vocabulary or features for this sample); pass "
                         "--example-inputs FILE.safetensors instead")
    return tensors


def _resampled(wave_: torch.Tensor, rate: int, wanted: int | None) -> tuple[torch.Tensor, int]:
    """``wave_`` linearly resampled to the feature extractor's rate (it refuses any other)."""
    if not wanted or int(wanted) == rate or wave_.numel() < 2:
        return wave_, rate
    n = max(2, round(wave_.numel() * int(wanted) / rate))
    resampled = torch.nn.functional.interpolate(wave_.view(1, 1, -1), size=n, mode="linear", align_corners=True)
    return resampled.view(-1), int(wanted)


def _fit_forward(model: nn.Module, encoded: dict[str, Any], what: str) -> dict[str, Any]:
    """The processor's outputs the forward takes (processors add extras: ``token_type_ids`` for a model
    that has none), plus decoder start ids for an encoder-decoder model; refused when the result still
    lacks a required input."""
    params = inspect.signature(model.forward).parameters
    kept = {k: v for k, v in encoded.items() if k in params}
    if not kept:
        raise UsageError(f"{what}: the processor made {', '.join(sorted(encoded)) or 'nothing'}, none of which "
                         f"{type(model).__name__}.forward takes; pass --example-inputs FILE.safetensors instead")
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params \
            and "decoder_input_ids" not in kept:
        start = getattr(config, "decoder_start_token_id", None)
        if start is None:
            start = getattr(getattr(config, "decoder", None), "bos_token_id", None)
        if isinstance(start, int):
            batch = next(iter(kept.values())).shape[0]
            kept["decoder_input_ids"] = torch.full((batch, 1), start, dtype=torch.long)
    check_names(model, kept, what)
    return kept
