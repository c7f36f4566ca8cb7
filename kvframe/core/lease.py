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
import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Generic, TypeVar

import attrs

from kvframe.core._checks import check_config_seconds, check_now, is_real
from kvframe.core.clock import MonotonicClamp
from kvframe.errors import ConfigError, InvalidTransitionError, LeaseError

__all__ = [
    "DEFAULT_REMEMBER_ENDED",
    "TRANSITIONS",
    "Lease",
    "LeaseCounters",
    "LeaseEvent",
    "LeasePolicy",
    "LeaseState",
    "LeaseTable",
    "RenewIgnored",
    "RenewResult",
    "Transition",
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


@attrs.frozen(kw_only=True)
class Lease(Generic[_PayloadT]):
    """A snapshot of one request's lease (a value: it does not change when the table does)."""

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


class _Record:
    __slots__ = ("expiry", "granted_at", "payload", "renewals", "token")

    def __init__(self, granted_at: float, expiry: float, payload: object, token: int) -> None:
        self.granted_at = granted_at
        self.expiry = expiry
        self.payload = payload
        self.renewals = 0
        self.token = token


_REASON_FOR = {
    LeaseState.CONSUMED: RenewIgnored.CONSUMED,
    LeaseState.ABORTED: RenewIgnored.ABORTED,
    LeaseState.EXPIRED: RenewIgnored.EXPIRED,
}

_Entry = tuple[float, int, str]  # (expiry, token, request id); (token, id) is unique


class _ExpiryIndex:
    """A priority queue of ``(expiry, token, id)`` entries, with lazy deletion by the caller.

    Grants and ``now``-based renewals produce expiries in non-decreasing order (``now`` is
    clamped; duration and extension are constant), so most entries go to a FIFO whose head is
    its minimum: O(1) to push and pop, no comparisons. Entries that would break the FIFO's
    order (a renewal as of an earlier ``sent_at``) go to a heap. The minimum is the smaller of
    the two heads, so every entry is found in expiry order whatever order it came in.
    """

    __slots__ = ("fifo", "heap")

    def __init__(self) -> None:
        self.fifo: deque[_Entry] = deque()
        self.heap: list[_Entry] = []

    def __len__(self) -> int:
        return len(self.fifo) + len(self.heap)

    def push(self, entry: _Entry) -> None:
        fifo = self.fifo
        if not fifo or entry[0] >= fifo[-1][0]:
            fifo.append(entry)
        else:
            heapq.heappush(self.heap, entry)

    def peek(self) -> _Entry | None:
        """The smallest entry (stale or not), or None."""
        fifo, heap = self.fifo, self.heap
        if fifo:
            if heap and heap[0] < fifo[0]:
                return heap[0]
            return fifo[0]
        return heap[0] if heap else None

    def pop(self) -> _Entry:
        """Remove and return the smallest entry; the index must not be empty."""
        fifo, heap = self.fifo, self.heap
        if fifo and not (heap and heap[0] < fifo[0]):
            return fifo.popleft()
        return heapq.heappop(heap)

    def rebuild(self, entries: list[_Entry]) -> None:
        entries.sort()
        self.fifo = deque(entries)
        self.heap = []


class LeaseTable(Generic[_PayloadT]):
    """Every lease one holder (a prefill instance) has granted.

    Live leases sit in a dict and in a priority queue of ``(expiry, token, id)`` entries with
    lazy deletion: a renewal pushes a new entry and makes the old one stale (its token no
    longer matches), an ending leaves its entry behind. The queue is a FIFO for entries that
    arrive in expiry order (grants and renewals as of ``now`` always do) plus a heap for the
    rest. So :meth:`expire` with nothing due and :meth:`next_deadline` are O(1) amortised,
    renewing ``k`` ids is O(k) (O(k log n) at worst), and every due lease is found however it
    was granted or renewed (a scan from the head of a grant-ordered list would strand renewed
    leases behind unrenewed ones, as vLLM's reaper did). The queue is rebuilt when stale
    entries outnumber live ones.

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
        self._live: dict[str, _Record] = {}
        self._index = _ExpiryIndex()
        self._ended: OrderedDict[str, Lease[_PayloadT]] = OrderedDict()
        self._clock = MonotonicClamp()
        self._token = 0
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
        return len(self._live)

    def __contains__(self, request_id: object) -> bool:
        """True when ``request_id`` holds a live lease."""
        return request_id in self._live

    @property
    def live_count(self) -> int:
        """The number of live leases."""
        return len(self._live)

    def lease(self, request_id: str) -> Lease[_PayloadT] | None:
        """A snapshot of ``request_id``'s lease: live, or ended and still remembered; ``None``
        when absent."""
        rec = self._live.get(request_id)
        if rec is not None:
            return self._snapshot(request_id, rec, LeaseState.LIVE, None)
        return self._ended.get(request_id)

    def state(self, request_id: str) -> LeaseState:
        """``request_id``'s state (``ABSENT`` when unknown or forgotten)."""
        if request_id in self._live:
            return LeaseState.LIVE
        ended = self._ended.get(request_id)
        return LeaseState.ABSENT if ended is None else ended.state

    def leases(self) -> Iterator[Lease[_PayloadT]]:
        """Snapshots of every live lease, in grant order. Do not change the table while
        iterating."""
        for rid, rec in self._live.items():
            yield self._snapshot(rid, rec, LeaseState.LIVE, None)

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
        no lease is live. Never later than any live lease's expiry."""
        index, live = self._index, self._live
        while True:
            entry = index.peek()
            if entry is None:
                return None
            rec = live.get(entry[2])
            if rec is not None and rec.token == entry[1]:
                return entry[0]
            index.pop()

    # -- events ---------------------------------------------------------------------------
    def grant(self, request_id: str, now: float, payload: _PayloadT) -> Lease[_PayloadT]:
        """Grant a lease on ``request_id``'s blocks: it expires at ``now + duration`` unless
        renewed.

        :param payload: kept with the lease and handed back when it ends (e.g. block ids).
        :returns: the new live lease.
        :raises InvalidTransitionError: the id holds a live lease, or one that ended and is
            still remembered (request ids are single-use). The table is unchanged.
        :raises LeaseError: ``request_id`` is not a non-empty str, or ``now`` is not finite.
            The table is unchanged.
        """
        if not isinstance(request_id, str) or not request_id:
            raise LeaseError(f"request_id must be a non-empty str, got {request_id!r}")
        check_now(now)
        self._transition(request_id, LeaseEvent.GRANT)
        t = self._clock.advance(now)
        self._token += 1
        rec = _Record(t, t + self._policy.duration, payload, self._token)
        self._live[request_id] = rec
        self._index.push((rec.expiry, rec.token, request_id))
        self._granted += 1
        return self._snapshot(request_id, rec, LeaseState.LIVE, None)

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
        """
        if isinstance(request_ids, str | bytes):
            raise LeaseError(
                f"request_ids must be an iterable of ids, not a single {type(request_ids).__name__}"
                f" ({request_ids!r}); wrap it in a list"
            )
        check_now(now)
        if sent_at is not None:
            check_now(sent_at, "sent_at")
        t = self._clock.advance(now)
        base = t if sent_at is None else min(float(sent_at), t)
        candidate = base + self._policy.extension
        live_get, ended, index = self._live.get, self._ended, self._index
        # Every push in this call has the same expiry, so one check picks the FIFO or the heap.
        push = index.fifo.append if not index.fifo or candidate >= index.fifo[-1][0] else index.push
        renewed: dict[str, float] = {}
        ignored: dict[str, RenewIgnored] = {}
        fresh = candidate > t
        # One token for every entry this call pushes: an entry is identified by (token, id),
        # and a call pushes at most one entry per id.
        self._token += 1
        token = self._token
        for rid in request_ids:
            rec = live_get(rid)
            if fresh and rec is not None and rec.expiry > t:
                if rid in renewed:
                    continue
                if candidate > rec.expiry:
                    rec.expiry = candidate
                    rec.token = token
                    push((candidate, token, rid))
                rec.renewals += 1
                renewed[rid] = rec.expiry
            elif rid in ignored or rid in renewed:
                continue
            elif rec is None:
                gone = ended.get(rid)
                ignored[rid] = RenewIgnored.UNKNOWN if gone is None else _REASON_FOR[gone.state]
            elif rec.expiry <= t:
                ignored[rid] = RenewIgnored.EXPIRED
            else:
                ignored[rid] = RenewIgnored.STALE
        self._renewed += len(renewed)
        self._renew_ignored += len(ignored)
        if len(self._index) > 2 * len(self._live) + 64:
            self._compact()
        return RenewResult(renewed=renewed, ignored=ignored)

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

    def expire(self, now: float) -> list[Lease[_PayloadT]]:
        """End every live lease whose expiry is ``<= now`` as ``EXPIRED``; return them, earliest
        expiry first. O(1) amortised when nothing is due.

        Raises :class:`~kvframe.errors.LeaseError` for a non-finite ``now`` (nothing ends).
        """
        t = self._clock.advance(now)
        index, live = self._index, self._live
        out: list[Lease[_PayloadT]] = []
        entry = index.peek()
        if entry is None or entry[0] > t:
            return out
        state = next_state(LeaseState.LIVE, LeaseEvent.EXPIRE)
        retire = self._retire
        while entry is not None and entry[0] <= t:
            _, token, rid = index.pop()
            rec = live.get(rid)
            if rec is not None and rec.token == token:
                del live[rid]
                out.append(retire(rid, rec, state, t))
            entry = index.peek()
        self._expired += len(out)
        return out

    # -- internals ------------------------------------------------------------------------
    def _transition(self, request_id: str, event: LeaseEvent) -> LeaseState:
        source = self.state(request_id)
        try:
            return next_state(source, event, request_id)
        except InvalidTransitionError as exc:
            gone = self._ended.get(request_id)
            if gone is not None:
                raise InvalidTransitionError(
                    f"{exc} (it ended at t={gone.ended_at!r}; request ids are single-use)"
                ) from None
            raise

    def _end(self, request_id: str, now: float, event: LeaseEvent) -> Lease[_PayloadT]:
        check_now(now)
        target = self._transition(request_id, event)
        t = self._clock.advance(now)
        rec = self._live.pop(request_id)
        if target is LeaseState.CONSUMED:
            self._consumed += 1
        else:
            self._aborted += 1
        if len(self._index) > 2 * len(self._live) + 64:
            self._compact()
        return self._retire(request_id, rec, target, t)

    def _retire(
        self, request_id: str, rec: _Record, state: LeaseState, now: float
    ) -> Lease[_PayloadT]:
        snap = self._snapshot(request_id, rec, state, now)
        if self._remember:
            ended = self._ended
            ended[request_id] = snap
            if len(ended) > self._remember:
                ended.popitem(last=False)
        return snap

    def _snapshot(
        self, request_id: str, rec: _Record, state: LeaseState, ended_at: float | None
    ) -> Lease[_PayloadT]:
        payload: _PayloadT = rec.payload  # type: ignore[assignment]
        return Lease(
            request_id=request_id,
            state=state,
            granted_at=rec.granted_at,
            expiry=rec.expiry,
            renewals=rec.renewals,
            payload=payload,
            ended_at=ended_at,
        )

    def _compact(self) -> None:
        self._index.rebuild([(rec.expiry, rec.token, rid) for rid, rec in self._live.items()])
