"""``normswap finetune RECIPE.yaml [key=value ...]``: recover accuracy after approximate conversion."""

from __future__ import annotations

import sys

import click

from normswap.cli import main
from normswap.errors import NormswapError

EXAMPLE = """\b
Examples:
  normswap finetune distill-masked-lm model.source=./bert-base data.path=corpus.txt
  normswap finetune distill-causal-lm model.source=./opt-350m data.path=wiki.jsonl \\
      data.field=text train.steps=2000 train.lr=5e-5 output.dir=runs/opt350m
  normswap finetune distill-encoder checkpoint.resume=true      # continue a run
  accelerate launch --config_file normswap/recipes/configs/accelerate/ddp.yaml -m normswap.recipes RECIPE.yaml

\b
Overrides are dotted keys (nested sections) with YAML values, e.g. train.lr=3e-4
progressive.enabled=true 'progressive.order=["*.attention.output.LayerNorm"]'.
Every key is documented in the recipe files under recipes/."""


@main.command("finetune", epilog=EXAMPLE)
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--print-config", is_flag=True, help="Print the resolved recipe (after overrides) and exit.")
def finetune(recipe: str, overrides: tuple[str, ...], print_config: bool) -> None:
    """Distil a converted (student) model towards its original (teacher) with a YAML RECIPE.

    The final model is written to OUTPUT.DIR/model in the same format as `normswap convert`,
    with the recipe and the held-out metrics before and after training in its manifest.
    """
    try:
        from normswap.recipes.config import load_config

        cfg = load_config(recipe, list(overrides), check_paths=not print_config)
        if print_config:
            click.echo(cfg.to_yaml(), nl=False)
            return
        from normswap.recipes import run

        result = run(cfg)
    except NormswapError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    if result.stopped_early:
        click.echo(
            f"stopped after step {result.steps} (checkpoint.stop_after); resume with checkpoint.resume=true"
        )
    else:
        click.echo(
            f"done: {result.steps} steps, {result.tokens:,} tokens, {result.train_time_s:.1f} s; "
            f"model in {result.model_dir}"
        )
