"""The ``etcd`` discovery backend, on etcd's HTTP/JSON gateway through ``etcd3gw``.

Capability card
---------------

=====================  ==============================================================
registrations          ``<prefix>engines/<engine_id>`` = the record's JSON, attached to
                       an etcd lease of ``ttl`` seconds the registrant keeps alive every
                       ``interval``; withdrawn by revoking the lease
liveness               an engine that dies vanishes within ``ttl`` of its last
                       keep-alive (etcd deletes the key with the lease); its registrant,
                       if alive but cut off, reports the registration lost before that
watch                  a listing of the prefix, then etcd's watch from the listing's
                       revision; the stream is reopened (with a fresh listing) after
                       ``watch_timeout`` of silence, a broken connection or a compaction
records               JSON, validated on read (:func:`kvframe.core.fleet.decode_record`);
                       a malformed record is skipped and counted, never raised
etcd                   3.4 or newer (the ``/v3/`` gateway paths)
=====================  ==============================================================

Options (``DiscoveryParams.options``; an unknown key or bad value raises
:class:`~kvframe.errors.ConfigError` naming it):

- ``endpoint`` (default ``"http://127.0.0.1:2379"``) — etcd's client URL (``http`` or
  ``https``).
- ``prefix`` (default ``"/kvframe/fleet/"``) — the key prefix of this fleet; must end with
  ``/``.
- ``ttl`` (whole seconds ≥ 2, default 10) — the lease TTL (etcd refuses shorter ones).
- ``interval`` (seconds, default ``ttl / 3``) — the keep-alive interval.
- ``request_timeout`` (seconds, default 2) — the bound of every request (grant, put,
  keep-alive, revoke, listing, opening the watch).
- ``watch_timeout`` (seconds, default 5) — the longest the watch stream stays silent before it
  is reopened with a fresh listing (so a half-open connection is noticed within it).
- ``retry`` (seconds, default 0.1) — the first delay before reconnecting or registering again
  after a failure; it doubles up to ``interval``.

Bounds: every request ends within ``request_timeout``; a dead engine vanishes within
``ttl`` (etcd's clock); a live registrant that cannot keep alive reports the registration lost
at most ``ttl - ttl/20`` after its last confirmed keep-alive was sent; a watcher notices a
silent or broken stream within ``watch_timeout`` and relists within ``request_timeout`` plus
its backoff (at most ``interval``).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

import etcd3gw
import requests
from etcd3gw.lease import Lease

from kvframe.core.fleet import EngineRecord, encode_record
from kvframe.discovery.keepalive import KeepAliveLoop, KeptDiscovery
from kvframe.discovery.options import check_options, seconds, text
from kvframe.errors import ConfigError
from kvframe.spi.discovery import (
    DiscoveryParams,
    FleetCallback,
    WatchBase,
)

__all__ = ["OPTIONS", "EtcdDiscovery", "EtcdWatch"]

#: The option keys the backend accepts.
OPTIONS = frozenset(
    {"endpoint", "prefix", "ttl", "interval", "request_timeout", "watch_timeout", "retry"}
)
_MAX_LINE = 1 << 22  # a watch response larger than 4 MiB is not a fleet's


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _range_end(prefix: bytes) -> bytes:
    # The first key after every key starting with prefix (etcd's prefix convention).
    return prefix[:-1] + bytes([prefix[-1] + 1])


class EtcdWatch(WatchBase):
    """A watch of the fleet's prefix on a thread of its own: list, watch from the listing's
    revision, relist on any break (its counters say how often)."""

    def __init__(self, backend: EtcdDiscovery, callback: FleetCallback) -> None:
        super().__init__(callback)
        self._b = backend
        self._response: requests.Response | None = None
        self.reconnects = 0
        """Times the stream was reopened after an error (not counting quiet timeouts)."""
        self.resyncs = 0
        """Listings taken (one per (re)connection)."""
        self.resets = 0
        """Listings that found etcd's revision lower than before (another cluster)."""
        self._revision = 0  # the highest revision this watch has seen
        self.bad_events = 0
        """Watch events whose key or value was not valid base64 (skipped)."""
        self.last_failure: str | None = None
        self._thread = threading.Thread(target=self._run, name="kvframe-etcd-watch", daemon=True)
        self._thread.start()

    def cancel(self) -> None:
        super().cancel()
        resp = self._response
        if resp is not None:
            resp.close()  # the thread then ends within watch_timeout at the latest

    def _run(self) -> None:
        backoff = 0.0
        while not self.cancelled:
            try:
                revision = self._resync()
                backoff = 0.0
                self._follow(revision)
            except _Resync:
                self.set_connected(False)
            except Exception as exc:
                # Whatever the connection did (including being closed under the reader by
                # cancel): relist after a backoff; the watcher thread never dies of it.
                if self.wait_cancelled(0):
                    return
                self.set_connected(False)
                self.reconnects += 1
                self.last_failure = f"{type(exc).__name__}: {exc}"[:500]
                backoff = min(max(2 * backoff, self._b.retry), self._b.interval)
                self.wait_cancelled(backoff)

    def _resync(self) -> int:
        items, revision = self._b.list_prefix()
        if revision < self._revision:
            # etcd's revision went backwards: another cluster (restored, or restarted without
            # its data) that knows none of the registrations yet. Every live registrant
            # registers again within its keep-alive interval; listing now would report them
            # all missing. Wait a TTL, then trust the listing.
            self.resets += 1
            self.set_connected(False)
            if self.wait_cancelled(self._b.ttl):
                raise _Resync
            items, revision = self._b.list_prefix()
        self._revision = revision
        self.resyncs += 1
        self.set_connected(True)
        self.observe_snapshot(items, time.monotonic())
        return revision

    def _follow(self, revision: int) -> None:
        b = self._b
        prefix = b.prefix.encode()
        body: dict[str, Any] = {
            "create_request": {
                "key": _b64(prefix),
                "range_end": _b64(_range_end(prefix)),
                "start_revision": revision + 1,
            }
        }
        resp = b.client.session.post(
            b.client.get_url("/watch"),
            json=body,
            stream=True,
            timeout=(b.request_timeout, b.watch_timeout),
        )
        self._response = resp
        try:
            if resp.status_code != 200:
                raise _Resync
            for line in _lines(resp):
                if self.cancelled:
                    return
                self._apply_line(line)
        except requests.ConnectionError as exc:
            # A silent stream past watch_timeout is the normal way out: relist quietly.
            if "timed out" not in str(exc).lower():
                raise
        finally:
            self._response = None
            resp.close()

    def _apply_line(self, line: bytes) -> None:
        try:
            chunk = json.loads(line)
            result = chunk["result"]
        except (ValueError, KeyError, TypeError):
            raise _Resync from None  # an error object or garbage: start over from a listing
        if not isinstance(result, dict) or result.get("canceled") or result.get("compact_revision"):
            raise _Resync
        header = result.get("header")
        if isinstance(header, dict):
            with contextlib.suppress(TypeError, ValueError):
                self._revision = max(self._revision, int(header.get("revision", 0)))
        events = result.get("events") or []
        now = time.monotonic()
        for ev in events if isinstance(events, list) else []:
            try:
                kv = ev["kv"]
                key = base64.b64decode(kv["key"], validate=True).decode("utf-8")
                if ev.get("type", "PUT") == "DELETE":
                    self.observe_delete(key, now)
                else:
                    self.observe_put(key, base64.b64decode(kv.get("value", ""), validate=True), now)
            except (KeyError, TypeError, ValueError, binascii.Error):
                self.bad_events += 1


class _Resync(Exception):
    """The watch must start over from a listing (canceled, compacted, or unreadable)."""


def _lines(resp: requests.Response) -> Iterator[bytes]:
    buf = b""
    for part in resp.iter_content(chunk_size=None):
        buf += part
        if len(buf) > _MAX_LINE:
            raise _Resync
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                yield line
    if buf.strip():
        yield buf


class EtcdDiscovery(KeptDiscovery):
    """The ``etcd`` backend (see the module docstring for options and bounds)."""

    def __init__(
        self,
        *,
        endpoint: str,
        prefix: str,
        ttl: int,
        interval: float,
        request_timeout: float,
        watch_timeout: float,
        retry: float,
    ) -> None:
        url = urllib.parse.urlsplit(endpoint)
        self.prefix = prefix
        self.ttl = ttl
        self.interval = interval
        self.request_timeout = request_timeout
        self.watch_timeout = watch_timeout
        self.retry = retry
        self.client = etcd3gw.Etcd3Client(
            host=url.hostname or "127.0.0.1",
            port=url.port or 2379,
            protocol=url.scheme,
            timeout=request_timeout,
            api_path="/v3/",
        )
        super().__init__(
            KeepAliveLoop(
                "etcd",
                ttl=float(ttl),
                interval=interval,
                grant=self._grant,
                refresh=self._refresh,
                revoke=self._revoke,
                retry=retry,
            )
        )

    @classmethod
    def create(cls, params: DiscoveryParams) -> EtcdDiscovery:
        """The factory registered as ``etcd``. Connects to nothing yet.

        :raises ConfigError: an unknown option or a bad value (the message names it).
        """
        o = check_options("etcd", params.options, OPTIONS)
        endpoint = text("etcd", o, "endpoint", "http://127.0.0.1:2379")
        url = urllib.parse.urlsplit(endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ConfigError(
                f"etcd discovery: endpoint {endpoint!r} must be an http:// or https:// URL of "
                "an etcd client port (e.g. http://10.0.0.5:2379)"
            )
        prefix = text("etcd", o, "prefix", "/kvframe/fleet/")
        if not prefix.endswith("/"):
            raise ConfigError(f"etcd discovery: prefix {prefix!r} must end with '/'")
        ttl_raw = o.get("ttl", 10)
        if isinstance(ttl_raw, bool) or not isinstance(ttl_raw, int) or ttl_raw < 2:
            raise ConfigError(
                f"etcd discovery: option 'ttl' must be a whole number of seconds >= 2 (etcd's "
                f"lease granularity), got {ttl_raw!r}"
            )
        interval = seconds("etcd", o, "interval", ttl_raw / 3)
        if interval >= ttl_raw:
            raise ConfigError(
                f"etcd discovery: interval ({interval:g} s) must be shorter than ttl "
                f"({ttl_raw} s), or registrations lapse between keep-alives"
            )
        return cls(
            endpoint=endpoint,
            prefix=prefix,
            ttl=ttl_raw,
            interval=interval,
            request_timeout=seconds("etcd", o, "request_timeout", 2.0),
            watch_timeout=seconds("etcd", o, "watch_timeout", 5.0),
            retry=seconds("etcd", o, "retry", 0.1),
        )

    # -- requests (each bounded by request_timeout) ----------------------------------------
    def key(self, engine_id: str) -> str:
        """The key of ``engine_id``'s registration."""
        return f"{self.prefix}engines/{engine_id}"

    def list_prefix(self) -> tuple[dict[str, bytes], int]:
        """Every key under the prefix with its value, and the revision of the listing."""
        prefix = self.prefix.encode()
        result = self.client.post(
            self.client.get_url("/kv/range"),
            json={"key": _b64(prefix), "range_end": _b64(_range_end(prefix))},
        )
        revision = int(result["header"]["revision"])
        items: dict[str, bytes] = {}
        for kv in result.get("kvs") or []:
            try:
                key = base64.b64decode(kv["key"], validate=True).decode("utf-8")
                items[key] = base64.b64decode(kv.get("value", ""), validate=True)
            except (KeyError, TypeError, ValueError, binascii.Error):
                continue  # not even a key: nothing the view could count against an engine
        return items, revision

    def _grant(self, record: EngineRecord) -> tuple[Lease, float]:
        lease = self.client.lease(self.ttl)
        try:
            self.client.put(self.key(record.engine_id), encode_record(record), lease=lease)
        except Exception:
            self._revoke(lease, record)
            raise
        return lease, float(self.ttl)

    def _refresh(self, lease: Lease) -> float | None:
        ttl = lease.refresh()
        return float(ttl) if ttl > 0 else None

    def _revoke(self, lease: Lease, record: EngineRecord) -> None:
        lease.revoke()

    def new_watch(self, callback: FleetCallback) -> WatchBase:
        """Follow the prefix on a thread of its own (an :class:`EtcdWatch`)."""
        return EtcdWatch(self, callback)
