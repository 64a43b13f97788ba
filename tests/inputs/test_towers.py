"""The per-tower route (:mod:`normswap.inputs.towers`): a multimodal model whose whole-model inputs with media
do not run converts with no inputs, each tower analysed on inputs of its own modality and the rest on text.

Replicas are tiny transformers models (float64, LayerNorm γ/β randomised, eval) whose forward refuses media,
as a model whose prompt format the builder does not know does: the whole model then runs on text alone, and
only the per-tower route reaches the towers. Exactness is measured through the *full* model (the stock
class's forward, media merged into the prompt) against the float64 original, on text and on media.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers as tf
from torch import nn

import normswap
from normswap import RMSNorm
from normswap.errors import NormswapError
from normswap.inputs import towers
from normswap.pipeline import default_dtype
from tests.zoo import float64_casts, randomise

TEXT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
            vocab_size=128, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2, head_dim=8)
VIT = dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, image_size=32,
           patch_size=8)
IMAGE_TOKEN = AUDIO_TOKEN = 100


class LlavaRefusingMedia(tf.LlavaForConditionalGeneration):
    """LLaVA whose forward refuses images (a prompt format the builder does not know)."""

    def forward(self, input_ids=None, pixel_values=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
        if pixel_values is not None:
            raise ValueError("unknown prompt format")
        return super().forward(input_ids=input_ids, **kwargs)


class VoxtralRefusingAudio(tf.VoxtralForConditionalGeneration):
    def forward(self, input_ids=None, input_features=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
        if input_features is not None:
            raise ValueError("unknown prompt format")
        return super().forward(input_ids=input_ids, **kwargs)


def llava(text_config: tf.PretrainedConfig | None = None) -> nn.Module:
    """CLIP vision tower, GELU projector reading a raw middle stream (``vision_feature_layer=-2``), text decoder."""
    torch.manual_seed(0)
    config = tf.LlavaConfig(vision_config=tf.CLIPVisionConfig(**VIT), text_config=text_config or tf.LlamaConfig(**TEXT),
                            image_token_id=IMAGE_TOKEN, projector_hidden_act="gelu", vision_feature_layer=-2)
    return randomise(LlavaRefusingMedia(config), 0)


def voxtral() -> nn.Module:
    torch.manual_seed(0)
    audio = tf.VoxtralEncoderConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    num_mel_bins=16, max_source_positions=16)
    return randomise(VoxtralRefusingAudio(tf.VoxtralConfig(audio_config=audio, text_config=tf.LlamaConfig(**TEXT),
                                                           audio_token_id=AUDIO_TOKEN)), 0)


def layernorms(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)}


def patched(model: nn.Module, **options: object) -> normswap.Report:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return normswap.patch(model, **options)


def full_model(stock: type, model: nn.Module, **kwargs: torch.Tensor) -> torch.Tensor:
    """The stock class's forward (media merged into the prompt), float64 end to end."""
    with torch.no_grad(), default_dtype(torch.float64), float64_casts():
        return stock.forward(model, **kwargs).logits


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


def prompt(tokens: int, token: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, IMAGE_TOKEN, (2, tokens + 9), generator=gen)
    ids[:, 3:3 + tokens] = token
    return ids


def test_llava_converts_by_towers_exact_through_the_full_model():
    model = llava()
    original = copy.deepcopy(model)
    norms = layernorms(model)
    report = patched(model, per_norm_centering=True)
    assert not layernorms(model), "every LayerNorm converted"
    assert {s.name for s in report.sites if s.convert} == norms
    assert all(s.verdict.startswith("exact") for s in report.sites if s.convert), report.plan.table()
    line = report.plan.options["analysis_inputs"]
    assert line.startswith("per tower") and "`model.vision_tower` through the model's get_image_features" in line
    assert "text alone" in line and "unknown prompt format" in line
    assert report.plan.options["towers"] == ["model.multi_modal_projector", "model.vision_tower"]  # tower + projector
    assert "per tower" in str(report)
    gen = torch.Generator().manual_seed(5)
    pixels = torch.randn(2, 3, 32, 32, generator=gen, dtype=torch.float64)
    stock = tf.LlavaForConditionalGeneration
    text = prompt(0, 0, 1)
    assert rel_error(full_model(stock, original, input_ids=text), full_model(stock, model, input_ids=text)) <= 1e-9
    images = prompt(16, IMAGE_TOKEN, 2)  # 16 patches per image: the vision tower, projector and decoder together
    ref = full_model(stock, original, input_ids=images, pixel_values=pixels)
    assert rel_error(ref, full_model(stock, model, input_ids=images, pixel_values=pixels)) <= 1e-9


def test_default_options_keep_what_the_projector_reads():
    """Without per-norm centering, the norms whose stream the projector reads raw cannot be exact: the plan says
    so (approximate, fitted), as the whole-model route does, and every exact one stays exact."""
    model = llava()
    plan = normswap.plan(model)
    assert plan.options["analysis_inputs"].startswith("per tower")
    verdicts = {s.name: s.verdict for s in plan.sites}
    assert set(verdicts) == layernorms(model) and not any(isinstance(m, RMSNorm) for m in model.modules())
    assert verdicts["model.vision_tower.pre_layrnorm"].startswith("exact")
    assert any(v == "approximate" for v in verdicts.values())
    assert all("`model.multi_modal_projector" in s.reason for s in plan.sites if s.verdict == "approximate")


def test_audio_tower_converts_by_towers_exact_through_the_full_model():
    model = voxtral()
    original = copy.deepcopy(model)
    report = patched(model)
    assert not layernorms(model)
    assert all(s.verdict.startswith("exact") for s in report.sites if s.convert), report.plan.table()
    assert "`model.audio_tower`, `model.multi_modal_projector` through the model's get_audio_features" in \
        report.plan.options["analysis_inputs"]
    gen = torch.Generator().manual_seed(3)
    features = torch.randn(2, 16, 32, generator=gen, dtype=torch.float64)
    stock = tf.VoxtralForConditionalGeneration
    with torch.no_grad():  # audio tokens per clip, as the model counts them
        per_clip = original.get_audio_features(input_features=features).pooler_output.shape[0] // 2
    ids = prompt(per_clip, AUDIO_TOKEN, 4)
    ref = full_model(stock, original, input_ids=ids, input_features=features)
    assert rel_error(ref, full_model(stock, model, input_ids=ids, input_features=features)) <= 1e-9
    text = prompt(0, 0, 6)
    assert rel_error(full_model(stock, original, input_ids=text), full_model(stock, model, input_ids=text)) <= 1e-9


def test_a_refused_tower_route_leaves_the_model_untouched():
    """A LayerNorm text decoder (OPT) reads the stream the image features join: no run analysed those rows,
    so the route is refused in one line, and the user's model is left as it was."""
    opt = tf.OPTConfig(hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4, vocab_size=128,
                       max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2, tie_word_embeddings=False)
    model = llava(opt)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    modules = dict(model.named_modules())
    with pytest.raises(NormswapError) as err:
        patched(model, per_norm_centering=True)
    text = str(err.value)
    assert "\n" not in text and "per-tower analysis refused" in text and "media features join" in text, text
    assert "unknown prompt format" in text
    assert dict(model.named_modules()) == modules and layernorms(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert type(model) is LlavaRefusingMedia and "forward" not in vars(model)


def test_a_model_without_towers_keeps_its_error():
    """A text model that does not run keeps the whole-model refusal: there is no tower to fall back on."""

    class Broken(tf.GPT2LMHeadModel):
        def forward(self, input_ids=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
            raise ValueError("broken")

    model = Broken(tf.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=32)).double()
    assert towers.find_towers(model) == []
    with pytest.raises(NormswapError, match="could not run Broken.forward"):
        patched(model)


def test_a_tower_run_alone_is_held_to_every_stream_the_model_reads():
    """Without a feature method, the tower runs alone; LLaVA's config picks a middle layer
    (``vision_feature_layer``), so its hidden states are outputs held exact, which centering its writers
    would change: refused in one line naming the stream, model untouched."""
    model = llava()
    for holder in (model, model.model):  # no get_image_features anywhere: the tower must run alone
        object.__setattr__(holder, "get_image_features", None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NormswapError) as err:
        patched(model)
    text = str(err.value)
    assert "\n" not in text and "per-tower analysis refused: converting `model.vision_tower`" in text, text
    assert "would change `tower:model.vision_tower." in text and "raw residual stream" in text
    assert layernorms(model) == layernorms(llava())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_cli_converts_and_verifies_by_towers(tmp_path):
    """A saved Voxtral whose config leaves the audio token unset (no prompt can hold the audio): ``normswap
    convert`` takes the per-tower route, says so, and checks the written checkpoint on the same runs
    (reloaded bitwise); ``normswap verify`` compares original and checkpoint on them too."""
    from click.testing import CliRunner

    from normswap.cli import main

    torch.manual_seed(0)
    audio = tf.VoxtralEncoderConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    num_mel_bins=16, max_source_positions=16)
    model = randomise(tf.VoxtralForConditionalGeneration(tf.VoxtralConfig(
        audio_config=audio, text_config=tf.LlamaConfig(**TEXT), audio_token_id=None)), 0).float()
    model.save_pretrained(tmp_path / "orig")
    runner = CliRunner()
    res = runner.invoke(main, ["convert", str(tmp_path / "orig"), "--out", str(tmp_path / "out")],
                        catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "analysis inputs: per tower" in res.stdout and "get_audio_features" in res.stdout, res.stdout
    assert "reload_bitwise_equal=True" in res.stdout, res.stdout
    res = runner.invoke(main, ["verify", str(tmp_path / "orig"), str(tmp_path / "out")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "per-tower runs' built inputs" in res.stdout and ": OK" in res.stdout, res.stdout
    converted = normswap.load(tmp_path / "out")
    assert not layernorms(converted) and normswap.plan_of(converted).options["towers"]
