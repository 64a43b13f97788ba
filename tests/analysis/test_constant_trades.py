"""Constant trades: a centered position table keeps its row means where a bias or class token takes them.

What could be silently wrong: a trade between writers that do not reach the same tokens (not exact, at
the traced size or where the table is resampled), a table still moved by its whole row means (the static
QDQ penalty the trade exists to remove), a trade the compat checkpoint or the manifest loses, a probe that
writes the user's model, and a trade proposed where rows are mixed (each token must read one row).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers as tf
from torch import nn

import normswap
from normswap.analysis.plan import Plan
from tests import benchmark_modules, zoo

EMBEDDING_PARAMS = ("position_embedding", "cls_token", "class_embedding", "distillation_token", "register_tokens")


def _randomise_embeddings(model: nn.Module, seed: int) -> nn.Module:
    """Class/register tokens and position tables with row means that are large and differ per row, and a
    few massive channels (DINOv2's shape), so a trade that moves the wrong constant shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in EMBEDDING_PARAMS):
                rows = p.shape[:-1]
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype)
                        + (0.5 + 0.05 * torch.randn(*rows, 1, generator=g, dtype=p.dtype)))
                p[..., 2:4] += 5
    return model


def _dinov2_registers() -> tuple[type, tf.PretrainedConfig]:
    return tf.Dinov2WithRegistersModel, tf.Dinov2WithRegistersConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2,
        num_register_tokens=2)


def _beit_absolute() -> tuple[type, tf.PretrainedConfig]:
    return tf.BeitModel, tf.BeitConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                       num_attention_heads=4, intermediate_size=64, use_mean_pooling=False,
                                       use_absolute_position_embeddings=True)


BUILDERS = {
    "dinov2": zoo.MORE["dinov2"][0],
    "dinov2-registers": _dinov2_registers,
    "vit": zoo.EXACT["vit"],
    "deit": zoo.MORE["deit"][0],
    "clip-vision": zoo.EXACT["clip-vision"],
    "beit-absolute": _beit_absolute,
    "gpt2": zoo.EXACT["gpt2"],
}
# the trades each model gets: (first row, end row, taker's last name part); every token's sum zero-mean
EXPECTED = {
    "dinov2": {(0, 1, "cls_token"), (1, 17, "bias")},
    "dinov2-registers": {(0, 1, "cls_token"), (1, 17, "bias")},
    "vit": {(0, 1, "cls_token"), (1, 17, "bias")},
    "deit": {(0, 1, "cls_token"), (1, 2, "distillation_token"), (2, 18, "bias")},
    "clip-vision": {(0, 1, "class_embedding")},  # its patch convolution has no bias: the patch rows stay centered
    "beit-absolute": {(0, 1, "cls_token"), (1, 17, "bias")},
    "gpt2": set(),  # wte + wpe: no float writer reaches every token (see docs/concepts.md)
}


def _build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cls, config = BUILDERS[name]()
    return _randomise_embeddings(zoo.randomise(cls(config), seed), seed)


def _inputs(name: str, model: nn.Module, size: int | None = None) -> dict:
    g = torch.Generator().manual_seed(7)
    if name == "gpt2":
        return {"input_ids": torch.randint(1, 99, (2, 9), generator=g)}
    size = size or model.config.image_size
    kw = {"pixel_values": torch.randn(2, 3, size, size + 8 * (size != model.config.image_size), generator=g,
                                      dtype=torch.float64)}
    if name in ("vit", "deit", "clip-vision", "beit-absolute"):
        kw["interpolate_pos_encoding"] = True
    return kw


def _outputs(model: nn.Module, kw: dict) -> list[torch.Tensor]:
    with torch.no_grad():
        out = model(**kw)
    return [v for k, v in out.items() if isinstance(v, torch.Tensor) and k != "last_hidden_state"] \
        or [out.last_hidden_state]


def _patched(model: nn.Module, **options) -> nn.Module:
    # the trades are between centered writers: the patch convolution's stream centered by weights, not by the
    # stem op (stem_centering="op", the default, leaves every writer of a ViT's start as it is: nothing to trade)
    options.setdefault("stem_centering", "weights")
    conv = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(conv, **options)
    return conv


@pytest.fixture(scope="module")
def converted() -> dict[str, tuple[nn.Module, nn.Module]]:
    return {}


def _pair(cache: dict, name: str) -> tuple[nn.Module, nn.Module]:
    if name not in cache:
        model = _build(name)
        cache[name] = (model, _patched(model))
    return cache[name]


@pytest.mark.parametrize("name", list(BUILDERS))
def test_trades_are_found_and_exact_at_the_configured_and_another_size(converted, name):
    model, conv = _pair(converted, name)
    trades = normswap.plan(model, stem_centering="weights").constant_trades
    assert {(t.lo, t.hi, t.into.rsplit(".", 1)[-1]) for t in trades} == EXPECTED[name]
    sizes = [None] if name == "gpt2" else [None, 48]  # 48 px: a 6×7 grid resampled from the 4×4 table
    for size in sizes:
        kw = _inputs(name, model, size)
        # transformers' DINOv2 resamples the table in float32 whatever the model's dtype: both models then
        # carry float32 rounding, the same with or without the trade (checked below)
        tol = 1e-6 if size and name.startswith("dinov2") else 1e-9
        for ref, out in zip(_outputs(model, kw), _outputs(conv, kw), strict=True):
            assert (out - ref).abs().max() <= tol * max(1.0, float(ref.abs().max())), (name, size)


@pytest.mark.parametrize("name", ["dinov2", "vit", "deit"])
def test_the_position_table_moves_by_the_spread_of_its_row_means_not_by_them(converted, name):
    """Static QDQ rounds the stream before and after the table is added: entries that stay where the
    original's were are rounded once. With the trade each patch row moves by ``|m_t − μ|``; without it
    (each writer centered alone, the centering before this) by ``|m_t|``, which this bound rejects."""
    model, conv = _pair(converted, name)
    first = 2 if name == "deit" else 1  # the rows of the patch tokens
    key = next(n for n, _ in model.named_parameters() if n.endswith("position_embeddings"))
    before = model.get_parameter(key)[0].detach()
    means = before.mean(-1)
    spread = (means[first:] - means[first:].mean()).abs()

    def moved(m: nn.Module) -> torch.Tensor:
        return (m.get_parameter(key)[0].detach() - before).abs().amax(-1)

    assert bool((moved(conv)[first:] <= spread + 1e-12).all())
    assert float(moved(conv)[:first].max()) <= 1e-12  # class/distillation rows: their tokens took the mean
    alone = moved(_patched(model, trade_constants=False))
    assert not bool((alone[first:] <= spread + 1e-12).all())  # the per-writer centering breaks the bound


def test_dinov2_resampled_in_float32_keeps_every_token_zero_mean(converted):
    """Where transformers resamples in float32, the float64 stream is zero-mean to float32's rounding of the
    table's entries, as without the trade: the constant the table keeps survives the bicubic weights (they
    sum to 1)."""
    model, conv = _pair(converted, "dinov2")
    alone = _patched(model, trade_constants=False)
    px = _inputs("dinov2", model, 48)["pixel_values"]
    with torch.no_grad():
        traded, centered = conv.dinov2.embeddings(px), alone.dinov2.embeddings(px)
    table = model.dinov2.embeddings.position_embeddings.detach()
    rounding = 8 * torch.finfo(torch.float32).eps * float(table.abs().max())
    assert traded.mean(-1).abs().max() <= rounding
    assert centered.mean(-1).abs().max() <= rounding


def test_the_default_conversion_is_the_benchmarks_hand_retrade():
    """``bench_quant_engines.retraded`` (measured 0.996× the original in static QDQ) by hand, applied to a
    conversion without trades, gives the default conversion's tensors."""
    from tests.benchmarks.test_quant_engines_pieces import _tiny_dino

    engines = benchmark_modules.load("bench_quant_engines")

    model = _tiny_dino()
    default = _patched(model)
    by_hand = engines.retraded(_patched(model, trade_constants=False), model)
    a, b = default.state_dict(), by_hand.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k].double() - b[k].double()).abs().max() <= 1e-12, k


def test_compat_and_native_checkpoints_keep_the_trade(converted, tmp_path):
    model, conv = _pair(converted, "dinov2")
    kw = _inputs("dinov2", model)
    refs = _outputs(model, kw)
    normswap.save(conv, tmp_path / "compat", format="compat")
    stock = tf.Dinov2ForImageClassification.from_pretrained(tmp_path / "compat", dtype=torch.float64).eval()
    assert not any(isinstance(m, normswap.RMSNorm) for m in stock.modules())
    normswap.save(conv, tmp_path / "native")
    native = normswap.load(tmp_path / "native", dtype=torch.float64).eval()
    for loaded in (stock, native):
        for ref, out in zip(refs, _outputs(loaded, kw), strict=True):
            assert (out - ref).abs().max() <= 1e-9 * max(1.0, float(ref.abs().max()))
    plan = normswap.analysis.plan.plan_of(native)
    assert Plan.from_dict(conv._normswap_plan.to_dict()).constant_trades == conv._normswap_plan.constant_trades
    assert plan is not None and len(plan.constant_trades) == 2


def test_a_float32_working_copy_proves_the_same_trades():
    """A model too big for a float64 copy is analysed in float32: the trades must not depend on that."""
    model = _build("deit").float()
    in_64 = normswap.plan(model, stem_centering="weights").constant_trades
    in_32 = normswap.plan(model, verify_dtype="float32", stem_centering="weights").constant_trades
    assert in_32 == in_64 and len(in_64) == 3


def test_planning_probes_without_writing_the_model():
    model = _build("vit")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert normswap.plan(model, stem_centering="weights").constant_trades
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


class _Tokens(nn.Module):
    """A custom encoder: a Linear input projection plus a learned position table, then two Pre-LN blocks and a
    final norm. ``read``: how each token reads the table: its own row (``"row"``), the mean of two
    neighbouring rows (``"mixed"``: weights that sum to 1, as a resampled grid's), or half its row
    (``"halved"``: a constant in the table reaches the token at half strength, so no bias can take it)."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.read = read
        self.proj = nn.Linear(6, 16)
        self.pos = nn.Parameter(torch.randn(1, 12, 16) + 0.5 + torch.randn(1, 12, 1) * 0.1)
        self.norms = nn.ModuleList(nn.LayerNorm(16) for _ in range(3))
        self.fcs = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        pos = self.pos[:, :t]
        if self.read == "mixed":
            pos = (pos + self.pos[:, 1:t + 1]) / 2
        elif self.read == "halved":
            pos = pos * 0.5
        h = self.proj(x) + pos
        for norm, fc in zip(self.norms, self.fcs, strict=False):
            h = h + fc(norm(h))
        return self.head(self.norms[-1](h))


@pytest.mark.parametrize("read", ["row", "mixed", "halved"])
def test_a_custom_model_trades_where_every_token_reads_the_table_with_weights_summing_to_one(read):
    torch.manual_seed(0)
    model = zoo.randomise(_Tokens(read), 0)
    x = torch.randn(3, 8, 6, dtype=torch.float64)
    trades = normswap.plan(model, (x,), stem_centering="weights").constant_trades
    if read == "halved":
        assert trades == []
    else:  # every row (those the 8 tokens read, and those longer inputs read) keeps the mean row mean; the
        # projection's bias takes it
        assert [(t.table, t.lo, t.hi, t.into) for t in trades] == [("pos", 0, 12, "proj.bias")]
    conv = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(conv, (x,), stem_centering="weights")
    for length in (8, 11):  # 11: rows no analysis token read, which the bias's block must hold too
        y = torch.randn(2, length, 6, dtype=torch.float64)
        assert (conv(y) - model(y)).abs().max() <= 1e-9


def test_a_one_row_table_every_token_reads_takes_the_constant_of_every_row_at_any_length_and_padding():
    """RoBERTa's token-type table has one row that every token reads: it reaches every token at any length,
    as a bias does, so the rows a longer or padded input reads must keep the constant too (a trade of only the
    rows the traced tokens read left every other position's sum off zero-mean: CLAP's text tower failed its
    verification so). Since round 63 the defaults keep a Post-LN encoder's tables (no edit, no trade: asserted);
    with γ folded (``fold_gamma``) the tables keep their edit, as round 62's defaults had it: the trade is tested
    there."""
    torch.manual_seed(0)
    cfg = tf.RobertaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=40, type_vocab_size=1)
    model = zoo.randomise(tf.RobertaModel(cfg, add_pooling_layer=False).double().eval(), 0)
    with torch.no_grad():  # position rows with large means that differ per row
        table = model.embeddings.position_embeddings.weight
        table.add_(0.5 + 0.05 * torch.randn(table.shape[0], 1, dtype=table.dtype))
    short = {"input_ids": torch.randint(3, 40, (2, 6))}
    assert not normswap.plan(model, short).constant_trades  # the defaults: the tables keep their rows
    conv = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normswap.patch(conv, short, mode="exact", fold_gamma=True)  # Post-LN: only the exact norms
    trades = normswap.plan(model, short, fold_gamma=True).constant_trades
    table_trade = next(t for t in trades if t.table == "embeddings.position_embeddings.weight")
    assert (table_trade.lo, table_trade.hi, table_trade.into) == (0, 40, "embeddings.token_type_embeddings.weight")
    ids = torch.randint(3, 40, (2, 30))
    mask = torch.ones_like(ids)
    ids[1, 20:], mask[1, 20:] = cfg.pad_token_id, 0  # padded positions read the padding row
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
        out = conv(input_ids=ids, attention_mask=mask).last_hidden_state
    assert (out - ref).abs().max() <= 1e-9 * ref.abs().max()


def test_the_command_line_trades_by_default_and_not_with_no_constant_trades(tmp_path):
    """``normswap convert`` records the trades in the manifest; ``--no-constant-trades`` (``trade_constants=False``)
    converts with none, exact either way (the command verifies the output)."""
    import json

    from click.testing import CliRunner

    from normswap.cli import main

    for flags, out in (([], "traded"), (["--no-constant-trades"], "alone")):
        res = CliRunner().invoke(main, ["convert", "tiny-vit", "--out", str(tmp_path / out), "-q",
                                        "--stem-centering", "weights", *flags])
        assert res.exit_code == 0, res.stderr
        manifest = json.loads((tmp_path / out / "config.json").read_text())["normswap"]
        trades = manifest["plan"]["constant_trades"]
        assert bool(trades) == (not flags), trades
        assert manifest["plan"]["options"]["trade_constants"] is (not flags)
