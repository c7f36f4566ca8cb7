"""docs/reference-engine.md quotes the engine's code: every quoted excerpt must still be there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reference-engine.md"
PKG = ROOT / "contrib" / "kvframe-refengine"
_BLOCK = re.compile(r"```python\n# from (kvframe_refengine/\w+\.py)\n(.*?)```", re.S)


def _excerpts() -> list[tuple[str, str]]:
    return _BLOCK.findall(DOC.read_text())


def test_the_page_quotes_every_file_it_explains() -> None:
    files = {f for f, _ in _excerpts()}
    assert files >= {
        "kvframe_refengine/engine.py",
        "kvframe_refengine/scheduler.py",
        "kvframe_refengine/runner.py",
        "kvframe_refengine/model.py",
    }


def _normal(code: str) -> str:
    # Whitespace-blind and trailing-comma-blind: ruff formats the page's code blocks at top
    # level, so an excerpt may be wrapped differently than in its indented original.
    flat = re.sub(r"\s+", "", code)
    return re.sub(r",([)\]}])", r"\1", flat)


@pytest.mark.parametrize(("path", "code"), _excerpts(), ids=lambda v: str(v)[:40])
def test_excerpt_is_verbatim_in_the_source(path: str, code: str) -> None:
    source = _normal((PKG / path).read_text())
    assert _normal(code) in source, f"docs/reference-engine.md quotes code not in {path}:\n{code}"
