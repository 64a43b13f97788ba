"""What a conversion holds in memory, and the precision its verification can afford there.

normswap analyses, edits and verifies a *working copy* of the model. In float64 an exact conversion
is judged against the float64 original at float64's tolerance; in float32 against the float32
original at float32's. A float64 copy costs 8 bytes a parameter beside the model, so which one runs
is decided here (:func:`choose_precision`), from the memory available when the conversion starts and
the peak it is predicted to reach (:func:`in_memory_peak`, the same prediction the checkpoint code's
in-memory / streaming switch makes), never from a fixed parameter count. The measured cost of float64
on a CPU (``benchmarks/bench_conversion.py precision``: docs/results/conversion.md) is small next to
the conversion's other work, so memory is what decides. The :class:`Precision` that results is
stated wherever the figures are: ``report.verification``, ``str(report)``, the CLI and the manifest.

A leaf module (torch and :mod:`normswap.errors` only): ``api``, ``calibrate`` and the checkpoint code
all read memory through it.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

import torch

from normswap.errors import NormswapError

# probes, calibration batches and the runtime's own allocations, on top of the tensors
ACTIVATION_BYTES = 1 << 30
# of a float32 model worked on in float32, the share the surgery writes (its own copies; the rest is shared)
WRITTEN_SHARE = 0.5
# The share of the memory available at the start that a conversion's predicted peak may take. Not all of
# it: "available" is a snapshot, other processes grow while a big conversion runs for minutes, and the
# page cache that holds the checkpoint's own files is what a peak near the limit evicts.
PEAK_SHARE = 0.6


def release(dropped: weakref.ReferenceType) -> bool:
    """Free what ``dropped`` refers to, once the caller has let go of its last reference: a full garbage
    collection only where the object is still alive, i.e. held by a reference cycle (a model whose modules
    point back at it); otherwise reference counting freed it already, and a collection would free nothing
    more while walking every live object (0.2-0.9 s in a process that imported transformers' modeling
    files). True when a collection ran (the object was still alive), False when nothing was left to free."""
    if dropped() is None:
        return False
    gc.collect()
    return True


def available_memory() -> int:
    """Bytes of RAM available now (psutil; 8 GB when it cannot say)."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - psutil is optional
        return 8 << 30


def device_memory(device: torch.device) -> int:
    """Bytes free where a model on ``device`` keeps its tensors: the GPU's free memory for CUDA, the
    host's available RAM otherwise (CPU, and devices that share it)."""
    if device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(device)[0])
    return available_memory()


def human(nbytes: float) -> str:
    """``nbytes`` in decimal units: ``9.60 GB``."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(nbytes) < 1000 or unit == "TB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.2f} TB"


def lean_itemsize(itemsize: int) -> int:
    """Bytes a parameter of the cheapest working copy normswap computes in: float32 for a half model
    (a CPU has no fast half-precision matmul: float16 ran ~4x slower than float32 here), the
    model's own dtype otherwise."""
    return max(itemsize, 4)


def working_copy_bytes(numel: int, itemsize: int, work_itemsize: int) -> int:
    """What a working copy in ``work_itemsize`` bytes a parameter adds beside a model of ``numel``
    parameters of ``itemsize`` bytes: a cast copy of everything, or, in the model's own dtype, only the
    tensors the surgery writes (the others are shared: :func:`normswap.pipeline.working_copy`)."""
    if work_itemsize == itemsize:
        return int(numel * itemsize * WRITTEN_SHARE)
    return numel * work_itemsize


def in_memory_peak(numel: int, itemsize: int, work_itemsize: int | None = None) -> int:
    """Predicted peak RSS of the in-memory path for ``numel`` parameters stored with ``itemsize``
    bytes each (loaded in that dtype), with a working copy of ``work_itemsize`` bytes a parameter
    (default: :func:`lean_itemsize`, the cheapest).

    The path holds the model with, beside it, either the working copy (:func:`working_copy_bytes`)
    or, while a half model runs on the probes, its float32 weights
    (:func:`normswap.checkpoint.conversion._run`). Once the checkpoint is written the converted model
    is freed, so the reload check holds the reloaded checkpoint (with its float32 weights while a
    half model runs) instead of the model, not beside it. Plus :data:`ACTIVATION_BYTES`."""
    work_itemsize = lean_itemsize(itemsize) if work_itemsize is None else work_itemsize
    model = numel * itemsize
    run = numel * 4 if itemsize < 4 else 0  # a half model is run in float32
    return model + max(working_copy_bytes(numel, itemsize, work_itemsize), run) + ACTIVATION_BYTES


@dataclass(frozen=True)
class Precision:
    """The dtype a conversion's working copy computes in (analysis, verification) and why.

    ``needed``: the predicted peak with a float64 copy; ``usable``: the part of the memory the
    conversion may take (:data:`PEAK_SHARE` of what was available, plus what the model itself holds);
    both ``None`` where memory did not decide. ``reason`` completes "in <dtype> (...)": empty when
    float64 simply fit."""

    dtype: torch.dtype
    reason: str = ""
    requested: str = "auto"
    needed: int | None = None
    usable: int | None = None

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def with_reason(self, dtype: torch.dtype, reason: str) -> Precision:
        """This decision overridden after the fact (the model could not run in float64)."""
        return Precision(dtype, reason, self.requested)

    def sentence(self, gate: str, subject: str = "verified") -> str:
        """``verified in float64 against the float64 original; tolerance 1e-06 relative`` or, where it
        fell back, ``verified in float32 against the float32 original (float64 would need ...);
        tolerance 0.002 relative``. ``gate``: what was gated, and at what tolerance
        (:func:`normswap.surgery.verify.gate_text`)."""
        why = f" ({self.reason})" if self.reason else ""
        return f"{subject} in {self.name} against the {self.name} original{why}; {gate}"

    def figures(self, tolerance: float | None, gate: str, subject: str = "verified") -> dict[str, object]:
        """What ``report.verification`` (and so the manifest) records about the precision:
        ``verify_dtype``, ``verify_tolerance`` (the relative output tolerance, where one was applied)
        and ``verify_precision`` (:meth:`sentence`)."""
        out: dict[str, object] = {"verify_dtype": self.name, "verify_precision": self.sentence(gate, subject)}
        if tolerance is not None:
            out["verify_tolerance"] = tolerance
        return out


def choose_precision(numel: int, dtype: torch.dtype, requested: str = "auto", *, available: int,
                     resident: int = 0, device_type: str = "cpu") -> Precision:
    """The working dtype for a model of ``numel`` parameters in ``dtype``.

    ``available``: bytes free now; ``resident``: bytes of the model already counted out of them
    (a loaded model: its own weights are part of the peak). float64 when the predicted peak with a
    float64 copy (:func:`in_memory_peak`) fits in :data:`PEAK_SHARE` of ``available + resident``;
    otherwise the cheapest copy (float32, the model's own dtype for a float32 model), or the model's
    own dtype where even a float32 copy of a half model would not fit. A float64 model is worked on
    in float64 (its copy shares the model's tensors). ``requested``: ``"float64"`` refuses, in one
    line, where float64 does not fit; ``"float32"`` never takes float64 (the cheapest copy, as above).
    """
    itemsize = dtype.itemsize
    usable = int(PEAK_SHARE * (available + resident))
    needed = in_memory_peak(numel, itemsize, 8)
    if dtype == torch.float64:
        if requested == "float32":
            raise NormswapError("verify_dtype='float32' would round a float64 model's weights to float32; "
                                "use verify_dtype='auto' (a float64 model is verified in float64 at no extra memory)")
        return Precision(torch.float64, "the model's own dtype", requested)
    if device_type == "mps":  # Apple's GPU has no float64
        if requested == "float64":
            raise NormswapError("verify_dtype='float64' is impossible on an MPS device (it has no float64); "
                                "use verify_dtype='auto' or move the model to the CPU")
        return Precision(torch.float32, "float64 is not supported on MPS", requested)
    if requested != "float32" and needed <= usable:
        return Precision(torch.float64, "", requested, needed, usable)
    if requested == "float64":
        raise NormswapError(
            f"verify_dtype='float64' does not fit: a float64 copy of this model's {numel:,} parameters would "
            f"need {human(needed)} at peak, and {human(usable)} can be used ({PEAK_SHARE:.0%} of the memory "
            "available); free memory, or use verify_dtype='auto' (float32 here)")
    why = ("verify_dtype='float32'" if requested == "float32" else
           f"float64 would need {human(needed)}, {human(usable)} usable: {PEAK_SHARE:.0%} of the memory available")
    if itemsize < 4 and in_memory_peak(numel, itemsize, 4) > usable:
        return Precision(dtype, why + "; a float32 copy would not fit either", requested, needed, usable)
    return Precision(torch.float32, why, requested, needed, usable)
