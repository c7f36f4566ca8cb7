"""The discovery contract: how engines register in a fleet and how anyone watches it.

A discovery backend (registered through
:func:`~kvframe.spi.hookspecs.kvframe_register_discovery_backends`) is built by a factory from
:class:`DiscoveryParams` and does three things:

- :meth:`Discovery.register` publishes an :class:`~kvframe.core.fleet.EngineRecord` and keeps
  it alive until :meth:`Registration.withdraw` (or :meth:`Discovery.close`). A backend with a
  TTL (etcd, file) lets a registration whose process died vanish within that TTL. When the
  registrant cannot confirm its registration in time it reports it *lost* (the ``on_lost``
  callback) and registers again as soon as it can.
- :meth:`Discovery.watch` follows the fleet: the callback receives the
  :data:`~kvframe.core.fleet.FleetEvent` lists a :class:`~kvframe.core.fleet.FleetView`
  returned (added, changed, vanished), in order, from one backend thread.
- :meth:`Discovery.close` withdraws every registration, cancels every watch and releases the
  connection; safe twice.

The I/O is the backend's; every decision about what is live is the view's (pure, in
:mod:`kvframe.core.fleet`). :class:`WatchBase` is the shared half of a watch: it owns the view,
serialises observations, and keeps a failing callback from stopping the watcher.

**Discovery down is not engine dead.** A watch that lost its connection reports nothing until
it has a complete listing again (:meth:`~kvframe.core.fleet.FleetView.snapshot`); engines
vanish only by observation. Liveness events are accelerations: leases bound everything
without them.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from kvframe.core.fleet import EngineRecord, FleetEvent, FleetView

__all__ = [
    "Discovery",
    "DiscoveryFactory",
    "DiscoveryParams",
    "FleetCallback",
    "FleetWatch",
    "LostCallback",
    "Registration",
    "WatchBase",
]

#: Receives the events of one observation, in order (from a backend thread: return quickly).
FleetCallback = Callable[[Sequence[FleetEvent]], None]
#: Receives why a registration may have lapsed (from a backend thread).
LostCallback = Callable[[str], None]


@attrs.frozen(kw_only=True)
class DiscoveryParams:
    """What a discovery factory receives."""

    options: Mapping[str, Any] = attrs.field(factory=dict)
    """Backend options (``"endpoint"``, ``"ttl"``, ``"prefix"`` ...); each backend documents
    its keys and raises :class:`~kvframe.errors.ConfigError` naming a bad or unknown one."""


class Registration(abc.ABC):
    """One engine's registration, kept alive by the backend until withdrawn."""

    @property
    @abc.abstractmethod
    def record(self) -> EngineRecord:
        """What is registered."""

    @property
    @abc.abstractmethod
    def lost(self) -> bool:
        """Whether the registration may have lapsed (peers may have seen the engine vanish);
        the backend is registering again."""

    @abc.abstractmethod
    def withdraw(self) -> None:
        """Remove the registration now (watchers see the engine vanish). Safe twice; never
        raises: a withdrawal the service did not get ends with the registration's TTL."""


class FleetWatch(abc.ABC):
    """A running watch of the fleet."""

    @abc.abstractmethod
    def live(self) -> tuple[EngineRecord, ...]:
        """The engines live as of the latest observation."""

    @property
    @abc.abstractmethod
    def malformed(self) -> int:
        """Records skipped because they did not decode or did not match their key."""

    @property
    @abc.abstractmethod
    def connected(self) -> bool:
        """Whether the watch currently follows the service (False while reconnecting)."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stop watching: no callback starts after this returns. Safe twice."""


class Discovery(abc.ABC):
    """A discovery backend (one per process and service is enough)."""

    @abc.abstractmethod
    def register(
        self, record: EngineRecord, *, on_lost: LostCallback | None = None
    ) -> Registration:
        """Publish ``record`` and keep it alive.

        :raises ConfigError: the backend cannot hold this record (the message says why).
        :raises KVFrameError: the service refused the first registration outright; a service
            that is merely unreachable does not raise: the backend keeps trying and the
            registration stays :attr:`~Registration.lost` until it succeeds.
        """

    @abc.abstractmethod
    def watch(self, callback: FleetCallback) -> FleetWatch:
        """Follow the fleet; ``callback`` gets every list of events, starting with the engines
        already registered (as :class:`~kvframe.core.fleet.EngineAdded`)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Withdraw every registration, cancel every watch, release the connection. Safe
        twice."""


#: Builds a backend: ``factory(DiscoveryParams(...))``.
DiscoveryFactory = Callable[[DiscoveryParams], Discovery]


class WatchBase(FleetWatch):
    """The shared half of a watch: a :class:`~kvframe.core.fleet.FleetView` behind a lock.

    A backend's watcher thread calls :meth:`observe_put`, :meth:`observe_delete` and
    :meth:`observe_snapshot` with its clock's ``now``; each runs the view and hands the events
    to the callback under the lock (so callbacks never overlap and arrive in order). A
    callback that raises is counted (:attr:`callback_errors`) and the watch goes on.
    """

    def __init__(self, callback: FleetCallback) -> None:
        self._callback = callback
        self._view = FleetView()
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._connected = False
        self.callback_errors = 0
        """Callbacks that raised (the events were still applied to the view)."""
        self.last_callback_error: BaseException | None = None

    def live(self) -> tuple[EngineRecord, ...]:
        """The engines live as of the latest observation."""
        with self._lock:
            return self._view.live()

    @property
    def malformed(self) -> int:
        """Records skipped because they did not decode or did not match their key."""
        return self._view.malformed

    @property
    def last_error(self) -> str | None:
        """Why the latest malformed record was skipped."""
        return self._view.last_error

    @property
    def connected(self) -> bool:
        """Whether the watch currently follows the service."""
        return self._connected and not self._cancelled.is_set()

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called."""
        return self._cancelled.is_set()

    def wait_cancelled(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, less if :meth:`cancel` is called; return whether
        it was (a backend thread's interruptible wait)."""
        return self._cancelled.wait(timeout)

    def cancel(self) -> None:
        """Stop delivering events; backends stop their thread when they see it."""
        with self._lock:
            self._cancelled.set()

    def set_connected(self, connected: bool) -> None:
        """The backend (re)gained or lost the service (no events follow from this alone)."""
        self._connected = connected

    def observe_put(self, key: str, data: bytes, now: float) -> None:
        """``key`` was written."""
        self._feed(lambda: self._view.put(key, data, now))

    def observe_delete(self, key: str, now: float) -> None:
        """``key`` was deleted or expired."""
        self._feed(lambda: self._view.delete(key, now))

    def observe_snapshot(self, items: Mapping[str, bytes], now: float) -> None:
        """A complete listing of the fleet's keys."""
        self._feed(lambda: self._view.snapshot(items, now))

    def _feed(self, step: Callable[[], list[FleetEvent]]) -> None:
        with self._lock:
            if self._cancelled.is_set():
                return
            events = step()
            if not events:
                return
            try:
                self._callback(events)
            except Exception as exc:
                self.callback_errors += 1
                self.last_callback_error = exc
