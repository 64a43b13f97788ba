"""Bad input: clear errors, and the user's model left exactly as it was."""

import copy

import pytest
import torch
import transformers as tf
from torch import nn

import normswap
from normswap.pipeline import all_finite
from normswap.surgery import edits
from tests.custom_models import TinyViT, randomise
from tests.zoo import EXACT, build


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_no_layernorm_is_a_report_not_an_error():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    report = normswap.patch(model, (torch.randn(3, 4),))
    assert not report.changed and "no LayerNorm" in report.message


def test_already_rms_models_are_reported_as_skipped():
    config = tf.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                            intermediate_size=64, vocab_size=99, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = tf.LlamaForCausalLM(config).eval()
    plan = normswap.plan(model)
    assert not plan.sites and len(plan.skipped) == 5
    assert all("RMS" in s["reason"] for s in plan.skipped)
    assert not normswap.patch(model).changed


def test_patching_twice_is_a_no_op_that_says_so():
    model = build(EXACT, "gpt2")
    assert normswap.patch(model).changed
    state = _state(model)
    report = normswap.patch(model)
    assert not report.changed and "already converted" in report.message
    assert _same(state, _state(model))


def test_custom_model_without_inputs_says_how_to_pass_them():
    with pytest.raises(normswap.NormswapError, match="example_inputs"):
        normswap.patch(TinyViT())


def test_inputs_that_do_not_fit_say_how_to_pass_them():
    with pytest.raises(normswap.NormswapError, match="could not run TinyViT.forward.*example_inputs"):
        normswap.patch(TinyViT(), (torch.randn(2, 5),))


def test_meta_device_weights_are_refused():
    with torch.device("meta"):
        model = TinyViT()
    with pytest.raises(normswap.NormswapError, match="meta device"):
        normswap.patch(model, (torch.randn(1, 3, 32, 32),))


def test_quantized_weights_are_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    model[0].weight = nn.Parameter(torch.zeros(4, 4, dtype=torch.int8), requires_grad=False)
    with pytest.raises(normswap.NormswapError, match="quantized"):
        normswap.patch(model, (torch.randn(2, 4),))


@pytest.mark.parametrize("with_inputs", [False, True], ids=["auto-inputs", "example_inputs"])
def test_a_peft_model_is_refused_with_how_to_merge_it(with_inputs):
    """A LoRA branch beside a writer or reader would not get the surgery (it crashed, or converted the
    base weights only); the error says to merge first, and nothing is touched."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build(EXACT, "gpt2"), peft.LoraConfig(r=2, target_modules=["c_attn"],
                                                                       init_lora_weights=False))
    before = _state(model)
    example = {"input_ids": torch.randint(0, 99, (2, 8))} if with_inputs else None
    with pytest.raises(normswap.NormswapError, match=r"PEFT model .*merge_and_unload\(\)"):
        normswap.patch(model, example)
    with pytest.raises(normswap.NormswapError, match="merge_and_unload"):
        normswap.plan(model.base_model.model, example)  # the LoRA layers are still inside
    assert _same(before, _state(model))


class _NaNInFloat64(nn.Module):
    """Pre-LN block whose own code breaks in float64 (as CANINE's local attention does): NaN there only."""

    def __init__(self, everywhere: bool = False):
        super().__init__()
        self.everywhere = everywhere
        self.embed, self.norm, self.head = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.embed(x)
        if self.everywhere or h.dtype == torch.float64:
            h = h + torch.where(h[..., :1] > 1e9, 0.0, float("nan"))  # NaN everywhere, in the broken dtype
        return self.head(self.norm(h))


def test_a_model_that_computes_nan_in_float64_only_is_converted_in_its_own_dtype():
    model = randomise(_NaNInFloat64()).float()
    x = torch.randn(3, 8)
    with torch.no_grad():
        before = model(x)
    report = normswap.patch(model, (x,))
    assert report.changed
    assert "analysed and verified in float32: _NaNInFloat64 computes NaN in float64" in report.message
    assert isinstance(model.norm, normswap.RMSNorm)
    with torch.no_grad():
        torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)


def test_nan_outputs_are_an_error_not_a_zero_error_verification():
    """NaN compares as no error: before this check such a model 'converted' with max_rel_error 0."""
    model = randomise(_NaNInFloat64(everywhere=True)).float()
    before = _state(model)
    with pytest.raises(normswap.NormswapError,
                       match="outputs NaN in `output` on the example inputs, before any change"):
        normswap.patch(model, (torch.randn(3, 8),))
    assert _same(before, _state(model)) and isinstance(model.norm, nn.LayerNorm)


def test_a_layernorm_that_matches_no_formula_is_reported_as_skipped():
    class Doubled(nn.LayerNorm):
        def forward(self, x):
            return 2 * x

    model = nn.Sequential(nn.Linear(8, 16), Doubled(16), nn.Linear(16, 4)).double()
    plan = normswap.plan(model, (torch.randn(3, 8, dtype=torch.float64),))
    assert not plan.sites
    reason = "its traced output matches no LayerNorm/RMSNorm formula of its parameters and buffers; kept"
    assert plan.skipped == [{"name": "1", "class": "Doubled", "reason": reason}]


def test_a_model_of_one_sequence_length_verifies_on_its_inputs_and_calibration_says_what_failed():
    """Nyströmformer built for 8-token segments runs on the analysis inputs (8 tokens) only: the unseen
    probe and the built-in calibration batches (other lengths) fail inside the model. Each says so, in
    one line, instead of a RuntimeError traceback out of patch."""
    config = tf.NystromformerConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                    vocab_size=99, max_position_embeddings=64, pad_token_id=0, num_landmarks=4,
                                    segment_means_seq_len=8)
    torch.manual_seed(0)
    model = randomise(tf.NystromformerModel(config))
    before = _state(model)
    with pytest.raises(normswap.NormswapError, match=r"^calibration could not run NystromformerModel on built-in "
                                                     r".*pass calibration= batches the model accepts"):
        normswap.patch(model)
    assert _same(before, _state(model))
    report = normswap.patch(model, mode="exact")
    assert report.changed and report.verification["probe"].startswith(
        "the analysis inputs (the unseen probe did not run: RuntimeError")


def test_nan_weights_are_refused_and_model_untouched():
    model = randomise(TinyViT())
    with torch.no_grad():
        model.head.weight[0, 0] = float("nan")
    state = _state(model)
    with pytest.raises(normswap.NormswapError, match="head.weight.*NaN"):
        normswap.patch(model, (torch.randn(1, 3, 32, 32, dtype=torch.float64),))
    assert all(torch.equal(state[k], v) or k == "head.weight" for k, v in model.state_dict().items())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_all_finite_finds_any_nan_or_inf(dtype):
    x = torch.randn(257, 33).to(dtype)
    assert all_finite(x) and all_finite(torch.empty(0, dtype=dtype))
    for bad in (float("nan"), float("inf"), float("-inf")):
        for index in [(0, 0), (128, 7), (256, 32)]:
            y = x.clone()
            y[index] = bad
            assert not all_finite(y), (bad, index)
            assert not all_finite(y.t())  # strided too


def test_train_mode_is_analysed_in_eval_and_restored():
    model = randomise(TinyViT()).train()
    model.blocks[0].eval()  # a mixed state must come back as it was
    flags = {n: m.training for n, m in model.named_modules()}
    report = normswap.patch(model, (torch.randn(2, 3, 32, 32, dtype=torch.float64),))
    assert report.changed
    after = {n: m.training for n, m in model.named_modules()}
    assert all(after[n] == f for n, f in flags.items() if n in after)


def test_failed_verification_leaves_the_model_bit_identical(monkeypatch):
    model = randomise(TinyViT())
    state, modules = _state(model), [type(m) for m in model.modules()]
    monkeypatch.setattr(edits, "center_writer", lambda *a, **k: None)  # sabotage the surgery
    with pytest.raises(normswap.NormswapError, match="verification failed.*left unchanged"):
        normswap.patch(model, (torch.randn(2, 3, 32, 32, dtype=torch.float64),))
    assert _same(state, _state(model))
    assert [type(m) for m in model.modules()] == modules


@pytest.mark.parametrize("kwargs,match", [({"mode": "fast"}, "mode must be"), ({"backend": "cuda9"}, "backend")])
def test_invalid_options(kwargs, match):
    with pytest.raises(normswap.NormswapError, match=match):
        normswap.patch(copy.deepcopy(TinyViT()), (torch.randn(1, 3, 32, 32),), **kwargs)


def test_plan_rejects_a_misspelt_option_but_takes_patch_options():
    model = TinyViT()
    with pytest.raises(normswap.NormswapError, match="option 'fold_gama'; did you mean 'fold_gamma'"):
        normswap.plan(model, (torch.randn(1, 3, 32, 32),), fold_gama=True)
    assert normswap.plan(model, (torch.randn(1, 3, 32, 32),), verify=False).sites


@pytest.mark.parametrize("call", ["patch", "plan"])
def test_options_object_and_keywords_are_the_same_conversion(call):
    """One ConvertOptions, or its fields as keywords: the same plan; a bad value fails before any work."""
    example = (torch.randn(1, 3, 32, 32),)
    opts = normswap.ConvertOptions(mode="exact", fold_gamma=True)
    by_object, by_keywords = copy.deepcopy(TinyViT()), copy.deepcopy(TinyViT())
    by_keywords.load_state_dict(by_object.state_dict())
    a = getattr(normswap, call)(by_object, example, options=opts)
    b = getattr(normswap, call)(by_keywords, example, mode="exact", fold_gamma=True)
    plan_a, plan_b = (a if call == "plan" else a.plan), (b if call == "plan" else b.plan)
    assert plan_a.to_dict() == plan_b.to_dict() and plan_a.options["mode"] == "exact"
    assert opts.replace(mode="all").mode == "all" and opts.mode == "exact"  # frozen: replace copies
    with pytest.raises(normswap.NormswapError, match="did you mean 'exact'"):
        normswap.ConvertOptions(mode="exakt")
    with pytest.raises(normswap.NormswapError, match="untie must be True, False or None"):
        normswap.ConvertOptions(untie="no")
    with pytest.raises(normswap.NormswapError, match="did you mean 'mean_carry'"):
        opts.replace(mean_cary=False)
