"""What would the *default* conversion of a Post-LN encoder quantize like with its embedding tables kept? (round 62)

Since round 62, ``per_norm_centering`` keeps a BERT-family encoder's word, position and token-type tables (the
embeddings' norm centers its own input: ``normswap.analysis.planner._table_ops``). The defaults (mean carry, no
per-norm ops) still center the tables. This script measures the proposal to take that rule into the defaults
without changing the product: it runs ``bench_openvino.py`` or ``bench_quant_encoders.py`` with one extra variant,
``converted-keep-tables`` (the CLI's default conversion, β kept), planned with ``_table_ops`` applied as under
``per_norm_centering`` and nothing else changed (the mean carry, the approximate attention-output norms and
their calibration are the default's). The rule is switched on for every conversion in the process, so pass that
variant alone with ``--baseline`` (an earlier run's original, same texts):

    python benchmarks/table_ops_default.py openvino quant --model DIR --texts 256 --modes fp32 w8 \\
        --variants converted-keep-tables --baseline ov.json --json ov_tables.json
    python benchmarks/table_ops_default.py encoders --model DIR --texts 256 --quantizers fp32 dyn-pt dyn-pc \\
        --variants converted-keep-tables --baseline ort.json --json ort_tables.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quant_encoders as encoders  # noqa: E402 (the benchmarks folder is on the path only now)

from normswap.analysis import planner  # noqa: E402

VARIANT = "converted-keep-tables"


def keep_tables_by_default() -> None:
    """Plan every conversion of this process with the tables' rule of ``per_norm_centering`` (only that rule)."""
    rule = planner._table_ops

    def tables_kept(st: planner.Planning) -> None:
        asked, st.per_norm_centering = st.per_norm_centering, True
        try:
            rule(st)
        finally:
            st.per_norm_centering = asked

    planner._table_ops = tables_kept
    encoders.OPTIONS[VARIANT] = {"beta_placement": "keep"}
    encoders.CONVERTED = (*encoders.CONVERTED, VARIANT)
    encoders.VARIANTS = (*encoders.VARIANTS, VARIANT)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("openvino", "encoders"):
        raise SystemExit("usage: table_ops_default.py {openvino|encoders} ARGS... (see the docstring)")
    which, argv = sys.argv[1], sys.argv[2:]
    keep_tables_by_default()
    if which == "encoders":
        encoders.main(argv)
        return
    import bench_openvino

    sys.argv = [sys.argv[0], *argv]
    bench_openvino.main()


if __name__ == "__main__":
    main()
