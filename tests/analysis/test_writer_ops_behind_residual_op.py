"""``writer_centering="op"`` on a model whose first block's attention reads the raw stream (ModernBERT: its first
layer's ``attn_norm`` is ``Identity``), found by round 61's ``--quantizer`` sweep.

The stream there is centered by one op on the residual sum ``x + attn(x)``, installed on the attention module. The
option then put the output projection's own op on the same module's output; run after the sum's op, it subtracted
the output's mean again and undid it: ``quantizer="openvino-int8"`` (``torchao``, or ``writer_centering="op"``)
was refused by verification ("planned exact but its input is not zero-mean"), where the defaults convert exactly.
What could be silently wrong: the refusal; two ops on one module's output; the writer's weights edited although an
op already centers what it adds; the conversion not exact.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import normswap
from normswap.analysis.plan import plan_of
from tests.zoo import randomise

TOL = 1e-10
EXACT = ("exact", "exact-with-centering", "exact-with-per-norm-centering")


def _modernbert() -> torch.nn.Module:
    """Tiny, with transformers' default attention (SDPA): the output projection's first op place is then the
    attention module's output, the module the residual sum's op sits on (with eager attention it is ``Wo``'s)."""
    from transformers import ModernBertConfig, ModernBertModel

    config = ModernBertConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=64, local_attention=8,
                              global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              cls_token_id=1, sep_token_id=2)
    return randomise(ModernBertModel(config).double().eval(), seed=3)


def _ids(seed: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(3, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def converted() -> tuple[torch.nn.Module, dict[str, torch.nn.Module]]:
    model = _modernbert()
    out = {}
    for name, options in {"op": {"writer_centering": "op"}, "openvino-int8": {"quantizer": "openvino-int8"}}.items():
        conv = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            normswap.patch(conv, {"input_ids": _ids(1, 2, 9)}, **options)  # verification on: raises if not exact
        out[name] = conv
    return model, out


@pytest.mark.parametrize("option", ["op", "openvino-int8"])
def test_one_op_per_module_output_and_every_writer_keeps_its_weights(converted, option):
    model, conv = converted[0], converted[1][option]
    plan = plan_of(conv)
    assert all(s.verdict in EXACT for s in plan.sites), plan.table()
    places = [(h.module, h.where) for h in plan.hooks if h.where in ("output", "residual")]
    assert len({m for m, _ in places}) == len(places), places  # never two ops after one module
    assert ("layers.0.attn", "residual") in places and any(h.writer for h in plan.hooks)
    for name in ("layers.0.attn.Wo.weight", "layers.0.mlp.Wo.weight", "layers.1.attn.Wo.weight"):
        assert torch.equal(model.get_parameter(name), conv.get_parameter(name)), name


@pytest.mark.parametrize("option", ["op", "openvino-int8"])
def test_the_conversion_is_exact_at_two_shapes(converted, option):
    model, conv = converted[0], converted[1][option]
    for seed, batch, seq in ((3, 1, 5), (4, 2, 11)):
        ids = _ids(seed, batch, seq)
        with torch.no_grad():
            ref, out = model(input_ids=ids).last_hidden_state, conv(input_ids=ids).last_hidden_state
        assert float((out - ref).abs().max()) <= TOL * max(1.0, float(ref.abs().max())), option
