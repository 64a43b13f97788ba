"""Custom models as their users build them (issue 31, parts 2, 5, 6): modules that cast inside (Whisper,
open_clip, fairseq), metadata reads (``type_as``), a norm's output changed in place (vit-pytorch),
calibration of a float64 model that keeps state between calls, a model that cannot run in float64,
and TorchScript modules."""

import copy
import warnings

import pytest
import torch
from torch import nn

import normswap
from normswap.analysis import precision, trace
from tests.custom_models import TinyViT, randomise
from tests.custom_models_cast import (
    ClipTextStyle,
    FairseqStyleEncoder,
    Float32OnlyNet,
    PostLNRotaryEncoder,
    SimpleVitStyle,
    VitPytorchStyle,
    WAttention,
    WhisperStyle,
    WLayerNorm,
    greedy_decode,
)

EXACT = ("exact", "exact-with-centering")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _held(model: nn.Module, *args: torch.Tensor) -> torch.Tensor:
    """The model's function in float64 arithmetic: its downcasts held at float64."""
    with torch.no_grad(), precision.holding(torch.float64):
        return model(*args)


def _check_exact(model: nn.Module, example: tuple, probes: list[tuple]) -> normswap.Report:
    """Patch, then every norm exact and the converted model within 1e-9 of the original on every probe."""
    original = copy.deepcopy(model)
    report = normswap.patch(model, example)
    assert report.sites and all(s.verdict in EXACT for s in report.sites), report.plan.table()
    assert not report.plan.skipped, report.plan.skipped
    assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())
    assert report.verification["max_rel_error"] <= 1e-9
    for probe in probes:
        assert _rel(_held(model, *probe), _held(original, *probe)) <= 1e-9
    return report


# ---------------------------------------------------------------------------------- part 2: casts inside
def test_hold_turns_downcasts_into_casts_to_the_working_dtype_and_nothing_else():
    x = torch.randn(2, 3, dtype=torch.float64)
    ids, other = torch.arange(3), torch.zeros(1, dtype=torch.float32)
    with precision.holding(torch.float64) as hold:
        downcasts = [x.float(), x.half(), x.bfloat16(), x.to(torch.float32), x.to("cpu", torch.float16),
                     x.to(dtype=torch.bfloat16), x.to(other), x.type(torch.float32),
                     x.type("torch.FloatTensor"), x.type_as(other), ids.float(),
                     torch.zeros(2, dtype=torch.float32), torch.softmax(x, -1, torch.float32),
                     torch.nn.functional.softmax(x, dim=-1, dtype=torch.float32), x.sum(-1, dtype=torch.float16)]
        untouched = [x.to(torch.int32), x.view(torch.int64), x.long(), torch.zeros(2, dtype=torch.int64)]
        same = x.float()
    assert all(t.dtype == torch.float64 for t in downcasts), [t.dtype for t in downcasts]
    assert [t.dtype for t in untouched] == [torch.int32, torch.int64, torch.int64, torch.int64]
    assert same is x  # a held cast is a no-op, as .double() of a float64 tensor is
    assert hold.held["float"] >= 3 and hold.held["to"] >= 4 and "softmax" in hold.held
    assert x.float().dtype == torch.float32  # nothing outlives the block
    with precision.holding(torch.float32):  # a float32 copy holds half casts, not its own
        assert x.float().dtype == torch.float32 and x.float().half().dtype == torch.float32


def test_a_norm_computing_in_float32_traces_as_one_norm_of_its_input():
    """Whisper's ``super().forward(x.float()).type(x.dtype)`` in a float64 copy: the held casts return their
    input, and are not recorded as ops, so the residual add reads the stream itself, not a cast inside the norm."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.fc = WLayerNorm(8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.fc(self.ln(x))

    block = Block().double()
    graph = trace.record(block, (torch.randn(2, 8, dtype=torch.float64),), {},
                         hold=precision.HoldCasts(torch.float64))
    assert graph.held_casts == {"float": 1}
    x = next(v.id for v in graph.values.values() if v.source == "input")
    add = next(op for op in graph.ops if op.name in ("add", "__add__"))
    assert add.args[0] == trace.ValueRef(x)
    assert graph.calls_of("ln")[0].first_input() == x
    assert not [op for op in graph.ops if op.name in ("to", "type", "float")]


@pytest.mark.parametrize("sdpa", [True, False])
def test_whisper_style_model_converts_exactly_in_float64(sdpa, monkeypatch):
    """Whisper's own code: norms computing in float32, Linear/Conv1d casting weights to the input dtype,
    softmax in float32 (eager attention), logits ``.float()`` read off the tied embedding."""
    monkeypatch.setattr(WAttention, "use_sdpa", sdpa)
    torch.manual_seed(0)
    model = randomise(WhisperStyle(layers=2 if sdpa else 1))
    original = copy.deepcopy(model)
    mel = torch.randn(2, 8, 12, dtype=torch.float64)
    probes = [(mel, torch.randint(0, 40, (2, 7))), (torch.randn(3, 8, 12, dtype=torch.float64),
                                                    torch.randint(0, 40, (3, 11)))]
    report = _check_exact(model, probes[0], probes)
    assert "casts to lower precision held at float64" in report.message
    assert "(float x" in report.message
    with torch.no_grad(), pytest.raises(RuntimeError, match="mixed dtype"):
        original(*probes[0])  # its float32 norms cannot run on float64 parameters: only a held run can


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_whisper_style_half_activations_keep_the_originals_error(dtype):
    """Whisper runs float32 weights on half-precision activations: the RMSNorm that replaces a norm computing
    in float32 also computes in float32 and returns the input dtype, so the converted model's error against
    exact math stays the original's (0.93-1.07x over 12 models, benchmarks/bench_cast_fidelity.py)."""
    torch.manual_seed(1)
    model = WhisperStyle().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    original = copy.deepcopy(model)
    mel, tokens = torch.randn(4, 8, 12), torch.randint(0, 40, (4, 10))
    normswap.patch(model, (mel, tokens))
    ref = _held(copy.deepcopy(original).double(), mel.double(), tokens)

    def rel_rms(out: torch.Tensor) -> float:
        return float((out.double() - ref).norm() / ref.norm())

    with torch.no_grad():
        before, after = rel_rms(original(mel.to(dtype), tokens)), rel_rms(model(mel.to(dtype), tokens))
        half = torch.randn(3, 32, dtype=dtype)
        assert model.decoder.ln(half).dtype == original.decoder.ln(half).dtype == dtype
    assert after <= 1.2 * before, (after, before)


def test_whisper_style_fold_gamma_says_why_the_decoder_stream_is_not_rotated():
    """Whisper's final decoder norm is read by one thing: the logits ``x @ token_embedding.weight.T``, the
    embedding that also writes the decoder stream. Nothing folds out of that norm, so γ stays and the
    decoder stream is not rotated; the reason says so (it said "some γ is near 0", with every γ near 1)."""
    torch.manual_seed(0)
    model = randomise(WhisperStyle())
    mel, tokens = torch.randn(2, 8, 12, dtype=torch.float64), torch.randint(0, 40, (2, 7))
    original = copy.deepcopy(model)
    report = normswap.patch(model, (mel, tokens), fold_gamma=True)
    final = report.plan.site("decoder.ln")
    assert float(original.decoder.ln.weight.detach().abs().min()) > 0.1  # no γ anywhere near 0
    assert final.rotation_reason == ("γ stays in the RMSNorm: nothing folds out of it (`decoder.token_embedding"
                                     ".weight` shares its weight with `decoder.token_embedding`)")
    assert final.beta_detail.endswith("shares its weight with `decoder.token_embedding`")
    rotation = normswap.rotate(model, "hadamard")
    assert [r["norms"][0] for r in rotation.rotated] == ["encoder.blocks.0.attn_ln"]
    assert [s["reason"] for s in rotation.skipped] == [f"`decoder.ln`: {final.rotation_reason}"]
    probe = (torch.randn(3, 8, 12, dtype=torch.float64), torch.randint(0, 40, (3, 9)))
    assert _rel(_held(model, *probe), _held(original, *probe)) <= 1e-9


def test_whisper_style_kv_cache_decoding_is_unchanged_by_patch_rotation_and_reload(tmp_path):
    """Whisper decodes through forward hooks on the decoder's key/value Linears that cache and prepend
    their outputs (``install_kv_cache_hooks``), keyed by those very modules. After ``patch``, after
    ``rotate`` and in a fresh instance loaded with ``normswap.load(dir, model=...)`` the cached greedy
    decoding gives the original's tokens, and the reloaded model's logits are bitwise the saved one's."""
    torch.manual_seed(11)
    model = WhisperStyle(vocab=40, text_ctx=16).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    mel, prefix = torch.randn(3, 8, 12), torch.tensor([[1, 2]] * 3)
    reference = greedy_decode(model, mel, prefix, steps=10)
    with torch.no_grad():  # the cache is used: one more step without it computes the same argmax
        assert torch.equal(model(mel, reference[:, :-1])[:, -1].argmax(-1), reference[:, -1])
    normswap.patch(model, (mel, reference[:, :6]), fold_gamma=True)
    assert torch.equal(greedy_decode(model, mel, prefix, steps=10), reference)
    normswap.rotate(model, "hadamard")
    assert torch.equal(greedy_decode(model, mel, prefix, steps=10), reference)
    normswap.save(model, tmp_path / "ckpt")
    loaded = normswap.load(tmp_path / "ckpt", model=WhisperStyle(vocab=40, text_ctx=16)).eval()
    assert torch.equal(greedy_decode(loaded, mel, prefix, steps=10), reference)
    with torch.no_grad():
        assert torch.equal(loaded(mel, reference), model(mel, reference))


def test_a_model_that_does_not_run_in_its_own_dtype_converts_and_the_report_says_so():
    """Whisper cast to bfloat16 does not run on a CPU: its LayerNorm computes in float32 and torch refuses
    bfloat16 parameters there ("mixed dtype"). The conversion is analysed and verified in float64 (casts
    held), which runs; measuring what bfloat16 costs the original then raised that RuntimeError from the
    model's code, after the whole conversion. Now that figure is missing and the report says why."""
    torch.manual_seed(12)
    model = WhisperStyle().eval().bfloat16()
    mel, tokens = torch.randn(2, 8, 12, dtype=torch.bfloat16), torch.randint(0, 40, (2, 7))
    reference = _held(copy.deepcopy(model).double(), mel.double(), tokens)
    with torch.no_grad(), pytest.raises(RuntimeError, match="mixed dtype"):
        model(mel, tokens)
    report = normswap.patch(model, (mel, tokens))
    assert all(s.verdict in EXACT for s in report.sites)
    assert ("the original WhisperStyle does not run in bfloat16 on these inputs (RuntimeError: mixed dtype"
            in report.message and "; the converted one does" in report.message)
    assert report.verification["original_in_model_dtype"] is None and report.verification["in_model_dtype"] < 0.05
    with torch.no_grad():
        assert _rel(model(mel, tokens), reference) < 0.05  # it runs in bfloat16 now, at bfloat16's error


def test_open_clip_style_float32_norms_and_cast_embeddings_convert_exactly():
    torch.manual_seed(2)
    model = randomise(ClipTextStyle())
    report = _check_exact(model, (torch.randint(0, 40, (2, 9)),),
                          [(torch.randint(0, 40, (2, 9)),), (torch.randint(0, 40, (4, 12)),)])
    assert "held at float64" in report.message


# ---------------------------------------------------------------------------------- part 5: idioms
def test_metadata_reads_are_not_data_inputs():
    """``type_as``, ``new_*``, ``*_like``, ``expand_as`` read a tensor's dtype, device or shape: the op keeps
    the argument but is not one of its consumers."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            y = self.fc(x)
            return (x.double().type_as(y), y.new_zeros(3), torch.zeros_like(y), torch.full_like(y, 2.0),
                    x[:, :1].expand_as(y), y.abs())

    graph = trace.record(Net(), (torch.randn(2, 4),), {})
    y = graph.calls_of("fc")[0].outputs[0]
    readers = {graph.ops[i].name for i in graph.values[y].consumers}
    assert readers == {"abs"}
    meta = [op for op in graph.ops if op.name in ("type_as", "new_zeros", "zeros_like", "full_like", "expand_as")]
    assert len(meta) == 5 and all(trace.ValueRef(y) in (*op.args, *op.kwargs.values()) for op in meta)
    assert all(y not in op.inputs for op in meta)


def test_fairseq_style_attention_weights_type_as_output_do_not_block_centering():
    """fairseq returns ``attn_weights.type_as(attn)`` beside ``attn = self.out_proj(attn)``: not a second
    reader of the output projection. Float32 norms (``Fp32LayerNorm``) and a float32 softmax too."""
    torch.manual_seed(3)
    model = randomise(FairseqStyleEncoder())
    plan = normswap.plan(model, (torch.randint(0, 40, (2, 9)),))
    assert not any("type_as" in s.reason for s in plan.sites), plan.table()
    _check_exact(model, (torch.randint(0, 40, (2, 9)),),
                 [(torch.randint(0, 40, (2, 9)),), (torch.randint(0, 40, (3, 14)),)])


def test_a_norm_output_changed_in_place_is_identified_from_what_it_returned():
    """``x = self.ln(h); x += pos``: the traced value of the norm's output is what the norm returned."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(6)
            self.pos = nn.Parameter(torch.randn(6))

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            x = self.ln(h)
            x += self.pos
            x[:, 0] = 0.0
            return x

    net = Net()
    h = torch.randn(3, 6)
    graph = trace.record(net, (h,), {}, snapshot=["ln"])
    call = graph.calls_of("ln")[0]
    with torch.no_grad():
        assert torch.equal(graph.values[call.outputs[0]].tensor, net.ln(h))
        assert torch.equal(graph.values[call.first_input()].tensor, h)
    final = graph.outputs[0][1]
    assert graph.values[final].tensor[:, 0].abs().max() == 0  # later values keep the live tensor


def test_simple_vit_style_patch_embedding_norm_changed_in_place_converts_exactly():
    """vit-pytorch's SimpleViT: ``x = self.to_patch_embedding(img); x += pos`` (a plain tensor cast with
    ``.to(device, dtype=...)``), the Sequential ending in a LayerNorm."""
    torch.manual_seed(4)
    model = randomise(SimpleVitStyle())
    example = (torch.randn(2, 3, 16, 16, dtype=torch.float64),)
    found = {s.path: s for s in normswap.pipeline.find_norms(model, example).sites}
    assert found["to_patch_embedding.3"].flavour == "standard"
    _check_exact(model, (torch.randn(2, 3, 16, 16, dtype=torch.float64),),
                 [(torch.randn(2, 3, 16, 16, dtype=torch.float64),), (torch.randn(5, 3, 16, 16, dtype=torch.float64),)])


def test_vit_pytorch_style_every_norm_is_identified_and_exact():
    """vit-pytorch's ViT (cls token, position Parameter added in place after the concatenation): every
    LayerNorm is found and identified, and every one is exact: the patch embedding's last LayerNorm starts
    the stream (one centering op there, as for CLIP's pre_layrnorm), the one on raw patches reads them
    through a centering op on the patch rearrangement."""
    torch.manual_seed(5)
    model = randomise(VitPytorchStyle())
    img = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    found = normswap.pipeline.find_norms(model, (img,))
    assert len(found.sites) == 7 and not found.skipped
    report = _check_exact(model, (img,), [(img,), (torch.randn(3, 3, 16, 16, dtype=torch.float64),)])
    assert {(h.module, h.where) for h in report.plan.hooks} == {("to_patch_embedding.0", "output"),
                                                               ("to_patch_embedding.3", "output")}


def test_calibration_of_a_float64_model_that_keeps_a_table_made_in_the_analysis_run():
    """The rotary tables cached in the float64 analysis run meet float32 activations in a float32
    calibration ("expected scalar type Float but found Double"): the fit runs in float64 and says so."""
    torch.manual_seed(6)
    model = randomise(PostLNRotaryEncoder())
    with pytest.warns(UserWarning, match="converted approximately"):
        report = normswap.patch(model, (torch.randint(0, 40, (2, 9)),))
    assert report.calibration is not None and report.calibration.fits
    assert "in float64 (PostLNRotaryEncoder did not run in float32" in report.calibration.pipeline
    assert report.verification["heldout_cosine"] > 0.99


def test_a_model_that_cannot_run_in_float64_is_analysed_and_verified_in_its_own_dtype():
    torch.manual_seed(7)
    model = Float32OnlyNet().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    original = copy.deepcopy(model)
    x = torch.randn(4, 12)
    assert len(normswap.pipeline.find_norms(model, (x,)).sites) == 3
    report = normswap.patch(model, (x,))
    assert report.plan.options["working_dtype"].startswith("float32: Float32OnlyNet cannot run in float64 (TypeError")
    assert "analysed and verified in float32" in report.message
    assert all(s.verdict in EXACT for s in report.sites)
    probe = torch.randn(5, 12)
    with torch.no_grad():
        assert _rel(model(probe), original(probe)) <= 1e-5  # float32's tolerance
    with pytest.raises(normswap.NormswapError, match=r"^could not run Float32OnlyNet.forward on the example inputs"):
        normswap.patch(model, (torch.randn(4, 5),))  # inputs that fit in no dtype: the inputs are to blame


# ---------------------------------------------------------------------------------- part 6: TorchScript
def _scripted(kind: str) -> nn.Module:
    torch.manual_seed(8)
    net = TinyViT().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated
        if kind == "script":
            return torch.jit.script(net)
        if kind == "trace":
            return torch.jit.trace(net, torch.randn(1, 3, 32, 32))
        net.blocks[0] = torch.jit.script(net.blocks[0])
        return net


@pytest.mark.parametrize("kind", ["script", "trace", "inner"])
def test_torchscript_modules_are_refused_in_one_line_without_warnings(kind):
    model = _scripted(kind)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 32, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no flood of `.grad` warnings on the way to the refusal
        for call in (lambda: normswap.patch(model, (x,)), lambda: normswap.plan(model), lambda: normswap.patch(model)):
            with pytest.raises(normswap.NormswapError) as err:
                call()
            message = str(err.value)
            assert "\n" not in message and "TorchScript" in message and "patch the eager module first" in message
            assert ("`blocks.0`" in message) == (kind == "inner")
            assert f"then {'trace' if kind == 'trace' else 'script'} the result" in message
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
