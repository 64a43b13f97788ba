"""Spoken English clips for the speech benchmarks, made offline with espeak-ng.

Speech models need real speech to show their real activations: random log-mel features exercise none of
the paths a transcription does. With no dataset download on these machines, this script speaks the
English paragraphs the text benchmarks already use (Python's reference docs, split into sentences) with
the ``espeak-ng`` synthesizer (a Debian package: ``apt-get install espeak-ng``), at 16 kHz, several voices
and speeds, and writes ``NNN.wav`` plus ``transcripts.json`` (file name → the sentence spoken).

    python benchmarks/speech_samples.py OUT_DIR [--count 24]
    python benchmarks/speech_samples.py OUT_DIR2 --respeak OUT_DIR   # same sentences, other voices
    python benchmarks/speech_samples.py OUT_DIR3 --respeak OUT_DIR --shift 1   # and others again

``load_clips(OUT_DIR)`` gives back the waveforms (float32, 16 kHz) and their transcripts.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_recovery import paragraphs  # noqa: E402

VOICES = ("en-us", "en", "en-us+f3", "en+m3", "en-us+f4")


def sentences(count: int) -> list[str]:
    """``count`` English sentences of 6 to 30 words from the shipped paragraphs."""
    found: list[str] = []
    held_out, _ = paragraphs()
    for text in held_out:
        for s in re.split(r"(?<=[.!?])\s+", text):
            if re.search(r"[^A-Za-z ,.'-]", s):  # prose only: code and symbols are not read aloud alike
                continue
            s = s.strip()
            if 6 <= len(s.split()) <= 30 and s not in found:
                found.append(s)
            if len(found) == count:
                return found
    return found


def make(out: Path, count: int) -> list[Path]:
    """Speak ``count`` sentences into ``out``; returns the WAV paths."""
    if shutil.which("espeak-ng") is None:
        raise SystemExit("espeak-ng is not installed (Debian: apt-get install espeak-ng)")
    return _speak(out, sentences(count), lambda i: (VOICES[i % len(VOICES)], 150 + 15 * (i % 4)))


def respeak(src: Path, out: Path, shift: int = 0) -> list[Path]:
    """The sentences of clip set ``src`` spoken again with other voices and speeds (more clips, same text).

    ``shift`` moves every clip to the next voice and speed again, so shifts 0-2 give three more sets whose
    clip ``i`` differs in voice from ``make``'s and from each other (speeds 125-205 words a minute)."""
    texts = [text for _, text in sorted(json.loads((src / "transcripts.json").read_text()).items())]
    return _speak(out, texts, lambda i: (VOICES[(i + 2 + shift) % len(VOICES)],
                                         135 + 20 * ((i + 1 + shift) % 4) - 10 * (shift % 2)))


def _speak(out: Path, texts: list[str], voice_and_speed) -> list[Path]:  # noqa: ANN001
    """Clip ``i`` of ``out`` is ``texts[i]`` spoken by espeak-ng with ``voice_and_speed(i)``, at 16 kHz;
    ``transcripts.json`` maps each clip to its text."""
    out.mkdir(parents=True, exist_ok=True)
    transcripts, paths = {}, []
    for i, text in enumerate(texts):
        path, raw = out / f"{i:03d}.wav", out / f"{i:03d}.22k.wav"
        voice, speed = voice_and_speed(i)
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(raw), text], check=True)
        _resample_to_16k(raw, path)
        raw.unlink()
        transcripts[path.name] = text
        paths.append(path)
    (out / "transcripts.json").write_text(json.dumps(transcripts, indent=1))
    return paths


def _read_wav(path: Path) -> tuple[torch.Tensor, int]:
    with wave.open(str(path)) as w:
        rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
        frames = w.readframes(w.getnframes())
    if width != 2:
        raise SystemExit(f"{path}: {8 * width}-bit samples; expected 16-bit PCM")
    audio = torch.frombuffer(bytearray(frames), dtype=torch.int16).float() / 32768.0
    return audio.reshape(-1, channels).mean(1), rate


def _resample_to_16k(src: Path, dst: Path) -> None:
    audio, rate = _read_wav(src)
    if rate != 16000:
        n = round(audio.numel() * 16000 / rate)
        audio = torch.nn.functional.interpolate(audio[None, None], size=n, mode="linear",
                                                align_corners=False)[0, 0]
    pcm = (audio.clamp(-1, 1) * 32767).round().to(torch.int16)
    with wave.open(str(dst), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.numpy().tobytes())


def load_clips(directory: Path) -> list[tuple[torch.Tensor, str]]:
    """(16 kHz float waveform, transcript) for every clip ``make`` wrote in ``directory``."""
    transcripts = json.loads((Path(directory) / "transcripts.json").read_text())
    return [(_read_wav(Path(directory) / name)[0], text) for name, text in sorted(transcripts.items())]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--count", type=int, default=24)
    ap.add_argument("--respeak", type=Path, metavar="SRC", help="re-speak clip set SRC's sentences instead")
    ap.add_argument("--shift", type=int, default=0, help="with --respeak: another voice and speed per clip")
    args = ap.parse_args(argv)
    paths = respeak(args.respeak, args.out, args.shift) if args.respeak else make(args.out, args.count)
    print(f"{len(paths)} clips in {args.out}")


if __name__ == "__main__":
    main()
