"""`kvframe bench pipeline --quick --json`: the output's shape (never its timings)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("nixl_cu12", reason="the benchmark pulls KV over NIXL")
pytest.importorskip("kvframe_refengine")


def test_quick_json_shape() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvframe.cli", "bench", "pipeline", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["benchmark"] == "pipeline"
    assert report["quick"] is True
    (case,) = report["cases"]
    for key in ("whole_s", "layerwise_s", "compute_s", "transfer_s", "ideal_s"):
        assert case[key] > 0
    assert case["ideal_s"] == max(case["compute_s"], case["transfer_s"])
    assert case["speedup"] == pytest.approx(case["whole_s"] / case["layerwise_s"])
    assert case["kv_bytes"] == case["prefix_tokens"] * report["model"]["kv_bytes_per_token"]
