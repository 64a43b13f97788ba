"""LayerScale λ on a centered writer: kept as a rebalanced per-row scale (default) or folded (``layer_scale="fold"``).

Both are exact; the kept form also keeps the writer's weight ranges, which is what a per-tensor int8
quantizer sees (``docs/results/quantization.md``: folding DINOv2's λ, 1e-4 to 10, into the attention output
projection took its max|w|/rms from 4.4 to 35 and ONNX Runtime's per-tensor dynamic int8 error 16-fold).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

import normswap

transformers = pytest.importorskip("transformers")


def _dinov2(seed: int = 0) -> torch.nn.Module:
    """A tiny DINOv2 with λ spread over five decades (2e-4 … 11.3, as DINOv2-small's) and γ/β randomised."""
    cfg = transformers.Dinov2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                                    image_size=28, patch_size=14, layerscale_value=1.0)
    torch.manual_seed(seed)
    model = transformers.Dinov2Model(cfg).eval().double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lambda" in name:  # log-uniform over [2e-4, 11.3]
                u = torch.rand(p.shape, generator=g, dtype=torch.float64)
                p.copy_(torch.exp(math.log(2e-4) + u * (math.log(11.3) - math.log(2e-4))))
            elif "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g, dtype=torch.float64) if name.endswith("weight")
                        else 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return model


def _pixels(n: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 28, 28, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _patched(model: torch.nn.Module, **options) -> torch.nn.Module:
    out = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(out, **options)
    return out


def _rel_error(a: torch.nn.Module, b: torch.nn.Module, px: torch.Tensor) -> float:
    with torch.no_grad():
        x, y = a(pixel_values=px).last_hidden_state, b(pixel_values=px).last_hidden_state
    return float((x - y).abs().max() / x.abs().max())


def _writers(model: torch.nn.Module):
    for layer in model.encoder.layer:
        yield layer.attention.o_proj, layer.layer_scale1.lambda1
        yield layer.mlp.fc2, layer.layer_scale2.lambda1


def _max_over_rms(w: torch.Tensor) -> float:
    w = w.detach().double()
    return float(w.abs().max() / w.pow(2).mean().sqrt())


@pytest.mark.parametrize("layer_scale", ["keep", "fold"])
def test_layer_scale_choice_is_exact_in_float64(layer_scale: str):
    model = _dinov2()
    conv = _patched(model, layer_scale=layer_scale)
    assert _rel_error(model, conv, _pixels()) < 1e-9
    plan = normswap.plan_of(conv)
    assert len(plan.scale_folds) == 4 and {f.keep for f in plan.scale_folds} == {layer_scale == "keep"}
    assert plan.options["layer_scale"] == layer_scale
    lams = [lam for _, lam in _writers(conv)]
    if layer_scale == "fold":
        assert all(bool((lam == 1).all()) for lam in lams)
    else:  # still a per-channel scale, not folded away
        assert all(float(lam.detach().min()) > 0 and float(lam.detach().std()) > 0.01 for lam in lams)


def test_kept_layer_scale_keeps_the_writers_ranges():
    """max|w|/rms of each converted writer ≤ 1.05× the original's; folding λ spreads the rows (the cause)."""
    model = _dinov2()
    kept, folded = _patched(model), _patched(model, layer_scale="fold")
    for (w0, _), (wk, _), (wf, _) in zip(_writers(model), _writers(kept), _writers(folded), strict=True):
        before = _max_over_rms(w0.weight)
        assert _max_over_rms(wk.weight) <= 1.05 * before
        assert _max_over_rms(wf.weight) > 2 * before  # what the default avoids
        peak0, rows = float(w0.weight.detach().abs().max()), wk.weight.detach().abs().amax(1)
        assert bool((rows <= peak0 * (1 + 1e-12)).all()) and bool((rows > peak0 * 8 / 9).all())  # the range, nearly all


def test_kept_layer_scale_is_exact_in_half_precision():
    """λ has four significant bits: a bfloat16 or float16 model stores it exactly (the folded model's λ = 1
    is exact too), so keeping λ adds no rounding of its own."""
    conv = _patched(_dinov2())
    for _, lam in _writers(conv):
        lam = lam.detach()
        assert torch.equal(lam.bfloat16().double(), lam) and torch.equal(lam.half().double(), lam)


def test_kept_layer_scale_stream_is_zero_mean():
    """The centered product λ ⊙ (W h + b) is zero-mean for every h: the RMSNorm reading it is exact."""
    conv = _patched(_dinov2())
    for lin, lam in _writers(conv):
        prod = lam.detach()[:, None] * lin.weight.detach()
        assert float(prod.sum(0).abs().max()) < 1e-12 * float(prod.abs().max())
        assert abs(float((lam.detach() * lin.bias.detach()).sum())) < 1e-12 * float(lin.bias.detach().abs().max() + 1)


def test_rotation_folds_kept_layer_scale_first():
    model = _dinov2()
    conv = _patched(model, fold_gamma=True)
    assert all(f.keep for f in normswap.plan_of(conv).scale_folds)
    result = normswap.rotate(conv, "hadamard", output="restore")
    assert result.rotated
    assert _rel_error(model, conv, _pixels()) < 1e-9
    plan = normswap.plan_of(conv)
    assert not any(f.keep for f in plan.scale_folds)
    assert all(bool((lam == 1).all()) for _, lam in _writers(conv))


def test_kept_layer_scale_survives_a_compat_checkpoint(tmp_path):
    """The compat format stores the rebalanced λ in the stock LayerScale; plain transformers reloads it exactly."""
    model = _dinov2()
    conv = _patched(model)
    normswap.save(conv, tmp_path / "compat", format="compat")
    reloaded = transformers.Dinov2Model.from_pretrained(tmp_path / "compat", dtype=torch.float64).eval()
    assert _rel_error(model, reloaded, _pixels()) < 1e-9
    for (_, lam), (_, lam2) in zip(_writers(conv), _writers(reloaded), strict=True):
        assert torch.equal(lam.detach(), lam2.detach())


def test_layer_scale_option_is_checked():
    with pytest.raises(normswap.NormswapError, match="layer_scale"):
        normswap.patch(_dinov2(), layer_scale="balance")


@pytest.mark.parametrize("layer_scale", ["keep", "fold"])
def test_streamed_conversion_writes_the_in_memory_layer_scale_bits(tmp_path, layer_scale: str):
    """The low-memory path applies the same λ fold and rebalancing tensor by tensor (before, it centered the
    writers without λ and its verification refused the result)."""
    model = _dinov2().float()
    model.save_pretrained(tmp_path / "src")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.convert(tmp_path / "src", tmp_path / "streamed", format="compat", low_memory=True,
                         layer_scale=layer_scale)
        normswap.convert(tmp_path / "src", tmp_path / "memory", format="compat", layer_scale=layer_scale)
    streamed = transformers.Dinov2Model.from_pretrained(tmp_path / "streamed").state_dict()
    memory = transformers.Dinov2Model.from_pretrained(tmp_path / "memory").state_dict()
    assert streamed.keys() == memory.keys()
    assert all(torch.equal(streamed[k], memory[k]) for k in memory)
    lam = streamed["encoder.layer.0.layer_scale1.lambda1"]
    assert bool((lam == 1).all()) == (layer_scale == "fold")
