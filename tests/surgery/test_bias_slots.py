"""Bias slots: with ``fold_gamma``, a bias-less Linear reader (GPT-2's LM head) takes the norm's β as
``W β`` in a bias of its own instead of the norm keeping ``β/γ``; exact in float64, saved and reloaded
natively, moved back into the stock LayerNorm for the compat format."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import normswap
from normswap.analysis.plan import plan_of
from normswap.errors import NormswapError


def _gpt2(seed: int = 0) -> tuple[GPT2LMHeadModel, torch.Tensor]:
    torch.manual_seed(seed)
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=97, n_positions=32, bos_token_id=0,
                     eos_token_id=0)
    model = GPT2LMHeadModel(cfg).eval().double()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.normal_(0, 0.5)
        model.transformer.ln_f.weight[3] = 0.01  # the small γ that made β/γ a huge constant channel
        model.transformer.ln_f.bias[3] = -0.5
    return model, torch.randint(0, 97, (2, 12))


def test_bias_less_head_gets_a_slot_exact_in_float64_and_the_norm_keeps_no_constant():
    model, ids = _gpt2()
    ref = model(ids).logits
    conv = copy.deepcopy(model)
    normswap.patch(conv, fold_gamma=True)
    plan = plan_of(conv)
    assert [(s.site, s.reader) for s in plan.bias_slots] == [("transformer.ln_f", "lm_head")]
    assert conv.transformer.ln_f.bias is None and bool((conv.transformer.ln_f.weight == 1).all())
    w, g, b = model.lm_head.weight, model.transformer.ln_f.weight, model.transformer.ln_f.bias
    torch.testing.assert_close(conv.lm_head.bias, w @ b, rtol=0, atol=1e-12)
    assert "bias slot added to `lm_head`" in plan.site("transformer.ln_f").beta_detail
    assert (conv(ids).logits - ref).abs().max() < 1e-10
    normswap.rotate(conv, "hadamard")
    assert (conv(ids).logits - ref).abs().max() < 1e-10
    # without slots the norm keeps β/γ: 50 on the small-γ channel
    old = copy.deepcopy(model)
    normswap.patch(old, fold_gamma=True, bias_slots=False)
    assert not plan_of(old).bias_slots and old.lm_head.bias is None
    torch.testing.assert_close(old.transformer.ln_f.bias, b / g)
    assert float(old.transformer.ln_f.bias.detach().abs().max()) > 10 * float(b.detach().abs().max())
    assert (old(ids).logits - ref).abs().max() < 1e-10


def test_slot_is_committed_into_a_float32_user_model_and_reloads_natively(tmp_path):
    model, ids = _gpt2(1)
    ref = model(ids).logits
    user = copy.deepcopy(model).float()
    normswap.patch(user, fold_gamma=True)
    assert user.lm_head.bias is not None and user.lm_head.bias.dtype == torch.float32
    normswap.rotate(user, "hadamard")
    normswap.save(user, tmp_path / "native")
    back = normswap.load(tmp_path / "native")
    assert back.lm_head.bias is not None
    torch.testing.assert_close(back.lm_head.bias, user.lm_head.bias, rtol=0, atol=0)
    assert plan_of(back).bias_slots[0].reader == "lm_head"
    with torch.no_grad():
        assert (back(ids).logits.double() - ref).abs().max() < 1e-3
        torch.testing.assert_close(back(ids).logits, user(ids).logits, rtol=0, atol=1e-5)


def test_compat_moves_the_slot_back_into_the_stock_layernorm_exactly(tmp_path):
    model, ids = _gpt2(2)
    ref = model(ids).logits
    conv = copy.deepcopy(model)
    normswap.patch(conv, fold_gamma=True)
    rot = normswap.rotate(conv, "hadamard")
    q = rot.rotated[0]["q"]
    normswap.save(conv, tmp_path / "compat", format="compat")
    stock = AutoModelForCausalLM.from_pretrained(tmp_path / "compat", dtype=torch.float64).eval()
    assert stock.lm_head.bias is None and type(stock.transformer.ln_f).__name__ == "LayerNorm"
    g, b = model.transformer.ln_f.weight, model.transformer.ln_f.bias
    torch.testing.assert_close(stock.transformer.ln_f.bias, (b / g) @ q, rtol=1e-6, atol=1e-6)
    assert (stock(ids).logits - ref).abs().max() < 1e-8
    # a slot bias that is no longer W·(something) (trained since) cannot go back: one-line refusal
    with torch.no_grad():
        conv.lm_head.bias.add_(torch.randn_like(conv.lm_head.bias))
    with pytest.raises(NormswapError, match="bias slot .* cannot go back"):
        normswap.save(conv, tmp_path / "bad", format="compat")
    assert not (tmp_path / "bad").exists()


def test_cli_writes_the_slot_natively_and_no_bias_slots_keeps_the_old_layout(tmp_path):
    import json

    from click.testing import CliRunner
    from safetensors.torch import load_file

    from normswap.cli import main

    for flag, slot in (([], True), (["--no-bias-slots"], False)):
        out = tmp_path / f"slot-{slot}"
        res = CliRunner().invoke(main, ["convert", "tiny-gpt2", "--out", str(out), "-q", "--rotate", "hadamard",
                                        *flag])
        assert res.exit_code == 0, res.output
        tensors = load_file(str(out / "model.safetensors"))
        manifest = json.loads((out / "config.json").read_text())["normswap"]["plan"]
        assert ("lm_head.bias" in tensors) is slot
        assert bool(manifest["bias_slots"]) is slot and manifest["options"]["bias_slots"] is slot
        assert ("transformer.ln_f.bias" in tensors) is not slot
        normswap.load(out)  # rebuilds the slot before the weights load (strict)
