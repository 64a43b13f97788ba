"""The usability gate measures what a user of the output would see.

Random tiny models give held-out outputs that a strict neighbour argmax misreads: clusters of
near-duplicate embeddings whose order the original itself decides by rounding, identical outputs for
every input, and decoder states (per token, per object query) that nobody mean-pools into one
embedding. These tests pin the rule (ties within the original's own resolution agree; items the
original does not tell apart are not judged; decoder states are judged per position) and that a
genuinely broken conversion is still refused.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers as tf

import normswap
from normswap.surgery import calibrate
from tests.zoo import ENC_DEC, LLM, randomise


def _normal(n: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---------------------------------------------------------------------------------- the figures
def test_twins_the_original_cannot_order_count_as_agreeing():
    """Items with an exact twin (RT-DETR's decoder states: 21 of 32): for a third item both twins are the
    nearest neighbour, and which one argmax returns is rounding. The converted model picking the other
    twin agrees."""
    base = _normal(12, 16, 0)
    teacher = torch.cat([base, base])  # every item has an exact twin
    student = teacher + 1e-9 * _normal(24, 16, 1)  # far below the items' spread, enough to reorder twins
    strict = (calibrate.neighbour_figures(teacher[:, :], teacher).get("top1_neighbour_agreement"))
    assert strict == 1.0
    got = calibrate.neighbour_figures(teacher, student)
    assert got["top1_neighbour_agreement"] == 1.0 and got["recall_at_10"] == 1.0
    assert got["neighbour_items"] == 24


def test_near_duplicate_clusters_below_the_tie_share_agree():
    """GroupViT-like: 4 clusters of 8 near-duplicates 1e-10 apart, while an item's similarities span
    ~1; a conversion that moves similarities by 1e-8 reorders members of a cluster, never clusters."""
    centres = _normal(4, 16, 2)
    teacher = centres.repeat_interleave(8, 0) + 1e-10 * _normal(32, 16, 3)
    student = teacher + 1e-8 * _normal(32, 16, 4)
    tn = torch.nn.functional.normalize(teacher, dim=-1)
    sn = torch.nn.functional.normalize(student, dim=-1)
    eye = torch.eye(32, dtype=torch.bool)
    strict = float(((tn @ tn.T).masked_fill(eye, -2).argmax(1) == (sn @ sn.T).masked_fill(eye, -2).argmax(1))
                   .double().mean())
    assert strict < 0.5  # what the gate used to see
    got = calibrate.neighbour_figures(teacher, student)
    assert got["top1_neighbour_agreement"] == 1.0


def test_outputs_the_original_does_not_tell_apart_are_not_judged():
    """D-FINE's and WavTokenizer's tiny outputs are the same for every input (to 1e-15): no item has a
    nearest neighbour, so there is no neighbour figure (the gate then reads the cosine alone)."""
    teacher = _normal(1, 16, 5).repeat(32, 1) + 1e-17 * _normal(32, 16, 6)
    student = teacher + 1e-6 * _normal(32, 16, 7)
    assert calibrate.neighbour_figures(teacher, student) == {}
    # in float32, similarities 1e-9 apart are rounding too
    near = _normal(1, 64, 8).repeat(8, 1) + 1e-9 * _normal(8, 64, 9)
    assert calibrate.neighbour_figures(near, near + 1e-7 * _normal(8, 64, 10),
                                       calibrate.similarity_resolution(torch.float32, 64)) == {}


def test_scrambled_neighbours_are_still_unusable():
    """Ties excuse nothing else: a student whose embeddings are the original's in another order keeps
    the cosine of most items low and its neighbours wrong, on well spread items."""
    teacher = _normal(40, 16, 11)
    student = teacher[torch.randperm(40, generator=torch.Generator().manual_seed(0))] + 0.01 * _normal(40, 16, 12)
    got = calibrate.neighbour_figures(teacher, student)
    assert got["top1_neighbour_agreement"] < 0.2 and got["neighbour_items"] == 40
    assert "neighbour" in calibrate.unusable({"cosine": 0.95, **got})


def test_unusable_reads_the_decoder_state_cosine():
    assert calibrate.unusable({"state_cosine": 0.99}) is None
    assert "decoder-state cosine" in calibrate.unusable({"state_cosine": 0.5})


# ---------------------------------------------------------------------------------- through patch()
def _post_ln_bert() -> torch.nn.Module:
    torch.manual_seed(0)
    return randomise(tf.BertModel(tf.BertConfig(**LLM), add_pooling_layer=False), 0)


def _marian() -> torch.nn.Module:
    torch.manual_seed(0)
    return randomise(tf.MarianModel(tf.MarianConfig(**ENC_DEC)), 0)


@pytest.fixture
def broken_fits(monkeypatch):
    """Every approximate norm's fit replaced by its channels shuffled: a conversion that runs and is wrong."""
    fit = calibrate._Sums.fit

    def shuffled(self):
        g, b = fit(self)
        perm = torch.randperm(g.numel(), generator=torch.Generator().manual_seed(0))
        return g.reshape(-1)[perm].reshape(g.shape), b.reshape(-1)[perm].reshape(b.shape)

    monkeypatch.setattr(calibrate._Sums, "fit", shuffled)


def _patch(model: torch.nn.Module) -> normswap.Report:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return normswap.patch(model)


def test_encoder_conversion_is_judged_on_neighbours_and_accepted():
    report = _patch(_post_ln_bert())
    figs = report.plan.options["calibration"]["figures"]
    assert {"cosine", "top1_neighbour_agreement", "recall_at_10", "neighbour_items"} <= figs.keys()
    assert figs["top1_neighbour_agreement"] >= calibrate.MIN_TOP1 and figs["neighbour_items"] > 0


def test_broken_encoder_conversion_is_refused(broken_fits):
    model = _post_ln_bert()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(calibrate.UnusableConversion, match="unusable"):
        _patch(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_decoder_states_are_judged_per_position():
    """MarianModel's output is its decoder's token states: judged by their per-position cosine (what
    MarianMTModel's head reads), not by neighbours among mean-pooled decoder states (0.156 on the
    sweep's tiny Marian, while the MT head's top-1 agreement was 0.91)."""
    report = _patch(_marian())
    figs = report.plan.options["calibration"]["figures"]
    assert set(figs) == {"state_cosine"} and figs["state_cosine"] >= calibrate.MIN_COSINE


def test_broken_decoder_conversion_is_refused(broken_fits):
    with pytest.raises(calibrate.UnusableConversion, match="decoder-state cosine"):
        _patch(_marian())
