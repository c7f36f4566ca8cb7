"""A signal to ``kvframe demo`` stops every process it started: one line on stderr, no
traceback, exit status ``128 + signal``, and no child left (checked in /proc, by pid and start
time, so a reused pid cannot pass for a survivor).

- SIGTERM to the demo's pid while phase 1's requests are in flight (what a supervisor sends);
- SIGINT to the demo's whole process group while phase 1's requests are in flight (what Ctrl-C
  at a terminal does: before, every process got it at once and the demo reported the broken
  connections as a ``ConnectionResetError`` failure);
- SIGTERM while the engines are still starting.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from kvframe.runtime.procs import descendants, still_running

pytest.importorskip("nixl_cu12", reason="the demo runs over NIXL")
pytest.importorskip("kvframe_refengine", reason="the demo needs contrib/kvframe-refengine")

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("sig", "to_group", "marker"),
    [
        (signal.SIGTERM, False, "phase 1:"),
        (signal.SIGINT, True, "phase 1:"),
        (signal.SIGTERM, False, "starting prefill"),
    ],
    ids=["sigterm-serving", "ctrl-c-serving", "sigterm-starting"],
)
def test_a_signal_stops_the_demo_and_every_process_it_started(
    sig: signal.Signals, to_group: bool, marker: str
) -> None:
    demo = subprocess.Popen(
        [sys.executable, "-m", "kvframe.cli", "demo", "--lease", "3"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group, as a shell gives a foreground job
    )
    children: dict[int, str] = {}
    try:
        assert demo.stdout is not None
        printed: list[int] = []
        for line in demo.stdout:
            found = re.search(r"pids (prefill \d+, decode \d+, router \d+)\)", line)
            if found:
                printed = [int(part.split()[1]) for part in found.group(1).split(", ")]
            if marker in line:
                break
        else:
            pytest.fail(f"the demo ended before {marker!r}: {demo.wait()}, {demo.stderr}")
        children = descendants(demo.pid)
        assert len(printed) == 3
        assert set(printed) <= set(children), (printed, children)
        if to_group:
            os.killpg(demo.pid, sig)
        else:
            demo.send_signal(sig)
        out, err = demo.communicate(timeout=40)
        survivors = [p for p, start in children.items() if still_running(p, start)]
        deadline = time.monotonic() + 5
        while survivors and time.monotonic() < deadline:  # reparented ones are reaped by init
            time.sleep(0.1)
            survivors = [p for p, start in children.items() if still_running(p, start)]
        assert survivors == []
        assert demo.returncode == 128 + sig
        assert "Traceback" not in err
        assert err.strip().splitlines() == [
            f"kvframe demo: stopped by {sig.name}; every process it started has been stopped"
        ]
        assert "[FAIL]" not in out  # no table of failed checks: it stopped, it did not fail
        assert "[599]" not in out  # nor the requests the stopping broke
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        for pid, start in children.items():
            if still_running(pid, start):
                os.kill(pid, signal.SIGKILL)
