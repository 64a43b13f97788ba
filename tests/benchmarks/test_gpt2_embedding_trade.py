"""``benchmarks/gpt2_embedding_trade.py``'s hand-made trades on a tiny GPT-2: exact (every token's sum of the two
tables unchanged, the model's outputs equal to the float64 original), and the only difference from the default
conversion is in the two tables, so the benchmark's claim that only a quantizer rounding them can tell the
variants apart holds. ``fake_quant``'s per-tensor grid is ONNX Runtime's dynamic ``Gather`` one (uint8, zero in
range, exactly representable)."""

from __future__ import annotations

import copy
import warnings

import torch
import transformers as tf

import normswap
from tests import benchmark_modules

bench = benchmark_modules.load("gpt2_embedding_trade")


def _tiny() -> torch.nn.Module:
    torch.manual_seed(0)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=40))
    model = model.double().eval()
    with torch.no_grad():  # tables with a common row mean, so a trade moves something
        model.transformer.wpe.weight.add_(0.3)
        model.transformer.wte.weight.sub_(0.1)
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.2, 0.2)
    return model


def test_hand_trades_are_exact_and_touch_only_the_tables():
    original = _tiny()
    native = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = normswap.patch(native, untie=True)
    assert report.plan.constant_trades == []  # the rule proposes none on GPT-2
    ids = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = original(input_ids=ids).logits
    for keeper in ("wpe", "wte"):
        tables = bench.traded(native, original, keeper)
        model = copy.deepcopy(native)
        with torch.no_grad():
            for t in ("wte", "wpe"):
                moved = (tables[t] - getattr(native.transformer, t).weight).abs().max()
                assert moved > 1e-3  # the trade moves both tables by the constant
                getattr(model.transformer, t).weight.copy_(tables[t])
            out = model(input_ids=ids).logits
        assert (out - ref).abs().max() <= 1e-9 * ref.abs().max()
        sd, nd = model.state_dict(), native.state_dict()
        assert [k for k in sd if not torch.equal(sd[k], nd[k])] == ["transformer.wte.weight", "transformer.wpe.weight"]


def test_per_tensor_grid_is_uint8_with_zero_on_it():
    t = torch.randn(50, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) + 0.7
    q = bench.fake_quant(t, "emb-pt")
    step = (float(t.max()) - min(float(t.min()), 0.0)) / 255
    assert len(torch.unique(q)) <= 256
    assert (q - t).abs().max() <= step / 2 + 1e-12
    levels = q / step
    assert (levels - levels.round()).abs().max() <= 1e-9  # zero is a level: the grid is k · step
