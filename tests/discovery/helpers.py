"""Shared pieces of the discovery tests: records, an event collector, waiting."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence

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
