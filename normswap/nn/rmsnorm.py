"""``normswap.RMSNorm``: the module every converted LayerNorm becomes, and its functional form.

Attribute names follow the ecosystem: ``weight``, ``bias``, ``eps`` and ``variance_epsilon`` (what
Hugging Face's hub kernels read). The class name contains "RMSNorm" because transformers' weight
init and Trainer's weight-decay exclusion key on it.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import nn

from normswap import backends
from normswap.backends import cpu
from normswap.backends.portable import delegable_rms_norm, export_rms_norm
from normswap.backends.rows import wants_grad
from normswap.backends.tracing import exporting

ShapeLike = int | Sequence[int] | torch.Size


def _as_shape(shape: ShapeLike) -> tuple[int, ...]:
    if isinstance(shape, numbers.Integral):
        return (int(shape),)
    return tuple(int(s) for s in shape)


def rms_norm(
    x: torch.Tensor,
    normalized_shape: ShapeLike,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """``weight * x / sqrt(mean(x**2) + eps) + bias`` over the trailing ``normalized_shape`` dims.

    Cast order (every backend): the whole expression is computed in float32 (float64 for float64
    input), with ``weight`` and ``bias`` upcast from their own dtype, and the result is rounded to the
    input dtype once, as ``torch.layer_norm`` does; so a converted bf16/fp16 model rounds where the
    LayerNorm it replaced rounded. ``weight`` and ``bias`` may have more leading dims than
    ``normalized_shape`` (per-head parameters) as long as they broadcast against ``x``.
    """
    kind = type(normalized_shape)  # exact-type checks: the common cases without _as_shape's loop
    shape = normalized_shape if kind is tuple else (normalized_shape,) if kind is int else _as_shape(normalized_shape)
    if exporting():  # torch.export / ONNX / jit.trace: stock aten ops unless a fused backend was asked for
        y = export_rms_norm(x, shape, weight, bias, float(eps), backend)
        if y is not None:
            return y
    else:
        if x.is_cpu and backend == "auto" and backends.env_backend() == "auto":
            y = cpu.try_fast(x, shape, weight, bias, float(eps))  # the common CPU call, checked in one go
            if y is not None:
                return y
        if not torch.compiler.is_compiling():
            y = _cached_call(x, shape, weight, bias, float(eps), backend)
            if y is not None:
                return y
    if tuple(x.shape[x.dim() - len(shape) :]) != shape:
        raise ValueError(f"rms_norm: input shape {tuple(x.shape)} does not end with {shape}")
    impl = backends.resolve(backend, x, weight, bias)
    return impl.rms_norm(x, shape, weight, bias, float(eps))


class _FunctionalDecisions:
    """Decisions for the functional ``rms_norm``, keyed on everything a bound launcher assumes (there is
    no module to cache on). Dropped by ``backends.refresh()``; bounded (cleared past MAX entries)."""

    MAX = 512

    def __init__(self) -> None:
        self.impls: dict[tuple, backends.Impl] = {}

    def clear_decisions(self) -> None:
        self.impls.clear()


_FUNCTIONAL = _FunctionalDecisions()
backends.track(_FUNCTIONAL)


def _param_key(p: torch.Tensor | None) -> tuple | None:
    return None if p is None else (type(p), p.dtype, p.device, p.shape, p.requires_grad)


def _cached_call(x: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None,
                 bias: torch.Tensor | None, eps: float, backend: str) -> torch.Tensor | None:
    """The functional call through a cached decision, or None (then the general path runs)."""
    grad = wants_grad(x, weight, bias)
    key = (backend, type(x), x.device, x.dtype, grad, shape, _param_key(weight), _param_key(bias))
    impls = _FUNCTIONAL.impls
    impl = impls.get(key)
    if impl is None:
        if tuple(x.shape[x.dim() - len(shape):]) != shape:
            return None  # the general path raises the shape error
        if len(impls) >= _FunctionalDecisions.MAX:
            impls.clear()
        impl = impls[key] = backends.bind(backend, x, weight, bias, shape)
    return impl(x, weight, bias, eps)


def _general(x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None, eps: float) -> None:
    return None  # "take the general path" (RMSNorm.forward then calls rms_norm)


class RMSNorm(nn.Module):
    """Root-mean-square normalisation with optional bias.

    ``y = weight * x / sqrt(mean(x**2) + eps) + bias``. With a zero-mean input this equals
    ``LayerNorm`` with the same eps, which is what makes normswap's conversions exact. In half
    precision it also rounds like ``LayerNorm``: float32 arithmetic throughout, one rounding of the
    output (see :func:`rms_norm`), not Hugging Face ``LlamaRMSNorm``'s rounding before the weight.

    Args:
        normalized_shape: trailing dims to normalise over.
        eps: added to the mean square; always explicit (never a dtype-dependent default).
        elementwise_affine: learnable ``weight`` (initialised to ones).
        bias: learnable ``bias`` (initialised to zeros); where a LayerNorm's β cannot be folded.
        backend: ``"auto"`` or a name from ``normswap.backends.names()``.
        param_shape: shape of ``weight``/``bias`` when it differs from ``normalized_shape``
            (a per-head norm that reduces over ``head_dim`` with parameters per ``(head, head_dim)``).
    """

    def __init__(
        self,
        normalized_shape: ShapeLike,
        eps: float = 1e-6,
        elementwise_affine: bool = True,
        bias: bool = False,
        *,
        backend: str = "auto",
        param_shape: ShapeLike | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = _as_shape(normalized_shape)
        self.param_shape = _as_shape(param_shape) if param_shape is not None else self.normalized_shape
        self.eps = float(eps)
        self.elementwise_affine = elementwise_affine
        self.backend = backends.check_name(backend)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(self.param_shape, **factory)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(self.param_shape, **factory)) if bias else None
        self._impls: dict[tuple, backends.Impl] = {}  # (type, device, dtype, grad) -> bound call; see forward
        backends.track(self)

    #: The form ``torch.export`` records, when not the default (:mod:`normswap.backends.portable`): a name from
    #: ``normswap.backends.portable.DELEGABLE_FORMS``, set on the instance (with its ``export_mean_weight``
    #: and ``export_eps`` buffers) by ``normswap.integrations.executorch.delegable_norms`` for the duration
    #: of an export. Eager calls never read it.
    export_form: str | None = None

    #: Subtract each token's mean before normalising: a Post-LN norm given a centering op
    #: (``per_norm_centering=True``). ``RMSNorm(x - mean(x))·γ + β`` is ``LayerNorm(x)`` with the same γ, β and
    #: eps, so such a norm runs torch's one ``layer_norm`` kernel (eager, compiled and exported) instead of a
    #: Python pre-hook, a mean and a subtraction before the RMS kernel. Set by
    #: :func:`normswap.surgery.edits.install_hook`, never by hand.
    centers_input: bool = False

    # The cached decisions depend on these; setting one (or moving/casting the module) drops them.
    _DECISION_INPUTS = frozenset({"weight", "bias", "eps", "backend", "normalized_shape", "param_shape",
                                  "centers_input"})

    def __setattr__(self, name: str, value: object) -> None:
        if name == "backend":
            value = backends.check_name(value)  # type: ignore[arg-type]
        super().__setattr__(name, value)
        if name in RMSNorm._DECISION_INPUTS:
            self.clear_decisions()

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        # what torch.distributed.tensor's distribute_module (tensor parallelism) calls to swap in a
        # DTensor: not __setattr__, so the decisions are dropped here too
        super().register_parameter(name, param)
        if name in RMSNorm._DECISION_INPUTS:
            self.clear_decisions()

    def clear_decisions(self) -> None:
        """Forget the cached backend decisions (the next call decides again)."""
        impls = self.__dict__.get("_impls")
        if impls:
            impls.clear()

    def _apply(self, fn, *args, **kwargs):  # .to(), .half(), .cuda(), ...: parameters change
        self.clear_decisions()
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_impls"] = {}  # bound calls are closures: not picklable, and specific to this process
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__.setdefault("_impls", {})
        backends.track(self)

    @property
    def variance_epsilon(self) -> float:
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, value: float) -> None:
        self.eps = float(value)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Normalise ``hidden_states`` over the trailing ``normalized_shape`` dims.

        Host cost: the backend decision is made once per (tensor type, device, dtype, grad state) and
        cached on the module (``normswap.backends.bind``); a call then costs one dict lookup plus the
        bound launcher. The tensor type is in the key because a ``DTensor`` input (tensor parallelism)
        must not reach a launcher bound for plain tensors (``normswap.backends.rows.dense``).
        Under ``torch.compile``/``torch.export`` or ``torch.jit`` tracing the general (traceable) path
        runs instead.
        """
        # torch._C._is_tracing is what torch.jit.is_tracing() returns outside TorchScript (this forward is
        # never scripted: __prepare_scriptable__), without its Python wrapper (~0.1 us a call)
        if torch.compiler.is_compiling() or torch._C._is_tracing():
            if self.centers_input:
                return torch.nn.functional.layer_norm(hidden_states, self.normalized_shape, self.weight, self.bias,
                                                      self.eps)
            if self.export_form is not None and exporting():
                return delegable_rms_norm(hidden_states, self.normalized_shape, self.weight, self.bias,
                                          self.export_mean_weight, self.export_eps, self.export_form)
            return rms_norm(hidden_states, self.normalized_shape, self.weight, self.bias, self.eps,
                            backend=self.backend)
        # The parameters straight from ``_parameters``: ``self.weight`` goes through nn.Module.__getattr__,
        # ~0.6 us each on CPU, a sixth of a decode-sized call. Anything not registered there (no weight:
        # a plain None attribute; a parametrization's property) is read the ordinary way.
        params = self._parameters
        w = params["weight"] if "weight" in params else self.weight
        b = params["bias"] if "bias" in params else self.bias
        x = hidden_states
        key = (type(x), x.device, x.dtype, torch.is_grad_enabled() and (
            x.requires_grad or (w is not None and w.requires_grad) or (b is not None and b.requires_grad)))
        impl = self._impls.get(key)
        if impl is None:
            impl = self._decide(key, x)
        y = impl(x, w, b, self.eps)
        if y is None:  # a call the bound launcher does not cover (e.g. a mis-shaped input)
            return rms_norm(x, self.normalized_shape, w, b, self.eps, backend=self.backend)
        return y

    def _decide(self, key: tuple, x: torch.Tensor) -> backends.Impl:
        if tuple(x.shape[x.dim() - len(self.normalized_shape):]) != self.normalized_shape:
            return _general  # not cached: the general path raises the shape error
        if self.centers_input:
            shape = self.normalized_shape
            impl = lambda x, w, b, eps: torch.nn.functional.layer_norm(x, shape, w, b, eps)  # noqa: E731
            self._impls[key] = impl
            return impl
        impl = backends.bind(self.backend, x, self.weight, self.bias, self.normalized_shape)
        self._impls[key] = impl
        return impl

    def __prepare_scriptable__(self) -> nn.Module:
        """``torch.jit.script`` compiles the eager math instead (same parameters)."""
        return ScriptableRMSNorm(self)

    def extra_repr(self) -> str:
        extra = f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        extra += f", bias={self.bias is not None}, backend={self.backend!r}"
        if self.param_shape != self.normalized_shape:
            extra += f", param_shape={self.param_shape}"
        if self.centers_input:
            extra += ", centers_input=True"
        return extra


class ScriptableRMSNorm(torch.nn.Module):
    """What ``torch.jit.script`` compiles in place of a ``normswap.RMSNorm``: the ``eager`` backend's
    math in TorchScript-compatible code, sharing the original module's parameters (TorchScript cannot
    compile the backend dispatch). Built by ``RMSNorm.__prepare_scriptable__``."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.weight = norm.weight
        self.bias = norm.bias
        self.eps = float(norm.eps)
        self.dims = [-(i + 1) for i in range(len(norm.normalized_shape))]
        self.centers_input = bool(getattr(norm, "centers_input", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        xf = x.to(compute)
        if self.centers_input:
            xf = xf - xf.mean(self.dims, keepdim=True)
        y = xf * torch.rsqrt(xf.pow(2).mean(self.dims, keepdim=True) + self.eps)
        weight = self.weight
        if weight is not None:
            y = y * weight.to(compute)
        bias = self.bias
        if bias is not None:
            y = y + bias.to(compute)
        return y.to(x.dtype)  # one rounding, as eager
