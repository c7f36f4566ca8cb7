"""The ``mem`` discovery backend: a fleet inside one process.

Options (``DiscoveryParams.options``; an unknown key raises
:class:`~kvframe.errors.ConfigError`):

- ``fleet`` — the :class:`MemFleet` to join. Default: the process's default fleet
  (:func:`default_fleet`). Tests should build their own.

Registrations live until withdrawn (there is no process to die separately from the watcher),
so there is no TTL; :meth:`MemFleet.drop` makes an engine vanish as an expired registration
would. Callbacks run on the thread that wrote (register, withdraw, drop), in order.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from kvframe.core.fleet import EngineRecord, encode_record
from kvframe.discovery.options import check_options
from kvframe.errors import ConfigError
from kvframe.spi.discovery import (
    Discovery,
    DiscoveryParams,
    FleetCallback,
    FleetWatch,
    LostCallback,
    Registration,
    WatchBase,
)

__all__ = ["MemDiscovery", "MemFleet", "default_fleet"]

_PREFIX = "/kvframe/engines/"


class MemFleet:
    """The shared store of an in-process fleet: keys to record bytes, and the watches."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._items: dict[str, bytes] = {}
        self._watches: list[WatchBase] = []

    def put(self, key: str, data: bytes) -> None:
        """Write ``key`` (raw bytes: tests use it to plant malformed records)."""
        with self._lock:
            self._items[key] = data
            for w in list(self._watches):
                w.observe_put(key, data, 0.0)

    def delete(self, key: str) -> None:
        """Delete ``key`` (nothing if absent)."""
        with self._lock:
            if self._items.pop(key, None) is None:
                return
            for w in list(self._watches):
                w.observe_delete(key, 0.0)

    def drop(self, engine_id: str) -> None:
        """Make ``engine_id`` vanish, as if its registration expired."""
        self.delete(_PREFIX + engine_id)

    def _watch(self, watch: WatchBase) -> None:
        with self._lock:
            self._watches.append(watch)
            watch.set_connected(True)
            watch.observe_snapshot(dict(self._items), 0.0)

    def _unwatch(self, watch: WatchBase) -> None:
        with self._lock:
            if watch in self._watches:
                self._watches.remove(watch)


_DEFAULT = MemFleet()


def default_fleet() -> MemFleet:
    """The process's default fleet (what ``mem`` without a ``fleet`` option joins)."""
    return _DEFAULT


class _MemRegistration(Registration):
    def __init__(self, fleet: MemFleet, record: EngineRecord, owner: MemDiscovery) -> None:
        self._fleet = fleet
        self._record = record
        self._owner = owner
        self._withdrawn = False

    @property
    def record(self) -> EngineRecord:
        return self._record

    @property
    def lost(self) -> bool:
        return False

    def withdraw(self) -> None:
        if not self._withdrawn:
            self._withdrawn = True
            self._fleet.delete(_PREFIX + self._record.engine_id)
            self._owner._forget(self)


class _MemWatch(WatchBase):
    def __init__(self, fleet: MemFleet, callback: FleetCallback) -> None:
        super().__init__(callback)
        self._fleet = fleet

    def cancel(self) -> None:
        super().cancel()
        self._fleet._unwatch(self)


class MemDiscovery(Discovery):
    """A backend joined to a :class:`MemFleet` (see the module docstring)."""

    def __init__(self, fleet: MemFleet) -> None:
        self._fleet = fleet
        self._registrations: list[_MemRegistration] = []
        self._watches: list[_MemWatch] = []
        self._closed = False

    @classmethod
    def create(cls, params: DiscoveryParams) -> MemDiscovery:
        """The factory registered as ``mem``.

        :raises ConfigError: an unknown option, or ``fleet`` is not a :class:`MemFleet`.
        """
        opts: Mapping[str, Any] = check_options("mem", params.options, {"fleet"})
        fleet = opts.get("fleet", _DEFAULT)
        if not isinstance(fleet, MemFleet):
            raise ConfigError(
                f"mem discovery: option fleet must be a kvframe.discovery.mem.MemFleet, got "
                f"{type(fleet).__name__}"
            )
        return cls(fleet)

    def register(
        self, record: EngineRecord, *, on_lost: LostCallback | None = None
    ) -> Registration:
        """Publish ``record`` at once; it never lapses (see the module docstring)."""
        self._check_open()
        reg = _MemRegistration(self._fleet, record, self)
        self._registrations.append(reg)
        self._fleet.put(_PREFIX + record.engine_id, encode_record(record))
        return reg

    def watch(self, callback: FleetCallback) -> FleetWatch:
        """Follow the fleet; the callback runs on the writer's thread."""
        self._check_open()
        w = _MemWatch(self._fleet, callback)
        self._watches.append(w)
        self._fleet._watch(w)
        return w

    def close(self) -> None:
        """Withdraw everything registered here and cancel every watch. Safe twice."""
        self._closed = True
        for reg in list(self._registrations):
            reg.withdraw()
        for w in self._watches:
            w.cancel()
        self._watches.clear()

    def _forget(self, reg: _MemRegistration) -> None:
        if reg in self._registrations:
            self._registrations.remove(reg)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this discovery backend was closed; create another")
