"""From dataflow facts to a :class:`~normswap.analysis.plan.Plan`: verdicts, edits and what the readers take.

:mod:`normswap.analysis` answers questions about the traced graph (who writes a stream, can a
writer be centered, where could a centering op sit, can the MLP carry a mean, who reads a norm).
:func:`analyse` asks them for every norm and turns the answers into the plan: the verdict and its
reason, the writer edits, unties and centering ops, and for each norm's readers what they can take:
β and γ folds (β dropped at keys or moved through values where :mod:`normswap.analysis.attention` proves it),
``fold_gamma`` on already-RMS norms, readers of approximate norms made blind to the leaked mean
(:class:`~normswap.analysis.plan.CenteredReader`), and whether the stream can be rotated.

:func:`analyse` is a sequence of named steps (writers, their centering, centering ops, committed edits,
readers, then each norm's verdict, folds and rotation, then the plan's global lists) that share one
:class:`Planning`: each step reads what the earlier ones decided there and adds its own answers.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from normswap.analysis.attention import Route
from normswap.analysis.linears import LinearView
from normswap.analysis.plan import (
    EXACT_VERDICTS,
    GAMMA_KEPT,
    RESIDUAL_HINT,
    BetaMove,
    BiasSlot,
    CenteredReader,
    CenterHook,
    FoldEdit,
    MeanCarry,
    Plan,
    ResidualFold,
    RmsFold,
    ScaleFold,
    SitePlan,
    Untie,
    WriterEdit,
    beta_text,
)
from normswap.analysis.residual import residual_writers
from normswap.analysis.streams import OUTPUT_AXIS, Analyzer, Reach, Term, mutated_parameters, writer_kind
from normswap.analysis.trace import Graph, ModuleCall
from normswap.analysis.walker import NormSite, SkippedNorm
from normswap.errors import NormswapError


def _site_plan(site: NormSite) -> SitePlan:
    return SitePlan(name=site.path, class_name=site.class_name, verdict="", reason="",
                    normalized_shape=list(site.normalized_shape), param_shape=list(site.param_shape),
                    eps=site.eps, flavour=site.flavour, extra_args=site.extra_args,
                    returns=dict(site.returns))


def _rms_folds(an: Analyzer, rms_norms: list[SkippedNorm], site_reader_paths: set[str]) -> list[RmsFold]:
    """``fold_gamma`` on already-RMS norms: γ moves into the Linear readers where every reader reads
    this norm alone, on every call, and nothing else reads the norm's output."""
    folds = []
    for norm in rms_norms:
        if norm.weight_attr is None or norm.bias_attr is not None:
            continue
        calls = an.calls_per_path.get(norm.path, [])
        readers: dict[str, set[int]] = {}
        ok = bool(calls)
        for call in calls:
            rcalls, other = an.readers(call)
            if other or not rcalls:
                ok = False
                break
            for rc in rcalls:
                readers.setdefault(rc.path, set()).add(rc.id)
        if not ok:
            continue
        if any(p in site_reader_paths or readers[p] != {c.id for c in an.calls_per_path[p]}
               or an.sharing_problem(an.weight_param(p), p) is not None for p in readers):
            continue
        paths = sorted(readers)
        folds.append(RmsFold(norm.path, f"{norm.path}.{norm.weight_attr}", norm.offset, paths,
                             [writer_kind(an.modules[p]) for p in paths]))
    taken: dict[str, int] = {}
    for f in folds:  # a Linear reading two RMS norms takes neither
        for p in f.readers:
            taken[p] = taken.get(p, 0) + 1
    return [f for f in folds if all(taken[p] == 1 for p in f.readers)]


def _is_head(an: Analyzer, call: ModuleCall) -> bool:
    """Does norm ``call``'s output reach no other norm's input (an LM or classifier head's norm)?"""
    out = an.site_output.get(call.id)
    others = {an.site_input[c.id] for c in an.site_calls if c.id != call.id and an.site_input[c.id] is not None}
    return out is not None and an.behind(out, set(), others)


@dataclass
class Planning:
    """The state :func:`analyse`'s steps share: the analyzer, the plan being built, and what each step
    decided about the norms' writers, centering ops and readers, for the steps after it."""

    an: Analyzer
    plan: Plan  # the result: each step appends its sites and edits
    per_norm_centering: bool  # may a centering op sit before each Post-LN norm (opt-in)
    mean_carry: bool  # may an MLP be widened to cancel a Post-LN mean
    carry_multiple: int  # a widened MLP's width is padded to a multiple of this
    stem_centering: str = "op"  # a stream start a quantized weight writes: centered by an op or by its weights
    writer_centering: str = "weights"  # a quantized writer inside the layers: centered by its weights or by an op
    site_terms: dict[int, list[Term]] = field(default_factory=dict)  # norm call -> the terms of its input
    module_ok: dict[str, str | None] = field(default_factory=dict)  # writer module -> why no edit centers it, or None
    # term value -> (centered by surgery, why not)
    term_status: dict[int, tuple[bool, str]] = field(default_factory=dict)
    term_edits: dict[int, tuple[list[WriterEdit], list[Untie]]] = field(default_factory=dict)  # what centers a term
    hooks: dict[int, tuple[CenterHook, Reach]] = field(default_factory=dict)  # hooked value -> (op, its reach)
    chained: dict[int, str] = field(default_factory=dict)  # term value -> module of the stream-start op it follows
    unhooked: dict[int, str] = field(default_factory=dict)  # stream-start norm output -> why no op centers it
    edits: dict[str, WriterEdit] = field(default_factory=dict)  # committed writer edits, by target parameter
    unties: dict[tuple[str, str], Untie] = field(default_factory=dict)  # (module, attr) -> the untie it needs
    # norm -> (its Linear readers, its other readers: described, e.g. "model output `x`")
    site_readers: dict[str, tuple[set[str], list[str]]] = field(default_factory=dict)
    reader_sources: dict[str, set[str]] = field(default_factory=dict)  # Linear reader -> the norms it reads
    reader_calls: dict[str, set[int]] = field(default_factory=dict)  # Linear reader -> its calls that read a norm
    carried_mlps: set[str] = field(default_factory=set)  # MLP up-projections already widened for one mean
    # do several norms inside the layers each need an op that serves them alone (one op per norm: opt-in)
    one_norm_ops: bool = False
    # norm -> why its stream does not turn: planned as without ``fold_gamma`` (a rotation folds γ only where it turns)
    keep_gamma: dict[str, str] = field(default_factory=dict)
    # stem writer term value -> its weight edits' status, restored where no op can take its place (_stem_ops)
    stem_terms: dict[int, tuple[bool, str]] = field(default_factory=dict)
    # writer term value -> its weight edits' status, restored where no op can take its place (_writer_ops)
    writer_terms: dict[int, tuple[bool, str]] = field(default_factory=dict)
    # embedding table term value -> its weight edits' status, restored where its norm takes no op (_table_ops)
    table_terms: dict[int, tuple[bool, str]] = field(default_factory=dict)
    table_ops: set[int] = field(default_factory=set)  # the hooked values of the tables' ops (_place_table_ops)
    # norm output value -> how many norm calls sum it into their input (_post_ln_term, filled on first use)
    norm_term_calls: dict[int, int] | None = None

    def folds_gamma(self, path: str) -> bool:
        """Is ``fold_gamma`` asked for this norm? (asked, and its stream not one the rotation leaves alone)"""
        return self.an.fold_gamma and path not in self.keep_gamma

    def centered_by_op(self, value: int) -> bool:
        """Is ``value`` downstream of a centering op already placed?"""
        return any(value in reach.mapped for _, reach in self.hooks.values())


@dataclass
class SiteStream:
    """What the writers of one norm's input come to, over all its calls."""

    calls: list[ModuleCall]
    writers: list[str] = field(default_factory=list)  # each writer's module path or label, once per call
    targets: set[str] = field(default_factory=set)  # writer-edit targets that center this stream
    centered_by: list[CenterHook] = field(default_factory=list)  # the ops that center the other terms
    problems: list[Term] = field(default_factory=list)  # terms neither an edit nor an op centers
    problem_calls: dict[int, list[Term]] = field(default_factory=dict)  # call id -> its problem terms


def analyse(model: nn.Module, graph: Graph, sites: list[NormSite], *, untie: bool | None = True,
            fold_gamma: bool = False, per_norm_centering: bool = False,
            rms_norms: list[SkippedNorm] | None = None, mean_carry: bool = True, carry_multiple: int = 8,
            bias_slots: bool = False, layer_scale: str = "keep", keep_gamma: dict[str, str] | None = None,
            stem_centering: str = "op", writer_centering: str = "weights", mode: str = "all") -> Plan:
    """Derive writers, readers, centering ops and a verdict for every NormSite.

    Verdict policy for centering ops: one op where a stream *starts* (its value depends on no
    LayerNorm output: an embedding LayerNorm, a conv stem, a regenerated table) keeps the norms
    exact (``exact-with-centering``). A stream written by another norm's output (Post-LN) would
    need a mean subtraction before every norm, which is LayerNorm by another name: such norms are
    ``approximate`` unless ``per_norm_centering=True`` asks for those ops, and then their verdict
    is ``exact-with-per-norm-centering``, counted apart.

    ``mean_carry``: where a Post-LN stream is ``h + MLP(h)`` (BERT's FFN-output norms), widen the
    MLP by a few neurons that cancel ``mean(h)`` (see :class:`normswap.analysis.plan.MeanCarry`), making
    that norm exact instead of approximate; the widened width is padded to a multiple of ``carry_multiple``.

    ``bias_slots`` (with ``fold_gamma``): a bias-less Linear reader whose share of β has nowhere else to go
    gets a bias (:class:`normswap.analysis.plan.BiasSlot`), so β leaves the norm instead of staying there as β/γ.

    ``layer_scale``: ``"keep"`` marks every LayerScale fold ``keep`` (λ rebalanced and kept after centering,
    so the writer keeps the original's ranges); ``"fold"`` leaves λ at 1.

    ``stem_centering``: ``"op"`` centers a stream whose start a Linear or conv writes (a patch or input
    projection: a weight quantizers round) by one op where the stream starts, the writer's weights left as
    they are (:func:`_stem_ops`); ``"weights"`` centers that writer's weights as any other's.

    ``writer_centering``: ``"op"`` keeps the weights of every writer inside the layers that weight quantizers round
    (a Pre-LN block's attention output projection and MLP down projection) and centers its output by one op
    right after it, LayerScale included (:func:`_writer_ops`); ``"weights"`` (default) centers those writers'
    weights.

    ``keep_gamma`` (with ``fold_gamma``): ``{norm: why its stream does not turn}``. Those norms (converted or
    RMS from the start) are planned as without ``fold_gamma``: γ stays in the norm, β goes where the β
    placement puts it, no bias slot is made for them, and their ``rotation_reason`` says why. A rotation
    asks for the fold only where it turns the stream (``normswap.rotation.rotate.unturned_norms``); the plan
    records the map as ``options["gamma_kept"]``.

    ``mode`` (``"auto"``, ``"exact"`` or ``"all"``, as ``ConvertOptions.mode``): which norms will convert (exact ones
    always, approximate ones in auto/all). Writers are centered, and centering ops kept, only for streams some
    converted norm reads (:func:`_center_for_converted`): with ``"exact"``, a writer whose streams only norms kept as
    LayerNorm read keeps the original's weights.

    The steps run in this order because each needs the previous ones' answers: centering ops are
    placed only for terms no weight edit centers, writer edits are committed only once the ops are
    known (an op may make one redundant), and a norm's verdict needs both its writers and its ops.
    """
    _refuse_parameter_writes(graph)
    an = Analyzer(model, graph, sites, untie=untie, fold_gamma=fold_gamma)
    an.bias_slots = bias_slots and fold_gamma
    st = Planning(an, Plan(options={"untie": untie, "fold_gamma": fold_gamma,
                                    "per_norm_centering": per_norm_centering, "mean_carry": mean_carry,
                                    "carry_multiple": carry_multiple, "bias_slots": an.bias_slots,
                                    "layer_scale": layer_scale, "stem_centering": stem_centering,
                                    "writer_centering": writer_centering}),
                  per_norm_centering=per_norm_centering, mean_carry=mean_carry, carry_multiple=carry_multiple,
                  stem_centering=stem_centering, writer_centering=writer_centering,
                  keep_gamma=dict(keep_gamma or {}) if fold_gamma else {})
    if st.keep_gamma:
        st.plan.options["gamma_kept"] = dict(sorted(st.keep_gamma.items()))
    _find_writers(st)
    _center_writers(st)
    _stem_ops(st)
    _table_ops(st)
    _writer_ops(st)
    _place_centering_ops(st)
    _commit_writer_edits(st)
    _find_readers(st)
    for path, site in an.sites.items():
        st.plan.sites.append(_plan_site(st, path, site))
    _center_for_converted(st, mode)
    st.plan.writer_edits = sorted(st.edits.values(), key=lambda e: e.target)
    _plan_rms_norms(st, rms_norms or [])
    _plan_lists(st)
    return st.plan


def _refuse_parameter_writes(graph: Graph) -> None:
    """A model that writes its own parameters during forward cannot be planned: normswap edits each
    weight once, and the model would then rescale the edited weights again."""
    mutated = mutated_parameters(graph)
    if mutated:
        name, op = mutated[0]
        raise NormswapError(
            f"the model changes parameter `{name}` in place during its forward pass (`{op}`): normswap "
            "edits each weight once, and the model would then rescale the edited weights again (RWKV "
            "does this in eval mode unless config.rescale_every = 0)")


def _find_writers(st: Planning) -> None:
    """The terms summed into every norm call's input (``st.site_terms``), and the modules that write some
    norm's input stream (``an.stream_writers``, which the centering questions consult)."""
    an = st.an
    for call in an.site_calls:
        vid = an.site_input[call.id]
        st.site_terms[call.id] = an.leaves(vid) if vid is not None else []
        an.stream_writers |= {t.module_path for t in st.site_terms[call.id] if t.kind == "module"}


def _center_writers(st: Planning) -> None:
    """Can weight surgery center each term, and with which edits? (``st.term_status``, ``st.term_edits``.)

    A module term is asked once per module (every call of it shares its weights); a parameter term on
    its own; any other term (a norm's output, an op no weight feeds) is not centered by surgery. The
    edits are committed later (:func:`_commit_writer_edits`), once the centering ops are known.
    """
    an = st.an
    module_edits: dict[str, tuple[list[WriterEdit], list[Untie]]] = {}
    for call in an.site_calls:
        for term in st.site_terms[call.id]:
            if term.value in st.term_status:
                continue
            if term.kind == "module":
                if term.module_path not in st.module_ok:
                    es, us, why = an.module_centering(term.module_path)
                    st.module_ok[term.module_path] = why
                    module_edits[term.module_path] = (es, us) if why is None else ([], [])
                why = st.module_ok[term.module_path]
                st.term_edits[term.value] = module_edits[term.module_path]
            elif term.kind == "param":
                es, why = an.param_centering(term)
                st.term_edits[term.value] = (es if why is None else [], [])
            else:
                st.term_status[term.value] = (False, term.label)
                continue
            st.term_status[term.value] = (why is None, f"{term.label} {why}" if why else "")


# writer kinds whose weights int8/4-bit quantizers round (MatMul/Conv weights); an Embedding's table is a gather,
# which NNCF's int8 weights and ONNX Runtime's dynamic int8 round too: its own rule, _table_ops
_QUANTIZED_WRITERS = ("linear", "conv1d", "conv")
STEM_WHY = "(its weights kept: quantizers round them; stem_centering='op')"


def _stem_ops(st: Planning) -> None:
    """``stem_centering="op"``: mark each stream-start writer whose weights quantizers round as centered by an
    op rather than by its weights (``st.stem_terms``); :func:`_place_centering_ops` then places one op for it
    where its stream starts, and puts the weight edits back where none can sit.

    **Rule: a stream started by a quantized weight is centered by one op, not by that weight.** A stream's
    start writer is a module term whose value is computed from no LayerNorm output (the model's raw input
    through a patch convolution, an audio or time-series input projection), called once. Centering its
    weights is exact, but a quantizer then rounds other weights than the original's, and the mean of their
    rounding error, which the original's first LayerNorm removed, stays in every token of the stream: no
    RMSNorm after it removes a mean (DINOv2-small's patch convolution in per-channel int8,
    ``docs/results/quantization.md``). One op (one mean per token at the stream start) keeps the writer's
    weights as they were and removes that error's mean as the original did. Embedding tables (gathers) and
    streams no such writer starts keep their weight edits here (a table under ``per_norm_centering``:
    :func:`_table_ops`).
    """
    if st.stem_centering != "op":
        return
    an = st.an
    norm_started: set[int | None] | None = None
    for call in an.site_calls:
        for term in st.site_terms[call.id]:
            ok, why = st.term_status[term.value]
            if not ok or term.kind != "module" or term.value in st.stem_terms \
                    or len(an.calls_per_path.get(term.module_path, [])) != 1 \
                    or writer_kind(an.modules[term.module_path]) not in _QUANTIZED_WRITERS \
                    or an.depends_on_norm(term.value):
                continue
            if norm_started is None:  # the norms whose output is itself a term of another norm's input
                norm_started = {t.call for terms in st.site_terms.values() for t in terms if t.kind == "norm"}
            if set(an.reach(term.value, -1).site_rows) & norm_started:
                # the stream ends in a norm whose output starts the stream the blocks read (CLIP's pre-LayerNorm):
                # that stream takes the stream-start op, and a second op before it would be a chain of two
                continue
            st.stem_terms[term.value] = (ok, why)
            st.term_status[term.value] = (False, f"{term.label} {STEM_WHY}")


TABLE_WHY = "(its table kept: weight quantizers round gathered tables too; its norm centers its own input)"


def _table_ops(st: Planning) -> None:
    """Mark each embedding table that starts a stream one norm alone reads (BERT's word, position and token-type
    tables, read by the embeddings' LayerNorm only) as centered by that norm's own op rather than by its rows
    (``st.table_terms``); :func:`_place_table_ops` puts the op on the norm's input, and puts the table's edit back
    where none fits. With every option set, the defaults included (since round 63; under ``per_norm_centering``
    only in round 62).

    **Rule: a table whose stream one norm alone reads keeps its rows.** Centering the rows is exact, but NNCF's
    ``compress_weights`` (int8 asymmetric per row, every ``Gather`` table) and ONNX Runtime's dynamic int8
    (``Gather``) round tables too, and the mean of each centered row's rounding error, which the original's
    LayerNorm removed, then passes through the exact RMSNorm into every token (round 61, the held-out
    paraphrase-MiniLM-L3-v2: NNCF int8 weights 1.19× the original's error with the defaults, 1.24× with
    ``--quantizer openvino-int8``; 1.000× with the tables left in float). The op before that one norm makes it
    compute ``LayerNorm`` itself (``RMSNorm.centers_input``; one op for the model, on the embeddings' stream), and
    the tables' rounding error then reaches the model as in the original: the default's NNCF int8 cell 1.189 →
    1.001 on that model (round 62/63, ``docs/results/quantization.md``). A table whose stream reaches several norms
    (GPT-2's, a Pre-LN tower's) keeps its edit: an op there would be a stream-start op. Nor does a table whose
    norm's output starts a stream several norms share (BLOOM's and RWKV's embedding LayerNorm): that stream's op
    sits after the norm, and one before it too would be a chain of two.

    Not where γ is folded (``fold_gamma``, or a rotation, which folds it on the streams it turns) unless
    ``per_norm_centering`` asks for the ops anyway: a stream centered by an op before its norm is one a rotation
    leaves unturned ("one rotation op per norm"), so the tables keep their edit there, as before round 63, and
    BERT's embedding stream still turns."""
    an = st.an
    if an.fold_gamma and not st.per_norm_centering:
        return
    # norms whose output starts a stream several norms share (BLOOM's, RWKV's embedding LayerNorm): that stream
    # takes its own op where it starts, and an op before the norm too would be a chain of two
    starts_shared_stream = {t.call for terms in st.site_terms.values() for t in terms
                            if t.kind == "norm" and not _post_ln_term(st, t)}
    for call in an.site_calls:
        if call.id in starts_shared_stream:
            continue
        for term in st.site_terms[call.id]:
            ok, why = st.term_status[term.value]
            if not ok or term.kind != "module" or term.value in st.table_terms or term.value in st.stem_terms \
                    or writer_kind(an.modules[term.module_path]) != "embedding" or an.depends_on_norm(term.value):
                continue
            if {an.graph.calls[c].path for c in an.reach(term.value, -1).site_rows} != {call.path}:
                continue  # its stream reaches other norms too: one op before this norm would not serve them
            st.table_terms[term.value] = (ok, why)
            st.term_status[term.value] = (False, f"{term.label} {TABLE_WHY}")


def _place_table_ops(st: Planning) -> None:
    """The tables' ops (:func:`_table_ops`): one on the input of the norm each table's stream reaches, shared by
    every table of that stream (per norm, as ``per_norm_centering``'s Post-LN ops); a table whose norm takes no
    op on its own input (it normalises more than the last axis) keeps its edit, and so, without
    ``per_norm_centering``, does one whose norm's output takes a stream-start op (:func:`_output_op_first`)."""
    an = st.an
    for call in an.site_calls:
        for term in st.site_terms[call.id]:
            if term.value not in st.table_terms:
                continue
            vid = an.site_input.get(call.id)
            if vid in st.table_ops:
                continue  # another table of the same stream placed it
            if not st.per_norm_centering and _output_op_first(st, call):
                for t in st.site_terms[call.id]:  # every table of this norm: centered by its rows, as before
                    if t.value in st.table_terms:
                        st.term_status[t.value] = st.table_terms.pop(t.value)
                break
            spot = next((h for v, h in an.hook_candidates(term, at_norms=True)
                         if v == vid and h.where == "input" and h.module == call.path), None)
            reach = an.own_input_reach(vid, call) if spot is not None else None
            if reach is None or call.id not in reach.site_rows:
                st.term_status[term.value] = st.table_terms.pop(term.value)  # centered by its rows after all
                continue
            spot.reason = (f"stream written by embedding tables ({term.label} first): one mean per token before this "
                           "norm, which reads that stream alone; the tables keep their rows (weight quantizers "
                           "round gathered tables too)")
            spot.per_norm = True
            st.hooks[vid] = (spot, reach)
            st.table_ops.add(vid)


def _output_op_first(st: Planning, call: ModuleCall) -> bool:
    """Without ``per_norm_centering``: does the output of the tables' norm ``call`` take a stream-start op (the
    text embeddings' norm of LayoutLMv3, whose output only the model's top norm sums, beside the image tower's
    norm)? That op is placed here, as the defaults placed it before the tables' rule (round 62), and the tables
    keep their edit: an op before the norm as well would make the output's op a second one on the same stream,
    which only ``per_norm_centering`` places, and the top norm would stay approximate. Where no such op can sit
    (BERT's embeddings' norm, whose output the first block reads beside its attention) nothing is recorded and
    the tables' op is placed."""
    an = st.an
    chained, unhooked = dict(st.chained), dict(st.unhooked)
    for other in an.site_calls:
        for term in st.site_terms[other.id]:
            if term.kind != "norm" or term.call != call.id or st.term_status[term.value][0] \
                    or st.centered_by_op(term.value) or _needs_op_per_norm(st, term):
                continue
            lone = _lone_head_term(st, other, term)
            if any(_place_op(st, other, term, at_norms, lone) for at_norms in ([False, True] if lone else [False])):
                return True
    for kept, now in ((chained, st.chained), (unhooked, st.unhooked)):  # a failed try leaves no trace in the plan
        now.clear()
        now.update(kept)
    return False


def _table_op_serves(st: Planning, term: Term) -> bool:
    """Does a table's op (:func:`_place_table_ops`) already center every norm call ``term`` reaches? (A tied word
    table, which no weight edit centers, then needs no op of its own: the op on its norm's input centers it.)"""
    calls = st.an.reach(term.value, -1).site_rows
    served = {c for vid in st.table_ops for c in st.hooks[vid][1].site_rows}
    return bool(calls) and all(c in served for c in calls)


WRITER_WHY = "(its weights kept: quantizers round them; writer_centering='op')"
# writer_centering="auto": a writer whose centering would widen some output row's max|w| more than this (a per-row
# weight grid's step on that row more than doubled: one bit of its int8 grid lost) keeps its weights behind an op
WRITER_AUTO_WIDENING = 2.0


def _writer_ops(st: Planning) -> None:
    """``writer_centering="op"``: mark each writer inside the layers whose weights quantizers round (a Linear or
    conv whose output is computed from a norm's output, called once: a Pre-LN block's attention output
    projection, its MLP down projection) as centered by an op rather than by its weights (``st.writer_terms``);
    :func:`_place_writer_ops` then places one op right after it, where its write is complete (after a LayerScale).
    ``"auto"``: only the writers a LayerScale λ scales, and those whose centering widens some output row's range
    on a per-row grid by more than :data:`WRITER_AUTO_WIDENING` (:func:`centering_widening`; every writer's figure
    in ``plan.options["writer_widening"]``); the others are centered by their weights.

    Centering those writers' weights is exact, but a per-row weight quantizer (torchao's int8, NNCF's int8
    weights, LLM.int8) then rounds the rows ``W_i − m`` instead of the original's ``W_i``, and RMSNorm, unlike the
    original's LayerNorm, does not remove the mean of their rounding error. With the op the writer keeps the
    original's weights and the op removes that mean as the original's next LayerNorm did. One op per writer
    (two per Pre-LN block): opt-in, for the engines where it pays. Why ``"auto"`` takes every LayerScale writer,
    not only the ones whose rows widen (round 52, DINOv2-small): ops after those 4 of its 24 writers alone fix
    the float simulation of a per-row grid (1.33× → 0.96×) but neither torchao (1.09×) nor NNCF's int8 weights
    (1.17×); ops after all 24 do (1.02×, ~1.0×). A writer without LayerScale (GPT-2, Whisper, BERT) keeps its
    weight edit unless its rows widen: no op, no cost, where no engine was measured to pay for the edit.
    """
    if st.writer_centering not in ("op", "auto"):
        return
    an = st.an
    widening: dict[str, float] = {}
    scaled = {path for _, path, _, _ in an.layer_scales.values()}  # writers a LayerScale λ scales
    for call in an.site_calls:
        if st.mean_carry and any(t.kind == "norm" and not st.term_status[t.value][0] and _mlp_carries_mean(st, call, t)
                                 for t in st.site_terms[call.id]):
            # a Post-LN stream whose MLP carries a norm's mean (BERT's FFN-output norms): the carry's added
            # neurons write that mean through the MLP's writer, and an op after the writer would remove it again
            continue
        for term in st.site_terms[call.id]:
            ok, why = st.term_status[term.value]
            if not ok or term.kind != "module" or term.value in st.writer_terms or term.value in st.stem_terms \
                    or len(an.calls_per_path.get(term.module_path, [])) != 1 \
                    or writer_kind(an.modules[term.module_path]) not in _QUANTIZED_WRITERS \
                    or not an.depends_on_norm(term.value):
                continue
            if st.writer_centering == "auto":
                if term.module_path not in widening:  # a writer is a term of every norm it reaches: once is enough
                    widening[term.module_path] = centering_widening(an, term.module_path,
                                                                    st.term_edits[term.value][0])
                if not widening[term.module_path] > WRITER_AUTO_WIDENING and term.module_path not in scaled:
                    continue
            st.writer_terms[term.value] = (ok, why)
            st.term_status[term.value] = (False, f"{term.label} {WRITER_WHY}")
    if st.writer_centering == "auto":
        st.plan.options["writer_widening"] = {path: round(w, 3) for path, w in sorted(widening.items())}


def centering_widening(an: Analyzer, path: str, edits: list[WriterEdit]) -> float:
    """How much centering writer ``path``'s weight (``edits``: the plan's edit of it, LayerScale λ folded first as
    the surgery folds it) widens its output rows for a per-row weight grid: the largest over rows of
    ``max|W'_i| / max|W_i|``, ``W_i`` the row (λ folded), ``W'_i`` the same row centered (``inf`` for a zero row
    the centering fills). A per-row int8 grid's step on row ``i`` is ``max|W'_i| / 127``: a row of small λ is
    mostly ``−m`` once centered, and its own signal then sits on a grid sized for the mean row.
    Computed in float64 from the weights alone (no data)."""
    edit = next((e for e in edits if an.model.get_parameter(e.target).dim() >= 2), None)  # the weight, not a bias
    if edit is None:
        return 1.0
    w = an.model.get_parameter(edit.target).detach().double()
    axis = edit.axis % w.dim()
    lam = next((an.model.get_parameter(param).detach().double().flatten() + offset
                for param, writer, _, offset in an.layer_scales.values() if writer == path), None)
    if lam is not None and lam.numel() == w.shape[axis]:
        shape = [1] * w.dim()
        shape[axis] = -1
        w = w * lam.reshape(shape)
    centered = w.clone()
    for lo, hi in edit.blocks or [(0, w.shape[axis])]:
        part = centered.narrow(axis, lo, hi - lo)
        part.sub_(part.mean(axis, keepdim=True))
    rows = w.movedim(axis, 0).reshape(w.shape[axis], -1).abs().amax(1)
    crows = centered.movedim(axis, 0).reshape(w.shape[axis], -1).abs().amax(1)
    ratio = torch.where(rows > 0, crows / rows.clamp_min(1e-300),
                        torch.where(crows > 0, torch.full_like(rows, float("inf")), torch.ones_like(rows)))
    return float(ratio.max()) if ratio.numel() else 1.0


def _place_writer_ops(st: Planning) -> None:
    """The writers' ops (:func:`_writer_ops`): each at the first place after its writer that centers every norm
    it reaches: the writer's output, or, for a writer scaled by a LayerScale λ, the product's (an op before the
    product would center the writer's output, not what ``λ ⊙`` it adds); a writer no op can serve keeps its
    weight edits.

    A writer whose every path to a norm already passes an op placed for another term (ModernBERT's first layer:
    the op on the residual sum ``x + attn(x)``, installed on the attention module, centers what its output
    projection adds too) takes no op of its own: a second op on the same module's output would run after the
    sum's and undo it (the sum's op leaves the output minus the stream's mean, the writer's then subtracts that
    output's own mean). It is centered by its weights in the plan, and :func:`_commit_writer_edits` leaves a
    writer behind an op as it is: the original's weights, as the option asks."""
    scaled = {path: index for index, (_, path, _, _) in st.an.layer_scales.items()}
    for call in st.an.site_calls:
        for term in st.site_terms[call.id]:
            if term.value not in st.writer_terms or st.centered_by_op(term.value):
                continue
            others = {v for v, (h, _) in st.hooks.items() if not h.writer}
            if others and st.an.behind(term.value, others):
                st.term_status[term.value] = st.writer_terms.pop(term.value)  # the op ahead of it centers it
                continue
            if not _place_op(st, call, term, False, False, after=scaled.get(term.module_path)):
                st.term_status[term.value] = st.writer_terms.pop(term.value)  # centered by its weights after all


def _place_centering_ops(st: Planning) -> None:
    """One centering op (``st.hooks``) for each term surgery cannot center, where the policy allows one.

    A stream-start op is tried first; a term that needs an op before each norm (Post-LN, or a second
    op on a stream one already centers) gets one only with ``per_norm_centering``, and not where an
    MLP can carry its mean instead (a real RMSNorm beats a centering op). A lone head term may take
    its op right at its norm's input (:func:`_lone_head_term`).
    """
    inner = {call.path for call in st.an.site_calls for term in st.site_terms[call.id]
             if not st.term_status[term.value][0] and term.kind != "norm" and term.value not in st.stem_terms
             and term.value not in st.writer_terms and term.value not in st.table_terms
             and _reaches_one_norm(st, term)}
    # one such norm is one op for the model (wav2vec2's conv feature extractor, GELU, then its projection
    # norm); one per block (NormFormer's mid-MLP norms, ConvNeXt's block norms) is LayerNorm by another name
    st.one_norm_ops = len(inner) >= 2
    _place_table_ops(st)
    for call in st.an.site_calls:
        for term in st.site_terms[call.id]:
            if st.term_status[term.value][0] or st.centered_by_op(term.value) or term.value in st.stem_terms \
                    or term.value in st.writer_terms or term.value in st.table_terms:
                continue
            if st.table_terms and term.kind != "norm" and _table_op_serves(st, term):
                continue  # a tied table beside centered ones: the tables' op on its norm's input centers it too
            per_norm = _needs_op_per_norm(st, term)
            if per_norm and not st.per_norm_centering:
                continue
            if per_norm and st.mean_carry and _mlp_carries_mean(st, call, term):
                continue
            lone = not per_norm and _lone_head_term(st, call, term)
            tries = [False, True] if (st.per_norm_centering or lone) and not per_norm else [per_norm]
            for at_norms in tries:
                if _place_op(st, call, term, at_norms, lone):
                    break
    _place_stem_ops(st)
    _place_writer_ops(st)


def _place_stem_ops(st: Planning) -> None:
    """The stem writers' ops (:func:`_stem_ops`), placed after every op a term surgery cannot center needs, so
    that a stem op never takes the one-op-per-stream place such a term needs (which would make its norms
    approximate). A stem writer whose stream already has an op keeps its weight edits (where that op is
    downstream of it, the rule of :func:`_commit_writer_edits` then leaves it as it is); one that no op can
    serve does too."""
    an = st.an
    for call in an.site_calls:
        for term in st.site_terms[call.id]:
            if term.value not in st.stem_terms:
                continue
            reached = set(an.reach(term.value, -1).site_rows)
            shared = st.centered_by_op(term.value) or any(reached & set(r.site_rows) for _, r in st.hooks.values())
            if shared or _needs_op_per_norm(st, term) or not _place_op(st, call, term, False, False, latest=True):
                st.term_status[term.value] = st.stem_terms.pop(term.value)  # centered by its weights after all


def _needs_op_per_norm(st: Planning, term: Term) -> bool:
    """Would centering ``term`` take an op before each norm it reaches, rather than one where its stream starts?

    A stream written by a norm's output (Post-LN) is not a stream start, unless that norm is the first
    of the model (BLOOM's embedding LayerNorm: its input depends on no norm) or is itself exact by
    weight surgery alone and the only such term of every stream it joins (:func:`_starts_stream`: a
    patch embedding's norm after a Linear or conv that reads another norm, in vit-pytorch and PVT),
    and itself needed no centering op (at most one op per stream, never a chain of them). A term
    computed from a norm's output that joins a stream a stream-start op already centers (RWKV's gated
    feed-forward, block after block) would need a second op on that stream: a chain, one op per
    block (recorded in ``st.chained``).
    """
    an = st.an
    per_norm = term.kind == "norm" and (
        (an.depends_on_norm(term.value) and not _starts_stream(st, term))
        or any(term.call in reach.site_rows for _, reach in st.hooks.values()))
    if term.value in st.chained:  # seen from an earlier norm of the same stream
        return True
    if not per_norm and an.depends_on_norm(term.value):
        start = _stream_start_op_before(st, term)
        if start is not None:
            st.chained[term.value] = start.module
            return True
    return per_norm


def _stream_start_op_before(st: Planning, term: Term) -> CenterHook | None:
    """The stream-start op already placed on a stream ``term`` joins (None when none, or when an op
    is placed further down, on ``term``'s own path)."""
    term_reach = st.an.reach(term.value, -1)
    reached = set(term_reach.site_rows)
    if any(v in term_reach.mapped for v in st.hooks):
        return None
    return next((h for h, reach in st.hooks.values() if not h.per_norm and reached & set(reach.site_rows)), None)


def _mlp_carries_mean(st: Planning, call: ModuleCall, term: Term) -> bool:
    """Can an MLP cancel ``term``'s mean at this norm call (:class:`~normswap.analysis.plan.MeanCarry`)?"""
    shared = sum(c.path == call.path for c in st.an.site_calls)
    return st.an.mean_carry(call, term, st.site_terms[call.id], st.module_ok, shared_calls=shared,
                            multiple=st.carry_multiple) is not None


def _lone_head_term(st: Planning, call: ModuleCall, term: Term) -> bool:
    """Is ``term`` the whole input of the one norm call it reaches, a norm whose output reaches no other
    norm (a head)? Its op may then sit right at that norm's input: one op for the head (fair-esm's LM
    head is dense, a GELU written in ops, then its norm). Not a norm inside the layers (ConvNeXt's
    block norm after its depthwise conv): that would be one op per block, LayerNorm by another name."""
    an = st.an
    return term.kind != "norm" and len(st.site_terms[call.id]) == 1 \
        and set(an.reach(term.value, -1).site_rows) == {call.id} and _is_head(an, call)


def _place_op(st: Planning, call: ModuleCall, term: Term, at_norms: bool, lone: bool, latest: bool = False,
              after: int | None = None) -> bool:
    """Place the first valid centering op for ``term`` that centers this norm call's stream (at the
    norms' inputs when ``at_norms``); ``st.unhooked`` records why a stream start has none. Returns
    whether one was placed.

    ``latest`` (a stem writer's op, :func:`_stem_ops`): the last valid place computed from no norm's output
    instead of the first, i.e. where every writer of the stream's start has been summed (after a ViT's
    class token and position table, not right after its patch convolution): those writers are then behind
    the op and keep their weights too (:func:`_commit_writer_edits`), so the whole start is the original's.

    ``after``: only values computed by op ``after`` or later (a writer's op past its LayerScale product)."""
    an = st.an
    candidates = an.hook_candidates(term, at_norms=at_norms)
    if after is not None:
        candidates = [c for c in candidates if (an.graph.values[c[0]].producer or -1) >= after]
    if latest:  # by value, last first; one value's places keep their order (a module's output before an input)
        def order(c: tuple[int, CenterHook]) -> int:
            producer = an.graph.values[c[0]].producer
            return 1 if producer is None else -producer  # a graph input is no later place than any op's value

        candidates = sorted((c for c in candidates if not an.depends_on_norm(c[0])), key=order)
    for i, (vid, hook) in enumerate(candidates):
        if hook.where == "input" and hook.module in an.sites:
            if hook.module != call.path:
                continue  # another norm's own op: it centers what that norm reads, not this one's stream
            reach = an.own_input_reach(vid, call)  # what this norm reads, not the stream others read too
        else:
            reach = an.hook_valid(vid)
        if reach is not None and hook.where == "residual":
            # a module boundary that centers the same norms wins: an op on a residual sum inside a forward
            # is installed on one addend, and the centered sum rounds twice in half precision where a
            # boundary op centers the sum and rounds once (wav2vec2's `h + pos_conv(h)`, then dropout)
            same = next(((v, h, r) for v, h in candidates[i + 1:] if h.where in ("input", "output")
                         and h.module not in an.sites and (r := an.hook_valid(v)) is not None
                         and r.site_rows.keys() == reach.site_rows.keys()), None)
            if same is not None:
                vid, hook, reach = same
        if reach is None:
            if term.kind == "norm" and not at_norms and not _read_by_linears(st, term):
                # a stream start no op can center: say why (a Swin merge's rows, a conv neck or classifier
                # reading the raw stream: named); a norm output that Linears read directly is Post-LN, said so
                problem = an.hook_problem(vid)
                if not an.reach(vid, -1).blockers or term.value not in st.unhooked:
                    st.unhooked[term.value] = problem
            continue
        if call.id not in reach.site_rows:
            continue  # an op for another norm's stream (CrossViT: one image, two patch embedders)
        if hook.where == "residual" and len({an.graph.calls[c].path for c in reach.site_rows}) < 2:
            continue  # an op on a sum that one norm alone reads is that norm's own-input op (Post-LN: opt-in)
        per_norm = at_norms and not lone
        own = hook.where == "input" and hook.module == call.path
        if st.one_norm_ops and not own and not lone and _serves_one_norm(st, reach) \
                and an.depends_on_norm(term.value):
            # an op whose stream reaches one norm and no other (a NormFormer mid-MLP norm after its GELU,
            # a ConvNeXt-style block norm after its depthwise conv) is one op per norm wherever it sits, at
            # a module boundary or not: so it sits at the norm's own input, opt-in (the at_norms pass),
            # whichever way the code is split into modules
            continue
        hook.reason = (f"stream written by {term.label}: one mean per token before this norm"
                       if per_norm else f"{term.label}'s write" if term.value in st.writer_terms
                       else f"stream starts at {term.label}")
        unedited = st.term_status[term.value][1].removeprefix(term.label).strip()
        if term.value in st.stem_terms:
            hook.reason += ", a weight quantizers round: its weights are kept and this op centers the stream " \
                           "(stem_centering='op')"
        elif term.value in st.writer_terms:
            hook.reason += ", a weight quantizers round: its weights are kept and this op centers what it adds " \
                           "to the stream (writer_centering='op')"
            hook.writer = True
        elif unedited and not per_norm and term.kind in ("module", "param"):
            hook.reason += f", which no weight edit can center ({unedited})"
        hook.per_norm = per_norm
        st.hooks[vid] = (hook, reach)
        return True
    return False


def _serves_one_norm(st: Planning, reach: Reach) -> bool:
    """Does an op with this reach center the input of one norm only (every call of one path), a norm
    whose output reaches other norms (not a head's)? Where the op's value is computed from another
    norm's output (inside the layers, not the model's first op on its raw input), such an op is one per
    norm, like a Post-LN one."""
    calls = [st.an.graph.calls[c] for c in reach.site_rows]
    return len({c.path for c in calls}) == 1 and not any(_is_head(st.an, c) for c in calls)


def _commit_writer_edits(st: Planning) -> None:
    """Record the writer edits (and the unties they need) of every term centered by surgery, except
    for a writer the plan's centering ops already center.

    **Rule: a writer behind a centering op stays as it is.** When every path from a writer's output to
    the norms passes through a stream-start centering op (one the plan inserts anyway, for a term no
    weight edit can center), that op makes the sum zero-mean whatever the writer adds, so centering
    the writer too changes nothing in float64: the writer keeps its original weights, one edit fewer
    (Whisper's encoder position table, added right after the conv+GELU stem; in bf16 this measured
    neutral to slightly worse on real Whisper, docs/results/field.md). A writer (a module: every call
    of it) that reaches some norm past every op keeps its edit. Per-norm ops (``per_norm_centering``)
    count as well: a Post-LN block's attention and FFN output projections, behind the op before their
    norm, keep the original's weights, so a quantizer rounds exactly what it rounds in the original (NNCF's
    int8 weights on all-mpnet-base-v2 with ``mean_carry=False``: 1.056× the original's error with those
    writers centered, whose column means move each row's range). Such a term is then centered by the op:
    ``term_status`` says so, and the verdict step finds the op as for the term that needed it.
    """
    stops = set(st.hooks)
    behind = {v for v, (ok, _) in st.term_status.items() if ok and stops and st.an.behind(v, stops)}
    by_module: dict[str, set[int]] = {}
    for terms in st.site_terms.values():
        for term in terms:
            if term.kind == "module" and term.module_path is not None:
                by_module.setdefault(term.module_path, set()).add(term.value)
    for values in by_module.values():
        if not values <= behind:  # a call of this writer reaches a norm directly: every call keeps its edit
            behind -= values
    for terms in st.site_terms.values():
        for term in terms:
            ok, _ = st.term_status[term.value]
            if term.value in behind:
                st.term_status[term.value] = (False, f"{term.label} (left uncentered: a centering op centers "
                                                     "every stream it reaches)")
                continue
            if not ok:
                continue
            es, us = st.term_edits[term.value]
            for e in es:
                st.edits.setdefault(e.target, e)
            for u in us:
                st.unties.setdefault((u.module, u.attr), u)


KEPT_WHY = "(left uncentered: only norms kept as LayerNorm read its stream)"


def _center_for_converted(st: Planning, mode: str) -> None:
    """Drop the writer edits and centering ops that serve only norms ``mode`` leaves as LayerNorm.

    **Rule: a writer is centered only for a norm that converts.** A norm kept as the original's LayerNorm
    (``mode="exact"`` leaves the approximate ones) computes ``LayerNorm(x − mean x) = LayerNorm(x)``: centering the
    writers of its stream changes nothing it outputs, but it changes the raw stream (a model output) and the
    writers' weights, which quantizers then round differently (NNCF int8 weights on all-mpnet-base-v2 with
    ``--mode exact --no-mean-carry``: 1.056× the original's error with 50 writer tensors centered for the
    Post-LN norms it keeps, docs/results/quantization.md, round 65). So an edit stays only if its target is among
    the writer targets of some converted norm (a Pre-LN stream that one converted norm reads keeps every edit; a
    mean carry's ``down`` writes the stream of the exact norm it serves); a centering op stays only if it reaches
    some converted norm. Nothing changes where every norm the example inputs call converts (``"auto"``, ``"all"``,
    or ``"exact"`` with no approximate norm): approximate norms under ``"all"`` keep their centered writers. The
    verdicts do not change: a kept norm is approximate because of a term no edit centers, and a converted one
    keeps every edit and op of its own stream. A kept norm's ``writer_targets`` keep only the edits that stay.
    """
    def converts(sp: SitePlan) -> bool:
        return sp.verdict in EXACT_VERDICTS or (sp.verdict == "approximate" and mode in ("auto", "all"))

    sites = st.plan.sites
    if all(converts(sp) for sp in sites if sp.verdict != "skipped"):
        return
    needed = {t for sp in sites if converts(sp) for t in sp.writer_targets}
    converted_calls = {c.id for c in st.an.site_calls if converts(st.plan.site(c.path))}
    st.hooks = {v: (h, reach) for v, (h, reach) in st.hooks.items() if set(reach.site_rows) & converted_calls}
    st.edits = {t: e for t, e in st.edits.items() if t in needed}
    unties: set[tuple[str, str]] = set()
    for terms in st.site_terms.values():
        for term in terms:
            ok, _ = st.term_status[term.value]
            if not ok:
                continue
            es, us = st.term_edits[term.value]
            if any(e.target in st.edits for e in es):
                unties |= {(u.module, u.attr) for u in us}
            elif es:
                st.term_status[term.value] = (False, f"{term.label} {KEPT_WHY}")
    st.unties = {k: u for k, u in st.unties.items() if k in unties}
    for sp in sites:
        if not converts(sp):
            sp.writer_targets = [t for t in sp.writer_targets if t in st.edits]


def _find_readers(st: Planning) -> None:
    """The readers of every norm (``st.site_readers``), and for each Linear reader which norms and which
    of its calls read them: a Linear that reads several norms, or reads one on some calls only, takes
    no fold (folding would change its other calls)."""
    for call in st.an.site_calls:
        rcalls, other = st.an.readers(call)
        paths, others = st.site_readers.setdefault(call.path, (set(), []))
        others += other
        for rc in rcalls:
            paths.add(rc.path)
            st.reader_sources.setdefault(rc.path, set()).add(call.path)
            st.reader_calls.setdefault(rc.path, set()).add(rc.id)


def _plan_site(st: Planning, path: str, site: NormSite) -> SitePlan:
    """One norm's :class:`SitePlan`: its verdict and reason, what folds into its readers (or, for an
    approximate norm, which readers are made blind to the mean it leaks), and whether its stream
    can be rotated."""
    calls = [c for c in st.an.site_calls if c.path == path]
    sp = _site_plan(site)
    if not calls:
        sp.verdict, sp.reason = "skipped", "not called by the example inputs (kept as LayerNorm)"
        return sp
    stream = _site_stream(st, calls)
    sp.stream_kind = _stream_kind(st, calls)
    sp.writers = sorted(set(stream.writers))
    sp.writer_targets = sorted(stream.targets)
    carries = _site_verdict(st, sp, stream)
    fold_blocker = _site_folds(st, site, sp)
    _site_rotation(st, site, sp, stream, carries, fold_blocker)
    return sp


def _stream_kind(st: Planning, calls: list[ModuleCall]) -> str:
    """What the norm's input stream carries besides writers (``SitePlan.stream_kind``, one of ``STREAM_KINDS``),
    over all its calls: ``"post-ln"`` where some call sums a Post-LN norm output (:func:`_post_ln_term`) with other
    terms (a residual add: BERT's ``h + FFN(h)``), else ``"norm-start"`` where some term is a norm's output (one that
    starts a stream several norms share, or one a norm reads alone: a ViT classifier's head LayerNorm reading the
    encoder's final norm, AST, Cosmos3-Edge's projector), else ``"writers"``.

    Read from the stream's terms alone (``st.site_terms``: which values the traced run summed into each norm's
    input), not from what the plan made of them: a Post-LN norm is ``"post-ln"`` whether a mean carry makes it
    exact, an op before it does (``per_norm_centering``) or it stays approximate, whatever its reason says (a reason
    speaks of the first problem term only, and of whether an op could be placed), so ``quantizer=`` reads the
    model's kind from this field (:func:`normswap.quantizers.model_kind`), never from a reason's words."""
    norm_terms = False
    for call in calls:
        terms = st.site_terms[call.id]
        norms = [t for t in terms if t.kind == "norm"]
        norm_terms = norm_terms or bool(norms)
        # a residual sum (the norm output plus what a block computed): a norm's output read alone is only passed on
        if len(terms) > len(norms) and any(_post_ln_term(st, t) for t in norms):
            return "post-ln"
    return "norm-start" if norm_terms else "writers"


def _post_ln_term(st: Planning, term: Term) -> bool:
    """Is norm output ``term`` summed into the input of one norm call only? Then the stream it writes ends at that
    norm, whose own output carries on: the norm outputs form a chain, each norm reading the last one's output plus
    what the block computed from it (BERT, BART, DeBERTa's masked embedding norm, ALBERT's shared layer call after
    call, Swin-V2's norm outputs that only its final norm sums), and each norm must cancel that output's mean on
    its own. A norm output summed into several norms' inputs starts a stream they share (BLOOM's embedding LayerNorm,
    CLIP's pre-LayerNorm, mBART's embedding norm, ModernBERT's embedding norm that its first attention reads, Swin's
    patch-embedding norm): Pre-LN, one op where it starts stands for all of them (where one can sit)."""
    if st.norm_term_calls is None:
        st.norm_term_calls = Counter(v for terms in st.site_terms.values() for v in {t.value for t in terms
                                                                                    if t.kind == "norm"})
    return st.norm_term_calls.get(term.value, 0) == 1


def _site_stream(st: Planning, calls: list[ModuleCall]) -> SiteStream:
    """Sort each term of a norm's input, call by call: centered by surgery (its edit targets count), centered
    by an op placed on this call's stream, or a problem (neither)."""
    an = st.an
    stream = SiteStream(calls)
    for call in calls:
        for term in st.site_terms[call.id]:
            stream.writers.append(term.module_path or term.label)
            if st.term_status[term.value][0]:
                stream.targets |= _term_targets(st, term)
                continue
            downstream = an.reach(term.value, -1).mapped
            hook = next((h for v, (h, reach) in st.hooks.items()
                         if call.id in reach.site_rows and v in downstream), None)
            if hook is not None and not an.behind(term.value, set(st.hooks), {an.site_input[call.id]}):
                hook = None  # the term also reaches this norm past every op (added twice to the stream)
            if hook is not None:
                stream.centered_by.append(hook)
                continue
            stream.problems.append(term)
            stream.problem_calls.setdefault(call.id, []).append(term)
    return stream


def _site_verdict(st: Planning, sp: SitePlan, stream: SiteStream) -> list[MeanCarry]:
    """Set the norm's verdict and reason: exact when every term is centered by surgery, or when its
    problem terms are Post-LN means an MLP carries; exact with centering when ops center the rest;
    else approximate, saying why. Returns the mean carries it claimed."""
    carries = _claim_mean_carries(st, stream)
    if carries:
        c = carries[0]
        sp.verdict = "exact"
        sp.reason = (f"stream written by `{c.source}` output (Post-LN), whose mean is cancelled by "
                     f"{c.added} neuron(s) added to `{c.up}` -> `{c.down}` ({c.activation})")
    elif stream.problems:
        sp.verdict = "approximate"
        sp.reason = _approximate_reason(st, stream)
    elif stream.centered_by:
        h = next((h for h in stream.centered_by if h.per_norm), stream.centered_by[0])
        sp.verdict = "exact-with-per-norm-centering" if h.per_norm else "exact-with-centering"
        sp.reason = f"centering op {h.place()}: {h.reason}"
    else:
        sp.verdict = "exact"
        sp.reason = f"stream written by {len(set(stream.writers))} centered writer(s)"
    return carries


def _claim_mean_carries(st: Planning, stream: SiteStream) -> list[MeanCarry]:
    """The MLPs that cancel every problem term's mean (all Post-LN norm outputs), added to the plan; []
    when some term has none or an MLP is already widened for another norm (one carry per MLP)."""
    if not (stream.problems and st.mean_carry and all(t.kind == "norm" for t in stream.problems)):
        return []
    carries = _site_carries(st, stream.calls, stream.problem_calls)
    if any(c.up in st.carried_mlps for c in carries):
        return []
    for c in carries:
        st.carried_mlps.add(c.up)
        st.plan.mean_carries.append(c)
    return carries


def _approximate_reason(st: Planning, stream: SiteStream) -> str:
    """Why a norm is approximate (said of its first problem term), and whether ``per_norm_centering``
    would make it exact: promised only where :func:`_per_norm_op_fits` checks that an op on this norm's
    own input centers every call of it (tests plan with the option and hold the promise to it)."""
    term = stream.problems[0]
    if term.kind == "norm" and term.value in st.unhooked:  # a stream start, but no op can center it
        reason = (f"stream starts at {term.label}; no centering point feeds only norms: the stream "
                  f"{st.unhooked[term.value]}")
    elif term.kind == "norm":
        reason = f"stream written by {term.label} (Post-LN)"
    elif term.value in st.chained:
        reason = (f"stream written by {st.term_status[term.value][1]}, computed after the centering op at "
                  f"`{st.chained[term.value]}` (a second op on one stream)")
    elif st.one_norm_ops and _reaches_one_norm(st, term):
        reason = (f"stream starts at {st.term_status[term.value][1]}, which reaches this norm alone: its "
                  "centering op would be one per norm")
    else:
        reason = f"stream written by {st.term_status[term.value][1]}; no centering point feeds only norms"
    if not st.per_norm_centering:
        why_not = _per_norm_op_fits(st, stream)
        reason += (f"; per_norm_centering=True would not help: {why_not}" if why_not else
                   "; a centering op before this norm would make it exact (per_norm_centering=True): "
                   "LayerNorm by another name")
    return reason


def _read_by_linears(st: Planning, term: Term) -> bool:
    """Do Linear/Conv1D layers read norm output ``term`` itself (BERT's embedding norm, read by the first
    attention): the stream is then Post-LN, not a Pre-LN tower that some other reader blocks."""
    call = st.an.graph.calls[term.call] if term.call is not None else None
    return call is not None and bool(st.an.readers(call)[0])


def _reaches_one_norm(st: Planning, term: Term) -> bool:
    """Does ``term``'s stream, computed from another norm's output, reach one norm only, not a head's?"""
    return st.an.depends_on_norm(term.value) and _serves_one_norm(st, st.an.reach(term.value, -1))


def _per_norm_op_fits(st: Planning, stream: SiteStream) -> str:
    """Why an op on the norm's own input (what ``per_norm_centering`` adds) would not make every call of
    it exact ('' when it would): one mean per row is the norm's mean only when it normalises the last axis
    alone, and a hook on a norm called several times runs at each call."""
    an = st.an
    for call in stream.calls:
        vid = an.site_input.get(call.id)
        if vid is None:
            return "its input is no tensor argument"
        if an.own_input_reach(vid, call) is None:
            site = an.sites[call.path]
            if len(site.normalized_shape) != 1:
                return f"it normalises over {tuple(site.normalized_shape)}, more than the last axis"
            return f"it is called {len(an.calls_per_path[call.path])} times (a module shared across depth)"
    return ""


def _site_folds(st: Planning, site: NormSite, sp: SitePlan) -> str:
    """Record the norm's readers and what they take: β and γ folds for a converted-exact norm, centered
    readers for an approximate one. Returns why nothing can fold out of the norm ('' when it can)."""
    foldable, other = st.site_readers.get(sp.name, (set(), []))
    sp.readers = sorted(foldable) + sorted(set(other))
    sp.linear_readers = sorted(foldable)
    sp.readers_alone = bool(foldable) and not other and all(
        st.reader_sources[path] == {sp.name}
        and st.reader_calls[path] == {c.id for c in st.an.calls_per_path.get(path, [])} for path in foldable)
    residual = bool(other) and _residual_fold(st, site, sp, sorted(foldable))
    if sp.verdict != "approximate":
        blocker = _plan_folds(st, site, sp, sorted(foldable), other)
        if residual and sp.beta_detail.startswith("kept in the RMSNorm: output also read by"):
            sp.beta_detail += RESIDUAL_HINT  # the placement decides later (opt-in); said in every plan
        return blocker
    st.plan.centered_readers += _centered_readers(st, site, sorted(foldable))
    return ""


def _residual_fold(st: Planning, site: NormSite, sp: SitePlan, foldable: list[str]) -> bool:
    """A :class:`~normswap.analysis.plan.ResidualFold` candidate for a norm whose other readers are residual
    adds (Post-LN): one call, every Linear reader reads only this norm, on every call, and has a bias; every
    residual's other term is one Linear writer with a bias (:func:`normswap.analysis.residual.residual_writers`).
    Not with ``fold_gamma`` or ``fold_beta=False``. A norm with neither β nor a fitted bias (an exact
    non-affine one) has nothing to fold. Returns whether it added one."""
    an = st.an
    calls = [c for c in an.site_calls if c.path == sp.name]
    if st.folds_gamma(sp.name) or not an.fold_beta or len(calls) != 1 or len(site.normalized_shape) != 1 \
            or list(site.param_shape) != list(site.normalized_shape):
        return False
    if site.bias_attr is None and sp.verdict != "approximate":
        return False
    for path in foldable:
        every_call = {c.id for c in an.calls_per_path.get(path, [])}
        if st.reader_sources[path] != {site.path} or st.reader_calls[path] != every_call \
                or getattr(an.modules[path], "bias", None) is None:
            return False
    reader_calls, _ = an.readers(calls[0])
    writers, _ = residual_writers(an, calls[0], {c.id for c in reader_calls})
    if not writers or any(w in foldable for w, _ in writers):
        return False
    st.plan.residual_folds.append(ResidualFold(
        site.path, foldable, [writer_kind(an.modules[p]) for p in foldable],
        [w for w, _ in writers], [k for _, k in writers]))
    return True


def _site_rotation(st: Planning, site: NormSite, sp: SitePlan, stream: SiteStream, carries: list[MeanCarry],
                   fold_blocker: str) -> None:
    """Can the norm's stream take an orthogonal Q? Where an op centers it, where Q goes as an op
    (:func:`_rotation_ops`); then the first blocker, if any (:func:`_rotation_blocker`). A stream that
    carries a Post-LN norm output is not rotated: the widened MLP cancels a mean Q would scramble."""
    _, other = st.site_readers.get(sp.name, (set(), []))
    if stream.centered_by:
        sp.rotation_ops, sp.rotation_upstream = _rotation_ops(st, stream.calls)
    sp.rotation_reason = _rotation_blocker(st.an, site, sp, stream.centered_by, sorted(set(other)), fold_blocker,
                                           st.keep_gamma.get(sp.name, ""))
    if carries and not sp.rotation_reason:
        sp.rotation_reason = "its stream carries a Post-LN norm output (mean cancelled in the MLP)"
    sp.rotation_ready = not sp.rotation_reason


def _plan_rms_norms(st: Planning, rms_norms: list[SkippedNorm]) -> None:
    """Norms that were RMS from the start: ``fold_gamma`` folds their γ into their readers, and their
    streams are described for rotation like converted ones."""
    if st.an.fold_gamma and rms_norms:
        st.plan.rms_folds = [f for f in _rms_folds(st.an, rms_norms, set(st.reader_sources))
                             if st.folds_gamma(f.norm)]
    if rms_norms:
        st.plan.rms_sites, st.plan.rotation_axes = _rms_streams(st.an, rms_norms, st.plan.rms_folds, st.keep_gamma)


def _plan_lists(st: Planning) -> None:
    """The plan's global lists: LayerScale folds of centered writers, unties, centering ops, and the model
    outputs the conversion changes (what verification compares)."""
    an, plan = st.an, st.plan
    centered_owners = {e.owner for e in st.edits.values()}
    keep = plan.options.get("layer_scale") == "keep"
    # writer_centering="auto": a writer behind its op keeps its rows, but λ is still taken into them and the rows
    # balanced back out (ScaleFold keep, no centering): the same integers on a per-row grid, equal row maxima for a
    # per-tensor one, as the writers centered by weights have (DINOv2-small, ONNX Runtime per-tensor int8: 0.55× the
    # original's error balanced, 1.00× with λ as it was). "op" leaves λ as it was (NNCF int8 weights, 256 crops:
    # 1.03× unbalanced, 1.08× balanced, both on one photograph; docs/results/quantization.md, round 52)
    balanced: set[str] = set()
    if keep and st.writer_centering == "auto":
        balanced = {t.module_path for call in an.site_calls for t in st.site_terms[call.id]
                    if t.value in st.writer_terms}
    plan.scale_folds = sorted({ScaleFold(param, path, writer_kind(an.modules[path]), offset, keep)
                               for param, path, _, offset in an.layer_scales.values()
                               if path in centered_owners or path in balanced},
                              key=lambda f: f.param)
    plan.unties = list(st.unties.values())
    plan.hooks = [h for h, _ in st.hooks.values()]
    reaches = [r for _, r in st.hooks.values()]
    for e in st.edits.values():
        if e.kind != "param":
            reaches += [an.reach(c.outputs[0], OUTPUT_AXIS[e.kind]) for c in an.calls_per_path.get(e.owner, [])]
    changed = {o for r in reaches for o in r.outputs}
    plan.changed_outputs = sorted(changed | an.cache_outputs)
    plan.changed_output_axes = _output_feature_axes(an, reaches)


def _output_feature_axes(an: Analyzer, reaches: list[Reach]) -> dict[str, int]:
    """The axis each changed model output holds the centered stream's features along, where it is not
    the last one (a stream permuted to channels-first (B, C, H, W) on its way out: VitDet). Read off the
    feature index maps the reaches carried to the output: the axis along which the map varies while it
    is constant along every other (each position holds the same features in the same order)."""
    axes: dict[str, int] = {}
    for reach in reaches:
        for vid, m in reach.mapped.items():
            path = an.output_values.get(vid)
            if path is None or path in axes or m.dim() < 2:
                continue
            axis = feature_axis(m)
            if axis is not None and axis != m.dim() - 1:
                axes[path] = axis - m.dim()
    return dict(sorted(axes.items()))


def feature_axis(index_map: torch.Tensor) -> int | None:
    """The one axis along which ``index_map`` (feature ids, NaN where not reached) varies, or None when
    no single axis does (features spread over several axes, or only one feature)."""
    found = None
    for axis in range(index_map.dim()):
        rows = index_map.movedim(axis, -1).reshape(-1, index_map.shape[axis])
        first = rows[0]
        known = ~torch.isnan(rows) & ~torch.isnan(first)
        if not bool((rows == first)[known].all()):
            continue  # varies along the other axes too
        if index_map.shape[axis] > 1 and torch.unique(first[~torch.isnan(first)]).numel() > 1:
            if found is not None:
                return None
            found = axis
    return found


def _starts_stream(st: Planning, term: Term) -> bool:
    """Does the norm output ``term`` start a stream, although the norm's input is computed from another norm?

    vit-pytorch's patch embedding (``LayerNorm, Linear, LayerNorm``) and PVT's per-stage patch embedding
    (a conv reading the last stage's norm, then a norm) end in a norm whose output starts the stream the
    blocks read. One centering op there keeps every norm of that stream exact, as after BLOOM's embedding
    norm, when both hold:

    - that norm is exact by weight surgery alone (every writer of its input centered): it becomes an
      RMSNorm, and the op replaces its mean, one for one. A Post-LN norm never is: its input holds the
      previous norm's output, which no weight edit centers;
    - it is the only term that surgery cannot center in every norm input it reaches: one op per stream,
      at its start. Swin-V2's post-norms (``x + norm(attn(x))``, each exact by surgery) all write the
      stream the final norm reads: that would take one op per block, or one before that norm (Post-LN).

    A writer that ``writer_centering="op"``/``"auto"`` centers by its own op (:func:`_writer_ops`) counts as
    centered by surgery in both: its op replaces its weight edit one for one (and it falls back to that edit
    where no op can serve it), so the option never costs a stream start its op (a ViT head's norm reading the
    final norm, a Conformer layer's ``norm_out`` starting the next layer's stream).
    """
    def centered(value: int) -> bool:
        return st.term_status[value][0] or value in st.writer_terms

    terms = st.site_terms.get(term.call) if term.kind == "norm" and term.call is not None else None
    if not terms or not all(centered(t.value) for t in terms):
        return False
    reached = st.an.reach(term.value, -1).site_rows
    return bool(reached) and all(t.value == term.value or centered(t.value)
                                 for call_id in reached for t in st.site_terms.get(call_id, []))


def _site_carries(st: Planning, calls: list[ModuleCall], problem_calls: dict[int, list[Term]]) -> list[MeanCarry]:
    """The mean carries that make every call of a site exact, or [] when some call has none.

    A layer shared across depth (ALBERT) calls its norm and its MLP once per depth: the same widened
    MLP then cancels, at each call, the mean of what that call reads, so the carry must be found for
    every call, and every call must agree on which MLP it is."""
    if any(not problem_calls.get(call.id) for call in calls):
        return []  # the widened MLP runs at every call: each call must be one the carry was checked on
    found: dict[tuple[str, str], MeanCarry] = {}
    for call in calls:
        for term in problem_calls.get(call.id, []):
            c = st.an.mean_carry(call, term, st.site_terms[call.id], st.module_ok, shared_calls=len(calls),
                             multiple=st.carry_multiple)
            if c is None:
                return []
            found.setdefault((c.up, c.down), c)
    if len(found) != len(problem_calls.get(calls[0].id, [])):
        return []  # the calls disagree on which MLP carries which mean
    return list(found.values())


def _term_targets(st: Planning, term: Term) -> set[str]:
    """The writer-edit targets (parameter names) that center one stream term."""
    if term.kind == "param":
        return {st.an.graph.values[term.value].name}
    return {e.target for e in st.edits.values() if e.owner == term.module_path}


def _rotation_ops(st: Planning, calls: list[ModuleCall]) -> tuple[list[dict], list[str]]:
    """Where a stream centered at run time takes its rotation, and which writers it then must not turn.

    A stream-start centering op sits on a value no weight can turn (a norm's output, a regenerated
    table, a nonlinear stem): rotating that stream needs one op there, ``x → x Q``, right after the
    centering (with ``Q·1 = ±1`` they commute). Writers upstream of that op (summed into the value it
    turns) are turned by it, not by their weights. Returns ``([{module, where, arg}], upstream targets)``.
    """
    an, hooks = st.an, st.hooks
    ops, upstream = {}, set()
    for call in calls:
        mine = [v for v, (h, reach) in hooks.items() if call.id in reach.site_rows and not h.per_norm and not h.writer]
        # an op whose value flows into another op's value is turned by that one: only the last ones stay
        # (wav2vec2: the positional conv's output, then the sum it joins, are both centered)
        last = [v for v in mine if not any(w != v and w in an.reach(v, -1).mapped for w in mine)]
        for v in last:
            h = hooks[v][0]
            if h.where == "residual":
                continue  # no rotation op there (_rotation_blocker says so)
            ops[(h.module, h.where, h.arg)] = {"module": h.module, "where": h.where, "arg": h.arg}
            for term in st.site_terms[call.id]:
                if st.term_status[term.value][0] and v in an.reach(term.value, -1).mapped:
                    upstream |= _term_targets(st, term)
    return list(ops.values()), sorted(upstream)


def _rotation_blocker(an: Analyzer, site: NormSite, sp: SitePlan, centered_by: list[CenterHook],
                      other: list[str], fold_blocker: str = "", unturned: str = "") -> str:
    """Why the stream this norm reads cannot be rotated by an orthogonal Q ('' when it can).

    Rotation needs an RMSNorm with unit weight and no bias (``rms(xQ) = rms(x)``), writers whose
    output features can absorb Q (Linear, Conv1D, Embedding, conv, raw parameters), and readers
    that are Linear layers seeing the norm's features unpermuted (they absorb Qᵀ). ``fold_blocker``
    is why nothing folds out of this norm at all (:func:`_fold_blocker`), when that is why γ stays;
    ``unturned`` why the rotation leaves this norm's stream alone, where that is why γ was not folded.
    """
    sp.rotation_outputs = _output_names(other)
    if sp.verdict == "approximate":
        return "approximate norm (the stream is not zero-mean)"
    if sp.verdict == "skipped":
        return "not converted"
    if any(h.per_norm for h in centered_by):
        h = next(h for h in centered_by if h.per_norm)
        return f"centering op before each norm (`{h.module}`; per_norm_centering): one rotation op per norm"
    if any(h.writer for h in centered_by):
        h = next(h for h in centered_by if h.writer)
        return f"centering op after each writer (`{h.module}`; writer_centering='op'): one rotation op per writer"
    if any(h.where == "residual" for h in centered_by):
        h = next(h for h in centered_by if h.where == "residual")
        return f"centering op {h.place()}: no rotation op sits on a residual sum inside a forward"
    if centered_by and not sp.rotation_ops:
        return f"centering op at `{centered_by[0].module}` that no rotation op can follow"
    if len(site.normalized_shape) != 1 or list(site.param_shape) != list(site.normalized_shape):
        return "normalises over more than one axis or per-head parameters (not a residual-stream norm)"
    why = _reader_blocker(other, sp.linear_readers)
    if why:
        return why
    if site.weight_attr is not None and not sp.fold_gamma:
        if unturned:
            return f"{GAMMA_KEPT}: {unturned}"
        if not an.fold_gamma:
            return "γ stays in the RMSNorm (pass fold_gamma=True)"
        if fold_blocker:  # Whisper's final norm: its one reader is the embedding, read again as the logits
            return f"γ stays in the RMSNorm: nothing folds out of it ({fold_blocker})"
        if site.bias_attr is not None and not sp.fold_beta:
            return "γ stays in the RMSNorm: β cannot fold (a reader has no bias slot) and some γ is near 0"
        return "γ cannot fold into the readers (a reader also reads another stream or is shared)"
    return ""


# the parameters of a writer that carry its output features, and the axis they sit on (rotation)
_ROTATED_PARAMS = {"linear": (("weight", 0), ("bias", 0)), "conv1d": (("weight", 1), ("bias", 0)),
                   "embedding": (("weight", 1),)}


def _rms_streams(an: Analyzer, rms_norms: list[SkippedNorm], folds: list[RmsFold], keep_gamma: dict[str, str]
                 ) -> tuple[list[SitePlan], dict[str, int]]:
    """Rotation facts for norms that were RMS from the start (Llama, Mistral, Gemma, T5): one
    :class:`SitePlan` each (verdict ``"rms"``, never converted, not in the plan's tables) with the
    stream's writers, Linear readers and readiness, so that :func:`normswap.rotate` turns their
    streams like converted ones. Their writers need no centering: ``rms(xQ) = rms(x) Q`` holds for
    any stream. Returns the sites and ``{writer parameter: output-feature axis}``."""
    folded = {f.norm: f for f in folds}
    axes: dict[str, int] = {}
    out = []
    for norm in rms_norms:
        if norm.weight_attr is None:  # a gated norm, a GroupNorm, ... (RMS ones name their γ)
            continue
        calls = an.calls_per_path.get(norm.path, [])
        module = an.modules.get(norm.path)
        width = int(getattr(module, "weight", None).shape[-1]) if getattr(module, "weight", None) is not None \
            else None
        if not calls or width is None:
            continue
        sp = SitePlan(name=norm.path, class_name=norm.class_name, verdict="rms", reason=norm.reason,
                      normalized_shape=[width], param_shape=[width], eps=float(getattr(module, "eps", 0.0) or 0.0),
                      flavour="rms")
        why, targets, readers, other = "", set(), set(), []
        for call in calls:
            vid = call.first_input()
            for term in an.leaves(vid) if vid is not None else []:
                turned, blocked = _rms_writer(an, term, width)
                why = why or blocked
                axes.update(turned)
                targets |= set(turned)
            rcalls, others = an.readers(call)
            readers |= {rc.path for rc in rcalls}
            other += others
        sp.writers = sorted(targets)
        sp.writer_targets = sorted(targets)
        sp.linear_readers = sorted(readers)
        sp.readers = sorted(readers) + sorted(set(other))
        sp.rotation_reason = why or _rms_rotation_blocker(an, norm, sp, sorted(set(other)), folded.get(norm.path),
                                                          keep_gamma.get(norm.path, ""))
        sp.rotation_outputs = _output_names(sorted(set(other)))
        sp.rotation_ready = not sp.rotation_reason
        out.append(sp)
    return out, axes


def _rms_writer(an: Analyzer, term: Term, width: int) -> tuple[dict[str, int], str]:
    """The parameters through which one writer of an RMS stream turns with it (``{name: output-feature
    axis}``), or why that writer's output features cannot absorb Q."""
    if term.kind == "module":
        writer = an.modules[term.module_path]
        params = _ROTATED_PARAMS.get(writer_kind(writer) or "")
        if params is None or writer.weight.shape[params[0][1]] != width:
            return {}, f"stream written by {term.label}, whose output features cannot absorb Q"
        return {f"{term.module_path}.{attr}": axis for attr, axis in params
                if writer._parameters.get(attr) is not None}, ""
    value = an.graph.values[term.value] if term.kind == "param" else None
    if value is not None and value.shape[-1:] == (width,):
        return {value.name: len(value.shape) - 1}, ""
    return {}, f"stream written by {term.label} (not a weight that can absorb Q)"


def _rms_rotation_blocker(an: Analyzer, norm: SkippedNorm, sp: SitePlan, other: list[str],
                          fold: RmsFold | None, unturned: str = "") -> str:
    """Why an RMS norm whose writers can all turn still blocks rotation ('' when it does not): a bias,
    readers that cannot absorb Qᵀ, or a γ that stays in the norm (``unturned``: because the rotation
    leaves its stream alone)."""
    if norm.bias_attr is not None:
        return "the RMS norm has a bias"
    why = _reader_blocker(other, sp.linear_readers)
    if not why and fold is None and unturned:
        return f"{GAMMA_KEPT}: {unturned}"
    if not why and fold is None:
        return ("γ stays in the RMS norm (pass fold_gamma=True)" if not an.fold_gamma else
                "γ cannot fold into the readers (a reader also reads another stream or is shared)")
    return why


def _output_names(other: list[str]) -> list[str]:
    """The model outputs among a norm's non-Linear readers (``model output `name```)."""
    return [o.split("`")[1] for o in other if o.startswith("model output `")]


def _reader_blocker(other: list[str], linear_readers: list[str]) -> str:
    """Why a norm's readers cannot absorb Qᵀ ('' when they can). A model output alone is a blocker that
    :func:`normswap.rotate`'s ``output=`` lifts (the output comes out rotated, or is turned back)."""
    plain = [o for o in other if not o.startswith("model output `")]
    if plain:
        return f"output also read by {plain[0]} (not a Linear that can absorb Qᵀ)"
    if other:
        names = ", ".join(f"`{n}`" for n in _output_names(other))
        return (f"its output is the model output {names} (rotate(..., output='rotated' | 'restore') "
                "rotates it: rotated output, or one un-rotation after this norm)")
    if not linear_readers:
        return "no Linear reader"
    return ""


def _well_conditioned(gamma: torch.Tensor | None) -> bool:
    """Can β/γ be kept in the norm without blowing up? (every |γ| ≥ 1e-3 · max |γ|)."""
    if gamma is None or gamma.numel() == 0:
        return False
    mag = gamma.abs()
    return bool(mag.max() > 0) and bool(mag.min() >= 1e-3 * mag.max())


def _plan_folds(st: Planning, site: NormSite, sp: SitePlan, foldable: list[str], other: list[str]) -> str:
    """β (and with fold_gamma, γ) leave the norm when every reader can take them; ``sp.beta_detail`` says
    where β went, reader by reader, or why it stays in the RMSNorm. Returns why nothing can fold out of
    the norm at all ('' when the readers allow folding).

    A reader with a bias slot takes its share ``W β`` there; one without may still let it go exactly
    (a key projection drops it, a value projection moves it through attention into the output
    projection's bias: :mod:`normswap.analysis.attention`). β stays in the norm, for every reader, as soon as
    one reader still needs it.
    """
    an, plan = st.an, st.plan
    has_beta = site.bias_attr is not None
    kept = _fold_blocker(st, site, foldable, other)
    if kept:
        sp.beta_detail = f"kept in the RMSNorm: {kept}" if has_beta else ""
        return kept
    routes: dict[str, Route] = {}
    if an.fold_beta and has_beta:
        for p in foldable:
            routes[p] = Route("bias", "") if an.modules[p].bias is not None else an.attention.route(p)
            if routes[p].how == "kept" and an.bias_slots and st.folds_gamma(site.path) \
                    and isinstance(an.modules[p], nn.Linear):
                routes[p] = Route("slot", "")  # a bias slot of its own (BiasSlot) takes W β
    stuck = [p for p, r in routes.items() if r.how == "kept"]
    fold_beta = bool(routes) and not stuck
    if has_beta:
        sp.beta_detail = _beta_detail(routes, stuck) if an.fold_beta else "kept in the RMSNorm (fold_beta=False)"
    # γ leaves the norm together with β, or, where β cannot fold (a reader has no bias slot), with
    # the norm keeping β/γ: γ⊙u + β = γ⊙(u + β/γ). Only where no γ is near zero relative to the rest.
    fold_gamma = st.folds_gamma(site.path) and site.weight_attr is not None and (
        fold_beta or not has_beta or _well_conditioned(site.gamma(an.modules[site.path])))
    if fold_beta or fold_gamma:
        sp.fold_beta, sp.fold_gamma = fold_beta, fold_gamma
        for p in foldable:
            route = routes[p].how if fold_beta else ""
            plan.folds.append(FoldEdit(site.path, p, writer_kind(an.modules[p]), route in ("bias", "slot"),
                                       fold_gamma, route))
            if route == "slot":
                plan.bias_slots.append(BiasSlot(site.path, p, int(an.modules[p].out_features)))
            if route == "moved":
                r = routes[p]
                plan.beta_moves.append(BetaMove(site.path, p, writer_kind(an.modules[p]), r.into, r.kind, r.runs))
    if fold_beta:
        an.cache_outputs |= {o for r in routes.values() for o in r.outputs}
    return ""


def _centered_readers(st: Planning, site: NormSite, foldable: list[str]) -> list[CenteredReader]:
    """The Linear readers of an approximate norm that can be made blind to the mean its RMSNorm leaks
    (:class:`~normswap.analysis.plan.CenteredReader`): each reads only this norm's whole, unpermuted output on
    every call, owns its weight, and has a bias slot for the β correction (unless the norm has no β).
    γ must be well conditioned (the edit divides by it)."""
    if len(site.normalized_shape) != 1 or (site.weight_attr is not None
                                           and list(site.param_shape) != list(site.normalized_shape)):
        return []
    an = st.an
    module = an.modules[site.path]
    if site.weight_attr is not None and not _well_conditioned(site.gamma(module)):
        return []
    out = []
    for path in foldable:
        reader = an.modules[path]
        every_call = {c.id for c in an.calls_per_path.get(path, [])}
        if st.reader_sources[path] != {site.path} or st.reader_calls[path] != every_call:
            continue
        weight = an.weight_param(path)
        untie = None
        if (an.weight_sharers(path) or an.sharing_problem(weight, path) is not None) \
                and (path, "weight") not in st.unties:
            if not (an.untie is None and not isinstance(reader, LinearView)
                    and an.sharing_problem(weight, path) in (None, "tied")):
                continue  # the edit would change the other owner (a tied embedding) too
            untie = Untie(path, "weight", an.param_name[id(weight)], weight.numel())  # untie=None: only here
        if site.bias_attr is not None and reader.bias is None:
            continue
        if untie is not None:
            st.unties[(path, "weight")] = untie
        out.append(CenteredReader(site.path, path, writer_kind(reader)))
    return out


def _fold_blocker(st: Planning, site: NormSite, foldable: list[str], other: list[str]) -> str:
    """Why nothing folds out of this norm at all ('' when its readers allow folding)."""
    an = st.an
    if other:
        return f"output also read by {other[0]} (not a Linear)"
    if not foldable:
        return "no Linear reader"
    if len(site.normalized_shape) != 1 or site.param_shape != site.normalized_shape:
        return "normalises over more than one axis or has per-head parameters"
    for path in foldable:
        every_call = {c.id for c in an.calls_per_path.get(path, [])}
        if st.reader_sources[path] != {site.path} or st.reader_calls[path] != every_call:
            return f"`{path}` also reads something else"  # folding would change that call
        weight = an.weight_param(path)
        # a kept tie blocks only a γ fold (it rewrites the weight); β goes into the reader's bias alone
        sharers = an.weight_sharers(path) if st.folds_gamma(site.path) else []
        if (sharers or an.sharing_problem(weight, path) is not None) and (path, "weight") not in st.unties:
            owners = sorted({o for o, _ in an.param_owners.get(id(weight), [])} - {path})  # a view's owner too
            return f"`{path}` shares its weight" + (f" with {', '.join(f'`{o}`' for o in owners)}" if owners else "")
    return ""


def _beta_detail(routes: dict[str, Route], stuck: list[str]) -> str:
    """Human text: where each reader's share of β went, or the first reader that keeps β in the norm."""
    if stuck:
        p = stuck[0]
        more = f" ({len(stuck) - 1} more reader(s) without a bias slot keep it too)" if len(stuck) > 1 else ""
        return f"kept in the RMSNorm: `{p}` has no bias slot and {routes[p].why}{more}"
    return beta_text([(p, r.how) for p, r in routes.items()], {p: r.into for p, r in routes.items() if r.into})
