"""How a conversion runs: :class:`ConvertOptions`, and the one definition of modes, formats, dtypes and tasks.

``patch``, ``plan``, ``convert``, the low-memory path, the CLI and the recipes take the same
options. Each entry point accepts them as keyword arguments (a convenience) or as one
``options=ConvertOptions(...)`` object; either way they are validated here, once, and an unknown
or misspelt option is an error that suggests the nearest name instead of being ignored.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from normswap import quantizers
from normswap.errors import NormswapError

# shard sizes (``max_shard_size``); here, not in checkpoint.io, so the CLI checks them without torch
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(value: int | str) -> int:
    """``"500MB"`` / ``"2GB"`` / ``"1.5GiB"`` / ``1000000`` -> bytes (HF's decimal convention for GB)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise NormswapError(f"max shard size must be positive, not {value}")
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _UNITS:
        raise NormswapError(f"invalid size {value!r}: use a number with a unit, e.g. 500MB, 2GB or 1.5GiB")
    size = int(float(m.group(1)) * _UNITS[unit])
    if size <= 0:
        raise NormswapError(f"size must be positive, not {value!r}")
    return size


def check_out_dir(out: str | os.PathLike, *, overwrite: bool, source: str | os.PathLike | None = None) -> Path:
    """The checks on an output directory that need only its path, torch-free so that the CLI answers them before
    loading anything (``convert``, ``normswap.save``; :func:`normswap.checkpoint.io.check_destination` adds the
    rest): a usage error (exit 2) when ``out`` is no path, is empty (``--out "$DIR"`` with ``DIR`` unset must
    not mean "here"), is a file, overlaps the directory of the ``source`` model, or is a non-empty directory
    and ``overwrite`` was not given. Returns ``out`` as a path."""
    from normswap.errors import UsageError

    if not isinstance(out, (str, os.PathLike)):
        raise UsageError(f"out_dir must be a directory path (a str or os.PathLike), not {type(out).__name__}")
    if not os.fspath(out).strip():  # Path("") is ".": an unset shell variable must not mean "here"
        raise UsageError("out_dir is empty; give the directory to write to (`.` for the current one)")
    path = Path(out).expanduser()
    if path.exists() and not path.is_dir():
        raise UsageError(f"out_dir {path} exists and is not a directory; choose another path")
    if source is not None:
        src, dst = Path(source).resolve(), path.resolve()
        if dst == src or dst in src.parents or src in dst.parents:
            raise UsageError(f"out_dir {path} overlaps the source model at {source}; write somewhere else")
    if not overwrite and path.is_dir() and any(path.iterdir()):
        raise UsageError(f"out_dir {path} exists and is not empty; pass overwrite=True to replace it, "
                         "or choose a new directory")
    return path


def check_inputs_outside(out: str | os.PathLike, files: dict[str, tuple[str | os.PathLike, ...]], *,
                         out_option: str = "out_dir") -> None:
    """Refuse (a usage error, exit 2, before anything is read or written) an input file that lies inside the
    output directory ``out``: with ``overwrite`` the finished output replaces the whole directory, and the file
    the conversion read (calibration data, example inputs, samples) would be gone with it. ``files``: option
    name -> the paths given; ``out_option``: how the message names ``out``. Symlinks are resolved; a name that is
    not on disk is left to the options' own checks. The model's overlap with ``out`` is :func:`check_out_dir`'s."""
    from normswap.errors import UsageError

    dst = Path(out).expanduser().resolve()
    for option, paths in files.items():
        for given in paths:
            src = Path(given).expanduser()
            if src.exists() and dst in src.resolve().parents:
                raise UsageError(f"{option} {given} lies inside {out_option} {out}, which the output replaces; "
                                 "move the file out of it or write somewhere else")


MODES = ("auto", "exact", "all")
BETA_PLACEMENTS = ("rounding", "keep", "fold")  # where β goes in a default conversion (normswap.surgery.beta_placement)
LAYER_SCALES = ("keep", "fold")  # where a centered writer's LayerScale λ ends up (normswap.surgery.edits)
# how a stream started by a Linear/conv (a patch or feature projection) is made zero-mean (normswap.analysis.planner)
STEM_CENTERINGS = ("op", "weights")
# how a quantized writer inside the layers (a Pre-LN block's output projections) is centered (normswap.analysis.planner)
WRITER_CENTERINGS = ("weights", "op", "auto")
FORMATS = ("native", "compat")
DTYPES = ("auto", "float32", "bfloat16", "float16")  # checkpoint dtypes ``convert`` can write
VERIFY_DTYPES = ("auto", "float64", "float32")  # what the working copy computes in (normswap.memory)
# what ``rotate`` builds (normswap.rotate also takes a seed or a matrix); "none": online Hadamards only
ROTATIONS = ("hadamard", "random", "learned", "none")
# rotate_learn's keys (normswap.rotation.learn.LearnSettings)
LEARN_KEYS = ("bits", "act_bits", "group_size", "steps", "lr", "grid", "scales", "heads", "logit_top_k")
ROTATE_OUTPUTS = ("rotated", "restore")  # a stream ending in a model output: turned output, or turned back
# task name -> transformers Auto class that loads it (the --task option)
TASKS = {
    "causal-lm": "AutoModelForCausalLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "speech-seq2seq": "AutoModelForSpeechSeq2Seq",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "question-answering": "AutoModelForQuestionAnswering",
    "image-classification": "AutoModelForImageClassification",
    "audio-classification": "AutoModelForAudioClassification",
    "ctc": "AutoModelForCTC",
    "base": "AutoModel",
}


def valid_online_block(block: object) -> bool:
    """Whether ``block`` can be an ``online_block``: an int (not a bool) that is a power of two of at least 2. The
    one rule the library (:func:`check_online_block`) and the CLI's usage check (``--online-block``) apply."""
    return isinstance(block, int) and not isinstance(block, bool) and block >= 2 and not block & (block - 1)


def check_online_block(block: int | None, online: bool) -> None:
    """Refuse an ``online_block`` that is not a power of two of at least 2, or one given without ``online=True``."""
    if block is None:
        return
    if not valid_online_block(block):
        raise NormswapError(f"online_block must be a power of two of at least 2 (e.g. 32, 64, 128), not {block!r}")
    if not online:
        raise NormswapError("online_block sets the block size of the online Hadamards: pass online=True (patch: "
                            "online_hadamard=True) too")


def choose(kind: str, value: str, choices: tuple[str, ...] | dict[str, Any]) -> str:
    """``value`` if it is one of ``choices``, else a one-line error naming them (and the nearest)."""
    if value in choices:
        return value
    near = difflib.get_close_matches(str(value), list(choices), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    raise NormswapError(f"{kind} must be one of {', '.join(choices)}, not {value!r}{hint}")


@dataclass(frozen=True)
class ConvertOptions:
    """The options of a LayerNorm → RMSNorm conversion.

    Attributes:
        mode: ``"auto"`` converts every norm and warns about approximate ones; ``"exact"`` leaves
            approximate norms as LayerNorm; ``"all"`` converts everything silently. With ``"exact"`` the writers of a
            stream that only the kept LayerNorms read keep the original's weights (a LayerNorm does not need them
            centered, and a quantizer rounds the original's rows best).
        defer_approximate: with ``mode="exact"``, the approximate norms left as LayerNorm will be swapped for
            RMSNorms later (the fine-tune recipe's progressive schedule, ``normswap.recipes.models.swap_stage``), so
            their streams' writers are centered now as ``"all"`` centers them: the swap starts closer to the
            LayerNorm (tiny BERT, the recipe's progressive run, without → with it: KL before the run 4.7e-4 →
            2.9e-4, after it 3.4e-5 → 2.3e-5).
        fold_gamma: also fold γ into the reader Linears (the RMSNorm keeps weight 1: "rotation-ready"), in
            every norm where the readers allow it, whether or not a rotation turns its stream. With ``rotate``
            and without ``fold_gamma``, γ is folded only into the norms of the streams the rotation turns.
        bias_slots: with ``fold_gamma``, give a bias-less Linear reader (GPT-2's LM head) a bias that takes
            the norm's β as ``W β`` (exact), instead of keeping ``β/γ`` in the RMSNorm, a constant that a
            small γ makes huge and that per-token activation quantization then pays for. On by default;
            the native format stores the slot (a ``bias`` tensor the stock class lacks), the compat format
            moves the shift back into the stock LayerNorm's bias, and the low-memory path plans without
            slots. ``False``: β/γ stays in the norm (the behaviour before this option).
        beta_placement: where a norm's β goes in a default conversion (no ``fold_gamma``):
            ``"rounding"`` folds it into the readers' biases unless that would round worse in
            bfloat16 than the original's own path, and then keeps it in the RMSNorm
            (:mod:`normswap.surgery.beta_placement`; each norm's ``beta_detail`` says which and why);
            ``"keep"`` keeps every β in its norm (the readers' biases and inputs stay the original's, so
            int8 engines that quantize the readers' inputs see the original's ranges: CTranslate2, ONNX
            Runtime, see ``docs/deployment.md``); ``"fold"`` folds it wherever the readers can take
            it (the behaviour before these options), and also takes a Post-LN norm's β (or fitted bias)
            out through the residual's other writer (:class:`normswap.analysis.plan.ResidualFold`: one
            ``Add`` less per BERT norm in ONNX Runtime; the low-memory path refuses it). All three are
            exact; with ``fold_gamma`` (rotation) β leaves the norm whatever the placement. ``None``
            (default): ``"keep"`` where ``convert`` writes a checkpoint, either format (what engines export and
            quantize: weight-only 4-bit/8-bit engines such as bitsandbytes, HQQ, GGUF and optimum-quanto
            round a model with β folded worse too), ``"rounding"`` for an in-memory ``patch`` (one bias add
            fewer per folded norm) (:meth:`beta_placement_for`).
        layer_scale: what happens to a LayerScale λ (BEiT, DINOv2, CaiT) whose writer is centered.
            ``"keep"`` (default): the writer is centered as ``diag(λ) W`` (exact), then each output row is
            divided by a per-row scale that puts its largest entry within 8/9 of the original weight's
            ``max|w|`` (at most that), and that scale becomes the new λ: the LayerScale multiply stays, the
            weight keeps the original's range, and every row uses nearly all of it (per-tensor int8 then
            quantizes the writer almost as finely as per-channel int8). The scale has four significant
            bits, so λ is exact in bfloat16/float16. ``"fold"``: ``W ← diag(λ) W``, λ ← 1
            (the behaviour before this option); exact too, but λ's spread (DINOv2: 1e-4 to 10) spreads the
            rows of the writer apart, and a per-tensor quantizer then loses the small rows
            (``docs/results/quantization.md``). A rotation folds a kept λ into its writer before turning
            it either way.
        stem_centering: how a stream whose start is written by a weight quantizers round (a ViT/DINOv2/DeiT
            patch convolution, an audio or time-series input projection: a Linear or conv that reads no norm)
            is made zero-mean. ``"op"``: that writer keeps its original weights and one centering op (one mean
            per token) sits where the stream starts, after every writer of the start (the position table and
            class token behind it keep their weights too); the verdict is ``exact-with-centering``. An
            int8/4-bit quantizer then rounds the very weights it rounds in the original, and the op removes
            the mean of that rounding error as the original's first LayerNorm did (DINOv2-small, ONNX Runtime
            per-channel int8: typical image 1.08× the original's error with ``"weights"``, ~0.99× with
            ``"op"``; ``docs/results/quantization.md``). ``"weights"``: the writer's weights are centered
            instead (no op; the behaviour before this option). ``None`` (default): ``"op"``, or ``"weights"``
            with ``rotate`` or ``fold_gamma`` (a rotation, then or later with :func:`normswap.rotate`, folds
            ``Q`` into those weights instead of adding it as an op after the stem op, and the rotated model
            can still be written in the compat format). Embedding tables (gathers) are centered by weights
            either way (a table whose stream one norm alone reads keeps its rows instead, γ not folded: that norm
            centers its own input), and a writer no op can serve falls back to its weights.
            The default also takes ``"weights"`` where the op would leave norms approximate that centered weights make
            exact (SAM2's Hiera adds its position parameter where the op cannot reach it).
        writer_centering: how the writers inside the layers whose weights quantizers round (a Pre-LN block's
            attention output projection and MLP down projection, each Linear/conv that reads a norm's output and
            writes the residual stream) are made zero-mean. ``"weights"`` (default): their weights are centered
            (each row minus the mean row; no op). ``"op"``: they keep the original's weights and one centering op
            (one mean per token) sits right after each, after its LayerScale where there is one; the norms'
            verdict is ``exact-with-centering``. For engines that round each weight row on its own scale and
            run the ops in float: torchao's int8 dynamic scheme, OpenVINO NNCF's int8 weights, bitsandbytes'
            LLM.int8 (DINOv2-small: the centered rows cost them up to 1.08× the original's error;
            ``docs/results/quantization.md``, rounds 51-52). It gives up what the centered writers gain in ONNX
            Runtime's int8 (DINOv2-small per tensor 0.55× → 1.00×, per channel 0.80× → 0.96×) and adds two ops
            per block. ``"auto"``: an op after every writer a LayerScale scales and after any other whose
            centering would widen some output row's range by more than 2× (``max|W'_i| / max|W_i|``: a weight
            statistic, no data), every other writer centered by its weights; an op writer's λ is taken into its
            rows and balanced back out as ``layer_scale="keep"`` does for a centered writer (its rows are the
            original's up to a per-row scale, the same integers on a per-row grid, with equal maxima for a
            per-tensor grid: ONNX Runtime's per-tensor int8 keeps its gain, DINOv2-small 0.55×). DINOv2 gets an
            op after every writer, GPT-2, Whisper and BERT none (the default): ops only where an engine was
            measured to pay for the edit (DINOv2-small: ops after only the 4 writers whose rows widen left
            torchao at 1.09× and NNCF at 1.17×). The figure per writer is in ``plan.options["writer_widening"]``.
            Neither ``"op"`` nor ``"auto"`` goes with a rotation that turns streams (its ``Q`` would need an op
            after each of those writers), nor ``"auto"`` with ``low_memory=True`` (planned on a proxy without the
            real weights).
        trade_constants: let a centered position table keep its row means where a float bias or a class
            token reaching exactly the same tokens can take them away instead
            (:class:`normswap.analysis.plan.ConstantTrade`, proved by probing the model in float64): exact,
            and the table's entries then stay on the grid a static int8 quantizer rounded the original's to
            (DINOv2/ViT in ONNX Runtime's static QDQ: 1.13× the original's error without it, ~1.00× with;
            ``docs/results/quantization.md``). On by default; ``False`` centers every writer alone (the
            behaviour before this option).
        untie: what to do with an output head tied to an input embedding the conversion must center.
            ``None`` (default): keep the tie and center the embedding's output at run time (one centering
            op per token, verdict ``exact-with-centering``), and untie only where the plan needs the head's
            own weight: γ folded into it (``fold_gamma``, a rotation) or an approximate norm's head made
            blind to the leaked mean. Quantizers then see the head as the original has it: ONNX Runtime's
            skip a tied head exactly as they skip the original's (a trained GPT-2-shaped decoder untied:
            7× the original's 4-bit error; kept: 0.97×, ``docs/results/quantization.md``), and the
            checkpoint keeps its size. ``True``: clone tied heads so the embedding is centered by weights (no
            op; the default before 0.2). ``False``: never untie (a plan that needs it then keeps γ or refuses).
        per_norm_centering: make Post-LN norms exact with one mean subtraction before each (verdict
            ``exact-with-per-norm-centering``) at LayerNorm's cost; off by default. An embedding stream that one
            norm alone reads (BERT's and MPNet's word, position and token-type tables, read by the embeddings'
            LayerNorm only) takes that norm's op with or without this option (since round 63; under it alone in
            round 62; without it not where γ is folded, ``fold_gamma`` or a rotation, which turns only a stream
            its weights center), and its tables keep the original's rows: NNCF's int8 weights and ONNX Runtime's dynamic
            int8 round gathered tables, and the mean of a centered row's rounding error would pass through the
            exact RMSNorm. Tables whose stream several norms read (GPT-2's), or whose norm's output starts a
            stream several norms share (BLOOM's), keep their edit.
        mean_carry: make a Post-LN norm exact where its stream is ``h + MLP(h)`` by widening the MLP
            with a few neurons that cancel the mean (verdict ``exact``); on by default. ``False``
            keeps the MLPs at their stock width (those norms are then approximate).
        carry_multiple: the widened MLP's width is padded (with zero neurons) to a multiple of this
            (default 8: BERT-base 3072 → 3080, the width CPU GEMMs run at the stock width's speed). A
            weight quantizer with groups along the MLP's width needs the width to divide by its group:
            pass the group size (OpenVINO NNCF int4 ``group_size=128``: 3072 → 3200, +4% FFN FLOPs).
        calibration: inputs (or a list of them) to fit approximate norms by least squares; ``None``
            uses a built-in set, ``False`` fits nothing (γ/β copied).
        sequential: fit approximate norms one after another on the converted model's activations.
        tokenizer: tokenizer for the built-in calibration text and the verification probe (default:
            the model's own, from the directory it was loaded from, its preset, or the local Hugging
            Face cache for a model loaded by Hub id).
        verify: compare against the original and refuse conversions that miss tolerance.
        verify_dtype: what the working copy (analysis, verification) computes in, and so what the
            original is compared in: ``"auto"`` (default) float64 where the predicted peak with a float64
            copy fits in the memory available, else float32 (:func:`normswap.memory.choose_precision`;
            the report says which, why, and the tolerance applied); ``"float64"`` refuses in one line
            where it does not fit; ``"float32"`` never takes a float64 copy (less memory, a looser
            tolerance). The surgery's arithmetic is float64 per tensor either way.
        allow_unusable: convert even when the held-out figures say the result is unusable.
        backend: the RMSNorm backend of the new modules (``"auto"`` or a name from
            ``normswap backends``).
        rotate: after the conversion, rotate every rotation-ready residual stream
            (:func:`normswap.rotate`): ``"hadamard"`` (randomized Hadamard, QuaRot's choice),
            ``"random"`` (random orthogonal) or ``"learned"``; ``"none"`` (with ``online_hadamard=True``) turns no
            stream, folds no γ, and adds only the online Hadamards, before every Linear input
            (:func:`normswap.rotate`'s ``q="none"``); ``None`` (default) does not rotate. A rotated
            stream needs γ folded, so ``rotate`` folds γ into the norms of every stream it will turn; the
            norms of a stream it leaves alone (Whisper's encoder, whose last norm output is a model output)
            keep γ and β as a conversion without ``rotate`` leaves them, and say why
            (``plan.options["gamma_kept"]``). ``fold_gamma=True`` as well folds γ everywhere. The matrices
            keep ``Q·1 = 1``, so a rotated exact model can still be written in the compat format.
        rotate_seed: the seed of the rotation's random signs / random matrix (stream ``i`` uses
            ``rotate_seed + i``); recorded in the manifest with the kind, enough to rebuild ``Q``.
        rotate_output: how a stream whose last norm output is itself a model output (a ViT/DINOv2
            backbone's ``last_hidden_state``) is handled (see :func:`normswap.rotate`'s ``output``).
        online_hadamard: also the online Hadamard rotations (see :func:`normswap.rotate`'s ``online``).
        online_block: with ``online_hadamard=True``: a power of two ``b`` for block-diagonal online Hadamards
            ``x·D·(I ⊗ H_b)/sqrt(b)`` on every op whose width is a multiple of ``b`` larger than it (see
            :func:`normswap.rotate`'s ``online_block``); ``None`` (default): the full Hadamard.
        rotate_smooth: SmoothQuant's α in [0, 1] for a scale migration after the rotation (see
            :func:`normswap.rotate`'s ``smooth``), measured on ``calibration`` (default: the built-in
            batches); ``None`` (default) does not smooth.
        rotate_learn: with ``rotate="learned"``: the learned rotation's settings as a dict of
            :func:`normswap.rotate`'s ``bits``, ``act_bits``, ``group_size``, ``steps``, ``lr``, ``grid``,
            ``scales`` (default
            ``{}``: 4-bit weights per output channel, float activations, 100 steps); learned on
            ``calibration`` (default: the built-in batches).
        quantizer: the engine the converted model will be quantized with (:data:`normswap.quantizers.QUANTIZERS`:
            ``"onnxruntime-dynamic"``, ``"torchao"``, ``"openvino-int8"``, ...; ``"none"``: the defaults).
            It sets ``writer_centering``, ``per_norm_centering`` and ``mean_carry`` as that engine was measured to
            need them on the kind of model the analysis finds (Pre-LN, Pre-LN with LayerScale, Post-LN encoder;
            ``docs/deployment.md``, "At a glance"), and ``convert``'s format where the engine needs compat. The
            plan records what it set (``plan.options["quantizer"]``, in the manifest). ``None`` (default): no
            engine named.
        quantizer_overrides: with ``quantizer``: the fields it may set that the caller set, which keep the
            caller's value. Filled in by itself: a keyword given next to ``quantizer`` (``patch(model,
            quantizer="torchao", writer_centering="weights")``) and any such field holding a value other than its
            default; the CLI adds the options given on the command line.
    """

    mode: str = "auto"
    fold_gamma: bool = False
    bias_slots: bool = True
    beta_placement: str | None = None
    layer_scale: str = "keep"
    stem_centering: str | None = None
    writer_centering: str = "weights"
    trade_constants: bool = True
    untie: bool | None = None
    per_norm_centering: bool = False
    mean_carry: bool = True
    carry_multiple: int = 8
    calibration: Any = None
    sequential: bool = True
    tokenizer: Any = None
    verify: bool = True
    verify_dtype: str = "auto"
    allow_unusable: bool = False
    backend: str = "auto"
    rotate: str | None = None
    rotate_seed: int = 0
    rotate_output: str | None = None
    online_hadamard: bool = False
    online_block: int | None = None
    rotate_smooth: float | None = None
    rotate_learn: dict | None = None
    quantizer: str | None = None
    quantizer_overrides: tuple[str, ...] = ()
    defer_approximate: bool = False  # last: a field added after the others keeps positional construction working

    def __post_init__(self) -> None:
        from normswap import backends  # the registry of backend names (imports torch kernels)

        choose("mode", self.mode, MODES)
        if self.defer_approximate and self.mode != "exact":
            raise NormswapError(f"option defer_approximate applies to mode='exact' (the norms it leaves for later), "
                                f"not mode={self.mode!r}")
        if self.beta_placement is not None:
            choose("beta_placement", self.beta_placement, BETA_PLACEMENTS)
        choose("layer_scale", self.layer_scale, LAYER_SCALES)
        if self.stem_centering is not None:
            choose("stem_centering", self.stem_centering, STEM_CENTERINGS)
        choose("writer_centering", self.writer_centering, WRITER_CENTERINGS)
        if self.writer_centering in ("op", "auto") and self.rotate not in (None, "none"):
            raise NormswapError(f"option writer_centering={self.writer_centering!r} leaves writers' weights as they "
                                "are and centers their outputs by ops, which a rotation that turns the stream cannot "
                                "fold into: drop one of them (rotate='none' with online_hadamard=True works with it)")
        choose("verify_dtype", self.verify_dtype, VERIFY_DTYPES)
        if self.rotate is not None:
            choose("rotate", self.rotate, ROTATIONS)  # γ folded where it turns (pipeline.analyse_copy)
        if self.rotate_output is not None:
            choose("rotate_output", self.rotate_output, ROTATE_OUTPUTS)
        if isinstance(self.rotate_seed, bool) or not isinstance(self.rotate_seed, int):
            raise NormswapError(f"option rotate_seed must be an int, not {self.rotate_seed!r}")
        if self.rotate == "none" and (not self.online_hadamard or self.rotate_output is not None):
            raise NormswapError("option rotate='none' turns no stream, it only adds online Hadamards: pass "
                                "online_hadamard=True (--online-hadamard), and no rotate_output")
        check_online_block(self.online_block, self.online_hadamard)
        if (self.online_hadamard or self.rotate_output is not None) and self.rotate is None:
            what = "online_hadamard" if self.online_hadamard else "rotate_output"
            raise NormswapError(f"option {what} applies to a rotation: pass rotate='hadamard' (--rotate hadamard) too")
        if self.rotate_smooth is not None:
            a = self.rotate_smooth
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= float(a) <= 1.0:
                raise NormswapError(f"option rotate_smooth must be a number in [0, 1] (SmoothQuant's alpha), not {a!r}")
            if self.rotate is None:
                raise NormswapError("option rotate_smooth applies to a rotation: pass rotate='hadamard' "
                                    "(--rotate hadamard) too")
        if self.rotate_learn is not None:
            from normswap.rotation.learn import LearnSettings  # checked here: a bad setting fails before converting

            if not isinstance(self.rotate_learn, dict) or not set(self.rotate_learn) <= set(LEARN_KEYS):
                raise NormswapError(f"option rotate_learn must be a dict with keys among {', '.join(LEARN_KEYS)}, "
                                    f"not {self.rotate_learn!r}")
            if self.rotate != "learned":
                raise NormswapError("option rotate_learn applies to a learned rotation: pass rotate='learned' "
                                    "(--rotate learned) too")
            LearnSettings(**self.rotate_learn)
            if self.rotate_learn.get("scales") and self.rotate_smooth is not None:
                raise NormswapError("option rotate_learn's scales and rotate_smooth both set each norm's scale: "
                                    "pass one of them")
        c = self.carry_multiple
        if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= 4096:
            raise NormswapError(f"option carry_multiple must be a whole number of neurons from 1 to 4096 (the MLP "
                                f"width the mean carry pads to a multiple of), not {c!r}")
        if self.untie is not None and not isinstance(self.untie, bool):
            raise NormswapError(f"option untie must be True, False or None (untie where the plan needs it), "
                                f"not {self.untie!r}")
        for name in ("fold_gamma", "bias_slots", "per_norm_centering", "mean_carry", "sequential", "verify",
                     "allow_unusable", "online_hadamard", "trade_constants"):
            if not isinstance(getattr(self, name), bool):
                raise NormswapError(f"option {name} must be True or False, not {getattr(self, name)!r}")
        if not self.bias_slots and not self.folds_gamma:  # slots only ever take β of a γ-folded norm
            raise NormswapError("option bias_slots=False applies with fold_gamma=True only (a bias slot takes the β "
                                "of a γ-folded norm; without fold_gamma none is made): pass fold_gamma=True too, or "
                                "drop bias_slots=False")
        backends.check_name(self.backend)
        self._check_quantizer()  # last: its refusals take the other options as valid

    def _check_quantizer(self) -> None:
        """``quantizer``: a known engine; ``quantizer_overrides`` completed with the fields set away from their
        defaults; the combinations the engine's options cannot go with refused (:mod:`normswap.quantizers`)."""
        if self.quantizer is None:
            if self.quantizer_overrides:
                raise NormswapError("option quantizer_overrides applies with quantizer=...: name the engine too")
            return
        choose("quantizer", self.quantizer, quantizers.QUANTIZER_NAMES)
        given = self.quantizer_overrides
        if isinstance(given, (str, bytes)) or not all(name in quantizers.OVERRIDABLE for name in given):
            raise NormswapError(f"option quantizer_overrides must name fields among "
                                f"{', '.join(quantizers.OVERRIDABLE)}, not {given!r}")
        pinned = set(given) | {name for name, default in quantizers.FIELDS.items() if getattr(self, name) != default}
        object.__setattr__(self, "quantizer_overrides", tuple(sorted(pinned)))  # frozen: completed once, here
        quantizers.check_combination(self.quantizer, pinned, rotate=self.rotate)

    @property
    def stem_centering_used(self) -> str:
        """``stem_centering``, or its default: ``"weights"`` for a rotation-ready conversion (``rotate`` or
        ``fold_gamma``: a rotation's ``Q`` then folds into the start writers instead of being an op of its own),
        ``"op"`` otherwise."""
        if self.stem_centering is not None:
            return self.stem_centering
        return "weights" if self.folds_gamma else "op"

    @property
    def untie_used(self) -> bool | None:
        """``untie``, or its default: ``True`` for a conversion that folds γ (a γ folded into a tied head
        needs the head's own weight), ``None`` otherwise (the analysis keeps ties and unties only a head an
        approximate norm's reader rewrite needs)."""
        if self.untie is not None:
            return self.untie
        return True if self.folds_gamma else None

    @property
    def folds_gamma(self) -> bool:
        """Is γ folded anywhere: ``fold_gamma`` (every norm), or a rotation (the norms of the streams it turns;
        ``rotate="none"`` turns none)."""
        return self.fold_gamma or self.rotate not in (None, "none")

    def beta_placement_for(self, fmt: str | None) -> str:
        """The β placement a conversion written in ``fmt`` runs (``None``: an in-memory ``patch``/``plan``):
        the option when given, else ``"keep"`` for a checkpoint (either format: what engines export and
        quantize, and a folded β costs their weight and activation quantizers) and ``"rounding"`` in memory
        (one bias add fewer per folded norm, which CUDA eager mode runs as one more op)."""
        if self.beta_placement is not None:
            return self.beta_placement
        return "rounding" if fmt is None else "keep"

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def build(cls, options: ConvertOptions | None = None, /, **keywords: Any) -> ConvertOptions:
        """``options`` with ``keywords`` applied; an unknown keyword is an error with a suggestion.

        Entry points call this with their keyword arguments, so ``patch(model, fold_gama=True)`` fails
        with "did you mean 'fold_gamma'?" instead of converting without the option.
        """
        known = set(cls.names())
        for key in keywords:
            if key not in known:
                near = difflib.get_close_matches(key, sorted(known), n=1)
                hint = f"; did you mean {near[0]!r}?" if near else f"; options are {', '.join(sorted(known))}"
                raise NormswapError(f"unknown conversion option {key!r}{hint}")
        base = options if options is not None else cls()
        if not isinstance(base, ConvertOptions):
            raise NormswapError(f"options must be a normswap.ConvertOptions, not {type(base).__name__}")
        if keywords.get("quantizer", base.quantizer) is not None:  # given next to the engine: the caller's value wins
            pinned = set(keywords.get("quantizer_overrides", base.quantizer_overrides))
            keywords["quantizer_overrides"] = tuple(sorted(pinned | (set(keywords) & set(quantizers.FIELDS))))
        return dataclasses.replace(base, **keywords) if keywords else base

    def replace(self, **changes: Any) -> ConvertOptions:
        """A copy with ``changes`` applied (validated, unknown names refused)."""
        return ConvertOptions.build(self, **changes)
