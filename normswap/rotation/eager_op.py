"""The online Hadamard's eager form: its constants prepared once per device and dtype, few kernels per call.

An online op computes ``x·D·H̃`` (``D`` random signs; ``H̃ = H/sqrt(n)``, ``H = H_K ⊗ H_{2^m}``, or block-diagonal
``(I ⊗ H_b)/sqrt(b)``). Its stock form (:func:`normswap.rotation.hadamard.split_matmuls`,
:func:`normswap.rotation.hadamard.block_matmul`) is what ``torch.compile`` and the exporters trace: a few stock
ops with the module's buffers as constants (since round 52 with this module's split and the scale folded in too).
In eager PyTorch each of its ops is a dispatch, a kernel and an allocation, paid on every call of every op (36
ops in DINOv2-small), and its ``K`` part multiplies by a transposed (non-contiguous) ``H_K``. :class:`EagerOp`
computes the same transform with less of that:

* the scale ``n^-½`` (``b^-½``) folded into the stored matrix (float32 and float64 only: in a 2-byte dtype the
  rounded scale would shrink or grow every output by the same factor, up to 0.4%; there the scale stays a
  separate multiply, as before);
* block-diagonal: the signs, then one 2-d matmul of the rows of ``b`` by the scaled ``H_b``;
* full: ``H = H_K ⊗ H_{2^m} = (H_K ⊗ H_{2^m/b}) ⊗ H_b`` (Sylvester's ``H_{2^m}`` is a Kronecker power of
  ``H_2``; ``b`` from :func:`split`): the signs, one 2-d matmul of the rows of ``b`` by the scaled ``H_b``, and
  one matmul by a contiguous ``(H_K ⊗ H_{2^m/b})ᵀ`` across them: ``b + K·2^m/b`` multiply-adds per feature where
  the stock form does ``2^m + K`` (width 1,536: 80 instead of 140; at width 384 the same 44), and no transposed
  operand;
* no module attribute lookups (the buffers are read from ``module._buffers``) and no conversions per call.

A dense ``n × n`` matrix (one matmul) was measured and rejected: at width 384 a one-row call by it takes about
as long as the factored form (the ``n × n`` matrix is read from memory on each call), and at more rows it is
``n/(2^m + K)`` times the work (``benchmarks/online_op_speed.py``, docs/results/deploy-speed.md round 51).

Outputs are the stock form's to float rounding (the same products in another order). Nothing here runs while a
graph is captured (:class:`normswap.rotation.rotate.OnlineHadamard` checks) or for tensor subclasses.
"""

from __future__ import annotations

import torch

from normswap.rotation import hadamard

__all__ = ["EagerOp", "FOLD_SCALE", "split"]

ROW = 32  # smallest last Kronecker factor of a full op (a matmul by a narrower one ran slower: 16 against 32)
FOLD_SCALE = (torch.float32, torch.float64)  # dtypes whose rounding of n^-½ is below their own output rounding


def split(k: int, m: int) -> int:
    """The order ``b`` of the last factor when a full op's ``H_K ⊗ H_{2^m}`` runs as ``(H_K ⊗ H_{2^m/b}) ⊗ H_b``:
    the power of two from ``min(2^m, ROW)`` to ``2^m`` with the fewest multiply-adds per feature, ``b + K·2^m/b``
    (the larger on a tie). Width 384 (``K = 12``, ``2^m = 32``): 32; width 1,536 (``2^m = 128``): 32, 80 against
    the stock form's 140."""
    best, b = m, min(m, ROW)
    while b <= m:
        if b + k * m // b <= best + k * m // best:
            best = b
        b *= 2
    return best


class EagerOp:
    """One online op's constants in one device and dtype, and the call (``op(x)`` → ``x·D·H̃``).

    Built from the module's buffers (:meth:`of`); :meth:`holds` tells whether it still matches them (the same
    tensors, not modified in place since), so the hook makes a new one after ``load_state_dict``, ``.to`` or a
    new value, and keeps it otherwise. Made outside inference mode (an inference tensor cannot be saved for
    backward, so a model first run under ``torch.inference_mode`` and then trained would fail)."""

    __slots__ = ("small", "signs", "versions", "b", "g", "s", "first", "second", "scale")

    def __init__(self, small: torch.Tensor, signs: torch.Tensor | None, n: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.small, self.signs = small, signs
        self.versions = (small._version, None if signs is None else signs._version)
        k = small.shape[0]
        block = hadamard.is_block_factor(k)
        scale = (k if block else n) ** -0.5
        self.scale, c = (None, scale) if dtype in FOLD_SCALE else (scale, 1.0)
        # H = A ⊗ H_b with H_b the last factor of at most ROW (b = the block for a block op, A = I there)
        m = k if block else n // k
        self.b = b = m if block else split(k, m)
        self.g = g = n // b
        with torch.inference_mode(False), torch.no_grad():
            self.s = None if signs is None else signs.detach().to(device=device, dtype=dtype)
            self.first = (hadamard.sylvester(b).to(device=device) * c).to(dtype)  # H_b·c (symmetric)
            self.second = None  # Aᵀ, the g × g rest: H_K ⊗ H_{2^m/b} (Sylvester: H_{2^m} = H_{2^m/b} ⊗ H_b)
            if not block and g > 1:
                a = torch.kron(small.detach().to(device=device, dtype=torch.float64), hadamard.sylvester(m // b))
                self.second = a.t().contiguous().to(dtype)

    @classmethod
    def of(cls, small: torch.Tensor, signs: torch.Tensor | None, x: torch.Tensor) -> EagerOp | None:
        """The op for calls like ``x``, or None where the stock form runs instead: the buffers are inference
        tensors (no version counter to notice an in-place change by), or ``x``'s width is not the op's."""
        if small.is_inference() or (signs is not None and signs.is_inference()):
            return None
        n, k = x.shape[-1], small.shape[0]
        if not hadamard.is_block_factor(k) and (n % k or (n // k) & (n // k - 1)):
            return None
        return cls(small, signs, n, x.dtype, x.device)

    def holds(self, small: torch.Tensor, signs: torch.Tensor | None) -> bool:
        """Whether this op was made from these very buffers, unchanged since."""
        return small is self.small and signs is self.signs and self.versions == (
            small._version, None if signs is None else signs._version)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x·D·H̃`` (``x``'s last axis the op's width). With ``H = A ⊗ H_b``, each row of ``x`` is a ``g × b``
        matrix ``X`` turned into ``Aᵀ·X·H_b·c``: one 2-d matmul of every row's ``g`` rows of ``b`` by ``H_b·c``,
        then, for a full op, one matmul by ``Aᵀ`` across them."""
        shape = x.shape
        if self.s is not None:
            x = x * self.s
        y = torch.mm(x.reshape(-1, self.b), self.first)
        if self.second is not None:
            y = torch.matmul(self.second, y.view(-1, self.g, self.b))
        y = y.view(shape)
        return y if self.scale is None else y * self.scale
