"""``rotate(..., online=True, online_block=b)``: block-diagonal online Hadamards ``x·D·(I ⊗ H_b)/sqrt(b)`` on every
op whose width is a multiple of ``b`` larger than ``b`` (the others full). Exact in float64 (≤ 1e-9) on a DINOv2
replica (γ/β/λ randomised) for each block size and on GPT-2 with a tied and an untied head; each op's matrix is
orthogonal (1e-12) and equal to ``D·(I ⊗ H_b)/sqrt(b)``; the native format saves and rebuilds it (the manifest
says which widths took the block); the exported ONNX op is one MatMul by ``H_b``; bad blocks are refused (API,
``patch``, CLI exit 2) with the model untouched and nothing written."""

import pytest
import torch

import normswap
from normswap.errors import NormswapError, UsageError
from normswap.inputs import hf_example_inputs
from normswap.rotation import hadamard
from normswap.rotation.rotate import HADAMARD_BUFFER, POW2_ATTR, SIGNS_BUFFER, OnlineHadamard, rotate
from tests.benchmark_modules import tiny_dinov2
from tests.rotation.test_rotate_online_only import _relative, _run
from tests.zoo import EXACT, build


def saved_and_loaded(tmp_path, **online):
    """A tiny DINOv2 with the online Hadamards alone (``rotate(model, "none", online=True, **online)``), saved
    natively and loaded back: ``(loaded, probe, ref)``, ``ref`` the rotated model's output before saving."""
    model = tiny_dinov2(seed=3)
    probe = hf_example_inputs(model, seed=5)
    normswap.patch(model, beta_placement="keep")
    rotate(model, "none", online=True, **online)
    ref = _run(model, probe)
    normswap.save(model, tmp_path / "ckpt")
    return normswap.load(tmp_path / "ckpt").double().eval(), probe, ref


def _op_matrix(module):
    """The op as a dense matrix: the installed hook's transform applied to the identity."""
    n = getattr(module, SIGNS_BUFFER).shape[0]
    return OnlineHadamard().transform(module, torch.eye(n, dtype=torch.float64))


def _ops(entry):
    return entry["online"] + [o["norm"] for o in entry["online_outputs"]]


def _width(model, path):
    return getattr(model.get_submodule(path), SIGNS_BUFFER).shape[0]


@pytest.mark.parametrize("block", [4, 16, 32, 64])
def test_block_diagonal_ops_keep_dinov2_exact_and_are_the_block_matrix(block):
    model = tiny_dinov2(seed=3)  # widths: 32 (norm outputs), 128 (fc2's input)
    probe = hf_example_inputs(model, seed=5)
    ref = _run(model, probe)
    normswap.patch(model, beta_placement="keep")
    rot = rotate(model, "none", online=True, seed=4, online_block=block)
    assert _relative(_run(model, probe), ref) <= 1e-9, str(rot)
    (entry,) = rot.rotated
    widths = sorted(w for w in (32, 128) if w > block)
    assert entry["online_block"] == block and entry["online_block_widths"] == widths
    assert f"blocks of {block} at width(s) {', '.join(map(str, widths))}" in rot.headline()
    for path in _ops(entry):
        module = model.get_submodule(path)
        n, g = _width(model, path), _op_matrix(module)
        assert float((g.T @ g - torch.eye(n, dtype=torch.float64)).abs().max()) <= 1e-12
        d = torch.diag(getattr(module, SIGNS_BUFFER).double())
        if n in widths:  # D·(I ⊗ H_b)/sqrt(b): zero outside the diagonal blocks, every entry ±b^-½ inside
            want = d @ hadamard.block_hadamard(n, block)
            assert getattr(module, HADAMARD_BUFFER).shape == (block, block)
            assert getattr(module, POW2_ATTR) is None
        else:  # a width the block does not fit: the full op, as without online_block
            want = d @ hadamard.hadamard(n) / n**0.5
            assert getattr(module, HADAMARD_BUFFER).shape[0] == hadamard.hadamard_order(n)
        assert float((g - want).abs().max()) <= 1e-12, path
    # the block ops do the work: without one the folded weights break the model
    broken = tiny_dinov2(seed=3)
    normswap.patch(broken, beta_placement="keep")
    rotate(broken, "none", online=True, seed=4, online_block=block)
    broken.get_submodule("encoder.layer.1.mlp.fc2")._normswap_online.remove()
    assert _relative(_run(broken, probe, guarded=False), ref) > 1e-3


def test_block_matrix_is_block_diagonal_and_the_op_is_one_matmul_of_it():
    gen = torch.Generator().manual_seed(0)
    for n, b in ((1536, 32), (384, 128), (64, 2)):
        m = hadamard.block_hadamard(n, b)
        assert float((m @ m.T - torch.eye(n, dtype=torch.float64)).abs().max()) <= 1e-12
        mask = torch.kron(torch.eye(n // b, dtype=torch.float64), torch.ones(b, b, dtype=torch.float64))
        assert torch.equal(m * (1 - mask), torch.zeros(n, n, dtype=torch.float64))
        assert torch.allclose(m.abs() * mask, mask * b**-0.5, atol=0, rtol=1e-15)
        x = torch.randn(3, 5, n, generator=gen, dtype=torch.float64)
        assert float((hadamard.block_matmul(x, hadamard.sylvester(b)) - x @ m).abs().max()) <= 1e-12
    assert hadamard.block_hadamard(96, 64) is None and hadamard.block_hadamard(96, 12) is None
    # the stored order tells the layouts apart: a full op's small factor is never a power of two above 1
    assert all(not hadamard.is_block_factor(hadamard.hadamard_order(n)) for n in (20, 96, 384, 768, 1536, 1024))
    assert all(hadamard.is_block_factor(b) for b in (2, 32, 128))


@pytest.mark.parametrize("untie", [True, False])
def test_gpt2_with_block_ops_stays_exact(untie):
    model = build(EXACT, "gpt2")
    probe = hf_example_inputs(model, seed=5)
    ref = _run(model, probe)
    normswap.patch(model, untie=untie)
    rot = rotate(model, "none", online=True, online_block=8)
    assert _relative(_run(model, probe), ref) <= 1e-9, str(rot)
    (entry,) = rot.rotated
    assert entry["online_block_widths"]
    assert ("lm_head" in entry["online"]) == untie
    for path in _ops(entry):
        g = _op_matrix(model.get_submodule(path))
        assert float((g.T @ g - torch.eye(g.shape[0], dtype=torch.float64)).abs().max()) <= 1e-12


def test_turned_stream_with_block_down_projections_stays_exact():
    model = build(EXACT, "gpt2")
    probe = hf_example_inputs(model, seed=5)
    ref = _run(model, probe)
    normswap.patch(model, fold_gamma=True)
    rot = rotate(model, "hadamard", online=True, online_block=8)
    assert _relative(_run(model, probe), ref) <= 1e-9, str(rot)
    entry = rot.rotated[0]
    assert entry["online"] and entry["online_block"] == 8 and entry["online_block_widths"]
    for path in entry["online"]:
        assert getattr(model.get_submodule(path), HADAMARD_BUFFER).shape == (8, 8)


def test_native_checkpoint_rebuilds_the_block_ops(tmp_path):
    loaded, probe, ref = saved_and_loaded(tmp_path, online_block=16)  # the 128 wide ops take it, the 32 wide too
    (entry,) = normswap.plan_of(loaded).rotations
    assert entry["online_block"] == 16 and entry["online_block_widths"] == [32, 128]
    for path in ("encoder.layer.0.norm1", "encoder.layer.0.mlp.fc2"):
        module = loaded.get_submodule(path)
        assert getattr(module, HADAMARD_BUFFER).shape == (16, 16)
        assert torch.equal(getattr(module, HADAMARD_BUFFER).double(), hadamard.sylvester(16))
    assert _relative(_run(loaded, probe), ref) <= 1e-12
    loaded.get_submodule("encoder.layer.0.mlp.fc2")._normswap_online.remove()  # the rebuilt op does the work
    assert _relative(_run(loaded, probe, guarded=False), ref) > 1e-3


def test_a_full_checkpoint_without_the_fields_loads_as_before(tmp_path):
    loaded, probe, ref = saved_and_loaded(tmp_path)
    (entry,) = normswap.plan_of(loaded).rotations
    assert "online_block" not in entry and "online_block_widths" not in entry
    assert getattr(loaded.get_submodule("encoder.layer.0.norm1"), HADAMARD_BUFFER).shape == (1, 1)  # H_32 alone
    assert _relative(_run(loaded, probe), ref) <= 1e-12


def test_onnx_export_has_one_matmul_per_block_op(tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from normswap.rotation.onnx_nodes import float_nodes

    model = tiny_dinov2(seed=3).float()
    normswap.patch(model, beta_placement="keep")
    rot = rotate(model, "none", online=True, online_block=16)
    (entry,) = rot.rotated
    x = torch.randn(1, 3, 56, 56)

    class Out(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, pixel_values):
            return self.m(pixel_values=pixel_values).last_hidden_state

    path = tmp_path / "dino.onnx"
    with torch.no_grad():
        want = Out(model)(x)
        torch.onnx.export(Out(model).eval(), (x,), str(path), input_names=["pixel_values"], dynamo=True)
    names = float_nodes(path, model)
    assert len(names) == len(_ops(entry)), names  # one MatMul by H_16 per op, no second (identity) one
    graph = onnx.load(str(path)).graph
    consts = {t.name: t for t in graph.initializer}
    h16 = [n for n in graph.node if n.op_type == "MatMul" and any(
        i in consts and tuple(consts[i].dims) == (16, 16) for i in n.input)]
    assert sorted(n.name for n in h16) == sorted(names)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"pixel_values": x.numpy()})
    assert float(abs(torch.from_numpy(got[0]) - want).max() / want.abs().max()) <= 1e-5  # the scale b^-½ included


@pytest.mark.parametrize("kwargs, error, message", [
    ({"online": True, "online_block": 12}, NormswapError, "power of two"),
    ({"online": True, "online_block": 1}, NormswapError, "power of two"),
    ({"online": True, "online_block": True}, NormswapError, "power of two"),
    ({"online_block": 16}, NormswapError, "pass online=True"),
    ({"online": True, "online_block": 128}, UsageError, "no online Hadamard's width is a multiple of 128"),
])
def test_bad_blocks_are_refused_and_leave_the_model_as_it_was(kwargs, error, message):
    model = tiny_dinov2(seed=3)
    normswap.patch(model, beta_placement="keep")
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(error, match=message):
        rotate(model, "none", **kwargs)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    assert not normswap.plan_of(model).rotations


def test_patch_option_refuses_an_unusable_block_before_converting():
    model = tiny_dinov2(seed=3)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(UsageError, match="no Linear input's width is a multiple of 256"):
        normswap.patch(model, rotate="none", online_hadamard=True, online_block=256)
    assert normswap.plan_of(model) is None
    assert all(torch.equal(before[n], p) for n, p in model.state_dict().items())
    with pytest.raises(NormswapError, match="online_hadamard=True"):
        normswap.patch(model, rotate="none", online_block=16)
    probe = hf_example_inputs(model, seed=5)
    ref = _run(model, probe)
    report = normswap.patch(model, rotate="none", online_hadamard=True, online_block=16)
    assert _relative(_run(model, probe), ref) <= 1e-9
    assert "block-diagonal (blocks of 16 at width(s) 32, 128)" in report.message


def test_cli_online_block(tmp_path):
    from click.testing import CliRunner

    from normswap.cli import main

    runner = CliRunner()
    base = ["convert", "tiny-gpt2"]
    for extra, message in ((["--rotate", "none", "--online-block", "16"], "pass --online-hadamard"),
                           (["--rotate", "none", "--online-hadamard", "--online-block", "24"], "power of two"),
                           (["--rotate", "none", "--online-hadamard", "--online-block", "4096"],
                            "no Linear input's width is a multiple of 4096")):
        out = tmp_path / extra[-1]
        res = runner.invoke(main, [*base, "--out", str(out), *extra])
        assert res.exit_code == 2 and message in res.stderr, res.stderr
        assert not out.exists()
    res = runner.invoke(main, [*base, "--out", str(tmp_path / "b"), "--rotate", "none", "--online-hadamard",
                               "--online-block", "8", "--quiet"])
    assert res.exit_code == 0, res.stderr
    assert "block-diagonal (blocks of 8 at width(s)" in res.stdout
    (entry,) = normswap.plan_of(normswap.load(tmp_path / "b")).rotations
    assert entry["online_block"] == 8 and entry["online_block_widths"]
