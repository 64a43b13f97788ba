"""A Post-LN encoder's default conversion with its embedding tables kept or centered (rounds 62-63).

Round 62 added, under ``per_norm_centering``, a rule that keeps a BERT-family encoder's word, position and
token-type tables and lets the embeddings' norm center its own input (``normswap.analysis.planner._table_ops``);
round 63 made it the default. This script measures one against the other in the same process, per variant
(nothing else in the process changes): it runs ``bench_openvino.py``, ``bench_quant_encoders.py`` or
``postln_default_speed.py`` with two more variants,

* ``converted-keep-tables``: the CLI's default conversion (β kept), planned with the tables' rule applied as under
  ``per_norm_centering`` and nothing else changed (the mean carry, the approximate attention-output norms and their
  calibration are the default's). On round 62's code this is the proposal; since round 63 it is ``converted-keep``.
* ``converted-keep-centered``: the CLI's default conversion with the tables' rule switched off unless
  ``per_norm_centering`` asks for it: round 62's default (the tables centered row by row, the embeddings' norm an
  exact RMSNorm without an op).

    python benchmarks/table_ops_default.py openvino quant --model DIR --texts 256 --modes fp32 w8 \\
        --variants original converted-keep converted-keep-centered --json ov.json
    python benchmarks/table_ops_default.py encoders --model DIR --texts 256 --quantizers fp32 dyn-pt dyn-pc \\
        --variants original converted-keep converted-keep-centered --json ort.json
    python benchmarks/table_ops_default.py speed DIR --engines eager,ort --tokens 8 128 \\
        --variants converted-keep-centered converted-keep --json speed.json
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quant_encoders as encoders  # noqa: E402 (the benchmarks folder is on the path only now)

from normswap.analysis import planner  # noqa: E402

KEPT = "converted-keep-tables"
CENTERED = "converted-keep-centered"
# round 64: the default (β kept) with each mean carry re-planned as two pairs of scales s and s/R, the first pair's
# entries on one grid (``carry_row_grids.two_scale``): ``converted-keep-twoscale16-asym`` is R = 16 on each row's
# INT8_ASYM grid (NNCF int8 weights); -sym: the per-row symmetric grid; -multi: whole per-tensor steps chosen near both
TWOSCALE = {f"converted-keep-twoscale{r}-{t}": (float(r), t) for r in (4, 16) for t in ("asym", "sym", "multi")}


@contextlib.contextmanager
def tables_rule(on: bool) -> Iterator[None]:
    """Plan with the tables' rule applied whatever the options (``on``), or only under ``per_norm_centering``
    (round 62's default: the tables centered)."""
    rule = planner._table_ops

    def ruled(st: planner.Planning) -> None:
        if not on and not st.per_norm_centering:
            return
        asked, st.per_norm_centering = st.per_norm_centering, True
        try:
            rule(st)
        finally:
            st.per_norm_centering = asked

    planner._table_ops = ruled
    try:
        yield
    finally:
        planner._table_ops = rule


def add_variants() -> None:
    """``converted-keep-tables`` and ``converted-keep-centered`` as variants of ``bench_quant_encoders.build``
    (which ``bench_openvino`` and ``postln_default_speed`` call too): the default conversion, β kept, with the
    tables' rule on or off for that variant's conversion alone."""
    build = encoders.build

    def built(name: str, original, model_dir):
        if name in TWOSCALE:
            return two_scale_variant(original, model_dir, *TWOSCALE[name])
        if name not in (KEPT, CENTERED):
            return build(name, original, model_dir)
        with tables_rule(name == KEPT):
            return build(name, original, model_dir)

    for name in (KEPT, CENTERED, *TWOSCALE):
        encoders.OPTIONS[name] = {"beta_placement": "keep"}
    encoders.CONVERTED = (*encoders.CONVERTED, KEPT, CENTERED, *TWOSCALE)
    encoders.VARIANTS = (*encoders.VARIANTS, KEPT, CENTERED, *TWOSCALE)
    encoders.build = built


def two_scale_variant(original, model_dir, ratio: float, target: str):
    """The default conversion (β kept) with every mean carry re-planned by ``carry_row_grids.two_scale`` (round 64;
    exact in float): each row's first column entry on one grid (``target``, ``carry_row_grids.row_entries``), a second
    pair of scale ``s/ratio`` taking the remainder."""
    import copy
    import warnings

    import carry_row_grids

    import normswap

    model = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = normswap.patch(model, tokenizer=str(model_dir), beta_placement="keep")
    lines = carry_row_grids.two_scale(model, report.plan.mean_carries, ratio, target)
    return model, f"{report.plan.summary()}; two-scale carry, s/s2 = {ratio:g}, {target}: " + "; ".join(lines)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("openvino", "encoders", "speed"):
        raise SystemExit("usage: table_ops_default.py {openvino|encoders|speed} ARGS... (see the docstring)")
    which, argv = sys.argv[1], sys.argv[2:]
    add_variants()
    if which == "encoders":
        encoders.main(argv)
        return
    if which == "speed":
        import postln_default_speed

        # the first two variants are also timed against each other: the tables centered, then kept
        postln_default_speed.main(argv if "--variants" in argv else [*argv, "--variants", CENTERED, "converted-keep"])
        return
    import bench_openvino

    sys.argv = [sys.argv[0], *argv]
    bench_openvino.main()


if __name__ == "__main__":
    main()
