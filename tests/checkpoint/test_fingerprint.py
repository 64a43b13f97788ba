"""``verify`` compares what the weights are, not where they came from.

The manifest's ``source_fingerprint`` is a hash of the source's tensors (dtype, shape, bytes), so the
preset, the same preset saved to a directory, sharded, or as a pickle, all match, and a model with
other weights (a fine-tune, another seed, another dtype) does not.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import normswap
from normswap import presets
from normswap.checkpoint import source
from normswap.cli import main


def run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def fp(spec: str | Path) -> str:
    return source.fingerprint(source.resolve(str(spec), allow_pickle=True))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("forms")
    forms = {
        "dir": presets.save("tiny-gpt2", root / "dir"),
        "sharded": presets.save("tiny-gpt2", root / "sharded", max_shard_size="100KB"),
        "seed": presets.save("tiny-gpt2", root / "seed", seed=1),
        "bf16": presets.save("tiny-gpt2", root / "bf16", dtype=torch.bfloat16),
    }
    pickled = Path(shutil.copytree(forms["dir"], root / "pickle"))
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    forms["pickle"] = pickled
    renamed = Path(shutil.copytree(forms["dir"], root / "reordered"))  # other key order and metadata
    tensors = load_file(renamed / "model.safetensors")
    save_file(dict(reversed(list(tensors.items()))), renamed / "model.safetensors", metadata={"format": "pt", "x": "y"})
    forms["reordered"] = renamed
    return forms


def test_the_same_weights_in_any_form_have_one_fingerprint(saved):
    assert len(list(saved["sharded"].glob("*.safetensors"))) > 1
    preset = fp("tiny-gpt2")
    assert preset.startswith(source.FINGERPRINT_SCHEME)
    for form in ("dir", "sharded", "pickle", "reordered"):
        assert fp(saved[form]) == preset, form


def test_other_weights_have_another_fingerprint(saved, tmp_path):
    preset = fp("tiny-gpt2")
    assert fp(saved["seed"]) != preset and fp(saved["bf16"]) != preset and fp("tiny-opt") != preset
    tuned = Path(shutil.copytree(saved["dir"], tmp_path / "tuned"))
    tensors = load_file(tuned / "model.safetensors")
    key = "transformer.h.1.mlp.c_fc.weight"
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[-1] += 1e-3  # one weight, at the end of one tensor
    save_file(tensors, tuned / "model.safetensors", metadata={"format": "pt"})
    assert fp(tuned) != preset


def test_verify_accepts_the_preset_and_its_saved_directory_either_way(saved, tmp_path):
    from_preset, from_dir = tmp_path / "from-preset", tmp_path / "from-dir"
    normswap.convert("tiny-gpt2", from_preset)
    normswap.convert(str(saved["dir"]), from_dir)
    for original, converted in (
        (saved["dir"], from_preset),
        ("tiny-gpt2", from_dir),
        (saved["sharded"], from_preset),
    ):
        code, out, err = run("verify", str(original), str(converted))
        assert code == 0 and "OK" in out and "fingerprint" not in err, (original, err)
    code, _, err = run("verify", str(saved["seed"]), str(from_preset))
    assert code == 1 and "was not converted from" in err and "--force" in err


def test_a_manifest_with_the_old_fingerprint_still_verifies(saved, tmp_path):
    """Checkpoints converted before the tensor fingerprint hold ``sha256:`` (by file bytes)."""
    import json

    out = tmp_path / "old"
    normswap.convert(str(saved["dir"]), out)
    cfg = json.loads((out / "config.json").read_text())
    src = source.resolve(str(saved["dir"]))
    cfg["normswap"]["source_fingerprint"] = source.legacy_fingerprint(src)
    (out / "config.json").write_text(json.dumps(cfg))
    assert source.same_source(cfg["normswap"]["source_fingerprint"], src)
    assert not source.same_source(cfg["normswap"]["source_fingerprint"], source.resolve(str(saved["seed"])))
    code, out_text, err = run("verify", str(saved["dir"]), str(out))
    assert code == 0 and "OK" in out_text, err
