"""Verification says its precision: the working dtype is chosen from the memory available and the
predicted peak (not from a parameter count), stated with the tolerance in the report, the CLI and the
manifest, and can be forced (``verify_dtype``), with a one-line refusal where float64 does not fit.

Memory is limited by patching the probe (``normswap.memory.available_memory``, and the checkpoint
code's own name for it); no big model is built."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import transformers as tf
from click.testing import CliRunner

import normswap
from normswap import memory, pipeline, presets
from normswap.checkpoint import conversion, truncated
from normswap.cli import main
from normswap.errors import NormswapError
from normswap.surgery.verify import exact_limit, precision_limit
from tests.custom_models import TinyViT, randomise
from tests.custom_models_cast import Float32OnlyNet

GB = 10**9


def cli(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def lacking_float64(numel: int, itemsize: int) -> int:
    """Available bytes (beside a loaded model of ``numel`` x ``itemsize``) one short of the predicted
    peak with a float64 working copy."""
    return math.ceil(memory.in_memory_peak(numel, itemsize, 8) / memory.PEAK_SHARE) - numel * itemsize - 1


def numel_of(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(scope="module")
def half_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    out = tmp_path_factory.mktemp("ckpt") / "gpt2-fp16"
    tf.GPT2LMHeadModel(cfg).eval().to(torch.float16).save_pretrained(out)
    return out


# ------------------------------------------------------------------------------------ the decision
@pytest.mark.parametrize("numel", [86_000_000, 124_000_000, 355_000_000, 774_000_000])
def test_float64_whenever_the_predicted_peak_fits_whatever_the_parameter_count(numel):
    """The issue's case: an 86M GPT-2 with 23 GB free was verified in float32 by a fixed ~67M limit."""
    chosen = memory.choose_precision(numel, torch.float32, available=23 * GB, resident=numel * 4)
    assert chosen.dtype == torch.float64 and chosen.reason == ""
    assert chosen.needed == memory.in_memory_peak(numel, 4, 8) <= chosen.usable


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_boundary_is_the_predicted_float64_peak_against_the_usable_share(dtype):
    numel = 300_000_000
    size = dtype.itemsize
    peak = memory.in_memory_peak(numel, size, 8)
    fits = math.ceil(peak / memory.PEAK_SHARE)  # available, the model not loaded yet
    assert memory.choose_precision(numel, dtype, available=fits).dtype == torch.float64
    short = memory.choose_precision(numel, dtype, available=fits - 2)
    assert short.dtype == torch.float32
    assert short.reason.startswith(f"float64 would need {memory.human(peak)}, ")
    assert f"{memory.human(short.usable)} usable: 60% of the memory available" in short.reason
    # a loaded model's own bytes count towards what the peak may use
    assert memory.choose_precision(numel, dtype, available=fits - numel * size,
                                   resident=numel * size).dtype == torch.float64


def test_a_half_model_without_room_for_a_float32_copy_stays_in_its_dtype():
    numel = 2_600_000_000
    chosen = memory.choose_precision(numel, torch.float16, available=10 * GB)
    assert chosen.dtype == torch.float16
    assert chosen.reason.endswith("a float32 copy would not fit either")


def test_a_float64_model_is_worked_on_in_float64_and_float32_is_refused():
    assert memory.choose_precision(10**9, torch.float64, available=1).dtype == torch.float64
    with pytest.raises(NormswapError, match="would round a float64 model's weights"):
        memory.choose_precision(10, torch.float64, "float32", available=100 * GB)


def test_forcing_the_dtype():
    assert memory.choose_precision(10**6, torch.float32, "float32", available=100 * GB).dtype == torch.float32
    assert memory.choose_precision(10**6, torch.float32, "float64", available=100 * GB).dtype == torch.float64
    with pytest.raises(NormswapError) as info:
        memory.choose_precision(10**9, torch.float32, "float64", available=8 * GB)
    message = str(info.value)
    assert "\n" not in message and "verify_dtype='float64' does not fit" in message
    assert "13.07 GB" in message and "4.80 GB can be used" in message  # 4 + 8 GB + 1 GiB; 60% of 8 GB


def test_the_option_is_validated():
    with pytest.raises(NormswapError, match="did you mean 'float64'"):
        normswap.ConvertOptions(verify_dtype="float46")
    code, _, err = cli("convert", "tiny-gpt2", "--out", "x", "--verify-dtype", "float16")
    assert code == 2 and "float16" in err


# ------------------------------------------------------------------------------------ the report
def test_the_report_states_float64_and_its_tolerance():
    model, _ = presets.build("tiny-gpt2")
    report = normswap.patch(model)
    ver = report.verification
    assert ver["verify_dtype"] == "float64" and ver["verify_tolerance"] == exact_limit(torch.float64)
    assert ver["verify_precision"] == "verified in float64 against the float64 original; tolerance 1e-06 relative"
    assert "precision: verified in float64 against the float64 original; tolerance 1e-06 relative" in str(report)
    assert ver["max_rel_error"] < 1e-12


def test_the_report_states_float32_when_forced_and_when_float64_does_not_fit(monkeypatch):
    model, _ = presets.build("tiny-gpt2")
    forced = normswap.patch(model, verify_dtype="float32")
    assert forced.verification["verify_dtype"] == "float32"
    # the tolerance is derived from the original's own float32 rounding error, not a flat 2e-3
    own = forced.verification["own_rounding_error"]
    assert 1e-8 < own < 1e-5
    assert forced.verification["verify_tolerance"] == precision_limit(torch.float32, own) < 1e-4
    assert ("precision: verified in float32 against the float32 original (verify_dtype='float32'); "
            f"tolerance {precision_limit(torch.float32, own):.3g} relative (= min(0.002, max(16 x the original's "
            "own float32 error") in str(forced)
    assert 1e-12 < forced.verification["max_rel_error"] < 1e-4  # float32 rounding, not float64's

    model, _ = presets.build("tiny-gpt2")
    monkeypatch.setattr(memory, "available_memory", lambda: lacking_float64(numel_of(model), 4))
    fell_back = normswap.patch(model)
    text = fell_back.verification["verify_precision"]
    assert fell_back.verification["verify_dtype"] == "float32"
    assert text.startswith("verified in float32 against the float32 original (float64 would need ")
    assert "usable: 60% of the memory available); tolerance " in text
    assert fell_back.verification["verify_tolerance"] < 1e-4


def test_an_approximate_conversion_says_no_output_tolerance_was_applied():
    model, _ = presets.build("tiny-bert")
    with pytest.warns(UserWarning):
        report = normswap.patch(model)
    assert "verify_tolerance" not in report.verification
    assert report.verification["verify_precision"] == (
        "verified in float64 against the float64 original; exact norms' inputs zero-mean within 1e-08 "
        "(|mean|/rms); approximate norms measured, held to no output tolerance")


def test_forced_float64_that_does_not_fit_is_refused_and_the_model_is_untouched(monkeypatch):
    model, _ = presets.build("tiny-gpt2")
    before = copy.deepcopy(model.state_dict())
    monkeypatch.setattr(memory, "available_memory", lambda: lacking_float64(numel_of(model), 4))
    with pytest.raises(NormswapError, match="verify_dtype='float64' does not fit"):
        normswap.patch(model, verify_dtype="float64")
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert normswap.plan_of(model) is None


def test_forced_float64_on_a_model_that_cannot_run_in_float64_is_refused():
    model = Float32OnlyNet().eval()
    with pytest.raises(NormswapError, match="verify_dtype='float64' is impossible: Float32OnlyNet cannot run in"):
        normswap.patch(model, (torch.randn(4, 12),), verify_dtype="float64")
    fallback = normswap.patch(model, (torch.randn(4, 12),))  # auto: its own dtype, and the report says why
    assert fallback.verification["verify_precision"].startswith(
        "verified in float32 against the float32 original (Float32OnlyNet cannot run in float64")


def test_a_custom_model_too_big_for_a_float64_copy_says_so(monkeypatch):
    torch.manual_seed(8)
    model = randomise(TinyViT()).float()
    monkeypatch.setattr(memory, "available_memory", lambda: 1)
    report = normswap.patch(model, (torch.randn(2, 3, 32, 32),))
    assert report.verification["verify_dtype"] == "float32"
    assert "float64 would need" in report.verification["verify_precision"]


# ------------------------------------------------------------------------------------ CLI and manifest
@pytest.mark.parametrize("flag, dtype, tolerance", [((), "float64", 1e-6), (("--verify-dtype", "float32"), "float32",
                                                                              None)])
def test_convert_prints_and_records_the_precision(tmp_path, flag, dtype, tolerance):
    out = tmp_path / "out"
    code, stdout, err = cli("convert", "tiny-gpt2", "--out", str(out), "--quiet", *flag)
    assert code == 0, err
    line = next(ln for ln in stdout.splitlines() if ln.startswith("precision: "))
    assert line.startswith(f"precision: verified in {dtype} against the {dtype} original")
    recorded = json.loads((out / "config.json").read_text())["normswap"]["verification"]
    if tolerance is None:  # float32: derived from the original's own float32 rounding error
        tolerance = recorded["verify_tolerance"]
        assert tolerance == precision_limit(torch.float32, recorded["own_rounding_error"]) < 1e-4
        assert f"tolerance {tolerance:.3g} relative (= min(0.002, max(16 x the original's own float32 error" in line
    else:
        assert line.endswith(f"tolerance {tolerance:g} relative")
    if flag:
        assert "(--verify-dtype float32)" in line  # in the CLI's words
    assert recorded["verify_dtype"] == dtype and recorded["verify_tolerance"] == tolerance
    assert recorded["verify_precision"].startswith(f"verified in {dtype} against the {dtype} original")
    card = (out / "README.md").read_text()
    assert f"Precision: verified in {dtype} against the {dtype} original" in card
    assert "float64 probe" not in card


def test_convert_refuses_forced_float64_before_loading(half_dir, tmp_path, monkeypatch):
    loads = []
    monkeypatch.setattr(conversion.source, "load_model", lambda *a, **k: loads.append(a))
    numel, _ = conversion.loaded_size(conversion.source.resolve(str(half_dir)), "auto")
    monkeypatch.setattr(conversion, "available_memory",  # the in-memory path fits; its float64 copy does not
                        lambda: math.ceil(memory.in_memory_peak(numel, 2, 8) / memory.PEAK_SHARE) - 1)
    out = tmp_path / "out"
    code, _, err = cli("convert", str(half_dir), "--out", str(out), "--verify-dtype", "float64", "--in-memory")
    assert code == 1 and not loads and not out.exists()
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "--verify-dtype float64 does not fit" in lines[0] and "--low-memory" in lines[0]


def test_the_streamed_path_states_the_precision_of_its_truncated_verification(half_dir, tmp_path, monkeypatch):
    report = normswap.convert(half_dir, tmp_path / "f64", low_memory=True)
    ver = report.verification
    # the tolerance is derived as in memory: from the truncated original's own float16 error (issue 38)
    own = ver["own_rounding_error"]
    assert ver["verify_dtype"] == "float64" and ver["verify_tolerance"] == precision_limit(torch.float16, own)
    assert ver["verify_tolerance"] <= exact_limit(torch.float16)
    assert ver["verify_precision"] == (
        "layers transformer.h: [0, 1, 3] verified on the real weights in float64 against the float64 original; "
        f"tolerance {ver['verify_tolerance']:.3g} relative (= min(0.02, max(16 x the original's own float16 error "
        f"{own:.2g} estimated by one rounding of every module's output in float16, 16 x float16 eps))); "
        "the converted weights as written, in float16")
    assert "precision: layers transformer.h: [0, 1, 3]" in str(report)
    manifest = json.loads((tmp_path / "f64" / "config.json").read_text())["normswap"]["verification"]
    assert manifest["verify_precision"] == ver["verify_precision"]

    monkeypatch.setattr(truncated, "available_memory", lambda: 1)  # no room for a float64 truncated model
    fell_back = normswap.convert(half_dir, tmp_path / "f32", low_memory=True).verification
    assert fell_back["verify_dtype"] == "float32" and "float64 would need" in fell_back["verify_precision"]
    # float64 computes the truncated models without float32's rounding: what is left is the float16 storage
    assert ver["truncated_max_rel_error"] != fell_back["truncated_max_rel_error"]
    with pytest.raises(NormswapError, match="verify_dtype='float64' does not fit"):
        normswap.convert(half_dir, tmp_path / "refused", low_memory=True, verify_dtype="float64")
    assert not (tmp_path / "refused").exists()


def test_verify_states_the_dtype_it_compared_in(tmp_path):
    out = tmp_path / "out"
    assert cli("convert", "tiny-gpt2", "--out", str(out), "--quiet")[0] == 0
    code, stdout, err = cli("verify", "tiny-gpt2", str(out))
    assert code == 0, err
    line = next(ln for ln in stdout.splitlines() if ln.startswith("precision: "))
    assert line.startswith("precision: compared in float32, both models in CONVERTED's stored dtype; tolerance ")
    assert "(= min(0.002, max(16 x the original's own float32 error" in line
    assert "against ORIGINAL run in float64 on the same batches" in line
    code, stdout, _ = cli("verify", "tiny-gpt2", str(out), "--json")
    assert json.loads(stdout)["precision"].startswith("compared in float32")


def test_working_precision_reads_the_memory_where_the_model_lives(monkeypatch):
    model, _ = presets.build("tiny-gpt2")
    assert pipeline.working_precision(model).dtype == torch.float64
    monkeypatch.setattr(memory, "available_memory", lambda: lacking_float64(numel_of(model), 4))
    assert pipeline.working_precision(model).dtype == torch.float32
