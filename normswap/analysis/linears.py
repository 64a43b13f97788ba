"""Linear maps that a model's code applies to its parameters directly, not by calling a module.

``nn.MultiheadAttention`` (and so ``nn.Transformer*``) projects its inputs with
``F.linear(x, self.in_proj_weight, self.in_proj_bias)``, q, k and v stacked in one tensor (or rows of
it, ``w.split([E, 2E])``, for cross-attention) and its output with
``F.linear(y, self.out_proj.weight, self.out_proj.bias)`` without calling ``out_proj``. Custom code does
the same: logits as ``x @ self.tok.weight.T``, a projection kept as a bare ``nn.Parameter`` and applied
with ``x @ self.w``. Such a call is a writer or a reader like any ``nn.Linear``: its weight's rows are
output features, and β and γ fold into it the same way.

A :class:`FunctionalLinear` names one: the parameter holding its weight (with the rows it uses, and
whether it is stored ``[out, in]`` like ``nn.Linear`` or ``[in, out]`` like HF's ``Conv1D``) and the
one holding its bias. Plans refer to it by :attr:`FunctionalLinear.name`, which spells all of that
out, so every edit that names a reader (:class:`~normswap.analysis.plan.FoldEdit`, bias slots, rotations, ...)
applies to it with no table beside the plan:

- ``enc.layers.0.self_attn.in_proj_weight+in_proj_bias``: ``F.linear(x, in_proj_weight, in_proj_bias)``;
- ``dec.layers.0.multihead_attn.in_proj_weight[32:96]+in_proj_bias[32:96]``: rows 32..95 of both;
- ``tok.weight``: ``x @ tok.weight.T`` (the weight as ``nn.Linear`` stores it, no bias);
- ``w_out.T``: ``x @ w_out``, ``w_out`` stored ``[in, out]`` (kind ``conv1d``).

The bias always belongs to the module that owns the weight (its attribute name follows the ``+``).
:func:`linear_at` returns the module or a :class:`LinearView` for any name, so the surgery reads and
writes both alike (a view writes through to the parameter).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

_NAME = re.compile(r"^(?P<weight>[^+\[]+?)(?:\[(?P<lo>\d+):(?P<hi>\d+)\])?(?P<t>\.T)?"
                   r"(?:\+(?P<bias>[^+\[]+?)(?:\[(?P<blo>\d+):(?P<bhi>\d+)\])?)?$")


@dataclass(frozen=True)
class FunctionalLinear:
    """``y = x Wᵀ + b`` computed by code from parameters: which ones, and which rows of them."""

    weight: str  # parameter name
    rows: tuple[int, int] | None  # output features used, as [lo, hi) of the weight's output axis
    transposed: bool  # stored [in, out] (x @ W): kind "conv1d"
    bias: str | None = None  # parameter name, a parameter of the weight's owner
    bias_rows: tuple[int, int] | None = None

    @property
    def kind(self) -> str:
        return "conv1d" if self.transposed else "linear"

    @property
    def owner(self) -> str:
        """The module path that owns the weight (and the bias)."""
        return self.weight.rpartition(".")[0]

    @property
    def name(self) -> str:
        rows = f"[{self.rows[0]}:{self.rows[1]}]" if self.rows else ""
        text = f"{self.weight}{rows}{'.T' if self.transposed else ''}"
        if self.bias is not None:
            brows = f"[{self.bias_rows[0]}:{self.bias_rows[1]}]" if self.bias_rows else ""
            text += f"+{self.bias.rpartition('.')[2]}{brows}"
        return text

    @classmethod
    def parse(cls, name: str) -> FunctionalLinear | None:
        """The functional linear a plan's name spells out, or None (then the name is a module path)."""
        if not any(mark in name for mark in ("+", "[", ".T")):
            return None
        m = _NAME.match(name)
        if m is None:
            return None
        weight = m["weight"]
        owner = weight.rpartition(".")[0]

        def span(lo: str | None, hi: str | None) -> tuple[int, int] | None:
            return None if lo is None else (int(lo), int(hi))

        bias = None if m["bias"] is None else (f"{owner}.{m['bias']}" if owner else m["bias"])
        return cls(weight, span(m["lo"], m["hi"]), m["t"] is not None, bias, span(m["blo"], m["bhi"]))


class LinearView:
    """A :class:`FunctionalLinear` of one model, with the attributes the surgery uses on an ``nn.Linear``.

    ``weight`` and ``bias`` are the parameters themselves, or views of the rows used (writing into a
    view writes the parameter). ``weight_param``/``bias_param`` are always the whole parameters.
    """

    def __init__(self, spec: FunctionalLinear, weight: nn.Parameter, bias: torch.Tensor | None,
                 owner: nn.Module | None = None) -> None:
        self.spec, self.weight_param, self.bias_param, self.owner = spec, weight, bias, owner

    # -- the nn.Linear-like surface
    @property
    def kind(self) -> str:
        return self.spec.kind

    @property
    def out_axis(self) -> int:
        return 1 if self.spec.transposed else 0

    @property
    def weight(self) -> torch.Tensor:
        rows, w = self.spec.rows, self.weight_param
        return w if rows is None else w.narrow(self.out_axis, rows[0], rows[1] - rows[0])

    @property
    def bias(self) -> torch.Tensor | None:
        b, rows = self.bias_param, self.spec.bias_rows
        return b if b is None or rows is None else b.narrow(0, rows[0], rows[1] - rows[0])

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[self.out_axis])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1 - self.out_axis])

    def __repr__(self) -> str:
        return f"LinearView({self.spec.name})"

    def give_bias(self, value: torch.Tensor) -> None:
        """Register ``value`` as the bias parameter of the weight's owner (a bias slot: only where the
        code reads that attribute, e.g. ``nn.MultiheadAttention(bias=False)``'s ``in_proj_bias``)."""
        if self.owner is None or self.spec.bias is None or self.spec.bias_rows is not None:
            raise ValueError(f"`{self.spec.name}` has no bias slot to fill")
        attr = self.spec.bias.rpartition(".")[2]
        self.owner.register_parameter(attr, nn.Parameter(value, requires_grad=self.weight_param.requires_grad))
        self.bias_param = getattr(self.owner, attr)


# Ops that contract a weight operand with data: a Linear map however the code spells it.
CONTRACTION_OPS = {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "mv", "addmm", "addmv", "baddbmm",
                   "addbmm", "einsum", "tensordot", "inner", "_grouped_mm", "grouped_mm"}
# Where those that add a bias take it: (position, keyword).
CONTRACTION_BIAS = {"linear": (2, "bias"), "addmm": (0, "input"), "addmv": (0, "input"), "baddbmm": (0, "input"),
                    "addbmm": (0, "input")}
# Ops that only move, repeat, select or cast the elements of a tensor (recorded names; ``.T`` and ``.mT``
# are recorded by their attribute names): a parameter reaching a contraction through any chain of them is
# still that parameter, laid out another way. An einops ``rearrange`` or ``repeat`` lowers to these.
LAYOUT_OPS = {"T", "mT", "t", "transpose", "permute", "reshape", "view", "contiguous", "clone", "expand", "expand_as",
              "broadcast_to", "unsqueeze", "squeeze", "flatten", "unflatten", "movedim", "moveaxis", "swapaxes",
              "swapdims", "view_as", "reshape_as", "__getitem__", "select", "narrow", "index_select", "to", "type",
              "float", "double", "half", "bfloat16", "type_as", "detach", "repeat", "tile", "flip", "roll"}


class ParamContraction:
    """One contraction op (``einsum``, ``@``, ``bmm``, ``F.linear``, ``addmm``, ...) whose weight operand is a
    stored parameter reached through layout ops (:data:`LAYOUT_OPS`): ``F.linear(h, W.T.contiguous())``,
    ``einsum("bhsd,hdm->bsm", z, W_O)``, ``F.linear(x, experts.down_proj[e])``.

    It is a writer (or reader) like any Linear, but no ``[out, in]`` matrix need exist: which axis of the
    stored parameter becomes which output axis is proved on the traced op
    (:func:`normswap.analysis.dataflow.weight_axes`) and followed back through the layout ops by an index map,
    so a centering edit lands on the stored parameter's own axis. The traced call's plan name is
    ``einsum(blocks.0.attn.W_O)``: every call of one parameter by one op kind is one writer (the experts of a
    fused MoE, called once per routed expert), sharing its edits.
    """

    kind = "contraction"

    def __init__(self, name: str, weight: str, owner: str, op_index: int, weight_operand: int, weight_value: int,
                 bias: str | None = None, bias_operand: int | None = None, bias_value: int | None = None) -> None:
        self.name, self.weight, self.owner = name, weight, owner
        self.op_index, self.weight_operand, self.weight_value = op_index, weight_operand, weight_value
        self.bias, self.bias_operand, self.bias_value = bias, bias_operand, bias_value

    def __repr__(self) -> str:
        return f"ParamContraction({self.name})"


def linear_module_kind(module: object) -> str | None:
    """``linear`` (``nn.Linear``: weight ``[out, in]``), ``conv1d`` (HF's transposed Linear: ``[in, out]``)
    or None. A :class:`LinearView` answers for the functional linear it stands for."""
    if isinstance(module, LinearView):
        return module.kind
    if isinstance(module, ParamContraction):
        return None  # no ``[out, in]`` matrix to fold β or γ into
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return "conv1d"
    if isinstance(module, nn.Linear):
        return "linear"
    return None


def view_of(model: nn.Module, spec: FunctionalLinear) -> LinearView:
    """The :class:`LinearView` of ``spec`` in ``model`` (its parameters looked up by name)."""
    weight = model.get_parameter(spec.weight)
    owner = model.get_submodule(spec.owner) if spec.owner else model
    bias = None
    if spec.bias is not None:
        bias = getattr(owner, spec.bias.rpartition(".")[2], None)
    return LinearView(spec, weight, bias, owner)


def spec_of(model: nn.Module, name: str) -> FunctionalLinear | None:
    """The functional linear ``name`` denotes in ``model``, or None when it is a module path.

    A name with no rows, no transpose and no bias (``tok.weight``: logits as ``x @ tok.weight.T``) is
    told from a module path by what it resolves to in ``model``."""
    spec = FunctionalLinear.parse(name)
    if spec is not None:
        return spec
    module_path, _, attr = name.rpartition(".")
    try:
        owner = model.get_submodule(module_path) if module_path else model
    except AttributeError:
        return None
    return FunctionalLinear(name, None, False) if attr in owner._parameters else None


def linear_at(model: nn.Module, name: str) -> nn.Module | LinearView:
    """The Linear-like module, or :class:`LinearView`, a plan calls ``name``."""
    spec = spec_of(model, name)
    return model.get_submodule(name) if spec is None else view_of(model, spec)


def tensors_by_name(name: str, tensor: Callable[[str], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, bias)`` of a Linear-like reader, read through ``tensor(parameter name)`` (a working
    copy's ``get_parameter``, or a checkpoint's tensors) and cut to the rows a functional linear uses.

    Names only, no model: a bare parameter read as ``x @ p.T`` (no marker in its name) would be taken
    for a module path; it has no bias, so nothing that needs its bias asks."""
    spec = FunctionalLinear.parse(name)
    if spec is None:
        return tensor(f"{name}.weight"), tensor(f"{name}.bias")
    w = tensor(spec.weight)
    if spec.rows is not None:
        w = w.narrow(1 if spec.transposed else 0, spec.rows[0], spec.rows[1] - spec.rows[0])
    if spec.bias is None:
        return w, None
    b = tensor(spec.bias)
    if spec.bias_rows is not None:
        b = b.narrow(0, spec.bias_rows[0], spec.bias_rows[1] - spec.bias_rows[0])
    return w, b


def param_names(model: nn.Module, name: str) -> tuple[str, str]:
    """``(weight, bias)`` parameter names of a Linear-like module or a functional linear (the bias name
    may be one the model has not registered: a bias slot, or none at all)."""
    spec = spec_of(model, name)
    if spec is None:
        return f"{name}.weight", f"{name}.bias"
    return spec.weight, spec.bias if spec.bias is not None else f"{spec.weight}+bias"
