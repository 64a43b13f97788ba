"""Patterns of real third-party libraries (tests/third_party_models.py) that once broke normswap.

Each model is built twice from one seed (the reference is never a deep copy: a closure a model keeps
over itself would read the other instance's weights), patched at one input shape and compared with
the float64 original at that shape and another, then saved and loaded into a fresh instance.
"""

from __future__ import annotations

import tempfile

import pytest
import torch

import normswap
from normswap.copying import deepcopy_module
from tests.third_party_models import (
    ClosureTiedLM,
    DepthwiseBlockNet,
    EsmStyleLM,
    KeptNormsNet,
    LayerScaleLM,
    MhaLayerScaleEncoder,
    NanoGptStyle,
    TwoInputPerceiver,
    TwoScaleViT,
    build_randomised,
)


def _ids(n: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 40, (n, t), generator=torch.Generator().manual_seed(seed))


def _images(n: int, size: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _rel(a: torch.Tensor | tuple, b: torch.Tensor | tuple) -> float:
    a, b = (y[0] if isinstance(y, tuple) else y for y in (a, b))  # nanoGPT returns (logits, loss)
    return float((a - b).abs().max() / b.abs().max())


def _exact_everywhere(make, example: torch.Tensor, other: torch.Tensor, **options) -> normswap.Report:  # noqa: ANN001, ANN003
    model, reference = build_randomised(make), build_randomised(make)
    report = normswap.patch(model, (example,), **options)
    assert all(s.verdict in ("exact", "exact-with-centering") for s in report.plan.sites), report.plan.table()
    with torch.no_grad():
        for x in (example, other):
            assert _rel(model(x), reference(x)) <= 1e-9
    with tempfile.TemporaryDirectory() as tmp:
        normswap.save(model, tmp)
        loaded = normswap.load(tmp, model=build_randomised(make, seed=1))
        with torch.no_grad():
            assert all(_rel(loaded(x), model(x)) == 0.0 for x in (example, other))
    return report


def test_logits_from_a_lambda_over_self_are_seen_and_stay_exact():
    """x-transformers ``tie_embedding=True``: before the fix the working copy's lambda read the user's
    embedding, the plan centered it as a writer (no tie seen), verification passed on the copy, and the
    committed model's logits were off by 4e-2."""
    report = _exact_everywhere(ClosureTiedLM, _ids(2, 9, 0), _ids(3, 14, 1))
    assert [(h.module, h.where) for h in report.plan.hooks] == [("tok", "output")]  # the tie is kept
    assert "tok.weight" not in {e.target for e in report.plan.writer_edits}


def test_a_deep_copy_computes_from_its_own_weights():
    model = build_randomised(ClosureTiedLM)
    copy = deepcopy_module(model)
    with torch.no_grad():
        copy.tok.weight.zero_()
        ids = _ids(2, 5, 0)
        assert float(copy(ids).abs().max()) == 0.0  # the copy's logits read the copy's (zeroed) table
        assert float(model(ids).abs().max()) > 0.0


@pytest.mark.parametrize("unit_offset", [False, True])
def test_layer_scale_times_parameter_plus_constant_folds(unit_offset: bool):
    """x-transformers ``use_layerscale=True``: ``out * (gamma + float(unit_offset))``."""
    report = _exact_everywhere(lambda: LayerScaleLM(unit_offset=unit_offset), _ids(2, 9, 0), _ids(3, 13, 1))
    assert len(report.plan.scale_folds) == 4
    assert {f.offset for f in report.plan.scale_folds} == {float(unit_offset)}
    model = build_randomised(lambda: LayerScaleLM(unit_offset=unit_offset))
    normswap.patch(model, (_ids(2, 9, 0),), layer_scale="fold")
    assert all(torch.allclose(m.gamma + float(unit_offset), torch.ones_like(m.gamma))
               for m in [*model.attn, *model.mlp])  # the effective λ is 1 once folded
    model = build_randomised(lambda: LayerScaleLM(unit_offset=unit_offset))
    normswap.patch(model, (_ids(2, 9, 0),))  # default layer_scale="keep": λ + offset is each row's scale
    assert all(bool((m.gamma + float(unit_offset) > 0).all()) and not torch.allclose(m.gamma + float(unit_offset),
               torch.ones_like(m.gamma)) for m in [*model.attn, *model.mlp])


def test_layer_scale_after_multihead_attention_folds_through_its_view_and_transpose():
    """open_clip ``ls_init_value`` without a class token: the second layer's norms were approximate
    (a second centering op on the stream) before the fold saw through MHA's reshapes."""
    report = _exact_everywhere(MhaLayerScaleEncoder, _images(2, 16, 0), _images(3, 16, 1), fold_gamma=True)
    assert {f.into for f in report.plan.scale_folds} >= {"attn.0.out_proj", "attn.1.out_proj"}
    assert not report.plan.hooks


def test_a_norm_right_after_a_gelu_written_in_ops_gets_one_centering_op():
    """fair-esm's LM head: the GELU output starts a stream that only the head's norm reads. Its centering op
    sits at that norm's input (the only module boundary), one op for the stream: exact-with-centering,
    not approximate ('no centering point feeds only norms') as before."""
    report = _exact_everywhere(EsmStyleLM, _ids(2, 9, 0), _ids(3, 14, 1), untie=True)  # no op at the tied table
    head = report.plan.site("lm_head.layer_norm")
    assert head.verdict == "exact-with-centering" and "stream starts at `mul`" in head.reason
    assert [(h.module, h.where, h.per_norm) for h in report.plan.hooks] == [("lm_head.layer_norm", "input", False)]


@pytest.mark.parametrize("bias", [False, True])
def test_nanogpt_style(bias: bool):
    """nanoGPT's patterns: F.layer_norm with bias=None, fused c_attn, SDPA, a tie by assignment (kept by
    default: one op at the embedding; untied with untie=True), the last position's logits only."""
    report = _exact_everywhere(lambda: NanoGptStyle(bias=bias), _ids(2, 9, 0), _ids(3, 14, 1))
    assert not report.plan.unties and report.plan.counts()["exact-with-centering"] == 5
    report = _exact_everywhere(lambda: NanoGptStyle(bias=bias), _ids(2, 9, 0), _ids(3, 14, 1), untie=True)
    assert report.plan.unties and report.plan.counts()["exact"] == 5
    assert {s.flavour for s in report.plan.sites} == {"standard" if bias else "gamma-only"}


def test_rotation_leaves_a_stream_whose_op_would_share_a_module_with_another_streams():
    """PerceiverIO: the ``data`` and ``queries`` streams are centered at the model's input, arguments 0 and 1,
    widths 24 and 16. ``rotate`` kept one Q buffer per module and composed the second stream's 16×16 turn
    onto the first's 24×24 ("mat1 and mat2 shapes cannot be multiplied"): now the second is left unrotated
    and said so, and the rotated model still computes the original."""
    def inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn(n, 7 + seed, 24, generator=gen, dtype=torch.float64),
                torch.randn(n, 3 + seed, 16, generator=gen, dtype=torch.float64))

    model, reference = build_randomised(TwoInputPerceiver), build_randomised(TwoInputPerceiver)
    report = normswap.patch(model, inputs(2, 0), fold_gamma=True)
    assert sorted((h.module, h.where, h.arg) for h in report.plan.hooks) == [("", "input", 0), ("", "input", 1)]
    rotation = normswap.rotate(model, "hadamard")
    assert any("one rotation op per module" in s["reason"] for s in rotation.skipped)
    with torch.no_grad():
        for x in (inputs(2, 0), inputs(3, 1)):
            assert _rel(model(*x), reference(*x)) <= 1e-9


def test_one_image_read_by_two_patch_embedders_gets_an_op_in_each():
    """CrossViT: the image starts two streams. The op chosen for the first embedder's raw-patch norm was
    taken for the image's, so the second embedder's raw-patch norm stayed approximate."""
    report = _exact_everywhere(TwoScaleViT, _images(2, 16, 0), _images(3, 16, 1))
    assert {(h.module, h.where) for h in report.plan.hooks} >= {("small.0", "output"), ("large.0", "output")}
    assert report.plan.site("large.1").verdict == "exact-with-centering"


def test_norms_named_layernorm_that_no_formula_converts_are_reported_not_dropped():
    """vit-pytorch's ChanLayerNorm with trained (1, C, 1, 1) γ/β matched no formula once moved channels-last
    (its parameters did not broadcast), and a class named LayerNorm that matches no formula at all was
    dropped in silence: neither a site nor a skipped norm."""
    model = build_randomised(KeptNormsNet)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 4 and p.numel() == p.shape[1]:  # the channels-first γ/β, away from 1/0
                p.add_(0.3 * torch.randn_like(p))
    found = {s.path: s.reason for s in normswap.pipeline.find_norms(model, (_images(2, 8, 0),)).skipped}
    assert set(found) == {"norm1", "norm2", "token_norm"}
    assert all("channel axis of a channels-first tensor" in found[n] for n in ("norm1", "norm2"))
    assert "matches no LayerNorm/RMSNorm formula" in found["token_norm"]
    report = normswap.patch(model, (_images(2, 8, 0),))
    assert not report.changed and {s["name"] for s in report.plan.skipped} == set(found)


def test_a_norm_inside_the_layers_after_a_depthwise_conv_stays_approximate():
    """The head rule above (one op at a norm's input) does not reach into the layers: there it would be one
    op per block (HF ConvNeXt's block norms stay approximate)."""
    model = build_randomised(DepthwiseBlockNet)
    plan = normswap.plan(model, (torch.randn(2, 7, 6, dtype=torch.float64),))
    assert [plan.site(f"norms.{i}").verdict for i in range(2)] == ["approximate", "approximate"]
    assert not any(h.module.startswith("norms.") for h in plan.hooks)
