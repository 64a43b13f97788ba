"""Find every LayerNorm-like module and work out exactly what it computes.

Class names are not trusted: HF models ship LayerNorms as ``nn.LayerNorm`` subclasses, as custom
classes (OLMo's parameter-free ``OlmoLayerNorm``, Cohere's γ-only ``CohereLayerNorm``, Nemotron's
``1+γ`` ``NemotronLayerNorm1P``), or as wrappers holding an inner non-affine ``nn.LayerNorm`` plus
their own parameters. So the walker collects *candidates* by structure and name, then identifies
each one's formula numerically from the input/output pair captured during the traced forward:
``γ ⊙ (x − μ)/sqrt(var + ε) + β`` in its flavours, or already-RMS (reported as skipped).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from normswap.analysis.trace import Graph, ModuleCall
from normswap.nn.call_args import reproducible
from normswap.nn.rmsnorm import RMSNorm

_LN_NAME = re.compile(r"norm|\bln\b", re.IGNORECASE)
# a module without submodules named like a LayerNorm is reported even when no formula matches (a wrapper
# such as wav2vec2's LayerNormConvLayer or StableLM's per-head norm list is not: its norms are inside)
_LN_CLASS = re.compile(r"layer_?norm", re.IGNORECASE)
_EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps", "layer_norm_epsilon")


@dataclass
class NormSite:
    """One LayerNorm instance, as the rest of normswap sees it."""

    path: str
    class_name: str
    normalized_shape: tuple[int, ...]  # trailing dims reduced over
    param_shape: tuple[int, ...]  # shape of γ/β (may have extra leading dims: per-head params)
    eps: float
    flavour: str  # standard | gamma-only | beta-only | non-affine | offset (1+γ)
    weight_attr: str | None = None  # attribute holding γ (on the module itself)
    bias_attr: str | None = None
    offset: float = 0.0  # effective γ = offset + weight
    # the module's forward takes more than its input (``norm(h, batch=batch)``): the replacement accepts
    # and ignores the rest, which the traced call showed do not change what it computes
    extra_args: bool = False
    # what the module returned when not its output alone (``(x, None)``, normswap.nn.call_args.Returns):
    # the replacement returns the same structure
    returns: dict = field(default_factory=dict)

    def gamma(self, module: nn.Module) -> torch.Tensor | None:
        """Effective γ in float64 (``None`` for non-affine)."""
        if self.weight_attr is None:
            return None
        return self.offset + getattr(module, self.weight_attr).detach().double()

    def beta(self, module: nn.Module) -> torch.Tensor | None:
        if self.bias_attr is None:
            return None
        return getattr(module, self.bias_attr).detach().double()

    def reference(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """What this norm computes, in float64 end to end (some HF norms compute in fp32 internally)."""
        dims = tuple(range(-len(self.normalized_shape), 0))
        x = x.double()
        mu = x.mean(dims, keepdim=True)
        y = (x - mu) / torch.sqrt((x - mu).pow(2).mean(dims, keepdim=True) + self.eps)
        gamma, beta = self.gamma(module), self.beta(module)
        if gamma is not None:
            y = y * gamma
        if beta is not None:
            y = y + beta
        return y


@dataclass
class SkippedNorm:
    path: str
    class_name: str
    reason: str
    weight_attr: str | None = None  # already-RMS norms: the γ parameter (``fold_gamma`` can fold it)
    offset: float = 0.0  # effective γ = offset + weight (Gemma's 1 + γ)
    bias_attr: str | None = None


@dataclass
class WalkResult:
    sites: list[NormSite] = field(default_factory=list)
    skipped: list[SkippedNorm] = field(default_factory=list)
    converted: list[str] = field(default_factory=list)  # normswap.RMSNorm modules already present


def candidates(model: nn.Module, calls_layer_norm: set[str] = frozenset()) -> list[str]:
    """Module paths that might be LayerNorms, outermost first.

    Structural (``nn.LayerNorm`` subclasses, wrappers around a non-affine one, modules whose forward
    computes a norm in its own ops: ``calls_layer_norm``, from :func:`computes_norm`) and by class name
    (``*Norm*``, which only adds candidates before a trace). The verdict on each is numerical
    (:func:`identify`): no name decides what a module is.
    """
    found = []
    for path, module in model.named_modules():
        if isinstance(module, RMSNorm):
            continue
        name = type(module).__name__
        direct_ln_child = any(
            isinstance(c, nn.LayerNorm) and c.weight is None for c in module.children()
        ) and len(list(module.children())) == 1 and len(module._parameters) > 0
        if isinstance(module, nn.LayerNorm) or _LN_NAME.search(name) or direct_ln_child \
                or path in calls_layer_norm:
            found.append(path)
    return found


# what a norm written in ops computes (its own ops, not its submodules'): a mean over features, and a root
# of a second moment (``(x - mu) / sqrt(var + eps)``, ``x * rsqrt(...)``) or the fused ``layer_norm`` itself
_FUSED_NORMS = frozenset({"layer_norm", "rms_norm"})
_MEANS = frozenset({"mean", "var_mean", "std_mean"})
_ROOTS = frozenset({"rsqrt", "sqrt", "std", "std_mean", "var", "var_mean"})


def computes_norm(graph: Graph) -> set[str]:
    """Paths of the module calls whose own ops compute a norm over features, whatever the class is
    called: the fused ``layer_norm`` / ``rms_norm``, or a mean and a root (a hand-written ``MyLN``,
    ``ManualLayerNorm``, Llama's RMSNorm). Only calls whose first output has their input's shape: a
    mean-pool followed by an L2 normalisation is not one."""
    names: dict[int, set[str]] = {}
    for op in graph.ops:
        if op.call is not None:
            names.setdefault(op.call, set()).add(op.name)
    found = set()
    for call_id, ops in names.items():
        if not (ops & _FUSED_NORMS or (ops & _MEANS and ops & _ROOTS)):
            continue
        call = graph.calls[call_id]
        vid = call.first_input()
        if call.functional or vid is None or not call.outputs \
                or graph.values[vid].shape != graph.values[call.outputs[0]].shape:
            continue
        found.add(call.path)
    return found


def _affine_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's own tensors that may be its γ or β: its parameters, then its floating-point buffers
    (``F.layer_norm(x, s, self.gamma, self.beta_buffer)`` is a LayerNorm with that buffer as β)."""
    direct = [(n, p) for n, p in module._parameters.items() if p is not None]
    direct += [(n, b) for n, b in module._buffers.items()
               if b is not None and b.is_floating_point() and 0 < b.dim() and b.numel() > 1]
    return direct


def _eps_of(module: nn.Module) -> list[float]:
    for attr in _EPS_ATTRS:
        val = getattr(module, attr, None)
        if isinstance(val, (int, float)) and not isinstance(val, bool):
            return [float(val)]
    for child in module.children():
        if isinstance(child, nn.LayerNorm):
            return [float(child.eps)]
    return [1e-5, 1e-6, 1e-12, 1e-8]


def _reduce_options(module: nn.Module, x: torch.Tensor, params: list[torch.Tensor]) -> list[tuple[int, ...]]:
    shapes = []
    ns = getattr(module, "normalized_shape", None)
    if ns is not None:
        shapes.append(tuple(ns) if not isinstance(ns, int) else (ns,))
    for p in params:
        for k in range(1, p.dim() + 1):
            shapes.append(tuple(p.shape[p.dim() - k:]))
    shapes.append((x.shape[-1],))
    seen, out = set(), []
    for s in shapes:
        if s not in seen and tuple(x.shape[x.dim() - len(s):]) == s:
            seen.add(s)
            out.append(s)
    return out


def agrees(candidate: torch.Tensor, y: torch.Tensor, tol: float) -> bool:
    """Does a formula's output ``candidate`` match the module's output ``y`` within ``tol`` of the larger of
    their magnitudes?

    Relative, never absolute: on inputs far below √ε a LayerNorm computes about ``(x − μ)/√ε``, and a
    tolerance of ``tol`` in absolute terms (what a floor of 1 on the scale gave) let any module named like a
    norm match a formula there. A tiny random D-FINE's backbone runs at 3e-8: its frozen BatchNorm2d
    (``DFineFrozenBatchNorm2d``, per-channel ``x·s + b``, output 3e-8) matched a non-affine LayerNorm over the
    image's width (output 1e-5) and was converted."""
    if candidate.shape != y.shape:
        return False
    if not y.numel():
        return True
    scale = max(float(y.abs().max()), float(candidate.abs().max()))
    return bool(((candidate - y).abs() <= tol * scale).all())


def identify(path: str, module: nn.Module, x: torch.Tensor, y: torch.Tensor,
             probe: Callable[[torch.Tensor], Any] | None = None) -> NormSite | SkippedNorm | None:
    """Match the captured ``y = module(x)`` against LayerNorm / RMSNorm formulas (float64).

    Rows of ``x`` with zero mean, or constant rows, make the two formulas agree (Idefics2's perceiver
    latents reach an RMSNorm as a constant table): such a match says nothing about the mean
    subtraction. ``probe`` (the module's output on another input of ``x``'s layout) then decides, on
    ``x`` moved off zero mean and off constant rows (:func:`_identify_off_centre`)."""
    if isinstance(module, nn.GroupNorm):
        if module.num_groups == 1:
            return SkippedNorm(path, type(module).__name__,
                               "GroupNorm(1, C) is a LayerNorm over (C, H, W), but H×W changes with the input, so "
                               "no fixed-shape RMSNorm replaces it; kept (PoolFormer's writers, pooling minus "
                               "identity, could not be centered anyway)")
        return SkippedNorm(path, type(module).__name__,
                           f"GroupNorm with {module.num_groups} groups is not a LayerNorm; kept")
    if not x.numel():  # no rows: every formula matches vacuously, so nothing is identified
        return None
    x64, y64 = x.detach().double(), y.detach().double()
    direct = _affine_tensors(module)
    tensors = dict(direct)
    tol = 1e-5 if x.dtype in (torch.float32, torch.float64) else 2e-2

    def close(candidate: torch.Tensor) -> bool:
        return agrees(candidate, y64, tol)

    for reduce in _reduce_options(module, x, [p for _, p in direct]):
        dims = tuple(range(-len(reduce), 0))
        mu = x64.mean(dims, keepdim=True)
        var = (x64 - mu).pow(2).mean(dims, keepdim=True)
        ms = x64.pow(2).mean(dims, keepdim=True)
        # every ε guess is tried and the closest match kept: a module with no ε attribute matches the
        # default guesses within the tolerance, and only its own ε makes the replacement exact
        best: tuple[float, NormSite | SkippedNorm] | None = None
        ambiguous = False
        for eps in _eps_of(module):
            ln_hat = (x64 - mu) / torch.sqrt(var + eps)
            rms_hat = x64 / torch.sqrt(ms + eps)
            found = _first_match(path, module, ln_hat, rms_hat, reduce, eps, direct, tensors, close)
            if found is not None:
                err = float((found[0] - y64).abs().max()) if y64.numel() else 0.0
                if best is None or err < best[0]:
                    best = (err, found[1])
                ambiguous = ambiguous or (isinstance(found[1], NormSite) and _first_match(
                    path, module, None, rms_hat, reduce, eps, direct, tensors, close) is not None)
        if best is not None:
            if ambiguous and probe is not None:
                return _identify_off_centre(path, module, x, probe) or best[1]
            return best[1]
    return None


def _identify_off_centre(path: str, module: nn.Module, x: torch.Tensor,
                         probe: Callable[[torch.Tensor], Any]) -> NormSite | SkippedNorm | None:
    """:func:`identify` on ``x`` moved off zero mean (a per-row constant) and off constant rows (seeded
    noise: on a constant row a LayerNorm with β = γ' and an RMSNorm with γ' agree too), or None where the
    module does not run on it."""
    scale = 1.0 + float(x.detach().abs().max())
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    shifted = (x.detach().double() + scale * (1.0 + 0.5 * noise)).to(x.dtype)
    try:
        with torch.no_grad():
            out = probe(shifted)
    except Exception:  # noqa: BLE001 - a module that needs more than its input: the first match stands
        return None
    out = out[0] if isinstance(out, (tuple, list)) and out else out
    if not isinstance(out, torch.Tensor) or out.shape != x.shape:
        return None
    return identify(path, module, shifted, out)


def _first_match(path: str, module: nn.Module, ln_hat: torch.Tensor | None, rms_hat: torch.Tensor,
                 reduce: tuple[int, ...], eps: float, direct: list[tuple[str, torch.Tensor]],
                 tensors: dict[str, torch.Tensor], close: Callable[[torch.Tensor], bool]
                 ) -> tuple[torch.Tensor, NormSite | SkippedNorm] | None:
    """The first (flavour, γ, β) assignment whose formula with this ε matches: ``(its output, the result)``."""
    for hat, kind in ((ln_hat, "ln"), (rms_hat, "rms")):
        if hat is None:
            continue
        for flavour, w_attr, b_attr, offset in _assignments(direct):
            cand = hat
            try:
                if w_attr is not None:
                    cand = cand * (offset + tensors[w_attr].detach().double())
                if b_attr is not None:
                    cand = cand + tensors[b_attr].detach().double()
            except RuntimeError:  # parameter does not broadcast with this reduction
                continue
            if not close(cand):
                continue
            if kind == "rms":
                plain = len(reduce) == 1 and w_attr is not None and tuple(tensors[w_attr].shape) == reduce
                return cand, SkippedNorm(path, type(module).__name__, "already RMS-style (no mean subtraction)",
                                         w_attr if plain else None, offset, b_attr)
            param_shape = tuple(tensors[w_attr or b_attr].shape) if (w_attr or b_attr) else reduce
            return cand, NormSite(path, type(module).__name__, reduce, param_shape, eps, flavour,
                                  w_attr, b_attr, offset)
    return None


def identify_channels_first(path: str, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> SkippedNorm | None:
    """A LayerNorm over the channel axis of a channels-first tensor (``(B, C, H, W)``, normalising dim
    1: ConvNeXt's stem and downsampling norms; vit-pytorch's ``ChanLayerNorm`` with ``(1, C, 1, 1)``
    parameters), reported with that reason, or None."""
    if x.dim() < 3 or x.shape != y.shape:
        return None
    channels = x.shape[1]
    flat = {n: p.detach().reshape(-1) for n, p in module._parameters.items()
            if p is not None and p.numel() == channels and p.dim() > 1 and p.shape[1 if p.dim() == x.dim() else 0]
            == channels}
    original = module
    if flat:  # γ, β kept as (1, C, 1, 1) or (C, 1, 1): matched as the (C,) vectors they are
        proxy = copy.copy(module)
        proxy._parameters = {**module._parameters, **flat}
        module = proxy
    found = identify(path, module, x.movedim(1, -1), y.movedim(1, -1),
                     probe=lambda t: original(t.movedim(-1, 1)).movedim(1, -1))
    if not isinstance(found, NormSite):
        return None
    return SkippedNorm(path, type(module).__name__,
                       "LayerNorm over the channel axis of a channels-first tensor (dim 1), where normswap's "
                       "RMSNorm normalises the trailing dims; kept")


def _grouped(x: torch.Tensor, groups: int, eps: float, *, center: bool) -> torch.Tensor:
    """LayerNorm (``center``) or RMSNorm hat of ``x`` over ``groups`` equal blocks of its last axis."""
    g = x.unflatten(-1, (groups, x.shape[-1] // groups))
    if center:
        g = g - g.mean(-1, keepdim=True)
    return (g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)


def identify_gated(path: str, module: nn.Module, x: torch.Tensor, gate: torch.Tensor,
                   y: torch.Tensor) -> SkippedNorm | None:
    """The gated norms of SSM/hybrid mixers (Mamba-2, Bamba, Nemotron-H, Zamba-2, Falcon-H1, Qwen3-Next):
    ``y = γ ⊙ norm(x ⊙ silu(gate))`` or ``y = γ ⊙ norm(x) ⊙ silu(gate)``, the norm possibly over equal
    groups of features. Reported as skipped with the formula: the RMS ones are not LayerNorms, and a
    gated LayerNorm has no RMSNorm replacement (the gate sits inside or after the normalisation).
    γ multiplies the output feature by feature either way, so ``fold_gamma`` may fold it into the
    readers (``weight_attr``)."""
    x64, g64, y64 = x.detach().double(), gate.detach().double(), y.detach().double()
    if g64.shape != x64.shape or y64.shape != x64.shape or not x64.dim():
        return None
    d = x64.shape[-1]
    silu = torch.nn.functional.silu(g64)
    counts = {1}
    for attr in ("n_groups", "group_count", "num_groups"):
        if isinstance(getattr(module, attr, None), int) and getattr(module, attr) > 0:
            counts.add(getattr(module, attr))
    size = getattr(module, "group_size", None)
    if isinstance(size, int) and size > 0 and d % size == 0:
        counts.add(d // size)
    weights = [(n, p.detach().double()) for n, p in module._parameters.items()
               if p is not None and tuple(p.shape) == (d,)] + [(None, None)]
    tol = 1e-5 if x.dtype in (torch.float32, torch.float64) else 2e-2
    for eps in _eps_of(module):
        for groups in sorted(c for c in counts if d % c == 0):
            for gate_first in (True, False):
                for center in (False, True):
                    hat = _grouped(x64 * silu if gate_first else x64, groups, eps, center=center)
                    for w_attr, w in weights:
                        cand = hat if w is None else hat * w
                        if not gate_first:
                            cand = cand * silu
                        if not agrees(cand, y64, tol):
                            continue
                        kind = "LayerNorm" if center else "RMSNorm"
                        formula = f"{kind} of x·silu(gate)" if gate_first else f"{kind} of x, times silu(gate)"
                        over = f" over {groups} groups of {d // groups} features" if groups > 1 else ""
                        reason = (f"gated {kind} ({formula}{over}): no RMSNorm replaces a gate inside the norm; kept"
                                  if center else f"already RMS-style, gated ({formula}{over}); kept")
                        return SkippedNorm(path, type(module).__name__, reason, None if center else w_attr)
    return None


def identify_flattened_heads(path: str, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> SkippedNorm | None:
    """A LayerNorm (or RMSNorm) over each head's features whose output flattens the heads before its
    γ/β (xLSTM's multi-head norm: ``(B, T, H, D) → (B, T, H·D)``). normswap's RMSNorm keeps its input's
    shape, so such a module is reported, with its formula, and kept."""
    x64, y64 = x.detach().double(), y.detach().double()
    if x64.dim() < 2 or y64.shape != (*x64.shape[:-2], x64.shape[-2] * x64.shape[-1]):
        return None
    direct = [(n, p.detach().double()) for n, p in module._parameters.items() if p is not None]
    tol = 1e-5 if x.dtype in (torch.float32, torch.float64) else 2e-2
    for eps in _eps_of(module):
        for center in (True, False):
            hat = _grouped(x64, 1, eps, center=center).flatten(-2)
            for flavour, w_attr, b_attr, offset in _assignments([(n, p) for n, p in direct]):
                cand = hat
                try:
                    if w_attr is not None:
                        cand = cand * (offset + dict(direct)[w_attr])
                    if b_attr is not None:
                        cand = cand + dict(direct)[b_attr]
                except RuntimeError:
                    continue
                if agrees(cand, y64, tol):
                    kind = "LayerNorm" if center else "RMSNorm"
                    return SkippedNorm(path, type(module).__name__,
                                       f"{kind} per head ({x64.shape[-2]} heads of {x64.shape[-1]}) whose output "
                                       f"flattens the heads before γ/β ({flavour}): no RMSNorm of that shape "
                                       "replaces it; kept")
    return None


def _extra_arguments(call: ModuleCall) -> list[str]:
    """The tensor arguments of a norm's call besides its input, by position or keyword (``batch``)."""
    first = call.first_input()
    found = [f"argument {i}" for i, v in enumerate(call.args) if v is not None and v != first]
    return found + [f"`{k}`" for k, v in call.kwargs.items() if v != first]


def _returned(returns: dict) -> str:
    """A recorded return structure as the user would write it: ``(output, None, other)``, ``dict``."""
    if "items" not in returns:
        return f"a {returns.get('type')}"
    items = ", ".join(returns["items"])
    return f"[{items}]" if returns["type"] == "list" else f"({items})"


def _takes_more_than_input(module: nn.Module) -> bool:
    """Does the module's ``forward`` accept anything besides its input (``forward(x, batch=None)``)?
    Its replacement must accept the same calls (:class:`normswap.nn.rmsnorm.RMSNorm`'s forward takes one
    tensor)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(params) > 1 or any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def _assignments(direct: list[tuple[str, torch.Tensor]]):
    """(flavour, weight attr, bias attr, offset) guesses, most common first."""
    names = [n for n, _ in direct]
    guesses = []
    for w, b in itertools.permutations(names, 2) if len(names) >= 2 else []:
        guesses += [("standard", w, b, 0.0), ("offset", w, b, 1.0)]
    for n in names:
        guesses += [("gamma-only", n, None, 0.0), ("offset", n, None, 1.0), ("beta-only", None, n, 0.0)]
    guesses.append(("non-affine", None, None, 0.0))
    return guesses


NOT_RUN = ("did not run on the analysis inputs (a branch they do not take), so it was neither analysed nor "
           "converted; kept as LayerNorm: pass example_inputs that reach it to convert it")


EMPTY_ONLY = ("ran on the analysis inputs only with no rows (an empty tensor, as a branch given no media), so "
              "nothing identified or analysed it; kept as LayerNorm: pass example_inputs that give it rows to "
              "convert it")


def find_sites(model: nn.Module, graph: Graph) -> WalkResult:
    """Every norm of ``model`` that ran in the traced ``graph``, identified from its real input and
    output (a wrapper identified as a norm claims the modules inside it); and the modules already
    converted by normswap."""
    found = WalkResult()
    modules = dict(model.named_modules())
    claimed: list[str] = []
    direct_ln = {graph.calls[op.call].path for op in graph.ops if op.name == "layer_norm" and op.call is not None}
    computed = computes_norm(graph)
    for path in candidates(model, direct_ln | computed):
        if any(path.startswith(c + ".") for c in claimed):
            continue  # inside a wrapper already identified as the norm
        calls = graph.calls_of(path)
        # a call on no rows (an audio branch given no audio: shape (0, d)) matches every formula vacuously
        live = [c for c in calls if (v := c.first_input()) is None or graph.values[v].tensor.numel()]
        if not live:
            if isinstance(modules[path], nn.LayerNorm) or path in direct_ln:
                found.skipped.append(SkippedNorm(path, type(modules[path]).__name__,
                                                 NOT_RUN if not calls else EMPTY_ONLY))
                claimed.append(path)
            continue
        call = live[0]
        vid = call.first_input()
        if vid is None or not call.outputs:
            continue
        x = graph.values[vid].tensor
        y = graph.values[call.outputs[0]].tensor
        result = identify(path, modules[path], x, y, probe=modules[path])
        tensors = [v for v in [*call.args, *call.kwargs.values()] if v is not None]
        if result is None and len(tensors) == 2:
            result = identify_gated(path, modules[path], x, graph.values[tensors[1]].tensor, y)
        if result is None:
            result = identify_flattened_heads(path, modules[path], x, y)
        if result is None:
            result = identify_channels_first(path, modules[path], x, y)
        extras = _extra_arguments(call)
        leaf = not any(True for _ in modules[path].children())
        if result is None and (isinstance(modules[path], nn.LayerNorm) or path in direct_ln
                               # a block that computes a norm inline among other work is not one: its
                               # own norms inside stay candidates (it is not reported, nor claimed)
                               or (path in computed and leaf)
                               or (_LN_CLASS.search(type(modules[path]).__name__) and leaf)):
            # a LayerNorm that ran and matched no formula is reported, never dropped in silence
            if not (bool(torch.isfinite(x).all()) and bool(torch.isfinite(y).all())):
                why = "its traced input or output is not finite"
            elif extras:
                why = (f"its traced output matches no per-row LayerNorm/RMSNorm formula of its input, parameters "
                       f"and buffers, with {', '.join(extras)} also passed to it: a norm over the rows of a graph "
                       "or batch those arguments pick out is not a per-row norm, and no RMSNorm replaces it")
            else:
                why = "its traced output matches no LayerNorm/RMSNorm formula of its parameters and buffers"
            result = SkippedNorm(path, type(modules[path]).__name__, f"{why}; kept")
        if isinstance(result, NormSite) and not reproducible(call.returns):
            result = SkippedNorm(path, type(modules[path]).__name__,
                                 f"it returns {_returned(call.returns)}, which holds more than its normalised "
                                 "output, None and its own arguments: no RMSNorm can return it; kept")
        if isinstance(result, NormSite):
            result.extra_args = bool(extras) or _takes_more_than_input(modules[path]) or bool(call.returns)
            result.returns = dict(call.returns)
            found.sites.append(result)
            claimed.append(path)
        elif isinstance(result, SkippedNorm):
            found.skipped.append(result)
            claimed.append(path)
    found.converted = [p for p, m in model.named_modules() if isinstance(m, RMSNorm)]
    return found
