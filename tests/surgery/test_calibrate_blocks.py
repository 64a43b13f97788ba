"""Sequential calibration in one pass (every batch's forwards paused at each norm boundary) gives the
fits of the replaying path, in which each norm re-runs every batch from the input; for every family
with approximate norms. Also: each layer runs once per batch (linear in depth), the memory fallback,
and errors inside a forward."""

from __future__ import annotations

import threading

import pytest
import torch
import transformers as tf

from normswap.pipeline import find_norms
from normswap.surgery import calibrate
from tests.custom_models import PostLNEncoder
from tests.custom_models import randomise as randomise_custom
from tests.zoo import APPROXIMATE, EXACT, MORE, build, randomise


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: intra-op threads only add barrier waits (seconds per forward on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _wav2vec2_post_ln() -> torch.nn.Module:  # audio, Post-LN (do_stable_layer_norm=False)
    torch.manual_seed(0)
    cfg = tf.Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                            conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                            num_conv_pos_embedding_groups=4, vocab_size=20, do_stable_layer_norm=False,
                            feat_extract_norm="layer")
    return randomise(tf.Wav2Vec2Model(cfg))


def _vit_post_ln() -> torch.nn.Module:
    """Vision, Post-LN: a custom ViT-like model, patches through a conv, norms after each residual add."""

    class PostLNViT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patch = torch.nn.Conv2d(3, 32, 8, 8)
            self.enc = PostLNEncoder(d=32, layers=3)

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            x = self.patch(pixel_values).flatten(2).transpose(1, 2)
            x = self.enc.emb_norm(x)
            for attn, mlp, n1, n2 in zip(self.enc.attn, self.enc.mlp, self.enc.n1, self.enc.n2, strict=True):
                x = n1(x + attn(x))
                x = n2(x + mlp(x))
            return x.mean(1)

    torch.manual_seed(0)
    return randomise_custom(PostLNViT())


def _albert_deeper() -> torch.nn.Module:  # one shared layer called at 4 depths
    torch.manual_seed(0)
    cfg = tf.AlbertConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                          vocab_size=99, max_position_embeddings=64, embedding_size=16)
    return randomise(tf.AlbertForMaskedLM(cfg))


# BERT-style Post-LN, encoder-decoder with cross-attention (BART, Marian), OPT-350m's layout, ALBERT's
# shared layer, audio (Whisper's encoder-decoder, wav2vec2 Post-LN), vision Post-LN; the other
# APPROXIMATE families (RoBERTa, DistilBERT, ELECTRA, MPNet, DeBERTa-v2) run the same mechanism
FAMILIES = {**{name: (lambda n=name: build(APPROXIMATE, n)) for name in ("bert", "bart", "opt-post-ln")},
            "marian": lambda: build({"marian": MORE["marian"][0]}, "marian"),
            "whisper": lambda: build(EXACT, "whisper"), "albert-4-deep": _albert_deeper,
            "wav2vec2-post-ln": _wav2vec2_post_ln, "vit-post-ln": _vit_post_ln}


def _setup(name: str) -> tuple[torch.nn.Module, list[calibrate.Target], list[calibrate.Batch]]:
    model = FAMILIES[name]()
    if name == "vit-post-ln":
        gen = torch.Generator().manual_seed(1)
        batches = [((torch.randn(5, 3, 32, 32, generator=gen, dtype=torch.float64),), {}) for _ in range(2)]
        sites = find_norms(model, batches[0][0]).sites
    else:
        batches, _ = calibrate.builtin_batches(model, batches=2, batch_size=4, seq_len=10, seed=1)
        batches = [(a, {k: (v.double() if v.is_floating_point() else v) if isinstance(v, torch.Tensor) else v
                        for k, v in kw.items()}) for a, kw in batches]
        sites = find_norms(model).sites
    targets = [calibrate.Target(s.path, model.get_submodule(s.path), s) for s in sites]
    return model, targets, batches


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_one_pass_gives_the_replayed_fits(name):
    model, targets, batches = _setup(name)
    fittable = [t for t in targets if t.site.weight_attr is not None and t.site.bias_attr is not None]
    assert len(fittable) >= 3, [t.name for t in targets]
    old = calibrate.fit_norms(model, targets, batches, micro_batch=2, pipeline="replay")
    new = calibrate.fit_norms(model, targets, batches, micro_batch=2, pipeline="lockstep")
    assert list(new) == list(old) and len(new) == len(fittable)
    for n, f in old.items():
        assert new[n].tokens == f.tokens
        torch.testing.assert_close(new[n].weight, f.weight, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(new[n].bias, f.bias, rtol=1e-9, atol=1e-11)
        assert new[n].residual_after == pytest.approx(f.residual_after, rel=1e-8, abs=1e-14)
    # the fits matter: the last norm's fit differs from what an independent fit gives
    ind = calibrate.fit_norms(model, targets, batches, micro_batch=2, sequential=False)
    last = list(old)[-1]
    assert not torch.allclose(ind[last].weight, old[last].weight, rtol=1e-6, atol=1e-9)


def _count_calls(module: torch.nn.Module) -> tuple[list[int], object]:
    calls = [0]
    return calls, module.register_forward_pre_hook(lambda m, a: calls.__setitem__(0, calls[0] + 1))


@pytest.mark.parametrize("layers", [2, 6])
def test_one_pass_runs_each_layer_once_per_batch_for_teacher_and_student(layers):
    torch.manual_seed(0)
    model = randomise_custom(PostLNEncoder(layers=layers))
    batches = [((torch.randint(0, 40, (4, 10)),), {}) for _ in range(3)]
    targets = [calibrate.Target(s.path, model.get_submodule(s.path), s) for s in find_norms(model, batches[0][0]).sites]
    counts = {}
    for pipeline in ("lockstep", "replay"):
        calls, h = _count_calls(model.mlp[0])
        calibrate.fit_norms(model, targets, batches, pipeline=pipeline)
        h.remove()
        counts[pipeline] = calls[0]
    assert counts["lockstep"] == 2 * len(batches)  # teacher + student, once each: independent of depth
    # replaying runs it again for every norm after it (2 * layers - 1 of them)
    assert counts["replay"] >= 2 * len(batches) * (2 * layers - 1)


def test_auto_replays_when_the_boundary_activations_do_not_fit(monkeypatch):
    model, targets, batches = _setup("bert")
    ref = calibrate.fit_norms(model, targets, batches, micro_batch=2, pipeline="lockstep")
    monkeypatch.setattr(calibrate, "available_memory", lambda: 10_000)
    before = threading.active_count()
    result = calibrate.calibrate(model, targets, batches, [], source="test")
    assert result.pipeline.startswith("replayed") and "do not fit" in result.pipeline
    assert result.as_dict()["pipeline"] == result.pipeline
    for n, f in ref.items():
        torch.testing.assert_close(result.fits[n].weight, f.weight, rtol=1e-7, atol=1e-9)
    assert threading.active_count() == before  # the paused forwards were ended
    monkeypatch.undo()
    assert calibrate.calibrate(model, targets, batches, [], source="test").pipeline.startswith("one pass")


def test_an_error_inside_a_forward_is_raised_and_ends_every_paused_forward():
    torch.manual_seed(0)
    model = randomise_custom(PostLNEncoder(layers=3))
    batches = [((torch.randint(0, 40, (4, 10)),), {}) for _ in range(4)]
    targets = [calibrate.Target(s.path, model.get_submodule(s.path), s) for s in find_norms(model, batches[0][0]).sites]
    seen = [0]

    def boom(module, args):  # noqa: ANN001
        seen[0] += 1
        if seen[0] == 6:  # the third batch's teacher, at layer 1
            raise RuntimeError("broken layer")

    h = model.mlp[1].register_forward_pre_hook(boom)
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="broken layer"):
        calibrate.fit_norms(model, targets, batches, pipeline="lockstep")
    h.remove()
    assert threading.active_count() == before
    assert calibrate.fit_norms(model, targets, batches, pipeline="lockstep")  # and it runs again


class _Seen(torch.overrides.TorchFunctionMode):
    """Records the threads in which a torch function ran under this mode."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.threads.add(threading.current_thread().name)
        return func(*args, **(kwargs or {}))


def test_the_paused_forwards_run_under_the_callers_torch_modes():
    """Inference mode, autocast and torch-function modes (``with torch.device(...)``) are per thread:
    the one-pass path's worker threads take the caller's, so both paths compute the same way."""
    torch.manual_seed(0)
    model = randomise_custom(PostLNEncoder(layers=2)).float()
    batches = [((torch.randint(0, 40, (4, 10)),), {}) for _ in range(2)]
    targets = [calibrate.Target(s.path, model.get_submodule(s.path), s) for s in find_norms(model, batches[0][0]).sites]
    state: list[tuple] = []
    # the last MLP runs before the last norm: the one-pass path's forwards end at the last norm's fit
    h = model.mlp[-1].register_forward_hook(lambda m, a, out: state.append((
        torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
        torch.is_grad_enabled(), out.dtype)))
    try:
        plain = calibrate.fit_norms(model, targets, batches, pipeline="lockstep")
        fits, seen, states = {}, {}, {}
        for pipeline in ("replay", "lockstep"):
            state.clear()
            mode = _Seen()
            with torch.enable_grad(), torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16), mode:
                fits[pipeline] = calibrate.fit_norms(model, targets, batches, pipeline=pipeline)
            seen[pipeline], states[pipeline] = mode.threads, set(state)
    finally:
        h.remove()
    # inference mode and bfloat16 autocast inside the layers, grad off, in both paths
    assert states["replay"] == states["lockstep"] == {(True, True, torch.bfloat16, False, torch.bfloat16)}
    assert any(t.startswith("normswap-calib-") for t in seen["lockstep"])  # the mode reached the workers
    assert threading.main_thread().name in seen["replay"]
    for n, f in fits["replay"].items():
        torch.testing.assert_close(fits["lockstep"][n].weight, f.weight, rtol=1e-6, atol=1e-8)
    last = list(plain)[-1]  # autocast changed the fits: it was not lost on the way
    assert not torch.allclose(fits["lockstep"][last].weight, plain[last].weight, rtol=1e-4, atol=1e-6)


def test_the_paused_forwards_stop_once_every_norm_is_fitted():
    """What runs after the last norm (a head, FastSpeech 2's HiFi-GAN vocoder: minutes per batch on CPU)
    is no part of any fit: the one-pass path's forwards end there."""
    torch.manual_seed(0)
    model = randomise_custom(PostLNEncoder(layers=2)).float()
    batches = [((torch.randint(0, 40, (4, 10)),), {}) for _ in range(2)]
    targets = [calibrate.Target(s.path, model.get_submodule(s.path), s) for s in find_norms(model, batches[0][0]).sites]
    calls: list[str] = []
    hooks = [model.head.register_forward_hook(lambda m, a, out: calls.append("head")),
             model.n2[-1].register_forward_hook(lambda m, a, out: calls.append("last norm"))]
    try:
        fits = calibrate.fit_norms(model, targets, batches, pipeline="lockstep")
    finally:
        for h in hooks:
            h.remove()
    assert len(fits) == len(targets) and "last norm" in calls and "head" not in calls
