"""Quantization error of the original, the converted and the rotated model, side by side in one run.

Variants of one fp32 model:

* ``original``: as loaded (LayerNorm);
* ``converted``: ``normswap.patch(fold_gamma=True)`` (RMSNorm, γ folded into the readers);
* ``random``, ``hadamard``, ``hadamard+online``: the converted model after ``normswap.rotate`` with a
  random orthogonal matrix, a randomized Hadamard, and a Hadamard with QuaRot's online rotations.
  A variant that this normswap cannot build (no Hadamard API yet) or that rotates nothing (no
  rotation-ready stream: Post-LN encoders) is reported with the reason, not measured.
* ``learned-w4a4``, ``learned-w4a4+online``, ``learned-w4a8``: ``normswap.rotate(model, "learned", bits=4,
  act_bits=4|8, steps=LEARN_STEPS)`` on the held-out calibration batches (the ``+smooth`` ones): the Hadamard
  times an orthogonal R learned for that RTN setting (``normswap.rotation.learn``).

Quantizers (``quant_utils``): round-to-nearest fake quantization of every ``nn.Linear`` and HF
``Conv1D`` at W8A8, W4A8, W8A4 and W4A4 (weights symmetric absmax per output channel, the Linear's
input symmetric absmax per token, no clipping search), and a real int8 path:
``torch.ao.quantization.quantize_dynamic`` (qint8 weights and dynamically quantized activations,
integer GEMMs on CPU), and torchao's int8 dynamic-activation / int8-weight where torchao is installed
(the ``quant`` extra; per-token activations and per-channel weights, ``torch._int_mm``). The real
quantizers run on what a stock tool would load: each variant written with ``format="compat"`` and
reloaded in plain transformers (checked to give the same outputs), or, where normswap cannot write
a compat checkpoint of it (approximate norms), the in-memory model; the notes say which.

Error against the fp32 original, in the metric users compare:

* causal LMs: mean KL(original ‖ quantized) of the next-token distributions and top-1 agreement;
* sentence encoders: 1 − cosine of the sentence embeddings (pooled as the sentence-transformers
  config says; mean by default) and top-1 neighbour agreement;
* vision backbones: 1 − cosine of the CLS token of ``last_hidden_state``;
* speech seq2seq (Whisper): mean KL(original ‖ quantized) of the decoder's next-token distributions and
  top-1 agreement, teacher-forced on transcripts of real audio (WAV files under ``--audio``, with a
  ``.txt`` transcript beside each or a ``transcripts.json``, or the fp32 original's greedy transcript
  where there is none); the
  encoder's Linear inputs get their own outlier figures.

Activation outliers per Linear input (per token, then averaged over tokens): ``max|x|/rms(x)`` and
kurtosis, reported as the mean over Linear inputs and the worst Linear input.

Models: a local transformers directory (``--model PATH``), or ``toy-gpt2`` / ``toy-gpt2-outliers``
(Pre-LN GPT-2 trained offline on the toy grammar by ``normswap.recipes.toy``; the second starts from
BERT-like LayerNorm parameters with a few large outlier channels), or ``random-gpt2`` /
``random-vit`` / ``random-bert`` (tiny random models, for the tests)::

    python benchmarks/bench_quant.py --model toy-gpt2
    python benchmarks/bench_quant.py --model /path/to/all-MiniLM-L6-v2 --texts 128
    python benchmarks/bench_quant.py --model /path/to/dinov2-small --images /path/to/skimage/data
    python benchmarks/bench_quant.py --model /path/to/whisper-base --audio /path/to/wavs --texts 8

Each variant is built, measured and freed in turn (at most the original, the converted model, one
rotated variant and one quantized copy are alive), so a 0.25B model stays within a few GB.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import random
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quant_utils  # noqa: E402  (the benchmark's own helper module, next to this file)

PRECISIONS = (("W8A8", 8, 8), ("W4A8", 4, 8), ("W8A4", 8, 4), ("W4A4", 4, 4))
ROTATIONS = ("random", "hadamard", "hadamard+online", "hadamard+smooth", "hadamard+online+smooth",
             "learned-w4a4", "learned-w4a4+online", "learned-w4a8")
LEARN_STEPS = 100  # "learned-wXaY": rotate(..., "learned", bits=X, act_bits=Y, steps=LEARN_STEPS) on CALIBRATION
SMOOTH_ALPHA = 0.5  # "+smooth": rotate(..., smooth=0.5), SmoothQuant's usual α, on CALIBRATION
CALIBRATION: list[dict] | None = None  # held-out batches for "+smooth" (None: normswap's built-in ones)
TOYS = ("toy-gpt2", "toy-gpt2-outliers")
RANDOMS = ("random-gpt2", "random-vit", "random-bert", "random-whisper")
SPEECH_TYPES = ("whisper",)
VISION_TYPES = ("vit", "dinov2", "deit", "dinov2_with_registers", "vit_mae", "vit_msn")


# ---------------------------------------------------------------- models and inputs

def _random_norms(model: torch.nn.Module, seed: int) -> None:
    """Spread LayerNorm γ/β with a few outlier channels (a random model's 1/0 norms hide what folding does)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm) and m.weight is not None:
                d = m.weight.shape[0]
                m.weight.copy_(1 + 0.5 * torch.randn(d, generator=gen))
                m.bias.copy_(0.3 * torch.randn(d, generator=gen))
                m.bias[: max(1, d // 32)] += 3.0


def random_model(name: str, seed: int = 0) -> tuple[torch.nn.Module, str]:
    """A tiny random model for the tests: (model, kind)."""
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel, ViTConfig, ViTModel

    torch.manual_seed(seed)
    if name == "random-gpt2":
        config = GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
                            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model, kind = GPT2LMHeadModel(config), "lm"
    elif name == "random-vit":
        model, kind = ViTModel(ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, image_size=32, patch_size=8),
                               add_pooling_layer=False), "vision"
    elif name == "random-whisper":
        from transformers import WhisperConfig, WhisperForConditionalGeneration

        config = WhisperConfig(vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                               decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8,
                               max_source_positions=16, max_target_positions=32, pad_token_id=0,
                               decoder_start_token_id=1, bos_token_id=1, eos_token_id=2, begin_suppress_tokens=None,
                               suppress_tokens=None)
        model, kind = WhisperForConditionalGeneration(config), "speech"
    elif name == "random-bert":
        model, kind = BertModel(BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=64, max_position_embeddings=64),
                                add_pooling_layer=False), "encoder"
    else:
        raise SystemExit(f"unknown random model {name!r} (one of {', '.join(RANDOMS)})")
    _random_norms(model, seed)
    return model.eval(), kind


def toy_model(name: str, workdir: Path, hidden: int, layers: int, steps: int) -> Path:
    """Train (once, cached under ``workdir``) a Pre-LN GPT-2 on the toy grammar."""
    from normswap.recipes.toy import train_tiny_causal_lm

    out = workdir / f"{name}-h{hidden}-l{layers}-s{steps}"
    if not (out / "config.json").exists():
        t0 = time.perf_counter()
        train_tiny_causal_lm(out, arch="gpt2", hidden=hidden, layers=layers, heads=max(1, hidden // 32),
                             steps=steps, bert_like_norms=1.0 if name == "toy-gpt2-outliers" else 0.0)
        print(f"trained {name} in {time.perf_counter() - t0:.0f} s -> {out}")
    return out


def kind_of(config: Any) -> str:
    archs = " ".join(getattr(config, "architectures", None) or [])
    if getattr(config, "model_type", "") in SPEECH_TYPES or "SpeechSeq2Seq" in archs:
        return "speech"
    if "CausalLM" in archs or "LMHeadModel" in archs:
        return "lm"
    if getattr(config, "model_type", "") in VISION_TYPES:
        return "vision"
    return "encoder"


def load_dir(path: Path) -> tuple[torch.nn.Module, Any, str]:
    """(model, tokenizer or None, kind) from a local transformers directory, fp32, eval mode."""
    from transformers import AutoConfig, AutoProcessor, AutoTokenizer

    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    kind = kind_of(config)
    model = model_class(kind).from_pretrained(str(path), local_files_only=True, dtype=torch.float32).eval()
    if kind == "speech":
        tok = AutoProcessor.from_pretrained(str(path), local_files_only=True)
    else:
        tok = None if kind == "vision" else AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return model, tok, kind


def model_class(kind: str) -> Any:
    """The transformers auto class a stock tool loads a model of this kind with."""
    from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSpeechSeq2Seq

    return {"lm": AutoModelForCausalLM, "speech": AutoModelForSpeechSeq2Seq}.get(kind, AutoModel)


def english(n: int, seed: int = 0) -> list[str]:
    """``n`` English paragraphs from Python's reference docs (shipped with Python, offline)."""
    import pydoc_data.topics as topics

    paras = [" ".join(p.split()) for text in topics.topics.values() for p in text.split("\n\n")]
    paras = sorted({p for p in paras if len(p.split()) >= 8 and not p.startswith(("*", ">>>", "|"))})
    random.Random(seed).shuffle(paras)
    return paras[:n]


def text_batches(tok: Any, texts: list[str], max_len: int, batch: int = 16) -> list[dict[str, torch.Tensor]]:
    out = []
    for i in range(0, len(texts), batch):
        enc = tok(texts[i:i + batch], padding=True, truncation=True, max_length=max_len, return_tensors="pt")
        out.append({k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")})
    return out


def random_id_batches(vocab: int, n: int, length: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, length), generator=gen)
    return [{"input_ids": ids[i:i + 8], "attention_mask": torch.ones_like(ids[i:i + 8])} for i in range(0, n, 8)]


def image_batches(model: torch.nn.Module, image_dir: str | None, n: int, path: Path | None = None,
                  seed: int = 0) -> tuple[list[dict[str, torch.Tensor]], str]:
    """Pixel batches: real images (PNG/JPEG under ``image_dir``, resized and normalised) or random noise."""
    size = int(getattr(model.config, "image_size", 224))
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # ImageNet, unless the processor says otherwise
    if path is not None and (path / "preprocessor_config.json").exists():
        pc = json.loads((path / "preprocessor_config.json").read_text())
        mean, std = pc.get("image_mean", mean), pc.get("image_std", std)
    files = sorted(p for ext in ("*.png", "*.jpg", "*.jpeg") for p in Path(image_dir).glob(ext)) if image_dir else []
    if not files:
        gen = torch.Generator().manual_seed(seed)
        px = torch.randn(n, 3, size, size, generator=gen)
        return [{"pixel_values": px[i:i + 8]} for i in range(0, n, 8)], f"{n} random-noise images"
    from PIL import Image

    tensors = []
    for f in files:
        img = Image.open(f).convert("RGB")
        # the whole image, and its four corner crops: more inputs from a handful of photographs
        w, h = img.size
        crops = [img] + [img.crop((x, y, x + w // 2, y + h // 2)) for x in (0, w // 2) for y in (0, h // 2)]
        for c in crops:
            t = torch.tensor(list(c.resize((size, size), Image.BICUBIC).getdata()), dtype=torch.float32)
            t = t.view(size, size, 3).permute(2, 0, 1) / 255.0
            tensors.append((t - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1))
    px = torch.stack(tensors[:n])
    return [{"pixel_values": px[i:i + 8]} for i in range(0, len(px), 8)], \
        f"{len(px)} crops of {len(files)} images in {image_dir}"


def read_wav(path: Path, rate: int = 16000) -> Any:
    """A WAV file as mono float32 samples at ``rate`` Hz (scipy reads PCM and float WAVs; resampled
    polyphase where the file's rate differs)."""
    from math import gcd

    import numpy as np
    from scipy.io import wavfile
    from scipy.signal import resample_poly

    sr, a = wavfile.read(str(path))
    if a.dtype.kind in "iu":
        info = np.iinfo(a.dtype)
        a = (a.astype(np.float64) - (info.max + info.min + 1) / 2) / ((info.max - info.min + 1) / 2)
    a = a.astype(np.float64)
    if a.ndim == 2:
        a = a.mean(axis=1)
    if sr != rate:
        g = gcd(sr, rate)
        a = resample_poly(a, rate // g, sr // g)
    return a.astype(np.float32)


def transcript_for(wav: Path) -> str | None:
    """The transcript of a WAV file: ``clip.txt`` beside ``clip.wav``, or its entry in a ``transcripts.json``
    (file name → text, as ``speech_samples.py`` writes) in the same directory; None if neither has one."""
    txt = wav.with_suffix(".txt")
    if txt.exists():
        return " ".join(txt.read_text().split())
    table = wav.parent / "transcripts.json"
    if table.exists():
        text = json.loads(table.read_text()).get(wav.name)
        return " ".join(text.split()) if isinstance(text, str) else None
    return None


def speech_batches(model: torch.nn.Module, processor: Any, audio_dir: str | None, n: int, max_len: int,
                   seed: int = 0, batch: int = 4) -> tuple[list[dict[str, torch.Tensor]], str, list[str]]:
    """Teacher-forced decoder batches over real audio: ``input_features`` (log-mel, the model's feature
    extractor), ``decoder_input_ids`` = the transcript's tokens with the decoder prompt in front
    (``<|startoftranscript|>`` [language, task] ``<|notimestamps|>``) and the end token dropped, and
    ``decoder_attention_mask``. Transcripts: the ``.txt`` beside each WAV, else the fp32 original's greedy
    decoding. Without a processor or audio (the random test model), random features and token ids."""
    cfg = model.config
    if processor is None or not audio_dir:
        gen = torch.Generator().manual_seed(seed)
        frames = 2 * cfg.max_source_positions
        feats = torch.randn(n, cfg.num_mel_bins, frames, generator=gen)
        ids = torch.randint(3, cfg.vocab_size, (n, min(max_len, 12)), generator=gen)
        ids[:, 0] = cfg.decoder_start_token_id
        return [{"input_features": feats[i:i + batch], "decoder_input_ids": ids[i:i + batch],
                 "decoder_attention_mask": torch.ones_like(ids[i:i + batch])} for i in range(0, n, batch)], \
            f"{n} random feature/token sequences", []
    files = sorted(Path(audio_dir).glob("*.wav"))[:n]
    if not files:
        raise SystemExit(f"{audio_dir}: no .wav files")
    fe, tok = processor.feature_extractor, processor.tokenizer
    if getattr(cfg, "lang_to_id", None) or getattr(model.generation_config, "lang_to_id", None):
        tok.set_prefix_tokens(language="en", task="transcribe", predict_timestamps=False)
    else:
        tok.set_prefix_tokens(predict_timestamps=False)
    texts, from_model = [], 0
    feats_all = []
    for f in files:
        audio = read_wav(f, fe.sampling_rate)
        feats_all.append(fe(audio, sampling_rate=fe.sampling_rate, return_tensors="pt")["input_features"])
    feats_all = torch.cat(feats_all)
    for i, f in enumerate(files):
        text = transcript_for(f)
        if text is None:  # the original's own greedy transcript
            with torch.no_grad():
                out = model.generate(feats_all[i:i + 1], max_new_tokens=max_len)
            text = tok.decode(out[0], skip_special_tokens=True).strip()
            from_model += 1
        texts.append(text)
    out_batches = []
    pad = tok.pad_token_id if tok.pad_token_id is not None else cfg.eos_token_id
    for i in range(0, len(files), batch):
        seqs = [tok(t).input_ids[:max_len + 1][:-1] for t in texts[i:i + batch]]  # drop the end token
        width = max(len(q) for q in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, q in enumerate(seqs):
            ids[j, :len(q)] = torch.tensor(q)
            mask[j, :len(q)] = 1
        out_batches.append({"input_features": feats_all[i:i + batch], "decoder_input_ids": ids,
                            "decoder_attention_mask": mask})
    tokens = sum(int(b["decoder_attention_mask"].sum()) for b in out_batches)
    where = "transcripts beside the WAVs" if not from_model else (
        f"{len(files) - from_model} transcripts beside the WAVs, {from_model} greedy fp32 transcripts")
    return out_batches, f"{len(files)} WAV clips in {audio_dir} ({where}; {tokens} decoder positions)", texts


# ---------------------------------------------------------------- outputs and errors

@torch.no_grad()
def outputs(model: torch.nn.Module, batches: list[dict], kind: str, pooling: str = "mean",
            stats: quant_utils.OutlierStats | None = None) -> torch.Tensor:
    """What the error is measured on: LM log-probs of real tokens, sentence embeddings or CLS vectors."""
    from normswap.recipes.losses import pool

    out = []
    for b in batches:
        if stats is not None:
            stats.mask = b.get("decoder_attention_mask" if kind == "speech" else "attention_mask")
        res = model(**b)
        if kind == "speech":
            keep = b["decoder_attention_mask"].bool()
            out.append(torch.log_softmax(res.logits.double()[keep], dim=-1))
        elif kind == "lm":
            logits = res.logits.double()
            keep = b["attention_mask"].bool()
            out.append(torch.log_softmax(logits[keep], dim=-1))
        elif kind == "encoder":
            out.append(pool(res.last_hidden_state.double(), b["attention_mask"], pooling))
        else:
            out.append(res.last_hidden_state[:, 0].double())
    return torch.cat(out)


def errors(ref: torch.Tensor, out: torch.Tensor, kind: str) -> dict[str, float]:
    """Error of ``out`` against ``ref``: {"err": main figure (lower is better), "agree": top-1 figure}."""
    if kind in ("lm", "speech"):
        kl = (ref.exp() * (ref - out)).sum(-1).mean()
        agree = (ref.argmax(-1) == out.argmax(-1)).double().mean()
        return {"err": float(kl), "agree": float(agree)}
    cos = torch.nn.functional.cosine_similarity(ref, out, dim=-1).mean()
    res = {"err": 1.0 - float(cos)}
    if kind == "encoder":
        from normswap.surgery.calibrate import neighbour_figures

        res["agree"] = neighbour_figures(ref, out).get("top1_neighbour_agreement", float("nan"))
    return res


# ---------------------------------------------------------------- variants

def rotation_api() -> dict[str, bool]:
    """Which rotations this normswap offers: the named-method API (``"hadamard"``, ``online=``) or a seed only."""
    import normswap

    params = inspect.signature(normswap.rotate).parameters
    return {"named": "seed" in params or "online" in params, "online": "online" in params,
            "output": "output" in params}


def _rotate(model: torch.nn.Module, which: str, seed: int, kind: str) -> Any:
    import normswap

    api = rotation_api()
    # a backbone whose last norm output is the model output: ask for that output turned back, so
    # the CLS vector is compared with the original's as it is
    # (Whisper's encoder output, `encoder_last_hidden_state`, is a model output too: its norm keeps γ, since
    # folding γ into the cross-attention projections would change that output, so it is turned back as well)
    extra = {"output": "restore"} if kind in ("vision", "speech") and api["output"] else {}
    if which == "random":
        return normswap.rotate(model, "random", seed=seed, **extra) if api["named"] else normswap.rotate(model, seed)
    if not api["named"]:
        raise NotImplementedError("this normswap.rotate takes a seed or a matrix only (no \"hadamard\")")
    if which.startswith("learned-"):  # learned-w4a4[+online]: the rotation learned for that RTN setting
        target, _, online = which.removeprefix("learned-").partition("+")
        w_bits, a_bits = (int(x) for x in target[1:].split("a"))
        return normswap.rotate(model, "learned", seed=seed, online=online == "online", calibration=CALIBRATION,
                               bits=w_bits, act_bits=a_bits, steps=LEARN_STEPS, **extra)
    if which.endswith("+smooth"):
        if "smooth" not in inspect.signature(normswap.rotate).parameters:
            raise NotImplementedError("this normswap.rotate has no smooth=")
        extra.update(smooth=SMOOTH_ALPHA, calibration=CALIBRATION)
        which = which[: -len("+smooth")]
    if which == "hadamard":
        return normswap.rotate(model, "hadamard", seed=seed, **extra)
    if not api["online"]:
        raise NotImplementedError("this normswap.rotate has no online=True")
    return normswap.rotate(model, "hadamard", seed=seed, online=True, **extra)


READERS: set[str] = set()  # Linear names that read a rotated stream (their inputs turn with it)


def build_variants(model: torch.nn.Module, tok: Any, which: list[str], seed: int, kind: str):
    """Yield ``(name, model or None, note)`` one variant at a time (None with the reason where the variant
    could not be built). A rotated variant is built when asked for, from the converted model, so only
    one is alive at a time."""
    import normswap

    yield "original", model, ""
    conv = copy.deepcopy(model)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = normswap.patch(conv, fold_gamma=True, tokenizer=None if kind == "speech" else tok,
                                allow_unusable=True)
    verdicts: dict[str, int] = {}
    for s in report.sites:
        verdicts[s.verdict] = verdicts.get(s.verdict, 0) + 1
    plan = normswap.plan_of(conv)
    extra = ""
    if plan is not None and plan.bias_slots:
        extra += "; bias slot(s) " + ", ".join(f"`{b.reader}`" for b in plan.bias_slots)
    if plan is not None and plan.mean_carries:
        extra += f"; {len(plan.mean_carries)} mean carr(y/ies), scale " + "/".join(
            sorted({f"{c.scale:g}" for c in plan.mean_carries}))
    yield "converted", conv, "patch(fold_gamma=True): " + ", ".join(
        f"{v} {k}" for k, v in sorted(verdicts.items())) + f" ({time.perf_counter() - t0:.1f} s){extra}"
    for rot in which:
        m = copy.deepcopy(conv)
        try:
            result = _rotate(m, rot, seed, kind)
        except (NotImplementedError, normswap.NormswapError) as e:
            yield rot, None, str(e).splitlines()[0]
            continue
        if not getattr(result, "rotated", None):
            yield rot, None, "nothing rotated: " + str(result).splitlines()[0]
            continue
        kept = list(getattr(result, "skipped", []))
        note = f"{len(result.rotated)} stream(s) rotated" + (f", {len(kept)} not: {kept[0]['reason']}" if kept else "")
        if getattr(result, "online_skipped", None):
            note += f"; no online Hadamard: {result.online_skipped[0]}"
        if getattr(result, "smoothing", None) is not None:
            note += f"; {result.smoothing.headline()}"
        READERS.update(r for stream in result.rotated for r in stream.get("readers", []))
        yield rot, m, note
        del m


def gaussian_max_rms(d: int, draws: int = 4000, seed: int = 0) -> float:
    """Mean ``max|g| / rms(g)`` of ``d`` iid Gaussians: what a randomized Hadamard drives every token towards.

    A Hadamard rotation makes each coordinate a ±-sum of all ``d``; for a heavy-tailed token (a few large
    channels) that lowers max/rms towards this figure, for a light-tailed one (max/rms already below it,
    kurtosis below 3) it raises it. So the rule, fixed before any measurement: rotation is expected to
    help a Linear input's per-token quantization when its max/rms is above this figure, and to hurt
    when it is below."""
    g = torch.randn(draws, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return float((g.abs().amax(-1) / g.pow(2).mean(-1).sqrt()).mean())


# ---------------------------------------------------------------- the measurement

def stock_model(variant: torch.nn.Module, name: str, kind: str, ref: torch.Tensor, batches: list[dict],
                pooling: str, tmp: Path) -> tuple[torch.nn.Module, str]:
    """The variant as a stock tool sees it: written with ``format="compat"`` and reloaded in plain
    transformers, when normswap can write it and the reload gives the same outputs; else the in-memory model."""
    if name == "original":
        return variant, "the stock model"
    import normswap

    out = tmp / name
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            normswap.save(variant, out, format="compat", overwrite=True)
            stock = model_class(kind).from_pretrained(str(out), local_files_only=True, dtype=torch.float32).eval()
    except Exception as e:  # noqa: BLE001 - any refusal is reported in the table's notes
        return variant, f"the in-memory model (no compat checkpoint: {str(e).splitlines()[0][:160]})"
    diff = errors(outputs(variant, batches, kind, pooling), outputs(stock, batches, kind, pooling), kind)["err"]
    if not diff < 1e-6:
        return variant, f"the in-memory model (its compat checkpoint reloads with different outputs: error {diff:.3g})"
    return stock, f"its compat checkpoint reloaded in plain transformers (outputs equal: error {diff:.1g})"


def measure(variant: torch.nn.Module, ref: torch.Tensor, batches: list[dict], kind: str, pooling: str,
            precisions: list[tuple[str, int, int]], real: list[str], stock: torch.nn.Module | None = None,
            sensitivity: tuple[str, int, int] | None = None, keep: set[str] = frozenset()) -> dict[str, Any]:
    row: dict[str, Any] = {}
    names = {n for n, _ in quant_utils.matmuls(variant)} - set(keep)
    if sensitivity is not None:  # the error with one Linear quantized at a time: where the error comes from
        _, wb, ab = sensitivity
        row["sensitivity"] = {}
        for name, _ in quant_utils.matmuls(variant):
            q = copy.deepcopy(variant)
            quant_utils.fake_quantize_(q, wb, ab, only={name})
            row["sensitivity"][name] = errors(ref, outputs(q, batches, kind, pooling), kind)["err"]
    with quant_utils.OutlierStats(variant) as stats:
        row["fp32"] = errors(ref, outputs(variant, batches, kind, pooling, stats), kind)
    row["outliers"] = {**stats.summary(), **quant_utils.weight_figures(variant)}
    row["per_linear"] = stats.per_linear()
    for label, wb, ab in precisions:
        q = copy.deepcopy(variant)
        quant_utils.fake_quantize_(q, wb, ab, only=names)
        row[label] = errors(ref, outputs(q, batches, kind, pooling), kind)
        del q
    for label in real:
        try:
            q = REAL[label](stock if stock is not None else variant)
            row[label] = errors(ref, outputs(q, batches, kind, pooling), kind)
        except Exception as e:  # noqa: BLE001 - a variant the real path cannot run is reported, not fatal
            row[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
    return row


REAL = {"int8-dyn": quant_utils.int8_dynamic, "torchao-int8": quant_utils.torchao_int8}


def real_quantizers(wanted: list[str]) -> list[str]:
    """The real int8 quantizers to run: torch.ao's always, torchao's where it imports."""
    out = []
    for label in wanted:
        if label == "torchao-int8":
            try:
                import torchao  # noqa: F401
            except ImportError:
                print("torchao is not installed (pip install normswap[quant]): no torchao-int8 column")
                continue
        out.append(label)
    return out


def _cell(fig: dict | None, kind: str) -> str:
    if not fig:
        return "-"
    if "error" in fig:
        return "failed"
    main = f"{fig['err']:.4g}"
    return main + (f" ({100 * fig['agree']:.1f}%)" if "agree" in fig else "")


def _split(per: dict[str, tuple[float, float]], readers: set[str]) -> str:
    def mean(names: list[str]) -> str:
        return f"{sum(per[n][0] for n in names) / len(names):.2f}" if names else "-"
    return f"{mean([n for n in per if n in readers])} / {mean([n for n in per if n not in readers])}"


def _part(per: dict[str, tuple[float, float]], encoder: bool) -> str:
    names = [n for n in per if (".encoder." in f".{n}") is encoder]
    if not names:
        return "-"
    r = [per[n][0] for n in names]
    k = [per[n][1] for n in names]
    return f"{sum(r) / len(r):.2f} ({max(r):.1f}), {sum(k) / len(k):.2f} ({max(k):.1f})"


def tail_lines(result: dict[str, Any]) -> list[str]:
    """The light-tail rule (:func:`gaussian_max_rms`) on the converted model's rotated-stream readers, and
    what the Hadamard rotation did to each group."""
    conv, had = result["rows"].get("converted"), result["rows"].get("hadamard")
    widths = result.get("reader_widths", {})
    if not conv or not had or not widths:
        return []
    heavy = [n for n in widths if n in conv["per_linear"] and conv["per_linear"][n][0] > widths[n][1]]
    light = [n for n in widths if n in conv["per_linear"] and n not in heavy]
    out = []
    for label, names in (("heavier-tailed than Gaussian (rotation expected to help)", heavy),
                         ("lighter-tailed (rotation expected to hurt)", light)):
        if not names:
            continue
        before = sum(conv["per_linear"][n][0] for n in names) / len(names)
        after = sum(had["per_linear"][n][0] for n in names if n in had["per_linear"]) / len(names)
        gauss = sum(widths[n][1] for n in names) / len(names)
        sens = ""
        if "sensitivity" in conv and "sensitivity" in had:
            b = sum(conv["sensitivity"].get(n, 0) for n in names)
            a = sum(had["sensitivity"].get(n, 0) for n in names)
            sens = f"; summed one-at-a-time {result['sensitivity']} error {b:.3g} -> {a:.3g}"
        out.append(f"{len(names)} reader input(s) {label}: max/rms {before:.2f} -> {after:.2f} "
                   f"(Gaussian reference {gauss:.2f}){sens}")
    return out


def table(result: dict[str, Any]) -> str:
    kind = result["kind"]
    cols = ["fp32", *[p[0] for p in result["precisions"]], *result["real"]]
    what = {"lm": "KL (top-1 agreement)", "encoder": "1 − cosine (top-1 neighbour agreement)",
            "vision": "1 − CLS cosine",
            "speech": "decoder next-token KL, teacher-forced (top-1 agreement)"}[kind]
    lines = [f"error against the fp32 original: {what}", "",
             "| model | act max/rms mean (worst) | act kurtosis mean (worst) | weight max/rms mean (worst) | "
             + " | ".join(cols) + " |",
             "|---|---|---|---|" + "---|" * len(cols)]
    for name, row in result["rows"].items():
        if row is None:
            continue
        o = row["outliers"]
        lines.append(f"| {name} | {o['max_rms_mean']:.2f} ({o['max_rms_worst']:.1f}) | "
                     f"{o['kurtosis_mean']:.2f} ({o['kurtosis_worst']:.1f}) | "
                     f"{o['w_max_rms_mean']:.2f} ({o['w_max_rms_worst']:.1f}) | "
                     + " | ".join(_cell(row.get(c), kind) for c in cols) + " |")
    lines.append("")
    lines += [f"- {name}: {note}" for name, note in result["notes"].items() if note]
    if result.get("sensitivity"):
        lines.append(f"- {result['sensitivity']} with one Linear quantized at a time, the five largest errors "
                     "(act max/rms and kurtosis of its input):")
        for name, row in result["rows"].items():
            if row and "sensitivity" in row:
                top = sorted(row["sensitivity"].items(), key=lambda kv: -kv[1])[:5]
                lines.append(f"  - {name}: " + ", ".join(
                    f"`{k}` {v:.3g} ({row['per_linear'][k][0]:.1f}, {row['per_linear'][k][1]:.1f})" for k, v in top))
    if kind == "speech":
        lines.append("- encoder / decoder Linear inputs, act max/rms mean (worst), kurtosis mean (worst): " + "; ".join(
            f"{name} {_part(row['per_linear'], True)} / {_part(row['per_linear'], False)}"
            for name, row in result["rows"].items() if row))
    readers = set(result.get("readers", []))
    if readers:
        lines.append("- act max/rms, mean over the Linear inputs that read a rotated stream / over the others "
                     "(those only online rotations reach): " + "; ".join(
                         f"{name} {_split(row['per_linear'], readers)}" for name, row in result["rows"].items() if row))
    return "\n".join(lines)


def goal_lines(result: dict[str, Any]) -> list[str]:
    """The issue's goal: offline rotation below the original at every precision; online at A4 ≤ half."""
    rows, out = result["rows"], []
    orig = rows.get("original")
    if not orig:
        return out
    for rot in ("random", "hadamard"):
        r = rows.get(rot)
        if not r:
            continue
        worse = [p for p, _, _ in result["precisions"] if r[p]["err"] >= orig[p]["err"]]
        out.append(f"{rot}: below the original at " + (
            "every precision" if not worse else f"{len(result['precisions']) - len(worse)} of "
            f"{len(result['precisions'])} precisions (not at {', '.join(worse)})"))
    r = rows.get("hadamard+online")
    if r:
        for p, _, ab in result["precisions"]:
            if ab == 4:
                ratio = r[p]["err"] / orig[p]["err"] if orig[p]["err"] > 0 else float("inf")
                out.append(f"hadamard+online {p}: {ratio:.2f}x the original's error "
                           f"({'meets' if ratio <= 0.5 else 'misses'} the ≤ 0.5x goal)")
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a local transformers directory, or one of "
                    + ", ".join(TOYS + RANDOMS))
    ap.add_argument("--texts", type=int, default=64, help="number of texts / images to evaluate on")
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--images", default=None, help="directory of PNG/JPEG images (vision models)")
    ap.add_argument("--audio", default=None, help="directory of WAV files with transcripts (a .txt beside each, or "
                    "transcripts.json; speech models; a WAV without one is transcribed by the fp32 original)")
    ap.add_argument("--rotations", nargs="*", default=list(ROTATIONS), choices=ROTATIONS)
    ap.add_argument("--precisions", nargs="*", default=[p[0] for p in PRECISIONS],
                    choices=[p[0] for p in PRECISIONS])
    ap.add_argument("--real", nargs="*", default=list(REAL), choices=list(REAL),
                    help="real int8 quantizers: torch.ao quantize_dynamic, torchao int8 dynamic (if installed)")
    ap.add_argument("--no-compat", action="store_true",
                    help="run the real quantizers on the in-memory models, not on reloaded compat checkpoints")
    ap.add_argument("--sensitivity", default=None, choices=[p[0] for p in PRECISIONS],
                    help="also quantize one Linear at a time at this precision (one pass per Linear and variant)")
    ap.add_argument("--keep-head", action="store_true",
                    help="leave the LM head in float in the RTN runs (QuaRot's and SpinQuant's setting)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default="/tmp/normswap-bench-quant", help="where toy models are trained once")
    ap.add_argument("--toy-hidden", type=int, default=128)
    ap.add_argument("--toy-layers", type=int, default=4)
    ap.add_argument("--toy-steps", type=int, default=400)
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    global CALIBRATION  # "+smooth" variants calibrate on these (speech, vision, random ids: normswap's built-in)

    from normswap.recipes.models import sentence_pooling

    path = None
    if args.model in RANDOMS:
        model, kind = random_model(args.model, args.seed)
        tok, label = None, args.model
    else:
        path = toy_model(args.model, Path(args.workdir), args.toy_hidden, args.toy_layers, args.toy_steps) \
            if args.model in TOYS else Path(args.model)
        if not (path / "config.json").exists():
            raise SystemExit(f"{path}: not a transformers directory (no config.json)")
        model, tok, kind = load_dir(path)
        label = args.model if args.model in TOYS else path.name
    pooling = sentence_pooling(str(path)) if path is not None else None
    pooling = pooling or "mean"

    if kind == "speech":
        batches, data, _ = speech_batches(model, tok, args.audio, args.texts, args.max_len, args.seed)
    elif kind == "vision":
        batches, data = image_batches(model, args.images, args.texts, path, args.seed)
    elif tok is None:
        batches = random_id_batches(model.config.vocab_size, args.texts, min(args.max_len, 16), args.seed)
        data = f"{args.texts} random token sequences"
    elif args.model in TOYS:
        from normswap.recipes.toy import grammar_corpus

        batches = text_batches(tok, grammar_corpus(args.texts, seed=10_000 + args.seed), args.max_len)
        data = f"{args.texts} held-out toy-grammar lines"
        CALIBRATION = text_batches(tok, grammar_corpus(32, seed=20_000 + args.seed), args.max_len)
    else:
        batches = text_batches(tok, english(args.texts, args.seed), args.max_len)
        data = f"{args.texts} English paragraphs (Python reference docs), up to {args.max_len} tokens"
        CALIBRATION = text_batches(tok, english(args.texts + 32, args.seed)[args.texts:], args.max_len)  # disjoint

    precisions = [p for p in PRECISIONS if p[0] in args.precisions]
    keep: set[str] = set()
    head = model.get_output_embeddings() if args.keep_head and hasattr(model, "get_output_embeddings") else None
    if head is not None:
        keep = {n for n, m in model.named_modules() if m is head}
    t0 = time.perf_counter()
    conv_widths: dict[str, int] = {}
    ref = outputs(model, batches, kind, pooling)
    variants = build_variants(model, tok, list(args.rotations), args.seed, kind)
    result: dict[str, Any] = {
        "model": label, "kind": kind, "data": data, "pooling": pooling if kind == "encoder" else None,
        "precisions": precisions, "real": real_quantizers(args.real), "rows": {}, "notes": {},
        "sensitivity": args.sensitivity, "kept_in_float": sorted(keep),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "normswap": __import__("normswap").__version__},
        "params": sum(p.numel() for p in model.parameters()),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, variant, note in variants:
            result["notes"][name] = note
            if variant is None:
                result["rows"][name] = None
                continue
            stock, where = (variant, "the in-memory model") if args.no_compat or not result["real"] else \
                stock_model(variant, name, kind, ref, batches, pooling, Path(tmp))
            if result["real"]:
                result["notes"][name] = "; ".join(filter(None, [note, "real quantizers on " + where]))
            result["rows"][name] = measure(variant, ref, batches, kind, pooling, precisions, result["real"], stock,
                                           next((p for p in PRECISIONS if p[0] == args.sensitivity), None), keep)
            if name == "converted":
                conv_widths = {n: m.weight.shape[quant_utils.weight_in_axis(m)]
                               for n, m in quant_utils.matmuls(variant)}
            del stock, variant
    result["readers"] = sorted(READERS)
    gauss: dict[int, float] = {}
    result["reader_widths"] = {n: (w, gauss.setdefault(w, gaussian_max_rms(w))) for n, w in conv_widths.items()
                               if n in READERS}
    result["tails"] = tail_lines(result)
    result["seconds"] = time.perf_counter() - t0
    result["goal"] = goal_lines(result)
    kept = f"; RTN leaves {', '.join(sorted(keep))} in float" if keep else ""
    print(f"\n## {label} ({kind}, {result['params'] / 1e6:.2f}M parameters; {data}{kept})\n")
    print(table(result))
    for line in result["tails"]:
        print(f"- light-tail rule: {line}")
    for line in result["goal"]:
        print(f"- goal: {line}")
    print(f"\n({result['seconds']:.0f} s; torch {torch.__version__})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
