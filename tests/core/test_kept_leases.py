"""Kept leases (bidirectional mode): properties of ``LeaseHolder.keep``/``evict`` and
``LeaseTable.grant(ttl=)``/``restart``, and a state machine mixing them with ordinary leases,
some granted for a named decode engine and ended by ``abort_unclaimed_for`` when it is gone.

A kept lease lives ``ttl`` seconds with no heartbeat; the first fresh heartbeat naming it
claims it for its reader and restarts it as an ordinary lease (``sent + extension``, earlier
or later than the ttl's end); a heartbeat after the ttl's end renews nothing (``EXPIRED``); a
stale one neither claims nor restarts; ``evict`` ends an unclaimed one at once (``ABORTED``)
and revokes a claimed one. Every time here is a multiple of 1/64 s and every clock offset an
integer, so the holder's arithmetic is exact and the model can demand equality.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import pytest
from hypothesis import Phase, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvframe.core import wire
from kvframe.core.holder import HolderOutput, LeaseHolder
from kvframe.core.lease import LeasePolicy, LeaseState, LeaseTable
from kvframe.errors import InvalidTransitionError, LeaseError
from tests.core.test_holder import NAME, H, acked, ended, lost

POLICY = LeasePolicy.from_duration(6.0)  # duration 6, interval 1, extension 4
EXT = POLICY.extension
OFF = {"R1": 1000.0, "R2": -5000.0}  # reader clock minus holder clock (exact)
READ = wire.DoneReason.READ
RELEASED = wire.DoneReason.RELEASED


def ticks(lo: int, hi: int) -> st.SearchStrategy[float]:
    """Seconds in [lo/64, hi/64], multiples of 1/64 (exact in binary floating point)."""
    return st.integers(min_value=lo, max_value=hi).map(lambda k: k / 64)


TTL = ticks(1, 64 * 20)
# The focused properties are cheap but numerous: at most this many examples each.
FOCUSED = settings(max_examples=min(settings().max_examples, 150))
GAP = ticks(0, 64 * 8)


class Reader:
    """A hand-played reader: numbers its heartbeats, stamps its own clock, and computes the
    confirmed bounds a LeaseReader would from the acks it gets (no drift allowed: the holder
    maps with ``max_drift=0``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.seq = 0
        self.sent: dict[int, float] = {}  # seq -> send time, reader's clock
        self.bounds: dict[str, float] = {}  # lease id -> confirmed bound, reader's clock

    def beat(self, true_now: float, *lids: str) -> wire.Heartbeat:
        self.seq += 1
        self.sent[self.seq] = true_now + OFF[self.name]
        return wire.Heartbeat(
            seq=self.seq, sent_at=true_now + OFF[self.name], handles=[H(x) for x in lids]
        )

    def done(self, reason: wire.DoneReason, *lids: str) -> wire.LeaseDone:
        self.seq += 1
        return wire.LeaseDone(
            seq=self.seq, sent_at=0.0, reason=reason, handles=[H(x) for x in lids]
        )

    def take(self, out: HolderOutput[str]) -> None:
        """The holder's replies reach this reader: raise its bounds as the reader does."""
        for m in out.replies:
            if isinstance(m, wire.LeaseAck):
                remaining = m.expiry - m.holder_now
                for h in m.handles:
                    lid = NAME[h]
                    bound = self.sent[m.echo_seq] + remaining
                    self.bounds[lid] = max(self.bounds.get(lid, -math.inf), bound)

    def bound_on_holder_clock(self, lid: str) -> float:
        return self.bounds.get(lid, -math.inf) - OFF[self.name]


def holder_with_mapping(*readers: Reader) -> LeaseHolder[str]:
    """A holder whose send-time mapping of each reader is exact: one heartbeat (naming an
    unknown lease) crossed with zero transit at holder time 0."""
    h: LeaseHolder[str] = LeaseHolder(POLICY, max_drift=0.0)
    for r in readers:
        out = h.receive(r.name, r.beat(0.0, "X"), 0.0)
        assert lost(out) == {"X": wire.LostReason.UNKNOWN}
        assert acked(out) == {}
    return h


# -- focused properties ------------------------------------------------------------------------
@FOCUSED
@given(
    t0=ticks(0, 64 * 1000),
    ttl=TTL,
    probes=st.lists(ticks(0, 64 * 30), max_size=6),
    hit=st.booleans(),
)
def test_an_unheartbeated_kept_lease_ends_exactly_at_its_ttl(
    t0: float, ttl: float, probes: list[float], hit: bool
) -> None:
    h: LeaseHolder[str] = LeaseHolder(POLICY, max_drift=0.0)
    lease = h.keep("K", t0, "blocks", ttl)
    end = t0 + ttl
    assert (lease.state, lease.expiry, lease.granted_at) == (LeaseState.LIVE, end, t0)
    assert h.kept("K")
    assert h.kept_count == 1
    assert h.claimant("K") is None
    assert h.next_deadline() == end
    times = sorted({t0 + p for p in probes} | ({end} if hit else set()))
    ends = 0
    for t in times:
        out = h.expire(t)
        if t < end:
            assert out.ended == ()
            assert h.kept("K")
        else:
            ends += len(out.ended)
            if out.ended:
                (x,) = out.ended
                assert (x.request_id, x.state, x.expiry, x.payload) == (
                    "K",
                    LeaseState.EXPIRED,
                    end,
                    "blocks",
                )
    assert ends == (1 if times and times[-1] >= end else 0)
    assert h.kept("K") == (ends == 0)
    assert h.kept_count == (1 if ends == 0 else 0)


@FOCUSED
@given(
    ttl=TTL,
    sent=ticks(0, 64 * 24),
    transit=ticks(0, 64 * 6),
    later=st.lists(st.tuples(GAP, ticks(0, 64 * 6)), max_size=4),
)
def test_the_first_fresh_heartbeat_claims_and_restarts_a_kept_lease(
    ttl: float, sent: float, transit: float, later: list[tuple[float, float]]
) -> None:
    """R1 sends at ``sent`` (holder's clock), the heartbeat arrives ``transit`` later.
    Arrived before the ttl's end and fresh: claimed, expiry = sent + extension (earlier or later
    than the ttl end). After the ttl's end: EXPIRED, nothing renewed. Stale: nothing at all.
    Later heartbeats of R1 renew max(old, sent + extension); R2 is told CLAIMED."""
    r1, r2 = Reader("R1"), Reader("R2")
    h = holder_with_mapping(r1, r2)
    h.keep("K", 0.0, "blocks", ttl)
    arrive = sent + transit
    out = h.receive("R1", r1.beat(sent, "K"), arrive)
    assert out.ended == ()
    if arrive >= ttl:
        assert acked(out) == {}
        assert lost(out) == {"K": wire.LostReason.EXPIRED}
        assert h.claimant("K") is None
        assert [x.state for x in h.expire(arrive).ended] == [LeaseState.EXPIRED]
        return
    if sent + EXT <= arrive:
        assert out.replies == ()  # stale: a fresher heartbeat may still claim it
        assert h.kept("K")
        assert h.claimant("K") is None
        assert h.table.lease("K").expiry == ttl  # type: ignore[union-attr]
        return
    expiry = sent + EXT
    assert acked(out) == {"K": expiry}
    assert lost(out) == {}
    assert h.claimant("K") == "R1"
    assert not h.kept("K")
    assert h.kept_count == 0
    assert h.table.lease("K").expiry == expiry  # type: ignore[union-attr]
    assert h.next_deadline() == expiry
    t = arrive
    for gap, tr in later:
        s = t + gap
        t = s + tr
        out2 = h.receive("R2", r2.beat(s, "K"), t)
        if t >= expiry:
            assert ended(h.expire(t)) == {"K": LeaseState.EXPIRED}
            return
        assert lost(out2) == {"K": wire.LostReason.CLAIMED}
        assert acked(out2) == {}
        out1 = h.receive("R1", r1.beat(s, "K"), t)
        if s + EXT > t:
            expiry = max(expiry, s + EXT)
            assert acked(out1) == {"K": expiry}
        else:
            assert out1.replies == ()
        assert h.table.lease("K").expiry == expiry  # type: ignore[union-attr]
        assert h.claimant("K") == "R1"


@FOCUSED
@given(ttl=TTL, at=ticks(0, 64 * 20), claim=st.booleans(), done_after=st.none() | GAP)
def test_evict_ends_an_unclaimed_kept_lease_at_once_and_revokes_a_claimed_one(
    ttl: float, at: float, claim: bool, done_after: float | None
) -> None:
    r1 = Reader("R1")
    h = holder_with_mapping(r1)
    h.keep("K", 0.0, "blocks", ttl)
    if claim:
        r1.take(h.receive("R1", r1.beat(0.0, "K"), 0.0))
        assert h.claimant("K") == "R1"
    if at >= h.table.lease("K").expiry:  # type: ignore[union-attr]
        at = h.table.lease("K").expiry / 2  # type: ignore[union-attr]
    t = at
    expiry = h.table.lease("K").expiry  # type: ignore[union-attr]
    out = h.evict("K", t)
    if not claim:
        assert ended(out) == {"K": LeaseState.ABORTED}
        assert out.ended[0].ended_at == t
        assert out.ended[0].payload == "blocks"
        assert h.kept_count == 0
        assert h.live_count == 0
        later = h.receive("R1", r1.beat(t, "K"), t)
        assert lost(later) == {"K": wire.LostReason.ABORTED}
        assert h.evict("K", t).ended == ()  # an ended lease: a no-op
        return
    assert out.ended == ()
    assert h.revoked("K")
    # Heartbeats are answered ABORTED and renew nothing.
    beat = h.receive("R1", r1.beat(t, "K"), t)
    assert lost(beat) == {"K": wire.LostReason.ABORTED}
    assert acked(beat) == {}
    assert h.table.lease("K").expiry == expiry  # type: ignore[union-attr]
    if done_after is not None and t + done_after < expiry:
        out = h.receive("R1", r1.done(READ, "K"), t + done_after)
        assert ended(out) == {"K": LeaseState.CONSUMED}
        return
    assert h.expire(math.nextafter(expiry, -math.inf)).ended == ()
    out = h.expire(expiry)
    assert ended(out) == {"K": LeaseState.EXPIRED}
    # Never earlier than the claimant's confirmed bound.
    assert r1.bound_on_holder_clock("K") <= expiry


@FOCUSED
@given(
    life=st.one_of(st.none(), TTL),
    sent=st.one_of(st.none(), ticks(0, 64 * 30)),
    now=ticks(0, 64 * 30),
)
def test_table_restart_sets_sent_plus_extension_or_changes_nothing(
    life: float | None, sent: float | None, now: float
) -> None:
    t: LeaseTable[int] = LeaseTable(POLICY)
    t.grant("a", 0.0, 1, ttl=life)
    before = t.lease("a")
    assert before is not None
    assert before.expiry == (POLICY.duration if life is None else life)
    base = now if sent is None else min(sent, now)
    got = t.restart("a", now, sent_at=sent)
    after = t.lease("a")
    assert after is not None
    assert after.state is LeaseState.LIVE
    if before.expiry <= now or base + EXT <= now:
        assert got is None
        assert after == before
    else:
        assert got == base + EXT == after.expiry
        assert t.next_deadline() == got
    assert t.restart("never", now) is None
    assert t.lease("never") is None


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, math.nan, math.inf, True, "5"])
def test_keep_with_a_bad_ttl_raises_and_changes_nothing(bad: object) -> None:
    h: LeaseHolder[str] = LeaseHolder(POLICY)
    with pytest.raises(LeaseError, match="ttl"):
        h.keep("K", 0.0, "blocks", bad)  # type: ignore[arg-type]
    assert h.live_count == 0
    assert h.kept_count == 0
    assert not h.kept("K")
    h.keep("K", 0.0, "blocks", 1.0)  # the id was not used up
    with pytest.raises(InvalidTransitionError):
        h.keep("K", 0.0, "blocks", 1.0)
    assert h.kept_count == 1


# -- the state machine -------------------------------------------------------------------------
IDS = [f"L{i}" for i in range(6)]
for _lid in [*IDS, "X"]:
    H(_lid)
ENGINES = ["E1", "E2"]  # decode engines a grant may name (readers R1, R2 belong to neither)
REASON_FOR = {
    LeaseState.CONSUMED: wire.LostReason.CONSUMED,
    LeaseState.ABORTED: wire.LostReason.ABORTED,
    LeaseState.EXPIRED: wire.LostReason.EXPIRED,
}


class KeptLeases(RuleBasedStateMachine):
    """One holder (``max_drift=0``), two readers with offset clocks, a network that delivers
    any message in flight at any later time (reordering included). The model predicts every
    expiry, claim, reply and end exactly; the safety check: when the holder frees a lease's
    blocks, no reader other than the one whose notice freed them holds a confirmed bound
    beyond that moment."""

    def __init__(self) -> None:
        super().__init__()
        self.readers = {n: Reader(n) for n in OFF}
        self.h = holder_with_mapping(*self.readers.values())
        self.t = 0.0
        # The holder's send-time mapping bound per reader, min(recv - sent): the seeding
        # heartbeat crossed with zero transit.
        self.base = {n: -off for n, off in OFF.items()}
        self.m: dict[str, dict[str, Any]] = {}
        self.flight: list[tuple[str, wire.Message]] = []
        self.ends: dict[str, int] = {}

    # -- helpers ---------------------------------------------------------------------------
    def _end(self, lid: str, how: LeaseState, by: str | None) -> None:
        m = self.m[lid]
        assert m["state"] is LeaseState.LIVE
        m.update(state=how, ended_at=self.t, claim=None, kept=False, revoked=False)
        self.ends[lid] = self.ends.get(lid, 0) + 1
        if m["restarted"]:
            event(f"a restarted kept lease ended {how.value}")
        for name, r in self.readers.items():
            if name != by:
                assert r.bound_on_holder_clock(lid) <= self.t, (
                    f"{lid} freed ({how.value}) at {self.t}, but {name} was confirmed it until "
                    f"{r.bound_on_holder_clock(lid)}"
                )

    def _not_for(self, reader: str, lid: str) -> wire.LostReason | None:
        # Why a message from ``reader`` naming ``lid`` cannot touch it (None: it can).
        m = self.m.get(lid)
        if m is None:
            return wire.LostReason.UNKNOWN
        if m["state"] is not LeaseState.LIVE:
            return REASON_FOR[m["state"]]
        if m["claim"] not in (None, reader):
            return wire.LostReason.CLAIMED
        return None

    def _check_ended(self, out: HolderOutput[str], expect: dict[str, LeaseState]) -> None:
        assert ended(out) == expect
        assert len(out.ended) == len(expect)
        for x in out.ended:
            assert x.ended_at == self.t

    # -- rules -----------------------------------------------------------------------------
    @rule(dt=st.sampled_from([0.0, 0.0, 0.25, 0.5, 1.0, 2.0, 3.0, 6.5]))
    def advance(self, dt: float) -> None:
        self.t += dt

    @rule(
        lid=st.sampled_from(IDS),
        ttl=st.one_of(st.none(), st.sampled_from([0.5, 2.0, 5.0, 12.0])),
        meant=st.sampled_from([None, *ENGINES]),
    )
    def grant_or_keep(self, lid: str, ttl: float | None, meant: str | None) -> None:
        if lid in self.m:
            with pytest.raises(InvalidTransitionError):
                self.h.keep(lid, self.t, lid, 1.0)
            return
        if ttl is None:
            lease = self.h.grant(lid, self.t, lid, engine=meant)
            life = POLICY.duration
        else:
            meant = None  # a kept lease names no decode engine
            lease = self.h.keep(lid, self.t, lid, ttl)
            life = ttl
        assert lease.expiry == self.t + life
        self.m[lid] = {
            "state": LeaseState.LIVE,
            "expiry": self.t + life,
            "kept": ttl is not None,
            "claim": None,
            "revoked": False,
            "ended_at": None,
            "restarted": False,
            "meant": meant,
        }

    def _names(self, data: st.DataObject, most: int) -> list[str]:
        # Leases granted so far (live or ended), or an unknown one.
        pool = [*sorted(self.m), "X"] if self.m else [*IDS, "X"]
        return sorted(data.draw(st.sets(st.sampled_from(pool), min_size=1, max_size=most)))

    @rule(reader=st.sampled_from(sorted(OFF)), data=st.data(), at_once=st.booleans())
    def heartbeat(self, reader: str, data: st.DataObject, at_once: bool) -> None:
        self.flight.append((reader, self.readers[reader].beat(self.t, *self._names(data, 3))))
        if at_once:
            self._deliver(len(self.flight) - 1)

    @rule(reader=st.sampled_from(sorted(OFF)), data=st.data(), read=st.booleans())
    def done(self, reader: str, data: st.DataObject, read: bool) -> None:
        msg = self.readers[reader].done(READ if read else RELEASED, *self._names(data, 2))
        self.flight.append((reader, msg))

    @precondition(lambda self: bool(self.flight))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        self._deliver(data.draw(st.integers(0, len(self.flight) - 1)))

    def _deliver(self, index: int) -> None:
        reader, msg = self.flight.pop(index)
        out = self.h.receive(reader, msg, self.t)
        if isinstance(msg, wire.Heartbeat):
            self._deliver_heartbeat(reader, msg, out)
        else:
            assert isinstance(msg, wire.LeaseDone)
            self._deliver_done(reader, msg, out)
        self.readers[reader].take(out)

    def _deliver_heartbeat(self, reader: str, msg: wire.Heartbeat, out: HolderOutput[str]) -> None:
        cand = self.t - msg.sent_at
        if cand <= self.base[reader]:
            self.base[reader] = cand
            mapped = self.t
        else:
            mapped = min(self.t, msg.sent_at + self.base[reader])
        fresh = mapped + EXT
        want_ack: dict[str, float] = {}
        want_lost: dict[str, wire.LostReason] = {}
        for h in msg.handles:
            lid = NAME[h]
            why = self._not_for(reader, lid)
            m = self.m.get(lid, {})
            if why is not None:
                want_lost[lid] = why
            elif m["revoked"]:
                want_lost[lid] = wire.LostReason.ABORTED
            elif m["expiry"] <= self.t:
                want_lost[lid] = wire.LostReason.EXPIRED
            elif fresh <= self.t:
                pass  # stale: no claim, no restart, no answer
            else:
                if m["kept"]:
                    event(f"restart {'earlier' if fresh < m['expiry'] else 'later'} than ttl")
                m["restarted"] |= m["kept"]
                m["expiry"] = fresh if m["kept"] else max(m["expiry"], fresh)
                m["kept"] = False
                m["claim"] = reader
                want_ack[lid] = m["expiry"]
        assert out.ended == ()
        assert lost(out) == want_lost
        acks = [x for x in out.replies if isinstance(x, wire.LeaseAck)]
        if want_ack:
            (ack,) = acks
            assert {NAME[h] for h in ack.handles} == set(want_ack)
            assert ack.expiry == min(want_ack.values())
            assert (ack.echo_seq, ack.holder_now) == (msg.seq, self.t)
        else:
            assert acks == []

    def _deliver_done(self, reader: str, msg: wire.LeaseDone, out: HolderOutput[str]) -> None:
        want_lost: dict[str, wire.LostReason] = {}
        want_end: dict[str, LeaseState] = {}
        for h in msg.handles:
            lid = NAME[h]
            why = self._not_for(reader, lid)
            if why is not None:
                want_lost[lid] = why
            else:
                how = LeaseState.CONSUMED if msg.reason is READ else LeaseState.ABORTED
                want_end[lid] = how
                self._end(lid, how, by=reader)
        assert lost(out) == want_lost
        assert not any(isinstance(x, wire.LeaseAck) for x in out.replies)
        self._check_ended(out, want_end)

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        (lid,) = self._names(data, 1)
        out = self.h.evict(lid, self.t)
        m = self.m.get(lid)
        if m is None or m["state"] is not LeaseState.LIVE:
            self._check_ended(out, {})
        elif m["kept"]:
            assert m["claim"] is None
            self._end(lid, LeaseState.ABORTED, by=None)
            self._check_ended(out, {lid: LeaseState.ABORTED})
        else:
            event(f"evict revokes a lease {'claimed' if m['claim'] else 'nobody claimed'}")
            m["revoked"] = True
            self._check_ended(out, {})
        assert out.replies == ()

    @rule(engine=st.sampled_from(ENGINES))
    def engine_gone(self, engine: str) -> None:
        # Every live lease meant for ``engine`` that nobody claimed ends at once; one claimed
        # by any reader (the other engine's included) is left to its claim. _end checks that no
        # reader holds a confirmed bound on what is freed.
        out = self.h.abort_unclaimed_for(engine, self.t)
        due = {
            lid: LeaseState.ABORTED
            for lid, m in self.m.items()
            if m["state"] is LeaseState.LIVE and m["claim"] is None and m["meant"] == engine
        }
        for lid in due:
            event("engine_gone aborts an unclaimed lease")
            self._end(lid, LeaseState.ABORTED, by=None)
        if any(
            m["state"] is LeaseState.LIVE and m["claim"] is not None and m["meant"] == engine
            for m in self.m.values()
        ):
            event("engine_gone leaves a lease meant for it that a reader claimed")
        self._check_ended(out, due)
        assert out.replies == ()

    @rule()
    def expire(self) -> None:
        out = self.h.expire(self.t)
        due = {
            lid: LeaseState.EXPIRED
            for lid, m in self.m.items()
            if m["state"] is LeaseState.LIVE and m["expiry"] <= self.t
        }
        for lid in due:
            self._end(lid, LeaseState.EXPIRED, by=None)
        self._check_ended(out, due)
        expiries = [x.expiry for x in out.ended]
        assert expiries == sorted(expiries)

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def holder_matches_model(self) -> None:
        live = []
        for lid in IDS:
            m = self.m.get(lid)
            lease = self.h.table.lease(lid)
            if m is None:
                assert lease is None
                continue
            assert lease is not None
            assert lease.state is m["state"]
            assert lease.expiry == m["expiry"] or m["state"] is not LeaseState.LIVE
            is_live = m["state"] is LeaseState.LIVE
            assert self.h.kept(lid) == (is_live and m["kept"])
            assert self.h.revoked(lid) == (is_live and m["revoked"])
            assert self.h.claimant(lid) == (m["claim"] if is_live else None)
            # The intended engine never outlives its lease.
            assert self.h.meant_for(lid) == (m["meant"] if is_live else None)
            if is_live:
                live.append(m["expiry"])
        assert self.h.live_count == len(live)
        assert self.h.kept_count == sum(
            m["state"] is LeaseState.LIVE and m["kept"] for m in self.m.values()
        )
        assert self.h.next_deadline() == (min(live) if live else None)
        assert self.h.meant_count == sum(
            m["state"] is LeaseState.LIVE and m["meant"] is not None for m in self.m.values()
        )
        assert self.h.meant_count <= self.h.live_count

    @invariant()
    def every_lease_ends_at_most_once(self) -> None:
        assert all(n == 1 for n in self.ends.values())

    def teardown(self) -> None:
        if sys.exc_info()[1] is not None:
            return
        # Let time run: every lease ends, exactly once (no reader heartbeats any more).
        self.t += 100.0
        self.expire()
        assert self.h.live_count == 0
        assert self.h.kept_count == 0
        assert self.h.meant_count == 0
        assert self.ends == dict.fromkeys(self.m, 1)


TestKeptLeases = KeptLeases.TestCase
TestKeptLeases.settings = settings(
    TestKeptLeases.settings,
    max_examples=min(settings().max_examples, 80),
    stateful_step_count=40,
    report_multiple_bugs=False,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)
