"""Where a norm's β should live in a default conversion: folded into its readers' biases, or kept in the RMSNorm.

Both are exact in float64. They differ in what half precision rounds:

* **folded**: a reader ``y = W(γ⊙u + β) + c`` stores ``c' = c + Wβ`` and rounds that one vector. Its
  error is the rounding of a coherent sum, up to √d times that of its terms, and every token adds
  the same error.
* **kept** (the original's path): the model rounds ``W``, ``β`` and ``c`` apart and computes ``Wβ``
  from them, so the constant part of the reader's output is off by ``round(W)·round(β) − Wβ`` plus
  ``round(c) − c``, whose roundings partly cancel across the ``d`` inputs.

**The rule** (option ``beta_placement="rounding"``, the default of an in-memory ``patch``):
for each norm whose β the plan folds, sum both squared errors over the readers whose bias takes a
share (bfloat16, computed exactly from the weights in float64; no data), and keep β in the RMSNorm
where folding rounds worse by more than :data:`MARGIN`. A key projection that drops its share costs
nothing either way (softmax removes a constant key shift in both), and a share moved through attention
into an output projection is not scored (rare: a bias-less value projection). The decision is a
function of the weights alone, so the streaming path (which plans on random-weight proxies) takes it
again on the checkpoint's tensors and
reaches the same plan. ``beta_placement="fold"`` folds β wherever the readers can take it.

``beta_placement="keep"`` keeps every β in its norm: each reader's input is then the original's
(``γ⊙u + β``, with ``u`` the normalised stream, identical to LayerNorm's ``x̂`` on a centered stream) and
its bias is untouched. Activation quantizers scale to the reader's input per token or per tensor, and a
fold changes that input's range (``γ⊙u`` instead of ``γ⊙u + β``); int8 engines that keep biases in
float (CTranslate2, ONNX Runtime) then quantize a folded model differently from its original
(``docs/results/quantization.md``, Whisper in CTranslate2), and weight-only engines (bitsandbytes, HQQ,
GGUF, optimum-quanto) multiply their weight rounding error by that larger input. The cost is one add per
norm, which the fused RMS kernels of the engines take as their bias input or a following Add. It is the
default of every checkpoint ``convert`` writes (either format).

It applies to the default conversion only: with ``fold_gamma`` (rotation, quantization) β must
leave the norm, since a kept β would become ``β/γ`` there, and a norm already rotation-ready (no γ
to keep) stays so. A rotation asks for ``fold_gamma`` only on the streams it turns: the norms of the
others keep γ and are placed here as in a default conversion (``plan.options["gamma_kept"]``).
Measured on Whisper tiny.en: ``docs/results/field.md``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from normswap.analysis.linears import tensors_by_name
from normswap.analysis.plan import BETA_KEEP_WHY, BETA_KEPT_WHY, Plan, SitePlan

MARGIN = 1.0  # keep β where folding's squared rounding error exceeds the original path's by this factor
KEPT_WHY = BETA_KEPT_WHY
KEEP_WHY = BETA_KEEP_WHY

Tensor = Callable[[str], torch.Tensor]


def _round(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


def rounding_costs(weight: torch.Tensor, bias: torch.Tensor, beta: torch.Tensor, kind: str) -> tuple[float, float]:
    """(folded, kept): squared bf16 rounding error of one reader's constant output term ``c + Wβ``.

    ``kind``: ``linear`` (``weight`` is ``[out, in]``) or ``conv1d`` (``[in, out]``)."""
    w, c, b = weight.double(), bias.double(), beta.double()
    if kind == "conv1d":
        w = w.T
    exact = c + w @ b
    folded = _round(exact) - exact
    kept = (_round(w) @ _round(b) - w @ b) + (_round(c) - c)
    return float(folded.pow(2).sum()), float(kept.pow(2).sum())


def site_costs(plan: Plan, sp: SitePlan, tensor: Tensor, beta: torch.Tensor) -> tuple[float, float]:
    """(folded, kept) summed over the readers of ``sp`` whose bias takes a share of β."""
    folded = kept = 0.0
    for f in plan.folds:
        if f.site == sp.name and f.beta:  # a share in a bias (or a bias slot)
            a, b = rounding_costs(*tensors_by_name(f.reader, tensor), beta, f.kind)
            folded, kept = folded + a, kept + b
    return folded, kept


def applies(plan: Plan, sp: SitePlan) -> bool:
    """Is ``sp`` a norm the rule decides for? (β folded in a default conversion, γ kept in the RMSNorm; or a
    norm whose γ a rotation keeps because it leaves its stream alone: planned as in a default conversion.)"""
    gamma_asked = plan.options.get("fold_gamma") and sp.name not in (plan.options.get("gamma_kept") or {})
    return sp.fold_beta and not sp.fold_gamma and not gamma_asked and not sp.rotation_ready


def keep_beta(plan: Plan, sp: SitePlan, why: str) -> None:
    """Undo the β fold of ``sp``: its readers keep their biases, the RMSNorm keeps β (``rms_bias``)."""
    sp.fold_beta = False
    sp.beta_detail = why
    plan.folds = [f for f in plan.folds if f.site != sp.name or f.gamma]
    plan.beta_moves = [m for m in plan.beta_moves if m.site != sp.name]
    plan.bias_slots = [s for s in plan.bias_slots if s.site != sp.name]


def place_beta(plan: Plan, tensor: Tensor, beta_of: Callable[[str], torch.Tensor | None],
               placement: str = "rounding", keep: dict[str, str] | None = None) -> list[str]:
    """Apply the rule to every norm of ``plan`` it decides for (``placement="fold"``: to none;
    ``placement="keep"``: every such norm keeps β); returns the norms that keep β.
    ``plan.options["beta_placement"]`` records which placement ran.

    ``tensor(name)``: a parameter of the original model by name; ``beta_of(norm)``: that norm's β.
    Both read the original weights (before any edit): the in-memory path from the working copy, the
    streaming path from the checkpoint. ``keep``: norms that keep β for a reason of the model's
    structure, with that reason (a fused kernel reads β from the norm itself: PyTorch's
    ``nn.TransformerEncoderLayer``; the readers are a task head the base model loads without:
    :func:`head_readers`).
    """
    plan.options["beta_placement"] = placement
    if placement == "fold":  # β leaves every norm whose readers can take it
        return []
    kept = []
    for sp in plan.sites:
        if not applies(plan, sp):
            continue
        if (keep and sp.name in keep) or placement == "keep":
            keep_beta(plan, sp, keep[sp.name] if keep and sp.name in keep else KEEP_WHY)
            kept.append(sp.name)
            continue
        beta = beta_of(sp.name)
        if beta is None:
            continue
        folded, original = site_costs(plan, sp, tensor, beta)
        if folded > MARGIN * original:
            keep_beta(plan, sp, f"{KEPT_WHY} (squared error {folded:.3g} folded vs {original:.3g} kept)")
            kept.append(sp.name)
    return kept


HEAD_WHY = ("kept in the RMSNorm: its readers are in the task head (`{head}`), and the base model loaded "
            "without that head (AutoModel, another task class) would miss it in its last hidden state")


def head_readers(plan: Plan, model: nn.Module) -> dict[str, str]:
    """Norms of ``model``'s base model whose β the plan folds into a reader outside it (a task head:
    BERT's MLM transform, ViT's classifier), with the reason to keep β instead.

    A checkpoint is loaded under other head classes of its base model (a masked LM fine-tuned as a
    classifier): the base model then must compute what the stock one computes. A β folded into a head
    it does not have would be lost there, and the kept β costs one add in the RMSNorm. Models without
    a base model (a custom ``nn.Module``, a bare ``BertModel``) get no such norm."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix or not isinstance(getattr(model, prefix, None), nn.Module):
        return {}
    inside = f"{prefix}."
    keep: dict[str, str] = {}
    for f in plan.folds:
        if f.beta and f.site.startswith(inside) and not f.reader.startswith(inside):
            keep.setdefault(f.site, HEAD_WHY.format(head=f.reader))
    return keep


def place_residual(plan: Plan, placement: str, model: nn.Module, keep: dict[str, str] | None = None) -> None:
    """Which :class:`~normswap.analysis.plan.ResidualFold` candidates run: all of them with ``"fold"``, none
    otherwise (an exact norm that keeps β for its residual reader says that ``fold`` would fold it:
    :data:`~normswap.analysis.plan.RESIDUAL_HINT`), and never
    one that would move β from the base model into a task head (as :func:`head_readers`), nor one of the
    norms ``keep`` names (a fused kernel reads β from the norm).

    Opt-in, unlike the bias folds the rounding rule decides: the low-memory path does not rewrite the
    residual writers (it refuses ``"fold"`` where a candidate exists), and ``patch`` must write the same
    tensors as ``convert`` for the same options whichever path runs."""
    if placement != "fold":
        plan.residual_folds = []
        return
    plan.residual_folds = [rf for rf in plan.residual_folds if not keep or rf.site not in keep]
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix or not isinstance(getattr(model, prefix, None), nn.Module):
        return
    inside = f"{prefix}."
    plan.residual_folds = [rf for rf in plan.residual_folds if not rf.site.startswith(inside)
                           or all(p.startswith(inside) for p in (*rf.readers, *rf.writers))]
