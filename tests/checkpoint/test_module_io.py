"""``normswap.save`` of any patched ``nn.Module`` and ``normswap.load(dir, model=fresh)`` (checkpoint/module_io.py).

Every custom model of the test suite goes patch -> save -> a freshly built instance of its class (other
random weights) -> load, and must give outputs bitwise equal to the patched model's on inputs the
analysis never saw: widened MLPs, bias slots, centering ops (stream start and per norm), untied and
kept ties, β moved through attention, approximate calibrated norms, rotations (weights only, a
rotation op, online Hadamards, per-head value Hadamards, a model output turned back). A directory that
does not fit the given instance is refused with one line naming the first mismatch, before the
instance is touched.
"""

from __future__ import annotations

import inspect
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner
from safetensors import safe_open
from torch import nn

import normswap
from normswap.errors import NormswapError
from normswap.rotation.rotate import rotate
from tests import custom_models, custom_models_cast, hierarchical_models
from tests.analysis.test_analysis import PreLNLM, StemNet, TanhNet
from tests.analysis.test_token_mixing import MixNet
from tests.custom_models import (
    MixedNormNet,
    PostLNEncoder,
    PostNormDecoder,
    PreBlock,
    ProjLM,
    TinyGPT,
    TinyViT,
    randomise,
)
from tests.custom_models_cast import (
    ClipTextStyle,
    FairseqStyleEncoder,
    Float32OnlyNet,
    PostLNRotaryEncoder,
    SimpleVitStyle,
    VitPytorchStyle,
    WhisperEncoderOnly,
    WhisperStyle,
)
from tests.hierarchical_models import ChannelShiftNet, ConvStemNet, PatchNormViT, PyramidStyle, SwinStyle
from tests.test_torch_modules import CrossAttention, EncoderLM, Seq2Seq, TiedLogits


def _ids(vocab: int, n: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(seed))


def _feats(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


class Backbone(nn.Module):
    """Pre-LN encoder whose output is its final norm's output (what ``rotate(output="restore")`` turns back)."""

    def __init__(self, vocab: int = 40, d: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(PreBlock(d, 4) for _ in range(2))
        self.norm = nn.LayerNorm(d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class OwnConfig(transformers.PretrainedConfig):
    """A model type transformers does not know (custom code on ``PreTrainedModel``, or trust_remote_code)."""

    model_type = "own_lm"

    def __init__(self, vocab: int = 40, d: int = 32, **kwargs: object) -> None:
        self.vocab, self.d = vocab, d
        super().__init__(**kwargs)


class OwnLM(transformers.PreTrainedModel):
    config_class = OwnConfig

    def __init__(self, config: OwnConfig | None = None) -> None:
        config = config or OwnConfig()
        super().__init__(config)
        self.tok = nn.Embedding(config.vocab, config.d)
        self.blocks = nn.ModuleList(PreBlock(config.d, 4) for _ in range(2))
        self.norm = nn.LayerNorm(config.d)
        self.head = nn.Linear(config.d, config.vocab)
        self.post_init()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _dinov2_probe() -> nn.Module:
    """A transformers DINOv2 backbone inside a custom module with a Linear on its CLS output (not itself a
    transformers model, so it is saved as a custom module)."""
    import transformers as tf

    from tests.zoo import MORE

    config = MORE["dinov2"][0]()[1]

    class DinoProbe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.backbone = tf.Dinov2Model(config)
            self.fc = nn.Linear(config.hidden_size, 10)

        def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
            return self.fc(self.backbone(pixel_values=pixel_values).last_hidden_state[:, 0])

    return DinoProbe()


def _x_transformers(pre_norm: bool) -> nn.Module:
    xt = pytest.importorskip("x_transformers")
    return xt.TransformerWrapper(num_tokens=50, max_seq_len=32,
                                 attn_layers=xt.Decoder(dim=32, depth=2, heads=4, pre_norm=pre_norm))


@dataclass
class Case:
    make: Callable[[], nn.Module]
    example: torch.Tensor | tuple  # the model's positional inputs (one tensor, or a tuple of them)
    probe: torch.Tensor | tuple  # other shape, other values: inputs the analysis never saw
    options: dict = field(default_factory=dict)
    rotation: dict | None = None  # normswap.rotate keywords, applied after patch
    dtype: torch.dtype = torch.float64
    edits: tuple[str, ...] = ()  # plan lists that must be non-empty (what the case is here to cover)


def _image(size: int, n: int, seed: int) -> torch.Tensor:
    return _feats(n, 3, size, size, seed=seed)


CASES: dict[str, Case] = {
    "TinyGPT (untied head, per-head qk norms)": Case(TinyGPT, _ids(50, 2, 9, 0), _ids(50, 3, 14, 1),
                                                     {"untie": True}, edits=("unties",)),
    "TinyGPT keeping the tie (centering op)": Case(lambda: TinyGPT(qk_norm=False), _ids(50, 2, 9, 0),
                                                   _ids(50, 3, 14, 1), {"untie": False}, edits=("hooks",)),
    "TinyGPT rotated, online Hadamards, bias slot": Case(
        TinyGPT, _ids(50, 2, 9, 0), _ids(50, 3, 14, 1), {"fold_gamma": True}, {"q": "hadamard", "online": True},
        edits=("unties", "bias_slots", "rotations")),
    "TinyViT rotated (conv patches, cls token)": Case(
        TinyViT, _image(32, 2, 0), _image(32, 3, 1), {"fold_gamma": True}, {"q": "random", "seed": 3},
        edits=("rotations",)),
    "TinyViT float32": Case(TinyViT, _image(32, 2, 0).float(), _image(32, 3, 1).float(), dtype=torch.float32),
    "MixedNormNet (norm flavours, eager backend)": Case(MixedNormNet, _feats(5, 10, seed=0), _feats(7, 10, seed=1),
                                                        {"backend": "eager"}),
    "PostLNEncoder, all (approximate, widened MLPs)": Case(PostLNEncoder, _ids(40, 2, 8, 0), _ids(40, 3, 12, 1),
                                                           {"mode": "all"}, edits=("mean_carries",)),
    "PostNormDecoder, per-norm centering": Case(PostNormDecoder, _ids(40, 2, 9, 0), _ids(40, 3, 13, 1),
                                                {"per_norm_centering": True, "mode": "exact"},
                                                edits=("hooks", "mean_carries")),
    "ProjLM, β moved and dropped": Case(
        lambda: ProjLM(k_bias=False, v_bias=False, kv_heads=2, eager=True, use_cache=True), _ids(40, 2, 9, 0),
        _ids(40, 3, 7, 1), {"beta_placement": "fold"}, edits=("beta_moves",)),
    "PreLNLM": Case(PreLNLM, _ids(40, 2, 9, 0), _ids(40, 3, 7, 1)),
    "TanhNet, all (approximate, centered readers)": Case(TanhNet, _feats(3, 6, seed=0), _feats(4, 6, seed=1),
                                                         {"mode": "all"}, edits=("hooks",)),
    "StemNet rotated through its centering op": Case(
        lambda: StemNet(late=True), _feats(3, 9, 6, seed=0), _feats(5, 12, 6, seed=1), {"fold_gamma": True},
        {"q": "hadamard"}, edits=("hooks", "rotations")),
    "MixNet (interpolated positions)": Case(lambda: MixNet("interpolate"), _ids(40, 2, 9, 0), _ids(40, 3, 11, 1)),
    "Backbone, output turned back": Case(Backbone, _ids(40, 2, 9, 0), _ids(40, 3, 7, 1), {"fold_gamma": True},
                                         {"q": "hadamard", "output": "restore"}, edits=("rotations",)),
    "PreTrainedModel of a type transformers does not know": Case(OwnLM, _ids(40, 2, 9, 0), _ids(40, 3, 7, 1)),
    "DINOv2 in a custom module, online and per-head Hadamards": Case(
        _dinov2_probe, _image(32, 2, 0), _image(32, 3, 1), {"fold_gamma": True}, {"q": "hadamard", "online": True},
        edits=("rotations",)),
    "x-transformers Decoder, rotated online": Case(
        lambda: _x_transformers(True), _ids(50, 2, 9, 0), _ids(50, 3, 14, 1), {"fold_gamma": True},
        {"q": "hadamard", "online": True}, edits=("rotations",)),
    "x-transformers post-norm Decoder, per-norm centering": Case(
        lambda: _x_transformers(False), _ids(50, 2, 9, 0), _ids(50, 3, 14, 1), {"per_norm_centering": True},
        edits=("hooks", "mean_carries")),
    # PyTorch's own modules (tests/test_torch_modules.py): functional projections, the fused encoder path
    "nn.TransformerEncoder Pre-LN (fused path kept)": Case(EncoderLM, _ids(50, 2, 7, 0), _ids(50, 3, 11, 1)),
    "nn.TransformerEncoder Post-LN (approximate, Python forward)": Case(
        lambda: EncoderLM(norm_first=False, causal=False), _ids(50, 2, 7, 0), _ids(50, 3, 11, 1), {"mode": "all"},
        edits=("mean_carries",)),
    "nn.Transformer, β folded into in_proj rows, rotated": Case(
        Seq2Seq, (_ids(50, 2, 7, 0), _ids(50, 2, 5, 2)), (_ids(50, 3, 9, 1), _ids(50, 3, 6, 3)),
        {"fold_gamma": True}, {"q": "hadamard"}, edits=("folds", "rotations")),
    "nn.MultiheadAttention kdim/vdim, add_bias_kv": Case(
        lambda: CrossAttention(add_bias_kv=True), (_ids(50, 2, 6, 0), _feats(2, 5, 24, seed=4)),
        (_ids(50, 3, 8, 1), _feats(3, 7, 24, seed=5)), {"beta_placement": "fold"}, edits=("folds",)),
    "logits read from the embedding (tie kept), bare-parameter projections": Case(
        TiedLogits, _ids(50, 2, 9, 0), _ids(50, 3, 12, 1), edits=("hooks",)),
    # custom models that cast inside or mutate a norm's output (tests/custom_models_cast.py)
    "Whisper style (float32 norms, weight casts, tied logits)": Case(
        WhisperStyle, (_feats(2, 8, 12, seed=0), _ids(40, 2, 7, 0)), (_feats(3, 8, 12, seed=1), _ids(40, 3, 11, 1))),
    "Whisper style audio encoder with a classifier": Case(WhisperEncoderOnly, _feats(2, 8, 12, seed=0),
                                                          _feats(3, 8, 12, seed=1)),
    "open_clip text tower style": Case(ClipTextStyle, _ids(40, 2, 9, 0), _ids(40, 4, 12, 1)),
    "fairseq style (type_as of the attention weights)": Case(FairseqStyleEncoder, _ids(40, 2, 9, 0),
                                                             _ids(40, 3, 14, 1)),
    "vit-pytorch ViT style": Case(VitPytorchStyle, _feats(2, 3, 16, 16, seed=0), _feats(3, 3, 16, 16, seed=1)),
    "vit-pytorch SimpleViT style (norm output changed in place)": Case(
        SimpleVitStyle, _feats(2, 3, 16, 16, seed=0), _feats(5, 3, 16, 16, seed=1)),
    "Post-LN encoder with a cached rotary table": Case(PostLNRotaryEncoder, _ids(40, 2, 9, 0), _ids(40, 3, 9, 1)),
    # hierarchical vision (tests/hierarchical_models.py): stem norms as stream starts, Swin merges
    "Swin style (the merged stage approximate)": Case(
        SwinStyle, _image(32, 2, 0), _image(48, 3, 1), {"mode": "all"}),
    "ConvNeXt-style stem": Case(ConvStemNet, _image(32, 2, 0), _image(48, 3, 1), edits=("hooks",)),
    "vit-pytorch patch-norm ViT": Case(PatchNormViT, _image(16, 2, 0), _image(8, 3, 1), edits=("hooks",)),
    "PVT style pyramid": Case(PyramidStyle, _image(32, 2, 0), _image(48, 3, 1), {"fold_gamma": True},
                              edits=("hooks",)),
    "channel shift between tokens (approximate)": Case(ChannelShiftNet, _ids(30, 2, 9, 0), _ids(30, 3, 12, 1),
                                                       {"mode": "all"}),
    "a model that runs in float32 only": Case(Float32OnlyNet, _feats(4, 12, seed=0).float(),
                                              _feats(5, 12, seed=1).float(), dtype=torch.float32),
}


def _args(x: torch.Tensor | tuple) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _patched(case: Case) -> nn.Module:
    torch.manual_seed(0)
    model = randomise(case.make()).to(case.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # approximate conversions warn, by design
        normswap.patch(model, example_inputs=_args(case.example), **case.options)
    if case.rotation is not None:
        assert rotate(model, **case.rotation).rotated
    return model


def _fresh(case: Case) -> nn.Module:
    torch.manual_seed(1)  # other random weights: every value must come from the files
    return case.make().to(case.dtype)


def _structure(model: nn.Module) -> dict[str, str]:
    return {path: type(m).__name__ + (f"/{m.backend}" if isinstance(m, normswap.RMSNorm) else "")
            for path, m in model.named_modules()}


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_into_a_fresh_instance_is_bitwise(name, tmp_path):
    case = CASES[name]
    model = _patched(case)
    plan = normswap.plan_of(model)
    for edit in case.edits:
        assert getattr(plan, edit), f"{name}: no {edit} in the plan, so the case tests nothing of it"
    out = normswap.save(model, tmp_path / "ckpt")
    side = ["normswap_adapter_bases.safetensors"] if any(plan.adapter_vectors) else []  # round 55: their vectors
    assert sorted(p.name for p in out.iterdir()) == sorted(["README.md", "model.safetensors", "normswap.json", *side])
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}

    fresh = _fresh(case)
    loaded = normswap.load(out, model=fresh)
    assert loaded is fresh and not loaded.training
    assert _structure(loaded) == _structure(model)  # RMSNorms (and their backends), widened layers, ...
    state, again = model.state_dict(), loaded.state_dict()
    assert list(again) == list(state) and all(torch.equal(again[k], state[k]) for k in state)
    assert normswap.plan_of(loaded).counts() == plan.counts()
    assert normswap.plan_of(loaded).rotations == json.loads(json.dumps(plan.rotations))
    with torch.no_grad():
        assert torch.equal(_first(loaded(*_args(case.probe))), _first(model(*_args(case.probe))))
        assert torch.equal(_first(loaded(*_args(case.example))), _first(model(*_args(case.example))))
    # PyTorch's fused encoder path is kept or held the same way (nn.TransformerEncoderLayer)
    assert _held_layers(loaded) == _held_layers(model)


def _first(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _held_layers(model: nn.Module) -> list[str]:
    return [p for p, m in model.named_modules() if isinstance(m, nn.TransformerEncoderLayer) and m._forward_pre_hooks]


def _building_block(cls: type) -> bool:
    """A layer of the models (a norm, a Linear or conv subclass, an attention, a block), not a model."""
    return issubclass(cls, (nn.LayerNorm, nn.Linear, nn.Conv1d)) or cls.__name__.endswith(
        ("Attention", "Block", "Layer", "FeedForward", "Transformer", "Kernel", "Rotary", "Patches", "Encoder",
         "Merging", "Stage", "Embed")) \
        and cls not in (FairseqStyleEncoder, PostLNRotaryEncoder)


def test_every_custom_model_of_the_suite_has_a_round_trip_case():
    """A model added to tests/custom_models.py must get a case in CASES (building blocks take arguments)."""
    models = {cls for module in (custom_models, custom_models_cast, hierarchical_models)
              for _, cls in inspect.getmembers(module, inspect.isclass)
              if issubclass(cls, nn.Module) and cls.__module__ == module.__name__ and cls is not
              custom_models.Residual and not _building_block(cls)
              and all(p.default is not p.empty or p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
                      for p in list(inspect.signature(cls.__init__).parameters.values())[1:])}
    covered = {type(case.make()) for name, case in CASES.items() if "x-transformers" not in name}
    assert models - covered == set()


# ------------------------------------------------------------------------------------ what is written
@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[nn.Module, Path]:
    model = _patched(CASES["TinyGPT (untied head, per-head qk norms)"])
    return model, normswap.save(model, tmp_path_factory.mktemp("gpt") / "ckpt", manifest_extra={"run": 7})


def test_manifest_records_the_structure_versions_and_class(saved):
    model, out = saved
    manifest = json.loads((out / "normswap.json").read_text())
    assert manifest["format"] == "module" and manifest["class"] == "tests.custom_models.TinyGPT"
    assert manifest["run"] == 7 and {"normswap", "torch", "safetensors"} <= set(manifest["versions"])
    plan = manifest["plan"]
    assert [u["module"] for u in plan["unties"]] == ["head"]
    norm_f = next(s for s in plan["sites"] if s["name"] == "norm_f")
    assert norm_f["normalized_shape"] == [32] and norm_f["eps"] == 1e-5 and norm_f["convert"]
    assert manifest["modules"]["norm_f"] == "RMSNorm" and manifest["modules"]["head"] == "Linear"
    assert set(manifest["backends"]) == {s["name"] for s in plan["sites"] if s["convert"]}
    assert manifest["parameters"] == sum(p.numel() for p in model.parameters())
    card = (out / "README.md").read_text()
    assert 'normswap.load("ckpt", model=TinyGPT(...))' in card


def test_a_kept_tie_is_stored_once_and_loads_tied(tmp_path):
    case = CASES["TinyGPT keeping the tie (centering op)"]
    model = _patched(case)
    out = normswap.save(model, tmp_path / "tied")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "tok.weight" in keys and "head.weight" not in keys
    assert json.loads((out / "normswap.json").read_text())["aliases"] == {"head.weight": "tok.weight"}
    loaded = normswap.load(out, model=_fresh(case))
    assert loaded.head.weight is loaded.tok.weight


def test_sharded_output_loads_bitwise(saved, tmp_path):
    model, _ = saved
    out = normswap.save(model, tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted(out.glob("model-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and set(index["weight_map"].values()) == {p.name for p in shards}
    probe = CASES["TinyGPT (untied head, per-head qk norms)"].probe
    loaded = normswap.load(out, model=TinyGPT().double())
    with torch.no_grad():
        assert torch.equal(loaded(probe), model(probe))
    # a float32 instance takes the float64 weights cast, as load_state_dict casts them
    single = normswap.load(out, model=TinyGPT())
    assert {p.dtype for p in single.parameters()} == {torch.float32}
    with torch.no_grad():
        ref = model(probe)
        assert float((single(probe).double() - ref).abs().max() / ref.abs().max()) < 1e-5


def test_inspect_prints_the_manifest_of_a_saved_module_and_convert_says_how_to_load_it(saved, tmp_path):
    from normswap.cli import main

    _, out = saved
    res = CliRunner().invoke(main, ["inspect", str(out)])
    assert res.exit_code == 0, res.output
    assert "custom module, tests.custom_models.TinyGPT" in res.output and "model=TinyGPT(...)" in res.output
    assert "norm_f" in res.output and "7 exact" in res.output
    res = CliRunner().invoke(main, ["convert", str(out), "--out", str(tmp_path / "again")])
    assert res.exit_code == 1 and "normswap.load(dir, model=YourClass(...))" in res.output
    assert not (tmp_path / "again").exists()


# ------------------------------------------------------------------------------------ refusals
def _snapshot(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str], int]:
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return {k: v.clone() for k, v in model.state_dict().items()}, _structure(model), hooks


def _refused(out: Path, model: nn.Module, match: str) -> str:
    before = _snapshot(model)
    with pytest.raises(NormswapError, match=match) as err:
        normswap.load(out, model=model)
    after = _snapshot(model)
    assert after[1:] == before[1:] and list(after[0]) == list(before[0])
    assert all(torch.equal(after[0][k], before[0][k]) for k in before[0])  # left as it was
    assert normswap.plan_of(model) is None
    message = str(err.value)
    assert "\n" not in message and "saved from tests.custom_models.TinyGPT" in message
    return message


class Head(nn.Linear):
    """A Linear under another class name: same keys and shapes, other module."""


def _untied_by_hand() -> nn.Module:
    model = TinyGPT()
    model.head.weight = nn.Parameter(model.tok.weight.detach().clone())
    return model


MISMATCHES = {
    "another class": (lambda: TinyViT(), r"no module `blocks\.0\.norm`.*given tests\.custom_models\.TinyViT"),
    "fewer layers": (lambda: TinyGPT(layers=1), r"no module `blocks\.1\.norm`"),
    "another width": (lambda: TinyGPT(d=48), r"`pos` is shape \[1, 16, 48\] in the model, shape \[1, 16, 32\] in the"),
    "another vocabulary": (lambda: TinyGPT(vocab=60), r"`tok\.weight` is shape \[60, 32\] in the model"),
    "no per-head norms": (lambda: TinyGPT(qk_norm=False), r"no module `blocks\.0\.attn\.q_norm`"),
}


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_a_checkpoint_that_does_not_fit_is_refused_and_the_model_left_alone(saved, name):
    make, match = MISMATCHES[name]
    _refused(saved[1], make().double(), match)


def test_wrong_module_class_extra_or_missing_tensors_and_ties_are_refused(saved, tmp_path):
    _, out = saved
    model = TinyGPT().double()
    model.norm_f = nn.Linear(32, 32).double()
    _refused(out, model, r"`norm_f` is a Linear, the checkpoint replaced a LayerNorm")
    model = TinyGPT().double()
    model.head = Head(32, 50, bias=False).double()
    _refused(out, model, r"`head` is a Head, the saved model has a Linear")
    model = TinyGPT().double()
    model.register_parameter("extra", nn.Parameter(torch.zeros(3, dtype=torch.float64)))
    _refused(out, model, r"`extra` \(shape \[3\]\) is not in the checkpoint")
    model = TinyGPT().double()
    model.blocks[1].mlp.down.bias = None
    _refused(out, model, r"the checkpoint has `blocks\.1\.mlp\.down\.bias`, which the model lacks")

    # a head untied before patching: no untie in the plan, so a fresh (tied) TinyGPT cannot hold it
    untied = _untied_by_hand()
    untied = randomise(untied)
    normswap.patch(untied, example_inputs=(_ids(50, 2, 9, 0),))
    assert not normswap.plan_of(untied).unties
    other = normswap.save(untied, tmp_path / "untied")
    _refused(other, TinyGPT().double(), r"`tok\.weight` and `head\.weight` are one tensor in the model \(tied\)")
    assert torch.equal(normswap.load(other, model=_untied_by_hand().double()).head.weight, untied.head.weight)


def test_load_and_save_refuse_bad_requests_in_one_line(saved, tmp_path):
    model, out = saved
    with pytest.raises(NormswapError, match=r"already converted by normswap; pass a freshly built instance"):
        normswap.load(out, model=model)
    with pytest.raises(NormswapError, match=r"module \(tests\.custom_models\.TinyGPT\).*model=TinyGPT\(\.\.\.\)"):
        normswap.load(out)
    with pytest.raises(NormswapError, match="takes no from_pretrained arguments"):
        normswap.load(out, model=TinyGPT(), dtype=torch.float64)
    (tmp_path / "plain").mkdir()
    with pytest.raises(NormswapError, match="model= is only for those"):
        normswap.load(tmp_path / "plain", model=TinyGPT())

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "normswap.json").write_text("{")
    with pytest.raises(NormswapError, match="corrupted"):
        normswap.load(broken, model=TinyGPT())
    (broken / "normswap.json").write_text(json.dumps({"format": "module", "plan": {}}))
    with pytest.raises(NormswapError, match="no safetensors weights"):
        normswap.load(broken, model=TinyGPT())
    data = (out / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(NormswapError, match="truncated"):
        normswap.load(broken, model=TinyGPT())

    unpatched = TinyGPT()
    with pytest.raises(NormswapError, match=r"TinyGPT has not been converted: run normswap.patch"):
        normswap.save(unpatched, tmp_path / "a")
    with pytest.raises(NormswapError, match="custom module, saved as safetensors"):
        normswap.save(model, tmp_path / "b", format="compat")
    with pytest.raises(NormswapError, match="reserved"):
        normswap.save(model, tmp_path / "c", manifest_extra={"plan": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "plain"]  # nothing else written
