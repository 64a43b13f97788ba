"""``normswap finetune RECIPE [key=value ...]``: recover accuracy after approximate conversion."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import click

from normswap.cli import main
from normswap.cli.common import EXIT_CODES, handle_errors
from normswap.errors import NormswapError, UsageError

EXAMPLE = f"""\b
Examples:
  normswap finetune --list                                      # the built-in recipes
  normswap finetune distill-masked-lm model.source=./bert-base data.path=corpus.txt
  normswap finetune distill-causal-lm model.source=./opt-350m data.path=wiki.jsonl \\
      data.field=text train.steps=2000 train.lr=5e-5 output.dir=runs/opt350m
  normswap finetune ./my-recipe.yaml checkpoint.resume=true    # a recipe file; continue a run
  accelerate launch --config_file recipes/accelerate/ddp.yaml -m normswap.recipes RECIPE.yaml

\b
RECIPE is a built-in recipe name (see --list) or a YAML file. Overrides are dotted keys
(nested sections) with YAML values, e.g. train.lr=3e-4 progressive.enabled=true
'progressive.order=["*.attention.output.LayerNorm"]'. A bad override exits with 2.
Print a recipe with every key and its default: normswap finetune NAME --print-config

{EXIT_CODES}"""


def _list_recipes() -> None:
    from normswap.recipes.config import builtin_recipes, recipe_summary

    recipes = builtin_recipes()
    width = max((len(n) for n in recipes), default=0)
    for name, path in recipes.items():
        click.echo(f"{name:{width}}  {recipe_summary(path)}")


def _check_overrides(overrides: tuple[str, ...]) -> list[str]:
    """Every ``key=value`` against the recipe schema first (exit 2); returns the dotted keys."""
    from normswap.recipes.config import check_override

    keys = []
    for text in overrides:
        try:
            keys.append(check_override(text))
        except NormswapError as exc:
            raise UsageError(str(exc)) from exc
    return keys


def _remove_if_empty(out: Path) -> None:
    """A failed run must not leave an empty output directory behind (files are kept: a resumable
    checkpoint is worth more than tidiness)."""
    if out.is_dir() and not any(p.is_file() for p in out.rglob("*")):
        shutil.rmtree(out, ignore_errors=True)


@main.command("finetune", epilog=EXAMPLE)
@click.argument("recipe", required=False)
@click.argument("overrides", nargs=-1)
@click.option("--list", "list_", is_flag=True, help="List the built-in recipes and exit.")
@click.option("--print-config", is_flag=True, help="Print the resolved recipe (after overrides) and exit.")
@handle_errors
def finetune(recipe: str | None, overrides: tuple[str, ...], list_: bool, print_config: bool) -> None:
    """Distil a converted (student) model towards its original (teacher) with a RECIPE.

    The final model is written to OUTPUT.DIR/model in the same format as `normswap convert`,
    with the recipe and the held-out metrics before and after training in its manifest.
    """
    if list_:
        _list_recipes()
        return
    if recipe is None:
        raise UsageError("missing RECIPE: a built-in recipe name or a YAML file (see `normswap finetune --list`)")
    from normswap.recipes.processes import shown_by_main

    try:
        keys = _check_overrides(overrides)
        from normswap.recipes.config import load_config

        try:
            cfg = load_config(recipe, list(overrides), check_paths=not print_config)
        except NormswapError as exc:
            # a bad override value or key is a command-line error (2); a bad recipe file is not
            if any(f"`{k}" in str(exc) for k in keys):
                raise UsageError(str(exc)) from exc
            raise
    except NormswapError as exc:  # every process of a distributed launch reads the same recipe
        shown_by_main(exc)
        raise
    if print_config:
        click.echo(cfg.to_yaml(mark_required=True), nl=False)
        return
    if os.environ.get("WORLD_SIZE", "1") == "1":
        # output.dir against what is on disk (exit 2), before the run's heavy imports; under a launcher the
        # main process alone checks it, in the run, before any process writes (the others would race it)
        from normswap.recipes.outdir import check_output

        check_output(cfg)
    from normswap.recipes import run

    out = Path(cfg.output.dir)
    existed = out.exists()
    try:
        result = run(cfg)
    except BaseException:
        if not existed:
            _remove_if_empty(out)
        raise
    if not result.main_process:  # under torchrun / accelerate launch: the main process reports
        return
    if result.stopped_early:
        click.echo(
            f"stopped after step {result.steps} (checkpoint.stop_after); resume with checkpoint.resume=true"
        )
    else:
        click.echo(
            f"done: {result.steps} steps, {result.tokens:,} tokens, {result.train_time_s:.1f} s; "
            f"model in {result.model_dir}"
        )
