"""bf16/fp16 fidelity: a converted model, rounded once from the float64 surgery, should be no further
from the float64 original than the original model rounded to the same dtype (issue 12 §1: ≤ 1.1×).

The figure is ``dtype_error_ratio``: ‖converted_in_dtype − fp64‖ / ‖original_in_dtype − fp64‖ on the
model's primary output (relative RMS). What made it reach 1.2-1.4× before: the RMSNorm kernels used the
Hugging Face Llama cast order (``x·rstd``, ``·w`` and ``+b`` each rounded to the input dtype) where the
LayerNorm being replaced rounds once. Every backend now uses the LayerNorm order (float32 throughout,
one rounding); tests/backends/test_numerics.py checks it norm by norm.

Why the ratio is averaged over a few random models per entry. The zoo's models are tiny (width 32,
two layers), so their dtype error is dominated by the rounding of a handful of parameters (a bias's
32 rounding errors are added to every token alike) and a ratio measured on one random model reads one
draw of those roundings, not the conversion. Measured (benchmarks/RESULTS.md, "One rounding"): the
conversion's reparametrisation alone, with every LayerNorm kept (only the writers centered and the
head untied, exact in float64), already reads 1.17× on the zoo's CLIP-vision model in fp16 and 0.82-1.15×
across eight random CLIP-vision models, where the full conversion reads 0.83-1.20× (geometric mean
1.00). So each entry's ratio here is the geometric mean over ``MODEL_SEEDS`` random models, each
probed on ``BATCH`` × 32 tokens: that is what the 1.1× target is about, and what a regression in the
kernels' cast order moves (over the 28 ``EXACT`` entries this mean reads at most 1.06× bf16 / 1.03×
fp16; with the old three-rounding kernels it read up to 1.17× / 1.15×, above 1.1× in 25 of those 56
cases). The families of ``MORE`` that must convert exactly are checked too; the image classifiers among
them are built with 32 classes (``tests.zoo.CLASSES``): with 2, each image gives 2 logits, and
data2vec-vision's ratio then scattered 0.75-2.35 between random models (mean 1.2-1.3 with either cast
order), where with 32 classes it reads 1.00.
"""

import copy
import math

import pytest
import torch

import normswap
from normswap.inputs import cast_inputs, hf_example_inputs
from normswap.pipeline import default_dtype
from normswap.surgery.edits import CenterOutput
from normswap.surgery.verify import compare, dtype_error_ratio
from tests.zoo import EXACT, MORE, build

TARGET = 1.1  # issue 12 §1
# every other zoo family that converts exactly: name -> the table build() takes it from
ENTRIES = {**{n: EXACT for n in EXACT},
           **{n: {n: f} for n, (f, verdict) in MORE.items() if verdict == "exact"}}
MODEL_SEEDS = tuple(range(6))
BATCH = 32
# Raw audio is cut to what makes 32 frames, the tokens every other entry is probed on: wav2vec2-stable's feature
# extractor (kernels 10, 3; strides 5, 2) makes 32 frames of 330 samples. The input builder's 4000 samples made
# 399, 12x the tokens and ~7x this file's CPU for that entry (24.3 of ~120 s), for the same ratios: over the six
# models, 1.026 bf16 / 1.012 fp16 with 399 frames, 1.031 / 1.011 with 32 (round 64).
AUDIO_SAMPLES = 330


DTYPES = (torch.bfloat16, torch.float16)
# (name, seed) -> the converted pair and its probe, and the dtypes not yet measured on it
_PAIRS: dict[tuple[str, int], tuple[tuple, set]] = {}


def _converted(name, seed, dtype):
    """The original and converted models of one random draw, their probe, the float64 reference and the outputs
    the conversion changes; each dtype's low-precision copies are rounded from them.

    Built once per (name, seed) for both dtypes. The dtype measured last takes the pair itself (rounding a
    model in place is what rounding its deep copy does) and drops it: a deep copy of each model per dtype was
    a third of this file's time, and keeping every pair alive to the end of the run made each conversion's
    ``gc.collect()`` walk all of them."""
    key = (name, seed)
    if key not in _PAIRS:
        model = build(ENTRIES[name], name, seed=seed)
        probe = hf_example_inputs(model, batch=BATCH, seq=32, seed=11)
        if "input_values" in probe:
            probe["input_values"] = probe["input_values"][..., :AUDIO_SAMPLES]
        with torch.no_grad(), default_dtype(torch.float64):
            reference = model(**probe)
        converted = copy.deepcopy(model)
        report = normswap.patch(converted)
        _PAIRS[key] = ((model, converted, probe, reference, set(report.plan.changed_outputs)), set(DTYPES))
    pair, pending = _PAIRS[key]
    pending.discard(dtype)
    if pending:
        model, converted, *rest = pair
        return (copy.deepcopy(model), copy.deepcopy(converted), *rest)
    del _PAIRS[key]
    return pair


def _ratio(name, seed, dtype):
    """The ratio on one random model, or None when either model is not finite in ``dtype``."""
    model, converted, probe, reference, skip = _converted(name, seed, dtype)
    args, kwargs = cast_inputs((), probe, dtype)
    with torch.no_grad():
        original_lp = compare(reference, model.to(dtype)(*args, **kwargs))
        converted_lp = compare(reference, converted.to(dtype)(*args, **kwargs), skip)
    if not all(math.isfinite(f.get("rel_rms_error", math.nan)) for f in (original_lp, converted_lp)):
        return None
    return dtype_error_ratio(original_lp, converted_lp)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_round_once_after_fp64_surgery_costs_what_the_dtype_costs(name, dtype):
    ratios = [_ratio(name, seed, dtype) for seed in MODEL_SEEDS]
    finite = [r for r in ratios if r is not None]
    if not finite:
        pytest.skip(f"{name} is not finite in {dtype}")
    assert all(r is not None and r > 0 for r in finite)
    mean = math.exp(sum(math.log(r) for r in finite) / len(finite))
    assert mean <= TARGET, (mean, ratios)


def test_patch_reports_the_dtype_error_ratio_of_an_in_memory_bf16_model():
    model = build(EXACT, "gpt2").to(torch.bfloat16)
    report = normswap.patch(model)
    v = report.verification
    assert v["dtype_error_ratio"] is not None and 0.5 < v["dtype_error_ratio"] < 3.0
    assert v["in_model_dtype"] > 0 and v["original_in_model_dtype"] > 0


def test_stream_start_centering_of_a_half_precision_norm_rounds_once():
    """BLOOM-style centering after an RMSNorm: computed in float32 and rounded once, not rounded by
    the norm and again by the mean subtraction. Against the float64 result of the same bf16 parameters
    and input, one rounding is the best any bf16 output can do; the norm-then-center order is ~1.5x."""
    torch.manual_seed(0)
    norm = normswap.RMSNorm(64, eps=1e-5, bias=True)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(64))
        norm.bias.copy_(0.5 + 0.3 * torch.randn(64))
    norm_bf = norm.to(torch.bfloat16)
    xb = torch.randn(512, 64).to(torch.bfloat16)
    with torch.no_grad():
        ref64 = copy.deepcopy(norm_bf).double()(xb.double())
        ref64 = ref64 - ref64.mean(-1, keepdim=True)
        out = CenterOutput()(norm_bf, (xb,), norm_bf(xb))
        twice = norm_bf(xb).float()
        twice = (twice - twice.mean(-1, keepdim=True)).to(torch.bfloat16)

    def err(t):
        return float((t.double() - ref64).norm())

    best = err(ref64.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and err(out) <= 1.01 * best, (err(out), best)
    assert err(twice) > 1.2 * best, (err(twice), best)
