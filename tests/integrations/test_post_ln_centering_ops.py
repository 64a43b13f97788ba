"""Post-LN encoders converted with centering ops instead of the mean carry (``per_norm_centering=True,
mean_carry=False``; CLI ``--per-norm-centering --no-mean-carry``): the choice docs/deployment.md names for
int8 in ONNX Runtime and NNCF, where the carry's two neurons meet the quantizer's grids.

What the advice rests on, on small BERT and MPNet replicas (LayerNorm γ/β randomised, eval mode): every
Post-LN norm is exact in float64 (no MLP widened), through a native checkpoint too; and ONNX Runtime's
session optimiser fuses each centering op and the RMSNorm after it into one ``LayerNormalization``, the
kernel the original runs (measured on all-MiniLM-L6-v2: docs/results/quantization.md).
"""

from __future__ import annotations

import copy
import json
import logging
import warnings

import pytest
import torch

import normswap
from normswap.inputs import hf_example_inputs
from normswap.pipeline import default_dtype
from normswap.surgery.verify import compare
from tests.zoo import APPROXIMATE, build

OPS_NO_CARRY = normswap.ConvertOptions(mode="exact", per_norm_centering=True, mean_carry=False)


def _fp64_error(original, model, seed=5):
    probe = hf_example_inputs(model, seed=seed)
    with torch.no_grad(), default_dtype(torch.float64):
        return compare(original(**probe), model(**probe))["worst_rel_error_any_output"]


@pytest.mark.parametrize("name", ["bert", "mpnet"])
def test_every_post_ln_norm_is_exact_by_an_op_and_no_mlp_is_widened(name, tmp_path):
    model = build(APPROXIMATE, name)
    original = copy.deepcopy(model)
    widths = {n: m.weight.shape for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    report = normswap.patch(model, options=OPS_NO_CARRY)
    plan = report.plan
    assert not plan.mean_carries
    post_ln = [s for s in plan.sites if "encoder" in s.name]
    assert len(post_ln) == 4, plan.table()  # two layers, two Post-LN norms each
    assert all(s.verdict == "exact-with-per-norm-centering" and s.convert for s in post_ln), plan.table()
    assert widths == {n: m.weight.shape for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert _fp64_error(original, model) <= 1e-9
    normswap.save(model, tmp_path / "n")
    loaded = normswap.load(tmp_path / "n", dtype=torch.float64).eval()
    assert normswap.plan_of(loaded).options["mean_carry"] is False
    assert normswap.plan_of(loaded).options["per_norm_centering"] is True
    assert _fp64_error(original, loaded) <= 1e-9


@pytest.mark.parametrize("name", ["bert", "mpnet"])
def test_writers_behind_the_ops_keep_the_originals_weights(name):
    """A centering op before a norm centers its stream whatever the writers add, so the attention and FFN
    output projections stay as the original's, bit for bit: a weight quantizer then rounds exactly what
    it rounds in the original (centered, their column means moved every row's range: NNCF int8 weights on
    all-mpnet-base-v2). With the carry kept, its ``down`` projection must stay centered; the attention
    output projection, behind its op, still keeps its weights."""
    model = build(APPROXIMATE, name)
    original = dict(copy.deepcopy(model).named_parameters())
    normswap.patch(model, options=OPS_NO_CARRY)
    encoder = {n: p for n, p in model.named_parameters() if ".encoder." in n and "LayerNorm" not in n}
    assert len(encoder) >= 16
    changed = [n for n, p in encoder.items() if not torch.equal(p, original[n])]
    assert not changed, changed

    model = build(APPROXIMATE, name)
    report = normswap.patch(model, options=normswap.ConvertOptions(mode="exact", per_norm_centering=True))
    carries = report.plan.mean_carries
    assert len(carries) == 2
    after = dict(model.named_parameters())
    widened = tuple(f"{m}." for c in carries for m in (c.up, c.down))
    kept = [n for n in encoder if not n.startswith(widened)]
    assert len(kept) >= 12 and all(torch.equal(after[n], original[n]) for n in kept)
    downs = [f"{c.down}.weight" for c in carries]  # centered: the carry needs a zero-mean down
    assert all(not torch.equal(after[n][:, :original[n].shape[1]], original[n]) for n in downs)


def test_the_cli_writes_the_choice_into_the_manifest(tmp_path):
    from click.testing import CliRunner

    from normswap.cli import main

    res = CliRunner().invoke(main, ["convert", "tiny-bert", "--out", str(tmp_path / "b"), "-q",
                                    "--per-norm-centering", "--no-mean-carry"])
    assert res.exit_code == 0, res.stderr
    manifest = json.loads((tmp_path / "b" / "config.json").read_text())["normswap"]
    assert manifest["plan"]["mean_carries"] == []
    assert manifest["plan"]["options"]["mean_carry"] is False
    assert manifest["plan"]["options"]["per_norm_centering"] is True
    assert manifest["counts"]["approximate"] == 0


@pytest.mark.parametrize("name", ["bert", "mpnet"])
def test_ort_fuses_each_centering_op_and_rms_norm_into_layer_normalization(name, tmp_path):
    pytest.importorskip("onnxruntime")
    from normswap.integrations.onnx import fused_norm_ops

    model = build(APPROXIMATE, name)
    base = model.base_model
    normswap.patch(model, options=OPS_NO_CARRY, calibration=False)
    base = base.float().eval()
    probe = hf_example_inputs(model, seed=1)
    names = [k for k in ("input_ids", "attention_mask") if k in probe]

    class Body(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = base

        def forward(self, *tensors):
            return self.base(**dict(zip(names, tensors, strict=True))).last_hidden_state

    path = tmp_path / f"{name}.onnx"
    with torch.no_grad(), warnings.catch_warnings():  # the export the quantization benchmarks use
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)
        try:
            torch.onnx.export(Body(), tuple(probe[k] for k in names), str(path), dynamo=False, opset_version=17,
                              input_names=names)
        finally:
            logging.disable(logging.NOTSET)
    ops = fused_norm_ops(path)
    # four Post-LN norms and the embeddings' norm (its tables keep their rows since round 62), each a centering op
    # and an RMSNorm: ORT's LayerNorm fusion sees a LayerNorm
    assert ops["LayerNormalization"] + ops["SkipLayerNormalization"] == 5, ops
    assert ops["Pow"] == 0, ops
