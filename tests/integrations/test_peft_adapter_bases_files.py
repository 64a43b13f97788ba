"""The adapter bases' vectors live in a binary side file, not in config.json (round 55).

Round 54 recorded the γ / β / λ / balance vectors an adapter on an edited Linear needs as JSON floats inside the
manifest, one copy per Linear: config.json grew with width × depth (149 KB for a 2-layer 1024-wide GPT-2). Now
the manifest holds structure only (a vector's name per field) and ``normswap_adapter_bases.safetensors`` the
vectors, one per norm site / λ. These tests: the round trip through the file (native, compat, a custom module),
bit for bit; the manifest not growing with width; the file read by neither transformers nor the weight
checks; a missing file (one warning, adapters there refused at attach, the model as before) and a damaged one
(one line). Float64 replicas from configs, LayerNorm γ/β randomised."""

from __future__ import annotations

import copy
import json
import logging
import warnings

import pytest
import torch
from torch import nn

import normswap
from normswap.analysis.plan import ADAPTER_VECTOR_FIELDS, plan_of
from normswap.checkpoint import bases_io
from normswap.errors import NormswapError
from normswap.inputs import hf_example_inputs
from tests.benchmark_modules import tiny_dinov2
from tests.integrations.test_peft_adapter_bases import _lora, _out, _relative
from tests.zoo import EXACT, build, randomise

peft = pytest.importorskip("peft")
tf = pytest.importorskip("transformers")

SIDECAR = "normswap_adapter_bases.safetensors"
GPT2 = (["c_attn", "c_proj", "c_fc"], {"fan_in_fan_out": True})


def _gpt2(tmp_path, fmt="native", width=None, **patch):
    if width is None:
        original = build(EXACT, "gpt2")
    else:
        cfg = tf.GPT2Config(n_layer=2, n_embd=width, n_head=4, vocab_size=99, n_positions=32)
        original = randomise(tf.GPT2LMHeadModel(cfg).eval().double())
    probe = hf_example_inputs(original, seed=5)
    converted = copy.deepcopy(original)
    normswap.patch(converted, **patch)
    out = tmp_path / f"gpt2-{fmt}-{width}"
    normswap.save(converted, out, format=fmt)
    return original, converted, probe, out


def _manifest(out):
    return json.loads((out / "config.json").read_text())["normswap"]


def test_the_manifest_names_the_vectors_and_the_side_file_holds_them_once(tmp_path):
    original = tiny_dinov2(seed=3)
    normswap.patch(original, layer_scale="keep")
    plan = plan_of(original)
    normswap.save(original, tmp_path / "dino")
    bases = _manifest(tmp_path / "dino")["plan"]["adapter_bases"]
    assert bases == plan.adapter_bases
    for record in bases.values():  # structure only: a name per vector field, never a list of floats
        assert all(isinstance(record[k], str) for k in ADAPTER_VECTOR_FIELDS if k in record)
    # query / key / value read norm1's γ / β: one vector per norm site, however many Linears read it
    q, k = (bases[f"encoder.layer.0.attention.{n}"] for n in ("q_proj", "k_proj"))
    assert q["beta"] == k["beta"] == "encoder.layer.0.norm1:beta"
    refs = [r[f] for r in bases.values() for f in ADAPTER_VECTOR_FIELDS if f in r]
    stored = bases_io.read(tmp_path / "dino" / SIDECAR)
    assert set(stored) == set(refs) == bases_io.named(plan) and len(stored) < len(refs)
    assert any(r.get("balance") for r in bases.values())  # the balanced λ (float64 arithmetic) too
    for name, t in stored.items():
        assert torch.equal(t, plan.adapter_vectors[name])  # bit for bit, whatever dtype stored it


def test_the_manifest_does_not_grow_with_width(tmp_path):
    # every β folded, so that the plan's structure is the same at both widths (auto placement weighs the values)
    _, _, _, narrow = _gpt2(tmp_path, width=32, beta_placement="fold")
    _, _, _, wide = _gpt2(tmp_path, width=64, beta_placement="fold")
    # only the digits of the per-site error figures differ (round 54 wrote every vector into it as JSON floats)
    assert (wide / "config.json").stat().st_size <= (narrow / "config.json").stat().st_size + 32
    assert _manifest(wide)["plan"]["adapter_bases"] == _manifest(narrow)["plan"]["adapter_bases"]
    assert (wide / SIDECAR).stat().st_size > (narrow / SIDECAR).stat().st_size  # the vectors moved there


def test_narrowest_exact_dtype():
    x = torch.tensor([1.0, 0.5, -3.25], dtype=torch.float64)
    assert bases_io.narrowest(x).dtype == torch.bfloat16
    y = torch.tensor([1.0, 0.1], dtype=torch.float32).double()
    assert bases_io.narrowest(y).dtype == torch.float32
    z = torch.tensor([0.1], dtype=torch.float64)
    assert bases_io.narrowest(z).dtype == torch.float64
    for t in (x, y, z):
        assert torch.equal(bases_io.narrowest(t).double(), t)


@pytest.mark.parametrize("how", ["normswap.load", "AutoModel"])
def test_native_round_trip_through_the_side_file(tmp_path, how):
    original, converted, probe, out = _gpt2(tmp_path)
    if how == "normswap.load":
        loaded = normswap.load(out, dtype=torch.float64)
    else:
        loaded = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    plan = plan_of(loaded)
    mine = plan_of(converted).adapter_vectors
    assert all(torch.equal(plan.adapter_vectors[n], mine[n]) for n in bases_io.named(plan))
    targets, kw = GPT2
    ref = _out(_lora(copy.deepcopy(original), targets, **kw), probe)
    lora = _lora(loaded, targets, **kw)
    assert _relative(_out(lora, probe), ref) <= 1e-9
    assert _relative(_out(lora.merge_and_unload(), probe), ref) <= 1e-9


def test_resaving_a_loaded_model_writes_the_side_file_again(tmp_path):
    original, _, probe, out = _gpt2(tmp_path)
    loaded = normswap.load(out, dtype=torch.float64)
    loaded.save_pretrained(tmp_path / "again")  # transformers' own save (Trainer's): finish_native_dir
    assert (tmp_path / "again" / SIDECAR).is_file()
    again = normswap.load(tmp_path / "again", dtype=torch.float64)
    targets, kw = GPT2
    ref = _out(_lora(copy.deepcopy(original), targets, **kw), probe)
    assert _relative(_out(_lora(again, targets, **kw), probe), ref) <= 1e-9


@pytest.mark.parametrize("model", ["gpt2", "dinov2"])
def test_compat_loaded_with_normswap_load_acts_as_on_the_original(tmp_path, model):
    if model == "gpt2":
        original, _, probe, out = _gpt2(tmp_path, fmt="compat")
        targets, kw = GPT2
        loaded = normswap.load(out, dtype=torch.float64)
    else:
        original = tiny_dinov2(seed=3)
        probe = hf_example_inputs(original, seed=5)
        converted = copy.deepcopy(original)
        normswap.patch(converted)
        out = tmp_path / "dino-compat"
        normswap.save(converted, out, format="compat")
        targets, kw = ["query", "value", "attention.output.dense", "fc1", "fc2"], {}
        loaded = normswap.load(out, dtype=torch.float64)
    assert (out / SIDECAR).is_file() and _manifest(out)["format"] == "compat"
    ref = _out(_lora(copy.deepcopy(original), targets, **kw), probe)
    assert _relative(_out(_lora(copy.deepcopy(original), targets, **kw), probe), _out(original, probe)) > 1e-3
    lora = _lora(loaded, targets, **kw)
    assert _relative(_out(lora, probe), ref) <= 1e-9
    assert _relative(_out(lora.merge_and_unload(), probe), ref) <= 1e-9


def test_stock_transformers_load_of_a_compat_dir_ignores_the_side_file(tmp_path, caplog):
    _, converted, probe, out = _gpt2(tmp_path, fmt="compat")
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        stock = tf.GPT2LMHeadModel.from_pretrained(out, dtype=torch.float64).eval()
    said = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert not [s for s in said if "adapter_bases" in s or "unexpected" in s.lower() or "not used" in s.lower()]
    assert _relative(_out(stock, probe), _out(converted, probe)) <= 1e-12


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(self.ln(x))))


def test_custom_module_round_trip_through_the_side_file(tmp_path):
    torch.manual_seed(0)
    original = _Net().double().eval()
    with torch.no_grad():
        original.ln.weight.copy_(1 + 0.5 * torch.randn(16, dtype=torch.float64))
        original.ln.bias.copy_(0.3 * torch.randn(16, dtype=torch.float64))
    x = torch.randn(4, 16, dtype=torch.float64)
    converted = copy.deepcopy(original)
    normswap.patch(converted, example_inputs=(x,))
    assert "up" in plan_of(converted).adapter_bases
    normswap.save(converted, tmp_path / "net")
    assert (tmp_path / "net" / SIDECAR).is_file()
    loaded = normswap.load(tmp_path / "net", model=_Net().double())
    with torch.no_grad():
        ref = _lora(copy.deepcopy(original), ["up"])(x)
        got = _lora(loaded, ["up"])(x)
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-9


def test_a_missing_side_file_warns_once_and_refuses_adapters_there(tmp_path):
    _, converted, probe, out = _gpt2(tmp_path)
    (out / SIDECAR).unlink()
    with pytest.warns(UserWarning, match=f"has no {SIDECAR}: the model is unaffected"):
        loaded = normswap.load(out, dtype=torch.float64)
    assert _relative(_out(loaded, probe), _out(converted, probe)) <= 1e-12  # the model itself loads as before
    before = _out(loaded, probe)
    with pytest.raises(NormswapError, match=f"is refused: .*{SIDECAR}.* were not there when the checkpoint was"):
        _lora(loaded, ["h.1.attn.c_attn"], fan_in_fan_out=True)
    assert _relative(_out(loaded, probe), before) == 0.0


def test_a_damaged_side_file_is_one_line(tmp_path):
    _, _, _, out = _gpt2(tmp_path)
    data = (out / SIDECAR).read_bytes()
    (out / SIDECAR).write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(NormswapError, match=f"{SIDECAR} .*damaged") as info:
        normswap.load(out, dtype=torch.float64)
    assert "\n" not in str(info.value)


def test_a_side_file_without_a_named_vector_is_one_line(tmp_path):
    from safetensors.torch import save_file

    _, _, _, out = _gpt2(tmp_path)
    save_file({"something.else:gamma": torch.ones(32, dtype=torch.float64)}, str(out / SIDECAR))
    with pytest.raises(NormswapError, match="lacks `transformer.h.1.ln_1:beta`, a vector config.json's") as info:
        normswap.load(out, dtype=torch.float64)
    assert "\n" not in str(info.value)


def test_at_runtime_the_vectors_are_tensors_not_float_lists():
    original = build(EXACT, "gpt2")
    normswap.patch(original)
    plan = plan_of(original)
    assert plan.adapter_vectors and all(isinstance(t, torch.Tensor) and t.dtype == torch.float64
                                        for t in plan.adapter_vectors.values())
    assert "adapter_vectors" not in plan.to_dict()


def test_a_low_memory_conversion_records_the_same_adapter_bases(tmp_path):
    """The streamed rewrite records the bases from the checkpoint's own tensors (round 55; round 54 wrote none):
    a LoRA on the loaded low-memory checkpoint acts as on the original (tests/checkpoint/test_streaming.py
    checks the manifest and side file equal to the in-memory conversion's, bit for bit)."""
    cfg = tf.GPT2Config(n_layer=5, n_embd=32, n_head=4, vocab_size=99, n_positions=32)
    original = randomise(tf.GPT2LMHeadModel(cfg).eval().double())
    original.save_pretrained(tmp_path / "src")
    report = normswap.convert(tmp_path / "src", tmp_path / "out", low_memory=True, beta_placement="fold")
    assert report.streamed and (tmp_path / "out" / SIDECAR).is_file()
    loaded = normswap.load(tmp_path / "out", dtype=torch.float64)
    probe = hf_example_inputs(original, seed=5)
    targets, kw = GPT2
    ref = _out(_lora(copy.deepcopy(original), targets, **kw), probe)
    lora = _lora(loaded, targets, **kw)
    assert _relative(_out(lora, probe), ref) <= 1e-9
    assert _relative(_out(lora.merge_and_unload(), probe), ref) <= 1e-9


@pytest.mark.parametrize("how", ["normswap.save", "save_pretrained"])
def test_a_stale_side_file_is_removed_when_nothing_needs_storing(tmp_path, how):
    """A save into a directory that holds the side file of an older save, of a model whose adapter bases name no
    vector (β kept in the norms, γ not folded: only centered writers, which need none): the old file is gone, so
    it is never read as this model's (round 56: tested; bases_io.write removes it)."""
    original, _, probe, out = _gpt2(tmp_path)
    assert (out / SIDECAR).is_file()
    plain = copy.deepcopy(original)
    normswap.patch(plain, beta_placement="keep")
    assert plan_of(plain).adapter_bases and not bases_io.named(plan_of(plain))
    if how == "normswap.save":
        normswap.save(plain, out, overwrite=True)
    else:
        normswap.save(plain, tmp_path / "plain")
        normswap.load(tmp_path / "plain", dtype=torch.float64).save_pretrained(out)
    assert not (out / SIDECAR).exists() and not list(out.glob(f"*{SIDECAR}*"))
    loaded = normswap.load(out, dtype=torch.float64)  # no warning: nothing is named, nothing is missing
    targets, kw = GPT2
    ref = _out(_lora(copy.deepcopy(original), targets, **kw), probe)
    assert _relative(_out(_lora(loaded, targets, **kw), probe), ref) <= 1e-9


_HUB_LOAD = r"""
import sys, warnings, torch, transformers as tf
import normswap
from normswap.analysis.plan import plan_of
for repo in sys.argv[1].split(","):
    for how in sys.argv[2:]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if how == "normswap.load":
                model = normswap.load(repo, dtype=torch.float64)
            else:
                model = tf.AutoModelForCausalLM.from_pretrained(repo, dtype=torch.float64)
        plan = plan_of(model) or getattr(model, "_normswap_compat", None)
        print("VECTORS", repo, how, len(plan.adapter_vectors))
        print("WARNINGS", repo, how, [str(w.message) for w in caught if "adapter" in str(w.message)])
"""

HOWS = ["normswap.load", "AutoModelForCausalLM"]
BARE_REPO = "org/bare-rms"  # the same files as org/tiny-rms, uploaded without the side file


def _hub_cache(cache, out, repo="org/tiny-rms", sha="0123456789abcdef0123456789abcdef01234567"):
    """``out`` laid out in Hub cache ``cache`` as the Hub lays out a downloaded repo: ``models--org--name/refs/main``
    holds the commit, ``snapshots/<commit>/`` the files. Returns the snapshot."""
    import shutil

    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(sha)
    shutil.copytree(out, root / "snapshots" / sha)
    return root / "snapshots" / sha


def _run_offline(warm_python, repos, hows):
    """Load each of ``repos`` from the Hub cache in one new process, by each of ``hows`` in turn (each load's
    warnings recorded on their own): ``{(repo, how): (number of adapter vectors, the adapter warnings as a
    string)}``. The process is a child of the warm fork server (``tests/warm_python.py``: it never imported
    normswap), whose environment, read when it started, has ``HF_HOME`` a directory of its own and the Hub off:
    the cache is that ``HF_HOME``'s, as it was the ``HF_HUB_CACHE`` given to the fresh interpreter before."""
    done = warm_python.run(_HUB_LOAD, ",".join(repos), *hows, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = {tuple(line.split(" ", 3)[:3]): line.split(" ", 3)[3] for line in done.stdout.splitlines()
             if line.startswith(("VECTORS", "WARN"))}
    return {(repo, how): (int(lines["VECTORS", repo, how]), lines["WARNINGS", repo, how])
            for repo in repos for how in hows}


@pytest.fixture(scope="module")
def hub_loads(tmp_path_factory, warm_python):
    """One conversion, laid out twice in one Hub cache (one repo's snapshot with the side file, another repo
    uploaded without it), each loaded by every way of ``HOWS`` in one new process (one process, not one per
    load nor one per repo)."""
    tmp_path = tmp_path_factory.mktemp("hub-loads")
    _, converted, _, out = _gpt2(tmp_path)
    named = len(bases_io.named(plan_of(converted)))
    with warm_python.hub_cache() as cache:
        _hub_cache(cache, out)
        snapshot = _hub_cache(cache, out, repo=BARE_REPO)
        (snapshot / SIDECAR).unlink()  # a repo uploaded without it
        loads = _run_offline(warm_python, ("org/tiny-rms", BARE_REPO), HOWS)
    return (named, {how: loads["org/tiny-rms", how] for how in HOWS},
            {how: loads[BARE_REPO, how] for how in HOWS})


@pytest.mark.parametrize("how", HOWS)
def test_a_hub_repo_id_finds_the_side_file_in_the_cache_offline(hub_loads, how):
    """Loading by repo id (no network: HF_HUB_OFFLINE=1, a temporary HF_HOME's cache laid out as the Hub lays it
    out) reads the side file from the snapshot as from a directory; a snapshot without it warns in one line."""
    named, with_file, without_file = hub_loads
    assert named
    vectors, said = with_file[how]
    assert vectors == named and said == "[]"
    vectors, said = without_file[how]
    where = BARE_REPO if how != "normswap.load" else "models--org--bare-rms/snapshots/"  # (load: the snapshot)
    assert vectors == 0 and f"{where}" in said and f"has no {SIDECAR}" in said and said.count("normswap:") == 1, said
