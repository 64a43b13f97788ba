"""Writer centering by ops keeps every stream start a norm's output begins (round 61's --quantizer sweep).

A norm whose output starts a stream (a ViT head's LayerNorm reading the encoder's final norm: AST, Cosmos3-Edge's
projector; a Conformer layer's ``norm_out`` whose output the next layer's norms read: Cohere ASR) is exact with the
defaults by one op where that stream starts, because the norm before it is exact by weight surgery. With
``writer_centering="op"`` (``quantizer="openvino-int8"``/``"torchao"`` on a Pre-LN model) the writers of that
norm's input are centered by their own ops instead of their weights; the planner took that for "not centered by
surgery" and left every norm of the stream approximate ("Post-LN"): an option meant to keep weights for a
quantizer silently cost exactness. What could be silently wrong: a norm exact with the defaults approximate with
the op; the conversion not exact; the writers' weights edited after all.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from normswap.analysis.plan import plan_of
from tests.zoo import patched_copies

D, FF, VOCAB, TOL = 16, 32, 50, 1e-10
EXACT = ("exact", "exact-with-centering", "exact-with-per-norm-centering")


class Block(nn.Module):
    """A Pre-LN block; ``norm_out``: a Conformer-style norm at the block's end whose output is the next block's
    stream."""

    def __init__(self, norm_out: bool) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn_v, self.attn_o = nn.Linear(D, D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, FF), nn.Linear(FF, D)
        self.norm_out = nn.LayerNorm(D) if norm_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attn_v(self.ln1(x))
        x = x + self.attn_o(h.mean(1, keepdim=True).expand_as(h) + h)  # token mixing keeps centering
        x = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))
        return self.norm_out(x) if self.norm_out is not None else x


class Model(nn.Module):
    """Token embedding, two blocks, then either (``norm_out=False``) a final norm and a head norm reading its
    output (a ViT classifier's own LayerNorm), or (``norm_out=True``) Conformer blocks, each ending in its own
    norm, read by the head."""

    def __init__(self, norm_out: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList(Block(norm_out) for _ in range(2))
        self.final = None if norm_out else nn.LayerNorm(D)
        self.head_norm = None if norm_out else nn.LayerNorm(D)
        self.head = nn.Linear(D, 7)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        if self.final is not None:
            x = self.head_norm(self.final(x))
        return self.head(x)


def _model(norm_out: bool) -> nn.Module:
    torch.manual_seed(0)
    model = Model(norm_out).double().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.3)
            elif isinstance(m, nn.Linear):
                m.bias.normal_(0.0, 0.3)
    return model


def _ids(seed: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=[False, True], ids=["vit-head-norm", "conformer-norm-out"])
def converted(request) -> dict[str, tuple[nn.Module, nn.Module]]:
    model = _model(request.param)
    return {"model": model, **patched_copies(model, {"input_ids": _ids(1, 2, 9)}, {
        "defaults": {}, "op": {"writer_centering": "op"}, "openvino-int8": {"quantizer": "openvino-int8"}})}


@pytest.mark.parametrize("option", ["op", "openvino-int8"])
def test_writer_ops_keep_every_norm_the_defaults_make_exact(converted, option):
    default_plan, plan = plan_of(converted["defaults"]), plan_of(converted[option])
    assert all(s.verdict in EXACT for s in default_plan.sites), default_plan.table()
    assert all(s.verdict in EXACT for s in plan.sites), plan.table()
    assert any(h.writer for h in plan.hooks)  # the option did act: the writers are behind ops
    # the writers inside the blocks keep the original's weights (the point of the option)
    model, conv = converted["model"], converted[option]
    for name in ("blocks.0.attn_o.weight", "blocks.1.fc2.weight"):
        assert torch.equal(model.get_parameter(name), conv.get_parameter(name)), name


@pytest.mark.parametrize("option", ["defaults", "op", "openvino-int8"])
def test_the_conversion_is_exact_at_two_shapes(converted, option):
    model, conv = converted["model"], converted[option]
    for seed, batch, seq in ((3, 1, 5), (4, 2, 11)):
        ids = _ids(seed, batch, seq)
        with torch.no_grad():
            ref, out = model(ids), conv(ids)
        assert float((out - ref).abs().max()) <= TOL * max(1.0, float(ref.abs().max())), option
