"""Low-memory conversion: transform a checkpoint tensor by tensor, never holding the model.

Design (and why):

1. **Plan without the model.** The analysis needs a real forward pass, and the model does not
   fit. So it runs on *proxies*: the same architecture and width built from the config with 3
   and 4 layers per layer stack and random weights (LayerNorm γ/β randomised so nothing is
   degenerate). Plans are structural (which modules write or read which stream), so random
   weights give the same plan as real ones. The depth-3 plan is extrapolated to full depth
   (:mod:`normswap.checkpoint.extrapolate`) and the same extrapolation is *checked* against the
   depth-4 plan; any mismatch refuses the low-memory path rather than guessing. The full plan is
   then checked against the full model built on the meta device (every path exists, every norm
   is covered, shapes match).
2. **Stream the tensors.** Input shards are read with ``safetensors.safe_open`` (handles are
   re-opened every few hundred MB, because mapped pages count as resident memory). Each output
   tensor is computed on its own, in float64 with the same operation order as the in-memory
   surgery (untie copy, centering, then folds), and cast once, so the result is bitwise
   identical to the in-memory path. A norm's γ/β are read up front (small); a reader's bias fold
   reads its weight again from whichever shard holds it. Output shards are written by a small
   streaming safetensors writer (header first, then one tensor at a time), so memory stays at
   about one tensor whatever ``max_shard_size`` is.
3. **Verify on real weights, at reduced depth.** Centering and folding are local to each layer,
   so a model made of layers 0, 1 and L-1 (plus embeddings and head) converted by this
   checkpoint must match the same layers of the original exactly. Both truncated models are
   built, loaded from the two checkpoints and compared on probe inputs.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from normswap import api, inputs, presets
from normswap.checkpoint import extrapolate as ex
from normswap.checkpoint import hf, io, source, writer
from normswap.checkpoint.source import NothingToConvert, Source
from normswap.errors import NormswapError, VerificationFailed
from normswap.plan import CENTERED_VERDICTS, Plan
from normswap.surgery import CARRY_TENSORS, carried
from normswap.verify import compare

LAYER_ATTR = re.compile(
    r"^(num_hidden_layers|n_layers?|num_layers|encoder_layers|decoder_layers|"
    r"num_decoder_layers|num_encoder_layers)$"
)
REOPEN_BYTES = 256 << 20
ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
ST_TO_TORCH = {v: k for k, v in ST_DTYPES.items()}


# ------------------------------------------------------------------------------------ reading
@dataclass
class Entry:
    key: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * _itemsize(self.dtype)


def _itemsize(st_dtype: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2}.get(st_dtype, 1)


def scan(files: list[Path]) -> dict[str, Entry]:
    """Every tensor of a (sharded) checkpoint, from the headers only, in file then offset order."""
    entries: dict[str, Entry] = {}
    for f in files:
        header = io.read_safetensors_header(f)
        items = sorted(
            ((k, v) for k, v in header.items() if k != "__metadata__"),
            key=lambda kv: kv[1]["data_offsets"][0],
        )
        for key, info in items:
            if key in entries:
                raise NormswapError(
                    f"tensor {key} appears in two shards ({entries[key].file.name}, {f.name}); "
                    "the checkpoint is corrupted"
                )
            entries[key] = Entry(key, f, info["dtype"], tuple(info["shape"]), info["data_offsets"][0])
    return entries


class Reader:
    """Tensors by key through ``safe_open``, re-opening handles so mapped pages do not pile up."""

    def __init__(self, entries: dict[str, Entry]) -> None:
        self.entries = entries
        self._handles: dict[Path, Any] = {}
        self._read: dict[Path, int] = {}

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        e = self.entries[key]
        if self._read.get(e.file, 0) > REOPEN_BYTES:
            self.close(e.file)
        if e.file not in self._handles:
            self._handles[e.file] = safe_open(str(e.file), framework="pt").__enter__()
            self._read[e.file] = 0
        try:
            t = self._handles[e.file].get_tensor(key)
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types
            raise NormswapError(
                f"cannot read {key} from {e.file.name}: {exc}; the file is corrupted"
            ) from exc
        self._read[e.file] += e.nbytes
        if e.nbytes > REOPEN_BYTES // 4:  # a big tensor: drop its mapped pages right away
            self.close(e.file)
        return t

    def close(self, file: Path | None = None) -> None:
        for f in [file] if file is not None else list(self._handles):
            handle = self._handles.pop(f, None)
            if handle is not None:
                handle.__exit__(None, None, None)
            self._read.pop(f, None)


# ------------------------------------------------------------------------------------ writing
class ShardWriter:
    """Write one safetensors file tensor by tensor (the header, with all offsets, comes first)."""

    def __init__(self, path: Path, layout: list[tuple[str, str, tuple[int, ...]]]) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        self._expected: list[tuple[str, int]] = []
        for key, dtype, shape in layout:
            n = _itemsize(dtype)
            for s in shape:
                n *= s
            header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._expected.append((key, n))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.path = path
        self._f = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._next = 0

    def write(self, key: str, tensor: torch.Tensor) -> None:
        want_key, want_bytes = self._expected[self._next]
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        if key != want_key or data.nbytes != want_bytes:
            raise RuntimeError(f"streaming writer: got {key} ({data.nbytes} bytes), expected {want_key}")
        self._f.write(memoryview(data))
        self._next += 1

    def close(self, *, complete: bool = True) -> None:
        """Close the file; ``complete=False`` on the way out of an error (nothing raised that
        would mask it: an interrupt or a full disk must be reported as what it is)."""
        if not complete:
            with contextlib.suppress(OSError):
                self._f.close()
            return
        self._f.close()
        if self._next != len(self._expected):
            raise RuntimeError(f"streaming writer: {self.path.name} is incomplete")


# ------------------------------------------------------------------------------------ proxies
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


def _param_count_meta(cls: type, config: Any) -> int:
    with torch.device("meta"):
        model = cls(config)
    return sum(p.numel() for p in model.parameters())


def build_proxy(cls: type, config: Any, dtype: torch.dtype) -> nn.Module:
    previous = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        model = cls(config)
    finally:
        torch.random.set_rng_state(previous)
    presets.randomise_norms(model)
    return model.to(dtype).eval()


def analyse_proxy(model: nn.Module, *, mode: str, untie: bool, fold_gamma: bool) -> Plan:
    """``normswap.plan`` without its working copy (the proxy is ours to use)."""
    api.preflight(model)
    args, kwargs = inputs.resolve(model, None)
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    with api.eval_mode(model):
        args, kwargs = inputs.cast_inputs(args, kwargs, dtype)
        result = api.analyse_copy(model, args, kwargs, untie=untie, fold_gamma=fold_gamma)
    api.decide_verdicts(result.plan, mode)
    return result.plan


def _stacks(model: nn.Module) -> dict[str, int]:
    return {p: len(m) for p, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) > 0}


def set_rms_structure(plan: Plan) -> None:
    """What ``make_rmsnorm`` records at patch time: the replacement's weight/bias slots."""
    for sp in plan.sites:
        has_gamma = sp.flavour in ("standard", "gamma-only", "offset")
        has_beta = sp.flavour in ("standard", "beta-only", "offset")
        sp.rms_weight = has_gamma if sp.convert else False
        sp.rms_bias = (has_beta and not sp.fold_beta) if sp.convert else False


@dataclass
class FullPlan:
    plan: Plan
    proxy_plan: Plan  # the depth-3 plan (= the plan of the truncated verification model)
    proxy_config: Any
    depths: dict[str, int]  # full depth per stack
    proxy_depths: dict[str, int]


def plan_full(
    cls: type,
    config: Any,
    meta: nn.Module,
    *,
    mode: str,
    untie: bool,
    fold_gamma: bool,
    echo: Callable[[str], None],
) -> FullPlan:
    """Analyse depth-3 and depth-4 proxies, check the extrapolation, extrapolate to full depth."""
    cfg3, cfg4 = reduced_config(config, ex.PROXY_DEPTH), reduced_config(config, ex.CHECK_DEPTH)
    n3 = _param_count_meta(cls, cfg3)
    budget = 0.5 * _available()
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
        proxy = build_proxy(cls, cfg, dtype)
        plans[depth] = analyse_proxy(proxy, mode=mode, untie=untie, fold_gamma=fold_gamma)
        stacks[depth] = _stacks(proxy)
        del proxy
        gc.collect()
    full_stacks = _stacks(meta)
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
    set_rms_structure(plan)
    proxy_plan = plans[ex.PROXY_DEPTH]
    set_rms_structure(proxy_plan)
    validate_against_meta(plan, meta)
    return FullPlan(plan, proxy_plan, cfg3, full, depths3)


def validate_against_meta(plan: Plan, meta: nn.Module) -> None:
    """Every path of the extrapolated plan must exist in the full model with matching shapes."""
    from normswap import walker

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
    for h in plan.hooks:
        if h.module not in modules:
            fail(f"no module {h.module}")
    for u in plan.unties:
        if u.module not in modules or u.source not in params:
            fail(f"no tie {u.module}.{u.attr}")
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


def _available() -> int:
    return io.available_memory()


# ------------------------------------------------------------------------------------ key mapping
class KeyMap:
    """Checkpoint key <-> model parameter name, with transformers' own load-time renames."""

    def __init__(self, meta: nn.Module, entries: dict[str, Entry]) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

        self.meta = meta
        mapping = get_model_conversion_mapping(meta)
        renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        converters = [m for m in mapping if isinstance(m, WeightConverter)]
        meta_sd = meta.state_dict()
        prefix = meta.base_model_prefix
        self.to_model: dict[str, str] = {}
        for key in entries:
            new, pattern = rename_source_key(key, renamings, converters, prefix, meta_sd)
            if new not in meta_sd and key in meta_sd:
                new, pattern = rename_source_key(
                    key, [], [], base_model_prefix=prefix, meta_state_dict=meta_sd
                )
            if pattern is not None:
                raise NormswapError(
                    f"low-memory conversion: checkpoint tensor {key} needs a weight conversion on "
                    "load (fused/split tensors); convert in memory (--in-memory)"
                )
            if new in meta_sd:
                self.to_model[key] = new
        self.to_ckpt = {m: k for k, m in self.to_model.items()}

    def ckpt_key(self, model_key: str) -> str:
        """The checkpoint-style name for a model parameter (new keys: transformers' save-time names)."""
        if model_key in self.to_ckpt:
            return self.to_ckpt[model_key]
        from transformers.core_model_loading import revert_weight_conversion

        try:
            reverted = revert_weight_conversion(self.meta, {model_key: torch.empty(0, device="meta")})
            return next(iter(reverted))
        except Exception:  # noqa: BLE001
            return model_key


# ------------------------------------------------------------------------------------ transform
def _center_(w: torch.Tensor, axis: int, blocks: list[tuple[int, int]] | None) -> torch.Tensor:
    """``surgery._center_`` on a float64 tensor, in place (same arithmetic, no extra copy)."""
    if blocks is None:
        w.sub_(w.mean(axis, keepdim=True))
    else:
        for lo, hi in blocks:
            part = w.narrow(axis, lo, hi - lo)
            part.sub_(part.mean(axis, keepdim=True))
    return w


class Transformer:
    """Computes every output tensor of the converted checkpoint from the input checkpoint.

    Parameters tied in the original model (and not untied by the plan) are one tensor in memory,
    so an edit through either name applies to both; ``canonical`` names the group by its source.
    """

    def __init__(
        self,
        plan: Plan,
        meta: nn.Module,
        keys: KeyMap,
        reader: Reader,
        *,
        fmt: str,
        dtype: torch.dtype | None,
    ) -> None:
        self.plan, self.meta, self.keys, self.reader, self.fmt, self.dtype = (
            plan,
            meta,
            keys,
            reader,
            fmt,
            dtype,
        )
        self.untie = {f"{u.module}.{u.attr}" if u.module else u.attr: u.source for u in plan.unties}
        before, after = self._ties()
        self.alias = {t: s for t, s in before.items() if t not in self.untie}
        # aliases the checkpoint lacks and loading will not re-tie: written explicitly
        self.extra = {t: s for t, s in self.alias.items() if t not in after}
        self.center = {self.canonical(e.target): (e.axis, e.blocks) for e in plan.writer_edits}
        # MLPs widened to carry a Post-LN mean (plan.MeanCarry): model key -> (carry, which tensor).
        # compat keeps the stock width (its norms are LayerNorms, which ignore the mean).
        self.widen = {} if fmt == "compat" else {
            f"{getattr(c, which.split('.')[0])}.{which.split('.')[1]}": (c, which)
            for c in plan.mean_carries for which in CARRY_TENSORS}
        self.folds: dict[str, list[tuple[int, Any, str]]] = {}
        for i, f in enumerate(plan.folds):
            for attr in ("weight", "bias"):
                self.folds.setdefault(self.canonical(f"{f.reader}.{attr}"), []).append((i, f, attr))
        self.norms: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        self.norm_keys: dict[
            str, tuple[str, str | None, str | None]
        ] = {}  # model key -> (site, γ attr, β attr)
        for sp in plan.sites:
            if not sp.convert:
                continue
            g_attr, b_attr = writer.norm_param_names(meta.get_submodule(sp.name), sp.flavour)
            offset = 1.0 if sp.flavour == "offset" else 0.0
            gamma = self.read(f"{sp.name}.{g_attr}").double() + offset if g_attr else None
            beta = self.read(f"{sp.name}.{b_attr}").double() if b_attr else None
            self.norms[sp.name] = (gamma, beta)
            for attr in (g_attr, b_attr):
                if attr:
                    self.norm_keys[f"{sp.name}.{attr}"] = (sp.name, g_attr, b_attr)

    def _ties(self) -> tuple[dict[str, str], dict[str, str]]:
        """Tied parameters (target -> source) with the original config, and after ``mark_untied``."""
        expand = getattr(self.meta, "get_expanded_tied_weights_keys", None)
        if not callable(expand):
            return {}, {}
        before = expand(all_submodels=True)
        if not self.plan.unties:
            return before, before
        from normswap.surgery import mark_untied

        mark_untied(self.meta)  # the meta model is ours; the converted config is untied too
        return before, expand(all_submodels=True)

    def canonical(self, model_key: str) -> str:
        return self.alias.get(model_key, model_key)

    def read(self, model_key: str) -> torch.Tensor:
        key = self.keys.to_ckpt.get(model_key) or self.keys.to_ckpt.get(self.canonical(model_key))
        if key is None:
            raise NormswapError(f"the checkpoint has no tensor for {model_key}; it does not match its config")
        t = self.reader.get(key)
        # as the in-memory path: with a target dtype, read in float32 (exact for half sources),
        # edit in float64, and cast once at the end (via float32, as the in-memory model is)
        return t.float() if self.dtype is not None and t.is_floating_point() else t

    def cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """An edited float64 tensor in the output dtype, rounded as the in-memory path rounds it."""
        if self.dtype is not None and t.is_floating_point():
            t = t.float()
        return t.to(dtype)

    def edited(self, model_key: str, upto: int | None = None) -> torch.Tensor:
        """Float64 value after untie, centering and the folds (those before plan index ``upto``)."""
        key = self.canonical(model_key)
        w = self.read(self.untie.get(key, key)).double()
        if key in self.center:
            _center_(w, *self.center[key])
        for i, f, attr in self.folds.get(key, []):
            if upto is not None and i >= upto:
                break
            gamma, beta = self.norms.get(f.site, (None, None))
            transposed = f.kind == "conv1d"
            if attr == "bias" and f.beta and beta is not None:
                wt = self.edited(f"{f.reader}.weight", i)
                w = w + (beta @ wt if transposed else wt @ beta)
            if attr == "weight" and f.gamma and gamma is not None:
                w.mul_(gamma[:, None] if transposed else gamma[None, :])
        if upto is None and key in self.widen:  # after centering, as the in-memory surgery does
            w = carried(w, *self.widen[key])
        return w

    def is_edited(self, model_key: str) -> bool:
        key = self.canonical(model_key)
        return key in self.center or key in self.untie or bool(self.folds.get(key)) or key in self.widen

    def shape(self, model_key: str | None, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The output shape of a tensor (MLPs carrying a mean are wider)."""
        if model_key is None or self.canonical(model_key) not in self.widen:
            return shape
        carry, which = self.widen[self.canonical(model_key)]
        axis = 1 if which == "down.weight" else 0
        return tuple(n + carry.added if i == axis else n for i, n in enumerate(shape))

    def out_dtype(self, st_dtype: str) -> str:
        if self.dtype is not None and st_dtype in ("F32", "F16", "BF16", "F64"):
            return ST_DTYPES[self.dtype]
        return st_dtype

    def layout(self) -> list[tuple[str, str, tuple[int, ...], Callable[[], torch.Tensor], str | None]]:
        """Output tensors in order: (key, safetensors dtype, shape, producer, model parameter name)."""
        out = []
        done_sites: set[str] = set()
        for key, e in self.reader.entries.items():
            mkey = self.keys.to_model.get(key)
            if mkey is not None and mkey in self.norm_keys:
                site, g_attr, b_attr = self.norm_keys[mkey]
                if site not in done_sites:
                    done_sites.add(site)
                    out += self._norm_entries(site, key, e, g_attr, b_attr)
                continue
            dtype = self.out_dtype(e.dtype)
            if mkey is not None and self.is_edited(mkey):
                out.append(
                    (key, dtype, self.shape(mkey, e.shape),
                     lambda m=mkey, d=dtype: self.cast(self.edited(m), ST_TO_TORCH[d]), mkey)
                )
            else:
                out.append(
                    (key, dtype, e.shape, lambda k=key, d=dtype: self.reader.get(k).to(ST_TO_TORCH[d]), mkey)
                )
        present = set(self.keys.to_model.values())
        for target, src in {**self.extra, **self.untie}.items():
            if target in present:
                continue
            e = self.reader.entries[self.keys.to_ckpt[self.canonical(src)]]
            dtype = self.out_dtype(e.dtype)
            out.append(
                (
                    self.keys.ckpt_key(target),
                    dtype,
                    e.shape,
                    lambda m=target, d=dtype: self.cast(self.edited(m), ST_TO_TORCH[d]),
                    target,
                )
            )
        return out

    def _norm_entries(self, site: str, key: str, e: Entry, g_attr: str | None, b_attr: str | None) -> list:
        sp = self.plan.site(site)
        gamma, beta = self.norms[site]
        dtype = self.out_dtype(e.dtype)
        torch_dtype = ST_TO_TORCH[dtype]
        shape = tuple(sp.param_shape)
        base = self.keys.to_ckpt.get(f"{site}.{g_attr or b_attr}", key).rpartition(".")[0]
        rms_gamma = None
        if sp.rms_weight:
            rms_gamma = gamma if not sp.fold_gamma else torch.ones_like(gamma)
        rms_beta = beta if sp.rms_bias else None
        entries = []
        if self.fmt == "native":
            if rms_gamma is not None:
                entries.append(
                    (f"{base}.weight", dtype, shape, lambda v=rms_gamma: self.cast(v, torch_dtype), f"{site}.weight")
                )
            if rms_beta is not None:
                entries.append(
                    (f"{base}.bias", dtype, shape, lambda v=rms_beta: self.cast(v, torch_dtype), f"{site}.bias")
                )
        else:  # compat: the original attributes hold the RMSNorm's values
            offset = 1.0 if sp.flavour == "offset" else 0.0
            if g_attr:
                value = (
                    rms_gamma if rms_gamma is not None else torch.ones(shape, dtype=torch.float64)
                ) - offset
                entries.append(
                    (
                        self.keys.to_ckpt[f"{site}.{g_attr}"],
                        dtype,
                        shape,
                        lambda v=value: self.cast(v, torch_dtype),
                        f"{site}.{g_attr}",
                    )
                )
            if b_attr:
                value = rms_beta if rms_beta is not None else torch.zeros(shape, dtype=torch.float64)
                entries.append(
                    (
                        self.keys.to_ckpt[f"{site}.{b_attr}"],
                        dtype,
                        shape,
                        lambda v=value: self.cast(v, torch_dtype),
                        f"{site}.{b_attr}",
                    )
                )
        return entries


def write_weights(
    tf: Transformer, out: Path, max_shard_size: int, progress: bool
) -> tuple[dict[str, str], dict[str, str]]:
    """Stream every output tensor into shards; returns the weight map and {model name: output key}."""
    from tqdm.auto import tqdm

    layout = tf.layout()
    sizes = []
    for _key, dtype, shape, _, _ in layout:
        n = _itemsize(dtype)
        for s in shape:
            n *= s
        sizes.append(n)
    shards: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if shards[-1] and used + n > max_shard_size:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += n
    total = len(shards)
    names = (
        ["model.safetensors"]
        if total == 1
        else [f"model-{k + 1:05d}-of-{total:05d}.safetensors" for k in range(total)]
    )
    weight_map: dict[str, str] = {}
    bar = tqdm(
        total=sum(sizes),
        unit="B",
        unit_scale=True,
        desc="streaming tensors",
        disable=None if progress else True,
        leave=False,
    )
    try:
        for name, idx in zip(names, shards, strict=True):
            w = ShardWriter(out / name, [(layout[i][0], layout[i][1], layout[i][2]) for i in idx])
            try:
                for i in idx:
                    key, _, _, produce, _ = layout[i]
                    tensor = produce()
                    w.write(key, tensor)
                    weight_map[key] = name
                    del tensor
                    bar.update(sizes[i])
            except BaseException:
                w.close(complete=False)
                raise
            w.close()
    finally:
        bar.close()
        tf.reader.close()
    if total > 1:
        numel = sum(sz // _itemsize(layout[i][1]) for i, sz in enumerate(sizes))
        io.write_json(
            out / "model.safetensors.index.json",
            {
                "metadata": {"total_size": sum(sizes), "total_parameters": numel},
                "weight_map": dict(sorted(weight_map.items())),
            },
        )
    return weight_map, {entry[4]: entry[0] for entry in layout if entry[4] is not None}


# ------------------------------------------------------------------------------------ verification
def _load_truncated(
    model: nn.Module,
    stacks: dict[str, int],
    proxy_depths: dict[str, int],
    lookup: Callable[[str], torch.Tensor | None],
) -> list[str]:
    """Fill a truncated model in place, tensor by tensor: proxy layer ``t`` of each stack gets full
    layer ``representative(t)``. Returns the names the checkpoint had no tensor for."""
    layout = ex.Layout(proxy_depths)
    missing = []
    with torch.no_grad():
        for name, target in model.state_dict(keep_vars=True).items():
            ref = layout.split(name)
            full_name = (
                name
                if ref.stack is None
                else ex.Layout.join(
                    ref.stack, representative(ref.index, stacks[ref.stack], proxy_depths[ref.stack]), ref.rest
                )
            )
            value = lookup(full_name)
            if value is None:
                missing.append(name)
                continue
            if tuple(value.shape) != tuple(target.shape):
                raise NormswapError(
                    f"{full_name}: checkpoint shape {tuple(value.shape)} does not match the "
                    f"model's {tuple(target.shape)}"
                )
            target.copy_(value.to(target.dtype))
            del value
    return missing


def verify_truncated(
    cls: type,
    fp: FullPlan,
    meta: nn.Module,
    src_entries: dict[str, Entry],
    out_entries: dict[str, Entry],
    keys: KeyMap,
    out_keys: dict[str, str],
    dtype: torch.dtype,
    base: str,
    fmt: str = "native",
) -> dict[str, Any]:
    """Layers 0, 1 and L-1 (plus everything outside the stacks), original vs converted."""
    config = fp.proxy_config
    probe = None
    outputs = []
    for which in ("original", "converted"):
        if which == "original":
            model = build_proxy(cls, config, torch.float32)
            reader, names = Reader(src_entries), keys.to_ckpt
        else:
            cfg = copy.deepcopy(config)
            if fp.plan.unties:
                from normswap.surgery import mark_untied

                holder = nn.Module()
                holder.config = cfg
                mark_untied(holder)
            if fmt == "native":
                setattr(
                    cfg,
                    hf.MANIFEST_KEY,
                    {
                        "plan": fp.proxy_plan.to_dict(),
                        "base_model_type": base,
                        "architecture": cls.__name__,
                        "base_model_prefix": hf.prefix_of(meta),
                    },
                )
                target_cls = hf.model_class_for(base, cls.__name__)
            else:
                target_cls = cls
            previous = torch.random.get_rng_state()
            torch.manual_seed(0)
            try:
                model = target_cls(cfg).float().eval()
            finally:
                torch.random.set_rng_state(previous)
            reader, names = Reader(out_entries), out_keys
        missing = _load_truncated(
            model, fp.depths, fp.proxy_depths, lambda n, r=reader, k=names: r.get(k[n]) if n in k else None
        )
        reader.close()
        tied = (
            set(model.get_expanded_tied_weights_keys(all_submodels=True))
            if hasattr(model, "get_expanded_tied_weights_keys")
            else set()
        )
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        lacking = sorted(m for m in missing if m in params and m not in tied)
        if lacking:
            raise NormswapError(f"the {which} checkpoint lacks {lacking[0]}; verification impossible")
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        model.eval()
        if probe is None:
            probe = inputs.hf_example_inputs(model, batch=2, seq=8, seed=4242)
        with torch.no_grad():
            outputs.append(model(**probe))
        del model
        gc.collect()
    figures = compare(outputs[0], outputs[1], set(fp.plan.changed_outputs))
    result: dict[str, Any] = {
        f"truncated_{k}": v
        for k, v in figures.items()
        if k in ("max_abs_error", "max_rel_error", "kl", "top1_agreement")
    }
    result["truncated_layers"] = (
        ", ".join(
            f"{p}: {sorted({representative(t, n, fp.proxy_depths[p]) for t in range(fp.proxy_depths[p])})}"
            for p, n in fp.depths.items()
        )
        or "all"
    )
    exact = all(sp.verdict != "approximate" for sp in fp.plan.sites if sp.convert)
    limit = api.EXACT_TOLERANCE.get(dtype, 1e-3)
    if exact and figures.get("max_rel_error", 0.0) > limit:
        raise VerificationFailed(
            f"verification failed: the streamed checkpoint's layers "
            f"{result['truncated_layers']} differ from the original by "
            f"{figures['max_rel_error']:.3g} (relative, limit {limit:g}); nothing was written"
        )
    return result


# ------------------------------------------------------------------------------------ entry point
def convert_streaming(
    src: Source,
    out: Path,
    *,
    fmt: str,
    mode: str,
    fold_gamma: bool,
    untie: bool,
    dtype: str,
    max_shard_size: int | str,
    overwrite: bool,
    verify: bool,
    task: str | None,
    backend: str,
    progress: bool,
    echo: Callable[[str], None],
) -> api.Report:
    """Convert the checkpoint directory ``src`` into ``out`` without loading the model."""
    from transformers import AutoConfig

    assert src.path is not None
    if not src.safetensors:
        raise NormswapError(
            "low-memory conversion reads safetensors only; convert the pickle checkpoint to safetensors first"
        )
    try:
        config = AutoConfig.from_pretrained(src.path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001
        raise NormswapError(f"cannot read the config of {src.spec}: {exc}") from exc
    cls = source.source_class(src, config, task)
    base = config.model_type
    with torch.device("meta"):
        meta = cls(copy.deepcopy(config))
    want = source.torch_dtype(dtype)
    out_dtype = None if want == "auto" else want
    entries = scan(src.safetensors)
    keys = KeyMap(meta, entries)
    missing = [k for k, _ in meta.named_parameters() if k not in keys.to_ckpt]
    fp = plan_full(cls, config, meta, mode=mode, untie=untie, fold_gamma=fold_gamma, echo=echo)
    plan = fp.plan
    if not plan.sites:
        raise NothingToConvert(f"{src.label}: no LayerNorm found; nothing to do")
    if not any(sp.convert for sp in plan.sites):
        raise NothingToConvert(f"{src.label}: no LayerNorm can be converted in this mode; nothing to do")
    if fmt == "compat" and any(sp.convert and sp.verdict == "approximate" for sp in plan.sites):
        raise NormswapError("compat format keeps LayerNorms; convert with --mode exact")
    approximate = sum(1 for sp in plan.sites if sp.convert and sp.verdict == "approximate")
    if approximate:
        # The in-memory path fits approximate norms on calibration activations of the real model;
        # the streamed path only sees random-weight proxies, so it could only copy gamma/beta,
        # which is what wrecks deep Post-LN models. Refuse instead of writing a worse model.
        raise NormswapError(
            f"{src.label}: {approximate} approximate norm(s) need calibration on the whole model, which "
            "--low-memory cannot do; convert without --low-memory, or add --mode exact to stream only "
            "the exact norms"
        )
    tied_ok = set(getattr(meta, "get_expanded_tied_weights_keys", lambda **_: {})(all_submodels=True))
    missing = [k for k in missing if k not in tied_ok]
    # the same rule as the in-memory load (source.check_loading_info): tensors the model does not
    # use are an error unless --task chose a class without the checkpoint's head
    ignore = [re.compile(p) for p in (getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or [])]
    unexpected = [k for k in entries if k not in keys.to_model and not any(p.search(k) for p in ignore)]
    meta_sd = meta.state_dict()
    mismatched = [
        k for k, m in keys.to_model.items() if tuple(entries[k].shape) != tuple(meta_sd[m].shape)
    ]
    if mismatched:
        raise NormswapError(
            f"{src.spec}: tensor shape(s) do not match the config for {source.names(mismatched)}; "
            "the checkpoint does not match its config.json"
        )
    if unexpected and task is None:
        raise NormswapError(
            f"{src.spec}: the checkpoint has tensor(s) {cls.__name__} does not use: "
            f"{source.names(unexpected)}; pass --task to choose the model class on purpose"
        )
    if missing:
        raise NormswapError(
            f"{src.spec} as {cls.__name__}: the checkpoint has no tensor(s) {source.names(missing)}; "
            "the download is incomplete or the files do not belong together"
        )
    # untied heads are written twice: count them (the pre-check must see what will be written)
    itemsize = out_dtype.itemsize if out_dtype is not None else _itemsize(next(iter(entries.values())).dtype)
    untied = sum(u.numel for u in plan.unties) * itemsize
    needed = io.check_space(out, int(src.nbytes * (2 if out_dtype == torch.float32 else 1) * 1.1) + untied)
    if plan.unties:
        grown = sum(u.numel for u in plan.unties)
        echo(io.untie_note(len(plan.unties), grown, untied, src.nbytes + untied))
    echo(f"streaming {len(entries)} tensors from {len(src.safetensors)} shard(s) ({io.human(src.nbytes)})")
    reader = Reader(entries)
    tf = Transformer(plan, meta, keys, reader, fmt=fmt, dtype=out_dtype)
    limit = io.parse_size(max_shard_size)
    report = api.Report(plan.sites, {}, plan, "", changed=True)
    with io.atomic_directory(out, overwrite=overwrite, needed=needed) as tmp:
        weight_map, out_model_keys = write_weights(tf, tmp, limit, progress)
        out_entries = scan(sorted({tmp / f for f in weight_map.values()}))
        float_dtype = out_dtype or ST_TO_TORCH.get(next(iter(entries.values())).dtype, torch.float32)
        if verify:
            echo("verifying layers 0, 1 and L-1 of every stack on the real weights")
            report.verification.update(
                verify_truncated(
                    cls, fp, meta, entries, out_entries, keys, out_model_keys, float_dtype, base, fmt
                )
            )
        _write_config(
            meta,
            config,
            tmp,
            plan,
            fmt=fmt,
            out_dtype=float_dtype,
            source_spec=src.spec,
            verification=report.verification,
            extra=source.record(src),
        )
        io.copy_side_files(src.path, tmp)
    counts = plan.counts()
    n = sum(1 for sp in plan.sites if sp.convert)
    report.message = (
        f"converted {n} of {len(plan.sites)} LayerNorm(s) "
        f"({counts['exact'] + counts['exact-with-centering']} exact, "
        f"{sum(1 for sp in plan.sites if sp.convert and sp.verdict == 'approximate')} approximate) "
        f"by streaming; wrote {fmt} checkpoint to {out}"
    )
    return report


def _write_config(
    meta: nn.Module,
    config: Any,
    out: Path,
    plan: Plan,
    *,
    fmt: str,
    out_dtype: torch.dtype,
    source_spec: str,
    verification: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> None:
    """config.json (+ generation config, modeling file, model card) as the in-memory path writes them."""
    cfg = copy.deepcopy(config)
    holder = meta
    holder.config = cfg
    if plan.unties:
        from normswap.surgery import mark_untied

        mark_untied(holder)
    cfg.architectures = [type(meta).__name__]
    cfg.dtype = out_dtype
    cfg.save_pretrained(out)
    gen = getattr(meta, "generation_config", None)
    if gen is not None and callable(getattr(meta, "can_generate", None)) and meta.can_generate():
        gen.save_pretrained(out)
    manifest = writer.build_manifest(
        meta, plan, fmt=fmt, verification=verification, source=source_spec, extra=extra
    )
    if fmt == "native":
        writer.make_native_config(meta, out, manifest)
    else:
        cfg_path = out / "config.json"
        data = json.loads(cfg_path.read_text())
        centering = {sp.name for sp in plan.sites if sp.verdict in CENTERED_VERDICTS}
        manifest["rms_ready"] = [sp.name for sp in plan.sites if sp.convert and sp.name not in centering]
        manifest["needs_centering"] = [sp.name for sp in plan.sites if sp.convert and sp.name in centering]
        data[hf.MANIFEST_KEY] = manifest
        io.write_json(cfg_path, data)
    (out / "README.md").write_text(writer.model_card(manifest, out.name.split(io.TMP_MARK)[0].lstrip(".")))
