"""``kvframe bench handshake`` runs at tiny sizes and prints the documented JSON shape (no
timed assertions: the machine decides the figures)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvframe.bench import handshake
from kvframe.cli import BENCHMARKS

TINY = ["--samples", "4", "--flood", "300", "--rate", "600", "--interval", "0.02"]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    handshake.add_arguments(parser)
    status = handshake.run(parser.parse_args(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_registered_in_the_cli() -> None:
    assert BENCHMARKS["handshake"][0] == "kvframe.bench.handshake"


def test_json_shape_and_the_flood_is_answered_or_dropped(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, err = _run([*TINY, "--json"], capsys)
    assert status == 0
    report = json.loads(out)
    assert report["benchmark"] == "handshake"
    assert report["params"] == {
        "samples": 4,
        "flood": 300,
        "rate": 600.0,
        "attackers": 4,
        "interval_s": 0.02,
    }
    cost = report["cost"]
    assert cost["auth_p90_s"] >= cost["auth_median_s"] > 0
    assert cost["plain_p90_s"] >= cost["plain_median_s"] > 0
    flood = report["flood"]
    assert flood["sent"] == 300
    # 600 messages: a 400-message burst answered, then the per-address rate drops the rest
    assert flood["rate_limited"] > 0
    # each attempt is two messages, each legitimate handshake two more
    assert flood["answered"] + flood["rate_limited"] <= 2 * (flood["sent"] + flood["legit_tried"])
    assert flood["legit_ok"] >= 1  # the legitimate D still got through
    assert "kvframe bench handshake [2/2" in err


def test_bad_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = _run(["--rate", "0"], capsys)
    assert status == 2
    assert "--rate must be > 0" in err
