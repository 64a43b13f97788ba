"""Calibration of approximate norms: fit each replacement RMSNorm by streamed least squares.

A Post-LN norm cannot be swapped exactly, so its RMSNorm gets the per-channel ``g, b`` that best
reproduce the LayerNorm's output: regress ``y_i`` (the original norm's output) on
``u_i = x_i / rms(x)`` over calibration tokens. Two ways to choose ``x``:

* **sequential** (the default, GPTQ-style): norm ``k`` is fitted on the inputs that the model
  produces when norms ``0..k-1`` are *already* the fitted RMSNorms, against the outputs of the
  original model. Each fit then corrects the error accumulated before it instead of compounding it.
* **independent**: every norm on the original model's own activations (one pass; what a
  progressive schedule does for the norms it swaps at one time).

Memory is bounded: only per-channel running sums (``n, Σu, Σy, Σu², Σuy, Σy²``) over the real tokens
(padding positions, where the batch has an ``attention_mask``, are left out) are kept, never the
activations; one norm output per batch is alive at a time.

Without user data, :func:`builtin_batches` builds a small set from the package's own English
sentences (``normswap/data/calibration_en.txt``), tokenised with the model's tokenizer when one can
be found locally (its directory, or its preset's), or plausible token ids / generated images /
generated speech (:mod:`normswap.inputs.speech`) otherwise.

:func:`measure` compares the calibrated model to the original on held-out batches in the figures
a user compares (embedding cosine and nearest-neighbour agreement for encoders, top-1 agreement and
KL for models with logits); :class:`UnusableConversion` is raised by the caller when they say the
result is unusable.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from normswap import inputs
from normswap.errors import NormswapError
from normswap.memory import available_memory
from normswap.nn.call_args import normalised, with_normalised
from normswap.surgery.verify import comparable, figure, primary_key, token_kl

Batch = tuple[tuple, dict]
# below these figures (against the original, on held-out calibration inputs) a model is unusable
MIN_COSINE = 0.9
MIN_TOP1 = 0.5


class UnusableConversion(NormswapError):
    """The converted model is too far from the original to be used (CLI exit code 4)."""

    exit_code = 4


@dataclass
class NormFit:
    """The fitted ``weight``/``bias`` of one approximate norm and its residuals.

    ``residual_before`` is the relative RMS error of the norm's output with γ/β copied unchanged,
    ``residual_after`` with the fitted values, both on the inputs the fit saw.
    """

    name: str
    weight: torch.Tensor
    bias: torch.Tensor
    residual_before: float
    residual_after: float
    tokens: int


@dataclass
class CalibrationResult:
    """What calibration did: which data, how, the per-norm fits and the held-out figures."""

    source: str
    method: str
    batches: int
    eval_batches: int
    fits: dict[str, NormFit] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)
    pipeline: str = ""  # how the sequential fits got their activations (:func:`fit_norms`)
    eval_source: str = ""  # what the held-out figures were measured on (a recipe's figures use other data)

    def summary(self) -> str:
        """One line for reports: the data, the method and the held-out figures."""
        figs = ", ".join(f"{k}={figure(v)}" for k, v in self.figures.items())
        on = f" ({self.eval_source})" if self.eval_source else ""
        return (f"calibration: {self.source}, {self.method}, {self.batches} batch(es)"
                + (f"; held-out{on} vs original: {figs}" if figs else ""))

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly form for manifests and reports."""
        return {
            "source": self.source, "method": self.method, "batches": self.batches,
            "eval_batches": self.eval_batches, "figures": dict(self.figures), "pipeline": self.pipeline,
            "residuals": {n: {"before": f.residual_before, "after": f.residual_after}
                          for n, f in self.fits.items()},
        }


# ------------------------------------------------------------------------------ built-in data
def builtin_batches(model: nn.Module, tokenizer: Any = None, *, batches: int = 4, batch_size: int = 16,
                    seq_len: int = 64, seed: int = 0) -> tuple[list[Batch], str]:
    """``batches`` calibration batches for a transformers model, and a description of them.

    Text models use the built-in sentences with ``tokenizer`` (or the model's own, found locally);
    without one, token ids drawn over the vocabulary. Vision and speech inputs are generated
    (smooth random images, synthetic speech) at the model's expected shapes.
    """
    tok = tokenizer if tokenizer is not None else inputs.find_tokenizer(model)
    probe = inputs.hf_example_inputs(model, batch=1, seq=4, seed=seed)
    text_only = "input_ids" in probe and not any(k in probe for k in ("pixel_values", "input_features",
                                                                      "input_values"))
    out: list[Batch] = []
    english = tok is not None and inputs.understands_text(tok)
    if english and text_only:
        limit = min(seq_len, int(getattr(getattr(model, "config", None), "max_position_embeddings", seq_len)
                                 or seq_len) - 2)
        texts = inputs.passages(batches * batch_size, seed)
        for i in range(batches):
            enc = tok(texts[i * batch_size:(i + 1) * batch_size], padding=True, truncation=True,
                      max_length=max(8, limit), return_tensors="pt")
            kw = {k: v for k, v in enc.items() if k in probe or k == "attention_mask"}
            for k, v in probe.items():  # decoder ids and the like: what the model also needs
                if k not in kw and isinstance(v, torch.Tensor) and v.dtype == torch.long:
                    kw[k] = kw["input_ids"].clone() if k.startswith("decoder_input") else v
            if "encoder_hidden_states" in probe:  # a decoder's cross-attention: random encoder states
                gen = torch.Generator().manual_seed(seed + 2000 + i)
                kw["encoder_hidden_states"] = inputs.encoder_states(model, kw["input_ids"].shape[0], 8, gen)
            out.append(((), kw))
        return out, f"built-in English sentences ({batches * batch_size} passages, model tokenizer)"
    texts = inputs.passages(batches * batch_size, seed) if english and "input_ids" in probe else []
    built = [inputs.with_generated_media(inputs.hf_example_inputs(
        model, batch=batch_size, seq=seq_len, seed=seed + 1000 + i), seed + i) for i in range(batches)]
    try:  # a vision-language or omni prompt: the built-in sentences around its media tokens
        out = [((), inputs.text_with_media(model, tok, kw, texts[i * batch_size:i * batch_size + kw[
            "input_ids"].shape[0]], seq_len) if texts else kw) for i, kw in enumerate(built)]
    except (NormswapError, TypeError, ValueError, KeyError, AttributeError):  # text the model cannot take
        texts, out = [], [((), kw) for kw in built]
    kinds = [k for k in ("pixel_values", "input_features", "input_values") if k in probe]
    what = {"pixel_values": "generated images", "input_features": "log-mel features of generated speech",
            "input_values": "generated speech"}
    desc = ", ".join(what[k] for k in kinds) or "token ids drawn over the vocabulary " + (
        "(the model's tokenizer reads most built-in English words as unknown)" if tok is not None
        else "(no tokenizer found)")
    if texts:
        desc = f"English sentences (model tokenizer) around the media tokens, {desc}"
    rows = next((v.shape[0] for v in out[0][1].values() if isinstance(v, torch.Tensor)), batch_size) if out else 0
    return out, f"built-in {desc} ({batches} x {rows})"  # rows: a 30-second audio batch holds one clip


def user_batches(calibration: Any) -> list[Batch]:
    """Normalise user calibration (a tensor, tuple, dict of model inputs, an ``(args, kwargs)`` batch,
    or a list of them)."""
    items = calibration if isinstance(calibration, list) else [calibration]
    out: list[Batch] = []
    for item in items:
        if (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], tuple)
                and isinstance(item[1], dict)):  # already an (args, kwargs) batch, e.g. from builtin_batches
            out.append((item[0], dict(item[1])))
        elif isinstance(item, dict):
            out.append(((), dict(item)))
        elif isinstance(item, tuple):
            out.append((item, {}))
        elif isinstance(item, torch.Tensor):
            out.append(((item,), {}))
        else:
            raise NormswapError("calibration must be a tensor, a tuple, a dict of model inputs, or a list of them")
    return out


# ------------------------------------------------------------------------------ streamed fit
class _Stop(Exception):
    """Raised by a hook to end a forward pass once the activation it wanted is captured."""


class _Sums:
    """Per-channel running sums for ``y ≈ g u + b`` (float64)."""

    def __init__(self) -> None:
        self.n = 0
        self.s: dict[str, torch.Tensor] = {}

    def add(self, u: torch.Tensor, y: torch.Tensor) -> None:
        u, y = u.double(), y.double()
        parts = {"u": u.sum(0), "y": y.sum(0), "uu": (u * u).sum(0), "uy": (u * y).sum(0), "yy": (y * y).sum(0)}
        for k, v in parts.items():
            self.s[k] = self.s[k] + v if k in self.s else v
        self.n += u.shape[0]

    def fit(self) -> tuple[torch.Tensor, torch.Tensor]:
        n, s = self.n, self.s
        mu_u, mu_y = s["u"] / n, s["y"] / n
        var_u = s["uu"] / n - mu_u * mu_u
        cov = s["uy"] / n - mu_u * mu_y
        ok = var_u > 1e-12 * (s["uu"] / n).clamp_min(1e-30)
        g = torch.where(ok, cov / var_u.clamp_min(1e-300), torch.ones_like(var_u))
        return g, mu_y - g * mu_u

    def residual(self, g: torch.Tensor, b: torch.Tensor) -> float:
        """``sqrt(Σ(y − g u − b)² / Σy²)`` from the sums alone."""
        s, n = self.s, self.n
        sq = (s["yy"] - 2 * g * s["uy"] - 2 * b * s["y"] + g * g * s["uu"] + 2 * g * b * s["u"] + n * b * b)
        den = float(s["yy"].sum())
        return (max(float(sq.sum()), 0.0) / den) ** 0.5 if den > 0 else 0.0


@dataclass
class Target:
    """One norm to fit: its module in the model, its identified site (a ``walker.NormSite``)."""

    name: str
    module: nn.Module
    site: Any

    def normalise(self, x: torch.Tensor) -> torch.Tensor:
        """``u = x / rms(x)`` flattened to ``[tokens, *param_shape]``."""
        dims = tuple(range(-len(self.site.normalized_shape), 0))
        xd = x.double()
        u = xd * torch.rsqrt(xd.pow(2).mean(dims, keepdim=True) + self.site.eps)
        return u.reshape(-1, *self.site.param_shape)

    def apply(self, x: torch.Tensor, g: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        u = self.normalise(x)
        return (u * g + b).reshape(x.shape).to(x.dtype)

    def copied(self) -> tuple[torch.Tensor, torch.Tensor]:
        shape = self.site.param_shape
        gamma, beta = self.site.gamma(self.module), self.site.beta(self.module)
        g = gamma.detach().double().reshape(shape) if gamma is not None else torch.ones(shape, dtype=torch.float64)
        b = beta.detach().double().reshape(shape) if beta is not None else torch.zeros(shape, dtype=torch.float64)
        return g, b


def _token_rows(batch: Batch, x: torch.Tensor, rows: int) -> torch.Tensor | None:
    """Boolean row selector for the real (non-padding) tokens of ``x``, when the batch has an
    ``attention_mask`` shaped like ``x``'s leading dims and every row is one token; else None."""
    mask = batch[1].get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or x.dim() < 3 or tuple(x.shape[:2]) != tuple(mask.shape) \
            or rows != mask.numel():
        return None
    keep = mask.reshape(-1).to(device="cpu", dtype=torch.bool)
    return keep if bool(keep.any()) else None


def _paired(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Can the converted model's input ``x`` at a norm be paired row for row with the original's output
    ``y`` there? Not when their shapes differ: a length the model computes from its own predictions
    (FastSpeech 2's length regulator repeats each phoneme by its predicted, rounded duration) came out
    differently for the two (3040 vs 3056 frames on a tiny FastSpeech2-Conformer). The norm is then fitted,
    for that batch, on the original's own input there (as an independent fit is)."""
    return tuple(x.shape) == tuple(y.shape)


def _add(sums: _Sums, target: Target, batch: Batch, x: torch.Tensor, y: torch.Tensor) -> None:
    """Add one batch's (normalised input, original output) rows to ``sums``, padding tokens left out."""
    u = target.normalise(x)
    v = y.double().reshape(-1, *target.site.param_shape)
    keep = _token_rows(batch, x, u.shape[0])
    if keep is not None:
        u, v = u[keep.to(u.device)], v[keep.to(v.device)]
    sums.add(u, v)


class _Router:
    """Forward hooks on every target: pass through, capture, stop, or stand in for the fitted RMSNorm."""

    def __init__(self, targets: list[Target]) -> None:
        self.targets = {t.name: t for t in targets}
        self.student = False  # True: fitted targets output their RMSNorm instead of the LayerNorm
        self.fitted: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.want: str | None = None  # capture this target's input (student) or output (teacher), then stop
        self.want_input = False  # capture the teacher's input instead (see _paired)
        self.got: torch.Tensor | None = None
        self.order: list[str] = []

    def hook(self, name: str) -> Callable:
        def fn(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            x = args[0] if args else next(iter(kwargs.values()))
            if name not in self.order:
                self.order.append(name)
            if name == self.want:
                self.got = (x if self.student or self.want_input else normalised(output)).detach()
                raise _Stop
            if self.student and name in self.fitted:
                g, b = self.fitted[name]
                return with_normalised(output, self.targets[name].apply(x, g.to(x.device), b.to(x.device)))
            return None
        return fn

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Router]:
        handles = [t.module.register_forward_hook(self.hook(n), with_kwargs=True)
                   for n, t in self.targets.items()]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()


def _run(model: nn.Module, batch: Batch, router: _Router, *, student: bool, want: str | None,
         want_input: bool = False) -> Any:
    router.student, router.want, router.got, router.want_input = student, want, None, want_input
    args, kwargs = batch
    try:
        with torch.no_grad():
            out = model(*args, **kwargs)
    except _Stop:
        return router.got
    finally:
        router.want, router.want_input = None, False
    return out if want is None else None


# ------------------------------------------------------------------------------ one pass per norm
class _Worker:
    """One forward pass (one batch, teacher or student) that pauses at every norm not yet fitted."""

    def __init__(self, index: int, student: bool, batch: Batch) -> None:
        self.index, self.student, self.batch = index, student, batch
        self.go = threading.Semaphore(0)
        self.at: str | None = None  # the norm it is paused at
        self.value: torch.Tensor | None = None  # that norm's input (student) or output (teacher)
        self.source: torch.Tensor | None = None  # a teacher's input at that norm (see _paired)
        self.done = False
        self.error: BaseException | None = None


AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "mtia")


class CallerModes:
    """The calling thread's torch state that a forward depends on and that a new thread does not
    inherit, captured to be re-entered in the one-pass path's worker threads, so that they compute as
    the replaying path, which runs on the caller's thread, does:

    * inference mode (``torch.inference_mode()``): tensors made inside are inference tensors, and a
      model may rely on it;
    * autocast, per device type, with its dtype and cache flag (``torch.autocast("cpu", torch.bfloat16)``);
    * the torch-function mode stack, which holds ``with torch.device(...)`` and
      ``torch.set_default_device`` (factory calls inside a model build their tensors there).

    Grad mode is off in both paths whatever the caller's (no fit needs a graph). The default dtype
    (``torch.set_default_dtype``) is process-wide in PyTorch, so every thread sees it already.
    """

    def __init__(self) -> None:
        self.inference = torch.is_inference_mode_enabled()
        self.autocast: list[tuple[str, torch.dtype]] = []
        for device in AUTOCAST_DEVICES:
            try:
                if torch.is_autocast_enabled(device):
                    self.autocast.append((device, torch.get_autocast_dtype(device)))
            except (RuntimeError, ValueError, TypeError):  # a device type this build does not know
                continue
        self.autocast_cache = torch.is_autocast_cache_enabled()
        stack = getattr(torch.overrides, "_get_current_function_mode_stack", None)
        self.function_modes: list[Any] = list(stack()) if callable(stack) else []

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """These modes, in the current (worker) thread, for the block; grad mode off."""
        with contextlib.ExitStack() as stack:
            if self.inference:
                stack.enter_context(torch.inference_mode())
            for device, dtype in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=self.autocast_cache))
            for mode in self.function_modes:  # bottom first, as the caller's stack is; the same objects,
                torch._C._push_on_torch_function_stack(mode)  # pushed without re-running their __enter__
                stack.callback(torch._C._pop_torch_function_stack)
            stack.enter_context(torch.no_grad())
            yield


class _Lockstep:
    """Sequential fitting with every batch's teacher and student forwards run side by side, each
    paused where it reaches the next norm to fit.

    Each forward is a thread, but only one runs at a time (the scheduler hands a baton), so the
    arithmetic is exactly that of the replaying path. When every forward has reached norm ``k``,
    ``k`` is fitted from the paused activations (in batch order), and the forwards go on: the
    students through the fitted RMSNorm, the teachers through the LayerNorm. Every layer thus runs
    once per batch for each of teacher and student: the cost is about two forward passes over the
    calibration set, at any depth, instead of one per norm. No model has to be cut into blocks:
    encoder-decoders, cross-attention, shared layers (ALBERT: a norm is fitted on its first call and
    stands in at the later ones, as in the replaying path) and norms outside the layers all run
    through the model's own forward.

    Memory: what the paused forwards hold, two copies (teacher, student) of everything alive in a
    forward at a norm boundary (not only the stream: an FFN's intermediate, attention scores, masks;
    :data:`LOCKSTEP_LIVE_FACTOR`) for the whole calibration set, plus one forward's working set. When
    that does not fit, :func:`fit_norms` falls back to replaying (memory one micro-batch, cost
    quadratic in depth): a paused forward's state lives in the frames of the model's own ``forward``,
    so it cannot be moved to disk piecemeal the way a block-by-block pipeline stores one boundary tensor.
    """

    def __init__(self, model: nn.Module, router: _Router, batches: list[Batch]) -> None:
        self.model, self.router, self.batches = model, router, batches
        self.paused = threading.Semaphore(0)
        self.current: _Worker | None = None
        self.abort = False
        self.passed: set[str] = set()  # norms whose fit is decided: no one pauses there any more
        self.order: list[str] = []  # norms in the order forwards first reached them
        self.workers = [_Worker(i, student, b) for i, b in enumerate(batches) for student in (False, True)]
        self.modes = CallerModes()  # built on the caller's thread; re-entered by every worker

    # -- inside a worker thread
    def hook(self, name: str, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        w = self.current
        if w is None:
            return None
        x = args[0] if args else next(iter(kwargs.values()))
        if name not in self.passed:
            w.at, w.value = name, (x if w.student else normalised(output)).detach()
            w.source = None if w.student else x.detach()
            if name not in self.order:
                self.order.append(name)
            self.paused.release()
            w.go.acquire()
            w.at = w.value = w.source = None
            if self.abort or self.passed.issuperset(self.router.targets):
                # nothing after the last norm's fit is needed: a head or a vocoder (FastSpeech 2 with
                # HiFi-GAN) would only cost time
                raise _Stop
        fitted = self.router.fitted.get(name)
        if w.student and fitted is not None:
            return with_normalised(output, self.router.targets[name].apply(x, fitted[0].to(x.device),
                                                                           fitted[1].to(x.device)))
        return None

    def body(self, w: _Worker) -> None:
        w.go.acquire()
        try:
            if not self.abort:
                args, kwargs = w.batch
                with self.modes.entered():
                    self.model(*args, **kwargs)
        except _Stop:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the scheduler, which raises it
            w.error = exc
        finally:
            w.done, w.at, w.value, w.source = True, None, None, None
            self.paused.release()

    # -- the scheduler (caller's thread)
    def step(self, w: _Worker) -> None:
        """Let ``w`` run until it pauses at a norm or ends."""
        self.current = w
        w.go.release()
        self.paused.acquire()
        self.current = None
        if w.error is not None:
            raise w.error

    def run(self, fit: Callable[[str, list[tuple[Batch, torch.Tensor, torch.Tensor, torch.Tensor]]], None],
            fits_left: Callable[[], None] | None = None,
            budget: Callable[[_Worker], bool] | None = None) -> bool:
        """Drive every forward to its end, calling ``fit(name, [(batch, x, y, x_teacher), ...])`` whenever
        all paused forwards wait for ``name`` (``x_teacher``: the original's own input there, for
        :func:`_paired`). ``budget(first_teacher)``, asked once the first teacher
        reached its first norm, may refuse the run (the set will not fit in memory): returns False."""
        threads = [threading.Thread(target=self.body, args=(w,), daemon=True, name=f"normswap-calib-{i}")
                   for i, w in enumerate(self.workers)]
        for t in threads:
            t.start()
        try:
            for i, w in enumerate(self.workers):
                self.step(w)
                if i == 0 and budget is not None and w.at is not None and not budget(w):
                    return False
            while True:
                waiting = [w for w in self.workers if not w.done]
                if not waiting:
                    return True
                name = min((w.at for w in waiting), key=self.order.index)
                here = [w for w in waiting if w.at == name]
                teach = {w.index: (w.value, w.source) for w in here if not w.student}
                stud = {w.index: w.value for w in here if w.student}
                fit(name, [(self.batches[i], stud[i], *teach[i]) for i in sorted(teach.keys() & stud.keys())])
                del teach, stud
                self.passed.add(name)
                for w in here:
                    self.step(w)
        finally:
            self.abort = True
            self.current = None
            for w in self.workers:
                if not w.done:
                    w.go.release()  # it raises _Stop at its pause (or never starts) and ends
            for t in threads:
                t.join()


FIT_MICRO_BATCH = 4  # rows per forward when replaying and measuring: same figures, activations 4x smaller
LOCKSTEP_MICRO_BATCH = 16  # rows per forward in the one-pass path (its memory is the whole set's anyway)
# A paused forward holds about this many boundary-sized tensors: the stream, the branch, an FFN's 4x-wide
# intermediate, attention scores (seq x seq per head), masks and position biases, plus the allocator's
# overhead with one thread per forward. Measured: all-mpnet-base-v2 on 256 paragraphs (32 pieces of
# 8 x up to 128 tokens) grew by 3.6 GB during the fit, 21x the teacher + student boundary values.
LOCKSTEP_LIVE_FACTOR = 24
LOCKSTEP_MEMORY_SHARE = 0.4  # of the available memory, the most the paused forwards may hold


def split_batch(batch: Batch, size: int) -> list[Batch]:
    """``batch`` cut into pieces of at most ``size`` rows, when every tensor in it has the same
    leading (batch) dimension; otherwise ``[batch]``. The least-squares sums are additive over rows,
    so fitting on the pieces gives the same fit with a fraction of the activation memory."""
    args, kwargs = batch
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    rows = {int(t.shape[0]) if t.dim() else -1 for t in tensors}
    if len(rows) != 1 or (n := rows.pop()) <= size:
        return [batch]

    def cut(v: Any, i: int) -> Any:
        return v[i:i + size] if isinstance(v, torch.Tensor) else v

    return [(tuple(cut(a, i) for a in args), {k: cut(v, i) for k, v in kwargs.items()}) for i in range(0, n, size)]


def _progress(total: int, what: str) -> Any:
    """A tqdm bar on stderr when it is a terminal and progress is wanted (:data:`PROGRESS`), else a
    no-op with the same ``update`` / ``close``."""
    from tqdm.auto import tqdm

    show = PROGRESS and total > 1 and sys.stderr is not None and sys.stderr.isatty()
    return tqdm(total=total, desc=what, unit="norm", disable=not show, leave=False, file=sys.stderr)


PROGRESS = True  # the CLI's --quiet and the library's callers turn progress bars off here


@dataclass
class _Fitted:
    fits: dict[str, NormFit]
    pipeline: str


def _fit_one(t: Target, s: _Sums) -> NormFit:
    g, b = s.fit()
    g0, b0 = t.copied()
    return NormFit(t.name, g, b, s.residual(g0, b0), s.residual(g, b), s.n)


def _fit_replay(model: nn.Module, router: _Router, fittable: list[Target], batches: list[Batch],
                prep: Callable[[Batch], Batch], sequential: bool, unpaired: set[str]) -> dict[str, NormFit]:
    """The replaying path: for each norm, every batch runs from the input up to that norm, teacher
    and student (cost quadratic in depth; memory one micro-batch). Independent fits: one pass.
    ``unpaired`` collects the norms some batch of which was fitted on the original's input (:func:`_paired`)."""
    fits: dict[str, NormFit] = {}
    _run(model, prep(batches[0]), router, student=False, want=None)  # learn the execution order
    order = [n for n in router.order if n in router.targets]
    order += [t.name for t in fittable if t.name not in order]
    if not sequential:
        sums = {n: _Sums() for n in order}
        grab: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        handles = [router.targets[n].module.register_forward_hook(
            lambda m, a, o, n=n: grab.__setitem__(n, (a[0].detach(), normalised(o).detach()))) for n in order]
        try:
            for batch in batches:
                grab.clear()
                b = prep(batch)
                _run(model, b, router, student=False, want=None)
                for n, (x, y) in grab.items():
                    _add(sums[n], router.targets[n], b, x, y)
                grab.clear()
        finally:
            for h in handles:
                h.remove()
    bar = _progress(len(order), "fitting norms (replay)")
    try:
        for n in order:
            t = router.targets[n]
            if sequential:
                s = _Sums()
                for batch in batches:
                    b = prep(batch)
                    y = _run(model, b, router, student=False, want=n)
                    x = _run(model, b, router, student=True, want=n)
                    if x is None or y is None:
                        continue
                    if not _paired(x, y):
                        x = _run(model, b, router, student=False, want=n, want_input=True)
                        unpaired.add(n)
                    _add(s, t, b, x, y)
                    del x, y
            else:
                s = sums[n]
            bar.update(1)
            if s.n == 0:
                continue
            fits[n] = _fit_one(t, s)
            router.fitted[n] = (fits[n].weight, fits[n].bias)
    finally:
        bar.close()
    return fits


def _fit_lockstep(model: nn.Module, router: _Router, batches: list[Batch], prep: Callable[[Batch], Batch],
                  memory_limit: int | None, unpaired: set[str]) -> dict[str, NormFit] | str:
    """The one-pass sequential path (:class:`_Lockstep`): the fits, or why it did not run (the
    calibration set's boundary activations would not fit in ``memory_limit`` bytes). ``unpaired``: as
    in :func:`_fit_replay`."""
    prepped = [prep(b) for b in batches]
    fits: dict[str, NormFit] = {}
    bar = _progress(len(router.targets), "fitting norms")
    lock = _Lockstep(model, router, prepped)
    refused = ""

    def budget(first: _Worker) -> bool:
        nonlocal refused
        if memory_limit is None or first.value is None:
            return True
        need = first.value.numel() * first.value.element_size() * 2 * len(prepped) * LOCKSTEP_LIVE_FACTOR
        if need <= memory_limit:
            return True
        refused = (f"the calibration set's activations at a norm boundary (~{need / 2**30:.1f} GiB for teacher and "
                   f"student) do not fit in {memory_limit / 2**30:.1f} GiB")
        return False

    def fit(name: str, rows: list[tuple[Batch, torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        t = router.targets[name]
        s = _Sums()
        for b, x, y, x_teacher in rows:
            if not _paired(x, y):
                x = x_teacher
                unpaired.add(name)
            _add(s, t, b, x, y)
        bar.update(1)
        bar.set_postfix_str(name, refresh=False)
        if s.n:
            fits[name] = _fit_one(t, s)
            router.fitted[name] = (fits[name].weight, fits[name].bias)

    hooks = [t.module.register_forward_hook(
        lambda m, a, k, o, n=n: lock.hook(n, m, a, k, o), with_kwargs=True) for n, t in router.targets.items()]
    try:
        if not lock.run(fit, budget=budget):
            return refused
    finally:
        for h in hooks:
            h.remove()
        bar.close()
    return fits


def fit_norms(model: nn.Module, targets: list[Target], batches: list[Batch], *, sequential: bool = True,
              call: Callable[[Batch], Batch] | None = None,
              micro_batch: int | None = None, pipeline: str = "auto") -> dict[str, NormFit]:
    """Fit every target's RMSNorm ``g, b`` by streamed least squares on ``batches``.

    Args:
        model: the model holding the target LayerNorms (they stay LayerNorms; nothing is replaced).
        targets: the norms to fit. Targets without both γ and β are not fitted.
        batches: ``(args, kwargs)`` inputs for ``model``.
        sequential: fit norm ``k`` on the inputs produced with norms ``0..k-1`` already replaced by
            their fits (in execution order), against the original outputs. ``False``: every norm
            on the original activations, in one pass per batch.
        call: maps a batch to what the model is called with (device/dtype moves), default identity.
        micro_batch: run the model on at most this many rows at a time (:func:`split_batch`); the fit
            is the same, the peak activation memory smaller. None: :data:`LOCKSTEP_MICRO_BATCH` rows
            in the one-pass path, :data:`FIT_MICRO_BATCH` when replaying.
        pipeline: how sequential fits get their activations. ``"lockstep"``: one pass, every batch's
            forwards paused at each norm boundary (:class:`_Lockstep`; cost about two forward passes
            at any depth). ``"replay"``: for each norm, every batch re-runs from the input (cost
            quadratic in depth, memory one micro-batch). ``"auto"``: lockstep unless the calibration
            set's boundary activations would not fit in memory.

    Returns:
        ``{name: NormFit}`` in execution order.
    """
    return _fit(model, targets, batches, sequential=sequential, call=call, micro_batch=micro_batch,
                pipeline=pipeline).fits


def _fit(model: nn.Module, targets: list[Target], batches: list[Batch], *, sequential: bool,
         call: Callable[[Batch], Batch] | None, micro_batch: int | None, pipeline: str) -> _Fitted:
    if pipeline not in ("auto", "lockstep", "replay"):
        raise ValueError(f"pipeline must be 'auto', 'lockstep' or 'replay', not {pipeline!r}")
    prep = call or (lambda b: b)
    fittable = [t for t in targets if t.site.weight_attr is not None and t.site.bias_attr is not None]
    if not fittable or not batches:
        return _Fitted({}, "nothing to fit")
    router = _Router(fittable)
    why = ""
    unpaired: set[str] = set()

    def unpaired_note() -> str:
        return (f"; {len(unpaired)} norm(s) fitted on the original's own inputs, where the converted model's "
                "activations came out at other lengths (lengths computed from its own predictions)") if unpaired else ""

    if sequential and pipeline != "replay":
        pieces = [p for b in batches for p in split_batch(b, micro_batch or LOCKSTEP_MICRO_BATCH)]
        limit = None if pipeline == "lockstep" else int(LOCKSTEP_MEMORY_SHARE * available_memory())
        got = _fit_lockstep(model, router, pieces, prep, limit, unpaired)
        if not isinstance(got, str):
            return _Fitted(got, f"one pass (each layer runs once per batch for teacher and student; "
                                f"{len(pieces)} forward(s) of each paused at every norm)" + unpaired_note())
        why = got
        router = _Router(fittable)
        unpaired.clear()
    pieces = [p for b in batches for p in split_batch(b, micro_batch or FIT_MICRO_BATCH)]
    with router.installed():
        fits = _fit_replay(model, router, fittable, pieces, prep, sequential, unpaired)
    if not sequential:
        return _Fitted(fits, "one pass (independent fits)")
    return _Fitted(fits, "replayed from the input for each norm" + (f" ({why})" if why else "") + unpaired_note())


# ------------------------------------------------------------------------------ measurement
def _pooled(hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    h = hidden.double()
    if h.dim() == 2:
        return h
    if mask is None or mask.shape != h.shape[:2]:
        return h.mean(1) if h.dim() == 3 else h.reshape(h.shape[0], -1)
    m = mask.to(h.dtype).unsqueeze(-1)
    return (h * m).sum(1) / m.sum(1).clamp_min(1.0)


# a converted model's neighbour the original rates within this share of the item's similarity range
# (best minus worst over the other items) of its own best is a tie: the original does not prefer one
# to the other (see :func:`neighbour_figures`)
TIE_SHARE = 1e-3
# similarities closer than this many ulps of the embedding dtype, times sqrt(width), are rounding
RESOLUTION_ULPS = 16.0


def similarity_resolution(dtype: torch.dtype, width: int) -> float:
    """The smallest cosine-similarity difference that embeddings computed in ``dtype`` of ``width``
    features resolve: ``RESOLUTION_ULPS · sqrt(width) · eps`` (a dot product's rounding grows with the
    square root of its length). float64, width 32: 2e-14; float32, width 768: 5e-5."""
    eps = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float64).eps
    return RESOLUTION_ULPS * max(width, 1) ** 0.5 * eps


def neighbour_figures(teacher: torch.Tensor, student: torch.Tensor,
                      resolution: float | None = None) -> dict[str, float]:
    """Retrieval figures of embeddings ``[n, d]`` against the original's (n ≥ 3).

    ``top1_neighbour_agreement``: share of items whose nearest other item (cosine) is the same, or one
    the original rates tied with its own nearest; ``recall_at_10``: share of the converted model's 10
    nearest neighbours that the original rates at least as close as its own 10th (ties again count);
    ``similarity_spearman``: Spearman correlation of all pairwise similarities. ``neighbour_items``: how
    many items were judged.

    A tie is a similarity within ``max(TIE_SHARE × range, resolution)`` of the original's, ``range``
    being the spread of the original's similarities from that item to the others. Random tiny models
    give held-out embeddings in clusters of near-duplicates (RT-DETR's decoder states: 21 of 32 items
    with an exact twin; GroupViT: best and runner-up 3e-11 apart where the item's similarities span
    1e-4): which of two items the original itself rates the same comes first is decided by rounding, and
    a strict argmax called those conversions unusable (top-1 0.19 and 0.22). An item whose similarities
    to all others are equal to within ``resolution`` (:func:`similarity_resolution`; the default is the
    float64 one) has no nearest neighbour for the original either: it is not judged, and when no item is
    judged the result is ``{}`` (D-FINE's or WavTokenizer's 32 outputs, identical to 1e-15).
    """
    n = teacher.shape[0]
    if n < 3:
        return {}
    if resolution is None:
        resolution = similarity_resolution(torch.float64, teacher.shape[-1])
    t = torch.nn.functional.normalize(teacher.double(), dim=-1)
    s = torch.nn.functional.normalize(student.double(), dim=-1)
    st, ss = t @ t.T, s @ s.T
    eye = torch.eye(n, dtype=torch.bool)
    st_m, ss_m = st.masked_fill(eye, -2.0), ss.masked_fill(eye, -2.0)
    spread = st_m.max(1).values - st.masked_fill(eye, 2.0).min(1).values
    judged = spread > resolution
    if not bool(judged.any()):
        return {}
    tol = (TIE_SHARE * spread).clamp_min(resolution)
    best = st_m.max(1).values
    chosen = st_m.gather(1, ss_m.argmax(1, keepdim=True)).squeeze(1)  # the original's rating of the converted choice
    top1 = float((chosen >= best - tol)[judged].double().mean())
    k = min(10, n - 1)
    kth = st_m.topk(k, dim=1).values[:, -1]
    picked = st_m.gather(1, ss_m.topk(k, dim=1).indices)  # the original's ratings of the converted top k
    hits = (picked >= (kth - tol).unsqueeze(1)).double().mean(1)[judged].mean()
    iu = torch.triu_indices(n, n, 1)
    a, b = st[iu[0], iu[1]], ss[iu[0], iu[1]]

    def rank(v: torch.Tensor) -> torch.Tensor:
        r = torch.empty_like(v)
        r[v.argsort()] = torch.arange(v.numel(), dtype=v.dtype)
        return r

    ra, rb = rank(a), rank(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    rho = float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-30))
    return {"top1_neighbour_agreement": top1, "recall_at_10": float(hits), "similarity_spearman": rho,
            "neighbour_items": float(judged.sum())}


def decoder_states(outputs: dict[str, torch.Tensor], key: str) -> bool:
    """Is output ``key`` a decoder's per-position states? ``last_hidden_state`` of a model that also
    returns its encoder's (``encoder_last_hidden_state*``: a seq2seq model's decoder tokens, a DETR-style
    detector's object queries, a time-series model's forecast steps). A head reads those states one
    position at a time (a language-model head per token, a box head per query); nobody mean-pools them
    into one embedding per input, so neighbours among such pooled vectors are not what a user sees."""
    return key == "last_hidden_state" and outputs[key].dim() >= 3 and any(
        k.startswith("encoder_last_hidden_state") for k in outputs)


def measure(model: nn.Module, targets: list[Target], fits: dict[str, NormFit], batches: list[Batch],
            call: Callable[[Batch], Batch] | None = None,
            micro_batch: int | None = LOCKSTEP_MICRO_BATCH) -> dict[str, float]:
    """Original vs calibrated model (fits standing in for their LayerNorms) on ``batches``, in the figure
    a user of the model's output reads.

    Models with logits: ``top1_agreement``, ``top5_agreement`` (the original's top-1 is in the
    converted model's top 5), ``kl``. Decoder states (:func:`decoder_states`): ``state_cosine``, the mean
    cosine of each position's state to the original's (real positions where the batch's
    ``attention_mask`` covers them). Others (embeddings): ``cosine`` of mean-pooled embeddings (attention
    mask respected) and the :func:`neighbour_figures` at the output dtype's resolution. Streamed per
    batch, in pieces of ``micro_batch`` rows (every figure is per row: the pieces give the same result);
    only pooled embeddings are kept.
    """
    prep = call or (lambda b: b)
    if micro_batch:
        batches = [piece for b in batches for piece in split_batch(b, micro_batch)]
    router = _Router(targets)
    router.fitted = {n: (f.weight, f.bias) for n, f in fits.items()}
    acc = {"agree": 0.0, "agree5": 0.0, "kl": 0.0, "n": 0.0, "state_cos": 0.0, "positions": 0.0}
    emb_t: list[torch.Tensor] = []
    emb_s: list[torch.Tensor] = []
    dtype = torch.float64
    with router.installed():
        for batch in batches:
            b = prep(batch)
            ref = comparable(_run(model, b, router, student=False, want=None), set())
            out = comparable(_run(model, b, router, student=True, want=None), set())
            mask = b[1].get("attention_mask")
            if "logits" in ref and "logits" in out:
                rt, ro = ref["logits"].double(), out["logits"].double()
                sel = mask.bool() if mask is not None and mask.shape == rt.shape[:-1] else torch.ones(
                    rt.shape[:-1], dtype=torch.bool)
                acc["agree"] += float((rt.argmax(-1) == ro.argmax(-1))[sel].sum())
                top5 = ro.topk(min(5, ro.shape[-1]), -1).indices
                acc["agree5"] += float((top5 == rt.argmax(-1, keepdim=True)).any(-1)[sel].sum())
                acc["kl"] += float(token_kl(rt, ro)[sel].sum())
                acc["n"] += float(sel.sum())
                continue
            key = "last_hidden_state" if "last_hidden_state" in ref else primary_key(ref)
            if key is None or key not in out:
                continue
            if decoder_states(ref, key) and ref[key].shape == out[key].shape:
                cos = torch.nn.functional.cosine_similarity(ref[key].double(), out[key].double(), dim=-1)
                sel = mask.to(device=cos.device, dtype=torch.bool) if isinstance(mask, torch.Tensor) \
                    and mask.shape == cos.shape[:2] and cos.dim() == 2 else torch.ones_like(cos, dtype=torch.bool)
                acc["state_cos"] += float(cos[sel].sum())
                acc["positions"] += float(sel.sum())
                continue
            pooled_t, pooled_s = _pooled(ref[key], mask), _pooled(out[key], mask)
            if pooled_t.shape != pooled_s.shape:
                # an output whose length the model computes from its own predictions (VITS' waveform, from
                # predicted durations): the converted model's is another length, nothing to pair row by row
                continue
            dtype = ref[key].dtype
            emb_t.append(pooled_t)
            emb_s.append(pooled_s)
    if acc["n"]:
        return {"top1_agreement": acc["agree"] / acc["n"], "top5_agreement": acc["agree5"] / acc["n"],
                "kl": acc["kl"] / acc["n"]}
    if acc["positions"]:
        return {"state_cosine": acc["state_cos"] / acc["positions"]}
    if not emb_t:
        return {}
    cosines = torch.cat([torch.nn.functional.cosine_similarity(t, s, dim=-1)
                         for t, s in zip(emb_t, emb_s, strict=True)])
    figs = {"cosine": float(cosines.mean())}
    if len({t.shape[1:] for t in emb_t}) == 1:  # neighbours need one width: not batches of other-length waveforms
        t, s = torch.cat(emb_t), torch.cat(emb_s)
        figs.update(neighbour_figures(t, s, similarity_resolution(dtype, t.shape[-1])))
    return figs


def unusable(figures: dict[str, float]) -> str | None:
    """Why ``figures`` (from :func:`measure`) mean an unusable model, or None when usable."""
    for key, what in (("cosine", "embedding cosine"), ("state_cosine", "per-position decoder-state cosine")):
        cos = figures.get(key)
        if cos is not None and cos < MIN_COSINE:
            return f"{what} to the original {cos:.3f} < {MIN_COSINE}"
    top1 = figures.get("top1_agreement", figures.get("top1_neighbour_agreement"))
    if top1 is not None and top1 < MIN_TOP1:
        what = "top-1 agreement" if "top1_agreement" in figures else "top-1 neighbour agreement"
        return f"{what} with the original {top1:.3f} < {MIN_TOP1}"
    return None


def calibrate(model: nn.Module, targets: list[Target], fit_batches: list[Batch], eval_batches: list[Batch], *,
              source: str, sequential: bool = True, call: Callable[[Batch], Batch] | None = None,
              pipeline: str = "auto", eval_source: str = "") -> CalibrationResult:
    """Fit ``targets`` on ``fit_batches`` (:func:`fit_norms`) and measure the result on ``eval_batches``
    (``eval_source`` names them in the summary)."""
    fitted = _fit(model, targets, fit_batches, sequential=sequential, call=call, micro_batch=None,
                  pipeline=pipeline)
    figures = measure(model, targets, fitted.fits, eval_batches, call=call) if eval_batches else {}
    return CalibrationResult(source, "sequential least squares" if sequential else "independent least squares",
                             len(fit_batches), len(eval_batches), fitted.fits, figures, pipeline=fitted.pipeline,
                             eval_source=eval_source)
