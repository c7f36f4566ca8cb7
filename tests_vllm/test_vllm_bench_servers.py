"""``kvframe bench vllm`` in its servers mode (the default), smallest configuration: both
connectors, each with two real OpenAI servers and the benchmark's proxy. Checked: the JSON's
shape, greedy outputs equal across the connectors and to the prefill server alone, the KV
bytes each request moved, every server thread's allowed CPUs reported (and kvframe's workers
left on their own core), P's blocks freed when D never comes, when D is stopped past the lease
and when D is killed (where D had not read them first). No timing is asserted.
About 2 to 5 minutes on a loaded 2-core machine (four servers start, two at a time)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(600)

STATS = {"median", "p90", "max", "n"}
KIB_PER_BLOCK = 64  # 2 layers x (K, V) x 32 tokens x 128 x float32


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvframe_vllm.bench",
            "--json",
            "--prompts",
            "2",
            "--min-prompt-tokens",
            "64",
            "--max-prompt-tokens",
            "96",
            "--decode-tokens",
            "4",
            "--idle-window",
            "1",
            "--lease",
            "6",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=560,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def test_the_report_has_every_figure_for_both_connectors(report: dict[str, Any]) -> None:
    assert report["benchmark"] == "vllm"
    assert report["mode"] == "servers"
    assert report["params"]["lease"] == 6
    assert set(report["results"]) == {"nixl", "kvframe"}
    for name, r in report["results"].items():
        for key in ("client_ttft_ms", "proxy_prefill_ms", "vllm_ttft_ms", "kv_transfer_ms"):
            assert set(r[key]) == STATS, (name, key)
            assert r[key]["n"] == 2, (name, key)
            assert 0 < r[key]["median"] <= r[key]["p90"] <= r[key]["max"], (name, key)
        assert (r["kv_load_wait_ms"] is None) == (name == "nixl")
        # Prompts of 64 and 96 tokens: 2 and 3 blocks; the median of two is their mean.
        assert r["kv_bytes_per_request"] == 2.5 * KIB_PER_BLOCK * 1024, name
        assert set(r["cold"]) == {
            "client_ttft_ms",
            "proxy_prefill_ms",
            "vllm_ttft_ms",
            "kv_transfer_ms",
        }
        assert all(v is not None and v > 0 for v in r["cold"].values()), (name, r["cold"])
        assert set(r["idle_cpu_cores"]) == {"prefill", "decode"}
        assert all(v >= 0 for v in r["idle_cpu_cores"].values())
        never = r["lease_d_never_comes"]
        assert never["held_usage_perc"] > 0, (name, never)
        assert never["freed_after_s"] is not None, (name, never)
        stalled = r["lease_d_stalled_past_lease"]
        assert stalled["stalled_s"] >= 6, (name, stalled)
        assert isinstance(stalled["d_answered"], bool)
        if stalled["held_at_stop"]:  # D had not read: P frees at the lease, D stopped or not
            assert stalled["p_freed_after_s"] is not None, (name, stalled)
        if stalled["d_answered"]:
            assert isinstance(stalled["d_output_matches_prefill_alone"], bool)
        killed = r["lease_d_killed_while_queued"]
        assert isinstance(killed["held_at_kill"], bool)
        if killed["held_at_kill"]:
            assert killed["freed_after_s"] is not None, (name, killed)
    assert {"client_ttft_median", "vllm_ttft_p90", "kv_transfer_median"} <= set(report["ratios"])


def test_outputs_are_equal_across_connectors_and_to_the_prefill_server_alone(
    report: dict[str, Any],
) -> None:
    assert report["outputs_equal"] is True
    for name, r in report["results"].items():
        assert r["outputs_match_prefill_alone"] is True, name


def test_every_server_threads_allowed_cpus_are_reported(report: dict[str, Any]) -> None:
    cpu_list = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")
    for name, r in report["results"].items():
        assert set(r["pinning"]) == {"prefill", "decode"}
        for role, procs in r["pinning"].items():
            workers = [p for p in procs if p["name"] == "VLLM::Worker"]
            assert len(workers) == 1, (name, role, procs)
            for p in procs:
                assert p["threads"] == sum(p["cpus"].values()) > 0
                assert all(cpu_list.match(c) for c in p["cpus"]), p
                assert p["main_thread_cpus"] in p["cpus"], p
    # kvframe leaves vLLM's binding alone: each worker's threads stay on its server's core.
    core = report["params"]["cores"]
    for role, procs in report["results"]["kvframe"]["pinning"].items():
        (worker,) = [p for p in procs if p["name"] == "VLLM::Worker"]
        assert set(worker["cpus"]) == {str(core[role])}, (role, worker)
