"""The patched GPTQ of ``benchmarks/ort_gptq.py``: its act-order on static groups, and its one-pass calibration.

What could be silently wrong: an act-order that rounds rows on grids other than their stored ``MatMulNBits``
block's (the store would then round them again), a GPTQ that is worse than round-to-nearest in the error it
minimises (the Hessian-weighted one), one that differs from round-to-nearest when there is nothing to feed back
(a diagonal Hessian), and a faster calibration that changes the Hessians (and so the quantized model).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests import benchmark_modules

gptq = benchmark_modules.load("ort_gptq")


def _rtn_sym(w: np.ndarray, group: int = 32) -> np.ndarray:
    """Round-to-nearest on the patched GPTQ's symmetric grid: per block of ``group`` input rows and output column,
    step ``2·max|w| / 15``, codes −8 … 7."""
    out = np.zeros_like(w, dtype=np.float64)
    for g in range(0, w.shape[0], group):
        b = w[g:g + group].astype(np.float64)
        s = 2 * np.abs(b).max(0) / 15
        out[g:g + group] = s * (np.clip(np.round(b / s) + 8, 0, 15) - 8)
    return out


def _layer(seed: int, k: int = 128, n: int = 16, tokens: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """A weight ``[k, n]`` and the Hessian ``2XᵀX/T`` of inputs with correlated features of unequal energy."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, k)) @ (np.eye(k) + 0.4 * rng.standard_normal((k, k)) / np.sqrt(k))
    x *= np.exp(rng.standard_normal(k))  # features of very different scale: act-order has an order to follow
    return rng.standard_normal((k, n)).astype(np.float32), 2 * x.T @ x / tokens


def _hessian_error(w: np.ndarray, q: np.ndarray, h: np.ndarray) -> float:
    d = w.astype(np.float64) - q
    return float(np.trace(d.T @ h @ d))


@pytest.mark.parametrize("actorder", [False, True])
def test_diagonal_hessian_is_round_to_nearest(actorder):
    """Nothing to feed back (independent inputs): GPTQ, in either order, is round-to-nearest on its grid."""
    w, _ = _layer(0)
    h = np.diag(np.random.default_rng(1).uniform(0.1, 10, w.shape[0]))
    gptq._GRIDS.clear()
    q = gptq.gptq_fixed(w, h, num_bits=4, group_size=32, scheme="sym", blocksize=64, actorder=actorder)
    gptq._GRIDS.clear()
    assert (w < 0).any(0).all()  # every block has a negative weight: the reference's grid is the same
    np.testing.assert_allclose(q, _rtn_sym(w), rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("actorder", [False, True])
def test_not_worse_than_round_to_nearest_in_the_hessian_error(seed, actorder):
    w, h = _layer(seed)
    gptq._GRIDS.clear()
    q = gptq.gptq_fixed(w, h.copy(), num_bits=4, group_size=32, scheme="sym", blocksize=64, actorder=actorder)
    gptq._GRIDS.clear()
    assert _hessian_error(w, q, h) < 0.95 * _hessian_error(w, _rtn_sym(w), h)


def test_actorder_keeps_every_row_on_its_stored_blocks_grid():
    """Act-order permutes the rows it rounds, not the blocks they are stored in: the codes and scales handed to
    ``MatMulNBits`` (blocks of 32 in the stored order) give back GPTQ's values exactly, with each block's scale
    the one of the unrounded weight's block."""
    w, h = _layer(3, k=96, n=24)
    assert not np.array_equal(np.argsort(np.diag(h))[::-1], np.arange(96))  # a real permutation
    gptq._GRIDS.clear()
    q = gptq.gptq_fixed(w, h, num_bits=4, group_size=32, scheme="sym", blocksize=64, actorder=True)
    codes, scale, zero = gptq.encode_exact(q.T.copy(), 4, 32, "sym", "uint")
    assert not gptq._GRIDS
    assert codes.min() >= 0 and codes.max() <= 15
    np.testing.assert_allclose(((codes - zero) * scale).reshape(24, 96).T, q, rtol=0, atol=1e-12)
    static = 2 * np.abs(w.astype(np.float64).reshape(3, 32, 24)).max(1) / 15  # [group, out]
    np.testing.assert_allclose(scale.reshape(24, 3).T, static, rtol=1e-12)


def test_actorder_not_worse_than_stored_order_on_uneven_features():
    """Act-order's point: the features with the most energy rounded first, their error fed to the rest."""
    errs = {a: [] for a in (False, True)}
    for seed in range(4):
        w, h = _layer(seed)
        for a in errs:
            gptq._GRIDS.clear()
            errs[a].append(_hessian_error(w, gptq.gptq_fixed(w, h.copy(), 4, 32, "sym", 64, actorder=a), h))
    gptq._GRIDS.clear()
    assert sum(errs[True]) < sum(errs[False])


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.up = torch.nn.Linear(64, 96)
        self.down = torch.nn.Linear(96, 64)
        self.head = torch.nn.Linear(64, 32)
        with torch.no_grad():
            for lin in (self.up, self.down, self.head):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.down(torch.relu(self.up(x)))) + x)


def _initializers(path) -> dict:  # noqa: ANN001
    import onnx
    from onnx import numpy_helper

    return {i.name: numpy_helper.to_array(i) for i in onnx.load(str(path)).graph.initializer}


def test_one_pass_calibration_gives_onnx_runtimes_model_to_the_bit(tmp_path):
    """The calibration run once per batch (every weight input fetched together) against ONNX Runtime's own loop
    (the whole calibration set once per weight input), both with the two fixes: the same ``MatMulNBits`` codes,
    scales and graph; an excluded node stays float in both."""
    pytest.importorskip("onnxruntime")
    import onnx

    fp32 = tmp_path / "mlp.onnx"
    torch.onnx.export(_Mlp().eval(), (torch.randn(2, 5, 64),), str(fp32), input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "b", 1: "t"}}, dynamo=False, opset_version=17)
    g = torch.Generator().manual_seed(1)
    feeds = [{"x": (torch.randn(2, 7, 64, generator=g) * torch.linspace(0.1, 3, 64)).numpy()} for _ in range(3)]
    head = [n.name for n in onnx.load(str(fp32)).graph.node if n.op_type == "MatMul"][-1]  # graph order: the head
    outs = {}
    for one_pass in (False, True):
        with gptq.patched(one_pass=one_pass):
            q = gptq.Excluding(str(fp32), block_size=32, is_symmetric=True, algo_config=gptq.config(feeds),
                               nodes_to_exclude=[head])
            q.process()
        outs[one_pass] = tmp_path / f"q{int(one_pass)}.onnx"
        q.model.save_model_to_file(str(outs[one_pass]), use_external_data_format=False)
    a, b = _initializers(outs[False]), _initializers(outs[True])
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    ops = [[n.op_type for n in onnx.load(str(p)).graph.node] for p in outs.values()]
    assert sorted(ops[0]) == sorted(ops[1])
    assert ops[1].count("MatMulNBits") == 2 and "MatMul" in ops[1]  # up and down quantized, the head float
    assert [o.name for o in onnx.load(str(outs[True])).graph.output] == ["y"]
