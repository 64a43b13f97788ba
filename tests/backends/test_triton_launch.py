"""The triton launch-handle path (``normswap.backends.triton.launch``) and its fallback, with fake
kernels: the real path needs a GPU (tests/backends/test_gpu.py runs it there)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from normswap.backends import triton as tb

CUDA0 = torch.device("cuda", 0)


class FakeCompiled:
    function = "fn"
    packed_metadata = "meta"

    def __init__(self, log, fail=False):
        self.log, self.fail = log, fail

    def run(self, *args):
        if self.fail:
            raise TypeError("launcher signature changed")
        self.log.append(("handle", args))


class FakeKernel:
    """``kernel[grid](*args, **kw)`` records the call and returns a compiled handle, like triton's."""

    def __init__(self, fail=False):
        self.log: list = []
        self.fail = fail

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.log.append(("triton", grid, args, kwargs))
            return FakeCompiled(self.log, self.fail)

        return call


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(tb, "HANDLES_ENABLED", [True])
    monkeypatch.setattr(tb, "_HANDLES", {})
    monkeypatch.setattr(tb, "current_stream", lambda index: 1234)
    monkeypatch.setattr(tb, "_launch_hooks_set", lambda: False)


def _args(ptr_offset=0):
    x = torch.zeros(64)
    return (x[ptr_offset:], 4096, 1, 3.0)


def test_second_launch_goes_through_the_handle_with_positional_constexprs():
    k = FakeKernel()
    args = _args()
    for _ in range(3):
        tb.launch(k, (7,), args, {"HAS_W": 1, "BLOCK_N": 64}, {"num_warps": 4}, CUDA0)
    kinds = [e[0] for e in k.log]
    assert kinds == ["triton", "handle", "handle"]
    _, run_args = k.log[1]
    assert run_args[:4] == (7, 1, 1, 1234)  # grid padded to 3 dims, then the stream
    assert run_args[-6:-2] == args and run_args[-2:] == (1, 64)  # runtime args, then constexprs in order
    assert tb.launch_handles() == 1


def test_a_new_specialisation_goes_back_to_triton():
    k = FakeKernel()
    tb.launch(k, (1,), _args(), {"HAS_W": 1}, {}, CUDA0)
    tb.launch(k, (1,), _args(ptr_offset=1), {"HAS_W": 1}, {}, CUDA0)  # 4-byte offset: not 16-aligned
    x = torch.zeros(64)
    tb.launch(k, (1,), (x, 4096, 2, 3.0), {"HAS_W": 1}, {}, CUDA0)  # an int that was 1 is now 2
    tb.launch(k, (1,), _args(), {"HAS_W": 0}, {}, CUDA0)  # another constexpr
    assert [e[0] for e in k.log] == ["triton"] * 4
    assert tb.launch_handles() == 4


def test_spec_key_follows_triton_specialisation():
    a = torch.zeros(64)
    assert tb._spec_key((a, 1)) != tb._spec_key((a, 2))
    assert tb._spec_key((a, 32)) != tb._spec_key((a, 33))
    assert tb._spec_key((a, 32)) == tb._spec_key((a, 48))
    assert tb._spec_key((a, 1 << 31)) != tb._spec_key((a, 16))
    assert tb._spec_key((a,)) != tb._spec_key((a[1:],))
    assert tb._spec_key((a,)) != tb._spec_key((a.half(),))


def test_a_failing_handle_falls_back_to_triton_for_good():
    k = FakeKernel(fail=True)
    for _ in range(3):
        tb.launch(k, (1,), _args(), {"HAS_W": 1}, {}, CUDA0)
    assert [e[0] for e in k.log] == ["triton", "triton", "triton"]
    assert tb.HANDLES_ENABLED == [False] and tb.launch_handles() == 0


def test_cpu_and_profiler_hooks_take_triton_path(monkeypatch):
    k = FakeKernel()
    for _ in range(2):
        tb.launch(k, (1,), _args(), {}, {}, torch.device("cpu"))  # the interpreter: no handles
    assert [e[0] for e in k.log] == ["triton", "triton"] and tb.launch_handles() == 0
    tb.launch(k, (1,), _args(), {}, {}, CUDA0)
    monkeypatch.setattr(tb, "_launch_hooks_set", lambda: True)
    tb.launch(k, (1,), _args(), {}, {}, CUDA0)
    assert [e[0] for e in k.log][-2:] == ["triton", "triton"]



@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_forward_gives_the_generic_specialisation_16_warps_on_blocks_of_4096(monkeypatch):
    """Rows of 2049-4096 elements: the aligned (vectorised) launch keeps 8 warps; a call triton compiles
    generically (an unaligned row length, row stride or pointer) gets 16, where triton 3.6's ptxas does
    not spill (tests/backends/test_triton_aot.py compiles both). Other lengths: one config."""
    seen = []
    monkeypatch.setattr(tb, "launch", lambda kernel, grid, args, constexprs, options, device:
                        seen.append((constexprs["BLOCK_N"], options["num_warps"])))
    wide = torch.randn(3, 4112, dtype=torch.bfloat16)  # rows 4112 apart: a multiple of 16
    odd = torch.randn(3, 4100, dtype=torch.bfloat16)  # rows 4100 apart: not one
    w = torch.ones(4096, dtype=torch.bfloat16)
    for x, want in (
        (wide[:, :4096].contiguous(), (4096, 8)),
        (wide[:, :4096], (4096, 8)),  # strided rows, still aligned
        (odd[:, :4096], (4096, 16)),  # row stride not a multiple of 16
        (wide[:, 8:4104], (4096, 8)),  # 8 bf16 = 16 bytes in: still aligned
        (wide[:, 1:4097], (4096, 16)),  # pointer 2 bytes past a 16-byte boundary
        (wide[:, :3000].contiguous(), (4096, 16)),  # row length not a multiple of 16
        (wide[:, :2048].contiguous(), (2048, 8)),  # another block size: one config
        (wide[:, 1:2049], (2048, 8)),
    ):
        seen.clear()
        n = x.shape[-1]
        tb.forward(x, (n,), w[:n], None, 1e-6)
        assert seen == [want], (tuple(x.shape), x.stride(), x.data_ptr() % 16, seen)
