"""A manifest saved from one head class, applied to another class of the same base model.

A native checkpoint's manifest names modules by their paths in the class that was converted
(``bert.encoder.layer.0.output.LayerNorm`` for ``BertForMaskedLM``). The same checkpoint may be
loaded as the base model (``BertModel``: ``encoder.layer.0...``) or under any other head class
(``BertForSequenceClassification``: ``bert.encoder...``), and transformers moves the *weights*
between those key spaces by one rule: the class's key renamings, then ``base_model_prefix``
stripped when the stripped key exists in the new class, else added when the prefixed key exists.
:class:`PathMap` applies that same function (transformers' own) to module and parameter paths, so
the structure follows the weights.

:func:`rebase_plan` moves every path of a manifest's plan that way. An edit that lives only in a
head the new class does not have is dropped, as transformers drops that head's weights. Where the
conversion moved part of a kept norm into such a head (γ folded by ``fold_gamma``, β folded into
the head's bias), the norm's output in the new class lacks it: :func:`rebase_plan` returns a note
saying so, which loading turns into a warning.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

from torch import nn

_QUOTED = re.compile(r"`([^`]+)`")


class PathMap:
    """Module and parameter paths of a checkpoint's class -> paths of ``model``'s class (or ``None``).

    A manifest path is what the checkpoint's keys are made of, so it moves the way transformers moves a
    checkpoint key into ``model`` (``core_model_loading.rename_source_key``): the class's key renamings
    (CLIP's text and vision models drop a ``text_model.`` / ``vision_model.`` prefix), then its
    ``base_model_prefix`` stripped if the stripped path exists, else added if that exists. It needs neither
    the saved class nor its prefix, so it works in both directions (head class -> base model, base
    model -> head class, one head class -> another).
    """

    def __init__(self, model: nn.Module) -> None:
        self.prefix = getattr(model, "base_model_prefix", "") or ""
        names = {name for name, _ in model.named_modules(remove_duplicate=False)}
        names |= {name for name, _ in model.named_parameters(remove_duplicate=False)}
        names |= {name for name, _ in model.named_buffers(remove_duplicate=False)}
        self.names = names
        self._exists = dict.fromkeys(names, True)  # what rename_source_key asks of a meta state dict
        self._renamings = _load_renamings(model)

    def __call__(self, path: str) -> str | None:
        p = self.prefix
        if p and path == p and p not in self.names:
            return ""  # the base model itself, loaded as the base class
        from transformers.core_model_loading import rename_source_key

        new, _ = rename_source_key(path, self._renamings, [], p, self._exists)
        return new if new in self.names else None

    def text(self, text: str) -> str:
        """``text`` with every back-quoted path that maps replaced by its new path (reasons, details)."""
        return _QUOTED.sub(lambda m: f"`{self(m.group(1)) or m.group(1)}`", text)

    def entry(self, item: str) -> str | None:
        """One entry of a writers/readers list: a path (``None`` when absent) or a description."""
        if " " in item or "`" in item:
            return self.text(item)
        return self(item)


def _load_renamings(model: nn.Module) -> list:
    """The key renamings transformers applies when it loads a checkpoint into ``model`` (not its weight
    converters: those fuse or split tensors, and no manifest path names a fused tensor)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    try:
        return [m for m in get_model_conversion_mapping(model) if isinstance(m, WeightRenaming)]
    except Exception:  # noqa: BLE001 - a model transformers cannot map keys for: the prefix rule alone
        return []


def _records(
    items: list[dict], pmap: PathMap, required: tuple[str, ...], optional: tuple[str, ...] = (),
    texts: tuple[str, ...] = (),
) -> list[dict]:
    """Records whose ``required`` paths all map, with those and the ``optional`` ones (kept as they
    were where they do not map) moved, and their ``texts`` rewritten."""
    out = []
    for item in items:
        moved = {key: pmap(item[key]) for key in required if key in item}
        if any(value is None for value in moved.values()):
            continue
        new = dict(item, **moved)
        for key in optional:
            if isinstance(new.get(key), str):
                new[key] = pmap(new[key]) or new[key]
        for key in texts:
            if isinstance(new.get(key), str):
                new[key] = pmap.text(new[key])
        out.append(new)
    return out


def _paths(items: list[str], move: Callable[[str], str | None]) -> list[str]:
    return [m for m in (move(i) for i in items) if m is not None]


def _site(site: dict, pmap: PathMap) -> dict:
    out = dict(site, name=pmap(site["name"]))
    for key in ("writers", "readers"):
        out[key] = _paths(site.get(key) or [], pmap.entry)
    for key in ("reason", "beta_detail", "rotation_reason"):
        if isinstance(out.get(key), str):
            out[key] = pmap.text(out[key])
    return out


def _rms_fold(fold: dict, pmap: PathMap) -> dict | None:
    norm, weight = pmap(fold["norm"]), pmap(fold["weight"])
    if norm is None or weight is None:
        return None
    pairs = [(pmap(r), k) for r, k in zip(fold.get("readers") or [], fold.get("kinds") or [], strict=True)]
    pairs = [(r, k) for r, k in pairs if r is not None]
    return dict(fold, norm=norm, weight=weight, readers=[r for r, _ in pairs], kinds=[k for _, k in pairs])


def _rotation(rotation: dict, pmap: PathMap) -> dict | None:
    norms = _paths(rotation.get("norms") or [], pmap)
    if not norms:
        return None
    out = dict(rotation, norms=norms)
    for key in ("restore", "online"):
        if key in out:
            out[key] = _paths(out[key] or [], pmap)
    if "ops" in out:
        out["ops"] = _records(out["ops"] or [], pmap, ("module",))
    return out


def lost_folds(plan: dict, pmap: PathMap) -> list[str]:
    """What a kept norm's output lacks in ``pmap``'s class: its γ/β folded into readers that class does not
    have (a head), one line per norm."""
    lost: dict[str, set[str]] = {}
    readers: dict[str, set[str]] = {}

    def note(site: str, reader: str, what: str) -> None:
        lost.setdefault(site, set()).add(what)
        readers.setdefault(site, set()).add(reader)

    for f in plan.get("folds") or []:
        if (f.get("beta") or f.get("gamma")) and pmap(f["site"]) is not None and pmap(f["reader"]) is None:
            for what, on in (("γ", f.get("gamma")), ("β", f.get("beta"))):
                if on:
                    note(f["site"], f["reader"], what)
    for rf in plan.get("rms_folds") or []:
        if pmap(rf["norm"]) is None:
            continue
        for r in rf.get("readers") or []:
            if pmap(r) is None:
                note(rf["norm"], r, "γ")
    for m in plan.get("beta_moves") or []:
        if pmap(m["site"]) is not None and pmap(m["into"]) is None:
            note(m["site"], m["into"], "β")
    return [
        f"`{pmap(site)}` lacks its {'/'.join(sorted(lost[site], reverse=True))} (folded into "
        f"{', '.join(f'`{r}`' for r in sorted(readers[site]))}, which this class does not have)"
        for site in sorted(lost)
    ]


def rebase_plan(plan: dict, model: nn.Module) -> tuple[dict, list[str]]:
    """The manifest ``plan`` (``Plan.to_dict()`` form) with every path moved to ``model``'s class.

    Returns the moved plan and the notes of :func:`lost_folds`. Records in a head the class lacks are
    dropped; paths inside descriptions (reasons, β details) are rewritten where they map.
    """
    pmap = PathMap(model)
    out = copy.deepcopy(plan)
    out["sites"] = [_site(s, pmap) for s in out.get("sites", []) if pmap(s["name"]) is not None]
    out["skipped"] = _records(out.get("skipped", []), pmap, ("name",), texts=("reason",))
    out["writer_edits"] = _records(out.get("writer_edits", []), pmap, ("target",), ("owner",))
    out["folds"] = _records(out.get("folds", []), pmap, ("site", "reader"))
    out["bias_slots"] = _records(out.get("bias_slots", []), pmap, ("reader",), ("site",))
    out["beta_moves"] = _records(out.get("beta_moves", []), pmap, ("site", "reader", "into"))
    out["scale_folds"] = _records(out.get("scale_folds", []), pmap, ("param", "into"))
    out["rms_folds"] = [f for f in (_rms_fold(f, pmap) for f in out.get("rms_folds", [])) if f is not None]
    out["hooks"] = _records(out.get("hooks", []), pmap, ("module",), texts=("reason",))
    out["mean_carries"] = _records(out.get("mean_carries", []), pmap, ("up", "down"), ("site", "source"))
    out["centered_readers"] = _records(out.get("centered_readers", []), pmap, ("site", "reader"))
    out["constant_trades"] = _records(out.get("constant_trades", []), pmap, ("table", "into"), texts=("reason",))
    out["unties"] = _records(out.get("unties", []), pmap, ("module", "source"))
    out["rotations"] = [r for r in (_rotation(r, pmap) for r in out.get("rotations", [])) if r is not None]
    if out.get("adapter_bases"):  # keyed by Linear; the vectors' names are the side file's, left as they are
        out["adapter_bases"] = {pmap(k): v for k, v in out["adapter_bases"].items() if pmap(k) is not None}
    return out, lost_folds(plan, pmap)


def dropped(before: dict, after: dict) -> dict[str, int]:
    """How many records of each kind :func:`rebase_plan` dropped (for the log)."""
    out: dict[str, int] = {}
    for key, value in before.items():
        if isinstance(value, list) and isinstance(after.get(key), list) and len(after[key]) < len(value):
            out[key] = len(value) - len(after[key])
    return out


def tied_to_centered(model: nn.Module, plan: Any) -> list[tuple[str, str]]:
    """``(output head weight, input embedding)`` pairs where ``model`` ties its output head to an input
    embedding that the conversion centered: the checkpoint was converted without that head, so no
    untie kept the head's own copy, and the head's logits differ from the stock model's."""
    expand = getattr(model, "get_expanded_tied_weights_keys", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not callable(expand) or head is None or getattr(head, "weight", None) is None:
        return []
    try:
        tied = expand(all_submodels=True)
    except Exception:  # noqa: BLE001 - a model that cannot list its ties has none we can judge
        return []
    head_path = next((n for n, m in model.named_modules() if m is head), None)
    head_name = f"{head_path}.weight" if head_path else None
    centered = {e.target for e in plan.writer_edits}
    untied = {f"{u.module}.{u.attr}" for u in plan.unties}
    return [
        (target, source)
        for target, source in tied.items()
        if target == head_name and source in centered and target not in untied
    ]
