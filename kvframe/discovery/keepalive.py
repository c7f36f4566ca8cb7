"""The registrant's loop shared by TTL backends (``file``, ``kvframe-etcd``): grant, keep
alive, notice a lapse, register again.

A backend supplies three blocking calls, each bounded by its own request timeout:

- ``grant(record) -> (handle, ttl)`` publishes the record under a fresh TTL (etcd: grant a
  lease and put the key on it) and returns the backend's handle and the TTL granted;
- ``refresh(handle) -> ttl | None`` keeps it alive; ``None`` means the service no longer
  knows the handle (the lease expired), so the record must be granted again;
- ``revoke(handle, record)`` withdraws it (best effort).

One thread per backend runs every registration's :class:`~kvframe.core.fleet.KeepAliveClock`
(the decisions: when to renew, when the registration may have lapsed). Bounds, with ``ttl``
and ``interval`` the backend's options: a live process renews every ``interval``; a
registration whose process died vanishes from watchers within ``ttl`` of its last renewal; a
registrant that could not renew reports the registration lost (``on_lost``) at
``confirmed_until - margin``, before any watcher can see it vanish, and retries the grant
every ``retry`` seconds (doubling up to ``interval``) until the service answers.

Threads: the loop thread calls ``grant``, ``refresh`` and ``revoke`` and the ``on_lost``
callbacks; :meth:`KeepAliveLoop.add` makes the first grant on the caller's thread. Shared
state (the registrations list and each registration's clock) is guarded by one lock; the
blocking calls run outside it.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable
from typing import Any

from kvframe.core.fleet import EngineRecord, KeepAliveClock
from kvframe.errors import ConfigError
from kvframe.spi.discovery import (
    Discovery,
    FleetCallback,
    FleetWatch,
    LostCallback,
    Registration,
    WatchBase,
)

__all__ = ["KeepAliveLoop", "KeptDiscovery", "KeptRegistration"]

GrantFn = Callable[[EngineRecord], tuple[Any, float]]
RefreshFn = Callable[[Any], "float | None"]
RevokeFn = Callable[[Any, EngineRecord], None]


class KeptRegistration(Registration):
    """A registration kept alive by a :class:`KeepAliveLoop`."""

    def __init__(
        self,
        loop: KeepAliveLoop,
        record: EngineRecord,
        clock: KeepAliveClock,
        on_lost: LostCallback | None,
    ) -> None:
        self._loop = loop
        self._record = record
        self.clock = clock
        """The registration's keep-alive decisions (read under the loop's lock)."""
        self.on_lost = on_lost
        self.handle: Any = None
        """The backend's handle of the current grant (``None``: not granted)."""
        self.withdrawn = False
        self.reported_lost = False
        self.grants = 0
        """Successful grants (more than one: it registered again after a lapse)."""
        self.retry_at = 0.0
        self.backoff = 0.0
        self.last_error: str | None = None

    @property
    def record(self) -> EngineRecord:
        """What is registered."""
        return self._record

    @property
    def lost(self) -> bool:
        """Whether the registration may have lapsed at this moment."""
        return self._loop.is_lost(self)

    def withdraw(self) -> None:
        """Revoke the grant and stop renewing; safe twice, never raises."""
        self._loop.withdraw(self)


class KeepAliveLoop:
    """Keeps a backend's registrations alive on one thread (see the module docstring).

    :param name: the backend's name (thread name, messages).
    :param ttl: TTL asked for, seconds.
    :param interval: keep-alive interval (default ``ttl / 3``).
    :param retry: first retry delay after a failed grant (doubles up to ``interval``).
    """

    def __init__(
        self,
        name: str,
        *,
        ttl: float,
        interval: float | None,
        grant: GrantFn,
        refresh: RefreshFn,
        revoke: RevokeFn,
        retry: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        KeepAliveClock(ttl, interval=interval)  # validates
        self._name = name
        self._ttl = ttl
        self._interval = interval
        self._grant = grant
        self._refresh = refresh
        self._revoke = revoke
        self._retry = retry
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._regs: list[KeptRegistration] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    def add(self, record: EngineRecord, on_lost: LostCallback | None) -> KeptRegistration:
        """Register ``record``: the first grant runs here; if it fails the loop retries."""
        reg = KeptRegistration(
            self, record, KeepAliveClock(self._ttl, interval=self._interval), on_lost
        )
        self._try_grant(reg)
        with self._lock:
            self._regs.append(reg)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"kvframe-{self._name}-keepalive", daemon=True
                )
                self._thread.start()
            self._wake.notify_all()
        return reg

    def is_lost(self, reg: KeptRegistration) -> bool:
        """Whether ``reg`` may have lapsed now."""
        with self._lock:
            return reg.handle is None or reg.clock.lost(self._clock())

    def withdraw(self, reg: KeptRegistration) -> None:
        """Stop renewing ``reg`` and revoke its grant (best effort)."""
        with self._lock:
            if reg.withdrawn:
                return
            reg.withdrawn = True
            if reg in self._regs:
                self._regs.remove(reg)
            handle, reg.handle = reg.handle, None
        if handle is not None:
            try:
                self._revoke(handle, reg.record)
            except Exception as exc:  # the grant then ends with its TTL
                reg.last_error = f"withdraw: {exc}"

    def close(self) -> None:
        """Withdraw every registration and stop the thread. Safe twice."""
        with self._lock:
            self._closed = True
            regs = list(self._regs)
            self._wake.notify_all()
            thread = self._thread
        for reg in regs:
            self.withdraw(reg)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)

    # -- the thread ----------------------------------------------------------------------
    def _try_grant(self, reg: KeptRegistration) -> None:
        sent = self._clock()
        try:
            handle, ttl = self._grant(reg.record)
        except Exception as exc:
            with self._lock:
                reg.last_error = f"grant: {exc}"
                reg.backoff = min(max(2 * reg.backoff, self._retry), reg.clock.interval)
                reg.retry_at = self._clock() + reg.backoff
            return
        stale = None
        with self._lock:
            if reg.withdrawn or self._closed:
                stale = handle
            else:
                reg.handle = handle
                reg.clock.registered(sent, ttl)
                reg.grants += 1
                reg.backoff = 0.0
                reg.reported_lost = False
                reg.last_error = None
        if stale is not None:
            try:
                self._revoke(stale, reg.record)
            except Exception as exc:
                reg.last_error = f"withdraw: {exc}"

    def _keepalive(self, reg: KeptRegistration, handle: Any) -> None:
        sent = self._clock()
        try:
            ttl = self._refresh(handle)
        except Exception as exc:
            with self._lock:
                reg.clock.attempted(sent)
                reg.last_error = f"keep-alive: {exc}"
            return
        with self._lock:
            if reg.handle is not handle:
                return
            if ttl is None or ttl <= 0:
                reg.clock.forget()
                reg.handle = None
                reg.last_error = "keep-alive: the service no longer knows the registration"
            else:
                reg.clock.renewed(sent, ttl)

    def _run(self) -> None:
        while True:
            lost: list[tuple[KeptRegistration, str]] = []
            with self._lock:
                if self._closed:
                    return
                now = self._clock()
                todo: list[tuple[KeptRegistration, Any]] = []
                wake = now + self._ttl
                for reg in self._regs:
                    due = reg.retry_at if reg.handle is None else reg.clock.next_keepalive()
                    if due <= now:
                        todo.append((reg, reg.handle))
                    else:
                        wake = min(wake, due)
                    if reg.handle is not None:
                        wake = min(wake, max(now, reg.clock.confirmed_until - reg.clock.margin))
                    if not reg.reported_lost and (reg.handle is None or reg.clock.lost(now)):
                        reg.reported_lost = True
                        lost.append(
                            (reg, reg.last_error or "the registration was not renewed in time")
                        )
                if not todo and not lost:
                    self._wake.wait(timeout=max(0.0, wake - now))
                    continue
            for reg, why in lost:
                if reg.on_lost is not None:
                    try:
                        reg.on_lost(why)
                    except Exception as exc:
                        reg.last_error = f"on_lost callback raised {exc!r}"
            for reg, handle in todo:
                if handle is None:
                    self._try_grant(reg)
                else:
                    self._keepalive(reg, handle)


class KeptDiscovery(Discovery):
    """The shared half of a TTL backend: registrations on a :class:`KeepAliveLoop`, watches
    made by :meth:`new_watch`, :meth:`close` that ends both. A subclass builds the loop with
    its ``grant``/``refresh``/``revoke`` calls and implements :meth:`new_watch`."""

    def __init__(self, loop: KeepAliveLoop) -> None:
        self._loop = loop
        self._watches: list[WatchBase] = []
        self._closed = False

    @abc.abstractmethod
    def new_watch(self, callback: FleetCallback) -> WatchBase:
        """Start a watch (its own thread) delivering to ``callback``."""

    def register(
        self, record: EngineRecord, *, on_lost: LostCallback | None = None
    ) -> Registration:
        """Grant ``record`` and keep it alive on the loop; an unreachable service does not
        raise: the registration stays lost and is granted again as soon as possible."""
        self._check_open()
        return self._loop.add(record, on_lost)

    def watch(self, callback: FleetCallback) -> FleetWatch:
        """Follow the fleet on a thread of the watch's own."""
        self._check_open()
        w = self.new_watch(callback)
        self._watches.append(w)
        return w

    def close(self) -> None:
        """Withdraw this backend's registrations, cancel its watches. Safe twice."""
        self._closed = True
        self._loop.close()
        for w in self._watches:
            w.cancel()
        self._watches.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this discovery backend was closed; create another")
