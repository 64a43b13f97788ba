"""A Post-LN norm's β leaves its RMSNorm through the residual's writer (``ResidualFold``).

BERT-family blocks read a norm's output ``n = g⊙u + b`` twice: Linear readers (q/k/v, or the FFN's
first dense) and the residual add ``dense(h) + c + n`` that the next norm reads. ``b`` folds into the
readers' biases (``R b``) and into the residual writer's bias (``c + b``): the same values everywhere
after the norm, in float64 to rounding, for exact norms (β) and approximate ones (the fitted bias,
folded after calibration). Each test compares the folded conversion against the un-folded one
(``beta_placement="keep"``: the same calibration, the bias in the norm) on tiny BERT, RoBERTa and
ELECTRA replicas with every LayerNorm γ/β and every bias randomised, float64, eval mode.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import normswap
from normswap import plan_of
from normswap.analysis.plan import RESIDUAL_HINT, RESIDUAL_WHY

transformers = pytest.importorskip("transformers")

FAMILIES = ("bert", "roberta", "electra")


def _replica(family: str, seed: int = 0) -> torch.nn.Module:
    """A 2-layer encoder of ``family``, width 32, float64, LayerNorm γ/β and every bias randomised."""
    common = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                  max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cls, cfg = {"bert": (transformers.BertModel, transformers.BertConfig(**common)),
                "roberta": (transformers.RobertaModel, transformers.RobertaConfig(**common, pad_token_id=1)),
                "electra": (transformers.ElectraModel, transformers.ElectraConfig(**common, embedding_size=32)),
                }[family]
    torch.manual_seed(seed)
    model = cls(cfg, add_pooling_layer=False) if family != "electra" else cls(cfg)
    model = model.double().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.copy_(torch.rand(m.weight.shape, generator=gen, dtype=torch.float64) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen, dtype=torch.float64) * 0.5)
            elif isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.copy_(torch.randn(m.bias.shape, generator=gen, dtype=torch.float64) * 0.1)
    return model


def _inputs(seed: int = 5) -> dict[str, torch.Tensor]:
    """Random tokens, one padded row (the mask matters to attention, not to the fold)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (3, 13), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _patched(model: torch.nn.Module, **options) -> tuple[torch.nn.Module, normswap.Report]:
    conv = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # approximate norms warn
        report = normswap.patch(conv, mode="all", **options)
    return conv, report


def _out(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).last_hidden_state


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _biased_norms(model: torch.nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, normswap.RMSNorm) and m.bias is not None]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(family, original, un-folded conversion): the reference every fold is compared with."""
    model = _replica(request.param)
    kept, report = _patched(model, beta_placement="keep")
    assert not report.plan.residual_folds
    return request.param, model, kept


def test_fold_is_exact_against_the_unfolded_conversion(family):
    name, model, kept = family
    folded, report = _patched(model, beta_placement="fold")
    inputs = _inputs()
    assert _rel(_out(folded, inputs), _out(kept, inputs)) <= 1e-12, name
    plan = report.plan
    converted = [s for s in plan.sites if s.convert]
    # (the embeddings' norm centers its own input since round 63: its tables keep their rows)
    assert len(converted) == 5 and {s.verdict for s in converted[1:]} == {"exact", "approximate"}
    assert converted[0].verdict == "exact-with-per-norm-centering", converted[0]
    # every norm but the last (its output is last_hidden_state) lost its bias: exact and approximate alike
    assert _biased_norms(kept) == [s.name for s in converted]
    assert _biased_norms(folded) == [converted[-1].name]
    assert len(plan.residual_folds) == 4 and {rf.site for rf in plan.residual_folds} == {s.name for s in converted[:-1]}
    for rf in plan.residual_folds:
        sp = plan.site(rf.site)
        assert sp.fold_beta and not sp.rms_bias and RESIDUAL_WHY in sp.beta_detail
        assert rf.readers and len(rf.writers) == 1 and rf.writers[0].endswith("output.dense"), rf
    assert "β of 4 Post-LN norm(s) folded into their readers and residual writers" in plan.summary()
    # the moved bias is there, in the residual writer: c_folded − c_kept = the kept norm's bias
    for rf in plan.residual_folds:
        moved = folded.get_submodule(rf.writers[0]).bias - kept.get_submodule(rf.writers[0]).bias
        assert torch.allclose(moved, kept.get_submodule(rf.site).bias, rtol=0, atol=1e-13), rf.site
    # the approximate norms' own figure counts the bias the fold moved out (same error as un-folded)
    errors = {s.name: s.error for s in plan_of(kept).sites if s.verdict == "approximate"}
    for s in converted:
        if s.verdict == "approximate":
            assert s.error == pytest.approx(errors[s.name], rel=1e-6, abs=1e-12), s.name


def test_default_keeps_the_bias_and_names_the_option(family):
    """Opt-in: the default placement (``rounding``) keeps β in a norm whose output a residual reads (the
    low-memory path, which must write the same tensors, does not fold through residual writers), and its
    ``beta_detail`` says that ``beta_placement='fold'`` would fold it."""
    name, model, kept = family
    conv, report = _patched(model)
    inputs = _inputs()
    assert _rel(_out(conv, inputs), _out(kept, inputs)) <= 1e-12, name
    plan = report.plan
    assert not plan.residual_folds
    assert _biased_norms(conv) == [s.name for s in plan.sites if s.convert]
    exact = [s for s in plan.sites[:-1] if s.verdict == "exact"]
    assert exact and all(s.beta_detail.endswith(RESIDUAL_HINT) for s in exact), [s.beta_detail for s in exact]


def test_low_memory_convert_refuses_the_fold_it_cannot_write(tmp_path):
    """``convert --low-memory --beta-placement fold`` on a Post-LN checkpoint: one clear error, nothing
    written (the streamed rewrite does not fold through residual writers)."""
    model = _replica("bert")
    model.save_pretrained(tmp_path / "src")
    with pytest.raises(normswap.NormswapError, match="residual writers, which the low-memory path cannot do"):
        normswap.convert(tmp_path / "src", tmp_path / "out", low_memory=True, mode="exact", beta_placement="fold")
    assert not (tmp_path / "out").exists()


def test_native_checkpoint_rebuilds_the_norms_without_bias(family, tmp_path):
    name, model, _ = family
    folded, _ = _patched(model, beta_placement="fold")
    normswap.save(folded, tmp_path / "native")
    back = normswap.load(tmp_path / "native", dtype=torch.float64)
    assert _biased_norms(back) == _biased_norms(folded)
    assert "residual_folds" not in (tmp_path / "native" / "config.json").read_text()
    saved, loaded = folded.state_dict(), back.state_dict()  # (the reload builds a pooler the replica has not)
    assert saved.keys() <= loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    inputs = _inputs()
    assert _rel(_out(back, inputs), _out(folded, inputs)) <= 1e-12, name


def test_head_and_output_norms_keep_their_bias():
    """A head class under the default placement: the base model's last norm feeds the MLM head only (a Linear
    reader in the head, not a residual): it keeps β as before (the base model loaded alone must compute what
    the stock one does), and no residual fold reaches outside the base model."""
    model = _replica("bert")
    mlm = transformers.BertForMaskedLM(model.config).double().eval()
    mlm.bert.load_state_dict(model.state_dict(), strict=False)
    conv, report = _patched(mlm)
    assert all(rf.site.startswith("bert.") and all(p.startswith("bert.") for p in (*rf.readers, *rf.writers))
               for rf in report.plan.residual_folds)
    assert "bert.encoder.layer.1.output.LayerNorm" in _biased_norms(conv)
    with torch.no_grad():
        ref = mlm(**_inputs()).logits
        got = conv(**_inputs()).logits
    assert _rel(got, ref) < 0.05  # approximate norms; the exact comparison is the test above


def test_ort_graph_loses_one_add_per_folded_norm(family, tmp_path):
    """What the fold is for: ONNX Runtime's optimised graph of the folded model has one ``Add`` fewer per
    folded norm than the un-folded one, and as many fused RMS norms (float32 exports: ORT has no float64
    ``Erf``)."""
    pytest.importorskip("onnxruntime")
    from normswap.integrations.onnx import fused_norm_ops

    name, model, kept = family
    folded, report = _patched(model, beta_placement="fold")
    inputs = _inputs()
    counts = {}
    for label, m in (("kept", kept), ("folded", folded)):
        path = tmp_path / f"{label}.onnx"
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(_Body(copy.deepcopy(m).float()), (inputs["input_ids"], inputs["attention_mask"]),
                              str(path), input_names=["input_ids", "attention_mask"], dynamo=False, opset_version=18)
        ops = fused_norm_ops(path)  # the embeddings' norm centers its input (round 63): ORT's LayerNorm ops
        counts[label] = (sum(ops[k] for k in ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
                                              "LayerNormalization", "SkipLayerNormalization")), _ort_adds(path))
    assert counts["kept"][0] == counts["folded"][0] == 5, counts
    # the embeddings' norm runs as LayerNormalization, whose bias input takes a kept β without an Add: its fold
    # saves none; every other fold saves one
    centering = [rf for rf in report.plan.residual_folds if folded.get_submodule(rf.site).centers_input]
    assert [rf.site for rf in centering] == ["embeddings.LayerNorm"] and len(report.plan.residual_folds) == 4
    assert counts["kept"][1] - counts["folded"][1] == 3, counts


class _Body(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def _ort_adds(path) -> int:
    import tempfile
    from pathlib import Path

    import onnx
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory() as tmp:
        options.optimized_model_filepath = str(Path(tmp) / "opt.onnx")
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return sum(n.op_type == "Add" for n in onnx.load(options.optimized_model_filepath).graph.node)
