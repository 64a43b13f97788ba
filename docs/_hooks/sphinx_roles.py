"""A griffe extension for the API reference: the docstrings use Sphinx roles (``:func:`patch```,
``:class:`~normswap.RMSNorm```), which Markdown would print as is; render each as inline code."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|obj|exc|const):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(lambda m: f"`{m.group(1)}`", obj.docstring.value)
