"""``--new-head`` streams (round 59): a task head the checkpoint lacks is initialised from a fixed seed by the
model's own ``_init_weights``, the same on both paths, so ``--low-memory`` writes the in-memory path's tensors
bitwise, head included (folds into it too). Before, the streamed path refused ``--new-head``, and the in-memory
head took whatever transformers drew from the process's random state. And the exit codes of a refusal agree:
an option-fixable refusal is exit 2 on both paths (round 58's sweep: 1 in memory, 2 streamed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import normswap
from normswap import presets
from normswap.checkpoint import source
from normswap.cli import main
from tests.checkpoint.test_streaming_combos import assert_same_output
from tests.streaming_models import MODELS, written_tensors


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("newhead")
    out = {}
    for name in ("gpt2", "bert_cls"):
        cls, config = MODELS[name]()
        torch.manual_seed(0)
        presets.randomise_norms(cls(config)).eval().save_pretrained(root / name, max_shard_size="40KB")
        out[name] = root / name
    return out


@pytest.mark.parametrize("name, options", [
    # a classifier head (score, no bias) reading the final norm: β folds into a bias slot, γ into its weight
    ("gpt2", {"task": "sequence-classification", "fold_gamma": True}),
    # an MLM head on a sequence-classification checkpoint: a head with its own LayerNorm, and a tied alias
    # (decoder.bias is cls.predictions.bias), in compat with shards
    ("bert_cls", {"task": "masked-lm", "mode": "exact", "format": "compat", "max_shard_size": "16KB"}),
])
def test_streamed_new_head_is_the_in_memory_head(sources, tmp_path, name, options):
    mem, stream = tmp_path / "mem", tmp_path / "stream"
    normswap.convert(sources[name], mem, low_memory=False, allow_new_head=True, **options)
    report = normswap.convert(sources[name], stream, low_memory=True, allow_new_head=True, **options)
    assert report.streamed
    assert_same_output(mem, stream)
    new = json.loads((stream / "config.json").read_text())["normswap"]["new_head"]
    assert new and new == json.loads((mem / "config.json").read_text())["normswap"]["new_head"]
    if "max_shard_size" in options:  # the same files too
        assert (mem / "model.safetensors.index.json").read_bytes() == \
            (stream / "model.safetensors.index.json").read_bytes()


def test_the_new_head_does_not_depend_on_the_random_state(sources, tmp_path):
    """Two in-memory runs, the process's random state moved between them, write the same head; it is
    transformers' initialisation (normal weights with the config's std), from the fixed seed."""
    heads = []
    for i in range(2):
        torch.manual_seed(100 + i)
        out = tmp_path / f"m{i}"
        normswap.convert(sources["gpt2"], out, low_memory=False, task="sequence-classification",
                         allow_new_head=True, verify=False)
        heads.append(written_tensors(out)[":score.weight"])
    assert torch.equal(heads[0], heads[1])
    cls, config = MODELS["gpt2"]()
    with torch.device("meta"):
        meta = __import__("transformers").GPT2ForSequenceClassification(config)
    want = source.init_new_head(meta, ["score.weight"], torch.float32)["score.weight"]
    assert torch.equal(heads[0], want)  # the final norm is γ/β-kept (native default): the head is as drawn
    assert 0.5 * config.initializer_range < float(want.std()) < 1.5 * config.initializer_range


def _run(args: list[str]) -> tuple[int, list[str]]:
    res = CliRunner().invoke(main, args)
    return res.exit_code, [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]


def test_a_head_without_new_head_is_refused_alike_on_both_paths(sources, tmp_path):
    """Without --new-head: the same line and exit 2 (an option fixes it) on both paths, nothing written."""
    answers = []
    for flag in ("--in-memory", "--low-memory"):
        out = tmp_path / flag.strip("-")
        answers.append(_run(["convert", str(sources["gpt2"]), "--out", str(out), "-q", flag,
                             "--task", "sequence-classification"]))
        assert not out.exists()
    (code_m, err_m), (code_s, err_s) = answers
    assert code_m == code_s == 2 and len(err_m) == len(err_s) == 1, answers
    assert err_m == err_s and "--new-head" in err_m[0]


def test_a_plan_refusal_has_the_usage_exit_code_on_both_paths(sources, tmp_path):
    """Round 58's sweep: a rotation the compat format cannot hold (BERT's MLM head stream starts at a GELU) was
    exit 1 in memory, and --low-memory with --rotate exit 2: now both 2, each naming its option."""
    args = ["--format", "compat", "--rotate", "random", "--task", "masked-lm", "--new-head", "--mode", "exact"]
    code_m, err_m = _run(["convert", str(sources["bert_cls"]), "--out", str(tmp_path / "m"), "-q", "--in-memory",
                          *args])
    code_s, err_s = _run(["convert", str(sources["bert_cls"]), "--out", str(tmp_path / "s"), "-q", "--low-memory",
                          *args])
    assert code_m == code_s == 2, (err_m, err_s)
    assert "--format native" in err_m[0] and "--rotate" in err_s[0]
    assert not (tmp_path / "m").exists() and not (tmp_path / "s").exists()
