"""``normswap.plan`` and ``normswap.patch``: the in-memory conversion entry points.

``patch`` is transactional: analysis and surgery run on a float64 working copy (float32 where a
float64 copy would not fit in the memory available: :mod:`normswap.memory`, and the report says so);
the user's model is only touched once the converted copy has passed verification, and then only
by copying tensors and swapping the norm modules.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from normswap import inputs, memory, quantizers
from normswap.analysis import precision, trace, trades, walker
from normswap.analysis.linears import linear_at
from normswap.analysis.plan import EXACT_VERDICTS, RESIDUAL_WHY, Plan, SitePlan, attach_plan
from normswap.analysis.planner import analyse
from normswap.analysis.trace import flatten_outputs
from normswap.copying import deepcopy_module
from normswap.errors import ModelRunFailed, NaNOutputs, NormswapError, VerificationFailed, first_line
from normswap.inputs import builder, reach, towers
from normswap.inputs.probe import call_args, held_out_like, special_ids
from normswap.integrations import torch_transformer, wrappers
from normswap.modelinfo import model_device, model_dtype
from normswap.nn.call_args import normalised
from normswap.options import ConvertOptions
from normswap.rotation import carry
from normswap.surgery import beta_placement, calibrate, edits
from normswap.surgery.verify import (
    RANDOM_NOTE,
    compare,
    dtype_error_ratio,
    figures_text,
    gate,
    gate_text,
    precision_limit,
    rounding_error,
    same_draws,
    unseeded_randomness,
)

log = logging.getLogger("normswap")
# how patch measures the working dtype's own error (surgery.verify.rounding_error), for the precision line
OWN_ERROR_HOW = "estimated by one rounding of every module's output"
NOTHING_TO_REDRAW = "the example inputs hold no tensor of data to redraw"



@dataclass
class Report:
    """What ``patch`` did. ``sites[i]`` has ``.name``, ``.verdict``, ``.reason``.

    ``verification`` holds the figures against the original and what they were computed in:
    ``verify_dtype`` (float64 where a float64 working copy fit in memory, else float32:
    :func:`normswap.memory.choose_precision`), ``verify_tolerance`` (the relative output tolerance
    applied, where one was) and ``verify_precision`` (the sentence ``str(report)`` prints)."""

    sites: list[SitePlan] = field(default_factory=list)
    verification: dict[str, Any] = field(default_factory=dict)
    plan: Plan | None = None
    message: str = ""
    changed: bool = False
    calibration: calibrate.CalibrationResult | None = None
    output: str | None = None  # the directory ``convert`` wrote
    output_format: str | None = None  # native | compat
    streamed: bool = False  # written by the low-memory path
    rotation: Any = None  # the normswap.Rotation applied after the conversion (options.rotate)

    def __str__(self) -> str:
        lines = [self.message] if self.message else []
        if self.output is not None:
            lines.append(f"wrote {self.output_format} checkpoint to {self.output}"
                         + (" (streamed)" if self.streamed else ""))
        if self.plan is not None:
            lines.append(self.plan.summary(self.output_format))
            if self.plan.options.get("analysis_inputs"):
                lines.append(f"analysis inputs: {self.plan.options['analysis_inputs']}")
        if self.calibration is not None:
            lines.append(self.calibration.summary())
        if self.verification:
            lines.append(f"verification: {figures_text(self.verification)}")
            if self.verification.get("probe"):
                lines.append(f"verified on: {self.verification['probe']}")
            if self.verification.get("verify_precision"):
                lines.append(f"precision: {self.verification['verify_precision']}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------- checks
def refuse_torchscript(model: object) -> None:
    """A TorchScript module (``torch.jit.script`` or ``torch.jit.trace``) runs its compiled graph: its
    submodules cannot be swapped ("Cannot re-assign modules in a ScriptModule") nor hooked, so normswap
    can neither analyse nor edit it. Refused in one line, with what to do instead."""
    if not isinstance(model, nn.Module):
        return
    for name, module in model.named_modules():
        if isinstance(module, torch.jit.ScriptModule):
            how = "torch.jit.trace" if isinstance(module, torch.jit.TracedModule) else "torch.jit.script"
            where = f"module `{name}` is" if name else f"{type(model).__name__} is"
            raise NormswapError(
                f"{where} a TorchScript module ({how}), whose compiled graph normswap cannot edit; "
                f"patch the eager module first (normswap.patch(model, ...)), then {how.split('.')[-1]} the result")


def preflight(model: nn.Module) -> None:
    """Refuse models normswap cannot edit, before touching anything (a model built under
    ``torch.inference_mode()`` is first given ordinary tensors: :func:`release_inference_tensors`)."""
    if not isinstance(model, nn.Module):
        raise NormswapError(f"expected a torch.nn.Module, got {type(model).__name__}")
    refuse_torchscript(model)
    if torch.is_inference_mode_enabled():
        raise NormswapError("normswap edits the model's weights, which torch.inference_mode() forbids: call it "
                            "outside the `with torch.inference_mode():` block (a model built inside one is fine)")
    release_inference_tensors(model)
    for name, p in model.named_parameters():
        if p.is_meta:
            raise NormswapError(
                f"parameter `{name}` is on the meta device (no data); load real weights first "
                "(e.g. from_pretrained without device_map='meta' or init_empty_weights)")
    peft = wrappers.peft_part(model)
    if peft is not None:
        raise NormswapError(
            f"{peft}; merge the adapters first (model = model.merge_and_unload()) "
            "and convert the merged model, or convert the base model before adding adapters")
    quantized = quantized_weight(model)
    if quantized is not None:
        raise NormswapError(f"{quantized}; convert the full-precision model, then quantize the result")
    for name, p in model.named_parameters():
        if not all_finite(p):
            raise NormswapError(f"parameter `{name}` contains NaN or inf values; fix the checkpoint first")


def release_inference_tensors(model: nn.Module) -> list[str]:
    """Give a model built under ``torch.inference_mode()`` ordinary tensors; returns the names replaced.

    Its parameters and buffers are then inference tensors, which outside that mode can be neither
    written in place nor tracked (no version counter: "Inference tensors do not track version
    counter"), and the conversion does both: it proves the user's weights untouched until the commit,
    then writes them. Each is replaced by an ordinary copy with the same values, one copy per tensor
    object (a tie stays a tie); a no-op for any other model.
    """
    found = [(mod, kind, name, t) for mod in model.modules(remove_duplicate=False)
             for kind in ("_parameters", "_buffers") for name, t in getattr(mod, kind).items()
             if t is not None and t.is_inference()]
    if not found:
        return []
    copies: dict[int, torch.Tensor] = {}
    with torch.inference_mode(False):
        for mod, kind, name, t in found:
            if id(t) not in copies:
                copy = t.detach().clone()
                copies[id(t)] = nn.Parameter(copy, requires_grad=t.requires_grad) if kind == "_parameters" else copy
            getattr(mod, kind)[name] = copies[id(t)]
    replaced = {id(c) for c in copies.values()}
    return [n for n, t in [*model.named_parameters(), *model.named_buffers()] if id(t) in replaced]
# floating dtypes of quantized storage: no float64 surgery can be written back into them
_QUANTIZED_FLOATS = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                                                  "float8_e8m0fnu", "float4_e2m1fn_x2") if hasattr(torch, n)}


def quantized_weight(model: nn.Module) -> str | None:
    """Why ``model`` holds quantized weights (None when it does not), judged by the tensors, not by class
    names: a parameter that is not a float (int8 ``Int8Params``, packed 4-bit ``Params4bit``), a float8 one,
    a quantized tensor (``torch.ao``'s ``qint8``) or a tensor subclass carrying quantization state (torchao),
    an integer buffer named like a weight (GPTQ/AWQ ``qweight``), or a ``torch.ao`` quantized module's packed
    parameters. A module whose class name says "Quant" but computes on float weights (I-BERT with
    ``quant_mode=False``: ``F.linear`` on a float ``weight``) is not quantized and converts."""
    for name, p in model.named_parameters():
        if getattr(p, "is_quantized", False) or not p.is_floating_point() or p.dtype in _QUANTIZED_FLOATS:
            return f"parameter `{name}` is quantized ({p.dtype})"
        if type(p.data) not in (torch.Tensor, nn.Parameter) and any(
                hasattr(p.data, a) for a in ("quant_state", "tensor_impl", "layout_tensor", "qdata", "scale")):
            return f"parameter `{name}` is a quantized tensor ({type(p.data).__name__})"
    for name, b in model.named_buffers():
        leaf = name.rpartition(".")[2]
        if b.is_quantized or (not b.is_floating_point() and "weight" in leaf and b.dim() >= 2):
            return f"buffer `{name}` holds quantized weights ({b.dtype})"
    for name, module in model.named_modules():
        if hasattr(module, "_packed_params"):  # torch.ao.nn.quantized Linear/Conv: weights packed, not parameters
            return f"module `{name}` holds packed quantized weights ({type(module).__name__})"
    return None


def all_finite(t: torch.Tensor) -> bool:
    """Whether every entry of the floating tensor ``t`` is finite.

    One reduction pass without a temporary: ``aminmax`` propagates NaN, and any ±inf entry is the
    minimum or the maximum, so both are finite exactly when every entry is. ``isfinite(t).all()``
    gives the same answer but writes a boolean tensor the size of ``t`` first: about 5x slower over
    GPT-2-124M's parameters on the 2-core CI machine."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t.detach())
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """Analyse in eval mode (dropout breaks centering), then restore every module's own flag.

    PyTorch's fused attention paths are off meanwhile (:func:`torch_transformer.python_forwards`): the
    calibration and verification forwards run the Python code the analysis traced."""
    flags = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch_transformer.python_forwards():
            yield
    finally:
        for m, flag in flags.items():
            m.training = flag


HALF_DTYPES = (torch.float16, torch.bfloat16)


def working_precision(model: nn.Module, requested: str = "auto") -> memory.Precision:
    """The dtype :func:`working_copy` computes in (analysis, probes, verification) and why.

    :func:`normswap.memory.choose_precision` on the model's size, dtype and the memory free where it
    lives now (the model's own bytes count as part of the peak): float64 where the predicted peak with
    a float64 copy fits, so exactness is judged against float64; otherwise float32 for float32 and half
    models (a CPU has no fast half-precision matmul), or the model's own dtype where even a float32
    copy of a half model would not fit. Every edit still upcasts each tensor to float64
    (:mod:`normswap.surgery`); the result is cast back to the model's dtype once, and ``patch``
    measures the original and the converted model in their own dtype as well.
    """
    dtype = model_dtype(model)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    device = params[0].device if params else torch.device("cpu")
    return memory.choose_precision(numel, dtype, requested, available=memory.device_memory(device),
                                   resident=numel * dtype.itemsize, device_type=device.type)


def working_copy(model: nn.Module, target: torch.dtype) -> nn.Module:
    """A copy of ``model`` to analyse and edit, in ``target`` (:func:`working_precision`).

    Modules and buffers are deep-copied; parameters are not, unless cast: a parameter already in the
    working dtype is a new ``Parameter`` over the *model's* storage. The analysis and the reference
    forwards only read it, and :func:`own_written` gives every parameter the surgery writes its own
    storage before the first edit (:func:`check_untouched` checks nothing else was written). On a
    float64 GPT-2 that copies 75M of its 124M parameters, and the commit then adopts them without a
    second copy. Peak memory: the model plus the cast copy (none for a float32 model worked on in
    float32, beyond the tensors the surgery writes).
    """
    cast = target != model_dtype(model)

    def param(p: nn.Parameter) -> nn.Parameter:
        data = p.detach()
        if cast and data.is_floating_point() and data.dtype != target:
            data = data.to(target)  # a new tensor: the cast is the copy
        return nn.Parameter(data, requires_grad=p.requires_grad)

    memo: dict[int, Any] = {id(p): param(p) for p in model.parameters()}  # tied parameters stay tied
    work = deepcopy_module(model, memo)
    if cast:
        work.to(target)  # the floating buffers (parameters are cast already)
    if target == torch.float64:
        _experts_in_float64(work)
    work.eval()
    return work


# transformers' fused-experts implementations that run in float64 on any device (loops of F.linear; bmm)
_FLOAT64_EXPERTS = ("eager", "batched_mm")


def _experts_in_float64(work: nn.Module) -> None:
    """Switch a float64 working copy's fused MoE experts to transformers' ``eager`` implementation where
    the model's own (``grouped_mm``, the default; fp8/deepgemm kernels) has no float64 kernel, so a MoE
    model is analysed and verified in float64 rather than falling back to float32. Only the copy's own
    (deep-copied) config changes: the user's model keeps its setting. :func:`experts_note` says so."""
    get = getattr(work, "get_experts_implementation", None)
    if get is None or not callable(get):
        return
    try:
        current = get()
    except (AttributeError, TypeError):
        return
    if any(v is not None and v not in _FLOAT64_EXPERTS for v in current.values()):
        work.set_experts_implementation({k: v if v in _FLOAT64_EXPERTS or v is None else "eager"
                                         for k, v in current.items()})


def experts_note(model: nn.Module, work: nn.Module) -> str:
    """What :func:`_experts_in_float64` changed in ``work``, as a clause for the precision line
    (empty when nothing): ``fused MoE experts run with experts_implementation='eager' in the float64
    copy ('grouped_mm' has no float64 kernel; the model keeps 'grouped_mm')``."""
    try:
        before, after = model.get_experts_implementation(), work.get_experts_implementation()
    except (AttributeError, TypeError):
        return ""
    changed = sorted({before[k] for k in before if after.get(k) != before[k]})
    if not changed:
        return ""
    was = ", ".join(f"'{v}'" for v in changed)
    return (f"fused MoE experts run with experts_implementation='eager' in the float64 copy ({was} has no "
            f"float64 kernel; the model keeps {was})")


def _storage(t: torch.Tensor) -> int:
    """The address of ``t``'s storage, 0 when it has none to share: empty, or not strided (Whisper keeps
    its alignment heads in a sparse buffer, which has no storage of its own)."""
    return t.untyped_storage().data_ptr() if t.numel() and t.layout == torch.strided else 0


def own_written(work: nn.Module, model: nn.Module, plan_: Plan) -> None:
    """Before surgery: untie without copying, then give each parameter the surgery will write in place
    its own storage wherever ``model`` or another parameter of ``work`` still uses it.

    An untied head is a new ``Parameter`` over the tied tensor: the embedding, which is written, gets
    the copy; the head keeps the original values it needs (one copy where untie-then-center made two).
    The copy replaces the parameter wherever a module registers it; a module that reads it through a
    plain attribute would still see the old values, so verification would fail, not pass wrongly.
    """
    for u in plan_.unties:
        tied = getattr(work.get_submodule(u.module), u.attr)
        edits.untie(work, u, tied.detach())
    if plan_.unties:
        edits.mark_untied(work)
    users: dict[int, set[int]] = {}  # storage -> ids of the tensors on it (model and work)
    for t in (*model.parameters(), *model.buffers(), *work.parameters()):
        users.setdefault(_storage(t), set()).add(id(t))
    registrations: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in work.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                registrations.setdefault(id(p), []).append((module, attr))
    for name in sorted(edits.written_parameters(plan_, work)):
        p = work.get_parameter(name)
        key = _storage(p)
        if key == 0 or users.get(key, set()) <= {id(p)}:
            continue  # already its own
        own = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        for module, attr in registrations.pop(id(p), []):  # a tie kept by the plan stays a tie
            module._parameters[attr] = own
        users[key].discard(id(p))


def versions(model: nn.Module) -> dict[str, int]:
    """The in-place write counter of every parameter of ``model`` (shared with any tensor on it)."""
    return {name: p._version for name, p in model.named_parameters(remove_duplicate=False)}


def check_untouched(model: nn.Module, before: dict[str, int]) -> None:
    """Refuse to go on if anything wrote a parameter of the user's model before the commit.

    The working copy shares the user's tensors that the plan does not edit (:func:`working_copy`), so
    this check (PyTorch's per-tensor in-place write counter, which every view and ``detach()`` of a
    tensor shares) is what shows that the analysis and the surgery wrote none of them. A failure is
    a normswap bug, typically an edit that writes a parameter :func:`surgery.written_parameters`
    does not list."""
    changed = [n for n, v in versions(model).items() if before.get(n, v) != v]
    if changed:
        raise NormswapError(
            f"internal error: `{changed[0]}` of your model was written in place before the commit "
            "(normswap edits only its own copies; is an edit missing from edits.written_parameters?); "
            "the model may be modified. Please report this model")


# ---------------------------------------------------------------------------------- analysis
@dataclass
class _Analysis:
    plan: Plan
    sites: dict[str, walker.NormSite]
    graph: trace.Graph
    args: tuple
    kwargs: dict
    held: dict[str, int] = field(default_factory=dict)  # the model's downcasts held in the traced run
    precision: memory.Precision | None = None  # what the copy computes in, and why (None: a streaming proxy)
    random: bool = False  # the model drew random numbers in eval mode (every compared forward is seeded)

    @property
    def hold(self) -> bool:
        """Whether every later forward of the working copy holds the model's casts (:func:`running`)."""
        return bool(self.held)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Run a float64 copy with float64 factory defaults (HF code builds mask constants with
    ``torch.full((), finfo(dtype).min)``, which overflows a float32 default)."""
    previous = torch.get_default_dtype()
    if dtype in (torch.float32, torch.float64):
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def running(dtype: torch.dtype, hold: bool) -> Iterator[None]:
    """How every forward of a working copy in ``dtype`` runs: factory defaults in ``dtype``
    (:func:`default_dtype`) and, for a model whose traced run cast down inside (``hold``), those casts
    held at ``dtype`` (:mod:`normswap.analysis.precision`)."""
    with default_dtype(dtype), precision.holding(dtype, hold):
        yield


def _run_trace(work: nn.Module, args: tuple, kwargs: dict) -> trace.Graph:
    """The traced analysis run, with the model's downcasts held at the copy's dtype (a model that
    computes a norm in float32 runs in a float64 copy; ``graph.held_casts`` says what was held)."""
    dtype = model_dtype(work)
    try:
        with default_dtype(dtype), same_draws(work) as draws:  # seeded as every verification forward is
            graph = trace.record(work, args, kwargs, snapshot=walker.candidates(work),
                                 hold=precision.HoldCasts(dtype))
        graph.draws_random = draws.drew
        return graph
    except NormswapError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model does not run on these inputs in this dtype
        raise ModelRunFailed(
            f"could not run {type(work).__name__}.forward on the example inputs ({type(exc).__name__}: "
            f"{first_line(exc, 200)}); pass example_inputs=(tensor, ...) or a dict of kwargs that the model accepts"
        ) from exc


def _identify_sites(work: nn.Module, args: tuple, kwargs: dict) -> tuple[walker.WalkResult, trace.Graph]:
    graph = _run_trace(work, args, kwargs)
    nan = next((k for k, t in flatten_outputs(graph.output_object)
                if (t.is_floating_point() or t.is_complex()) and bool(t.isnan().any())), None)
    if nan is not None:  # nothing can be identified, fitted or verified on NaN (it compares as "no error")
        raise NaNOutputs(
            f"{type(work).__name__} outputs NaN in `{nan}` on the example inputs, before any change (inputs "
            "that do not fit the model, or broken weights); pass example_inputs=(tensor, ...) or a dict of "
            "kwargs on which the original model's outputs are finite")
    return walker.find_sites(work, graph), graph


def analysed_copy(model: nn.Module, args: tuple, kwargs: dict,
                  opts: ConvertOptions) -> tuple[nn.Module, tuple, dict, _Analysis]:
    """The working copy, the inputs cast to its dtype, and its analysis (:func:`analyse_copy`).

    In :func:`working_precision`'s dtype (float64 where it fits, or as ``opts.verify_dtype`` says).
    Where the model's own code cannot run in float64 (it raises: a dtype check, a float32-only kernel)
    or computes NaN there but not in its own dtype (CANINE's local attention does), the copy is in the
    model's dtype, verified at that dtype's tolerance, and the plan says so
    (``options["working_dtype"]``), unless float64 was asked for: that is refused. Failing in its own
    dtype too is the inputs' or the weights' fault, and only then does the error say so.
    """
    chosen = working_precision(model, opts.verify_dtype)
    work = working_copy(model, chosen.dtype)
    wargs, wkwargs = inputs.cast_inputs(args, kwargs, chosen.dtype)
    try:
        an = analyse_copy(work, wargs, wkwargs, opts)
        an.precision = chosen
        note = experts_note(model, work)
        if note:  # the manifest and the precision line say the copy ran other expert code than the model
            an.plan.options["experts_implementation"] = note
            an.precision = dataclasses.replace(chosen, reason="; ".join(r for r in (chosen.reason, note) if r))
        place_beta(work, an, opts)
        return work, wargs, wkwargs, an
    except (NaNOutputs, ModelRunFailed) as exc:
        if chosen.dtype == model_dtype(model):
            raise
        in_precise = exc
    del work
    dtype = model_dtype(model)
    work = working_copy(model, dtype)
    wargs, wkwargs = inputs.cast_inputs(args, kwargs, dtype)
    try:
        an = analyse_copy(work, wargs, wkwargs, opts)
    except NaNOutputs:
        if isinstance(in_precise, NaNOutputs):
            raise in_precise from None
        raise
    name = type(model).__name__
    if isinstance(in_precise, NaNOutputs):
        why = f"{name} computes NaN in {chosen.name}, not in its own dtype"
    else:
        cause = in_precise.__cause__ if in_precise.__cause__ is not None else in_precise
        why = f"{name} cannot run in {chosen.name} ({type(cause).__name__}: {first_line(cause, 120)})"
    if opts.verify_dtype == "float64":
        raise NormswapError(f"verify_dtype='float64' is impossible: {why}; use verify_dtype='auto' to verify "
                            "it in its own dtype") from in_precise
    an.plan.options["working_dtype"] = f"{str(dtype).removeprefix('torch.')}: {why}"
    an.precision = chosen.with_reason(dtype, why)
    place_beta(work, an, opts)
    return work, wargs, wkwargs, an


def place_beta(work: nn.Module, an: _Analysis, opts: ConvertOptions) -> None:
    """:func:`normswap.surgery.beta_placement.place_beta` on the plan, from the working copy's (unedited) weights.

    Not part of :func:`analyse_copy`: the streaming path analyses random-weight proxies and takes this
    decision later, on the checkpoint's tensors."""
    keep = dict.fromkeys(torch_transformer.fused_norm_paths(work), torch_transformer.FUSED_WHY)
    keep |= beta_placement.head_readers(an.plan, work)  # a head class: its base model stays whole
    beta_placement.place_beta(an.plan, lambda name: work.get_parameter(name).detach(),
                              lambda norm: an.sites[norm].beta(work.get_submodule(norm)),
                              opts.beta_placement_for(None), keep)
    beta_placement.place_residual(an.plan, opts.beta_placement_for(None), work, keep)


def find_norms(model: nn.Module, example_inputs: inputs.ExampleInputs = None) -> walker.WalkResult:
    """The walker alone: every LayerNorm-like module with its identified flavour (model untouched)."""
    preflight(model)
    args, kwargs = inputs.resolve(model, example_inputs)
    with eval_mode(model):
        dtype = working_precision(model).dtype
        try:
            return _identify_sites(working_copy(model, dtype), *inputs.cast_inputs(args, kwargs, dtype))[0]
        except (NaNOutputs, ModelRunFailed):
            if dtype == model_dtype(model):
                raise
        dtype = model_dtype(model)  # as analysed_copy falls back to
        return _identify_sites(working_copy(model, dtype), *inputs.cast_inputs(args, kwargs, dtype))[0]


def analyse_copy(work: nn.Module, args: tuple, kwargs: dict, opts: ConvertOptions, *,
                 streamed: bool = False) -> _Analysis:
    """Trace ``work`` once on the inputs, find its norms and analyse them into a plan (no verdicts yet).

    Shared by ``plan``/``patch`` and the streaming converter, which runs it on a reduced-depth proxy
    (``streamed=True``: a ``quantizer`` whose options for the model's kind need the whole model is refused).
    """
    found, graph = _identify_sites(work, args, kwargs)

    chosen = {"untie": opts.untie_used, "stem_centering": opts.stem_centering_used}
    given = {name: getattr(opts, name) for name in quantizers.FIELDS}
    engine = dict(given)  # the planner's writer_centering, per_norm_centering, mean_carry

    def planned(keep_gamma: dict[str, str] | None = None) -> Plan:
        return analyse(work, graph, found.sites, fold_gamma=opts.folds_gamma,
                       per_norm_centering=engine["per_norm_centering"], mean_carry=engine["mean_carry"],
                       carry_multiple=opts.carry_multiple, rms_norms=found.skipped, bias_slots=opts.bias_slots,
                       layer_scale=opts.layer_scale, keep_gamma=keep_gamma,
                       writer_centering=engine["writer_centering"],
                       mode="all" if opts.defer_approximate else opts.mode, **chosen)

    record = None
    if opts.quantizer is not None:
        # the engine's options depend on the model's kind, read from a plan made with the defaults
        engine.update(quantizers.FIELDS)
        plan = planned()
        record = quantizers.resolve(opts.quantizer, quantizers.model_kind(plan), given, opts.quantizer_overrides)
        if streamed:
            quantizers.check_streamed(record)
        if quantizers.planner_values(record, given) != engine:
            engine.update(quantizers.planner_values(record, given))
            plan = planned()
    else:
        plan = planned()
    # defaults chosen for what quantizers see, each planned the other way where the plan leaves norms approximate
    # and kept only where that makes more norms exact: the stem op (SAM2's Hiera adds its position parameter where
    # the op cannot reach it) and a kept tie (BLOOM: the op at the tied embedding leaves none for the stream its
    # embedding LayerNorm starts)
    fallbacks = (("stem_centering", "weights", opts.stem_centering is None and chosen["stem_centering"] == "op"),
                 ("untie", True, chosen["untie"] is None and _has_ties(work)))
    for option, other, applies in fallbacks:
        if applies and _exact_count(plan) < len(plan.sites):
            default, chosen[option] = chosen[option], other
            replanned = planned()
            if _exact_count(replanned) > _exact_count(plan):
                plan = replanned
            else:
                chosen[option] = default
    if opts.rotate not in (None, "none") and not opts.fold_gamma:
        # the rotation asked for the fold, so only where it will turn: the norms of every stream it will leave
        # alone are planned again as without it (γ and β where a conversion without rotate puts them)
        from normswap.rotation.rotate import unturned_norms

        decide_verdicts(plan, opts.mode)
        keep = unturned_norms(work, plan, opts.rotate_output)
        if keep:
            plan = planned(keep)
    # where the centering may leave a table's row means (a proof by probing the unedited copy, in float64)
    plan.constant_trades = trades.find_trades(work, plan, args, kwargs, lambda: same_draws(work)) \
        if opts.trade_constants else []
    plan.options["trade_constants"] = opts.trade_constants  # the manifest says whether trades were looked for
    plan.skipped = [{"name": s.path, "class": s.class_name, "reason": s.reason} for s in found.skipped]
    plan.options["already_converted"] = bool(found.converted) and not found.sites
    if record is not None:
        plan.options["quantizer"] = record
    return _Analysis(plan, {s.path: s for s in found.sites}, graph, args, kwargs, dict(graph.held_casts),
                     random=graph.draws_random)


def _has_ties(model: nn.Module) -> bool:
    """Does one parameter sit under two names (a head tied to an embedding)?"""
    return len({id(p) for p in model.parameters()}) < sum(1 for _ in model.named_parameters(remove_duplicate=False))


def _exact_count(plan: Plan) -> int:
    return sum(sp.verdict in EXACT_VERDICTS for sp in plan.sites)


def decide_verdicts(plan: Plan, mode: str) -> None:
    """Mark which sites convert under ``mode``: exact ones always, approximate ones in auto/all."""
    for sp in plan.sites:
        if sp.verdict in EXACT_VERDICTS:
            sp.convert = True
        elif sp.verdict == "approximate":
            sp.convert = mode in ("auto", "all")
    converted = {sp.name for sp in plan.sites if sp.convert}
    plan.centered_readers = [r for r in plan.centered_readers if r.site in converted]
    plan.options["mode"] = mode


def unwrap(model: nn.Module, example_inputs: inputs.ExampleInputs,
           opts: ConvertOptions) -> tuple[nn.Module, ConvertOptions, str]:
    """What to convert: ``model`` itself, the module inside a ``torch.compile``'d one, or the
    transformers model inside a wrapper such as a ``SentenceTransformer``
    (:mod:`normswap.integrations.wrappers`), with the wrapper's tokenizer as the default
    ``tokenizer``. Returns (model to convert, options, a note for the report or "")."""
    refuse_torchscript(model)  # before looking inside it for a wrapped model
    notes = []
    while True:
        if example_inputs is not None and not wrappers.is_compiled(model):
            break  # inputs given for the object itself: convert it as it is
        try:
            found = wrappers.inner_model(model)
        except ValueError as exc:
            raise NormswapError(str(exc)) from None
        if found is None:
            break
        if opts.tokenizer is None and found.tokenizer is not None:
            opts = opts.replace(tokenizer=found.tokenizer)
        notes.append(f"{found.wrapper}: converted its model `{found.path}` in place")
        model = found.model
    return model, opts, "; ".join(notes)


def plan(model: nn.Module, example_inputs: inputs.ExampleInputs = None, *,
         options: ConvertOptions | None = None, **keywords: Any) -> Plan:
    """Dry run: the per-norm verdicts and every edit ``patch`` would make. The model is untouched.

    Takes ``patch``'s options (a :class:`~normswap.ConvertOptions`, or its fields as keywords) so
    one set serves both; calibration, verify and the like do not change the plan. An unknown
    keyword is an error.
    """
    opts = ConvertOptions.build(options, **keywords)
    model, opts, _ = unwrap(model, example_inputs, opts)
    preflight(model)
    untouched = versions(model)
    route, kwargs = None, {}
    built = example_inputs is None and inputs.is_hf_model(model)
    refused = ""
    with eval_mode(model):
        try:
            args, kwargs = inputs.resolve(model, example_inputs)
            route, called = reach.route(model, kwargs) if built else (None, None)
            result = None
            if route is not None:  # as patch does: sub-runs for the norms the built inputs do not reach
                result, refused = _planned_view(model, route, opts)
                route = route if result is not None else None
            if result is None:
                result = analysed_copy(model, args, kwargs, opts)[3]
                decide_verdicts(result.plan, opts.mode)
        except ModelRunFailed as exc:  # as patch does: each tower on inputs of its own
            route, called = _tower_route(model, exc, built)
            result = analysed_copy(towers.view(model, route), (), route.example_inputs(), opts)[3]
            decide_verdicts(result.plan, opts.mode)
            route.check(result.plan, model)
    check_untouched(model, untouched)
    if route is None and built:
        result.plan.options["analysis_inputs"] = inputs.describe_built(model, kwargs)
    if built:
        _say_reach(result.plan, model, route, kwargs, called, refused)
    return result.plan


def _tower_route(model: nn.Module, exc: ModelRunFailed, built: bool) -> tuple[towers.Route, set[str] | None]:
    """No whole-model layout ran: the per-tower route (:func:`towers.fallback`) with sub-runs for the norms its
    runs do not reach, and the modules its runs call; ``exc`` raised again where the inputs were the user's
    or the model has no towers."""
    route = towers.fallback(model, exc) if built else None
    if route is None:
        raise exc
    sub, called = reach.route(model, {}, route)
    return sub or route, called


def _planned_view(model: nn.Module, route: towers.Route, opts: ConvertOptions) -> tuple[Any, str]:
    """The analysis of the view making ``route``'s runs, checked; ``(None, why)`` where the analysis or the check
    refuses the sub-runs (``patch`` then converts without them)."""
    try:
        result = analysed_copy(towers.view(model, route), (), route.example_inputs(), opts)[3]
        decide_verdicts(result.plan, opts.mode)
        route.check(result.plan, model)
    except NormswapError as exc:  # a sub-run the analysis cannot trace either: as patch, planned without them
        return None, first_line(exc, 300)
    return result, ""


def _say_reach(plan_: Plan, model: nn.Module, route: towers.Route | None, kwargs: dict[str, Any],
               called: set[str] | None, refused: str = "") -> None:
    """Name, in ``plan_``, the input that would reach each norm still not called (``reach.say_missing``; the
    runs called the modules in ``called``), and why the sub-runs were dropped where they were refused."""
    given = route.example_inputs() if route is not None else kwargs
    if refused:
        plan_.options["analysis_inputs"] = (plan_.options.get("analysis_inputs") or "") + \
            f"; converted without sub-runs ({refused})"
    reach.say_missing(plan_, model, called, {k.rpartition(towers.SEP)[2]: v for k, v in given.items()})


# ---------------------------------------------------------------------------------- patch
@contextlib.contextmanager
def _capture(modules: dict[str, nn.Module]) -> Iterator[dict[str, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """Record (input, output) of each named module during the forwards run inside the block: copies, since
    the model may change either in place afterwards (``x = norm(h); x += pos``)."""
    seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {k: [] for k in modules}
    handles = []
    for name, module in modules.items():
        def hook(mod, args, kwargs, output, name=name):  # noqa: ANN001
            x = args[0] if args else next(iter(kwargs.values()))
            if getattr(mod, "centers_input", False):  # what its RMS reads (the op a pre-hook was before round 58)
                x = edits.center_last(x)
            seen[name].append((x.detach().clone(), normalised(output).detach().clone()))
        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def patch(model: nn.Module, example_inputs: inputs.ExampleInputs = None, *,
          options: ConvertOptions | None = None, on_commit: Callable[[nn.Module], object] | None = None,
          **keywords: Any) -> Report:
    """Convert ``model``'s LayerNorms to :class:`normswap.RMSNorm`, in place, verified.

    The pipeline behind :func:`normswap.patch` (:mod:`normswap.api`, where the arguments are
    documented), which passes ``on_commit``: called with the converted model (the one inside a
    wrapper) once it is committed.

    The steps, on a working copy (:func:`analysed_copy`): analyse and decide verdicts; run the unseen
    probe on the original; edit the weights and swap the exact norms; calibrate and swap the
    approximate ones; verify; then, only if verification passed, commit into ``model``. Any error
    before the commit leaves ``model`` as it was.
    """
    opts = ConvertOptions.build(options, **keywords)
    model, opts, wrapped = unwrap(model, example_inputs, opts)
    built = example_inputs is None and inputs.is_hf_model(model)
    route, refused, called = None, "", None
    try:
        st = _start(model, example_inputs, opts)
        route, called = None, None
        if built:  # its run of the model on the built inputs is the original's, in its own dtype: kept
            with builder.keeping_runs(model, lambda: same_draws(model), on=st.kwargs) as trial:
                route, called = reach.route(model, st.kwargs)
            st.own_run = trial.output_on(st.kwargs)
        if route is not None:  # norms the built inputs do not reach: sub-runs join the whole-model run
            plain = st
            try:
                st = _start(towers.view(model, route), route.example_inputs(), opts)
                committed = _convert(st, lambda plan_: route.check(plan_, model))
            except (NormswapError, torch.linalg.LinAlgError) as exc:  # model untouched: convert without them
                refused, route, st = first_line(exc, 300), None, plain
                committed = _convert(st)
        else:
            committed = _convert(st)
    except ModelRunFailed as exc:  # no whole-model layout ran: each tower on inputs of its own, if it has towers
        route, called = _tower_route(model, exc, built)
        st = _start(towers.view(model, route), route.example_inputs(), opts)
        committed = _convert(st, lambda plan_: route.check(plan_, model))
    if built and st.an is not None:
        _say_reach(st.plan, model, route, st.kwargs, called, refused)
    if not committed:
        return st.nothing
    attach_plan(model, st.plan)
    carry.mark_bases(model)  # adapters attached later act on the edited Linears as on the original's
    if on_commit is not None:
        on_commit(model)
    return _report(st, wrapped)


def _convert(st: _Patching, check: Callable[[Plan], None] | None = None) -> bool:
    """:func:`patch`'s steps on ``st``; False when there is nothing to do (``st.nothing`` says why).
    ``check``: called on the plan before any edit, may refuse it (the per-tower route's conditions)."""
    model = st.model
    with eval_mode(model):
        st.nothing = _analyse(st)
        if st.nothing is not None:
            return False
        if check is not None:
            check(st.plan)
        _run_unseen_probe(st)
        _edit_weights(st)
        _swap(st, [sp for sp in st.todo if sp.verdict != "approximate"])  # approximate ones fit around them
        _calibrate_approximate(st)
        _fold_residual_beta(st)
        check_untouched(model, st.untouched)  # the surgery is done: it wrote only its own tensors
        _verify(st)
        report_warnings(st.plan, st.todo)
        check_untouched(model, st.untouched)
        _commit_verified(st)
    return True


@dataclass
class _Patching:
    """What travels between :func:`patch`'s steps."""

    model: nn.Module  # the user's model: read until the commit, written only by it
    opts: ConvertOptions
    example_inputs: inputs.ExampleInputs  # as the user gave them (None: built for a transformers model)
    args: tuple  # the resolved inputs, in the model's dtype
    kwargs: dict
    user_dtype: torch.dtype
    training: dict[str, bool]  # each module's train/eval flag, restored by the commit
    untouched: dict[str, int]  # the model's tensor versions: proof that only the commit writes
    work: nn.Module | None = None  # the working copy that the surgery edits
    wargs: tuple = ()  # the inputs in the working dtype
    wkwargs: dict = field(default_factory=dict)
    an: _Analysis | None = None
    work_dtype: torch.dtype = torch.float64
    todo: list[SitePlan] = field(default_factory=list)  # the norms this mode converts
    reference: Any = None  # the original's outputs on the analysis inputs
    probe: inputs.Probe | None = None  # the unseen verification probe, and the original's outputs on it
    probe_reference: Any = None
    probe_failed: str = ""  # why the probe did not run, when it did not
    own_run: Any = None  # the original's outputs on (args, kwargs) in its own dtype, kept from the route check
    own_error: float | None = None  # below float64: the original's error from the working dtype's rounding alone
    originals: dict[str, nn.Module] = field(default_factory=dict)  # the working copy's norms before the swap
    new_modules: dict[str, nn.Module] = field(default_factory=dict)  # the RMSNorms swapped in
    residual_shifts: dict[str, torch.Tensor] = field(default_factory=dict)  # bias folded out of each norm (float64)
    calib: calibrate.CalibrationResult | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    dtype_note: str = ""  # what the cast back to the model's dtype costs, when measured
    nothing: Report | None = None  # the Report when there is nothing to convert

    @property
    def plan(self) -> Plan:
        return self.an.plan

    @property
    def approximate(self) -> list[SitePlan]:
        return [sp for sp in self.todo if sp.verdict == "approximate"]

    @property
    def measure_cast(self) -> bool:
        """Whether the cast back to the model's own dtype is measured (the copy ran in another one). Not
        for a model that draws random numbers in eval mode: the same seed draws other numbers in another
        dtype (ViT-MAE's ``torch.rand`` noise follows the default dtype), so the figure would measure two
        different random masks, not the cast."""
        return self.user_dtype != self.work_dtype and self.opts.verify and not self.an.random


def _start(model: nn.Module, example_inputs: inputs.ExampleInputs, opts: ConvertOptions) -> _Patching:
    """Refuse what cannot be converted, resolve the inputs, and note what the commit must restore."""
    preflight(model)
    if opts.online_block is not None:  # a block no Linear input could take: refused before the conversion
        from normswap.rotation.rotate import refuse_unusable_block

        refuse_unusable_block(model, opts.online_block)
    args, kwargs = inputs.resolve(model, example_inputs)
    return _Patching(model, opts, example_inputs, args, kwargs, user_dtype=model_dtype(model),
                     training={name: m.training for name, m in model.named_modules()},
                     untouched=versions(model))


def _analyse(st: _Patching) -> Report | None:
    """The working copy, analysed, with verdicts for the mode; a Report when there is nothing to do."""
    st.work, st.wargs, st.wkwargs, st.an = analysed_copy(st.model, st.args, st.kwargs, st.opts)
    st.work_dtype = model_dtype(st.work)
    plan_ = st.plan
    if st.example_inputs is None and inputs.is_hf_model(st.model):  # what normswap built, and which towers it reached
        plan_.options["analysis_inputs"] = inputs.describe_built(st.model, st.kwargs)
    decide_verdicts(plan_, st.opts.mode)
    if plan_.options.get("already_converted"):
        return Report([], {}, plan_, "model is already converted by normswap; nothing to do")
    if not plan_.sites and not plan_.rms_folds:
        kept = plan_.options.get("gamma_kept") or {}  # RMS norms only, on streams a rotation would leave alone
        why = (f"; nothing to rotate either, so every RMS norm keeps γ ({next(iter(kept.values()))})"
               if kept else "")
        return Report([], {}, plan_, f"no LayerNorm found; nothing to do{why}")
    st.todo = [sp for sp in plan_.sites if sp.convert]
    if not st.todo and not plan_.rms_folds:  # fold_gamma on an already-RMS model still has work
        return Report(plan_.sites, {}, plan_, "no LayerNorm can be converted in this mode; model unchanged")
    st.reference = st.an.graph.output_object
    del st.an.graph  # free the recorded activations
    return None


def _run_unseen_probe(st: _Patching) -> None:
    """The original's outputs on a second, unseen probe: it guards against a plan that only fits the
    inputs the analysis ran on. A transformers model analysed on inputs normswap built gets the built-in
    probe (real text where the tokenizer is known: :func:`inputs.verification_probe`); a model given
    ``example_inputs`` (every custom model) gets those inputs redrawn from another seed, same shapes
    (:func:`normswap.inputs.probe.held_out_like`). Below float64, also what the working dtype's rounding
    alone costs the original on those inputs (:func:`surgery.verify.rounding_error`), from which the
    exactness tolerance is derived."""
    if not st.opts.verify:
        return
    if st.example_inputs is None:
        st.probe = inputs.verification_probe(st.work, st.opts.tokenizer)
    else:
        st.probe = held_out_like(st.wargs, st.wkwargs, keep_ids=special_ids(st.work))
        if st.probe is None:
            st.probe_failed = NOTHING_TO_REDRAW
    if st.probe is not None:
        try:
            st.probe_reference = _forward(st, st.probe.kwargs)
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - e.g. a model that takes one sequence length only
            st.probe_failed = f"{type(exc).__name__}: {first_line(exc, 120, default='')}"
            st.probe = None
    if st.probe is not None and any((t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all())
                                    for _, t in flatten_outputs(st.probe_reference)):
        # redrawn inputs outside the model's domain (a log of a negative value): NaN compares as "no error"
        st.probe_failed, st.probe, st.probe_reference = "the original outputs NaN or inf on it", None, None
    if st.work_dtype != torch.float64 and all(sp.verdict != "approximate" for sp in st.todo):
        kwargs, reference = (st.probe.kwargs, st.probe_reference) if st.probe is not None else \
            ({**{f"*{i}": a for i, a in enumerate(st.wargs)}, **st.wkwargs}, st.reference)
        st.own_error = rounding_error(st.work, lambda: _forward(st, kwargs), reference, st.work_dtype)


def _forward(st: _Patching, probe_kwargs: dict[str, Any]) -> Any:
    """The working copy on a probe's inputs (:func:`normswap.inputs.probe.call_args`), run as every
    verification forward is: no grad, the model's casts held, the same seeded random draws."""
    args, kwargs = call_args(probe_kwargs)
    with torch.no_grad(), running(st.work_dtype, st.an.hold), same_draws(st.work):
        return st.work(*args, **kwargs)


def _edit_weights(st: _Patching) -> None:
    """The plan's weight edits and run-time ops on the working copy, which from here on holds its own
    copy of every tensor it writes."""
    st.originals = {sp.name: st.work.get_submodule(sp.name) for sp in st.plan.sites}
    own_written(st.work, st.model, st.plan)
    edits.apply_weight_edits(st.work, st.plan, st.an.sites, st.originals)
    for h in st.plan.hooks:
        edits.install_hook(st.work, h)


def _swap(st: _Patching, sps: list[SitePlan], fits: dict | None = None) -> None:
    """Replace the norms ``sps`` in the working copy by RMSNorms (γ/β from ``fits`` where calibrated)."""
    fits = fits or {}
    for sp in sps:
        new = edits.make_rmsnorm(st.an.sites[sp.name], sp, st.originals[sp.name], st.opts.backend,
                                 fits.get(sp.name))
        edits.replace_module(st.work, st.originals[sp.name], new)
        st.new_modules[sp.name] = new
    for h in st.plan.hooks:  # again: a hook on a norm that was just replaced went with it
        edits.install_hook(st.work, h)


def _calibrate_approximate(st: _Patching) -> None:
    """Fit the approximate norms inside the model as it will run (exact ones already swapped), refuse
    an unusable result, then swap them."""
    approx, opts, plan_ = st.approximate, st.opts, st.plan
    if approx and opts.calibration is not False:
        st.calib = _calibrate(st.work, approx, st.an.sites, st.originals, opts, st.example_inputs, st.wargs,
                              st.wkwargs, st.work_dtype, st.an.hold)
        plan_.options["calibration"] = st.calib.as_dict()
        plan_.options["calibration_batches"] = st.calib.batches
        reason = calibrate.unusable(st.calib.figures)
        if opts.verify and reason and not opts.allow_unusable:
            raise calibrate.UnusableConversion(
                f"conversion unusable: {reason} (held-out, {st.calib.source}); model left unchanged. "
                "Calibrate on data from your domain (calibration=...), keep "
                "approximate norms as LayerNorm (mode='exact'), or recover with the distillation "
                "recipe (normswap finetune distill-encoder|distill-masked-lm|distill-causal-lm); "
                "allow_unusable=True writes it anyway")
    elif approx:
        plan_.options["calibration"] = {"source": "none (γ/β copied unchanged)"}
    _swap(st, approx, {n: (f.weight, f.bias) for n, f in (st.calib.fits.items() if st.calib else [])})


def _fold_residual_beta(st: _Patching) -> None:
    """Move the bias of each converted Post-LN norm whose output is read by Linear readers and residual adds
    into those readers' and the residual writers' biases (:class:`~normswap.analysis.plan.ResidualFold`,
    ``beta_placement="fold"``): after calibration, so an approximate norm's fitted bias moves too. Exact for
    any value; the RMSNorm then has no bias (an exported graph, no ``Add`` after the fused norm)."""
    plan_, done = st.plan, []
    for rf in plan_.residual_folds:
        sp = plan_.site(rf.site)
        norm = st.new_modules.get(rf.site)
        if not sp.convert or getattr(norm, "bias", None) is None:
            continue
        st.residual_shifts[rf.site] = edits.fold_residual_beta(st.work, rf)
        sp.fold_beta, sp.rms_bias = True, False
        readers = ", ".join(f"`{p}`" for p in rf.readers)
        writers = ", ".join(f"`{p}`" for p in rf.writers)
        what = "fitted bias" if sp.verdict == "approximate" else "β"
        sp.beta_detail = (f"{what} folded into the bias of {readers}" + (" and " if readers else "")
                          + f"of {RESIDUAL_WHY} {writers} (Post-LN: the residual adds it to the next "
                          "stream from there, the same sum)")
        done.append(rf)
    plan_.residual_folds = done


def _verify(st: _Patching) -> None:
    """Run the converted copy, compare with the original, check each norm, and gate (``verify``).

    It runs on the unseen probe; on the traced inputs too only when the probe did not reach every
    converted norm (each needs its zero-mean evidence) or there is no probe."""
    skip, axes = set(st.plan.changed_outputs), st.plan.changed_output_axes
    figures: dict[str, Any] = {}
    with _capture(st.new_modules) as seen, torch.no_grad(), running(st.work_dtype, st.an.hold):
        if st.probe is not None:
            out = _forward(st, st.probe.kwargs)
            figures = compare(st.probe_reference, out, skip, st.probe.attention_mask, axes)
            if "max_rel_error" in figures:  # not a 0 where no output was compared
                figures["unseen_probe_max_rel_error"] = figures["max_rel_error"]
            figures["probe"] = st.probe.source
            st.probe_reference = None
        if st.probe is None or any(not seen[name] for name in st.new_modules):
            with same_draws(st.work):
                out = st.work(*st.wargs, **st.wkwargs)
            traced = compare(st.reference, out, skip, axes=axes)
            if st.probe is None:
                figures = traced
                figures["probe"] = _probe_used(st)
            else:
                for k in ("max_rel_error", "raw_stream_rel_error"):
                    if k in figures or k in traced:
                        figures[k] = max(figures.get(k, 0.0), traced.get(k, 0.0))
    with running(st.work_dtype, st.an.hold):  # the originals' forwards: a float32 norm of a float64 copy too
        _site_checks(st.plan, st.todo, seen, st.originals, st.an.sites, st.work_dtype, figures, st.residual_shifts)
    if st.opts.verify:
        try:
            gate(st.todo, figures, st.work_dtype, precision_limit(st.work_dtype, st.own_error))
        except VerificationFailed as exc:  # the original's own randomness, where no seed reaches it, says so
            try:
                why = unseeded_randomness(lambda: st.model(*st.args, **st.kwargs), st.user_dtype, st.model)
            except Exception:  # noqa: BLE001 - the original failing to run again: the gate's own reason stands
                why = None
            if why is None:
                raise
            raise VerificationFailed(f"{exc}; {why}") from None
    if st.own_error is not None:
        figures["own_rounding_error"] = st.own_error
    limit, gated = gate_text(st.todo, st.work_dtype, st.opts.verify, st.own_error, OWN_ERROR_HOW)
    if st.opts.verify and not figures.get("compared") and "raw_stream_rel_error" not in figures:
        gated += f"; {NOTHING_COMPARED}"  # integer ids, objects: else a pass would read as outputs compared
    figures.update(st.an.precision.figures(limit, gated))
    st.figures = figures


NOTHING_COMPARED = ("the model returns no floating-point output to compare (outputs compared: none): only the "
                    "converted norms were checked, an exact norm's input zero-mean, an approximate norm's output "
                    "against the original norm's")


def _probe_used(st: _Patching) -> str:
    """What the verification ran on, when it is not the unseen probe."""
    if not st.opts.verify:
        return "the analysis inputs (verify=False: no unseen probe)"
    if st.example_inputs is not None and st.probe_failed == NOTHING_TO_REDRAW:
        return f"the analysis inputs (no unseen probe: {st.probe_failed})"
    return f"the analysis inputs (the unseen probe did not run: {st.probe_failed})"


def _commit_verified(st: _Patching) -> None:
    """Copy the verified copy into the user's model, and measure what the cast back to its own dtype
    costs next to what that dtype costs the original anyway."""
    model, figures = st.model, st.figures
    kept, st.own_run = (st.own_run if not st.args else None), None
    if st.measure_cast:
        in_dtype, original_failed = _error_in_own_dtype(model, st.reference, st.args, st.kwargs, output=kept)
        figures["original_in_model_dtype"] = in_dtype.get("max_rel_error")
    _commit(model, st.work, st.plan, st.todo, st.user_dtype, st.training)
    torch_transformer.keep_python_forward(model, st.plan)
    if st.measure_cast:
        skip = set(st.plan.changed_outputs)
        converted_in_dtype, converted_failed = _error_in_own_dtype(model, st.reference, st.args, st.kwargs, skip,
                                                                   st.plan.changed_output_axes)
        figures["in_model_dtype"] = converted_in_dtype.get("max_rel_error")
        figures["dtype_error_ratio"] = dtype_error_ratio(in_dtype, converted_in_dtype)
        st.dtype_note = _own_dtype_note(model, st.user_dtype, original_failed, converted_failed)
        if converted_failed:  # committed already: say it loudly rather than leave a half-told result
            warnings.warn(st.dtype_note, stacklevel=4)


def _report(st: _Patching, wrapped: str) -> Report:
    """The Report: the plan's conversion line with what else the user should know, then the rotation
    (``options.rotate``, proven output-preserving: :mod:`normswap.rotation.rotate`) of the committed
    model."""
    plan_, figures, calib, opts = st.plan, st.figures, st.calib, st.opts
    message = plan_.conversion_line()
    if wrapped:
        message = f"{wrapped}; {message}"
    if st.dtype_note:
        message += f"; {st.dtype_note}"
    if st.an.random:
        message += f"; {RANDOM_NOTE}"
        if st.user_dtype != st.work_dtype:
            message += (f" (the cost of {str(st.user_dtype).removeprefix('torch.')} is not measured: the same "
                        "seed draws other numbers in another dtype)")
    if plan_.options.get("working_dtype"):
        message += f"; analysed and verified in {plan_.options['working_dtype']}"
    elif st.an.hold:  # a fact of these inputs' run (DINOv2 casts only where it interpolates), not of the plan
        message += (f"; the model's casts to lower precision held at {str(st.work_dtype).removeprefix('torch.')} "
                    f"in analysis and verification ({precision.describe(st.an.held)})")
    if plan_.options.get("sub_runs"):  # norms the model's own run does not reach (inputs.reach)
        message += f"; reached by sub-runs: {'; '.join(plan_.options['sub_runs'])}"
    if plan_.options.get("unreached"):
        message += f"; kept as LayerNorm: {'; '.join(plan_.options['unreached'])}"
    if calib is not None:
        message += f"; {calib.summary()}"
        figures.update({f"heldout_{k}": v for k, v in calib.figures.items()})
    elif st.approximate:
        message += "; no calibration (γ/β copied unchanged)"
    rotation = None
    if opts.rotate is not None:
        from normswap.rotation.rotate import rotate

        rotation = rotate(st.model, opts.rotate, seed=opts.rotate_seed, online=opts.online_hadamard,
                          online_block=opts.online_block,
                          output=opts.rotate_output, smooth=opts.rotate_smooth, **(opts.rotate_learn or {}),
                          calibration=opts.calibration if opts.calibration is not False else None)
        message += f"; {rotation.headline()}"
    return Report(plan_.sites, figures, plan_, message, changed=True, calibration=calib, rotation=rotation)


def _error_in_own_dtype(model: nn.Module, reference: Any, args: tuple, kwargs: dict,
                        skip: set[str] | frozenset[str] = frozenset(),
                        axes: dict[str, int] | None = None, output: Any = None) -> tuple[dict, str]:
    """``compare()`` of the model run as it is (its own dtype) against the float64 reference, or
    ``({}, why)`` where the model's own code cannot run in that dtype: Whisper's LayerNorm computes in
    float32 and on a CPU refuses bfloat16 parameters ("mixed dtype"). A figure, not a gate: the
    conversion was verified in the working dtype, and a failure here must not undo a commit. ``output``:
    that run's outputs where they are known already (the route check ran it: :func:`patch`)."""
    if output is not None:
        return compare(reference, output, skip, axes=axes), ""
    try:
        with torch.no_grad(), same_draws(model):
            out = model(*args, **kwargs)
        return compare(reference, out, skip, axes=axes), ""
    except Exception as exc:  # the model's own code, in its own dtype: any error it raises
        return {}, f"{type(exc).__name__}: {first_line(exc, 120)}"


def _own_dtype_note(model: nn.Module, dtype: torch.dtype, original_failed: str, converted_failed: str) -> str:
    """The report's words on a model that does not run in its own dtype ('' when both runs worked)."""
    name, dtype_name = type(model).__name__, str(dtype).removeprefix("torch.")
    if original_failed and not converted_failed:
        return (f"the original {name} does not run in {dtype_name} on these inputs ({original_failed}); "
                "the converted one does")
    if original_failed:
        return f"neither the original nor the converted {name} runs in {dtype_name} on these inputs ({original_failed})"
    if converted_failed:
        return f"the converted {name} does not run in {dtype_name} on these inputs ({converted_failed})"
    return ""


def calibration_dtype(work_dtype: torch.dtype) -> torch.dtype:
    """What the calibration forwards compute in: float32 for a float64 working copy. A least-squares
    fit of an approximate norm does not need float64 activations (the sums are float64 either way,
    and the fit's own error is orders of magnitude above float32 rounding), and float64 forwards cost
    2-3x float32 ones on a CPU."""
    return torch.float32 if work_dtype == torch.float64 else work_dtype


@contextlib.contextmanager
def computing_in(model: nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """Hold ``model``'s floating parameters and buffers in ``dtype`` for the block, then give each its
    own tensor back (exactly: the originals are kept aside, not cast back). The module tree, its hooks
    and every ``Parameter`` object stay the same; only ``.data`` is swapped."""
    saved: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        for t in (*model.parameters(), *model.buffers()):
            if t.is_floating_point() and t.dtype != dtype:
                saved.append((t, t.data))
                t.data = t.data.to(dtype)
        yield
    finally:
        for t, data in saved:
            t.data = data


def _calibrate(work: nn.Module, approx: list[SitePlan], sites: dict, originals: dict, opts: ConvertOptions,
               example_inputs: inputs.ExampleInputs, args: tuple, kwargs: dict, work_dtype: torch.dtype,
               hold: bool) -> calibrate.CalibrationResult:
    """Fit the approximate norms (still LayerNorms in ``work``) and measure on held-out inputs.

    The forwards run in :func:`calibration_dtype` (float32 for a float64 copy: 2-3x faster) and, where
    the model does not run there, in the working dtype the analysis ran in: a custom model may keep a
    tensor it made in the traced float64 run (a rotary table cached on first use) that then meets float32
    activations ("expected scalar type Float but found Double"). The error says what failed in each.
    """
    calibration, tokenizer = opts.calibration, opts.tokenizer
    device = model_device(work)
    sub = reach.sub_route_of(work)  # converted with sub-runs: the model's own batches, lifted into the view's runs
    base = reach.plain(work) if sub is not None else work
    hf = inputs.is_hf_model(work) and (example_inputs is None or sub is not None)

    def lifted(batches: list[calibrate.Batch]) -> list[calibrate.Batch]:
        return [reach.lift(sub, b) for b in batches] if sub is not None else batches

    held_out: list[calibrate.Batch] = []
    if hf:  # built-in held-out batches (other seed): never fitted on, whichever data the fit used
        held_out = lifted(calibrate.builtin_batches(base, tokenizer, batches=2, batch_size=16, seed=7)[0])
    if calibration is not None:
        fit, source = lifted(calibrate.user_batches(calibration)), "user calibration data"
    elif hf:
        fit, source = calibrate.builtin_batches(base, tokenizer, batches=4, batch_size=16, seed=0)
        fit = lifted(fit)
    elif towers.is_view(work):  # converted by towers: the runs' built inputs are all there is
        fit, source = [(args, kwargs)], "the per-tower runs' built inputs (pass calibration= for a better fit)"
    else:
        fit, source = [(args, kwargs)], "the example inputs (custom model: pass calibration= for a better fit)"
    if not held_out:
        held_out = [(args, kwargs)]
    targets = [calibrate.Target(sp.name, originals[sp.name], sites[sp.name]) for sp in approx]

    def move(t: Any) -> Any:
        return t.to(device) if isinstance(t, torch.Tensor) else t

    failures: list[tuple[torch.dtype, Exception]] = []
    for dtype in dict.fromkeys((calibration_dtype(work_dtype), work_dtype)):
        def call(batch: calibrate.Batch, dtype: torch.dtype = dtype) -> calibrate.Batch:
            a, k = inputs.cast_inputs(*batch, dtype)
            return tuple(move(x) for x in a), {n: move(v) for n, v in k.items()}

        try:
            with computing_in(work, dtype), running(dtype, hold):
                result = calibrate.calibrate(work, targets, fit, held_out, source=source,
                                             sequential=opts.sequential, call=call,
                                             eval_source="built-in, another seed" if hf else "the example inputs")
        except (NormswapError, MemoryError):
            raise
        except Exception as exc:  # noqa: BLE001 - the model does not run on these batches in this dtype
            log.info("calibration in %s failed: %s: %s", dtype, type(exc).__name__, first_line(exc, 160))
            failures.append((dtype, exc))
            continue
        for failed, exc in failures:  # say why the fit ran in the slower dtype
            result.pipeline += (f"; in {str(dtype).removeprefix('torch.')} ({type(work).__name__} did not run in "
                                f"{str(failed).removeprefix('torch.')}: {type(exc).__name__}: {first_line(exc, 120)})")
        return result
    exc = failures[-1][1]
    tried = " or ".join(str(d).removeprefix("torch.") for d, _ in failures)
    what = f"{type(exc).__name__}: {first_line(exc, 160)}"
    if calibration is None and not hf:  # the example inputs, on which the analysis ran the model
        raise NormswapError(
            f"calibration could not run {type(work).__name__} on the example inputs in {tried} ({what}), though "
            "the analysis ran them; keep the approximate norms as LayerNorm (mode='exact') or skip the fit "
            "(calibration=False), and please report this model") from exc
    raise NormswapError(
        f"calibration could not run {type(work).__name__} on {source} in {tried} ({what}); "
        "pass calibration= batches the model accepts (--calibration-data), keep the approximate norms "
        "as LayerNorm (mode='exact'), or skip the fit (calibration=False)") from exc


def _site_checks(plan_: Plan, todo: list[SitePlan], seen: dict, originals: dict, sites: dict,
                 dtype: torch.dtype, figures: dict, shifts: dict[str, torch.Tensor] | None = None) -> None:
    """Per-norm evidence: exact norms must read a zero-mean stream; approximate ones get an error (of their
    output with the bias a residual fold moved out of them, ``shifts``, added back)."""
    worst = 0.0
    for sp in todo:
        pairs = seen.get(sp.name, [])
        if not pairs:
            continue
        dims = tuple(range(-len(sp.normalized_shape), 0))
        if sp.verdict == "approximate":
            num = den = 0.0
            shift = (shifts or {}).get(sp.name)
            with torch.no_grad():
                for x, y in pairs:
                    ref = normalised(originals[sp.name](x))
                    y = y.double() if shift is None else y.double() + shift.to(y.device)
                    num += float((y - ref.double()).pow(2).sum())
                    den += float(ref.double().pow(2).sum())
            sp.error = (num / den) ** 0.5 if den > 0 else 0.0
        else:
            ratio = 0.0
            for x, _ in pairs:
                x = x.double()
                rms = x.pow(2).mean(dims).sqrt()
                # a row that is zero to rounding (a centred constant row: silence in speech features) has
                # |mean| ~ rms ~ 1e-16 and says nothing about centring; |mean| <= rms bounds what it leaves out
                rows = rms > max(1e-30, float(rms.max()) * 1e-9)
                if bool(rows.any()):
                    ratio = max(ratio, float((x.mean(dims).abs()[rows] / rms[rows]).max()))
            sp.error = ratio
            worst = max(worst, ratio)
    figures["max_stream_mean_ratio"] = worst


def report_warnings(plan_: Plan, todo: list[SitePlan]) -> None:
    if plan_.options.get("mode") != "auto":
        return
    for sp in todo:
        if sp.verdict == "approximate":
            warnings.warn(f"normswap: `{sp.name}` converted approximately ({sp.reason}); "
                          f"relative output error {sp.error:.3g}. Use mode='exact' to keep it as LayerNorm, "
                          "or recover accuracy with `normswap finetune`", stacklevel=4)  # the user's call


def _commit(model: nn.Module, work: nn.Module, plan_: Plan, todo: list[SitePlan], dtype: torch.dtype,
            training: dict[str, bool]) -> None:
    """Copy the verified edits into the user's model (cast back to its dtype, once).

    Memory: each working tensor is freed as soon as it is copied, an untied parameter is the cast
    of its working tensor (no clone of the tied one first), and casts go straight into the target.
    A working tensor already in the target's dtype and device is adopted (``target.data = source``):
    the user's ``Parameter`` objects stay the same, and a head untied from a tensor the model shares
    keeps its own storage while the embedding's is replaced.
    """
    taken = set()
    with torch.no_grad():
        for u in plan_.unties:
            name = f"{u.module}.{u.attr}" if u.module else u.attr
            tied = getattr(model.get_submodule(u.module), u.attr)
            source = work.get_parameter(name)
            edits.untie(model, u, source.detach().to(device=tied.device, dtype=tied.dtype))
            source.data = torch.empty(0, dtype=source.dtype)
            taken.add(name)
    if plan_.unties:
        edits.mark_untied(model)
    names = edits.written_parameters(plan_, model)
    for c in plan_.mean_carries:  # the widened MLP tensors, one at a time (no second set allocated up front)
        taken.update(edits.adopt_widened_mlp(model, c, work))
    with torch.no_grad():
        for name in sorted(names - taken):
            target, source = model.get_parameter(name), work.get_parameter(name)
            if source.numel() == 0 and target.numel() != 0:
                continue  # tied to a name already copied (and freed) in this loop
            if source.dtype == target.dtype and source.device == target.device:
                target.data = source.detach()  # adopt the edited tensor (its own storage): no copy
            else:
                target.copy_(source)  # casts elementwise, rounding as .to() does, without a temporary
            source.data = torch.empty(0, dtype=source.dtype)  # the working copy is done with: free as we go
    for slot in plan_.bias_slots:  # new tensors: the readers had no bias (plan.BiasSlot)
        source = linear_at(work, slot.reader).bias
        w = linear_at(model, slot.reader).weight
        edits.add_bias_slot(model, slot, source.detach().to(device=w.device, dtype=w.dtype))
        source.data = torch.empty(0, dtype=source.dtype)
    for sp in todo:
        old = model.get_submodule(sp.name)
        ref = next(iter(old.parameters()), None)
        new = copy.deepcopy(work.get_submodule(sp.name))
        new.to(device=ref.device if ref is not None else None, dtype=ref.dtype if ref is not None else dtype)
        if ref is None:
            new.to(dtype)
        new.train(training.get(sp.name, False))
        edits.replace_module(model, old, new)
    for h in plan_.hooks:
        edits.install_hook(model, h)
