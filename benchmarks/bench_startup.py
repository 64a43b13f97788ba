"""How fast the command line answers when it has nothing heavy to do (issue 11: < 0.5 s).

Runs each command a few times in a fresh process and prints min / median wall time, plus the
CPU time of the fastest run (on a loaded machine wall time includes waiting for a core; CPU time
does not). ``--help`` and argument errors must not import torch or transformers; ``backends``
has to ask torch what devices exist, so it pays torch's import.

    python benchmarks/bench_startup.py            # 5 runs each
    python benchmarks/bench_startup.py --runs 10
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "normswap --help": ["--help"],
    "normswap convert --help": ["convert", "--help"],
    "normswap convert (missing --out)": ["convert", "tiny-gpt2"],
    "normswap convert --mode bogus": ["convert", "tiny-gpt2", "--out", "x", "--mode", "bogus"],
    "convert --max-shard-size banana": ["convert", "tiny-gpt2", "--out", "x", "--max-shard-size", "banana"],
    "convert --seed 3 (no --rotate)": ["convert", "tiny-gpt2", "--out", "x", "--seed", "3"],
    "convert --no-bias-slots": ["convert", "tiny-gpt2", "--out", "x", "--no-bias-slots"],
    "convert --low-memory --rotate": ["convert", "tiny-gpt2", "--out", "x", "--low-memory", "--rotate", "hadamard"],
    "convert --calibration-data missing": ["convert", "tiny-gpt2", "--out", "x", "--calibration-data", "nope.txt"],
    "finetune NAME --print-config": ["finetune", "distill-masked-lm", "--print-config"],
    "normswap finetune --list": ["finetune", "--list"],
    "normswap backends": ["backends"],
}


def time_one(argv: list[str]) -> tuple[float, float, int]:
    """(wall s, child CPU s, exit code) of one fresh process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    base = [sys.executable, "-m", "normswap"]  # the normswap on sys.path (a checkout's, with PYTHONPATH)
    print(f"{'command':36} {'exit':>4} {'min s':>7} {'median s':>9} {'cpu s (min)':>12}")
    for label, cmd in COMMANDS.items():
        runs = [time_one(base + cmd) for _ in range(args.runs)]
        walls = [r[0] for r in runs]
        cpu = min(r[1] for r in runs)
        print(f"{label:36} {runs[0][2]:4d} {min(walls):7.2f} {statistics.median(walls):9.2f} {cpu:12.2f}")


if __name__ == "__main__":
    main()
