"""The recipe under FSDP2 (accelerate's ``fully_shard`` path, one process over gloo on CPU).

Under FSDP2 a module's registered parameters alternate between the sharded ``DTensor`` and a plain
unsharded tensor, and the model ends sharded: the run must clip the gradients of the parameters the
optimiser steps and save one gathered, plain model. With one process, FSDP computes what a plain
single-process run computes, so the two runs must agree step for step and in the saved weights.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import normswap

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "distill-causal-lm.yaml"


def _records(out: Path, split: str) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["split"] == split]


def test_fsdp2_run_matches_a_single_process_run(tiny_gpt2, corpus, tmp_path, warm_python):
    overrides = [
        f"model.source={tiny_gpt2}", f"data.path={corpus}", "train.steps=4", "train.warmup_steps=1",
        "train.lr=1e-3", "train.max_grad_norm=0.05", "train.mixed_precision=no", "data.seq_len=32",
        "data.batch_size=8", "data.eval_batch_size=16", "eval.every=2", "eval.keep_best=false", "log.every=1",
        "log.progress_bar=false", "log.plot=false", "checkpoint.every=2",
    ]
    sharded = tmp_path / "fsdp"
    # both runs are children of the warm fork server (torch, transformers and accelerate imported, normswap not,
    # no process group): the launcher run as a program (``runpy``, as ``python fsdp_cpu.py`` would), with the
    # environment above; accelerate reads its FSDP variables when the state is made, which the launcher sets
    # first. OpenMP read its thread count when the server imported torch, so the child sets the one thread itself
    child = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "NORMSWAP_DEBUG": "1"}
    launcher = ("import torch, runpy\n"
                "torch.set_num_threads(1)\n"
                f"runpy.run_path({str(Path(__file__).with_name('fsdp_cpu.py'))!r}, run_name='__main__')\n")
    proc = warm_python.run(launcher, str(RECIPE), *overrides, f"output.dir={sharded}", timeout=300, env=child)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # it did run sharded: accelerate wrote FSDP's sharded (torch.distributed.checkpoint) state
    assert sorted(p.name for p in (sharded / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    assert list((sharded / "checkpoints" / "step-000004" / "pytorch_model_fsdp_0").glob("*.distcp"))

    plain = tmp_path / "plain"  # the same run, one ordinary process, also on CPU whatever the machine has
    # ``python -m normswap.recipes``, likewise a child of the warm fork server
    code = ("import torch, runpy\n"
            "torch.set_num_threads(1)\n"
            "runpy.run_module('normswap.recipes', run_name='__main__', alter_sys=True)\n")
    proc = warm_python.run(code, str(RECIPE), *overrides, f"output.dir={plain}", timeout=300, env=child)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the same losses step by step: the clip (max_grad_norm small enough to act) and the optimiser
    # step saw the sharded parameters' gradients
    losses = [[r["loss"] for r in _records(out, "train")] for out in (sharded, plain)]
    assert len(losses[0]) == 4
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-4, atol=1e-6)
    assert _records(sharded, "after")[0]["kl"] != _records(sharded, "before")[0]["kl"]  # it trained

    # the saved model is the gathered student, not the step-0 one or a shard
    got, want = normswap.load(sharded / "model"), normswap.load(plain / "model")
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in got.modules())
    sd_got, sd_want = got.state_dict(), want.state_dict()
    assert sd_got.keys() == sd_want.keys()
    for name, value in sd_want.items():
        torch.testing.assert_close(sd_got[name], value, rtol=1e-4, atol=1e-5, msg=name)
    ids = torch.randint(5, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(got(input_ids=ids).logits, want(input_ids=ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_two_process_fsdp2_saves_the_gathered_shards(tiny_gpt2, corpus, tmp_path, warm_python):
    """Two processes, each holding half of every weight: the saved model is the full gather, equal to
    what accelerate's sharded checkpoint of the last step holds."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / "fsdp2"
    args = ["--standalone", "--nproc_per_node", "2", str(Path(__file__).with_name("fsdp_cpu.py")),
            str(RECIPE), f"model.source={tiny_gpt2}", f"data.path={corpus}", f"output.dir={out}", "train.steps=2",
            "train.warmup_steps=1", "train.lr=1e-3", "data.seq_len=32", "data.batch_size=8",
            "data.eval_batch_size=16", "eval.every=2", "log.every=1", "log.progress_bar=false", "log.plot=false",
            "checkpoint.every=2"]
    env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    # ``torchrun`` (the console script's entry point, ``torch.distributed.run:main``) as a child of the warm fork
    # server: the launcher's own interpreter start is not under test; the two processes its elastic agent starts
    # (``sys.executable -u fsdp_cpu.py ...``) are fresh interpreters as before, with the environment set here
    torchrun = "import sys\nfrom torch.distributed.run import main\nsys.argv[0] = 'torchrun'\nmain()\n"
    proc = warm_python.run(torchrun, *args, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sum(line.startswith("done:") for line in proc.stdout.splitlines()) == 1, proc.stdout
    shards = out / "checkpoints" / "step-000002" / "pytorch_model_fsdp_0"
    assert len(list(shards.glob("*.distcp"))) == 2  # one shard file per process
    dcp_to_torch_save(shards, tmp_path / "full.pt")
    checkpoint = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    saved = normswap.load(out / "model").state_dict()
    assert saved.keys() == checkpoint.keys()
    for name, value in saved.items():
        torch.testing.assert_close(value, checkpoint[name].to(value.dtype), rtol=0, atol=0, msg=name)


def test_meta_copy_then_materialize_rebuilds_ties_buffers_and_dtypes():
    """What save() does under FSDP, without processes: the meta copy costs no memory, keeps the ties
    and the norm's settings; filling it takes each tie's value from whichever name the gathered state
    holds, casts to the copy's dtypes, takes a non-persistent buffer from the trained model's buffers
    (no state dict has it), and refuses to leave anything on the meta device."""
    from torch import nn

    from normswap.recipes import models as models_mod
    from normswap.recipes.runner import _plain_name

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.norm = normswap.RMSNorm(8, eps=1e-5, bias=True, dtype=torch.bfloat16)
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight  # tied
            self.register_buffer("table", torch.arange(8.0), persistent=False)

    model = Tiny()
    skeleton = models_mod.meta_copy(model)
    assert all(t.is_meta for t in (*skeleton.parameters(), *skeleton.buffers()))
    assert skeleton.head.weight is skeleton.emb.weight and skeleton.norm.eps == 1e-5
    trained = {"head.weight": torch.randn(10, 8), "norm.weight": torch.rand(8), "norm.bias": torch.rand(8)}
    buffers = {_plain_name("_checkpoint_wrapped_module.table"): torch.arange(8.0) * 2}
    with pytest.raises(RuntimeError, match="no value for emb.weight"):
        models_mod.materialize(models_mod.meta_copy(model), {}, buffers)
    out = models_mod.materialize(skeleton, trained, buffers)
    assert out.head.weight is out.emb.weight and torch.equal(out.emb.weight, trained["head.weight"])
    assert out.norm.weight.dtype == torch.bfloat16
    assert torch.equal(out.norm.weight, trained["norm.weight"].bfloat16())
    assert torch.equal(out.table, torch.arange(8.0) * 2)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    want = normswap.rms_norm(x, 8, out.norm.weight, out.norm.bias, eps=1e-5)
    torch.testing.assert_close(out.norm(x), want, rtol=0, atol=0)  # the norm runs on the real tensors
