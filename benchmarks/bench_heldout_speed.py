"""Speed of a real checkpoint against what ``normswap convert`` wrote for it, side by side in one run.

``bench_deploy_speed.py`` times models it builds (random weights at GPT-2/BERT/ViT sizes); this times two
directories: the original checkpoint and the CLI's output (``normswap convert ORIGINAL --out CONVERTED``,
native format, loaded with ``normswap.load``), so a held-out checkpoint is timed as users would run it.
The timing machinery is ``bench_deploy_speed``'s: one thread, interleaved ABBA quads per cell, the
median converted/original ratio with its quartiles, ORT sessions created in both orders and second torch
copies allocated in the opposite order (``--control`` adds the original against itself: the noise floor).
Engines: ``ort`` (``torch.onnx.export(dynamo=True)``, ONNX Runtime's CPU provider, default optimisation),
``ortfuse`` (the converted export through ``normswap.integrations.onnx.fuse_norms``), ``eager``, ``compile``
(``torch.compile(dynamic=True)``, inductor; at batches above 1 only unless ``--compile-batch1``, as
``bench_deploy_speed``: a batch of 1 is specialised, a second compile per model).

Inputs: vision models (a config with ``image_size``) get ``pixel_values`` at each ``--sizes`` side;
text models ``input_ids`` of ``--sizes`` tokens. Only ``last_hidden_state`` is returned (the body: a
checkpoint with a task head, a causal LM say, is timed without it, both sides loaded as ``AutoModel`` /
the converted model's ``base_model``).

    python benchmarks/bench_heldout_speed.py ORIGINAL_DIR CONVERTED_DIR --label dinov2-small \\
        --sizes 112,224 --batches 1,4 --engines ort,ortfuse,eager --budget 8 --control --json out.json

Goal (issue 40): converted/original <= 1.00 in every cell.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_deploy_speed as deploy  # noqa: E402 (the benchmarks folder is on the path only now)


def is_vision(model: torch.nn.Module) -> bool:
    return hasattr(model.config, "image_size") and hasattr(model.config, "num_channels")


def tokens(model: torch.nn.Module, size: int) -> int:
    """Sequence length the body sees: patches plus the class token for vision, ``size`` for text."""
    if is_vision(model):
        return (size // model.config.patch_size) ** 2 + 1
    return size


def example(model: torch.nn.Module, batch: int, size: int) -> tuple[torch.Tensor, ...]:
    """Seeded inputs: ``pixel_values`` of ``size`` px, or ``input_ids`` and a full mask of ``size`` tokens."""
    gen = torch.Generator().manual_seed(batch * 1000 + size)
    if is_vision(model):
        return (torch.randn(batch, model.config.num_channels, size, size, generator=gen),)
    ids = torch.randint(100, min(20000, model.config.vocab_size), (batch, size), generator=gen)
    return ids, torch.ones_like(ids)


def keys(model: torch.nn.Module) -> tuple[str, ...]:
    return ("pixel_values",) if is_vision(model) else ("input_ids", "attention_mask")


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import transformers as tf

    import normswap

    torch.set_num_threads(1)
    original = tf.AutoModel.from_pretrained(args.original).eval()
    converted = normswap.load(str(args.converted)).eval()
    converted = getattr(converted, "base_model", converted)  # the body, as AutoModel gives the original
    norms = sum(isinstance(m, normswap.RMSNorm) for m in converted.modules())
    print(f"# {args.label}: {norms} RMSNorms in {args.converted}", flush=True)
    k = keys(original)
    bodies = {"original": deploy.Body(original, k).eval(), "converted": deploy.Body(converted, k).eval()}
    cells = [(b, s) for s in args.sizes for b in args.batches]
    rows = {(b, s): {"model": f"{args.label} {s}" + (" px" if is_vision(original) else " tok"), "batch": b,
                     "tokens": tokens(original, s)} for b, s in cells}
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    for engine in [e for e in ("ort", "ortfuse") if e in args.engines]:
        for size in args.sizes:
            paths = {}
            for name, body in bodies.items():
                path = cache / f"{args.label}-{name}-{size}.onnx"
                secs = deploy.export(body, example(original, 2, size), path, None)
                if secs:
                    print(f"#   exported {path.name} in {secs:.0f} s", flush=True)
                if engine == "ortfuse" and name == "converted":
                    path = deploy.norms_fused(path)
                paths[name] = path
            ops = {n: {o: c for o, c in deploy.fused_norm_ops(p).items() if c} for n, p in paths.items()}
            print(f"#   {engine} {size}: norm ops after ORT's optimiser {ops}", flush=True)
            for batch in args.batches:
                row = rows[(batch, size)]
                x = example(original, batch, size)
                row[engine] = deploy.abba_sessions(paths["original"], paths["converted"], x, args.budget,
                                                   args.min_quads)
                row[engine + "_ops"] = ops
                if args.control:
                    row[engine + "_aa"] = deploy.abba_sessions(paths["original"], paths["original"], x,
                                                               args.budget, args.min_quads)
                print(f"#   {engine} b{batch} {size}: {row[engine]['ratio']:.3f}", flush=True)
    if "eager" in args.engines:
        bodies["converted2"] = deploy.Body(copy.deepcopy(converted), k).eval()
        bodies["original2"] = deploy.Body(copy.deepcopy(original), k).eval()
        for batch, size in cells:
            row = rows[(batch, size)]
            x = example(original, batch, size)
            calls = {n: deploy.torch_call(b, x) for n, b in bodies.items()}
            half, least = args.budget / 2, max(1, (args.min_quads + 1) // 2)
            pooled = [deploy.quads(calls["original" + s], calls["converted" + s], half, least) for s in ("", "2")]
            row["eager"] = deploy.summary(pooled[0][0] + pooled[1][0], pooled[0][1] + pooled[1][1])
            if args.control:
                row["eager_aa"] = deploy.abba(calls["original"], calls["original2"], args.budget, args.min_quads)
            print(f"#   eager b{batch} {size}: {row['eager']['ratio']:.3f}", flush=True)
    if "compile" in args.engines:
        for name in [n for n in bodies if n.endswith("2")]:
            del bodies[name]  # one compiled graph per model, timed by plain ABBA quads (no second copies)
        fns = {n: torch.compile(b, dynamic=True) for n, b in bodies.items()}
        for batch, size in cells:
            if batch == 1 and not args.compile_batch1:
                continue
            row = rows[(batch, size)]
            calls = {n: deploy.torch_call(f, example(original, batch, size)) for n, f in fns.items()}
            row["compile"] = deploy.abba(calls["original"], calls["converted"], args.budget, args.min_quads)
            print(f"#   compile b{batch} {size}: {row['compile']['ratio']:.3f}", flush=True)
        del fns
        torch._dynamo.reset()
    gc.collect()
    return list(rows.values())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("original", type=Path)
    ap.add_argument("converted", type=Path, help="normswap convert's output (native format)")
    ap.add_argument("--label", default="model")
    ap.add_argument("--sizes", type=lambda s: [int(v) for v in s.split(",")], default=[112, 224],
                    help="image sides (vision) or token counts (text)")
    ap.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",")], default=[1, 4])
    ap.add_argument("--engines", default="ort,eager", help="comma-separated: ort, ortfuse, eager, compile")
    ap.add_argument("--compile-batch1", action="store_true", help="also time torch.compile at batch 1")
    ap.add_argument("--budget", type=float, default=8.0, help="seconds per cell")
    ap.add_argument("--min-quads", type=int, default=5)
    ap.add_argument("--control", action="store_true", help="also the original against itself (noise floor)")
    ap.add_argument("--cache", default=os.environ.get("TMPDIR", "/tmp") + "/normswap-heldout-bench")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.engines = args.engines.split(",")
    load = os.getloadavg()[0]
    rows = run(args)
    engines = [e for e in ("ort", "ortfuse", "eager", "compile") if e in args.engines]
    print(f"\n{args.label}; torch {torch.__version__}, {platform.processor() or platform.machine()}, one thread, "
          f"load average {load:.1f} → {os.getloadavg()[0]:.1f}\n")
    print(deploy.table(rows, engines))
    if args.json:
        args.json.write_text(json.dumps({"label": args.label, "rows": rows, "time": time.time()}, indent=1))


if __name__ == "__main__":
    main()
