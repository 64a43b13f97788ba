"""Rank the test suite's files by summed time, before against after (docs/results/test-suite.md).

Reads the logs of two full runs made with ``--durations=0`` (every setup, call and teardown line) and sums
each file's phases: many 1-3 s tests in one file can outweigh the slowest single test, and a module
fixture's cost lands in its first test's setup. Prints the top files of the first run with both sums and
writes the per-file and per-test sums as JSON.

Usage::

    nice -n 10 python -m pytest -q --durations=0 > before.log   # on each tree, one full run each
    python benchmarks/suite_durations.py before.log after.log --top 25 --json docs/results/test_suite57.json

The sums are per-test wall-clock seconds as pytest reports them (xdist workers side by side), so they
follow the machine's load; the suite's CPU time comes from ``/usr/bin/time -v`` around the same runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

LINE = re.compile(r"^([\d.]+)s (setup|call|teardown)\s+(\S+?)::(.*)$")
SUMMARY = re.compile(r"^(\d+) passed.* in ([\d.]+)s")


def parse(path: Path) -> dict:
    """Per-file and per-test summed seconds (setup + call + teardown) and the run's summary line."""
    files: collections.Counter[str] = collections.Counter()
    setup: collections.Counter[str] = collections.Counter()
    tests: collections.Counter[str] = collections.Counter()
    summary = None
    for raw in path.read_text(errors="replace").splitlines():
        line = raw.strip()
        m = LINE.match(line)
        if m:
            seconds, phase, file, name = float(m.group(1)), m.group(2), m.group(3), m.group(4)
            files[file] += seconds
            tests[f"{file}::{name}"] += seconds
            if phase == "setup":
                setup[file] += seconds
        elif SUMMARY.match(line):
            summary = line
    return {"files": dict(files), "setup": dict(setup), "tests": dict(tests), "summary": summary,
            "total": sum(files.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    before, after = parse(args.before), parse(args.after)
    print("| file | before (s) | after (s) | after/before |\n|---|---:|---:|---:|")
    ranked = sorted(before["files"], key=before["files"].get, reverse=True)[: args.top]
    for f in ranked:
        b, a = before["files"][f], after["files"].get(f, 0.0)
        print(f"| `{f}` | {b:.1f} | {a:.1f} | {a / b:.2f} |")
    b, a = before["total"], after["total"]
    print(f"| **all files** | {b:.1f} | {a:.1f} | {a / b:.2f} |")
    print("before:", before["summary"])
    print("after: ", after["summary"])
    gone = sorted(set(before["tests"]) - set(after["tests"]))
    if gone:
        print(f"{len(gone)} test ids in the first run's list only (pytest leaves out those under 0.005 s)")
    if args.json:  # every file; of the tests, those of a second or more in either run
        slow = {t for run in (before, after) for t, s in run["tests"].items() if s >= 1.0}
        for run in (before, after):
            run["tests"] = {t: s for t, s in run["tests"].items() if t in slow}
        args.json.write_text(json.dumps({"before": before, "after": after}, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
