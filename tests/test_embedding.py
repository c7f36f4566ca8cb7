"""docs/embedding.md's script again, with the one-line change the page gives for NIXL
(``TRANSPORT = "nixl"``): the claim that nothing else changes is tested, not just stated. The
page's block as written runs in ``tests/test_docs_examples.py``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parent.parent / "docs" / "embedding.md"


def _script() -> str:
    blocks = re.findall(r"<!-- example -->\n```python\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) == 1
    return str(blocks[0])


def test_the_script_is_under_100_lines_and_names_its_transport_once() -> None:
    script = _script()
    assert len(script.splitlines()) < 100
    assert len(re.findall(r'^TRANSPORT = "inprocess"', script, re.M)) == 1


def test_the_script_runs_over_nixl_with_its_one_line_changed() -> None:
    pytest.importorskip("nixl_cu12", reason="the NIXL transport needs nixl-cu12")
    pytest.importorskip("kvframe_nixl", reason="the NIXL transport plugin")
    script = re.sub(r'^TRANSPORT = "inprocess"', 'TRANSPORT = "nixl"', _script(), flags=re.M)
    namespace: dict[str, object] = {"__name__": "embedding_over_nixl"}
    exec(compile(script, "docs/embedding.md (nixl)", "exec"), namespace)
    assert namespace["TRANSPORT"] == "nixl"
