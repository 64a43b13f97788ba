"""A model patched in memory saves correctly through ``save_pretrained`` and ``Trainer.save_model``.

Before issue 15 both wrote the stock config with RMSNorm weights under LayerNorm names; the directory
loaded back with LayerNorms and without the RMSNorm biases (logits off by ~3.5e-2).
"""

from __future__ import annotations

import json

import pytest
import torch

import normswap
from tests.zoo import APPROXIMATE, EXACT, build


def _inputs():
    return {"input_ids": torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])}


def _logits(model):
    with torch.no_grad():
        return model(**_inputs()).logits


@pytest.fixture(scope="module", params=["gpt2", "bert"])
def patched(request):
    table = APPROXIMATE if request.param == "bert" else EXACT
    model = build(table, request.param).float()
    normswap.patch(model, mode="all", calibration=False)  # calibration does not matter for saving
    assert any(isinstance(b, normswap.RMSNorm) and b.bias is not None for b in model.modules()) or \
        request.param == "gpt2"
    return model


def _check_reload(model, path):
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"].startswith("normswap_")
    assert "normswap" in cfg and "auto_map" in cfg
    reloaded = normswap.load(path).eval()
    assert sum(isinstance(m, normswap.RMSNorm) for m in reloaded.modules()) == \
        sum(isinstance(m, normswap.RMSNorm) for m in model.modules())
    assert torch.equal(_logits(reloaded), _logits(model))


def test_save_pretrained_writes_native(patched, tmp_path):
    before = {k: v.clone() for k, v in patched.state_dict().items()}
    patched.save_pretrained(tmp_path / "out")
    _check_reload(patched, tmp_path / "out")
    assert all(torch.equal(before[k], v) for k, v in patched.state_dict().items())  # model untouched


def test_trainer_save_model_writes_native(patched, tmp_path):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "run"), report_to=[], use_cpu=True)
    trainer = Trainer(model=patched, args=args)
    trainer.save_model(str(tmp_path / "saved"))
    _check_reload(patched, tmp_path / "saved")


def test_patched_class_is_the_loaded_class(tmp_path):
    model = build(EXACT, "gpt2").float()
    cls = type(model)
    normswap.patch(model)
    assert isinstance(model, cls) and type(model) is not cls
    model.save_pretrained(tmp_path / "d")
    assert type(normswap.load(tmp_path / "d")) is type(model)
