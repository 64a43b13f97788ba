"""normswap on custom models from twelve more third-party libraries (issue 37, "Checked by").

    PYTHONPATH=.:/path/to/libs python benchmarks/bench_third_party_more.py [--only SUBSTRING ...] [--json OUT.json]

The same checks as ``benchmarks/bench_third_party.py`` (float64, eval, every vector parameter randomised;
``plan`` and ``patch`` at input shape A, the patched model against the original at A and at an unseen shape B;
every LayerNorm-like module converted or reported; save/load round trip; fold γ + Hadamard rotation where every
norm is exact), on libraries none of the earlier rounds used: graph (torch_geometric), tabular
(rtdl_revisiting_models, tab-transformer-pytorch), efficient-attention LMs (performer-pytorch, linformer,
local-attention, reformer-pytorch, MEGABYTE-pytorch), Mega (EMA + gated attention), PaLM (parallel blocks),
mixture of experts (st-moe-pytorch inside a Pre-LN decoder) and multimodal (CoCa-pytorch). A library that is
not installed is skipped with a note; none is a test dependency (tests/test_third_party_more.py holds replicas
of the patterns that broke). The table in ``docs/results/third-party.md`` is what this printed.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_third_party as base  # noqa: E402
from bench_third_party import Case, feats, ids  # noqa: E402

LM_A, LM_B = (ids(64, 2, 16, 0),), (ids(64, 3, 32, 1),)


# ------------------------------------------------------------------------------ torch_geometric
class _GraphPreLN(nn.Module):
    """A Pre-LN graph transformer as torch_geometric's users write one: ``TransformerConv`` message passing,
    ``torch_geometric.nn.norm.LayerNorm`` called as ``norm(x, batch)`` (mode 'node': per node, a LayerNorm;
    mode 'graph': statistics over every node of a graph, not a per-token LayerNorm), a final norm and a
    per-graph mean-pool head."""

    def __init__(self, pyg: Any, mode: str, d: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(6, d)
        self.norms = nn.ModuleList(pyg.nn.norm.LayerNorm(d, mode=mode) for _ in range(2 * layers + 1))
        self.convs = nn.ModuleList(pyg.nn.TransformerConv(d, d // 4, heads=4) for _ in range(layers))
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
                                  for _ in range(layers))
        self.head = nn.Linear(d, 3)
        self.pool = pyg.nn.global_mean_pool

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i, (conv, mlp) in enumerate(zip(self.convs, self.mlps, strict=True)):
            h = h + conv(self.norms[2 * i](h, batch), edge_index)
            h = h + mlp(self.norms[2 * i + 1](h, batch))
        return self.head(self.pool(self.norms[-1](h, batch), batch))


class _GPS(nn.Module):
    """torch_geometric's ``GPSConv`` (local GINE-free GIN conv + global attention, its own Post-LN norms),
    with ``norm='layer_norm'``."""

    def __init__(self, pyg: Any, mode: str, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(6, d)
        self.layers = nn.ModuleList(
            pyg.nn.GPSConv(d, pyg.nn.GINConv(nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))), heads=4,
                           norm="layer_norm", norm_kwargs={"mode": mode}) for _ in range(2))
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h, edge_index, batch)
        return self.head(h)


def _graphs(sizes: tuple[int, ...], seed: int) -> tuple:
    """Node features, a random directed edge list inside each graph (plus self-loops), the batch vector."""
    gen = torch.Generator().manual_seed(seed)
    edges, batch, start = [], [], 0
    for g, n in enumerate(sizes):
        src = torch.randint(0, n, (3 * n,), generator=gen) + start
        dst = torch.randint(0, n, (3 * n,), generator=gen) + start
        loops = torch.arange(start, start + n)
        edges.append(torch.stack([torch.cat([src, loops]), torch.cat([dst, loops])]))
        batch.append(torch.full((n,), g))
        start += n
    return feats(start, 6, seed=seed), torch.cat(edges, 1), torch.cat(batch)


def pyg_cases() -> list[Case]:
    import torch_geometric as pyg

    a, b = _graphs((5, 7), 0), _graphs((4, 9, 6), 1)
    return [Case("torch_geometric", f"Pre-LN TransformerConv, LayerNorm mode='{m}'",
                 lambda m=m: _GraphPreLN(pyg, m), a, b) for m in ("node", "graph")] + [
        Case("torch_geometric", f"GPSConv norm='layer_norm' mode='{m}' (Post-LN)", lambda m=m: _GPS(pyg, m), a, b)
        for m in ("node", "graph")]


# -------------------------------------------------------------------------------------- tabular
def _tabular(batch: int, seed: int, cards: tuple[int, ...] = (3, 5, 4), n_cont: int = 4) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    cat = torch.stack([torch.randint(0, c, (batch,), generator=gen) for c in cards], 1)
    return cat, feats(batch, n_cont, seed=seed)


class _RtdlFT(nn.Module):
    def __init__(self, rtdl: Any, **kw: Any) -> None:
        super().__init__()
        self.net = rtdl.FTTransformer(n_cont_features=4, cat_cardinalities=[3, 5, 4], d_out=2, n_blocks=2,
                                      d_block=32, attention_n_heads=4, attention_dropout=0.0,
                                      ffn_d_hidden_multiplier=2.0, ffn_dropout=0.0, residual_dropout=0.0, **kw)

    def forward(self, x_cat: torch.Tensor, x_cont: torch.Tensor) -> torch.Tensor:
        return self.net(x_cont, x_cat)


def rtdl_cases() -> list[Case]:
    import rtdl_revisiting_models as rtdl

    a, b = _tabular(3, 0), _tabular(5, 1)
    return [Case("rtdl_revisiting_models", "FTTransformer (first block without attention norm)",
                 lambda: _RtdlFT(rtdl), a, b),
            Case("rtdl_revisiting_models", "FTTransformer, ReLU FFN", lambda: _RtdlFT(rtdl, ffn_activation="ReLU"),
                 a, b)]


def tab_transformer_cases() -> list[Case]:
    import tab_transformer_pytorch as tt

    a, b = _tabular(3, 0), _tabular(5, 1)
    kw = {"categories": (3, 5, 4), "num_continuous": 4, "dim": 32, "depth": 2, "heads": 4, "dim_head": 8,
          "dim_out": 2}
    return [Case("tab-transformer-pytorch", f"FTTransformer num_residual_streams={n}",
                 lambda n=n: tt.FTTransformer(**kw, num_residual_streams=n), a, b) for n in (1, 4)] + [
        Case("tab-transformer-pytorch", f"TabTransformer num_residual_streams={n}",
             lambda n=n: tt.TabTransformer(**kw, mlp_hidden_mults=(2,), mlp_act=nn.ReLU(), num_residual_streams=n),
             a, b)
        for n in (1, 4)]


# ------------------------------------------------------------------------------------------ LMs
def performer_cases() -> list[Case]:
    import performer_pytorch as pp

    kw = {"num_tokens": 64, "max_seq_len": 64, "dim": 32, "depth": 2, "heads": 4, "dim_head": 8, "nb_features": 16}
    return [Case("performer-pytorch", "PerformerLM causal", lambda: pp.PerformerLM(**kw, causal=True), LM_A, LM_B),
            Case("performer-pytorch", "PerformerLM encoder, ff_glu, local heads",
                 lambda: pp.PerformerLM(**kw, ff_glu=True, local_attn_heads=2, local_window_size=8), LM_A, LM_B)]


def linformer_cases() -> list[Case]:
    import linformer

    a, b = (ids(64, 2, 32, 0),), (ids(64, 3, 32, 1),)  # Linformer's projection fixes the sequence length
    return [Case("linformer", "LinformerLM", lambda: linformer.LinformerLM(num_tokens=64, dim=32, seq_len=32, depth=2,
                                                                          k=8, heads=4), a, b),
            Case("linformer", "LinformerLM one_kv_head share_kv",
                 lambda: linformer.LinformerLM(num_tokens=64, dim=32, seq_len=32, depth=2, k=8, heads=4,
                                               one_kv_head=True, share_kv=True), a, b)]


def local_attention_cases() -> list[Case]:
    import local_attention as la

    kw = {"num_tokens": 64, "max_seq_len": 64, "dim": 32, "depth": 2, "heads": 4, "dim_head": 8,
          "local_attn_window_size": 8}
    return [Case("local-attention", f"LocalTransformer num_residual_streams={n}",
                 lambda n=n: la.LocalTransformer(**kw, num_residual_streams=n), LM_A, LM_B) for n in (1, 4)] + [
        Case("local-attention", "LocalTransformer dynamic pos bias (float32: its position MLP casts to float32)",
             lambda: la.LocalTransformer(**kw, num_residual_streams=1, use_dynamic_pos_bias=True), LM_A, LM_B,
             dtype=torch.float32)]


def reformer_cases() -> list[Case]:
    import reformer_pytorch as rf

    kw = {"num_tokens": 64, "dim": 32, "depth": 2, "max_seq_len": 64, "heads": 4, "dim_head": 8, "ff_chunks": 1,
          "use_full_attn": True}  # full attention: LSH bucketing draws random rotations at every call
    return [Case("reformer-pytorch", "ReformerLM (reversible, full attention)", lambda: rf.ReformerLM(**kw),
                 LM_A, LM_B),
            Case("reformer-pytorch", "ReformerLM causal, absolute positions",
                 lambda: rf.ReformerLM(**kw, causal=True, absolute_position_emb=True), LM_A, LM_B)]


def megabyte_cases() -> list[Case]:
    import MEGABYTE_pytorch as mb

    return [Case("MEGABYTE-pytorch", "MEGABYTE (2 stages)", lambda: mb.MEGABYTE(
        num_tokens=64, dim=(32, 16), depth=(1, 1), max_seq_len=(8, 4), dim_head=8, heads=2),
        (ids(64, 2, 32, 0),), (ids(64, 3, 20, 1),))]


def mega_cases() -> list[Case]:
    import mega_pytorch as mp

    kw = {"num_tokens": 64, "dim": 32, "depth": 2, "ema_heads": 4, "attn_dim_qk": 16, "attn_dim_value": 32}
    return [Case("Mega-pytorch", f"Mega pre_norm={p}", lambda p=p: mp.Mega(**kw, pre_norm=p), LM_A, LM_B)
            for p in (True, False)]


def palm_cases() -> list[Case]:
    import palm_pytorch as pa

    return [Case("PaLM-pytorch", "PaLM (parallel blocks, β buffer LayerNorm)",
                 lambda: pa.PaLM(dim=32, num_tokens=64, depth=2, dim_head=8, heads=4), LM_A, LM_B)]


class _MoEDecoder(nn.Module):
    """A Pre-LN decoder whose feed-forward is st-moe-pytorch's ``MoE`` (top-2 routing), as its README plugs
    it in. Its router draws random numbers to decide on the second expert: the forward seeds torch's
    generator first, so every call (original, patched, reloaded) routes alike."""

    def __init__(self, sm: Any, vocab: int = 64, d: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(2 * layers + 1))
        self.attn = nn.ModuleList(nn.MultiheadAttention(d, 4, batch_first=True) for _ in range(layers))
        self.moe = nn.ModuleList(sm.MoE(d, num_experts=4, gating_top_n=2, capacity_factor_eval=4.0)
                                 for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(0)
        x = self.tok(tokens)
        for i, (attn, moe) in enumerate(zip(self.attn, self.moe, strict=True)):
            h = self.norms[2 * i](x)
            x = x + attn(h, h, h, need_weights=False)[0]
            x = x + moe(self.norms[2 * i + 1](x)).outputs
        return self.head(self.norms[-1](x))


def st_moe_cases() -> list[Case]:
    import st_moe_pytorch as sm

    return [Case("st-moe-pytorch", "Pre-LN decoder with MoE feed-forward (top-2)", lambda: _MoEDecoder(sm),
                 LM_A, LM_B)]


class _CoCa(nn.Module):
    def __init__(self, cc: Any) -> None:
        super().__init__()
        self.net = cc.CoCa(dim=32, num_tokens=64, unimodal_depth=1, multimodal_depth=1, image_dim=24,
                           num_img_queries=5, dim_head=8, heads=4)

    def forward(self, text: torch.Tensor, image_tokens: torch.Tensor) -> torch.Tensor:
        return self.net(text, image_tokens=image_tokens)


def coca_cases() -> list[Case]:
    import coca_pytorch as cc

    return [Case("CoCa-pytorch", "CoCa (image tokens in, caption logits out)", lambda: _CoCa(cc),
                 (ids(64, 2, 9, 0, low=1), feats(2, 7, 24, seed=0)),
                 (ids(64, 3, 13, 1, low=1), feats(3, 5, 24, seed=1)))]


LIBRARIES: dict[str, tuple[str, Any]] = {
    "torch_geometric": ("torch_geometric", pyg_cases),
    "rtdl_revisiting_models": ("rtdl_revisiting_models", rtdl_cases),
    "tab-transformer-pytorch": ("tab_transformer_pytorch", tab_transformer_cases),
    "performer-pytorch": ("performer_pytorch", performer_cases),
    "linformer": ("linformer", linformer_cases),
    "local-attention": ("local_attention", local_attention_cases),
    "reformer-pytorch": ("reformer_pytorch", reformer_cases),
    "MEGABYTE-pytorch": ("MEGABYTE_pytorch", megabyte_cases),
    "Mega-pytorch": ("mega_pytorch", mega_cases),
    "PaLM-pytorch": ("palm_pytorch", palm_cases),
    "st-moe-pytorch": ("st_moe_pytorch", st_moe_cases),
    "CoCa-pytorch": ("coca_pytorch", coca_cases),
}


def _build(case: Case) -> nn.Module:
    """``bench_third_party.build``, with Python's ``random`` seeded too: hyper-connections (tab-transformer,
    local-attention with ``num_residual_streams`` > 1) draws each layer's initial stream with ``random``."""
    random.seed(0)
    return _base_build(case)


_base_build = base.build

if __name__ == "__main__":
    base.build = _build
    base.LIBRARIES.clear()
    base.LIBRARIES.update(LIBRARIES)
    base.main()
