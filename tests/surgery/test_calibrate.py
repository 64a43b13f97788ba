"""Calibration of approximate norms: streamed least squares, sequential fitting, the built-in set,
retrieval figures, and the unusable-conversion gate. Tiny models built here, offline."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

import normswap
from normswap import inputs
from normswap.errors import NormswapError
from normswap.pipeline import find_norms
from normswap.recipes import losses, models
from normswap.surgery import calibrate
from tests.custom_models import PostLNEncoder, randomise
from tests.zoo import APPROXIMATE, build


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# ---------------------------------------------------------------------------------- the fit
def test_streamed_fit_equals_float64_least_squares_on_all_activations():
    torch.manual_seed(0)
    ln = nn.LayerNorm(24).double()
    with torch.no_grad():
        ln.weight.copy_(1 + 0.5 * torch.randn(24, dtype=torch.float64))
        ln.bias.copy_(0.5 * torch.randn(24, dtype=torch.float64))
    xs = [torch.randn(5, 7, 24, dtype=torch.float64) + 2.0 * torch.randn(5, 7, 1, dtype=torch.float64)
          for _ in range(3)]

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = ln

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.ln(x)

    model = Holder()
    site = find_norms(model, (xs[0],)).sites[0]
    fits = calibrate.fit_norms(model, [calibrate.Target("ln", ln, site)], [((x,), {}) for x in xs])
    fit = fits["ln"]
    # reference: ordinary least squares per channel on every activation at once, float64
    x = torch.cat([x.reshape(-1, 24) for x in xs])
    y = ln(x).detach()
    u = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + ln.eps)
    for i in range(24):
        a = torch.stack([u[:, i], torch.ones_like(u[:, i])], 1)
        g, b = torch.linalg.lstsq(a, y[:, i:i + 1]).solution.flatten()
        assert abs(float(fit.weight[i]) - float(g)) < 1e-9
        assert abs(float(fit.bias[i]) - float(b)) < 1e-9
    residual = float((u * fit.weight + fit.bias - y).norm() / y.norm())
    assert fit.residual_after == pytest.approx(residual, rel=1e-6)
    copied = float((u * ln.weight + ln.bias - y).detach().norm() / y.norm())
    assert fit.residual_before == pytest.approx(copied, rel=1e-6)
    assert fit.residual_after < fit.residual_before
    assert fit.tokens == 3 * 5 * 7


def test_sequential_fit_beats_independent_fit_on_a_deep_post_ln_model():
    totals = {"copy": 0.0, "independent": 0.0, "sequential": 0.0}
    for seed in range(3):
        torch.manual_seed(seed)
        base = randomise(PostLNEncoder(layers=6), seed)
        calib = [(torch.randint(0, 40, (8, 16)),) for _ in range(4)]
        test = torch.randint(0, 40, (16, 16))
        with torch.no_grad():
            ref = base(test)
        for name, kw in (("copy", {"calibration": False}), ("independent", {"calibration": calib,
                                                                             "sequential": False}),
                         ("sequential", {"calibration": calib})):
            m = copy.deepcopy(base)
            report = normswap.patch(m, calib[0], mode="all", allow_unusable=True, **kw)
            with torch.no_grad():
                totals[name] += _rel(m(test), ref)
            if name == "sequential":
                res = report.plan.options["calibration"]["residuals"]
                # 6 attention-output norms; the 6 FFN-output norms are exact (the MLP carries the mean)
                assert len(res) == 6 and all(v["after"] <= v["before"] + 1e-12 for v in res.values())
                assert report.calibration.method == "sequential least squares"
    assert totals["sequential"] < totals["independent"] < totals["copy"], totals


# ---------------------------------------------------------------------------------- the default
def test_default_patch_calibrates_on_the_built_in_set_and_says_so():
    base = build(APPROXIMATE, "bert")
    probe = {"input_ids": torch.randint(3, 99, (4, 12), generator=torch.Generator().manual_seed(3))}
    with torch.no_grad():
        ref = base(**probe).logits
    errors, reports = {}, {}
    for name, cal in (("copy", False), ("default", None)):
        m = copy.deepcopy(base)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reports[name] = normswap.patch(m, mode="all", calibration=cal)
        with torch.no_grad():
            errors[name] = _rel(m(**probe).logits, ref)
    report = reports["default"]
    assert report.calibration is not None and report.calibration.source.startswith("built-in")
    assert "calibration: built-in" in report.message and "calibration: built-in" in str(report)
    assert "heldout_top1_agreement" in report.verification
    assert report.plan.options["calibration"]["source"].startswith("built-in")
    assert "no calibration" in reports["copy"].message and reports["copy"].calibration is None
    assert errors["default"] < 0.7 * errors["copy"], errors


def test_builtin_batches_without_tokenizer_and_for_images():
    bert = build(APPROXIMATE, "bert")
    batches, desc = calibrate.builtin_batches(bert, batches=2, batch_size=4, seq_len=10)
    assert len(batches) == 2 and "no tokenizer" in desc
    ids = batches[0][1]["input_ids"]
    assert ids.shape == (4, 10) and int(ids.min()) >= 0 and int(ids.max()) < 99
    import transformers as tf

    vit = tf.ViTModel(tf.ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, intermediate_size=32))
    batches, desc = calibrate.builtin_batches(vit, batches=1, batch_size=2)
    px = batches[0][1]["pixel_values"]
    assert px.shape == (2, 3, 16, 16) and "generated images" in desc
    # smooth: neighbouring pixels are correlated, unlike white noise
    a, b = px[..., :-1].flatten(), px[..., 1:].flatten()
    assert float(torch.corrcoef(torch.stack([a, b]))[0, 1]) > 0.5


def test_builtin_sentences_ship_with_the_package():
    sents = inputs.builtin_sentences()
    assert len(sents) >= 200 and len(set(sents)) == len(sents)
    assert all(len(s.split()) >= 3 for s in sents)


# ---------------------------------------------------------------------------------- figures
def test_neighbour_figures_match_a_reference():
    scipy_stats = pytest.importorskip("scipy.stats")
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(30, 8, generator=gen, dtype=torch.float64)
    same = calibrate.neighbour_figures(t, t * 3.0)
    assert same == {"top1_neighbour_agreement": 1.0, "recall_at_10": 1.0, "similarity_spearman": pytest.approx(1.0),
                    "neighbour_items": 30.0}
    s = t + 0.5 * torch.randn(30, 8, generator=gen, dtype=torch.float64)
    got = calibrate.neighbour_figures(t, s)
    tn, sn = nn.functional.normalize(t, dim=-1), nn.functional.normalize(s, dim=-1)
    st, ss = tn @ tn.T, sn @ sn.T
    top1 = recall = 0.0
    for i in range(30):
        order_t = [j for j in st[i].argsort(descending=True).tolist() if j != i]
        order_s = [j for j in ss[i].argsort(descending=True).tolist() if j != i]
        # a tie: the original rates the converted choice within TIE_SHARE of its similarity range of its own
        tol = max(calibrate.TIE_SHARE * float(st[i, order_t[0]] - st[i, order_t[-1]]),
                  calibrate.similarity_resolution(torch.float64, 8))
        top1 += float(st[i, order_s[0]]) >= float(st[i, order_t[0]]) - tol
        recall += sum(float(st[i, j]) >= float(st[i, order_t[9]]) - tol for j in order_s[:10]) / 10
    iu = torch.triu_indices(30, 30, 1)
    rho = scipy_stats.spearmanr(st[iu[0], iu[1]].numpy(), ss[iu[0], iu[1]].numpy()).statistic
    assert got["top1_neighbour_agreement"] == pytest.approx(top1 / 30)
    assert got["recall_at_10"] == pytest.approx(recall / 30)
    assert got["similarity_spearman"] == pytest.approx(rho, abs=1e-9)
    assert got["top1_neighbour_agreement"] < 1.0


def test_unusable_thresholds():
    assert calibrate.unusable({"cosine": 0.95, "top1_neighbour_agreement": 0.8}) is None
    assert "cosine" in calibrate.unusable({"cosine": 0.89, "top1_neighbour_agreement": 0.9})
    assert "neighbour" in calibrate.unusable({"cosine": 0.99, "top1_neighbour_agreement": 0.4})
    assert "top-1 agreement" in calibrate.unusable({"top1_agreement": 0.3, "kl": 1.0})
    assert calibrate.unusable({}) is None


# ---------------------------------------------------------------------------------- the gate
@pytest.fixture
def measured_unusable(monkeypatch):
    """Make the held-out measurement report an unusable model (the wiring is what is tested)."""
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: {"cosine": 0.42, "top1_neighbour_agreement": 0.1})


def test_patch_refuses_an_unusable_conversion_and_leaves_the_model_untouched(measured_unusable):
    model = build(APPROXIMATE, "bert")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(calibrate.UnusableConversion) as info:
        normswap.patch(model, mode="all")
    err = info.value
    assert isinstance(err, NormswapError) and err.exit_code == 4
    msg = str(err)
    assert "\n" not in msg and "cosine" in msg and "calibration" in msg and "normswap finetune" in msg
    assert "allow_unusable" in msg
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not any("RMSNorm" in type(m).__name__ for m in model.modules())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = normswap.patch(model, mode="all", allow_unusable=True)
    assert report.changed and report.verification["heldout_cosine"] == 0.42


def test_cli_convert_exits_4_on_an_unusable_conversion_and_writes_nothing(measured_unusable, tmp_path):
    from click.testing import CliRunner

    from normswap.cli import main

    out = tmp_path / "o"
    res = CliRunner().invoke(main, ["convert", "tiny-bert", "--out", str(out), "--mode", "all", "-q"])
    assert res.exit_code == 4, res.output
    assert "unusable" in res.output and "Traceback" not in res.output
    # the CLI user reads CLI words, not the API's keyword arguments
    assert "--allow-unusable" in res.output and "--calibration-data" in res.output
    assert "allow_unusable=" not in res.output and "mode='exact'" not in res.output
    assert not out.exists() or not any(out.iterdir())
    res = CliRunner().invoke(main, ["convert", "tiny-bert", "--out", str(out), "--mode", "all", "-q",
                                    "--allow-unusable"])
    assert res.exit_code == 0, res.output
    manifest = json.loads((out / "config.json").read_text())["normswap"]
    assert manifest["plan"]["options"]["calibration"]["source"].startswith("built-in")


# ---------------------------------------------------------------------------------- recipes
def test_similarity_kl_is_zero_for_the_teacher_and_positive_when_neighbours_move():
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(8, 16, generator=gen)
    assert float(losses.similarity_kl(t, t)) == pytest.approx(0.0, abs=1e-7)
    assert float(losses.similarity_kl(2.5 * t, t)) == pytest.approx(0.0, abs=1e-6)  # scale-free
    s = (t + 0.3 * torch.randn(8, 16, generator=gen)).requires_grad_(True)
    loss = losses.similarity_kl(s, t)
    loss.backward()
    assert float(loss.detach()) > 1e-3 and s.grad is not None and float(s.grad.abs().sum()) > 0
    assert float(losses.similarity_kl(t[:2], t[:2])) == 0.0


def test_sentence_pooling_reads_sentence_transformers_files(tmp_path):
    assert models.sentence_pooling(str(tmp_path)) is None
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    assert models.sentence_pooling(str(tmp_path)) == "cls"
    other = tmp_path / "b"
    (other / "pool").mkdir(parents=True)
    (other / "modules.json").write_text(json.dumps([{"path": "", "type": "sentence_transformers.models.Transformer"},
                                                    {"path": "pool", "type": "sentence_transformers.models.Pooling"}]))
    (other / "pool" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert models.sentence_pooling(str(other)) == "mean"


def test_user_batches_accept_tensors_tuples_dicts_and_built_in_batches():
    ids = torch.ones(2, 3, dtype=torch.long)
    got = calibrate.user_batches([ids, (ids,), {"input_ids": ids}, ((), {"input_ids": ids})])
    assert [(len(a), sorted(k)) for a, k in got] == [(1, []), (1, []), (0, ["input_ids"]), (0, ["input_ids"])]
    with pytest.raises(NormswapError, match="calibration must be"):
        calibrate.user_batches(["text"])


def test_convert_calibrates_with_the_sources_own_tokenizer(tmp_path):
    """A converted directory's built-in calibration uses the tokenizer that came with the source
    (here the preset's), not token ids drawn at random."""
    out = tmp_path / "bert"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.convert("tiny-bert", out, mode="all")
    manifest = json.loads((out / "config.json").read_text())["normswap"]
    source = manifest["plan"]["options"]["calibration"]["source"]
    assert source.startswith("built-in English sentences") and "model tokenizer" in source
