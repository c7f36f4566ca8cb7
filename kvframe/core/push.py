"""Push mode's own decisions: D's registrations, their wire format, and P's matching of them.

In push mode the roles of the lease protocol swap. D allocates its destination blocks first
and *holds* them under a lease of its own (a :class:`~kvframe.core.holder.LeaseHolder` on D);
it tells P where they are with a :class:`PushRegister`. P, the *writer*, matches the
registration with its finished prefill (:class:`PushSource`), then writes under D's lease with
the same machine a pull-mode reader uses (:class:`~kvframe.core.reader.LeaseReader`, whose
``PostRead`` the P worker posts as a WRITE): heartbeats renew D's lease, a WRITE is posted only
with ``margin`` seconds of D's lease confirmed, and its completion notice (a lease-done
``READ``) consumes the lease on D. So:

- **fenced**: D frees its blocks only when its lease ends (P's completion or release, or the
  expiry), and P writes only inside a lease bound D confirmed; when D aborts it *revokes* the
  lease (:meth:`~kvframe.core.holder.LeaseHolder.revoke`: no more renewals, P is told at once)
  and still keeps the blocks until P says it stopped or the lease expires;
- **registration in any order**: a registration may arrive before P's prefill finished (P
  heartbeats D's lease while it waits: it still means to write), after, or never (P frees its
  KV after ``wait_timeout``);
- **fail-closed**: a registration P cannot serve (unknown or abandoned push id, another
  prompt, blocks that do not fit, a push id used twice) is answered with a
  :class:`PushRefused` at once, and D fails the load then.

Sans-I/O like the rest of :mod:`kvframe.core`: :class:`PushSource` takes ``now`` and returns
:data:`PushAction` values.

Wire format
-----------
Registrations and refusals travel as transport notifications beside the heartbeat messages of
:mod:`kvframe.core.wire`, told apart by their magic (``b"KP"``). Big-endian, never pickle::

    offset size  field
    0      2     magic   b"KP"
    2      1     version 1
    3      1     type    1 register (D -> P), 2 refused (P -> D)

    register: push_id   u8 length + ASCII (1..64 of [A-Za-z0-9_-])
              lease_id  u8 length + ASCII (1..64, same alphabet): D's lease on the blocks
              first     u32  index of the first block written (blocks before it D has)
              tokens    u32  the prompt's length in tokens (P's must be the same)
              digest    u8 length (0 or 32) + that many hex characters: the prompt digest
              groups    u8   1..64, then per group: u32 count, count x u32 block ids
    refused:  lease_id  u8 length + ASCII
              reason    u8   a :class:`RefuseReason`

A message is at most :data:`MAX_PUSH_MESSAGE_BYTES` (16 KiB): a registration holds about 4,000
block ids; D prefills a request whose registration would not fit itself.
:func:`decode` raises :class:`~kvframe.errors.CodecError` for anything malformed and nothing
else.
"""

from __future__ import annotations

import enum
import re
import struct
from collections import OrderedDict
from collections.abc import Iterable
from typing import TypeAlias

import attrs

from kvframe.core._checks import check_config_seconds, check_now
from kvframe.core.lease import lease_handle
from kvframe.errors import CodecError

__all__ = [
    "MAGIC",
    "MAX_PUSH_MESSAGE_BYTES",
    "PUSH_ID_PATTERN",
    "EndSource",
    "Keepalive",
    "PushAction",
    "PushRefused",
    "PushRegister",
    "PushSource",
    "Refuse",
    "RefuseReason",
    "StartWrite",
    "decode",
    "encode",
    "is_push_message",
]

MAGIC = b"KP"
"""The first two bytes of every push message (heartbeat messages start with ``b"KH"``)."""
VERSION = 1
"""The format version this module writes and reads."""
MAX_PUSH_MESSAGE_BYTES = 16 * 1024
"""Largest encoded push message (about 4,000 block ids in a registration)."""
#: What a push id and a lease id in a registration may be made of.
PUSH_ID_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
_MAX_GROUPS = 64
_U32 = struct.Struct(">I")


class RefuseReason(enum.IntEnum):
    """Why P will not write a registration (the reason byte of :class:`PushRefused`)."""

    UNKNOWN = 1
    """P has no request with that push id (never sent to it, or it forgot it)."""
    ABANDONED = 2
    """P's request with that push id ended without KV to push (aborted, failed, not kept)."""
    PROMPT = 3
    """The registration names another prompt (digest or token count) than P computed."""
    BLOCKS = 4
    """The registration's blocks do not fit P's (group count or block range)."""
    DUPLICATE = 5
    """Another registration already claimed that push id: a push id is single-use."""
    GAVE_UP = 6
    """P waited ``wait_timeout`` for its prefill and gave up (or shut down)."""

    def text(self) -> str:
        """What the reason means, for the decoder's failure report."""
        return {
            RefuseReason.UNKNOWN: "the prefill engine has no request with this push id",
            RefuseReason.ABANDONED: "the prefill engine's request ended without KV to push "
            "(aborted or failed)",
            RefuseReason.PROMPT: "the prefill engine computed another prompt than this request's",
            RefuseReason.BLOCKS: "the registered blocks do not fit the prefill engine's KV",
            RefuseReason.DUPLICATE: "another decoder registered this push id first (a push id "
            "is single-use)",
            RefuseReason.GAVE_UP: "the prefill engine gave up waiting for its prefill",
        }[self]


def _ident(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not PUSH_ID_PATTERN.fullmatch(value):
        raise ValueError(
            f"{attribute.name} = {value!r}; expected 1..64 characters of [A-Za-z0-9_-]"
        )


def _u32(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 32:
        raise ValueError(f"{attribute.name} = {value!r}; expected an int in [0, 2**32)")


def _digest(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not re.fullmatch(r"(?:[0-9a-f]{32})?", value):
        raise ValueError(f"{attribute.name} = {value!r}; expected '' or 32 hex characters")


def _groups(value: object) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, list | tuple):
        raise ValueError(f"groups must be a sequence of block id sequences, got {value!r}")
    out = tuple(tuple(g) for g in value)
    if not 1 <= len(out) <= _MAX_GROUPS:
        raise ValueError(f"a registration has 1..{_MAX_GROUPS} groups, got {len(out)}")
    for g in out:
        for b in g:
            if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < 1 << 32:
                raise ValueError(f"block ids are ints in [0, 2**32), got {b!r}")
    return out


@attrs.frozen(kw_only=True)
class PushRegister:
    """D -> P: write the KV of push id ``push_id`` into these blocks, under D's lease
    ``lease_id``. Raises ``ValueError`` for a field out of range."""

    push_id: str = attrs.field(validator=_ident)
    lease_id: str = attrs.field(validator=_ident)
    first_block: int = attrs.field(validator=_u32)
    """Index (in P's block list) of the first block to write: D has the blocks before it."""
    num_tokens: int = attrs.field(validator=_u32)
    """D's prompt length in tokens: P writes only for a prompt of the same length."""
    prompt_digest: str = attrs.field(validator=_digest)
    """D's prompt digest (:func:`kvframe.connectors.pd.params.prompt_digest` of its
    ``num_tokens`` tokens), or ``''`` when D's engine gives no token ids."""
    groups: tuple[tuple[int, ...], ...] = attrs.field(converter=_groups)
    """Per KV group, D's destination blocks for P's blocks ``first_block`` on."""


@attrs.frozen(kw_only=True)
class PushRefused:
    """P -> D: P will not write under lease ``lease_id``, for ``reason``."""

    lease_id: str = attrs.field(validator=_ident)
    reason: RefuseReason = attrs.field(converter=RefuseReason)


PushMessage: TypeAlias = PushRegister | PushRefused


def is_push_message(data: bytes | bytearray | memoryview) -> bool:
    """Whether ``data`` starts with this format's magic (else it is a heartbeat message)."""
    return bytes(data[:2]) == MAGIC


def _text(value: str) -> bytes:
    raw = value.encode("ascii")
    return bytes((len(raw),)) + raw


def encode(msg: PushMessage) -> bytes:
    """The wire bytes of ``msg``.

    :raises CodecError: it would exceed :data:`MAX_PUSH_MESSAGE_BYTES` (too many blocks).
    """
    if isinstance(msg, PushRefused):
        return MAGIC + bytes((VERSION, 2)) + _text(msg.lease_id) + bytes((int(msg.reason),))
    parts = [MAGIC, bytes((VERSION, 1)), _text(msg.push_id), _text(msg.lease_id)]
    parts.append(struct.pack(">II", msg.first_block, msg.num_tokens))
    parts.append(_text(msg.prompt_digest))
    parts.append(bytes((len(msg.groups),)))
    for g in msg.groups:
        parts.append(struct.pack(f">I{len(g)}I", len(g), *g))
    data = b"".join(parts)
    if len(data) > MAX_PUSH_MESSAGE_BYTES:
        blocks = sum(len(g) for g in msg.groups)
        raise CodecError(
            f"a registration of {blocks} blocks is {len(data)} bytes; the limit is "
            f"{MAX_PUSH_MESSAGE_BYTES} (about 4,000 blocks)"
        )
    return data


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.buf):
            raise CodecError(f"truncated push message: {what} needs {n} more bytes")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def u32(self, what: str) -> int:
        value: int = _U32.unpack(self.take(4, what))[0]
        return value

    def text(self, what: str) -> str:
        raw = self.take(self.u8(what), what)
        try:
            return raw.decode("ascii")
        except UnicodeDecodeError:
            raise CodecError(f"{what} is not ASCII") from None


def decode(data: bytes | bytearray | memoryview) -> PushMessage:
    """The message in ``data`` (exactly one, no trailing bytes).

    :raises CodecError: anything malformed (wrong magic or version, an unknown type or reason,
        truncated, trailing bytes, over the size limit, a field out of range).
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError(f"expected bytes, got {type(data).__name__}")
    buf = bytes(data)
    if len(buf) > MAX_PUSH_MESSAGE_BYTES:
        raise CodecError(f"push message is {len(buf)} bytes; the limit is {MAX_PUSH_MESSAGE_BYTES}")
    r = _Reader(buf)
    if r.take(2, "magic") != MAGIC:
        raise CodecError(f"bad magic {buf[:2]!r}: not a kvframe push message")
    version = r.u8("version")
    if version != VERSION:
        raise CodecError(f"push message version {version} is not supported (this side reads 1)")
    mtype = r.u8("type")
    try:
        msg: PushMessage
        if mtype == 2:
            lease_id = r.text("lease id")
            code = r.u8("reason")
            if code not in RefuseReason._value2member_map_:
                raise CodecError(f"unknown refusal reason byte {code}")
            msg = PushRefused(lease_id=lease_id, reason=RefuseReason(code))
        elif mtype == 1:
            push_id = r.text("push id")
            lease_id = r.text("lease id")
            first, tokens = r.u32("first block"), r.u32("token count")
            digest = r.text("prompt digest")
            n = r.u8("group count")
            groups = []
            for g in range(n):
                count = r.u32(f"group {g} count")
                if count > MAX_PUSH_MESSAGE_BYTES // 4:
                    raise CodecError(f"group {g} claims {count} blocks; more than fit a message")
                raw = r.take(4 * count, f"group {g} blocks")
                groups.append(struct.unpack(f">{count}I", raw))
            msg = PushRegister(
                push_id=push_id,
                lease_id=lease_id,
                first_block=first,
                num_tokens=tokens,
                prompt_digest=digest,
                groups=groups,
            )
        else:
            raise CodecError(f"unknown push message type {mtype}")
    except ValueError as exc:
        raise CodecError(f"malformed push message: {exc}") from None
    if r.pos != len(buf):
        raise CodecError(f"{len(buf) - r.pos} trailing bytes after a push message")
    return msg


# -- P's matching ------------------------------------------------------------------------------
@attrs.frozen(kw_only=True)
class StartWrite:
    """Both the KV and the registration exist and agree: write P's ``local_block_ids`` into
    D's ``remote_block_ids`` under D's lease ``lease_id`` (hand it to the writer machine)."""

    request_id: str
    engine: str
    lease_id: str
    local_block_ids: tuple[tuple[int, ...], ...]
    remote_block_ids: tuple[tuple[int, ...], ...]
    first_block: int = 0
    """The index in P's block list of ``local_block_ids``' first block."""


@attrs.frozen(kw_only=True)
class Refuse:
    """Send D a :class:`PushRefused` for its lease ``lease_id`` (and heartbeat it no more)."""

    engine: str
    lease_id: str
    reason: RefuseReason


@attrs.frozen(kw_only=True)
class EndSource:
    """P's request ``request_id`` will not be pushed: free its KV (``finished_sending``)."""

    request_id: str
    reason: str


@attrs.frozen(kw_only=True)
class Keepalive:
    """Heartbeat D's leases ``lease_ids`` on ``engine`` now: P waits for its prefill and still
    means to write."""

    engine: str
    lease_ids: tuple[str, ...]


PushAction: TypeAlias = StartWrite | Refuse | EndSource | Keepalive
"""Anything :class:`PushSource` asks its caller to do."""


@attrs.define(eq=False)
class _Offer:
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    prompt_digest: str
    deadline: float


@attrs.define(eq=False)
class _Waiting:
    engine: str
    reg: PushRegister
    deadline: float
    beat_at: float


class PushSource:
    """P's half of push mode before the write: pairs each finished prefill (:meth:`offer`)
    with the registration D sent for it (:meth:`register`), in either order.

    :param wait_timeout: how long an offer waits for its registration, and a registration for
        its offer, seconds; then the offer's KV is freed (:class:`EndSource`) or the
        registration refused (:class:`Refuse`, ``GAVE_UP`` or ``UNKNOWN``).
    :param heartbeat_interval: how often a waiting registration's lease is heartbeated.
    :param capacity: registrations waiting at most (a new one past it is refused ``UNKNOWN``),
        and push ids remembered as abandoned or used.
    :param require_digest: refuse (``PROMPT``) a registration or an offer without a prompt
        digest (a fleet with a key binds every write to its prompt).
    """

    def __init__(
        self,
        *,
        wait_timeout: float,
        heartbeat_interval: float,
        capacity: int = 4096,
        require_digest: bool = False,
    ) -> None:
        self._require = require_digest
        self._wait = check_config_seconds("wait_timeout", wait_timeout)
        self._beat = check_config_seconds("heartbeat_interval", heartbeat_interval)
        self._capacity = capacity
        self._offers: dict[str, _Offer] = {}  # push id -> offer
        self._by_request: dict[str, str] = {}  # request id -> push id (offers waiting)
        self._waiting: dict[str, _Waiting] = {}  # push id -> registration
        self._gone: OrderedDict[str, RefuseReason] = OrderedDict()  # push id -> why refused
        # push id -> (engine, lease id) of the registration it was matched with: a copy of
        # that registration (a transport that delivers twice, a replay) is ignored, never
        # refused: a refusal would make D free the blocks the write is landing in.
        self._matched: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self._counts: dict[str, int] = {}

    def __len__(self) -> int:
        """Offers and registrations waiting."""
        return len(self._offers) + len(self._waiting)

    def take_counts(self) -> dict[str, int]:
        """Counts since the last call (``push_matched``, ``push_refused``,
        ``push_unregistered``, ``push_duplicates``: copies of a registration already taken,
        ignored)."""
        out, self._counts = self._counts, {}
        return out

    def _count(self, name: str) -> None:
        self._counts[name] = self._counts.get(name, 0) + 1

    def next_deadline(self) -> float | None:
        """When :meth:`tick` must run next, or ``None``."""
        times = [o.deadline for o in self._offers.values()]
        times += [min(w.deadline, w.beat_at) for w in self._waiting.values()]
        return min(times) if times else None

    def _remember(self, push_id: str, why: RefuseReason) -> None:
        self._gone[push_id] = why
        self._gone.move_to_end(push_id)
        while len(self._gone) > self._capacity:
            self._gone.popitem(last=False)

    def registration(self, push_id: str) -> tuple[str, PushRegister] | None:
        """The registration waiting for ``push_id``'s prefill, with the peer it came from (P
        may write parts of it early: ``push_layerwise``), or ``None``."""
        w = self._waiting.get(push_id)
        return None if w is None else (w.engine, w.reg)

    def fits(
        self,
        reg: PushRegister,
        block_ids: tuple[tuple[int, ...], ...],
        num_tokens: int,
        prompt_digest: str,
        *,
        partial: bool = False,
    ) -> RefuseReason | None:
        """Why a registration does not fit P's request (``None``: it fits): the check
        :meth:`offer` makes before it writes. ``partial``: ``block_ids`` are the blocks so far
        of a prefill under way (only the group count is checked, not the range)."""
        digests = (reg.prompt_digest, prompt_digest)
        if (
            reg.num_tokens != num_tokens
            or (all(digests) and digests[0] != digests[1])
            or (self._require and not all(digests))
        ):
            return RefuseReason.PROMPT
        if len(reg.groups) != len(block_ids):
            return RefuseReason.BLOCKS
        if not partial and any(
            reg.first_block + len(d) > len(p) for d, p in zip(reg.groups, block_ids, strict=True)
        ):
            return RefuseReason.BLOCKS
        return None

    def offer(
        self,
        request_id: str,
        push_id: str,
        block_ids: tuple[tuple[int, ...], ...],
        num_tokens: int,
        prompt_digest: str,
        now: float,
    ) -> list[PushAction]:
        """P's prefill of ``request_id`` finished; its KV (``block_ids``, ``num_tokens``
        tokens) waits for push id ``push_id``'s registration."""
        t = check_now(now)
        if push_id in self._offers or push_id in self._gone:
            self._count("push_refused")
            return [EndSource(request_id=request_id, reason=f"push id {push_id!r} used twice")]
        offer = _Offer(request_id, block_ids, num_tokens, prompt_digest, t + self._wait)
        waiting = self._waiting.pop(push_id, None)
        if waiting is None:
            self._offers[push_id] = offer
            self._by_request[request_id] = push_id
            return []
        return self._match(push_id, offer, waiting)

    def register(self, engine: str, reg: PushRegister, now: float) -> list[PushAction]:
        """D's registration arrived from ``engine`` (the transport peer it came from)."""
        t = check_now(now)
        pid = reg.push_id
        waiting = self._waiting.get(pid)
        if self._matched.get(pid) == (engine, reg.lease_id) or (
            waiting is not None and (waiting.engine, waiting.reg.lease_id) == (engine, reg.lease_id)
        ):
            self._count("push_duplicates")
            return []  # a copy of a registration already taken
        gone = self._gone.get(pid)
        if gone is not None or waiting is not None:
            self._count("push_refused")
            why = RefuseReason.DUPLICATE if gone is None or gone is RefuseReason.DUPLICATE else gone
            return [Refuse(engine=engine, lease_id=reg.lease_id, reason=why)]
        offer = self._offers.pop(pid, None)
        if offer is not None:
            del self._by_request[offer.request_id]
            return self._match(pid, offer, _Waiting(engine, reg, t, t))
        if len(self._waiting) >= self._capacity:
            self._count("push_refused")
            return [Refuse(engine=engine, lease_id=reg.lease_id, reason=RefuseReason.UNKNOWN)]
        self._waiting[pid] = _Waiting(engine, reg, t + self._wait, t + self._beat)
        return [Keepalive(engine=engine, lease_ids=(reg.lease_id,))]

    def abandon(self, push_id: str, now: float) -> list[PushAction]:
        """P's request for ``push_id`` ended without KV to push (aborted before its prefill
        finished, or not kept): its registration, now or later, is refused ``ABANDONED``."""
        check_now(now)
        self._remember(push_id, RefuseReason.ABANDONED)
        waiting = self._waiting.pop(push_id, None)
        if waiting is None:
            return []
        self._count("push_refused")
        return [
            Refuse(
                engine=waiting.engine, lease_id=waiting.reg.lease_id, reason=RefuseReason.ABANDONED
            )
        ]

    def abort(self, request_id: str, now: float) -> list[PushAction]:
        """P's engine gives up request ``request_id`` while its offer waits: end it now."""
        check_now(now)
        pid = self._by_request.pop(request_id, None)
        if pid is None:
            return []
        del self._offers[pid]
        self._remember(pid, RefuseReason.ABANDONED)
        return [EndSource(request_id=request_id, reason="aborted by the engine")]

    def revoked(self, engine: str, handles: Iterable[int], now: float) -> list[str]:
        """D revoked the leases with these wire handles (it aborted): the registrations of
        them that wait are dropped, and their lease ids returned (tell D the write will not
        come: a release)."""
        check_now(now)
        wanted = set(handles)
        out = []
        for pid, w in list(self._waiting.items()):
            if w.engine == engine and lease_handle(w.reg.lease_id) in wanted:
                del self._waiting[pid]
                self._remember(pid, RefuseReason.ABANDONED)
                out.append(w.reg.lease_id)
        return out

    def peer_gone(self, engine: str, now: float) -> list[PushAction]:
        """The connection to ``engine`` is gone: its waiting registrations are dropped (its
        leases expire there); the offers they would have matched wait on."""
        check_now(now)
        for pid, w in list(self._waiting.items()):
            if w.engine == engine:
                del self._waiting[pid]
        return []

    def tick(self, now: float) -> list[PushAction]:
        """Fire deadlines: offers nobody registered for are freed, registrations whose prefill
        never came are refused, waiting registrations' leases are heartbeated."""
        t = check_now(now)
        out: list[PushAction] = []
        for pid, offer in list(self._offers.items()):
            if offer.deadline <= t:
                del self._offers[pid]
                del self._by_request[offer.request_id]
                self._remember(pid, RefuseReason.GAVE_UP)
                self._count("push_unregistered")
                out.append(
                    EndSource(
                        request_id=offer.request_id,
                        reason=f"no decoder registered for push id {pid!r} within {self._wait:g} s",
                    )
                )
        beats: dict[str, list[str]] = {}
        for pid, w in list(self._waiting.items()):
            if w.deadline <= t:
                del self._waiting[pid]
                self._remember(pid, RefuseReason.UNKNOWN)  # a late copy is refused again
                self._count("push_refused")
                out.append(
                    Refuse(engine=w.engine, lease_id=w.reg.lease_id, reason=RefuseReason.UNKNOWN)
                )
            elif w.beat_at <= t:
                w.beat_at = t + self._beat
                beats.setdefault(w.engine, []).append(w.reg.lease_id)
        out += [Keepalive(engine=e, lease_ids=tuple(ids)) for e, ids in beats.items()]
        return out

    def _match(self, push_id: str, offer: _Offer, w: _Waiting) -> list[PushAction]:
        reg = w.reg
        refuse = self.fits(reg, offer.block_ids, offer.num_tokens, offer.prompt_digest)
        if refuse is not None:
            self._remember(push_id, refuse)
            self._count("push_refused")
            return [
                Refuse(engine=w.engine, lease_id=reg.lease_id, reason=refuse),
                EndSource(request_id=offer.request_id, reason=refuse.text()),
            ]
        self._remember(push_id, RefuseReason.DUPLICATE)
        self._matched[push_id] = (w.engine, reg.lease_id)
        while len(self._matched) > self._capacity:
            self._matched.popitem(last=False)
        self._count("push_matched")
        first = reg.first_block
        local = tuple(
            p[first : first + len(d)] for d, p in zip(reg.groups, offer.block_ids, strict=True)
        )
        return [
            StartWrite(
                request_id=offer.request_id,
                engine=w.engine,
                lease_id=reg.lease_id,
                local_block_ids=local,
                remote_block_ids=reg.groups,
                first_block=first,
            )
        ]
