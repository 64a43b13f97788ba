"""normswap on custom models built with real third-party libraries (issue 31, "Checked by").

    python benchmarks/bench_third_party.py [--only SUBSTRING ...] [--json OUT.json] [--threads 1]

For every model a library builds (small dims, random weights; every 1-d parameter randomised, so
LayerNorm γ/β and biases are far from their init), in float64 and eval mode, as its users would patch
it (``normswap.patch(model, example_inputs=...)``):

* ``plan`` and ``patch`` at one input shape (A), then the patched model against the float64 original at
  shape A and at another shape B (another sequence length, batch or image size) the analysis never saw;
* every LayerNorm-like module of the original (an ``nn.LayerNorm`` subclass, a class named
  ``*LayerNorm*``, or a module whose ``forward`` calls ``layer_norm``) is a plan site or reported as skipped;
* the save/load round trip: ``normswap.save(model, dir)``, ``normswap.load(dir, model=fresh_instance)``,
  outputs bitwise equal to the patched model's at both shapes;
* where every converted norm is exact: ``patch(fold_gamma=True)`` then ``normswap.rotate(model,
  "hadamard")`` on a fresh copy, against the original at both shapes.

A library that is not installed is skipped with a note. The libraries are never test dependencies
(``tests/third_party_models.py`` holds small replicas of the patterns that broke). timm, vit-pytorch
and open_clip import torchvision at package import time only for transforms and a frozen batch norm,
and torchvision's wheels cannot load with the torch here: this script puts a stand-in ``torchvision``
module in ``sys.modules`` that only satisfies those imports (any real use of it raises), in this
process only. The table recorded in ``docs/results/third-party.md`` is what this printed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
import json
import re
import sys
import tempfile
import time
import traceback
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.third_party_models (the nanoGPT replica)

import normswap  # noqa: E402

TOL = 1e-9  # float64 exactness bar of the issue
TOL_FLOAT32 = 1e-5  # for the one model whose own code runs in float32 only


# ------------------------------------------------------------------------- torchvision stand-in
class _AbsentMeta(type):
    def __getattr__(cls, name: str) -> Any:  # enum members read at import time (InterpolationMode.NEAREST)
        if name.startswith("__"):
            raise AttributeError(name)
        return _AbsentMeta(f"{cls.__name__}.{name}", (_Absent,), {})


class _Absent(metaclass=_AbsentMeta):
    """What the stand-in hands out for any name: importable, unusable."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("torchvision stand-in (benchmarks/bench_third_party.py): not usable")


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _AbsentMeta(name, (_Absent,), {})


def install_torchvision_stand_in() -> None:
    """Satisfy ``from torchvision... import X`` at import time of timm / vit-pytorch / open_clip."""
    try:
        import torchvision  # noqa: F401
        return
    except Exception:  # noqa: BLE001 (a broken wheel raises more than ImportError)
        pass
    for name in ("torchvision", "torchvision.ops", "torchvision.ops.misc", "torchvision.transforms",
                 "torchvision.transforms.functional", "torchvision.transforms.v2", "torchvision.models",
                 "torchvision.datasets", "torchvision.io", "torchvision.utils"):
        module = _StandIn(name)
        module.__path__ = []  # a package, so submodules import
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__version__ = "0.0+stand-in"
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    sys.modules["torchvision.models.feature_extraction"] = None  # timm guards this one itself


def install_wandb_stand_in() -> None:
    """Satisfy TransformerLens 2.x's import-time ``import wandb`` (its training helpers) when wandb is not
    installed: a stand-in module, in this process only, after accelerate has looked for the real one."""
    if importlib.util.find_spec("wandb") is not None:
        return
    try:
        importlib.import_module("accelerate")  # checks for wandb at import: let it find none first
    except Exception:  # noqa: BLE001
        pass
    module = _StandIn("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    sys.modules["wandb"] = module


# ------------------------------------------------------------------------------------ helpers
def randomise(model: nn.Module, seed: int = 0) -> nn.Module:
    """Every vector parameter (norm γ/β, biases, LayerScale, tokens) moved by 0.3·N(0, 1), and every weight
    initialised to zero or nearly (timm's MLP-Mixer head, BEiT's and EVA's ``head_init_scale``) redrawn as
    0.02·N(0, 1), so no output is a near-constant that any conversion would match; float64, eval."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.numel() == max(p.shape, default=1):  # a vector, whatever its shape (vit-pytorch's (1, C, 1, 1) γ)
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
            elif p.numel() and float(p.abs().max()) < 1e-2:  # zero or tiny init (timm's head_init_scale)
                p.copy_(0.02 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p.dtype))
    return model.double().eval()


def ids(vocab: int, batch: int, length: int, seed: int, low: int = 0) -> torch.Tensor:
    return torch.randint(low, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def feats(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def tensors(out: Any) -> list[torch.Tensor]:
    """The floating tensors of a model output (tensor, tuple, list, dict, dataclass)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, dict):
        return [t for v in out.values() for t in tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in tensors(v)]
    if hasattr(out, "__dataclass_fields__"):
        return [t for k in out.__dataclass_fields__ for t in tensors(getattr(out, k))]
    return []


def rel_error(got: Any, want: Any) -> float:
    a, b = tensors(got), tensors(want)
    if len(a) != len(b) or not a:
        return float("nan")
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-300)) for x, y in zip(a, b, strict=True))


def bitwise(got: Any, want: Any) -> bool:
    a, b = tensors(got), tensors(want)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def run(model: nn.Module, inputs: tuple) -> Any:
    with torch.no_grad():
        return model(*inputs)


_LN_CLASS = re.compile(r"layer_?norm|^ln$|^ln\d|layernorm", re.I)


def layernorm_like(model: nn.Module) -> list[str]:
    """LayerNorm-like modules, found independently of normswap's walker: ``nn.LayerNorm`` subclasses,
    classes named like a LayerNorm, and modules whose own ``forward`` calls ``layer_norm``; outermost only
    (x-transformers' ``LayerNorm`` wraps a non-affine ``nn.LayerNorm``: one norm)."""
    found = []
    for path, module in model.named_modules():
        if isinstance(module, normswap.RMSNorm):
            continue
        cls = type(module)
        calls = False
        if cls.__module__.split(".")[0] not in ("torch", "normswap"):
            try:
                calls = bool(re.search(r"\blayer_norm\s*\(", inspect.getsource(cls.forward)))  # a call, not
                # a name that contains it (TransformerLens's ``cfg.is_layer_norm_activation()``)
            except (OSError, TypeError):
                calls = False
        inside = any(path.startswith(f + ".") for f in found)  # a wrapper's own LayerNorm counts once
        if (isinstance(module, nn.LayerNorm) or _LN_CLASS.search(cls.__name__) or calls) and not inside:
            found.append(path)
    return found


def unreported(paths: list[str], plan: Any) -> list[str]:
    """The paths neither a plan site nor a skipped norm, nor inside or around one (a wrapper)."""
    named = {s.name for s in plan.sites} | {s["name"] for s in plan.skipped}

    def covered(path: str) -> bool:
        return any(path == n or path.startswith(n + ".") or n.startswith(path + ".") for n in named)

    return [p for p in paths if not covered(p)]


# ------------------------------------------------------------------------------------- cases
@dataclass
class Case:
    library: str
    name: str
    make: Callable[[], nn.Module]  # a fresh instance (random init); the same call gives the fresh load target
    shape_a: tuple  # positional inputs the analysis sees
    shape_b: tuple  # another shape, never seen by the analysis
    options: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float64  # float32 only for a model whose own code cannot run in float64


def x_transformers_cases() -> list[Case]:
    import x_transformers as xt

    def lm(**layer_kw: Any) -> Callable[[], nn.Module]:
        wrap = {k[5:]: layer_kw.pop(k) for k in list(layer_kw) if k.startswith("wrap_")}
        layer_kw = {"depth": 2, **layer_kw}
        return lambda: xt.TransformerWrapper(num_tokens=64, max_seq_len=32, **wrap,
                                             attn_layers=xt.Decoder(dim=32, heads=4, **layer_kw))

    def enc(**layer_kw: Any) -> Callable[[], nn.Module]:
        return lambda: xt.TransformerWrapper(num_tokens=64, max_seq_len=32,
                                             attn_layers=xt.Encoder(dim=32, depth=2, heads=4, **layer_kw))

    a, b = (ids(64, 2, 9, 0),), (ids(64, 3, 14, 1),)
    variants = {
        "Decoder": {},
        "Decoder rotary_pos_emb": {"rotary_pos_emb": True},
        "Decoder attn_flash": {"attn_flash": True},
        "Decoder ff_glu": {"ff_glu": True},
        "Decoder ff_swish+ff_glu, no bias": {"ff_swish": True, "ff_glu": True, "ff_no_bias": True},
        "Decoder use_scalenorm": {"use_scalenorm": True},
        "Decoder use_rmsnorm": {"use_rmsnorm": True},
        "Decoder pre_norm=False (Post-LN)": {"pre_norm": False},
        "Decoder sandwich_norm": {"sandwich_norm": True},
        "Decoder residual_attn": {"residual_attn": True},
        "Decoder num_memory_tokens=2": {"wrap_num_memory_tokens": 2},
        "Decoder shift_tokens=1": {"shift_tokens": 1},
        "Decoder tie_embedding": {"wrap_tie_embedding": True},
        "Decoder post_emb_norm": {"wrap_post_emb_norm": True},
        "Decoder attn_qk_norm": {"attn_qk_norm": True},
        "Decoder alibi_pos_bias": {"alibi_pos_bias": True, "alibi_num_heads": 2},
        "Decoder rel_pos_bias": {"rel_pos_bias": True},
        "Decoder macaron": {"macaron": True},
        "Decoder attn_kv_heads=2 (GQA)": {"attn_kv_heads": 2},
        "Decoder attn_gate_values": {"attn_gate_values": True},
        "Decoder attn_num_mem_kv=2": {"attn_num_mem_kv": 2},
        "Decoder attn_head_scale": {"attn_head_scale": True},
        "Decoder ff_relu_squared": {"ff_relu_squared": True},
        "Decoder weight_tie_layers": {"weight_tie_layers": True},
        "Decoder add_value_residual": {"add_value_residual": True},
        "Decoder unet_skips": {"unet_skips": True, "depth": 4},
        "Decoder pre_norm_has_final_norm=False": {"pre_norm_has_final_norm": False},
        "Decoder use_simple_rmsnorm": {"use_simple_rmsnorm": True},
        "Decoder ff_post_act_ln": {"ff_post_act_ln": True},
        "Decoder scale_residual": {"scale_residual": True},
        "Decoder layer scale (use_layerscale)": {"use_layerscale": True},
        "Decoder gate_residual": {"gate_residual": True},
        "Decoder l2norm_embed": {"wrap_l2norm_embed": True},
        "Decoder scaled_sinu_pos_emb": {"wrap_scaled_sinu_pos_emb": True},
        "Decoder use_abs_pos_emb=False": {"wrap_use_abs_pos_emb": False},
    }
    cases = [Case("x-transformers", name, lm(**kw), a, b) for name, kw in variants.items()]
    cases.append(Case("x-transformers", "Decoder dynamic_pos_bias (float32: its position MLP casts to float32)",
                      lm(dynamic_pos_bias=True), a, b, dtype=torch.float32))
    cases.append(Case("x-transformers", "Encoder", enc(), a, b))
    cases.append(Case("x-transformers", "ContinuousTransformerWrapper (features in, features out)",
                      lambda: xt.ContinuousTransformerWrapper(dim_in=12, dim_out=6, max_seq_len=32,
                                                              attn_layers=xt.Encoder(dim=32, depth=2, heads=4)),
                      (feats(2, 9, 12, seed=0),), (feats(3, 14, 12, seed=1),)))
    cases.append(Case("x-transformers", "Encoder rotary + cross_attend (context)",
                      lambda: _ContextEncoder(xt), (ids(64, 2, 9, 0), feats(2, 5, 24, seed=2)),
                      (ids(64, 3, 12, 1), feats(3, 7, 24, seed=3))))
    cases.append(Case("x-transformers", "XTransformer enc-dec",
                      lambda: xt.XTransformer(dim=32, enc_num_tokens=64, enc_depth=2, enc_heads=4, enc_max_seq_len=32,
                                              dec_num_tokens=64, dec_depth=2, dec_heads=4, dec_max_seq_len=32,
                                              tie_token_emb=True),
                      (ids(64, 2, 9, 0), ids(64, 2, 7, 2)), (ids(64, 3, 12, 1), ids(64, 3, 5, 3))))
    cases.append(Case("x-transformers", "ViTransformerWrapper",
                      lambda: xt.ViTransformerWrapper(image_size=16, patch_size=4, num_classes=10,
                                                      attn_layers=xt.Encoder(dim=32, depth=2, heads=4)),
                      (feats(2, 3, 16, 16, seed=0),), (feats(5, 3, 16, 16, seed=1),)))
    return cases


class _ContextEncoder(nn.Module):
    """An x-transformers encoder cross-attending to a context (conditioning as its users wire it)."""

    def __init__(self, xt: Any) -> None:
        super().__init__()
        self.net = xt.TransformerWrapper(num_tokens=64, max_seq_len=32,
                                         attn_layers=xt.Encoder(dim=32, depth=2, heads=4, rotary_pos_emb=True,
                                                                cross_attend=True))
        self.ctx = nn.Linear(24, 32)

    def forward(self, tokens: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.net(tokens, context=self.ctx(context))


def _images(size: int, batch: int, seed: int, channels: int = 3) -> tuple:
    return (feats(batch, channels, size, size, seed=seed),)


def vit_pytorch_cases() -> list[Case]:
    vp = "vit_pytorch."
    mod = {n: importlib.import_module(vp + n) for n in (
        "vit", "simple_vit", "cait", "deepvit", "cross_vit", "t2t", "pit", "levit", "cvt", "twins_svt",
        "regionvit", "crossformer", "max_vit", "scalable_vit", "mobile_vit", "xcit", "nest",
        "simple_vit_with_register_tokens", "vit_for_small_dataset", "cct", "simple_flash_attn_vit",
        "vit_1d", "na_vit", "vivit")}
    vit = {"image_size": 32, "patch_size": 8, "num_classes": 10, "dim": 32, "depth": 2, "heads": 4, "mlp_dim": 64,
           "dim_head": 8}
    a32, b32 = _images(32, 2, 0), _images(32, 5, 1)

    def c(name: str, make: Callable[[], nn.Module], a: tuple = a32, b: tuple = b32, **kw: Any) -> Case:
        return Case("vit-pytorch", name, make, a, b, **kw)

    return [
        c("ViT", lambda: mod["vit"].ViT(**vit)),
        c("ViT pool='mean'", lambda: mod["vit"].ViT(**vit, pool="mean")),
        c("SimpleViT", lambda: mod["simple_vit"].SimpleViT(**vit)),
        c("SimpleViT register tokens", lambda: mod["simple_vit_with_register_tokens"].SimpleViT(**vit)),
        c("SimpleViT flash attention", lambda: mod["simple_flash_attn_vit"].SimpleViT(**vit)),
        c("CaiT", lambda: mod["cait"].CaiT(**vit, cls_depth=1)),
        c("DeepViT", lambda: mod["deepvit"].DeepViT(**vit)),
        c("CrossViT", lambda: mod["cross_vit"].CrossViT(
            image_size=32, num_classes=10, sm_dim=32, lg_dim=48, sm_patch_size=8, sm_enc_depth=1, sm_enc_heads=4,
            sm_enc_mlp_dim=64, sm_enc_dim_head=8, lg_patch_size=16, lg_enc_depth=1, lg_enc_heads=4,
            lg_enc_mlp_dim=64, lg_enc_dim_head=8, cross_attn_depth=1, cross_attn_heads=4, cross_attn_dim_head=8,
            depth=2, dropout=0.0, emb_dropout=0.0)),
        c("T2TViT", lambda: mod["t2t"].T2TViT(image_size=32, num_classes=10, dim=32, depth=2, heads=4, mlp_dim=64,
                                             dim_head=8, t2t_layers=((7, 4), (3, 2)))),
        c("PiT", lambda: mod["pit"].PiT(image_size=32, patch_size=8, num_classes=10, dim=32, depth=(1, 1), heads=4,
                                       mlp_dim=64, dim_head=8)),
        c("LeViT", lambda: mod["levit"].LeViT(image_size=32, num_classes=10, dim=(16, 32, 48), depth=1, heads=(2, 4, 4),
                                             mlp_mult=2, dim_key=8, dim_value=8)),
        c("CvT", lambda: mod["cvt"].CvT(num_classes=10, s1_emb_dim=16, s2_emb_dim=24, s3_emb_dim=32, s1_depth=1,
                                       s2_depth=1, s3_depth=1, s2_heads=2, s3_heads=2)),
        c("TwinsSVT", lambda: mod["twins_svt"].TwinsSVT(num_classes=10, s1_emb_dim=16, s2_emb_dim=16, s3_emb_dim=16,
                                                        s4_emb_dim=16, s3_depth=1, s4_depth=1, s1_local_patch_size=2,
                                                        s2_local_patch_size=2, s3_local_patch_size=1,
                                                        s4_local_patch_size=1, s1_global_k=2, s2_global_k=2,
                                                        s3_global_k=1, s4_global_k=1), _images(64, 2, 0),
          _images(64, 3, 1)),
        c("RegionViT", lambda: mod["regionvit"].RegionViT(dim=(16, 16, 32, 32), depth=(1, 1, 1, 1), window_size=2,
                                                         num_classes=10), _images(64, 2, 0), _images(64, 3, 1)),
        c("CrossFormer (float32: its position bias casts to float32)", lambda: mod["crossformer"].CrossFormer(
            dim=(32, 32, 64, 64), depth=(1, 1, 1, 1), global_window_size=(2, 2, 1, 1), local_window_size=2,
            num_classes=10), tuple(x.float() for x in _images(64, 2, 0)), tuple(x.float() for x in _images(64, 3, 1)),
          dtype=torch.float32),
        c("MaxViT", lambda: mod["max_vit"].MaxViT(num_classes=10, dim=16, depth=(1, 1), dim_head=8, window_size=2,
                                                  dropout=0.0), _images(32, 2, 0), _images(32, 3, 1)),
        c("ScalableViT", lambda: mod["scalable_vit"].ScalableViT(
            num_classes=10, dim=16, depth=(1, 1, 1, 1), heads=(1, 2, 2, 2), reduction_factor=(2, 2, 1, 1),
            window_size=(2, 2, None, None)), _images(64, 2, 0), _images(64, 3, 1)),
        c("MobileViT", lambda: mod["mobile_vit"].MobileViT(image_size=(64, 64), dims=[24, 32, 40],
                                                           channels=[8, 8, 16, 16, 24, 24, 32, 32, 48, 48, 64],
                                                           num_classes=10), _images(64, 2, 0), _images(64, 3, 1)),
        c("XCiT", lambda: mod["xcit"].XCiT(**vit, cls_depth=1)),
        c("NesT", lambda: mod["nest"].NesT(image_size=32, patch_size=4, dim=16, heads=2, num_hierarchies=2,
                                          block_repeats=(1, 1), num_classes=10, dim_head=8)),
        c("ViT for small datasets (SPT, LSA)", lambda: mod["vit_for_small_dataset"].ViT(**vit)),
        c("CCT", lambda: mod["cct"].CCT(img_size=(32, 32), embedding_dim=32, n_conv_layers=1, kernel_size=3,
                                       stride=2, padding=1, pooling_kernel_size=3, pooling_stride=2,
                                       pooling_padding=1, num_layers=2, num_heads=4, mlp_ratio=2.0, num_classes=10,
                                       positional_embedding="learnable")),
        c("ViT 1D", lambda: mod["vit_1d"].ViT(seq_len=64, patch_size=8, num_classes=10, dim=32, depth=2, heads=4,
                                              mlp_dim=64, dim_head=8),
          (feats(2, 3, 64, seed=0),), (feats(5, 3, 64, seed=1),)),
        c("ViViT factorized encoder", lambda: mod["vivit"].ViViT(
            image_size=16, image_patch_size=8, frames=4, frame_patch_size=2, num_classes=10, dim=32,
            spatial_depth=1, temporal_depth=1, heads=4, mlp_dim=64, dim_head=8, use_flash_attn=False),
          (feats(2, 3, 4, 16, 16, seed=0),), (feats(3, 3, 4, 16, 16, seed=1),)),
        c("NaViT (lists of images)", lambda: mod["na_vit"].NaViT(**vit),
          ([[feats(3, 32, 32, seed=0), feats(3, 16, 24, seed=1)], [feats(3, 24, 32, seed=2)]],),
          ([[feats(3, 16, 16, seed=3)], [feats(3, 32, 16, seed=4), feats(3, 8, 8, seed=5)]],)),
    ]


class _Esm2(nn.Module):
    """fair-esm's ESM-2 as users call it: logits and a layer's representations (a dict)."""

    def __init__(self, esm: Any, token_dropout: bool = True) -> None:
        super().__init__()
        self.net = esm.model.esm2.ESM2(num_layers=2, embed_dim=32, attention_heads=4, alphabet="ESM-1b",
                                       token_dropout=token_dropout)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.net(tokens, repr_layers=[2])
        return out["logits"], out["representations"][2]


def _proteins(batch: int, length: int, seed: int) -> tuple:
    """<cls> amino acids <eos>, in ESM-1b's alphabet (4..23 the standard residues)."""
    body = ids(24, batch, length, seed, low=4)
    return (torch.cat([torch.zeros(batch, 1, dtype=torch.long), body, torch.full((batch, 1), 2)], dim=1),)


def esm_cases() -> list[Case]:
    import esm

    return [
        Case("fair-esm", "ESM-2 (token dropout)", lambda: _Esm2(esm), _proteins(2, 9, 0), _proteins(3, 14, 1)),
        Case("fair-esm", "ESM-2 (no token dropout)", lambda: _Esm2(esm, False), _proteins(2, 9, 0),
             _proteins(3, 14, 1)),
    ]


def timm_cases() -> list[Case]:
    import timm

    vit = {"img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 4, "num_classes": 10}
    plain = {"img_size": 32, "num_classes": 10}

    def c(name: str, arch: str, kw: dict, a: tuple = _images(32, 2, 0), b: tuple = _images(32, 5, 1)) -> Case:
        return Case("timm", f"{name} ({arch})", lambda: timm.create_model(arch, pretrained=False, **kw), a, b)

    return [
        c("ViT", "vit_tiny_patch16_224", vit),
        c("ViT avg pool, no class token", "vit_tiny_patch16_224", {**vit, "class_token": False, "global_pool": "avg"}),
        c("ViT register tokens, layer scale", "vit_small_patch14_reg4_dinov2",
          {**vit, "init_values": 1e-1, "dynamic_img_size": True}, _images(32, 2, 0), _images(48, 3, 1)),
        c("ViT CLIP-style pre-norm", "vit_base_patch16_clip_224", vit),
        c("ViT SigLIP (attention-pool head)", "vit_base_patch16_siglip_224", vit),
        c("DeiT distilled", "deit_tiny_distilled_patch16_224", vit),
        c("DeiT-3 (layer scale)", "deit3_small_patch16_224", vit),
        c("BEiT", "beit_base_patch16_224", vit),
        c("EVA-02 (rope, SwiGLU)", "eva02_tiny_patch14_224", {**vit, "ref_feat_shape": (4, 4)}),
        c("CaiT", "cait_xxs24_224", {**vit, "depth_token_only": 1}),
        c("XCiT", "xcit_nano_12_p16_224", {**vit, "patch_size": 16}),
        Case("timm", "MLP-Mixer (MlpMixer)", lambda: importlib.import_module("timm.models.mlp_mixer").MlpMixer(
            img_size=32, patch_size=8, embed_dim=32, num_blocks=2, num_classes=10), _images(32, 2, 0),
             _images(32, 5, 1)),
        c("ConvNeXt", "convnext_atto", {"dims": (16, 16, 32, 32), "depths": (1, 1, 1, 1), "num_classes": 10}),
        c("Swin", "swin_tiny_patch4_window7_224", {**plain, "patch_size": 4, "embed_dim": 16, "depths": (1, 1),
                                                   "num_heads": (1, 2), "window_size": 4}),
        c("PVT-v2", "pvt_v2_b0", {"embed_dims": (16, 16, 32, 32), "depths": (1, 1, 1, 1), "num_heads": (1, 1, 2, 2),
                                  "num_classes": 10}),
        c("PiT", "pit_ti_224", {**plain, "patch_size": 8, "stride": 4, "base_dims": (16, 16), "depth": (1, 1),
                                "heads": (2, 4)}),
    ]


class _Perceiver(nn.Module):
    def __init__(self, pp: Any) -> None:
        super().__init__()
        self.net = pp.Perceiver(input_channels=3, input_axis=2, num_freq_bands=4, max_freq=10.0, depth=2,
                                num_latents=8, latent_dim=32, cross_heads=1, latent_heads=4, cross_dim_head=8,
                                latent_dim_head=8, num_classes=10)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return self.net(img)


def perceiver_cases() -> list[Case]:
    import perceiver_pytorch as pp

    return [
        Case("perceiver-pytorch", "Perceiver", lambda: _Perceiver(pp), (feats(2, 8, 8, 3, seed=0),),
             (feats(3, 12, 10, 3, seed=1),)),
        Case("perceiver-pytorch", "PerceiverIO", lambda: pp.PerceiverIO(
            dim=24, queries_dim=16, logits_dim=10, depth=2, num_latents=8, latent_dim=32, cross_heads=1,
            latent_heads=4, cross_dim_head=8, latent_dim_head=8),
             (feats(2, 9, 24, seed=0), None, feats(2, 5, 16, seed=2)),
             (feats(3, 13, 24, seed=1), None, feats(3, 4, 16, seed=3))),
    ]


def open_clip_cases() -> list[Case]:
    from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg

    def clip(**vision: Any) -> Callable[[], nn.Module]:
        return lambda: CLIP(embed_dim=16, vision_cfg=CLIPVisionCfg(layers=2, width=32, head_width=8, image_size=32,
                                                                   patch_size=8, **vision),
                            text_cfg=CLIPTextCfg(context_length=12, vocab_size=64, width=32, heads=4, layers=2))

    def both(batch: int, seed: int) -> tuple:
        return (feats(batch, 3, 32, 32, seed=seed), ids(64, batch, 12, seed + 10))

    return [
        Case("open_clip", "CLIP ViT", clip(), both(2, 0), both(3, 1)),
        Case("open_clip", "CLIP ViT, attention pooling", clip(attentional_pool=True), both(2, 0), both(3, 1)),
        Case("open_clip", "CLIP ViT, no class token, layer scale", clip(no_ln_pre=True, ls_init_value=0.1,
                                                                      pool_type="avg"), both(2, 0), both(3, 1)),
    ]


class _RotaryLM(nn.Module):
    """A Pre-LN decoder written with rotary-embedding-torch the way its README wires it: separate q/k/v
    Linears, ``rotary.rotate_queries_or_keys`` on q and k, SDPA."""

    def __init__(self, ret: Any, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.rotary = ret.RotaryEmbedding(dim=d // heads // 2)
        self.tok = nn.Embedding(vocab, d)
        self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(2 * layers + 1))
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d, bias=False) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
                                 for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        b, t, d = x.shape
        for i, (qkv, out, mlp) in enumerate(zip(self.qkv, self.out, self.mlp, strict=True)):
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in qkv(self.norms[2 * i](x)).chunk(3, -1))
            q, k = self.rotary.rotate_queries_or_keys(q), self.rotary.rotate_queries_or_keys(k)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + out(y.transpose(1, 2).reshape(b, t, d))
            x = x + mlp(self.norms[2 * i + 1](x))
        return self.head(self.norms[-1](x))


def rotary_cases() -> list[Case]:
    import rotary_embedding_torch as ret

    return [Case("rotary-embedding-torch", "Pre-LN decoder with RotaryEmbedding", lambda: _RotaryLM(ret),
                 (ids(64, 2, 9, 0),), (ids(64, 3, 14, 1),))]


def nanogpt_cases() -> list[Case]:
    """nanoGPT is not a package: its patterns, replicated in tests/third_party_models.py."""
    from tests.third_party_models import NanoGptStyle

    return [Case("nanoGPT (replica)", f"GPT bias={bias}", lambda bias=bias: NanoGptStyle(vocab=64, bias=bias),
                 (ids(64, 2, 9, 0),), (ids(64, 3, 14, 1),)) for bias in (False, True)]


def transformer_lens_cases() -> list[Case]:
    """TransformerLens's ``HookedTransformer`` (2.x): W_E / W_pos tables, W_Q/W_K/W_V ``[heads, d_model, d_head]``
    and W_O ``[heads, d_head, d_model]`` applied with einsum, W_in / W_out ``[d_in, d_out]`` (issue 37 §1)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    def c(name: str, **kw: Any) -> Case:
        def make() -> nn.Module:
            config = dict(n_layers=2, d_model=32, n_ctx=16, d_head=8, n_heads=4, d_mlp=64, d_vocab=64,
                          act_fn="gelu", normalization_type="LN", dtype=torch.float64)
            return HookedTransformer(HookedTransformerConfig(**{**config, **kw}))
        return Case("transformer-lens", name, make, (ids(64, 2, 9, 0),), (ids(64, 3, 14, 1),))

    return [c("HookedTransformer"), c("HookedTransformer attn-only", attn_only=True),
            c("HookedTransformer SoLU (LN in the MLP)", act_fn="solu_ln"),
            c("HookedTransformer shortformer positions", positional_embedding_type="shortformer"),
            c("HookedTransformer rotary", positional_embedding_type="rotary")]


LIBRARIES: dict[str, tuple[str, Callable[[], list[Case]]]] = {
    "x-transformers": ("x_transformers", x_transformers_cases),
    "vit-pytorch": ("vit_pytorch", vit_pytorch_cases),
    "timm": ("timm", timm_cases),
    "fair-esm": ("esm", esm_cases),
    "open-clip-torch": ("open_clip", open_clip_cases),
    "perceiver-pytorch": ("perceiver_pytorch", perceiver_cases),
    "rotary-embedding-torch": ("rotary_embedding_torch", rotary_cases),
    "nanoGPT (replica)": ("torch", nanogpt_cases),
    "transformer-lens": ("transformer_lens", transformer_lens_cases),
}


# ------------------------------------------------------------------------------------- checks
@dataclass
class Row:
    library: str
    model: str
    norms: int = 0
    verdicts: str = ""
    err_a: float = float("nan")
    err_b: float = float("nan")
    round_trip: str = ""
    rotated: str = ""
    unreported: list[str] = field(default_factory=list)
    problem: str = ""
    seconds: float = 0.0

    def ok(self) -> bool:
        return not self.problem and not self.unreported


def _verdicts(plan: Any) -> str:
    short = {"exact": "E", "exact-with-centering": "C", "exact-with-per-norm-centering": "P",
             "approximate": "A", "skipped": "S"}
    return " ".join(f"{n}{short[v]}" for v, n in plan.counts().items() if n)


def _round_trip(case: Case, patched: nn.Module, outputs: list) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        normswap.save(patched, tmp)
        torch.manual_seed(123)  # a fresh instance with other random weights
        fresh = case.make().to(case.dtype)
        loaded = normswap.load(tmp, model=fresh)
    same = all(bitwise(run(loaded, x), want) for x, want in zip((case.shape_a, case.shape_b), outputs, strict=True))
    return "bitwise" if same else "DIFFERS"


def _rotation(case: Case, model: nn.Module, original: Any) -> str:
    report = normswap.patch(model, case.shape_a, fold_gamma=True, **case.options)
    result = normswap.rotate(model, "hadamard")
    errs = [rel_error(run(model, x), want) for x, want in zip((case.shape_a, case.shape_b), original, strict=True)]
    streams = len(report.plan.rotations) or len(getattr(result, "streams", []) or [])
    return f"{max(errs):.1e} ({streams} streams)"


def build(case: Case) -> nn.Module:
    """The case's model, randomised, float64, eval: the same weights at every call. Built anew rather than
    deep-copied, so a closure the model keeps over itself never reads another instance's weights."""
    torch.manual_seed(0)
    return randomise(case.make()).to(case.dtype)


def check(case: Case) -> Row:
    row = Row(case.library, case.name)
    t0 = time.perf_counter()
    try:
        model, original = build(case), build(case)
        reference = [run(original, x) for x in (case.shape_a, case.shape_b)]
        lns = layernorm_like(model)
        plan = normswap.plan(model, case.shape_a, **case.options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = normswap.patch(model, case.shape_a, **case.options)
        row.norms, row.verdicts = len(lns), _verdicts(report.plan)
        row.unreported = unreported(lns, report.plan)
        if _verdicts(plan) != row.verdicts:
            row.problem = f"plan {_verdicts(plan)} != patch {row.verdicts}; "
        outputs = [run(model, x) for x in (case.shape_a, case.shape_b)]
        row.err_a, row.err_b = (rel_error(o, r) for o, r in zip(outputs, reference, strict=True))
        exact = all(s.verdict.startswith("exact") for s in report.plan.sites if s.convert)
        tol = TOL if case.dtype == torch.float64 else TOL_FLOAT32
        if exact and max(row.err_a, row.err_b) > tol:
            row.problem += f"exact plan but error {max(row.err_a, row.err_b):.1e}; "
        row.round_trip = _round_trip(case, model, outputs) if report.changed else "nothing converted"
        if row.round_trip == "DIFFERS":
            row.problem += "round trip differs; "
        if exact and report.changed:
            row.rotated = _rotation(case, build(case), reference)
            if float(row.rotated.split()[0]) > tol:
                row.problem += "rotated model differs; "
        else:
            row.rotated = "n/a (approximate)" if report.changed else "n/a"
    except Exception as exc:  # noqa: BLE001 (every failure is a finding to report)
        row.problem += f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        if "--traceback" in sys.argv:
            traceback.print_exc()
    row.seconds = time.perf_counter() - t0
    return row


def table(rows: list[Row]) -> str:
    head = ("| library | model | LN-like | verdicts | max rel err A | max rel err B | round trip | "
            "fold γ + Hadamard | problem |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        problem = r.problem.rstrip("; ") + (f" unreported: {r.unreported}" if r.unreported else "")
        lines.append(f"| {r.library} | {r.model} | {r.norms} | {r.verdicts} | {r.err_a:.1e} | {r.err_b:.1e} | "
                     f"{r.round_trip} | {r.rotated} | {problem or '-'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[], help="run the cases whose 'library model' contains one")
    parser.add_argument("--json", help="also write the rows as JSON here")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--traceback", action="store_true", help="print the traceback of each failure")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    install_torchvision_stand_in()
    install_wandb_stand_in()
    rows, versions = [], {"torch": torch.__version__, "normswap": normswap.__version__}
    for library, (module, cases) in LIBRARIES.items():
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001
            print(f"note: {library} skipped ({type(exc).__name__}: {exc})", flush=True)
            continue
        if module != "torch":
            versions[library] = importlib.metadata.version(library)
        for case in cases():
            if args.only and not any(s.lower() in f"{case.library} {case.name}".lower() for s in args.only):
                continue
            row = check(case)
            rows.append(row)
            print(f"{row.library} | {row.model} | {row.verdicts} | {row.err_a:.1e} {row.err_b:.1e} | "
                  f"{row.round_trip} | {row.rotated} | {row.problem or 'ok'}"
                  + (f" unreported {row.unreported}" if row.unreported else "") + f" [{row.seconds:.1f}s]",
                  flush=True)
    print("\nversions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    print("verdicts: E exact, C exact-with-centering, P exact-with-per-norm-centering, A approximate, S skipped\n")
    print(table(rows))
    bad = [r for r in rows if not r.ok()]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} models without a problem")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": versions, "rows": [r.__dict__ for r in rows]}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
