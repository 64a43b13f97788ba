"""Float32 latency of Whisper with online Hadamards alone against the original, side by side, in ONNX Runtime
and (``--engines eager``) in torch eager: the encoder, and one cached decoder step.

Three variants of one checkpoint directory each (``normswap convert`` outputs, loaded as the docs load them):
the original; ``native`` (``normswap convert ORIG --out DIR --dtype float32``: β kept, no rotation) and
``online`` (``normswap convert ORIG --out DIR --rotate none --online-hadamard --dtype float32``). Two graphs per
variant, exported by the TorchScript exporter at fixed shapes:

* ``encoder``: log-mel features ``[batch, 80, 3000]`` → the encoder's last hidden state;
* ``step``: one decoder token with a cache already holding ``--past`` self-attention positions and the
  cross-attention keys and values of the 1,500 encoder positions (so the step computes what a cached greedy
  step computes: no cross-attention projection of the encoder output) → the logits of that token.

One thread. Each graph is timed in ABBA rounds (the original, each variant in turn, the original, the variants
in reverse, the original; ``dinov2_online_speed.abba``), each variant's ratio to the mean of the original's three
runs in that round, and the original's last run against its first (the machine's noise). Prints the median and
range over the rounds.

    python benchmarks/whisper_online_speed.py --orig tiny-orig native=tiny-native online=tiny-none --rounds 8
    python benchmarks/whisper_online_speed.py --orig tiny-orig native=tiny-native online=tiny-none \
        online-stock=tiny-none online-b32=tiny-none-b32 --engines eager --graphs step --rounds 12

A variant named ``...-stock`` runs its ops' eager calls in their stock form (``dinov2_online_speed.stock_ops_``:
as before round 51's ``EagerOp``), for a side-by-side of the two forms; one named ``...-r51`` exports its ops in
round 51's stock form (``dinov2_online_speed.r51_ops_``; eager calls unchanged), against round 52's.

    python benchmarks/whisper_online_speed.py --orig base-orig native=base-native online=base-none \
        online-r51=base-none online-b32=base-none-b32 --engines ort eager --rounds 5 --reps 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant_whisper import whisper_model  # noqa: E402
from dinov2_online_speed import abba, r51_ops_, stock_ops_  # noqa: E402

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}


class Encoder(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = model.get_encoder()
        self.train(model.training)  # torch.onnx.export restores the wrapper's mode recursively

    def forward(self, input_features: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_features=input_features).last_hidden_state


class Step(torch.nn.Module):
    """One cached decoder step: ``(ids [batch, 1], k_0, v_0, ck_0, cv_0, k_1, …)`` → logits ``[batch, 1, V]``
    (self-attention keys/values of the past positions and the cross-attention ones, per layer)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.train(model.training)  # torch.onnx.export restores the wrapper's mode recursively

    def forward(self, ids: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        from transformers import DynamicCache, EncoderDecoderCache

        layers = len(kv) // 4
        own = DynamicCache(ddp_cache_data=[(kv[4 * i], kv[4 * i + 1]) for i in range(layers)])
        cross = DynamicCache(ddp_cache_data=[(kv[4 * i + 2], kv[4 * i + 3]) for i in range(layers)])
        cache = EncoderDecoderCache(own, cross)
        for i in range(layers):  # the cross-attention keys/values are given: the step must not recompute them
            cache.is_updated[i] = True
        past = kv[0].shape[2]
        pos = torch.full_like(ids, past)
        # the decoder layers attend across only when given encoder states; with the cache marked updated they take
        # the keys and values from it and never read these (a placeholder of one position)
        placeholder = kv[2].new_zeros(ids.shape[0], 1, self.model.config.d_model)
        out = self.model.model.decoder(input_ids=ids, cache=cache, use_cache=True, position_ids=pos,
                                       encoder_hidden_states=placeholder)
        return self.model.proj_out(out.last_hidden_state)


def step_inputs(model: torch.nn.Module, feats: torch.Tensor, past: int) -> tuple[torch.Tensor, ...]:
    """A real cache: the encoder on ``feats`` and ``past`` forced tokens through the model, then the next id."""
    ids = torch.randint(0, model.config.vocab_size, (feats.shape[0], past + 1),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_features=feats, decoder_input_ids=ids[:, :past], use_cache=True)
    cache = out.past_key_values
    kv: list[torch.Tensor] = []
    for i in range(len(cache.self_attention_cache.layers)):
        s, c = cache.self_attention_cache.layers[i], cache.cross_attention_cache.layers[i]
        kv += [s.keys, s.values, c.keys, c.values]
    return (ids[:, past:], *kv)


def main(argv: list[str] | None = None) -> dict[str, dict[str, list[float]]]:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--orig", type=Path, required=True)
    ap.add_argument("variants", nargs="+", help="name=DIR")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--past", type=int, default=24, help="self-attention positions in the step's cache")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3, help="runs per timing (the step: 20 times this)")
    ap.add_argument("--graphs", nargs="+", default=["encoder", "step"], choices=["encoder", "step"])
    ap.add_argument("--engines", nargs="+", default=["ort"], choices=["ort", "eager"],
                    help="ONNX Runtime (the exported graphs) and/or torch eager (the same wrappers called under "
                    "torch.inference_mode: the per-call host cost a decode loop in PyTorch pays)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="what a timing measures: wall time (perf_counter), or this thread's CPU time "
                    "(thread_time: steadier on a loaded machine; one thread, and ONNX Runtime with one intra-op "
                    "thread computes in the calling thread)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    clock = CLOCKS[args.clock]
    torch.set_num_threads(1)
    dirs = {"original": args.orig, **{v.split("=", 1)[0]: Path(v.split("=", 1)[1]) for v in args.variants}}
    models = {name: whisper_model(d) for name, d in dirs.items()}
    for name, m in models.items():
        if name.endswith("-stock"):  # the same checkpoint, its ops' eager calls in their stock form
            print(f"{name}: {stock_ops_(m)} ops in their stock form", flush=True)
        if name.endswith("-r51"):  # the same checkpoint, its ops exported in round 51's stock form
            print(f"{name}: {r51_ops_(m)} ops captured in round 51's stock form", flush=True)
    feats = torch.randn(args.batch, models["original"].config.num_mel_bins, 3000,
                        generator=torch.Generator().manual_seed(1))
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines:
            for graph in args.graphs:
                run: dict[str, Callable[[], float]] = {}
                ref = None
                for name, m in models.items():
                    wrap = Encoder(m) if graph == "encoder" else Step(m)
                    # the step: each variant's own cache (its keys and values are its own functions of the input)
                    inputs = (feats,) if graph == "encoder" else step_inputs(m, feats, args.past)
                    reps = args.reps * (20 if graph == "step" else 1)
                    if engine == "eager":
                        with torch.inference_mode():
                            got = wrap(*inputs)
                        ref = got if ref is None else ref
                        print(f"eager {graph} {name}: against the original's eager output "
                              f"{float((got - ref).abs().max() / ref.abs().max()):.1e}", flush=True)

                        def seconds(w: torch.nn.Module = wrap, i: tuple = inputs, n: int = reps) -> float:
                            with torch.inference_mode():
                                t0 = clock()
                                for _ in range(n):
                                    w(*i)
                                return (clock() - t0) / n
                        run[name] = seconds
                        continue
                    names = [f"x{i}" for i in range(len(inputs))]
                    path = Path(tmp) / f"{graph}-{name}.onnx"
                    with warnings.catch_warnings(), torch.no_grad():
                        warnings.simplefilter("ignore")
                        torch.onnx.export(wrap, inputs, str(path), input_names=names, dynamo=False, opset_version=17)
                        eager = wrap(*inputs)
                    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
                    feed = {n: t.numpy() for n, t in zip(names, inputs, strict=True)}
                    got = torch.from_numpy(sess.run(None, feed)[0])
                    ref = eager if ref is None else ref
                    err_eager = float((got - eager).abs().max() / eager.abs().max())
                    err_ref = float((got - ref).abs().max() / ref.abs().max())
                    print(f"{graph} {name}: ONNX Runtime against its eager model {err_eager:.1e}, against the "
                          f"original's eager output {err_ref:.1e}", flush=True)

                    def seconds(s: ort.InferenceSession = sess, f: dict = feed, n: int = reps) -> float:
                        t0 = clock()
                        for _ in range(n):
                            s.run(None, f)
                        return (clock() - t0) / n
                    run[name] = seconds
                for fn in run.values():  # warm-up
                    fn()
                key = graph if engine == "ort" else f"eager {graph}"
                results[key] = ratios = abba(run, args.rounds)
                print(f"\n{'ONNX Runtime' if engine == 'ort' else 'torch eager'} {graph}, batch {args.batch}"
                      + (f", {args.past} past positions" if graph == "step" else "")
                      + f", {args.rounds} ABBA rounds, time / original's:")
                print("| variant | median | range |\n|---|---|---|")
                for name, r in ratios.items():
                    print(f"| {name} | {statistics.median(r):.3f} | {min(r):.3f}-{max(r):.3f} |", flush=True)
                if args.json:
                    args.json.write_text(json.dumps({"batch": args.batch, "past": args.past, "rounds": args.rounds,
                                                     "reps": args.reps, "clock": args.clock,
                                                     "ratios": results}, indent=1))
    return results


if __name__ == "__main__":
    main()
