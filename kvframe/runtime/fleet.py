"""Liveness feeds the leases: one engine's registration and watch, wired to its P/D workers.

:class:`FleetLiveness` registers the engine through a discovery backend and watches the
fleet. When another engine vanishes it tells every worker (:meth:`LivenessTarget.engine_gone`:
P aborts the leases that engine's workers claimed, D fails its loads from it); when this
engine's own registration may have lapsed it fences the workers
(:meth:`LivenessTarget.fence`: no reads, no lease claims) until the registration has been
confirmed again for ``hold`` seconds, so that a peer acting on the lapse never frees blocks
this engine is still reading.

Both are accelerations: with the discovery service down nothing is reported, and the leases
bound everything as before (a watch that lost the service reports no engine gone; a
registrant that cannot reach it fences its own reads, which fail over to the failure policy).

Threads: the backend's threads call :meth:`FleetLiveness._on_events` and
:meth:`FleetLiveness._on_lost`; the workers' methods they call are thread-safe (they queue
for the worker's next progress point). One monitor thread, started on the first lapse, waits
for the registration to be confirmed again and unfences; it shares only ``_fenced_since``
(under ``_lock``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from kvframe.core.fleet import EngineRecord, EngineVanished, FleetEvent
from kvframe.spi.discovery import Discovery, FleetWatch, Registration

__all__ = ["FleetLiveness", "LivenessTarget"]


class LivenessTarget(Protocol):
    """What :class:`FleetLiveness` drives: a :class:`~kvframe.connectors.pd.PDConnectorWorker`
    (or anything with the same three thread-safe methods)."""

    def engine_gone(self, engine_id: str, reason: str = ...) -> None:
        """Engine ``engine_id`` left the fleet."""

    def fence(self, reason: str) -> None:
        """Stop reading: this engine may have been reported gone."""

    def unfence(self) -> None:
        """Read again."""


class FleetLiveness:
    """Registers ``record`` and keeps ``targets`` informed (see the module docstring).

    :param discovery: the backend (not closed by :meth:`close`: it may serve others).
    :param record: this engine's registration.
    :param targets: this engine's workers.
    :param hold: seconds the registration must stay confirmed after a lapse before the
        workers read again; default the backend's TTL is a good choice (a peer then had a
        whole TTL to apply the vanish it saw).
    """

    def __init__(
        self,
        discovery: Discovery,
        record: EngineRecord,
        targets: Sequence[LivenessTarget],
        *,
        hold: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not hold >= 0:
            raise ValueError(f"hold must be a number of seconds >= 0, got {hold!r}")
        self._discovery = discovery
        self._record = record
        self._targets = tuple(targets)
        self._hold = hold
        self._clock = clock
        self._lock = threading.Lock()
        self._fenced_since: float | None = None
        self._closed = threading.Event()
        self._monitor: threading.Thread | None = None
        self.gone: list[EngineVanished] = []
        """Every vanish reported to the workers, in order (for diagnostics and tests); a
        ``replaced`` one is not reported (see :meth:`_on_events`)."""
        self._registration: Registration = discovery.register(record, on_lost=self._on_lost)
        self._watch: FleetWatch = discovery.watch(self._on_events)

    @property
    def registration(self) -> Registration:
        """This engine's registration."""
        return self._registration

    @property
    def watch(self) -> FleetWatch:
        """The fleet watch."""
        return self._watch

    @property
    def fenced(self) -> bool:
        """Whether the workers are fenced now."""
        with self._lock:
            return self._fenced_since is not None

    def close(self) -> None:
        """Withdraw the registration (first: peers see this engine leave at once, whatever
        stopping the watch takes), stop watching. Safe twice."""
        self._closed.set()
        self._registration.withdraw()
        self._watch.cancel()
        if self._monitor is not None:
            self._monitor.join(timeout=10)

    def _on_events(self, events: Sequence[FleetEvent]) -> None:
        for ev in events:
            if not isinstance(ev, EngineVanished) or ev.record.engine_id == self._record.engine_id:
                continue
            if ev.reason == "replaced":
                # A new incarnation registered already: it may have connected and claimed
                # leases under the same peer names, so aborting "its" claims could free blocks
                # the new instance reads. The old instance's leases expire (as without
                # discovery), and its connection is rebuilt by the new handshake.
                continue
            self.gone.append(ev)
            why = f"its fleet registration is gone ({ev.reason})"
            for t in self._targets:
                t.engine_gone(ev.record.engine_id, why)

    def _on_lost(self, why: str) -> None:
        with self._lock:
            if self._closed.is_set() or self._fenced_since is not None:
                return
            self._fenced_since = self._clock()
            start = self._monitor is None or not self._monitor.is_alive()
        for t in self._targets:
            t.fence(f"its fleet registration may have lapsed ({why})")
        if start:
            self._monitor = threading.Thread(
                target=self._wait_confirmed, name="kvframe-fleet-unfence", daemon=True
            )
            self._monitor.start()

    def _wait_confirmed(self) -> None:
        confirmed_at: float | None = None
        while not self._closed.wait(0.05):
            now = self._clock()
            if self._registration.lost:
                confirmed_at = None
                continue
            if confirmed_at is None:
                confirmed_at = now
            if now - confirmed_at >= self._hold:
                with self._lock:
                    self._fenced_since = None
                for t in self._targets:
                    t.unfence()
                return
