"""The README's first command, end to end: `kvframe demo --json`.

Three processes (prefill engine, decode engine, router) on loopback over real NIXL: outputs
equal a single engine's, the leak oracle passes on both engines, and after D is killed P
reclaims its leased blocks by the lease rules.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("nixl_cu12", reason="the demo runs over NIXL")
pytest.importorskip("kvframe_refengine", reason="the demo needs contrib/kvframe-refengine")


def run_demo_json(*args: str) -> dict[str, Any]:
    """`kvframe demo --json --prompts 6 --lease 3 ARGS`; asserts every check passed and the
    exit status is 0, and returns the result."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvframe.cli", "demo", "--json", "--prompts", "6", "--lease", "3",
         *args],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(proc.stdout)
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed, json.dumps(result, indent=1)
    assert proc.returncode == 0
    return result


def test_demo_passes_every_check() -> None:
    result = run_demo_json()
    assert result["mode"] == "pull"
    assert result["authenticated"] is True  # a fresh fleet key by default
    p1 = result["phase1"]
    assert p1["equal_outputs"] == p1["requests"] == 6
    assert p1["kv_loads"] == 6
    assert p1["kv_bytes_moved"] > 0
    assert p1["leases"]["consumed"] == 6
    p2 = result["phase2"]
    assert p2["leases_held_at_kill"] > 0
    assert p2["expired"] >= p2["leases_held_at_kill"]
    assert p2["reclaim_after_kill_s"] <= p2["reclaim_bound_s"] + 1.0


def test_no_auth_and_a_key_file_exclude_each_other() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvframe.cli", "demo", "--no-auth", "--auth-key-file", "k"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--no-auth and --auth-key-file exclude each other" in proc.stderr


def test_demo_at_tensor_parallel_2_passes_every_check() -> None:
    """``--tp-size 2``: both engines run two worker processes each (KV heads split); P's
    worker ranks serve D's same ranks; killing D's server kills its workers (they see their
    engine's socket close), and P reclaims by the lease rules."""
    result = run_demo_json("--tp-size", "2")
    assert result["tp_size"] == 2
    p1 = result["phase1"]
    assert p1["equal_outputs"] == p1["requests"] == 6
    assert p1["kv_loads"] == 6  # per request: each of D's two ranks loaded its heads
    p2 = result["phase2"]
    assert p2["leases_held_at_kill"] > 0
    assert p2["reclaim_after_kill_s"] <= p2["reclaim_bound_s"] + 1.0
