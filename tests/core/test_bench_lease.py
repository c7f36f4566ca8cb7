"""``kvframe bench lease`` runs at tiny sizes and prints the documented JSON shape."""

from __future__ import annotations

import argparse
import json

import pytest

from kvframe.bench import lease
from kvframe.cli import BENCHMARKS

TINY = ["--leases", "300", "--renew", "30", "--expire", "10", "--repeat", "1"]


def run_bench(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    lease.add_arguments(parser)
    status = lease.run(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_registered_in_the_cli() -> None:
    assert BENCHMARKS["lease"][0] == "kvframe.bench.lease"


def test_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_bench([*TINY, "--json"], capsys)
    assert status == 0
    report = json.loads(out)
    assert set(report) == {"benchmark", "params", "results", "heartbeat"}
    assert report["benchmark"] == "lease"
    assert report["params"] == {
        "leases": 300,
        "renew": 30,
        "expire": 10,
        "repeat": 1,
        "heartbeat_ids": 100,
        "id_length": 39,
    }
    assert set(report["results"]) == {
        "renew",
        "renew_by_id",
        "expire_none_due",
        "expire_due",
        "expire_due_rows",
    }
    # Reading the rows comes on top of the same call.
    rows, due = report["results"]["expire_due_rows"], report["results"]["expire_due"]
    assert rows["kvframe_s"] >= due["kvframe_s"]
    assert rows["naive_s"] == due["naive_s"]
    pair = {"kvframe_s", "kvframe_p90_s", "naive_s", "naive_p90_s", "ratio"}
    for name, r in report["results"].items():
        extra = {"naive_handle_s", "ratio_handle"} if name == "renew" else set()
        assert set(r) == pair | extra
        assert all(isinstance(v, float) and v >= 0 for v in r.values())
        assert r["kvframe_p90_s"] >= r["kvframe_s"]
    hb = report["heartbeat"]
    assert set(hb) == {
        "ids",
        "id_length",
        "message_bytes",
        "header_bytes",
        "bytes_per_id",
        "msgpack_bytes_per_id",
    }
    assert hb["bytes_per_id"] == 8.0  # one 64-bit handle per lease, whatever the id
    assert hb["message_bytes"] == 18 + 100 * 8
    assert hb["msgpack_bytes_per_id"] == 41.03  # the 39-byte ids (+2, +3 bytes of list header)


def test_scale_and_human_table(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_bench(["--scale", "0.002", "--repeat", "1", "--id-length", "8"], capsys)
    assert status == 0
    assert "200 live leases" in out
    assert "renew 20 (by handle)" in out
    assert "renew 20 (by id)" in out
    assert "expire 2 due" in out
    assert "+ reading the Lease rows" in out
    assert "8.00 bytes/lease" in out
    assert "msgpack list: 9.03 bytes/id" in out


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--leases", "0"], "--leases must be >= 1"),
        (["--scale", "0"], "--scale must be > 0"),
        (["--id-length", "300"], "--id-length must be <= 255"),
    ],
)
def test_bad_options(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_bench(argv, capsys)
    assert status == 2
    assert match in err
    assert out == ""
