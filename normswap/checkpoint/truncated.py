"""Verify a streamed checkpoint on its real weights without loading it: compare truncated models.

Centering and folding are local to each layer, so a model made of layers 0, 1 and L-1 of every
layer stack (plus embeddings and head) loaded from the converted checkpoint must match the same
layers loaded from the original exactly. Both truncated models are built at the proxy's depth,
filled tensor by tensor, and compared on probe inputs.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from normswap import inputs, memory, pipeline
from normswap.checkpoint import extrapolate as ex
from normswap.checkpoint import hf
from normswap.checkpoint.io import available_memory
from normswap.checkpoint.proxy import FullPlan, build_proxy, param_count_meta, representative
from normswap.checkpoint.rewrite import KeyMap
from normswap.checkpoint.stream_io import Entry, Reader
from normswap.errors import NormswapError, VerificationFailed
from normswap.surgery.edits import mark_untied
from normswap.surgery.verify import compare, gate_text, rounding_error, same_draws


def load_truncated(
    model: nn.Module,
    stacks: dict[str, int],
    proxy_depths: dict[str, int],
    lookup: Callable[[str], torch.Tensor | None],
) -> list[str]:
    """Fill a truncated model in place, tensor by tensor: proxy layer ``t`` of each stack gets full
    layer ``representative(t)``. Returns the names the checkpoint had no tensor for."""
    layout = ex.Layout(proxy_depths)
    missing = []
    with torch.no_grad():
        for name, target in model.state_dict(keep_vars=True).items():
            ref = layout.split(name)
            full_name = (
                name
                if ref.stack is None
                else ex.Layout.join(
                    ref.stack, representative(ref.index, stacks[ref.stack], proxy_depths[ref.stack]), ref.rest
                )
            )
            value = lookup(full_name)
            if value is None:
                missing.append(name)
                continue
            if tuple(value.shape) != tuple(target.shape):
                raise NormswapError(
                    f"{full_name}: checkpoint shape {tuple(value.shape)} does not match the "
                    f"model's {tuple(target.shape)}"
                )
            target.copy_(value.to(target.dtype))
            del value
    return missing


def truncated_precision(cls: type, fp: FullPlan, dtype: torch.dtype, requested: str) -> memory.Precision:
    """What the truncated models compute in: float64 where one of them (they are built one at a time,
    the converted one with its untied heads) fits beside the runtime, by the in-memory path's rule
    (:func:`normswap.memory.choose_precision`), else float32. Each is built in float32 and then cast,
    so its peak is a float32 model's with a float64 copy; a float64 checkpoint's are float64 anyway."""
    numel = param_count_meta(cls, fp.proxy_config) + sum(u.numel for u in fp.proxy_plan.unties)
    built = torch.float64 if dtype == torch.float64 else torch.float32
    return memory.choose_precision(numel, built, requested, available=available_memory())


def own_rounding_error(model: nn.Module, probe: dict[str, Any], reference: Any, dtype: torch.dtype,
                       work: torch.dtype, drew: bool = False) -> tuple[float, str]:
    """The truncated original's own relative error in the checkpoints' ``dtype`` on ``probe``, and how it
    was found: the yardstick :func:`~normswap.surgery.verify.precision_limit` derives the tolerance from,
    as the in-memory path and ``normswap verify`` do. ``reference`` is its output computed in ``work``.
    Measured (the model run in ``dtype`` against its float64 run) where ``work`` is float64 and ``dtype``
    float32; else, where the model does not run in float32, and where it draws random numbers (``drew``: the
    same seed draws other numbers in another dtype), estimated by one rounding of every module's output in
    ``dtype`` (:func:`~normswap.surgery.verify.rounding_error`; a CPU computes bfloat16 slowly)."""
    if work == torch.float64 and dtype == torch.float32 and not drew:
        try:
            model.to(torch.float32)
            _, cast = inputs.cast_inputs((), probe, torch.float32)
            with torch.no_grad(), pipeline.default_dtype(torch.float32), same_draws(model):
                rounded = model(**cast)
            return (compare(reference, rounded, set()).get("max_rel_error", 0.0),
                    "against its float64 run, on the same layers and inputs")
        except Exception:  # noqa: BLE001 - the model's code refuses float32 (a dtype check): estimate instead
            model.to(work)

    def run() -> Any:
        with torch.no_grad(), pipeline.default_dtype(work), same_draws(model):
            return model(**probe)

    why = " (the model draws random numbers, which differ in another dtype)" if drew else ""
    return (rounding_error(model, run, reference, dtype),
            f"estimated by one rounding of every module's output in {str(dtype).removeprefix('torch.')}{why}")


def verify_truncated(
    cls: type,
    fp: FullPlan,
    meta: nn.Module,
    src_entries: dict[str, Entry],
    out_entries: dict[str, Entry],
    keys: KeyMap,
    out_keys: dict[str, str],
    dtype: torch.dtype,
    base: str,
    fmt: str = "native",
    precision: memory.Precision | None = None,
) -> dict[str, Any]:
    """Layers 0, 1 and L-1 (plus everything outside the stacks), original vs converted, computed in
    ``precision`` (float32 when not given; :func:`truncated_precision`). The converted weights are compared
    as written, rounded to the checkpoints' ``dtype``, so an exact conversion is held to what that rounding
    explains for this model, as in memory: :func:`~normswap.surgery.verify.precision_limit` of the truncated
    original's own error in ``dtype`` (:func:`own_rounding_error`), stated with its derivation in
    ``verify_precision``."""
    precision = precision or memory.Precision(torch.float32, "not chosen")
    work = precision.dtype
    converted = [sp for sp in fp.plan.sites if sp.convert]
    exact = all(sp.verdict != "approximate" for sp in converted)
    own, how = None, ""  # the original's own error in ``dtype``: what the tolerance is derived from
    config = fp.proxy_config
    probe = None
    outputs = []
    for which in ("original", "converted"):
        if which == "original":
            model = build_proxy(cls, config, work, fp.left_out)
            reader, names = Reader(src_entries), keys.to_ckpt
        else:
            cfg = copy.deepcopy(config)
            if fp.plan.unties:
                holder = nn.Module()
                holder.config = cfg
                mark_untied(holder)
            if fmt == "native":
                setattr(
                    cfg,
                    hf.MANIFEST_KEY,
                    {
                        "plan": fp.proxy_plan.to_dict(),
                        "base_model_type": base,
                        "architecture": cls.__name__,
                        "base_model_prefix": hf.prefix_of(meta),
                        hf.LEFT_OUT_KEY: list(fp.left_out),
                    },
                )
                target_cls = hf.model_class_for(base, cls.__name__)
            else:
                target_cls = cls
            previous = torch.random.get_rng_state()
            torch.manual_seed(0)
            try:
                model = target_cls(cfg).to(work).eval()
            finally:
                torch.random.set_rng_state(previous)
            if fmt != "native":  # the native class drops them itself, from the manifest
                hf.drop_modules(model, list(fp.left_out))
            reader, names = Reader(out_entries), out_keys
        missing = load_truncated(
            model, fp.depths, fp.proxy_depths, lambda n, r=reader, k=names: r.get(k[n]) if n in k else None
        )
        reader.close()
        tied = (
            set(model.get_expanded_tied_weights_keys(all_submodels=True))
            if hasattr(model, "get_expanded_tied_weights_keys")
            else set()
        )
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        lacking = sorted(m for m in missing if m in params and m not in tied)
        if lacking:
            raise NormswapError(f"the {which} checkpoint lacks {lacking[0]}; verification impossible")
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        model.eval()
        if probe is None:
            probe = inputs.cast_inputs((), inputs.hf_example_inputs(model, batch=2, seq=8, seed=4242), work)[1]
        with torch.no_grad(), pipeline.default_dtype(work), same_draws(model) as draws:
            outputs.append(model(**probe))
        if which == "original" and exact and dtype != torch.float64:
            own, how = own_rounding_error(model, probe, outputs[0], dtype, work, draws.drew)
        dropped = weakref.ref(model)
        del model
        memory.release(dropped)
    figures = compare(outputs[0], outputs[1], set(fp.plan.changed_outputs), axes=fp.plan.changed_output_axes)
    result: dict[str, Any] = {
        f"truncated_{k}": v
        for k, v in figures.items()
        if k in ("max_abs_error", "max_rel_error", "kl", "top1_agreement", "raw_stream_rel_error")
    }
    result["truncated_layers"] = (
        ", ".join(
            f"{p}: {sorted({representative(t, n, fp.proxy_depths[p]) for t in range(fp.proxy_depths[p])})}"
            for p, n in fp.depths.items()
        )
        or "all"
    )
    limit, gated = gate_text(converted, dtype, True, own, how)
    stored = str(dtype).removeprefix("torch.")
    if own is not None:
        result["own_rounding_error"] = own
    result.update(precision.figures(limit, f"{gated}; the converted weights as written, in {stored}" if exact
                                    else gated,
                                    subject=f"layers {result['truncated_layers']} verified on the real weights"))
    worst = max(figures.get("max_rel_error", 0.0), figures.get("raw_stream_rel_error", 0.0))
    if exact and limit is not None and worst > limit:
        raise VerificationFailed(
            f"verification failed: the streamed checkpoint's layers {result['truncated_layers']} differ from "
            f"the original by {worst:.3g} (relative; {gated}); nothing was written"
        )
    return result
