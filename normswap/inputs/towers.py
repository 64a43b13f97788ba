"""Per-tower analysis: a multimodal transformers model whose whole-model inputs with media do not run is
analysed tower by tower, each tower on inputs of its own modality.

The builder (:mod:`normswap.inputs.builder`) first tries to run the whole model with every modality in
one forward (text with the image/audio tokens, plus the media). Where no layout runs (a prompt format
the builder does not know, a config whose cross-references a checkpoint fixes), ``patch`` would stop at
"could not run X.forward". This module builds the other route the issue asks for:

- **one run per modality through the model's own feature method** (``get_image_features``,
  ``get_video_features``, ``get_audio_features``: the tower *and* what the model does to its output
  before merging it, e.g. LLaVA's ``vision_feature_layer`` selection and its projector), on the first
  of the builder's media layouts it runs on. The modules it runs and the text run does not are its
  towers, whatever their attribute names;
- **a media tower no feature method runs, alone**, on inputs built for it
  (:func:`~normswap.inputs.builder.hf_example_inputs` of the tower; ``output_hidden_states=True`` where
  the model's config picks a layer to read). Such towers are found by what they are
  (:func:`find_towers`): transformers ``PreTrainedModel`` models with a config of their own and a LayerNorm
  inside, other than the text side;
- **one text-only run of the whole model** (token ids, decoder ids for an encoder-decoder), which
  reaches every norm outside the towers.

All runs are one forward of a *view* of the model (:func:`view`: an object sharing the model's state,
whose ``forward`` makes every run and returns their outputs by name), so ``patch`` makes one working
copy, one trace, one plan (paths as in the model: the manifest reloads), one verification and one
commit, transactional as ever.

What the parent reads of a tower (its feature method's output, or every output of a tower run alone)
is a model output of the view, and must come out of the conversion unchanged: a plan that would
change it (a raw residual stream, centered by a per-token mean) is refused (:meth:`Route.check`). So
are norms of the text run whose stream the input embeddings write: at run time the media features
join that stream, and no run analysed them there.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from normswap.errors import ModelRunFailed, NormswapError, first_line
from normswap.inputs import builder

# media inputs a tower takes first (its ``main_input_name``) -> the modality
MEDIA_MAIN_INPUTS = {"pixel_values": "image", "pixel_values_videos": "video", "input_features": "audio",
                     "input_values": "audio"}
# the parent's feature method of each modality, and the inputs that mark that modality in a layout
FEATURE_KINDS = {"image": ("pixel_values",), "video": ("pixel_values_videos",),
                 "audio": ("input_features", "input_values")}
SEP = "/"  # run name / input name: the view's keyword arguments
ROUTE_NAME = "per tower"


@dataclass
class Run:
    """One forward the view makes: the whole model on text, a feature method on media, or a tower alone."""

    name: str  # prefix of its inputs and name of its output ("text", "image", "tower:<path>")
    call: str  # model | features | module
    kwargs: dict[str, Any]
    towers: list[str] = field(default_factory=list)  # the tower paths it runs
    target: str = ""  # features: "<owner path>:<method>"; module: the tower's path
    held: bool = False  # its output is what the parent reads: it must stay exact

    def describe(self) -> str:
        shapes = ", ".join(f"`{k}` {tuple(v.shape)}" for k, v in self.kwargs.items()
                           if isinstance(v, torch.Tensor) and (k in builder.MODALITY or k.endswith(("_thw", "_sizes"))))
        towers = ", ".join(f"`{t}`" for t in self.towers)
        if self.call == "model":
            return f"the rest of the model on text alone ({shapes})"
        if self.call == "features":
            method = self.target.rpartition(":")[2]
            return f"{towers or 'no tower'} through the model's {method} on built {self.name} ({shapes})"
        return f"{towers} alone on inputs built for it ({shapes}; every output held exact)"


@dataclass
class Route:
    """The runs that together reach every tower and the rest of the model; what the report says of them."""

    runs: list[Run]
    towers: list[str]
    why: str  # why the whole model was not run with media

    def example_inputs(self) -> dict[str, Any]:
        """The view's keyword arguments: every run's inputs, named ``<run>/<input>``."""
        return {f"{run.name}{SEP}{k}": v for run in self.runs for k, v in run.kwargs.items()}

    def describe(self) -> str:
        """One line: which run reached which tower (the report's ``analysis inputs`` line)."""
        return (f"{ROUTE_NAME} (no whole-model layout with media ran: {self.why}): "
                + "; ".join(run.describe() for run in self.runs))

    def check(self, plan: Any, model: nn.Module) -> None:
        """Refuse a plan the per-tower route cannot vouch for (one line, NormswapError), and record the
        route in ``plan.options`` (``analysis_inputs``, ``towers``).

        - a held output (what the parent reads of a tower) the conversion changes: the parent would read
          other values than the original's;
        - a converted norm of the text run whose stream the input embeddings write: at run time the media
          features join that stream in rows no run analysed, so its exactness there is unproven.
        """
        plan.options["analysis_inputs"] = self.describe()
        plan.options["towers"] = list(self.towers)
        place_input_ops(plan, self)
        unreached = [sp.name for sp in plan.sites if sp.verdict == "skipped" and "not called" in sp.reason]
        if unreached:
            plan.options["analysis_inputs"] += (f"; {len(unreached)} LayerNorm(s) no run reaches, kept: "
                                                + ", ".join(f"`{n}`" for n in unreached[:4])
                                                + (" ..." if len(unreached) > 4 else ""))
        held = [run.name for run in self.runs if run.held]
        changed = [o for o in plan.changed_outputs if any(o == h or o.startswith(h + ".") for h in held)]
        if changed:
            run = next(r for r in self.runs if changed[0] == r.name or changed[0].startswith(r.name + "."))
            names = ", ".join(f"`{t}`" for t in run.towers)
            raise NormswapError(
                f"{type(model).__name__}: per-tower analysis refused: converting {names} "
                f"would change `{changed[0]}`, which the model reads of it (a raw residual stream, off by a "
                f"per-token mean); pass example_inputs with every modality so that one run covers the seam "
                f"(no whole-model layout with media ran: {self.why})")
        embedding = _input_embedding_path(model)
        seam = [sp.name for sp in plan.sites if sp.convert and embedding is not None
                and any(w == embedding or w.startswith(embedding + ".") for w in sp.writers)]
        if seam:
            raise NormswapError(
                f"{type(model).__name__}: per-tower analysis refused: `{seam[0]}` ({len(seam)} LayerNorm(s)) reads "
                f"the stream `{embedding}` writes, which the media features join in rows no run analysed; "
                f"pass example_inputs with every modality (no whole-model layout with media ran: {self.why})")


def place_input_ops(plan: Any, route: Route) -> None:
    """Move the plan's ops on the view's own inputs (``<run>/<input>``: a centering op where a run's input
    starts a stream, e.g. a module run alone on built rows) to the module that run calls, on the input of
    that name: the view exists only for the analysis, and the converted model must center what that module
    is given wherever it is called from."""
    runs = {run.name: run for run in route.runs}
    for hook in getattr(plan, "hooks", []):
        if hook.module or hook.where != "input" or not isinstance(hook.arg, str) or SEP not in hook.arg:
            continue
        name, _, arg = hook.arg.partition(SEP)
        run = runs.get(name)
        if run is None or run.call == "features":
            continue  # a feature method's input: no module to hold it (the check refuses such plans elsewhere)
        hook.module = run.target if run.call == "module" else ""
        hook.arg = int(arg[1:]) if arg.startswith("*") and arg[1:].isdigit() else arg


def find_towers(model: nn.Module) -> list[str]:
    """Paths of the media towers inside ``model`` (outermost only), by what they are: a transformers
    ``PreTrainedModel`` with a config of its own, holding a LayerNorm, that is not the text side. The
    text side is the innermost such model holding the input embeddings (``language_model``): it, what
    lies inside it and what holds it are not towers. Where the model has no input embeddings to tell
    the text side by, a tower is one whose ``main_input_name`` is media (``pixel_values``, ...)."""
    from transformers import PreTrainedModel

    own = getattr(model, "config", None)
    models = [(path, m) for path, m in model.named_modules()
              if path and isinstance(m, PreTrainedModel) and getattr(m, "config", None) is not own]
    embedding = _input_embedding_path(model)
    text = None
    if embedding is not None:
        holders = [path for path, _ in models if embedding.startswith(path + ".")]
        text = max(holders, key=len) if holders else ""
    found: list[str] = []
    for path, module in models:
        if any(path.startswith(t + ".") for t in found):
            continue
        if text is None:
            if getattr(module, "main_input_name", None) not in MEDIA_MAIN_INPUTS:
                continue
        elif embedding.startswith(path + ".") or (text and (path == text or path.startswith(text + "."))):
            continue
        if any(isinstance(m, nn.LayerNorm) or computes_layer_norm(m) for m in module.modules()):
            found.append(path)
    return found


def computes_layer_norm(module: nn.Module) -> bool:
    """A norm module that is no ``nn.LayerNorm`` subclass (HF's custom LayerNorm classes): it has a
    weight and an eps and its class name says Norm but not RMS. A tower holding one needs the route;
    whether it really is a LayerNorm is the analysis's numerical call, not this one."""
    name = type(module).__name__.lower()
    return "norm" in name and "rms" not in name and hasattr(module, "weight") and any(
        hasattr(module, a) for a in ("eps", "variance_epsilon", "epsilon"))


def _input_embedding_path(model: nn.Module) -> str | None:
    try:
        embedding = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    return next((p for p, m in model.named_modules() if m is embedding), None)


def _feature_method(model: nn.Module, kind: str) -> tuple[str, Any] | None:
    """``(owner path, bound method)`` of the model's ``get_<kind>_features`` (on the model, else on its
    base model, where a head class leaves it), or None."""
    name = f"get_{kind}_features"
    if callable(getattr(model, name, None)):
        return "", getattr(model, name)
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if isinstance(base, nn.Module) and callable(getattr(base, name, None)):
        return prefix, getattr(base, name)
    return None


def _accepted(fn: Any, layout: dict[str, Any], kind: str) -> dict[str, Any]:
    """The part of ``layout`` the ``kind`` feature method takes: what it names, and behind ``**kwargs``
    its own modality's media and their metadata by name (never another modality's media)."""
    params = inspect.signature(fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    others = {k for other, keys in FEATURE_KINDS.items() if other != kind for k in keys}
    return {k: v for k, v in layout.items() if k in params or (takes_any and k not in others and (
        k in builder.MODALITY or k.endswith(("_thw", "_mask", "_sizes"))))}


def features_of(out: Any) -> Any:
    """What a parent merges of its feature method's output: ``pooler_output`` where transformers puts
    the projected features, else ``last_hidden_state``, else the output itself (a tensor or a list)."""
    pooled = getattr(out, "pooler_output", None)
    if pooled is not None:
        return pooled
    last = getattr(out, "last_hidden_state", None)
    return last if last is not None else out


class Called:
    """The paths of ``model``'s modules that run during the block (forward pre-hooks on every module)."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.called, self.handles = model, set(), []

    def __enter__(self) -> set[str]:
        for path, module in self.model.named_modules():
            if path:
                def hook(module: nn.Module, args: Any, path: str = path) -> None:
                    self.called.add(path)
                self.handles.append(module.register_forward_pre_hook(hook))
        return self.called

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()


def outermost(paths: set[str]) -> list[str]:
    """The paths of ``paths`` that lie inside no other of them."""
    return sorted(p for p in paths if not any(p.startswith(q + ".") for q in paths))


def _feature_runs(model: nn.Module, text_called: set[str]) -> list[Run]:
    """One run per modality whose ``get_<kind>_features`` runs on one of the builder's layouts; each run's
    towers are the outermost modules it calls that the text run does not (the tower, its projector)."""
    runs: list[Run] = []
    try:
        layouts = builder.media_layouts(model)
    except Exception:  # noqa: BLE001 - no media layout can be built for this config: towers go alone
        return runs
    for kind, keys in FEATURE_KINDS.items():
        found = _feature_method(model, kind)
        if found is None:
            continue
        owner, fn = found
        seen: list[dict[str, Any]] = []
        for layout in layouts:
            kw = _accepted(fn, layout, kind)
            if not any(k in kw for k in keys) or any(kw.keys() == s.keys() and all(
                    kw[k] is s[k] for k in kw) for s in seen):
                continue
            seen.append(kw)
            try:
                with builder.trial(model), Called(model) as called:
                    fn(**kw)
            except MemoryError:
                raise
            except Exception:  # noqa: BLE001 - the method does not take this layout: the next one is tried
                continue
            runs.append(Run(kind, "features", kw, outermost(called - text_called), f"{owner}:get_{kind}_features",
                            held=True))
            break
    return runs


def _tower_run(model: nn.Module, path: str) -> tuple[Run | None, str]:
    """The tower at ``path`` run alone on inputs built for it, every output held exact; or (None, why)."""
    tower = model.get_submodule(path)
    try:
        kw = builder.hf_example_inputs(tower)
    except NormswapError as exc:
        return None, first_line(exc, 160)
    if "output_hidden_states" in builder.forward_params(tower) and _reads_hidden_states(model):
        kw["output_hidden_states"] = True  # the parent reads a layer's stream (LLaVA's vision_feature_layer)
    error = builder.run_error(tower, kw)
    if error is not None:
        return None, f"{type(error).__name__}: {first_line(error, 160)}"
    return Run(f"tower:{path}", "module", kw, [path], path, held=True), ""


_LAYER_CHOICE = re.compile(r"feature_layer|select_layer|intermediate_layers|layers_indices|layer_ids|deepstack")


def _reads_hidden_states(model: nn.Module) -> bool:
    """Whether the model's own config picks a tower layer's stream to read (``vision_feature_layer``,
    ``intermediate_layers_indices``, ...): the tower alone then runs with ``output_hidden_states=True``,
    and every stream it returns is held exact."""
    config = getattr(model, "config", None)
    keys = [k for c in (config, *(v for v in vars(config).values() if hasattr(v, "to_dict"))) for k in vars(c)] \
        if config is not None else []
    return any(_LAYER_CHOICE.search(k) for k in keys)


def fallback(model: nn.Module, failure: Exception) -> Route | None:
    """The per-tower route of ``model`` after its whole-model inputs failed with ``failure``: None when
    ``model`` has no media path of its own (no ``get_<kind>_features`` that runs, no tower: the failure
    stands). Raises ModelRunFailed (one line: the whole-model failure as the pipeline said it, then why the
    route could not run either) when a tower or the text run cannot run on inputs of its own."""
    cause = failure.__cause__ if failure.__cause__ is not None else failure
    why = f"{type(cause).__name__}: {first_line(cause, 160)}" if cause is not failure else first_line(failure, 400)
    said = first_line(failure, 400)  # "could not run X.forward on the example inputs (...); pass example_inputs=..."
    towers = find_towers(model)
    try:
        text = builder.text_inputs(model)
    except NormswapError as exc:
        text, error = None, exc
    else:
        with Called(model) as text_called:
            error = builder.run_error(model, text)
    runs = _feature_runs(model, set(text_called) if text is not None else set())
    if not runs and not towers:
        return None
    if error is not None:
        raise ModelRunFailed(f"{said}; per-tower analysis: the model does not run on text alone either "
                            f"({type(error).__name__}: {first_line(error, 160)})")
    reached = {t for run in runs for t in run.towers}
    for path in towers:
        if any(path == r or path.startswith(r + ".") for r in reached):
            continue
        run, problem = _tower_run(model, path)
        if run is None:
            raise ModelRunFailed(f"{said}; per-tower analysis: tower `{path}` does not run on inputs built for it "
                                f"either ({problem})")
        runs.append(run)
    runs.insert(0, Run("text", "model", text))
    return Route(runs, sorted({t for run in runs for t in run.towers}), why)


def view(model: nn.Module, route: Route) -> nn.Module:
    """An object that *is* ``model`` (it shares its ``__dict__``: modules, parameters, config, flags) but
    whose ``forward`` makes every run of ``route`` and returns their outputs by run name.

    ``patch`` converts the view as it converts any model (working copy, trace, plan, verification,
    commit); what it commits lands in ``model``, whose class and forward are untouched. Its class is a
    subclass of ``model``'s with the same name, so messages and the plan read as the model's."""
    cls = type(model)
    sub = type(cls.__name__, (cls,), {"forward": _runs_forward, "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__, "_normswap_route": route,
                                      "_normswap_forward": cls.forward})
    shared = object.__new__(sub)
    shared.__dict__ = model.__dict__
    return shared


def is_view(model: nn.Module) -> bool:
    """Whether ``model`` is a :func:`view` (or a copy of one): a model converted by towers."""
    return getattr(type(model), "_normswap_route", None) is not None


def _runs_forward(self: nn.Module, **kwargs: Any) -> dict[str, Any]:
    """The view's forward: each run on its own inputs (``<run>/<input>``), outputs by run name."""
    route: Route = type(self)._normswap_route
    out: dict[str, Any] = {}
    for run in route.runs:
        kw = {k.split(SEP, 1)[1]: v for k, v in kwargs.items() if k.startswith(run.name + SEP)}
        if run.call == "model":
            out[run.name] = type(self)._normswap_forward(self, **kw)
        elif run.call == "features":
            owner, _, method = run.target.rpartition(":")
            holder = self.get_submodule(owner) if owner else self
            out[run.name] = features_of(getattr(holder, method)(**kw))
        else:  # "*<i>" names the i-th positional input (a norm run alone: RMSNorm names its input otherwise)
            args = [kw.pop(k) for k in sorted((k for k in kw if k.startswith("*")), key=lambda k: int(k[1:]))]
            out[run.name] = self.get_submodule(run.target)(*args, **kw)
    return out
