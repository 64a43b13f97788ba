"""``float_nodes``: the ONNX nodes of a rotation's own matmuls (``Qᵀ`` of ``output="restore"``, online
Hadamards), found by value so ONNX Runtime's quantizers can leave them in float (``nodes_to_exclude``)."""

import warnings

import pytest
import torch
import transformers as tf

import normswap
from normswap.rotation.onnx_nodes import float_nodes
from normswap.rotation.rotate import rotate
from tests.zoo import randomise

onnx = pytest.importorskip("onnx")
quantization = pytest.importorskip("onnxruntime.quantization")


class Hidden(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).last_hidden_state


def _export(model: torch.nn.Module, x: torch.Tensor, path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(path), input_names=["x"], dynamo=False, opset_version=17)


def test_the_restore_matmul_is_found_and_stays_float_in_quantize_dynamic(tmp_path):
    torch.manual_seed(0)
    model = randomise(tf.Dinov2Model(tf.Dinov2Config(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=4, mlp_ratio=2))).float()
    px = torch.randn(2, 3, 32, 32)
    plain = tmp_path / "plain.onnx"
    _export(Hidden(model), px, plain)
    assert float_nodes(plain, model) == []  # nothing rotated: nothing to keep in float
    normswap.patch(model, fold_gamma=True)
    rotate(model, "hadamard", output="restore")
    path = tmp_path / "rot.onnx"
    _export(Hidden(model), px, path)
    found = float_nodes(path, model)
    assert len(found) == 1, found  # the one Qᵀ before the final norm; no layer's MatMul
    quantized = tmp_path / "rot.int8.onnx"
    quantization.quantize_dynamic(str(path), str(quantized), weight_type=quantization.QuantType.QInt8,
                                  nodes_to_exclude=found)
    nodes = {n.name: n.op_type for n in onnx.load(str(quantized)).graph.node}
    assert nodes[found[0]] == "MatMul"  # left as a float MatMul
    assert any(op == "MatMulInteger" for op in nodes.values())  # the layers were quantized


@pytest.mark.parametrize("inner", [96, 1024])
def test_online_hadamard_factors_are_found(tmp_path, inner):
    """MLP width 96 = 12·8: the online Hadamard is two matmuls, by the 8 × 8 Sylvester factor and by the 12 × 12
    one (``hadamard.hadamard_matmuls``), both found. Width 1,024 (a power of two above 256): two matmuls too, by
    ``H_256`` and ``H_4`` (``H_1024 = H_4 ⊗ H_256``), not a butterfly."""
    torch.manual_seed(0)
    model = randomise(tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=24, n_head=4, n_inner=inner, vocab_size=99,
                                                       n_positions=64))).float()
    normswap.patch(model, fold_gamma=True)
    rotate(model, "hadamard", online=True)

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(input_ids=x).logits

    path = tmp_path / "gpt2.onnx"
    _export(Logits(model), torch.randint(0, 99, (1, 8)), path)
    names = float_nodes(path, model)
    assert len(names) == 4, names  # two per down projection
    # the op's two matmuls in each MLP, not a layer (the Linears export as Gemm under c_fc / c_proj / c_attn)
    assert sorted(names) == [f"/m/transformer/h.{i}/mlp/MatMul{s}" for i in (0, 1) for s in ("", "_1")], names
