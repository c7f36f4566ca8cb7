"""A signal to ``kvframe bench vllm`` stops both vLLM engines and removes the temporary
directory: one line on stderr, no traceback, exit status ``128 + signal``, no engine left
(checked in /proc by pid and start time).

Run through ``kvframe.cli bench vllm`` (the launcher becomes the benchmark with ``exec``, so the
pid the signal goes to is the benchmark's), SIGTERM once both engines are up. (SIGINT and
Ctrl-C to the whole group go through the same code, :mod:`kvframe.runtime.procs`; the main
suite's ``tests/e2e/test_signals.py`` sends them to the demo. One engine pair is what this
suite's time allows: about 85 s on a loaded 2-core machine.)
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvframe.runtime.procs import descendants, still_running

pytestmark = pytest.mark.timeout(300)


def test_sigterm_stops_both_engines_and_removes_the_temporary_directory() -> None:
    sig, marker = signal.SIGTERM, "kvframe: warm-up request"  # printed once both are up
    bench = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvframe.cli",
            "bench",
            "vllm",
            "--quick",
            "--only",
            "kvframe",
            "--requests",
            "1",
            "--repeat",
            "1",
            "--prompt-tokens",
            "64",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "KVFRAME_VLLM_PYTHON": sys.executable},
        start_new_session=True,
    )
    engines: dict[int, str] = {}
    try:
        assert bench.stderr is not None
        tmp: Path | None = None
        seen: list[str] = []
        for line in bench.stderr:
            seen.append(line)
            found = re.search(r"model and engine logs in (\S+)", line)
            if found:
                tmp = Path(found.group(1))
            if marker in line:
                break
        else:
            pytest.fail(f"the benchmark ended before {marker!r}:\n{''.join(seen)[-3000:]}")
        assert tmp is not None
        assert tmp.is_dir()
        engines = descendants(bench.pid)
        assert len(engines) >= 2, engines  # prefill and decode (and what they started)
        bench.send_signal(sig)
        _, err = bench.communicate(timeout=60)
        deadline = time.monotonic() + 5
        survivors = [p for p, s in engines.items() if still_running(p, s)]
        while survivors and time.monotonic() < deadline:  # reparented ones are reaped by init
            time.sleep(0.1)
            survivors = [p for p, s in engines.items() if still_running(p, s)]
        assert survivors == []
        assert not tmp.exists()
        assert bench.returncode == 128 + sig
        assert "Traceback" not in err
        lines = [ln for ln in err.splitlines() if not ln.startswith("kvframe bench vllm [")]
        assert lines == [
            f"kvframe bench vllm: stopped by {sig.name}; every process it started has been stopped"
        ]
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
        for pid, start in engines.items():
            if still_running(pid, start):
                os.kill(pid, signal.SIGKILL)
