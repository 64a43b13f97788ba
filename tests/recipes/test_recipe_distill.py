"""Distillation recovers a Post-LN BERT after approximate conversion; resume is exact; outputs load."""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path

import pytest
import torch

import normswap
from normswap.recipes import run
from normswap.recipes.io import read_manifest


def _logits(model, ids):
    model.to("cpu")  # RunResult.model is on the run's device (cuda:0 on a GPU machine); compare on CPU
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_masked_lm_distillation_recovers_the_teacher(tiny_bert, corpus, tmp_path, make_config):
    out = tmp_path / "run"
    result = run(make_config(tiny_bert, corpus, out, log={"plot": True}))
    before, after = result.metrics_before, result.metrics_after
    # the teacher learned structure: its masked-token perplexity is well below the unigram one
    counts = collections.Counter(corpus.read_text().split())
    total = sum(counts.values())
    unigram_ppl = math.exp(-sum(c / total * math.log(c / total) for c in counts.values()))
    assert before["teacher_ppl"] < 0.95 * unigram_ppl, (before, unigram_ppl)
    # the approximate conversion (least-squares init) loses something real...
    assert before["top1_agreement"] < 0.985, before
    # ...and distillation recovers it: held-out KL to the teacher down >= 5x, agreement up
    assert after["kl"] * 5 <= before["kl"], (before, after)
    assert after["top1_agreement"] > before["top1_agreement"] + 0.01, (before, after)
    assert after["kl_masked"] < before["kl_masked"]
    assert result.steps == 150 and result.tokens == 150 * 16 * 32

    # logs: before, train and eval records, and the plot
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "eval"] == [0, 50, 100, 150]
    assert sum(r["split"] == "train" for r in records) == 15
    assert (out / "curves.png").stat().st_size > 10_000
    assert (out / "recipe.yaml").is_file()

    # the final directory loads with normswap.load and computes what the trained student computes
    loaded = normswap.load(result.model_dir)
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in loaded.modules())
    assert sum(isinstance(m, normswap.RMSNorm) for m in loaded.modules()) == 6
    ids = torch.randint(5, 40, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(loaded, ids), _logits(result.model, ids), rtol=1e-5, atol=1e-5)
    manifest = read_manifest(result.model_dir)
    ft = manifest["finetune"]
    assert ft["recipe"]["task"] == "masked-lm" and ft["recipe"]["train"]["steps"] == 150
    assert ft["metrics_before"]["kl"] == pytest.approx(before["kl"])
    assert ft["metrics_after"]["kl"] == pytest.approx(after["kl"])
    # the model card names the model it came from and says what the run did (not "# model", "a model")
    card = (Path(result.model_dir) / "README.md").read_text()
    assert card.splitlines()[card.splitlines().index("---", 1) + 2] == f"# {tiny_bert.name} (RMSNorm, distilled)"
    assert f"`{tiny_bert}` (BertForMaskedLM)" in card and "a model" not in card and "# model" not in card
    assert "## Distillation (normswap finetune)" in card and f"- after: kl={after['kl']:.4g}" in card
    assert manifest["source"] == str(tiny_bert)


def test_causal_lm_distillation_recovers_a_post_ln_decoder(tiny_opt_post_ln, corpus, tmp_path, make_config):
    """The causal-LM recipe on OPT-350m's Post-LN layout: the conversion keeps approximate norms, loses
    next-token agreement, and distillation wins it back (measured at 300 steps: KL 6.0e-4 -> 5.1e-5,
    top-1 94.5% -> 98.3%; 150 steps here)."""
    result = run(make_config(tiny_opt_post_ln, corpus, tmp_path / "run", task="causal-lm"))
    before, after = result.metrics_before, result.metrics_after
    assert before["top1_agreement"] < 0.985, before
    assert after["kl"] * 3 <= before["kl"], (before, after)
    assert after["top1_agreement"] > before["top1_agreement"] + 0.01, (before, after)
    assert abs(math.log(after["ppl_ratio"])) < abs(math.log(before["ppl_ratio"])), (before, after)
    assert {"top5_agreement", "ppl", "teacher_ppl"} <= set(after)
    loaded = normswap.load(result.model_dir)
    assert sum(isinstance(m, normswap.RMSNorm) for m in loaded.modules()) == 4
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in loaded.modules())
    ids = torch.randint(5, 40, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(loaded, ids), _logits(result.model, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("progressive", [False, True], ids=["plain", "progressive"])
def test_resume_continues_exactly(tiny_bert, corpus, tmp_path, make_config, progressive):
    sections = dict(
        train={"steps": 12, "lr": 3e-4, "warmup_steps": 2, "gradient_accumulation_steps": 2},
        eval={"every": 6},
        log={"every": 3, "progress_bar": False, "plot": False},
        checkpoint={"every": 4, "keep_last": 2},
    )
    if progressive:
        sections.update(
            convert={"mode": "exact"},
            progressive={"enabled": True, "group_size": 2, "interval": 4, "start_step": 2},
        )
    straight = run(make_config(tiny_bert, corpus, tmp_path / "a", **sections))

    cfg = make_config(tiny_bert, corpus, tmp_path / "b", **sections)
    first = run(cfg, ["checkpoint.stop_after=7"])
    assert first.stopped_early and first.steps == 7 and first.model_dir is None
    kept = sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir())
    assert kept == ["step-000004", "step-000007"]  # keep_last=2 pruned nothing newer
    resumed = run(cfg, ["checkpoint.resume=true"])
    assert resumed.resumed_from.endswith("step-000007") and resumed.steps == 12

    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert resumed.metrics_after == pytest.approx(straight.metrics_after, rel=1e-6)
    assert resumed.metrics_before == pytest.approx(straight.metrics_before, rel=1e-12)
    assert resumed.tokens == straight.tokens
    # the log is continuous: records after the checkpoint were not duplicated
    steps = [
        (r["split"], r["step"])
        for r in map(json.loads, (tmp_path / "b" / "metrics.jsonl").read_text().splitlines())
    ]
    assert len(steps) == len(set(steps))


def test_progressive_swaps_every_norm_and_saves_a_fully_converted_model(
    tiny_bert, corpus, tmp_path, make_config
):
    cfg = make_config(
        tiny_bert,
        corpus,
        tmp_path / "p",
        convert={"mode": "exact"},
        progressive={"enabled": True, "order": ["*.layer.0.attention.output.LayerNorm"], "interval": 20},
        train={"steps": 60, "lr": 5e-5, "warmup_steps": 5},
        eval={"every": 20},
    )
    result = run(cfg)
    records = [json.loads(line) for line in (tmp_path / "p" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r for r in records if r["split"] == "eval"}
    # exact mode leaves only the two attention-output norms as LayerNorm (the FFN-output ones are exact by
    # mean carry). Step 0: the first stage (layer 0's) is swapped; "before" is all swapped at once
    assert evals[0]["kl"] < result.metrics_before["kl"]
    assert result.metrics_after["kl"] < result.metrics_before["kl"]
    loaded = normswap.load(result.model_dir)
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in loaded.modules())
    plan = read_manifest(result.model_dir)
    stages = plan["finetune"]["progressive_stages"]
    assert stages == [["bert.encoder.layer.0.attention.output.LayerNorm"],
                      ["bert.encoder.layer.1.attention.output.LayerNorm"]]


def test_norms_and_biases_trains_only_those(tiny_bert, corpus, tmp_path, make_config):
    import warnings

    from transformers import BertForMaskedLM

    cfg = make_config(
        tiny_bert,
        corpus,
        tmp_path / "nb",
        train={"steps": 5, "warmup_steps": 1, "trainable": "norms_and_biases"},
        eval={"every": 5},
    )
    result = run(cfg)
    converted = BertForMaskedLM.from_pretrained(str(tiny_bert))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(converted, mode="all")  # matrices as the conversion left them (centered writers)
    reference = converted.state_dict()
    trained = result.model.cpu().state_dict()  # the run's device may be a GPU
    matrices = [n for n, v in reference.items() if v.dim() == 2]
    assert matrices and all(torch.equal(trained[n], reference[n]) for n in matrices)
    changed = [n for n, v in trained.items() if n.endswith("bias") and not torch.equal(v, reference[n])]
    assert len(changed) > 10


def test_lora_merges_into_a_plain_converted_model(tiny_bert, corpus, tmp_path, make_config):
    pytest.importorskip("peft")
    cfg = make_config(
        tiny_bert,
        corpus,
        tmp_path / "lora",
        train={
            "steps": 20,
            "lr": 1e-3,
            "trainable": "lora",
            "lora": {"r": 4, "target_modules": ["query", "value"]},
        },
        eval={"every": 20},
    )
    result = run(cfg)
    assert result.metrics_after["kl"] < result.metrics_before["kl"]
    assert not any("lora" in n for n in result.model.state_dict())
    loaded = normswap.load(result.model_dir)
    ids = torch.randint(5, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(loaded, ids), _logits(result.model, ids), rtol=1e-5, atol=1e-5)
