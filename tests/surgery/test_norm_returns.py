"""A norm that returns more than its output keeps its call and return convention once converted.

I-BERT's ``IntLayerNorm`` (``quant_mode=False``) is called as ``norm(x, scaling_factor)`` and returns
``(x, None)``; the replacement RMSNorm returns the same tuple, in memory and after a native
save/load. A custom norm returning one of its own arguments passes it through; a norm returning
something it computed besides its output cannot be replaced and is kept with that reason.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import IBertConfig, IBertModel

import normswap
from normswap.analysis.plan import plan_of
from normswap.nn.call_args import RMSNormTakingArgs
from normswap.nn.rmsnorm import RMSNorm

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _tiny_ibert() -> IBertModel:
    torch.manual_seed(0)
    cfg = IBertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=37, max_position_embeddings=64, quant_mode=False)
    model = IBertModel(cfg).double().eval()
    with torch.no_grad():  # γ/β away from (1, 0), so a dropped β or γ would show
        for m in model.modules():
            if type(m).__name__ == "IntLayerNorm":
                m.weight.normal_(1.0, 0.3)
                m.bias.normal_(0.0, 0.3)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(3, 99, (2, 11), generator=torch.Generator().manual_seed(1))


def _returned_by_norms(model: nn.Module, ids: torch.Tensor) -> dict[str, object]:
    got: dict[str, object] = {}
    hooks = [m.register_forward_hook(lambda mod, a, o, n=n: got.__setitem__(n, o))
             for n, m in model.named_modules() if isinstance(m, RMSNorm)]
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return got


def test_ibert_converts_and_keeps_the_tuple_convention(tmp_path):
    model = _tiny_ibert()
    ids = _ids()
    with torch.no_grad():
        ref = model(input_ids=ids).last_hidden_state.clone()
    report = normswap.patch(model)
    plan = plan_of(model)
    assert all(sp.convert for sp in plan.sites) and len(plan.sites) == 5
    # Post-LN: the embedding norm is exact, the four block norms approximate with a measured error
    verdicts = sorted(sp.verdict for sp in plan.sites)
    assert verdicts.count("approximate") == 4, verdicts
    assert all(sp.returns == {"type": "tuple", "items": ["output", "None"]} for sp in plan.sites)
    assert all(isinstance(model.get_submodule(sp.name), RMSNormTakingArgs) for sp in plan.sites)
    # honest: each approximate norm carries its measured error, and the model's error is what was reported
    assert all(sp.error is not None and sp.error > 0 for sp in plan.sites if sp.verdict == "approximate")
    with torch.no_grad():
        out = model(input_ids=ids).last_hidden_state
    assert 0 < (out - ref).abs().max() / ref.abs().max() < 0.1
    assert report.verification["max_rel_error"] < 0.1
    returned = _returned_by_norms(model, ids)
    assert len(returned) == 5
    assert all(isinstance(o, tuple) and len(o) == 2 and o[1] is None for o in returned.values())

    # native checkpoint: convert a saved model, load it back, same outputs and the same tuples
    src = tmp_path / "ibert"
    _tiny_ibert().save_pretrained(src)
    normswap.convert(str(src), tmp_path / "out")
    loaded = normswap.load(tmp_path / "out").double().eval()
    assert all(plan_of(loaded).sites[i].returns == plan.sites[i].returns for i in range(5))
    with torch.no_grad():
        again = loaded(input_ids=ids).last_hidden_state
    assert 0 < (again - ref).abs().max() / ref.abs().max() < 0.1
    assert all(isinstance(o, tuple) and o[1] is None for o in _returned_by_norms(loaded, ids).values())


class _PassNorm(nn.Module):
    """A LayerNorm returning ``(y, mask)``, the mask passed through as it came in."""

    def __init__(self, d: int, computed: bool = False) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))
        self.computed = computed

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = nn.functional.layer_norm(x, x.shape[-1:], self.weight, self.bias, 1e-5)
        return y, (mask * 2 if self.computed else mask)


class _Net(nn.Module):
    def __init__(self, computed: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)
        self.norm1, self.norm2 = _PassNorm(16, computed), _PassNorm(16, computed)
        self.head = nn.Linear(16, 7)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = torch.ones(ids.shape, dtype=torch.float64)
        h = self.emb(ids)
        y, mask = self.norm1(h, mask)
        h = h + self.down(torch.relu(self.up(y)))
        y, mask = self.norm2(h, mask)
        return self.head(y) * mask[..., None]


def _net(computed: bool = False) -> _Net:
    torch.manual_seed(2)
    net = _Net(computed).double().eval()
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, _PassNorm):
                m.weight.normal_(1.0, 0.3)
                m.bias.normal_(0.0, 0.3)
    return net


def test_passed_through_argument_is_returned_exactly():
    net = _net()
    ids = torch.randint(0, 50, (3, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = net(ids).clone()
    normswap.patch(net, example_inputs=(ids,))
    plan = plan_of(net)
    converted = [sp for sp in plan.sites if sp.convert]
    assert {sp.returns["items"][1] for sp in converted} == {"arg 1"}
    assert all(sp.verdict != "approximate" for sp in converted)
    with torch.no_grad():
        out = net(ids)
    assert (out - ref).abs().max() < 1e-9
    norm = net.get_submodule(converted[0].name)
    x, mask = torch.randn(2, 16, dtype=torch.float64), torch.randn(2)
    y, back = norm(x, mask)
    assert back is mask and y.shape == x.shape


def test_a_norm_returning_what_it_computed_is_kept_with_the_reason():
    net = _net(computed=True)
    ids = torch.randint(0, 50, (3, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = net(ids).clone()
    plan = normswap.patch(net, example_inputs=(ids,)).plan
    assert not any(sp.convert for sp in plan.sites)
    kept = {s["name"]: s["reason"] for s in plan.skipped}
    assert set(kept) == {"norm1", "norm2"}
    assert all("(output, computed tensor)" in r and "no RMSNorm can return it" in r for r in kept.values()), kept
    assert not any(isinstance(m, RMSNorm) for m in net.modules())
    with torch.no_grad():
        assert (net(ids) - ref).abs().max() < 1e-9


def test_ordinary_norms_get_the_plain_rmsnorm():
    net = nn.Sequential(nn.Embedding(50, 16), nn.LayerNorm(16), nn.Linear(16, 4)).double().eval()
    normswap.patch(net, example_inputs=(torch.randint(0, 50, (2, 5)),))
    assert type(net[1]) is RMSNorm
