"""The transaction behind ``patch``: what the working copy shares with the user's model, what the
surgery may write, and what verification runs."""

import copy

import pytest
import torch

import normswap
from normswap import pipeline
from normswap.inputs import hf_example_inputs
from normswap.surgery import edits, verify
from tests.zoo import EXACT, build


def test_float64_patch_adopts_edited_tensors_and_leaves_the_rest_in_place():
    """A float64 model is not copied whole: parameters the plan does not edit keep their storage, the
    edited ones are replaced (same Parameter objects), and the untied head keeps the original values."""
    model = build(EXACT, "gpt2")
    reference = copy.deepcopy(model)
    params = dict(model.named_parameters())
    storage = {n: p.data_ptr() for n, p in params.items()}
    head = model.lm_head.weight.detach().clone()
    probe = hf_example_inputs(model, seed=5)

    report = normswap.patch(model, untie=True)

    written = edits.written_parameters(report.plan, reference)
    assert written and "transformer.h.0.attn.c_attn.weight" not in written
    after = dict(model.named_parameters())
    norms = tuple(f"{sp.name}." for sp in report.plan.sites if sp.convert)
    for name, p in params.items():
        if name.startswith(norms):  # a LayerNorm, replaced by an RMSNorm
            continue
        assert after[name] is p, name  # the user's Parameter objects stay
        if name in written:
            assert p.data_ptr() != storage[name], name
        else:
            assert p.data_ptr() == storage[name], name
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert torch.equal(model.lm_head.weight, head)
    with torch.no_grad():
        a, b = reference(**probe).logits, model(**probe).logits
    assert float((a - b).abs().max() / a.abs().max()) < 1e-12


def test_an_unlisted_in_place_write_is_caught_before_the_commit(monkeypatch):
    """If the surgery wrote a parameter that written_parameters does not list, that tensor is the
    user's own: the conversion must stop with an internal error, not commit or claim success."""
    model = build(EXACT, "gpt2-untied")
    real = edits.written_parameters
    monkeypatch.setattr(edits, "written_parameters",
                        lambda plan, m: {n for n in real(plan, m) if "c_proj" not in n})
    modules = [type(m) for m in model.modules()]
    with pytest.raises(normswap.NormswapError, match="internal error.*c_proj"):
        normswap.patch(model)
    assert [type(m) for m in model.modules()] == modules  # nothing committed


def test_plan_leaves_every_tensor_of_a_float64_model_unwritten():
    model = build(EXACT, "gpt2")
    before = pipeline.versions(model)
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    normswap.plan(model)
    assert pipeline.versions(model) == before
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == storage


def test_verification_runs_the_converted_model_on_an_unseen_probe(monkeypatch):
    """The converted model is compared on inputs the analysis never traced (another batch and length)."""
    model = build(EXACT, "gpt2")
    traced = hf_example_inputs(model)["input_ids"].shape
    compared = []
    real = pipeline.compare

    def spy(reference, converted, *args, **kwargs):
        compared.append(tuple(converted.logits.shape[:2]))
        return real(reference, converted, *args, **kwargs)

    monkeypatch.setattr(pipeline, "compare", spy)
    report = normswap.patch(model)
    # one comparison, on the probe: it reached every converted norm, so the traced batch is not rerun
    assert len(compared) == 1 and compared[0] != tuple(traced)
    assert report.verification["unseen_probe_max_rel_error"] == report.verification["max_rel_error"] < 1e-12
    assert report.verification["output"] == "logits"
    assert verify.exact_limit(torch.float64) > report.verification["max_rel_error"]


class _ShortInputsOnly(torch.nn.Module):
    """A transformers-like model with a norm that only inputs of at most 8 tokens reach."""

    main_input_name = "input_ids"

    def __init__(self) -> None:
        super().__init__()
        import transformers as tf

        self.config = tf.PretrainedConfig(vocab_size=50, max_position_embeddings=64)
        self.emb = torch.nn.Embedding(50, 16)
        self.ln_short, self.mid = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)
        self.ln_f, self.head = torch.nn.LayerNorm(16), torch.nn.Linear(16, 50)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.emb(input_ids)
        if input_ids.shape[1] <= 8:
            h = h + self.mid(self.ln_short(h))
        return {"logits": self.head(self.ln_f(h))}


def test_the_traced_inputs_run_too_when_the_probe_misses_a_converted_norm(monkeypatch):
    """Every converted norm needs its zero-mean evidence: a norm the (longer) probe never reaches is
    checked on the traced inputs, which then also count towards the figures."""
    torch.manual_seed(0)
    model = _ShortInputsOnly().double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    compared = []
    real = pipeline.compare

    def spy(reference, converted, *args, **kwargs):
        compared.append(tuple(converted["logits"].shape[:2]))
        return real(reference, converted, *args, **kwargs)

    monkeypatch.setattr(pipeline, "compare", spy)
    report = normswap.patch(model)
    assert {sp.name for sp in report.plan.sites if sp.convert} == {"ln_short", "ln_f"}
    assert compared[0] != compared[1] and compared[1] == tuple(hf_example_inputs(model)["input_ids"].shape)
    assert report.verification["max_stream_mean_ratio"] < 1e-12
    assert report.verification["max_rel_error"] < 1e-12
