"""Checkpoint IO: native and compat round trips, sharding, the three native load paths, save()."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from torch import nn

import normswap
from normswap import presets
from normswap.checkpoint import hf, rebase, writer
from normswap.checkpoint.conversion import calibration_tokenizer
from normswap.errors import NormswapError

# preset -> mode for the native round trip (BERT is Post-LN: approximate, so mode=all)
CASES = {
    "tiny-gpt2": "auto",
    "tiny-opt": "auto",
    "tiny-bloom": "auto",
    "tiny-phi": "auto",
    "tiny-vit": "auto",
    "tiny-whisper": "auto",
    "tiny-bert": "all",
}


def outputs(model: nn.Module, name: str) -> torch.Tensor:
    with torch.no_grad():
        out = model(**presets.example_inputs(name))
    return out.logits


def converted_in_memory(name: str, mode: str) -> nn.Module:
    """What ``convert`` does in memory: patch the preset, calibrating with its own tokenizer, every β kept
    (the β placement ``convert`` resolves for a checkpoint; an in-memory patch's own default folds some)."""
    model, proc = presets.build(name)
    normswap.patch(model, mode=mode, tokenizer=calibration_tokenizer(proc), beta_placement="keep")
    return model


def safetensors_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


@pytest.fixture(scope="module")
def native_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("native")
    out = {}
    for name, mode in CASES.items():
        report = normswap.convert(name, root / name, mode=mode)
        assert report.verification["reload_bitwise_equal"] is True
        out[name] = root / name
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_native_round_trip_is_bitwise(native_dirs, name):
    d = native_dirs[name]
    loaded = normswap.load(d)
    assert type(loaded).__name__.startswith("Normswap")
    assert isinstance(normswap.plan_of(loaded), normswap.Plan)
    assert any(isinstance(m, normswap.RMSNorm) for m in loaded.modules())
    assert torch.equal(outputs(loaded, name), outputs(converted_in_memory(name, CASES[name]), name))
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "normswap_" + loaded.config.model_type.removeprefix("normswap_")
    assert cfg["auto_map"]["AutoConfig"].startswith("modeling_normswap.")
    manifest = cfg["normswap"]
    assert manifest["format"] == "native" and manifest["plan"]["sites"]
    assert {"normswap", "transformers", "torch"} <= set(manifest["versions"])
    assert "max_rel_error" in manifest["verification"]
    assert (d / "modeling_normswap.py").is_file() and (d / "README.md").is_file()
    for f in safetensors_files(d):
        with safe_open(str(f), "pt") as h:
            assert h.metadata() == {"format": "pt"}
    assert not list(d.glob("*.bin")) and not list(d.glob("*.pt"))


def test_native_output_keeps_side_files_and_model_card(native_dirs):
    d = native_dirs["tiny-gpt2"]
    assert (d / "tokenizer.json").is_file() and (d / "generation_config.json").is_file()
    card = (d / "README.md").read_text()
    assert "5 exact" in card and "normswap.load" in card and "trust_remote_code=True" in card
    vit = native_dirs["tiny-vit"]
    assert (vit / "preprocessor_config.json").is_file()


def test_side_files_leave_python_bytecode_caches_behind(tmp_path):
    """A source whose custom modeling code was imported in place holds ``__pycache__`` (and a sentence-transformers
    module directory may too): the machine's compiled bytecode, not part of the checkpoint. Before, it was copied
    into the output (and a later reader of every file of the output met a directory there)."""
    from normswap.checkpoint import io

    src, dst = tmp_path / "src", tmp_path / "dst"
    (src / "__pycache__").mkdir(parents=True)
    (src / "__pycache__" / "modeling_x.cpython-311.pyc").write_bytes(b"\0" * 1000)
    (src / "stray.pyc").write_bytes(b"\0" * 1000)
    (src / "1_Pooling" / "__pycache__").mkdir(parents=True)
    (src / "1_Pooling" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\0" * 1000)
    (src / "1_Pooling" / "config.json").write_text("{}")
    (src / "modeling_x.py").write_text("x = 1\n")
    (src / "tokenizer.json").write_text("{}")
    dst.mkdir()
    assert io.side_file_bytes(src) == 2 + 6 + 2  # the two configs and the modeling file, no bytecode
    assert sorted(io.copy_side_files(src, dst)) == ["1_Pooling", "modeling_x.py", "tokenizer.json"]
    assert sorted(str(p.relative_to(dst)) for p in dst.rglob("*")) == [
        "1_Pooling", "1_Pooling/config.json", "modeling_x.py", "tokenizer.json"]


def test_native_saves_original_key_names(native_dirs):
    # transformers v5 renames ViT modules (q_proj, mlp.fc1) but checkpoints keep the v4/Hub names
    keys = set()
    for f in safetensors_files(native_dirs["tiny-vit"]):
        with safe_open(str(f), "pt") as h:
            keys |= set(h.keys())
    assert "vit.encoder.layer.0.attention.attention.query.weight" in keys
    assert not any(".q_proj." in k for k in keys)


def test_tied_head_and_bert_decoder_bias_are_kept_tied_and_stored_once(native_dirs):
    """The default keeps ties (the embedding centered by an op): each tied tensor is written once."""
    with safe_open(str(native_dirs["tiny-gpt2"] / "model.safetensors"), "pt") as h:
        assert len({"lm_head.weight", "transformer.wte.weight"} & set(h.keys())) == 1
    with safe_open(str(native_dirs["tiny-bert"] / "model.safetensors"), "pt") as h:
        # the MLM decoder bias is tied to cls.predictions.bias: one of the two names
        assert len({"cls.predictions.decoder.bias", "cls.predictions.bias"} & set(h.keys())) == 1
    assert json.loads((native_dirs["tiny-gpt2"] / "config.json").read_text()).get("tie_word_embeddings") is not False


def test_import_normswap_then_auto_class(native_dirs):
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSpeechSeq2Seq

    model = AutoModelForCausalLM.from_pretrained(native_dirs["tiny-opt"])
    assert type(model) is hf.model_class_for("opt", "OPTForCausalLM")
    assert torch.equal(
        outputs(model, "tiny-opt"), outputs(normswap.load(native_dirs["tiny-opt"]), "tiny-opt")
    )
    whisper = AutoModelForSpeechSeq2Seq.from_pretrained(native_dirs["tiny-whisper"])
    assert whisper.model.encoder.layers[0]._normswap_hooks  # centering op re-installed on load
    base = AutoModel.from_pretrained(native_dirs["tiny-gpt2"])  # head-less class: manifest paths rebased
    assert isinstance(base.h[0].ln_1, normswap.RMSNorm) and isinstance(base.ln_f, normswap.RMSNorm)


def test_generate_and_pipeline_on_reloaded_models(native_dirs):
    from transformers import pipeline

    gen = pipeline("text-generation", model=str(native_dirs["tiny-gpt2"]))
    text = gen("The quick", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert text.startswith("The quick")
    fill = pipeline("fill-mask", model=str(native_dirs["tiny-bert"]))
    assert len(fill("The quick [MASK] fox")) > 0
    whisper = normswap.load(native_dirs["tiny-whisper"])
    feats = presets.example_inputs("tiny-whisper")["input_features"]
    assert whisper.generate(feats, max_new_tokens=3).shape[0] == feats.shape[0]


@pytest.fixture(scope="module")
def compat_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compat")
    for name in CASES:
        normswap.convert(name, root / name, format="compat")
    return {name: root / name for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_compat_round_trip_is_exact_in_stock_transformers(compat_dirs, name):
    d = compat_dirs[name]
    cfg = json.loads((d / "config.json").read_text())
    assert not cfg["model_type"].startswith("normswap_") and "auto_map" not in cfg
    assert not (d / "modeling_normswap.py").exists()
    cls = getattr(transformers, cfg["architectures"][0])
    model = cls.from_pretrained(d).eval()
    assert not any(isinstance(m, normswap.RMSNorm) for m in model.modules())
    original = presets.build_model(name)
    ref, got = outputs(original, name), outputs(model, name)
    assert (got - ref).abs().max() / ref.abs().max() < 1e-5
    manifest = cfg["normswap"]
    assert manifest["format"] == "compat"
    converted = [s["name"] for s in manifest["plan"]["sites"] if s["convert"]]
    assert sorted(manifest["rms_ready"] + manifest["needs_centering"]) == sorted(converted)
    if name in ("tiny-bloom", "tiny-whisper"):
        assert manifest["needs_centering"], "models with a centering op must say which norms need it"
    if name == "tiny-bert":  # approximate norms stay LayerNorm in compat
        assert all(s["verdict"] != "approximate" for s in manifest["plan"]["sites"] if s["convert"])


def test_compat_rms_ready_norms_read_zero_mean_streams(compat_dirs):
    d = compat_dirs["tiny-gpt2"]
    model = transformers.GPT2LMHeadModel.from_pretrained(d).eval()
    ready = json.loads((d / "config.json").read_text())["normswap"]["rms_ready"]
    seen = {}
    hooks = [
        model.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: seen.__setitem__(n, a[0].detach()))
        for n in ready
    ]
    outputs(model, "tiny-gpt2")
    for h in hooks:
        h.remove()
    for n, x in seen.items():
        assert (x.mean(-1).abs() / x.pow(2).mean(-1).sqrt()).max() < 1e-5, n


def test_sharded_native_output(tmp_path):
    out = tmp_path / "sharded"
    normswap.convert("tiny-gpt2", out, max_shard_size="40KB")
    shards = safetensors_files(out)
    assert len(shards) > 3
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in shards}
    assert all(f.name.startswith("model-") and "-of-" in f.name for f in shards)
    assert index["metadata"]["total_size"] > 0
    for f in shards:
        with safe_open(str(f), "pt") as h:
            assert h.metadata() == {"format": "pt"}
    loaded = normswap.load(out)
    assert torch.equal(
        outputs(loaded, "tiny-gpt2"), outputs(converted_in_memory("tiny-gpt2", "auto"), "tiny-gpt2")
    )


def test_trust_remote_code_in_a_fresh_process(native_dirs, compat_dirs, tmp_path, warm_python):
    """Stock transformers in a process that never imported normswap loads the compat checkpoint, refuses the native
    one without ``trust_remote_code`` and runs it with it. A child of the warm fork server (``tests/warm_python.py``:
    it never imports normswap), whose ``HF_HOME`` is a directory of its own: the remote code's modules go to its
    empty ``modules`` cache, as they went to the ``HF_MODULES_CACHE`` this test gave a fresh interpreter."""
    ref = outputs(normswap.load(native_dirs["tiny-gpt2"]), "tiny-gpt2")
    ref_compat = outputs(transformers.GPT2LMHeadModel.from_pretrained(compat_dirs["tiny-gpt2"]), "tiny-gpt2")
    torch.save(
        {"ids": presets.example_inputs("tiny-gpt2"), "native": ref, "compat": ref_compat}, tmp_path / "ref.pt"
    )
    script = textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        ref = torch.load({str(tmp_path / "ref.pt")!r})
        compat = AutoModelForCausalLM.from_pretrained({str(compat_dirs["tiny-gpt2"])!r})
        assert "normswap" not in sys.modules, "compat must load without normswap"
        with torch.no_grad():
            assert torch.equal(compat(**ref["ids"]).logits, ref["compat"])
        try:
            AutoModelForCausalLM.from_pretrained({str(native_dirs["tiny-gpt2"])!r})
            raise SystemExit("native loaded without trust_remote_code or normswap")
        except ValueError as exc:
            assert "trust_remote_code" in str(exc)
        native = {str(native_dirs["tiny-gpt2"])!r}
        model = AutoModelForCausalLM.from_pretrained(native, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            assert torch.equal(model(**ref["ids"]).logits, ref["native"])
        print("OK", type(model).__name__)
    """)
    modules = warm_python.hf_home / "modules"
    assert not modules.exists()  # no child before this one ran remote code
    try:
        res = warm_python.run(script, timeout=300)
        wrote = modules.is_dir()  # the remote code went where the child's environment says
    finally:
        shutil.rmtree(modules, ignore_errors=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert wrote
    assert "OK NormswapGPT2LMHeadModel" in res.stdout


def test_save_in_memory_model_with_manifest_extra(tmp_path):
    model, tok = presets.build("tiny-phi")
    normswap.patch(model)
    out = normswap.checkpoint.save(
        model,
        tmp_path / "phi",
        manifest_extra={"finetune": {"steps": 3}},
        tokenizer=tok,
        max_shard_size="60KB",
    )
    assert len(safetensors_files(out)) > 1
    manifest = json.loads((out / "config.json").read_text())["normswap"]
    assert manifest["finetune"] == {"steps": 3}
    loaded = normswap.load(out)
    assert torch.equal(outputs(loaded, "tiny-phi"), outputs(model, "tiny-phi"))
    # saving a loaded checkpoint again keeps its manifest and earlier extras
    again = normswap.checkpoint.save(loaded, tmp_path / "phi2", manifest_extra={"note": "x"})
    manifest2 = json.loads((again / "config.json").read_text())["normswap"]
    assert manifest2["finetune"] == {"steps": 3} and manifest2["note"] == "x"
    assert torch.equal(outputs(normswap.load(again), "tiny-phi"), outputs(model, "tiny-phi"))
    compat = normswap.checkpoint.save(loaded, tmp_path / "phi3", format="compat")
    stock = transformers.PhiForCausalLM.from_pretrained(compat)
    ref = outputs(presets.build_model("tiny-phi"), "tiny-phi")
    assert (outputs(stock, "tiny-phi") - ref).abs().max() / ref.abs().max() < 1e-5


def test_save_refuses_bad_requests(tmp_path):
    model = presets.build_model("tiny-gpt2")
    with pytest.raises(NormswapError, match="not been converted"):
        normswap.checkpoint.save(model, tmp_path / "a")
    normswap.patch(model)
    with pytest.raises(NormswapError, match="reserved"):
        normswap.checkpoint.save(model, tmp_path / "b", manifest_extra={"plan": 1})
    with pytest.raises(NormswapError, match="format"):
        normswap.checkpoint.save(model, tmp_path / "c", format="gguf")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "mine.txt").write_text("keep")
    with pytest.raises(NormswapError, match="not empty"):
        normswap.checkpoint.save(model, tmp_path / "d")
    assert (tmp_path / "d" / "mine.txt").read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d"]  # nothing else written


def test_compat_refuses_approximate_conversions(tmp_path):
    model = presets.build_model("tiny-bert")
    normswap.patch(model, mode="all")
    with pytest.raises(NormswapError, match="approximate"):
        normswap.checkpoint.save(model, tmp_path / "x", format="compat")
    with pytest.raises(NormswapError, match="compat"):
        normswap.convert("tiny-bert", tmp_path / "y", format="compat", mode="all")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_load_errors(tmp_path):
    with pytest.raises(NormswapError, match="does not exist"):
        normswap.load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(NormswapError, match="config.json"):
        normswap.load(tmp_path / "empty")


def test_manifest_rebase_for_other_head_classes(native_dirs):
    cfg = json.loads((native_dirs["tiny-gpt2"] / "config.json").read_text())
    plan = cfg["normswap"]["plan"]
    base = transformers.GPT2Model(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=320))
    rebased, lost = rebase.rebase_plan(plan, base)
    assert {s["name"] for s in rebased["sites"]} == {"h.0.ln_1", "h.0.ln_2", "h.1.ln_1", "h.1.ln_2", "ln_f"}
    assert rebased["unties"] == []  # lm_head does not exist in the base model
    assert lost == []  # no fold_gamma: ln_f kept its γ/β


def test_writer_names_and_auto_classes():
    model = presets.build_model("tiny-gpt2")
    classes = writer.auto_classes_for(model)
    assert classes["AutoModelForCausalLM"] == "GPT2LMHeadModel" and classes["AutoModel"] == "GPT2Model"
    src = writer.modeling_source("gpt2", classes)
    compile(src, "modeling_normswap.py", "exec")
    assert "import normswap" not in src or "from normswap" in src


def test_plain_save_pretrained_of_a_loaded_model_stays_native(native_dirs, tmp_path):
    """Trainer and users call save_pretrained: the result must still load the three ways."""
    model = normswap.load(native_dirs["tiny-bert"])
    model.save_pretrained(tmp_path / "plain")
    cfg = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert cfg["model_type"] == "normswap_bert" and "AutoModelForMaskedLM" in cfg["auto_map"]
    assert (tmp_path / "plain" / "modeling_normswap.py").is_file()
    with safe_open(str(tmp_path / "plain" / "model.safetensors"), "pt") as h:
        assert {"cls.predictions.decoder.bias", "cls.predictions.bias"} & set(h.keys())
    assert torch.equal(outputs(normswap.load(tmp_path / "plain"), "tiny-bert"), outputs(model, "tiny-bert"))


def test_compat_of_a_model_built_without_its_pooler(tmp_path):
    """ViTModel(add_pooling_layer=False) has `pooler = None`: the compat model leaves it out too."""
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, image_size=32, patch_size=8)
    model = transformers.ViTModel(cfg, add_pooling_layer=False).eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.3)
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model(pixel_values=pixels).last_hidden_state
    normswap.patch(model)
    normswap.save(model, tmp_path / "compat", format="compat")
    reloaded = transformers.ViTModel.from_pretrained(tmp_path / "compat", add_pooling_layer=False).eval()
    assert not any(isinstance(m, normswap.RMSNorm) for m in reloaded.modules())
    with torch.no_grad():
        got = reloaded(pixel_values=pixels).last_hidden_state
    assert float((got - expected).abs().max() / expected.abs().max()) <= 1e-5
