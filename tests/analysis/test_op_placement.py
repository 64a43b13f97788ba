"""Where the one centering op goes (issue 37 §3) and what the reasons promise (§5).

- An op may sit on a value that is no module boundary: the residual sum ``a + M(a)`` of a block whose
  branch reads the raw stream (ModernBERT's first layer, ``attn_norm = Identity``; tabular transformers
  built the same way). Every norm is then exact with the one op, and the op survives save and load.
- A verdict does not depend on how the same dataflow is split into modules: a NormFormer-style mid-MLP
  norm after ``F.gelu`` and after an ``nn.GELU()`` module get the same verdict, approximate by default
  (its op would be one per norm) and exact with ``per_norm_centering=True``.
- A reason that promises ``per_norm_centering=True`` is kept: every such norm of the replicas here and
  of the test models is exact when planned with the option.
- A Pre-LN tower blocked by a reader of the raw stream names that reader and is not called Post-LN.
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normswap
from tests.analysis.test_analysis import TanhNet
from tests.custom_models import PostLNEncoder, PostNormDecoder, TinyGPT, TinyViT, randomise
from tests.hierarchical_models import ConvStemNet, PatchNormViT, PyramidStyle, SwinStyle
from tests.zoo import float64_reference

PROMISE = "would make it exact (per_norm_centering=True)"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


# ------------------------------------------------------------------ replicas
def _modernbert():
    from transformers import ModernBertConfig, ModernBertModel

    config = ModernBertConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                              num_attention_heads=4, max_position_embeddings=64, local_attention=8,
                              global_attn_every_n_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              cls_token_id=1, sep_token_id=2)
    config._attn_implementation = "eager"
    return randomise(ModernBertModel(config).double().eval(), seed=3)


class TabularBlock(nn.Module):
    """A tabular-transformer block: the first one has no attention norm (``Identity``), as in FT-Transformer."""

    def __init__(self, d: int, first: bool) -> None:
        super().__init__()
        self.attn_norm = nn.Identity() if first else nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.ffn_norm = nn.LayerNorm(d)
        self.ffn = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))

    def forward(self, x):
        h = self.attn_norm(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ffn(self.ffn_norm(x))


class Tabular(nn.Module):
    """Numeric features -> per-feature tokens (a weight and bias per feature) + a CLS token, blocks, head."""

    def __init__(self, features: int = 5, d: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(features, d))
        self.bias = nn.Parameter(torch.randn(features, d))
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.blocks = nn.ModuleList(TabularBlock(d, i == 0) for i in range(depth))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        tokens = x[..., None] * self.weight + self.bias
        h = torch.cat([self.cls.expand(len(x), 1, -1), tokens], 1)
        for block in self.blocks:
            h = block(h)
        return self.head(F.relu(self.norm(h[:, 0])))


class NormFormerMLP(nn.Module):
    def __init__(self, d: int, module_act: bool) -> None:
        super().__init__()
        self.up, self.ln, self.down = nn.Linear(d, 2 * d), nn.LayerNorm(2 * d), nn.Linear(2 * d, d)
        self.act = nn.GELU() if module_act else None

    def forward(self, x):
        h = self.up(x)
        h = self.act(h) if self.act is not None else F.gelu(h)
        return self.down(self.ln(h))


class NormFormer(nn.Module):
    """Pre-LN blocks whose MLP normalises its hidden activations (NormFormer), the GELU as a function or a module."""

    def __init__(self, module_act: bool, d: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, d)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(depth))
        self.mlps = nn.ModuleList(NormFormerMLP(d, module_act) for _ in range(depth))
        self.final = nn.LayerNorm(d)

    def forward(self, ids):
        x = self.emb(ids)
        for norm, mlp in zip(self.norms, self.mlps, strict=True):
            x = x + mlp(norm(x))
        return self.final(x)


class ConvNeck(nn.Module):
    """A Pre-LN tower whose raw stream a conv neck reads (a detection backbone): no op can center it."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.patch = nn.Linear(12, d)
        self.stem_norm = nn.LayerNorm(d)
        self.blocks = nn.ModuleList(TabularBlock(d, False) for _ in range(2))
        self.neck = nn.Conv1d(d, 8, 3, padding=1)

    def forward(self, x):
        h = self.stem_norm(self.patch(x))
        for block in self.blocks:
            h = block(h)
        return self.neck(h.transpose(1, 2))


def _ids(shape=(2, 9), vocab=40, seed=0):
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _table(n=4, seed=0):
    return torch.randn(n, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _patch_exact(model, example, probe, **options):
    reference = float64_reference(model, example)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = normswap.patch(model, example_inputs=example, **options)
    with torch.no_grad():
        got, want = model(*probe), reference(*probe)
    got = got.last_hidden_state if hasattr(got, "last_hidden_state") else got
    want = want.last_hidden_state if hasattr(want, "last_hidden_state") else want
    return report, _rel(got, want)


# ------------------------------------------------------------------ §3: an op on a residual sum
def test_modernbert_identity_attn_norm_centers_the_first_residual_sum_and_every_norm_is_exact():
    pytest.importorskip("transformers.models.modernbert")
    model = _modernbert()
    report, err = _patch_exact(model, (_ids(vocab=64),), (_ids((3, 11), vocab=64, seed=1),))
    verdicts = {s.name: s.verdict for s in report.sites}
    assert verdicts["layers.0.mlp_norm"] == "exact-with-centering", report.plan.table()
    assert all(v in ("exact", "exact-with-centering") for v in verdicts.values()), report.plan.table()
    assert [(h.module, h.where, h.arg, h.per_norm) for h in report.plan.hooks] == [
        ("layers.0.attn", "residual", 0, False)]
    assert report.plan.site("layers.0.mlp_norm").reason.startswith(
        "centering op on the residual sum of `layers.0.attn`'s input (argument 0) and its output: stream starts at "
        "`embeddings.norm` output")
    assert err <= 1e-9


def test_modernbert_residual_op_survives_save_and_load(tmp_path):
    pytest.importorskip("transformers.models.modernbert")
    model = _modernbert()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(model, example_inputs=(_ids(vocab=64),))
        normswap.save(model, tmp_path / "mb")
        loaded = normswap.load(tmp_path / "mb", torch_dtype=torch.float64)
    assert [(h.module, h.where, h.arg) for h in normswap.plan_of(loaded).hooks] == [("layers.0.attn", "residual", 0)]
    probe = _ids((2, 7), vocab=64, seed=2)
    with torch.no_grad():  # the reloaded model may pick another attention kernel: float64 noise apart
        assert _rel(loaded(probe).last_hidden_state, model(probe).last_hidden_state) <= 1e-9


def test_tabular_transformer_without_a_first_attention_norm_is_exact_and_round_trips(tmp_path):
    torch.manual_seed(0)
    model = randomise(Tabular()).double().eval()
    fresh = copy.deepcopy(model)
    report, err = _patch_exact(model, (_table(),), (_table(6, seed=1),))
    assert all(s.verdict in ("exact", "exact-with-centering") for s in report.sites), report.plan.table()
    assert report.plan.site("blocks.0.ffn_norm").verdict == "exact-with-centering"
    assert [(h.module, h.where) for h in report.plan.hooks] == [("blocks.0.attn", "residual")]
    assert err <= 1e-9
    # a rotation op cannot follow an op on a sum inside a forward: said, not attempted
    assert all("no rotation op sits on a residual sum" in s.rotation_reason
               for s in report.plan.sites if s.verdict == "exact-with-centering")
    normswap.save(model, tmp_path / "tab")
    loaded = normswap.load(tmp_path / "tab", model=fresh)
    with torch.no_grad():
        assert torch.equal(loaded(_table(3, seed=2)), model(_table(3, seed=2)))


# ------------------------------------------------------------------ §3: the same dataflow in other modules
@pytest.mark.parametrize("per_norm", [False, True])
def test_normformer_mid_mlp_norm_gets_one_verdict_whether_its_gelu_is_a_function_or_a_module(per_norm):
    results = {}
    for module_act in (False, True):
        torch.manual_seed(1)
        model = randomise(NormFormer(module_act)).double().eval()
        report, err = _patch_exact(model, (_ids(),), (_ids((3, 12), seed=1),), per_norm_centering=per_norm,
                                   mode="all")
        results[module_act] = {s.name: s.verdict for s in report.sites}
        mid = [s for s in report.sites if s.name.endswith(".ln")]
        if per_norm:
            assert all(s.verdict == "exact-with-per-norm-centering" for s in mid), report.plan.table()
            assert {(h.module, h.where) for h in report.plan.hooks} == {(s.name, "input") for s in mid}
            assert err <= 1e-9
        else:
            assert all(s.verdict == "approximate" and PROMISE in s.reason and "reaches this norm alone" in s.reason
                       for s in mid), report.plan.table()
            assert not report.plan.hooks  # no per-norm op the user did not ask for
    assert results[False] == results[True]


# ------------------------------------------------------------------ §5: what the reasons say
def _promises_kept(model, example):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = normswap.plan(model, example_inputs=example)
        promised = [s.name for s in plan.sites if PROMISE in s.reason]
        if not promised:
            return [], []
        with_option = normswap.plan(model, example_inputs=example, per_norm_centering=True)
    verdicts = {s.name: s.verdict for s in with_option.sites}
    return promised, [n for n in promised if not verdicts[n].startswith("exact")]


def _images(n=2, size=32, seed=0):
    return torch.randn(n, 3, size, size, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


PROMISING = {
    "post-ln-encoder": (lambda: PostLNEncoder(), lambda: (_ids(),)),
    "post-norm-decoder": (lambda: PostNormDecoder(), lambda: (_ids(),)),
    "tanh-net": (lambda: TanhNet(wrap=False), lambda: (torch.randn(3, 6, dtype=torch.float64),)),
    "tanh-chain": (lambda: TanhNet(wrap=True), lambda: (torch.randn(3, 6, dtype=torch.float64),)),
    "normformer": (lambda: NormFormer(False), lambda: (_ids(),)),
    "swin-reshape": (lambda: SwinStyle(depth=2), lambda: (_images(),)),
    "swin-cat": (lambda: SwinStyle(merge="cat", depth=2), lambda: (_images(),)),
    "conv-stem": (lambda: ConvStemNet(), lambda: (_images(),)),
    "pyramid": (lambda: PyramidStyle(), lambda: (_images(),)),
    "patch-norm-vit": (lambda: PatchNormViT(), lambda: (_images(size=16),)),
    "conv-neck": (lambda: ConvNeck(), lambda: (torch.randn(2, 6, 12, dtype=torch.float64),)),
    "tiny-gpt": (lambda: TinyGPT(), lambda: (_ids(vocab=50),)),
    "tiny-vit": (lambda: TinyViT(), lambda: (_images(),)),
}


@pytest.mark.parametrize("name", sorted(PROMISING))
def test_every_promise_of_per_norm_centering_is_kept(name):
    build, inputs = PROMISING[name]
    torch.manual_seed(0)
    model = randomise(build()).double().eval()
    promised, broken = _promises_kept(model, inputs())
    assert not broken, f"{name}: promised but not exact with per_norm_centering=True: {broken}"


def test_the_swin_stage_feeding_a_patch_merge_is_exact_with_the_option_it_is_promised():
    torch.manual_seed(0)
    model = randomise(SwinStyle(merge="cat", depth=2)).double().eval()
    promised, broken = _promises_kept(model, (_images(),))
    assert len(promised) == 5 and not broken  # the four stage-0 norms and the merge norm


def test_a_pre_ln_tower_blocked_by_a_conv_neck_names_the_reader_and_is_not_called_post_ln():
    torch.manual_seed(2)
    model = randomise(ConvNeck()).double().eval()
    plan = normswap.plan(model, example_inputs=(torch.randn(2, 6, 12, dtype=torch.float64),))
    blocked = [s for s in plan.sites if s.verdict == "approximate"]
    assert blocked, plan.table()
    for s in blocked:
        assert "Post-LN" not in s.reason, s.reason
        assert "`conv1d` in `neck`" in s.reason, s.reason


def test_inspect_and_convert_speak_the_command_line_spelling_of_the_option():
    from normswap.cli.common import cli_words

    torch.manual_seed(0)
    plan = normswap.plan(randomise(PostLNEncoder()).double().eval(), example_inputs=(_ids(),))
    text = cli_words(plan.table())
    assert "--per-norm-centering" in text and "per_norm_centering=True" not in text


@pytest.mark.parametrize("name", ["bert", "bart", "albert"])
def test_every_promise_of_per_norm_centering_is_kept_in_post_ln_transformers(name):
    """The transformers Post-LN families of the zoo: every norm whose reason promises the option is exact
    with it; ALBERT's layer, shared across depth, too: its op runs at every call of the layer (round 61)."""
    from tests.zoo import APPROXIMATE, build

    model = build(APPROXIMATE, name)
    promised, broken = _promises_kept(model, None)
    assert not broken, f"{name}: promised but not exact with per_norm_centering=True: {broken}"
    assert promised
