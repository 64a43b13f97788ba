"""Fine-tune recipes that recover accuracy after approximate (Post-LN) conversion.

The teacher is the original LayerNorm model, frozen; the student is its converted copy (loaded
from a converted directory, or converted on the fly with least-squares-initialised norms). The
student is distilled towards the teacher on local text, with held-out KL / top-1 agreement /
perplexity (LMs) or embedding cosine (encoders) measured before, during and after training.

Entry points::

    normswap finetune recipes/distill-masked-lm.yaml model.source=./bert data.path=corpus.txt
    normswap.recipes.run("recipes/distill-masked-lm.yaml", overrides=["train.steps=200"])

Recipes are YAML files whose keys are the fields of :class:`RecipeConfig` (see ``recipes/*.yaml``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from normswap.recipes.config import RecipeConfig, load_config

if TYPE_CHECKING:
    from normswap.recipes.runner import RunResult

__all__ = ["RecipeConfig", "RunResult", "load_config", "run"]


def run(config_or_path: Any, overrides: list[str] | dict[str, Any] | None = None) -> RunResult:
    """Run a recipe (a YAML path, dict or :class:`RecipeConfig`) with ``key=value`` overrides.

    See :func:`normswap.recipes.runner.run`.
    """
    from normswap.recipes.runner import run as _run

    return _run(config_or_path, overrides)


def __getattr__(name: str) -> Any:
    if name == "RunResult":
        from normswap.recipes.runner import RunResult

        return RunResult
    raise AttributeError(name)
