"""``normswap.save`` of a ``torch.compile``'d model writes the model inside it, and what it writes loads back equal.

``torch.compile(model)`` wraps the model in an ``OptimizedModule`` whose state-dict keys carry an
``_orig_mod.`` prefix and whose class no loader knows. ``patch`` converts the model inside it; ``save``
must write that same model (its keys, its class), and every directory ``save`` writes is read back
and compared with the model before it is moved into place: one line and nothing written otherwise.
``backend="eager"`` keeps the compile instant on CPU (the wrapper is the same ``OptimizedModule``).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors import safe_open

import normswap
from normswap.checkpoint import writer
from normswap.errors import NormswapError
from normswap.integrations import wrappers
from tests.custom_models import TinyGPT, randomise_layer_norms, tiny_gpt2_config


def _gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    randomise_layer_norms(model)
    return model.eval()


def _keys(out) -> set[str]:
    keys: set[str] = set()
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            keys |= set(h.keys())
    return keys


def test_a_compiled_transformers_model_is_saved_as_the_model_inside(tmp_path):
    model = _gpt2()
    compiled = torch.compile(model, backend="eager")
    normswap.patch(compiled)
    ids = torch.randint(0, 99, (2, 11), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = model(ids).logits
        # compiled, auto picks F.rms_norm (what inductor fuses), eager the C++ kernel: float32 rounding apart
        torch.testing.assert_close(compiled(ids).logits, expected, rtol=1e-5, atol=1e-5)

    out = normswap.save(compiled, tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["NormswapGPT2LMHeadModel"]
    assert not [k for k in _keys(out) if k.startswith("_orig_mod")]
    with torch.no_grad():
        assert torch.equal(normswap.load(out)(ids).logits, expected)
        auto = transformers.AutoModelForCausalLM.from_pretrained(out)  # `import normswap` registered the type
        assert torch.equal(auto.eval()(ids).logits, expected)

    compat = normswap.save(compiled, tmp_path / "compat", format="compat")
    stock = transformers.GPT2LMHeadModel.from_pretrained(compat).eval()  # plain transformers, stock LayerNorms
    with torch.no_grad():
        torch.testing.assert_close(stock(ids).logits, expected, rtol=1e-5, atol=1e-5)


def test_a_compiled_custom_module_saves_and_loads_into_a_fresh_instance(tmp_path):
    torch.manual_seed(1)
    net = TinyGPT().eval()
    randomise_layer_norms(net)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(net, backend="eager")
    normswap.patch(compiled, example_inputs=(ids,))
    out = normswap.save(compiled, tmp_path / "net")
    assert not [k for k in _keys(out) if k.startswith("_orig_mod")]
    manifest = json.loads((out / "normswap.json").read_text())
    assert manifest["class"].endswith("TinyGPT")
    probe = torch.randint(0, 50, (3, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = net(probe)
        fresh = normswap.load(out, model=TinyGPT())
        assert torch.equal(fresh(probe), expected)
        into_compiled = normswap.load(out, model=torch.compile(TinyGPT(), backend="eager"))
        # compiled, auto picks F.rms_norm (what inductor fuses), eager the C++ kernel: float32 rounding apart
        torch.testing.assert_close(into_compiled(probe), expected, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_that_would_not_load_back_is_not_written(tmp_path, monkeypatch):
    # the safety net under the unwrapping: were the wrapper written as it is (the old behaviour),
    # the read-back refuses it in one line and leaves nothing behind
    model = _gpt2()
    compiled = torch.compile(model, backend="eager")
    normswap.patch(compiled)
    monkeypatch.setattr(wrappers, "held_module", lambda m: m)
    monkeypatch.setattr(writer, "stock_class", lambda m: type(m))
    with pytest.raises(NormswapError, match="OptimizedModule.*nothing was written") as err:
        normswap.save(compiled, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert not list(tmp_path.iterdir())


def test_a_checkpoint_whose_files_differ_from_the_model_is_not_written(tmp_path, monkeypatch):
    model = _gpt2()
    normswap.patch(model)
    real = writer.state_dict_for_save

    def with_a_stray_key(m):
        state = dict(real(m))
        state["_orig_mod.extra"] = torch.zeros(2)
        return state

    saving = transformers.GPT2LMHeadModel.save_pretrained

    def save_pretrained(self, out, **kwargs):
        kwargs["state_dict"] = with_a_stray_key(self)
        return saving(self, out, **kwargs)

    monkeypatch.setattr(transformers.GPT2LMHeadModel, "save_pretrained", save_pretrained)
    with pytest.raises(NormswapError, match=r"would not load back equal \(the files hold `_orig_mod.extra`"):
        normswap.save(model, tmp_path / "out")
    assert not list(tmp_path.iterdir())


def test_a_model_inside_data_parallel_is_saved_as_the_model(tmp_path):
    model = _gpt2()
    normswap.patch(model)
    wrapped = torch.nn.DataParallel(model)  # on a CPU-only machine it just holds the model as `module`
    assert next(iter(wrapped.state_dict())).startswith("module.")
    out = normswap.save(wrapped, tmp_path / "out")
    assert not [k for k in _keys(out) if k.startswith("module.")]
    ids = torch.randint(0, 99, (1, 9))
    with torch.no_grad():
        assert torch.equal(normswap.load(out)(ids).logits, model(ids).logits)
