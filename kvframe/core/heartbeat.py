"""Heartbeats: D's tracker that decides what to send, and P's guard that decides what to believe.

**D (the reader)** tracks each request from the moment it enters its scheduler until its
transfer is done or the request ends. :meth:`HeartbeatTracker.due` answers, at most once per
interval for each remote engine, one :class:`HeartbeatBatch` holding every remote request id
tracked for that engine (one message per engine, not per request). An engine with nothing
tracked is dropped. :meth:`HeartbeatTracker.next_deadline` says when to call ``due`` again.
:meth:`HeartbeatTracker.rebase_ack` turns the holder's acknowledgement into deadlines on D's
clock, against the answered batch's send time, so D reads only under a confirmed lease.

**P (the holder)** runs each received heartbeat through :class:`HeartbeatGuard` before it
renews anything: the guard drops heartbeats older than one already accepted from the same
engine (sequence numbers) and maps the heartbeat's send time onto P's clock
(:class:`~kvframe.core.clock.SendTimeMapper`). P then calls
``LeaseTable.renew(ids, now, sent_at=mapped)``: a heartbeat that sat in a queue during a
partition and arrives in a burst later extends leases only to ``sent + extension``, which has
usually passed already, so it prolongs nothing.

Sans-I/O: every call takes ``now``; nothing here reads a clock or sends anything.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable

import attrs

from kvframe.core._checks import check_config_seconds, check_now
from kvframe.core.clock import (
    DEFAULT_MAX_DRIFT,
    ClockSample,
    MonotonicClamp,
    SendTimeMapper,
    rebase_deadline,
)
from kvframe.core.lease import LeasePolicy
from kvframe.errors import InvalidTransitionError, LeaseError

__all__ = [
    "REMEMBER_BATCHES",
    "SEQ_MODULUS",
    "HeartbeatBatch",
    "HeartbeatGuard",
    "HeartbeatTracker",
    "StopReason",
    "seq_newer_or_equal",
]

#: How many recent batches a :class:`HeartbeatTracker` remembers for
#: :meth:`HeartbeatTracker.rebase_ack` (an ack for an older batch is ignored).
REMEMBER_BATCHES = 4096

#: Sequence numbers are 32-bit and wrap around; compare them with :func:`seq_newer_or_equal`.
SEQ_MODULUS = 1 << 32


def seq_newer_or_equal(a: int, b: int) -> bool:
    """True when sequence number ``a`` is ``b`` or comes after it, modulo :data:`SEQ_MODULUS`
    (serial-number arithmetic: ``a`` is newer when it is less than half the space ahead)."""
    return (a - b) % SEQ_MODULUS < SEQ_MODULUS // 2


class StopReason(enum.Enum):
    """Why D stopped heartbeating for a request."""

    TRANSFER_DONE = "transfer_done"
    """The read completed (or failed for good): the lease is no longer needed."""
    FINISHED = "finished"
    """The request finished."""
    ABORTED = "aborted"
    """The request was aborted."""


@attrs.frozen(kw_only=True)
class HeartbeatBatch:
    """One heartbeat to send to one remote engine."""

    engine_id: str
    """The remote (holder) engine to send it to."""
    request_ids: tuple[str, ...]
    """Every remote request id tracked for that engine, sorted, without repeats."""
    seq: int
    """The tracker's sequence number (0 <= seq < 2**32, increasing per batch, wrapping)."""
    sent_at: float
    """The ``now`` of the :meth:`HeartbeatTracker.due` call: the send time to put on the wire.
    The tracker remembers it per ``seq`` to rebase the holder's acknowledgement safely
    (:meth:`HeartbeatTracker.rebase_ack`)."""


class _Engine:
    __slots__ = ("ids", "next_due")

    def __init__(self, next_due: float) -> None:
        self.ids: dict[str, int] = {}  # remote request id -> number of local requests using it
        self.next_due = next_due


class HeartbeatTracker:
    """D's side: which remote request ids to heartbeat, to which engine, and when.

    A newly tracked engine is due at once (so its lease is confirmed early), then every
    ``interval`` seconds after each batch; a late ``due`` call moves the schedule (no catch-up
    bursts). An engine whose requests all stopped keeps its schedule until it would next be
    due, then is dropped, so stopping and re-tracking cannot produce two batches in one
    interval.

    :param interval: seconds between batches to one engine (usually
        ``LeasePolicy.heartbeat_interval``; see :meth:`from_policy`).
    :raises ConfigError: for a non-positive, non-finite or non-numeric interval.
    """

    def __init__(self, interval: float) -> None:
        self._interval = check_config_seconds("heartbeat_interval", interval)
        self._requests: dict[str, tuple[str, str]] = {}
        self._engines: dict[str, _Engine] = {}
        self._clock = MonotonicClamp()
        self._seq = 0
        self._stopped = dict.fromkeys(StopReason, 0)
        # seq -> (engine, sent_at) of recent batches, to rebase the holder's acks safely.
        self._sent: OrderedDict[int, tuple[str, float]] = OrderedDict()

    @classmethod
    def from_policy(cls, policy: LeasePolicy) -> HeartbeatTracker:
        """A tracker heartbeating at ``policy.heartbeat_interval``."""
        return cls(policy.heartbeat_interval)

    @property
    def interval(self) -> float:
        """Seconds between two batches to the same engine."""
        return self._interval

    def __len__(self) -> int:
        """The number of tracked (local) requests."""
        return len(self._requests)

    @property
    def engines(self) -> frozenset[str]:
        """Remote engines with at least one tracked request."""
        return frozenset(e for e, st in self._engines.items() if st.ids)

    def tracked(self, request_id: str) -> tuple[str, str] | None:
        """``(engine_id, remote_request_id)`` for a tracked local request, else ``None``."""
        return self._requests.get(request_id)

    @property
    def stopped(self) -> dict[str, int]:
        """How many requests stopped, by :class:`StopReason` value (a copy)."""
        return {r.value: n for r, n in self._stopped.items()}

    @property
    def clock_regressions(self) -> int:
        """Calls whose ``now`` was smaller than an earlier one (clamped)."""
        return self._clock.regressions

    def track(self, request_id: str, engine_id: str, remote_request_id: str, now: float) -> None:
        """Start heartbeating for local request ``request_id``, whose KV lies on
        ``engine_id`` under ``remote_request_id``.

        :raises InvalidTransitionError: ``request_id`` is already tracked (stop it first).
        :raises LeaseError: an id is not a non-empty str, or ``now`` is not finite.
        Nothing changes on error.
        """
        for name, value in (
            ("request_id", request_id),
            ("engine_id", engine_id),
            ("remote_request_id", remote_request_id),
        ):
            if not isinstance(value, str) or not value:
                raise LeaseError(f"{name} must be a non-empty str, got {value!r}")
        check_now(now)
        if request_id in self._requests:
            engine, remote = self._requests[request_id]
            raise InvalidTransitionError(
                f"request {request_id!r} is already tracked (engine {engine!r}, remote id "
                f"{remote!r}); stop() it before tracking it again"
            )
        t = self._clock.advance(now)
        st = self._engines.get(engine_id)
        if st is None:
            st = self._engines[engine_id] = _Engine(t)
        st.ids[remote_request_id] = st.ids.get(remote_request_id, 0) + 1
        self._requests[request_id] = (engine_id, remote_request_id)

    def stop(self, request_id: str, now: float, reason: StopReason) -> bool:
        """Stop heartbeating for ``request_id``; returns whether it was tracked.

        Stopping an untracked request is not an error (transfer end and request end both
        stop it; whichever comes second finds nothing). Raises
        :class:`~kvframe.errors.LeaseError` for a non-finite ``now`` or a ``reason`` that is
        not a :class:`StopReason` (nothing changes then).
        """
        if not isinstance(reason, StopReason):
            raise LeaseError(f"reason must be a StopReason, got {reason!r}")
        self._clock.advance(now)
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return False
        engine_id, remote = entry
        ids = self._engines[engine_id].ids
        if ids[remote] == 1:
            del ids[remote]
        else:
            ids[remote] -= 1
        self._stopped[reason] += 1
        return True

    def due(self, now: float) -> list[HeartbeatBatch]:
        """The batches to send now: one per engine whose time has come and that has tracked
        requests, in engine-id order. Engines whose time has come with nothing tracked are
        dropped. Raises :class:`~kvframe.errors.LeaseError` for a non-finite ``now``."""
        t = self._clock.advance(now)
        out: list[HeartbeatBatch] = []
        dropped: list[str] = []
        for engine_id in sorted(self._engines):
            st = self._engines[engine_id]
            if st.next_due > t:
                continue
            if not st.ids:
                dropped.append(engine_id)
                continue
            out.append(
                HeartbeatBatch(
                    engine_id=engine_id,
                    request_ids=tuple(sorted(st.ids)),
                    seq=self._seq,
                    sent_at=t,
                )
            )
            self._sent[self._seq] = (engine_id, t)
            if len(self._sent) > REMEMBER_BATCHES:
                self._sent.popitem(last=False)
            self._seq = (self._seq + 1) % SEQ_MODULUS
            st.next_due = t + self._interval
        for engine_id in dropped:
            del self._engines[engine_id]
        return out

    def rebase_ack(
        self,
        engine_id: str,
        echo_seq: int,
        holder_now: float,
        expiries: Iterable[tuple[str, float]],
    ) -> dict[str, float] | None:
        """The holder's acknowledgement of batch ``echo_seq`` as deadlines on this side's clock.

        Each expiry is rebased with :func:`~kvframe.core.clock.rebase_deadline` against the
        batch's own send time, a local reading no later than the holder's ``holder_now``, so
        every returned deadline is at or before the true one. Read only under a deadline that
        has not passed.

        :param engine_id: the engine the acknowledgement came from.
        :param echo_seq: the ``seq`` of the batch it answers.
        :param holder_now: the holder's clock when it renewed.
        :param expiries: ``(remote request id, expiry on the holder's clock)`` pairs.
        :returns: remote request id -> local deadline; ``None`` when ``echo_seq`` is not a
            recent batch sent to ``engine_id`` (too old to remember, never sent, or sent to
            another engine): such an ack cannot be rebased safely and must be ignored.
        :raises LeaseError: a time is not finite.
        """
        sent = self._sent.get(echo_seq) if isinstance(echo_seq, int) else None
        if sent is None or sent[0] != engine_id:
            return None
        return {rid: rebase_deadline(exp, holder_now, sent[1]) for rid, exp in expiries}

    def next_deadline(self) -> float | None:
        """When the next batch is due (call :meth:`due` then), or ``None`` when nothing is
        tracked."""
        times = [st.next_due for st in self._engines.values() if st.ids]
        return min(times) if times else None


@attrs.frozen(kw_only=True)
class _Peer:
    mapper: SendTimeMapper
    last_seq: int | None


class HeartbeatGuard:
    """P's side: decide whether a received heartbeat may renew anything, and as of when.

    Per remote engine it remembers the newest sequence number accepted and a
    :class:`~kvframe.core.clock.SendTimeMapper`. :meth:`accept` answers the heartbeat's send
    time on P's clock (pass it as ``sent_at`` to ``LeaseTable.renew``), or ``None`` for a
    heartbeat older than one already accepted (a reordered or replayed message: drop it).
    Equal sequence numbers are accepted: a batch split into several messages shares one.

    :param max_drift: passed to each engine's mapper.
    :raises ConfigError: for a negative or non-finite ``max_drift``.
    """

    def __init__(self, max_drift: float = DEFAULT_MAX_DRIFT) -> None:
        self._max_drift = check_config_seconds("max_drift", max_drift, allow_zero=True)
        self._peers: dict[str, _Peer] = {}
        self.accepted = 0
        """Heartbeats accepted."""
        self.out_of_order = 0
        """Heartbeats dropped because a newer one from the same engine was accepted first."""

    def _peer(self, engine_id: str) -> _Peer:
        peer = self._peers.get(engine_id)
        if peer is None:
            peer = self._peers[engine_id] = _Peer(
                mapper=SendTimeMapper(self._max_drift), last_seq=None
            )
        return peer

    def seed(self, engine_id: str, sample: ClockSample) -> None:
        """Tighten ``engine_id``'s send-time mapping with its handshake round trip (do this
        when the engine connects, before its first heartbeat)."""
        self._peer(engine_id).mapper.observe(sample.remote_ts, sample.t_recv)

    def accept(self, engine_id: str, seq: int, sent_at: float, now: float) -> float | None:
        """A heartbeat from ``engine_id`` with sequence number ``seq``, sent at ``sent_at``
        (the engine's clock), received at ``now`` (P's clock).

        :returns: the send time on P's clock (``<= now``), or ``None`` when the heartbeat is
            older than one already accepted from that engine.
        :raises LeaseError: ``seq`` is not an int in ``[0, 2**32)``, or a time is not
            finite. Nothing is recorded then.
        """
        if isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < SEQ_MODULUS:
            raise LeaseError(f"seq must be an int in [0, 2**32), got {seq!r}")
        check_now(sent_at, "sent_at")
        check_now(now)
        peer = self._peer(engine_id)
        if peer.last_seq is not None and not seq_newer_or_equal(seq, peer.last_seq):
            self.out_of_order += 1
            return None
        self._peers[engine_id] = attrs.evolve(peer, last_seq=seq)
        self.accepted += 1
        return peer.mapper.observe(sent_at, now)

    def map_send_time(self, engine_id: str, sent_at: float, now: float) -> float:
        """The send time of any message from ``engine_id`` on P's clock (``<= now``, never
        earlier than the truth for drift up to ``max_drift``), whatever its sequence number.

        A holder may renew from an out-of-order heartbeat as of this time: the mapping alone
        keeps a stale one from extending anything, so dropping reordered heartbeats outright
        (what :meth:`accept`'s verdict allows) is not needed for safety, and over a transport
        that reorders notifications it would starve the leases only the overtaken one names.

        :raises LeaseError: a time is not finite. Nothing is recorded then.
        """
        check_now(sent_at, "sent_at")
        check_now(now)
        return self._peer(engine_id).mapper.observe(sent_at, now)

    def forget(self, engine_id: str) -> None:
        """Drop everything known about ``engine_id`` (it restarted or was removed). A restarted
        engine starts its sequence numbers again, so forget it before its first heartbeat."""
        self._peers.pop(engine_id, None)
