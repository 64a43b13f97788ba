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

from normswap.errors import NormswapError
from normswap.recipes import data as data_mod
from normswap.recipes import io, losses
from normswap.recipes import metrics as metrics_mod
from normswap.recipes import models as models_mod
from normswap.recipes.config import RecipeConfig, load_config, selection_metric


@dataclass
class RunResult:
    """What a recipe run produced. ``model`` is the final student (LoRA merged), in eval mode."""

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
    resumed_from: str | None = None
    best_step: int | None = None
    conversion: dict[str, Any] = field(default_factory=dict)
    model: nn.Module | None = None


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
    )


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
    cfg: RecipeConfig,
    student: nn.Module,
    teacher: nn.Module | None,
    batch: dict[str, torch.Tensor],
    autocast: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    inputs = metrics_mod.model_inputs(batch)
    out = student(**inputs)
    t_out = None
    if teacher is not None:
        with torch.no_grad(), autocast():
            t_out = teacher(**inputs)
    lc, parts = cfg.loss, {}
    total = torch.zeros((), device=batch["input_ids"].device)
    if cfg.task == "encoder":
        s_h, t_h = metrics_mod.hidden_of(out), metrics_mod.hidden_of(t_out)
        if lc.pooled_weight:
            cos = losses.pooled_cosine(s_h, t_h, batch["attention_mask"], lc.pooling)
            total = total + lc.pooled_weight * cos
            parts["cos_loss"] = float(cos.detach())
        if lc.hidden_weight:
            mse = losses.hidden_relative_mse(s_h, t_h, batch["attention_mask"])
            total = total + lc.hidden_weight * mse
            parts["hidden_loss"] = float(mse.detach())
        if lc.similarity_weight:
            sim = losses.similarity_kl(
                losses.pool(s_h.float(), batch["attention_mask"], lc.pooling),
                losses.pool(t_h.float(), batch["attention_mask"], lc.pooling),
                lc.similarity_temperature,
            )
            total = total + lc.similarity_weight * sim
            parts["similarity_loss"] = float(sim.detach())
        return total, parts
    logits = metrics_mod.logits_of(out)
    if t_out is not None and lc.kl_weight:
        mask = batch["attention_mask"] if lc.positions == "all" else batch["labels"] != -100
        kl = losses.kl_logits(logits, metrics_mod.logits_of(t_out), mask, lc.temperature)
        total = total + lc.kl_weight * kl
        parts["kl_loss"] = float(kl.detach())
    if lc.ce_weight:
        ce = losses.lm_ce(logits, batch["labels"], causal=cfg.task == "causal-lm")
        total = total + lc.ce_weight * ce
        parts["ce_loss"] = float(ce.detach())
    return total, parts


def _prepare_output(cfg: RecipeConfig, main: bool) -> tuple[Path, Path | None]:
    """Create the output directory; returns it and the checkpoint to resume from (if any)."""
    out = Path(cfg.output.dir)
    ckpt_root = out / "checkpoints"
    latest = (
        io.checkpoint_dirs(ckpt_root)[-1][1]
        if cfg.checkpoint.resume and io.checkpoint_dirs(ckpt_root)
        else None
    )
    existing = [p for p in (out / "metrics.jsonl", ckpt_root, out / "model") if p.exists()]
    if latest is None and existing and not cfg.output.overwrite:  # every process raises: none waits forever
        if cfg.checkpoint.resume:
            raise NormswapError(
                f"config key `checkpoint.resume`: {str(out / 'checkpoints')!r} holds no checkpoint to resume "
                "from; set output.overwrite=true to start the run again"
            )
        raise NormswapError(
            f"config key `output.dir`: {str(out)!r} already holds a run ({existing[0].name}); "
            "set checkpoint.resume=true to continue it or output.overwrite=true to replace it"
        )
    if latest is None and existing and main:
        for p in existing:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    if main:
        out.mkdir(parents=True, exist_ok=True)
    return out, latest


class _Console:
    def __init__(self, enabled: bool, bar: bool, total: int, initial: int) -> None:
        self.enabled = enabled
        self.bar = None
        if enabled and bar:
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
    """The held-out-best student so far (``eval.keep_best``): step, metrics and a CPU weight copy."""

    def __init__(self, metric: str, maximize: bool, enabled: bool) -> None:
        self.metric, self.maximize, self.enabled = metric, maximize, enabled
        self.step: int | None = None
        self.metrics: dict[str, float] = {}
        self.state: dict[str, torch.Tensor] | None = None

    def consider(self, step: int, metrics: dict[str, float], model: nn.Module) -> None:
        value = metrics.get(self.metric)
        if not self.enabled or value is None or value != value:
            return
        best = self.metrics.get(self.metric)
        if best is not None and not (value > best if self.maximize else value < best):
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
    cfg = load_config(config_or_path, overrides)
    from accelerate.utils import set_seed

    accelerator = _make_accelerator(cfg)
    main = accelerator.is_main_process
    if cfg.progressive.enabled and accelerator.distributed_type.value in ("FSDP", "DEEPSPEED"):
        raise NormswapError(
            "config key `progressive.enabled` is not supported under FSDP or DeepSpeed (norms are "
            "swapped after the model is sharded); use DDP, or convert.mode=all"
        )
    out, resume_dir = _prepare_output(cfg, main)
    accelerator.wait_for_everyone()
    set_seed(cfg.train.seed)
    device = accelerator.device
    console = _Console(main, False, 0, 0)

    if cfg.loss.pooling == "auto":  # the sentence-transformers pooling when the model ships one
        cfg.loss.pooling = models_mod.sentence_pooling(cfg.model.source or cfg.model.student) or "mean"
        if cfg.task == "encoder":
            console.print(f"pooling: {cfg.loss.pooling}")

    # ---- data
    tokenizer = models_mod.load_tokenizer(cfg.model)
    docs = data_mod.read_documents(cfg.data)
    tokens = data_mod.tokenize(docs, tokenizer, cfg.data, cfg.task)
    source = data_mod.BatchSource(
        tokens, cfg.data, cfg.task, tokenizer, accelerator.process_index, accelerator.num_processes
    )
    calibration = source.calibration_batches(cfg.convert.calibration_batches)
    eval_batches = source.eval_batches()
    console.print(
        f"data: {len(docs)} documents -> {len(tokens.train)} train / {len(tokens.eval)} held-out "
        f"examples of <= {cfg.data.seq_len} tokens"
    )

    # ---- models
    need_source = cfg.teacher.enabled or not cfg.model.student
    teacher = models_mod.load_teacher(cfg.model, cfg.task) if need_source and cfg.model.source else None
    if cfg.teacher.enabled and teacher is None:
        raise NormswapError("config key `model.source` is required: the teacher is the original model")
    student, conversion = models_mod.build_student(
        cfg.model,
        cfg.convert,
        cfg.task,
        teacher,
        calibration,
        mode="exact" if cfg.progressive.enabled and not cfg.model.student else None,
    )
    if not cfg.teacher.enabled:
        teacher = None
    console.print(f"student: {conversion.get('message') or conversion.get('path')}")
    prog = None
    if cfg.progressive.enabled:
        example = calibration[0] if calibration else metrics_mod.model_inputs(source.train_batch(0))
        prog = models_mod.plan_progressive(
            student, cfg.progressive, cfg.convert.backend, cfg.train.steps, metrics_mod.model_inputs(example)
        )
        console.print(f"progressive: {len(prog.stages)} stage(s) at steps {prog.swap_steps()}")

    # "before": the one-shot conversion (for progressive runs: every stage swapped at once, fitted now)
    before_model = None
    if resume_dir is None and cfg.progressive.enabled and prog is not None:
        before_model = copy.deepcopy(student)
        before_prog = copy.deepcopy(prog)
        before_prog.sites = prog.sites
        for k in range(len(prog.stages)):
            models_mod.swap_stage(before_model, before_prog, k, calibration)

    models_mod.set_dropout(student, cfg.train.dropout)
    model = models_mod.select_trainable(student, cfg.train.trainable, cfg.train.lora)
    trainable = models_mod.trainable_summary(model)
    optimizer = _optimizer(model, cfg)
    scheduler = _scheduler(optimizer, cfg)
    ds_plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if ds_plugin is not None:  # no prepared dataloader tells DeepSpeed the micro-batch size
        ds_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = cfg.data.batch_size
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    if teacher is not None:
        teacher.to(device)
    reduce = (lambda t: accelerator.reduce(t, "sum")) if accelerator.num_processes > 1 else None
    broadcast = None
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast as _broadcast

        broadcast = _broadcast

    def evaluate(m: nn.Module) -> dict[str, float]:
        return metrics_mod.evaluate(
            m, teacher, eval_batches, cfg.task, cfg.loss.pooling, device, reduce, accelerator.autocast
        )

    log = metrics_mod.MetricsLog(out / "metrics.jsonl", enabled=main)
    from accelerate.utils import DistributedType

    sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
    if cfg.eval.keep_best and sharded:
        console.print("eval.keep_best is off under FSDP/DeepSpeed (sharded weights): the last step is saved")
    best = _Best(*selection_metric(cfg), enabled=cfg.eval.keep_best and not sharded)
    final_structure = prog.last_step() if prog is not None else 0  # earlier steps still have LayerNorms
    step, seen_tokens, train_time = 0, 0, 0.0
    metrics_before: dict[str, float] = {}
    last_eval: dict[str, float] = {}
    if resume_dir is not None:
        state = json.loads((resume_dir / "trainer_state.json").read_text())
        step, seen_tokens, train_time = state["step"], state["tokens"], state["train_time_s"]
        metrics_before, last_eval = state["metrics_before"], state.get("last_eval", {})
        if prog is not None:
            for k in prog.due(step):
                # structure only: the weights come from the checkpoint
                models_mod.swap_stage(accelerator.unwrap_model(model), prog, k, None)
        accelerator.load_state(str(resume_dir))
        accelerator.step = 0
        best.load(resume_dir, state.get("best"))
        log.truncate_after(step)
        console.print(f"resumed from {resume_dir} at step {step}")
    else:
        if main:
            (out / "recipe.yaml").write_text(cfg.to_yaml())
        if prog is not None:
            for k in prog.due(0):
                models_mod.swap_stage(
                    accelerator.unwrap_model(model), prog, k, calibration, device, broadcast
                )
        if before_model is not None:
            before_model.to(device)
            metrics_before = evaluate(before_model)
            del before_model
        elif cfg.eval.before:
            metrics_before = evaluate(model)
        log.write({"step": 0, "split": "before", **metrics_before})
        if cfg.eval.before:
            last_eval = metrics_before if prog is None else evaluate(model)
            log.write({"step": 0, "split": "eval", **last_eval})
            if final_structure <= 0:
                best.consider(0, last_eval, accelerator.unwrap_model(model))
        console.print(f"before: {metrics_mod.headline(metrics_before)}")

    # ---- train
    gas = cfg.train.gradient_accumulation_steps
    params = [p for p in model.parameters() if p.requires_grad]
    console = _Console(main, cfg.log.progress_bar, cfg.train.steps, step)
    window: dict[str, float] = {}
    window_n = 0
    stop_at = cfg.checkpoint.stop_after or cfg.train.steps
    stopped_early = False
    model.train()
    tick = time.perf_counter()
    while step < cfg.train.steps:
        for micro in range(gas):
            batch = {k: v.to(device) for k, v in source.train_batch(step * gas + micro).items()}
            with accelerator.accumulate(model):
                loss, parts = _loss(cfg, model, teacher, batch, accelerator.autocast)
                accelerator.backward(loss)
                if accelerator.sync_gradients and cfg.train.max_grad_norm:
                    accelerator.clip_grad_norm_(params, cfg.train.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            seen_tokens += int(batch["attention_mask"].sum()) * accelerator.num_processes
            for k, v in {"loss": float(loss.detach()), **parts}.items():
                window[k] = window.get(k, 0.0) + v / gas
        if not getattr(optimizer, "step_was_skipped", False):
            scheduler.step()
        step += 1
        window_n += 1
        if prog is not None and step < cfg.train.steps:
            for k in prog.due(step):
                names = models_mod.swap_stage(
                    accelerator.unwrap_model(model), prog, k, calibration, device, broadcast
                )
                console.print(
                    f"step {step}: swapped {len(names)} LayerNorm(s) to RMSNorm: {', '.join(names)}"
                )
        console.update({k: v / window_n for k, v in window.items() if k == "loss"})
        if step % cfg.log.every == 0 or step == cfg.train.steps:
            elapsed = train_time + time.perf_counter() - tick
            log.write(
                {
                    "step": step,
                    "split": "train",
                    **{k: v / window_n for k, v in window.items()},
                    "lr": scheduler.get_last_lr()[0],
                    "tokens": seen_tokens,
                    "elapsed_s": round(elapsed, 3),
                }
            )
            window, window_n = {}, 0
        if step % cfg.eval.every == 0 or step == cfg.train.steps:
            last_eval = evaluate(model)
            log.write({"step": step, "split": "eval", **last_eval})
            if step >= final_structure:
                best.consider(step, last_eval, accelerator.unwrap_model(model))
            console.print(f"step {step}: {metrics_mod.headline(last_eval)}")
        if step % cfg.checkpoint.every == 0 or step == stop_at:
            train_time += time.perf_counter() - tick
            tick = time.perf_counter()
            _save_checkpoint(
                accelerator,
                out,
                step,
                cfg,
                {
                    "step": step,
                    "tokens": seen_tokens,
                    "train_time_s": train_time,
                    "metrics_before": metrics_before,
                    "last_eval": last_eval,
                    "swapped": list(prog.done) if prog else [],
                },
                best,
            )
        if step == stop_at and stop_at < cfg.train.steps:
            stopped_early = True
            break
    train_time += time.perf_counter() - tick
    console.close()
    in_sync = _replicas_in_sync(accelerator, model)
    if in_sync is not None:
        log.write(
            {"step": step, "split": "replicas", "processes": accelerator.num_processes, "in_sync": in_sync}
        )
        if not in_sync:
            console.print(
                "warning: data-parallel replicas hold different weights; the saved model is rank 0's"
            )

    # ---- finish
    metrics_after = last_eval
    if not stopped_early and best.state is not None and best.step != step:
        accelerator.unwrap_model(model).load_state_dict(best.state)
        metrics_after = best.metrics
        console.print(
            f"keeping step {best.step}: best held-out {best.metric} ({best.metrics[best.metric]:.4g})"
        )
    if not stopped_early:
        log.write({"step": best.step if best.state is not None else step, "split": "after", **metrics_after})
    unwrapped = models_mod.finalize(accelerator.unwrap_model(model))
    unwrapped.eval()
    model_dir, saved_with = None, None
    if not stopped_early:
        accelerator.wait_for_everyone()
        if main:
            model_dir = str(out / "model")
            extra = {
                "finetune": {
                    "recipe": cfg.to_dict(),
                    "metrics_before": metrics_before,
                    "metrics_after": metrics_after,
                    "steps": step,
                    "kept_step": best.step if best.state is not None else step,
                    "tokens": seen_tokens,
                    "train_time_s": round(train_time, 3),
                    "conversion": conversion,
                    **trainable,
                    "progressive_stages": prog.stages if prog else None,
                }
            }
            saved_with = io.save_converted(
                unwrapped, model_dir, tokenizer=tokenizer, fmt=cfg.output.format, manifest_extra=extra
            )
            if cfg.log.plot:
                png = metrics_mod.plot(
                    log.records(),
                    out / "curves.png",
                    title=f"{cfg.task}: {'/'.join(Path(cfg.model.source or cfg.model.student).parts[-2:])}",
                )
                if png:
                    console.print(f"plot: {png}")
            console.print(f"after: {metrics_mod.headline(metrics_after)}")
            console.print(f"saved: {model_dir}")
        accelerator.wait_for_everyone()
    return RunResult(
        output_dir=str(out),
        model_dir=model_dir,
        metrics_before=metrics_before,
        metrics_after=metrics_after,
        steps=step,
        tokens=seen_tokens,
        train_time_s=train_time,
        wall_time_s=time.perf_counter() - t_start,
        saved_with=saved_with,
        stopped_early=stopped_early,
        resumed_from=str(resume_dir) if resume_dir else None,
        best_step=best.step if best.state is not None else None,
        conversion=conversion,
        model=unwrapped,
    )


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
