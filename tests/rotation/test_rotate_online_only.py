"""``rotate(model, "none", online=True)``: no stream turned (the norms keep γ and β, LayerScale stays), an online
Hadamard before every Linear reader of a norm and every MLP down projection, per-head Hadamards on the values;
one op after a norm whose output only its Linear readers read (q/k/v), per-reader ops where something else reads
it or a reader reads another norm too. Exact in float64 (≤ 1e-9) on a DINOv2 replica with γ/β/λ randomised,
with and without ``fold_gamma``, on GPT-2 (a tied head left alone) and on small fan-out modules; every op
orthogonal (1e-12); saved and rebuilt by the native format; refused by compat, without ``online``, with a stream
option, and before a later stream turn, the model untouched."""

import pytest
import torch

import normswap
from normswap.errors import NormswapError
from normswap.inputs import hf_example_inputs
from normswap.pipeline import default_dtype
from normswap.rotation import hadamard
from normswap.rotation.onnx_nodes import rotation_matrices
from normswap.rotation.rotate import HADAMARD_BUFFER, POW2_ATTR, REST_ATTR, SIGNS_BUFFER, rotate
from tests.benchmark_modules import tiny_bert, tiny_dinov2
from tests.zoo import EXACT, build

OWN_OP = ("mlp.fc1", "mlp.fc2")  # one reader of norm2, and the down projection: an op before each
SHARED = ("attention.k_proj", "attention.q_proj", "attention.v_proj")  # norm1's readers: one op after norm1


def _run(model, probe, *, guarded=True):
    """The model's output; ``guarded=False``: past the model's pre-hooks (its online-op guard), to see what a
    model missing an op computes (the guard refuses it since round 52 when an op's hook is removed in place)."""
    with torch.no_grad(), default_dtype(torch.float64):
        out = model(**probe) if guarded else model.forward(**probe)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _relative(out, ref):
    return float((out - ref).abs().max() / ref.abs().max())


def _op_matrix(module):
    """The op's ``D·H/sqrt(n)`` as a dense matrix: the op applied to the identity."""
    n = getattr(module, SIGNS_BUFFER).shape[0]
    eye = torch.eye(n, dtype=torch.float64)
    signs = getattr(module, SIGNS_BUFFER).double()
    return hadamard.fwht(eye * signs, getattr(module, HADAMARD_BUFFER).double())


@pytest.mark.parametrize("fold_gamma", [False, True])
def test_online_hadamards_at_every_linear_input_keep_dinov2_exact(fold_gamma):
    model = tiny_dinov2(seed=3)
    probe = hf_example_inputs(model, seed=5)
    ref = _run(model, probe)
    normswap.patch(model, fold_gamma=fold_gamma, beta_placement="keep")
    gammas = {n: p.clone() for n, p in model.named_parameters() if "norm" in n}
    rot = rotate(model, "none", online=True, seed=4)
    assert _relative(_run(model, probe), ref) <= 1e-9, str(rot)
    (entry,) = rot.rotated
    assert entry["kind"] == "none" and not entry["writers"] and not entry["readers"]
    assert entry["online"] == sorted(f"encoder.layer.{i}.{lin}" for i in range(2) for lin in OWN_OP)
    # q, k and v read norm1's output alone: one op after it, its transpose folded into all three
    assert entry["online_outputs"] == [{"norm": f"encoder.layer.{i}.norm1",
                                        "readers": [f"encoder.layer.{i}.{lin}" for lin in SHARED], "width": 32}
                                       for i in range(2)]
    assert entry["value_heads"] and entry["head_dim"] == 16
    # nothing turned the stream: the norms' γ and β are where the conversion put them
    assert all(torch.equal(p, gammas[n]) for n, p in model.named_parameters() if "norm" in n and "normswap" not in n)
    ops = entry["online"] + [o["norm"] for o in entry["online_outputs"]]
    for path in ops:
        g = _op_matrix(model.get_submodule(path))
        eye = torch.eye(g.shape[0], dtype=torch.float64)
        assert float((g.T @ g - eye).abs().max()) <= 1e-12 and float((g - eye).abs().max()) > 0.1
    # what float_nodes looks for: each op's two stock-form factors, H_b and H_K ⊗ H_r (hadamard.split_matmuls)
    found = rotation_matrices(model)
    for path in ops:
        module = model.get_submodule(path)
        small, rest = getattr(module, HADAMARD_BUFFER).double(), getattr(module, REST_ATTR)
        for w in (getattr(module, POW2_ATTR), small if rest is None else torch.kron(small, rest)):
            assert any(f.shape == w.shape and torch.equal(f, w) for f in found), path
    assert "online Hadamards before 10 Linear(s), 6 op(s) (2 after a norm" in rot.headline()
    # the ops do the work: without one the folded weights break the model
    for path in ("encoder.layer.1.mlp.fc1", "encoder.layer.0.norm1"):
        broken = tiny_dinov2(seed=3)
        normswap.patch(broken, fold_gamma=fold_gamma, beta_placement="keep")
        rotate(broken, "none", online=True, seed=4)
        broken.get_submodule(path)._normswap_online.remove()
        assert _relative(_run(broken, probe, guarded=False), ref) > 1e-3, path


class FanOut(torch.nn.Module):
    """A norm read by three Linears; ``extra="residual"``: its output is also added to the result (a reader no
    weight can take the op into); ``extra="shared"``: ``q`` also reads a second norm's output."""

    def __init__(self, extra: str = "") -> None:
        super().__init__()
        self.extra = extra
        self.inp, self.inp2 = torch.nn.Linear(8, 16), torch.nn.Linear(8, 16)
        self.norm, self.norm2 = torch.nn.LayerNorm(16), torch.nn.LayerNorm(16)
        self.q, self.k, self.v = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for norm in (self.norm, self.norm2):
                norm.weight.copy_(1 + 0.5 * torch.randn(16, generator=gen))
                norm.bias.copy_(0.3 * torch.randn(16, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.inp(x))
        out = self.q(y) * torch.sigmoid(self.k(y)) + self.v(y)
        if self.extra == "residual":
            out = out + y
        if self.extra == "shared":
            out = out + self.q(self.norm2(self.inp2(x)))
        return out


@pytest.mark.parametrize("extra, shared_op", [("", True), ("residual", False), ("shared", False)])
def test_one_op_after_a_norm_only_where_its_linear_readers_alone_read_its_output(extra, shared_op):
    torch.manual_seed(0)
    model = FanOut(extra).double().eval()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    ref = model(x)
    normswap.patch(model, example_inputs=(x,), beta_placement="keep")
    rot = rotate(model, "none", online=True, seed=2)
    with torch.no_grad():
        assert _relative(model(x), ref) <= 1e-9, str(rot)
    (entry,) = rot.rotated
    if shared_op:
        assert [o["norm"] for o in entry["online_outputs"]] == ["norm"] and entry["online"] == []
        assert hasattr(model.norm, HADAMARD_BUFFER) and not hasattr(model.q, HADAMARD_BUFFER)
    else:  # the output is also added to the result, or q reads norm2 too: an op before each reader
        assert entry["online_outputs"] == [] and {"k", "q", "v"} <= set(entry["online"])
        assert not hasattr(model.norm, HADAMARD_BUFFER)


@pytest.mark.parametrize("untie", [True, False])
def test_gpt2_stays_exact_and_a_head_tied_to_the_embedding_is_left_alone(untie):
    model = build(EXACT, "gpt2")
    probe = hf_example_inputs(model, seed=5)
    ref = _run(model, probe)
    normswap.patch(model, untie=untie)
    rot = rotate(model, "none", online=True)
    assert _relative(_run(model, probe), ref) <= 1e-9, str(rot)
    online = rot.rotated[0]["online"]
    assert any(p.endswith("attn.c_attn") for p in online)  # HF Conv1D readers
    assert any(p.endswith("mlp.c_proj") for p in online) and any(p.endswith("mlp.c_fc") for p in online)
    if untie:  # the conversion cloned the head: a reader like any other
        assert "lm_head" in online
    else:  # tied: turning its weight would turn the embedding too
        assert "lm_head" not in online
        assert any("lm_head" in why and "shared" in why for why in rot.online_skipped), rot.online_skipped
        assert model.lm_head.weight is model.transformer.wte.weight


def test_native_checkpoint_rebuilds_the_ops_and_compat_refuses_them(tmp_path):
    model = tiny_dinov2(seed=3)
    probe = hf_example_inputs(model, seed=5)
    normswap.patch(model, beta_placement="keep")
    rotate(model, "none", online=True)
    ref = _run(model, probe)
    normswap.save(model, tmp_path / "ckpt")
    loaded = normswap.load(tmp_path / "ckpt").double().eval()
    (entry,) = normswap.plan_of(loaded).rotations
    assert entry["kind"] == "none" and len(entry["online"]) == 4 and len(entry["online_outputs"]) == 2
    assert hasattr(loaded.get_submodule("encoder.layer.0.norm1"), HADAMARD_BUFFER)
    assert hasattr(loaded.get_submodule("encoder.layer.0.mlp.fc1"), HADAMARD_BUFFER)
    assert _relative(_run(loaded, probe), ref) <= 1e-12
    loaded.get_submodule("encoder.layer.0.norm1")._normswap_online.remove()  # the rebuilt op does the work
    assert _relative(_run(loaded, probe, guarded=False), ref) > 1e-3
    with pytest.raises(NormswapError, match="compat format cannot hold the online Hadamard"):
        normswap.save(model, tmp_path / "compat", format="compat")


@pytest.mark.parametrize("kwargs, message", [
    ({}, "pass online=True too"),
    ({"online": True, "output": "restore"}, "output= .* does not apply"),
    ({"online": True, "smooth": 2.0}, r"smooth must be a number in \[0, 1\]"),
    ({"online": True, "steps": 5}, "apply to a learned rotation"),
])
def test_bad_requests_are_refused_and_leave_the_model_as_it_was(kwargs, message):
    model = tiny_dinov2(seed=3)
    normswap.patch(model, fold_gamma=True)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(NormswapError, match=message):
        rotate(model, "none", **kwargs)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)


def test_a_stream_turn_after_the_online_hadamards_is_refused():
    model = tiny_dinov2(seed=3)
    normswap.patch(model, fold_gamma=True)
    rotate(model, "none", online=True)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(NormswapError, match="already has online Hadamards at its Linear inputs"):
        rotate(model, "hadamard", output="restore")
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_patch_option_rotate_none_folds_no_gamma_and_stays_exact():
    model = tiny_dinov2(seed=3)
    probe = hf_example_inputs(model, seed=5)
    ref = _run(model, probe)
    gammas = [m.weight.clone() for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    report = normswap.patch(model, rotate="none", online_hadamard=True)
    assert _relative(_run(model, probe), ref) <= 1e-9
    assert "online Hadamards before 10 Linear(s)" in str(report.message)
    kept = [m.weight for m in model.modules() if isinstance(m, normswap.RMSNorm)]
    assert len(kept) == len(gammas) and all(torch.equal(a, b) for a, b in zip(kept, gammas, strict=True))
    with pytest.raises(NormswapError, match="pass online_hadamard=True"):
        normswap.patch(tiny_dinov2(seed=3), rotate="none")


def test_cli_rotate_none_needs_online_hadamard_and_writes_a_native_checkpoint(tmp_path):
    from click.testing import CliRunner

    from normswap.cli import main

    runner = CliRunner()
    res = runner.invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "a"), "--rotate", "none"])
    assert res.exit_code == 2 and "pass --online-hadamard" in res.stderr
    res = runner.invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "c"), "--rotate", "none",
                               "--online-hadamard", "--format", "compat"])
    assert res.exit_code == 2 and "use --format native" in res.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "c").exists()
    res = runner.invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "b"), "--rotate", "none",
                               "--online-hadamard", "--quiet"])
    assert res.exit_code == 0, res.stderr
    assert "no stream turned; online Hadamards before" in res.stdout
    loaded = normswap.load(tmp_path / "b")
    (entry,) = normswap.plan_of(loaded).rotations
    assert entry["kind"] == "none" and entry["online"]


def test_the_matmul_form_is_the_butterfly_to_float_rounding():
    gen = torch.Generator().manual_seed(0)
    for n in (384, 1536, 64, 20):
        small = hadamard.small_factor(n)
        m = n // small.shape[0]
        x = torch.randn(3, 5, n, generator=gen, dtype=torch.float64)
        pow2 = hadamard.sylvester(m)
        assert float((hadamard.hadamard_matmuls(x, small, pow2) - hadamard.fwht(x, small)).abs().max()) <= 1e-12
    assert hadamard.sylvester(12) is None


def test_online_op_after_inference_mode_still_trains_and_reuses_its_factor():
    """The stock form's ``2^m`` factor (what a traced graph uses; eager calls run ``EagerOp``, whose constants
    tests/rotation/test_online_eager_op.py checks the same way) is converted once per device and dtype; a copy
    made under ``torch.inference_mode`` must not be an inference tensor, or training afterwards fails."""
    model = tiny_dinov2(seed=3).float()
    probe = hf_example_inputs(model, seed=5)
    normswap.patch(model, beta_placement="keep")
    rotate(model, "none", online=True, seed=4)
    fc1 = model.get_submodule("encoder.layer.0.mlp.fc1")
    (hook,) = [h for h in fc1._forward_pre_hooks.values() if hasattr(h, "pow2_copies")]
    pow2 = getattr(fc1, POW2_ATTR)
    with torch.inference_mode():
        model(**probe)
        copy = hook.pow2_like(pow2, torch.ones(1, dtype=torch.float32))
    assert not copy.is_inference() and copy.dtype == torch.float32
    model.train()
    model(**probe).last_hidden_state.square().mean().backward()
    assert fc1.weight.grad is not None and torch.isfinite(fc1.weight.grad).all()
    assert hook.pow2_like(pow2, torch.ones(1, dtype=torch.float32)) is copy  # reused, not converted again


def test_post_ln_norms_made_exact_by_a_centering_op_still_get_an_op_before_every_mlp_down_projection(tmp_path):
    """With ``per_norm_centering=True, mean_carry=False`` (what ``convert --per-norm-centering --no-mean-carry``
    does on a Post-LN encoder) the FFN output projection writes the stream unedited (no writer is centered), and
    it is still an MLP down projection: it takes the op like every other down projection. (It was left without
    one, silently: the down projections were found among the centered writers only.)"""
    original = tiny_bert(seed=4).double()
    model = tiny_bert(seed=4).double()
    ids = torch.randint(0, 64, (3, 9), generator=torch.Generator().manual_seed(5))
    probe = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    normswap.patch(model, per_norm_centering=True, mean_carry=False, beta_placement="keep")
    r = rotate(model, "none", online=True)
    downs = [f"encoder.layer.{i}.output.dense" for i in range(2)]
    assert set(downs) <= set(r.rotated[0]["online"]), r.rotated[0]["online"]
    assert all(hasattr(model.get_submodule(p), HADAMARD_BUFFER) for p in downs)
    ref = _run(original, probe)
    assert _relative(_run(model, probe), ref) <= 1e-12
    normswap.save(model, tmp_path / "ckpt")
    loaded = normswap.load(tmp_path / "ckpt").double().eval()
    assert all(hasattr(loaded.get_submodule(p), HADAMARD_BUFFER) for p in downs)
    assert _relative(_run(loaded, probe), ref) <= 1e-12
