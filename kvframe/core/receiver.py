"""D's side of push mode as one machine: when a registration goes out, when D gives up, and
how each push ends.

In push mode D holds its destination blocks under a lease of its own (granted in D's
:class:`~kvframe.core.holder.LeaseHolder`) and registers them with P
(:class:`~kvframe.core.push.PushRegister`); P writes under that lease
(:mod:`kvframe.core.push`). :class:`PushReceiver` decides the rest, per request::

    unsent --peer ready--> sent --lease consumed--> done
       \\                    \\--timeout / abort--> revoked --lease ends--> failed
        \\--peer failed / send failed / timeout--> failed (freed at once)

A push the engine aborted ends ``aborted`` wherever it was (never ``failed``: the engine does
not recompute an aborted request).

- **Nobody told, nothing to fence.** While the registration has not left (no connection to
  P yet), an abort or a failure frees the blocks at once (:class:`FreeNow`).
- **Told, fenced.** Once sent, P may write at any time its lease is confirmed, so the push
  ends only when the *lease* ends (:meth:`PushReceiver.lease_ended`): P's completion notice
  consumed it (done), P released it (it will not write, or stopped: failed), or it expired
  (failed; P may have died or stalled with a WRITE in flight, so D first cuts it off:
  :class:`Fence`). An abort, or the overall cap, **revokes** it (:class:`Revoke`: no more renewals,
  P is told) and still waits for the lease to end; a refusal from P (it never wrote) frees at
  once.
- **Bounded.** An unsent registration ends after ``send_timeout``; a sent one is revoked after
  ``cap``, and its lease then ends by P's release or at its expiry, at most one lease duration
  later (P's heartbeats stop renewing a revoked lease). So every push ends within
  ``send_timeout + cap + kv_lease_duration`` of :meth:`PushReceiver.add`.

Sans-I/O: every call takes ``now`` and returns :data:`ReceiverAction` values to carry out in
order; :meth:`PushReceiver.next_deadline` says when to call :meth:`PushReceiver.tick`.
"""

from __future__ import annotations

import enum
from typing import TypeAlias

import attrs

from kvframe.core._checks import check_config_seconds, check_now
from kvframe.core.lease import LeaseState
from kvframe.core.machine import Step, TransitionTable
from kvframe.errors import InvalidTransitionError

__all__ = [
    "RECEIVE_TRANSITIONS",
    "Fence",
    "FreeNow",
    "PushEnded",
    "PushReceiver",
    "ReceiveEvent",
    "ReceiveState",
    "ReceiverAction",
    "Revoke",
    "SendRegistration",
    "state_diagram",
    "transition_table",
]


class ReceiveState(enum.Enum):
    """Where one push D waits for is."""

    UNSENT = "unsent"
    """Blocks held; the registration waits for a connection to P."""
    SENT = "sent"
    """Registered with P: P may write under D's lease."""
    REVOKED = "revoked"
    """D gave up (abort or cap); P may still be writing: the blocks stay until the lease ends."""
    DONE = "done"
    """P's completion notice consumed the lease: the blocks hold P's KV."""
    FAILED = "failed"
    """No (complete) write will come; the blocks are invalid."""
    ABORTED = "aborted"
    """The engine aborted the request; nothing writes into its blocks any more."""


class ReceiveEvent(enum.Enum):
    """What can happen to a push D waits for."""

    PEER_READY = "peer_ready"
    PEER_FAILED = "peer_failed"
    SEND_FAILED = "send_failed"
    TIMEOUT = "timeout"
    ABORT = "abort"
    REFUSED = "refused"
    CONSUMED = "consumed"
    RELEASED = "released"
    EXPIRED = "expired"


_S, _E = ReceiveState, ReceiveEvent

#: Every legal step of a push on D (drawn in ``docs/push.md``).
RECEIVE_TRANSITIONS: TransitionTable[ReceiveState, ReceiveEvent] = TransitionTable(
    "push",
    ReceiveState,
    ReceiveEvent,
    [
        Step(source=_S.UNSENT, event=_E.PEER_READY, target=_S.SENT, effect="send the registration"),
        Step(source=_S.UNSENT, event=_E.PEER_FAILED, target=_S.FAILED, effect="free at once"),
        Step(source=_S.UNSENT, event=_E.SEND_FAILED, target=_S.FAILED, effect="free at once"),
        Step(
            source=_S.UNSENT,
            event=_E.TIMEOUT,
            target=_S.FAILED,
            effect="no connection within send_timeout: free at once",
        ),
        Step(source=_S.UNSENT, event=_E.ABORT, target=_S.ABORTED, effect="free at once"),
        Step(
            source=_S.UNSENT,
            event=_E.EXPIRED,
            target=_S.FAILED,
            effect="the lease ran out before the registration left (nobody can write)",
        ),
        Step(
            source=_S.UNSENT,
            event=_E.RELEASED,
            target=_S.FAILED,
            effect="the lease ended before the registration left (nobody can write)",
        ),
        Step(
            source=_S.SENT,
            event=_E.CONSUMED,
            target=_S.DONE,
            effect="P's completion notice: the KV landed",
        ),
        Step(
            source=_S.SENT,
            event=_E.RELEASED,
            target=_S.FAILED,
            effect="P will not write (or stopped)",
        ),
        Step(source=_S.SENT, event=_E.EXPIRED, target=_S.FAILED, effect="P stopped renewing"),
        Step(
            source=_S.SENT,
            event=_E.REFUSED,
            target=_S.FAILED,
            effect="P refused the registration: free at once",
        ),
        Step(
            source=_S.SENT,
            event=_E.ABORT,
            target=_S.REVOKED,
            effect="revoke: no renewals, tell P; keep the blocks",
        ),
        Step(
            source=_S.SENT,
            event=_E.TIMEOUT,
            target=_S.REVOKED,
            effect="no write within cap: revoke",
        ),
        Step(
            source=_S.REVOKED,
            event=_E.CONSUMED,
            target=_S.FAILED,
            effect="the write completed anyway; the blocks are freed",
        ),
        Step(source=_S.REVOKED, event=_E.RELEASED, target=_S.FAILED, effect="P stopped: free"),
        Step(
            source=_S.REVOKED,
            event=_E.EXPIRED,
            target=_S.FAILED,
            effect="P's confirmed bound has passed: free",
        ),
        Step(source=_S.REVOKED, event=_E.REFUSED, target=_S.FAILED, effect="free at once"),
    ],
    terminal=(_S.DONE, _S.FAILED, _S.ABORTED),
)
del _S, _E


# -- actions -----------------------------------------------------------------------------------
@attrs.frozen(kw_only=True)
class SendRegistration:
    """Send push ``request_id``'s registration to P ``engine`` now; report a failure with
    :meth:`PushReceiver.send_failed`."""

    request_id: str
    engine: str


@attrs.frozen(kw_only=True)
class Revoke:
    """Revoke D's lease ``lease_id`` (``LeaseHolder.revoke``) and tell P ``engine`` (a loss
    notice, ``ABORTED``). Keep the blocks: the push ends when the lease does."""

    request_id: str
    lease_id: str
    engine: str


@attrs.frozen(kw_only=True)
class FreeNow:
    """End D's lease ``lease_id`` at once (``LeaseHolder.abort``): nobody writes into its
    blocks (P was never told, or refused). Its end, reported back to
    :meth:`PushReceiver.lease_ended`, is then a no-op."""

    request_id: str
    lease_id: str


@attrs.frozen(kw_only=True)
class Fence:
    """D's lease of push ``request_id`` expired while P may still have a WRITE in flight (P
    died or stalled: it neither completed nor said it stopped). Before the blocks are
    reported free, cut P ``engine`` off: drop the connection, which cancels whatever of P's
    transfers this side still serves (a two-sided transport's receives posted into the
    blocks), and make the next use handshake again."""

    request_id: str
    engine: str


@attrs.frozen(kw_only=True)
class PushEnded:
    """Push ``request_id`` ended (``DONE``, ``FAILED`` or ``ABORTED``): report it to the engine
    (``finished_recving``; for ``FAILED`` its blocks as invalid and ``reason``). Exactly once
    per push, after the :class:`FreeNow` that frees its blocks when there is one."""

    request_id: str
    engine: str
    state: ReceiveState
    reason: str | None = None


ReceiverAction: TypeAlias = SendRegistration | Revoke | FreeNow | Fence | PushEnded
"""Anything :class:`PushReceiver` asks its caller to do."""


@attrs.define(eq=False)
class _Push:
    request_id: str
    engine: str
    lease_id: str
    state: ReceiveState
    deadline: float
    aborted: bool = False
    reason: str | None = None


class PushReceiver:
    """D's pushes (one per decode worker rank; see the module docs).

    :param send_timeout: how long a registration may wait for a connection to P, seconds.
    :param cap: how long after its registration went out a push may take before D revokes it.
    """

    def __init__(self, *, send_timeout: float, cap: float) -> None:
        self._send = check_config_seconds("send_timeout", send_timeout)
        self._cap = check_config_seconds("cap", cap)
        self._pushes: dict[str, _Push] = {}
        self._by_lease: dict[str, str] = {}

    def __len__(self) -> int:
        """Pushes not ended."""
        return len(self._pushes)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._pushes

    def count(self, state: ReceiveState) -> int:
        """Pushes not ended in ``state``."""
        return sum(1 for p in self._pushes.values() if p.state is state)

    def state(self, request_id: str) -> ReceiveState | None:
        """The state of a push not ended, else ``None``."""
        push = self._pushes.get(request_id)
        return None if push is None else push.state

    def lease_of(self, request_id: str) -> str | None:
        """D's lease id of a push not ended."""
        push = self._pushes.get(request_id)
        return None if push is None else push.lease_id

    def request_of(self, lease_id: str) -> str | None:
        """The request whose push holds lease ``lease_id`` (not ended), or ``None``."""
        return self._by_lease.get(lease_id)

    def engine_busy(self, engine: str) -> bool:
        """Whether a push not ended waits on P ``engine``."""
        return any(p.engine == engine for p in self._pushes.values())

    def next_deadline(self) -> float | None:
        """When :meth:`tick` must run next, or ``None``."""
        times = [p.deadline for p in self._pushes.values() if p.state is not ReceiveState.REVOKED]
        return min(times) if times else None

    # -- inputs --------------------------------------------------------------------------
    def add(self, request_id: str, engine: str, lease_id: str, now: float) -> None:
        """A push to wait for: D granted lease ``lease_id`` over the request's blocks and has
        its registration for P ``engine`` ready. Call :meth:`peer_ready` when (or if already)
        connected.

        :raises InvalidTransitionError: ``request_id`` has a push not ended.
        """
        t = check_now(now)
        if request_id in self._pushes:
            raise InvalidTransitionError(
                f"push {request_id!r} is already {self._pushes[request_id].state.value}; it "
                "must end before the request id is pushed again"
            )
        self._pushes[request_id] = _Push(
            request_id=request_id,
            engine=engine,
            lease_id=lease_id,
            state=ReceiveState.UNSENT,
            deadline=t + self._send,
        )
        self._by_lease[lease_id] = request_id

    def peer_ready(self, engine: str, now: float) -> list[ReceiverAction]:
        """A usable connection to P ``engine`` exists: send every registration waiting for
        it."""
        t = check_now(now)
        out: list[ReceiverAction] = []
        for push in list(self._pushes.values()):
            if push.engine == engine and push.state is ReceiveState.UNSENT:
                self._fire(push, ReceiveEvent.PEER_READY)
                push.deadline = t + self._cap
                out.append(SendRegistration(request_id=push.request_id, engine=engine))
        return out

    def peer_failed(self, engine: str, reason: str, now: float) -> list[ReceiverAction]:
        """No connection to P ``engine`` could be made: registrations still waiting for it
        fail (sent ones wait for their leases: P may still write over the old one)."""
        check_now(now)
        out: list[ReceiverAction] = []
        for push in list(self._pushes.values()):
            if push.engine == engine and push.state is ReceiveState.UNSENT:
                self._end(
                    push,
                    ReceiveEvent.PEER_FAILED,
                    out,
                    f"no connection to the prefill engine: {reason}",
                    free=True,
                )
        return out

    def send_failed(self, request_id: str, reason: str, now: float) -> list[ReceiverAction]:
        """Sending push ``request_id``'s registration failed: nobody was told; it fails."""
        check_now(now)
        push = self._pushes.get(request_id)
        out: list[ReceiverAction] = []
        if push is not None and push.state is ReceiveState.SENT:
            push.state = ReceiveState.UNSENT  # it never left: undo the send
            self._end(
                push,
                ReceiveEvent.SEND_FAILED,
                out,
                f"sending the registration failed: {reason}",
                free=True,
            )
        return out

    def abort(self, request_id: str, now: float) -> list[ReceiverAction]:
        """The engine aborted the request. Unknown or ended pushes are a no-op."""
        check_now(now)
        push = self._pushes.get(request_id)
        out: list[ReceiverAction] = []
        if push is None:
            return out
        push.aborted = True
        if push.state is ReceiveState.UNSENT:
            self._end(push, ReceiveEvent.ABORT, out, "aborted by the engine", free=True)
        elif push.state is ReceiveState.SENT:
            self._fire(push, ReceiveEvent.ABORT)
            out.append(Revoke(request_id=request_id, lease_id=push.lease_id, engine=push.engine))
        return out

    def refused(self, engine: str, lease_id: str, reason: str, now: float) -> list[ReceiverAction]:
        """P ``engine`` refused the registration of lease ``lease_id`` (it never wrote): the
        push fails (or ends aborted, when revoked) and its blocks are freed at once. A refusal
        from another engine than the one registered with is ignored."""
        check_now(now)
        rid = self._by_lease.get(lease_id)
        push = self._pushes.get(rid) if rid is not None else None
        out: list[ReceiverAction] = []
        if push is None or push.engine != engine or push.state is ReceiveState.UNSENT:
            return out
        self._end(push, ReceiveEvent.REFUSED, out, reason, free=True)
        return out

    def lease_ended(self, lease_id: str, state: LeaseState, now: float) -> list[ReceiverAction]:
        """D's lease ``lease_id`` ended in ``state`` (``CONSUMED``: P's completion notice;
        ``ABORTED``: P released it, or :class:`FreeNow`; ``EXPIRED``). A lease of no push not
        ended is a no-op."""
        check_now(now)
        rid = self._by_lease.get(lease_id)
        push = self._pushes.get(rid) if rid is not None else None
        out: list[ReceiverAction] = []
        if push is None:
            return out
        if push.state is ReceiveState.UNSENT:
            # Only its expiry can end it (P never heard of it): nothing to fence, nothing left
            # to free; the push fails now instead of registering a dead lease later.
            event = ReceiveEvent.EXPIRED if state is LeaseState.EXPIRED else ReceiveEvent.RELEASED
            self._end(
                push,
                event,
                out,
                "D's lease ran out before its registration could be "
                "sent (the handshake took longer than kv_lease_duration)",
                free=False,
            )
            return out
        event = {
            LeaseState.CONSUMED: ReceiveEvent.CONSUMED,
            LeaseState.EXPIRED: ReceiveEvent.EXPIRED,
        }.get(state, ReceiveEvent.RELEASED)
        reason = push.reason or {
            ReceiveEvent.EXPIRED: "the prefill engine did not write within the lease (it died "
            "or stalled)",
            ReceiveEvent.RELEASED: "the prefill engine gave up the write (it failed, or its "
            "request was abandoned)",
        }.get(event)
        if event is ReceiveEvent.EXPIRED:
            out.append(Fence(request_id=push.request_id, engine=push.engine))
        self._end(push, event, out, reason, free=False)
        return out

    def tick(self, now: float) -> list[ReceiverAction]:
        """Fire deadlines: unsent registrations fail, sent pushes past the cap are revoked."""
        t = check_now(now)
        out: list[ReceiverAction] = []
        for push in list(self._pushes.values()):
            if push.deadline > t or push.state is ReceiveState.REVOKED:
                continue
            if push.state is ReceiveState.UNSENT:
                self._end(
                    push,
                    ReceiveEvent.TIMEOUT,
                    out,
                    f"no connection to the prefill engine within {self._send:g} s",
                    free=True,
                )
            else:
                push.reason = f"the prefill engine did not complete the push within {self._cap:g} s"
                self._fire(push, ReceiveEvent.TIMEOUT)
                out.append(
                    Revoke(request_id=push.request_id, lease_id=push.lease_id, engine=push.engine)
                )
        return out

    # -- internals -----------------------------------------------------------------------
    def _fire(self, push: _Push, event: ReceiveEvent) -> None:
        push.state = RECEIVE_TRANSITIONS.next(push.state, event, push.request_id)

    def _end(
        self,
        push: _Push,
        event: ReceiveEvent,
        out: list[ReceiverAction],
        reason: str | None,
        *,
        free: bool,
    ) -> None:
        self._fire(push, event)
        if push.state is not ReceiveState.DONE and push.aborted:
            push.state = ReceiveState.ABORTED  # the engine aborted it: not a failure to report
        del self._pushes[push.request_id]
        del self._by_lease[push.lease_id]
        if free:
            out.append(FreeNow(request_id=push.request_id, lease_id=push.lease_id))
        out.append(
            PushEnded(
                request_id=push.request_id,
                engine=push.engine,
                state=push.state,
                reason=None if push.state is ReceiveState.DONE else reason,
            )
        )


def state_diagram() -> str:
    """The push state machine on D as a mermaid block (embedded in ``docs/push.md``)."""
    return RECEIVE_TRANSITIONS.diagram(ReceiveState.UNSENT)


def transition_table() -> str:
    """:data:`RECEIVE_TRANSITIONS` as a markdown table (embedded in ``docs/push.md``)."""
    return RECEIVE_TRANSITIONS.markdown()
