"""Held-out quantization engines (round 48): bitsandbytes, HQQ and GGUF on real checkpoints.

Issue 40 is "checked by the same measurements on held-out real checkpoints and engines that are not named
here". Earlier rounds held out OpenVINO NNCF and optimum-quanto; this benchmark adds three more engines
people deploy with on CPU, each quantizing with its own code (nothing here re-implements a grid):

* **bitsandbytes** (``bitsandbytes.nn``; its CPU backend): ``bnb-nf4`` / ``bnb-fp4`` swap every ``nn.Linear``
  for ``Linear4bit`` (4-bit NormalFloat / FP4 weights, one absmax per block of 64 consecutive weights, no
  double quantization: ``transformers.BitsAndBytesConfig``'s defaults but the type), ``bnb-int8`` for
  ``Linear8bitLt`` (LLM.int8: int8 weights per row, int8 activations per token, input columns above
  ``threshold=6.0`` kept in float). The model runs through bitsandbytes' modules.
* **HQQ** (the ``hqq`` library, not ONNX Runtime's HQQ mode): ``hqq-w4`` swaps every ``nn.Linear`` for
  ``HQQLinear`` (``BaseQuantizeConfig(nbits=4, group_size=64)``: 4-bit, affine per 64 inputs, its
  half-quadratic optimiser on the zero points), ``hqq-w8`` the same at 8 bits; run by its PyTorch backend.
* **GGUF** (the ``gguf`` package, llama.cpp's Python reference of its block formats): ``gguf-q8_0``,
  ``gguf-q4_0`` (symmetric, one scale per 32 weights), ``gguf-q4_1`` (scale and minimum per 32),
  ``gguf-q5_0``: a **weight round trip** (``gguf.quants.quantize`` then ``dequantize``, in numpy): llama.cpp
  itself runs neither DINOv2 nor Whisper from Python here, so the float model runs the weights exactly as
  llama.cpp stores them (its matmuls also round activations to 8 bits for the quantized types; not
  simulated). A Linear whose input width is not a multiple of the block stays float (none in these models).

Convolutions stay float in every engine (bitsandbytes and HQQ swap only ``nn.Linear``; llama.cpp's vision
and Whisper converters store them in F16), and so does a head over the vocabulary (Whisper's ``proj_out``:
transformers' bitsandbytes and HQQ integrations leave it out). A rotation's own ``Qᵀ`` (``--rotate-output
restore``) is a buffer on the last norm, not a Linear, so it stays float, as docs/rotation.md advises (a
Linear named ``*rotation*``/``*restore*``/``*unrotat*`` would be left float too).

Models: ``--dinov2 DIR`` (a ``Dinov2Model``; error ``1 − cos`` per image against the float32 original, every
token and the CLS embedding, on ``--images`` crops of ``--photos``: bench_quanto's crops and metrics), or
``--whisper DIR`` (teacher-forced KL(float32 original ‖ variant) summed per clip over every decoder position,
forced on the spoken sentence, ``--clips`` clips of ``--speech``). Variants: ``NAME=DIR`` (``normswap
convert`` outputs), and exact re-roundings that pair by seed N with the same draw of the original: ``permuted-N``
/ ``NAME-permuted-N`` (every MLP's hidden neurons reordered: ``fc2`` rounds other numbers) and, for DINOv2,
``reordered-N`` / ``NAME-reordered-N`` (bench_quanto's: heads and value dimensions too, ``o_proj`` as well).
Ratios to the original in the same engine with a 95% paired bootstrap over inputs
(``bench_quant_engines.ci_table``), the typical input too, and the draws table where there are draws
(bench_quanto's ``draw_ratio``: an interval over draws and inputs).

    PYTHONPATH=HELD:$PWD python benchmarks/bench_heldout_engines.py --dinov2 ORIG native=N compat=C had=H \\
        --photos SKIMAGE/data --images 256 --engines bnb-nf4 bnb-int8 hqq-w4 gguf-q4_0 --json out.json
    PYTHONPATH=HELD:$PWD python benchmarks/bench_heldout_engines.py --whisper TINY native=N had=H \\
        --speech SPEECH --clips 64 --engines bnb-nf4 hqq-w4 gguf-q4_0 --json whisper.json
    ... --groups writers readers          # one group of Linears at a time (the others float)

``HELD``: the engines installed apart, e.g. ``pip install --no-deps --target HELD bitsandbytes hqq termcolor
gguf`` (none is a normswap dependency).
"""

from __future__ import annotations

import argparse
import copy
import fnmatch
import json
import re
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

ENGINES = ("fp32", "bnb-nf4", "bnb-fp4", "bnb-int8", "hqq-w4", "hqq-w8", "gguf-q8_0", "gguf-q4_0", "gguf-q4_1",
           "gguf-q5_0")
KEEP_FLOAT = ("*rotation*", "*restore*", "*unrotat*")  # a rotation's own Qᵀ: left in float in every engine
# groups of Linears (fnmatch on module names) for --groups, as bench_quanto's for DINOv2; Whisper's names
GROUPS = {"writers": ["*.o_proj", "*.fc2", "*.out_proj"], "readers": ["*.q_proj", "*.k_proj", "*.v_proj", "*.fc1"],
          "all": ["*"]}


def linears(model: torch.nn.Module, include: list[str] | None = None) -> list[str]:
    """The names of ``model``'s ``nn.Linear`` modules an engine quantizes: matching one of ``include``
    (fnmatch; ``None``: all), none of :data:`KEEP_FLOAT`, and not a head over the vocabulary (a Linear
    shaped like an input embedding, tied to it or not: Whisper's ``proj_out``, which the conversion unties):
    transformers' bitsandbytes and HQQ integrations leave that head in float, and bitsandbytes' CPU 4-bit
    kernel cannot run it (51,864 outputs: not a whole number of its blocks)."""
    vocab = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return [name for name, m in model.named_modules() if type(m) is torch.nn.Linear
            and (include is None or any(fnmatch.fnmatch(name, p) for p in include))
            and not any(fnmatch.fnmatch(name, p) for p in KEEP_FLOAT) and tuple(m.weight.shape) not in vocab]


def swap_linears(model: torch.nn.Module, make: Callable[[torch.nn.Linear], torch.nn.Module],
                 include: list[str] | None = None) -> list[str]:
    """Replace each of ``model``'s :func:`linears` by ``make(linear)``, in place; the names replaced.
    Every replacement is made before any is installed, so a failing ``make`` leaves ``model`` as it was."""
    names = linears(model, include)
    made = {name: carry_input_ops(model.get_submodule(name), make(model.get_submodule(name))) for name in names}
    for name, module in made.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module)
    return names


def carry_input_ops(linear: torch.nn.Module, replacement: torch.nn.Module) -> torch.nn.Module:
    """``replacement`` (the engine's module for ``linear``) given ``linear``'s normswap input op, if it has one:
    its forward pre-hooks, its ``normswap_*`` buffers and ``_normswap_*`` attributes. Returns ``replacement``.

    Why: ``rotate(model, ..., online=True)`` puts its online Hadamard on the Linear itself (a pre-hook reading
    the signs and the small Hadamard factor from the module; the weight holds the op's transpose). An engine
    that swaps the Linear for its own module would drop the op and keep the turned weight: a wrong model, not
    a quantized one. Carried over, the op stays float (it is not a Linear) and the engine rounds the weight,
    as an engine that runs the op would."""
    if replacement is linear:
        return replacement
    for name, buf in linear.named_buffers(recurse=False):
        if name.startswith("normswap"):
            replacement.register_buffer(name, buf)
    for key, value in vars(linear).items():
        if key.startswith("_normswap") and not isinstance(value, torch.utils.hooks.RemovableHandle):
            setattr(replacement, key, value)
    kwargs = linear._forward_pre_hooks_with_kwargs
    for hook_id, hook in linear._forward_pre_hooks.items():
        replacement.register_forward_pre_hook(hook, with_kwargs=hook_id in kwargs)
    return replacement


def gguf_round_trip(weight: torch.Tensor, qtype: str) -> torch.Tensor | None:
    """``weight`` (``[out, in]``) stored in GGUF block type ``qtype`` (``"Q4_0"``…) by the ``gguf`` package's own
    quantizer and read back (``gguf.quants.dequantize``): the float32 values llama.cpp computes with. ``None``
    when the input width is not a multiple of the type's block (the tensor cannot be stored in it)."""
    import gguf
    from gguf import quants

    kind = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[kind][0]
    if weight.shape[-1] % block:
        return None
    w = weight.detach().to(torch.float32).cpu().numpy()
    back = quants.dequantize(quants.quantize(w, kind), kind)
    return torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32)).reshape(weight.shape)


def _bnb_linear(linear: torch.nn.Linear, how: str) -> torch.nn.Module:
    import bitsandbytes as bnb

    w = linear.weight.detach().float().clone()
    if how == "bnb-int8":
        q = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, linear.bias is not None,
                                has_fp16_weights=False, threshold=6.0)
        q.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
    else:
        kind = how.removeprefix("bnb-")
        q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, linear.bias is not None,
                              compute_dtype=torch.float32, compress_statistics=False, quant_type=kind)
        q.weight = bnb.nn.Params4bit(w, requires_grad=False, compress_statistics=False, quant_type=kind,
                                     blocksize=64)
    if linear.bias is not None:
        q.bias = torch.nn.Parameter(linear.bias.detach().float().clone(), requires_grad=False)
    return q.to("cpu")  # bitsandbytes quantizes on the move to a device


def _hqq_linear(linear: torch.nn.Linear, bits: int) -> torch.nn.Module:
    from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

    src = torch.nn.Linear(linear.in_features, linear.out_features, linear.bias is not None)
    # HQQLinear consumes its input module; an online Hadamard's buffers are not the Linear's (carry_input_ops)
    src.load_state_dict({k: v for k, v in linear.state_dict().items() if k in ("weight", "bias")})
    return HQQLinear(src.requires_grad_(False), BaseQuantizeConfig(nbits=bits, group_size=64),
                     compute_dtype=torch.float32, device="cpu")


class _RoundTripped(torch.nn.Linear):
    """A Linear whose weight went through an engine's quantize/dequantize (a new tensor, not written into the
    original's)."""


def _gguf_linear(linear: torch.nn.Linear, qtype: str) -> torch.nn.Module:
    back = gguf_round_trip(linear.weight, qtype)
    if back is None:
        return linear
    q = _RoundTripped(linear.in_features, linear.out_features, linear.bias is not None)
    q.weight = torch.nn.Parameter(back, requires_grad=False)
    if linear.bias is not None:
        q.bias = torch.nn.Parameter(linear.bias.detach().float().clone(), requires_grad=False)
    return q


def quantized(model: torch.nn.Module, how: str, include: list[str] | None = None) -> torch.nn.Module:
    """A copy of ``model`` with its Linears (those of ``include``) quantized by engine setting ``how``."""
    if how == "fp32":
        return model
    q = copy.deepcopy(model)
    if how.startswith("bnb-"):
        make = lambda m: _bnb_linear(m, how)  # noqa: E731
    elif how.startswith("hqq-w"):
        make = lambda m: _hqq_linear(m, int(how.removeprefix("hqq-w")))  # noqa: E731
    elif how.startswith("gguf-"):
        make = lambda m: _gguf_linear(m, how.removeprefix("gguf-").upper())  # noqa: E731
    else:
        raise ValueError(f"unknown engine setting {how!r}; one of {', '.join(ENGINES)}")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        swap_linears(q, make, include)
    return q.eval()


@torch.no_grad()
def mlp_permuted(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A rounding draw of a grouped weight quantizer for any model whose MLPs are ``fc1``/``fc2`` pairs (Whisper's
    layers, DINOv2's ``mlp``): a copy with every MLP's hidden neurons in another order (``fc1``'s rows and bias,
    ``fc2``'s columns), the same function, so ``fc2``'s groups along its input hold other entries and round
    differently. The same seed gives the same order on any model of the same shape (a converted model's draw N
    pairs with the original's). bench_quanto's ``permuted`` for DINOv2, by module names instead of its layout."""
    from bench_quanto import reorder_mlp_

    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    for module in out.modules():
        fc1, fc2 = getattr(module, "fc1", None), getattr(module, "fc2", None)
        if isinstance(fc1, torch.nn.Linear) and isinstance(fc2, torch.nn.Linear):
            reorder_mlp_(fc1, fc2, g)
    return out


def versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    for mod in ("bitsandbytes", "hqq", "gguf", "transformers"):
        try:
            out[mod] = getattr(__import__(mod), "__version__", "?")
        except ImportError:
            out[mod] = "absent"
    if out["gguf"] == "?":
        from importlib.metadata import version

        out["gguf"] = version("gguf")
    return out


# ---------------------------------------------------------------- DINOv2 (bench_quanto's crops and metrics)

def dinov2_rows(args: argparse.Namespace, dirs: dict[str, str]) -> dict[str, Any]:
    from bench_quant_engines import per_image
    from bench_quanto import DRAW, permuted, run
    from heldout_exactness import load
    from photo_crops import photo_crops

    px = photo_crops(args.photos, args.images, args.image, seed=args.seed, exclude=args.calib_photos.split(","))
    original = load(args.dinov2)
    ref_pool, ref_tok = run(original, px)
    loaded: dict[str, torch.nn.Module] = {"original": original}
    rows: dict[str, Any] = {}
    for name, path in dirs.items():
        t0 = time.perf_counter()
        draw = DRAW.match(name) if name not in loaded and path == name else None
        if name in loaded:
            model = loaded[name]
        elif draw:
            base = draw["base"] or "original"
            if base not in loaded:
                sys.exit(f"bench_heldout_engines: {name}: no variant {base!r} before it")
            model = permuted(loaded[base], int(draw["seed"]), attention=draw["how"] == "reordered")
        else:
            model = loaded[name] = load(Path(path))
        row: dict[str, Any] = {"note": str(path), "errors": {}, "per_image": {}}
        for how in args.engines:
            for group in ["all"] if how == "fp32" else args.groups:
                key = how if group == "all" else f"{how}:{group}"
                pool, tok = run(quantized(model, how, None if group == "all" else GROUPS[group]), px)
                cls_err, tok_err = per_image(ref_pool, pool), per_image(ref_tok, tok)
                row["errors"][key] = {"cls": float(cls_err.mean()), "tok": float(tok_err.mean())}
                row["per_image"][key] = {"cls": cls_err.tolist(), "tok": tok_err.tolist()}
                print(f"{name:22s} {key:18s} cls {cls_err.mean():.3e} tok {tok_err.mean():.3e}", flush=True)
        row["seconds"] = time.perf_counter() - t0
        rows[name] = row
    return {"model": f"{args.dinov2}, {args.image} px", "inputs": len(px), "rows": rows}


# ---------------------------------------------------------------- Whisper (teacher-forced KL per clip)

def whisper_logp(model: torch.nn.Module, feats: np.ndarray, refs: list[list[int]],
                 encoded: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Log-probs (float32) at every teacher-forced decoder position of every clip, the end-of-text step
    included: ``bench_quant_whisper.torch_logits``' loop on a model already built. ``encoded``: the encoder's
    output for each batch of 4 clips (:func:`whisper_encoded`), so only the decoder runs."""
    import bench_quant_whisper as bqw

    out = []
    with torch.inference_mode():
        for i in range(0, len(feats), 4):
            batch = refs[i:i + 4]
            p = len(bqw.SOT_NOTS)
            ids = torch.full((len(batch), p + max(map(len, batch))), bqw.EOT)
            for j, r in enumerate(batch):
                ids[j, : p + len(r)] = torch.tensor(list(bqw.SOT_NOTS) + r)
            if encoded is None:
                logits = model(input_features=torch.from_numpy(feats[i:i + 4]), decoder_input_ids=ids).logits
            else:
                logits = model(encoder_outputs=(encoded[i // 4],), decoder_input_ids=ids).logits
            for j, r in enumerate(batch):
                out.append(torch.log_softmax(logits[j, p - 1: p + len(r)].double(), -1).float())
    return out


def whisper_encoded(model: torch.nn.Module, feats: np.ndarray) -> list[torch.Tensor]:
    """The float encoder's ``last_hidden_state`` for each batch of 4 clips (``--decoder-only``)."""
    with torch.inference_mode():
        return [model.model.encoder(input_features=torch.from_numpy(feats[i:i + 4])).last_hidden_state
                for i in range(0, len(feats), 4)]


def decoder_patterns(patterns: list[str]) -> list[str]:
    """``patterns`` (a group's, ``*.fc2``…) restricted to Whisper's decoder: ``model.decoder*.fc2``…"""
    return ["model.decoder" + (p if p.startswith("*") else "*." + p) for p in patterns]


def whisper_rows(args: argparse.Namespace, dirs: dict[str, str]) -> dict[str, Any]:
    import bench_quant_whisper as bqw
    from speech_samples import load_clips
    from transformers import AutoTokenizer

    bqw.set_prompt(args.whisper)
    clips = [c for d in args.speech for c in load_clips(d)][: args.clips]
    feats = bqw.features(args.whisper, clips)
    spoken = AutoTokenizer.from_pretrained(args.whisper)
    refs = [spoken.encode(" " + text.strip(), add_special_tokens=False) for _, text in clips]
    ref = whisper_logp(bqw.whisper_model(args.whisper), feats, refs)
    from bench_quanto import DRAW

    rows: dict[str, Any] = {}
    for name, path in dirs.items():
        t0 = time.perf_counter()
        draw = DRAW.match(name) if path == name else None
        if draw:  # MLP neurons reordered (exact): fc2 rounds other numbers
            base = draw["base"] or "original"
            if base not in dirs or draw["how"] != "permuted":
                sys.exit(f"bench_heldout_engines: {name}: Whisper draws are BASE-permuted-N of a variant before it")
            model = mlp_permuted(bqw.whisper_model(Path(dirs[base])), int(draw["seed"]))
        else:
            model = bqw.whisper_model(Path(path))
        row: dict[str, Any] = {"note": str(path), "errors": {}, "per_image": {}}
        encoded = whisper_encoded(model, feats) if args.decoder_only else None
        for how in args.engines:
            for group in ["all"] if how == "fp32" else args.groups:
                key = how if group == "all" else f"{how}:{group}"
                include = None if group == "all" and not args.decoder_only else GROUPS[group]
                if args.decoder_only:
                    include = decoder_patterns(include)
                got = bqw.compare(ref, whisper_logp(quantized(model, how, include), feats, refs, encoded))
                row["errors"][key] = {"kl": got["kl"], "top1": got["top1"]}
                row["per_image"][key] = {"kl": got["clip_kl"], "agree": got["clip_agree"]}
                print(f"{name:22s} {key:18s} KL {got['kl']:.4e} top-1 {got['top1']:.4f}", flush=True)
        row["seconds"] = time.perf_counter() - t0
        rows[name] = row
        del model
    return {"model": str(args.whisper), "inputs": len(clips), "positions": sum(map(len, refs)) + len(refs),
            "decoder_only": args.decoder_only, "rows": rows}


def kl_draws_table(result: dict[str, Any], how: str) -> str:
    """Whisper's draws (``permuted-N`` of the original and ``BASE-permuted-N``): each set's mean KL over draws
    and clips against the original's draws, with bench_quanto's interval over draws (paired by seed) and clips."""
    from bench_quanto import DRAW, draw_ratio, draw_sets

    def seeds(name: str) -> tuple[str, int]:  # a draw's reordering; ("", 0): the model as it is
        m = DRAW.match(name)
        return (m["how"], int(m["seed"])) if m else ("", 0)

    rows = result["rows"]
    sets = draw_sets([n for n in rows if how in rows[n]["per_image"]])
    lines = [f"rounding draws in {how}: KL per clip; ratio of means to the original's draws, 95% interval over "
             "draws and clips", "", "| model | draws | KL: mean (sd between draws) | ratio | typical clip |",
             "|---|---|---|---|---|"]
    for (base, kind), names in sets.items():
        if ("original", kind) not in sets or base == "original":
            continue
        orig = np.stack([rows[n]["per_image"][how]["kl"] for n in sets["original", kind]])
        mine = np.stack([rows[n]["per_image"][how]["kl"] for n in names])
        paired = [seeds(n) for n in names] == [seeds(n) for n in sets["original", kind]]
        r = "{:.3f} ({:.3f}-{:.3f})".format(*draw_ratio(orig, mine, paired=paired))
        t = "{:.3f} ({:.3f}-{:.3f})".format(*draw_ratio(orig, mine, typical=True, paired=paired))
        means = mine.sum(1) / result["positions"]
        lines.append(f"| {base} | {len(names)} | {means.mean():.4e} ({means.std(ddof=1):.1e}) | {r} | {t} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--dinov2", type=Path, help="the original Dinov2Model directory")
    which.add_argument("--whisper", type=Path, help="the original Whisper directory")
    ap.add_argument("variants", nargs="*", help="NAME=DIR (normswap convert outputs); DINOv2: also "
                    "reordered-N and NAME-reordered-N (exact re-roundings, seed N)")
    ap.add_argument("--engines", nargs="+", default=["bnb-nf4", "bnb-int8", "hqq-w4", "gguf-q8_0", "gguf-q4_0"],
                    choices=ENGINES)
    ap.add_argument("--groups", nargs="+", default=["all"], choices=list(GROUPS),
                    help="quantize only this group of Linears, one group at a time")
    ap.add_argument("--photos", type=Path, help="DINOv2: scikit-image's skimage/data")
    ap.add_argument("--calib-photos", default="motorcycle_right.png,gravel.png,brick.png",
                    help="photographs left out of the measured crops (bench_quanto's calibration ones)")
    ap.add_argument("--image", type=int, default=112)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1, help="DINOv2: the crops' seed")
    ap.add_argument("--speech", type=Path, nargs="+", help="Whisper: speech_samples.py clip directories")
    ap.add_argument("--clips", type=int, default=64)
    ap.add_argument("--decoder-only", action="store_true", help="Whisper: quantize the decoder's Linears only; "
                    "the float encoder's output is computed once per variant (a sixth of the time)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.dinov2 and not args.photos or args.whisper and not args.speech:
        ap.error("--dinov2 needs --photos; --whisper needs --speech")
    bad = [v for v in args.variants if "=" not in v and not re.search(r"(^|-)(reordered|permuted)-\d+$", v)]
    if bad:
        ap.error(f"{bad[0]!r}: a variant is NAME=DIR, or a draw: [NAME-]permuted-N (DINOv2 also reordered-N)")
    torch.set_num_threads(1)
    dirs = {"original": str(args.dinov2 or args.whisper)} | dict(
        v.split("=", 1) if "=" in v else (v, v) for v in args.variants)
    result = dinov2_rows(args, dirs) if args.dinov2 else whisper_rows(args, dirs)
    result["versions"] = versions()
    from bench_quant_engines import ci_table

    metrics = ("tok", "cls") if args.dinov2 else ("kl",)
    if len(dirs) > 1:
        for metric in metrics:
            print("\n" + ci_table([result], metric) + "\n\n" + ci_table([result], metric, typical=True))
    from bench_quanto import draw_sets, draw_table

    if draw_sets(list(dirs)):
        for how in args.engines:
            if how != "fp32":
                print("\n" + (draw_table(result, how) if args.dinov2 else kl_draws_table(result, how)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
