"""``python -m normswap.recipes RECIPE.yaml [key=value ...]``: the same as ``normswap finetune``.

Handy under ``accelerate launch -m normswap.recipes RECIPE.yaml ...`` (multi-GPU / multi-node). Its errors are
``normswap finetune``'s: a usage mistake is one ``error:`` line, exit 2 (:func:`normswap.cli.run_command`).
"""

from normswap.cli import run_command
from normswap.cli.finetune_cmd import finetune

if __name__ == "__main__":
    run_command(finetune, "python -m normswap.recipes")
