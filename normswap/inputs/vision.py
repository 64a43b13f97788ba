"""Rules for the vision side of vision-language models whose inputs the common image layouts
(:mod:`normswap.inputs.media`) do not cover: each one read from the config or the forward signature,
never from a per-model table.

- A vision tower run alone that takes its flattened patches as ``hidden_states`` with their ``grid_thw``
  (the Qwen-VL towers of GLM-4V, Qwen2.5-VL, EXAONE 4.5): the grid layout under that name.
- A Q-Former run alone (BLIP-2's ``query_embeds``): query rows of its own width.
- Patch rows kept square, ``(N, C, p, p)`` with their ``grid_thw``, for towers that embed them with a
  2-D convolution (Kimi-K2.5, PaddleOCR-VL).
- Images per sample with a per-tile ``pixel_attention_mask`` (Granite-Docling).
- Images packed into one strip of patches with ``target_sizes`` (MiniCPM-V).
- Patch rows with their ``(x, y)`` places (Gemma 4's ``pixel_position_ids``).
- A second image input at another resolution, ``<name>_pixel_values`` next to a ``<name>_vision_config``
  (DeepSeek-VL hybrid's ``high_res_pixel_values``): the same images at that tower's size.
- Tiled images with aspect-ratio ids (Mllama): ``(B, images, tiles, C, H, W)`` at the config's
  ``max_num_tiles``, the id of the supported aspect ratio that uses every tile, and its tile mask.
- Masks that say which text positions see which image (Idefics' ``image_attention_mask``, Mllama's
  ``cross_attention_mask``): every position sees every image, once the prompt's length is known.
- Channels-last patches, one row per prompt token: merged ``m·p × m·p`` squares with a grid counted in
  prompt tokens next to ``image_grid_thw`` (Inkling 2), or ``t × p × p`` cubes where the tower takes
  patches with no grid (Inkling).
- Crops of patch rows pooled into prompt tokens by index (``image_token_pooling``, Molmo 2): windows of
  the patch grid, and each image's token grid in ``image_grids``.
- Flattened patch rows with no grid at all, one prompt token each (NeoMME).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from typing import Any

import torch

from normswap.inputs.media import Layout, cfg, grid_layout, image_geometry, sub_config

QUERY_ROWS = 8  # query rows of a Q-Former run alone when the config does not fix how many



def patch_side(vcfg: Any, *keys: str, default: int) -> int:
    """A vision config's patch side: an int, or the first of a ``(height, width)`` pair (Hiera's and
    InternVL's ``patch_size`` ``[14, 14]``; every layout built here is square)."""
    value = cfg(vcfg, *keys, default=default)
    return int(value[0]) if isinstance(value, (list, tuple)) and value else int(value)

def built_here(params: Any) -> set[str]:
    """The required forward arguments this module has a rule for, given the forward's parameters."""
    out = set()
    if "hidden_states" in params and "grid_thw" in params and "pixel_values" not in params:
        out.add("hidden_states")
    if "query_embeds" in params:
        out.add("query_embeds")
    if "pixel_position_ids" in params and "pixel_values" in params:
        out.add("pixel_position_ids")
    return out


def tower_layouts(config: Any, params: Any, batch: int, gen: torch.Generator, dtype: torch.dtype
                  ) -> Iterator[Layout]:
    """Inputs of a vision-side module that takes no ``pixel_values`` (see :func:`built_here`)."""
    made = built_here(params)
    if "hidden_states" in made:
        # a Qwen-VL tower alone: the patches it embeds are its "hidden states"
        yield grid_layout(sub_config(config, "vision"), batch, gen, dtype, name="hidden_states", grid="grid_thw")
    if "query_embeds" in made:
        width = int(cfg(config, "hidden_size", default=32))
        rows = int(cfg(config, "num_query_tokens", default=QUERY_ROWS))
        yield {"query_embeds": torch.randn(batch, rows, width, generator=gen).to(dtype)}


def tiled_layouts(config: Any, params: Any, batch: int, gen: torch.Generator, dtype: torch.dtype
                  ) -> Iterator[Layout]:
    """Mllama-style tiled images: one image per sample cut into ``max_num_tiles`` tiles, with the
    (1-based) id of a supported aspect ratio of that many tiles and a mask over the tiles."""
    if "aspect_ratio_ids" not in params:
        return
    vcfg = sub_config(config, "vision")
    tiles = int(cfg(vcfg, "max_num_tiles", default=1))
    ratios = cfg(vcfg, "supported_aspect_ratios", default=[[1, 1]])
    ratio_id = next((i + 1 for i, r in enumerate(ratios) if math.prod(r) == tiles), None)
    if ratio_id is None:  # no ratio uses every tile: the first, with its tiles marked
        ratio_id, used = 1, math.prod(ratios[0])
    else:
        used = tiles
    size, channels, _ = image_geometry(config)
    mask = torch.zeros(batch, 1, tiles, dtype=torch.long)
    mask[..., :used] = 1
    yield {"pixel_values": torch.randn(batch, 1, tiles, channels, size, size, generator=gen).to(dtype),
           "aspect_ratio_ids": torch.full((batch, 1), ratio_id, dtype=torch.long), "aspect_ratio_mask": mask}


def patch_layouts(config: Any, params: Any, batch: int, gen: torch.Generator, dtype: torch.dtype
                  ) -> Iterator[Layout]:
    """Qwen-VL style patches kept square, ``(N, C, p, p)`` rows with their grid, for towers that embed
    them with a 2-D convolution (Kimi-K2.5, PaddleOCR-VL); after the flattened rows of
    :func:`~normswap.inputs.media.grid_layout`, which most such towers take."""
    vcfg = sub_config(config, "vision")
    for grid in ("image_grid_thw", "grid_thw"):
        if grid not in params:
            continue
        layout = grid_layout(vcfg, batch, gen, dtype, grid=grid)
        rows = layout["pixel_values"]
        patch = patch_side(vcfg, "patch_size", "spatial_patch_size", default=14)
        channels = rows.shape[1] // (patch * patch)
        if channels * patch * patch == rows.shape[1]:  # one frame per patch: a square image of it
            yield {**layout, "pixel_values": rows.reshape(rows.shape[0], channels, patch, patch)}


def positioned_patch_layouts(config: Any, params: Any, batch: int, gen: torch.Generator, dtype: torch.dtype
                             ) -> Iterator[Layout]:
    """Patch rows with their ``(x, y)`` places, ``pixel_position_ids`` (Gemma 4's vision tower): a square
    grid of patches whose side is a multiple of the pooling kernel, ``(B, side², C·p·p)``."""
    if "pixel_position_ids" not in params:
        return
    vcfg = sub_config(config, "vision")
    patch = patch_side(vcfg, "patch_size", default=16)
    kernel = int(cfg(vcfg, "pooling_kernel_size", default=1))
    channels = int(cfg(vcfg, "num_channels", default=3))
    side = 2 * kernel
    ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    places = torch.stack([xs.flatten(), ys.flatten()], dim=-1)
    yield {"pixel_values": torch.rand(batch, side * side, channels * patch * patch, generator=gen).to(dtype),
           "pixel_position_ids": places.expand(batch, -1, -1).clone()}


def packed_layouts(config: Any, params: Any, batch: int, gen: torch.Generator, dtype: torch.dtype
                   ) -> Iterator[Layout]:
    """Images packed into one strip of patches with each image's patch grid in ``target_sizes`` (MiniCPM-V,
    MiniCPM-o OCR): ``(1, C, p, n·p)`` for ``n`` patches in all, each image a square grid whose side the
    tower's window kernel (``window_kernel_size``) and its 2× merger divide."""
    if "target_sizes" not in params:
        return
    vcfg = sub_config(config, "vision")
    patch = patch_side(vcfg, "patch_size", default=14)
    channels = int(cfg(vcfg, "num_channels", default=3))
    kernel = cfg(vcfg, "window_kernel_size", default=None)
    side = 2 * math.lcm(*(int(k) for k in kernel)) if isinstance(kernel, (list, tuple)) and kernel else 4
    strip = torch.randn(1, channels, patch, batch * side * side * patch, generator=gen).to(dtype)
    yield {"pixel_values": strip, "target_sizes": torch.tensor([[side, side]] * batch, dtype=torch.int32)}


def channels_last_patch_layouts(config: Any, params: Any, batch: int, gen: torch.Generator, dtype: torch.dtype
                                 ) -> Iterator[Layout]:
    """Patches channels-last, one row per prompt token, for towers that cut no image themselves:

    - next to ``image_grid_thw``, each row an ``m·p × m·p × C`` square of ``m × m`` merged patches and the
      grid counted in those rows, i.e. in prompt tokens (Inkling 2: ``(tokens, m·p, m·p, C)``, its tower
      multiplying the grid by ``spatial_merge_size`` itself);
    - where the forward takes no grid and the vision config has a ``temporal_patch_size``, each row a
      ``t × p × p × C`` cube that the tower folds into one token (Inkling's hierarchical patch MLP).

    Four rows (a 2 × 2 grid) per image, one image per sample. Tried after the flattened and square patch
    layouts, which most grid models take."""
    vcfg = sub_config(config, "vision")
    patch = patch_side(vcfg, "patch_size", "spatial_patch_size", default=14)
    channels = int(cfg(vcfg, "num_channels", "in_channels", "in_chans", default=3))
    side = 2
    rows = batch * side * side
    if "image_grid_thw" in params:
        merge = int(cfg(vcfg, "spatial_merge_size", "merge_size", default=1))
        square = merge * patch
        yield {"pixel_values": torch.randn(rows, square, square, channels, generator=gen).to(dtype),
               "image_grid_thw": torch.tensor([[1, side, side]] * batch)}
        return
    temporal = cfg(vcfg, "temporal_patch_size")
    if "grid_thw" not in params and isinstance(temporal, int) and temporal > 0:
        yield {"pixel_values": torch.randn(rows, temporal, patch, patch, channels, generator=gen).to(dtype)}


GRID_INPUTS = ("image_grid_thw", "grid_thw", "spatial_shapes", "pixel_position_ids", "target_sizes", "image_sizes")
FLAT_PATCH_ROWS = 4  # patch rows per image (one prompt token each) where the forward takes flat patches alone


def flat_patch_layouts(config: Any, params: Any, batch: int, gen: torch.Generator, dtype: torch.dtype
                       ) -> Iterator[Layout]:
    """Flattened patch rows with no grid, ``(B·n, C·p·p)``, for a forward that takes patches its processor cut
    and says nothing of where they lie (NeoMME: rows of ``3 · patch_size²`` placed at the image tokens of the
    prompt): a patch side in the config (the vision config's, else the model's), no grid, size or position
    input in the forward. Tried after every image and patch layout with a grid."""
    if any(name in params for name in GRID_INPUTS):
        return
    vcfg = sub_config(config, "vision")
    patch = cfg(vcfg, "patch_size", "spatial_patch_size", default=None) or cfg(config, "patch_size", default=None)
    patch = int(patch[0]) if isinstance(patch, (list, tuple)) and patch else patch
    if not isinstance(patch, int) or isinstance(patch, bool) or patch < 2:
        return
    channels = int(cfg(vcfg, "num_channels", "in_channels", "in_chans", default=3))
    yield {"pixel_values": torch.randn(batch * FLAT_PATCH_ROWS, channels * patch * patch, generator=gen).to(dtype)}


POOLING_WINDOW = 2  # patches a side pooled into one prompt token, as Molmo 2's image processor pools by default


def pooled_crop_layouts(config: Any, params: Any, batch: int, gen: torch.Generator, dtype: torch.dtype
                        ) -> Iterator[Layout]:
    """Crops of patch rows pooled into prompt tokens by index, for a forward that takes
    ``<kind>_token_pooling`` (Molmo 2): ``pixel_values`` one crop per image of the tower's
    ``num_position_embeddings`` patch rows ``(crops, patches, C·p·p)`` (its position table is added as is,
    so every crop has that many patches); ``image_token_pooling`` the flat patch indices each token pools,
    2 × 2 windows of the crop's patch grid with ``-1`` where a window passes the edge, as the model's image
    processor makes them; ``image_grids`` each image's token grid ``[rows, cols, 0, 0]`` (a low-resolution
    grid and no high-resolution one: the model splits its tokens per image by ``g0·g1 + g2·g3``), and
    ``image_num_crops`` one per image where the forward takes it."""
    pooling = next((n for n in params if n.endswith("_token_pooling") and n.startswith("image")), None)
    if pooling is None:
        return
    vcfg = sub_config(config, "vision")
    patch = patch_side(vcfg, "patch_size", default=14)
    channels = int(cfg(vcfg, "num_channels", default=3))
    positions = cfg(vcfg, "num_position_embeddings")
    sizes = cfg(vcfg, "image_size", default=patch * 4)
    sizes = list(sizes) if isinstance(sizes, (list, tuple)) else [sizes, sizes]
    high, wide = int(sizes[0]) // patch, int(sizes[-1]) // patch
    if isinstance(positions, int) and positions != high * wide:
        high = wide = math.isqrt(positions)
    k = POOLING_WINDOW
    rows, cols = -(-high // k), -(-wide // k)
    grid = torch.arange(high * wide).reshape(high, wide)
    grid = torch.nn.functional.pad(grid, (0, cols * k - wide, 0, rows * k - high), value=-1)
    windows = grid.reshape(rows, k, cols, k).permute(0, 2, 1, 3).reshape(rows * cols, k * k)
    patches = high * wide  # per crop; crop i's patches are rows i·patches … of the flattened features
    index = torch.cat([torch.where(windows >= 0, windows + i * patches, windows) for i in range(batch)])
    layout = {"pixel_values": torch.randn(batch, patches, channels * patch * patch, generator=gen).to(dtype),
              pooling: index, "image_grids": torch.tensor([[rows, cols, 0, 0]] * batch)}
    if "image_num_crops" in params:
        layout["image_num_crops"] = torch.ones(batch, dtype=torch.long)
    yield {k_: v for k_, v in layout.items() if k_ in params}


def tile_mask_variants(layouts: list[Layout]) -> Iterator[Layout]:
    """Each images-per-sample layout again with its ``pixel_attention_mask`` per tile, ``(B, tiles)``,
    instead of per pixel (Granite-Docling marks which tiles of a sample are real)."""
    for layout in layouts:
        mask = layout.get("pixel_attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 4 and layout["pixel_values"].dim() == 5:
            yield {**layout, "pixel_attention_mask": mask.flatten(2).any(-1)}


def with_companions(layout: Layout, config: Any, params: Any, gen: torch.Generator, dtype: torch.dtype) -> Layout:
    """``layout`` plus the images a second vision tower takes at its own size: ``<name>_pixel_values``
    for each ``<name>_vision_config`` (DeepSeek-VL hybrid's high-resolution SAM tower); and each image's
    merge factor, ``image_merge_sizes``, next to its grid where the forward takes it (VideoLLaMA 3)."""
    out = dict(layout)
    grid = layout.get("image_grid_thw")
    if isinstance(grid, torch.Tensor) and "image_merge_sizes" in params:
        # VideoLLaMA 3 merges each image's patches by its own factor: the tower's where its config names one (the
        # grid's sides are a multiple of it), else 1, as its image processor merges images
        merge = int(cfg(sub_config(config, "vision"), "spatial_merge_size", "merge_size", default=1))
        out["image_merge_sizes"] = torch.full((grid.shape[0],), merge, dtype=torch.long)
    pixels = layout.get("pixel_values")
    if not isinstance(pixels, torch.Tensor) or pixels.dim() != 4:
        return out
    for name in params:
        prefix = name.removesuffix("_pixel_values")
        sub = getattr(config, f"{prefix}_vision_config", None)
        if prefix == name or sub is None or name in out:
            continue
        size = int(cfg(sub, "image_size", default=pixels.shape[-1]))
        channels = int(cfg(sub, "num_channels", default=pixels.shape[1]))
        out[name] = torch.randn(pixels.shape[0], channels, size, size, generator=gen).to(dtype)
    return out


def complete(params: Any, inputs: dict[str, Any]) -> None:
    """Add, in place, the masks that say which text positions see which image, now that the prompt's
    length is known: every position sees every image (and every used tile)."""
    ids, pixels = inputs.get("input_ids"), inputs.get("pixel_values")
    if not isinstance(ids, torch.Tensor) or not isinstance(pixels, torch.Tensor):
        return
    if "image_attention_mask" in params and pixels.dim() == 5:  # Idefics: (B, seq, images)
        inputs["image_attention_mask"] = torch.ones(ids.shape[0], ids.shape[1], pixels.shape[1], dtype=torch.long)
    tiles = inputs.get("aspect_ratio_mask")
    if "cross_attention_mask" in params and isinstance(tiles, torch.Tensor):  # Mllama: (B, seq, images, tiles)
        inputs["cross_attention_mask"] = tiles[:, None].expand(-1, ids.shape[1], -1, -1).clone()


MEDIA_KEYS = {"image": ("image_token_id", "image_token_index", "video_token_id", "video_token_index"),
              "audio": ("audio_token_id", "audio_token_index")}
MEDIA_INPUTS = {"image": ("pixel_values",), "audio": ("input_features", "input_values")}


def required_media_token(model: Any, params: Any) -> str | None:
    """The config key of a media placeholder token the forward needs but the config leaves unset, or None:
    BLIP-2 and InstructBLIP-Video configs saved before transformers placed the query outputs by token
    (``image_token_index: null``), Voxtral's default config (``audio_token_id: None``; its checkpoints set
    it). The forward compares the prompt's ids with that key, so no input places the media: such a forward
    cannot run on any input with its media."""
    if "input_ids" not in params:
        return None
    sources = []
    for module in dict.fromkeys((model, getattr(model, "base_model", None), getattr(model, "model", None))):
        try:  # a head class leaves the merging to its base model (Voxtral)
            sources.append(inspect.getsource(type(module)) if module is not None else "")
        except (OSError, TypeError):
            continue
    source = "\n".join(sources)
    config = model.config
    for kind, keys in MEDIA_KEYS.items():
        if not any(name in params for name in MEDIA_INPUTS[kind]):
            continue
        if any(isinstance(getattr(config, k, None), int) for k in keys):
            continue
        for key in keys:
            if key in vars(config) and getattr(config, key) is None and f"config.{key.rsplit('_', 1)[0]}" in source:
                return key
    return None
