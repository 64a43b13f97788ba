"""Inputs from files on the command line: ``--example-inputs FILE.safetensors`` (named tensors, checked
against the forward signature) and ``--sample PATH`` (the model's own processor on a text file, an image or
a WAV clip), for ``convert``, ``inspect`` and ``verify``; bad files get one line and exit 2."""

from __future__ import annotations

import json
import math
import struct
import wave
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import normswap
from normswap import presets
from normswap.cli import main
from normswap.errors import UsageError
from normswap.inputs import from_file


def cli(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return res.exit_code, res.stdout, res.stderr


def _ids_file(path: Path, **extra: torch.Tensor) -> Path:
    gen = torch.Generator().manual_seed(1)
    save_file({"input_ids": torch.randint(3, 200, (2, 11), generator=gen),
               "attention_mask": torch.ones(2, 11, dtype=torch.long), **extra}, str(path))
    return path


def _wav(path: Path, width: int = 2, rate: int = 16000, seconds: float = 0.25) -> Path:
    n = int(rate * seconds)
    values = [0.5 * math.sin(2 * math.pi * 220 * i / rate) for i in range(n)]
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(width)
        w.setframerate(rate)
        if width == 2:
            w.writeframes(b"".join(struct.pack("<h", round(v * 32767)) for v in values))
        elif width == 1:
            w.writeframes(bytes(round(v * 127) + 128 for v in values))
        else:  # 24-bit
            w.writeframes(b"".join(round(v * 8388607).to_bytes(3, "little", signed=True) for v in values))
    return path


def test_convert_runs_the_analysis_on_the_file_and_verifies_on_it_redrawn(tmp_path):
    """Fails if the file were ignored: the analysis inputs have the file's shape, and the verification says
    it ran on those inputs redrawn (input_ids) with the mask kept."""
    file = _ids_file(tmp_path / "inputs.safetensors")
    code, out, err = cli("convert", "tiny-gpt2", "--out", tmp_path / "out", "-q", "--example-inputs", file)
    assert code == 0, err
    assert "verified on: the example inputs redrawn from seed" in out
    assert "input_ids redrawn; attention_mask kept as given" in out
    manifest = json.loads((tmp_path / "out" / "config.json").read_text())["normswap"]
    assert manifest["verification"]["max_rel_error"] < 1e-9

    code, out, err = cli("verify", "tiny-gpt2", tmp_path / "out", "--example-inputs", file)
    assert code == 0, err
    assert "inputs: the example inputs given, then the example inputs redrawn from seed" in out


def test_the_python_api_takes_the_same_inputs(tmp_path):
    file = _ids_file(tmp_path / "inputs.safetensors")
    given = from_file.from_safetensors(file)
    report = normswap.convert("tiny-gpt2", tmp_path / "out", example_inputs=given)
    assert report.verification["probe"].startswith("the example inputs redrawn")
    model, _ = presets.build("tiny-gpt2")
    assert set(given(model, None)) == {"input_ids", "attention_mask", "use_cache"}


@pytest.mark.parametrize("make, words", [
    (lambda p: _ids_file(p, bogus=torch.ones(2)), "GPT2LMHeadModel.forward takes no input named 'bogus'"),
    (lambda p: p.write_bytes(b"not a safetensors file") and p, "is not a readable safetensors file"),
    (lambda p: p, "no such file"),
])
def test_a_bad_inputs_file_is_one_line_and_exit_2(tmp_path, make, words):
    file = make(tmp_path / "inputs.safetensors")
    code, _, err = cli("convert", "tiny-gpt2", "--out", tmp_path / "out", "-q", "--example-inputs", file)
    assert code == 2 and words in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
    code, _, err = cli("inspect", "tiny-gpt2", "--example-inputs", file)
    assert code == 2 and words in err, err


def test_a_required_input_missing_from_the_file_is_named():
    class Needs(torch.nn.Module):
        def forward(self, x, lengths, scale=1.0):  # noqa: ANN001, ANN201
            return x

    with pytest.raises(UsageError, match="requires 'lengths', which the file does not hold"):
        from_file.check_names(Needs(), {"x": torch.ones(1)}, "--example-inputs f")


def test_a_text_sample_goes_through_the_model_tokenizer(tmp_path):
    text = tmp_path / "prompt.txt"
    text.write_text("The river rose after three days of rain, and the old bridge held.")
    model, tok = presets.build("tiny-gpt2")
    built = from_file.from_samples([text])(model, tok)
    assert built["input_ids"].tolist() == [tok(text.read_text().strip())["input_ids"]]
    code, out, err = cli("inspect", "tiny-gpt2", "--sample", text)
    assert code == 0, err
    assert "5 exact" in out


def test_an_image_sample_goes_through_the_image_processor(tmp_path):
    from PIL import Image

    gen = torch.Generator().manual_seed(0)
    pixels = (torch.rand(40, 48, 3, generator=gen) * 255).to(torch.uint8).numpy()
    Image.fromarray(pixels).save(tmp_path / "cat.png")
    model, proc = presets.build("tiny-vit")
    built = from_file.from_samples([tmp_path / "cat.png"])(model, proc)
    size = model.config.image_size
    assert built["pixel_values"].shape == (1, 3, size, size)
    code, out, err = cli("inspect", "tiny-vit", "--sample", tmp_path / "cat.png")
    assert code == 0, err
    code, _, err = cli("inspect", "tiny-gpt2", "--sample", tmp_path / "cat.png")
    assert code == 2 and "could not encode it" in err, err


@pytest.mark.parametrize("width", [1, 2, 3])
def test_a_wav_sample_is_read_without_extra_packages_and_goes_through_the_feature_extractor(tmp_path, width):
    clip = _wav(tmp_path / "clip.wav", width=width, rate=8000)
    waveform, rate = from_file.read_audio(clip)
    assert rate == 8000 and waveform.shape == (2000,)
    assert abs(float(waveform.abs().max()) - 0.5) < 0.02  # scaled to [-1, 1] whatever the sample width
    model, proc = presets.build("tiny-whisper")
    built = from_file.from_samples([clip])(model, proc)  # resampled to the extractor's 16 kHz
    assert built["input_features"].shape[:2] == (1, model.config.num_mel_bins)
    assert built["decoder_input_ids"].tolist() == [[model.config.decoder_start_token_id]]
    code, out, err = cli("inspect", "tiny-whisper", "--sample", clip)
    assert code == 0, err


def test_unreadable_samples_and_conflicting_options_exit_2(tmp_path):
    (tmp_path / "broken.wav").write_bytes(b"RIFF nonsense")
    code, _, err = cli("inspect", "tiny-whisper", "--sample", tmp_path / "broken.wav")
    assert code == 2 and "is not a readable WAV file" in err, err
    (tmp_path / "broken.png").write_bytes(b"\x89PNG nonsense")
    code, _, err = cli("inspect", "tiny-vit", "--sample", tmp_path / "broken.png")
    assert code == 2 and "is not a readable image" in err, err
    (tmp_path / "empty.txt").write_text("  \n")
    code, _, err = cli("inspect", "tiny-gpt2", "--sample", tmp_path / "empty.txt")
    assert code == 2 and "is empty" in err, err
    file = _ids_file(tmp_path / "inputs.safetensors")
    code, _, err = cli("inspect", "tiny-gpt2", "--sample", tmp_path / "empty.txt", "--example-inputs", file)
    assert code == 2 and "pass one of them" in err, err


def test_a_text_sample_longer_than_the_model_positions_is_cut_to_them(tmp_path):
    """Fails without the cut: a whole text file read as one sequence (40 lines) has more tokens than the
    tiny GPT-2 has positions, and the conversion died on an index error ("internal error", exit 1)."""
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"sentence {i} about the quick brown fox and the lazy dog\n" for i in range(40)))
    model, tok = presets.build("tiny-gpt2")
    assert len(tok(text.read_text())["input_ids"]) > model.config.n_positions
    built = from_file.from_samples([text])(model, tok)
    assert built["input_ids"].shape == (1, model.config.n_positions)
    code, out, err = cli("convert", "tiny-gpt2", "--out", tmp_path / "out", "-q", "--sample", text)
    assert code == 0, err
    assert "wrote native checkpoint" in out


def test_a_text_sample_for_a_directory_without_tokenizer_files_is_one_line_and_exit_2(tmp_path):
    """Fails without the fix: transformers 5 builds a tokenizer of special tokens alone from a config.json
    with no tokenizer files; the sample became an empty input_ids and the model failed on it ("internal
    error", exit 1). Now that tokenizer counts as none, and nothing is written."""
    model, _ = presets.build("tiny-gpt2")
    model.save_pretrained(tmp_path / "model")  # weights and config only
    text = tmp_path / "prompt.txt"
    text.write_text("The river rose after three days of rain.")
    code, _, err = cli("convert", tmp_path / "model", "--out", tmp_path / "out", "-q", "--sample", text)
    assert code == 2, err
    assert "no processor or tokenizer was found" in err and "--example-inputs" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_a_processor_that_makes_empty_tensors_is_refused_by_name():
    """Fails without the check: an empty ``input_ids`` went on to the model."""

    class Empty:
        def encode(self, text):
            return []

        def __call__(self, text, return_tensors=None, **kwargs):
            return {"input_ids": torch.zeros(1, 0, dtype=torch.long), "attention_mask": torch.zeros(1, 0)}

    with pytest.raises(UsageError, match="made an empty attention_mask, input_ids of it"):
        from_file._encode(Empty(), {"text": "some words"}, "--sample p.txt")


def test_samples_of_two_kinds_for_a_processor_of_one_part_say_so(tmp_path):
    """Fails without the check: a text and an audio sample for Whisper's feature extractor alone went
    through it together and came back as "could not encode it (TypeError: ... missing ... 'raw_speech')"."""
    clip = _wav(tmp_path / "clip.wav")
    text = tmp_path / "prompt.txt"
    text.write_text("The river rose after three days of rain.")
    model, proc = presets.build("tiny-whisper")
    with pytest.raises(UsageError, match=r"\(WhisperFeatureExtractor\) takes one kind of sample, not audio and "
                                         r"text together; pass only the samples it takes"):
        from_file.from_samples([clip, text])(model, proc)
