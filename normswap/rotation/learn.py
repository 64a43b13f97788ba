"""A residual-stream rotation chosen from data: SpinQuant's R1 by the Cayley transform, on a fake-quantized copy.

A fixed rotation (the randomized Hadamard) evens out a stream's channels on average; which orthogonal ``Q``
is best for a given quantizer depends on the model's weights and activations. SpinQuant (Liu et al. 2024)
learns it: minimise the quantized model's output error over orthogonal matrices, starting from the Hadamard.
Here, per stream, ``Q = Q₀ · R(S)`` with ``Q₀`` the mean-keeping randomized Hadamard that ``rotate(...,
"hadamard")`` builds and

    R(S) = (I − A/2)⁻¹ (I + A/2),   A = P (S − Sᵀ) P,   P = I − 11ᵀ/d,

the Cayley transform of a skew-symmetric ``A``: orthogonal for every ``S`` (to float64 rounding, so the
rotated float model equals the original), equal to ``I`` at ``S = 0`` (the search starts at the Hadamard),
and ``R·1 = 1`` because ``A·1 = 0``, so ``Q·1 = Q₀·1 = 1`` keeps zero-mean streams zero-mean (compat format,
centering ops) exactly as the fixed matrices do. ``S`` is a free ``d × d`` parameter, optimised by Adam.

Where the stream quantizes better unturned (a stream lighter-tailed than Gaussian: rotation makes it *more*
Gaussian), the search starts from ``R = Q₀ᵀ`` instead (``Q = Q₀ Q₀ᵀ cayley(S)``: no rotation, then the
learned one); both starts are scored on every calibration batch first.

The loss is the fake-quantized model's output error against the float model on the calibration batches:
every ``nn.Linear`` / transformers ``Conv1D`` weight rounded to ``bits`` (symmetric absmax, one scale per
output channel or per ``group_size`` inputs) and, with ``act_bits``, every such module's input rounded per
token, both with straight-through rounding (the scales stay differentiable). The weights are the copy's,
turned by ``R`` through ``torch.func.functional_call`` (nothing is written into the model while learning);
the rotation ops a stream already has (``output="restore"``'s ``Qᵀ``, a centering op's ``Q``) take ``R`` too.

With ``scales=True`` a per-channel scale ``s > 0`` per norm (in the rotated basis) is learned with ``R``:
the norm's unit weight becomes ``1/s`` and its Linear readers' input columns ``× s`` (the migration
:mod:`normswap.rotation.smooth` makes with SmoothQuant's formula; exact for any ``s``), parametrised as
``s = exp(t − mean t)`` so an overall factor, which no quantizer's rounding sees, is not a free direction.
A weight-only block quantizer (``MatMulNBits``) sees only the readers' columns, so the scale evens the
columns of each block of 32 out; with ``act_bits`` it trades activation against weight ranges as
SmoothQuant does, but chosen against the quantized model's output error rather than by a formula.

With ``heads=True`` SpinQuant's R2 is learned with ``R``: per attention layer one orthogonal ``h × h`` matrix
``R2 = cayley(S2)`` (``h`` the head size; no mean to keep: the values are no normed stream), shared by the
layer's heads, turning each head's values ``v_h → v_h R2`` (the value projection's rows and bias, per head) and
the output projection's input columns of each head by the same ``R2``. Attention is linear in each head's
values, so ``softmax(.) V_h R2 R2ᵀ W_o,hᵀ = softmax(.) V_h W_o,hᵀ``: exact for any orthogonal ``R2``, and
grouped-query heads share it. It evens out the ranges of the value projection's rows and the output
projection's per-head column blocks, which a block-wise weight quantizer rounds together.

Cost: one forward and backward of the fake-quantized model per step, plus a ``d × d`` solve per stream, and
one float copy of the model. A few hundred steps of a 4-layer, width-64 toy take seconds on one CPU core;
a 7B model is SpinQuant's territory (a GPU, ~800 steps of 800 samples in its paper).

This module knows nothing of how a stream is found or turned: :func:`normswap.rotation.rotate.rotate`
hands it, per stream, the names of the tensors its rotation multiplies (:class:`StreamTensors`), and takes
back each stream's ``R``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from normswap.errors import NormswapError
from normswap.rotation.heads import turn_heads

GRIDS = ("symmetric", "full", "asymmetric")
# logit_top_k: how many of the other tokens (drawn once per batch) estimate the quantized model's tail mass
LOGIT_TAIL_SAMPLE = 2048


@dataclass(frozen=True)
class LearnSettings:
    """What the learned rotation optimises for and how long.

    ``bits``: weight bits of the fake quantizer (2-8; default 4). ``act_bits``: per-token activation bits,
    or None for weight-only quantization. ``group_size``: one weight scale per this many inputs (None: per
    output channel). ``steps``: optimiser steps (one calibration batch each, cycling). ``lr``: Adam's step on
    the skew parameter. ``grid``: the weights' integer grid: ``"symmetric"`` (levels ``±(2^(b−1) − 1)``, step
    ``max|w|/(2^(b−1) − 1)``: RTN, CTranslate2, torchao), ``"full"`` (levels ``−2^(b−1) … 2^(b−1) − 1``, the
    block's largest magnitude at ``−2^(b−1)``: ONNX Runtime's symmetric ``MatMulNBits``) or ``"asymmetric"``
    (levels ``0 … 2^b − 1`` from the block's minimum to its maximum, with a zero point: the start HQQ refines,
    asymmetric ``MatMulNBits``, NNCF/llama.cpp-style asymmetric int4), or several joined by ``+``
    (``"full+asymmetric"``): the steps take the grids in turn and the checkpoints are scored on their mean, so
    the rotation is fitted to no single rounding. A rotation learned on one grid need not carry to another
    (``docs/results/quantization.md``: fitted to the full grid alone, Whisper's HQQ error rose). ``scales``:
    also learn a per-channel scale between each norm of a rotated stream and its Linear readers (its log at ten
    times ``lr``). ``heads``: also learn SpinQuant's R2, one orthogonal head-size matrix per attention layer on
    its values and output projection (:class:`HeadTensors`). ``logit_top_k``: for a model whose output is
    logits, compare them on a subset of the vocabulary only: per calibration batch, the union over its positions
    of the float model's ``k`` likeliest tokens and the batch's input tokens, plus one "every other token" class:
    the KL is taken over those tokens and that class, whose float probability is exact (from the float logits)
    and whose quantized probability is estimated from :data:`LOGIT_TAIL_SAMPLE` of the other tokens drawn once
    per batch (their summed ``exp`` scaled by how many they stand for), so probability the rounding moves into
    the tail still counts. The output head and the input embedding are turned (and the head rounded) on those
    rows alone. A large vocabulary's head is otherwise most of a step's work (Whisper's 51,865 × 384 against 7M
    decoder weights); each row of the head is rounded on its own (groups run along its inputs), so the rows kept
    are rounded exactly as in the whole head."""

    bits: int = 4
    act_bits: int | None = None
    group_size: int | None = None
    steps: int = 100
    lr: float = 1e-3
    grid: str = "symmetric"
    scales: bool = False
    heads: bool = False
    logit_top_k: int | None = None

    def __post_init__(self) -> None:
        parts = self.grid.split("+") if isinstance(self.grid, str) else [None]
        if any(g not in GRIDS for g in parts) or len(set(parts)) != len(parts):
            raise NormswapError(f"learned rotation: grid must be one of {', '.join(GRIDS)}, or several of them "
                                f"joined by '+' (e.g. 'full+asymmetric'), not {self.grid!r}")
        for name, lo, hi, optional in (("bits", 2, 8, False), ("act_bits", 2, 16, True)):
            v = getattr(self, name)
            if v is None and optional:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise NormswapError(f"learned rotation: {name} must be an int in [{lo}, {hi}]"
                                    f"{' or None' if optional else ''}, not {v!r}")
        g = self.group_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g < 2):
            raise NormswapError(f"learned rotation: group_size must be an int ≥ 2 or None, not {g!r}")
        k = self.logit_top_k
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise NormswapError(f"learned rotation: logit_top_k must be an int ≥ 1 or None, not {k!r}")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or not 0 <= self.steps <= 100_000:
            raise NormswapError(f"learned rotation: steps must be an int in [0, 100000], not {self.steps!r}")
        for flag in ("scales", "heads"):
            if not isinstance(getattr(self, flag), bool):
                raise NormswapError(f"learned rotation: {flag} must be True or False, not {getattr(self, flag)!r}")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not 0 < float(self.lr) < 10:
            raise NormswapError(f"learned rotation: lr must be a number in (0, 10), not {self.lr!r}")

    @property
    def grids(self) -> tuple[str, ...]:
        """The grids the loss takes in turn (one, unless ``grid`` joins several with ``+``)."""
        return tuple(self.grid.split("+"))

    def describe(self) -> str:
        what = f"W{self.bits}" + (f"A{self.act_bits}" if self.act_bits else "") \
            + (f", groups of {self.group_size}" if self.group_size else "") \
            + (f", {self.grid} grid" if self.grid != "symmetric" else "") \
            + (", learned scales" if self.scales else "") + (", learned head rotations" if self.heads else "") \
            + (f", KL on the top {self.logit_top_k} logits" if self.logit_top_k else "")
        return f"{what}, {self.steps} steps"


@dataclass
class StreamTensors:
    """What turning one stream by ``R`` multiplies, by name in the model: ``turned`` = ``(parameter, axis,
    rows)`` whose ``axis`` features become ``· R`` (writers' output features, kept norm biases, readers' input
    features; ``rows = (start, stop, row_axis)`` where only some rows of the parameter are one reader's, as a
    stacked q/k/v weight), ``restore`` = buffers holding a ``Qᵀ`` (they become ``Rᵀ Qᵀ``), ``ops`` = buffers
    holding a ``Q`` (they become ``Q R``). ``scaled`` = the norms that can take a learned per-channel scale
    (``LearnSettings.scales``): ``(norm, [its weight and kept bias], [(reader weight, input axis, rows)])``."""

    key: str  # the stream's first norm
    width: int
    undo: torch.Tensor | None = None  # Q₀ᵀ: R = Q₀ᵀ turns the stream back (the no-rotation start)
    turned: list[tuple[str, int, tuple[int, int, int] | None]] = field(default_factory=list)
    restore: list[str] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    scaled: list[tuple[str, list[str], list[tuple[str, int, tuple[int, int, int] | None]]]] = \
        field(default_factory=list)


@dataclass
class HeadTensors:
    """One attention layer's values and output projection, for R2 (``LearnSettings.heads``): ``turned`` =
    ``(parameter, axis)`` whose ``axis`` runs over whole heads of ``head_dim`` features, each block of which
    becomes ``· R2`` (the value projection's weight rows and bias, the output projection's input columns)."""

    key: str  # the attention module's path
    head_dim: int
    turned: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class Learned:
    """What the optimisation did: the settings, the loss (relative squared output error of the fake-quantized
    model, mean over the calibration batches) at the Hadamard start and at the end, and the time taken.
    ``kept_start`` is True where the learned matrix did no better on the calibration batches than the start,
    so the start (``R = I``) was kept."""

    settings: LearnSettings
    loss_start: float
    loss_end: float
    seconds: float
    kept_start: bool
    history: list[float] = field(default_factory=list)
    start: str = "hadamard"  # or "identity": the stream unrotated scored better than the Hadamard on the data
    loss_hadamard: float = float("nan")
    loss_identity: float = float("nan")
    scales: dict[str, torch.Tensor] = field(default_factory=dict)  # norm → s (float64), with settings.scales
    heads: dict[str, torch.Tensor] = field(default_factory=dict)  # attention path → R2 (float64), settings.heads

    def headline(self) -> str:
        line = (f"learned rotation ({self.settings.describe()}, {self.seconds:.1f} s): fake-quant output error "
                f"{self.loss_start:.3g} at the {self.start} start → {self.loss_end:.3g}")
        if self.start == "identity":
            line += f" (the Hadamard scored {self.loss_hadamard:.3g})"
        if self.scales:
            spread = max(float(s.max() / s.min()) for s in self.scales.values())
            line += f"; {len(self.scales)} norm scale(s) learned (largest spread max/min {spread:.3g})"
        if self.heads:
            line += f"; {len(self.heads)} head rotation(s) learned"
        return line + (f" (no gain: the {self.start} start kept)" if self.kept_start else "")

    def record(self) -> dict:
        """The manifest's fields (plain numbers)."""
        s = self.settings
        return {"bits": s.bits, "act_bits": s.act_bits, "group_size": s.group_size, "steps": s.steps, "lr": s.lr,
                "grid": s.grid, "scales": s.scales, "scaled_norms": sorted(self.scales),
                "heads": s.heads, "head_rotations": sorted(self.heads), "logit_top_k": s.logit_top_k,
                "start": self.start, "loss_hadamard": self.loss_hadamard, "loss_identity": self.loss_identity,
                "loss_start": self.loss_start, "loss_end": self.loss_end, "kept_start": self.kept_start}


@dataclass(frozen=True)
class Progress:
    """Where a learning run stands (``optimise``'s ``progress`` callback): after ``step`` of ``steps``, the
    loss of the matrices now (``score``, on every calibration batch and grid) and of the best so far
    (``best_loss``; the start counts), ``best`` = each stream's best matrix so far (float64; from ``optimise``
    ``{stream key: R}``, the stream's matrix being ``Q₀ R``; from ``normswap.rotate(..., progress=)`` ``{first
    norm: Q₀ R}`` itself), the per-step losses so far and the seconds taken."""

    step: int
    steps: int
    start: str
    score: float
    best_loss: float
    best: dict[str, torch.Tensor]
    history: list[float]
    seconds: float


def cayley(skew_param: torch.Tensor, keep_mean: bool = True) -> torch.Tensor:
    """``R = (I − A/2)⁻¹(I + A/2)`` with ``A = P (S − Sᵀ) P``: orthogonal, ``R·1 = 1``, ``R = I`` at ``S = 0``.
    ``keep_mean=False``: ``A = S − Sᵀ`` (any rotation near ``I``; for features no centering relies on)."""
    d = skew_param.shape[0]
    eye = torch.eye(d, dtype=skew_param.dtype, device=skew_param.device)
    a = skew_param - skew_param.T
    if keep_mean:
        proj = eye - 1.0 / d
        a = proj @ a @ proj
    return torch.linalg.solve(eye - a / 2, eye + a / 2)


def fake_quant(x: torch.Tensor, bits: int, dim: int, group_size: int | None = None,
               grid: str = "symmetric") -> torch.Tensor:
    """Symmetric absmax round-to-nearest along ``dim`` (one scale per slice, or per ``group_size`` entries of
    it), with the straight-through estimator: the forward value is rounded, the gradient passes as if not.
    ``grid="full"``: ONNX Runtime ``MatMulNBits``' symmetric grid (the largest magnitude at ``−2^(b−1)``).
    ``grid="asymmetric"``: ``2^b`` levels from the slice's minimum to its maximum (scale ``(max − min)/(2^b − 1)``,
    an integer zero point), the grid asymmetric int4 quantizers use and HQQ starts its search from."""
    qmax = 2 ** (bits - 1) - 1
    moved = x.movedim(dim, -1)
    n = moved.shape[-1]
    if group_size is not None and n % group_size == 0 and n > group_size:
        work = moved.reshape(*moved.shape[:-1], n // group_size, group_size)
    else:
        work = moved
    if grid == "asymmetric":  # min → level 0, max → level 2^b − 1 (the zero point rounded, as engines store it)
        lo, hi = work.amin(-1, keepdim=True), work.amax(-1, keepdim=True)
        scale = ((hi - lo) / (2 ** bits - 1)).clamp_min(1e-12)
        zero = (-lo / scale).round().detach()
        rounded = ((work / scale).round() + zero).clamp(0, 2 ** bits - 1).sub(zero) * scale
    elif grid == "full":  # scale = signed max / −2^(b−1): that entry lands on the grid's far end
        peak = torch.gather(work, -1, work.abs().argmax(-1, keepdim=True))
        scale = peak / -(qmax + 1)
        scale = torch.where(scale.abs() < 1e-12, torch.full_like(scale, 1e-12), scale)
        rounded = (work / scale).round().clamp(-qmax - 1, qmax) * scale
    else:
        scale = work.abs().amax(-1, keepdim=True).clamp_min(1e-12) / qmax
        rounded = (work / scale).round().clamp(-qmax, qmax) * scale
    q = work + (rounded - work).detach()
    return q.reshape(moved.shape).movedim(-1, dim)


def _input_axis(module: nn.Module) -> int | None:
    """The weight's input-feature axis of a matmul the loss quantizes (Linear: 1, HF Conv1D: 0), else None."""
    if isinstance(module, nn.Linear):
        return 1
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None and module.weight.dim() == 2:
        return 0
    return None


def _on_rows(p: torch.Tensor, rows: tuple[int, int, int] | None,
             edit: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``edit(p)``, or, where ``rows = (start, stop, row_axis)`` is given, ``p`` with only those rows edited
    (a packed tensor's slice of one stream); differentiable."""
    if rows is None:
        return edit(p)
    start, stop, row_axis = rows
    parts = [p.narrow(row_axis, 0, start), edit(p.narrow(row_axis, start, stop - start)),
             p.narrow(row_axis, stop, p.shape[row_axis] - stop)]
    return torch.cat(parts, dim=row_axis)


def _turn(p: torch.Tensor, axis: int, r: torch.Tensor, rows: tuple[int, int, int] | None) -> torch.Tensor:
    """``p`` with its ``axis`` features times ``r`` (only rows ``rows`` of it, where given); differentiable."""
    return _on_rows(p, rows, lambda t: (t.movedim(axis, -1) @ r.to(t.dtype)).movedim(-1, axis))


def _scale(p: torch.Tensor, axis: int, s: torch.Tensor, rows: tuple[int, int, int] | None) -> torch.Tensor:
    """``p`` with its ``axis`` features times ``s`` (only rows ``rows`` of it, where given); differentiable."""
    shape = [1] * p.dim()
    shape[axis] = -1
    return _on_rows(p, rows, lambda t: t * s.to(t.dtype).reshape(shape))


def norm_scales(logs: torch.Tensor) -> torch.Tensor:
    """``s = exp(t − mean t)``: positive, geometric mean 1 (an overall factor changes no rounding)."""
    return (logs - logs.mean()).exp()


def output_tensor(out: Any) -> torch.Tensor:
    """The model output the loss compares: a tensor itself, else ``logits``, ``last_hidden_state``, or the first
    tensor of a tuple/ModelOutput."""
    if torch.is_tensor(out):
        return out
    for name in ("logits", "last_hidden_state"):
        v = getattr(out, name, None)
        if torch.is_tensor(v):
            return v
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else []
    for v in items:
        if torch.is_tensor(v):
            return v
    raise NormswapError(f"learned rotation: the model's output ({type(out).__name__}) holds no tensor to compare")


class _Quantized:
    """The fake quantizer around ``functional_call``: weights rounded in the parameter dict, inputs by pre-hooks."""

    def __init__(self, model: nn.Module, settings: LearnSettings) -> None:
        self.model, self.s = model, settings
        self.weights = {f"{path}.weight" if path else "weight": _input_axis(m)
                        for path, m in model.named_modules() if _input_axis(m) is not None}
        self.handles: list = []

    def __enter__(self) -> _Quantized:
        if self.s.act_bits is not None:
            bits = self.s.act_bits

            def hook(module: nn.Module, args: tuple) -> tuple:
                if not args or not torch.is_tensor(args[0]) or not args[0].is_floating_point():
                    return args
                return (fake_quant(args[0], bits, -1), *args[1:])

            self.handles = [m.register_forward_pre_hook(hook) for m in self.model.modules()
                            if _input_axis(m) is not None]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()

    def params(self, turned: dict[str, torch.Tensor], grid: str) -> dict[str, torch.Tensor]:
        """Every quantized weight, rounded on ``grid`` (the turned value where the rotation changed it), plus the
        turned tensors that are not quantized weights (biases, raw parameters, rotation-op buffers)."""
        out = dict(turned)
        state = dict(self.model.named_parameters(remove_duplicate=False))
        for name, axis in self.weights.items():
            w = turned.get(name, state.get(name))
            if w is not None:
                out[name] = fake_quant(w, self.s.bits, axis, self.s.group_size, grid)
        return out


def output_error(out: torch.Tensor, ref: torch.Tensor, logits: bool, mask: torch.Tensor | None) -> torch.Tensor:
    """What the learning minimises: for logits, KL(float ‖ quantized) per position (the figure LMs are compared
    by); otherwise the relative squared error. ``mask`` (``[batch, seq]``, 1 = real token) leaves padding out."""
    if logits:
        log_ref = ref.log_softmax(-1)
        per = (log_ref.exp() * (log_ref - out.log_softmax(-1))).sum(-1)
    else:
        per = (out - ref).pow(2).mean(-1) / ref.pow(2).mean().clamp_min(1e-30)
    if mask is not None and mask.shape == per.shape:
        w = mask.to(per.dtype)
        return (per * w).sum() / w.sum().clamp_min(1)
    return per.mean()


def _is_logits(out: Any) -> bool:
    return not torch.is_tensor(out) and torch.is_tensor(getattr(out, "logits", None))


def _head_tensors(model: nn.Module) -> tuple[str, str | None]:
    """The output head's weight and bias names (``get_output_embeddings()``, a Linear): the vocabulary rows
    ``logit_top_k`` restricts."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear):
        raise NormswapError("learned rotation: logit_top_k needs a model whose logits come from an output head "
                            f"Linear (get_output_embeddings()); {type(model).__name__} has "
                            f"{type(head).__name__ if head is not None else 'none'}: leave logit_top_k unset")
    path = next(p for p, m in model.named_modules() if m is head)
    prefix = f"{path}." if path else ""
    return prefix + "weight", (prefix + "bias" if head.bias is not None else None)


@dataclass
class _VocabRows:
    """One calibration batch's share of the vocabulary (``LearnSettings.logit_top_k``): ``rows`` (sorted ids),
    ``source`` = the output head's tensors (weight, bias) and the input embedding's (tied to the head or not)
    restricted to those rows, ``tables`` = the input embedding's names, read as full tables: the batch's tokens are
    among ``rows``, so only those rows need turning; the others keep their start value, which nothing reads."""

    rows: torch.Tensor
    source: dict[str, torch.Tensor]
    tables: list[str]
    kept: int = 0  # rows[:kept]: the likeliest and input tokens; rows[kept:]: the sample of the others
    tail_weight: float | None = None  # log(others / sampled): the sample's exp-sum scaled to the whole tail

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The quantized logits on the kept tokens, and one for the tail: the sample's log-sum-exp scaled to the
        tail's size (with no tail, the kept tokens are the whole vocabulary)."""
        if self.tail_weight is None:
            return out
        tail = out[..., self.kept:].logsumexp(-1, keepdim=True) + self.tail_weight
        return torch.cat([out[..., :self.kept], tail], dim=-1)


def _batch_ids(args: tuple, kwargs: dict, vocab: int) -> list[torch.Tensor]:
    """Every integer entry of a batch's inputs that can be a token id (ids, and harmless 0/1 of a mask): the rows
    a tied input embedding reads."""
    out = []
    for t in (*args, *kwargs.values()):
        if torch.is_tensor(t) and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool:
            flat = t.reshape(-1).long()
            out.append(flat[(flat >= 0) & (flat < vocab)])
    return out


def optimise(model: nn.Module, streams: list[StreamTensors], batches: list[tuple[tuple, dict]],
             settings: LearnSettings, heads: list[HeadTensors] | None = None,
             progress: Callable[[Progress], None] | None = None) -> tuple[dict[str, torch.Tensor], Learned]:
    """Learn one ``R`` per stream of ``model`` (already turned by its start matrices ``Q₀``), so that ``Q₀ R``
    minimises the fake-quantized model's output error on ``batches``; with ``heads`` (``settings.heads``), one
    ``R2`` per attention layer too, in ``Learned.heads``. Returns ``({stream key: R}`` in float64,
    what it did``)``. The model's parameters are read, never written; it runs in its own dtype, in eval mode.
    The search starts from the better of ``R = I`` (the Hadamard) and ``R = Q₀ᵀ`` (no rotation; where every
    stream has ``undo``) on all the batches; if nothing learned beats that start, the start is returned.
    ``progress``: called after the starts are scored and at every check (every tenth of the run) with a
    :class:`Progress`, so a long run can report and keep its best matrices as it goes."""
    from torch.func import functional_call

    if not batches:
        raise NormswapError("learned rotation: no calibration batch to learn from")
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    state = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}
    for p in model.parameters():
        p.requires_grad_(False)
    # S = 0: R = I, the search starts at the Hadamard
    skews = {s.key: torch.zeros(s.width, s.width, dtype=torch.float64, requires_grad=True) for s in streams}
    # t = 0: s = 1, every norm's weight as the start has it
    logs = {norm: torch.zeros(st.width, dtype=torch.float64, requires_grad=True)
            for st in streams if settings.scales for norm, _, _ in st.scaled}
    # S2 = 0: R2 = I, each head's values as the start has them
    heads = list(heads or []) if settings.heads else []
    head_skews = {h.key: torch.zeros(h.head_dim, h.head_dim, dtype=torch.float64, requires_grad=True) for h in heads}

    aliases: dict[int, list[str]] = {}  # a tensor reachable by several names (tied weights) turns under all
    for name, t in state.items():
        aliases.setdefault(id(t), []).append(name)

    def turned(rs: dict[str, torch.Tensor], ss: dict[str, torch.Tensor] | None = None,
               r2s: dict[str, torch.Tensor] | None = None, vocab: _VocabRows | None = None) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        src = vocab.source if vocab is not None else {}

        def start(name: str) -> torch.Tensor:
            return out[name] if name in out else src[name] if name in src else state[name]

        for st in streams:
            r = rs[st.key]
            for name, axis, rows in st.turned:
                out[name] = _turn(start(name), axis, r, rows)
            for name in st.restore:
                out[name] = r.T.to(state[name].dtype) @ state[name]
            for name in st.ops:
                out[name] = state[name] @ r.to(state[name].dtype)
            for norm, own, readers in st.scaled if ss else ():
                s = ss[norm]
                for name in own:  # the norm's weight (and a kept bias) ÷ s
                    out[name] = start(name) / s.to(state[name].dtype)
                for name, axis, rows in readers:  # its readers' input columns × s
                    out[name] = _scale(start(name), axis, s, rows)
        for h in heads if r2s else ():  # R2 on the head axis: the stream's R (other axis) commutes with it
            for name, axis in h.turned:
                out[name] = turn_heads(start(name), axis, r2s[h.key])
        for name in list(out):
            out.update({alias: out[name] for alias in aliases[id(state[name])]})
        if vocab is not None:  # the head on its rows only (turned or not); a tied table full size again
            for name, t in src.items():
                out.setdefault(name, t)
            for name in vocab.tables:
                out[name] = state[name].index_copy(0, vocab.rows, out[name].to(state[name].dtype))
        return out

    with torch.no_grad():
        first = model(*batches[0][0], **batches[0][1])
        logits = _is_logits(first)
        refs = [output_tensor(first).detach()] + [output_tensor(model(*args, **kwargs)).detach()
                                                  for args, kwargs in batches[1:]]
    masks = [kwargs.get("attention_mask") for _, kwargs in batches]
    quant = _Quantized(model, settings)
    vocab_rows: list[_VocabRows | None] = [None] * len(batches)
    if settings.logit_top_k is not None:
        if not logits:
            raise NormswapError(f"learned rotation: logit_top_k applies to a model whose output is logits; "
                                f"{type(model).__name__}'s is {type(first).__name__}: leave logit_top_k unset")
        head_w, head_b = _head_tensors(model)
        # the input embedding's rows read are the batch's tokens: turned on the kept rows only, like the head
        # (tied to it or not: a γ folded into the head unties them)
        get_emb = getattr(model, "get_input_embeddings", None)
        emb = get_emb() if callable(get_emb) else None
        emb_names = aliases.get(id(emb.weight), []) if isinstance(emb, nn.Embedding) \
            and emb.weight.shape[0] == state[head_w].shape[0] else []
        tables = sorted({*aliases[id(state[head_w])], *emb_names} - {head_w})
        for i, (args, kwargs) in enumerate(batches):
            size = refs[i].shape[-1]
            likeliest = refs[i].topk(min(settings.logit_top_k, size), -1).indices.reshape(-1)
            kept = torch.unique(torch.cat([likeliest, *_batch_ids(args, kwargs, size)]))
            others = torch.ones(size, dtype=torch.bool)
            others[kept] = False
            tail = others.nonzero().reshape(-1)
            logp = refs[i].log_softmax(-1)
            refs[i] = logp.index_select(-1, kept)  # log-probabilities: the loss's log_softmax leaves them as they are
            rows, weight = kept, None
            if len(tail):  # the tail as one class: its float log-mass exact, its quantized one from a sample
                draw = torch.randperm(len(tail), generator=torch.Generator().manual_seed(i))[:LOGIT_TAIL_SAMPLE]
                sample = tail[draw.sort().values]
                rows, weight = torch.cat([kept, sample]), float(torch.log(torch.tensor(len(tail) / len(sample))))
                refs[i] = torch.cat([refs[i], logp.index_select(-1, tail).logsumexp(-1, keepdim=True)], dim=-1)
            del logp
            source = {n: state[n].index_select(0, rows) for n in (head_w, *tables)}
            if head_b is not None:
                source[head_b] = state[head_b].index_select(0, rows)
            vocab_rows[i] = _VocabRows(rows, source, tables, len(kept), weight)

    grids = settings.grids

    def loss_on(i: int, rs: dict[str, torch.Tensor], ss: dict[str, torch.Tensor] | None = None,
                grid: str = grids[0], r2s: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        args, kwargs = batches[i]
        # tie_weights=False: a weight tied to a writer (an LM head) is rounded where its matmul reads it only
        out = functional_call(model, quant.params(turned(rs, ss, r2s, vocab_rows[i]), grid), args, kwargs,
                              tie_weights=False, strict=False)
        out = output_tensor(out).to(refs[i].dtype)
        if vocab_rows[i] is not None:
            out = vocab_rows[i].logits(out)
        return output_error(out, refs[i], logits, masks[i])

    def mean_loss(rs: dict[str, torch.Tensor], ss: dict[str, torch.Tensor] | None = None,
                  r2s: dict[str, torch.Tensor] | None = None) -> float:
        """The loss on every batch, on every grid (the mean: several grids score as one)."""
        with torch.no_grad():
            return sum(float(loss_on(i, rs, ss, g, r2s)) for i in range(len(batches)) for g in grids) \
                / (len(batches) * len(grids))

    identity = {k: torch.eye(s.shape[0], dtype=torch.float64) for k, s in skews.items()}
    undo = {st.key: st.undo for st in streams if st.undo is not None}
    history: list[float] = []
    # one batch per step is a noisy estimate: every tenth of the run the matrices are scored on every batch,
    # and the best scored (the Hadamard start included) is returned
    check_every = max(1, settings.steps // 10)
    try:
        with quant:
            # two starts, scored on every batch: the Hadamard (R = I) and no rotation at all (R = Q₀ᵀ), which
            # a stream lighter-tailed than Gaussian quantizes better with; the search goes on from the better
            loss_hadamard = start = mean_loss(identity)
            loss_identity = mean_loss(undo) if len(undo) == len(skews) else float("nan")
            base, start_name = identity, "hadamard"
            if loss_identity < loss_hadamard:
                base, start_name, start = undo, "identity", loss_identity
            best, best_loss, best_scales, best_heads = base, start, {}, {}
            if progress is not None:
                progress(Progress(0, settings.steps, start_name, start, start, dict(best), [],
                                  time.perf_counter() - t0))
            # the scales' log moves at ten times R's step: a log-scale of 1 is e×, a rotation angle of 1 is 57°
            groups: list[dict] = [{"params": list(skews.values()) + list(head_skews.values())}]
            if logs:
                groups.append({"params": list(logs.values()), "lr": 10 * float(settings.lr)})
            opt = torch.optim.Adam(groups, lr=float(settings.lr))
            decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - i / max(1, settings.steps))
            for step in range(settings.steps):
                opt.zero_grad(set_to_none=True)
                # several grids: each pass over the batches shifts which grid a batch meets, so every batch
                # meets every grid and none is fitted alone
                batch, rounds = step % len(batches), step // len(batches)
                loss = loss_on(batch, {k: base[k] @ cayley(s) for k, s in skews.items()},
                               {n: norm_scales(t) for n, t in logs.items()}, grids[(batch + rounds) % len(grids)],
                               {k: cayley(s, keep_mean=False) for k, s in head_skews.items()})
                loss.backward()
                opt.step()
                decay.step()
                history.append(float(loss.detach()))
                if (step + 1) % check_every == 0 or step + 1 == settings.steps:
                    with torch.no_grad():
                        now = {k: base[k] @ cayley(s.detach()) for k, s in skews.items()}
                        now_scales = {n: norm_scales(t.detach()) for n, t in logs.items()}
                        now_heads = {k: cayley(s.detach(), keep_mean=False) for k, s in head_skews.items()}
                    score = mean_loss(now, now_scales, now_heads)
                    if score < best_loss:
                        best, best_loss, best_scales, best_heads = now, score, now_scales, now_heads
                    if progress is not None:
                        progress(Progress(step + 1, settings.steps, start_name, score, best_loss, dict(best),
                                          list(history), time.perf_counter() - t0))
    finally:
        model.train(was_training)
    kept = best is base
    return best, Learned(settings, start, best_loss, time.perf_counter() - t0, kept, history, start_name,
                         loss_hadamard, loss_identity, best_scales, best_heads)
