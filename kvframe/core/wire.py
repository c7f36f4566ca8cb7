"""The heartbeat wire format: D -> P heartbeats and completions, P -> D acks and loss notices.

Small, versioned, bounded binary messages (big-endian ``struct`` layouts, never pickle). Every
message starts with the same four bytes::

    offset size field
    0      2    magic  b"KH"
    2      1    version (1)
    3      1    type: 1 heartbeat, 2 lease ack, 3 lease lost, 4 lease done

**Heartbeat** (D -> P, type 1): "keep these leases; I sent this at ``sent_at``"::

    4      4    seq       u32   the sender's sequence number (wraps; see heartbeat.py)
    8      8    sent_at   f64   the sender's monotonic clock when it sent the message
    16     2    count     u16   1 .. MAX_IDS_PER_MESSAGE
    18     ...  count x (len u8 1..255, request id UTF-8)

So each request id costs ``len(id) + 1`` bytes; a batch of ``n`` ids of ``L`` bytes is
``18 + n * (L + 1)`` bytes.

**Lease ack** (P -> D, type 2): "your lease on X now runs until T (my clock; my clock read
``holder_now`` when I computed T)"::

    4      4    echo_seq   u32  seq of the heartbeat answered
    8      8    holder_now f64  P's clock when it renewed
    16     2    count      u16
    18     ...  count x (len u8, request id UTF-8, expiry f64)

D rebases each expiry with ``rebase_deadline(expiry, holder_now, sent_at_of(echo_seq))``:
the send time of the answered heartbeat is a local reading no later than P's ``holder_now``.

**Lease lost** (P -> D, type 3): "there is no lease on X any more, and why"::

    4      4    echo_seq   u32
    8      8    holder_now f64
    16     2    count      u16
    18     ...  count x (len u8, request id UTF-8, reason u8: 1 unknown, 2 consumed,
                3 aborted, 4 expired, 5 claimed by another reader)

**Lease done** (D -> P, type 4): "I no longer need the lease on X, and why"; the holder
ends it at once (consumed after a read, aborted after a release)::

    4      4    seq        u32  the sender's sequence number (same space as heartbeats)
    8      8    sent_at    f64  the sender's clock
    16     2    count      u16
    18     ...  count x (len u8, request id UTF-8, reason u8: 1 read, 2 released)

The P/D connector sends it as the notification of the READ itself (delivered after the data
landed) and as a release when a request was aborted or its KV was found in the local cache.

**Limits.** A request id is 1 to :data:`MAX_ID_BYTES` (255) bytes of UTF-8; a message holds
1 to :data:`MAX_IDS_PER_MESSAGE` (1024) entries and at most :data:`MAX_MESSAGE_BYTES` (16 KiB)
in all. :func:`encode` refuses anything larger with :class:`~kvframe.errors.CodecError`;
:func:`split` cuts a message into several that fit (and fit a transport's smaller
``max_notification_bytes`` when given). Times are finite; ids in one message are distinct.

**Decoding** raises :class:`~kvframe.errors.CodecError` (or its subclasses
:class:`~kvframe.errors.UnsupportedVersionError` and
:class:`~kvframe.errors.UnknownMessageTypeError`) for any malformed input, and nothing else.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Iterable, Sequence
from typing import TypeAlias

import attrs

from kvframe.errors import CodecError, UnknownMessageTypeError, UnsupportedVersionError

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "MAX_IDS_PER_MESSAGE",
    "MAX_ID_BYTES",
    "MAX_MESSAGE_BYTES",
    "VERSION",
    "DoneReason",
    "Heartbeat",
    "LeaseAck",
    "LeaseDone",
    "LeaseLost",
    "LostReason",
    "Message",
    "MessageType",
    "decode",
    "encode",
    "encoded_size",
    "split",
]

MAGIC = b"KH"
"""The first two bytes of every message."""
VERSION = 1
"""The format version this module writes and reads."""
MAX_ID_BYTES = 255
"""Longest request id, in UTF-8 bytes (its length is one byte on the wire)."""
MAX_IDS_PER_MESSAGE = 1024
"""Most entries (request ids) in one message."""
MAX_MESSAGE_BYTES = 16 * 1024
"""Largest encoded message. Also what :func:`decode` accepts at most."""
HEADER_BYTES = 18
"""Bytes before the first entry, in every message type."""

_U32 = 1 << 32
_HEAD = struct.Struct(">2sBBIdH")
_F64 = struct.Struct(">d")
assert _HEAD.size == HEADER_BYTES


class MessageType(enum.IntEnum):
    """The type byte (offset 3)."""

    HEARTBEAT = 1
    LEASE_ACK = 2
    LEASE_LOST = 3
    LEASE_DONE = 4


class LostReason(enum.IntEnum):
    """Why a holder has no lease for an id (the reason byte of a :class:`LeaseLost` entry)."""

    UNKNOWN = 1
    """The holder never granted it (or forgot it)."""
    CONSUMED = 2
    """It ended: the holder saw a completion."""
    ABORTED = 3
    """It ended: the holder aborted it."""
    EXPIRED = 4
    """It expired (or its expiry has passed): the blocks are or will be reclaimed."""
    CLAIMED = 5
    """It is live but bound to another reader (the first that named it): a ticket used twice
    is read once."""


def _check_seq(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _U32:
        raise ValueError(f"{attribute.name} must be an int in [0, 2**32), got {value!r}")


def _check_time(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be a finite number of seconds, got {value!r}")


def _check_ids(ids: Sequence[str], what: str) -> None:
    if not ids:
        raise ValueError(f"a {what} needs at least one request id")
    for rid in ids:
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request ids must be non-empty str, got {rid!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"request ids in one {what} must be distinct")


def _id_tuple(value: Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str | bytes):
        raise ValueError(f"request_ids must be a sequence of ids, not one {type(value).__name__}")
    return tuple(value)


def _ids_validator(instance: Heartbeat, attribute: attrs.Attribute[object], value: object) -> None:
    _check_ids(value, "heartbeat")  # type: ignore[arg-type]


@attrs.frozen(kw_only=True)
class Heartbeat:
    """D -> P: keep the leases on ``request_ids``. Raises ``ValueError`` for an out-of-range
    ``seq``, a non-finite ``sent_at``, or empty/repeated/non-str ids."""

    seq: int = attrs.field(validator=_check_seq)
    sent_at: float = attrs.field(validator=_check_time)
    """The sender's clock at sending (never converted: the receiver maps it)."""
    request_ids: tuple[str, ...] = attrs.field(converter=_id_tuple, validator=_ids_validator)


def _check_ack_entries(
    instance: LeaseAck, attribute: attrs.Attribute[object], value: object
) -> None:
    entries: tuple[tuple[str, float], ...] = value  # type: ignore[assignment]
    _check_ids([e[0] for e in entries], "lease ack")
    for rid, expiry in entries:
        if isinstance(expiry, bool) or not isinstance(expiry, int | float):
            raise ValueError(f"expiry of {rid!r} must be a number, got {expiry!r}")
        if not math.isfinite(expiry):
            raise ValueError(f"expiry of {rid!r} must be finite, got {expiry!r}")


def _ack_pairs(value: Iterable[tuple[str, float]]) -> tuple[tuple[str, float], ...]:
    return tuple((rid, x) for rid, x in value)


def _lost_pairs(value: Iterable[tuple[str, LostReason]]) -> tuple[tuple[str, LostReason], ...]:
    return tuple((rid, x) for rid, x in value)


@attrs.frozen(kw_only=True)
class LeaseAck:
    """P -> D: the lease on each id runs until the paired expiry (P's clock, read as
    ``holder_now``). Raises ``ValueError`` for bad fields (as :class:`Heartbeat`)."""

    echo_seq: int = attrs.field(validator=_check_seq)
    """The ``seq`` of the heartbeat this answers."""
    holder_now: float = attrs.field(validator=_check_time)
    expiries: tuple[tuple[str, float], ...] = attrs.field(
        converter=_ack_pairs, validator=_check_ack_entries
    )


def _check_lost_entries(
    instance: LeaseLost, attribute: attrs.Attribute[object], value: object
) -> None:
    entries: tuple[tuple[str, LostReason], ...] = value  # type: ignore[assignment]
    _check_ids([e[0] for e in entries], "lease-lost notice")
    for rid, reason in entries:
        if not isinstance(reason, LostReason):
            raise ValueError(f"reason for {rid!r} must be a LostReason, got {reason!r}")


@attrs.frozen(kw_only=True)
class LeaseLost:
    """P -> D: there is no lease on each id any more, for the paired reason. Raises
    ``ValueError`` for bad fields."""

    echo_seq: int = attrs.field(validator=_check_seq)
    holder_now: float = attrs.field(validator=_check_time)
    lost: tuple[tuple[str, LostReason], ...] = attrs.field(
        converter=_lost_pairs, validator=_check_lost_entries
    )


class DoneReason(enum.IntEnum):
    """Why a reader ends a lease (the reason byte of a :class:`LeaseDone` entry)."""

    READ = 1
    """The read completed: the holder consumes the lease."""
    RELEASED = 2
    """No read will come (aborted, or found in the reader's own cache): the holder aborts it."""


def _done_pairs(value: Iterable[tuple[str, DoneReason]]) -> tuple[tuple[str, DoneReason], ...]:
    return tuple((rid, x) for rid, x in value)


def _check_done_entries(
    instance: LeaseDone, attribute: attrs.Attribute[object], value: object
) -> None:
    entries: tuple[tuple[str, DoneReason], ...] = value  # type: ignore[assignment]
    _check_ids([e[0] for e in entries], "lease-done notice")
    for rid, reason in entries:
        if not isinstance(reason, DoneReason):
            raise ValueError(f"reason for {rid!r} must be a DoneReason, got {reason!r}")


@attrs.frozen(kw_only=True)
class LeaseDone:
    """D -> P: end the leases on each id, for the paired reason. Raises ``ValueError`` for bad
    fields."""

    seq: int = attrs.field(validator=_check_seq)
    sent_at: float = attrs.field(validator=_check_time)
    done: tuple[tuple[str, DoneReason], ...] = attrs.field(
        converter=_done_pairs, validator=_check_done_entries
    )


Message: TypeAlias = Heartbeat | LeaseAck | LeaseLost | LeaseDone
"""Any message of this format."""

_TRAILER = {Heartbeat: 0, LeaseAck: 8, LeaseLost: 1, LeaseDone: 1}


def _entries(msg: Message) -> Sequence[tuple[str, object]]:
    if isinstance(msg, Heartbeat):
        return [(rid, None) for rid in msg.request_ids]
    if isinstance(msg, LeaseAck):
        return msg.expiries
    if isinstance(msg, LeaseDone):
        return msg.done
    return msg.lost


def _entry_size(rid: str, trailer: int) -> int:
    n = len(rid.encode("utf-8"))
    if n > MAX_ID_BYTES:
        raise CodecError(
            f"request id {rid[:40]!r}... is {n} UTF-8 bytes; the wire format allows at most "
            f"{MAX_ID_BYTES}"
        )
    return 1 + n + trailer


def encoded_size(msg: Message) -> int:
    """The number of bytes :func:`encode` would produce for ``msg`` (limits not checked,
    except the id length: raises :class:`~kvframe.errors.CodecError` for an id over
    :data:`MAX_ID_BYTES`)."""
    trailer = _TRAILER[type(msg)]
    return HEADER_BYTES + sum(_entry_size(rid, trailer) for rid, _ in _entries(msg))


def encode(msg: Message) -> bytes:
    """The wire bytes of ``msg``.

    :raises CodecError: an id is longer than :data:`MAX_ID_BYTES`, or the message has more
        than :data:`MAX_IDS_PER_MESSAGE` entries or would exceed :data:`MAX_MESSAGE_BYTES`
        (use :func:`split`). Nothing is produced.
    :raises TypeError: ``msg`` is not a message of this module.
    """
    if isinstance(msg, Heartbeat):
        mtype, seq, t = MessageType.HEARTBEAT, msg.seq, msg.sent_at
    elif isinstance(msg, LeaseAck):
        mtype, seq, t = MessageType.LEASE_ACK, msg.echo_seq, msg.holder_now
    elif isinstance(msg, LeaseLost):
        mtype, seq, t = MessageType.LEASE_LOST, msg.echo_seq, msg.holder_now
    elif isinstance(msg, LeaseDone):
        mtype, seq, t = MessageType.LEASE_DONE, msg.seq, msg.sent_at
    else:
        raise TypeError(f"not a wire message: {type(msg).__name__}")
    entries = _entries(msg)
    if len(entries) > MAX_IDS_PER_MESSAGE:
        raise CodecError(
            f"{len(entries)} entries in one message; the limit is {MAX_IDS_PER_MESSAGE}: "
            "cut it with kvframe.core.wire.split()"
        )
    parts = [_HEAD.pack(MAGIC, VERSION, mtype, seq, t, len(entries))]
    for rid, extra in entries:
        raw = rid.encode("utf-8")
        if len(raw) > MAX_ID_BYTES:
            raise CodecError(
                f"request id {rid[:40]!r}... is {len(raw)} UTF-8 bytes; the wire format allows "
                f"at most {MAX_ID_BYTES}"
            )
        parts.append(bytes((len(raw),)))
        parts.append(raw)
        if mtype is MessageType.LEASE_ACK:
            parts.append(_F64.pack(extra))
        elif mtype in (MessageType.LEASE_LOST, MessageType.LEASE_DONE):
            parts.append(bytes((int(extra),)))  # type: ignore[call-overload]
    out = b"".join(parts)
    if len(out) > MAX_MESSAGE_BYTES:
        raise CodecError(
            f"message would be {len(out)} bytes; the limit is {MAX_MESSAGE_BYTES}: "
            "cut it with kvframe.core.wire.split()"
        )
    return out


def split(msg: Message, max_bytes: int = MAX_MESSAGE_BYTES) -> list[Message]:
    """Cut ``msg`` into messages of the same type and header (same ``seq``/time) that each
    encode within ``min(max_bytes, MAX_MESSAGE_BYTES)`` bytes and
    :data:`MAX_IDS_PER_MESSAGE` entries, keeping the entries' order. A message that already
    fits comes back alone.

    :param max_bytes: e.g. the transport's ``max_notification_bytes``.
    :raises CodecError: an id is over :data:`MAX_ID_BYTES`, or one entry alone would not fit
        ``max_bytes``.
    :raises ValueError: ``max_bytes`` is not a positive int.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    limit = min(max_bytes, MAX_MESSAGE_BYTES)
    trailer = _TRAILER[type(msg)]
    bounds: list[int] = []  # index where each chunk after the first starts
    size = HEADER_BYTES
    count = 0
    for i, (rid, _) in enumerate(_entries(msg)):
        esize = _entry_size(rid, trailer)
        if HEADER_BYTES + esize > limit:
            raise CodecError(
                f"request id {rid[:40]!r} needs {HEADER_BYTES + esize} bytes alone; "
                f"max_bytes is {limit}"
            )
        if count and (size + esize > limit or count == MAX_IDS_PER_MESSAGE):
            bounds.append(i)
            size, count = HEADER_BYTES, 0
        size += esize
        count += 1
    if not bounds:
        return [msg]
    cuts = list(zip([0, *bounds], [*bounds, None], strict=True))
    if isinstance(msg, Heartbeat):
        return [attrs.evolve(msg, request_ids=msg.request_ids[a:b]) for a, b in cuts]
    if isinstance(msg, LeaseAck):
        return [attrs.evolve(msg, expiries=msg.expiries[a:b]) for a, b in cuts]
    if isinstance(msg, LeaseDone):
        return [attrs.evolve(msg, done=msg.done[a:b]) for a, b in cuts]
    return [attrs.evolve(msg, lost=msg.lost[a:b]) for a, b in cuts]


def decode(data: bytes | bytearray | memoryview) -> Message:
    """The message in ``data`` (exactly one, no trailing bytes).

    :raises UnsupportedVersionError: the version byte is not :data:`VERSION`.
    :raises UnknownMessageTypeError: the type byte is not a :class:`MessageType`.
    :raises CodecError: anything else malformed: wrong magic, over
        :data:`MAX_MESSAGE_BYTES`, truncated, trailing bytes, zero or too many entries, an
        empty or non-UTF-8 id, repeated ids, a non-finite time, an unknown reason byte, a
        non-bytes argument. The decoder is stateless and stays usable.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError(f"expected bytes, got {type(data).__name__}")
    buf = bytes(data)
    if len(buf) > MAX_MESSAGE_BYTES:
        raise CodecError(f"message is {len(buf)} bytes; the limit is {MAX_MESSAGE_BYTES}")
    if len(buf) < 4:
        raise CodecError(f"truncated: {len(buf)} bytes, a message header needs {HEADER_BYTES}")
    if buf[:2] != MAGIC:
        raise CodecError(f"bad magic {buf[:2]!r}: not a kvframe heartbeat message (want {MAGIC!r})")
    if buf[2] != VERSION:
        raise UnsupportedVersionError(
            f"heartbeat wire version {buf[2]} is not supported (this side reads {VERSION})"
        )
    try:
        mtype = MessageType(buf[3])
    except ValueError:
        raise UnknownMessageTypeError(f"unknown heartbeat message type {buf[3]}") from None
    if len(buf) < HEADER_BYTES:
        raise CodecError(f"truncated: {len(buf)} bytes, a message header needs {HEADER_BYTES}")
    _, _, _, seq, t, count = _HEAD.unpack_from(buf, 0)
    if not math.isfinite(t):
        raise CodecError(f"time field is not finite: {t!r}")
    if not 1 <= count <= MAX_IDS_PER_MESSAGE:
        raise CodecError(f"entry count {count} is outside 1..{MAX_IDS_PER_MESSAGE}")
    trailer = 0 if mtype is MessageType.HEARTBEAT else 8 if mtype is MessageType.LEASE_ACK else 1
    pos = HEADER_BYTES
    ids: list[str] = []
    expiries: list[tuple[str, float]] = []
    lost: list[tuple[str, LostReason]] = []
    done: list[tuple[str, DoneReason]] = []
    for i in range(count):
        if pos >= len(buf):
            raise CodecError(f"truncated: entry {i} of {count} is missing")
        n = buf[pos]
        if n == 0:
            raise CodecError(f"entry {i}: empty request id")
        end = pos + 1 + n
        if end + trailer > len(buf):
            raise CodecError(f"truncated: entry {i} needs {end + trailer} bytes, have {len(buf)}")
        try:
            rid = buf[pos + 1 : end].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CodecError(f"entry {i}: request id is not valid UTF-8 ({exc.reason})") from None
        ids.append(rid)
        if mtype is MessageType.LEASE_ACK:
            (expiry,) = _F64.unpack_from(buf, end)
            if not math.isfinite(expiry):
                raise CodecError(f"entry {i} ({rid!r}): expiry is not finite: {expiry!r}")
            expiries.append((rid, expiry))
        elif mtype is MessageType.LEASE_LOST:
            try:
                lost.append((rid, LostReason(buf[end])))
            except ValueError:
                raise CodecError(f"entry {i} ({rid!r}): unknown reason byte {buf[end]}") from None
        elif mtype is MessageType.LEASE_DONE:
            try:
                done.append((rid, DoneReason(buf[end])))
            except ValueError:
                raise CodecError(f"entry {i} ({rid!r}): unknown reason byte {buf[end]}") from None
        pos = end + trailer
    if pos != len(buf):
        raise CodecError(f"{len(buf) - pos} trailing bytes after {count} entries")
    if len(set(ids)) != len(ids):
        raise CodecError("repeated request id in one message")
    try:
        if mtype is MessageType.HEARTBEAT:
            return Heartbeat(seq=seq, sent_at=t, request_ids=tuple(ids))
        if mtype is MessageType.LEASE_ACK:
            return LeaseAck(echo_seq=seq, holder_now=t, expiries=expiries)
        if mtype is MessageType.LEASE_DONE:
            return LeaseDone(seq=seq, sent_at=t, done=done)
        return LeaseLost(echo_seq=seq, holder_now=t, lost=lost)
    except (ValueError, TypeError) as exc:  # defence in depth: the checks above should cover it
        raise CodecError(f"malformed message: {exc}") from None
