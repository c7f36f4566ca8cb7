"""``kvframe bench transfer --quick --json``: the output's shape, not its timings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.nixl


def test_quick_json_shape() -> None:
    from kvframe.bench.transfer import PD_PHASES

    proc = subprocess.run(
        [sys.executable, "-m", "kvframe.cli", "bench", "transfer", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)  # stdout is exactly one JSON object
    assert report["benchmark"] == "transfer"
    assert report["version"] == 1
    assert report["quick"] is True
    assert report["methods"] == [
        "kvframe",
        "kvframe_inline",
        "raw_nixl",
        "memcpy",
        "pd_connector",
        "pd_floor",
    ]
    cfg = report["config"]
    rows = report["throughput"]
    assert len(rows) == len(cfg["block_sizes"]) * len(cfg["blocks"])
    for row in rows:
        assert row["bytes"] == row["block_bytes"] * row["blocks"]
        assert set(row["results"]) == set(report["methods"])
        for cell in row["results"].values():
            assert cell["median_s"] > 0
            assert cell["gbps"] > 0
        assert set(row["ratios"]) == {f"kvframe/{m}" for m in report["methods"][1:]} | {
            "pd_connector/raw_nixl",
            "pd_connector/memcpy",
            "pd_floor/raw_nixl",
        }
        # The protocol floor ran beside the connector and raw NIXL in the same rounds.
        floor = row["results"]["pd_floor"]["median_s"]
        raw = row["results"]["raw_nixl"]["median_s"]
        assert row["floor_fixed_cost_us"] == pytest.approx((floor - raw) * 1e6)
        # Where the connector's time went: every part timed, each step counted; the parts
        # are a share of the connector's median time (the loop around them is not counted).
        phases = row["pd_phases_us"]
        assert tuple(phases) == PD_PHASES
        assert phases["steps"] >= 1
        assert all(phases[name] > 0 for name in PD_PHASES)
        parts = sum(v for name, v in phases.items() if name != "steps")
        assert parts < 3 * row["results"]["pd_connector"]["median_s"] * 1e6
        p90 = row["pd_phases_p90_us"]
        assert tuple(p90) == PD_PHASES
        assert all(p90[name] >= phases[name] for name in PD_PHASES)
    assert [r["descriptors"] for r in report["post_cost"]] == cfg["descriptor_counts"]
    for row in report["post_cost"]:
        assert set(row) == {
            "descriptors",
            "kvframe_inline_post_us",
            "kvframe_post_thread_us",
            "raw_make_us",
            "raw_make_transfer_us",
            "pd_connector_launch_us",
        }
        assert all(v > 0 for v in row.values())
    tp = report["tp"]
    assert tp["pairings"] == ["P2->D2", "P4->D2", "P2->D4"]
    assert [r["blocks"] for r in tp["rows"]] == cfg["tp_blocks"]
    # Every timed load (and each warm-up) was checked byte for byte against P's blocks.
    assert tp["loads_checked"] == 3 * (cfg["repeats"] + 1) * len(cfg["tp_blocks"])
    for row in tp["rows"]:
        assert row["bytes"] == row["blocks"] * cfg["tp_block_bytes"]
        assert set(row["results"]) == set(tp["pairings"])
        assert all(c["p90_s"] >= c["median_s"] > 0 for c in row["results"].values())
        assert set(row["ratios"]) == {"P4->D2/P2->D2", "P2->D4/P2->D2"}
    overlap = report["overlap"]
    assert overlap["bytes"] > 0
    for mode in ("inline", "post_thread"):
        assert overlap[mode]["step_s"] >= overlap[mode]["post_s"] > 0
    cold = report["cold"]
    assert cold["blocks"] == cfg["cold_blocks"]
    assert cold["block_bytes"] == cfg["cold_block_bytes"]
    assert set(cold["results"]) == {"raw_nixl", "pd_connector", "pd_connector_no_warmup"}
    for name, r in cold["results"].items():
        assert len(r["trials"]) == cfg["cold_trials"]
        for trial in r["trials"]:
            # The first request includes its handshake; the handshake is measured apart.
            assert trial["first_s"] > trial["handshake_s"] > 0
            assert trial["later_median_s"] > 0
            assert (trial["warmup_s"] is not None) is (name == "pd_connector")
        assert r["excess_max_s"] >= r["excess_median_s"]


def test_cold_trials_option() -> None:
    import argparse

    from kvframe.bench.transfer import QUICK, add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args(["--quick"])) is QUICK
    cfg = config_from_args(parser.parse_args(["--quick", "--cold-trials", "4"]))
    assert cfg.cold_trials == 4
    assert cfg.cold_blocks == QUICK.cold_blocks
    with pytest.raises(ValueError, match="--cold-trials"):
        config_from_args(parser.parse_args(["--cold-trials", "0"]))


def test_plugin_host_finds_nixl() -> None:
    from kvframe_nixl import CAPABILITIES, NixlTransport

    from kvframe.runtime.plugins import PluginHost
    from kvframe.spi.transport import TransportParams

    host = PluginHost(env={})
    host.load()
    assert "nixl" in host.transport_names()
    assert host.transport_info("nixl").capabilities == CAPABILITIES
    t = host.create_transport("nixl", TransportParams(name="host-made", options={}))
    try:
        assert isinstance(t, NixlTransport)
    finally:
        t.close()
