"""The holder's lease table: P keeps finished KV blocks under a per-request lease.

Prefill (P) finishes a request's KV and *grants* a lease on its blocks; decode (D) heartbeats
to *renew* it while it waits to read, reports *consumption* when its read completed, and P
*aborts* the lease when no reader will come. A lease nobody renews *expires* and its blocks are
reclaimed. Every lease ends exactly once, in one of three ways (consumed, aborted, expired),
and the table says which.

The table is sans-I/O: every call takes ``now`` (seconds on the caller's monotonic clock),
returns what happened, and :meth:`LeaseTable.next_deadline` says when to call
:meth:`LeaseTable.expire` next (like aioquic's ``get_timer``/``handle_timer``). ``now`` values
are clamped to be non-decreasing (:class:`~kvframe.core.clock.MonotonicClamp`): a smaller
``now`` never shortens or un-expires anything.

The legal transitions are data, in :data:`TRANSITIONS`; the table consults it for every event,
the tests enumerate it, and the docs draw it (:func:`state_diagram`). Illegal events raise
:class:`~kvframe.errors.InvalidTransitionError` and leave the table unchanged.

Timing comes from one number (:meth:`LeasePolicy.from_duration`): a lease is granted for
``kv_lease_duration`` seconds; D heartbeats every ``heartbeat_interval``; each heartbeat sets
the expiry to ``max(old, t + extension)``.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from typing import Any, Generic, NamedTuple, TypeVar, overload

import attrs
import numpy as np
import numpy.typing as npt

from kvframe.core._checks import check_config_seconds, check_now, is_real
from kvframe.core.clock import MonotonicClamp
from kvframe.errors import ConfigError, InvalidTransitionError, LeaseError

__all__ = [
    "DEFAULT_REMEMBER_ENDED",
    "TRANSITIONS",
    "EndedLeases",
    "HandleRenewResult",
    "Lease",
    "LeaseCounters",
    "LeaseEvent",
    "LeasePolicy",
    "LeaseState",
    "LeaseTable",
    "RenewIgnored",
    "RenewResult",
    "Transition",
    "lease_handle",
    "next_state",
    "state_diagram",
    "transition_table",
]

_PayloadT = TypeVar("_PayloadT")

#: How many ended leases a :class:`LeaseTable` remembers by default (for precise errors and
#: :meth:`LeaseTable.lease` answers after the end). Older ones are forgotten, oldest first.
DEFAULT_REMEMBER_ENDED = 10_000


class LeaseState(enum.Enum):
    """Where a request id's lease is."""

    ABSENT = "absent"
    """No lease is known for this id: never granted, or ended so long ago it was forgotten."""
    LIVE = "live"
    """Granted and not ended: the holder keeps the blocks until the expiry."""
    CONSUMED = "consumed"
    """Ended: the reader reported completion; the blocks were released at once."""
    ABORTED = "aborted"
    """Ended: released by the holder because no reader will come."""
    EXPIRED = "expired"
    """Ended: nobody renewed it in time; the blocks were reclaimed."""

    @property
    def ended(self) -> bool:
        """True for the three terminal states."""
        return self in _ENDED


_ENDED = frozenset({LeaseState.CONSUMED, LeaseState.ABORTED, LeaseState.EXPIRED})


class LeaseEvent(enum.Enum):
    """What can happen to a lease."""

    GRANT = "grant"
    """The request's KV is ready to be read (:meth:`LeaseTable.grant`)."""
    RENEW = "renew"
    """A heartbeat from the reader (:meth:`LeaseTable.renew`)."""
    CONSUME = "consume"
    """The reader reported completion (:meth:`LeaseTable.consume`)."""
    ABORT = "abort"
    """No reader will come (:meth:`LeaseTable.abort`)."""
    EXPIRE = "expire"
    """The expiry passed (:meth:`LeaseTable.expire`)."""


@attrs.frozen(kw_only=True)
class Transition:
    """One legal ``(source, event) -> target`` step and what it does."""

    source: LeaseState
    event: LeaseEvent
    target: LeaseState
    effect: str
    """What happens, in a few words (shown in the docs and the state diagram)."""


_S, _E = LeaseState, LeaseEvent

#: Every legal transition. A ``(state, event)`` pair that is not here is illegal and raises
#: :class:`~kvframe.errors.InvalidTransitionError`. Renewals of leases that are not live are
#: legal no-ops (a heartbeat may cross the end of its lease in flight): they are counted as
#: ignored, never create a lease.
TRANSITIONS: tuple[Transition, ...] = (
    Transition(source=_S.ABSENT, event=_E.GRANT, target=_S.LIVE, effect="expiry = now + duration"),
    Transition(source=_S.ABSENT, event=_E.RENEW, target=_S.ABSENT, effect="ignored, counted"),
    Transition(
        source=_S.LIVE,
        event=_E.RENEW,
        target=_S.LIVE,
        effect="expiry = max(expiry, sent + extension)",
    ),
    Transition(source=_S.LIVE, event=_E.CONSUME, target=_S.CONSUMED, effect="blocks released"),
    Transition(source=_S.LIVE, event=_E.ABORT, target=_S.ABORTED, effect="blocks released"),
    Transition(
        source=_S.LIVE, event=_E.EXPIRE, target=_S.EXPIRED, effect="expiry <= now; reclaimed"
    ),
    Transition(source=_S.CONSUMED, event=_E.RENEW, target=_S.CONSUMED, effect="ignored, counted"),
    Transition(source=_S.ABORTED, event=_E.RENEW, target=_S.ABORTED, effect="ignored, counted"),
    Transition(source=_S.EXPIRED, event=_E.RENEW, target=_S.EXPIRED, effect="ignored, counted"),
)

_TABLE: dict[tuple[LeaseState, LeaseEvent], Transition] = {
    (t.source, t.event): t for t in TRANSITIONS
}
del _S, _E


def next_state(state: LeaseState, event: LeaseEvent, request_id: str | None = None) -> LeaseState:
    """The state after ``event`` in ``state``, according to :data:`TRANSITIONS`.

    Raises :class:`~kvframe.errors.InvalidTransitionError` naming the state, the event, the
    request id (when given) and the events that are legal in that state.
    """
    rule = _TABLE.get((state, event))
    if rule is None:
        legal = sorted(e.value for (s, e) in _TABLE if s is state)
        who = f" for request id {request_id!r}" if request_id is not None else ""
        raise InvalidTransitionError(
            f"cannot {event.value}{who}: its lease is {state.value}; "
            f"legal events in state {state.value!r}: {', '.join(legal) or 'none'}"
        )
    return rule.target


def state_diagram() -> str:
    """The lease state machine as a mermaid ``stateDiagram-v2`` block, drawn from
    :data:`TRANSITIONS` (embedded in ``docs/leases.md``)."""
    lines = ["```mermaid", "stateDiagram-v2", "    [*] --> absent"]
    lines += [f"    {t.source.value} --> {t.target.value}: {t.event.value}" for t in TRANSITIONS]
    lines.append("```")
    return "\n".join(lines) + "\n"


def transition_table() -> str:
    """:data:`TRANSITIONS` as a markdown table (state, event, next state, effect), followed by
    the list of illegal pairs (embedded in ``docs/leases.md``)."""
    lines = ["| state | event | next state | effect |", "|---|---|---|---|"]
    lines += [
        f"| `{t.source.value}` | `{t.event.value}` | `{t.target.value}` | {t.effect} |"
        for t in TRANSITIONS
    ]
    illegal = [
        f"`{s.value}` × `{e.value}`" for s in LeaseState for e in LeaseEvent if (s, e) not in _TABLE
    ]
    lines += ["", "Every other pair raises `InvalidTransitionError`: " + ", ".join(illegal) + "."]
    return "\n".join(lines) + "\n"


def _floor_or_exact(duration: float) -> tuple[float, float]:
    # The seeds specify floor division (30 -> 5 and 20). Below 6 s floor division gives a zero
    # interval (a heartbeat storm) and, below 1.5 s, a zero extension (leases that can never be
    # renewed), so short durations -- legitimate in tests -- use the exact fractions. The two
    # rules agree at 6 s (1 and 4).
    if duration >= 6:
        return float(duration // 6), float(duration * 2 // 3)
    return duration / 6, duration * 2 / 3


@attrs.frozen(kw_only=True)
class LeasePolicy:
    """The lease timing: initial duration, heartbeat interval, renewal extension (seconds).

    Build it from one number with :meth:`from_duration`. Direct construction is for tests and
    unusual deployments; it raises :class:`~kvframe.errors.ConfigError` unless every field is
    a finite positive number and ``heartbeat_interval < extension`` (otherwise a lease renewed
    on time would still expire between two heartbeats).
    """

    duration: float
    """``kv_lease_duration``: a new lease lives this long without any heartbeat."""
    heartbeat_interval: float
    """D sends one heartbeat per remote engine this often."""
    extension: float
    """A heartbeat sent at ``t`` keeps the lease until at least ``t + extension``."""

    def __attrs_post_init__(self) -> None:
        check_config_seconds("kv_lease_duration", self.duration)
        check_config_seconds("heartbeat_interval", self.heartbeat_interval)
        check_config_seconds("extension", self.extension)
        if not self.heartbeat_interval < self.extension:
            raise ConfigError(
                f"heartbeat_interval ({self.heartbeat_interval!r}) must be smaller than "
                f"extension ({self.extension!r}), or a lease renewed on time would expire"
            )

    @classmethod
    def from_duration(cls, kv_lease_duration: float = 30.0) -> LeasePolicy:
        """The policy for one ``kv_lease_duration`` (default 30 s).

        For durations of 6 s or more: ``heartbeat_interval = duration // 6`` and
        ``extension = duration * 2 // 3`` (floor division, as vLLM specifies; 30 gives 5 and
        20). Below 6 s the exact fractions ``duration / 6`` and ``duration * 2 / 3`` are used,
        because floor division would give a zero interval. Either way a lease survives three
        lost heartbeats in a row: the extension is four intervals.

        Raises :class:`~kvframe.errors.ConfigError` naming the value for zero, negative, NaN,
        infinite and non-numeric values (``bool`` included).
        """
        d = check_config_seconds("kv_lease_duration", kv_lease_duration)
        interval, extension = _floor_or_exact(d)
        return cls(duration=d, heartbeat_interval=interval, extension=extension)


class Lease(NamedTuple, Generic[_PayloadT]):
    """A snapshot of one request's lease (a value: it does not change when the table does).

    A named tuple (cheap to make: :meth:`LeaseTable.expire` returns thousands at once); read
    it by field name.
    """

    request_id: str
    state: LeaseState
    """``LIVE`` or one of the ended states (never ``ABSENT``)."""
    granted_at: float
    expiry: float
    """When it expires (or expired, or would have): holder's clock, seconds."""
    renewals: int
    """How many heartbeats renewed it (stale and post-expiry ones excluded)."""
    payload: _PayloadT
    """What the holder attached at grant (block ids, a handle, ...); opaque to the core."""
    ended_at: float | None = None
    """When it ended (the ``now`` of the ending call), ``None`` while live."""
    handle: int = 0
    """The lease's 64-bit handle (:func:`lease_handle` of the request id): what heartbeats
    and notices carry on the wire instead of the id."""


class RenewIgnored(enum.Enum):
    """Why :meth:`LeaseTable.renew` did not renew an id."""

    UNKNOWN = "unknown"
    """No lease with this id (never granted, or forgotten)."""
    CONSUMED = "consumed"
    """Its lease ended: consumed."""
    ABORTED = "aborted"
    """Its lease ended: aborted."""
    EXPIRED = "expired"
    """Its lease expired, or its expiry has passed and the next :meth:`~LeaseTable.expire`
    will reclaim it (a renewal never revives a lease that is due)."""
    STALE = "stale"
    """The lease is live but the heartbeat was sent too long ago to extend it (a delayed
    burst); its expiry is unchanged."""


@attrs.frozen(kw_only=True)
class RenewResult:
    """What one :meth:`LeaseTable.renew` call did."""

    renewed: Mapping[str, float]
    """Request id -> its expiry after this call, for every live lease the heartbeat
    confirmed. The holder acknowledges each with this expiry."""
    ignored: Mapping[str, RenewIgnored]
    """Request id -> why it was not renewed. Nothing was created or changed for these."""


@attrs.frozen(kw_only=True)
class LeaseCounters:
    """Cumulative counts of a :class:`LeaseTable` (per id for renewals)."""

    granted: int
    renewed: int
    renew_ignored: int
    """Renewals of unknown, ended, due or stale leases (each id counted once per call)."""
    consumed: int
    aborted: int
    expired: int
    clock_regressions: int
    """Calls whose ``now`` was smaller than an earlier one (clamped)."""


_REASON_FOR = {
    LeaseState.CONSUMED: RenewIgnored.CONSUMED,
    LeaseState.ABORTED: RenewIgnored.ABORTED,
    LeaseState.EXPIRED: RenewIgnored.EXPIRED,
}

# Runs an iterator to its end, keeping nothing (a C-level loop).
_drain: Callable[[Iterable[Any]], None] = deque[Any](maxlen=0).extend

_EMPTY = 0  # handle-index key of a never-used position
_TOMB = 1  # handle-index key of a position whose handle was removed
_INF = math.inf
# Slots come in chunks of this many, each with a lower bound of its expiries (_cmin): expire
# scans only the chunks that may hold a due lease.
_SHIFT = 10
_CHUNK = 1 << _SHIFT


def lease_handle(request_id: str) -> int:
    """The 64-bit handle of a lease id: the first 8 bytes of BLAKE2b-64 of its UTF-8 bytes, as
    a big-endian unsigned integer (0 and 1, reserved, are moved to 2 and 3).

    Reader and holder compute it from the id they both know, so nothing extra travels in
    ``kv_transfer_params``, and the wire carries 8 bytes per lease instead of the id. A lease
    id drawn at random (the P/D connector draws 128 bits) gives a handle with 64 random bits: a
    forged or stale handle names nothing, except by a 2**-64 chance per guess and live lease.

    :raises LeaseError: ``request_id`` is not a non-empty str.
    """
    if not isinstance(request_id, str) or not request_id:
        raise LeaseError(f"request_id must be a non-empty str, got {request_id!r}")
    digest = hashlib.blake2b(request_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    h = int.from_bytes(digest, "big")
    return h + 2 if h < 2 else h


class _HandleIndex:
    """Handle -> slot, as an open-addressing hash table in two numpy arrays (linear probing;
    handles are uniformly random, so their low bits are the hash). Single lookups run in
    Python; batches (:meth:`slots`) run as a few vector operations per probe round, which is
    what lets a heartbeat of thousands of handles renew in one pass. ``slot_pos`` keeps where
    each slot's handle sits, so removing the handles of ended slots probes nothing."""

    __slots__ = ("keys", "mask", "slot_pos", "tombs", "used", "vals")

    def __init__(self, capacity: int = 1024) -> None:
        self._alloc(capacity)
        self.slot_pos = np.full(capacity, -1, dtype=np.intp)  # slot -> position (-1: none)

    def _alloc(self, capacity: int) -> None:
        self.keys = np.zeros(capacity, dtype=np.uint64)
        self.vals = np.full(capacity, -1, dtype=np.int64)
        self.mask = capacity - 1
        self.used = 0
        self.tombs = 0

    def _find(self, handle: int) -> int:
        # The position holding ``handle``, or -1.
        keys, mask = self.keys, self.mask
        p = handle & mask
        while True:
            k = int(keys[p])
            if k == handle:
                return p
            if k == _EMPTY:
                return -1
            p = (p + 1) & mask

    def get(self, handle: int) -> int:
        p = self._find(handle)
        return -1 if p < 0 else int(self.vals[p])

    def insert(self, handle: int, slot: int) -> None:
        """Add ``handle`` (the caller checked that it is absent)."""
        if 2 * (self.used + self.tombs + 1) > len(self.keys):
            self._rebuild()
        keys, mask = self.keys, self.mask
        p = handle & mask
        while True:
            k = int(keys[p])
            if k in (_EMPTY, _TOMB):
                break
            p = (p + 1) & mask
        if k == _TOMB:
            self.tombs -= 1
        keys[p] = handle
        self.vals[p] = slot
        self.used += 1
        if slot >= len(self.slot_pos):
            grow = np.full(max(slot + 1, 2 * len(self.slot_pos)), -1, dtype=np.intp)
            grow[: len(self.slot_pos)] = self.slot_pos
            self.slot_pos = grow
        self.slot_pos[slot] = p

    def positions(self, handles: npt.NDArray[np.uint64]) -> npt.NDArray[np.intp]:
        """Where each handle sits (-1 where absent), all at once: one vector round for every
        handle, then rounds only for those that probe further."""
        keys, mask = self.keys, self.mask
        pos = (handles & np.uint64(mask)).astype(np.intp)
        k = keys[pos]
        hit = k == handles
        out = np.where(hit, pos, -1)
        miss = np.flatnonzero(~hit & (k != _EMPTY))
        while miss.size:
            at = (pos[miss] + 1) & mask
            pos[miss] = at
            k = keys[at]
            hit = k == handles[miss]
            out[miss[hit]] = at[hit]
            miss = miss[~hit & (k != _EMPTY)]
        return out

    def slots(self, handles: npt.NDArray[np.uint64]) -> npt.NDArray[np.int64]:
        """The slot of each handle (-1 where absent), all at once."""
        pos = self.positions(handles)
        return np.where(pos >= 0, self.vals[pos], -1)

    def remove_slots(self, slots: npt.NDArray[np.intp]) -> None:
        """Remove the handles of ``slots`` (each holds one: the caller checked)."""
        # A tombstone's val and a free slot's slot_pos are never read: left as they are.
        pos = self.slot_pos[slots]
        self.keys[pos] = _TOMB
        self.used -= len(pos)
        self.tombs += len(pos)

    def _rebuild(self) -> None:
        live = self.keys > _TOMB
        handles, vals = self.keys[live], self.vals[live]
        capacity = len(self.keys)
        while 4 * (len(handles) + 1) > capacity:
            capacity *= 2
        self._alloc(capacity)
        mask = np.uint64(self.mask)
        pos = (handles & mask).astype(np.intp)
        pending = np.arange(len(handles))
        while pending.size:
            p = pos[pending]
            free = self.keys[p] == _EMPTY
            cand, cand_pos = pending[free], p[free]
            _, first = np.unique(cand_pos, return_index=True)
            win = cand[first]
            self.keys[pos[win]] = handles[win]
            self.vals[pos[win]] = vals[win]
            self.slot_pos[vals[win]] = pos[win]
            placed = np.zeros(len(handles), dtype=bool)
            placed[win] = True
            pending = pending[~placed[pending]]
            pos[pending] = (pos[pending] + 1) & self.mask
        self.used = len(handles)


class EndedLeases(Sequence[Lease[_PayloadT]]):
    """The leases one call ended (all in one state, at one ``now``), earliest expiry first: a
    read-only sequence of :class:`Lease` rows, kept as columns.

    :meth:`LeaseTable.expire` may end thousands of leases at once; making a named tuple per
    lease costs more than the rest of the reclaim together. So the rows are made when first
    read (all at once, then kept), and a caller that needs only the ids, handles or payloads
    reads those columns and makes none. It compares equal to a list or tuple of the same rows.

    Columns, aligned with the rows: ``request_ids``, ``payloads`` and ``handles`` (tuples),
    ``granted_at``, ``expiries`` and ``renewals`` (read-only numpy arrays); and ``state`` (how
    they ended, the same for every row) and ``ended_at`` (the ``now`` of the call that ended
    them).
    """

    __slots__ = (
        "_rows",
        "_where",
        "ended_at",
        "expiries",
        "granted_at",
        "handles",
        "payloads",
        "renewals",
        "request_ids",
        "state",
    )

    def __init__(
        self,
        state: LeaseState,
        ended_at: float,
        request_ids: Iterable[str],
        payloads: Iterable[Any],
        handles: Iterable[int],
        granted_at: npt.ArrayLike,
        expiries: npt.ArrayLike,
        renewals: npt.ArrayLike,
    ) -> None:
        self.state = state
        self.ended_at = ended_at
        self.request_ids: tuple[str, ...] = tuple(request_ids)
        self.payloads: tuple[_PayloadT, ...] = tuple(payloads)
        self.handles: tuple[int, ...] = tuple(handles)
        self.granted_at: npt.NDArray[np.float64] = _frozen(granted_at, np.float64)
        self.expiries: npt.NDArray[np.float64] = _frozen(expiries, np.float64)
        self.renewals: npt.NDArray[np.int64] = _frozen(renewals, np.int64)
        self._rows: list[Lease[_PayloadT]] | None = None
        self._where: dict[int, int] | None = None

    def rows(self) -> list[Lease[_PayloadT]]:
        """Every row, as a new list."""
        return list(self._all())

    def _all(self) -> list[Lease[_PayloadT]]:
        rows = self._rows
        if rows is None:
            cols = zip(
                self.request_ids,
                repeat(self.state),
                self.granted_at.tolist(),
                self.expiries.tolist(),
                self.renewals.tolist(),
                self.payloads,
                repeat(self.ended_at),
                self.handles,
            )
            # Named tuples made by tuple.__new__ through map: no Python frame per lease.
            rows = self._rows = list(map(tuple.__new__, repeat(Lease), cols))
        return rows

    def by_handle(self, handle: int) -> Lease[_PayloadT] | None:
        """The row of the lease with ``handle``, or ``None``."""
        where = self._where
        if where is None:
            where = self._where = {h: i for i, h in enumerate(self.handles)}
        i = where.get(handle)
        return None if i is None else self[i]

    def __len__(self) -> int:
        return len(self.request_ids)

    @overload
    def __getitem__(self, index: int) -> Lease[_PayloadT]: ...

    @overload
    def __getitem__(self, index: slice) -> list[Lease[_PayloadT]]: ...

    def __getitem__(self, index: int | slice) -> Lease[_PayloadT] | list[Lease[_PayloadT]]:
        return self._all()[index]

    def __iter__(self) -> Iterator[Lease[_PayloadT]]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, EndedLeases):
            return self._all() == other._all()
        if isinstance(other, list | tuple):
            return len(other) == len(self) and self._all() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"EndedLeases({self._all()!r})"


def _frozen(values: npt.ArrayLike, dtype: type[np.generic]) -> npt.NDArray[Any]:
    out = np.array(values, dtype=dtype)  # a copy: the caller's array stays its own
    out.flags.writeable = False
    return out


_NONE_ENDED: EndedLeases[Any] = EndedLeases(LeaseState.EXPIRED, 0.0, [], [], [], [], [], [])


@attrs.frozen(kw_only=True, eq=False)
class HandleRenewResult:
    """What one :meth:`LeaseTable.renew_handles` call did (read-only numpy arrays)."""

    renewed: npt.NDArray[np.uint64]
    """The handles of the live leases the heartbeat renewed, in input order."""
    expiries: npt.NDArray[np.float64]
    """Each renewed lease's expiry after the call (aligned with :attr:`renewed`)."""
    ignored: Mapping[int, RenewIgnored]
    """Handle -> why it was not renewed (unknown, ended, due or stale)."""

    @property
    def min_expiry(self) -> float | None:
        """The earliest expiry among the renewed leases (``None`` when none was renewed): a
        lower bound for all of them, which is what an acknowledgement carries."""
        return float(self.expiries.min()) if len(self.expiries) else None


class LeaseTable(Generic[_PayloadT]):
    """Every lease one holder (a prefill instance) has granted.

    Live leases sit in *slots*: parallel numpy arrays of expiry, handle and renewal count,
    with the ids and payloads in lists, and an id -> slot dict. A handle index (an
    open-addressing hash table in numpy) maps each lease's 64-bit :func:`lease_handle` to its
    slot, so a heartbeat renews a batch of handles with a few vector operations
    (:meth:`renew_handles`), not a Python step per id. The table keeps a lower bound of the
    earliest live expiry (exact after :meth:`next_deadline` or :meth:`expire`): :meth:`expire`
    with nothing due is O(1); with something due it finds every due lease in one vector scan,
    however the leases were granted or renewed (a scan from the head of a grant-ordered list
    would strand renewed leases behind unrenewed ones, as vLLM's reaper did).

    Ended leases are remembered (up to ``remember_ended``, oldest forgotten first) so that
    :meth:`lease` can still say how one ended, a late renewal can be told *why* it was
    ignored, and a request id cannot be granted twice by mistake.

    Not thread-safe: use it from one thread (the holder's scheduler).

    :param policy: the timing (see :meth:`LeasePolicy.from_duration`).
    :param remember_ended: how many ended leases to remember (>= 0).
    :raises ConfigError: for a negative or non-integer ``remember_ended``.
    """

    def __init__(
        self, policy: LeasePolicy, *, remember_ended: int = DEFAULT_REMEMBER_ENDED
    ) -> None:
        if not isinstance(policy, LeasePolicy):
            raise ConfigError(f"policy must be a LeasePolicy, got {policy!r}")
        if not is_real(remember_ended) or not isinstance(remember_ended, int) or remember_ended < 0:
            raise ConfigError(f"remember_ended must be an int >= 0, got {remember_ended!r}")
        self._policy = policy
        self._remember = remember_ended
        self._slot: dict[str, int] = {}  # live id -> slot
        # Slots 0.._n-1 have been used; the arrays have one more element than there are
        # slots (see _exp). Object arrays, so that ending a batch gathers and clears its
        # slots' ids and payloads with one vector operation each.
        self._n = 0
        self._ids: npt.NDArray[np.object_] = np.full(65, None, dtype=object)  # None: free
        self._payloads: npt.NDArray[np.object_] = np.full(65, None, dtype=object)
        self._granted_at = np.zeros(65)
        # slot -> expiry (inf: free); one more element, -inf, is what slot -1 (absent) reads
        self._exp = np.full(65, _INF)
        self._exp[-1] = -_INF
        self._hnd = np.zeros(65, dtype=np.uint64)  # slot -> handle (0: free)
        self._ren = np.zeros(65, dtype=np.int64)  # slot -> renewals
        # chunk -> a lower bound of its slots' expiries (exact after a full recompute); a
        # renewal only raises expiries, so it leaves the bound valid.
        self._cmin = np.full(1, _INF)
        self._free: list[int] = []
        self._handles = _HandleIndex()
        self._lb = _INF  # <= every live expiry; == the earliest when _lb_exact
        self._lb_exact = True
        # Ended leases by handle, and their handles oldest first (one ends at most once).
        self._ended: dict[int, EndedLeases[_PayloadT]] = {}
        self._ended_order: deque[int] = deque()
        self._clock = MonotonicClamp()
        self._granted = self._renewed = self._renew_ignored = 0
        self._consumed = self._aborted = self._expired = 0

    # -- queries --------------------------------------------------------------------------
    @property
    def policy(self) -> LeasePolicy:
        """The timing this table applies."""
        return self._policy

    @property
    def now(self) -> float | None:
        """The latest (clamped) ``now`` any call has passed, or ``None`` before the first."""
        return self._clock.latest

    def __len__(self) -> int:
        """The number of live leases."""
        return len(self._slot)

    def __contains__(self, request_id: object) -> bool:
        """True when ``request_id`` holds a live lease."""
        return request_id in self._slot

    @property
    def live_count(self) -> int:
        """The number of live leases."""
        return len(self._slot)

    def lease(self, request_id: str) -> Lease[_PayloadT] | None:
        """A snapshot of ``request_id``'s lease: live, or ended and still remembered; ``None``
        when absent."""
        slot = self._slot.get(request_id)
        if slot is not None:
            return self._snapshot(slot, LeaseState.LIVE, None)
        return self._gone(request_id)

    def state(self, request_id: str) -> LeaseState:
        """``request_id``'s state (``ABSENT`` when unknown or forgotten)."""
        return self._state(request_id)

    def _state(self, request_id: str, handle: int | None = None) -> LeaseState:
        if request_id in self._slot:
            return LeaseState.LIVE
        ended = self._gone(request_id, handle)
        return LeaseState.ABSENT if ended is None else ended.state

    def _gone(self, request_id: str, handle: int | None = None) -> Lease[_PayloadT] | None:
        # The remembered ended lease of this id (None for a non-str id).
        if not self._ended or not isinstance(request_id, str) or not request_id:
            return None
        h = lease_handle(request_id) if handle is None else handle
        batch = self._ended.get(h)
        gone = None if batch is None else batch.by_handle(h)
        return gone if gone is not None and gone.request_id == request_id else None

    def request_id_for(self, handle: int) -> str | None:
        """The id of the lease with this handle: live, or ended and still remembered; ``None``
        for a handle that names nothing (forged, stale or forgotten)."""
        if isinstance(handle, bool) or not isinstance(handle, int) or not 1 < handle < 1 << 64:
            return None
        slot = self._handles.get(handle)
        if slot >= 0:
            rid: str = self._ids[slot]
            return rid
        batch = self._ended.get(handle)
        gone = None if batch is None else batch.by_handle(handle)
        return gone.request_id if gone is not None else None

    def leases(self) -> Iterator[Lease[_PayloadT]]:
        """Snapshots of every live lease, in grant order. Do not change the table while
        iterating."""
        for slot in self._slot.values():
            yield self._snapshot(slot, LeaseState.LIVE, None)

    @property
    def counters(self) -> LeaseCounters:
        """A snapshot of the cumulative counters."""
        return LeaseCounters(
            granted=self._granted,
            renewed=self._renewed,
            renew_ignored=self._renew_ignored,
            consumed=self._consumed,
            aborted=self._aborted,
            expired=self._expired,
            clock_regressions=self._clock.regressions,
        )

    def next_deadline(self) -> float | None:
        """The earliest expiry among live leases (call :meth:`expire` then), or ``None`` when
        no lease is live. Exact; O(1) unless a renewal or an ending since the last call may
        have moved it (then one vector scan)."""
        if not self._slot:
            return None
        if not self._lb_exact:
            self._exact_bounds()
        return self._lb

    # -- events ---------------------------------------------------------------------------
    def grant(
        self, request_id: str, now: float, payload: _PayloadT, *, ttl: float | None = None
    ) -> Lease[_PayloadT]:
        """Grant a lease on ``request_id``'s blocks: it expires at ``now + duration`` (or
        ``now + ttl``) unless renewed.

        :param payload: kept with the lease and handed back when it ends (e.g. block ids).
        :param ttl: the lease's first life in seconds instead of the policy's ``duration``
            (a finite number > 0): bidirectional mode keeps a decoder's blocks for
            ``decoder_kv_blocks_ttl`` this way (see :meth:`restart`).
        :returns: the new live lease (with its :attr:`~Lease.handle`).
        :raises InvalidTransitionError: the id holds a live lease, or one that ended and is
            still remembered (request ids are single-use). The table is unchanged.
        :raises LeaseError: ``request_id`` is not a non-empty str, ``now`` is not finite, or
            the id's handle equals a live lease's (two ids whose BLAKE2b-64 collide; with
            random ids a 2**-64 chance per pair). The table is unchanged.
        """
        handle = lease_handle(request_id)
        check_now(now)
        life = self._policy.duration if ttl is None else check_now(ttl, "ttl")
        if life <= 0:
            raise LeaseError(f"ttl must be > 0 seconds, got {ttl!r}")
        self._transition(request_id, LeaseEvent.GRANT, handle)
        other = self._handles.get(handle)
        if other >= 0:
            raise LeaseError(
                f"lease id {request_id!r} has the same 64-bit handle as live lease "
                f"{self._ids[other]!r}; draw another id"
            )
        t = self._clock.advance(now)
        expiry = t + life
        slot = self._alloc_slot()
        self._ids[slot] = request_id
        self._payloads[slot] = payload
        self._granted_at[slot] = t
        self._exp[slot] = expiry
        if expiry < self._cmin[slot >> _SHIFT]:
            self._cmin[slot >> _SHIFT] = expiry
        self._hnd[slot] = handle
        self._ren[slot] = 0
        self._handles.insert(handle, slot)
        self._slot[request_id] = slot
        self._lb = min(self._lb, expiry)
        self._granted += 1
        return Lease(request_id, LeaseState.LIVE, t, expiry, 0, payload, None, handle)

    def renew(
        self, request_ids: Iterable[str], now: float, *, sent_at: float | None = None
    ) -> RenewResult:
        """Renew a batch of leases (one heartbeat): each live lease's expiry becomes
        ``max(expiry, sent + extension)``, where ``sent`` is ``min(sent_at, now)`` or ``now``.

        :param request_ids: the ids in the heartbeat. Unknown and ended ids are ignored and
            counted, never created. A repeated id counts once.
        :param now: the holder's clock now.
        :param sent_at: when the heartbeat was sent, mapped onto the holder's clock (see
            :class:`~kvframe.core.clock.SendTimeMapper`). A heartbeat delayed in a queue thus
            extends leases only as far as it would have on time; one sent more than
            ``extension`` ago extends nothing (``STALE``). ``None`` treats it as sent now.
        :returns: the new expiry of each renewed id and the reason for each ignored one.
        :raises LeaseError: ``now`` or ``sent_at`` is not finite, or ``request_ids`` is a str
            (pass a list). Nothing was changed.

        A lease whose expiry has passed is not renewed (``EXPIRED``) even if :meth:`expire`
        has not reclaimed it yet: the outcome must not depend on when the caller reaps.
        :meth:`renew_handles` does the same for handles, in bulk.
        """
        if isinstance(request_ids, str | bytes):
            raise LeaseError(
                f"request_ids must be an iterable of ids, not a single {type(request_ids).__name__}"
                f" ({request_ids!r}); wrap it in a list"
            )
        t, candidate = self._renew_times(now, sent_at)
        ids = list(dict.fromkeys(request_ids))
        get = self._slot.get
        slots = np.fromiter((get(r, -1) for r in ids), dtype=np.int64, count=len(ids))
        found, ok, expiries = self._renew_slots(slots, t, candidate)
        renewed = dict(
            zip(np.asarray(ids, dtype=object)[ok].tolist(), expiries.tolist(), strict=True)
        )
        ignored: dict[str, RenewIgnored] = {}
        if len(renewed) != len(ids):
            for i in np.flatnonzero(~ok).tolist():
                rid = ids[i]
                if found[i]:
                    due = self._exp[slots[i]] <= t
                    ignored[rid] = RenewIgnored.EXPIRED if due else RenewIgnored.STALE
                else:
                    gone = self._gone(rid)
                    ignored[rid] = RenewIgnored.UNKNOWN if gone is None else _REASON_FOR[gone.state]
        self._renew_ignored += len(ignored)
        return RenewResult(renewed=renewed, ignored=ignored)

    def renew_handles(
        self,
        handles: Iterable[int] | npt.NDArray[np.uint64],
        now: float,
        *,
        sent_at: float | None = None,
    ) -> HandleRenewResult:
        """:meth:`renew` for a batch of lease handles (:func:`lease_handle`), in bulk: the
        batch is looked up, checked and renewed with a few vector operations, whatever its
        size. Same rules, counters and errors as :meth:`renew`.

        :param handles: the handles in the heartbeat (a numpy ``uint64`` array is taken as it
            is). Handles must be distinct (the wire guarantees it); a repeated one is renewed
            once but listed, and counted, each time. A handle that names no live lease
            (forged, stale or ended) is ignored with its reason, never created.
        :raises LeaseError: as :meth:`renew`, or a handle is not an integer in
            ``[0, 2**64)``. Nothing was changed.
        """
        if isinstance(handles, np.ndarray) and handles.dtype == np.uint64:
            h = handles.reshape(-1)
        else:
            try:
                h = np.fromiter(handles, dtype=np.uint64)
            except (TypeError, ValueError, OverflowError) as exc:
                raise LeaseError(
                    f"handles must be integers in [0, 2**64), got {handles!r}: {exc}"
                ) from None
        t, candidate = self._renew_times(now, sent_at)
        slots = self._handles.slots(h)
        found, ok, expiries = self._renew_slots(slots, t, candidate)
        renewed = h[ok]
        exp_arr = expiries
        ignored: dict[int, RenewIgnored] = {}
        if len(renewed) != len(h):
            for i in np.flatnonzero(~ok).tolist():
                handle = int(h[i])
                if found[i]:
                    due = self._exp[slots[i]] <= t
                    ignored[handle] = RenewIgnored.EXPIRED if due else RenewIgnored.STALE
                else:
                    batch = self._ended.get(handle)
                    ignored[handle] = (
                        RenewIgnored.UNKNOWN if batch is None else _REASON_FOR[batch.state]
                    )
        self._renew_ignored += len(ignored)
        renewed.flags.writeable = False
        exp_arr.flags.writeable = False
        return HandleRenewResult(renewed=renewed, expiries=exp_arr, ignored=ignored)

    def restart(self, request_id: str, now: float, *, sent_at: float | None = None) -> float | None:
        """Make a live lease an ordinary heartbeated one from now: its expiry becomes
        ``sent + extension`` (``sent`` as in :meth:`renew`), *earlier or later* than before.

        Bidirectional mode grants a decoder's kept blocks with a long ``ttl`` (nobody
        heartbeats them between turns); the first heartbeat of the prefill engine that pulls
        them restarts the lease, so from then on it lives by that engine's heartbeats and
        ends within one extension of its last one.

        :returns: the new expiry, or ``None`` (nothing changed) when the id has no live lease,
            its expiry has passed (``expire`` reclaims it; a restart never revives one), or
            the heartbeat is stale (``sent + extension <= now``: it would end the lease).
        :raises LeaseError: ``now`` or ``sent_at`` is not finite.
        """
        t, candidate = self._renew_times(now, sent_at)
        slot = self._slot.get(request_id)
        if slot is None or self._exp[slot] <= t or candidate <= t:
            return None
        self._exp[slot] = candidate
        if candidate < self._cmin[slot >> _SHIFT]:
            self._cmin[slot >> _SHIFT] = candidate
        self._lb = min(self._lb, candidate)
        self._lb_exact = False
        return candidate

    def consume(self, request_id: str, now: float) -> Lease[_PayloadT]:
        """The reader reported completion: end the lease as ``CONSUMED``; release the blocks
        (the returned lease carries the payload) at once.

        A lease whose expiry has passed but that :meth:`expire` has not reclaimed yet is still
        consumed: its blocks were kept, so the read was good.

        :raises InvalidTransitionError: no live lease for the id (unknown, or already ended:
            the message says how and when). The table is unchanged.
        :raises LeaseError: ``now`` is not finite. The table is unchanged.
        """
        return self._end(request_id, now, LeaseEvent.CONSUME)

    def abort(self, request_id: str, now: float) -> Lease[_PayloadT]:
        """No reader will come: end the lease as ``ABORTED`` and release the blocks at once.

        Raises as :meth:`consume` does; the table is unchanged then.
        """
        return self._end(request_id, now, LeaseEvent.ABORT)

    def expire(self, now: float) -> EndedLeases[_PayloadT]:
        """End every live lease whose expiry is ``<= now`` as ``EXPIRED``; return them, earliest
        expiry first (ties in slot order), as an :class:`EndedLeases` sequence (its columns
        give ids, handles and payloads without making a :class:`Lease` per row). O(1) when
        nothing is due; otherwise one vector scan of the slots plus the work per lease ended.

        Raises :class:`~kvframe.errors.LeaseError` for a non-finite ``now`` (nothing ends).
        """
        t = self._clock.advance(now)
        if t < self._lb or not self._slot:
            return _NONE_ENDED
        exp = self._exp[: self._n]
        hot = np.flatnonzero(self._cmin <= t).tolist()
        if 4 * len(hot) >= len(self._cmin):  # most chunks: one scan of every slot
            due = np.flatnonzero(exp <= t)
        else:  # leases expire in grant order mostly, so a few chunks hold them all
            due = np.concatenate(
                [
                    np.flatnonzero(exp[c << _SHIFT : (c + 1) << _SHIFT] <= t) + (c << _SHIFT)
                    for c in hot
                ]
            )
        if len(due) > 1:
            due = due[np.argsort(exp[due], kind="stable")]
        state = next_state(LeaseState.LIVE, LeaseEvent.EXPIRE)
        out = self._retire_slots(due, state, t)
        self._expired += len(out)
        if 4 * len(hot) >= len(self._cmin):
            self._exact_bounds()
        else:
            cap = self._exp[:-1]
            for c in hot:
                self._cmin[c] = cap[c << _SHIFT : (c + 1) << _SHIFT].min()
            # Exact only if every other chunk's bound is: a renewal may have left one low.
            self._lb = float(self._cmin.min()) if self._slot else _INF
            self._lb_exact = False
        return out

    def _exact_bounds(self) -> None:
        # Every chunk's bound and the table's, exact: one pass over the slots.
        cap = self._exp[:-1]
        self._cmin = cap.reshape(len(self._cmin), -1).min(axis=1)
        self._lb = float(self._cmin.min()) if self._slot else _INF
        self._lb_exact = True

    # -- internals ------------------------------------------------------------------------
    def _alloc_slot(self) -> int:
        if self._free:
            return self._free.pop()
        slot = self._n
        if slot == len(self._exp) - 1:
            grow = slot
            exp = np.concatenate([self._exp[:-1], np.full(grow, _INF), self._exp[-1:]])
            self._exp = exp
            # Chunk c holds slots c * _CHUNK...: new chunks start with no lease (bound inf).
            cmin = np.full(max(1, (len(exp) - 1) >> _SHIFT), _INF)
            cmin[: len(self._cmin)] = self._cmin
            self._cmin = cmin
            self._hnd = np.concatenate([self._hnd, np.zeros(grow, dtype=np.uint64)])
            self._ren = np.concatenate([self._ren, np.zeros(grow, dtype=np.int64)])
            self._ids = np.concatenate([self._ids, np.full(grow, None, dtype=object)])
            self._payloads = np.concatenate([self._payloads, np.full(grow, None, dtype=object)])
            self._granted_at = np.concatenate([self._granted_at, np.zeros(grow)])
        self._n = slot + 1
        return slot

    def _renew_times(self, now: float, sent_at: float | None) -> tuple[float, float]:
        check_now(now)
        if sent_at is not None:
            check_now(sent_at, "sent_at")
        t = self._clock.advance(now)
        base = t if sent_at is None else min(float(sent_at), t)
        return t, base + self._policy.extension

    def _renew_slots(
        self, slots: npt.NDArray[np.int64], t: float, candidate: float
    ) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_], npt.NDArray[np.float64]]:
        # found: names a live lease; ok: renewed (live, not due, and the heartbeat is fresh).
        found = slots >= 0
        exp = self._exp
        cur = exp[slots]  # -inf for -1 (the sentinel)
        ok = cur > t if candidate > t else np.zeros(len(slots), dtype=bool)
        rs = slots[ok]
        new = np.maximum(cur[ok], candidate)
        if len(rs):
            exp[rs] = new
            self._ren[rs] += 1
            self._lb_exact = False
        self._renewed += len(rs)
        return found, ok, new

    def _transition(
        self, request_id: str, event: LeaseEvent, handle: int | None = None
    ) -> LeaseState:
        source = self._state(request_id, handle)
        try:
            return next_state(source, event, request_id)
        except InvalidTransitionError as exc:
            gone = self._gone(request_id, handle)
            if gone is not None:
                raise InvalidTransitionError(
                    f"{exc} (it ended at t={gone.ended_at!r}; request ids are single-use)"
                ) from None
            raise

    def _end(self, request_id: str, now: float, event: LeaseEvent) -> Lease[_PayloadT]:
        check_now(now)
        target = self._transition(request_id, event)
        t = self._clock.advance(now)
        if target is LeaseState.CONSUMED:
            self._consumed += 1
        else:
            self._aborted += 1
        slot = self._slot[request_id]
        if self._exp[slot] <= self._lb:
            self._lb_exact = False
        return self._retire_slots(np.array([slot], dtype=np.intp), target, t)[0]

    def _retire_slots(
        self, slots: npt.NDArray[np.intp], state: LeaseState, now: float
    ) -> EndedLeases[_PayloadT]:
        if not len(slots):
            return _NONE_ENDED
        idx = slots.tolist()
        hlist = self._hnd[slots].tolist()
        rids = self._ids[slots].tolist()
        # Columns, not rows: a Lease per ended lease is made only when the caller reads one.
        out: EndedLeases[_PayloadT] = EndedLeases(
            state,
            now,
            rids,
            self._payloads[slots].tolist(),
            hlist,
            self._granted_at[slots],
            self._exp[slots],
            self._ren[slots],
        )
        self._handles.remove_slots(slots)
        self._exp[slots] = _INF
        self._hnd[slots] = 0
        # C-level loops (map), not Python ones: expire may end thousands at once.
        _drain(map(self._slot.__delitem__, rids))
        self._ids[slots] = None
        self._payloads[slots] = None
        self._free.extend(idx)
        if self._remember:
            ended, order = self._ended, self._ended_order
            ended.update(zip(hlist, repeat(out)))
            order.extend(hlist)
            excess = len(order) - self._remember
            if excess > 0:
                _drain(map(ended.__delitem__, [order.popleft() for _ in range(excess)]))
        return out

    def _snapshot(self, slot: int, state: LeaseState, ended_at: float | None) -> Lease[_PayloadT]:
        payload: _PayloadT = self._payloads[slot]
        return Lease(
            self._ids[slot],
            state,
            float(self._granted_at[slot]),
            float(self._exp[slot]),
            int(self._ren[slot]),
            payload,
            ended_at,
            int(self._hnd[slot]),
        )
