"""Hadamard matrices built in code, and a fast Walsh–Hadamard transform.

A Hadamard matrix ``H`` of order ``n`` has entries ±1 and ``H Hᵀ = n I``; ``H / sqrt(n)`` is
orthogonal and *incoherent* (every entry has magnitude ``1/sqrt(n)``), which is why QuaRot rotates
with it: a feature that carries an outlier is spread evenly over every feature.

Orders built here, all from first principles (no stored tables):

* Sylvester: ``2^m`` (``H_{2k} = [[H, H], [H, -H]]``).
* Paley I: ``q + 1`` for a prime power ``q ≡ 3 (mod 4)`` (12, 20, 24, 28, 44, 48, 60, 68, 72, 84, ...).
* Paley II: ``2(q + 1)`` for a prime power ``q ≡ 1 (mod 4)`` (12, 20, 28, 36, 52, 60, 76, 108, ...).
* Kronecker products of the above (``H_a ⊗ H_b`` has order ``a·b``).

:func:`hadamard_order` picks, for a width ``d = o·2^a`` (``o`` odd), the smallest constructible
order ``K = o·2^b`` with ``b ≤ a``; the matrix is then ``H_K ⊗ H_{2^{a-b}}``, and :func:`fwht`
applies it in ``O(d log d + d K)`` with a butterfly over the ``2^{a-b}`` part and one small matmul
over the ``K`` part. Widths with no constructible order (92, or any ``o·2^a`` with ``a < 2`` and
``o > 1``) return None: callers fall back to a random orthogonal matrix and say so.
"""

from __future__ import annotations

from functools import cache, lru_cache

import torch

__all__ = ["hadamard", "hadamard_order", "has_hadamard", "fwht", "random_signs", "paley_orders"]


# ------------------------------------------------------------------------ finite fields GF(p^k)
def _prime_power(q: int) -> tuple[int, int] | None:
    """``(p, k)`` with ``q = p^k`` for a prime ``p``, or None."""
    if q < 2:
        return None
    p = next((f for f in range(2, int(q**0.5) + 1) if q % f == 0), q)
    k = 0
    while q % p == 0:
        q //= p
        k += 1
    return (p, k) if q == 1 else None


def _poly_mulmod(a: list[int], b: list[int], mod: list[int], p: int) -> list[int]:
    """Product of two polynomials (coefficient lists, lowest first) modulo the monic ``mod`` over GF(p)."""
    k = len(mod) - 1
    out = [0] * (len(a) + len(b) - 1)
    for i, x in enumerate(a):
        if x:
            for j, y in enumerate(b):
                out[i + j] = (out[i + j] + x * y) % p
    for deg in range(len(out) - 1, k - 1, -1):  # reduce: x^k = -(mod[0] + ... + mod[k-1] x^{k-1})
        c = out[deg]
        if c:
            for j in range(k + 1):
                out[deg - k + j] = (out[deg - k + j] - c * mod[j]) % p
    return (out + [0] * k)[:k]


def _poly_mod(a: list[int], g: list[int], p: int) -> list[int]:
    """Remainder of ``a`` divided by the monic ``g`` over GF(p) (coefficients lowest first)."""
    a = list(a)
    k = len(g) - 1
    for deg in range(len(a) - 1, k - 1, -1):
        c = a[deg]
        if c:
            for j in range(k + 1):
                a[deg - k + j] = (a[deg - k + j] - c * g[j]) % p
    return a[:k]


def _irreducible(p: int, k: int) -> list[int]:
    """The first monic irreducible polynomial of degree ``k`` over GF(p) (lowest coefficient first):
    one with no monic factor of degree 1..k//2."""
    if k == 1:
        return [0, 1]
    for code in range(p**k):
        f = [(code // p**i) % p for i in range(k)] + [1]
        if f[0] == 0:
            continue
        if all(any(_poly_mod(f, [(c // p**i) % p for i in range(d)] + [1], p))
               for d in range(1, k // 2 + 1) for c in range(p**d)):
            return f
    raise ValueError(f"no irreducible polynomial of degree {k} over GF({p})")  # pragma: no cover (always exists)


def _jacobsthal(q: int) -> torch.Tensor:
    """The ``q × q`` Jacobsthal matrix ``Q[a, b] = chi(a - b)`` of GF(q) (int64), ``chi`` the quadratic
    character (0 at 0, 1 on nonzero squares, -1 elsewhere). Elements are coefficient vectors over
    GF(p) modulo an irreducible polynomial, coded base p (for a prime, the integers mod q)."""
    p, k = _prime_power(q)  # type: ignore[misc]
    mod = _irreducible(p, k)
    chi = torch.full((q,), -1, dtype=torch.int64)
    chi[0] = 0
    powers = [p**i for i in range(k)]
    for code in range(1, q):
        v = [(code // w) % p for w in powers]
        chi[sum(c * w for c, w in zip(_poly_mulmod(v, v, mod, p), powers, strict=True))] = 1
    digits = torch.tensor([[(code // w) % p for w in powers] for code in range(q)], dtype=torch.int64)
    diff = (digits[:, None, :] - digits[None, :, :]) % p
    return chi[(diff * torch.tensor(powers, dtype=torch.int64)).sum(-1)]


# ------------------------------------------------------------------------ constructions
def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.int64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _paley1(q: int) -> torch.Tensor:
    """Order ``q + 1``, ``q ≡ 3 (mod 4)``: ``H = I + S`` with ``S = [[0, 1ᵀ], [-1, Q]]`` (skew)."""
    n = q + 1
    s = torch.zeros(n, n, dtype=torch.int64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = _jacobsthal(q)
    return s + torch.eye(n, dtype=torch.int64)


def _paley2(q: int) -> torch.Tensor:
    """Order ``2(q + 1)``, ``q ≡ 1 (mod 4)``: the symmetric conference matrix ``C = [[0, 1ᵀ], [1, Q]]``,
    then ``H = C ⊗ [[1, -1], [-1, -1]] + I ⊗ [[1, 1], [1, -1]]``."""
    n = q + 1
    c = torch.zeros(n, n, dtype=torch.int64)
    c[0, 1:] = 1
    c[1:, 0] = 1
    c[1:, 1:] = _jacobsthal(q)
    a = torch.tensor([[1, -1], [-1, -1]], dtype=torch.int64)
    b = torch.tensor([[1, 1], [1, -1]], dtype=torch.int64)
    return torch.kron(c, a) + torch.kron(torch.eye(n, dtype=torch.int64), b)


# largest q for the brute-force field arithmetic of a non-prime power (primes use plain modular arithmetic)
_MAX_FIELD = 2048


def _paley_recipe(n: int) -> tuple[str, int] | None:
    if n % 4 != 0 and n > 2:
        return None
    q = n - 1
    pk = _prime_power(q)
    if pk is not None and q % 4 == 3 and (pk[1] == 1 or q <= _MAX_FIELD):
        return ("paley1", q)
    if n % 2 == 0:
        q = n // 2 - 1
        pk = _prime_power(q)
        if pk is not None and q % 4 == 1 and (pk[1] == 1 or q <= _MAX_FIELD):
            return ("paley2", q)
    return None


@cache
def _recipe(n: int) -> tuple | None:
    """How to build a Hadamard matrix of order ``n`` (a nested tuple), or None when none is known here."""
    if n < 1:
        return None
    if n & (n - 1) == 0:
        return ("sylvester", n)
    if n % 4:
        return None
    paley = _paley_recipe(n)
    if paley is not None:
        return paley
    for a in range(2, int(n**0.5) + 1):  # Kronecker product of two smaller orders
        if n % a == 0 and _recipe(a) is not None and _recipe(n // a) is not None:
            return ("kron", _recipe(a), _recipe(n // a))
    return None


def _build(recipe: tuple) -> torch.Tensor:
    kind = recipe[0]
    if kind == "sylvester":
        return _sylvester(recipe[1])
    if kind == "paley1":
        return _paley1(recipe[1])
    if kind == "paley2":
        return _paley2(recipe[1])
    return torch.kron(_build(recipe[1]), _build(recipe[2]))


def _describe(recipe: tuple) -> str:
    kind = recipe[0]
    if kind == "sylvester":
        return f"Sylvester {recipe[1]}"
    if kind == "paley1":
        return f"Paley I (q={recipe[1]})"
    if kind == "paley2":
        return f"Paley II (q={recipe[1]})"
    return f"{_describe(recipe[1])} ⊗ {_describe(recipe[2])}"


def hadamard_order(width: int) -> int | None:
    """The order ``K`` of the small Hadamard factor for ``width = K·2^m`` (the smallest constructible
    ``K`` of the form ``odd part · 2^b``), or None when no Hadamard matrix of order ``width`` is built here."""
    if width < 1:
        return None
    odd, a = width, 0
    while odd % 2 == 0:
        odd //= 2
        a += 1
    if odd == 1:
        return 1
    for b in range(2, a + 1):
        if _recipe(odd << b) is not None:
            return odd << b
    return None


def has_hadamard(width: int) -> bool:
    """Whether :func:`hadamard` can build a matrix of order ``width``."""
    return hadamard_order(width) is not None


def describe(width: int) -> str:
    """How the Hadamard matrix of order ``width`` is built (e.g. ``"Paley I (q=11) ⊗ Sylvester 64"``)."""
    k = hadamard_order(width)
    if k is None:
        return "none"
    parts = [] if k == 1 else [_describe(_recipe(k))]
    if width // k > 1:
        parts.append(f"Sylvester {width // k}")
    return " ⊗ ".join(parts)


@lru_cache(maxsize=64)
def _small(k: int) -> torch.Tensor:
    h = _build(_recipe(k)) if k > 1 else torch.ones(1, 1, dtype=torch.int64)
    return h


def hadamard(width: int, dtype: torch.dtype = torch.float64) -> torch.Tensor | None:
    """A Hadamard matrix of order ``width`` (entries ±1, ``H Hᵀ = width·I``), or None when none is built here.

    ``H = H_K ⊗ H_{2^m}`` with ``K = hadamard_order(width)``: the same matrix :func:`fwht` applies."""
    k = hadamard_order(width)
    if k is None:
        return None
    return torch.kron(_small(k), _sylvester(width // k)).to(dtype)


def paley_orders(limit: int) -> list[int]:
    """Every order ``n ≤ limit`` (a multiple of 4, not a power of two) that a Paley construction gives."""
    return [n for n in range(4, limit + 1, 4) if n & (n - 1) and _paley_recipe(n) is not None]


def small_factor(width: int) -> torch.Tensor | None:
    """``H_K`` for ``width = K·2^m`` (float64), the dense factor :func:`fwht` multiplies by; None when none."""
    k = hadamard_order(width)
    return None if k is None else _small(k).to(torch.float64)


def random_signs(n: int, seed: int) -> torch.Tensor:
    """``n`` random ±1 (float64), deterministic given ``seed``: the diagonal ``D`` of a randomized Hadamard."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1


# ------------------------------------------------------------------------ the fast transform
def fwht(x: torch.Tensor, small: torch.Tensor | None = None, *, scale: float | None = None) -> torch.Tensor:
    """``x @ H`` along the last axis (``H = H_K ⊗ H_{2^m}``, the matrix :func:`hadamard` builds), times ``scale``
    (default ``1/sqrt(width)``: the orthonormal transform).

    ``small`` is ``H_K`` (:func:`small_factor`, as a buffer of the caller's, so that tracing sees a
    constant tensor and not Python work); it is looked up when None. Stock ops only (view, add, sub,
    cat, matmul): it traces, exports and compiles like any other torch code. The ``2^m`` part is a
    butterfly of ``m`` stages, the ``K`` part one matmul; ``H`` is symmetric for Sylvester only, and
    the small factor is applied as ``x @ H_K``.
    """
    n = x.shape[-1]
    if small is None:
        small = small_factor(n)
        if small is None:
            raise ValueError(f"no Hadamard matrix of order {n}")
    k = small.shape[0]
    m = n // k
    lead = x.shape[:-1]
    y = x.reshape(-1, k, m)
    h = 1
    while h < m:  # butterfly: pairs (i, i + h) inside blocks of 2h
        y = y.reshape(-1, k, m // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.cat([a + b, a - b], dim=-1)
        h *= 2
    y = y.reshape(-1, k, m)
    if k > 1:  # (x @ (H_K ⊗ S))[j, l] = Σ_i H_K[i, j] (x_i S)[l]
        y = torch.matmul(small.to(y.dtype).transpose(0, 1), y)
    y = y.reshape(*lead, n)
    return y * (scale if scale is not None else n**-0.5)


POW2_DENSE_MAX = 256  # round 51's stock form (hadamard_matmuls): up to this order the 2^m factor is one dense matmul


def sylvester(m: int) -> torch.Tensor | None:
    """The Sylvester Hadamard matrix of order ``m`` (a power of two) in float64: the ``2^m`` factor
    :func:`fwht`'s butterfly applies; None for any other ``m``."""
    if m < 1 or m & (m - 1):
        return None
    with torch.device("cpu"):  # real values even where a loader builds modules on the meta device
        return _sylvester(m).to(torch.float64)


def hadamard_matmuls(x: torch.Tensor, small: torch.Tensor, pow2: torch.Tensor, *,
                     scale: float | None = None, rest: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`fwht` as matmuls: ``x`` in blocks of ``2^m`` times ``H_{2^m}`` (``pow2``, :func:`sylvester`),
    then the ``K × K`` factor across the blocks. The same transform to float rounding. Where the power-of-two
    part is larger than :data:`POW2_DENSE_MAX`, it is split (Sylvester's ``H_{r·2^m} = H_r ⊗ H_{2^m}``): ``pow2``
    is ``H_{2^m}`` for the last ``2^m`` of it and ``rest`` the ``H_r`` for the rest (:func:`pow2_factors`), one
    more matmul; ``H = H_K ⊗ H_r ⊗ H_{2^m}``.

    Why: an exported butterfly is about six graph nodes per stage (slices, add, sub, concat); two or three
    matmuls are as many nodes, and engines run a few large nodes much faster than many small ones (ONNX Runtime
    ran a DINOv2-small with 60 butterflies at 2.6× the original's time)."""
    n = x.shape[-1]
    k, m = small.shape[0], pow2.shape[0]
    lead = x.shape[:-1]
    if rest is None:
        y = torch.matmul(x.reshape(-1, k, m), pow2.to(x.dtype))  # Sylvester's H is symmetric
    else:  # across the r blocks of 2^m inside each of the K: (H_r ⊗ H_{2^m}) is H_r applied to the block index
        r = rest.shape[0]
        y = torch.matmul(x.reshape(-1, k, r, m), pow2.to(x.dtype))
        y = torch.matmul(rest.to(y.dtype), y).reshape(-1, k, r * m)
    if k > 1:
        y = torch.matmul(small.to(y.dtype).transpose(0, 1), y)
    return y.reshape(*lead, n) * (scale if scale is not None else n**-0.5)


def split_matmuls(x: torch.Tensor, small: torch.Tensor, first: torch.Tensor, *, rest: torch.Tensor | None = None,
                  scale: float | None = None) -> torch.Tensor:
    """``x @ H`` times ``scale`` along the last axis, ``H = H_K ⊗ H_{2^m}`` (:func:`hadamard`) run as
    ``(H_K ⊗ H_{2^m/b}) ⊗ H_b``: ``x`` in rows of ``b`` times ``first`` (``H_b``, times the scale where the caller
    folded it in: then ``scale`` is None), then one matmul by ``(H_K ⊗ H_r)ᵀ`` across the ``g = n/b`` rows of each
    token (``rest`` is ``H_r``, ``r = 2^m/b``, or None for ``r = 1``). The same transform as :func:`fwht` and
    :func:`hadamard_matmuls` to float rounding; the online op's stock form (what ``torch.compile`` and the
    exporters capture), with ``b`` from :func:`normswap.rotation.eager_op.split`, the eager form's split.

    Why: ``b + K·2^m/b`` multiply-adds per feature instead of :func:`hadamard_matmuls`' ``2^m + K`` (width 1,536:
    80 instead of 140; width 2,048, ``K = 1``: 96 instead of 264), two ``MatMul`` nodes at every width, the scale
    in a constant instead of a ``Mul`` over the output, and one ``Reshape`` back by the input's own shape (a
    ``Shape`` node, not a ``Shape``/``Gather``/``Unsqueeze``/``Concat`` chain per axis)."""
    b = first.shape[0]
    second = small.to(x.dtype) if rest is None else \
        (small.to(x.dtype)[:, None, :, None] * rest.to(x.dtype)[None, :, None, :]).reshape(
            small.shape[0] * rest.shape[0], -1)  # H_K ⊗ H_r, made of the stored H_K (a constant once exported)
    g = second.shape[0]
    y = torch.matmul(x.reshape(-1, g, b), first.to(x.dtype))  # Sylvester's H_b is symmetric
    if g > 1:
        y = torch.matmul(second.transpose(0, 1), y)
    y = y.reshape_as(x)
    return y if scale is None else y * scale


def pow2_factors(m: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(H_{2^m}, H_r)``, the Sylvester factors :func:`hadamard_matmuls` multiplies by (the online op's stock form
    in round 51; since round 52 it runs :func:`split_matmuls`) for an op whose power-of-two part is ``m``:
    ``(H_m, None)`` up to :data:`POW2_DENSE_MAX`, above ``(H_{POW2_DENSE_MAX}, H_{m/POW2_DENSE_MAX})`` (widths such
    as 512, 2,048 or 4,096 then export as matmuls, not as a butterfly); ``(None, None)`` for an ``m`` that is not a
    power of two."""
    if m <= POW2_DENSE_MAX:
        return sylvester(m), None
    rest = sylvester(m // POW2_DENSE_MAX)
    return (None, None) if rest is None else (sylvester(POW2_DENSE_MAX), rest)


def is_block_factor(k: int) -> bool:
    """Whether an online Hadamard's stored factor of order ``k`` is a block ``H_b`` of a block-diagonal op
    (``k`` a power of two, at least 2) rather than the small factor ``H_K`` of a full one: :func:`hadamard_order`
    never returns a power of two above 1 (its ``K`` is 1 or an odd number times 4 or more), so the order alone
    tells the two apart, in a checkpoint as in memory."""
    return k >= 2 and k & (k - 1) == 0


def block_hadamard(width: int, block: int, dtype: torch.dtype = torch.float64) -> torch.Tensor | None:
    """``(I_{width/block} ⊗ H_block)/sqrt(block)``: the orthogonal block-diagonal Hadamard matrix a block-diagonal
    online op applies (:func:`block_matmul`); None where ``block`` is not a power of two dividing ``width``."""
    if block < 1 or block & (block - 1) or width % block:
        return None
    eye = torch.eye(width // block, dtype=torch.float64)
    return (torch.kron(eye, _sylvester(block).to(torch.float64)) / block**0.5).to(dtype)


def block_matmul(x: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """``x @ (I ⊗ H_b)/sqrt(b)`` along the last axis: ``x`` in blocks of ``b`` (``block`` is ``H_b``, the
    Sylvester matrix, :func:`sylvester`) times ``H_b``, one matmul, then the scale ``b^-½``.

    Why: ``n·b`` multiply-adds per token instead of the full transform's ``n·(2^m + K)``, and one exported
    ``MatMul`` node; still orthogonal, so still exact. A block-wise weight quantizer whose groups are aligned
    with the blocks gets each group's inputs evened out as by the full transform."""
    n, b = x.shape[-1], block.shape[0]
    y = torch.matmul(x.reshape(*x.shape[:-1], n // b, b), block.to(x.dtype))  # Sylvester's H is symmetric
    return y.reshape(x.shape) * b**-0.5
