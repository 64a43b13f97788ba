"""A verdict must not depend on the shape of the example inputs (issue 22, part 1).

For every zoo entry, the plan made on three differently shaped input sets (lengths and batch sizes,
padded batches with an attention mask, other image resolutions with and without
``interpolate_pos_encoding``) must be the same plan: the same verdicts and reasons, and the same
edits. A model converted at one shape must then stay exact, in float64 against the original with
its LayerNorm parameters randomised, at the other shapes.

Why it can hold: an op that mixes tokens with weights every channel shares (interpolating a
position grid, averaging over tokens, padding, gathers, flips, rolls, concatenation) maps zero-mean
tokens to zero-mean tokens, and the analysis proves that form on the traced op
(``normswap.analysis.dataflow.channel_mixing``), so a model that interpolates its position table at one
resolution and not at another reaches the same verdicts at both.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch

import normswap
from normswap.inputs import hf_example_inputs
from normswap.pipeline import default_dtype
from normswap.surgery.verify import compare
from tests.zoo import APPROXIMATE, EXACT, MORE, RMS, SSM, build, float64_casts

ZOO = {**EXACT, **APPROXIMATE, **RMS, **{k: f for k, (f, _) in MORE.items()}, **{k: f for k, (f, _) in SSM.items()}}


def _params(model) -> set[str]:
    return set(inspect.signature(model.forward).parameters)


def _image_size(model) -> int:
    config = getattr(model.config, "vision_config", None) or model.config
    size = getattr(config, "image_size", None) or 32
    return size if isinstance(size, int) else size[0]


def shaped_inputs(model, batch: int, seq: int, *, resolution: int | None = None, interpolate: bool | None = None,
                  padded: bool = False, seed: int = 0) -> dict:
    """Example inputs of one shape: ``batch`` rows of ``seq`` tokens (text, decoder ids), images at
    ``resolution`` pixels (``interpolate``: pass ``interpolate_pos_encoding``), audio of a length
    that grows with ``seq``, and with ``padded`` an attention mask that hides the last tokens of
    the first row (and of the first clip)."""
    inputs = hf_example_inputs(model, batch=batch, seq=seq, seed=seed)
    params = _params(model)
    gen = torch.Generator().manual_seed(seed + 1)
    if "pixel_values" in inputs and resolution is not None:
        pv = inputs["pixel_values"]
        inputs["pixel_values"] = torch.randn(*pv.shape[:-2], resolution, resolution, generator=gen, dtype=pv.dtype)
    if interpolate is not None and "interpolate_pos_encoding" in params:
        inputs["interpolate_pos_encoding"] = interpolate
    if "input_values" in inputs:  # raw audio: the length follows seq
        inputs["input_values"] = torch.randn(batch, 200 * seq, generator=gen, dtype=inputs["input_values"].dtype)
    if padded and "attention_mask" in params:
        main = inputs.get("input_ids", inputs.get("input_values"))
        if main is not None:
            mask = torch.ones(main.shape[:2], dtype=torch.long)
            mask[0, -max(1, main.shape[1] // 4):] = 0
            inputs["attention_mask"] = mask
    return inputs


def three_shapes(model) -> list[tuple[str, dict]]:
    """The three input sets every entry is planned on: (label, inputs)."""
    params = _params(model)
    if "pixel_values" in params:
        size = _image_size(model)
        other = size + 16
        if "interpolate_pos_encoding" in params:  # ViT, DeiT, CLIP, BEiT: the flag decides
            return [("config size", shaped_inputs(model, 2, 8, resolution=size)),
                    (f"{other}px interpolated, batch 1",
                     shaped_inputs(model, 1, 5, resolution=other, interpolate=True, seed=1)),
                    ("config size, flag set, batch 3, padded",
                     shaped_inputs(model, 3, 11, resolution=size, interpolate=True, padded=True, seed=2))]
        return [("config size", shaped_inputs(model, 2, 8, resolution=size)),  # DINOv2 interpolates by itself
                (f"{other}px, batch 1", shaped_inputs(model, 1, 5, resolution=other, seed=1)),
                (f"{size + 32}px, batch 3", shaped_inputs(model, 3, 11, resolution=size + 32, seed=2))]
    return [("batch 2 x 8", shaped_inputs(model, 2, 8)),
            ("batch 1 x 5", shaped_inputs(model, 1, 5, seed=1)),
            ("batch 3 x 11, padded", shaped_inputs(model, 3, 11, padded=True, seed=2))]


# filled in by patch, not by the analysis: the mode's decision, the measured error, the RMSNorm built
CONVERSION_FIELDS = ("convert", "error", "rms_weight", "rms_bias")


def comparable(plan) -> dict:
    """The plan as a manifest, less what the conversion fills in (``patch(mode="exact")`` keeps
    approximate norms as LayerNorms: their ``convert`` flag and centered readers, the mode itself,
    then each norm's measured error and the RMSNorm it became, and the adapter bases it records). No field
    of the analysis is removed: none depends on the inputs' shape."""
    data = plan.to_dict()
    data["options"] = {k: v for k, v in data["options"].items() if k != "mode"}
    data["sites"] = [{k: v for k, v in site.items() if k not in CONVERSION_FIELDS} for site in data["sites"]]
    data["centered_readers"] = []
    data.pop("adapter_bases", None)  # the edited Linears' folded γ/β and writer maps: values the conversion records
    return data


def _run(model, inputs):
    with torch.no_grad(), default_dtype(torch.float64), float64_casts():
        return model(**inputs)


def _check(name: str) -> None:
    model = build(ZOO, name)
    original = copy.deepcopy(model)  # run under float64_casts: norms that round to float32 inside do not
    shapes = three_shapes(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # mode="exact" as patch's below: the mode decides which writers are centered (only for norms that convert)
        plans = {i: normswap.plan(model, shapes[i][1], mode="exact") for i in (0, 2)}
        # the second shape's plan is the one patch makes: converted there (another length / resolution)
        report = normswap.patch(model, shapes[1][1], mode="exact", verify=False)
    plans[1] = report.plan
    first = comparable(plans[0])
    for i in (1, 2):
        assert comparable(plans[i]) == first, f"{name}: the plan at {shapes[i][0]} differs from the plan at " \
            f"{shapes[0][0]}:\n{plans[0].table()}\n---\n{plans[i].table()}"
    if not plans[0].sites:
        return  # nothing to convert (already RMS-style, or skipped): the plans agree, that is all
    changed = set(report.plan.changed_outputs)
    for label, inputs in (shapes[0], shapes[2]):
        figs = compare(_run(original, inputs), _run(model, inputs), changed)
        assert figs["compared"], f"{name}: nothing compared at {label}"
        assert figs["worst_rel_error_any_output"] <= 1e-9, f"{name} converted at {shapes[1][0]}, run at {label}: {figs}"


@pytest.mark.parametrize("name", sorted(ZOO))
def test_plans_and_exactness_do_not_depend_on_the_input_shape(name):
    _check(name)


def test_the_shapes_differ_where_they_should():
    """The property is only worth something if the three input sets really differ: lengths, batch sizes,
    a mask, and resolutions where the position table is interpolated."""
    vit = build(ZOO, "vit")
    shapes = [inputs for _, inputs in three_shapes(vit)]
    assert {tuple(s["pixel_values"].shape) for s in shapes} == {(2, 3, 32, 32), (1, 3, 48, 48), (3, 3, 32, 32)}
    assert shapes[1]["interpolate_pos_encoding"] is True
    gpt2 = build(ZOO, "gpt2")
    shapes = [inputs for _, inputs in three_shapes(gpt2)]
    assert [tuple(s["input_ids"].shape) for s in shapes] == [(2, 8), (1, 5), (3, 11)]
    assert int(shapes[2]["attention_mask"].sum()) < 33
