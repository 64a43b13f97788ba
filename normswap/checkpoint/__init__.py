"""Checkpoint IO: convert a model on disk, save a converted model, load it back.

* :func:`convert` - model id / local directory / preset -> converted checkpoint directory.
* :func:`save` - an in-memory converted model -> checkpoint directory (``native`` or ``compat``).
* :func:`load` - checkpoint directory -> model (native ones rebuilt from their manifest).
* :func:`register` - make ``AutoModel*`` understand ``normswap_<base>`` for one base type
  (``import normswap`` already does this lazily for every base type:
  :mod:`normswap.integrations.auto_registry`).

See ``normswap.checkpoint.streaming`` for the low-memory path used on checkpoints larger than RAM.
"""

from normswap.checkpoint.hf import register
from normswap.checkpoint.reader import load
from normswap.checkpoint.writer import save
from normswap.options import FORMATS


def convert(model_id_or_path, out_dir, *, format=None, **options):  # noqa: A002, ANN001, ANN201
    """Convert a model (Hub id, local directory or preset name) into ``out_dir``; see
    :func:`normswap.checkpoint.conversion.convert`."""
    from normswap.checkpoint.conversion import convert as _convert

    return _convert(model_id_or_path, out_dir, format=format, **options)


__all__ = ["FORMATS", "convert", "load", "register", "save"]
