"""``normswap.convert``: model on disk (or preset) -> converted checkpoint directory.

In-memory path: load, ``normswap.patch`` (analysis + fp64 surgery + verification), write into a
temporary directory beside ``out``, reload what was written and check it reproduces the
converted model (bitwise for native, or within its float32 rounding; within what the dtype's rounding
explains of the original for compat), then
rename into place. Checkpoints whose in-memory conversion would not fit in the available RAM
(:func:`normswap.memory.in_memory_peak`; or ``low_memory=True``)
take the streaming path in :mod:`normswap.checkpoint.streaming` instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap import inputs, memory, pipeline, quantizers
from normswap.analysis.plan import Plan, plan_of
from normswap.checkpoint import io, source, writer
from normswap.checkpoint.source import Source
from normswap.errors import (
    ModelRunFailed,
    NormswapError,
    NothingToConvert,
    OptionRefused,
    UsageError,
    VerificationFailed,
)
from normswap.inputs import builder, towers
from normswap.integrations.quiet import quietly
from normswap.modelinfo import model_dtype
from normswap.options import DTYPES, FORMATS, TASKS, ConvertOptions, check_inputs_outside, check_out_dir, choose
from normswap.surgery.verify import (
    comparable,
    compare,
    derived_text,
    max_rel_error,
    precision_limit,
    rounding_error,
    same_draws,
)

log = logging.getLogger("normswap")


class Steps:
    """Step progress on stderr: ``normswap convert X: 2/4 analysing and converting (12 s)``.

    On a terminal the line is rewritten in place. Piped or in CI (not a TTY) it prints plain
    lines instead: one per step, at most one every :attr:`EVERY` seconds, and a "still ..." line
    every :attr:`HEARTBEAT` seconds while one step runs long (loading a big model), so a log never
    sits silent for minutes.
    """

    EVERY = 3.0
    HEARTBEAT = 30.0

    def __init__(self, enabled: bool, total: int, desc: str, stream: Any = None) -> None:
        import threading
        import time

        self.enabled, self.total, self.desc = enabled, total, desc
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.n, self.what = 0, ""
        self._clock = time.monotonic
        self._start = self._last = self._clock()
        self._printed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Any = None
        if enabled and not self.tty:
            self._thread = threading.Thread(target=self._beat, daemon=True)

    def __enter__(self) -> Steps:
        if self._thread is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r\033[K")
        elif self._printed and exc[0] is None:
            self.stream.write(f"{self.desc}: done ({self._clock() - self._start:.0f} s)\n")
        self.stream.flush()

    def _line(self) -> str:
        secs = self._clock() - self._start
        step = min(self.n + 1, self.total)
        return f"{self.desc}: step {step}/{self.total}: {self.what} ({secs:.0f} s)"

    def _emit(self) -> None:
        if not self.enabled:
            return
        with self._lock:
            now = self._clock()
            if self.tty:
                self.stream.write("\r\033[K" + self._line())
            elif now - self._last >= self.EVERY or not self._printed:
                self.stream.write(self._line() + "\n")
                self._printed = True
            else:
                return
            self._last = now
            self.stream.flush()

    def _beat(self) -> None:
        while not self._stop.wait(self.HEARTBEAT / 6):
            now = self._clock()
            if now - self._last >= self.HEARTBEAT:
                with self._lock:
                    self.stream.write(f"{self.desc}: still {self.what} ({now - self._start:.0f} s)\n")
                    self.stream.flush()
                    self._last = now
                    self._printed = True

    def set_postfix_str(self, what: str) -> None:
        """Name the step now running (printed, unless a line went out less than EVERY s ago)."""
        self.what = what
        self._emit()

    def update(self, n: int = 1) -> None:
        """One more step done."""
        self.n += n


def _progress(enabled: bool, total: int, desc: str) -> Steps:
    return Steps(enabled, total, desc)


@contextlib.contextmanager
def calibration_progress(enabled: bool) -> Iterator[None]:
    """Show (or not) the calibration's per-norm bar (``fitting norms k/N``, time left) for the block."""
    from normswap.surgery import calibrate

    before = calibrate.PROGRESS
    calibrate.PROGRESS = enabled
    try:
        yield
    finally:
        calibrate.PROGRESS = before


def check_options(
    opts: ConvertOptions,
    *,
    fmt: str,
    dtype: str,
    max_shard_size: int | str,
    task: str | None,
    low_memory: bool | None,
    calibration_data: Any,
) -> ConvertOptions:
    """Validate the checkpoint options before touching anything; returns the effective conversion
    options (compat keeps approximate norms as LayerNorm: mode ``exact``; the β placement resolved for
    ``fmt``: :meth:`ConvertOptions.beta_placement_for`)."""
    choose("format", fmt, FORMATS)
    choose("dtype", dtype, DTYPES)
    io.parse_size(max_shard_size)
    if task is not None:
        choose("task", task, TASKS)
    if fmt == "compat" and opts.mode == "all":
        raise OptionRefused(
            "compat format keeps LayerNorms, so approximate norms cannot be converted: "
            "use mode='exact' or mode='auto' with format='compat', or format='native' with mode='all'"
        )
    if fmt == "compat" and opts.rotate_output == "restore":
        raise OptionRefused("rotate_output='restore' adds an un-rotation op the stock architecture lacks: use "
                            "format='native', or rotate_output='rotated' with format='compat'")
    if fmt == "compat" and opts.online_hadamard:
        raise OptionRefused("online Hadamard rotations add ops the stock architecture lacks: use format='native' "
                            "with online_hadamard=True, or drop it for format='compat'")
    if low_memory and opts.rotate is not None:
        raise OptionRefused(f"rotate={opts.rotate!r} needs the whole model in memory; drop low_memory=True or the "
                            "rotation")
    if low_memory and calibration_data is not None:
        raise OptionRefused(
            "calibration_data needs the whole model in memory; drop low_memory=True or the calibration data"
        )
    opts = opts.replace(beta_placement=opts.beta_placement_for(fmt))  # compat: every β kept by default
    return opts.replace(mode="exact") if fmt == "compat" else opts


available_memory = io.available_memory  # kept here too: callers and tests patch it by this name


def calibration_tokenizer(proc: Any) -> Any:
    """The source's text tokenizer for the built-in calibration sentences (a processor's own
    tokenizer), or None when it has none that can pad a batch (the calibration then finds one
    itself or draws token ids)."""
    tok = getattr(proc, "tokenizer", proc)
    return tok if callable(tok) and getattr(tok, "pad_token", None) is not None else None


def _itemsize(src: Source) -> int:
    sizes = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2}
    for f in src.safetensors[:1]:
        header = io.read_safetensors_header(f)
        found = [sizes[v["dtype"]] for k, v in header.items() if k != "__metadata__" and v.get("dtype") in sizes]
        if found:
            return max(set(found), key=found.count)
    return 4


def loaded_size(src: Source, dtype: str) -> tuple[int, int]:
    """(parameters, bytes each) of the model as the in-memory path loads it: in the checkpoint's dtype,
    or in float32 with ``--dtype`` (loaded in float32 before the one cast at the end)."""
    itemsize = _itemsize(src)
    return src.nbytes // itemsize, itemsize if dtype == "auto" else 4


def wants_low_memory(src: Source, dtype: str) -> bool:
    """Stream when the in-memory path's predicted peak with its cheapest working copy
    (:func:`normswap.memory.in_memory_peak`) would not fit in ``memory.PEAK_SHARE`` of the available RAM: no default
    conversion is left to the OOM killer. Whether float64 fits is decided after loading, by ``patch``
    (:func:`normswap.memory.choose_precision`): a model that fits in memory only with a float32
    copy is converted in memory and verified whole, in float32, rather than streamed."""
    if src.kind == "preset":
        return False
    return memory.in_memory_peak(*loaded_size(src, dtype)) > memory.PEAK_SHARE * available_memory()


def check_float64_fits(src: Source, dtype: str, opts: ConvertOptions) -> None:
    """With ``verify_dtype='float64'``, refuse before loading anything when the in-memory path's
    float64 working copy would not fit (the same prediction ``patch`` makes once the model is loaded)."""
    if opts.verify_dtype != "float64" or src.kind == "preset":
        return
    numel, itemsize = loaded_size(src, dtype)
    if itemsize == 8:
        return
    try:
        memory.choose_precision(numel, torch.float32 if itemsize == 4 else torch.float16, "float64",
                                available=int(available_memory()))
    except NormswapError as exc:
        raise NormswapError(f"{exc}, or low_memory=True (streamed: layers 0, 1 and L-1 verified, in float64 "
                            "where they fit)") from None


# ------------------------------------------------------------------------------------ calibration
def check_text_file(path: str | os.PathLike, option: str) -> None:
    """Refuse a missing text input up front, named by its ``option``, before any model is loaded."""
    p = Path(path)
    if not p.exists():
        raise NormswapError(f"{option} {p} does not exist")
    if not p.is_file():
        raise NormswapError(f"{option} {p} is not a file; pass a text file (one sample per line) or JSONL")


def read_calibration(
    path: str | os.PathLike, tokenizer: Any, model: nn.Module, *, max_samples: int = 256, batch_size: int = 8,
    option: str = "--calibration-data",
) -> list[dict[str, torch.Tensor]]:
    """Text file (one sample per non-empty line) or JSONL with a ``"text"`` field -> model batches.

    ``option`` names the file in messages: ``--calibration-data`` (calibration) or ``--data`` (``verify``'s
    evaluation inputs)."""
    path = Path(path)
    check_text_file(path, option)
    if tokenizer is None or not callable(tokenizer):
        raise NormswapError(
            f"{option} is text, but {type(model).__name__} has no tokenizer "
            "(image/audio model, or no tokenizer files next to the weights)"
        )
    main = getattr(model, "main_input_name", "input_ids")
    if main != "input_ids":
        raise NormswapError(f"{option} is text, but {type(model).__name__} takes {main}")
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise NormswapError(f"cannot read {option} {path}: {exc}") from exc
    lines = [ln for ln in raw.splitlines() if ln.strip()]
    jsonl = path.suffix in (".jsonl", ".json") or (lines and lines[0].lstrip().startswith("{"))
    texts: list[str] = []
    for i, line in enumerate(lines, 1):
        if jsonl:
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise NormswapError(
                    f"{path}:{i}: not valid JSON ({exc.args[0] if exc.args else exc})"
                ) from exc
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise NormswapError(f'{path}:{i}: expected an object with a "text" string field')
            texts.append(obj["text"])
        else:
            texts.append(line)
    texts = [t for t in texts if t.strip()][:max_samples]
    if not texts:
        raise NormswapError(f"{option} {path} contains no text")
    config = model.config
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None) or 512
    max_length = max(4, min(128, int(limit) - 2))
    if getattr(tokenizer, "pad_token", None) is None:
        tokenizer.pad_token = getattr(tokenizer, "eos_token", None) or getattr(tokenizer, "unk_token", None)
    import inspect

    params = inspect.signature(model.forward).parameters
    batches = []
    for lo in range(0, len(texts), batch_size):
        enc = tokenizer(
            texts[lo : lo + batch_size],
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=max_length,
        )
        batch = {k: v for k, v in enc.items() if k in params}
        if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
            batch["decoder_input_ids"] = enc["input_ids"][:, : min(8, enc["input_ids"].shape[1])]
        if "use_cache" in params:
            batch["use_cache"] = False
        batches.append(batch)
    return batches


# ------------------------------------------------------------------------------------ reload check
def probe_inputs(model: nn.Module) -> dict[str, Any]:
    """Inputs unseen by the analysis (different seed) for the reload check."""
    return inputs.hf_example_inputs(model, batch=2, seq=8, seed=4242)


def _run(model: nn.Module, probe: dict[str, Any]) -> Any:
    """``model`` on ``probe``; a float16 / bfloat16 model on a CPU computes in float32 (its weights
    as they are, upcast for the call: a CPU has no fast half-precision matmul, and GPT-2's ``addmm``
    in bfloat16 took ~45 s for 16 tokens of a 0.1B model here). The original and the converted model
    and the reloaded checkpoint are all run this way, so the comparisons between them still hold
    (bitwise for native); ``patch`` measures the cast in the model's own dtype."""
    if not _half_on_cpu(model):
        with torch.no_grad(), same_draws(model):  # a model drawing random numbers in eval mode: the same draws
            return model(**probe)
    cast = {k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in probe.items()}
    with torch.no_grad(), pipeline.computing_in(model, torch.float32), same_draws(model):
        return model(**cast)


def own_memory(model: nn.Module) -> None:
    """Give every parameter and buffer of ``model`` memory of its own: a copy out of the file mapping a
    loaded checkpoint's tensors point into.

    The converted model's tensors live in memory the allocator aligned; a safetensors file maps each tensor
    at its offset in the file, aligned to 8 bytes only. BLAS kernels choose their reduction order by the
    alignment of their operands (a matrix-vector product of a batch-1, one-token decoder step most visibly),
    so the same weights at another address can round the last bit of an output differently: tiny Whisper's
    reloaded logits differed from the converted model's by 8.9e-8 with bitwise equal state dicts. Placed
    like the converted model's, the reloaded tensors compute like them. Tied tensors stay tied."""
    params: set[int] = set()
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # the original kept: its id stays its own
    with torch.no_grad():
        for module in model.modules():
            for p in module._parameters.values():
                if p is not None and not p.is_meta and id(p) not in params:
                    params.add(id(p))
                    p.data = p.data.clone()
            for name, b in list(module._buffers.items()):
                if b is not None and not b.is_meta:
                    buffers.setdefault(id(b), (b, b.clone()))
                    module._buffers[name] = buffers[id(b)][1]


def _half_on_cpu(model: nn.Module) -> bool:
    dtype = model_dtype(model)
    return dtype in pipeline.HALF_DTYPES and all(p.device.type == "cpu" for p in model.parameters())


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype :func:`_run` computes ``model`` in: its own, float32 for a half model on a CPU."""
    if _half_on_cpu(model):
        return torch.float32
    return model_dtype(model)


def reload_check(
    fmt: str,
    out: Path,
    converted: Any,
    original: Any,
    probe: dict[str, Any],
    plan: Any,
    dtype: torch.dtype,
    *,
    trust_remote_code: bool = False,
    route: towers.Route | None = None,
) -> dict[str, Any]:
    """Load what was written and compare it with the converted model it was written from, on the same
    inputs (``probe``) and with its tensors in memory of their own as the converted model's are
    (:func:`own_memory`): native is expected bitwise equal, and must be within the limit of that float32
    comparison (:func:`reload_tolerance`) where it is not; compat (stock LayerNorms) must match the
    original within what the checkpoint's dtype explains for it (:func:`reload_tolerance` too)."""
    from normswap.checkpoint.reader import load

    model = load(out, trust_remote_code=True) if trust_remote_code else load(out)
    if not _half_on_cpu(model):  # (a half model on a CPU computes on float32 copies of its tensors anyway)
        own_memory(model)
    reloaded = _run(towers.view(model, route) if route is not None else model, probe)  # a per-tower probe: its runs
    skip = set(plan.changed_outputs)
    # reloaded vs converted: every output, the raw streams the plan changes included (they must reload bitwise
    # too; a model whose only output is its raw stream, VitDet's backbone, has nothing else to compare)
    a, b = comparable(converted, set()), comparable(reloaded, set())
    keys = [k for k in a if k in b and a[k].shape == b[k].shape]
    if not keys:
        raise VerificationFailed(
            "verification failed: the reloaded checkpoint produces none of the converted "
            "model's outputs; nothing was written"
        )
    bitwise = all(torch.equal(a[k], b[k]) for k in keys)
    figures: dict[str, Any] = {
        "reload_bitwise_equal": bitwise,
        "reload_max_abs_diff": max(float((a[k].double() - b[k].double()).abs().max()) for k in keys),
    }
    vs_orig = compare(original, reloaded, skip, axes=plan.changed_output_axes)
    if "max_rel_error" in vs_orig:
        figures["reload_vs_original_max_rel_error"] = vs_orig["max_rel_error"]
    exact = all(sp.verdict != "approximate" for sp in plan.sites if sp.convert)
    if fmt == "native" and not bitwise:
        worst = max(keys, key=lambda k: max_rel_error(a[k], b[k]))  # every output, as the estimate below
        figures["reload_max_rel_diff"] = max_rel_error(a[worst], b[worst])
        limit, how = reload_tolerance(model, probe, reloaded)
        figures["reload_tolerance"] = limit
        diff = figures["reload_max_rel_diff"]
        figures["reload_precision"] = (f"not bitwise equal to the converted model: {diff:.2g} relative, "
                                       f"tolerance {limit:.3g}{how}")
        if diff > limit:
            raise VerificationFailed(
                f"verification failed: the reloaded native checkpoint differs from the converted model by "
                f"{diff:.3g} (relative, tolerance {limit:.3g}{how}) on `{worst}`; nothing was written"
            )
    if fmt == "compat" and exact and "max_rel_error" in vs_orig:
        # stock LayerNorms on centered weights: another computation than the original's, as exact as the
        # checkpoint's dtype allows, so held to what that dtype's rounding explains for this model
        limit, how = reload_tolerance(model, probe, reloaded, dtype)
        figures["reload_tolerance"] = limit
        figures["reload_precision"] = (f"(compat) against the original: {vs_orig['max_rel_error']:.2g} relative, "
                                       f"tolerance {limit:.3g}{how}")
        if vs_orig["max_rel_error"] > limit:
            raise VerificationFailed(
                f"verification failed: the compat checkpoint differs from the original by "
                f"{vs_orig['max_rel_error']:.3g} (relative, tolerance {limit:.3g}{how}); nothing was written"
            )
    del model
    return figures


# how a reload comparison's rounding error is found, for its precision statement
RELOAD_ROUNDING = "(estimated: each module's output rounded once more, on the same inputs)"


def reload_tolerance(model: nn.Module, probe: dict[str, Any], reloaded: Any,
                     dtype: torch.dtype | None = None) -> tuple[float, str]:
    """How far a reloaded checkpoint may compute from what it is compared with, and the clause saying how
    that was derived: :func:`surgery.verify.precision_limit` of the reloaded model's own rounding error in
    ``dtype`` on the same inputs, estimated by :func:`surgery.verify.rounding_error` (one more rounding of
    every module's output), as the conversion's own gate derives its limit. Native: the converted model's
    very tensors, the same operations in the same dtype, differing only where a kernel sums in another order
    (:func:`own_memory`): ``dtype`` is what :func:`_run` computes in. Compat: the original, which computes
    otherwise on weights the checkpoint's ``dtype`` rounds: that ``dtype``."""
    dtype = dtype or compute_dtype(model)
    if dtype == torch.float64:  # nothing finer to measure against: precision_limit keeps the flat limit
        return precision_limit(dtype, None), " (float64's limit)"
    own = rounding_error(model, lambda: _run(model, probe), reloaded, dtype, worst=True)
    return precision_limit(dtype, own), derived_text(dtype, own, RELOAD_ROUNDING, whose="the reloaded model's")


def _update_manifest(out: Path, figures: dict[str, Any], source_dir: Path | None) -> None:
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    manifest = cfg.get("normswap", {})
    manifest.setdefault("verification", {}).update(writer.json_safe(figures))
    io.write_json(cfg_path, cfg)
    card = writer.model_card(manifest, out.name.split(io.TMP_MARK)[0].lstrip("."))
    io.write_card(out, card, source_dir)


def output_bytes(model: nn.Module) -> int:
    """Bytes of weights the checkpoint will hold: every distinct tensor once, untied heads included
    (untying GPT-2-small's embedding grows its checkpoint by about half)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for t in model.state_dict().values():
        key = (t.data_ptr(), t.numel())
        if key in seen or t.is_meta:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def check_agreement(verification: dict[str, Any]) -> None:
    """A conversion whose top-1 agreement is 0 is not usable, whatever else it reports."""
    top1 = verification.get("top1_agreement")
    if isinstance(top1, (int, float)) and top1 <= 0.0:
        raise VerificationFailed(
            "verification failed: top-1 agreement with the original is 0 (the converted model "
            "never predicts what the original does); nothing was written"
        )


# ------------------------------------------------------------------------------------ convert
@quietly
def convert(
    model_id_or_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    format: str | None = None,  # noqa: A002
    dtype: str = "auto",
    calibration_data: str | os.PathLike | None = None,
    max_shard_size: int | str = writer.DEFAULT_SHARD,
    low_memory: bool | None = None,
    trust_remote_code: bool = False,
    overwrite: bool = False,
    task: str | None = None,
    allow_pickle: bool = False,
    allow_new_head: bool = False,
    revision: str | None = None,
    progress: bool = False,
    echo: Callable[[str], None] | None = None,
    options: ConvertOptions | None = None,
    example_inputs: inputs.ExampleInputs | Callable[[nn.Module, Any], inputs.ExampleInputs] = None,
    **keywords: Any,
) -> pipeline.Report:
    """Convert a model into a checkpoint directory, atomically.

    Args:
        model_id_or_path: a Hub id, a local Hugging Face model directory, or a preset name
            (``normswap.presets.names()``). A Hub id resolves as transformers resolves it: from the
            Hugging Face cache (``HF_HOME`` / ``HF_HUB_CACHE``) when ``HF_HUB_OFFLINE`` is set or the
            Hub is unreachable, else downloaded into that cache.
        out_dir: destination; must not exist or be empty unless ``overwrite``.
        format: ``"native"`` (RMSNorm modules + manifest) or ``"compat"`` (stock architecture,
            LayerNorms kept, exact, loads without normswap). ``None`` (default): ``"native"``, or the format the
            ``quantizer`` option's engine needs (``"compat"`` for CTranslate2, ONNX Runtime's static QDQ and
            4-bit ``MatMulNBits``; :mod:`normswap.quantizers`).
        options: the conversion's :class:`~normswap.ConvertOptions` (mode, fold_gamma, untie,
            per_norm_centering, mean_carry, calibration, verify, allow_unusable, backend, ...), or
            its fields as keywords: ``convert(src, out, mode="exact")``. ``calibration`` takes
            already-tokenised batches (an alternative to ``calibration_data``); ``verify`` also
            covers the reload check of the written checkpoint; ``per_norm_centering`` needs the
            in-memory path. An unknown keyword is an error.
        dtype: ``"auto"`` (the checkpoint's), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        calibration_data: text file or JSONL (``"text"`` field) used to fit approximate norms.
        max_shard_size: shard limit for the written safetensors (``"5GB"``, ``"500MB"``, bytes).
        low_memory: stream tensors shard by shard (``None``: automatic for checkpoints whose
            in-memory conversion would not fit in memory: :func:`normswap.memory.in_memory_peak`).
        trust_remote_code: allow custom modeling code shipped with the source model.
        overwrite: replace a non-empty ``out_dir`` (only once the new one is complete).
        task: override the model class picked from ``config.architectures`` (``source.TASKS``);
            also for a preset (``convert("tiny-bert", out, task="base", allow_new_head=True)``).
        allow_pickle: accept pickle-only (``.bin``) source checkpoints.
        allow_new_head: with ``task``, accept a task head the checkpoint lacks (randomly
            initialised, listed in the manifest as ``new_head``). Without it any parameter
            missing from the checkpoint is an error. A part the checkpoint's own class never had
            (the pooler of ``BertModel``, absent from ``BertForMaskedLM``) counts as new.
        revision: with a Hub id, the branch, tag or commit to convert (default ``main``).
        progress: show progress bars on stderr.
        echo: called with one-line status messages (the CLI prints them).
        example_inputs: what the analysis runs the model on, as ``normswap.patch`` takes them (default:
            built from the config), or a function of the loaded model and its processor returning them
            (:mod:`normswap.inputs.from_file`: the CLI's ``--example-inputs`` and ``--sample``). Verified
            on them redrawn from another seed; needs the in-memory path.

    Returns:
        The :class:`normswap.Report` (verification figures include the reload check).

    Raises:
        NormswapError: bad input (one actionable line); nothing is written.
        NothingToConvert: no LayerNorm to convert in this mode (``exit_code`` 3).
        VerificationFailed: an exact conversion missed tolerance (``exit_code`` 4).
    """
    say = echo or (lambda msg: log.info(msg))
    if not isinstance(model_id_or_path, (str, os.PathLike)):
        how = ("; for a model in memory: normswap.patch(model), then normswap.save(model, out_dir)"
               if isinstance(model_id_or_path, nn.Module) else "")
        raise NormswapError(f"convert takes a Hub id, a local directory or a preset name, not a "
                            f"{type(model_id_or_path).__name__}{how}")
    if allow_new_head and task is None:
        raise NormswapError("allow_new_head=True adds a task head: name it, e.g. task='sequence-classification'")
    opts = ConvertOptions.build(options, **keywords)
    format = quantizers.format_for(opts.quantizer, format)  # noqa: A001
    if opts.quantizer is not None:
        quantizers.check_combination(opts.quantizer, opts.quantizer_overrides, format=format, low_memory=low_memory)
    opts = check_options(opts, fmt=format, dtype=dtype,
                         max_shard_size=max_shard_size, task=task, low_memory=low_memory,
                         calibration_data=calibration_data)
    if calibration_data is not None:
        check_text_file(calibration_data, "calibration_data")
    check_out_dir(out_dir, overwrite=overwrite)  # before a Hub id is fetched; check_destination repeats it below
    check_inputs_outside(out_dir, {"calibration_data": (calibration_data,) if calibration_data is not None else ()})
    src = source.resolve(str(model_id_or_path), allow_pickle=allow_pickle, trust_remote_code=trust_remote_code,
                         revision=revision)
    out = io.check_destination(out_dir, overwrite=overwrite, source=src.path)
    source.check_config_fits(src, task, trust_remote_code=trust_remote_code)  # before anything is built
    st = _Conversion(src, out, opts, fmt=format, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite,
                     task=task, trust_remote_code=trust_remote_code, allow_new_head=allow_new_head,
                     calibration_data=calibration_data, say=say, example_inputs=example_inputs)
    if _streams(st, low_memory):
        from normswap.checkpoint import streaming

        return streaming.convert_streaming(src, out, fmt=format, options=st.opts, dtype=dtype,
                                           max_shard_size=max_shard_size, overwrite=overwrite, task=task,
                                           progress=progress, echo=say, automatic=low_memory is None,
                                           allow_new_head=allow_new_head, trust_remote_code=trust_remote_code)
    check_float64_fits(src, dtype, st.opts)
    st.side_bytes = io.side_file_bytes(src.path)
    io.check_space(out, src.nbytes + st.side_bytes)
    st.steps = _progress(progress, 4, f"normswap convert {src.spec}")
    with st.steps:
        _load(st)
        st.steps.update()
        _convert_loaded(st, progress)
        st.steps.update()
        _cast_to_dtype(st)
        _write_and_check(st)
    st.report.output, st.report.output_format = str(out), format
    return st.report


def streamed_plan(src: Source, *, fmt: str, options: ConvertOptions, task: str | None, low_memory: bool | None,
                  echo: Callable[[str], None], allow_new_head: bool = False,
                  trust_remote_code: bool = False) -> Plan | None:
    """The plan :func:`convert` would stream ``src`` with (``low_memory`` as ``convert`` takes it: ``None`` is
    automatic, for a checkpoint whose in-memory conversion would not fit), or ``None`` when ``convert`` would
    convert it in memory. Loads no model and writes nothing: ``normswap inspect --low-memory``. ``options``:
    as :func:`check_options` returned them; refusals are ``convert``'s, in its words."""
    st = _Conversion(src, Path(os.devnull), options, fmt=fmt, dtype="auto", max_shard_size=writer.DEFAULT_SHARD,
                     overwrite=False, task=task, trust_remote_code=False, allow_new_head=False,
                     calibration_data=None, say=echo)
    if not _streams(st, low_memory):
        return None
    from normswap.checkpoint import streaming

    return streaming.plan_streaming(src, fmt=fmt, options=options, task=task, echo=echo,
                                    automatic=low_memory is None, allow_new_head=allow_new_head,
                                    trust_remote_code=trust_remote_code)


@dataclasses.dataclass
class _Conversion:
    """What travels between :func:`convert`'s steps (the in-memory path)."""

    src: Source
    out: Path
    opts: ConvertOptions
    fmt: str
    dtype: str  # the written checkpoint's dtype ("auto": the source's)
    max_shard_size: int | str
    overwrite: bool
    task: str | None
    trust_remote_code: bool
    allow_new_head: bool
    calibration_data: str | os.PathLike | None
    say: Callable[[str], None]
    steps: Steps | None = None
    model: nn.Module | None = None  # the loaded model, converted in place; freed before the reload check
    proc: Any = None  # its tokenizer / processor
    probe: dict[str, Any] | None = None  # inputs the written checkpoint is checked on
    original: Any = None  # the original's outputs on them (None: no reload check)
    converted: Any = None  # the converted model's, in the written dtype
    report: pipeline.Report | None = None
    side_bytes: int = 0  # the source's side files (tokenizer, processor), copied beside the weights
    example_inputs: Any = None  # as given (a function of the loaded model and processor: resolved by _load)
    route: towers.Route | None = None  # converted by towers: the probe is the route's (``_original_outputs``)


def _streams(st: _Conversion, low_memory: bool | None) -> bool:
    """Whether the checkpoint takes the streaming path: ``low_memory`` as asked, else when the in-memory
    conversion would not fit (and nothing needs the whole model: calibration, per-norm centering).
    Refuses what streaming cannot do."""
    src, opts = st.src, st.opts
    if low_memory is None:
        low_memory = (wants_low_memory(src, st.dtype) and st.calibration_data is None and opts.calibration is None
                      and not opts.per_norm_centering and opts.writer_centering != "auto"
                      and st.example_inputs is None)
        if low_memory:
            st.say(
                f"checkpoint is {io.human(src.nbytes)}: converting it in memory would need more than the "
                f"available RAM ({io.human(int(available_memory()))}); streaming conversion (--low-memory)"
            )
    if low_memory and st.example_inputs is not None:
        raise UsageError("example inputs (--example-inputs, --sample) need the whole model in memory; drop "
                         "--low-memory")
    if low_memory and opts.per_norm_centering:
        raise OptionRefused("per_norm_centering=True needs the whole model in memory; drop low_memory=True")
    if low_memory and opts.writer_centering == "auto":
        raise OptionRefused("writer_centering='auto' chooses each writer's centering from its own weights, which the "
                            "streamed conversion plans without (a depth-reduced proxy): drop low_memory=True, or pass "
                            "writer_centering='op' or 'weights'")
    if low_memory and opts.rotate is not None:
        raise OptionRefused(f"{src.label} is streamed (its in-memory conversion would not fit in the available "
                            f"RAM) and rotate={opts.rotate!r} needs the whole model in memory; pass low_memory=False "
                            "to force it, or drop the rotation")
    if low_memory and src.kind == "preset":
        raise OptionRefused("low_memory=True converts a checkpoint on disk; save the preset first "
                            "(normswap.presets.save) or drop low_memory=True")
    return bool(low_memory)


def _load(st: _Conversion) -> None:
    """Load the model and its processor, say what was left out or added, and complete the options from
    them (calibration batches, the tokenizer of the verification probe)."""
    st.steps.set_postfix_str("loading")
    src = st.src
    # --dtype: load in float32 (exact for bf16/fp16 checkpoints), do the fp64 surgery on the
    # unrounded weights, cast once at the end; loading in the target dtype would round twice
    st.model, st.proc = source.load_model(src, task=st.task, dtype="auto" if st.dtype == "auto" else "float32",
                                          trust_remote_code=st.trust_remote_code,
                                          allow_new_head=st.allow_new_head)
    if src.left_out:
        st.say(f"left out {source.names(src.left_out)}: the checkpoint has no tensors for it, and the "
               f"{src.layout} pipeline does not use it (it reads {source.PIPELINE_READS[src.layout]})")
    if src.new_head:
        st.say(f"new task head, randomly initialised (--new-head): {source.names(src.new_head)}; "
               "train it before use")
    if st.fmt == "native" and type(st.model).__module__.startswith("transformers_modules"):
        raise OptionRefused(f"{src.spec} uses custom modeling code; the native format needs a transformers "
                            "architecture. Use --format compat")
    if st.opts.calibration is None and st.calibration_data is not None:
        st.opts = st.opts.replace(calibration=read_calibration(st.calibration_data, st.proc, st.model))
    if st.opts.tokenizer is None:
        st.opts = st.opts.replace(tokenizer=calibration_tokenizer(st.proc))
    if callable(st.example_inputs) and not isinstance(st.example_inputs, torch.Tensor):
        st.example_inputs = st.example_inputs(st.model, st.proc)


def _original_outputs(st: _Conversion) -> Any:
    """The original's outputs on ``st.probe``. A multimodal model whose whole-model inputs do not run is
    converted by towers (:mod:`normswap.inputs.towers`): its reload check then runs that route (a text-only
    run and each tower's feature run, ``st.route``) on the original, the converted model and the reloaded
    checkpoint alike."""
    try:
        kept = None
        if st.probe is None:  # built here: an unset media token is a run failure already in the builder
            # building runs the model once on the layout it chooses (a trial forward): its output, where it
            # computes what _run would (no half model's float32 upcast), is the original's outputs
            with builder.keeping_runs(st.model, lambda: same_draws(st.model)) as trial:
                st.probe = probe_inputs(st.model)
            kept = None if _half_on_cpu(st.model) else trial.output_on(st.probe)
        return kept if kept is not None else _run(st.model, st.probe)
    except Exception as exc:  # the model's own code on the built inputs: any error it raises
        if st.example_inputs is not None or not inputs.is_hf_model(st.model) or st.probe is None and \
                not isinstance(exc, ModelRunFailed):  # inputs that cannot be built: patch says which
            raise
        route = towers.fallback(st.model, exc)
        if route is None:
            raise
    st.route, st.probe = route, route.example_inputs()  # the route's inputs, as patch builds them
    return _run(towers.view(st.model, route), st.probe)


def _convert_loaded(st: _Conversion, progress: bool) -> None:
    """``normswap.patch`` on the loaded model (the original's outputs kept first for the reload check),
    refusing a conversion that never agrees with the original, and saying what grows or stays."""
    model = st.model
    if isinstance(st.example_inputs, dict):  # the reload check runs on the inputs the model is known to take
        st.probe = dict(st.example_inputs)
    else:
        st.probe = None  # built by _original_outputs for a transformers model given no inputs
    built = inputs.is_hf_model(model) and st.example_inputs is None
    st.original = _original_outputs(st) if (st.opts.verify and (st.probe is not None or built)) else None
    st.steps.set_postfix_str("analysing and converting")
    try:
        with calibration_progress(progress):
            st.report = pipeline.patch(model, st.example_inputs, options=st.opts)
    except VerificationFailed as exc:
        raise VerificationFailed(f"{exc}; nothing was written") from exc
    if not st.report.changed:
        raise NothingToConvert(f"{st.src.label}: {st.report.message}")
    if st.opts.allow_unusable:
        top1 = st.report.verification.get("top1_agreement")
        if isinstance(top1, (int, float)) and top1 <= 0.0:
            st.say("top-1 agreement with the original is 0; writing it anyway (--allow-unusable)")
    else:
        check_agreement(st.report.verification)
    plan = plan_of(model)
    if plan.unties:
        grown = sum(u.numel for u in plan.unties)
        itemsize = model_dtype(model).itemsize
        st.say(io.untie_note(len(plan.unties), grown, grown * itemsize, output_bytes(model)))
    kept = [sp.name for sp in plan.sites if sp.verdict == "approximate" and not sp.convert]
    if st.fmt == "compat" and kept:
        st.say(f"compat format keeps LayerNorms: {len(kept)} approximate norm(s) left unconverted "
               "(use --format native --mode all to convert them)")


def _cast_to_dtype(st: _Conversion) -> None:
    """The one cast from the float32 result to ``--dtype``, and the converted model's outputs in it."""
    if st.dtype != "auto":
        target = source.torch_dtype(st.dtype)
        st.model.to(target)
        if st.probe is not None:
            st.probe = {k: (v.to(target) if torch.is_tensor(v) and v.is_floating_point() else v)
                        for k, v in st.probe.items()}
    if st.original is not None:
        st.converted = _run(towers.view(st.model, st.route) if st.route else st.model, st.probe)


def _write_and_check(st: _Conversion) -> None:
    """Write the checkpoint into a temporary directory beside ``out``, reload it and check it against
    the converted model's and the original's outputs, then move it into place (:func:`io.atomic_directory`)."""
    st.steps.set_postfix_str("writing")
    model, src = st.model, st.src
    plan = plan_of(model)
    needed = io.check_space(st.out, output_bytes(model) + st.side_bytes)
    with io.atomic_directory(st.out, overwrite=st.overwrite, needed=needed) as tmp:
        writer.write_model_dir(model, tmp, fmt=st.fmt, plan=plan, max_shard_size=st.max_shard_size,
                               verification=st.report.verification, source=src.spec,
                               tokenizer=st.proc if src.kind == "preset" else None, side_files_from=src.path,
                               manifest_extra=source.record(src))
        st.steps.update()
        if st.original is not None:
            st.steps.set_postfix_str("verifying the written checkpoint")
            dtype_ = model_dtype(model)
            # the converted model's outputs are kept (``converted``): free the model itself, so the
            # reloaded checkpoint (and a half model's float32 run) takes its place, not a place beside it
            dropped = weakref.ref(model)
            st.model = model = None
            memory.release(dropped)
            figures = reload_check(st.fmt, tmp, st.converted, st.original, st.probe, plan, dtype_,
                                   trust_remote_code=st.trust_remote_code, route=st.route)
            if "reload_precision" in figures:  # stated where the precision of the conversion is
                said = st.report.verification.get("verify_precision")
                reload = f"reloaded checkpoint {figures.pop('reload_precision')}"
                figures["verify_precision"] = f"{said}; {reload}" if said else reload
            _update_manifest(tmp, figures, src.path)
            st.report.verification.update(figures)
        st.steps.update()
