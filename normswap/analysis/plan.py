"""The conversion plan: one verdict per LayerNorm plus every weight edit needed to honour it.

A plan is printable (``normswap inspect``) and serialisable: ``to_dict()`` becomes the checkpoint
manifest, from which loading re-applies the structural edits without re-running the analysis.
"""

from __future__ import annotations

import math
import struct
import textwrap
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any

VERDICTS = ("exact", "exact-with-centering", "exact-with-per-norm-centering", "approximate", "skipped")
# verdicts whose norm reads a stream made zero-mean at run time (not RMS-swappable in a stock runtime)
CENTERED_VERDICTS = ("exact-with-centering", "exact-with-per-norm-centering")
EXACT_VERDICTS = ("exact",) + CENTERED_VERDICTS
# not serialised (see Plan.to_dict)
RUNTIME_SITE_FIELDS = ("writer_targets", "linear_readers", "rotation_ops", "rotation_upstream", "readers_alone")
# SitePlan.stream_kind: what a norm's input stream carries besides writers, found from the stream's terms (which
# values the traced run summed into each norm's input), never from a reason's words, and the same whatever options
# the plan was made with (normswap.analysis.planner._stream_kind):
# - "writers": no norm's output: every term is a writer (a Linear, conv, embedding, parameter) or another op;
# - "norm-start": a norm's output that several norms' inputs share, or that a norm reads alone (a ViT classifier's
#   head LayerNorm reading the encoder's final norm): it starts their stream (BLOOM's embedding
#   LayerNorm, CLIP's pre-LayerNorm, ModernBERT's embedding norm, Swin's patch-embedding norm), and one op where the
#   stream starts stands for all of them (where one can sit): Pre-LN all the same;
# - "post-ln": a norm's output summed with other terms (a residual add) into this norm's input and no other norm's:
#   the norms form a chain, each reading the last one's output plus what its block computed from it (BERT, BART,
#   DeBERTa, ALBERT), and each must cancel that mean on its own: exact by a mean carry, exact with an op before it,
#   or approximate.
STREAM_KINDS = ("writers", "norm-start", "post-ln")
RESIDUAL_WHY = "the residual add's other writer"  # in beta_detail: β folded out of a Post-LN norm (ResidualFold)
# appended to the beta_detail of an exact norm that keeps β although a ResidualFold could take it out
RESIDUAL_HINT = "; beta_placement='fold' folds it into the readers' biases and the residual writer's"


@dataclass
class WriterEdit:
    """Center ``target`` (a parameter name) along ``axis``: whole axis, or per ``[lo, hi)`` block."""

    target: str
    axis: int
    blocks: list[tuple[int, int]] | None
    owner: str  # module path ('' for raw parameters)
    kind: str  # linear | conv1d | embedding | conv | param


@dataclass
class ConstantTrade:
    """Rows ``[lo, hi)`` of the centered table ``table`` get back one constant ``c``, which ``into`` gives up.

    Exactness needs each token's *sum* of writers to be zero-mean, not each writer. Centering every writer
    alone moves each entry of a position table by its row's mean, off the grid a quantizer rounded the
    original's small entries to (ONNX Runtime's static QDQ rounds the stream before and after the table is
    added: ``docs/results/quantization.md``). When a float bias or a one-token parameter (a class token)
    reaches exactly the tokens those rows reach, each once, the rows can keep ``c`` = the mean of their
    original row means (each entry then moves by ``|m_t − c|``, not ``|m_t|``) and ``into`` take ``−c``:
    every token's sum is unchanged. ``c`` is computed from the table's tensor when the edit is applied
    (:func:`normswap.surgery.edits.trade_constants`), so a plan fits any weights of the same structure.
    Rows count over the table's axes other than ``axis`` (its feature axis), flattened in order.
    """

    table: str  # a centered writer parameter (a position table, row per token position)
    axis: int  # its feature axis (the one centering subtracts the mean along)
    lo: int
    hi: int
    into: str  # a centered bias or one-token parameter that reaches the same tokens, each once
    reason: str = ""


@dataclass
class FoldEdit:
    """Fold a norm's β (into the bias) and/or γ (into the weight) of reader ``reader``.

    ``beta_route`` says where this reader's share ``W β`` of the norm's β goes when β leaves the norm:
    ``"bias"`` (added to the reader's bias: ``beta`` is set), ``"slot"`` (the reader had no bias: a
    :class:`BiasSlot` gives it one, which takes ``W β``; ``beta`` is set), ``"dropped"`` (a key projection whose
    keys only meet the queries in softmax-normalised scores: a constant key shift changes every score of
    a query by the same amount), ``"moved"`` (a value projection: see :class:`BetaMove`), or ``""``
    (β stays in the norm, or there is none).
    """

    site: str
    reader: str
    kind: str  # linear | conv1d
    beta: bool
    gamma: bool
    beta_route: str = ""


@dataclass
class BiasSlot:
    """Give a bias-less Linear reader (GPT-2's LM head) a bias, so a norm's β can fold into it as ``W β``.

    Without one, β stays in the norm, and with ``fold_gamma`` it must stay as ``β/γ``
    (``γ⊙u + β = γ⊙(u + β/γ)``): a constant added to every token that a near-zero γ makes huge (γ = 0.013
    gave −35.9 on one channel of a trained toy GPT-2), which per-token activation quantization then
    spends its whole grid on. In the reader's bias the same shift is a constant the quantizer never
    sees. Structural: loading a native checkpoint adds the slot before the weights load
    (:func:`normswap.surgery.edits.apply_structure`); the compat format (stock architecture, no slot) moves the
    shift back into the stock LayerNorm's bias (exact, :func:`normswap.checkpoint.writer.compat_model`).
    """

    site: str  # the norm whose β the slot takes
    reader: str  # an nn.Linear created with bias=False
    features: int  # its out_features


@dataclass
class BetaMove:
    """Carry a bias-less value projection's share of a norm's β through attention into the bias of the
    Linear that reads the attention output (``b_into += W_into s``).

    ``W_v (u + β) = W_v u + W_v β``: every value of a head gains the same vector. Attention rows sum to
    one (softmax, no sink logit, no dropout in eval), so every output row of that head gains it too,
    and the output projection turns it into the constant ``W_into s``. ``runs`` maps the value
    features onto ``into``'s input features (identity for the usual head layout, repeated heads
    for grouped-query attention); input features outside every run get nothing.
    """

    site: str
    reader: str  # the value projection (its output is the value tensor)
    reader_kind: str  # linear | conv1d
    into: str  # the Linear reading the attention output; it has a bias
    kind: str  # linear | conv1d
    runs: list[tuple[int, int, int]]  # (first input feature of `into`, first output feature of `reader`, count)


# The affine slots of each norm flavour (walker.NormSite.flavour): (has γ, has β).
FLAVOUR_SLOTS = {
    "standard": (True, True),
    "gamma-only": (True, False),
    "beta-only": (False, True),
    "non-affine": (False, False),
    "offset": (True, True),
}
TABLE_WIDTH = 100  # columns Plan.table fits by default (a common terminal)

KEY_DROP_WHY = "keys: softmax over the keys ignores a constant key shift"
BETA_KEPT_WHY = "kept in the RMSNorm: folding it into the reader biases would round worse in bf16"
BETA_KEEP_WHY = "kept in the RMSNorm (beta_placement='keep'): the readers' biases and inputs stay the original's"
# a norm's rotation_reason where a rotation asked for fold_gamma but leaves its stream alone (planner keep_gamma)
GAMMA_KEPT = "γ kept in the norm, as without a rotation, because the rotation leaves its stream alone"
VALUE_MOVE_WHY = "values: attention weights sum to 1 over the keys, so the shift passes through"


def int8_asym_step(w: Any) -> Any:
    """Each row's step on NNCF's INT8_ASYM grid (its ``compress_weights`` default: per row, reduction over the
    last axis), computed as NNCF does in float32: ``(max(w, 0) − min(w, 0))/255`` (zero for an all-zero row).
    The grid's points are the whole multiples of the step (the zero point is whole)."""
    w = w.detach().float()
    lo = w.amin(dim=-1).clamp(max=0)
    hi = w.amax(dim=-1).clamp(min=0)
    return (hi - lo) / 255


def int8_asym(w: Any) -> Any:
    """``w`` through NNCF's INT8_ASYM per row, dequantized (float32), as NNCF computes it
    (``calculate_integer_quantization_params`` / ``calculate_quantized_weight``): ``scale`` from
    :func:`int8_asym_step` (float32 eps where zero), ``zp = clip(−round(min/scale), 0, 255)``,
    ``q = clip(round(w/scale + zp), 0, 255)``, ``(q − zp)·scale``. What :meth:`MeanCarry.columns` puts the
    carry's first entries on; the benchmarks' replica of NNCF's int8 weights."""
    import torch

    w = w.detach().float()
    lo = w.amin(dim=-1, keepdim=True).clamp(max=0)
    scale = int8_asym_step(w).unsqueeze(-1)
    eps = torch.finfo(torch.float32).eps
    scale = torch.where(scale.abs() < eps, torch.full_like(scale, eps), scale)
    zp = torch.clamp(-torch.round(lo / scale), 0, 255)
    q = torch.clamp(torch.round(w / scale + zp), 0, 255)
    return (q - zp) * scale


def beta_text(routes: list[tuple[str, str]], moved_into: dict[str, str]) -> str:
    """Where a norm's β went, from its readers' ``(reader, FoldEdit.beta_route)`` and, for moved shares,
    ``{value projection: output projection}``. The text of ``SitePlan.beta_detail`` when β left the
    norm; a function of the edits alone, so an extrapolated plan rebuilds it at full depth."""
    parts = []
    biased = [r for r, how in routes if how == "bias"]
    if biased:
        parts.append("folded into the bias of " + ", ".join(f"`{r}`" for r in biased))
    slotted = [r for r, how in routes if how == "slot"]
    if slotted:
        parts.append("folded into a bias slot added to " + ", ".join(f"`{r}`" for r in slotted)
                     + " (it had none)")
    parts += [f"dropped at `{r}` ({KEY_DROP_WHY})" for r, how in routes if how == "dropped"]
    parts += [f"moved from `{r}` into the bias of `{moved_into[r]}` ({VALUE_MOVE_WHY})"
              for r, how in routes if how == "moved"]
    return "; ".join(parts)


@dataclass(frozen=True)
class ScaleFold:
    """Fold a per-feature LayerScale ``param`` (λ) into writer ``into``'s output rows before it is centered.

    ``keep=False``: λ becomes 1 (``W ← diag(λ) W``). ``keep=True`` (option ``layer_scale="keep"``): after
    centering, each row is scaled so that its largest entry is within 8/9 of the original weight's ``max|w|``,
    and that per-row scale becomes the new λ: the writer keeps the original's range
    (:func:`normswap.surgery.edits.balance_layer_scale`)."""

    param: str
    into: str  # module path of the Linear / Conv1D whose output λ scales
    kind: str  # linear | conv1d
    offset: float = 0.0  # the model scales by ``param + offset`` (x-transformers' unit offset); param ← 1 − offset
    keep: bool = False  # λ kept as a per-row scale (not 1) after centering


@dataclass
class RmsFold:
    """``fold_gamma`` on a norm that is already RMS-style (Llama, T5, Gemma): γ into its Linear readers,
    the norm's own weight set so that its effective γ is 1 (``weight = 1 − offset``)."""

    norm: str
    weight: str  # parameter name of the norm's γ
    offset: float  # effective γ = offset + weight
    readers: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)  # linear | conv1d, per reader


@dataclass
class CenterHook:
    """Subtract the per-token mean of a value: a module's ``output``, one ``input`` argument, or the
    ``residual`` sum ``a + M(a)`` its caller computes (``a``: input ``arg`` of module ``M``), a value
    inside another module's forward that is no module boundary (installed on ``M``)."""

    module: str
    where: str  # input | output | residual
    arg: int | str | None
    reason: str = ""
    per_norm: bool = False  # one op per norm (Post-LN, or a stream that reaches one norm): opt-in
    writer: bool = False  # one op after a writer inside the layers, which keeps its weights (writer_centering="op")

    def place(self) -> str:
        """Where the op sits, in words (reasons and ``inspect --verbose``)."""
        if self.where == "residual":
            arg = f"argument {self.arg}" if isinstance(self.arg, int) else f"`{self.arg}`"
            return f"on the residual sum of `{self.module}`'s input ({arg}) and its output"
        return f"at `{self.module}` {self.where}"


@dataclass
class MeanCarry:
    """Cancel a Post-LN norm output's mean inside the MLP that reads it (makes the next norm exact).

    In ``x = h + down(act(up(h)))`` with ``h`` a norm's output, ``x`` is not zero-mean because ``h``
    is not. For an activation with ``act(t) - act(-t) = t`` (ReLU, GELU, GELU-tanh, SiLU,
    quick-GELU), neurons added to the MLP compute ``mean(h)`` exactly: a pair with ``up`` rows ``+r`` and
    ``-r`` and ``down`` columns ``-c`` and ``+c`` adds ``-c·r·h``. The carry uses :data:`NEURONS` = 8 neurons,
    four ± pairs: two at scale ``s`` (rows ``±s/d``) and two at scale ``s₂ = s/``:data:`SECOND_RATIO` (rows
    ``±s₂/d``), each of the two on the even and on the odd features (zero elsewhere). Row ``i`` of ``down``
    gives the first pairs the entry ``c1[i]`` and the second pairs ``c2[i] = (1 − c1[i]·s)/s₂``, so
    ``c1·s + c2·s₂ = 1`` in every row and the carry adds ``-mean(h)`` (:meth:`columns`). With ``down``
    centered, ``x`` is then zero-mean and the norm reading it is exactly an RMSNorm. The MLP grows from
    ``hidden`` to ``hidden + added`` neurons, the next multiple of the ``carry_multiple`` option (8 by
    default) with room for the eight (the rest zero): for a width that is a multiple of 8 (every checkpoint
    measured) that is ``hidden + 8``, the width the four-neuron carry before round 65 took too; a width 1-4
    past a multiple of 8 takes one more block of 8 than it did, and ``carry_multiple=1`` adds exactly 8.

    Why two scales, with ``c1`` on each row's INT8_ASYM grid (round 64, in the product since round 65): a
    weight-only quantizer with a per-row grid (NNCF's ``compress_weights`` default, INT8_ASYM: each row of
    ``down`` on ``[min(w, 0), max(w, 0)]`` in 255 steps) rounds a constant column ``1/s`` differently in
    every row, and no ``s`` puts it on all rows' grids: the carry's gain then differs per output feature and
    the leaked mean is what the RMSNorm keeps (all-mpnet-base-v2, NNCF int8 weights: 1.093× the original's
    error with one scale). ``c1[i]`` is the point of row ``i``'s own grid (from the row's real entries, as
    exported: float32) nearest ``1/s``, which that quantizer keeps; the remainder ``c2[i]``, at most half a
    row step times ``SECOND_RATIO``, is rounded by at most half a step, a leak ``SECOND_RATIO`` times smaller
    than rounding ``1/s`` itself. Measured (256 texts, ratio to the original's int8 error): 1.093 → 1.051,
    0.961× the one-scale carry text for text; ONNX Runtime's dynamic int8 per tensor and per channel on
    all-MiniLM-L3/L6-v2 within noise of the one-scale carry (paired 0.986-1.014), although the columns are
    no longer whole per-tensor steps of ``down`` (``scale_for``'s reason for ``s``, which stays).

    Why each scale is split over even and odd features (round 61), not one pair of constant rows ``±s/d``:
    every int8 weight quantizer turns a constant row into one integer repeated (per channel: ±127
    everywhere), and x86 int8 GEMMs without VNNI (AVX2's ``vpmaddubsw``, ONNX Runtime's u8s8 kernels) add
    each *adjacent pair* of uint8 × int8 products in a saturating int16: ``2 × 127 × 255`` overflows it
    whenever both activations of a pair sit above the zero point, so the carry's mean came out clipped
    (all-MiniLM-L6-v2, ``quantize_dynamic`` per channel on an AVX2 machine: 11× the original's error;
    paraphrase-MiniLM-L3-v2 3.4×). A row that is zero on every other feature has at most one nonzero product
    per pair (``127 × 255`` fits), whatever the quantizer's grid.
    """

    NEURONS = 8  # the neurons the carry uses (four ± pairs: scales s and s/SECOND_RATIO, even and odd features)
    SECOND_RATIO = 16.0  # s / s₂, the second pairs' scale (round 64 measured 16; see the class docstring)

    site: str  # the norm made exact
    source: str  # the norm whose output's mean is carried
    up: str  # Linear d -> hidden
    down: str  # Linear hidden -> d
    features: int  # d
    hidden: int  # the MLP's width before
    added: int
    activation: str
    # the first pairs' rows are ``±scale/d`` and their columns ``∓c1`` with ``c1 ≈ 1/scale`` (:meth:`columns`):
    # exact for any scale > 0, since act(s·m) − act(−s·m) = s·m; :meth:`scale_for` picks it
    scale: float = 1.0

    @staticmethod
    def columns(real: Any, scale: float, ratio: float | None = None) -> tuple[Any, Any]:
        """The carry's ``down`` entries for each row, ``(c1, c2)`` (float64 ``[d]``): ``c1[i]`` the point of row
        ``i``'s INT8_ASYM grid (:func:`int8_asym_step` of the row's real entries ``real`` ``[d, hidden]``, as
        exported: float32) nearest ``1/scale``, at least one step; ``c2[i] = (1 − c1[i]·scale)/s₂`` with
        ``s₂ = scale/ratio`` (:data:`SECOND_RATIO` unless given: the benchmarks try others), so that
        ``c1·scale + c2·s₂ = 1`` in float64. A row without range (all zero) takes ``c1 = 1/scale`` in float32.
        One function for the surgery and the streamed rewrite."""
        import torch

        step = int8_asym_step(real)
        inv = torch.tensor(1.0 / float(scale), dtype=torch.float32)
        count = torch.clamp(torch.round(inv / torch.where(step > 0, step, torch.ones_like(step))), min=1)
        c1 = torch.where(step > 0, count * step, inv.expand_as(step)).double()
        s2 = float(scale) / (MeanCarry.SECOND_RATIO if ratio is None else ratio)
        return c1, (1 - c1 * float(scale)) / s2

    # the carry neuron's row may be at most this fraction of the MLP's longest ``up`` row (see scale_for)
    ROW_NORM_SHARE = 0.5

    @staticmethod
    def scale_for(down_weight: Any, up_weight: Any) -> float:
        """The carry scale ``s`` for a down projection ``[d, hidden]`` (its real columns, centered, as exported) and
        the up projection ``[hidden, d]`` that feeds it (its real rows). It starts from
        ``1/s = k·max|down|/127``, a whole number ``k ≥ 1`` of per-tensor int8 steps of ``down``, the *fewest* for
        which the carry neuron's ``up`` row (``s/d`` in each of ``d`` entries, length ``s/√d``) is at most
        half the longest row of ``up``, and never more than the smallest of ``down``'s row peaks allows;
        then it widens ``s`` as far as the same row bound and the per-tensor gain allow (:meth:`_widest`):
        the carry's gain after per-tensor rounding of both matrices stays as close to 1 as at ``k`` whole
        steps.

        Why, from the quantizers the columns, the rows and the activations meet:

        - ``down`` per tensor (ONNX Runtime's ``quantize_dynamic`` default, static QDQ: symmetric, step
          ``max|w|/127``): the carry is exact only if its columns keep their value; ``k`` whole steps
          quantize to exactly ``k`` steps (off the grid, all-mpnet-base-v2's power-of-two columns were
          rounded by up to 96%: 1.40× the original's int8 error).
        - the carry neurons' activations (dynamic uint8, one step for the whole intermediate, whose range
          its largest neurons set: 5-100 on all-mpnet-base-v2): each rounding error ``e`` lands, times
          ``1/s``, in the mean direction that the RMSNorm keeps, for every feature. So ``1/s`` as small as
          the grid allows (``k = 1``): the carry's activation ``s·mean(h)`` then spans as many uint8 steps
          as it can (measured on all-mpnet-base-v2, a torch replica of ORT: per channel 1.079 → 1.026×
          the original's error, per tensor 0.931 → 0.881).
        - the activation range: ``s`` must not make the carry the intermediate's largest neuron (it would
          widen every neuron's uint8 step, and a calibrated static range). By Cauchy-Schwarz a row ``r``
          gives at most ``‖r‖·‖h‖`` on the norm output ``h`` that all rows read, so a carry row no longer
          than half the longest real row stays inside the range the real neurons can reach (the weights'
          worst case, no data; on all-mpnet-base-v2's last layer ``k = 1`` would be 3.6× the longest row
          and measured 4.5× the intermediate's largest activation).
        - ``down`` per output channel: at most the smallest row peak, the columns set no row's scale, so
          the real weights keep the same row scales as in the unwidened MLP (columns of ``∓1`` would:
          MiniLM's W4 error 5× the original's).
        - ``up`` per tensor: the carry's entries ``s/d`` round to whole steps of ``up`` too, so after per-tensor
          rounding of both matrices the gain is ``round(P·x)·round(1/x)/P`` (``x = s·step_down``,
          ``P = 1/(d·step_down·step_up)``), piecewise constant in ``x``: ``k`` whole steps keep ``down``'s
          columns but not the gain where ``P`` is not whole. Widening ``s`` within the piece (or onto pieces
          no further from 1) costs per tensor no gain and makes the activations' rounding, divided by ``s``,
          smaller on every grid: on all-mpnet-base-v2 ``s`` grows 1.0-1.9× and ONNX Runtime's per-channel
          dynamic int8 error falls from 1.048 to 0.976× the original's (per tensor 0.902 → 0.948, still
          below the original; cause open). The same holds on the asymmetric uint8 grid (U8U8) with other
          steps, so :meth:`_widest` keeps both (round 65). Per channel the columns
          are off each row's grid at any ``s``, and their rounding grows with ``s``: a weight-only
          per-channel quantizer, which rounds no activations, pays it alone (NNCF int8 weights on
          all-mpnet-base-v2: 1.080 → 1.115).

        The step is taken from the float32 maximum, the precision models are exported and quantized in. The row
        bound is kept on a whole row of ``s/d`` (length ``s/√d``), although each carry row now holds ``s/d`` on
        every other feature only (length ``s·√⌈d/2⌉/d``, :attr:`NEURONS`): the scale, and so ``down``'s columns,
        are what they were with one pair of constant rows.
        """
        w = down_weight.detach().abs()
        peaks = w.amax(dim=1).double()
        peaks = peaks[peaks > 0]
        if peaks.numel() == 0:
            return 1.0
        step = float(peaks.max().float()) / 127  # the float32 maximum: what the quantizer reads
        k_most = max(1, math.floor(float(peaks.min()) / step))  # within every row's peak
        longest = float(up_weight.detach().double().norm(dim=1).max())
        d = w.shape[0]
        if longest <= 0:
            return 1.0 / (k_most * step)
        # s = 1/(k·step) with s/√d <= share·longest  <=>  k >= 1/(√d·share·longest·step)
        x_row = math.sqrt(d) * MeanCarry.ROW_NORM_SHARE * longest * step  # the row limit, as s·step
        k = max(1, min(k_most, math.ceil(1 / x_row * (1 - 1e-12))))
        u = up_weight.detach()
        u_peak = float(u.abs().max().float())
        if u_peak <= 0:
            return 1.0 / (k * step)
        dw = down_weight.detach()
        ranges = ((float(u.min().float()), float(u.max().float())), (float(dw.min().float()), float(dw.max().float())))
        return MeanCarry._widest(1.0 / k, x_row, d, step, ranges) / step

    # the relative margin kept from a per-tensor rounding boundary (the quantizers' float32 steps, the
    # conversion's centered readers moving ``up``'s range: 0-3% on MiniLM and all-mpnet-base-v2, 9% once)
    GAIN_MARGIN = 0.03
    # scales whose asymmetric per-tensor gain error is within this of the best count as equal (then the widest)
    GAIN_TIE = 0.01
    # the scales tried between the whole-step start and the row limit (log-spaced)
    GAIN_STEPS = 1024

    @staticmethod
    def _grid_steps(lo: float, hi: float, extra: float) -> tuple[float, float]:
        """The symmetric int8 step (``max|w|/127``) and the asymmetric uint8 step (``[min(w,0), max(w,0)]`` in
        255: ONNX Runtime's ``QUInt8`` weights) of a tensor spanning ``[lo, hi]`` once entries ``±extra`` are
        added (the carry's), in float32 as the quantizers store them."""
        lo, hi = min(lo, -extra, 0.0), max(hi, extra, 0.0)
        return _float32(max(-lo, hi) / 127), _float32((hi - lo) / 255)

    @staticmethod
    def _widest(x0: float, x_row: float, d: int, step: float,
                ranges: tuple[tuple[float, float], tuple[float, float]]) -> float:
        """The ``x = s·step`` (``step``: ``down``'s symmetric per-tensor int8 step) in ``[x0, x_row]`` for the carry:
        of the scales whose gain after symmetric int8 per-tensor rounding of both matrices is no further from 1
        than at ``x0`` (whole steps: the rule before round 65), those whose gain after *asymmetric uint8*
        per-tensor rounding, of both matrices or of the ``up`` rows alone, is within :attr:`GAIN_TIE` of the best;
        of these, the widest. Every gain is taken at ``x`` and ``x·(1 ± GAIN_MARGIN)``. ``ranges``: ``up``'s and
        ``down``'s ``(min, max)``.

        The carry's entries are ``ρ = s/d`` in ``up`` and ``c = 1/s`` in ``down`` (``ρ·c·d = 1``); after rounding
        the gain is ``round(ρ/a)·round(c/b)·a·b·d`` for ``up``'s step ``a`` and ``down``'s ``b``, piecewise
        constant in ``x``. The symmetric grid (step ``max|w|/127``: ONNX Runtime's U8S8 default, static QDQ)
        and the asymmetric one (``[min(w,0), max(w,0)]`` in 255 steps, a whole zero point: ``weight_type=
        QUInt8``, U8U8, ONNX Runtime's remedy for x86 CPUs without VNNI) have different steps, so a scale
        chosen for one lands anywhere on the other: with the symmetric gain alone kept, all-MiniLM-L6-v2's
        first carry kept 0.70 of the mean on the asymmetric grid (the model's U8U8 per-tensor error in ONNX
        Runtime 1.074× the original's; now 0.96 of the mean and the error 1.004×, 256 texts). ``up`` alone
        counts because a quantizer may round ``up`` per tensor and leave ``down`` float (all-mpnet-base-v2 in
        U8U8 with its FFN-output projections float: the carry's ``up`` rows cost 1.67× the original's error;
        a rule on both matrices' asymmetric gain alone took it to 2.2×). Within a piece a larger ``s`` costs
        per tensor nothing and spans more of the intermediate's uint8 steps, whose rounding the carry returns
        times ``1/s`` in the mean direction the RMSNorm keeps: hence the widest last.
        """
        if x_row <= x0:
            return x0
        (u_lo, u_hi), (d_lo, d_hi) = ranges
        m = MeanCarry.GAIN_MARGIN

        def errors(x: float) -> tuple[float, float]:
            """The worst gain errors at ``x`` (and ``x`` moved by the margin): symmetric of both matrices;
            asymmetric of both matrices or of the ``up`` rows alone, whichever is larger."""
            out = [0.0, 0.0]
            for f in (1 - m, 1.0, 1 + m):
                rho, col = x * f / (d * step), step / (x * f)
                for g in (0, 1):  # symmetric int8, asymmetric uint8
                    a = MeanCarry._grid_steps(u_lo, u_hi, rho)[g]
                    b = MeanCarry._grid_steps(d_lo, d_hi, col)[g]
                    gu = round(rho / a) * a / rho
                    out[g] = max(out[g], abs(gu * round(col / b) * b / col - 1), abs(gu - 1) if g else 0.0)
            return out[0], out[1]

        n = MeanCarry.GAIN_STEPS
        xs = [x0 * (x_row / x0) ** (i / n) for i in range(n + 1)]
        errs = [errors(x) for x in xs]
        keep = [(x, e) for x, e in zip(xs, errs, strict=True) if e[0] <= errs[0][0] + 1e-9]  # x0 is one: never empty
        best = min(e[1] for _, e in keep) + MeanCarry.GAIN_TIE
        return max(x for x, e in keep if e[1] <= best)


def _float32(v: float) -> float:
    """``v`` rounded to float32, as a quantizer stores a scale (``struct``: no torch needed here)."""
    return struct.unpack("f", struct.pack("f", v))[0]


@dataclass
class CenteredReader:
    """Make a Linear reader of an *approximate* norm blind to the mean its RMSNorm leaks.

    A LayerNorm's output is ``γ⊙u + β`` with ``u`` zero-mean. The RMSNorm that approximates it
    computes ``x / rms(x)``, which for an input of mean ``m`` is ``(σ/rms)·u + (m/rms)·1``: to first
    order the whole error is that one direction. The reader ``W n + c`` becomes
    ``W' = W·diag(γ)·P·diag(1/γ)`` with ``P = I − 11ᵀ/d`` and ``c' = c + (W − W')β``: equal on every
    LayerNorm output (exact for the original, since ``P u = u``), and zero on the leaked direction,
    which leaves the reader only the second-order scale error ``σ/rms − 1``.
    """

    site: str  # the approximate norm
    reader: str  # a Linear / Conv1D reading only its output, with a bias slot unless the norm has no β
    kind: str  # linear | conv1d


@dataclass
class ResidualFold:
    """Take a norm's β out of its RMSNorm where the norm's output is read by Linear readers and by
    residual adds (Post-LN: BERT's ``norm2(W h + c + n)``, :mod:`normswap.analysis.residual`).

    With ``n = g⊙u + b`` the converted norm's output: each reader ``R n + r`` takes ``R b`` in its bias,
    and each residual's other writer takes ``b`` in its own (``(W h + c + b) + g⊙u`` is the same sum), so
    every value after the norm is unchanged while the norm computes ``g⊙u`` alone: one ``Add`` less per
    norm in an exported graph. ``b`` is the value the converted norm holds when the fold runs, after
    calibration (the fitted bias of an approximate norm, β of an exact one), so the fold is exact for
    both. A candidate of the analysis; :func:`normswap.surgery.edits.fold_residual_beta` applies it and
    the site's ``beta_detail`` records it (``rms_bias`` false): loading needs nothing more, so it is not
    in the manifest.
    """

    site: str
    readers: list[str]  # Linear / Conv1D readers of the norm's output (each has a bias)
    reader_kinds: list[str]  # linear | conv1d, per reader
    writers: list[str]  # the Linear / Conv1D whose output each residual add sums with the norm's output
    writer_kinds: list[str]


@dataclass
class Untie:
    """Give ``module.attr`` its own copy of the tied parameter ``source`` before centering."""

    module: str
    attr: str
    source: str
    numel: int


@dataclass
class SitePlan:
    name: str
    class_name: str
    verdict: str
    reason: str
    normalized_shape: list[int]
    param_shape: list[int]
    eps: float
    flavour: str
    writers: list[str] = field(default_factory=list)
    readers: list[str] = field(default_factory=list)
    fold_beta: bool = False
    fold_gamma: bool = False
    convert: bool = False  # decided by the mode
    error: float | None = None  # exact: max |mean|/rms of the input seen; approximate: relative output error
    rms_weight: bool = False  # structure of the replacement RMSNorm (what loading rebuilds)
    rms_bias: bool = False
    beta_detail: str = ""  # where β went, per reader, and why (or why it stays in the RMSNorm)
    writer_targets: list[str] = field(default_factory=list)  # parameters centered for this stream
    linear_readers: list[str] = field(default_factory=list)  # Linear/Conv1D readers of the output
    # the output is read by its Linear readers alone (no other op, no model output), and each of them reads this
    # norm's output alone, on every call: one op on the output can stand for an op before each reader
    readers_alone: bool = False
    rotation_ready: bool = False  # the stream can take an orthogonal Q (see normswap.rotate)
    rotation_reason: str = ""  # why not, when it cannot
    rotation_outputs: list[str] = field(default_factory=list)  # model outputs the norm's output is (rotate's output=)
    rotation_ops: list[dict] = field(default_factory=list)  # where a centered stream takes its Q as an op
    rotation_upstream: list[str] = field(default_factory=list)  # writer targets that op turns (not their weights)
    extra_args: bool = False  # the norm's forward takes more than its input: the RMSNorm accepts (and ignores) it
    # what the norm returned when not its output alone (``{"type": "tuple", "items": ["output", "None"]}``,
    # normswap.nn.call_args.Returns): the RMSNorm returns the same structure
    returns: dict[str, Any] = field(default_factory=dict)
    # what the norm's input stream carries besides writers (one of STREAM_KINDS), read from the stream's terms: "" for
    # a norm the example inputs never called, and in a manifest written before round 61 (which did not record it)
    stream_kind: str = ""


def _placement(s: SitePlan) -> tuple[str, str]:
    """Where a norm's (β, γ) end up, for :meth:`Plan.table`: ``fold`` (into its readers), ``norm`` (kept in
    the norm), ``-`` (it has none, or the norm is not converted)."""
    if not s.convert:
        return "-", "-"
    has_gamma, has_beta = FLAVOUR_SLOTS.get(s.flavour, (True, True))
    return ("fold" if s.fold_beta else "norm") if has_beta else "-", \
        ("fold" if s.fold_gamma else "norm") if has_gamma else "-"


@dataclass
class Plan:
    sites: list[SitePlan] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)  # already-RMS norms etc.
    writer_edits: list[WriterEdit] = field(default_factory=list)
    folds: list[FoldEdit] = field(default_factory=list)
    hooks: list[CenterHook] = field(default_factory=list)
    unties: list[Untie] = field(default_factory=list)
    scale_folds: list[ScaleFold] = field(default_factory=list)  # LayerScale λ folded into writers (first)
    rms_folds: list[RmsFold] = field(default_factory=list)  # fold_gamma on already-RMS norms
    mean_carries: list[MeanCarry] = field(default_factory=list)  # MLPs widened to cancel a Post-LN mean
    beta_moves: list[BetaMove] = field(default_factory=list)  # value-projection β shares moved into an output bias
    bias_slots: list[BiasSlot] = field(default_factory=list)  # bias-less Linear readers given a bias for β
    centered_readers: list[CenteredReader] = field(default_factory=list)  # readers of approximate norms
    # position-table row means given back to the table and taken from a bias / class token with the same reach
    constant_trades: list[ConstantTrade] = field(default_factory=list)
    # runtime only (not in the manifest): Post-LN norms whose β may leave through the residual's writer
    residual_folds: list[ResidualFold] = field(default_factory=list)
    changed_outputs: list[str] = field(default_factory=list)
    # the feature axis (negative: counted from the end) of each changed output whose features do not lie
    # along its last axis: a channels-first (B, C, H, W) stream output (VitDet). Verification centres the
    # difference over this axis (surgery.verify.raw_stream_error); an output not listed uses its last axis
    changed_output_axes: dict[str, int] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    # orthogonal rotations applied after the conversion (normswap.rotate), one record per stream
    rotations: list[dict[str, Any]] = field(default_factory=list)
    # per Linear the conversion edited, what maps its input / output back to the original model's (the folded
    # γ / β of the norm it reads, the LayerScale λ, centering and balance of a writer's rows), so that an adapter
    # attached to it acts in the original basis (normswap.rotation.carry.AdapterBasis); not written when empty.
    # Structure only: a vector field ("gamma", "beta", "scale", "balance") names its tensor in adapter_vectors
    # (one name per norm site / λ, shared by the Linears that read it), "center" is True or the [lo, hi) blocks
    adapter_bases: dict[str, dict[str, Any]] = field(default_factory=dict)
    # runtime only (not in the manifest): the float64 vectors adapter_bases names; a checkpoint stores them in
    # the binary side file normswap_adapter_bases.safetensors (normswap.checkpoint.bases_io), not in config.json
    adapter_vectors: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # runtime only (not in the manifest): norms that were RMS from the start, with their streams'
    # writers and readers (verdict "rms"), and the output-feature axis of writers that no edit centers
    rms_sites: list[SitePlan] = field(default_factory=list)
    rotation_axes: dict[str, int] = field(default_factory=dict)

    def counts(self) -> dict[str, int]:
        c = Counter(s.verdict for s in self.sites)
        c["skipped"] += len(self.skipped)
        return {v: c.get(v, 0) for v in VERDICTS}

    def site(self, name: str) -> SitePlan:
        return next(s for s in self.sites if s.name == name)

    @property
    def untied_parameters(self) -> int:
        return sum(u.numel for u in self.unties)

    def conversion_line(self) -> str:
        """``converted N of M LayerNorm(s) (E exact, A approximate)``: the headline of a conversion."""
        done = [s for s in self.sites if s.convert]
        exact = sum(1 for s in done if s.verdict in EXACT_VERDICTS)
        return (f"converted {len(done)} of {len(self.sites)} LayerNorm(s) "
                f"({exact} exact, {len(done) - exact} approximate)")

    def summary(self, fmt: str | None = None) -> str:
        """One line: verdict counts and the edits. ``fmt`` is the checkpoint format the plan was written in,
        where that changes what is true (``"compat"`` keeps stock LayerNorms: a β not folded stays in the
        LayerNorm's bias, not in an RMSNorm)."""
        counts = ", ".join(f"{n} {v}" for v, n in self.counts().items() if n)
        extra = []
        if self.writer_edits:
            extra.append(f"{len(self.writer_edits)} writer tensors centered")
        folds = [f for f in self.folds if f.beta or f.gamma]
        if folds:
            extra.append(f"{len(folds)} reader folds")
        dropped = sum(f.beta_route == "dropped" for f in self.folds)
        if dropped:
            extra.append(f"β dropped at {dropped} key projection(s)")
        if self.beta_moves:
            extra.append(f"β moved through attention into {len(self.beta_moves)} output bias(es)")
        where = "stock LayerNorm bias(es)" if fmt == "compat" else "RMSNorm(s)"
        for why, because in ((BETA_KEPT_WHY, "folding would round worse in bf16"),
                             (BETA_KEEP_WHY, "beta_placement='keep'")):
            kept = sum(s.beta_detail.startswith(why) for s in self.sites)
            if kept:
                extra.append(f"β kept in {kept} {where} ({because})")
        residual = sum(RESIDUAL_WHY in s.beta_detail and s.fold_beta for s in self.sites)
        if residual:
            extra.append(f"β of {residual} Post-LN norm(s) folded into their readers and residual writers")
        if self.constant_trades:
            tables = len({t.table for t in self.constant_trades})
            extra.append(f"{len(self.constant_trades)} row mean(s) of {tables} table(s) traded into a bias or "
                         "a parameter reaching the same tokens")
        if self.hooks:
            extra.append(f"{len(self.hooks)} centering op(s)")
        if self.centered_readers:
            extra.append(f"{len(self.centered_readers)} reader(s) of approximate norms blind to the leaked mean")
        if self.rms_folds:
            extra.append(f"γ of {len(self.rms_folds)} RMS norm(s) folded")
        if self.scale_folds:
            kept = sum(f.keep for f in self.scale_folds)
            extra.append(f"{len(self.scale_folds) - kept} layer scale(s) folded" if not kept else
                         f"{kept} layer scale(s) kept (rebalanced)"
                         + (f", {len(self.scale_folds) - kept} folded" if kept < len(self.scale_folds) else ""))
        if self.mean_carries:
            widths = "/".join(sorted({str(c.added) for c in self.mean_carries}))
            extra.append(f"{len(self.mean_carries)} MLP(s) widened by {widths} neurons to cancel a Post-LN mean")
        if self.rotations:
            kinds = "/".join(sorted({r["kind"] for r in self.rotations}))
            extra.append(f"{len(self.rotations)} stream(s) rotated ({kinds})")
        if self.unties:
            extra.append(f"{len(self.unties)} tie(s) broken (+{self.untied_parameters:,} params)")
        return f"{len(self.sites)} LayerNorm(s): {counts or 'none'}" + (f"; {'; '.join(extra)}" if extra else "")

    def table(self, width: int | None = TABLE_WIDTH, *, verbose: bool = False, fmt: str | None = None) -> str:
        """Per-norm table, then the summary: what ``print(plan)`` and ``normswap inspect`` show.

        One row per norm: name, verdict, whether it is converted, where its β and γ end up (``fold``:
        into the readers; ``norm``: kept in the norm; ``-``: it has none, or the norm is not converted),
        how many writers and readers its stream has; its reason, whole, wrapped below the row. The lot
        fits ``width`` columns (``None``: no limit); a name too long for its column takes a line of its
        own. ``verbose`` adds each norm's eps, shape, flavour and stream kind (``stream_kind``), every writer
        and reader and where its β went and why, the centering ops and the broken ties. ``fmt``: see :meth:`summary`."""
        header = ("norm", "verdict", "convert", "β", "γ", "writers", "readers")
        rows = [((s.name, s.verdict, "yes" if s.convert else "no", *_placement(s), str(len(s.writers)),
                  str(len(s.readers))), s.reason) for s in self.sites]
        rows += [((sk["name"], "skipped", "no", "-", "-", "-", "-"), sk["reason"]) for sk in self.skipped]
        widths = [max([len(header[i])] + [len(cells[i]) for cells, _ in rows]) for i in range(len(header))]
        gap = "  "
        if width is not None:  # the name column takes what the others leave
            widths[0] = max(16, min(widths[0], width - sum(widths[1:]) - len(gap) * (len(header) - 1)))

        def row(cells: tuple[str, ...]) -> str:
            return gap.join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

        def wrapped(text: str, indent: str = "", first: str = "") -> list[str]:
            if width is None:
                return [first + text]
            return textwrap.wrap(text, width, initial_indent=first, subsequent_indent=indent,
                                 break_long_words=False, break_on_hyphens=False) or [first]

        total = sum(widths) + len(gap) * (len(header) - 1)
        lines = [row(header), "-" * (total if width is None else min(total, width))]
        for cells, reason in rows:
            if len(cells[0]) > widths[0]:
                lines += [cells[0], row(("", *cells[1:]))]
            else:
                lines.append(row(cells))
            lines += wrapped(reason, "    ", "    ")
        if verbose:
            for s in self.sites:
                stream = f", stream: {s.stream_kind}" if s.stream_kind else ""  # STREAM_KINDS ("": not recorded)
                lines += ["", *wrapped(f"{s.name} ({s.verdict}, eps={s.eps:g}, shape={s.normalized_shape}, "
                                       f"{s.flavour}{stream})", "  ")]
                lines += wrapped(f"writers: {', '.join(s.writers) or '-'}", "    ", "  ")
                lines += wrapped(f"readers: {', '.join(s.readers) or '-'}", "    ", "  ")
                if s.beta_detail:
                    lines += wrapped(f"β: {s.beta_detail}", "    ", "  ")
            for h in self.hooks:
                where = h.where if h.arg is None else f"{h.where} {h.arg}"
                if h.where == "residual":
                    where = f"residual sum of its input {h.arg} and its output"
                lines += wrapped(f"centering op: {h.module} ({where}): {h.reason}", "  ")
            for u in self.unties:
                lines += wrapped(f"untie: {u.module}.{u.attr} from {u.source} (+{u.numel:,} params)", "  ")
            for t in self.constant_trades:
                lines += wrapped(f"constant trade: {t.reason}", "  ")
            lines.append("")
        lines += wrapped(self.summary(fmt), "  ")
        if self.changed_outputs:
            lines += wrapped("changed by design (raw residual stream): " + ", ".join(self.changed_outputs), "  ")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """The manifest. Per-site stream details (``writer_targets``, ``linear_readers``) stay in memory:
        they grow with depth, which the streaming path's plan extrapolation does not model."""
        data = asdict(replace(self, adapter_vectors={}))  # the vectors go to a binary side file, not JSON
        data.pop("adapter_vectors")
        data.pop("rms_sites")
        data.pop("rotation_axes")
        data.pop("residual_folds")  # applied as weights; the sites' rms_bias and beta_detail record it
        if not data["adapter_bases"]:  # (manifests before round 54 have none; the low-memory proxies neither)
            data.pop("adapter_bases")
        for site in data["sites"]:
            for key in RUNTIME_SITE_FIELDS:
                site.pop(key, None)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        def blocks(b: Any) -> list[tuple[int, int]] | None:
            return None if b is None else [tuple(x) for x in b]

        return cls(
            sites=[SitePlan(**s) for s in data.get("sites", [])],
            skipped=list(data.get("skipped", [])),
            writer_edits=[WriterEdit(**{**e, "blocks": blocks(e["blocks"])}) for e in data.get("writer_edits", [])],
            folds=[FoldEdit(**f) for f in data.get("folds", [])],
            hooks=[CenterHook(**h) for h in data.get("hooks", [])],
            unties=[Untie(**u) for u in data.get("unties", [])],
            scale_folds=[ScaleFold(**f) for f in data.get("scale_folds", [])],
            rms_folds=[RmsFold(**f) for f in data.get("rms_folds", [])],
            mean_carries=[MeanCarry(**c) for c in data.get("mean_carries", [])],
            beta_moves=[BetaMove(**{**m, "runs": [tuple(r) for r in m["runs"]]}) for m in data.get("beta_moves", [])],
            centered_readers=[CenteredReader(**r) for r in data.get("centered_readers", [])],
            bias_slots=[BiasSlot(**b) for b in data.get("bias_slots", [])],
            constant_trades=[ConstantTrade(**t) for t in data.get("constant_trades", [])],
            changed_outputs=list(data.get("changed_outputs", [])),
            changed_output_axes={str(k): int(v) for k, v in data.get("changed_output_axes", {}).items()},
            options=dict(data.get("options", {})),
            rotations=[dict(r) for r in data.get("rotations", [])],
            adapter_bases={str(k): dict(v) for k, v in data.get("adapter_bases", {}).items()},
        )


# the fields of a Plan.adapter_bases record that name a vector of Plan.adapter_vectors (the rest is structure)
# ("turn_in" / "turn_out": a rotated stream's Q, d × d stored flat, since round 56)
ADAPTER_VECTOR_FIELDS = ("gamma", "beta", "scale", "balance", "turn_in", "turn_out")
# the binary side file of a checkpoint directory that holds Plan.adapter_vectors (normswap.checkpoint.bases_io)
ADAPTER_BASES_FILE = "normswap_adapter_bases.safetensors"
# Why an adapter on a Linear is refused (the "refuse" field of a Plan.adapter_bases record, since round 56): an
# edit the adapter bases do not model, so an adapter there could not act as on the original model. Each names
# what to do instead; none names a path (a checkpoint rebased to another class keeps the text as it is).
REFUSE_BETA_MOVED = ("the conversion carried a norm's β share of this bias-less value projection through attention "
                     "into the output projection's bias, which an adapter's update would have to follow; "
                     "beta_placement='keep' (--beta-placement keep) leaves β in the norm")
REFUSE_CENTERED_READER = ("its weight was centered to hide the mean an approximate RMSNorm leaks (Post-LN), so its "
                          "input is not the original's; mode='exact' (--mode exact) keeps that norm a LayerNorm")
REFUSE_MEAN_CARRY = ("the mean carry widened this MLP Linear by neurons the original has not (an adapter from the "
                     "original does not fit it); mean_carry=False (--no-mean-carry) converts without them")
REFUSE_RESIDUAL_BETA = ("a Post-LN norm's β was folded through the residual into this Linear's bias, so its input "
                        "lacks β; beta_placement='keep' (--beta-placement keep) leaves β in the norm")
REFUSE_AXIS = "its weight was centered along an axis an adapter's output map does not model"
REFUSE_CENTERED_TABLE = ("its table was centered (an embedding or convolution writer), and PEFT's adapter there "
                         "keeps its update in parameters no map reaches")
REFUSE_ROTATED = ("a rotation turned the residual stream it reads or writes (normswap.rotate / --rotate) in a way "
                  "the adapter bases do not record (a checkpoint rotated before round 56, smoothing or learned "
                  "scales / head rotations, a stream turned twice, an embedding table); attach and merge the adapter "
                  "(merge_and_unload) before rotating")


# the attribute a converted model carries its plan under (read and written only through the two
# functions below, so the storage can change without touching their callers)
_ATTRIBUTE = "_normswap_plan"


def plan_of(model: Any) -> Plan | None:
    """The plan ``normswap.patch``/``normswap.load`` applied to ``model`` (None for an unconverted model)."""
    return getattr(model, _ATTRIBUTE, None)


def attach_plan(model: Any, plan: Plan) -> None:
    """Record ``plan`` as the one applied to ``model`` (what :func:`plan_of` returns)."""
    setattr(model, _ATTRIBUTE, plan)
