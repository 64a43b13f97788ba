"""Verification of models that draw random numbers in eval mode (issue 38): every generator normswap can seed is
seeded identically for the original and the converted model (torch's default one, a ``torch.Generator`` the
model holds, NumPy's global and held generators, Python's ``random``), and restored after; randomness no seed
reaches (a generator seeded from the system on each call) is named in the refusal, with the way out. Pre-LN
models whose tokens are shuffled at random, as ViT-MAE's masking does, in float64 with LayerNorm γ/β
randomised."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import normswap
from normswap.errors import VerificationFailed
from normswap.surgery.verify import RANDOM_NOTE, held_generators, same_draws


class Shuffled(nn.Module):
    """Embed, shuffle the tokens by random noise (argsort, as ViT-MAE), then one Pre-LN residual block and a
    final norm. ``source`` says where the noise comes from."""

    def __init__(self, source: str, d: int = 16) -> None:
        super().__init__()
        self.source = source
        self.emb = nn.Linear(8, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc, self.head = nn.Linear(d, d), nn.Linear(d, 5)
        if source == "held torch.Generator":
            self.generator = torch.Generator().manual_seed(7)
        if source == "held numpy Generator":
            self.rngs = [np.random.default_rng(7)]  # inside a list: found too
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for ln in (self.ln1, self.ln2):
                ln.weight.copy_(torch.rand(d, generator=gen) + 0.5)
                ln.bias.copy_(torch.randn(d, generator=gen) * 0.3)

    def noise(self, b: int, t: int) -> torch.Tensor:
        if self.source == "torch default":
            return torch.rand(b, t)
        if self.source == "held torch.Generator":
            return torch.rand(b, t, generator=self.generator)
        if self.source == "numpy global":
            return torch.from_numpy(np.random.rand(b, t))
        if self.source == "held numpy Generator":
            return torch.from_numpy(self.rngs[0].random((b, t)))
        if self.source == "python random":
            return torch.tensor([[random.random() for _ in range(t)] for _ in range(b)])
        if self.source == "system-seeded torch":
            torch.seed()
            return torch.rand(b, t)
        if self.source == "system-seeded numpy":
            return torch.from_numpy(np.random.default_rng().random((b, t)))
        return torch.arange(float(t)).expand(b, t)  # deterministic

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        order = self.noise(x.shape[0], x.shape[1]).argsort(-1)
        h = torch.gather(h, 1, order.unsqueeze(-1).expand_as(h))
        h = h + self.fc(self.ln1(h))
        return self.head(self.ln2(h))


def _model(source: str) -> nn.Module:
    torch.manual_seed(0)
    return Shuffled(source).double().eval()


def _states(model: nn.Module) -> list:
    held = [g.get_state() if isinstance(g, torch.Generator) else g.bit_generator.state
            for g in held_generators(model)]
    return [torch.get_rng_state(), np.random.get_state(legacy=False)["state"]["key"].copy(), random.getstate(), held]


def _same(a: list, b: list) -> bool:
    if len(a[3]) != len(b[3]):
        return False
    held = all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a[3], b[3], strict=True))
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2] and held


SEEDED = ["torch default", "held torch.Generator", "numpy global", "held numpy Generator", "python random"]


@pytest.mark.parametrize("source", SEEDED)
def test_a_model_drawing_from_any_seedable_generator_converts_exactly(source):
    """Failed before for every source but torch's default generator: 'converted outputs differ ... 1.3e+00'."""
    model = _model(source)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    with torch.no_grad():  # the model really is random in eval mode: two runs differ
        assert not torch.equal(model(x), model(x))
    before = _states(model)
    report = normswap.patch(model, (x,))
    assert _same(before, _states(model))  # the user's random streams, and the model's own, untouched
    assert all(sp.convert and sp.verdict.startswith("exact") for sp in report.sites), report.plan.table()
    assert report.verification["max_rel_error"] < 1e-12
    assert RANDOM_NOTE in report.message


@pytest.mark.parametrize("source", SEEDED)
def test_same_draws_gives_two_copies_the_same_numbers_and_says_it_drew(source):
    model = _model(source)
    twin = _model(source)
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    with torch.no_grad():
        model(x)  # the model's generators now in another state than its twin's
        with same_draws(model) as draws:
            a = model(x)
        with same_draws(twin):
            b = twin(x)
    assert torch.equal(a, b) and draws.drew


def test_a_deterministic_model_is_not_said_to_draw():
    model = _model("deterministic")
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    with torch.no_grad(), same_draws(model) as draws:
        model(x)
    assert not draws.drew


@pytest.mark.parametrize("source", ["system-seeded torch", "system-seeded numpy"])
def test_randomness_no_seed_reaches_is_named_in_the_refusal(source):
    model = _model(source)
    with pytest.raises(VerificationFailed) as e:
        normswap.patch(model, (torch.randn(2, 6, 8, dtype=torch.float64),))
    msg = str(e.value)
    assert "model left unchanged; the original itself differs by" in msg
    assert "mask_ratio=0" in msg and "\n" not in msg
    assert isinstance(model.ln1, nn.LayerNorm)  # untouched


@pytest.mark.parametrize("source", [*SEEDED, "deterministic", "system-seeded torch", "system-seeded numpy"])
def test_unseeded_randomness_names_only_what_no_seed_reaches(source):
    """What ``patch``'s refusal and ``normswap verify``'s verdict append (verify runs ORIGINAL's forward with
    keyword inputs, in whatever dtype its own-error measurement left it)."""
    from normswap.checkpoint import verify_dirs

    model = _model(source)
    x = torch.randn(2, 6, 8, dtype=torch.float32)
    why = verify_dirs._unseeded(model, {"x": x})  # cast to the model's float64
    assert (why is not None) == source.startswith("system-seeded"), why
    if why:
        assert why.startswith("the original itself differs by") and "noise=" in why
