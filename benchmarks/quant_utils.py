"""Quantization pieces for ``bench_quant.py``: round-to-nearest fake-quant and activation outlier figures.

The package itself has no quantizer; these exist to measure what a conversion and a rotation do to
quantization error. Everything here works on any ``nn.Module`` whose matmuls are ``nn.Linear`` or
transformers' ``Conv1D`` (GPT-2 style, weight stored ``[in, out]``).

* :func:`absmax_quantize`: symmetric absmax RTN of a tensor along one axis, no clipping search.
* :func:`fake_quantize_`: a model's weights per output channel (in place) and, through forward
  pre-hooks, each Linear's input per token, so every matmul sees ``Q(x) Q(W)ᵀ``.
* :class:`OutlierStats`: per Linear input, per token, ``max|x| / rms(x)`` and the kurtosis over the
  channels, averaged over tokens; the figures that say how hard a tensor is to quantize per token.
* :func:`int8_dynamic`: a real int8 path, ``torch.ao.quantization.quantize_dynamic`` (qint8 weights,
  activations quantized per tensor at run time, integer GEMMs on fbgemm/x86).
* :func:`torchao_int8`: torchao's int8 dynamic-activation / int8-weight (per-token activations,
  per-channel weights, both symmetric: the W8A8 scheme above, run with ``torch._int_mm``), when
  torchao is installed (the ``quant`` extra).
* :class:`BatchReader`: ONNX Runtime's calibration data reader over ready feeds (static QDQ).
* :func:`torchao_int8_grid` / :func:`torchao_linear_`: torchao 0.18's symmetric int8 grid and its dynamic W8A8
  Linear emulated bit for bit in float (torchao need not be installed).
* :func:`cluster_bootstrap`: a ratio of means with its interval resampling clusters (the photographs a set of
  crops came from), not the single inputs.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn


def weight_in_axis(module: nn.Module) -> int | None:
    """The weight's input-feature axis for a quantizable matmul (Linear: 1, HF Conv1D: 0), else None."""
    if isinstance(module, nn.Linear):
        return 1
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None \
            and module.weight.dim() == 2:
        return 0
    return None


def matmuls(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every ``nn.Linear`` and HF ``Conv1D`` of ``model`` as ``(name, module)``."""
    return [(name, m) for name, m in model.named_modules() if weight_in_axis(m) is not None]


def absmax_quantize(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Symmetric round-to-nearest fake quantization of ``x``, one scale per slice reduced over ``dim``.

    ``scale = max|x| / (2^(bits-1) − 1)`` over ``dim``; values become ``round(x / scale)`` clamped to
    ``±(2^(bits-1) − 1)``, times ``scale``. Computed in float32 (float64 stays float64), returned in
    ``x``'s dtype. An all-zero slice stays zero.
    """
    if bits < 2:
        raise ValueError(f"bits must be at least 2, got {bits}")
    work = x if x.dtype == torch.float64 else x.float()
    qmax = 2 ** (bits - 1) - 1
    scale = work.abs().amax(dim=dim, keepdim=True) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return ((work / scale).round().clamp(-qmax, qmax) * scale).to(x.dtype)


def _quantize_input(bits: int, per: str = "token"):
    def hook(module: nn.Module, args: tuple) -> tuple:
        if not args or not torch.is_tensor(args[0]):
            return args
        x = args[0]
        if per == "tensor" and x.dim() > 2:  # one scale per sample: over its tokens and features
            return (absmax_quantize(x.reshape(x.shape[0], -1), bits, dim=-1).reshape(x.shape), *args[1:])
        return (absmax_quantize(x, bits, dim=-1), *args[1:])  # per token: over the features
    return hook


def fake_quantize_(model: nn.Module, w_bits: int | None, a_bits: int | None, only: set[str] | None = None,
                   act_per: str = "token") -> list:
    """Fake-quantize every Linear/Conv1D of ``model`` (or those named in ``only``): W per output channel,
    inputs per token (``act_per="tensor"``: one scale per sample, over all its tokens and features, the
    dynamic per-tensor scale a batch of one gets).

    ``None`` leaves that side in floating point. Each quantized module gets its own rounded weight
    (a new parameter), so a weight tied to something else (GPT-2's head and its input embedding)
    is rounded where the matmul reads it and nowhere else. Returns the hook handles (remove them to
    stop quantizing activations; the weights stay rounded).
    """
    if act_per not in ("token", "tensor"):
        raise ValueError(f"act_per must be 'token' or 'tensor', got {act_per!r}")
    handles = []
    for name, module in matmuls(model):
        if only is not None and name not in only:
            continue
        if w_bits is not None:  # one scale per output channel: reduce over the input axis
            rounded = absmax_quantize(module.weight.detach(), w_bits, dim=weight_in_axis(module))
            module.weight = nn.Parameter(rounded, requires_grad=False)
        if a_bits is not None:
            handles.append(module.register_forward_pre_hook(_quantize_input(a_bits, act_per)))
    return handles


def token_figures(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (``x`` flattened to ``[tokens, features]``): ``max|x| / rms(x)`` and Pearson kurtosis.

    Kurtosis is ``mean((x − μ)⁴) / var(x)²`` over a token's features (3 for Gaussian features,
    large when a few channels carry outliers). A constant token gets ratio 0 / kurtosis 0 only if it
    is all zero; otherwise a constant token has ratio 1 and kurtosis 0 (no spread).
    """
    t = x.detach().reshape(-1, x.shape[-1]).double()
    rms = t.pow(2).mean(-1).sqrt()
    ratio = t.abs().amax(-1) / torch.where(rms > 0, rms, torch.ones_like(rms))
    c = t - t.mean(-1, keepdim=True)
    var = c.pow(2).mean(-1)
    kurt = c.pow(4).mean(-1) / torch.where(var > 0, var, torch.ones_like(var)).pow(2)
    return ratio, kurt


@dataclass
class _Acc:
    ratio: float = 0.0
    kurt: float = 0.0
    tokens: int = 0


@dataclass
class OutlierStats:
    """Outlier figures of every Linear/Conv1D input of a model, accumulated over forward passes.

    Use as a context manager around the forward passes. Set ``mask`` (``[batch, seq]``, 1 = real
    token) before a pass to leave padding tokens out; inputs whose leading shape does not match the
    mask are counted whole.
    """

    model: nn.Module
    mask: torch.Tensor | None = None
    acc: dict[str, _Acc] = field(default_factory=dict)
    _handles: list = field(default_factory=list)

    def __enter__(self) -> OutlierStats:
        for name, module in matmuls(self.model):
            self._handles.append(module.register_forward_pre_hook(self._hook(name)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            if not args or not torch.is_tensor(args[0]):
                return
            x = args[0]
            ratio, kurt = token_figures(x)
            m = self.mask
            if m is not None and tuple(x.shape[:-1]) == tuple(m.shape):
                keep = m.reshape(-1).bool()
                ratio, kurt = ratio[keep], kurt[keep]
            a = self.acc.setdefault(name, _Acc())
            a.ratio += float(ratio.sum())
            a.kurt += float(kurt.sum())
            a.tokens += ratio.numel()
        return hook

    def per_linear(self) -> dict[str, tuple[float, float]]:
        """``{name: (mean max/rms, mean kurtosis)}`` over the tokens seen."""
        return {k: (a.ratio / a.tokens, a.kurt / a.tokens) for k, a in self.acc.items() if a.tokens}

    def summary(self) -> dict[str, float | str]:
        """Mean over Linear inputs and the worst one, for max/rms and kurtosis."""
        per = self.per_linear()
        if not per:
            return {}
        worst_r = max(per, key=lambda k: per[k][0])
        worst_k = max(per, key=lambda k: per[k][1])
        return {"max_rms_mean": sum(v[0] for v in per.values()) / len(per), "max_rms_worst": per[worst_r][0],
                "max_rms_worst_at": worst_r, "kurtosis_mean": sum(v[1] for v in per.values()) / len(per),
                "kurtosis_worst": per[worst_k][1], "kurtosis_worst_at": worst_k}


def weight_figures(model: nn.Module) -> dict[str, float]:
    """Per-output-channel ``max|w| / rms(w)`` of every Linear/Conv1D weight (the row a per-channel scale
    covers): mean over channels, then the mean over matrices and the worst matrix."""
    per = []
    seen: set[int] = set()
    for _, m in matmuls(model):
        if id(m.weight) in seen:
            continue
        seen.add(id(m.weight))
        w = m.weight.detach().double().movedim(weight_in_axis(m), -1)  # [out, in]
        per.append(float(token_figures(w)[0].mean()))
    return {"w_max_rms_mean": sum(per) / len(per), "w_max_rms_worst": max(per)} if per else {}


def conv1d_to_linear_(model: nn.Module) -> int:
    """Replace every HF ``Conv1D`` by the equivalent ``nn.Linear`` (weight transposed); returns the count.

    ``quantize_dynamic`` only swaps ``nn.Linear``; GPT-2's matmuls are Conv1D.
    """
    swaps = [(name, m) for name, m in model.named_modules() if weight_in_axis(m) == 0]
    for name, m in swaps:
        d_in, d_out = m.weight.shape
        lin = nn.Linear(d_in, d_out, bias=m.bias is not None, dtype=m.weight.dtype, device=m.weight.device)
        with torch.no_grad():
            lin.weight.copy_(m.weight.T)
            if m.bias is not None:
                lin.bias.copy_(m.bias)
        lin._forward_pre_hooks.update(m._forward_pre_hooks)  # e.g. an online Hadamard on the input
        lin._forward_pre_hooks_with_kwargs.update(m._forward_pre_hooks_with_kwargs)
        lin._forward_hooks.update(m._forward_hooks)
        lin._forward_hooks_with_kwargs.update(m._forward_hooks_with_kwargs)
        for bname, buf in m.named_buffers(recurse=False):  # what those hooks read
            lin.register_buffer(bname, buf)
        for key, value in vars(m).items():  # and their plain attributes (an online op's pow2 factor: without
            # it the op exports as a butterfly of adds that rotation.onnx_nodes.float_nodes cannot find)
            if key.startswith("_normswap") and not isinstance(value, torch.utils.hooks.RemovableHandle):
                setattr(lin, key, value)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, lin)
    return len(swaps)


class InputHooks(nn.Module):
    """Runs a module's forward pre-hooks (an online Hadamard, say) ahead of it, from a wrapper, so that a
    quantizer that replaces the module by its own class keeps them. The hooks are the wrapper's own pre-hooks
    and see the wrapper, which carries the original module's buffers and ``_normswap*`` attributes (so
    normswap's guard sees the op still run at that path)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        if inner._forward_pre_hooks_with_kwargs:
            raise ValueError("pre-hooks that take keyword arguments are not supported")
        for name, buf in inner.named_buffers(recurse=False):
            self.register_buffer(name, buf)
        for key, value in vars(inner).items():
            if key.startswith("_normswap") and not isinstance(value, torch.utils.hooks.RemovableHandle):
                setattr(self, key, value)
        for hook in inner._forward_pre_hooks.values():
            self.register_forward_pre_hook(hook)
        inner._forward_pre_hooks.clear()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.inner(*args)


def hoist_input_hooks_(model: nn.Module) -> int:
    """Wrap every Linear that has forward pre-hooks in :class:`InputHooks`; returns the count."""
    hooked = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and m._forward_pre_hooks]
    for name, m in hooked:
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, InputHooks(m))
    return len(hooked)


def int8_dynamic(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every Linear (Conv1D converted first) as a dynamic int8 qint8 Linear.

    ``torch.ao.quantization.quantize_dynamic``: weights int8 per tensor, activations quantized per
    tensor at run time, the matmul in int8 on the x86/fbgemm engine. CPU only, float32 models.
    """
    from torch.ao.quantization import quantize_dynamic

    work = copy.deepcopy(model).float()
    conv1d_to_linear_(work)
    hoist_input_hooks_(work)
    with warnings.catch_warnings():  # torch 2.10+ marks the quantized tensor types deprecated; they still run
        warnings.simplefilter("ignore", UserWarning)
        return quantize_dynamic(work, {nn.Linear}, dtype=torch.qint8)


def torchao_int8(model: nn.Module) -> nn.Module:
    """A copy of ``model`` quantized by torchao's ``Int8DynamicActivationInt8WeightConfig`` (raises ImportError
    without torchao). Conv1D layers become ``nn.Linear`` first: torchao only swaps Linear weights."""
    import logging

    logging.getLogger("torchao").setLevel(logging.ERROR)  # CUDA-only extensions fail to load on CPU
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    work = copy.deepcopy(model).float()
    conv1d_to_linear_(work)
    hoist_input_hooks_(work)
    quantize_(work, Int8DynamicActivationInt8WeightConfig())
    return work


def torchao_int8_grid(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao 0.18's symmetric int8 (``choose_qparams_affine`` + ``quantize_affine``, ``MappingType.SYMMETRIC``):
    ``s = max(absmax / 127.5, eps)`` in float32 along ``dim``, ``q = clamp(round(x · (1/s)), −128, 127)``.

    Returns ``(q, s)`` as float32 (``q`` holds integers). Not LLM.int8's ``absmax / 127``: each slice's largest
    positive value lands on 127 (half a step short), its largest negative one on −127 or −128 depending on the
    last bit of ``x · (1/s)`` (``127.5`` computed in float32), so the extreme element always carries the largest
    rounding error (half a step, ``absmax / 255``) and, where negative, in a direction float noise decides.
    """
    xf = x.float()
    s = (xf.abs().amax(dim, keepdim=True) / 127.5).clamp_min(torch.finfo(torch.float32).eps)
    return torch.clamp(torch.round(xf * (1.0 / s)), -128, 127), s


def torchao_linear_(linear: nn.Linear, weights: bool = True, activations: bool = True) -> nn.Linear:
    """``linear`` (in place) computing as torchao's ``Int8DynamicActivationInt8WeightConfig`` does on CPU: weight
    rows and each input token on :func:`torchao_int8_grid`, the integer product exact (``torch._int_mm`` on int32;
    here in float64, exact for these sizes), then ``· s_x`` and ``· s_w`` in float32, then the bias. Equal to
    torchao's own output bit for bit (checked on DINOv2-small, round 53), so a model can be quantized in part.
    ``weights=False`` / ``activations=False``: that side left in float (the other rounded as torchao does), to
    split torchao's error into its two roundings.
    """
    if not (weights or activations):
        raise ValueError("torchao_linear_ needs weights, activations or both rounded")
    w = linear.weight.detach().float()
    wq, ws = torchao_int8_grid(w)
    bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(x: torch.Tensor) -> torch.Tensor:
        if activations:
            xq, xs = torchao_int8_grid(x)
            y = ((xq.double() @ wq.double().T).float() * xs * ws.flatten() if weights
                 else (xq * xs) @ w.T)
        else:
            y = x.float() @ (wq * ws).T
        return (y if bias is None else y + bias).to(x.dtype)

    linear.forward = forward
    return linear


def cluster_bootstrap(variant: Sequence[float], base: Sequence[float], clusters: Sequence[object],
                      draws: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """``mean(variant) / mean(base)`` (paired per input) with a 95% interval that resamples whole clusters.

    Crops of one photograph are not independent: resampling crops treats 64 crops of one photograph as 64
    pieces of evidence, and an interval over them is too narrow when the photographs differ. Here each draw
    picks as many clusters as there are, with replacement, and keeps every input of each one. Returns
    ``(ratio, low, high)``.
    """
    import numpy as np

    v, b = np.asarray(variant, dtype=float), np.asarray(base, dtype=float)
    labels = np.asarray([str(c) for c in clusters])
    if not (len(v) == len(b) == len(labels)):
        raise ValueError("variant, base and clusters must have one entry per input")
    names = np.unique(labels)
    sums = np.array([[v[labels == n].sum(), b[labels == n].sum()] for n in names])
    idx = np.random.default_rng(seed).integers(0, len(names), (draws, len(names)))
    picked = sums[idx].sum(1)
    lo, hi = np.percentile(picked[:, 0] / picked[:, 1], [2.5, 97.5])
    return float(v.mean() / b.mean()), float(lo), float(hi)


class BatchReader:
    """ONNX Runtime's calibration data reader (``quantize_static``) over a list of ready feeds, each a dict of
    input name to NumPy array; ``rewind`` starts again for a second calibration pass."""

    def __init__(self, feeds: list[dict]) -> None:
        self.batches = list(feeds)
        self.i = 0

    def get_next(self) -> dict | None:
        if self.i >= len(self.batches):
            return None
        self.i += 1
        return self.batches[self.i - 1]

    def rewind(self) -> None:
        self.i = 0
