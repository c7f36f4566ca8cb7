"""``kvframe demo --fleet``: 2 P + 2 D + router on a real etcd started by the demo, one P and
one D SIGKILLed under load; every check passes (~20-30 s)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(240)


def test_fleet_demo_passes_every_check() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvframe.cli", "demo", "--fleet", "--json", "--load", "16"],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert all(result["checks"].values()), result["checks"]
    assert result["ok"]
    p2 = result["phase2"]
    assert p2["served"] + p2["failed_by_policy"] == p2["requests"] == 16
    assert p2["killed"] == ["fleet-P0", "fleet-D0"]
    assert p2["etcd_vanished_after_s"] <= result["registration_ttl_s"] + 1.0
    assert result["phase3"]["withdrawn_after_s"] < 1.0


def test_a_ttl_that_accelerates_nothing_is_refused() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvframe.cli", "demo", "--fleet", "--ttl", "5", "--lease", "6"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "--ttl 5" in proc.stderr
