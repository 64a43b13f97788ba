"""Compare an original and a converted model's outputs: the figures every conversion reports.

Figures (on the model's primary output: ``logits`` when there is one, else the first floating
output that is not a raw residual stream):
``max_abs_error``, ``max_rel_error`` (max abs error / max abs reference), ``rel_rms_error``
(‖error‖ / ‖reference‖), ``kl`` (mean KL of the
softmax over the last dim, reference ‖ converted), ``top1_agreement``. Given the probe's
``attention_mask``, figures of per-token outputs count the real tokens, not the padding.
"""

from __future__ import annotations

import contextlib
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from normswap.analysis.plan import SitePlan
from normswap.analysis.trace import flatten_outputs
from normswap.errors import VerificationFailed

# fp64 reference vs converted fp64 copy: anything above this is a bug, not rounding
EXACT_TOLERANCE = {torch.float64: 1e-6, torch.float32: 2e-3, torch.bfloat16: 5e-2, torch.float16: 2e-2}
# |mean| / rms of a stream whose writers were centered, per working dtype
ZERO_MEAN_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def figure(value: float, digits: int = 4) -> str:
    """``value`` with ``digits`` significant digits, or more where those would round it to a whole
    number it is not: a cosine of 0.999997 prints as ``0.999997``, not ``1`` (only an exact 1 is 1)."""
    text = f"{value:.{digits}g}"
    while digits < 15 and float(text) != value and float(text).is_integer():
        digits += 1
        text = f"{value:.{digits}g}"
    return text


def exact_limit(dtype: torch.dtype) -> float:
    """The largest relative output error an *exact* conversion computed in ``dtype`` may show, whatever
    the model: the ceiling of :func:`precision_limit`, and the tolerance where none was derived."""
    return EXACT_TOLERANCE.get(dtype, 1e-3)


# how many times the original's own rounding error an exact conversion may show: the converted model
# rounds its (edited) weights once more and computes in another order; measured ratios stay under ~4
PRECISION_FACTOR = 16


def precision_limit(dtype: torch.dtype, own_error: float | None) -> float:
    """The tolerance of an exact conversion computed in ``dtype``, from what that precision explains for
    this model: :data:`PRECISION_FACTOR` times ``own_error`` (the original's own relative error in ``dtype``
    against float64 on the same inputs, or :func:`rounding_error`'s estimate of it), at least that factor
    times the dtype's machine epsilon, at most :func:`exact_limit`. A genuine float32 conversion of GPT-2
    shows ~3e-7 against an own error of ~3e-7; one weight matrix scaled by 1.01 shows ~2.5e-4, which a flat
    2e-3 let through. float64 (nothing finer to measure against) and ``own_error=None`` keep
    :func:`exact_limit`."""
    if own_error is None or dtype == torch.float64 or not dtype.is_floating_point:
        return exact_limit(dtype)
    floor = PRECISION_FACTOR * torch.finfo(dtype).eps
    return min(exact_limit(dtype), max(PRECISION_FACTOR * own_error, floor))


def rounding_error(model: torch.nn.Module, run: Any, reference: Any, dtype: torch.dtype,
                   skip: set[str] = frozenset(), seed: int = 0, worst: bool = False) -> float:
    """An estimate of the relative output error ``dtype``'s rounding alone causes in ``model``, for
    :func:`precision_limit` where no float64 run is affordable (a working copy in float32 because a float64
    one would not fit): ``run()`` once more with the output of every module that holds parameters
    multiplied by ``1 ± eps/2`` (random signs: one rounding of each result, the backward-error model of
    floating point), compared with ``reference`` (its unperturbed outputs). On GPT-2, BERT and tiny
    presets it lands within 1.3x of the measured float32-vs-float64 error. The figure is the primary
    output's (:func:`compare`'s ``max_rel_error``), or with ``worst`` the worst over every compared output."""
    unit = torch.finfo(dtype).eps / 2
    gen = torch.Generator().manual_seed(seed)

    def perturb(module: torch.nn.Module, args: Any, output: Any) -> Any:
        if not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return None
        signs = torch.randint(0, 2, output.shape, generator=gen).to(output.device, output.dtype) * 2 - 1
        return output * (1 + unit * signs)

    handles = [m.register_forward_hook(perturb) for m in model.modules()
               if next(m.parameters(recurse=False), None) is not None]
    try:
        perturbed = run()
    finally:
        for h in handles:
            h.remove()
    figs = compare(reference, perturbed, skip)  # every output by default: a raw stream rounds as any other
    return float(figs.get("worst_rel_error_any_output" if worst else "max_rel_error", 0.0))


def gate(converted: list[SitePlan], figures: dict[str, Any], dtype: torch.dtype, limit: float | None = None) -> None:
    """Refuse a conversion that misses its tolerance: an exact norm whose input is not zero-mean, or,
    when every converted norm is exact, outputs further from the original than ``limit`` (by default
    :func:`exact_limit`; ``patch`` passes :func:`precision_limit` when it verifies below float64)."""
    tol = ZERO_MEAN_TOLERANCE.get(dtype, 1e-4)
    bad = [sp for sp in converted if sp.verdict != "approximate" and sp.error is not None and sp.error > tol]
    if bad:
        raise VerificationFailed(
            f"verification failed: `{bad[0].name}` was planned exact but its input is not zero-mean "
            f"(|mean|/rms = {bad[0].error:.2e}); model left unchanged. Please report this model; "
            "mode='exact' with verify=False skips the check")
    limit = exact_limit(dtype) if limit is None else limit
    if all(sp.verdict != "approximate" for sp in converted) and "max_rel_error" in figures:
        if figures["max_rel_error"] > limit:
            raise VerificationFailed(
                f"verification failed: converted outputs differ from the original by "
                f"{figures['max_rel_error']:.2e} (relative, tolerance {limit:.3g}) on `{figures.get('output')}`; "
                "model left unchanged")
    if all(sp.verdict != "approximate" for sp in converted) and \
            figures.get("raw_stream_rel_error", 0.0) > limit:
        raise VerificationFailed(
            f"verification failed: a raw residual-stream output differs from the original by more than a "
            f"per-token constant ({figures['raw_stream_rel_error']:.2e}, relative); model left unchanged. "
            "Please report this model")


def gate_text(converted: list[SitePlan], dtype: torch.dtype, verify: bool = True,
              own_error: float | None = None, how: str = "") -> tuple[float | None, str]:
    """The relative output tolerance :func:`gate` holds these converted norms to in ``dtype`` (None where
    it holds them to none), and a clause saying what was gated, for the precision statement. With
    ``own_error`` (what ``dtype``'s rounding costs the original, measured ``how``), the tolerance is
    :func:`precision_limit`'s and the clause says how it was derived."""
    if not verify:
        return None, "not gated (verify=False)"
    if all(sp.verdict != "approximate" for sp in converted):
        limit = precision_limit(dtype, own_error)
        return limit, f"tolerance {limit:.3g} relative" + (derived_text(dtype, own_error, how)
                                                            if own_error is not None and dtype != torch.float64 else "")
    zero = ZERO_MEAN_TOLERANCE.get(dtype, 1e-4)
    return None, (f"exact norms' inputs zero-mean within {zero:g} (|mean|/rms); approximate norms measured, "
                  "held to no output tolerance")


# the seed every verification forward runs under (see :func:`same_draws`)
VERIFY_SEED = 0


@dataclass
class Draws:
    """Whether the forwards run under :func:`same_draws` drew random numbers (set when the block exits)."""

    drew: bool = False


def _rng_states() -> list[Any]:
    states: list[Any] = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    states.append(random.getstate())
    numpy = sys.modules.get("numpy")  # a model drawing from numpy has imported it
    if numpy is not None:
        states.append(numpy.random.get_state(legacy=False))
    return states


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(map(_same_state, a, b))
    equal = a == b
    return bool(equal.all()) if hasattr(equal, "all") else bool(equal)  # numpy arrays compare elementwise


def held_generators(*models: Any) -> list[Any]:
    """The random generators ``models``' modules hold as attributes (``self.generator = torch.Generator()``,
    a NumPy ``Generator`` or ``RandomState``; also inside a list, tuple or dict attribute), each once, in
    module order: the same order in a model and its copy."""
    numpy = sys.modules.get("numpy")
    kinds: tuple[type, ...] = (torch.Generator,)
    if numpy is not None:
        kinds += (numpy.random.Generator, numpy.random.RandomState)
    found: dict[int, Any] = {}
    for model in models:
        for module in model.modules() if isinstance(model, torch.nn.Module) else ():
            for value in vars(module).values():
                items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) \
                    else (value,)
                for item in items:
                    if isinstance(item, kinds):
                        found.setdefault(id(item), item)
    return list(found.values())


def _seed_held(gens: list[Any], seed: int) -> list[tuple[Any, Any]]:
    """Seed each of ``gens`` with ``seed + k``; their states before, to restore."""
    saved = []
    for k, gen in enumerate(gens):
        if isinstance(gen, torch.Generator):
            saved.append((gen, gen.get_state()))
            gen.manual_seed(seed + k)
        elif hasattr(gen, "bit_generator"):  # numpy.random.Generator
            saved.append((gen, gen.bit_generator.state))
            gen.bit_generator.state = type(gen.bit_generator)(seed + k).state
        else:  # numpy.random.RandomState
            saved.append((gen, gen.get_state()))
            gen.seed(seed + k)
    return saved


def _held_state(gen: Any) -> Any:
    if isinstance(gen, torch.Generator):
        return gen.get_state()
    return gen.bit_generator.state if hasattr(gen, "bit_generator") else gen.get_state()


def _restore_held(saved: list[tuple[Any, Any]]) -> None:
    for gen, state in saved:
        if isinstance(gen, torch.Generator):
            gen.set_state(state)
        elif hasattr(gen, "bit_generator"):
            gen.bit_generator.state = state
        else:
            gen.set_state(state)


@contextlib.contextmanager
def same_draws(*models: Any, seed: int = VERIFY_SEED) -> Iterator[Draws]:
    """Run the block with every random number generator the model draws from seeded with ``seed``.

    A model that draws random numbers in eval mode (ViT-MAE's random patch masking: ``torch.rand``,
    ``randn``, ``randperm``, ``multinomial``, ``bernoulli``, ``normal_``...) computes something else on
    every call: compared run for run, the original would differ from itself, and a correct conversion
    would fail. Every forward that verification compares (the original's and the converted model's)
    runs under this, so both see the same draws. Seeded: torch's default generators (CPU, and CUDA where
    initialised), NumPy's global generator (``np.random.rand``), Python's ``random``, and the generators
    ``models`` hold (:func:`held_generators`: ``torch.rand(..., generator=self.generator)``; the k-th
    with ``seed + k``, so a model and its copy draw alike). Each is restored after the block (the user's
    random streams are untouched). ``Draws.drew`` says whether the forwards drew from any of them, for the
    report. Not reachable: a generator seeded from the system on each call (``torch.seed()``,
    ``np.random.default_rng()``) or held outside the model; :func:`unseeded_randomness` names that case."""
    draws = Draws()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # never initialise CUDA for a CPU model
    numpy = sys.modules.get("numpy")
    py_state = random.getstate()
    np_state = numpy.random.get_state(legacy=False) if numpy is not None else None
    held = held_generators(*models)
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count())) if cuda else []):
        if cuda:
            torch.manual_seed(seed)
        else:
            torch.random.default_generator.manual_seed(seed)
        random.seed(seed)
        if numpy is not None:
            numpy.random.seed(seed)
        saved = _seed_held(held, seed)
        before = _rng_states() + [_held_state(g) for g in held]
        try:
            yield draws
        finally:
            after = _rng_states() + [_held_state(g) for g in held]
            draws.drew = len(before) != len(after) or not all(
                _same_state(a, b) for a, b in zip(before, after, strict=False))
            _restore_held(saved)
            random.setstate(py_state)
            if numpy is not None:
                numpy.random.set_state(np_state)


RANDOM_NOTE = ("the model draws random numbers in eval mode; the original and the converted model ran with "
               f"the same seeded draws (torch's, NumPy's and Python's generators and those the model holds, "
               f"seeded from {VERIFY_SEED} before each run)")


def unseeded_randomness(run: Callable[[], Any], dtype: torch.dtype, *models: Any) -> str | None:
    """Why a model's outputs cannot be compared run for run, or None: ``run()`` (the original on the inputs
    it was compared on; ``models``: the ones it runs) twice under :func:`same_draws`. Outputs that differ
    by more than ``dtype``'s :func:`exact_limit` come from random numbers no seed reaches (a generator
    seeded from the system on each call), so verification cannot tell a conversion's error from the
    model's own variation. The sentence says how far the original is from itself and how to switch the
    randomness off."""
    with torch.no_grad():
        with same_draws(*models):
            first = run()
        with same_draws(*models):
            second = run()
    figs = compare(first, second, set())
    worst = max(figs.get("worst_rel_error_any_output", 0.0), figs.get("max_rel_error", 0.0))
    if worst <= exact_limit(dtype):
        return None
    return (f"the original itself differs by {worst:.2e} (relative) between two runs on the same inputs with every "
            "seed normswap sets fixed (torch's, NumPy's, Python's and the generators the model holds): it draws "
            "random numbers from a generator seeded anew on each call (torch.seed(), numpy.random.default_rng(), "
            "os.urandom), which no seed reaches. Switch that randomness off where the model offers it (a noise= "
            "input, a config option such as ViT-MAE's mask_ratio=0) or draw it from torch's generator, and convert "
            "again")


def derived_text(dtype: torch.dtype, own_error: float, how: str, whose: str = "the original's") -> str:
    """`` (= ...)``: how :func:`precision_limit` got the tolerance, for the precision statement (``whose``
    rounding error ``own_error`` is: the original's, or a reloaded checkpoint's)."""
    name = str(dtype).removeprefix("torch.")
    return (f" (= min({exact_limit(dtype):g}, max({PRECISION_FACTOR} x {whose} own {name} error "
            f"{own_error:.2g}{' ' + how if how else ''}, {PRECISION_FACTOR} x {name} eps)))")


PRIMARY_KEYS = ("logits", "logits_per_image", "pooler_output", "image_embeds", "text_embeds",
                "last_hidden_state", "prediction_logits", "start_logits")


def comparable(obj: Any, skip: set[str]) -> dict[str, torch.Tensor]:
    """Floating outputs worth comparing: not cached keys/values, not documented raw-stream outputs. A
    complex output (a spectrogram, an FFT of the stream) is compared as real numbers: its real and
    imaginary parts interleaved along the last axis (:func:`as_real`)."""
    return {k: as_real(v) for k, v in flatten_outputs(obj)
            if (v.is_floating_point() or v.is_complex()) and k not in skip and "past_key_values" not in k
            and not k.startswith("hidden_states") and "encoder_hidden_states" not in k}


def as_real(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when real; a complex ``t`` of shape ``(..., n)`` as ``(..., 2n)`` real numbers (each
    element's real and imaginary part side by side), so every error figure of a complex output is the
    figure of its components, relative to the largest component."""
    if not t.is_complex():
        return t
    real = torch.view_as_real(t.resolve_conj())
    return real.reshape(*t.shape[:-1], -1) if t.dim() else real


def primary_key(outputs: dict[str, torch.Tensor]) -> str | None:
    """The output that stands for the model in summaries: a conventional name (:data:`PRIMARY_KEYS`), else
    the first output that varies. An output constant over the batch says nothing about the conversion
    (PE-Audio's ``logits_audio_text`` is all zero while its logit scale is zero): its cosine or agreement
    would call any conversion unusable."""
    ordered = [k for k in PRIMARY_KEYS if k in outputs] + [k for k in outputs if k not in PRIMARY_KEYS]
    varying = (k for k in ordered if outputs[k].numel() > 1 and bool((outputs[k] != outputs[k].reshape(-1)[0]).any()))
    return next(varying, next(iter(ordered), None))


def difference(reference: torch.Tensor, converted: torch.Tensor) -> torch.Tensor:
    """``converted − reference`` (float64) where an entry equal in both, infinities included (or NaN in
    both), differs by 0, and any other NaN counts as an infinite difference. Masked logits (``-inf`` in
    both: Grounding DINO's padded text positions) made every error figure NaN, and a NaN error is never
    above a tolerance: the check could not fail."""
    ref, out = reference.detach().double(), converted.detach().double()
    same = (out == ref) | (torch.isnan(out) & torch.isnan(ref))
    diff = torch.where(same, torch.zeros_like(ref), out - ref)
    return torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)


def _finite(t: torch.Tensor) -> torch.Tensor:
    return t[torch.isfinite(t)]


def figures(reference: torch.Tensor, converted: torch.Tensor) -> dict[str, float]:
    ref, out = reference.detach().double(), converted.detach().double()
    diff = difference(ref, out)
    worst = float(diff.abs().max()) if diff.numel() else 0.0
    scale = float(_finite(ref).abs().max()) if _finite(ref).numel() else 0.0  # the reference's own size
    norm = float(_finite(ref).norm()) if ref.numel() else 0.0
    result = {
        "max_abs_error": worst,
        "max_rel_error": worst / scale if scale > 0 else 0.0,
        # ‖out − ref‖ / ‖ref‖ over the whole output: the stable figure for comparing two roundings
        "rel_rms_error": float(diff.norm()) / norm if norm > 0 else 0.0,
    }
    if ref.dim() >= 1 and ref.shape[-1] > 1 and ref.numel():
        result["kl"] = float(token_kl(ref, out).mean())
        result["top1_agreement"] = float((ref.argmax(-1) == out.argmax(-1)).double().mean())
    return result


def token_kl(reference_logits: torch.Tensor, converted_logits: torch.Tensor) -> torch.Tensor:
    """``KL(softmax(reference) ‖ softmax(converted))`` over the last dim, per row, in float64, never below 0.

    A divergence is non-negative; the sum ``Σ p (log p − log q)`` of two nearly equal distributions can
    round to a tiny negative number (``-4.5e-17``), which says nothing, so each row is clamped at 0.
    Classes the reference gives probability 0 add nothing (``0 · log 0 = 0``): masked logits of ``-inf``
    in both (Grounding DINO's padded text positions) made the sum NaN."""
    logp_ref = torch.log_softmax(reference_logits.detach().double(), -1)
    logp_out = torch.log_softmax(converted_logits.detach().double(), -1)
    p = logp_ref.exp()
    terms = torch.where(p > 0, p * (logp_ref - logp_out), torch.zeros_like(p))
    return terms.sum(-1).clamp_min(0.0)


def max_rel_error(reference: torch.Tensor, converted: torch.Tensor) -> float:
    """``max |converted − reference| / max |reference|`` (the ``max_rel_error`` of :func:`figures`
    without the softmax figures, for outputs that only count towards the worst case)."""
    ref, out = reference.detach().double(), converted.detach().double()
    if not ref.numel():
        return 0.0
    scale = float(_finite(ref).abs().max()) if _finite(ref).numel() else 0.0
    return float(difference(ref, out).abs().max()) / scale if scale > 0 else 0.0


def rel_rms_error(reference: torch.Tensor, converted: torch.Tensor) -> float:
    """``‖converted − reference‖ / ‖reference‖`` (the ``rel_rms_error`` of :func:`figures`)."""
    ref, out = reference.detach().double(), converted.detach().double()
    norm = float(_finite(ref).norm()) if ref.numel() else 0.0
    return float(difference(ref, out).norm()) / norm if norm > 0 else 0.0


def embedding_cosine(reference: torch.Tensor, converted: torch.Tensor,
                     attention_mask: torch.Tensor | None = None) -> float:
    """Mean cosine between masked mean-pooled ``[batch, seq, hidden]`` states: what sentence
    encoders compare (their embeddings are pooled hidden states, not ``pooler_output``)."""
    ref, out = reference.detach().double(), converted.detach().double()
    if attention_mask is None or tuple(attention_mask.shape) != tuple(ref.shape[:2]):
        mask = torch.ones(ref.shape[:2], dtype=torch.float64)
    else:
        mask = attention_mask.detach().double()
    mask = mask.unsqueeze(-1)
    pooled_ref = (ref * mask).sum(1) / mask.sum(1).clamp_min(1)
    pooled_out = (out * mask).sum(1) / mask.sum(1).clamp_min(1)
    return float(torch.nn.functional.cosine_similarity(pooled_ref, pooled_out, dim=-1).mean())


def task_figures(ref: dict[str, torch.Tensor], out: dict[str, torch.Tensor], keys: list[str],
                 attention_mask: torch.Tensor | None = None) -> dict[str, float]:
    """The figure each family's users compare, next to the generic ones.

    LMs: ``kl`` and ``top1_agreement`` on ``logits`` (always reported). Classifiers (2-D logits):
    ``class_agreement``. Encoders: ``embedding_cosine`` (masked mean-pooled ``last_hidden_state``) and
    ``last_hidden_state_rel_error``. Seq2seq: ``encoder_state_rel_error``.
    """
    result: dict[str, float] = {}
    if "logits" in keys and ref["logits"].dim() == 2:
        result["class_agreement"] = float((ref["logits"].argmax(-1) == out["logits"].argmax(-1)).double().mean())
    if "last_hidden_state" in keys and ref["last_hidden_state"].dim() == 3:
        result["embedding_cosine"] = embedding_cosine(ref["last_hidden_state"], out["last_hidden_state"],
                                                      attention_mask)
        result["last_hidden_state_rel_error"] = rel_rms_error(
            real_tokens(ref["last_hidden_state"], attention_mask), real_tokens(out["last_hidden_state"],
                                                                               attention_mask))
    if "encoder_last_hidden_state" in keys:
        result["encoder_state_rel_error"] = rel_rms_error(
            real_tokens(ref["encoder_last_hidden_state"], attention_mask),
            real_tokens(out["encoder_last_hidden_state"], attention_mask))
    return result


def real_tokens(t: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The rows of ``t`` (``[batch, seq, ...]``) at the real tokens of ``attention_mask`` (``[batch,
    seq]``), as ``[tokens, ...]``; ``t`` unchanged when there is no mask or it does not fit."""
    if attention_mask is None or t.dim() < 3 or tuple(t.shape[:2]) != tuple(attention_mask.shape):
        return t
    return t[attention_mask.to(device=t.device, dtype=torch.bool)]


def compare(reference: Any, converted: Any, skip: set[str] = frozenset(),
            attention_mask: torch.Tensor | None = None, axes: dict[str, int] | None = None) -> dict[str, Any]:
    """Figures for the primary output, the family's own figures (:func:`task_figures`), and the
    worst relative error over every compared output. With ``attention_mask``, the figures of
    ``[batch, seq, ...]`` outputs count the real tokens only (padding is not what users compare).
    ``skip`` are the outputs the conversion changes by design (``Plan.changed_outputs``), ``axes`` their
    feature axes where not the last (``Plan.changed_output_axes``): see :func:`raw_stream_error`."""
    ref, out = comparable(reference, set(skip)), comparable(converted, set(skip))
    keys = [k for k in ref if k in out and ref[k].shape == out[k].shape]

    def real(t: torch.Tensor) -> torch.Tensor:
        return real_tokens(t, attention_mask)

    streams = raw_stream_error(reference, converted, skip, real, axes)
    if not keys:
        return {"compared": [], **streams}
    key = primary_key({k: ref[k] for k in keys})

    result: dict[str, Any] = {"output": key, **figures(real(ref[key]), real(out[key]))}
    result.update(task_figures(ref, out, keys, attention_mask))
    result["worst_rel_error_any_output"] = max(
        result["max_rel_error"] if k == key else max_rel_error(real(ref[k]), real(out[k])) for k in keys)
    result["compared"] = keys
    result.update(streams)
    return result


def raw_stream_error(reference: Any, converted: Any, changed: set[str], real: Any,
                     axes: dict[str, int] | None = None) -> dict[str, float]:
    """``raw_stream_rel_error``: how far the outputs the plan changes by design (raw residual streams,
    ``Plan.changed_outputs``) are from what the design allows. Centering a writer subtracts, at each
    token, a constant from every feature of its output, so such a stream may differ from the original
    only along the all-ones direction: the figure is ``max |P(converted − original)| / max |original|``
    with ``P`` removing each token's mean over the features, worst over those outputs (0 in exact
    arithmetic for an exact conversion). Empty when the model has no such output. This is what a model
    whose only output is its raw stream (VideoMAE's base model) is verified on.

    The features lie along the axis the analysis found for each output (``axes``, from
    ``Plan.changed_output_axes``: a channels-first (B, C, H, W) stream output is centred over C), else
    along the last axis. ``real`` (padding removal) keeps the trailing axes, so negative axes stay valid."""
    ref, out = dict(flatten_outputs(reference)), dict(flatten_outputs(converted))
    keys = [k for k in changed if k in ref and k in out and ref[k].is_floating_point()
            and ref[k].shape == out[k].shape and ref[k].dim() >= 1]
    if not keys:
        return {}
    worst = 0.0
    for k in keys:
        r, o = real(ref[k]).double(), real(out[k]).double()
        d = o - r
        axis = (axes or {}).get(k, -1)
        axis = axis if -d.dim() <= axis < d.dim() else -1
        scale = float(r.abs().max()) if r.numel() else 0.0
        if scale > 0:
            worst = max(worst, float((d - d.mean(axis, keepdim=True)).abs().max()) / scale)
    return {"raw_stream_rel_error": worst}


# what a figure is, printed beside it where its name alone would mislead (next to max errors, a ratio of
# RMS errors reads like one more max error)
FIGURE_NOTES = {
    "dtype_error_ratio": "RMS error of the converted model over the original's, both in the model's dtype, "
                         "against the original in verify_dtype",
    "own_rounding_error": "the original's error from the working dtype's rounding alone, which the tolerance "
                          "is derived from",
}
# floats in the figures that are settings, stated in ``verify_precision``
NOT_FIGURES = {"verify_tolerance", "reload_tolerance"}


def figures_text(figures: dict[str, Any]) -> str:
    """``key=value, ...`` of the float figures, each with its note from :data:`FIGURE_NOTES`."""
    return ", ".join(f"{k}={figure(v, 3)}" + (f" ({FIGURE_NOTES[k]})" if k in FIGURE_NOTES else "")
                     for k, v in figures.items() if isinstance(v, float) and k not in NOT_FIGURES)


def dtype_error_ratio(original: dict[str, Any], converted: dict[str, Any]) -> float | None:
    """Converted-in-dtype error over original-in-dtype error, both against the original in the working dtype
    (float64 where it fits: ``verify_dtype``).

    Takes two :func:`compare` results (same reference, same output key) and divides their
    ``rel_rms_error``. 1.0 means the conversion added nothing to what the dtype costs anyway.
    """
    a, b = original.get("rel_rms_error"), converted.get("rel_rms_error")
    if a is None or b is None or original.get("output") != converted.get("output"):
        return None
    return b / a if a > 0 else (1.0 if b == 0 else float("inf"))
