"""Apply a :class:`~normswap.analysis.plan.Plan` to a model: untie, center, fold, swap, hook.

All arithmetic is float64 (each tensor is upcast, edited and cast back once). The functions here
mutate the module they are given; :mod:`normswap.pipeline` runs them on a working copy and commits the
result to the user's model only after verification, which is what makes ``patch`` transactional.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from normswap.analysis.linears import LinearView, linear_at, param_names
from normswap.analysis.plan import (
    ADAPTER_VECTOR_FIELDS,
    EXACT_VERDICTS,
    FLAVOUR_SLOTS,
    REFUSE_AXIS,
    REFUSE_BETA_MOVED,
    REFUSE_CENTERED_READER,
    REFUSE_CENTERED_TABLE,
    REFUSE_MEAN_CARRY,
    REFUSE_RESIDUAL_BETA,
    BetaMove,
    BiasSlot,
    CenteredReader,
    CenterHook,
    ConstantTrade,
    FoldEdit,
    MeanCarry,
    Plan,
    ResidualFold,
    RmsFold,
    ScaleFold,
    SitePlan,
    Untie,
    WriterEdit,
    attach_plan,
)
from normswap.analysis.trades import row_shift
from normswap.analysis.walker import NormSite
from normswap.integrations import torch_transformer
from normswap.nn.call_args import RMSNormTakingArgs, argument_slot
from normswap.nn.rmsnorm import RMSNorm
from normswap.surgery.scales import fold_layer_scale


def center_(w: torch.Tensor, axis: int, blocks: list[tuple[int, int]] | None) -> torch.Tensor:
    """Subtract the mean along ``axis`` (per block) from the float64 tensor ``w``, in place.

    The one centering arithmetic: the in-memory surgery and the streamed rewrite both call it, so
    their outputs are bitwise equal."""
    if blocks is None:
        w.sub_(w.mean(axis, keepdim=True))
    else:
        for lo, hi in blocks:
            part = w.narrow(axis, lo, hi - lo)
            part.sub_(part.mean(axis, keepdim=True))
    return w


def untie(model: nn.Module, u: Untie, value: torch.Tensor | None = None) -> None:
    """Give ``u.module.u.attr`` its own parameter: a clone of the tied one, or ``value`` (used as is).

    Without ``value``, a parameter that is no longer tied (registered under no other name: the
    caller already gave it its own) is left as it is, so untying twice never copies twice."""
    module = model.get_submodule(u.module)
    source = getattr(module, u.attr)
    if value is None and not _registered_elsewhere(model, source, module, u.attr):
        return
    data = source.detach().clone() if value is None else value
    setattr(module, u.attr, nn.Parameter(data, requires_grad=source.requires_grad))


def _registered_elsewhere(model: nn.Module, param: torch.Tensor, module: nn.Module, attr: str) -> bool:
    for m in model.modules():
        for name, p in m._parameters.items():
            if p is param and not (m is module and name == attr):
                return True
    return False


def mark_untied(model: nn.Module) -> None:
    """Tell transformers not to re-tie what we untied (``tie_weights`` runs on load and resize)."""
    config = getattr(model, "config", None)
    if config is None:
        return
    configs = [config] + [getattr(config, a) for a in dir(config)
                          if a.endswith("_config") and hasattr(getattr(config, a, None), "to_dict")]
    for cfg in configs:
        if hasattr(cfg, "tie_word_embeddings"):
            cfg.tie_word_embeddings = False


def center_writer(model: nn.Module, e: WriterEdit) -> None:
    """Make the writer ``e.target`` zero-mean along its output axis, computed in float64."""
    t = model.get_parameter(e.target)
    if t.dtype == torch.float64:  # the working copy: in place, no second copy of (say) a 190 MB embedding
        center_(t.detach(), e.axis, e.blocks)
        return
    w = center_(t.detach().double(), e.axis, e.blocks)
    with torch.no_grad():
        t.copy_(w)


def trade_constant(table: torch.Tensor, t: ConstantTrade) -> torch.Tensor:
    """The constant rows ``[t.lo, t.hi)`` of ``table`` (before centering) keep: the mean of their row means.

    One function for the in-memory surgery and the streamed rewrite (float64, the same reduction order)."""
    ax = t.axis % table.dim()
    means = table.double().mean(ax).reshape(-1)
    return means[t.lo:t.hi].mean()


def traded(w: torch.Tensor, t: ConstantTrade, c: torch.Tensor, *, table: bool) -> torch.Tensor:
    """The centered float64 ``w`` after trade ``t`` of constant ``c``, in place: ``+c`` on the table's rows
    ``[lo, hi)`` (``table``), ``−c`` on every entry of the taker."""
    if not table:
        return w.sub_(c)
    marks = torch.zeros(w.numel() // w.shape[t.axis], dtype=w.dtype)
    marks[t.lo:t.hi] = 1
    return w.add_(row_shift(w, t.axis, marks * c))


def trade_constants(model: nn.Module, trades: list[ConstantTrade]) -> list[torch.Tensor]:
    """Each trade's constant, from the tables as they are now (call before centering)."""
    return [trade_constant(model.get_parameter(t.table).detach(), t) for t in trades]


def apply_trades(model: nn.Module, trades: list[ConstantTrade], constants: list[torch.Tensor]) -> None:
    """Give each trade's constant back to its table's rows and take it from its taker (after centering)."""
    for t, c in zip(trades, constants, strict=True):
        for name, table in ((t.table, True), (t.into, False)):
            p = model.get_parameter(name)
            w = traded(p.detach().double(), t, c, table=table)
            with torch.no_grad():
                p.copy_(w)


CARRY_TENSORS = ("up.weight", "up.bias", "down.weight")  # what a MeanCarry widens (down.bias is not)


def carried(t: torch.Tensor, carry: MeanCarry, which: str, *, values: bool = True) -> torch.Tensor:
    """``t`` (the ``which`` tensor of ``carry``'s MLP, one of :data:`CARRY_TENSORS`) widened by ``carry.added``.

    The new entries are zero except, with ``values``, the :attr:`MeanCarry.NEURONS` neurons that carry the mean
    (see :class:`MeanCarry`): rows ``+s/d, -s/d`` of ``up.weight`` on the even features, then the same on the odd
    features (zero elsewhere: no adjacent pair of a row is nonzero twice), then the same two pairs at
    ``s₂ = s/SECOND_RATIO``; columns ``-c1, +c1, -c1, +c1, -c2, +c2, -c2, +c2`` of ``down.weight``, per row, from
    :meth:`MeanCarry.columns` of ``t``'s real columns (``s = carry.scale``): ``t`` must be ``down`` as it is
    written (centered and folded), so ``c1`` lies on each row's exported INT8_ASYM grid. One function for the
    in-memory surgery and the streamed checkpoint rewrite, so both write the same bits.
    """
    axis = 1 if which == "down.weight" else 0
    shape = list(t.shape)
    shape[axis] += carry.added
    out = torch.zeros(shape, dtype=t.dtype, device=t.device)
    if t.device.type == "meta":
        return out
    n, d = carry.hidden, carry.features
    out.narrow(axis, 0, n).copy_(t.detach())
    s = float(carry.scale)
    scales = (s, s / MeanCarry.SECOND_RATIO)
    if values and which == "up.weight":
        for k, scale in enumerate(scales):  # the first pairs, then the second
            for pair, first in enumerate((0, 1)):  # even features, then odd
                out[n + 4 * k + 2 * pair, first::2] = scale / d
                out[n + 4 * k + 2 * pair + 1, first::2] = -scale / d
    elif values and which == "down.weight":
        entries = MeanCarry.columns(t.detach()[:, :n].cpu(), s)
        for k, c in enumerate(entries):
            c = c.to(device=t.device, dtype=t.dtype)
            for pair in range(2):
                out[:, n + 4 * k + 2 * pair] = -c
                out[:, n + 4 * k + 2 * pair + 1] = c
    return out


def widen_mlp(model: nn.Module, carry: MeanCarry, *, weights: bool = True) -> None:
    """Add ``carry.added`` neurons to the MLP ``carry.up -> carry.down`` (see :class:`MeanCarry`).

    ``weights=False`` only changes the shapes (loading a checkpoint rebuilds the structure, the
    values come from the file). Idempotent on an MLP that already has the wider shape. With
    ``weights``: run after centering ``down`` and after every edit of its real columns (the carry's entries
    are put on their rows' grids, :meth:`MeanCarry.columns`).
    """
    up, down = model.get_submodule(carry.up), model.get_submodule(carry.down)
    wide = carry.hidden + carry.added
    if up.out_features == wide and down.in_features == wide:
        return
    if up.out_features != carry.hidden or down.in_features != carry.hidden:
        raise ValueError(f"cannot widen `{carry.up}` -> `{carry.down}`: width {up.out_features}, "
                         f"expected {carry.hidden}")
    for which in CARRY_TENSORS:
        module, attr = (up, down)[which.startswith("down")], which.split(".")[1]
        old = module._parameters.get(attr)
        if old is not None:
            new = carried(old.detach(), carry, which, values=weights)
            setattr(module, attr, nn.Parameter(new, requires_grad=old.requires_grad))
    up.out_features = down.in_features = wide


def adopt_widened_mlp(model: nn.Module, carry: MeanCarry, source: nn.Module) -> list[str]:
    """Give ``model``'s MLP ``carry.up -> carry.down`` the tensors of the same MLP in ``source`` (already
    widened and edited), cast to ``model``'s dtype and device. Each source tensor is emptied as soon as
    it is taken, so at most one MLP tensor is alive twice. Returns the parameter names taken."""
    taken = []
    for path in (carry.up, carry.down):
        module = model.get_submodule(path)
        for attr in ("weight", "bias"):
            old = module._parameters.get(attr)
            if old is None:
                continue
            name = f"{path}.{attr}"
            src = source.get_parameter(name)
            setattr(module, attr, nn.Parameter(src.detach().to(device=old.device, dtype=old.dtype),
                                               requires_grad=old.requires_grad))
            src.data = torch.empty(0, dtype=src.dtype)
            taken.append(name)
    model.get_submodule(carry.up).out_features = model.get_submodule(carry.down).in_features = (
        carry.hidden + carry.added)
    return taken


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl): nothing to do
        return None


def release_free_memory() -> None:
    """Hand heap memory that is already free back to the OS (glibc's ``malloc_trim``).

    Replacing tensors by slightly larger ones (a widened MLP: 3072 -> 3080 rows) leaves holes the
    allocator cannot reuse for the next, larger tensor, and glibc keeps them resident: measured
    +230-380 MB of RSS on a 12-layer encoder. Releasing after each replacement keeps the resident
    size at the live tensors. Touches no live memory; a no-op without glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def writer_max(model: nn.Module, sf: ScaleFold) -> float:
    """The largest ``|w|`` of ``sf``'s writer weight (float64): the range :func:`balance_layer_scale` keeps."""
    return float(linear_at(model, sf.into).weight.detach().double().abs().max())


def layer_scale_balance(peak: torch.Tensor, target: float) -> torch.Tensor:
    """The per-row scale :func:`balance_layer_scale` takes into λ: the smallest ``s_i`` of four significant
    bits (``m · 2^e``, ``m`` in ``{1, 1.125, …, 1.875}``) with ``peak_i / s_i ≤ target``, so every row's largest
    entry lies in ``(8/9 · target, target]`` (1 for a zero row). Four bits so that λ = s is exact in bfloat16,
    float16 and float32: a half-precision model rounds λ no more than the folded one (λ = 1) does. One
    function for the in-memory surgery and the streamed rewrite."""
    ok = peak > 0
    if target <= 0:
        return torch.ones_like(peak)
    ratio = torch.where(ok, peak, target) / target
    exponent = torch.floor(torch.log2(ratio))
    scale = torch.ceil(ratio / torch.exp2(exponent) * 8) / 8 * torch.exp2(exponent)
    scale = torch.where(scale * target < torch.where(ok, peak, target), scale + torch.exp2(exponent) / 8, scale)
    return torch.where(ok, scale, torch.ones_like(peak))


def balance_layer_scale(model: nn.Module, sf: ScaleFold, target: float) -> None:
    """Take a per-row scale back out of a folded and centered LayerScale writer into λ (``sf.keep``).

    After :func:`fold_layer_scale` and centering, the writer computes ``C diag(λ) (W x + b)``: exact, but
    its rows carry λ's spread (DINOv2: 1e-4 to 10), which a per-tensor quantizer pays for. Any per-row
    ``s > 0`` gives the same product ``s ⊙ (diag(1/s) W' x + b'/s)``. ``s_i`` puts row ``i``'s largest entry in
    ``(8/9 · target, target]`` (``target``: the original weight's ``max|w|``; ``s`` has four significant bits,
    exact in half precision: :func:`layer_scale_balance`), so the weight's range is the original's and every
    row uses almost all of it: per-tensor quantization of the writer is nearly as fine as per-row
    (per-channel) quantization. λ ← s (the LayerScale multiply stays). A zero row keeps ``s_i = 1``.
    """
    lam = model.get_parameter(sf.param)
    module = linear_at(model, sf.into)
    with torch.no_grad():
        w = module.weight.detach().double()
        peak = w.abs().amax(dim=0) if sf.kind == "conv1d" else w.abs().amax(dim=1)
        scale = layer_scale_balance(peak, target)
        w = w / scale[None, :] if sf.kind == "conv1d" else w / scale[:, None]
        module.weight.copy_(w.to(module.weight.dtype))
        if module.bias is not None:
            module.bias.copy_((module.bias.detach().double() / scale).to(module.bias.dtype))
        lam.copy_((scale - sf.offset).reshape(lam.shape).to(lam.dtype))


def fold_rms_gamma(model: nn.Module, rf: RmsFold) -> None:
    """An already-RMS norm's γ into its Linear readers (``W ← W diag γ``); its effective γ becomes 1."""
    weight = model.get_parameter(rf.weight)
    gamma = rf.offset + weight.detach().double()
    with torch.no_grad():
        for path, kind in zip(rf.readers, rf.kinds, strict=True):
            reader = linear_at(model, path)
            w = reader.weight.detach().double()
            w = w * gamma[:, None] if kind == "conv1d" else w * gamma[None, :]
            reader.weight.copy_(w.to(reader.weight.dtype))
        weight.fill_(1.0 - rf.offset)


def add_bias_slot(model: nn.Module, slot: BiasSlot, value: torch.Tensor | None = None) -> None:
    """Give the bias-less Linear ``slot.reader`` a bias (:class:`~normswap.analysis.plan.BiasSlot`): zeros on its
    weight's device and dtype (the β fold then adds ``W β``), or ``value`` (adopted as is). Idempotent."""
    reader = linear_at(model, slot.reader)
    if reader.bias is not None:
        return
    w = reader.weight
    if value is None:
        value = torch.zeros(slot.features, device=w.device, dtype=w.dtype)
    if isinstance(reader, LinearView):
        reader.give_bias(value)
    else:
        reader.bias = nn.Parameter(value, requires_grad=w.requires_grad)


def fold_into_reader(model: nn.Module, f: FoldEdit, gamma: torch.Tensor | None, beta: torch.Tensor | None) -> None:
    """``W (γ⊙u + β) + c = (W diag γ) u + (W β + c)`` for Linear ``[out,in]`` and Conv1D ``[in,out]``."""
    reader = linear_at(model, f.reader)
    w = reader.weight.detach().double()
    transposed = f.kind == "conv1d"
    with torch.no_grad():
        if f.beta and beta is not None:
            shift = beta @ w if transposed else w @ beta
            reader.bias.copy_((reader.bias.detach().double() + shift).to(reader.bias.dtype))
        if f.gamma and gamma is not None:
            w = w * gamma[:, None] if transposed else w * gamma[None, :]
            reader.weight.copy_(w.to(reader.weight.dtype))


def center_reader(model: nn.Module, r: CenteredReader, gamma: torch.Tensor | None, beta: torch.Tensor | None) -> None:
    """``W' = W·diag(γ)·P·diag(1/γ)``, ``c' = c + (W − W')β`` (:class:`~normswap.analysis.plan.CenteredReader`), for
    Linear ``[out,in]`` and Conv1D ``[in,out]``: the reader sees a LayerNorm output as before and
    ignores the mean an approximate RMSNorm leaks. ``W·diag(γ)·P`` subtracts each row's mean."""
    reader = linear_at(model, r.reader)
    w = reader.weight.detach().double()
    if r.kind == "conv1d":
        w = w.T
    g = gamma.double() if gamma is not None else torch.ones(w.shape[1], dtype=torch.float64, device=w.device)
    scaled = w * g
    new = (scaled - scaled.mean(dim=1, keepdim=True)) / g
    with torch.no_grad():
        if beta is not None:
            reader.bias.copy_((reader.bias.detach().double() + (w - new) @ beta.double()).to(reader.bias.dtype))
        reader.weight.copy_((new.T if r.kind == "conv1d" else new).to(reader.weight.dtype))


def moved_shift(w_reader: torch.Tensor, w_into: torch.Tensor, beta: torch.Tensor, m: BetaMove) -> torch.Tensor:
    """What :class:`BetaMove` ``m`` adds to ``m.into``'s bias: ``W_into · scatter(W_reader β)`` (float64).

    One function for the in-memory surgery and the streamed checkpoint rewrite, so both write the same
    bits. ``w_reader`` is the value projection's weight before any γ fold (its share is ``W β`` of the
    weight the norm's output met)."""
    share = beta @ w_reader if m.reader_kind == "conv1d" else w_reader @ beta
    width = w_into.shape[0] if m.kind == "conv1d" else w_into.shape[1]
    carried_in = torch.zeros(width, dtype=share.dtype, device=share.device)
    for lo, src, n in m.runs:
        carried_in[lo:lo + n] = share[src:src + n]
    return carried_in @ w_into if m.kind == "conv1d" else w_into @ carried_in


def move_beta(model: nn.Module, m: BetaMove, beta: torch.Tensor) -> None:
    """Add a value projection's share of β, carried through attention, to ``m.into``'s bias."""
    reader, into = linear_at(model, m.reader), linear_at(model, m.into)
    shift = moved_shift(reader.weight.detach().double(), into.weight.detach().double(), beta, m)
    with torch.no_grad():
        into.bias.copy_((into.bias.detach().double() + shift).to(into.bias.dtype))


def residual_shares(model: nn.Module, rf: ResidualFold, b: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """What :func:`fold_residual_beta` adds to each bias, as ``[(module path, shift)]`` (float64): ``R b``
    for each reader (its current weight, after every other edit: a centered reader, a widened MLP), ``b`` for
    each residual writer."""
    b = b.detach().double()
    out = []
    for path, kind in zip(rf.readers, rf.reader_kinds, strict=True):
        w = linear_at(model, path).weight.detach().double()
        out.append((path, b @ w if kind == "conv1d" else w @ b))
    out += [(path, b) for path in rf.writers]
    return out


def fold_residual_beta(model: nn.Module, rf: ResidualFold) -> torch.Tensor:
    """Move the bias of the converted norm ``rf.site`` into its readers' and residual writers' biases
    (:class:`~normswap.analysis.plan.ResidualFold`) and drop it from the norm; returns the bias moved.
    Each bias is reached as :func:`fold_into_reader` reaches it (a functional linear's slice of a fused
    bias included)."""
    norm = model.get_submodule(rf.site)
    b = norm.bias.detach().double().clone()
    with torch.no_grad():
        for path, shift in residual_shares(model, rf, b):
            bias = linear_at(model, path).bias
            bias.copy_((bias.detach().double() + shift.to(bias.device)).to(bias.dtype))
    norm.register_parameter("bias", None)
    return b


def rms_slots(sp: SitePlan, *, has_gamma: bool, has_beta: bool) -> tuple[bool, bool]:
    """The replacement RMSNorm's (weight, bias) slots: a weight wherever the norm has γ (ones when γ
    is folded, so the slot stays trainable), a bias only where β could not be folded."""
    return has_gamma, has_beta and not sp.fold_beta


def record_rms_slots(plan: Plan) -> None:
    """Record in ``plan`` the slots :func:`make_rmsnorm` would give each converted norm (the
    low-memory path builds no module, but its checkpoint and manifest must say the same)."""
    for sp in plan.sites:
        has_gamma, has_beta = FLAVOUR_SLOTS[sp.flavour]
        sp.rms_weight, sp.rms_bias = rms_slots(sp, has_gamma=has_gamma, has_beta=has_beta) if sp.convert else (
            False, False)


def make_rmsnorm(site: NormSite, sp: SitePlan, module: nn.Module, backend: str,
                 fit: tuple[torch.Tensor, torch.Tensor] | None = None) -> RMSNorm:
    """The RMSNorm replacing ``module``: γ/β kept unless folded; fitted values for approximate sites."""
    gamma, beta = site.gamma(module), site.beta(module)
    if fit is not None:
        gamma, beta = fit
    has_weight, keep_beta = rms_slots(sp, has_gamma=gamma is not None, has_beta=beta is not None)
    keep_gamma = has_weight and not sp.fold_gamma
    # a norm may hold γ/β in buffers only (F.layer_norm(x, s, self.gamma, self.beta_buffer))
    ref = next((t for t in [*module.parameters(), *module.buffers()] if t.is_floating_point()), None)
    dtype = ref.dtype if ref is not None else torch.get_default_dtype()
    device = ref.device if ref is not None else None
    norm = _new_rmsnorm(sp, site.normalized_shape, eps=site.eps, elementwise_affine=has_weight, bias=keep_beta,
                        backend=backend, param_shape=site.param_shape, device=device, dtype=dtype)
    sp.rms_weight, sp.rms_bias = has_weight, keep_beta
    with torch.no_grad():
        if keep_gamma:
            norm.weight.copy_(gamma.to(dtype))
        if keep_beta:
            # γ folded into the readers while β could not fold: the norm keeps β/γ (see _plan_folds)
            kept = beta / gamma if (sp.fold_gamma and gamma is not None and fit is None) else beta
            norm.bias.copy_(kept.to(dtype))
    return norm


def _new_rmsnorm(sp: SitePlan, *args: Any, **kwargs: Any) -> RMSNorm:
    """The replacement: one that accepts the original's extra call arguments, and returns its structure
    (``(x, None)``), where it did; the plain RMSNorm (one-tensor forward, no per-call cost) otherwise."""
    if sp.extra_args or sp.returns:
        return RMSNormTakingArgs(*args, returns=sp.returns, **kwargs)
    return RMSNorm(*args, **kwargs)


def replace_module(model: nn.Module, old: nn.Module, new: nn.Module) -> list[str]:
    """Swap every reference to ``old`` (a shared module may have several parents) for ``new``."""
    paths = []
    for parent_path, parent in list(model.named_modules(remove_duplicate=False)):
        for name, child in list(parent._modules.items()):
            if child is old:
                parent._modules[name] = new
                paths.append(f"{parent_path}.{name}" if parent_path else name)
    return paths


def center_last(t: torch.Tensor) -> torch.Tensor:
    """``t`` minus its mean over the last dim; half precision computes in float32 and rounds once
    (a bf16 mean and a bf16 subtraction would round twice where the LayerNorm it replaces rounds once)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        tf = t.float()
        return (tf - tf.mean(-1, keepdim=True)).to(t.dtype)
    return t - t.mean(-1, keepdim=True)


class CenterOutput:
    """Forward hook: subtract the per-token mean of a module's output (one mean per token)."""

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not isinstance(output, torch.Tensor):
            # a module returning (tensor, None, ...) (RWKV's attention and feed-forward with their state):
            # the plan places a hook only where the output holds one tensor, the one centered here
            return pytree.tree_map_only(torch.Tensor, center_last, output)
        if isinstance(module, RMSNorm) and output.dtype in (torch.bfloat16, torch.float16) and args:
            # A stream-start norm (BLOOM's embedding norm, CLIP's pre_layrnorm): redo it in float32 and
            # center before the one rounding; centering the rounded output would round twice.
            return _rms_norm_centered_fp32(module, args[0]).to(output.dtype)
        return center_last(output)


def _rms_norm_centered_fp32(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    dims = tuple(range(-len(norm.normalized_shape), 0))
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dims, keepdim=True) + norm.eps)
    if norm.weight is not None:
        y = y * norm.weight.float()
    if norm.bias is not None:
        y = y + norm.bias.float()
    return y - y.mean(-1, keepdim=True)


class CenterInput:
    """Forward pre-hook: subtract the per-token mean of one input argument."""

    def __init__(self, arg: int | str) -> None:
        self.arg = arg

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        slot = argument_slot(module, args, kwargs, self.arg)
        if isinstance(slot, int):
            args = list(args)
            args[slot] = center_last(args[slot])
            return tuple(args), kwargs
        kwargs = dict(kwargs)
        kwargs[slot] = center_last(kwargs[slot])
        return args, kwargs


class CenterResidual:
    """Forward hook: center the residual sum ``a + M(a)`` that module ``M``'s caller computes, from inside
    ``M``: its first output ``b`` becomes ``b - mean(a + b)`` (``a`` is its input ``arg``), so the sum is
    zero-mean while ``M`` still reads ``a`` as it was. One mean per token, as any centering op."""

    def __init__(self, arg: int | str) -> None:
        self.arg = arg

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        slot = argument_slot(module, args, kwargs, self.arg)
        a = args[slot] if isinstance(slot, int) else kwargs[slot]
        leaves, spec = pytree.tree_flatten(output)
        i = next(i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor))
        b = leaves[i]
        compute = torch.float32 if b.dtype in (torch.bfloat16, torch.float16) else b.dtype
        mean = (a.to(compute) + b.to(compute)).mean(-1, keepdim=True)
        leaves[i] = (b.to(compute) - mean).to(b.dtype)  # one rounding, as center_last
        return pytree.tree_unflatten(leaves, spec)


class _CenteredNorm:
    """The handle of a centering op an :class:`RMSNorm` runs itself (its ``centers_input``): ``remove()`` undoes
    it, as a hook's handle would."""

    def __init__(self, norm: RMSNorm) -> None:
        self.norm = norm

    def remove(self) -> None:
        self.norm.centers_input = False


def install_hook(model: nn.Module, h: CenterHook) -> None:
    """Register one centering op. Idempotent: a module never gets the same hook twice.

    An op on the input of a :class:`RMSNorm` that normalises one dim (a Post-LN norm's op,
    ``per_norm_centering``) is no hook: the norm centers its input itself (``centers_input``), which is
    ``LayerNorm``'s math and runs its one kernel (round 58: the hook cost 4-6 % of a BERT-class encoder's eager
    time)."""
    module = model.get_submodule(h.module)
    installed = getattr(module, "_normswap_hooks", {})
    key = (h.where, h.arg)
    if key in installed:
        return
    if h.where == "input" and isinstance(module, RMSNorm) and len(module.normalized_shape) == 1:
        module.centers_input = True
        handle = _CenteredNorm(module)
    elif h.where == "output":
        handle = module.register_forward_hook(CenterOutput())
    elif h.where == "residual":
        handle = module.register_forward_hook(CenterResidual(h.arg), with_kwargs=True)
    else:
        handle = module.register_forward_pre_hook(CenterInput(h.arg), with_kwargs=True)
    installed[key] = handle
    module._normswap_hooks = installed


def apply_weight_edits(model: nn.Module, plan: Plan, sites: dict[str, NormSite],
                       originals: dict[str, nn.Module]) -> None:
    """Untie, center writers, move value β shares through attention, fold γ/β into readers (not the norm
    swap itself)."""
    for u in plan.unties:
        untie(model, u)
    if plan.unties:
        mark_untied(model)
    bases = adapter_bases(  # before the folds: λ and an RMS norm's γ as they were
        model, plan, lambda name: (sites[name].gamma(originals[name]), sites[name].beta(originals[name])),
        lambda name: model.get_parameter(name))
    for rf in plan.rms_folds:
        fold_rms_gamma(model, rf)
    ranges = {sf.param: writer_max(model, sf) for sf in plan.scale_folds if sf.keep}
    for sf in plan.scale_folds:  # before centering: the centered rows are the scaled ones
        fold_layer_scale(model, sf)
    constants = trade_constants(model, plan.constant_trades)  # the tables' row means before centering
    for e in plan.writer_edits:
        center_writer(model, e)
    apply_trades(model, plan.constant_trades, constants)
    for sf in plan.scale_folds:  # after centering: every row of the writer spans its original range, λ the scale
        if sf.keep:
            balance_layer_scale(model, sf, ranges[sf.param])
            if sf.into in bases and "refuse" not in bases[sf.into]:
                bases[sf.into]["balance"] = _vector(plan, f"{sf.param}:balance",
                                                    model.get_parameter(sf.param).reshape(-1), sf.offset)
    for r in plan.centered_readers:  # before widening: the carry's added rows must see the norm's output as is
        center_reader(model, r, sites[r.site].gamma(originals[r.site]), sites[r.site].beta(originals[r.site]))
    for c in plan.mean_carries:  # after centering: the carry's entries sit on the centered rows' grids
        widen_mlp(model, c)
        release_free_memory()  # the narrower tensors' holes (see release_free_memory)
    for m in plan.beta_moves:  # after centering (the shift then keeps `into` centered), before γ folds
        move_beta(model, m, sites[m.site].beta(originals[m.site]))
    for slot in plan.bias_slots:  # before the folds: the β fold adds W β into the new bias
        add_bias_slot(model, slot)
    for f in plan.folds:
        site = sites[f.site]
        module = originals[f.site]
        fold_into_reader(model, f, site.gamma(module), site.beta(module))


def _vector(plan: Plan, name: str, t: torch.Tensor, offset: float = 0.0) -> str:
    """Keep ``offset + t`` (float64, on the CPU) in ``plan.adapter_vectors`` under ``name``; returns ``name``,
    what ``plan.adapter_bases`` records (one vector per norm site / λ however many Linears read it)."""
    if name not in plan.adapter_vectors:
        plan.adapter_vectors[name] = (t.detach().to("cpu", torch.float64).reshape(-1) + offset).contiguous()
    return name


def adapter_bases(model: nn.Module, plan: Plan,
                  norm: Callable[[str], tuple[torch.Tensor | None, torch.Tensor | None]],
                  param: Callable[[str], torch.Tensor],
                  balance: Callable[[ScaleFold], torch.Tensor] | None = None) -> dict[str, dict[str, Any]]:
    """Record in ``plan.adapter_bases`` (and return), per Linear / Conv1D the plan edits, what an adapter on it
    needs to act in the original model's basis (:class:`normswap.rotation.carry.AdapterBasis`): ``gamma`` /
    ``beta``, the γ folded into its weight and the β folded into its bias (its input was ``x·γ + β`` in the
    original); ``scale`` (the LayerScale λ folded into its rows), ``center`` (its rows centered: ``True`` or
    the ``[lo, hi)`` blocks), ``balance`` (the per-row scale taken back into λ): its output space is
    ``diag(1/s)·C·diag(λ)`` of the original's. Each vector is kept once, float64, in ``plan.adapter_vectors``
    under the name the record holds (``<norm site>:gamma``, ``<λ parameter>:scale``, ...).

    The values come from ``norm(site)`` (the original norm's effective γ and β), ``param(name)`` (a parameter
    before any edit) and ``balance(scale_fold)`` (λ's parameter after the balance; without it, the in-memory
    surgery records it after :func:`balance_layer_scale`); ``model`` may be the meta model (only its structure
    is read). The in-memory surgery and the low-memory rewrite (:mod:`normswap.checkpoint.streaming`) both
    call it, with their own readers, so that both write the same adapter bases. A Linear under an edit this
    does not model (β moved through attention, a centered reader of an approximate norm, a widened MLP, a
    Post-LN β folded through the residual into a reader's bias, rows centered along another axis, a centered
    embedding or convolution) gets the record ``{"kind", "refuse": <why>}`` instead (since round 56): a PEFT
    adapter attached there is refused in one line naming it, where before it acted, silently, on the
    converted Linear's own input and output. (A Post-LN residual writer needs no record: the adapter's output
    joins the same sum.)"""
    bases: dict[str, dict[str, Any]] = {}
    plan.adapter_vectors = {}
    by_site = {sp.name: sp for sp in plan.sites}
    for f in plan.folds:
        sp = by_site.get(f.site)
        if sp is None or sp.verdict not in EXACT_VERDICTS or f.beta_route == "moved":
            continue
        gamma, beta = norm(f.site)
        entry = bases.setdefault(f.reader, {"kind": f.kind})
        if f.gamma and gamma is not None:
            entry["gamma"] = _vector(plan, f"{f.site}:gamma", gamma)
        if f.beta and beta is not None:
            entry["beta"] = _vector(plan, f"{f.site}:beta", beta)
    for rf in plan.rms_folds:
        for path, kind in zip(rf.readers, rf.kinds, strict=True):
            bases.setdefault(path, {"kind": kind})["gamma"] = _vector(plan, f"{rf.weight}:gamma", param(rf.weight),
                                                                      rf.offset)
    for sf in plan.scale_folds:
        entry = bases.setdefault(sf.into, {"kind": sf.kind})
        entry["scale"] = _vector(plan, f"{sf.param}:scale", param(sf.param), sf.offset)
        if sf.keep and balance is not None:
            entry["balance"] = _vector(plan, f"{sf.param}:balance", balance(sf), sf.offset)
    refused: dict[str, dict[str, str]] = {}  # the first reason found names the Linear
    for e in plan.writer_edits:
        if e.kind in ("embedding", "conv") and e.owner and e.target.endswith("weight"):
            refused.setdefault(e.owner, {"kind": e.kind, "refuse": REFUSE_CENTERED_TABLE})
        if e.kind not in ("linear", "conv1d") or not e.owner:
            continue
        weight = linear_at(model, e.owner).weight
        if weight is not model.get_parameter(e.target):
            continue  # the bias: its centering is the output's own
        if e.axis % weight.dim() != (1 if e.kind == "conv1d" else 0):
            refused.setdefault(e.owner, {"kind": e.kind, "refuse": REFUSE_AXIS})
            continue
        bases.setdefault(e.owner, {"kind": e.kind})["center"] = [list(b) for b in e.blocks] if e.blocks else True
    for m in plan.beta_moves:
        refused.setdefault(m.reader, {"kind": m.reader_kind, "refuse": REFUSE_BETA_MOVED})
    for r in plan.centered_readers:
        refused.setdefault(r.reader, {"kind": r.kind, "refuse": REFUSE_CENTERED_READER})
    for c in plan.mean_carries:
        for p in (c.up, c.down):
            refused.setdefault(p, {"kind": bases.get(p, {}).get("kind", "linear"), "refuse": REFUSE_MEAN_CARRY})
    for rf in plan.residual_folds:  # (its residual writers need nothing: the adapter's output adds to the same sum)
        for p, kind in zip(rf.readers, rf.reader_kinds, strict=True):
            refused.setdefault(p, {"kind": kind, "refuse": REFUSE_RESIDUAL_BETA})
    bases = {p: e for p, e in bases.items() if p not in refused and len(e) > 1}
    bases.update(refused)
    named = {v for e in bases.values() for k, v in e.items() if k in ADAPTER_VECTOR_FIELDS}
    plan.adapter_bases = bases
    plan.adapter_vectors = {k: v for k, v in plan.adapter_vectors.items() if k in named}
    return bases


def written_parameters(plan: Plan, model: nn.Module) -> set[str]:
    """The parameters of ``model`` that :func:`apply_weight_edits` writes in place, by name.

    The caller gives exactly these tensors their own storage before the edits (the rest of a working
    copy may share the user's tensors) and copies exactly these back after verification, so an edit
    that writes a parameter in place must list it here. Untied and widened parameters are new
    tensors, not in-place writes."""
    names = {e.target for e in plan.writer_edits}

    def weight(path: str) -> str:
        return param_names(model, path)[0]

    def bias(path: str) -> str:
        return param_names(model, path)[1]

    for sf in plan.scale_folds:  # λ is set to 1 (or rebalanced); its writer's rows are scaled
        names |= {sf.param, weight(sf.into), bias(sf.into)}
    for rf in plan.rms_folds:
        names |= {rf.weight} | {weight(r) for r in rf.readers}
    for f in plan.folds:
        names |= ({weight(f.reader)} if f.gamma else set()) | ({bias(f.reader)} if f.beta else set())
    names |= {bias(m.into) for m in plan.beta_moves}  # value β shares carried through attention
    for r in plan.centered_readers:  # readers of approximate norms, blind to the leaked mean
        names |= {weight(r.reader), bias(r.reader)}
    for rf in plan.residual_folds:  # a Post-LN norm's β into its readers' and residual writers' biases
        names |= {bias(p) for p in (*rf.readers, *rf.writers)}
    present = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return names & present  # e.g. a LayerScale writer without a bias


def apply_structure(model: nn.Module, plan: Plan, backend: str = "auto") -> nn.Module:
    """Rebuild a converted model's *structure* from its manifest: untie, swap norms, add hooks.

    No analysis and no weight arithmetic: the weights come from the converted checkpoint. Works
    on a meta-device model (parameters are created on the device/dtype of the module replaced).
    """
    for u in plan.unties:
        untie(model, u)
    if plan.unties:
        mark_untied(model)
    for c in plan.mean_carries:
        widen_mlp(model, c, weights=False)
    for slot in plan.bias_slots:
        w = linear_at(model, slot.reader).weight
        add_bias_slot(model, slot, torch.empty(slot.features, device=w.device, dtype=w.dtype))
    for sp in plan.sites:
        if not sp.convert:
            continue
        old = model.get_submodule(sp.name)
        ref = next((t for t in [*old.parameters(), *old.buffers()] if t.is_floating_point()), None)
        new = _new_rmsnorm(sp, sp.normalized_shape, eps=sp.eps, elementwise_affine=sp.rms_weight,
                           bias=sp.rms_bias, backend=backend, param_shape=sp.param_shape,
                           device=ref.device if ref is not None else None,
                           dtype=ref.dtype if ref is not None else None)
        replace_module(model, old, new)
    for h in plan.hooks:
        install_hook(model, h)
    if plan.rotations:  # what a rotation added besides weights (normswap.rotate)
        from normswap.rotation import carry
        from normswap.rotation.rotate import install_ops

        install_ops(model, plan)
        carry.record(model)  # the ops' hooks and buffer names; a loader that swaps Linears needs them back
    torch_transformer.keep_python_forward(model, plan)
    attach_plan(model, plan)
    from normswap.rotation import carry

    carry.mark_bases(model)  # adapters attached later act on the edited Linears as on the original's
    return model
