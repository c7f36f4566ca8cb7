"""``kvframe bench vllm`` end to end, small: the kvframe side only (vLLM's NixlConnector side
runs in the full benchmark; the comparison's figures are in docs/vllm.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(600)


def test_bench_reports_every_figure_and_a_correct_decode() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvframe_vllm.bench",
            "--json",
            "--only",
            "kvframe",
            "--requests",
            "2",
            "--repeat",
            "1",
            "--decode-tokens",
            "4",
            "--prompt-tokens",
            "64",
            "--lease",
            "2",
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=500,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["benchmark"] == "vllm"
    r = report["results"]["kvframe"]
    assert r["outputs_match_reference"] is True
    assert r["kv_bytes_per_request"] == 128 * 1024  # 2 blocks × 64 KiB of float32 KV
    assert r["ttft_decode_ms"] > 0
    assert r["decode_tokens_per_s"] > 0
    assert r["decode_death"]["reclaimed"] is True
    assert 1.8 <= r["decode_death"]["seconds"] <= 2 + 5


def test_bench_rejects_bad_options() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvframe_vllm.bench", "--prompt-tokens", "8"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 2
    assert "--prompt-tokens must be 32..400" in out.stderr
