"""The options ``convert`` and ``inspect`` share, defined once: what shapes the plan, the rotation, and which
model is loaded. ``inspect`` takes them so that it shows the plan ``convert`` would make with the same options
(:func:`conversion_options` resolves them the same way for both), and refuses the same combinations
(:func:`check_combination`, exit 2). Nothing here imports torch: ``--help`` and argument errors answer fast.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import click

from normswap import quantizers
from normswap.cli.common import (
    BETA_PLACEMENTS,
    FORMATS,
    LAYER_SCALES,
    MODES,
    PRESET_NAMES,
    ROTATIONS,
    STEM_CENTERINGS,
    TASK_NAMES,
    WRITER_CENTERINGS,
    check_input_file,
    say,
)
from normswap.errors import NormswapError, UsageError
from normswap.options import valid_online_block
from normswap.quantizers import QUANTIZER_NAMES

# the options that change the plan (verdicts, where γ and β go, centering ops, ties, widths), in --help order
PLAN_OPTIONS = (
    click.option(
        "--mode",
        type=click.Choice(MODES),
        default="auto",
        show_default=True,
        help="exact: only exact norms; all: also Post-LN (approximate); auto: all, with warnings.",
    ),
    click.option(
        "--format",
        "fmt",
        type=click.Choice(FORMATS),
        default="native",
        show_default=True,
        help="native: RMSNorm modules + manifest; compat: stock architecture, LayerNorms kept, exact.",
    ),
    click.option(
        "--quantizer",
        type=click.Choice(QUANTIZER_NAMES),
        default=None,
        help="The engine you will quantize the output with: sets the options that engine was measured to need on "
        "the kind of model the analysis finds (Pre-LN, Pre-LN with LayerScale, Post-LN encoder: --writer-centering, "
        "--per-norm-centering, --no-mean-carry) and --format compat where the engine needs it (docs/deployment.md, "
        "\"At a glance\"). Options you pass yourself win; convert prints what it set, the manifest records it. "
        "none: the defaults.",
    ),
    click.option("--fold-gamma", is_flag=True, help="Also fold γ into reader weights (RMSNorm weight = 1)."),
    click.option(
        "--per-norm-centering",
        is_flag=True,
        help="Post-LN norms: insert one centering op (a mean per token) before each, which makes them exact "
        "at LayerNorm's cost (verdict exact-with-per-norm-centering, counted apart). An embedding norm that alone "
        "reads its tables' stream (BERT) takes one with or without this flag (without it, not under --rotate or "
        "--fold-gamma), and the tables keep their rows.",
    ),
    click.option(
        "--no-mean-carry",
        is_flag=True,
        help="Keep MLPs at their stock width. By default a Post-LN norm whose stream is h + MLP(h) becomes "
        "exact by adding a few neurons to that MLP that cancel the mean (its width padded to a multiple of "
        "--carry-multiple); with this flag "
        "those norms are approximate instead.",
    ),
    click.option(
        "--no-constant-trades",
        is_flag=True,
        help="Center every embedding writer on its own. By default a centered position table keeps its row means "
        "where a bias or class token reaching the same tokens takes them away instead (exact; what a static int8 "
        "quantizer needs on a ViT/DINOv2).",
    ),
    click.option(
        "--carry-multiple",
        type=click.IntRange(1, 4096),
        default=8,
        show_default=True,
        metavar="N",
        help="Pad an MLP the mean carry widens to a multiple of N neurons. Pass your weight quantizer's group "
        "size when it groups along the MLP's width (OpenVINO NNCF int4: 128), which must divide the width.",
    ),
    click.option(
        "--no-bias-slots",
        is_flag=True,
        help="With --fold-gamma: keep β/γ in a norm whose reader has no bias (GPT-2's LM head). By default that "
        "reader gets a bias holding W·β (native format; compat moves it back into the LayerNorm), since a "
        "small γ makes β/γ a large constant that activation quantization pays for.",
    ),
    click.option(
        "--beta-placement",
        type=click.Choice(BETA_PLACEMENTS),
        default=None,
        help="Where a norm's β goes without --fold-gamma: 'keep' keeps every β in its norm (readers' biases and "
        "inputs stay the original's: int8 engines such as CTranslate2 and ONNX Runtime quantize them as they did "
        "the original; the default: weight-only 4-bit/8-bit engines too quantize a folded model worse); 'rounding' "
        "folds it into the readers' biases unless that rounds worse in bfloat16 than the original's own path (one "
        "add fewer per folded norm: the in-memory patch's default); 'fold' folds it wherever the readers can take "
        "it. All exact.",
    ),
    click.option(
        "--layer-scale",
        type=click.Choice(LAYER_SCALES),
        default="keep",
        show_default=True,
        help="A LayerScale λ (DINOv2, BEiT) whose writer is centered: 'keep' leaves it as a per-channel scale "
        "that gives every row of the writer nearly all of the original weight's range (per-tensor int8 then "
        "quantizes it almost as finely as per-channel); 'fold' multiplies it into the writer's rows (λ = 1). "
        "Both exact.",
    ),
    click.option(
        "--stem-centering",
        type=click.Choice(STEM_CENTERINGS),
        default=None,
        help="A stream started by a Linear or conv (a ViT/DINOv2 patch convolution, an input projection): 'op' "
        "keeps its weights and centers the stream with one mean per token where it starts (exact-with-centering; "
        "int8/4-bit quantizers then round the original's weights, and the op removes their rounding error's mean "
        "as the original's first LayerNorm did; default); 'weights' centers that writer's weights instead (no op; "
        "default with --rotate or --fold-gamma: a rotation then folds into those weights, and where the op would "
        "leave norms approximate that centered weights make exact). Both exact.",
    ),
    click.option(
        "--writer-centering",
        type=click.Choice(WRITER_CENTERINGS),
        default="weights",
        show_default=True,
        help="The writers inside the layers (a Pre-LN block's attention output and MLP down projections): 'weights' "
        "centers their weights (each row minus the mean row; no op); 'op' keeps the original's weights and centers "
        "each one's output by one mean per token after it (two ops per block); 'auto' does that for the writers a "
        "LayerScale scales (DINOv2, BEiT; their rows balanced as --layer-scale keep does) or whose centering would "
        "widen a weight row more than 2x, and centers the others by weights (GPT-2, Whisper: the default). For "
        "engines that round each weight row on its own scale (torchao int8, OpenVINO NNCF int8 weights, LLM.int8) "
        "use 'op' or 'auto' ('auto' keeps ONNX Runtime's per-tensor int8 gain too); ONNX Runtime's per-channel int8 "
        "gains most from 'weights' (docs/deployment.md). Each op is one unfused mean in OpenVINO's CPU plugin "
        "(DINOv2-small: up to 1.1x the default's time on one small image). All exact.",
    ),
    click.option(
        "--untie/--keep-tied",
        "untie",
        default=None,
        help="What to do with an output head tied to the input embedding. Default: keep the tie (one centering "
        "op per token at run time; quantizers see the head as the original has it) and untie only where the plan "
        "needs it (--fold-gamma, a rotation). --untie clones the head so the embedding is centered by weights "
        "(no op; the checkpoint grows by the embedding's size, GPT-2: about +50%); --keep-tied never unties.",
    ),
    click.option("--no-untie", "no_untie", is_flag=True, hidden=True, help="Alias of --keep-tied."),
)

# the rotation: --rotate (and --rotate-output) change the plan (γ folded into the streams it turns); the others
# set the rotation itself, checked against --rotate by check_combination
ROTATION_OPTIONS = (
    click.option(
        "--rotate",
        "rotation",
        type=click.Choice(ROTATIONS),
        default=None,
        help="After converting, rotate every rotation-ready residual stream by an orthogonal Q (outputs "
        "unchanged): hadamard = randomized Hadamard (QuaRot's choice; a random orthogonal Q where no "
        "Hadamard order fits the width), random = random orthogonal, learned = the Hadamard times an "
        "orthogonal R learned on --calibration-data (default: built-in batches) for the quantizer the --learn-* "
        "options describe (SpinQuant's R1), none = no stream turned, only --online-hadamard's ops, before every Linear "
        "input (norms keep γ and β: the 4-bit choice for models with uneven γ, e.g. DINOv2). γ is folded into the "
        "readers of the streams it turns; the norms of "
        "a stream it leaves alone keep γ and β as without --rotate (add --fold-gamma to fold γ everywhere). Q keeps "
        "the "
        "mean (Q·1 = 1), so --format compat works too. Recorded in the manifest.",
    ),
    click.option("--learn-bits", type=click.IntRange(2, 8), default=None, metavar="N",
                  help="With --rotate learned: the weight bits it is learned for (default 4)."),
    click.option("--learn-act-bits", type=click.IntRange(2, 16), default=None, metavar="N",
                  help="With --rotate learned: per-token activation bits it is learned for (default: none, "
                  "weight-only quantization)."),
    click.option("--learn-group-size", type=click.IntRange(2), default=None, metavar="N",
                  help="With --rotate learned: one weight scale per N inputs, as block-wise 4-bit quantizers "
                  "(ONNX Runtime MatMulNBits: 32; default: one per output channel)."),
    click.option("--learn-steps", type=click.IntRange(0, 100_000), default=None, metavar="N",
                  help="With --rotate learned: optimiser steps, one calibration batch each (default 100)."),
    click.option("--learn-grid", default=None, metavar="GRID[+GRID]",
                  help="With --rotate learned: the weights' integer grid: symmetric (±(2^(b-1)-1): RTN, CTranslate2, "
                  "torchao; default), full (-2^(b-1) … 2^(b-1)-1, the largest magnitude at the far end: ONNX "
                  "Runtime's symmetric MatMulNBits) or asymmetric (min … max with a zero point: HQQ's start, "
                  "asymmetric int4); several joined by + (full+asymmetric) take turns in the loss."),
    click.option("--learn-scales", is_flag=True, default=None,
                  help="With --rotate learned: also learn a per-channel scale between each norm and its readers "
                  "(exact; the norms keep it as their weight). Not with --smooth."),
    click.option("--learn-logit-top-k", type=click.IntRange(1), default=None, metavar="K",
                  help="With --rotate learned: the loss's KL over each calibration batch's K likeliest tokens per "
                  "position, its input tokens and one class for all other tokens (estimated from a sample), the output "
                  "head turned and rounded on those rows only (a large vocabulary's head is otherwise most of a step; "
                  "default: the whole vocabulary)."),
    click.option("--learn-heads", is_flag=True, default=None,
                  help="With --rotate learned: also learn one rotation per attention layer on each head's values and "
                  "the output projection's columns of that head (SpinQuant's R2; exact, weights only)."),
    click.option("--seed", "rotate_seed", type=int, default=0, show_default=True,
                  help="With --rotate: the seed of the random signs / random matrix (stream i uses seed + i)."),
    click.option(
        "--rotate-output",
        type=click.Choice(("rotated", "restore")),
        default=None,
        help="With --rotate, for a stream whose last norm output is a model output (a ViT backbone's "
        "last_hidden_state): rotated = that output comes out rotated (cosines and inner products kept; Q in "
        "the manifest); restore = one un-rotation after the last norm (outputs unchanged). Default: such "
        "streams are not rotated.",
    ),
    click.option("--online-hadamard", is_flag=True,
                  help="With --rotate and --format native: also the online Hadamard rotations (before every MLP down "
                  "projection; with --rotate none before every Linear input)."),
    click.option("--online-block", "online_block", type=int, default=None, metavar="N",
                  help="With --online-hadamard: block-diagonal online Hadamards x·D·(I ⊗ H_N)/sqrt(N), N a power of "
                  "two "
                  "(32, 64, 128), on every op whose width is a multiple of N larger than N (the others stay full): N "
                  "multiply-adds per feature instead of the full transform's, one MatMul when exported; exact. The "
                  "report and the manifest say which widths took it. Default: the full Hadamard."),
    click.option("--smooth", "smooth", type=click.FloatRange(0.0, 1.0), default=None, metavar="ALPHA",
                  help="With --rotate: after the rotation, move a per-channel scale between each norm's weight and "
                  "its readers' input columns (SmoothQuant's alpha, e.g. 0.5), measured on --calibration-data "
                  "(default: built-in batches). Exact; works with --format compat. With --rotate none "
                  "--online-hadamard: the scale goes in before the ops, in the norm's own basis (γ and β / s)."),
)

# which model is loaded, and from where
SOURCE_OPTIONS = (
    click.option("--trust-remote-code", is_flag=True, help="Allow custom modeling code shipped with MODEL."),
    click.option(
        "--revision",
        default=None,
        help="With a Hub id: the branch, tag or commit (default main). Offline (HF_HUB_OFFLINE=1) or with "
        "the Hub unreachable, a Hub id is read from the Hugging Face cache (HF_HOME / HF_HUB_CACHE), as "
        "transformers reads it.",
    ),
    click.option(
        "--allow-pickle", is_flag=True, help="Accept pickle-only (.bin) checkpoints. Only for trusted files."
    ),
    click.option(
        "--task",
        type=click.Choice(TASK_NAMES),
        default=None,
        help="Model class to load (default: from config.architectures); presets too. Loading a masked-LM "
        "checkpoint as sequence-classification (or base, whose pooler it lacks) needs --new-head.",
    ),
    click.option(
        "--new-head",
        is_flag=True,
        help="With --task: allow a task head (or a pooler) that the checkpoint's own class lacks (random "
        "init, recorded in the manifest). Without it any missing tensor is an error.",
    ),
)

# how the model is read: whole, or streamed tensor by tensor (inspect: planned as the streamed conversion plans)
MEMORY_OPTIONS = (
    click.option(
        "--low-memory/--in-memory",
        "low_memory",
        default=None,
        help="Stream tensors shard by shard, never holding the whole model; the plan then comes from 3- and "
        "4-layer copies with random weights, extrapolated to full depth (inspect shows that plan without "
        "loading the model). Default: automatic when the in-memory conversion's predicted peak would not fit "
        "in the available RAM.",
    ),
)


def _apply(options: tuple[Callable[[Any], Any], ...]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):  # the first listed is the first in --help
            fn = option(fn)
        return fn

    return decorate


plan_options = _apply(PLAN_OPTIONS)
"""``--mode``, ``--format``, ``--fold-gamma``, ... ``--untie/--keep-tied``: the options that change the plan."""
rotation_options = _apply(ROTATION_OPTIONS)
"""``--rotate``, ``--learn-*``, ``--seed``, ``--rotate-output``, ``--online-hadamard``, ``--online-block``,
``--smooth``."""
source_options = _apply(SOURCE_OPTIONS)
"""``--trust-remote-code``, ``--revision``, ``--allow-pickle``, ``--task``, ``--new-head``."""
memory_options = _apply(MEMORY_OPTIONS)
"""``--low-memory/--in-memory``: the whole model in memory, or streamed (planned from proxies)."""


def learn_settings(learn_bits: int | None, learn_act_bits: int | None, learn_group_size: int | None,
                   learn_steps: int | None, learn_grid: str | None, learn_scales: bool | None,
                   learn_heads: bool | None, learn_logit_top_k: int | None) -> dict[str, Any]:
    """The ``--learn-*`` options given, as ``ConvertOptions.rotate_learn``'s dict (empty: none given)."""
    return {k: v for k, v in (("bits", learn_bits), ("act_bits", learn_act_bits), ("group_size", learn_group_size),
                               ("steps", learn_steps), ("grid", learn_grid), ("scales", learn_scales or None),
                               ("heads", learn_heads or None), ("logit_top_k", learn_logit_top_k))
            if v is not None}


def conversion_options(params: dict[str, Any], *, verify: bool = True, verify_dtype: str = "auto",
                       allow_unusable: bool = False) -> dict[str, Any]:
    """The :class:`normswap.ConvertOptions` fields that the shared options set, from a command's parameters
    (``--no-untie`` read as ``--keep-tied``), after :func:`check_combination` has passed them. ``convert``
    adds the verification settings; ``inspect`` resolves the result for ``--format`` as ``convert`` does
    (:func:`normswap.checkpoint.conversion.check_options`), so both plan alike."""
    p = params
    learn = learn_settings(p["learn_bits"], p["learn_act_bits"], p["learn_group_size"], p["learn_steps"],
                           p["learn_grid"], p["learn_scales"], p["learn_heads"], p["learn_logit_top_k"])
    return dict(
        mode=p["mode"],
        fold_gamma=p["fold_gamma"],  # --rotate folds γ where it turns the stream; --fold-gamma everywhere
        rotate=p["rotation"],
        rotate_seed=p["rotate_seed"],
        rotate_output=p["rotate_output"],
        online_hadamard=p["online_hadamard"],
        online_block=p["online_block"],
        rotate_smooth=p["smooth"],
        rotate_learn=learn or None,
        untie=False if p["no_untie"] else p["untie"],
        per_norm_centering=p["per_norm_centering"],
        mean_carry=not p["no_mean_carry"],
        trade_constants=not p["no_constant_trades"],
        carry_multiple=p["carry_multiple"],
        bias_slots=not p["no_bias_slots"],
        beta_placement=p["beta_placement"],
        layer_scale=p["layer_scale"],
        stem_centering=p["stem_centering"],
        writer_centering=p["writer_centering"],
        quantizer=p["quantizer"],
        quantizer_overrides=tuple(p.get("quantizer_overrides", ())),
        verify=verify,
        verify_dtype=verify_dtype,
        allow_unusable=allow_unusable,
    )


# the options --quantizer may set -> their parameter names here
_QUANTIZER_PARAMS = {"writer_centering": "writer_centering", "per_norm_centering": "per_norm_centering",
                     "mean_carry": "no_mean_carry", "format": "fmt"}


def apply_quantizer(params: dict[str, Any], ctx: click.Context) -> None:
    """``--quantizer``: record which of the options it may set were given on the command line (click's parameter
    source: those win, ``params["quantizer_overrides"]``), put the engine's format in ``params["fmt"]`` where
    ``--format`` was not given, and refuse what the engine's options cannot go with (exit 2). Before
    :func:`check_combination`, which then checks the combination with the format resolved."""
    name = params.get("quantizer")
    if name is None:
        return
    explicit = tuple(field for field, param in _QUANTIZER_PARAMS.items()
                     if ctx.get_parameter_source(param) not in (click.core.ParameterSource.DEFAULT,
                                                                click.core.ParameterSource.DEFAULT_MAP, None))
    params["quantizer_overrides"] = explicit
    params["fmt"] = quantizers.format_for(name, params["fmt"] if "format" in explicit else None)
    try:
        quantizers.check_combination(name, explicit, rotate=params["rotation"], format=params["fmt"],
                                     low_memory=params.get("low_memory"))
    except NormswapError as exc:
        raise UsageError(str(exc)) from None


def echo_quantizer(plan: Any, fmt: str | None, params: dict[str, Any], quiet: bool = False) -> None:
    """What ``convert``/``inspect`` say about ``--quantizer``: the line naming what the engine set on this model
    and which of your options were kept over its choice (stdout), and a note for an option you gave that the
    engine's measurements advise against (:func:`~normswap.cli.common.say`, stderr, silenced by ``quiet``)."""
    record = plan.options.get("quantizer") if plan is not None else None
    if not record:
        return
    click.echo(f"quantizer: {quantizers.describe(record, fmt)}")
    q = quantizers.QUANTIZERS.get(record["name"])
    given = {"--fold-gamma": params.get("fold_gamma"), "--rotate": params.get("rotation")}
    for flag, why in (q.avoid.items() if q is not None else ()):
        if given.get(flag):
            say("note", f"{flag} with --quantizer {q.name}: {why}", quiet)
    if q is not None and q.format == "compat" and fmt == "native" and q.native:
        say("note", f"--format native with --quantizer {q.name}: {q.native}", quiet)


def check_combination(params: dict[str, Any], *, calibration_data: str | None = None,
                      low_memory: bool | None = None, model: str | None = None) -> None:
    """Options that conflict or depend on one another, and a missing --calibration-data file: a usage
    error (exit 2), answered before torch is imported. The library checks the same combinations for
    Python callers (``checkpoint.conversion.check_options``), in its own words. ``params``: the command's
    parameters (the shared options' names); ``convert`` adds its ``--calibration-data``, both ``--low-memory``
    and the MODEL argument (``--low-memory`` streams a checkpoint on disk, never a preset). A ``--format`` that
    ``--quantizer`` chose (:func:`apply_quantizer`) is named as the engine's in the error."""
    try:
        _check_combination(params, calibration_data=calibration_data, low_memory=low_memory, model=model)
    except UsageError as exc:
        name = params.get("quantizer")
        if name is None or "format" in params.get("quantizer_overrides", ()) or "--format" not in str(exc):
            raise
        raise UsageError(f"{exc} (--quantizer {name} writes --format {params['fmt']})") from None


def _check_combination(params: dict[str, Any], *, calibration_data: str | None, low_memory: bool | None,
                       model: str | None) -> None:
    p = params
    mode, fmt, fold_gamma, rotation = p["mode"], p["fmt"], p["fold_gamma"], p["rotation"]
    per_norm_centering, no_bias_slots, task, new_head = p["per_norm_centering"], p["no_bias_slots"], p["task"], \
        p["new_head"]
    rotate_seed, rotate_output, online_hadamard, online_block = p["rotate_seed"], p["rotate_output"], \
        p["online_hadamard"], p["online_block"]
    smooth, beta_placement, writer_centering = p["smooth"], p["beta_placement"], p["writer_centering"]
    learn = learn_settings(p["learn_bits"], p["learn_act_bits"], p["learn_group_size"], p["learn_steps"],
                           p["learn_grid"], p["learn_scales"], p["learn_heads"], p["learn_logit_top_k"])
    if rotation is None and (online_hadamard or rotate_output or rotate_seed or smooth is not None):
        what = "--online-hadamard" if online_hadamard else "--rotate-output" if rotate_output else \
            "--smooth" if smooth is not None else "--seed"
        raise UsageError(f"{what} applies to a rotation: pass --rotate hadamard (or random) too")
    if online_block is not None and not online_hadamard:
        raise UsageError("--online-block sets the block size of the online Hadamards: pass --online-hadamard (and "
                         "--rotate none or hadamard) too")
    if online_block is not None and not valid_online_block(online_block):
        raise UsageError(f"--online-block {online_block}: pass a power of two of at least 2 (e.g. 32, 64, 128)")
    if writer_centering in ("op", "auto") and rotation not in (None, "none"):
        raise UsageError(f"--writer-centering {writer_centering} keeps writers' weights and centers their outputs by "
                         "ops, which "
                         f"--rotate {rotation} cannot fold its rotation into: drop one of them (--rotate none "
                         "--online-hadamard works with it)")
    if rotation == "none" and not online_hadamard:
        raise UsageError("--rotate none turns no stream, it only adds the online Hadamards: pass --online-hadamard "
                         "too (and --format native)")
    if learn and rotation != "learned":
        flag = "--learn-" + next(iter(learn)).replace("_", "-")
        raise UsageError(f"{flag} applies to a learned rotation: pass --rotate learned too")
    grids = str(learn.get("grid") or "symmetric").split("+") if learn else []
    # the names of normswap.rotation.learn.GRIDS, spelled here: that module imports torch
    if any(g not in ("symmetric", "full", "asymmetric") for g in grids) or len(set(grids)) != len(grids):
        raise UsageError(f"--learn-grid {learn['grid']!r}: pass symmetric, full or asymmetric, or several of them "
                         "joined by + (e.g. full+asymmetric)")
    if learn and learn.get("scales") and smooth is not None:
        raise UsageError("--learn-scales and --smooth both set each norm's scale: pass one of them")
    if no_bias_slots and not fold_gamma and rotation in (None, "none"):  # --rotate none folds no γ
        raise UsageError("--no-bias-slots applies with --fold-gamma (or a --rotate that turns streams) only: a bias "
                         "slot takes the β of a γ-folded norm, and without --fold-gamma none is made; pass "
                         "--fold-gamma too, or drop --no-bias-slots")
    if beta_placement in ("keep", "rounding") and fold_gamma:  # with --rotate alone: the norms it does not turn
        raise UsageError(f"--beta-placement {beta_placement} applies without --fold-gamma: a norm whose γ is folded "
                         "into its readers has no γ for β to sit behind, so β leaves every such norm whatever the "
                         "placement; drop --beta-placement, or drop --fold-gamma")
    if new_head and task is None:
        raise UsageError("--new-head adds a task head: name it with --task (e.g. --task sequence-classification)")
    if fmt == "compat" and mode == "all":
        raise UsageError("--format compat keeps LayerNorms, so approximate norms cannot be converted: use --mode "
                         "exact or --mode auto with --format compat, or --format native with --mode all")
    if fmt == "compat" and rotate_output == "restore":
        raise UsageError("--rotate-output restore adds an un-rotation op the stock architecture lacks: use --format "
                         "native, or --rotate-output rotated with --format compat")
    if fmt == "compat" and online_hadamard:
        raise UsageError("--online-hadamard adds ops the stock architecture lacks: use --format native with it, or "
                         "drop it for --format compat")
    if low_memory:
        if p.get("example_inputs") is not None or p.get("samples"):
            raise UsageError("example inputs (--example-inputs, --sample) need the whole model in memory; drop "
                             "--low-memory")
        for flag, given in (("--rotate", rotation), ("--calibration-data", calibration_data),
                            ("--per-norm-centering", per_norm_centering)):
            if given:
                raise UsageError(f"{flag} needs the whole model in memory; drop --low-memory or {flag}")
        if writer_centering == "auto":
            raise UsageError("--writer-centering auto chooses each writer's centering from its own weights, which "
                             "--low-memory plans without: drop --low-memory, or pass --writer-centering op or weights")
    if low_memory and model in PRESET_NAMES and not os.path.exists(model):
        raise UsageError(f"--low-memory streams a checkpoint on disk and {model} is a preset; save it first "
                         "(normswap.presets.save) or drop --low-memory")
    if calibration_data is not None:
        check_input_file(calibration_data, "--calibration-data")
