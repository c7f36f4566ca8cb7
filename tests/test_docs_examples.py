"""Every example marked ``<!-- example -->`` in ``docs/`` runs as written.

A marked ``python`` block is executed as a module; one whose first line names a file
(``# kvframe_pushpull/plugin.py``) is importable under that name by the page's later blocks,
so a page can show a plugin and then the test that builds it. The blocks of a page run in
order. A marked ``json`` block is a connector configuration and must parse
(:meth:`KVTransferConfig.from_dict <kvframe.config.KVTransferConfig.from_dict>`).
"""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import pytest

from kvframe.config import KVTransferConfig

DOCS = Path(__file__).resolve().parent.parent / "docs"
_EXAMPLE = re.compile(r"<!-- example -->\n```(\w+)\n(.*?)```", re.S)
_FILE = re.compile(r"# ([A-Za-z_][\w/]*)\.py")

#: Pages whose examples are the contract they document: each must keep at least one.
PAGES_WITH_EXAMPLES = ("connectors.md", "embedding.md", "multi.md", "writing-plugins.md")


def _examples(page: str) -> list[tuple[str, str]]:
    return _EXAMPLE.findall((DOCS / page).read_text())


def _pages() -> list[str]:
    return sorted(p.name for p in DOCS.glob("*.md") if _examples(p.name))


def _module(name: str, created: list[str]) -> types.ModuleType:
    parts = name.split(".")
    for i in range(1, len(parts)):
        parent = ".".join(parts[:i])
        if parent not in sys.modules:
            package = types.ModuleType(parent)
            package.__path__ = []
            sys.modules[parent] = package
            created.append(parent)
    module = types.ModuleType(name)
    sys.modules[name] = module
    created.append(name)
    if len(parts) > 1:
        setattr(sys.modules[".".join(parts[:-1])], parts[-1], module)
    return module


def test_the_pages_that_document_contracts_have_examples() -> None:
    assert set(PAGES_WITH_EXAMPLES) <= set(_pages())


@pytest.mark.parametrize("page", _pages())
def test_the_examples_on_the_page_run(page: str) -> None:
    created: list[str] = []
    try:
        for i, (lang, code) in enumerate(_examples(page)):
            where = f"docs/{page}, example {i}"
            if lang == "json":
                KVTransferConfig.from_dict(json.loads(code))
                continue
            assert lang == "python", f"{where}: cannot run a {lang!r} block"
            named = _FILE.fullmatch(code.splitlines()[0])
            name = named.group(1).replace("/", ".") if named else f"_docs_example_{i}"
            module = _module(name, created)
            exec(compile(code, where, "exec"), module.__dict__)
    finally:
        for name in created:
            sys.modules.pop(name, None)
