"""Measurements shared by the integration tests and ``benchmarks/compat_table.py``.

Tiny converted models (GPT-2: exact Pre-LN; BERT: Post-LN, converted with ``mode="all"``; ViT: exact
Pre-LN), built offline from ``tests/zoo.py`` with randomised LayerNorm parameters, converted in float64
and cast to float32 (what people export). Each function returns the agreement it measured against the
eager converted model, so the compatibility table (docs/compatibility.md) is generated from the same code the tests
assert on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import torch
from torch import nn

import normswap
from tests.zoo import APPROXIMATE, EXACT, build

MODELS = ("gpt2", "bert", "vit")
REPO = Path(__file__).resolve().parents[2]


def tiny_converted(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """``(converted float32 model in eval mode, example kwargs)`` for ``gpt2``, ``bert`` or ``vit``."""
    table = APPROXIMATE if name == "bert" else EXACT
    model = build(table, name)
    normswap.patch(model, mode="all", calibration=False)  # agreement is with the converted model itself
    model = model.float().eval()
    return model, example_inputs(name, model)


def example_inputs(name: str, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=gen)}
    ids = torch.randint(3, 99, (2, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0  # one padded row, so the mask is a real input
    out = {"input_ids": ids, "attention_mask": mask}
    if name == "gpt2":
        out["use_cache"] = False
    return out


def tensor_inputs(inputs: dict) -> dict[str, torch.Tensor]:
    return {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}


def first_output(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return next(iter(out.values()))
    return out[0]


def vit_exported_with_cpu_op() -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor, object]:
    """A converted tiny ViT with every RMSNorm on the fused ``cpu`` backend, and its ``torch.export``
    program, which holds ``normswap::cpu_rms_norm`` (checked): ``(model, inputs, pixel_values, program)``,
    for the tests of the ONNX translation table."""
    model, inputs = tiny_converted("vit")
    for m in model.modules():
        if isinstance(m, normswap.RMSNorm):
            m.backend = "cpu"
    x = tensor_inputs(inputs)["pixel_values"]
    ep = torch.export.export(Positional(model, inputs), (x,))
    assert any("normswap.cpu_rms_norm" in str(n.target) for n in ep.graph.nodes)
    return model, inputs, x, ep


def rms_norm_count(model: nn.Module) -> int:
    return sum(isinstance(m, normswap.RMSNorm) for m in model.modules())


def norm_op_counts(model: nn.Module) -> tuple[int, int]:
    """``(RMS, centering)``: the model's RMSNorms that export as RMS ops, and those that center their own input
    (``centers_input``: LayerNorm's math, exported as the original's ``LayerNormalization``). Since round 63 a
    Post-LN encoder's embeddings' norm is one of the latter by default (its tables keep their rows)."""
    centering = sum(bool(getattr(m, "centers_input", False)) for m in model.modules()
                    if isinstance(m, normswap.RMSNorm))
    return rms_norm_count(model) - centering, centering


def agreement(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Max abs error and max error relative to the reference's largest magnitude."""
    got, ref = got.double(), ref.double()
    err = (got - ref).abs().max().item()
    return {"max_abs": err, "max_rel": err / max(ref.abs().max().item(), 1e-30)}


class Positional(nn.Module):
    """``model(**inputs)`` as a module whose forward takes the tensor inputs positionally and returns
    the first output (what deployment graphs look like; the exporters then see no keyword defaults)."""

    def __init__(self, model: nn.Module, inputs: dict) -> None:
        super().__init__()
        self.model = model
        self.keys = [k for k, v in inputs.items() if isinstance(v, torch.Tensor)]
        self.extra = {k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)}
        self.train(model.training)  # a fresh module is in train mode; exporters restore it onto the model

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
        return first_output(self.model(**dict(zip(self.keys, tensors, strict=True)), **self.extra))


def onnx_roundtrip(model: nn.Module, inputs: dict, *, dynamo: bool, opset: int, path: str | os.PathLike,
                   **export_kwargs) -> dict:
    """Export with ``torch.onnx.export``, run in onnxruntime, compare with the eager model.

    Returns the agreement plus ``ops`` (the graph's op types), ``rms`` (RMSNormalization nodes) and
    ``inputs`` (the graph's input count).
    """
    export_onnx(model, inputs, path, dynamo=dynamo, opset_version=opset, **export_kwargs)
    return onnx_agreement(model, inputs, path)


def export_onnx(model: nn.Module, inputs: dict, path: str | os.PathLike, **export_kwargs) -> None:
    """``torch.onnx.export`` of ``Positional(model, inputs)`` with the tensor inputs, under ``no_grad``,
    without the exporter's warnings and progress lines."""
    import logging
    import warnings

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.disable(logging.WARNING)  # the exporter's progress lines
        try:
            torch.onnx.export(Positional(model, inputs), tuple(tensor_inputs(inputs).values()), str(path),
                              **export_kwargs)
        finally:
            logging.disable(logging.NOTSET)


def onnx_agreement(model: nn.Module, inputs: dict, path: str | os.PathLike) -> dict:
    """Run the ONNX file ``path`` (an export of ``model``) in onnxruntime and compare with the eager model:
    :func:`onnx_roundtrip`'s figures for a file exported already."""
    import onnx
    import onnxruntime as ort

    tensors = tensor_inputs(inputs)
    with torch.no_grad():
        ref = first_output(model(**inputs))
    graph = onnx.load(str(path)).graph
    ops = [n.op_type for n in graph.node]
    for fn in onnx.load(str(path)).functions:
        ops += [n.op_type for n in fn.node]
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    assert len(names) == len(tensors), f"graph inputs {names} vs {list(tensors)}"
    feed = {n: t.numpy() for n, t in zip(names, tensors.values(), strict=True)}
    got = torch.from_numpy(sess.run(None, feed)[0])
    return {**agreement(got, ref), "ops": sorted(set(ops)), "rms": ops.count("RMSNormalization"),
            "inputs": len(names), "nonzero": bool(got.abs().max().item() > 0)}


class OnnxExports:
    """What the ONNX test files (``test_onnx_export.py``, ``test_onnx_fusion.py``) share within one process
    (the session fixture ``onnx_exports``): each tiny converted model built once, each of its exports made
    once per set of ``torch.onnx.export`` arguments, the ViT program holding ``normswap::cpu_rms_norm`` and
    its translations made once per opset. Each dynamo export costs 3-4 CPU s; the two files asked for the
    same ones (``dynamo=True, opset_version=23`` and ``dynamo=False, opset_version=18`` of each model, the
    opset-18 translation). Tests read these and never change them: a test that needs another model
    (another backend, a float16 copy) builds its own."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._models: dict[str, tuple[nn.Module, dict[str, torch.Tensor]]] = {}
        self._files: dict[tuple[str, str], Path] = {}
        self._cpu_op: tuple | None = None

    def model(self, name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
        """:func:`tiny_converted` ``(model, inputs)`` for ``name``, built once."""
        if name not in self._models:
            self._models[name] = tiny_converted(name)
        return self._models[name]

    def export(self, name: str, **export_kwargs) -> Path:
        """The file of ``torch.onnx.export(Positional(model, inputs), ..., **export_kwargs)`` for ``name``'s
        model, written once per set of arguments."""
        key = "-".join(f"{k}={v}" for k, v in sorted(export_kwargs.items()))
        if (name, key) not in self._files:
            folder = self.root / name
            folder.mkdir(parents=True, exist_ok=True)
            model, inputs = self.model(name)
            export_onnx(model, inputs, folder / f"{key}.onnx", **export_kwargs)
            self._files[name, key] = folder / f"{key}.onnx"
        return self._files[name, key]

    def vit_cpu_op(self) -> tuple[nn.Module, dict[str, torch.Tensor], torch.Tensor, object]:
        """:func:`vit_exported_with_cpu_op`, made once."""
        if self._cpu_op is None:
            self._cpu_op = vit_exported_with_cpu_op()
        return self._cpu_op

    def translated(self, opset: int) -> Path:
        """The ONNX file of :meth:`vit_cpu_op`'s program exported with ``translation_table(opset)``."""
        import warnings

        from normswap.integrations.onnx import translation_table

        if ("vit-cpu-op", str(opset)) not in self._files:
            *_, ep = self.vit_cpu_op()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                program = torch.onnx.export(ep, dynamo=True, opset_version=opset,
                                            custom_translation_table=translation_table(opset))
            path = self.root / f"vit-cpu-op-translated-{opset}.onnx"
            self.root.mkdir(parents=True, exist_ok=True)
            program.save(str(path))
            self._files["vit-cpu-op", str(opset)] = path
        return self._files["vit-cpu-op", str(opset)]


_FRESH_EXPORT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {repo!r})
    import normswap
    from tests.integrations.compat import example_inputs, first_output, Positional, tensor_inputs
    model = normswap.load({tmp!r} + "/ckpt").float().eval()  # no forward has run in this process yet
    inputs = example_inputs({name!r})
    tensors = tuple(tensor_inputs(inputs).values())
    ep = torch.export.export(Positional(model, inputs), tensors)
    torch.export.save(ep, {tmp!r} + "/model.pt2")
    with torch.no_grad():
        ref = first_output(model(**inputs))
    torch.save({{"ref": ref, "inputs": tensors}}, {tmp!r} + "/ref.pt")
    targets = sorted({{str(n.target) for n in ep.graph.nodes if n.op == "call_function"}})
    print(json.dumps({{"targets": targets}}))
""")

# The head of a script run in a fresh process to prove a written artefact loads without normswap:
# any import of normswap fails. Contains no braces, so scripts built on it can still use str.format.
NO_NORMSWAP_IMPORTS = textwrap.dedent("""
    import builtins
    _real_import = builtins.__import__
    def _no_normswap(name, *a, **k):
        if name.split(".")[0] == "normswap":
            raise ImportError("normswap must not be needed here")
        return _real_import(name, *a, **k)
    builtins.__import__ = _no_normswap
""")

_LOAD_WITHOUT_NORMSWAP = NO_NORMSWAP_IMPORTS + textwrap.dedent("""
    import json, sys, torch
    ep = torch.export.load({tmp!r} + "/model.pt2")
    data = torch.load({tmp!r} + "/ref.pt")
    with torch.no_grad():
        out = ep.module()(*data["inputs"])
    err = (out.double() - data["ref"].double()).abs().max().item()
    print(json.dumps({{"max_abs": err, "max_rel": err / data["ref"].abs().max().item(),
                      "normswap_loaded": any(m.startswith("normswap") for m in sys.modules)}}))
""")


def _run(code: str, warm=None) -> dict:
    """Run ``code`` in a fresh interpreter, or with ``warm`` (``tests/warm_python.py``) in a child of the
    warm fork server: a new process where neither normswap nor any RMSNorm call has run yet."""
    import json

    if warm is None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                              cwd=str(REPO))
    else:
        proc = warm.run(code, cwd=REPO, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"subprocess failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def torch_export_fresh(name: str, warm=None) -> dict:
    """Save the converted model natively, then in a fresh process ``normswap.load`` it and make
    ``torch.export.export`` the first RMSNorm call, ``torch.export.save``; then ``torch.export.load``
    and run it in a second process where importing normswap is forbidden. With ``warm`` (the tests'
    fork server) both processes are its children: new processes that never imported normswap."""
    import normswap

    model, _ = tiny_converted(name)
    with tempfile.TemporaryDirectory() as tmp:
        normswap.checkpoint.save(model, Path(tmp) / "ckpt")
        first = _run(_FRESH_EXPORT.format(repo=str(REPO), name=name, tmp=tmp), warm)
        second = _run(_LOAD_WITHOUT_NORMSWAP.format(tmp=tmp), warm)
    return {**second, "targets": first["targets"]}
