"""PEFT's ``AutoPeftModelForCausalLM`` on an adapter trained over a normswap checkpoint.

With ``task_type="CAUSAL_LM"`` in the LoRA config (PEFT's usual setup) the base loads through
``AutoModelForCausalLM``, which knows ``normswap_*`` model types after ``import normswap``. Without a
task type PEFT records the base class's module (``normswap.checkpoint.hf``) and wants it allowlisted:
``import_allowlist=["normswap"]`` is the one line (README, compatibility table).
"""

from __future__ import annotations

import pytest
import torch

import normswap
from tests.zoo import EXACT, build

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    model = build(EXACT, "gpt2").float()
    normswap.patch(model)
    out = tmp_path_factory.mktemp("peft") / "base"
    normswap.checkpoint.save(model, out)
    return out


@pytest.mark.parametrize("task_type", ["CAUSAL_LM", None])
def test_auto_peft_model_loads_normswap_base(base_dir, tmp_path, task_type):
    from peft import AutoPeftModelForCausalLM, LoraConfig, get_peft_model

    model = normswap.load(base_dir)
    config = LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False, task_type=task_type)
    peft_model = get_peft_model(model, config).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        ref = peft_model(input_ids=ids).logits
    extra = {} if task_type else {"import_allowlist": ["normswap"]}
    loaded = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", **extra).eval()
    assert any(isinstance(m, normswap.RMSNorm) for m in loaded.modules())
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, ref)


def test_normswap_save_of_a_peft_model_says_how_to_save_it(base_dir, tmp_path):
    """Fails without the check: on a converted base it failed as "I/O error on OUT: No such file or
    directory" (PEFT's save_pretrained writes no config.json), and on an unconverted one it asked for
    normswap.patch, which refuses PEFT models."""
    from peft import LoraConfig, get_peft_model

    for model in (normswap.load(base_dir), build(EXACT, "gpt2").float()):
        peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["c_attn"]))
        with pytest.raises(normswap.NormswapError, match=r"writes a whole model, and PeftModel is a PEFT model "
                                                         r"\(PeftModel\): merge the adapters first"):
            normswap.save(peft_model, tmp_path / "out")
        assert not list(tmp_path.iterdir())
