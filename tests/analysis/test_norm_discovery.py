"""Norms are found by what their traced forward computes, not by their class name (issue 37 §4).

A hand-written LayerNorm in a class with any name, a LayerNorm whose β is a buffer, and a norm whose
``forward`` takes extra arguments (``norm(h, batch=batch)``, as graph libraries call theirs) are
converted exactly; one whose extra argument changes what it computes is kept, with that reason.
"""

import copy

import torch
import torch.nn.functional as F
from torch import nn

import normswap
from normswap.nn.call_args import RMSNormTakingArgs


class MyLN(nn.Module):
    """A LayerNorm written in ops, in a class whose name says nothing."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.randn(d))
        self.b = nn.Parameter(torch.randn(d))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-5) * self.g + self.b


class Affine(nn.Module):
    """rsqrt-based, γ first: the same formula written another way (no `norm` in the name either)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(d))
        self.shift = nn.Parameter(torch.randn(d))

    def forward(self, x):
        c = x - x.mean(-1, keepdim=True)
        return self.scale * (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6)) + self.shift


class BufferBeta(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.randn(d))
        self.register_buffer("beta_buffer", torch.randn(d))

    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.gamma, self.beta_buffer)


class GraphNorm(nn.Module):
    """Called as ``norm(h, batch=batch)``; ``per_graph`` makes the batch vector change the computation
    (a LayerNorm over all nodes and features of each graph, as PyG's ``mode='graph'``)."""

    def __init__(self, d: int, per_graph: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.bias = nn.Parameter(torch.randn(d))
        self.per_graph = per_graph

    def forward(self, x, batch=None):
        if not self.per_graph or batch is None:
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, 1e-5)
        out = torch.empty_like(x)
        for g in batch.unique():
            rows = x[batch == g]
            out[batch == g] = (rows - rows.mean()) / torch.sqrt(rows.var(unbiased=False) + 1e-5)
        return out * self.weight + self.bias


class Net(nn.Module):
    """Pre-LN: an input projection, one residual block, a final norm and a head."""

    def __init__(self, norm, takes_batch: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.n1 = norm(16)
        self.fc = nn.Linear(16, 16)
        self.n2 = norm(16)
        self.head = nn.Linear(16, 3)
        self.takes_batch = takes_batch

    def forward(self, x, batch):
        kw = {"batch": batch} if self.takes_batch else {}
        h = self.inp(x)
        h = h + self.fc(F.gelu(self.n1(h, **kw)))
        return self.head(self.n2(h, **kw))


def _inputs(n: int = 10, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, dtype=torch.float64, generator=gen), torch.tensor([0] * (n // 2) + [1] * (n - n // 2))


def _patched(model: nn.Module):
    original = copy.deepcopy(model)
    report = normswap.patch(model, example_inputs=_inputs(), stem_centering="weights")  # its Linear stem by weights
    probe = _inputs(14, seed=1)
    with torch.no_grad():
        err = float((model(*probe) - original(*probe)).abs().max() / original(*probe).abs().max())
    return report, err


def test_layernorm_written_in_ops_is_found_whatever_its_class_is_called():
    for norm in (MyLN, Affine):
        torch.manual_seed(0)
        report, err = _patched(Net(norm).double().eval())
        assert {s.name: s.verdict for s in report.sites} == {"n1": "exact", "n2": "exact"}, norm
        assert err <= 1e-9, (norm, err)
        assert {s.class_name for s in report.plan.sites} == {norm.__name__}


def test_beta_held_in_a_buffer_is_that_layernorm_beta():
    torch.manual_seed(1)
    model = Net(BufferBeta).double().eval()
    found = normswap.pipeline.find_norms(model, _inputs()).sites
    assert [(s.path, s.weight_attr, s.bias_attr) for s in found] == [("n1", "gamma", "beta_buffer"),
                                                                      ("n2", "gamma", "beta_buffer")]
    report, err = _patched(model)
    assert all(s.verdict == "exact" for s in report.sites)
    assert err <= 1e-9


def test_norm_called_with_extra_arguments_is_replaced_by_one_that_accepts_them():
    torch.manual_seed(2)
    model = Net(GraphNorm, takes_batch=True).double().eval()
    report, err = _patched(model)
    assert all(s.verdict == "exact" for s in report.sites)
    assert all(s.extra_args for s in report.plan.sites)
    assert isinstance(model.n1, RMSNormTakingArgs) and isinstance(model.n1, normswap.RMSNorm)
    assert err <= 1e-9
    x, batch = _inputs()
    assert torch.equal(model.n2(x @ torch.ones(8, 16, dtype=torch.float64), batch=batch),
                       model.n2(x @ torch.ones(8, 16, dtype=torch.float64)))


def test_extra_argument_norm_survives_save_and_load(tmp_path):
    torch.manual_seed(3)
    model = Net(GraphNorm, takes_batch=True).double().eval()
    normswap.patch(model, example_inputs=_inputs())
    normswap.save(model, tmp_path / "out")
    fresh = normswap.load(tmp_path / "out", model=Net(GraphNorm, takes_batch=True).double().eval())
    assert isinstance(fresh.n1, RMSNormTakingArgs)
    probe = _inputs(6, seed=4)
    with torch.no_grad():
        assert torch.equal(fresh(*probe), model(*probe))


def test_extra_argument_that_changes_the_computation_keeps_the_norm_with_that_reason():
    torch.manual_seed(4)
    model = Net(lambda d: GraphNorm(d, per_graph=True), takes_batch=True).double().eval()
    plan = normswap.plan(model, example_inputs=_inputs())
    assert not plan.sites
    reasons = {s["name"]: s["reason"] for s in plan.skipped}
    assert set(reasons) == {"n1", "n2"}
    assert all("`batch` also passed to it" in r and "not a per-row norm" in r for r in reasons.values()), reasons


def test_pooling_and_l2_normalisation_are_not_reported_as_norms():
    """A module computing a mean and a root whose output is not its input's shape is no norm candidate."""

    class Pool(nn.Module):
        def forward(self, x):
            p = x.mean(0, keepdim=True)
            return p / torch.sqrt(p.pow(2).sum(-1, keepdim=True))

    class WithPool(Net):
        def __init__(self) -> None:
            super().__init__(nn.LayerNorm)
            self.pool = Pool()

        def forward(self, x, batch):
            return self.pool(super().forward(x, batch))

    plan = normswap.plan(WithPool().double().eval(), example_inputs=_inputs())
    assert [s.name for s in plan.sites] == ["n1", "n2"] and not plan.skipped


def test_a_block_computing_a_norm_inline_does_not_hide_the_norms_inside_it():
    """A block whose own ops take a mean and a root among other work is no norm, and is not reported as
    one: the LayerNorm inside it is still found and converted."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

        def forward(self, x):
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # an inline RMS scaling
            return x + self.fc(self.ln(x))

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.block, self.out = nn.Linear(8, 16), Block(), nn.Linear(16, 2)

        def forward(self, x, batch):
            return self.out(self.block(self.inp(x)))

    plan = normswap.plan(Outer().double().eval(), example_inputs=_inputs())
    assert [s.name for s in plan.sites] == ["block.ln"] and not plan.skipped



class RMSNormModule(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class LatentsThroughNorm(nn.Module):
    """Idefics2's perceiver: an RMSNorm whose input is a learned latent table, here constant rows (its
    initial value). On such rows a LayerNorm with β = γ gives the same output, to ε."""

    def __init__(self, d: int = 16, n: int = 4) -> None:
        super().__init__()
        self.latents = nn.Parameter(torch.ones(n, d))
        self.norm = RMSNormModule(d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        latents = self.norm(self.latents).expand(x.shape[0], -1, -1)
        return self.proj(torch.cat([latents, x], 1))


def test_an_rmsnorm_on_constant_rows_is_not_taken_for_a_layernorm():
    torch.manual_seed(0)
    model = LatentsThroughNorm().double().eval()
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    reference = model(x)
    report = normswap.patch(model, (x,))
    assert not report.sites, [(s.name, s.verdict) for s in report.sites]
    assert any(s["name"] == "norm" and "RMS" in s["reason"] for s in report.plan.skipped), report.plan.skipped
    assert torch.equal(model(x), reference)


class CenteredInputLN(nn.Module):
    """A true LayerNorm whose input rows are already zero mean: still a LayerNorm, and converted."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        h = self.inp(x)
        return self.out(self.ln(h - h.mean(-1, keepdim=True)))


def test_a_layernorm_fed_zero_mean_rows_stays_a_layernorm():
    torch.manual_seed(0)
    model = CenteredInputLN().double().eval()
    with torch.no_grad():
        model.ln.weight.normal_()
        model.ln.bias.normal_()
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    reference = model(x)
    report = normswap.patch(model, (x,))
    assert [s.name for s in report.sites] == ["ln"]
    assert (model(x) - reference).abs().max() <= 1e-9 * reference.abs().max()


class EmptyBranch(nn.Module):
    """A norm that runs only on no rows (a media branch given no media: ``x[:0]``): every formula matches
    an empty tensor, so nothing can be identified from it (identifying it crashed on ``max()`` of nothing)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.inp, self.ln, self.side, self.out = nn.Linear(d, d), nn.LayerNorm(d), nn.LayerNorm(d), nn.Linear(d, 3)

    def forward(self, x):
        return self.out(self.ln(self.inp(x))) + self.side(x[:, :0]).sum()


def test_a_norm_run_only_on_no_rows_is_kept_with_that_reason():
    torch.manual_seed(0)
    model = EmptyBranch().double().eval()
    with torch.no_grad():
        for ln in (model.ln, model.side):
            ln.weight.normal_()
            ln.bias.normal_()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    reference = model(x)
    report = normswap.patch(model, (x,))
    assert [s.name for s in report.sites] == ["ln"]
    assert any(s["name"] == "side" and "no rows" in s["reason"] for s in report.plan.skipped), report.plan.skipped
    assert isinstance(model.side, nn.LayerNorm)
    assert (model(x) - reference).abs().max() <= 1e-9 * reference.abs().max()


class FrozenBatchNorm2d(nn.Module):
    """D-FINE's / DETR's frozen BatchNorm2d: a per-channel ``x·s + b`` over a (B, C, H, W) map, named like a norm."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weight = nn.Buffer(torch.rand(c) + 0.5)
        self.bias = nn.Buffer(torch.randn(c) * 1e-7)
        self.running_mean = nn.Buffer(torch.randn(c) * 1e-7)
        self.running_var = nn.Buffer(torch.rand(c) + 0.5)

    def forward(self, x):
        scale = self.weight.reshape(1, -1, 1, 1) * (self.running_var.reshape(1, -1, 1, 1) + 1e-5).rsqrt()
        return x * scale + (self.bias - self.running_mean * self.weight).reshape(1, -1, 1, 1)


class TinyActivationDetector(nn.Module):
    """A conv backbone whose activations are far below √ε (a tiny random detector's: 1e-7), frozen BatchNorms
    after its convs, then a Post-LN layer on the flattened map."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), FrozenBatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 1, bias=False), FrozenBatchNorm2d(8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, pixels):
        h = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(pixels * 1e-7)))))
        tokens = h.flatten(2).transpose(1, 2)
        return self.head(self.norm(tokens + self.proj(tokens)))


def test_a_batchnorm_on_activations_far_below_sqrt_eps_is_not_taken_for_a_layernorm():
    """On inputs far below √ε a LayerNorm computes about ``(x − μ)/√ε``, so an absolute match tolerance let a
    frozen BatchNorm2d over a tiny random D-FINE's backbone (activations 3e-8) pass for a non-affine LayerNorm
    over the image's width: the defaults converted it as approximate, and ``per_norm_centering`` (``--quantizer
    openvino-int8``'s Post-LN options) as exact, off by 2.6e-4 in the encoder's output. Only the real LayerNorm is
    a site, and the per-norm option set converts the model exactly."""
    torch.manual_seed(0)
    model = TinyActivationDetector().double().eval()
    with torch.no_grad():
        model.norm.weight.normal_()
        model.norm.bias.normal_()
    original = copy.deepcopy(model)
    pixels = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    normswap.patch(model, (pixels,), per_norm_centering=True, mean_carry=False)
    plan = normswap.plan_of(model)
    assert [s.name for s in plan.sites] == ["norm"]
    assert isinstance(model.bn1, FrozenBatchNorm2d) and isinstance(model.bn2, FrozenBatchNorm2d)
    probe = torch.randn(3, 3, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        ref, out = original(probe), model(probe)
    assert float((out - ref).norm() / ref.norm()) < 1e-10
