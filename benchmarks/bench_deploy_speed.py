"""Deployment speed: a converted model against its LayerNorm original, end to end, in the engines people
deploy to on CPU: ONNX Runtime (CPU provider, default session optimisation), torch eager and
``torch.compile`` (inductor).

Models (random weights, seeded; LayerNorm γ/β and every bias randomised so nothing folds away by
accident), at their real sizes, body only (``last_hidden_state``; no LM/classifier head, which would
dilute the norms' share):

* ``gpt2``: GPT-2 small (12 layers, width 768), Pre-LN, converted exactly (``normswap.patch``);
* ``bert``: BERT-base (12 layers, width 768), Post-LN, every norm converted (``mode="all"``, approximate;
  speed does not depend on calibration, so ``calibration=False``);
* ``vit``: ViT-B/16 (12 layers, width 768), Pre-LN, converted exactly; two models, one per image size
  (their position tables differ).

Shapes: batch 1 and 4 at two sequence lengths (text: 8 and 32 tokens; ViT: 64 and 128 px images, 17 and
65 tokens), small enough that the norms are a visible share and that the run stays bounded on a shared
2-core machine. Each model is exported once per variant with ``torch.onnx.export(dynamo=True)`` at the
exporter's default opset (dynamic batch and sequence) and cached (``--cache``); ``--opset 23`` adds an
ONNX Runtime column for ``RMSNormalization``.

Timing: one thread everywhere (``torch.set_num_threads(1)``, ORT ``intra_op_num_threads=1``), timed by
the calling thread's CPU time (``--clock cpu``, the default: on a loaded machine wall time also counts
the time the thread waited for a core); per cell, interleaved ABBA quads (original, converted,
converted, original) until the cell's time budget is spent (at least ``--min-quads``); the ratio is the
median over quads of converted/original time, with the quartiles of that ratio. Two copies of one
model run a few percent apart depending on where their weights landed in memory (measured: two ORT
sessions of one file, 2-7%), so each cell pools two halves: ORT sessions created in opposite orders,
and in torch second copies of both models allocated in the opposite order. ``--control`` adds
the original against its second session/copy, the noise floor. Load average is recorded before and
after. ``torch.compile`` (inductor, ``dynamic=True``) is timed at batch 4 only unless
``--compile-batch1``: a batch of 1 is specialised, so it would cost a second compile per model (minutes
each on a loaded 2-core machine).

    python benchmarks/bench_deploy_speed.py                 # everything (~15-30 min on a loaded 2-core box)
    python benchmarks/bench_deploy_speed.py --quick         # batch 1 and 4 at the short length, less time per cell
    python benchmarks/bench_deploy_speed.py --models gpt2 --engines ort,eager
    python benchmarks/bench_deploy_speed.py --json out.json # also write the raw figures
    python benchmarks/bench_deploy_speed.py --control       # also the original against itself (noise floor)
    python benchmarks/bench_deploy_speed.py --models gpt2 --engines ort --opset23   # + ORT at opset 23
    python benchmarks/bench_deploy_speed.py --engines ortopt  # ORT after onnxruntime.transformers.optimizer
    python benchmarks/bench_deploy_speed.py --engines ort,ortfuse,ortopt,ortoptfuse  # + normswap's fuse_norms
    python benchmarks/bench_deploy_speed.py --round-robin 45  # cached ORT exports timed in turn, batch 1
    python benchmarks/bench_deploy_speed.py --kernels       # ORT's norm kernels alone (about a minute)
    python benchmarks/bench_deploy_speed.py --norm-calls --budget 2 --control  # eager norm modules alone
    python benchmarks/bench_deploy_speed.py --models bert --profile 50  # ORT kernel time per op type
    python benchmarks/bench_deploy_speed.py --models bert --beta-placement fold  # β out of BERT's norms
    python benchmarks/bench_deploy_speed.py --gemm-widths 3074,3080,3136 --budget 6  # BERT's FFN GEMMs by width
    python benchmarks/bench_deploy_speed.py --carry-eager --budget 6 --quick  # BERT eager, mean carry on/off

Goal (issue 40): converted/original <= 1.00 in every cell, below 1 where the norm is a visible share.
Results: docs/results/deploy-speed.md.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import normswap
from normswap.integrations.onnx import fused_norm_ops

TEXT_SHAPES = [(1, 8), (4, 8), (1, 32), (4, 32)]  # (batch, tokens)
VIT_SIZES = (64, 128)  # image px: 17 and 65 tokens at patch 16
ENGINES = ("ort", "eager", "compile")
# opt-in: "ortopt" (ORT after onnxruntime.transformers.optimizer), "ortfuse" and "ortoptfuse" (the same two with
# the converted file passed through normswap.integrations.onnx.fuse_norms; the original as it is)


class Body(nn.Module):
    """The model's forward on positional tensors, returning ``last_hidden_state`` (what an exporter and a
    compiled graph see)."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.keys = model, keys
        self.extra = {"use_cache": False} if "gpt2" in type(model).__name__.lower() else {}

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return self.model(**dict(zip(self.keys, tensors, strict=True)), **self.extra).last_hidden_state


def randomise_(model: nn.Module, seed: int = 0) -> nn.Module:
    """LayerNorm γ around 1, β and every bias around 0 (the default 1/0 init would let folds vanish)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.dim() == 1 and ("norm" in name.lower() or "ln" in name.lower() or leaf == "bias"):
                p.copy_((1.0 if leaf == "weight" else 0.0) + 0.3 * torch.randn(p.shape, generator=gen))
    return model.eval()


def build(name: str, image: int = 0, layers: int = 12) -> tuple[nn.Module, tuple[str, ...]]:
    import transformers as tf

    torch.manual_seed(0)
    if name == "gpt2":
        model = tf.GPT2Model(tf.GPT2Config(n_layer=layers, n_embd=768, n_head=12))
        keys: tuple[str, ...] = ("input_ids", "attention_mask")
    elif name == "bert":
        model = tf.BertModel(tf.BertConfig(num_hidden_layers=layers), add_pooling_layer=False)
        keys = ("input_ids", "attention_mask")
    else:
        model = tf.ViTModel(tf.ViTConfig(image_size=image, patch_size=16, num_hidden_layers=layers),
                            add_pooling_layer=False)
        keys = ("pixel_values",)
    return randomise_(model), keys


def convert(name: str, model: nn.Module, beta_placement: str | None = None) -> tuple[nn.Module, dict[str, int]]:
    converted = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = {"mode": "all", "calibration": False} if name == "bert" else {}
        if beta_placement:
            kwargs["beta_placement"] = beta_placement
        report = normswap.patch(converted, **kwargs)
    verdicts: dict[str, int] = {}
    for site in report.sites:
        verdicts[site.verdict] = verdicts.get(site.verdict, 0) + 1
    return converted.eval(), verdicts


def inputs_for(name: str, batch: int, tokens_or_px: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(batch * 1000 + tokens_or_px)
    if name == "vit":
        return (torch.randn(batch, 3, tokens_or_px, tokens_or_px, generator=gen),)
    ids = torch.randint(100, 20000, (batch, tokens_or_px), generator=gen)
    return ids, torch.ones_like(ids)


def export(body: Body, example: tuple[torch.Tensor, ...], path: Path, opset: int | None) -> float:
    """``torch.onnx.export(dynamo=True)`` with a dynamic batch (and sequence for text); seconds taken."""
    done = path.with_suffix(".done")  # written last: a half-written export is redone
    if path.exists() and done.exists():
        return 0.0
    batch = torch.export.Dim("batch", min=1, max=64)
    if len(example) == 2:
        seq = torch.export.Dim("seq", min=2, max=512)
        shapes: tuple = ({0: batch, 1: seq}, {0: batch, 1: seq})
    else:
        shapes = ({0: batch},)
    kwargs = {} if opset is None else {"opset_version": opset}
    t0 = time.perf_counter()
    logging.disable(logging.WARNING)
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(body, example, str(path), dynamo=True, dynamic_shapes={"tensors": shapes}, **kwargs)
    finally:
        logging.disable(logging.NOTSET)
    done.write_text("")
    return time.perf_counter() - t0


def ort_optimised(path: Path, name: str) -> Path:
    """``onnxruntime.transformers.optimizer.optimize_model`` of the export at ``path`` (cached next to it):
    its fusions on top of the session's, among them each residual ``Add`` with the norm after it
    (``SkipLayerNormalization`` / ``SkipSimplifiedLayerNormalization``). ``model_type="bert"`` for the
    text models (``gpt2`` fails on a dynamic-shape GPT-2 export, original or converted; docs/deployment.md)."""
    out = path.with_name(path.stem + "-optimised.onnx")
    done = out.with_suffix(".done")
    if out.exists() and done.exists():
        return out
    # in a child process: the optimiser's protobuf copies and shape-inference session (several GB for
    # a 12-layer model) would otherwise stay in this process's heap next to the timed sessions
    import subprocess

    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_deploy_speed as b; "
            f"b.optimise_onnx({str(path)!r}, {str(out)!r}, {name!r})")
    subprocess.run([sys.executable, "-c", code], check=True)
    done.write_text("")
    return out


def norms_fused(path: Path) -> Path:
    """``normswap.integrations.onnx.fuse_norms`` of the file at ``path`` (cached next to it, written in a child
    process as :func:`ort_optimised`): the converted model's norms with their residual and bias ``Add``s in
    ``SkipSimplifiedLayerNormalization``, as the original's LayerNorms are in ``SkipLayerNormalization``."""
    out = path.with_name(path.stem + "-fused.onnx")
    done = out.with_suffix(".done")
    if out.exists() and done.exists():
        return out
    import subprocess

    code = (f"from normswap.integrations.onnx import fuse_norms; fuse_norms({str(path)!r}, {str(out)!r})")
    subprocess.run([sys.executable, "-c", code], check=True)
    done.write_text("")
    return out


def optimise_onnx(path: str, out: str, name: str) -> None:
    """What :func:`ort_optimised` runs in its child process."""
    from onnxruntime.transformers.optimizer import optimize_model

    logging.disable(logging.WARNING)
    try:
        model = optimize_model(str(path), model_type="vit" if name == "vit" else "bert", num_heads=12,
                               hidden_size=768)
    finally:
        logging.disable(logging.NOTSET)
    model.save_model_to_file(out)


def ort_session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()  # default: ORT_ENABLE_ALL
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def ort_call(session, example: tuple[torch.Tensor, ...]) -> Callable[[], object]:
    feed = {i.name: t.numpy() for i, t in zip(session.get_inputs(), example, strict=True)}
    return lambda: session.run(None, feed)


def torch_call(fn: Callable[..., torch.Tensor], example: tuple[torch.Tensor, ...]) -> Callable[[], object]:
    def run() -> object:
        with torch.inference_mode():
            return fn(*example)

    return run


#: The clock cells are timed with: "cpu" (the calling thread's CPU time, ``time.thread_time``; every
#: engine here computes on the calling thread: one torch thread, ORT with one intra-op thread and no
#: inter-op pool), which leaves out the time the thread waits for a core on a loaded machine, or
#: "wall" (``time.perf_counter``). Set from ``--clock``.
CLOCK: list[Callable[[], float]] = [time.thread_time]


def quads(original: Callable[[], object], converted: Callable[[], object], budget_s: float,
          min_quads: int) -> tuple[list[float], list[float]]:
    """Interleaved ABBA quads (original, converted, converted, original) for ``budget_s`` seconds of wall
    time (at least ``min_quads``): per quad, converted/original time and the original's mean time."""
    for f in (original, converted, original, converted):
        f()
    ratios, base = [], []
    clock, wall = CLOCK[0], time.perf_counter
    start = wall()
    while len(ratios) < min_quads or wall() - start < budget_s:
        t = []
        for f in (original, converted, converted, original):
            t0 = clock()
            f()
            t.append(clock() - t0)
        ratios.append((t[1] + t[2]) / (t[0] + t[3]))
        base.append((t[0] + t[3]) / 2)
        if len(ratios) >= 400:
            break
    return ratios, base


def summary(ratios: list[float], base: list[float]) -> dict[str, float]:
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return {"ratio": statistics.median(ratios), "q1": q[0], "q3": q[2], "quads": len(ratios),
            "original_ms": 1e3 * statistics.median(base)}


def abba(original: Callable[[], object], converted: Callable[[], object], budget_s: float,
         min_quads: int) -> dict[str, float]:
    """Median and quartiles over ABBA quads of converted/original time; both warmed up first."""
    return summary(*quads(original, converted, budget_s, min_quads))


def abba_sessions(original: Path, converted: Path, example: tuple[torch.Tensor, ...], budget_s: float,
                  min_quads: int) -> dict[str, float]:
    """:func:`abba` for two ONNX files, over two halves whose sessions are created in opposite orders.

    Two sessions of the *same* file, created one after the other, ran 2-7% apart in this process
    (BERT-base, batch 1, 8 tokens: the second one slower, steadily over 40-90 quads; memory placement
    of the weights, not the graph). One creation order would add that bias to every ratio; pooling the
    quads of both orders cancels it."""
    ratios: list[float] = []
    base: list[float] = []
    for first_original in (True, False):
        if first_original:
            s_original = ort_session(original)
            s_converted = ort_session(converted)  # a second session even when it is the same file (A/A)
        else:
            s_converted = ort_session(converted)
            s_original = ort_session(original)
        r, b = quads(ort_call(s_original, example), ort_call(s_converted, example), budget_s / 2,
                     max(1, (min_quads + 1) // 2))
        ratios += r
        base += b
        del s_original, s_converted
        gc.collect()
    return summary(ratios, base)


KERNELS = {
    # label: (op, domain, inputs after x (the residual sum, or x and skip for Skip* ops), extra Add of a bias)
    "LayerNormalization (original)": ("LayerNormalization", "", ["w", "b"], False),
    "SimplifiedLayerNormalization": ("SimplifiedLayerNormalization", "", ["w"], False),
    "SimplifiedLayerNormalization + Add (kept β)": ("SimplifiedLayerNormalization", "", ["w"], True),
    "RMSNormalization (opset 23)": ("RMSNormalization", "", ["w"], False),
    "SkipLayerNormalization (original)": ("SkipLayerNormalization", "com.microsoft", ["w", "b"], False),
    "SkipSimplifiedLayerNormalization": ("SkipSimplifiedLayerNormalization", "com.microsoft", ["w"], False),
}


def kernel_rows(width: int = 768, rows_list: tuple[int, ...] = (8, 128, 512), budget: float = 3.0) -> str:
    """ORT's norm kernels alone (one thread), each against ``LayerNormalization`` (or
    ``SkipLayerNormalization`` for the Skip ops) on the same input, ABBA-interleaved: what the fused
    converted graph saves per norm."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    def session(label: str):
        op, domain, params, bias_add = KERNELS[label]
        skip = op.startswith("Skip")
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])
        r = helper.make_tensor_value_info("r", TensorProto.FLOAT, ["N", width])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", width])
        gen = np.random.default_rng(0)
        inits = [numpy_helper.from_array((gen.random(width) + 0.5).astype(np.float32), "w"),
                 numpy_helper.from_array(gen.random(width).astype(np.float32), "b")]
        nodes = [] if skip else [helper.make_node("Add", ["x", "r"], ["h"])]
        first = ["x", "r"] if skip else ["h"]
        out = "z" if bias_add else "y"
        nodes.append(helper.make_node(op, first + params, [out], domain=domain, epsilon=1e-5,
                                      **({} if skip else {"axis": -1})))
        if bias_add:
            nodes.append(helper.make_node("Add", ["z", "b"], ["y"]))
        graph = helper.make_graph(nodes, "norm", [x, r], [y], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23),
                                                        helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 10
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.log_severity_level = 3
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    sessions = {label: session(label) for label in KERNELS}
    lines = ["| ORT kernel | " + " | ".join(f"{n} rows: vs original" for n in rows_list) + " |",
             "|---|" + "---|" * len(rows_list)]
    gen = np.random.default_rng(1)
    results: dict[str, list[str]] = {label: [] for label in KERNELS}
    for n in rows_list:
        feed = {"x": gen.standard_normal((n, width), dtype=np.float32),
                "r": gen.standard_normal((n, width), dtype=np.float32)}
        repeat = max(1, 4096 // n)  # calls per timed block, so a block lasts long enough to time

        def block(sess, feed=feed, repeat=repeat):
            def run() -> None:
                for _ in range(repeat):
                    sess.run(None, feed)
            return run

        for label in KERNELS:
            base = "SkipLayerNormalization (original)" if label.startswith("Skip") else "LayerNormalization (original)"
            if label == base:
                r = abba(block(sessions[base]), block(sessions[base]), budget, 5)
                results[label].append(f"1.00 ({1e6 * r['original_ms'] / 1e3 / repeat:.1f} µs)")
                continue
            r = abba(block(sessions[base]), block(sessions[label]), budget, 5)
            results[label].append(f"**{r['ratio']:.2f}** ({r['q1']:.2f}–{r['q3']:.2f})")
    for label, cells in results.items():
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


NORM_CALL_SHAPES = ((1, 1), (1, 8), (4, 8), (1, 32), (4, 32), (4, 65))  # (batch, tokens); 1x1: a decode step


def norm_calls(budget: float, min_quads: int, control: bool) -> str:
    """Eager per-call cost of the converted norm module against the ``nn.LayerNorm`` it replaced: GPT-2
    small's own modules (``h.0.ln_1``: exact, β folded away; ``ln_f``: the last norm, which keeps β),
    one module call at a time (its output dropped before the next), in inference mode and with
    gradients enabled (a model called without ``torch.no_grad``: the parameters require grad, so each
    call records an autograd node). End to end the norms are under 1% of an eager forward, below what
    a loaded machine resolves; this is where their host cost shows. Each timed block is 200 calls (the
    clock's resolution is ~1 us)."""
    model, _ = build("gpt2", layers=1)
    converted, _ = convert("gpt2", model)
    pairs = [("h.0.ln_1", model.h[0].ln_1, converted.h[0].ln_1), ("ln_f", model.ln_f, converted.ln_f)]
    lines = ["| norm | mode | batch x tokens | converted / original | A/A | original µs per call |",
             "|---|---|---|---|---|---|"]
    gen = torch.Generator().manual_seed(0)
    for mode in ("inference", "grad"):
        for label, original, ours in pairs:
            if mode == "grad":
                assert all(p.requires_grad for p in (*original.parameters(), *ours.parameters()))
            twin = copy.deepcopy(original)
            for batch, tokens in NORM_CALL_SHAPES:
                x = torch.randn(batch, tokens, 768, generator=gen)

                def block(module: nn.Module, x: torch.Tensor = x) -> Callable[[], object]:
                    def run() -> None:
                        for _ in range(200):  # each output dropped at once, as a model's activations are
                            module(x)
                    return run

                with torch.inference_mode() if mode == "inference" else torch.enable_grad():
                    cell = abba(block(original), block(ours), budget, min_quads)
                    aa = abba(block(original), block(twin), budget, min_quads) if control else None
                lines.append(f"| {label} | {mode} | {batch}x{tokens} | **{cell['ratio']:.3f}** "
                             f"({cell['q1']:.2f}–{cell['q3']:.2f}, {cell['quads']}) | "
                             f"{aa['ratio']:.3f} | {cell['original_ms'] * 1e3 / 200:.2f} |" if aa else
                             f"| {label} | {mode} | {batch}x{tokens} | **{cell['ratio']:.3f}** "
                             f"({cell['q1']:.2f}–{cell['q3']:.2f}, {cell['quads']}) | – | "
                             f"{cell['original_ms'] * 1e3 / 200:.2f} |")
                print(lines[-1], flush=True)
    return "\n".join(lines)


def round_robin(label: str, cache: Path, opsets: list[str], batch: int, tokens: int, seconds: float) -> str:
    """Every cached ORT session of one model (original and converted, per opset) timed in turn, one call
    each per round with the order reversed every other round, for ``seconds``: medians over hundreds of
    rounds, steadier than ABBA cells when calls are short. Needs the exports a normal run cached."""
    opsets = [o for o in opsets if all((cache / f"{label}-{v}-{o}.done").exists() for v in ("original", "converted"))]
    if not opsets:
        return f"{label}: no cached exports in {cache} (run without --round-robin first)"
    paths = {f"{v}-{o}": cache / f"{label}-{v}-{o}.onnx" for o in opsets for v in ("original", "converted")}
    name = "vit" if label.startswith("vit") else label.split("-")[0]
    px = int(label[3:].split("-")[0]) if name == "vit" else 0
    example = inputs_for(name, batch, px or tokens)
    calls = {k: ort_call(ort_session(p), example) for k, p in paths.items()}
    for f in calls.values():
        f()
    times: dict[str, list[float]] = {k: [] for k in calls}
    keys, rounds, end = list(calls), 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        for k in keys if rounds % 2 == 0 else keys[::-1]:
            t0 = time.perf_counter()
            calls[k]()
            times[k].append(time.perf_counter() - t0)
        rounds += 1
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    cells = [f"{k}: {m:.1f} ms" for k, m in med.items()]
    ratios = [f"converted/original, {o}: **{med['converted-' + o] / med['original-' + o]:.3f}**" for o in opsets]
    return f"{label} b{batch} t{tokens}, {rounds} rounds: " + ", ".join(cells) + "; " + ", ".join(ratios)


def op_profile(label: str, cache: Path, batch: int, tokens: int, runs: int, placed: str = "") -> str:
    """ORT's own profiler over the cached default-opset exports of one model (original and converted,
    ``runs`` calls each, alternating): kernel time per op type (the sum over its nodes of each node's
    median over calls, so a call preempted on a loaded machine does not count), microseconds per call,
    as a table. Which ops the conversion changed, and what each costs, apart from end-to-end noise.
    ``placed``: the converted file's β-placement suffix (``-fold`` for ``--beta-placement fold``)."""
    import onnxruntime as ort

    name = "vit" if label.startswith("vit") else label.split("-")[0]
    px = int(label[3:].split("-")[0]) if name == "vit" else 0
    example = inputs_for(name, batch, px or tokens)
    sessions = {}
    for variant in ("original", "converted"):
        path = cache / f"{label}-{variant}{placed if variant == 'converted' else ''}-default.onnx"
        if not path.with_suffix(".done").exists():
            return f"{label}: no cached export in {cache} (run without --profile first)"
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        options.log_severity_level = 3
        options.enable_profiling = True
        options.profile_file_prefix = str(cache / f"profile-{label}-{variant}")
        sessions[variant] = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    calls = {v: ort_call(sess, example) for v, sess in sessions.items()}
    for f in calls.values():
        f()
    for _ in range(runs):
        for f in calls.values():
            f()
    per_op: dict[str, dict[str, tuple[float, int]]] = {}
    for variant, sess in sessions.items():
        trace = Path(sess.end_profiling())
        per_node: dict[str, tuple[str, list[float]]] = {}  # node -> (op type, its time in each call)
        for event in json.loads(trace.read_text()):
            if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
                per_node.setdefault(event["name"], (event["args"]["op_name"], []))[1].append(event["dur"])
        trace.unlink()
        totals: dict[str, tuple[float, int]] = {}
        for op, durations in per_node.values():  # each node's median call: a preempted call does not count
            us, n = totals.get(op, (0.0, 0))
            totals[op] = (us + statistics.median(durations), n + 1)
        per_op[variant] = totals
    lines = [f"{label}, batch {batch}, {example[0].shape[1] if name != 'vit' else (px // 16) ** 2 + 1} tokens, "
             f"{runs} calls each (ORT profiler, median µs per call):", "",
             "| op | original: µs (nodes) | converted: µs (nodes) |", "|---|---|---|"]
    ops = sorted(set(per_op["original"]) | set(per_op["converted"]),
                 key=lambda op: -max(per_op[v].get(op, (0, 0))[0] for v in per_op))
    for op in ops:
        cells = [f"{per_op[v][op][0]:.0f} ({per_op[v][op][1]})" if op in per_op[v] else "–" for v in per_op]
        lines.append(f"| {op} | " + " | ".join(cells) + " |")
    totals = [sum(us for us, _ in per_op[v].values()) for v in per_op]
    lines.append(f"| all kernels | {totals[0]:.0f} | {totals[1]:.0f} |")
    return "\n".join(lines)


def gemm_widths(widths: tuple[int, ...], rows_list: tuple[int, ...], budget: float) -> str:
    """BERT-base's FFN alone, ``linear(x, up) -> linear(h, down)`` (768 -> width -> 768, with biases, one
    thread, float32), at each width against 3072: the mean carry widens BERT's FFN 3072 -> 3080 (issue 40:
    is a GEMM of width 3080 slower per call than 3072 on CPU?). ``3072+8``: the stock FFN plus a separate
    8-wide one (the carry as its own pair of GEMMs). Median of ABBA quads, A/A = 3072 against a second copy."""
    gen = torch.Generator().manual_seed(0)

    def ffn(rows: int, width: int, extra: int = 0) -> Callable[[], object]:
        def make(n: int) -> tuple[torch.Tensor, ...]:
            return (torch.randn(n, 768, generator=gen) * 0.03, torch.randn(n, generator=gen) * 0.03,
                    torch.randn(768, n, generator=gen) * 0.03)

        x, (up, ub, down), db = torch.randn(rows, 768, generator=gen), make(width), torch.randn(768, generator=gen)
        side = make(extra) if extra else None
        f = torch.nn.functional

        def run() -> object:
            with torch.inference_mode():
                y = f.linear(f.gelu(f.linear(x, up, ub)), down, db)
                if side is not None:
                    y = y + f.linear(f.gelu(f.linear(x, side[0], side[1])), side[2])
                return y
        return run

    cols = [str(w) for w in widths] + ["3072+8", "A/A"]
    lines = ["| rows | " + " | ".join(f"{c} / 3072" for c in cols) + " | 3072 µs |", "|" + "---|" * (len(cols) + 2)]
    for rows in rows_list:
        base, cells = ffn(rows, 3072), []
        for c in cols:
            other = ffn(rows, 3072) if c == "A/A" else ffn(rows, 3072, 8) if c == "3072+8" else ffn(rows, int(c))
            m = abba(base, other, budget, 5)
            cells.append(f"**{m['ratio']:.3f}** ({m['q1']:.2f}–{m['q3']:.2f}, {m['quads']})")
        lines.append(f"| {rows} | " + " | ".join(cells) + f" | {1e3 * m['original_ms']:.0f} |")
    return "\n".join(lines)


def carry_eager(budget: float, min_quads: int, layers: int, quick: bool) -> str:
    """BERT-base in torch eager: the default conversion (mean carry on, FFN 3080 wide in the 12 carried
    layers) and ``mean_carry=False`` (stock widths, those norms approximate), each against the original
    and against each other, with the original's A/A, per text shape (second copies in opposite order,
    as :func:`run_model`)."""
    model, keys = build("bert", 0, layers)
    variants_ = {"original": model}
    for label, carry in (("carry", True), ("nocarry", False)):
        converted = copy.deepcopy(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            normswap.patch(converted, mode="all", calibration=False, mean_carry=carry)
        variants_[label] = converted.eval()
    widths = {k: sorted({m.out_features for m in v.modules() if isinstance(m, nn.Linear)})
              for k, v in variants_.items()}
    bodies = {k: Body(v, keys).eval() for k, v in variants_.items()}
    bodies |= {k + "2": Body(copy.deepcopy(v), keys).eval() for k, v in reversed(list(variants_.items()))}
    pairs = [("carry", "original"), ("nocarry", "original"), ("carry", "nocarry"), ("original2", "original")]
    lines = [f"Linear output widths: {widths}", "",
             "| batch | tokens | " + " | ".join(f"{a} / {b}" for a, b in pairs) + " | original ms |",
             "|" + "---|" * (len(pairs) + 3)]
    for batch, n in shapes("bert", quick):
        example = inputs_for("bert", batch, n)
        calls = {k: torch_call(b, example) for k, b in bodies.items()}
        cells, base = [], 0.0
        for a, b in pairs:
            if b == "original" and a != "original2":
                half = [quads(calls[b + k], calls[a + k], budget / 2, max(1, (min_quads + 1) // 2)) for k in ("", "2")]
                m = summary(half[0][0] + half[1][0], half[0][1] + half[1][1])
            else:
                m = abba(calls[b], calls[a], budget, min_quads)
            cells.append(f"**{m['ratio']:.3f}** ({m['q1']:.2f}–{m['q3']:.2f}, {m['quads']})")
            base = m["original_ms"] if (a, b) == ("carry", "original") else base
        lines.append(f"| {batch} | {n} | " + " | ".join(cells) + f" | {base:.1f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def fused_against_unfused(label: str, cache: Path, batch: int, tokens: int, budget: float, min_quads: int,
                          placed: str = "") -> str:
    """The converted model's cached exports with and without :func:`normswap.integrations.onnx.fuse_norms`,
    against each other in ORT sessions (fused / unfused), plain and after ``optimize_model``, with the
    unfused file's A/A: what the Skip fusion itself is worth, measured side by side."""
    lines = []
    for suffix in ("", "-optimised"):
        unfused = cache / f"{label}-converted{placed}-default{suffix}.onnx"
        fused = unfused.with_name(unfused.stem + "-fused.onnx")
        if not (unfused.exists() and fused.exists()):
            lines.append(f"{label}{suffix}: not cached in {cache} (run with --engines ortfuse,ortoptfuse first)")
            continue
        example = inputs_for(label.split("-")[0].rstrip("0123456789") or label, batch, tokens)
        m = abba_sessions(unfused, fused, example, budget, min_quads)
        aa = abba_sessions(unfused, unfused, example, budget, min_quads)
        lines.append(f"| {label} | {'optimize_model' if suffix else 'session'} | {batch} | {tokens} | "
                     f"**{m['ratio']:.3f}** ({m['q1']:.2f}–{m['q3']:.2f}, {m['quads']}); A/A {aa['ratio']:.3f} | "
                     f"{m['original_ms']:.1f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def session_adds(path: Path) -> int:
    """``Add`` nodes left in ONNX Runtime's session-optimised graph of ``path`` (residuals, biases, kept β)."""
    import tempfile

    import onnx
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory() as tmp:
        options.optimized_model_filepath = str(Path(tmp) / "optimised.onnx")
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        graph = onnx.load(options.optimized_model_filepath, load_external_data=False).graph
    return sum(n.op_type == "Add" for n in graph.node)


def variants(name: str) -> list[tuple[str, int]]:
    """(label, image size) per model built: one for text, one per image size for ViT."""
    return [(name, 0)] if name != "vit" else [(f"vit{px}", px) for px in VIT_SIZES]


def shapes(name: str, quick: bool) -> list[tuple[int, int]]:
    if name.startswith("vit"):
        return [(1, 0), (4, 0)] if not quick else [(1, 0)]
    return TEXT_SHAPES if not quick else [(1, 8), (4, 8)]


def run_model(name: str, label: str, px: int, args: argparse.Namespace, cache: Path) -> list[dict]:
    model, keys = build(name, px, args.layers)
    t0 = time.perf_counter()
    converted, verdicts = convert(name, model, args.beta_placement)
    convert_s = time.perf_counter() - t0
    norms = sum(isinstance(m, normswap.RMSNorm) for m in converted.modules())
    biased = sum(isinstance(m, normswap.RMSNorm) and m.bias is not None for m in converted.modules())
    print(f"# {label}: {norms} RMSNorms ({biased} with a bias), verdicts {verdicts}, converted in {convert_s:.0f} s"
          + (f", beta_placement={args.beta_placement}" if args.beta_placement else ""), flush=True)
    bodies = {"original": Body(model, keys).eval(), "converted": Body(converted, keys).eval()}
    rows: dict[tuple[int, int], dict] = {}
    for batch, n in shapes(label, args.quick):
        rows[(batch, n)] = {"model": label, "batch": batch, "tokens": (px // 16) ** 2 + 1 if px else n,
                            "verdicts": verdicts, "norms": norms}
    ort_columns = [("ort", None)] + ([("ort23", 23)] if args.opset23 else []) + [("ortopt", None)] + \
        [("ortfuse", None), ("ortoptfuse", None)]
    for engine, opset in ort_columns:
        if engine not in args.engines and not (engine == "ort23" and "ort" in args.engines):
            continue
        paths, fused = {}, {}
        for variant, body in bodies.items():
            placed = f"-{args.beta_placement}" if args.beta_placement and variant == "converted" else ""
            path = cache / f"{label}-L{args.layers}-{variant}{placed}-{opset or 'default'}.onnx"
            example = inputs_for(name, 2, px or 16)
            secs = export(body, example, path, opset)
            if secs:
                print(f"#   exported {path.name} in {secs:.0f} s", flush=True)
            if engine in ("ortopt", "ortoptfuse"):
                path = ort_optimised(path, name)
            if engine.endswith("fuse") and variant == "converted":
                path = norms_fused(path)
            fused[variant] = {k: v for k, v in fused_norm_ops(path).items() if v} | {"Add": session_adds(path)}
            paths[variant] = path
        print(f"#   {engine} norm ops after ORT's optimiser: {fused}", flush=True)
        for (batch, n), row in rows.items():
            example = inputs_for(name, batch, px or n)
            row[engine] = abba_sessions(paths["original"], paths["converted"], example, args.budget,
                                        args.min_quads)
            if args.control:  # original against a second session of itself: the noise floor
                row[engine + "_aa"] = abba_sessions(paths["original"], paths["original"], example, args.budget,
                                                    args.min_quads)
            row[engine + "_ops"] = fused
            print(f"#   {engine} b{batch} t{row['tokens']}: {row[engine]['ratio']:.3f}", flush=True)
    if "eager" in args.engines or "compile" in args.engines:
        # second copies, allocated in the opposite order (converted, then original): half of each cell's
        # quads time them instead of the first ones, so where in memory a model's weights landed (2-7%
        # between two copies of one model, see abba_sessions) averages out, and the A/A control sees it
        bodies["converted2"] = Body(copy.deepcopy(converted), keys).eval()
        bodies["original2"] = Body(copy.deepcopy(model), keys).eval()
    for engine in ("eager", "compile"):
        if engine not in args.engines:
            continue
        fns = {k: (torch.compile(b, dynamic=True) if engine == "compile" else b) for k, b in bodies.items()}
        for (batch, n), row in rows.items():
            if engine == "compile" and batch == 1 and not args.compile_batch1:
                continue  # a second compile per model (size-1 dims are specialised): --compile-batch1
            example = inputs_for(name, batch, px or n)
            t0 = time.perf_counter()
            half, least = args.budget / 2, max(1, (args.min_quads + 1) // 2)
            calls = {k: torch_call(f, example) for k, f in fns.items()}
            pooled = [quads(calls["original" + k], calls["converted" + k], half, least) for k in ("", "2")]
            row[engine] = summary(pooled[0][0] + pooled[1][0], pooled[0][1] + pooled[1][1])
            if args.control:  # the first copy of the original against the second
                row[engine + "_aa"] = abba(calls["original"], calls["original2"], args.budget, args.min_quads)
            print(f"#   {engine} b{batch} t{row['tokens']}: {row[engine]['ratio']:.3f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
        del fns
        torch._dynamo.reset()
        gc.collect()
    return list(rows.values())


def table(rows: list[dict], engines: list[str]) -> str:
    head = "| model | batch | tokens | " + " | ".join(f"{e}: converted / original" for e in engines)
    head += " | original ms (" + engines[0] + ") |"
    lines = [head, "|" + "---|" * (len(engines) + 4)]
    for r in rows:
        cells = []
        for e in engines:
            m, aa = r.get(e), r.get(e + "_aa")
            cell = "–" if m is None else f"**{m['ratio']:.3f}** ({m['q1']:.2f}–{m['q3']:.2f}, {m['quads']})"
            cells.append(cell + (f"; A/A {aa['ratio']:.3f}" if aa else ""))
        first = r.get(engines[0])
        base = f"{first['original_ms']:.1f}" if first else "–"
        lines.append(f"| {r['model']} | {r['batch']} | {r['tokens']} | " + " | ".join(cells) + f" | {base} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt2,bert,vit")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--opset23", action="store_true", help="add an ORT column at opset 23 (RMSNormalization)")
    parser.add_argument("--quick", action="store_true", help="fewer shapes, 4 s per cell")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds of ABBA quads per cell (default 12; 4 quick)")
    parser.add_argument("--min-quads", type=int, default=None, help="at least this many quads per cell (5; 3 quick)")
    parser.add_argument("--cache", default=os.environ.get("TMPDIR", "/tmp") + "/normswap-deploy-bench",
                        help="where the exported .onnx files are kept between runs")
    parser.add_argument("--json", default=None, help="also write the raw figures here")
    parser.add_argument("--control", action="store_true",
                        help="also time the original against itself per cell (the noise floor; doubles the time)")
    parser.add_argument("--round-robin", type=float, default=0, metavar="SECONDS",
                        help="only ORT: the cached exports of each model timed round-robin at batch 1 for SECONDS")
    parser.add_argument("--profile", type=int, default=0, metavar="CALLS",
                        help="only ORT: its profiler's kernel time per op type, original vs converted "
                        "(cached exports, batch 1, the short length), over CALLS calls each")
    parser.add_argument("--kernels", action="store_true",
                        help="only ORT's norm kernels alone, against LayerNormalization (about a minute)")
    parser.add_argument("--norm-calls", action="store_true",
                        help="only the eager norm modules alone (GPT-2's ln_1 and ln_f, LayerNorm vs converted), "
                        "in inference mode and with gradients: the per-call host cost")
    parser.add_argument("--compile-batch1", action="store_true",
                        help="also time torch.compile at batch 1 (one more compile per model)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="time cells by the calling thread's CPU time (default; robust to a loaded "
                        "machine) or by wall time")
    parser.add_argument("--beta-placement", choices=("rounding", "keep", "fold"), default=None,
                        help="the converted model's beta_placement (default: patch's); 'fold' folds a Post-LN "
                        "norm's β through the residual's writer (BERT: no Add after the norm)")
    parser.add_argument("--layers", type=int, default=12, help="transformer layers (12: the real sizes; fewer "
                        "for a plumbing check)")
    parser.add_argument("--gemm-widths", default="", metavar="W,W,..",
                        help="only BERT's FFN GEMMs alone at these widths against 3072 (e.g. 3074,3080,3136)")
    parser.add_argument("--fused-vs-unfused", action="store_true",
                        help="only ORT: the converted model's cached exports with fuse_norms against without")
    parser.add_argument("--carry-eager", action="store_true",
                        help="only BERT eager: the default conversion (mean carry) and mean_carry=False, against "
                        "the original and each other")
    args = parser.parse_args()
    args.engines = [e for e in args.engines.split(",") if e]
    args.budget = args.budget if args.budget is not None else (4.0 if args.quick else 12.0)
    args.min_quads = args.min_quads if args.min_quads is not None else (3 if args.quick else 5)
    torch.set_num_threads(1)
    CLOCK[0] = time.thread_time if args.clock == "cpu" else time.perf_counter
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    t_start = time.perf_counter()
    import onnxruntime
    import transformers

    versions = (f"torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, transformers "
                f"{transformers.__version__}, normswap {getattr(normswap, '__version__', '?')}, "
                f"Python {platform.python_version()}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {versions}; {os.cpu_count()} CPUs; "
          f"load average {load_before[0]:.1f}/{load_before[1]:.1f}/{load_before[2]:.1f}", flush=True)
    if args.round_robin:
        opsets = ["default"] + (["23"] if args.opset23 else []) + ["default-optimised"]  # those cached
        for name in args.models.split(","):
            for label, _ in variants(name):
                batch, n = shapes(label, quick=True)[0]
                print(round_robin(f"{label}-L{args.layers}", cache, opsets, batch, n, args.round_robin), flush=True)
        print(f"load average {os.getloadavg()[0]:.1f}")
        return
    if args.profile:
        for name in args.models.split(","):
            for label, _ in variants(name):
                batch, n = shapes(label, quick=True)[0]
                placed = f"-{args.beta_placement}" if args.beta_placement else ""
                print(op_profile(f"{label}-L{args.layers}", cache, batch, n, args.profile, placed), flush=True)
        print(f"load average {os.getloadavg()[0]:.1f}")
        return
    if args.norm_calls:
        print(norm_calls(args.budget, args.min_quads, args.control))
        print(f"\nGPT-2 small's norm modules in eager, one thread; median of ABBA quads of 200-call blocks "
              f"(quartiles, quads); load average {os.getloadavg()[0]:.1f}")
        return
    if args.fused_vs_unfused:
        print("| model | graph | batch | tokens | fused / unfused | unfused ms |\n|---|---|---|---|---|---|")
        for name in args.models.split(","):
            for label, px in variants(name):
                placed = f"-{args.beta_placement}" if args.beta_placement else ""
                for batch, n in shapes(label, args.quick):
                    fused_against_unfused(f"{label}-L{args.layers}", cache, batch, px or n, args.budget,
                                          args.min_quads, placed)
        print(f"\nload average {os.getloadavg()[0]:.1f}")
        return
    if args.gemm_widths:
        widths = tuple(int(w) for w in args.gemm_widths.split(","))
        print(gemm_widths(widths, (8, 32, 128), args.budget))
        print(f"\nBERT-base FFN (768 -> width -> 768, GELU, biases), one thread; median of ABBA quads (quartiles, "
              f"quads); load average {os.getloadavg()[0]:.1f}")
        return
    if args.carry_eager:
        print(carry_eager(args.budget, args.min_quads, args.layers, args.quick))
        print(f"\nBERT-base eager, one thread; median of ABBA quads, a / b time (quartiles, quads); load average "
              f"{os.getloadavg()[0]:.1f}")
        return
    if args.kernels:
        print(kernel_rows(budget=args.budget / 2))
        print(f"\nwidth 768, one thread; median of ABBA quads (quartiles); load average {os.getloadavg()[0]:.1f}")
        return
    rows: list[dict] = []
    for name in args.models.split(","):
        for label, px in variants(name):
            try:
                rows += run_model(name, label, px, args, cache)
            except Exception as exc:  # noqa: BLE001  (one model's failure must not lose the others' figures)
                print(f"# {label} FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            gc.collect()
            if args.json:
                Path(args.json).write_text(json.dumps({"versions": versions, "rows": rows}, indent=1, default=str))
    load_after = os.getloadavg()
    engines = [e for e in ("ort", "ort23", "ortopt", "ortfuse", "ortoptfuse", "eager", "compile")
               if any(e in r for r in rows)]
    print()
    print(table(rows, engines))
    print(f"\nmedian over ABBA quads of converted/original time (quartiles, quads); 1 thread; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; "
          f"{time.perf_counter() - t_start:.0f} s in all; {' '.join(sys.argv[1:]) or '(defaults)'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"versions": versions, "load": [load_before, load_after],
                                               "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
