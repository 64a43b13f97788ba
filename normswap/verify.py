"""Compare an original and a converted model's outputs: the figures every conversion reports.

Figures (on the model's primary output: ``logits`` when there is one, else the first floating
output that is not a raw residual stream):
``max_abs_error``, ``max_rel_error`` (max abs error / max abs reference), ``rel_rms_error``
(‖error‖ / ‖reference‖), ``kl`` (mean KL of the
softmax over the last dim, reference ‖ converted), ``top1_agreement``.
"""

from __future__ import annotations

from typing import Any

import torch

PRIMARY_KEYS = ("logits", "logits_per_image", "pooler_output", "image_embeds", "text_embeds",
                "last_hidden_state", "prediction_logits", "start_logits")


def flatten_outputs(obj: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(obj, torch.Tensor):
        out.append((prefix or "output", obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out += flatten_outputs(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            out += flatten_outputs(v, f"{prefix}[{i}]")
    return out


def comparable(obj: Any, skip: set[str]) -> dict[str, torch.Tensor]:
    """Floating outputs worth comparing: not cached keys/values, not documented raw-stream outputs."""
    return {k: v for k, v in flatten_outputs(obj)
            if v.is_floating_point() and k not in skip and "past_key_values" not in k
            and not k.startswith("hidden_states") and "encoder_hidden_states" not in k}


def primary_key(outputs: dict[str, torch.Tensor]) -> str | None:
    for key in PRIMARY_KEYS:
        if key in outputs:
            return key
    return next(iter(outputs), None)


def figures(reference: torch.Tensor, converted: torch.Tensor) -> dict[str, float]:
    ref, out = reference.detach().double(), converted.detach().double()
    err = (out - ref).abs()
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    norm = float(ref.norm()) if ref.numel() else 0.0
    result = {
        "max_abs_error": float(err.max()) if err.numel() else 0.0,
        "max_rel_error": float(err.max()) / scale if scale > 0 else 0.0,
        # ‖out − ref‖ / ‖ref‖ over the whole output: the stable figure for comparing two roundings
        "rel_rms_error": float((out - ref).norm()) / norm if norm > 0 else 0.0,
    }
    if ref.dim() >= 1 and ref.shape[-1] > 1 and ref.numel():
        logp_ref = torch.log_softmax(ref, -1)
        logp_out = torch.log_softmax(out, -1)
        result["kl"] = float((logp_ref.exp() * (logp_ref - logp_out)).sum(-1).mean())
        result["top1_agreement"] = float((ref.argmax(-1) == out.argmax(-1)).double().mean())
    return result


def compare(reference: Any, converted: Any, skip: set[str] = frozenset()) -> dict[str, Any]:
    """Figures for the primary output plus the worst relative error over every compared output."""
    ref, out = comparable(reference, set(skip)), comparable(converted, set(skip))
    keys = [k for k in ref if k in out and ref[k].shape == out[k].shape]
    if not keys:
        return {"compared": []}
    key = primary_key({k: ref[k] for k in keys})
    result: dict[str, Any] = {"output": key, **figures(ref[key], out[key])}
    result["worst_rel_error_any_output"] = max(figures(ref[k], out[k])["max_rel_error"] for k in keys)
    result["compared"] = keys
    return result


def dtype_error_ratio(original: dict[str, Any], converted: dict[str, Any]) -> float | None:
    """Converted-in-dtype error over original-in-dtype error, both against the float64 original.

    Takes two :func:`compare` results (same reference, same output key) and divides their
    ``rel_rms_error``. 1.0 means the conversion added nothing to what the dtype costs anyway.
    """
    a, b = original.get("rel_rms_error"), converted.get("rel_rms_error")
    if a is None or b is None or original.get("output") != converted.get("output"):
        return None
    return b / a if a > 0 else (1.0 if b == 0 else float("inf"))
