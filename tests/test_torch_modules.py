"""PyTorch's own transformer modules, and Linear maps that custom code applies to parameters itself.

``nn.MultiheadAttention`` calls its projections functionally (``F.linear`` on ``in_proj_weight`` and
on ``out_proj.weight``, never ``out_proj(...)``), so these models test that writers and readers are
found from the traced ops that use a parameter, not from module calls. Every norm of a Pre-LN model
built from them is exact (float64, randomised LayerNorm parameters, compared with the original).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normswap
from normswap.integrations.torch_transformer import FUSED_WHY

D, HEADS, VOCAB = 32, 4, 50


def _randomise_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            with torch.no_grad():
                if m.weight is not None:
                    m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=gen))
                if m.bias is not None:
                    m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=gen))
    return model


def _first(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _patch_and_compare(model: nn.Module, inputs: tuple, **options: object) -> tuple[normswap.Report, float]:
    """Patch a float64 copy on ``inputs``; the largest output difference from the original, on them."""
    original = copy.deepcopy(model)
    with torch.no_grad():
        reference = _first(original(*inputs))
    report = normswap.patch(model, example_inputs=inputs, **options)
    with torch.no_grad():
        out = _first(model(*inputs))
    return report, float((out - reference).abs().max() / reference.abs().max())


class EncoderLM(nn.Module):
    """``nn.TransformerEncoder`` of ``nn.TransformerEncoderLayer`` with a final norm, as tutorials build it."""

    def __init__(self, norm_first: bool = True, batch_first: bool = True, layers: int = 3,
                 bias: bool = True, causal: bool = True) -> None:
        super().__init__()
        self.batch_first, self.causal = batch_first, causal
        self.emb = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(16, D) * 0.1)
        layer = nn.TransformerEncoderLayer(D, HEADS, 2 * D, dropout=0.0, batch_first=batch_first,
                                           norm_first=norm_first, bias=bias)
        self.encoder = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(D, bias=bias),
                                             enable_nested_tensor=not norm_first)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(ids) + self.pos[: ids.shape[1]]
        if not self.batch_first:
            x = x.transpose(0, 1)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=x.dtype) if self.causal else None
        y = self.encoder(x, mask=mask, src_key_padding_mask=pad, is_causal=self.causal)
        return self.head(y if self.batch_first else y.transpose(0, 1))


class Seq2Seq(nn.Module):
    """``nn.Transformer`` encoder-decoder: self-, causal and cross-attention, padding masks."""

    def __init__(self, batch_first: bool = True, bias: bool = True) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(16, D) * 0.1)
        self.transformer = nn.Transformer(D, HEADS, 2, 2, 2 * D, dropout=0.0, batch_first=batch_first,
                                          norm_first=True, bias=bias)
        self.head = nn.Linear(D, VOCAB, bias=bias)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        s = self.emb(src) + self.pos[: src.shape[1]]
        t = self.emb(tgt) + self.pos[: tgt.shape[1]]
        if not self.batch_first:
            s, t = s.transpose(0, 1), t.transpose(0, 1)
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], dtype=s.dtype)
        y = self.transformer(s, t, tgt_mask=causal, tgt_is_causal=True, src_key_padding_mask=pad,
                             memory_key_padding_mask=pad)
        return self.head(y if self.batch_first else y.transpose(0, 1))


class CrossAttention(nn.Module):
    """``nn.MultiheadAttention`` with ``kdim``/``vdim`` (three weights), sequence-first self-attention,
    ``need_weights``, ``add_bias_kv``, ``bias=False``: each variant of the functional projections."""

    def __init__(self, add_bias_kv: bool = False, bias: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.memory = nn.Linear(24, 24)
        self.memory_norm = nn.LayerNorm(24)
        self.norm1 = nn.LayerNorm(D)
        self.cross = nn.MultiheadAttention(D, HEADS, kdim=24, vdim=24, batch_first=True, add_bias_kv=add_bias_kv,
                                           bias=bias)
        self.norm2 = nn.LayerNorm(D)
        self.self_attn = nn.MultiheadAttention(D, HEADS, add_bias_kv=add_bias_kv, bias=bias)
        self.norm3 = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor, memory: torch.Tensor,
                pad: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.emb(ids)
        mem = self.memory_norm(self.memory(memory))
        a, weights = self.cross(self.norm1(x), mem, mem, key_padding_mask=pad, need_weights=True)
        x = x + a
        h = self.norm2(x).transpose(0, 1)
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], dtype=h.dtype)
        a, _ = self.self_attn(h, h, h, need_weights=False, attn_mask=causal, is_causal=True)
        x = x + a.transpose(0, 1)
        return self.head(self.norm3(x)), weights


class BareBlock(nn.Module):
    """Projections kept as bare ``nn.Parameter``s and applied with ``@`` (``[in, out]`` storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.w_qkv = nn.Parameter(torch.randn(D, 3 * D) / D**0.5)
        self.b_qkv = nn.Parameter(torch.randn(3 * D) * 0.1)
        self.w_out = nn.Parameter(torch.randn(D, D) / D**0.5)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = torch.addmm(self.b_qkv, self.ln1(x).flatten(0, 1), self.w_qkv).view(*x.shape[:2], 3 * D).chunk(3, -1)
        b, t, _ = x.shape
        q, k, v = (z.reshape(b, t, HEADS, D // HEADS).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D)
        x = x + y @ self.w_out
        return x + self.mlp(self.ln2(x))


class TiedLogits(nn.Module):
    """Logits as ``x @ tok.weight.T`` (Whisper's decoder): the embedding's weight read by the model's code."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(16, D) * 0.1)
        self.blocks = nn.ModuleList(BareBlock() for _ in range(2))
        self.ln = nn.LayerNorm(D)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return (self.ln(x) @ self.tok.weight.to(x.dtype).T).float()


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def _pad(batch: int, length: int) -> torch.Tensor:
    pad = torch.zeros(batch, length, dtype=torch.bool)
    pad[-1, length - 2:] = True
    return pad


def _model(cls: type, *args: object, **kwargs: object) -> nn.Module:
    torch.manual_seed(0)
    return _randomise_norms(cls(*args, **kwargs)).double().eval()


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("length", [7, 11])
def test_pre_ln_transformer_encoder_is_exact(batch_first: bool, length: int) -> None:
    model = _model(EncoderLM, batch_first=batch_first)
    report, err = _patch_and_compare(model, (_ids(2, length), _pad(2, length)))
    assert {s.verdict for s in report.sites} == {"exact"} and len(report.sites) == 7
    assert err < 1e-12
    # the projections are functional calls: out_proj is a writer, in_proj_weight a reader
    plan = report.plan
    assert "encoder.layers.1.self_attn.out_proj" in plan.site("encoder.layers.2.norm1").writers
    assert plan.site("encoder.layers.0.norm1").readers == ["encoder.layers.0.self_attn.in_proj_weight+in_proj_bias"]


def test_encoder_decoder_transformer_is_exact_with_cross_attention() -> None:
    model = _model(Seq2Seq)
    report, err = _patch_and_compare(model, (_ids(2, 7), _ids(2, 5, seed=1), _pad(2, 7)), beta_placement="fold")
    assert {s.verdict for s in report.sites} == {"exact"} and len(report.sites) == 12
    assert err < 1e-12
    # the encoder's final norm is read by every cross-attention's key/value rows of in_proj_weight
    readers = report.plan.site("transformer.encoder.norm").readers
    assert readers == [f"transformer.decoder.layers.{i}.multihead_attn.in_proj_weight[32:96]+in_proj_bias[32:96]"
                       for i in range(2)]
    # and the decoder's cross-attention queries fold into rows 0..31
    folds = {f.reader for f in report.plan.folds if f.site == "transformer.decoder.layers.0.norm2"}
    assert folds == {"transformer.decoder.layers.0.multihead_attn.in_proj_weight[0:32]+in_proj_bias[0:32]"}


@pytest.mark.parametrize("batch_first", [True, False])
def test_encoder_decoder_without_biases(batch_first: bool) -> None:
    model = _model(Seq2Seq, batch_first=batch_first, bias=False)
    report, err = _patch_and_compare(model, (_ids(2, 6), _ids(2, 6, seed=1)))
    assert {s.verdict for s in report.sites} == {"exact"} and err < 1e-12


@pytest.mark.parametrize("add_bias_kv", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_multihead_attention_variants(add_bias_kv: bool, bias: bool) -> None:
    model = _model(CrossAttention, add_bias_kv=add_bias_kv, bias=bias)
    memory = torch.randn(2, 5, 24, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    report, err = _patch_and_compare(model, (_ids(2, 6), memory, _pad(2, 5)), beta_placement="fold")
    # the memory projection reads the raw input: a stream start quantizers round, kept and centered by one op
    verdicts = {s.name: s.verdict for s in report.sites}
    assert verdicts.pop("memory_norm") == "exact-with-centering" and err < 1e-12
    assert set(verdicts.values()) == {"exact"}
    beta = {s.name: s.beta_detail for s in report.sites}
    if bias:  # q, k and v are rows of one bias: each reader takes its share there
        assert beta["memory_norm"] == ("folded into the bias of `cross.k_proj_weight+in_proj_bias[32:64]`, "
                                       "`cross.v_proj_weight+in_proj_bias[64:96]`")
        assert beta["norm2"] == "folded into the bias of `self_attn.in_proj_weight+in_proj_bias`"
    elif add_bias_kv:  # a learned key appended after the projection: a key shift is no longer softmax-invariant
        assert beta["memory_norm"].startswith("kept in the RMSNorm: `cross.k_proj_weight` has no bias slot and its "
                                              "keys carry different features at different key positions")
    else:  # the key share could drop, but the value share has no output bias to move into, so β stays
        assert beta["memory_norm"].startswith("kept in the RMSNorm: `cross.v_proj_weight` has no bias slot and "
                                              "`cross.out_proj` reads the attention output but has no bias slot")


def test_attention_weights_are_not_a_reader() -> None:
    """need_weights=True returns the attention probabilities: computed from q and k, not a stream."""
    model = _model(CrossAttention)
    memory = torch.randn(2, 5, 24, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    inputs = (_ids(2, 6), memory, _pad(2, 5))
    with torch.no_grad():
        weights = model(*inputs)[1]
    normswap.patch(model, example_inputs=inputs)
    with torch.no_grad():
        assert float((model(*inputs)[1] - weights).abs().max()) < 1e-12


def test_bare_parameter_projections_fold_and_rotate() -> None:
    model = _model(TiedLogits)
    ids = _ids(2, 9)
    report, err = _patch_and_compare(model, (ids,), fold_gamma=True)
    assert err < 1e-6  # the model returns float32 logits
    plan = report.plan
    assert all(s.verdict in ("exact", "exact-with-centering") for s in plan.sites)
    # ``x @ w_out`` is a writer (centered rows of the [in, out] parameter), addmm on w_qkv a reader
    assert "blocks.0.w_out.T" in plan.site("blocks.1.ln1").writers
    assert plan.site("blocks.0.ln1").readers == ["blocks.0.w_qkv.T+b_qkv"]
    assert plan.site("blocks.0.ln1").fold_beta and plan.site("blocks.0.ln1").fold_gamma


def test_logits_read_from_the_embedding_keep_the_tie_and_center_at_run_time() -> None:
    model = _model(TiedLogits)
    report, err = _patch_and_compare(model, (_ids(2, 9),))
    assert err < 1e-6
    plan = report.plan
    assert not plan.unties and model.tok.weight.data_ptr() != 0
    [hook] = plan.hooks
    assert (hook.module, hook.where) == ("tok", "output")
    assert "weight also read directly by the model's code" in hook.reason
    assert all(s.verdict == "exact-with-centering" for s in plan.sites)


def test_rotation_of_a_pytorch_transformer() -> None:
    model = _model(Seq2Seq)
    inputs = (_ids(2, 7), _ids(2, 5, seed=1), _pad(2, 7))
    with torch.no_grad():
        reference = model(*inputs)
    normswap.patch(model, example_inputs=inputs, fold_gamma=True)
    rotation = normswap.rotate(model, "hadamard")
    assert rotation.rotated
    with torch.no_grad():
        assert float((model(*inputs) - reference).abs().max() / reference.abs().max()) < 1e-12


# ------------------------------------------------------------------ PyTorch's fused encoder-layer path
def _count_fused(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    fused = torch._transformer_encoder_layer_fwd

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        calls[0] += 1
        return fused(*args, **kwargs)

    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", counting)
    return calls


def test_exact_layers_keep_pytorchs_fused_path(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = _randomise_norms(EncoderLM()).eval()  # float32: the fused path's conditions
    ids = _ids(3, 8)
    with torch.no_grad():
        reference = model(ids)
    report = normswap.patch(model, example_inputs=(ids,))
    assert {s.verdict for s in report.sites} == {"exact"}
    assert {s.beta_detail for s in report.sites if ".layers." in s.name} == {FUSED_WHY}
    calls = _count_fused(monkeypatch)
    with torch.no_grad():
        fused = model(ids)
    assert calls[0] == 3  # every layer took it, and it computes what the RMSNorm model computes
    unfused = model(ids)  # autograd on: the Python forward
    assert float((fused - reference).abs().max()) < 1e-5 and float((unfused - reference).abs().max()) < 1e-5


def test_layers_the_fused_path_would_get_wrong_run_their_python_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    post_ln = _randomise_norms(EncoderLM(norm_first=False, causal=False)).eval()  # approximate norms, nested
    folded = _randomise_norms(EncoderLM()).eval()
    ids, pad = _ids(3, 8), _pad(3, 8)
    normswap.patch(post_ln, example_inputs=(ids, pad))
    normswap.patch(folded, example_inputs=(ids, pad), beta_placement="fold")  # RMSNorm bias None
    calls = _count_fused(monkeypatch)
    for model in (post_ln, folded):
        with torch.no_grad():
            fast = model(ids, pad)
        slow = model(ids, pad)
        assert calls[0] == 0 and not post_ln.encoder.use_nested_tensor
        assert float((fast - slow).abs().max()) < 1e-5
