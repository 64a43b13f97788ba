"""Online Hadamard rotations (QuaRot's, on every MLP down projection's input): outputs unchanged in
float64, saved and rebuilt by the native format, exported with stock ops only."""

import pytest
import torch

import normswap
from normswap.inputs import hf_example_inputs
from normswap.pipeline import default_dtype
from normswap.rotation.rotate import HADAMARD_BUFFER, OnlineHadamard, rotate
from tests.integrations.compat import Positional
from tests.zoo import EXACT, RMS, build

CASES = {"gpt2": (EXACT, "mlp.c_proj", 1e-9), "opt": (EXACT, "fc2", 1e-9),
         # Llama's own RMSNorm computes in float32 whatever the input dtype
         "llama": (RMS, "mlp.down_proj", 1e-5)}


def _rotated_online(model):
    """Fold γ, rotate with online Hadamards; the probe and the float64 logits before and after."""
    normswap.patch(model, fold_gamma=True)
    probe = hf_example_inputs(model, seed=5)
    with torch.no_grad(), default_dtype(torch.float64):
        ref = model(**probe).logits
        rot = rotate(model, "hadamard", online=True)
        out = model(**probe).logits
    return probe, ref, rot, out


@pytest.mark.parametrize("name", sorted(CASES))
def test_online_hadamard_before_every_down_projection_keeps_outputs(name):
    table, down, tol = CASES[name]
    model = build(table, name)
    probe, ref, rot, out = _rotated_online(model)
    (stream,) = rot.rotated
    assert len(stream["online"]) == 2 and all(p.endswith(down) for p in stream["online"])
    assert float((out - ref).abs().max() / ref.abs().max()) <= tol
    # the op does the work: without it the folded Hᵀ alone breaks the model
    module = model.get_submodule(stream["online"][0])
    module._normswap_online.remove()
    with torch.no_grad(), default_dtype(torch.float64):
        broken = model.forward(**probe).logits  # past the model's guard, which refuses it (round 52)
    assert float((broken - ref).abs().max() / ref.abs().max()) > 1e-3


def test_online_rotation_survives_a_native_checkpoint_and_exports_with_stock_ops(tmp_path):
    model = build(EXACT, "gpt2")
    normswap.patch(model, fold_gamma=True)
    probe = hf_example_inputs(model, seed=5)
    rotate(model, "hadamard", online=True)
    with torch.no_grad():
        ref = model(**probe).logits
    normswap.checkpoint.save(model, tmp_path / "ckpt")
    loaded = normswap.load(tmp_path / "ckpt").double().eval()
    assert normswap.plan_of(loaded).rotations[0]["online"] == ["transformer.h.0.mlp.c_proj",
                                                                "transformer.h.1.mlp.c_proj"]
    assert hasattr(loaded.get_submodule("transformer.h.0.mlp.c_proj"), HADAMARD_BUFFER)
    with torch.no_grad():
        again = loaded(**probe).logits
    assert torch.equal(again, ref)

    inputs = {"input_ids": probe["input_ids"]}
    ep = torch.export.export(Positional(loaded, inputs), (probe["input_ids"],))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not any("normswap" in t for t in targets), targets
    with torch.no_grad():
        exported = ep.module()(probe["input_ids"])
    assert float((exported - ref).abs().max() / ref.abs().max()) <= 1e-12


def test_online_skips_a_down_projection_without_a_hadamard_order_and_says_so():
    import transformers as tf

    from tests.zoo import randomise

    torch.manual_seed(0)
    model = randomise(tf.OPTForCausalLM(tf.OPTConfig(hidden_size=32, num_hidden_layers=1, ffn_dim=30,
                                                     num_attention_heads=4, vocab_size=50, word_embed_proj_dim=32,
                                                     max_position_embeddings=64)))
    model = model.double()
    normswap.patch(model, fold_gamma=True)
    probe = hf_example_inputs(model, seed=5)
    with torch.no_grad():
        ref = model(**probe).logits
        rot = rotate(model, "hadamard", online=True)
        out = model(**probe).logits
    assert rot.rotated[0]["online"] == [] and "no Hadamard matrix of order 30" in rot.online_skipped[0]
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-9


def test_per_head_hadamard_on_values_folds_into_value_and_output_projections():
    model = build(RMS, "mistral")  # grouped-query heads: 2 value heads serve 4 query heads
    probe, ref, rot, out = _rotated_online(model)
    (stream,) = rot.rotated
    assert len(stream["value_heads"]) == 2 and stream["head_dim"] == 8
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-5
    # undoing the value side alone breaks the model: the output projections really hold H̃
    attn = model.get_submodule(stream["value_heads"][0])
    from normswap.rotation import hadamard

    h = hadamard.hadamard(8) / 8**0.5
    with torch.no_grad():
        w = attn.v_proj.weight
        w.copy_((h @ w.reshape(-1, 8, w.shape[1])).reshape(w.shape))  # turn each head once more
        broken = model(**probe).logits
    assert float((broken - ref).abs().max() / ref.abs().max()) > 1e-3


def test_vision_backbone_with_a_linear_reader_after_its_last_norm_rotates_whole():
    """A DINOv2 backbone (LayerScale, interpolated positions, cls token) with a Linear on its CLS output:
    the whole stream turns, the down projections get online Hadamards, the values per-head ones
    (BERT/ViT layout: attention.value and output.dense)."""
    import transformers as tf
    from torch import nn

    from tests.zoo import MORE, randomise

    torch.manual_seed(0)
    _, config = MORE["dinov2"][0]()

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = randomise(tf.Dinov2Model(config))
            self.fc = nn.Linear(config.hidden_size, 10)

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            return self.fc(self.backbone(pixel_values=pixel_values).last_hidden_state[:, 0])

    model = Probe().double().eval()
    x = torch.randn(2, 3, config.image_size, config.image_size, dtype=torch.float64)
    normswap.patch(model, example_inputs=(x,), fold_gamma=True)
    with torch.no_grad():
        ref = model(x)
        rot = rotate(model, "hadamard", online=True)
        out = model(x)
    (stream,) = rot.rotated
    assert not rot.skipped and len(stream["online"]) == 2 and len(stream["value_heads"]) == 2
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-9


def test_rotating_twice_composes_ops_and_adds_online_hadamards_once():
    model = build(EXACT, "opt")
    normswap.patch(model, fold_gamma=True)
    probe = hf_example_inputs(model, seed=5)
    with torch.no_grad(), default_dtype(torch.float64):
        ref = model(**probe).logits
        first = rotate(model, "hadamard", online=True)
        second = rotate(model, "random", seed=4, online=True)
        out = model(**probe).logits
    assert first.rotated[0]["online"] and not second.rotated[0]["online"]  # already there
    assert first.rotated[0]["value_heads"] and "value_heads" not in second.rotated[0]
    assert float((out - ref).abs().max() / ref.abs().max()) <= 1e-9
    assert len(normswap.plan_of(model).rotations) == 2


def test_the_online_hadamard_spreads_a_per_token_mean():
    """An MLP down projection reads GELU outputs with a large per-token mean; a plain Hadamard would put it
    all on one coordinate (max/rms = sqrt(n) for a constant vector). The random signs spread it."""
    model = build(EXACT, "gpt2")
    normswap.patch(model, fold_gamma=True)
    rot = rotate(model, "hadamard", online=True)
    assert normswap.plan_of(model).rotations[0]["online_signs"]
    module = model.get_submodule(rot.rotated[0]["online"][0])
    n = module.weight.shape[0]  # Conv1D: [in, out]
    (turned,) = OnlineHadamard()(module, (torch.ones(1, n, dtype=module.weight.dtype),))
    ratio = float(turned.abs().max() / turned.pow(2).mean().sqrt())
    assert ratio < 0.5 * n**0.5, ratio  # a plain Hadamard gives exactly sqrt(n)
