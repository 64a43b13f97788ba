"""``quantizer=ENGINE`` (CLI ``--quantizer ENGINE``): the conversion options each quantization engine was measured to
need, in one table (:data:`QUANTIZERS`), so a user names the engine instead of translating ``docs/deployment.md``'s
"At a glance" table into flags.

Each engine's entry sets options per *model kind*, which the analysis finds (never the model's name, never a
reason's words: :func:`model_kind` reads the plan's structured records):

* ``pre-ln``: every residual stream is written by Linear/conv writers (GPT-2, Whisper, ViT), or starts at a norm's
  output that several norms share (BLOOM's embedding LayerNorm, CLIP's pre-LayerNorm: ``SitePlan.stream_kind ==
  "norm-start"``);
* ``layer-scale``: a Pre-LN model whose writers a LayerScale λ scales (DINOv2, BEiT, CaiT: ``plan.scale_folds``);
* ``post-ln``: some norm's stream carries another norm's output that no other norm sums, the norms a chain (BERT,
  MPNet, MiniLM: a Post-LN encoder; ``SitePlan.stream_kind == "post-ln"`` on some norm, whatever its verdict, or a
  mean carry in the plan).

Why kinds resolved after the analysis, not planner values that act per model on their own: the measured advice is
per kind (``--writer-centering op`` on a Pre-LN model, ``auto`` on one with LayerScale, ``--per-norm-centering
--no-mean-carry`` on a Post-LN encoder), and spelling it as one planner value would need new option values whose
meaning is "what engine X wants", which the explicit options then could not express. Here every kind resolves to
plain options a user could pass (``normswap inspect`` and the manifest show which), so ``convert --quantizer X``
writes the very checkpoint ``convert`` with those options writes. The kind is read from one plan made with the
defaults (:func:`model_kind`: each norm's ``stream_kind``, the mean carries, the LayerScale folds; before round 61 it
read whether an approximate norm's reason said "(Post-LN)", which a Post-LN norm approximate for another stated
reason, its first problem term a ``tanh`` branch or a Linear also read elsewhere (ALBERT), does not say); the plan
is then made again with the engine's options where they differ. The kinds
matter: on a Post-LN encoder ``writer_centering="op"`` is not refused, it adds one op after each attention output
projection (none after the FFN writers, through which the mean carry writes) and leaves the approximate norms
approximate, and with ``per_norm_centering`` as well those ops sit beside the per-norm ones, redundant; the writer
options are the Pre-LN kinds' advice only. The Post-LN advice alone could be a plain mapping (``per_norm_centering=True,
mean_carry=False`` plans GPT-2, DINOv2 and Whisper exactly as the defaults do: no norm of theirs is approximate),
but ``low_memory=True`` refuses ``per_norm_centering`` whatever the model, and the manifest would then record
options the table does not give for that model.

Options the caller gives explicitly win over the engine's (``ConvertOptions.quantizer_overrides``; the CLI reads
click's parameter source). A combination the engine's options cannot honour is refused before anything is loaded
(:func:`check_combination`). Torch-free: the CLI's ``--help`` and usage errors read it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from normswap.errors import OptionRefused

KINDS = ("pre-ln", "layer-scale", "post-ln")
KIND_LABELS = {"pre-ln": "Pre-LN", "layer-scale": "Pre-LN with LayerScale", "post-ln": "Post-LN encoder"}
# the ConvertOptions fields an engine's entry may set, with their defaults (the defaults stay normswap's)
FIELDS: dict[str, Any] = {"writer_centering": "weights", "per_norm_centering": False, "mean_carry": True}
# what an override may name: those fields and the checkpoint's format (convert's own argument)
OVERRIDABLE = (*FIELDS, "format")
# Post-LN norms made exact by one mean per norm, not by the MLP carry (whose added neurons per-tensor int8 and
# symmetric int4 groups round worse: all-MiniLM-L6-v2, all-mpnet-base-v2)
POST_LN_OPS: dict[str, Any] = {"per_norm_centering": True, "mean_carry": False}


@dataclass(frozen=True)
class Quantizer:
    """One engine: which options it needs on each model kind, and why.

    Attributes:
        name: the value of ``quantizer=`` / ``--quantizer``.
        row: the engine as ``docs/deployment.md``'s "At a glance" table names it (its row's first cell).
        options: model kind → the :class:`~normswap.ConvertOptions` fields it sets (only those that differ from
            the defaults; a kind not listed takes the defaults).
        format: the checkpoint format it needs (``None``: either; the default, native).
        native: with ``format="compat"``: what a native checkpoint means for this engine when the caller asks for
            one; ``""``: the engine cannot read one (refused).
        why: one line: what the options do for this engine.
        measured: the measured cell behind it (error over the original's, in that quantizer; 1.05 is the bar).
        avoid: options the measurements advise against with this engine (CLI name → why), said when given.
    """

    name: str
    row: str
    options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    format: str | None = None
    native: str = ""
    why: str = ""
    measured: str = ""
    avoid: Mapping[str, str] = field(default_factory=dict)

    def options_for(self, kind: str) -> dict[str, Any]:
        """The fields this engine sets on a model of ``kind`` (one of :data:`KINDS`)."""
        if kind not in KINDS:
            raise ValueError(f"model kind must be one of {', '.join(KINDS)}, not {kind!r}")
        return dict(self.options.get(kind, {}))

    def sets(self, name: str) -> set[Any]:
        """The values this engine gives field ``name`` on some kind (empty: it never sets it)."""
        return {opts[name] for opts in self.options.values() if name in opts}


_PRE_LN = ("pre-ln", "layer-scale")
_ALL = {kind: {} for kind in KINDS}


def _kinds(options: Mapping[str, Any], kinds: tuple[str, ...] = KINDS) -> dict[str, dict[str, Any]]:
    return {kind: dict(options) for kind in kinds}


QUANTIZERS: dict[str, Quantizer] = {q.name: q for q in (
    Quantizer("none", "(none: normswap's defaults)", _ALL,
              why="no engine in mind: the defaults (exact; every β kept in a checkpoint)"),
    Quantizer("onnxruntime-dynamic", "ONNX Runtime `quantize_dynamic`, per-tensor weights",
              {"post-ln": POST_LN_OPS},
              why="per-tensor int8 rounds a mean carry's added neurons coarsely: Post-LN norms take per-norm ops",
              measured="all-MiniLM-L6-v2 1.028, paraphrase-MiniLM-L3-v2 1.015 (the defaults, tables kept since "
                       "round 63) → 1.000 (the original's tensors); Whisper 0.94-0.999, DINOv2-small 0.55-0.63 with "
                       "the defaults"),
    Quantizer("onnxruntime-dynamic-per-channel", "ONNX Runtime `quantize_dynamic`, per-channel weights",
              why="one scale per weight row absorbs every fold: the defaults",
              measured="Whisper tiny.en native 1.02 (0.93-1.12); paraphrase-MiniLM-L3-v2 0.986, all-MiniLM-L6-v2 "
                       "0.999 (tables kept since round 63; 0.94 / 0.99 centered; AVX2, no VNNI: 3.4 and 11.2 before "
                       "round 61's carry pairs)"),
    Quantizer("onnxruntime-static", "ONNX Runtime static QDQ", format="compat",
              native="ONNX Runtime's own quantize_static rounds the native format's stem op twice (DINOv2-shaped "
                     "1.29): quantize it with normswap.integrations.onnx.quantize_static (0.86)",
              why="the compat graph has no centering op for static QDQ to round on a second grid",
              measured="native through ONNX Runtime's call 1.29 → compat DINOv2-small 0.89-0.95"),
    Quantizer("onnxruntime-int4", "ONNX Runtime `MatMulNBits` 4-bit (RTN, HQQ, GPTQ)", format="compat",
              native="the native format measured worse in MatMulNBits (Whisper base RTN 1.10 vs compat 1.03)",
              why="block-wise 4-bit rounds the compat format within the bar; a folded γ spreads a block's columns",
              measured="Whisper base native RTN 1.10 → compat 1.03 (21 paired draws); tiny.en 0.96-0.995; "
                       "all-MiniLM-L6-v2 native RTN 0.989 (split carry)",
              avoid={"--fold-gamma": "γ folded into the readers spreads the columns a 4-bit block shares"}),
    Quantizer("ctranslate2", "CTranslate2 int8", format="compat",
              why="CTranslate2's converters read the stock architecture (the compat format) only",
              measured="Whisper tiny.en 0.96-0.99, base 0.99"),
    Quantizer("openvino-int8", "OpenVINO NNCF int8 weights",
              {**_kinds({"writer_centering": "op"}, _PRE_LN), "post-ln": POST_LN_OPS},
              why="NNCF rounds each weight row on its own scale: the writers keep the original's rows (one op "
                  "each); Post-LN norms take per-norm ops",
              measured="DINOv2-small 1.13-1.15 → 1.03; all-mpnet-base-v2 1.09 → 0.995-1.008; held-out "
                       "paraphrase-MiniLM-L3-v2 1.001 → 1.000, all-MiniLM-L6-v2 1.038 → 1.000 (the defaults keep "
                       "the embedding tables since round 63: 1.12, 1.19, 1.016 with them centered; a Post-LN "
                       "checkpoint holds the original's tensors)"),
    Quantizer("openvino-int4", "OpenVINO NNCF int4 groups", {"post-ln": POST_LN_OPS},
              why="symmetric int4 groups round a mean carry's added neurons coarsely: Post-LN norms take per-norm "
                  "ops (or keep the carry and use NNCF's INT4_ASYM)",
              measured="MPNet int4 sym 1.09 → 0.999-1.001; paraphrase-MiniLM-L3-v2 sym/asym g128 1.000 (1.03 "
                       "with the tables centered before round 62; the defaults 0.75/0.78); DINOv2-small int4 1.04 "
                       "with the defaults"),
    Quantizer("openvino-static", "OpenVINO NNCF static int8 (`nncf.quantize`)",
              {"layer-scale": {"writer_centering": "op"}, "post-ln": POST_LN_OPS},
              why="calibrated int8 of weights and activations: on a Post-LN encoder the per-norm ops write the "
                  "original's tensors and OpenVINO fuses each op and its RMSNorm into MVN, so NNCF quantizes the "
                  "original's graph; on a LayerScale model the writers keep the original's rows (one op each)",
              measured="paraphrase-MiniLM-L3-v2 1.060 (1.05-1.07; 1.015 with the FFN-output projections float, 0.997 "
                       "with every norm exact by ops and the carry kept; 0.956 "
                       "with the tables centered before round 63), all-MiniLM-L6-v2 0.973 with the defaults → 1.000 "
                       "with the ops (round 63); DINOv2-small 1.046 (1.02-1.07; every token 1.051) → op 1.003 "
                       "(0.99-1.01), Whisper tiny.en's decoder 0.986 (0.96-1.01) with the defaults, all-mpnet-base-v2 "
                       "1.209 → 1.000 with the ops (round 64)"),
    Quantizer("torchao", "torchao int8 dynamic activations + int8 weights",
              {"pre-ln": {"writer_centering": "op"}, "layer-scale": {"writer_centering": "auto"}},
              why="per-row weight scales: the writers keep the original's rows behind ops (eager: +8-17% time on "
                  "Whisper tiny.en); auto on LayerScale models keeps ONNX Runtime's per-tensor gain too",
              measured="Whisper tiny.en 1.044 (10 paired draws; 1.01-1.08 over pairs: its decoder writers' "
                       "integers) → op 1.002 (8); DINOv2-small op 0.98, auto 1.02"),
    Quantizer("executorch-dynamic", "ExecuTorch XNNPACK int8", _kinds({"writer_centering": "auto"}, _PRE_LN),
              why="dynamic int8: ops after the writers a LayerScale scales or whose rows centering widens",
              measured="DINOv2-small 1.03 → auto 0.98 (8 paired draws)"),
    Quantizer("executorch-static", "ExecuTorch XNNPACK int8",
              why="static int8: the defaults; keep the norms float in the quantizer (its annotation, not convert)",
              measured="DINOv2-small with the norms float 1.03"),
    Quantizer("pt2e-x86-static", "PyTorch's own int8: PT2E `X86InductorQuantizer` + `torch.compile`",
              why="static (the quantizer's default): the defaults",
              measured="DINOv2-small 1.018, MiniLM 0.998"),
    Quantizer("pt2e-x86-dynamic", "PyTorch's own int8: PT2E `X86InductorQuantizer` + `torch.compile`",
              {"layer-scale": {"writer_centering": "auto"}},
              why="dynamic: ops after a LayerScale model's writers (compiled: +1-4% time, DINOv2-small); the "
                  "defaults elsewhere",
              measured="DINOv2-small 1.088 on one compiled run (a draw: 0.980 eager on its crops, 1.001 over 8 "
                       "paired draws) -> auto 0.984 compiled, 0.974 over the draws; MiniLM 0.976 with the defaults"),
    Quantizer("weights-only", "optimum-quanto, bitsandbytes, HQQ, GGUF (weights rounded in Python)",
              why="weights rounded in Python: the defaults (every β kept in a checkpoint)",
              measured="DINOv2-small 0.84-1.03; Whisper tiny.en's decoder GGUF Q8_0 0.990 (0.96-1.03, 17 paired "
                       "draws; 1.075 as shipped was a draw)",
              avoid={"--rotate": "rotation costs the Python 4-bit engines (1.08-1.79)"}),
)}
QUANTIZER_NAMES = tuple(QUANTIZERS)


def get(name: str) -> Quantizer:
    """The entry named ``name`` (a one-line error listing the names otherwise)."""
    if name not in QUANTIZERS:
        raise OptionRefused(f"quantizer must be one of {', '.join(QUANTIZER_NAMES)}, not {name!r}")
    return QUANTIZERS[name]


def format_for(name: str | None, given: str | None) -> str:
    """The checkpoint format ``convert`` writes: ``given`` when the caller gave one, else engine ``name``'s (when
    it needs one), else ``"native"``."""
    if given is not None:
        return given
    return (get(name).format if name is not None else None) or "native"


def flags(options: Mapping[str, Any]) -> str:
    """Options as ``convert`` spells them (``--writer-centering op --no-mean-carry``); ``""`` for none."""
    out = []
    order = ("format", *FIELDS)  # one spelling whatever order the options come in (a manifest sorts its keys)
    for name, value in sorted(options.items(), key=lambda item: order.index(item[0]) if item[0] in order else 99):
        if name == "writer_centering":
            out.append(f"--writer-centering {value}")
        elif name == "per_norm_centering":
            out.append("--per-norm-centering" if value else "")
        elif name == "mean_carry":
            out.append("" if value else "--no-mean-carry")
        elif name == "format":
            out.append(f"--format {value}")
        else:
            raise ValueError(f"no flag for option {name!r}")
    return " ".join(o for o in out if o)


def model_kind(plan: Any) -> str:
    """The kind of model a plan made with the defaults describes (a :class:`normswap.Plan`), from its structured
    records alone: ``post-ln`` where some norm's stream carries another norm's output that the norm must cancel the
    mean of on its own (``SitePlan.stream_kind == "post-ln"``, whatever the norm's verdict: exact by a mean carry,
    exact by an op before it, approximate for any reason; or a mean carry in the plan), else ``layer-scale`` where
    a LayerScale λ scales a writer (``plan.scale_folds``), else ``pre-ln``. A stream that starts at a norm's output
    only norms read (BLOOM's embedding LayerNorm, CLIP's pre-LayerNorm: ``"norm-start"``) is Pre-LN. Never from a
    reason's words, which say one problem of a norm and may change. A plan from a manifest written before round 61
    (no ``stream_kind``) is refused (``ValueError``): its kind is unknown, not Pre-LN."""
    unknown = [sp.name for sp in plan.sites if sp.verdict != "skipped" and not sp.stream_kind]
    if unknown:
        raise ValueError(f"the plan records no stream kind for {len(unknown)} norm(s) (`{unknown[0]}`, ...): a "
                         "manifest written before round 61; plan the model again to find its kind")
    if plan.mean_carries or any(sp.stream_kind == "post-ln" for sp in plan.sites):
        return "post-ln"
    return "layer-scale" if plan.scale_folds else "pre-ln"


def resolve(name: str, kind: str, given: Mapping[str, Any], overrides: Collection[str]) -> dict[str, Any]:
    """What engine ``name`` does on a model of ``kind``, as the manifest records it (``plan.options["quantizer"]``):
    ``{"name", "model", "set": {field: value}, "kept": {field: the caller's value}, "format"}``. ``given``: the
    caller's values of :data:`FIELDS`; ``overrides``: the fields the caller set (they keep the caller's value)."""
    q = get(name)
    wanted = q.options_for(kind)
    set_ = {k: v for k, v in wanted.items() if k not in overrides}
    kept = {k: given[k] for k in wanted if k in overrides and given[k] != wanted[k]}
    return {"name": name, "model": kind, "set": set_, "kept": kept, "format": q.format}


def planner_values(record: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`FIELDS` values the plan is made with: the caller's, with the engine's where it sets them."""
    return {**{k: given[k] for k in FIELDS}, **record["set"]}


def check_combination(name: str, overrides: Collection[str], *, rotate: str | None = None,
                      format: str | None = None, low_memory: bool | None = None) -> None:  # noqa: A002
    """Refuse (one line, :class:`~normswap.errors.OptionRefused`, exit 2) what engine ``name``'s options cannot go
    with, before anything is loaded: writer ops with a rotation that turns streams, a native checkpoint for an
    engine that reads only the stock architecture, ``low_memory=True`` where every Pre-LN model needs
    ``writer_centering="auto"`` (a Post-LN model's per-norm ops and a LayerScale model's ``auto`` need the whole
    model too: refused once the streamed plan finds that kind, :func:`check_streamed`). ``overrides``: the fields
    the caller set (those keep the caller's value, so they conflict with nothing here)."""
    q = get(name)
    writer = sorted(q.sets("writer_centering") - {"weights"})
    if writer and "writer_centering" not in overrides and rotate not in (None, "none"):
        ops = " or ".join(f"writer_centering='{w}'" for w in writer)
        raise OptionRefused(f"quantizer='{name}' centers writers by ops ({ops}), which "
                            f"rotate='{rotate}' cannot fold its rotation into: drop the rotation, or pass "
                            "writer_centering='weights' to override the engine's choice")
    if q.format == "compat" and format == "native" and not q.native:
        raise OptionRefused(f"quantizer='{name}' needs format='compat' ({q.why}); drop format='native'")
    pre_ln = [q.options_for(kind).get("writer_centering") for kind in ("pre-ln", "layer-scale")]
    if low_memory and "writer_centering" not in overrides and pre_ln == ["auto", "auto"]:
        raise OptionRefused(f"quantizer='{name}' sets writer_centering='auto', which chooses each writer's "
                            "centering from its own weights, and low_memory=True plans without them: drop "
                            "low_memory=True, or pass writer_centering='op' or writer_centering='weights' to "
                            "override the engine's choice")


def check_streamed(record: Mapping[str, Any]) -> None:
    """Refuse, for the streamed (low-memory) conversion, an engine whose options for the kind found need the whole
    model: ``writer_centering="auto"`` (chosen from each writer's weights) or per-norm centering ops."""
    values = record["set"]
    need = [f"writer_centering='{v}'" if k == "writer_centering" else f"{k}=True"
            for k, v in values.items() if (k, v) in (("writer_centering", "auto"), ("per_norm_centering", True))]
    if need:
        raise OptionRefused(f"quantizer='{record['name']}' sets {' and '.join(need)} on a "
                            f"{KIND_LABELS[record['model']]} model, which needs the whole model in memory: pass "
                            "low_memory=False, or set the option yourself to override the engine's choice")


def describe(record: Mapping[str, Any], written: str | None = None) -> str:
    """One line from a manifest's record: the engine, the kind found, what it set, what the caller kept
    (``written``: the checkpoint's format, when known)."""
    q = QUANTIZERS.get(record.get("name", ""))
    kind = KIND_LABELS.get(record.get("model", ""), record.get("model", "?"))
    set_ = dict(record.get("set") or {})
    kept = dict(record.get("kept") or {})
    fmt = record.get("format")
    if fmt and written and written != fmt:
        kept["format"] = written
    elif fmt:
        set_["format"] = fmt
    text = f"{record.get('name')} on a {kind} model: " + (f"set {flags(set_)}" if set_ else "the defaults")
    if kept:
        text += f"; yours kept over the engine's: {flags(kept) or 'the defaults'}"
    if q is not None:
        text += f" ({q.why})"
    return text


def markdown_table() -> str:
    """The docs table (``docs/deployment.md``, "At a glance"): one row per engine, its options per model kind, and
    the measured cell. A test holds the page's copy to this."""
    lines = ["| `--quantizer` | engine | Pre-LN | Pre-LN with LayerScale | Post-LN encoder | measured (error / "
             "original's) |", "|---|---|---|---|---|---|"]
    for q in QUANTIZERS.values():
        cells = []
        for kind in KINDS:
            opts = {**({"format": q.format} if q.format else {}), **q.options_for(kind)}
            cells.append(f"`{flags(opts)}`" if opts else "defaults")
        lines.append(f"| `{q.name}` | {q.row} | {' | '.join(cells)} | {q.measured or '-'} |")
    return "\n".join(lines)
