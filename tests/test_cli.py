"""The command line: convert / inspect / verify through click's CliRunner and the installed script,
plus every bad-input path (one-line error, documented exit code, nothing written, fast)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import site
import subprocess
import sys
import time
from collections.abc import Callable
from io import StringIO
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import normswap
from normswap import presets
from normswap.checkpoint import io, writer
from normswap.cli import main
from normswap.cli.common import cli_words
from normswap.errors import UsageError


def run(*args: str, env: dict | None = None) -> tuple[int, str, str, float]:
    runner = CliRunner()
    start = time.perf_counter()
    res = runner.invoke(main, list(args), env=env, catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr, time.perf_counter() - start


def assert_one_line_error(code: int, err: str, expected_code: int, *fragments: str) -> None:
    assert code == expected_code, err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for frag in fragments:
        assert frag in lines[0], lines[0]


def listing(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    return presets.save("tiny-gpt2", tmp_path_factory.mktemp("src") / "gpt2")


# ------------------------------------------------------------------------------------ happy paths
def test_group_lists_commands():
    code, out, _, _ = run("--help")
    assert code == 0
    for cmd in ("convert", "inspect", "verify"):
        assert cmd in out


@pytest.mark.parametrize("cmd", ["convert", "inspect", "verify"])
def test_help_has_worked_example_and_exit_codes(cmd):
    code, out, _, _ = run(cmd, "--help")
    assert code == 0
    assert "Examples:" in out and f"normswap {cmd} " in out
    assert "Exit codes" in out
    if cmd == "convert":
        for name in presets.names():
            assert name in out
        assert "normswap convert tiny-gpt2 --out ./tiny-gpt2-rms" in out


def test_convert_preset_quickstart(tmp_path):
    out = tmp_path / "tiny-gpt2-rms"
    code, stdout, err, _ = run("convert", "tiny-gpt2", "--out", str(out))
    assert code == 0, err
    assert "converted 5 of 5 LayerNorm(s)" in stdout and "plan: 5 LayerNorm(s): 5 exact" in stdout
    assert "reload_bitwise_equal=True" in stdout and "max_rel_error=" in stdout
    model = normswap.load(out)
    tok = presets.tokenizer("tiny-gpt2")
    enc = tok("The quick", return_tensors="pt")
    assert model.generate(**enc, max_new_tokens=3, do_sample=False).shape[1] == enc.input_ids.shape[1] + 3
    assert listing(tmp_path) == ["tiny-gpt2-rms"]  # no temporary directories left behind


def test_convert_local_dir_with_options(tmp_path, gpt2_dir):
    out = tmp_path / "o"
    code, stdout, err, _ = run(
        "convert",
        str(gpt2_dir),
        "--out",
        str(out),
        "--format",
        "compat",
        "--dtype",
        "bfloat16",
        "--max-shard-size",
        "50KB",
        "--keep-tied",
        "-q",
    )
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gpt2" and cfg["dtype"] == "bfloat16"
    assert (out / "model.safetensors.index.json").is_file()
    assert load_file(str(sorted(out.glob("*.safetensors"))[0])).popitem()[1].dtype == torch.bfloat16
    assert (out / "tokenizer.json").is_file()  # side files copied from the source directory


def test_convert_bert_all_with_calibration(tmp_path):
    data = tmp_path / "calib.jsonl"
    data.write_text("\n".join(json.dumps({"text": line}) for line in presets.CORPUS.splitlines()))
    out = tmp_path / "bert"
    code, stdout, err, _ = run(
        "convert", "tiny-bert", "--out", str(out), "--mode", "all", "--calibration-data", str(data)
    )
    assert code == 0, err
    manifest = json.loads((out / "config.json").read_text())["normswap"]
    assert manifest["plan"]["options"]["calibration_batches"] == 2
    # tiny-bert: the two attention-output norms are Post-LN; the FFN-output ones are exact by mean carry
    assert manifest["counts"]["approximate"] == 2
    assert len(manifest["plan"]["mean_carries"]) == 2


def test_convert_auto_mode_warns_about_approximate_norms(tmp_path):
    code, _, err, _ = run("convert", "tiny-bert", "--out", str(tmp_path / "b"))
    assert code == 0, err
    assert err.count("warning:") == 2 and "approximately" in err
    assert err.count("attention.output.LayerNorm` converted approximately") == 2


def test_convert_groups_the_approximate_norm_warnings_of_a_deep_post_ln_model(tmp_path):
    import transformers as tf

    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=5, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=32)
    tf.BertModel(config).save_pretrained(tmp_path / "bert5")
    code, stdout, err, _ = run("convert", str(tmp_path / "bert5"), "--out", str(tmp_path / "out"))
    assert code == 0, err
    n = json.loads((tmp_path / "out" / "config.json").read_text())["normswap"]["counts"]["approximate"]
    assert n >= 5
    lines = [ln for ln in err.splitlines() if "converted approximately" in ln]
    assert len(lines) == 1, err  # one line for all of them, not one per layer
    assert lines[0].startswith(f"warning: {n} LayerNorm(s) converted approximately, relative output error ")
    assert "--mode exact" in lines[0] and "normswap inspect" in lines[0] and "=True" not in lines[0]


def test_compat_reports_approximate_norms_left_as_layernorm(tmp_path):
    code, stdout, err, _ = run("convert", "tiny-bert", "--out", str(tmp_path / "b"), "--format", "compat")
    assert code == 0, err
    assert "2 approximate norm(s) left unconverted" in err and "converted 4 of 6" in stdout


def test_convert_task_override(tmp_path, gpt2_dir):
    out = tmp_path / "base"
    code, _, err, _ = run("convert", str(gpt2_dir), "--out", str(out), "--task", "base")
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["architectures"] == ["NormswapGPT2Model"]


def test_inspect_table_json_and_manifest(tmp_path):
    code, out, err, _ = run("inspect", "tiny-bloom", "-v")
    assert code == 0, err
    for frag in (
        "verdict",
        "writers",
        "readers",
        "transformer.h.0.input_layernorm",
        "exact-with-centering",
        "centering op: transformer.word_embeddings_layernorm",
    ):
        assert frag in out
    code, out, _, _ = run("inspect", "tiny-gpt2", "--json")
    plan = json.loads(out)
    assert [s["verdict"] for s in plan["sites"]] == ["exact-with-centering"] * 5  # the tied wte: one op
    normswap.convert("tiny-opt", tmp_path / "opt")
    code, out, _, _ = run("inspect", str(tmp_path / "opt"))
    assert code == 0 and "(manifest)" in out and "model.decoder.final_layer_norm" in out


def test_verify_exact_approximate_and_tampered(tmp_path):
    normswap.convert("tiny-gpt2", tmp_path / "g")
    code, out, err, _ = run("verify", "tiny-gpt2", str(tmp_path / "g"))
    assert code == 0, err
    assert "exact conversion" in out and "OK" in out
    data = tmp_path / "prompts.txt"
    data.write_text(presets.CORPUS)
    code, out, _, _ = run("verify", "tiny-gpt2", str(tmp_path / "g"), "--data", str(data), "--json")
    assert code == 0 and json.loads(out)["ok"] is True
    normswap.convert("tiny-gpt2", tmp_path / "gc", format="compat")
    code, out, _, _ = run("verify", "tiny-gpt2", str(tmp_path / "gc"))
    assert code == 0 and "exact conversion" in out
    normswap.convert("tiny-bert", tmp_path / "b", mode="all")
    code, out, _, _ = run("verify", "tiny-bert", str(tmp_path / "b"))
    assert code == 0 and "approximate conversion" in out
    # break an exact checkpoint: verify must fail with exit code 4
    f = tmp_path / "g" / "model.safetensors"
    tensors = load_file(str(f))
    tensors["transformer.h.0.mlp.c_fc.bias"] += 1.0
    save_file(tensors, str(f), metadata={"format": "pt"})
    code, out, err, _ = run("verify", "tiny-gpt2", str(tmp_path / "g"))
    assert code == 4 and "misses tolerance" in out


def test_verify_with_its_arguments_swapped_says_so(tmp_path):
    """Fails without the check: ``verify CONVERTED ORIGINAL`` said only that ORIGINAL "is not a normswap
    checkpoint", which reads as if the conversion were broken."""
    presets.save("tiny-gpt2", tmp_path / "orig")
    normswap.convert(tmp_path / "orig", tmp_path / "rms")
    code, _, err, _ = run("verify", str(tmp_path / "rms"), str(tmp_path / "orig"))
    assert_one_line_error(code, err, 1, "is the normswap checkpoint", "the order is ORIGINAL CONVERTED",
                          f"normswap verify {tmp_path / 'orig'} {tmp_path / 'rms'}")
    code, _, err, _ = run("verify", "tiny-gpt2", str(tmp_path / "orig"))  # neither is: as before
    assert_one_line_error(code, err, 1, "is not a normswap checkpoint")


# ------------------------------------------------------------------------------------ bad input
def test_missing_path(tmp_path):
    code, _, err, secs = run("convert", "./no/such/model", "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, 2, "does not exist")  # no Hub id looks like it: a usage error (round 56)
    assert secs < 10 and listing(tmp_path) == []


def test_hub_id_while_offline(tmp_path):
    code, _, err, secs = run(
        "convert", "some-org/some-model", "--out", str(tmp_path / "o"), env={"HF_HUB_OFFLINE": "1"}
    )
    assert_one_line_error(code, err, 1, "HF_HUB_OFFLINE", "some-org/some-model")
    assert secs < 10 and listing(tmp_path) == []


def test_hub_id_with_unreachable_network(tmp_path):
    env = {"HF_HUB_OFFLINE": None, "TRANSFORMERS_OFFLINE": None, "HF_ENDPOINT": "http://127.0.0.1:9"}
    code, _, err, secs = run("convert", "some-org/some-model", "--out", str(tmp_path / "o"), env=env)
    assert_one_line_error(code, err, 1, "unreachable")
    assert secs < 10 and listing(tmp_path) == []


def test_truncated_and_corrupted_safetensors(tmp_path, gpt2_dir):
    src = tmp_path / "trunc"
    shutil.copytree(gpt2_dir, src)
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    code, _, err, secs = run("convert", str(src), "--out", str(tmp_path / "o1"))
    assert_one_line_error(code, err, 1, "truncated")
    f.write_bytes(b"\x00garbage-not-a-header" * 4)
    code, _, err, _ = run("convert", str(src), "--out", str(tmp_path / "o2"))
    assert_one_line_error(code, err, 1, "not a valid safetensors")
    assert secs < 10 and listing(tmp_path) == ["trunc"]


def test_pickle_only_refused_unless_opted_in(tmp_path, gpt2_dir):
    src = tmp_path / "pickled"
    shutil.copytree(gpt2_dir, src)
    torch.save(load_file(str(src / "model.safetensors")), src / "pytorch_model.bin")
    (src / "model.safetensors").unlink()
    code, _, err, _ = run("convert", str(src), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, 2, "pickle", "--allow-pickle")
    assert not (tmp_path / "o").exists()
    code, _, err, _ = run("convert", str(src), "--out", str(tmp_path / "o"), "--allow-pickle")
    assert code == 0, err
    assert not list((tmp_path / "o").glob("*.bin"))  # the output is safetensors only


def test_model_needing_trust_remote_code(tmp_path, gpt2_dir):
    src = tmp_path / "custom"
    shutil.copytree(gpt2_dir, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomModel"}
    (src / "config.json").write_text(json.dumps(cfg))
    code, _, err, _ = run("convert", str(src), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, 2, "--trust-remote-code")
    assert not (tmp_path / "o").exists()


def test_unwritable_destination(tmp_path, monkeypatch):
    monkeypatch.setattr(io.os, "access", lambda *a, **k: False)
    code, _, err, _ = run("convert", "tiny-gpt2", "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, 1, "permission denied")
    monkeypatch.undo()
    (tmp_path / "afile").write_text("x")
    code, _, err, _ = run("convert", "tiny-gpt2", "--out", str(tmp_path / "afile" / "sub"))
    assert_one_line_error(code, err, 1, "not a directory")
    assert listing(tmp_path) == ["afile"]


def test_full_destination(tmp_path, gpt2_dir, monkeypatch):
    monkeypatch.setattr(io, "free_bytes", lambda path: 1000)
    code, _, err, _ = run("convert", str(gpt2_dir), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, 1, "disk full: --out", "needs ~", "headroom", "has 1.00 KB free")
    monkeypatch.undo()

    def disk_full(model, out, **kw):
        (out / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "write_native", disk_full)
    code, _, err, _ = run("convert", "tiny-gpt2", "--out", str(tmp_path / "nested" / "o"))
    assert_one_line_error(code, err, 1, "disk full:", f"the filesystem of {tmp_path.resolve()} filled up",
                          "to write")
    assert listing(tmp_path) == []  # partial output and the created parent are gone


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--mode", "bogus"], "--mode"),
        (["--format", "gguf"], "--format"),
        (["--dtype", "int8"], "--dtype"),
        (["--max-shard-size", "12XB"], "--max-shard-size"),
        (["--task", "painting"], "--task"),
    ],
)
def test_invalid_option_values(tmp_path, args, fragment):
    code, _, err, secs = run("convert", "tiny-gpt2", "--out", str(tmp_path / "o"), *args)
    assert code == 2 and fragment in err and "Traceback" not in err
    assert secs < 5 and listing(tmp_path) == []


def test_conflicting_options(tmp_path):
    code, _, err, _ = run(
        "convert", "tiny-bert", "--out", str(tmp_path / "o"), "--format", "compat", "--mode", "all"
    )
    assert_one_line_error(code, err, 2, "compat")
    code, _, err, _ = run(
        "convert",
        "tiny-gpt2",
        "--out",
        str(tmp_path / "o"),
        "--low-memory",
        "--calibration-data",
        str(tmp_path / "x.txt"),
    )
    assert_one_line_error(code, err, 2, "--calibration-data")
    assert listing(tmp_path) == []


def test_nothing_to_convert(tmp_path):
    import transformers

    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=99,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    code, _, err, _ = run("convert", str(tmp_path / "llama"), "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, 3, "no LayerNorm", "nothing to do")
    normswap.convert("tiny-gpt2", tmp_path / "done")
    code, _, err, _ = run("convert", str(tmp_path / "done"), "--out", str(tmp_path / "again"))
    assert_one_line_error(code, err, 3, "already converted")
    assert listing(tmp_path) == ["done", "llama"]


def test_bad_calibration_data(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "missing field"}\n')
    code, _, err, _ = run(
        "convert", "tiny-bert", "--out", str(tmp_path / "o"), "--mode", "all", "--calibration-data", str(bad)
    )
    assert_one_line_error(code, err, 1, "bad.jsonl:2", '"text"')
    code, _, err, _ = run("convert", "tiny-vit", "--out", str(tmp_path / "o"), "--calibration-data", str(bad))
    assert_one_line_error(code, err, 1, "pixel_values")
    assert listing(tmp_path) == ["bad.jsonl"]


# ------------------------------------------------------------------------------------ atomic output
def test_existing_output_refused_then_overwritten(tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (tmp_path / "neighbour.txt").write_text("untouched")
    code, _, err, _ = run("convert", "tiny-gpt2", "--out", str(out))
    assert_one_line_error(code, err, 2, "not empty", "--overwrite")  # a usage error (docs/cli.md)
    assert listing(out) == ["notes.txt"]
    code, _, err, _ = run("convert", "tiny-gpt2", "--out", str(out), "--overwrite")
    assert code == 0, err
    assert "notes.txt" not in listing(out) and (out / "config.json").is_file()
    assert (tmp_path / "neighbour.txt").read_text() == "untouched"
    assert listing(tmp_path) == ["neighbour.txt", "o"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run("convert", "tiny-opt", "--out", str(empty), "-q")[0] == 0  # an empty directory is fine


def test_failed_overwrite_keeps_the_old_output(tmp_path, monkeypatch):
    out = tmp_path / "o"
    normswap.convert("tiny-gpt2", out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def boom(model, out_dir, **kw):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(writer, "write_native", boom)
    code, _, err, _ = run("convert", "tiny-gpt2", "--out", str(out), "--overwrite")
    assert code == 1 and "internal error" in err and "Traceback" not in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert listing(tmp_path) == ["o"]


def test_interrupted_run_leaves_nothing(tmp_path, monkeypatch):
    def interrupted(model, out_dir, **kw):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "write_native", interrupted)
    code, _, err, _ = run("convert", "tiny-gpt2", "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, 130, "interrupted")
    assert listing(tmp_path) == []


def test_refuses_to_overwrite_the_source_or_cwd(tmp_path, gpt2_dir, monkeypatch):
    code, _, err, _ = run("convert", str(gpt2_dir), "--out", str(gpt2_dir), "--overwrite")
    assert_one_line_error(code, err, 2, "overlaps the source")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keep.txt").write_text("x")
    code, _, err, _ = run("convert", "tiny-gpt2", "--out", ".", "--overwrite")
    assert_one_line_error(code, err, 2, "current working directory")
    assert (tmp_path / "keep.txt").exists()


# ------------------------------------------------------------------------------------ console script
def _script() -> list[str]:
    exe = shutil.which("normswap")
    if exe is None:
        pytest.skip("the normswap console script is not installed (pip install -e .)")
    return [exe]


def test_console_script_convert_and_error(tmp_path):
    cmd = _script()
    env = {"HF_HUB_OFFLINE": "1", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    import os

    env = {**os.environ, **env}
    res = subprocess.run(
        [*cmd, "convert", "tiny-gpt2", "--out", str(tmp_path / "tiny-gpt2-rms")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, res.stderr
    assert "wrote native checkpoint" in res.stdout
    assert (tmp_path / "tiny-gpt2-rms" / "config.json").is_file()
    res = subprocess.run(
        [*cmd, "convert", str(tmp_path / "missing"), "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 2  # a path that does not exist: a usage error (round 56)
    assert res.stderr.strip().startswith("error:") and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_cli_preset_names_match_the_presets():
    from normswap.cli.convert_cmd import PRESET_NAMES

    assert list(PRESET_NAMES) == presets.names()


def test_import_normswap_cli_does_not_import_torch():
    # nor do `finetune --list` and the recipe config's own checks (round 65: 3.5 s -> 0.5 s)
    code = (
        "import sys; import normswap, normswap.cli, normswap.recipes.config; "
        "from click.testing import CliRunner; "
        "res = CliRunner().invoke(normswap.cli.main, ['finetune', '--list']); "
        "assert res.exit_code == 0 and 'distill' in res.output, res.output; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_public_names_and_hooks_after_lazy_import():
    code = (
        "import normswap, transformers\n"
        "import normswap.analysis.plan, normswap.rotation.rotate, normswap.api\n"  # no submodule shadows them
        "assert callable(normswap.plan) and callable(normswap.rotate) and callable(normswap.save)\n"
        "assert normswap.save is normswap.checkpoint.save\n"
        "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
        "assert 'normswap_gpt2' in CONFIG_MAPPING\n"
        "import transformers.trainer as t\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


# ------------------------------------------------------------------------------------ documented exit codes
CLI_DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def documented_exit_codes() -> dict[int, set[str]]:
    """The exit-code table of docs/cli.md: code -> the commands that can return it."""
    text = CLI_DOC.read_text()
    table = text[text.index("| code | meaning | commands |") :].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[int(cells[0])] = {c.strip() for c in cells[2].split(",")}
    return rows


def _interrupt(monkeypatch, target: str, attr: str) -> None:
    import importlib

    def raise_interrupt(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(target), attr, raise_interrupt)


def _scenarios(tmp_path: Path, gpt2_dir: Path, monkeypatch) -> dict[tuple[int, str], Callable]:
    """One way to get each (exit code, command) of the table; each returns the CLI arguments."""
    import transformers

    out = tmp_path / "o"
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 4)
    ft = ["finetune", "distill-causal-lm", f"model.source={gpt2_dir}", f"data.path={corpus}",
          f"output.dir={tmp_path / 'run'}"]

    def converted() -> Path:
        d = tmp_path / "conv"
        if not d.exists():
            assert run("convert", str(gpt2_dir), "--out", str(d), "-q")[0] == 0
        return d

    def llama() -> Path:
        d = tmp_path / "llama"
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
        transformers.LlamaForCausalLM(cfg).save_pretrained(d)
        return d

    def empty() -> Path:
        d = tmp_path / "empty"
        d.mkdir(exist_ok=True)
        return d

    def bad_recipe() -> Path:
        f = tmp_path / "bad.yaml"
        f.write_text("- just\n- a list\n")
        return f

    def finetune_ok() -> list[str]:
        import normswap.recipes

        class Result:
            stopped_early, steps, tokens, train_time_s, model_dir, main_process = False, 1, 8, 0.1, "m", True

        monkeypatch.setattr(normswap.recipes, "run", lambda cfg: Result())
        return ft

    def verify_fails() -> list[str]:
        from normswap.checkpoint import verify_dirs

        d = converted()
        original = verify_dirs.compare

        def worse(a, b, skip, *rest, **kwargs):  # an exact conversion that misses its tolerance
            figs = original(a, b, skip, *rest, **kwargs)
            figs["max_rel_error"] = 1.0
            return figs

        monkeypatch.setattr(verify_dirs, "compare", worse)
        return ["verify", str(gpt2_dir), str(d)]

    def convert_fails() -> list[str]:
        from normswap.checkpoint import conversion

        monkeypatch.setattr(conversion, "check_agreement", _raise_verification)
        return ["convert", str(gpt2_dir), "--out", str(out)]

    def interrupted(target: str, attr: str, args: list[str]) -> Callable[[], list[str]]:
        def go() -> list[str]:
            _interrupt(monkeypatch, target, attr)
            return args

        return go

    bench = ["bench", "--shapes", "8x64", "--rounds", "1", "--target-ms", "0.2", "--dtype", "fp32"]
    return {
        (0, "convert"): lambda: ["convert", "tiny-gpt2", "--out", str(out), "-q"],
        (0, "inspect"): lambda: ["inspect", "tiny-gpt2"],
        (0, "verify"): lambda: ["verify", str(gpt2_dir), str(converted())],
        (0, "finetune"): finetune_ok,
        (0, "bench"): lambda: bench,
        (0, "backends"): lambda: ["backends"],
        # bad input: a directory with no model in it, a model that is no normswap checkpoint, a recipe file
        # that is no YAML mapping (a path that does not exist is a usage error, 2: tests/test_cli_usage.py)
        (1, "convert"): lambda: ["convert", str(empty()), "--out", str(out)],
        (1, "inspect"): lambda: ["inspect", str(empty())],
        (1, "verify"): lambda: ["verify", "tiny-gpt2", str(gpt2_dir)],
        (1, "finetune"): lambda: ["finetune", str(bad_recipe())],
        (1, "bench"): lambda: ["bench", "--device", "cuda"] if not torch.cuda.is_available() else None,
        (2, "convert"): lambda: ["convert", "tiny-gpt2", "--out", str(out), "--mode", "bogus"],
        (2, "inspect"): lambda: ["inspect", "tiny-gpt2", "--mode", "bogus"],
        (2, "verify"): lambda: ["verify", "tiny-gpt2", str(out), "--tolerance", "-1"],
        (2, "finetune"): lambda: [*ft, "train.lr=abc"],
        (2, "bench"): lambda: ["bench", "--rounds", "many"],
        (3, "convert"): lambda: ["convert", str(converted()), "--out", str(out)],
        (3, "inspect"): lambda: ["inspect", str(llama())],
        (4, "convert"): convert_fails,
        (4, "verify"): verify_fails,
        (130, "convert"): interrupted("normswap.checkpoint.source", "load_model",
                                      ["convert", str(gpt2_dir), "--out", str(out)]),
        (130, "inspect"): interrupted("normswap.checkpoint.source", "load_model", ["inspect", str(gpt2_dir)]),
        (130, "verify"): interrupted("normswap.checkpoint.verify_dirs", "compare",
                                     ["verify", str(gpt2_dir), str(converted())]),
        (130, "finetune"): interrupted("normswap.recipes", "run", ft),
        (130, "bench"): interrupted("normswap.backends.bench", "run", bench),
    }


def _raise_verification(verification):
    from normswap.errors import VerificationFailed

    raise VerificationFailed("verification failed: simulated; nothing was written")


def test_documented_exit_code_table_is_true_for_every_command(tmp_path, gpt2_dir, monkeypatch):
    table = documented_exit_codes()
    assert set(table) == {0, 1, 2, 3, 4, 130}
    scenarios = _scenarios(tmp_path, gpt2_dir, monkeypatch)
    claimed = {(code, cmd) for code, cmds in table.items() for cmd in cmds}
    assert claimed == set(scenarios), claimed ^ set(scenarios)
    for code, cmd in sorted(claimed):
        with monkeypatch.context() as m:
            scenarios_m = _scenarios(tmp_path, gpt2_dir, m)
            args = scenarios_m[(code, cmd)]()
            if args is None:
                continue
            got, _, err, _ = run(*args)
            assert got == code, (code, cmd, err[-500:])
            if code:
                assert "Traceback" not in err
                if code != 2:
                    assert len([ln for ln in err.splitlines() if ln.startswith("error:")]) == 1, (code, cmd, err)
        shutil.rmtree(tmp_path / "o", ignore_errors=True)
        shutil.rmtree(tmp_path / "run", ignore_errors=True)


# ------------------------------------------------------------------------------------ the wheel
# Variables that put other code ahead of a venv's site-packages (PYTHONPATH: the GPU acceptance script
# and our own sessions put the checkout there) or send pip elsewhere (PIP_TARGET, PIP_PREFIX, PIP_USER, ...).
_IMPORT_PATH_VARS = ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONSTARTUP", "PYTHONPLATLIBDIR",
                     "PYTHONEXECUTABLE")


def wheel_test_env() -> dict[str, str]:
    """The environment of the wheel test's subprocesses: the caller's, less what could make ``import
    normswap`` in the venv find anything but the installed wheel, and pip offline."""
    env = {k: v for k, v in os.environ.items() if k not in _IMPORT_PATH_VARS and not k.startswith("PIP_")}
    return env | {"PIP_NO_INDEX": "1", "HF_HUB_OFFLINE": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def test_wheel_test_env_drops_what_would_import_the_checkout(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/checkout")
    monkeypatch.setenv("PIP_TARGET", "/elsewhere")
    monkeypatch.setenv("PYTHONHOME", "/other/python")
    env = wheel_test_env()
    assert not {"PYTHONPATH", "PIP_TARGET", "PYTHONHOME"} & set(env)
    assert env["PIP_NO_INDEX"] == "1" and env["PATH"] == os.environ["PATH"]


def test_wheel_ships_the_recipes_and_lists_them_offline(tmp_path):
    """Build the wheel, install it (not the editable checkout, nor a checkout on PYTHONPATH) in a fresh
    venv, list the recipes."""
    repo = Path(__file__).resolve().parents[1]
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (repo / name).exists():
            shutil.copy2(repo / name, src / name)
    for tree in ("normswap", "recipes"):  # recipes/ goes into the wheel as normswap/recipes/configs
        shutil.copytree(repo / tree, src / tree, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    env = wheel_test_env()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist")],
        check=True, env=env, capture_output=True, timeout=300,
    )
    wheel = next((tmp_path / "dist").glob("normswap-*.whl"))
    venv = tmp_path / "venv"
    # no pip of its own (ensurepip: ~7 s of CPU): this interpreter's pip installs into it (``--python``)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=env, timeout=300)
    bindir = venv / ("Scripts" if os.name == "nt" else "bin")
    # The wheel's dependencies (torch, click, ...) are this interpreter's: its site-packages go in a .pth,
    # after the venv's own (where the wheel goes). Not --system-site-packages: run from inside a venv
    # (the GPU machine's), that gives the base Python's packages, which lack them. Plain paths, so the
    # .pth hooks in those folders (an editable install's import finder) do not run.
    purelib = subprocess.run([str(bindir / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, env=env, capture_output=True, text=True, timeout=120).stdout.strip()
    outer = [p for p in site.getsitepackages() if os.path.isdir(p)]
    Path(purelib, "_normswap_test_deps.pth").write_text("".join(f"{p}\n" for p in outer), encoding="utf-8")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(bindir / "python"), "install", "--no-deps", "-q",
                    str(wheel)], check=True, env=env, capture_output=True, timeout=300)
    where = subprocess.run([str(bindir / "python"), "-c", "import normswap; print(normswap.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert str(venv) in where.stdout, where.stdout + where.stderr  # the wheel, not the checkout
    listing_ = subprocess.run([str(bindir / "normswap"), "finetune", "--list"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
    assert listing_.returncode == 0, listing_.stderr
    names = [ln.split()[0] for ln in listing_.stdout.splitlines()]
    assert {"distill-causal-lm", "distill-encoder", "distill-masked-lm"} <= set(names)
    where_ = subprocess.run([str(bindir / "python"), "-c", "from normswap.recipes.config import builtin_recipes_dir; "
                             "print(builtin_recipes_dir())"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    assert where_.stdout.strip().startswith(str(venv)), where_.stdout + where_.stderr  # the wheel's own copy
    assert Path(where_.stdout.strip(), "accelerate", "ddp.yaml").is_file()  # accelerate configs ship too
    shown = subprocess.run([str(bindir / "normswap"), "finetune", "distill-encoder", "model.source=m",
                            "data.path=d", "--print-config"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120)
    assert shown.returncode == 0 and "task: encoder" in shown.stdout, shown.stderr


def test_per_norm_centering_flag_makes_post_ln_exact_and_says_so(tmp_path):
    out = tmp_path / "bert"
    code, stdout, err, _ = run("convert", "tiny-bert", "--out", str(out), "-q", "--per-norm-centering")
    assert code == 0, err
    manifest = json.loads((out / "config.json").read_text())["normswap"]
    assert manifest["counts"].get("approximate", 0) == 0
    # the FFN-output norms need no centering op (their MLPs carry the mean); the other two get one each, and so does
    # the embeddings' norm, which alone reads the tables' stream (the tables keep their rows: round 62)
    assert manifest["counts"]["exact-with-per-norm-centering"] == 3
    assert manifest["verification"]["max_rel_error"] < 1e-9
    # without the flag the warning names the flag in CLI words, not the API's keyword
    code, stdout, err, _ = run("convert", "tiny-bert", "--out", str(tmp_path / "b2"))
    assert code == 0 and "--per-norm-centering" in err and "per_norm_centering=" not in err
    src = presets.save("tiny-bert", tmp_path / "src")
    code, _, err, _ = run("convert", str(src), "--out", str(tmp_path / "b3"), "--low-memory", "--per-norm-centering")
    assert_one_line_error(code, err, 2, "--per-norm-centering needs the whole model in memory")
    assert not (tmp_path / "b3").exists()


# ------------------------------------------------------------------------------------ issue 32 §4
def test_usage_errors_exit_2(tmp_path):
    """A missing required recipe setting, an unknown recipe, and an option that would do nothing are
    command-line errors (exit 2, the documented table), each said in one line, before anything runs."""
    data = tmp_path / "corpus.txt"
    data.write_text("hello world\n")
    cases = [
        (["finetune", "distill-masked-lm"], ["model.source", "is required", "model.source="]),
        (["finetune", "distill-masked-lm", f"data.path={data}"], ["model.source", "is required"]),
        (["finetune", "distill-causal-lm", "model.source=tiny-gpt2"], ["data.path", "is required"]),
        (["finetune", "no-such-recipe"], ["not a built-in recipe", "--list"]),
        (["convert", "tiny-gpt2", "--out", str(tmp_path / "o"), "--no-bias-slots"],
         ["--no-bias-slots", "--fold-gamma"]),
        (["convert", "tiny-gpt2", "--out", str(tmp_path / "o"), "--online-hadamard"], ["--rotate"]),
    ]
    for args, fragments in cases:
        code, _, err, secs = run(*args)
        assert_one_line_error(code, err, 2, *fragments)
        assert "must be a string, got None" not in err and secs < 10, (args, secs)
    assert listing(tmp_path) == ["corpus.txt"]


def test_convert_with_the_output_as_a_second_argument_names_the_option(tmp_path):
    """Fails without the hint: ``normswap convert MODEL OUT`` (as ``cp`` takes it) got click's bare
    "Missing option '--out'"; now the message gives the command to type. Nothing is written."""
    out = str(tmp_path / "rms")
    for args in (["tiny-gpt2", out], ["tiny-gpt2", "--format", "compat", out],
                 ["--format", "compat", "tiny-gpt2", out]):
        code, _, err, _ = run("convert", *args)
        assert code == 2, err
        assert f"not a second argument: normswap convert tiny-gpt2 --out {out}" in err, err
    code, _, err, _ = run("convert", "tiny-gpt2", "--format", "compat")  # no second argument: click's own line
    assert code == 2 and "Missing option '--out'." in err, err
    assert listing(tmp_path) == []


def test_options_that_would_do_nothing_are_refused_in_python_too():
    from normswap.options import ConvertOptions

    with pytest.raises(normswap.NormswapError, match="bias_slots=False applies with fold_gamma=True"):
        ConvertOptions(bias_slots=False)
    assert not ConvertOptions(bias_slots=False, fold_gamma=True).bias_slots
    opts = ConvertOptions(bias_slots=False, rotate="hadamard")  # rotate folds γ where it turns
    assert opts.folds_gamma and not opts.fold_gamma
    model = presets.build_model("tiny-gpt2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(normswap.NormswapError, match="bias_slots"):
        normswap.patch(model, bias_slots=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_verify_data_that_does_not_exist_is_named_as_data(tmp_path):
    normswap.convert("tiny-gpt2", tmp_path / "g")
    code, _, err, _ = run("verify", "tiny-gpt2", str(tmp_path / "g"), "--data", str(tmp_path / "nope.txt"))
    assert_one_line_error(code, err, 2, f"--data {tmp_path / 'nope.txt'} does not exist")
    assert "calibration" not in err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    code, _, err, _ = run("verify", "tiny-gpt2", str(tmp_path / "g"), "--data", str(empty))
    assert_one_line_error(code, err, 1, "--data", "contains no text")
    assert "calibration" not in err


@pytest.mark.parametrize("preset", ["tiny-bert", "tiny-whisper"])
def test_inspect_fits_100_columns_and_shows_where_beta_goes(preset):
    code, out, err, _ = run("inspect", preset)
    assert code == 0, err
    lines = out.splitlines()
    assert max(len(ln) for ln in lines) <= 100, max(lines, key=len)
    header = next(ln for ln in lines if ln.startswith("norm "))
    assert header.split() == ["norm", "verdict", "convert", "β", "γ", "writers", "readers"]

    plan = normswap.plan(presets.build_model(preset), beta_placement="keep")  # what convert writes, as inspect plans
    for sp in plan.sites:  # every norm and its whole reason are there, β placement in its row
        at = next(i for i, ln in enumerate(lines) if ln.split()[:1] == [sp.name])
        row = (lines[at] if len(lines[at].split()) > 1 else lines[at + 1]).split()  # a long name: own line
        assert row[-6:-4] == [sp.verdict, "yes" if sp.convert else "no"], row
        assert row[-4] == ("fold" if sp.fold_beta else "norm"), row
        # in the command line's spelling (--per-norm-centering), as convert prints it
        assert " ".join(cli_words(sp.reason).split()) in " ".join(out.split())
    assert "per_norm_centering=" not in out
    code, verbose, _, _ = run("inspect", preset, "-v")
    assert max(len(ln) for ln in verbose.splitlines()) <= 100
    assert "writers:" in verbose and "β:" in verbose  # -v keeps the details


def test_compat_summary_says_where_beta_is_kept(tmp_path):
    code, out, err, _ = run("convert", "tiny-gpt2", "--out", str(tmp_path / "c"), "--format", "compat")
    assert code == 0, err
    plan_line = next(ln for ln in out.splitlines() if ln.startswith("plan:"))
    # compat keeps every β by default (beta_placement resolves to "keep" for that format)
    assert "β kept in 4 stock LayerNorm bias(es) (beta_placement='keep')" in plan_line and "RMSNorm" not in plan_line
    code, out, _, _ = run("inspect", str(tmp_path / "c"))
    assert "stock LayerNorm bias(es)" in " ".join(out.split()) and "RMSNorm" not in out
    # a native checkpoint keeps them too (in its RMSNorms); an in-memory patch folds where bf16 allows
    report = normswap.convert("tiny-gpt2", tmp_path / "n")
    assert "β kept in 4 RMSNorm(s) (beta_placement='keep')" in str(report)
    assert "β kept in 2 RMSNorm(s)" in str(normswap.patch(presets.build_model("tiny-gpt2")))


# ------------------------------------------------------------------------------------ issue 39 §6, §7
ARGUMENT_ERRORS = [
    (["--max-shard-size", "banana"], "invalid size 'banana'"),
    (["--seed", "3"], "--seed applies to a rotation"),
    (["--no-bias-slots"], "--no-bias-slots applies with --fold-gamma"),
    (["--fold-gamma", "--beta-placement", "keep"], "--beta-placement keep applies without --fold-gamma"),
    (["--fold-gamma", "--beta-placement", "rounding"], "--beta-placement rounding applies without --fold-gamma"),
    (["--low-memory", "--rotate", "hadamard"], "--rotate needs the whole model in memory; drop --low-memory"),
    (["--low-memory", "--per-norm-centering"], "--per-norm-centering needs the whole model in memory"),
    (["--low-memory", "--writer-centering", "auto"], "--writer-centering auto chooses each writer's centering"),
    (["--writer-centering", "auto", "--rotate", "hadamard"], "--writer-centering auto keeps writers' weights"),
    (["--rotate", "hadamard", "--rotate-output", "restore", "--format", "compat"], "--rotate-output restore adds"),
    (["--rotate", "hadamard", "--online-hadamard", "--format", "compat"], "--online-hadamard adds ops"),
    (["--format", "compat", "--mode", "all"], "--format compat keeps LayerNorms"),
    (["--new-head"], "--new-head adds a task head: name it with --task"),
    (["--calibration-data", "no-such-file.txt"], "--calibration-data no-such-file.txt does not exist"),
]


@pytest.mark.parametrize("args, fragment", ARGUMENT_ERRORS, ids=[" ".join(a) for a, _ in ARGUMENT_ERRORS])
def test_argument_errors_exit_2_without_importing_torch(tmp_path, args, fragment):
    """Conflicting or dependent options and a missing input file are usage errors (exit 2, docs/cli.md's
    table), answered before torch or transformers is imported (as fast as ``--help``)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "normswap", "convert", "tiny-gpt2",
                           "--out", str(tmp_path / "o"), *args], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode == 2, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "transformers", "safetensors"}, sorted(imported & {"torch", "transformers"})
    ours = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert any(fragment in line for line in ours), ours
    assert "Traceback" not in proc.stderr and listing(tmp_path) == []


def test_python_callers_read_python_words_the_cli_reads_flags(tmp_path):
    """The library's messages name keyword arguments (``overwrite=True``); the command line translates
    them to its flags (``--overwrite``): each caller reads the spelling it types."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    model = presets.build_model("tiny-gpt2")
    normswap.patch(model)
    for call in (lambda: normswap.save(model, out), lambda: normswap.convert("tiny-gpt2", out)):
        with pytest.raises(normswap.NormswapError) as info:
            call()
        assert "pass overwrite=True" in str(info.value) and f"out_dir {out}" in str(info.value)
        assert "--" not in str(info.value)
    with pytest.raises(normswap.NormswapError, match="allow_new_head=True adds a task head.*task='sequence"):
        normswap.convert("tiny-bert", tmp_path / "b", allow_new_head=True)
    with pytest.raises(normswap.NormswapError, match="format='native'.*online_hadamard=True"):
        normswap.convert("tiny-gpt2", tmp_path / "g", format="compat", rotate="hadamard", online_hadamard=True)
    code, _, err, _ = run("convert", "tiny-gpt2", "--out", str(out))
    assert_one_line_error(code, err, 2, f"--out {out} exists and is not empty; pass --overwrite")
    assert "out_dir" not in err and "overwrite=True" not in err
    assert (out / "keep.txt").read_text() == "mine"


def test_quiet_prints_errors_only_and_notes_start_their_own_line(tmp_path, monkeypatch):
    """``-q``: no progress, note or warning on stderr (tiny-gpt2 has an untie note, tiny-bert approximate-
    norm warnings); without it they are there. On a terminal a note first clears the progress line
    that is rewritten in place, so it never runs on after "(3 s)"."""
    for args in (("tiny-gpt2", "--rotate", "hadamard"), ("tiny-bert",)):  # notes (untie, rotate); warnings
        code, stdout, err, _ = run("convert", *args, "--out", str(tmp_path / args[0]), "-q")
        assert code == 0 and err == "", err
        assert "wrote native checkpoint" in stdout
    code, _, err, _ = run("convert", "tiny-bert", "--out", str(tmp_path / "loud"))
    assert code == 0 and "warning:" in err, err
    code, _, err, _ = run("convert", "tiny-gpt2", "--rotate", "hadamard", "--out", str(tmp_path / "loud-gpt2"))
    assert code == 0 and "note: untied" in err, err

    from normswap.cli import common

    class Terminal(StringIO):
        def isatty(self) -> bool:
            return True

    term = Terminal()
    term.write("normswap convert tiny-gpt2: step 2/4: analysing (3 s)")  # the progress line, unfinished
    monkeypatch.setattr(common.sys, "stderr", term)
    monkeypatch.setattr(common.click, "echo", lambda text, err=False: term.write(text + "\n"))
    common.say("note", "untied 1 tied weight(s): untie=False keeps the tie")
    assert term.getvalue().endswith("(3 s)\r\033[Knote: untied 1 tied weight(s): --keep-tied keeps the tie\n")
    common.say("warning", "not shown", quiet=True)
    assert "not shown" not in term.getvalue()


def test_a_misspelt_preset_is_answered_at_once_with_the_nearest(tmp_path):
    """``tiny-gpt3`` is no Hub id anyone means: the nearest preset is suggested before torch is imported
    and before any network, by every command that takes a MODEL; Python callers hear the same."""
    for args in (["convert", "tiny-gpt3", "--out", str(tmp_path / "o")], ["inspect", "tiny-brt"],
                 ["verify", "tiny-gpt3", str(tmp_path / "o")]):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "normswap", *args], capture_output=True,
                              text=True, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "0",
                                                            "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        ours = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
        assert proc.returncode == 2 and len(ours) == 1, proc.stderr[-2000:]  # a usage error since round 56
        near = "tiny-bert" if "tiny-brt" in args else "tiny-gpt2"
        assert ours[0].startswith("error: ") and f"did you mean {near}?" in ours[0], ours
        assert not any(line.rstrip().endswith("| torch") for line in proc.stderr.splitlines())
    code, _, err, _ = run("convert", "tiny-foo", "--out", str(tmp_path / "o"))
    assert_one_line_error(code, err, 2, "tiny-foo is not a preset", "presets: tiny-bert")
    assert "did you mean" not in err  # nothing near: the list only
    with pytest.raises(normswap.NormswapError, match="did you mean tiny-gpt2"):
        normswap.convert("tiny-gpt3", tmp_path / "o")
    assert listing(tmp_path) == []


def test_inspect_speaks_flags_like_convert():
    code, stdout, err, _ = run("inspect", "tiny-bert")
    assert code == 0, err
    assert "(--per-norm-centering)" in stdout and "per_norm_centering=" not in stdout


def test_api_convert_refuses_calibration_data_inside_out_dir(tmp_path):
    """Fails without the check in ``normswap.convert``: with ``overwrite=True`` the finished output replaced
    ``out_dir`` and deleted the calibration file read from inside it (the CLI refused it already)."""
    out = tmp_path / "prev"
    out.mkdir()
    cal = out / "cal.txt"
    cal.write_text(presets.CORPUS)
    with pytest.raises(UsageError, match="calibration_data .* lies inside out_dir"):
        normswap.convert("tiny-bert", out, overwrite=True, calibration_data=cal)
    assert cal.read_text() == presets.CORPUS and sorted(p.name for p in out.iterdir()) == ["cal.txt"]
