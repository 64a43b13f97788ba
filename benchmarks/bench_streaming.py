"""Peak memory and time of the low-memory (streaming) conversion on a synthetic multi-shard checkpoint.

Builds a GPT-2-style checkpoint of about 1.5 GB (float32, 26 layers, width 1024, vocabulary 50257,
random weights with randomised LayerNorm γ/β) in shards of 400 MB, converts it with
``normswap convert --low-memory`` in a child process and reports the child's peak RSS
(``wait4`` rusage), which must stay below ``0.5 × checkpoint size + 1 GB``. With
``--compare-in-memory`` it also runs the in-memory path and checks the two outputs are bitwise
identical, tensor by tensor.

Reproduce::

    python benchmarks/bench_streaming.py                      # streaming only
    python benchmarks/bench_streaming.py --compare-in-memory  # + in-memory run and equality check
    python benchmarks/bench_streaming.py --layers 8 --keep    # smaller; keep the files in --workdir

Nothing touches the network.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

CLI = [sys.executable, "-c", "from normswap.cli import main; main()"]


def make_checkpoint(out: Path, *, layers: int, width: int, vocab: int, shard_mb: int, seed: int = 0) -> int:
    """Write a random GPT-2-style checkpoint tensor by tensor; returns its size in bytes."""
    import transformers as tf
    from safetensors.torch import save_file

    config = tf.GPT2Config(
        n_layer=layers,
        n_embd=width,
        n_head=width // 64,
        vocab_size=vocab,
        n_positions=1024,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    with torch.device("meta"):
        meta = tf.GPT2LMHeadModel(config)
    out.mkdir(parents=True, exist_ok=True)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(out)
    gen = torch.Generator().manual_seed(seed)
    names = [(n, p.shape) for n, p in meta.named_parameters()]  # deduplicated: the tied head is skipped
    shards: list[list[tuple[str, torch.Size]]] = [[]]
    used = 0
    for name, shape in names:
        n = shape.numel() * 4
        if shards[-1] and used + n > shard_mb * 10**6:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += n
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard:
            leaf = name.rsplit(".", 1)[-1]
            if "ln" in name and leaf == "weight":
                t = 1.0 + 0.1 * torch.randn(shape, generator=gen)
            elif leaf == "bias":
                t = 0.02 * torch.randn(shape, generator=gen)
            else:
                t = 0.02 * torch.randn(shape, generator=gen)
            tensors[name] = t
            weight_map[name] = fname
            total += t.numel() * 4
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return total


def run_measured(cmd: list[str]) -> tuple[int, float, int, str]:
    """Run ``cmd``; return (exit code, seconds, peak RSS bytes of that child, output tail)."""
    with tempfile.TemporaryFile(mode="w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage (ru_maxrss in KiB on Linux)
        elapsed = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        tail = log.read()[-2000:]
    return proc.returncode, elapsed, usage.ru_maxrss * 1024, tail


def tensors_equal(a: Path, b: Path) -> tuple[int, list[str]]:
    from safetensors import safe_open

    def keys(d: Path) -> dict[str, Path]:
        found = {}
        for f in sorted(d.glob("*.safetensors")):
            with safe_open(str(f), "pt") as h:
                for k in h.keys():
                    found[k] = f
        return found

    ka, kb = keys(a), keys(b)
    diff = sorted(set(ka) ^ set(kb))
    for k in sorted(set(ka) & set(kb)):
        with safe_open(str(ka[k]), "pt") as ha, safe_open(str(kb[k]), "pt") as hb:
            if not torch.equal(ha.get_tensor(k), hb.get_tensor(k)):
                diff.append(k)
    return len(ka), diff


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--shard-mb", type=int, default=400)
    ap.add_argument("--out-shard", default="500MB", help="--max-shard-size of the converted checkpoint")
    ap.add_argument("--workdir", default=None, help="where to put the checkpoints (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    ap.add_argument("--compare-in-memory", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="normswap-bench-"))
    src, out_s, out_m = work / "src", work / "streamed", work / "in-memory"
    for d in (out_s, out_m):
        shutil.rmtree(d, ignore_errors=True)
    results: dict = {"layers": args.layers, "width": args.width, "vocab": args.vocab}
    try:
        if not (src / "model.safetensors.index.json").exists():
            t = time.perf_counter()
            size = make_checkpoint(
                src, layers=args.layers, width=args.width, vocab=args.vocab, shard_mb=args.shard_mb
            )
            print(
                f"synthetic checkpoint: {size / 1e9:.2f} GB in {len(list(src.glob('*.safetensors')))} shards "
                f"({time.perf_counter() - t:.1f} s)"
            )
        size = sum(f.stat().st_size for f in src.glob("*.safetensors"))
        results["checkpoint_bytes"] = size
        results["shards"] = len(list(src.glob("*.safetensors")))
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        os.environ.update(env)
        cli = [
            *CLI,
            "convert",
            str(src),
            "--out",
            str(out_s),
            "--low-memory",
            "--max-shard-size",
            args.out_shard,
            "-q",
        ]
        code, secs, peak, tail = run_measured(cli)
        budget = 0.5 * size + 1e9
        results.update(
            streaming_seconds=round(secs, 1),
            streaming_peak_rss_bytes=peak,
            budget_bytes=int(budget),
            within_budget=peak <= budget,
            streaming_exit=code,
        )
        print(tail.strip().splitlines()[-3:] if tail.strip() else "")
        print(
            f"streaming: exit {code}, {secs:.1f} s, peak RSS {peak / 1e9:.2f} GB "
            f"(budget 0.5 x {size / 1e9:.2f} GB + 1 GB = {budget / 1e9:.2f} GB): "
            f"{'OK' if peak <= budget else 'OVER BUDGET'}"
        )
        if args.compare_in_memory and code == 0:
            cli_m = [
                *CLI,
                "convert",
                str(src),
                "--out",
                str(out_m),
                "--in-memory",
                "--max-shard-size",
                args.out_shard,
                "-q",
            ]
            code_m, secs_m, peak_m, tail_m = run_measured(cli_m)
            results.update(
                in_memory_seconds=round(secs_m, 1), in_memory_exit=code_m, in_memory_peak_rss_bytes=peak_m
            )
            print(f"in-memory: exit {code_m}, {secs_m:.1f} s, peak RSS {peak_m / 1e9:.2f} GB")
            if code_m == 0:
                n, diff = tensors_equal(out_s, out_m)
                results.update(tensors=n, tensors_differing=len(diff))
                print(f"bitwise comparison: {n} tensors, {len(diff)} differ {diff[:3]}")
            else:
                print(tail_m)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        print(json.dumps(results, indent=2))
        return 0 if code == 0 and results["within_budget"] else 1
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
