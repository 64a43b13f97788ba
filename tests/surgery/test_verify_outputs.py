"""Verification reads every output a model returns (issue 38): a custom model's ``@dataclass`` output is
compared field by field as a dict's would be (it was not read at all: the returned stream changed unseen,
and the report compared nothing), a model with no floating-point output says that only its norms
were checked, and a complex output (an FFT of the stream) is compared as its real and imaginary parts
(it was left out, as an integer output is). Small Pre-LN models in float64, LayerNorm γ/β randomised."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

import normswap
from normswap import pipeline
from normswap.surgery.verify import compare


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor  # the residual stream before the block, returned: a reader the analysis must see
    ids: torch.Tensor
    note: str = "not a tensor"


class Block(nn.Module):
    def __init__(self, returns: str, d: int = 16) -> None:
        super().__init__()
        self.returns = returns
        self.emb, self.fc, self.head = nn.Linear(8, d), nn.Linear(d, d), nn.Linear(d, 5)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for ln in (self.ln1, self.ln2):
                ln.weight.copy_(torch.rand(d, generator=gen) + 0.5)
                ln.bias.copy_(torch.randn(d, generator=gen) * 0.3)

    def forward(self, x: torch.Tensor):  # noqa: ANN201 - one of three output structures
        h = self.emb(x)
        logits = self.head(self.ln2(h + self.fc(self.ln1(h))))
        if self.returns == "dataclass":
            return Out(logits, h, logits.argmax(-1))
        if self.returns == "spectrum":  # only a complex output: verification must read it
            return torch.fft.rfft(logits, dim=-1)
        if self.returns == "nested":
            return {"out": [logits, (h, {"ids": logits.argmax(-1), "note": "x", "none": None})], "n": 3}
        return logits.argmax(-1)


def _model(returns: str) -> nn.Module:
    torch.manual_seed(0)
    return Block(returns).double().eval()


def test_a_dataclass_output_is_compared_field_by_field_like_a_nested_dict():
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    model = _model("dataclass")
    original = pipeline.working_copy(model, torch.float64)
    report = normswap.patch(model, (x,))
    assert report.verification["compared"] == ["logits", "hidden"]
    # the same verdicts as the same model returning its tensors in nested dicts and tuples
    nested = normswap.patch(_model("nested"), (x,))
    assert [(s.name, s.verdict) for s in report.sites] == [(s.name, s.verdict) for s in nested.sites]
    with torch.no_grad():
        ref, out = original(x), model(x)
    figs = compare(ref, out, set(report.plan.changed_outputs))
    assert figs["compared"] == ["logits", "hidden"]
    # what the report says is what the model does: the returned stream is not changed unseen
    assert figs["worst_rel_error_any_output"] <= report.verification["worst_rel_error_any_output"] * 10 + 1e-12


def test_a_model_with_no_floating_output_says_only_its_norms_were_checked():
    report = normswap.patch(_model("ids"), (torch.randn(2, 6, 8, dtype=torch.float64),))
    assert report.changed
    assert pipeline.NOTHING_COMPARED in report.verification["verify_precision"]
    assert "unseen_probe_max_rel_error" not in report.verification  # not a 0 that reads as a comparison
    assert "max_stream_mean_ratio" in report.verification


def test_a_complex_output_is_compared_as_its_real_and_imaginary_parts():
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    model = _model("spectrum")
    original = pipeline.working_copy(model, torch.float64)
    report = normswap.patch(model, (x,))
    assert report.verification["compared"] == ["output"]
    assert pipeline.NOTHING_COMPARED not in report.verification["verify_precision"]
    assert report.verification["max_rel_error"] < 1e-9  # an exact conversion, read on the complex output
    with torch.no_grad():
        ref = original(x)
        wrong = torch.complex(ref.real, ref.imag * 1.01)  # only the imaginary part off: still seen
    figs = compare(ref, wrong)
    assert figs["compared"] == ["output"]
    assert 1e-3 < figs["max_rel_error"] < 2e-2
