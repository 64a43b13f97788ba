"""Host cost per call: the backend decision is made once, not on every call (issue 10, item 1).

These tests count calls to the functions that used to run per call (availability, device queries,
the ``auto`` rule) across many module calls; they fail if per-call resolution comes back. CUDA paths
are exercised on CPU by faking the device facts.
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from collections import Counter

import pytest
import torch

import normswap
from normswap import backends
from normswap.backends import cpu, eager, native
from normswap.backends import triton as tb

CALLS = 40


@pytest.fixture
def counts(monkeypatch):
    """Wrap every decision-time function in a counter."""
    counter: Counter = Counter()

    def wrap(owner, attr):
        fn = getattr(owner, attr)

        def counted(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("normswap"):  # torch's own lazy imports call find_spec too
                counter[f"{getattr(owner, '__name__', owner)}.{attr}"] += 1
            return fn(*args, **kwargs)

        monkeypatch.setattr(owner, attr, counted)

    for owner, attr in [
        (backends, "bind"), (backends, "select"), (backends, "select_for"), (backends, "resolve"),
        (backends, "env_backend"), (importlib.util, "find_spec"), (torch.cuda, "is_available"),
        (torch.cuda, "get_device_name"), (torch.cuda, "get_device_properties"),
        (cpu, "available"), (native, "available"), (eager, "available"), (tb, "available"),
        (cpu, "supports"), (native, "supports"), (tb, "supports"),
    ]:
        wrap(owner, attr)
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    backends.refresh()
    yield counter
    backends.refresh()


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_module_decides_once_per_device_dtype_and_grad_state(counts, device):
    m = normswap.RMSNorm(64, bias=True, device=device)
    keys = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        m.to(dtype)  # casting the module drops its decisions: a new one per dtype
        for grad in (False, True):
            keys += 1
            x = torch.randn(3, 5, 64, dtype=dtype, device=device)
            with torch.set_grad_enabled(grad):
                for i in range(CALLS):
                    m(x[: 1 + i % 3])  # the shape class varies: no new decision on CPU/meta
    assert counts["normswap.backends.bind"] == keys
    # every other decision-time function ran a bounded number of times, not once per call
    for name, n in counts.items():
        assert n <= 2 * keys, f"{name} ran {n} times over {keys * CALLS} calls"
    assert counts["normswap.backends.env_backend"] <= keys


def test_functional_calls_read_env_and_availability_once(counts):
    x, w = torch.randn(4, 32), torch.ones(32)
    for _ in range(CALLS):
        normswap.rms_norm(x.double(), 32, w.double())  # not the CPU fast path: goes through resolve
    assert counts["importlib.util.find_spec"] == 0
    assert counts["torch.cuda.is_available"] <= 1
    assert sum(counts[f"{m}.available"] for m in ("normswap.backends.cpu", "normswap.backends.native",
                                                  "normswap.backends.triton")) <= 3


def _allocations(prof) -> int:
    """aten::empty* events not nested in another one (empty_like calls empty inside)."""
    return sum(1 for e in prof.function_events if e.name.startswith("aten::empty")
               and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::empty")))


def test_no_grad_call_allocates_only_the_output_and_never_syncs():
    m = normswap.RMSNorm(256, bias=True)
    x = torch.randn(8, 256)
    with torch.no_grad():
        m(x)  # decide (and build) first
        with torch.autograd.profiler.profile() as prof:
            for _ in range(5):
                m(x)
    names = Counter(e.name for e in prof.function_events)
    allocs = _allocations(prof)
    assert allocs == 5, names  # one output per call
    assert "aten::_local_scalar_dense" not in names and "aten::item" not in names  # .item() syncs a GPU
    assert not any(k in names for k in ("aten::to", "aten::_to_copy", "aten::copy_", "aten::contiguous"))


def test_grad_call_allocates_output_and_rstd_only():
    m = normswap.RMSNorm(256)
    x = torch.randn(8, 256, requires_grad=True)
    m(x)
    with torch.autograd.profiler.profile() as prof:
        for _ in range(5):
            m(x)
    names = Counter(e.name for e in prof.function_events)
    allocs = _allocations(prof)
    if cpu.available()[0]:
        assert allocs == 10, names  # output + rstd
    assert "aten::_local_scalar_dense" not in names


def test_setting_backend_or_moving_the_module_drops_the_decision(counts, monkeypatch):
    m = normswap.RMSNorm(32)
    x = torch.randn(2, 32)
    with torch.no_grad():
        m(x)
        m(x)
        assert counts["normswap.backends.bind"] == 1
        m.backend = "eager"
        calls = []
        real = eager.rms_norm
        monkeypatch.setattr(eager, "rms_norm", lambda *a: calls.append(1) or real(*a))
        m(x)
        assert calls and counts["normswap.backends.bind"] == 2
        m.float()
        m(x)
        assert counts["normswap.backends.bind"] == 3
    with pytest.raises(normswap.errors.NormswapError, match="choose one of"):
        m.backend = "fast"


def test_cuda_decision_is_a_threshold_on_numel(monkeypatch):
    """The bound CUDA call compares numel with the eager and graph thresholds; the capture query runs
    only between them. Device facts are faked (meta tensors stand in for CUDA ones)."""
    picked: list[str] = []
    monkeypatch.setattr(backends, "is_available", lambda name: True)
    monkeypatch.setattr(tb, "supports", lambda x, w, b: True)
    monkeypatch.setattr(tb, "bind", lambda *a: (lambda x, w, b, eps: picked.append("triton")))
    monkeypatch.setattr(native, "bind", lambda *a: (lambda x, w, b, eps: picked.append("native")))
    capturing = {"value": False, "queries": 0}

    def fake_capturing():
        capturing["queries"] += 1
        return capturing["value"]

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", fake_capturing)
    n = 4096
    x = torch.empty(2048, n, dtype=torch.bfloat16, device="meta")
    w = torch.empty(n, dtype=torch.bfloat16, device="meta")
    impl = backends._bind_cuda(x, w, None, (n,), False)
    eager_min = backends.eager_triton_min_elements(torch.bfloat16, grad=False, extra_pass=False)
    graph_min = backends.graph_triton_min_elements(n, grad=False, extra_pass=False)
    assert graph_min <= 2048 * n < eager_min

    impl(x[:1], w, None, 1e-6)  # decode: below both thresholds, no query
    assert picked == ["native"] and capturing["queries"] == 0
    impl(x, w, None, 1e-6)  # between: eager -> native
    assert picked[-1] == "native" and capturing["queries"] == 1
    capturing["value"] = True
    impl(x, w, None, 1e-6)  # between, capturing a CUDA graph -> triton
    assert picked[-1] == "triton"
    big = torch.empty(int(eager_min) // n + 1, n, dtype=torch.bfloat16, device="meta")
    queries = capturing["queries"]
    impl(big, w, None, 1e-6)
    assert picked[-1] == "triton" and capturing["queries"] == queries


@pytest.mark.parametrize(("device", "backend"), [("cpu", "native"), ("meta", "auto")])
def test_functional_calls_decide_once_per_signature(counts, device, backend):
    # (an explicit backend on CPU: the auto CPU fast path never reaches a decision at all)
    w = torch.ones(64, device=device)
    x = torch.randn(4, 64, device=device)
    for i in range(CALLS):
        normswap.rms_norm(x[: 1 + i % 4], 64, w, backend=backend)
    assert counts["normswap.backends.bind"] == 1
    assert counts["normswap.backends.resolve"] == 0 and counts["normswap.backends.select_for"] <= 1
    normswap.rms_norm(x, 64, w.double(), backend=backend)  # another parameter dtype: another decision
    assert counts["normswap.backends.bind"] == 2
    with pytest.raises(ValueError, match="does not end with"):
        normswap.rms_norm(x, 32, w, backend=backend)


# ------------------------------------------------- per-call Python cost of the module's forward (issue 40)
@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_reads_parameters_without_module_getattr(monkeypatch, grad, bias):
    """``self.weight`` on an nn.Module goes through ``Module.__getattr__`` (Python, ~0.6 us a read on
    CPU, a sixth of a decode-sized norm call); the forward reads ``_parameters`` instead. Counted, not
    timed: the forward makes no ``__getattr__`` call at all once its decision is cached."""
    m = normswap.RMSNorm(64, bias=bias)
    x = torch.randn(2, 64)
    with torch.set_grad_enabled(grad):
        ref = m(x)
        reads: list[str] = []
        real = torch.nn.Module.__getattr__

        def counted(self, name):
            reads.append(name)
            return real(self, name)

        monkeypatch.setattr(torch.nn.Module, "__getattr__", counted)
        for _ in range(5):
            y = m(x)
        monkeypatch.undo()
    assert reads == []
    torch.testing.assert_close(y, ref, rtol=0, atol=0)


def test_forward_reads_a_parametrized_or_absent_weight_the_ordinary_way():
    """A parameter that is not in ``_parameters`` (a parametrization's property; no weight at all) is
    still what the forward uses."""
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    x = torch.randn(3, 16, dtype=torch.float64)
    m = normswap.RMSNorm(16, bias=True, dtype=torch.float64)
    with torch.no_grad():
        m.weight.copy_(torch.randn(16, dtype=torch.float64))
        m.bias.copy_(torch.randn(16, dtype=torch.float64))
    plain = m(x)
    parametrize.register_parametrization(m, "weight", Double())
    assert "weight" not in m._parameters
    want = (plain - m.bias) * 2 + m.bias
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            torch.testing.assert_close(m(x), want)
    bare = normswap.RMSNorm(16, elementwise_affine=False, dtype=torch.float64)
    torch.testing.assert_close(bare(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + bare.eps))


def test_forward_sees_parameters_swapped_by_functional_call():
    """``torch.func.functional_call`` swaps tensors into ``_parameters``: the forward uses them."""
    m = normswap.RMSNorm(16, bias=True)
    x, w, b = torch.randn(3, 16), torch.randn(16), torch.randn(16)
    with torch.no_grad():
        m(x)  # a cached decision first
        got = torch.func.functional_call(m, {"weight": w, "bias": b}, (x,))
        torch.testing.assert_close(got, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.eps) * w + b)
        torch.testing.assert_close(m(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.eps))


def test_converted_model_dispatches_no_more_aten_ops_than_the_original():
    """Eager per-call work of a whole converted model, counted by op: each LayerNorm's ``aten.layer_norm``
    becomes at most one aten op (the output's allocation; the C++ kernel then fills it), and nothing
    else is added around the norms (no casts, no bias add, no copies)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.fc1 = torch.nn.LayerNorm(32), torch.nn.Linear(32, 64)
            self.ln2, self.fc2 = torch.nn.LayerNorm(64), torch.nn.Linear(64, 32)
            self.ln_f = torch.nn.LayerNorm(32)

        def forward(self, x):
            x = x - x.mean(-1, keepdim=True)  # centred stream: every norm converts exactly
            h = x + self.fc2(self.ln2(torch.relu(self.fc1(self.ln1(x)))))
            return self.ln_f(h)

    torch.manual_seed(0)
    model = Block().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    converted = copy.deepcopy(model)
    normswap.patch(converted, torch.randn(2, 5, 32), mode="all", calibration=False)
    assert not any(isinstance(m, torch.nn.LayerNorm) for m in converted.modules())
    x = torch.randn(2, 5, 32)
    counts = []
    for net in (model, converted):
        with torch.inference_mode():
            net(x)  # decide first
            with Count() as c:
                net(x)
        counts.append(c.ops)
    original, ours = counts
    assert original["aten.layer_norm"] == 3 and ours["aten.layer_norm"] == 0
    assert sum(ours.values()) <= sum(original.values()), (original, ours)
    added = {op: n - original[op] for op, n in ours.items() if n > original[op]}
    assert added == {"aten.empty_like": 3}, added  # the three outputs, nothing else
