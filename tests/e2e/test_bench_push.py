"""`kvframe bench push --quick --json`: the output's shape and that every arm moved KV (never
its timings)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from kvframe import cli

pytest.importorskip("nixl_cu12", reason="the benchmark moves KV over NIXL")
pytest.importorskip("kvframe_refengine")


def test_quick_json_shape_and_every_arm_moved_kv() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvframe.cli", "bench", "push", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["benchmark"] == "push"
    assert report["version"] == 1
    assert report["quick"] is True
    repeats = report["repeats"]
    assert repeats == 1
    pin = report["pinning"]
    assert pin["verified"] is True
    assert pin["P"] == pin["P_layerwise"]
    assert len(pin["P"]) == len(pin["D"]) == 1
    assert set(pin["threads"]) == {"P", "P_layerwise", "D"}
    assert set(report["load_average"]) == {"start", "end"}
    per_token = report["model"]["kv_bytes_per_token"]
    (case,) = report["cases"]
    n = case["prompt_tokens"]
    block = report["model"]["block_size"]
    # D loads n - 1 tokens: their whole blocks cross.
    assert case["kv_bytes"] == -(-(n - 1) // block) * block * per_token
    assert set(case["arms"]) == {"pull", "push", "progressive"}
    for arm, a in case["arms"].items():
        for key in ("ttft_s", "prefill_s", "tail_s"):
            s = a[key]
            assert len(s["samples"]) == repeats, (arm, key)
            assert s["median"] <= s["p90"] or s["median"] == pytest.approx(s["p90"])
        assert a["ttft_s"]["median"] > 0
        moved = a["moved"]
        assert moved["requests"] == repeats
        assert moved["loads_done"] == repeats, arm
        assert moved["external_tokens"] == repeats * (n - 1), arm
        if arm == "progressive":
            # Either the layer WRITEs carried it during the prefill or the final WRITE did.
            assert moved["bytes"] > 0 or moved["layer_writes"] > 0
        else:
            assert moved["bytes"] == repeats * case["kv_bytes"], arm
    assert case["transfer_s"]["median"] > 0
    assert case["read_s"]["median"] > 0
    assert case["compute_s"] == case["arms"]["push"]["prefill_s"]
    assert len(case["compute_alone_s"]["samples"]) == repeats
    assert case["ideal_s"] == max(case["compute_s"]["median"], case["transfer_s"]["median"])
    ttft = {arm: a["ttft_s"]["median"] for arm, a in case["arms"].items()}
    assert case["push_speedup"] == pytest.approx(ttft["pull"] / ttft["push"])
    assert case["progressive_speedup"] == pytest.approx(ttft["pull"] / ttft["progressive"])
    assert case["overlap_efficiency"] == pytest.approx(case["ideal_s"] / ttft["progressive"])


def test_repeats_must_be_a_positive_count(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "push", "--repeats", "0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--repeats: '0': expected a whole number of rounds >= 1" in err


def test_figures_and_table_from_samples() -> None:
    from kvframe_refengine import bench_push as bp

    def samples(ttft: float, prefill: float, transfer: float, tokens: int = 127) -> list[Any]:
        return [
            bp._Sample(
                ttft + i,
                prefill_s=prefill + i,
                transfer_s=transfer,
                external_tokens=tokens,
                loads_done=1.0,
                bytes=2.0**21,
            )
            for i in range(3)
        ]

    got = {
        "pull": samples(10.0, 6.0, 0.5),
        "push": samples(8.0, 6.0, 1.0),
        "progressive": samples(7.0, 6.0, 0.0),
        "compute": samples(5.0, 5.0, 0.0, tokens=0),
    }
    case = bp._case(128, got)
    assert case["arms"]["pull"]["ttft_s"]["median"] == 11.0
    assert case["arms"]["push"]["tail_s"]["samples"] == [2.0, 2.0, 2.0]
    assert case["compute_s"]["median"] == 7.0  # P's prefill in the push arm
    assert case["compute_alone_s"]["median"] == 6.0
    assert case["transfer_s"]["median"] == 1.0
    assert case["read_s"]["median"] == 0.5
    assert case["ideal_s"] == 7.0
    assert case["overlap_efficiency"] == pytest.approx(7.0 / 8.0)
    assert case["push_speedup"] == pytest.approx(11.0 / 9.0)
    assert case["arms"]["progressive"]["moved"]["requests"] == 3
    report = {
        "repeats": 3,
        "pinning": {"P": [0], "D": [1]},
        "load_average": {"start": 0.1, "end": 0.2},
        "cases": [case],
    }
    table = bp._table(report)
    assert "| 128 tokens | 2.0 MiB | 11000.0 / " in table
    assert "| 88 % | 6000.0 / " in table
