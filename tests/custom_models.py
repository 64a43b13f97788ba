"""Hand-written transformer blocks, the kind third-party code contains, for custom-model tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Fused qkv projection; optional per-head LayerNorm on q and k (qk-norm)."""

    def __init__(self, d: int, heads: int, qk_norm: bool = False) -> None:
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.q_norm = nn.LayerNorm(self.hd) if qk_norm else None
        self.k_norm = nn.LayerNorm(self.hd) if qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, self.hd).unbind(2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class ParallelBlock(nn.Module):
    """GPT-J style: one norm feeds attention and MLP, both added to the residual."""

    def __init__(self, d: int, heads: int, qk_norm: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn, self.mlp = Attention(d, heads, qk_norm), MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h) + self.mlp(h)


class TinyGPT(nn.Module):
    """Token + learned position Parameter, parallel blocks, final norm, tied head."""

    def __init__(self, vocab: int = 50, d: int = 32, heads: int = 4, layers: int = 2, qk_norm: bool = True) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, 16, d) * 0.1)
        self.blocks = nn.ModuleList(ParallelBlock(d, heads, qk_norm) for _ in range(layers))
        self.norm_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[:, : ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm_f(x))


class PreBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.mlp = Attention(d, heads), MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class TinyViT(nn.Module):
    """Conv patch embedding, cls token, learned position Parameter, Pre-LN blocks, CLS head."""

    def __init__(self, d: int = 32, heads: int = 4, layers: int = 2, classes: int = 7) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, d, kernel_size=8, stride=8)
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, 17, d) * 0.1)
        self.blocks = nn.Sequential(*[PreBlock(d, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(d, eps=1e-6)
        self.head = nn.Linear(d, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        x = self.blocks(x)
        return self.head(self.norm(x)[:, 0])


class WrappedNorm(nn.Module):
    """A norm written as a wrapper: inner non-affine LayerNorm plus its own scale and shift."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.inner = nn.LayerNorm(d, elementwise_affine=False, eps=1e-5)
        self.scale = nn.Parameter(torch.ones(d))
        self.shift = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale + self.shift


class OffsetNorm(nn.Module):
    """Nemotron-style LayerNorm1P: the stored weight is γ − 1."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.eps = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight + 1, self.bias, self.eps)


class MixedNormNet(nn.Module):
    """Pre-LN stack whose norms come in the wrapper, 1+γ, non-affine and multi-dim flavours."""

    def __init__(self, d: int = 24) -> None:
        super().__init__()
        self.inp = nn.Linear(10, d)
        self.n_wrapped, self.n_offset = WrappedNorm(d), OffsetNorm(d)
        self.n_plain = nn.LayerNorm(d, elementwise_affine=False)
        self.f1, self.f2, self.f3 = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.n_2d = nn.LayerNorm([4, d // 4])
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.f1(torch.tanh(self.n_wrapped(h)))
        h = h + self.f2(torch.tanh(self.n_offset(h)))
        h = h + self.f3(torch.tanh(self.n_plain(h)))
        return self.out(self.n_2d(h.unflatten(-1, (4, -1))).flatten(-2))


class PostLNEncoder(nn.Module):
    """BERT-style Post-LN: the residual stream is each norm's output."""

    def __init__(self, vocab: int = 40, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.emb_norm = nn.LayerNorm(d)
        self.attn = nn.ModuleList(Attention(d, heads) for _ in range(layers))
        self.mlp = nn.ModuleList(MLP(d) for _ in range(layers))
        self.n1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.n2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb_norm(self.tok(ids))
        for attn, mlp, n1, n2 in zip(self.attn, self.mlp, self.n1, self.n2, strict=True):
            x = n1(x + attn(x))
            x = n2(x + mlp(x))
        return self.head(x)


def randomise_layer_norms(model: nn.Module, beta_std: float = 0.1) -> None:
    """Every ``nn.LayerNorm``'s γ in U(0.5, 1.5) and β in N(0, ``beta_std``), from torch's global generator
    (in place)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, beta_std)


def tiny_gpt2_config():  # noqa: ANN201 - transformers is imported lazily: most users of this module never need it
    """The 2-layer, width-32 GPT-2 config the save/load and inference-mode tests build."""
    import transformers

    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=99, n_positions=64)


def randomise(model: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model.double().eval()


class Residual(nn.Module):
    """``x + f(x)`` as its own module (x-transformers style): the sum is a module output read only by a norm."""

    def forward(self, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        return x + branch


class PostNormDecoder(nn.Module):
    """Post-norm decoder written like x-transformers' ``Decoder(pre_norm=False)``: norm(residual(x, f(x))).

    The residual add is a module boundary whose output only the norm reads, so a centering op could
    sit there before every norm: LayerNorm by another name, which the verdict policy must not call exact.
    """

    def __init__(self, vocab: int = 40, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(16, d)
        self.attn = nn.ModuleList(Attention(d, heads) for _ in range(layers))
        self.mlp = nn.ModuleList(MLP(d) for _ in range(layers))
        self.res = nn.ModuleList(Residual() for _ in range(2 * layers))
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(2 * layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlp, strict=True)):
            x = self.norms[2 * i](self.res[2 * i](x, attn(x)))
            x = self.norms[2 * i + 1](self.res[2 * i + 1](x, mlp(x)))
        return self.head(x)


class ProjAttention(nn.Module):
    """Attention with separate q/k/v projections whose bias slots are chosen one by one, in the variants
    that decide whether a norm's β may leave it through a bias-less key or value projection: eager
    (matmul, masked scores, softmax) or SDPA, grouped-query heads, rotary keys, a k-norm, a sink
    logit (gpt-oss style: one extra logit per head that takes probability but no value), tanh
    soft-capping of the scores, and a key/value cache."""

    def __init__(self, d: int, heads: int, *, q_bias: bool = True, k_bias: bool = True, v_bias: bool = True,
                 o_bias: bool = True, kv_heads: int | None = None, eager: bool = False, rope: bool = False,
                 k_norm: bool = False, sink: bool = False, softcap: float | None = None) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads or heads, d // heads
        self.q = nn.Linear(d, d, bias=q_bias)
        self.k = nn.Linear(d, self.kv_heads * self.hd, bias=k_bias)
        self.v = nn.Linear(d, self.kv_heads * self.hd, bias=v_bias)
        self.o = nn.Linear(d, d, bias=o_bias)
        self.k_norm = nn.LayerNorm(self.hd) if k_norm else None
        self.sink = nn.Parameter(torch.randn(heads)) if sink else None
        self.eager, self.rope, self.softcap = eager or sink or softcap is not None, rope, softcap

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[-2]
        freq = 1.0 / (100.0 ** (torch.arange(0, self.hd, 2, dtype=x.dtype) / self.hd))
        angle = torch.arange(t, dtype=x.dtype)[:, None] * freq[None]
        cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
        half = torch.cat([-x[..., self.hd // 2:], x[..., : self.hd // 2]], -1)
        return x * cos + half * sin

    def forward(self, x: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.rope:
            q, k = self._rotate(q), self._rotate(k)
        if cache is not None:  # DynamicCache-style append (the cache starts empty)
            k = cache["k"] = torch.cat([cache.get("k", k[:, :, :0]), k], dim=-2)
            v = cache["v"] = torch.cat([cache.get("v", v[:, :, :0]), v], dim=-2)
        if self.kv_heads != self.heads:  # HF repeat_kv: expand, then fold the copies into the head axis
            rep = self.heads // self.kv_heads
            k = k[:, :, None].expand(b, self.kv_heads, rep, t, self.hd).reshape(b, self.heads, t, self.hd)
            v = v[:, :, None].expand(b, self.kv_heads, rep, t, self.hd).reshape(b, self.heads, t, self.hd)
        if self.eager:
            scores = torch.matmul(q, k.transpose(-1, -2)) * self.hd ** -0.5
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
            if self.softcap is not None:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            if self.sink is not None:
                sink = self.sink.view(1, -1, 1, 1).expand(b, -1, t, 1)
                probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
            else:
                probs = torch.softmax(scores, dim=-1)
            y = torch.matmul(probs, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class ProjBlock(nn.Module):
    def __init__(self, d: int, heads: int, **attn: object) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.mlp = ProjAttention(d, heads, **attn), MLP(d)

    def forward(self, x: torch.Tensor, cache: dict | None = None) -> torch.Tensor:
        x = x + self.attn(self.n1(x), cache)
        return x + self.mlp(self.n2(x))


class ProjLM(nn.Module):
    """Pre-LN decoder built from :class:`ProjAttention` blocks; ``use_cache`` fills a fresh key/value cache."""

    def __init__(self, vocab: int = 40, d: int = 32, heads: int = 4, layers: int = 2, use_cache: bool = False,
                 **attn: object) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(ProjBlock(d, heads, **attn) for _ in range(layers))
        self.norm_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.use_cache = use_cache

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x, {} if self.use_cache else None)
        return self.head(self.norm_f(x))
