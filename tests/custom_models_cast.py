"""Custom models written the way speech, CLIP and ViT code writes them: modules that cast inside
(a LayerNorm computing in float32, a Linear casting its weight to the input's dtype), attention that
returns its weights ``type_as`` its output, a norm's output changed in place.

In the style of OpenAI Whisper's ``model.py``, open_clip's ``transformer.py``, fairseq's
``MultiheadAttention`` and vit-pytorch's ``ViT``; written here (those packages cannot be imported in
the test environment), small enough for the default suite.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


# ---------------------------------------------------------------------------------- Whisper style
class WLayerNorm(nn.LayerNorm):
    """Whisper's LayerNorm: computes in float32 whatever the input, returns the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).type(x.dtype)


class WLinear(nn.Linear):
    """Whisper's Linear: the weight is cast to the input's dtype (float32 weights, fp16 activations)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class WConv1d(nn.Conv1d):
    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return super()._conv_forward(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-increment * torch.arange(channels // 2))
    t = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1)


class WAttention(nn.Module):
    use_sdpa = True

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = WLinear(d, d)
        self.key = WLinear(d, d, bias=False)
        self.value = WLinear(d, d)
        self.out = WLinear(d, d)

    def forward(self, x: torch.Tensor, xa: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                kv_cache: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        q = self.query(x)
        if kv_cache is None or xa is None or self.key not in kv_cache:
            # the cache hooks on key/value (WhisperStyle.install_kv_cache_hooks) prepend what they cached
            k = self.key(x if xa is None else xa)
            v = self.value(x if xa is None else xa)
        else:  # cross-attention: keys and values of the audio computed once, then reused
            k, v = kv_cache[self.key], kv_cache[self.value]
        wv, qk = self.qkv_attention(q, k, v, mask)
        return self.out(wv), qk

    def qkv_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        n_ctx, d = q.shape[1], q.shape[2]
        scale = (d // self.heads) ** -0.25
        q, k, v = (z.view(*z.shape[:2], self.heads, -1).permute(0, 2, 1, 3) for z in (q, k, v))
        if self.use_sdpa:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=mask is not None and n_ctx > 1)
            return a.permute(0, 2, 1, 3).flatten(start_dim=2), None
        qk = (q * scale) @ (k * scale).transpose(-1, -2)
        if mask is not None:
            qk = qk + mask[:n_ctx, :n_ctx]
        qk = qk.float()
        w = F.softmax(qk, dim=-1).to(q.dtype)
        return (w @ v).permute(0, 2, 1, 3).flatten(start_dim=2), qk.detach()


class WBlock(nn.Module):
    def __init__(self, d: int, heads: int, cross: bool = False) -> None:
        super().__init__()
        self.attn, self.attn_ln = WAttention(d, heads), WLayerNorm(d)
        self.cross_attn = WAttention(d, heads) if cross else None
        self.cross_attn_ln = WLayerNorm(d) if cross else None
        self.mlp = nn.Sequential(WLinear(d, 4 * d), nn.GELU(), WLinear(4 * d, d))
        self.mlp_ln = WLayerNorm(d)

    def forward(self, x: torch.Tensor, xa: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                kv_cache: dict | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_ln(x), mask=mask, kv_cache=kv_cache)[0]
        if self.cross_attn is not None:
            x = x + self.cross_attn(self.cross_attn_ln(x), xa, kv_cache=kv_cache)[0]
        return x + self.mlp(self.mlp_ln(x))


class WAudioEncoder(nn.Module):
    def __init__(self, n_mels: int, n_ctx: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.conv1 = WConv1d(n_mels, d, kernel_size=3, padding=1)
        self.conv2 = WConv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positional_embedding", sinusoids(n_ctx, d))
        self.blocks = nn.ModuleList(WBlock(d, heads) for _ in range(layers))
        self.ln_post = WLayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv1(x))
        x = F.gelu(self.conv2(x))
        x = x.permute(0, 2, 1)
        assert x.shape[1:] == self.positional_embedding.shape, "incorrect audio shape"
        x = (x + self.positional_embedding).to(x.dtype)
        for block in self.blocks:
            x = block(x)
        return self.ln_post(x)


class WTextDecoder(nn.Module):
    def __init__(self, vocab: int, n_ctx: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, d)
        self.positional_embedding = nn.Parameter(torch.randn(n_ctx, d) * 0.1)
        self.blocks = nn.ModuleList(WBlock(d, heads, cross=True) for _ in range(layers))
        self.ln = WLayerNorm(d)
        self.register_buffer("mask", torch.empty(n_ctx, n_ctx).fill_(-math.inf).triu_(1), persistent=False)

    def forward(self, tokens: torch.Tensor, xa: torch.Tensor, kv_cache: dict | None = None) -> torch.Tensor:
        offset = next(iter(kv_cache.values())).shape[1] if kv_cache else 0
        x = self.token_embedding(tokens) + self.positional_embedding[offset: offset + tokens.shape[-1]]
        x = x.to(xa.dtype)
        for block in self.blocks:
            x = block(x, xa, mask=self.mask, kv_cache=kv_cache)
        x = self.ln(x)
        return (x @ torch.transpose(self.token_embedding.weight.to(x.dtype), 0, 1)).float()


class WhisperStyle(nn.Module):
    """Encoder (conv + GELU stem, sinusoid buffer) and decoder (tied logits read off the embedding), a
    sparse boolean buffer, and Whisper's kv-cache: forward hooks on every key/value Linear of the decoder
    that keep and prepend what those modules computed (``install_kv_cache_hooks``, :func:`greedy_decode`)."""

    def __init__(self, n_mels: int = 8, audio_ctx: int = 6, vocab: int = 40, text_ctx: int = 12, d: int = 32,
                 heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.encoder = WAudioEncoder(n_mels, audio_ctx, d, heads, layers)
        self.decoder = WTextDecoder(vocab, text_ctx, d, heads, layers)
        heads_used = torch.zeros(layers, heads, dtype=torch.bool)  # the cross-attention heads used for alignment,
        heads_used[layers // 2:] = True  # kept sparse as Whisper keeps them
        self.register_buffer("alignment_heads", heads_used.to_sparse(), persistent=False)

    def forward(self, mel: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(tokens, self.encoder(mel))

    def install_kv_cache_hooks(self) -> tuple[dict, list]:
        """Whisper's own: the cache is keyed by the key/value modules themselves, filled by their hooks."""
        cache: dict = {}
        text_ctx = self.decoder.positional_embedding.shape[0]

        def save_to_cache(module: nn.Module, _: tuple, output: torch.Tensor) -> torch.Tensor:
            if module not in cache or output.shape[1] > text_ctx:  # the first tokens, or the audio
                cache[module] = output
            else:
                cache[module] = torch.cat([cache[module], output], dim=1).detach()
            return cache[module]

        hooks = [m.register_forward_hook(save_to_cache) for layer in self.decoder.modules()
                 if isinstance(layer, WAttention) for m in (layer.key, layer.value)]
        return cache, hooks


def greedy_decode(model: WhisperStyle, mel: torch.Tensor, prefix: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding as ``whisper.decode`` runs it: the audio encoded once, the prefix through the decoder,
    then one new token per step through the kv-cache hooks. Returns the prefix and the ``steps`` tokens."""
    cache, hooks = model.install_kv_cache_hooks()
    try:
        with torch.no_grad():
            audio, tokens, new = model.encoder(mel), prefix, prefix
            for _ in range(steps):
                new = model.decoder(new, audio, kv_cache=cache)[:, -1].argmax(-1, keepdim=True)
                tokens = torch.cat([tokens, new], dim=1)
    finally:
        for h in hooks:
            h.remove()
    return tokens


class WhisperEncoderOnly(nn.Module):
    """The audio encoder with a classifier on its mean-pooled output (all its norms read Pre-LN streams)."""

    def __init__(self, n_mels: int = 8, audio_ctx: int = 6, d: int = 32, heads: int = 4, layers: int = 2,
                 classes: int = 5) -> None:
        super().__init__()
        self.encoder = WAudioEncoder(n_mels, audio_ctx, d, heads, layers)
        self.head = WLinear(d, classes)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(mel).mean(1)).float()


# ---------------------------------------------------------------------------------- open_clip style
class LayerNormFp32(nn.LayerNorm):
    """open_clip's LayerNormFp32: normalises in float32, returns the input's dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        orig = x.dtype
        x = F.layer_norm(x.to(torch.float32), self.normalized_shape, self.weight, self.bias, self.eps)
        return x.to(orig)


class ClipAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, d))


class ClipBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = LayerNormFp32(d), LayerNormFp32(d)
        self.attn = ClipAttention(d, heads)
        self.ls_1, self.ls_2 = nn.Identity(), nn.Identity()
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.ls_1(self.attn(self.ln_1(x), attn_mask=attn_mask))
        return x + self.ls_2(self.mlp(self.ln_2(x)))


class ClipTextStyle(nn.Module):
    """open_clip's text tower: token + position Parameter cast to the blocks' dtype, causal blocks,
    ``ln_final``, the end-of-text token's features times ``text_projection``."""

    def __init__(self, vocab: int = 40, ctx: int = 12, d: int = 32, heads: int = 4, layers: int = 2,
                 embed: int = 16) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, d)
        self.positional_embedding = nn.Parameter(torch.randn(ctx, d) * 0.1)
        self.resblocks = nn.ModuleList(ClipBlock(d, heads) for _ in range(layers))
        self.ln_final = LayerNormFp32(d)
        self.text_projection = nn.Parameter(torch.randn(d, embed) * d ** -0.5)
        self.register_buffer("attn_mask", torch.empty(ctx, ctx).fill_(-math.inf).triu_(1), persistent=False)

    def cast_dtype(self) -> torch.dtype:
        return self.resblocks[0].mlp[0].weight.dtype

    def forward(self, text: torch.Tensor) -> torch.Tensor:
        cast = self.cast_dtype()
        t = text.shape[1]
        x = self.token_embedding(text).to(cast)
        x = x + self.positional_embedding[:t].to(cast)
        for block in self.resblocks:
            x = block(x, attn_mask=self.attn_mask[:t, :t].to(cast))
        x = self.ln_final(x)
        x = x[torch.arange(x.shape[0]), text.argmax(dim=-1)] @ self.text_projection
        return F.normalize(x, dim=-1)


# ---------------------------------------------------------------------------------- fairseq style
class Fp32LayerNorm(nn.LayerNorm):
    """fairseq's Fp32LayerNorm: input and parameters in float32, output ``type_as`` the input."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), self.bias.float(), self.eps)
        return out.type_as(x)


class FairseqAttention(nn.Module):
    """Time-first (T, B, C) attention; softmax in float32 brought back ``type_as``; returns the attention
    weights ``type_as`` the output projection's result, which callers may ignore."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.scaling = self.hd ** -0.5
        self.k_proj, self.v_proj, self.q_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tgt, bsz, d = query.shape
        q = self.q_proj(query) * self.scaling
        k, v = self.k_proj(query), self.v_proj(query)
        q = q.contiguous().view(tgt, bsz * self.heads, self.hd).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.heads, self.hd).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.heads, self.hd).transpose(0, 1)
        attn_weights = torch.bmm(q, k.transpose(1, 2))
        attn_weights_float = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
        attn_probs = attn_weights_float.type_as(attn_weights)
        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt, bsz, d)
        attn = self.out_proj(attn)
        weights = attn_weights_float.view(bsz, self.heads, tgt, -1).mean(dim=1)
        return attn, weights.type_as(attn)


class FairseqLayer(nn.Module):
    """``normalize_before=True`` encoder layer."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.self_attn = FairseqAttention(d, heads)
        self.self_attn_layer_norm = Fp32LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.final_layer_norm = Fp32LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = x
        x, _ = self.self_attn(self.self_attn_layer_norm(x))
        x = residual + x
        residual = x
        x = self.fc2(F.relu(self.fc1(self.final_layer_norm(x))))
        return residual + x


class FairseqStyleEncoder(nn.Module):
    """Scaled token embedding plus a learned position table, Pre-LN layers, final norm, output Linear."""

    def __init__(self, vocab: int = 40, ctx: int = 16, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.embed_positions = nn.Embedding(ctx, d)
        self.embed_scale = math.sqrt(d)
        self.layers = nn.ModuleList(FairseqLayer(d, heads) for _ in range(layers))
        self.layer_norm = Fp32LayerNorm(d)
        self.output = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        x = self.embed_scale * self.embed_tokens(tokens) + self.embed_positions(pos)
        x = x.transpose(0, 1)  # B x T x C -> T x B x C
        for layer in self.layers:
            x = layer(x)
        return self.output(self.layer_norm(x).transpose(0, 1))


# ---------------------------------------------------------------------------------- vit-pytorch style
class Patches(nn.Module):
    """einops ``Rearrange('b c (h p1) (w p2) -> b (h w) (p1 p2 c)')`` written with torch ops."""

    def __init__(self, p: int) -> None:
        super().__init__()
        self.p = p

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        b, c, hh, ww = img.shape
        p = self.p
        x = img.reshape(b, c, hh // p, p, ww // p, p).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(b, (hh // p) * (ww // p), p * p * c)


class VitFeedForward(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, hidden), nn.GELU(), nn.Dropout(0.0),
                                 nn.Linear(hidden, d), nn.Dropout(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class VitAttention(nn.Module):
    def __init__(self, d: int, heads: int, dim_head: int) -> None:
        super().__init__()
        inner = heads * dim_head
        self.heads, self.scale = heads, dim_head ** -0.5
        self.norm = nn.LayerNorm(d)
        self.attend = nn.Softmax(dim=-1)
        self.to_qkv = nn.Linear(d, inner * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, d), nn.Dropout(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.heads, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        attn = self.attend(torch.matmul(q, k.transpose(-1, -2)) * self.scale)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class VitTransformer(nn.Module):
    def __init__(self, d: int, depth: int, heads: int, dim_head: int, mlp_dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.layers = nn.ModuleList(nn.ModuleList([VitAttention(d, heads, dim_head), VitFeedForward(d, mlp_dim)])
                                    for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for attn, ff in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        return self.norm(x)


class VitPytorchStyle(nn.Module):
    """vit-pytorch's ``ViT``: the patch embedding is a Sequential ending in a LayerNorm, and the
    position table is added to its output *in place* (``x += self.pos_embedding``)."""

    def __init__(self, image: int = 16, patch: int = 4, classes: int = 5, d: int = 32, depth: int = 2,
                 heads: int = 4, dim_head: int = 8, mlp_dim: int = 64, channels: int = 3) -> None:
        super().__init__()
        n = (image // patch) ** 2
        patch_dim = channels * patch * patch
        self.to_patch_embedding = nn.Sequential(Patches(patch), nn.LayerNorm(patch_dim), nn.Linear(patch_dim, d),
                                                nn.LayerNorm(d))
        self.pos_embedding = nn.Parameter(torch.randn(1, n + 1, d))
        self.cls_token = nn.Parameter(torch.randn(1, 1, d))
        self.dropout = nn.Dropout(0.0)
        self.transformer = VitTransformer(d, depth, heads, dim_head, mlp_dim)
        self.to_latent = nn.Identity()
        self.mlp_head = nn.Linear(d, classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.to_patch_embedding(img)
        b, n, _ = x.shape
        cls = self.cls_token.expand(b, -1, -1)
        x = torch.cat((cls, x), dim=1)
        x += self.pos_embedding[:, : n + 1]
        x = self.dropout(x)
        x = self.transformer(x)
        return self.mlp_head(self.to_latent(x[:, 0]))


def posemb_sincos_2d(h: int, w: int, dim: int, temperature: float = 10000.0) -> torch.Tensor:
    y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    omega = 1.0 / (temperature ** (torch.arange(dim // 4) / (dim // 4 - 1)))
    y, x = y.flatten()[:, None] * omega[None, :], x.flatten()[:, None] * omega[None, :]
    return torch.cat((x.sin(), x.cos(), y.sin(), y.cos()), dim=1).float()


class SimpleVitStyle(nn.Module):
    """vit-pytorch's ``SimpleViT``: the patch embedding's LayerNorm output is itself changed in place
    (``x += pos``) by a sin-cos table held as a plain tensor attribute and cast ``.to(device, dtype=...)``;
    blocks without biases in attention; mean pooling."""

    def __init__(self, image: int = 16, patch: int = 4, classes: int = 5, d: int = 32, depth: int = 2,
                 heads: int = 4, dim_head: int = 8, mlp_dim: int = 64, channels: int = 3) -> None:
        super().__init__()
        patch_dim = channels * patch * patch
        self.to_patch_embedding = nn.Sequential(Patches(patch), nn.LayerNorm(patch_dim), nn.Linear(patch_dim, d),
                                                nn.LayerNorm(d))
        self.pos_embedding = posemb_sincos_2d(image // patch, image // patch, d)
        self.transformer = VitTransformer(d, depth, heads, dim_head, mlp_dim)
        for layer in self.transformer.layers:
            out = layer[0].to_out[0]
            layer[0].to_out[0] = nn.Linear(out.in_features, out.out_features, bias=False)
        self.linear_head = nn.Linear(d, classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.to_patch_embedding(img)
        x += self.pos_embedding.to(img.device, dtype=x.dtype)
        return self.linear_head(self.transformer(x).mean(dim=1))


# ---------------------------------------------------------------------------------- state kept between calls
class CachedRotary(nn.Module):
    """ESM-style rotary embedding: cos/sin tables built on first use and cached, keyed on the length only
    (so a table built in one dtype is reused in another)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim)))
        self._seq_len_cached: int | None = None
        self._cos_cached: torch.Tensor | None = None
        self._sin_cached: torch.Tensor | None = None

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = q.shape[-2]
        if n != self._seq_len_cached:
            self._seq_len_cached = n
            t = torch.arange(n, device=q.device).type_as(self.inv_freq)
            emb = torch.cat([torch.outer(t, self.inv_freq)] * 2, dim=-1)
            self._cos_cached, self._sin_cached = emb.cos()[None, None], emb.sin()[None, None]
        cos, sin = self._cos_cached, self._sin_cached
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin


class RotaryAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)
        self.rot = CachedRotary(d // heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rot(q, k)
        w = torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5, dim=-1)
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, t, d))


class PostLNRotaryEncoder(nn.Module):
    """Post-LN encoder whose attention caches its rotary tables (the approximate norms get calibrated)."""

    def __init__(self, vocab: int = 40, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.attn = nn.ModuleList(RotaryAttention(d, heads) for _ in range(layers))
        self.fc1 = nn.ModuleList(nn.Linear(d, 2 * d) for _ in range(layers))
        self.fc2 = nn.ModuleList(nn.Linear(2 * d, d) for _ in range(layers))
        self.n1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.n2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for attn, fc1, fc2, n1, n2 in zip(self.attn, self.fc1, self.fc2, self.n1, self.n2, strict=True):
            x = n1(x + attn(x))
            x = n2(x + fc2(F.gelu(fc1(x))))
        return self.head(x)


class Float32Kernel(nn.Module):
    """A layer whose kernel exists for float32 only (a compiled extension, say): it refuses other dtypes."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"kernel built for float32 inputs only, got {x.dtype}")
        return self.proj(x)


class Float32OnlyNet(nn.Module):
    """Pre-LN blocks around a float32-only layer: the model runs in float32 and in no other dtype."""

    def __init__(self, d: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(12, d)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.mixers = nn.ModuleList(Float32Kernel(d) for _ in range(layers))
        self.norm_f = nn.LayerNorm(d)
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for norm, mixer in zip(self.norms, self.mixers, strict=True):
            h = h + mixer(torch.tanh(norm(h)))
        return self.out(self.norm_f(h))
