"""LeaseReader on explicit clock readings: every decision, every state, every deadline.

The holder's side is played by hand (acks and loss notices built here), so each number can be
checked: the holder's clock is offset by 5000 s from the reader's, and the reader allows 1 %
of drift. ``test_pd_network.py`` drives the reader against the real holder.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import pytest

from kvframe.core import wire
from kvframe.core.lease import LeasePolicy, lease_handle
from kvframe.core.reader import (
    READ_TRANSITIONS,
    Action,
    LeaseReader,
    LoadEnded,
    PostRead,
    ReaderTimeouts,
    ReadEvent,
    ReadState,
    Reconnect,
    SendMessage,
    StopRead,
)
from kvframe.core.slots import slot_tag
from kvframe.errors import ConfigError, InvalidTransitionError, LeaseError

E = "P"
INC = "inc-A"
POLICY = LeasePolicy.from_duration(6.0)  # interval 1, extension 4
T = ReaderTimeouts(
    margin=0.5, peer_timeout=3.0, confirm_timeout=4.0, transfer_timeout=5.0, resend_after=1.0
)
BOUND = 12.0  # peer + confirm + transfer
DRIFT = 0.01
HOLDER = 5000.0  # the holder's clock reads 5000 s more than the reader's


# Lease ids the tests use, by handle: the wire names leases by handle, the tests by id.
LEASE_IDS = ["L", "M", "N", "A", "B", "C", "Lw", "Lp", "Lc", "Lr", "Lq"]
LEASE_IDS += [f"L{i}" for i in range(200)]
NAME = {lease_handle(lid): lid for lid in LEASE_IDS}


def H(lid: str) -> int:
    """The wire handle of lease ``lid``."""
    NAME.setdefault(lease_handle(lid), lid)
    return lease_handle(lid)


def names(handles: tuple[int, ...]) -> tuple[str, ...]:
    """The lease ids of ``handles`` (as the tests name them)."""
    return tuple(NAME[h] for h in handles)


def make(drift: float = DRIFT, remember: int = 65_536, *, optimistic: bool = False) -> LeaseReader:
    return LeaseReader(POLICY, T, max_drift=drift, remember=remember, optimistic=optimistic)


def kinds(actions: list[Action]) -> list[str]:
    return [type(a).__name__ for a in actions]


def sent(actions: list[Action], engine: str = E) -> list[wire.Message]:
    """The messages ``actions`` send to ``engine``."""
    return [a.message for a in actions if isinstance(a, SendMessage) and a.engine == engine]


def heartbeat(actions: list[Action], engine: str = E) -> wire.Heartbeat:
    """The one heartbeat among ``actions``."""
    beats = [m for m in sent(actions, engine) if isinstance(m, wire.Heartbeat)]
    assert len(beats) == 1, actions
    return beats[0]


def releases(actions: list[Action]) -> list[str]:
    """Lease ids released by ``actions``."""
    out = []
    for m in sent(actions):
        if isinstance(m, wire.LeaseDone):
            assert m.reason is wire.DoneReason.RELEASED
            out += names(m.handles)
    return out


def ended(actions: list[Action], rid: str = "q") -> LoadEnded:
    hits = [a for a in actions if isinstance(a, LoadEnded) and a.request_id == rid]
    assert len(hits) == 1, actions
    return hits[0]


def ack(hb: wire.Heartbeat, lid: str, remaining: float, holder_now: float) -> wire.LeaseAck:
    """The holder's answer to ``hb``: ``lid`` lasts ``remaining`` more seconds of its clock."""
    return wire.LeaseAck(
        echo_seq=hb.seq, holder_now=holder_now, expiry=holder_now + remaining, handles=[H(lid)]
    )


def lost(lid: str, why: wire.LostReason = wire.LostReason.EXPIRED) -> wire.LeaseLost:
    return wire.LeaseLost(echo_seq=0, holder_now=HOLDER, reason=why, handles=[H(lid)])


def confirming(r: LeaseReader, t: float = 0.0, rid: str = "q", lid: str = "L") -> wire.Heartbeat:
    """Connect, add load ``rid`` at ``t``: it asks for a confirmation. Returns the heartbeat."""
    assert r.peer_ready(E, t, incarnation=INC) == []
    hb = heartbeat(r.add(rid, E, lid, t, incarnation=INC))
    assert names(hb.handles) == (lid,)
    assert hb.sent_at == t
    assert r.state(rid) is ReadState.CONFIRMING
    return hb


def posted(r: LeaseReader, t: float = 0.0, rid: str = "q", lid: str = "L") -> PostRead:
    """A load posted at ``t + 0.25`` under a bound of ``t + 4 * (1 - drift)``."""
    hb = confirming(r, t, rid, lid)
    out = r.receive(E, ack(hb, lid, 4.0, HOLDER + t + 0.1), t + 0.25)
    assert kinds(out) == ["PostRead"], out
    post = out[0]
    assert isinstance(post, PostRead)
    assert r.state(rid) is ReadState.POSTED
    return post


# -- configuration -----------------------------------------------------------------------------
def test_timeouts_from_policy_and_bound() -> None:
    t = ReaderTimeouts.from_policy(POLICY, peer_timeout=7.0)
    assert t == ReaderTimeouts(
        margin=1.0, peer_timeout=7.0, confirm_timeout=4.0, transfer_timeout=4.0, resend_after=1.0
    )
    assert ReaderTimeouts.from_policy(POLICY, peer_timeout=7.0, margin=0.1).margin == 0.1
    assert make().bound() == BOUND


@pytest.mark.parametrize("field", [f.name for f in attrs.fields(ReaderTimeouts)])
@pytest.mark.parametrize("bad", [0, -1.0, math.inf, math.nan, True])
def test_timeouts_refuse_bad_values(field: str, bad: object) -> None:
    values: dict[str, object] = {f.name: 1.0 for f in attrs.fields(ReaderTimeouts)}
    values[field] = bad
    with pytest.raises(ConfigError, match=field):
        ReaderTimeouts(**values)  # type: ignore[arg-type]


# -- confirmation ------------------------------------------------------------------------------
def test_an_ack_confirms_from_the_send_time_shrunk_by_the_drift() -> None:
    r = make()
    hb = confirming(r, t=10.0)
    # The holder computed 4 s of lease at its 5011.0; the ack took 2 s to come back.
    out = r.receive(E, ack(hb, "L", 4.0, HOLDER + 11.0), 12.0)
    bound = 10.0 + 4.0 * (1 - DRIFT)  # sent + (expiry - holder_now) * (1 - drift)
    assert r.confirmed_bound(E, "L") == pytest.approx(bound, abs=1e-12)
    assert out == [
        PostRead(
            request_id="q",
            engine=E,
            notification=wire.LeaseDone(
                seq=out[0].notification.seq,  # type: ignore[union-attr]
                sent_at=12.0,
                reason=wire.DoneReason.READ,
                handles=(H("L"),),
            ),
        )
    ]
    assert r.next_deadline() == pytest.approx(bound)  # the bound is earlier than 12 + 5
    assert r.take_counts()["acks"] == 1


def test_the_bound_counts_from_the_heartbeat_answered_not_the_latest() -> None:
    r = make(drift=0.0)
    first = confirming(r, t=10.0)
    second = heartbeat(r.tick(11.0))  # resent after resend_after
    assert second.seq != first.seq
    assert second.sent_at == 11.0
    # An answer to the first heartbeat, arriving after the second was sent.
    r.receive(E, ack(first, "L", 0.75, HOLDER + 10.5), 11.1)
    assert r.confirmed_bound(E, "L") == 10.75
    assert r.state("q") is ReadState.CONFIRMING  # 10.75 - 11.1 < margin
    out = r.receive(E, ack(second, "L", 0.75, HOLDER + 11.05), 11.1)
    assert r.confirmed_bound(E, "L") == 11.75
    assert kinds(out) == ["PostRead"]


def test_a_read_needs_the_margin() -> None:
    r = make(drift=0.0)
    hb = confirming(r, t=10.0)
    assert r.receive(E, ack(hb, "L", 0.75, HOLDER + 10.1), 10.375) == []  # 0.375 s left
    assert r.state("q") is ReadState.CONFIRMING
    assert r.confirmed_bound(E, "L") == 10.75
    hb2 = heartbeat(r.tick(11.0))
    assert kinds(r.receive(E, ack(hb2, "L", 0.5, HOLDER + 11.0), 11.0)) == ["PostRead"]  # 0.5


def test_a_scheduler_heartbeat_confirms_before_the_load_arrives() -> None:
    r = make()
    r.peer_ready(E, 0.0, incarnation=INC)
    hb = heartbeat(r.heartbeat(E, ["L", "L"], 0.0))
    assert names(hb.handles) == ("L",)
    assert r.receive(E, ack(hb, "L", 4.0, HOLDER), 0.1) == []
    out = r.add("q", E, "L", 0.2, incarnation=INC)
    assert kinds(out) == ["PostRead"]  # no heartbeat needed


@pytest.mark.parametrize("optimistic", [False, True])
def test_a_lease_is_named_in_one_heartbeat_per_progress_point(optimistic: bool) -> None:
    """A load added in the step its request arrives heartbeats its lease at once; the
    scheduler's batch naming it at the same moment leaves it out (the others in the batch
    go), and the answer to the one heartbeat confirms the load. At a later moment the lease
    is heartbeated again."""
    r = make(optimistic=optimistic)
    assert r.peer_ready(E, 0.0, incarnation=INC) == []
    hb = heartbeat(r.add("q", E, "L", 0.0, incarnation=INC))
    assert names(hb.handles) == ("L",)
    assert sent(r.heartbeat(E, ["L"], 0.0)) == []
    assert names(heartbeat(r.heartbeat(E, ["L", "M"], 0.0)).handles) == ("M",)
    assert r.take_counts()["heartbeats_merged"] == 2
    if optimistic:
        assert r.transfer_done("q", 0.1) == []  # the early READ landed: it waits for the answer
        out = r.receive(E, ack(hb, "L", 4.0, HOLDER + 0.1), 0.2)
        assert ended(out).state is ReadState.DONE
    else:
        out = r.receive(E, ack(hb, "L", 4.0, HOLDER + 0.1), 0.2)
        assert kinds(out) == ["PostRead"], out
    assert names(heartbeat(r.heartbeat(E, ["L"], 0.3)).handles) == ("L",)


def test_heartbeats_while_disconnected_are_deferred() -> None:
    r = make()
    assert r.heartbeat(E, ["L"], 0.0) == []
    assert r.heartbeat(E, [], 0.0) == []
    assert r.take_counts() == {"heartbeats_deferred": 1}


@pytest.mark.parametrize("case", ["unknown seq", "other engine", "lost before"])
def test_acks_that_cannot_confirm_change_nothing(case: str) -> None:
    r = make()
    hb = confirming(r)
    if case == "unknown seq":
        out = r.receive(E, attrs.evolve(ack(hb, "L", 4.0, HOLDER), echo_seq=hb.seq + 99), 0.1)
    elif case == "other engine":
        out = r.receive("P2", ack(hb, "L", 4.0, HOLDER), 0.1)
    else:
        r.heartbeat(E, ["M"], 0.0)
        hb_m = heartbeat(r.heartbeat(E, ["M"], 0.05))
        r.receive(E, lost("M"), 0.06)
        out = r.receive(E, ack(hb_m, "M", 4.0, HOLDER), 0.1)
        assert r.confirmed_bound(E, "M") == -math.inf
    assert out == []
    assert r.state("q") is ReadState.CONFIRMING
    assert r.confirmed_bound(E, "L") == -math.inf


# -- completion --------------------------------------------------------------------------------
def test_completion_before_the_bound_is_done() -> None:
    r = make()
    posted(r)
    out = r.transfer_done("q", 3.9)  # bound 3.96
    assert out == [LoadEnded(request_id="q", engine=E, state=ReadState.DONE)]
    assert len(r) == 0
    assert r.next_deadline() is None


@pytest.mark.parametrize("at", [3.96, 3.97, 20.0])
def test_completion_at_or_after_the_bound_fails_without_a_release(at: float) -> None:
    r = make()
    posted(r)
    out = r.transfer_done("q", at)
    # The READ's own notification consumes the lease: no release.
    assert kinds(out) == ["StopRead", "LoadEnded"]
    assert ended(out).state is ReadState.FAILED
    assert "after the confirmed lease bound" in (ended(out).reason or "")


def test_a_posted_read_times_out_at_the_bound_then_releases() -> None:
    r = make()
    posted(r)
    assert r.next_deadline() == pytest.approx(3.96)
    assert r.tick(3.95) == []
    out = r.tick(3.96)
    assert kinds(out) == ["StopRead", "LoadEnded", "SendMessage"]
    assert ended(out).state is ReadState.FAILED
    assert releases(out) == ["L"]


def test_a_posted_read_times_out_at_the_transfer_timeout_when_earlier() -> None:
    r = make()
    hb = confirming(r, t=1.0)
    r.receive(E, ack(hb, "L", 30.0, HOLDER + 1.0), 2.0)  # bound 1 + 29.7
    assert r.next_deadline() == 2.0 + T.transfer_timeout
    assert kinds(r.tick(7.0)) == ["StopRead", "LoadEnded", "SendMessage"]


def test_a_later_ack_while_posted_moves_the_bound() -> None:
    r = make(drift=0.0)
    posted(r)  # bound 4.0
    hb = heartbeat(r.heartbeat(E, ["L"], 1.0))
    assert r.receive(E, ack(hb, "L", 4.0, HOLDER + 1.1), 1.2) == []
    assert r.confirmed_bound(E, "L") == 5.0
    assert r.next_deadline() == 5.0  # not later than posted + transfer_timeout (5.25)
    assert r.transfer_done("q", 4.5)[0] == LoadEnded(request_id="q", engine=E, state=ReadState.DONE)


def test_a_failed_transfer_stops_reports_and_releases() -> None:
    r = make()
    posted(r)
    out = r.transfer_failed("q", "boom", 1.0)
    assert kinds(out) == ["StopRead", "LoadEnded", "SendMessage"]
    assert ended(out).reason == "transfer failed: boom"
    assert releases(out) == ["L"]


# -- loss notices ------------------------------------------------------------------------------
ENDING_REASONS = [w for w in wire.LostReason if w is not wire.LostReason.CONSUMED]


@pytest.mark.parametrize("why", list(wire.LostReason))
def test_a_loss_notice_fails_a_confirming_load(why: wire.LostReason) -> None:
    r = make()
    confirming(r)
    out = r.receive(E, lost("L", why), 0.1)
    assert kinds(out) == ["LoadEnded"]  # the holder knows: no release
    assert ended(out).state is ReadState.FAILED
    assert r.confirmed_bound(E, "L") == -math.inf


@pytest.mark.parametrize("why", ENDING_REASONS)
def test_a_loss_notice_stops_a_posted_read_first(why: wire.LostReason) -> None:
    r = make()
    posted(r)
    out = r.receive(E, lost("L", why), 1.0)
    assert kinds(out) == ["StopRead", "LoadEnded"]
    assert ended(out).state is ReadState.FAILED


def test_consumed_while_posted_is_our_own_read_and_ignored() -> None:
    r = make()
    posted(r)
    # Our READ's notification reached the holder before the transport told us.
    assert r.receive(E, lost("L", wire.LostReason.CONSUMED), 1.0) == []
    assert r.state("q") is ReadState.POSTED
    assert r.transfer_done("q", 1.1) == [LoadEnded(request_id="q", engine=E, state=ReadState.DONE)]


def test_a_loss_notice_fails_a_load_waiting_for_its_connection() -> None:
    r = make()
    confirming(r)
    r.peer_lost(E, 0.1)
    assert r.state("q") is ReadState.WAITING_PEER
    out = r.receive(E, lost("L"), 0.2)  # answered over the old connection
    assert kinds(out) == ["LoadEnded"]


def test_a_loss_notice_before_the_load_fails_it_at_once() -> None:
    r = make()
    r.peer_ready(E, 0.0, incarnation=INC)
    r.heartbeat(E, ["L"], 0.0)
    assert r.receive(E, lost("L", wire.LostReason.CLAIMED), 0.1) == []
    out = r.add("q", E, "L", 0.2, incarnation=INC)
    assert kinds(out) == ["LoadEnded"]
    assert "another reader" in (ended(out).reason or "")
    assert len(r) == 0


def test_loss_notices_for_unknown_leases_are_ignored() -> None:
    r = make()
    confirming(r)
    assert r.receive(E, lost("M"), 0.1) == []
    assert r.state("q") is ReadState.CONFIRMING


# -- single-use tickets ------------------------------------------------------------------------
@pytest.mark.parametrize("state", [ReadState.WAITING_PEER, ReadState.CONFIRMING, ReadState.POSTED])
def test_a_ticket_in_use_refuses_a_second_load_at_once(state: ReadState) -> None:
    r = make()
    if state is ReadState.WAITING_PEER:
        r.add("q", E, "L", 0.0)
    elif state is ReadState.CONFIRMING:
        confirming(r)
    else:
        posted(r)
    before = (r.state("q"), r.next_deadline(), r.confirmed_bound(E, "L"))
    out = r.add("q2", E, "L", 1.0, incarnation=INC)
    assert kinds(out) == ["LoadEnded"]
    assert ended(out, "q2").state is ReadState.FAILED
    assert "reading it now" in (ended(out, "q2").reason or "")
    assert (r.state("q"), r.next_deadline(), r.confirmed_bound(E, "L")) == before
    assert r.loads() == ["q"]
    assert r.take_counts()["duplicate_tickets"] == 1


def _done(r: LeaseReader) -> None:
    posted(r)
    r.transfer_done("q", 1.0)


def _failed(r: LeaseReader) -> None:
    posted(r)
    r.transfer_failed("q", "boom", 1.0)


def _lost(r: LeaseReader) -> None:
    confirming(r)
    r.receive(E, lost("L"), 1.0)


def _aborted(r: LeaseReader) -> None:
    confirming(r)
    r.abort("q", 1.0)


def _timed_out(r: LeaseReader) -> None:
    r.add("q", E, "L", 0.0)
    r.tick(3.0)


def _released(r: LeaseReader) -> None:
    r.release(E, ["L"], 0.0)


END_A_LOAD: dict[str, Callable[[LeaseReader], None]] = {
    "done": _done,
    "failed": _failed,
    "lost": _lost,
    "aborted": _aborted,
    "timed out": _timed_out,
    "released": _released,
}


@pytest.mark.parametrize("how", list(END_A_LOAD))
def test_a_spent_ticket_refuses_a_replay_at_once(how: str) -> None:
    r = make()
    END_A_LOAD[how](r)
    assert len(r) == 0
    r.tick(2.0)
    out = r.add("q2", E, "L", 2.0, incarnation=INC)
    assert kinds(out) == ["LoadEnded"], out
    assert ended(out, "q2").state is ReadState.FAILED
    assert len(r) == 0


def test_add_refuses_a_request_id_that_has_not_ended() -> None:
    r = make()
    confirming(r)
    before = (r.state("q"), r.next_deadline(), r.loads())
    with pytest.raises(InvalidTransitionError, match="already confirming"):
        r.add("q", E, "M", 0.1)
    assert (r.state("q"), r.next_deadline(), r.loads()) == before
    assert r.confirmed_bound(E, "M") == -math.inf


@pytest.mark.parametrize(("rid", "engine", "lid"), [("", E, "L"), ("q", "", "L"), ("q", E, "")])
def test_add_refuses_empty_ids(rid: str, engine: str, lid: str) -> None:
    r = make()
    with pytest.raises(LeaseError):
        r.add(rid, engine, lid, 0.0)
    assert len(r) == 0


def test_add_refuses_a_time_that_is_not_finite() -> None:
    r = make()
    with pytest.raises(LeaseError):
        r.add("q", E, "L", math.nan)
    assert len(r) == 0


# -- timeouts and deadlines --------------------------------------------------------------------
def test_waiting_for_the_connection_times_out_and_queues_the_release() -> None:
    r = make()
    assert r.add("q", E, "L", 0.0) == []
    assert r.next_deadline() == T.peer_timeout
    assert r.tick(2.99) == []
    out = r.tick(3.0)
    assert kinds(out) == ["LoadEnded"]
    assert "no connection" in (ended(out).reason or "")
    out = r.peer_ready(E, 4.0, incarnation=INC)
    assert releases(out) == ["L"]


def test_confirmation_is_resent_then_times_out() -> None:
    r = make()
    first = confirming(r, t=0.0)
    assert r.next_deadline() == T.resend_after
    assert r.tick(0.99) == []
    seqs = {first.seq}
    for k in range(1, 4):
        assert r.next_deadline() == float(k)
        hb = heartbeat(r.tick(float(k)))
        assert names(hb.handles) == ("L",)
        assert hb.sent_at == float(k)
        assert hb.seq not in seqs
        seqs.add(hb.seq)
    assert r.next_deadline() == T.confirm_timeout  # the resend at 4 coincides
    out = r.tick(4.0)
    assert kinds(out) == ["LoadEnded", "SendMessage"]
    assert "did not confirm" in (ended(out).reason or "")
    assert releases(out) == ["L"]
    assert r.take_counts()["urgent_heartbeats"] == 4


def test_every_state_deadline_is_capped_by_the_overall_bound() -> None:
    r = make(drift=0.0)
    r.add("q", E, "L", 0.0)  # hard deadline 12
    assert r.next_deadline() == 3.0
    r.peer_ready(E, 2.9, incarnation=INC)
    assert r.state("q") is ReadState.CONFIRMING
    r.peer_lost(E, 6.0)
    assert r.next_deadline() == 9.0  # 6 + peer_timeout
    out = r.peer_ready(E, 8.9, incarnation=INC)
    hb = heartbeat(out)
    assert min(8.9 + T.confirm_timeout, 12.0) == 12.0
    r.receive(E, ack(hb, "L", 60.0, HOLDER + 9.0), 9.0)
    assert r.state("q") is ReadState.POSTED
    assert r.next_deadline() == 12.0  # not 9 + transfer_timeout, not the bound 68.9
    assert r.tick(11.99) == []
    assert kinds(r.tick(12.0)) == ["StopRead", "LoadEnded", "SendMessage"]


def test_next_deadline_is_the_earliest_of_every_load_and_resend() -> None:
    r = make()
    assert r.next_deadline() is None
    r.add("w", E, "Lw", 0.0)  # waiting: 3.0
    r.peer_ready("P2", 0.5, incarnation=INC)
    r.add("c", "P2", "Lc", 0.5, incarnation=INC)  # confirming: resend 1.5, timeout 4.5
    assert r.next_deadline() == 1.5
    heartbeat(r.tick(1.5), "P2")
    assert r.next_deadline() == 2.5
    heartbeat(r.tick(2.5), "P2")
    assert r.next_deadline() == 3.0
    r.tick(3.0)
    assert r.loads() == ["c"]
    assert r.next_deadline() == 3.5


def test_a_tick_at_next_deadline_always_moves_it() -> None:
    # Resend due at 0.4 + 1.0 == 1.4; but 1.4 - 0.4 == 0.9999999999999999 < resend_after.
    r = make()
    confirming(r, t=0.4)
    deadline = r.next_deadline()
    assert deadline == 1.4
    out = r.tick(deadline)
    assert kinds(out) == ["SendMessage"], "the resend due at next_deadline() did not happen"
    next_one = r.next_deadline()
    assert next_one is not None
    assert next_one > deadline


# -- connections -------------------------------------------------------------------------------
def test_a_lost_connection_forgets_its_confirmations() -> None:
    r = make()
    hb = confirming(r)
    r.peer_lost(E, 0.1)
    assert r.state("q") is ReadState.WAITING_PEER
    assert r.next_deadline() == 0.1 + T.peer_timeout
    # A late ack from the old connection: unmatched, confirms nothing.
    assert r.receive(E, ack(hb, "L", 4.0, HOLDER), 0.2) == []
    assert r.confirmed_bound(E, "L") == -math.inf
    assert r.take_counts()["acks_unmatched"] == 1
    hb2 = heartbeat(r.peer_ready(E, 0.3, incarnation=INC))
    assert hb2.seq != hb.seq
    assert r.receive(E, ack(hb, "L", 4.0, HOLDER), 0.35) == []  # still unmatched
    assert kinds(r.receive(E, ack(hb2, "L", 4.0, HOLDER), 0.4)) == ["PostRead"]


def test_a_lost_connection_leaves_posted_reads_to_their_transfers() -> None:
    r = make()
    posted(r)
    assert r.peer_lost(E, 1.0) == []
    assert r.state("q") is ReadState.POSTED
    assert r.next_deadline() == pytest.approx(3.96)  # its own bound
    assert r.confirmed_bound(E, "L") == -math.inf
    assert r.transfer_done("q", 2.0) == [LoadEnded(request_id="q", engine=E, state=ReadState.DONE)]


def test_a_failed_connection_fails_every_load_and_drops_queued_releases() -> None:
    r = make()
    posted(r, rid="p", lid="Lp")
    r.add("c", E, "Lc", 0.5, incarnation=INC)
    r.release(E, ["Lr"], 0.6)  # connected: sent at once
    r.peer_lost(E, 0.7)
    r.release(E, ["Lq"], 0.8)  # queued
    r.add("w", E, "Lw", 0.9)
    out = r.peer_failed(E, "handshake refused", 1.0)
    assert kinds(out) == ["StopRead", "LoadEnded", "LoadEnded", "LoadEnded"]
    assert out[0] == StopRead(request_id="p")
    assert {ended(out, rid).state for rid in ("p", "c", "w")} == {ReadState.FAILED}
    assert "handshake refused" in (ended(out, "w").reason or "")
    assert releases(r.peer_ready(E, 2.0, incarnation=INC)) == []
    assert r.take_counts()["releases_dropped"] == 1


def test_a_broken_read_is_read_once_more_on_a_new_connection() -> None:
    r = make()
    first = posted(r)
    out = r.transfer_failed("q", "link down", 1.0, peer_broken=True)
    assert out == [StopRead(request_id="q")]
    assert r.state("q") is ReadState.WAITING_PEER
    assert r.confirmed_bound(E, "L") == -math.inf
    assert r.heartbeat(E, ["L"], 1.1) == []  # not connected any more
    hb = heartbeat(r.peer_ready(E, 2.0, incarnation=INC))
    out = r.receive(E, ack(hb, "L", 4.0, HOLDER + 2.0), 2.1)
    assert kinds(out) == ["PostRead"]
    assert out[0] != first
    # Broken again: no third read.
    out = r.transfer_failed("q", "link down", 2.5, peer_broken=True)
    assert kinds(out)[:2] == ["StopRead", "LoadEnded"]
    assert ended(out).state is ReadState.FAILED
    assert r.take_counts()["reads_retried"] == 1


def test_a_ticket_of_another_instance_reconnects_first() -> None:
    r = make()
    r.peer_ready(E, 0.0, incarnation=INC)
    out = r.add("q", E, "L", 0.0, incarnation="inc-B")
    assert out == [Reconnect(engine=E, incarnation="inc-B")]
    assert r.state("q") is ReadState.WAITING_PEER
    r.peer_lost(E, 0.1)
    hb = heartbeat(r.peer_ready(E, 0.2, incarnation="inc-B"))
    assert r.state("q") is ReadState.CONFIRMING
    assert names(hb.handles) == ("L",)


def test_a_load_whose_holder_restarted_fails_on_the_new_connection() -> None:
    r = make()
    r.add("q", E, "L", 0.0, incarnation="inc-B")
    r.add("n", E, "N", 0.0)  # no incarnation in its ticket: not checked
    out = r.peer_ready(E, 0.5, incarnation=INC)
    assert ended(out, "q").state is ReadState.FAILED
    assert "restarted" in (ended(out, "q").reason or "")
    assert releases(out) == []
    assert r.state("n") is ReadState.CONFIRMING


def test_releases_are_queued_until_the_connection_is_ready() -> None:
    r = make()
    assert r.release(E, ["A", "B", "A"], 0.0) == []
    r.add("q", E, "L", 0.1)
    assert kinds(r.abort("q", 0.2)) == ["LoadEnded"]  # its release is queued too
    out = r.peer_ready(E, 1.0, incarnation=INC)
    assert releases(out) == ["A", "B", "L"]
    assert isinstance(out[0], SendMessage)
    assert r.release(E, ["C"], 1.1) != []  # connected: at once


# -- optimistic reads (READ posted beside the confirming heartbeat) -----------------------------
def test_an_optimistic_load_posts_before_its_heartbeat() -> None:
    """The READ goes in the same call as the heartbeat asking for its confirmation, before it
    (no notification pending to the holder when it is posted), its done notice held back for
    the worker to send once the READ is seen done (so it follows the heartbeat), whether the
    load arrives connected (add) or waits for the connection (peer_ready)."""
    r = make(optimistic=True)
    hb = early(r)
    assert r.state("q") is ReadState.POSTED
    r2 = make(optimistic=True)
    assert r2.add("q", E, "L", 0.0, incarnation=INC) == []  # waits for the connection
    out = r2.peer_ready(E, 0.5, incarnation=INC)
    assert kinds(out) == ["PostRead", "SendMessage"]
    post = out[0]
    assert isinstance(post, PostRead)
    assert post.notify_when_done
    assert post.notification.reason is wire.DoneReason.READ
    assert names(post.notification.handles) == ("L",)
    assert names(hb.handles) == ("L",)
    assert r.take_counts()["reads_posted_early"] == 1


def test_several_optimistic_loads_post_every_read_before_any_heartbeat() -> None:
    # Loads waiting for one connection: every READ first, then the heartbeat naming them all.
    r = make(optimistic=True)
    for i in range(3):
        assert r.add(f"q{i}", E, f"L{i}", 0.0, incarnation=INC) == []
    out = r.peer_ready(E, 0.5, incarnation=INC)
    assert kinds(out) == ["PostRead", "PostRead", "PostRead", "SendMessage"]
    assert all(isinstance(a, PostRead) and a.notify_when_done for a in out[:3])
    assert names(heartbeat(out).handles) == ("L0", "L1", "L2")


def test_a_confirmed_read_carries_its_notification_in_the_post() -> None:
    # Posted under a confirmed bound (after the ack): the transport sends the notice itself.
    r = make()
    post = posted(r)
    assert not post.notify_when_done
    r2 = make(optimistic=True)
    r2.peer_ready(E, 0.0, incarnation=INC)
    hb = heartbeat(r2.heartbeat(E, ["L"], 0.0))
    assert r2.receive(E, ack(hb, "L", 4.0, HOLDER + 0.1), 0.1) == []
    out = r2.add("q", E, "L", 0.2, incarnation=INC)
    assert kinds(out) == ["PostRead"]
    assert isinstance(out[0], PostRead)
    assert not out[0].notify_when_done


def test_an_optimistic_load_with_a_confirmed_bound_posts_as_usual() -> None:
    r = make(optimistic=True)
    r.peer_ready(E, 0.0, incarnation=INC)
    hb = heartbeat(r.heartbeat(E, ["L"], 0.0))  # the scheduler's early confirmation
    assert r.receive(E, ack(hb, "L", 4.0, HOLDER + 0.1), 0.1) == []
    assert kinds(r.add("q", E, "L", 0.2, incarnation=INC)) == ["PostRead"]  # no heartbeat
    assert r.transfer_done("q", 0.3) == [LoadEnded(request_id="q", engine=E, state=ReadState.DONE)]


def test_an_ack_before_the_optimistic_read_completes_confirms_it() -> None:
    r = make(optimistic=True)
    hb = early(r)
    assert r.receive(E, ack(hb, "L", 4.0, HOLDER + 0.1), 0.2) == []
    assert r.state("q") is ReadState.POSTED
    assert r.next_deadline() == pytest.approx(4.0 * (1 - DRIFT))  # the bound, as for any read
    out = r.transfer_done("q", 0.3)
    assert out == [LoadEnded(request_id="q", engine=E, state=ReadState.DONE)]  # no release


def test_an_optimistic_read_completed_first_waits_for_its_ack() -> None:
    r = make(optimistic=True)
    hb = early(r)
    assert r.transfer_done("q", 0.1) == []
    assert r.state("q") is ReadState.VERIFYING
    assert r.take_counts()["reads_verifying"] == 1
    with pytest.raises(InvalidTransitionError, match="only a posted load"):
        r.transfer_done("q", 0.2)  # reported once
    out = r.receive(E, ack(hb, "L", 4.0, HOLDER + 0.15), 0.2)
    assert out == [LoadEnded(request_id="q", engine=E, state=ReadState.DONE)]  # no release
    assert r.state("q") is None


def test_an_optimistic_read_completed_after_its_confirmed_bound_fails() -> None:
    """The only acknowledgement answers a heartbeat sent at 0 with 0.2 s left: the lease may
    have ended at 0.198, and the read was seen complete at 0.3."""
    r = make(optimistic=True)
    hb = early(r)
    assert r.transfer_done("q", 0.3) == []
    out = r.receive(E, ack(hb, "L", 0.2, HOLDER + 0.1), 0.4)
    assert kinds(out) == ["LoadEnded"]  # nothing to stop, no release: the READ consumed it
    assert ended(out).state is ReadState.FAILED
    assert "after the lease bound" in (ended(out).reason or "")


@pytest.mark.parametrize("why", list(wire.LostReason), ids=lambda w: w.name)
@pytest.mark.parametrize("completed", [False, True], ids=["in_flight", "completed"])
def test_an_optimistic_read_of_a_lease_the_holder_ended_is_never_trusted(
    why: wire.LostReason, completed: bool
) -> None:
    """A router retry of a ticket whose lease the holder already ended (its blocks may hold
    another request's KV now): the READ was posted before the holder answered. Whatever the
    reason, CONSUMED included (no acknowledgement came, so it is not our own READ's), the load
    fails with its blocks invalid, the READ stopped first if it is still in flight."""
    r = make(optimistic=True)
    early(r)
    if completed:
        assert r.transfer_done("q", 0.1) == []
    out = r.receive(E, lost("L", why), 0.2)
    assert ended(out).state is ReadState.FAILED
    if completed:
        assert kinds(out) == ["LoadEnded"]
    else:
        assert kinds(out) == ["StopRead", "LoadEnded"]
    assert releases(out) == []  # the holder knows: it said so
    # a late acknowledgement (a duplicate, a reordered answer) changes nothing
    assert r.state("q") is None


# -- proof from the holder's lease table ------------------------------------------------------
TAG = slot_tag(lease_handle("L"))


def test_a_verifying_read_is_done_when_the_lease_table_shows_its_tag() -> None:
    """The table READ, posted after the completion was seen (0.3), found the lease's tag: done
    at once, no release (the READ's own done notice ends the lease), and the acknowledgement
    that comes later changes nothing."""
    r = make(optimistic=True)
    hb = early(r)
    assert r.transfer_done("q", 0.3) == []
    out = r.lease_seen("q", TAG, 0.3, 0.35)
    assert out == [LoadEnded(request_id="q", engine=E, state=ReadState.DONE)]
    assert r.take_counts()["reads_proven_by_table"] == 1
    assert r.receive(E, ack(hb, "L", 4.0, HOLDER + 0.4), 0.5) == []
    assert r.state("q") is None


@pytest.mark.parametrize(
    ("found", "checked_at", "why"),
    [
        (0, 0.3, "an empty slot: the lease ended, or its holder has not entered it yet"),
        (TAG ^ 1, 0.3, "another lease's tag in the slot"),
        (TAG, 0.29, "a table READ posted before the completion was seen proves nothing"),
    ],
)
def test_anything_but_the_tag_read_after_the_completion_proves_nothing(
    found: int, checked_at: float, why: str
) -> None:
    r = make(optimistic=True)
    hb = early(r)
    assert r.transfer_done("q", 0.3) == []
    assert r.lease_seen("q", found, checked_at, 0.35) == [], why
    assert r.state("q") is ReadState.VERIFYING
    assert r.take_counts()["lease_checks_unproven"] == 1
    # the acknowledgement still decides, as without a table
    out = r.receive(E, ack(hb, "L", 4.0, HOLDER + 0.4), 0.5)
    assert out == [LoadEnded(request_id="q", engine=E, state=ReadState.DONE)]


def test_the_table_read_is_compared_with_the_callers_own_reading() -> None:
    """A worker reports the completion with a reading taken in its progress point, after an
    earlier call of the same point gave a later one (the reader's clock is clamped to that):
    a table READ posted at the completion's own reading still counts."""
    r = make(optimistic=True)
    early(r, rid="q")
    r.add("q2", E, "L2", 0.5, incarnation=INC)  # the reader's clock is now 0.5
    assert r.transfer_done("q", 0.4) == []  # clamped to 0.5
    out = r.lease_seen("q", TAG, 0.4, 0.4)
    assert out == [LoadEnded(request_id="q", engine=E, state=ReadState.DONE)]


def test_the_tag_proves_nothing_past_the_tickets_cap() -> None:
    """A kept turn's cap (the decoder's expiry on this clock) earlier than the completion:
    the table's answer does not lift it."""
    r = make(optimistic=True)
    early(r)
    assert r.cap("q", 10.0, 0.05) == []
    assert r.transfer_done("q", 0.3) == []
    assert r.cap("q", 0.25, 0.31) == []
    assert r.lease_seen("q", TAG, 0.3, 0.35) == []
    assert r.state("q") is ReadState.VERIFYING


def test_a_table_answer_for_a_load_not_verifying_is_ignored() -> None:
    r = make(optimistic=True)
    early(r)
    assert r.lease_seen("q", TAG, 0.2, 0.2) == []  # still posted: nothing completed yet
    assert r.state("q") is ReadState.POSTED
    assert r.lease_seen("gone", TAG, 0.2, 0.2) == []
    assert r.take_counts()["lease_checks_unused"] == 2
    with pytest.raises(LeaseError):
        r.lease_seen("q", TAG, math.nan, 0.2)


def test_consumed_after_an_ack_is_our_own_optimistic_read() -> None:
    r = make(optimistic=True)
    hb = early(r)
    assert r.receive(E, ack(hb, "L", 4.0, HOLDER + 0.1), 0.2) == []
    assert r.receive(E, lost("L", wire.LostReason.CONSUMED), 0.3) == []
    assert r.state("q") is ReadState.POSTED
    assert r.transfer_done("q", 0.4) == [LoadEnded(request_id="q", engine=E, state=ReadState.DONE)]


def test_an_unconfirmed_optimistic_read_resends_then_times_out() -> None:
    r = make(optimistic=True)
    early(r)
    assert r.next_deadline() == T.resend_after
    hb = heartbeat(r.tick(1.0))  # unanswered: sent again
    assert hb.sent_at == 1.0
    assert r.transfer_done("q", 1.5) == []  # VERIFYING: still resending
    assert r.next_deadline() == 2.0
    heartbeat(r.tick(2.0))
    out = r.tick(4.0)  # confirm_timeout
    assert ended(out).state is ReadState.FAILED
    assert "cannot be trusted" in (ended(out).reason or "")
    assert releases(out) == []  # the READ's own notice ended the lease, if it was live


def test_an_unconfirmed_optimistic_read_in_flight_times_out_and_stops() -> None:
    r = make(optimistic=True)
    early(r)
    for k in (1.0, 2.0, 3.0):
        heartbeat(r.tick(k))
    out = r.tick(4.0)
    assert kinds(out)[:2] == ["StopRead", "LoadEnded"]
    assert "did not confirm" in (ended(out).reason or "")
    assert releases(out) == ["L"]  # never landed: give the lease back


def test_an_ack_that_raced_a_lost_connection_does_not_verify() -> None:
    """The connection was replaced after the optimistic READ: the old heartbeat's answer no
    longer matches; the resent heartbeat's answer on the new connection does."""
    r = make(optimistic=True)
    hb = early(r)
    assert r.transfer_done("q", 0.1) == []
    r.peer_lost(E, 0.2)
    assert r.state("q") is ReadState.VERIFYING
    assert r.receive(E, ack(hb, "L", 4.0, HOLDER + 0.1), 0.3) == []  # unmatched now
    assert r.state("q") is ReadState.VERIFYING
    r.peer_ready(E, 0.5, incarnation=INC)
    again = heartbeat(r.tick(1.0))
    out = r.receive(E, ack(again, "L", 4.0, HOLDER + 1.1), 1.2)
    assert out == [LoadEnded(request_id="q", engine=E, state=ReadState.DONE)]


def test_abort_of_a_verifying_load_sends_nothing() -> None:
    r = make(optimistic=True)
    early(r)
    assert r.transfer_done("q", 0.1) == []
    out = r.abort("q", 0.2)
    assert kinds(out) == ["LoadEnded"]
    assert ended(out).state is ReadState.ABORTED


def test_a_load_can_refuse_optimism() -> None:
    r = make(optimistic=True)
    r.peer_ready(E, 0.0, incarnation=INC)
    out = r.add("q", E, "L", 0.0, incarnation=INC, optimistic=False)
    assert kinds(out) == ["SendMessage"]  # the heartbeat only
    assert r.state("q") is ReadState.CONFIRMING
    r2 = make()
    r2.peer_ready(E, 0.0, incarnation=INC)
    assert kinds(r2.add("q", E, "L", 0.0, incarnation=INC, optimistic=True)) == [
        "PostRead",
        "SendMessage",
    ]


def test_a_writer_never_posts_before_confirmation() -> None:
    r = make()  # optimistic is off by default (writers must keep it off)
    hb = confirming(r)
    assert r.state("q") is ReadState.CONFIRMING
    assert kinds(r.receive(E, ack(hb, "L", 4.0, HOLDER + 0.1), 0.2)) == ["PostRead"]


# -- aborts ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("state", "expected"),
    [
        (ReadState.WAITING_PEER, ["LoadEnded"]),  # the release waits for a connection
        (ReadState.CONFIRMING, ["LoadEnded", "SendMessage"]),
        (ReadState.POSTED, ["StopRead", "LoadEnded", "SendMessage"]),
    ],
)
def test_abort_stops_reports_then_releases(state: ReadState, expected: list[str]) -> None:
    r = make()
    if state is ReadState.WAITING_PEER:
        r.add("q", E, "L", 0.0)
    elif state is ReadState.CONFIRMING:
        confirming(r)
    else:
        posted(r)
    out = r.abort("q", 1.0)
    assert kinds(out) == expected
    assert ended(out) == LoadEnded(
        request_id="q", engine=E, state=ReadState.ABORTED, reason="aborted by the engine"
    )
    if state is ReadState.WAITING_PEER:
        assert releases(r.peer_ready(E, 2.0, incarnation=INC)) == ["L"]
    else:
        assert releases(out) == ["L"]
    assert r.abort("q", 2.0) == []  # ended: reported once already
    assert r.abort("never", 2.0) == []


# -- every (state x event) through the public API ----------------------------------------------
TRANSFER_EVENTS = {
    ReadEvent.TRANSFER_DONE,
    ReadEvent.TRANSFER_LATE,
    ReadEvent.TRANSFER_UNCONFIRMED,
    ReadEvent.TRANSFER_FAILED,
    ReadEvent.PEER_BROKEN,
}


def early(r: LeaseReader, t: float = 0.0, rid: str = "q", lid: str = "L") -> wire.Heartbeat:
    """Connect an optimistic reader, add load ``rid`` at ``t``: it posts the READ at once,
    then sends the heartbeat asking for the confirmation. Returns the heartbeat."""
    assert r.peer_ready(E, t, incarnation=INC) == []
    out = r.add(rid, E, lid, t, incarnation=INC)
    assert kinds(out) == ["PostRead", "SendMessage"], out
    assert r.state(rid) is ReadState.POSTED
    return heartbeat(out)


def reader_in(state: ReadState, *, optimistic: bool = False) -> tuple[LeaseReader, wire.Heartbeat]:
    """A reader whose load "q" (lease "L") is in ``state`` (or ended so) by t = 0.5; with
    ``optimistic`` (``POSTED`` or ``VERIFYING``), posted before any acknowledgement."""
    if optimistic or state is ReadState.VERIFYING:
        r = make(optimistic=True)
        hb = early(r)
        if state is ReadState.VERIFYING:
            assert r.transfer_done("q", 0.3) == []
        assert r.state("q") is state
        return r, hb
    r = make()
    hb = confirming(r)
    if state is ReadState.WAITING_PEER:
        r.peer_lost(E, 0.1)
    elif state is ReadState.POSTED:
        r.receive(E, ack(hb, "L", 4.0, HOLDER + 0.1), 0.25)  # bound 3.96
    elif state is ReadState.DONE:
        r.receive(E, ack(hb, "L", 4.0, HOLDER + 0.1), 0.25)
        r.transfer_done("q", 0.5)
    elif state is ReadState.FAILED:
        r.receive(E, lost("L"), 0.5)
    elif state is ReadState.ABORTED:
        r.abort("q", 0.5)
    assert r.state("q") is (None if state in READ_TRANSITIONS.terminal else state)
    return r, hb


def apply(r: LeaseReader, event: ReadEvent, hb: wire.Heartbeat) -> list[Action]:
    """Make ``event`` happen to load "q" the way a worker would report it, at t = 1 (or at its
    deadline for ``TIMEOUT``, after the bound for ``TRANSFER_LATE``)."""
    t = 1.0
    if event is ReadEvent.PEER_READY:
        return r.peer_ready(E, t, incarnation=INC)
    if event is ReadEvent.CONFIRMED:
        out = r.heartbeat(E, ["L"], t)
        beat = heartbeat(out) if out else hb
        return out + r.receive(E, ack(beat, "L", 4.0, HOLDER + t), t)
    if event is ReadEvent.CONFIRMED_LATE:
        # An answer to the first heartbeat (sent at 0) with a bound of 0.198: earlier than an
        # optimistic read seen complete at 0.3.
        return r.receive(E, ack(hb, "L", 0.2, HOLDER + 0.1), t)
    if event is ReadEvent.TRANSFER_UNCONFIRMED:
        return r.transfer_done("q", t)
    if event is ReadEvent.PEER_LOST:
        return r.peer_lost(E, t)
    if event is ReadEvent.LOST:
        return r.receive(E, lost("L"), t)
    if event is ReadEvent.PEER_FAILED:
        return r.peer_failed(E, "refused", t)
    if event is ReadEvent.PEER_BROKEN:
        return r.transfer_failed("q", "link down", t, peer_broken=True)
    if event is ReadEvent.TRANSFER_DONE:
        return r.transfer_done("q", t)
    if event is ReadEvent.TRANSFER_LATE:
        return r.transfer_done("q", 3.96)  # the bound passed; no tick came
    if event is ReadEvent.TRANSFER_FAILED:
        return r.transfer_failed("q", "boom", t)
    if event is ReadEvent.ABORT:
        return r.abort("q", t)
    if event is ReadEvent.SEEN_LIVE:
        return r.lease_seen("q", slot_tag(lease_handle("L")), t, t)
    assert event is ReadEvent.TIMEOUT
    return r.tick(20.0)  # later than any deadline of any state


def snapshot(r: LeaseReader) -> tuple[object, ...]:
    return (
        r.loads(),
        r.state("q"),
        r.next_deadline(),
        r.confirmed_bound(E, "L"),
        len(r),
        r.engine_busy(E),
    )


@pytest.mark.parametrize("event", list(ReadEvent), ids=lambda e: e.value)
@pytest.mark.parametrize("state", list(ReadState), ids=lambda s: s.value)
def test_every_state_and_event_through_the_api(state: ReadState, event: ReadEvent) -> None:
    """A legal pair lands where READ_TRANSITIONS says (so every listed step is taken by the
    machine); an illegal one raises and changes nothing (a transfer reported for a load that
    is not posted) or is a race the reader ignores (the load stays where it was); an ended load
    is never reported again."""
    if event is ReadEvent.POST_EARLY:
        # Taken only inside peer_ready or add of an optimistic reader (the load passes
        # through confirming in that one call): test_an_optimistic_load_posts_after_its_heartbeat.
        assert READ_TRANSITIONS.legal(state, event) is (state is ReadState.CONFIRMING)
        return
    optimistic = state is ReadState.POSTED and event is ReadEvent.TRANSFER_UNCONFIRMED
    r, hb = reader_in(state, optimistic=optimistic)
    before = snapshot(r)
    if event in TRANSFER_EVENTS and state is not ReadState.POSTED:
        with pytest.raises(InvalidTransitionError, match="only a posted load"):
            apply(r, event, hb)
        assert snapshot(r) == before
        return
    out = apply(r, event, hb)
    ends = [a for a in out if isinstance(a, LoadEnded) and a.request_id == "q"]
    assert len(ends) <= 1
    if state in READ_TRANSITIONS.terminal:
        assert ends == []
        assert r.state("q") is None
        assert not any(isinstance(a, StopRead | PostRead) for a in out)
        return
    after = ends[0].state if ends else r.state("q")
    if READ_TRANSITIONS.legal(state, event):
        assert after is READ_TRANSITIONS.next(state, event)
        if state is ReadState.POSTED and after not in (ReadState.DONE, ReadState.VERIFYING):
            assert StopRead(request_id="q") in out  # stopped, before it is reported
            if ends:
                assert out.index(StopRead(request_id="q")) < out.index(ends[0])
    else:
        assert after is state
        assert ends == []
        assert not any(isinstance(a, StopRead) for a in out)


def test_the_api_walk_covers_every_step() -> None:
    reachable = {
        ReadState.WAITING_PEER,
        ReadState.CONFIRMING,
        ReadState.POSTED,
        ReadState.VERIFYING,
    }
    steps = {(s.source, s.event) for s in READ_TRANSITIONS.steps}
    assert {s for s, _ in steps} <= reachable
    assert len(steps) == len(READ_TRANSITIONS.steps) == 28


def test_transfer_reports_for_unknown_loads_raise() -> None:
    r = make()
    with pytest.raises(InvalidTransitionError, match="ended or unknown"):
        r.transfer_done("nope", 0.0)
    with pytest.raises(InvalidTransitionError, match="ended or unknown"):
        r.transfer_failed("nope", "boom", 0.0)


def test_an_illegal_report_does_not_move_the_readers_clock() -> None:
    """Illegal input must leave the reader unchanged, its clock included (as LeaseTable does:
    it checks the transition before it advances its clock)."""
    r = make()
    r.add("q", E, "L", 0.0)  # waits for a connection until 3.0
    with pytest.raises(InvalidTransitionError):
        r.transfer_done("q", 100.0)
    assert r.tick(1.0) == [], "the refused transfer_done(now=100) advanced the clock to 100"


# -- inspection --------------------------------------------------------------------------------
def test_inspection() -> None:
    r = make()
    posted(r, rid="p", lid="Lp")
    r.add("w", "P2", "Lw", 0.5)
    assert len(r) == 2
    assert r.loads() == ["p", "w"]
    assert r.loads(ReadState.POSTED) == ["p"]
    assert r.loads(ReadState.WAITING_PEER) == ["w"]
    assert r.state("nope") is None
    assert r.engine_busy(E)
    assert r.engine_busy("P2")
    assert not r.engine_busy("P3")
    assert r.confirmed_bound("P3", "x") == -math.inf
    counts = r.take_counts()
    assert counts["acks"] == 1
    assert counts["urgent_heartbeats"] == 1
    assert r.take_counts() == {}
