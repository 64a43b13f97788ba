"""Constant trades in models converted by more than one run: towers, sub-runs, dual encoders, streamed.

A tower's position table keeps its row means where its class token (or patch bias) takes them
(:mod:`normswap.analysis.trades`). A multimodal model reaches its towers through several runs: both towers in
one whole-model run (CLIP), each tower through the model's feature method beside a text-only run (the
per-tower route, :mod:`normswap.inputs.towers`: LLaVA whose prompt format is unknown), or norms the model's
run misses by a sub-run (:mod:`normswap.inputs.reach`: BLIP's text decoder). All runs are one forward of a
view, so there is one plan, and every tower's trade must be in it, named by the model's own parameter paths,
applied in memory, in the checkpoints and in the streamed rewrite.

What could be silently wrong: a trade proved in one run but lost or misnamed in the model's plan (the model
stays exact, the quantization benefit is gone), a trade between writers that do not reach the same tokens
through the full model (not exact), a table still moved by its whole row means.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
import transformers as tf
from click.testing import CliRunner
from torch import nn

import normswap
from normswap.analysis.plan import ConstantTrade, plan_of
from normswap.cli import main
from normswap.integrations.saving import saving_class
from tests import zoo
from tests.analysis.test_constant_trades import _randomise_embeddings
from tests.inputs.test_towers import IMAGE_TOKEN, LlavaRefusingMedia, full_model, llava, prompt, rel_error


def _clip() -> nn.Module:
    torch.manual_seed(0)
    cls, config = zoo.MORE["clip"][0]()
    return _randomise_embeddings(zoo.randomise(cls(config), 0), 0)


def _blip() -> nn.Module:
    torch.manual_seed(0)
    config = tf.BlipConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         vocab_size=99, max_position_embeddings=64, bos_token_id=1, sep_token_id=2, pad_token_id=0),
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                           image_size=32, patch_size=8), projection_dim=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _randomise_embeddings(zoo.randomise(tf.BlipModel(config), 0), 0)


def _llava() -> nn.Module:
    return _randomise_embeddings(llava(), 0)


def _pixels(seed: int) -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _dual_outputs(model: nn.Module) -> list[torch.Tensor]:
    """A dual encoder's every output on unseen text and images (both towers and the similarity)."""
    ids = torch.randint(3, 90, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=_pixels(4))
    return [v for v in out.values() if isinstance(v, torch.Tensor)]


def _llava_outputs(model: nn.Module) -> list[torch.Tensor]:
    """The stock LLaVA forward (images merged into the prompt): the vision tower, projector and decoder."""
    stock = tf.LlavaForConditionalGeneration
    return [full_model(stock, model, input_ids=prompt(16, IMAGE_TOKEN, 2), pixel_values=_pixels(5)),
            full_model(stock, model, input_ids=prompt(0, 0, 1))]


# (builder, outputs through the full model, what the analysis line says, the trades: (table, lo, hi, taker))
CASES = {
    "clip": (_clip, _dual_outputs, "images + text in one run of the whole model", {
        ("vision_model.embeddings.position_embedding.weight", 0, 1, "vision_model.embeddings.class_embedding")}),
    "llava-per-tower": (_llava, _llava_outputs, "per tower", {
        ("model.vision_tower.embeddings.position_embedding.weight", 0, 1,
         "model.vision_tower.embeddings.class_embedding")}),
    "blip-sub-runs": (_blip, _dual_outputs, "by sub-runs: `text_model`", {
        ("vision_model.embeddings.position_embedding", 0, 1, "vision_model.embeddings.class_embedding"),
        ("vision_model.embeddings.position_embedding", 1, 17, "vision_model.embeddings.patch_embedding.bias")}),
}


def _patched(model: nn.Module, **options: object) -> tuple[nn.Module, normswap.Report]:
    conv = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return conv, normswap.patch(conv, **options)


@pytest.fixture(scope="module")
def converted() -> dict[str, tuple[nn.Module, nn.Module, normswap.Report]]:
    return {}


# LLaVA's projector reads a raw middle stream of the tower (``vision_feature_layer=-2``): per-norm centering
# keeps it exact (by default its norms are approximate, with or without the trade: tests/inputs/test_towers.py).
# BLIP's text model is Post-LN (approximate): exact mode converts only the exact norms, the vision tower's.
OPTIONS = {"llava-per-tower": {"per_norm_centering": True}, "blip-sub-runs": {"mode": "exact"}}


def _case(cache: dict, name: str) -> tuple[nn.Module, nn.Module, normswap.Report]:
    if name not in cache:
        model = CASES[name][0]()
        cache[name] = (model, *_patched(model, **OPTIONS.get(name, {})))
    return cache[name]


def _row_means(p: torch.Tensor, t: ConstantTrade) -> torch.Tensor:
    return p.detach().double().mean(t.axis).reshape(-1)


def _moved(before: torch.Tensor, after: torch.Tensor, t: ConstantTrade) -> torch.Tensor:
    """How far each row's entries moved: the largest change over the feature axis."""
    return (after.detach().double() - before.detach().double()).abs().amax(t.axis).reshape(-1)


@pytest.mark.parametrize("name", list(CASES))
def test_each_towers_trade_is_in_the_models_plan_exact_through_the_full_model(converted, name):
    model, conv, report = _case(converted, name)
    _, outputs, route, expected = CASES[name]
    assert route in report.plan.options["analysis_inputs"]
    trades = report.plan.constant_trades
    assert {(t.table, t.lo, t.hi, t.into) for t in trades} == expected
    params = dict(conv.named_parameters())
    assert all(t.table in params and t.into in params for t in trades)  # the model's own paths, not a run's
    assert {(t.table, t.lo, t.hi, t.into) for t in normswap.plan(model, **OPTIONS.get(name, {})).constant_trades} \
        == expected
    for ref, out in zip(outputs(model), outputs(conv), strict=True):
        assert rel_error(ref, out) <= 1e-9, name


@pytest.mark.parametrize("name", list(CASES))
def test_a_towers_table_moves_by_the_spread_of_its_traded_row_means(converted, name):
    """Each traded block of rows keeps ``c``, the mean of its rows' original means: every row moves by
    ``|m_t − c|`` (0 for a class token's own row). Without the trade each row moves by ``|m_t|``."""
    model, conv, report = _case(converted, name)
    alone, _ = _patched(model, trade_constants=False, **OPTIONS.get(name, {}))
    for t in report.plan.constant_trades:
        before = model.get_parameter(t.table)
        means = _row_means(before, t)[t.lo:t.hi]
        bound = (means - means.mean()).abs()
        assert bool((_moved(before, conv.get_parameter(t.table), t)[t.lo:t.hi] <= bound + 1e-12).all()), t
        assert not bool((_moved(before, alone.get_parameter(t.table), t)[t.lo:t.hi] <= bound + 1e-12).all()), t


@pytest.mark.parametrize("name", ["llava-per-tower", "blip-sub-runs"])
def test_checkpoints_of_a_model_converted_by_several_runs_keep_every_trade(converted, name, tmp_path):
    model, conv, report = _case(converted, name)
    conv = copy.deepcopy(conv)
    if isinstance(conv, LlavaRefusingMedia):  # the test's subclass: saved as the stock class it extends
        conv.__class__ = saving_class(tf.LlavaForConditionalGeneration, "llava")
    normswap.save(conv, tmp_path / "native")
    native = normswap.load(tmp_path / "native", dtype=torch.float64).eval()
    assert plan_of(native).constant_trades == report.plan.constant_trades
    outputs = CASES[name][1]
    for ref, out in zip(outputs(model), outputs(native), strict=True):
        assert rel_error(ref, out) <= 1e-9, name
    for t in report.plan.constant_trades:
        assert torch.equal(native.get_parameter(t.table), conv.get_parameter(t.table).to(torch.float64))


def test_the_streamed_rewrite_of_a_dual_encoder_applies_the_towers_trade_as_in_memory(tmp_path):
    """``convert --low-memory`` analyses random-weight proxies and rewrites the checkpoint tensor by tensor:
    the vision tower's trade must be in its manifest and its tensors those of the in-memory conversion."""
    model = _clip()
    model.save_pretrained(tmp_path / "clip")
    conv, report = _patched(model)
    # the command itself, run in this process (a fresh interpreter only paid the imports again)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        done = CliRunner().invoke(main, ["convert", str(tmp_path / "clip"), "--out", str(tmp_path / "streamed"),
                                         "--low-memory"], catch_exceptions=False)
    assert done.exit_code == 0, done.stderr[-2000:]
    manifest = json.loads((tmp_path / "streamed" / "config.json").read_text())["normswap"]["plan"]
    assert manifest["options"]["analysis"].startswith("low-memory")
    assert [ConstantTrade(**t) for t in manifest["constant_trades"]] == report.plan.constant_trades
    streamed = normswap.load(tmp_path / "streamed", dtype=torch.float64).eval()
    for t in report.plan.constant_trades:
        for key in (t.table, t.into):
            assert (streamed.get_parameter(key) - conv.get_parameter(key)).abs().max() <= 1e-12, key
    for ref, out in zip(_dual_outputs(model), _dual_outputs(streamed), strict=True):
        assert rel_error(ref, out) <= 1e-9


def test_a_text_towers_one_row_table_trades_every_row_beside_an_image_tower():
    """AltCLIP: a RoBERTa text tower (its one token-type row reaches every text token, at any length) and a CLIP
    image tower in one run. The probe sees both towers' tokens; the token-type row reaches none of the image's, and
    was taken for a one-token parameter: only the position rows the traced text read were traded, and a longer
    text failed verification (|mean|/rms 1.7e-2 at the embedding norm; the transformers sweep refused AltCLIP).
    Since round 63 the defaults keep a Post-LN text tower's tables (no trade); with γ folded (``fold_gamma``) they
    keep their edit, as round 62's defaults had it: the trade is tested there."""
    torch.manual_seed(0)
    config = tf.AltCLIPConfig(
        text_config=dict(vocab_size=99, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=40, type_vocab_size=1, pad_token_id=1,
                         project_dim=16),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                           image_size=32, patch_size=8), projection_dim=16)
    model = _randomise_embeddings(zoo.randomise(tf.AltCLIPModel(config).double().eval(), 0), 0)
    short = {"input_ids": torch.randint(3, 99, (2, 6)), "pixel_values": _pixels(1)}
    conv, _ = _patched(model, example_inputs=short, mode="exact", fold_gamma=True)
    trade = next(t for t in plan_of(conv).constant_trades if "roberta" in t.table)
    assert (trade.lo, trade.hi) == (0, 40) and trade.into.endswith("token_type_embeddings.weight")
    long = {"input_ids": torch.randint(3, 99, (2, 30)), "pixel_values": _pixels(2)}
    with torch.no_grad():
        ref, out = model(**long), conv(**long)
    for a, b in ((ref.text_embeds, out.text_embeds), (ref.image_embeds, out.image_embeds)):
        assert (a - b).abs().max() <= 1e-9 * a.abs().max()
