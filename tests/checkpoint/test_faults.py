"""Fault injection for ``normswap convert / inspect / verify``: nothing wrong is ever written with exit 0.

Each case asserts the exit code, the one-line message, that ``--out`` is absent (or untouched),
and that the source directory is byte-identical afterwards.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from normswap import presets
from normswap.cli import main


# ------------------------------------------------------------------------------------ helpers
def run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def one_line_error(code: int, err: str, expected: int, *fragments: str) -> str:
    assert code == expected, err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for frag in fragments:
        assert frag in lines[0], lines[0]
    return lines[0]


def digest(d: Path) -> dict[str, str]:
    """Path -> sha256 of every file under ``d`` (the source must stay byte-identical)."""
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def edit_weights(d: Path, fn) -> Path:
    f = d / "model.safetensors"
    sd = load_file(f)
    fn(sd)
    save_file(sd, f, metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def gpt2_src(tmp_path_factory) -> Path:
    return presets.save("tiny-gpt2", tmp_path_factory.mktemp("src") / "gpt2")


def copy_of(src: Path, tmp_path: Path, name: str = "src") -> Path:
    return Path(shutil.copytree(src, tmp_path / name))


def refused(tmp_path: Path, src: Path, expected: int, *fragments: str, extra: tuple[str, ...] = ()) -> str:
    """Run convert on ``src`` and check a one-line refusal, nothing written, source untouched."""
    before = digest(src)
    out = tmp_path / "out"
    code, _, err = run("convert", str(src), "--out", str(out), "-q", *extra)
    line = one_line_error(code, err, expected, *fragments)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dir left
    assert digest(src) == before
    return line


# ------------------------------------------------------------------------------------ defect 1
@pytest.mark.parametrize("low_memory", [False, True], ids=["in-memory", "low-memory"])
def test_missing_tensor_is_an_error_on_both_paths(tmp_path, gpt2_src, low_memory):
    src = edit_weights(copy_of(gpt2_src, tmp_path), lambda sd: sd.pop("transformer.h.0.mlp.c_fc.weight"))
    flag = ("--low-memory",) if low_memory else ("--in-memory",)
    refused(tmp_path, src, 1, "transformer.h.0.mlp.c_fc.weight", "no tensor", extra=flag)


@pytest.mark.parametrize("low_memory", [False, True], ids=["in-memory", "low-memory"])
def test_unexpected_tensor_is_an_error(tmp_path, gpt2_src, low_memory):
    def add(sd):
        sd["transformer.h.0.extra.weight"] = torch.zeros(3)

    src = edit_weights(copy_of(gpt2_src, tmp_path), add)
    flag = ("--low-memory",) if low_memory else ("--in-memory",)
    refused(tmp_path, src, 2, "transformer.h.0.extra.weight", "--task", extra=flag)


@pytest.mark.parametrize("low_memory", [False, True], ids=["in-memory", "low-memory"])
def test_mismatched_tensor_is_an_error(tmp_path, gpt2_src, low_memory):
    def shrink(sd):
        sd["transformer.h.0.mlp.c_fc.bias"] = sd["transformer.h.0.mlp.c_fc.bias"][:-1].clone()

    src = edit_weights(copy_of(gpt2_src, tmp_path), shrink)
    flag = ("--low-memory",) if low_memory else ("--in-memory",)
    refused(tmp_path, src, 1, "transformer.h.0.mlp.c_fc.bias", extra=flag)


def test_truncated_safetensors(tmp_path, gpt2_src):
    src = copy_of(gpt2_src, tmp_path)
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    refused(tmp_path, src, 1, "truncated")


def test_new_task_head_needs_the_flag_and_is_recorded(tmp_path, gpt2_src):
    src = copy_of(gpt2_src, tmp_path)
    refused(tmp_path, src, 2, "score.weight", "--new-head", extra=("--task", "sequence-classification"))
    out = tmp_path / "out"
    code, _, err = run(
        "convert", str(src), "--out", str(out), "--task", "sequence-classification", "--new-head"
    )
    assert code == 0, err
    assert "score.weight" in err  # said out loud, not only in the manifest
    manifest = json.loads((out / "config.json").read_text())["normswap"]
    assert manifest["new_head"] == ["score.weight"]
    code, _, err = run("convert", str(src), "--out", str(tmp_path / "o2"), "--new-head")
    one_line_error(code, err, 2, "--task")  # an option that needs another: a usage error


# ------------------------------------------------------------------------------------ defect 9
def test_compat_checkpoint_given_to_convert(tmp_path, gpt2_src):
    compat = tmp_path / "compat"
    code, _, err = run("convert", str(gpt2_src), "--out", str(compat), "-q", "--format", "compat")
    assert code == 0, err
    sub = tmp_path / "again"
    sub.mkdir()
    refused(sub, compat, 3, "already converted (compat)", "use it as is")


# ------------------------------------------------------------------------------------ defects 1 + 11
def _tiny_sentence_transformer(root: Path) -> Path:
    """A sentence-transformers directory built offline, shaped like the real ones: config.json
    names the masked-LM class, the weights hold only the encoder, README/Pooling/Normalize."""
    st = pytest.importorskip("sentence_transformers")
    import transformers
    from sentence_transformers import models

    mlm, tok = presets.build("tiny-bert")
    base = transformers.BertModel(mlm.config)
    base.load_state_dict(mlm.bert.state_dict(), strict=False)
    base_dir = root / "base"
    base.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    tr = models.Transformer(str(base_dir), max_seq_length=24)
    dim = getattr(tr, "get_embedding_dimension", None) or tr.get_word_embedding_dimension
    model = st.SentenceTransformer(modules=[tr, models.Pooling(dim()), models.Normalize()])
    out = root / "st"
    model.save(str(out))
    cfg = json.loads((out / "config.json").read_text())
    cfg["architectures"] = ["BertForMaskedLM"]
    (out / "config.json").write_text(json.dumps(cfg))
    card = "---\nlicense: mit\ntags:\n- sentence-transformers\n---\n\n# my encoder\n\nIt embeds.\n"
    (out / "README.md").write_text(card)
    (out / "NOTES.txt").write_text("keep me\n")
    return out


def test_sentence_transformers_round_trip(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    src = _tiny_sentence_transformer(tmp_path / "build")
    before = digest(src)
    out = tmp_path / "out"
    code, stdout, err = run("convert", str(src), "--out", str(out), "-q")
    assert code == 0, err
    assert digest(src) == before
    manifest = json.loads((out / "config.json").read_text())["normswap"]
    assert manifest["architecture"] == "BertModel"  # the base model, not a random masked-LM head
    assert manifest["source_layout"] == "sentence-transformers"
    assert "new_head" not in manifest and manifest["plan"]["unties"] == []
    # every non-weight file of the source came along, subdirectories included
    for name in before:
        if name not in ("model.safetensors", "config.json", "README.md"):
            assert (out / name).read_bytes() == (src / name).read_bytes(), name
    card = (out / "README.md").read_text()
    assert card.index("It embeds.") < card.index("Converted by normswap")
    assert "license: mit" in card and "- normswap" in card and "- sentence-transformers" in card

    import normswap  # noqa: F401 - registers normswap_* model types for the plain AutoModel path

    a, b = st.SentenceTransformer(str(src), device="cpu"), st.SentenceTransformer(str(out), device="cpu")
    assert [type(m).__name__ for m in a] == [type(m).__name__ for m in b] == [
        "Transformer",
        "Pooling",
        "Normalize",
    ]
    assert a.max_seq_length == b.max_seq_length == 24
    texts = ["hello world", "a b c d e f g", "the quick brown fox"]
    ea, eb = a.encode(texts, convert_to_tensor=True), b.encode(texts, convert_to_tensor=True)
    cos = torch.nn.functional.cosine_similarity(ea.double(), eb.double())
    # 4 of the 5 norms are Post-LN (approximate); the embeddings stay close, not equal
    assert float(cos.min()) > 0.98, cos
    assert not torch.equal(ea, eb) or manifest["counts"]["approximate"] == 0


# ------------------------------------------------------------------------------------ defects 5, 6
def test_load_refuses_a_plain_transformers_dir(gpt2_src):
    import normswap
    from normswap.errors import NormswapError

    with pytest.raises(NormswapError, match=r"not a normswap checkpoint.*AutoModel.*normswap convert"):
        normswap.load(gpt2_src)


@pytest.fixture(scope="module")
def gpt2_converted(gpt2_src, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("conv") / "gpt2-rms"
    code, _, err = run("convert", str(gpt2_src), "--out", str(out), "-q")
    assert code == 0, err
    return out


def test_verify_refuses_a_converted_model_from_another_source(tmp_path, gpt2_src, gpt2_converted):
    def finetune(sd):  # same architecture, different weights: only the content sample can tell
        for k in sd:
            sd[k] = sd[k] + 0.01

    other = edit_weights(copy_of(gpt2_src, tmp_path), finetune)
    code, _, err = run("verify", str(other), str(gpt2_converted))
    one_line_error(code, err, 1, "was not converted from", "--force")
    code, out, err = run("verify", str(other), str(gpt2_converted), "--force")
    assert code in (0, 4) and "--force" in err and "figures:" in out
    code, out, err = run("verify", str(gpt2_src), str(gpt2_converted))
    assert code == 0 and "OK" in out, err
    manifest = json.loads((gpt2_converted / "config.json").read_text())["normswap"]
    assert manifest["source_fingerprint"].startswith("tensors-sha256:")


# ------------------------------------------------------------------------------------ defects 2, 3, 10
def _raise(exc: BaseException):
    def fn(*args, **kwargs):
        raise exc

    return fn


def _interrupt_after_partial(tmp_arg: int = 1):
    """Write a partial file into the temp dir (positional arg ``tmp_arg``), then Ctrl-C."""

    def fn(*args, **kwargs):
        (Path(args[tmp_arg]) / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    return fn


# (phase, module path, attribute, replacement, extra CLI flags)
PHASES = [
    ("in-memory weights", "normswap.checkpoint.writer", "write_native", _interrupt_after_partial(), ()),
    ("in-memory reload check", "normswap.checkpoint.conversion", "reload_check", _raise(KeyboardInterrupt()), ()),
    ("rename into place", "normswap.checkpoint.io", "_move_into_place", _raise(KeyboardInterrupt()), ()),
    ("streamed tensors", "normswap.checkpoint.stream_io.ShardWriter", "write", _raise(KeyboardInterrupt()),
     ("--low-memory",)),
    ("streamed config", "normswap.checkpoint.streaming", "_write_config", _raise(KeyboardInterrupt()),
     ("--low-memory",)),
]


@pytest.mark.parametrize("phase, target, attr, fn, flags", PHASES, ids=[p[0] for p in PHASES])
def test_interrupt_in_each_write_phase(tmp_path, gpt2_src, monkeypatch, phase, target, attr, fn, flags):
    import importlib

    mod_name, _, cls_name = target.partition(".ShardWriter")
    obj = importlib.import_module(mod_name)
    if cls_name or target.endswith("ShardWriter"):
        obj = obj.ShardWriter
    monkeypatch.setattr(obj, attr, fn)
    work = tmp_path / "work"
    work.mkdir()
    refused(work, gpt2_src, 130, "interrupted", extra=flags)


@pytest.mark.parametrize("low_memory", [False, True], ids=["in-memory", "low-memory"])
def test_disk_full_while_writing(tmp_path, gpt2_src, monkeypatch, low_memory):
    import errno

    from normswap.checkpoint import stream_io, writer

    enospc = OSError(errno.ENOSPC, "No space left on device")
    if low_memory:
        calls = {"n": 0}
        original = stream_io.ShardWriter.write

        def write(self, key, tensor):  # a few tensors land, then the disk fills up
            calls["n"] += 1
            if calls["n"] > 3:
                raise enospc
            original(self, key, tensor)

        monkeypatch.setattr(stream_io.ShardWriter, "write", write)
    else:
        monkeypatch.setattr(writer, "write_native", _raise(enospc))
    work = tmp_path / "work"
    work.mkdir()
    line = refused(work, gpt2_src, 1, "disk full:", "filled up while writing --out", "to write", "free",
                   extra=("--low-memory",) if low_memory else ())
    assert "internal error" not in line and "incomplete" not in line


def test_space_precheck_counts_untied_bytes(tmp_path, gpt2_src, monkeypatch):
    """The pre-check sees what will be written: untying the GPT-2 embedding (--untie) adds its size."""
    from normswap.checkpoint import io

    seen: list[int] = []
    original = io.check_space

    def spy(out, needed):
        seen.append(needed)
        return original(out, needed)

    monkeypatch.setattr(io, "check_space", spy)
    wte = load_file(gpt2_src / "model.safetensors")["transformer.wte.weight"]
    src_bytes = (gpt2_src / "model.safetensors").stat().st_size
    for flags in ((), ("--low-memory",)):
        seen.clear()
        out = tmp_path / f"o{len(flags)}"
        code, _, err = run("convert", str(gpt2_src), "--out", str(out), "--untie", *flags)  # notes on
        assert code == 0, err
        assert max(seen) >= src_bytes - 4096 + wte.numel() * wte.element_size(), (flags, seen)
        assert "+" in err and "--untie" in err  # the growth is said out loud


def test_sigkill_then_rerun_cleans_the_stale_temp_dir(tmp_path, warm_python):
    out = tmp_path / "out"
    script = (
        "import os, signal\n"
        "from normswap.checkpoint import writer\n"
        "from normswap.cli import main\n"
        "orig = writer.write_native\n"
        "def killed(*a, **k):\n"
        "    orig(*a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "writer.write_native = killed\n"
        f"main(['convert', 'tiny-gpt2', '--out', {str(out)!r}, '-q'])\n"
    )
    # a process of its own that kills itself: a child of the warm fork server (tests/warm_python.py)
    proc = warm_python.run(script, timeout=300)
    assert proc.returncode == -9, proc.stderr
    stale = [p for p in tmp_path.iterdir() if p.name.startswith(".out.normswap-tmp-")]
    assert len(stale) == 1 and not out.exists()
    code, _, err = run("convert", "tiny-gpt2", "--out", str(out))  # not -q: the note is what is checked
    assert code == 0, err
    assert "removed" in err and stale[0].name in err and "no longer exists" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ------------------------------------------------------------------------------------ defect 7, 12, 13
@pytest.fixture()
def finetune_args(tmp_path, gpt2_src) -> list[str]:
    data = tmp_path / "corpus.txt"
    data.write_text("hello world\nthe quick brown fox\n" * 8)
    return [
        "distill-causal-lm",
        f"model.source={gpt2_src}",
        f"data.path={data}",
        f"output.dir={tmp_path / 'run'}",
    ]


def test_finetune_interrupt_and_failure(tmp_path, finetune_args, monkeypatch):
    import normswap.recipes
    from normswap.errors import NormswapError

    monkeypatch.setattr(normswap.recipes, "run", _raise(KeyboardInterrupt()))
    code, _, err = run("finetune", *finetune_args)
    one_line_error(code, err, 130, "interrupted")

    def fails_after_mkdir(cfg):
        Path(cfg.output.dir).mkdir(parents=True)
        raise NormswapError("the teacher and the student disagree on the vocabulary")

    monkeypatch.setattr(normswap.recipes, "run", fails_after_mkdir)
    code, _, err = run("finetune", *finetune_args)
    one_line_error(code, err, 1, "vocabulary")
    assert not (tmp_path / "run").exists()  # no empty output directory left behind


@pytest.mark.parametrize(
    "override, fragment",
    [("train.lr=abc", "train.lr"), ("train.bogus=1", "train.bogus"), ("trainlr", "key=value")],
)
def test_finetune_bad_override_is_a_usage_error(finetune_args, override, fragment):
    code, _, err = run("finetune", *finetune_args, override)
    one_line_error(code, err, 2, fragment)


def test_finetune_list_and_recipe_names():
    code, out, err = run("finetune", "--list")
    assert code == 0, err
    names = [ln.split()[0] for ln in out.strip().splitlines()]
    assert "distill-masked-lm" in names and "distill-encoder" in names
    code, out, _ = run("finetune", "distill-encoder", "model.source=m", "data.path=d", "--print-config")
    assert code == 0 and "task: encoder" in out
    code, _, err = run("finetune")
    one_line_error(code, err, 2, "--list")
    code, _, err = run("finetune", "no-such-recipe")  # an invalid RECIPE argument: a usage error
    one_line_error(code, err, 2, "built-in", "distill-encoder")


def test_bench_plot_without_matplotlib_and_interrupt(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    code, _, err = run("bench", "--shapes", "8x64", "--plot", str(tmp_path / "p.png"))
    one_line_error(code, err, 2, "pip install matplotlib")
    assert not (tmp_path / "p.png").exists()
    monkeypatch.undo()

    from normswap.backends import bench

    monkeypatch.setattr(bench, "run", _raise(KeyboardInterrupt()))
    code, _, err = run("bench", "--shapes", "8x64")
    one_line_error(code, err, 130, "interrupted")


def test_bench_spread_table_flags_wide_ratios():
    from normswap.backends.bench import Record
    from normswap.cli.backends_cmd import spread_table

    def rec(method, samples):
        return Record("cpu", "float32", 8, 64, "fwd", method, 1.0, 1.0, 1.0, None, None, samples_us=samples)

    records = [rec("layer_norm", [10.0, 10.0, 10.0]), rec("cpu", [5.0, 5.2, 5.1]), rec("eager", [5.0, 20.0, 9.0])]
    text, wide = spread_table(records)
    assert "x layer_norm: min" in text and "median" in text
    assert len(wide) == 1 and wide[0].startswith("eager")
    row = next(ln for ln in text.splitlines() if " eager " in ln)
    assert row.split()[-4:] == ["0.5", "0.9", "2", "wide"]


def test_inspect_with_nothing_to_convert_exits_3(tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32,
    )
    d = tmp_path / "llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    code, out, err = run("inspect", str(d))
    one_line_error(code, err, 3, "nothing to convert")
    assert "skipped" in out  # the table still shows what was found


def test_messages_speak_cli_words_and_kl_is_never_negative():
    from normswap.cli.common import cli_words
    from normswap.cli.common import figures_line as _figures

    assert cli_words("keep it with mode='exact'; verify=False skips") == "keep it with --mode exact; --no-verify skips"
    assert "kl=0" in _figures({"kl": -3e-17}) and "-" not in _figures({"kl": -3e-17})


def test_progress_lines_when_not_a_tty():
    import io as stdio

    from normswap.checkpoint.conversion import Steps

    class Clock:
        t = 0.0

        def __call__(self):
            return self.t

    stream = stdio.StringIO()
    steps = Steps(True, 3, "normswap convert x", stream=stream)
    clock = Clock()
    steps._clock = clock
    steps._start = steps._last = 0.0
    with steps:
        steps.set_postfix_str("loading")
        clock.t = 1.0
        steps.update()
        steps.set_postfix_str("converting")  # 1 s after the last line: not printed
        clock.t = 10.0
        steps.update()
        steps.set_postfix_str("writing")
        steps.update()
    lines = stream.getvalue().splitlines()
    assert lines == [
        "normswap convert x: step 1/3: loading (0 s)",
        "normswap convert x: step 3/3: writing (10 s)",
        "normswap convert x: done (10 s)",
    ]
    assert "," not in stream.getvalue() and "\r" not in stream.getvalue()


# ------------------------------------------------------------------------------------ defect 4
def test_trust_remote_code_reaches_every_loader(tmp_path, gpt2_src, monkeypatch):
    import transformers

    calls: list[tuple[str, object]] = []

    def spy(owner, name):
        original = getattr(owner, name).__func__

        def wrapped(cls, *args, **kwargs):
            calls.append((f"{cls.__name__}.{name}", kwargs.get("trust_remote_code")))
            return original(cls, *args, **kwargs)

        monkeypatch.setattr(owner, name, classmethod(wrapped))

    spy(transformers.PreTrainedModel, "from_pretrained")
    spy(transformers.AutoConfig, "from_pretrained")
    spy(transformers.AutoTokenizer, "from_pretrained")
    for fmt in ("compat", "native"):
        out = tmp_path / fmt
        code, _, err = run("convert", str(gpt2_src), "--out", str(out), "-q", "--format", fmt, "--trust-remote-code")
        assert code == 0, err
        code, _, err = run("verify", str(gpt2_src), str(out), "--trust-remote-code")
        assert code == 0, err
    kinds = {name.split(".")[0] for name, _ in calls}
    assert {"AutoConfig", "AutoTokenizer"} <= kinds and len(calls) >= 8, calls
    assert [c for c in calls if c[1] is not True] == [], calls


# ------------------------------------------------------------------------------------ --dtype: one rounding
def test_dtype_bfloat16_rounds_once(tmp_path, gpt2_src):
    import transformers

    import normswap

    out = tmp_path / "bf16"
    code, _, err = run("convert", str(gpt2_src), "--out", str(out), "-q", "--dtype", "bfloat16")
    assert code == 0, err
    written = normswap.load(out).state_dict()

    def converted(load_dtype: torch.dtype) -> dict[str, torch.Tensor]:
        model = transformers.AutoModelForCausalLM.from_pretrained(gpt2_src, dtype=load_dtype).eval()
        normswap.patch(model, beta_placement="keep")  # what convert resolves for a checkpoint
        return model.to(torch.bfloat16).state_dict()

    once, twice = converted(torch.float32), converted(torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in written.values() if v.is_floating_point())
    assert [k for k in once if not torch.equal(once[k], written[k])] == []
    # what loading in bf16 first gives: the centered weights differ (rounded before the surgery)
    assert any(not torch.equal(once[k], twice[k]) for k in once)


# ------------------------------------------------------------------------------------ defect 8
def test_bogus_backend_env_is_one_line_with_the_valid_names(tmp_path, monkeypatch, warm_python):
    """``convert`` in a new process (the variable read at the process's first norm call, end to end): a child
    of the warm fork server, which never imported normswap; ``backends`` in this one, the variable read again
    by ``backends.refresh()`` (an interpreter start costs an import of torch, ~4 s of CPU)."""
    from normswap import backends

    out = tmp_path / "out"
    proc = warm_python.run("from normswap.cli import main; main()", "convert", "tiny-gpt2", "--out", str(out), "-q",
                           env={"NORMSWAP_BACKEND": "bogus"}, timeout=300)
    line = one_line_error(proc.returncode, proc.stderr, 1, "NORMSWAP_BACKEND='bogus'", "eager", "auto")
    assert "internal error" not in line
    monkeypatch.setenv("NORMSWAP_BACKEND", "bogus")
    backends.refresh()
    try:
        res = CliRunner().invoke(main, ["backends"])
        line = one_line_error(res.exit_code, res.stderr, 1, "NORMSWAP_BACKEND='bogus'", "eager", "auto")
        assert "internal error" not in line
    finally:
        monkeypatch.undo()
        backends.refresh()
    assert not out.exists() and list(tmp_path.iterdir()) == []
