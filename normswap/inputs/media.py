"""Images, video, audio and time series for the analysis inputs, in the layouts transformers models take.

Each ``*_layouts`` function yields the layouts a model's ``forward`` may take for one modality, most
common first, as dicts of keyword arguments: :func:`normswap.inputs.builder.hf_example_inputs` keeps the
first with which the model runs. The sizes come from the config (``image_size``, ``patch_size``,
``num_mel_bins``, ``context_length`` ...); nothing is read from the Hub.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from typing import Any

import torch

Layout = dict[str, Any]


def attribute(config: Any, name: str) -> Any:
    """``config.<name>``, or None where it is unset or is a computed property that cannot be computed
    (WavTokenizer's ``encoder_config`` builds a sub-config that validates itself): a config the model
    never reads that way must not stop the input builder."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - any error inside a config property means "not available"
        return None


def cfg(config: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` that ``config`` sets (not None), else ``default``."""
    for name in names:
        val = attribute(config, name)
        if val is not None:
            return val
    return default


def sub_config(config: Any, *kinds: str) -> Any:
    """``config.<kind>_config`` or ``config.<kind>`` for the first kind found, else ``config``."""
    for kind in kinds:
        for attr in (f"{kind}_config", kind):
            sub = attribute(config, attr)
            if sub is not None and hasattr(sub, "to_dict"):
                return sub
    return config


def tower_unset(config: Any, kind: str) -> bool:
    """True when the config sets its ``<kind>_config`` to None: the model is built without that tower (Gemma 4's
    default config is text-only, though its forward takes ``pixel_values`` and ``input_features``), so no
    input of that modality can run it, and the other towers are every tower there is."""
    return f"{kind}_config" in vars(config) and attribute(config, f"{kind}_config") is None


def _int(x: Any) -> int | None:
    if isinstance(x, (list, tuple)) and x:
        x = x[0]
    if isinstance(x, dict):
        x = x.get("height", x.get("shortest_edge", next(iter(x.values()), None)))
    return int(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 else None


# ------------------------------------------------------------------------------------------------ images
def image_geometry(config: Any) -> tuple[int, int, int]:
    """``(size, channels, patch)`` of the model's images: the vision config's ``image_size`` (else the
    top config's, else 64: big enough for a convolutional stem that halves 5 times), channels and
    patch size (1 where there is none). FLAVA names its vision tower's config ``image_config``."""
    vcfg = sub_config(config, "vision", "backbone", "image")
    size = _int(cfg(vcfg, "image_size", "img_size", "input_size")) or _int(cfg(config, "image_size")) or 64
    channels = _int(cfg(vcfg, "num_channels", "in_channels", "in_chans")) or 3
    patch = _int(cfg(vcfg, "patch_size", "spatial_patch_size")) or 1
    counts = projector_patch_counts(config)
    if counts and (size // patch) ** 2 not in counts:
        # a projector that takes only some patch counts (Aria: 1225 or 4900): the smallest square one
        size = patch * min(math.isqrt(n) for n in counts)
    return size, channels, patch


def projector_patch_counts(config: Any) -> set[int]:
    """The patch counts per image a projector takes, where the config fixes them as the keys of a
    ``*patch_to_query_dict`` (Aria's ``projector_patch_to_query_dict``): the square ones only."""
    for key, value in vars(config).items():
        if key.endswith("patch_to_query_dict") and isinstance(value, dict):
            counts = {int(k) for k in value if str(k).isdigit()}
            return {n for n in counts if n > 0 and math.isqrt(n) ** 2 == n}
    return set()


def image_layouts(config: Any, params: Any, batch: int, gen: torch.Generator, dtype: torch.dtype
                  ) -> Iterator[Layout]:
    """``pixel_values`` in every layout a transformers vision model takes, one image per sample:
    ``(B, C, H, W)``; video ``(B, T, C, H, W)`` where the config has ``num_frames``; images per sample
    ``(B, 1, C, H, W)`` (Idefics, SmolVLM) with a ``pixel_attention_mask``; Qwen-VL's flattened patches
    ``(B·h·w, C·t·p·p)`` with ``image_grid_thw``; each with ``image_sizes`` and ``pixel_mask`` where the
    forward takes them."""
    size, channels, patch = image_geometry(config)
    size = detection_size(config, size)
    vcfg = sub_config(config, "vision", "backbone", "image")
    frames = _int(cfg(vcfg, "num_frames", "frames"))

    def pixels(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    def extras(layout: Layout) -> Iterator[Layout]:
        if "pixel_mask" in params:
            layout["pixel_mask"] = torch.ones(batch, size, size, dtype=torch.long)
        yield layout
        if "image_sizes" in params:  # LLaVA takes it optional, LLaVA-NeXT needs it: both, in that order
            yield {**layout, "image_sizes": torch.tensor([[size, size]] * batch)}

    if frames:
        yield from extras({"pixel_values": pixels(batch, frames, channels, size, size)})
    yield from extras({"pixel_values": pixels(batch, channels, size, size)})
    # the config's own (height, width) where it is not square (MGP-STR's 32 x 128 text strips): a model that
    # checks its input against it runs on no square image
    high, wide = image_sides(config)
    if high != wide:
        layout = {"pixel_values": pixels(batch, channels, high, wide)}
        if "pixel_mask" in params:
            layout["pixel_mask"] = torch.ones(batch, high, wide, dtype=torch.long)
        yield layout
    # an image that keeps a few positions after every stride the backbone can take (PP-OCRv5 mobile rec: a stem
    # and 4 stages of stride 2, 32 in all, then a 3 x 2 pooling: 64 pixels leave 2 x 2, too few)
    deep = STRIDE_SIDE_POSITIONS * max_backbone_stride(vcfg)
    if deep > size:
        yield {"pixel_values": pixels(batch, channels, deep, deep)}
    for tiles in dict.fromkeys((1, anyres_tiles(config, size))):
        per_sample = {"pixel_values": pixels(batch, tiles, channels, size, size)}
        if "pixel_attention_mask" in params:
            per_sample["pixel_attention_mask"] = torch.ones(batch, tiles, size, size, dtype=torch.bool)
        yield from extras(per_sample)
    if "spatial_shapes" in params:  # NaFlex (SigLIP2, LFM2-VL): patch rows, their grid and a mask over them
        side = 2 * max(1, _int(cfg(config, "downsample_factor")) or 1)
        side = max(side, min(16, math.isqrt(_int(cfg(vcfg, "num_patches")) or 16)) // side * side)
        layout = {"pixel_values": pixels(batch, side * side, channels * patch * patch),
                  "spatial_shapes": torch.tensor([[side, side]] * batch),
                  "pixel_attention_mask": torch.ones(batch, side * side, dtype=torch.long)}
        yield layout
    if "image_grid_thw" in params:
        yield from extras(grid_layout(vcfg, batch, gen, dtype))
    if "grid_thw" in params:  # a Qwen-VL style vision tower alone
        yield grid_layout(vcfg, batch, gen, dtype, grid="grid_thw")
    # a pair of images per sample (B, 2, C, H, W): keypoint matchers (LightGlue, EfficientLoFTR)
    yield {"pixel_values": pixels(batch, 2, channels, size, size)}


STRIDE_SIDE_POSITIONS = 4  # positions a side left after a backbone's coarsest stride (as "4 patches a side")


def image_sides(config: Any) -> tuple[int, int]:
    """``(height, width)`` of the model's images where the vision config gives its ``image_size`` as a pair
    (a list or tuple, or a ``{"height", "width"}`` dict: MGP-STR's ``(32, 128)``), else the square side of
    :func:`image_geometry`."""
    vcfg = sub_config(config, "vision", "backbone", "image")
    value = cfg(vcfg, "image_size", "img_size", "input_size")
    if value is None:
        value = cfg(config, "image_size")
    if isinstance(value, dict):
        value = (value.get("height"), value.get("width"))
    if (isinstance(value, (list, tuple)) and len(value) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in value)):
        return int(value[0]), int(value[1])
    size = image_geometry(config)[0]
    return size, size


def max_backbone_stride(vcfg: Any) -> int:
    """The coarsest stride a staged convolutional backbone can reach, read from its config: 2 for its stem and
    for each stage it lists (``depths``, one entry a stage, with ``stage_names`` naming the stem and each stage:
    transformers' staged backbones halve the image at most once in each); 1 for a config with no such stages
    (a ViT backbone names one stage per layer and lists no ``depths``)."""
    stages, depths = cfg(vcfg, "stage_names"), cfg(vcfg, "depths")
    if not (isinstance(stages, (list, tuple)) and isinstance(depths, (list, tuple)) and depths
            and len(stages) == len(depths) + 1):
        return 1
    return 2 ** len(depths)


def anyres_tiles(config: Any, size: int) -> int:
    """Crops per image of an "any resolution" model (LLaVA-NeXT, LLaVA-OneVision): the base image
    plus the tiles of the grid pinpoint an image of ``size × size`` is fitted to (the closest pinpoint
    at least that size, else the largest), each tile one ``image_size`` square."""
    points = cfg(config, "image_grid_pinpoints")
    if not isinstance(points, (list, tuple)) or not points:
        return 1
    fits = [p for p in points if isinstance(p, (list, tuple)) and len(p) == 2 and min(p) >= size]
    best = min(fits or points, key=lambda p: p[0] * p[1])
    return 1 + max(1, -(-int(best[0]) // size)) * max(1, -(-int(best[1]) // size))


def grid_layout(vcfg: Any, batch: int, gen: torch.Generator, dtype: torch.dtype, *,
                name: str = "pixel_values", grid: str = "image_grid_thw") -> Layout:
    """Qwen-VL style patches: each image a ``t×h×w`` grid of patches, flattened to rows of
    ``C·temporal_patch·patch·patch`` values, with its grid in ``grid`` (``h``, ``w`` four spatial merges)."""
    patch = _int(cfg(vcfg, "patch_size", "spatial_patch_size")) or 14
    temporal = _int(cfg(vcfg, "temporal_patch_size", "patch_temporal")) or 1
    merge = _int(cfg(vcfg, "spatial_merge_size", "merge_size")) or 1
    channels = _int(cfg(vcfg, "in_channels", "num_channels", "in_chans")) or 3
    side = 2 * merge
    rows = batch * side * side
    return {name: torch.randn(rows, channels * temporal * patch * patch, generator=gen).to(dtype),
            grid: torch.tensor([[1, side, side]] * batch)}


def detection_size(config: Any, size: int) -> int:
    """``size``, or the smallest multiple of the coarsest stride above it whose feature maps hold at
    least ``num_queries`` positions, for a detector that picks its queries as the top-k encoder positions
    (RT-DETR, D-FINE, DEIM: ``feat_strides``; two-stage Deformable DETR / Grounding DINO: strides 8 to 64,
    one per feature level; LW-DETR / RF-DETR: the backbone's patch over each projector scale). Such a
    model cannot run on fewer positions than queries."""
    queries = _int(cfg(config, "num_queries"))
    strides = cfg(config, "feat_strides")
    patch = _int(cfg(sub_config(config, "backbone"), "patch_size"))
    if queries and patch and cfg(config, "group_detr") is not None and not strides:
        # LW-DETR / RF-DETR: always two-stage, over a ViT backbone's patches scaled by the projector
        scales = cfg(config, "projector_scale_factors") or [1.0]
        strides = [max(1, round(patch / float(f))) for f in scales]
    if not queries or not (isinstance(strides, (list, tuple)) and strides or cfg(config, "two_stage") is True):
        return size
    if not (isinstance(strides, (list, tuple)) and strides):
        strides = (8, 16, 32, 64)[: _int(cfg(config, "num_feature_levels")) or 4]
    # whole windows for a windowed ViT backbone (RF-DETR's DINOv2 splits the patch grid num_windows ways)
    step = max(int(s) for s in strides) * (_int(cfg(sub_config(config, "backbone"), "num_windows")) or 1)
    side = -(-size // step) * step
    while sum((side // int(s)) ** 2 for s in strides) < queries:
        side += step
    return side


def video_layouts(config: Any, params: Any, batch: int, gen: torch.Generator, dtype: torch.dtype
                  ) -> Iterator[Layout]:
    """``pixel_values_videos`` for models that take video next to images: 2 frames per sample
    ``(B, T, C, H, W)``, or Qwen-VL patches with ``video_grid_thw``."""
    vcfg = sub_config(config, "vision")
    if "video_grid_thw" in params:
        yield grid_layout(vcfg, batch, gen, dtype, name="pixel_values_videos", grid="video_grid_thw")
        return
    size, channels, _ = image_geometry(config)
    yield {"pixel_values_videos": torch.randn(batch, 2, channels, size, size, generator=gen).to(dtype)}


# ------------------------------------------------------------------------------------------------- audio
AUDIO_FRAME_BUDGET = 3000  # log-mel frames of 10 ms per batch: one 30-second clip


AUDIO_KINDS = ("audio", "speech", "encoder", "asr")
FEATURE_KEYS = ("num_mel_bins", "n_mels", "feature_size", "input_feat_size")


def audio_config(config: Any) -> Any:
    """The config of the audio encoder: ``audio_config`` (or ``speech``, ``encoder``, ``asr``), and
    inside it the one that sets the feature width where it only groups others (Nemotron 3.5
    Transcribe's ``audio_config`` holds an ``asr_config`` with the mel count and a diarization config)."""
    acfg = sub_config(config, *AUDIO_KINDS)
    for _ in range(2):
        if acfg is config or cfg(acfg, *FEATURE_KEYS) is not None:
            break
        inner = sub_config(acfg, *AUDIO_KINDS)
        if inner is acfg:
            break
        acfg = inner
    return acfg


def feature_frames(config: Any) -> int:
    """How many feature frames the model takes: twice its encoder positions where it fixes them
    (Whisper: 3000 for 1500), else 200 (2 s of 10 ms frames; a conv stem that subsamples 4-8 times
    keeps 25-50 positions)."""
    acfg = audio_config(config)
    positions = _int(cfg(acfg, "max_source_positions")) or _int(cfg(config, "max_source_positions"))
    return 2 * positions if positions else 200


def feature_layouts(config: Any, batch: int, gen: torch.Generator, dtype: torch.dtype,
                    masks: list[str] = ()) -> Iterator[Layout]:
    """``input_features``: log-mel ``(B, mels, T)`` (Whisper and its kin), ``(B, T, F)`` filterbank
    features (Speech2Text, Wav2Vec2-BERT, Conformer encoders), ``F`` being the config's feature size, or a
    one-channel spectrogram ``(B, 1, T, mels)`` (CLAP). Each of ``masks`` (``feature_attention_mask``,
    ``input_features_mask``) comes along as ones over the frames."""
    acfg = audio_config(config)
    frames = feature_frames(config)
    mels = _int(cfg(acfg, "num_mel_bins", "n_mels", "feature_size", "input_feat_size")) or \
        _int(cfg(config, "num_mel_bins", "feature_size")) or 80
    width = mels * (_int(cfg(acfg, "input_channels")) or 1)
    feats = _int(cfg(acfg, "feature_size", "input_feat_per_channel", "input_dim", "num_mel_bins")) or mels
    feats *= _int(cfg(acfg, "input_channels")) or 1
    def with_masks(features: torch.Tensor, time_axis: int) -> Layout:
        mask = torch.ones(batch, features.shape[time_axis], dtype=torch.long)
        return {"input_features": features, **{m: mask for m in masks}}

    yield with_masks(torch.randn(batch, width, frames, generator=gen).to(dtype), -1)
    yield with_masks(torch.randn(batch, min(frames, 200), feats, generator=gen).to(dtype), 1)
    # one-channel spectrogram images (B, 1, T, mels): CLAP's audio tower
    yield with_masks(torch.randn(batch, 1, min(frames, 1024), mels, generator=gen).to(dtype), 2)
    for size in stacked_feature_sizes(config, mels, feats):
        yield with_masks(torch.randn(batch, min(frames, 200), size, generator=gen).to(dtype), 1)
    for size in dict.fromkeys((128, 80)):  # the common mel counts, where the config does not say
        if size != width:
            yield with_masks(torch.randn(batch, size, frames, generator=gen).to(dtype), -1)


def stacked_feature_sizes(config: Any, mels: int, feats: int) -> list[int]:
    """Feature widths of ``(B, T, F)`` models whose frames are stacked or expanded before the encoder,
    beyond the configured ``mels``/``feats``: ``feature_projection_input_dim`` (Wav2Vec2-BERT, SeamlessM4T:
    two stacked 80-mel frames = 160), ``num_mel_bins · num_stacked_frames`` (FunASR's low frame rate
    stacking), mels × 2 and × 4 (delta-expanded then pair-stacked frames: Granite Speech 5) and the
    first sub-sampling conv's channels (Gemma 4's audio tower reads 128 mels off
    ``subsampling_conv_channels[0]``)."""
    acfg = audio_config(config)
    sizes = [_int(cfg(acfg, "feature_projection_input_dim")) or _int(cfg(config, "feature_projection_input_dim"))]
    stack = _int(cfg(acfg, "num_stacked_frames", "lfr_m"))
    sizes += [mels * stack if stack else None, 2 * mels, 4 * mels, _int(cfg(acfg, "subsampling_conv_channels"))]
    return [s for s in dict.fromkeys(sizes) if s and s not in (mels, feats)]


HOP_SAMPLES = 160  # 16 kHz samples per 10 ms feature frame


def with_sample_mask(layout: Layout, params: Any, *, from_features: bool = False, required: bool = False) -> Layout:
    """``layout`` plus ``padding_mask``, ones over the clip's raw samples ``(B, samples)``, where the forward
    takes one next to features (MOSS Transcribe-Diarize's audio features read it: one row per clip, as long
    as the audio the features were cut from, ``frames · 160``) or requires one next to raw audio (``required``:
    its audio encoder does, Apertus 1.5). Left out where it is optional next to raw audio: codecs (EnCodec,
    DAC) take a mask shaped like their input.
    Next to features, also each clip's raw length where the forward takes ``*_sample_lengths``
    (dots.note's ``chunk_sample_lengths``, one per clip); next to raw audio, where each sample's clips end
    (CSM's ``input_values_cutoffs``: one clip per sample, all of it)."""
    batch = layout[next(iter(layout))].shape[0]
    if from_features:
        feats = layout["input_features"]
        mask = next((layout[k] for k in ("feature_attention_mask", "input_features_mask") if k in layout), None)
        frames = mask.shape[-1] if isinstance(mask, torch.Tensor) else max(feats.shape[1:])
        samples = frames * HOP_SAMPLES
        # each chunk's raw length, where the forward reads it (dots.note's chunk_sample_lengths): all of it
        layout = {**layout, **{name: torch.full((batch,), samples, dtype=torch.long) for name in params
                               if name.endswith("_sample_lengths") and name not in layout}}
    else:  # where each sample's clips end (CSM's input_values_cutoffs, (B, clips)): one clip, all of it
        layout = {**layout, **{name: torch.full((batch, 1), layout["input_values"].shape[-1], dtype=torch.long)
                               for name in params if name == "input_values_cutoffs" and name not in layout}}
    param = params.get("padding_mask") if hasattr(params, "get") else None
    if param is None or "padding_mask" in layout:
        return layout
    if not from_features:
        if not required and getattr(param, "default", None) is not inspect.Parameter.empty:
            return layout
        samples = layout["input_values"].shape[-1]
    return {**layout, "padding_mask": torch.ones(batch, samples, dtype=torch.long)}


def value_layouts(config: Any, batch: int, gen: torch.Generator, dtype: torch.dtype) -> Iterator[Layout]:
    """``input_values``: raw mono audio ``(B, samples)`` (Wav2Vec2, HuBERT), one channel
    ``(B, 1, samples)`` (audio codecs: EnCodec, DAC, Mimi), spectrogram patches ``(B, T, mels)``
    (Audio Spectrogram Transformer), hidden states ``(B, T, hidden_size)`` (an encoder without its
    pre-net: SpeechT5Model), or mono audio in whole frames of the config's ``frame_size`` / ``hop_length``
    or of its strides' product (MuseSpark's audio patches: 16·6·5·4 = 1920 samples)."""
    acfg = audio_config(config)
    yield {"input_values": torch.randn(batch, 4000, generator=gen).to(dtype)}
    channels = _int(cfg(acfg, "audio_channels", "channels")) or 1
    hop = _int(cfg(acfg, "hop_length", "frame_size")) or 320
    yield {"input_values": torch.randn(batch, channels, 16 * hop, generator=gen).to(dtype)}
    mels = _int(cfg(acfg, "num_mel_bins", "feature_size")) or 128
    length = _int(cfg(acfg, "max_length")) or 100
    yield {"input_values": torch.randn(batch, length, mels, generator=gen).to(dtype)}
    hidden = _int(cfg(acfg, "hidden_size", "d_model"))
    if hidden and hidden != mels:  # an encoder built without its pre-net takes hidden states (SpeechT5Model)
        yield {"input_values": torch.randn(batch, 16, hidden, generator=gen).to(dtype)}
    ratios = cfg(acfg, "patch_sizes", "downsampling_ratios", "upsampling_ratios")
    frame = _int(cfg(acfg, "frame_size", "hop_length", "samples_per_frame")) or (
        math.prod(ratios) if isinstance(ratios, (list, tuple)) and all(isinstance(r, int) for r in ratios) else None)
    if frame and 4000 % frame:  # a codec or encoder that takes whole frames of samples only
        yield {"input_values": torch.randn(batch, frame * max(1, -(-4000 // frame)), generator=gen).to(dtype)}


# ------------------------------------------------------------------------------------------- time series
def series_layouts(config: Any, params: Any, batch: int, gen: torch.Generator, dtype: torch.dtype
                   ) -> Iterator[Layout]:
    """``past_values`` and the inputs that come with it: ``past_time_features``,
    ``past_observed_mask``, the future window (``future_values``, ``future_time_features``: a
    forecaster's decoder runs only on them) and static features, at the config's context, lag and
    prediction lengths and channel count. Univariate series ``(B, L)`` and multivariate ``(B, L, C)``."""
    context = _int(cfg(config, "context_length", "input_size_length", "sequence_length")) or 32
    lags = cfg(config, "lags_sequence")
    length = context + (max(lags) if isinstance(lags, (list, tuple)) and lags else 0)
    future = _int(cfg(config, "prediction_length", "horizon_length")) or 8
    channels = _int(cfg(config, "input_size", "num_input_channels", "num_channels", "enc_in")) or 1
    time_feats = _int(cfg(config, "num_time_features")) or 0

    def series(n: int, shape_tail: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(batch, n, *shape_tail, generator=gen).to(dtype)

    tails = [(channels,)] if channels > 1 else [(), (1,)]
    for tail in tails:
        layout: Layout = {"past_values": series(length, tail)}
        if "past_observed_mask" in params:
            layout["past_observed_mask"] = torch.ones_like(layout["past_values"])
        if "past_time_features" in params:
            layout["past_time_features"] = series(length, (time_feats,))
        if "future_values" in params and "future_time_features" in params:  # seq2seq forecasters
            layout["future_values"] = series(future, tail)
            layout["future_time_features"] = series(future, (time_feats,))
        cats = _int(cfg(config, "num_static_categorical_features")) or 0
        if cats and "static_categorical_features" in params:
            card = cfg(config, "cardinality") or [2] * cats
            layout["static_categorical_features"] = torch.stack(
                [torch.randint(0, max(1, int(c)), (batch,), generator=gen) for c in card[:cats]], dim=1)
        reals = _int(cfg(config, "num_static_real_features")) or 0
        if reals and "static_real_features" in params:
            layout["static_real_features"] = torch.randn(batch, reals, generator=gen).to(dtype)
        yield layout
