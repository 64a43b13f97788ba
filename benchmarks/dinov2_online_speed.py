"""Float32 latency of a DINOv2 with online Hadamards alone against the original, side by side, in ONNX Runtime and in
torch eager. Variants of one checkpoint: the original; ``native``, the checkpoint ``normswap convert`` writes
(β kept); ``online``, the same with ``normswap.rotate(model, "none", online=True)`` (one op after each norm whose
output only its Linear readers read, so q, k and v share one, and one before each other reader and each MLP down
projection); ``online-per-reader``, the same function laid out as before 2026-11-30 (an op before every Linear
reader: q, k and v each transform the same tensor); ``online-bN``, the ops block-diagonal (``online_block=N``);
``online-stock`` / ``online-b32-stock``, the same models with each op's eager call in its stock form (as before
round 51's ``EagerOp``: :func:`stock_ops_`); ``copy``, the original's deep copy (a control: the original's weights
are a mapping of the checkpoint file, which the kernel may back with huge pages, every other variant's are
anonymous memory); ``writer-ops``, ``normswap convert --writer-centering op`` (the writers' weights kept, a
centering op after each LayerScale: 24 ops more than ``native`` on DINOv2-small); ``writer-auto``, ``--writer-centering
auto`` (an op after the writers whose centering widens a row); ``online-r51``, ``online`` with
its ops captured in round 51's stock form (:func:`r51_ops_`: differs from ``online`` in ``ort`` and ``compile``
only). Engines: ONNX Runtime (``ort``), torch eager, ``compile`` (``torch.compile``, inductor, default mode; each
model's dynamo graphs and graph breaks printed first: :func:`compiled`). One thread. Each engine is timed
in ABBA rounds (the original, each variant in turn, the original, the variants in reverse, the original), each
variant's ratio to the mean of the original's three runs in that round, and the original's last run against its
first (the machine's noise). Prints the median and range over the rounds, per engine.

    python benchmarks/dinov2_online_speed.py --model /tmp/held46/dinov2-focus --batch 8 --image 112 --rounds 8
    python benchmarks/dinov2_online_speed.py --model /tmp/held46/dinov2-focus --batch 1 --image 224 --rounds 8
    python benchmarks/dinov2_online_speed.py --model DINOV2_SMALL --shapes 8x112 1x224 --engines compile ort \
        --variants native online online-r51 online-b32 --rounds 8 --reps 5 --stat min
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_engines import export  # noqa: E402

ENGINES = ("ort", "eager", "compile")


VARIANTS = ("native", "online", "online-per-reader", "online-b32", "online-b64", "online-b128", "copy", "online-stock",
            "online-b32-stock", "writer-ops", "online-r51",
            "writer-auto")


def r51_stock(factors: dict, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Round 51's stock form of one online op (a replica: what graph capture recorded before round 52): the signs,
    ``H_K ⊗ H_{2^m}`` as ``hadamard.hadamard_matmuls`` (the dense ``H_{2^m}`` up to order 256, above it
    ``H_r ⊗ H_256``: ``factors``, float32, made once by :func:`r51_ops_` as round 51 made them at install), the
    scale a multiply over the output; block-diagonal ops as now."""
    from normswap.rotation import hadamard
    from normswap.rotation.rotate import HADAMARD_BUFFER, SIGNS_BUFFER

    signs = getattr(module, SIGNS_BUFFER, None)
    if signs is not None:
        x = x * signs.to(x.dtype)
    small = getattr(module, HADAMARD_BUFFER)
    if hadamard.is_block_factor(small.shape[0]):
        return hadamard.block_matmul(x, small)
    return hadamard.hadamard_matmuls(x, small, factors["pow2"], rest=factors["rest"])


def r51_ops_(model: torch.nn.Module) -> int:
    """Make every online op of ``model`` capture round 51's stock form (:func:`r51_stock`) in ``torch.compile`` and the
    exporters (eager calls keep the eager form): the side-by-side baseline for round 52's stock form. Returns the
    number of ops."""
    from functools import partial

    from normswap.rotation import hadamard
    from normswap.rotation.rotate import HADAMARD_BUFFER, POW2_ATTR, REST_ATTR, OnlineHadamard

    hooks = [(m, h) for m in model.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())
             if isinstance(h, OnlineHadamard)]
    for m, h in hooks:
        factors = {"pow2": None, "rest": None}
        if getattr(m, POW2_ATTR, None) is not None:  # a full op: round 51's factors from the same widths
            k = getattr(m, HADAMARD_BUFFER).shape[0]
            r = getattr(m, REST_ATTR)
            pow2, rest = hadamard.pow2_factors(getattr(m, POW2_ATTR).shape[0] * (1 if r is None else r.shape[0]))
            factors = {"pow2": pow2.float(), "rest": None if rest is None else rest.float()}
            assert factors["pow2"].shape[0] * (1 if rest is None else rest.shape[0]) * k > 0
        h.stock = partial(r51_stock, factors)
    return len(hooks)


def stock_ops_(model: torch.nn.Module) -> int:
    """Make every online op of ``model`` run its stock form in eager too (the form ``torch.compile`` and the
    exporters trace; what eager ran before round 51's ``EagerOp``): the side-by-side baseline for the eager
    form. Returns the number of ops."""
    from normswap.rotation.rotate import OnlineHadamard

    hooks = [h for m in model.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())
             if isinstance(h, OnlineHadamard)]
    for h in hooks:
        h.eager_op = lambda *_: None  # no eager form: transform falls through to the stock one
    return len(hooks)


def online_block(name: str) -> int | None:
    """The ``online_block`` of a variant name: ``online-b32`` → 32; None for the full Hadamard."""
    return int(name.rpartition("-b")[2]) if name.startswith("online-b") else None


def variants(model: torch.nn.Module, names: tuple[str, ...] = VARIANTS[:3]) -> dict[str, torch.nn.Module]:
    """``{name: model}``: the original and the variants ``names`` (see the module doc)."""
    import normswap

    out = {"original": model}
    if "copy" in names:  # the original's deep copy: its weights in anonymous memory, as every variant's are
        out["copy"] = copy.deepcopy(model)
    native = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(native, beta_placement="keep")
        if "native" in names:
            out["native"] = native
        for name, how in (("writer-ops", "op"), ("writer-auto", "auto")):  # op: one centering op after each writer
            if name in names:  # (two per block); auto: after the writers whose centering widens a row (4 of 24)
                out[name] = copy.deepcopy(model)
                normswap.patch(out[name], beta_placement="keep", writer_centering=how)
        for name in (n for n in names if n.startswith("online")):
            m = copy.deepcopy(native)
            if name == "online-per-reader":  # the layout before one op per norm output: no norm shares its op
                for sp in normswap.plan_of(m).sites:
                    sp.readers_alone = False
            base = name.removesuffix("-stock").removesuffix("-r51")
            rot = normswap.rotate(m, "none", online=True, online_block=online_block(base))
            if name.endswith("-stock"):
                print(f"{name}: {stock_ops_(m)} ops in their stock form", flush=True)
            if name.endswith("-r51"):
                print(f"{name}: {r51_ops_(m)} ops captured in round 51's stock form", flush=True)
            print(f"{name}: {rot.headline()}", flush=True)
            out[name] = m
    return out


NORM_OPS = ("LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
            "SkipSimplifiedLayerNormalization", "ReduceMean", "Sub")


def norm_ops(path: Path) -> dict[str, int]:
    """How many norm kernels (and loose ``ReduceMean``/``Sub`` nodes: centering ops ONNX Runtime did not fuse) the
    CPU provider's optimised graph of ``path`` holds, at the default optimisation level."""
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.optimized_model_filepath = str(path.with_suffix(".opt.onnx"))
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    nodes = [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]
    return {op: nodes.count(op) for op in NORM_OPS}


def abba(run: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Per round: the original, each variant, the original, the variants in reverse, the original. Returns each
    variant's ratio (its two runs over the original's three, as means) and ``original (A/A)`` (last / first)."""
    names = [n for n in run if n != "original"]
    ratios: dict[str, list[float]] = {n: [] for n in names} | {"original (A/A)": []}
    for _ in range(rounds):
        base = [run["original"]()]
        t = {n: run[n]() for n in names}
        base.append(run["original"]())
        for n in reversed(names):
            t[n] += run[n]()
        base.append(run["original"]())
        for n in names:
            ratios[n].append((t[n] / 2) / (sum(base) / 3))
        ratios["original (A/A)"].append(base[2] / base[0])
    return ratios


def main(argv: list[str] | None = None) -> dict[str, dict[str, dict[str, list[float]]]]:
    import transformers as tf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="a Dinov2Model directory")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--image", type=int, default=112)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3, help="runs per timing")
    ap.add_argument("--stat", choices=("mean", "min"), default="mean",
                    help="a timing's figure over its --reps runs: their mean, or the fastest (min: robust to other "
                    "jobs taking the core now and then, on a loaded machine)")
    ap.add_argument("--shapes", nargs="+", metavar="BxPX",
                    help="several (batch, image) settings timed one after the other on the same models, e.g. 8x112 "
                    "1x224 (instead of --batch and --image)")
    ap.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS[:3]), choices=VARIANTS,
                    help="the variants beside the original (online-bN: rotate(..., online_block=N))")
    ap.add_argument("--json", type=Path, help="write the per-round ratios here, engine by engine as they finish")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    model = tf.Dinov2Model.from_pretrained(args.model).eval()
    models = variants(model, tuple(args.variants))
    shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes] if args.shapes else [(args.batch, args.image)]
    results: dict = {}
    for batch, image in shapes:
        results[f"{batch}x{image}"] = time_shape(models, args, batch, image)
    return results


def compiled(name: str, model: torch.nn.Module, x: torch.Tensor) -> torch.nn.Module:
    """``torch.compile(model)`` (inductor, default mode), after ``torch._dynamo.explain`` says how many graphs and
    graph breaks dynamo makes of it (printed: an online op that broke the graph would show here); the first call,
    which compiles, is made here, outside the timings, and checked against eager."""
    import torch._dynamo

    torch._dynamo.reset()
    with torch.inference_mode():
        info = torch._dynamo.explain(model)(pixel_values=x)
    reasons = sorted({str(b.reason).splitlines()[0][:120] for b in info.break_reasons})
    print(f"compile {name}: {info.graph_count} graph(s), {info.graph_break_count} graph break(s) {reasons}", flush=True)
    fn = torch.compile(model)
    t0 = time.perf_counter()
    with torch.inference_mode():
        got = fn(pixel_values=x).last_hidden_state
        want = model(pixel_values=x).last_hidden_state
    print(f"compile {name}: compiled in {time.perf_counter() - t0:.0f} s, against eager "
          f"{float((got - want).abs().max() / want.abs().max()):.1e}", flush=True)
    return fn


def time_shape(models: dict[str, torch.nn.Module], args: argparse.Namespace, batch: int,
               image: int) -> dict[str, dict[str, list[float]]]:
    """The ABBA rounds of every engine at one (batch, image) setting; printed, and written to ``--json``."""
    import onnxruntime as ort

    x = torch.randn(batch, 3, image, image)
    with torch.no_grad():
        ref = models["original"](pixel_values=x).last_hidden_state
        for name, m in models.items():  # every variant computes the same function
            err = float((m(pixel_values=x).last_hidden_state - ref).abs().max() / ref.abs().max())
            print(f"{name}: max relative difference to the original {err:.1e}", flush=True)

    def timer(fn: Callable[[], object]) -> Callable[[], float]:
        def seconds() -> float:
            runs = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                fn()
                runs.append(time.perf_counter() - t0)
            return min(runs) if args.stat == "min" else sum(runs) / len(runs)
        return seconds

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines:
            if engine == "ort":
                so = ort.SessionOptions()
                so.intra_op_num_threads = so.inter_op_num_threads = 1
                feed = {"pixel_values": x.numpy()}
                run = {}
                for name, m in models.items():
                    path = Path(tmp) / f"{name}.onnx"
                    export(m, x, path)
                    print(f"{name}: ONNX Runtime's optimised graph {norm_ops(path)}", flush=True)
                    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
                    run[name] = timer(lambda s=session, f=feed: s.run(None, f))
            else:
                def forward(m: torch.nn.Module) -> Callable[[], object]:
                    def call() -> object:
                        with torch.inference_mode():
                            return m(pixel_values=x)
                    return call
                if engine == "compile":
                    run = {name: timer(forward(compiled(name, m, x))) for name, m in models.items()}
                else:
                    run = {name: timer(forward(m)) for name, m in models.items()}
            for fn in run.values():  # warm-up
                fn()
            results[engine] = ratios = abba(run, args.rounds)
            print(f"\n{engine}, batch {batch}, {image} px, {args.rounds} ABBA rounds "
                  f"({args.stat} of {args.reps} runs), time / original's:")
            print("| variant | median | range |\n|---|---|---|")
            for name, r in ratios.items():
                print(f"| {name} | {statistics.median(r):.3f} | {min(r):.3f}-{max(r):.3f} |", flush=True)
            if args.json:
                import json

                path = args.json if not args.shapes else args.json.with_name(f"{args.json.stem}_{batch}x{image}.json")
                path.write_text(json.dumps({"batch": batch, "image": image, "rounds": args.rounds, "reps": args.reps,
                                            "stat": args.stat, "ratios": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
