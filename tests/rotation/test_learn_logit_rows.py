"""The learned rotation's loss on part of the vocabulary (``rotate(model, "learned", logit_top_k=k)``): per
calibration batch, the float model's ``k`` likeliest tokens at each position and the batch's input tokens, and
one class for every other token (its quantized mass estimated from a sample of them); the output head and the
input embedding turned (the head rounded) on those rows alone.

What must hold: the restricted loss compares the full model's quantized logits on the kept rows, and the tail's
log-sum-exp (the test models' tails are smaller than the sample: exact here), against the float model's
log-probabilities of the same classes; so it is at most the full KL (coarse-graining), and with every row kept
it is the full loss; the input embedding read at the batch's tokens sees the turned rows; the
rotation it learns is exact in float64 with γ/β randomised, orthogonal to 1e-12 and mean-keeping, and lowers the
loss; a bad ``k``, or a model whose output is no logits, is refused with the model untouched (CLI: exit 2)."""

import copy

import pytest
import torch
from click.testing import CliRunner

import normswap
from normswap.cli import main
from normswap.errors import NormswapError
from normswap.rotation import learn
from normswap.rotation.rotate import rotate
from tests.rotation.test_rotate_smooth import _dinov2_backbone, _patched_for_rotation, _relative, _run
from tests.zoo import EXACT, build

LMS = {  # heads tied to the input embedding until γ folds: GPT-2 (wte / lm_head), Whisper (embed_tokens / proj_out)
    "gpt2": lambda: build(EXACT, "gpt2"),
    "whisper": lambda: build(EXACT, "whisper"),
}
SETTINGS = dict(seed=0, bits=3, group_size=16, grid="full")


def _calls(monkeypatch, model, calib, **kwargs) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], learn.Learned]:
    """The (quantized output, float reference) pairs the loss compares at ``steps=0`` (both starts scored on
    every batch), and what the learning reported."""
    seen, inner = [], learn.output_error

    def spy(out, ref, logits, mask):
        seen.append((out.detach().clone(), ref.detach().clone()))
        return inner(out, ref, logits, mask)

    monkeypatch.setattr(learn, "output_error", spy)
    rot = rotate(copy.deepcopy(model), "learned", calibration=calib, steps=0, **SETTINGS, **kwargs)
    monkeypatch.setattr(learn, "output_error", inner)
    return seen, rot.learned


@pytest.mark.parametrize("name", sorted(LMS))
def test_the_restricted_loss_is_the_full_models_logits_on_the_kept_rows(name, monkeypatch):
    model = LMS[name]()
    _, _, calib = _patched_for_rotation(model)
    # γ folded into the head unties it: the input embedding is restricted on its own (read at the batch's tokens)
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    vocab = model.get_output_embeddings().weight.shape[0]
    k = 3
    full, full_learned = _calls(monkeypatch, model, calib)
    part, part_learned = _calls(monkeypatch, model, calib, logit_top_k=k)
    assert len(full) == len(part) == 2 * len(calib)  # the Hadamard start, then no rotation, on every batch
    kept = []
    assert vocab <= learn.LOGIT_TAIL_SAMPLE  # the whole tail is the sample: its class is exact
    for (out, ref), (out_k, ref_k), batch in zip(full, part, calib + calib, strict=True):
        ids = [t.reshape(-1) for t in batch.values() if torch.is_tensor(t) and not t.is_floating_point()]
        rows = torch.unique(torch.cat([ref.topk(k, -1).indices.reshape(-1), *ids]))
        tail = torch.tensor([j for j in range(vocab) if j not in set(rows.tolist())])
        kept.append(len(rows))
        logp = ref.log_softmax(-1)
        want_ref = torch.cat([logp[..., rows], logp[..., tail].logsumexp(-1, keepdim=True)], -1)
        assert float((ref_k - want_ref).abs().max()) <= 1e-12
        # the same rows of the same quantized head, on the same (turned) token embeddings; the tail's log-sum-exp
        want = torch.cat([out[..., rows], out[..., tail].logsumexp(-1, keepdim=True)], -1)
        assert float((out_k - want).abs().max()) <= 1e-5 * float(out.abs().max()), name
    assert max(kept) < vocab  # a subset, else this proves nothing about restricting
    for field in ("loss_hadamard", "loss_identity"):  # KL between coarse-grained distributions: at most the full
        assert getattr(part_learned, field) <= getattr(full_learned, field) * (1 + 1e-6), field
    assert part_learned.loss_hadamard != pytest.approx(full_learned.loss_hadamard, rel=1e-6)
    # every row kept: the full loss itself
    _, all_learned = _calls(monkeypatch, model, calib, logit_top_k=vocab)
    for field in ("loss_hadamard", "loss_identity"):
        assert getattr(all_learned, field) == pytest.approx(getattr(full_learned, field), rel=1e-5), field


@pytest.mark.parametrize("name", sorted(LMS))
def test_learned_on_the_top_logits_is_exact_orthogonal_and_lowers_the_loss(name):
    model = LMS[name]()
    probe, ref, calib = _patched_for_rotation(model)
    rot = rotate(model, "learned", calibration=calib, steps=12, lr=2e-2, logit_top_k=4, **SETTINGS)
    assert _relative(_run(model, probe), ref) <= 1e-9, str(rot)
    learned = rot.learned
    assert not learned.kept_start and learned.loss_end < learned.loss_start, str(rot)
    assert "KL on the top 4 logits" in rot.headline() and learned.record()["logit_top_k"] == 4
    assert rot.rotated
    for r in rot.rotated:
        q = r["q"]
        assert float((q.T @ q - torch.eye(q.shape[0], dtype=torch.float64)).abs().max()) <= 1e-12
        assert float((q.sum(dim=1) - 1).abs().max()) <= 1e-12
    assert all(r["learned"]["logit_top_k"] == 4 for r in normswap.plan_of(model).rotations)


@pytest.mark.parametrize("make, kwargs, message", [
    (lambda: build(EXACT, "gpt2"), {"logit_top_k": 0}, "logit_top_k must be an int ≥ 1 or None"),
    (lambda: build(EXACT, "gpt2"), {"logit_top_k": True}, "logit_top_k must be an int ≥ 1 or None"),
    (_dinov2_backbone, {"logit_top_k": 8, "output": "restore"}, "logit_top_k applies to a model whose output is"),
])
def test_bad_requests_are_refused_and_leave_the_model_as_it_was(make, kwargs, message):
    model = make()
    _, _, calib = _patched_for_rotation(model)
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(NormswapError, match=message):
        rotate(model, "learned", calibration=calib, steps=1, **kwargs)
    after = model.state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert not normswap.plan_of(model).rotations
    with pytest.raises(NormswapError, match="apply to a learned rotation"):
        rotate(model, "hadamard", logit_top_k=8)


def test_cli_learn_logit_top_k_needs_rotate_learned(tmp_path):
    res = CliRunner().invoke(main, ["convert", "gpt2", "--out", str(tmp_path / "o"), "--learn-logit-top-k", "64"])
    assert res.exit_code == 2 and "--learn-logit-top-k applies to a learned rotation" in res.output, res.output
    assert not (tmp_path / "o").exists()
    res = CliRunner().invoke(main, ["convert", "gpt2", "--out", str(tmp_path / "o"), "--rotate", "learned",
                                    "--learn-logit-top-k", "0"])
    assert res.exit_code == 2 and "--learn-logit-top-k" in res.output, res.output


def test_a_sampled_tail_stands_for_every_other_token(monkeypatch):
    """A tail larger than the sample: its class is the drawn tokens' log-sum-exp plus log(tail / drawn), the draw
    fixed per batch (the same tokens at every step, so the loss is a fixed function of the rotation)."""
    model = build(EXACT, "gpt2")
    _, _, calib = _patched_for_rotation(model)
    vocab, k, m = model.get_output_embeddings().weight.shape[0], 2, 8
    full, _ = _calls(monkeypatch, model, calib)
    monkeypatch.setattr(learn, "LOGIT_TAIL_SAMPLE", m)
    part, _ = _calls(monkeypatch, model, calib, logit_top_k=k)
    again, _ = _calls(monkeypatch, model, calib, logit_top_k=k)
    for i, ((out, ref), (out_k, _), (out_a, _)) in enumerate(zip(full, part, again, strict=True)):
        batch = calib[i % len(calib)]
        ids = [t.reshape(-1) for t in batch.values() if torch.is_tensor(t) and not t.is_floating_point()]
        rows = torch.unique(torch.cat([ref.topk(k, -1).indices.reshape(-1), *ids]))
        tail = torch.tensor([j for j in range(vocab) if j not in set(rows.tolist())])
        assert len(tail) > m
        gen = torch.Generator().manual_seed(i % len(calib))  # the batch's index seeds its draw
        draw = tail[torch.randperm(len(tail), generator=gen)[:m].sort().values]
        want = out[..., draw].logsumexp(-1) + torch.log(torch.tensor(len(tail) / m, dtype=out.dtype))
        assert out_k.shape[-1] == len(rows) + 1
        assert float((out_k[..., -1] - want).abs().max()) <= 1e-5 * float(out.abs().max())
        assert torch.equal(out_k, out_a)  # the same draw every time
