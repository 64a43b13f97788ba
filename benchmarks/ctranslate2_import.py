"""Turn a CTranslate2 Whisper model (``model.bin``) into a Hugging Face ``WhisperForConditionalGeneration`` directory.

Why this exists: the machines these benchmarks run on reach package registries only, and the real
Pre-LN checkpoints the package index holds are Whisper models packaged for faster-whisper (tiny.en,
base, small). Their weights are OpenAI's, stored in CTranslate2's own binary format, not pickled. This
script reads that format directly and writes a stock transformers directory (``model.safetensors``,
``config.json``, ``generation_config.json``, feature extractor and tokenizer), which ``normswap convert``
and the benchmarks then take like any downloaded checkpoint.

The format (CTranslate2's ``Model::load``, binary version 6): ``uint32`` version, the spec name and its
revision, then ``uint32`` count of variables, each one a name (``uint16`` length, bytes with a final NUL),
``uint8`` rank, ``uint32`` dims, ``uint8`` dtype, ``uint32`` byte count and the raw little-endian data;
then aliases (name, target). Quantized weights (int8 / int16) come with a ``weight_scale`` per output
row and are dequantized here, which is the model those packages actually run.

    python benchmarks/ctranslate2_import.py SRC_DIR_WITH_MODEL_BIN OUT_DIR [--name whisper-base]
"""

from __future__ import annotations

import argparse
import json
import re
import struct
from pathlib import Path
from typing import BinaryIO

import torch

# CTranslate2's DataType enum, in its order.
_DTYPES = {0: torch.float32, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.float16, 5: torch.bfloat16}


def read_ctranslate2(path: Path) -> tuple[str, dict[str, torch.Tensor]]:
    """The spec name and every variable (aliases resolved) of a CTranslate2 ``model.bin``."""
    with path.open("rb") as f:
        def unpack(fmt: str) -> tuple:
            return struct.unpack("<" + fmt, f.read(struct.calcsize(fmt)))

        def string(stream: BinaryIO = f) -> str:
            (n,) = unpack("H")
            return stream.read(n)[:-1].decode()

        (version,) = unpack("I")
        if version < 5:
            raise SystemExit(f"{path}: CTranslate2 binary version {version} is older than this reader (5+)")
        spec = string()
        unpack("I")  # spec revision
        (count,) = unpack("I")
        variables: dict[str, torch.Tensor] = {}
        for _ in range(count):
            name = string()
            (rank,) = unpack("B")
            dims = unpack("I" * rank) if rank else ()
            (code,) = unpack("B")
            (nbytes,) = unpack("I")
            raw = bytearray(f.read(nbytes))
            variables[name] = torch.frombuffer(raw, dtype=_DTYPES[code]).reshape(dims).clone()
        (aliases,) = unpack("I")
        for _ in range(aliases):
            alias, target = string(), string()
            variables[alias] = variables[target]
    return spec, variables


def _dequantized(variables: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    value = variables[name]
    if value.dtype in (torch.int8, torch.int16) and name.endswith("/weight"):
        scale = variables[name[: -len("weight")] + "weight_scale"].float()
        return value.float() / scale.reshape(-1, *([1] * (value.dim() - 1)))
    return value


def _linear(out: dict, hf: str, v: dict, ct: str, dtype: torch.dtype, rows: slice | None = None,
            bias: bool = True) -> None:
    w = _dequantized(v, f"{ct}/weight")
    b = v.get(f"{ct}/bias")
    if rows is not None:
        w = w[rows]
        b = None if b is None else b[rows]
    out[f"{hf}.weight"] = w.to(dtype)
    if bias:
        out[f"{hf}.bias"] = (b if b is not None else torch.zeros(w.shape[0])).to(dtype)
    elif b is not None and b.abs().max() > 0:
        raise SystemExit(f"{ct}: a nonzero bias where Whisper has none (key projection)")


def _norm(out: dict, hf: str, v: dict, ct: str, dtype: torch.dtype) -> None:
    out[f"{hf}.weight"] = v[f"{ct}/gamma"].to(dtype)
    out[f"{hf}.bias"] = v[f"{ct}/beta"].to(dtype)


def _attention(out: dict, hf: str, v: dict, ct: str, d: int, dtype: torch.dtype, cross: bool) -> None:
    _norm(out, f"{hf}_layer_norm", v, f"{ct}/layer_norm", dtype)
    if cross:  # linear_0 = query, linear_1 = key and value, linear_2 = output
        _linear(out, f"{hf}.q_proj", v, f"{ct}/linear_0", dtype)
        _linear(out, f"{hf}.k_proj", v, f"{ct}/linear_1", dtype, slice(0, d), bias=False)
        _linear(out, f"{hf}.v_proj", v, f"{ct}/linear_1", dtype, slice(d, 2 * d))
        _linear(out, f"{hf}.out_proj", v, f"{ct}/linear_2", dtype)
    else:  # linear_0 = query, key and value, linear_1 = output
        _linear(out, f"{hf}.q_proj", v, f"{ct}/linear_0", dtype, slice(0, d))
        _linear(out, f"{hf}.k_proj", v, f"{ct}/linear_0", dtype, slice(d, 2 * d), bias=False)
        _linear(out, f"{hf}.v_proj", v, f"{ct}/linear_0", dtype, slice(2 * d, 3 * d))
        _linear(out, f"{hf}.out_proj", v, f"{ct}/linear_1", dtype)


def _layer_count(v: dict, side: str) -> int:
    found = {int(m.group(1)) for k in v if (m := re.match(rf"{side}/layer_(\d+)/", k))}
    return max(found) + 1


def whisper_state_dict(v: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
    """Hugging Face tensor names and the ``WhisperConfig`` fields, from CTranslate2 Whisper variables."""
    emb = v["decoder/embeddings/weight"]
    dtype = emb.dtype if emb.is_floating_point() else torch.float32
    vocab, d = emb.shape
    enc_layers, dec_layers = _layer_count(v, "encoder"), _layer_count(v, "decoder")
    out: dict[str, torch.Tensor] = {}
    for i in (1, 2):
        out[f"model.encoder.conv{i}.weight"] = _dequantized(v, f"encoder/conv{i}/weight").to(dtype)
        out[f"model.encoder.conv{i}.bias"] = v[f"encoder/conv{i}/bias"].to(dtype)
    out["model.encoder.embed_positions.weight"] = v["encoder/position_encodings/encodings"].to(dtype)
    for i in range(enc_layers):
        ct, hf = f"encoder/layer_{i}", f"model.encoder.layers.{i}"
        _attention(out, f"{hf}.self_attn", v, f"{ct}/self_attention", d, dtype, cross=False)
        _norm(out, f"{hf}.final_layer_norm", v, f"{ct}/ffn/layer_norm", dtype)
        _linear(out, f"{hf}.fc1", v, f"{ct}/ffn/linear_0", dtype)
        _linear(out, f"{hf}.fc2", v, f"{ct}/ffn/linear_1", dtype)
    _norm(out, "model.encoder.layer_norm", v, "encoder/layer_norm", dtype)
    out["model.decoder.embed_tokens.weight"] = emb.to(dtype)
    out["model.decoder.embed_positions.weight"] = v["decoder/position_encodings/encodings"].to(dtype)
    for i in range(dec_layers):
        ct, hf = f"decoder/layer_{i}", f"model.decoder.layers.{i}"
        _attention(out, f"{hf}.self_attn", v, f"{ct}/self_attention", d, dtype, cross=False)
        _attention(out, f"{hf}.encoder_attn", v, f"{ct}/attention", d, dtype, cross=True)
        _norm(out, f"{hf}.final_layer_norm", v, f"{ct}/ffn/layer_norm", dtype)
        _linear(out, f"{hf}.fc1", v, f"{ct}/ffn/linear_0", dtype)
        _linear(out, f"{hf}.fc2", v, f"{ct}/ffn/linear_1", dtype)
    _norm(out, "model.decoder.layer_norm", v, "decoder/layer_norm", dtype)
    heads = int(v["encoder/num_heads"])
    config = {
        "vocab_size": vocab, "d_model": d, "num_mel_bins": v["encoder/conv1/weight"].shape[1],
        "encoder_layers": enc_layers, "decoder_layers": dec_layers,
        "encoder_attention_heads": heads, "decoder_attention_heads": int(v["decoder/num_heads"]),
        "encoder_ffn_dim": v["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        "decoder_ffn_dim": v["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        "max_source_positions": v["encoder/position_encodings/encodings"].shape[0],
        "max_target_positions": v["decoder/position_encodings/encodings"].shape[0],
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    return out, config


def convert(src: Path, out_dir: Path) -> Path:
    """Write ``out_dir`` as a transformers Whisper directory from the CTranslate2 model in ``src``."""
    from safetensors.torch import save_file
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperTokenizerFast,
    )

    spec, variables = read_ctranslate2(src / "model.bin")
    if spec != "WhisperSpec":
        raise SystemExit(f"{src}: a {spec} model; this importer reads Whisper models only")
    state, fields = whisper_state_dict(variables)
    tokenizer = WhisperTokenizerFast(tokenizer_file=str(src / "tokenizer.json"))
    english_only = fields["vocab_size"] < 51865
    special = {t: tokenizer.convert_tokens_to_ids(t) for t in
               ("<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>", "<|transcribe|>", "<|translate|>")}
    eot, sot = special["<|endoftext|>"], special["<|startoftranscript|>"]
    config = WhisperConfig(**fields, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
                           decoder_start_token_id=sot, tie_word_embeddings=True)
    with torch.device("meta"):
        model = WhisperForConditionalGeneration(config)
    expected = {k for k in model.state_dict() if k != "proj_out.weight"}
    if set(state) != expected:
        raise SystemExit(f"tensor names differ: missing {sorted(expected - set(state))[:5]}, "
                         f"extra {sorted(set(state) - expected)[:5]}")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: t.contiguous() for k, t in state.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    generation = GenerationConfig(
        decoder_start_token_id=sot, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot,
        max_length=config.max_target_positions, no_timestamps_token_id=special["<|notimestamps|>"],
        is_multilingual=not english_only,
    )
    if not english_only:  # what generate(language=..., task=...) looks the prompt tokens up in
        ids = json.loads((src / "config.json").read_text())["lang_ids"]
        generation.lang_to_id = {tokenizer.convert_ids_to_tokens(i): i for i in ids}
        generation.task_to_id = {"transcribe": special["<|transcribe|>"], "translate": special["<|translate|>"]}
    generation.save_pretrained(out_dir)
    WhisperFeatureExtractor(feature_size=config.num_mel_bins).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="directory holding model.bin and tokenizer.json")
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    out = convert(args.src, args.out)
    print(json.dumps({"out": str(out), **json.loads((out / "config.json").read_text())}, default=str)[:400])


if __name__ == "__main__":
    main()
