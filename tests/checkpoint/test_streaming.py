"""Low-memory (streaming) conversion: bitwise equal to the in-memory path, correct sharding, never
loads the model, extrapolates per-layer plans only when the check passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers as tf
from click.testing import CliRunner
from safetensors import safe_open

import normswap
from normswap import presets
from normswap.analysis.plan import BETA_KEPT_WHY
from normswap.checkpoint import conversion as convert_mod
from normswap.checkpoint import extrapolate, proxy, stream_io
from normswap.errors import NormswapError
from tests.streaming_models import converting_once

SPECIAL = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
MODELS = {
    # deeper than the 3/4-layer proxies, so the plan is extrapolated and the extrapolation checked
    "gpt2-6": lambda: (
        tf.GPT2LMHeadModel,
        tf.GPT2Config(n_layer=6, n_embd=32, n_head=4, vocab_size=99, n_positions=64, **SPECIAL),
    ),
    "bert-5": lambda: (
        tf.BertForMaskedLM,
        tf.BertConfig(
            hidden_size=32,
            num_hidden_layers=5,
            num_attention_heads=4,
            intermediate_size=64,
            vocab_size=99,
            max_position_embeddings=64,
            pad_token_id=0,
        ),
    ),
    "vit-5": lambda: (
        tf.ViTForImageClassification,
        tf.ViTConfig(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            num_hidden_layers=5,
            num_attention_heads=4,
            intermediate_size=64,
            num_labels=5,
        ),
    ),
    "whisper-5-6": lambda: (
        tf.WhisperForConditionalGeneration,
        tf.WhisperConfig(
            d_model=32,
            encoder_layers=5,
            decoder_layers=6,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            vocab_size=99,
            num_mel_bins=8,
            max_source_positions=16,
            max_target_positions=32,
            decoder_start_token_id=0,
            **SPECIAL,
        ),
    ),
    # a bias-less value projection: norm1's β moves through attention into o_proj's bias (plan.BetaMove)
    "dinov3-5": lambda: (
        tf.DINOv3ViTModel,
        tf.DINOv3ViTConfig(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_register_tokens=2,
            key_bias=True,
            value_bias=False,
            out_indices=[1],  # the default (last stage) names a layer the 3-layer proxy does not have
        ),
    ),
    "gpt_neo": lambda: (
        tf.GPTNeoForCausalLM,
        tf.GPTNeoConfig(
            num_layers=6,
            hidden_size=32,
            num_heads=4,
            vocab_size=99,
            max_position_embeddings=64,
            attention_types=[[["global", "local"], 3]],
            **SPECIAL,
        ),
    ),
}


def save_model(name: str, root: Path, shard: str = "40KB") -> Path:
    cls, config = MODELS[name]()
    torch.manual_seed(0)
    model = presets.randomise_norms(cls(config)).eval()
    out = root / name
    model.save_pretrained(out, max_shard_size=shard)
    return out


def tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def assert_same_tensors(a: Path, b: Path) -> None:
    ta, tb = tensors(a), tensors(b)
    assert set(ta) == set(tb)
    different = [k for k in ta if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
    assert not different, different[:5]


def test_streaming_refuses_approximate_norms_it_cannot_calibrate(sources, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(NormswapError, match="need calibration on the whole model.*--mode exact"):
        normswap.convert(sources["bert-5"], out, low_memory=True, mode="all")
    assert not out.exists() and not list(tmp_path.iterdir())


def assert_same_plan(a: Path, b: Path) -> None:
    pa = json.loads((a / "config.json").read_text())["normswap"]["plan"]
    pb = json.loads((b / "config.json").read_text())["normswap"]["plan"]
    for key in ("writer_edits", "folds", "hooks", "unties", "skipped", "changed_outputs", "mean_carries",
                "beta_moves"):
        assert pa[key] == pb[key], key
    # round 55: the adapter bases too (their vectors are in normswap_adapter_bases.safetensors, which
    # assert_same_tensors compares with the weights)
    assert pa.get("adapter_bases") == pb.get("adapter_bases")
    strip = ("error",)
    assert [{k: v for k, v in s.items() if k not in strip} for s in pa["sites"]] == [
        {k: v for k, v in s.items() if k not in strip} for s in pb["sites"]
    ]


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("src")
    out = {name: save_model(name, root) for name in MODELS}
    out["tiny-whisper"] = presets.save("tiny-whisper", root / "tiny-whisper", max_shard_size="40KB")
    return out


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory):
    """Each conversion made once per module (:func:`tests.streaming_models.converting_once`)."""
    return converting_once(sources, tmp_path_factory.mktemp("converted"))


@pytest.mark.parametrize(
    "name, options",
    [
        ("gpt2-6", {}),  # a checkpoint's default: every β kept
        ("gpt2-6", {"untie": False, "beta_placement": "rounding"}),  # the rule, taken on the tensors
        ("gpt2-6", {"dtype": "bfloat16", "beta_placement": "rounding"}),
        ("gpt2-6", {"format": "compat", "beta_placement": "keep"}),  # every β kept, taken at full depth
        ("bert-5", {"mode": "exact"}),
        ("bert-5", {"format": "compat"}),
        ("vit-5", {"beta_placement": "rounding"}),
        ("tiny-whisper", {}),
        ("tiny-whisper", {"beta_placement": "rounding"}),
        ("tiny-whisper", {"format": "compat"}),
        ("dinov3-5", {"beta_placement": "fold"}),  # the moved value shares, in every layer
        ("dinov3-5", {"format": "compat", "beta_placement": "fold"}),
        # γ folded into the readers, β kept where no bias takes it (the LM head): the norm keeps β/γ, as in
        # memory (round 56: the streamed rewrite wrote β, which failed its own verification whenever γ ≠ 1)
        ("gpt2-6", {"fold_gamma": True, "bias_slots": False}),
        ("gpt2-6", {"fold_gamma": True, "bias_slots": False, "format": "compat"}),
    ],
)
def test_streaming_is_bitwise_equal_to_in_memory(converted, name, options):
    mem, _ = converted(name, False, **options)
    stream, report = converted(name, True, **options)
    assert report.streamed and report.output is not None
    assert_same_tensors(mem, stream)
    assert_same_plan(mem, stream)
    # a checkpoint's default, either format (with fold_gamma β leaves every norm whose readers take it)
    keep = options.get("beta_placement", "keep") == "keep" and not options.get("fold_gamma")
    if name in ("gpt2-6", "vit-5", "tiny-whisper") and options.get("beta_placement") == "rounding":
        # the β placement rule, taken on the checkpoint's tensors, kept β in the same norms as in memory
        # (assert_same_plan); on these random weights it keeps some
        assert any(s.beta_detail.startswith(BETA_KEPT_WHY) for s in report.plan.sites), report.plan.table()
    if keep:  # every foldable β kept, none in a reader bias
        assert report.plan.options["beta_placement"] == "keep" and not any(f.beta for f in report.plan.folds)
    if name == "bert-5" and options.get("format") != "compat":  # FFN-output norms exact: widened MLPs streamed
        assert len(report.plan.mean_carries) == 5
    if name == "tiny-whisper" and not keep:  # bias-less k_proj: β dropped at the keys
        assert sum(f.beta_route == "dropped" for f in report.plan.folds) > 0
    if name == "dinov3-5":  # bias-less v_proj: β moved into o_proj's bias, in every layer at full depth
        assert [m.into for m in report.plan.beta_moves] == [f"model.layer.{i}.attention.o_proj" for i in range(5)]
    figures = report.verification
    exact = options.get("mode") != "all"
    limit = 5e-2 if options.get("dtype") == "bfloat16" else 1e-5
    assert (
        (figures["truncated_max_rel_error"] < limit) if exact else (figures["truncated_max_rel_error"] > 1e-4)
    )
    if name != "tiny-whisper":
        assert "[0, 1, 4]" in figures["truncated_layers"] or "[0, 1, 5]" in figures["truncated_layers"]


def test_streamed_whisper_is_exact_on_the_full_model(sources, tmp_path):
    """Two layer stacks, a centering op and cross-attention readers, extrapolated from 3/4-layer proxies."""
    out = tmp_path / "w"
    report = normswap.convert(sources["whisper-5-6"], out, low_memory=True)
    plan = report.plan
    assert len(plan.sites) == 2 * 5 + 3 * 6 + 2 and len(plan.hooks) == 2  # the stem's, the tied decoder table's
    assert "extrapolated" in plan.options["analysis"]
    converted = normswap.load(out)
    original = tf.WhisperForConditionalGeneration.from_pretrained(sources["whisper-5-6"]).eval()
    from normswap.inputs import hf_example_inputs

    probe = hf_example_inputs(original, seed=3)
    with torch.no_grad():
        ref, got = original(**probe).logits, converted(**probe).logits
    assert (got - ref).abs().max() / ref.abs().max() < 1e-5


def test_streamed_compat_with_moved_value_beta_runs_exactly_in_stock_transformers(sources, converted):
    """Compat keeps the stock DINOv3 structure: o_proj's existing bias took v_proj's share of β, the
    LayerNorm's own β is zero, and plain transformers reproduces the original outputs."""
    out, report = converted("dinov3-5", True, format="compat", beta_placement="fold")  # a case of the test above
    assert len(report.plan.beta_moves) == 5
    stock = tf.DINOv3ViTModel.from_pretrained(out).eval()
    original = tf.DINOv3ViTModel.from_pretrained(sources["dinov3-5"]).eval()
    assert all(torch.all(stock.get_submodule(m.site).bias == 0) for m in report.plan.beta_moves)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref, got = original(pixel_values=pixels).pooler_output, stock(pixel_values=pixels).pooler_output
    assert (got - ref).abs().max() / ref.abs().max() < 1e-5


def test_streamed_shards_are_valid_and_bounded(sources, tmp_path):
    out = tmp_path / "s"
    normswap.convert(sources["gpt2-6"], out, low_memory=True, max_shard_size="30KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(out.glob("*.safetensors"))
    assert len(files) > 3 and set(index["weight_map"].values()) == {f.name for f in files}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors(out).values())
    for f in files:
        with safe_open(str(f), "pt") as h:
            assert h.metadata() == {"format": "pt"}
            sizes = [h.get_tensor(k).numel() * 4 for k in h.keys()]
        assert sum(sizes) <= 30_000 or len(sizes) == 1
    assert normswap.load(out) is not None


def test_streaming_never_loads_the_model(sources, converted, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the streaming path must not load the model")

    monkeypatch.setattr(tf.PreTrainedModel, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(stream_io, "REOPEN_BYTES", 1)  # re-open the shard handles constantly: same result
    normswap.convert(sources["gpt2-6"], tmp_path / "s", low_memory=True)
    monkeypatch.undo()
    mem, _ = converted("gpt2-6", False)  # the in-memory conversion of the bitwise test's first case
    assert_same_tensors(mem, tmp_path / "s")


def test_low_memory_is_chosen_automatically_for_big_checkpoints(sources, tmp_path, monkeypatch):
    size = sum(f.stat().st_size for f in sources["gpt2-6"].glob("*.safetensors"))
    monkeypatch.setattr(convert_mod, "available_memory", lambda: size)  # checkpoint > half of "RAM"
    monkeypatch.setattr(proxy, "available_memory", lambda: 8 << 30)  # ... while the small proxies fit
    notes = []
    report = normswap.convert(sources["gpt2-6"], tmp_path / "auto", echo=notes.append)
    assert report.streamed and report.output is not None
    assert any("--low-memory" in n for n in notes)


def test_an_automatically_streamed_post_ln_model_names_in_memory_as_the_way_out(sources, tmp_path, monkeypatch):
    """The user asked for no --low-memory: the refusal says why it streamed and offers --in-memory."""
    monkeypatch.setattr(convert_mod, "available_memory", lambda: 1)  # nothing fits in memory
    monkeypatch.setattr(proxy, "available_memory", lambda: 8 << 30)
    out = tmp_path / "out"
    with pytest.raises(NormswapError, match="predicted not to fit.*--in-memory.*--mode exact"):
        normswap.convert(sources["bert-5"], out, mode="all")
    assert not out.exists()


def test_cli_low_memory(sources, tmp_path):
    from normswap.cli import main

    res = CliRunner().invoke(
        main, ["convert", str(sources["vit-5"]), "--out", str(tmp_path / "v"), "--low-memory"]
    )
    assert res.exit_code == 0, res.stderr
    assert "truncated" in res.stdout or "verification" in res.stdout
    assert (tmp_path / "v" / "modeling_normswap.py").is_file()


def test_per_layer_config_lists_are_reduced(sources, tmp_path):
    # GPT-Neo alternates global/local attention through a per-layer list: cut with the layers
    report = normswap.convert(sources["gpt_neo"], tmp_path / "n", low_memory=True)
    assert report.verification["truncated_max_rel_error"] < 1e-5


def test_non_uniform_layers_are_refused_cleanly(sources, tmp_path, monkeypatch):
    real = proxy.analyse_proxy

    def non_uniform(model, opts):  # pretend layer 2 of the 4-layer proxy is different
        plan = real(model, opts)
        if len(model.transformer.h) == 4:
            plan.folds = [f for f in plan.folds if not f.site.startswith("transformer.h.2.")]
        return plan

    monkeypatch.setattr(proxy, "analyse_proxy", non_uniform)
    with pytest.raises(NormswapError, match="convert in memory") as info:
        normswap.convert(sources["gpt2-6"], tmp_path / "n", low_memory=True)
    assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_streaming_refuses_pickle_and_presets(sources, tmp_path):
    with pytest.raises(NormswapError, match="save the preset first"):
        normswap.convert("tiny-gpt2", tmp_path / "p", low_memory=True)
    assert list(tmp_path.iterdir()) == []


def test_extrapolation_check_rejects_non_uniform_layers(tmp_path):
    cls, config = MODELS["gpt2-6"]()
    plans, depths = {}, {}
    for d in (3, 4):
        model = proxy.build_proxy(cls, proxy.reduced_config(config, d), torch.float64)
        plans[d] = proxy.analyse_proxy(model, normswap.ConvertOptions(untie=True)).to_dict()
        depths[d] = {"transformer.h": d}
    extrapolate.check(plans[3], plans[4], depths[3], depths[4])  # uniform: passes
    tampered = json.loads(json.dumps(plans[4]))
    tampered["folds"] = [f for f in tampered["folds"] if not f["site"].startswith("transformer.h.2.")]
    with pytest.raises(extrapolate.ExtrapolationError, match="not uniform"):
        extrapolate.check(plans[3], tampered, depths[3], depths[4])
    six = extrapolate.extrapolate(plans[3], depths[3], {"transformer.h": 6})
    names = [s["name"] for s in six["sites"]]
    assert names == [f"transformer.h.{i}.ln_{k}" for i in range(6) for k in (1, 2)] + ["transformer.ln_f"]
    last = six["sites"][-1]
    assert len(last["writers"]) == 2 + 2 * 6 and last["reason"] == "stream written by 14 centered writer(s)"


def test_shard_writer_round_trip(tmp_path):
    data = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(4).bfloat16(),
        "d": torch.tensor(2.5),
    }
    layout = [(k, stream_io.ST_DTYPES[v.dtype], tuple(v.shape)) for k, v in data.items()]
    w = stream_io.ShardWriter(tmp_path / "x.safetensors", layout)
    for k, v in data.items():
        w.write(k, v)
    w.close()
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as h:
        assert h.metadata() == {"format": "pt"}
        for k, v in data.items():
            assert torch.equal(h.get_tensor(k), v)
    bad = stream_io.ShardWriter(tmp_path / "y.safetensors", layout)
    with pytest.raises(RuntimeError, match="expected a"):
        bad.write("b", data["b"])
    with pytest.raises(RuntimeError, match="incomplete"):
        bad.close()


def test_an_integer_tensor_stored_first_does_not_set_the_streamed_dtype(tmp_path):
    """Older BERT checkpoints (sentence-transformers' all-MiniLM-L6-v2) store the int64 ``position_ids`` buffer
    as their first tensor: the streamed conversion takes the weights' dtype from the first floating tensor, so
    it verifies and writes what the in-memory conversion writes (it crashed in ``torch.finfo(int64)``)."""
    from safetensors.torch import load_file, save_file

    src = save_model("bert-5", tmp_path / "src", shard="10GB")
    weights = load_file(src / "model.safetensors")
    first = {"bert.embeddings.position_ids": torch.arange(64).unsqueeze(0)}
    save_file({**first, **weights}, src / "model.safetensors", metadata={"format": "pt"})
    streamed, in_memory = tmp_path / "streamed", tmp_path / "in-memory"
    report = normswap.convert(src, streamed, low_memory=True, mode="exact")
    assert report.verification["truncated_max_rel_error"] < 1e-6
    normswap.convert(src, in_memory, mode="exact")
    assert_same_tensors(streamed, in_memory)
