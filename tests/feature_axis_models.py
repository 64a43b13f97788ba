"""Models whose writers and token mixes are recognised by what they do to the feature axis, not by idiom.

Each is a small Pre-LN replica of how real code spells a writer or a row sum: a weight reaching its matmul
through views (``.T.contiguous()``, ``permute``, an einops ``rearrange``), a contraction other than
``nn.Linear`` (``einsum``, ``bmm``, ``baddbmm``, ``addmm``, ``tensordot``), interpretability-style weights
stored ``[heads, d_model, d_head]`` and applied with ``einsum``, a class token broadcast with
``broadcast_to``, a position table added to a slice of itself, and message passing (``index_add``,
``scatter_add``, ``scatter_reduce``, ``index_put_`` with ``accumulate``, a sparse adjacency matmul). Every
norm of every one is exact once its writers are centered (tests/analysis/test_feature_axis_ops.py).
"""

from __future__ import annotations

import einops
import torch
import torch.nn.functional as F
from torch import nn

D, VOCAB = 32, 50


class LayoutBlock(nn.Module):
    """The issue's block: a residual writer whose weight reaches its matmul in one of several layouts."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.ln, self.up = how, nn.LayerNorm(D), nn.Linear(D, 64)
        self.W, self.b = nn.Parameter(torch.randn(64, D) / 8), nn.Parameter(torch.randn(D))
        self.W_O = nn.Parameter(torch.randn(4, 16, D) / 8)  # [heads, d_head, d_model]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.up(self.ln(x)))
        if self.how == "T":
            out = F.linear(h, self.W.T, self.b)
        elif self.how == "T.contiguous":
            out = F.linear(h, self.W.T.contiguous(), self.b)
        elif self.how == "permute":
            out = F.linear(h, self.W_O.permute(2, 0, 1).reshape(D, 64), self.b)
        elif self.how == "rearrange":  # einops lowers it to a permute and a reshape
            out = F.linear(h, einops.rearrange(self.W_O, "h k d -> d (h k)"), self.b)
        elif self.how == "mT.float":
            out = h @ self.W.mT.mT.to(h.dtype) + self.b
        elif self.how == "einsum":
            out = torch.einsum("bsi,id->bsd", h, self.W) + self.b
        elif self.how == "bmm":
            out = torch.bmm(h, self.W.unsqueeze(0).expand(h.shape[0], -1, -1)) + self.b
        elif self.how == "baddbmm":
            out = torch.baddbmm(self.b.expand(h.shape[0], h.shape[1], D), h, self.W.expand(h.shape[0], 64, D))
        elif self.how == "addmm":
            out = torch.addmm(self.b, h.reshape(-1, 64), self.W).reshape(x.shape)
        elif self.how == "tensordot":
            out = torch.tensordot(h, self.W.T.contiguous(), dims=([2], [1])) + self.b
        else:
            raise ValueError(self.how)
        return x + out


class LayoutLM(nn.Module):
    """Embedding -> 2 LayoutBlocks -> final LayerNorm -> head: three norms, all exact."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([LayoutBlock(how) for _ in range(2)])
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


class EinsumAttention(nn.Module):
    """TransformerLens-style attention: W_Q/W_K/W_V ``[heads, d_model, d_head]``, W_O ``[heads, d_head, d_model]``."""

    def __init__(self, heads: int = 4, d_head: int = 8) -> None:
        super().__init__()
        self.W_Q, self.W_K, self.W_V = (nn.Parameter(torch.randn(heads, D, d_head) / 6) for _ in range(3))
        self.W_O = nn.Parameter(torch.randn(heads, d_head, D) / 6)
        self.b_Q, self.b_K, self.b_V = (nn.Parameter(torch.randn(heads, d_head) / 4) for _ in range(3))
        self.b_O = nn.Parameter(torch.randn(D) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.einsum("bpd,hdk->bphk", x, self.W_Q) + self.b_Q
        k = torch.einsum("bpd,hdk->bphk", x, self.W_K) + self.b_K
        v = torch.einsum("bpd,hdk->bphk", x, self.W_V) + self.b_V
        scores = torch.einsum("bqhk,bshk->bhqs", q, k) / q.shape[-1] ** 0.5
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        pattern = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        z = torch.einsum("bhqs,bshk->bqhk", pattern, v)
        return torch.einsum("bqhk,hkd->bqd", z, self.W_O) + self.b_O


class EinsumMLP(nn.Module):
    def __init__(self, d_mlp: int = 64) -> None:
        super().__init__()
        self.W_in, self.b_in = nn.Parameter(torch.randn(D, d_mlp) / 6), nn.Parameter(torch.randn(d_mlp) / 4)
        self.W_out, self.b_out = nn.Parameter(torch.randn(d_mlp, D) / 8), nn.Parameter(torch.randn(D) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(torch.einsum("bpd,dm->bpm", x, self.W_in) + self.b_in)
        return torch.einsum("bpm,md->bpd", h, self.W_out) + self.b_out


class EinsumBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(D), EinsumAttention(), nn.LayerNorm(D), EinsumMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class EinsumLM(nn.Module):
    """An interpretability-library-style LM: raw W_E / W_pos tables, einsum everywhere, W_U ``[d_model, vocab]``."""

    def __init__(self, layers: int = 2, n_ctx: int = 16) -> None:
        super().__init__()
        self.W_E = nn.Parameter(torch.randn(VOCAB, D) / 2)
        self.W_pos = nn.Parameter(torch.randn(n_ctx, D) / 2)
        self.blocks = nn.ModuleList([EinsumBlock() for _ in range(layers)])
        self.ln_final = nn.LayerNorm(D)
        self.W_U, self.b_U = nn.Parameter(torch.randn(D, VOCAB) / 6), nn.Parameter(torch.zeros(VOCAB))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = einops.repeat(self.W_pos[: ids.shape[1]], "p d -> b p d", b=ids.shape[0])
        x = self.W_E[ids] + pos
        for block in self.blocks:
            x = block(x)
        return torch.einsum("bpd,dv->bpv", self.ln_final(x), self.W_U) + self.b_U


class TokenViT(nn.Module):
    """Patch tokens -> Linear patch embedding, a class token, a position table; Pre-LN blocks; final norm.

    ``cls``: ``broadcast_to`` (where ``expand`` was the idiom). ``pe_slice``: the VitPose table, added to a
    slice of itself (``pe[:, 1:] + pe[:, :1]``) and no class token."""

    def __init__(self, pe_slice: bool = False, patches: int = 6, patch_dim: int = 12) -> None:
        super().__init__()
        self.pe_slice = pe_slice
        self.embed = nn.Linear(patch_dim, D)
        self.cls = nn.Parameter(torch.randn(1, 1, D))
        self.pos = nn.Parameter(torch.randn(1, patches + 1, D))
        self.blocks = nn.ModuleList([LayoutBlock("T.contiguous") for _ in range(2)])
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, 5)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.embed(patches)
        if self.pe_slice:
            x = x + (self.pos[:, 1:] + self.pos[:, :1])
        else:
            x = torch.cat([self.cls.broadcast_to(x.shape[0], 1, D), x], dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class MessageLayer(nn.Module):
    """One message-passing step written into the node stream: ``h + Σ_edges w_e · msg(ln(h))[src]`` into ``dst``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.ln, self.msg = how, nn.LayerNorm(D), nn.Linear(D, D)

    def forward(self, h: torch.Tensor, edges: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        src, dst = edges
        m = self.msg(self.ln(h))[src] * weight[:, None]
        if self.how == "index_add":
            agg = torch.zeros_like(h).index_add(0, dst, m)
        elif self.how == "index_add_":
            agg = h.new_zeros(h.shape)
            agg.index_add_(0, dst, m)
        elif self.how == "scatter_add":
            agg = torch.zeros_like(h).scatter_add(0, dst[:, None].expand_as(m), m)
        elif self.how == "scatter_reduce_sum":
            agg = torch.zeros_like(h).scatter_reduce(0, dst[:, None].expand_as(m), m, reduce="sum")
        elif self.how == "scatter_reduce_mean":
            agg = torch.zeros_like(h).scatter_reduce(0, dst[:, None].expand_as(m), m, reduce="mean",
                                                     include_self=False)
        elif self.how == "index_put":
            agg = torch.zeros_like(h).index_put_((dst,), m, accumulate=True)
        elif self.how == "segment_reduce":  # messages sorted by destination, summed per segment
            order = torch.argsort(dst, stable=True)
            lengths = torch.bincount(dst, minlength=h.shape[0])
            agg = torch.segment_reduce(m[order], "sum", lengths=lengths, unsafe=True)
        elif self.how == "sparse_mm":
            n = h.shape[0]
            adj = torch.sparse_coo_tensor(torch.stack([dst, torch.arange(len(dst))]),
                                          torch.ones(len(dst), dtype=h.dtype), (n, len(dst)), check_invariants=True)
            agg = torch.sparse.mm(adj, m)
        else:
            raise ValueError(self.how)
        return h + agg


class MessagePassingNet(nn.Module):
    """Node features -> Linear -> 2 message-passing layers -> final LayerNorm -> readout: three norms, all exact."""

    def __init__(self, how: str, features: int = 7) -> None:
        super().__init__()
        self.embed = nn.Linear(features, D)
        self.layers = nn.ModuleList([MessageLayer(how) for _ in range(2)])
        self.norm, self.readout = nn.LayerNorm(D), nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, edges: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, edges, weight)
        return self.readout(self.norm(h))
