"""``normswap.patch`` / ``normswap.plan`` on objects that wrap a model: a sentence-transformers pipeline
(the transformers model inside is converted in place with the pipeline's tokenizer, the pipeline keeps
working and saves/loads back through sentence-transformers) and a ``torch.compile``'d module (the module
inside is converted; the compiled object recompiles and computes the converted model). Offline, tiny."""

from __future__ import annotations

import pytest
import torch
import transformers

import normswap
from normswap import presets
from tests.zoo import EXACT, build

TEXTS = ["hello world", "a b c d e f g", "the quick brown fox", "jumps over the lazy dog"]


def _tiny(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers import models

    mlm, tok = presets.build("tiny-bert")
    base = transformers.BertModel(mlm.config)
    base.load_state_dict(mlm.bert.state_dict(), strict=False)
    base.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    tr = models.Transformer(str(tmp_path / "base"), max_seq_length=24)
    dim = getattr(tr, "get_embedding_dimension", None) or tr.get_word_embedding_dimension
    return st.SentenceTransformer(modules=[tr, models.Pooling(dim()), models.Normalize()], device="cpu")


def _encode(model):
    return model.encode(TEXTS, convert_to_tensor=True).double()


def test_patch_converts_the_inner_model_with_the_wrappers_tokenizer(tmp_path):
    model = _tiny(tmp_path)
    before = _encode(model)
    plan = normswap.plan(model)
    assert len(plan.sites) == 5  # the inner BertModel's norms, found without example_inputs
    report = normswap.patch(model)
    assert report.changed and report.message.startswith("SentenceTransformer: converted its model `0.")
    assert "built-in English text" in report.verification["probe"]  # real text through the wrapper's tokenizer
    assert "model tokenizer" in report.calibration.source
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    after = _encode(model)
    cos = torch.nn.functional.cosine_similarity(before, after)
    assert float(cos.min()) > 0.99, cos  # Post-LN: approximate, calibrated; close, not equal

    with pytest.raises(normswap.NormswapError, match=r"save it with its own SentenceTransformer.save\(dir\)"):
        normswap.save(model, tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    model.save(str(tmp_path / "saved"))
    again = type(model)(str(tmp_path / "saved"), device="cpu")
    assert sum(isinstance(m, normswap.RMSNorm) for m in again.modules()) == 5
    torch.testing.assert_close(_encode(again), after, rtol=1e-5, atol=1e-6)


def test_a_wrapper_with_two_transformers_models_names_them():
    class Pair(torch.nn.Sequential):
        pass

    Pair.__module__ = "sentence_transformers.fake"
    a, b = (transformers.BertModel(presets.build_model("tiny-bert").config) for _ in range(2))
    with pytest.raises(normswap.NormswapError, match="holds 2 transformers models"):
        normswap.patch(Pair(a, b))


def test_a_compiled_module_is_converted_inside_and_recompiles():
    model = build(EXACT, "gpt2")
    eager_reference = build(EXACT, "gpt2")
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    compiled = torch.compile(model, backend=recording_backend)
    ids = torch.randint(0, 99, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = compiled(input_ids=ids).logits
    report = normswap.patch(compiled)
    assert report.message.startswith("torch.compile'd module: converted its model `_orig_mod` in place")
    assert sum(isinstance(m, normswap.RMSNorm) for m in model.modules()) == 5
    normswap.patch(eager_reference)
    with torch.no_grad():
        after = compiled(input_ids=ids).logits  # the RMSNorm modules, not the cached LayerNorm graph
        expected = eager_reference(input_ids=ids).logits
    assert len(graphs) >= 2 and "layer_norm" in graphs[0] and "layer_norm" not in graphs[-1]  # recompiled
    torch.testing.assert_close(after, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(after, before, rtol=1e-9, atol=1e-9)  # exact conversion
