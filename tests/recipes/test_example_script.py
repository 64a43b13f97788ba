"""``examples/recover_post_ln.py`` runs end to end as its docstring says (offline, toy Post-LN model)."""

from __future__ import annotations

import json
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "recover_post_ln.py"

# the script run as ``PYTHONPATH=. python examples/recover_post_ln.py ARGS`` from the checkout runs it: its folder
# first on sys.path, then the checkout (the working directory), its argv
RUN_SCRIPT = """
import os, runpy, sys
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path[0:1] = [os.path.dirname(script), os.getcwd()]
runpy.run_path(script, run_name="__main__")
"""


def test_the_recovery_example_runs_and_writes_its_summary(tmp_path, warm_python):
    """In a child of the warm fork server (``tests/warm_python.py``): a new process that has imported torch and
    transformers' modeling stack, never normswap, as the script's own first lines and first model load would.
    (``TQDM_DISABLE``, set for a fresh interpreter before, only quietened the progress bars on its stderr; tqdm
    reads it when imported, which the server did.)"""
    out = tmp_path / "run"
    proc = warm_python.run(RUN_SCRIPT, str(EXAMPLE), "--task", "causal-lm", "--threads", "1", "--steps", "20",
                           "--out", str(out), "eval.every=10", cwd=EXAMPLE.parents[1], timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "causal-lm" and summary["steps"] == 20
    # the saved directory, re-measured from disk, computes what the run reported
    assert abs(summary["saved_dir_metrics"]["kl"] - summary["after"]["kl"]) <= 1e-6 * max(1.0, summary["after"]["kl"])
    assert summary["before"]["top1_agreement"] < 1.0  # Post-LN: the conversion is approximate
