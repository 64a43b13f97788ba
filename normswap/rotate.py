"""Rotate a converted model's residual streams by an orthogonal matrix: the proof of rotation-readiness.

Rotation methods (SliceGPT, QuaRot, SpinQuant) rely on one invariance: if every norm on a stream
is an RMSNorm with unit weight, then ``rms_norm(x Q) = rms_norm(x) Q`` for any orthogonal ``Q``
(``Q Qᵀ = I`` keeps ``mean(x²)``); a bias the norm keeps (β/γ where β had no bias slot to fold
into) is part of the output and turns with it (``b ← b Q``). So multiplying every *writer*'s output features
by ``Q`` and every *reader*'s input features by ``Qᵀ`` leaves the model's outputs unchanged.

``normswap.patch(model, fold_gamma=True)`` produces such streams wherever the math allows, and the
plan records, per norm, whether its stream is ready and, if not, why (``SitePlan.rotation_ready``,
``SitePlan.rotation_reason``). :func:`rotate` applies a rotation to every ready stream, in float64,
cast back once. Streams are the connected groups of norms that share writers (a decoder stream,
an encoder stream, a vision tower's stream): each is rotated as a whole or not at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.norm import RMSNorm
from normswap.plan import Plan, SitePlan, plan_of


@dataclass
class Rotation:
    """What :func:`rotate` did: the streams rotated and the ones left alone, with reasons."""

    rotated: list[dict] = field(default_factory=list)  # {"width", "norms", "writers", "readers"}
    skipped: list[dict] = field(default_factory=list)  # {"norms", "reason"}

    def __str__(self) -> str:
        lines = [f"rotated stream of width {r['width']}: {len(r['norms'])} norm(s), {len(r['writers'])} writer "
                 f"tensor(s), {len(r['readers'])} reader(s)" for r in self.rotated]
        lines += [f"not rotated ({len(s['norms'])} norm(s), e.g. `{s['norms'][0]}`): {s['reason']}"
                  for s in self.skipped]
        return "\n".join(lines) or "no stream to rotate"


def random_orthogonal(n: int, seed: int = 0) -> torch.Tensor:
    """A Haar-random ``n × n`` orthogonal matrix in float64 (QR of a Gaussian, signs fixed)."""
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


def streams(plan: Plan, model: nn.Module | None = None) -> list[list[SitePlan]]:
    """Converted norms grouped into streams: norms that share a centered writer read the same stream.

    With ``model``, writers are matched by parameter identity (a tied embedding has two names).
    """
    sites = [sp for sp in plan.sites if sp.convert]
    parent = list(range(len(sites)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[object, int] = {}
    for i, sp in enumerate(sites):
        for name in sp.writer_targets:
            target = id(model.get_parameter(name)) if model is not None else name
            if target in owner:
                parent[find(i)] = find(owner[target])
            else:
                owner[target] = i
    groups: dict[int, list[SitePlan]] = {}
    for i, sp in enumerate(sites):
        groups.setdefault(find(i), []).append(sp)
    return list(groups.values())


def _blocker(model: nn.Module, plan: Plan, group: list[SitePlan]) -> str:
    not_ready = next((sp for sp in group if not sp.rotation_ready), None)
    if not_ready is not None:
        return f"`{not_ready.name}`: {not_ready.rotation_reason or 'not rotation-ready'}"
    widths = {tuple(sp.normalized_shape) for sp in group}
    if len(widths) != 1:
        return f"norms of different widths share writers ({sorted(widths)})"
    edits = {e.target: e for e in plan.writer_edits}
    targets = {t for sp in group for t in sp.writer_targets}
    if not targets:
        return "no centered writer recorded (a plan read back from a manifest has no stream details: " \
            "rotate right after normswap.patch)"
    for t in sorted(targets):
        if t not in edits or edits[t].blocks is not None:
            return f"writer `{t}` is centered per block, not over the whole stream"
    for sp in group:
        module = model.get_submodule(sp.name)
        if not isinstance(module, RMSNorm):
            return f"`{sp.name}` is not an RMSNorm"
        if module.weight is not None and not bool((module.weight == 1).all()):
            return f"`{sp.name}` weight is not 1 (convert with fold_gamma=True)"
    return ""


def _rotate_axis_(p: torch.Tensor, axis: int, q: torch.Tensor) -> None:
    """``p`` with its ``axis`` features multiplied by ``q`` (row-vector convention), fp64, cast once."""
    w = p.detach().double().movedim(axis, -1)
    with torch.no_grad():
        p.copy_((w @ q).movedim(-1, axis).to(p.dtype))


def rotate(model: nn.Module, q: torch.Tensor | int = 0) -> Rotation:
    """Multiply every rotation-ready residual stream of a converted model by an orthogonal matrix.

    Args:
        model: a model converted by ``normswap.patch(model, fold_gamma=True)`` (or loaded with
            ``normswap.load``), in place.
        q: an orthogonal ``d × d`` matrix applied to every ready stream of width ``d``, or an int
            seed: each stream then gets its own random orthogonal matrix (seed, seed + 1, ...).

    Returns:
        A :class:`Rotation` listing the streams rotated and, for the others, why not.

    Writers' output features become ``x Q`` (Linear/Conv1D/conv/Embedding weights and biases, raw
    position/cls parameters); readers' input features become ``Qᵀ`` (``W ← W Q``). Outputs are
    unchanged up to float rounding; raw residual-stream outputs (``hidden_states``) come out
    rotated.
    """
    plan: Plan | None = plan_of(model)
    if plan is None:
        raise NormswapError("model was not converted by normswap; run normswap.patch(model, fold_gamma=True) first")
    if isinstance(q, torch.Tensor):
        q64 = q.detach().double().cpu()
        if q64.dim() != 2 or q64.shape[0] != q64.shape[1]:
            raise NormswapError(f"q must be a square matrix, got shape {tuple(q.shape)}")
        if float((q64.T @ q64 - torch.eye(q64.shape[0], dtype=torch.float64)).abs().max()) > 1e-6:
            raise NormswapError("q is not orthogonal (qᵀq differs from the identity by more than 1e-6)")
    elif isinstance(q, int) and not isinstance(q, bool):
        q64 = None
    else:
        raise NormswapError(f"q must be an orthogonal matrix or an int seed, not {type(q).__name__}")

    result = Rotation()
    edits = {e.target: e for e in plan.writer_edits}
    todo: list[tuple[list[SitePlan], torch.Tensor]] = []
    for i, group in enumerate(streams(plan, model)):
        names = [sp.name for sp in group]
        why = _blocker(model, plan, group)
        width = group[0].normalized_shape[0]
        if not why and q64 is not None and q64.shape[0] != width:
            why = f"q is {q64.shape[0]}×{q64.shape[0]} but this stream has width {width}"
        if why:
            result.skipped.append({"norms": names, "reason": why})
            continue
        todo.append((group, q64 if q64 is not None else random_orthogonal(width, q + i)))
    # every parameter is rotated at most once per side; check before touching anything
    writer_params = [id(model.get_parameter(t)) for group, _ in todo
                     for t in sorted({t for sp in group for t in sp.writer_targets})]
    reader_params = [id(model.get_submodule(r).weight) for group, _ in todo
                     for r in sorted({r for sp in group for r in sp.linear_readers})]
    if len(set(reader_params)) != len(reader_params) or set(writer_params) & set(reader_params):
        raise NormswapError("streams share a writer or a reader; this model cannot be rotated stream by stream")
    for group, rot in todo:
        by_id = {id(model.get_parameter(t)): t for sp in group for t in sorted(sp.writer_targets)}
        writers = sorted(by_id.values())  # a tied parameter is rotated once
        readers = sorted({r for sp in group for r in sp.linear_readers})
        for t in writers:
            p = model.get_parameter(t)
            _rotate_axis_(p, edits[t].axis, rot.to(p.device))
        for sp in group:  # a kept bias is part of the norm's output: it turns with the stream
            bias = model.get_submodule(sp.name).bias
            if bias is not None:
                _rotate_axis_(bias, 0, rot.to(bias.device))
        for r in readers:
            module = model.get_submodule(r)
            in_axis = 0 if type(module).__name__ == "Conv1D" else 1  # HF Conv1D stores [in, out]
            _rotate_axis_(module.weight, in_axis, rot.to(module.weight.device))
        result.rotated.append({"width": rot.shape[0], "norms": [sp.name for sp in group], "writers": writers,
                               "readers": readers})
    return result
