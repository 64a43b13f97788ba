"""``--low-memory`` equals the in-memory conversion for the option combinations where round 57's sweep
(``benchmarks/lowmem_option_sweep.py``) found them apart: the same tensors (bitwise), the same manifest (less the
verification figures and the analysis line, which must differ) and the same side files. Tiny models, deeper than
the 3/4-layer proxies so the streamed plan is extrapolated; a small pairwise set, not the sweep."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers as tf

import normswap
from normswap import presets
from tests.streaming_models import MODELS as STREAMING_MODELS
from tests.streaming_models import converting_once, written_tensors

# the sweep's models but OPT (GPT-2 covers its structure here); DINOv2 with the default backbone settings:
# out_features names the last of 5 stages, which a 3-layer copy lacks
MODELS = {name: STREAMING_MODELS[name] for name in ("gpt2", "whisper", "bert", "dinov2", "bert_cls", "gptj")}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("combos")
    out = {}
    for name, make in MODELS.items():
        cls, config = make()
        torch.manual_seed(0)
        model = presets.randomise_norms(cls(config)).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lambda" in pname:  # LayerScale spread as real DINOv2's
                    p.copy_(torch.exp(1.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1))))
        model.save_pretrained(root / name, max_shard_size="40KB")
        out[name] = root / name
    return out


@pytest.fixture(scope="module")
def converted(sources, tmp_path_factory):
    """Each conversion made once per module (:func:`tests.streaming_models.converting_once`)."""
    return converting_once(sources, tmp_path_factory.mktemp("converted"))


def _manifest(d: Path) -> dict[str, Any]:
    """The written manifest less what must differ: the verification (streamed: layers 0, 1 and L-1), the
    analysis line, and each norm's error (the streamed plan's is the proxy's)."""
    m = json.loads((d / "config.json").read_text())["normswap"]
    m = {k: v for k, v in m.items() if k not in ("verification", "streamed")}
    plan = dict(m["plan"])
    plan["options"] = {k: v for k, v in plan["options"].items() if k not in ("analysis", "analysis_inputs")}
    plan["sites"] = [{k: v for k, v in s.items() if k != "error"} for s in plan["sites"]]
    m["plan"] = plan
    return m


def assert_same_output(mem: Path, stream: Path) -> None:
    ta, tb = written_tensors(mem), written_tensors(stream)
    assert sorted(ta) == sorted(tb)
    different = [k for k in ta if ta[k].dtype != tb[k].dtype or not torch.equal(ta[k], tb[k])]
    assert not different, different[:5]
    assert _manifest(mem) == _manifest(stream)
    side = {p.name for p in mem.iterdir() if p.suffix != ".safetensors"} - {"model.safetensors.index.json"}
    assert side == {p.name for p in stream.iterdir() if p.suffix != ".safetensors"} - {"model.safetensors.index.json"}
    for name in side - {"config.json", "README.md"}:
        assert (mem / name).read_bytes() == (stream / name).read_bytes(), name
    assert _card(mem) == _card(stream)


def _card(d: Path) -> str:
    """The model card less its verification section (other figures streamed) and the directory's name."""
    text = (d / "README.md").read_text().replace(f"# {d.name}\n", "# OUT\n").replace(f'("{d.name}")', '("OUT")')
    head, _, rest = text.partition("## Verification")
    return head + rest[rest.find("## How to load"):]


@pytest.mark.parametrize("name, options", [
    # γ folded everywhere: the tied LM head's share of β goes into a bias slot in memory; the streamed rewrite
    # made none and kept β/γ in the last norm (round 57: other tensors, another manifest)
    ("gpt2", {"fold_gamma": True}),
    ("gpt2", {"fold_gamma": True, "format": "compat"}),  # the slot's shift back in the norm, solved alike
    ("whisper", {"fold_gamma": True, "untie": False, "dtype": "bfloat16"}),
    # the centering ops after each writer: listed layer by layer, not grouped by template
    ("gpt2", {"writer_centering": "op", "beta_placement": "fold"}),
    ("whisper", {"writer_centering": "op", "format": "compat"}),
    # Post-LN, compat: the card listed the verdicts in another order (the in-memory card is written again from
    # config.json, whose keys are sorted)
    ("bert", {"format": "compat"}),
    # round 58: bias slots inside the layers (GPT-J's q/k/v, three per layer): the streamed manifest listed them
    # grouped by template (h.0.k_proj, h.1.k_proj, ...), memory layer by layer; compat moves each slot's shift
    # back into ln_1 and takes it out of fc_in's bias (the slotted norm's other β-taking reader) again
    ("gptj", {"fold_gamma": True}),
    ("gptj", {"fold_gamma": True, "format": "compat", "dtype": "bfloat16"}),
    # a backbone config's stage names: the 3-layer copy refused to build (exit 1)
    ("dinov2", {}),
    ("dinov2", {"fold_gamma": True, "layer_scale": "fold", "writer_centering": "op"}),
    # round 58: the bare model from a checkpoint with a head: the streamed path kept the checkpoint's prefixed
    # names (transformer.h.0...) where memory saves the loaded model's own (h.0...)
    ("gpt2", {"task": "base"}),
    ("gpt2", {"task": "base", "fold_gamma": True, "format": "compat", "max_shard_size": "16KB"}),
    ("whisper", {"task": "base", "writer_centering": "op"}),
    # ... and copied the head's tensors (classifier.*) the bare model does not hold; memory leaves them out
    ("bert_cls", {"task": "base", "mode": "exact"}),
])
def test_low_memory_writes_what_in_memory_writes(converted, name, options):
    mem, _ = converted(name, False, **options)
    stream, report = converted(name, True, **options)
    assert report.streamed
    assert_same_output(mem, stream)
    if options.get("fold_gamma") and name == "gpt2" and "task" not in options:  # native: there; compat: gone back
        slots = json.loads((stream / "config.json").read_text())["normswap"]["plan"]["bias_slots"]
        assert [s["reader"] for s in slots] == ["lm_head"]
    if options.get("task") == "base":  # neither the head's prefix nor the head itself
        prefixed = (":transformer.", ":model.", ":bert.", ":classifier.")
        assert not any(k.startswith(prefixed) for k in written_tensors(stream))
    if name == "gptj":  # the slots inside the layers, all five layers'
        slots = json.loads((stream / "config.json").read_text())["normswap"]["plan"]["bias_slots"]
        assert [s["reader"] for s in slots] == [f"transformer.h.{i}.attn.{p}_proj" for i in range(5) for p in "kqv"]


def test_streamed_shards_and_index_agree(sources, tmp_path):
    """With shards small enough to split the model into several files, the index names, for every tensor, the
    file that holds it, and its total size is the tensors' bytes (the streamed writer's own layout)."""
    from safetensors import safe_open

    out = tmp_path / "s"
    normswap.convert(sources["gpt2"], out, low_memory=True, max_shard_size="16KB", fold_gamma=True)
    files = sorted(out.glob("model-*.safetensors"))
    assert len(files) > 3
    index = json.loads((out / "model.safetensors.index.json").read_text())
    held, total = {}, 0
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                t = h.get_tensor(k)
                held[k], total = f.name, total + t.numel() * t.element_size()
    assert index["weight_map"] == held
    assert int(index["metadata"]["total_size"]) == total
    assert all(f.stat().st_size <= 16_000 + 4096 or len(safe_open(str(f), "pt").keys()) == 1 for f in files)


def test_streamed_bias_slot_is_exact_in_float64(sources, converted):
    """The streamed GPT-2 with γ folded and β in the head's new bias computes the original's logits (float64)."""
    out, _ = converted("gpt2", True, fold_gamma=True)  # the first case of the test above
    original = tf.GPT2LMHeadModel.from_pretrained(sources["gpt2"]).double().eval()
    converted = normswap.load(out).double().eval()
    assert converted.lm_head.bias is not None
    ids = torch.randint(0, 99, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, got = original(ids).logits, converted(ids).logits
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-6  # float32 weights, float64 arithmetic


def test_inspect_low_memory_shows_the_plan_convert_low_memory_writes_with_mean_carries(sources, tmp_path):
    """BERT's widened MLPs: ``inspect --low-memory`` showed the random-weight proxies' carry scales, the streamed
    conversion writes the real weights' (round 57); now the shown plan is the written one, field for field."""
    from click.testing import CliRunner

    from normswap.cli import main

    out = tmp_path / "o"
    shown = CliRunner().invoke(main, ["inspect", str(sources["bert"]), "--json", "--low-memory", "--mode", "exact"])
    assert shown.exit_code == 0, shown.stderr
    normswap.convert(sources["bert"], out, low_memory=True, mode="exact")
    written = json.loads((out / "config.json").read_text())["normswap"]["plan"]
    plan = json.loads(shown.stdout)
    assert len(plan["mean_carries"]) == 5
    assert plan == {k: v for k, v in written.items() if k != "adapter_bases"}
