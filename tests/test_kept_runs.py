"""A conversion runs the original no more often than its figures need (round 63).

Two forwards repeated another on the same inputs: building the reload probe runs the model once to check the
layout it chose, then ``convert`` ran it again for the original's outputs on that probe; ``patch``'s route
check runs the model on the built inputs, then the commit ran it again for the original's error in its own
dtype. The trial forward's output is kept now (:func:`normswap.inputs.builder.keeping_runs`) and used where it
computes exactly what the second run would (eval mode, the factory dtype the model's, the same seeded draws).
These tests compare each conversion against the same conversion with nothing kept: one forward fewer per reuse,
every figure and every written byte the same. And a full garbage collection runs only where dropping a model
did not free it (:func:`normswap.memory.release`)."""

from __future__ import annotations

import copy
import gc
import hashlib
import weakref
from pathlib import Path

import torch
import transformers as tf
from click.testing import CliRunner

from normswap import memory, patch
from normswap.cli import main
from normswap.inputs import builder

GPT2 = tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=99, n_positions=64)
DINOV2 = tf.Dinov2Config(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         mlp_ratio=2, layerscale_value=0.5)


def _randomised(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=g))
    return model.eval()


class _Count:
    """Calls of a model's own forward (not of its submodules)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.n = 0
        self.handle = model.register_forward_pre_hook(self.hook)

    def hook(self, *_: object) -> None:
        self.n += 1


def _patched(model: torch.nn.Module) -> tuple[dict, int]:
    count = _Count(model)
    report = patch(model)
    count.handle.remove()
    return report.verification, count.n


def test_patch_reuses_the_route_checks_run_for_the_original_in_its_own_dtype(monkeypatch):
    torch.manual_seed(0)
    model = _randomised(tf.GPT2LMHeadModel(GPT2))
    kept_figures, kept_runs = _patched(copy.deepcopy(model))
    monkeypatch.setattr(builder, "_runs_as_is", lambda model: False)
    figures, runs = _patched(copy.deepcopy(model))
    assert "original_in_model_dtype" in figures  # a float32 model worked in float64: the cast is measured
    assert kept_figures == figures
    assert kept_runs == runs - 1


def test_convert_writes_the_same_bytes_with_two_forwards_fewer(tmp_path, monkeypatch):
    torch.manual_seed(0)
    _randomised(tf.Dinov2Model(DINOV2)).save_pretrained(tmp_path / "dinov2")
    calls = []

    def counted(module: torch.nn.Module, *_: object) -> None:  # every DINOv2 forward: original, copies, reloaded
        if isinstance(module, tf.Dinov2Model):
            calls.append(1)

    def convert(out: Path) -> tuple[dict[str, str], int]:
        calls.clear()
        monkeypatch.setattr(builder, "_CHOSEN", {})  # the layout check runs, as in a fresh process
        handle = torch.nn.modules.module.register_module_forward_pre_hook(counted)
        try:
            res = CliRunner().invoke(main, ["convert", str(tmp_path / "dinov2"), "--out", str(out), "-q"],
                                     catch_exceptions=False)
        finally:
            handle.remove()
        assert res.exit_code == 0, res.stderr
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}, len(calls)

    kept_files, kept_runs = convert(tmp_path / "kept" / "out")
    monkeypatch.setattr(builder, "_runs_as_is", lambda model: False)
    files, runs = convert(tmp_path / "plain" / "out")
    assert kept_files == files  # model.safetensors, config.json (every figure), the model card
    assert kept_runs == runs - 2  # the layout check's, and the route check's


def test_a_trial_keeps_nothing_where_it_computes_something_else():
    """A model in training mode (the trial switches it to eval) or in float64 (the trial holds its float32
    casts at float64): its trial output is not what a plain forward of it gives, so none is kept."""
    torch.manual_seed(0)
    model = _randomised(tf.GPT2LMHeadModel(GPT2))
    kwargs = builder.hf_example_inputs(model)
    for variant in (copy.deepcopy(model).train(), copy.deepcopy(model).double()):
        with builder.keeping_runs(variant, torch.no_grad) as kept:
            assert builder.run_error(variant, kwargs) is None
        assert kept.output_on(kwargs) is None
    with builder.keeping_runs(model, torch.no_grad, on=kwargs) as kept:
        assert builder.run_error(model, dict(kwargs)) is None  # equal values, another dict: not kept
        assert kept.output_on(kwargs) is None
        assert builder.run_error(model, kwargs) is None
    with torch.no_grad():
        expected = model(**kwargs)
    assert torch.equal(kept.output_on(kwargs).logits, expected.logits)


class _Cyclic:
    def __init__(self) -> None:
        self.me = self


class _Plain:
    pass


def test_release_collects_only_what_a_cycle_holds(monkeypatch):
    collected = []
    real = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(1) or real(*a))
    plain = _Plain()
    dropped = weakref.ref(plain)
    del plain
    assert memory.release(dropped) is False and not collected  # freed by its reference count: nothing to walk
    gc.disable()  # no automatic collection between the del and the check
    try:
        cyclic = _Cyclic()
        dropped = weakref.ref(cyclic)
        del cyclic
        assert dropped() is not None
        assert memory.release(dropped) is True and collected == [1]
        assert dropped() is None
    finally:
        gc.enable()
