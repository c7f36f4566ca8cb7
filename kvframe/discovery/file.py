"""The ``file`` discovery backend: a fleet on one host, in a shared directory.

Each registration is a file ``<directory>/<engine_id>.json``: a first line with the moment it
expires (this host's ``CLOCK_MONOTONIC``, which every process on the host shares) and the
record's JSON after it. The registrant rewrites it (atomically: a temporary file renamed over
it) every keep-alive interval with a new expiry; withdrawing deletes it. A watcher lists the
directory every ``poll_interval`` and treats a file whose expiry passed as absent, so an
engine whose process died vanishes within ``ttl + poll_interval``. A file that does not parse
is skipped and counted (at every poll that sees it).

Options (``DiscoveryParams.options``; an unknown key or bad value raises
:class:`~kvframe.errors.ConfigError`):

- ``directory`` (required) — the shared directory (created if missing).
- ``ttl`` (seconds, default 10) — how long a registration outlives its last rewrite.
- ``interval`` (seconds, default ``ttl / 3``) — the keep-alive interval.
- ``poll_interval`` (seconds, default 0.2) — how often a watcher lists the directory.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from kvframe.core.fleet import EngineRecord, encode_record
from kvframe.discovery.keepalive import KeepAliveLoop, KeptDiscovery
from kvframe.discovery.options import check_options, seconds, text
from kvframe.errors import ConfigError
from kvframe.spi.discovery import (
    DiscoveryParams,
    FleetCallback,
    WatchBase,
)

__all__ = ["FileDiscovery"]

_SUFFIX = ".json"
_MAX_FILE = 32768


class _FileWatch(WatchBase):
    def __init__(self, directory: Path, poll: float, callback: FleetCallback) -> None:
        super().__init__(callback)
        self._dir = directory
        self._poll = poll
        self._thread = threading.Thread(target=self._run, name="kvframe-file-watch", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        super().cancel()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self.cancelled:
            items: dict[str, bytes] = {}
            try:
                names = os.listdir(self._dir)
                self.set_connected(True)
            except OSError:
                self.set_connected(False)  # discovery down: nothing vanishes
                time.sleep(self._poll)
                continue
            now = time.monotonic()
            for name in names:
                if not name.endswith(_SUFFIX):
                    continue
                try:
                    with open(self._dir / name, "rb") as f:
                        raw = f.read(_MAX_FILE + 1)
                except OSError:
                    continue  # removed between listing and reading
                head, _, body = raw.partition(b"\n")
                try:
                    expires = float(head)
                except ValueError:
                    expires = float("inf")  # let the view count the malformed record
                    body = raw
                if expires > now:
                    items["/" + name[: -len(_SUFFIX)]] = body
            self.observe_snapshot(items, now)
            time.sleep(self._poll)


class FileDiscovery(KeptDiscovery):
    """The ``file`` backend (see the module docstring)."""

    def __init__(self, directory: Path, *, ttl: float, interval: float | None, poll: float) -> None:
        self._dir = directory
        self._ttl = ttl
        self._poll = poll
        super().__init__(
            KeepAliveLoop(
                "file",
                ttl=ttl,
                interval=interval,
                grant=self._write,
                refresh=self._rewrite,
                revoke=self._remove,
            )
        )

    @classmethod
    def create(cls, params: DiscoveryParams) -> FileDiscovery:
        """The factory registered as ``file``; raises :class:`ConfigError` for bad options."""
        o = check_options("file", params.options, {"directory", "ttl", "interval", "poll_interval"})
        directory = Path(text("file", o, "directory", None))
        ttl = seconds("file", o, "ttl", 10.0)
        interval = seconds("file", o, "interval", ttl / 3)
        if interval >= ttl:
            raise ConfigError(
                f"file discovery: interval ({interval:g} s) must be shorter than ttl ({ttl:g} s)"
            )
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"file discovery: cannot create directory {str(directory)!r}: {exc}"
            ) from exc
        return cls(
            directory, ttl=ttl, interval=interval, poll=seconds("file", o, "poll_interval", 0.2)
        )

    # -- the keep-alive loop's calls -------------------------------------------------------
    def _path(self, record: EngineRecord) -> Path:
        return self._dir / f"{record.engine_id}{_SUFFIX}"

    def _write(self, record: EngineRecord) -> tuple[EngineRecord, float]:
        path = self._path(record)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(b"%r\n" % (time.monotonic() + self._ttl) + encode_record(record))
        os.replace(tmp, path)
        return record, self._ttl

    def _rewrite(self, record: EngineRecord) -> float:
        self._write(record)
        return self._ttl

    def _remove(self, record: EngineRecord, _: EngineRecord) -> None:
        self._path(record).unlink(missing_ok=True)

    def new_watch(self, callback: FleetCallback) -> WatchBase:
        """List the directory every ``poll_interval`` on a thread of its own."""
        return _FileWatch(self._dir, self._poll, callback)
