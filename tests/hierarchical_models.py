"""Hierarchical vision models written the way third-party code writes them (issue 31, part 3).

No timm / vit-pytorch import (they import torchvision, which cannot be imported here): these follow
their code's shapes and op sequences instead.

- :class:`SwinStyle`: a conv patch embedding with a LayerNorm on its channels-last output
  (``patch_embed.norm``, whose output starts the stream), Pre-LN stages on ``(B, H, W, C)``, and
  between stages a Swin patch merging, either space-to-depth
  (``reshape(B, H/2, 2, W/2, 2, C).permute(0, 1, 3, 4, 2, 5).flatten(3)``, timm) or the
  ``torch.cat`` of four strided slices (the original Swin code, Hugging Face), then
  ``norm`` (LayerNorm(4C)) and ``reduction`` (Linear 4C -> 2C).
- :class:`ConvStemNet`: a ConvNeXt-style stem (conv, then a channels-last LayerNorm), Pre-LN blocks
  on channels-last feature maps, a ConvNeXt-style downsampling (LayerNorm, then a 2x2 stride-2 conv on
  NCHW), a spatial mean and a head norm.
- :class:`PatchNormViT`: vit-pytorch's patch embedding ``Sequential(Rearrange, LayerNorm(patch_dim),
  Linear, LayerNorm(dim))``, a cls token and a position table, then Pre-LN blocks.
- :class:`PyramidStyle`: PVT-style stages, each starting with its own conv patch embedding and norm,
  each ending with a stage norm whose output the next stage's conv reads.
- :class:`ChannelShiftNet`: Pre-LN blocks whose attention output moves half of its channels one token
  along (a temporal-shift-style mix) before the residual add: every norm row then holds features of
  two tokens, each once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops.layers.torch import Rearrange
from torch import nn

from tests.custom_models import PreBlock


class PatchMerging(nn.Module):
    """Swin's 2x2 patch merging on ``(B, H, W, C)``: 4 neighbouring tokens -> one row of 4C, norm, reduction.

    ``variant``: ``"reshape"`` (space-to-depth, timm), ``"cat"`` (four strided slices, original Swin /
    HF), ``"split"`` (each new token made of halves of two tokens, then merged), or ``"repeat"`` (not a
    merge: one token's features four times over, every other token dropped). Only ``"repeat"`` leaves one
    token per row of ``norm``.
    ``pool``: a 3x3 average pooling over the map first (a channel-shared token mix).
    """

    def __init__(self, d: int, variant: str = "reshape", pool: bool = False) -> None:
        super().__init__()
        self.variant, self.pool = variant, pool
        self.norm = nn.LayerNorm(4 * d)
        self.reduction = nn.Linear(4 * d, 2 * d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        if self.pool:
            x = F.avg_pool2d(x.permute(0, 3, 1, 2), 3, 1, 1).permute(0, 2, 3, 1)
        if self.variant == "reshape":
            x = x.reshape(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 4, 2, 5).flatten(3)
        elif self.variant == "cat":
            x0, x1 = x[:, 0::2, 0::2, :], x[:, 1::2, 0::2, :]
            x2, x3 = x[:, 0::2, 1::2, :], x[:, 1::2, 1::2, :]
            x = torch.cat([x0, x1, x2, x3], -1)
        elif self.variant == "split":  # each new token: one token's first half, its left neighbour's second
            x = torch.cat([x[..., : c // 2], x[..., c // 2:].roll(1, dims=2)], -1)
            x = x.reshape(b, h // 2, 2, w // 2, 2, c).permute(0, 1, 3, 4, 2, 5).flatten(3)
        else:  # "repeat"
            x = torch.cat([x, x, x, x], -1)[:, ::2, ::2]
        return self.reduction(self.norm(x))


class SwinStage(nn.Module):
    """An optional patch merging (timm: at the start of every stage but the first), then Pre-LN blocks
    with global attention over the stage's tokens (window attention is not what is under test)."""

    def __init__(self, d: int, depth: int, heads: int, merge: str | None, pool: bool = False) -> None:
        super().__init__()
        self.downsample = PatchMerging(d // 2, merge, pool) if merge else nn.Identity()
        self.blocks = nn.ModuleList(PreBlock(d, heads) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.downsample(x)
        b, h, w, c = x.shape
        x = x.reshape(b, h * w, c)
        for block in self.blocks:
            x = block(x)
        return x.reshape(b, h, w, c)


class PatchEmbed(nn.Module):
    """timm's PatchEmbed with ``output_fmt="NHWC"`` and a norm layer: conv, to channels-last, LayerNorm."""

    def __init__(self, d: int, patch: int = 4) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, d, patch, patch)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x).permute(0, 2, 3, 1))


class SwinStyle(nn.Module):
    """Two stages (C, then 2C after one patch merging), a final norm, average pooling, a head."""

    def __init__(self, d: int = 16, heads: int = 2, depth: int = 1, classes: int = 5, merge: str = "reshape",
                 pool: bool = False) -> None:
        super().__init__()
        self.patch_embed = PatchEmbed(d)
        self.layers = nn.Sequential(SwinStage(d, depth, heads, None),
                                    SwinStage(2 * d, depth, 2 * heads, merge, pool))
        self.norm = nn.LayerNorm(2 * d)
        self.head = nn.Linear(2 * d, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.patch_embed(images))
        return self.head(self.norm(x).mean(dim=(1, 2)))


class ChannelsLastBlock(nn.Module):
    """A Pre-LN block on ``(B, H, W, C)``: attention over the flattened tokens, then a pointwise MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.inner = PreBlock(d, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        return self.inner(x.flatten(1, 2)).view(b, h, w, c)


class ConvStemNet(nn.Module):
    """ConvNeXt-style stem and downsampling around Pre-LN blocks on channels-last maps."""

    def __init__(self, d: int = 16, heads: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, d, 4, 4)
        self.stem_norm = nn.LayerNorm(d, eps=1e-6)
        self.stage0 = ChannelsLastBlock(d, heads)
        self.down_norm = nn.LayerNorm(d, eps=1e-6)
        self.down = nn.Conv2d(d, 2 * d, 2, 2)
        self.stage1 = ChannelsLastBlock(2 * d, heads)
        self.head_norm = nn.LayerNorm(2 * d, eps=1e-6)
        self.head = nn.Linear(2 * d, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem_norm(self.stem(images).permute(0, 2, 3, 1))
        x = self.stage0(x)
        x = self.down(self.down_norm(x).permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        x = self.stage1(x)
        return self.head(self.head_norm(x.mean(dim=(1, 2))))


class PatchNormViT(nn.Module):
    """vit-pytorch's ``ViT``: LayerNorm on raw patches, Linear, LayerNorm; cls token, position table."""

    def __init__(self, image: int = 16, patch: int = 4, d: int = 16, heads: int = 2, depth: int = 2,
                 classes: int = 5) -> None:
        super().__init__()
        patch_dim = 3 * patch * patch
        self.to_patch_embedding = nn.Sequential(
            Rearrange("b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=patch, p2=patch),
            nn.LayerNorm(patch_dim), nn.Linear(patch_dim, d), nn.LayerNorm(d))
        self.pos_embedding = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, d))
        self.cls_token = nn.Parameter(torch.randn(1, 1, d))
        self.blocks = nn.Sequential(*[PreBlock(d, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.mlp_head = nn.Linear(d, classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.to_patch_embedding(img)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embedding[:, : x.shape[1]]
        x = self.norm(self.blocks(x))
        return self.mlp_head(x[:, 0])


class PyramidStage(nn.Module):
    """PVT-style: an overlapping conv patch embedding with its norm, Pre-LN blocks, a stage norm."""

    def __init__(self, d_in: int, d: int, heads: int, stride: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(d_in, d, stride + 1, stride, padding=stride // 2)
        self.embed_norm = nn.LayerNorm(d)
        self.block = PreBlock(d, heads)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        b, _, h, w = x.shape
        x = self.norm(self.block(self.embed_norm(x.flatten(2).transpose(1, 2))))
        return x.reshape(b, h, w, -1).permute(0, 3, 1, 2).contiguous()


class PyramidStyle(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.stages = nn.Sequential(PyramidStage(3, d, heads, 4), PyramidStage(d, 2 * d, heads, 2))
        self.head = nn.Linear(2 * d, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool2d(self.stages(images), 1).flatten(1))


class ShiftBlock(nn.Module):
    """A Pre-LN block whose attention output shifts its first half of channels by one token."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.inner = PreBlock(d, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner.attn(self.inner.n1(x))
        half = y.shape[-1] // 2
        x = x + torch.cat([y[:, :, :half].roll(1, dims=1), y[:, :, half:]], -1)
        return x + self.inner.mlp(self.inner.n2(x))


class ChannelShiftNet(nn.Module):
    def __init__(self, vocab: int = 30, d: int = 16, heads: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(ShiftBlock(d, heads), ShiftBlock(d, heads))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.blocks(self.tok(ids))))
