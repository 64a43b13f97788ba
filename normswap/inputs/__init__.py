"""Example inputs: what the analysis runs the model on, and what verification probes it with.

For Hugging Face models the analysis inputs are built from the config, the forward signature and the
family's conventions (:mod:`normswap.inputs.builder`: text with image and audio tokens, images, video,
audio features, raw audio, time series, in the layout the model runs on; :mod:`normswap.inputs.media`).
Custom models must pass ``example_inputs``: a tuple of positional args or a dict of kwargs.

The verification probe (:func:`verification_probe`) is real text where the model's tokenizer is
known: the package's built-in English sentences (``normswap/data/calibration_en.txt``, also the
built-in calibration set), tokenised, padded, with an attention mask. Without a tokenizer it falls
back to random inputs, and says so.
"""

from __future__ import annotations

import inspect
import math
import os
import random
import warnings
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from torch import nn

from normswap.errors import NormswapError, first_line
from normswap.inputs import speech
from normswap.inputs.builder import describe as describe_built  # noqa: F401
from normswap.inputs.builder import encoder_states, has_cross_attention, hf_example_inputs, media_token_ids  # noqa: F401
from normswap.inputs.media import (
    AUDIO_FRAME_BUDGET,  # noqa: F401
    cfg,
)

ExampleInputs = tuple[Any, ...] | dict[str, Any] | torch.Tensor | None


def _sub_config(config: Any, kind: str) -> Any:
    """``config.<kind>_config`` (CLIP, BLIP, ...), ``config.<kind>`` (``EncoderDecoderConfig``'s
    ``encoder``/``decoder``; its encoder is the text side), else ``config`` itself."""
    for attr in (f"{kind}_config", kind, *(("encoder",) if kind == "text" else ())):
        sub = getattr(config, attr, None)
        if sub is not None and hasattr(sub, "to_dict"):
            return sub
    return config


def is_hf_model(model: nn.Module) -> bool:
    return hasattr(model, "config") and hasattr(model.config, "to_dict") and hasattr(model, "main_input_name")


def resolve(model: nn.Module, example_inputs: ExampleInputs) -> tuple[tuple, dict]:
    """Normalise user inputs (or build HF ones) into ``(args, kwargs)``."""
    if example_inputs is None:
        if not is_hf_model(model):
            raise NormswapError(
                f"{type(model).__name__} is not a transformers model, so normswap cannot guess its inputs; "
                "pass example_inputs=(tensor, ...) or example_inputs={'name': tensor}"
            )
        return (), hf_example_inputs(model)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise NormswapError(
        f"example_inputs must be a tensor, a tuple of positional args or a dict of kwargs, "
        f"not {type(example_inputs).__name__}"
    )


def cast_inputs(args: tuple, kwargs: dict, dtype: torch.dtype) -> tuple[tuple, dict]:
    """Floating-point inputs cast to ``dtype`` (ids and masks untouched)."""

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.to(dtype)
        return x

    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


# ------------------------------------------------------------------------------ built-in text
def builtin_sentences() -> list[str]:
    """The package's built-in sentences (a few hundred varied English sentences)."""
    text = resources.files("normswap").joinpath("data/calibration_en.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def passages(n: int, seed: int, per: int = 3, *, from_end: bool = False) -> list[str]:
    """``n`` passages of 1, 2, ..., ``per`` built-in sentences (short and longer inputs), in an order
    shuffled by ``seed``. ``from_end`` takes them from the other end of that order: the passages a
    fit on ``passages(m, seed)`` never sees, as long as both together need fewer sentences than ship."""
    sents = builtin_sentences()
    order = list(range(len(sents)))
    random.Random(seed).shuffle(order)
    if from_end:
        order.reverse()
    out = []
    for i in range(n):
        k = 1 + (i % per)
        out.append(" ".join(sents[order[(i * per + j) % len(order)]] for j in range(k)))
    return out


def find_tokenizer(model: nn.Module) -> Any | None:
    """The model's own tokenizer when it can be found offline, else None: the one in the local
    directory the model was loaded from, a built-in preset's (:mod:`normswap.presets`), or, for a
    model loaded by Hub id, the tokenizer files ``from_pretrained`` left in the local Hugging Face
    cache (read with ``local_files_only``: no network call, and no remote code). A tokenizer without
    a pad token gets the eos (or unk) token as one."""
    return _find_tokenizer(model)[0]


def _find_tokenizer(model: nn.Module) -> tuple[Any | None, str]:
    config = getattr(model, "config", None)
    path = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    if not path:
        return None, ""
    tok, where = None, ""
    if os.path.isdir(str(path)):
        try:
            from transformers import AutoTokenizer

            # never custom tokenizer code: without trust_remote_code=False transformers asks on stdin (y/N),
            # which blocks a convert --trust-remote-code of a custom-code model in a terminal (round 59)
            tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
            where = "the tokenizer in the model's directory"
        except Exception:  # noqa: BLE001 - no tokenizer files, or one transformers cannot read
            return None, ""
    else:
        from normswap import presets

        if presets.is_preset(str(path)):
            tok, where = presets.tokenizer(str(path)), f"the {path} preset's tokenizer"
        else:
            tok, where = _cached_hub_tokenizer(str(path)), f"the {path} tokenizer in the Hugging Face cache"
    if tok is None or not has_vocabulary(tok):
        return None, ""
    if getattr(tok, "pad_token", None) is None:
        tok.pad_token = getattr(tok, "eos_token", None) or getattr(tok, "unk_token", None)
    return (tok, where) if getattr(tok, "pad_token", None) is not None else (None, "")


def has_vocabulary(tok: Any) -> bool:
    """False for a tokenizer made of its special tokens alone. In transformers 5,
    ``AutoTokenizer.from_pretrained`` on a directory with a ``config.json`` but no tokenizer files
    builds one like that (BERT: 5 tokens), which reads every word as ``[UNK]``."""
    try:
        return len(tok) > len(set(getattr(tok, "all_special_ids", None) or [])) + 8
    except TypeError:  # no len(): judge it by what it does with text
        return understands_text(tok)


def understands_text(tok: Any) -> bool:
    """False for a tokenizer that maps most words of a built-in English sentence to its unknown token
    (no vocabulary, or one of another domain or language): calibration and the probe on the built-in
    sentences through it would be "real text" in name only."""
    try:
        ids = list(tok(passages(1, 0)[0])["input_ids"])
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode plain text
        return False
    unk = getattr(tok, "unk_token_id", None)
    framing = set(getattr(tok, "all_special_ids", None) or []) - {unk}
    words = [int(i) for i in ids if int(i) not in framing]
    return bool(words) and (unk is None or 2 * sum(i == unk for i in words) < len(words))


def _cached_hub_tokenizer(repo_id: str) -> Any | None:
    """The tokenizer of Hub repository ``repo_id`` if its files are in the local Hugging Face cache
    (a model loaded with ``from_pretrained(repo_id)`` usually brought them along), else None."""
    if repo_id.count("/") > 1 or repo_id.startswith((".", "/", "~")):
        return None  # a path that does not exist, not a repository id
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(repo_id, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached, not a repository id, or a tokenizer needing remote code
        return None


# ------------------------------------------------------------------------------ verification probe
PROBE_BATCH, PROBE_SEQ, PROBE_SEED, PROBE_MAX_TOKENS = 3, 13, 1, 24


@dataclass
class Probe:
    """The inputs verification runs the original and the converted model on, and what they are."""

    kwargs: dict[str, Any]
    source: str  # for the report: real text (and from which tokenizer) or random inputs (and why)
    text: bool = False  # True: built-in sentences tokenised with the model's tokenizer

    @property
    def attention_mask(self) -> torch.Tensor | None:
        """The padding mask the model was given (figures leave padding positions out), or None."""
        mask = self.kwargs.get("attention_mask")
        return mask if isinstance(mask, torch.Tensor) else None


GENERATED_IMAGES = "generated natural-looking images (smooth colour fields with fine texture)"


def generated_images(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Images with natural-image-like structure: low-frequency colour fields plus fine texture, at the
    scale of normalised pixel values. ``shape`` is ``(B, C, H, W)``, or ``(B, T, C, H, W)`` for video
    (T independent frames). White noise is no image: a vision model's activations on it (and so its
    error after conversion) are not what it shows on photographs; calibration and the verification
    probe both use these."""
    *lead, c, h, w = shape
    b = math.prod(lead)
    coarse = torch.randn(b, c, 4, 4, generator=gen, dtype=torch.float64)
    img = torch.nn.functional.interpolate(coarse, size=(h, w), mode="bilinear", align_corners=False)
    img = img + 0.25 * torch.randn(b, c, h, w, generator=gen, dtype=torch.float64)
    return img.reshape(shape).to(dtype)


def with_generated_media(kwargs: dict[str, Any], seed: int) -> dict[str, Any]:
    """``kwargs`` with random images and audio replaced by structured ones of the same shape and dtype:
    ``pixel_values`` by :func:`generated_images`, ``input_features`` by log-mel features of
    :func:`~normswap.inputs.speech.generated_speech`, ``input_values`` by that speech normalised per clip."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(kwargs)
    pixels = kwargs.get("pixel_values")
    if isinstance(pixels, torch.Tensor) and pixels.is_floating_point() and pixels.dim() >= 4:  # not patch rows
        out["pixel_values"] = generated_images(tuple(pixels.shape), gen, pixels.dtype).to(pixels.device)
    feats = kwargs.get("input_features")
    if isinstance(feats, torch.Tensor) and feats.is_floating_point() and feats.dim() == 3:
        batch, mels, frames = feats.shape
        waves = speech.generated_speech(batch, frames * 160, gen)
        out["input_features"] = speech.speech_features(waves, mels, frames).to(feats.device, feats.dtype)
    values = kwargs.get("input_values")
    if isinstance(values, torch.Tensor) and values.is_floating_point() and values.dim() == 2:
        waves = speech.generated_speech(*values.shape, gen)
        out["input_values"] = speech.normalised(waves).to(values.device, values.dtype)
    return out


def _random_source(kwargs: dict[str, Any]) -> str:
    kinds = {"input_ids": "random token ids drawn over the vocabulary", "pixel_values": GENERATED_IMAGES,
             "input_features": f"log-mel features of {speech.GENERATED_SPEECH}",
             "input_values": speech.GENERATED_SPEECH}
    return ", ".join(kinds[k] for k in kinds if k in kwargs)


def verification_probe(model: nn.Module, tokenizer: Any = None, *, batch: int = PROBE_BATCH,
                       seq: int = PROBE_SEQ, seed: int = PROBE_SEED,
                       max_tokens: int = PROBE_MAX_TOKENS, passage_offset: int = 0) -> Probe:
    """The unseen inputs ``patch`` verifies a transformers model on (never the analysis inputs).

    With a tokenizer (``tokenizer``, else :func:`find_tokenizer`) and a model that reads
    ``input_ids``: ``batch`` passages of 1-3 built-in English sentences (taken from the end of the
    calibration order, so never the ones the built-in calibration fits on), each tokenised as the
    tokenizer does (special tokens included), the rows cut at ``max_tokens``, 2/3 and 1/3 of it (so
    the batch needs padding), padded on the tokenizer's padding side with an ``attention_mask``.
    Decoder ids, where the model takes them, are the same text. A vision-language or omni prompt keeps
    its media: the span of image/audio placeholder tokens (with start/end tokens, token types and the
    like) the built inputs hold goes after each passage's first token, so every tower still runs.
    Images (a vision model's, or a text+image model's) are :func:`generated_images` and audio is generated speech
    (:func:`with_generated_media`), never white noise; other inputs stay as
    :func:`hf_example_inputs` builds them.
    Without a usable tokenizer: :func:`hf_example_inputs` with ``seed`` (other ids and another length
    than the analysis inputs), and ``source`` says why; a tokenizer that was given but cannot be
    used also warns. ``passage_offset`` skips that many passages first: ``normswap verify`` passes
    ``PROBE_BATCH`` so that it checks on passages (other sentences) that neither the conversion's probe
    nor its calibration used.
    """
    base = with_generated_media(hf_example_inputs(model, batch=batch, seq=seq, seed=seed), seed)
    if "input_ids" not in base:
        return Probe(base, _random_source(base))
    tok, where = (tokenizer, "the tokenizer passed in") if tokenizer is not None else _find_tokenizer(model)
    if tok is None:
        return Probe(base, _random_source(base) + " (no tokenizer given or found)")
    tok = getattr(tok, "tokenizer", tok)  # a processor's text tokenizer
    if not understands_text(tok):
        return Probe(base, f"{_random_source(base)} ({where} reads most built-in English words as unknown)")
    try:
        texts = passages(batch + passage_offset, 0, from_end=True)[passage_offset:]
        kwargs, lengths = _tokenised(model, tok, base, texts, max_tokens)
    except (NormswapError, TypeError, ValueError, KeyError, AttributeError) as exc:
        reason = first_line(exc, 160)
        if tokenizer is not None:
            warnings.warn(f"normswap: the tokenizer given cannot make the verification probe ({reason}); "
                          "verifying on random token ids", stacklevel=3)
        return Probe(base, f"{_random_source(base)} ({where} is unusable: {reason})")
    side = getattr(tok, "padding_side", "right")
    span = f"{min(lengths)}-{max(lengths)}" if min(lengths) != max(lengths) else str(lengths[0])
    padded = f", {side}-padded with an attention mask" if "attention_mask" in kwargs and min(lengths) != max(
        lengths) else ""
    media = media_token_ids(model.config)
    held = sorted({int(i) for i in kwargs["input_ids"][0].tolist() if int(i) in media}) if media else []
    kept = f" (each with the prompt's media span, ids {held}, after its first token)" if held else ""
    source = (f"built-in English text: {batch} passages tokenised with {where} ({type(tok).__name__}), "
              f"{span} tokens{kept}{padded}" + (f"; {GENERATED_IMAGES}" if "pixel_values" in kwargs else ""))
    return Probe(kwargs, source, text=True)


def text_with_media(model: nn.Module, tok: Any, base: dict[str, Any], texts: list[str],
                    max_tokens: int) -> dict[str, Any]:
    """``base`` (built inputs of a model that reads ``input_ids``) with its token ids replaced by ``texts``
    tokenised with ``tok``, one text per row, keeping the prompt's media span (see
    :func:`verification_probe`); raises ValueError (or the tokenizer's error) when the text cannot be
    used with this model."""
    return _tokenised(model, tok, base, texts, max_tokens)[0]


def _tokenised(model: nn.Module, tok: Any, base: dict[str, Any], texts: list[str],
               max_tokens: int) -> tuple[dict[str, Any], list[int]]:
    """``base`` with its token ids replaced by ``texts`` encoded with ``tok`` (padded by hand, so a
    tokenizer without a pad token is neither refused nor modified)."""
    config = model.config
    tcfg = _sub_config(config, "text")
    vocab = int(cfg(tcfg, "vocab_size", default=0))
    max_pos = cfg(tcfg, "max_position_embeddings", "n_positions", "max_target_positions", "n_ctx")
    limit = max(2, min(max_tokens, int(max_pos) - 2)) if max_pos else max_tokens
    span, at, side = _media_span(config, base)
    limit = max(2, limit - len(span)) if span else limit
    rows = []
    for i, text in enumerate(texts):  # cut at limit, 2/3 and 1/3 of it...: rows of different lengths
        cap = max(2, limit * (len(texts) - i) // len(texts))
        ids = tok(text, truncation=True, max_length=cap)["input_ids"]
        ids = [int(i) for i in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)][:cap]
        if not ids:
            raise ValueError("it returned no tokens")
        rows.append(ids)
    pad = next((int(i) for i in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None),
                                 getattr(tok, "unk_token_id", None)) if isinstance(i, int)), 0)
    top = max(max(r) for r in rows + [[pad]])
    if vocab and top >= vocab:
        raise ValueError(f"token id {top} is outside the model's vocabulary of {vocab}")
    text_rows = rows
    # the media span (placeholder tokens and their start/end) goes after the first token of each row
    cuts = [min(at, 1, len(r)) for r in rows]
    rows = [r[:c] + span + r[c:] for r, c in zip(rows, cuts, strict=True)]
    width = max(len(r) for r in rows)
    left = getattr(tok, "padding_side", "right") == "left"
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    out = dict(base)
    per_token = {k: torch.zeros((len(rows), width, *v.shape[2:]), dtype=v.dtype) + v[0, side[k]]
                 for k, v in base.items() if k in side}
    for i, r in enumerate(rows):
        cols = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, cols] = torch.tensor(r, dtype=torch.long)
        mask[i, cols] = 1
        first = cols.start + cuts[i]
        for k, t in per_token.items():  # the media positions' values (token types, latent places) move along
            t[i, first:first + len(span)] = base[k][0, at:at + len(span)]
    device = base["input_ids"].device
    params = inspect.signature(model.forward).parameters
    out.update({k: t.to(base[k].device) for k, t in per_token.items()})
    out["input_ids"] = ids.to(device)
    if "attention_mask" in params:
        out["attention_mask"] = mask.to(device)
    if "decoder_input_ids" in base:
        out["decoder_input_ids"] = ids.to(device)
        if "decoder_attention_mask" in params:
            out["decoder_attention_mask"] = mask.to(device)
    return out, [len(r) for r in text_rows]


def _media_span(config: Any, base: dict[str, Any]) -> tuple[list[int], int, dict[str, int]]:
    """Where the built inputs hold their media in the prompt, so tokenised text can keep it: the ids of
    the span (placeholder tokens with their start/end tokens, and the places Kosmos-2's latent queries
    take), where it starts, and for each other per-token input (``mm_token_type_ids``,
    ``image_embeds_position_mask``, ``image_attention_mask``, ...) a text position whose value the
    text tokens take. Empty when the prompt holds no media. The span must be one run, as the builder
    makes it; anything else is refused (ValueError), so the probe falls back to the built inputs."""
    ids = base.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return [], 0, {}
    row = ids[0].cpu()
    marked = torch.isin(row, torch.tensor(sorted(media_token_ids(config)) or [-1], dtype=row.dtype))
    side = [k for k, v in base.items() if isinstance(v, torch.Tensor) and v.dim() >= 2 and k not in (
        "input_ids", "attention_mask") and not k.endswith("input_ids") and tuple(v.shape[:2]) == tuple(ids.shape)]
    for k in side:  # a per-token input that marks positions (token types, latent places) marks media too
        values = base[k][0].reshape(ids.shape[1], -1).cpu()
        common = torch.mode(values[:, 0]).values
        marked |= (values != common).any(dim=1)
    if not bool(marked.any()):
        return [], 0, {}
    where = marked.nonzero().flatten()
    start, end = int(where[0]), int(where[-1]) + 1
    if end - start != where.numel():
        raise ValueError("the built prompt's media tokens are not one run")
    text_at = int((~marked).nonzero().flatten()[0]) if bool((~marked).any()) else 0
    return row[start:end].tolist(), start, {k: text_at for k in side}
