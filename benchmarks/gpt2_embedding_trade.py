"""Would a ``wte ↔ wpe`` constant trade matter on GPT-2? Measured on GPT-2 small with random weights.

``normswap.patch`` centers GPT-2's two embedding tables row by row (every token's stream is
``wte[id] + wpe[t]``, and only that sum must be zero-mean) and proposes no constant trade there: the rule
(:mod:`normswap.analysis.trades`) needs a float writer (a bias) or a one-token parameter reaching the
table's tokens, and GPT-2 has neither before its first norm. Exact alternatives exist all the same, and
this script builds them by hand from the default conversion:

* ``trade-wpe``: ``wpe`` keeps ``c``, the mean of its original row means, and every ``wte`` row takes ``−c``;
* ``trade-wte``: ``wte`` keeps the mean of *its* row means, every ``wpe`` row takes it away.

Each is exact in float64 (checked: every token's sum is unchanged). The weights any Linear quantizer rounds
are identical in ``native`` and both trades (the tables are the only difference, ``lm_head`` is untied from
``wte`` by the conversion), so the trade can only matter where a quantizer rounds the embedding tables:
ONNX Runtime's ``quantize_dynamic`` does (``Gather`` is in its default op types: uint8, min/max, one scale
per tensor). Quantizers here, simulated in float on the tables only (everything else float32):

* ``emb-pt``: asymmetric uint8 per tensor (ONNX Runtime's dynamic ``Gather``);
* ``emb-row``: symmetric int8 per row (a per-channel embedding quantizer);

error: mean KL(original float ‖ quantized) of the next-token distributions over random token sequences, and
each variant's ratio to the original's with a 95% paired bootstrap interval over sequences.

    python benchmarks/gpt2_embedding_trade.py --layers 4 --sequences 16 --tokens 64
"""

from __future__ import annotations

import argparse
import copy
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers as tf

VARIANTS = ("original", "native", "trade-wpe", "trade-wte")
QUANTIZERS = ("emb-pt", "emb-row")


def build(layers: int, seed: int) -> torch.nn.Module:
    """GPT-2 small's shape, random weights (transformers' init), LayerNorm γ/β randomised, float64, eval."""
    torch.manual_seed(seed)
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=layers)).double().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g, dtype=torch.float64))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g, dtype=torch.float64))
    return model


@torch.no_grad()
def traded(native: torch.nn.Module, original: torch.nn.Module, keeper: str) -> dict[str, torch.Tensor]:
    """``native``'s tables (float64) with ``keeper`` keeping the mean of its original row means and the other
    table taking it away."""
    tables = {t: getattr(native.transformer, t).weight.detach().double().clone() for t in ("wte", "wpe")}
    c = getattr(original.transformer, keeper).weight.double().mean(-1).mean()
    tables[keeper] += c
    tables["wpe" if keeper == "wte" else "wte"] -= c
    return tables


def fake_quant(table: torch.Tensor, how: str) -> torch.Tensor:
    t = table.detach().double()
    if how == "emb-pt":  # ONNX Runtime's dynamic Gather: uint8, min/max with a zero point, one scale per tensor
        low, high = min(float(t.min()), 0.0), max(float(t.max()), 0.0)
        step = (high - low) / 255
        zero = round(-low / step)
        return ((torch.round(t / step) + zero).clamp(0, 255) - zero) * step
    step = t.abs().amax(-1, keepdim=True) / 127  # symmetric int8, one scale per row
    return torch.round(t / step) * step


@torch.no_grad()
def logprobs(model: torch.nn.Module, ids: torch.Tensor, batch: int = 4) -> torch.Tensor:
    """Next-token log-probabilities, float32 (sequences × tokens × vocabulary: keep the run small)."""
    return torch.cat([torch.log_softmax(model(input_ids=ids[i:i + batch]).logits.float(), -1)
                      for i in range(0, len(ids), batch)])


@torch.no_grad()
def kl_per_sequence(model: torch.nn.Module, ids: torch.Tensor, ref: torch.Tensor, batch: int = 4) -> torch.Tensor:
    """Mean KL(ref ‖ model) over each sequence's positions, batch by batch (no second full tensor)."""
    out = []
    for i in range(0, len(ids), batch):
        lp = torch.log_softmax(model(input_ids=ids[i:i + batch]).logits.float(), -1)
        r = ref[i:i + batch]
        out.append((r.exp() * (r - lp)).sum(-1).double().mean(-1))
    return torch.cat(out)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    import normswap

    torch.set_num_threads(1)
    original = build(args.layers, args.seed)
    native = copy.deepcopy(original)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = normswap.patch(native, untie=True)  # the tables centered by weights (the tie kept: an op)
    assert native.lm_head.weight is not native.transformer.wte.weight, "the conversion unties lm_head from wte"
    ids = torch.randint(0, original.config.vocab_size, (args.sequences, args.tokens),
                        generator=torch.Generator().manual_seed(args.seed + 1))
    pos = torch.arange(args.tokens)
    tables = {name: {t: getattr(m.transformer, t).weight.detach().double().clone() for t in ("wte", "wpe")}
              for name, m in (("original", original), ("native", native))}
    tables["trade-wpe"] = traded(native, original, "wpe")
    tables["trade-wte"] = traded(native, original, "wte")
    result: dict[str, Any] = {"layers": args.layers, "sequences": args.sequences, "tokens": args.tokens,
                              "trades_proposed": len(report.plan.constant_trades), "rows": {}}
    sums = {n: tb["wte"][ids] + tb["wpe"][pos] for n, tb in tables.items()}  # each token's stream, float64
    original, native = original.float(), native.float()  # measured in float32 (two models in memory, not five)
    ref = logprobs(original, ids)
    for name, tb in tables.items():
        model = original if name == "original" else native
        sum_err = float((sums[name] - sums["native"]).abs().max()) if name != "original" else 0.0
        tok = sums[name]
        mean_ratio = float((tok.mean(-1).abs() / tok.pow(2).mean(-1).sqrt()).max())
        moved = {t: float((tb[t] - tables["original"][t]).abs().max()) for t in ("wte", "wpe")}
        row: dict[str, Any] = {"stream_mean_ratio": mean_ratio, "sum_change_vs_native": sum_err, "moved": moved,
                               "kl": {}}
        for how in ("float", *QUANTIZERS):
            with torch.no_grad():
                for t in ("wte", "wpe"):
                    w = tb[t] if how == "float" else fake_quant(tb[t], how)
                    getattr(model.transformer, t).weight.copy_(w)
            kl = kl_per_sequence(model, ids, ref)
            row["kl"][how] = kl.tolist()
            print(f"{name:10s} {how:8s} KL {float(kl.mean()):.3e}  (sum change {sum_err:.1e}, "
                  f"|mean|/rms {mean_ratio:.1e}, wte moved {moved['wte']:.2e}, wpe {moved['wpe']:.2e})", flush=True)
        with torch.no_grad():
            for t in ("wte", "wpe"):
                getattr(model.transformer, t).weight.copy_(tb[t])
        result["rows"][name] = row
    rng = np.random.default_rng(0)
    lines = [f"\nGPT-2 ({args.layers} layers, random weights), {args.sequences} × {args.tokens} tokens; KL ratio to "
             "the original's, 95% paired bootstrap over sequences", "", "| variant | " + " | ".join(QUANTIZERS)
             + " | wte moved (max) | wpe moved (max) |", "|---|" + "---|" * (len(QUANTIZERS) + 2)]
    base = result["rows"]["original"]["kl"]
    lines.insert(4, "| original (KL) | " + " | ".join(f"{np.mean(base[h]):.3e}" for h in QUANTIZERS) + " | – | – |")
    for name in VARIANTS[1:]:
        row = result["rows"][name]
        cells = []
        for how in QUANTIZERS:
            a, b = np.array(row["kl"][how]), np.array(base[how])
            idx = rng.integers(0, len(a), (2000, len(a)))
            lo, hi = np.percentile(a[idx].mean(1) / b[idx].mean(1), [2.5, 97.5])
            cells.append(f"{a.mean() / b.mean():.3f} ({lo:.3f}-{hi:.3f})")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {row['moved']['wte']:.2e} | {row['moved']['wpe']:.2e} |")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
