"""Which values are computed from a LayerNorm's output (``Analyzer.depends_on_norm``), asked in any order.

What could be silently wrong: the answer to one question leaking into the next through the memo. A search that
marked every value it visited on its way to some norm as computed from a norm also marked the raw-input side
branches it passed (LayoutLMv3's bounding-box and position values, which its layers read beside the normed
stream): the embedding LayerNorm whose input they feed was then taken for a Post-LN norm, and the model's
top-level LayerNorm lost its stream-start op (exact-with-centering -> approximate) depending on which question
the planner happened to ask first (since ``stem_centering="op"`` asks about the layers' writers before the ops
are placed; the default's fallback to stem weights had hidden it since).
"""

from __future__ import annotations

import copy
import warnings

import torch
import transformers as tf
from torch import nn

import normswap
from normswap.analysis import streams
from normswap.options import ConvertOptions
from normswap.pipeline import analyse_copy
from tests import zoo

TOL = 1e-9


class _SideBranch(nn.Module):
    """A raw-input side value (a position table's rows) summed into the embeddings and read again inside the
    layers, beside the normed stream (LayoutLMv3's relative position bias reads the ids and boxes again)."""

    def __init__(self, vocab: int = 40, width: int = 16) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(vocab, width)
        self.ln0, self.fc, self.ln1 = nn.LayerNorm(width), nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        side = self.pos(ids)
        h = self.ln0(self.tok(ids) + side)
        return self.ln1(self.fc(h) + side)


def test_a_value_on_a_side_branch_is_not_taken_for_one_computed_from_a_norm():
    torch.manual_seed(0)
    work = zoo.randomise(_SideBranch()).double().eval()
    ids = torch.randint(0, 40, (2, 7))
    opts = ConvertOptions()
    result = analyse_copy(work, (ids,), {}, opts)
    an = streams.Analyzer(work, result.graph, list(result.sites.values()), untie=opts.untie_used, fold_gamma=False)
    ln0, ln1 = an.graph.calls_of("ln0")[0], an.graph.calls_of("ln1")[0]
    side = an.graph.calls_of("pos")[0].outputs[0]
    # the later norm's input first: its search passes the side branch before it finds ln0's output
    assert an.depends_on_norm(ln1.first_input())
    assert not an.depends_on_norm(side)
    assert not an.depends_on_norm(ln0.first_input())
    assert not an.depends_on_norm(ln0.outputs[0])  # the first norm's output starts a stream (its input: no norm)
    assert an.depends_on_norm(ln1.outputs[0])  # a Post-LN norm's output does not
    # the same answers asked in the other order, on a fresh analyzer
    fresh = streams.Analyzer(work, result.graph, list(result.sites.values()), untie=opts.untie_used, fold_gamma=False)
    assert [fresh.depends_on_norm(v) for v in (side, ln0.outputs[0], ln1.first_input())] == [False, False, True]


def _layoutlmv3() -> nn.Module:
    """A tiny LayoutLMv3 (text and image towers, relative 1D and 2D attention biases), float64, γ/β randomised."""
    config = tf.LayoutLMv3Config(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=40, max_2d_position_embeddings=64, coordinate_size=6, shape_size=4,
        rel_pos_bins=8, max_rel_pos=16, rel_2d_pos_bins=8, max_rel_2d_pos=32, input_size=32, patch_size=8,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1)
    torch.manual_seed(0)
    model = zoo.randomise(tf.LayoutLMv3Model(config).double().eval(), 0)
    with torch.no_grad():  # the class token and the image position table start at zero
        model.cls_token.normal_()
        model.pos_embed.normal_()
    return model


def _inputs(batch: int, seq: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    corners = torch.randint(0, 30, (batch, seq, 2), generator=g)
    sizes = torch.randint(1, 30, (batch, seq, 2), generator=g)
    bbox = torch.cat([corners, (corners + sizes).clamp_max(63)], -1)
    return {"input_ids": torch.randint(2, 64, (batch, seq), generator=g), "bbox": bbox,
            "pixel_values": torch.randn(batch, 3, 32, 32, generator=g, dtype=torch.float64)}


def test_layoutlmv3_top_norm_keeps_its_stream_start_op_and_is_exact_at_another_length():
    """The top-level ``LayerNorm`` reads the text embedding norm's output beside the image tower's ``norm``: one
    op at each of those outputs (where a stream starts) makes it exact, with the stem op asked for or by default
    (which then has no reason to fall back to stem weights)."""
    model = _layoutlmv3()
    for stem in ("op", None):
        conv = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = normswap.patch(conv, _inputs(2, 6, 0), mode="exact", stem_centering=stem)
        verdicts = {s.name: s.verdict for s in report.sites}
        assert verdicts["LayerNorm"] == "exact-with-centering", (stem, verdicts)
        assert verdicts["norm"] == "exact", verdicts
        assert report.plan.options["stem_centering"] == "op", stem
        assert {(h.module, h.where) for h in report.plan.hooks} >= {("embeddings.LayerNorm", "output"),
                                                                     ("norm", "output")}
        other = _inputs(3, 11, 1)  # another batch and length than the traced one
        with torch.no_grad():
            ref, out = model(**other).last_hidden_state, conv(**other).last_hidden_state
        assert float((out - ref).abs().max()) <= TOL * float(ref.abs().max()), stem
