"""Where a model comes from: a preset name, a local directory, or a Hub id.

Every check that can fail on bad input runs here, *before* anything is loaded or written, and
fails with one actionable line: missing paths, Hub ids that are not in the Hugging Face cache
while offline (or with no network), truncated or corrupted safetensors, pickle-only checkpoints
(refused unless ``allow_pickle``), models that need ``trust_remote_code``, and checkpoints normswap already converted.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import logging
import os
import re
import socket
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn

from normswap import inputs, presets
from normswap.checkpoint import hf, io, module_io, stream_io
from normswap.errors import NormswapError, NothingToConvert, OptionRefused, first_line
from normswap.options import DTYPES, TASKS, choose

# when config.architectures names nothing transformers has, try these in order
FALLBACK_TASKS = ("causal-lm", "seq2seq-lm", "speech-seq2seq", "masked-lm", "image-classification", "base")
# options.DTYPES by name -> torch dtype
TORCH_DTYPES = {name: "auto" if name == "auto" else getattr(torch, name) for name in DTYPES}
ST_MODULES = "modules.json"  # marks a sentence-transformers directory
# what each layout's own pipeline reads of the model's outputs (sentence-transformers: the token
# embeddings, output 0); a tensor the checkpoint lacks that none of it depends on is left out
PIPELINE_READS = {"sentence-transformers": "last_hidden_state"}
log = logging.getLogger("normswap")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


@dataclass
class Source:
    """A resolved model source. ``path`` is a local directory except for presets."""

    spec: str
    kind: str  # preset | local | hub
    path: Path | None = None
    config: dict[str, Any] = field(default_factory=dict)
    safetensors: list[Path] = field(default_factory=list)
    pickles: list[Path] = field(default_factory=list)
    # "sentence-transformers" when the directory has a modules.json (its weights are the base model)
    layout: str = "hf"
    # parameters of a task head the checkpoint does not hold, initialised at random (allow_new_head)
    new_head: list[str] = field(default_factory=list)
    # modules the checkpoint has no tensors for and the layout's pipeline never uses (a BERT pooler
    # in a sentence-transformers directory): dropped from the model, recorded in the manifest
    left_out: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        files = self.safetensors or self.pickles
        return sum(f.stat().st_size for f in files)

    @property
    def label(self) -> str:
        return f"preset {self.spec}" if self.kind == "preset" else self.spec


def _looks_like_path(spec: str) -> bool:
    """Hub ids are ``name`` or ``org/name``; anything else path-like is a (missing) local path."""
    return (
        spec.startswith((".", "/", "~"))
        or spec.count("/") > 1
        or "\\" in spec
        or spec.endswith(("/", ".json", ".safetensors", ".bin", ".pt", ".pth"))
    )


def is_hub_id(spec: str) -> bool:
    """``name`` or ``org/name`` that is not a local path: what transformers would look up on the Hub."""
    return not _looks_like_path(spec) and bool(_HUB_ID.match(spec))


def hub_reachable(timeout: float = 3.0) -> bool:
    """Can we open a TCP connection to the Hub endpoint within ``timeout`` seconds?"""
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _offline() -> bool:
    return any(
        os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


# what a conversion reads of a Hub repository (the weights, configs, tokenizer and processor files)
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


def hub_cache_dir() -> str:
    """The Hugging Face cache that Hub ids resolve in: huggingface_hub's own (``HF_HUB_CACHE``, else
    ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``), the one transformers reads."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def cached_snapshot(spec: str, revision: str | None = None) -> Path | None:
    """The local snapshot of Hub repository ``spec`` at ``revision`` (branch, tag or commit; default
    ``main``) in the Hugging Face cache, resolved by huggingface_hub exactly as transformers resolves
    it offline (``refs/<revision>`` -> ``snapshots/<commit>/``, files symlinked into ``blobs/``);
    ``None`` when it is not there. No network call."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(spec, revision=revision, allow_patterns=HUB_PATTERNS, local_files_only=True))
    except LocalEntryNotFoundError as exc:
        # a snapshot the cached file listing says lacks some files (only part of the repository was ever
        # fetched, as from_pretrained does): still the one transformers would load; the files a
        # conversion needs are checked next (inspect_dir), by name
        partial = getattr(exc, "snapshot_path", None)
        return Path(partial) if partial else None
    except (ValueError, OSError) as exc:  # an id huggingface_hub refuses, an unreadable cache
        log.debug("normswap: no cached snapshot of %s: %s", spec, exc)
        return None


def hub_snapshot(spec: str, *, revision: str | None, allow_pickle: bool, trust_remote_code: bool) -> Path:
    """A local directory with Hub repository ``spec`` at ``revision``.

    Offline (``HF_HUB_OFFLINE``) or with the Hub unreachable, the snapshot in the Hugging Face cache
    (:func:`cached_snapshot`), as transformers loads it there; an id that is not cached is refused,
    naming the cache searched. Online, the files a conversion reads are downloaded into that cache.
    """
    hint = f"{spec!r} is not a local directory or a preset ({', '.join(presets.names())})"
    at = f" at revision {revision!r}" if revision else ""
    offline = _offline()
    if offline or not hub_reachable():
        local = cached_snapshot(spec, revision)
        if local is not None:
            log.info("normswap: %s%s from the Hugging Face cache (%s)", spec, at, local)
            return local
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub is unreachable (no network?)"
        raise NormswapError(
            f"{hint}, {why}, and it is not in the Hugging Face cache{at} (searched {hub_cache_dir()}; "
            "set HF_HOME or HF_HUB_CACHE to use another): download it first "
            f"(`hf download {spec}{f' --revision {revision}' if revision else ''} --local-dir DIR`) and pass "
            "the directory"
        )
    try:
        from huggingface_hub import list_repo_files, snapshot_download

        files = list_repo_files(spec, revision=revision)
        patterns = list(HUB_PATTERNS)
        if allow_pickle and not any(f.endswith(".safetensors") for f in files):
            patterns += ["*.bin"]
        if trust_remote_code:
            patterns += ["*.py"]
        return Path(snapshot_download(spec, revision=revision, allow_patterns=patterns))
    except Exception as exc:  # noqa: BLE001 - hub errors are many; report one line
        raise NormswapError(f"cannot download {spec!r}{at} from the Hub: {first_line(exc, 200)}") from exc


def inspect_dir(
    path: Path, spec: str, *, allow_pickle: bool, trust_remote_code: bool, allow_converted: bool = False
) -> Source:
    """Validate a local model directory without loading it."""
    if path.is_file():
        raise NormswapError(f"{spec} is a file; pass the model directory that contains config.json")
    cfg_path = path / "config.json"
    if not cfg_path.is_file() and module_io.is_module_dir(path):
        raise NormswapError(
            f"{spec} is a custom module normswap.save wrote (converted already; no config.json): load it in "
            "Python into a fresh instance of its class, normswap.load(dir, model=YourClass(...))")
    if not cfg_path.is_file():
        raise NormswapError(
            f"{spec} has no config.json; pass a Hugging Face model directory "
            "(save_pretrained output) or a preset name"
        )
    try:
        config = json.loads(cfg_path.read_text())
    except (ValueError, OSError) as exc:
        raise NormswapError(f"{cfg_path} is not valid JSON ({exc}); the file is corrupted") from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise NormswapError(f"{cfg_path} has no model_type; is it a transformers config?")
    model_type = config["model_type"]
    if hf.base_type(model_type) is not None and not allow_converted:
        raise NothingToConvert(f"{spec} was already converted by normswap ({model_type}); nothing to do")
    manifest = config.get(hf.MANIFEST_KEY)
    if isinstance(manifest, dict) and manifest.get("format") == "compat" and not allow_converted:
        raise NothingToConvert(
            f"{spec}: already converted (compat); use it as is (any runtime may swap "
            "its rms_ready LayerNorms for RMSNorm)"
        )
    safe, pickles = io.weight_files(path)
    for f in safe:
        io.read_safetensors_header(f)
    if not safe:
        if not pickles:
            raise NormswapError(f"{spec} contains no weights (*.safetensors); the download is incomplete")
        if not allow_pickle:
            raise OptionRefused(
                f"{spec} has only pickle weights ({pickles[0].name}); loading them can run "
                "arbitrary code. Convert to safetensors first, or pass --allow-pickle if you "
                "trust the source"
            )
    needs_code = "auto_map" in config and hf.base_type(model_type) is None
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if (needs_code or model_type not in CONFIG_MAPPING) and not trust_remote_code:
        if needs_code:
            raise OptionRefused(
                f"{spec} uses custom modeling code (auto_map in config.json); pass "
                "--trust-remote-code if you trust it"
            )
        raise NormswapError(
            f"{spec} has model_type {model_type!r}, which transformers "
            f"{_tf_version()} does not know; upgrade transformers"
        )
    layout = "sentence-transformers" if (path / ST_MODULES).is_file() else "hf"
    return Source(spec, "local", path, config, safe, pickles, layout=layout)


def _tf_version() -> str:
    import transformers

    return transformers.__version__


def resolve(
    spec: str,
    *,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    allow_converted: bool = False,
    revision: str | None = None,
) -> Source:
    """Preset name, local directory or Hub id -> :class:`Source`.

    A Hub id resolves as transformers resolves it: downloaded into the Hugging Face cache when the Hub
    is reachable, read from that cache when offline or unreachable (:func:`hub_snapshot`).
    ``revision`` (branch, tag or commit) applies to Hub ids only.
    """
    spec = str(spec)
    if revision is not None and (presets.is_preset(spec) or Path(spec).expanduser().exists()):
        what = "preset" if presets.is_preset(spec) else "local path"
        raise NormswapError(f"--revision applies to a Hub id; {spec} is a {what}")
    if presets.is_preset(spec):
        return Source(spec, "preset", None, {"model_type": presets.get(spec).config(8).model_type})
    path = Path(spec).expanduser()
    if path.exists():
        return inspect_dir(
            path,
            spec,
            allow_pickle=allow_pickle,
            trust_remote_code=trust_remote_code,
            allow_converted=allow_converted,
        )
    near = difflib.get_close_matches(spec, presets.names(), n=1, cutoff=0.8) if spec.startswith("tiny-") else []
    if not is_hub_id(spec) or ("/" not in spec and spec.startswith("tiny-")):  # a misspelt preset: no Hub wait
        hint = f"did you mean {near[0]}? " if near else ""
        raise NormswapError(
            f"{spec} does not exist (not a directory, a preset or a Hub id); {hint}"
            f"presets: {', '.join(presets.names())}"
        )
    local = hub_snapshot(spec, revision=revision, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    src = inspect_dir(
        local,
        spec,
        allow_pickle=allow_pickle,
        trust_remote_code=trust_remote_code,
        allow_converted=allow_converted,
    )
    src.kind = "hub"
    return src


# ------------------------------------------------------------------------------------ fingerprint
_SAMPLE = 1 << 14  # bytes of each tensor hashed at each of three places (the whole tensor when smaller)
FINGERPRINT_SCHEME = "tensors-sha256:"  # weights-only fingerprints; older manifests hold "sha256:" (by file)
_VOLATILE = ("_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype", "auto_map")
_LEGACY_SAMPLE = 1 << 16


def _windows(nbytes: int) -> list[tuple[int, int]]:
    """(offset, length) of the bytes of an ``nbytes`` tensor that its digest covers."""
    if nbytes <= 3 * _SAMPLE:
        return [(0, nbytes)]
    return [(0, _SAMPLE), (nbytes // 2 - _SAMPLE // 2, _SAMPLE), (nbytes - _SAMPLE, _SAMPLE)]


def _tensor_digest(dtype: str, shape: list[int] | tuple[int, ...], windows: list[bytes]) -> str:
    """sha256 of a tensor's safetensors dtype name, shape and sampled bytes (:func:`_windows`)."""
    h = hashlib.sha256(f"{dtype}{list(shape)}".encode())
    for chunk in windows:
        h.update(chunk)
    return h.hexdigest()


def _digests_of_files(files: list[Path]) -> set[str]:
    out = set()
    for f in files:
        header = io.read_safetensors_header(f)
        with open(f, "rb") as fh:
            base = 8 + int.from_bytes(fh.read(8), "little")
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                chunks = []
                for at, length in _windows(end - begin):
                    fh.seek(base + begin + at)
                    chunks.append(fh.read(length))
                out.add(_tensor_digest(info["dtype"], info["shape"], chunks))
    return out


def _digests_of_tensors(tensors: Any) -> set[str]:
    out = set()
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        chunks = [raw[at:at + length].numpy().tobytes() for at, length in _windows(raw.numel())]
        out.add(_tensor_digest(stream_io.ST_DTYPES.get(t.dtype, str(t.dtype)), tuple(t.shape), chunks))
    return out


def fingerprint(src: Source) -> str:
    """What the source's weights are, recorded in the manifest and checked by ``verify``.

    A hash of the set of its tensors, each by dtype, shape and bytes (the whole tensor up to 48 KB,
    else 16 KB at its start, middle and end), whatever holds them: a preset, the same preset saved
    to a directory, one file or shards of any size, safetensors or a pickle, tied weights stored
    once or twice, any key names. A fine-tune differs in the bytes, another model in the shapes.
    Reads about 48 KB per tensor, whatever the checkpoint size.
    """
    if src.kind == "preset":
        digests = _digests_of_tensors(presets.build_model(src.spec).state_dict().values())
    elif src.safetensors:
        digests = _digests_of_files(src.safetensors)
    else:  # pickles (allow_pickle was given to resolve them): their tensors, without running code
        digests = set()
        for f in src.pickles:
            try:
                try:
                    state = torch.load(f, map_location="cpu", weights_only=True, mmap=True)
                except RuntimeError:  # the pre-zip format cannot be mapped: read it
                    state = torch.load(f, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - a corrupt pickle
                raise io.damaged(f, f"cannot be read as a PyTorch state dict ({first_line(exc, 200)})") from exc
            digests |= _digests_of_tensors(state.values() if isinstance(state, dict) else [])
    h = hashlib.sha256("\n".join(sorted(digests)).encode())
    return FINGERPRINT_SCHEME + h.hexdigest()[:32]


def legacy_fingerprint(src: Source) -> str:
    """The fingerprint manifests written before :data:`FINGERPRINT_SCHEME` hold (``sha256:...``): the
    config, and 64 KB of each shard's bytes at three places; presets hashed their name. Kept so that
    ``verify`` still recognises the source of a checkpoint converted then."""
    h = hashlib.sha256()
    if src.kind == "preset":
        h.update(f"preset:{src.spec}".encode())
        return "sha256:" + h.hexdigest()[:32]
    cfg = {k: v for k, v in src.config.items() if k not in _VOLATILE and k != hf.MANIFEST_KEY}
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for f in src.safetensors or src.pickles:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            for at in (0, max(0, size // 2 - _LEGACY_SAMPLE // 2), max(0, size - _LEGACY_SAMPLE)):
                fh.seek(at)
                h.update(fh.read(_LEGACY_SAMPLE))
        h.update(str(size).encode())
    return "sha256:" + h.hexdigest()[:32]


def same_source(recorded: str, src: Source) -> bool:
    """Whether a manifest's ``source_fingerprint`` names ``src``'s weights (either scheme)."""
    if recorded.startswith(FINGERPRINT_SCHEME):
        return recorded == fingerprint(src)
    return recorded == legacy_fingerprint(src)


def record(src: Source) -> dict[str, Any]:
    """Manifest entries about the source: its fingerprint, layout and any head not from it."""
    extra: dict[str, Any] = {"source_fingerprint": fingerprint(src)}
    if src.layout != "hf":
        extra["source_layout"] = src.layout
    if src.new_head:
        extra["new_head"] = list(src.new_head)
    if src.left_out:
        extra[LEFT_OUT_KEY] = list(src.left_out)
    return extra


# ------------------------------------------------------------------------------------ model classes
def _auto(name: str) -> Any:
    import transformers

    return getattr(transformers, name)


def model_class(config: Any, task: str | None = None, architectures: list[str] | None = None) -> type:
    """The class to load: ``task``'s AutoModel class, else ``config.architectures``, else a fallback."""
    import transformers

    if task is not None:
        choose("task", task, TASKS)
        mapping = _auto(TASKS[task])._model_mapping
        if type(config) not in mapping:
            raise NormswapError(f"task {task!r} is not available for model_type {config.model_type!r}")
        return hf.one_class(mapping[type(config)], getattr(config, "architectures", None))
    for name in architectures or getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            return cls
    for t in FALLBACK_TASKS:
        mapping = _auto(TASKS[t])._model_mapping
        if type(config) in mapping:
            return hf.one_class(mapping[type(config)], getattr(config, "architectures", None))
    raise OptionRefused(f"no transformers model class for model_type {config.model_type!r}; pass --task")


def torch_dtype(name: str) -> Any:
    return TORCH_DTYPES[choose("dtype", name, DTYPES)]


def load_model(
    src: Source,
    *,
    task: str | None = None,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    allow_new_head: bool = False,
) -> tuple[nn.Module, Any]:
    """Load the source model (eval mode) and its tokenizer/processor (or ``None``).

    Every parameter must come from the checkpoint (see :func:`check_loading_info`); with
    ``allow_new_head`` a task head missing from it is initialised and listed in ``src.new_head``. A
    ``config.json`` that does not fit the weights is refused first (:func:`check_config_fits`), for
    ``inspect`` and ``verify`` as for ``convert``.
    """
    want = torch_dtype(dtype)
    if src.kind == "preset":
        model, proc = presets.build(src.spec, dtype=torch.float32 if want == "auto" else want)
        if task is not None:
            cls = model_class(model.config, task)
            if not isinstance(model, cls):
                model = preset_as(src, model, cls, allow_new_head=allow_new_head)
        seed_new_head(model, src.new_head)
        return model, proc
    from transformers import AutoConfig

    assert src.path is not None
    check_config_fits(src, task, trust_remote_code=trust_remote_code)  # before the claimed model is built
    try:
        config = AutoConfig.from_pretrained(
            src.path, trust_remote_code=trust_remote_code, local_files_only=True
        )
    except Exception as exc:  # noqa: BLE001
        raise NormswapError(f"cannot read the config of {src.spec}: {first_line(exc)}") from exc
    if trust_remote_code and "auto_map" in src.config and task is not None and TASKS[task] in src.config["auto_map"]:
        cls = _auto(TASKS[task])  # the custom code's own class for the task (round 59: as --low-memory builds it)
    elif trust_remote_code and "auto_map" in src.config and task is None:
        auto_map = src.config["auto_map"]
        name = next(
            (
                n
                for n in (
                    "AutoModelForCausalLM",
                    "AutoModelForSeq2SeqLM",
                    "AutoModelForMaskedLM",
                    "AutoModel",
                )
                if n in auto_map
            ),
            None,
        )
        cls = _auto(name) if name else model_class(config, None)
    else:
        cls = source_class(src, config, task)
    # mismatched shapes are reported by us, by name (check_loading_info), not by a transformers raise
    kwargs: dict[str, Any] = {
        "dtype": want,
        "local_files_only": True,
        "output_loading_info": True,
        "ignore_mismatched_sizes": True,
    }
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    if not src.safetensors:
        kwargs["use_safetensors"] = False
    try:
        model, info = cls.from_pretrained(src.path, **kwargs)
    except NormswapError:
        raise
    except Exception as exc:  # noqa: BLE001 - report, don't dump a traceback
        raise NormswapError(f"cannot load {src.spec} as {cls.__name__}: {first_line(exc)}") from exc
    missing = list(info.get("missing_keys") or ())
    if missing and src.layout in PIPELINE_READS:
        src.left_out, missing = leave_out_unused(model, missing, PIPELINE_READS[src.layout])
        info = dict(info, missing_keys=missing)
    src.new_head = check_loading_info(
        src, model, info, explicit_task=task is not None, allow_new_head=allow_new_head,
        saved_class=checkpoint_class(src, config) if task is not None else None,
    )
    seed_new_head(model, src.new_head)
    model.eval()
    return model, load_processor(src.path, trust_remote_code=trust_remote_code)


# ------------------------------------------------------------------------------------ config vs weights
CHECK_DEPTH = 2  # layers per stack of the meta copy the early shape check builds


def _layer_stacks(cls: type, config: Any) -> dict[str, int]:
    """``{stack path: layers the config claims}`` for every layer stack of ``cls(config)``, found on
    meta copies at depth :data:`CHECK_DEPTH` with one layer count raised by one at a time (which stack
    grows tells which count it follows: an encoder-decoder has two)."""
    from normswap.checkpoint import proxy

    counts = proxy.layer_attrs(config)
    base = proxy.reduced_config(config, CHECK_DEPTH)
    with torch.device("meta"):
        before = proxy.stacks_of(cls(copy.deepcopy(base)))
    stacks: dict[str, int] = {}
    for attr, n in counts.items():
        if n <= CHECK_DEPTH:
            continue
        grown = copy.deepcopy(base)
        try:
            setattr(grown, attr, CHECK_DEPTH + 1)
            with torch.device("meta"):
                after = proxy.stacks_of(cls(grown))
        except Exception:  # noqa: BLE001 - per-layer lists this count must match: leave its depth to the loader
            continue
        stacks.update({path: n for path, k in after.items() if before.get(path) == CHECK_DEPTH and k > CHECK_DEPTH})
    return stacks


def check_config_fits(src: Source, task: str | None = None, *, trust_remote_code: bool = False) -> None:
    """Refuse, before anything is built or loaded, a checkpoint whose ``config.json`` does not fit its
    weights (a config of another model size beside them): the config's model is built on the meta device
    at two layers per stack (no memory, well under a second at any claimed size) and its tensor shapes
    compared with the safetensors headers (no tensor read), and every layer stack's last layer the config
    claims must be in the files. Otherwise the in-memory path built the whole claimed model first (a
    GPT-3-sized config: an allocator error) and ``--low-memory`` sized its proxies by it. Whatever this
    cannot judge (a class it cannot build, names transformers renames on load) is left to the loader's
    own check (:func:`check_loading_info`)."""
    if src.kind == "preset" or not src.safetensors or src.path is None:
        return
    from transformers import AutoConfig

    from normswap.checkpoint import proxy

    try:
        config = AutoConfig.from_pretrained(src.path, trust_remote_code=trust_remote_code, local_files_only=True)
        cls = source_class(src, config, task)
        stacks = _layer_stacks(cls, config)
        with torch.device("meta"):
            small = cls(copy.deepcopy(proxy.reduced_config(config, CHECK_DEPTH)))
    except Exception:  # noqa: BLE001 - the loader reports what it cannot build, in its own words
        return
    shapes = {k: tuple(e.shape) for k, e in stream_io.scan(src.safetensors).items()}
    prefix = f"{getattr(small, 'base_model_prefix', '') or ''}."

    def stored(name: str) -> str | None:  # the checkpoint's name for a model name (base-model prefix or not)
        for key in (name, prefix + name, name.removeprefix(prefix)):
            if key in shapes:
                return key
        return None

    wrong = []
    for name, t in small.state_dict().items():
        key = stored(name)
        if key is not None and shapes[key] != tuple(t.shape):
            wrong.append(f"`{key}` is {list(shapes[key])} in the weights, {list(t.shape)} by the config")
    if wrong:
        more = f" (and {len(wrong) - 2} more)" if len(wrong) > 2 else ""
        raise NormswapError(f"{src.spec}: config.json does not match the weights: {'; '.join(wrong[:2])}{more}; "
                            "the checkpoint does not match its config.json (a config of another model size?)")
    for path, n in stacks.items():
        names = (path, path.removeprefix(prefix), prefix + path)
        layer = re.compile("(?:" + "|".join(map(re.escape, names)) + r")\.(\d+)\.")
        held = {int(m.group(1)) for k in shapes if (m := layer.match(k))}
        if held and max(held) + 1 != n:
            raise NormswapError(f"{src.spec}: config.json does not match the weights: it builds {n} layers in "
                                f"`{path}`, the weights hold {max(held) + 1}; the checkpoint does not match its "
                                "config.json (a config of another model size?)")


def checkpoint_class(src: Source, config: Any) -> type | None:
    """The transformers class the checkpoint was saved from (``config.architectures``), when it is one
    transformers has for this config; ``None`` otherwise (custom code, no architectures)."""
    import transformers

    for name in src.config.get("architectures") or []:
        cls = getattr(transformers, str(name), None)
        if isinstance(cls, type) and issubclass(cls, nn.Module) and getattr(cls, "config_class", None) is type(config):
            return cls
    return None


def preset_as(src: Source, model: nn.Module, cls: type, *, allow_new_head: bool) -> nn.Module:
    """The preset ``model`` loaded as another class of its base model (``--task`` on a preset), the way
    ``cls.from_pretrained`` loads a saved directory: the base model's weights carried over, a head the
    preset lacks initialised at random (only with ``allow_new_head``, as for a directory), and every
    missing or unused tensor judged by :func:`check_loading_info`."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="normswap-preset-") as tmp:
        model.save_pretrained(tmp)
        try:
            loaded, info = cls.from_pretrained(
                tmp, dtype=next(model.parameters()).dtype, local_files_only=True, output_loading_info=True
            )
        except Exception as exc:  # noqa: BLE001 - report, don't dump a traceback
            raise NormswapError(f"cannot load preset {src.spec} as {cls.__name__}: {first_line(exc)}") from exc
        # nothing may keep reading the temporary files once they are gone
        for t in list(loaded.parameters()) + list(loaded.buffers()):
            t.data = t.data.clone()
    loaded.config.name_or_path = src.spec  # the preset's tokenizer is found by name (inputs.find_tokenizer)
    src.new_head = check_loading_info(
        src, loaded, info, explicit_task=True, allow_new_head=allow_new_head, saved_class=type(model)
    )
    return loaded.eval()


def remote_code_class(src: Source, task: str | None) -> type | None:
    """The custom modeling code's class for ``task`` (``None``: the first of causal-LM, seq2seq-LM, masked-LM and
    the bare model its ``auto_map`` names, as :func:`load_model` picks with ``trust_remote_code``), imported from
    the checkpoint directory; ``None`` without an ``auto_map`` entry for it. The streamed path builds it on the
    meta device, as the in-memory path loads it."""
    auto_map = src.config.get("auto_map")
    if not isinstance(auto_map, dict) or src.path is None:
        return None
    names = ([TASKS[task]] if task is not None else
             ["AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM", "AutoModel"])
    name = next((n for n in names if n in auto_map), None)
    if name is None:
        return None
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    ref = auto_map[name][0] if isinstance(auto_map[name], (list, tuple)) else auto_map[name]
    try:
        return get_class_from_dynamic_module(ref, str(src.path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - the user's code: one line
        raise NormswapError(f"cannot import the custom modeling code of {src.spec} ({ref}): {first_line(exc)}") \
            from exc


def source_class(src: Source, config: Any, task: str | None) -> type:
    """:func:`model_class`, except that a sentence-transformers directory loads its base model.

    Such directories name a masked-LM (or similar) class in ``config.json`` while their weights
    hold only the encoder; building the named class would give a randomly initialised head.
    """
    if task is None and src.layout == "sentence-transformers":
        task = "base"
    if task is None and not getattr(config, "architectures", None) and src.safetensors:
        return _class_holding(config, set(stream_io.scan(src.safetensors))) or model_class(config, None)
    return model_class(config, task)


def _class_holding(config: Any, names: set[str]) -> type | None:
    """For a config that names no architecture: the first fallback task's class that has a place for
    every tensor of the checkpoint (names compared without the base-model prefix, as transformers
    loads them), or ``None``. Without it, a Whisper directory whose config lacks ``architectures``
    was built as ``WhisperForCausalLM`` and its encoder tensors refused."""
    seen: set[type] = set()
    for t in FALLBACK_TASKS:
        mapping = _auto(TASKS[t])._model_mapping
        cls = hf.one_class(mapping[type(config)]) if type(config) in mapping else None
        if cls is None or cls in seen:
            continue
        seen.add(cls)
        with torch.device("meta"):
            try:
                model = cls(copy.deepcopy(config))
            except Exception:  # noqa: BLE001 - a class this config cannot build is no candidate
                continue
        prefix = f"{getattr(cls, 'base_model_prefix', '')}."
        expected = {k.removeprefix(prefix) for k in model.state_dict()}
        if all(n.removeprefix(prefix) in expected for n in names):
            return cls
    return None


def names(keys: Any, limit: int = 4) -> str:
    keys = sorted(keys)
    more = f" (+{len(keys) - limit} more)" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


LEFT_OUT_KEY = hf.LEFT_OUT_KEY


def _droppable(model: nn.Module, missing: set[str]) -> dict[str, list[str]]:
    """Missing tensor names grouped by the outermost module all of whose tensors are missing (the
    unit that can be left out); a tensor whose module also holds loaded ones has no such group."""
    owned: dict[str, list[str]] = {}
    for path, module in model.named_modules():
        if not path:
            continue
        names = [f"{path}.{k}" for k in module.state_dict()]
        if names and all(n in missing for n in names) and not any(p in owned for p in _parents(path)):
            owned[path] = names
    return owned


def _parents(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _pipeline_output(model: nn.Module, probe: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        out = model(**probe)
    return out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))


def leave_out_unused(model: nn.Module, missing: list[str], reads: str) -> tuple[list[str], list[str]]:
    """Split tensors the checkpoint lacks into modules the pipeline never uses and tensors it needs.

    A pipeline that reads only the model's first output (``reads``; sentence-transformers' token
    embeddings) never uses a pooler computed from it, and checkpoints often ship without one (ONNX
    exports, ``add_pooling_layer=False``). Whether a missing tensor feeds that output is tested, not
    assumed from its name: every missing module is filled with NaN and the output must stay finite
    (one forward pass on random inputs; module by module when it does not). Unused ones are set to
    ``None`` in ``model`` (the output must then be unchanged, else they stay); returns their paths
    and the missing tensor names left over, which stay an error.
    """
    groups = _droppable(model, set(missing))
    if not groups:
        return [], missing
    probe = inputs.hf_example_inputs(model, batch=2, seq=8, seed=977)
    tensors = dict(model.state_dict(keep_vars=True))

    def finite_with_nan(paths: list[str]) -> bool:
        saved = {n: tensors[n].detach().clone() for p in paths for n in groups[p]}
        with torch.no_grad():
            for n in saved:
                if tensors[n].is_floating_point():
                    tensors[n].fill_(float("nan"))
            try:
                return bool(torch.isfinite(_pipeline_output(model, probe)).all())
            finally:
                for n, v in saved.items():
                    tensors[n].copy_(v)

    every = sorted(groups)
    unused = every if finite_with_nan(every) else [p for p in every if finite_with_nan([p])]
    if not unused:
        return [], missing
    before = _pipeline_output(model, probe)
    dropped = hf.drop_modules(model, unused)
    try:
        same = torch.equal(_pipeline_output(model, probe), before)
    except Exception:  # noqa: BLE001 - a model that cannot run without the module keeps it
        same = False
    if not same:
        for parent, name, module in dropped:
            setattr(parent, name, module)
        return [], missing
    gone = {n for p in unused for n in groups[p]}
    log.info("left out %s: not in the checkpoint, not used for %s", names(unused), reads)
    return unused, [k for k in missing if k not in gone]


def new_parts(model: nn.Module, saved_class: type, config: Any, missing: set[str]) -> set[str]:
    """The ``missing`` tensors of ``model`` that ``saved_class`` (the class the checkpoint was saved from)
    does not have at all: a head, or a part its base model leaves out (``BertForMaskedLM`` has no pooler,
    ``BertModel`` has one). transformers initialises them at random with its "newly initialized"
    warning; every other missing tensor is one the checkpoint should hold (an incomplete download).
    Keys are moved between the two classes by transformers' own prefix rule (:class:`rebase.PathMap`)."""
    from normswap.checkpoint.rebase import PathMap

    with torch.device("meta"):
        try:
            saved = saved_class(copy.deepcopy(config))
        except Exception:  # noqa: BLE001 - a class this config cannot build: judge nothing as new
            return set()
    pmap = PathMap(model)
    held = {pmap(k) for k in saved.state_dict()}
    return {k for k in missing if k not in held}


NEW_HEAD_SEED = 0  # the seed of a new task head (--new-head), the same on both conversion paths


def init_new_head(model: nn.Module, names: list[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Values for the new task head's parameters ``names`` (``--new-head``), in ``dtype``, the same whether
    ``model`` is loaded (the in-memory path) or on the meta device (the streamed path, which never holds the
    model): each module owning one, in name order, is copied onto the CPU empty and initialised by the model's own
    ``_init_weights`` (transformers' rule for that head: normal weights, zero biases, ...) from
    :data:`NEW_HEAD_SEED`, in a forked RNG (the caller's random state is left as it was). Before round 59 the
    in-memory head took whatever transformers drew from the process's random state at load time, so no other
    run, streamed or not, could write the same head."""
    owners = sorted({n.rpartition(".")[0] for n in names})
    out: dict[str, torch.Tensor] = {}
    init = getattr(model, "_init_weights", None)
    with torch.random.fork_rng(devices=[]):
        for path in owners:
            # one seed per module, so that a module's values do not depend on which others are new (a tied
            # alias, such as BERT's decoder.bias, is listed on one path and not on the other)
            torch.manual_seed(NEW_HEAD_SEED + zlib.crc32(path.encode()))
            fresh = copy.deepcopy(model.get_submodule(path)).to_empty(device="cpu")
            fresh = fresh.to(dtype) if dtype.is_floating_point else fresh
            for m in fresh.modules():  # transformers skips what it marked initialised (the loaded copy's marks)
                for t in [m, *m.parameters(recurse=False), *m.buffers(recurse=False)]:
                    if "_is_hf_initialized" in vars(t):
                        delattr(t, "_is_hf_initialized")
            if callable(init):
                init(fresh)
            else:  # not a transformers model: the module's own reset
                fresh.reset_parameters()
            for n in names:
                owner, _, leaf = n.rpartition(".")
                if owner == path:
                    out[n] = getattr(fresh, leaf).detach().clone()
    # aliases (one tensor under two names) hold one value: the first name's
    groups: dict[int, list[str]] = {}
    for n, t in model.state_dict(keep_vars=True).items():
        if n in out:
            groups.setdefault(id(t), []).append(n)
    for group in groups.values():
        for n in sorted(group)[1:]:
            out[n] = out[sorted(group)[0]]
    return out


def seed_new_head(model: nn.Module, names: list[str]) -> None:
    """Set the new task head's parameters ``names`` (loaded model, ``--new-head``) to :func:`init_new_head`'s
    values, which the streamed path writes too."""
    if not names:
        return
    state = model.state_dict(keep_vars=True)
    values = init_new_head(model, names, state[names[0]].dtype)
    with torch.no_grad():
        for name, value in values.items():
            state[name].copy_(value)


def check_loading_info(
    src: Source, model: nn.Module, info: dict[str, Any], *, explicit_task: bool, allow_new_head: bool,
    saved_class: type | None = None,
) -> list[str]:
    """Refuse a load that did not fill every parameter from the checkpoint.

    transformers initialises missing tensors at random and drops unexpected ones with only a log
    line; converting such a model would "verify" a random model against itself. Missing or
    mismatched tensors are errors. The one exception is a new head the user asked for on purpose
    (``allow_new_head``, with ``--task``): tensors of parts the checkpoint's own class
    (``saved_class``) does not have (a task head, or a pooler a masked-LM checkpoint never had),
    or, when that class is unknown, missing tensors outside the base model. Their names are
    returned so the manifest can record them. Unexpected tensors are errors unless ``--task``
    picked a class without the checkpoint's head (e.g. ``base`` on a masked-LM checkpoint).
    """
    missing = set(info.get("missing_keys") or ())
    unexpected = set(info.get("unexpected_keys") or ())
    mismatched = [k[0] if isinstance(k, (tuple, list)) else k for k in info.get("mismatched_keys") or ()]
    if mismatched:
        raise NormswapError(
            f"{src.spec}: tensor shape(s) do not match the config for {names(mismatched)}; "
            "the checkpoint does not match its config.json"
        )
    if saved_class is not None and missing and type(model) is not saved_class:
        head = new_parts(model, saved_class, model.config, missing)
        in_base = missing - head
    else:
        prefix = getattr(model, "base_model_prefix", "") or ""
        base = getattr(model, prefix, None) if prefix else None
        if base is None or base is model:  # a base model: everything missing is the body
            in_base = set(missing)
        else:
            in_base = {k for k in missing if k.startswith(prefix + ".")}
        head = missing - in_base
    if missing and not (allow_new_head and explicit_task and not in_base):
        if head and not in_base and saved_class is not None:
            raise OptionRefused(
                f"{src.spec} as {type(model).__name__}: the checkpoint ({saved_class.__name__}) has no "
                f"{names(head)}, which {type(model).__name__} adds; pass --new-head with --task to "
                "initialise them at random (as transformers does), then train them"
            )
        what = "the head" if head and not in_base else "tensor(s)"
        needed = (
            f", which the {src.layout} pipeline needs (they feed its {PIPELINE_READS[src.layout]})"
            if src.layout in PIPELINE_READS
            else ""
        )
        hint = (
            "; to add a new, randomly initialised task head on purpose pass --new-head with --task"
            if head and not in_base
            else f"{needed}; the download is incomplete or the files do not belong together"
        )
        raise NormswapError(
            f"{src.spec} as {type(model).__name__}: the checkpoint has no {what} "
            f"{names(in_base if in_base and saved_class is not None else missing)}{hint}"
        )
    if unexpected and not explicit_task:
        raise OptionRefused(
            f"{src.spec}: the checkpoint has tensor(s) {type(model).__name__} does not use: "
            f"{names(unexpected)}; pass --task to choose the model class on purpose"
        )
    return sorted(head)


def load_processor(path: Path, *, trust_remote_code: bool = False) -> Any:
    """Tokenizer (preferred for text) or processor saved in ``path``; ``None`` when there is none."""
    from transformers import AutoTokenizer

    if any(
        (path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt")
    ):
        try:
            tok = AutoTokenizer.from_pretrained(
                path, local_files_only=True, trust_remote_code=trust_remote_code
            )
        except Exception:  # noqa: BLE001 - a broken tokenizer must not block the conversion
            return None
        return tok if inputs.has_vocabulary(tok) else None  # not one made of special tokens alone
    return None

