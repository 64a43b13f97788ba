"""Rotated checkpoints: ``normswap convert --rotate``, native and compat. A rotated compat directory
loads in a process that never imports normswap, with the original's logits and rotated weights."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import normswap
from normswap.cli import main
from normswap.presets import build as build_preset
from normswap.rotation.rotate import rotation_matrix
from tests.integrations.compat import NO_NORMSWAP_IMPORTS

REPO = Path(__file__).resolve().parents[2]

_LOAD_STOCK = NO_NORMSWAP_IMPORTS + textwrap.dedent("""
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32).eval()
    ids = torch.load({ids!r})
    with torch.no_grad():
        torch.save(model(input_ids=ids).logits, {out!r})
    print(json.dumps({{"normswap_loaded": any(m.startswith("normswap") for m in sys.modules),
                       "class": type(model).__name__}}))
""")


def _stock_logits(tmp: Path, path: Path, ids: torch.Tensor, warm=None) -> torch.Tensor:
    """The logits of ``path`` loaded by stock transformers in a process where any import of normswap fails:
    a fresh interpreter, or with ``warm`` a child of the tests' warm fork server (which never imports it)."""
    torch.save(ids, tmp / "ids.pt")
    code = _LOAD_STOCK.format(path=str(path), ids=str(tmp / "ids.pt"), out=str(tmp / "logits.pt"))
    if warm is not None:
        proc = warm.run(code, cwd=tmp, timeout=300)
    else:
        env = {**os.environ, "PYTHONPATH": ""}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                              cwd=str(tmp))
    assert proc.returncode == 0, proc.stderr[-3000:]
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not info["normswap_loaded"] and info["class"] == "GPT2LMHeadModel"
    return torch.load(tmp / "logits.pt")


def _convert(*args: str) -> str:
    res = CliRunner().invoke(main, ["convert", *args, "--quiet"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return res.output


def test_rotated_compat_gpt2_loads_in_stock_transformers_with_the_same_logits(tmp_path, warm_python):
    out = _convert("tiny-gpt2", "--out", str(tmp_path / "rot"), "--format", "compat", "--rotate", "hadamard",
                   "--seed", "3")
    assert "rotated 1 stream(s) (hadamard)" in out and "--rotate implies" not in out  # --quiet: no notes

    original, _ = build_preset("tiny-gpt2")
    original = original.float().eval()
    plain_model, _ = build_preset("tiny-gpt2")  # the unrotated conversion, in memory
    normswap.patch(plain_model.float(), fold_gamma=True, mode="exact")
    plain = {f"transformer.{k}" if not k.startswith(("transformer.", "lm_head")) else k: v
             for k, v in plain_model.state_dict().items()}
    ids = torch.randint(0, original.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = original(input_ids=ids).logits
    logits = _stock_logits(tmp_path, tmp_path / "rot", ids, warm_python)
    assert float((logits - ref).abs().max() / ref.abs().max()) < 1e-4

    rot = load_file(tmp_path / "rot" / "model.safetensors")
    shared = [k for k in rot if k in plain]  # (the RMSNorms hold no β where it folded; compat's LayerNorms do)
    assert len(shared) > 20
    differ = [k for k in shared if rot[k].shape == plain[k].shape
              and not torch.allclose(rot[k], plain[k].float(), atol=1e-5)]
    assert any("wte" in k for k in differ) and any("c_attn.weight" in k for k in differ)
    assert any("mlp.c_proj.weight" in k for k in differ)

    manifest = json.loads((tmp_path / "rot" / "config.json").read_text())["normswap"]
    assert manifest["format"] == "compat"
    (entry,) = manifest["plan"]["rotations"]
    assert entry["kind"] == "hadamard" and entry["seed"] == 3 and entry["mean_preserving"]
    # the manifest rebuilds Q: undoing it on the rotated embedding gives the unrotated one
    q, _ = rotation_matrix(entry["width"], entry["kind"], entry["seed"])
    wte = next(k for k in rot if k.endswith("wte.weight"))
    assert torch.allclose(rot[wte].double() @ q.T, plain[wte].double(), atol=1e-5)
    ln = next(k for k in rot if k.endswith("ln_f.weight"))  # stock LayerNorms, γ folded: weight 1
    assert torch.equal(rot[ln], torch.ones_like(rot[ln]))


def test_rotated_native_checkpoint_reloads_bitwise_and_records_the_rotation(tmp_path):
    out = _convert("tiny-opt", "--out", str(tmp_path / "n"), "--rotate", "random", "--seed", "5")
    assert "rotated" in out
    model = normswap.load(tmp_path / "n")
    (entry,) = normswap.plan_of(model).rotations
    assert entry["kind"] == "random" and entry["seed"] == 5


def test_rotation_flags_without_rotate_and_online_with_compat_are_errors(tmp_path):
    res = CliRunner().invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "x"), "--seed", "2"])
    assert res.exit_code != 0 and "--seed applies to a rotation" in res.output
    res = CliRunner().invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "x"), "--rotate", "hadamard",
                                    "--online-hadamard", "--format", "compat"])
    assert res.exit_code != 0 and "--format native" in res.output
    assert not (tmp_path / "x").exists()
    with pytest.raises(normswap.NormswapError, match="did you mean 'hadamard'"):
        normswap.ConvertOptions(rotate="hadamad")
    assert normswap.ConvertOptions(rotate="random").folds_gamma  # γ folded where the rotation turns


def test_compat_refuses_a_rotation_it_cannot_hold():
    from normswap.checkpoint.writer import compat_model
    from tests.zoo import EXACT, build

    model = build(EXACT, "gpt2")
    normswap.patch(model, fold_gamma=True)
    q = torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64))[0]  # orthogonal, not mean-preserving
    rot = normswap.rotate(model, q)
    assert rot.rotated and not rot.rotated[0]["mean_preserving"]
    with pytest.raises(normswap.NormswapError, match="mean-preserving"):
        compat_model(model, normswap.plan_of(model))
