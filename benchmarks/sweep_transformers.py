"""Sweep every LayerNorm model type the installed transformers ships: build it tiny, convert it with no
inputs (as ``normswap convert`` does), and write the results table.

Which types: every ``model_type`` with a base class in ``MODEL_MAPPING_NAMES`` whose modeling code
(``transformers/models/<name>/modeling_*.py``) uses a LayerNorm (``nn.LayerNorm`` or a ``*LayerNorm``
class). For each, the base class and the main head class (the first of :data:`HEADS` that maps the
type), each built from the config class's defaults shrunk to tiny (:func:`tiny_config`: :func:`shrink`'s
2 layers, width 32, small vocab, image, audio and patch sizes, made self-consistent by
:func:`consistent`'s and :func:`derived_sizes`' rules, with fallbacks when that does not build), random
weights, float64, LayerNorm γ/β and biases randomised, eval mode. Per class:

- ``inputs``: whether :func:`normswap.inputs.hf_example_inputs` built inputs (or its error);
- ``patch``: ``normswap.patch(model)`` with no inputs, verification on (the CLI's call): ``ok`` or the
  one-line error, and the verdict counts;
- ``err``: the max relative output error of the exact norms (``mode="exact"``, approximate norms kept as
  LayerNorm) against the float64 original, at two input shapes (batch 1 x 5 tokens, batch 2 x 11);
- ``crash``: an exception that is not a :class:`normswap.NormswapError` (a bug, not a refusal);
- ``runs_on`` / ``runnable`` / ``not_run``: what ran the class (normswap's inputs, else the oracle's:
  :func:`oracle_inputs`, which is not normswap) or the error when nothing did; ``shrink: widths kept``
  when only the config with its own widths ran (:func:`build` ``widths=False``: the mild shrink).

The page's headline is the issue's measure: of the types some inputs can run, how many convert with no
inputs (:func:`runnable_totals`).

Each type runs in a worker process (``OMP_NUM_THREADS=1``) with a per-type time limit, so a hang or a
crash costs one row. ``--jobs`` runs that many workers side by side.

    # everything (every type, the JSON and the page; about 40 min with two free cores):
    PYTHONPATH=$PWD python benchmarks/sweep_transformers.py --write --jobs 2 \\
        --before benchmarks/transformers_sweep_before.json
    PYTHONPATH=$PWD python benchmarks/sweep_transformers.py --only vit,whisper   # a few rows, printed
    python benchmarks/sweep_transformers.py --render --write --before benchmarks/transformers_sweep_before.json

``--write`` writes docs/results/transformers-sweep.md and benchmarks/transformers_sweep.json.

An engine's option sets (rounds 61-62): ``--quantizer ENGINE`` passes ``quantizer=ENGINE`` to every ``normswap.patch``
call; each class records the model kind found (``kind``); ``--write`` then writes
``benchmarks/transformers_sweep_q62_<engine>.json`` (compact rows; round 61's rows merged in, each row's ``swept_on``
says which code swept it) and prints the comparison with the defaults' JSON, which ``--compare`` prints again from the
files:

    PYTHONPATH=$PWD python benchmarks/sweep_transformers.py --quantizer openvino-int8 --write --jobs 2
    python benchmarks/sweep_transformers.py --compare benchmarks/transformers_sweep.json \\
        --json benchmarks/transformers_sweep_q62_openvino-int8.json

The normswap swept is the one Python imports: ``PYTHONPATH=$PWD`` for this checkout,
``PYTHONPATH=/path/to/other/checkout`` for another (the before/after numbers), else the installed one;
each worker prints the path it imported into the JSON (``normswap``).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "results" / "transformers-sweep.md"
JSON = REPO / "benchmarks" / "transformers_sweep.json"
TYPE_LIMIT_S = 150  # per type, both classes: past this the worker is killed and the row says "timeout"
MAX_PARAMS = 30_000_000  # a "tiny" config still above this is not built (memory on a shared machine)
MAX_VOCAB = 65_536  # a tiny vocabulary kept larger than this (to fit a special id) is renumbered instead
EXACT_LIMIT = 1e-9
# a --quantizer sweep's JSON with --write (rounds 61 and 62, one file per engine); the defaults' JSON and page are
# left alone
QUANTIZER_JSON = "transformers_sweep_q62_{}.json"
# the page's hand-written sections start here: --write regenerates what is above and keeps this and what follows
KEEP = "<!-- hand-written below: sweep_transformers.py --write keeps this line and what follows -->"

# the main head class: the first of these mappings that holds the type (a class other than the base)
HEADS = ("IMAGE_TEXT_TO_TEXT", "MULTIMODAL_LM", "SPEECH_SEQ_2_SEQ", "SEQ_TO_SEQ_CAUSAL_LM", "CAUSAL_LM", "MASKED_LM",
         "CTC", "IMAGE_CLASSIFICATION", "AUDIO_CLASSIFICATION", "VIDEO_CLASSIFICATION", "OBJECT_DETECTION",
         "SEMANTIC_SEGMENTATION", "UNIVERSAL_SEGMENTATION", "INSTANCE_SEGMENTATION", "DEPTH_ESTIMATION",
         "TIME_SERIES_PREDICTION", "TIME_SERIES_CLASSIFICATION", "TEXT_TO_SPECTROGRAM", "TEXT_TO_WAVEFORM",
         "ZERO_SHOT_OBJECT_DETECTION", "ZERO_SHOT_IMAGE_CLASSIFICATION", "KEYPOINT_DETECTION", "MASK_GENERATION",
         "SEQUENCE_CLASSIFICATION", "PRETRAINING", "MASKED_IMAGE_MODELING", "IMAGE_TO_IMAGE", "BACKBONE")


def layernorm_types() -> list[str]:
    """Model types with a base class whose modeling code uses a LayerNorm."""
    import transformers
    from transformers.models.auto import configuration_auto as ca
    from transformers.models.auto import modeling_auto as ma

    root = Path(transformers.__file__).parent / "models"
    uses = set()
    for d in os.listdir(root):
        text = "".join(Path(f).read_text(encoding="utf-8", errors="ignore")
                       for f in glob.glob(str(root / d / "modeling_*.py")))
        if re.search(r"LayerNorm\b", text):  # nn.LayerNorm, a *LayerNorm class, or one imported
            uses.add(d)
    return sorted(t for t in ca.CONFIG_MAPPING_NAMES if t in ma.MODEL_MAPPING_NAMES
                  and ca.model_type_to_module_name(t) in uses)


def classes(model_type: str) -> list[str]:
    """The base class and the main head class names of ``model_type``."""
    from transformers.models.auto import modeling_auto as ma

    def first(v: object) -> str:
        return v[0] if isinstance(v, (tuple, list)) else v

    base = first(ma.MODEL_MAPPING_NAMES[model_type])
    out = [base]
    for head in HEADS:
        mapping = getattr(ma, f"MODEL_FOR_{head}_MAPPING_NAMES", {})
        if model_type in mapping and first(mapping[model_type]) != base:
            out.append(first(mapping[model_type]))
            break
    return out


# ------------------------------------------------------------------------------------------- tiny configs
WIDTH = {"hidden_size", "d_model", "n_embd", "embed_dim", "dim", "hidden_dim", "embedding_dim", "d_embed",
         "word_embed_proj_dim", "projection_dim", "encoder_hidden_size", "decoder_hidden_size", "text_embed_dim",
         "vision_embed_dim", "audio_embed_dim", "cross_attention_hidden_size", "encoder_embed_dim",
         "decoder_embed_dim", "n_embed", "model_dim", "d_latents", "latent_dim", "out_hidden_size", "output_dim",
         "cross_hidden_size", "unit_embed_dim"}
FFN = {"intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner", "mlp_dim",
       "decoder_intermediate_size", "encoder_intermediate_size", "dim_feedforward", "ffn_hidden_size",
       "speech_encoder_intermediate_size", "t2u_encoder_ffn_dim", "t2u_decoder_ffn_dim"}
LAYERS = {"num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
          "num_encoder_layers", "num_decoder_layers", "depth", "decoder_num_hidden_layers", "num_blocks",
          "decoder_depth", "encoder_depth", "num_decoder_blocks", "num_encoder_blocks", "num_self_attends_per_block",
          "num_global_layers"}
HEADS_ATTR = {"num_attention_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads",
              "num_heads", "decoder_num_attention_heads", "num_attention_heads_text", "decoder_num_heads",
              "encoder_num_heads", "cross_num_attention_heads"}
KV_HEADS = {"num_key_value_heads", "num_kv_heads", "n_head_kv", "cross_num_key_value_heads"}
# sizes defined as equal to a width or a feed-forward width although their names say neither (or say
# "not a width": codebook): a conv grouped per channel (Mimi's upsample_groups = hidden_size), a codec's
# codebook vectors (EnCodec's codebook_dim = hidden_size); :func:`_follow_widths` applies them
FOLLOWS_WIDTH = re.compile(r"(groups|codebook_dim|output_hidden_size)$")
TOKEN_ID = re.compile(r"_(token_)?(id|index)$")


def _special_ids(d: dict) -> list[int]:
    out = []
    for k, v in d.items():
        if TOKEN_ID.search(k) and isinstance(v, int) and v >= 0:
            out.append(v)
    return out


def all_special_ids(config: object) -> list[int]:
    """Every token id named anywhere in the config tree (an image token id at the top must fit the
    text config's vocabulary)."""
    from transformers import PretrainedConfig

    out = _special_ids(config.__dict__)
    for v in config.__dict__.values():
        if isinstance(v, PretrainedConfig):
            out += all_special_ids(v)
    return out


def modeling_source(config: object) -> str:
    """The text of the modeling code next to ``config``'s class (``modeling_*.py`` in its folder): what the
    model reads from its config, which the config itself may not hold."""
    import importlib

    module = importlib.import_module(type(config).__module__)
    folder = Path(module.__file__).parent
    if folder not in _SOURCES:
        _SOURCES[folder] = "".join(Path(f).read_text(encoding="utf-8", errors="ignore")
                                   for f in sorted(glob.glob(str(folder / "modeling_*.py"))))
    return _SOURCES[folder]


_SOURCES: dict[Path, str] = {}


def _unset_token_ids(config: object, ids: list[int]) -> None:
    """A multimodal model's config (one that sets a media token id) that lacks a media token id its modeling
    code reads (``self.config.vision_start_token_id``: Qwen2.5-Omni's thinker config does not define it, real
    checkpoints set it) gets a fresh id past every other, as ``image_token_id`` does when unset."""
    media = ("vision_", "image_", "video_", "audio_")
    if not any(TOKEN_ID.search(k) and k.startswith(media) and _int(v) for k, v in config.__dict__.items()):
        return
    read = set(re.findall(r"config\.(\w+_token_id)\b", modeling_source(config)))
    for name in sorted(read):  # hasattr: also a name the config maps to another (``image_token_id`` → ``_index``)
        if not hasattr(config, name) and name.startswith(media):
            config.__dict__[name] = max(ids + [127]) + 1
            ids.append(config.__dict__[name])


def shrink(config: object, depth: int = 0, ids: list[int] | None = None, images: bool = True,
           mild: bool = False, renumber: bool | int = False) -> None:
    """Shrink ``config`` (and its sub-configs) in place to a tiny model of the same architecture.
    ``images=False`` keeps image sizes (a config that fixes its image tokens, ``mm_tokens_per_image``);
    ``mild=True`` keeps every width, head count and image size (layers, experts and vocabularies only:
    the fallback for a config whose widths do not shrink together); ``renumber=True`` renumbers the
    special token ids into a small vocabulary (:func:`renumber_ids`; an int: only the ids from it up)."""
    from transformers import PretrainedConfig

    tree = _snapshot(config) if depth == 0 else None  # every sub-config's full-size attributes
    derived = _derived_widths(config) if depth == 0 else None  # widths the config classes compute
    if renumber and depth == 0:
        renumber_ids(config, 128 if renumber is True else renumber)
    ids = all_special_ids(config) if ids is None else ids
    images = images and "mm_tokens_per_image" not in config.__dict__
    d = config.__dict__
    if depth == 0:  # the config the model class is built from
        _unset_token_ids(config, ids)
    for k in ("image_token_id", "image_token_index"):  # unset in some defaults (BLIP-2), set in real checkpoints
        if k in d and d[k] is None and depth == 0:
            d[k] = max(ids + [127]) + 1
            ids.append(d[k])
    for k, v in list(d.items()):  # timm is not installed: a small transformers ResNet backbone instead
        if type(v).__name__ == "TimmBackboneConfig":
            import transformers as tf

            idx = [i for i in (getattr(v, "out_indices", None) or [1, 2, 3, 4]) if 1 <= i <= 4]
            d[k] = tf.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                                   out_indices=idx)
    if "prediction_length" in d and d["prediction_length"] is None:  # time-series configs leave it unset
        d["prediction_length"] = 8
        if d.get("context_length") is None:  # the decoder starts from the last label_length steps (Autoformer)
            d["context_length"] = max(8, d.get("label_length") or 0)
    before = dict(d)  # the full-size values: the consistency rules below map them to their tiny ones
    heads = next((d[k] for k in HEADS_ATTR if isinstance(d.get(k), int)), None)
    for k in list(d):
        v = d[k]
        if isinstance(v, PretrainedConfig):
            if depth < 4:
                shrink(v, depth + 1, ids, images, mild)
            continue
        if isinstance(v, bool) or k.startswith("_"):
            continue
        if mild and (k in WIDTH or k in FFN or k in HEADS_ATTR or k in KV_HEADS or k in ("head_dim", "image_size")):
            continue
        if k in LAYERS and isinstance(v, int) and v > 2:
            d[k] = 2
        elif k in HEADS_ATTR and isinstance(v, int) and v > 4:
            d[k] = 4
        elif k in KV_HEADS and isinstance(v, int) and v > 2:
            d[k] = 2
        elif k in WIDTH and isinstance(v, int) and v > 64:
            d[k] = 32 if heads is None or 32 % min(4, heads) == 0 else 64
        elif k in FFN and isinstance(v, int) and v > 64:
            d[k] = 64
        elif k == "head_dim" and isinstance(v, int) and v > 16:
            d[k] = 8
        elif k in ("vocab_size", "n_vocab", "text_vocab_size") and isinstance(v, int) and v > 128:
            d[k] = max(128, 1 + max(ids + [0]))
        elif k in ("max_position_embeddings", "n_positions", "max_source_positions", "max_target_positions",
                   "max_seq_len", "context_length") and isinstance(v, int) and v > 4096:
            d[k] = 4096
        elif k == "image_size" and images and isinstance(v, int) and v > 64 and (v % 2 == 0):
            patch = d.get("patch_size")
            # 4 patches a side; also an image that is not a whole number of patches (Aya Vision's default 384
            # at patch 14: 27 patches a side, which its 2x pixel shuffle cannot fold)
            if isinstance(patch, int) and patch > 0 and v // patch > 4:
                d[k] = patch * 4 if patch * 4 >= 32 else 32 - 32 % patch
        elif k == "num_labels" and isinstance(v, int) and v > 32:
            d[k] = 32
        elif k == "num_mel_bins" and isinstance(v, int) and v > 40:
            pass
        elif k in ("depths",) and isinstance(v, (list, tuple)) and all(isinstance(x, int) for x in v):
            d[k] = type(v)(min(x, 1) for x in v)
        elif k == "blocks_per_stage" and isinstance(v, list) and all(_int(x) for x in v):
            # two blocks a stage: a stage's first block pools (Hiera), its global-attention block is another
            d[k] = [min(x, 2) for x in v]
        elif (k == "image_size" and images and isinstance(v, list) and len(v) == 2 and all(_int(x) for x in v)
              and "blocks_per_stage" in d):
            d[k] = [min(x, TINY_STAGED_IMAGE) for x in v]  # [height, width]: a staged (Hiera) backbone's input
    # keep every special token id inside the (maybe shrunk) vocabulary
    vocab = d.get("vocab_size")
    if isinstance(vocab, int) and vocab > 0:
        if ids and max(ids) >= vocab:
            d["vocab_size"] = max(ids) + 1
    hidden, heads_now = d.get("hidden_size"), next((d[k] for k in HEADS_ATTR if isinstance(d.get(k), int)), None)
    head_dim = d.get("head_dim") or (hidden // heads_now if isinstance(hidden, int) and heads_now else None)
    for k in ("rope_parameters", "rope_scaling"):  # multimodal RoPE sections follow the head width
        rope = d.get(k)
        # multimodal RoPE: by the type's name, or its modeling code reads sections (GLM-4V: "glm4v_text")
        multimodal_rope = (re.search(r"vl|omni", str(getattr(config, "model_type", "")))
                           or "mrope_section" in modeling_source(config))
        # one set of parameters (not per layer type, not left empty for _missing_defaults' per-type defaults)
        flat = isinstance(rope, dict) and bool(rope) and not any(isinstance(x, dict) for x in rope.values())
        if flat and "mrope_section" not in rope and multimodal_rope:
            rope["mrope_section"] = [16, 24, 24]  # the modeling code's default when the config has none
        if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list) and isinstance(head_dim, int):
            # the rotary half-width: a partial rotary factor (GLM-4V-MoE's 0.5) rotates that share of a head
            partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0
            half, n = int(head_dim * partial) // 2, len(rope["mrope_section"])
            rope["mrope_section"] = [half - (n - 1) * (half // n)] + [half // n] * (n - 1)
    vision = d.get("vision_config")
    if isinstance(d.get("image_grid_pinpoints"), list) and isinstance(getattr(vision, "image_size", None), int):
        side = vision.image_size  # any-resolution grids in units of the (shrunk) tile size
        d["image_grid_pinpoints"] = [[side, side], [side, 2 * side], [2 * side, side]]
    consistent(config, before, mild)
    derived_sizes(config, before, mild)
    # a multimodal RoPE whose axes split the rotated channels in code (no ``mrope_section`` in the config) keeps
    # at least MIN_ROTARY rotated channels a head under a partial rotary factor (NeoMME's full-attention layers
    # rotate a quarter of each head over two interleaved axes, row and column: at head width 8 that is 2
    # channels, one frequency, and the column axis gets none): the head width grows to the smallest multiple of
    # HEAD_DIM that rotates that many under every layer type's factor
    sets = _rope_sets(d.get("rope_parameters"))
    factors = [f for p in sets if isinstance(f := p.get("partial_rotary_factor"), float) and 0 < f < 1]
    code_sections = not any("mrope_section" in p for p in sets) and "mrope_section" in modeling_source(config)
    if factors and code_sections and _int(d.get("head_dim")) and not mild \
            and int(d["head_dim"] * min(factors)) < MIN_ROTARY:
        d["head_dim"] = next(h for h in range(HEAD_DIM, 257, HEAD_DIM) if int(h * min(factors)) >= MIN_ROTARY)
    if tree is not None and not mild:
        _follow_widths_across(tree)
        _follow_stage_widths(tree)
        _follow_feature_sizes(tree)
        _follow_derived_widths(tree, derived)
    if tree is not None:
        _read_out_layers(tree)
        _token_offsets(config)
    for k in ("layer_types", "block_types", "layers_block_type"):  # per-layer lists follow the layer count
        v = d.get(k)
        n = d.get("num_hidden_layers")
        if isinstance(v, list) and isinstance(n, int) and len(v) > n:
            d[k] = v[:n]
        elif isinstance(v, list) and n is None and len(v) > 2 and all(isinstance(x, str) for x in v) \
                and not any(_int(d.get(x)) for x in LAYERS):
            # the list is the depth (Nemotron-H inside NeMo SpeechLM: 52 layers, 23 of them Mamba mixers on the
            # reference scan, 15 s a forward): the first layer of each kind, at least 2 (as the layer-count rule)
            first: dict[str, int] = {}
            for i, kind in enumerate(v):
                first.setdefault(kind, i)
            keep = sorted(set(sorted(first.values())[:4]) | {0, 1})
            d[k] = [v[i] for i in keep]


# ------------------------------------------------------------------ self-consistent tiny configs (rules)
# shrink() above cuts each size it knows by name; these rules then make every other attribute agree with
# the cut ones, so the tiny model runs with its own sizes (a size left full-width, or cut on its own,
# builds a model whose layers disagree: "size of tensor a (32) must match … (4)").
EXPERTS = {"num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "n_experts",
           "zero_expert_num", "num_experts_total"}
EXPERTS_PER_TOKEN = {"num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_top_k", "moe_k",
                     "n_activated_experts", "num_selected_experts"}
SHARED_EXPERTS = {"n_shared_experts", "num_shared_experts", "moe_num_shared_experts"}
EXPERT_GROUPS = {"n_group", "num_expert_group", "topk_group"}  # group-limited routing: one group of 4
FFN_LIKE = re.compile(r"(intermediate|ffn|feed_forward|mlp).*(size|dim)$")  # moe_intermediate_size, …
WIDTH_LIKE = re.compile(r"(size|dim|channel|width|hidden|embed)s?$")
NOT_WIDTH = re.compile(r"vocab|position|patch|image|window|kernel|stride|chunk|sampl|max_|min_|token|length|"
                       r"^num_|^n_|rate|frame|seq|codebook|bins|spatial|temporal|pool|bucket|cache|batch|"
                       r"label|state|conv|rank|head")
VOCAB_LIKE = re.compile(r"vocab(_size)?$|vocab_size_|^codebook_size$")
MAMBA_HEADS = ("mamba_n_heads", "n_mamba_heads")
MAMBA_HEAD_DIM = ("mamba_d_head", "mamba_headdim", "mamba_head_dim")
MAMBA_GROUPS = ("mamba_n_groups", "mamba_ngroups", "n_groups")
HEAD_DIM = 8  # shrink()'s head width
TINY_STAGED_IMAGE = 128  # a staged backbone's [height, width] (Hiera: stride 4, then 3 poolings → 4 x 4 at the end)
LORA_RANK = 16  # low-rank projections (MLA's q/kv/o LoRA ranks, …)
# lists of layers whose hidden states are read out (concatenated, stacked, fed to a projector): their
# length is part of the architecture, unlike a list of the layers of one kind (``moe_layers``)
# (also one layer a module is inserted after: MiniCPM-V's ``insert_layer_id``, where its merger runs)
READ_OUT = re.compile(r"(feature_layers?|intermediate_\w*ind(ices|exes)|deepstack_\w*indexes|hidden_state_indices|"
                      r"_layer_(id|idx|index))$")
MAX_READ_OUT_DEPTH = 6
STRIDES = re.compile(r"^(patch_sizes|strides|downsampling_ratios|conv_strides?)$")  # one stride a layer
KINDS = ("layer_types", "block_types", "layers_block_type", "layers_type", "attn_type_list", "hybrid_layer_types")
# (names, cut above, cut to): an alias of a standard size is cut as the standard name; MoE sizes
ALIAS_CAPS = ((WIDTH, 64, 32), (FFN, 64, 64), (LAYERS, 2, 2), (HEADS_ATTR, 4, 4), (KV_HEADS, 2, 2))
MOE_CAPS = ((EXPERTS, 4, 4), (EXPERTS_PER_TOKEN, 2, 2), (SHARED_EXPERTS, 1, 1), (EXPERT_GROUPS, 1, 1))


MIN_ROTARY = 4  # rotated channels a head at least: two frequency pairs (one per axis of a 2-D M-RoPE)


def _rope_sets(rope: object) -> list[dict]:
    """The RoPE parameter sets of a ``rope_parameters`` value: itself when flat, else its per-layer-type dicts."""
    if not isinstance(rope, dict):
        return []
    nested = [v for v in rope.values() if isinstance(v, dict)]
    return nested or [rope]


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def capped(name: str, value: int, caps: tuple[tuple[set[str], int, int], ...]) -> int:
    """``value`` cut to the first ``(names, above, to)`` of ``caps`` whose names hold ``name`` and
    whose threshold it passes, else kept."""
    return next((to for names, above, to in caps if name in names and value > above), value)


def renumber_ids(config: object, above: int = 128) -> None:
    """Special token ids from ``above`` up, anywhere in the config tree, renumbered in their order past the
    largest id below it (128, 129, … for the default), equal ids staying equal: a default config whose image
    token is id 200,093 otherwise keeps a 200,094-row embedding (and head) in its tiny model."""
    from transformers import PretrainedConfig

    refs: list[tuple[dict, str]] = []

    def walk(c: object) -> None:
        for k, v in c.__dict__.items():
            if isinstance(v, PretrainedConfig):
                walk(v)
            elif TOKEN_ID.search(k) and (_int(v) or isinstance(v, list) and v and all(_int(x) for x in v)):
                refs.append((c.__dict__, k))

    walk(config)
    every = {x for d, k in refs for x in (d[k] if isinstance(d[k], list) else [d[k]])}
    start = max([x for x in every if x < above] + [127]) + 1
    new = {x: start + i for i, x in enumerate(sorted(x for x in every if x >= above))}
    for d, k in refs:
        d[k] = [new.get(x, x) for x in d[k]] if isinstance(d[k], list) else new.get(d[k], d[k])


def consistent(config: object, before: dict, mild: bool = False) -> None:
    """Make the attributes ``shrink`` did not cut by name agree with those it cut (``before``: the
    config's full-size attributes). Each rule is general: it applies to any config with such names.
    ``mild``: widths are kept, so only the rules that do not touch a width run."""
    d = config.__dict__
    if not mild:
        _aliases(config, d)
        _follow_widths(d, before)
        _kv_heads(d, before)
        _kv_head_counts(d, before)
    _moe(d)
    if not mild:
        _head_dims(d, before)
        _mamba(d, before)
        _staged_heads(d, before)
        _windows(d)
    _queries(d)
    _missing_defaults(d)
    _vocabularies(d)
    _per_layer_lists(d, before, _read_by_properties(config))


def _snapshot(config: object) -> list[tuple[dict, dict]]:
    """(attributes, a copy of them) for ``config`` and every sub-config below it."""
    from transformers import PretrainedConfig

    out = [(config.__dict__, dict(config.__dict__))]
    for v in config.__dict__.values():
        if isinstance(v, PretrainedConfig):
            out += _snapshot(v)
    return out


def _follow_widths_across(tree: list[tuple[dict, dict]]) -> None:
    """A width named in one sub-config after another's (a vision config's ``projector_output_dim`` or
    ``text_hidden_size`` is the text model's hidden size) follows that one's cut: every width-named int
    left at a full-size width that some config of the tree cut takes its tiny value. So does one that
    :func:`_follow_widths` took for a multiple of its own config's hidden size when its full-size value is
    exactly another config's width (SAM-HQ's mask decoder ``vit_dim``: the vision tower's 768, not 3 x its
    own 256)."""
    cut: dict[int, int] = {}
    for d, before in tree:
        for k in sorted(WIDTH):
            if _int(before.get(k)) and _int(d.get(k)) and d[k] != before[k]:
                cut.setdefault(before[k], d[k])
    for d, before in tree:
        # random Fourier position features, sine and cosine of each: half the width they are added to (SAM's
        # ``num_pos_feats`` 128 in the vision config, for the prompt encoder's and mask decoder's 256)
        feats = d.get("num_pos_feats")
        if _int(feats) and feats == before.get("num_pos_feats") and 2 * feats in cut:
            d["num_pos_feats"] = cut[2 * feats] // 2
        own = {before[k] for k in WIDTH if _int(before.get(k)) and _int(d.get(k)) and d[k] != before[k]}
        for k, v in list(d.items()):
            # a list of channel widths ending at the width another tower reads (Unlimited-OCR's SAM
            # `downsample_channels` (512, 1024) feeding its 1024-wide CLIP encoder): the last one follows
            if (isinstance(v, (list, tuple)) and v and all(_int(x) for x in v) and v == before.get(k)
                    and v[-1] in cut and k.endswith("_channels")):
                d[k] = type(v)([*v[:-1], cut[v[-1]]])
            if not (_int(v) and before.get(k) in cut and WIDTH_LIKE.search(k) and not NOT_WIDTH.search(k)
                    and not k.startswith("_")):
                continue
            full = before[k]
            if v == full or (k not in WIDTH and not FFN_LIKE.search(k) and full not in own
                             and _int(before.get("hidden_size")) and full % before["hidden_size"] == 0
                             and v == full // before["hidden_size"] * d.get("hidden_size", 0)):
                d[k] = cut[full]
    # `<kind>_hidden_size` in one sub-config is the `<kind>_config`'s hidden size (Molmo2's adapter
    # `text_hidden_size`; its default config itself has 3584 there and 4096 in the text config)
    root = tree[0][0]
    for d, before in tree:
        for k, v in list(d.items()):
            sub = root.get(f"{k.removesuffix('_hidden_size')}_config") if k.endswith("_hidden_size") else None
            size = getattr(sub, "hidden_size", None)
            if _int(v) and v == before.get(k) and sub is not None and sub.__dict__ is not d and _int(size) \
                    and v != size:
                d[k] = size
    # an adapter's or projector's output width that was the text model's full hidden size writes into the text
    # stream (dots.note's audio `adapter_out_dim`, 5120, which the rules within its config took for 4 x its
    # own 1280): it follows the text width
    text = root.get("text_config")
    text_before = next((b for d, b in tree if text is not None and d is text.__dict__), None)
    if text_before is not None and _int(text_before.get("hidden_size")) and _int(text.hidden_size):
        for d, before in tree:
            for k, v in list(d.items()):
                if (d is not text.__dict__ and d is not root and "out" in k and WIDTH_LIKE.search(k)
                        and _int(v) and before.get(k) == text_before["hidden_size"] != before.get("hidden_size")):
                    d[k] = text.hidden_size


def _follow_stage_widths(tree: list[tuple[dict, dict]]) -> None:
    """Staged backbones that list their widths per stage (SAM 2's Hiera: ``embed_dim_per_stage`` 96, 192,
    384, 768 from ``hidden_size`` 96) scale the list with the cut hidden size, heads per stage at most
    the stage's width; lists elsewhere in the tree naming those widths (the neck's
    ``backbone_channel_list``) follow; a global-attention block becomes the last block of the stage it was
    in (at most two a stage: :func:`shrink` cut ``blocks_per_stage``; the first one pools), and
    feature-map sizes listed per level (``backbone_feature_sizes``) follow the tiny image at the
    backbone's strides."""
    cut: dict[int, int] = {}
    for d, before in tree:
        dims, hidden = before.get("embed_dim_per_stage"), before.get("hidden_size")
        if not (isinstance(dims, list) and dims and all(_int(x) for x in dims) and _int(hidden)
                and _int(d.get("hidden_size")) and d["hidden_size"] != hidden and dims[0] == hidden):
            continue
        d["embed_dim_per_stage"] = [x * d["hidden_size"] // hidden for x in dims]
        cut.update(zip(dims, d["embed_dim_per_stage"], strict=True))
        heads = d.get("num_attention_heads_per_stage")
        if isinstance(heads, list) and len(heads) == len(dims):
            d["num_attention_heads_per_stage"] = [max(h for h in range(1, max(1, n) + 1) if w % h == 0)
                                                  for n, w in zip(heads, d["embed_dim_per_stage"], strict=True)]
        blocks, glob = before.get("blocks_per_stage"), d.get("global_attention_blocks")
        if isinstance(blocks, list) and isinstance(glob, list) and d.get("blocks_per_stage") != blocks:
            ends = [sum(blocks[: i + 1]) for i in range(len(blocks))]
            tiny_ends = [sum(d["blocks_per_stage"][: i + 1]) for i in range(len(blocks))]
            d["global_attention_blocks"] = sorted({tiny_ends[next(i for i, e in enumerate(ends) if b < e)] - 1
                                                   for b in glob if b < ends[-1]})
    if not cut:
        return
    for d, before in tree:
        for k, v in list(d.items()):
            if (isinstance(v, list) and v and v == before.get(k) and all(_int(x) and x in cut for x in v)
                    and re.search(r"channel|dim|width|hidden", k)):
                d[k] = [cut[x] for x in v]
        feats, side = d.get("backbone_feature_sizes"), next(
            (c.get("image_size") for c, _ in tree if isinstance(c.get("embed_dim_per_stage"), list)), None)
        full_side = next((b.get("image_size") for c, b in tree if isinstance(c.get("embed_dim_per_stage"), list)), None)
        if (isinstance(feats, list) and isinstance(side, list) and isinstance(full_side, list) and side != full_side
                and all(isinstance(f, list) and len(f) == 2 for f in feats)):
            d["backbone_feature_sizes"] = [[f[0] * side[0] // full_side[0], f[1] * side[1] // full_side[1]]
                                           for f in feats]


def _derived_widths(config: object) -> list[tuple[object, str, int]]:
    """``(config, name, full-size value)`` for each width of :data:`WIDTH` that a config of the tree computes
    (a property of its class, not an attribute: X-Codec's ``hidden_size`` is its acoustic plus its semantic
    model's), read before the shrink."""
    from transformers import PretrainedConfig

    out = [(config, k, getattr(config, k)) for k in sorted(WIDTH)
           if isinstance(getattr(type(config), k, None), property) and _int(getattr(config, k, None))]
    for v in config.__dict__.values():
        if isinstance(v, PretrainedConfig):
            out += _derived_widths(v)
    return out


def _follow_derived_widths(tree: list[tuple[dict, dict]], derived: list[tuple[object, str, int]]) -> None:
    """A size defined as equal to a computed width (:func:`_derived_widths`; X-Codec's ``codebook_dim`` 1024,
    its ``hidden_size`` 256 + 768, read by the quantizer on the fused stream) follows that width once the
    shrink cut its parts (→ 32 + 32 = 64), where the size is named as a width or as one that follows a width
    (:data:`FOLLOWS_WIDTH`) and was left at its full value."""
    for config, name, full in derived:
        tiny = getattr(config, name, None)
        if not _int(tiny) or tiny == full:
            continue
        for d, before in tree:
            for k, v in list(d.items()):
                if (_int(v) and v == full == before.get(k) and not k.startswith("_")
                        and (FOLLOWS_WIDTH.search(k) or WIDTH_LIKE.search(k) and not NOT_WIDTH.search(k))):
                    d[k] = tiny


def _follow_feature_sizes(tree: list[tuple[dict, dict]]) -> None:
    """Feature-map sizes listed per level as ``[height, width]`` pairs (``backbone_feature_sizes``: SAM 3
    tracker's 288, 144 and 72 for its 1008-pixel image at patch 14 and scales 4, 2, 1) follow the image the
    shrink cut, in proportion: when every image size cut anywhere in the tree was cut by one factor (1008 →
    56: 288 → 16, 144 → 8, 72 → 4) and each size stays whole. A list :func:`_follow_stage_widths` already
    moved (SAM 2's Hiera) is left to it."""
    ratios = set()
    for d, before in tree:
        for k in ("image_size", "pretrain_image_size"):
            full, tiny = before.get(k), d.get(k)
            if _int(full) and _int(tiny) and tiny != full:
                ratios.add((full, tiny))
            elif isinstance(full, (list, tuple)) and isinstance(tiny, (list, tuple)) and list(full) != list(tiny) \
                    and len(full) == 2 and all(_int(x) for x in (*full, *tiny)):
                ratios |= set(zip(full, tiny, strict=True))
    scales = {tiny / full for full, tiny in ratios}
    if len(scales) != 1:
        return
    full, tiny = next(iter(ratios))
    for d, before in tree:
        for k, v in list(d.items()):
            if not (k.endswith("feature_sizes") and isinstance(v, list) and v == before.get(k) and v
                    and all(isinstance(f, (list, tuple)) and f and all(_int(x) for x in f) for f in v)):
                continue
            if all(x * tiny % full == 0 for f in v for x in f):
                d[k] = [type(f)(x * tiny // full for x in f) for f in v]


def _token_offsets(config: object) -> None:
    """Blocks of media codes placed in the text vocabulary at ``<kind>_token_offset`` (Apertus 1.5's image and
    audio tokenizers' codes, at 131,272 and 262,344 of 266,752 ids) follow the tiny vocabulary: each block, in
    the order of its offset, starts after the one before (the first after the text vocabulary and every special
    id) and is as long as its tower's ``codebook_size``; the text vocabulary grows to hold them."""
    d = config.__dict__
    offsets = sorted((v, k) for k, v in d.items() if k.endswith("_token_offset") and _int(v))
    text = d.get("text_config") if _int(getattr(d.get("text_config"), "vocab_size", None)) else config
    vocab = getattr(text, "vocab_size", None)
    if not offsets or not _int(vocab) or offsets[0][0] < vocab:
        return
    start = max([vocab - 1, *all_special_ids(config)]) + 1
    for _, k in offsets:
        d[k] = start
        start += int(getattr(d.get(f"{k.removesuffix('_token_offset')}_config"), "codebook_size", None) or 128)
    text.vocab_size = start


def _tower(tree: list[tuple[dict, dict]], d: dict, name: str) -> tuple[dict, dict, str] | None:
    """The config whose layers ``d[name]`` indexes, its full-size attributes and its layer-count key:
    ``d`` itself when its layers were cut, else the sub-config the name starts with (``vision_feature_layer``
    → ``vision_config``), found in ``d`` or in the root config (Molmo2's adapter reads the vision tower)."""
    from transformers import PretrainedConfig

    def depth_key(c: dict, before: dict) -> str | None:
        order = ("num_hidden_layers", "depth", "num_layers", "n_layer", "n_layers", *sorted(LAYERS))  # main stack 1st
        return next((k for k in order if _int(before.get(k)) and _int(c.get(k)) and c[k] < before[k]), None)

    befores = {id(c): before for c, before in tree}
    if (key := depth_key(d, befores[id(d)])) is not None:
        return d, befores[id(d)], key
    prefix = name.split("_")[0]
    for holder in (d, tree[0][0]):
        sub = holder.get(f"{prefix}_config")
        if isinstance(sub, PretrainedConfig) and id(sub.__dict__) in befores:
            key = depth_key(sub.__dict__, befores[id(sub.__dict__)])
            return (sub.__dict__, befores[id(sub.__dict__)], key) if key else None
    return None


def _read_out_layers(tree: list[tuple[dict, dict]]) -> None:
    """Hidden states read out at listed layers (Mllama's ``intermediate_layers_indices``, VipLLaVA's
    ``vision_feature_layer`` list, Qwen3-VL's ``deepstack_visual_indexes``; in the config itself or indexing a
    sub-config's layers) keep their number, each renumbered into the tiny depth in the same order (the
    projector reading them is as wide as their count); the tower keeps as many layers as distinct read-outs
    (at most :data:`MAX_READ_OUT_DEPTH`); a width that was the hidden size x the number of read-outs
    (Mllama's ``vision_output_dim``) stays so. Indices already valid in the tiny depth stay as they are."""
    for d, _ in tree:
        for k, v in list(d.items()):
            if k.startswith("_") or not READ_OUT.search(k):
                continue
            ints = isinstance(v, (list, tuple)) and v and all(_int(x) for x in v)
            idx = [v] if _int(v) else list(v) if ints else None
            found = _tower(tree, d, k) if idx else None
            if found is None:
                continue
            tower, before, key = found
            old, new = before[key], tower[key]
            if len(set(idx)) == len(idx) and all(-new <= i < new for i in idx):
                continue
            positions = [i if i >= 0 else old + 1 + i for i in idx]  # negative: counted from the last hidden state
            distinct = sorted(set(positions))
            per_layer = any(isinstance(x, list) and len(x) == old for n, x in before.items() if not n.startswith("_"))
            depth = new if per_layer else max(new, min(len(distinct), MAX_READ_OUT_DEPTH))
            tower[key] = depth
            out = [max(0, depth - len(distinct) + distinct.index(p)) for p in positions]  # the last layers, in order
            d[k] = out[0] if _int(v) else type(v)(out)
            hidden_before, hidden = before.get("hidden_size"), tower.get("hidden_size")
            if _int(hidden_before) and _int(hidden) and hidden != hidden_before:
                for c in (d, tower):
                    for w, x in list(c.items()):
                        if (len(idx) > 1 and _int(x) and WIDTH_LIKE.search(w) and not NOT_WIDTH.search(w)
                                and x % hidden_before == 0 and x // hidden_before in (len(idx), len(idx) + 1)):
                            c[w] = x // hidden_before * hidden


def _aliases(config: object, d: dict) -> None:
    """Sizes stored under the config's own name for a standard one (``attribute_map``: XLM's ``emb_dim``
    is its ``hidden_size``) are cut as the standard name would be."""
    for alias, real in (getattr(config, "attribute_map", None) or {}).items():
        v = d.get(real)
        if not _int(v) or real in WIDTH | FFN | LAYERS | HEADS_ATTR | KV_HEADS:
            continue
        if real == "num_stages" and alias in LAYERS:  # stages: their lists (depths …) hold the count
            continue
        d[real] = capped(alias, v, ALIAS_CAPS)


def _follow_widths(d: dict, before: dict) -> None:
    """Every width-named int attribute that had the same full-size value as a width shrink() cut (the
    hidden size under another name: ``cross_hidden_size``, ``emb_dim``, ``d_latents`` …) takes the same
    tiny value; every feed-forward width (``moe_intermediate_size``, ``expert_ffn_hidden_size`` …) → 64;
    a size defined as equal to a width or feed-forward width under another kind of name
    (:data:`FOLLOWS_WIDTH`: per-channel conv groups, codebook vectors) takes that one's tiny value."""
    cut = {before[k]: d[k] for k in WIDTH if _int(before.get(k)) and _int(d.get(k)) and d[k] != before[k]}
    shrunk = _int(d.get("hidden_size")) and d["hidden_size"] != before["hidden_size"]
    hidden = before["hidden_size"] if shrunk else None
    for k, v in d.items():
        if (isinstance(v, (list, tuple)) and v and all(_int(x) for x in v) and v == before.get(k)
                and WIDTH_LIKE.search(k) and not NOT_WIDTH.search(k) and all(x in cut for x in v)):
            d[k] = type(v)(cut.get(x, x) for x in v)  # RT-DETR's decoder_in_channels
        if not _int(v) or k.startswith("_") or v != before.get(k):
            continue
        if not NOT_WIDTH.search(k):
            if FFN_LIKE.search(k) and v > 64:
                d[k] = 64
                continue
            if WIDTH_LIKE.search(k) and v in cut:
                d[k] = cut[v]
                continue
            if WIDTH_LIKE.search(k) and _int(hidden) and v in (2 * hidden, 3 * hidden, 4 * hidden):  # Zamba2's 2h
                d[k] = v // hidden * d["hidden_size"]
                continue
        if FOLLOWS_WIDTH.search(k) and v > 1:
            width = next((w for w in sorted(WIDTH | FFN) if before.get(w) == v and d.get(w) != v), None)
            if width is not None:
                d[k] = d[width]
    # a derived width stays derived: Swin's hidden_size is embed_dim * 2 ** (stages - 1)
    depths, embed, hidden = before.get("depths"), before.get("embed_dim"), before.get("hidden_size")
    if isinstance(depths, (list, tuple)) and _int(embed) and _int(hidden) and hidden == embed * 2 ** (len(depths) - 1):
        d["hidden_size"] = d["embed_dim"] * 2 ** (len(depths) - 1)


def _kv_heads(d: dict, before: dict) -> None:
    """Multi-head attention stays multi-head: a key/value head count equal to the head count (DeepSeek's
    MLA, …) follows the head count instead of being cut on its own."""
    heads = next((k for k in HEADS_ATTR if _int(d.get(k))), None)
    for k in KV_HEADS:
        if heads and _int(d.get(k)) and before.get(k) == before.get(heads):
            d[k] = d[heads]


KV_HEAD_COUNT = re.compile(r"(key_value|kv)_(attention_)?heads")


def _kv_head_counts(d: dict, before: dict) -> None:
    """Key/value head counts under names :data:`KV_HEADS` does not list follow the head cut in proportion:
    an int (Sapiens2's ``num_key_value_attention_heads``) or a per-layer list (its
    ``num_key_value_heads_per_layer``, 16 on full-attention layers and 8 on grouped ones) of counts that each
    divided the full head count becomes, each, the largest divisor of the tiny head count not above
    ``count x tiny heads / full heads`` (at least 1): 16 → 4 and 8 → 2 for 16 → 4 heads, so every layer still
    groups its query heads over whole key/value heads."""
    for k, v in list(d.items()):
        if k in KV_HEADS or k.startswith("_") or not KV_HEAD_COUNT.search(k) or v != before.get(k):
            continue
        # the query head count of the same stack (Moonshine's ``encoder_num_key_value_heads`` goes with its
        # encoder's heads, not with the decoder's cut ``decoder_num_attention_heads``)
        key = next((h for h in sorted(HEADS_ATTR) if _int(d.get(h)) and _int(before.get(h)) and d[h] < before[h]
                    and _stack(h) == _stack(k)), None)
        if key is None:
            continue
        full, tiny = before[key], d[key]

        def follow(n: int, full: int = full, tiny: int = tiny) -> int:
            return max(h for h in range(1, max(1, n * tiny // full) + 1) if tiny % h == 0)

        if _int(v) and 0 < v <= full and full % v == 0:
            d[k] = follow(v)
        elif (isinstance(v, (list, tuple)) and v and all(_int(x) and 0 < x <= full and full % x == 0 for x in v)):
            d[k] = type(v)(follow(x) for x in v)


def _moe(d: dict) -> None:
    """Mixture of experts: 4 experts, at most 2 per token, at most 1 shared, one routing group."""
    if not any(_int(d.get(k)) and d[k] > 4 for k in EXPERTS):
        return
    for k, v in list(d.items()):
        if _int(v):
            d[k] = capped(k, v, MOE_CAPS)


def _head_dims(d: dict, before: dict) -> None:
    """Every ``*_head_dim`` (MLA's ``qk_rope_head_dim``, ``qk_nope_head_dim``, ``v_head_dim``, linear
    attention's key/value head dims …) shrinks with ``head_dim``; a sum of two of them stays their sum
    (``qk_head_dim`` = nope + rope); every low rank (``kv_lora_rank`` …) → 16; a rotary width is at most
    the head width."""
    # only where this config's heads were cut (Idefics2's resampler keeps its own heads and head width)
    heads_cut = any(_int(before.get(k)) and d.get(k) != before[k] for k in (*HEADS_ATTR, "head_dim"))
    for k, v in list(d.items()):
        if not _int(v) or k.startswith("_"):
            continue
        if (k.endswith("head_dim") or k.endswith("head_size")) and k != "head_dim" and v > 2 * HEAD_DIM and heads_cut:
            d[k] = HEAD_DIM
        elif (k.endswith("_rank") or k.endswith("lowrank")) and v > 2 * LORA_RANK:
            d[k] = LORA_RANK
    hidden = next((d[k] for k in ("hidden_size", *sorted(WIDTH)) if _int(d.get(k))), None)
    heads = next((d[k] for k in HEADS_ATTR if _int(d.get(k))), None)
    heads_before = next((before[k] for k in HEADS_ATTR if _int(before.get(k))), None)
    for k, v in list(d.items()):  # a head width that was a width / heads stays so (Zamba2: 2 x hidden / heads)
        if (k.endswith("head_dim") and _int(v) and _int(before.get(k)) and heads and heads_before
                and k not in ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")):
            for w, full in before.items():
                if (w != k and _int(full) and full == before[k] * heads_before and _int(d.get(w)) and d[w] != full
                        and d[w] % heads == 0 and WIDTH_LIKE.search(w)):
                    d[k] = d[w] // heads
                    break
    nope, rope = d.get("qk_nope_head_dim"), d.get("qk_rope_head_dim")
    if _int(nope) and _int(rope):  # multi-head latent attention (DeepSeek V2/V3, MiniCPM3, Mistral4 …)
        if _int(d.get("qk_head_dim")):
            d["qk_head_dim"] = nope + rope
        if before.get("head_dim") == before.get("qk_rope_head_dim"):  # DeepSeek: head_dim is the rope width
            d["head_dim"] = rope
        elif before.get("head_dim") == before.get("qk_head_dim"):  # Mistral4: head_dim is nope + rope
            d["head_dim"] = nope + rope
    head_dim = d.get("head_dim") if _int(d.get("head_dim")) else (hidden // heads if _int(hidden) and heads else None)
    if _int(d.get("rotary_dim")) and head_dim and d["rotary_dim"] > head_dim:  # GPT-J, CodeGen
        d["rotary_dim"] = head_dim


def _mamba(d: dict, before: dict) -> None:
    """Mamba-2 mixers: heads x head width = expand x hidden size (when it was so: Falcon-H1 sets its own
    inner width), groups dividing the heads."""
    expand = d.get("mamba_expand", d.get("expand"))
    hidden = d.get("hidden_size")
    if not (_int(expand) and _int(hidden)):
        return
    inner = expand * hidden
    dim_key = next((k for k in MAMBA_HEAD_DIM if _int(d.get(k))), None)
    heads_key = next((k for k in MAMBA_HEADS if _int(d.get(k))), None)
    if heads_key is None and _int(d.get("num_heads")) and _int(d.get("state_size")):  # Mamba2Config's own names
        heads_key, dim_key = "num_heads", "head_dim" if _int(d.get("head_dim")) else dim_key
    if dim_key is None or heads_key is None:
        return
    if before.get(heads_key, 0) * before.get(dim_key, 0) != expand * before.get("hidden_size", 0):
        return
    d[dim_key] = min(d[dim_key], HEAD_DIM)
    d[heads_key] = max(1, inner // d[dim_key])
    for k in MAMBA_GROUPS:
        if _int(d.get(k)) and d[heads_key] % d[k]:
            d[k] = 1


def _staged_heads(d: dict, before: dict) -> None:
    """Hierarchical vision models (Swin, …): stage i is ``embed_dim * 2**i`` wide, with ``num_heads[i]``
    heads: each head count becomes the largest divisor of its stage width not above the old count."""
    embed = d.get("embed_dim")
    if not _int(embed) or embed == before.get("embed_dim"):
        return
    for k in HEADS_ATTR:
        v = d.get(k)
        if isinstance(v, (list, tuple)) and v and all(_int(x) for x in v):
            width = [embed * 2 ** i for i in range(len(v))]
            d[k] = type(v)(max(h for h in range(1, max(1, x) + 1) if w % h == 0) for x, w in zip(v, width, strict=True))


def _windows(d: dict) -> None:
    """Windowed hierarchical vision models (Swin family): windows of 2 patches, and an image large enough
    that the last stage still holds a whole window (a stage smaller than its window shrinks the window and
    no longer matches its relative-position table)."""
    depths, window, patch = d.get("depths"), d.get("window_size"), d.get("patch_size")
    if not (isinstance(depths, (list, tuple)) and _int(window) and window > 2 and _int(patch)):
        return
    d["window_size"] = 2
    side = patch * 2 * 2 ** (len(depths) - 1)
    if _int(d.get("image_size")) and d["image_size"] < side:
        d["image_size"] = side


def _queries(d: dict) -> None:
    """Detection heads that pick their queries as the top-k encoder tokens (RT-DETR, D-FINE, DEIM …) need
    no more queries than a tiny image has tokens: at most 16 (a 32-pixel image at strides 8/16/32 gives 21)."""
    for k in ("num_queries", "num_top_queries"):
        if _int(d.get(k)) and d[k] > 16:
            d[k] = 16


def _missing_defaults(d: dict) -> None:
    """Defaults some configs leave unset, which their modeling code then divides by: ``head_dim`` None →
    hidden / heads; ``num_key_value_heads`` None → one per head; per-layer-type RoPE parameters missing
    for a layer type → the default RoPE."""
    hidden = d.get("hidden_size")
    heads = next((d[k] for k in HEADS_ATTR if _int(d.get(k))), None)
    if "head_dim" in d and d["head_dim"] is None and _int(hidden) and heads:
        d["head_dim"] = hidden // heads
    if "n_routed_experts" in d and d["n_routed_experts"] is None and "num_experts_per_tok" in d:  # dots1
        d["n_routed_experts"], d["num_experts_per_tok"] = 4, d["num_experts_per_tok"] or 2
        if "n_shared_experts" in d and d["n_shared_experts"] is None:
            d["n_shared_experts"] = 1
    if _int(d.get("n_routed_experts")) and d.get("num_experts_per_tok") is None:  # DeepSeek-V2: routing unset
        d["num_experts_per_tok"] = 2  # real checkpoints set it
        for k in ("n_group", "topk_group"):
            if k in d and d[k] is None:
                d[k] = 1
    if "vocab_size" in d and d["vocab_size"] is None and "pad_token_id" in d:  # ESM: set by each checkpoint
        d["vocab_size"] = 128
        if d["pad_token_id"] is None:  # ESM's positions count from its padding id
            d["pad_token_id"] = 1
    for k in ("width_coefficient", "depth_coefficient"):  # EfficientNet scales its widths and depths up
        if isinstance(d.get(k), float) and d[k] > 1:
            d[k] = 1.0
    if "num_key_value_heads" in d and d["num_key_value_heads"] is None and heads:
        d["num_key_value_heads"] = heads
    kinds, rope = d.get("layer_types"), d.get("rope_parameters")
    if isinstance(kinds, list) and isinstance(rope, dict) and not rope and all(isinstance(x, str) for x in kinds):
        d["rope_parameters"] = {kind: {"rope_type": "default", "rope_theta": 10000.0} for kind in set(kinds)}


def _vocabularies(d: dict) -> None:
    """Every other vocabulary (entity, per-layer-input, hash n-gram, codebook …) shrinks like
    ``vocab_size``: to 128, or to the text vocabulary when that is larger (special ids must fit)."""
    text = d.get("vocab_size") if _int(d.get("vocab_size")) else 128
    for k, v in list(d.items()):
        if k != "vocab_size" and _int(v) and VOCAB_LIKE.search(k) and v > max(128, text) and "divisible" not in k:
            d[k] = max(128, text)


def _stack(name: str) -> str | None:
    """Which stack a name is about: ``encode`` (``encoder_layers``, ``encode_proj_layers``), ``decode``, or
    None (the model's main stack)."""
    m = re.search(r"encode|decode", name)
    return m.group(0) if m else None


def _read_by_properties(config: object) -> set[str]:
    """The attributes that the properties of ``config``'s class read (``self.<name>`` in their code)."""
    import inspect

    out: set[str] = set()
    for klass in type(config).__mro__:
        for v in vars(klass).values():
            if isinstance(v, property) and v.fget is not None:
                try:
                    out |= set(re.findall(r"self\.(\w+)", inspect.getsource(v.fget)))
                except (OSError, TypeError):
                    continue
    return out


def _per_layer_lists(d: dict, before: dict, derived: set[str] = frozenset()) -> None:
    """Every list as long as the full layer count follows the tiny one, keeping one layer of each kind:
    a hybrid model (linear and full attention, Mamba and attention, sliding and global) stays hybrid, with
    as many layers as it has kinds (at most 4), the same layers kept in every per-layer list."""
    for key in LAYERS:
        old, new = before.get(key), d.get(key)
        # a stack whose layers each stride, where the config derives a size from every stride (MuseSpark's
        # audio encoder: ``patch_sizes`` (16, 6, 5, 4), one a layer, and ``samples_per_token``, their
        # product, which its forward checks the input against): its per-layer lists and tuples (strides,
        # widths, depths) are cut with the layer count, whatever the depth, so that the derived size is the
        # tiny layers' (lists read one a stage with no such size, SegFormer's, stay whole as before); so are
        # the lists of any stack of at least 6 layers
        staged = _int(old) and any(STRIDES.search(k) and isinstance(v, (list, tuple)) and len(v) == old
                                   and all(_int(x) for x in v) and k in derived for k, v in d.items())
        if not (_int(old) and _int(new) and old > new and (old >= 6 or staged)):
            continue
        if isinstance(d.get("stage_names"), list) and (d.get("_out_indices") or d.get("out_indices")):
            break  # a backbone read at stages: derived_sizes() sets its depth from them, its lists stay whole
        # lists of layer indices (``moe_layers``, ``full_attn_idxs``, SAM's ``global_attn_indexes``) are
        # renumbered, not cut by position; read-out lists are :func:`_read_out_layers`'
        # (a tuple only under an ``_indexes`` name; a list named for the encoder or the decoder indexes that
        # stack only: RT-DETR-style ``encode_proj_layers`` is not renumbered with ``decoder_layers``)
        indices = [k for k, v in d.items() if re.search(r"layers|layer_ids|idxs|_indexes$", k)
                   and not READ_OUT.search(k) and _stack(k) in (None, _stack(key))
                   and (isinstance(v, list) or isinstance(v, tuple) and k.endswith("_indexes"))
                   and v and all(_int(x) for x in v) and list(v) == sorted(set(v))
                   and v[-1] < old and (len(v) < old or list(v) == list(range(old)))]
        lists = [k for k, v in d.items() if isinstance(v, list if not staged else (list, tuple)) and len(v) == old
                 and not k.startswith("_") and k not in indices]
        kinds = next((d[k] for k in KINDS if k in lists), None)
        keep = list(range(new))
        if kinds is not None and all(isinstance(x, str) for x in kinds):
            first = {}
            for i, kind in enumerate(kinds):
                first.setdefault(kind, i)
            if len(first) > 1 and set(kinds[:new]) != set(first):
                keep = sorted(first.values())[:4]
                keep = sorted(set(keep) | set(range(new - len(keep))))  # at least the tiny count
                d[key] = len(keep)
        for k in lists:
            d[k] = type(d[k])(d[k][i] for i in keep)
        for k in indices:
            # a kind of layer named by its indices (cross-attention, global attention) stays present: when
            # none of its layers is kept, the last tiny layer is of that kind
            kept = [keep.index(i) for i in d[k] if i in keep] or [len(keep) - 1]
            d[k] = type(d[k])(kept)


def derived_sizes(config: object, before: dict, mild: bool = False) -> None:
    """Sizes a model derives from others in ways the name rules above do not see: a hierarchical audio
    tower's width (CLAP's HTSAT doubles its patch width per stage), a backbone read at stages past the tiny
    layer count (its ``out_indices``, DPT's ``backbone_out_indices``), a grid of patch embeddings that is
    the image in patches (SAM's prompt encoder ``image_embedding_size``: 1024 / 16), a HiFi-GAN vocoder's
    upsampling chain (its first channel count ``upsample_initial_channel``, halved at each stage, and
    its strides: 2 a stage)."""
    d = config.__dict__
    image, patch, grid = d.get("image_size"), d.get("patch_size"), before.get("image_embedding_size")
    if (_int(grid) and _int(image) and _int(patch) and patch > 0 and _int(before.get("image_size"))
            and grid == before["image_size"] // patch and image != before["image_size"]):
        d["image_embedding_size"] = image // patch
    rates, kernels = d.get("upsample_rates"), d.get("upsample_kernel_sizes")
    channels = d.get("upsample_initial_channel")
    if (not mild and isinstance(rates, (list, tuple)) and isinstance(kernels, (list, tuple)) and _int(channels)
            and len(kernels) == len(rates)
            and all(_int(u) and k == 2 * u for u, k in zip(rates, kernels, strict=True))):
        # HiFi-GAN's convention (each transposed conv's kernel twice its stride): every stage upsamples 2x with
        # a kernel of 4, so a waveform is 2**stages samples a frame, not 256 (the float64 convolutions over
        # 256 samples a frame took most of VITS' and FastSpeech 2's sweep time), and every stage keeps a channel
        d["upsample_rates"] = type(rates)(2 for _ in rates)
        d["upsample_kernel_sizes"] = type(kernels)(4 for _ in kernels)
        if channels > 64:
            d["upsample_initial_channel"] = max(32, 2 ** len(rates))
    if not mild and _int(d.get("patch_embeds_hidden_size")) and isinstance(d.get("depths"), (list, tuple)):
        d["patch_embeds_hidden_size"] = min(d["patch_embeds_hidden_size"], 16)
        d["hidden_size"] = d["patch_embeds_hidden_size"] * 2 ** (len(d["depths"]) - 1)
    stages = getattr(config, "out_indices", None)  # a backbone read at these stages keeps the layers they name
    if isinstance(stages, (list, tuple)) and stages and _int(d.get("num_hidden_layers")) and \
            isinstance(d.get("stage_names"), list) and len(d["stage_names"]) == before.get("num_hidden_layers", 0) + 1:
        d["num_hidden_layers"] = max(d["num_hidden_layers"], max(int(i) for i in stages))
    out_idx = d.get("backbone_out_indices")
    if isinstance(out_idx, (list, tuple)) and _int(d.get("num_hidden_layers")) and \
            max(out_idx, default=0) >= d["num_hidden_layers"]:
        # a ViT backbone read at these layers (DPT): as many layers as indices, each read
        d["num_hidden_layers"] = len(out_idx)
        d["backbone_out_indices"] = type(out_idx)(range(len(out_idx)))


# True one-offs, applied after shrink() (each says why no rule covers it).
OVERRIDES: dict[str, dict] = {
    # the hybrid layers share one transformer, tied from the first hybrid layer to the others: transformers'
    # tie needs a second hybrid layer to exist, and one-of-each-kind keeps one
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    # PVT's per-stage sizes are tuples the per-layer rules leave whole, and its last stage (no sequence reduction)
    # holds the cls token: the stage count stays with the tuples (cut to 2, the cls token landed on a reducing
    # stage and the reshape failed)
    "pvt": {"num_encoder_blocks": 4},
}


def tiny_config(model_type: str, class_name: str, widths: bool = True):  # noqa: ANN201 - the config
    """``model_type``'s default config shrunk to tiny and self-consistent: the full shrink; when that
    does not build ``class_name`` or stays over :data:`MAX_PARAMS`, the full shrink with the special ids
    renumbered into a small vocabulary; then the full shrink with its downsampling stages cut
    (:func:`cut_stages`); then the mild one (widths kept: layers, experts and vocabularies
    cut, ids renumbered). ``widths=False`` goes straight to the mild one (:func:`run_class`'s second try
    for a model no inputs run once its widths are cut). A full shrink that builds but keeps a vocabulary
    over :data:`MAX_VOCAB` to fit a special id has the ids past MAX_VOCAB renumbered (kept as it is if that
    does not build). Raises the first error when none builds."""
    import torch
    import transformers as tf

    cls = getattr(tf, class_name)

    def shrunk(mild: bool, renumber: bool | int, stages: bool = False):  # noqa: ANN202 - the config, or raises
        config = tf.AutoConfig.for_model(model_type)
        shrink(config, mild=mild, renumber=renumber)
        if stages:
            cut_stages(config)
        for k, v in OVERRIDES.get(model_type, {}).items():
            setattr(config, k, v)
        if class_name.endswith("ForCTC") and getattr(config, "vocab_size", 0) is None:
            config.vocab_size = 32  # a CTC head's defaults leave its alphabet to the checkpoint
        with torch.device("meta"):
            n = sum(p.numel() for p in cls(config).parameters())
        if n > MAX_PARAMS:
            raise RuntimeError(f"tiny config still has {n / 1e6:.0f}M parameters")
        return config

    first: Exception | None = None
    tries = ((False, False, False), (False, True, False), (False, False, True), (True, True, False)) if widths \
        else ((True, True, False),)
    for mild, renumber, stages in tries:
        try:
            config = shrunk(mild, renumber, stages)
        except Exception as exc:  # noqa: BLE001 - recorded by the caller when no shrink builds
            first = first or exc
            continue
        if not renumber and largest_vocabulary(config) > MAX_VOCAB:
            # kept large to hold a special id (Aya Vision's image token 255,036): its logits cost gigabytes in
            # calibration and verification; the ids past MAX_VOCAB are renumbered (those below keep their
            # meaning: Higgs Audio's codebook-space stream ids), unless that does not build
            try:
                return shrunk(False, MAX_VOCAB, stages)
            except Exception:  # noqa: BLE001 - the large vocabulary, as before
                return config
        return config
    raise first


STAGE_STRIDES = re.compile(r"^(downsampling_ratios|upsampling_ratios|strides|patch_sizes)$")
TINY_STAGES = 2


def cut_stages(config: object) -> None:
    """A convolutional pyramid that the name rules leave over :data:`MAX_PARAMS` because its channels double
    at each downsampling stage from a base width no width name covers (VibeVoice's acoustic tokenizer:
    ``num_filters`` 32 x 2^6 = 2048 channels after its 6 ``downsampling_ratios``, 172M tiny) keeps its first
    :data:`TINY_STAGES` stages: in every config of the tree, a list of strides (:data:`STAGE_STRIDES`) longer
    than that is cut to its first ones, and every list or tuple of the same length to as many, every one
    one longer (a stem stage's entry first: its ``depths``) to one more. :func:`tiny_config`'s third try,
    for configs the full shrink leaves too large."""
    from transformers import PretrainedConfig

    d = config.__dict__
    n = next((len(v) for k, v in d.items() if STAGE_STRIDES.search(k) and isinstance(v, (list, tuple))
              and len(v) > TINY_STAGES and all(_int(x) for x in v)), None)
    if n is not None:
        for k, v in list(d.items()):
            if isinstance(v, (list, tuple)) and not k.startswith("_") and len(v) in (n, n + 1):
                d[k] = type(v)(v[: TINY_STAGES + len(v) - n])
    for v in d.values():
        if isinstance(v, PretrainedConfig):
            cut_stages(v)


def largest_vocabulary(config: object) -> int:
    """The largest ``*vocab_size`` anywhere in the config tree (0 when none is set)."""
    from transformers import PretrainedConfig

    sizes = [v for k, v in config.__dict__.items() if _int(v) and VOCAB_LIKE.search(k)]
    sizes += [largest_vocabulary(v) for v in config.__dict__.values() if isinstance(v, PretrainedConfig)]
    return max(sizes, default=0)


def build(class_name: str, model_type: str, widths: bool = True):  # noqa: ANN201 - the model
    """The tiny, random, float64, eval-mode model of ``class_name``; raises when it cannot be built.
    ``widths=False``: the mild shrink only (:func:`tiny_config`)."""
    import torch
    import transformers as tf

    randomise = zoo().randomise
    config = tiny_config(model_type, class_name, widths)
    torch.manual_seed(0)
    model = randomise(getattr(tf, class_name)(config), 0)
    if callable(getattr(model, "set_experts_implementation", None)):
        # fused MoE kernels (grouped_mm) take no float64: a float64 model runs its experts eagerly, as a
        # float64 transformers model must (normswap's float64 working copy does the same)
        try:
            model.set_experts_implementation("eager")
        except Exception:  # noqa: BLE001 - a model without experts
            pass
    return model


# ------------------------------------------------------------------------------------ runnable oracle
def _oracle_table() -> dict:
    """Inputs written by hand for types whose forward takes arguments no generic rule here builds
    (read from each model's forward in transformers 5.24): the oracle's last resort, never normswap's."""
    import torch

    def ids(config: object, n: int = 8, batch: int = 2) -> torch.Tensor:
        vocab = getattr(config, "vocab_size", None) or getattr(getattr(config, "text_config", None), "vocab_size", 100)
        return torch.randint(3, max(4, min(int(vocab), 1000)), (batch, n))

    def decision(config: object) -> dict:
        b, t = 2, 5
        return {"states": torch.randn(b, t, config.state_dim), "actions": torch.randn(b, t, config.act_dim),
                "rewards": torch.randn(b, t, 1), "returns_to_go": torch.randn(b, t, 1),
                "timesteps": torch.arange(t).expand(b, t), "attention_mask": torch.ones(b, t, dtype=torch.long)}

    def bros(config: object) -> dict:
        box = torch.rand(2, 8, 4)
        box = torch.cat([box[..., :2].minimum(box[..., 2:]), box[..., :2].maximum(box[..., 2:])], -1)
        return {"input_ids": ids(config), "bbox": box}

    def timesfm(config: object) -> dict:
        n = config.context_length
        return {"past_values": torch.randn(2, n), "past_values_padding": torch.zeros(2, n),
                "freq": torch.zeros(2, 1, dtype=torch.long)}

    def oneformer(config: object) -> dict:
        side = 64
        return {"pixel_values": torch.randn(2, 3, side, side),
                "task_inputs": ids(config.text_config if hasattr(config, "text_config") else config,
                                   config.task_seq_len)}

    return {"decision_transformer": decision, "bros": bros, "timesfm": timesfm, "oneformer": oneformer}


def oracle_inputs(model: object, model_type: str):  # noqa: ANN201 - (source, kwargs) pairs
    """Inputs that do not come from normswap, to tell a model that some inputs run from a config that
    runs on none: the model's own ``dummy_inputs``; its feature extractor's defaults applied to one
    second of noise (audio models); inputs written by hand for the few types in :func:`_oracle_table`."""
    import inspect

    import numpy as np
    import torch
    import transformers as tf
    from transformers.models.auto import feature_extraction_auto as fa

    params = inspect.signature(model.forward).parameters
    config = model.config

    def decoder(kw: dict) -> dict:
        if "decoder_input_ids" in params and getattr(config, "is_encoder_decoder", False):
            start = getattr(config, "decoder_start_token_id", None)
            kw["decoder_input_ids"] = torch.tensor([[start if isinstance(start, int) else 0, 4, 5]] * len(
                next(iter(kw.values()))))
        return kw

    try:
        dummy = dict(model.dummy_inputs)
    except Exception:  # noqa: BLE001 - a model whose dummy_inputs property itself fails
        dummy = {}
    if dummy and all(k in params for k in dummy):
        yield "the model's dummy_inputs", decoder(dummy)
    name = fa.FEATURE_EXTRACTOR_MAPPING_NAMES.get(model_type)
    if name and hasattr(tf, name):
        try:
            fe = getattr(tf, name)()
            rate = getattr(fe, "sampling_rate", 16000) or 16000
            wave = np.random.default_rng(0).standard_normal(int(rate)).astype(np.float32) * 0.1
            got = fe([wave, wave], sampling_rate=rate, return_tensors="pt")
            kw = {k: v for k, v in dict(got).items() if k in params and isinstance(v, torch.Tensor)}
            if "input_ids" in params and "input_ids" in dummy:
                kw["input_ids"] = dummy["input_ids"][:1].expand(2, -1)
            if kw:
                yield f"{name} defaults on noise", decoder(kw)
        except Exception:  # noqa: BLE001 - an extractor that needs files or arguments: no candidate
            pass
    table = _oracle_table()
    if model_type in table:
        yield "inputs written for this type", decoder(table[model_type](config))


def runs(model: object, kwargs: dict) -> str | None:
    """None when ``model`` runs on ``kwargs`` (float64, eval, no grad, random state untouched), else the
    error in one line."""
    import torch

    from normswap.pipeline import default_dtype

    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float64)
    kwargs = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in kwargs.items()}
    try:
        with torch.no_grad(), default_dtype(dtype), zoo().float64_casts(), torch.random.fork_rng():
            model(**kwargs)
        return None
    except Exception as exc:  # noqa: BLE001 - the answer is the error
        return f"{type(exc).__name__}: {_line(exc, 160)}"


def built_inputs(model: object) -> tuple[dict | None, str]:
    """normswap's own inputs for ``model`` (``hf_example_inputs`` at its defaults: what ``patch`` with no
    inputs builds) and ``"ok"``, or None and the refusal (``refused: …``) or crash (``crash: …``) in one
    line. Built once per model: the runnable check, the ``inputs`` column and the exact-mode run share it."""
    from normswap import NormswapError
    from normswap.inputs import hf_example_inputs

    try:
        return hf_example_inputs(model), "ok"
    except NormswapError as exc:
        return None, f"refused: {_line(exc)}"
    except Exception as exc:  # noqa: BLE001 - a bug in the input builder: recorded, and patch will say so too
        return None, f"crash: {type(exc).__name__}: {_line(exc)}"


def runnable(model: object, model_type: str, built: tuple[dict | None, str] | None = None) -> tuple[str | None, str]:
    """``(what ran the model, why not)``: "normswap's inputs", an oracle source, or None and the last
    error. ``built``: :func:`built_inputs` of ``model`` when the caller has them."""
    kw, status = built if built is not None else built_inputs(model)
    why = runs(model, kw) if kw is not None else status.split(": ", 1)[1][:160]
    if why is None:
        return "normswap's inputs", ""
    for source, kw in oracle_inputs(model, model_type):
        err = runs(model, kw)
        if err is None:
            return source, ""
        why = err
    return None, why


# --------------------------------------------------------------------------------------- per class
def run_class(class_name: str, model_type: str, quantizer: str | None = None) -> dict:
    """One class of ``model_type``: built tiny, patched with no inputs, its exact norms' error measured.
    ``quantizer``: an engine of :mod:`normswap.quantizers`, passed to every ``normswap.patch`` call (the row
    then records it, the model kind the analysis found and the options the engine set)."""
    import copy
    import warnings

    import torch

    import normswap
    from normswap import NormswapError
    from normswap.inputs import hf_example_inputs
    from normswap.pipeline import default_dtype
    from normswap.surgery.verify import compare

    float64_casts = zoo().float64_casts

    row: dict = {"class": class_name}
    engine = {"quantizer": quantizer} if quantizer else {}  # the default sweep passes nothing new
    t0 = time.perf_counter()
    phases: dict[str, float] = {}  # seconds per step, in the JSON: where a slow type's time goes

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        phases[name] = round(phases.get(name, 0.0) + now - since, 2)
        return now

    try:
        model = build(class_name, model_type)
    except Exception as exc:  # noqa: BLE001 - the config cannot be built tiny: recorded, not a normswap bug
        row["build"] = f"{type(exc).__name__}: {_line(exc)}"
        model = None
    t = lap("build", t0)
    built = built_inputs(model) if model is not None else None
    t = lap("inputs", t)
    source, why = runnable(model, model_type, built) if model is not None else (None, row["build"])
    t = lap("runnable", t)
    if source is None:
        # no inputs run the fully shrunk model: a config whose sizes derive from each other may have been
        # made inconsistent by shrinking its widths; the same model with its own widths is tried
        try:
            wide = build(class_name, model_type, widths=False)
            wide_built = built_inputs(wide)
            wide_source, wide_why = runnable(wide, model_type, wide_built)
            if wide_source is not None or model is None:
                model, source, why, built = wide, wide_source, wide_why, wide_built
                row["shrink"] = "widths kept"
                row["build"] = "ok"
        except Exception as exc:  # noqa: BLE001 - too big or unbuildable with its widths: the first try stands
            if model is None:
                return row
            row["wide"] = f"{type(exc).__name__}: {_line(exc, 120)}"
        t = lap("widths kept retry", t)
    if model is None:
        return row
    row["build"] = "ok"
    row["runs_on"] = source
    row["runnable"] = source is not None
    if source is None:
        row["not_run"] = why
    kw, row["inputs"] = built
    original = copy.deepcopy(model)
    warnings.simplefilter("ignore")
    t = time.perf_counter()
    try:
        report = normswap.patch(model, **engine)
        row["patch"] = "ok"
        if quantizer and report.plan is not None:
            record = report.plan.options.get("quantizer") or {}
            row["kind"], row["set"] = record.get("model"), record.get("set")
        row["counts"] = report.plan.counts() if report.plan is not None else {}
        # LayerNorms the built inputs never reached are kept as LayerNorm: the class is only partly converted
        uncalled = not_called(report.plan)
        row["not_called"] = len(uncalled)
        if uncalled:
            row["not_called_names"] = uncalled[:3]
        row["message"] = report.message
        row["verify_err"] = report.verification.get("max_rel_error")
    except NormswapError as exc:
        row["patch"] = f"refused: {_line(exc)}"
    except Exception as exc:  # noqa: BLE001 - a bug: the CLI would say "internal error"
        row["patch"] = f"crash: {type(exc).__name__}: {_line(exc)}"
    if quantizer and "kind" not in row:  # refused or crashed: the kind from a plan made with the defaults
        row["kind"] = kind_of(copy.deepcopy(original), kw)
    t = lap("patch", t)
    if row["patch"] == "ok" and row["counts"].get("approximate"):
        model = copy.deepcopy(original)
        try:
            # the inputs patch() built for itself, built once above: the same analysis, without building
            # them again (a VLM's input builder tries layouts with trial forwards)
            normswap.patch(model, dict(kw) if kw is not None else None, mode="exact", verify=False, **engine)
        except Exception as exc:  # noqa: BLE001
            row["err"] = f"exact-mode patch failed: {type(exc).__name__}: {_line(exc)}"
            model = None
        t = lap("exact-mode patch", t)
    if row["patch"] == "ok" and model is not None and any(
            row["counts"].get(k) for k in ("exact", "exact-with-centering", "exact-with-per-norm-centering")):
        errs = []
        for batch, seq in ((1, 5), (2, 11)):
            try:
                kw = hf_example_inputs(original, batch=batch, seq=seq, seed=7)
                with torch.no_grad(), default_dtype(torch.float64), float64_casts():
                    torch.manual_seed(0)
                    ref = original(**kw)
                    torch.manual_seed(0)
                    out = model(**kw)
                skip = set(report.plan.changed_outputs) if report.plan else set()
                axes = dict(report.plan.changed_output_axes) if report.plan else {}  # VitDet's (B, C, H, W)
                figures = compare(ref, out, skip, axes=axes)
                # a model whose every output is its raw stream (SAM 2's Hiera): the error after each
                # token's mean is removed, the figure verification holds such an output to
                errs.append(figures.get("max_rel_error", figures.get("raw_stream_rel_error")))
            except Exception as exc:  # noqa: BLE001 - e.g. a model that takes one length only
                errs.append(f"{type(exc).__name__}: {_line(exc, 80)}")
        row["err"] = errs
        lap("exact error, 2 shapes", t)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    row["phases"] = phases
    return row


def kind_of(model: object, kw: dict | None) -> str:
    """The model kind (:func:`normswap.quantizers.model_kind`) of a plan made with the defaults, or why none."""
    import normswap
    from normswap import quantizers

    try:
        return quantizers.model_kind(normswap.plan(model, dict(kw) if kw is not None else None))
    except Exception as exc:  # noqa: BLE001 - the default plan fails too: said in the row
        return f"unknown ({type(exc).__name__}: {_line(exc, 80)})"


def _line(exc: BaseException, n: int = 240) -> str:
    text = str(exc).strip().splitlines()
    text = text[0] if text else ""
    return text if len(text) <= n else text[: n - 1] + "…"


def zoo():  # noqa: ANN201 - the tests.zoo module
    """``tests/zoo.py`` loaded from its file: with the repository itself on ``sys.path``, its ``normswap``
    would shadow the one ``PYTHONPATH`` or the installed package names (a sweep of another checkout)."""
    import importlib.util

    if "sweep_zoo" not in sys.modules:
        spec = importlib.util.spec_from_file_location("sweep_zoo", REPO / "tests" / "zoo.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["sweep_zoo"] = module
        spec.loader.exec_module(module)
    return sys.modules["sweep_zoo"]


def code_version(checkout: Path) -> str:
    """Which normswap code a row was swept on: ``git describe`` of the checkout Python imported it from
    (``-dirty`` when its working tree has uncommitted changes other than the sweep's own outputs, which
    ``--write`` rewrites as rows arrive), else the installed package's version."""
    try:
        git = ["git", "-C", str(checkout)]
        out = subprocess.run([*git, "describe", "--always", "--abbrev=9"],
                             capture_output=True, text=True, timeout=20, check=True).stdout.strip()
        # the sweep's own outputs, rewritten as rows arrive: the defaults' JSON and page, the --quantizer JSONs
        own = [f":(exclude){p.relative_to(REPO)}" for p in (JSON, DOC)] + [
            f":(exclude)benchmarks/{QUANTIZER_JSON.format('*')}"]
        changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", ".", *own],
                                 capture_output=True, text=True, timeout=20, check=True).stdout.strip()
        return f"normswap {out}{'-dirty' if changed else ''}" if out else "normswap (unknown commit)"
    except Exception:  # noqa: BLE001 - not a git checkout: an installed copy
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"normswap {version('normswap')} (installed)"
        except PackageNotFoundError:
            return "normswap (unknown version)"


def worker(types: list[str], quantizer: str | None = None) -> None:
    """Sweep ``types`` in this process, one JSON line per type on stdout (``START`` before each)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    import normswap

    checkout = Path(normswap.__file__).parents[1]
    swept_on = code_version(checkout)
    torch.set_num_threads(1)
    for t in types:
        print(f"START {t}", flush=True)
        try:
            rows = [run_class(c, t, quantizer) for c in classes(t)]
        except Exception as exc:  # noqa: BLE001
            rows = [{"class": "?", "build": f"{type(exc).__name__}: {_line(exc)}"}]
        row = {"type": t, "classes": rows, "normswap": str(checkout), "swept_on": swept_on}
        if quantizer:
            row["quantizer"] = quantizer
        print("ROW " + json.dumps(row, default=str), flush=True)


def sweep(types: list[str], jobs: int, limit: float, save=None,  # noqa: ANN001
          quantizer: str | None = None) -> list[dict]:
    """Run ``types`` in ``jobs`` worker processes; a type whose worker dies or passes ``limit`` seconds
    gets a row saying so, and a new worker carries on with the rest. ``quantizer``: passed to every patch."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    queue = list(types)
    done: dict[str, dict] = {}
    slots: list[dict] = []

    def spawn() -> dict | None:
        if not queue:
            return None
        take = queue[: max(1, math.ceil(len(queue) / max(1, jobs - len(slots) + 1)))] if jobs > 1 else list(queue)
        take = queue[: min(len(take), 40)]
        del queue[: len(take)]
        engine = ["--quantizer", quantizer] if quantizer else []
        p = subprocess.Popen([sys.executable, __file__, "--worker", ",".join(take), *engine], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, env=env)
        os.set_blocking(p.stdout.fileno(), False)
        return {"p": p, "todo": list(take), "current": None, "since": time.time(), "buf": ""}

    while queue or slots:
        while len(slots) < jobs and queue:
            slots.append(spawn())
        time.sleep(0.2)
        for s in list(slots):
            chunk = (s["p"].stdout.read() or b"").decode("utf-8", "replace")
            s["buf"] += chunk
            *lines, s["buf"] = s["buf"].split("\n")
            for line in lines:
                if line.startswith("START "):
                    s["current"], s["since"] = line[6:], time.time()
                elif line.startswith("ROW "):
                    row = json.loads(line[4:])
                    done[row["type"]] = row
                    s["todo"].remove(row["type"])
                    s["current"] = None
                    print(f"[{len(done)}/{len(types)}] {summary_line(row)}", flush=True)
                    if save is not None:
                        save(row)
            dead = s["p"].poll() is not None
            late = s["current"] is not None and time.time() - s["since"] > limit
            if dead or late:
                if late:
                    s["p"].kill()
                    s["p"].wait()
                if s["current"] is not None and s["current"] not in done:
                    why = f"timeout after {limit:.0f} s" if late else f"worker died (exit {s['p'].returncode})"
                    done[s["current"]] = {"type": s["current"], "classes": [{"class": "?", "build": why}],
                                          **({"quantizer": quantizer} if quantizer else {})}
                    s["todo"].remove(s["current"])
                    print(f"[{len(done)}/{len(types)}] {s['current']}: {why}", flush=True)
                    if save is not None:
                        save(done[s["current"]])
                queue[:0] = s["todo"]
                slots.remove(s)
    return [done[t] for t in types if t in done]


# --------------------------------------------------------------------------------------- outcome and table
# a norm the inputs never ran: the planner's reason for a traced site never called, the walker's for a
# norm found in no trace (a branch the inputs do not take)
NOT_CALLED = re.compile(r"not called by the example inputs|did not run on the analysis inputs"
                        r"|ran on the analysis inputs only with no rows")


def not_called(plan: object) -> list[str]:
    """Names of the norms ``plan`` kept because the inputs never called them (sites and skipped norms)."""
    if plan is None:
        return []
    names = [sp.name for sp in plan.sites if NOT_CALLED.match(sp.reason or "")]
    return names + [s["name"] for s in plan.skipped if NOT_CALLED.match(str(s.get("reason", "")))]


def outcome(row: dict) -> str:
    """One word per class: ``unbuilt``, ``converted``, ``partial`` (patched, but some LayerNorms were never
    called by the built inputs and stay LayerNorm: ``not_called``), ``no-run`` (refused: the model does not
    run on the built inputs, or none could be built), ``refused`` (for another reason) or ``crash``."""
    if row.get("build") != "ok":
        return "unbuilt"
    p = row.get("patch", "")
    if p == "ok":
        return "partial" if row.get("not_called") else "converted"
    if p.startswith("crash"):
        return "crash"
    return "no-run" if NO_RUN.search(p) else "refused"


# refusals that say the model did not run: the pipeline's own, a media token no prompt can hold, and the
# per-tower route's (rows swept before the route's refusal said the pipeline's words too)
NO_RUN = re.compile(r"on the example inputs|cannot build example inputs|outputs NaN|cannot run on any inputs"
                    r"|per-tower analysis: .*does not run")


def is_runnable(c: dict) -> bool | None:
    """Whether some inputs run the class (normswap's or the oracle's); None when unknown: a row measured
    before the sweep asked (no ``runnable`` key) that did not convert, or a type that ran out of time."""
    if outcome(c) == "converted":
        return True
    if outcome(c) == "unbuilt":  # a type whose worker timed out or died was not measured: unknown
        return None if re.match(r"timeout|worker died", c.get("build", "")) else False
    return c.get("runnable")


def runnable_totals(rows: list[dict]) -> dict:
    """The issue's measure: of the types some inputs can run (a built class runs on normswap's inputs or
    the oracle's), how many convert with no inputs (every class that some inputs run converted)."""
    known = [r for r in rows if all(is_runnable(c) is not None for c in r["classes"])]
    runnable_types = [r for r in known if any(is_runnable(c) for c in r["classes"])]
    converted = [r for r in runnable_types if all(outcome(c) == "converted" for c in r["classes"] if is_runnable(c))]
    return {"asked": len(known), "unknown": len(rows) - len(known), "runnable": len(runnable_types),
            "converted": len(converted), "not_runnable": [r for r in known if r not in runnable_types],
            "failing": [r for r in runnable_types if r not in converted]}


def worst_err(row: dict) -> float | None:
    errs = [e for e in row.get("err", []) or [] if isinstance(e, float)] if isinstance(row.get("err"), list) else []
    return max(errs) if errs else None


def summary_line(row: dict) -> str:
    def why(c: dict) -> str:
        if outcome(c) == "partial":
            return f" ({c['not_called']} LayerNorm(s) not called)"
        return f" ({c.get('patch', c.get('build'))[:100]})" if outcome(c) != "converted" else ""

    return f"{row['type']}: " + "; ".join(f"{c['class']} {outcome(c)}{why(c)}" for c in row["classes"])


def totals(rows: list[dict]) -> dict:
    per_class = [c for r in rows for c in r["classes"]]
    built = [c for c in per_class if outcome(c) != "unbuilt"]
    types_built = [r for r in rows if any(outcome(c) != "unbuilt" for c in r["classes"])]
    types_ok = [r for r in types_built if all(outcome(c) in ("converted", "unbuilt") for c in r["classes"])]
    over = [c for c in built if (worst_err(c) or 0) > EXACT_LIMIT]
    return {"types": len(rows), "types_built": len(types_built), "types_converted": len(types_ok),
            "classes": len(per_class), "classes_built": len(built),
            "classes_converted": sum(outcome(c) == "converted" for c in built),
            "classes_partial": sum(outcome(c) == "partial" for c in built),
            "layernorms_not_called": sum(c.get("not_called") or 0 for c in built),
            # converted before the sweep counted LayerNorms never called (rows kept from an earlier run)
            "not_called_unrecorded": sum(c.get("patch") == "ok" and "not_called" not in c for c in built),
            "classes_refused": sum(outcome(c) == "refused" for c in built),
            "classes_no_run": sum(outcome(c) == "no-run" for c in built),
            "classes_crashed": sum(outcome(c) == "crash" for c in built),
            "inputs_not_built": sum(c.get("inputs", "ok") != "ok" for c in built),
            "exact_over_1e-9": len(over)}


def fmt_err(c: dict) -> str:
    e = c.get("err")
    if isinstance(e, list):
        return " / ".join(f"{x:.0e}" if isinstance(x, float) else ("-" if x is None else "fails") for x in e)
    return "-" if e is None else "fails"


def table(rows: list[dict], before: dict | None, all_types: int | None = None,
          transformers_version: str | None = None) -> str:
    t = totals(rows)
    import collections

    kept = sum(1 for r in rows if str(r.get("swept_on", "")).startswith("main"))
    codes = collections.Counter(str(r.get("swept_on") or "unrecorded") for r in rows)
    provenance = (f"Swept with transformers {transformers_version or '(version not recorded)'}; "
                  "normswap code swept (each row's `swept_on` in the JSON): " + "; ".join(
        f"{code}: {n} types" for code, n in codes.most_common()) + "."
        + (f" Rows of {kept} types come from an earlier run: types that converted there were not swept again."
           if kept else ""))
    out = [f"Swept: **{len(rows)} of the {all_types}** LayerNorm model types of this transformers."
           if all_types and all_types > len(rows) else "", provenance, "",
           f"Types: **{t['types']}** with a LayerNorm in their modeling code; built tiny: **{t['types_built']}**; "
           f"converted with no inputs (every built class): **{t['types_converted']}** "
           f"({100 * t['types_converted'] / max(1, t['types_built']):.0f}% of those built).", "",
           f"Classes built: {t['classes_built']} of {t['classes']}; converted {t['classes_converted']}, "
           f"partly converted {t['classes_partial']} ({t['layernorms_not_called']} LayerNorms the built inputs "
           "never called, kept as LayerNorm"
           + (f"; not recorded for {t['not_called_unrecorded']} converted classes swept before the sweep counted "
              "them" if t["not_called_unrecorded"] else "") + "), "
           f"not run on the built inputs {t['classes_no_run']}, refused for another reason {t['classes_refused']}, "
           f"crashed {t['classes_crashed']}; inputs not built: "
           f"{t['inputs_not_built']}; exact conversions above 1e-9: {t['exact_over_1e-9']}.", ""]
    rt = runnable_totals(rows)
    out += [f"**Types some inputs can run: {rt['runnable']}; converted with no inputs: {rt['converted']} "
            f"({100 * rt['converted'] / max(1, rt['runnable']):.1f}%).** A class counts as runnable when it runs on "
            "normswap's built inputs or on the sweep's oracle (inputs that are not normswap's: the model's own "
            "`dummy_inputs`, its feature extractor's defaults on noise, inputs written by hand for a few types); "
            f"{len(rt['not_runnable'])} types run on neither (listed below with the error)"
            + (f"; {rt['unknown']} types are left out of this count (measured before the sweep asked, or out of "
               "time)" if rt["unknown"] else "") + ".", ""]
    if before:
        b = totals(before["rows"])
        same = {r["type"] for r in before["rows"]} & {r["type"] for r in rows}
        a = totals([r for r in rows if r["type"] in same])
        b = totals([r for r in before["rows"] if r["type"] in same])
        out += [f"Before and after on the {len(same)} types both runs measured ({before.get('label') or 'before'} "
                f"vs this run): types converted with no inputs **{b['types_converted']} → {a['types_converted']}** "
                f"of {a['types_built']} built; classes converted {b['classes_converted']} → {a['classes_converted']}, "
                f"partly converted {b['classes_partial']} → {a['classes_partial']}, "
                f"not run on the built inputs {b['classes_no_run']} → {a['classes_no_run']}, crashed "
                f"{b['classes_crashed']} → {a['classes_crashed']}.", ""]
    was = {(r["type"], c["class"]): outcome(c) for r in (before or {}).get("rows", []) for c in r["classes"]}
    out += ["| model type | class | outcome | before | verdicts (exact / centered / approx / skipped) | "
            "exact err, 2 shapes | note |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        for c in r["classes"]:
            o = outcome(c)
            counts = c.get("counts") or {}
            v = (f"{counts.get('exact', 0)} / "
                 f"{counts.get('exact-with-centering', 0) + counts.get('exact-with-per-norm-centering', 0)} / "
                 f"{counts.get('approximate', 0)} / {counts.get('skipped', 0)}") if counts else "-"
            note = {"unbuilt": c.get("build", ""), "converted": "", "partial": ""}.get(o, c.get("patch"))
            if o in ("converted", "partial") and c.get("message"):
                note = c["message"]
            if o == "partial":
                names = ", ".join(c.get("not_called_names", [])) + (", …" if c["not_called"] > 3 else "")
                note = f"{c['not_called']} LayerNorm(s) not called by the inputs, kept ({names}) {note or ''}"
            if c.get("shrink"):  # the fully shrunk config ran on no inputs; this one keeps the model's widths
                note = f"[{c['shrink']}] {note or ''}"
            if o != "converted" and c.get("runs_on"):
                note = f"{note or ''} (runs on {c['runs_on']})"
            note = (note or "").replace("|", "\\|").replace("\n", " ")[:200]
            out.append(f"| {r['type']} | {c['class']} | {o} | {was.get((r['type'], c['class']), '')} | {v} | "
                       f"{fmt_err(c)} | {note} |")
    out += ["", "## Runnable but not converted with no inputs", "",
            "| model type | class | outcome | runs on | why not converted |", "|---|---|---|---|---|"]
    for r in rt["failing"]:
        for c in r["classes"]:
            if is_runnable(c) and outcome(c) != "converted":
                why = (c.get("patch") or "").replace("|", "\\|")[:200]
                if outcome(c) == "partial":
                    why = f"{c['not_called']} LayerNorm(s) not called by the built inputs (kept as LayerNorm)"
                out.append(f"| {r['type']} | {c['class']} | {outcome(c)} | {c.get('runs_on') or '-'} | {why} |")
    out += ["", "## Not runnable on any inputs the sweep has", "",
            "Neither normswap's inputs nor the oracle's run these tiny models (or they do not build tiny); "
            "the model's own error, one line:", "", "| model type | class | error |", "|---|---|---|"]
    for r in rt["not_runnable"]:
        for c in r["classes"]:
            why = c.get("not_run") or c.get("build") or ""
            out.append(f"| {r['type']} | {c['class']} | {why.replace('|', chr(92) + '|')[:200]} |")
    return "\n".join(out)


# ------------------------------------------------------------------------------------- --compare: two sweeps
# the classes of difference between a class's row in a defaults sweep (A) and in a --quantizer sweep (B), worst
# first: a row takes the first that applies
DIFFERENCES = {
    "crash": "(a) crash: an exception that is not a NormswapError with the engine's options (a bug)",
    "exact lost": "(b) a norm exact with the defaults is approximate (or kept) with the engine's options",
    "err": "(c) exact norms' error above 1e-9 (or failing) with the engine's options, not with the defaults",
    "refused": "refused (or not run) with the engine's options, converted with the defaults",
    "timeout": "not measured with the engine's options (out of time or the worker died), measured with the defaults",
    "expected": "(d) expected: verdicts move between exact kinds (a centering op or a per-norm mean), as the "
                "options ask",
    "better": "more norms exact with the engine's options",
    "same": "the same verdict counts, outcome and error class",
    "unmeasured": "measured by neither run, or only by the engine's",
}


def exact_total(c: dict) -> int:
    counts = c.get("counts") or {}
    return sum(counts.get(k, 0) for k in ("exact", "exact-with-centering", "exact-with-per-norm-centering"))


def verdicts(c: dict) -> str:
    """``exact / centered / per-norm / approx / skipped`` counts, ``-`` when the class did not patch."""
    counts = c.get("counts")
    if not counts:
        return "-"
    return "/".join(str(counts.get(k, 0)) for k in ("exact", "exact-with-centering", "exact-with-per-norm-centering",
                                                     "approximate", "skipped"))


def err_fails(c: dict) -> bool:
    """Whether a patched class's exact-norm error is over 1e-9 or could not be measured at some shape."""
    e = c.get("err")
    if e is None:
        return False
    if not isinstance(e, list):
        return True
    return any(not isinstance(x, float) or x > EXACT_LIMIT for x in e if x is not None)


def difference(a: dict | None, b: dict | None) -> str:
    """Which of :data:`DIFFERENCES` class ``b`` (the engine's row) is of ``a`` (the defaults' row)."""
    oa, ob = (outcome(c) if c else "unbuilt" for c in (a, b))
    if ob == "crash" and oa != "crash":
        return "crash"
    if a is None or oa == "unbuilt":
        return "unmeasured"
    if ob == "unbuilt":
        return "timeout" if re.match(r"timeout|worker died", (b or {}).get("build", "")) else "unmeasured"
    patched_a, patched_b = oa in ("converted", "partial"), ob in ("converted", "partial")
    if patched_a and not patched_b:
        return "refused"
    if not patched_b:
        return "same"
    ca, cb = a.get("counts") or {}, b.get("counts") or {}
    if exact_total(b) < exact_total(a) or (patched_a and (b.get("not_called") or 0) > (a.get("not_called") or 0)):
        return "exact lost"
    if err_fails(b) and not err_fails(a):
        return "err"
    if exact_total(b) > exact_total(a) or not patched_a:
        return "better"
    same = {k: v for k, v in ca.items() if v} == {k: v for k, v in cb.items() if v}  # a --quantizer row drops zeros
    return "same" if same and oa == ob else "expected"


# what a --quantizer row keeps in its JSON (benchmarks/transformers_sweep_q62_*.json, kept under 200 KB): what
# --compare reads; the per-phase seconds, the report's message, the verification figure and the import path are
# dropped
SLIM_KEYS = ("class", "build", "patch", "counts", "not_called", "err", "kind", "inputs", "not_run", "shrink")


def slim(row: dict) -> dict:
    """``row`` (a type's) as a --quantizer sweep stores it: :data:`SLIM_KEYS` only, zero verdict counts and an
    ``inputs`` of "ok" left out, errors to two significant digits."""
    def small(c: dict) -> dict:
        out = {k: c[k] for k in SLIM_KEYS if k in c and not (k == "inputs" and c[k] == "ok")}
        if out.get("counts"):
            out["counts"] = {k: v for k, v in out["counts"].items() if v}
        if isinstance(out.get("err"), list):
            out["err"] = [float(f"{x:.2g}") if isinstance(x, float) else x for x in out["err"]]
        return out

    return {"type": row["type"], "swept_on": row.get("swept_on"), "classes": [small(c) for c in row["classes"]]}


def compare_rows(default_rows: list[dict], engine_rows: list[dict]) -> list[dict]:
    """One entry per (type, class) the engine's sweep measured: both rows, the kind, the difference class."""
    by = {(r["type"], c["class"]): c for r in default_rows for c in r["classes"]}
    out = []
    for r in engine_rows:
        for c in r["classes"]:
            a = by.get((r["type"], c["class"]))
            if a is None and c["class"] == "?":  # a timeout row: the type's classes in the defaults' sweep
                a = next((x for (t, _), x in by.items() if t == r["type"]), None)
            out.append({"type": r["type"], "class": c["class"], "kind": c.get("kind") or "-", "a": a or {}, "b": c,
                        "difference": difference(a, c)})
    return out


def compare_table(default_json: dict, engine_json: dict, only_differences: bool = True) -> str:
    """The ``--compare`` report: counts of each difference class (per model kind), then per type and class the
    outcome, verdict counts and ``err`` of both sweeps side by side (the rows that differ, or all)."""
    import collections

    rows = compare_rows(default_json["rows"], engine_json["rows"])
    engine = engine_json.get("label") or "engine"
    for r in rows:  # a refused class's kind says why it is unknown: counted as "unknown"
        r["kind"] = r["kind"].split(" ")[0]
    kinds = sorted({r["kind"] for r in rows})
    counts = collections.Counter((r["difference"], r["kind"]) for r in rows)
    out = [f"Defaults ({(default_json.get('label') or 'A')[:60]}…) vs {engine}: {len(rows)} classes of "
           f"{len({r['type'] for r in rows})} types.", "",
           "| difference | " + " | ".join(kinds) + " | all |", "|---|" + "---|" * (len(kinds) + 1)]
    for d, text in DIFFERENCES.items():
        n = [counts[(d, k)] for k in kinds]
        if sum(n):
            out.append(f"| {text} | " + " | ".join(map(str, n)) + f" | {sum(n)} |")
    out += ["", "Verdicts: exact/centered/per-norm/approximate/skipped.", "",
            "| model type | class | kind | outcome | verdicts | exact err, 2 shapes | difference | engine's note |",
            "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if only_differences and r["difference"] in ("same", "unmeasured"):
            continue
        a, b = r["a"], r["b"]
        note = "" if outcome(b) in ("converted", "partial") else (b.get("patch") or b.get("build") or "")
        note = note.replace("|", "\\|").replace("\n", " ")[:160]
        out.append(f"| {r['type']} | {r['class']} | {r['kind']} | {outcome(a) if a else '-'} → {outcome(b)} | "
                   f"{verdicts(a)} → {verdicts(b)} | {fmt_err(a)} → {fmt_err(b)} | {r['difference']} | {note} |")
    return "\n".join(out)


HEADER = """# Every transformers model type, converted with no inputs

<!-- generated by benchmarks/sweep_transformers.py --write; edit the script, not this page -->

Every model type the installed transformers ships whose modeling code uses a LayerNorm: the base
class and the main head class of each, built tiny from the config's defaults (2 layers, width 32,
small vocabulary, image and audio sizes; random weights, float64, LayerNorm γ/β and biases
randomised, eval mode), then `normswap.patch(model)` with **no inputs**, as `normswap convert`
calls it: normswap builds the inputs itself. Columns: whether it converted, was refused (one line
saying why; `no-run` when the model did not run on the inputs normswap built) or crashed; the
outcome in the previous sweep (`before`: `benchmarks/transformers_sweep_before.json`, where measured); the
verdict counts; the max relative output error of the exact norms
(`mode="exact"`) against the float64 original at two input shapes (1 x 5 and 2 x 11 tokens;
images and audio at their configured size); the refusal or the model's own note.

The tiny config is self-consistent by rules, not by a per-type table: every size under another name
follows the one it equals (a width named after the hidden size, a head width after the head count,
MLA's rope/nope/value head widths and LoRA ranks together, a multiple of the hidden size, per-channel
conv groups and codebook vectors), experts cut to 4 with at most 2 per token, every per-layer list cut
with the layer count keeping one layer of each kind (a hybrid model stays hybrid; a kind named by layer
indices, such as cross-attention or global-attention layers, keeps a layer), hidden states read out at
listed layers keeping their number inside the tiny depth (also when the list indexes a sub-config's
layers; a width derived from their count follows), multimodal RoPE sections summing to the rotary
half-width, a media token id the modeling code reads but the config lacks set, an image that is a whole
number of patches, Swin windows that fit the last stage, detection queries that fit a tiny image, a
backbone keeping the layers it is read at. When that does not build (or stays over 30M parameters, or
keeps a vocabulary over 65,536 tokens to fit a special id), the special token ids are renumbered into a
small vocabulary, then a conv pyramid keeps its first two downsampling stages (a config still over 30M
parameters), then a mild shrink keeps every width (layers, experts and vocabularies cut).

"Unbuilt" types are those whose default config does not build tiny even so (the sweep's shrinking, not
normswap); they are counted apart. When no inputs run the fully shrunk model, the sweep builds it again
with the mild shrink, the model's own widths ("[widths kept]" in the note), for sizes that derive from
each other in ways the rules do not know.

**Runnable** means that some inputs run the class: normswap's built inputs, or the sweep's oracle,
which is not normswap: the model's own `dummy_inputs`, its feature extractor's defaults applied to a
second of noise, or inputs written by hand for a few types whose forwards take arguments no generic rule
builds (`oracle_inputs` in the script). The measure the issue sets, "types some inputs can run that
convert with no inputs", counts a type when one of its classes is runnable and converted when every
runnable class converted; the two lists at the end give the rest, each with its one-line reason.

A class whose patch succeeded but where some LayerNorms were never called by the built inputs (the
planner keeps them as LayerNorm: "not called by the example inputs") is **partial**, not converted: it
is counted apart, with the number of such LayerNorms, and its type does not count as converted.

Regenerate everything (every type, the JSON and this page, with the before column; about 40 minutes
with two free cores):

```
PYTHONPATH=$PWD python benchmarks/sweep_transformers.py --write --jobs 2 \\
    --before benchmarks/transformers_sweep_before.json
```

A few types: `--only vit,whisper --json /tmp/x.json` (printed, nothing committed is written); in chunks:
`--write --start 0 --count 100` (rows accumulate in the JSON); the page again from the JSON:
`--render --write --before benchmarks/transformers_sweep_before.json`; a "before" run of other code:
`PYTHONPATH=/path/to/old/checkout python benchmarks/sweep_transformers.py --json old.json`.

"""


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="regenerate everything (every type, benchmarks/transformers_sweep.json and "
               "docs/results/transformers-sweep.md; about 40 min with two free cores):\n"
               "  PYTHONPATH=$PWD python benchmarks/sweep_transformers.py --write --jobs 2 "
               "--before benchmarks/transformers_sweep_before.json\n"
               "a few types, printed:  PYTHONPATH=$PWD python benchmarks/sweep_transformers.py --only vit,whisper\n"
               "the page from the JSON as it is:  python benchmarks/sweep_transformers.py --render --write "
               "--before benchmarks/transformers_sweep_before.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--only", help="comma-separated model types")
    ap.add_argument("--start", type=int, default=0, help="skip the first N types (run in chunks)")
    ap.add_argument("--count", type=int, default=None, help="run N types from --start")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--limit", type=float, default=TYPE_LIMIT_S, help="seconds per type")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here (default with --write: "
                    "benchmarks/transformers_sweep.json); rows already there for other types are kept")
    ap.add_argument("--before", type=Path, default=None, help="JSON of an earlier run, for the before line")
    ap.add_argument("--label", default=None, help="what this run is, stored in the JSON")
    ap.add_argument("--write", action="store_true", help="write the docs page and the JSON")
    ap.add_argument("--render", action="store_true", help="no sweep: the table from the JSON as it is")
    ap.add_argument("--quantizer", default=None, metavar="ENGINE",
                    help="pass quantizer=ENGINE to every normswap.patch call; rows record the model kind found and "
                         "the options set; --write then writes benchmarks/" + QUANTIZER_JSON.format("ENGINE")
                         + " (not the defaults' JSON or page) and prints the comparison with the defaults' JSON")
    ap.add_argument("--compare", type=Path, default=None, metavar="DEFAULTS_JSON",
                    help="no sweep: compare the --json run (or --quantizer's JSON) with this defaults run, per type "
                         "and class: outcome, verdict counts, err side by side and the class of each difference")
    ap.add_argument("--all-rows", action="store_true", help="with --compare: every row, not only the differing")
    args = ap.parse_args()
    if args.worker:
        worker(args.worker.split(","), args.quantizer)
        return
    if args.quantizer:
        from normswap.quantizers import QUANTIZER_NAMES

        if args.quantizer not in QUANTIZER_NAMES:
            sys.exit(f"--quantizer must be one of {', '.join(QUANTIZER_NAMES)}, not {args.quantizer!r}")
        args.label = args.label or f"--quantizer {args.quantizer}"
    engine_json = REPO / "benchmarks" / QUANTIZER_JSON.format(args.quantizer) if args.quantizer else None
    if args.compare:
        other = args.json or engine_json
        if other is None or not other.exists() or not args.compare.exists():
            sys.exit("--compare DEFAULTS_JSON needs --json ENGINE_JSON (or --quantizer ENGINE with its JSON written)")
        print(compare_table(json.loads(args.compare.read_text()), json.loads(other.read_text()),
                            only_differences=not args.all_rows))
        return
    types = args.only.split(",") if args.only else layernorm_types()
    types = types[args.start: None if args.count is None else args.start + args.count]
    path = args.json or ((engine_json or JSON) if args.write else None)

    def save(row: dict) -> None:  # after every type: an interrupted sweep keeps what it measured
        import transformers

        old = json.loads(path.read_text()) if path.exists() else {"rows": []}
        merged = {r["type"]: r for r in old["rows"]} | {row["type"]: slim(row) if args.quantizer else row}
        meta = {"transformers": transformers.__version__, "label": args.label or old.get("label")}
        if args.quantizer:  # one row a line, compact: the file stays small enough to commit
            path.write_text(json.dumps(meta)[:-1] + ', "rows": [\n' + ",\n".join(
                json.dumps(merged[t], default=str, separators=(",", ":")) for t in sorted(merged)) + "\n]}\n")
        else:
            path.write_text(json.dumps({**meta, "rows": [merged[t] for t in sorted(merged)]}, indent=1,
                                       default=str) + "\n")

    rows = [] if args.render else sweep(types, args.jobs, args.limit, save if path is not None else None,
                                        args.quantizer)
    if path is not None and path.exists():
        rows = json.loads(path.read_text())["rows"]
    before = json.loads(args.before.read_text()) if args.before else None
    import transformers

    stored = json.loads(path.read_text()).get("transformers") if path is not None and path.exists() else None
    text = table(rows, before, len(layernorm_types()), stored or transformers.__version__)
    if args.quantizer and path is not None and JSON.exists():  # the engine's run beside the defaults'
        text = compare_table(json.loads(JSON.read_text()), json.loads(path.read_text()))
    print(text)
    if args.write and not args.quantizer:
        kept = DOC.read_text().split(KEEP, 1) if DOC.exists() else []
        DOC.write_text(HEADER + text + "\n" + (f"\n{KEEP}{kept[1]}" if len(kept) == 2 else ""))
    t = totals(rows)
    sys.exit(1 if t["classes_crashed"] or t["exact_over_1e-9"] else 0)


if __name__ == "__main__":
    main()
