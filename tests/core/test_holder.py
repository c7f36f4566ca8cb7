"""LeaseHolder on explicit clock readings: renewals, acknowledgements, loss notices, claims.

Readers are played by hand here (their heartbeats and lease-done notices built from the wire
types); ``test_pd_network.py`` drives the holder against real readers.
"""

from __future__ import annotations

import math

import pytest

from kvframe.core import wire
from kvframe.core.holder import HolderCounters, HolderOutput, LeaseHolder
from kvframe.core.lease import LeasePolicy, LeaseState, lease_handle
from kvframe.errors import InvalidTransitionError, LeaseError

POLICY = LeasePolicy.from_duration(6.0)  # duration 6, interval 1, extension 4


def make() -> LeaseHolder[str]:
    return LeaseHolder(POLICY, max_drift=0.0)


NAME: dict[int, str] = {}  # handle -> the lease id a test named it by


def H(lid: str) -> int:
    """The wire handle of lease ``lid`` (remembered, to name the replies' handles)."""
    NAME[lease_handle(lid)] = lid
    return lease_handle(lid)


def beat(seq: int, sent_at: float, *ids: str) -> wire.Heartbeat:
    return wire.Heartbeat(seq=seq, sent_at=sent_at, handles=[H(i) for i in ids])


def done(seq: int, reason: wire.DoneReason, *ids: str) -> wire.LeaseDone:
    return wire.LeaseDone(seq=seq, sent_at=0.0, reason=reason, handles=[H(i) for i in ids])


def merged(*outs: HolderOutput[str]) -> HolderOutput[str]:
    """Several calls' outputs as one (one done notice per reason on the wire)."""
    return HolderOutput(
        replies=tuple(m for o in outs for m in o.replies),
        ended=tuple(x for o in outs for x in o.ended),
    )


READ = wire.DoneReason.READ
RELEASED = wire.DoneReason.RELEASED


def acked(out: HolderOutput[str]) -> dict[str, float]:
    return {
        NAME[h]: m.expiry for m in out.replies if isinstance(m, wire.LeaseAck) for h in m.handles
    }


def lost(out: HolderOutput[str]) -> dict[str, wire.LostReason]:
    return {
        NAME[h]: m.reason for m in out.replies if isinstance(m, wire.LeaseLost) for h in m.handles
    }


def ended(out: HolderOutput[str]) -> dict[str, LeaseState]:
    return {lease.request_id: lease.state for lease in out.ended}


# -- heartbeats --------------------------------------------------------------------------------
def test_a_heartbeat_renews_and_is_acknowledged_with_the_holders_clock() -> None:
    h = make()
    h.grant("L", 100.0, "blocks")
    # The reader's clock is 10,000 s behind; the first message seeds the mapping.
    out = h.receive("D1", beat(7, -9_899.0, "L"), 101.0)
    assert out.replies == (
        wire.LeaseAck(echo_seq=7, holder_now=101.0, expiry=106.0, handles=[H("L")]),
    )
    assert out.ended == ()
    # Sent 2 s later on the reader's clock, delayed 1.5 s more than the first: renewed as of
    # its send time (103), not its arrival (104.5).
    out = h.receive("D1", beat(8, -9_897.0, "L"), 104.5)
    assert acked(out) == {"L": 107.0}
    assert h.claimant("L") == "D1"
    assert h.table.lease("L").renewals == 2  # type: ignore[union-attr]


def test_a_heartbeat_answers_acks_before_loss_notices() -> None:
    h = make()
    for lid in ("live", "used", "gone", "due"):
        h.grant(lid, 0.0, lid)
    h.receive("D1", done(1, READ, "used"), 0.5)
    h.receive("D1", done(1, RELEASED, "gone"), 0.5)
    h.table.renew(["live"], 5.0)  # keep one lease past the others' expiry (6.0)
    out = h.receive("D1", beat(2, 6.0, "live", "used", "gone", "due", "never"), 6.0)
    # The ack first, then one loss notice per reason, in reason order.
    assert [type(m).__name__ for m in out.replies] == ["LeaseAck", *["LeaseLost"] * 4]
    assert [m.reason for m in out.replies[1:]] == sorted(  # type: ignore[union-attr]
        [
            wire.LostReason.UNKNOWN,
            wire.LostReason.CONSUMED,
            wire.LostReason.ABORTED,
            wire.LostReason.EXPIRED,
        ]
    )
    assert acked(out) == {"live": 10.0}
    assert lost(out) == {
        "used": wire.LostReason.CONSUMED,
        "gone": wire.LostReason.ABORTED,
        "due": wire.LostReason.EXPIRED,  # due but not reaped yet: never revived
        "never": wire.LostReason.UNKNOWN,
    }
    assert all(m.echo_seq == 2 and m.holder_now == 6.0 for m in out.replies)  # type: ignore[union-attr]
    out = h.expire(6.0)
    assert ended(out) == {"due": LeaseState.EXPIRED}
    out = h.receive("D1", beat(3, 6.5, "due"), 6.5)
    assert lost(out) == {"due": wire.LostReason.EXPIRED}


def test_a_heartbeat_sent_too_long_ago_renews_nothing_and_is_not_answered() -> None:
    h = make()
    h.receive("D1", beat(1, 0.0, "nothing-yet"), 0.0)  # seeds the mapping: no delay
    h.grant("L", 8.0, "blocks")  # expires at 14
    out = h.receive("D1", beat(2, 1.0, "L"), 10.0)  # sent at 1, 1 + 4 <= 10: stale
    assert out == HolderOutput()
    assert h.table.lease("L").expiry == 14.0  # type: ignore[union-attr]
    assert h.claimant("L") is None
    assert h.counters.ids_ignored == 2  # "nothing-yet" (unknown) and "L" (stale)


def test_an_older_heartbeat_than_one_accepted_extends_nothing() -> None:
    h = make()
    h.grant("L", 0.0, "blocks")
    h.receive("D1", beat(4, 0.0, "seed"), 0.0)
    assert acked(h.receive("D1", beat(5, 3.0, "L"), 3.0)) == {"L": 7.0}
    out = h.receive("D1", beat(3, 2.5, "L"), 3.1)  # reordered: sent before seq 5
    assert acked(out) in ({}, {"L": 7.0})  # dropped, or answered with the expiry it has
    assert lost(out) == {}
    assert h.table.lease("L").expiry == 7.0  # type: ignore[union-attr]
    assert h.counters.heartbeats_stale == 1
    assert h.take_counts() == {"heartbeats_stale": 1}
    assert h.take_counts() == {}
    # The same sequence number again (a batch split in two) is accepted.
    assert acked(h.receive("D1", beat(5, 3.2, "L"), 3.2)) == {"L": 7.2}
    # Sequence numbers of different readers are independent.
    h.grant("M", 3.2, "m")
    assert acked(h.receive("D2", beat(1, 3.3, "M"), 3.3)) == {"M": 9.2}


def test_a_reconnected_reader_starts_its_sequence_again_and_keeps_its_claims() -> None:
    h = make()
    h.grant("L", 0.0, "blocks")
    h.receive("D1", beat(100, 0.0, "L"), 0.0)
    h.connected("D1")
    assert h.claimant("L") == "D1"
    assert acked(h.receive("D1", beat(1, 1.0, "L"), 1.0)) == {"L": 6.0}


def test_a_heartbeat_that_sat_out_of_order_still_renews_what_only_it_names() -> None:
    """Transports may deliver notifications out of order (``ordered_notifications=False``),
    and a reader's urgent heartbeat (one lease to confirm) can overtake the scheduler's batch
    (every lease it keeps) sent just before it. Dropping the batch because its sequence number
    is older starves the leases only it names: here every batch arrives 0.3 s after it was
    sent (well within a heartbeat interval) and lease "b" expires anyway. Renewing as of the
    batch's own send time would be as safe (a stale one extends nothing)."""
    h = make()
    h.grant("a", 0.0, "a")
    h.grant("b", 0.0, "b")
    seq = 0
    for k in range(8):
        t = float(k)
        urgent = beat(seq + 2, t + 0.1, "a")
        batch = beat(seq + 1, t, "a", "b")
        seq += 2
        h.receive("D1", urgent, t + 0.2)
        h.receive("D1", batch, t + 0.3)
        assert "b" not in ended(h.expire(t + 0.3)), (
            f"lease b expired at {t + 0.3} though the reader heartbeat it every second"
        )


# -- lease done --------------------------------------------------------------------------------
def test_lease_done_consumes_or_aborts_and_frees_once() -> None:
    h = make()
    h.grant("r", 0.0, "r-blocks")
    h.grant("x", 0.0, "x-blocks")
    out = merged(
        h.receive("D1", done(1, READ, "r"), 1.0), h.receive("D1", done(1, RELEASED, "x"), 1.0)
    )
    assert ended(out) == {"r": LeaseState.CONSUMED, "x": LeaseState.ABORTED}
    assert [lease.payload for lease in out.ended] == ["r-blocks", "x-blocks"]
    assert out.replies == ()
    assert h.live_count == 0
    assert h.next_deadline() is None
    # Again (a duplicated notice): nothing ends twice; the reader is told why.
    out = merged(
        h.receive("D1", done(2, READ, "r", "n"), 1.5), h.receive("D1", done(2, RELEASED, "x"), 1.5)
    )
    assert out.ended == ()
    assert lost(out) == {
        "r": wire.LostReason.CONSUMED,
        "x": wire.LostReason.ABORTED,
        "n": wire.LostReason.UNKNOWN,
    }
    assert h.take_counts() == {"done_for_unknown_lease": 3}


def test_a_lease_past_its_expiry_but_not_reaped_is_still_consumed() -> None:
    h = make()
    h.grant("L", 0.0, "blocks")
    out = h.receive("D1", done(1, READ, "L"), 7.0)
    assert ended(out) == {"L": LeaseState.CONSUMED}
    assert h.expire(7.0).ended == ()


# -- claims ------------------------------------------------------------------------------------
def test_the_first_reader_claims_a_lease_and_no_other_can_renew_or_end_it() -> None:
    h = make()
    h.grant("L", 0.0, "blocks")
    assert acked(h.receive("D1", beat(1, 0.0, "L"), 0.5)) == {"L": 6.0}  # grant expiry kept
    assert h.claimant("L") == "D1"
    out = h.receive("D2", beat(1, 1.0, "L"), 1.0)
    assert out.replies == (
        wire.LeaseLost(
            echo_seq=1, holder_now=1.0, reason=wire.LostReason.CLAIMED, handles=[H("L")]
        ),
    )
    for reason in (READ, RELEASED):
        out = h.receive("D2", done(2, reason, "L"), 2.0)
        assert out.ended == ()
        assert lost(out) == {"L": wire.LostReason.CLAIMED}
    assert h.table.lease("L").expiry == 6.0  # type: ignore[union-attr]
    assert h.table.state("L") is LeaseState.LIVE
    assert h.counters == HolderCounters(
        heartbeats=2, heartbeats_stale=0, ids_ignored=1, claimed_elsewhere=3, done_unknown=0
    )
    assert h.take_counts() == {"claimed_elsewhere": 3}
    out = h.receive("D1", done(3, READ, "L"), 3.0)
    assert ended(out) == {"L": LeaseState.CONSUMED}
    assert h.claimant("L") is None
    assert lost(h.receive("D2", beat(2, 3.5, "L"), 3.5)) == {"L": wire.LostReason.CONSUMED}


def test_an_unclaimed_lease_is_ended_by_any_reader() -> None:
    h = make()
    h.grant("L", 0.0, "blocks")
    assert h.claimant("L") is None
    assert ended(h.receive("D2", done(1, RELEASED, "L"), 0.5)) == {"L": LeaseState.ABORTED}


def test_a_heartbeat_that_renews_nothing_claims_nothing() -> None:
    h = make()
    h.grant("L", 0.0, "blocks")
    h.receive("D1", beat(1, 0.0, "seed"), 0.0)
    assert h.receive("D1", beat(2, 1.0, "L"), 5.5) == HolderOutput()  # stale (1 + 4 <= 5.5)
    assert h.claimant("L") is None
    assert acked(h.receive("D2", beat(1, 5.6, "L"), 5.6)) == {"L": 9.6}
    assert h.claimant("L") == "D2"


def test_expiry_reclaims_and_drops_the_claim() -> None:
    h = make()
    h.grant("L", 0.0, "blocks")
    h.receive("D1", beat(1, 0.0, "L"), 0.0)
    assert h.next_deadline() == 6.0
    assert h.expire(5.99).ended == ()
    out = h.expire(6.0)
    assert ended(out) == {"L": LeaseState.EXPIRED}
    assert out.replies == ()
    assert h.claimant("L") is None
    assert h.expire(7.0).ended == ()
    assert lost(h.receive("D2", beat(1, 7.0, "L"), 7.0)) == {"L": wire.LostReason.EXPIRED}


def test_the_holder_aborts_a_live_lease_once() -> None:
    h = make()
    h.grant("L", 0.0, "blocks")
    h.receive("D1", beat(1, 0.0, "L"), 0.0)
    assert ended(h.abort("L", 1.0)) == {"L": LeaseState.ABORTED}
    assert h.claimant("L") is None
    assert h.abort("L", 2.0) == HolderOutput()
    assert h.abort("never", 2.0) == HolderOutput()


# -- inputs it refuses or ignores --------------------------------------------------------------
def test_messages_sent_the_wrong_way_are_ignored() -> None:
    h = make()
    h.grant("L", 0.0, "blocks")
    ack = wire.LeaseAck(echo_seq=1, holder_now=0.0, expiry=100.0, handles=[H("L")])
    notice = wire.LeaseLost(
        echo_seq=1, holder_now=0.0, reason=wire.LostReason.UNKNOWN, handles=[H("L")]
    )
    assert h.receive("D1", ack, 1.0) == HolderOutput()
    assert h.receive("D1", notice, 1.0) == HolderOutput()
    assert h.table.lease("L").expiry == 6.0  # type: ignore[union-attr]


def test_grant_refuses_a_used_lease_id() -> None:
    h = make()
    h.grant("L", 0.0, "blocks")
    h.receive("D1", done(1, READ, "L"), 0.5)
    with pytest.raises(InvalidTransitionError):
        h.grant("L", 1.0, "again")
    assert h.live_count == 0


@pytest.mark.parametrize("message", ["heartbeat", "done"])
def test_a_time_that_is_not_finite_raises_and_changes_nothing(message: str) -> None:
    h = make()
    h.grant("L", 0.0, "blocks")
    h.grant("M", 0.0, "blocks")
    h.receive("D1", beat(1, 0.0, "L", "M"), 0.0)
    before = (h.claimant("L"), h.claimant("M"), h.table.lease("L"), h.table.lease("M"))
    msg: wire.Message = beat(2, 0.5, "L", "M") if message == "heartbeat" else done(2, READ, "L")
    with pytest.raises(LeaseError):
        h.receive("D1", msg, math.nan)
    after = (h.claimant("L"), h.claimant("M"), h.table.lease("L"), h.table.lease("M"))
    assert after == before, "a refused call dropped a claim: another reader can now take it"


# -- reader groups (heterogeneous tensor parallelism) ------------------------------------------
def grouped() -> LeaseHolder[str]:
    """A holder read by decode engine D's ranks 0 and 2 (peers D.0, D.2: members 0 and 1 of
    group D), as P rank 0 at TP 2 is by D at TP 4."""
    h = make()
    h.join("D.0", "D", 0, 2)
    h.join("D.2", "D", 1, 2)
    return h


def test_a_group_lease_ends_only_when_every_member_reported() -> None:
    h = grouped()
    h.grant("L", 0.0, "blocks")
    assert acked(h.receive("D.0", beat(1, 0.0, "L"), 0.1)) == {"L": 6.0}
    assert h.claimant("L") == "D"
    # The other member renews the group's lease (not CLAIMED) and gets its own ack.
    assert acked(h.receive("D.2", beat(1, 1.0, "L"), 1.1)) == {"L": 6.0}
    out = h.receive("D.0", done(2, READ, "L"), 2.0)
    assert out == HolderOutput()  # member 1 may still be reading: nothing freed
    assert h.table.state("L") is LeaseState.LIVE
    assert h.reported("L") == (0,)
    assert acked(h.receive("D.2", beat(2, 3.0, "L"), 3.0)) == {"L": 7.0}
    out = h.receive("D.2", done(3, READ, "L"), 3.5)
    assert ended(out) == {"L": LeaseState.CONSUMED}
    assert h.claimant("L") is None
    assert h.reported("L") == ()


def test_a_group_lease_one_member_released_is_aborted_at_the_last_report() -> None:
    h = grouped()
    h.grant("L", 0.0, "blocks")
    h.receive("D.2", beat(1, 0.0, "L"), 0.0)
    assert h.receive("D.2", done(2, RELEASED, "L"), 0.5).ended == ()
    assert ended(h.receive("D.0", done(1, READ, "L"), 1.0)) == {"L": LeaseState.ABORTED}


def test_a_member_reporting_twice_does_not_end_the_group_lease() -> None:
    """A member that read again on a new connection (a new peer name, same member id) and
    reported twice still counts once: the other member's read is not cut short."""
    h = grouped()
    h.grant("L", 0.0, "blocks")
    h.receive("D.0", beat(1, 0.0, "L"), 0.0)
    assert h.receive("D.0", done(2, READ, "L"), 0.5).ended == ()
    h.join("D.0'", "D", 0, 2)  # member 0 reconnected under a new peer name
    h.leave("D.0")
    assert h.receive("D.0'", done(1, READ, "L"), 1.0).ended == ()
    assert h.table.state("L") is LeaseState.LIVE
    assert ended(h.receive("D.2", done(1, READ, "L"), 1.5)) == {"L": LeaseState.CONSUMED}


def test_another_engine_cannot_renew_or_end_a_group_lease() -> None:
    h = grouped()
    h.join("E.0", "E", 0, 2)
    h.grant("L", 0.0, "blocks")
    h.receive("D.0", beat(1, 0.0, "L"), 0.0)
    assert lost(h.receive("E.0", beat(1, 0.5, "L"), 0.5)) == {"L": wire.LostReason.CLAIMED}
    assert lost(h.receive("E.0", done(2, READ, "L"), 0.6)) == {"L": wire.LostReason.CLAIMED}
    assert lost(h.receive("solo", done(1, READ, "L"), 0.7)) == {"L": wire.LostReason.CLAIMED}
    assert h.reported("L") == ()
    assert h.claimed_by("D.2") == ("L",)  # any member names the group's claims


def test_a_group_lease_still_expires_and_engine_gone_aborts_it() -> None:
    h = grouped()
    h.grant("L", 0.0, "blocks")
    h.grant("M", 0.0, "blocks")
    h.receive("D.0", beat(1, 0.0, "L", "M"), 0.0)
    h.receive("D.0", done(2, READ, "L", "M"), 0.5)  # member 1 never reports
    assert ended(h.expire(6.0)) == {"L": LeaseState.EXPIRED, "M": LeaseState.EXPIRED}
    assert h.reported("L") == ()
    h.grant("N", 7.0, "blocks")
    h.receive("D.2", beat(2, 7.0, "N"), 7.0)
    assert ended(h.abort_claims("D.0", 7.5)) == {"N": LeaseState.ABORTED}


def test_join_refuses_bad_membership() -> None:
    h = make()
    with pytest.raises(ValueError, match="members = 0"):
        h.join("D.0", "D", 0, 0)
    with pytest.raises(ValueError, match="member = 2"):
        h.join("D.0", "D", 2, 2)
    with pytest.raises(ValueError, match="group = ''"):
        h.join("D.0", "", 0, 1)
    assert h.group_of("D.0") == "D.0"


# -- leases meant for a decode engine ----------------------------------------------------------
def test_a_gone_engines_unclaimed_leases_end_at_once_and_claimed_ones_follow_the_claim() -> None:
    h = make()
    h.grant("A", 0.0, "a", engine="E")  # meant for E, never claimed
    h.grant("B", 0.0, "b", engine="E")  # meant for E, claimed by F's reader (a router retry)
    h.grant("C", 0.0, "c", engine="F")  # meant for F
    h.grant("N", 0.0, "n")  # meant for nobody named
    h.receive("F.0", beat(1, 0.0, "B"), 0.0)
    assert (h.meant_for("A"), h.meant_for("N"), h.meant_count) == ("E", None, 3)
    out = h.abort_unclaimed_for("E", 1.0)
    assert ended(out) == {"A": LeaseState.ABORTED}
    assert out.replies == ()
    assert h.live_count == 3
    assert h.claimant("B") == "F.0"
    assert h.meant_for("A") is None
    # A reader that names the aborted lease later is told so and cannot claim it.
    assert lost(h.receive("E.0", beat(1, 1.5, "A"), 1.5)) == {"A": wire.LostReason.ABORTED}
    assert lost(h.receive("G.0", beat(1, 1.5, "A"), 1.5)) == {"A": wire.LostReason.ABORTED}
    assert h.claimant("A") is None
    # Nothing more for E; an engine nobody named changes nothing.
    assert ended(h.abort_unclaimed_for("E", 2.0)) == {}
    assert ended(h.abort_unclaimed_for("nobody", 2.0)) == {}
    assert ended(h.abort_unclaimed_for("F", 2.0)) == {"C": LeaseState.ABORTED}


def test_the_intended_engine_is_forgotten_when_the_lease_ends_by_any_path() -> None:
    h = make()
    for lid in ("X", "A", "R", "C"):
        h.grant(lid, 0.0, lid, engine="E")
    assert h.meant_count == 4
    h.abort("A", 0.1)
    h.receive("E.0", done(1, RELEASED, "R"), 0.2)
    h.receive("E.0", beat(2, 0.3, "C"), 0.3)
    h.receive("E.0", done(3, READ, "C"), 0.4)
    assert (h.meant_count, h.meant_for("X")) == (1, "E")
    assert ended(h.expire(POLICY.duration)) == {"X": LeaseState.EXPIRED}
    assert h.meant_count == 0
    assert ended(h.abort_unclaimed_for("E", 10.0)) == {}


@pytest.mark.parametrize("bad", ["", 7, b"E"])
def test_grant_refuses_a_bad_engine_and_changes_nothing(bad: object) -> None:
    h = make()
    with pytest.raises(ValueError, match="engine = "):
        h.grant("L", 0.0, "blocks", engine=bad)  # type: ignore[arg-type]
    assert (h.live_count, h.meant_count) == (0, 0)
    h.grant("L", 0.0, "blocks", engine="E")  # the id was not used up
    assert h.meant_for("L") == "E"


def test_abort_unclaimed_for_refuses_a_time_that_is_not_finite() -> None:
    h = make()
    h.grant("L", 0.0, "blocks", engine="E")
    with pytest.raises(LeaseError):
        h.abort_unclaimed_for("E", math.nan)
    assert h.live_count == 1
