"""``beta_placement="keep"``: every norm keeps its β, so every reader keeps its bias and sees the original's input.

Exact like the other placements (float64 on random inputs, LayerNorm γ/β and biases randomised by the
presets); what it changes is what int8 engines quantize: a folded β moves out of the reader's input into
its bias, and CTranslate2 / ONNX Runtime then scale that input differently from the original's
(``docs/results/quantization.md``). The compat checkpoint is a stock LayerNorm model with β in the
LayerNorm's bias, loaded here by plain transformers.
"""

from __future__ import annotations

import copy

import pytest
import torch

import normswap
from normswap import plan_of, presets
from normswap.analysis.plan import BETA_KEEP_WHY

transformers = pytest.importorskip("transformers")

CASES = [("tiny-whisper", "exact"), ("tiny-gpt2", "exact"), ("tiny-bert", "exact")]  # bert: 2 Post-LN norms stay LN


def _probe(name: str, model: torch.nn.Module, seed: int = 7) -> dict[str, torch.Tensor]:
    """Fresh inputs (other than the analysis's): random tokens / features of another length."""
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    if name == "tiny-whisper":
        base = presets.example_inputs(name, batch=3)
        return {"input_features": torch.randn(base["input_features"].shape, generator=gen, dtype=torch.float64),
                "decoder_input_ids": torch.randint(0, cfg.vocab_size, (3, 6), generator=gen)}
    return {"input_ids": torch.randint(0, cfg.vocab_size, (3, 17), generator=gen),
            "attention_mask": torch.ones(3, 17, dtype=torch.long)}


def _out(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _reader_biases(model: torch.nn.Module, plan) -> dict[str, torch.Tensor]:  # noqa: ANN001
    names = {r for s in plan.sites if s.convert for r in s.linear_readers}
    return {n: model.get_submodule(n).bias for n in sorted(names) if model.get_submodule(n).bias is not None}


@pytest.mark.parametrize("name, mode", CASES)
def test_keep_is_exact_keeps_every_beta_and_leaves_every_reader_bias(name: str, mode: str, tmp_path):
    model, _ = presets.build(name, dtype=torch.float64)
    conv = copy.deepcopy(model)
    report = normswap.patch(conv, example_inputs=presets.example_inputs(name), mode=mode, beta_placement="keep")
    plan = report.plan
    assert plan.options["beta_placement"] == "keep"
    probe = _probe(name, model)
    ref = _out(model, probe)
    assert _rel(_out(conv, probe), ref) <= 1e-9

    # every converted norm holds the original β, bit for bit, and folds none of it
    converted = [s for s in plan.sites if s.convert]
    assert converted and not any(s.fold_beta for s in converted)
    assert not any(f.beta for f in plan.folds) and not plan.beta_moves and not plan.bias_slots
    assert sum(s.beta_detail.startswith(BETA_KEEP_WHY) for s in converted) >= 1
    for s in converted:
        norm = conv.get_submodule(s.name)
        assert isinstance(norm, normswap.RMSNorm) and norm.bias is not None, s.name
        assert torch.equal(norm.bias, model.get_submodule(s.name).bias), s.name
    # no reader's bias changed (a reader that is also a centered writer would show up here too)
    before, after = _reader_biases(model, plan), _reader_biases(conv, plan)
    assert before.keys() == after.keys() and before
    for n in before:
        assert torch.equal(before[n], after[n]), n

    # save/load: native round trip with every tensor bitwise (outputs to the last bits: the reloaded
    # model's attention may take another kernel), the placement recorded in the manifest
    normswap.save(conv, tmp_path / "native")
    back = normswap.load(tmp_path / "native", dtype=torch.float64)
    assert plan_of(back).options["beta_placement"] == "keep"
    saved, loaded = conv.state_dict(), back.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert _rel(_out(back, probe), _out(conv, probe)) <= 1e-12

    # compat: a stock LayerNorm model with β in every LayerNorm's bias, loaded by plain transformers
    normswap.save(conv, tmp_path / "compat", format="compat")
    stock = type(model).from_pretrained(tmp_path / "compat", dtype=torch.float64).eval()
    for s in converted:
        ln = stock.get_submodule(s.name)
        assert type(ln).__name__ == "LayerNorm", (s.name, type(ln))
        assert torch.equal(ln.bias, model.get_submodule(s.name).bias), s.name
    for n, b in _reader_biases(stock, plan).items():
        assert torch.equal(b, before[n]), n
    assert _rel(_out(stock, probe), ref) <= 1e-9


def test_other_placements_fold_what_keep_keeps():
    """The contrast that makes the test above mean something: the default and ``fold`` move β out of
    tiny-gpt2's norms into reader biases."""
    model, _ = presets.build("tiny-gpt2", dtype=torch.float64)
    inputs = presets.example_inputs("tiny-gpt2")
    folded = normswap.plan(model, inputs, beta_placement="fold")
    assert sum(f.beta for f in folded.folds) >= 4
    kept = normswap.plan(model, inputs, beta_placement="keep")
    assert "β kept in 4 RMSNorm(s) (beta_placement='keep')" in kept.summary()
    assert "stock LayerNorm bias(es) (beta_placement='keep')" in kept.summary("compat")


def test_keep_with_fold_gamma_folds_beta_as_rotation_needs():
    """γ folded (rotation-ready) leaves no γ for β to sit behind: β leaves the norm whatever the placement."""
    model, _ = presets.build("tiny-gpt2", dtype=torch.float64)
    plan = normswap.plan(model, presets.example_inputs("tiny-gpt2"), beta_placement="keep", fold_gamma=True)
    assert all(s.fold_beta for s in plan.sites) and not any(s.beta_detail.startswith(BETA_KEEP_WHY) for s in plan.sites)


def test_cli_beta_placement_keep_writes_a_stock_compat_model_with_every_beta(tmp_path):
    from click.testing import CliRunner

    from normswap.cli import main

    res = CliRunner().invoke(main, ["convert", "tiny-gpt2", "--out", str(tmp_path / "c"), "--format", "compat",
                                    "--beta-placement", "keep"], catch_exceptions=False)
    assert res.exit_code == 0, res.stderr
    plan_line = next(ln for ln in res.stdout.splitlines() if ln.startswith("plan:"))
    assert "β kept in 4 stock LayerNorm bias(es) (beta_placement='keep')" in plan_line, plan_line
    model, _ = presets.build("tiny-gpt2")
    stock = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "c").eval()
    for name, p in model.named_parameters():  # every LayerNorm β and every reader bias as the original's
        if name.endswith((".ln_1.bias", ".ln_2.bias", ".c_attn.bias", ".c_fc.bias")):
            assert torch.equal(stock.get_parameter(name), p), name
