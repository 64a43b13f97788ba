"""The triton launch-handle path (``normswap.backends.triton.launch``) and its fallback, with fake
kernels: the real path needs a GPU (tests/backends/test_gpu.py runs it there)."""

from __future__ import annotations

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
