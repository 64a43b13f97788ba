"""Scale migration in the rotated basis: a per-channel scale between a norm's weight and its readers.

After a rotation every norm of a turned stream has unit weight (γ went into its readers' columns), so
``rms_norm(x Q) = rms_norm(x) Q`` holds. A per-channel weight ``g`` *in the rotated basis* keeps it:
the norm computes ``rms_norm(x Q) ⊙ g``, and each reader ``W`` (input features already turned,
``W Q``) takes ``diag(1/g)`` on its input columns, so ``(W Q diag(1/g)) (g ⊙ u Q) = W (u Q)``: exact, for
any ``g > 0``. What ``g`` cannot do is act before the turn: ``rms_norm(x Q) ⊙ γ ≠ (rms_norm(x) ⊙ γ) Q``
unless ``γ`` is uniform, so the original γ stays folded in the readers and only a scale chosen in the
rotated basis can live in the norm.

That freedom is SmoothQuant's migration of range between activations and weights (Xiao et al. 2023):
with ``a_j = max|u_j|`` over calibration tokens of the norm's rotated output and ``w_j = max|W_:,j|`` over
the readers' columns, ``s_j = a_j^α / w_j^(1-α)``, the norm's weight becomes ``1/s`` and the readers'
columns ``× s``, so activation and weight channel ranges meet at ``sqrt``-like balance for ``α = 0.5``.
The norm's weight stays a float multiply in every engine (ONNX Runtime's and CTranslate2's norms keep it
in float), so the quantizers see the smoothed activations and weights and nothing else changes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from normswap.analysis.linears import LinearView, linear_at, linear_module_kind
from normswap.analysis.plan import Plan
from normswap.errors import NormswapError
from normswap.nn.rmsnorm import RMSNorm


@dataclass
class Smoothing:
    """What :func:`smooth_` did: ``alpha``, the norms smoothed, and the ones left alone with why.

    ``scales`` maps each smoothed norm to its ``s`` (float64; the norm's weight became ``1/s``, its
    readers' input columns ``× s``); ``spread`` is ``max(s)/min(s)`` per norm, a one-number summary."""

    alpha: float
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def spread(self) -> dict[str, float]:
        return {n: float(s.max() / s.min()) for n, s in self.scales.items()}

    def headline(self) -> str:
        line = f"smoothed {len(self.scales)} norm(s) (alpha={self.alpha:g})"
        if self.skipped:
            name, why = next(iter(self.skipped.items()))
            line += f", {len(self.skipped)} left unsmoothed (`{name}`: {why})"
        return line


def check_alpha(alpha: float) -> float:
    """``alpha`` as a float in [0, 1], or a one-line error."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= float(alpha) <= 1.0:
        raise NormswapError(f"smooth must be a number in [0, 1] (SmoothQuant's alpha; 0.5 is the usual choice), "
                            f"not {alpha!r}")
    return float(alpha)


def calibration_batches(model: nn.Module, calibration: Any) -> list[tuple[tuple, dict]]:
    """``calibration`` as ``(args, kwargs)`` batches; without it, the built-in batches of a transformers model
    (two of eight: English text, generated images or speech); a custom model must pass it."""
    from normswap import inputs
    from normswap.surgery import calibrate

    if calibration is not None:
        return calibrate.user_batches(calibration)
    if not inputs.is_hf_model(model):
        raise NormswapError(f"smoothing measures activations: {type(model).__name__} is not a transformers model, "
                            "so pass calibration= (a tensor, a tuple or dict of model inputs, or a list of them)")
    batches, _ = calibrate.builtin_batches(model, batches=2, batch_size=8, seed=11)
    return batches


def _input_axis(module: nn.Module | LinearView) -> int:
    return 0 if linear_module_kind(module) == "conv1d" else 1  # HF Conv1D stores [in, out]


def targets(model: nn.Module, plan: Plan, rotated: Iterable[dict]) -> tuple[dict[str, list[str]], dict[str, str]]:
    """``({norm: its Linear readers}, {norm: why not})`` over the norms of the rotated streams.

    A norm can take a scale when it is a normswap ``RMSNorm`` with a weight, its output is read only by
    Linear readers (a rotation-ready norm that is not a model output), it was not turned back
    (``output="restore"``), and no reader's weight is also a writer of a stream (a head tied to the
    embedding: its columns are the embedding's features)."""
    sites = {sp.name: sp for sp in list(plan.sites) + list(plan.rms_sites)}
    writer_ids = {id(model.get_parameter(w)) for r in rotated for w in r.get("writers", [])}
    found: dict[str, list[str]] = {}
    skipped: dict[str, str] = {}
    for r in rotated:
        restored = set(r.get("restore", []))
        for name in r["norms"]:
            sp, module = sites.get(name), model.get_submodule(name)
            if name in restored:
                skipped[name] = "its input is turned back (output='restore'): it sees the unrotated stream"
            elif sp is None or sp.rotation_outputs or not sp.linear_readers:
                skipped[name] = "its output is a model output or has no Linear reader to take the scale"
            elif not isinstance(module, RMSNorm) or module.weight is None:
                skipped[name] = "not a normswap RMSNorm with a weight (a norm that was RMS from the start)"
            elif any(id(_param(model, rd)) in writer_ids for rd in sp.linear_readers):
                skipped[name] = "a reader's weight also writes the stream (tied embedding)"
            else:
                found[name] = sorted(set(sp.linear_readers))
    # a reader weight shared by two norms (layers that share weights) cannot take two scales: leave those alone
    users: dict[tuple, set[str]] = {}
    for name, readers in found.items():
        for rd in readers:
            users.setdefault(_rows(model, rd), set()).add(name)
    for norms in users.values():
        if len(norms) > 1:
            for name in norms:
                found.pop(name, None)
                skipped[name] = f"a reader's weight is shared with {len(norms) - 1} other norm(s) (shared layers)"
    return found, skipped


def _rows(model: nn.Module, reader: str) -> tuple:
    """What a scale on ``reader``'s columns touches: its weight parameter and the rows it uses."""
    module = linear_at(model, reader)
    if isinstance(module, LinearView):
        return id(module.weight_param), module.spec.rows
    return id(module.weight), None


def _param(model: nn.Module, reader: str) -> torch.Tensor:
    module = linear_at(model, reader)
    return module.weight_param if isinstance(module, LinearView) else module.weight


@torch.no_grad()
def activation_maxima(model: nn.Module, norms: Iterable[str],
                      batches: list[tuple[tuple, dict]]) -> dict[str, torch.Tensor]:
    """Per-channel ``max|y_j|`` of each norm's output over every token of ``batches`` (float64)."""
    maxima: dict[str, torch.Tensor] = {}
    handles = []

    def hook(name: str):
        def record(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            m = out.detach().abs().reshape(-1, out.shape[-1]).amax(0).double().cpu()
            maxima[name] = torch.maximum(maxima[name], m) if name in maxima else m
        return record

    for name in norms:
        handles.append(model.get_submodule(name).register_forward_hook(hook(name)))
    was_training = model.training
    model.eval()
    try:
        ref = next(iter(model.parameters()), None)

        def move(t: Any) -> Any:  # the model's device; floating inputs in its dtype
            if not isinstance(t, torch.Tensor) or ref is None:
                return t
            return t.to(ref.device, ref.dtype) if t.is_floating_point() else t.to(ref.device)

        for args, kwargs in batches:
            model(*[move(a) for a in args], **{k: move(v) for k, v in kwargs.items()})
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return maxima


def weight_maxima(model: nn.Module, readers: list[str]) -> torch.Tensor:
    """Per input channel ``max|W_:,j|`` over all ``readers`` (float64)."""
    cols = []
    for rd in readers:
        module = linear_at(model, rd)
        w = module.weight.detach().double().abs()
        cols.append(w.amax(dim=1 - _input_axis(module)).cpu())
    return torch.stack(cols).amax(0)


def scales(act: torch.Tensor, wmax: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's ``s_j = a_j^α / w_j^(1-α)``, geometric mean 1 (an overall factor changes no quantizer's
    rounding, only the norm weight's magnitude). Channels that are zero in either go to the median, so no
    scale is 0 or infinite."""
    tiny = 1e-12
    a, w = act.clamp_min(tiny), wmax.clamp_min(tiny)
    s = a.pow(alpha) / w.pow(1.0 - alpha)
    dead = (act <= tiny) | (wmax <= tiny)
    if bool(dead.all()):
        return torch.ones_like(s)
    if bool(dead.any()):
        s[dead] = s[~dead].median()
    return s / s.log().mean().exp()


@torch.no_grad()
def apply_(model: nn.Module, norm: str, readers: list[str], s: torch.Tensor) -> None:
    """Norm weight ``← weight / s`` (and a kept bias ``← bias / s``), readers' input columns ``× s``; float64,
    cast back once."""
    module = model.get_submodule(norm)
    for p in (module.weight, getattr(module, "bias", None)):
        if isinstance(p, torch.Tensor):
            p.copy_((p.double() / s.to(p.device)).to(p.dtype))
    for rd in readers:
        reader = linear_at(model, rd)
        w, axis = reader.weight, _input_axis(reader)
        shape = [1] * w.dim()
        shape[axis] = -1
        w.copy_((w.double() * s.to(w.device).reshape(shape)).to(w.dtype))


def reader_weight(model: nn.Module, reader: str) -> torch.Tensor:
    """The weight parameter a scale on ``reader``'s input columns multiplies."""
    return _param(model, reader)


def norm_tensors(model: nn.Module, norm: str) -> list[torch.Tensor]:
    """The norm's weight and (kept β) bias: what :func:`apply_` divides by ``s``."""
    module = model.get_submodule(norm)
    return [p for p in (getattr(module, "weight", None), getattr(module, "bias", None)) if isinstance(p, torch.Tensor)]


def smooth_(model: nn.Module, plan: Plan, rotated: list[dict], batches: list[tuple[tuple, dict]],
            alpha: float) -> Smoothing:
    """Scale-migrate every norm of the ``rotated`` streams that can take it (:func:`targets`), in place."""
    found, skipped = targets(model, plan, rotated)
    return smooth_found_(model, found, skipped, batches, alpha)


def smooth_found_(model: nn.Module, found: dict[str, list[str]], skipped: dict[str, str],
                  batches: list[tuple[tuple, dict]], alpha: float) -> Smoothing:
    """Scale-migrate each norm of ``found`` (``{norm: its Linear readers}``, as :func:`targets` gives) in
    place; ``skipped`` (``{norm: why not}``) is recorded as it is."""
    result = Smoothing(check_alpha(alpha))
    result.skipped = dict(skipped)
    if not found:
        return result
    if not batches:
        raise NormswapError("smoothing needs calibration inputs: pass calibration= (batches the model accepts)")
    act = activation_maxima(model, found, batches)
    for name, readers in found.items():
        if name not in act:
            result.skipped[name] = "the calibration inputs never reached it"
            continue
        s = scales(act[name], weight_maxima(model, readers), result.alpha)
        apply_(model, name, readers, s)
        result.scales[name] = s
    return result
