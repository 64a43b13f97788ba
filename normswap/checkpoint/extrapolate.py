"""Extrapolate a plan made on a depth-reduced copy of a model to the model's real depth.

The low-memory path cannot run the analysis on the full model (it does not fit), and the analysis
needs a real forward pass. It therefore analyses *proxies*: the same architecture and width, built
from the config with fewer layers (3 and 4 per layer stack) and random weights. Every plan item
lives either outside the layer stacks ("global": embeddings, final norm, head) or in layer ``t``
of a stack. A full-depth layer ``j`` takes the items of template layer ``t(j)``: the first layer
maps to the first, the last to the last, every middle layer to the middle one.

Items also *refer* to other modules (a norm's writers are every earlier layer's output
projections; Whisper's final encoder norm is read by every decoder layer). References are
grouped by role (stack + path inside the layer) and each group is matched against a small set of
relations to the owner's index (same, before, up-to, all, after, previous, first, last, ...)
that must hold for every template instance; that relation is then evaluated at full depth.

Soundness is checked, not assumed: :func:`check` extrapolates the depth-3 plan to depth 4 and
compares it with the plan actually computed at depth 4. Any difference (an architecture whose
layers are not uniform in a way these rules capture) makes the low-memory path refuse.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from normswap.analysis.plan import beta_text
from normswap.errors import NormswapError

PROXY_DEPTH = 3
CHECK_DEPTH = 4


class ExtrapolationError(NormswapError):
    """The depth-reduced plan cannot be carried to full depth for this architecture."""


@dataclass(frozen=True)
class Ref:
    stack: str | None  # layer stack path (a ModuleList) or None for global paths
    index: int | None
    rest: str  # path inside the layer ('' for the layer itself) or the whole global path

    @property
    def role(self) -> tuple[str | None, str]:
        return self.stack, self.rest


class Layout:
    """Layer stacks of a model and their depths."""

    def __init__(self, depths: dict[str, int]) -> None:
        self.depths = dict(depths)
        self._stacks = sorted(depths, key=len, reverse=True)

    def split(self, path: str) -> Ref:
        for stack in self._stacks:
            if path.startswith(stack + "."):
                head, _, rest = path[len(stack) + 1 :].partition(".")
                if head.isdigit():
                    return Ref(stack, int(head), rest)
        return Ref(None, None, path)

    @staticmethod
    def join(stack: str | None, index: int | None, rest: str) -> str:
        if stack is None:
            return rest
        return f"{stack}.{index}" + (f".{rest}" if rest else "")


def template(j: int, full: int, proxy: int) -> int:
    """Template layer (in a stack of depth ``proxy``) for layer ``j`` of a stack of depth ``full``."""
    if full <= proxy:
        return j
    if j == 0:
        return 0
    if j == full - 1:
        return proxy - 1
    return 1


# relations between an owner at index t (stack depth n) and the indices it refers to
_SAME_STACK: dict[str, Callable[[int, int], set[int]]] = {
    "same": lambda t, n: {t},
    "before": lambda t, n: set(range(t)),
    "upto": lambda t, n: set(range(t + 1)),
    "all": lambda t, n: set(range(n)),
    "after": lambda t, n: set(range(t + 1, n)),
    "from": lambda t, n: set(range(t, n)),
    "prev": lambda t, n: {t - 1} if t > 0 else set(),
    "next": lambda t, n: {t + 1} if t + 1 < n else set(),
    "first": lambda t, n: {0},
    "last": lambda t, n: {n - 1},
}
_OTHER: dict[str, Callable[[int, int], set[int]]] = {
    "all": lambda t, n: set(range(n)),
    "first": lambda t, n: {0},
    "last": lambda t, n: {n - 1},
}


def _infer(
    instances: dict[int | None, set[int | None]], same_stack: bool, depth: int, where: str
) -> Callable[[int | None, int | None, int], set[int | None]]:
    """A relation ``f(j, t, n)`` that reproduces ``instances`` ({owner template index: referenced
    indices}) at every template; evaluated at full depth with owner index ``j`` (template ``t``) and
    the referenced stack's full depth ``n``.

    Within one stack the relation is relative to the owner's index and must be the same for every
    template. Across stacks (or from a global owner) each template may have its own kind (none,
    all, first, last): the last encoder layer's norm is read by every decoder layer, others by none.
    """
    if all(ix == {None} or not ix for ix in instances.values()):  # a global reference
        present = {t: bool(ix) for t, ix in instances.items()}
        return lambda j, t, n, _p=present: {None} if _p.get(t, False) else set()
    if same_stack:
        for rel in _SAME_STACK.values():
            if all(ix == rel(t if t is not None else 0, depth) for t, ix in instances.items()):
                return lambda j, t, n, _r=rel: _r(j if j is not None else 0, n)
    else:
        kinds: dict[int | None, Callable[[int, int], set[int]] | None] = {}
        for t, ix in instances.items():
            if not ix:
                kinds[t] = None
                continue
            kinds[t] = next((rel for rel in _OTHER.values() if ix == rel(0, depth)), None)
            if kinds[t] is None:
                break
        else:
            return lambda j, t, n, _k=kinds: _k[t](0, n) if _k.get(t) is not None else set()
    raise ExtrapolationError(
        f"low-memory analysis: cannot extrapolate the references of `{where}` "
        f"({instances}) to full depth; convert in memory (--in-memory)"
    )


class Extrapolator:
    """Carries plan items from proxy depths to full depths."""

    def __init__(self, proxy: dict[str, int], full: dict[str, int]) -> None:
        self.proxy = Layout(proxy)
        self.full = Layout(full)

    def instances(self, ref: Ref) -> list[tuple[int | None, int | None]]:
        """(full index, template index) pairs of an owner at ``ref`` (one pair for globals)."""
        if ref.stack is None:
            return [(None, None)]
        n, d = self.full.depths[ref.stack], self.proxy.depths[ref.stack]
        return [(j, template(j, n, d)) for j in range(n) if template(j, n, d) == ref.index]

    def owners(self, paths: list[str]) -> dict[tuple, dict[int | None, str]]:
        """Group owner paths by role: {role: {template index: path}}."""
        roles: dict[tuple, dict[int | None, str]] = {}
        for p in paths:
            ref = self.proxy.split(p)
            roles.setdefault(ref.role, {})[ref.index] = p
        return roles

    def _full_indices(self, stack0: str | None, present: Any) -> list[int | None]:
        if stack0 is None:
            return [None]
        n, d = self.full.depths[stack0], self.proxy.depths[stack0]
        return [j for j in range(n) if template(j, n, d) in present]

    def _t(self, stack0: str | None, j: int | None) -> int | None:
        return (
            None
            if stack0 is None or j is None
            else template(j, self.full.depths[stack0], self.proxy.depths[stack0])
        )

    def expand_refs(
        self, owner_role: tuple, by_t: dict[int | None, list[str]], where: str
    ) -> dict[int | None, list[str]]:
        """Reference lists of one owner role, at every full index: {full j: [paths or labels]}."""
        stack0 = owner_role[0]
        groups: dict[tuple, dict[int | None, set[int | None]]] = {}
        labels: dict[str, dict[int | None, str]] = {}  # skeleton -> {t: label}
        for t, refs in by_t.items():
            for p in refs:
                if _is_label(p):
                    labels.setdefault(_skeleton(p), {})[t] = p
                else:
                    groups.setdefault(self.proxy.split(p).role, {})
        for t, refs in by_t.items():
            for role in groups:
                groups[role].setdefault(t, set())
            for p in refs:
                if not _is_label(p):
                    r = self.proxy.split(p)
                    groups[r.role][t].add(r.index)
        relations = {}
        for role, inst in groups.items():
            stack = role[0]
            depth = self.proxy.depths.get(stack, 0) if stack else 0
            relations[role] = _infer(inst, stack is not None and stack == stack0, depth, where)
        label_texts = {skel: self.expand_text(owner_role, texts, where) for skel, texts in labels.items()}
        out: dict[int | None, list[str]] = {}
        for j in self._full_indices(stack0, by_t):
            t = self._t(stack0, j)
            paths = []
            for role, rel in relations.items():
                stack = role[0]
                n = self.full.depths.get(stack, 0) if stack else 0
                hits = rel(j, t, n)
                for i in sorted(x for x in hits if x is not None) if stack else ([None] if hits else []):
                    paths.append(self.full.join(stack, i, role[1]))
            for skel, texts in label_texts.items():
                if t in labels[skel]:
                    paths.append(texts[j])
            out[j] = paths
        return out

    def expand_text(
        self, owner_role: tuple, by_t: dict[int | None, str], where: str
    ) -> dict[int | None, str]:
        """Human-readable text of one owner role (reasons, labels) at every full index.

        Module paths inside the text are re-indexed with the relation that holds across the
        template instances (e.g. "the previous layer's norm", "layer 0"); when none does, the
        template's text is used with the owner's own index substituted.
        """
        stack0 = owner_role[0]
        parsed = {t: self._tokens(text) for t, text in by_t.items()}
        by_skeleton: dict[tuple, list[int | None]] = {}
        for t, (parts, refs) in parsed.items():
            by_skeleton.setdefault((tuple(parts), tuple(r.role for r in refs)), []).append(t)
        rels: dict[int | None, list[Any] | None] = {}
        for (_, roles), ts in by_skeleton.items():
            try:
                found = []
                for k, role in enumerate(roles):
                    inst = {t: {parsed[t][1][k].index} for t in ts}
                    found.append(_infer(inst, role[0] == stack0, self.proxy.depths[role[0]], where))
            except ExtrapolationError:
                found = None
            for t in ts:
                rels[t] = found
        out: dict[int | None, str] = {}
        for j in self._full_indices(stack0, by_t):
            t = self._t(stack0, j)
            parts, refs = parsed[t]
            relations = rels[t]
            new_refs = []
            for k, ref in enumerate(refs):
                hits = relations[k](j, t, self.full.depths[ref.stack]) if relations is not None else set()
                if len(hits) == 1:
                    new_refs.append(self.full.join(ref.stack, next(iter(hits)), ref.rest))
                else:
                    same = ref.index == t and ref.stack == stack0
                    new_refs.append(self.full.join(ref.stack, j if same else ref.index, ref.rest))
            text = parts[0]
            for ref_text, part in zip(new_refs, parts[1:], strict=True):
                text += ref_text + part
            out[j] = text
        return out

    def _tokens(self, text: str) -> tuple[list[str], list[Ref]]:
        """Split text into literal parts and the layer-stack paths between them."""
        parts, refs, last = [], [], 0
        for m in _PATH.finditer(text):
            ref = self.proxy.split(m.group())
            if ref.stack is None:
                continue
            parts.append(text[last : m.start()])
            refs.append(ref)
            last = m.end()
        parts.append(text[last:])
        return parts, refs

    def move(self, path: str, j: int | None, t: int | None) -> str:
        """Re-index a path of an owner from template ``t`` to full index ``j`` (same-layer paths)."""
        ref = self.proxy.split(path)
        if ref.stack is None or j is None:
            return path
        return self.full.join(ref.stack, j, ref.rest)


_PATH = re.compile(r"[A-Za-z_]\w*(?:\.\w+)+")


def _is_label(ref: str) -> bool:
    """Writers/readers are module paths or, for things that are not modules, short labels."""
    return "`" in ref or " " in ref


def _skeleton(text: str) -> str:
    return re.sub(r"\.\d+(?=\.|`|$)", ".#", text)


_COUNT = re.compile(r"^stream written by \d+ centered writer\(s\)$")


def extrapolate(plan: dict[str, Any], proxy: dict[str, int], full: dict[str, int]) -> dict[str, Any]:
    """The plan of the full-depth model from the plan of its proxy (``Plan.to_dict`` form)."""
    if proxy == full:
        return copy.deepcopy(plan)
    ex = Extrapolator(proxy, full)
    out: dict[str, Any] = {
        k: copy.deepcopy(v)
        for k, v in plan.items()
        if k not in ("sites", "writer_edits", "folds", "hooks", "unties", "skipped", "mean_carries", "beta_moves",
                     "scale_folds", "bias_slots")
    }

    # --- sites (with their writer and reader lists)
    sites = {s["name"]: s for s in plan["sites"]}
    new_sites = []
    for role, by_t in ex.owners(list(sites)).items():
        writers = ex.expand_refs(role, {t: sites[p]["writers"] for t, p in by_t.items()}, f"{role} writers")
        readers = ex.expand_refs(role, {t: sites[p]["readers"] for t, p in by_t.items()}, f"{role} readers")
        reasons = ex.expand_text(role, {t: sites[p]["reason"] for t, p in by_t.items()}, f"{role} reason")
        rotation = ex.expand_text(role, {t: sites[p].get("rotation_reason", "") for t, p in by_t.items()},
                                  f"{role} rotation reason")
        kept = ex.expand_text(role, {t: sites[p].get("beta_detail", "") for t, p in by_t.items()},
                              f"{role} β detail")  # rebuilt from the folds below where β left the norm
        for j in writers:
            t = template(j, full[role[0]], proxy[role[0]]) if role[0] else None
            src = sites[by_t[t]]
            s = copy.deepcopy(src)
            s["name"] = ex.move(src["name"], j, t)
            s["writers"] = sorted(set(writers[j]))
            s["readers"] = _reorder_readers(ex, src["readers"], readers[j])
            s["reason"] = (
                f"stream written by {len(s['writers'])} centered writer(s)"
                if _COUNT.match(src["reason"])
                else reasons[j]
            )
            s["error"] = None
            if "rotation_reason" in s:
                s["rotation_reason"] = rotation[j]
            if "beta_detail" in s:
                s["beta_detail"] = kept[j]
            new_sites.append((ex.full.split(s["name"]), s))
    site_names = [s["name"] for s in plan["sites"]]
    out["sites"] = [s for _, s in sorted(new_sites, key=lambda rs: _order_key(rs[0], site_names, ex))]

    # --- folds: per site, a list of readers with their own flags
    folds_by_site: dict[str, list[dict]] = {}
    for f in plan["folds"]:
        folds_by_site.setdefault(f["site"], []).append(f)
    new_folds = []
    for role, by_t in ex.owners(list(folds_by_site)).items():
        lists = ex.expand_refs(
            role, {t: [f["reader"] for f in folds_by_site[p]] for t, p in by_t.items()}, f"{role} folds"
        )
        for j, readers in lists.items():
            t = template(j, full[role[0]], proxy[role[0]]) if role[0] else None
            site_path = by_t[t]
            flags = {ex.proxy.split(f["reader"]).role: f for f in folds_by_site[site_path]}
            for r in readers:
                f = dict(flags[ex.full.split(r).role])
                f["site"], f["reader"] = ex.move(site_path, j, t), r
                new_folds.append(f)
    site_pos = {s["name"]: i for i, s in enumerate(out["sites"])}
    out["folds"] = sorted(new_folds, key=lambda f: (site_pos.get(f["site"], -1), f["reader"]))

    # --- items owned by one path, with at most one reference
    out["writer_edits"] = sorted(
        _simple(ex, plan["writer_edits"], "target", ("owner",)), key=lambda e: e["target"]
    )
    # as the in-memory analysis lists them: the ops where streams start, then the writers' ops (writer-centering
    # op), each in module order, a layer's ops together (not grouped by template)
    hook_names = [h["module"] for h in plan["hooks"]]
    out["hooks"] = sorted(_simple(ex, plan["hooks"], "module", (), text_fields=("reason",)),
                          key=lambda h: (bool(h.get("writer")), _order_key(ex.full.split(h["module"]), hook_names, ex)))
    out["unties"] = _simple(ex, plan["unties"], "module", (), ref_field="source")
    out["skipped"] = _simple(ex, plan["skipped"], "name", (), text_fields=("reason",))
    out["mean_carries"] = _simple(ex, plan.get("mean_carries", []), "up", ("down", "site"), ref_field="source",
                                  text_fields=("activation",))
    out["beta_moves"] = _simple(ex, plan.get("beta_moves", []), "into", ("reader",), ref_field="site")
    # bias-less readers given a bias for β (an LM head; one per layer where a layer's reader has one), listed as
    # the in-memory analysis lists them, with the folds: by site, then reader (round 58: several per layer, as
    # GPT-J's q/k/v, came out grouped by template, h.0.k_proj, h.1.k_proj, ...)
    out["bias_slots"] = sorted(_simple(ex, plan.get("bias_slots", []), "reader", (), ref_field="site"),
                               key=lambda b: (site_pos.get(b["site"], -1), b["reader"]))
    # LayerScale folds, one per layer's λ (the low-memory rewrite folds and rebalances every one of them)
    out["scale_folds"] = sorted(_simple(ex, plan.get("scale_folds", []), "param", ("into",)), key=lambda f: f["param"])
    moved_into = {m["reader"]: m["into"] for m in out["beta_moves"]}
    for s in out["sites"]:
        if s.get("fold_beta"):  # β left the norm: where it went is a function of the extrapolated folds
            routes = [(f["reader"], f.get("beta_route", "")) for f in out["folds"] if f["site"] == s["name"]]
            s["beta_detail"] = beta_text(routes, moved_into)
    return out


def _reorder_readers(ex: Extrapolator, template_list: list[str], expanded: list[str]) -> list[str]:
    """Readers are ``sorted(foldable) + sorted(other)`` in the core: keep that run structure by role."""
    run_of_role: dict[tuple, int] = {}
    run, prev = 0, None
    for item in template_list:
        if prev is not None and item < prev:
            run += 1
        run_of_role.setdefault(_role_key(ex.proxy, item), run)
        prev = item
    runs: dict[int, list[str]] = {}
    for p in expanded:
        runs.setdefault(run_of_role.get(_role_key(ex.full, p), 0), []).append(p)
    return [x for k in sorted(runs) for x in sorted(set(runs[k]))]


def _role_key(layout: Layout, ref: str) -> tuple:
    return ("label", _skeleton(ref)) if _is_label(ref) else layout.split(ref).role


def _order_key(ref: Ref, names: list[str], ex: Extrapolator) -> tuple:
    """Module order, as the proxy plan lists ``names`` (its sites' or its hooks' paths): globals before/after
    stacks as in the proxy plan, stacks by index, within a layer as in the proxy's layers."""
    first_pos: dict[tuple, int] = {}
    for pos, name in enumerate(names):
        r = ex.proxy.split(name)
        key = (r.stack,) if r.stack is not None else (None, r.rest)
        first_pos.setdefault(key, pos)
    if ref.stack is None:
        return (first_pos.get((None, ref.rest), 0), 0, 0)
    inner = [
        pos
        for pos, name in enumerate(names)
        if ex.proxy.split(name).stack == ref.stack and ex.proxy.split(name).rest == ref.rest
    ]
    return (first_pos.get((ref.stack,), 0), ref.index or 0, min(inner) if inner else 0)


def _simple(
    ex: Extrapolator,
    items: list[dict],
    owner_field: str,
    same_fields: tuple[str, ...],
    ref_field: str | None = None,
    text_fields: tuple[str, ...] = (),
) -> list[dict]:
    by_role: dict[tuple, dict[int | None, dict]] = {}
    for item in items:
        r = ex.proxy.split(item[owner_field])
        by_role.setdefault(r.role, {})[r.index] = item
    out = []
    for role, by_t in by_role.items():
        refs = None
        if ref_field is not None:
            refs = ex.expand_refs(role, {t: [it[ref_field]] for t, it in by_t.items()}, f"{role} {ref_field}")
        texts = {
            f: ex.expand_text(role, {t: it[f] for t, it in by_t.items()}, f"{role} {f}") for f in text_fields
        }
        stack = role[0]
        full_idx = (
            [None]
            if stack is None
            else [
                j
                for j in range(ex.full.depths[stack])
                if template(j, ex.full.depths[stack], ex.proxy.depths[stack]) in by_t
            ]
        )
        for j in full_idx:
            t = None if stack is None else template(j, ex.full.depths[stack], ex.proxy.depths[stack])
            item = copy.deepcopy(by_t[t])
            item[owner_field] = ex.move(item[owner_field], j, t)
            for f in same_fields:
                item[f] = ex.move(item[f], j, t)
            for f in text_fields:
                item[f] = texts[f][j]
            if refs is not None:
                if len(refs[j]) != 1:
                    raise ExtrapolationError(
                        f"low-memory analysis: `{item[owner_field]}` would refer to "
                        f"{len(refs[j])} modules; convert in memory (--in-memory)"
                    )
                item[ref_field] = refs[j][0]
            out.append(item)
    return out


def normalise(plan: dict[str, Any]) -> dict[str, Any]:
    """The comparable structure of a plan (no errors, reasons or list orders)."""
    return {
        "sites": {
            s["name"]: (
                s["verdict"],
                s["class_name"],
                tuple(s["normalized_shape"]),
                tuple(s["param_shape"]),
                s["eps"],
                s["flavour"],
                tuple(sorted(s["writers"])),
                tuple(sorted(s["readers"])),
                s["fold_beta"],
                s["fold_gamma"],
            )
            for s in plan["sites"]
        },
        "writer_edits": sorted(
            (e["target"], e["axis"], str(e["blocks"]), e["owner"], e["kind"]) for e in plan["writer_edits"]
        ),
        "folds": sorted((f["site"], f["reader"], f["kind"], f["beta"], f["gamma"], f.get("beta_route", ""))
                        for f in plan["folds"]),
        "beta_moves": sorted((m["site"], m["reader"], m["into"], m["kind"], str(m["runs"]))
                             for m in plan.get("beta_moves", [])),
        "hooks": sorted((h["module"], h["where"], str(h["arg"])) for h in plan["hooks"]),
        "unties": sorted((u["module"], u["attr"], u["source"], u["numel"]) for u in plan["unties"]),
        "skipped": sorted(s["name"] for s in plan["skipped"]),
        "changed_outputs": sorted(plan["changed_outputs"]),
        "mean_carries": sorted((c["site"], c["source"], c["up"], c["down"], c["features"], c["hidden"], c["added"])
                               for c in plan.get("mean_carries", [])),
        "scale_folds": sorted((f["param"], f["into"], f["kind"], f["offset"], f.get("keep", False))
                              for f in plan.get("scale_folds", [])),
    }


def check(
    plan3: dict[str, Any], plan4: dict[str, Any], depths3: dict[str, int], depths4: dict[str, int]
) -> None:
    """Refuse unless the depth-3 plan extrapolated to depth 4 equals the depth-4 plan."""
    got, want = normalise(extrapolate(plan3, depths3, depths4)), normalise(plan4)
    for key in want:
        if got[key] != want[key]:
            detail = _first_difference(got[key], want[key])
            raise ExtrapolationError(
                f"low-memory analysis: this architecture's layers are not uniform enough to "
                f"extrapolate the plan ({key}: {detail}); convert in memory (--in-memory)"
            )


def _first_difference(a: Any, b: Any) -> str:
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                return f"{k}: {a.get(k)} != {b.get(k)}"
    sa, sb = set(map(str, a)), set(map(str, b))
    diff = sorted(sa ^ sb)
    return diff[0][:200] if diff else "order"
