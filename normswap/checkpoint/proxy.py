"""Plan a model too big to load: analyse reduced-depth copies with random weights, extrapolate.

The analysis needs a real forward pass and the model does not fit, so it runs on *proxies*: the
same architecture and width built from the config with 3 and 4 layers per layer stack and random
weights (LayerNorm γ/β randomised so nothing is degenerate). Plans are structural (which modules
write or read which stream), so random weights give the same plan as real ones. The depth-3 plan
is extrapolated to full depth (:mod:`normswap.checkpoint.extrapolate`) and the same
extrapolation is *checked* against the depth-4 plan; any mismatch refuses the low-memory path
rather than guessing. The full plan is then checked against the full model built on the meta
device (every path exists, every norm is covered).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from normswap import inputs, memory, pipeline, presets
from normswap.analysis import walker
from normswap.analysis.plan import Plan
from normswap.checkpoint import extrapolate as ex
from normswap.checkpoint.hf_types import drop_modules
from normswap.checkpoint.io import available_memory
from normswap.errors import NormswapError
from normswap.modelinfo import model_dtype
from normswap.options import ConvertOptions
from normswap.surgery.edits import record_rms_slots

LAYER_ATTR = re.compile(
    r"^(num_hidden_layers|n_layers?|num_layers|encoder_layers|decoder_layers|"
    r"num_decoder_layers|num_encoder_layers)$"
)


def layer_attrs(config: Any) -> dict[str, int]:
    """Config attributes that set a layer count (``n_layer``, ``encoder_layers``, ...)."""
    return {
        k: v
        for k, v in config.to_dict().items()
        if LAYER_ATTR.match(k) and isinstance(v, int) and not isinstance(v, bool) and v > 0
    }


def representative(t: int, full: int, depth: int) -> int:
    """The full-depth layer a proxy layer stands for (inverse of ``extrapolate.template``)."""
    if full <= depth:
        return t
    return full - 1 if t == depth - 1 else t


def reduced_config(config: Any, depth: int) -> Any:
    """The same config with every layer stack cut to ``depth`` (per-layer lists cut to match)."""
    data = config.to_dict()
    counts = layer_attrs(config)
    for attr, n in counts.items():
        data[attr] = min(n, depth)
    _reduce_stages(data, depth)
    lengths = set(counts.values())
    for key, value in list(data.items()):
        if isinstance(value, list) and len(value) in lengths and len(value) > depth and key not in counts:
            n = len(value)
            data[key] = [value[representative(t, n, depth)] for t in range(depth)]
    try:
        return type(config).from_dict(data)
    except Exception as exc:  # noqa: BLE001
        first = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else type(exc).__name__
        raise ex.ExtrapolationError(
            f"low-memory analysis: cannot build a {depth}-layer copy of this config "
            f"({first}); convert in memory (--in-memory)"
        ) from exc


def _reduce_stages(data: dict[str, Any], depth: int) -> None:
    """A backbone config (DINOv2's, ViT's: ``stage_names`` = stem + one stage per layer, ``out_features`` /
    ``out_indices`` the stages it returns) cut to ``depth`` layers: the stages renumbered as the layers are
    (the stem, the first layers, the last as the proxy's last), the names left for the config to derive.
    A stage with no layer of its own in the proxy (a middle layer) is left as is: the config then refuses
    it, and the conversion with it (convert in memory)."""
    names, indices = data.get("stage_names"), data.get("out_indices")
    if not isinstance(names, list) or not isinstance(indices, list) or len(names) <= depth + 1:
        return
    last = len(names) - 1  # the stage of the last layer
    mapped = []
    for s in indices:
        s = s + len(names) if isinstance(s, int) and s < 0 else s
        if not isinstance(s, int):
            return
        if s < depth:  # the stem (0) and the layers the proxy keeps (stage s: layer s - 1 < depth - 1)
            mapped.append(s)
        elif s == last:
            mapped.append(depth)
        else:
            return
    data["out_indices"] = sorted(set(mapped))
    data.pop("stage_names")
    data.pop("out_features", None)


def param_count_meta(cls: type, config: Any) -> int:
    """Parameters of ``cls(config)``, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        model = cls(config)
    return sum(p.numel() for p in model.parameters())


def build_proxy(cls: type, config: Any, dtype: torch.dtype, left_out: list[str] | tuple[str, ...] = ()) -> nn.Module:
    """``cls(config)`` with seeded random weights and randomised norms, in eval mode, without the
    modules at ``left_out`` (those the checkpoint has no tensors for and its pipeline never uses)."""
    previous = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        model = cls(config)
    finally:
        torch.random.set_rng_state(previous)
    drop_modules(model, list(left_out))
    presets.randomise_norms(model)
    return model.to(dtype).eval()


def analyse_proxy(model: nn.Module, opts: ConvertOptions) -> Plan:
    """``normswap.plan`` without its working copy (the proxy is ours to use)."""
    pipeline.preflight(model)
    args, kwargs = inputs.resolve(model, None)
    dtype = model_dtype(model)
    with pipeline.eval_mode(model):
        args, kwargs = inputs.cast_inputs(args, kwargs, dtype)
        result = pipeline.analyse_copy(model, args, kwargs, opts, streamed=True)
    pipeline.decide_verdicts(result.plan, opts.mode)
    return result.plan


def stacks_of(model: nn.Module) -> dict[str, int]:
    """Every non-empty ``nn.ModuleList`` (a layer stack) and its length."""
    return {p: len(m) for p, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0}


@dataclass
class FullPlan:
    """The extrapolated full-depth plan and what the truncated verification rebuilds from."""

    plan: Plan
    proxy_plan: Plan  # the depth-3 plan (= the plan of the truncated verification model)
    proxy_config: Any
    depths: dict[str, int]  # full depth per stack
    proxy_depths: dict[str, int]
    left_out: tuple[str, ...] = ()  # modules absent from every proxy, the truncated models and the output

    def full_name(self, name: str) -> str:
        """The full-depth name of a proxy-depth path: proxy layer ``t`` stands for full layer
        ``representative(t)`` (as the truncated verification model loads it)."""
        ref = ex.Layout(self.proxy_depths).split(name)
        if ref.stack is None:
            return name
        return ex.Layout.join(ref.stack, representative(ref.index, self.depths[ref.stack],
                                                        self.proxy_depths[ref.stack]), ref.rest)


def plan_full(
    cls: type,
    config: Any,
    meta: nn.Module,
    opts: ConvertOptions,
    *,
    echo: Callable[[str], None],
    left_out: list[str] | tuple[str, ...] = (),
) -> FullPlan:
    """Analyse depth-3 and depth-4 proxies, check the extrapolation, extrapolate to full depth.

    ``left_out``: modules the checkpoint lacks and its pipeline never uses; the proxies are built
    without them, as the in-memory path analyses the model after dropping them."""
    cfg3, cfg4 = reduced_config(config, ex.PROXY_DEPTH), reduced_config(config, ex.CHECK_DEPTH)
    n3 = param_count_meta(cls, cfg3)
    budget = 0.5 * available_memory()
    dtype = torch.float64 if n3 * 8 * 1.5 < min(budget, 512 << 20) else torch.float32
    if n3 * torch.finfo(dtype).bits / 8 > budget:
        raise NormswapError(
            f"not enough memory even for a {ex.PROXY_DEPTH}-layer copy of this model "
            f"({n3:,} parameters); free memory or use a bigger machine"
        )
    plans, stacks = {}, {}
    for depth, cfg in ((ex.PROXY_DEPTH, cfg3), (ex.CHECK_DEPTH, cfg4)):
        echo(
            f"analysing a {depth}-layer proxy ({'float64' if dtype == torch.float64 else 'float32'}, "
            "random weights)"
        )
        proxy = build_proxy(cls, cfg, dtype, left_out)
        plans[depth] = analyse_proxy(proxy, opts)
        stacks[depth] = stacks_of(proxy)
        dropped = weakref.ref(proxy)
        del proxy
        memory.release(dropped)
    full_stacks = stacks_of(meta)
    grown = {p for p, n in stacks[ex.CHECK_DEPTH].items() if stacks[ex.PROXY_DEPTH].get(p) != n}
    depths3 = {p: stacks[ex.PROXY_DEPTH][p] for p in grown}
    depths4 = {p: stacks[ex.CHECK_DEPTH][p] for p in grown}
    full = {p: full_stacks.get(p, 0) for p in grown}
    if any(n < depths4[p] for p, n in full.items()):
        raise ex.ExtrapolationError(
            "low-memory analysis: the layer stacks of the reduced copies do not match the "
            "model's; convert in memory (--in-memory)"
        )
    p3, p4 = plans[ex.PROXY_DEPTH].to_dict(), plans[ex.CHECK_DEPTH].to_dict()
    if any(full[p] > depths4[p] for p in grown):
        ex.check(p3, p4, depths3, depths4)
        full_dict = ex.extrapolate(p3, depths3, full)
    elif all(full[p] == depths4[p] for p in grown):
        full_dict = p4
    else:
        full_dict = p3
    plan = Plan.from_dict(full_dict)
    plan.options["analysis"] = (
        f"low-memory: {ex.PROXY_DEPTH}-layer proxy extrapolated to full depth, "
        f"checked against a {ex.CHECK_DEPTH}-layer proxy"
        if full_dict is not p4 and full_dict is not p3
        else "low-memory: random-weight copy at full depth"
    )
    record_rms_slots(plan)
    proxy_plan = plans[ex.PROXY_DEPTH]
    record_rms_slots(proxy_plan)
    validate_against_meta(plan, meta)
    return FullPlan(plan, proxy_plan, cfg3, full, depths3, tuple(left_out))


def validate_against_meta(plan: Plan, meta: nn.Module) -> None:
    """Every path of the extrapolated plan must exist in the full model with matching shapes."""
    modules = dict(meta.named_modules())
    params = dict(meta.named_parameters(remove_duplicate=False))

    def fail(what: str) -> None:
        raise ex.ExtrapolationError(
            f"low-memory analysis: the extrapolated plan does not fit the model ({what}); "
            "convert in memory (--in-memory)"
        )

    for sp in plan.sites:
        if sp.name not in modules:
            fail(f"no module {sp.name}")
    for e in plan.writer_edits:
        if e.target not in params:
            fail(f"no parameter {e.target}")
    for f in plan.folds:
        if f.reader not in modules or f.site not in modules:
            fail(f"no module {f.reader}")
    for m in plan.beta_moves:
        if m.reader not in modules or m.into not in modules or m.site not in modules:
            fail(f"no module {m.into}")
    for h in plan.hooks:
        if h.module not in modules:
            fail(f"no module {h.module}")
    for u in plan.unties:
        if u.module not in modules or u.source not in params:
            fail(f"no tie {u.module}.{u.attr}")
    for t in plan.constant_trades:
        if t.table not in params or t.into not in params:
            fail(f"no parameter {t.table if t.table not in params else t.into}")
        if t.hi * params[t.table].shape[t.axis] > params[t.table].numel():
            fail(f"`{t.table}` has fewer than {t.hi} rows")
    covered = {sp.name for sp in plan.sites} | {s["name"] for s in plan.skipped}
    missing = [
        p
        for p in walker.candidates(meta)
        if p not in covered
        and isinstance(modules[p], nn.LayerNorm)
        and not any(p.startswith(c + ".") for c in covered)
    ]
    if missing:
        fail(f"norm {missing[0]} not covered")
