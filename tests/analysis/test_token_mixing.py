"""Ops that mix tokens keep a centered stream centered when every channel shares their weights.

``y[p'] = Σ_p W[p', p] x[p]`` with one ``W`` for all channels maps zero-mean tokens to zero-mean
tokens: interpolation of a position grid, average pooling, zero padding, gathers, flips, rolls,
concatenation, a blur whose kernel every channel shares. A depthwise convolution with a kernel per
channel, or a per-channel scale, does not, and the analysis must not treat it as if it did. On the
reader side, a mean over tokens (weights summing to 1) passes β and γ through to the Linear after
it; a sum over tokens does not pass β.

Checked on hand-written models (every variant) and on the transformers models whose verdicts used
to change with the image resolution (issue 22's table).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from torch import nn

import normswap
from normswap.analysis.dataflow import channel_mixing
from normswap.analysis.trace import record
from normswap.pipeline import default_dtype
from normswap.surgery.verify import compare
from tests.custom_models import PreBlock
from tests.custom_models import randomise as randomise_custom
from tests.zoo import float64_casts, float64_reference, randomise

GRID = 8  # rows of the position table


class MixNet(nn.Module):
    """Token embedding plus a position table that reaches the stream through ``mix``; Pre-LN blocks;
    a final norm read by a pooled head (``pool``: the first token, a mean or a sum over tokens)."""

    def __init__(self, mix: str, pool: str = "first", d: int = 16, vocab: int = 40) -> None:
        super().__init__()
        self.mix, self.pool = mix, pool
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, GRID, d) * 0.5)
        self.blocks = nn.Sequential(PreBlock(d, 4), PreBlock(d, 4))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 5)
        if mix == "depthwise":  # a kernel per channel
            self.dw = nn.Conv1d(d, d, 3, padding=1, groups=d, bias=False)
        self.register_buffer("blur", torch.tensor([0.25, 0.5, 0.25]).repeat(d, 1, 1))  # one kernel for all
        self.register_buffer("scale", torch.linspace(0.5, 2.0, d))

    def positions(self, t: int) -> torch.Tensor:
        p, mix = self.pos, self.mix
        grid = p.transpose(1, 2)  # (1, d, GRID): channels first, as interpolate and conv1d want
        if mix == "interpolate":
            return F.interpolate(grid, size=t, mode="linear", align_corners=False).transpose(1, 2)
        if mix == "avgpool":
            return F.adaptive_avg_pool1d(torch.cat([grid, grid], 2), t).transpose(1, 2)
        if mix == "blur":
            return F.conv1d(F.interpolate(grid, size=t, mode="nearest"), self.blur, padding=1,
                            groups=grid.shape[1]).transpose(1, 2)
        if mix == "depthwise":
            return self.dw(F.interpolate(grid, size=t, mode="nearest")).transpose(1, 2)
        if mix == "scale":
            return (p * self.scale)[:, torch.arange(t) % GRID]
        if mix == "flip":
            return torch.cat([p, p], 1).flip(1)[:, :t]
        if mix == "roll":
            return torch.cat([p, p], 1).roll(3, dims=1)[:, :t]
        if mix == "gather":
            return p.index_select(1, torch.arange(t) % GRID)
        if mix == "pad":
            return F.pad(p, (0, 0, 0, t - GRID)) if t > GRID else p[:, :t]
        if mix == "cat":
            return torch.cat([p[:, :3], p.flip(1), p], 1)[:, :t]
        raise ValueError(mix)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        if self.mix == "roll":  # a module writer's output through a token roll too
            x = x.roll(1, dims=1)
        x = self.blocks(x + self.positions(ids.shape[1]))
        h = self.norm(x)
        pooled = h[:, 0] if self.pool == "first" else h.mean(1) if self.pool == "mean" else h.sum(1)
        return self.head(pooled)


def _ids(batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor]:
    return (torch.randint(0, 40, (batch, length), generator=torch.Generator().manual_seed(seed)),)


def _model(mix: str, pool: str = "first") -> MixNet:
    torch.manual_seed(0)
    return randomise_custom(MixNet(mix, pool))


def _convert_and_check(model: nn.Module, convert_at, run_at: list) -> normswap.Report:
    """Patch at one shape, then compare with the float64 original at the others."""
    original = copy.deepcopy(model)
    report = normswap.patch(model, convert_at)
    for inputs in run_at:
        with torch.no_grad():
            ref, out = original(*inputs), model(*inputs)
        assert float((ref - out).abs().max() / ref.abs().max()) <= 1e-12
    return report


SHARED = ["interpolate", "avgpool", "blur", "flip", "roll", "gather", "pad", "cat"]


@pytest.mark.parametrize("mix", SHARED)
def test_a_position_table_through_a_channel_shared_token_mix_is_centered_at_the_source(mix):
    model = _model(mix)
    plans = [normswap.plan(model, _ids(b, t, s)) for b, t, s in ((2, GRID, 0), (3, 12, 2))]
    for plan in plans:
        assert {s.verdict for s in plan.sites} == {"exact"}, plan.table()
        assert not plan.hooks
        assert "pos" in {e.target for e in plan.writer_edits}
        assert plan.to_dict() == plans[0].to_dict()
    _convert_and_check(model, _ids(1, 5, 1), [_ids(2, GRID, 3), _ids(3, 12, 4)])


@pytest.mark.parametrize("mix", ["depthwise", "scale"])
def test_a_per_channel_token_mix_or_scale_is_not_taken_for_a_centered_writer(mix):
    """A kernel (or scale) per channel does not keep tokens zero-mean: the table is not centered at its
    source; the stream needs a centering op where it starts, and the conversion stays exact."""
    model = _model(mix)
    for inputs in (_ids(2, GRID), _ids(3, 12, 2)):
        plan = normswap.plan(model, inputs)
        assert "pos" not in {e.target for e in plan.writer_edits}, plan.table()
        assert {s.verdict for s in plan.sites} == {"exact-with-centering"}, plan.table()
        assert len(plan.hooks) == 1
    _convert_and_check(model, _ids(3, 12, 2), [_ids(2, GRID, 3)])


def test_channel_mixing_proves_the_form_on_the_traced_op():
    """The proof itself: the shared blur and the interpolation pass, the depthwise kernel per channel
    and a bias fail (a bias makes the op affine, not linear)."""
    d = 16
    x = torch.randn(2, d, 9, dtype=torch.float64)
    kernels = {"shared": torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64).repeat(d, 1, 1),
               "per-channel": torch.randn(d, 1, 3, dtype=torch.float64)}

    class Probe(nn.Module):
        def forward(self, x, k, bias):
            return F.conv1d(x, k, bias, padding=1, groups=d), F.interpolate(x, size=13, mode="linear")

    for name, k in kernels.items():
        for bias in (None, torch.randn(d, dtype=torch.float64)):
            graph = record(Probe(), (x, k, bias), {})
            conv = next(op for op in graph.ops if op.name == "conv1d")
            interp = next(op for op in graph.ops if op.name == "interpolate")
            proved = {(m.in_axis, m.out_axis) for m in channel_mixing(graph, conv, conv.inputs[0])}
            # channels along axis 1; along the batch axis every conv is channel-shared, bias aside
            assert proved == ({(0, 0), (1, 1)} if name == "shared" else {(0, 0)}) if bias is None else not proved, \
                (name, bias is None, proved)
            assert any(m.in_axis == 1 and m.out_axis == 1 and m.keeps_constants
                       for m in channel_mixing(graph, interp, interp.inputs[0]))


def test_a_mean_over_tokens_reading_a_norm_folds_its_beta_a_sum_does_not():
    """Reader side: ``head(norm(x).mean(1))`` sees ``γ ⊙ mean(u) + β``, so β folds into the head's bias;
    ``head(norm(x).sum(1))`` sees ``T·β``, which depends on the length: β stays in the RMSNorm.
    ``beta_placement="fold"``: the fold's mechanics, not the default's bf16 rounding choice."""
    mean, total = _model("interpolate", "mean"), _model("interpolate", "sum")
    plan = normswap.plan(mean, _ids(2, GRID), beta_placement="fold")
    assert ("norm", "head") in {(f.site, f.reader) for f in plan.folds}, plan.table()
    assert next(s for s in plan.sites if s.name == "norm").verdict == "exact"
    plan = normswap.plan(total, _ids(2, GRID), beta_placement="fold")
    assert ("norm", "head") not in {(f.site, f.reader) for f in plan.folds}
    assert next(s for s in plan.sites if s.name == "norm").verdict == "exact"
    for model in (mean, total):
        _convert_and_check(model, _ids(1, 5, 1), [_ids(2, GRID, 3), _ids(3, 12, 4)])


# --- issue 22's table: transformers vision models at another resolution
V = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
         intermediate_size=64)
VISION = {  # name -> (class, config, does forward take interpolate_pos_encoding)
    "vit": lambda: (tf.ViTModel, tf.ViTConfig(**V), True),
    "deit": lambda: (tf.DeiTModel, tf.DeiTConfig(**V), True),
    "clip-vision": lambda: (tf.CLIPVisionModel, tf.CLIPVisionConfig(**V), True),
    "siglip-vision": lambda: (tf.SiglipVisionModel, tf.SiglipVisionConfig(**V), True),
    "dinov2": lambda: (tf.Dinov2Model, tf.Dinov2Config(**{k: v for k, v in V.items() if k != "intermediate_size"},
                                                       mlp_ratio=2), False),
    "beit-mean-pooling": lambda: (tf.BeitModel, tf.BeitConfig(**V, use_mean_pooling=True,
                                                                use_absolute_position_embeddings=True), False),
}


def _pixels(size: int, flag: bool, seed: int) -> dict:
    x = {"pixel_values": torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(seed),
                                     dtype=torch.float64)}
    if flag:
        x["interpolate_pos_encoding"] = True
    return x


@pytest.mark.parametrize("name", sorted(VISION))
def test_vision_models_reach_the_same_verdicts_at_another_resolution_and_stay_exact(name):
    cls, config, flag = VISION[name]()
    torch.manual_seed(0)
    model = randomise(cls(config))
    original = float64_reference(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        at_config = normswap.plan(model, _pixels(32, False, 0))
        report = normswap.patch(model, _pixels(48, flag, 1), mode="exact")  # planned and converted at 48 px
    at_other = report.plan
    assert [(s.name, s.verdict, s.reason, s.writer_targets) for s in at_other.sites] \
        == [(s.name, s.verdict, s.reason, s.writer_targets) for s in at_config.sites], \
        f"{at_config.table()}\n---\n{at_other.table()}"
    for what in ("writer_edits", "folds", "hooks", "unties", "scale_folds", "beta_moves"):
        assert getattr(at_other, what) == getattr(at_config, what), what
    verdicts = {s.name: s.verdict for s in at_config.sites}
    approximate = {n for n, v in verdicts.items() if v == "approximate"}
    # SigLIP's attention-pooling head reads an attention output (not zero-mean, and returned as pooler_output):
    # its head norm takes an op on its own input, which changes nothing else
    assert not approximate, at_config.table()
    for size in (32, 64):
        inputs = _pixels(size, flag and size != 32, 2)
        with torch.no_grad(), default_dtype(torch.float64), float64_casts():
            figs = compare(original(**inputs), model(**inputs), set(report.plan.changed_outputs))
        assert figs["compared"] and figs["worst_rel_error_any_output"] <= 1e-9, (size, figs)
