"""Shared checks of the input-family tests (tests/inputs/test_*_families.py): a tiny transformers model
converted with no inputs, as the CLI converts it, then measured on inputs the analysis never saw."""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable

import torch
from torch import nn

import normswap
from normswap.inputs import hf_example_inputs
from normswap.pipeline import default_dtype
from normswap.surgery.verify import compare
from tests.zoo import float64_casts, randomise

# the reasons the planner keeps a norm the analysis inputs never ran (normswap.analysis.planner, .walker)
_NOT_CALLED = re.compile(r"not called by the example inputs|did not run on the analysis inputs|only with no rows")


def layernorms(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)}


def eager_experts(model: nn.Module) -> nn.Module:
    """Fused MoE experts (Aria's grouped_mm) have no float64 kernel: transformers' eager loop instead."""
    if getattr(model, "get_experts_implementation", None) is not None:
        model.set_experts_implementation("eager")
    return model


def run_built(model: nn.Module, on: nn.Module | None = None) -> dict:
    """The inputs normswap builds for ``model``, after running ``on`` (``model`` itself by default) on
    them in float64: a model they do not run raises."""
    built = hf_example_inputs(model)
    with torch.no_grad(), default_dtype(torch.float64), float64_casts():
        (model if on is None else on)(**built)
    return built


def convert_with_no_inputs(model: nn.Module) -> tuple[dict, nn.Module, nn.Module, normswap.Report]:
    """``(built inputs, original, model with only its exact norms converted, report)`` of ``model``
    patched in place with no inputs. Asserts the built inputs run the original and reach every norm."""
    norms = layernorms(model)
    assert norms, "the replica has no LayerNorm to reach"
    original = eager_experts(copy.deepcopy(model))
    built = run_built(model, on=original)  # the inputs run the model as built
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = normswap.patch(model)  # no inputs: as the CLI converts
    found = {s.name for s in report.plan.sites} | {s["name"] for s in report.plan.skipped}
    assert norms <= found, f"norms the inputs never reached: {sorted(norms - found)}"
    # a norm kept because the inputs never called it (or called it on no rows) is found, not reached
    kept = [s.name for s in report.plan.sites if _NOT_CALLED.search(s.reason or "")]
    kept += [s["name"] for s in report.plan.skipped if _NOT_CALLED.search(str(s.get("reason", "")))]
    assert not kept, f"norms the inputs never called: {sorted(kept)}"
    exact = model
    if any(s.verdict == "approximate" for s in report.sites):  # measure the exact ones alone
        exact = copy.deepcopy(original)
        normswap.patch(exact, mode="exact", verify=False)
    return built, original, exact, report


def assert_exact_on_unseen_inputs(original: nn.Module, exact: nn.Module, report: normswap.Report) -> None:
    """The exact norms agree with the float64 original to 1e-9 on inputs the analysis never saw."""
    probe = hf_example_inputs(original, batch=1, seq=5, seed=99)
    eager_experts(exact)
    with torch.no_grad(), default_dtype(torch.float64), float64_casts():
        torch.manual_seed(0)
        ref = original(**probe)
        torch.manual_seed(0)
        out = exact(**probe)
    figures = compare(ref, out, set(report.plan.changed_outputs))
    assert figures["compared"], figures
    assert figures["worst_rel_error_any_output"] <= 1e-9, figures


def assert_family_converts_exactly(build: Callable[[], nn.Module]) -> normswap.Report:
    """The family test's body: a replica from ``build`` with LayerNorm γ/β randomised converts with no inputs
    (every norm reached) and its exact norms agree with the original on unseen inputs; its report."""
    torch.manual_seed(0)
    _, original, exact, report = convert_with_no_inputs(randomise(build(), 0))
    assert_exact_on_unseen_inputs(original, exact, report)
    return report
