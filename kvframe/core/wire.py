"""The heartbeat wire format: D -> P heartbeats and completions, P -> D acks and loss notices.

Small, versioned, bounded binary messages (big-endian ``struct`` layouts, never pickle). They
name leases by **handle**: the 64-bit :func:`~kvframe.core.lease.lease_handle` of the lease
id, which reader and holder both compute from the id in the ticket. So a batch costs 8 bytes
per lease, whatever the ids' length; the ids themselves stay in logs and statistics. Every
message starts with the same eighteen bytes::

    offset size field
    0      2    magic     b"KH"
    2      1    version   (2)
    3      1    type      1 heartbeat, 2 lease ack, 3 lease lost, 4 lease done
    4      4    seq       u32  (heartbeat, done: the sender's sequence number, wrapping;
                               ack, lost: the seq of the heartbeat answered)
    8      8    time      f64  (heartbeat, done: the sender's clock when it sent the message;
                               ack, lost: the holder's clock when it answered)
    16     2    count     u16  1 .. MAX_HANDLES_PER_MESSAGE

then a type-specific field, then ``count`` handles (u64 each, distinct, never 0 or 1)::

    heartbeat (D -> P, type 1)   nothing            "keep these leases"
    lease ack (P -> D, type 2)   expiry  f64        "each lease runs at least until expiry
                                                     (my clock, which read `time` then)"
    lease lost (P -> D, type 3)  reason  u8         "no lease any more: 1 unknown,
                                                     2 consumed, 3 aborted, 4 expired,
                                                     5 claimed by another reader"
    lease done (D -> P, type 4)  reason  u8         "end these leases: 1 read, 2 released"

So a heartbeat of ``n`` leases is ``18 + 8 n`` bytes, an ack ``26 + 8 n``, a loss or done
notice ``19 + 8 n``. An ack carries one expiry for all its handles: the earliest among them,
a lower bound for each (a lease renewed by the heartbeat runs at least ``sent + extension``;
a young one may run longer, which the reader need not know). D rebases it with the send time
of the answered heartbeat (see :mod:`kvframe.core.reader`). A loss or done notice carries one
reason; a holder with several reasons sends one notice per reason.

The P/D connector sends a *done* notice as the notification of the READ itself (delivered
after the data landed) and as a release when a request was aborted or its KV was found in the
local cache.

**Limits.** A message holds 1 to :data:`MAX_HANDLES_PER_MESSAGE` (1024) handles and at most
:data:`MAX_MESSAGE_BYTES` (16 KiB) in all. :func:`encode` refuses anything larger with
:class:`~kvframe.errors.CodecError`; :func:`split` cuts a message into several that fit (and
fit a transport's smaller ``max_notification_bytes`` when given). Times are finite.

**Decoding** raises :class:`~kvframe.errors.CodecError` (or its subclasses
:class:`~kvframe.errors.UnsupportedVersionError` and
:class:`~kvframe.errors.UnknownMessageTypeError`) for any malformed input, and nothing else.
Version 1 (ids instead of handles) is refused as unsupported.
"""

from __future__ import annotations

import enum
import math
import struct
from collections.abc import Iterable
from typing import TypeAlias

import attrs

from kvframe.errors import CodecError, UnknownMessageTypeError, UnsupportedVersionError

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "MAX_HANDLES_PER_MESSAGE",
    "MAX_IDS_PER_MESSAGE",
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
VERSION = 2
"""The format version this module writes and reads (1 named leases by id)."""
MAX_HANDLES_PER_MESSAGE = 1024
"""Most handles in one message."""
MAX_IDS_PER_MESSAGE = MAX_HANDLES_PER_MESSAGE
"""The same limit under its version-1 name."""
MAX_MESSAGE_BYTES = 16 * 1024
"""Largest encoded message. Also what :func:`decode` accepts at most."""
HEADER_BYTES = 18
"""Bytes before the type-specific field, in every message type."""

_U32 = 1 << 32
_U64 = 1 << 64
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
    """Why a holder has no lease for a handle (the reason byte of a :class:`LeaseLost`)."""

    UNKNOWN = 1
    """The holder never granted it (or forgot it), or the handle names nothing."""
    CONSUMED = 2
    """It ended: the holder saw a completion."""
    ABORTED = 3
    """It ended: the holder aborted it."""
    EXPIRED = 4
    """It expired (or its expiry has passed): the blocks are or will be reclaimed."""
    CLAIMED = 5
    """It is live but bound to another reader (the first that named it): a ticket used twice
    is read once."""


class DoneReason(enum.IntEnum):
    """Why a reader ends leases (the reason byte of a :class:`LeaseDone`)."""

    READ = 1
    """The read completed: the holder consumes the lease."""
    RELEASED = 2
    """No read will come (aborted, or found in the reader's own cache): the holder aborts it."""


def _check_seq(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _U32:
        raise ValueError(f"{attribute.name} must be an int in [0, 2**32), got {value!r}")


def _check_time(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value):
        raise ValueError(f"{attribute.name} must be a finite number, got {value!r}")


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond any f64
        return False


def _handle_tuple(value: Iterable[int]) -> tuple[int, ...]:
    if isinstance(value, str | bytes):
        raise ValueError(f"handles must be a sequence of ints, not one {type(value).__name__}")
    try:
        return tuple(value)
    except TypeError:
        raise ValueError(f"handles must be a sequence of ints, got {value!r}") from None


def _check_handles(instance: object, attribute: attrs.Attribute[object], value: object) -> None:
    handles: tuple[int, ...] = value  # type: ignore[assignment]
    if not handles:
        raise ValueError(f"a {type(instance).__name__} needs at least one handle")
    for h in handles:
        if isinstance(h, bool) or not isinstance(h, int) or not 1 < h < _U64:
            raise ValueError(f"handles must be ints in [2, 2**64), got {h!r}")
    if len(set(handles)) != len(handles):
        raise ValueError(f"handles in one {type(instance).__name__} must be distinct")


def _check_lost_reason(
    instance: object, attribute: attrs.Attribute[LostReason], value: LostReason
) -> None:
    if not isinstance(value, LostReason):
        raise ValueError(f"reason must be a LostReason, got {value!r}")


def _check_done_reason(
    instance: object, attribute: attrs.Attribute[DoneReason], value: DoneReason
) -> None:
    if not isinstance(value, DoneReason):
        raise ValueError(f"reason must be a DoneReason, got {value!r}")


@attrs.frozen(kw_only=True)
class Heartbeat:
    """D -> P: keep the leases with these handles. Raises ``ValueError`` for an out-of-range
    ``seq``, a non-finite ``sent_at``, or empty, repeated or out-of-range handles."""

    seq: int = attrs.field(validator=_check_seq)
    sent_at: float = attrs.field(validator=_check_time)
    """The sender's clock at sending (never converted: the receiver maps it)."""
    handles: tuple[int, ...] = attrs.field(converter=_handle_tuple, validator=_check_handles)


@attrs.frozen(kw_only=True)
class LeaseAck:
    """P -> D: each lease named runs at least until ``expiry`` (P's clock, read as
    ``holder_now``). Raises ``ValueError`` for bad fields (as :class:`Heartbeat`)."""

    echo_seq: int = attrs.field(validator=_check_seq)
    """The ``seq`` of the heartbeat this answers."""
    holder_now: float = attrs.field(validator=_check_time)
    expiry: float = attrs.field(validator=_check_time)
    """The earliest expiry among the named leases: a lower bound for each."""
    handles: tuple[int, ...] = attrs.field(converter=_handle_tuple, validator=_check_handles)


@attrs.frozen(kw_only=True)
class LeaseLost:
    """P -> D: there is no lease with these handles any more, for ``reason``. Raises
    ``ValueError`` for bad fields."""

    echo_seq: int = attrs.field(validator=_check_seq)
    holder_now: float = attrs.field(validator=_check_time)
    reason: LostReason = attrs.field(validator=_check_lost_reason)
    handles: tuple[int, ...] = attrs.field(converter=_handle_tuple, validator=_check_handles)


@attrs.frozen(kw_only=True)
class LeaseDone:
    """D -> P: end the leases with these handles, for ``reason``. Raises ``ValueError`` for
    bad fields."""

    seq: int = attrs.field(validator=_check_seq)
    sent_at: float = attrs.field(validator=_check_time)
    reason: DoneReason = attrs.field(validator=_check_done_reason)
    handles: tuple[int, ...] = attrs.field(converter=_handle_tuple, validator=_check_handles)


Message: TypeAlias = Heartbeat | LeaseAck | LeaseLost | LeaseDone
"""Any message of this format."""

_EXTRA = {
    MessageType.HEARTBEAT: 0,
    MessageType.LEASE_ACK: 8,
    MessageType.LEASE_LOST: 1,
    MessageType.LEASE_DONE: 1,
}
_TYPE = {Heartbeat: MessageType.HEARTBEAT, LeaseAck: MessageType.LEASE_ACK}
_TYPE.update({LeaseLost: MessageType.LEASE_LOST, LeaseDone: MessageType.LEASE_DONE})


def _mtype(msg: Message) -> MessageType:
    mtype = _TYPE.get(type(msg))
    if mtype is None:
        raise TypeError(f"not a wire message: {type(msg).__name__}")
    return mtype


def encoded_size(msg: Message) -> int:
    """The number of bytes :func:`encode` would produce for ``msg`` (limits not checked)."""
    return HEADER_BYTES + _EXTRA[_mtype(msg)] + 8 * len(msg.handles)


def encode(msg: Message) -> bytes:
    """The wire bytes of ``msg``.

    :raises CodecError: the message has more than :data:`MAX_HANDLES_PER_MESSAGE` handles or
        would exceed :data:`MAX_MESSAGE_BYTES` (use :func:`split`). Nothing is produced.
    :raises TypeError: ``msg`` is not a message of this module.
    """
    mtype = _mtype(msg)
    n = len(msg.handles)
    if n > MAX_HANDLES_PER_MESSAGE:
        raise CodecError(
            f"{n} handles in one message; the limit is {MAX_HANDLES_PER_MESSAGE}: "
            "cut it with kvframe.core.wire.split()"
        )
    if isinstance(msg, Heartbeat):
        head = _HEAD.pack(MAGIC, VERSION, mtype, msg.seq, msg.sent_at, n)
    elif isinstance(msg, LeaseAck):
        head = _HEAD.pack(MAGIC, VERSION, mtype, msg.echo_seq, msg.holder_now, n)
        head += _F64.pack(msg.expiry)
    elif isinstance(msg, LeaseLost):
        head = _HEAD.pack(MAGIC, VERSION, mtype, msg.echo_seq, msg.holder_now, n)
        head += bytes((int(msg.reason),))
    else:
        head = _HEAD.pack(MAGIC, VERSION, mtype, msg.seq, msg.sent_at, n)
        head += bytes((int(msg.reason),))
    return head + struct.pack(f">{n}Q", *msg.handles)


def split(msg: Message, max_bytes: int = MAX_MESSAGE_BYTES) -> list[Message]:
    """Cut ``msg`` into messages of the same type and header (same ``seq``, time, expiry or
    reason) that each encode within ``min(max_bytes, MAX_MESSAGE_BYTES)`` bytes and
    :data:`MAX_HANDLES_PER_MESSAGE` handles, keeping the handles' order. A message that
    already fits comes back alone.

    :param max_bytes: e.g. the transport's ``max_notification_bytes``.
    :raises CodecError: one handle alone would not fit ``max_bytes``.
    :raises ValueError: ``max_bytes`` is not a positive int.
    """
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    limit = min(max_bytes, MAX_MESSAGE_BYTES)
    head = HEADER_BYTES + _EXTRA[_mtype(msg)]
    per = min((limit - head) // 8, MAX_HANDLES_PER_MESSAGE)
    if per < 1:
        raise CodecError(f"one handle needs {head + 8} bytes in this message; max_bytes is {limit}")
    handles = msg.handles
    if len(handles) <= per:
        return [msg]
    return [attrs.evolve(msg, handles=handles[a : a + per]) for a in range(0, len(handles), per)]


def decode(data: bytes | bytearray | memoryview) -> Message:
    """The message in ``data`` (exactly one, no trailing bytes).

    :raises UnsupportedVersionError: the version byte is not :data:`VERSION`.
    :raises UnknownMessageTypeError: the type byte is not a :class:`MessageType`.
    :raises CodecError: anything else malformed: wrong magic, over
        :data:`MAX_MESSAGE_BYTES`, truncated, trailing bytes, zero or too many handles, a
        handle 0 or 1, repeated handles, a non-finite time or expiry, an unknown reason byte,
        a non-bytes argument. The decoder is stateless and stays usable.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError(f"expected bytes, got {type(data).__name__}")
    try:
        buf = bytes(data)
    except ValueError as exc:  # a released memoryview
        raise CodecError(f"unreadable input: {exc}") from None
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
    head = HEADER_BYTES + _EXTRA[mtype]
    if len(buf) < head:
        raise CodecError(f"truncated: {len(buf)} bytes, this message's header needs {head}")
    _, _, _, seq, t, count = _HEAD.unpack_from(buf, 0)
    if not math.isfinite(t):
        raise CodecError(f"time field is not finite: {t!r}")
    if not 1 <= count <= MAX_HANDLES_PER_MESSAGE:
        raise CodecError(f"handle count {count} is outside 1..{MAX_HANDLES_PER_MESSAGE}")
    if len(buf) != head + 8 * count:
        raise CodecError(
            f"{count} handles need {head + 8 * count} bytes; the message has {len(buf)}"
        )
    handles = struct.unpack_from(f">{count}Q", buf, head)
    if min(handles) < 2:
        raise CodecError("handle 0 or 1 (reserved) in a message")
    if len(set(handles)) != count:
        raise CodecError("repeated handle in one message")
    try:
        if mtype is MessageType.HEARTBEAT:
            return Heartbeat(seq=seq, sent_at=t, handles=handles)
        if mtype is MessageType.LEASE_ACK:
            (expiry,) = _F64.unpack_from(buf, HEADER_BYTES)
            if not math.isfinite(expiry):
                raise CodecError(f"expiry is not finite: {expiry!r}")
            return LeaseAck(echo_seq=seq, holder_now=t, expiry=expiry, handles=handles)
        code = buf[HEADER_BYTES]
        if mtype is MessageType.LEASE_LOST:
            if code not in LostReason._value2member_map_:
                raise CodecError(f"unknown loss reason byte {code}")
            return LeaseLost(echo_seq=seq, holder_now=t, reason=LostReason(code), handles=handles)
        if code not in DoneReason._value2member_map_:
            raise CodecError(f"unknown done reason byte {code}")
        return LeaseDone(seq=seq, sent_at=t, reason=DoneReason(code), handles=handles)
    except (ValueError, TypeError) as exc:  # defence in depth: the checks above should cover it
        raise CodecError(f"malformed message: {exc}") from None
