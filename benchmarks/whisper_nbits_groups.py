"""Where a converted Whisper's 4-bit block-wise (``MatMulNBits``) cost comes from: one Linear group at a time.

ONNX Runtime's ``MatMulNBitsQuantizer`` with its default RTN algorithm (``block_size=32``,
``is_symmetric=True``) rounds every weight ``MatMul`` in blocks of 32 input features, one scale per block and
output column: the scale is the block's value of largest magnitude, signed, over ``-8`` (MLAS
``range2scale``), the codes ``round(w / scale + 8)`` (a tie up) clamped to ``0..15``. :func:`rtn4` is that grid in
float; ``--check`` compares it with the weights ONNX Runtime wrote (every ``MatMulNBits`` of a quantized
graph dequantized against the float graph's initializers).

Two measurements, original against variant, on the same clips:

* per Linear (float64, every Linear rounded on its own, inputs from the unrounded model): the relative
  output error ``‖(Q(W) − W) x‖ / ‖W x‖`` and its token-centred part (what the next LayerNorm keeps of a
  writer's error), with the median per-block range (max|w| / rms(w) over each block of 32);
* per group (float32, only that group rounded, the rest of the model float): teacher-forced KL of the
  decoder's distributions against the unrounded original, summed per clip, and the ratio variant /
  original with a paired bootstrap over clips. Groups: encoder / decoder × readers (q, k, v, fc1) and
  writers (out_proj, fc2), cross-attention's q and k/v apart, the LM head (``proj_out``), and all.

    python benchmarks/whisper_nbits_groups.py ORIG VARIANT SPEECH_DIR [--clips 16] [--linears 2] \
        [--groups all,enc.writers,...] [--nulls K]   # K null draws of the original (whisper_null_draws.py)
    python benchmarks/whisper_nbits_groups.py --check FLOAT.onnx NBITS.onnx
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quant_whisper as bq  # noqa: E402
from speech_samples import load_clips  # noqa: E402

BLOCK = 32


def rtn4(w: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """``w`` (out, in) rounded as ``MatMulNBits`` RTN symmetric 4-bit, blocks of ``block`` along ``in``."""
    out, k = w.shape
    b = w.reshape(out, k // block, block)
    big = b.gather(-1, b.abs().argmax(-1, keepdim=True))  # the signed value of largest magnitude
    scale = big / -8
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    # MLAS: roundf(w × (1 / scale) + 8), so a tie rounds up (the code is positive once 8 is added)
    q = (b * (1 / safe) + 8 + 0.5).floor().clamp(0, 15)
    return ((q - 8) * scale).reshape(out, k)


def block_range(w: torch.Tensor, block: int = BLOCK) -> float:
    """Median over blocks of max|w| / rms(w): how far a block's largest weight sits above its typical one."""
    b = w.reshape(w.shape[0], -1, block).double()
    return float((b.abs().amax(-1) / b.pow(2).mean(-1).sqrt().clamp_min(1e-30)).median())


def nbits_weights(fp32: Path, nbits: Path):
    """Every ``MatMulNBits`` weight of the quantized graph ``nbits``, dequantized as the kernel reads it (4-bit
    codes, per-block scales, the block's zero point or 8), with the float graph ``fp32``'s weight it replaced
    (``(out, in)``, or None where ``fp32`` has no initializer of that name): ``(node name, dequantized, float)``
    per node, in graph order."""
    import onnx
    from onnx import numpy_helper

    inits = {i.name: i for i in onnx.load(str(fp32)).graph.initializer}
    q = onnx.load(str(nbits))
    qinits = {i.name: i for i in q.graph.initializer}
    for node in q.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        k, nout, block = attrs["K"], attrs["N"], attrs["block_size"]
        packed = numpy_helper.to_array(qinits[node.input[1]]).reshape(nout, -1)
        codes = np.stack([packed & 0x0F, packed >> 4], -1).reshape(nout, -1)[:, :k].astype(np.float64)
        scales = numpy_helper.to_array(qinits[node.input[2]]).reshape(nout, -1).astype(np.float64)
        if len(node.input) > 3 and node.input[3]:
            zero = np.repeat(numpy_helper.to_array(qinits[node.input[3]]).reshape(nout, -1).astype(np.float64),
                             block, axis=1)[:, :k]
        else:
            zero = 8.0
        deq = (codes - zero) * np.repeat(scales, block, axis=1)[:, :k]
        # the float graph's MatMul weight (in, out) under the same name the quantizer replaced
        src = node.input[1].removesuffix("_Q4")
        yield node.name, deq, (numpy_helper.to_array(inits[src]).T if src in inits else None)


def check(fp32: Path, nbits: Path) -> None:
    """Every ``MatMulNBits`` weight of ``nbits`` dequantized, against :func:`rtn4` of ``fp32``'s initializer."""
    worst, n, total = 0, 0, 0
    for name, deq, w in nbits_weights(fp32, nbits):
        if w is None:
            print(f"{name}: no float initializer")
            continue
        sim = rtn4(torch.from_numpy(np.ascontiguousarray(w)).float()).double().numpy()
        off = np.abs(sim - deq) > 1e-6 * np.abs(deq).max()
        worst, n, total = worst + int(off.sum()), n + 1, total + off.size
    print(f"{n} MatMulNBits weights: {worst} of {total} rounded weights differ from ONNX Runtime's "
          f"({worst / total:.1e}; float32 ties)")


def groups(name: str) -> list[str]:
    """The groups a Linear belongs to (``all`` included)."""
    side = "enc" if ".encoder." in name else "dec" if ".decoder." in name else "head"
    if side == "head":
        return ["head", "all"]
    leaf = name.rsplit(".", 1)[-1]
    role = "writers" if leaf in ("out_proj", "fc2") else "readers"
    out = [f"{side}.{role}", "all"]
    if "encoder_attn" in name:
        out.append("dec.cross.kv" if leaf in ("k_proj", "v_proj") else f"dec.cross.{leaf.split('_')[0]}")
    elif side == "dec" and leaf in ("out_proj", "fc2"):
        out.append(f"dec.{'self.out' if leaf == 'out_proj' else 'fc2'}")
    elif side == "enc" and leaf in ("out_proj", "fc2"):
        out.append(f"enc.{'out' if leaf == 'out_proj' else 'fc2'}")
    return out


GROUPS = ["all", "enc.readers", "enc.writers", "enc.out", "enc.fc2", "dec.readers", "dec.writers", "dec.self.out",
          "dec.cross.out", "dec.fc2", "dec.cross.q", "dec.cross.kv", "head"]


def forced_logp(model: torch.nn.Module, feats: torch.Tensor, ids: list[torch.Tensor], enc: list | None = None
                ) -> tuple[list[torch.Tensor], list]:
    """Teacher-forced log-probs of each clip (one clip a pass); ``enc``: encoder states to reuse."""
    p = len(bq.SOT_NOTS)
    out, states = [], []
    with torch.inference_mode():
        for i in range(len(ids)):
            kw = {"encoder_outputs": (enc[i],)} if enc is not None else {"input_features": feats[i:i + 1]}
            r = model(decoder_input_ids=ids[i][None], use_cache=False, **kw)
            states.append(r.encoder_last_hidden_state)
            out.append(torch.log_softmax(r.logits[0, p - 1:].double(), -1))
    return out, states


def clip_kl(ref: list[torch.Tensor], got: list[torch.Tensor]) -> np.ndarray:
    return np.array([float((a.exp() * (a - b)).sum()) for a, b in zip(ref, got, strict=True)])


def per_group(model_dir: Path, feats: torch.Tensor, ids: list[torch.Tensor], ref: list[torch.Tensor],
              names: list[str], null_seed: int | None = None) -> dict[str, np.ndarray]:
    """Per-clip summed KL against ``ref`` with only one group's Linears rounded, for each group of ``names``;
    ``null_seed``: the model first re-written as a null draw (``whisper_null_draws.shift``: same function,
    other roundings)."""
    model = bq.whisper_model(model_dir)
    if null_seed is not None:
        import whisper_null_draws

        whisper_null_draws.shift(model, null_seed)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    own = {n: m.weight.detach().clone() for n, m in linears.items()}
    rounded = {n: rtn4(w) for n, w in own.items()}
    # the float encoder's states, reused by the groups that round no encoder Linear
    decoder_only = [g for g in names if not any(".encoder." in n for n in linears if g in groups(n))]
    enc_float = forced_logp(model, feats, ids)[1] if decoder_only else None
    out = {}
    label = model_dir.name if null_seed is None else f"null{null_seed}"
    for g in names:
        chosen = [n for n in linears if g in groups(n)]
        for n, m in linears.items():  # a fresh parameter: proj_out may share the embedding's (tied original)
            m.weight = torch.nn.Parameter(rounded[n] if n in chosen else own[n], requires_grad=False)
        encoder_touched = any(".encoder." in n for n in chosen)
        got, _ = forced_logp(model, feats, ids, None if encoder_touched else enc_float)
        out[g] = clip_kl(ref, got)
        print(f"  {label} {g}: {len(chosen)} Linears, KL {out[g].sum() / sum(len(r) for r in ref):.4e}",
              flush=True)
    return out


def per_linear(model_dir: Path, feats: torch.Tensor, ids: list[torch.Tensor]) -> dict[str, dict]:
    """Every Linear rounded on its own in float64: summed squared output error (whole, token-centred) and
    the squared reference, inputs from the unrounded model."""
    model = bq.whisper_model(model_dir).double()
    out: dict[str, dict] = {}

    def hook(name: str, mod: torch.nn.Linear):
        q = rtn4(mod.weight.detach())

        def record(_mod, inputs, _y) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            ref = x @ mod.weight.T
            err = x @ (q - mod.weight).T
            r = out.setdefault(name, {"err": 0.0, "ref": 0.0, "err_c": 0.0, "ref_c": 0.0,
                                      "w_range": block_range(mod.weight.detach())})
            r["err"] += float(err.pow(2).sum())
            r["ref"] += float(ref.pow(2).sum())
            r["err_c"] += float((err - err.mean(-1, keepdim=True)).pow(2).sum())
            r["ref_c"] += float((ref - ref.mean(-1, keepdim=True)).pow(2).sum())
        return record

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            mod.register_forward_hook(hook(name, mod))
    with torch.inference_mode():
        for i in range(len(ids)):
            model(input_features=feats[i:i + 1].double(), decoder_input_ids=ids[i][None], use_cache=False)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", type=Path, nargs="+", help="ORIG VARIANT SPEECH_DIR, or with --check FLOAT NBITS")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--clips", type=int, default=16, help="clips for the per-group KL")
    ap.add_argument("--linears", type=int, default=2, help="clips for the per-Linear errors (0: skip)")
    ap.add_argument("--groups", default=",".join(GROUPS), help="comma list of the groups rounded (default: all)")
    ap.add_argument("--nulls", type=int, default=0,
                    help="also K null draws of the original (whisper_null_draws.py: same function, other roundings)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.check:
        check(*args.paths)
        return
    orig, variant, speech = args.paths
    from transformers import AutoTokenizer

    bq.set_prompt(orig)
    clips = load_clips(speech)[: max(args.clips, args.linears)]
    feats = torch.from_numpy(bq.features(orig, clips))
    tok = AutoTokenizer.from_pretrained(orig)
    ids = [torch.tensor([*bq.SOT_NOTS, *tok.encode(" " + t.strip(), add_special_tokens=False)]) for _, t in clips]
    result: dict = {"clips": args.clips, "linear_clips": args.linears}
    if args.linears:
        a = per_linear(orig, feats[: args.linears], ids[: args.linears])
        b = per_linear(variant, feats[: args.linears], ids[: args.linears])
        print("| Linear | centred rel. error, original | variant | ratio | block range o / v |")
        print("|---|---|---|---|---|")
        rows = []
        for name, o in a.items():
            v = b[name]
            c_o, c_v = math.sqrt(o["err_c"] / o["ref_c"]), math.sqrt(v["err_c"] / v["ref_c"])
            rows.append({"linear": name, "orig": c_o, "variant": c_v, "w_range_o": o["w_range"],
                         "w_range_v": v["w_range"]})
            if abs(c_v / c_o - 1) > 1e-3:
                print(f"| {name} | {c_o:.3e} | {c_v:.3e} | {c_v / c_o:.3f} | {o['w_range']:.2f} / "
                      f"{v['w_range']:.2f} |", flush=True)
        result["linears"] = rows
    if args.clips:
        n = args.clips
        ref, _ = forced_logp(bq.whisper_model(orig), feats[:n], ids[:n])
        names = args.groups.split(",")
        ko = per_group(orig, feats[:n], ids[:n], ref, names)
        kv = per_group(variant, feats[:n], ids[:n], ref, names)
        pos = np.array([len(r) for r in ref], dtype=float)
        if args.nulls:
            result["nulls"] = {}
            for seed in range(1, args.nulls + 1):
                kn = per_group(orig, feats[:n], ids[:n], ref, names, null_seed=seed)
                result["nulls"][seed] = {g: kn[g].tolist() for g in names}
            print("\n| group rounded | variant / original | null draws / original |")
            print("|---|---|---|")
            for g in names:
                nulls = [sum(result["nulls"][s][g]) / ko[g].sum() for s in result["nulls"]]
                print(f"| {g} | {kv[g].sum() / ko[g].sum():.3f} | {', '.join(f'{r:.3f}' for r in nulls)} |")
        print("\n| group rounded | KL original | KL variant | ratio (95% CI) |")
        print("|---|---|---|---|")
        result["groups"] = {}
        for g in names:
            lo, hi = bq.bootstrap(kv[g], pos, ko[g], pos)
            r = kv[g].sum() / ko[g].sum()
            print(f"| {g} | {ko[g].sum() / pos.sum():.4e} | {kv[g].sum() / pos.sum():.4e} | {r:.3f} "
                  f"({lo:.3f}–{hi:.3f}) |", flush=True)
            result["groups"][g] = {"orig": ko[g].tolist(), "variant": kv[g].tolist(), "ratio": r, "lo": lo, "hi": hi}
        result["positions"] = pos.tolist()
    if args.json:
        args.json.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
