"""D's side of the P/D lease protocol as one machine: every decision about a remote read.

A decode worker (the *reader*) pulls each request's KV from the prefill worker that holds it
(the *holder*, :mod:`kvframe.core.holder`) under the holder's lease. :class:`LeaseReader` decides
everything about those reads; the worker only carries out the :data:`Action` values it returns
and feeds back what the transport and the network said. Per load::

    waiting_peer --peer ready--> confirming --confirmed--> posted --transfer done--> done
          \\________________________\\___________________\\--> failed | aborted

and, for a reader built with ``optimistic=True`` (see "Optimistic reads" below)::

    confirming --post early--> posted --transfer unconfirmed--> verifying --confirmed--> done

- **Never trust a ticket.** A load is posted only under a lease the holder *confirmed* in an
  acknowledgement of a heartbeat this reader sent: ``sent + (expiry - holder_now)`` (shrunk by
  the allowed clock drift) is a lower bound of the lease's end on the reader's clock whatever
  the delays, and the read must keep ``margin`` seconds of it. The expiry in
  ``kv_transfer_params`` is never taken as confirmation, so a ticket replayed after its lease
  ended (a router retry) gets a loss notice instead of a read of reused blocks.
- **A ticket is single-use.** A lease id already read, released or in use by another load on
  this reader fails the new load at once; the holder binds each lease to the first reader that
  names it, so another decoder with the same ticket is refused there.
- **Keep a read only if it completed in time**: before the confirmed bound. Otherwise the holder
  may have reclaimed and reused the blocks, and the load fails.
- **Every load ends within a bound** (:meth:`LeaseReader.bound`): ``peer_timeout`` waiting for
  the connection, ``confirm_timeout`` waiting for a confirmation, and while posted the earlier
  of the confirmed bound and ``transfer_timeout`` after posting; a read whose connection broke
  under it is read once more on a new connection, within the same overall budget
  (``peer_timeout + confirm_timeout + transfer_timeout`` from :meth:`LeaseReader.add`). At a
  deadline the load fails.
- **Optimistic reads** (``optimistic=True``; READs only, never writes). A load whose lease is
  not yet confirmed posts its READ at once, right *before* the heartbeat that asks for the
  confirmation, and without its lease-done notification (``PostRead.notify_when_done``): the
  notification goes as a message of its own once the READ is seen complete, so it follows the
  heartbeat to the holder, which claims the lease for this reader before the notice consumes
  it. Posted first, the READ does not queue behind the heartbeat (NIXL completes a READ
  inside the post only when no notification went to that peer since the previous READ; after
  one it completes at the holder's next progress point), and the holder's one progress point
  then only has to answer the heartbeat. Its bytes count only under the keep rule above: the
  read completed (was seen complete, on this reader's clock) before a bound confirmed by an
  acknowledgement. The order of the READ and the heartbeat plays no part in it. Why that is
  enough although the READ started before any confirmation:
  the lease was granted before the ticket existed, so before the READ was posted; a lease is
  live from its grant until it ends, and an ended lease id is never live again (ids are
  random and single-use, :meth:`LeaseTable.grant <kvframe.core.lease.LeaseTable.grant>`); an
  acknowledgement proves the lease live until at least its bound. So it was live during the
  whole READ, from the post to the completion, whether the acknowledgement arrived before the
  completion or after it, and its blocks were not freed or reused under the READ. A READ that
  completed before any acknowledgement waits (``verifying``) for one; a loss notice (the
  holder had already ended the lease: a router retry of a consumed ticket, or another
  decoder's claim), a bound not later than the completion, a lost connection's silence past
  ``confirm_timeout``, or ``CONSUMED`` before any acknowledgement all fail the load with its
  blocks invalid, whatever bytes landed. Never for writes: a WRITE into blocks the holder no
  longer leases would corrupt them.
- **Or prove it from the holder's lease table** (:mod:`kvframe.core.slots`). A verifying load
  whose holder keeps a lease table a reader can READ is done as soon as a READ of the lease's
  slot, posted after the completion was seen, finds the lease's tag there
  (:meth:`LeaseReader.lease_seen`): the lease was then still live after the bytes had landed.
  Anything else that READ finds proves nothing and changes nothing: the load waits for the
  acknowledgement as above.
- **Stop before you report.** A failed or aborted posted load emits :class:`StopRead` before
  :class:`LoadEnded`, and the release to the holder after both: nothing lands in blocks the
  engine was told it may reuse, and the holder never frees blocks a read of ours still touches.

Sans-I/O: every call takes ``now`` (the reader's monotonic clock, read by the caller *after* it
observed what it reports) and returns a list of actions to carry out in order;
:meth:`LeaseReader.next_deadline` says when to call :meth:`LeaseReader.tick`. Engine keys are
opaque strings (the remote engine id); the caller maps transport peers to them.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import TypeAlias

import attrs

from kvframe.core import wire
from kvframe.core._checks import check_config_seconds, check_now
from kvframe.core.clock import DEFAULT_MAX_DRIFT, MonotonicClamp
from kvframe.core.heartbeat import SEQ_MODULUS
from kvframe.core.lease import LeasePolicy, lease_handle
from kvframe.core.machine import Step, TransitionTable
from kvframe.core.slots import slot_tag
from kvframe.errors import InvalidTransitionError, LeaseError

__all__ = [
    "READ_TRANSITIONS",
    "Action",
    "LeaseReader",
    "LoadEnded",
    "PostRead",
    "ReadEvent",
    "ReadState",
    "ReaderTimeouts",
    "Reconnect",
    "SendMessage",
    "StopRead",
    "state_diagram",
    "transition_table",
]


class ReadState(enum.Enum):
    """Where one load is."""

    WAITING_PEER = "waiting_peer"
    """The holder's engine has no usable connection yet (handshake under way)."""
    CONFIRMING = "confirming"
    """Connected; waiting for the holder to confirm the lease long enough for a read."""
    POSTED = "posted"
    """The READ is in flight (with ``optimistic``, possibly before any confirmation)."""
    VERIFYING = "verifying"
    """Optimistic reads only: the READ completed before any acknowledgement confirmed the
    lease; its bytes count only if one does, with a bound later than the completion."""
    DONE = "done"
    """The read completed under the confirmed lease: the blocks hold the holder's KV."""
    FAILED = "failed"
    """The load failed; its transfer has stopped; its blocks are invalid."""
    ABORTED = "aborted"
    """The engine aborted the request; its transfer has stopped."""


class ReadEvent(enum.Enum):
    """What can happen to a load."""

    PEER_READY = "peer_ready"
    CONFIRMED = "confirmed"
    CONFIRMED_LATE = "confirmed_late"
    SEEN_LIVE = "seen_live"
    POST_EARLY = "post_early"
    PEER_LOST = "peer_lost"
    LOST = "lost"
    PEER_FAILED = "peer_failed"
    PEER_BROKEN = "peer_broken"
    TRANSFER_DONE = "transfer_done"
    TRANSFER_LATE = "transfer_late"
    TRANSFER_UNCONFIRMED = "transfer_unconfirmed"
    TRANSFER_FAILED = "transfer_failed"
    ABORT = "abort"
    TIMEOUT = "timeout"


_S, _E = ReadState, ReadEvent

#: Every legal step of a load. The reader consults it for each event it applies; the docs draw
#: it. Messages that concern an ended load (a late ack, a duplicate loss notice) are legal races
#: the reader ignores before they reach the table.
READ_TRANSITIONS: TransitionTable[ReadState, ReadEvent] = TransitionTable(
    "load",
    ReadState,
    ReadEvent,
    [
        Step(
            source=_S.WAITING_PEER,
            event=_E.PEER_READY,
            target=_S.CONFIRMING,
            effect="urgent heartbeat unless already confirmed",
        ),
        Step(
            source=_S.WAITING_PEER,
            event=_E.PEER_FAILED,
            target=_S.FAILED,
            effect="handshake failed; release queued",
        ),
        Step(
            source=_S.WAITING_PEER,
            event=_E.LOST,
            target=_S.FAILED,
            effect="the holder has no lease; nothing to stop",
        ),
        Step(source=_S.WAITING_PEER, event=_E.ABORT, target=_S.ABORTED, effect="release queued"),
        Step(
            source=_S.WAITING_PEER,
            event=_E.TIMEOUT,
            target=_S.FAILED,
            effect="no connection within peer_timeout",
        ),
        Step(
            source=_S.CONFIRMING,
            event=_E.CONFIRMED,
            target=_S.POSTED,
            effect="post the READ with its lease-done notification",
        ),
        Step(
            source=_S.CONFIRMING,
            event=_E.POST_EARLY,
            target=_S.POSTED,
            effect="optimistic: post the READ right before the confirming heartbeat",
        ),
        Step(
            source=_S.CONFIRMING,
            event=_E.PEER_LOST,
            target=_S.WAITING_PEER,
            effect="wait for the new connection",
        ),
        Step(
            source=_S.CONFIRMING, event=_E.PEER_FAILED, target=_S.FAILED, effect="connection failed"
        ),
        Step(
            source=_S.CONFIRMING, event=_E.LOST, target=_S.FAILED, effect="the holder has no lease"
        ),
        Step(source=_S.CONFIRMING, event=_E.ABORT, target=_S.ABORTED, effect="release sent"),
        Step(
            source=_S.CONFIRMING,
            event=_E.TIMEOUT,
            target=_S.FAILED,
            effect="no confirmation within confirm_timeout",
        ),
        Step(
            source=_S.POSTED,
            event=_E.TRANSFER_DONE,
            target=_S.DONE,
            effect="completed before the confirmed bound: blocks valid",
        ),
        Step(
            source=_S.POSTED,
            event=_E.TRANSFER_LATE,
            target=_S.FAILED,
            effect="completed after the confirmed bound: blocks invalid",
        ),
        Step(
            source=_S.POSTED,
            event=_E.TRANSFER_UNCONFIRMED,
            target=_S.VERIFYING,
            effect="optimistic read completed before any acknowledgement: wait for one",
        ),
        Step(
            source=_S.POSTED,
            event=_E.TRANSFER_FAILED,
            target=_S.FAILED,
            effect="the transport stopped it; release sent",
        ),
        Step(source=_S.POSTED, event=_E.LOST, target=_S.FAILED, effect="stop the read, then fail"),
        Step(
            source=_S.POSTED,
            event=_E.PEER_FAILED,
            target=_S.FAILED,
            effect="stop the read, then fail",
        ),
        Step(
            source=_S.POSTED,
            event=_E.PEER_BROKEN,
            target=_S.WAITING_PEER,
            effect="the connection died under the read: read again once on a new one",
        ),
        Step(
            source=_S.POSTED,
            event=_E.ABORT,
            target=_S.ABORTED,
            effect="stop the read, then release",
        ),
        Step(
            source=_S.POSTED,
            event=_E.TIMEOUT,
            target=_S.FAILED,
            effect="stop the read at min(bound, transfer_timeout)",
        ),
        Step(
            source=_S.VERIFYING,
            event=_E.CONFIRMED,
            target=_S.DONE,
            effect="the confirmed bound is later than the completion: blocks valid",
        ),
        Step(
            source=_S.VERIFYING,
            event=_E.SEEN_LIVE,
            target=_S.DONE,
            effect="a READ of the holder's lease table, posted after the completion, found the "
            "lease's tag: blocks valid",
        ),
        Step(
            source=_S.VERIFYING,
            event=_E.CONFIRMED_LATE,
            target=_S.FAILED,
            effect="the confirmed bound is not later than the completion: blocks invalid",
        ),
        Step(
            source=_S.VERIFYING,
            event=_E.LOST,
            target=_S.FAILED,
            effect="the holder had no lease for us (a replayed ticket): blocks invalid",
        ),
        Step(
            source=_S.VERIFYING,
            event=_E.PEER_FAILED,
            target=_S.FAILED,
            effect="no connection for the confirmation: blocks invalid",
        ),
        Step(source=_S.VERIFYING, event=_E.ABORT, target=_S.ABORTED, effect="nothing to stop"),
        Step(
            source=_S.VERIFYING,
            event=_E.TIMEOUT,
            target=_S.FAILED,
            effect="no acknowledgement within confirm_timeout: blocks invalid",
        ),
    ],
    terminal=(_S.DONE, _S.FAILED, _S.ABORTED),
)
del _S, _E

_ENDED = READ_TRANSITIONS.terminal


# -- actions -----------------------------------------------------------------------------------
@attrs.frozen(kw_only=True)
class SendMessage:
    """Send ``message`` to the holder engine ``engine`` (a heartbeat or a release)."""

    engine: str
    message: wire.Message


@attrs.frozen(kw_only=True)
class PostRead:
    """Post the READ of load ``request_id`` from ``engine``, with ``notification`` (encode it)
    delivered to the holder when the data has landed. If posting raises, report it with
    :meth:`LeaseReader.transfer_failed` at once.

    ``notify_when_done`` (optimistic reads, posted before the heartbeat that asks to confirm
    their lease): post the READ *without* the notification and send ``notification`` to
    ``engine`` yourself once the transfer is seen DONE, before reporting it with
    :meth:`LeaseReader.transfer_done`; never if it failed or was stopped. The messages that
    follow this action in the same list then reach the holder before it does."""

    request_id: str
    engine: str
    notification: wire.LeaseDone
    notify_when_done: bool = False


@attrs.frozen(kw_only=True)
class StopRead:
    """Stop load ``request_id``'s transfer now (``Transport.release``); when this returns no
    byte of it may land any more."""

    request_id: str


@attrs.frozen(kw_only=True)
class LoadEnded:
    """Load ``request_id`` ended (``DONE``, ``FAILED`` or ``ABORTED``): report it to the engine
    (``finished_recving``; for ``FAILED`` its blocks as invalid and ``reason``). Exactly once
    per load; after :class:`StopRead` when it was posted."""

    request_id: str
    engine: str
    state: ReadState
    reason: str | None = None


@attrs.frozen(kw_only=True)
class Reconnect:
    """The holder engine ``engine`` was replaced (a load names incarnation ``incarnation``,
    the connection is to another): drop the connection and handshake again, then report
    :meth:`LeaseReader.peer_lost` and :meth:`LeaseReader.peer_ready`."""

    engine: str
    incarnation: str


Action: TypeAlias = SendMessage | PostRead | StopRead | LoadEnded | Reconnect
"""Anything :class:`LeaseReader` asks its caller to do."""


@attrs.frozen(kw_only=True)
class ReaderTimeouts:
    """How long a load may stay in each waiting state, seconds (see :meth:`LeaseReader.bound`).

    Build it with :meth:`from_policy`; every field must be finite and > 0.
    """

    margin: float
    """Confirmed lease a read needs left when it is posted."""
    peer_timeout: float
    """Waiting for a usable connection to the holder."""
    confirm_timeout: float
    """Waiting for the holder's confirmation (a live holder answers within milliseconds)."""
    transfer_timeout: float
    """A posted read, at most (it also ends at the confirmed bound, if that is earlier)."""
    resend_after: float
    """An unanswered confirmation heartbeat is sent again after this long."""

    def __attrs_post_init__(self) -> None:
        for f in attrs.fields(ReaderTimeouts):
            check_config_seconds(f"ReaderTimeouts.{f.name}", getattr(self, f.name))

    @classmethod
    def from_policy(
        cls,
        policy: LeasePolicy,
        *,
        peer_timeout: float,
        margin: float | None = None,
    ) -> ReaderTimeouts:
        """Defaults from the lease timing: margin ``extension / 4``, confirmation and transfer
        timeouts one ``extension`` each, resend every ``heartbeat_interval``."""
        return cls(
            margin=policy.extension / 4 if margin is None else margin,
            peer_timeout=peer_timeout,
            confirm_timeout=policy.extension,
            transfer_timeout=policy.extension,
            resend_after=min(policy.heartbeat_interval, policy.extension / 4),
        )


# -- internal records --------------------------------------------------------------------------
class _Peer:
    __slots__ = ("incarnation", "pending_heartbeat", "pending_release", "ready")

    def __init__(self) -> None:
        self.ready = False
        self.incarnation: str | None = None
        self.pending_release: dict[str, None] = {}  # ordered set of lease ids
        self.pending_heartbeat: dict[str, None] = {}


class _Ticket:
    """What this reader knows of one remote lease."""

    __slots__ = (
        "bound",
        "cap",
        "handle",
        "heartbeat_at",
        "lost",
        "lost_at",
        "spent",
        "touched",
        "urgent_at",
        "user",
    )

    def __init__(self, handle: int) -> None:
        self.handle = handle
        """The lease's wire handle (:func:`~kvframe.core.lease.lease_handle` of its id)."""
        self.touched = -math.inf
        """When it was last named (heartbeat, load, release): an answer may still come."""
        self.bound = -math.inf
        """Confirmed lower bound of the lease's end, reader's clock."""
        self.cap = math.inf
        """No bound is ever later than this (``not_after`` of :meth:`LeaseReader.add`)."""
        self.lost: wire.LostReason | None = None
        self.lost_at = 0.0
        self.spent = False
        """Read, released or failed: never to be used again."""
        self.user: str | None = None
        """The local load using it."""
        self.urgent_at = -math.inf
        self.heartbeat_at = -math.inf
        """When a heartbeat last named it (the reader's clock of that progress point)."""


@attrs.define(eq=False)
class _Load:
    request_id: str
    engine: str
    lease_id: str
    incarnation: str | None
    state: ReadState
    since: float
    """When it entered its current state."""
    deadline: float
    hard: float
    """The overall deadline (add time + the reader's bound): no state's deadline is later."""
    posted_at: float = 0.0
    bound: float = -math.inf
    """While posted: the confirmed bound the read must complete before."""
    retried: bool = False
    early: bool = False
    """Posted optimistically, and no acknowledgement has come since (the bound, if any, is
    an older confirmation's)."""
    done_at: float = math.inf
    """Verifying: when the READ was seen complete (reader's clock)."""
    done_now: float = math.inf
    """Verifying: the caller's own ``now`` of that report, before this reader's clamp (what a
    lease-table READ's post time is compared with)."""
    may_post_early: bool = False
    """Optimistic reads allowed for this load."""

    def wait(self, t: float, seconds: float) -> None:
        self.deadline = min(t + seconds, self.hard)


class LeaseReader:
    """D's reads under P's leases (one per decode worker rank; see the module docs).

    :param policy: the lease timing (heartbeat interval, extension).
    :param timeouts: the waiting bounds.
    :param max_drift: the clock-rate difference allowed between reader and holder: confirmed
        intervals are shrunk by this fraction.
    :param remember: tickets remembered at most (oldest unused ones forgotten first).
    :param release_after_loss: also release a lease the holder reported lost when the load
        ends (push mode: a holder that revoked its lease waits for the writer to say it
        stopped, and frees the blocks at once when it does).
    :param optimistic: post a load's READ in the same call as the heartbeat that asks for its
        confirmation instead of after the acknowledgement, and keep its bytes only once an
        acknowledgement confirms a bound later than its completion (see "Optimistic reads" in
        the module docs). Only for reads: a writer must leave it off.
    """

    def __init__(
        self,
        policy: LeasePolicy,
        timeouts: ReaderTimeouts,
        *,
        max_drift: float = DEFAULT_MAX_DRIFT,
        remember: int = 65_536,
        release_after_loss: bool = False,
        optimistic: bool = False,
    ) -> None:
        self._release_lost = release_after_loss
        self._optimistic = bool(optimistic)
        self._early: list[_Load] = []  # posted optimistically; PostRead before the heartbeat
        self._policy = policy
        self._t = timeouts
        self._drift = check_config_seconds("max_drift", max_drift, allow_zero=True)
        self._remember = remember
        self._clock = MonotonicClamp()
        self._loads: dict[str, _Load] = {}
        self._tickets: OrderedDict[tuple[str, str], _Ticket] = OrderedDict()
        self._by_handle: dict[tuple[str, int], str] = {}  # (engine, handle) -> lease id
        self._peers: dict[str, _Peer] = {}
        self._seq = 0
        self._sent: OrderedDict[int, tuple[str, float]] = OrderedDict()  # seq -> (engine, at)
        self._urgent: dict[str, dict[str, None]] = {}
        self._next_sweep = -math.inf
        self._counts: dict[str, int] = {}

    # -- inspection ----------------------------------------------------------------------
    def __len__(self) -> int:
        """Loads not ended."""
        return len(self._loads)

    def state(self, request_id: str) -> ReadState | None:
        """The state of a load that has not ended, else ``None``."""
        load = self._loads.get(request_id)
        return load.state if load is not None else None

    def loads(self, state: ReadState | None = None) -> list[str]:
        """Request ids of the loads not ended (in ``state``, when given)."""
        return [r for r, ld in self._loads.items() if state is None or ld.state is state]

    def engine_busy(self, engine: str) -> bool:
        """Whether any load not ended reads from ``engine``."""
        return any(ld.engine == engine for ld in self._loads.values())

    def confirmed_bound(self, engine: str, lease_id: str) -> float:
        """The confirmed lower bound of a lease's end on this reader's clock (``-inf`` when
        unconfirmed or forgotten)."""
        ticket = self._tickets.get((engine, lease_id))
        return ticket.bound if ticket is not None else -math.inf

    def bound(self) -> float:
        """The longest a load can take from :meth:`add` to its end, seconds, whatever the
        holder and the network do: every state's deadline is capped by the load's overall
        deadline, ``add`` time + ``peer_timeout + confirm_timeout + transfer_timeout``."""
        t = self._t
        return t.peer_timeout + t.confirm_timeout + t.transfer_timeout

    def next_deadline(self) -> float | None:
        """The earliest deadline of any load or resend (call :meth:`tick` then), or ``None``."""
        times = [ld.deadline for ld in self._loads.values()]
        for ld in self._loads.values():
            if ld.state is ReadState.CONFIRMING or ld.early:
                ticket = self._tickets.get((ld.engine, ld.lease_id))
                if ticket is not None:
                    times.append(ticket.urgent_at + self._t.resend_after)
        return min(times) if times else None

    def take_counts(self) -> dict[str, int]:
        """Counts since the last call (``acks``, ``acks_unmatched``, ``urgent_heartbeats``,
        ``duplicate_tickets``, ``releases_dropped``, ``heartbeats_deferred``, ...)."""
        out, self._counts = self._counts, {}
        return out

    def _count(self, name: str, n: int = 1) -> None:
        self._counts[name] = self._counts.get(name, 0) + n

    # -- inputs: loads -------------------------------------------------------------------
    def add(
        self,
        request_id: str,
        engine: str,
        lease_id: str,
        now: float,
        *,
        incarnation: str | None = None,
        not_after: float | None = None,
        optimistic: bool | None = None,
    ) -> list[Action]:
        """A load to carry out: read ``lease_id`` from ``engine`` into the request's blocks.

        ``optimistic`` overrides the reader's setting for this load (``False``: post only
        once confirmed; ``True`` only where reading before confirmation is harmless).

        ``incarnation`` names the holder instance that granted the lease (from the ticket);
        a connection to another instance is replaced first (:class:`Reconnect`).

        ``not_after`` (this reader's clock) caps every bound the holder confirms: the read is
        posted only with ``margin`` left before it, a read completing after it is discarded
        (``TRANSFER_LATE``), and a load still waiting ``margin`` before it times out. A
        prefill engine pulling a decoder's kept blocks passes the decoder's expiry mapped
        through the clock-offset estimate (:meth:`DecoderBlocksTTL.reader_deadline
        <kvframe.core.clock.DecoderBlocksTTL.reader_deadline>`). A load whose cap is already
        that close fails at once (``TIMEOUT``, and the lease is released).

        :raises InvalidTransitionError: ``request_id`` has a load that has not ended.
        :raises LeaseError: an id is empty or ``now`` is not finite. Nothing changes on error.
        """
        for name, value in (("request_id", request_id), ("engine", engine), ("lease_id", lease_id)):
            if not isinstance(value, str) or not value:
                raise LeaseError(f"{name} must be a non-empty str, got {value!r}")
        check_now(now)
        cap = math.inf if not_after is None else check_now(not_after, "not_after")
        if request_id in self._loads:
            raise InvalidTransitionError(
                f"load {request_id!r} is already {self._loads[request_id].state.value}; it "
                "must end before the request id is loaded again"
            )
        t = self._advance(now)
        out: list[Action] = []
        ticket = self._ticket(engine, lease_id)
        load = _Load(
            request_id=request_id,
            engine=engine,
            lease_id=lease_id,
            incarnation=incarnation,
            state=ReadState.WAITING_PEER,
            since=t,
            deadline=t + self._t.peer_timeout,
            hard=t + self.bound(),
            may_post_early=self._optimistic if optimistic is None else bool(optimistic),
        )
        if ticket.user is not None or ticket.spent:
            self._count("duplicate_tickets")
            why = (
                f"load {ticket.user!r} is reading it now"
                if ticket.user is not None
                else "it was already read or released here"
            )
            out.append(
                LoadEnded(
                    request_id=request_id,
                    engine=engine,
                    state=ReadState.FAILED,
                    reason=f"ticket {lease_id!r} refused: {why} (a ticket is single-use)",
                )
            )
            return out
        ticket.user = request_id
        self._loads[request_id] = load
        if ticket.lost is not None:
            self._end(load, ReadEvent.LOST, t, out, reason=_lost_text(ticket.lost))
            return out
        if cap < math.inf and not self._cap(load, ticket, cap, t, out):
            return out
        peer = self._peers.get(engine)
        if peer is not None and peer.ready:
            if incarnation is not None and peer.incarnation not in (None, incarnation):
                out.append(Reconnect(engine=engine, incarnation=incarnation))
            else:
                self._enter_confirming(load, t, out)
        self._flush(t, out)
        return out

    def cap(self, request_id: str, not_after: float, now: float) -> list[Action]:
        """Cap load ``request_id``'s bounds at ``not_after`` (as ``add``'s ``not_after``), for
        a cap known only once the peer's clock offset is: call it before :meth:`peer_ready`.
        A cap only ever lowers. Unknown or ended loads: a no-op.

        :raises LeaseError: ``not_after`` or ``now`` is not finite.
        """
        cap = check_now(not_after, "not_after")
        t = self._advance(now)
        out: list[Action] = []
        load = self._loads.get(request_id)
        if load is not None:
            self._cap(load, self._tickets[(load.engine, load.lease_id)], cap, t, out)
        return out

    def _cap(self, load: _Load, ticket: _Ticket, cap: float, t: float, out: list[Action]) -> bool:
        # Lower the ticket's cap; end the load at once when a read can no longer fit.
        ticket.cap = min(ticket.cap, cap)
        ticket.bound = min(ticket.bound, ticket.cap)
        load.hard = min(load.hard, ticket.cap - self._t.margin)
        load.deadline = min(load.deadline, load.hard)
        if load.state is ReadState.POSTED or load.state is ReadState.VERIFYING:
            load.bound = min(load.bound, ticket.cap)
            return True
        if load.hard > t:
            return True
        self._count("loads_past_cap")
        self._end(
            load,
            ReadEvent.TIMEOUT,
            t,
            out,
            reason=f"the blocks are kept only until {ticket.cap:.3f} on this clock (their "
            f"holder's expiry, corrected for clock offset), and a read needs "
            f"{self._t.margin:g} s of it; recompute instead",
        )
        return False

    def abort(self, request_id: str, now: float) -> list[Action]:
        """The engine aborted the request. A load that already ended (or never existed) is a
        no-op: its end was or will be reported once."""
        t = self._advance(now)
        out: list[Action] = []
        load = self._loads.get(request_id)
        if load is not None:
            self._end(load, ReadEvent.ABORT, t, out, reason="aborted by the engine")
        return out

    def transfer_done(self, request_id: str, now: float) -> list[Action]:
        """The transport reports load ``request_id``'s READ complete. ``now`` must be read
        after the transport said so (a later reading only makes the check stricter).

        :raises InvalidTransitionError: the load is not posted.
        """
        check_now(now)
        load = self._posted(request_id, ReadEvent.TRANSFER_DONE)
        t = self._advance(now)
        out: list[Action] = []
        if t < load.bound:
            self._end(load, ReadEvent.TRANSFER_DONE, t, out)
        elif load.early:
            # Optimistic, and no acknowledgement since the post: the bytes wait for one.
            self._fire(load, ReadEvent.TRANSFER_UNCONFIRMED, t)
            load.done_at = t
            load.done_now = now
            self._count("reads_verifying")
        else:
            self._end(
                load,
                ReadEvent.TRANSFER_LATE,
                t,
                out,
                reason="the read completed after the confirmed lease bound; the prefill engine "
                "may have reused the blocks",
            )
        return out

    def lease_seen(self, request_id: str, tag: int, checked_at: float, now: float) -> list[Action]:
        """A READ of the holder's lease table, posted at ``checked_at`` (this reader's clock,
        read after the transport reported load ``request_id``'s READ complete), found ``tag``
        in the slot of the load's lease (:mod:`kvframe.core.slots`). When the load is
        verifying, ``checked_at`` is not before the ``now`` its :meth:`transfer_done` was
        given (the same reading will do: the check READ is posted after it), the lease is not
        reported lost and ``tag`` is the lease's :func:`~kvframe.core.slots.slot_tag`, the load
        is done (``SEEN_LIVE``; counted as ``reads_proven_by_table``). Otherwise nothing
        changes (``lease_checks_unproven``): the load still waits for the holder's
        acknowledgement. A load that ended or is not verifying (an acknowledgement came
        first): a no-op (``lease_checks_unused``).
        ``now`` is this reader's clock, not earlier than ``checked_at``; it decides nothing
        here (the READ's place after the completion does).

        :raises LeaseError: ``checked_at`` or ``now`` is not finite.
        """
        check_now(checked_at, "checked_at")
        check_now(now)
        t = self._advance(now)
        out: list[Action] = []
        load = self._loads.get(request_id)
        if load is None or load.state is not ReadState.VERIFYING:
            self._count("lease_checks_unused")
            return out
        ticket = self._tickets[(load.engine, load.lease_id)]
        if (
            ticket.lost is None
            and load.done_now <= checked_at
            and load.done_at < ticket.cap
            and tag == slot_tag(ticket.handle)
        ):
            self._count("reads_proven_by_table")
            self._end(load, ReadEvent.SEEN_LIVE, t, out)
        else:
            self._count("lease_checks_unproven")
        return out

    def transfer_failed(
        self, request_id: str, reason: str, now: float, *, peer_broken: bool = False
    ) -> list[Action]:
        """The transport failed load ``request_id``'s READ (posting raised, or ``poll`` said
        failed); the transfer has stopped. ``peer_broken``: the connection itself is dead (the
        caller handshakes again and reports :meth:`peer_ready` or :meth:`peer_failed`): the
        load is read once more on the new connection (a restarted holder that kept nothing
        answers with a loss notice), and the engine counts as disconnected.

        :raises InvalidTransitionError: the load is not posted.
        """
        check_now(now)
        load = self._posted(request_id, ReadEvent.TRANSFER_FAILED)
        t = self._advance(now)
        out: list[Action] = []
        if peer_broken and not load.retried:
            self._fire(load, ReadEvent.PEER_BROKEN, t)
            load.retried = True
            load.early = False
            load.wait(t, self._t.peer_timeout)
            out.append(StopRead(request_id=request_id))
            self._count("reads_retried")
        else:
            self._end(load, ReadEvent.TRANSFER_FAILED, t, out, reason=f"transfer failed: {reason}")
        if peer_broken:
            self._peer_down(load.engine, t, out, f"connection broken: {reason}", failed=False)
        return out

    # -- inputs: peers -------------------------------------------------------------------
    def peer_ready(
        self, engine: str, now: float, *, incarnation: str | None = None
    ) -> list[Action]:
        """A usable connection to ``engine`` (instance ``incarnation``) exists now."""
        t = self._advance(now)
        out: list[Action] = []
        peer = self._peers.setdefault(engine, _Peer())
        if peer.ready and incarnation != peer.incarnation:
            # Another instance behind the same name: nothing confirmed by the old one counts.
            self._peer_down(engine, t, out, "replaced", failed=False)
        peer.ready = True
        peer.incarnation = incarnation
        pending = list(peer.pending_release)
        peer.pending_release.clear()
        if pending:
            self._send_release(engine, pending, t, out)
        waiting = [lid for lid in peer.pending_heartbeat if lid not in pending]
        peer.pending_heartbeat.clear()
        if waiting:
            self._urgent.setdefault(engine, {}).update(dict.fromkeys(waiting))
        for load in list(self._loads.values()):
            if load.engine != engine or load.state is not ReadState.WAITING_PEER:
                continue
            if incarnation is not None and load.incarnation not in (None, incarnation):
                self._end(
                    load,
                    ReadEvent.PEER_FAILED,
                    t,
                    out,
                    reason=f"prefill engine {engine!r} restarted (now {incarnation!r}, the KV "
                    f"was on {load.incarnation!r}); its KV is gone",
                )
                continue
            self._enter_confirming(load, t, out)
        self._flush(t, out)
        return out

    def peer_lost(self, engine: str, now: float) -> list[Action]:
        """The connection to ``engine`` is gone and a new handshake is under way (a replaced
        holder, or one the transport declared dead). Loads waiting for confirmation wait for
        the new connection; posted loads are ended by their transfers' results."""
        t = self._advance(now)
        out: list[Action] = []
        self._peer_down(engine, t, out, "connection lost", failed=False)
        return out

    def peer_failed(self, engine: str, reason: str, now: float) -> list[Action]:
        """No connection to ``engine`` could be made (the handshake failed or timed out):
        every load from it fails; queued releases are dropped (the leases expire there)."""
        t = self._advance(now)
        out: list[Action] = []
        self._peer_down(engine, t, out, reason, failed=True)
        return out

    # -- inputs: messages ----------------------------------------------------------------
    def heartbeat(self, engine: str, lease_ids: Iterable[str], now: float) -> list[Action]:
        """The scheduler wants these leases heartbeated now (its schedule, or new requests to
        confirm early). Sent at once when ``engine`` is connected; otherwise kept (at most
        ``remember`` ids) and sent in one heartbeat as soon as it is."""
        t = self._advance(now)
        ids = list(dict.fromkeys(lease_ids))
        out: list[Action] = []
        if not ids:
            return out
        for lid in ids:
            self._ticket(engine, lid)
        peer = self._peers.get(engine)
        if peer is None or not peer.ready:
            if peer is None:
                peer = self._peers[engine] = _Peer()
            self._count("heartbeats_deferred")
            peer.pending_heartbeat.update(dict.fromkeys(ids))
            while len(peer.pending_heartbeat) > self._remember:
                del peer.pending_heartbeat[next(iter(peer.pending_heartbeat))]
            return out
        self._emit_heartbeat(engine, ids, t, out)
        return out

    def release(self, engine: str, lease_ids: Iterable[str], now: float) -> list[Action]:
        """Tell ``engine`` these leases are no longer needed (the request ended before a load,
        or its KV was found locally). Queued until connected; the tickets are spent."""
        t = self._advance(now)
        out: list[Action] = []
        free: list[str] = []
        for lid in dict.fromkeys(lease_ids):
            ticket = self._ticket(engine, lid)
            ticket.spent = True
            if ticket.user is None:
                free.append(lid)
            # else: a load reads it (the same ticket reached this reader twice): that load
            # ends the lease itself; releasing it now would free the blocks under the read.
        self._send_release(engine, free, t, out)
        return out

    def spend(self, engine: str, lease_ids: Iterable[str], now: float) -> None:
        """Never use these leases of ``engine`` again, and tell the holder nothing: a load
        that names one later fails at once as a used ticket, whatever bound was confirmed
        (push mode: P refused the registration, and D freed the blocks on the refusal)."""
        self._advance(now)
        for lid in dict.fromkeys(lease_ids):
            ticket = self._ticket(engine, lid)
            ticket.spent = True
            ticket.bound = -math.inf

    def receive(self, engine: str, message: wire.Message, now: float) -> list[Action]:
        """A decoded notification from ``engine``: acknowledgements raise confirmed bounds
        (only for heartbeats this reader sent to that engine), loss notices end the loads that
        use those leases. Other message types are ignored."""
        t = self._advance(now)
        out: list[Action] = []
        if isinstance(message, wire.LeaseAck):
            self._on_ack(engine, message, t, out)
        elif isinstance(message, wire.LeaseLost):
            self._on_lost(engine, message, t, out)
        self._flush(t, out)
        return out

    def tick(self, now: float) -> list[Action]:
        """Fire every deadline that has passed: loads time out, unanswered confirmations are
        sent again; forget tickets that can no longer matter."""
        t = self._advance(now)
        out: list[Action] = []
        for load in list(self._loads.values()):
            if load.deadline <= t:
                reason = {
                    ReadState.WAITING_PEER: "no connection to the prefill engine within "
                    f"{self._t.peer_timeout:g} s",
                    ReadState.CONFIRMING: "the prefill engine did not confirm the lease within "
                    f"{self._t.confirm_timeout:g} s"
                    if load.hard > t
                    else "the lease was not confirmed before the kept blocks' corrected "
                    "expiry (not_after) less the read margin",
                    ReadState.POSTED: "the read did not complete before the confirmed lease "
                    "bound or the transfer timeout"
                    if not load.early
                    else "the prefill engine did not confirm the lease within "
                    f"{self._t.confirm_timeout:g} s (the read was posted before its "
                    "confirmation)",
                    ReadState.VERIFYING: "the read completed, but the prefill engine did not "
                    f"confirm the lease within {self._t.confirm_timeout:g} s, so its bytes "
                    "cannot be trusted",
                }.get(load.state, "timed out")
                self._end(load, ReadEvent.TIMEOUT, t, out, reason=reason)
            elif load.state is ReadState.CONFIRMING or load.early:
                ticket = self._tickets[(load.engine, load.lease_id)]
                if t >= ticket.urgent_at + self._t.resend_after:
                    self._urgent_heartbeat(load, ticket, t)
        self._flush(t, out)
        self._forget(t)
        return out

    # -- internals -----------------------------------------------------------------------
    def _advance(self, now: float) -> float:
        return self._clock.advance(check_now(now))

    def _ticket(self, engine: str, lease_id: str) -> _Ticket:
        key = (engine, lease_id)
        ticket = self._tickets.get(key)
        if ticket is None:
            ticket = self._tickets[key] = _Ticket(lease_handle(lease_id))
            # A second lease id with the same handle (a 2**-64 chance) takes the mapping: the
            # first one's answers then go unmatched, and its load times out, never misreads.
            self._by_handle[(engine, ticket.handle)] = lease_id
        else:
            self._tickets.move_to_end(key)
        latest = self._clock.latest
        ticket.touched = latest if latest is not None else -math.inf
        return ticket

    def _forget(self, t: float) -> None:
        # Up to ``remember`` tickets stay (spent ones for good): sweep them by time at most
        # once per ``resend_after``, not on every tick (a tick runs in every progress point).
        if t < self._next_sweep:
            return
        self._next_sweep = t + self._t.resend_after
        # A ticket matters while a load uses it, while an answer to its last heartbeat may
        # still come, while its bound lies ahead, once spent, and for one extension after a
        # loss notice. Beyond that, a load naming it again asks the holder, which answers with
        # a loss notice.
        keep = self._policy.extension
        wait = self._t.confirm_timeout
        # A spent ticket is never forgotten by time (only under the ``remember`` cap): a
        # release of its first use may still be on its way to the holder, and a replay read
        # on a fresh confirmation would then have its blocks freed under it.
        stale = [
            key
            for key, tk in self._tickets.items()
            if tk.user is None
            and not tk.spent
            and tk.bound < t
            and t - tk.touched > wait
            and (tk.lost is None or t - tk.lost_at > keep)
        ]
        for key in stale:
            self._drop_ticket(key)
        while len(self._tickets) > self._remember:
            key, tk = next(iter(self._tickets.items()))
            if tk.user is not None:
                self._tickets.move_to_end(key)
                break
            self._drop_ticket(key)

    def _drop_ticket(self, key: tuple[str, str]) -> None:
        ticket = self._tickets.pop(key)
        hkey = (key[0], ticket.handle)
        if self._by_handle.get(hkey) == key[1]:
            del self._by_handle[hkey]

    def _handles(self, engine: str, lease_ids: list[str]) -> list[int]:
        tickets = self._tickets
        out = []
        for lid in lease_ids:
            ticket = tickets.get((engine, lid))
            out.append(ticket.handle if ticket is not None else lease_handle(lid))
        return out

    def _fire(self, load: _Load, event: ReadEvent, t: float) -> None:
        load.state = READ_TRANSITIONS.next(load.state, event, load.request_id)
        load.since = t

    def _posted(self, request_id: str, event: ReadEvent) -> _Load:
        load = self._loads.get(request_id)
        if load is None or load.state is not ReadState.POSTED:
            where = load.state.value if load is not None else "ended or unknown"
            raise InvalidTransitionError(
                f"load {request_id!r}: {event.value} is illegal in state {where!r}; only a "
                "posted load has a transfer to report"
            )
        return load

    def _enter_confirming(self, load: _Load, t: float, out: list[Action]) -> None:
        self._fire(load, ReadEvent.PEER_READY, t)
        load.wait(t, self._t.confirm_timeout)
        ticket = self._tickets[(load.engine, load.lease_id)]
        if not self._try_post(load, ticket, t, out):
            self._urgent_heartbeat(load, ticket, t)
            if load.may_post_early:
                self._post_early(load, ticket, t)

    def _try_post(self, load: _Load, ticket: _Ticket, t: float, out: list[Action]) -> bool:
        if ticket.bound - t < self._t.margin:
            return False
        self._fire(load, ReadEvent.CONFIRMED, t)
        load.posted_at = t
        load.bound = ticket.bound
        load.deadline = min(ticket.bound, t + self._t.transfer_timeout, load.hard)
        out.append(self._post_read(load, ticket, t))
        return True

    def _post_early(self, load: _Load, ticket: _Ticket, t: float) -> None:
        # Optimistic: the READ goes now, in the same call as the heartbeat asking for the
        # confirmation, and before it (``_flush`` emits the READs first, so that no
        # notification to the holder is pending when the READ is posted); its done notice goes
        # only once the READ is seen complete (``notify_when_done``), after the heartbeat, so
        # the holder claims the lease for this reader before the notice consumes it. Its
        # bytes count only under a bound an acknowledgement confirms later than their
        # completion (module docs, "Optimistic reads"); until one comes, the load waits at
        # most ``confirm_timeout`` (already its deadline) and the heartbeat is resent.
        self._fire(load, ReadEvent.POST_EARLY, t)
        load.posted_at = t
        load.early = True
        load.bound = ticket.bound  # an older confirmation's, if any: still a valid bound
        load.deadline = min(load.deadline, t + self._t.transfer_timeout)
        self._early.append(load)
        self._count("reads_posted_early")

    def _post_read(
        self, load: _Load, ticket: _Ticket, t: float, *, notify_when_done: bool = False
    ) -> PostRead:
        seq = self._next_seq(load.engine, t)
        return PostRead(
            request_id=load.request_id,
            engine=load.engine,
            notification=wire.LeaseDone(
                seq=seq, sent_at=t, reason=wire.DoneReason.READ, handles=(ticket.handle,)
            ),
            notify_when_done=notify_when_done,
        )

    def _urgent_heartbeat(self, load: _Load, ticket: _Ticket, t: float) -> None:
        ticket.urgent_at = t
        self._urgent.setdefault(load.engine, {})[load.lease_id] = None
        self._count("urgent_heartbeats")

    def _flush(self, t: float, out: list[Action]) -> None:
        if self._early:
            # Optimistic READs before the heartbeats that ask for their confirmation (a READ
            # posted behind a notification waits for the holder's next progress point), their
            # done notices sent by the worker once each READ is seen complete: after the
            # heartbeats, so the holder claims each lease before the notice consumes it.
            early, self._early = self._early, []
            for load in early:
                if self._loads.get(load.request_id) is load and load.state is ReadState.POSTED:
                    ticket = self._tickets[(load.engine, load.lease_id)]
                    out.append(self._post_read(load, ticket, t, notify_when_done=True))
        urgent, self._urgent = self._urgent, {}
        for engine, ids in urgent.items():
            peer = self._peers.get(engine)
            if peer is not None and peer.ready:
                self._emit_heartbeat(engine, list(ids), t, out)

    def _emit_heartbeat(self, engine: str, ids: list[str], t: float, out: list[Action]) -> None:
        # At most one heartbeat per lease per progress point: a new load's own (urgent) one
        # and the scheduler's batch naming the same lease come in one engine step, and a
        # second one sent at the same ``t`` can confirm no later bound than the first.
        # One pass: each id's ticket is looked up once, for the check and for its handle.
        tickets = self._tickets
        handles: list[int] = []
        merged = 0
        for lid in ids:
            ticket = tickets.get((engine, lid))
            if ticket is None:
                handles.append(lease_handle(lid))
            elif ticket.heartbeat_at == t:
                merged += 1
            else:
                ticket.heartbeat_at = t
                handles.append(ticket.handle)
        if merged:
            self._count("heartbeats_merged", merged)
        if not handles:
            return
        seq = self._next_seq(engine, t)
        for chunk in _chunks(handles):
            out.append(
                SendMessage(
                    engine=engine, message=wire.Heartbeat(seq=seq, sent_at=t, handles=chunk)
                )
            )

    def _next_seq(self, engine: str, t: float) -> int:
        self._seq = (self._seq + 1) % SEQ_MODULUS
        self._sent[self._seq] = (engine, t)
        if len(self._sent) > 8192:
            self._sent.popitem(last=False)
        return self._seq

    def _send_release(self, engine: str, ids: list[str], t: float, out: list[Action]) -> None:
        if not ids:
            return
        peer = self._peers.get(engine)
        if peer is None or not peer.ready:
            if peer is None:
                peer = self._peers[engine] = _Peer()
            peer.pending_release.update(dict.fromkeys(ids))
            if len(peer.pending_release) > self._remember:
                self._count("releases_dropped", len(peer.pending_release) - self._remember)
                while len(peer.pending_release) > self._remember:
                    del peer.pending_release[next(iter(peer.pending_release))]
            return
        seq = self._next_seq(engine, t)
        for chunk in _chunks(self._handles(engine, ids)):
            done = wire.LeaseDone(
                seq=seq, sent_at=t, reason=wire.DoneReason.RELEASED, handles=chunk
            )
            out.append(SendMessage(engine=engine, message=done))
        self._count("releases_sent", len(ids))

    def _on_ack(self, engine: str, msg: wire.LeaseAck, t: float, out: list[Action]) -> None:
        record = self._sent.get(msg.echo_seq)
        if record is None or record[0] != engine:
            self._count("acks_unmatched")
            return
        sent = record[1]
        self._count("acks")
        remaining = (msg.expiry - msg.holder_now) * (1.0 - self._drift)
        by_handle, tickets = self._by_handle, self._tickets
        for h in msg.handles:
            lid = by_handle.get((engine, h))
            ticket = tickets.get((engine, lid)) if lid is not None else None
            if ticket is None or ticket.lost is not None:
                continue
            ticket.bound = min(ticket.cap, max(ticket.bound, sent + remaining))
            load = self._loads.get(ticket.user) if ticket.user is not None else None
            if load is None:
                continue
            if load.state is ReadState.CONFIRMING:
                self._try_post(load, ticket, t, out)
            elif load.state is ReadState.POSTED:
                load.early = False
                load.bound = ticket.bound
                load.deadline = min(
                    ticket.bound, load.posted_at + self._t.transfer_timeout, load.hard
                )
            elif load.state is ReadState.VERIFYING:
                load.early = False
                load.bound = ticket.bound
                if load.done_at < ticket.bound:
                    self._end(load, ReadEvent.CONFIRMED, t, out)
                else:
                    self._end(
                        load,
                        ReadEvent.CONFIRMED_LATE,
                        t,
                        out,
                        reason="the read completed after the lease bound the prefill engine "
                        "confirmed; it may have reused the blocks",
                    )

    def _on_lost(self, engine: str, msg: wire.LeaseLost, t: float, out: list[Action]) -> None:
        why = msg.reason
        for h in msg.handles:
            lid = self._by_handle.get((engine, h))
            ticket = self._tickets.get((engine, lid)) if lid is not None else None
            if ticket is None:
                continue
            load = self._loads.get(ticket.user) if ticket.user is not None else None
            if (
                load is not None
                and load.state is ReadState.POSTED
                and not load.early
                and why is wire.LostReason.CONSUMED
            ):
                # Our own READ's notification reached the holder before we saw the transfer
                # complete: the holder consumed the lease for us (we are its claimant: it
                # acknowledged our heartbeat). Keep waiting for the result. An optimistic read
                # with no acknowledgement yet cannot tell its own consumption from an earlier
                # one (a replayed ticket), so it fails.
                continue
            ticket.lost = why
            ticket.lost_at = t
            ticket.bound = -math.inf
            if load is not None:
                self._end(load, ReadEvent.LOST, t, out, reason=_lost_text(why))

    def _peer_down(
        self, engine: str, t: float, out: list[Action], reason: str, *, failed: bool
    ) -> None:
        peer = self._peers.setdefault(engine, _Peer())
        peer.ready = False
        # The next connection may reach another instance of the engine: nothing confirmed over
        # this one counts there. Forget the bounds and the heartbeats sent (their late acks no
        # longer match); reads already posted keep their own bound.
        for (eng, _lid), ticket in self._tickets.items():
            if eng == engine:
                ticket.bound = -math.inf
        for seq in [q for q, (eng, _at) in self._sent.items() if eng == engine]:
            del self._sent[seq]
        if failed:
            if peer.pending_release:
                self._count("releases_dropped", len(peer.pending_release))
            peer.pending_release.clear()
            peer.pending_heartbeat.clear()
        for load in list(self._loads.values()):
            if load.engine != engine:
                continue
            if failed:
                self._end(
                    load,
                    ReadEvent.PEER_FAILED,
                    t,
                    out,
                    reason=f"prefill engine {engine!r}: {reason}",
                )
            elif load.state is ReadState.CONFIRMING:
                self._fire(load, ReadEvent.PEER_LOST, t)
                load.wait(t, self._t.peer_timeout)

    def _end(
        self,
        load: _Load,
        event: ReadEvent,
        t: float,
        out: list[Action],
        *,
        reason: str | None = None,
    ) -> None:
        was = load.state
        self._fire(load, event, t)
        del self._loads[load.request_id]
        ticket = self._tickets[(load.engine, load.lease_id)]
        ticket.user = None
        ticket.spent = True
        if was is ReadState.POSTED and load.state is not ReadState.DONE:
            out.append(StopRead(request_id=load.request_id))
        out.append(
            LoadEnded(
                request_id=load.request_id,
                engine=load.engine,
                state=load.state,
                reason=None if load.state is ReadState.DONE else reason,
            )
        )
        # The holder may free at once unless it already knows (lost), or our READ completed
        # (its notification consumed the lease).
        completed = (
            event in (ReadEvent.TRANSFER_DONE, ReadEvent.TRANSFER_LATE)
            or was is ReadState.VERIFYING
        )
        known = ticket.lost is None or (
            self._release_lost and ticket.lost is not wire.LostReason.CLAIMED
        )
        if known and not completed and event is not ReadEvent.PEER_FAILED:
            self._send_release(load.engine, [load.lease_id], t, out)


def _chunks(handles: list[int]) -> Iterator[tuple[int, ...]]:
    # One message holds at most MAX_HANDLES_PER_MESSAGE handles; a batch's parts share its seq.
    per = wire.MAX_HANDLES_PER_MESSAGE
    for start in range(0, len(handles), per):
        yield tuple(handles[start : start + per])


def _lost_text(why: wire.LostReason) -> str:
    # The holder is the prefill engine in pull mode, the decoder in push and bidirectional mode.
    return {
        wire.LostReason.UNKNOWN: "the engine holding the KV does not know the lease (never "
        "granted, or long gone)",
        wire.LostReason.CONSUMED: "the engine holding the KV reports the lease consumed (the "
        "ticket was already used)",
        wire.LostReason.ABORTED: "the engine holding the KV reports the lease aborted (it gave "
        "the blocks back)",
        wire.LostReason.EXPIRED: "the engine holding the KV reports the lease expired",
        wire.LostReason.CLAIMED: "another reader holds this lease (the ticket was used twice)",
    }.get(why, f"the engine holding the KV reports the lease lost ({why!r})")


def state_diagram() -> str:
    """The load state machine as a mermaid block, drawn from :data:`READ_TRANSITIONS`
    (embedded in ``docs/pd.md``)."""
    return READ_TRANSITIONS.diagram(ReadState.WAITING_PEER)


def transition_table() -> str:
    """:data:`READ_TRANSITIONS` as a markdown table (embedded in ``docs/pd.md``)."""
    return READ_TRANSITIONS.markdown()
