"""normswap.analysis.walker on the hand-written models: which modules are LayerNorms, and what each computes.

Unit level: ``walker.candidates`` / ``walker.identify`` directly, and ``normswap.pipeline.find_norms``
(the walker alone, on a traced forward; the model is never converted here).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import normswap
from normswap import RMSNorm
from normswap.analysis import walker
from normswap.pipeline import find_norms
from tests.custom_models import MixedNormNet, PostLNEncoder, TinyGPT, TinyViT, randomise

D = 24


def _mixed():
    torch.manual_seed(2)
    model = randomise(MixedNormNet(D))
    return model, (torch.randn(3, 10, dtype=torch.float64),)


def _sites(model, example):
    return {s.path: s for s in find_norms(model, example).sites}


# ------------------------------------------------------------------ candidates
def test_candidates_are_norm_shaped_modules_outermost_first():
    model = MixedNormNet(D)
    found = walker.candidates(model)
    # by class name ("MixedNormNet" matches too: identification, not the name, decides), by structure
    # (the wrapper around a non-affine LayerNorm), by type; outermost first
    assert found == ["", "n_wrapped", "n_wrapped.inner", "n_offset", "n_plain", "n_2d"]
    assert not {"inp", "f1", "out"} & set(found)


def test_a_module_that_calls_layer_norm_directly_is_a_candidate_only_when_the_trace_says_so():
    class Shift(nn.Module):  # no "norm" in the name, no LayerNorm child
        def __init__(self):
            super().__init__()
            self.g, self.b = nn.Parameter(torch.ones(8)), nn.Parameter(torch.zeros(8))

        def forward(self, x):
            return F.layer_norm(x, (8,), self.g, self.b, 1e-5)

    model = nn.Sequential(nn.Linear(4, 8), Shift())
    assert walker.candidates(model) == []
    assert walker.candidates(model, {"1"}) == ["1"]
    sites = find_norms(model.double(), (torch.randn(2, 4, dtype=torch.float64),)).sites
    assert [(s.path, s.class_name, s.weight_attr, s.bias_attr) for s in sites] == [("1", "Shift", "g", "b")]


def test_existing_rmsnorm_modules_are_not_candidates_and_are_reported_as_converted():
    model = nn.Sequential(nn.Linear(4, 8), RMSNorm(8), nn.Linear(8, 2)).double()
    assert walker.candidates(model) == []
    found = find_norms(model, (torch.randn(2, 4, dtype=torch.float64),))
    assert found.sites == [] and found.skipped == [] and found.converted == ["1"]


# ------------------------------------------------------------------ find_norms: sites and their fields
def test_flavours_shapes_eps_and_parameter_attributes():
    model, example = _mixed()
    sites = _sites(model, example)
    assert list(sites) == ["n_wrapped", "n_offset", "n_plain", "n_2d"]  # the wrapper claims its inner norm
    fields = {p: (s.class_name, s.flavour, s.normalized_shape, s.param_shape, s.eps, s.weight_attr, s.bias_attr,
                  s.offset) for p, s in sites.items()}
    assert fields == {
        "n_wrapped": ("WrappedNorm", "standard", (D,), (D,), 1e-5, "scale", "shift", 0.0),
        "n_offset": ("OffsetNorm", "offset", (D,), (D,), 1e-5, "weight", "bias", 1.0),
        "n_plain": ("LayerNorm", "non-affine", (D,), (D,), 1e-5, None, None, 0.0),
        "n_2d": ("LayerNorm", "standard", (4, D // 4), (4, D // 4), 1e-5, "weight", "bias", 0.0),
    }


def test_gamma_and_beta_are_the_effective_float64_parameters():
    model, example = _mixed()
    sites = _sites(model, example)
    wrapped, offset, plain = model.n_wrapped, model.n_offset, model.n_plain
    assert torch.equal(sites["n_wrapped"].gamma(wrapped), wrapped.scale.detach().double())
    assert torch.equal(sites["n_wrapped"].beta(wrapped), wrapped.shift.detach().double())
    assert torch.equal(sites["n_offset"].gamma(offset), 1.0 + offset.weight.detach().double())  # stored γ − 1
    assert sites["n_offset"].gamma(offset).dtype == torch.float64
    assert sites["n_plain"].gamma(plain) is None and sites["n_plain"].beta(plain) is None


def test_reference_reproduces_every_identified_norm():
    model, example = _mixed()
    x = torch.randn(5, 4, D // 4, dtype=torch.float64) * 3 + 1
    for path, site in _sites(model, example).items():
        module = model.get_submodule(path)
        inp = x if path == "n_2d" else x.flatten(-2)
        with torch.no_grad():
            assert torch.allclose(site.reference(module, inp), module(inp), rtol=0, atol=1e-12), path


def test_per_head_qk_norms_and_the_eps_each_module_declares():
    torch.manual_seed(0)
    gpt = randomise(TinyGPT(d=32, heads=4))
    sites = _sites(gpt, (torch.randint(0, 50, (2, 9)),))
    assert set(sites) == {"blocks.0.norm", "blocks.0.attn.q_norm", "blocks.0.attn.k_norm", "blocks.1.norm",
                          "blocks.1.attn.q_norm", "blocks.1.attn.k_norm", "norm_f"}
    assert {p: s.normalized_shape for p, s in sites.items() if "_norm" in p} == {
        p: (8,) for p in sites if "_norm" in p}  # head_dim = 32 / 4
    assert sites["norm_f"].normalized_shape == (32,)
    vit = randomise(TinyViT())
    eps = {p: s.eps for p, s in _sites(vit, (torch.randn(1, 3, 32, 32, dtype=torch.float64),)).items()}
    assert eps == {"blocks.0.n1": 1e-5, "blocks.0.n2": 1e-5, "blocks.1.n1": 1e-5, "blocks.1.n2": 1e-5, "norm": 1e-6}


def test_norms_the_example_inputs_never_call_are_not_sites():
    torch.manual_seed(3)
    model = randomise(PostLNEncoder())
    model.unused_norm = nn.LayerNorm(32).double()
    assert "unused_norm" in walker.candidates(model)
    sites = _sites(model, (torch.randint(0, 40, (2, 6)),))
    assert "unused_norm" not in sites
    assert list(sites) == ["emb_norm", "n1.0", "n1.1", "n2.0", "n2.1"]
    # ...but reported, never dropped in silence: the plan says it stays a LayerNorm and why
    skipped = normswap.plan(model, (torch.randint(0, 40, (2, 6)),)).skipped
    assert skipped == [{"name": "unused_norm", "class": "LayerNorm", "reason": walker.NOT_RUN}]


def test_find_norms_leaves_the_model_untouched():
    model, example = _mixed()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    find_norms(model, example)
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert isinstance(model.n_plain, nn.LayerNorm)


# ------------------------------------------------------------------ identify: the numerical match
class _RMS(nn.Module):
    """Llama-style RMS norm, optionally Gemma's 1 + γ."""

    def __init__(self, d: int, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d) * 0.3 + (1.0 - offset))
        self.offset, self.variance_epsilon = offset, 1e-6

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (self.offset + self.weight)


def _io(module, shape=(4, 7, 16)):
    x = torch.randn(*shape, dtype=torch.float64) + 0.5  # a non-zero mean separates LN from RMS
    with torch.no_grad():
        return x, module(x)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_already_rms_norms_are_skipped_with_their_gamma(offset):
    module = _RMS(16, offset).double()
    result = walker.identify("norm", module, *_io(module))
    assert isinstance(result, walker.SkippedNorm)
    assert "already RMS-style" in result.reason
    assert (result.weight_attr, result.offset, result.bias_attr) == ("weight", offset, None)


def test_group_norm_is_skipped_with_the_reason():
    one = nn.GroupNorm(1, 6).double()
    result = walker.identify("g", one, *_io(one, (2, 6, 5, 5)))
    assert isinstance(result, walker.SkippedNorm) and "GroupNorm(1, C)" in result.reason
    many = nn.GroupNorm(3, 6).double()
    result = walker.identify("g", many, *_io(many, (2, 6, 5, 5)))
    assert isinstance(result, walker.SkippedNorm) and "3 groups is not a LayerNorm" in result.reason


def test_modules_that_compute_something_else_are_not_norms():
    lin = nn.Linear(16, 16).double()
    assert walker.identify("proj", lin, *_io(lin)) is None
    x, _ = _io(lin)
    ln = nn.LayerNorm(16).double()
    assert walker.identify("ln", ln, x, torch.tanh(x)) is None  # output not what a LayerNorm gives


def test_gamma_only_and_beta_only_layernorms():
    g_only = nn.LayerNorm(16, bias=False).double()
    with torch.no_grad():
        g_only.weight.normal_()
    site = walker.identify("g", g_only, *_io(g_only))
    assert (site.flavour, site.weight_attr, site.bias_attr) == ("gamma-only", "weight", None)

    class BetaOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.shift = nn.Parameter(torch.randn(16))

        def forward(self, x):
            return F.layer_norm(x, (16,), eps=1e-5) + self.shift

    b_only = BetaOnly().double()
    site = walker.identify("b", b_only, *_io(b_only))
    assert (site.flavour, site.weight_attr, site.bias_attr) == ("beta-only", None, "shift")


def test_find_sites_on_a_trace_claims_wrapped_norms_and_lists_converted_ones():
    """``walker.find_sites`` directly on a recorded graph: a wrapper identified as the norm claims the
    LayerNorm inside it, norms that never ran are skipped with the reason, normswap RMSNorms are listed
    apart."""
    from normswap.analysis import trace

    model, example = _mixed()
    model.unused = nn.LayerNorm(D)  # never called in forward
    model.done = RMSNorm(D)  # already converted (not called either)
    found = walker.find_sites(model, trace.record(model, example, {}))
    paths = {s.path for s in found.sites} | {s.path for s in found.skipped}
    assert "n_wrapped" in paths and "n_wrapped.inner" not in paths
    assert "unused" not in {s.path for s in found.sites}
    assert [s.reason for s in found.skipped if s.path == "unused"] == [walker.NOT_RUN]
    assert found.converted == ["done"]


# ------------------------------------------------------------------ gated and head-flattening norms
class GatedNorm(nn.Module):
    """A Mamba-2-style gated norm: ``γ ⊙ norm(x ⊙ silu(gate))`` (``gate_first``) or ``γ ⊙ norm(x) ⊙ silu(gate)``,
    RMS or LayerNorm (``center``), over ``groups`` equal blocks of the features."""

    def __init__(self, d: int, groups: int = 1, gate_first: bool = True, center: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(d))
        self.group_size, self.gate_first, self.center, self.eps = d // groups, gate_first, center, 1e-6

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if self.gate_first:
            x = x * F.silu(gate)
        g = x.unflatten(-1, (-1, self.group_size))
        if self.center:
            g = g - g.mean(-1, keepdim=True)
        y = self.weight * (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return y if self.gate_first else y * F.silu(gate)


class HeadsNorm(nn.Module):
    """xLSTM's multi-head norm: LayerNorm over each head of ``(B, T, H, D)``, heads flattened, then γ."""

    def __init__(self, heads: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.3 * torch.randn(heads * dim))
        self.eps = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + self.eps)
        return x.flatten(-2) * self.weight


@pytest.mark.parametrize("groups, gate_first, center, reason", [
    (1, True, False, "already RMS-style, gated (RMSNorm of x·silu(gate)); kept"),
    (2, True, False, "already RMS-style, gated (RMSNorm of x·silu(gate) over 2 groups of 12 features); kept"),
    (1, False, False, "already RMS-style, gated (RMSNorm of x, times silu(gate)); kept"),
    (1, True, True, "gated LayerNorm (LayerNorm of x·silu(gate)): no RMSNorm replaces a gate inside the norm; kept"),
])
def test_gated_norms_are_reported_with_their_formula(groups, gate_first, center, reason):
    torch.manual_seed(0)
    norm = GatedNorm(D, groups, gate_first, center).double()
    x, gate = torch.randn(3, 5, D, dtype=torch.float64), torch.randn(3, 5, D, dtype=torch.float64)
    assert walker.identify("n", norm, x, norm(x, gate)) is None  # the ungated formulas do not match
    found = walker.identify_gated("n", norm, x, gate, norm(x, gate))
    assert isinstance(found, walker.SkippedNorm) and found.reason == reason
    assert found.weight_attr == (None if center else "weight")  # an RMS γ may fold into the readers
    assert walker.identify_gated("n", norm, x, gate, norm(x, gate) + 1e-3) is None  # any other output: no match


def test_a_norm_that_flattens_its_heads_is_reported_and_kept():
    torch.manual_seed(0)
    norm = HeadsNorm(4, 6).double()
    x = torch.randn(2, 5, 4, 6, dtype=torch.float64)
    found = walker.identify_flattened_heads("h", norm, x, norm(x))
    assert isinstance(found, walker.SkippedNorm) and found.reason.startswith(
        "LayerNorm per head (4 heads of 6) whose output flattens the heads before γ/β (gamma-only)")
    assert walker.identify_flattened_heads("h", norm, x, norm(x) * 1.01) is None


def test_a_channels_first_layernorm_is_skipped_with_that_reason():
    """ConvNeXt's stem and downsampling norms normalise dim 1 of (B, C, H, W): they were left out of the
    plan without a word; now each is reported, and the zoo's ConvNeXt lists both."""
    from transformers.models.convnext.modeling_convnext import ConvNextLayerNorm

    from tests.zoo import MORE, build

    norm = ConvNextLayerNorm(8, data_format="channels_first").double()
    with torch.no_grad():
        norm.weight.normal_(1, 0.3), norm.bias.normal_(0, 0.3)
    x = torch.randn(2, 8, 5, 5, dtype=torch.float64)
    assert walker.identify("n", norm, x, norm(x)) is None  # no trailing-dims formula fits...
    found = walker.identify_channels_first("n", norm, x, norm(x))  # ...the channel axis does
    assert isinstance(found, walker.SkippedNorm) and "channel axis of a channels-first tensor" in found.reason
    plan = normswap.plan(build({"convnext": MORE["convnext"][0]}, "convnext"))
    assert sorted(s["name"] for s in plan.skipped if "channels-first" in s["reason"]) == [
        "convnext.embeddings.layernorm", "convnext.encoder.stages.1.downsampling_layer.0"]
