"""mkdocs hook: replace ``<!-- generate: module:function -->`` with what the function returns.

Generated sections (the lease state diagram, the hook reference, the error table) come from the
code itself, so the docs cannot drift from it. A marker naming something that does not exist
fails the (strict) build.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

_MARKER = re.compile(r"<!--\s*generate:\s*([\w.]+):(\w+)\s*-->")


def _render(match: re.Match[str]) -> str:
    module = importlib.import_module(match.group(1))
    func = getattr(module, match.group(2))
    return str(func())


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return _MARKER.sub(_render, markdown)
