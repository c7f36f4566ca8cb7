"""``kvframe bench vllm --quick`` (the in-process harness) end to end, small: the kvframe side
only; and the options checks of both modes. The servers mode (the default) has its own test,
``test_vllm_bench_servers.py``."""

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
            "--quick",
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
    assert report["mode"] == "quick"
    assert report["note"] == "in-process quick mode, not what users run"
    r = report["results"]["kvframe"]
    assert r["outputs_match_reference"] is True
    assert r["kv_bytes_per_request"] == 128 * 1024  # 2 blocks × 64 KiB of float32 KV
    assert r["ttft_decode_ms"] > 0
    assert r["decode_tokens_per_s"] > 0
    assert r["decode_death"]["reclaimed"] is True
    assert 1.8 <= r["decode_death"]["seconds"] <= 2 + 5


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--quick", "--prompt-tokens", "8"], "--prompt-tokens must be 32..400"),
        (["--lease", "5"], "--lease 5: at least 6 s in the servers mode"),
        (["--quick", "--prompts", "3"], "--prompts: only for the servers mode"),
        (["--repeat", "2"], "--repeat: only for the --quick mode"),
        (["--min-prompt-tokens", "128", "--max-prompt-tokens", "64"], "32 <= min <= max"),
    ],
)
def test_bench_rejects_bad_options(args: list[str], message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvframe_vllm.bench", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 2
    assert message in out.stderr
