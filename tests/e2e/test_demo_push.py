"""`kvframe demo --mode push --json`: the demo's every check in push mode.

The router sends both legs at once and P WRITEs the KV into the blocks D registered: outputs
equal a single engine's, every request's KV was pushed by P (D's loads, P's pushes and bytes
written), the leak oracle passes on both engines, and after D is killed P frees the KV it kept
for D's queue within ``kv_lease_duration``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("nixl_cu12", reason="the demo runs over NIXL")
pytest.importorskip("kvframe_refengine", reason="the demo needs contrib/kvframe-refengine")

from tests.e2e.test_demo import run_demo_json


def test_push_demo_passes_every_check() -> None:
    result = run_demo_json("--mode", "push")
    assert result["mode"] == "push"
    assert result["authenticated"] is True
    p1 = result["phase1"]
    assert p1["equal_outputs"] == p1["requests"] == 6
    assert p1["kv_loads"] == 6
    assert p1["kv_bytes_moved"] > 0
    assert "leases" not in p1
    pushes = p1["pushes"]
    assert pushes["offered"] == pushes["registered"] == pushes["done"] == 6
    assert pushes["failed"] == pushes["unsent"] == 0
    p2 = result["phase2"]
    assert p2["kv_held_at_kill"] > 0
    # every request whose KV P kept at the kill ended on P: never registered, or a failed push
    assert p2["unsent"] + p2["failed"] >= p2["kv_held_at_kill"]
    assert p2["freed_after_kill_s"] <= p2["freed_bound_s"] + 1.0
    assert p2["freed_bound_s"] == result["lease_duration_s"]


def test_a_bad_mode_is_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    from kvframe_refengine.demo import main

    assert main(["--mode", "pushy"]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == "kvframe demo: --mode pushy: expected one of pull, push"
    assert out == ""
