"""Real checkpoints converted the way users do it: the default CLI, and ``normswap.patch`` on real inputs.

For each sentence-transformers directory given (``NAME=DIR``):

* ``normswap convert DIR --out OUT`` with defaults, in a fresh process under ``/usr/bin/time -v``: exit
  code, wall time, peak RSS, verdict counts and the figures it reports;
* the written directory loaded back in sentence-transformers, against the original, on held-out English
  paragraphs (Python's reference docs, as in ``bench_recovery.py``): mean cosine of the embeddings,
  top-1 neighbour agreement, recall@10, Spearman of pairwise similarities;
* the output error against the float64 original (token states over real tokens, relative RMS): the
  converted model in float32, and in bfloat16 divided by the original's own bfloat16 error (the ratio
  ``tests/surgery/test_bf16_fidelity.py`` holds to ≤ 1.1 on the zoo);
* ``normswap.plan(model, example_inputs=...)`` (the analysis ``patch`` runs) with a batch of real padded
  sentences as the analysis inputs: are the verdicts the CLI's?

For a Whisper directory (``model_type`` ``whisper``; speech clips from ``--speech DIR``, ``*.wav``):

* the same CLI run; every norm of these Pre-LN models should come out exact;
* ``normswap.plan`` and ``normswap.patch`` with what Whisper users feed as the analysis inputs: log-mel
  features of real speech from the model's ``WhisperFeatureExtractor``, one clip and a batch of all
  clips, with decoder prompts of different lengths (start token; the task prefix; a previous-text
  prompt before it; the prefix followed by a whole transcript): verdicts and edits equal to the CLI's?
* the written directory reloaded (``normswap.load`` and ``AutoModelForSpeechSeq2Seq`` after
  ``import normswap``): logits under teacher forcing on the original's own transcripts against the
  float64 original (fp32 error; bf16 error over the original's bf16 error); greedy transcripts of
  the converted model (float32 and bfloat16) against the original's; ``generate()`` as users call it;
* ``--stages placement``: the bf16 error ratio of the default conversion (β placement rule) against
  ``beta_placement="fold"`` (β folded wherever the readers can take it), and how many norms keep β.

    python benchmarks/bench_field.py minilm=/path/all-MiniLM-L6-v2 mpnet=/path/all-mpnet-base-v2 \\
        --json field.jsonl
    python benchmarks/bench_field.py tiny.en=/path/whisper-tiny.en --speech /path/speech --json field.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_recovery import figures, paragraphs  # noqa: E402


def run_cli(src: Path, out: Path) -> dict:
    cmd = ["/usr/bin/time", "-v", sys.executable, "-c", "from normswap.cli import main; main()",
           "convert", str(src), "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    row = {"exit": proc.returncode, "wall_s": round(wall, 1),
           "peak_rss_mb": round(int(rss.group(1)) / 1024) if rss else None,
           "notes": [ln for ln in proc.stderr.splitlines() if ln.startswith(("note:", "error:"))],
           "summary": proc.stdout.strip().splitlines()[:4]}
    if proc.returncode == 0:
        row.update(manifest_figures(out))
    return row


def manifest_figures(out: Path) -> dict:
    manifest = json.loads((out / "config.json").read_text())["normswap"]
    return {"counts": {k: v for k, v in manifest["counts"].items() if v},
            "verification": {k: v for k, v in manifest.get("verification", {}).items()
                             if isinstance(v, (int, float))}}


@torch.no_grad()
def states(model: torch.nn.Module, batches: list[dict]) -> list[torch.Tensor]:
    """Last hidden states at the real tokens, float64, per batch."""
    out = []
    for enc in batches:
        h = model(**enc).last_hidden_state
        out.append(h.double()[enc["attention_mask"].bool()])
    return out


def rel_rms(ref: list[torch.Tensor], got: list[torch.Tensor]) -> float:
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(ref, got, strict=True))
    den = sum(float(a.pow(2).sum()) for a in ref)
    return (num / den) ** 0.5


def errors(src: Path, out: Path, texts: list[str]) -> dict:
    """fp32 error and bf16 ratio, against the float64 original, on token states."""
    from transformers import AutoModel, AutoTokenizer

    import normswap

    tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    batches = [tok(texts[i:i + 16], padding=True, truncation=True, max_length=128, return_tensors="pt")
               for i in range(0, len(texts), 16)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        original = AutoModel.from_pretrained(str(src), local_files_only=True).eval()
    converted = normswap.load(out)
    ref = states(copy.deepcopy(original).double(), batches)
    row = {"fp32_rel_rms_error": rel_rms(ref, states(converted, batches)),
           "fp32_original_rel_rms_error": rel_rms(ref, states(original, batches))}
    o16 = rel_rms(ref, states(copy.deepcopy(original).to(torch.bfloat16), batches))
    c16 = rel_rms(ref, states(copy.deepcopy(converted).to(torch.bfloat16), batches))
    row.update(bf16_original_rel_rms_error=o16, bf16_converted_rel_rms_error=c16, bf16_ratio=c16 / o16)
    return row


def embeddings(src: Path, out: Path, held: list[str]) -> dict:
    import sentence_transformers as st

    import normswap  # noqa: F401 - registers the converted model types for AutoModel

    a = st.SentenceTransformer(str(src), device="cpu")
    b = st.SentenceTransformer(str(out), device="cpu")
    ea = a.encode(held, convert_to_tensor=True, batch_size=32).double()
    eb = b.encode(held, convert_to_tensor=True, batch_size=32).double()
    return figures(ea, eb)


def planned_on_real_inputs(src: Path, texts: list[str]) -> dict:
    """``normswap.plan`` (the analysis ``patch`` runs) with real padded sentences as the analysis
    inputs: the verdict counts, to compare with the CLI's (which analyses random ids)."""
    from transformers import AutoModel, AutoTokenizer

    import normswap

    tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModel.from_pretrained(str(src), local_files_only=True).eval()
        enc = dict(tok(texts[:8], padding=True, truncation=True, max_length=128, return_tensors="pt"))
        t0 = time.perf_counter()
        plan = normswap.plan(model, example_inputs=enc)
    return {"plan_counts": {k: v for k, v in plan.counts().items() if v},
            "plan_s": round(time.perf_counter() - t0, 1)}


# ------------------------------------------------------------------------------------------ Whisper
def is_whisper(src: Path) -> bool:
    return json.loads((src / "config.json").read_text()).get("model_type") == "whisper"


def load_wav(path: Path, rate: int = 16000) -> Any:
    """A mono 16-bit WAV as float32 at ``rate`` Hz (polyphase resampling)."""
    import wave
    from math import gcd

    import numpy as np
    from scipy.signal import resample_poly

    with wave.open(str(path)) as w:
        sr, ch, width, n = w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()
        raw = w.readframes(n)
    if width != 2:
        raise SystemExit(f"{path}: 16-bit PCM expected")
    x = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    x = x.reshape(-1, ch).mean(axis=1)
    if sr != rate:
        g = gcd(sr, rate)
        x = resample_poly(x, rate // g, sr // g).astype(np.float32)
    return x


class Speech:
    """The model's feature extractor and tokenizer, the clips as log-mel features, the prompts."""

    def __init__(self, src: Path, wavs: list[Path]) -> None:
        from transformers import AutoTokenizer, GenerationConfig, WhisperFeatureExtractor

        self.fe = WhisperFeatureExtractor.from_pretrained(str(src), local_files_only=True)
        self.tok = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
        self.gen = GenerationConfig.from_pretrained(str(src), local_files_only=True)
        self.names = [w.name for w in wavs]
        audio = [load_wav(w, self.fe.sampling_rate) for w in wavs]
        self.seconds = [round(len(a) / self.fe.sampling_rate, 2) for a in audio]
        self.features = self.fe(audio, sampling_rate=self.fe.sampling_rate, return_tensors="pt").input_features
        ids = self.tok.convert_tokens_to_ids
        sot = self.gen.decoder_start_token_id
        multilingual = bool(getattr(self.gen, "is_multilingual", False))
        self.prefix = [sot] + ([ids("<|en|>"), ids("<|transcribe|>")] if multilingual else []) + [
            self.gen.no_timestamps_token_id]
        previous = self.tok.encode(" Earlier on the radio, they talked about the weather and the traffic.",
                                   add_special_tokens=False)
        self.prompts = {
            "start token": [sot],
            "task prefix": self.prefix,
            "previous text + prefix": [ids("<|startofprev|>")] + previous + self.prefix,
        }
        self.eos = self.gen.eos_token_id

    def batch(self, n: int | None = None) -> torch.Tensor:
        return self.features if n is None else self.features[:n]


@torch.no_grad()
def greedy(model: torch.nn.Module, features: torch.Tensor, prompt: list[int], eos: int,
           max_new: int = 120) -> list[list[int]]:
    """Greedy decoding with the KV cache: argmax at every step, no suppression (the same rule for both
    models, so transcripts are compared token for token); rows stop at ``eos``."""
    dtype = next(model.parameters()).dtype
    enc = model.get_encoder()(input_features=features.to(dtype))
    b = features.shape[0]
    cur = torch.tensor([prompt] * b)
    past, done, out = None, torch.zeros(b, dtype=torch.bool), []
    for _ in range(max_new):
        o = model(encoder_outputs=enc, decoder_input_ids=cur, past_key_values=past, use_cache=True)
        past = o.past_key_values
        nxt = o.logits[:, -1].float().argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, eos), nxt)
        out.append(nxt)
        done |= nxt == eos
        cur = nxt[:, None]
        if bool(done.all()):
            break
    rows = torch.stack(out, 1).tolist()
    return [r[: r.index(eos)] if eos in r else r for r in rows]


@torch.no_grad()
def forced_logits(model: torch.nn.Module, features: torch.Tensor, dec: torch.Tensor) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return model(input_features=features.to(dtype), decoder_input_ids=dec).logits.double()


def forced_batch(prefix: list[int], transcripts: list[list[int]], eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder ids prefix + transcript + eos per clip, padded with eos; the mask of real positions."""
    rows = [prefix + t + [eos] for t in transcripts]
    n = max(map(len, rows))
    ids = torch.full((len(rows), n), eos)
    mask = torch.zeros(len(rows), n, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
    return ids, mask


def masked_rel_rms(ref: torch.Tensor, got: torch.Tensor, mask: torch.Tensor) -> float:
    a, b = ref[mask], got[mask]
    return float((a - b).pow(2).sum().sqrt() / a.pow(2).sum().sqrt())


def plan_signature(plan: dict) -> dict:
    """What a plan does (sites, verdicts, every edit), without its options and reason wording."""
    sig = {k: v for k, v in plan.items() if k not in ("options", "sites")}
    sig["sites"] = [(s["name"], s["verdict"], s.get("convert")) for s in plan["sites"]]
    return sig


def whisper_inputs_of(speech: Speech, n: int | None, prompt: list[int]) -> dict:
    feats = speech.batch(n)
    return {"input_features": feats, "decoder_input_ids": torch.tensor([prompt] * feats.shape[0])}


def load_original(src: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The source checkpoint as the stock class, in ``dtype`` (these checkpoints store float16:
    float32 holds those weights exactly)."""
    from transformers import WhisperForConditionalGeneration

    return WhisperForConditionalGeneration.from_pretrained(str(src), local_files_only=True, dtype=dtype).eval()


def chunked(fn: Any, feats: torch.Tensor, *rest: Any, size: int = 4) -> Any:
    """``fn`` over chunks of clips (float64 attention over 1500 frames is large), results joined."""
    parts = [fn(feats[i:i + size], *(r[i:i + size] for r in rest)) for i in range(0, feats.shape[0], size)]
    if isinstance(parts[0], list):
        return [x for part in parts for x in part]
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, 0, 0, width - p.shape[1])) if p.dim() == 3 else p
                      for p in parts])


def whisper_real_inputs(original: torch.nn.Module, out: Path, speech: Speech, forced: list[int],
                        batch: int) -> tuple[dict, torch.nn.Module]:
    """``plan`` at every (batch, prompt) users feed, ``patch`` at two of them: verdicts and edits equal to
    the CLI's; the patched models' weights against the written checkpoint's. Returns the rows and the
    model patched at a batch of clips (float32, for the error figures)."""
    import normswap

    cli_plan = json.loads((out / "config.json").read_text())["normswap"]["plan"]
    cli_sig = plan_signature(cli_plan)
    shapes = [(1, "task prefix"), (batch, "start token"), (batch, "task prefix"),
              (batch, "previous text + prefix"), (1, "prefix + transcript")]
    rows = []
    for n, which in shapes:
        prompt = forced if which == "prefix + transcript" else speech.prompts[which]
        ex = whisper_inputs_of(speech, n, prompt)
        t0 = time.perf_counter()
        plan = normswap.plan(original, example_inputs=ex)
        rows.append({"batch": int(ex["input_features"].shape[0]), "prompt": which,
                     "decoder_tokens": len(prompt), "counts": {k: v for k, v in plan.counts().items() if v},
                     "same_as_cli": plan_signature(plan.to_dict()) == cli_sig,
                     "plan_s": round(time.perf_counter() - t0, 1)})
        print(json.dumps({"plan": rows[-1]}), flush=True)
    patched, kept = [], None
    written = normswap.load(out).state_dict()
    for n, which in ((1, "task prefix"), (batch, "previous text + prefix")):
        work = copy.deepcopy(original)
        ex = whisper_inputs_of(speech, n, speech.prompts[which])
        t0 = time.perf_counter()
        report = normswap.patch(work, example_inputs=ex)
        took = round(time.perf_counter() - t0, 1)
        sd = work.state_dict()
        # the written checkpoint is the same surgery cast once to the checkpoint's dtype
        diff = max(float((sd[k].to(v.dtype).double() - v.double()).abs().max()) for k, v in written.items())
        patched.append({"batch": int(ex["input_features"].shape[0]), "prompt": which,
                        "counts": dict(Counter(s.verdict for s in report.sites)),
                        "same_as_cli": plan_signature(normswap.plan_of(work).to_dict()) == cli_sig,
                        "keys_equal": sorted(sd) == sorted(written),
                        "max_abs_diff_vs_written_after_cast": diff,
                        "verification": {k: v for k, v in report.verification.items()
                                         if k in ("max_rel_error", "top1_agreement", "kl")},
                        "patch_s": took})
        print(json.dumps({"patch": patched[-1]}), flush=True)
        kept = work
    return {"plans": rows, "patches": patched}, kept


def greedy_all(model: torch.nn.Module, feats: torch.Tensor, prompt: list[int], eos: int) -> list[list[int]]:
    return chunked(lambda f: greedy(model, f, prompt, eos), feats, size=8)


WHISPER_STAGES = ("transcripts", "real-inputs", "errors", "rounding", "keep-beta", "placement")


def patch_keeping_beta(model: torch.nn.Module, example_inputs: dict) -> None:
    """``normswap.patch`` with every norm's β kept in its RMSNorm (the analysis's ``fold_beta=False``,
    not a public option): the experiment behind the bf16 diagnosis in docs/results/field.md."""
    import normswap
    from normswap.analysis import streams

    init = streams.Analyzer.__init__

    def keep(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["fold_beta"] = False
        init(self, *args, **kwargs)

    streams.Analyzer.__init__ = keep
    try:
        normswap.patch(model, example_inputs=example_inputs)
    finally:
        streams.Analyzer.__init__ = init


def tensor_group(name: str) -> str:
    """The kind of tensor a parameter name is, for the rounding attribution."""
    stack = "encoder" if ".encoder." in f".{name}" else "decoder" if ".decoder." in f".{name}" else "head"
    leaf = name.split(".")[-2] + "." + name.split(".")[-1]
    if "embed" in name:
        return f"{stack} embeddings"
    if leaf.startswith(("out_proj.", "fc2.")):
        return f"{stack} writers ({leaf.split('.')[0]}.*: centered)"
    if leaf.startswith(("q_proj.", "k_proj.", "v_proj.", "fc1.")):
        return f"{stack} readers ({leaf.split('.')[0]}.*: β folded)"
    return f"{stack} other ({leaf})"


def rounded(model: torch.nn.Module, keys: set[str] | None = None) -> torch.nn.Module:
    """A copy whose tensors ``keys`` (all when None) hold their bfloat16-rounded values, still float32."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for k, v in m.state_dict().items():
            if v.is_floating_point() and (keys is None or k in keys):
                v.copy_(v.to(torch.bfloat16).to(v.dtype))
    return m


def rounding_attribution(original: torch.nn.Module, patched: torch.nn.Module, measure: Any) -> dict:
    """Where the bf16 error comes from: every weight rounded to bfloat16 but arithmetic in float32, then
    one group of the tensors the conversion changed rounded alone, in the converted model and (the
    same tensors) in the original."""
    out = {"all weights": {"converted": measure("rw all c rel_rms_error", rounded(patched)),
                           "original": measure("rw all o rel_rms_error", rounded(original))}}
    sd_o, sd_c = original.state_dict(), patched.state_dict()
    groups: dict[str, list[str]] = {}
    for k, v in sd_c.items():
        if k not in sd_o or not torch.equal(v, sd_o[k]):
            groups.setdefault(tensor_group(k), []).append(k)
    for g, keys in sorted(groups.items()):
        out[g] = {"tensors": len(keys),
                  "converted": measure(f"rw {g} c rel_rms_error", rounded(patched, set(keys))),
                  "original": measure(f"rw {g} o rel_rms_error", rounded(original, {k for k in keys if k in sd_o}))}
    return out


def whisper_row(name: str, src: Path, speech_dir: Path, row: dict, out: Path, clips: int, batch: int,
                stages: tuple[str, ...] = WHISPER_STAGES) -> None:
    """Everything the module docstring lists for a Whisper directory (``stages`` of it), into ``row``."""
    from transformers import AutoModelForSpeechSeq2Seq

    import normswap

    speech = Speech(src, sorted(speech_dir.glob("*.wav"))[:clips])
    row["speech"] = {"clips": speech.names, "seconds": speech.seconds}
    feats, eos, text = speech.batch(), speech.eos, speech.tok.batch_decode
    original = load_original(src)
    written = normswap.load(out).eval()  # as written: the checkpoint's dtype
    auto = AutoModelForSpeechSeq2Seq.from_pretrained(str(out), local_files_only=True).eval()
    sd_a, sd_c = auto.state_dict(), written.state_dict()
    row["reload"] = {"class": type(written).__name__, "auto_class": type(auto).__name__,
                     "dtype": str(next(written.parameters()).dtype),
                     "auto_equals_load": sorted(sd_a) == sorted(sd_c)
                     and all(torch.equal(sd_a[k], sd_c[k].to(sd_a[k].dtype)) for k in sd_c),
                     "rmsnorms": sum(isinstance(m, normswap.RMSNorm) for m in written.modules()),
                     "layernorms_left": sum(isinstance(m, torch.nn.LayerNorm) for m in written.modules())}
    del auto, sd_a, sd_c
    print(json.dumps({"model": name, "reload": row["reload"]}), flush=True)
    conv32 = copy.deepcopy(written).float()  # the written checkpoint run in float32
    t_orig = greedy_all(original, feats, speech.prefix, eos)
    if "transcripts" in stages:
        tr = {"original": text(t_orig),
              "written_equal": greedy_all(conv32, feats, speech.prefix, eos) == t_orig}
        prev = speech.prompts["previous text + prefix"]
        tr["previous_text_prompt_equal"] = (greedy_all(conv32, feats, prev, eos)
                                            == greedy_all(original, feats, prev, eos))
        # generate() as users call it (the generation config's suppression and forced prefix), one batch
        g_orig = original.generate(feats[:batch], max_new_tokens=120)
        g_conv = conv32.generate(feats[:batch], max_new_tokens=120)
        tr["generate_original"] = text(g_orig, skip_special_tokens=True)
        tr["generate_equal"] = g_orig.shape == g_conv.shape and torch.equal(g_orig, g_conv)
        row["transcripts"] = tr
        print(json.dumps({"model": name, "transcripts": tr}), flush=True)

    if "real-inputs" in stages:
        forced = speech.prefix + max(t_orig, key=len)
        row["real_inputs"], patched = whisper_real_inputs(original, out, speech, forced, batch)
    else:  # the float32 surgery for the error figures: patch at a batch of clips
        patched = copy.deepcopy(original)
        normswap.patch(patched, example_inputs=whisper_inputs_of(speech, batch, speech.prefix))
    if not {"errors", "rounding", "keep-beta", "placement"} & set(stages):
        return

    # errors against the float64 original, teacher-forced on the original's transcripts
    dec, mask = forced_batch(speech.prefix, t_orig, eos)

    def logits(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
        return chunked(lambda f, d: forced_logits(model, f if dtype is None else f.to(dtype), d), feats, dec)

    ref = logits(copy.deepcopy(original).double(), torch.float64)
    top = ref.argmax(-1)[mask]
    err: dict[str, Any] = {"positions": int(mask.sum())}

    def measure(key: str, model: torch.nn.Module) -> torch.Tensor:
        t0 = time.perf_counter()
        got = logits(model)
        err[key] = masked_rel_rms(ref, got, mask)
        err[key.replace("rel_rms_error", "top1")] = float((got.argmax(-1)[mask] == top).double().mean())
        print(json.dumps({key: err[key], "s": round(time.perf_counter() - t0, 1)}), flush=True)
        return got

    if "rounding" in stages:
        row["rounding"] = rounding_attribution(
            original, patched, lambda key, model: (measure(key, model), err.pop(key),
                                                   err.pop(key.replace("rel_rms_error", "top1"), None))[1])
        print(json.dumps({"model": name, "rounding": row["rounding"]}), flush=True)
    if "keep-beta" in stages:
        kept = copy.deepcopy(original)
        patch_keeping_beta(kept, whisper_inputs_of(speech, batch, speech.prefix))
        measure("fp32_beta_kept_rel_rms_error", kept)
        measure("bf16_original_rel_rms_error", copy.deepcopy(original).to(torch.bfloat16))
        measure("bf16_converted_rel_rms_error", copy.deepcopy(patched).to(torch.bfloat16))
        measure("bf16_beta_kept_rel_rms_error", copy.deepcopy(kept).to(torch.bfloat16))
        # the encoder's position table is centered although the centering op at the input of layer 0
        # (after the conv+GELU stem) centers the stream it is added to: restoring it stays exact
        with torch.no_grad():
            kept.model.encoder.embed_positions.weight.copy_(original.model.encoder.embed_positions.weight)
        measure("fp32_beta_kept_positions_restored_rel_rms_error", kept)
        measure("bf16_beta_kept_positions_restored_rel_rms_error", kept.to(torch.bfloat16))
        o16 = err["bf16_original_rel_rms_error"]
        err["bf16_ratio"] = err["bf16_converted_rel_rms_error"] / o16
        err["bf16_ratio_beta_kept"] = err["bf16_beta_kept_rel_rms_error"] / o16
        err["bf16_ratio_beta_kept_positions_restored"] = err["bf16_beta_kept_positions_restored_rel_rms_error"] / o16
        row["keep_beta"] = dict(err)
        print(json.dumps({"model": name, "keep_beta": row["keep_beta"]}), flush=True)
    if "placement" in stages:
        # the β placement rule (the default) against folding β wherever the readers can take it
        from normswap.analysis.plan import BETA_KEPT_WHY

        folded = copy.deepcopy(original)
        normswap.patch(folded, example_inputs=whisper_inputs_of(speech, batch, speech.prefix),
                       beta_placement="fold")
        plan = normswap.plan_of(patched)
        place: dict[str, Any] = {"norms_with_beta": sum(bool(s.beta_detail) for s in plan.sites),
                                 "beta_kept": sum(s.beta_detail.startswith(BETA_KEPT_WHY) for s in plan.sites),
                                 "writer_tensors_centered": len(plan.writer_edits)}
        for key, model in (("bf16_original", original), ("bf16_fold", folded), ("bf16_rounding", patched)):
            place[key] = masked_rel_rms(ref, logits(copy.deepcopy(model).to(torch.bfloat16)), mask)
        place["fp32_rounding"] = masked_rel_rms(ref, logits(patched), mask)
        place["bf16_ratio_fold"] = place["bf16_fold"] / place["bf16_original"]
        place["bf16_ratio_rounding"] = place["bf16_rounding"] / place["bf16_original"]
        row["placement"] = place
        print(json.dumps({"model": name, "placement": place}), flush=True)
    if "errors" not in stages:
        return
    measure("fp32_original_rel_rms_error", original)
    measure("fp32_patched_rel_rms_error", patched)  # the surgery, cast to float32
    measure("fp32_written_rel_rms_error", conv32)  # the checkpoint as written, run in float32
    del conv32
    store = next(written.parameters()).dtype
    if store != torch.float32:  # the checkpoint's own dtype, both models
        o = copy.deepcopy(original).to(store)
        measure(f"{store}_original_rel_rms_error".replace("torch.", ""), o)
        measure(f"{store}_written_rel_rms_error".replace("torch.", ""), written)
        del o
    o16m, c16m = copy.deepcopy(original).to(torch.bfloat16), copy.deepcopy(patched).to(torch.bfloat16)
    measure("bf16_original_rel_rms_error", o16m)
    measure("bf16_converted_rel_rms_error", c16m)
    err["bf16_ratio"] = err["bf16_converted_rel_rms_error"] / err["bf16_original_rel_rms_error"]
    w16 = copy.deepcopy(written).to(torch.bfloat16)
    measure("bf16_written_rel_rms_error", w16)  # the float16 checkpoint cast on to bfloat16
    del w16
    if store != torch.float32:
        key = str(store).replace("torch.", "")
        err[f"{key}_ratio"] = err[f"{key}_written_rel_rms_error"] / err[f"{key}_original_rel_rms_error"]
    b_orig = greedy_all(o16m, feats, speech.prefix, eos)
    b_conv = greedy_all(c16m, feats, speech.prefix, eos)
    err["bf16_transcripts_equal_fp32"] = {"original": b_orig == t_orig, "converted": b_conv == t_orig}
    err["bf16_converted_transcripts_equal_original_bf16"] = b_conv == b_orig
    row["errors"] = err
    print(json.dumps({"model": name, "errors": err}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+", help="NAME=DIR (a sentence-transformers directory)")
    ap.add_argument("--json", default=None, help="append one JSON object per model to this file")
    ap.add_argument("--held-out", type=int, default=200)
    ap.add_argument("--speech", default=None, help="folder of *.wav speech clips (Whisper models)")
    ap.add_argument("--clips", type=int, default=8, help="Whisper: clips used (the first N, sorted)")
    ap.add_argument("--batch", type=int, default=4, help="Whisper: the batch of several clips")
    ap.add_argument("--stages", nargs="+", default=list(WHISPER_STAGES), choices=WHISPER_STAGES,
                    help="Whisper: which measurements to run")
    ap.add_argument("--keep", default=None,
                    help="write each conversion to KEEP/NAME and keep it; an existing one is reused (no CLI run)")
    args = ap.parse_args()
    held, _ = paragraphs()
    held = held[:args.held_out]
    torch.manual_seed(0)
    for spec in args.models:
        name, _, path = spec.partition("=")
        src = Path(path)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(args.keep) / name if args.keep else Path(tmp) / "out"
            row = {"model": name, "path": str(src), "torch": torch.__version__,
                   "transformers": __import__("transformers").__version__}
            cli_json = out.parent / f"{out.name}.cli.json"
            if (out / "config.json").exists():
                first = json.loads(cli_json.read_text()) if cli_json.exists() else {}
                row["cli"] = {**first, "exit": 0, "reused": str(out), **manifest_figures(out)}
            else:
                row["cli"] = run_cli(src, out)
                if args.keep:
                    cli_json.write_text(json.dumps(row["cli"]))
            print(json.dumps({"model": name, "cli": row["cli"]}), flush=True)
            if is_whisper(src):
                if row["cli"]["exit"] == 0:
                    whisper_row(name, src, Path(args.speech), row, out, args.clips, args.batch,
                                tuple(args.stages))
            elif row["cli"]["exit"] == 0:
                row["embeddings"] = embeddings(src, out, held)
                print(json.dumps({"model": name, "embeddings": row["embeddings"]}), flush=True)
                row["errors"] = errors(src, out, held[:64])
                print(json.dumps({"model": name, "errors": row["errors"]}), flush=True)
            if not is_whisper(src):
                row["real_inputs"] = planned_on_real_inputs(src, held)
                print(json.dumps({"model": name, "real_inputs": row["real_inputs"]}), flush=True)
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
