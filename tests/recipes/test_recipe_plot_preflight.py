"""A recipe's plot needs matplotlib: the preflight finds it missing before training, not after.

``log.plot`` draws ``curves.png`` once training is done. Without matplotlib that used to be found only
then; now :func:`normswap.recipes.preflight.check_settings` imports it first: the recipe's default adapts
(no plot, said in one line), a ``log.plot=true`` the user chose is refused (exit 2) before any work.
The missing package is simulated by making ``import matplotlib`` fail (``sys.modules`` entry None).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from normswap.cli import main
from normswap.recipes import models, preflight
from normswap.recipes.config import load_config

CPU = torch.device("cpu")


@pytest.fixture()
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(f"line {i} of a small corpus about foxes and dogs" for i in range(200)) + "\n")
    return path


@pytest.fixture()
def no_matplotlib(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError


def _check(cfg) -> list[str]:
    said: list[str] = []
    preflight.check_settings(cfg, models.load_tokenizer(cfg.model), CPU, said.append)
    return said


def test_the_default_plot_adapts_and_says_so(corpus, no_matplotlib):
    cfg = load_config("distill-causal-lm", ["model.source=tiny-gpt2", f"data.path={corpus}"])
    assert cfg.log.plot and cfg.is_default("log.plot")
    said = _check(cfg)
    assert cfg.log.plot is False
    assert [s for s in said if s.startswith("log.plot: matplotlib cannot be imported")], said


def test_a_chosen_plot_is_refused_before_training(corpus, no_matplotlib, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["finetune", "distill-causal-lm", "model.source=tiny-gpt2",
                                       f"data.path={corpus}", "log.plot=true", f"output.dir={out}",
                                       "train.steps=1"])
    assert result.exit_code == 2, result.output
    errors = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "`log.plot`" in errors[0] and "matplotlib" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_with_matplotlib_nothing_changes(corpus):
    pytest.importorskip("matplotlib")
    cfg = load_config("distill-causal-lm", ["model.source=tiny-gpt2", f"data.path={corpus}", "log.plot=true"])
    said = _check(cfg)
    assert cfg.log.plot is True and not [s for s in said if s.startswith("log.plot")]
