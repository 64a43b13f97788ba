"""Hierarchical vision models: stem norms, Swin patch merging (issue 31, part 3).

- **Stem norms.** A norm whose output starts the stream (``patch_embed.norm`` after a conv; vit-pytorch's
  ``LayerNorm, Linear, LayerNorm``; PVT's per-stage patch embedding norm after a conv that reads the
  previous stage's norm) gets one stream-start centering op on its output, as BLOOM's embedding norm
  does, and every norm after it is exact.
- **Patch merging.** A Swin merge puts 4 tokens in one row of its norm. After centering, each token
  is zero-mean, and so is the row; but each token was shifted by its own mean, and LayerNorm over the
  row is invariant to one shift per row only: the merge norm's output would change. The analysis tracks
  which token each element of a norm row comes from (``Analyzer.reach(..., tokens=True)``) and centers
  a writer only where every row holds one token alone. So the stages that end in a merge stay
  approximate, with that reason (the math, not a missing feature: ``test_token_rule_matches_layer_norm``).

Every model: float64, LayerNorm γ/β randomised, eval mode, planned at two input shapes (the plan must
not depend on the shape); the custom ones converted at one and compared with the original at both.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as tf
from torch import nn

import normswap
from normswap.analysis.streams import Analyzer, Reach
from tests.custom_models import randomise
from tests.hierarchical_models import ChannelShiftNet, ConvStemNet, PatchNormViT, PyramidStyle, SwinStyle

EXACT_VERDICTS = ("exact", "exact-with-centering")


def _images(batch: int, size: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# name -> (model factory, the two image sizes, hooks the plan must place)
MODELS = {
    # not a merge: each row of the "merge" norm is one token four times over (one shift per row)
    "swin-repeat": (lambda: SwinStyle(merge="repeat"), (32, 48), {"patch_embed.norm"}),
    "convnext-stem": (ConvStemNet, (32, 48), {"stem_norm"}),
    "vit-pytorch": (PatchNormViT, (16, 8), {"to_patch_embedding.0", "to_patch_embedding.3"}),
    "pvt": (PyramidStyle, (32, 48), {"stages.0.embed_norm", "stages.1.embed_norm"}),
}


def _plan_facts(plan) -> tuple:
    return ([(s.name, s.verdict, s.reason) for s in plan.sites], [(h.module, h.where) for h in plan.hooks],
            sorted((e.target, str(e.blocks)) for e in plan.writer_edits))


@pytest.mark.parametrize("name", list(MODELS))
def test_every_norm_exact_at_two_shapes(name):
    factory, (size_a, size_b), hooks = MODELS[name]
    torch.manual_seed(0)
    model = randomise(factory(), seed=1)
    first, second = _images(2, size_a, 2), _images(3, size_b, 3)
    plan = normswap.plan(model, (first,))
    assert _plan_facts(normswap.plan(model, (second,))) == _plan_facts(plan)  # no verdict depends on the shape
    assert all(s.verdict in EXACT_VERDICTS for s in plan.sites), plan.table()
    assert {h.module for h in plan.hooks} == hooks and all(h.where == "output" and not h.per_norm
                                                           for h in plan.hooks)
    n_norms = sum(isinstance(m, nn.LayerNorm) for m in model.modules())
    assert len(plan.sites) == n_norms

    original = copy.deepcopy(model)
    report = normswap.patch(model, example_inputs=(first,))
    assert sum(s.verdict in EXACT_VERDICTS for s in report.sites) == n_norms
    assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())
    with torch.no_grad():
        for images in (first, second):
            want = original(images)
            assert float((model(images) - want).abs().max() / want.abs().max()) <= 1e-9


STAGE0 = ["layers.0.blocks.0.n1", "layers.0.blocks.0.n2", "layers.1.downsample.norm"]


@pytest.mark.parametrize("merge, pool", [("reshape", False), ("cat", False), ("reshape", True), ("split", False)])
def test_swin_merges_keep_their_stage_approximate(merge, pool):
    """Space-to-depth (timm) and ``torch.cat`` (original Swin, HF) merges alike: the stem norm, the next
    stage and the final norm are exact; the stage that ends in the merge is approximate, and the reason
    names the merge norm. ``mode="exact"`` converts the exact norms only, and stays exact at both shapes."""
    model = randomise(SwinStyle(merge=merge, pool=pool), seed=6)
    first, second = _images(2, 32, 7), _images(3, 48, 8)
    plan = normswap.plan(model, (first,))
    assert _plan_facts(normswap.plan(model, (second,))) == _plan_facts(plan)
    verdicts = {s.name: s.verdict for s in plan.sites}
    assert all(verdicts[n] == "approximate" for n in STAGE0), plan.table()
    assert all(verdicts[n] == "exact" for n in verdicts if n not in STAGE0), plan.table()
    reason = plan.site("layers.1.downsample.norm").reason
    assert "stream starts at `patch_embed.norm` output" in reason and "Post-LN" not in reason
    assert "several tokens in one row of `layers.1.downsample.norm`" in reason
    assert not plan.hooks and not any(e.target.startswith("layers.0.blocks") for e in plan.writer_edits)
    assert {e.target for e in plan.writer_edits} >= {"patch_embed.proj.weight", "layers.1.downsample.reduction.weight"}
    original = copy.deepcopy(model)
    normswap.patch(model, example_inputs=(first,), mode="exact")
    assert sum(isinstance(m, nn.LayerNorm) for m in model.modules()) == len(STAGE0)
    with torch.no_grad():
        for images in (first, second):
            want = original(images)
            assert float((model(images) - want).abs().max() / want.abs().max()) <= 1e-9


def test_swin_merge_norm_is_exact_with_per_norm_centering():
    """Opt-in: one mean per merged row before the merge norm (LayerNorm by another name) makes it exact;
    and the stage-0 norms, whose stream no single op can center, each get an op on their own input (what
    the reason's promise of per_norm_centering says), so every norm is exact."""
    model = randomise(SwinStyle(merge="cat"), seed=9)
    first, second = _images(2, 32, 10), _images(1, 48, 11)
    original = copy.deepcopy(model)
    report = normswap.patch(model, example_inputs=(first,), mode="exact", per_norm_centering=True)
    assert report.plan.site("layers.1.downsample.norm").verdict == "exact-with-per-norm-centering"
    assert sorted((h.module, h.where) for h in report.plan.hooks) == [(n, "input") for n in sorted(STAGE0)]
    assert report.plan.counts()["approximate"] == 0
    with torch.no_grad():
        for images in (first, second):
            want = original(images)
            assert float((model(images) - want).abs().max() / want.abs().max()) <= 1e-9


def test_channel_shift_between_tokens_is_not_centered():
    """A writer whose output moves half its channels one token along (temporal-shift style) fills every
    norm row with each feature once, from two tokens. Feature ids alone cannot tell; centering it
    would shift each half by another token's mean. It used to be planned exact and then fail the
    zero-mean check; now those norms are approximate, with the reason."""
    model = randomise(ChannelShiftNet(), seed=3)
    ids = torch.randint(0, 30, (2, 7), generator=torch.Generator().manual_seed(4))
    plan = normswap.plan(model, (ids,))
    site = plan.site("blocks.0.inner.n2")
    assert site.verdict == "approximate"
    assert "`blocks.0.inner.attn.proj` (Linear) puts several tokens in one row" in site.reason
    assert plan.site("blocks.0.inner.n1").verdict == "exact"
    assert "blocks.0.inner.attn.proj.weight" not in {e.target for e in plan.writer_edits}
    original = copy.deepcopy(model)
    normswap.patch(model, example_inputs=(ids,), mode="exact")
    with torch.no_grad():
        assert float((model(ids) - original(ids)).abs().max() / original(ids).abs().max()) <= 1e-9


def _token_reach(rows: torch.Tensor, width: int) -> Reach:
    """A reach whose one norm (call 0) reads ``rows`` of (token, feature) ids, written ``token*width+feature``."""
    return Reach(site_rows={0: rows.double()}, token_width=width)


def _layer_norm(row: torch.Tensor) -> torch.Tensor:
    return (row - row.mean()) / (row.var(unbiased=False) + 1e-5).sqrt()


def test_token_rule_matches_layer_norm():
    """The rule, checked numerically on random rows of (token, feature) elements: a row is accepted
    exactly when centering every token leaves its LayerNorm unchanged and makes it zero-mean. Rows of
    several whole tokens (a patch merging) are zero-mean after centering, yet their LayerNorm changes."""
    gen = torch.Generator().manual_seed(0)
    tokens, width = 6, 4
    y = torch.randn(tokens, width, generator=gen, dtype=torch.float64) + 3 * torch.randn(tokens, 1, generator=gen,
                                                                                        dtype=torch.float64)
    centered = y - y.mean(dim=1, keepdim=True)
    seen = {True: 0, False: 0}
    for trial in range(240):
        picked = torch.randint(0, tokens, (1 + trial % 3,), generator=gen)  # whole tokens, repeats allowed
        row = torch.cat([t * width + torch.arange(width) for t in picked.tolist()])
        if trial % 4 == 3:  # one element swapped for another feature of a token
            row[int(torch.randint(0, row.numel(), (1,), generator=gen))] = \
                int(torch.randint(0, tokens * width, (1,), generator=gen))
        accepted = Analyzer._token_groups(0, row.numel(), _token_reach(row[None].expand(2, -1), width))[1] == ""
        same = torch.allclose(_layer_norm(y.flatten()[row]), _layer_norm(centered.flatten()[row]), atol=1e-12)
        zero_mean = abs(float(centered.flatten()[row].mean())) <= 1e-12
        assert accepted == (same and zero_mean), (row.tolist(), accepted, same, zero_mean)
        seen[accepted] += 1
    assert min(seen.values()) >= 40  # both outcomes exercised
    merge = torch.arange(4 * width)  # 4 whole tokens: zero-mean after centering, LayerNorm changed
    assert abs(float(centered.flatten()[merge].mean())) <= 1e-12
    assert "several tokens" in Analyzer._token_groups(0, 4 * width, _token_reach(merge[None], width))[1]


def _hf_swin() -> nn.Module:
    config = tf.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)
    torch.manual_seed(0)
    return randomise(tf.SwinModel(config), seed=8)


def test_hf_swin_model_keeps_its_merged_stage_approximate():
    """transformers' own Swin (its merge is the ``torch.cat`` variant): the same verdicts as the timm-style
    model, at 32 pixels and at 48, where stage 1 is 6x6 tokens padded to 8x8 for its 4x4 windows
    (``mode="exact"`` at other shapes: the zoo's Swin in ``test_shape_invariance``)."""
    model = _hf_swin()
    first, second = _images(2, 32, 9), _images(1, 48, 10)
    plan = normswap.plan(model, (first,))
    assert _plan_facts(normswap.plan(model, (second,))) == _plan_facts(plan)
    approximate = {s.name for s in plan.sites if s.verdict == "approximate"}
    assert approximate == {"encoder.layers.0.blocks.0.layernorm_before", "encoder.layers.0.blocks.0.layernorm_after",
                           "encoder.layers.0.downsample.norm"}, plan.table()
    assert "several tokens in one row of `encoder.layers.0.downsample.norm`" in \
        plan.site("encoder.layers.0.downsample.norm").reason
