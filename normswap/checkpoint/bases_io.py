"""The adapter bases' vectors of a checkpoint directory: a binary side file beside ``config.json``.

A Linear the conversion edited carries an :class:`normswap.rotation.carry.AdapterBasis` so that a PEFT adapter
on it acts as on the original model. Its structure (which Linear reads which norm's γ / β, which writer is
centered, which λ it holds) is small and goes into the manifest (``plan.adapter_bases``); its vectors grow with
width × depth and go into :data:`SIDECAR` (``normswap_adapter_bases.safetensors``), one tensor per norm site / λ
however many Linears read it, named as the manifest names it. The manifest of a 2-layer, 1024-wide GPT-2 stays
the size it has without adapter bases (it was 149 KB with the vectors as JSON floats). Each vector is stored in
the narrowest float dtype that gives its float64 values back bit for bit (a float32 model's γ in float32; a
balance computed in float64 in float64), so the adapters stay exact to float64.

Transformers never reads the file (it loads ``model.safetensors`` or the files its index lists), and
:func:`normswap.checkpoint.io.weight_files` leaves it out. A directory without it (written before round 55, or
the file removed) loads as before: a manifest that names vectors with no file to read them from gives one
warning, and an adapter attached to one of those Linears is refused with one line (the model itself is
unaffected: the vectors only map adapters). A file that is there but damaged, or lacks a vector the manifest
names, raises one line as the load starts.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch

from normswap.analysis.plan import ADAPTER_BASES_FILE, ADAPTER_VECTOR_FIELDS, Plan
from normswap.checkpoint import io

SIDECAR = ADAPTER_BASES_FILE
_NARROWER = (torch.bfloat16, torch.float16, torch.float32)


def named(plan: Plan) -> set[str]:
    """The vector names ``plan.adapter_bases`` refers to."""
    return {v for record in plan.adapter_bases.values() for k, v in record.items()
            if k in ADAPTER_VECTOR_FIELDS and isinstance(v, str)}


def narrowest(t: torch.Tensor) -> torch.Tensor:
    """``t`` (float64) in the narrowest float dtype whose values convert back to ``t`` exactly."""
    for dtype in _NARROWER:
        c = t.to(dtype)
        if torch.equal(c.double(), t):
            return c
    return t


def write(plan: Plan, out: Path) -> int:
    """Write the vectors ``plan.adapter_bases`` names into ``out/SIDECAR`` (through a temporary name and a
    rename, so the file is whole or absent; inside a conversion's staging directory the whole directory is
    moved into place at the end). Returns the bytes written: 0 when there is nothing to store (no adapter bases,
    or a model loaded without its side file, whose vectors are not known); a side file an earlier save left in
    ``out`` is then removed, so that it is never read as this model's."""
    tensors = {name: narrowest(plan.adapter_vectors[name].detach().to("cpu", torch.float64).contiguous())
               for name in sorted(named(plan)) if name in plan.adapter_vectors}
    if not tensors:
        (Path(out) / SIDECAR).unlink(missing_ok=True)
        return 0
    from safetensors.torch import save_file

    target = Path(out) / SIDECAR
    tmp = target.with_name(f".{SIDECAR}.partial")
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target.stat().st_size


def read(path: Path | str) -> dict[str, torch.Tensor]:
    """The vectors of the side file ``path``, float64 (one line, :class:`normswap.errors.NormswapError`, if it
    is damaged: the header checks of :func:`normswap.checkpoint.io.read_safetensors_header`, a tensor that is
    not a 1-D float vector)."""
    header = io.read_safetensors_header(Path(path))
    for name, info in header.items():
        if name != "__metadata__" and (len(info.get("shape", [])) != 1 or info.get("dtype") not in
                                       ("F64", "F32", "F16", "BF16")):
            raise io.damaged(path, f"holds `{name}` as {info.get('dtype')} {info.get('shape')}, not a float "
                                   "vector (the adapter bases' side file was replaced or damaged)")
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        return {name: fh.get_tensor(name).double() for name in fh.keys()}  # noqa: SIM118 - not a dict


def load(plan: Plan, path: Path | str | None, where: object) -> None:
    """Put the vectors ``plan.adapter_bases`` names into ``plan.adapter_vectors``, read from the side file
    ``path`` (None: the checkpoint ``where`` has none). No adapter bases: nothing to do. No file: one warning
    (adapters on those Linears will be refused at attach). A damaged file or one that lacks a named vector:
    one line, raised."""
    names = named(plan)
    if not names:
        return
    if path is None or not Path(path).is_file():
        warnings.warn(
            f"normswap: {where} names the adapter bases of {len(plan.adapter_bases)} Linear(s) the conversion "
            f"edited but has no {SIDECAR}: the model is unaffected, and a PEFT adapter attached to one of those "
            "Linears is refused (it could not act as on the original model)",
            stacklevel=3,
        )
        return
    vectors = read(path)
    absent = sorted(names - set(vectors))
    if absent:
        more = f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""
        raise io.damaged(path, f"lacks `{absent[0]}`{more}, a vector config.json's adapter bases name")
    plan.adapter_vectors = {name: vectors[name] for name in names}
