"""The architecture's import rules, enforced.

- ``kvframe.core`` imports only the standard library, attrs and itself.
- ``kvframe.core``, ``kvframe.spi`` and ``kvframe.protocol`` import nothing from the runtime
  shell, the transports, the connectors, plugins or contrib.
- The core never reads a clock, sleeps, starts threads, opens sockets or logs.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "kvframe"

STDLIB = set(sys.stdlib_module_names)
SHELL = (
    "kvframe.runtime",
    "kvframe.transports",
    "kvframe.connectors",
    "kvframe.testing",
    "kvframe.cli",
    "kvframe.bench",
    "kvframe_",
)
FORBIDDEN_IN_CORE = {
    "time",
    "threading",
    "socket",
    "logging",
    "asyncio",
    "select",
    "selectors",
    "subprocess",
    "multiprocessing",
    "random",
    "datetime",
}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def _files(sub: str) -> list[Path]:
    return sorted((PKG / sub).rglob("*.py"))


@pytest.mark.parametrize("path", _files("core"), ids=lambda p: p.name)
def test_core_imports_only_stdlib_attrs_and_core(path: Path) -> None:
    for name in _imports(path):
        top = name.split(".")[0]
        if name.startswith("kvframe"):
            assert name.startswith(("kvframe.core", "kvframe.errors")), f"{path}: {name}"
        else:
            assert top in STDLIB or top == "attrs", f"{path} imports {name}"
            assert top not in FORBIDDEN_IN_CORE, f"{path} imports {name}: the core is sans-I/O"


@pytest.mark.parametrize(
    "path", _files("core") + _files("spi") + _files("protocol"), ids=lambda p: p.name
)
def test_contracts_do_not_import_the_shell(path: Path) -> None:
    for name in _imports(path):
        assert not name.startswith(SHELL), f"{path} imports {name} from the runtime shell"
