"""``kvframe bench offload --quick --json``: the report's shape (never its timings)."""

from __future__ import annotations

import json

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
    assert all(isinstance(f, float) and f > 0 for f in figures)
    assert set(r["hit_rates"]) == {"lru", "arc"}
    assert all(0.0 <= v <= 1.0 for v in r["hit_rates"].values())


def test_bad_option_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "offload", "--blocks", "0"]) == 2
    assert "--blocks = 0" in capsys.readouterr().err
