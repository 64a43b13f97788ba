"""The quantization benchmark's pieces (``benchmarks/quant_utils.py``) and one tiny end-to-end run.

What can be wrong in a fake-quant benchmark without anything crashing: the rounding math, the axis
a scale is shared over (per output channel for weights, per token for activations; Conv1D stores
its weight transposed), the kurtosis formula, and padding tokens leaking into the outlier figures.
Each is checked against a hand computation.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests import benchmark_modules


def _load(name: str):
    return benchmark_modules.load(name)


qu = _load("quant_utils")
bench = _load("bench_quant")


def test_absmax_quantize_matches_a_hand_computation():
    x = torch.tensor([[0.55, -1.0, 0.26, 0.0], [3.0, 1.4, -0.7, 0.1]])
    # 4 bits: qmax 7. Row 0: scale 1/7 -> 0.55*7=3.85 -> 4, -7, 1.82 -> 2, 0
    # Row 1: scale 3/7 -> 7, 1.4*7/3=3.27 -> 3, -0.7*7/3=-1.63 -> -2, 0.1*7/3=0.23 -> 0
    expect = torch.tensor([[4 / 7, -1.0, 2 / 7, 0.0], [3.0, 9 / 7, -6 / 7, 0.0]])
    torch.testing.assert_close(qu.absmax_quantize(x, 4, dim=-1), expect)
    # along dim 0 one scale per column: column 0 (0.55, 3.0) has scale 3/7 -> levels 1, 7;
    # column 1 (-1.0, 1.4) has scale 0.2 -> levels -5, 7
    col = qu.absmax_quantize(x, 4, dim=0)
    torch.testing.assert_close(col[:, 0], torch.tensor([3 / 7, 3.0]))
    torch.testing.assert_close(col[:, 1], torch.tensor([-1.0, 1.4]))


def test_absmax_quantize_levels_bounds_and_zero_rows():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 50, generator=gen, dtype=torch.float64)
    x[2] = 0.0
    for bits in (4, 8):
        q = qu.absmax_quantize(x, bits, dim=1)
        qmax = 2 ** (bits - 1) - 1
        scale = x.abs().amax(1, keepdim=True) / qmax
        scale[2] = 1.0
        levels = q / scale
        assert torch.allclose(levels, levels.round(), atol=1e-9)  # on the grid
        assert levels.abs().max() <= qmax + 1e-9
        assert torch.allclose(q.abs().amax(1)[[0, 1, 3, 4, 5]], x.abs().amax(1)[[0, 1, 3, 4, 5]])  # absmax kept
        assert (q - x).abs().le(scale / 2 + 1e-12).all()  # round to nearest: within half a step
        assert (q[2] == 0).all()
    assert q.dtype == torch.float64
    assert qu.absmax_quantize(x.half(), 8, dim=1).dtype == torch.float16


def test_fake_quantize_linear_weights_per_output_channel_and_inputs_per_token():
    torch.manual_seed(0)
    lin = nn.Linear(5, 3)
    x = torch.randn(2, 4, 5)
    w0 = lin.weight.detach().clone()
    handles = qu.fake_quantize_(lin, 4, 8)
    # weight [out, in]: one scale per output row
    torch.testing.assert_close(lin.weight.detach(), _hand_rtn(w0, 4, rows=True))
    want = _hand_rtn(x.reshape(8, 5), 8, rows=True).reshape(2, 4, 5) @ lin.weight.detach().T + lin.bias.detach()
    torch.testing.assert_close(lin(x), want)
    for h in handles:
        h.remove()
    torch.testing.assert_close(lin(x), x @ lin.weight.detach().T + lin.bias.detach())  # hooks removed


def test_fake_quantize_per_tensor_inputs_share_one_scale_per_sample():
    torch.manual_seed(0)
    lin = nn.Linear(5, 3)
    x = torch.randn(2, 4, 5)
    x[1, 2, 3] = 40.0  # one outlier in sample 1: it sets that sample's scale, not sample 0's
    qu.fake_quantize_(lin, None, 4, act_per="tensor")
    want = torch.stack([_hand_rtn(x[i].reshape(1, 20), 4, rows=True).reshape(4, 5) for i in range(2)])
    torch.testing.assert_close(lin(x), want @ lin.weight.detach().T + lin.bias.detach())
    per_token = _hand_rtn(x.reshape(8, 5), 4, rows=True).reshape(2, 4, 5) @ lin.weight.detach().T + lin.bias.detach()
    assert not torch.allclose(lin(x), per_token)
    with pytest.raises(ValueError, match="act_per"):
        qu.fake_quantize_(nn.Linear(2, 2), None, 4, act_per="channel")


def _hand_rtn(w: torch.Tensor, bits: int, rows: bool) -> torch.Tensor:
    """Element by element, the way one would on paper."""
    qmax = 2 ** (bits - 1) - 1
    out = torch.empty_like(w)
    mat = w if rows else w.T
    res = out if rows else out.T
    for i in range(mat.shape[0]):
        s = max(abs(float(v)) for v in mat[i]) / qmax
        for j in range(mat.shape[1]):
            res[i, j] = min(max(round(float(mat[i, j]) / s), -qmax), qmax) * s
    return out


def test_conv1d_weight_is_quantized_per_output_channel_along_its_transposed_axis():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(1)
    conv = Conv1D(3, 5)  # nf=3 outputs, nx=5 inputs: weight [5, 3]
    w0 = conv.weight.detach().clone()
    qu.fake_quantize_(conv, 4, None)
    torch.testing.assert_close(conv.weight.detach(), _hand_rtn(w0, 4, rows=False))  # a scale per column
    assert not torch.allclose(conv.weight.detach(), _hand_rtn(w0, 4, rows=True))


def test_a_tied_head_is_rounded_where_the_matmul_reads_it_and_the_embedding_is_not():
    emb = nn.Embedding(4, 4)
    head = nn.Linear(4, 4, bias=False)
    head.weight = emb.weight
    w = torch.tensor([[0.3, 0.31, -1.0, 0.1]] * 4)
    with torch.no_grad():
        emb.weight.copy_(w)
    qu.fake_quantize_(nn.ModuleDict({"emb": emb, "head": head}), 2, None)  # qmax 1
    torch.testing.assert_close(head.weight.detach(), torch.tensor([[0.0, 0.0, -1.0, 0.0]] * 4))
    torch.testing.assert_close(emb.weight.detach(), w)


def test_only_the_named_linears_are_quantized():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    before = [m.weight.detach().clone() for m in model]
    handles = qu.fake_quantize_(model, 2, 4, only={"1"})
    assert torch.equal(model[0].weight.detach(), before[0]) and not torch.equal(model[1].weight.detach(), before[1])
    assert len(handles) == 1 and not model[0]._forward_pre_hooks


def test_token_figures_against_hand_values():
    x = torch.tensor([[1.0, -1.0, 1.0, -1.0], [4.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    ratio, kurt = qu.token_figures(x)
    # row 0: rms 1, max 1; kurtosis of ±1: 1. Row 1: rms 2 -> ratio 2; mean 1, c = (3,-1,-1,-1):
    # var = 12/4 = 3, m4 = (81+3)/4 = 21 -> 21/9. Row 2: constant: ratio 1, no spread -> 0
    torch.testing.assert_close(ratio, torch.tensor([1.0, 2.0, 1.0], dtype=torch.float64))
    torch.testing.assert_close(kurt, torch.tensor([1.0, 21 / 9, 0.0], dtype=torch.float64))
    gauss = torch.randn(64, 4096, generator=torch.Generator().manual_seed(0))
    assert qu.token_figures(gauss)[1].mean() == pytest.approx(3.0, abs=0.1)


def test_outlier_stats_are_per_linear_input_and_skip_padding():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.zero_()
    x = torch.tensor([[[4.0, 0, 0, 0], [1.0, -1, 1, -1]]])  # token 1 is padding
    with qu.OutlierStats(model) as stats:
        stats.mask = torch.tensor([[1, 0]])
        model(x)
    per = stats.per_linear()
    assert set(per) == {"0", "1"}
    assert per["0"] == pytest.approx((2.0, 21 / 9))  # only the real token
    s = stats.summary()
    assert s["max_rms_worst"] >= s["max_rms_mean"] and s["kurtosis_worst_at"] in per
    assert not model[0]._forward_pre_hooks  # hooks removed on exit


def test_conv1d_to_linear_is_exact_and_int8_dynamic_runs_integer_linears():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(2)
    model = nn.Sequential(Conv1D(8, 6), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(5, 6)
    ref = model(x)
    swapped = copy.deepcopy(model)
    assert qu.conv1d_to_linear_(swapped) == 1
    torch.testing.assert_close(swapped(x), ref)
    q = qu.int8_dynamic(model)
    kinds = {type(m).__name__ for m in q.modules()}
    assert "Linear" in kinds and any(type(m).__module__.startswith("torch.ao.nn.quantized") for m in q.modules())
    out = q(x)
    assert not torch.equal(out, ref) and torch.allclose(out, ref, atol=0.1)
    assert type(model[0]).__name__ == "Conv1D"  # the original is untouched


def test_lm_errors_kl_and_agreement():
    ref = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64), -1)
    same = bench.errors(ref, ref, "lm")
    assert same["err"] == pytest.approx(0.0, abs=1e-12) and same["agree"] == 1.0
    other = torch.log_softmax(torch.tensor([[0.0, 2.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64), -1)
    e = bench.errors(ref, other, "lm")
    p = ref[0].exp()
    assert e["err"] == pytest.approx(float((p * (ref[0] - other[0])).sum()) / 2)
    assert e["agree"] == 0.5


def test_main_end_to_end_on_a_tiny_random_gpt2(capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small only loses to thread start-up on a busy machine
    try:
        result = bench.main(["--model", "random-gpt2", "--texts", "4", "--precisions", "W8A8", "W4A4",
                             "--rotations", "random", "--real", "int8-dyn"])
    finally:
        torch.set_num_threads(threads)
    rows = result["rows"]
    assert set(rows) == {"original", "converted", "random"}
    assert rows["converted"]["fp32"]["err"] < 1e-9 and rows["random"]["fp32"]["err"] < 1e-9  # exact conversions
    assert rows["original"]["fp32"]["err"] == 0.0
    for name, row in rows.items():
        assert 0 < row["W8A8"]["err"] < row["W4A4"]["err"], name  # fewer bits, more error
        assert "err" in row["int8-dyn"] and row["int8-dyn"]["err"] > 0
        assert row["outliers"]["max_rms_mean"] > 1.0
    # the real quantizer ran on the converted model's compat checkpoint, reloaded in plain transformers
    assert "compat checkpoint reloaded in plain transformers" in result["notes"]["converted"]
    assert result["readers"] and all(r in rows["random"]["per_linear"] for r in result["readers"])
    assert "| random |" in capsys.readouterr().out


def test_weight_figures_are_per_output_channel():
    from transformers.pytorch_utils import Conv1D

    lin = nn.Linear(4, 2, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[4.0, 0, 0, 0], [1.0, -1, 1, -1]]))  # rows: ratios 2 and 1
    assert qu.weight_figures(lin) == pytest.approx({"w_max_rms_mean": 1.5, "w_max_rms_worst": 1.5})
    conv = Conv1D(2, 4)  # weight [in=4, out=2]: the same matrix transposed reads the same
    with torch.no_grad():
        conv.weight.copy_(lin.weight.T)
    assert qu.weight_figures(conv)["w_max_rms_mean"] == pytest.approx(1.5)


def test_conv1d_to_linear_keeps_input_hooks():
    from transformers.pytorch_utils import Conv1D

    model = nn.Sequential(Conv1D(3, 4))
    model[0].register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    x = torch.randn(2, 4)
    ref = model(x)
    qu.conv1d_to_linear_(model)
    assert isinstance(model[0], nn.Linear)
    torch.testing.assert_close(model(x), ref)


def test_int8_dynamic_keeps_an_input_hook_that_reads_a_buffer():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(3)
    model = nn.Sequential(Conv1D(8, 6))
    model[0].register_buffer("scale", torch.full((6,), -2.0))
    model[0].register_forward_pre_hook(lambda mod, args: (args[0] * mod.scale,))
    x = torch.randn(5, 6)
    ref = model(x)
    out = qu.int8_dynamic(model)(x)
    assert torch.allclose(out, ref, atol=0.1) and not torch.allclose(out, -ref / 2, atol=0.1)


def test_main_end_to_end_on_a_tiny_random_whisper(capsys):
    """The speech kind: decoder next-token KL, both streams rotated (the encoder's output rotated into the
    cross-attention readers), a bias slot on the bias-less head, the light-tail rule reported."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = bench.main(["--model", "random-whisper", "--texts", "4", "--precisions", "W8A8", "W4A4",
                             "--rotations", "hadamard", "--real"])
    finally:
        torch.set_num_threads(threads)
    rows = result["rows"]
    assert result["kind"] == "speech" and set(rows) == {"original", "converted", "hadamard"}
    assert rows["converted"]["fp32"]["err"] < 1e-9 and rows["hadamard"]["fp32"]["err"] < 1e-9
    for name, row in rows.items():
        assert 0 < row["W8A8"]["err"] < row["W4A4"]["err"], name
    assert "bias slot(s) `proj_out`" in result["notes"]["converted"]
    assert result["notes"]["hadamard"].startswith("2 stream(s) rotated")
    assert result["tails"] and all("Gaussian reference" in t for t in result["tails"])
    out = capsys.readouterr().out
    assert "encoder / decoder Linear inputs" in out and "light-tail rule" in out


def test_gaussian_reference_and_wav_reading(tmp_path):
    import numpy as np
    from scipy.io import wavfile

    g = bench.gaussian_max_rms(512)
    assert 3.0 < g < 4.0 and bench.gaussian_max_rms(64) < g  # grows like sqrt(2 ln d)
    t = np.arange(8000) / 8000
    wavfile.write(tmp_path / "a.wav", 8000, (0.5 * 32767 * np.sin(2 * np.pi * 440 * t)).astype(np.int16))
    (tmp_path / "a.txt").write_text("  hello\n world ")
    a = bench.read_wav(tmp_path / "a.wav")
    assert a.dtype == np.float32 and len(a) == 16000 and abs(float(np.abs(a).max()) - 0.5) < 0.01
    assert bench.transcript_for(tmp_path / "a.wav") == "hello world"


def test_transcripts_json_beside_the_wavs(tmp_path):
    (tmp_path / "transcripts.json").write_text('{"b.wav": "one  two"}')
    assert bench.transcript_for(tmp_path / "b.wav") == "one two"
    assert bench.transcript_for(tmp_path / "c.wav") is None


def test_conv1d_to_linear_carries_an_online_ops_factors_so_it_exports_as_matmuls():
    """An online Hadamard reads its power-of-two factor from a plain ``_normswap_*`` attribute of its module,
    not a buffer; a Linear swapped in without it still computes the op (eager runs its own form) but exports
    it as a butterfly of adds that ``rotation.onnx_nodes.float_nodes`` cannot find (round 52: 1 op node found
    in a 6-layer GPT-2 instead of 25: the others exported as butterflies)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import normswap

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=256, n_layer=1, n_head=4, n_positions=16, bos_token_id=0,
                                       eos_token_id=0)).double().eval()
    bench._random_norms(model, 0)
    normswap.patch(model, beta_placement="keep")
    normswap.rotate(model, "none", online=True)
    hooked = {name: {k: v for k, v in vars(m).items() if k.startswith("_normswap_hadamard")}
              for name, m in model.named_modules() if type(m).__name__ == "Conv1D" and m._forward_pre_hooks}
    assert any(attrs for attrs in hooked.values())  # the width makes the op keep a pow2 factor
    ids = torch.randint(0, 64, (2, 9))
    ref = model(ids).logits
    qu.conv1d_to_linear_(model)
    for name, attrs in hooked.items():
        lin = model.get_submodule(name)
        assert isinstance(lin, nn.Linear)
        for key, value in attrs.items():
            assert getattr(lin, key, None) is value
    torch.testing.assert_close(model(ids).logits, ref)
