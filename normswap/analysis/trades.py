"""Where a stream's centering may leave a table's row means: :class:`~normswap.analysis.plan.ConstantTrade`.

Centering each writer of a stream alone is sufficient for exactness, not necessary: only each token's sum
of writers must be zero-mean. A position table centered row by row moves every entry by its row's mean
(the massive channels' share in a ViT), and a quantizer that rounds the stream before and after the table
is added then rounds it twice (``docs/results/quantization.md``). Where a *float* writer (a bias: every
engine keeps biases in float) or a one-token parameter (a class token) reaches exactly the tokens a block
of the table's rows reaches, each token once, that block can keep its mean row mean and the other writer
take it away: the table's entries move by ``|m_t − c|`` instead of ``|m_t|``, and no token's sum changes.

Which tokens a writer reaches is proved numerically on the analysis inputs, in the working copy's float64
(float32 where a float64 copy does not fit): the copy runs with a parameter shifted
(:func:`torch.func.functional_call`: the model itself is never written) up to the first norm of the
stream, and the per-token mean of that norm's input is compared with the unshifted run (:class:`_Prober`
says why the first norm is enough). Ops are recognised by what they do to the shift, not by their names: a
class token concatenated in front, a table sliced and added, a bias reaching every patch token, a gather
by position ids, a bicubic resampling of the grid all look the same.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

from normswap.analysis.plan import ConstantTrade, Plan

# the shifts are 1 or whole row ids: float64 rounding leaves ~1e-13 of them, a model that resamples its table in
# float32 (transformers' DINOv2) ~1e-7, a float32 working copy (a model too big for a float64 one) ~1e-5; a
# writer that does not reach a token moves it by a whole unit, a wrong trade by a mix weight (≳ 0.01)
TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-3}
BIAS_KINDS = ("linear", "conv1d", "conv")
TABLE_KINDS = ("param", "embedding")


@dataclass
class _Slot:
    """A centered writer parameter that could take or give a constant."""

    name: str
    axis: int
    rows: int  # entries along the axes other than ``axis``
    bias: bool  # a Linear/conv bias: kept in float by quantizers
    table: bool  # a parameter or embedding table the stream reads rows of (a weight's output depends on data)


class _Enough(Exception):
    """Raised inside a probe's forward once the norm inputs it needs are recorded (the rest need not run)."""


class _Prober:
    """Per-token means at the first norm each stream reaches, for the working copy run with some parameters
    shifted.

    The first norm a stream reaches is enough: every shift probed is one number per token (the same on every
    feature), and a LayerNorm ignores such a shift, so the layers after it see the same inputs and each later
    norm of the stream sees the shift exactly as it was, or mixed over tokens by ops the analysis proved keep
    token means (a trade that leaves every token's mean alone at the first norm leaves it alone everywhere).
    So each probe runs the model only up to that norm's last call; the verification of the whole conversion
    checks every norm's input afterwards."""

    def __init__(self, model: nn.Module, plan: Plan, args: tuple, kwargs: dict,
                 draws: Callable[[], AbstractContextManager], streams: list[frozenset[str]]) -> None:
        self.model, self.args, self.kwargs, self.draws = model, args, kwargs, draws
        self.sites = {sp.name: len(sp.normalized_shape) for sp in plan.sites}
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.keep: set[str] = set(self.sites)
        self.until: int | None = None
        self.streams = streams  # the plain run stops once each stream's first norm was called
        order = self._run({}, calls=True)
        self.base = None
        if order is None:
            return
        firsts = {next((name for name, _ in order if name in stream), None) for stream in streams} - {None}
        if not firsts:
            return
        self.keep = set(firsts)
        self.until = max(i for i, (name, _) in enumerate(order) if name in self.keep)
        self.base = torch.cat([m for name, m in order if name in self.keep])

    def _run(self, shifts: dict[str, torch.Tensor], calls: bool = False):  # noqa: ANN202
        seen: list[tuple[str, torch.Tensor]] = []
        count = [0]
        handles = []
        for name, dims in self.sites.items():
            def hook(mod, args, kwargs, name=name, dims=dims):  # noqa: ANN001
                x = args[0] if args else next(iter(kwargs.values()), None)
                if name in self.keep and isinstance(x, torch.Tensor) and x.is_floating_point():
                    seen.append((name, x.detach().mean(tuple(range(-dims, 0))).reshape(-1)))
                if self.until is not None and count[0] >= self.until:
                    raise _Enough
                if self.until is None and all(any(n in stream for n, _ in seen) for stream in self.streams):
                    raise _Enough  # the plain run: every stream's first norm is known
                count[0] += 1
            handles.append(self.model.get_submodule(name).register_forward_pre_hook(hook, with_kwargs=True))
        replaced = {n: self.params[n] + d for n, d in shifts.items()}
        try:
            with torch.no_grad(), self.draws():  # a model that draws in eval mode (ViT-MAE) draws alike
                torch.func.functional_call(self.model, replaced, self.args, self.kwargs, strict=False)
        except _Enough:
            pass
        except Exception:  # noqa: BLE001 (a model that cannot be probed gets no trade; the conversion goes on)
            return None
        finally:
            for h in handles:
                h.remove()
        if calls:
            return seen
        return torch.cat([m for _, m in seen]) if seen else None

    def reach(self, shifts: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """How much each token's mean moves at the first norm of each stream (every call, in call order)."""
        if self.base is None:
            return None
        out = self._run(shifts)
        return None if out is None or out.shape != self.base.shape else out - self.base


def _rows_shape(p: torch.Tensor, axis: int) -> list[int]:
    return [n for i, n in enumerate(p.shape) if i != axis % p.dim()]


def row_shift(p: torch.Tensor, axis: int, per_row: torch.Tensor) -> torch.Tensor:
    """A tensor of ``p``'s shape holding ``per_row[r]`` on every feature of row ``r`` (rows: the other axes)."""
    ax = axis % p.dim()
    return per_row.reshape(_rows_shape(p, axis)).unsqueeze(ax).expand(p.shape).to(p.dtype)


def _slots(model: nn.Module, plan: Plan) -> list[_Slot]:
    """Centered writers that no other edit touches: whole-axis centering, no fold, no untie, no λ."""
    busy = {u.source for u in plan.unties} | {f"{u.module}.{u.attr}" if u.module else u.attr for u in plan.unties}
    busy |= {sf.param for sf in plan.scale_folds}
    owners_busy = {sf.into for sf in plan.scale_folds} | {f.reader for f in plan.folds} \
        | {m.into for m in plan.beta_moves} | {c.down for c in plan.mean_carries} | {b.reader for b in plan.bias_slots}
    params = dict(model.named_parameters(remove_duplicate=False))
    out = []
    for e in plan.writer_edits:
        if e.blocks is not None or e.target in busy or (e.owner and e.owner in owners_busy) or e.target not in params:
            continue
        p = params[e.target]
        rows = math.prod(_rows_shape(p, e.axis))
        out.append(_Slot(e.target, e.axis, rows, e.kind in BIAS_KINDS and p.dim() == 1, e.kind in TABLE_KINDS))
    return out


def _streams(plan: Plan) -> dict[str, frozenset[str]]:
    """The norms each centered writer writes (the analysis's stream records)."""
    where: dict[str, set[str]] = {}
    for sp in plan.sites:
        for t in sp.writer_targets:
            where.setdefault(t, set()).add(sp.name)
    return {t: frozenset(s) for t, s in where.items()}


def _is(values: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (values - target).abs() <= TOLERANCE[values.dtype] * target.abs().clamp_min(1)


def find_trades(model: nn.Module, plan: Plan, args: tuple, kwargs: dict,
                draws: Callable[[], AbstractContextManager] = contextlib.nullcontext) -> list[ConstantTrade]:
    """The constant trades of ``plan``'s centered writers, proved on ``model`` (the unedited working copy:
    float64, or float32 where a float64 copy does not fit, at a looser tolerance).

    A *taker* is a bias or a one-row parameter whose unit shift moves each norm-input token's mean by 0 or 1: its
    reach (one that reaches every token is taken as a bias: it reaches every token at any length). A *giver* is a
    table of several rows, each token reading rows with weights that sum to 0 or 1 (a slice, a gather by position
    ids, a bicubic resampling). A block of the giver's rows is proposed for each taker, one-token takers first (the
    class token, which reads its own row: row ids shifted by ``r+1`` and ``(r+1)²`` give back one ``r`` at its
    token), then each bias: the rows its tokens read where each reads one row, with the rows no token read (a bias
    reaches every token of its writer at any length, so the rows longer inputs read must carry the constant too), or
    else every row no other taker holds (a resampled grid reads a mix of them). A proposal is a trade only when the
    trade itself (block +1, taker −1) leaves the token means at the stream's first norm where they were (see
    :class:`_Prober`): the proof, whatever the proposal's reasoning. So the trades do not depend on the inputs'
    shape: a ViT traced at another image size reads a resampled table and gets the same trades.
    ``draws``: a context every probe runs in,
    which seeds the model's random draws alike each time and restores the caller's
    (:func:`normswap.surgery.verify.same_draws`).
    """
    if not plan.writer_edits or next(model.parameters()).dtype not in TOLERANCE:
        return []
    slots = _slots(model, plan)
    streams = _streams(plan)
    takers = sorted((s for s in slots if s.bias or (s.table and s.rows == 1)), key=lambda s: (s.bias, s.name))
    givers = [s for s in slots if s.table and s.rows > 1]
    pairs = [(g, t) for g in givers for t in takers
             if streams.get(g.name) and streams.get(g.name) == streams.get(t.name)]
    if not pairs:
        return []
    prober = _Prober(model, plan, args, kwargs, draws, [streams[g.name] for g, _ in pairs])
    params = prober.params

    taker_reach: dict[str, torch.Tensor | None] = {}
    for t in {t.name: t for _, t in pairs}.values():
        r = prober.reach({t.name: torch.ones_like(params[t.name])})
        ok = r is not None and bool((_is(r, torch.zeros_like(r)) | _is(r, torch.ones_like(r))).all())
        taker_reach[t.name] = (r > 0.5) if ok and bool((r > 0.5).any()) else None

    trades: list[ConstantTrade] = []
    for g in {g.name: g for g, _ in pairs}.values():
        p = params[g.name]
        ids = torch.arange(1, g.rows + 1, dtype=torch.float64)
        count = prober.reach({g.name: torch.ones_like(p)})
        first = prober.reach({g.name: row_shift(p, g.axis, ids)})
        second = prober.reach({g.name: row_shift(p, g.axis, ids * ids)})
        if count is None or first is None or second is None:
            continue
        once = _is(count, torch.ones_like(count))
        if not bool((once | _is(count, torch.zeros_like(count))).all()):
            continue  # some token reads the table with weights that do not sum to 0 or 1
        single = once & _is(first, first.round()) & _is(second, first.round() ** 2)  # reads one row
        row = torch.where(single, first.round() - 1, torch.full_like(first, -1)).long()
        unread = torch.ones(g.rows, dtype=torch.bool)  # rows no token read alone at these inputs
        unread[row[single].unique()] = False
        if not bool(single[once].all()):
            unread[:] = False  # some rows are read in mixes: which is unknown, so none is "unread"
        used = torch.zeros(g.rows, dtype=torch.bool)
        for t in (t for gg, t in pairs if gg.name == g.name):
            reach = taker_reach.get(t.name)
            if reach is None or not bool(once[reach].all()):
                continue
            # a one-row parameter every token reads (RoBERTa's single token-type row, a broadcast bias
            # parameter) reaches every token at any length, as a bias does: the rows longer or padded inputs
            # read must carry the constant too. Only one that reaches some tokens (a class token) is one-token.
            # "Every token": of those that read this table; the probe also sees other streams' tokens (AltCLIP's
            # image tower beside its RoBERTa text tower), which neither reaches.
            every = t.bias or bool(reach[once].all())
            proposals = []
            if bool(single[reach].all()):
                rows_in = torch.zeros(g.rows, dtype=torch.bool)
                rows_in[row[reach].unique()] = True
                proposals.append(rows_in | (unread & ~used) if every else rows_in)
            if every:
                proposals.append(~used)
            for rows_in in proposals:
                span = rows_in.nonzero().flatten()
                if not len(span):
                    continue
                lo, hi = int(span.min()), int(span.max()) + 1
                if len(span) != hi - lo or bool(used[lo:hi].any()):
                    continue  # not one block of rows, or rows already traded
                marks = torch.zeros(g.rows, dtype=torch.float64)
                marks[lo:hi] = 1
                check = prober.reach({g.name: row_shift(p, g.axis, marks),
                                      t.name: -torch.ones_like(params[t.name])})
                if check is None or not bool(_is(check, torch.zeros_like(check)).all()):
                    continue
                used[lo:hi] = True
                rows = f"row {lo}" if hi == lo + 1 else f"rows {lo}..{hi - 1}"
                what = "bias" if t.bias else "parameter every token reads" if every else "one-token parameter"
                trades.append(ConstantTrade(
                    g.name, g.axis, lo, hi, t.name,
                    f"{rows} of `{g.name}` keep their mean row mean, the {what} `{t.name}` takes it away "
                    "(both reach the same tokens, each token once)"))
                break
    return sorted(trades, key=lambda t: (t.table, t.lo))
