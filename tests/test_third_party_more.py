"""Replicas of patterns from issue 37's held-out third-party libraries (benchmarks/bench_third_party_more.py),
each a small model written here (never importing the library), float64, LayerNorm γ/β randomised, eval:
every Pre-LN norm converted exactly (≤ 1e-9 against the float64 original)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normswap

H, C = 4, 8
D = H * C


def _randomised(model: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    model = model.double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
    return model


def _max_error(make, inputs_a: tuple, inputs_b: tuple, **options: object) -> tuple[float, dict]:
    torch.manual_seed(1)
    original = _randomised(make())
    torch.manual_seed(1)
    model = _randomised(make())
    report = normswap.patch(model, inputs_a, **options)
    with torch.no_grad():
        errs = [float((model(*x) - original(*x)).abs().max() / original(*x).abs().max()) for x in (inputs_a, inputs_b)]
    return max(errs), report.plan.counts()


# ---------------------------------------------------------------------- graph message passing
class _GraphConv(nn.Module):
    """torch_geometric's ``TransformerConv``: per-edge messages ``[edges, heads, head_dim]`` (a value Linear
    viewed per head, weighted per edge or per edge and head), summed into their target nodes with
    ``new_zeros(...).scatter_add_`` or ``index_add_`` on the 3-d view, plus a root Linear."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.value, self.skip, self.query, self.key = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        src, dst = edges
        msg = self.value(x)[src].view(-1, H, C)
        if self.how.endswith("head"):  # attention per edge and head: each head block is centered alone
            score = (self.query(x)[dst].view(-1, H, C) * self.key(x)[src].view(-1, H, C)).sum(-1).sigmoid()
            msg = msg * score.view(-1, H, 1)
        elif self.how.endswith("edge"):
            msg = msg * (self.query(x)[dst] * self.key(x)[src]).sum(-1).sigmoid().view(-1, 1, 1)
        if self.how.startswith("index_add"):
            out = msg.new_zeros((x.shape[0], H, C)).index_add_(0, dst, msg)
        else:
            out = msg.new_zeros((x.shape[0], H, C)).scatter_add_(0, dst.view(-1, 1, 1).expand_as(msg), msg)
        return out.view(-1, D) + self.skip(x)


class _GraphPreLN(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.embed = nn.Linear(6, D)
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(3))
        self.convs = nn.ModuleList(_GraphConv(how) for _ in range(2))
        self.head = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for norm, conv in zip(self.norms, self.convs, strict=False):
            h = h + conv(norm(h), edges)
        return self.head(F.gelu(self.norms[-1](h)))


def _graph(nodes: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(nodes, 6, generator=gen, dtype=torch.float64),
            torch.randint(0, nodes, (2, 3 * nodes), generator=gen))


@pytest.mark.parametrize("how", ["scatter_add", "index_add", "scatter_add per edge"])
def test_messages_over_heads_summed_into_nodes_stay_exact(how: str) -> None:
    """A row sum whose rows lie along two axes (heads × head_dim) mixes whole rows with one weight per
    edge: every norm after it stays exact (it read 'reaches no norm' and went approximate). The node
    embedding Linear is centered by its weights, so every centering here is a weight edit (no stem op)."""
    err, counts = _max_error(lambda: _GraphPreLN(how), _graph(9, 0), _graph(13, 1), stem_centering="weights")
    assert counts["approximate"] == 0 and counts["exact"] == 3, counts
    assert err <= 1e-9
    # the default keeps the node embedding's weights and centers its stream by one op: exact all the same
    err, counts = _max_error(lambda: _GraphPreLN(how), _graph(9, 0), _graph(13, 1))
    assert counts["approximate"] == 0 and counts["exact-with-centering"] == 3, counts
    assert err <= 1e-9


def test_messages_weighted_per_head_are_not_claimed_exact() -> None:
    """A factor per edge *and head* (``[edges, heads, 1]``) scales each head's block of a row by its own
    number: a centered row does not stay centered, so the norms after it are approximate, not planned
    exact and then refused by verification."""
    torch.manual_seed(1)
    model = _randomised(_GraphPreLN("scatter_add per head"))
    plan = normswap.patch(model, _graph(9, 0), stem_centering="weights").plan  # weight edits only (no stem op)
    assert plan.counts()["exact"] == 1 and plan.counts()["approximate"] == 2, plan.counts()
    assert "its rows stop at `mul`" in plan.site("norms.1").reason  # names the per-head factor


# --------------------------------------------------------------- residual branch behind dropout
class _FTBlock(nn.Module):
    """rtdl's FT-Transformer block: no attention norm in the first block (the attention reads the raw
    embeddings), the branch output passed through a Dropout module before the residual add."""

    def __init__(self, first: bool) -> None:
        super().__init__()
        self.attention_normalization = nn.Identity() if first else nn.LayerNorm(D)
        self.attention = nn.MultiheadAttention(D, H, batch_first=True)
        self.attention_residual_dropout = nn.Dropout(0.1)
        self.ffn_normalization = nn.LayerNorm(D)
        self.ffn = nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, D))
        self.ffn_residual_dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.attention_normalization(x)
        x = x + self.attention_residual_dropout(self.attention(h, h, h, need_weights=False)[0])
        return x + self.ffn_residual_dropout(self.ffn(self.ffn_normalization(x)))


class _FTTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Parameter(torch.randn(5, D))
        self.blocks = nn.ModuleList(_FTBlock(i == 0) for i in range(2))
        self.output = nn.Sequential(nn.LayerNorm(D), nn.ReLU(), nn.Linear(D, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.unsqueeze(-1) * self.features
        for block in self.blocks:
            h = block(h)
        return self.output(h[:, 0])


def test_first_block_without_attention_norm_branch_behind_dropout() -> None:
    """The one centering op sits on the first block's residual sum ``x + drop(attn(x))`` (the branch
    module's output reaches the sum through an eval-mode Dropout): every norm exact-with-centering, none
    approximate (the op went to the block's output and left ``ffn_normalization`` approximate)."""
    x_a = torch.randn(3, 5, dtype=torch.float64)
    x_b = torch.randn(6, 5, dtype=torch.float64)
    err, counts = _max_error(_FTTransformer, (x_a,), (x_b,))
    assert counts["approximate"] == 0 and counts["exact-with-centering"] == 4, counts
    assert err <= 1e-9
