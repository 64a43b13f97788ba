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

from tests.custom_models_cast import Patches


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


class ErfGeluLMHead(nn.Module):
    """fair-esm's ``RobertaLMHead``: dense, a GELU written in ops, LayerNorm, then logits from the tied token
    table (``F.linear(x, self.weight) + self.bias``). The GELU's output starts a stream only this norm reads,
    and no module boundary lies between them."""

    def __init__(self, d: int, weight: nn.Parameter) -> None:
        super().__init__()
        self.dense = nn.Linear(d, d)
        self.layer_norm = nn.LayerNorm(d)
        self.weight = weight
        self.bias = nn.Parameter(torch.zeros(weight.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer_norm(erf_gelu(self.dense(x)))
        return F.linear(x, self.weight) + self.bias


class EsmStyleLM(nn.Module):
    """ESM-2 in small: Pre-LN blocks, a final norm, and the LM head above."""

    def __init__(self, vocab: int = 40, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.emb_layer_norm_after = nn.LayerNorm(d)
        self.lm_head = ErfGeluLMHead(d, self.embed_tokens.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.emb_layer_norm_after(x))


# ------------------------------------------------------------------------------ nanoGPT style
class BiasOptionalLayerNorm(nn.Module):
    """nanoGPT's LayerNorm: ``F.layer_norm`` with an optional bias (``bias=False`` passes ``None``)."""

    def __init__(self, d: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.bias = nn.Parameter(torch.zeros(d)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class FusedAttention(nn.Module):
    """One ``c_attn`` Linear for q, k and v, split, causal ``scaled_dot_product_attention``, ``c_proj``."""

    def __init__(self, d: int, heads: int, bias: bool) -> None:
        super().__init__()
        self.heads, self.d = heads, d
        self.c_attn = nn.Linear(d, 3 * d, bias=bias)
        self.c_proj = nn.Linear(d, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.c_attn(x).split(self.d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, self.d))


class GptBlock(nn.Module):
    def __init__(self, d: int, heads: int, bias: bool) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = BiasOptionalLayerNorm(d, bias), BiasOptionalLayerNorm(d, bias)
        self.attn = FusedAttention(d, heads, bias)
        self.c_fc, self.c_proj = nn.Linear(d, 4 * d, bias=bias), nn.Linear(4 * d, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class NanoGptStyle(nn.Module):
    """A GPT written the way nanoGPT's ``model.py`` writes it: the modules in an ``nn.ModuleDict``, the token
    table tied to the head by assignment (``wte.weight = lm_head.weight``), a bias-less head, and at
    inference the logits of the last position only (``x[:, [-1], :]``), returned with a ``None`` loss."""

    def __init__(self, vocab: int = 40, block: int = 16, d: int = 32, heads: int = 4, layers: int = 2,
                 bias: bool = False) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block, d), drop=nn.Dropout(0.0),
            h=nn.ModuleList(GptBlock(d, heads, bias) for _ in range(layers)), ln_f=BiasOptionalLayerNorm(d, bias)))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x[:, [-1], :]), None


# ------------------------------------------------------------------------------ PerceiverIO style
def _attend(q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    k, v = kv.chunk(2, dim=-1)
    return F.scaled_dot_product_attention(q, k, v)


class TwoInputPerceiver(nn.Module):
    """perceiver-pytorch's ``PerceiverIO``: latents cross-attend to ``data`` through a norm on the data, and
    ``queries`` (another width) read the latents through a norm on the queries. Both model inputs start
    streams that only norms read: one centering op each, both on the model's own input, at two arguments."""

    def __init__(self, d_data: int = 24, d_query: int = 16, d: int = 32, latents: int = 4, classes: int = 10
                 ) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.randn(latents, d))
        self.norm_latents, self.norm_data = nn.LayerNorm(d), nn.LayerNorm(d_data)
        self.to_q, self.to_kv, self.to_out = nn.Linear(d, d), nn.Linear(d_data, 2 * d), nn.Linear(d, d)
        self.norm_queries, self.norm_final = nn.LayerNorm(d_query), nn.LayerNorm(d)
        self.dec_q, self.dec_kv = nn.Linear(d_query, d), nn.Linear(d, 2 * d)
        self.head = nn.Linear(d, classes)

    def forward(self, data: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
        x = self.latents.expand(data.shape[0], -1, -1)
        x = x + self.to_out(_attend(self.to_q(self.norm_latents(x)), self.to_kv(self.norm_data(data))))
        y = _attend(self.dec_q(self.norm_queries(queries)), self.dec_kv(self.norm_final(x)))
        return self.head(y)


# ------------------------------------------------------------------------------ vit-pytorch CrossViT style
class TwoScaleViT(nn.Module):
    """vit-pytorch's ``CrossViT``: one image read by two patch embedders (``Rearrange, LayerNorm, Linear,
    LayerNorm``) of two patch sizes, each starting a stream of its own."""

    def __init__(self, d_small: int = 16, d_large: int = 24, classes: int = 10) -> None:
        super().__init__()
        self.small = nn.Sequential(Patches(4), nn.LayerNorm(48), nn.Linear(48, d_small), nn.LayerNorm(d_small))
        self.large = nn.Sequential(Patches(8), nn.LayerNorm(192), nn.Linear(192, d_large), nn.LayerNorm(d_large))
        self.small_block, self.large_block = Block(d_small, 2), Block(d_large, 2)
        self.small_norm, self.large_norm = nn.LayerNorm(d_small), nn.LayerNorm(d_large)
        self.head = nn.Linear(d_small + d_large, classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        a = self.small_norm(self.small_block(self.small(img))).mean(dim=1)
        b = self.large_norm(self.large_block(self.large(img))).mean(dim=1)
        return self.head(torch.cat([a, b], dim=-1))


# ------------------------------------------------------------------------------ norms normswap keeps
class ChanLayerNorm(nn.Module):
    """vit-pytorch's channels-first LayerNorm (CvT, Twins-SVT, NesT, CrossFormer, ScalableViT, RegionViT):
    ``(1, C, 1, 1)`` parameters, mean and variance over dim 1 written in ops."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.g = nn.Parameter(torch.ones(1, dim, 1, 1))
        self.b = nn.Parameter(torch.zeros(1, dim, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = torch.var(x, dim=1, unbiased=False, keepdim=True)
        mean = torch.mean(x, dim=1, keepdim=True)
        return (x - mean) / (var + self.eps).sqrt() * self.g + self.b


class AnnotatedLayerNorm(nn.Module):
    """The Annotated Transformer's LayerNorm, copied into many custom models: unbiased std, eps added
    outside the square root. No LayerNorm or RMSNorm formula matches it."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.a_2, self.b_2, self.eps = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a_2 * (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + self.eps) + self.b_2


class KeptNormsNet(nn.Module):
    """A conv stage with channels-first norms, then tokens through an Annotated-Transformer norm."""

    def __init__(self, c: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.stem, self.norm1 = nn.Conv2d(3, c, 3, padding=1), ChanLayerNorm(c)
        self.mix, self.norm2 = nn.Conv2d(c, c, 1), ChanLayerNorm(c)
        self.token_norm, self.head = AnnotatedLayerNorm(c), nn.Linear(c, classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.norm1(self.stem(img))
        x = self.norm2(x + self.mix(F.gelu(x)))
        return self.head(self.token_norm(x.flatten(2).transpose(1, 2)).mean(dim=1))


class DepthwiseBlockNet(nn.Module):
    """ConvNeXt's block in tokens: a depthwise conv over the stream, then a norm, then an MLP added back.
    Each block norm reads a depthwise conv alone (no weight edit centers it): a centering op there would
    be one per block, LayerNorm by another name, so those norms stay approximate."""

    def __init__(self, d: int = 16, blocks: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Linear(6, d)
        self.dw = nn.ModuleList(nn.Conv1d(d, d, 3, padding=1, groups=d) for _ in range(blocks))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(blocks))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                  for _ in range(blocks))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for dw, norm, mlp in zip(self.dw, self.norms, self.mlps, strict=True):
            x = x + mlp(norm(dw(x.transpose(1, 2)).transpose(1, 2)))
        return self.head(self.norm(x).mean(dim=1))


def build_randomised(make, seed: int = 0) -> nn.Module:  # noqa: ANN001
    """``make()`` under seed ``seed`` with every 1-D parameter (LayerNorm γ/β, biases, LayerScale) moved far
    from its init, in float64 and eval mode: the replica tests' models."""
    torch.manual_seed(seed)
    model = make()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model.double().eval()
