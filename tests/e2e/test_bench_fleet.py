"""`kvframe bench fleet --quick --json`: the output's shape (a real etcd and 2 P + 2 D started
by the benchmark; ~15 s). The figures themselves are not asserted (timings on a shared
machine), only that every arm served every request and the ratios are the arms' own."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(240)


def test_bench_fleet_quick_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvframe.cli", "bench", "fleet", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert report["benchmark"] == "fleet"
    assert report["quick"] is True
    arms = report["arms"]
    assert list(arms) == ["1P+1D", "2P+2D round_robin", "2P+2D prefix"]
    for arm in arms.values():
        assert arm["requests"] == report["config"]["requests"] * report["config"]["rounds"]
        assert 0.0 <= arm["hit_rate"] < 1.0
        assert 0 < arm["median_ttft_s"] <= arm["p90_ttft_s"]
    r = report["ratios"]
    pre, rr = arms["2P+2D prefix"], arms["2P+2D round_robin"]
    assert math.isclose(
        r["prefix_over_round_robin_mean_ttft"], pre["mean_ttft_s"] / rr["mean_ttft_s"]
    )
    # A quick run's workload shares prefixes: some prompt tokens were served from P's cache.
    assert max(a["hit_rate"] for a in arms.values()) > 0
