"""Reaching every LayerNorm: norms the built inputs never call are reached by a sub-run, or the input that
would reach them is named.

Inputs built from a config run the model's main path. Some norms lie off it: a text model's
cross-attention that its parent never feeds encoder states (``BlipModel``), a pre-training head that runs
only with labels or a mask (``FlavaForPreTraining``'s MIM/MLM heads), a protein or image encoder that
runs only when its own input is given. Before this module such norms were kept as LayerNorm
("not called by the example inputs") and nobody said which input would reach them.

- **Sub-runs** (:func:`sub_runs`). For each unreached norm, a submodule around it that can run alone on
  inputs built for it and calls the norm: a transformers ``PreTrainedModel`` (its own config and
  ``main_input_name``: :func:`~normswap.inputs.builder.hf_example_inputs`, which adds
  ``encoder_hidden_states`` where the model holds cross-attention), or any module whose forward takes a
  stream (``hidden_states``, ``x``, ...) of a width its own first LayerNorm or Linear gives. Only modules
  whose output is safe to hold exact are tried (:func:`_candidates`: inside unreached code, or an
  enclosing transformers model the model's run calls, so the junction is analysed too). The sub-runs
  join the whole-model run in a *view* of the model (:func:`normswap.inputs.towers.view`), so ``patch``
  still makes one working copy, one trace, one plan, one verification and one commit. Every output of a
  sub-run is held exact (what the rest of the model reads of that submodule): a plan that would change
  one is refused (:meth:`SubRoute.check`), and ``patch`` then converts without the sub-runs.
- **Naming the missing input** (:func:`missing_inputs`). For a norm still unreached, the forward
  parameters that guard the call of the module holding it (``if entity_ids is not None: ...
  self.entity_embeddings(...)``), read from the source of each forward on the way down from the model:
  those of the model's own forward that the built inputs left unset are the inputs to pass; a guard
  that only an inner forward has, and the model's forward never passes, makes the norm dead for this
  class (a sub-run is its only way in).

A norm that stays unreached is kept as LayerNorm: the conversion is *partial* and exact (the kept norm
computes what it did), and the report says which input reaches it (``plan.options["unreached"]``).
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from normswap.errors import NormswapError, first_line
from normswap.inputs import builder, towers

SUB = "sub:"  # a sub-run's name: "sub:<path>"
MAX_TRIES = 6  # input layouts tried per submodule: a bound on the forwards a search makes


def layer_norms(model: nn.Module) -> list[str]:
    """Paths of the modules that look like LayerNorms (``nn.LayerNorm``, or a Norm class with a weight and an
    eps that is not RMS-style: :func:`towers.computes_layer_norm`). What they compute is the analysis's call."""
    return [p for p, m in model.named_modules() if p and (isinstance(m, nn.LayerNorm) or towers.computes_layer_norm(m))]


class _ParameterWrite(Exception):
    """A trial forward was about to write one of the model's parameters in place."""


class _NoParameterWrites(TorchDispatchMode):
    """Stops a forward before any op writes into a parameter's storage (RWKV divides its weights in eval
    mode on the first call): the trial forward runs on the user's model, which must stay untouched, and the
    analysis on the working copy refuses such a model with its own line."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.storages = {p.untyped_storage().data_ptr() for p in model.parameters() if p.device.type != "meta"}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            for i, arg in enumerate(schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = kwargs.get(arg.name, args[i] if i < len(args) and not arg.kwarg_only else None)
                if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in self.storages:
                    raise _ParameterWrite(str(func))
        return func(*args, **kwargs)


def called_by(model: nn.Module, forward: Any) -> set[str] | None:
    """Paths of ``model``'s modules that ``forward()`` calls (a trial forward: eval, no grad, random state
    kept, no parameter written), or None where it raises or would write a parameter in place."""
    try:
        with builder.trial(model), towers.Called(model) as called, _NoParameterWrites(model):
            forward()
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - these inputs do not run this module: the caller tries others
        return None
    return set(called)


def was_called(path: str, called: set[str]) -> bool:
    """Whether the module at ``path``, or one inside it, is among the ``called`` module paths."""
    return any(c == path or c.startswith(path + ".") for c in called)


def unreached(model: nn.Module, called: set[str]) -> list[str]:
    """The LayerNorms of ``model`` that no module call in ``called`` reaches."""
    return [p for p in layer_norms(model) if p not in called]


@dataclass
class SubRun:
    """One submodule run alone, and the unreached norms it calls."""

    path: str
    kwargs: dict[str, Any]
    norms: list[str]
    how: str  # "on inputs built from its config" | "on built hidden states (width 32)" ...

    def run(self) -> towers.Run:
        return towers.Run(f"{SUB}{self.path}", "module", self.kwargs, [self.path], self.path, held=True)

    def describe(self) -> str:
        return f"`{self.path}` ({len(self.norms)} norm(s)) run alone {self.how}"


def _numbered(path: str) -> str:
    """``path`` with its numeric parts as ``*``: what numbered siblings share."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", path)


def _ancestors(path: str) -> list[str]:
    """The modules enclosing ``path``, smallest first, the model itself left out; last the norm ``path``
    itself (run alone where nothing around it runs: a norm only training mode calls, RF-DETR's group heads)."""
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)] + [path]


def _has_forward(module: nn.Module) -> bool:
    """A module whose forward can be called (a ModuleList or ModuleDict cannot)."""
    return type(module).forward is not nn.Module.forward and not isinstance(module, (nn.ModuleList, nn.ModuleDict))


def _widths(module: nn.Module) -> list[int]:
    """Feature widths ``module`` may take, from its own parts in order: the first LayerNorm's width, then the
    input widths of its Linears."""
    found: list[int] = []
    for m in module.modules():
        if isinstance(m, nn.LayerNorm) and m.normalized_shape:
            found.append(int(m.normalized_shape[-1]))
        elif isinstance(m, nn.Linear):
            found.append(int(m.in_features))
    return list(dict.fromkeys(found))[:3]


def _stream_layouts(module: nn.Module, model: nn.Module) -> list[tuple[dict[str, Any], str]]:
    """Inputs for a module that is no transformers model: its stream inputs (the first parameter, and every
    other required one that is not ids, positions or sizes) as random (2, 8, width) rows, for each width its
    own parts give; a required mask as all ones (2, 8); ``encoder_hidden_states`` added where it takes them.
    Whether the module runs on them, and calls the norm, is the caller's trial."""
    params = builder.forward_params(module)
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not names or _NOT_STREAM.search(names[0]) or _MASK.search(names[0]):
        return []
    required = [n for n in names[1:] if params[n].default is inspect.Parameter.empty]
    masks = [n for n in required if _MASK.search(n)]
    streams = [names[0]] + [n for n in required if n not in masks]
    if any(_NOT_STREAM.search(n) for n in streams):
        return []  # a required input of another kind (ids, positions, sizes) no rule here builds
    p = next((q for q in model.parameters() if q.is_floating_point()), None)
    dtype, device = (p.dtype, p.device) if p is not None else (torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    widths = _widths(module)
    layouts: list[tuple[dict[str, Any], str]] = []
    for width in widths:
        kw: dict[str, Any] = {n: torch.randn(2, 8, width, generator=gen).to(device, dtype) for n in streams}
        kw.update({n: torch.ones(2, 8, dtype=torch.bool, device=device) for n in masks})
        how = f"on built {', '.join(f'`{n}`' for n in streams)} (width {width})"
        if "encoder_hidden_states" in params and "encoder_hidden_states" not in streams:
            for enc in widths:  # with encoder states first: a cross-attention also runs without them, on itself
                states = torch.randn(2, 5, enc, generator=gen).to(device, dtype)
                layouts.append(({**kw, "encoder_hidden_states": states}, f"{how} and encoder states (width {enc})"))
        layouts.append((kw, how))
    return layouts[:MAX_TRIES]


_NOT_STREAM = re.compile(r"(ids|labels?|positions?|position_ids|index|indices|idx|lengths?|sizes?|shapes?|thw|"
                         r"cache|past_key_values?|^use_\w+|^output_\w+|^return_\w+|^times?|timesteps?)$")
_MASK = re.compile(r"mask")


def _model_layouts(module: nn.Module) -> list[tuple[dict[str, Any], str]]:
    """Inputs for a transformers model inside the model, built from its own config (with encoder states where
    it holds cross-attention, as :func:`~normswap.inputs.builder.hf_example_inputs` builds them)."""
    try:
        kw = builder.hf_example_inputs(module)
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - no inputs can be built for it: the next enclosing module is tried
        return []
    main = getattr(module, "main_input_name", "input_ids")
    how = "on inputs built from its config" + (" with encoder states" if "encoder_hidden_states" in kw else "")
    shapes = [f"`{k}` {tuple(v.shape)}" for k, v in kw.items() if isinstance(v, torch.Tensor) and
              (k == main or k == "encoder_hidden_states")]
    return [(kw, f"{how} ({', '.join(shapes)})" if shapes else how)]


def sub_runs(model: nn.Module, norms: list[str], in_place: set[str] = frozenset(),
             called: set[str] = frozenset()) -> tuple[list[SubRun], list[str]]:
    """Sub-runs that reach ``norms`` (unreached by the model's own run, which calls the modules ``called``),
    and the norms none reaches.

    Per norm, the candidates of :func:`_candidates` in order (what is safe to hold exact: a module inside an
    unreached one, outermost first; an enclosing transformers model the model's run calls; the norm alone,
    a centering op at its input then making it exact), except the norm alone for the norms of ``in_place``:
    an input of the model reaches those (:func:`missing_inputs`), and they are best analysed in place,
    where their writers can be centered. The first candidate whose run calls the norm is taken; it serves
    every other norm it calls."""
    runs: list[SubRun] = []
    left, kept = list(norms), []
    while left:
        norm = left[0]
        found = None
        for path, kind in _candidates(model, norm, called):
            if path == norm and norm in in_place:
                continue
            sub = model.get_submodule(path)
            for kw, how in (_model_layouts(sub) if kind == "model" else _stream_layouts(sub, model)):
                alone = path == norm
                if alone:  # the norm alone: its input by position (the RMSNorm swapped in names it `x`)
                    kw = {f"*{i}": v for i, v in enumerate(kw.values())}
                    how = "(the norm itself: nothing around it runs) on built rows " + how[how.rfind("(width"):]
                ran = called_by(sub, lambda sub=sub, kw=kw, alone=alone: sub(*kw.values()) if alone else sub(**kw))
                inside = {f"{path}.{c}" for c in ran or ()} | ({path} if ran is not None else set())
                if norm in inside:
                    found = SubRun(path, kw, [n for n in left if n in inside], how)
                    break
            if found:
                break
        if found is None:
            kept.append(norm)
            left.remove(norm)
            continue
        runs.append(found)
        left = [n for n in left if n not in found.norms]
    return runs, kept


def _candidates(model: nn.Module, norm: str, called: set[str]) -> list[tuple[str, str]]:
    """``(path, "model" | "stream")`` for each module :func:`sub_runs` tries for ``norm``, in its order.

    A sub-run holds its module's output exact, but the analysis sees only what happens inside it: where that
    output goes is unanalysed. So a module is a candidate only where that is safe:

    - first an enclosing transformers model the model's run calls, smallest first, run alone on inputs built
      for it that reach the norm (GPT-2's or BLIP's text model with encoder states): the junction, where what
      the unreached part returns joins the analysed streams, is then analysed too. GPT-2's cross-attention
      run alone would add its uncentered output to a stream whose norms were converted without it;
    - else a module the model's run never calls *inside one it never calls either* (its caller: the nearest
      enclosing module with a forward of its own), outermost first: what it returns goes into code no run
      converted. What that unreached code returns in turn is not analysed where it lands; where it lands in
      a model output or a reader that only reads it (a pre-training head's logits, a protein encoder's
      features read by cross-attention projections) that is exact, where it joins a stream the model's run
      analysed it is not proven (docs/compatibility.md says so);
    - last the norm alone, on the same condition as the second (its caller never called).
    """
    from transformers import PreTrainedModel

    def is_called(path: str) -> bool:
        return not path or was_called(path, called)

    def caller(path: str) -> str:
        up = path.rpartition(".")[0]
        while up and not _has_forward(model.get_submodule(up)):
            up = up.rpartition(".")[0]
        return up

    around = [p for p in _ancestors(norm)[:-1] if _has_forward(model.get_submodule(p))]  # smallest first
    inner = [p for p in around if not is_called(p) and not is_called(caller(p))]
    def kind(path: str) -> str:
        return "model" if isinstance(model.get_submodule(path), PreTrainedModel) else "stream"

    order = [(p, "model") for p in around if is_called(p) and kind(p) == "model"]
    order += [(p, kind(p)) for p in reversed(inner)]
    if not is_called(caller(norm)):
        order.append((norm, "stream"))
    return order


@dataclass
class SubRoute(towers.Route):
    """The whole model's run plus sub-runs for the norms it does not reach (a :class:`towers.Route`, so
    :func:`towers.view` runs it)."""

    subs: list[SubRun] = field(default_factory=list)
    base: str = ""  # what the whole-model run's inputs are (builder.describe)

    def describe(self) -> str:
        return f"{self.base}; norms the whole model's run does not reach, by sub-runs: {'; '.join(self.lines())}"

    def lines(self) -> list[str]:
        """One phrase per kind of sub-run: runs of numbered siblings built alike (``layers.0``, ``layers.1``)
        said once, as ``layers.*``."""
        groups: dict[tuple[str, str], list[SubRun]] = {}
        for s in self.subs:
            groups.setdefault((_numbered(s.path), s.how), []).append(s)
        out = []
        for (pattern, how), subs in groups.items():
            if len(subs) == 1:
                out.append(subs[0].describe())
            else:
                norms = sum(len(s.norms) for s in subs)
                out.append(f"`{pattern}` ({len(subs)} modules, {norms} norm(s)) each run alone {how}")
        return out

    def check(self, plan: Any, model: nn.Module) -> None:
        """Refuse (one line, NormswapError) a plan that changes what the model reads of a sub-run's module (a
        held output); record the runs in ``plan.options`` (``analysis_inputs``, ``sub_runs``)."""
        plan.options["analysis_inputs"] = self.describe()
        plan.options["sub_runs"] = self.lines()
        if self.towers:
            plan.options["towers"] = list(self.towers)
        towers.place_input_ops(plan, self)
        held = [s.run().name for s in self.subs]
        changed = [o for o in plan.changed_outputs if any(o == h or o.startswith(h + ".") for h in held)]
        if changed:
            sub = next(s for s in self.subs if changed[0].startswith(s.run().name))
            raise NormswapError(
                f"{type(model).__name__}: sub-run of `{sub.path}` refused: converting it would change `{changed[0]}`, "
                f"which the model reads of it (a raw residual stream, off by a per-token mean)")


def route(model: nn.Module, kwargs: dict[str, Any],
          base: towers.Route | None = None) -> tuple[SubRoute | None, set[str] | None]:
    """The sub-runs that reach what the model's own run on ``kwargs`` (or the per-tower route ``base``) does
    not (None when it reaches every LayerNorm or no sub-run reaches any of the rest), and the paths of the
    modules the model's own run calls (None where it failed here), which naming the missing input reads."""
    if base is None:
        called = called_by(model, lambda: builder.run_kept(model, kwargs))  # kept where the caller asks
    else:
        shared = towers.view(model, base)
        called = called_by(model, lambda: shared(**base.example_inputs()))
    if called is None:
        return None, None
    norms = unreached(model, called)
    if not norms:
        return None, called
    given = {k.rpartition(towers.SEP)[2]: v for k, v in (base.example_inputs() if base is not None else kwargs).items()}
    try:
        in_place = {n for m in missing_inputs(model, norms, called, given) if m.inputs or m.without for n in m.norms}
    except MemoryError:
        raise
    except Exception:  # noqa: BLE001 - a forward whose source cannot be read: no input named, every way tried
        in_place = set()
    subs, _ = sub_runs(model, norms, in_place, called)
    # ``called`` stays the model's own run's: a norm a sub-run reaches is converted, and one it does not is
    # named by the guards on the model's own path (a sub-run that ran part of a module says nothing of them)
    if not subs:
        return None, called
    runs = list(base.runs) if base is not None else [towers.Run("model", "model", dict(kwargs))]
    runs += [s.run() for s in subs]
    return SubRoute(runs, list(base.towers) if base is not None else [], base.why if base is not None else "",
                    subs=subs, base=base.describe() if base is not None else builder.describe(model, kwargs)), called


# ------------------------------------------------------------------------------- naming the missing input
def _source_tree(fn: Any) -> ast.FunctionDef | None:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


SET, UNSET = "set", "unset"
Want = tuple[str, str]  # (name, SET or UNSET): what a condition needs of a name
Condition = frozenset[Want]  # any one of these holds the condition (alternatives)


def _conditions(test: ast.AST, truth: bool) -> list[Condition]:
    """What ``test`` evaluating to ``truth`` needs of the names it tests, as conditions that must all hold
    (each a set of alternatives): ``x is None`` true needs ``x`` unset, ``x is not None`` or a bare ``x``
    true needs it set, ``not`` flips, ``and``/``or`` combine. A test it cannot read (a call, a comparison
    of values, an attribute) needs nothing it can name: ``[]``."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _conditions(test.operand, not truth)
    if isinstance(test, ast.Name):
        return [frozenset({(test.id, SET if truth else UNSET)})]
    if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Name)
            and isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None
            and isinstance(test.ops[0], (ast.Is, ast.IsNot))):
        is_set = isinstance(test.ops[0], ast.IsNot) == truth
        return [frozenset({(test.left.id, SET if is_set else UNSET)})]
    if isinstance(test, ast.BoolOp):
        every = isinstance(test.op, ast.And) == truth  # each operand must evaluate to ``truth``
        parts = [_conditions(v, truth) for v in test.values]
        if every:
            return [c for part in parts for c in part]
        if all(len(part) == 1 for part in parts):  # one operand evaluating to ``truth`` is enough
            return [frozenset().union(*(part[0] for part in parts))]
    return []


def _guards(fn: Any, attrs: set[str]) -> tuple[bool, list[Condition]]:
    """Whether ``fn`` uses ``self.<attr>`` for an attr in ``attrs``, and the conditions its enclosing tests
    (``if``/``elif``/``else``, ``a if c else b``, ``and``/``or``) put on the names they test at those uses,
    with their polarity: a use in an ``else`` needs its test false."""
    tree = _source_tree(fn)
    if tree is None:
        return False, []
    used, guards = False, []

    def visit(node: ast.AST, conditions: list[Condition]) -> None:
        nonlocal used
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
                and node.attr in attrs:
            used = True
            guards.extend(c for c in conditions if c not in guards)
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            visit(node.test, conditions)
            body = node.body if isinstance(node.body, list) else [node.body]
            orelse = node.orelse if isinstance(node.orelse, list) else [node.orelse]
            for child in body:
                visit(child, [*conditions, *_conditions(node.test, True)])
            for child in orelse:
                visit(child, [*conditions, *_conditions(node.test, False)])
            return
        if isinstance(node, ast.BoolOp):  # ``a and self.x(...)``: x runs only once a is true (false for ``or``)
            for i, child in enumerate(node.values):
                before = [c for v in node.values[:i] for c in _conditions(v, isinstance(node.op, ast.And))]
                visit(child, [*conditions, *before])
            return
        for child in ast.iter_child_nodes(node):
            visit(child, conditions)

    visit(tree, [])
    if used:  # one step of dataflow: the local names passed to the child, and what guards their assignment
        passed = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and any(isinstance(n, ast.Attribute) and n.attr in attrs and
                                                  isinstance(n.value, ast.Name) and n.value.id == "self"
                                                  for n in ast.walk(node.func)):
                passed |= {n.id for a in [*node.args, *(k.value for k in node.keywords)] for n in ast.walk(a)
                           if isinstance(n, ast.Name)}
        if passed:
            guards.extend(c for c in _assignment_guards(tree, passed) if c not in guards)
    return used, guards


def _assignment_guards(tree: ast.AST, targets: set[str]) -> list[Condition]:
    """The conditions of the tests around an assignment to any of ``targets`` that need a name given
    (``if input_boxes is not None: boxes = input_boxes``): what gives the passed name a real value. The
    other branch's fallback (``else: boxes = torch.zeros(1, 0, 4)``) needs a name left out, which is what the
    built inputs already do, so those alternatives are dropped."""
    found: list[Condition] = []

    def visit(node: ast.AST, conditions: list[Condition]) -> None:
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            names = {n.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                     for n in ast.walk(t) if isinstance(n, ast.Name)}
            if names & targets:
                found.extend(c for c in conditions if all(want == SET for _, want in c) and c not in found)
        if isinstance(node, ast.If):
            for child in node.body:
                visit(child, [*conditions, *_conditions(node.test, True)])
            for child in node.orelse:
                visit(child, [*conditions, *_conditions(node.test, False)])
            return
        for child in ast.iter_child_nodes(node):
            visit(child, conditions)

    visit(tree, [])
    return found


def _methods_using(cls: type, attr: str) -> list[str]:
    """Names of ``cls``'s own methods (not nn.Module's) other than forward that use ``self.<attr>``."""
    found = []
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if name == "forward" or name.startswith("__") or getattr(nn.Module, name, None) is fn:
            continue
        if _guards(fn, {attr})[0]:
            found.append(name)
    return found


def _level_guards(module: nn.Module, child: str) -> tuple[bool, list[Condition]]:
    """Whether ``module``'s forward reaches its child ``child`` (directly or through one of its own methods),
    and the conditions on its forward parameters that guard it (a condition naming anything else is left
    out: a local could hold it either way)."""
    forward = type(module).forward
    params = set(builder.forward_params(module))
    used, guards = _guards(forward, {child})
    if not used:
        helpers = _methods_using(type(module), child)
        used, guards = _guards(forward, set(helpers)) if helpers else (False, [])
        for helper in helpers if used else ():  # what guards the child inside the helper, by its own parameters
            guards += [c for c in _guards(getattr(type(module), helper), {child})[1] if c not in guards]
    return used, [c for c in guards if all(name in params for name, _ in c)]


def _is_given(value: Any) -> bool:
    return value is not None and value is not False


@dataclass
class Missing:
    """Norms no run reaches, grouped by the outermost module holding them that no run calls."""

    module: str
    norms: list[str]
    inputs: list[str]  # the model's forward parameters that would reach them (any one of them)
    dead: str = ""  # why no input of the model's forward reaches them (an inner guard it never passes)
    owner: str = "the model"  # the model's class name
    without: list[str] = field(default_factory=list)  # given inputs whose presence keeps them off the path

    def line(self) -> str:
        head = f"{len(self.norms)} LayerNorm(s) in `{self.module}` not reached"
        leave = " and ".join(f"`{i}`" for i in self.without)
        if self.inputs:
            also = f" without {leave}" if self.without else ""
            return f"{head}: pass {' or '.join(f'`{i}`' for i in self.inputs)}{also} ({self.owner}.forward " \
                   "reaches them only with it)"
        if self.without:
            return f"{head}: pass example inputs without {leave} ({self.owner}.forward reaches them only when " \
                   f"{'it is' if len(self.without) == 1 else 'they are'} not given)"
        if self.dead:
            return f"{head}: {self.dead}"
        return f"{head} by the built inputs (no forward parameter found that reaches them; pass example_inputs that do)"


def _unmet(conditions: list[Condition], given: dict[str, Any]) -> tuple[list[str], list[str]]:
    """For the ``conditions`` the ``given`` inputs do not meet: the parameters to pass (any one of a
    condition's) and the given ones to leave out."""
    to_pass: list[str] = []
    to_leave: list[str] = []
    for condition in conditions:
        if any(_is_given(given.get(name)) == (want == SET) for name, want in condition):
            continue
        for name, want in sorted(condition):
            target = to_pass if want == SET else to_leave
            if name not in target:
                target.append(name)
    return to_pass, to_leave


def missing_inputs(model: nn.Module, norms: list[str], called: set[str], given: dict[str, Any]) -> list[Missing]:
    """For ``norms`` no run reaches, grouped by the outermost module on their path that holds nothing
    ``called``: the model's forward parameters whose tests guard the call of the module on the way down,
    read with their polarity (the inputs to pass that the built ones left out, and the built ones to leave
    out: SeamlessM4T's text encoder runs only when ``input_features`` is not given); else the inner guard
    the model never passes (dead for this class). The guards of a call that did run (what it was given) are
    named only where no deeper guard is: SAM's prompt encoder runs on the points but embeds masks only with
    ``input_masks``, the guard one level down."""
    groups: dict[str, list[str]] = {}
    for norm in norms:
        parts = norm.split(".")
        prefixes = (".".join(parts[:i]) for i in range(1, len(parts) + 1))
        top = next((p for p in prefixes if not was_called(p, called)), norm)
        groups.setdefault(top, []).append(norm)
    own = set(builder.forward_params(model))
    found = []
    for top, members in groups.items():
        parts = top.split(".")
        inputs: list[str] = []
        without: list[str] = []
        dead = ""
        ran_pass: list[str] = []  # what guards the levels that did run (the values they were given), a fallback
        for i in range(len(parts)):
            holder = model.get_submodule(".".join(parts[:i])) if i else model
            if isinstance(holder, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) or not _has_forward(holder):
                continue
            child = ".".join(parts[:i + 1])
            child_ran = was_called(child, called)
            used, guards = _level_guards(holder, parts[i])
            if not used and not child_ran and not inputs and not without:  # forward never calls it (generate-only)
                others = _methods_using(type(holder), parts[i])
                dead = (f"`{_numbered(child)}` is not called by {type(holder).__name__}.forward"
                        + (f"; only {', '.join(f'`{m}`' for m in others)} {'calls' if len(others) == 1 else 'call'} it"
                           if others else "")
                        + " (dead for this class)")
                break
            if i == 0 or holder is model:
                to_pass, to_leave = _unmet(guards, given)
                if child_ran:  # called, so its own guards held: only what it was given may have been empty
                    ran_pass += [n for n in to_pass if n not in ran_pass]
                    continue
                inputs += [n for n in to_pass if n not in inputs]
                without += [n for n in to_leave if n not in without]
                continue
            # an inner forward's guard: met by default unless it needs a parameter given, which the model
            # can pass only under the same name
            needed = [c for c in guards if all(want == SET for _, want in c)]
            if not needed or inputs or without:
                continue
            reachable = sorted({name for c in needed for name, _ in c
                                if name in own and not _is_given(given.get(name))})
            if reachable:
                inputs += reachable
            else:
                guard = ", ".join(f"`{g}`" for g in sorted({name for c in needed for name, _ in c}))
                dead = (f"`{_numbered('.'.join(parts[:i]))}` runs it only with {guard}, which "
                        f"{type(model).__name__}.forward never passes (dead for this class)")
                break
        if not (inputs or without or dead):  # SAM 3's geometry encoder runs on empty boxes without `input_boxes`
            inputs = ran_pass
        found.append(Missing(top, members, inputs, "" if inputs or without else dead, type(model).__name__,
                             without))
    merged: dict[tuple[str, tuple[str, ...], tuple[str, ...], str], Missing] = {}  # numbered siblings: one line
    for m in found:
        key = (_numbered(m.module), tuple(m.inputs), tuple(m.without), m.dead)
        if key in merged:
            merged[key].norms += m.norms
            merged[key].module = key[0]
        else:
            merged[key] = m
    return list(merged.values())


def say_missing(plan: Any, model: nn.Module, called: set[str] | None, given: dict[str, Any]) -> None:
    """Record in ``plan`` which input would reach each norm no run reached (``plan.options["unreached"]``,
    the ``analysis_inputs`` line, and each such site's reason)."""
    kept = [sp.name for sp in plan.sites if sp.verdict == "skipped" and "not called" in sp.reason]
    kept += [sk["name"] for sk in plan.skipped if _NOT_RUN.search(str(sk.get("reason", "")))]
    if not kept:
        return
    if called is None:
        called = set()
    try:
        groups = missing_inputs(model, kept, called, given)
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - reading the source is a courtesy: say what was kept anyway
        groups = [Missing(kept[0].rpartition(".")[0] or kept[0], kept, [],
                          f"(could not read which input reaches them: {type(exc).__name__}: {first_line(exc, 80)})")]
    lines = [g.line() for g in groups]
    plan.options["unreached"] = lines
    line = "; ".join(lines)
    plan.options["analysis_inputs"] = (plan.options.get("analysis_inputs") or "") + f"; kept as LayerNorm: {line}"
    for g in groups:
        why = g.line().split(": ", 1)[1] if ": " in g.line() else ""
        for sp in plan.sites:
            if sp.name in g.norms and why:
                sp.reason = f"not called by the example inputs (kept as LayerNorm); {why}"
        for sk in plan.skipped:
            if sk["name"] in g.norms and why:
                sk["reason"] = f"{sk['reason']}; {why}"


# the walker's reasons for a norm found in no trace, or traced on no rows (analysis.walker.NOT_RUN and kin)
_NOT_RUN = re.compile(r"did not run on the analysis inputs|ran on the analysis inputs only with no rows")


# ------------------------------------------------------------------------------- calibration of a sub-run view
def sub_route_of(model: nn.Module) -> SubRoute | None:
    """The :class:`SubRoute` of a view made for one (:func:`towers.view`), when it has no per-tower runs: the
    whole model then runs on its own inputs, so calibration data for the model serves it (:meth:`SubRoute.lift`)."""
    found = getattr(type(model), "_normswap_route", None)
    return found if isinstance(found, SubRoute) and not found.towers else None


def plain(view: nn.Module) -> nn.Module:
    """The model a view is made of, as itself (same state, the model's own class and forward)."""
    base = type(view).__mro__[1]
    shared = object.__new__(base)
    shared.__dict__ = view.__dict__
    return shared


def lift(route_: SubRoute, batch: tuple[tuple, dict]) -> tuple[tuple, dict]:
    """A batch of the whole model's inputs as the view takes it: the model run's inputs, plus every sub-run's
    built inputs (the same in every batch). Positional inputs cannot be named for the view: refused."""
    args, kwargs = batch
    if args:
        raise NormswapError("calibration batches with positional inputs cannot feed a model converted with "
                            "sub-runs; pass them as a dict of forward's keyword arguments")
    run = route_.runs[0]
    out = {f"{run.name}{towers.SEP}{k}": v for k, v in kwargs.items()}
    out.update({k: v for k, v in route_.example_inputs().items() if not k.startswith(run.name + towers.SEP)})
    return (), out
