"""``kvframe bench codec`` runs at tiny sizes and prints the documented JSON shape (no timed
assertions: the machine decides the figures)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvframe.bench import codec
from kvframe.cli import BENCHMARKS

TINY = ["--loads", "3", "--blocks", "2", "--samples", "20", "--batch", "2"]
KEYS = {
    "kvframe_median_s",
    "kvframe_p90_s",
    "msgspec_median_s",
    "msgspec_p90_s",
    "ratio_median",
    "ratio_p90",
    "bar_s",
    "meets_bar",
    "bar_ratio",
    "meets_bar_ratio",
    "kvframe_bytes",
    "msgspec_bytes",
}


def run_bench(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    codec.add_arguments(parser)
    status = codec.run(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_registered_in_the_cli() -> None:
    assert BENCHMARKS["codec"][0] == "kvframe.bench.codec"


def test_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_bench([*TINY, "--json"], capsys)
    assert status == 0
    report = json.loads(out)
    assert set(report) == {"benchmark", "params", "results"}
    assert report["benchmark"] == "codec"
    assert report["params"] == {"loads": 3, "blocks": 2, "samples": 20, "batch": 2}
    assert set(report["results"]) == {"empty_step", "loads_step"}
    for row in report["results"].values():
        assert set(row) == KEYS
        assert row["kvframe_median_s"] > 0
        assert row["msgspec_median_s"] > 0
        assert row["kvframe_p90_s"] >= row["kvframe_median_s"]
        assert row["msgspec_p90_s"] >= row["msgspec_median_s"]
        assert isinstance(row["meets_bar"], bool)
        assert isinstance(row["meets_bar_ratio"], bool)
        assert row["kvframe_bytes"] > 0
        assert row["msgspec_bytes"] > 0
    assert report["results"]["empty_step"]["bar_s"] == pytest.approx(5e-6)
    assert report["results"]["loads_step"]["bar_s"] == pytest.approx(150e-6 * 3 / 64)
    assert report["results"]["empty_step"]["bar_ratio"] == pytest.approx(5 / 0.6)
    assert report["results"]["loads_step"]["bar_ratio"] == pytest.approx(150 / 74)


def test_table_names_both_rows_and_the_bar(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_bench(TINY, capsys)
    assert status == 0
    for part in ("empty_step", "loads_step", "bar ratio:"):
        assert part in out


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_bench(["--loads", "0"], capsys)
    assert status == 2
    assert "--loads must be >= 1" in err


def test_the_reference_carries_the_messages_fields() -> None:
    # Same fields in the same order: both sides write the same map, so the bytes differ by
    # kvframe's envelope only (a reference with fewer fields would flatter it).
    assert codec.same_fields()
    empty, full = codec._messages(3, 2)
    for ours, theirs in (empty, full):
        kv = codec.codec_for(
            codec.PDConnector,
            codec.KVTransferConfig(kv_connector="PDConnector", kv_role="kv_both"),
        ).encode(ours)
        ref = codec._REF_ENCODER.encode(theirs)
        assert len(kv) - len(ref) == len(b"KVFM") + 2 + 1 + len(b"pd.metadata") + 4
