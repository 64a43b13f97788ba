"""The online Hadamard's eager form (``normswap.rotation.eager_op.EagerOp``, what the op's hook runs outside graph
capture): the op's transform ``x·D·H̃`` in float64 to 1e-12 for full ops (widths with and without a Paley factor,
one row and many, 2-d and 3-d inputs) and block-diagonal ones; a 2-byte dtype keeps the scale out of its
rounded matrix (the output's norm is the input's, no factor off); the constants are made once and reused, and made
again when the buffers change in place (``load_state_dict``) or are replaced (``.to``); inference-tensor buffers and
widths beyond the dense ``2^m`` factor take the stock form; a traced graph holds the stored factors, not the eager
constants."""

import pytest
import torch
from torch import nn

import normswap
from normswap.inputs import hf_example_inputs
from normswap.rotation import hadamard
from normswap.rotation.eager_op import EagerOp, split
from normswap.rotation.rotate import HADAMARD_BUFFER, SIGNS_BUFFER, OnlineHadamard, _install_online, rotate
from tests.benchmark_modules import tiny_dinov2


def op_module(n: int, block: int | None = None, seed: int = 0, dtype=torch.float64) -> nn.Module:
    """A bare module holding one online op after a norm of width ``n`` (full, or blocks of ``block``)."""
    module = nn.Module()
    factor = hadamard.sylvester(block) if block else hadamard.small_factor(n)
    _install_online(module, factor.to(dtype), hadamard.random_signs(n, seed).to(dtype), width=n)
    return module


def reference(n: int, block: int | None = None, seed: int = 0) -> torch.Tensor:
    """``D·H̃`` in float64 from the definitions."""
    h = hadamard.block_hadamard(n, block) if block else hadamard.hadamard(n) / n**0.5
    return hadamard.random_signs(n, seed).unsqueeze(1) * h


def hook_of(module: nn.Module) -> OnlineHadamard:
    (hook,) = module._forward_hooks.values()
    return hook


@pytest.mark.parametrize(("n", "block"), [(384, None), (768, None), (20, None), (64, None), (1536, None),
                                          (384, 32), (1536, 32), (64, 4)])
@pytest.mark.parametrize("rows", [1, 4, 37])
def test_eager_op_is_the_transform_in_float64(n, block, rows):
    module = op_module(n, block)
    x = torch.randn(rows, 3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(rows))[:, 0]
    want = x @ reference(n, block)
    got = hook_of(module).transform(module, x)
    assert float((got - want).abs().max()) <= 1e-12
    (op,) = hook_of(module).eager_ops.values()  # the eager form ran, not the stock one
    assert isinstance(op, EagerOp)
    # a 3-d input and the stock form agree with it too
    x3 = torch.randn(2, 5, n, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert float((hook_of(module).transform(module, x3) - x3 @ reference(n, block)).abs().max()) <= 1e-12


def test_the_full_op_splits_its_pow2_factor_for_fewer_multiply_adds():
    """``H_K ⊗ H_{2^m}`` runs as ``(H_K ⊗ H_{2^m/b}) ⊗ H_b``: ``b + K·2^m/b`` multiply-adds per feature, never more
    than the stock form's ``2^m + K``; at width 1,536 (``H_12 ⊗ H_128``) 80 instead of 140."""
    assert split(12, 128) == 32 and split(12, 32) == 32
    for k in (1, 12, 20, 172):
        for m in (1, 2, 8, 32, 64, 128, 256):
            b = split(k, m)
            assert b & (b - 1) == 0 and m % b == 0 and b + k * m // b <= m + k, (k, m, b)
    module = op_module(1536)
    (op,) = [EagerOp.of(getattr(module, HADAMARD_BUFFER), getattr(module, SIGNS_BUFFER),
                        torch.ones(1, 1536, dtype=torch.float64))]
    assert op.first.shape == (32, 32) and op.second.shape == (48, 48)


@pytest.mark.parametrize(("n", "block"), [(448, None), (384, 32)])
def test_a_two_byte_dtype_keeps_the_scale_out_of_the_rounded_matrix(n, block):
    """In bfloat16 a folded scale rounds by up to 0.4% (``448^-½``, ``H_28 ⊗ H_16``: by 0.25%), and every output
    would be that much too large or small; the op is orthogonal, so over many rows the output's norm must be the
    input's."""
    module = op_module(n, block, dtype=torch.bfloat16)
    for rows in (1, 256):
        x = torch.randn(rows, n, generator=torch.Generator().manual_seed(2)).bfloat16()
        y = hook_of(module).transform(module, x)
        assert y.dtype == torch.bfloat16
        ratio = float(y.float().norm() / x.float().norm())
        assert abs(ratio - 1) <= 1e-3, (rows, ratio)
        want = x.double() @ reference(n, block)
        assert float((y.double() - want).abs().max() / want.abs().max()) <= 2e-2


def test_constants_are_made_once_and_again_when_the_buffers_change():
    n = 384
    module = op_module(n, dtype=torch.float32)
    hook = hook_of(module)
    x = torch.randn(8, n, generator=torch.Generator().manual_seed(3))
    hook.transform(module, x)
    (op,) = hook.eager_ops.values()
    hook.transform(module, x)
    assert hook.eager_ops[(x.device, x.dtype)] is op  # reused
    # load_state_dict copies into the buffers in place: the op must follow the new signs
    state = {k: v.clone() for k, v in module.state_dict().items()}
    state[SIGNS_BUFFER] = -state[SIGNS_BUFFER]
    module.load_state_dict(state)
    y = hook.transform(module, x)
    want = x.double() @ (-reference(n))
    assert float((y.double() - want).abs().max()) <= 1e-5
    assert hook.eager_ops[(x.device, x.dtype)] is not op
    # a cast replaces the buffers; float64 calls get their own constants, the float32 ones are dropped
    module.double()
    y = hook.transform(module, x.double())
    assert float((y - want).abs().max()) <= 1e-12
    assert list(hook.eager_ops) == [(x.device, torch.float64)]


def test_inference_tensor_buffers_take_the_stock_form():
    n = 96
    with torch.inference_mode():
        module = op_module(n)
    x = torch.randn(4, n, dtype=torch.float64)
    assert float((hook_of(module).transform(module, x) - x @ reference(n)).abs().max()) <= 1e-12
    assert not hook_of(module).eager_ops


@pytest.mark.parametrize("n", [2 * 12 * 256, 2048])  # K = 12, 2^m = 512; K = 1, 2^m = 2,048
def test_a_pow2_factor_above_the_dense_limit_runs_eager_and_exports_as_matmuls(n):
    """Above :data:`hadamard.POW2_DENSE_MAX` the op is still exact in its eager form and in the stock form a
    graph captures, and the stock form is two matmuls (``(H_K ⊗ H_r) ⊗ H_b``, the eager form's split; round 51's
    ``H_K ⊗ H_r ⊗ H_256`` was three where ``K > 1``), not a butterfly's dozens of nodes."""
    module = op_module(n)
    hook = hook_of(module)
    x = torch.randn(2, 3, n, dtype=torch.float64)
    want = x @ reference(n)
    assert float((hook.transform(module, x) - want).abs().max()) <= 1e-12
    assert list(hook.eager_ops) == [(x.device, x.dtype)]
    traced = torch.jit.trace(lambda t: hook.transform(module, t), x, check_trace=False)
    assert torch.allclose(traced(x), want, rtol=0, atol=1e-12)
    kinds = [node.kind() for node in traced.graph.nodes()]
    assert kinds.count("aten::matmul") == 2, kinds
    assert "aten::cat" not in kinds  # no butterfly stage


def test_online_model_after_inference_mode_still_trains_and_keeps_its_constants():
    """Constants made while the model first ran under ``torch.inference_mode`` must not be inference tensors,
    or training afterwards fails; and the model stays exact in float64 through the eager form."""
    model = tiny_dinov2(seed=3).float()
    probe = hf_example_inputs(model, seed=5)
    normswap.patch(model, beta_placement="keep")
    rotate(model, "none", online=True, seed=4)
    with torch.inference_mode():
        model(**probe)
    fc1 = model.get_submodule("encoder.layer.0.mlp.fc1")
    (hook,) = [h for h in fc1._forward_pre_hooks.values() if isinstance(h, OnlineHadamard)]
    (op,) = hook.eager_ops.values()
    assert not op.first.is_inference() and not op.s.is_inference()
    model.train()
    model(**probe).last_hidden_state.square().mean().backward()
    assert fc1.weight.grad is not None and torch.isfinite(fc1.weight.grad).all()
    assert next(iter(hook.eager_ops.values())) is op


def test_a_traced_graph_holds_the_stored_factor_not_the_eager_constants():
    module = op_module(384, dtype=torch.float32)

    class Op(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = module

        def forward(self, x):
            return hook_of(module).transform(module, x)

    x = torch.randn(2, 384)
    traced = torch.jit.trace(Op(), (x,), check_trace=False)
    consts = [n.output().toIValue() for n in traced.graph.nodes() if n.kind() == "prim::Constant" and
              n.output().type().kind() == "TensorType"]
    # the stock form's ±1 H_32 (H_12 is read from the module's buffer), not the eager form's scaled factors
    assert any(c.shape == (32, 32) and bool((c.abs() == 1).all()) for c in consts)
    assert not any(bool((c.abs() - 384**-0.5).abs().max() < 1e-6) for c in consts
                   if isinstance(c, torch.Tensor) and c.numel() > 1)  # the scale is a multiply in the trace
    assert not hook_of(module).eager_ops
    assert torch.allclose(traced(x), x @ reference(384).float(), atol=1e-5)
    assert getattr(module, HADAMARD_BUFFER).shape == (12, 12)


@pytest.mark.parametrize("n", [384, 1536, 512, 2048, 96, 20, 448])
def test_the_stock_form_runs_the_eager_split_exactly(n):
    """The stock form (what ``torch.compile`` and the exporters capture) runs the eager form's split
    ``(H_K ⊗ H_{2^m/b}) ⊗ H_b``, ``b = split(K, 2^m)``, with the scale folded into ``H_b``: the transform in float64 to
    1e-12, two matmuls whose factors are ``b × b`` and ``n/b × n/b`` (width 1,536: 32 and 48, where round 51's
    stock form multiplied by ``H_128`` and ``H_12``; width 2,048: 64 and 32, where it was ``H_256``, ``H_8``,
    ``H_1``), and no multiply by the scale after them."""
    module = op_module(n)
    hook = hook_of(module)
    x = torch.randn(2, 3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    assert float((hook.stock(module, x) - x @ reference(n)).abs().max()) <= 1e-12
    k = getattr(module, HADAMARD_BUFFER).shape[0]
    b = split(k, n // k)
    traced = torch.jit.trace(lambda t: hook.stock(module, t), x, check_trace=False)
    assert float((traced(x) - x @ reference(n)).abs().max()) <= 1e-12
    nodes = list(traced.graph.nodes())
    shapes = sorted(tuple(t.type().sizes()) for node in nodes if node.kind() == "aten::matmul"
                    for t in node.inputs() if t.type().kind() == "TensorType" and t.type().sizes()
                    and len(t.type().sizes()) == 2)
    assert shapes == sorted([(b, b), (n // b, n // b)]), shapes
    last = [node.kind() for node in nodes if node.kind().startswith("aten::")][-1]
    assert last in ("aten::reshape_as", "aten::reshape"), last  # the output is the matmul's, reshaped: no scale Mul
