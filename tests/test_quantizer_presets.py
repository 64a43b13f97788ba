"""``--quantizer ENGINE`` / ``quantizer=``: the options each engine was measured to need, per kind of model, from one
table (:mod:`normswap.quantizers`), which the docs copy.

The kind comes from the analysis (tiny random models: a Pre-LN GPT-2, a DINOv2 with LayerScale, a Post-LN BERT);
``convert --quantizer X`` writes the bytes ``convert`` with the options it stands for writes; an option given
explicitly wins; combinations the engine's options cannot go with are one-line usage errors (exit 2, nothing
written).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import normswap
from normswap import presets, quantizers
from normswap.analysis.plan import Plan
from normswap.checkpoint import hf
from normswap.cli import main
from normswap.errors import NormswapError
from normswap.options import ConvertOptions
from tests.zoo import APPROXIMATE, EXACT, MORE, build

ROOT = Path(__file__).resolve().parents[1]
DEPLOYMENT = (ROOT / "docs" / "deployment.md").read_text()
KIND_COLUMNS = {"Pre-LN": "pre-ln", "Pre-LN with LayerScale": "layer-scale", "Post-LN encoder": "post-ln"}


def run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _docs_engine_table() -> dict[str, dict[str, str]]:
    """The page's engine table: ``--quantizer`` value -> model kind -> the flags it lists ("" for defaults)."""
    lines = DEPLOYMENT.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| `--quantizer` |"))
    header = _cells(lines[start])
    table = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        row = dict(zip(header, _cells(line), strict=True))
        table[row["`--quantizer`"].strip("`")] = {kind: "" if row[col] == "defaults" else row[col].strip("`")
                                                  for col, kind in KIND_COLUMNS.items()}
    return table


def _at_a_glance_rows() -> dict[str, str]:
    """The long "At a glance" table: engine cell -> its "pass to convert" cell."""
    lines = DEPLOYMENT.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| engine / quantizer |"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = _cells(line)
        rows[cells[0]] = cells[1]
    return rows


@pytest.fixture(scope="module")
def models() -> dict[str, object]:
    """One tiny random model of each kind, by the kind the docs table's columns name."""
    return {"pre-ln": build(EXACT, "gpt2"), "layer-scale": build({"dinov2": MORE["dinov2"][0]}, "dinov2"),
            "post-ln": build(APPROXIMATE, "bert")}


@pytest.fixture(scope="module")
def kinds(models) -> dict[str, str]:
    """The kind the analysis finds for each model (from a plan with the defaults, as ``--quantizer`` reads it)."""
    return {name: quantizers.model_kind(normswap.plan(model)) for name, model in models.items()}


def test_the_analysis_finds_each_models_kind(kinds):
    assert kinds == {"pre-ln": "pre-ln", "layer-scale": "layer-scale", "post-ln": "post-ln"}


def test_the_docs_engine_table_is_the_code_table():
    assert quantizers.markdown_table() in DEPLOYMENT


@pytest.mark.parametrize("engine", quantizers.QUANTIZER_NAMES)
def test_each_engine_resolves_on_each_kind_of_model_to_the_options_the_docs_table_lists(engine, kinds):
    docs = _docs_engine_table()[engine]
    defaults = {name: getattr(ConvertOptions(), name) for name in quantizers.FIELDS}
    for model, kind in kinds.items():
        record = quantizers.resolve(engine, kind, defaults, ())
        options = {**({"format": record["format"]} if record["format"] else {}), **record["set"]}
        assert quantizers.flags(options) == docs[model], (engine, model)


def test_every_at_a_glance_row_has_an_engine_whose_flags_it_names():
    rows = _at_a_glance_rows()
    named = {q.row for q in quantizers.QUANTIZERS.values()}
    assert set(rows) <= named, set(rows) - named
    for q in quantizers.QUANTIZERS.values():
        if q.name == "none":
            continue
        assert q.row in rows, q.name
        for kind in quantizers.KINDS:
            for flag in re.findall(r"--[\w-]+(?: (?:op|auto|compat))?", quantizers.flags(q.options_for(kind))):
                assert flag.split()[0] in rows[q.row] and flag.split()[-1] in rows[q.row], (q.name, flag)
        if q.format:
            assert f"--format {q.format}" in rows[q.row], q.name


def test_cli_help_and_docs_name_every_engine():
    code, out, _ = run("convert", "--help")
    assert code == 0
    flat = " ".join(out.split())
    cli_doc = (ROOT / "docs" / "cli.md").read_text()
    for name in quantizers.QUANTIZER_NAMES:
        assert name in flat and f"`{name}`" in cli_doc, name


@pytest.mark.parametrize("engine", ["torchao", "openvino-int8"])
def test_plan_with_a_quantizer_is_the_plan_with_its_options(engine, models, kinds):
    """In memory: ``plan(model, quantizer=X)`` plans what ``plan(model, **options)`` plans for that kind, and
    records what it set."""
    for model_name, model in models.items():
        want = quantizers.get(engine).options_for(kinds[model_name])
        got = normswap.plan(model, quantizer=engine)
        record = got.options.pop("quantizer")
        assert record == {"name": engine, "model": kinds[model_name], "set": want, "kept": {}, "format": None}
        explicit = normswap.plan(model, **want)
        assert json.dumps(got.to_dict(), sort_keys=True, default=str) == \
            json.dumps(explicit.to_dict(), sort_keys=True, default=str), (engine, model_name)


def test_a_post_ln_encoder_converted_for_openvino_int8_is_exact_in_float64(models):
    """The engine's per-norm ops make every BERT norm exact: the float64 outputs agree to rounding (γ/β random)."""
    original = models["post-ln"]
    model = copy.deepcopy(original)
    report = normswap.patch(model, quantizer="openvino-int8")
    assert {s.verdict for s in report.sites} <= {"exact", "exact-with-centering", "exact-with-per-norm-centering"}
    ids = torch.randint(1, 99, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = original(input_ids=ids).logits, model(input_ids=ids).logits
    assert want.dtype == torch.float64 and (got - want).abs().max() <= 1e-10 * want.abs().max()


def test_a_keyword_given_next_to_the_quantizer_wins(models):
    plan = normswap.plan(models["pre-ln"], quantizer="torchao", writer_centering="weights")
    assert plan.options["writer_centering"] == "weights"
    assert plan.options["quantizer"]["set"] == {}
    assert plan.options["quantizer"]["kept"] == {"writer_centering": "weights"}
    bert = normswap.plan(models["post-ln"], quantizer="openvino-int8", mean_carry=True)
    assert (bert.options["per_norm_centering"], bert.options["mean_carry"]) == (True, True)
    assert bert.options["quantizer"]["kept"] == {"mean_carry": True}


def test_library_refusals_are_one_line():
    with pytest.raises(NormswapError, match=r"quantizer must be one of none, onnxruntime-dynamic,.*not 'tensorrt'"):
        ConvertOptions(quantizer="tensorrt")
    with pytest.raises(NormswapError, match="cannot fold its rotation into"):
        ConvertOptions(quantizer="torchao", rotate="hadamard")
    # given next to the engine, the default value is the caller's choice too: the engine's ops are overridden
    ConvertOptions.build(quantizer="torchao", rotate="hadamard", writer_centering="weights")
    with pytest.raises(NormswapError, match="quantizer_overrides must name fields"):
        ConvertOptions(quantizer="torchao", quantizer_overrides=("rotate",))


def _shards(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> Path:
    return presets.save("tiny-gpt2", tmp_path_factory.mktemp("src") / "gpt2")


# engine, preset, the options it stands for on that preset's kind
SAME_BYTES = [
    ("torchao", "tiny-gpt2", ["--writer-centering", "op"]),
    ("openvino-int8", "tiny-bert", ["--per-norm-centering", "--no-mean-carry"]),
    ("ctranslate2", "tiny-gpt2", ["--format", "compat"]),
]


@pytest.mark.parametrize("engine, preset, flags", SAME_BYTES, ids=[e for e, _, _ in SAME_BYTES])
def test_convert_with_a_quantizer_writes_the_bytes_of_convert_with_its_options(tmp_path, engine, preset, flags):
    code, out, err = run("convert", preset, "--out", str(tmp_path / "q"), "--quantizer", engine, "--no-verify")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("quantizer: "))
    assert line.startswith(f"quantizer: {engine} on a ") and " ".join(flags) in line
    code, _, err = run("convert", preset, "--out", str(tmp_path / "x"), *flags, "--no-verify")
    assert code == 0, err
    assert _shards(tmp_path / "q") and _shards(tmp_path / "q") == _shards(tmp_path / "x")
    manifest = json.loads((tmp_path / "q" / "config.json").read_text())[hf.MANIFEST_KEY]
    record = Plan.from_dict(manifest["plan"]).options["quantizer"]
    assert record["name"] == engine and manifest.get("format", "native") == quantizers.format_for(engine, None)
    code, shown, _ = run("inspect", str(tmp_path / "q"))
    assert code == 0 and line in shown.splitlines()


def test_an_option_given_on_the_command_line_wins_and_is_named():
    code, out, err = run("inspect", "tiny-gpt2", "--json", "--quantizer", "torchao", "--writer-centering", "weights")
    assert code == 0, err
    options = json.loads(out)["options"]
    assert options["writer_centering"] == "weights"
    assert options["quantizer"]["kept"] == {"writer_centering": "weights"} and options["quantizer"]["set"] == {}
    code, out, err = run("inspect", "tiny-gpt2", "--quantizer", "onnxruntime-static", "--format", "native")
    assert code == 0, err
    assert "as convert --format native plans it" in out
    assert "quantizer: onnxruntime-static on a Pre-LN model: the defaults; yours kept over the engine's: " \
           "--format native" in out
    assert "normswap.integrations.onnx.quantize_static" in err  # the note: what a native checkpoint costs there
    code, out, _ = run("inspect", "tiny-gpt2", "--quantizer", "onnxruntime-static")
    assert code == 0 and "as convert --format compat plans it" in out
    code, out, err = run("inspect", "tiny-gpt2", "--quantizer", "onnxruntime-int4", "--fold-gamma")
    assert code == 0, err
    assert "note: --fold-gamma with --quantizer onnxruntime-int4: " in err  # what its measurements advise against


@pytest.mark.parametrize("args, message", [
    (["--quantizer", "tensorrt"], "is not one of 'none', 'onnxruntime-dynamic'"),
    (["--quantizer", "torchao", "--rotate", "hadamard"], "--quantizer torchao centers writers by ops"),
    (["--quantizer", "ctranslate2", "--format", "native"], "--quantizer ctranslate2 needs --format compat"),
    (["--quantizer", "ctranslate2", "--mode", "all"], "(--quantizer ctranslate2 writes --format compat)"),
    (["--quantizer", "executorch-dynamic", "--low-memory"], "--quantizer executorch-dynamic sets --writer-centering "
                                                            "auto"),
], ids=["unknown", "rotate", "native", "mode-all", "low-memory"])
def test_what_the_engine_cannot_go_with_is_a_usage_error_and_nothing_is_written(tmp_path, gpt2_dir, args, message):
    out = tmp_path / "out"
    code, stdout, err = run("convert", str(gpt2_dir), "--out", str(out), *args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()


def test_a_streamed_conversion_refuses_an_engine_whose_options_need_the_whole_model(tmp_path):
    src = presets.save("tiny-bert", tmp_path / "bert")
    out = tmp_path / "out"
    code, _, err = run("convert", str(src), "--out", str(out), "--quantizer", "onnxruntime-dynamic", "--low-memory")
    assert code == 2, err
    assert "--quantizer onnxruntime-dynamic sets --per-norm-centering on a Post-LN encoder model" in err
    assert not out.exists()


def test_a_layerscale_model_converted_for_openvino_static_keeps_its_writers_rows(models):
    """Round 64: NNCF static int8 on DINOv2-small measured the defaults at 1.046 (every token 1.051) and the writers
    behind ops at 1.003, so the engine sets ``writer_centering="op"`` on a LayerScale model: every writer keeps the
    original's weight (what NNCF rounds), the conversion stays exact in float64."""
    original = models["layer-scale"]
    model = copy.deepcopy(original)
    report = normswap.patch(model, quantizer="openvino-static")
    assert report.plan.options["writer_centering"] == "op"
    assert report.plan.options["quantizer"]["set"] == {"writer_centering": "op"}
    assert {s.verdict for s in report.sites} <= {"exact", "exact-with-centering"}
    before = dict(original.named_parameters())
    writers = [n for n in before if n.endswith(("attention.output.dense.weight", "mlp.fc2.weight"))]
    assert writers and all(torch.equal(dict(model.named_parameters())[n], before[n]) for n in writers)
    px = torch.randn(2, 3, 28, 28, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        want, got = original(pixel_values=px).logits, model(pixel_values=px).logits
    assert want.dtype == torch.float64 and (got - want).abs().max() <= 1e-10 * want.abs().max()
