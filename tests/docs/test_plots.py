"""The benchmark figures in the docs: drawn by ``python -m kvframe.bench.plots`` from the JSON
committed beside them, each one shown on a page.

The command runs on the committed data (Agg, a few seconds) and writes one SVG per benchmark;
each committed SVG carries the digest of the data it was drawn from, which must be the
committed data's (redraw with ``./dev run python -m kvframe.bench.plots`` after changing it).
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from kvframe.bench import plots

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PLOTS = DOCS / "assets" / "plots"
DATA = PLOTS / "data"
_DESCRIPTION = re.compile(r"<dc:description>data sha256 ([0-9a-f]{64})</dc:description>")


def _committed() -> list[str]:
    return sorted(p.stem for p in DATA.glob("*.json") if p.stem != "runs")


def test_every_benchmark_has_committed_data() -> None:
    assert _committed() == sorted(plots.FIGURES)


def test_the_command_draws_the_committed_data(tmp_path: Path) -> None:
    assert plots.main(["--data", str(DATA), "--out", str(tmp_path)]) == 0
    assert sorted(p.stem for p in tmp_path.glob("*.svg")) == _committed()
    runs = json.loads((DATA / "runs.json").read_text())
    for name in _committed():
        svg = (tmp_path / f"{name}.svg").read_text()
        ET.fromstring(svg)  # well-formed
        assert f"kvframe bench {name}" in svg
        assert "From one run of" in svg
        data = json.loads((DATA / f"{name}.json").read_text())
        assert plots.data_digest(data, runs.get(name)) in svg


@pytest.mark.parametrize("name", _committed())
def test_the_committed_figure_is_drawn_from_the_committed_data(name: str) -> None:
    svg = (PLOTS / f"{name}.svg").read_text()
    found = _DESCRIPTION.search(svg)
    assert found, f"docs/assets/plots/{name}.svg carries no data digest"
    data = json.loads((DATA / f"{name}.json").read_text())
    runs = json.loads((DATA / "runs.json").read_text())
    assert found.group(1) == plots.data_digest(data, runs.get(name)), (
        f"docs/assets/plots/{name}.svg is not drawn from data/{name}.json: "
        "./dev run python -m kvframe.bench.plots"
    )


@pytest.mark.parametrize("name", _committed())
def test_the_figure_is_shown_in_the_docs(name: str) -> None:
    pages = [p.name for p in DOCS.glob("*.md") if f"assets/plots/{name}.svg" in p.read_text()]
    assert pages, f"no page in docs/ shows assets/plots/{name}.svg"


def test_a_file_that_is_not_the_benchmarks_json_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "lease.json").write_text(json.dumps({"benchmark": "codec"}))
    assert plots.main(["--data", str(tmp_path), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "lease.json" in err
    assert "kvframe bench lease --json" in err
    (tmp_path / "lease.json").write_text(json.dumps({"benchmark": "lease", "params": {}}))
    assert plots.main(["--data", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "no 'results' in it" in capsys.readouterr().err
    lease = {"benchmark": "lease", "params": {}, "results": {}, "heartbeat": {}}
    (tmp_path / "lease.json").write_text(json.dumps(lease))
    assert plots.main(["--data", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "unexpected shape (KeyError" in capsys.readouterr().err
    (tmp_path / "lease.json").write_text("{")
    assert plots.main(["--data", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "is not JSON" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.svg"))


def test_an_empty_directory_says_how_to_make_the_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert plots.main(["--data", str(tmp_path), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "nothing to draw" in err
    assert "--json > DIR/NAME.json" in err
