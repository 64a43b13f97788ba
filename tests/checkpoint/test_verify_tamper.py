"""``normswap verify`` and ``patch``'s gate hold an exact conversion to what the precision explains for the
model (issue 39 §5): a genuine conversion passes; the same with one weight scaled by 1.01 fails, in float32
and in float64. And ``verify`` checks on passages the conversion never used (issue 39 §6)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import normswap
from normswap import inputs, pipeline, presets
from normswap.checkpoint import verify_dirs
from normswap.checkpoint.verify_dirs import verify_checkpoint
from normswap.cli import main
from normswap.errors import VerificationFailed
from normswap.surgery.verify import precision_limit

TAMPERED = "transformer.h.0.mlp.c_proj.weight"


@pytest.fixture(scope="module", params=["float32", "float64"])
def converted(request, tmp_path_factory) -> tuple[str, Path, Path]:
    """(dtype, the original's directory, its conversion), float32 or float64 throughout."""
    root = tmp_path_factory.mktemp(f"tamper-{request.param}")
    model, tok = presets.build("tiny-gpt2", dtype=getattr(torch, request.param))
    model.save_pretrained(root / "orig")
    tok.save_pretrained(root / "orig")
    normswap.convert(root / "orig", root / "conv")
    return request.param, root / "orig", root / "conv"


def _tampered(conv: Path, dest: Path, name: str = TAMPERED, factor: float = 1.01) -> Path:
    shutil.copytree(conv, dest)
    file = next(f for f in dest.glob("*.safetensors") if name in load_file(str(f)))
    tensors = load_file(str(file))
    tensors[name] = tensors[name] * factor
    save_file(tensors, str(file), metadata={"format": "pt"})
    return dest


def test_a_genuine_conversion_passes_and_one_weight_times_1_01_fails(converted, tmp_path):
    dtype, orig, conv = converted
    good = verify_checkpoint(orig, conv)
    assert good["ok"], good["verdict"]
    assert good["figures"]["max_rel_error"] <= good["tolerance"]
    bad = verify_checkpoint(orig, _tampered(conv, tmp_path / "bad"))
    assert not bad["ok"], bad["verdict"]
    assert "misses tolerance" in bad["verdict"]
    if dtype == "float32":  # the tolerance comes from the original's own float32 error, not a flat 2e-3
        own = good["figures"]["own_rounding_error"]
        assert good["tolerance"] == precision_limit(torch.float32, own) < 1e-4
        assert "16 x the original's own float32 error" in good["precision"]
        assert bad["figures"]["max_rel_error"] < 2e-3  # what the flat tolerance let through


def test_the_cli_exits_4_on_a_tampered_checkpoint_and_states_the_derived_tolerance(converted, tmp_path):
    dtype, orig, conv = converted
    bad = _tampered(conv, tmp_path / "bad", "transformer.h.1.attn.c_attn.weight")
    res = CliRunner().invoke(main, ["verify", str(orig), str(bad)])
    assert res.exit_code == 4, res.output
    assert "exact conversion misses tolerance" in res.stderr
    res = CliRunner().invoke(main, ["verify", str(orig), str(conv)])
    assert res.exit_code == 0, res.output
    if dtype == "float32":
        assert "(= min(0.002, max(16 x the original's own float32 error" in res.stdout


@pytest.mark.parametrize("verify_dtype", ["float32", "float64"])
def test_patch_gate_refuses_a_conversion_one_weight_off(verify_dtype, monkeypatch):
    """``patch`` verifying in float32 holds the conversion to the derived tolerance too: a surgery that
    scaled one weight matrix by 1.01 is refused, and the model is left unchanged."""
    real = pipeline._edit_weights

    def off_by_one_percent(st):
        real(st)
        with torch.no_grad():
            st.work.get_parameter(TAMPERED).mul_(1.01)

    model, _ = presets.build("tiny-gpt2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(pipeline, "_edit_weights", off_by_one_percent)
    with pytest.raises(VerificationFailed, match="converted outputs differ"):
        normswap.patch(model, verify_dtype=verify_dtype)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    monkeypatch.setattr(pipeline, "_edit_weights", real)
    report = normswap.patch(model, verify_dtype=verify_dtype)
    assert report.verification["max_rel_error"] <= report.verification["verify_tolerance"]


def test_verify_checks_on_passages_the_conversion_never_used(converted, monkeypatch):
    dtype, orig, conv = converted
    if dtype != "float32":
        return  # one dtype is enough: the passages do not depend on it
    seen: list[dict] = []
    real = verify_dirs._figures

    def spy(orig_model, conv_model, batches, skip, axes):  # noqa: ANN202
        seen.extend(batches)
        return real(orig_model, conv_model, batches, skip, axes)

    monkeypatch.setattr(verify_dirs, "_figures", spy)
    result = verify_checkpoint(orig, conv)
    assert "passages the conversion neither verified nor calibrated on" in result["probe"]
    model, tok = presets.build("tiny-gpt2")
    converts_probe = inputs.verification_probe(model, tok)
    assert converts_probe.text
    used = {tuple(r.tolist()) for r in converts_probe.kwargs["input_ids"]}
    verify_rows = {tuple(r.tolist()) for r in seen[0]["input_ids"]}
    assert not used & verify_rows
    # and the sentences themselves differ: neither the conversion's probe nor its calibration's
    verify_texts = set(inputs.passages(2 * inputs.PROBE_BATCH, 0, from_end=True)[inputs.PROBE_BATCH:])
    assert not verify_texts & set(inputs.passages(inputs.PROBE_BATCH, 0, from_end=True))
    assert not verify_texts & set(inputs.passages(64, 0))
    manifest = json.loads((conv / "config.json").read_text())["normswap"]
    assert manifest["verification"]["probe"].startswith("built-in English text")


def test_without_room_for_a_float64_original_the_own_error_is_estimated(converted, tmp_path, monkeypatch):
    """Where ORIGINAL cast to float64 would not fit, verify estimates its own error in the stored dtype
    (one rounding of every module's output) and says so; the tampered checkpoint still fails."""
    dtype, orig, conv = converted
    if dtype != "float32":
        return  # float64 needs no yardstick
    monkeypatch.setattr(verify_dirs, "_float64_fits", lambda model: False)
    good = verify_checkpoint(orig, conv)
    assert good["ok"] and "estimated by one rounding of every module's output" in good["precision"]
    assert good["tolerance"] < 1e-4
    assert not verify_checkpoint(orig, _tampered(conv, tmp_path / "bad"))["ok"]
