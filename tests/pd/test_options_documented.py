"""Every ``kv_connector_extra_config`` key of the P/D connector has a row in docs/pd.md's
configuration table, and every row names a key the connector knows."""

from __future__ import annotations

import re
from pathlib import Path

import attrs

from kvframe.connectors.pd.options import PDOptions

DOC = Path(__file__).resolve().parents[2] / "docs" / "pd.md"


def _table_keys() -> set[str]:
    text = DOC.read_text()
    section = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(\w+)` \|", section, re.M))


def test_every_option_is_documented_and_every_documented_option_exists() -> None:
    known = {f.name for f in attrs.fields(PDOptions)} - {"keys"}  # keys: read from the file
    documented = _table_keys()
    assert known - documented == set(), "options without a row in docs/pd.md"
    assert documented - known == set(), "rows in docs/pd.md naming no option"
