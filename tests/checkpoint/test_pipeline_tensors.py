"""A sentence-transformers checkpoint without the tensors its pipeline never uses (no ``pooler.*``: ONNX
exports, ``add_pooling_layer=False``) converts through the CLI, says what it left out, and loads back in
sentence-transformers with the same embeddings; a tensor the pipeline does need stays an error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from normswap import presets
from normswap.cli import main

st = None  # sentence_transformers, imported by _sentence_transformers


@pytest.fixture(autouse=True, scope="module")
def _sentence_transformers():
    """Imported when this file's tests run, in the worker that runs them (~2.6 s of CPU): at module level it was
    imported by every xdist worker's collection. Not installed: every test here is skipped, as before."""
    global st
    st = pytest.importorskip("sentence_transformers")


def run(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def st_dir(root: Path, drop: tuple[str, ...]) -> Path:
    """A tiny BERT sentence-transformers directory (Transformer, mean Pooling, Normalize) whose
    safetensors lack every tensor whose name starts with one of ``drop``."""
    import transformers
    from sentence_transformers import models

    mlm, tok = presets.build("tiny-bert")
    torch.manual_seed(0)
    with torch.no_grad():  # LayerNorm parameters away from 1/0, so an exact conversion is a real test
        for m in mlm.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.2)
    base = transformers.BertModel(mlm.config)
    base.load_state_dict(mlm.bert.state_dict(), strict=False)
    base.save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    tr = models.Transformer(str(root / "base"), max_seq_length=24)
    dim = getattr(tr, "get_embedding_dimension", None) or tr.get_word_embedding_dimension
    out = root / "st"
    st.SentenceTransformer(modules=[tr, models.Pooling(dim()), models.Normalize()], device="cpu").save(str(out))
    weights = out / "model.safetensors"
    sd = load_file(weights)
    kept = {k: v for k, v in sd.items() if not k.startswith(drop)}
    assert len(kept) < len(sd), f"nothing starts with {drop}"
    save_file(kept, weights, metadata={"format": "pt"})
    return out


TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a b c d e f g", "it embeds sentences"]


def test_missing_pooler_is_left_out_and_embeddings_match(tmp_path):
    src = st_dir(tmp_path / "build", ("pooler.",))
    out = tmp_path / "out"
    # --mode exact: the exact norms only, so the embeddings must match to float32 rounding
    code, stdout, err = run("convert", str(src), "--out", str(out), "--mode", "exact")
    assert code == 0, err
    assert "left out pooler" in err and "does not use it" in err, err
    manifest = json.loads((out / "config.json").read_text())["normswap"]
    assert manifest["left_out"] == ["pooler"]
    assert not any(k.startswith("pooler.") for k in load_file(out / "model.safetensors"))
    assert manifest["counts"]["exact"] >= 1

    import normswap

    a, b = st.SentenceTransformer(str(src), device="cpu"), st.SentenceTransformer(str(out), device="cpu")
    inner = b[0].auto_model
    assert inner.pooler is None  # rebuilt without the module, not with a random one
    assert any(isinstance(m, normswap.RMSNorm) for m in inner.modules())
    ea, eb = a.encode(TEXTS, convert_to_tensor=True), b.encode(TEXTS, convert_to_tensor=True)
    assert torch.allclose(ea, eb, atol=2e-5, rtol=0), (ea - eb).abs().max()
    # normswap.load rebuilds it the same way
    assert normswap.load(out).pooler is None


def test_low_memory_leaves_out_the_pooler_as_in_memory_does(tmp_path):
    """The streaming path tests the missing pooler on a small random-weight copy, builds its proxies
    without it, and writes what the in-memory path writes, bit for bit."""
    src = st_dir(tmp_path / "build", ("pooler.",))
    streamed, in_memory = tmp_path / "streamed", tmp_path / "in_memory"
    code, stdout, err = run("convert", str(src), "--out", str(streamed), "--mode", "exact", "--low-memory")
    assert code == 0, err
    assert "(streamed)" in stdout and "left out pooler" in err and "does not use it" in err, (stdout, err)
    code, _, err = run("convert", str(src), "--out", str(in_memory), "--mode", "exact", "-q")
    assert code == 0, err
    a, b = load_file(streamed / "model.safetensors"), load_file(in_memory / "model.safetensors")
    assert sorted(a) == sorted(b) and not any(k.startswith("pooler.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    manifest = json.loads((streamed / "config.json").read_text())["normswap"]
    assert manifest["left_out"] == ["pooler"] and manifest["counts"]["exact"] >= 1

    s, o = st.SentenceTransformer(str(src), device="cpu"), st.SentenceTransformer(str(streamed), device="cpu")
    assert o[0].auto_model.pooler is None
    ea, eb = s.encode(TEXTS, convert_to_tensor=True), o.encode(TEXTS, convert_to_tensor=True)
    assert torch.allclose(ea, eb, atol=2e-5, rtol=0), (ea - eb).abs().max()


@pytest.mark.parametrize("low_memory", [False, True], ids=["in-memory", "low-memory"])
@pytest.mark.parametrize(
    ("drop", "named"),
    [
        # a whole module the token embeddings need: tested (NaN reaches the output), not guessed
        (("encoder.layer.1.output.dense.",), "encoder.layer.1.output.dense.bias"),
        # one tensor of a module whose other tensors are there
        (("encoder.layer.0.attention.self.query.weight",), "encoder.layer.0.attention.self.query.weight"),
        # a whole module outside the layer stacks that the token embeddings need
        (("embeddings.token_type_embeddings.",), "embeddings.token_type_embeddings.weight"),
    ],
)
def test_a_tensor_the_pipeline_needs_stays_an_error(tmp_path, drop, named, low_memory):
    src = st_dir(tmp_path / "build", drop)
    out = tmp_path / "out"
    # --mode exact so that the streaming path reaches its tensor checks (it refuses approximate norms)
    extra = ["--low-memory", "--mode", "exact"] if low_memory else []
    code, _, err = run("convert", str(src), "--out", str(out), "-q", *extra)
    assert code == 1, err
    line = next(ln for ln in err.splitlines() if ln.startswith("error:"))
    assert named in line and "sentence-transformers pipeline needs" in line, line
    assert "download is incomplete" in line and "pooler" not in line, line
    assert "Traceback" not in err and not out.exists()
