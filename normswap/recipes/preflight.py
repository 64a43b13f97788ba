"""Recipe settings checked against the model, tokenizer, data and machine before any work starts.

A setting can be valid on its own and impossible for what it meets: ``data.seq_len: 256`` for a model
of 128 positions, a tokenizer with more ids than the model has embedding rows, ``task: masked-lm`` on a
checkpoint without a masked-LM head, LoRA target modules the model does not have. Found late, each is a
crash deep in a forward pass (``IndexError: index out of range in self``) after minutes of conversion,
with a run directory half written. The runner asks this module at three points, each before the work
the next one would waste: :func:`check_settings` (from the ``config.json`` files, the tokenizer and the
installed packages, no weight read), :func:`check_data` (after tokenising) and :func:`check_student`
(after the conversion); it creates the output directory only once all three have passed.

A failure is a :class:`RecipeMismatch` (a usage error: exit code 2) whose one line names the config key,
its value and the limit. A value the user did not choose (the recipe's default,
:meth:`RecipeConfig.is_default`) that does not fit adapts to the limit instead, and says so in one line.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from normswap.analysis.plan import Plan
from normswap.checkpoint import hf_types
from normswap.errors import UsageError
from normswap.recipes import models, tasks
from normswap.recipes.config import RecipeConfig, selection_metric
from normswap.recipes.data import BatchSource

Say = Callable[[str], None]  # prints one line to the user (the main process's console)

# Model types whose position ids start after the padding index (RoBERTa's ``padding_idx + 1 + cumsum``):
# ``pad_token_id + 1`` rows of their position table are never a real position.
_POSITIONS_AFTER_PADDING = frozenset({
    "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "mpnet", "longformer", "data2vec-text", "ibert",
    "roberta-prelayernorm", "xmod", "luke", "esm", "markuplm", "lilt", "layoutlmv3",
})
# Config attributes that declare a model's positions, in the order transformers' configs use them.
_POSITION_ATTRS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length", "seq_length")
_UNSET_MODEL_MAX_LENGTH = 1_000_000  # transformers' "no limit" is ~1e30


class RecipeMismatch(UsageError):
    """A recipe setting that this model, tokenizer, data or machine cannot run (exit code 2)."""


# ---------------------------------------------------------------------------------- facts
@dataclass(frozen=True)
class ModelFacts:
    """What the checks read from one model directory's ``config.json``: no weight is loaded."""

    key: str  # the config key naming the directory: model.source or model.student
    spec: str  # its value
    model_type: str  # the stock type (a converted ``normswap_gpt2`` is a ``gpt2``)
    architecture: str | None  # the class it was saved as
    config: Any  # the transformers config; None for a type this transformers does not know

    def number(self, *attrs: str) -> tuple[str, int] | None:
        """The first of ``attrs`` the config sets to a positive integer, with its name."""
        for attr in attrs:
            value = getattr(self.config, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return attr, value
        return None

    @property
    def vocab_size(self) -> int | None:
        found = self.number("vocab_size")
        return found[1] if found else None

    @property
    def hidden_size(self) -> int | None:
        found = self.number("hidden_size")
        return found[1] if found else None

    @property
    def named(self) -> str:
        return f"{self.key} {self.spec!r}"


def read_facts(key: str, spec: str | None) -> ModelFacts | None:
    """The facts of the model directory (or preset) ``spec``; None when there is no readable
    ``config.json`` (loading the model then says what is wrong, as it always has)."""
    if not spec:
        return None
    try:
        raw = json.loads((Path(models.local_path(spec)) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    model_type = str(raw.get("model_type", ""))
    base = hf_types.base_type(model_type) or model_type
    manifest = raw.get(hf_types.MANIFEST_KEY)
    architecture = manifest.get("architecture") if isinstance(manifest, dict) else None
    architecture = architecture or next(iter(raw.get("architectures") or []), None)
    config = None
    if hf_types.known_type(base):
        fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map", hf_types.MANIFEST_KEY)}
        try:
            config = hf_types.base_config_class(base).from_dict(fields)
        except Exception:  # noqa: BLE001 - a config transformers cannot read: from_pretrained will say so
            config = None
    return ModelFacts(key, spec, base, architecture, config)


def models_used(cfg: RecipeConfig) -> list[ModelFacts]:
    """The facts of every model the run loads: the teacher/conversion source and the student directory."""
    need_source = cfg.teacher.enabled or not cfg.model.student
    found = [
        read_facts("model.source", cfg.model.source if need_source else None),
        read_facts("model.student", cfg.model.student),
    ]
    return [f for f in found if f is not None]


# ---------------------------------------------------------------------------------- before any work
def check_settings(cfg: RecipeConfig, tokenizer: Any, device: torch.device, say: Say) -> None:
    """Everything that ``config.json`` files, the tokenizer and the machine decide: the task's head,
    teacher/student agreement, tokenizer against vocabulary, ``data.seq_len`` against positions, LoRA
    targets, precision on this device, the warmup against the steps. Adapts defaults in place."""
    task = tasks.get(cfg.task)
    used = models_used(cfg)
    for facts in used:
        _check_head(task, facts)
    _check_pair(cfg, task, used)
    _check_tokenizer(cfg, task, tokenizer, used)
    fit_seq_len(cfg, position_limits(used, tokenizer), say)
    _check_lora(cfg, task, used[-1] if used else None)
    _check_precision(cfg, device)
    _fit_warmup(cfg, say)
    _check_plot(cfg, say)


def _head_classes(task: tasks.Task, model_type: str) -> set[str]:
    """The class names of ``model_type`` that carry ``task``'s head (empty: the task's Auto class has none)."""
    from transformers.models.auto import modeling_auto

    names: set[str] = set()
    for table in task.head_tables:
        entry = getattr(modeling_auto, table, {}).get(model_type)
        names |= {entry} if isinstance(entry, str) else set(entry or ())
    return names


def _task_for(architecture: str, model_type: str) -> str:
    """The recipe task whose head ``architecture`` carries (the encoder task fits any)."""
    for name in tasks.TASK_NAMES:
        task = tasks.get(name)
        if task.head_required and architecture in _head_classes(task, model_type):
            return name
    return "encoder"


def _check_head(task: tasks.Task, facts: ModelFacts) -> None:
    """``task`` must have a class for this model type, and a head the checkpoint was trained with."""
    if facts.config is None:  # custom code: from_pretrained decides
        return
    from transformers.models.auto import modeling_auto

    if getattr(modeling_auto, task.head_tables[0], {}).get(facts.model_type) is None:
        fits = _task_for(facts.architecture or "", facts.model_type)
        raise RecipeMismatch(
            f"config key `task`: {task.name} loads the model as {task.auto_class}, which has no class for "
            f"{facts.model_type} models ({facts.named}); use task={fits}"
        )
    arch = facts.architecture
    if not task.head_required or not arch or arch in _head_classes(task, facts.model_type):
        return
    import transformers

    if hasattr(transformers, arch):  # a stock class without this head: it would load untrained
        raise RecipeMismatch(
            f"config key `task`: {facts.named} was saved as {arch}, without the {task.name} head "
            f"({task.auto_class} would start it untrained); use task={_task_for(arch, facts.model_type)}"
        )


def _check_pair(cfg: RecipeConfig, task: tasks.Task, used: list[ModelFacts]) -> None:
    """A student directory distilled towards the source must be the same model: same type, and the
    same logits (LM tasks) or hidden states (encoder) to compare."""
    if len(used) < 2 or not cfg.teacher.enabled:
        return
    teacher, student = used
    if teacher.model_type != student.model_type:
        raise RecipeMismatch(
            f"config key `model.student`: {student.spec!r} is a model of type {student.model_type} and "
            f"model.source {teacher.spec!r} one of type {teacher.model_type}; give the student converted from "
            "that source"
        )
    what, t_size, s_size = (
        ("hidden size", teacher.hidden_size, student.hidden_size) if task.embeds
        else ("vocabulary", teacher.vocab_size, student.vocab_size)
    )
    if t_size and s_size and t_size != s_size:
        raise RecipeMismatch(
            f"config key `model.student`: {student.spec!r} has a {what} of {s_size} and the teacher "
            f"{teacher.spec!r} one of {t_size}: their outputs cannot be compared; give the student "
            "converted from that source"
        )


def _check_tokenizer(cfg: RecipeConfig, task: tasks.Task, tokenizer: Any, used: list[ModelFacts]) -> None:
    """The tokenizer's ids must index every model's embedding, it must frame the task's examples, and a
    model directory that ships its own tokenizer must agree with it (else the ids mean other words)."""
    key, path = models.tokenizer_source(cfg.model)
    for facts in used:
        vocab = facts.vocab_size
        if vocab and len(tokenizer) > vocab:
            raise RecipeMismatch(
                f"config key `{key}`: the tokenizer of {path!r} has {len(tokenizer)} tokens, more than the "
                f"{vocab} rows of the embedding of {facts.named}; use the model's own tokenizer"
            )
    problem = task.tokenizer_problem(tokenizer, cfg, f"the tokenizer of {key} {path!r}")
    if problem is not None:
        raise RecipeMismatch(f"config key `{problem[0]}`: {problem[1]}")
    for facts in used:
        if facts.spec == path:
            continue
        own = _own_tokenizer(facts.spec, cfg.model.trust_remote_code)
        ids = tokenizer.get_vocab()
        moved = next((t for t, i in (own.get_vocab().items() if own is not None else ()) if ids.get(t) != i), None)
        if moved is not None:
            raise RecipeMismatch(
                f"config key `{key}`: the tokenizer of {path!r} gives token {moved!r} another id than the "
                f"tokenizer {facts.named} ships; use that model's tokenizer"
            )


def _own_tokenizer(spec: str, trust_remote_code: bool) -> Any:
    """The tokenizer saved in a model directory, or None where it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            models.local_path(spec), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception:  # noqa: BLE001 - no tokenizer there (or none transformers reads): nothing to compare
        return None


@dataclass(frozen=True)
class Limit:
    """A longest sequence: ``hard`` when a longer one indexes past a learned position table."""

    tokens: int
    what: str
    hard: bool


def position_limits(used: Iterable[ModelFacts], tokenizer: Any) -> list[Limit]:
    """The sequence-length limits the models and the tokenizer declare."""
    limits = []
    for facts in used:
        found = facts.number(*_POSITION_ATTRS)
        if found is None:  # ALiBi (BLOOM) and other models that declare no positions
            continue
        attr, positions = found
        offset = 0
        if facts.model_type in _POSITIONS_AFTER_PADDING:
            offset = (getattr(facts.config, "pad_token_id", None) or 0) + 1
        if _positions_learned(facts.config):
            usable = positions - offset
            why = f"{attr}={positions}" + (f", less {offset} for the padding offset" if offset else "")
            limits.append(Limit(usable, f"the {usable} positions of {facts.named} ({why})", True))
        else:
            limits.append(Limit(positions, f"the {positions}-token context of {facts.named} ({attr}, rotary)", False))
    longest = getattr(tokenizer, "model_max_length", None)
    if isinstance(longest, int) and 0 < longest < _UNSET_MODEL_MAX_LENGTH:
        limits.append(Limit(longest, f"the tokenizer's model_max_length ({longest})", False))
    return limits


def _positions_learned(config: Any) -> bool:
    """Whether position ids index a learned table (absolute, or BERT's relative-key distances), past whose
    end a longer sequence fails; rotary and ALiBi positions, and DeBERTa's relative buckets, extrapolate."""
    if getattr(config, "position_embedding_type", None) in ("rotary", "alibi"):
        return False
    if getattr(config, "position_biased_input", True) is False:
        return False
    rotary = ("rope_parameters", "rope_theta", "rope_scaling", "rotary_dim", "rotary_pct")
    return not any(getattr(config, attr, None) for attr in rotary)


def fit_seq_len(cfg: RecipeConfig, limits: list[Limit], say: Say) -> None:
    """``data.seq_len`` against ``limits``: a default longer than the shortest adapts to it; a chosen value
    past a hard limit is an error, past a soft one (a rotary context, the tokenizer's declared length) a note."""
    seq_len = cfg.data.seq_len
    over = sorted((lim for lim in limits if seq_len > lim.tokens), key=lambda lim: lim.tokens)
    if not over:
        return
    if cfg.is_default("data.seq_len"):
        cfg.data.seq_len = over[0].tokens
        say(f"data.seq_len: the recipe's {seq_len} is longer than {over[0].what}; using {over[0].tokens}")
        return
    hard = [lim for lim in over if lim.hard]
    if hard:
        raise RecipeMismatch(
            f"config key `data.seq_len`: {seq_len} is longer than {hard[0].what}; "
            f"set data.seq_len={hard[0].tokens} or less"
        )
    say(f"note: data.seq_len={seq_len} is longer than {over[0].what}")


def _check_lora(cfg: RecipeConfig, task: tasks.Task, student: ModelFacts | None) -> None:
    """LoRA needs peft, and target modules the student has (or a PEFT default for its type)."""
    if cfg.train.trainable != "lora":
        return
    if importlib.util.find_spec("peft") is None:
        raise RecipeMismatch(
            "config key `train.trainable`: 'lora' needs the `peft` package, which is not installed "
            "(pip install peft), or use train.trainable=all"
        )
    if student is None or student.config is None:
        return
    targets = cfg.train.lora.target_modules
    if targets is None and models.default_lora_targets(student.model_type) is not None:
        return
    names = _module_names(task, student)
    if names is None:
        return
    missing = [t for t in targets or () if not any(n == t or n.endswith("." + t) for n in names)]
    if targets is None or missing:
        linears = sorted({n.rpartition(".")[2] for n, kind in names.items() if kind == "Linear"})
        why = (f"PEFT has no default target modules for {student.model_type} models" if targets is None
               else f"{missing[0]!r} names no module of {student.named}")
        raise RecipeMismatch(
            f"config key `train.lora.target_modules`: {why}; name some of its Linear layers, e.g. "
            f"train.lora.target_modules=[{','.join(linears[:4])}]"
        )


def _module_names(task: tasks.Task, facts: ModelFacts) -> dict[str, str] | None:
    """Module path -> class name of the model ``facts`` describes, built on the meta device (no memory)."""
    try:
        with torch.device("meta"):
            model = task.model_class().from_config(facts.config)
    except Exception:  # noqa: BLE001 - a model not built this way: PEFT checks the targets itself later
        return None
    # transformers' Conv1D (GPT-2) is a Linear with its weight transposed, and PEFT adapts it as one
    return {name: "Linear" if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D" else type(m).__name__
            for name, m in model.named_modules() if name}


def _check_precision(cfg: RecipeConfig, device: torch.device) -> None:
    """A precision this device lacks, or a combination accelerate cannot train."""
    mixed, dtype = cfg.train.mixed_precision, cfg.model.dtype
    if mixed == "fp16" and dtype == "float16":
        raise RecipeMismatch(
            "config key `model.dtype`: float16 weights get float16 gradients, which fp16 mixed precision's "
            "gradient scaler cannot unscale; keep model.dtype=float32 (train.mixed_precision=fp16 computes in float16)"
        )
    wants_bf16 = mixed == "bf16" or dtype == "bfloat16"
    if device.type == "cuda" and wants_bf16 and not torch.cuda.is_bf16_supported():
        key, value = ("train.mixed_precision", mixed) if mixed == "bf16" else ("model.dtype", dtype)
        raise RecipeMismatch(
            f"config key `{key}`: {value} needs bfloat16, which {torch.cuda.get_device_name(device)} does not "
            "support; use train.mixed_precision=fp16 with model.dtype=float32"
        )


def _fit_warmup(cfg: RecipeConfig, say: Say) -> None:
    """A warmup longer than the run never reaches ``train.lr``: a default adapts, a chosen value is an error."""
    warmup, steps = cfg.train.warmup_steps, cfg.train.steps
    if warmup <= steps:
        return
    if cfg.is_default("train.warmup_steps"):
        cfg.train.warmup_steps = steps // 20
        say(f"train.warmup_steps: the recipe's {warmup} is more than train.steps={steps}; using "
            f"{cfg.train.warmup_steps} (5% of the steps)")
        return
    raise RecipeMismatch(
        f"config key `train.warmup_steps`: {warmup} is more than train.steps={steps}, so the learning rate "
        f"would never reach train.lr; use train.warmup_steps={steps} or less"
    )


def _matplotlib_missing() -> str | None:
    """Why ``import matplotlib`` fails here (None: it imports). Imported, not looked up: a broken
    install fails the same way at the end of the run."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return str(exc) or "not installed"
    return None


def _check_plot(cfg: RecipeConfig, say: Say) -> None:
    """``log.plot`` draws ``curves.png`` after training, with matplotlib: found missing then, the run's
    minutes are spent. A default adapts (no plot, said now); a chosen ``log.plot=true`` is an error."""
    if not cfg.log.plot:
        return
    why = _matplotlib_missing()
    if why is None:
        return
    if cfg.is_default("log.plot"):
        cfg.log.plot = False
        say(f"log.plot: matplotlib cannot be imported ({why}), so the run draws no curves.png; pip install "
            "matplotlib for it (metrics.jsonl holds the same numbers)")
        return
    raise RecipeMismatch(
        f"config key `log.plot`: true needs matplotlib, which cannot be imported ({why}); pip install matplotlib, "
        "or set log.plot=false (metrics.jsonl holds the same numbers)"
    )


# ---------------------------------------------------------------------------------- after tokenising
def check_data(cfg: RecipeConfig, source: BatchSource, calibrates: bool, say: Say) -> None:
    """Settings that the tokenised data decides: an optimizer step's examples, the calibration batches,
    the held-out examples a metric needs. ``calibrates``: the run fits norms on calibration batches."""
    train, world = len(source.data.train), source.world
    per_micro = cfg.data.batch_size * world
    accumulate = cfg.train.gradient_accumulation_steps
    if per_micro * accumulate > train:
        raise RecipeMismatch(
            f"config key `train.gradient_accumulation_steps`: {accumulate} micro-batches of {per_micro} make "
            f"{per_micro * accumulate} examples per optimizer step, more than the training split's {train}; "
            f"use train.gradient_accumulation_steps={train // per_micro} or less, or more data"
        )
    wanted, available = cfg.convert.calibration_batches, source.batches_per_epoch
    if calibrates and wanted > available:
        if not cfg.is_default("convert.calibration_batches"):
            raise RecipeMismatch(
                f"config key `convert.calibration_batches`: {wanted} is more than the {available} batch(es) of "
                f"{cfg.data.batch_size} the training split makes; use convert.calibration_batches={available} or less"
            )
        cfg.convert.calibration_batches = available
        say(f"convert.calibration_batches: the recipe's {wanted} is more than the {available} batch(es) "
            f"the training split makes; using {available}")
    _check_eval_share(cfg, source)


def _check_eval_share(cfg: RecipeConfig, source: BatchSource) -> None:
    """The metric ``eval.keep_best`` ranks by must be measurable on some process's held-out share."""
    metric = selection_metric(cfg)[0]
    needed = tasks.get(cfg.task).eval_examples_needed(metric)
    held_out, world = len(source.data.eval), source.world
    if -(-held_out // world) < needed:
        raise RecipeMismatch(
            f"config key `eval.metric`: {metric} needs {needed} held-out examples on a process and the held-out "
            f"split has {held_out} for {world} process(es); raise data.eval_fraction (or data.eval_batches)"
        )


# ---------------------------------------------------------------------------------- after the conversion
def check_student(cfg: RecipeConfig, plan: Plan | None, progressive: bool) -> None:
    """What the converted student decides: ``output.format: compat`` stores LayerNorms, so it cannot hold
    an approximate norm converted now or by a progressive swap during training."""
    if cfg.output.format != "compat" or plan is None:
        return
    approximate = [sp.name for sp in plan.sites if sp.verdict == "approximate" and (sp.convert or progressive)]
    if approximate:
        raise RecipeMismatch(
            f"config key `output.format`: compat keeps LayerNorms and cannot store the student's "
            f"{len(approximate)} approximate norm(s) ({approximate[0]}); use output.format=native"
        )
