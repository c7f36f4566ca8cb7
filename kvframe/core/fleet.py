"""The fleet as one engine sees it: registration records, the live view, and keep-alive timing.

Three pure pieces, none of which reads a clock, sleeps or touches a socket (a discovery
backend carries the I/O and feeds them):

- :class:`EngineRecord`, what an engine registers (role, address, side-channel ports,
  transport, TP size, capabilities, an incarnation token), with :func:`encode_record` and
  :func:`decode_record`: JSON, one schema version, every field checked on read. Records come
  from a coordination service that other processes write to, so :func:`decode_record` treats
  its input as hostile and raises only :class:`~kvframe.errors.CodecError`.
- :class:`FleetView`, the live engines. It takes what the backend observed — a key written
  (:meth:`FleetView.put`), a key deleted (:meth:`FleetView.delete`), a complete listing
  (:meth:`FleetView.snapshot`) — each with ``now``, and returns the fleet events that follow
  (:class:`EngineAdded`, :class:`EngineChanged`, :class:`EngineVanished`). A malformed record
  is skipped and counted, never raised. Only an observation can make an engine vanish: a
  backend that lost its connection reports nothing, so *discovery down* never means *engine
  dead* (leases keep bounding everything meanwhile).
- :class:`KeepAliveClock`, the registrant's side: from the send times of the keep-alives the
  service answered and the TTL it granted, the earliest moment the service may drop the
  registration (:attr:`KeepAliveClock.confirmed_until`), when to send the next keep-alive, and
  whether the registration must be considered lost.

Transitions of the view, for one engine id::

    absent --put--> live (EngineAdded)
    live --put, same incarnation, other fields--> live (EngineChanged)
    live --put, another incarnation--> live (EngineVanished "replaced", then EngineAdded)
    live --delete / missing from a snapshot--> absent (EngineVanished)
"""

from __future__ import annotations

import collections
import enum
import hashlib
import json
import math
import re
from collections.abc import Mapping
from typing import Any

import attrs

from kvframe.errors import CodecError

__all__ = [
    "MAX_RECORD_BYTES",
    "RECORD_SCHEMA",
    "EngineAdded",
    "EngineChanged",
    "EngineRecord",
    "EngineRole",
    "EngineVanished",
    "FleetEvent",
    "FleetView",
    "KeepAliveClock",
    "decode_record",
    "encode_record",
    "is_engine_id",
]

#: The schema version written into every record (``"kvframe_engine": 1``); a record of another
#: version is refused on read (skipped and counted by :class:`FleetView`).
RECORD_SCHEMA = 1
#: Largest encoded record accepted, bytes: a record is a few hundred bytes; anything far larger
#: is not one of ours.
MAX_RECORD_BYTES = 16384
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_TOKEN = re.compile(r"[A-Za-z0-9._-]{1,64}")
_CAP = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,63}")
_MAX_PORTS = 256
_MAX_CAPS = 64


class EngineRole(enum.Enum):
    """What an engine does in a P/D fleet; the values are the ``kv_role`` words."""

    PRODUCER = "kv_producer"
    """A prefill engine: it holds KV under leases for decoders to read."""
    CONSUMER = "kv_consumer"
    """A decode engine: it reads KV from prefill engines."""
    BOTH = "kv_both"
    """Both (multi-turn engines that keep a turn's KV for the next prefill)."""


def is_engine_id(value: Any) -> bool:
    """Whether ``value`` is an allowed fleet engine id: a string of 1-128 letters, digits,
    ``.``, ``_`` or ``-``, starting with a letter or digit."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def _check_id(inst: Any, attribute: Any, value: str) -> None:
    if not is_engine_id(value):
        raise ValueError(
            f"engine_id {value!r} is not allowed: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (it is the last part of the registration key)"
        )


def _check_host(inst: Any, attribute: Any, value: str) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= 253 or any(c.isspace() for c in value):
        raise ValueError(
            f"host {value!r} is not allowed: give the address decoders connect to (a host name "
            "or IP address, 1-253 characters, no spaces)"
        )


def _check_ports(inst: Any, attribute: Any, value: tuple[int, ...]) -> None:
    if len(value) > _MAX_PORTS:
        raise ValueError(
            f"side_channel_ports must list 0-{_MAX_PORTS} ports (one per TP rank), got {len(value)}"
        )
    for p in value:
        if type(p) is not int or not 0 < p < 65536:
            raise ValueError(f"side_channel_ports: {p!r} is not a TCP port (1-65535)")


def _check_name(inst: Any, attribute: Any, value: str) -> None:
    if not isinstance(value, str) or _CAP.fullmatch(value) is None:
        raise ValueError(
            f"{attribute.name} {value!r} is not allowed: 1-64 letters, digits, '.', '_', ':' "
            "or '-', starting with a letter or digit"
        )


def _check_tp(inst: Any, attribute: Any, value: int) -> None:
    if type(value) is not int or not 1 <= value <= _MAX_PORTS:
        raise ValueError(f"tp_size must be an integer from 1 to {_MAX_PORTS}, got {value!r}")


def _check_caps(inst: Any, attribute: Any, value: frozenset[str]) -> None:
    if len(value) > _MAX_CAPS:
        raise ValueError(f"capabilities: at most {_MAX_CAPS} entries, got {len(value)}")
    for c in value:
        _check_name(inst, attribute, c)


def _check_api_port(inst: Any, attribute: Any, value: int | None) -> None:
    if value is not None and (type(value) is not int or not 0 < value < 65536):
        raise ValueError(f"api_port: {value!r} is not a TCP port (1-65535) or None")


def _check_token(inst: Any, attribute: Any, value: str) -> None:
    if not isinstance(value, str) or _TOKEN.fullmatch(value) is None:
        raise ValueError(
            f"incarnation {value!r} is not allowed: 1-64 letters, digits, '.', '_' or '-' "
            "(a fresh random token per engine start)"
        )


@attrs.frozen(kw_only=True)
class EngineRecord:
    """One engine's registration: everything a router or a peer needs to reach it.

    :raises ValueError: a field is out of range; the message names the field and the rule.
    """

    engine_id: str = attrs.field(validator=_check_id)
    """The engine's ``engine_id`` (the P/D connector's name for it)."""
    role: EngineRole = attrs.field(validator=attrs.validators.instance_of(EngineRole))
    host: str = attrs.field(validator=_check_host)
    """The address its side channel listens on."""
    side_channel_ports: tuple[int, ...] = attrs.field(converter=tuple, validator=_check_ports)
    """One handshake port per TP rank, rank order; empty for an engine that runs no side
    channel (a decoder that only reads)."""
    transport: str = attrs.field(validator=_check_name)
    """The transport its connector uses (``"nixl"``, ``"ucx"``, ``"inprocess"``)."""
    tp_size: int = attrs.field(validator=_check_tp)
    capabilities: frozenset[str] = attrs.field(
        default=frozenset(), converter=frozenset, validator=_check_caps
    )
    """Free-form feature words (``"push"``, ``"multiturn"``, a model name ...)."""
    incarnation: str = attrs.field(validator=_check_token)
    """A random token per engine start: a record with another incarnation is another instance
    of the engine (the old one's leases and KV are gone)."""
    api_port: int | None = attrs.field(default=None, validator=_check_api_port)
    """The TCP port of the engine's serving API (HTTP) on :attr:`host`, where a router sends
    its requests; ``None`` for an engine that serves none (encoded only when set)."""

    def __attrs_post_init__(self) -> None:
        if self.side_channel_ports and len(self.side_channel_ports) != self.tp_size:
            raise ValueError(
                f"engine {self.engine_id!r}: side_channel_ports lists "
                f"{len(self.side_channel_ports)} port(s) for tp_size {self.tp_size}; give one "
                "port per TP rank"
            )


def encode_record(record: EngineRecord) -> bytes:
    """The record as compact JSON (UTF-8), with the schema version; never pickle."""
    fields: dict[str, Any] = {
        "kvframe_engine": RECORD_SCHEMA,
        "engine_id": record.engine_id,
        "role": record.role.value,
        "host": record.host,
        "side_channel_ports": list(record.side_channel_ports),
        "transport": record.transport,
        "tp_size": record.tp_size,
        "capabilities": sorted(record.capabilities),
        "incarnation": record.incarnation,
    }
    if record.api_port is not None:
        fields["api_port"] = record.api_port
    return json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()


_FIELDS = {
    "kvframe_engine",
    "engine_id",
    "role",
    "host",
    "side_channel_ports",
    "transport",
    "tp_size",
    "capabilities",
    "incarnation",
}
_OPTIONAL = {"api_port"}


def decode_record(data: bytes) -> EngineRecord:
    """Parse and validate a record written by :func:`encode_record`.

    Total: any input either yields a valid :class:`EngineRecord` or raises
    :class:`~kvframe.errors.CodecError` naming what was wrong (size, JSON, schema version, an
    unknown or missing field, a field's type or range). Unknown fields are refused rather than
    ignored, so a record from a newer schema is not half-read.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError(f"an engine record must be bytes, got {type(data).__name__}")
    if len(data) > MAX_RECORD_BYTES:
        raise CodecError(f"engine record of {len(data)} bytes exceeds {MAX_RECORD_BYTES}")
    try:
        obj = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CodecError(f"engine record is not UTF-8 JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise CodecError(f"engine record must be a JSON object, got {type(obj).__name__}")
    version = obj.get("kvframe_engine")
    if version != RECORD_SCHEMA:
        raise CodecError(
            f"engine record schema {version!r} is not {RECORD_SCHEMA}: a record from another "
            "kvframe version or not a kvframe record"
        )
    if not _FIELDS <= set(obj) <= _FIELDS | _OPTIONAL:
        missing = sorted(_FIELDS - set(obj))
        extra = sorted(set(obj) - _FIELDS - _OPTIONAL)
        raise CodecError(f"engine record fields: missing {missing}, unknown {extra}")
    ports, caps = obj["side_channel_ports"], obj["capabilities"]
    if not isinstance(ports, list) or not isinstance(caps, list):
        raise CodecError("engine record: side_channel_ports and capabilities must be lists")
    if not all(isinstance(c, str) for c in caps):
        raise CodecError("engine record: capabilities must be strings")
    try:
        return EngineRecord(
            engine_id=obj["engine_id"],
            role=EngineRole(obj["role"]),
            host=obj["host"],
            side_channel_ports=tuple(ports),
            transport=obj["transport"],
            tp_size=obj["tp_size"],
            capabilities=frozenset(caps),
            incarnation=obj["incarnation"],
            api_port=obj.get("api_port"),
        )
    except (TypeError, ValueError) as exc:
        raise CodecError(f"engine record is invalid: {exc}") from None


# -- the view ---------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class EngineAdded:
    """An engine appeared (or a new incarnation of it)."""

    record: EngineRecord
    at: float
    """The ``now`` of the observation."""


@attrs.frozen(kw_only=True)
class EngineChanged:
    """A live engine re-registered the same incarnation with other fields."""

    old: EngineRecord
    record: EngineRecord
    at: float


@attrs.frozen(kw_only=True)
class EngineVanished:
    """An engine left the fleet: its registration was withdrawn, expired (its TTL ran out) or
    was replaced by another incarnation."""

    record: EngineRecord
    """Its last record."""
    at: float
    reason: str
    """``"deleted"`` (withdrawn or expired: the service does not say which), ``"replaced"``
    (another incarnation registered) or ``"missing"`` (absent from a complete listing)."""


#: What :class:`FleetView` returns.
FleetEvent = EngineAdded | EngineChanged | EngineVanished


class FleetView:
    """The live engines under one key prefix, built from observations.

    Keys are the backend's (``<prefix><engine_id>``); a record whose ``engine_id`` is not its
    key's last part is refused (one engine cannot register under another's key). Every input
    takes ``now`` and returns the events that follow, in order; nothing here reads a clock.

    :param remember_vanished: how many vanished engines :meth:`vanished_at` remembers.
    :param remember_malformed: how many malformed entries (key and a digest of the bytes) are
        remembered so that seeing the same bytes again (every poll of a listing backend,
        every relist) does not count them again; the oldest is forgotten first.
    """

    def __init__(self, *, remember_vanished: int = 1024, remember_malformed: int = 1024) -> None:
        self._live: dict[str, EngineRecord] = {}
        self._vanished: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._remember = remember_vanished
        self._malformed = 0
        self._last_error: str | None = None
        # key -> digest of the malformed bytes last seen under it (bounded, oldest first out).
        self._bad: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._remember_bad = remember_malformed

    # -- inspection ----------------------------------------------------------------------
    def live(self) -> tuple[EngineRecord, ...]:
        """The live engines, by engine id."""
        return tuple(self._live[k] for k in sorted(self._live))

    def get(self, engine_id: str) -> EngineRecord | None:
        """The live record of ``engine_id``, or ``None``."""
        return self._live.get(engine_id)

    def vanished_at(self, engine_id: str) -> float | None:
        """When ``engine_id`` last vanished (``None``: never seen vanish, or forgotten)."""
        return self._vanished.get(engine_id)

    @property
    def malformed(self) -> int:
        """Records skipped because they did not decode or did not match their key; the same
        bytes under the same key, seen again, are not counted again."""
        return self._malformed

    @property
    def last_error(self) -> str | None:
        """Why the latest malformed record was skipped."""
        return self._last_error

    # -- inputs --------------------------------------------------------------------------
    def put(self, key: str, data: bytes, now: float) -> list[FleetEvent]:
        """``key`` was written with ``data``. A malformed record changes nothing."""
        _check_now(now)
        record = self._decode(key, data)
        if record is None:
            return []
        return self._upsert(record, now)

    def delete(self, key: str, now: float) -> list[FleetEvent]:
        """``key`` was deleted (withdrawn, or its lease expired)."""
        _check_now(now)
        self._bad.pop(key, None)
        engine_id = _engine_of(key)
        old = self._live.pop(engine_id, None)
        if old is None:
            return []
        return [self._vanish(old, now, "deleted")]

    def snapshot(self, items: Mapping[str, bytes], now: float) -> list[FleetEvent]:
        """A complete listing of the prefix (after a (re)connection): engines absent from it
        vanish (``"missing"``), the others are put. Malformed entries are skipped and counted;
        an engine whose only entry is malformed counts as missing."""
        _check_now(now)
        # Entries no longer listed are forgotten: they count again if they come back.
        for key in [k for k in self._bad if k not in items]:
            del self._bad[key]
        seen: dict[str, EngineRecord] = {}
        for key, data in items.items():
            record = self._decode(key, data)
            if record is not None:
                seen[record.engine_id] = record
        out: list[FleetEvent] = []
        for engine_id in sorted(set(self._live) - set(seen)):
            out.append(self._vanish(self._live.pop(engine_id), now, "missing"))
        for engine_id in sorted(seen):
            out.extend(self._upsert(seen[engine_id], now))
        return out

    # -- internals -----------------------------------------------------------------------
    def _decode(self, key: str, data: bytes) -> EngineRecord | None:
        try:
            record = decode_record(data)
        except CodecError as exc:
            self._skip(key, data, f"{key[:200]!r}: {exc}")
            return None
        if _engine_of(key) != record.engine_id:
            self._skip(key, data, f"{key[:200]!r} holds the record of engine {record.engine_id!r}")
            return None
        self._bad.pop(key, None)
        return record

    def _skip(self, key: str, data: bytes, why: str) -> None:
        digest = hashlib.blake2b(data, digest_size=16).digest()
        if self._bad.get(key) == digest:
            self._bad.move_to_end(key)
            return
        self._bad[key] = digest
        self._bad.move_to_end(key)
        while len(self._bad) > self._remember_bad:
            self._bad.popitem(last=False)
        self._malformed += 1
        self._last_error = why

    def _upsert(self, record: EngineRecord, now: float) -> list[FleetEvent]:
        old = self._live.get(record.engine_id)
        self._live[record.engine_id] = record
        if old is None:
            return [EngineAdded(record=record, at=now)]
        if old == record:
            return []
        if old.incarnation != record.incarnation:
            return [self._vanish(old, now, "replaced"), EngineAdded(record=record, at=now)]
        return [EngineChanged(old=old, record=record, at=now)]

    def _vanish(self, record: EngineRecord, now: float, reason: str) -> EngineVanished:
        self._vanished.pop(record.engine_id, None)
        self._vanished[record.engine_id] = now
        while len(self._vanished) > self._remember:
            self._vanished.popitem(last=False)
        return EngineVanished(record=record, at=now, reason=reason)


def _engine_of(key: str) -> str:
    return key.rstrip("/").rsplit("/", 1)[-1]


def _check_now(now: float) -> None:
    if not isinstance(now, int | float) or not math.isfinite(now):
        raise ValueError(f"now must be a finite number of seconds, got {now!r}")


# -- the registrant's clock -------------------------------------------------------------------


class KeepAliveClock:
    """When an engine's registration is sure to exist, and when to renew it.

    The service counts a registration's TTL from when it *received* the latest keep-alive,
    which is after this side *sent* it: so ``sent + granted_ttl`` is a lower bound of the
    moment the service may drop the registration. :attr:`confirmed_until` is the latest such
    bound; past it (less ``margin``) the registration must be taken as lost — peers may
    already have seen the engine vanish — and registered again.

    :param ttl: the TTL asked for, seconds.
    :param interval: time between keep-alives; default a third of ``ttl`` (two may fail before
        the registration lapses).
    :param margin: safety margin subtracted from :attr:`confirmed_until` for :meth:`lost`
        (covers clock-rate differences); default 5 % of ``ttl``.
    :raises ValueError: non-positive or non-finite values, or ``interval >= ttl``.
    """

    def __init__(self, ttl: float, *, interval: float | None = None, margin: float | None = None):
        interval = ttl / 3 if interval is None else interval
        margin = 0.05 * ttl if margin is None else margin
        for name, value in (("ttl", ttl), ("interval", interval)):
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if not (math.isfinite(margin) and 0 <= margin < ttl):
            raise ValueError(f"margin must be in [0, ttl), got {margin!r}")
        if interval >= ttl:
            raise ValueError(
                f"interval {interval:g} s must be shorter than ttl {ttl:g} s, or the "
                "registration lapses between keep-alives"
            )
        self.ttl = float(ttl)
        self.interval = float(interval)
        self.margin = float(margin)
        self._confirmed_until = -math.inf
        self._last_sent = -math.inf

    @property
    def confirmed_until(self) -> float:
        """The registration exists at least until then (``-inf``: not registered)."""
        return self._confirmed_until

    def registered(self, sent_at: float, granted_ttl: float) -> None:
        """A registration (lease grant and write) sent at ``sent_at`` succeeded with
        ``granted_ttl`` seconds."""
        self._confirmed_until = sent_at + granted_ttl
        self._last_sent = sent_at

    def renewed(self, sent_at: float, granted_ttl: float) -> None:
        """A keep-alive sent at ``sent_at`` was answered with ``granted_ttl`` (> 0). A late
        answer never moves the bound backwards."""
        self._last_sent = max(self._last_sent, sent_at)
        self._confirmed_until = max(self._confirmed_until, sent_at + granted_ttl)

    def attempted(self, sent_at: float) -> None:
        """A keep-alive was sent at ``sent_at`` and failed or is unanswered (schedules the
        next one an interval later)."""
        self._last_sent = max(self._last_sent, sent_at)

    def forget(self) -> None:
        """The service said the registration is gone (its lease is unknown)."""
        self._confirmed_until = -math.inf

    def next_keepalive(self) -> float:
        """When to send the next keep-alive."""
        return self._last_sent + self.interval

    def lost(self, now: float) -> bool:
        """Whether the registration may already be gone at ``now``."""
        return now >= self._confirmed_until - self.margin
