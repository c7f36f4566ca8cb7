"""The demo end to end over UCX, pull and push: the same checks as over NIXL (outputs equal a
single engine's, every request's KV came from P, the leak oracle on both engines), with the
kill phase in push mode (P frees the KV it kept for a dead D within ``kv_lease_duration``).

The demo's engines are processes of their own, so ucxx never loads into this test process
(where it would break NIXL: see tests/ucx/test_ucx_isolated.py).
"""

from __future__ import annotations

import importlib.util
import sys

import pytest

pytest.importorskip("kvframe_refengine", reason="the demo needs contrib/kvframe-refengine")
if importlib.util.find_spec("ucxx") is None or importlib.util.find_spec("kvframe_ucx") is None:
    pytest.skip("the UCX demo needs ucxx-cu12 and plugins/kvframe-ucx", allow_module_level=True)

from tests.e2e.test_demo import run_demo_json

pytestmark = pytest.mark.ucx


def test_pull_demo_over_ucx() -> None:
    result = run_demo_json("--transport", "ucx", "--no-kill")
    assert (result["mode"], result["transport"]) == ("pull", "ucx")
    p1 = result["phase1"]
    assert p1["equal_outputs"] == p1["requests"] == p1["kv_loads"] == 6
    assert p1["leases"]["consumed"] == 6
    assert "ucxx" not in sys.modules


def test_push_demo_over_ucx() -> None:
    result = run_demo_json("--transport", "ucx", "--mode", "push")
    assert (result["mode"], result["transport"]) == ("push", "ucx")
    p1 = result["phase1"]
    assert p1["equal_outputs"] == p1["requests"] == p1["kv_loads"] == 6
    assert p1["pushes"]["done"] == 6
    assert p1["pushes"]["failed"] == p1["pushes"]["unsent"] == 0
    p2 = result["phase2"]
    assert p2["unsent"] + p2["failed"] >= p2["kv_held_at_kill"] > 0
    assert p2["freed_after_kill_s"] <= p2["freed_bound_s"] + 1.0
