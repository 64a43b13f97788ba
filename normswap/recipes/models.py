"""Teacher, student, trainable-parameter selection, LoRA, and the progressive LayerNorm→RMSNorm swap."""

from __future__ import annotations

import fnmatch
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from normswap import presets
from normswap.analysis.plan import Plan, SitePlan, attach_plan, plan_of
from normswap.checkpoint import hf_types
from normswap.copying import deepcopy_module
from normswap.errors import NormswapError, first_line
from normswap.nn.rmsnorm import RMSNorm
from normswap.recipes import io, tasks
from normswap.recipes.config import ConvertConfig, LoraConfig, ModelConfig, ProgressiveConfig

log = logging.getLogger("normswap.recipes")

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


_PRESET_DIRS: dict[str, str] = {}


def local_path(spec: str | None) -> str | None:
    """``spec`` as a local directory: a preset name (``tiny-bert``, as ``normswap convert`` accepts) is
    written once per process to a temporary directory (removed at exit), anything else is returned as
    is. Presets are seeded, so every process of a distributed run builds the same weights; call it
    before ``torch.distributed`` is initialised (the recipe does), since transformers then writes a
    model on rank 0 only."""
    if not spec or not presets.is_preset(spec):
        return spec
    if spec not in _PRESET_DIRS:
        import atexit
        import shutil
        import tempfile

        root = tempfile.mkdtemp(prefix=f"normswap-{spec}-")
        atexit.register(shutil.rmtree, root, True)
        _PRESET_DIRS[spec] = str(presets.save(spec, root))
    return _PRESET_DIRS[spec]


def sentence_pooling(path: str | None) -> str | None:
    """``"mean"`` or ``"cls"`` from a sentence-transformers directory (``modules.json`` ->
    the Pooling module's ``config.json``, else ``1_Pooling/config.json``); None when absent."""
    import json
    from pathlib import Path

    path = local_path(path)
    if not path or not Path(path).is_dir():
        return None
    root = Path(path)
    candidates = [root / "1_Pooling" / "config.json"]
    try:
        modules = json.loads((root / "modules.json").read_text())
        candidates = [root / m["path"] / "config.json" for m in modules
                      if str(m.get("type", "")).endswith("Pooling")] + candidates
    except (OSError, ValueError, KeyError, TypeError):
        pass
    for cfg_path in candidates:
        try:
            cfg = json.loads(cfg_path.read_text())
        except (OSError, ValueError):
            continue
        if cfg.get("pooling_mode_cls_token"):
            return "cls"
        if cfg.get("pooling_mode_mean_tokens") or cfg.get("pooling_mode_mean_sqrt_len_tokens"):
            return "mean"
    return None


def tokenizer_source(cfg: ModelConfig) -> tuple[str, str]:
    """``(config key, path)`` the recipe's tokenizer comes from: model.tokenizer, else the source, else the student."""
    return next(
        (k, p)
        for k, p in (("model.tokenizer", cfg.tokenizer), ("model.source", cfg.source), ("model.student", cfg.student))
        if p
    )


def load_tokenizer(cfg: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    key, path = tokenizer_source(cfg)
    try:
        tok = AutoTokenizer.from_pretrained(
            local_path(path), local_files_only=True, trust_remote_code=cfg.trust_remote_code
        )
    except Exception as exc:  # noqa: BLE001 - transformers raises many types here
        raise NormswapError(
            f"config key `{key}`: no tokenizer could be loaded from {path!r} "
            f"({type(exc).__name__}); set model.tokenizer to a local tokenizer directory"
        ) from None
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def load_teacher(cfg: ModelConfig, task: str) -> nn.Module:
    """The original model, frozen and in eval mode. Never downloads (``local_files_only``)."""
    cls = tasks.get(task).model_class()
    try:
        model = cls.from_pretrained(
            local_path(cfg.source),
            local_files_only=True,
            dtype=DTYPES[cfg.dtype],
            trust_remote_code=cfg.trust_remote_code,
        )
    except Exception as exc:  # noqa: BLE001
        raise NormswapError(
            f"config key `model.source`: could not load {cfg.source!r} as a {task} model "
            f"({type(exc).__name__}: {first_line(exc, 200)})"
        ) from None
    return freeze(model)


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


def build_student(
    cfg: ModelConfig,
    conv: ConvertConfig,
    task: str,
    teacher: nn.Module | None,
    calibration: list[dict[str, torch.Tensor]],
    *,
    mode: str | None = None,
) -> tuple[nn.Module, dict]:
    """A converted student: loaded from ``model.student`` or converted from the teacher on the fly.

    Returns the model (train mode, all parameters trainable) and a summary of the conversion.
    """
    if cfg.student:
        model = io.load_converted(
            cfg.student, tasks.get(task).model_class(), dtype=DTYPES[cfg.dtype],
            trust_remote_code=cfg.trust_remote_code,
        )
        plan = plan_of(model)
        if plan is None:
            raise NormswapError(
                f"config key `model.student`: {cfg.student!r} is not a normswap-converted "
                "directory (no manifest); give the original as model.source and leave "
                "model.student empty to convert on the fly"
            )
        summary = {"source": "directory", "path": cfg.student, "verdicts": plan.counts()}
    else:
        if teacher is None:
            teacher = load_teacher(cfg, task)
        import normswap

        model = deepcopy_module(teacher)  # closures over the teacher move to the student
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore"
            )  # approximate-site warnings: the metrics below say it with numbers
            # allow_unusable: recovering an unusable conversion is what the recipe is for
            # mode="exact" comes only from a progressive schedule, which swaps the approximate norms later:
            # their writers are centered now (defer_approximate)
            options = conv.options(mode=mode or conv.mode, defer_approximate=mode == "exact",
                                   calibration=calibration or None, allow_unusable=True)
            report = normswap.patch(model, options=options)
        plan = (plan_of(model) or report.plan)
        attach_plan(model, plan)
        summary = {
            "source": "converted",
            "mode": mode or conv.mode,
            "message": report.message,
            "calibration_batches": len(calibration),
            "calibration": report.calibration.summary() if report.calibration is not None else None,
            "verdicts": plan.counts() if plan is not None else {},
            "verification": {k: v for k, v in report.verification.items() if isinstance(v, (int, float))},
        }
    model.requires_grad_(True)
    model.train()
    return model, summary


# ---------------------------------------------------------------------------------- trainable
def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, RMSNorm)) or "Norm" in type(module).__name__


def norm_parameter_names(model: nn.Module) -> set[str]:
    names = set()
    for mname, module in model.named_modules():
        if _is_norm(module):
            for pname, _ in module.named_parameters(recurse=False):
                names.add(f"{mname}.{pname}" if mname else pname)
    return names


def set_dropout(model: nn.Module, p: float | None) -> int:
    """Set every dropout module's probability (``None``: leave the model's own). Returns how many.

    Recovery matches a teacher that runs in eval mode: dropout in the student only adds noise to
    that target, so the recipes default to 0.
    """
    if p is None:
        return 0
    count = 0
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = float(p)
            count += 1
    return count


def select_trainable(model: nn.Module, how: str, lora: LoraConfig) -> nn.Module:
    """Set ``requires_grad`` per ``train.trainable``; returns the model to train (a PeftModel for LoRA)."""
    if how == "all":
        model.requires_grad_(True)
        return model
    if how == "norms_and_biases":
        norms = norm_parameter_names(model)
        for name, p in model.named_parameters():
            p.requires_grad_(name in norms or name.endswith("bias"))
        return model
    try:
        import peft
    except ImportError:
        raise NormswapError(
            "config key `train.trainable`: 'lora' needs the `peft` package "
            "(pip install 'normswap[train]' or pip install peft)"
        ) from None
    norms = norm_parameter_names(model)
    targets = lora.target_modules or default_lora_targets(getattr(model.config, "model_type", ""))
    config = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets)
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as exc:
        raise NormswapError(
            f"config key `train.lora.target_modules`: {first_line(exc, 200)}"
        ) from None
    # the norms are what conversion changed: train them too (cheap, and where the error is)
    base = wrapped.get_base_model()
    for name, p in base.named_parameters():
        if name in norms:
            p.requires_grad_(True)
    return wrapped


def default_lora_targets(model_type: str) -> list[str] | None:
    """PEFT's default LoRA target modules for a model type, a converted checkpoint's (``normswap_gpt2``)
    under its stock type, which PEFT's table knows; None where PEFT has no default."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

    targets = defaults.get(hf_types.base_type(model_type) or model_type)
    return list(targets) if targets is not None else None


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def finalize(model: nn.Module) -> nn.Module:
    """Merge LoRA adapters into the weights so the output is a plain converted model."""
    if hasattr(model, "merge_and_unload"):
        plan = plan_of(base_model(model))
        model = model.merge_and_unload()
        if plan is not None:
            attach_plan(model, plan)
    return model


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device (no memory).

    Taken before FSDP shards the model: afterwards its parameters are ``DTensor`` shards and its modules
    FSDP subclasses, so the final model is rebuilt from this copy and the gathered weights
    (:func:`materialize`). Ties survive (a shared tensor is copied once), and so does everything that is
    not a tensor (the conversion plan, configs, norm settings).
    """
    memo: dict[int, Any] = {}
    for t in (*model.parameters(), *model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return deepcopy_module(model, memo)


def materialize(skeleton: nn.Module, state: dict[str, torch.Tensor],
                buffers: dict[str, torch.Tensor]) -> nn.Module:
    """Fill :func:`meta_copy`'s ``skeleton`` in place with real tensors and return it.

    ``state`` is the gathered full state dict (parameter values, cast to the skeleton's dtypes);
    ``buffers`` the trained model's buffers by name (FSDP does not shard buffers, and a non-persistent
    one, such as a position-id table, is in no state dict). A parameter registered under several names
    (a tie) becomes one tensor again, whichever of its names ``state`` holds. Anything left on the meta
    device raises (a bug, not a user error: it would be saved as garbage).
    """
    names: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for prefix, module in skeleton.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None:
                names.setdefault(id(p), []).append((module, attr, f"{prefix}.{attr}" if prefix else attr))
    done: dict[int, nn.Parameter] = {}
    for key, sites in names.items():
        module, attr, _ = sites[0]
        meta = module._parameters[attr]
        found = next((state[full] for _, _, full in sites if full in state), None)
        if found is None:
            continue
        done[key] = nn.Parameter(found.detach().to("cpu", meta.dtype), requires_grad=meta.requires_grad)
        for owner, name, _ in sites:
            owner._parameters[name] = done[key]  # not setattr: nothing of the module's own reacts to it
    for prefix, module in skeleton.named_modules(remove_duplicate=False):
        for attr, b in list(module._buffers.items()):
            full = f"{prefix}.{attr}" if prefix else attr
            value = buffers.get(full, state.get(full))
            if b is not None and value is not None:
                module._buffers[attr] = value.detach().to("cpu", b.dtype)
    left = [n for n, t in (*skeleton.named_parameters(), *skeleton.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"the gathered state dict has no value for {', '.join(left[:5])}")
    for module in skeleton.modules():  # e.g. normswap.RMSNorm: decisions were made for other tensors
        clear = getattr(module, "clear_decisions", None)
        if callable(clear):
            clear()
    return skeleton


def trainable_summary(model: nn.Module) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"trainable_parameters": train, "total_parameters": total}


# ---------------------------------------------------------------------------------- progressive
@dataclass
class Progressive:
    """Swap the still-LayerNorm approximate norms to RMSNorm in stages during training.

    Stage ``k`` is swapped when ``step == start_step + k * interval`` (optimizer steps done), each
    new RMSNorm initialised by least squares on the calibration batches as the student is *then*.
    The RMSNorm reuses the LayerNorm's parameter objects, so the optimizer (and its state), DDP's
    hooks and ``requires_grad`` carry over without rebuilding anything.
    """

    stages: list[list[str]]
    start_step: int
    interval: int
    backend: str
    sites: dict[str, Any] = field(default_factory=dict)  # path -> walker.NormSite
    done: list[str] = field(default_factory=list)

    def swap_steps(self) -> list[int]:
        return [self.start_step + k * self.interval for k in range(len(self.stages))]

    def due(self, step: int) -> list[int]:
        """Stages whose swap step is ``step`` (or earlier and not yet done)."""
        return [
            k
            for k, s in enumerate(self.swap_steps())
            if s <= step and not set(self.stages[k]) <= set(self.done)
        ]

    def last_step(self) -> int:
        return self.swap_steps()[-1] if self.stages else -1


def plan_progressive(
    model: nn.Module, cfg: ProgressiveConfig, backend: str, steps: int, example: dict[str, torch.Tensor]
) -> Progressive:
    """Work out the stages from the student's plan: its approximate sites that are still LayerNorm."""
    from normswap.pipeline import find_norms

    plan: Plan | None = plan_of(model)
    pending = [
        sp.name for sp in (plan.sites if plan else []) if sp.verdict == "approximate" and not sp.convert
    ]
    if not pending:
        raise NormswapError(
            "config key `progressive.enabled`: the student has no approximate LayerNorm left to "
            "swap (convert with convert.mode=exact, or set progressive.enabled=false)"
        )
    if cfg.order == "forward":
        groups = [pending[i : i + cfg.group_size] for i in range(0, len(pending), cfg.group_size)]
    elif cfg.order == "reverse":
        rev = pending[::-1]
        groups = [rev[i : i + cfg.group_size] for i in range(0, len(rev), cfg.group_size)]
    else:
        left, groups = list(pending), []
        for pattern in cfg.order:
            group = [n for n in left if fnmatch.fnmatchcase(n, pattern)]
            if not group:
                raise NormswapError(
                    f"config key `progressive.order`: pattern {pattern!r} matches no remaining "
                    f"approximate norm (pending: {', '.join(left) or 'none'})"
                )
            groups.append(group)
            left = [n for n in left if n not in group]
        if left:
            groups.append(left)  # whatever no pattern named goes last
    prog = Progressive(groups, cfg.start_step, cfg.interval, backend)
    if prog.last_step() >= steps:
        raise NormswapError(
            f"config key `progressive.interval`: {len(groups)} stages every {cfg.interval} steps "
            f"from step {cfg.start_step} end at step {prog.last_step()}, not before train.steps="
            f"{steps}; use a smaller interval, a larger group_size or more steps"
        )
    found = find_norms(model, example)
    prog.sites = {s.path: s for s in found.sites if s.path in pending}
    missing = [n for n in pending if n not in prog.sites]
    if missing:
        raise NormswapError(
            f"config key `progressive.enabled`: could not identify LayerNorm `{missing[0]}` in the "
            "student for swapping"
        )
    return prog


def swap_stage(
    model: nn.Module,
    prog: Progressive,
    stage: int,
    calibration: list[dict[str, torch.Tensor]] | None,
    device: torch.device | None = None,
    broadcast: Any = None,
) -> list[str]:
    """Replace stage ``stage``'s LayerNorms by RMSNorms (fitted on ``calibration`` when given).

    ``broadcast(tensor)`` (multi-process runs) copies rank 0's fitted values to every process, so
    data-parallel replicas stay identical whatever the floating-point order of the fits.
    """
    from normswap.surgery import calibrate, edits

    base = base_model(model)
    plan: Plan = plan_of(base)
    names = [n for n in prog.stages[stage] if n not in prog.done]
    modules = {n: base.get_submodule(n) for n in names}
    fits: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if calibration:
        was_training = base.training
        base.eval()
        targets = [calibrate.Target(n, modules[n], prog.sites[n]) for n in names]

        def move(batch: calibrate.Batch) -> calibrate.Batch:
            return batch[0], {k: v.to(device) if device is not None else v for k, v in batch[1].items()}

        # the norms of one stage are swapped together: each is fitted on the student as it is now
        found = calibrate.fit_norms(base, targets, [((), b) for b in calibration], sequential=False, call=move)
        base.train(was_training)
        fits = {n: (f.weight, f.bias) for n, f in found.items()}
    for n in names:
        site, old = prog.sites[n], modules[n]
        sp: SitePlan = plan.site(n)
        new = edits.make_rmsnorm(site, sp, old, prog.backend, fits.get(n))
        # reuse the LayerNorm's Parameter objects: the optimizer keeps pointing at live tensors
        for attr_new, attr_old in (("weight", site.weight_attr), ("bias", site.bias_attr)):
            p_new = getattr(new, attr_new)
            p_old = getattr(old, attr_old) if attr_old else None
            if (
                isinstance(p_new, nn.Parameter)
                and isinstance(p_old, nn.Parameter)
                and p_old.shape == p_new.shape
            ):
                with torch.no_grad():
                    p_old.copy_(p_new.to(p_old.dtype))
                setattr(new, attr_new, p_old)
            if broadcast is not None and calibration and isinstance(getattr(new, attr_new), nn.Parameter):
                with torch.no_grad():
                    param = getattr(new, attr_new)
                    param.copy_(broadcast(param.detach().clone()))
        new.train(old.training)
        edits.replace_module(base, old, new)
        sp.convert = True
        prog.done.append(n)
    if all(sp.convert for sp in plan.sites if sp.verdict == "approximate"):
        plan.options["mode"] = "all"
        plan.options["progressive"] = True
    return names
