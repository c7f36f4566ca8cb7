"""Tests about the code base itself: hooks, docs, tests and the public surface stay in step.

- Every hookspec is documented (its arguments, return, when it is called, an example), has a
  section in the generated hook reference, and is exercised by at least one test.
- Every public module under ``kvframe/`` has a docstring and an explicit ``__all__`` whose names
  exist and are documented; public-looking top-level classes and functions not in ``__all__``
  are flagged.
- Every error class is in the generated error table and says what is left usable after it.
- Every ``<!-- generate: ... -->`` marker in ``docs/`` names a function that returns markdown.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvframe import errors
from kvframe.runtime import docgen
from kvframe.spi import hookspecs

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "kvframe"
TESTS = ROOT / "tests"

# -- hooks ----------------------------------------------------------------------------------

HOOKS = hookspecs.hookspec_names()
SECTIONS = ("Arguments:", "Returns:", "When it is called:", "Example:")


def test_hookspec_names_cover_every_hookspec_in_the_module() -> None:
    marked = {
        name
        for name, obj in vars(hookspecs).items()
        if callable(obj) and hasattr(obj, f"{hookspecs.PROJECT_NAME}_spec")
    }
    assert set(HOOKS) == marked
    assert all(name.startswith("kvframe_") for name in HOOKS)


@pytest.mark.parametrize("name", HOOKS)
def test_hookspec_is_documented(name: str) -> None:
    fn = getattr(hookspecs, name)
    doc = inspect.getdoc(fn) or ""
    for section in SECTIONS:
        assert f"\n{section}\n" in doc, f"{name}: docstring lacks a {section!r} section"
    arguments = doc.split("Arguments:\n", 1)[1].split("\n\n", 1)[0]
    for param in inspect.signature(fn).parameters:
        assert re.search(rf"^\s+{param}:", arguments, re.M), f"{name}: {param} undocumented"
    assert re.fullmatch(r"\d+\.\d+\.\d+", hookspecs.hookspec_since(name))


@pytest.mark.parametrize("name", HOOKS)
def test_hookspec_has_a_section_in_the_generated_reference(name: str) -> None:
    reference = hookspecs.hook_reference()
    section = reference.split(f"### `{name}`\n", 1)
    assert len(section) == 2, f"{name} has no section in the hook reference"
    body = section[1].split("\n### ", 1)[0]
    assert f"def {name}(" in body
    assert "Since kvframe" in body
    assert "**Example**" in body


def _test_sources() -> dict[Path, str]:
    return {
        p: p.read_text()
        for p in TESTS.rglob("*.py")
        if p.name != Path(__file__).name and "__pycache__" not in p.parts
    }


@pytest.mark.parametrize("name", HOOKS)
def test_hookspec_is_exercised_by_a_test(name: str) -> None:
    users = [p for p, text in _test_sources().items() if name in text]
    assert users, f"no test under tests/ mentions {name}; add one that implements it"


def test_hook_reference_is_embedded_in_the_docs() -> None:
    text = (ROOT / "docs" / "plugins.md").read_text()
    assert "<!-- generate: kvframe.spi.hookspecs:hook_reference -->" in text


# -- the public surface ---------------------------------------------------------------------


def _public_modules() -> list[str]:
    out = []
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if any(p.startswith("_") for p in parts):
            continue
        out.append(".".join(parts))
    return out


def _module_path(module: str) -> Path:
    base = ROOT.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _assignments(path: Path) -> tuple[set[str], set[str]]:
    """Top-level names assigned in the file, and those of them assigned with a ``#:`` comment
    above or a string literal below (the two ways Sphinx and mkdocstrings document a value)."""
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    assigned: set[str] = set()
    out: set[str] = set()
    for i, node in enumerate(tree.body):
        if not isinstance(node, ast.Assign | ast.AnnAssign):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        assigned.update(names)
        above = lines[node.lineno - 2].strip() if node.lineno >= 2 else ""
        nxt = tree.body[i + 1] if i + 1 < len(tree.body) else None
        below = (
            isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        )
        if above.startswith("#:") or below:
            out.update(names)
    return assigned, out


def _top_level_defs(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    ]


# Methods whose name says it all and that nobody calls directly: pytest test methods (in the
# conformance kit) and Hypothesis rules and invariants (in state machines).
_SELF_DESCRIBING = (
    "hypothesis_stateful_rule",
    "hypothesis_stateful_initialize_rule",
    "hypothesis_stateful_invariant",
)


def _undocumented_members(name: str, cls: type) -> list[str]:
    """Public methods and properties defined on ``cls`` without a docstring. An override
    counts as documented when the method it overrides is (its contract is the base's)."""
    out = []
    for attr, member in vars(cls).items():
        if attr.startswith(("_", "test")):
            continue
        func = member.__func__ if isinstance(member, classmethod | staticmethod) else member
        if not (inspect.isfunction(func) or isinstance(func, property)):
            continue
        if any(hasattr(func, marker) for marker in _SELF_DESCRIBING):
            continue
        if not inspect.getdoc(getattr(cls, attr)):
            out.append(f"{name}.{attr} has no docstring")
    return out


def _surface_problems(module: str, path: Path | None = None) -> list[str]:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:
        return [f"does not import: {type(exc).__name__}: {exc}"]
    problems = []
    if not (mod.__doc__ or "").strip():
        problems.append("no module docstring")
    names = vars(mod).get("__all__")
    if names is None:
        return [*problems, "no __all__"]
    path = path or _module_path(module)
    assigned, documented = _assignments(path)
    for name in names:
        if name.startswith("__"):
            continue
        try:
            obj = getattr(mod, name)
        except AttributeError:
            problems.append(f"{name} is in __all__ but does not exist")
            continue
        if isinstance(obj, type | ModuleType) or inspect.isroutine(obj):
            if not (obj.__doc__ or "").strip():
                problems.append(f"{name} has no docstring")
            if isinstance(obj, type) and obj.__module__ == module:
                problems.extend(_undocumented_members(name, obj))
        elif name in assigned and name not in documented:
            # Values (constants, markers) are documented where they are assigned; re-exported
            # ones are checked in their own module.
            problems.append(f"{name} is undocumented (add a #: comment or a docstring below)")
    if len(set(names)) != len(names):
        problems.append("__all__ lists a name twice")
    listed = set(names)
    for name in _top_level_defs(path):
        if not name.startswith("_") and name not in listed:
            problems.append(f"{name} looks public but is not in __all__ (add it or prefix _)")
    return sorted(set(problems))


# Gaps in other engineers' modules that existed when this test was written, with their owners
# noted in the lead's tracker. The list may only shrink: an entry that no longer fails must be
# removed (test_known_surface_gaps_still_exist), so a fixed module cannot regress unnoticed.
KNOWN_SURFACE_GAPS: dict[str, set[str]] = {}


@pytest.mark.parametrize("module", _public_modules())
def test_public_module_has_an_accurate_documented_all(module: str) -> None:
    problems = set(_surface_problems(module)) - KNOWN_SURFACE_GAPS.get(module, set())
    assert not problems, f"{module}:\n" + "\n".join(sorted(problems))


def test_known_surface_gaps_still_exist() -> None:
    fixed = {
        (module, problem)
        for module, problems in KNOWN_SURFACE_GAPS.items()
        for problem in problems
        if problem not in _surface_problems(module)
    }
    assert not fixed, f"fixed now; remove from KNOWN_SURFACE_GAPS: {sorted(fixed)}"


def test_surface_check_catches_what_it_claims(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The checker itself must fail on a bad module; otherwise the test above proves nothing.
    pkg = tmp_path / "meta_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text('"""Probe."""\n__all__ = []\n')
    (pkg / "bad.py").write_text(
        '"""A module with every mistake."""\n'
        '__all__ = ["missing", "undocumented", "LIMIT", "Thing", "LIMIT"]\n'
        "LIMIT = 3\n"
        "def undocumented():\n    pass\n"
        "def forgotten():\n    '''Public but not listed.'''\n"
        "class Thing:\n    '''A thing.'''\n    def act(self):\n        pass\n"
    )
    (pkg / "good.py").write_text(
        '"""Fine."""\n__all__ = ["LIMIT", "f", "Base", "Sub"]\n#: The limit.\nLIMIT = 3\n'
        "def f():\n    '''Does f.'''\n"
        "class Base:\n    '''Base.'''\n    def act(self):\n        '''Acts.'''\n"
        "class Sub(Base):\n    '''Sub.'''\n    def act(self):\n        pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        bad = _surface_problems("meta_probe_pkg.bad", pkg / "bad.py")
        good = _surface_problems("meta_probe_pkg.good", pkg / "good.py")
    finally:
        for name in [m for m in sys.modules if m.startswith("meta_probe_pkg")]:
            del sys.modules[name]
    assert good == []
    assert sorted(bad) == sorted(
        [
            "missing is in __all__ but does not exist",
            "undocumented has no docstring",
            "LIMIT is undocumented (add a #: comment or a docstring below)",
            "forgotten looks public but is not in __all__ (add it or prefix _)",
            "Thing.act has no docstring",
            "__all__ lists a name twice",
        ]
    )


# -- errors ---------------------------------------------------------------------------------

ERROR_CLASSES = [
    name
    for name, obj in vars(errors).items()
    if isinstance(obj, type) and issubclass(obj, errors.KVFrameError)
]


def test_every_error_class_is_public() -> None:
    assert set(ERROR_CLASSES) == set(errors.__all__)


@pytest.mark.parametrize("name", ERROR_CLASSES)
def test_error_is_in_the_table_and_says_what_is_left(name: str) -> None:
    table = docgen.error_table()
    assert f"| `{name}` |" in table
    (doc,) = [d for d in docgen.error_docs() if d.name == name]
    assert doc.raised_when
    if name != "KVFrameError":
        assert doc.states_what_is_left, (
            f"{name}'s docstring (or an ancestor's) must say what is left usable after it"
        )


def test_error_table_is_embedded_in_the_docs() -> None:
    text = (ROOT / "docs" / "errors.md").read_text()
    assert "<!-- generate: kvframe.runtime.docgen:error_table -->" in text


# -- docs markers ---------------------------------------------------------------------------

_MARKER = re.compile(r"<!--\s*generate:\s*([\w.]+):(\w+)\s*-->")
MARKERS = sorted(
    {m.groups() for p in (ROOT / "docs").rglob("*.md") for m in _MARKER.finditer(p.read_text())}
)


@pytest.mark.parametrize(("module", "func"), MARKERS, ids=[f"{m}:{f}" for m, f in MARKERS])
def test_docs_generators_return_markdown(module: str, func: str) -> None:
    text = getattr(importlib.import_module(module), func)()
    assert isinstance(text, str)
    assert text.strip()
