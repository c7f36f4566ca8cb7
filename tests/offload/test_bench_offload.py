"""``kvframe bench offload --quick --json``: the report's shape (never its timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvframe.cli import main


def test_quick_json_report_has_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "offload", "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["benchmark"] == "offload"
    assert report["params"]["quick"] is True
    r = report["results"]
    figures = [
        r["cpu"]["store_gbps"],
        r["cpu"]["load_gbps"],
        r["disk"]["write_gbps"],
        r["disk"]["read_gbps"],
        *r["baselines"].values(),
        r["store_engine_thread_us"],
        r["store_copy_out_ms"],
        r["step_store_engine_thread_us"],
        r["lookup_us_per_block"],
    ]
    assert set(r["baselines"]) == {"memcpy_gbps", "pwrite_gbps", "pread_gbps"}
    assert set(r["comparisons"]) == {
        "cpu_store",
        "cpu_load",
        "disk_write",
        "disk_write_full",
        "disk_write_full_reuse",
        "disk_write_full_unspared",
        "disk_read",
        "disk_read_2t",
    }
    for c in r["comparisons"].values():
        figures += [c["gbps"], c["p90_gbps"], c["ref_gbps"], c["ref_p90_gbps"], c["ratio"]]
        assert c["ratio"] == pytest.approx(c["gbps"] / c["ref_gbps"])
    # The bars of issue 18, each against its reference in the same run.
    bars = {name: c["bar"] for name, c in r["comparisons"].items() if c["bar"] is not None}
    assert bars == {"cpu_store": 0.9, "disk_write": 0.9, "disk_write_full": 0.9, "disk_read": 0.8}
    # The three rows at capacity share the tier's side; the reuse row's reference is another.
    full = r["comparisons"]["disk_write_full"]
    assert r["comparisons"]["disk_write_full_reuse"]["gbps"] == full["gbps"]
    assert r["comparisons"]["disk_write_full_unspared"]["ref_gbps"] == full["ref_gbps"]
    assert r["disk"]["read_gbps"] == r["comparisons"]["disk_read"]["gbps"]
    assert r["baselines"]["pread_gbps"] == r["comparisons"]["disk_read"]["ref_gbps"]
    od = r["o_direct"]
    assert isinstance(od["note"], str)
    assert (od["pwrite_gbps"] is None) == (od["pread_gbps"] is None)
    assert isinstance(report["params"]["filesystem"], str)
    assert all(isinstance(f, float) and f > 0 for f in figures)
    assert set(r["hit_rates"]) == {"lru", "arc"}
    assert all(0.0 <= v <= 1.0 for v in r["hit_rates"].values())


def test_bad_option_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "offload", "--blocks", "0"]) == 2
    assert "--blocks = 0" in capsys.readouterr().err


def test_human_report_prints_each_tier_beside_its_reference(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["bench", "offload", "--quick", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"disk files in {tmp_path}" in out
    for side, ref in [
        ("cpu tier store", "memcpy"),
        ("disk tier write, new file", "os.pwrite, new file"),
        ("disk tier full: evict+write", "unlink old, pwrite new file"),
        ("disk tier read (verified)", "os.pread"),
    ]:
        line = next(x for x in out.splitlines() if x.startswith(side))
        assert ref in line
        assert "ratio" not in line
    assert "O_DIRECT" in out
    assert not list(tmp_path.iterdir())  # the benchmark's files are gone


def test_a_missing_dir_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["bench", "offload", "--dir", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
