"""The C++ source of the fused CPU RMSNorm kernels, read from ``csrc/rmsnorm.cpp`` (package data).

:mod:`normswap.backends.cpu` compiles ``SOURCE`` at first use and keys its build cache on a hash of
it (with the compiler, flags and ISA), so an edited source is never served by a stale binary. Why the
kernel looks as it does is written at the top of the .cpp file.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

PATH = Path(__file__).with_name("csrc") / "rmsnorm.cpp"
SOURCE = PATH.read_text(encoding="utf-8")
SOURCE_SHA256 = hashlib.sha256(SOURCE.encode()).hexdigest()
