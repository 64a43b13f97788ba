"""normswap.patch on hand-written models with example_inputs, and the options of patch()."""

import copy

import pytest
import torch
from torch import nn

import normswap
from tests.custom_models import MixedNormNet, PostLNEncoder, PostNormDecoder, TinyGPT, TinyViT, randomise


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _no_layernorm(model: nn.Module) -> bool:
    return not any(isinstance(m, nn.LayerNorm) for m in model.modules())


def _check_exact(model, example, probe, **options):
    original = copy.deepcopy(model)
    report = normswap.patch(model, example_inputs=example, **options)
    assert all(s.verdict in ("exact", "exact-with-centering") for s in report.sites), report.plan.table()
    with torch.no_grad():
        assert _rel(model(probe), original(probe)) <= 1e-9
    return report


def test_parallel_blocks_fused_qkv_per_head_norms_and_tied_head():
    torch.manual_seed(0)
    model = randomise(TinyGPT())
    report = _check_exact(model, (torch.randint(0, 50, (2, 9)),), torch.randint(0, 50, (3, 16)), untie=True)
    assert _no_layernorm(model)
    # the per-head norms are centered per head inside the fused qkv projection
    qkv = [e for e in report.plan.writer_edits if e.target == "blocks.0.attn.qkv.weight"]
    assert qkv and qkv[0].blocks is not None and len(qkv[0].blocks) == 8  # 4 q heads + 4 k heads
    assert report.plan.unties and report.plan.untied_parameters == 50 * 32
    assert model.head.weight is not model.tok.weight


def test_conv_patch_embedding_cls_token_and_position_parameter():
    torch.manual_seed(1)
    model = randomise(TinyViT())
    example = (torch.randn(2, 3, 32, 32, dtype=torch.float64),)
    # by default one op centers the stream and the conv, class token and table keep their weights
    default = _check_exact(copy.deepcopy(model), example, torch.randn(4, 3, 32, 32, dtype=torch.float64))
    assert len(default.plan.hooks) == 1 and not {"patch.weight", "cls", "pos"} & {
        e.target for e in default.plan.writer_edits}
    report = _check_exact(model, example, torch.randn(4, 3, 32, 32, dtype=torch.float64), stem_centering="weights")
    targets = {e.target for e in report.plan.writer_edits}
    assert {"patch.weight", "patch.bias", "cls", "pos"} <= targets
    # raw Parameter writers are centered too: the class token together with its position row (the row keeps
    # its mean, the class token takes it away: a constant trade), the patch rows with the conv's bias
    assert {(t.table, t.into) for t in report.plan.constant_trades} == {("pos", "cls"), ("pos", "patch.bias")}
    assert abs(float((model.cls + model.pos[:, :1]).detach().sum())) < 1e-12


def test_norm_flavours_wrapper_offset_non_affine_multidim():
    torch.manual_seed(2)
    model = randomise(MixedNormNet())
    found = {s.path: s for s in normswap.pipeline.find_norms(model, (torch.randn(2, 10, dtype=torch.float64),)).sites}
    assert found["n_wrapped"].flavour == "standard" and "n_wrapped.inner" not in found
    assert found["n_offset"].flavour == "offset" and found["n_offset"].offset == 1.0
    assert found["n_plain"].flavour == "non-affine"
    assert found["n_2d"].normalized_shape == (4, 6)
    _check_exact(model, (torch.randn(5, 10, dtype=torch.float64),), torch.randn(7, 10, dtype=torch.float64))
    assert not any(isinstance(m, (nn.LayerNorm,)) for m in model.modules())


def test_post_ln_custom_model_is_approximate_and_exact_mode_is_a_no_op():
    torch.manual_seed(3)
    model = randomise(PostLNEncoder())
    ids = torch.randint(0, 40, (2, 8))
    plan = normswap.plan(model, (ids,))
    verdicts = {s.name: s.verdict for s in plan.sites}
    assert verdicts["n1.0"] == "approximate" and "Post-LN" in plan.site("n1.0").reason
    original = copy.deepcopy(model)
    normswap.patch(model, (ids,), mode="exact")
    with torch.no_grad():
        assert _rel(model(ids), original(ids)) <= 1e-12


def test_calibration_fit_beats_copying_gamma_beta():
    torch.manual_seed(4)
    base = randomise(PostLNEncoder())
    calib = [(torch.randint(0, 40, (8, 16)),) for _ in range(4)]
    errors = {}
    for name, cal in (("copy", False), ("fit", calib)):
        model = copy.deepcopy(base)
        report = normswap.patch(model, calib[0], mode="all", calibration=cal)
        errors[name] = sum(s.error for s in report.sites if s.verdict == "approximate")
    assert errors["fit"] < errors["copy"]


def test_untie_false_keeps_the_tie_and_stays_exact():
    torch.manual_seed(5)
    model = randomise(TinyGPT(qk_norm=False))
    report = normswap.patch(model, (torch.randint(0, 50, (2, 9)),), untie=False)
    assert model.head.weight is model.tok.weight
    assert not report.plan.unties and report.plan.hooks
    assert report.verification["max_rel_error"] <= 1e-9


def test_fold_gamma_leaves_unit_weights():
    torch.manual_seed(6)
    model = randomise(TinyViT())
    original = copy.deepcopy(model)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    report = normswap.patch(model, (x,), fold_gamma=True)
    folded = [s for s in report.sites if s.fold_gamma]
    assert folded
    for s in folded:
        norm = model.get_submodule(s.name)
        assert norm.weight is None or torch.all(norm.weight == 1)
    with torch.no_grad():
        assert _rel(model(x), original(x)) <= 1e-9


@pytest.mark.parametrize("backend", ["eager", "native"])
def test_backend_option_reaches_the_new_modules(backend):
    model = randomise(TinyViT())
    normswap.patch(model, (torch.randn(1, 3, 32, 32, dtype=torch.float64),), backend=backend)
    assert {m.backend for m in model.modules() if isinstance(m, normswap.RMSNorm)} == {backend}


@pytest.mark.parametrize("name", ["gpt2", "opt", "bloom"])
def test_fold_gamma_where_beta_cannot_fold_keeps_beta_over_gamma_in_the_norm(name):
    """lm_head has no bias. By default it gets a bias slot that takes W β (plan.BiasSlot): β and γ leave the
    norm, even with a γ entry at 0. With bias_slots=False, β stays in ln_f as β/γ while γ folds into lm_head
    (unit weight, rotation-ready); with a γ entry at 0 that is impossible, and γ stays with β."""
    from tests.zoo import EXACT, build

    for zero_gamma in (False, True):
        for slots in (True, False):
            model = build(EXACT, name)
            original = copy.deepcopy(model)
            final_name = next(s.name for s in normswap.plan(model).sites if "lm_head" in s.readers)
            if zero_gamma:
                with torch.no_grad():
                    model.get_submodule(final_name).weight[3] = 0.0
                    original.get_submodule(final_name).weight[3] = 0.0
            report = normswap.patch(model, fold_gamma=True, bias_slots=slots)
            assert report.verification["max_rel_error"] <= 1e-9
            final = report.plan.site(final_name)
            norm = model.get_submodule(final_name)
            ln = original.get_submodule(final_name)
            if slots:
                assert final.fold_beta and final.fold_gamma and norm.bias is None and final.rotation_ready
                assert [s.reader for s in report.plan.bias_slots] == ["lm_head"]
                assert torch.allclose(model.lm_head.bias, original.lm_head.weight @ ln.bias, rtol=0, atol=1e-12)
            else:
                assert not final.fold_beta and norm.bias is not None
            if zero_gamma and not slots:
                assert not final.fold_gamma and not final.rotation_ready
                assert "near 0" in final.rotation_reason
                assert torch.equal(norm.weight, ln.weight)
            elif not slots:
                assert final.fold_gamma and torch.all(norm.weight == 1)
                assert final.rotation_ready  # bloom too: its centering op commutes with a mean-keeping Q
                assert torch.allclose(norm.bias, ln.bias / ln.weight, rtol=0, atol=1e-12)
            probe = torch.randint(1, 99, (2, 11))
            with torch.no_grad():
                assert _rel(model(probe).logits, original(probe).logits) <= 1e-9


def test_without_room_for_a_float64_copy_the_surgery_still_runs_in_float64_per_tensor(monkeypatch):
    """Big models get a working copy in their own dtype; each edit still upcasts to float64."""
    from normswap import memory

    monkeypatch.setattr(memory, "available_memory", lambda: 1)
    torch.manual_seed(8)
    model = randomise(TinyViT()).float()
    reference = copy.deepcopy(model).double()
    x = torch.randn(3, 3, 32, 32)
    report = normswap.patch(model, (x,))
    assert report.changed and model.head.weight.dtype == torch.float32
    assert report.verification["verify_dtype"] == "float32"
    with torch.no_grad():
        assert _rel(model(x).double(), reference(x.double())) <= 1e-5


def _policy_check(model, example, probe, n_norms):
    """One verdict policy: the first norm may be centered where its stream starts (once); every later
    Post-LN norm is exact when its MLP can cancel the stream's mean (FFN-output norms), else approximate
    by default and exact-with-per-norm-centering only when asked."""
    default = normswap.plan(model, example)
    verdicts = [s.verdict for s in default.sites]
    carried = {c.site for c in default.mean_carries}
    assert len(verdicts) == n_norms
    assert verdicts.count("approximate") + len(carried) >= n_norms - 1, default.table()
    assert verdicts.count("approximate") >= 1, default.table()  # attention-output norms stay approximate
    assert all(default.site(n).verdict == "exact" and "cancelled" in default.site(n).reason for n in carried)
    assert len(default.hooks) <= 1 and all(not h.per_norm for h in default.hooks)
    assert all("per_norm_centering=True" in s.reason for s in default.sites if s.verdict == "approximate")
    original = copy.deepcopy(model)
    report = normswap.patch(model, example, per_norm_centering=True, mode="exact")
    counts = report.plan.counts()
    assert counts["approximate"] == 0
    assert counts["exact-with-per-norm-centering"] == verdicts.count("approximate")
    assert "exact-with-per-norm-centering" in report.plan.summary()
    assert sum(h.per_norm for h in report.plan.hooks) == counts["exact-with-per-norm-centering"]
    assert _no_layernorm(model)
    with torch.no_grad():
        assert _rel(model(*probe), original(*probe)) <= 1e-9


def test_verdict_policy_post_norm_decoder_with_residual_modules():
    torch.manual_seed(5)
    model = randomise(PostNormDecoder())
    _policy_check(model, (torch.randint(0, 40, (2, 9)),), (torch.randint(0, 40, (3, 13)),), 4)


def test_verdict_policy_x_transformers_post_norm_decoder():
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    model = xt.TransformerWrapper(num_tokens=50, max_seq_len=32,
                                  attn_layers=xt.Decoder(dim=32, depth=2, heads=4, pre_norm=False))
    model = randomise(model)
    _policy_check(model, (torch.randint(0, 50, (2, 9)),), (torch.randint(0, 50, (3, 17)),), 4)
