"""Synthetic speech: what speech models are analysed, calibrated and verified on when no audio is given.

White noise is no speech. A speech encoder's activations on Gaussian log-mel features (or Gaussian
samples) are not the ones it shows on voices, so errors measured on them say little about a user's
audio. These generators build speech-like sound from first principles, offline and deterministically:

* voiced syllables: a harmonic source at a gliding pitch (90-240 Hz), shaped by three vowel formants
  (F1 300-850 Hz, F2 900-2300 Hz, F3 2300-3000 Hz) and a smooth syllable envelope;
* unvoiced consonants: short bursts of high-passed noise before some syllables;
* pauses between words, and silence after the utterance (as a short clip padded to the model's
  window, which is how Whisper-style models see most real inputs).

:func:`speech_features` turns waveforms into log-mel features the way Whisper's feature extractor
does (25 ms Hann windows, 10 ms hop, Slaney mel filters, log10, an 8-decade floor below the loudest
bin, scaled by ``(x + 4) / 4``), so ``input_features`` models see values in their trained range.
"""

from __future__ import annotations

import math

import torch

SAMPLE_RATE = 16000
_N_FFT, _HOP = 400, 160

GENERATED_SPEECH = "generated speech (formant-shaped voiced syllables, noise consonants, pauses)"


def generated_speech(batch: int, samples: int, gen: torch.Generator) -> torch.Tensor:
    """``(batch, samples)`` float64 waveforms at 16 kHz, peak-normalised speech followed by silence.

    Clips last 60-100% of ``samples`` when that is under 2 s; otherwise 2-8 s."""
    out = torch.zeros(batch, samples, dtype=torch.float64)
    for b in range(batch):
        short = samples < 2 * SAMPLE_RATE
        span = int(samples * _uniform(gen, 0.6, 1.0)) if short else int(
            min(samples, SAMPLE_RATE * _uniform(gen, 2.0, 8.0)))
        pos = 0
        while pos < span:
            pos += _syllable(out[b], pos, span, gen)
            pause = _uniform(gen, 0.3, 0.6) if _uniform(gen, 0, 1) < 0.15 else _uniform(gen, 0.02, 0.12)
            pos += int(pause * SAMPLE_RATE)
        peak = out[b].abs().max()
        if peak > 0:
            out[b] *= _uniform(gen, 0.3, 0.9) / peak
    return out


def _uniform(gen: torch.Generator, low: float, high: float) -> float:
    return low + (high - low) * float(torch.rand((), generator=gen, dtype=torch.float64))


def _syllable(wave: torch.Tensor, start: int, end: int, gen: torch.Generator) -> int:
    """Write one syllable (an optional noise consonant, then a voiced vowel) at ``start``; its length."""
    pos = start
    if _uniform(gen, 0, 1) < 0.35:  # an unvoiced consonant: high-passed noise
        n = min(int(_uniform(gen, 0.04, 0.1) * SAMPLE_RATE), end - pos)
        if n > 2:
            noise = torch.randn(n + 1, generator=gen, dtype=torch.float64).diff()
            wave[pos:pos + n] += 0.15 * noise * torch.hann_window(n, periodic=False, dtype=torch.float64)
            pos += n
    n = min(int(_uniform(gen, 0.12, 0.3) * SAMPLE_RATE), end - pos)
    if n <= 2:
        return max(pos - start, 1)
    t = torch.arange(n, dtype=torch.float64) / SAMPLE_RATE
    f0_start, glide = _uniform(gen, 90.0, 240.0), _uniform(gen, 0.85, 1.15)
    f0 = f0_start * (1 + (glide - 1) * t / t[-1]) * (1 + 0.02 * torch.sin(2 * math.pi * 5.0 * t))
    phase = 2 * math.pi * torch.cumsum(f0, 0) / SAMPLE_RATE
    formants = torch.tensor([_uniform(gen, 300, 850), _uniform(gen, 900, 2300), _uniform(gen, 2300, 3000)],
                            dtype=torch.float64)
    widths = torch.tensor([90.0, 120.0, 180.0], dtype=torch.float64)
    harmonics = torch.arange(1, int(7000 / f0_start) + 1, dtype=torch.float64)
    freq = harmonics[:, None] * f0_start * glide ** 0.5  # the formant gain at the syllable's mean pitch
    gain = (torch.exp(-0.5 * ((freq - formants) / widths) ** 2) / torch.arange(1, 4)).sum(1) + 0.01 / harmonics
    voiced = (gain[:, None] * torch.sin(harmonics[:, None] * phase)).sum(0)
    wave[pos:pos + n] += voiced * torch.sin(math.pi * t / t[-1]).clamp(min=0).sqrt()
    return pos + n - start


def speech_features(waves: torch.Tensor, mels: int, frames: int) -> torch.Tensor:
    """Whisper-style log-mel features ``(batch, mels, frames)`` of 16 kHz ``waves``, float64."""
    from transformers.audio_utils import mel_filter_bank

    need = frames * _HOP
    waves = torch.nn.functional.pad(waves, (0, max(0, need - waves.shape[-1])))[..., :need]
    spec = torch.stft(waves, _N_FFT, _HOP, window=torch.hann_window(_N_FFT, dtype=waves.dtype),
                      return_complex=True)[..., :frames].abs() ** 2
    filters = torch.from_numpy(mel_filter_bank(num_frequency_bins=1 + _N_FFT // 2, num_mel_filters=mels,
                                               min_frequency=0.0, max_frequency=8000.0,
                                               sampling_rate=SAMPLE_RATE, norm="slaney", mel_scale="slaney"))
    logmel = torch.clamp(filters.T.to(spec.dtype) @ spec, min=1e-10).log10()
    logmel = torch.maximum(logmel, logmel.amax(dim=(-2, -1), keepdim=True) - 8.0)
    return (logmel + 4.0) / 4.0


def normalised(waves: torch.Tensor) -> torch.Tensor:
    """Waveforms as wav2vec2-style extractors give them: zero mean, unit variance per clip."""
    return (waves - waves.mean(-1, keepdim=True)) / (waves.var(-1, keepdim=True) + 1e-7).sqrt()
