"""Small replicas of patterns that real third-party model libraries use and that once broke normswap.

Found by ``benchmarks/bench_third_party.py`` on the real libraries (x-transformers, open_clip, fair-esm,
vit-pytorch, timm); written here so the suite needs none of them. Each class names the library and the
option that uses the pattern.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A Pre-LN block (attention with separate projections, GELU MLP)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.proj = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attend(self.ln_1(x))
        return x + self.proj(F.gelu(self.fc(self.ln_2(x))))


class ClosureTiedLM(nn.Module):
    """x-transformers' ``TransformerWrapper(tie_embedding=True)``: the logits come from a lambda stored on
    the module that closes over ``self`` (``self.to_logits = lambda t: t @ self.token_emb.emb.weight.t()``).

    ``copy.deepcopy`` keeps function objects as they are, so a deep copy's lambda still reads the
    original's embedding: a working copy analysed and verified that way sees no tied read.
    """

    def __init__(self, vocab: int = 40, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(16, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        scale = d ** -0.5
        self.to_logits = lambda t: (t @ self.tok.weight.t()) * scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.to_logits(self.norm(x))


class OffsetLayerScale(nn.Module):
    """x-transformers' ``LayerScale``: the branch output times ``gamma + float(unit_offset)``, a product whose
    factor is the parameter plus a constant rather than the parameter itself."""

    def __init__(self, fn: nn.Module, d: int, unit_offset: bool) -> None:
        super().__init__()
        self.fn, self.unit_offset = fn, unit_offset
        self.gamma = nn.Parameter(torch.full((d,), 0.1 - float(unit_offset)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x) * (self.gamma + float(self.unit_offset))


class LayerScaleLM(nn.Module):
    """A Pre-LN decoder whose attention and MLP branches are scaled as x-transformers' ``use_layerscale=True``
    (``unit_offset=True``: ``gamma + 1.0``) does."""

    def __init__(self, vocab: int = 40, d: int = 32, heads: int = 4, layers: int = 2, unit_offset: bool = False
                 ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.attn = nn.ModuleList(OffsetLayerScale(b.out, d, unit_offset) for b in self.blocks)
        self.mlp = nn.ModuleList(OffsetLayerScale(b.proj, d, unit_offset) for b in self.blocks)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block, attn, mlp in zip(self.blocks, self.attn, self.mlp, strict=True):
            b, t, d = x.shape
            h = block.ln_1(x)
            q, k, v = (z.view(b, t, block.heads, -1).transpose(1, 2) for z in block.qkv(h).chunk(3, dim=-1))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
            x = x + attn(y)
            x = x + mlp(F.gelu(block.fc(block.ln_2(x))))
        return self.head(self.norm(x))


class MhaLayerScaleEncoder(nn.Module):
    """open_clip's ``ResidualAttentionBlock`` with ``ls_init_value`` and no class token: ``x * gamma`` right after
    ``nn.MultiheadAttention(batch_first=True)``, whose output projection is applied inside
    ``F.multi_head_attention_forward`` and followed by a ``view`` and a ``transpose`` before the product."""

    def __init__(self, d: int = 32, heads: int = 4, layers: int = 2, patch: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, patch)
        self.pos = nn.Parameter(torch.randn(16, d) * 0.1)
        self.ln_1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.ln_2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.attn = nn.ModuleList(nn.MultiheadAttention(d, heads, batch_first=True) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                 for _ in range(layers))
        self.ls_1 = nn.ParameterList(nn.Parameter(torch.full((d,), 0.1)) for _ in range(layers))
        self.ls_2 = nn.ParameterList(nn.Parameter(torch.full((d,), 0.1)) for _ in range(layers))
        self.ln_post = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.patch(img).flatten(2).transpose(1, 2)
        x = x + self.pos[: x.shape[1]]
        for i in range(len(self.attn)):
            h = self.ln_1[i](x)
            x = x + self.attn[i](h, h, h, need_weights=False)[0] * self.ls_1[i]
            x = x + self.mlp[i](self.ln_2[i](x)) * self.ls_2[i]
        return self.head(self.ln_post(x).mean(dim=1))


def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    """fair-esm's (and fairseq's) GELU, written out in ops rather than ``F.gelu``."""
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
