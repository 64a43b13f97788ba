"""Writers, readers and centering-preserving ops recognised by their action on the feature axis (issue 37 §1-§2).

Every model is built twice from one seed in float64 with LayerNorm γ/β (and biases) randomised, patched on one
input and compared with the original on another: every norm must be planned ``exact`` (weight surgery alone,
no centering op), the converted model's output must match to 1e-9, and every converted norm's input must be
zero-mean to 1e-9 (each norm checked on its own, not only through the output).
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from torch import nn

import normswap
from tests.feature_axis_models import EinsumLM, LayoutBlock, LayoutLM, MessagePassingNet, TokenViT
from tests.third_party_models import build_randomised


def _norm_inputs(model: nn.Module, paths: list[str], inputs: tuple) -> dict[str, torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}
    handles = [model.get_submodule(p).register_forward_pre_hook(
        lambda m, a, p=p: seen.setdefault(p, a[0].detach().clone())) for p in paths]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return seen


def _assert_exact(model: nn.Module, reference: nn.Module, report: normswap.Report, other: tuple) -> None:
    plan = report.plan
    assert [s.verdict for s in plan.sites] == ["exact"] * len(plan.sites), plan.table()
    assert not plan.hooks, plan.table()
    with torch.no_grad():
        got, want = (getattr(y, "logits", y) for y in (model(*other), reference(*other)))
    assert float((got - want).abs().max()) <= 1e-9
    inputs = _norm_inputs(model, [s.name for s in plan.sites], other)
    assert set(inputs) == {s.name for s in plan.sites}
    for name, x in inputs.items():
        ratio = (x.mean(-1).abs() / x.pow(2).mean(-1).sqrt()).max()
        assert float(ratio) <= 1e-9, name


def _check(make, example: tuple, other: tuple) -> normswap.Report:  # noqa: ANN001
    model, reference = build_randomised(make), build_randomised(make)
    # the weight edits under test: the Linear stems centered by weights, not by the stem op (tests of that:
    # test_stem_centering.py)
    report = normswap.patch(model, example, stem_centering="weights")
    _assert_exact(model, reference, report, other)
    return report


def _ids(n: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 50, (n, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("how", ["T", "T.contiguous", "permute", "rearrange", "mT.float", "einsum", "bmm",
                                 "baddbmm", "addmm", "tensordot"])
def test_a_parameter_through_layout_ops_into_a_contraction_is_a_centerable_writer(how):
    report = _check(lambda: LayoutLM(how), (_ids(2, 7, 1),), (_ids(3, 5, 2),))
    edits = {e.target: e for e in report.plan.writer_edits}
    if how in ("permute", "rearrange"):  # W_O [heads, d_head, d_model]: centered over its last axis
        assert edits["blocks.0.W_O"].axis == 2 and edits["blocks.0.W_O"].blocks is None
    elif how in ("T.contiguous", "tensordot"):  # W [64, d_model] read as W.T: its output features are axis 1
        assert edits["blocks.1.W"].axis == 1
    assert edits["blocks.0.b"].axis == 0


def test_an_interpretability_style_einsum_model_is_exact_and_round_trips():
    model, reference = build_randomised(EinsumLM), build_randomised(EinsumLM)
    report = normswap.patch(model, (_ids(2, 7, 1),))
    _assert_exact(model, reference, report, (_ids(3, 9, 2),))
    edits = {e.target: (e.axis, e.blocks) for e in report.plan.writer_edits}
    assert edits["blocks.0.attn.W_O"] == (2, None)  # [heads, d_head, d_model]
    assert edits["blocks.1.mlp.W_out"] == (1, None)  # [d_mlp, d_model]
    assert edits["W_E"] == (1, None) and edits["W_pos"] == (1, None) and edits["blocks.0.attn.b_O"] == (0, None)
    assert not any(t.endswith(("W_Q", "W_K", "W_V", "W_in", "W_U")) for t in edits)  # readers: untouched
    with tempfile.TemporaryDirectory() as tmp:
        normswap.save(model, tmp)
        fresh = normswap.load(tmp, model=EinsumLM().double())
        for (name, a), (name_b, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
            assert name == name_b and torch.equal(a, b), name
        with torch.no_grad():
            assert torch.equal(fresh(_ids(3, 9, 2)), model(_ids(3, 9, 2)))


@pytest.mark.parametrize("pe_slice", [False, True])
def test_a_class_token_by_broadcast_to_and_a_table_added_to_a_slice_of_itself_are_stream_start_tables(pe_slice):
    def patches(n: int, s: int) -> tuple:
        return (torch.randn(n, 6, 12, generator=torch.Generator().manual_seed(s), dtype=torch.float64),)

    report = _check(lambda: TokenViT(pe_slice), patches(2, 1), patches(3, 2))
    edits = {e.target: e.axis for e in report.plan.writer_edits}
    assert edits["pos"] == 2 and ("cls" in edits) != pe_slice


@pytest.mark.parametrize("how", ["index_add", "index_add_", "scatter_add", "scatter_reduce_sum", "scatter_reduce_mean",
                                 "index_put", "sparse_mm", "segment_reduce"])
def test_rows_summed_into_rows_with_one_weight_per_row_keep_centering(how):
    def graph(seed: int, nodes: int, edges: int) -> tuple:
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn(nodes, 7, generator=gen, dtype=torch.float64),
                torch.randint(0, nodes, (2, edges), generator=gen),
                torch.rand(edges, generator=gen, dtype=torch.float64))

    _check(lambda: MessagePassingNet(how), graph(1, 9, 20), graph(2, 11, 25))


class _RolledTableViT(TokenViT):
    """A position table added to itself with its features rolled: not a sum of one feature's elements."""

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        x = self.embed(patches) + (self.pos[:, 1:] + self.pos[:, 1:].roll(1, -1))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def test_a_table_summed_with_itself_at_other_features_gets_no_edit():
    images = torch.randn(2, 6, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    # verified: every exact claim holds
    report = normswap.patch(build_randomised(_RolledTableViT), (images,), mode="exact")
    assert "pos" not in {e.target for e in report.plan.writer_edits}, report.plan.table()
    assert all(s.verdict != "exact" for s in report.plan.sites), report.plan.table()


class _PerFeatureMessages(MessagePassingNet):
    """Messages weighted per edge *and per feature* before the row sum: not one weight per row."""

    def __init__(self) -> None:
        super().__init__("index_add")
        self.mix = nn.Parameter(torch.rand(20, 32) + 0.5)

    def forward(self, x, edges, weight):  # noqa: ANN001, ANN201
        h = self.embed(x)
        for layer in self.layers:
            src, dst = edges
            m = layer.msg(layer.ln(h))[src] * (weight[:, None] * self.mix)
            h = h + torch.zeros_like(h).index_add(0, dst, m)
        return self.readout(self.norm(h))


def test_a_row_sum_with_weights_per_feature_does_not_keep_centering():
    gen = torch.Generator().manual_seed(1)
    inputs = (torch.randn(9, 7, generator=gen, dtype=torch.float64), torch.randint(0, 9, (2, 20), generator=gen),
              torch.rand(20, generator=gen, dtype=torch.float64))
    model, reference = build_randomised(_PerFeatureMessages), build_randomised(_PerFeatureMessages)
    report = normswap.patch(model, inputs, mode="exact", stem_centering="weights")
    verdicts = [s.verdict for s in report.plan.sites]
    assert verdicts[0] == "exact" and verdicts[1:] != ["exact", "exact"], report.plan.table()
    with torch.no_grad():  # what is converted stays exact
        assert float((model(*inputs) - reference(*inputs)).abs().max()) <= 1e-9


class _SplitOutputAxis(LayoutBlock):
    """A writer whose output features are two axes of its stored weight (``[2, 16, 64]`` flattened to 32): no
    single stored axis to center along."""

    def __init__(self) -> None:
        super().__init__("T")
        self.W2 = nn.Parameter(torch.randn(2, 16, 64) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(self.up(self.ln(x)))
        return x + nn.functional.linear(h, self.W2.reshape(32, 64).contiguous(), self.b)


class _SplitNet(LayoutLM):
    def __init__(self) -> None:
        super().__init__("T")
        self.blocks = nn.ModuleList([_SplitOutputAxis(), _SplitOutputAxis()])


def test_a_writer_whose_features_span_two_stored_axes_is_not_centered_by_a_guess():
    model = build_randomised(_SplitNet)
    report = normswap.patch(model, (_ids(2, 7, 1),))  # verified: whatever is planned exact is
    assert not any(e.target.endswith("W2") for e in report.plan.writer_edits), report.plan.table()
    verdicts = [s.verdict for s in report.plan.sites]
    assert verdicts[0] == "exact" and "exact" not in verdicts[1:], report.plan.table()


def _moe(kind: str, implementation: str) -> nn.Module:
    if kind == "phimoe":
        from transformers import PhimoeConfig, PhimoeForCausalLM
        config = PhimoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                              max_position_embeddings=64, experts_implementation=implementation)
        model = PhimoeForCausalLM(config)
    else:
        from transformers import DbrxConfig, DbrxForCausalLM
        config = DbrxConfig(vocab_size=64, d_model=32, n_heads=4, n_layers=2, max_seq_len=64,
                            attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                            ffn_config={"ffn_hidden_size": 48, "moe_num_experts": 4, "moe_top_k": 2},
                            experts_implementation=implementation)
        model = DbrxForCausalLM(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            one = 1.0 if "norm" in name and name.endswith("weight") else 0.0
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else 0.2) + one)
    return model.double().eval()


@pytest.mark.parametrize(("kind", "implementation"), [("phimoe", "eager"), ("phimoe", "batched_mm"), ("dbrx", "eager")])
def test_fused_moe_experts_are_writers_and_their_routed_rows_keep_centering(kind, implementation):
    """transformers' fused experts: 3-D ``down_proj`` read per expert (``F.linear`` on ``down_proj[e]``, or a
    ``bmm`` on the gathered experts), rows scaled by routing weights and summed with ``index_add_`` (or a sum
    over top-k). One edit per stored tensor, no centering op: every norm exact."""
    model, reference = _moe(kind, implementation), _moe(kind, implementation)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    report = normswap.patch(model, (ids,))
    other = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(4))
    _assert_exact(model, reference, report, (other,))
    down = {e.target: e.axis for e in report.plan.writer_edits if e.target.endswith(("down_proj", "w2"))}
    assert down == ({f"model.layers.{i}.mlp.experts.down_proj": 1 for i in range(2)} if kind == "phimoe"
                    else {f"transformer.blocks.{i}.ffn.experts.mlp.w2": 1 for i in range(2)})


def test_grouped_mm_experts_with_no_float64_kernel_are_proved_in_float32():
    """transformers' default fused-experts path on CPU, ``torch._grouped_mm`` over the whole 3-D tensor, has no
    float64 kernel: a copy worked on in float32 (``verify_dtype='float32'``; by default the float64 copy runs
    the ``eager`` experts instead) runs it, and the weight-axis proof runs in float32 too."""
    model, reference = (_moe("phimoe", "grouped_mm").float() for _ in range(2))
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    report = normswap.patch(model, (ids,), verify_dtype="float32")
    assert report.verification["verify_dtype"] == "float32"
    assert [s.verdict for s in report.plan.sites] == ["exact"] * 5 and not report.plan.hooks, report.plan.table()
    assert {e.target: e.axis for e in report.plan.writer_edits if e.target.endswith("down_proj")} == \
        {f"model.layers.{i}.mlp.experts.down_proj": 1 for i in range(2)}
    other = torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got, want = model(other).logits, reference(other).logits
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5


def test_nllb_moe_routed_experts_keep_the_stream_start_op_the_only_one():
    """NLLB-MoE: experts are ``nn.Linear`` modules, their rows routed with ``index_add_`` into the stream; the
    sinusoidal position buffer starts each stack (one op there). Before, each routed layer was "a second op
    on one stream" and 7 of 12 norms were approximate."""
    from transformers import NllbMoeConfig, NllbMoeForConditionalGeneration

    config = NllbMoeConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, num_experts=4,
                           expert_capacity=8, encoder_sparse_step=1, decoder_sparse_step=1, max_position_embeddings=64)
    model, reference = (build_randomised(lambda: NllbMoeForConditionalGeneration(config)) for _ in range(2))
    ids = torch.randint(4, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    report = normswap.patch(model, {"input_ids": ids, "decoder_input_ids": ids[:, :5]}, untie=True)  # no op at the tie
    assert [s.verdict for s in report.plan.sites] == ["exact-with-centering"] * 12, report.plan.table()
    assert sorted(h.module for h in report.plan.hooks) == ["model.decoder.embed_positions",
                                                           "model.encoder.embed_positions"]
    other = torch.randint(4, 64, (3, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got, want = (m(input_ids=other, decoder_input_ids=other[:, :6]).logits for m in (model, reference))
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-9


def test_the_same_model_split_differently_gets_the_same_verdicts():
    """A writer's weight transposed in the model's code or stored transposed: the same edits, the same verdicts."""
    a = normswap.plan(build_randomised(lambda: LayoutLM("T")), (_ids(2, 7, 1),))
    b = normswap.plan(build_randomised(lambda: LayoutLM("T.contiguous")), (_ids(2, 7, 1),))
    assert [s.verdict for s in a.sites] == [s.verdict for s in b.sites] == ["exact"] * 3


class _CopiedReaderBlock(LayoutBlock):
    """The norm read through a weight copied into its transpose (``W_up`` stored ``[in, out]``)."""

    def __init__(self) -> None:
        super().__init__("T.contiguous")
        self.W_up, self.b_up = nn.Parameter(torch.randn(32, 64) / 6), nn.Parameter(torch.randn(64) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.gelu(nn.functional.linear(self.ln(x), self.W_up.T.contiguous(), self.b_up))
        return x + nn.functional.linear(h, self.W.T.contiguous(), self.b)


class _CopiedReaderNet(LayoutLM):
    def __init__(self) -> None:
        super().__init__("T.contiguous")
        self.blocks = nn.ModuleList([_CopiedReaderBlock(), _CopiedReaderBlock()])


def test_a_reader_whose_weight_is_copied_into_its_transpose_takes_the_folds_and_the_rotation():
    model, reference = build_randomised(_CopiedReaderNet), build_randomised(_CopiedReaderNet)
    report = normswap.patch(model, (_ids(2, 7, 1),), fold_gamma=True)
    folds = {(f.site, f.reader): f for f in report.plan.folds}
    fold = folds[("blocks.0.ln", "blocks.0.W_up.T+b_up")]
    assert fold.gamma and fold.beta and fold.kind == "conv1d"
    assert all(s.rotation_ready for s in report.plan.sites), report.plan.table()
    normswap.rotate(model, "hadamard")
    with torch.no_grad():
        assert float((model(_ids(3, 5, 2)) - reference(_ids(3, 5, 2))).abs().max()) <= 1e-9
