"""Reaching every LayerNorm (:mod:`normswap.inputs.reach`): norms the built inputs never call are converted by a
sub-run of the smallest enclosing submodule that runs alone, or the input that would reach them is named.

Replicas are tiny transformers models (float64, LayerNorm γ/β randomised, eval). Exactness is measured against a
float64 copy of the original, on the model's own forward and on the submodule the parent never feeds fully.
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
from normswap.inputs import reach, towers
from tests.zoo import randomise

GPT2 = dict(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64, add_cross_attention=True,
            bos_token_id=1, eos_token_id=2)


class CaptionerWithoutEncoderStates(tf.GPT2LMHeadModel):
    """A text decoder with cross-attention whose own forward never passes encoder states (as ``BlipModel`` calls
    its text model): its ``ln_cross_attn`` norms are dead for this class, live in a sibling class that does."""

    def forward(self, input_ids=None, attention_mask=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
        return super().forward(input_ids=input_ids, attention_mask=attention_mask)


def captioner() -> nn.Module:
    torch.manual_seed(0)
    return randomise(CaptionerWithoutEncoderStates(tf.GPT2Config(**GPT2)), 0)


def patched(model: nn.Module, **options: object) -> normswap.Report:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return normswap.patch(model, **options)


def cross_norms(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_modules() if n.endswith("ln_cross_attn")]


def test_cross_attention_the_parent_never_feeds_converts_by_a_sub_run_exactly() -> None:
    model = captioner()
    original = copy.deepcopy(model)
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    states = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(6), dtype=torch.float64)

    report = patched(model)

    assert cross_norms(model) and all(isinstance(model.get_submodule(n), RMSNorm) for n in cross_norms(model))
    assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())  # converted whole
    assert all(s.convert for s in report.plan.sites), [(s.name, s.reason) for s in report.plan.sites]
    # not the cross-attention alone: its output joins the block's stream, whose norms the parent's run converts
    said = report.plan.options["analysis_inputs"]
    assert "`transformer` (2 norm(s)) run alone on inputs built from its config with encoder states" in said
    assert "reached by sub-runs: `transformer`" in report.message
    with torch.no_grad():
        # through the parent's forward (no encoder states), and through the text model with them (a sibling
        # class's path: the checkpoint must be exact there too)
        assert (model(input_ids=ids).logits - original(input_ids=ids).logits).abs().max() <= 1e-9
        got = model.transformer(input_ids=ids, encoder_hidden_states=states).last_hidden_state
        want = original.transformer(input_ids=ids, encoder_hidden_states=states).last_hidden_state
        assert (got - want).abs().max() <= 1e-9
    assert isinstance(model, CaptionerWithoutEncoderStates) and not towers.is_view(model)  # no view leaks out


def test_plan_says_the_same_sub_runs_and_leaves_the_model_untouched() -> None:
    model = captioner()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plan = normswap.plan(model)
    assert all(s.convert for s in plan.sites)
    assert plan.options["sub_runs"] == ["`transformer` (2 norm(s)) run alone on inputs built from its config with "
                                        "encoder states (`input_ids` (2, 8), `encoder_hidden_states` (2, 5, 32))"]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class Transform(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.dense, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.norm(nn.functional.gelu(self.dense(hidden_states)))


class MaskedHead(nn.Module):
    """A pre-training head (a transform: dense, GELU, LayerNorm; then a decoder), as FLAVA's MIM/MLM heads."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.transform, self.decoder = Transform(width), nn.Linear(width, 16)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(hidden_states))


class GPT2WithMaskedHead(tf.GPT2Model):
    """A head its forward runs only when ``bool_masked_pos`` is given (no rule builds it)."""

    def __init__(self, config: tf.GPT2Config) -> None:
        super().__init__(config)
        self.mim_head = MaskedHead(config.n_embd)

    def forward(self, input_ids=None, bool_masked_pos=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
        hidden = super().forward(input_ids=input_ids).last_hidden_state
        if bool_masked_pos is not None:
            return hidden, self.mim_head(hidden[bool_masked_pos])
        return hidden


def test_a_head_only_an_optional_input_runs_converts_by_running_it_alone() -> None:
    torch.manual_seed(0)
    model = randomise(GPT2WithMaskedHead(tf.GPT2Config(**{**GPT2, "add_cross_attention": False})), 0)
    original = copy.deepcopy(model)
    report = patched(model)
    # the transform, inside the head the model's run never calls: what it returns meets no converted norm
    assert report.plan.options["sub_runs"] == ["`mim_head.transform` (1 norm(s)) run alone on built `hidden_states` "
                                               "(width 32)"]
    assert isinstance(model.mim_head.transform.norm, RMSNorm)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.rand(2, 7, generator=torch.Generator().manual_seed(2)) > 0.5
    rows = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        for got, want in zip(model(ids, bool_masked_pos=mask), original(ids, bool_masked_pos=mask), strict=True):
            assert (got - want).abs().max() <= 1e-9
        assert (model.mim_head(rows) - original.mim_head(rows)).abs().max() <= 1e-9


class EntityEmbeddings(nn.Module):
    """Embeddings of concept ids, normalised: the model runs them only when ``concept_ids`` are given."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.table = nn.Embedding(16, width)
        self.LayerNorm = nn.LayerNorm(width)

    def forward(self, concept_ids: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.table(concept_ids))


class BertWithEntities(tf.BertModel):
    """BERT (Post-LN, so its own norms are approximate) whose entity branch runs only with ``concept_ids``."""

    def __init__(self, config: tf.BertConfig) -> None:
        super().__init__(config)
        self.entity_embeddings = EntityEmbeddings(config.hidden_size)

    def forward(self, input_ids=None, attention_mask=None, concept_ids=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask)
        if concept_ids is not None:
            return out.last_hidden_state, self.entity_embeddings(concept_ids)
        return out.last_hidden_state


def bert_with_entities() -> nn.Module:
    torch.manual_seed(0)
    config = tf.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                           vocab_size=128, max_position_embeddings=64)
    return randomise(BertWithEntities(config), 0)


def test_a_norm_only_an_optional_input_reaches_is_kept_and_the_input_named() -> None:
    model = bert_with_entities()
    original = copy.deepcopy(model)
    report = patched(model, mode="exact")

    assert isinstance(model.entity_embeddings.LayerNorm, nn.LayerNorm)  # kept: partial, exact
    line = ("1 LayerNorm(s) in `entity_embeddings` not reached: pass `concept_ids` (BertWithEntities.forward reaches "
            "them only with it)")
    assert report.plan.options["unreached"] == [line]
    assert line in report.message and line in report.plan.options["analysis_inputs"]
    [reason] = [s.reason for s in report.plan.sites if s.name == "entity_embeddings.LayerNorm"] + \
        [s["reason"] for s in report.plan.skipped if s["name"] == "entity_embeddings.LayerNorm"]
    assert reason.endswith("; pass `concept_ids` (BertWithEntities.forward reaches them only with it)")
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    ent = torch.randint(0, 16, (2, 3), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        outputs = model(input_ids=ids, concept_ids=ent), original(input_ids=ids, concept_ids=ent)
        for got, want in zip(*outputs, strict=True):
            assert (got - want).abs().max() <= 1e-9


def test_missing_inputs_reads_guards_through_an_assignment() -> None:
    """The call itself is unconditional; what it is given is not (SAM 3's geometry encoder on boxes)."""

    class Boxes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(4)

        def forward(self, boxes: torch.Tensor) -> torch.Tensor:
            return self.norm(boxes) if boxes.shape[1] else boxes

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.geometry = Boxes()

        def forward(self, pixel_values=None, input_boxes=None):  # noqa: ANN001, ANN201
            if input_boxes is not None:
                boxes = input_boxes
            else:
                boxes = torch.zeros(1, 0, 4)
            return self.geometry(boxes)

    model = Model()
    [found] = reach.missing_inputs(model, ["geometry.norm"], {"geometry"}, {"pixel_values": torch.zeros(1)})
    assert found.inputs == ["input_boxes"] and found.norms == ["geometry.norm"]


def test_a_refused_sub_run_leaves_the_model_untouched_and_converts_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    model = captioner()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def refuse(self, plan, model):  # noqa: ANN001, ANN202
        raise NormswapError("sub-run of `transformer` refused: converting it would change `sub:transformer.x`")

    calls = []
    real_convert = normswap.pipeline._convert

    def convert(st, check=None):  # noqa: ANN001, ANN202
        calls.append(reach.sub_route_of(st.model) is not None)
        if calls[-1]:  # the view's conversion is refused: the user's model must be as it was
            with pytest.raises(NormswapError):
                real_convert(st, check)
            assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
            raise NormswapError("sub-run of `transformer` refused: converting it would change `sub:transformer.x`")
        return real_convert(st, check)

    monkeypatch.setattr(reach.SubRoute, "check", refuse)
    monkeypatch.setattr(normswap.pipeline, "_convert", convert)
    report = patched(model)
    assert calls == [True, False]
    assert all(isinstance(model.get_submodule(n), nn.LayerNorm) for n in cross_norms(model))  # kept, exact
    assert "converted without sub-runs (sub-run of `transformer` refused" in report.plan.options["analysis_inputs"]
    assert ("kept as LayerNorm: 2 LayerNorm(s) in `transformer.h.*.ln_cross_attn` not reached: `transformer.h.*` runs "
            "it only with `encoder_hidden_states`, which CaptionerWithoutEncoderStates.forward never passes (dead for "
            "this class)") in report.message


def test_ops_on_the_views_inputs_move_onto_the_module_each_run_calls() -> None:
    """A centering op the plan puts on a run's built input (the view's own argument) must be installed on the
    module that run calls: the converted model never sees the view's argument names."""
    from normswap.analysis.plan import CenterHook

    runs = [towers.Run("model", "model", {}), towers.Run("sub:head.norm", "module", {}, target="head.norm"),
            towers.Run("sub:head", "module", {}, target="head")]
    route = reach.SubRoute(runs, [], "")
    hooks = [CenterHook("", "input", "sub:head.norm/*0"), CenterHook("", "input", "sub:head/hidden_states"),
             CenterHook("", "input", "model/inputs_embeds"), CenterHook("body", "input", 0)]

    class Plan:
        pass

    plan = Plan()
    plan.hooks = hooks
    towers.place_input_ops(plan, route)
    assert [(h.module, h.arg) for h in hooks] == [("head.norm", 0), ("head", "hidden_states"), ("", "inputs_embeds"),
                                                  ("body", 0)]


class _Encoders(nn.Module):
    """A speech encoder and a text encoder, the text one run only when no speech features are given (as
    ``SeamlessM4TModel`` picks one by its inputs), and a vocoder that only ``generate`` runs."""

    def __init__(self) -> None:
        super().__init__()
        self.speech = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))
        self.text = nn.Sequential(nn.Embedding(16, 8), nn.LayerNorm(8))
        self.vocoder = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))

    def forward(self, input_ids=None, input_features=None, encoder_outputs=None):  # noqa: ANN001, ANN201
        if encoder_outputs is None:
            if input_features is not None:
                encoder_outputs = self.speech(input_features)
            elif input_ids is not None:
                encoder_outputs = self.text(input_ids)
        return encoder_outputs

    def generate(self, input_ids=None, input_features=None):  # noqa: ANN001, ANN201
        return self.vocoder(self.forward(input_ids, input_features))


def test_missing_inputs_read_guards_with_their_polarity() -> None:
    """A branch taken only when an input is *not* given names that input as one to leave out, never as one to
    pass (``encoder_outputs is None`` is met by leaving it out); a module only another method calls is dead for
    this class, whatever that method's own guards."""
    model = _Encoders()
    given = {"input_ids": torch.zeros(1, 3, dtype=torch.long), "input_features": torch.zeros(1, 3, 4)}
    called = {"speech", "speech.0", "speech.1"}
    found = {m.module: m for m in reach.missing_inputs(model, ["text.1", "vocoder.1"], called, given)}
    assert found["text"].inputs == [] and found["text"].without == ["input_features"]
    assert found["text"].line() == ("1 LayerNorm(s) in `text` not reached: pass example inputs without "
                                    "`input_features` (_Encoders.forward reaches them only when it is not given)")
    assert found["vocoder"].inputs == [] and found["vocoder"].without == []
    assert found["vocoder"].line() == ("1 LayerNorm(s) in `vocoder` not reached: `vocoder` is not called by "
                                       "_Encoders.forward; only `generate` calls it (dead for this class)")
    # with only text given, the speech encoder's guard names the input to pass
    text_only = {"input_ids": given["input_ids"]}
    [speech] = reach.missing_inputs(model, ["speech.1"], {"text", "text.0", "text.1"}, text_only)
    assert speech.inputs == ["input_features"] and speech.without == []


class _Prompts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.points = nn.Linear(2, 8)
        self.mask_embed = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8))

    def forward(self, input_points=None, input_masks=None):  # noqa: ANN001, ANN201
        dense = self.mask_embed(input_masks) if input_masks is not None else None
        return (self.points(input_points) if input_points is not None else None), dense


class _Segmenter(nn.Module):
    """SAM's shape: the prompt encoder runs with or without points, its mask branch only with ``input_masks``."""

    def __init__(self) -> None:
        super().__init__()
        self.prompt_encoder = _Prompts()

    def forward(self, pixel_values=None, input_points=None, input_masks=None):  # noqa: ANN001, ANN201
        if input_points is not None:
            input_points = input_points * 2
        return self.prompt_encoder(input_points=input_points, input_masks=input_masks)


def test_a_call_that_ran_names_the_guard_one_level_down() -> None:
    """The prompt encoder ran (its arguments' guards held), so the input to name is the one its mask branch
    tests, not the one guarding what the encoder was given."""
    given = {"pixel_values": torch.zeros(1)}
    [found] = reach.missing_inputs(_Segmenter(), ["prompt_encoder.mask_embed.1"], {"prompt_encoder"}, given)
    assert found.module == "prompt_encoder.mask_embed" and found.inputs == ["input_masks"]
