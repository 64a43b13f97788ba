"""DINOv2-small's per-row int8 weight cells (OpenVINO NNCF int8 weights, bitsandbytes LLM.int8): image by image,
token by token, and one group of the conversion's edits at a time.

Both engines round every Linear's weight with one scale per output row (NNCF ``compress_weights`` int8:
asymmetric, ``max − min`` over 255 levels; LLM.int8: symmetric absmax over 127, activations per token, input
columns with any ``|x| ≥ 6`` in float16). A conversion changes no Linear input of DINOv2 (β kept, the readers see
``γ·x̂ + β``; the writers read the attention output and the GELU output): only the writers' rows differ,
``λ_i W_i − m`` (then rescaled, which a per-row grid ignores) instead of ``λ_i W_i``.

Variants (``--variants``): ``original``; ``native`` (``normswap.patch(beta_placement="keep")``, what ``normswap
convert`` writes, in memory); ``compat`` (the same written with ``format="compat"`` and loaded back by
transformers: stock LayerNorms, so each writer's edit is exact on its own); ``hyb-GROUP``: the original with
compat's tensors of one group (``--hybrid-groups``: regular expressions on state-dict keys, ``NAME=REGEX``) and
the original's everywhere else; exact in float32 (the next LayerNorm removes what a centering moved);
``writer-ops``: ``native`` with the original's writers and a centering op after each LayerScale
(:func:`writer_ops`, by hand); ``wop``: the product's way to the same model, ``normswap.patch(beta_placement="keep",
writer_centering="op")`` (what ``normswap convert --writer-centering op`` writes); ``wauto``: the same with
``writer_centering="auto"`` (``--writer-centering auto``: ops after the writers whose centering widens a row, the
others centered by weights); ``null-S``: the original re-drawn by float noise alone (:func:`null_draw`, seed ``S``).
By hand, one group at a time (round 52): ``writer-ops-attn`` / ``writer-ops-mlp`` (ops after the attention / MLP
writers alone, the others centered by weights), ``-bal`` (those writers' λ folded into their rows and balanced back
out, :func:`balanced_rows`), ``orig-bal`` (the original with every writer balanced so, LayerNorms kept),
``native-fold`` (``layer_scale="fold"``), ``native-stemw`` (``stem_centering="weights"``), ``wauto-widen`` (ops after
the writers whose centering widens a row more than 2×, balanced: ``auto``'s first form, 4 of DINOv2-small's 24).
Round 54's diagnostics of the stream's mean (:func:`leak_variant`, ``native`` with its writer rows kept):
``native-normc`` (a mean subtraction before every norm), ``native-lastc`` (before the final norm), ``native-cread``
(every block norm's readers blind to the mean), ``native-cread-lastc`` (both).

Engines (``--engines``): ``ov-w8`` (the ONNX export through OpenVINO and NNCF, ``bench_quant_engines.run_openvino``;
``ov-w8-GROUP``: NNCF on one group alone, ``qkv``, ``o``, ``fc1``, ``fc2``, ``conv``, ``writers`` or ``readers``;
``ov-w8-noact``: every weight, the CPU plugin's dynamic quantization of Linear inputs off),
``bnb-int8`` (``bench_heldout_engines.quantized``), ``ort-dyn-pt`` / ``ort-dyn-pc`` (ONNX Runtime's
``quantize_dynamic``, int8 weights per tensor / per channel, ``bench_quant_engines.quantize``), and the float
simulations of the first two's weight grids on every ``nn.Linear`` (``sim-asym8``: NNCF's int8 grid,
``sim-asym8c``: the same and the patch convolution, per filter, as NNCF compresses it; ``sim-asym8h``: that
with OpenVINO's float16 decompression, :func:`fake_rows`; ``sim-sym8``: LLM.int8's weight grid;
activations in float; ``sim-tao``: torchao's int8 dynamic scheme, the symmetric per-row weight grid with every
Linear input rounded per token, ``sim-tao-a`` its activation rounding alone, both on LLM.int8's ``absmax / 127``
grid; ``sim-tao-x``: torchao 0.18 bit for bit, ``quant_utils.torchao_linear_``, round 53; ``sim-tao-xw`` the same on
the writers alone (``o_proj``, ``fc2``), ``sim-tao-xr`` on every other Linear, ``sim-tao-xwgt`` / ``sim-tao-xact``
its weight / activation rounding alone on every Linear); ``torchao``: torchao's own
``Int8DynamicActivationInt8WeightConfig`` on the torch model (``bench_quant_engines.run_torchao``).

Per image: ``1 − cos`` against the float32 original, every token (mean), the CLS token, the patch tokens; the
per-token errors go to ``--tokens`` (``torch.save``) for the breakdown. ``--json`` is rewritten after every row.

    python benchmarks/int8w_dinov2.py DINOV2_SMALL --photos SKIMAGE/data --image 112 --images 1024 \\
        --variants original native compat --engines ov-w8 bnb-int8 --json out.json --tokens out.pt
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SIM = ("sim-asym8", "sim-asym8c", "sim-asym8h", "sim-sym8", "sim-tao", "sim-tao-a", "sim-tao-x", "sim-tao-xw",
       "sim-tao-xr", "sim-tao-xwgt", "sim-tao-xact")
ORT = ("ort-dyn-pt", "ort-dyn-pc", "ort-nbits-rtn")  # the last: MatMulNBits 4-bit RTN, block 32
# ov-w8 on one group of Linears (or the patch convolution) alone, the rest float: NNCF's error split by group (round 54)
OV_GROUPS = tuple(f"ov-w8-{g}" for g in ("qkv", "o", "fc1", "fc2", "conv", "writers", "readers", "noact"))
ENGINES = ("ov-w8", "bnb-int8", "torchao") + ORT + SIM + OV_GROUPS
# hybrids: compat's tensors matching one expression, the original's elsewhere
HYBRIDS = {"attn": r"attention\.o_proj\.|layer_scale1\.", "mlp": r"mlp\.fc2\.|layer_scale2\.",
           "early": r"layer\.[0-5]\.(attention\.o_proj|mlp\.fc2|layer_scale)", "late":
           r"layer\.([6-9]|1[01])\.(attention\.o_proj|mlp\.fc2|layer_scale)"}


def fake_rows(weight: torch.Tensor, symmetric: bool, half: bool = False) -> torch.Tensor:
    """Round-to-nearest int8, one scale per output row: NNCF's asymmetric grid (255 steps from the row's min to
    its max, an integer zero point) or LLM.int8's symmetric one (absmax / 127). ``half``: as OpenVINO decompresses
    NNCF's weights: the scale stored in float16 and ``(q − zero) · scale`` computed in float16."""
    w = weight.detach().double()
    if half:
        w = w.float()
        low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        step = ((high - low) / 255).clamp_min(1e-30)
        zero = torch.round(-low / step).clamp(0, 255)
        q = torch.clamp(torch.round(w / step) + zero, 0, 255)
        return ((q - zero).half() * step.half()).to(weight.dtype)
    if symmetric:
        step = w.abs().amax(1, keepdim=True).clamp_min(1e-30) / 127
        return (torch.round(w / step) * step).to(weight.dtype)
    low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    step = ((high - low) / 255).clamp_min(1e-30)
    zero = torch.round(-low / step)
    q = torch.clamp(torch.round(w / step) + zero, 0, 255)
    return ((q - zero) * step).to(weight.dtype)


def per_token_int8(x: torch.Tensor) -> torch.Tensor:
    """torchao's dynamic activation grid, approximately: symmetric int8, one scale per token (absmax over the features
    / 127). torchao 0.18 divides by 127.5 and clamps to [−128, 127] (each token's largest positive value clipped by
    half a step), here and for its weights: the simulations round on a slightly different grid (round 51: the
    original's error 15% above torchao's own)."""
    step = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return torch.clamp(torch.round(x / step), -128, 127) * step


def simulated(model: torch.nn.Module, how: str) -> torch.nn.Module:
    """``model`` with every ``nn.Linear``'s weight rounded on ``how``'s grid (``sim-tao``: torchao's
    ``Int8DynamicActivationInt8WeightConfig``, the symmetric per-row weight grid and each Linear's input rounded
    per token, :func:`per_token_int8`; ``sim-tao-a``: its activation grid alone, the weights left float)."""
    q = copy.deepcopy(model)
    if how.startswith("sim-tao-x"):  # torchao bit for bit; -xw: the writers alone, -xr: every other Linear
        from quant_utils import torchao_linear_

        for name, module in q.named_modules():
            writer = name.endswith((".o_proj", ".fc2"))
            if type(module) is torch.nn.Linear and (how not in ("sim-tao-xw", "sim-tao-xr")
                                                    or writer == (how == "sim-tao-xw")):
                torchao_linear_(module, weights=how != "sim-tao-xact", activations=how != "sim-tao-xwgt")
        return q
    with torch.no_grad():
        for module in q.modules():
            if how in ("sim-tao", "sim-tao-a") and type(module) is torch.nn.Linear:
                module.register_forward_pre_hook(lambda _m, args: (per_token_int8(args[0]),) + args[1:])
            if how == "sim-tao-a":
                continue
            conv = how in ("sim-asym8c", "sim-asym8h") and type(module) is torch.nn.Conv2d
            if type(module) is torch.nn.Linear or conv:
                flat = fake_rows(module.weight.reshape(module.weight.shape[0], -1), how in ("sim-sym8", "sim-tao"),
                                 how == "sim-asym8h")
                module.weight.copy_(flat.reshape(module.weight.shape))
    return q


def hybrid(original: torch.nn.Module, compat: torch.nn.Module, pattern: str) -> torch.nn.Module:
    out = copy.deepcopy(original)
    src = compat.state_dict()
    with torch.no_grad():
        for key, value in out.state_dict().items():
            if re.search(pattern, key):
                value.copy_(src[key])
    return out


@torch.no_grad()
def writer_ops(original: torch.nn.Module, attention_only: bool = False, groups: tuple[str, ...] = ("attn", "mlp"),
               balance: bool = False, widening_above: float | None = None) -> torch.nn.Module:
    """``native`` with every writer's weights, bias and LayerScale λ put back as the original's and its output
    centered by an op instead (a mean subtraction over the features after each LayerScale): exact, and a per-row
    weight quantizer then rounds the original's rows. Built by hand (round 50); the product option is
    ``writer_centering="op"`` (variant ``wop``). ``attention_only`` (variant ``writer-ops-attn``): the attention output
    projections alone, the MLP down projections centered by their weights as in ``native``; ``groups``: the same
    by group (``writer-ops-mlp``: the MLP down projections alone). ``balance`` (``-bal`` variants): each such
    writer's λ folded into its rows and taken back out by :func:`balanced_rows` (the rows of equal maxima that
    ``layer_scale="keep"`` gives a centered writer, here without centering). ``widening_above`` (``wauto-widen``:
    ``writer_centering="auto"``'s first form this round): ops only after the writers whose centering widens some
    row's ``max|w|`` (λ folded) more than this, the others centered by weights as in ``native``."""
    import normswap

    if attention_only:
        groups = ("attn",)
    model = copy.deepcopy(original)
    normswap.patch(model, beta_placement="keep")
    pairs = [p for g, p in (("attn", ("attention.o_proj", "layer_scale1")), ("mlp", ("mlp.fc2", "layer_scale2")))
             if g in groups]
    for mine, theirs in zip(model.encoder.layer, original.encoder.layer, strict=True):
        for lin, scale in pairs:
            dst, src = mine.get_submodule(lin), theirs.get_submodule(lin)
            if widening_above is not None:
                w = src.weight.double() * theirs.get_submodule(scale).lambda1.double()[:, None]
                if float(((w - w.mean(0)).abs().amax(1) / w.abs().amax(1)).max()) <= widening_above:
                    continue
            dst.weight.copy_(src.weight)
            dst.bias.copy_(src.bias)
            mine.get_submodule(scale).lambda1.copy_(theirs.get_submodule(scale).lambda1)
            if balance:
                balanced_rows(dst, mine.get_submodule(scale))
            mine.get_submodule(scale).register_forward_hook(
                lambda _module, _inputs, out: out - out.mean(-1, keepdim=True))
    return model


@torch.no_grad()
def balanced_rows(linear: torch.nn.Linear, layer_scale: torch.nn.Module) -> None:
    """λ folded into ``linear``'s rows, then each row divided by the four-bit scale that puts its largest entry
    in (8/9, 1] of the weight's original ``max|w|``, that scale becoming λ (what ``layer_scale="keep"`` does
    after centering, :func:`normswap.surgery.edits.layer_scale_balance`): the same function, the same integers
    on any per-row grid, and rows of nearly equal maxima for a per-tensor one."""
    from normswap.surgery.edits import layer_scale_balance

    lam = layer_scale.lambda1
    w = linear.weight.double() * lam.double()[:, None]
    b = linear.bias.double() * lam.double()
    s = layer_scale_balance(w.abs().amax(1), float(linear.weight.double().abs().max()))
    linear.weight.copy_((w / s[:, None]).to(linear.weight.dtype))
    linear.bias.copy_((b / s).to(linear.bias.dtype))
    lam.copy_(s.to(lam.dtype))


@torch.no_grad()
def null_draw(original: torch.nn.Module, seed: int, spread: float = 1e-3) -> torch.nn.Module:
    """The original with each writer's rows (weight and bias) scaled by ``1 + spread·u`` (``u`` uniform in [−1, 1],
    one per row, seeded) and its LayerScale λ divided by the same: the same function up to float rounding, and the
    same integers on any per-row grid (a row's scale moves with it). What differs from the original is only the
    float noise of the forward pass: where an engine also rounds activations (torchao: per token), that noise moves
    values across rounding boundaries and the error downstream is another draw of the same rounding."""
    model = copy.deepcopy(original)
    gen = torch.Generator().manual_seed(seed)
    for layer in model.encoder.layer:
        for lin, scale in (("attention.o_proj", "layer_scale1"), ("mlp.fc2", "layer_scale2")):
            dst = layer.get_submodule(lin)
            c = 1 + spread * (2 * torch.rand(dst.weight.shape[0], generator=gen, dtype=torch.float64) - 1)
            dst.weight.copy_((dst.weight.double() * c[:, None]).to(dst.weight.dtype))
            dst.bias.copy_((dst.bias.double() * c).to(dst.bias.dtype))
            lam = layer.get_submodule(scale).lambda1
            lam.copy_((lam.double() / c).to(lam.dtype))
    return model


def _center_input(_module: torch.nn.Module, args: tuple) -> tuple:
    return (args[0] - args[0].mean(-1, keepdim=True),) + args[1:]


@torch.no_grad()
def leak_variant(original: torch.nn.Module, norms: str = "all", readers: bool = False) -> torch.nn.Module:
    """``native`` (the default conversion, β kept) with what the stream's mean does downstream taken away, its
    writer rows untouched (round 54's diagnostics of where NNCF's cost is). The converted stream is zero-mean only
    in float: once a per-row quantizer rounds the centered writer rows, ``1ᵀ(Q(W) − W)h`` is a mean that the
    RMSNorms pass on, where the original's LayerNorms removed it. ``norms``: ``"all"`` puts a mean subtraction on
    every norm's input (LayerNorm by another name: the rounding left as is, its mean removed), ``"last"`` on the
    final norm's alone, ``"none"`` on none. ``readers``: every reader of a block norm (q, k, v, fc1) made blind to
    the mean, ``W' = W·diag(γ)·P·diag(1/γ)`` and ``b' = b + (W − W')β`` (``normswap.surgery.edits.center_reader``'s
    arithmetic): exact on the zero-mean stream, and a mean ``m1`` then reaches the readers only through the
    norm's ``rms``. All exact in float."""
    import normswap

    model = copy.deepcopy(original)
    normswap.patch(model, beta_placement="keep")
    blocks = [(layer.norm1, (layer.attention.q_proj, layer.attention.k_proj, layer.attention.v_proj))
              for layer in model.encoder.layer] + [(layer.norm2, (layer.mlp.fc1,)) for layer in model.encoder.layer]
    if norms in ("all", "last"):
        for norm in ([n for n, _ in blocks] if norms == "all" else []) + [model.layernorm]:
            norm.register_forward_pre_hook(_center_input)
    if readers:
        for norm, linears in blocks:
            g, beta = norm.weight.double(), norm.bias.double()
            for lin in linears:
                w = lin.weight.double()
                new = (w * g - (w * g).mean(1, keepdim=True)) / g
                lin.bias.copy_((lin.bias.double() + (w - new) @ beta).to(lin.bias.dtype))
                lin.weight.copy_(new.to(lin.weight.dtype))
    return model


def tokens_out(model: torch.nn.Module, px: torch.Tensor, batch: int = 16) -> torch.Tensor:
    from bench_quant_engines import Outputs

    out = []
    with torch.no_grad():
        for i in range(0, len(px), batch):
            out.append(Outputs(model)(px[i:i + batch])[1].float())
    return torch.cat(out)


def engine_tokens(model: torch.nn.Module, how: str, px: torch.Tensor, work: Path) -> torch.Tensor:
    """Every token's output of ``model`` quantized by ``how``: ``[images, tokens, hidden]``."""
    if how == "fp32":
        return tokens_out(model, px)
    if how in SIM:
        return tokens_out(simulated(model, how), px)
    if how == "bnb-int8":
        from bench_heldout_engines import quantized

        return tokens_out(quantized(model, how), px)
    if how == "torchao":
        from bench_quant_engines import run_torchao

        return run_torchao(model, px)[1].float()
    from bench_quant_engines import export, quantize, run_onnx, run_openvino

    fp32 = work / "model.onnx"
    export(model, px, fp32)
    if how in ORT:
        tok = run_onnx(quantize(fp32, how.removeprefix("ort-"), px[:0]), px)[1]
    else:
        tok = run_openvino(fp32, how, px)[1]
    for f in work.iterdir():
        f.unlink()
    return tok


def errors(ref: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``1 − cos`` per image and token, ``[images, tokens]``."""
    return 1 - torch.nn.functional.cosine_similarity(ref.double(), out.double(), dim=-1)


@torch.no_grad()
def row_noise(original: torch.nn.Module, compat: torch.nn.Module, px: torch.Tensor, symmetric: bool) -> list[dict]:
    """Per writer: the error its per-row int8 rounding adds to the residual stream, ``E = λ ⊙ ((W_q − W) x)`` on the
    writer's real inputs (the same in both models), original against compat (the converted rows). ``power``:
    ``E[‖E‖²]`` per token; ``centered``: with each token's mean over the features removed (what the next
    LayerNorm sees); ``gamma``: the centered error weighted by the next norm's ``γ²``; ``small``: the share of
    ``centered`` in the half of the channels with the smaller original λ; ``shared``: the share of ``centered``
    along the error's first principal direction over tokens (a term rounded alike in many rows shows up there)."""
    inputs: dict[str, torch.Tensor] = {}
    hooks = [original.get_submodule(n).register_forward_pre_hook(
        lambda _m, args, n=n: inputs.__setitem__(n, args[0].reshape(-1, args[0].shape[-1]).double()))
        for n, m in original.named_modules() if re.search(r"\.(o_proj|fc2)$", n)]
    original(pixel_values=px)
    for h in hooks:
        h.remove()
    layers = original.config.num_hidden_layers
    out = []
    for name, x in inputs.items():
        i = int(name.split(".")[2])
        kind = "layer_scale1" if name.endswith("o_proj") else "layer_scale2"
        nxt = (f"encoder.layer.{i}.norm2" if kind == "layer_scale1" else
               f"encoder.layer.{i + 1}.norm1" if i + 1 < layers else "layernorm")
        gamma = original.get_submodule(nxt).weight.double()
        lam0 = original.get_submodule(f"encoder.layer.{i}.{kind}").lambda1.double()
        row: dict[str, Any] = {"writer": name}
        for label, model in (("original", original), ("converted", compat)):
            w = model.get_submodule(name).weight.double()
            lam = model.get_submodule(f"encoder.layer.{i}.{kind}").lambda1.double()
            err = (x @ (fake_rows(w, symmetric).double() - w).T) * lam
            cen = err - err.mean(-1, keepdim=True)
            top = torch.linalg.svdvals(cen)[0] ** 2 / cen.pow(2).sum()
            small = lam0 < lam0.median()
            row[label] = {"power": float(err.pow(2).sum(-1).mean()), "centered": float(cen.pow(2).sum(-1).mean()),
                          "gamma": float((cen * gamma).pow(2).sum(-1).mean()),
                          "small": float(cen[:, small].pow(2).sum() / cen.pow(2).sum()), "shared": float(top)}
        out.append(row)
    return out


def summary(result: dict[str, Any], name: str, how: str, metric: str = "tok", draws: int = 2000,
            base: tuple[str, ...] = ("original",)) -> dict[str, Any]:
    """``name``'s error over the original's in ``how``: the ratio of the means with a 95% paired bootstrap interval
    over images, the typical image (geometric mean of per-image ratios), the median per-image ratio, the ratio
    of the medians, of the 5%-trimmed means (the images of largest original + variant error left out), and the
    share of the excess (``Σ variant − original``) carried by the 5% of images that carry most of it."""
    import numpy as np

    b = np.array(result["rows"][name]["per_image"][how][metric])
    # the baseline: the original's errors, or per image the mean over several rows (the null draws' pool)
    a = np.mean([result["rows"][r]["per_image"][how][metric] for r in base], axis=0)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, len(a), (draws, len(a)))
    lo, hi = np.percentile(b[idx].mean(1) / a[idx].mean(1), [2.5, 97.5])
    logs = np.log(b / a)
    tlo, thi = np.percentile(logs[idx].mean(1), [2.5, 97.5])
    keep = np.argsort(a + b)[: int(len(a) * 0.95)]
    excess = np.sort(b - a)[::-1]
    top = max(1, len(a) // 20)
    photo_lo = photo_hi = float("nan")
    if result.get("photo"):  # the photographs resampled, not the crops (quant_utils.cluster_bootstrap)
        from quant_utils import cluster_bootstrap

        _, photo_lo, photo_hi = cluster_bootstrap(b, a, result["photo"], draws)
    return {"mean": b.mean() / a.mean(), "lo": lo, "hi": hi, "photo_lo": photo_lo, "photo_hi": photo_hi,
            "typical": float(np.exp(logs.mean())),
            "typical_lo": float(np.exp(tlo)), "typical_hi": float(np.exp(thi)),
            "median_ratio": float(np.exp(np.median(logs))), "ratio_of_medians": float(np.median(b) / np.median(a)),
            "trimmed": float(b[keep].mean() / a[keep].mean()),
            "top5pct_share": float(excess[:top].sum() / (b - a).sum()) if (b - a).sum() > 0 else float("nan"),
            "original": float(a.mean()), "variant": float(b.mean())}


def report(result: dict[str, Any], metric: str = "tok", base: tuple[str, ...] = ("original",)) -> str:
    lines = [f"{result['images']} crops at {result['image']} px, 1 − cos ({metric}); ratios to "
             + ("the original's" if base == ("original",) else f"the mean of {', '.join(base)} (per image)"),
             "", "| variant | engine | mean (95%) | photographs resampled (95%) | typical (95%) | median ratio | "
             "ratio of medians | 5%-trimmed | "
             "top 5% images' share of the excess |", "|---|---|---|---|---|---|---|---|---|"]
    for name, row in result["rows"].items():
        if name == "original":
            continue
        for how in row["per_image"]:
            if how == "fp32" or any(how not in result["rows"][r]["per_image"] for r in base):
                continue
            s = summary(result, name, how, metric, base=base)
            lines.append(f"| {name} | {how} | {s['mean']:.3f} ({s['lo']:.2f}-{s['hi']:.2f}) | "
                         f"{s['photo_lo']:.2f}-{s['photo_hi']:.2f} | {s['typical']:.3f} "
                         f"({s['typical_lo']:.2f}-{s['typical_hi']:.2f}) | {s['median_ratio']:.3f} | "
                         f"{s['ratio_of_medians']:.3f} | {s['trimmed']:.3f} | {s['top5pct_share']:.2f} |")
    return "\n".join(lines)


def by_photo(result: dict[str, Any], name: str, how: str, metric: str = "tok") -> str:
    """Each photograph's crops: the ratio of the mean errors and the photograph's share of the excess."""
    import numpy as np

    b = np.array(result["rows"][name]["per_image"][how][metric])
    a = np.array(result["rows"]["original"]["per_image"][how][metric])
    photo = np.array(result["photo"])
    lines = [f"{name} / original, {how}, by photograph", "", "| photograph | crops | original | ratio | typical | "
             "share of the excess |", "|---|---|---|---|---|---|"]
    for p in sorted(set(photo), key=lambda q: -(b - a)[photo == q].sum()):
        m = photo == p
        lines.append(f"| {p} | {m.sum()} | {a[m].mean():.2e} | {b[m].mean() / a[m].mean():.3f} | "
                     f"{np.exp(np.log(b[m] / a[m]).mean()):.3f} | {(b - a)[m].sum() / (b - a).sum():.2f} |")
    return "\n".join(lines)


@torch.no_grad()
def token_report(tokens: dict[str, torch.Tensor], name: str, how: str, original: torch.nn.Module,
                 px: torch.Tensor, images: int = 64) -> str:
    """Where ``name``'s excess over the original sits, token by token (``tokens``: :func:`main`'s ``--tokens``):
    CLS against the patch tokens, the share of the excess in the 1% of (image, token) pairs that carry most, and,
    on the ``images`` images of largest excess, how the excess goes with each token's norm in the original's
    residual stream before the last LayerNorm (massive-activation tokens have norms far above the rest)."""
    a, b = tokens[f"original|{how}"].double(), tokens[f"{name}|{how}"].double()
    d = b - a
    flat = d.flatten().sort(descending=True).values
    top = max(1, flat.numel() // 100)
    lines = [f"{name} / original, {how}, per token ({a.shape[0]} images x {a.shape[1]} tokens)", "",
             f"- CLS: {b[:, 0].mean() / a[:, 0].mean():.3f}; patch tokens: {b[:, 1:].mean() / a[:, 1:].mean():.3f}",
             f"- the top 1% of (image, token) pairs by excess carry {flat[:top].sum() / d.sum():.2f} of it; "
             f"per-token ratio median {torch.exp(torch.log(b / a).median()):.3f}"]
    worst = d.mean(1).argsort(descending=True)[:images]
    hidden = original(pixel_values=px[worst], output_hidden_states=True).hidden_states[-1].double().norm(dim=-1)
    rank = hidden.argsort(-1, descending=True)
    massive = torch.zeros_like(hidden, dtype=torch.bool).scatter_(1, rank[:, :2], True)
    pair = torch.stack([d[worst].flatten(), hidden.flatten()])
    lines.append(f"- on the {images} images of largest excess: the 2 tokens of largest stream norm per image "
                 f"(median norm {hidden[massive].median():.0f} against {hidden[~massive].median():.0f}) carry "
                 f"{d[worst][massive].sum() / d[worst].sum():.2f} of the excess (their share of tokens: "
                 f"{massive.float().mean():.2f}); CLS carries {d[worst][:, 0].sum() / d[worst].sum():.2f}; "
                 f"correlation of excess with stream norm {torch.corrcoef(pair)[0, 1]:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="the original Dinov2Model directory")
    ap.add_argument("--photos", type=Path, required=True)
    ap.add_argument("--calib-photos", default="motorcycle_right.png,gravel.png,brick.png",
                    help="left out of the crops, as in bench_quant_engines / bench_heldout_engines")
    ap.add_argument("--image", type=int, default=112)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1, help="the crops' seed (1: the earlier rounds' crops first)")
    ap.add_argument("--variants", nargs="+", default=["original", "native", "compat"])
    ap.add_argument("--hybrid-groups", nargs="*", default=[], metavar="NAME=REGEX",
                    help="more hybrids (hyb-NAME) besides " + ", ".join(HYBRIDS))
    ap.add_argument("--engines", nargs="+", default=[e for e in ENGINES if e not in OV_GROUPS],
                    choices=ENGINES + ("fp32",))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--tokens", type=Path, help="torch.save the per-token errors here")
    ap.add_argument("--from-json", type=Path, nargs="+", help="no measuring: the tables of earlier --json runs "
                    "(rows merged; the same crops)")
    ap.add_argument("--baseline", nargs="+", default=["original"], metavar="VARIANT",
                    help="with --from-json: the ratios' denominator, per image the mean of these rows' errors (e.g. "
                    "the original and its null draws null-1 ... null-4: the rounding draw's spread averaged out)")
    ap.add_argument("--by-photo", nargs="*", default=[], metavar="VARIANT:ENGINE", help="with --from-json: "
                    "also the breakdown by photograph")
    ap.add_argument("--rows", action="store_true", help="no engines: each writer's per-row rounding noise in the "
                    "stream, original against the converted rows (:func:`row_noise`), on --images crops")
    ap.add_argument("--token-report", nargs="*", default=[], metavar="VARIANT:ENGINE",
                    help="no measuring: the per-token breakdown (:func:`token_report`) from --tokens, on the crops "
                    "--images/--seed/--image say (those of the run that wrote it)")
    args = ap.parse_args(argv)
    if args.token_report:
        import transformers as tf
        from photo_crops import photo_crops

        torch.set_num_threads(1)
        px = photo_crops(args.photos, args.images, args.image, seed=args.seed, exclude=args.calib_photos.split(","))
        original = tf.Dinov2Model.from_pretrained(args.model).eval()
        tokens = torch.load(args.tokens)
        for spec in args.token_report:
            print(token_report(tokens, *spec.split(":"), original, px) + "\n")
        return {}
    if args.from_json:
        result = json.loads(args.from_json[0].read_text())
        for extra in args.from_json[1:]:  # a row in several runs: its engines joined (the same crops)
            for name, row in json.loads(extra.read_text())["rows"].items():
                result["rows"].setdefault(name, {"per_image": {}})["per_image"].update(row["per_image"])
        base = tuple(args.baseline)
        print(report(result, "tok", base) + "\n\n" + report(result, "cls", base))
        for spec in args.by_photo:
            print("\n" + by_photo(result, *spec.split(":")))
        return result
    import transformers as tf
    from photo_crops import photo_crops, photographs

    import normswap

    torch.set_num_threads(1)
    held_out = args.calib_photos.split(",")
    px = photo_crops(args.photos, args.images, args.image, seed=args.seed, exclude=held_out)
    files = photographs(args.photos, held_out)
    photo = [files[i].name for i, f in enumerate(files)
             for _ in range(args.images // len(files) + (1 if i < args.images % len(files) else 0))]
    original = tf.Dinov2Model.from_pretrained(args.model).eval()
    if args.rows:
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            conv = copy.deepcopy(original)
            normswap.patch(conv, beta_placement="keep")
            normswap.save(conv, Path(tmp) / "compat", format="compat", overwrite=True)
            compat = tf.Dinov2Model.from_pretrained(Path(tmp) / "compat").eval()
        rows = {g: row_noise(original, compat, px, g == "sym") for g in ("asym", "sym")}
        for grid, table in rows.items():
            print(f"\n{grid} int8 per row: converted / original per writer; shares: original -> converted\n")
            print("| writer | power | centered | γ-weighted | small-λ half's share | first direction's share |")
            print("|---|---|---|---|---|---|")
            for r in table:
                o, c = r["original"], r["converted"]
                print(f"| {r['writer'].removeprefix('encoder.layer.')} | {c['power'] / o['power']:.2f} | "
                      f"{c['centered'] / o['centered']:.2f} | {c['gamma'] / o['gamma']:.2f} | "
                      f"{o['small']:.2f} -> {c['small']:.2f} | {o['shared']:.2f} -> {c['shared']:.2f} |")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return rows
    ref = tokens_out(original, px)
    groups = HYBRIDS | dict(g.split("=", 1) for g in args.hybrid_groups)
    result: dict[str, Any] = {"model": str(args.model), "image": args.image, "images": len(px), "photo": photo,
                              "rows": {}}
    per_token: dict[str, torch.Tensor] = {}
    compat = None
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in args.variants:
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if name == "original":
                    model = original
                elif name == "native":
                    model = copy.deepcopy(original)
                    normswap.patch(model, beta_placement="keep")
                elif name.startswith("writer-ops"):  # writer-ops[-attn|-mlp][-bal]
                    parts = name.removeprefix("writer-ops").split("-")[1:]
                    groups = tuple(p for p in parts if p in ("attn", "mlp")) or ("attn", "mlp")
                    model = writer_ops(original, groups=groups, balance="bal" in parts)
                elif name == "wauto-widen":  # ops after the writers whose centering widens a row > 2x, balanced
                    model = writer_ops(original, balance=True, widening_above=2.0)
                elif name == "orig-bal":  # the original's writers balanced alone: no centering, LayerNorms kept
                    model = copy.deepcopy(original)
                    for layer in model.encoder.layer:
                        balanced_rows(layer.attention.o_proj, layer.layer_scale1)
                        balanced_rows(layer.mlp.fc2, layer.layer_scale2)
                elif name == "native-fold":  # λ folded into the centered writers (layer_scale="fold")
                    model = copy.deepcopy(original)
                    normswap.patch(model, beta_placement="keep", layer_scale="fold")
                elif name == "native-stemw":  # the stem centered by its weights, no stem op
                    model = copy.deepcopy(original)
                    normswap.patch(model, beta_placement="keep", stem_centering="weights")
                elif name in ("native-normc", "native-lastc", "native-cread", "native-cread-lastc"):
                    model = leak_variant(original, norms={"normc": "all"}.get(name[7:], "last" if "lastc" in name
                                                                              else "none"), readers="cread" in name)
                elif name.startswith("null-"):
                    model = null_draw(original, int(name[5:]))
                elif name in ("wop", "wauto"):
                    model = copy.deepcopy(original)
                    normswap.patch(model, beta_placement="keep",
                                   writer_centering="op" if name == "wop" else "auto")
                elif name == "compat" or name.startswith("hyb-"):
                    if compat is None:
                        conv = copy.deepcopy(original)
                        normswap.patch(conv, beta_placement="keep")
                        normswap.save(conv, work / "compat", format="compat", overwrite=True)
                        compat = tf.Dinov2Model.from_pretrained(work / "compat").eval()
                    model = compat if name == "compat" else hybrid(original, compat, groups[name[4:]])
                else:
                    raise SystemExit(f"unknown variant {name!r}")
            sub = work / "onnx"
            sub.mkdir(exist_ok=True)
            row: dict[str, Any] = {"per_image": {}}
            for how in args.engines:
                err = errors(ref, engine_tokens(model, how, px, sub))
                per_token[f"{name}|{how}"] = err.float()
                row["per_image"][how] = {"tok": [float(f"{v:.4g}") for v in err.mean(1)],
                                         "cls": [float(f"{v:.4g}") for v in err[:, 0]],
                                         "patch": [float(f"{v:.4g}") for v in err[:, 1:].mean(1)]}
                print(f"{name:12s} {how:10s} tok {err.mean():.3e} cls {err[:, 0].mean():.3e} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
            row["seconds"] = time.perf_counter() - t0
            result["rows"][name] = row
            if args.json:
                args.json.write_text(json.dumps(result))
            if args.tokens:
                torch.save(per_token, args.tokens)
    return result


if __name__ == "__main__":
    main()
