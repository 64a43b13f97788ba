"""Recipe settings checked against the model, tokenizer, data and machine before any work starts.

Each refusal is one line naming the config key, its value and the limit, exits 2 from the command
line and leaves nothing on disk; a recipe default that does not fit the model adapts to it instead.
Most checks read only ``config.json`` files and the tokenizer, so these tests build configs and call
the checks directly; a few run the recipe end to end where the failure used to come late.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

import normswap
from normswap import NormswapError, presets
from normswap.cli import main
from normswap.recipes import models, preflight, run
from normswap.recipes.config import LoraConfig, load_config
from normswap.recipes.data import BatchSource, read_documents, tokenize

CPU = torch.device("cpu")
FAST = ["train.steps=1", "data.max_documents=200", "data.batch_size=4", "data.eval_batch_size=8",
        "log.progress_bar=false", "log.plot=false"]


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    """Three thousand short lines: the issue's corpus of "a few thousand lines"."""
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    words = "the quick brown fox jumps over a lazy dog while cats sleep in warm sun by the river".split()
    gen = torch.Generator().manual_seed(0)
    lines = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (int(n),), generator=gen))
             for n in torch.randint(5, 30, (3000,), generator=gen)]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """tiny-gpt2, tiny-bert and tiny-phi written as Hugging Face directories."""
    root = tmp_path_factory.mktemp("presets")
    for name in ("tiny-gpt2", "tiny-bert", "tiny-phi"):
        presets.save(name, root / name)
    return root


def _config(source, text: Path, *overrides: str, recipe: str | dict = "distill-causal-lm"):
    return load_config(recipe, [f"model.source={source}", f"data.path={text}", *overrides])


def _check(cfg) -> list[str]:
    said: list[str] = []
    preflight.check_settings(cfg, models.load_tokenizer(cfg.model), CPU, said.append)
    return said


def _model_dir(root: Path, like: Path, **changes) -> Path:
    """A directory holding only ``like``'s config.json with ``changes``: what the checks read."""
    root.mkdir()
    config = {**json.loads((like / "config.json").read_text()), **changes}
    (root / "config.json").write_text(json.dumps(config))
    return root


# ---------------------------------------------------------------------------------- the issue
def test_issue_32_too_long_seq_len_is_refused_in_one_line_exit_2_nothing_written(text, tmp_path):
    out = tmp_path / "r"
    result = CliRunner().invoke(main, ["finetune", "distill-causal-lm", "model.source=tiny-gpt2",
                                       f"data.path={text}", "train.steps=2", "data.batch_size=2",
                                       f"output.dir={out}", "data.seq_len=200"])
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: config key `data.seq_len`: 200 ") and "128 positions" in line
    assert not out.exists()


def test_issue_32_recipe_default_seq_len_adapts_to_the_model_and_says_so(text):
    cfg = _config("tiny-gpt2", text, "train.steps=2")
    assert cfg.data.seq_len == 256 and cfg.is_default("data.seq_len")
    said = _check(cfg)
    assert cfg.data.seq_len == 128
    assert any(s.startswith("data.seq_len: the recipe's 256 is longer than the 128 positions") for s in said)


def test_issue_32_command_runs_on_the_recipe_default_seq_len(text, tmp_path):
    """The issue's command, end to end: it used to end in "IndexError: index out of range in self"."""
    result = run("distill-causal-lm", ["model.source=tiny-gpt2", f"data.path={text}", f"output.dir={tmp_path}/r",
                                       *FAST])
    assert result.steps == 1 and result.model_dir is not None
    assert yaml.safe_load((tmp_path / "r" / "recipe.yaml").read_text())["data"]["seq_len"] == 128


def test_which_keys_the_user_set(text, tmp_path):
    builtin = _config("tiny-gpt2", text, "data.seq_len=64")
    assert builtin.is_default("train.lr") and not builtin.is_default("data.seq_len")
    assert not builtin.is_default("model.source")
    again = load_config(builtin)  # what the CLI hands to run(): the choices travel with the config
    assert again.user_set == builtin.user_set
    own = tmp_path / "mine.yaml"
    own.write_text(f"model: {{source: tiny-gpt2}}\ndata: {{path: {text}, seq_len: 256}}\n")
    assert not load_config(own).is_default("data.seq_len")  # a recipe file of the user's own: chosen
    assert load_config(own).is_default("train.lr")  # ... except what it leaves out
    as_dict = load_config({"model": {"source": "tiny-gpt2"}, "data": {"path": str(text), "seq_len": 256}})
    assert not as_dict.is_default("data.seq_len") and as_dict.is_default("data.batch_size")
    with pytest.raises(preflight.RecipeMismatch, match="`data.seq_len`: 256 "):
        _check(as_dict)


def test_position_limits_hard_soft_and_the_padding_offset(saved, text, tmp_path):
    phi = _config(saved / "tiny-phi", text, "data.seq_len=200")
    said = _check(phi)  # rotary positions extrapolate: a chosen length past the context is a note, not an error
    assert phi.data.seq_len == 200 and any("128-token context" in s for s in said)
    default = _config(saved / "tiny-phi", text)
    _check(default)
    assert default.data.seq_len == 128
    from transformers import RobertaConfig

    roberta = tmp_path / "roberta"
    RobertaConfig(vocab_size=320, max_position_embeddings=34, pad_token_id=1).save_pretrained(roberta)
    facts = preflight.read_facts("model.source", str(roberta))
    (limit,) = preflight.position_limits([facts], tokenizer=None)
    assert limit.tokens == 32 and limit.hard  # position ids start at pad_token_id + 1


# ---------------------------------------------------------------------------------- model and tokenizer
@pytest.mark.parametrize(
    ("source", "overrides", "message"),
    [
        ("tiny-gpt2", ["task=masked-lm"], "`task`: masked-lm loads the model as AutoModelForMaskedLM, which has no "
                                          "class for gpt2 models"),
        ("tiny-bert", ["task=causal-lm"], "`task`: model.source 'tiny-bert' was saved as BertForMaskedLM, without "
                                          "the causal-lm head"),
        ("tiny-bert", ["task=masked-lm", "model.tokenizer=tiny-gpt2"], "`task`: masked-lm replaces tokens by a "
                                                                       "mask token and the tokenizer of "
                                                                       "model.tokenizer 'tiny-gpt2' has none"),
        ("tiny-gpt2", ["task=encoder", "loss.pooling=cls"], "`loss.pooling`: 'cls' pools a [CLS] token"),
        ("tiny-gpt2", ["train.trainable=lora", "train.lora.target_modules=[q_proj]"],
         "`train.lora.target_modules`: 'q_proj' names no module of model.source 'tiny-gpt2'; name some of its "
         "Linear layers, e.g. train.lora.target_modules=[c_attn,c_fc,c_proj,lm_head]"),
        ("tiny-gpt2", ["model.dtype=float16", "train.mixed_precision=fp16"], None),
        ("tiny-gpt2", ["train.steps=10", "train.warmup_steps=20"], "`train.warmup_steps`: 20 is more than "
                                                                   "train.steps=10"),
    ],
)
def test_settings_the_model_cannot_run_are_refused_naming_the_key(source, overrides, message, text, monkeypatch):
    if message is None:  # fp16 mixed precision: a GPU's check (validate refuses fp16 on a CPU-only machine)
        monkeypatch.setattr("normswap.recipes.config._cuda_available", lambda: True)
        message = "`model.dtype`: float16 weights get float16 gradients"
    cfg = _config(source, text, *overrides)
    with pytest.raises(preflight.RecipeMismatch) as info:
        _check(cfg)
    assert message in str(info.value) and "\n" not in str(info.value)
    assert info.value.exit_code == 2


def test_recipe_default_warmup_adapts_to_a_short_run(text):
    cfg = _config("tiny-gpt2", text, "train.steps=40")
    said = _check(cfg)
    assert cfg.train.warmup_steps == 2 and any("train.warmup_steps: the recipe's 50" in s for s in said)


def test_tokenizer_must_fit_the_models_vocabulary(saved, text, tmp_path):
    from transformers import AutoTokenizer

    big = AutoTokenizer.from_pretrained(saved / "tiny-gpt2")
    big.add_tokens([f"extra{i}" for i in range(8)])
    big.save_pretrained(tmp_path / "big")
    cfg = _config(saved / "tiny-gpt2", text, f"model.tokenizer={tmp_path / 'big'}")
    with pytest.raises(preflight.RecipeMismatch, match=r"`model.tokenizer`: the tokenizer of .* has 328 tokens, "
                                                       r"more than the 320 rows of the embedding of model.source"):
        _check(cfg)


def test_student_must_be_the_teachers_model(saved, text, tmp_path):
    gpt2 = saved / "tiny-gpt2"
    other_type = _model_dir(tmp_path / "opt", gpt2, model_type="opt", architectures=["OPTForCausalLM"])
    cfg = _config(gpt2, text, f"model.student={other_type}")
    with pytest.raises(preflight.RecipeMismatch, match="`model.student`: .* is a model of type opt and "
                                                       "model.source .* one of type gpt2"):
        _check(cfg)
    other_vocab = _model_dir(tmp_path / "vocab", gpt2, vocab_size=512)
    with pytest.raises(preflight.RecipeMismatch, match="`model.student`: .* has a vocabulary of 512 and the "
                                                       "teacher .* one of 320"):
        _check(_config(gpt2, text, f"model.student={other_vocab}"))
    # the same vocabulary size, but the student directory's own tokenizer numbers the tokens differently
    other_tokens = _model_dir(tmp_path / "tokens", gpt2)
    for f in (saved / "tiny-bert").glob("tokenizer*"):
        shutil.copy(f, other_tokens / f.name)
    with pytest.raises(preflight.RecipeMismatch, match="`model.source`: the tokenizer of .* gives token .* another "
                                                       "id than the tokenizer model.student"):
        _check(_config(gpt2, text, f"model.student={other_tokens}"))


def test_lora_needs_peft_and_a_default_for_the_model_type(saved, text, tmp_path, monkeypatch):
    biogpt = tmp_path / "biogpt"  # a causal LM PEFT has no default target modules for
    from transformers import BioGptConfig

    BioGptConfig(vocab_size=320, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=64, max_position_embeddings=128).save_pretrained(biogpt)
    cfg = _config(biogpt, text, f"model.tokenizer={saved / 'tiny-gpt2'}", "train.trainable=lora")
    with pytest.raises(preflight.RecipeMismatch, match="`train.lora.target_modules`: PEFT has no default target "
                                                       r"modules for biogpt models; .* e.g. "):
        _check(cfg)
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(preflight.RecipeMismatch, match="`train.trainable`: 'lora' needs the `peft` package"):
        _check(_config("tiny-gpt2", text, "train.trainable=lora"))


def test_bf16_on_a_gpu_without_it(text, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    for overrides, key in ((["train.mixed_precision=bf16"], "train.mixed_precision"),
                           (["model.dtype=bfloat16"], "model.dtype")):
        cfg = _config("tiny-gpt2", text, "data.seq_len=64", *overrides)
        with pytest.raises(preflight.RecipeMismatch, match=f"`{key}`: .* needs bfloat16, which Tesla V100 does not"):
            preflight.check_settings(cfg, models.load_tokenizer(cfg.model), torch.device("cuda", 0), print)
    cfg = _config("tiny-gpt2", text, "data.seq_len=64", "train.mixed_precision=bf16")
    preflight.check_settings(cfg, models.load_tokenizer(cfg.model), CPU, print)  # bf16 autocast runs on a CPU


# ---------------------------------------------------------------------------------- data
def _batches(cfg, world: int = 1) -> BatchSource:
    tok = models.load_tokenizer(cfg.model)
    data = tokenize(read_documents(cfg.data), tok, cfg.data, cfg.task)
    return BatchSource(data, cfg.data, cfg.task, tok, 0, world)


def test_data_decides_accumulation_calibration_and_the_held_out_metric(text):
    small = ["data.seq_len=32", "data.max_documents=15", "data.batch_size=4"]
    cfg = _config("tiny-gpt2", text, *small, "train.gradient_accumulation_steps=50")
    source = _batches(cfg)
    train = len(source.data.train)
    with pytest.raises(preflight.RecipeMismatch, match=f"`train.gradient_accumulation_steps`: 50 micro-batches of 4 "
                                                       f"make 200 examples per optimizer step, more than the training "
                                                       f"split's {train}; use train.gradient_accumulation_steps="
                                                       f"{train // 4} or less"):
        preflight.check_data(cfg, source, True, print)
    batches = source.batches_per_epoch
    assert batches < 8
    chosen = _config("tiny-gpt2", text, *small, "convert.calibration_batches=8")
    with pytest.raises(preflight.RecipeMismatch, match=f"`convert.calibration_batches`: 8 is more than the "
                                                       f"{batches} batch"):
        preflight.check_data(chosen, _batches(chosen), True, print)
    preflight.check_data(chosen, _batches(chosen), False, print)  # a converted student: nothing is calibrated
    default, said = _config("tiny-gpt2", text, *small), []
    preflight.check_data(default, _batches(default), True, said.append)
    assert default.convert.calibration_batches == batches and "the recipe's 8" in said[0]
    encoder = _config("tiny-bert", text, "data.max_documents=40", "data.eval_fraction=0.01",
                      "eval.metric=recall_at_10", recipe="distill-encoder")
    with pytest.raises(preflight.RecipeMismatch, match="`eval.metric`: recall_at_10 needs 3 held-out examples on a "
                                                       "process and the held-out split has 1"):
        preflight.check_data(encoder, _batches(encoder), True, print)


def test_similarity_loss_needs_three_sentences_a_batch(text):
    with pytest.raises(NormswapError, match="`data.batch_size`: 2 sentences per batch leave the in-batch similarity"):
        _config("tiny-bert", text, "data.batch_size=2", recipe="distill-encoder")
    _config("tiny-bert", text, "data.batch_size=2", "loss.similarity_weight=0", recipe="distill-encoder")


# ---------------------------------------------------------------------------------- after the conversion
def test_compat_output_of_an_approximate_student_is_refused_before_training(text, tmp_path):
    out = tmp_path / "r"
    with pytest.raises(preflight.RecipeMismatch, match="`output.format`: compat keeps LayerNorms and cannot store "
                                                       "the student's 2 approximate norm"):
        run("distill-masked-lm", ["model.source=tiny-bert", f"data.path={text}", "data.seq_len=32",
                                  "output.format=compat", f"output.dir={out}", *FAST])
    assert not out.exists()  # it used to train, then fail to save, leaving checkpoints and an empty model/


def test_a_refused_overwrite_keeps_the_old_run(text, tmp_path):
    out = tmp_path / "r"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(preflight.RecipeMismatch):
        run("distill-causal-lm", ["model.source=tiny-gpt2", f"data.path={text}", "data.seq_len=500",
                                  "output.overwrite=true", f"output.dir={out}", *FAST])
    assert (out / "metrics.jsonl").read_text() == '{"step": 0}\n'


def test_a_masked_lm_directory_is_an_encoder_student(text, tmp_path):
    """model.student loads under the task's class: a converted BertForMaskedLM distils as an encoder."""
    student = tmp_path / "bert-rms"
    normswap.convert("tiny-bert", str(student), mode="all")
    result = run("distill-encoder", ["model.source=tiny-bert", f"model.student={student}", f"data.path={text}",
                                     "data.seq_len=32", f"output.dir={tmp_path / 'r'}", *FAST])
    assert result.metrics_before["cosine"] > 0.99  # it used to fail: logits (320) against hidden states (64)


def test_lora_on_a_converted_directory_takes_peft_default_targets(tmp_path):
    normswap.convert("tiny-gpt2", str(tmp_path / "gpt2-rms"))
    model = normswap.load(str(tmp_path / "gpt2-rms"))
    assert model.config.model_type == "normswap_gpt2"  # PEFT's table knows gpt2, not this
    wrapped = models.select_trainable(model, "lora", LoraConfig())
    assert any("lora_A" in name for name, _ in wrapped.named_parameters())
