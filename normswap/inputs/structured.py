"""Analysis inputs that are neither text, images, audio nor a series' values: what some forwards take
next to (or instead of) them, built from the config so that these models convert with no inputs.

- ``bbox``: one box per token for a document-layout model that requires them (BROS, UDOP): ``x0 ≤ x1``,
  ``y0 ≤ y1``; integer coordinates below ``max_2d_position_embeddings`` where the config has a 2-D
  position table (LayoutLM family), else fractions of the page in [0, 1].
- a Decision Transformer's trajectory: ``states`` (``state_dim``), ``actions`` (``act_dim``),
  ``rewards``, ``returns_to_go``, ``timesteps`` (below ``max_ep_len``) and its ``attention_mask``.
- ``past_values_padding`` (none padded) and ``freq`` (frequency class 0) of a TimesFM forecaster.
- ``task_inputs``: OneFormer's task prompt, ``task_seq_len`` token ids over its text vocabulary.
- ``latents``: a codec decoder's continuous latents ``(B, hidden_size, frames)`` (Mimi, Pocket-TTS).
- ``decoder_input_ids`` of a text-to-speech decoder that reads one audio code per codebook per step
  (Dia: the decoder config's ``num_channels`` codebooks), ``(B, T, codebooks)``.
- ``decoder_input_values``: hidden states for the decoder of an encoder-decoder built without its
  pre-nets (SpeechT5Model), when the encoder's ``input_values`` are hidden states too.
- entities next to the text (LUKE): ``entity_ids`` over the config's ``entity_vocab_size`` (past its
  padding, unknown and mask entities), each entity a mention of :data:`MENTION` words of the prompt in
  ``entity_position_ids`` ``(B, entities, max_mention_length)`` (``-1`` past the mention, as the model's
  tokenizer pads it), ``entity_attention_mask`` ones, and where the forward takes them the mention's first
  and last word (``entity_start_positions``, ``entity_end_positions``). The entity embeddings and their
  LayerNorm (and a masked-LM head's entity predictions) run only on entities.

Each rule fires only when the forward takes that argument; :data:`NAMES` is what the builder knows.
"""

from __future__ import annotations

from typing import Any

import torch

from normswap.inputs.media import cfg, sub_config

TRAJECTORY = ("states", "actions", "rewards", "returns_to_go", "timesteps")
ENTITY = ("entity_ids", "entity_attention_mask", "entity_position_ids", "entity_start_positions",
          "entity_end_positions")
NAMES = {"bbox", "past_values_padding", "freq", "task_inputs", "latents", "decoder_input_values", *TRAJECTORY,
         *ENTITY}
ENTITIES = 2  # entities per sample
MENTION = 2  # words each entity's mention spans


def main_inputs(config: Any, params: Any) -> bool:
    """True when these rules build a model's main input on their own (no text or media to go with it)."""
    return "latents" in params or all(n in params for n in ("states", "actions", "returns_to_go"))


def extra_inputs(config: Any, params: Any, built: dict[str, Any], batch: int, seq: int, gen: torch.Generator,
                 dtype: torch.dtype) -> dict[str, Any]:
    """The inputs of this module's kinds that ``params`` (the forward's parameters) take, sized to match
    ``built`` (the text and media inputs already built)."""
    out: dict[str, Any] = {}
    ids = built.get("input_ids")
    if "bbox" in params and isinstance(ids, torch.Tensor) and _requires(params, "bbox", config):
        out["bbox"] = _boxes(config, ids.shape[0], ids.shape[1], gen, dtype)
    if all(n in params for n in ("states", "actions", "returns_to_go")):
        out.update(_trajectory(config, batch, min(seq, 8), gen, dtype))
    past = built.get("past_values")
    if isinstance(past, torch.Tensor):
        if "past_values_padding" in params:
            out["past_values_padding"] = torch.zeros(past.shape[:2], dtype=dtype)
        if "freq" in params:
            out["freq"] = torch.zeros(past.shape[0], 1, dtype=torch.long)
    if "task_inputs" in params:
        length = _int(cfg(config, "task_seq_len")) or 77
        vocab = _int(cfg(config, "text_encoder_vocab_size", "vocab_size")) or 100
        out["task_inputs"] = torch.randint(min(3, vocab - 1), vocab, (batch, length), generator=gen)
    values = built.get("input_values")
    if "decoder_input_values" in params and isinstance(values, torch.Tensor) and values.dim() == 3 and \
            values.shape[-1] == _int(cfg(config, "hidden_size", "d_model")):
        # an encoder-decoder without pre-nets (SpeechT5Model) takes hidden states on both sides
        out["decoder_input_values"] = torch.randn(values.shape[0], 8, values.shape[-1], generator=gen).to(dtype)
    dec = built.get("decoder_input_ids")
    dcfg = sub_config(config, "decoder")
    codebooks = _int(cfg(dcfg, "num_codebooks")) or (_int(cfg(dcfg, "num_channels")) if dcfg is not config else None)
    if isinstance(dec, torch.Tensor) and dec.dim() == 2 and codebooks and codebooks > 1:
        # a text-to-speech decoder reads one id per codebook per step: (B, T, codebooks), as Dia's own
        # default start is shaped (its 2-D reshape leaves a view its embedding cannot take)
        out["decoder_input_ids"] = dec[:, :, None].repeat(1, 1, codebooks)
    if "entity_ids" in params and isinstance(ids, torch.Tensor):
        out.update({k: v for k, v in _entities(config, ids.shape[0], ids.shape[1], gen).items() if k in params})
    if "latents" in params:
        width = _int(cfg(config, "hidden_size", "latent_dim", "codebook_dim")) or 32
        out["latents"] = torch.randn(batch, width, 16, generator=gen).to(dtype)
    return out


def _entities(config: Any, batch: int, words: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """:data:`ENTITIES` entities per sample, each a mention of :data:`MENTION` consecutive words of a
    ``words``-long prompt (the first at word 1, after the start token; the next after it, wrapping round
    a short prompt), at the model's word positions (RoBERTa-style: counted from ``pad_token_id + 1``)."""
    vocab = _int(cfg(config, "entity_vocab_size")) or 3
    ids = torch.randint(min(3, vocab - 1), vocab, (batch, ENTITIES), generator=gen)
    longest = _int(cfg(config, "max_mention_length")) or MENTION
    span = max(1, min(MENTION, longest, words - 1))
    first = torch.tensor([(1 + e * span) % max(1, words - span) for e in range(ENTITIES)])
    pad = cfg(config, "pad_token_id")
    offset = pad + 1 if isinstance(pad, int) and not isinstance(pad, bool) and pad >= 0 else 0
    positions = torch.full((batch, ENTITIES, longest), -1, dtype=torch.long)
    positions[:, :, :span] = (first[:, None] + torch.arange(span) + offset).clamp(
        max=(_int(cfg(config, "max_position_embeddings")) or 512) - 1)
    return {"entity_ids": ids, "entity_attention_mask": torch.ones(batch, ENTITIES, dtype=torch.long),
            "entity_position_ids": positions,
            "entity_start_positions": first.expand(batch, -1).clone(),
            "entity_end_positions": (first + span - 1).expand(batch, -1).clone()}


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _requires(params: Any, name: str, config: Any) -> bool:
    """``bbox`` is built where the forward cannot do without it (no default, or a model that raises
    without it: BROS's embeddings are the boxes)."""
    import inspect

    p = params[name]
    return p.default is inspect.Parameter.empty or cfg(config, "dim_bbox") is not None or _box_biases(config)


def _box_biases(config: Any) -> bool:
    """UDOP: attention biases over box coordinates (``relative_bias_args`` of type horizontal/vertical),
    which raise without boxes; its boxes are fractions of the page."""
    kinds = cfg(config, "relative_bias_args") or []
    return any(isinstance(k, dict) and k.get("type") in ("horizontal", "vertical") for k in kinds)


def _boxes(config: Any, batch: int, tokens: int, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    corners = torch.rand(batch, tokens, 2, 2, generator=gen, dtype=torch.float64)
    low, high = corners.min(dim=2).values, corners.max(dim=2).values
    boxes = torch.cat([low, high], dim=-1)  # x0, y0, x1, y1
    limit = _int(cfg(config, "max_2d_position_embeddings"))
    if limit and not _box_biases(config):
        return (boxes * (limit - 1)).long()
    return boxes.to(dtype)


def _trajectory(config: Any, batch: int, steps: int, gen: torch.Generator, dtype: torch.dtype) -> dict[str, Any]:
    state, act = _int(cfg(config, "state_dim")) or 1, _int(cfg(config, "act_dim")) or 1
    episode = _int(cfg(config, "max_ep_len")) or steps
    start = torch.randint(0, max(1, episode - steps), (batch, 1), generator=gen)
    return {"states": torch.randn(batch, steps, state, generator=gen).to(dtype),
            "actions": torch.randn(batch, steps, act, generator=gen).to(dtype),
            "rewards": torch.randn(batch, steps, 1, generator=gen).to(dtype),
            "returns_to_go": torch.randn(batch, steps, 1, generator=gen).to(dtype),
            "timesteps": (start + torch.arange(steps)).clamp(max=max(0, episode - 1)),
            "attention_mask": torch.ones(batch, steps, dtype=torch.long)}
