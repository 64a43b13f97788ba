"""Recipe configs: typed parsing, dotted overrides, one-line errors naming the key, CLI behaviour."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from normswap import NormswapError
from normswap.cli import main
from normswap.recipes.config import RecipeConfig, load_config, parse_override

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _keys(cls: type, prefix: str = "") -> set[str]:
    out = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        out.add(key)
        if dataclasses.is_dataclass(hints[f.name]):
            out |= _keys(hints[f.name], key + ".")
    return out


def _yaml_keys(data: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in data.items():
        out.add(prefix + k)
        if isinstance(v, dict):
            out |= _yaml_keys(v, f"{prefix}{k}.")
    return out


@pytest.mark.parametrize(
    "name", ["distill-causal-lm", "distill-masked-lm", "distill-encoder", "finetune-causal-lm"]
)
def test_shipped_recipes_spell_out_and_document_every_key(name, tmp_path):
    path = RECIPES / f"{name}.yaml"
    text = path.read_text()
    assert _yaml_keys(yaml.safe_load(text)) == _keys(RecipeConfig)
    for line in text.splitlines():  # every key line carries a comment (or opens a commented section)
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and ":" in stripped:
            assert "#" in line or stripped.endswith(":"), line
    (tmp_path / "d.txt").write_text("x\n")
    cfg = load_config(path, [f"model.source={tmp_path}", f"data.path={tmp_path / 'd.txt'}"])
    assert cfg.task in ("causal-lm", "masked-lm", "encoder")


def test_overrides_are_typed_and_nested(tmp_path):
    (tmp_path / "d.txt").write_text("x\n")
    cfg = load_config(
        {"model": {"source": str(tmp_path)}, "data": {"path": str(tmp_path / "d.txt")}},
        [
            "train.lr=3e-4",
            "train.steps=20",
            "progressive.enabled=true",
            "convert.mode=exact",
            'progressive.order=["*.output.LayerNorm", "cls.*"]',
            "train.max_grad_norm=null",
            "train.lora.target_modules=[query,value]",
            "train.mixed_precision=no",
            "data.eval_batches=2",
        ],
    )
    assert cfg.train.lr == 3e-4 and isinstance(cfg.train.lr, float)
    assert cfg.train.steps == 20 and cfg.progressive.enabled is True
    assert cfg.progressive.order == ["*.output.LayerNorm", "cls.*"]
    assert cfg.train.max_grad_norm is None
    assert cfg.train.lora.target_modules == ["query", "value"]
    assert cfg.train.mixed_precision == "no"  # YAML reads `no` as false; the key's type says otherwise
    assert parse_override("a.b=1e-4") == (["a", "b"], "1e-4")


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["train.learning_rate=1e-4"], "`train.learning_rate`"),
        (["trian.lr=1"], "`trian`"),
        (["train.steps=many"], "`train.steps`"),
        (["train.lr=fast"], "`train.lr`"),
        (["train.trainable=some"], "`train.trainable`"),
        (["data.path=/nonexistent/corpus.txt"], "`data.path`"),
        (["model.source=/nonexistent/model"], "`model.source`"),
        (["train.steps=0"], "`train.steps`"),
        (["data.eval_fraction=1.5"], "`data.eval_fraction`"),
        (["progressive.enabled=true"], "`convert.mode`"),
        (["teacher.enabled=false"], "`loss.kl_weight`"),
        (["train.lr"], "key=value"),
        (["train=3"], "`train`"),
        (["task=classification"], "`task` must be one of causal-lm, masked-lm, encoder"),
        (["task=encoder", "eval.metric=kl"], "`eval.metric` must be one of cosine"),
        (["task=causal-lm", "loss.positions=masked"], "`loss.positions`"),
    ],
)
def test_bad_configs_raise_one_line_errors_naming_the_key(tmp_path, overrides, key):
    (tmp_path / "d.txt").write_text("x\n")
    base = {"model": {"source": str(tmp_path)}, "data": {"path": str(tmp_path / "d.txt")}}
    with pytest.raises(NormswapError) as info:
        load_config(base, overrides)
    message = str(info.value)
    assert key in message and "\n" not in message


def test_cli_reports_errors_as_one_line_and_exits_nonzero(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"task: masked-lm\nmodel:\n  source: {tmp_path}\ndata:\n  path: {tmp_path}/missing.txt\n"
    )
    runner = CliRunner()
    result = runner.invoke(main, ["finetune", str(recipe)])
    assert result.exit_code != 0
    assert result.output.strip().splitlines() == [result.output.strip()]
    assert result.output.startswith("error: ") and "`data.path`" in result.output

    result = runner.invoke(main, ["finetune", str(recipe), "train.warmup=3"])
    assert result.exit_code == 2 and "error: unknown config key `train.warmup`" in result.output  # a usage error

    result = runner.invoke(main, ["finetune", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2 and "does not exist" in result.output  # a path naming nothing: usage (round 56)

    recipe.write_text("task: [unclosed\n")
    result = runner.invoke(main, ["finetune", str(recipe)])
    assert result.exit_code == 1 and "not valid YAML" in result.output


def test_cli_print_config_resolves_overrides(tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "finetune",
            str(RECIPES / "distill-masked-lm.yaml"),
            "--print-config",
            "model.source=x",
            "data.path=y",
            "train.lr=1e-3",
        ],
    )
    assert result.exit_code == 0, result.output
    printed = yaml.safe_load(result.output)
    assert printed["train"]["lr"] == 1e-3 and printed["model"]["source"] == "x"


def test_print_config_needs_no_model_or_data_and_marks_them_required():
    """``--print-config`` prints the recipe with every default before the user has a model or data: the
    required keys read null with a ``# REQUIRED`` note (still valid YAML), nothing else is demanded."""
    from normswap.recipes.config import RecipeConfig

    for name in ("distill-masked-lm", "distill-causal-lm", "distill-encoder", "finetune-causal-lm"):
        result = CliRunner().invoke(main, ["finetune", name, "--print-config"])
        assert result.exit_code == 0, result.output
        marked = [line for line in result.output.splitlines() if "# REQUIRED" in line]
        assert [line.split(":")[0].strip() for line in marked] == ["source", "path"], marked
        assert "pass model.source=DIR" in marked[0] and "pass data.path=FILE" in marked[1]
        printed = yaml.safe_load(result.output)
        assert printed["model"]["source"] is None and printed["data"]["path"] is None
        assert printed.keys() == RecipeConfig().to_dict().keys()  # every section, defaults included
    # a key the user set is printed as set, unmarked; running without them is still refused (exit 2)
    result = CliRunner().invoke(main, ["finetune", "distill-masked-lm", "--print-config", "data.path=d.txt"])
    assert result.exit_code == 0 and "# REQUIRED" in result.output and "path: d.txt\n" in result.output
    result = CliRunner().invoke(main, ["finetune", "distill-masked-lm"])
    assert result.exit_code == 2 and "model.source` is required" in result.output


def test_help_has_an_example():
    result = CliRunner().invoke(main, ["finetune", "--help"])
    assert result.exit_code == 0 and "normswap finetune distill-masked-lm" in result.output


def test_the_recipes_are_found_by_name_in_the_source_checkout():
    """Run from a checkout (editable install or PYTHONPATH), the recipes come from the top-level recipes/:
    the same files ``tests/test_cli.py`` finds inside the built wheel."""
    from normswap.recipes.config import builtin_recipes, builtin_recipes_dir

    assert builtin_recipes_dir() == RECIPES
    names = set(builtin_recipes())
    assert names == {p.stem for p in RECIPES.glob("*.yaml")} >= {"distill-encoder", "distill-masked-lm"}
