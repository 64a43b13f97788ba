"""Rotate a converted model's residual streams by an orthogonal matrix: the proof of rotation-readiness.

Rotation methods (SliceGPT, QuaRot, SpinQuant) rely on one invariance: if every norm on a stream
is an RMSNorm with unit weight, then ``rms_norm(x Q) = rms_norm(x) Q`` for any orthogonal ``Q``
(``Q Qᵀ = I`` keeps ``mean(x²)``); a bias the norm keeps (β/γ where β had no bias slot to fold
into) is part of the output and turns with it (``b ← b Q``). So multiplying every *writer*'s output features
by ``Q`` and every *reader*'s input features by ``Qᵀ`` leaves the model's outputs unchanged.

``normswap.patch(model, fold_gamma=True)`` produces such streams wherever the math allows, and the
plan records, per norm, whether its stream is ready and, if not, why (``SitePlan.rotation_ready``,
``SitePlan.rotation_reason``); norms that were RMS from the start (Llama) are in ``plan.rms_sites``.
:func:`rotate` applies a rotation to every ready stream, in float64, cast back once. Streams are the
connected groups of norms that share writers (a decoder stream, an encoder stream, a vision tower's
stream): each is rotated as a whole or not at all.

The matrices built here keep the mean direction (``Q·1 = 1``, :func:`keep_mean`): a zero-mean stream stays
zero-mean, so a rotated exact model is still exact with stock LayerNorms (the compat format), and a
centering op commutes with ``Q``. A stream centered at run time starts at a value no weight can turn (a
norm's output, a regenerated table, a nonlinear stem): it takes ``Q`` as one op right after its centering
op. ``output=`` decides what happens to a stream whose last norm output is a model output, ``online=``
adds QuaRot's online Hadamards (:mod:`normswap.rotation.hadamard`). Every op a rotation adds is a buffer plus a
hook that :func:`install_ops` rebuilds when a native checkpoint loads; the compat format refuses them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from normswap.analysis.linears import LinearView, linear_at, linear_module_kind, param_names
from normswap.analysis.plan import CENTERED_VERDICTS, FLAVOUR_SLOTS, Plan, SitePlan, plan_of
from normswap.errors import NormswapError, UsageError
from normswap.nn.call_args import argument_slot
from normswap.nn.rmsnorm import RMSNorm
from normswap.options import check_online_block, choose
from normswap.rotation import carry, hadamard
from normswap.rotation.eager_op import FOLD_SCALE, EagerOp, split
from normswap.rotation.heads import head_turn, turn_heads, value_heads
from normswap.surgery.scales import fold_layer_scale

KINDS = ("hadamard", "random")  # built from (width, kind, seed)
LEARNED = "learned"  # Q₀ (the "hadamard" matrix) times an R chosen from calibration data (rotation/learn.py)
NONE = "none"  # no stream turned; with online=True an online Hadamard at every Linear input (_online_only)


@dataclass
class Rotation:
    """What :func:`rotate` did: the streams rotated and the ones left alone, with reasons.

    Each entry of ``rotated`` is a dict: ``width``, ``norms``, ``writers``, ``readers``, ``kind``
    (``"hadamard"``, ``"random"`` or ``"user"``), ``seed``, ``construction`` (how the Hadamard matrix was
    built, e.g. ``"Paley I (q=11) ⊗ Sylvester 64"``), ``fallback`` (why a ``"hadamard"`` request got a
    random orthogonal matrix instead: no Hadamard order fits the width; ``""`` otherwise),
    ``mean_preserving`` (``Q·1 = ±1``), ``output`` (how a stream whose last norm output is a model output
    was handled: ``""``, ``"rotated"`` or ``"restore"``) and ``q``, the float64 ``d × d`` matrix itself
    (row-vector convention: the stream ``x`` became ``x @ q``). ``skipped`` entries have ``norms``, ``reason``
    and ``gamma_kept``: the norms that keep γ because the conversion's rotation planned to leave this stream
    alone (``normswap.patch(model, rotate=...)`` without ``fold_gamma=True`` folds γ only where it turns).
    """

    rotated: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"norms", "reason", "gamma_kept"}
    online_skipped: list[str] = field(default_factory=list)  # down projections left without an online Hadamard
    smoothing: Any = None  # normswap.rotation.smooth.Smoothing where rotate(smooth=α) ran, else None
    learned: Any = None  # normswap.rotation.learn.Learned where rotate(q="learned") ran, else None

    @property
    def matrices(self) -> dict[str, torch.Tensor]:
        """``{first norm of the stream: Q}`` for every rotated stream (float64, ``x → x @ Q``)."""
        return {r["norms"][0]: r["q"] for r in self.rotated}

    @property
    def fallbacks(self) -> list[str]:
        """One line per stream that asked for a Hadamard matrix and got a random orthogonal one."""
        return [f"width {r['width']}: {r['fallback']}" for r in self.rotated if r["fallback"]]

    def headline(self) -> str:
        """One line: ``rotated 2 stream(s) (hadamard), 1 left unrotated``."""
        if any(r["kind"] == NONE for r in self.rotated):
            return f"no stream turned; {_online_only_counts(self.rotated)}" + _blocks_said(self.rotated) + \
                (f", {len(self.online_skipped)} left alone" if self.online_skipped else "") + \
                (f"; {self.smoothing.headline()}" if self.smoothing is not None else "")
        kinds = "/".join(sorted({r["kind"] for r in self.rotated}))
        line = f"rotated {len(self.rotated)} stream(s)" + (f" ({kinds})" if kinds else "")
        if self.fallbacks:
            line += f", {len(self.fallbacks)} by a random orthogonal matrix (no Hadamard order fits their width)"
        if self.skipped:
            line += f", {len(self.skipped)} left unrotated ({self.skipped[0]['reason']})"
        if self.learned is not None:
            line += f"; {self.learned.headline()}"
        if self.smoothing is not None:
            line += f"; {self.smoothing.headline()}"
        return line

    def __str__(self) -> str:
        lines = []
        for r in self.rotated:
            if r["kind"] == NONE:
                lines.append(f"no stream turned: {_online_only_counts([r])}; per-head Hadamard (size "
                             f"{r['head_dim']}) on {len(r['value_heads'])} attention(s)' values")
                lines += [f"one online Hadamard after `{o['norm']}` for its readers "
                          f"{', '.join(f'`{rd}`' for rd in o['readers'])}" for o in r.get("online_outputs", [])]
                continue
            what = r["kind"] + (f" ({r['construction']})" if r["construction"] else "")
            if r["fallback"]:
                what += f"; {r['fallback']}"
            out = {"rotated": "; its model output comes out rotated",
                   "restore": "; its model output is turned back"}.get(r.get("output", ""), "")
            if r.get("online"):
                out += f"; online Hadamard before {len(r['online'])} down projection(s)" + _blocks_said([r])
            if r.get("value_heads"):
                out += f"; per-head Hadamard (size {r['head_dim']}) on {len(r['value_heads'])} attention(s)' values"
            lines.append(f"rotated stream of width {r['width']} by {what}: {len(r['norms'])} norm(s), "
                         f"{len(r['writers'])} writer tensor(s), {len(r['readers'])} reader(s){out}")
        lines += [f"not rotated ({len(s['norms'])} norm(s), e.g. `{s['norms'][0]}`): {s['reason']}"
                  for s in self.skipped]
        lines += [f"no online Hadamard: {why}" for why in self.online_skipped]
        if self.learned is not None:
            lines.append(self.learned.headline())
        if self.smoothing is not None:
            lines.append(self.smoothing.headline())
            lines += [f"not smoothed: `{n}`: {why}" for n, why in self.smoothing.skipped.items()]
        return "\n".join(lines) or "no stream to rotate"


def _blocks_said(rotated: list[dict]) -> str:
    """``, block-diagonal (blocks of 32) at widths 384, 1536`` where ``online_block`` applied, else ``""``."""
    said = [f"blocks of {r['online_block']} at width(s) {', '.join(str(w) for w in r['online_block_widths'])}"
            for r in rotated if r.get("online_block_widths")]
    return f", block-diagonal ({'; '.join(said)})" if said else ""


def _online_only_counts(rotated: list[dict]) -> str:
    """``online Hadamards before 10 Linear(s), 6 op(s) (2 after a norm, shared by its readers)``."""
    shared = [o for r in rotated for o in r.get("online_outputs", [])]
    own = sum(len(r["online"]) for r in rotated)
    line = f"online Hadamards before {own + sum(len(o['readers']) for o in shared)} Linear(s)"
    if shared:
        line += f", {own + len(shared)} op(s) ({len(shared)} after a norm, shared by its readers)"
    return line


def random_orthogonal(n: int, seed: int = 0) -> torch.Tensor:
    """A Haar-random ``n × n`` orthogonal matrix in float64 (QR of a Gaussian, signs fixed)."""
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


def randomized_hadamard(n: int, seed: int = 0) -> torch.Tensor | None:
    """``diag(r)·H·diag(s)/sqrt(n)``: a Hadamard matrix (:func:`normswap.rotation.hadamard.hadamard`) with random row
    and column signs ``r``, ``s`` drawn from ``seed``, float64; None when no Hadamard order fits ``n``.

    QuaRot uses ``H·diag(s)``; the row signs add nothing to the spreading but make ``H``'s column sums
    (``n`` in one column for Sylvester, ``1 - q`` for Paley) sums of random signs, so that the rank-one
    mean-keeping correction (:func:`keep_mean`) stays of order ``1/n`` per entry instead of ``1/sqrt(n)``.
    """
    h = hadamard.hadamard(n)
    if h is None:
        return None
    signs = hadamard.random_signs(2 * n, seed)
    return signs[:n].unsqueeze(1) * h * signs[n:].unsqueeze(0) / n**0.5


def keep_mean(q: torch.Tensor) -> torch.Tensor:
    """``R·q`` with ``R`` the Householder reflection that maps ``q·1`` onto ``1``: orthogonal, and ``(R q)·1 = 1``.

    Why: a stream ``x`` with ``mean(x) = 0`` stays zero-mean under ``x → x Q`` exactly when ``Q·1 = ±1``
    (``Q`` orthogonal, so also ``1ᵀQ = ±1ᵀ``); then ``mean(xQ) = ±mean(x)`` for every ``x``, a stock
    LayerNorm still equals the RMSNorm on the rotated stream, and a centering op commutes with ``Q``
    (``(I - 11ᵀ/d) Q = Q (I - 11ᵀ/d)``). ``R = I - 2uuᵀ/(uᵀu)`` with ``u = q·1 - 1`` (``|q·1| = |1|``, so
    ``R (q·1) = 1``). ``R`` differs from the identity by rank one, so ``R·q`` keeps ``q``'s spreading:
    ``x R q = x q - 2 (x·u)/(uᵀu) · uᵀq``, and ``uᵀq = 1ᵀ - (qᵀ1)ᵀ`` is a flat vector for a Hadamard ``q``.
    """
    ones = torch.ones(q.shape[0], dtype=q.dtype)
    u = q @ ones - ones
    uu = float(u @ u)
    if uu <= 1e-24 * q.shape[0]:
        return q.clone()
    return q - (2.0 / uu) * torch.outer(u, u @ q)


def is_mean_preserving(q: torch.Tensor, tol: float = 1e-9) -> bool:
    """``Q·1 = ±1`` (within ``tol`` per entry): the rotation keeps zero-mean streams zero-mean."""
    q64 = q.detach().double().cpu()
    s = q64.sum(dim=1)
    return bool((s - 1).abs().max() <= tol) or bool((s + 1).abs().max() <= tol)


def rotation_matrix(width: int, kind: str = "hadamard", seed: int = 0) -> tuple[torch.Tensor, dict]:
    """The mean-preserving ``width × width`` rotation :func:`rotate` uses for one stream, and its record.

    ``kind="hadamard"``: :func:`keep_mean` of the randomized Hadamard ``H·diag(s)/sqrt(width)`` (signs
    from ``seed``); where no Hadamard order fits ``width``, a random orthogonal matrix, and the record's
    ``fallback`` says why. ``kind="random"``: :func:`keep_mean` of a Haar-random orthogonal matrix from
    ``seed``. Deterministic given ``(width, kind, seed)``: the manifest records these to rebuild ``Q``.
    """
    choose("rotation", kind, KINDS)
    info = {"kind": kind, "seed": seed, "construction": "", "fallback": "", "mean_preserving": True}
    q = randomized_hadamard(width, seed) if kind == "hadamard" else None
    if kind == "hadamard" and q is None:
        info["fallback"] = (f"no Hadamard matrix of order {width} is built here (needs {width} = K·2^m with "
                            "K a Sylvester/Paley/product order): random orthogonal matrix instead")
    if q is None:
        q = random_orthogonal(width, seed)
    else:
        info["construction"] = "randomized Hadamard, " + hadamard.describe(width)
    return keep_mean(q), info


def streams(plan: Plan, model: nn.Module | None = None) -> list[list[SitePlan]]:
    """Converted norms, and norms that were RMS from the start (``plan.rms_sites``), grouped into streams:
    norms that share a writer read the same stream.

    With ``model``, writers are matched by parameter identity (a tied embedding has two names).
    """
    sites = [sp for sp in plan.sites if sp.convert] + list(plan.rms_sites)
    parent = list(range(len(sites)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[object, int] = {}
    for i, sp in enumerate(sites):
        keys = [id(model.get_parameter(n)) if model is not None else n for n in sp.writer_targets]
        keys += [(op["module"], op["where"], op["arg"]) for op in sp.rotation_ops]  # one op turns one stream
        for target in keys:
            if target in owner:
                parent[find(i)] = find(owner[target])
            else:
                owner[target] = i
    groups: dict[int, list[SitePlan]] = {}
    for i, sp in enumerate(sites):
        groups.setdefault(find(i), []).append(sp)
    return list(groups.values())


OUTPUT_BLOCK = "its output is the model output"  # the planner's reason when only outputs read a norm


def _axes(plan: Plan) -> dict[str, int]:
    """``{writer parameter: output-feature axis}`` for every writer a rotation may turn."""
    axes = {e.target: e.axis for e in plan.writer_edits if e.blocks is None}
    axes.update(plan.rotation_axes)
    return axes


GAMMA_STAYS = ("so its norms keep γ (and β where a conversion without rotate puts it): the rotation folds γ only "
               "into the streams it turns")


def _kept_reason(plan: Plan, group: list[SitePlan]) -> str:
    """Why the stream of ``group`` was left alone when the conversion's rotation planned the γ folds, where it
    kept γ in its norms for that reason (``plan.options["gamma_kept"]``); '' otherwise."""
    kept = plan.options.get("gamma_kept") or {}
    why = next((kept[sp.name] for sp in group if sp.name in kept), "")
    return f"{why}; {GAMMA_STAYS}" if why else ""


def _blocker(model: nn.Module, plan: Plan, group: list[SitePlan], output: str | None, planned: bool = False) -> str:
    """Why the stream of ``group`` cannot turn ('' when it can). ``planned``: asked of ``plan`` before its
    surgery (``model`` is the unedited one): a converted norm's weight will be 1 where the plan folds its γ."""
    kept = _kept_reason(plan, group)
    if kept:
        return kept
    restored = _restored(group, output)
    for sp in group:
        if sp.rotation_ready:
            continue
        if output is not None and sp.rotation_reason.startswith(OUTPUT_BLOCK):
            continue  # the caller chose what the model output becomes
        return f"`{sp.name}`: {sp.rotation_reason or 'not rotation-ready'}"
    widths = {tuple(sp.normalized_shape) for sp in group}
    if len(widths) != 1:
        return f"norms of different widths share writers ({sorted(widths)})"
    axes = _axes(plan)
    blocked = {e.target for e in plan.writer_edits if e.blocks is not None}
    targets = {t for sp in group for t in sp.writer_targets}
    if not targets and not any(sp.rotation_ops for sp in group):
        return "no writer recorded (a plan read back from a manifest has no stream details: " \
            "rotate right after normswap.patch)"
    for t in sorted(targets):
        if t in blocked or t not in axes:
            return f"writer `{t}` is centered per block, not over the whole stream"
    keeps_gamma = ("keeps γ (its output, the model output, has no Linear reader to fold it into), so its output "
                   "cannot come out rotated: output='restore' turns the stream back before it")
    folded = {f.norm for f in plan.rms_folds}
    for sp in group:
        module = model.get_submodule(sp.name)
        if sp.name in restored:
            continue  # sees the stream as before
        if sp.verdict == "rms":  # γ folded by RmsFold (effective weight 1), checked by the planner
            weight = getattr(module, "weight", None)
            unit = isinstance(weight, torch.Tensor) and bool((weight == 1).all())
            if sp.rotation_outputs and sp.name not in folded and not unit:
                return f"`{sp.name}` {keeps_gamma}"
            continue
        if planned:  # after the surgery: an RMSNorm whose weight is 1 where γ folds (or there is none)
            has_gamma = FLAVOUR_SLOTS.get(sp.flavour, (True, True))[0]
            if has_gamma and not sp.fold_gamma:
                return f"`{sp.name}` {keeps_gamma}" if sp.rotation_outputs else f"`{sp.name}` keeps γ"
            continue
        if not isinstance(module, RMSNorm):
            return f"`{sp.name}` is not an RMSNorm"
        if module.weight is not None and not bool((module.weight == 1).all()):
            if sp.rotation_outputs:
                return f"`{sp.name}` {keeps_gamma}"
            return f"`{sp.name}` weight is not 1 (convert with fold_gamma=True)"
    return ""


def _restored(group: list[SitePlan], output: str | None) -> set[str]:
    """The norms whose input is turned back (``output="restore"``): those whose output is a model output."""
    return {sp.name for sp in group if sp.rotation_outputs} if output == "restore" else set()


RESTORE_BUFFER = "normswap_unrotate"  # Qᵀ on a norm whose input is turned back (output="restore")


class Unrotate:
    """Forward pre-hook: the norm's input times the ``Qᵀ`` it holds (``output="restore"``), so the norm, its
    γ/β and whatever reads it see the stream as before the rotation."""

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        return (torch.matmul(x, getattr(module, RESTORE_BUFFER).to(x.dtype)), *args[1:])


def _install_unrotate(module: nn.Module, value: torch.Tensor, *, compose: bool = False) -> None:
    """Register the ``Qᵀ`` buffer and pre-hook; on a norm that has them, ``compose`` turns back a second
    rotation too (``(Q₁Q₂)ᵀ = Q₂ᵀQ₁ᵀ``)."""
    if getattr(module, "_normswap_unrotate", None) is None:
        module.register_buffer(RESTORE_BUFFER, value)
        module._normswap_unrotate = module.register_forward_pre_hook(Unrotate())
    elif compose:
        old = getattr(module, RESTORE_BUFFER)
        setattr(module, RESTORE_BUFFER, (value.double() @ old.double()).to(old.dtype))
    else:
        setattr(module, RESTORE_BUFFER, value)


ROTATION_BUFFER = "normswap_rotation"  # Q on the module where a centered stream starts (a rotation op)


class RotateOutput:
    """Forward hook: the module's output times the ``Q`` it holds (a stream start no weight can turn)."""

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        q = getattr(module, ROTATION_BUFFER)
        if not isinstance(output, torch.Tensor):
            # a module returning (tensor, grid size) (Data2Vec-vision's embeddings, where a stem centering op
            # sits): the plan places an op only where the output holds one tensor, the one turned here
            return pytree.tree_map_only(torch.Tensor, lambda t: torch.matmul(t, q.to(t.dtype)), output)
        return torch.matmul(output, q.to(output.dtype))


class RotateInput:
    """Forward pre-hook: one input argument times the ``Q`` the module holds."""

    def __init__(self, arg: int | str) -> None:
        self.arg = arg

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        q = getattr(module, ROTATION_BUFFER)
        slot = argument_slot(module, args, kwargs, self.arg)  # traced by name, perhaps called by position
        if isinstance(slot, int):
            args = list(args)
            args[slot] = torch.matmul(args[slot], q.to(args[slot].dtype))
            return tuple(args), kwargs
        kwargs = dict(kwargs)
        kwargs[slot] = torch.matmul(kwargs[slot], q.to(kwargs[slot].dtype))
        return args, kwargs


def _one_slot_per_module(model: nn.Module, turns: list[StreamTurn], result: Rotation) -> list[StreamTurn]:
    """The streams of ``turns`` whose rotation ops can all be installed: a module holds one ``Q`` buffer and one
    hook, for one argument or its output. A stream whose op would sit on a module where another stream's op
    sits at another slot (PerceiverIO centers both its ``data`` and its ``queries`` argument, of two
    widths, at its own input) is left unrotated, and ``result.skipped`` says why."""
    slots: dict[str, tuple] = {}  # module path -> (where, arg) of the op it holds or will hold
    kept = []
    for turn in turns:
        group, ops = turn.group, turn.ops
        clash = None
        for op in ops:
            have = slots.get(op["module"], getattr(model.get_submodule(op["module"]), "_normswap_rotation_slot", None))
            if have is not None and tuple(have) != (op["where"], op["arg"]):
                clash = op
                break
        if clash is not None:
            where = f"`{clash['module']}`" if clash["module"] else "the model itself"
            result.skipped.append({"norms": [sp.name for sp in group], "reason": (
                f"its centering op's turn would sit on {where}, which already turns another stream at another "
                "argument (one rotation op per module)")})
            continue
        slots.update({op["module"]: (op["where"], op["arg"]) for op in ops})
        kept.append(turn)
    return kept


def _install_rotation_op(module: nn.Module, op: dict, value: torch.Tensor, *, compose: bool = False) -> None:
    """Register the ``Q`` buffer and hook; where they exist, ``compose`` makes it ``Q₁Q₂`` (a second rotation)."""
    module._normswap_rotation_slot = (op["where"], op["arg"])
    if getattr(module, "_normswap_rotation", None) is not None:
        old = getattr(module, ROTATION_BUFFER)
        setattr(module, ROTATION_BUFFER, (old.double() @ value.double()).to(old.dtype) if compose else value)
        return
    module.register_buffer(ROTATION_BUFFER, value)
    if op["where"] == "output":
        module._normswap_rotation = module.register_forward_hook(RotateOutput())
    else:
        module._normswap_rotation = module.register_forward_pre_hook(RotateInput(op["arg"]), with_kwargs=True)


HADAMARD_BUFFER = "normswap_hadamard"  # H_K of an online Hadamard (the small factor; fwht does the 2^m part)
SIGNS_BUFFER = "normswap_hadamard_signs"  # its random signs D (x → x D H/sqrt(n))


class OnlineHadamard:
    """Forward pre-hook: the module's input times ``D·H/sqrt(n)`` (``D`` random signs, where the module holds
    them), ``H = H_K ⊗ H_{2^m}``: in eager by an :class:`EagerOp`; while a graph is captured as two matmuls of
    stock ops (:meth:`stock`: ``(H_K ⊗ H_{2^m/b}) ⊗ H_b``, the eager form's split, the factors plain attributes
    rebuilt from the widths; the butterfly :func:`normswap.rotation.hadamard.fwht` only where they are missing),
    so it exports and compiles. The module's weight holds ``(D H/sqrt(n))ᵀ``. Where the stored factor is a power of two
    ``b`` (``rotate(..., online_block=b)``), ``H`` is block-diagonal, ``(I ⊗ H_b)`` scaled by ``b^-½``: one
    matmul by the factor (:func:`normswap.rotation.hadamard.block_matmul`).

    Why the signs: an MLP down projection reads GELU/ReLU outputs, whose per-token mean is a third of their
    rms or more. A plain ``H`` maps that mean onto one coordinate (its first column is all ones), a spike of
    ``sqrt(n)·mean`` that sets every per-token activation scale (a DINOv2-shaped MLP input's max/rms went
    5.9 → 10.2 under ``H``, 3.5 under ``D·H``); with ``D`` the mean spreads like everything else."""

    def __init__(self) -> None:
        self.pow2_copies: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.eager_ops: dict[tuple[torch.device, torch.dtype], EagerOp] = {}

    def __call__(self, module: nn.Module, args: tuple) -> tuple:
        return (self.transform(module, args[0]), *args[1:])

    def transform(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """``x·D·H/sqrt(n)`` with the factors ``module`` holds: in eager mode by its :class:`EagerOp` (constants
        prepared once per device and dtype, few kernels), while a graph is captured (``torch.compile``, the
        exporters, ``torch.jit.trace``) or for a tensor subclass by the stock form below, which holds the
        stored factors as they are."""
        if type(x) is torch.Tensor and not torch.compiler.is_compiling() and not torch._C._is_tracing():
            buffers = module._buffers  # not module.<name>: nn.Module.__getattr__ costs ~0.6 us a read
            small, signs = buffers.get(HADAMARD_BUFFER), buffers.get(SIGNS_BUFFER)
            if small is not None:
                op = self.eager_ops.get((x.device, x.dtype))
                if op is None or not op.holds(small, signs):
                    op = self.eager_op(small, signs, x)
                if op is not None:
                    return op(x)
        return self.stock(module, x)

    def stock(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The op's stock form (what graph capture records): the signs, then the matmuls by the factors ``module``
        holds (:func:`normswap.rotation.hadamard.split_matmuls`; block-diagonal:
        :func:`normswap.rotation.hadamard.block_matmul`; the butterfly only where no ``2^m`` factor was built)."""
        small, pow2 = getattr(module, HADAMARD_BUFFER, None), getattr(module, POW2_ATTR, None)
        if small is None:  # a hook copied onto another module without the op's values (torch.ao's swap)
            raise NormswapError(carry.lost_line(getattr(self, "path", "?"), module))
        signs = getattr(module, SIGNS_BUFFER, None)
        if signs is not None:
            x = x * signs.to(x.dtype)
        if hadamard.is_block_factor(small.shape[0]):  # block-diagonal: the stored factor is H_b, one matmul
            return hadamard.block_matmul(x, small)
        if pow2 is not None:  # two matmuls, the eager form's split: as many exported nodes, not a butterfly's dozens
            rest = getattr(module, REST_ATTR, None)
            rest = None if rest is None else rest.to(device=x.device, dtype=x.dtype)  # H_{2^m/b}
            n = small.shape[0] * pow2.shape[0] * (1 if rest is None else rest.shape[0])
            first = self.pow2_like(pow2, x)
            if x.dtype in FOLD_SCALE:  # the scale in the constant (a Python float: exporters fold it), no Mul
                return hadamard.split_matmuls(x, small, first * float(n) ** -0.5, rest=rest)
            return hadamard.split_matmuls(x, small, first, rest=rest, scale=float(n) ** -0.5)
        return hadamard.fwht(x, small)

    def eager_op(self, small: torch.Tensor, signs: torch.Tensor | None, x: torch.Tensor) -> EagerOp | None:
        """A new :class:`EagerOp` for calls like ``x`` (None where the buffers cannot be cached: inference
        tensors); the ops made from other buffers (before a ``.to``, a new value) are dropped."""
        op = EagerOp.of(small, signs, x)
        if op is not None:
            self.eager_ops = {k: v for k, v in self.eager_ops.items() if v.holds(small, signs)}
            self.eager_ops[(x.device, x.dtype)] = op
        return op

    def pow2_like(self, pow2: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``pow2`` (float64, on the CPU) on ``x``'s device in its dtype, converted once per device and dtype.

        Why: converting it on every call costs a cast on the host, and on a GPU a host-to-device copy
        per Linear per decoding step. Made outside inference mode (an inference tensor cannot be saved for
        backward, so a model verified under ``torch.inference_mode`` and then trained would fail), and not cached
        while torch.compile or torch.export traces (their tensors must not outlive the trace)."""
        if torch.compiler.is_compiling():
            return pow2.to(device=x.device, dtype=x.dtype)
        key = (x.device, x.dtype)
        copy = self.pow2_copies.get(key)
        if copy is None or copy.shape != pow2.shape:
            with torch.inference_mode(False):
                copy = self.pow2_copies[key] = pow2.to(device=x.device, dtype=x.dtype)
        return copy


class OnlineHadamardOutput(OnlineHadamard):
    """Forward hook: the same op on a norm's *output*, shared by all its readers (each reader's weight holds
    ``(D H/sqrt(n))ᵀ``): one op where a pre-hook on each reader would transform the same tensor once per
    reader (q, k and v). Placed only where the norm's output reaches those readers alone
    (``SitePlan.readers_alone``), so no other consumer sees the turned output."""

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.transform(module, output)

    def as_input(self) -> OnlineHadamard:
        """The same op as a pre-hook on one reader's input (a new hook object: it keeps its own per-device
        constants), for :func:`normswap.rotation.carry.split_shared_op`."""
        return OnlineHadamard()


# H_b, the last factor of H_{2^m} = H_r ⊗ H_b in OnlineHadamard's stock form (b from eager_op.split): a plain
# attribute (float64), not a buffer, so no checkpoint holds it and no loader re-initialises it (a ±1 matrix is
# rebuilt from the widths whenever the op is installed)
POW2_ATTR = "_normswap_hadamard_pow2"
# H_r, r = 2^m / b, of that split (the stock form multiplies by H_K ⊗ H_r across the rows of b); None for r = 1
REST_ATTR = "_normswap_hadamard_rest"


def _install_online(module: nn.Module, small: torch.Tensor, signs: torch.Tensor | None = None, *,
                    width: int | None = None) -> None:
    """The online Hadamard's buffers and hook on ``module`` (or new values for them): a pre-hook on a Linear's
    input, or, given the ``width`` of a norm's output, a forward hook on that output (:class:`OnlineHadamardOutput`).
    The ``2^m`` factor's two Sylvester factors ``H_r ⊗ H_b`` (the split of :func:`normswap.rotation.eager_op.split`)
    are plain attributes built here from the widths, so the stock form runs as two matmuls (a checkpoint holds
    only ``H_K`` and the signs, as before)."""
    n = width if width is not None else module.weight.shape[_reader_axis(module)]
    k = small.shape[0]
    m = n // k
    full = not hadamard.is_block_factor(k)  # a block op's factor is H_b itself: nothing else to build
    b = split(k, m) if full and m & (m - 1) == 0 else None  # the eager form's split: H_{2^m} = H_{2^m/b} ⊗ H_b
    pow2 = None if b is None else hadamard.sylvester(b)
    rest = None if b is None or b == m else hadamard.sylvester(m // b)
    setattr(module, POW2_ATTR, pow2)
    setattr(module, REST_ATTR, rest)
    if getattr(module, "_normswap_online", None) is not None:
        setattr(module, HADAMARD_BUFFER, small)
        if signs is not None:
            setattr(module, SIGNS_BUFFER, signs)
        return
    module.register_buffer(HADAMARD_BUFFER, small)
    if signs is not None:
        module.register_buffer(SIGNS_BUFFER, signs)
    module._normswap_online = module.register_forward_pre_hook(OnlineHadamard()) if width is None else \
        module.register_forward_hook(OnlineHadamardOutput())


def _online_targets(model: nn.Module, writers: list[str], width: int) -> tuple[list[str], list[str]]:
    """The MLP down projections among a stream's writers (Linear/Conv1D whose input width is not the
    stream's: ``(paths with a Hadamard order, reasons for the others)``."""
    found, why = [], []
    modules = dict(model.named_modules())
    for path in sorted({w.rpartition(".")[0] for w in writers}):  # a top-level raw parameter's owner is the model
        module = modules.get(path)
        if not (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"):
            continue
        n = module.weight.shape[_reader_axis(module)]
        if n == width or getattr(module, "_normswap_online", None) is not None:
            continue  # an attention output projection; or an online Hadamard is there already
        if not hadamard.has_hadamard(n):
            why.append(f"`{path}`: no Hadamard matrix of order {n}")
            continue
        found.append(path)
    return found, why


def _rotate_heads_(model: nn.Module) -> tuple[list[str], int | None, str]:
    """Per-head Hadamard on values, folded offline: each head's value features ``v_h → v_h H̃`` (the value
    projection's rows and bias, per head) and the output projection's input columns of each head ``W → W H̃``.
    Attention is linear in each head's values (``softmax(.) V_h H̃ = (softmax(.) V_h) H̃``), so outputs
    are unchanged; grouped-query heads share one ``H̃``, so any head mapping works."""
    pairs, hd = value_heads(model)
    if not pairs:
        return [], hd, ("no attention with separate value/output projections (v_proj with o_proj/out_proj, or "
                        "self|attention.value with output.dense)")
    if not hadamard.has_hadamard(hd):
        return [], hd, f"no Hadamard matrix of order {hd} (the head size)"
    h = head_turn(hd)
    _turn_heads_(pairs, {path: h for path, _, _ in pairs})
    return [path for path, _, _ in pairs], hd, ""


def _turn_heads_(pairs: list[tuple[str, nn.Linear, nn.Linear]], matrices: dict[str, torch.Tensor]) -> None:
    """Fold one head-size orthogonal matrix per attention layer (``{attention path: matrix}``, paths of
    ``pairs``, :func:`normswap.rotation.heads.value_heads`' layers): the value projection's rows and bias, and
    the output projection's input columns, per head. The per-head Hadamard (:func:`_rotate_heads_`) and a
    learned R2 alike."""
    by_path = {path: (v, o) for path, v, o in pairs}
    for path, r2 in matrices.items():
        v, o = by_path[path]
        for p, axis in ((v.weight, 0), (v.bias, 0), (o.weight, 1)):
            if p is not None:
                with torch.no_grad():
                    p.copy_(turn_heads(p.detach().double(), axis, r2.to(p.device)).to(p.dtype))


def _like(module: nn.Module, model: nn.Module) -> dict:
    ref = next(iter(module.parameters()), None)
    if ref is None:
        ref = next(iter(model.parameters()), None)
    return {"device": ref.device, "dtype": ref.dtype} if ref is not None else {}


def install_ops(model: nn.Module, plan: Plan) -> None:
    """Rebuild the structure a rotation added (loading a native checkpoint; no weight arithmetic): the
    ``Qᵀ`` buffer and hook of each norm whose model output is turned back. The buffer's value comes with
    the checkpoint's weights; it is created here, empty, on the norm's device and dtype."""
    for r in plan.rotations:
        width = int(r["width"])
        for name in r.get("restore", []):
            module = model.get_submodule(name)
            _install_unrotate(module, torch.empty(width, width, **_like(module, model)))
        for op in r.get("ops", []):
            module = model.get_submodule(op["module"])
            _install_rotation_op(module, op, torch.empty(width, width, **_like(module, model)))
        blocked = {int(w) for w in r.get("online_block_widths", [])}  # since round 50: block-diagonal ops

        def order(n: int, r: dict = r, blocked: set[int] = blocked) -> int:
            return int(r["online_block"]) if n in blocked else hadamard.hadamard_order(n)

        for path in r.get("online", []):
            module = model.get_submodule(path)
            n = module.weight.shape[_reader_axis(module)]
            k = order(n)
            signs = torch.empty(n, **_like(module, model)) if r.get("online_signs") else None  # since 2026-11-29
            _install_online(module, torch.empty(k, k, **_like(module, model)), signs)
        for shared in r.get("online_outputs", []):  # since 2026-11-30: one op after a norm for all its readers
            module, n = model.get_submodule(shared["norm"]), int(shared["width"])
            k = order(n)
            _install_online(module, torch.empty(k, k, **_like(module, model)), torch.empty(n, **_like(module, model)),
                            width=n)


def _rotate_axis_(p: torch.Tensor, axis: int, q: torch.Tensor) -> None:
    """``p`` with its ``axis`` features multiplied by ``q`` (row-vector convention), fp64, cast once."""
    w = p.detach().double().movedim(axis, -1)
    with torch.no_grad():
        p.copy_((w @ q).movedim(-1, axis).to(p.dtype))


def _reader_axis(module: nn.Module | LinearView) -> int:
    return 0 if linear_module_kind(module) == "conv1d" else 1  # HF Conv1D (and x @ W) stores [in, out]


def _reader_rows(model: nn.Module, name: str) -> tuple[int, int | None]:
    """What a reader's rotation turns: its weight parameter, and which rows (a functional linear may use
    some rows of a stacked q/k/v weight: two such readers of one parameter turn different rows)."""
    module = linear_at(model, name)
    if isinstance(module, LinearView):
        return id(module.weight_param), module.spec.rows[0] if module.spec.rows else None
    return id(module.weight), None


def _user_matrix(q: torch.Tensor) -> torch.Tensor:
    q64 = q.detach().double().cpu()
    if q64.dim() != 2 or q64.shape[0] != q64.shape[1]:
        raise NormswapError(f"q must be a square matrix, got shape {tuple(q.shape)}")
    if float((q64.T @ q64 - torch.eye(q64.shape[0], dtype=torch.float64)).abs().max()) > 1e-6:
        raise NormswapError("q is not orthogonal (qᵀq differs from the identity by more than 1e-6)")
    return q64


def rotate(model: nn.Module, q: str | int | torch.Tensor = "hadamard", *, seed: int = 0,
           online: bool = False, output: str | None = None, smooth: float | None = None,
           calibration: Any = None, bits: int = 4, act_bits: int | None = None, group_size: int | None = None,
           steps: int = 100, lr: float = 1e-3, grid: str = "symmetric", scales: bool = False,
           heads: bool = False, logit_top_k: int | None = None,
           progress: Callable[[Any], None] | None = None, online_block: int | None = None) -> Rotation:
    """Multiply every rotation-ready residual stream of a converted model by an orthogonal matrix.

    Args:
        model: a model converted by ``normswap.patch(model, fold_gamma=True)``, in place.
        q: ``"hadamard"`` (default): a randomized Hadamard matrix ``H·diag(s)/sqrt(d)`` per stream (QuaRot's
            choice: every feature spread evenly over all), made mean-preserving (:func:`keep_mean`); a width
            with no Hadamard order here gets a random orthogonal matrix and the result says so.
            ``"random"``: a Haar-random orthogonal matrix per stream, made mean-preserving. An int: a seed
            for ``"random"`` (``rotate(model, 3)`` = ``rotate(model, "random", seed=3)``). A tensor: your own
            orthogonal ``d × d`` matrix, applied as given to every ready stream of width ``d``.
            ``"learned"``: per stream, the ``"hadamard"`` matrix times an orthogonal ``R`` learned on
            ``calibration`` so that the model quantized as ``bits``/``act_bits``/``group_size`` say comes out
            closest to the float model (SpinQuant's R1: the Cayley transform of a skew-symmetric parameter,
            ``steps`` Adam steps at ``lr``; :mod:`normswap.rotation.learn`). Still orthogonal and
            mean-preserving, so the float model's outputs are unchanged. The search starts from the better,
            on the calibration batches, of the Hadamard and no rotation (``R = Q₀ᵀ``: a stream lighter-tailed
            than Gaussian quantizes worse turned), and keeps that start where learning does not lower the error.
            ``"none"`` (with ``online=True`` only): no stream turns, so the norms keep γ and β and LayerScale
            stays where the conversion put it (any converted model, ``fold_gamma`` not needed); instead every
            Linear input of the converted streams takes an online Hadamard: each Linear reader of a norm
            (queries, keys, values, MLP up projection) and each MLP down projection gets the op ``x·D·H/sqrt(n)``
            before it and ``W·D·H/sqrt(n)`` in its weight, and the values turn per head with the output
            projection's columns (no op). Where a norm's output is read only by Linears that all take the op,
            each reading only that output (q, k and v), the op sits once after the norm instead, its transpose
            folded into every reader (``Rotation.rotated[0]["online_outputs"]``): the same function with one
            transform instead of one per reader. For block-wise weight quantizers (blocks run along the input
            features) this evens out every weight's blocks without folding γ into the readers' columns, which
            is what a turned stream costs at 4 bits on a model with uneven γ (DINOv2-small:
            ``docs/results/quantization.md``). A model turned so cannot be rotated again.
        seed: the random signs / random matrix of the first stream; the i-th stream uses ``seed + i``.
        online: also QuaRot's online Hadamard on every MLP down projection of a rotated stream (a writer
            Linear/Conv1D whose input width ``n`` is not the stream's): an op computing ``x·H/sqrt(n)``
            by the fast Walsh–Hadamard transform before it, ``Hᵀ`` folded into its weight. The op is a
            buffer (``H_K``) and a pre-hook, saved and rebuilt by the native format; stock ops, so it
            exports. A width with no Hadamard order is left alone and listed in ``Rotation.online_skipped``.
            Also per-head Hadamards on values and outputs where they fold (attention modules with separate
            ``v_proj`` and ``o_proj``/``out_proj`` Linears, or BERT/ViT's ``self``/``attention.value`` with
            ``output.dense``, over whole heads; the head size from the config):
            each head's values turn by ``H/sqrt(head_dim)`` (value projection rows) and the output
            projection's columns of that head absorb it; weights only, no op.
        output: for a stream whose last norm's output is itself a model output (a ViT/DINOv2
            backbone's ``last_hidden_state``, a base model's final norm): ``None`` (default) leaves such a
            stream unrotated and says so; ``"rotated"`` rotates it and that output comes out as ``y Q``:
            every cosine, inner product and distance between output vectors is unchanged (embeddings
            used for search work as they are), and ``Q`` is in the result (:attr:`Rotation.matrices`)
            and rebuildable from the manifest; ``"restore"`` rotates it and turns that norm's output back
            before that norm (one ``d × d`` matmul per token: a ``Qᵀ`` buffer and pre-hook on the norm, which
            the native format saves and rebuilds; the compat format cannot hold it). ``"rotated"`` needs
            the norm's γ folded, i.e. a Linear reader besides the output; ``"restore"`` works either way.
        smooth: SmoothQuant's α in [0, 1], or None (default: no smoothing). After the turn, each norm of a
            rotated stream whose output only Linears read takes a per-channel weight ``1/s`` in the rotated
            basis and its readers' input columns ``× s``, with ``s_j = max|a_j|^α / max|W_:,j|^(1-α)`` from
            the norm's rotated output ``a`` on ``calibration`` and the readers' columns ``W``
            (:mod:`normswap.rotation.smooth`). Exact for any ``s``; it evens activation and weight channel
            ranges out between them. The norms keep that weight (a float multiply in every engine), so the
            model cannot be rotated again afterwards. With ``q="none"`` (online Hadamards alone) the scale goes
            in before the ops, in the norm's own basis: γ and β ``/ s``, the readers' columns ``× s``, then the
            op after the norm spreads the smoothed output; on DINOv2-small this is what takes 4-bit weights
            furthest below the original (``docs/results/quantization.md``, round 51).
        calibration: the inputs ``smooth`` measures activations on and ``"learned"`` learns from: a tensor,
            a tuple or dict of model inputs, or a list of them (as ``normswap.patch``'s ``calibration``).
            Default: for a transformers model, the built-in calibration batches (English text, generated
            images or speech); a custom model must pass it.
        bits: with ``q="learned"`` only (as the six below; :class:`normswap.rotation.learn.LearnSettings`):
            the weight bits of the fake quantizer the rotation is learned for (symmetric, per output channel).
        act_bits: per-token bits of every Linear's input in that quantizer, or None (weights only).
        group_size: one weight scale per this many inputs (ONNX Runtime ``MatMulNBits``: 32), or None.
        steps: optimiser steps, one calibration batch each.
        lr: Adam's step on the skew parameter.
        grid: the weights' integer grid: ``"symmetric"`` (±(2^(b−1) − 1)), ``"full"`` (ONNX Runtime
            ``MatMulNBits``' −2^(b−1) … 2^(b−1) − 1) or ``"asymmetric"`` (min … max with a zero point: HQQ's
            start, asymmetric int4); learn on the grid the engine uses, or on several joined by ``+``
            (``"full+asymmetric"``) for one rotation that serves quantizers on different grids.
        scales: also learn, with ``R``, a per-channel scale between each norm of a rotated stream and its
            Linear readers (the migration ``smooth`` makes, chosen against the quantized model's error instead
            of by SmoothQuant's formula; exact for any scale; the norms keep the weight ``1/s``, as with
            ``smooth``). Not with ``smooth``.
        heads: also learn, with ``R``, SpinQuant's R2: per attention layer with separate value and output
            projections over whole heads (the layouts ``online`` turns), one orthogonal head-size matrix turning
            each head's values (the value projection's rows and bias) and the output projection's columns of
            that head; weights only, no op, exact (attention is linear in each head's values). With
            ``online=True`` it is learned on top of the per-head Hadamard.
        logit_top_k: for a model whose output is logits from an output head Linear: the loss's KL over part of
            the vocabulary, per calibration batch the float model's ``k`` likeliest tokens at each position and
            the batch's input tokens, plus one class for all the others (its quantized mass estimated from a
            fixed sample of 2,048 of them); the head and the input embedding turned (the head rounded) on those
            rows alone. Makes a step affordable where the head dominates it (Whisper: 51,865 × 384); None
            (default): the whole vocabulary.
        online_block: with ``online=True``: a power of two ``b`` (e.g. 32, 64, 128) for block-diagonal online
            Hadamards, ``x·D·(I ⊗ H_b)/sqrt(b)`` (one ``b × b`` matmul per block, ``n·b`` multiply-adds per token
            instead of the full transform's ``n·(2^m + K)``, one exported ``MatMul``), on every op whose width
            ``n`` is a multiple of ``b`` larger than ``b``; ops of other widths keep the full Hadamard. Still
            orthogonal, so still exact; each block of ``b`` inputs is evened out within itself only, which is what
            a block-wise 4-bit weight quantizer with groups of ``b`` (or a divisor of ``b``) aligned with the blocks
            needs, less than what a per-tensor activation scale needs. The result and the manifest record the
            widths it applied to (``online_block_widths``). None (default): the full Hadamard everywhere.
        progress: with ``q="learned"``: called with a :class:`normswap.rotation.learn.Progress` once the starts
            are scored and at every tenth of the run; its ``best`` holds each stream's best matrix so far
            (``{first norm: Q₀ R}``, float64), so a long run can report and save them as it goes (a matrix saved
            so is a user ``q`` for this function: ``rotate(model, q, output=...)`` turns the model by it).

    Returns:
        A :class:`Rotation` listing the streams rotated (with the matrix of each) and, for the others, why not.

    Raises:
        NormswapError: the model was not converted by normswap, or was converted without ``fold_gamma``
            and so has streams whose norms keep γ (nothing is rotated then).

    Writers' output features become ``x Q`` (Linear/Conv1D/conv/Embedding weights and biases, raw
    position/cls parameters); readers' input features become ``Qᵀ`` (``W ← W Q``). Outputs are
    unchanged up to float rounding; raw residual-stream outputs (``hidden_states``) come out
    rotated. A stream made zero-mean by a centering op needs ``Q·1 = ±1`` (always true of the
    matrices built here; a user matrix without it leaves such streams alone). The rotation is recorded in
    the model's plan (``plan.rotations``), which becomes the checkpoint manifest.
    """
    plan = _converted_plan(model)
    if any(r.get("kind") == NONE for r in plan.rotations):
        raise NormswapError("the model already has online Hadamards at its Linear inputs (rotate(..., 'none', "
                            "online=True)); a stream turned now would meet them in the wrong order: rotate the "
                            "converted model before adding them, or convert the original again")
    choice = MatrixChoice.of(q, seed)
    check_online_block(online_block, online)
    batches = None
    settings = None
    if choice.kind == LEARNED:
        from normswap.rotation import learn

        settings = learn.LearnSettings(bits=bits, act_bits=act_bits, group_size=group_size, steps=steps, lr=lr,
                                       grid=grid, scales=scales, heads=heads, logit_top_k=logit_top_k)
        if scales and smooth is not None:
            raise NormswapError("scales (learned) and smooth both set each norm's scale: pass one of them")
    elif (bits, act_bits, group_size, steps, lr, grid, scales, heads, logit_top_k, progress) \
            != (4, None, None, 100, 1e-3, "symmetric", False, False, None, None):
        raise NormswapError("bits, act_bits, group_size, steps, lr, grid, scales, heads, logit_top_k and progress "
                            "apply to a learned rotation: pass q='learned' (--rotate learned) too")
    if choice.kind == NONE:
        if not online:
            raise NormswapError("q='none' turns no stream: it only adds online Hadamards, so pass online=True too")
        if output is not None:
            raise NormswapError("q='none' turns no stream, so output= (which says what a turned stream's model "
                                "output becomes) does not apply: leave it out")
        if smooth is None:
            result = _online_only(model, plan, seed, online_block)
        else:
            result = _online_only_smoothed(model, plan, seed, online_block, smooth, calibration)
        carry.record(model)  # so that a module swap can be undone (carry_online_ops) or is refused
        return result
    if smooth is not None or settings is not None:  # checked and resolved before anything turns
        from normswap.rotation import smooth as smoothing

        if smooth is not None:
            smoothing.check_alpha(smooth)
        batches = smoothing.calibration_batches(model, calibration)
    if output is not None:
        choose("output", output, ("rotated", "restore"))
    result = Rotation()
    if settings is not None:
        choice.learned, result.learned = _learn_matrices(model, seed, online, output, settings, batches, progress,
                                                         online_block)
    todo = _choose_streams(model, plan, choice, output, result)
    axes = _axes(plan)  # the output-feature axis of every writer tensor
    turns = _stream_turns(model, axes, todo, output, result)
    if online_block is not None:  # refused before anything turns where no online op would take the block
        widths = {_linear_width(model, p) for t in turns
                  for p in _online_targets(model, sorted(t.writers.values()), t.q.shape[0])[0]}
        _refuse_unused_block(online_block, widths)
    _fold_kept_layer_scales(model, plan, {w for turn in turns for w in turn.writers.values()})
    for turn in turns:
        result.rotated.append(_turn_stream(model, axes, turn, output, online, result, online_block))
    if online and result.rotated and not any(r.get("value_heads") for r in plan.rotations):
        # per-head Hadamards on values and outputs: offline folds, no op (once: a second H̃ would undo nothing)
        heads, hd, why = _rotate_heads_(model)
        result.rotated[0].update(value_heads=heads, head_dim=hd)
        if why:
            result.online_skipped.append(f"per-head Hadamard on values: {why}")
    if result.learned is not None:
        for r in result.rotated:
            r["learned"] = result.learned.record()
        if result.learned.scales:
            _apply_learned_scales(model, plan, result)
        if result.learned.heads and result.rotated:  # R2 after the per-head Hadamard it was learned on top of
            _turn_heads_(value_heads(model)[0], result.learned.heads)
            result.rotated[0].update(learned_heads=sorted(result.learned.heads))
    if smooth is not None and result.rotated:
        _smooth_streams(model, plan, result, smooth, batches)
    carry.turn_rotated(model, plan, result.rotated)  # a PEFT adapter on a turned Linear: mapped by Q, or refused
    plan.rotations = plan.rotations + [manifest_entry(r) for r in result.rotated]
    carry.record(model)  # so that a module swap can be undone (carry_online_ops) or is refused
    return result


def _refuse_unused_block(block: int, widths: set[int], what: str = "online Hadamard's") -> None:
    """Refuse a block no online op can use (every op's width is not a multiple of it, or not larger): a usage
    error (the CLI's exit code 2)."""
    if not any(block_of(w, block) for w in widths):
        have = ", ".join(str(w) for w in sorted(widths)) or "none"
        raise UsageError(f"online_block={block}: no {what} width is a multiple of {block} larger than it (the "
                         f"widths: {have}); pass a smaller power of two, or leave it out")


def refuse_unusable_block(model: nn.Module, block: int) -> None:
    """Before a conversion that will add online Hadamards with ``online_block=block``: refuse the block where no
    Linear input of ``model`` could take it (the ops sit at Linear inputs, so their widths are among these),
    before anything is converted. :func:`rotate` checks the ops' own widths again."""
    widths = {int(m.weight.shape[_reader_axis(m)]) for m in model.modules()
              if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"}
    _refuse_unused_block(block, widths, "Linear input's")


def _online_only(model: nn.Module, plan: Plan, seed: int, online_block: int | None = None) -> Rotation:
    """``rotate(model, "none", online=True)``: no stream turned; an online Hadamard before every Linear reader
    of the converted norms and every MLP down projection (:func:`_add_online_hadamard`, the op and weight
    ``online=True`` puts on down projections), and per-head Hadamards on the values (:func:`_rotate_heads_`).
    Each op turns its Linear's own input, so it is exact whoever else reads that input; a reader reached
    through a functional linear (no module to hold the op), one whose weight another module shares (a head
    tied to the embedding), or one with no Hadamard order for its width is left alone and listed in
    ``online_skipped``.

    Where a norm's output is read by two or more Linears and by nothing else, each of them reading that
    output alone (``SitePlan.readers_alone``, from the dataflow), and every one of them can take the op, the
    op sits once after the norm instead (:func:`_add_output_hadamard`, one seed for all its readers): the
    same function with one transform where q, k and v would each transform the same tensor."""
    result = Rotation()
    sharing: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            sharing[id(p)] = sharing.get(id(p), 0) + 1
    paths, widths, norms = [], [], []
    shared: list[dict] = []  # {"norm", "readers", "width"}: one op after the norm
    modules = dict(model.named_modules())
    for group in streams(plan, model):
        norms += [sp.name for sp in group]
        widths.append(group[0].normalized_shape[0])
        own: dict[str, list[str]] = {}  # norm -> its readers that can take an op
        for sp in group:
            for rd in sorted(set(sp.linear_readers)):
                module = modules.get(rd)
                if not (isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"):
                    result.online_skipped.append(f"`{rd}`: a functional linear (no module to hold the op)")
                elif sharing.get(id(module.weight), 0) > 1:
                    result.online_skipped.append(f"`{rd}`: its weight is shared with another module (tied)")
                elif getattr(module, "_normswap_online", None) is None:
                    n = module.weight.shape[_reader_axis(module)]
                    if hadamard.has_hadamard(n):
                        own.setdefault(sp.name, []).append(rd)
                    else:
                        result.online_skipped.append(f"`{rd}`: no Hadamard matrix of order {n}")
        for sp in group:
            readers = own.get(sp.name, [])
            if _one_op_fits(sp, readers, modules.get(sp.name)):
                shared.append({"norm": sp.name, "readers": readers, "width": int(sp.normalized_shape[0])})
            else:
                paths += [rd for rd in readers if rd not in paths]
        # the writers the conversion centered (writer_targets), and those of a norm a centering op made exact
        # (per_norm_centering: its writers keep their weights, so none is a target; the FFN output projection of
        # a Post-LN block is one of them)
        writers = {t for sp in group for t in sp.writer_targets} | {
            f"{w}.weight" for sp in group if sp.verdict == "exact-with-per-norm-centering" for w in sp.writers}
        down, why = _online_targets(model, sorted(writers), widths[-1])
        paths += [p for p in down if p not in paths]
        result.online_skipped += why
    paths = sorted(paths)
    widths_used = {_linear_width(model, p) for p in paths} | {op["width"] for op in shared}
    if online_block is not None:  # refused before any op is added
        _refuse_unused_block(online_block, widths_used)
    for i, path in enumerate(paths):
        _add_online_hadamard(model, path, seed=seed + 7919 * (i + 1), block=online_block)
    for j, op in enumerate(shared):
        _add_output_hadamard(model, op, seed=seed + 7919 * (len(paths) + j + 1), block=online_block)
    heads, hd, why = _rotate_heads_(model) if paths or shared else ([], None, "")
    if why:
        result.online_skipped.append(f"per-head Hadamard on values: {why}")
    if paths or shared:
        entry = {"width": max(widths), "norms": norms, "writers": [], "readers": [], "kind": NONE, "seed": seed,
                 "construction": "", "fallback": "", "mean_preserving": True, "output": "", "outputs": [],
                 "restore": [], "ops": [], "online": paths, "online_signs": True, "online_outputs": shared,
                 **_block_record(online_block, sorted(w for w in widths_used if block_of(w, online_block))),
                 "value_heads": heads, "head_dim": hd, "q": torch.eye(max(widths), dtype=torch.float64)}
        result.rotated.append(entry)
        plan.rotations = plan.rotations + [manifest_entry(entry)]
    return result


def _online_only_smoothed(model: nn.Module, plan: Plan, seed: int, online_block: int | None, alpha: float,
                          calibration: Any) -> Rotation:
    """``rotate(model, "none", online=True, smooth=alpha)``: SmoothQuant's scale migration between each converted
    norm (γ and β kept) and its Linear readers, then the online Hadamards (:func:`_online_only`).

    The scale goes in before the ops, in the norm's own basis: the norm's γ and β ``/ s``, its readers' input
    columns ``× s`` (exact for any ``s > 0``; :mod:`normswap.rotation.smooth`), and the op after the norm then
    spreads the smoothed output, so each reader's weight is ``W·diag(s)·D·H``: the columns of the channels
    that carry the most activation (DINOv2's massive channels) are rounded finer, relative to their size,
    where the Hadamard alone rounds every column on one step. Norms whose output is a model output, or whose
    readers' weights are shared (a tied head), are left alone (``result.smoothing.skipped``). If adding the
    ops fails, the smoothed tensors are put back, so the model is untouched."""
    from normswap.rotation import smooth as smoothing

    smoothing.check_alpha(alpha)
    batches = smoothing.calibration_batches(model, calibration)
    pseudo = [{"norms": [sp.name for sp in group], "writers": [], "restore": []} for group in streams(plan, model)]
    found, skipped = smoothing.targets(model, plan, pseudo)
    sharing: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            sharing[id(p)] = sharing.get(id(p), 0) + 1
    for name, readers in list(found.items()):
        if any(sharing.get(id(smoothing.reader_weight(model, rd)), 0) > 1 for rd in readers):
            del found[name]
            skipped[name] = "a reader's weight is shared with another module (tied)"
    touched = {id(t): t for name, readers in found.items()
               for t in [*smoothing.norm_tensors(model, name), *(smoothing.reader_weight(model, rd) for rd in readers)]}
    saved = {k: t.detach().clone() for k, t in touched.items()}
    try:
        done = smoothing.smooth_found_(model, found, skipped, batches, alpha)
        result = _online_only(model, plan, seed, online_block)
    except BaseException:
        with torch.no_grad():
            for k, t in touched.items():
                t.copy_(saved[k])
        raise
    result.smoothing = done
    if result.rotated:  # recorded in the manifest entry _online_only wrote, too
        result.rotated[0].update(smooth=done.alpha, smoothed=sorted(done.scales))
        plan.rotations = plan.rotations[:-1] + [manifest_entry(result.rotated[0])]
    return result


def _one_op_fits(sp: SitePlan, readers: list[str], norm: nn.Module | None) -> bool:
    """Can one op after norm ``sp`` stand for an op before each of ``readers`` (those of its Linear readers
    that can take one)? Where the norm's output reaches Linear readers alone, each reading only it on every
    call (``sp.readers_alone``), all of them take the op, there are two or more (for one, the op before it is
    the same op), the norm returns its output alone (a hook turns that tensor) and holds no online op yet."""
    return (sp.readers_alone and len(readers) >= 2 and sorted(readers) == sorted(set(sp.linear_readers))
            and not sp.returns and norm is not None and getattr(norm, "_normswap_online", None) is None
            and hadamard.has_hadamard(int(sp.normalized_shape[0])))


def _learn_matrices(model: nn.Module, seed: int, online: bool, output: str | None, settings: Any,
                    batches: list, progress: Callable[[Any], None] | None = None, online_block: int | None = None
                    ) -> tuple[dict[str, torch.Tensor], Any]:
    """``({first norm: Q₀ R}, what the learning did)`` for the streams ``rotate(model, "hadamard", seed=seed,
    online=online, output=output)`` would turn: that rotation is applied to a copy of the model (ops, online
    Hadamards and all), and :func:`normswap.rotation.learn.optimise` learns each stream's ``R`` on top of it,
    from the names of the tensors the turn multiplied. The model itself is not touched here."""
    import copy

    from normswap.rotation import learn

    work = copy.deepcopy(model)
    start = rotate(work, "hadamard", seed=seed, online=online, output=output, online_block=online_block)
    axes = _axes(_converted_plan(work))
    names: dict[int, str] = {}
    for name, p in work.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    specs = []
    for r in start.rotated:
        spec = learn.StreamTensors(r["norms"][0], int(r["width"]), undo=r["q"].T.contiguous())
        writer_ids = {id(work.get_parameter(w)) for w in r["writers"]}
        spec.turned += [(w, axes[w], None) for w in r["writers"]]
        for name in r["norms"]:
            bias = getattr(work.get_submodule(name), "bias", None)
            if name not in r["restore"] and isinstance(bias, torch.Tensor):
                spec.turned.append((f"{name}.bias" if name else "bias", 0, None))
        for rd in r["readers"]:
            module = linear_at(work, rd)
            weight = module.weight_param if isinstance(module, LinearView) else module.weight
            if id(weight) in writer_ids:
                continue  # a reader tied to a writer of this stream: turned once, as the writer
            rows = module.spec.rows if isinstance(module, LinearView) else None
            spec.turned.append((names[id(weight)], _reader_axis(module),
                                (rows[0], rows[1], module.out_axis) if rows else None))
        spec.restore = [f"{n}.{RESTORE_BUFFER}" if n else RESTORE_BUFFER for n in r["restore"]]
        spec.ops = [f"{op['module']}.{ROTATION_BUFFER}" if op["module"] else ROTATION_BUFFER for op in r["ops"]]
        specs.append(spec)
    if not specs:
        return {}, None
    if settings.scales:  # the norms that can take a scale, and what a scale multiplies (smooth's own rule)
        from normswap.rotation import smooth as smoothing

        found, _ = smoothing.targets(work, _converted_plan(work), start.rotated)
        for spec, r in zip(specs, start.rotated, strict=True):
            for norm in (n for n in r["norms"] if n in found):
                module = work.get_submodule(norm)
                own = [f"{norm}.{p}" for p in ("weight", "bias") if isinstance(getattr(module, p, None), torch.Tensor)]
                readers = []
                for rd in found[norm]:
                    reader = linear_at(work, rd)
                    weight = reader.weight_param if isinstance(reader, LinearView) else reader.weight
                    rows = reader.spec.rows if isinstance(reader, LinearView) else None
                    readers.append((names[id(weight)], _reader_axis(reader),
                                    (rows[0], rows[1], reader.out_axis) if rows else None))
                spec.scaled.append((norm, own, readers))
    heads = []
    if settings.heads:  # R2: the layouts the per-head Hadamard turns, with the same parameters
        pairs, hd = value_heads(work)
        for path, v, o in pairs:
            turned = [(names[id(p)], axis) for p, axis in ((v.weight, 0), (v.bias, 0), (o.weight, 1)) if p is not None]
            heads.append(learn.HeadTensors(path, hd, turned))
    starts = {r["norms"][0]: r["q"] for r in start.rotated}

    def report(p: Any) -> None:  # the user sees each stream's whole matrix, Q₀ R
        progress(replace(p, best={k: starts[k] @ r for k, r in p.best.items()}))

    rs, done = learn.optimise(work, specs, batches, settings, heads, report if progress is not None else None)
    return {r["norms"][0]: r["q"] @ rs[r["norms"][0]] for r in start.rotated}, done


def _apply_learned_scales(model: nn.Module, plan: Plan, result: Rotation) -> None:
    """The learned per-norm scales (``rotate(..., scales=True)``) written as ``smooth`` writes its own: the
    norm's weight ``÷ s``, its readers' input columns ``× s``; each stream's entry lists the norms in
    ``smoothed``."""
    from normswap.rotation import smooth as smoothing

    found, _ = smoothing.targets(model, plan, result.rotated)
    for r in result.rotated:
        done = [n for n in r["norms"] if n in found and n in result.learned.scales]
        for name in done:
            smoothing.apply_(model, name, found[name], result.learned.scales[name])
        r.update(smooth="learned", smoothed=done)


def _smooth_streams(model: nn.Module, plan: Plan, result: Rotation, alpha: float, batches: list) -> None:
    """Scale migration on the streams just turned (:func:`normswap.rotation.smooth.smooth_`); each stream's
    entry records ``smooth`` (α) and ``smoothed`` (its norms that took a scale), and ``result.smoothing`` the
    details."""
    from normswap.rotation import smooth as smoothing

    done = smoothing.smooth_(model, plan, result.rotated, batches, alpha)
    for r in result.rotated:
        r.update(smooth=done.alpha, smoothed=[n for n in r["norms"] if n in done.scales])
    result.smoothing = done


def _fold_kept_layer_scales(model: nn.Module, plan: Plan, turned: set[str]) -> None:
    """Fold each LayerScale λ the conversion kept (``layer_scale="keep"``) into its writer, where that writer
    turns: ``λ ⊙ (Qᵀ W x)`` is not ``Qᵀ (λ ⊙ W x)``, so the rows take λ first (``W ← diag(λ) W``, λ ← 1)
    and then turn. The plan records the fold (``keep=False``), as a conversion with ``layer_scale="fold"``."""
    folds = []
    for sf in plan.scale_folds:
        if sf.keep and param_names(model, sf.into)[0] in turned:
            fold_layer_scale(model, sf)
            sf = replace(sf, keep=False)
        folds.append(sf)
    plan.scale_folds = folds


def _converted_plan(model: nn.Module) -> Plan:
    plan = plan_of(model)
    if plan is None:
        raise NormswapError("model was not converted by normswap; run normswap.patch(model, fold_gamma=True) first")
    return plan


@dataclass
class MatrixChoice:
    """What ``rotate``'s ``q`` and ``seed`` ask for: one user matrix for every stream (``matrix``), or a
    ``kind`` of matrix built per stream from ``seed + i``."""

    matrix: torch.Tensor | None
    kind: str
    seed: int
    learned: dict[str, torch.Tensor] = field(default_factory=dict)  # "learned": {first norm: Q₀ R} per stream

    @classmethod
    def of(cls, q: str | int | torch.Tensor, seed: int) -> MatrixChoice:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise NormswapError(f"seed must be an int, not {type(seed).__name__}")
        if isinstance(q, torch.Tensor):
            return cls(_user_matrix(q), "user", seed)
        if isinstance(q, int) and not isinstance(q, bool):
            return cls(None, "random", q)
        if isinstance(q, str):
            return cls(None, choose("rotation", q, (*KINDS, LEARNED, NONE)), seed)
        raise NormswapError(f"q must be 'hadamard', 'random', an int seed or an orthogonal matrix, "
                            f"not {type(q).__name__}")

    @property
    def keeps_mean(self) -> bool:
        return self.matrix is not None and is_mean_preserving(self.matrix)

    def for_stream(self, i: int, width: int, first_norm: str = "") -> tuple[torch.Tensor, dict]:
        """The matrix of the ``i``-th stream and its description (the manifest's fields)."""
        if self.kind == LEARNED:
            start, info = rotation_matrix(width, "hadamard", self.seed + i)
            q = self.learned.get(first_norm, start)  # a stream the learning did not see keeps its start
            construction = (info["construction"] or "random orthogonal") + " × learned R"
            return q, {**info, "kind": LEARNED, "construction": construction}
        if self.matrix is None:
            return rotation_matrix(width, self.kind, self.seed + i)
        return self.matrix, {"kind": "user", "seed": None, "construction": "", "fallback": "",
                             "mean_preserving": self.keeps_mean}

    def refusal(self, group: list[SitePlan], width: int) -> str:
        """Why this matrix cannot turn the stream of ``group`` ("" when it can)."""
        if self.matrix is None:
            return ""
        if self.matrix.shape[0] != width:
            return f"q is {self.matrix.shape[0]}×{self.matrix.shape[0]} but this stream has width {width}"
        centered = next((sp for sp in group if sp.verdict in CENTERED_VERDICTS), None)
        if centered is not None and not self.keeps_mean:
            return (f"`{centered.name}` reads a stream centered at run time, which only a mean-preserving q "
                    "commutes with (q·1 = ±1; the 'hadamard' and 'random' matrices are)")
        return ""


def _choose_streams(model: nn.Module, plan: Plan, choice: MatrixChoice, output: str | None,
                    result: Rotation) -> list[tuple[list[SitePlan], torch.Tensor, dict]]:
    """(norms, Q, description) of every stream to turn; the others go to ``result.skipped`` with why.
    Refuses a model converted without ``fold_gamma`` (its norms keep γ) rather than rotating nothing."""
    todo = []
    for i, group in enumerate(streams(plan, model)):
        width = group[0].normalized_shape[0]
        why = _blocker(model, plan, group, output) or choice.refusal(group, width)
        if why:
            kept = plan.options.get("gamma_kept") or {}
            result.skipped.append({"norms": [sp.name for sp in group], "reason": why,
                                   "gamma_kept": [sp.name for sp in group if sp.name in kept]})
        else:
            todo.append((group, *choice.for_stream(i, width, group[0].name)))
    gamma_kept = [s for s in result.skipped if "fold_gamma" in s["reason"]]
    if gamma_kept and not plan.options.get("fold_gamma"):  # a model that cannot take it: say so, not "0 rotated"
        others = len(gamma_kept) - 1
        which = f"`{gamma_kept[0]['norms'][0]}`" + (f" and the norms of {others} other stream(s)" if others else "")
        raise NormswapError(
            f"cannot rotate: the model was converted without fold_gamma, so its norms keep γ "
            f"({which}) and a rotation needs RMSNorms "
            "of unit weight; convert the original model with normswap.patch(model, fold_gamma=True) (CLI: normswap "
            "convert --fold-gamma, or --rotate), then rotate it")
    return todo


@dataclass
class StreamTurn:
    """One stream's rotation: its norms, ``q`` and description, and the tensors it turns."""

    group: list[SitePlan]
    q: torch.Tensor
    info: dict
    writers: dict[int, str]  # id(parameter) -> its name: a parameter tied to several names turns once
    readers: list[str]
    tied: set[str]  # readers whose weight is a writer of the same stream (turned once, as a writer)
    restored: set[str]  # norms whose output is turned back before them (output="restore")
    ops: list[dict]  # rotation ops at the stream's centering op


def _stream_turns(model: nn.Module, axes: dict[str, int], todo: list[tuple[list[SitePlan], torch.Tensor, dict]],
                  output: str | None, result: Rotation) -> list[StreamTurn]:
    """The tensors each stream turns. Every parameter is rotated at most once; a reader whose weight is
    also a writer of the same stream (a head tied to the embedding: rows x → x Q as a writer, W → W Q as a
    reader) is that one rotation. Streams that share a writer or reader are refused; one whose rotation op
    would share a module with another stream's is left unrotated (:func:`_one_slot_per_module`)."""
    turns = []
    for group, rot, info in todo:
        upstream = {t for sp in group for t in sp.rotation_upstream}  # turned by the stream's op
        by_id = {id(model.get_parameter(t)): t for sp in group for t in sorted(sp.writer_targets)
                 if t not in upstream}
        restored = _restored(group, output)
        readers = sorted({r for sp in group if sp.name not in restored for r in sp.linear_readers})
        tied = {r for r in readers if id(linear_at(model, r).weight) in by_id
                and axes[by_id[id(linear_at(model, r).weight)]] == _reader_axis(linear_at(model, r))}
        turns.append(StreamTurn(group, rot, info, by_id, readers, tied, restored, _stream_ops(group)))
    turns = _one_slot_per_module(model, turns, result)
    writer_params = [p for t in turns for p in t.writers]
    reader_params = [_reader_rows(model, r) for t in turns for r in t.readers if r not in t.tied]
    if len(set(writer_params)) != len(writer_params) or len(set(reader_params)) != len(reader_params) \
            or set(writer_params) & set(reader_params):
        raise NormswapError("streams share a writer or a reader; this model cannot be rotated stream by stream")
    return turns


def _stream_ops(group: list[SitePlan]) -> list[dict]:
    """The rotation ops of a stream (each centering op's turn once)."""
    return list({(o["module"], o["where"], o["arg"]): o for sp in group for o in sp.rotation_ops}.values())


def unturned_norms(model: nn.Module, plan: Plan, output: str | None = None) -> dict[str, str]:
    """``{norm: why its stream will not turn}`` for the norms whose γ ``plan`` folds but whose stream
    ``rotate(model, q, output=output)`` would leave alone once ``plan`` is applied: asked before the surgery, of
    a plan made with ``fold_gamma`` and its verdicts decided, on the unedited ``model``.

    Why: a rotation needs γ folded only where it turns the stream. Folded into the readers of a stream that
    stays unrotated (Whisper's encoder, whose last norm output is a model output), γ only widens the readers'
    input columns, and a quantizer whose blocks run along them pays for it (ONNX Runtime's 4-bit
    ``MatMulNBits``: 1.55× the original's error from the encoder's folds alone). ``normswap.patch(model,
    rotate=...)`` plans those norms again as without ``fold_gamma`` (:func:`normswap.analysis.planner.analyse`'s
    ``keep_gamma``). The same checks as :func:`rotate`'s, which any matrix it builds passes."""
    skipped = Rotation()
    turns = []
    for group in streams(plan, model):
        why = _blocker(model, plan, group, output, planned=True)
        if why:
            skipped.skipped.append({"norms": [sp.name for sp in group], "reason": why})
        else:
            turns.append(StreamTurn(group, torch.empty(0), {}, {}, [], set(), set(), _stream_ops(group)))
    _one_slot_per_module(model, turns, skipped)
    folds = {sp.name for sp in plan.sites if sp.convert and sp.fold_gamma} | {f.norm for f in plan.rms_folds}
    return {name: s["reason"] for s in skipped.skipped for name in s["norms"] if name in folds}


def _turn_stream(model: nn.Module, axes: dict[str, int], turn: StreamTurn, output: str | None, online: bool,
                 result: Rotation, online_block: int | None = None) -> dict:
    """Rotate one stream's writers, kept biases and readers, install its ops; returns its entry."""
    rot = turn.q
    writers = sorted(turn.writers.values())  # a tied parameter is rotated once
    for t in writers:
        p = model.get_parameter(t)
        _rotate_axis_(p, axes[t], rot.to(p.device))
    for sp in turn.group:  # a kept bias is part of the norm's output: it turns with the stream
        bias = getattr(model.get_submodule(sp.name), "bias", None)
        if sp.name not in turn.restored and isinstance(bias, torch.Tensor):
            _rotate_axis_(bias, 0, rot.to(bias.device))
    for r in turn.readers:
        if r not in turn.tied:
            module = linear_at(model, r)
            _rotate_axis_(module.weight, _reader_axis(module), rot.to(module.weight.device))
    for name in sorted(turn.restored):
        module = model.get_submodule(name)
        ref = next(iter(module.parameters()), None)
        _install_unrotate(module, rot.T.contiguous().to(device=ref.device if ref is not None else None,
                                                        dtype=ref.dtype if ref is not None else None),
                          compose=True)
    for op in turn.ops:
        module = model.get_submodule(op["module"])
        _install_rotation_op(module, op, rot.to(**_like(module, model)).contiguous(), compose=True)
    online_paths: list[str] = []
    if online:
        online_paths, skipped_online = _online_targets(model, writers, rot.shape[0])
        result.online_skipped += skipped_online
        for i, path in enumerate(online_paths):
            _add_online_hadamard(model, path, seed=(turn.info.get("seed") or 0) + 7919 * (i + 1), block=online_block)
    outputs = sorted({o for sp in turn.group for o in sp.rotation_outputs})
    blocked = sorted({w for w in (_linear_width(model, p) for p in online_paths) if block_of(w, online_block)})
    return {"width": rot.shape[0], "norms": [sp.name for sp in turn.group], "writers": writers,
            "readers": turn.readers, **turn.info, "output": (output or "") if outputs else "", "outputs": outputs,
            "restore": sorted(turn.restored), "ops": turn.ops, "online": online_paths,
            "online_signs": bool(online_paths), **_block_record(online_block, blocked), "q": rot}


def block_of(width: int, block: int | None) -> int | None:
    """The block size an online op of ``width`` features takes under ``online_block=block``: ``block`` where it
    divides ``width`` and is smaller (a block as wide as the op is the full transform), else None (the full
    Hadamard ``D·H/sqrt(n)``)."""
    return block if block and width % block == 0 and width > block else None


def _block_record(block: int | None, widths: list[int]) -> dict:
    """The manifest fields of a block-diagonal layout: ``online_block`` and the op widths it applied to (the
    ops of other widths are full), so a loader rebuilds each op's factor with the right order. Nothing
    without a block (older checkpoints have neither field and load as full ops)."""
    return {"online_block": block, "online_block_widths": widths} if block and widths else {}


def _linear_width(model: nn.Module, path: str) -> int:
    module = model.get_submodule(path)
    return int(module.weight.shape[_reader_axis(module)])


def _online_factors(n: int, seed: int, block: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(D·M, stored factor, signs)`` of one online op over ``n`` features: ``M = H/sqrt(n)`` with the
    stored factor ``H_K`` (full), or, with ``block`` (:func:`block_of`), ``M = (I ⊗ H_b)/sqrt(b)`` with the
    stored factor ``H_b``; ``D`` the random signs from ``seed``. The weight takes ``W·D·M``."""
    signs = hadamard.random_signs(n, seed)
    b = block_of(n, block)
    if b is None:
        return signs.unsqueeze(1) * hadamard.hadamard(n) / n**0.5, hadamard.small_factor(n), signs
    return signs.unsqueeze(1) * hadamard.block_hadamard(n, b), hadamard.sylvester(b), signs


def _add_online_hadamard(model: nn.Module, path: str, seed: int, block: int | None = None) -> None:
    """QuaRot's online Hadamard before the down projection at ``path``, with random signs ``D`` (from ``seed``;
    :class:`OnlineHadamard` says why): ``W ← W D H̃`` and the op ``x D H̃`` (``H̃`` block-diagonal with blocks of
    ``block`` where :func:`block_of` says so)."""
    module = model.get_submodule(path)
    n = module.weight.shape[_reader_axis(module)]
    turn, factor, signs = _online_factors(n, seed, block)  # D H̃
    _rotate_axis_(module.weight, _reader_axis(module), turn.to(module.weight.device))  # W ← W D H̃
    like = _like(module, model)
    _install_online(module, factor.to(**like), signs.to(**like))


def _add_output_hadamard(model: nn.Module, op: dict, seed: int, block: int | None = None) -> None:
    """One online Hadamard after the norm ``op["norm"]`` for all its readers ``op["readers"]``: the op
    ``y D H̃`` on the norm's output and ``W ← W D H̃`` in each reader (random signs ``D`` from ``seed``; ``H̃``
    block-diagonal as in :func:`_add_online_hadamard`)."""
    n = op["width"]
    turn, factor, signs = _online_factors(n, seed, block)  # D H̃
    for path in op["readers"]:
        module = model.get_submodule(path)
        _rotate_axis_(module.weight, _reader_axis(module), turn.to(module.weight.device))
    norm = model.get_submodule(op["norm"])
    like = _like(norm, model)
    _install_online(norm, factor.to(**like), signs.to(**like), width=n)


def manifest_entry(stream: dict) -> dict:
    """What the checkpoint manifest records of one rotated stream: enough to rebuild ``Q`` (kind, seed,
    width; :func:`rotation_matrix`) or, for a user matrix, to recognise it (its SHA-256), and to undo it."""
    entry = {k: v for k, v in stream.items() if k not in ("q", "writers", "readers")}
    if stream["kind"] in ("user", LEARNED):  # not rebuildable from (kind, seed): recognisable by its hash
        import hashlib

        entry["sha256"] = hashlib.sha256(stream["q"].contiguous().numpy().tobytes()).hexdigest()
    return entry
