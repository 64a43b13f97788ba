"""Pieces of ``bench_heldout_engines.py`` (round 48's held-out engines: bitsandbytes, HQQ, GGUF).

What could be silently wrong: a module swap that quantizes a rotation's own ``Qᵀ`` (docs/rotation.md keeps it
in float) or a group's outsiders, a failing engine that leaves the model half-swapped, a GGUF round trip that
is not the format's (a weight that does not round back to itself, a width the block does not divide stored
anyway), and a round trip that writes through a tied weight into the embedding.
"""

from __future__ import annotations

import pytest
import torch

from tests import benchmark_modules

bench = benchmark_modules.load("bench_heldout_engines")


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(64, 64)
        self.fc2 = torch.nn.Linear(128, 64)
        self.rotation_restore = torch.nn.Linear(64, 64, bias=False)  # a rotation's Qᵀ: never quantized
        self.conv = torch.nn.Conv1d(4, 4, 3)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Module()
    m.layer = _Block()
    m.embed = torch.nn.Embedding(10, 64)
    m.proj_out = torch.nn.Linear(64, 10, bias=False)
    m.proj_out.weight = m.embed.weight  # tied, as Whisper's head
    return m


def test_linears_skip_rotation_ops_tied_heads_and_follow_groups() -> None:
    m = _model()
    assert bench.linears(m) == ["layer.q_proj", "layer.fc2"]  # proj_out is a head over the vocabulary: float
    assert bench.linears(m, bench.GROUPS["writers"]) == ["layer.fc2"]
    assert bench.linears(m, bench.GROUPS["readers"]) == ["layer.q_proj"]
    m.proj_out.weight = torch.nn.Parameter(m.embed.weight.detach().clone())  # untied (a converted model's)
    assert bench.linears(m) == ["layer.q_proj", "layer.fc2"]  # the same head: float in both models
    m.proj_out = torch.nn.Linear(64, 12, bias=False)  # not shaped like the embedding: an ordinary Linear
    assert bench.linears(m) == ["layer.q_proj", "layer.fc2", "proj_out"]


def test_swap_linears_is_all_or_nothing() -> None:
    m = _model()
    before = {n: type(mod) for n, mod in m.named_modules()}
    calls = []

    def fails_second(linear: torch.nn.Linear) -> torch.nn.Module:
        calls.append(linear)
        if len(calls) == 2:
            raise RuntimeError("engine failed")
        return torch.nn.Identity()

    with pytest.raises(RuntimeError):
        bench.swap_linears(m, fails_second)
    assert {n: type(mod) for n, mod in m.named_modules()} == before
    assert bench.swap_linears(m, lambda _: torch.nn.Identity(), ["*.fc2"]) == ["layer.fc2"]
    assert isinstance(m.layer.fc2, torch.nn.Identity) and type(m.layer.q_proj) is torch.nn.Linear


def test_quantized_fp32_and_unknown_setting() -> None:
    m = _model()
    assert bench.quantized(m, "fp32") is m
    with pytest.raises(ValueError, match="unknown engine setting"):
        bench.quantized(m, "int3-magic")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_round_trip_is_the_format(qtype: str) -> None:
    torch.manual_seed(1)
    w = torch.randn(48, 96) * torch.logspace(-2, 1, 48)[:, None]  # rows of very different scale
    back = bench.gguf_round_trip(w, qtype)
    assert back.shape == w.shape and back.dtype == torch.float32
    err = (back - w).abs().reshape(48, 3, 32)
    span = w.reshape(48, 3, 32)
    # one scale per 32 inputs: a block's error is half a step of its own range (Q4_0: a whole one, its signed
    # maximum sits on level -8 and a value of the other sign as large is clipped to +7), plus the float16
    # rounding of the stored scale (and minimum) times the largest level (2^-11 relative each)
    levels = {"Q8_0": 127, "Q4_0": 8, "Q4_1": 15}[qtype]
    step = (span.amax(-1) - span.amin(-1) if qtype == "Q4_1" else span.abs().amax(-1)) / levels
    bound = (1.0 if qtype == "Q4_0" else 0.5) * step + (levels * step + span.abs().amax(-1)) * 2.0**-11
    assert bool((err.amax(-1) <= bound).all())
    assert bool((err.amax(-1) > 0.2 * step).any())  # and it is a grid that coarse, not finer
    assert not torch.equal(back, w)
    again = bench.gguf_round_trip(back, qtype)  # values on the grid stay there
    assert torch.allclose(again, back, rtol=0, atol=2e-3 * float(step.max()))
    assert bench.gguf_round_trip(torch.randn(4, 40), qtype) is None  # 40 inputs: no whole block of 32


def test_gguf_quantized_rounds_the_linears_and_leaves_the_rest() -> None:
    m = _model()
    embed = m.embed.weight.detach().clone()
    restore = m.layer.rotation_restore.weight.detach().clone()
    q = bench.quantized(m, "gguf-q4_0")
    assert torch.equal(q.embed.weight, embed) and q.proj_out.weight is q.embed.weight  # tied head: float
    assert torch.equal(q.layer.rotation_restore.weight, restore)
    assert not torch.equal(q.layer.fc2.weight, m.layer.fc2.weight)
    assert torch.equal(q.layer.fc2.weight, bench.gguf_round_trip(m.layer.fc2.weight, "Q4_0"))
    assert isinstance(q.layer.conv, torch.nn.Conv1d)
    assert torch.equal(q.layer.fc2.bias, m.layer.fc2.bias)
    assert type(m.layer.fc2) is torch.nn.Linear  # the input model is not touched


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def test_mlp_permuted_is_the_same_function_rounded_elsewhere() -> None:
    torch.manual_seed(2)
    m = torch.nn.Sequential(_Mlp(), _Mlp()).double()
    x = torch.randn(5, 8, dtype=torch.float64)
    d1, d1_again, d2 = (bench.mlp_permuted(m, s) for s in (1, 1, 2))
    with torch.no_grad():
        assert torch.allclose(d1(x), m(x), rtol=0, atol=1e-12)
    for a, b in ((m, d1), (d1, d2)):  # fc2's inputs (what a grouped quantizer blocks) hold other entries
        assert not torch.equal(a[0].fc2.weight, b[0].fc2.weight)
        assert not torch.equal(a[1].fc2.weight[:, :16], b[1].fc2.weight[:, :16])
    assert all(torch.equal(p, q) for p, q in zip(d1.parameters(), d1_again.parameters(), strict=True))  # by seed
    assert torch.equal(torch.sort(d1[0].fc2.weight, dim=1).values, torch.sort(m[0].fc2.weight, dim=1).values)


def test_an_online_hadamard_rides_on_the_engines_module() -> None:
    """``rotate(model, "none", online=True)`` puts its op on a Linear (a pre-hook; the weight holds the op's
    transpose) wherever the Linear does not share it after a norm. The engine's module must keep it: a float
    copy is the model itself, GGUF's round trip is the same model with every weight rounded in place (the op
    untouched), and without the op the model breaks."""
    import normswap
    from normswap.inputs import hf_example_inputs
    from normswap.rotation.rotate import rotate
    from tests.benchmark_modules import tiny_dinov2

    model = tiny_dinov2(seed=3).float()
    probe = {k: v.float() for k, v in hf_example_inputs(model, seed=5).items()}
    normswap.patch(model, beta_placement="keep")
    rotated = rotate(model, "none", online=True, seed=4).rotated[0]
    online = rotated["online"]  # the Linears with an op of their own (fc1, fc2); q, k, v share one on norm1
    assert len(online) == 4 and len(rotated["online_outputs"]) == 2

    def run(m: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return m(**probe).last_hidden_state

    ref = run(model)

    def plain_copy(linear: torch.nn.Linear) -> torch.nn.Module:
        fresh = torch.nn.Linear(linear.in_features, linear.out_features, linear.bias is not None)
        fresh.load_state_dict({k: v for k, v in linear.state_dict().items() if not k.startswith("normswap")})
        return fresh

    copied = bench.copy.deepcopy(model)
    swapped = bench.swap_linears(copied, plain_copy)
    assert set(online) < set(swapped)  # every Linear, o_proj (no op: a per-head turn of its columns) too
    assert all(copied.get_submodule(p) is not model.get_submodule(p) for p in swapped)
    assert torch.equal(run(copied), ref)

    q = bench.quantized(model, "gguf-q8_0")
    by_hand = bench.copy.deepcopy(model)
    with torch.no_grad():
        for path in swapped:
            w = by_hand.get_submodule(path).weight
            w.copy_(bench.gguf_round_trip(w, "Q8_0"))
    assert torch.equal(run(q), run(by_hand)) and not torch.equal(run(q), ref)
    assert float((run(q) - ref).abs().max() / ref.abs().max()) < 0.05  # a rounded model, not a broken one

    dropped = bench.copy.deepcopy(model)  # what the swap did before it carried the op: a wrong model
    for path in online:
        parent, _, child = path.rpartition(".")
        setattr(dropped.get_submodule(parent), child, plain_copy(dropped.get_submodule(path)))
    with pytest.raises(normswap.NormswapError, match="has lost its online Hadamard"):  # normswap's guard refuses it
        run(dropped)
    from normswap.rotation.carry import Refuse

    for m in dropped.modules():  # the swapped modules refuse their own calls too (round 52): taken off here
        Refuse.disarm(m)
    with torch.no_grad():  # past the guard (the model's own pre-hook): wrong
        out = dropped.forward(**probe).last_hidden_state
    assert float((out - ref).abs().max() / ref.abs().max()) > 0.1
