"""The one recipe runner: distil (or fine-tune) a converted student on accelerate.

Single process CPU/GPU needs no setup; ``accelerate launch --config_file
recipes/accelerate/ddp.yaml -m normswap.recipes RECIPE.yaml key=value ...`` runs the same code on
many GPUs (FSDP / DeepSpeed configs beside it). Mixed precision and gradient accumulation are accelerate's
(``Accelerator(mixed_precision=..., gradient_accumulation_steps=...)`` + ``accelerator.accumulate``).

Output directory layout::

    OUT/recipe.yaml          the resolved recipe
    OUT/metrics.jsonl        before/train/eval records, one JSON object per line
    OUT/curves.png           loss and metric curves (when matplotlib is installed)
    OUT/checkpoints/step-N/  accelerate state (weights, optimizer, scheduler, RNG) + trainer_state.json
    OUT/model/               the final converted model (normswap.load-able), manifest with recipe + metrics
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap import interrupts
from normswap.analysis.plan import plan_of
from normswap.errors import NormswapError
from normswap.integrations.quiet import quietly
from normswap.recipes import data as data_mod
from normswap.recipes import io, outdir, preflight, tasks
from normswap.recipes import metrics as metrics_mod
from normswap.recipes import models as models_mod
from normswap.recipes.config import RecipeConfig, load_config, selection_metric
from normswap.recipes.processes import shown_by_main


@dataclass
class RunResult:
    """What a recipe run produced. ``model`` is the final student (LoRA merged), in eval mode: on the
    run's device, or under FSDP gathered on CPU on the main process (the other processes keep their
    sharded module)."""

    output_dir: str
    model_dir: str | None
    metrics_before: dict[str, float]
    metrics_after: dict[str, float]
    steps: int
    tokens: int
    train_time_s: float
    wall_time_s: float
    saved_with: str | None = None
    stopped_early: bool = False
    converged: bool = False  # eval.patience ended the run before train.steps
    resumed_from: str | None = None
    best_step: int | None = None
    conversion: dict[str, Any] = field(default_factory=dict)
    model: nn.Module | None = None
    # False on the other processes of a distributed run: only the main one writes (model_dir is
    # None elsewhere) and reports
    main_process: bool = True


# ---------------------------------------------------------------------------------- pieces
def _make_accelerator(cfg: RecipeConfig) -> Any:
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs

    handlers = []
    if cfg.progressive.enabled or cfg.train.trainable == "lora":
        # a swapped LayerNorm may leave its β unused; LoRA freezes most parameters
        handlers.append(DistributedDataParallelKwargs(find_unused_parameters=True))
    return Accelerator(
        mixed_precision=cfg.train.mixed_precision,
        gradient_accumulation_steps=cfg.train.gradient_accumulation_steps,
        kwargs_handlers=handlers,
        cpu=launched_on_cpu_only(),
    )


def launched_on_cpu_only() -> bool:
    """True for a multi-process launch (``accelerate launch``, ``torchrun``) on a machine without an
    accelerator, unless the launcher chose the device itself (``ACCELERATE_TORCH_DEVICE``).

    accelerate sets up its process group only for GPU-like devices unless told ``cpu=True``: without it
    a GPU config (ddp.yaml, fsdp.yaml) on a CPU-only machine starts N unconnected single-process runs,
    each of which believes it is the main process, trains alone and writes the same ``OUT/model``. With
    it the processes form one data-parallel group over gloo (accelerate's ``MULTI_CPU``; FSDP and
    DeepSpeed need an accelerator, so their configs run as plain data parallelism there).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or os.environ.get("ACCELERATE_TORCH_DEVICE"):
        return False
    return not torch.accelerator.is_available()


def _optimizer(model: nn.Module, cfg: RecipeConfig) -> torch.optim.Optimizer:
    norms = models_mod.norm_parameter_names(models_mod.base_model(model))
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        plain = name.removeprefix("base_model.model.")
        (no_decay if p.dim() < 2 or plain in norms or name.endswith("bias") else decay).append(p)
    if not decay and not no_decay:
        raise NormswapError("config key `train.trainable`: no trainable parameters selected")
    groups = [
        {"params": decay, "weight_decay": cfg.train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.train.lr, betas=tuple(cfg.train.betas)
    )


def _scheduler(optimizer: torch.optim.Optimizer, cfg: RecipeConfig) -> torch.optim.lr_scheduler.LambdaLR:
    warmup, total, kind = cfg.train.warmup_steps, cfg.train.steps, cfg.train.scheduler

    def factor(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if kind == "linear":
            return 1.0 - progress
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _loss(
    task: tasks.Task,
    cfg: RecipeConfig,
    student: nn.Module,
    teacher: nn.Module | None,
    batch: dict[str, torch.Tensor],
    autocast: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    inputs = tasks.model_inputs(batch)
    out = student(**inputs)
    t_out = None
    if teacher is not None:
        with torch.no_grad(), autocast():
            t_out = teacher(**inputs)
    return task.loss(cfg.loss, out, t_out, batch)


def _check_output(cfg: RecipeConfig) -> tuple[Path, Path | None, list[Path]]:
    """The output directory, the checkpoint to resume from (if any) and what an overwrite replaces;
    raises (a usage error) when ``output.dir`` holds a run or files this one may not touch. Writes nothing.
    The command line asks the same before its heavy imports (:func:`normswap.recipes.outdir.check_output`)."""
    return outdir.check_output(cfg)


def on_disk(out: Path) -> str:
    """What a run interrupted now leaves in ``out``, as the one line ``normswap finetune`` prints: the
    final model when it was written, else the newest complete checkpoint (one with its
    ``trainer_state.json``: a checkpoint cut off while saving is not one), else what little is there."""
    model = out / "model"
    if (model / "config.json").is_file() or (model / "normswap.json").is_file():
        return f"the final model was already written to {model}"
    done = io.checkpoint_dirs(out / "checkpoints")
    if done:
        return f"checkpoints to resume from: {done[-1][1]} (resume with checkpoint.resume=true)"
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) if out.is_dir() else []
    if not files:
        return "nothing was written"
    return (f"no checkpoint to resume from yet (the first is saved after checkpoint.every steps); {out} holds "
            f"{', '.join(files[:4])}{' ...' if len(files) > 4 else ''}")


def _create_output(out: Path, replaced: list[Path], main: bool) -> None:
    """Create the output directory, removing the run an overwrite replaces (main process only)."""
    if not main:
        return
    for p in replaced:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    out.mkdir(parents=True, exist_ok=True)


class _Console:
    """What the main process prints: lines, and the progress bar (``log.progress_bar``) on a terminal
    only. Piped into a log, a bar is carriage returns and half-drawn lines; the ``step N:`` evaluation
    lines are the progress there."""

    def __init__(self, enabled: bool, bar: bool, total: int, initial: int) -> None:
        import sys

        self.enabled = enabled
        self.bar = None
        if enabled and bar and sys.stderr is not None and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="finetune", unit="step", dynamic_ncols=True)

    def print(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def update(self, postfix: dict[str, float] | None = None) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if postfix:
                self.bar.set_postfix({k: f"{v:.4g}" for k, v in postfix.items()}, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Best:
    """The held-out-best student so far (``eval.keep_best``): step, metrics and a CPU weight copy.

    Steps are ranked by the selection metric (float64 figures over the whole held-out split: the KL
    is summed in float64, :func:`losses.token_kl_exact`); on a tie, by a second figure (top-1
    agreement when ranking by a KL, else the KL), and on a tie of both the earlier step is kept: it is
    closer to the conversion, and later steps must earn their place."""

    def __init__(self, metric: str, maximize: bool, enabled: bool) -> None:
        self.metric, self.maximize, self.enabled = metric, maximize, enabled
        self.step: int | None = None
        self.metrics: dict[str, float] = {}
        self.state: dict[str, torch.Tensor] | None = None

    def _key(self, metrics: dict[str, float]) -> tuple[float, float]:
        """Smaller is better: (primary, tie-break), each signed so."""
        primary = metrics[self.metric]
        second = "top1_agreement" if self.metric.startswith("kl") else "kl"
        tie = metrics.get(second)
        tie = 0.0 if tie is None or tie != tie else (-tie if second == "top1_agreement" else tie)
        return (-primary if self.maximize else primary, tie)

    def consider(self, step: int, metrics: dict[str, float], model: nn.Module) -> None:
        value = metrics.get(self.metric)
        if not self.enabled or value is None or value != value:
            return
        if self.metrics and not self._key(metrics) < self._key(self.metrics):
            return
        self.step, self.metrics = step, dict(metrics)
        self.state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    def save(self, path: Path) -> dict[str, Any] | None:
        if self.state is None:
            return None
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in self.state.items()}, str(path / "best.safetensors"))
        return {"step": self.step, "metrics": self.metrics}

    def load(self, path: Path, info: dict[str, Any] | None) -> None:
        if not info or not (path / "best.safetensors").is_file():
            return
        from safetensors.torch import load_file

        self.step, self.metrics = info["step"], info["metrics"]
        self.state = load_file(str(path / "best.safetensors"))


# ---------------------------------------------------------------------------------- run
@quietly
def run(
    config_or_path: str | os.PathLike | dict[str, Any] | RecipeConfig,
    overrides: list[str] | dict[str, Any] | None = None,
) -> RunResult:
    """Run a recipe: build teacher and student, train, measure before/during/after, save.

    Args:
        config_or_path: a recipe YAML path, a dict with the same structure, or a :class:`RecipeConfig`.
        overrides: ``["train.lr=3e-4", ...]`` or ``{"train.lr": 3e-4}`` applied on top.

    Returns:
        A :class:`RunResult` (metrics before/after, steps, tokens, timings, the final model).

    Raises:
        NormswapError: a configuration or data problem, with a one-line message naming the key.
    """
    t_start = time.perf_counter()
    return Recipe(load_config(config_or_path, overrides), t_start).run()


class Recipe:
    """One run of a recipe, in the steps torchtune's recipes use: :meth:`setup` (accelerator,
    output directory, data, teacher and student, optimizer, resume), :meth:`train` (the loop, with
    held-out evaluation, progressive swaps and checkpoints) and :meth:`save` (keep the best step,
    write the converted model with its manifest). What differs between tasks is asked of
    ``self.task`` (:mod:`normswap.recipes.tasks`)."""

    def __init__(self, cfg: RecipeConfig, t_start: float | None = None) -> None:
        self.cfg = cfg
        self.task = tasks.get(cfg.task)
        self.t_start = time.perf_counter() if t_start is None else t_start
        self.step, self.seen_tokens, self.train_time = 0, 0, 0.0
        self.metrics_before: dict[str, float] = {}
        self.last_eval: dict[str, float] = {}
        self.stopped_early = False  # checkpoint.stop_after: interrupted on purpose, to be resumed
        self.converged = False  # eval.patience ended the run

    def run(self) -> RunResult:
        try:
            self.setup()
            self.train()
            return self.save()
        except KeyboardInterrupt as exc:  # Ctrl-C / SIGTERM: say what the run leaves to resume from
            if isinstance(exc, interrupts.Interrupted):
                raise
            out = getattr(self, "out", None)
            raise interrupts.Interrupted(on_disk(out) if out is not None else "nothing was written") from None

    # ---- setup
    def setup(self) -> None:
        """Everything before the first optimiser step, including the "before" evaluation.

        The settings are checked against the model, tokenizer, data and machine (:mod:`preflight`) as
        soon as each is known, and the output directory is created only after the last check. In a
        distributed run every process makes the same checks on the same files and settings: a refusal
        is printed by the main process alone (:mod:`normswap.recipes.processes`).
        """
        try:
            self._setup()
        except NormswapError as exc:
            shown_by_main(exc, getattr(self, "main", None))
            raise

    def _check_output_once(self) -> tuple[Path, Path | None, list[Path]]:
        """:func:`_check_output` on the main process, before any process creates anything; the others
        take its verdict (a broadcast), so none of them looks at the directory once the main one has
        started writing into it."""
        if self.accelerator.num_processes == 1:
            return _check_output(self.cfg)
        from accelerate.utils import broadcast_object_list

        verdict: list[Any] = [None]
        if self.main:
            try:
                verdict[0] = ("ok", _check_output(self.cfg), None)
            except NormswapError as exc:
                verdict[0] = ("refused", str(exc), exc.exit_code)
        broadcast_object_list(verdict)
        kind, value, code = verdict[0]
        if kind == "refused":  # the same error, and exit code, on every process
            exc = NormswapError(value)
            exc.exit_code = code
            raise exc
        return value

    def _setup(self) -> None:
        from accelerate.utils import set_seed

        cfg = self.cfg
        for spec in (cfg.model.source, cfg.model.tokenizer):
            # a preset is written to disk now, before the process group exists (transformers saves on
            # rank 0 only once it does): every process then reads its own copy of the same weights
            models_mod.local_path(spec)
        self.accelerator = _make_accelerator(cfg)
        self.main = self.accelerator.is_main_process
        if cfg.progressive.enabled and self.accelerator.distributed_type.value in ("FSDP", "DEEPSPEED"):
            raise NormswapError(
                "config key `progressive.enabled` is not supported under FSDP or DeepSpeed (norms are "
                "swapped after the model is sharded); use DDP, or convert.mode=all"
            )
        self.out, self.resume_dir, replaced = self._check_output_once()
        set_seed(cfg.train.seed)
        self.device = self.accelerator.device
        self.console = _Console(self.main, False, 0, 0)
        sharding = [k for k in ("FSDP", "DEEPSPEED") if os.environ.get(f"ACCELERATE_USE_{k}", "").lower() == "true"]
        if sharding and launched_on_cpu_only():
            self.console.print(
                f"note: {'FSDP' if sharding[0] == 'FSDP' else 'DeepSpeed'} needs a GPU; on this CPU-only machine "
                f"the {self.accelerator.num_processes} processes run as plain data parallelism over gloo (each "
                "holds the whole model)"
            )
        if cfg.loss.pooling == "auto":  # the sentence-transformers pooling when the model ships one
            cfg.loss.pooling = models_mod.sentence_pooling(cfg.model.source or cfg.model.student) or "mean"
            if self.task.embeds:
                self.console.print(f"pooling: {cfg.loss.pooling}")
        self.tokenizer = models_mod.load_tokenizer(cfg.model)
        preflight.check_settings(cfg, self.tokenizer, self.device, self.console.print)
        self._setup_data()
        self._setup_models()
        self._setup_optimisation()
        self._group_batches()
        # nothing is written before every check has passed: a refused run leaves no directory behind
        _create_output(self.out, replaced, self.main)
        self.accelerator.wait_for_everyone()
        if self.resume_dir is not None:
            self._resume()
        else:
            self._start()

    def _setup_data(self) -> None:
        cfg, acc = self.cfg, self.accelerator
        docs = data_mod.read_documents(cfg.data)
        tokens = data_mod.tokenize(docs, self.tokenizer, cfg.data, cfg.task)
        self.source = data_mod.BatchSource(
            tokens, cfg.data, cfg.task, self.tokenizer, acc.process_index, acc.num_processes
        )
        calibrates = not cfg.model.student or cfg.progressive.enabled  # norms are fitted on these batches
        preflight.check_data(cfg, self.source, calibrates, self.console.print)
        self.calibration = self.source.calibration_batches(cfg.convert.calibration_batches)
        self.eval_batches = self.source.eval_batches()
        self.console.print(
            f"data: {len(docs)} documents -> {len(tokens.train)} train / {len(tokens.eval)} held-out "
            f"examples of <= {cfg.data.seq_len} tokens"
        )

    def _group_batches(self) -> None:
        """``data.neighbour_groups``: batches of teacher-neighbour groups (one teacher pass over the
        training split; the same on every process, so batches stay a pure function of the step)."""
        size = self.cfg.data.neighbour_groups
        if size <= 1 or self.teacher is None:
            return
        t0 = time.perf_counter()
        embeddings = tasks.sentence_embeddings(
            self.teacher, self.source.train_examples(self.cfg.data.eval_batch_size), self.cfg.loss.pooling,
            self.device, self.accelerator.autocast,
        )
        self.source.group_by_neighbours(embeddings, size)
        self.console.print(f"batches: groups of {size} teacher neighbours ({time.perf_counter() - t0:.0f} s)")

    def _setup_models(self) -> None:
        cfg = self.cfg
        need_source = cfg.teacher.enabled or not cfg.model.student
        teacher = models_mod.load_teacher(cfg.model, cfg.task) if need_source and cfg.model.source else None
        if cfg.teacher.enabled and teacher is None:
            raise NormswapError("config key `model.source` is required: the teacher is the original model")
        self.student, self.conversion = models_mod.build_student(
            cfg.model,
            cfg.convert,
            cfg.task,
            teacher,
            self.calibration,
            mode="exact" if cfg.progressive.enabled and not cfg.model.student else None,
        )
        self.teacher = teacher if cfg.teacher.enabled else None
        self.console.print(f"student: {self.conversion.get('message') or self.conversion.get('path')}")
        self.prog = None
        if cfg.progressive.enabled:
            example = self.calibration[0] if self.calibration else tasks.model_inputs(self.source.train_batch(0))
            self.prog = models_mod.plan_progressive(
                self.student, cfg.progressive, cfg.convert.backend, cfg.train.steps, tasks.model_inputs(example)
            )
            self.console.print(f"progressive: {len(self.prog.stages)} stage(s) at steps {self.prog.swap_steps()}")
        preflight.check_student(cfg, plan_of(self.student), self.prog is not None)
        # "before" of a progressive run: the one-shot conversion (every stage swapped at once, fitted now)
        self.before_model = None
        if self.resume_dir is None and self.prog is not None:
            self.before_model = copy.deepcopy(self.student)
            before_prog = copy.deepcopy(self.prog)
            before_prog.sites = self.prog.sites
            for k in range(len(self.prog.stages)):
                models_mod.swap_stage(self.before_model, before_prog, k, self.calibration)

    def _setup_optimisation(self) -> None:
        from accelerate.utils import DistributedType

        cfg, accelerator = self.cfg, self.accelerator
        models_mod.set_dropout(self.student, cfg.train.dropout)
        model = models_mod.select_trainable(self.student, cfg.train.trainable, cfg.train.lora)
        self.trainable = models_mod.trainable_summary(model)
        optimizer = _optimizer(model, cfg)
        self.scheduler = _scheduler(optimizer, cfg)
        ds_plugin = getattr(accelerator.state, "deepspeed_plugin", None)
        if ds_plugin is not None:  # no prepared dataloader tells DeepSpeed the micro-batch size
            ds_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.data.batch_size
        # FSDP turns the parameters into shards: keep the unsharded structure (meta, no memory) to build
        # the final model from the gathered weights in save()
        self.skeleton = models_mod.meta_copy(model) if accelerator.distributed_type == DistributedType.FSDP else None
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        accelerator.register_for_checkpointing(self.scheduler)
        if self.teacher is not None:
            self.teacher.to(self.device)
        self.reduce = (lambda t: accelerator.reduce(t, "sum")) if accelerator.num_processes > 1 else None
        self.broadcast = None
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast

            self.broadcast = broadcast
        self.log = metrics_mod.MetricsLog(self.out / "metrics.jsonl", enabled=self.main)
        sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        if cfg.eval.keep_best and sharded:
            self.console.print("eval.keep_best is off under FSDP/DeepSpeed (sharded weights): the last step is saved")
        self.best = _Best(*selection_metric(cfg), enabled=cfg.eval.keep_best and not sharded)
        # steps before the last progressive swap still hold LayerNorms: not a candidate for keep_best
        self.final_structure = self.prog.last_step() if self.prog is not None else 0

    def _resume(self) -> None:
        state = json.loads((self.resume_dir / "trainer_state.json").read_text())
        self.step, self.seen_tokens, self.train_time = state["step"], state["tokens"], state["train_time_s"]
        self.metrics_before, self.last_eval = state["metrics_before"], state.get("last_eval", {})
        if self.prog is not None:
            for k in self.prog.due(self.step):  # structure only: the weights come from the checkpoint
                models_mod.swap_stage(self.accelerator.unwrap_model(self.model), self.prog, k, None)
        self.accelerator.load_state(str(self.resume_dir))
        self.accelerator.step = 0
        self.best.load(self.resume_dir, state.get("best"))
        self.log.truncate_after(self.step)
        self.console.print(f"resumed from {self.resume_dir} at step {self.step}")

    def _start(self) -> None:
        cfg = self.cfg
        if self.main:
            (self.out / "recipe.yaml").write_text(cfg.to_yaml())
        self._swap_due(0)
        if self.before_model is not None:
            self.before_model.to(self.device)
            self.metrics_before = self.evaluate(self.before_model)
            self.before_model = None
        elif cfg.eval.before:
            self.metrics_before = self.evaluate(self.model)
        self.log.write({"step": 0, "split": "before", **self.metrics_before})
        if cfg.eval.before:
            self.last_eval = self.metrics_before if self.prog is None else self.evaluate(self.model)
            self.log.write({"step": 0, "split": "eval", **self.last_eval})
            if self.final_structure <= 0:
                self.best.consider(0, self.last_eval, self.accelerator.unwrap_model(self.model))
        # the student line's figures were measured on the conversion's own inputs (built-in text); these
        # and every later evaluation on the held-out split of data.path, prepared as for training
        self.console.print(f"before (held-out split of data.path): {metrics_mod.headline(self.metrics_before)}")

    # ---- evaluate
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Held-out metrics of ``model`` against the teacher, summed over all processes."""
        return metrics_mod.evaluate(
            model, self.teacher, self.eval_batches, self.cfg.task, self.cfg.loss.pooling, self.device,
            self.reduce, self.accelerator.autocast,
        )

    # ---- train
    def _swap_due(self, step: int, announce: bool = False) -> None:
        """Swap the progressive stages due at ``step`` (fitted on the calibration batches)."""
        if self.prog is None:
            return
        for k in self.prog.due(step):
            names = models_mod.swap_stage(
                self.accelerator.unwrap_model(self.model), self.prog, k, self.calibration, self.device,
                self.broadcast,
            )
            if announce:
                self.console.print(f"step {step}: swapped {len(names)} LayerNorm(s) to RMSNorm: {', '.join(names)}")

    def _optimiser_step(self, window: dict[str, float]) -> None:
        """One optimiser step over ``gradient_accumulation_steps`` micro-batches; adds to ``window``."""
        cfg, accelerator, model = self.cfg, self.accelerator, self.model
        gas = cfg.train.gradient_accumulation_steps
        for micro in range(gas):
            batch = {k: v.to(self.device) for k, v in self.source.train_batch(self.step * gas + micro).items()}
            with accelerator.accumulate(model):
                loss, parts = _loss(self.task, cfg, model, self.teacher, batch, accelerator.autocast)
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.train.max_grad_norm:
                    accelerator.clip_grad_norm_(_trainable(model), cfg.train.max_grad_norm)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            self.seen_tokens += int(batch["attention_mask"].sum()) * accelerator.num_processes
            for k, v in {"loss": float(loss.detach()), **parts}.items():
                window[k] = window.get(k, 0.0) + v / gas
        if not getattr(self.optimizer, "step_was_skipped", False):
            self.scheduler.step()
        self.step += 1

    def train(self) -> None:
        """The training loop: log, evaluate, swap progressive stages and checkpoint on schedule."""
        cfg = self.cfg
        self.console = _Console(self.main, cfg.log.progress_bar, cfg.train.steps, self.step)
        window: dict[str, float] = {}
        window_n = 0
        stop_at = cfg.checkpoint.stop_after or cfg.train.steps
        self.model.train()
        tick = time.perf_counter()
        while self.step < cfg.train.steps:
            self._optimiser_step(window)
            step = self.step
            window_n += 1
            if step < cfg.train.steps:
                self._swap_due(step, announce=True)
            self.console.update({k: v / window_n for k, v in window.items() if k == "loss"})
            if step % cfg.log.every == 0 or step == cfg.train.steps:
                elapsed = self.train_time + time.perf_counter() - tick
                self.log.write({"step": step, "split": "train", **{k: v / window_n for k, v in window.items()},
                                "lr": self.scheduler.get_last_lr()[0], "tokens": self.seen_tokens,
                                "elapsed_s": round(elapsed, 3)})
                window, window_n = {}, 0
            if step % cfg.eval.every == 0 or step == cfg.train.steps:
                self.last_eval = self.evaluate(self.model)
                self.log.write({"step": step, "split": "eval", **self.last_eval})
                if step >= self.final_structure:
                    self.best.consider(step, self.last_eval, self.accelerator.unwrap_model(self.model))
                self.console.print(f"step {step}: {metrics_mod.headline(self.last_eval)}")
                if self._out_of_patience(step):
                    break
            if step % cfg.checkpoint.every == 0 or step == stop_at:
                self.train_time += time.perf_counter() - tick
                tick = time.perf_counter()
                _save_checkpoint(self.accelerator, self.out, step, cfg, {
                    "step": step,
                    "tokens": self.seen_tokens,
                    "train_time_s": self.train_time,
                    "metrics_before": self.metrics_before,
                    "last_eval": self.last_eval,
                    "swapped": list(self.prog.done) if self.prog else [],
                }, self.best)
            if step == stop_at and stop_at < cfg.train.steps:
                self.stopped_early = True
                break
        self.train_time += time.perf_counter() - tick
        self.console.close()
        in_sync = _replicas_in_sync(self.accelerator, self.model)
        if in_sync is not None:
            self.log.write({"step": self.step, "split": "replicas", "processes": self.accelerator.num_processes,
                            "in_sync": in_sync})
            if not in_sync:
                self.console.print(
                    "warning: data-parallel replicas hold different weights; the saved model is rank 0's"
                )

    def _out_of_patience(self, step: int) -> bool:
        """``eval.patience``: True once that many evaluations in a row (after the last progressive swap)
        have not beaten the kept one; the run then ends and :meth:`save` keeps the best step."""
        patience, best = self.cfg.eval.patience, self.best
        if not patience or not best.enabled or best.step is None or step < self.final_structure:
            return False
        since = (step - max(best.step, self.final_structure)) // self.cfg.eval.every
        if since < patience:
            return False
        self.converged = True
        self.log.write({"step": step, "split": "early_stop", "best_step": best.step, "patience": patience})
        self.console.print(f"step {step}: no held-out gain over step {best.step} in {since} evaluation(s) "
                           f"(eval.patience={patience}): stopping; the saved model is step {best.step}'s")
        return True

    # ---- save
    def save(self) -> RunResult:
        """Keep the held-out-best step, write ``OUT/model`` (main process) and return the result."""
        accelerator, best = self.accelerator, self.best
        metrics_after = self.last_eval
        if not self.stopped_early and best.state is not None and best.step != self.step:
            accelerator.unwrap_model(self.model).load_state_dict(best.state)
            metrics_after = best.metrics
            self.console.print(
                f"keeping step {best.step}: best held-out {best.metric} ({best.metrics[best.metric]:.4g})"
            )
        kept_step = best.step if best.state is not None else self.step
        if not self.stopped_early:
            self.log.write({"step": kept_step, "split": "after", **metrics_after})
        unwrapped = models_mod.finalize(self._final_model())
        unwrapped.eval()
        model_dir, saved_with = None, None
        if not self.stopped_early:
            accelerator.wait_for_everyone()
            if self.main:
                model_dir = str(self.out / "model")
                saved_with = self._write_model(unwrapped, model_dir, metrics_after, kept_step)
            accelerator.wait_for_everyone()
        return RunResult(
            output_dir=str(self.out),
            model_dir=model_dir,
            metrics_before=self.metrics_before,
            metrics_after=metrics_after,
            steps=self.step,
            tokens=self.seen_tokens,
            train_time_s=self.train_time,
            wall_time_s=time.perf_counter() - self.t_start,
            saved_with=saved_with,
            stopped_early=self.stopped_early,
            converged=self.converged,
            resumed_from=str(self.resume_dir) if self.resume_dir else None,
            best_step=best.step if best.state is not None else None,
            conversion=self.conversion,
            model=unwrapped,
            main_process=self.main,
        )

    def _final_model(self) -> nn.Module:
        """The trained student as one plain module. Under FSDP: gathered from every process's shards
        (a collective: every process calls it) into the unsharded structure kept before sharding, on
        the main process (on CPU); the others keep their sharded module (they write nothing)."""
        accelerator = self.accelerator
        if self.skeleton is None or self.stopped_early:
            return accelerator.unwrap_model(self.model)
        state = accelerator.get_state_dict(self.model)  # full tensors, on CPU, on the main process only
        if not self.main:
            return accelerator.unwrap_model(self.model)
        buffers = {_plain_name(name): b for name, b in
                   accelerator.unwrap_model(self.model).named_buffers(remove_duplicate=False)}
        model = models_mod.materialize(self.skeleton, state, buffers)
        self.skeleton = None
        return model

    def _write_model(self, model: nn.Module, model_dir: str, metrics_after: dict[str, float],
                     kept_step: int) -> str:
        cfg = self.cfg
        extra = {
            "finetune": {
                "recipe": cfg.to_dict(),
                "metrics_before": self.metrics_before,
                "metrics_after": metrics_after,
                "steps": self.step,
                "stopped_by_patience": self.converged,
                "kept_step": kept_step,
                "tokens": self.seen_tokens,
                "train_time_s": round(self.train_time, 3),
                "conversion": self.conversion,
                **self.trainable,
                "progressive_stages": self.prog.stages if self.prog else None,
            }
        }
        source = cfg.model.source or cfg.model.student
        card = [
            "## Distillation (normswap finetune)",
            "",
            f"{self.step} step(s) of the `{cfg.task}` recipe towards the original, {self.seen_tokens:,} tokens; "
            f"the kept model is step {kept_step}'s. Held-out figures against the original:",
            "",
            f"- before: {metrics_mod.headline(self.metrics_before) or 'not measured'}",
            f"- after: {metrics_mod.headline(metrics_after) or 'not measured'}",
        ]
        saved_with = io.save_converted(
            model, model_dir, tokenizer=self.tokenizer, fmt=cfg.output.format, manifest_extra=extra,
            source=str(source), card_section=card,
        )
        if cfg.log.plot:
            png = metrics_mod.plot(self.log.records(), self.out / "curves.png",
                                   title=f"{cfg.task}: {'/'.join(Path(source).parts[-2:])}")
            if png:
                self.console.print(f"plot: {png}")
        self.console.print(f"after: {metrics_mod.headline(metrics_after)}")
        self.console.print(f"saved: {model_dir}")
        return saved_with


def _plain_name(name: str) -> str:
    """A parameter or buffer name without the wrappers accelerate may insert (activation checkpointing's
    ``_checkpoint_wrapped_module``, ``torch.compile``'s ``_orig_mod``), as state dicts name it."""
    return ".".join(part for part in name.split(".") if part not in ("_checkpoint_wrapped_module", "_orig_mod"))


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    """The parameters to clip, read at the clip (after backward), not once before training.

    Under FSDP2 a module's parameters are swapped between the sharded ``DTensor`` (what the optimizer
    steps, and what backward leaves registered) and a plain unsharded tensor (registered from a forward
    until the reshard; the root and the final-norm group are not resharded after a no-grad forward such
    as the held-out evaluation). A list taken before training held those stale unsharded tensors:
    accelerate's FSDP ``clip_grad_norm_`` compares the list with ``model.parameters()`` (an ``aten.eq``
    of a plain tensor with a ``DTensor``, which raises), and their gradients are never the sharded ones.
    Read after backward, the list is the model's own parameter objects (the same ones, every step).
    """
    return [p for p in model.parameters() if p.requires_grad]


def _replicas_in_sync(accelerator: Any, model: nn.Module) -> bool | None:
    """Under DDP every process must hold bit-identical weights; None when not applicable."""
    from accelerate.utils import DistributedType

    if accelerator.num_processes < 2 or accelerator.distributed_type not in (
        DistributedType.MULTI_GPU,
        DistributedType.MULTI_CPU,
    ):
        return None
    with torch.no_grad():
        total = sum(p.detach().double().sum() for p in model.parameters())
        mine = torch.stack([total, (total * 1e6) % 1.0]).to(accelerator.device)
    everyone = accelerator.gather(mine.unsqueeze(0))
    return bool((everyone == everyone[0]).all())


def _save_checkpoint(
    accelerator: Any, out: Path, step: int, cfg: RecipeConfig, state: dict[str, Any], best: _Best
) -> None:
    root = out / "checkpoints"
    path = root / f"step-{step:06d}"
    accelerator.save_state(str(path), safe_serialization=True)
    if accelerator.is_main_process:
        state = {**state, "best": best.save(path)}
        (path / "trainer_state.json").write_text(json.dumps(state, indent=2, default=float))
        io.prune_checkpoints(root, cfg.checkpoint.keep_last)
    accelerator.wait_for_everyone()
