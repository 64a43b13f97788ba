"""Other libraries' bars and warnings stay out of normswap's output, and the caller's settings come back.

transformers' "Loading weights" / "Writing model shards" bars and accelerate's "[RANK 0] Removed shared
tensor" warning are switched off with each library's own switch while normswap works, and switched
back to what they were afterwards.
"""

from __future__ import annotations

import logging

import torch
from huggingface_hub import utils as hub_utils
from transformers.utils import logging as hf_logging

import normswap
from normswap.integrations.quiet import quiet_libraries


def _removed_shared_tensor() -> None:
    """What accelerate's ``save_state`` does with tied weights: drop the alias and warn."""
    from accelerate import PartialState
    from accelerate.utils.other import clean_state_dict_for_safetensors

    PartialState()  # accelerate's loggers need its state
    shared = torch.zeros(4)
    clean_state_dict_for_safetensors({"wte.weight": shared, "lm_head.weight": shared})


def test_switches_are_off_inside_and_restored_after(caplog):
    accelerate_logger = logging.getLogger("accelerate.utils.other")
    for bars_on in (True, False):
        (hf_logging.enable_progress_bar if bars_on else hf_logging.disable_progress_bar)()
        accelerate_logger.setLevel(logging.INFO)
        try:
            with quiet_libraries():
                assert not hf_logging.is_progress_bar_enabled() and hub_utils.are_progress_bars_disabled()
                assert not accelerate_logger.isEnabledFor(logging.WARNING)
                caplog.clear()
                _removed_shared_tensor()
                assert "Removed shared tensor" not in caplog.text
            assert hf_logging.is_progress_bar_enabled() is bars_on
            assert hub_utils.are_progress_bars_disabled() is not bars_on
            assert accelerate_logger.level == logging.INFO
            caplog.clear()
            _removed_shared_tensor()  # outside: the library speaks again (so the check above can fail)
            assert "Removed shared tensor" in caplog.text
        finally:
            hf_logging.enable_progress_bar()
            accelerate_logger.setLevel(logging.NOTSET)


def test_convert_progress_has_no_library_bars(tmp_path, capfd):
    hf_logging.enable_progress_bar()
    normswap.convert("tiny-gpt2", tmp_path / "o", progress=True)
    err = capfd.readouterr().err
    assert "normswap convert tiny-gpt2" in err  # normswap's own progress
    assert "Writing model shards" not in err and "Loading weights" not in err, err
    assert hf_logging.is_progress_bar_enabled()  # the caller's setting is back
    normswap.save(normswap.load(tmp_path / "o"), tmp_path / "saved")
    assert "Writing model shards" not in capfd.readouterr().err
