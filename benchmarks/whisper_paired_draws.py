"""Whisper at 4-bit weights, original against its conversion, judged over paired rounding draws.

One set of rounded weights is one draw of "which numbers fall in which block": a clip bootstrap resamples
clips for that fixed set and cannot see it. :func:`reordered` re-writes a Whisper so that it computes the
same function (float64: ~1e-15) but ``MatMulNBits`` rounds other numbers: every MLP's hidden neurons in
another order (``fc1`` rows and bias, ``fc2`` columns), and in every attention (self and cross) the heads
in another order (q/k/v rows and biases by head) and the value dimensions inside each head (``v_proj``
rows, ``out_proj`` columns). A block holds 32 consecutive *input* features of one output column, so the
writers (``fc2``, ``out_proj``) get other blocks while the readers' blocks keep their entries (their rows
move). The same seed reorders the original and the conversion the same way, and the conversion's row
centring commutes with a column permutation, so draw N of the conversion *is* the conversion of the
original's draw N: a pair. Seed 0 is each model as shipped.

Every Linear is rounded on ``MatMulNBits``' RTN grid in float (``whisper_nbits_groups.rtn4``, checked
against ONNX Runtime's own weights there: 1.2e-5 of weights differ, float32 ties); the error is the
teacher-forced KL against the unrounded float32 original, summed per clip. The ratio is of the means over
draws and clips, its 95% interval resampling clips and draw pairs together (``bench_quanto.draw_ratio``).

``--quant hqq`` rounds on ``MatMulNBits``' HQQ grid instead (:func:`hqq4`: ONNX Runtime's own
``HQQWeightOnlyQuantizer.quantize_internal`` on the same tensor, blocks of 32, float zero points; ``--check-hqq``
compares it with a graph ONNX Runtime quantized: on Whisper base 64 of 70.6 M weights differ). Its solver
is slow (about 5 s per million weights on a loaded core), so a :class:`RoundingCache` keeps what a draw leaves
unchanged: the LM head, and the readers the original and compat's conversion share bit for bit.

Extra variants, each with the same draws (``--variants``):

* ``rms``: the conversion with every LayerNorm computed as RMSNorm with the same γ and β and one mean
  subtraction at the encoder's first layer (the native format's graph; what a runtime that swaps the compat
  checkpoint's norms runs): the quantization error's per-token mean, which a LayerNorm removes, then reaches
  every later norm. Exact in float (the streams are zero-mean); the compat checkpoint as measured keeps its
  LayerNorms, which subtract that mean before every norm already.
* ``decw`` / ``encw``: attribution. The original's rounded draw with the conversion's rounded writers of the
  decoder (encoder) only, the rest the original's (:func:`swapped_writers`). compat's conversion differs from the
  original only in its writers' rows (each minus the mean row: a per-token constant in the stream, which every
  LayerNorm removes) and in weights no ``MatMulNBits`` rounds (embeddings), so the mix computes the original's
  function exactly and its extra error over the original's draw is that side's writers' share of the
  conversion's. ``decw`` reuses the original draw's encoder states (a decoder pass only).

    python benchmarks/whisper_paired_draws.py ORIG CONV SPEECH_DIR [SPEECH_DIR ...] --clips 20 \
        --seeds 0-8 [--variants rms] [--quant hqq] [--ref-cache ref.pt] --json out.json
    python benchmarks/whisper_paired_draws.py --check-hqq FLOAT.onnx HQQ.onnx      # hqq4 against ONNX Runtime
    python benchmarks/whisper_paired_draws.py --table out.json [more.json ...]   # pooled, no model run

``--quant torchao`` runs torchao's real ``Int8DynamicActivationInt8WeightConfig`` (``quantize_`` on a copy of each
re-rounded model: int8 weights symmetric per output row, int8 activations symmetric per token at run time,
``torch._int_mm``; torchao on the path, e.g. ``PYTHONPATH=TAO:$PWD``). A reordering re-rounds nothing on that grid (a
row keeps its values in another order; a token's absmax is the same over permuted features), so with it use
``--draws rotate`` (:func:`rotated`): per layer, attention (self and cross) and head, one Haar-random orthogonal ``B``
on the head's ``q``/``k`` rows (``q' = Bq``, ``k' = Bk``) and another ``A`` on its values (``v' = Av``, ``out_proj``'s
columns ``· Aᵀ``): exact in any network, and every ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` row is new to
a per-row grid, as is every ``out_proj`` input token to a per-token one. ``fc1``, ``fc2`` and ``proj_out`` keep
their shipped integers. ``--draws rotate+fc2`` also shifts each ``fc2``'s rows by one shared random vector (within
±1 step of the original's per-row grid): ``(vᵀh)·1`` in the stream, which the next LayerNorm removes, so exact only
in a model with LayerNorms (the original and the compat hybrids, :func:`rotated`). Every drawn model is first checked
against the unrounded float32 original (logits on 2 clips, ‖Δ‖/‖ref‖ ≤ 1e-5) and the transform alone in float64
(≤ 1e-9); the run stops on a mismatch.

``--quant torchao-emu`` computes the same int8 model in float (:class:`TorchaoInt8Linear`: torchao's grids and float32
order, the integer product as an exact float32 ``matmul``): torch's CPU ``_int_mm`` takes ~13 s a clip on one loaded
core, the emulation ~1.5 s (round 59). Each model as loaded is first compared with torchao itself on clip 0 (logits,
bit for bit in round 59; the run stops above 1e-6), and its runs are recorded as ``torchao`` so ``--table`` pools them
with the real engine's.

``--table`` joins runs clip by clip (a clip set split over processes by seeds, ``--skip``/``--clips`` or
``--only``), then pools the clips over the seeds every clip has.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_quant_whisper as bq  # noqa: E402
from bench_quanto import draw_ratio, reorder_heads_, reorder_mlp_  # noqa: E402
from speech_samples import load_clips  # noqa: E402
from whisper_nbits_groups import BLOCK, clip_kl, forced_logp, nbits_weights, rtn4  # noqa: E402


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = model.model if hasattr(model, "model") else model
    return [*inner.encoder.layers, *inner.decoder.layers]


def _reorder_attention(att: torch.nn.Module, g: torch.Generator) -> None:
    """Heads in another order, value dims shuffled inside each head: the same attention, other ``out_proj``
    blocks (bench_quanto's :func:`reorder_heads_` on Whisper's projection names)."""
    reorder_heads_(att.q_proj, att.k_proj, att.v_proj, att.out_proj, att.num_heads, g)


def reordered(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy of ``model`` (a Whisper, original or converted) that computes the same function with its
    writers' 4-bit blocks holding other entries (module docstring); seed 0: the model itself, uncopied.
    The same seed gives the same reordering on any Whisper of the same shape."""
    if seed == 0:
        return model
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    for layer in _layers(out):
        reorder_mlp_(layer.fc1, layer.fc2, g)
        _reorder_attention(layer.self_attn, g)
        if hasattr(layer, "encoder_attn"):
            _reorder_attention(layer.encoder_attn, g)
    return out


def _attentions(model: torch.nn.Module) -> list[torch.nn.Module]:
    out = []
    for layer in _layers(model):
        out.append(layer.self_attn)
        if hasattr(layer, "encoder_attn"):
            out.append(layer.encoder_attn)
    return out


@torch.no_grad()
def rotated(model: torch.nn.Module, seed: int, fc2: bool = False, grid_from: torch.nn.Module | None = None
            ) -> torch.nn.Module:
    """A copy of ``model`` (a Whisper, original or converted) re-rounded for per-row / per-token int8 grids by draw
    ``seed`` (module docstring, ``--draws rotate``): per attention and head ``q' = Bq``, ``k' = Bk``, ``v' = Av``,
    ``out_proj`` columns ``· Aᵀ`` (float64 products, cast back). ``fc2``: each layer's ``fc2`` rows also shifted by
    one shared vector ``v`` uniform within ±1 step of ``grid_from``'s (default ``model``'s) median per-row
    ``absmax / 127.5``; exact only where a LayerNorm reads the stream. The random numbers are drawn in one fixed
    order, so the same seed gives the same transforms on any Whisper of the same shape (a pair). Seed 0: ``model``."""
    from nncf_paired_draws import haar

    if seed == 0:
        return model
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    for att in _attentions(out):
        d = att.head_dim
        for h in range(att.num_heads):
            rows = slice(h * d, (h + 1) * d)
            b, a = haar(d, g), haar(d, g)
            for lin, m in ((att.q_proj, b), (att.k_proj, b), (att.v_proj, a)):
                lin.weight[rows] = (m @ lin.weight[rows].double()).to(lin.weight.dtype)
                if lin.bias is not None:
                    lin.bias[rows] = (m @ lin.bias[rows].double()).to(lin.bias.dtype)
            w = att.out_proj.weight
            w[:, rows] = (w[:, rows].double() @ a.T).to(w.dtype)
    ref_layers = _layers(grid_from if grid_from is not None else model)
    for layer, ref in zip(_layers(out), ref_layers, strict=True):
        w0 = ref.fc2.weight.double()
        step = float((w0.abs().amax(1) / 127.5).median())
        v = step * (2 * torch.rand(w0.shape[1], generator=g, dtype=torch.float64) - 1)
        if fc2:
            layer.fc2.weight.copy_((layer.fc2.weight.double() + v[None, :]).to(layer.fc2.weight.dtype))
    return out


def torchao_int8(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` through torchao's ``quantize_(…, Int8DynamicActivationInt8WeightConfig())``: every
    ``nn.Linear`` (``proj_out`` included, which leaves a tied embedding in float) int8 per output row, its input int8
    per token at run time."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    out = copy.deepcopy(model)
    quantize_(out, Int8DynamicActivationInt8WeightConfig())
    return out


_EXACT_F32 = 2.0 ** 24  # integers up to this magnitude, and every partial sum below it, are exact in float32


class TorchaoInt8Linear(torch.nn.Module):
    """An ``nn.Linear`` as torchao 0.18's ``Int8DynamicActivationInt8WeightConfig`` computes it on CPU, on the same
    grids (``quant_utils.torchao_int8_grid``: weight rows once, each input token at run time) and in the same float32
    order (integer product, ``· s_x``, ``· s_w``, ``+ bias``; ``quant_utils.torchao_linear_``), but the integer
    product as a float32 ``matmul``: exact while every partial sum stays below 2²⁴ in magnitude, which
    ``Σ|x_q| · max|w_q| < 2²⁴`` per token guarantees (checked per call; float64 otherwise, exact at these sizes).
    Why: torch's CPU ``_int_mm`` runs Whisper tiny.en's 64 clips at ~6× the float time on one loaded core, too slow
    for paired draws; :func:`check_emulation` compares the two on real clips."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        from quant_utils import torchao_int8_grid

        super().__init__()
        self.grid = torchao_int8_grid
        self.wq, self.ws = torchao_int8_grid(linear.weight.detach().float())
        self.wq_t = self.wq.T.contiguous()
        self.wmax = float(self.wq.abs().max())
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, xs = self.grid(x)
        if float(xq.abs().sum(-1).max()) * self.wmax < _EXACT_F32:
            dot = xq @ self.wq_t
        else:
            dot = (xq.double() @ self.wq_t.double()).float()
        y = dot * xs * self.ws.flatten()
        return (y if self.bias is None else y + self.bias).to(x.dtype)


def torchao_int8_emulated(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with every ``nn.Linear`` computing as a :class:`TorchaoInt8Linear` (``--quant
    torchao-emu``): what :func:`torchao_int8` computes, bit for bit where :func:`check_emulation` says so, at float
    speed. Each Linear stays in place with its ``forward`` replaced, as ``quantize_`` swaps only its weight: the
    hooks on it (``--writer-centering op``'s centering after a writer) still run (round 59: a module swap dropped
    them, and the check stopped the run)."""
    out = copy.deepcopy(model)
    for mod in out.modules():
        if isinstance(mod, torch.nn.Linear):
            mod.forward = TorchaoInt8Linear(mod).forward
    return out


@torch.no_grad()
def check_emulation(model: torch.nn.Module, feats: torch.Tensor, ids: list[torch.Tensor], clips: int = 1
                    ) -> float:
    """torchao's real ``quantize_`` against :func:`torchao_int8_emulated` on ``model``'s logits for the first
    ``clips`` clips: the largest absolute difference over the largest logit (0: bit for bit)."""
    real = _logits(torchao_int8(model), feats, ids, clips)
    emu = _logits(torchao_int8_emulated(model), feats, ids, clips)
    return float((real - emu).abs().max() / real.abs().max())


@torch.no_grad()
def check_drawn(drawn: torch.nn.Module, ref_logits: torch.Tensor, feats: torch.Tensor, ids: list[torch.Tensor],
                base: torch.nn.Module, redo: Any, label: str) -> dict[str, float]:
    """``drawn`` (a re-rounded model, float32) against the unrounded float32 original's logits ``ref_logits`` on
    the first two clips (``‖Δ‖ / ‖ref‖`` ≤ 1e-5), and the transform alone in float64 on the first clip:
    ``redo(base.double())`` against ``base.double()`` (≤ 1e-9). Stops the run otherwise."""
    got = _logits(drawn, feats, ids)
    rel = float((got - ref_logits).norm() / ref_logits.norm())
    if not rel <= 1e-5:
        raise SystemExit(f"{label}: not the original's function in float32, ‖Δ‖ / ‖ref‖ = {rel:.2e}")
    b64 = copy.deepcopy(base).double()
    a = _logits(b64, feats.double(), ids, 1)
    rel64 = float((_logits(redo(b64), feats.double(), ids, 1) - a).norm() / a.norm())
    if not rel64 <= 1e-9:
        raise SystemExit(f"{label}: the transform is not exact in float64, ‖Δ‖ / ‖ref‖ = {rel64:.2e}")
    return {"rel": rel, "rel64": rel64}


def _logits(model: torch.nn.Module, feats: torch.Tensor, ids: list[torch.Tensor], clips: int = 2) -> torch.Tensor:
    return torch.cat([model(input_features=feats[i:i + 1], decoder_input_ids=ids[i][None], use_cache=False).logits[0]
                      for i in range(clips)])


class RMSAsLayerNorm(torch.nn.Module):
    """A LayerNorm's γ and β around RMSNorm: ``x / rms(x) · γ + β`` (no mean subtraction)."""

    def __init__(self, ln: torch.nn.LayerNorm) -> None:
        super().__init__()
        self.weight, self.bias, self.eps = ln.weight, ln.bias, ln.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight + self.bias


WRITERS = ("out_proj", "fc2")  # self- and cross-attention output projections, and the MLPs' second Linear


def swapped_writers(base: torch.nn.Module, donor: torch.nn.Module, side: str) -> torch.nn.Module:
    """A copy of ``base`` with the writers of ``side`` (``"encoder"`` or ``"decoder"``) taken from ``donor``, a
    Whisper of the same shape (weights and biases)."""
    out = copy.deepcopy(base)
    for name, mod in out.named_modules():
        if isinstance(mod, torch.nn.Linear) and f".{side}." in f".{name}" and name.rsplit(".", 1)[-1] in WRITERS:
            src = donor.get_submodule(name)
            mod.weight = torch.nn.Parameter(src.weight.detach().clone(), requires_grad=False)
            if mod.bias is not None:
                mod.bias = torch.nn.Parameter(src.bias.detach().clone(), requires_grad=False)
    return out


def rms_norms(model: torch.nn.Module) -> torch.nn.Module:
    """A converted Whisper (in place) as the native format runs it: every ``nn.LayerNorm`` computed as
    :class:`RMSAsLayerNorm`, and one mean subtraction where the encoder's stream starts (its stem ends in a
    GELU, so no weight edit centres it; the conversion's plan puts its one centering op there)."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, torch.nn.LayerNorm):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, RMSAsLayerNorm(mod))
    first = _layers(model)[0]
    first.register_forward_pre_hook(lambda _m, args: (args[0] - args[0].mean(-1, keepdim=True), *args[1:]))
    return model


def hqq4(w: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """``w`` (out, in) as ``MatMulNBits`` HQQ 4-bit stores it, dequantized: ONNX Runtime's own
    ``HQQWeightOnlyQuantizer.quantize_internal`` (asymmetric, blocks of ``block`` along ``in``, its proximal
    solver choosing each block's float zero point) on the tensor the quantizer hands it (the ONNX ``MatMul``
    weight transposed, which is ``w``), then ``(code − zero) · scale`` as the kernel reads it. The same code on
    the same numbers, so the codes are ONNX Runtime's (``--check-hqq`` compares them with a quantized graph)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig, HQQWeightOnlyQuantizer

    quantizer = HQQWeightOnlyQuantizer(HQQWeightOnlyQuantConfig(block_size=block, bits=4))
    codes, scale, zero = quantizer.quantize_internal(w.float(), bits=4, group_size=block)
    out, k = w.shape
    deq = (codes.reshape(out, -1, block).float() - zero.reshape(out, -1, 1)) * scale.reshape(out, -1, 1)
    return deq.reshape(out, -1)[:, :k].to(w.dtype)


def gguf_q8_0(w: torch.Tensor) -> torch.Tensor:
    """``w`` (out, in) stored as GGUF ``Q8_0`` and read back by the ``gguf`` package's own quantizer
    (``bench_heldout_engines.gguf_round_trip``: int8, one float16 scale ``absmax / 127`` per 32 consecutive inputs of
    a row, round to nearest): deterministic, so its draws come from :func:`reordered` (a writer's blocks hold other
    entries). A width that is not a multiple of 32 stays as it is (none in Whisper)."""
    from bench_heldout_engines import gguf_round_trip

    back = gguf_round_trip(w.float(), "Q8_0")
    return w if back is None else back.to(w.dtype)


def gguf_q4_0(w: torch.Tensor) -> torch.Tensor:
    """:func:`gguf_q8_0` for GGUF ``Q4_0`` (4-bit symmetric, one float16 scale per 32 inputs)."""
    from bench_heldout_engines import gguf_round_trip

    back = gguf_round_trip(w.float(), "Q4_0")
    return w if back is None else back.to(w.dtype)


QUANT = {"rtn": rtn4, "hqq": hqq4, "gguf-q8_0": gguf_q8_0, "gguf-q4_0": gguf_q4_0}
QUANT_NAMES = {"rtn": "simulated MatMulNBits RTN 4-bit", "hqq": "simulated MatMulNBits HQQ 4-bit",
               "gguf-q8_0": "GGUF Q8_0 weight round trip (gguf package)",
               "gguf-q4_0": "GGUF Q4_0 weight round trip (gguf package)",
               "torchao": "torchao int8 dynamic activation + int8 weight"}
DECODER = "model.decoder."  # --decoder-only: the Linears under it are rounded (proj_out, the head, is not)


class RoundingCache:
    """Rounded weights by their exact bytes: a draw moves only some Linears' entries between blocks, the LM
    head never, and compat's readers are the original's bit for bit, so the original and the conversion of one
    draw share most roundings and every draw shares the head's (HQQ's solver is the cost). The same bytes
    round to the same numbers, so a hit is exact. :meth:`keep_used` drops what the last draw did not use."""

    def __init__(self) -> None:
        self.store: dict[tuple, torch.Tensor] = {}
        self.used: set[tuple] = set()

    def get(self, quant: str, w: torch.Tensor) -> torch.Tensor:
        w = w.contiguous()
        key = (quant, tuple(w.shape), str(w.dtype), hashlib.sha256(w.numpy()).hexdigest())
        if key not in self.store:
            self.store[key] = QUANT[quant](w)
        self.used.add(key)
        return self.store[key]

    def keep_used(self) -> None:
        self.store = {k: v for k, v in self.store.items() if k in self.used}
        self.used = set()


def rounded(model: torch.nn.Module, quant: str = "rtn", cache: RoundingCache | None = None,
            prefix: str = "") -> torch.nn.Module:
    """A copy of ``model`` with every Linear on ``MatMulNBits``' 4-bit grid, ``quant`` one of :data:`QUANT`
    (the LM head included, as ONNX Runtime quantizes it; a fresh parameter each, so a tied head is rounded apart
    from the embedding); ``cache``: reuse roundings of identical weights. ``prefix``: only the Linears whose name
    starts with it (``--decoder-only``: :data:`DECODER`, the decoder's Linears, the head left in float as
    round 48's held-out GGUF cell did). Weights are replaced in place of each Linear, so hooks on it
    (``--writer-centering op``'s centering after a writer) still run."""
    out = copy.deepcopy(model)
    for name, mod in out.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.startswith(prefix):
            w = mod.weight.detach()
            q = cache.get(quant, w) if cache is not None else QUANT[quant](w)
            mod.weight = torch.nn.Parameter(q, requires_grad=False)
    return out


def check_hqq(fp32: Path, nbits: Path) -> tuple[int, int]:
    """Every ``MatMulNBits`` weight of an HQQ-quantized graph dequantized, against :func:`hqq4` of the float
    graph's initializer: (weights that differ by more than 1e-6 of the largest, weights compared)."""
    off, total = 0, 0
    for _, deq, w in nbits_weights(fp32, nbits):
        sim = hqq4(torch.from_numpy(np.ascontiguousarray(w)).float()).double().numpy()
        off += int((np.abs(sim - deq) > 1e-6 * np.abs(deq).max()).sum())
        total += deq.size
    return off, total


def encoder_states(original: torch.nn.Module, feats: torch.Tensor, cache: Path | None = None) -> list[torch.Tensor]:
    """The float original's encoder output for each clip (``--decoder-only``), as :func:`forced_logp` computes it
    inside a whole pass; ``cache``: saved there / read from there (float32, bit for bit)."""
    if cache is not None and cache.exists():
        states = torch.load(cache, mmap=True)  # file-backed: processes sharing the cache share its pages
        if len(states) != len(feats):
            raise SystemExit(f"{cache}: {len(states)} clips' encoder states, {len(feats)} clips here")
        return states
    with torch.inference_mode():
        states = [original.model.encoder(input_features=feats[i:i + 1]).last_hidden_state for i in range(len(feats))]
    if cache is not None:
        torch.save(states, cache)
    return states


@torch.no_grad()
def rounding_energy(original: torch.nn.Module, other: torch.nn.Module, quant: str = "gguf-q8_0",
                    prefix: str = DECODER, writers: tuple[str, ...] = WRITERS) -> dict[str, dict[str, float]]:
    """Per writer Linear under ``prefix`` (``out_proj`` of both attentions, ``fc2``), what rounding on ``quant``'s grid
    does to ``other``'s weight against ``original``'s, in float64: ``step``, the ratio of the mean squared block
    scale (``QUANT``'s grid: its step is proportional to a block's absmax; ``Q8_0``'s ``absmax / 127`` per 32 inputs
    of a row; ``quant="torchao"``: torchao's int8 weights, ``absmax / 127.5`` per output row, round 62), ``full``,
    the ratio of the rounding error's energy ``‖Q(W) − W‖²``, and ``seen``, the same for the part a LayerNorm after
    the writer passes on (the error with its mean over output rows removed: the rest is a per-token constant in the
    stream). The error energy is what a weight-only quantizer adds to a writer's output
    for inputs of equal energy in every feature; ``other`` with centered rows (compat, the default) widens its
    blocks, so its step and energy grow. Keys: module names; ``"all"`` pools every writer's energies."""
    out: dict[str, dict[str, float]] = {}
    tot = np.zeros((2, 3))
    for name, mod in original.named_modules():
        if not (isinstance(mod, torch.nn.Linear) and name.startswith(prefix) and name.rsplit(".", 1)[-1] in writers):
            continue
        row = np.zeros((2, 3))
        for k, m in enumerate((mod, other.get_submodule(name))):
            w = m.weight.detach().double()
            if quant == "torchao":  # one scale per output row (torchao's int8 weights): the row is the block
                from quant_utils import torchao_int8_grid

                q, s = torchao_int8_grid(w.float())
                e, blocks = (q * s).double() - w, w.abs().amax(1)
            else:
                e = QUANT[quant](w.float()).double() - w
                blocks = w.reshape(w.shape[0], -1, BLOCK).abs().amax(-1)
            row[k] = [float(blocks.pow(2).mean()), float(e.pow(2).sum()), float((e - e.mean(0)).pow(2).sum())]
        tot += row
        out[name] = dict(zip(("step", "full", "seen"), (row[1] / row[0]).tolist(), strict=True))
    out["all"] = dict(zip(("step", "full", "seen"), (tot[1] / tot[0]).tolist(), strict=True))
    return out


def decoder_logp(model: torch.nn.Module, ids: list[torch.Tensor], enc: list[torch.Tensor], batch: int = 16
                 ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`forced_logp` given the encoder states, ``batch`` clips a pass (``--decoder-only``): each clip's ids
    padded at the end (the decoder is causal, so a position never sees the padding after it) and its own positions
    kept. The same log-probs as one clip a pass up to float32 summation order; every model of a run goes through
    this path, the float reference too (:func:`main`)."""
    p = len(bq.SOT_NOTS)
    out = []
    with torch.inference_mode():
        for i in range(0, len(ids), batch):
            chunk = ids[i:i + batch]
            width = max(len(t) for t in chunk)
            padded = torch.stack([torch.cat([t, t.new_full((width - len(t),), int(t[-1]))]) for t in chunk])
            states = torch.cat(enc[i:i + batch])
            logits = model(encoder_outputs=(states,), decoder_input_ids=padded, use_cache=False).logits
            out += [torch.log_softmax(logits[j, p - 1:len(t)].double(), -1) for j, t in enumerate(chunk)]
    return out, enc


def decoder_kl(model: torch.nn.Module, ids: list[torch.Tensor], enc: list[torch.Tensor], ref: list[torch.Tensor],
               batch: int = 16) -> np.ndarray:
    """Per clip, the summed KL(``ref`` ‖ ``model``) of :func:`decoder_logp`, a batch at a time: the model's own
    log-probs (float64, 51,864 per position: ~2 GB for 328 clips) are never all held at once."""
    out = [clip_kl(ref[i:i + batch], decoder_logp(model, ids[i:i + batch], enc[i:i + batch], batch)[0])
           for i in range(0, len(ids), batch)]
    return np.concatenate(out)


def parse_seeds(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi or lo) + 1))
    return seeds


def run_clips(run: dict) -> list[tuple[str, int]]:
    """Each clip of a run as (speech directory's name, index in it): the run took ``clips / len(speech)`` clips
    from each directory, from its ``skip``-th on (:func:`main`). The name, not the path: ``speech_samples.py``
    builds the same clips wherever it writes them, so runs of other sessions (``/tmp/a/speech``,
    ``/tmp/b/speech``) join clip by clip (:func:`pooled` stops if a clip's decoder positions differ between runs)."""
    per_dir = run["clips"] // len(run["speech"])
    return [(Path(d).name, run["skip"] + i) for d in run["speech"] for i in range(per_dir)]


def pooled(results: list[dict]) -> tuple[list[int], dict[str, np.ndarray], float]:
    """Runs joined clip by clip (a clip set split over processes by seeds or by clips, or measured model by
    model), then every clip side by side over the seeds every clip has: the seeds, per variant (one measured on
    every clip) the KL array ``[draws, clips]``, the positions."""
    kinds = {r.get("draws", "reorder") for r in results}
    if len(kinds) > 1:  # seed N of one kind of draw is another model than seed N of another: no pair
        raise SystemExit(f"runs of different --draws ({', '.join(sorted(kinds))}) do not pool: table them apart")
    clips: dict[tuple[str, int], dict] = {}
    for r in results:
        for j, clip in enumerate(run_clips(r)):
            entry = clips.setdefault(clip, {"positions": r["positions"][j], "kl": {}})
            if entry["positions"] != r["positions"][j]:
                raise SystemExit(f"clip {clip}: {entry['positions']} decoder positions in one run, "
                                 f"{r['positions'][j]} in another: not the same clips")
            for name, rows in r["kl"].items():
                got = entry["kl"].setdefault(name, {})
                for seed, row in zip(r["seeds"], rows, strict=False):  # a stopped run: fewer rows for its last variants
                    got[seed] = row[j]
    names = [n for n in next(iter(clips.values()))["kl"] if all(n in c["kl"] for c in clips.values())]
    common = sorted(set.intersection(*(set.intersection(*(set(c["kl"][n]) for n in names)) for c in clips.values())))
    kl = {n: np.array([[c["kl"][n][seed] for c in clips.values()] for seed in common]).reshape(len(common), -1)
          for n in names}
    return common, kl, float(sum(c["positions"] for c in clips.values()))


def pair_tests(pairs: np.ndarray) -> tuple[int, float, float, float]:
    """Two checks on the per-pair ratios alone (these clips fixed): how many pairs are above 1 with the two-sided
    sign test's p, and the 95% t-interval of their geometric mean (on the log ratios)."""
    from scipy import stats

    above = int((pairs > 1).sum())
    p_sign = float(stats.binomtest(above, len(pairs)).pvalue)
    logs = np.log(pairs)
    half = stats.t.ppf(0.975, len(logs) - 1) * logs.std(ddof=1) / np.sqrt(len(logs)) if len(logs) > 1 else np.inf
    return above, p_sign, float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))


def table(results: list[dict]) -> str:
    """One table per quantizer (a run's ``quant``; RTN where a run predates the field), each :func:`quant_table`."""
    order = [*QUANT, "torchao"]
    kinds = sorted({r.get("quant", "rtn") for r in results},
                   key=lambda q: (order.index(q.split(":")[0]) if q.split(":")[0] in order else len(order), q))
    return "\n\n".join(quant_table([r for r in results if r.get("quant", "rtn") == q], q) for q in kinds)


def quant_name(quant: str) -> str:
    """A run's ``quant`` in words: ``gguf-q8_0:decoder`` is GGUF ``Q8_0`` on the decoder's Linears only."""
    base, _, where = quant.partition(":")
    return QUANT_NAMES.get(base, base) + (", the decoder's Linears only" if where == "decoder" else "")


def quant_table(results: list[dict], quant: str = "rtn") -> str:
    """Pooled (:func:`pooled`): per variant, the ratio of the mean KL over draws and clips to the original's,
    95% interval over draw pairs and clips together (``draw_ratio``), the as-shipped pair, and each pair's."""
    seeds, kl, positions = pooled(results)
    if not seeds:
        raise SystemExit(f"{quant}: no seed measured in every clip set")
    orig = kl["original"]
    lines = [f"{len(seeds)} paired draws (seeds {', '.join(map(str, seeds))}; 0: as shipped), {orig.shape[1]} clips, "
             f"{int(positions)} positions; " + quant_name(quant), "",
             "| variant | KL/clip, mean over draws (sd between draws) | ratio to original (95% CI, draws and clips) | "
             "pairs above 1 (sign test p) | t 95% over pairs | as shipped | per pair |", "|---" * 7 + "|"]
    for name, k in kl.items():
        per = k.mean(1)
        if name == "original":
            own = ", ".join(f"{p / per[0]:.3f}" for p in per[1:]) if seeds[0] == 0 else "–"
            lines.append(f"| original | {per.mean():.4f} ({per.std(ddof=1):.4f}) | 1 | – | – | – | "
                         f"own draws / as shipped: {own} |")
            continue
        r, lo, hi = draw_ratio(orig, k, paired=True)
        pairs = per / orig.mean(1)
        shipped = f"{pairs[0]:.3f}" if seeds[0] == 0 else "–"
        above, p_sign, t_lo, t_hi = pair_tests(pairs)
        lines.append(f"| {name} | {per.mean():.4f} ({per.std(ddof=1):.4f}) | **{r:.3f}** ({lo:.3f}-{hi:.3f}) | "
                     f"{above} of {len(pairs)} (p = {p_sign:.2g}) | {t_lo:.3f}-{t_hi:.3f} | "
                     f"{shipped} | {', '.join(f'{p:.3f}' for p in pairs)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", type=Path, nargs="*", help="ORIG CONV SPEECH_DIR [SPEECH_DIR ...]")
    ap.add_argument("--clips", type=int, default=20, help="clips from each SPEECH_DIR (its first ones)")
    ap.add_argument("--skip", type=int, default=0, help="skip each SPEECH_DIR's first clips")
    ap.add_argument("--seeds", default="0-8", help="draws, e.g. 0-8 or 0,3,5 (0: as shipped)")
    ap.add_argument("--variants", default="", help="comma list of extra variants of the conversion: rms")
    ap.add_argument("--only", default="", help="comma list: measure only these models (original, conversion, "
                    "conversion-rms); --table joins runs of one clip set and seeds model by model")
    ap.add_argument("--ref-cache", type=Path, help="the float original's log-probs, saved / reused")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quant", choices=[*QUANT, "torchao", "torchao-emu"], default="rtn",
                    help="MatMulNBits' 4-bit algorithm to simulate, or torchao's real int8, or its float emulation "
                    "(module docstring)")
    ap.add_argument("--decoder-only", action="store_true", help="round only the decoder's Linears (not proj_out); "
                    "every model's decoder reads the float original's encoder states, computed once (--enc-cache)")
    ap.add_argument("--enc-cache", type=Path,
                    help="--decoder-only: the float original's encoder states, saved / reused")
    ap.add_argument("--label", default="conversion", help="CONV's variant name in the JSON and tables (e.g. a "
                    "hybrid measured with --only LABEL, pooled by --table with another run's original)")
    ap.add_argument("--draws", choices=["reorder", "rotate", "rotate+fc2"], default="reorder",
                    help="the exact re-rounding of each draw: reordered() or rotated() (module docstring)")
    ap.add_argument("--table", type=Path, nargs="+", help="print the pooled table of these JSON files and exit")
    ap.add_argument("--check-hqq", type=Path, nargs=2, metavar=("FLOAT.onnx", "HQQ.onnx"),
                    help="compare hqq4 with the weights ONNX Runtime's HQQ quantizer wrote, and exit")
    args = ap.parse_args(argv)
    if args.check_hqq:
        off, total = check_hqq(*args.check_hqq)
        print(f"{off} of {total} HQQ-rounded weights differ from ONNX Runtime's ({off / total:.1e})")
        return
    if args.table:  # each file: one run, or a list of runs (the docs' raw figures)
        runs = [json.loads(p.read_text()) for p in args.table]
        print(table([r for run in runs for r in (run if isinstance(run, list) else [run])]))
        return
    orig_dir, conv_dir, *speech = args.paths
    extra = [v for v in args.variants.split(",") if v]
    if any(v not in ("rms", "decw", "encw") for v in extra):
        raise SystemExit(f"unknown variant in --variants {args.variants!r} (known: rms, decw, encw)")
    swaps = [v for v in extra if v in ("decw", "encw")]
    if (swaps or "rms" in extra) and args.label != "conversion":
        raise SystemExit("--variants rms/decw/encw name the conversion 'conversion': leave --label out")
    if swaps and args.only and "original" not in args.only.split(","):
        raise SystemExit("--variants decw/encw start from the original's draw: --only must keep original")
    from transformers import AutoTokenizer

    bq.set_prompt(orig_dir)
    clips = [c for d in speech for c in load_clips(d)[args.skip: args.skip + args.clips]]
    feats = torch.from_numpy(bq.features(orig_dir, clips))
    tok = AutoTokenizer.from_pretrained(orig_dir)
    ids = [torch.tensor([*bq.SOT_NOTS, *tok.encode(" " + t.strip(), add_special_tokens=False)]) for _, t in clips]
    original = bq.whisper_model(orig_dir)
    conv = bq.whisper_model(conv_dir)
    if args.decoder_only and args.quant.startswith("torchao"):
        raise SystemExit("--decoder-only applies to the weight round trips (rtn, hqq, gguf-*): drop it with torchao")
    enc = encoder_states(original, feats, args.enc_cache) if args.decoder_only else None

    def logp(model: torch.nn.Module) -> tuple[list[torch.Tensor], list]:
        return decoder_logp(model, ids, enc) if enc is not None else forced_logp(model, feats, ids)

    if args.ref_cache and args.ref_cache.exists():
        ref = torch.load(args.ref_cache, mmap=True)  # ~2 GB for 328 clips: shared pages, not each process's own
    else:
        ref, _ = logp(original)  # decoder-only: the float reference through the same batched path
        if args.ref_cache:
            torch.save(ref, args.ref_cache)
    models = {"original": original, args.label: conv}
    if "rms" in extra:
        models["conversion-rms"] = rms_norms(copy.deepcopy(conv))
        got, _ = forced_logp(models["conversion-rms"], feats[:1], ids[:1])
        print(f"conversion-rms, float32, no rounding: KL to the original {clip_kl(ref[:1], got)[0]:.2e} (clip 0)")
    if args.only:
        models = {n: m for n, m in models.items() if n in args.only.split(",")}
    seeds = parse_seeds(args.seeds)
    quant = "torchao" if args.quant == "torchao-emu" else args.quant  # the emulation pools with torchao's runs
    if args.decoder_only:  # another measurement than the whole model's: tabled apart
        quant += ":decoder"
    result = {"clips": len(clips), "speech": [str(d) for d in speech], "skip": args.skip, "quant": quant,
              "seeds": [], "positions": [len(r) for r in ref],
              "kl": {n: [] for n in [*models, *(f"conversion-{v}" for v in swaps)]}}
    cache = RoundingCache()
    result["draws"] = args.draws
    result["exactness"] = {}

    def drawn_model(model: torch.nn.Module, seed: int) -> torch.nn.Module:
        if args.draws == "reorder":
            return reordered(model, seed)
        return rotated(model, seed, fc2=args.draws == "rotate+fc2", grid_from=original)

    def engine(model: torch.nn.Module) -> torch.nn.Module:
        if args.quant == "torchao":
            return torchao_int8(model)
        if args.quant == "torchao-emu":
            return torchao_int8_emulated(model)
        return rounded(model, args.quant, cache, DECODER if args.decoder_only else "")

    with torch.inference_mode():
        ref_logits = _logits(original, feats, ids)
        for name, model in models.items():  # each model as loaded, against the original in float32
            rel = float((_logits(model, feats, ids) - ref_logits).norm() / ref_logits.norm())
            result["exactness"][f"{name}|0"] = {"rel": rel}
            if not rel <= 1e-5:
                raise SystemExit(f"{name}: not the original's function in float32, ‖Δ‖ / ‖ref‖ = {rel:.2e}")
            if args.quant == "torchao-emu":  # the emulation against torchao itself, on the first clip
                diff = check_emulation(model, feats, ids)
                result["exactness"][f"{name}|0"]["emulation"] = diff
                print(f"{name}: torchao emulated vs torchao, clip 0 logits: max |Δ| / max |logit| = {diff:.1e}")
                if not diff <= 1e-6:
                    raise SystemExit(f"{name}: the torchao emulation is not torchao's computation ({diff:.1e})")
    for seed in seeds:
        t0 = time.time()
        drawn, enc_states = {}, None  # kept for the swaps: both rounded draws, the original's encoder states
        for name, model in models.items():
            d = drawn_model(model, seed)
            if seed != 0 and args.draws != "reorder":  # the draw checked against the unrounded original first
                result["exactness"][f"{name}|{seed}"] = check_drawn(
                    d, ref_logits, feats, ids, model, lambda m, seed=seed: drawn_model(m, seed), f"{name} draw {seed}")
            q = engine(d)
            del d
            if enc is not None and not swaps:  # the decoder alone, a batch at a time (memory)
                result["kl"][name].append(decoder_kl(q, ids, enc, ref).tolist())
                del q
                continue
            got, states = logp(q)
            result["kl"][name].append(clip_kl(ref, got).tolist())
            if swaps and name in ("original", "conversion"):
                drawn[name] = q
                enc_states = states if name == "original" else enc_states
        if swaps and "conversion" not in drawn:  # --only original: the conversion's draw rounded, not run
            drawn["conversion"] = engine(drawn_model(conv, seed))
        for v in swaps:  # the original's draw with one side's writers from the conversion's (same seed)
            mixed = swapped_writers(drawn["original"], drawn["conversion"], "decoder" if v == "decw" else "encoder")
            got, _ = forced_logp(mixed, feats, ids, enc_states if v == "decw" else None)
            result["kl"][f"conversion-{v}"].append(clip_kl(ref, got).tolist())
        del drawn
        cache.keep_used()
        result["seeds"].append(seed)
        line = ", ".join(f"{n} {np.mean(k[-1]):.4f}" for n, k in result["kl"].items())
        print(f"seed {seed}: KL/clip {line} ({time.time() - t0:.0f} s)", flush=True)
        if args.json:  # after every draw, so a stopped run keeps what it measured
            args.json.write_text(json.dumps(result))
    print()
    print(table([result]))


if __name__ == "__main__":
    main()
