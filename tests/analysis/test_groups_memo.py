"""The remembered row groups (``Analyzer._row_groups``): a plan is the same with and without them.

Placing centering ops asks hundreds of candidate values which groups of features each norm row they reach holds;
the answers are remembered per row map (``convert --writer-centering auto`` on DINOv2-small read the same 50
maps 5,250 times). What could be silently wrong: an answer given for rows that are not the ones asked about:
the same memory read through another view (other strides: other rows), rows written in place since, a refusal
that names the norm first asked about instead of the one asked now. Each would change a plan, or say the wrong
thing in it; the plans below are compared whole with the cache on and off.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import normswap
from normswap.analysis.streams import Analyzer, Reach
from tests import zoo


def _uncached(self: Analyzer, what: tuple, m: torch.Tensor):
    return Analyzer._flat_groups(m, what[1]) if what[0] == "flat" else Analyzer._rows_token_groups(m, *what[1:])


def _whole(plan) -> tuple:
    """Everything a plan holds that a wrong group could change: the manifest and the per-site stream details
    the manifest leaves out, and the ops with where they sit."""
    return plan.to_dict(), repr(plan.sites), repr(plan.hooks)


def _plan(model: torch.nn.Module, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return normswap.plan(model, **options)


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    return {"dinov2": zoo.build({"dinov2": zoo.MORE["dinov2"][0]}, "dinov2"),  # LayerScale after every writer
            "bert": zoo.build(zoo.APPROXIMATE, "bert")}  # Post-LN


@pytest.mark.parametrize("name,options", [
    ("dinov2", {"writer_centering": "weights"}),
    ("dinov2", {"writer_centering": "op"}),
    ("dinov2", {"writer_centering": "auto"}),
    ("dinov2", {"writer_centering": "auto", "per_norm_centering": True}),  # the option with places searched
    ("bert", {"writer_centering": "weights"}),
    ("bert", {"writer_centering": "op"}),
    # every op on a norm's own input (the embeddings' norm too: since round 62 under the option, since round 63
    # with the defaults as well): no place searched, nothing read twice; the plans are still compared
    ("bert", {"writer_centering": "auto", "per_norm_centering": True}),
])
def test_plan_same_with_and_without_the_cache(models, monkeypatch, name, options):
    model = models[name]
    computed: list[int] = []

    def counting(read):
        def counted(*a):
            computed.append(1)
            return read(*a)
        return staticmethod(counted)

    monkeypatch.setattr(Analyzer, "_rows_token_groups", counting(Analyzer._rows_token_groups))
    monkeypatch.setattr(Analyzer, "_flat_groups", counting(Analyzer._flat_groups))
    cached = _plan(model, **options)
    reads = len(computed)
    monkeypatch.setattr(Analyzer, "_remembered", _uncached)
    computed.clear()
    plain = _plan(model, **options)
    assert _whole(cached) == _whole(plain)
    if name != "bert" or options.get("writer_centering") == "op":
        assert reads < len(computed)  # the cache answered some reads: the comparison exercised it


def _analyzer() -> Analyzer:
    """An analyzer of nothing: :meth:`Analyzer._row_groups` reads only the reach it is given."""
    an = Analyzer.__new__(Analyzer)
    an._groups_memo = {}
    return an


def test_a_view_of_the_same_memory_is_other_rows():
    """Same address, dtype and shape, other strides: the transposed map puts 4 tokens in each row."""
    width = 4
    rows = (torch.arange(4)[:, None] * width + torch.arange(width)).double()  # token t, features 0..3
    an = _analyzer()
    groups, why = an._row_groups(0, width, Reach(site_rows={0: rows}, token_width=width), "a")
    assert why == "" and groups == {(0, 1, 2, 3)}
    turned = rows.t()
    assert turned.data_ptr() == rows.data_ptr() and turned.shape == rows.shape
    groups, why = an._row_groups(0, width, Reach(site_rows={0: turned}, token_width=width), "a")
    assert "several tokens" in why and not groups
    assert (groups, why) == Analyzer._token_groups(0, width, Reach(site_rows={0: turned}, token_width=width), "a")


def test_flat_ids_of_a_view_of_the_same_memory_are_other_rows():
    """A raw parameter's flat element ids (a position table read whole by each norm row), then the same memory
    transposed: other rows, other groups; and a refusal there names the norm asked about."""
    width = 4
    ids = torch.arange(16, dtype=torch.float64).reshape(4, 4)
    an = _analyzer()
    assert an._remembered(("flat", width), ids) == ({(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)},
                                                     "")
    turned = ids.t()
    assert turned.data_ptr() == ids.data_ptr()
    assert an._remembered(("flat", width), turned)[0] == {(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14),
                                                          (3, 7, 11, 15)}
    twice = torch.tensor([[0.0, 1.0, 1.0, 2.0]]).expand(3, 4)
    assert an._remembered(("flat", width), twice) == (set(), "repeats features within a row of `{path}`")


def test_rows_written_in_place_are_read_again():
    width = 4
    rows = (torch.arange(3)[:, None] * width + torch.arange(width)).double()
    reach = Reach(site_rows={0: rows}, token_width=width)
    an = _analyzer()
    assert an._row_groups(0, width, reach, "a") == ({(0, 1, 2, 3)}, "")
    rows[1, 2] = 3.0 + width  # token 1's features 3, 3: one feature twice, another not at all
    expected = Analyzer._token_groups(0, width, reach, "a")
    assert "repeats some features" in expected[1]
    assert an._row_groups(0, width, reach, "a") == expected


def test_a_refusal_names_the_norm_asked_about():
    """One map read by two norms (the residual stream): the second refusal names the second norm."""
    width = 4
    rows = torch.arange(2 * width, dtype=torch.float64).reshape(1, 2 * width)  # two tokens in one row
    reach = Reach(site_rows={0: rows, 1: rows}, token_width=width)
    an = _analyzer()
    first = an._row_groups(0, 2 * width, reach, "layer.0.norm")
    second = an._row_groups(1, 2 * width, reach, "layer.1.norm")
    assert "`layer.0.norm`" in first[1] and "`layer.1.norm`" in second[1]
    assert len(an._groups_memo) == 1  # one read of the rows for both


def test_returned_groups_are_the_callers_own():
    """A caller that adds to the set it got must not change what the next caller gets."""
    width = 4
    rows = (torch.arange(2)[:, None] * width + torch.arange(width)).double()
    reach = Reach(site_rows={0: rows}, token_width=width)
    an = _analyzer()
    an._row_groups(0, width, reach, "a")[0].add((9,))
    assert an._row_groups(0, width, reach, "a")[0] == {(0, 1, 2, 3)}


def test_widening_figured_once_per_writer(monkeypatch):
    """``writer_centering="auto"`` figures each writer's widening once, not once per norm it reaches (GPT-2 small:
    300 float64 copies of its writers' weights for 24 writers). The figures themselves are checked against an
    independent computation in ``test_writer_centering_auto.py``."""
    from normswap.analysis import planner

    model = zoo.build(zoo.EXACT, "gpt2")
    asked: list[str] = []
    figure = planner.centering_widening

    def counting(an, path, edits):
        asked.append(path)
        return figure(an, path, edits)

    monkeypatch.setattr(planner, "centering_widening", counting)
    plan = _plan(model, writer_centering="auto")
    recorded = plan.options["writer_widening"]
    assert len(recorded) == 4 and sorted(asked) == sorted(recorded)  # 2 layers x (attention c_proj, MLP c_proj)
