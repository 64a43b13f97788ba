"""Which of a converted Whisper's writer columns re-round, and do they carry the large activations?

The default conversion centres every writer's rows (``W − 1·mᵀ``, ``m`` the mean row): input feature
``j``'s column moves by ``m_j``. ``MatMulNBits``' symmetric RTN (blocks of 32 input features per output
row, scale = the block's signed largest value / −8) stores a block's largest-magnitude weight exactly (code
0). If a column rides on a common offset ``m_j`` large enough to be its block's largest entry in most rows,
the original rounds it exactly; centred, its entries are ordinary and round like the rest. What that costs
depends on the activation that column multiplies.

Per writer (``out_proj``, ``fc2``), inputs from the float original on a few clips (the converted writer
reads the same inputs): each input feature's rms activation; the column's shift ``|m_j| / rms(W[:, j])``;
how often the column is its block's largest entry (original, converted); and the token-centred output
error energy (what the next LayerNorm keeps) split per column, ``Σ_t x_j(t)² · ‖E_c[:, j]‖²`` (the cross
terms between columns left out), for the original's and the converted rounding. Printed: per writer the
converted / original energy, and the same for the top ``--top`` activation columns and for the rest.

``--nulls K``: how much of the error each exact shift of the original re-draws (entries whose rounding changes,
and their share of the activation-weighted error energy): the conversion's centring, K random-vector shifts
and 3 random-sign shifts (``whisper_null_draws.py``).

    python benchmarks/whisper_moved_columns.py ORIG CONV SPEECH_DIR [--clips 2] [--top 8] [--nulls 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quant_whisper as bq  # noqa: E402
from speech_samples import load_clips  # noqa: E402
from whisper_nbits_groups import BLOCK, rtn4  # noqa: E402
from whisper_null_draws import writers  # noqa: E402


def block_argmax_share(w: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Per input column: the share of output rows in which it is its block's largest-magnitude entry."""
    out, k = w.shape
    b = w.abs().reshape(out, k // block, block)
    hit = torch.zeros_like(b)
    hit.scatter_(-1, b.argmax(-1, keepdim=True), 1.0)
    return hit.reshape(out, k).mean(0)


def column_energy(w: torch.Tensor, act_sq: torch.Tensor) -> torch.Tensor:
    """Per input column ``j``: ``act_sq[j] · ‖E_c[:, j]‖²``, ``E`` = RTN error of ``w``, centred over outputs."""
    e = (rtn4(w.float()).double() - w.double())
    e = e - e.mean(0, keepdim=True)
    return act_sq * e.pow(2).sum(0)


def _step(w: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Each entry's 4-bit step (its block's largest magnitude / 8)."""
    out, k = w.shape
    b = w.abs().reshape(out, k // block, block)
    return (b.amax(-1, keepdim=True) / 8).expand_as(b).reshape(out, k)


def redrawn(w: torch.Tensor, moved: torch.Tensor, act_sq: torch.Tensor) -> tuple[float, float]:
    """How much of ``w``'s rounding ``moved`` (``w`` shifted, same function) draws anew: the share of entries
    whose rounding error jumps by more than a quarter step (another code; the shift itself drifts an error by
    ~3% of a step), and the share of ``w``'s activation-weighted error energy ``Σ act_sq[j] E[o, j]²`` on those
    entries (a re-rounded entry of a column with a large activation counts for more)."""
    e = rtn4(w.float()).double() - w.double()
    e2 = rtn4(moved.float()).double() - moved.double()
    changed = (e2 - e).abs() > 0.25 * _step(w.double())
    energy = act_sq * e.pow(2)
    return float(changed.double().mean()), float(energy[changed].sum() / energy.sum())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", type=Path, nargs=3, help="ORIG CONV SPEECH_DIR")
    ap.add_argument("--clips", type=int, default=2)
    ap.add_argument("--top", type=int, default=8, help="the columns with the largest activations, per writer")
    ap.add_argument("--nulls", type=int, default=0,
                    help="also the shares of error re-drawn by K random-vector shifts and 3 random-sign shifts of the "
                         "original (whisper_null_draws.shift), against the conversion's")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    orig_dir, conv_dir, speech = args.paths
    from transformers import AutoTokenizer

    bq.set_prompt(orig_dir)
    clips = load_clips(speech)[: args.clips]
    feats = torch.from_numpy(bq.features(orig_dir, clips))
    tok = AutoTokenizer.from_pretrained(orig_dir)
    original, conv = bq.whisper_model(orig_dir), bq.whisper_model(conv_dir)
    ws, wc = writers(original), writers(conv)
    act_sq = {n: torch.zeros(m.in_features, dtype=torch.float64) for n, m in ws.items()}

    def hook(name: str):
        def record(_mod, inputs, _y) -> None:
            act_sq[name] += inputs[0].reshape(-1, inputs[0].shape[-1]).double().pow(2).sum(0)
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in ws.items()]
    with torch.inference_mode():
        for i, (_, text) in enumerate(clips):
            ids = torch.tensor([[*bq.SOT_NOTS, *tok.encode(" " + text.strip(), add_special_tokens=False)]])
            original(input_features=feats[i:i + 1], decoder_input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    rows = []
    print(f"| writer | act. top/median | top-{args.top} cols: shift |m|/rms(col) (median cols) | largest-in-block "
          "o → c (top cols) | energy c/o: all | top cols | rest | top cols' share of o's energy |")
    print("|---|---|---|---|---|---|---|---|")
    for name, mod in ws.items():
        w_o, w_c = mod.weight.detach().double(), wc[name].weight.detach().double()
        a = act_sq[name]
        rms_a = a.sqrt()
        top = torch.argsort(rms_a, descending=True)[: args.top]
        rest = torch.ones_like(a, dtype=torch.bool)
        rest[top] = False
        shift = (w_o - w_c).mean(0).abs() / w_o.pow(2).mean(0).sqrt()
        eo, ec = column_energy(w_o, a), column_energy(w_c, a)
        share_o, share_c = block_argmax_share(w_o), block_argmax_share(w_c)
        row = {"writer": name, "act_top_over_median": float(rms_a[top[0]] / rms_a.median()),
               "shift_top": float(shift[top].mean()), "shift_median": float(shift.median()),
               "argmax_top_o": float(share_o[top].mean()), "argmax_top_c": float(share_c[top].mean()),
               "energy_all": float(ec.sum() / eo.sum()), "energy_top": float(ec[top].sum() / eo[top].sum()),
               "energy_rest": float(ec[rest].sum() / eo[rest].sum()), "top_share_o": float(eo[top].sum() / eo.sum()),
               "corr_shift_act": float(np.corrcoef(shift.numpy(), rms_a.numpy())[0, 1])}
        rows.append(row)
        print(f"| {name.removeprefix('model.')} | {row['act_top_over_median']:.1f} | {row['shift_top']:.3f} "
              f"({row['shift_median']:.3f}) | {row['argmax_top_o']:.2f} → {row['argmax_top_c']:.2f} | "
              f"{row['energy_all']:.3f} | {row['energy_top']:.3f} | {row['energy_rest']:.3f} | "
              f"{row['top_share_o']:.2f} |", flush=True)
    tot = {k: float(np.exp(np.mean(np.log([r[k] for r in rows])))) for k in ("energy_all", "energy_top", "energy_rest")}
    print(f"\ngeometric mean over {len(rows)} writers, converted / original centred error energy: all "
          f"{tot['energy_all']:.3f}, top-{args.top} activation columns {tot['energy_top']:.3f}, the rest "
          f"{tot['energy_rest']:.3f}")
    out = {"clips": args.clips, "top": args.top, "rows": rows, "geomean": tot}
    if args.nulls:
        import copy

        import whisper_null_draws

        shifts = {"conversion (centring)": wc}
        for seed in range(1, args.nulls + 1):
            m = copy.deepcopy(original)
            whisper_null_draws.shift(m, seed)
            shifts[f"random vector, seed {seed}"] = writers(m)
        for seed in (1, 2, 3):
            m = copy.deepcopy(original)
            whisper_null_draws.shift(m, seed, signs=True)
            shifts[f"mean row, random signs, seed {seed}"] = writers(m)
        m = copy.deepcopy(original)
        whisper_null_draws.shift(m, 0, alpha=-1.0)
        shifts["−1 × mean row"] = writers(m)
        print("\n| the original's writers moved by | entries re-rounded | activation-weighted error energy re-drawn "
              "(mean over writers) |\n|---|---|---|")
        out["redrawn"] = {}
        for label, moved in shifts.items():
            got = [redrawn(ws[n].weight.detach(), moved[n].weight.detach(), act_sq[n]) for n in ws]
            share, energy = float(np.mean([g[0] for g in got])), float(np.mean([g[1] for g in got]))
            out["redrawn"][label] = {"entries": share, "energy": energy,
                                     "per_writer": {n: g for n, g in zip(ws, got, strict=True)}}
            print(f"| {label} | {share:.1%} | {energy:.1%} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out))


if __name__ == "__main__":
    main()
