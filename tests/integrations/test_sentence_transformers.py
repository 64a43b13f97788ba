"""``normswap.patch`` / ``normswap.plan`` on a sentence-transformers model object: the transformers model
inside it is converted in place with the wrapper's tokenizer, the pipeline keeps working, and it saves
and loads back through sentence-transformers (offline, tiny BERT)."""

from __future__ import annotations

import pytest
import torch
import transformers

import normswap
from normswap import presets

st = pytest.importorskip("sentence_transformers")
TEXTS = ["hello world", "a b c d e f g", "the quick brown fox", "jumps over the lazy dog"]


def _tiny(tmp_path):
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
    assert report.changed and report.message.startswith("SentenceTransformer: converted its transformers model")
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
    again = st.SentenceTransformer(str(tmp_path / "saved"), device="cpu")
    assert sum(isinstance(m, normswap.RMSNorm) for m in again.modules()) == 5
    torch.testing.assert_close(_encode(again), after, rtol=1e-5, atol=1e-6)


def test_a_wrapper_with_two_transformers_models_names_them():
    class Pair(torch.nn.Sequential):
        pass

    Pair.__module__ = "sentence_transformers.fake"
    a, b = (transformers.BertModel(presets.build_model("tiny-bert").config) for _ in range(2))
    with pytest.raises(normswap.NormswapError, match="holds 2 transformers models"):
        normswap.patch(Pair(a, b))
