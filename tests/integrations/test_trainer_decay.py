"""transformers' Trainer decays no RMSNorm parameter of a converted model, as it decayed no LayerNorm
parameter of the original (issue 15: GPT-2's converted ``ln_1``/``ln_2``/``ln_f`` weights were decayed)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from transformers import Trainer

import normswap
from normswap.integrations.trainer import decay_parameter_names, norm_parameter_names
from tests.zoo import APPROXIMATE, EXACT, build


def _layer_norm_params(model) -> set[str]:
    from torch import nn

    return {f"{m}.{p}" for m, mod in model.named_modules() if isinstance(mod, nn.LayerNorm)
            for p, _ in mod.named_parameters(recurse=False)}


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_converted_norms_get_no_weight_decay(name):
    table = APPROXIMATE if name == "bert" else EXACT
    model = build(table, name)
    original_norms = _layer_norm_params(model)
    original_decay = set(Trainer.get_decay_parameter_names(None, model))
    assert original_norms and not original_norms & original_decay  # the rule we want to keep
    normswap.patch(model, mode="all", calibration=False)
    norms = norm_parameter_names(model)
    assert norms, "no RMSNorm parameters found"
    decay = set(Trainer.get_decay_parameter_names(None, model))
    assert not norms & decay, sorted(norms & decay)
    assert decay == set(decay_parameter_names(model))
    # Nothing else changed: the decayed set is the original's minus parameters folded away or added.
    assert decay <= {n for n, _ in model.named_parameters(remove_duplicate=False)}  # a tie kept: both names
    assert {n for n in original_decay if n in dict(model.named_parameters())} <= decay | norms


def test_rmsnorm_registered_as_layer_norm_class():
    from transformers import pytorch_utils

    from normswap.integrations import trainer

    trainer.register()
    assert normswap.RMSNorm in pytorch_utils.ALL_LAYERNORM_LAYERS


def _run(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


HAND_BUILT = (
    "from torch import nn\n"
    "m = nn.Sequential(nn.Linear(4, 4), normswap.RMSNorm(4))\n"
)


def test_import_normswap_leaves_the_trainer_alone_and_register_sets_the_rule_up():
    """``import normswap`` changes nothing of transformers' Trainer (its one import-time hook is the
    ``normswap_*`` config registry); ``register()`` sets the rule up, also before Trainer is imported."""
    _run("import sys, normswap\n" + HAND_BUILT +
         "from transformers import Trainer\n"
         "assert not hasattr(Trainer.get_decay_parameter_names, '__wrapped__')\n"
         "assert Trainer.get_decay_parameter_names(None, m) == ['0.weight', '1.weight']\n")
    _run("import sys, normswap\n"
         "from normswap.integrations import trainer\n"
         "trainer.register()\n"
         "assert 'transformers.trainer' not in sys.modules\n" + HAND_BUILT +
         "from transformers import Trainer\n"
         "names = Trainer.get_decay_parameter_names(None, m)\n"
         "assert names == ['0.weight'], names\n")


def test_load_sets_the_rule_up(tmp_path):
    """A converted checkpoint loaded in a fresh process (``normswap.load`` or ``AutoModel*`` after
    ``import normswap``) gets the rule, as ``patch`` does."""
    normswap.convert("tiny-gpt2", tmp_path / "out", verify=False)
    for load in ("normswap.load(d)", "transformers.AutoModelForCausalLM.from_pretrained(d)"):
        _run("import normswap, transformers\n"
             f"d = {str(tmp_path / 'out')!r}\n"
             f"m = {load}\n"
             "from normswap.integrations.trainer import norm_parameter_names\n"
             "from transformers import Trainer\n"
             "norms = norm_parameter_names(m)\n"
             "assert norms and not norms & set(Trainer.get_decay_parameter_names(None, m))\n")
