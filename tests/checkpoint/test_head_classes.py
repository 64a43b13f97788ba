"""A native checkpoint loads under every head class of its base model, as the stock checkpoint does.

Converted as one class (masked LM, causal LM, classifier, seq2seq, or the base model), loaded as every
other ``AutoModel*`` class that knows the base config, both through ``AutoModel*.from_pretrained`` (after
``import normswap``) and through ``normswap.load(dir, task=...)``: the body the classes share gives the
converted model's outputs, every tensor of the checkpoint the class has is loaded, a head the checkpoint
lacks is initialised by transformers (with its report), and a head the class lacks is ignored. Also the
command line: ``--task X --new-head`` on a saved masked-LM directory and ``--task`` on presets.
"""

from __future__ import annotations

import inspect
import json
import logging
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner
from safetensors.torch import load_file

import normswap
from normswap import inputs, presets
from normswap.checkpoint import hf, hf_types, rebase
from normswap.cli import main
from normswap.errors import NormswapError
from tests import zoo

# name -> (source, convert options); the sources are presets (also loaded as their base model or a
# classifier: task=), and saved zoo models: T5 (RMS norms only, so fold_gamma), Phi (whose v5 classifier
# builds its base model through AutoModel.from_config), DeiT (two classes for one Auto mapping) and CLIP's
# vision tower (its plain class renames the checkpoint's keys: transformers drops a `vision_model.` prefix)
ZOO = {"t5": zoo.RMS, "phi": zoo.EXACT, "deit": {k: v[0] for k, v in zoo.MORE.items()}, "clip-vision": zoo.EXACT}
CASES = {
    "bert-mlm": ("tiny-bert", {}),
    "gpt2-lm-fold-gamma": ("tiny-gpt2", {"fold_gamma": True}),
    "vit-classifier": ("tiny-vit", {}),
    "whisper-seq2seq": ("tiny-whisper", {}),
    "t5-seq2seq-fold-gamma": ("t5", {"fold_gamma": True}),
    "phi-lm-fold-gamma": ("phi", {"fold_gamma": True}),
    "deit-classifier": ("deit", {}),
    "gpt2-base": ("tiny-gpt2", {"task": "base"}),
    "bert-base": ("tiny-bert", {"task": "base", "allow_new_head": True, "mode": "exact"}),
    "gpt2-classifier": ("tiny-gpt2", {"task": "sequence-classification", "allow_new_head": True}),
    "clip-vision-projection": ("clip-vision", {}),
    "clip-vision-base": ("clip-vision", {"task": "base"}),
}
# classes no AutoModel* maps to this config, loaded by class (normswap.load(task=cls), the generated class)
EXTRA = {name: [transformers.CLIPVisionModel, transformers.CLIPVisionModelWithProjection]
         for name in ("clip-vision-projection", "clip-vision-base")}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heads")
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, (src, options) in CASES.items():
            if src in ZOO:
                torch.manual_seed(0)
                zoo.build(ZOO[src], src).float().save_pretrained(root / f"{src}-src")
                src = str(root / f"{src}-src")
            # verification is covered elsewhere; here the structure and the weights are what is checked
            normswap.convert(src, root / name, verify=False, **options)
            out[name] = root / name
    return out


def auto_classes(d: Path) -> list[type]:
    base = json.loads((d / "config.json").read_text())["normswap"]["base_model_type"]
    base_cfg = hf_types.base_config_class(base)
    return [auto for auto in hf_types.auto_classes() if base_cfg in auto._model_mapping]


def accepted(module: torch.nn.Module, batch: dict) -> dict:
    params = inspect.signature(module.forward).parameters
    return {k: v for k, v in batch.items() if k in params}


def body(model: torch.nn.Module, batch: dict, encoder_states: torch.Tensor | None,
         encoder_decoder: bool) -> dict[str, torch.Tensor]:
    """What every class of one base model computes the same way: the base model's output, or for an
    encoder-decoder family the encoder's and the decoder's (on ``encoder_states``, so a decoder-only class
    compares); a class with only one of them (T5EncoderModel, WhisperForCausalLM) gives that one."""
    if not encoder_decoder:
        return {"base": model.base_model(**accepted(model.base_model, batch))[0]}
    out = {}
    encoder = model.get_encoder() if hasattr(model, "get_encoder") else None
    if "Encoder" in type(encoder).__name__ or "Stack" in type(encoder).__name__:
        out["encoder"] = encoder(**accepted(encoder, {k: v for k, v in batch.items() if "decoder" not in k}))[0]
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    # a class without a decoder may answer get_decoder() with something else (Whisper's audio classifier)
    if "Decoder" in type(decoder).__name__ and encoder_states is not None:
        out["decoder"] = decoder(input_ids=batch["decoder_input_ids"], encoder_hidden_states=encoder_states)[0]
    return out


def checkpoint_tensors(d: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def load_both(d: Path, cls: type) -> list[tuple[str, torch.nn.Module]]:
    """``cls`` (an AutoModel* class, or a model class) loaded both ways a user can."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if hasattr(cls, "_model_mapping"):
            via_class = cls.from_pretrained(d).eval()
        else:
            base = json.loads((d / "config.json").read_text())["normswap"]["base_model_type"]
            via_class = hf.model_class_for(base, cls.__name__).from_pretrained(d).eval()
        via_load = normswap.load(d, task=cls)
    return [(f"{cls.__name__}.from_pretrained", via_class), ("normswap.load(task=)", via_load)]


@pytest.mark.parametrize("name", list(CASES))
def test_every_auto_class_loads_the_converted_checkpoint(dirs, name):
    d = dirs[name]
    ref = normswap.load(d)  # the class it was converted as
    batch = inputs.hf_example_inputs(ref, batch=2, seq=8, seed=5)
    with torch.no_grad():
        encoder_decoder = bool(getattr(ref.config, "is_encoder_decoder", False))
        ref_body = body(ref, batch, None, encoder_decoder)
        ref_body = body(ref, batch, ref_body.get("encoder"), encoder_decoder)
    tensors = checkpoint_tensors(d)
    classes = auto_classes(d) + EXTRA.get(name, [])
    assert len(classes) >= 2
    for cls in classes:
        for how, model in load_both(d, cls):
            what = f"{type(model).__name__} via {how}"
            assert type(model).__name__.startswith("Normswap"), what
            assert normswap.plan_of(model) is not None, what
            # the body is the converted model's (bitwise here; the contract is <= 1e-6 in float32)
            with torch.no_grad():
                got = body(model, batch, ref_body.get("encoder"), encoder_decoder)
            shared = set(got) & set(ref_body)
            assert shared, what
            for key in shared:
                assert (got[key] - ref_body[key]).abs().max().item() <= 1e-6, f"{what}: {key}"
            # every checkpoint tensor this class has is loaded; what it has beyond them is initialised
            pmap, state = rebase.PathMap(model), model.state_dict()
            loaded = set()
            for key, value in tensors.items():
                target = pmap(key)
                if target is not None:
                    assert torch.equal(state[target], value.to(state[target].dtype)), f"{what}: {key}"
                    loaded.add(target)
            tied = model.get_expanded_tied_weights_keys(all_submodels=True)
            for key, value in state.items():
                if key not in loaded and key not in tied and value.is_floating_point():
                    assert value.device.type != "meta" and torch.isfinite(value).all(), f"{what}: {key}"


def test_a_head_the_class_lacks_is_ignored_and_a_new_head_is_initialised_with_transformers_report(dirs):
    d = dirs["bert-mlm"]
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    previous = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_warning()
    try:
        model, info = transformers.AutoModelForSequenceClassification.from_pretrained(
            d, num_labels=3, output_loading_info=True
        )
    finally:
        transformers.logging.set_verbosity(previous)
        root.removeHandler(handler)
    assert type(model).__name__ == "NormswapBertForSequenceClassification"
    assert set(info["missing_keys"]) == {"classifier.weight", "classifier.bias",
                                         "bert.pooler.dense.weight", "bert.pooler.dense.bias"}
    assert all(k.startswith("cls.") for k in info["unexpected_keys"]) and info["unexpected_keys"]
    report = "\n".join(records)
    assert "newly initialized" in report and "classifier.weight" in report
    assert model.classifier.weight.std() > 0 and model(torch.tensor([[2, 7, 9, 3]])).logits.shape == (1, 3)
    # the masked-LM head's centering op is not in a classifier; its body's norms all are RMSNorms
    plan = normswap.plan_of(model)
    assert not any(h.module.startswith("cls.") for h in plan.hooks)
    assert {s.name for s in plan.sites} == {
        n for n, m in model.named_modules() if isinstance(m, normswap.RMSNorm)
    }


def test_fold_into_a_missing_head_warns(dirs):
    d = dirs["gpt2-lm-fold-gamma"]
    with pytest.warns(UserWarning, match=r"`ln_f` lacks its γ/β \(folded into `lm_head`"):
        transformers.AutoModel.from_pretrained(d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the class it was converted with: no warning
        transformers.AutoModelForCausalLM.from_pretrained(d)


def test_a_base_model_built_through_auto_model_gets_the_manifest_once(dirs):
    """Phi's classifier builds its base model with AutoModel.from_config, which is a Normswap class too:
    the manifest is applied once, by the outer class (one warning, not one per nesting level)."""
    with pytest.warns(UserWarning) as caught:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(dirs["phi-lm-fold-gamma"])
    lost = [w for w in caught if "lacks its γ/β" in str(w.message)]
    assert len(lost) == 1 and "as PhiForSequenceClassification: `model.final_layernorm`" in str(lost[0].message)
    assert normswap.plan_of(model) is not None and normswap.plan_of(model.model) is None


def test_an_auto_mapping_with_two_classes_loads_the_converted_one(dirs):
    d = dirs["deit-classifier"]
    assert isinstance(transformers.AutoModelForImageClassification._model_mapping[transformers.DeiTConfig], tuple)
    model = transformers.AutoModelForImageClassification.from_pretrained(d)
    assert type(model).__name__ == "NormswapDeiTForImageClassification"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForImageClassification"] == "modeling_normswap.NormswapDeiTForImageClassification"


def test_head_tied_to_a_centered_embedding_warns(dirs):
    d = dirs["gpt2-base"]
    with pytest.warns(UserWarning, match=r"ties `lm_head.weight` to `transformer.wte.weight`, which this checkpoint"):
        model = normswap.load(d, task="causal-lm")
    assert type(model).__name__ == "NormswapGPT2LMHeadModel"


def test_load_task_accepts_names_auto_classes_and_model_classes(dirs):
    d = dirs["bert-mlm"]
    assert type(normswap.load(d, task="base")).__name__ == "NormswapBertModel"
    assert type(normswap.load(d, task=transformers.BertForTokenClassification)).__name__ == (
        "NormswapBertForTokenClassification"
    )
    with pytest.raises(NormswapError, match="did you mean 'sequence-classification'"):
        normswap.load(d, task="sequence-clasification")
    with pytest.raises(NormswapError, match="AutoModelForImageClassification has no class"):
        normswap.load(d, task="image-classification")
    with pytest.raises(NormswapError, match="GPT2Model is not a model class"):
        normswap.load(d, task=transformers.GPT2Model)


def test_trust_remote_code_lists_every_head_class(dirs):
    cfg = json.loads((dirs["bert-mlm"] / "config.json").read_text())
    for auto in auto_classes(dirs["bert-mlm"]):
        assert auto.__name__ in cfg["auto_map"]
    assert cfg["auto_map"]["AutoModelForSequenceClassification"] == (
        "modeling_normswap.NormswapBertForSequenceClassification"
    )


def test_path_map_follows_transformers_key_rules():
    with torch.device("meta"):
        lm = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40))
        base = transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40))
    to_base, to_lm = rebase.PathMap(base), rebase.PathMap(lm)
    assert to_base("transformer.h.0.ln_1") == "h.0.ln_1" and to_base("transformer.wte.weight") == "wte.weight"
    assert to_base("lm_head") is None and to_base("transformer") == ""
    assert to_lm("h.0.ln_1") == "transformer.h.0.ln_1" and to_lm("lm_head") == "lm_head"
    assert to_lm("h.7.ln_1") is None
    assert to_base.text("stream written by `transformer.h.0.ln_2` output") == "stream written by `h.0.ln_2` output"
    vision = transformers.CLIPVisionConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                           intermediate_size=32, image_size=16, patch_size=8)
    with torch.device("meta"):
        plain, projection = transformers.CLIPVisionModel(vision), transformers.CLIPVisionModelWithProjection(vision)
    # CLIPVisionModel's own key renaming (transformers drops `vision_model.`), and back by the prefix rule
    assert rebase.PathMap(plain)("vision_model.encoder.layers.0.layer_norm1") == "encoder.layers.0.layer_norm1"
    assert rebase.PathMap(projection)("encoder.layers.0.layer_norm1") == "vision_model.encoder.layers.0.layer_norm1"
    assert rebase.PathMap(plain)("visual_projection") is None


# ------------------------------------------------------------------------------------ command line
def run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return res.exit_code, res.stderr


@pytest.fixture(scope="module")
def mlm_dir(tmp_path_factory) -> Path:
    return presets.save("tiny-bert", tmp_path_factory.mktemp("mlm") / "bert")


def test_cli_task_new_head_on_a_masked_lm_directory(mlm_dir, tmp_path):
    code, err = run("convert", str(mlm_dir), "--out", str(tmp_path / "base"), "--task", "base", "--mode", "exact")
    assert code == 2 and "(BertForMaskedLM) has no pooler.dense.bias" in err and "--new-head" in err
    assert not (tmp_path / "base").exists()
    code, err = run("convert", str(mlm_dir), "--out", str(tmp_path / "cls"), "--task", "sequence-classification",
                    "--new-head", "--mode", "exact", "-q")
    assert code == 0, err
    manifest = json.loads((tmp_path / "cls" / "config.json").read_text())["normswap"]
    assert manifest["architecture"] == "BertForSequenceClassification"
    assert set(manifest["new_head"]) == {"classifier.weight", "classifier.bias",
                                         "bert.pooler.dense.weight", "bert.pooler.dense.bias"}
    assert type(normswap.load(tmp_path / "cls")).__name__ == "NormswapBertForSequenceClassification"


def test_cli_task_on_a_preset(tmp_path):
    code, err = run("convert", "tiny-bert", "--out", str(tmp_path / "b"), "--task", "base", "--new-head",
                    "--mode", "exact", "--no-verify", "-q")
    assert code == 0, err
    manifest = json.loads((tmp_path / "b" / "config.json").read_text())["normswap"]
    assert manifest["architecture"] == "BertModel" and manifest["source"] == "tiny-bert"
    assert set(manifest["new_head"]) == {"pooler.dense.weight", "pooler.dense.bias"}


def test_a_missing_body_tensor_is_still_an_incomplete_download(mlm_dir, tmp_path):
    from safetensors.torch import save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in mlm_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["bert.encoder.layer.1.output.dense.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    code, err = run("convert", str(broken), "--out", str(tmp_path / "o"), "--task", "base", "--new-head")
    assert code == 1 and "encoder.layer.1.output.dense.weight" in err and "incomplete" in err
    assert "pooler" not in err  # only what the checkpoint should hold is named
    assert not (tmp_path / "o").exists()


def test_registry_builds_every_head_class():
    hf.register("bert")
    cfg = hf_types.config_class_for("bert")
    assert transformers.AutoModelForQuestionAnswering._model_mapping[cfg].__name__ == (
        "NormswapBertForQuestionAnswering"
    )


@pytest.mark.parametrize("preset, options", [("tiny-vit", {}), ("tiny-bert", {"mode": "exact"})])
def test_base_model_of_a_head_checkpoint_computes_the_stock_last_hidden_state(tmp_path, monkeypatch, preset,
                                                                                options):
    """A β whose readers are all in the task head stays in the base model's RMSNorm by default, so the
    checkpoint loaded as ``AutoModel`` (to fine-tune another head) gives the stock base model's
    ``last_hidden_state``, without a warning; folding it into the head would lose it there.

    The bf16 rounding rule is switched off (it keeps these presets' β for its own reason), so the
    head rule is what decides."""
    monkeypatch.setattr(normswap.surgery.beta_placement, "MARGIN", float("inf"))
    stock = presets.build_model(preset)
    normswap.convert(preset, tmp_path / "out", verify=False, **options)
    batch = presets.example_inputs(preset)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing of the conversion is missing here
        base = transformers.AutoModel.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        want = stock.base_model(**accepted(stock.base_model, batch))[0]
        got = base(**accepted(base, batch))[0]
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    # and the folding the rule avoided would have lost it: with beta_placement="fold" it differs
    normswap.convert(preset, tmp_path / "fold", verify=False, beta_placement="fold", **options)
    with pytest.warns(UserWarning, match="folded into"):
        folded = transformers.AutoModel.from_pretrained(tmp_path / "fold").eval()
    with torch.no_grad():
        lost = folded(**accepted(folded, batch))[0]
    assert (lost - want).abs().max().item() > 1e-3 * want.abs().max().item()
