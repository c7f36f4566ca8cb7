"""The architecture's import rules, enforced.

- ``kvframe.core`` imports only the standard library, attrs and itself.
- ``kvframe.core``, ``kvframe.spi`` and ``kvframe.protocol`` import nothing from the runtime
  shell, the transports, the connectors, plugins or contrib.
- The core never reads a clock, sleeps, starts threads, opens sockets or logs.
- ``kvframe.errors`` is the bottom layer: it imports only the standard library.
- Plugins (``plugins/``) and engine adapters (``contrib/``) use kvframe's public names only.

Relative imports are resolved before checking, so ``from ..runtime import x`` cannot slip by.
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
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            out.append(_resolve_relative(path, node.level, node.module))
    return out


def _resolve_relative(path: Path, level: int, module: str | None) -> str:
    # The package containing the file (for ``pkg/__init__.py`` that is ``pkg`` itself).
    package = list(path.relative_to(ROOT).with_suffix("").parts)[:-1]
    base = package[: len(package) - (level - 1)] if level > 1 else package
    return ".".join([*base, module] if module else base)


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


def test_relative_imports_are_resolved() -> None:
    assert _resolve_relative(PKG / "spi" / "hookspecs.py", 2, "runtime") == "kvframe.runtime"
    assert _resolve_relative(PKG / "spi" / "__init__.py", 1, "transport") == (
        "kvframe.spi.transport"
    )


def test_errors_module_imports_only_the_standard_library() -> None:
    for name in _imports(PKG / "errors.py"):
        assert name.split(".")[0] in STDLIB, f"kvframe/errors.py imports {name}"


@pytest.mark.parametrize(
    "path", _files("core") + _files("spi") + _files("protocol"), ids=lambda p: p.name
)
def test_contracts_do_not_import_the_shell(path: Path) -> None:
    for name in _imports(path):
        assert not name.startswith(SHELL), f"{path} imports {name} from the runtime shell"


def _outside_files() -> list[Path]:
    return sorted(
        p
        for top in ("plugins", "contrib")
        for p in (ROOT / top).rglob("*.py")
        if not {"__pycache__", "build", ".venv"} & set(p.parts)
    )


@pytest.mark.parametrize("path", _outside_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_and_contrib_use_public_names_only(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [(node.module, [a.name for a in node.names])]
        else:
            continue
        for module, names in modules:
            if module.split(".")[0] != "kvframe":
                continue
            private = [p for p in module.split(".") if p.startswith("_")]
            private += [n for n in names if n.startswith("_")]
            assert not private, f"{path} imports private kvframe name(s) {private} from {module}"
