"""Find every LayerNorm-like module and work out exactly what it computes.

Class names are not trusted: HF models ship LayerNorms as ``nn.LayerNorm`` subclasses, as custom
classes (OLMo's parameter-free ``OlmoLayerNorm``, Cohere's γ-only ``CohereLayerNorm``, Nemotron's
``1+γ`` ``NemotronLayerNorm1P``), or as wrappers holding an inner non-affine ``nn.LayerNorm`` plus
their own parameters. So the walker collects *candidates* by structure and name, then identifies
each one's formula numerically from the input/output pair captured during the traced forward:
``γ ⊙ (x − μ)/sqrt(var + ε) + β`` in its flavours, or already-RMS (reported as skipped).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field

import torch
from torch import nn

from normswap.norm import RMSNorm
from normswap.trace import Graph

_LN_NAME = re.compile(r"norm|\bln\b", re.IGNORECASE)
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
    calls ``layer_norm`` directly: ``calls_layer_norm``) and by class name (``*Norm*``).
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


def identify(path: str, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> NormSite | SkippedNorm | None:
    """Match the captured ``y = module(x)`` against LayerNorm / RMSNorm formulas (float64)."""
    if isinstance(module, nn.GroupNorm):
        if module.num_groups == 1:
            return SkippedNorm(path, type(module).__name__,
                               "GroupNorm(1, C) is a LayerNorm over (C, H, W), but H×W changes with the input, so "
                               "no fixed-shape RMSNorm replaces it; kept (PoolFormer's writers, pooling minus "
                               "identity, could not be centered anyway)")
        return SkippedNorm(path, type(module).__name__,
                           f"GroupNorm with {module.num_groups} groups is not a LayerNorm; kept")
    x64, y64 = x.detach().double(), y.detach().double()
    direct = [(n, p) for n, p in module._parameters.items() if p is not None]
    tol = 1e-5 if x.dtype in (torch.float32, torch.float64) else 2e-2
    scale = max(1.0, float(y64.abs().max())) if y64.numel() else 1.0

    def close(candidate: torch.Tensor) -> bool:
        return candidate.shape == y64.shape and bool(((candidate - y64).abs() <= tol * scale).all())

    for reduce in _reduce_options(module, x, [p for _, p in direct]):
        dims = tuple(range(-len(reduce), 0))
        mu = x64.mean(dims, keepdim=True)
        var = (x64 - mu).pow(2).mean(dims, keepdim=True)
        ms = x64.pow(2).mean(dims, keepdim=True)
        for eps in _eps_of(module):
            ln_hat = (x64 - mu) / torch.sqrt(var + eps)
            rms_hat = x64 / torch.sqrt(ms + eps)
            for hat, kind in ((ln_hat, "ln"), (rms_hat, "rms")):
                for flavour, w_attr, b_attr, offset in _assignments(direct):
                    cand = hat
                    try:
                        if w_attr is not None:
                            cand = cand * (offset + module._parameters[w_attr].detach().double())
                        if b_attr is not None:
                            cand = cand + module._parameters[b_attr].detach().double()
                    except RuntimeError:  # parameter does not broadcast with this reduction
                        continue
                    if not close(cand):
                        continue
                    if kind == "rms":
                        plain = len(reduce) == 1 and w_attr is not None and \
                            tuple(module._parameters[w_attr].shape) == reduce
                        return SkippedNorm(path, type(module).__name__, "already RMS-style (no mean subtraction)",
                                           w_attr if plain else None, offset, b_attr)
                    param_shape = tuple(module._parameters[w_attr or b_attr].shape) if (w_attr or b_attr) \
                        else reduce
                    return NormSite(path, type(module).__name__, reduce, param_shape, eps, flavour,
                                    w_attr, b_attr, offset)
    return None


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


def find_sites(model: nn.Module, graph: Graph) -> WalkResult:
    """Every norm of ``model`` that ran in the traced ``graph``, identified from its real input and
    output (a wrapper identified as a norm claims the modules inside it); and the modules already
    converted by normswap."""
    found = WalkResult()
    modules = dict(model.named_modules())
    claimed: list[str] = []
    direct_ln = {graph.calls[op.call].path for op in graph.ops if op.name == "layer_norm" and op.call is not None}
    for path in candidates(model, direct_ln):
        if any(path.startswith(c + ".") for c in claimed):
            continue  # inside a wrapper already identified as the norm
        calls = graph.calls_of(path)
        if not calls:
            continue
        call = calls[0]
        vid = call.first_input()
        if vid is None or not call.outputs:
            continue
        x = graph.values[vid].tensor
        y = graph.values[call.outputs[0]].tensor
        result = identify(path, modules[path], x, y)
        if isinstance(result, NormSite):
            found.sites.append(result)
            claimed.append(path)
        elif isinstance(result, SkippedNorm):
            found.skipped.append(result)
            claimed.append(path)
    found.converted = [p for p, m in model.named_modules() if isinstance(m, RMSNorm)]
    return found
