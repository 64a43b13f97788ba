"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def onnx_exports(tmp_path_factory):
    """The tiny converted models and their ONNX exports, each made once a process
    (``tests.integrations.compat.OnnxExports``), for the ONNX test files."""
    from tests.integrations.compat import OnnxExports

    return OnnxExports(tmp_path_factory.mktemp("onnx-exports"))
