"""``normswap verify ORIGINAL CONVERTED``: compare two models on disk with ``normswap.surgery.verify.compare``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from normswap import inputs, memory
from normswap.analysis.plan import Plan, plan_of
from normswap.checkpoint import source
from normswap.checkpoint.reader import is_normswap_dir, load
from normswap.errors import NormswapError, first_line
from normswap.inputs import towers
from normswap.inputs.probe import HELD_OUT_SEED, held_out_like, special_ids
from normswap.integrations.quiet import quietly
from normswap.modelinfo import model_dtype
from normswap.surgery.verify import (
    compare,
    derived_text,
    precision_limit,
    rounding_error,
    same_draws,
    unseeded_randomness,
)

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _plan_of(model: Any) -> Plan | None:
    return plan_of(model) or getattr(model, "_normswap_compat", None)


@quietly
def verify_checkpoint(
    original: str | os.PathLike,
    converted: str | os.PathLike,
    *,
    data: Any = None,
    tolerance: float | None = None,
    task: str | None = None,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    force: bool = False,
    example_inputs: Any = None,
) -> dict[str, Any]:
    """Figures for ``converted`` vs ``original`` and whether an exact conversion is within tolerance.

    Returns a dict with ``figures`` (max/mean over batches), ``ok``, ``kind`` (exact/approximate),
    ``tolerance``, ``batches``, ``dtype``, ``precision`` (a sentence: the dtype both models ran in and
    the tolerance), ``source_match``, a one-line ``verdict`` and ``probe`` (what the batches are).
    Without ``data``: the verification probe of :func:`normswap.inputs.verification_probe` (built-in
    text through ORIGINAL's tokenizer when it has one, padding left out of the figures), then a batch
    of random inputs.

    CONVERTED's manifest records a fingerprint of the weights it was made from
    (:func:`normswap.checkpoint.source.fingerprint`: what the tensors are, not where they are stored, so
    a preset and the same preset saved to a directory match); ORIGINAL with other weights is refused
    unless ``force``. A top-1 agreement of 0 is never "ok".

    ``example_inputs``: the inputs to compare on instead of the probe (a dict of ``forward``'s keyword
    arguments, or a function of ORIGINAL and its processor returning one: the CLI's ``--example-inputs``
    and ``--sample``), then the same redrawn from a seed the conversion did not use
    (:func:`normswap.inputs.probe.held_out_like`).
    """
    conv_path, conv, plan = _load_converted(converted, data, trust_remote_code, original=original)
    dtype = model_dtype(conv)
    src, source_match = _resolve_original(original, converted, conv, allow_pickle=allow_pickle,
                                          trust_remote_code=trust_remote_code, force=force)
    orig, proc = _load_original(src, conv, task, dtype, trust_remote_code)
    if plan.options.get("towers") and data is None and example_inputs is None and inputs.is_hf_model(orig):
        # converted per tower (its whole model runs on no built media): compared on the same runs
        route = towers.fallback(orig, NormswapError("the conversion analysed it per tower"))
        if route is not None:
            orig, conv = towers.view(orig, route), towers.view(conv, route)
            example_inputs = route.example_inputs()
    batches, probe_source = _batches(data, orig, proc, conv_path, example_inputs)
    if towers.is_view(orig):
        probe_source = probe_source.replace("the example inputs given", "the per-tower runs' built inputs", 1)
    skip, axes = set(plan.changed_outputs), dict(plan.changed_output_axes)
    figures, references, drew = _figures(orig, conv, batches, skip, axes)
    exact = all(sp.verdict != "approximate" for sp in plan.sites if sp.convert)
    own, own_failed = (None, "")
    how = "against ORIGINAL run in float64 on the same batches"
    if exact and tolerance is None and dtype != torch.float64:
        del conv  # ORIGINAL's float64 run needs the room
        if _float64_fits(orig) and not drew:
            own, own_failed = _own_error(orig, batches, references)
        else:  # estimated in ORIGINAL's own dtype instead (surgery.verify.rounding_error, as patch does)
            why = ("ORIGINAL draws random numbers, which differ in float64" if drew
                   else "a float64 ORIGINAL would not fit in memory")
            own = _estimated_own_error(orig, batches, references, dtype)
            how = f"estimated by one rounding of every module's output ({why})"
        if own is not None:
            figures["own_rounding_error"] = own
    exact, ok, tol, verdict = _judge(plan, figures, tolerance, dtype, own)
    if exact and not ok:  # the original's own randomness, where no seed reaches it, says so
        why = _unseeded(orig, batches[0])
        verdict += f"; {why}" if why else ""
    if not exact:
        gated = "approximate conversion: measured, no tolerance"
    elif tolerance is not None:
        gated = f"tolerance {tol:g} relative (--tolerance)"
    elif own is not None:
        gated = f"tolerance {tol:.3g} relative" + derived_text(dtype, own, how)
    else:
        gated = f"tolerance {tol:g} relative" + (f" (ORIGINAL does not run in float64: {own_failed})"
                                                 if own_failed else "")
    return {
        "figures": figures,
        # both models run in CONVERTED's stored dtype: what a user of the checkpoint computes in
        "precision": f"compared in {str(dtype).removeprefix('torch.')}, both models in CONVERTED's stored dtype; "
                     + gated,
        "ok": ok,
        "kind": "exact" if exact else "approximate",
        "tolerance": tol,
        "batches": len(batches),
        "dtype": _DTYPE_NAMES.get(dtype, str(dtype)),
        "verdict": verdict,
        "source_match": source_match,
        "probe": probe_source,
    }


def _load_converted(converted: str | os.PathLike, data: Any, trust_remote_code: bool,
                    original: str | os.PathLike | None = None) -> tuple[Path, Any, Plan]:
    """CONVERTED, loaded, and the plan its manifest carries; ``data`` is checked first (a bad file fails
    before any model loads). Arguments given the wrong way round (ORIGINAL a normswap checkpoint,
    CONVERTED not) are named as such, not as "not a normswap checkpoint"."""
    from normswap.checkpoint.conversion import check_text_file

    conv_path = Path(converted).expanduser()
    if not conv_path.exists():
        raise NormswapError(f"{converted} does not exist")
    if (original is not None and conv_path.is_dir() and not is_normswap_dir(conv_path)
            and is_normswap_dir(original)):
        raise NormswapError(
            f"{original} is the normswap checkpoint and {converted} is not: the order is ORIGINAL CONVERTED "
            f"(normswap verify {converted} {original})")
    if data is not None:
        check_text_file(data, "--data")
    conv = load(conv_path, trust_remote_code=True) if trust_remote_code else load(conv_path)
    plan = _plan_of(conv)
    if plan is None:
        raise NormswapError(f"{converted} is not a normswap checkpoint (no manifest in config.json)")
    return conv_path, conv, plan


def _resolve_original(original: str | os.PathLike, converted: str | os.PathLike, conv: Any, *,
                      allow_pickle: bool, trust_remote_code: bool, force: bool) -> tuple[Any, bool | None]:
    """ORIGINAL's source, and whether its weights are those CONVERTED's manifest says it was made from
    (None when the manifest records no fingerprint). Another model is refused unless ``force``."""
    try:
        src = source.resolve(str(original), allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    except source.NothingToConvert as exc:
        raise NormswapError(
            f"ORIGINAL {original} is itself a normswap checkpoint; pass the model it was converted from"
        ) from exc
    manifest = getattr(conv.config, "normswap", None)
    recorded = manifest.get("source_fingerprint") if isinstance(manifest, dict) else None
    source_match = None if not isinstance(recorded, str) else source.same_source(recorded, src)
    if source_match is False and not force:
        raise NormswapError(
            f"{converted} was not converted from {original}: its weights differ from those of the source "
            f"its manifest records ({manifest.get('source')!r}); pass the model it was made from, or "
            "--force to compare anyway"
        )
    return src, source_match


def _load_original(src: Any, conv: Any, task: str | None, dtype: torch.dtype, trust_remote_code: bool
                   ) -> tuple[Any, Any]:
    """ORIGINAL in CONVERTED's dtype, with its processor; without ``task``, it must load as the class
    CONVERTED records (else the two heads compute different things)."""
    arch = (
        getattr(conv.config, "normswap", {}).get("architecture") if hasattr(conv.config, "normswap") else None
    )
    orig, proc = source.load_model(
        src, task=task, dtype=_DTYPE_NAMES.get(dtype, "float32"), trust_remote_code=trust_remote_code
    )
    if task is None and arch and type(orig).__name__ != arch:
        raise NormswapError(f"ORIGINAL loads as {type(orig).__name__} but CONVERTED is a {arch}; pass --task")
    return orig, proc


def _batches(data: Any, orig: Any, proc: Any, conv_path: Path, example_inputs: Any = None
             ) -> tuple[list[dict], str]:
    """The batches both models run, and what they are: ``data`` when given; ``example_inputs`` and the same
    redrawn from a seed the conversion did not use; else the verification probe on passages the conversion
    never used (``passage_offset``: neither its probe's nor its calibration's sentences), then random ids
    from a seed the analysis did not use."""
    from normswap.checkpoint.conversion import read_calibration

    if example_inputs is not None:
        given = example_inputs(orig, proc) if callable(example_inputs) else example_inputs
        if not isinstance(given, dict):
            raise NormswapError("example_inputs for verify must be a dict of forward's keyword arguments")
        held_out = held_out_like((), given, seed=HELD_OUT_SEED + 1, keep_ids=special_ids(orig))
        if held_out is None:
            return [given], "the example inputs given (nothing in them to redraw)"
        return [given, held_out.kwargs], f"the example inputs given, then {held_out.source}"

    if data is not None:
        tok = proc if proc is not None else source.load_processor(conv_path)
        return read_calibration(data, tok, orig, option="--data"), f"--data {data}"
    if inputs.is_hf_model(orig):
        tok = getattr(proc, "tokenizer", proc) if proc is not None else None
        probe = inputs.verification_probe(orig, tok if callable(tok) else None, seed=101,
                                          passage_offset=inputs.PROBE_BATCH)
        batches = [probe.kwargs, inputs.hf_example_inputs(orig, batch=2, seq=12, seed=102)]
        what = probe.source
        if probe.text:
            what += " (passages the conversion neither verified nor calibrated on)"
        return batches, f"{what}; then random inputs"
    raise NormswapError("cannot build inputs for this model; pass --data")


def _figures(orig: Any, conv: Any, batches: list[dict], skip: set[str], axes: dict[str, int]
             ) -> tuple[dict[str, Any], list[Any], bool]:
    """Compare the two models batch by batch (``skip``: the outputs the conversion changes on purpose,
    ``axes`` their feature axes), every forward with the same seeded random draws: the worst error over
    the batches, the mean KL and top-1 agreement; ORIGINAL's outputs, batch by batch; and whether
    ORIGINAL drew random numbers."""
    per_batch, references, drew = [], [], False
    with torch.no_grad():
        for batch in batches:
            mask = batch.get("attention_mask") if isinstance(batch.get("attention_mask"), torch.Tensor) else None
            with same_draws(orig) as draws:
                reference = orig(**batch)
            drew = drew or draws.drew
            with same_draws(conv):
                converted = conv(**batch)
            per_batch.append(compare(reference, converted, skip, mask, axes))
            references.append(reference)
    if not per_batch or not any(k in per_batch[0] for k in ("max_rel_error", "raw_stream_rel_error")):
        raise NormswapError("the two models share no comparable output (different tasks?); pass --task")
    # a model whose only output is its raw stream (VitDet's backbone) is judged on that stream, up to the
    # per-token constant the conversion changes by design (surgery.verify.raw_stream_error)
    figures: dict[str, Any] = {"output": per_batch[0].get("output", "the raw stream (per-token constant removed)")}
    for key in ("max_abs_error", "max_rel_error", "worst_rel_error_any_output", "raw_stream_rel_error"):
        vals = [f[key] for f in per_batch if key in f]
        if vals:
            figures[key] = max(vals)
    for key in ("kl", "top1_agreement"):
        vals = [f[key] for f in per_batch if key in f]
        if vals:
            figures[key] = sum(vals) / len(vals)
    return figures, references, drew


def _unseeded(orig: Any, batch: dict) -> str | None:
    """:func:`~normswap.surgery.verify.unseeded_randomness` of ORIGINAL (in whatever dtype it now is: the
    own-error measurement may have cast it to float64) on ``batch``; None where it does not run."""
    dtype = model_dtype(orig)
    _, cast = inputs.cast_inputs((), batch, dtype)
    try:
        return unseeded_randomness(lambda: orig(**cast), dtype, orig)
    except Exception:  # noqa: BLE001 - the original failing to run again: the verdict stands as it is
        return None


def _float64_fits(orig: Any) -> bool:
    """Whether ORIGINAL cast to float64 fits in the memory share a working copy may take
    (:data:`normswap.memory.PEAK_SHARE` of what is available, its own bytes counted as freed by the cast)."""
    params = [p for p in orig.parameters() if p.is_floating_point()]
    own = sum(p.numel() * p.element_size() for p in params)
    needed = sum(p.numel() for p in params) * 8 + memory.ACTIVATION_BYTES
    device = params[0].device if params else torch.device("cpu")
    return needed <= memory.PEAK_SHARE * (memory.device_memory(device) + own)


def _estimated_own_error(orig: Any, batches: list[dict], references: list[Any], dtype: torch.dtype) -> float:
    """ORIGINAL's own rounding error in ``dtype`` estimated without float64
    (:func:`normswap.surgery.verify.rounding_error`), worst over the batches."""
    worst = 0.0
    with torch.no_grad():
        for batch, reference in zip(batches, references, strict=True):
            def run(batch: dict = batch) -> Any:
                with same_draws(orig):
                    return orig(**batch)

            worst = max(worst, rounding_error(orig, run, reference, dtype))
    return worst


def _own_error(orig: Any, batches: list[dict], references: list[Any]) -> tuple[float | None, str]:
    """ORIGINAL's own relative error in its loaded dtype: its outputs (``references``) against the same
    model run in float64 on the same batches (cast in place: ORIGINAL is not used afterwards), the yardstick
    :func:`normswap.surgery.verify.precision_limit` derives the tolerance from. ``(None, why)`` where the
    model does not run in float64."""
    from normswap.pipeline import default_dtype

    try:
        orig.to(torch.float64)
        worst = 0.0
        with torch.no_grad(), default_dtype(torch.float64):
            for batch, reference in zip(batches, references, strict=True):
                _, cast = inputs.cast_inputs((), batch, torch.float64)
                mask = batch.get("attention_mask") if isinstance(batch.get("attention_mask"), torch.Tensor) else None
                with same_draws(orig):
                    precise = orig(**cast)
                worst = max(worst, compare(precise, reference, set(), mask).get("max_rel_error", 0.0))
        return worst, ""
    except Exception as exc:  # noqa: BLE001 - the model's own code refuses float64 (a dtype check, a kernel)
        return None, f"{type(exc).__name__}: {first_line(exc, 120)}"


def _judge(plan: Plan, figures: dict[str, Any], tolerance: float | None, dtype: torch.dtype,
           own_error: float | None = None) -> tuple[bool, bool, float, str]:
    """``(exact, ok, tolerance, verdict)``: an exact conversion must be within tolerance (by default
    what the dtype explains for this model: :func:`~normswap.surgery.verify.precision_limit` of ORIGINAL's
    own error ``own_error``); an approximate one is reported, not judged; a top-1 agreement of 0 is
    never ok."""
    converted_sites = [sp for sp in plan.sites if sp.convert]
    exact = all(sp.verdict != "approximate" for sp in converted_sites)
    tol = tolerance if tolerance is not None else precision_limit(dtype, own_error)
    worst = max(figures.get("max_rel_error", 0.0), figures.get("raw_stream_rel_error", 0.0))
    top1 = figures.get("top1_agreement")
    if isinstance(top1, float) and top1 <= 0.0:
        return exact, False, tol, (
            f"top-1 agreement with the original is 0 (max relative error {worst:.3g}): the converted "
            "model never predicts what the original does"
        )
    if exact:
        ok = worst <= tol
        return exact, ok, tol, (
            f"exact conversion: max relative error {worst:.3g} <= {tol:.3g}: OK"
            if ok
            else f"exact conversion misses tolerance: max relative error {worst:.3g} > {tol:.3g}"
        )
    n = sum(1 for sp in converted_sites if sp.verdict == "approximate")
    return exact, True, tol, (
        f"approximate conversion ({n} approximate norm(s)): max relative error {worst:.3g}, "
        f"top-1 agreement {figures.get('top1_agreement', float('nan')):.3f}"
    )
