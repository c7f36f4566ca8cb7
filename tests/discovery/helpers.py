"""Shared pieces of the discovery tests: records, an event collector, waiting."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvframe.core.fleet import EngineRecord, EngineRole, EngineVanished, FleetEvent


def record(
    engine_id: str, role: EngineRole = EngineRole.PRODUCER, port: int = 5600
) -> EngineRecord:
    return EngineRecord(
        engine_id=engine_id,
        role=role,
        host="127.0.0.1",
        side_channel_ports=(port,),
        transport="inprocess",
        tp_size=1,
        capabilities=frozenset({"pull"}),
        incarnation=secrets.token_hex(4),
    )


class Events:
    """Collects a watch's events (from the backend's thread) with their arrival times."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.items: list[tuple[float, FleetEvent]] = []

    def __call__(self, events: Sequence[FleetEvent]) -> None:
        now = time.monotonic()
        with self._lock:
            self.items.extend((now, e) for e in events)

    def kinds(self, engine_id: str) -> list[str]:
        with self._lock:
            return [type(e).__name__ for _, e in self.items if e_id(e) == engine_id]

    def vanished(self, engine_id: str) -> list[tuple[float, EngineVanished]]:
        with self._lock:
            return [
                (t, e)
                for t, e in self.items
                if isinstance(e, EngineVanished) and e.record.engine_id == engine_id
            ]


def e_id(e: FleetEvent) -> str:
    return e.record.engine_id


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> float:
    """Poll ``cond`` every 10 ms; return the seconds it took, fail after ``timeout``."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.01)
    return time.monotonic() - t0


_CHILD = """
import json, sys, time
from kvframe.core.fleet import EngineRecord, EngineRole
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.discovery import DiscoveryParams
h = PluginHost(env={}); h.load()
d = h.create_discovery(sys.argv[1], DiscoveryParams(options=json.loads(sys.argv[2])))
reg = d.register(EngineRecord(engine_id=sys.argv[3], role=EngineRole.CONSUMER, host="127.0.0.1",
    side_channel_ports=(1,), transport="inprocess", tp_size=1, incarnation="child"))
while reg.lost:
    time.sleep(0.01)
print("registered", flush=True)
time.sleep(600)
"""


def start_registered_child(
    backend: str, options: dict[str, Any], engine_id: str
) -> subprocess.Popen[str]:
    """A separate process that registers ``engine_id`` and then just lives (to be killed)."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, backend, json.dumps(options), engine_id],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "registered"
    return child


def stop_child(child: subprocess.Popen[str]) -> None:
    if child.poll() is None:
        child.kill()
    child.wait()
    if child.stdout is not None:
        child.stdout.close()
