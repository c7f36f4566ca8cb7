"""The architecture's import rules, enforced.

- Every module of kvframe belongs to one of the units in :data:`LAYERS` (its packages, plus
  ``config``, ``errors``, ``cli`` and the root package), and a unit imports only units on
  *lower* layers: nothing upwards, nothing sideways within a layer. So no two of kvframe's
  packages import each other, in any number of steps (``test_no_import_cycles`` finds the
  cycles themselves, naming every edge).
- An import is any ``import`` statement — at module level, inside a function (lazy) or under
  ``if TYPE_CHECKING:`` — and any string constant that names a kvframe module (what
  ``importlib.import_module`` gets: the plugin host's built-ins, the command's benchmarks).
  Relative imports are resolved first, so ``from ..runtime import x`` cannot slip by.
- ``kvframe.core`` imports only the standard library, attrs, numpy (arrays for the lease
  table's bulk paths: computation, no I/O, and already a kvframe dependency) and itself (and
  ``kvframe.errors``); it never reads a clock, sleeps, starts threads, opens sockets or logs.
- ``kvframe.errors`` is the bottom layer: it imports only the standard library.
- Plugins (``plugins/``) and engine adapters (``contrib/``) use kvframe's public names only.

``docs/architecture.md`` shows the same layers in a table; a test keeps the two equal.
"""

from __future__ import annotations

import ast
import itertools
import re
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


#: kvframe's units from the bottom layer up. A unit is a subpackage or a top-level module of
#: ``kvframe`` (``"kvframe"`` is the root package itself: ``__version__``); it may import only
#: units on lower layers. Written out in ``docs/architecture.md`` as well.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("kvframe", "core"),
    ("config",),
    ("protocol",),
    ("spi",),
    ("transports", "connectors", "discovery"),
    ("runtime",),
    ("testing", "bench"),
    ("cli",),
)

#: Imports that break the layers today, each with why and who removes it. The list may only
#: shrink: an entry that no longer occurs fails ``test_known_layer_breaks_still_exist``.
KNOWN_LAYER_BREAKS: dict[tuple[str, str], str] = {}

_MODULES = {
    ".".join(p.relative_to(ROOT).with_suffix("").parts[: -1 if p.name == "__init__.py" else None])
    for p in PKG.rglob("*.py")
}


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            out.add(id(body[0].value))
    return out


def _imports(path: Path) -> list[str]:
    """Every kvframe or third-party module ``path`` imports, anywhere in it (see the module
    docstring), relative imports resolved; ``from kvframe import errors`` counts as
    ``kvframe.errors``."""
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = _resolve_relative(path, node.level, node.module) if node.level else node.module
            if module is None:
                continue
            out.append(module)
            out.extend(f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in _MODULES)
        elif isinstance(node, ast.Constant) and node.value in _MODULES and id(node) not in docs:
            out.append(str(node.value))
    return out


def _unit(module: str) -> str | None:
    """The unit of a kvframe module name (``kvframe.spi.request`` -> ``spi``), else None."""
    parts = module.split(".")
    if parts[0] != "kvframe":
        return None
    return parts[1] if len(parts) > 1 else "kvframe"


def _unit_of_file(path: Path) -> str:
    parts = path.relative_to(PKG).with_suffix("").parts
    return "kvframe" if parts == ("__init__",) else parts[0]


_LAYER = {unit: i for i, units in enumerate(LAYERS) for unit in units}


def _edges() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> where, for every import between two units."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        src = _unit_of_file(path)
        for module in _imports(path):
            dst = _unit(module)
            if dst is None or dst == src or (rel, module) in KNOWN_LAYER_BREAKS:
                continue
            edges.setdefault((src, dst), []).append(f"{rel} imports {module}")
    return edges


def _resolve_relative(path: Path, level: int, module: str | None) -> str:
    # The package containing the file (for ``pkg/__init__.py`` that is ``pkg`` itself).
    package = list(path.relative_to(ROOT).with_suffix("").parts)[:-1]
    base = package[: len(package) - (level - 1)] if level > 1 else package
    return ".".join([*base, module] if module else base)


def _files(sub: str) -> list[Path]:
    return sorted((PKG / sub).rglob("*.py"))


@pytest.mark.parametrize("path", _files("core"), ids=lambda p: p.name)
def test_core_imports_only_stdlib_attrs_numpy_and_core(path: Path) -> None:
    for name in _imports(path):
        top = name.split(".")[0]
        if name.startswith("kvframe"):
            assert name.startswith(("kvframe.core", "kvframe.errors")), f"{path}: {name}"
        else:
            assert top in STDLIB or top in ("attrs", "numpy"), f"{path} imports {name}"
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


def test_every_unit_is_on_a_layer() -> None:
    units = {_unit_of_file(p) for p in PKG.rglob("*.py")}
    assert units == set(_LAYER), (
        f"not on a layer: {sorted(units - set(_LAYER))}; "
        f"on a layer but gone: {sorted(set(_LAYER) - units)} (edit LAYERS and "
        "docs/architecture.md)"
    )
    assert len(_LAYER) == sum(len(units) for units in LAYERS), "a unit is on two layers"


def test_units_import_only_lower_layers() -> None:
    wrong = [
        f"{src} (layer {_LAYER[src]}) -> {dst} (layer {_LAYER[dst]}): {where[0]}"
        for (src, dst), where in sorted(_edges().items())
        if _LAYER[dst] >= _LAYER[src]
    ]
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def _cycles(edges: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """One cycle through each strongly connected group of units (Tarjan), as unit lists."""
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, set()).add(dst)
        graph.setdefault(dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for group in groups:
        # The shortest way from the group's first unit back to it (breadth first).
        start, members = group[0], set(group)
        prev: dict[str, str] = {}
        queue, last = [start], None
        while last is None:
            v = queue.pop(0)
            for w in sorted(graph[v] & members):
                if w == start:
                    last = v
                    break
                if w not in prev:
                    prev[w] = v
                    queue.append(w)
        back = []
        while last != start:
            back.append(last)
            last = prev[last]
        out.append([start, *reversed(back), start])
    return out


def test_no_import_cycles() -> None:
    edges = _edges()
    found = [
        " -> ".join(cycle)
        + "\n"
        + "\n".join(f"    {edges[(a, b)][0]}" for a, b in itertools.pairwise(cycle))
        for cycle in _cycles(edges)
    ]
    assert not found, "import cycles between kvframe's units:\n" + "\n".join(found)


def test_the_cycle_finder_finds_cycles() -> None:
    # The test above proves nothing unless the finder sees a cycle, a long one included.
    edge = ["x"]
    assert _cycles({("a", "b"): edge, ("b", "a"): edge}) == [["a", "b", "a"]]
    assert _cycles({("a", "b"): edge, ("b", "c"): edge, ("c", "a"): edge, ("c", "d"): edge}) == [
        ["a", "b", "c", "a"]
    ]
    assert _cycles({("a", "b"): edge, ("b", "c"): edge}) == []


def test_lazy_type_only_and_dynamic_imports_count(tmp_path: Path) -> None:
    src = tmp_path / "probe.py"
    src.write_text(
        '"""kvframe.cli is named in this docstring only."""\n'
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvframe.runtime.plugins import PluginHost\n"
        "def f():\n    import kvframe.connectors.multi\n"
        'BUILTINS = ("kvframe.transports.inprocess", "not kvframe.bench")\n'
        "from kvframe import errors\n"
    )
    got = set(_imports(src))
    assert {
        "kvframe.runtime.plugins",
        "kvframe.connectors.multi",
        "kvframe.transports.inprocess",
        "kvframe.errors",
    } <= got
    assert "kvframe.cli" not in got


def test_known_layer_breaks_still_exist() -> None:
    gone = [
        (path, module) for path, module in KNOWN_LAYER_BREAKS if module not in _imports(ROOT / path)
    ]
    assert not gone, f"fixed now; remove from KNOWN_LAYER_BREAKS: {gone}"


def test_the_docs_show_the_same_layers() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| (\d+) \| ([^|]+) \|", text, re.M)
    documented = tuple(
        tuple(
            "kvframe" if name == "kvframe" else name.removeprefix("kvframe.")
            for name in re.findall(r"`([\w.]+)`", packages)
        )
        for _, packages in rows
    )
    assert [int(n) for n, _ in rows] == list(range(len(LAYERS)))
    assert documented == LAYERS


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
