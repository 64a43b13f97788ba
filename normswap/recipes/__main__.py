"""``python -m normswap.recipes RECIPE.yaml [key=value ...]``: the same as ``normswap finetune``.

Handy under ``accelerate launch -m normswap.recipes RECIPE.yaml ...`` (multi-GPU / multi-node).
"""

from normswap.cli.finetune_cmd import finetune

if __name__ == "__main__":
    finetune(prog_name="python -m normswap.recipes")
