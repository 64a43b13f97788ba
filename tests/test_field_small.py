"""Small things users meet first: figures that look like 1 but are not, a recipe's ``model.source`` given as
a preset name, the finetune summary under a distributed launch."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from normswap.surgery import calibrate
from normswap.surgery.verify import figure


@pytest.mark.parametrize(
    ("value", "digits", "expected"),
    [
        (0.999997, 4, "0.999997"),  # .4g would print 1
        (0.9999996, 3, "0.9999996"),
        (1.0, 4, "1"),  # an exact 1 stays 1
        (0.98765, 4, "0.9877"),  # nothing to add when the digits already say it is not 1
        (2.9999999, 4, "2.9999999"),
        (3.2e-05, 3, "3.2e-05"),
        (0.0, 3, "0"),
    ],
)
def test_a_figure_short_of_a_whole_number_keeps_the_digits_that_show_it(value, digits, expected):
    assert figure(value, digits) == expected


def test_the_calibration_summary_does_not_round_an_approximate_cosine_to_1():
    result = calibrate.CalibrationResult("built-in", "least squares", 4, 2,
                                         figures={"cosine": 0.999997, "top1_neighbour_agreement": 1.0})
    line = result.summary()
    assert "cosine=0.999997" in line and "top1_neighbour_agreement=1" in line, line


def test_the_convert_summary_figures_keep_their_digits():
    from normswap.cli.common import figures_line

    line = figures_line({"top1_agreement": 0.99999, "max_rel_error": 0.0123456, "kl": -1e-12})
    assert "top1_agreement=0.99999" in line and "max_rel_error=0.0123" in line and "kl=0" in line, line


# ---------------------------------------------------------------------------------- recipes
def _corpus(tmp_path):
    from normswap.recipes import toy

    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(toy.grammar_corpus(40)))
    return path


def test_a_recipe_takes_a_preset_name_as_model_source(tmp_path):
    """``normswap convert tiny-bert`` works, so ``model.source=tiny-bert`` must too (it was refused
    as a missing directory); the teacher and tokenizer are the preset's."""
    from normswap import presets
    from normswap.recipes import models
    from normswap.recipes.config import builtin_recipes, load_config

    cfg = load_config(builtin_recipes()["distill-masked-lm"],
                      ["model.source=tiny-bert", f"data.path={_corpus(tmp_path)}"])
    assert cfg.model.source == "tiny-bert"  # recorded as given, not as a temporary path
    teacher = models.load_teacher(cfg.model, cfg.task)
    reference, _ = presets.build("tiny-bert")
    assert type(teacher).__name__ == type(reference).__name__
    ta, tb = teacher.state_dict(), reference.state_dict()
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert models.load_tokenizer(cfg.model)("hello world")["input_ids"]
    # a name that is neither a directory nor a preset is still refused, naming the presets
    from normswap.errors import NormswapError

    with pytest.raises(NormswapError, match="tiny-bert"):
        load_config(builtin_recipes()["distill-masked-lm"],
                    ["model.source=tiny-bret", f"data.path={_corpus(tmp_path)}"])


@pytest.mark.parametrize("main", [True, False])
def test_finetune_reports_on_the_main_process_only(monkeypatch, tmp_path, main):
    """Under torchrun every process returns from the run; the others have no model directory and
    printed "model in None"."""
    import normswap.recipes
    from normswap.cli import main as cli
    from normswap.recipes.runner import RunResult

    result = RunResult(output_dir=str(tmp_path), model_dir=str(tmp_path / "model") if main else None,
                       metrics_before={}, metrics_after={}, steps=3, tokens=96, train_time_s=0.1,
                       wall_time_s=0.2, main_process=main)
    monkeypatch.setattr(normswap.recipes, "run", lambda cfg: result)
    res = CliRunner().invoke(cli, ["finetune", "distill-masked-lm", "model.source=tiny-bert",
                                   f"data.path={_corpus(tmp_path)}", f"output.dir={tmp_path / 'o'}"],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.output
    if main:
        assert f"model in {tmp_path / 'model'}" in res.stdout
    else:
        assert res.stdout == ""
