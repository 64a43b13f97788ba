"""Hadamard matrices built in code (Sylvester, Paley I/II over prime fields and prime-power fields,
Kronecker products), the fast Walsh–Hadamard transform, and the rotation matrices built from them."""

import pytest
import torch

from normswap.rotation import hadamard as hd
from normswap.rotation.rotate import is_mean_preserving, keep_mean, random_orthogonal, rotation_matrix


def _is_hadamard(h: torch.Tensor) -> bool:
    n = h.shape[0]
    return bool(((h == 1) | (h == -1)).all()) and torch.equal(h @ h.T, n * torch.eye(n, dtype=h.dtype))


def test_every_order_built_up_to_160_is_hadamard_and_the_covered_set_is_known():
    built = []
    for n in range(1, 161):
        h = hd.hadamard(n)
        if h is None:
            continue
        assert h.shape == (n, n)
        assert _is_hadamard(h), n
        built.append(n)
    # every power of two, and every multiple of 4 up to 160 except those no Paley/product construction reaches
    assert [n for n in range(4, 161, 4) if n not in built] == [92, 116, 156]
    assert [n for n in range(160, 401, 4) if not hd.has_hadamard(n)] == [172, 184, 188, 232, 236, 260, 268, 292,
                                                                         324, 356, 372, 376]
    assert [n for n in built if n % 4] == [1, 2]


@pytest.mark.parametrize("q, n", [(11, 12), (19, 20), (27, 28), (43, 44), (59, 60), (83, 84), (107, 108)])
def test_paley_one_including_prime_power_fields(q, n):
    assert hd.hadamard_order(n) == n and f"q={q}" in hd.describe(n)
    assert _is_hadamard(hd.hadamard(n))


@pytest.mark.parametrize("q, n", [(13, 28), (17, 36), (25, 52), (37, 76), (41, 84), (49, 100)])
def test_paley_two_including_prime_power_fields(q, n):
    h = hd._paley2(q)  # the construction itself, even where Paley I also reaches the order
    assert h.shape == (n, n) and _is_hadamard(h)


def test_prime_power_field_of_343_gives_order_344():
    # 11008 (Llama-7B's MLP width) = 344 · 32, with 343 = 7^3 ≡ 3 mod 4
    assert hd.hadamard_order(11008) == 344
    assert _is_hadamard(hd._paley1(343))


@pytest.mark.parametrize("width, k", [(384, 12), (768, 12), (1024, 1), (1536, 12), (2048, 1), (2560, 20),
                                      (3072, 12), (5120, 20), (7168, 28), (4864, 76), (13824, 108), (14336, 28)])
def test_typical_hidden_sizes_are_covered(width, k):
    assert hd.hadamard_order(width) == k


def test_a_large_width_without_order_is_answered_without_building_anything():
    assert hd.hadamard_order(1000 * 1024 + 4) is None  # 4 · 256001: no Paley field, no product

@pytest.mark.parametrize("width", [6, 10, 30, 92, 7])
def test_widths_without_a_hadamard_order(width):
    assert hd.hadamard(width) is None and not hd.has_hadamard(width)
    q, info = rotation_matrix(width, "hadamard", seed=1)
    assert "no Hadamard matrix" in info["fallback"] and info["construction"] == ""
    assert torch.allclose(q @ q.T, torch.eye(width, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("width", [1, 2, 16, 12, 40, 96, 768, 44 * 8])
def test_fast_transform_equals_the_matrix(width):
    x = torch.randn(3, 5, width, dtype=torch.float64)
    h = hd.hadamard(width)
    assert torch.allclose(hd.fwht(x), x @ h / width**0.5, atol=1e-12)
    assert torch.allclose(hd.fwht(x, scale=1.0), x @ h, atol=1e-10)
    assert torch.allclose(hd.fwht(x) @ h.T / width**0.5, x, atol=1e-12)  # orthonormal: undone by Hᵀ/sqrt(n)


def test_fast_transform_refuses_a_width_without_order():
    with pytest.raises(ValueError, match="no Hadamard"):
        hd.fwht(torch.randn(2, 10))


@pytest.mark.parametrize("kind", ["hadamard", "random"])
@pytest.mark.parametrize("width", [12, 64, 96, 30])
def test_rotation_matrices_are_orthogonal_mean_preserving_and_seeded(kind, width):
    q, info = rotation_matrix(width, kind, seed=3)
    eye = torch.eye(width, dtype=torch.float64)
    assert torch.allclose(q @ q.T, eye, atol=1e-12)
    ones = torch.ones(width, dtype=torch.float64)
    assert torch.allclose(q @ ones, ones, atol=1e-12) and is_mean_preserving(q)
    assert torch.equal(q, rotation_matrix(width, kind, seed=3)[0])
    assert not torch.allclose(q, rotation_matrix(width, kind, seed=4)[0])
    # a zero-mean row stays zero-mean, a centering commutes
    x = torch.randn(7, width, dtype=torch.float64)
    xc = x - x.mean(-1, keepdim=True)
    assert float((xc @ q).mean(-1).abs().max()) < 1e-12
    assert torch.allclose((x @ q) - (x @ q).mean(-1, keepdim=True), xc @ q, atol=1e-12)


def test_mean_preserving_hadamard_still_spreads_every_feature():
    """Incoherence: a feature carrying an outlier comes out spread, |Q_ij| ≤ c / sqrt(d)."""
    for width in (768, 1280):
        q, _ = rotation_matrix(width, "hadamard", seed=0)
        assert float(q.abs().max()) * width**0.5 < 2.0, width  # the mean-keeping correction is O(1/d)
        # a Haar-random matrix is far less flat
        r = keep_mean(random_orthogonal(width, 0))
        assert float(q.abs().max()) < float(r.abs().max())
    assert not is_mean_preserving(random_orthogonal(16, 0))


def test_randomized_hadamard_is_signed_h_corrected_by_one_reflection():
    width = 48
    h = hd.hadamard(width)
    s = hd.random_signs(2 * width, 5)
    plain = s[:width, None] * h * s[width:] / width**0.5
    q, info = rotation_matrix(width, "hadamard", seed=5)
    assert info["construction"].startswith("randomized Hadamard")
    diff = q - plain
    assert torch.linalg.matrix_rank(diff) == 1  # a rank-one (Householder) correction of H·D/sqrt(n)
