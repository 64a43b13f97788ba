"""Rewrite a checkpoint tensor by tensor: the converted model's tensors from the original's.

Each output tensor is computed on its own, in float64 with the same operation order as the
in-memory surgery (untie copy, centering, value β shares moved through attention, folds, MLP
widening for a mean carry) and cast once, so the result is bitwise identical to converting in
memory. A norm's γ/β are read up front (they are
small); a reader's bias fold reads its weight again from whichever shard holds it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from normswap.analysis.plan import BetaMove, MeanCarry, Plan, ScaleFold
from normswap.checkpoint import writer
from normswap.checkpoint.stream_io import ST_DTYPES, ST_TO_TORCH, Entry, Reader
from normswap.errors import NormswapError
from normswap.surgery.edits import (
    CARRY_TENSORS,
    carried,
    center_,
    layer_scale_balance,
    mark_untied,
    moved_shift,
    trade_constant,
    traded,
)


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
        self.buffers: set[str] = set()  # checkpoint keys of the model's non-persistent buffers (dropped)
        self._non_persistent: dict[str, torch.Tensor] | None = None
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
            elif self._names_a_buffer(key, renamings, converters, meta_sd):
                self.buffers.add(key)
        self.to_ckpt = {m: k for k, m in self.to_model.items()}

    def _names_a_buffer(self, key: str, renamings: list, converters: list, meta_sd: dict) -> bool:
        """Whether checkpoint tensor ``key`` is one of the model's non-persistent buffers (the ``position_ids``
        older BERT checkpoints store): transformers drops it on load, as the model computes it itself, and so
        does the streamed conversion (not written, not an unused tensor)."""
        from transformers.core_model_loading import rename_source_key

        if self._non_persistent is None:
            self._non_persistent = {n: b for n, b in self.meta.named_buffers() if n not in meta_sd}
        if not self._non_persistent:
            return False
        new, _ = rename_source_key(key, renamings, converters, self.meta.base_model_prefix, self._non_persistent)
        return new in self._non_persistent

    def out_key(self, key: str) -> str:
        """The name the converted checkpoint gives checkpoint tensor ``key``: the name the in-memory path saves
        the loaded model's parameter under. That is ``key`` itself unless the checkpoint and the model class
        disagree on the base-model prefix: ``--task base`` on a checkpoint with a head (``transformer.h.0...`` is
        saved as ``h.0...``), a base checkpoint loaded with a head class (the other way), or a load-time rename
        that the save reverts (DINOv3's ``layer.0...`` is ``model.layer.0...`` in memory, saved as ``layer.0...``):
        then transformers' save-time name of the parameter."""
        model_key = self.to_model.get(key)
        prefix = getattr(self.meta, "base_model_prefix", "") or ""
        if model_key is None or not prefix or key.startswith(f"{prefix}.") == model_key.startswith(f"{prefix}."):
            return key
        return self._saved_name(model_key)

    def _saved_name(self, model_key: str) -> str:
        """transformers' save-time name for a model parameter (its load-time renames reverted)."""
        from transformers.core_model_loading import revert_weight_conversion

        try:
            reverted = revert_weight_conversion(self.meta, {model_key: torch.empty(0, device="meta")})
            return next(iter(reverted))
        except Exception:  # noqa: BLE001
            return model_key

    def ckpt_key(self, model_key: str) -> str:
        """The checkpoint-style name for a model parameter (new keys: transformers' save-time names)."""
        if model_key in self.to_ckpt:
            return self.to_ckpt[model_key]
        return self._saved_name(model_key)


class TensorRewriter:
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
        # row means a centered table keeps, taken from a bias or class token (plan.ConstantTrade), as in memory
        self.trades: dict[str, list[tuple[int, bool]]] = {}
        for i, t in enumerate(plan.constant_trades):
            self.trades.setdefault(self.canonical(t.table), []).append((i, True))
            self.trades.setdefault(self.canonical(t.into), []).append((i, False))
        self._trade_constants: dict[int, torch.Tensor] = {}
        # LayerScale λ folded into its writer before centering (plan.ScaleFold), and with ``keep`` the
        # per-row scale taken back out into λ afterwards, as surgery.edits does in memory
        self.scales: dict[str, tuple[ScaleFold, str]] = {}
        for sf in plan.scale_folds:
            for what, key in (("weight", f"{sf.into}.weight"), ("bias", f"{sf.into}.bias"), ("lambda", sf.param)):
                self.scales[self.canonical(key)] = (sf, what)
        self._balance: dict[str, torch.Tensor] = {}
        # MLPs widened to carry a Post-LN mean (plan.MeanCarry): model key -> (carry, which tensor).
        # compat keeps the stock width (its norms are LayerNorms, which ignore the mean).
        self.widen = {} if fmt == "compat" else {
            f"{getattr(c, which.split('.')[0])}.{which.split('.')[1]}": (c, which)
            for c in plan.mean_carries for which in CARRY_TENSORS}
        # value β shares carried through attention (plan.BetaMove): output bias key -> moves, in plan order
        self.moves: dict[str, list[Any]] = {}
        for m in plan.beta_moves:
            self.moves.setdefault(self.canonical(f"{m.into}.bias"), []).append(m)
        # bias slots (plan.BiasSlot): a bias the checkpoint lacks, given to a bias-less reader to take W β (zeros
        # before the fold). Native writes it; compat has no such bias and moves the shift back into the norm
        # (writer.unslot_shift, on the values as written), taking it out of the norm's other readers again
        self.slots = {f"{b.reader}.bias": b for b in plan.bias_slots}
        self._unslot: dict[str, torch.Tensor] = {}
        self.unslot_minus: dict[str, Any] = {}  # compat: bias key -> the fold or move whose share comes back out
        if fmt == "compat":
            slot_readers = {b.reader for b in plan.bias_slots}
            for f in plan.folds:
                if f.site not in {b.site for b in plan.bias_slots} or f.reader in slot_readers \
                        or f.beta_route in ("", "dropped"):
                    continue
                if f.beta_route == "bias":
                    self.unslot_minus[self.canonical(f"{f.reader}.bias")] = f
                else:
                    m = next(m for m in plan.beta_moves if m.site == f.site and m.reader == f.reader)
                    self.unslot_minus[self.canonical(f"{m.into}.bias")] = m
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

    def scale_mean_carries(self) -> None:
        """Set each :class:`~normswap.analysis.plan.MeanCarry`'s ``scale`` in the plan from the checkpoint's own
        MLP weights.

        The plan came from random-weight proxies, so its carry scales are the proxies'; the rewrite widens
        the MLPs with the real ones, and ``normswap inspect --low-memory`` shows them. The real down weight as
        the surgery writes it (centered, before any fold, not widened) and the real up weight as the analysis
        reads it (before any edit) set it, as in memory. Call it once, before :meth:`layout`; compat records
        the scale too, unused (it keeps the stock width). Mutates the plan's carries, nothing else."""
        for c in self.plan.mean_carries:
            up = self.canonical(f"{c.up}.weight")
            c.scale = MeanCarry.scale_for(self.edited(f"{c.down}.weight", upto=0),
                                          self.read(self.untie.get(up, up)).double())

    def _ties(self) -> tuple[dict[str, str], dict[str, str]]:
        """Tied parameters (target -> source) with the original config, and after ``mark_untied``."""
        expand = getattr(self.meta, "get_expanded_tied_weights_keys", None)
        if not callable(expand):
            return {}, {}
        before = expand(all_submodels=True)
        if not self.plan.unties:
            return before, before
        mark_untied(self.meta)  # the meta model is ours; the converted config is untied too
        return before, expand(all_submodels=True)

    def canonical(self, model_key: str) -> str:
        return self.alias.get(model_key, model_key)

    def read(self, model_key: str) -> torch.Tensor:
        key = self.keys.to_ckpt.get(model_key) or self.keys.to_ckpt.get(self.canonical(model_key))
        if key is None and model_key in self.slots:  # a bias slot starts at zero (edits.add_bias_slot)
            return torch.zeros(self.slots[model_key].features, dtype=torch.float64)
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
        sf, what = self.scales.get(key, (None, ""))
        if sf is not None:
            if what == "lambda":
                return (self._row_scale(sf) if sf.keep else torch.ones_like(w)).reshape(w.shape) - sf.offset
            w = self._scaled(w, sf, what)
        if key in self.center:
            center_(w, *self.center[key])
        for i, table in self.trades.get(key, []):
            traded(w, self.plan.constant_trades[i], self._trade_constant(i), table=table)
        if sf is not None and sf.keep:
            s = self._row_scale(sf)
            w = w / s[None, :] if what == "weight" and sf.kind == "conv1d" else \
                (w / s[:, None] if what == "weight" else w / s)
        for m in self.moves.get(key, []):  # after centering, before every fold, as the in-memory surgery
            w = w + moved_shift(self.edited(f"{m.reader}.weight", 0), self.edited(f"{m.into}.weight", 0),
                                self._beta(m.site), m)
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

    def source_entry(self, model_key: str) -> Entry:
        """The checkpoint tensor a model parameter is read from (through ties and unties)."""
        key = self.canonical(model_key)
        key = self.untie.get(key, key)
        ckpt = self.keys.to_ckpt.get(key) or self.keys.to_ckpt[self.canonical(key)]
        return self.reader.entries[ckpt]

    def output(self, model_key: str, dtype: torch.dtype) -> torch.Tensor:
        """The written value of an edited tensor: :meth:`edited` cast once; in compat, a bias that took a share
        of a slotted norm's β has it taken back out, as ``writer._unslot`` does on the cast model."""
        value = self.cast(self.edited(model_key), dtype)
        item = self.unslot_minus.get(self.canonical(model_key))
        if item is None:
            return value
        c = self.unslot_shift(item.site)
        w = self.cast(self.edited(f"{item.reader}.weight"), dtype).double()
        if isinstance(item, BetaMove):
            share = moved_shift(w, self.cast(self.edited(f"{item.into}.weight"), dtype).double(), c, item)
        else:
            share = c @ w if item.kind == "conv1d" else w @ c
        return (value.double() - share).to(dtype)

    def unslot_shift(self, site: str) -> torch.Tensor:
        """Compat: the shift the norm ``site`` takes back from its bias slots (cached; float64)."""
        if site not in self._unslot:
            slots = [b for b in self.plan.bias_slots if b.site == site]
            dtype = self.dtype or ST_TO_TORCH.get(self.source_entry(f"{slots[0].reader}.weight").dtype,
                                                  torch.float32)
            self._unslot[site] = writer.unslot_shift(
                site, slots[0].reader, [self.cast(self.edited(f"{b.reader}.weight"), dtype) for b in slots],
                [self.cast(self.edited(f"{b.reader}.bias"), dtype) for b in slots])
        return self._unslot[site]

    def _trade_constant(self, i: int) -> torch.Tensor:
        """Trade ``i``'s constant from its table as the checkpoint holds it (cached)."""
        if i not in self._trade_constants:
            t = self.plan.constant_trades[i]
            key = self.canonical(t.table)
            self._trade_constants[i] = trade_constant(self.read(self.untie.get(key, key)).double(), t)
        return self._trade_constants[i]

    def _scaled(self, w: torch.Tensor, sf: ScaleFold, what: str) -> torch.Tensor:
        """``w`` (the writer's weight or bias) times its LayerScale λ, before centering (``fold_layer_scale``)."""
        lam = self.read(sf.param).double().reshape(-1) + sf.offset
        if what == "bias":
            return w * lam
        return w * lam[None, :] if sf.kind == "conv1d" else w * lam[:, None]

    def _row_scale(self, sf: ScaleFold) -> torch.Tensor:
        """The per-row scale ``balance_layer_scale`` takes out of a folded, centered writer into λ (cached)."""
        if sf.param not in self._balance:
            key = self.canonical(f"{sf.into}.weight")
            raw = self.read(self.untie.get(key, key)).double()
            w = self._scaled(raw.clone(), sf, "weight")
            if key in self.center:
                center_(w, *self.center[key])
            peak = w.abs().amax(dim=0) if sf.kind == "conv1d" else w.abs().amax(dim=1)
            target = float(raw.abs().max())
            self._balance[sf.param] = layer_scale_balance(peak, target)
        return self._balance[sf.param]

    def _beta(self, site: str) -> torch.Tensor:
        """A norm's β in float64 (read up front for converted norms)."""
        if site in self.norms:
            return self.norms[site][1]
        _, b_attr = writer.norm_param_names(self.meta.get_submodule(site), self.plan.site(site).flavour)
        return self.read(f"{site}.{b_attr}").double()

    def is_edited(self, model_key: str) -> bool:
        key = self.canonical(model_key)
        return key in self.center or key in self.untie or bool(self.folds.get(key)) or key in self.widen \
            or key in self.moves or key in self.scales or key in self.unslot_minus

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
            if mkey is None:  # a tensor the model does not hold (a head --task left out): not saved in memory
                continue
            if mkey in self.norm_keys:
                site, g_attr, b_attr = self.norm_keys[mkey]
                if site not in done_sites:
                    done_sites.add(site)
                    out += self._norm_entries(site, key, e, g_attr, b_attr)
                continue
            dtype = self.out_dtype(e.dtype)
            name = self.keys.out_key(key)
            if self.is_edited(mkey):
                out.append(
                    (name, dtype, self.shape(mkey, e.shape),
                     lambda m=mkey, d=dtype: self.output(m, ST_TO_TORCH[d]), mkey)
                )
            else:
                out.append(
                    (name, dtype, e.shape, lambda k=key, d=dtype: self.reader.get(k).to(ST_TO_TORCH[d]), mkey)
                )
        present = set(self.keys.to_model.values())
        for target, slot in self.slots.items() if self.fmt == "native" else ():
            if target in present:
                continue
            dtype = self.out_dtype(self.source_entry(f"{slot.reader}.weight").dtype)
            out.append((self.keys.ckpt_key(target), dtype, (slot.features,),
                        lambda m=target, d=dtype: self.output(m, ST_TO_TORCH[d]), target))
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
        base = self.keys.out_key(self.keys.to_ckpt.get(f"{site}.{g_attr or b_attr}", key)).rpartition(".")[0]
        rms_gamma = None
        if sp.rms_weight:
            rms_gamma = gamma if not sp.fold_gamma else torch.ones_like(gamma)
        rms_beta = None
        if sp.rms_bias:  # γ folded into the readers while β could not fold: the norm keeps β/γ, as the surgery does
            rms_beta = beta / gamma if sp.fold_gamma and gamma is not None else beta
        entries = []

        def add(ckpt_key: str, value: torch.Tensor, name: str) -> None:
            """One output tensor of this norm: ``value`` (float64) cast to the output dtype when written."""
            entries.append((ckpt_key, dtype, shape, lambda: self.cast(value, torch_dtype), name))

        if self.fmt == "native":
            if rms_gamma is not None:
                add(f"{base}.weight", rms_gamma, f"{site}.weight")
            if rms_beta is not None:
                add(f"{base}.bias", rms_beta, f"{site}.bias")
        else:  # compat: the original attributes hold the RMSNorm's values
            offset = 1.0 if sp.flavour == "offset" else 0.0
            if g_attr:
                value = (
                    rms_gamma if rms_gamma is not None else torch.ones(shape, dtype=torch.float64)
                ) - offset
                add(self.keys.out_key(self.keys.to_ckpt[f"{site}.{g_attr}"]), value, f"{site}.{g_attr}")
            if b_attr:
                value = rms_beta if rms_beta is not None else torch.zeros(shape, dtype=torch.float64)
                ckpt_key = self.keys.out_key(self.keys.to_ckpt[f"{site}.{b_attr}"])
                if any(b.site == site for b in self.plan.bias_slots):  # as writer.compat_model: + c, in the dtype
                    entries.append((ckpt_key, dtype, shape, lambda v=value, s=site: self.cast(v, torch_dtype)
                                    + self.unslot_shift(s).reshape(shape).to(torch_dtype), f"{site}.{b_attr}"))
                else:
                    add(ckpt_key, value, f"{site}.{b_attr}")
        return entries
