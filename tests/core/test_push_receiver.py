"""PushReceiver (D's side of push mode) on explicit clock readings: every step of its table,
the illegal pairs and the calls the docs make no-ops, its bounds, aborts in every state,
refusals, ``send_failed``, ``peer_failed``, and a property over any sequence of calls.

``test_push_model.py`` drives it inside the whole push protocol, as the worker composes it,
over a lossy network."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvframe.core.lease import LeaseState
from kvframe.core.machine import Step
from kvframe.core.receiver import (
    RECEIVE_TRANSITIONS,
    Fence,
    FreeNow,
    PushEnded,
    PushReceiver,
    ReceiveEvent,
    ReceiverAction,
    ReceiveState,
    Revoke,
    SendRegistration,
    state_diagram,
    transition_table,
)
from kvframe.errors import ConfigError, InvalidTransitionError, LeaseError

SEND = 3.0
CAP = 18.0
LEASE = 6.0
"""The lease duration the property's holder grants (longer than ``SEND``, as the worker's
defaults are: ``send_timeout = 2 * handshake_timeout`` = 10 s, ``kv_lease_duration`` 30 s)."""
EXTENSION = 4.0
P = "P"
Q = "Q"
T0 = 100.0

S, E = ReceiveState, ReceiveEvent


def make() -> PushReceiver:
    return PushReceiver(send_timeout=SEND, cap=CAP)


def added(rid: str = "r", engine: str = P, now: float = T0) -> PushReceiver:
    r = make()
    r.add(rid, engine, f"{rid}-lease", now)
    return r


def sent(rid: str = "r", now: float = T0) -> PushReceiver:
    r = added(rid, now=now)
    assert r.peer_ready(P, now) == [SendRegistration(request_id=rid, engine=P)]
    return r


def capped(rid: str = "r", now: float = T0) -> PushReceiver:
    """Sent at ``now``, revoked by the cap (not aborted)."""
    r = sent(rid, now)
    assert r.tick(now + CAP) == [Revoke(request_id=rid, lease_id=f"{rid}-lease", engine=P)]
    return r


def ended(actions: list[ReceiverAction]) -> PushEnded:
    [end] = [a for a in actions if isinstance(a, PushEnded)]
    assert actions[-1] is end, "PushEnded comes last"
    return end


# -- the table, step by step ---------------------------------------------------------------------
REACH: dict[ReceiveState, Callable[[], PushReceiver]] = {
    S.UNSENT: added,
    S.SENT: sent,
    S.REVOKED: capped,
}
"""A receiver holding push ``r`` in each non-terminal state."""

LATER = T0 + CAP + 1.0

FIRE: dict[ReceiveEvent, Callable[[PushReceiver], list[ReceiverAction]]] = {
    E.PEER_READY: lambda r: r.peer_ready(P, LATER),
    E.PEER_FAILED: lambda r: r.peer_failed(P, "refused", LATER),
    E.TIMEOUT: lambda r: r.tick(LATER + CAP),
    E.ABORT: lambda r: r.abort("r", LATER),
    E.REFUSED: lambda r: r.refused(P, "r-lease", "push refused: unknown", LATER),
    E.CONSUMED: lambda r: r.lease_ended("r-lease", LeaseState.CONSUMED, LATER),
    E.RELEASED: lambda r: r.lease_ended("r-lease", LeaseState.ABORTED, LATER),
    E.EXPIRED: lambda r: r.lease_ended("r-lease", LeaseState.EXPIRED, LATER),
}
"""The call that applies each event to push ``r`` (send_failed: see ``apply``)."""


def apply(step: Step[ReceiveState, ReceiveEvent]) -> tuple[PushReceiver, list[ReceiverAction]]:
    if step.event is E.SEND_FAILED:
        # The registration is handed out by peer_ready and fails to leave: still unsent.
        r = added()
        r.peer_ready(P, T0)
        return r, r.send_failed("r", "no route", T0)
    r = REACH[step.source]()
    assert r.state("r") is step.source
    return r, FIRE[step.event](r)


def step_id(step: Step[ReceiveState, ReceiveEvent]) -> str:
    return f"{step.source.value}-{step.event.value}"


@pytest.mark.parametrize("step", RECEIVE_TRANSITIONS.steps, ids=step_id)
def test_each_step_of_the_table(step: Step[ReceiveState, ReceiveEvent]) -> None:
    r, actions = apply(step)
    lid = "r-lease"
    if step.target in RECEIVE_TRANSITIONS.terminal:
        end = ended(actions)
        assert end.request_id == "r"
        assert end.engine == P
        assert end.state is step.target
        if step.target is not S.ABORTED:
            assert (end.reason is None) == (step.target is S.DONE)
        assert "r" not in r
        assert len(r) == 0
        assert r.lease_of("r") is None
        assert r.request_of(lid) is None
        assert not r.engine_busy(P)
        assert r.next_deadline() is None
        frees = [a for a in actions if isinstance(a, FreeNow)]
        # Freed at once when P was never told or refused; else the lease already ended.
        lease_gone = step.event in (E.CONSUMED, E.RELEASED, E.EXPIRED)
        at_once = (step.source is S.UNSENT or step.event is E.REFUSED) and not lease_gone
        assert frees == ([FreeNow(request_id="r", lease_id=lid)] if at_once else [])
        # A lease that expired under a sent registration: P may have died or stalled with a
        # WRITE in flight, so D cuts it off before the blocks are reported free.
        fenced = step.event is E.EXPIRED and step.source is not S.UNSENT
        fences = [a for a in actions if isinstance(a, Fence)]
        assert fences == ([Fence(request_id="r", engine=P)] if fenced else [])
        assert len(actions) == len(frees) + len(fences) + 1
        # Ended means ended: the same event again, or any other, is a no-op.
        for fire in FIRE.values():
            assert fire(r) == []
    else:
        assert r.state("r") is step.target
        assert "r" in r
        assert r.count(step.target) == 1
        assert len(r) == 1
        assert r.engine_busy(P)
        if step.target is S.SENT:
            assert actions == [SendRegistration(request_id="r", engine=P)]
            assert r.next_deadline() == LATER + CAP  # the cap runs from the send
        else:
            assert actions == [Revoke(request_id="r", lease_id=lid, engine=P)]
            assert r.next_deadline() is None  # a revoked push waits for its lease


def test_the_steps_cover_the_table() -> None:
    """Every step above goes through the public calls; the table's states and events are all
    used, and its terminal states are the three ends."""
    events = {s.event for s in RECEIVE_TRANSITIONS.steps}
    assert events == set(ReceiveEvent)
    assert set(FIRE) | {E.SEND_FAILED} == set(ReceiveEvent)
    assert RECEIVE_TRANSITIONS.terminal == {S.DONE, S.FAILED, S.ABORTED}
    sources = {s.source for s in RECEIVE_TRANSITIONS.steps}
    assert sources == {S.UNSENT, S.SENT, S.REVOKED} == set(REACH)


ILLEGAL = [
    (s, e) for s in ReceiveState for e in ReceiveEvent if not RECEIVE_TRANSITIONS.legal(s, e)
]


@pytest.mark.parametrize(("state", "event"), ILLEGAL, ids=lambda x: x.value)
def test_illegal_pairs_raise_naming_the_state(state: ReceiveState, event: ReceiveEvent) -> None:
    with pytest.raises(InvalidTransitionError) as info:
        RECEIVE_TRANSITIONS.next(state, event, "req-7")
    text = str(info.value)
    assert f"'{state.value}'" in text
    assert event.value in text
    assert "'req-7'" in text
    assert text.startswith("push ")
    if state in RECEIVE_TRANSITIONS.terminal:
        assert "nothing (terminal)" in text


# The public calls never fire an illegal pair: each is a no-op where the docs say so.
NO_OPS: list[tuple[ReceiveState, ReceiveEvent]] = [
    (S.SENT, E.PEER_READY),  # only unsent registrations are sent
    (S.REVOKED, E.PEER_READY),
    (S.SENT, E.PEER_FAILED),  # sent ones wait for their leases
    (S.REVOKED, E.PEER_FAILED),
    (S.REVOKED, E.TIMEOUT),  # a revoked push waits for its lease
    (S.REVOKED, E.ABORT),  # revoked once
    (S.UNSENT, E.REFUSED),  # P was never told: not P's refusal
]


@pytest.mark.parametrize(("state", "event"), NO_OPS, ids=lambda x: x.value)
def test_calls_the_docs_make_no_ops(state: ReceiveState, event: ReceiveEvent) -> None:
    assert not RECEIVE_TRANSITIONS.legal(state, event)
    r = REACH[state]()
    assert FIRE[event](r) == []
    assert r.state("r") is state


def test_send_failed_only_for_a_registration_handed_out() -> None:
    r = added()
    assert r.send_failed("r", "x", T0) == []  # not handed out yet
    assert r.state("r") is S.UNSENT
    r = capped()
    assert r.send_failed("r", "x", LATER) == []
    assert r.state("r") is S.REVOKED
    assert make().send_failed("nobody", "x", T0) == []


def test_send_failed_frees_at_once_with_the_reason() -> None:
    r = added()
    r.add("other", P, "other-lease", T0)
    assert len(r.peer_ready(P, T0)) == 2
    out = r.send_failed("r", "connection reset", T0 + 1)
    assert out[0] == FreeNow(request_id="r", lease_id="r-lease")
    end = ended(out)
    assert end.state is S.FAILED
    assert end.reason is not None
    assert "connection reset" in end.reason
    assert r.state("other") is S.SENT  # the other registration left


def test_adding_a_request_twice_raises_naming_its_state() -> None:
    r = sent()
    with pytest.raises(InvalidTransitionError, match="'r' is already sent"):
        r.add("r", P, "another-lease", T0)
    assert r.lease_of("r") == "r-lease"
    assert r.request_of("another-lease") is None
    # once ended, the request id may be pushed again
    ended(r.lease_ended("r-lease", LeaseState.CONSUMED, T0 + 1))
    r.add("r", P, "another-lease", T0 + 2)
    assert r.state("r") is S.UNSENT


# -- bounds ---------------------------------------------------------------------------------------
def test_an_unsent_registration_ends_within_send_timeout() -> None:
    r = added()
    assert r.next_deadline() == T0 + SEND
    assert r.tick(T0 + SEND - 1e-9) == []
    out = r.tick(T0 + SEND)
    assert out[0] == FreeNow(request_id="r", lease_id="r-lease")
    end = ended(out)
    assert end.state is S.FAILED
    assert end.reason is not None
    assert f"{SEND:g} s" in end.reason
    assert len(r) == 0


def test_a_sent_registration_is_revoked_at_the_cap() -> None:
    r = added()
    sent_at = T0 + 1.0
    r.peer_ready(P, sent_at)
    assert r.next_deadline() == sent_at + CAP
    assert r.tick(sent_at + CAP - 1e-9) == []
    assert r.tick(sent_at + CAP) == [Revoke(request_id="r", lease_id="r-lease", engine=P)]
    assert r.next_deadline() is None
    assert r.tick(sent_at + 10 * CAP) == []  # revoked once; it waits for the lease
    assert r.state("r") is S.REVOKED
    end = ended(r.lease_ended("r-lease", LeaseState.EXPIRED, sent_at + CAP + LEASE))
    assert end.state is S.FAILED
    assert end.reason is not None
    assert f"within {CAP:g} s" in end.reason


@pytest.mark.parametrize("state", [LeaseState.CONSUMED, LeaseState.ABORTED, LeaseState.EXPIRED])
def test_a_capped_push_fails_however_its_lease_ends(state: LeaseState) -> None:
    r = capped()
    assert ended(r.lease_ended("r-lease", state, LATER)).state is S.FAILED


def test_next_deadline_is_the_earliest_of_the_pushes_not_revoked() -> None:
    r = make()
    assert r.next_deadline() is None
    r.add("a", P, "a-lease", T0)
    r.add("b", Q, "b-lease", T0 + 1)
    assert r.next_deadline() == T0 + SEND
    r.peer_ready(P, T0 + 0.5)
    assert r.next_deadline() == T0 + 1 + SEND
    r.peer_ready(Q, T0 + 2)
    assert r.next_deadline() == T0 + 0.5 + CAP
    r.abort("a", T0 + 3)
    assert r.next_deadline() == T0 + 2 + CAP


# -- aborts ---------------------------------------------------------------------------------------
def test_abort_while_unsent_frees_at_once() -> None:
    r = added()
    out = r.abort("r", T0 + 1)
    assert out[0] == FreeNow(request_id="r", lease_id="r-lease")
    assert ended(out).state is S.ABORTED


@pytest.mark.parametrize("state", [LeaseState.CONSUMED, LeaseState.ABORTED, LeaseState.EXPIRED])
def test_abort_while_sent_revokes_and_ends_aborted_with_the_lease(state: LeaseState) -> None:
    r = sent()
    assert r.abort("r", T0 + 1) == [Revoke(request_id="r", lease_id="r-lease", engine=P)]
    assert r.state("r") is S.REVOKED
    assert r.abort("r", T0 + 2) == []  # no second revoke
    assert r.tick(T0 + 10 * CAP) == []
    out = r.lease_ended("r-lease", state, T0 + 3)
    end = ended(out)
    # an expiry under a sent registration cuts P off first (it may still be writing)
    fence = [Fence(request_id="r", engine=P)] if state is LeaseState.EXPIRED else []
    assert out == [*fence, end]
    assert end.state is S.ABORTED


def test_abort_after_the_cap_ends_aborted() -> None:
    r = capped()
    assert r.abort("r", LATER) == []
    assert ended(r.lease_ended("r-lease", LeaseState.CONSUMED, LATER)).state is S.ABORTED


def test_abort_then_refusal_frees_at_once_and_ends_aborted() -> None:
    r = sent()
    r.abort("r", T0 + 1)
    out = r.refused(P, "r-lease", "push refused: abandoned", T0 + 2)
    assert out[0] == FreeNow(request_id="r", lease_id="r-lease")
    assert ended(out).state is S.ABORTED


def test_abort_of_unknown_or_ended_pushes_is_a_no_op() -> None:
    r = sent()
    assert r.abort("nobody", T0) == []
    ended(r.lease_ended("r-lease", LeaseState.CONSUMED, T0 + 1))
    assert r.abort("r", T0 + 2) == []


# -- refusals, lease ends, peers ----------------------------------------------------------------
def test_a_refusal_from_the_engine_registered_with_frees_at_once() -> None:
    r = sent()
    out = r.refused(P, "r-lease", "push refused: prompt", T0 + 1)
    assert out[0] == FreeNow(request_id="r", lease_id="r-lease")
    end = ended(out)
    assert end.state is S.FAILED
    assert end.reason == "push refused: prompt"


def test_a_refusal_from_another_engine_or_for_another_lease_is_ignored() -> None:
    r = sent()
    assert r.refused(Q, "r-lease", "x", T0 + 1) == []
    assert r.refused(P, "other-lease", "x", T0 + 1) == []
    assert r.state("r") is S.SENT
    r = capped()
    assert r.refused(Q, "r-lease", "x", LATER) == []
    assert r.state("r") is S.REVOKED


def test_lease_ended_for_unknown_leases_is_a_no_op() -> None:
    r = sent()
    for state in (LeaseState.CONSUMED, LeaseState.ABORTED, LeaseState.EXPIRED):
        assert r.lease_ended("no-such-lease", state, T0 + 1) == []
    assert r.state("r") is S.SENT
    # a FreeNow's lease, reported back as the worker does, is a no-op too
    r = added()
    assert isinstance(r.abort("r", T0 + 2)[0], FreeNow)
    assert r.lease_ended("r-lease", LeaseState.ABORTED, T0 + 2) == []


def test_a_lease_that_expires_while_unsent_ends_the_push() -> None:
    """D's holder expires leases nobody renews: an unsent registration's lease (P does not
    know it) expires ``kv_lease_duration`` after the grant, before ``send_timeout`` when that
    is longer. The push must end then (nothing to fence: P never heard of the lease), or at
    the latest within the documented bound; today it goes on, is sent, revoked at the cap,
    and never ends."""
    send = 10.0  # 2 * handshake_timeout (5 s, the default)
    lease = 6.0  # kv_lease_duration
    r = PushReceiver(send_timeout=send, cap=3 * lease)
    r.add("r", P, "r-lease", T0)
    out = r.lease_ended("r-lease", LeaseState.EXPIRED, T0 + lease)
    out += r.peer_ready(P, T0 + lease + 1)  # the handshake completed in time
    out += r.tick(T0 + lease + 1 + 3 * lease)  # the cap
    out += r.tick(T0 + send + 3 * lease + lease)  # the documented bound
    assert [a.state for a in out if isinstance(a, PushEnded)] == [S.FAILED]
    assert len(r) == 0


def test_peer_failed_touches_only_unsent_pushes_of_that_engine() -> None:
    r = make()
    r.add("a", P, "a-lease", T0)  # sent, to P
    r.add("d", P, "d-lease", T0)  # revoked, with P
    r.peer_ready(P, T0)
    r.abort("d", T0 + 1)
    r.add("b", P, "b-lease", T0 + 1)  # unsent, for P
    r.add("c", Q, "c-lease", T0 + 1)  # unsent, for Q
    out = r.peer_failed(P, "connection refused", T0 + 2)
    assert out[0] == FreeNow(request_id="b", lease_id="b-lease")
    end = ended(out)
    assert end.request_id == "b"
    assert end.state is S.FAILED
    assert end.reason is not None
    assert "connection refused" in end.reason
    assert (r.state("a"), r.state("b"), r.state("c"), r.state("d")) == (
        S.SENT,
        None,
        S.UNSENT,
        S.REVOKED,
    )
    assert r.peer_failed(P, "again", T0 + 3) == []
    assert r.engine_busy(P)
    assert r.engine_busy(Q)
    assert not r.engine_busy("R")


def test_peer_ready_sends_every_waiting_registration_of_that_engine_once() -> None:
    r = make()
    r.add("a", P, "a-lease", T0)
    r.add("b", Q, "b-lease", T0)
    r.add("c", P, "c-lease", T0)
    assert r.peer_ready(P, T0 + 1) == [
        SendRegistration(request_id="a", engine=P),
        SendRegistration(request_id="c", engine=P),
    ]
    assert r.peer_ready(P, T0 + 2) == []
    assert r.count(S.SENT) == 2
    assert r.count(S.UNSENT) == 1


# -- arguments, docs ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True, "3"])
@pytest.mark.parametrize("key", ["send_timeout", "cap"])
def test_bad_configuration_names_the_key(key: str, bad: Any) -> None:
    kw: dict[str, Any] = {"send_timeout": SEND, "cap": CAP, key: bad}
    with pytest.raises(ConfigError, match=key):
        PushReceiver(**kw)


@pytest.mark.parametrize("bad", [math.nan, math.inf, None, True])
def test_bad_times_raise_and_change_nothing(bad: Any) -> None:
    r = sent()
    calls: list[Callable[[], object]] = [
        lambda: r.add("x", P, "x-lease", bad),
        lambda: r.peer_ready(P, bad),
        lambda: r.peer_failed(P, "x", bad),
        lambda: r.send_failed("r", "x", bad),
        lambda: r.abort("r", bad),
        lambda: r.refused(P, "r-lease", "x", bad),
        lambda: r.lease_ended("r-lease", LeaseState.CONSUMED, bad),
        lambda: r.tick(bad),
    ]
    for call in calls:
        with pytest.raises(LeaseError, match="now must be a finite number"):
            call()
    assert r.state("r") is S.SENT
    assert len(r) == 1


def test_the_drawings_show_every_step() -> None:
    diagram, table = state_diagram(), transition_table()
    assert "[*] --> unsent" in diagram
    for s in RECEIVE_TRANSITIONS.steps:
        assert f"{s.source.value} --> {s.target.value}: {s.event.value}" in diagram
        assert f"| `{s.source.value}` | `{s.event.value}` | `{s.target.value}` |" in table


# -- any sequence of calls ----------------------------------------------------------------------
RIDS = ["a", "b", "c"]
ENGINES = [P, Q]


@attrs.define
class Lease:
    """The property's holder: one lease per push, granted at ``add``."""

    rid: str
    engine: str
    granted: float
    expiry: float
    live: bool = True
    told: bool = False
    """The registration left (P may renew, consume or release the lease)."""
    refused: bool = False
    revoked: bool = False
    freed: bool = False
    ends: int = 0


OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "add",
                "ready",
                "peer_failed",
                "abort",
                "refuse",
                "renew",
                "consume",
                "release",
                "tick",
                "wait",
            ]
        ),
        st.sampled_from(RIDS),
        st.sampled_from(ENGINES),
        st.one_of(st.sampled_from([0.0, 0.5, SEND, LEASE, CAP]), st.floats(0.0, 8.0)),
        st.booleans(),
    ),
    max_size=40,
)


@given(ops=OPS)
def test_any_sequence_of_calls_ends_every_push_exactly_once(
    ops: list[tuple[str, str, str, float, bool]],
) -> None:
    """Any order of calls, with non-decreasing ``now`` and a holder that does what D's does
    (a lease lasts ``LEASE`` from its grant and each renewal keeps it ``EXTENSION`` more; a
    revoked or unsent lease is not renewed; P consumes or releases only a lease it was told;
    a lease ends once; expiry is reported at the holder's progress points): each push emits
    exactly one PushEnded, within ``send_timeout + cap + kv_lease_duration`` of its add; a
    FreeNow only for a push never sent or refused; no PushEnded for a sent push before its
    lease ended, except a refusal's."""
    r = make()
    now = T0
    leases: dict[str, Lease] = {}  # lease id -> lease
    n = 0

    def lid_of(rid: str) -> str | None:
        live = [lid for lid, ls in leases.items() if ls.rid == rid and ls.ends == 0]
        return live[-1] if live else None

    def carry_out(actions: list[ReceiverAction], *, send_fails: bool = False) -> None:
        todo = list(actions)
        while todo:
            a = todo.pop(0)
            if isinstance(a, SendRegistration):
                lid = r.lease_of(a.request_id)
                assert lid is not None
                assert not leases[lid].told
                if send_fails:  # the worker reports it at once: nobody was told
                    todo.extend(r.send_failed(a.request_id, "boom", now))
                else:
                    leases[lid].told = True
            elif isinstance(a, Revoke):
                ls = leases[a.lease_id]
                assert ls.told
                assert not ls.revoked
                assert ls.ends == 0
                ls.revoked = True
            elif isinstance(a, FreeNow):
                ls = leases[a.lease_id]
                assert not ls.told or ls.refused, "freed a lease P may write under"
                assert not ls.freed
                ls.freed = True
                if ls.live:  # LeaseHolder.abort: its end is reported back, a no-op
                    ls.live = False
                    assert r.lease_ended(a.lease_id, LeaseState.ABORTED, now) == []
            elif isinstance(a, Fence):
                [lid] = [k for k, ls in leases.items() if ls.rid == a.request_id and ls.ends == 0]
                assert leases[lid].told, "a fence for a registration P never had"
                assert not leases[lid].live, "a fence for a lease not gone"
            else:
                assert isinstance(a, PushEnded)
                [lid] = [k for k, ls in leases.items() if ls.rid == a.request_id and ls.ends == 0]
                ls = leases[lid]
                ls.ends += 1
                if ls.told and not ls.refused:
                    assert not ls.live, "a sent push ended before its lease"
                if a.state is not S.ABORTED:  # a failure says why; done has no reason
                    assert (a.state is S.DONE) == (a.reason is None)
                assert now <= ls.granted + SEND + CAP + LEASE + 1e-9, "ended late"
                assert a.request_id not in r

    def expire() -> None:  # LeaseHolder.expire at a progress point
        for lid, ls in list(leases.items()):
            if ls.live and ls.expiry <= now:
                ls.live = False
                carry_out(r.lease_ended(lid, LeaseState.EXPIRED, now))

    def progress() -> None:  # the worker's progress point: tick, then the holder's expiry
        carry_out(r.tick(now))
        expire()

    def wait(dt: float) -> None:
        # time passes; the worker wakes at the receiver's and the holder's deadlines
        nonlocal now
        target = now + dt
        while True:
            times = [d for d in [r.next_deadline()] if d is not None]
            times += [ls.expiry for ls in leases.values() if ls.live]
            due = min((x for x in times if x <= target), default=None)
            if due is None:
                break
            now = max(now, due)
            progress()
        now = target

    for op, rid, engine, dt, flag in ops:
        lid = lid_of(rid)
        if op == "wait":
            wait(dt)
        elif op == "add":
            if rid in r:
                with pytest.raises(InvalidTransitionError):
                    r.add(rid, engine, "x", now)
                continue
            n += 1
            new = f"{rid}-{n}"
            leases[new] = Lease(rid, engine, now, now + LEASE)
            r.add(rid, engine, new, now)
        elif op == "ready":
            carry_out(r.peer_ready(engine, now), send_fails=flag)
        elif op == "peer_failed":
            carry_out(r.peer_failed(engine, "down", now))
        elif op == "abort":
            carry_out(r.abort(rid, now))
        elif op == "tick":
            progress()
        elif lid is None:
            continue
        elif op == "refuse":
            ls = leases[lid]
            if ls.told and ls.live:
                ls.refused = engine == ls.engine
            carry_out(r.refused(engine, lid, "push refused", now))
        elif op == "renew":
            ls = leases[lid]
            if ls.live and ls.told and not ls.revoked:
                ls.expiry = max(ls.expiry, now + EXTENSION)
        else:
            ls = leases[lid]
            if ls.live and ls.told:  # P's completion notice, or P's release
                ls.live = False
                state = LeaseState.CONSUMED if op == "consume" else LeaseState.ABORTED
                carry_out(r.lease_ended(lid, state, now))

    # Let time run to every bound: the worker's progress points at every deadline.
    wait(2 * (SEND + CAP + LEASE))
    assert len(r) == 0, "a push never ended"
    for ls in leases.values():
        assert ls.ends == 1, f"{ls.rid} ended {ls.ends} times"
        assert not ls.live
