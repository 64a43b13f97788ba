"""transformers' Trainer decays no RMSNorm parameter of a converted model, as it decayed no LayerNorm
parameter of the original (issue 15: GPT-2's converted ``ln_1``/``ln_2``/``ln_f`` weights were decayed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import normswap
from normswap.integrations.trainer import decay_parameter_names, norm_parameter_names
from tests.zoo import APPROXIMATE, EXACT, build


def _trainer():
    # imported here, not at module level: ``transformers.trainer`` brings datasets and pandas (~2.5 CPU s),
    # which every xdist worker's collection paid for and only the worker running this file needs
    from transformers import Trainer

    return Trainer


def _layer_norm_params(model) -> set[str]:
    from torch import nn

    return {f"{m}.{p}" for m, mod in model.named_modules() if isinstance(mod, nn.LayerNorm)
            for p, _ in mod.named_parameters(recurse=False)}


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_converted_norms_get_no_weight_decay(name):
    Trainer = _trainer()
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

    _trainer()  # imported, as the module-level import had it: register() then wraps it and fills the list
    trainer.register()
    assert normswap.RMSNorm in pytorch_utils.ALL_LAYERNORM_LAYERS


def _run(code: str, warm=None) -> None:
    """Run ``code`` in a new process: a fresh interpreter, or with ``warm`` a child of the warm fork server
    (torch and transformers' modeling stack imported; neither normswap nor ``transformers.trainer``)."""
    if warm is None:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    else:
        proc = warm.run(code, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


HAND_BUILT = (
    "from torch import nn\n"
    "m = nn.Sequential(nn.Linear(4, 4), normswap.RMSNorm(4))\n"
)


def test_import_normswap_leaves_the_trainer_alone_and_register_sets_the_rule_up(warm_python):
    """``import normswap`` changes nothing of transformers' Trainer (its one import-time hook is the
    ``normswap_*`` config registry); ``register()`` sets the rule up, also before Trainer is imported.

    The first check runs in a truly fresh interpreter: it is about what ``import normswap`` does before
    transformers is imported at all. The second needs only a process where neither normswap nor
    ``transformers.trainer`` was imported (it asserts the latter), which the warm server's child is."""
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
         "assert names == ['0.weight'], names\n", warm_python)


def test_load_sets_the_rule_up(tmp_path, warm_python):
    """A converted checkpoint loaded in a fresh process (``normswap.load`` or ``AutoModel*`` after
    ``import normswap``) gets the rule, as ``patch`` does. Each load in a process of its own where neither
    normswap nor ``transformers.trainer`` was imported: a child of the warm fork server."""
    normswap.convert("tiny-gpt2", tmp_path / "out", verify=False)
    for load in ("normswap.load(d)", "transformers.AutoModelForCausalLM.from_pretrained(d)"):
        _run("import normswap, transformers\n"
             f"d = {str(tmp_path / 'out')!r}\n"
             f"m = {load}\n"
             "from normswap.integrations.trainer import norm_parameter_names\n"
             "from transformers import Trainer\n"
             "norms = norm_parameter_names(m)\n"
             "assert norms and not norms & set(Trainer.get_decay_parameter_names(None, m))\n", warm_python)
