"""The causal-LM and encoder recipes end to end, and the data formats (all offline, tiny models)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import normswap
from normswap import NormswapError
from normswap.cli import main
from normswap.recipes import run, toy
from normswap.recipes.config import DataConfig
from normswap.recipes.data import read_documents

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
FAST = [
    "train.steps=8",
    "train.warmup_steps=0",
    "eval.every=4",
    "log.every=2",
    "log.progress_bar=false",
    "log.plot=false",
    "data.seq_len=32",
    "data.batch_size=8",
    "data.eval_batch_size=16",
    "data.eval_fraction=0.1",
]


def test_distill_causal_lm_recipe_runs_end_to_end_on_tiny_gpt2(tiny_gpt2, corpus, tmp_path):
    out = tmp_path / "gpt2"
    result = run(
        RECIPES / "distill-causal-lm.yaml",
        [
            f"model.source={tiny_gpt2}",
            f"data.path={corpus}",
            f"output.dir={out}",
            "loss.ce_weight=0.1",
            *FAST,
        ],
    )
    before, after = result.metrics_before, result.metrics_after
    assert set(before) == {"kl", "top1_agreement", "top5_agreement", "ppl", "teacher_ppl", "ppl_ratio"}
    # GPT-2 is Pre-LN: the conversion is exact, so the student starts on the teacher
    assert before["kl"] < 1e-8 and before["top1_agreement"] == 1.0 and before["top5_agreement"] == 1.0
    assert before["ppl_ratio"] == pytest.approx(1.0, rel=1e-5)
    assert before["ppl"] == pytest.approx(before["teacher_ppl"], rel=1e-5)
    assert math.isfinite(after["ppl"])
    # training can only add noise to an exact student: eval.keep_best keeps the converted start
    assert result.best_step == 0 and after == before
    assert result.steps == 8 and result.tokens == 8 * 8 * 32
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["split"] == "after" and records[-1]["step"] == 0
    last_eval = [r for r in records if r["split"] == "eval"][-1]
    assert last_eval["step"] == 8 and last_eval["kl"] > before["kl"]
    loaded = normswap.load(result.model_dir)
    assert any(isinstance(m, normswap.RMSNorm) for m in loaded.modules())
    ids = torch.randint(5, 40, (1, 10), generator=torch.Generator().manual_seed(0))
    model = result.model.cpu()  # on the run's device (cuda:0 on a GPU machine): compare on CPU
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )


def test_finetune_causal_lm_through_the_cli_without_teacher(tiny_gpt2, corpus, tmp_path):
    out = tmp_path / "ft"
    result = CliRunner().invoke(
        main,
        [
            "finetune",
            str(RECIPES / "finetune-causal-lm.yaml"),
            f"model.source={tiny_gpt2}",
            f"data.path={corpus}",
            f"output.dir={out}",
            "train.lr=1e-3",
            *FAST,
        ],
    )
    assert result.exit_code == 0, result.output
    assert "done: 8 steps" in result.output
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [0, 4, 8] and all(set(r) == {"step", "split", "ppl"} for r in evals)
    assert evals[-1]["ppl"] < evals[0]["ppl"] * 1.05
    assert (out / "model" / "config.json").is_file()


def test_encoder_recipe_pulls_embeddings_towards_the_teacher(tiny_bert, tmp_path):
    data = tmp_path / "sentences.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": i, "sentence": s}) + "\n"
            for i, s in enumerate(toy.grammar_corpus(400, seed=11, sentences_per_line=1))
        )
    )
    result = run(
        RECIPES / "distill-encoder.yaml",
        [
            f"model.source={tiny_bert}",
            f"data.path={data}",
            "data.field=sentence",
            f"output.dir={tmp_path / 'e'}",
            "train.steps=40",
            "train.trainable=all",
            "train.lr=2e-4",
            "train.warmup_steps=4",
            "eval.every=20",
            "log.progress_bar=false",
            "log.plot=false",
            "data.batch_size=16",
            "data.seq_len=24",
            "data.eval_fraction=0.1",
            "convert.mean_carry=false",  # twice the approximate norms: a start with room to improve
        ],
    )
    before, after = result.metrics_before, result.metrics_after
    assert set(before) == {"cosine", "hidden_rel_mse", "top1_neighbour_agreement", "recall_at_10",
                           "similarity_spearman"}
    assert before["cosine"] < 0.9999
    assert all(0.0 <= before[k] <= 1.0 for k in ("top1_neighbour_agreement", "recall_at_10"))
    assert after["similarity_spearman"] >= before["similarity_spearman"] - 1e-3, (before, after)
    assert after["hidden_rel_mse"] < before["hidden_rel_mse"] / 2, (before, after)
    assert 1 - after["cosine"] < (1 - before["cosine"]) / 2, (before, after)
    assert type(result.model).__name__.endswith("BertModel")


def test_data_formats_and_their_errors(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("first doc\n\n  second doc  \n")
    assert read_documents(DataConfig(path=str(text))) == ["first doc", "second doc"]
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text('{"body": "one"}\n{"body": "two"}\n')
    assert read_documents(DataConfig(path=str(jsonl), field="body", max_documents=1)) == ["one"]
    with pytest.raises(NormswapError, match="`data.field`"):
        read_documents(DataConfig(path=str(jsonl), field="text"))
    jsonl.write_text('{"body": "one"}\nnot json\n')
    with pytest.raises(NormswapError, match="line 2"):
        read_documents(DataConfig(path=str(jsonl), field="body"))


def test_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b", "c d"]})}).save_to_disk(
        str(tmp_path / "ds")
    )
    assert read_documents(DataConfig(path=str(tmp_path / "ds"))) == ["a b", "c d"]
    with pytest.raises(NormswapError, match="`data.split`"):
        read_documents(DataConfig(path=str(tmp_path / "ds"), split="validation"))


def test_too_little_data_names_the_key(tiny_bert, tmp_path, make_config):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("the cat sees a dog .\n")
    with pytest.raises(NormswapError, match="`data.seq_len`"):
        run(make_config(tiny_bert, tiny, tmp_path / "o"))


def test_existing_output_needs_resume_or_overwrite(tiny_bert, corpus, tmp_path, make_config):
    cfg = make_config(tiny_bert, corpus, tmp_path / "o", train={"steps": 2, "warmup_steps": 0}, eval={"every": 2})
    run(cfg)
    with pytest.raises(NormswapError, match="`output.dir`"):
        run(cfg)
    again = run(cfg, ["output.overwrite=true"])
    assert again.steps == 2
    import shutil

    shutil.rmtree(tmp_path / "o" / "checkpoints")  # a run that died before its first checkpoint
    with pytest.raises(NormswapError, match="`checkpoint.resume`"):
        run(cfg, ["checkpoint.resume=true"])


@pytest.mark.parametrize("mode", ["all", "exact"])
def test_student_from_a_converted_directory(tiny_bert, corpus, tmp_path, make_config, mode):
    """model.student = the output of normswap.convert; 'exact' students recover progressively."""
    import warnings

    student_dir = tmp_path / f"student-{mode}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.convert(str(tiny_bert), str(student_dir), mode=mode, calibration_data=str(corpus))
    sections = dict(train={"steps": 20, "lr": 5e-5, "warmup_steps": 2}, eval={"every": 10})
    if mode == "exact":
        sections["progressive"] = {"enabled": True, "group_size": 2, "interval": 5}
    cfg = make_config(tiny_bert, corpus, tmp_path / f"run-{mode}", **sections)
    cfg["model"]["student"] = str(student_dir)
    result = run(cfg)
    assert result.conversion["source"] == "directory"
    assert result.metrics_after["kl"] < result.metrics_before["kl"]
    loaded = normswap.load(result.model_dir)
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in loaded.modules())


def _source(n: int, batch_size: int, seed: int = 0):
    from normswap.recipes.data import BatchSource, TokenData

    data = TokenData(train=[[1, 2, 3 + i] for i in range(n)], eval=[[1, 2]], pad_id=0, tokens_per_example=3.0)
    return BatchSource(data, DataConfig(path="-", batch_size=batch_size, seed=seed), "encoder", tokenizer=None)


def test_neighbour_groups_put_each_clusters_members_in_one_batch_slot():
    """8 clusters of 4 tight points: every aligned block of 4 in an epoch is one cluster, every
    example appears once per epoch, and the order is a pure function of (seed, epoch)."""
    torch.manual_seed(0)
    centres = torch.nn.functional.normalize(torch.randn(8, 16), dim=-1)
    cluster = torch.arange(32) % 8  # interleaved, so index order says nothing about clusters
    emb = centres[cluster] + 1e-3 * torch.randn(32, 16)
    src = _source(32, batch_size=8)
    plain = src._permutation(0)
    src.group_by_neighbours(emb, 4)
    for epoch in (0, 1):
        order = src._permutation(epoch)
        assert sorted(order) == list(range(32))
        blocks = [order[i:i + 4] for i in range(0, 32, 4)]
        assert all(len({int(cluster[j]) for j in b}) == 1 for b in blocks), blocks
    assert src._permutation(0) != plain
    again = _source(32, batch_size=8)
    again.group_by_neighbours(emb, 4)
    assert again._permutation(1) == src._permutation(1)
    batch = src.train_batch(0)["input_ids"][:, 2] - 3  # the example index each row came from
    assert len({int(cluster[j]) for j in batch[:4]}) == 1 and len({int(cluster[j]) for j in batch[4:]}) == 1


def test_every_example_once_per_epoch_when_neighbour_lists_run_out():
    """Points on an arc: each one's candidate list is its 12 nearest along the arc, which late
    anchors find used up; those groups are completed from the remaining anchors."""
    angle = torch.linspace(0, 1.5, 60)
    emb = torch.stack([angle.cos(), angle.sin()], dim=-1)
    src = _source(60, batch_size=6)
    src.group_by_neighbours(emb, 3)
    for epoch in range(4):
        order = src._permutation(epoch)
        assert sorted(order) == list(range(60))
        close = sum(max(b) - min(b) <= 6 for b in (order[i:i + 3] for i in range(0, 60, 3)))
        assert close >= 12, order  # most groups are neighbours along the arc


@pytest.mark.parametrize(("override", "message"), [
    ("data.neighbour_groups=3", "must divide `data.batch_size`"),
    ("data.neighbour_groups=0", "data.neighbour_groups"),
])
def test_neighbour_groups_config_errors(tiny_bert, corpus, tmp_path, override, message):
    with pytest.raises(NormswapError, match=message):
        run(RECIPES / "distill-encoder.yaml", [f"model.source={tiny_bert}", f"data.path={corpus}",
                                                f"output.dir={tmp_path / 'o'}", "data.batch_size=8", override])


def test_neighbour_groups_need_an_encoder_with_a_teacher(tiny_gpt2, corpus, tmp_path):
    with pytest.raises(NormswapError, match="needs task: encoder"):
        run(RECIPES / "distill-causal-lm.yaml", [f"model.source={tiny_gpt2}", f"data.path={corpus}",
                                                  f"output.dir={tmp_path / 'o'}", "data.neighbour_groups=2"])


def test_patience_stops_a_run_that_only_drifts_and_keeps_the_start(tiny_bert, tmp_path):
    """A learning rate that can only make the student worse: with eval.patience=2 the run ends two
    evaluations after its best (the converted start), and the saved model is that start."""
    data = tmp_path / "sentences.txt"
    data.write_text("\n".join(toy.grammar_corpus(300, seed=3, sentences_per_line=1)) + "\n")
    result = run(RECIPES / "distill-encoder.yaml", [
        f"model.source={tiny_bert}", f"data.path={data}", f"output.dir={tmp_path / 'e'}",
        "train.steps=40", "train.lr=0.5", "train.warmup_steps=0", "eval.every=5", "eval.patience=2",
        "log.progress_bar=false", "log.plot=false", "data.batch_size=8", "data.seq_len=24",
        "data.eval_fraction=0.1"])
    assert result.converged and not result.stopped_early
    assert result.best_step == 0 and result.steps == 10, (result.best_step, result.steps)
    assert result.metrics_after == result.metrics_before
    records = [json.loads(line) for line in (tmp_path / "e" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["split"] == "early_stop" and r["best_step"] == 0 for r in records)
    manifest = json.loads((tmp_path / "e" / "model" / "config.json").read_text())["normswap"]
    assert manifest["finetune"]["stopped_by_patience"] is True


def test_patience_needs_keep_best(tiny_bert, corpus, tmp_path):
    with pytest.raises(NormswapError, match="eval.patience"):
        run(RECIPES / "distill-encoder.yaml", [f"model.source={tiny_bert}", f"data.path={corpus}",
                                                f"output.dir={tmp_path / 'o'}", "eval.keep_best=false"])
