"""``normswap.RMSNorm`` with ``DTensor`` parameters and inputs (FSDP2, tensor parallelism), on CPU.

The ``cpu`` (and ``triton``) kernels read tensors by pointer; a DTensor's own storage is not its data,
so such calls must go to the aten backends, which DTensor dispatches, and give the values a plain call
gives. A one-process gloo group is enough to make real DTensors and run ``fully_shard``.
"""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

import normswap
from normswap import backends
from normswap.backends import cpu

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")


@pytest.fixture(scope="module")
def mesh():
    from torch.distributed.device_mesh import init_device_mesh

    started = not dist.is_initialized()
    if started:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if started:
            dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_dtensor_parameters_and_input_match_a_plain_call(mesh, dtype, bias):
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    torch.manual_seed(0)
    norm = normswap.RMSNorm(24, eps=1e-5, bias=bias, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_()
        if bias:
            norm.bias.normal_()
    ref = copy.deepcopy(norm)
    x = torch.randn(6, 24, dtype=dtype)
    x_ref = x.clone().requires_grad_(True)
    y_ref = ref(x_ref)
    y_ref.backward(torch.ones_like(y_ref))
    if cpu.available()[0]:  # the plain call takes the pointer-reading kernel
        assert backends.select(x, ref.weight, ref.bias) is cpu

    norm(x.clone())  # a decision for plain tensors is cached first, as in a model used before sharding
    for name in ("weight", "bias") if bias else ("weight",):
        # what tensor parallelism's distribute_module does: register_parameter, not __setattr__
        norm.register_parameter(name, nn.Parameter(distribute_tensor(getattr(norm, name).detach(), mesh,
                                                                     [Replicate()])))
    xd = distribute_tensor(x.clone(), mesh, [Shard(0)]).requires_grad_(True)
    assert not cpu.supports(xd, norm.weight, norm.bias) and not cpu.supports(x, norm.weight, None)
    assert backends.select(xd, norm.weight, norm.bias) is not cpu
    y = norm(xd)
    assert isinstance(y, DTensor)
    torch.testing.assert_close(y.full_tensor(), y_ref)  # native vs the cpu kernel: rounding only
    y.backward(distribute_tensor(torch.ones_like(y_ref), mesh, [Shard(0)]))
    torch.testing.assert_close(xd.grad.full_tensor(), x_ref.grad)
    torch.testing.assert_close(norm.weight.grad.full_tensor(), ref.weight.grad)
    if bias:
        torch.testing.assert_close(norm.bias.grad.full_tensor(), ref.bias.grad)
    with torch.no_grad():  # the functional form, and a plain call again on the same module
        yf = normswap.rms_norm(xd, 24, norm.weight, norm.bias, eps=1e-5)
        torch.testing.assert_close(yf.full_tensor(), y_ref.detach())
        torch.testing.assert_close(normswap.rms_norm(x, 24, ref.weight, ref.bias, eps=1e-5), y_ref.detach())


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = normswap.RMSNorm(d, eps=1e-5, bias=True)
        self.fc = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.fc(self.norm(x)))


def test_fully_shard_training_step_matches_unsharded(mesh):
    """FSDP2 swaps each norm's parameters (DTensor shard <-> gathered tensor) around every forward:
    a held-out pass, then training steps with clipping, must give what the unsharded model gives."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = nn.Sequential(*[_Block(16) for _ in range(2)], normswap.RMSNorm(16, eps=1e-5))
    for m in model.modules():
        if isinstance(m, normswap.RMSNorm):
            with torch.no_grad():
                m.weight.uniform_(0.5, 1.5)
    plain = copy.deepcopy(model)
    for block in model[:2]:
        fully_shard(block, mesh=mesh)
    fully_shard([model[2]], mesh=mesh, reshard_after_forward=False)  # as accelerate groups the final norm
    fully_shard(model, mesh=mesh)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, plain)]
    x = torch.randn(4, 8, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x))
    for step in range(3):
        for m, opt in zip((model, plain), opts, strict=True):
            loss = m(x + step).square().mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(m.parameters()), 0.1)
            opt.step()
            opt.zero_grad(set_to_none=True)
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert isinstance(p, DTensor), name
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)
