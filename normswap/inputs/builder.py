"""The analysis inputs of a transformers model, built from its config, ``forward`` signature and the
conventions of its family, so that ``normswap convert MODEL`` needs no inputs from the user.

Every modality the forward takes gets inputs, so one run of the whole model reaches every tower (a
vision tower and a text decoder, an audio encoder, a forecaster's decoder): text ids; images, in the
layout the model takes (:func:`normswap.inputs.media.image_layouts`); log-mel or filterbank features;
raw audio; time series. A vision-language or omni model's prompt holds the image (and audio) tokens
its ``image_token_id`` / ``audio_token_id`` names, as many as its own encoder makes of the media
(counted by running ``get_image_features`` / ``get_audio_features`` once), between the
``*_start``/``boi`` and ``*_end``/``eoi`` tokens where the config has them, with ``mm_token_type_ids``
or ``token_type_ids`` marking them where the forward takes those.

Where a modality has more than one layout the model might take, the candidates are tried in order with
one forward each, and the first that runs is kept (remembered per model class and config, so later
calls, with other seeds and lengths, build it directly). A required forward argument with no rule to
build it is refused in one line naming it.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import itertools
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from normswap.analysis import precision
from normswap.errors import ModelRunFailed, NormswapError
from normswap.inputs import media, structured, vision
from normswap.inputs.media import AUDIO_FRAME_BUDGET, Layout, cfg, sub_config
from normswap.modelinfo import model_device, model_dtype

# how to build each required forward argument; any other required one is refused by name
KNOWN = {"input_ids", "pixel_values", "grid_thw", "spatial_shapes", "input_features", "input_values", "past_values",
         "past_time_features", "past_observed_mask", "decoder_input_ids", "pixel_values_videos", "image_grid_thw",
         "video_grid_thw", "image_sizes", "pixel_attention_mask", "pixel_mask", "future_values",
         "future_time_features", "static_categorical_features", "static_real_features", "feature_attention_mask",
         "input_features_mask", "padding_mask"}
# a video-only model (InstructBLIP-Video) marks its frames' rows with its video token
MEDIA_TOKEN = {"image": ("image_token_id", "image_token_index", "image_token", "video_token_id", "video_token_index"),
               "audio": ("audio_token_id", "audio_token_index", "audio_token")}
MEDIA_START = {"image": ("vision_start_token_id", "boi_token_id", "boi_token_index", "image_start_token_id"),
               "audio": ("audio_start_token_id", "boa_token_id", "audio_bos_token_id")}
MEDIA_END = {"image": ("vision_end_token_id", "eoi_token_id", "eoi_token_index", "image_end_token_id"),
             "audio": ("audio_end_token_id", "eoa_token_id", "audio_eos_token_id")}
_TOKEN_KEY = re.compile(r"(_token_id|_token_index|_token|_id)$")

# (model class, config) -> index of the candidate that ran, media tokens per sample, variant (below)
_CHOSEN: dict[tuple[str, int], tuple[int, dict[str, int], frozenset[str]]] = {}
# what a candidate is retried with when it does not run as first built (see _retry)
NO_PROMPT_MASK = "no prompt mask"  # the prompt's all-ones attention_mask left out
MASK_OVER_ROWS = "feature mask over encoder rows"  # the audio feature mask over the encoder's output rows
KNOWN |= structured.NAMES  # boxes, trajectories, forecaster padding, task prompts, codec latents


def forward_params(model: nn.Module) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(model.forward).parameters)


def special_ids(config: Any) -> set[int]:
    """Every token id the config (and its sub-configs) names: pad, bos, eos, image, audio, boi..."""
    out: set[int] = set()
    stack, seen = [config], set()
    while stack:
        c = stack.pop()
        if id(c) in seen:
            continue
        seen.add(id(c))
        for k, v in vars(c).items():
            if hasattr(v, "to_dict") and not isinstance(v, type):
                stack.append(v)
            elif _TOKEN_KEY.search(k) and isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                out.add(v)
            elif _TOKEN_KEY.search(k) and isinstance(v, (list, tuple)):
                out.update(int(x) for x in v if isinstance(x, int) and not isinstance(x, bool) and x >= 0)
    return out


def max_positions(cfg_: Any) -> int | None:
    """The longest sequence the text side takes, or None. Negative or zero (XLNet: -1, "no limit") is none."""
    val = cfg(cfg_, "max_position_embeddings", "n_positions", "max_target_positions", "n_ctx")
    return int(val) if isinstance(val, int) and not isinstance(val, bool) and val > 2 else None


def text_ids(cfg_: Any, batch: int, length: int, gen: torch.Generator, avoid: set[int]) -> torch.Tensor:
    """Random token ids over the vocabulary, none of them a special id (pad, bos, eos, image...): no
    masking or media merging kicks in where the ids are plain text."""
    vocab = int(cfg(cfg_, "vocab_size", default=100))
    max_pos = max_positions(cfg_)
    length = max(1, min(length, max_pos - 2)) if max_pos else length
    low = min(3, vocab - 1)
    ids = torch.randint(low, vocab, (batch, length), generator=gen)
    if avoid:
        plain = next((i for i in range(low, vocab) if i not in avoid), low)
        ids[torch.isin(ids, torch.tensor(sorted(avoid)))] = plain
    return ids


def _media_token(config: Any, kind: str, key: dict[str, tuple[str, ...]]) -> int | None:
    for c in (config, sub_config(config, "text")):
        val = cfg(c, *key[kind])
        if isinstance(val, int) and not isinstance(val, bool) and val >= 0:
            return val
    return None


def media_token_ids(config: Any) -> set[int]:
    """The ids that mark media in a prompt the builder makes: each modality's placeholder token and its
    start/end tokens, where the config names them."""
    found = (_media_token(config, kind, table) for table in (MEDIA_TOKEN, MEDIA_START, MEDIA_END) for kind in table)
    return {i for i in found if i is not None}


def _feature_count(model: nn.Module, kind: str, layout: Layout, batch: int) -> int | None:
    """Media tokens per sample the model's prompt must hold for ``layout``: what its own
    ``get_<kind>_features`` makes of it, in rows of the text width. None: no such method (the caller
    then tries the forward alone); raises when the encoder does not run on the layout."""
    fn = getattr(model, f"get_{kind}_features", None)
    if fn is None:  # a head class that leaves it to its base model (DeepSeek-VL hybrid)
        fn = getattr(getattr(model, "base_model", None), f"get_{kind}_features", None)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    width = getattr(embed, "embedding_dim", None) or getattr(getattr(embed, "weight", None), "shape", [0, 0])[-1]
    if fn is None or not width:
        return None
    accepted = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    # a signature hidden behind a decorator's (*args, **kwargs) takes the media and its metadata by name
    kw = {k: v for k, v in layout.items() if k in accepted or (takes_any and (k in MODALITY or k.endswith((
        "_thw", "_mask", "_sizes", "_lengths"))))}
    with torch.no_grad():
        out = fn(**kw)
    feats = getattr(out, "pooler_output", None)
    if feats is None:
        feats = getattr(out, "last_hidden_state", None) if not isinstance(out, (torch.Tensor, list, tuple)) else out
    if feats is None and isinstance(out, (tuple, list)):
        feats = out[0]
    tensors = [feats] if isinstance(feats, torch.Tensor) else [t for t in feats if isinstance(t, torch.Tensor)]
    # a factorized embedding (NeoMME's, ALBERT-style: vocab -> rank -> hidden) is projected to the text model's
    # hidden size before the media rows replace the placeholders: rows of that width are the prompt's too
    hidden = cfg(sub_config(model.config, "text"), "hidden_size") if hasattr(model, "config") else None
    if tensors and tensors[0].shape[-1] != width and isinstance(hidden, int) and tensors[0].shape[-1] == hidden:
        width = hidden
    total = sum(t.numel() for t in tensors) // int(width)
    if tensors and tensors[0].shape[-1] != width:
        return None  # rows of another width (the encoder's own, before a projection): not the prompt's count
    if total <= 0 or total % batch:
        raise ValueError(f"{total} {kind} feature rows do not split over {batch} samples")
    return total // batch


@contextlib.contextmanager
def _trial(model: nn.Module) -> Iterator[None]:
    """Eval mode, no grad and the model's dtype as the factory default (HF mask constants), undone after;
    torch's random generators forked, so a model that draws random numbers in eval mode (ViT-MAE's
    masking) leaves the user's random stream where it was. A float64 model runs with its float32 casts
    held at float64, as the analysis runs it (:mod:`normswap.analysis.precision`): GLM-4V's position
    interpolation casts the grid to float32 and would not meet its float64 embeddings otherwise."""
    modes = {m: m.training for m in model.modules()}
    previous = torch.get_default_dtype()
    dtype = model_dtype(model)
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # never initialise CUDA for a CPU model
    model.eval()
    experts = _float64_experts(model) if dtype == torch.float64 else None
    try:
        if dtype in (torch.float32, torch.float64):
            torch.set_default_dtype(dtype)
        with torch.no_grad(), torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if cuda else []), \
                precision.holding(torch.float64, enabled=dtype == torch.float64):
            yield
    finally:
        torch.set_default_dtype(previous)
        for m, training in modes.items():
            m.training = training
        if experts is not None:
            model.set_experts_implementation(experts)


def _float64_experts(model: nn.Module) -> dict[str, Any] | None:
    """Switch a float64 model's fused MoE experts to transformers' ``eager`` implementation for a trial
    forward where its own (``grouped_mm``) has no float64 kernel, as the pipeline's float64 working copy
    runs them; the setting to restore, or None when nothing changed."""
    get = getattr(model, "get_experts_implementation", None)
    try:
        current = get() if callable(get) else None
    except (AttributeError, TypeError):
        return None
    if not current or all(v in (None, "eager", "batched_mm") for v in current.values()):
        return None
    model.set_experts_implementation({k: v if v in (None, "eager", "batched_mm") else "eager"
                                      for k, v in current.items()})
    return current


class KeptRun:
    """The output of a trial forward, kept for a caller that would otherwise run the same forward again
    (:func:`keeping_runs`): ``output_on(kwargs)`` is the model's output on exactly that dict of inputs
    (the same object, not equal values), or None where no kept trial ran on it."""

    def __init__(self, within: Callable[[], contextlib.AbstractContextManager[Any]],
                 on: dict[str, Any] | None) -> None:
        self.within, self.on = within, on
        self.kwargs: dict[str, Any] | None = None
        self.output: Any = None

    def output_on(self, kwargs: dict[str, Any]) -> Any:
        return self.output if self.kwargs is not None and kwargs is self.kwargs else None


_KEEPING: contextvars.ContextVar[KeptRun | None] = contextvars.ContextVar("normswap_kept_run", default=None)


def _runs_as_is(model: nn.Module) -> bool:
    """Whether a trial forward of ``model`` (:func:`_trial`) computes what a plain no-grad forward of it does
    now: every module in eval mode already, and a dtype the trial leaves the factory default at (not
    float64, whose trial holds the model's float32 casts at float64)."""
    dtype = model_dtype(model)
    if dtype == torch.float64 or (dtype == torch.float32 and torch.get_default_dtype() != torch.float32):
        return False
    return not any(m.training for m in model.modules())


@contextlib.contextmanager
def keeping_runs(model: nn.Module, within: Callable[[], contextlib.AbstractContextManager[Any]],
                 on: dict[str, Any] | None = None) -> Iterator[KeptRun]:
    """Keep the output of ``model``'s trial forwards run inside the block (:func:`run_kept`): the last one,
    or the one on the dict ``on`` when given. Each runs inside ``within()`` too (the caller's seeded random
    draws), so that it computes what the caller's own no-grad forward on those inputs would; nothing is
    kept where a trial would compute something else (:func:`_runs_as_is`). A layout check and the reload
    probe's original outputs, a route check and the original's error in its own dtype, are then one
    forward each instead of two."""
    kept = KeptRun(within, on)
    if not _runs_as_is(model):
        yield kept  # keeps nothing: output_on() is None
        return
    token = _KEEPING.set(kept)
    try:
        yield kept
    finally:
        _KEEPING.reset(token)


def run_kept(model: nn.Module, kwargs: dict[str, Any]) -> Any:
    """``model(**kwargs)``, kept (with the inputs it ran on) where :func:`keeping_runs` asks for it. Runs
    inside the caller's trial context."""
    kept = _KEEPING.get()
    if kept is None or (kept.on is not None and kwargs is not kept.on):
        return model(**kwargs)
    kept.kwargs, kept.output = None, None  # a failed run keeps nothing
    with kept.within():
        out = model(**kwargs)
    kept.kwargs, kept.output = kwargs, out
    return out


def _run_error(model: nn.Module, kwargs: dict[str, Any]) -> Exception | None:
    """None when the model runs on ``kwargs``, else what it raised."""
    try:
        with _trial(model):
            run_kept(model, kwargs)
        return None
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - the layout does not fit the model: the next one is tried
        return exc


# the check transformers models make when the prompt's media tokens and the encoder's rows differ
_MISMATCH = re.compile(r"(image|audio|video|multimodal)\w* (?:features and \w+ tokens|tokens and features) "
                       r"do not match.*?tokens: (\d+), features:? (\d+)", re.IGNORECASE | re.DOTALL)


# torch's own error where a model writes the encoder's rows into the prompt's media positions by index (CSM):
# the indexing result holds the prompt's tokens, the value tensor the encoder's rows
_SCATTER = re.compile(r"value tensor of shape \[(\d+), \d+\] cannot be broadcast to indexing result of shape "
                      r"\[(\d+), \d+\]")


def _mismatch(error: Exception | None) -> tuple[str, int, int] | None:
    """``(kind, tokens, rows)`` from a model's error that its prompt's media tokens and its encoder's rows differ:
    its own check (:data:`_MISMATCH`) or torch's indexed write (:data:`_SCATTER`, kind "multimodal")."""
    if error is None:
        return None
    if fix := _MISMATCH.search(str(error)):
        return fix.group(1).lower(), int(fix.group(2)), int(fix.group(3))
    if fix := _SCATTER.search(str(error)):
        return "multimodal", int(fix.group(2)), int(fix.group(1))
    return None


def _mismatched_kind(found: tuple[str, int, int] | None, counts: dict[str, int], batch: int) -> str | None:
    """The modality whose prompt tokens the model found wrong (``found`` from :func:`_mismatch`): the one it
    names, or, where it says "multimodal" (dots.note, CSM), the one whose tokens in the prompt are as many
    as it counted."""
    if found is None:
        return None
    kind, tokens, _ = found
    if kind != "multimodal":
        return kind
    matching = [k for k, n in counts.items() if n * batch == tokens]
    return matching[0] if len(matching) == 1 else None


def _key(model: nn.Module) -> tuple[str, int]:
    try:
        text = model.config.to_json_string(use_diff=False)
    except Exception:  # noqa: BLE001 - a config that does not serialise: remember by identity
        text = str(id(model.config))
    return type(model).__qualname__, hash(text)


def hf_example_inputs(model: nn.Module, batch: int = 2, seq: int = 8, seed: int = 0) -> dict[str, Any]:
    """Random but valid inputs for a transformers model, from its config and forward signature (see the
    module docstring): every modality it takes, in the layout it runs on."""
    config = model.config
    params = forward_params(model)
    device = model_device(model)
    dtype = model_dtype(model)
    missing = [n for n in _required(params) if n not in KNOWN and not _side_ids(n)
               and n not in vision.built_here(params)]
    if missing:
        raise NormswapError(
            f"cannot build example inputs for {type(model).__name__}: its forward requires "
            f"{', '.join(f'`{m}`' for m in missing)}, which normswap has no rule to build; pass example_inputs="
            "{...} with it (and the model's other inputs)")
    if "input_features" in params:
        # log-mel models fix their own length (Whisper: 30 s, 1500 encoder tokens per clip): a batch
        # holds as many clips as fit in AUDIO_FRAME_BUDGET, at least one, so that analysis, probes and
        # calibration cost about what they do for text per token
        batch = max(1, min(batch, AUDIO_FRAME_BUDGET // media.feature_frames(config)))
    key = _key(model)
    chosen = _CHOSEN.get(key)
    combos = list(_combinations(config, params, batch, seed, dtype, _encoder_needs(model)))
    if not combos and structured.main_inputs(config, params):
        combos = [{}]  # a trajectory, a codec decoder's latents: built whole in _finish
    if not combos:
        raise NormswapError(
            f"cannot build example inputs for {type(model).__name__} (main input "
            f"{getattr(model, 'main_input_name', '?')!r}); pass example_inputs=(...) or a dict of kwargs")
    if chosen is not None and chosen[0] < len(combos):
        index, counts, variant = chosen
        return _finish(model, config, params, combos[index], counts, batch, seq, seed, device, variant)
    built, first, first_counts = None, 0, {}
    for index, media_kw in enumerate(combos):
        try:
            counts = _counts(model, config, params, media_kw, batch)
        except Exception:  # noqa: BLE001 - the encoder does not take this layout
            continue
        kwargs = _finish(model, config, params, media_kw, counts, batch, seq, seed, device)
        if built is None:
            built, first, first_counts = kwargs, index, counts
        if len(combos) == 1 and not counts:
            return kwargs
        error = _run_error(model, kwargs)
        variant: frozenset[str] = frozenset()
        if error is not None:  # first with the counts the encoder gave, then with the ones the model's check says
            kwargs, error, variant = _retry(model, config, params, media_kw, counts, batch, seq, seed, device,
                                            kwargs, error, variant)
        for _ in range(3):  # no usable get_*_features: the model's own check says how many, per modality
            found = _mismatch(error)
            kind = _mismatched_kind(found, counts, batch)
            if kind is None or found[2] % batch:
                break
            counts = {**counts, kind: found[2] // batch}
            kwargs = _finish(model, config, params, media_kw, counts, batch, seq, seed, device, variant)
            error = _run_error(model, kwargs)
        if error is not None:
            kwargs, error, variant = _retry(model, config, params, media_kw, counts, batch, seq, seed, device,
                                            kwargs, error, variant)
        if error is None:
            _CHOSEN[key] = (index, counts, variant)
            return kwargs
    if (key_unset := vision.required_media_token(model, params)) is not None:
        # a run failure: the pipeline then tries each tower on inputs of its own (inputs.towers), and says
        # this when that cannot be done either
        raise ModelRunFailed(
            f"{type(model).__name__} cannot run on any inputs: its config's `{key_unset}` is None, so its forward "
            f"cannot place the {_KIND_WORDS[key_unset.split('_')[0]]} in the prompt; set `config.{key_unset}` to its "
            f"processor's {key_unset.split('_')[0]} token id (checkpoints saved by recent transformers set it)")
    if built is None:  # no layout even reached the model: the first, so the pipeline's error says why
        built = _finish(model, config, params, combos[0], {}, batch, seq, seed, device)
    _CHOSEN[key] = (first, first_counts, frozenset())  # none ran: later calls (probe, calibration) need not retry
    return built


def _retry(model: nn.Module, config: Any, params: dict[str, Any], media_kw: Layout, counts: dict[str, int],
           batch: int, seq: int, seed: int, device: torch.device, kwargs: dict[str, Any], error: Exception,
           variant: frozenset[str]) -> tuple[dict[str, Any], Exception | None, frozenset[str]]:
    """A candidate that did not run, built again the way the model's own error points to:

    - its check that the prompt's audio tokens match the encoder's rows fails although their counts
      agree, and a feature mask came along: the mask is over the encoder's output rows, boolean, as
      the model indexes its features with it (Granite Speech's ``input_features_mask``, which its
      processor makes one entry per projected audio token);
    - it reads a config key this config does not set (Qwen2.5-Omni's ``vision_start_token_id``, which
      checkpoints set and 5.24's default config lacks) on the path the prompt's ``attention_mask``
      opens (its 3-D rope index): the mask, all ones, is left out, and the positions are the plain ones.

    ``(kwargs, error, variant)``: the inputs, None or what they raised, and the variant (``variant`` plus
    what was kept) they were built with."""
    tries = []
    found = _mismatch(error)
    masks = [m for m in _FEATURE_MASKS if m in kwargs]
    if found and found[0] == "audio" and masks and counts.get("audio") and MASK_OVER_ROWS not in variant:
        tries.append(MASK_OVER_ROWS)
    if isinstance(error, AttributeError) and "Config' object has no attribute" in str(error) and \
            "attention_mask" in kwargs and counts and NO_PROMPT_MASK not in variant:
        tries.append(NO_PROMPT_MASK)
    for extra in tries:
        trial = _finish(model, config, params, media_kw, counts, batch, seq, seed, device, variant | {extra})
        trial_error = _run_error(model, trial)
        if trial_error is None or type(trial_error) is not type(error) or str(trial_error) != str(error):
            variant, kwargs, error = variant | {extra}, trial, trial_error  # it moved on: keep it
        if error is None:
            break
    return kwargs, error, variant


_KIND_WORDS = {"image": "images", "video": "video frames", "audio": "audio"}


def _required(params: dict[str, inspect.Parameter]) -> list[str]:
    return [n for n, p in params.items() if p.default is inspect.Parameter.empty and n != "self"
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]


def _side_ids(name: str) -> str | None:
    """``qformer`` for ``qformer_input_ids``: token ids for a side model whose config is ``<side>_config``
    (InstructBLIP's Q-Former reads the prompt too)."""
    side = name.removesuffix("_input_ids")
    return side if side != name and side not in ("decoder", "") else None


def _encoder_needs(model: nn.Module) -> set[str]:
    """The arguments the model's own media encoders (``get_image_features``, ``get_audio_features``, on it or
    its base model) require, though its forward takes them as optional (Apertus 1.5's ``padding_mask``)."""
    out: set[str] = set()
    for owner in (model, getattr(model, "base_model", None)):
        for kind in ("image", "audio"):
            fn = getattr(owner, f"get_{kind}_features", None)
            try:
                out.update(_required(dict(inspect.signature(fn).parameters)) if callable(fn) else ())
            except (TypeError, ValueError):
                continue
    return out


def _combinations(config: Any, params: dict[str, Any], batch: int, seed: int, dtype: torch.dtype,
                  needs: set[str] = frozenset()) -> Iterator[Layout]:
    """Every combination of one layout per media modality the forward takes (images, audio
    features, raw audio, time series), in order of preference; ``{}`` for a text-only model. ``needs``:
    what the model's media encoders require (:func:`_encoder_needs`)."""
    gen = torch.Generator().manual_seed(seed + 1)  # media draws apart from the text ids' generator
    groups: list[list[Layout]] = []
    if "pixel_values" in params and not media.tower_unset(config, "vision"):
        common = list(media.image_layouts(config, params, batch, gen, dtype))
        images = [*vision.tiled_layouts(config, params, batch, gen, dtype), *common,
                  *vision.tile_mask_variants(common),
                  *vision.patch_layouts(config, params, batch, gen, dtype),
                  *vision.positioned_patch_layouts(config, params, batch, gen, dtype),
                  *vision.packed_layouts(config, params, batch, gen, dtype),
                  *vision.channels_last_patch_layouts(config, params, batch, gen, dtype),
                  *vision.pooled_crop_layouts(config, params, batch, gen, dtype),
                  *vision.flat_patch_layouts(config, params, batch, gen, dtype)]
        groups.append([vision.with_companions(layout, config, params, gen, dtype) for layout in images])
    elif towers := list(vision.tower_layouts(config, params, batch, gen, dtype)):
        groups.append(towers)
    audio = not media.tower_unset(config, "audio")
    if "input_features" in params and audio:
        masks = [m for m in ("feature_attention_mask", "input_features_mask") if m in params]
        groups.append([media.with_sample_mask(layout, params, from_features=True)
                       for layout in media.feature_layouts(config, batch, gen, dtype, masks)])
    if "input_values" in params and audio:
        groups.append([media.with_sample_mask(layout, params, required="padding_mask" in needs)
                       for layout in media.value_layouts(config, batch, gen, dtype)])
    if "past_values" in params:
        groups.append(list(media.series_layouts(config, params, batch, gen, dtype)))
    if not groups:
        if "input_ids" in params:
            yield {}
        return
    for combo in itertools.product(*groups):
        merged: Layout = {}
        for part in combo:
            merged.update(part)
        yield merged


def _counts(model: nn.Module, config: Any, params: dict[str, Any], media_kw: Layout, batch: int) -> dict[str, int]:
    """Media tokens per sample for each modality whose tokens the prompt must hold."""
    counts: dict[str, int] = {}
    if "input_ids" not in params:
        return counts
    samples = batch
    for kind, present in (("image", "pixel_values" in media_kw), ("audio", "input_features" in media_kw
                                                                    or "input_values" in media_kw)):
        if present and _media_token(config, kind, MEDIA_TOKEN) is not None:
            with _trial(model):
                n = _feature_count(model, kind, media_kw, samples)
            counts[kind] = 1 if n is None else n  # None: one token, which a legacy merge expands
    return counts


_FEATURE_MASKS = ("feature_attention_mask", "input_features_mask")


def _finish(model: nn.Module, config: Any, params: dict[str, Any], media_kw: Layout, counts: dict[str, int],
            batch: int, seq: int, seed: int, device: torch.device, variant: frozenset[str] = frozenset()
            ) -> dict[str, Any]:
    """The media layout plus text ids (with the media tokens in the prompt), decoder ids and the
    flags the forward takes, on the model's device; ``variant`` as :func:`_retry` found it."""
    gen = torch.Generator().manual_seed(seed)
    inputs: dict[str, Any] = {}
    avoid = special_ids(config)
    rows = next((t.shape[0] for k, t in media_kw.items() if isinstance(t, torch.Tensor) and k in (
        "input_features", "input_values", "past_values")), batch)
    if "input_ids" in params:
        # a wrapper's text model may sit in `model_config` (FastSpeech2-Conformer with HiFi-GAN: the
        # acoustic model's vocabulary there, the vocoder's config beside it)
        tcfg = sub_config(config, "text", "encoder", "model")
        ids = text_ids(tcfg, rows, seq, gen, avoid)
        types = torch.zeros_like(ids)
        cut = ids.shape[1] // 2  # each modality's span after the one before, never inside it (omni rope indices)
        for code, kind in enumerate(("image", "audio"), start=1):
            n = counts.get(kind)
            token = _media_token(config, kind, MEDIA_TOKEN)
            if not n or token is None:
                continue
            start, end = _media_token(config, kind, MEDIA_START), _media_token(config, kind, MEDIA_END)
            span = [start] * (start is not None) + [token] * n + [end] * (end is not None)
            mid = torch.tensor(span, dtype=ids.dtype).expand(ids.shape[0], -1)
            kinds = torch.tensor([0] * (start is not None) + [code] * n + [0] * (end is not None)).expand_as(mid)
            ids = torch.cat([ids[:, :cut], mid, ids[:, cut:]], dim=1)
            types = torch.cat([types[:, :cut], kinds, types[:, cut:]], dim=1)
            cut += mid.shape[1]
        latents = cfg(config, "latent_query_num")
        if "image_embeds_position_mask" in params and "pixel_values" in media_kw and isinstance(latents, int):
            # Kosmos-2: the image's latent queries take the places this mask marks in the prompt
            place = torch.zeros(ids.shape[0], latents, dtype=ids.dtype)
            ids = torch.cat([ids[:, :1], place + ids[:, 1:2], ids[:, 1:]], dim=1)
            mask = torch.zeros_like(ids, dtype=torch.bool)
            mask[:, 1:1 + latents] = True
            inputs["image_embeds_position_mask"] = mask
        inputs["input_ids"] = ids
        for name in _required(params):  # side models' ids (InstructBLIP's Q-Former), over their own vocabulary
            if (side := _side_ids(name)) is not None:
                inputs[name] = text_ids(sub_config(config, side), rows, seq, gen, avoid)
        if counts and "attention_mask" in params and NO_PROMPT_MASK not in variant:
            inputs["attention_mask"] = torch.ones_like(ids)  # merging media into the prompt reads it (Qwen2-Audio)
        if counts and "mm_token_type_ids" in params:
            inputs["mm_token_type_ids"] = types
        elif counts.get("image") and "token_type_ids" in params:
            inputs["token_type_ids"] = (types == 1).long()
    inputs.update(media_kw)
    if MASK_OVER_ROWS in variant:
        for name in _FEATURE_MASKS:
            if name in inputs:
                inputs[name] = torch.ones(rows, counts["audio"], dtype=torch.bool)
    vision.complete(params, inputs)
    if "decoder_input_ids" in params and (getattr(config, "is_encoder_decoder", False) or "input_ids" not in params):
        dcfg = sub_config(config, "decoder")
        dec = text_ids(dcfg, rows, seq, gen, avoid)
        first = cfg(config, "decoder_start_token_id")
        if isinstance(first, int) and first >= 0:
            dec[:, 0] = first
        inputs["decoder_input_ids"] = dec
    dtype = model_dtype(model)
    inputs.update(structured.extra_inputs(config, params, inputs, rows, seq, gen, dtype))
    if inputs and "encoder_hidden_states" in params and has_cross_attention(model):
        # a decoder with cross-attention (BLIP's text decoder, BERT/GPT-2 with add_cross_attention): its
        # cross-attention blocks and their norms run only when given encoder states
        inputs["encoder_hidden_states"] = encoder_states(model, rows, max(2, seq // 2 + 1), gen)
    if "use_cache" in params:
        inputs["use_cache"] = False
    if "return_loss" in params:
        # no loss: normswap compares outputs; a config that asks for one by default (FLAVA pre-training's
        # return_loss=True) then demands labels no built input has (`codebook_pixel_values`)
        inputs["return_loss"] = False
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def has_cross_attention(model: nn.Module) -> bool:
    """True when a model that is not an encoder-decoder holds cross-attention blocks (they run only
    when ``encoder_hidden_states`` are given)."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    return any(_CROSS_ATTENTION.search(name) for name, _ in model.named_modules())


_CROSS_ATTENTION = re.compile(r"cross_?att|encoder_attn", re.IGNORECASE)


def encoder_states(model: nn.Module, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """Random ``encoder_hidden_states`` of the width the model's cross-attention takes."""
    config = model.config
    width = int(cfg(config, "encoder_hidden_size", "cross_attention_hidden_size", "hidden_size", "n_embd",
                    "d_model"))
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    t = torch.randn(batch, length, width, generator=gen)
    return t if p is None else t.to(p.device, p.dtype)


MODALITY = {"input_ids": "text", "pixel_values": "images", "pixel_values_videos": "video", "input_features": "audio",
            "input_values": "audio", "past_values": "time series", "decoder_input_ids": "decoder text",
            "hidden_states": "image patches", "query_embeds": "queries"}  # a vision tower or Q-Former alone


# metadata the report names next to the modalities: grids, sizes, pooling indices (Molmo 2), entities (LUKE)
DESCRIBED = ("_thw", "_sizes", "_grids", "_token_pooling", "entity_ids")


def describe(model: nn.Module, kwargs: dict[str, Any]) -> str:
    """One line for the report: what the built analysis inputs hold, and how they reach every tower
    (all modalities in one run of the whole model: each tower runs on its own modality's inputs)."""
    parts = []
    for name, value in kwargs.items():
        if not isinstance(value, torch.Tensor) or name not in MODALITY and not name.endswith(DESCRIBED):
            continue
        text = f"`{name}` {tuple(value.shape)}"
        if name == "input_ids":
            tokens = {kind: _media_token(model.config, kind, MEDIA_TOKEN) for kind in MEDIA_TOKEN}
            marks = [f"{int((value[0] == tok).sum())} {kind} tokens" for kind, tok in tokens.items()
                     if tok is not None and bool((value == tok).any())]
            text += f" ({', '.join(marks)} per sample)" if marks else ""
        parts.append(text)
    kinds = sorted({MODALITY[k] for k in kwargs if k in MODALITY} - {"decoder text"})
    how = (f"; {' + '.join(kinds)} in one run of the whole model, so each tower runs on inputs of its own modality"
           if len(kinds) > 1 else "")
    return "built from the config: " + ", ".join(parts) + how


# ------------------------------------------------------------------ pieces the per-tower route reuses
def media_layouts(model: nn.Module, batch: int = 2, seed: int = 0) -> list[Layout]:
    """Every media layout the builder would try for ``model`` (one per combination of modalities), in
    its order of preference: what :mod:`normswap.inputs.towers` hands each tower's feature method."""
    dtype = model_dtype(model)
    params = forward_params(model)
    if "input_features" in params:  # as hf_example_inputs: log-mel clips fix their own length
        batch = max(1, min(batch, AUDIO_FRAME_BUDGET // media.feature_frames(model.config)))
    return list(_combinations(model.config, params, batch, seed, dtype))


def text_inputs(model: nn.Module, batch: int = 2, seq: int = 8, seed: int = 0) -> dict[str, Any]:
    """The whole model's inputs with no media: text ids (decoder ids for an encoder-decoder) and the flags
    the forward takes, as :func:`hf_example_inputs` builds them around a media layout."""
    device = model_device(model)
    return _finish(model, model.config, forward_params(model), {}, {}, batch, seq, seed, device)


def run_error(model: nn.Module, kwargs: dict[str, Any]) -> Exception | None:
    """None when ``model`` runs on ``kwargs`` (a trial forward: eval, no grad, random state kept), else
    what it raised."""
    return _run_error(model, kwargs)


def trial(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """The context a trial forward of ``model`` runs in (see :func:`run_error`)."""
    return _trial(model)
