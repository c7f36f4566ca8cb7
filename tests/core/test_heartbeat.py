"""D's HeartbeatTracker and P's HeartbeatGuard, alone and together through the wire format."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvframe.core import wire
from kvframe.core.clock import ClockSample
from kvframe.core.heartbeat import (
    REMEMBER_BATCHES,
    SEQ_MODULUS,
    HeartbeatGuard,
    HeartbeatTracker,
    StopReason,
    seq_newer_or_equal,
)
from kvframe.core.lease import LeasePolicy, LeaseTable, RenewIgnored, lease_handle
from kvframe.errors import ConfigError, InvalidTransitionError, LeaseError

INTERVAL = 5.0
ENGINES = ["p0", "p1", "p2"]
LOCAL = [f"d{i}" for i in range(10)]


class TrackerModel(RuleBasedStateMachine):
    """Tracked requests in a dict; every batch checked against it."""

    def __init__(self) -> None:
        super().__init__()
        self.tracker = HeartbeatTracker(INTERVAL)
        self.model: dict[str, tuple[str, str]] = {}
        self.now = 0.0
        self.clock: float | None = None  # the largest time passed so far (the tracker's clock)
        self.last_batch: dict[str, float] = {}
        self.last_seq = -1
        self.since: dict[str, float] = {}  # when each engine last went from idle to tracked

    def _t(self, now: float) -> float:
        self.clock = now if self.clock is None else max(self.clock, now)
        return self.clock

    @rule(dt=st.floats(min_value=0.0, max_value=8.0))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(
        rid=st.sampled_from(LOCAL),
        engine=st.sampled_from(ENGINES),
        remote=st.sampled_from(["x", "y", "z", "w"]),
        back=st.sampled_from([0.0, 0.0, 2.0]),
    )
    def track(self, rid: str, engine: str, remote: str, back: float) -> None:
        if rid in self.model:
            with pytest.raises(InvalidTransitionError, match="already tracked"):
                self.tracker.track(rid, engine, remote, self.now - back)
            return
        t = self._t(self.now - back)
        self.tracker.track(rid, engine, remote, self.now - back)
        if engine not in {e for e, _ in self.model.values()}:
            self.since[engine] = t
        self.model[rid] = (engine, remote)

    @rule(rid=st.sampled_from(LOCAL), reason=st.sampled_from(list(StopReason)))
    def stop(self, rid: str, reason: StopReason) -> None:
        self._t(self.now)
        assert self.tracker.stop(rid, self.now, reason) is (rid in self.model)
        self.model.pop(rid, None)

    @rule(back=st.sampled_from([0.0, 0.0, 0.0, 3.0]))
    def due(self, back: float) -> None:
        now = self._t(self.now - back)
        deadline = self.tracker.next_deadline()
        batches = self.tracker.due(self.now - back)
        engines = [b.engine_id for b in batches]
        assert len(engines) == len(set(engines)), "two batches for one engine in one call"
        tracked: dict[str, set[str]] = {}
        for engine, remote in self.model.values():
            tracked.setdefault(engine, set()).add(remote)
        for b in batches:
            # Every tracked id of that engine, and nothing else.
            assert set(b.request_ids) == tracked[b.engine_id]
            assert list(b.request_ids) == sorted(set(b.request_ids))
            # At most one batch per engine per interval.
            last = self.last_batch.get(b.engine_id)
            assert last is None or now - last >= INTERVAL
            self.last_batch[b.engine_id] = now
            assert b.sent_at == now
            assert b.seq > self.last_seq
            self.last_seq = b.seq
        # An engine with something tracked is served once its time has come.
        if deadline is not None and deadline <= now:
            assert batches
        assert not set(engines) - set(tracked), "a batch for an engine with nothing tracked"

    @invariant()
    def engines_are_those_with_tracked_requests(self) -> None:
        assert self.tracker.engines == {e for e, _ in self.model.values()}
        assert len(self.tracker) == len(self.model)
        for rid, where in self.model.items():
            assert self.tracker.tracked(rid) == where

    @invariant()
    def next_deadline_is_sound(self) -> None:
        deadline = self.tracker.next_deadline()
        if not self.model:
            assert deadline is None
            return
        assert deadline is not None
        for engine in self.tracker.engines:
            # Due at once when it became busy, or one interval after its last batch.
            last = self.last_batch.get(engine)
            since = self.since[engine]
            assert deadline <= (since if last is None else max(since, last + INTERVAL))

    @precondition(lambda self: not self.model)
    @rule()
    def idle_engines_are_dropped(self) -> None:
        self.now += INTERVAL
        self._t(self.now)
        assert self.tracker.due(self.now) == []
        assert self.tracker.engines == frozenset()
        assert self.tracker._engines == {}


TestTrackerModel = TrackerModel.TestCase


def test_tracker_batches_per_engine_and_waits_an_interval() -> None:
    t = HeartbeatTracker(INTERVAL)
    t.track("d1", "p0", "r1", 0.0)
    t.track("d2", "p0", "r2", 0.0)
    t.track("d3", "p1", "r3", 1.0)
    assert t.next_deadline() == 0.0
    first = t.due(1.0)
    assert [(b.engine_id, b.request_ids, b.seq) for b in first] == [
        ("p0", ("r1", "r2"), 0),
        ("p1", ("r3",), 1),
    ]
    assert t.due(5.9) == []
    assert t.next_deadline() == 6.0
    t.stop("d1", 6.0, StopReason.TRANSFER_DONE)
    t.stop("d1", 6.0, StopReason.FINISHED)  # second stop finds nothing
    assert [(b.engine_id, b.request_ids) for b in t.due(6.0)] == [("p0", ("r2",)), ("p1", ("r3",))]
    t.stop("d3", 7.0, StopReason.ABORTED)
    assert t.engines == {"p0"}
    # Re-tracking on p1 before its next slot does not produce an extra batch.
    t.track("d4", "p1", "r4", 8.0)
    assert t.due(8.0) == []
    assert [b.engine_id for b in t.due(11.0)] == ["p0", "p1"]
    assert t.stopped == {"transfer_done": 1, "finished": 0, "aborted": 1}


def test_tracker_time_going_backwards_does_not_double_send() -> None:
    t = HeartbeatTracker(INTERVAL)
    t.track("d1", "p0", "r1", 100.0)
    assert len(t.due(100.0)) == 1
    assert t.due(50.0) == []  # clamped to 100
    assert t.due(104.9) == []
    assert len(t.due(105.0)) == 1
    assert t.clock_regressions == 1


def test_tracker_rejects_bad_input() -> None:
    for bad in (0, -1.0, math.nan, math.inf, True, "5"):
        with pytest.raises(ConfigError, match="heartbeat_interval"):
            HeartbeatTracker(bad)  # type: ignore[arg-type]
    t = HeartbeatTracker.from_policy(LeasePolicy.from_duration(30.0))
    assert t.interval == 5.0
    with pytest.raises(LeaseError, match="engine_id"):
        t.track("d1", "", "r1", 0.0)
    with pytest.raises(LeaseError, match="now"):
        t.track("d1", "p0", "r1", math.nan)
    with pytest.raises(LeaseError, match="StopReason"):
        t.stop("d1", 0.0, "done")  # type: ignore[arg-type]
    assert len(t) == 0


def test_same_remote_id_from_two_local_requests_is_sent_once_until_both_stop() -> None:
    t = HeartbeatTracker(INTERVAL)
    t.track("d1", "p0", "r1", 0.0)
    t.track("d2", "p0", "r1", 0.0)
    assert t.due(0.0)[0].request_ids == ("r1",)
    t.stop("d1", 1.0, StopReason.FINISHED)
    assert t.due(5.0)[0].request_ids == ("r1",)
    t.stop("d2", 6.0, StopReason.FINISHED)
    assert t.due(10.0) == []


# -- P's guard --------------------------------------------------------------------------------


@given(st.integers(0, SEQ_MODULUS - 1), st.integers(0, SEQ_MODULUS // 2 - 1))
def test_seq_comparison_wraps(b: int, ahead: int) -> None:
    a = (b + ahead) % SEQ_MODULUS
    assert seq_newer_or_equal(a, b)
    if ahead:
        assert not seq_newer_or_equal(b, a)


def test_guard_drops_reordered_and_accepts_split_parts() -> None:
    g = HeartbeatGuard()
    assert g.accept("d", 5, 1000.0, 10.0) == 10.0
    assert g.accept("d", 5, 1000.0, 10.1) is not None  # second part of a split batch
    assert g.accept("d", 4, 999.0, 10.2) is None
    assert g.accept("d", 6, 1005.0, 15.0) == 15.0
    assert (g.accepted, g.out_of_order) == (3, 1)
    g.forget("d")  # restarted engine: numbering starts again
    assert g.accept("d", 0, 3.0, 20.0) == 20.0
    with pytest.raises(LeaseError, match="seq"):
        g.accept("d", -1, 1.0, 20.0)
    with pytest.raises(LeaseError, match="seq"):
        g.accept("d", SEQ_MODULUS, 1.0, 20.0)
    with pytest.raises(LeaseError, match="sent_at"):
        g.accept("d", 1, math.inf, 20.0)


def test_guard_maps_a_delayed_burst_into_the_past() -> None:
    g = HeartbeatGuard()
    g.seed("d", ClockSample(t_send=0.0, remote_ts=5000.0005, t_recv=0.001))
    # D's clock is P's + 5000. On time: mapped to about the receive time.
    assert g.accept("d", 1, 5010.0, 10.0001) == pytest.approx(10.0, abs=0.002)
    # Sent at D 5015 (P 15), delivered 31 s late in a burst at P 46. (The bound widens by
    # 500 ppm of its 36 s age for possible drift: 18 ms.)
    mapped = g.accept("d", 2, 5015.0, 46.0)
    assert mapped is not None
    assert 15.0 <= mapped <= 15.0 + 0.001 + 36 * 500e-6 + 1e-9


def test_partition_burst_cannot_prolong_a_lease() -> None:
    """End to end: D's tracker -> wire -> P's guard -> P's table, with a 31 s partition during
    which D's heartbeats queue up and arrive in one burst (FACTS.md). The burst must neither
    revive nor prolong the lease; P answers with lease-lost notices that D decodes."""
    policy = LeasePolicy.from_duration(30.0)
    table: LeaseTable[None] = LeaseTable(policy)
    tracker = HeartbeatTracker.from_policy(policy)
    guard = HeartbeatGuard()
    skew = -7_000.0  # D's clock = P's clock + skew
    guard.seed("D", ClockSample(t_send=0.0, remote_ts=0.0005 + skew, t_recv=0.001))
    table.grant("a", 0.0, None)
    tracker.track("local-a", "P", "a", 0.0 + skew)
    queued: list[tuple[float, bytes]] = []
    acks: list[bytes] = []
    t = 0.0
    while t <= 100.0:
        for batch in tracker.due(t + skew):
            hb = wire.Heartbeat(
                seq=batch.seq,
                sent_at=batch.sent_at,
                handles=[lease_handle(r) for r in batch.request_ids],
            )
            queued.append((t, wire.encode(hb)))
        partitioned = 30.0 <= t < 61.0
        if not partitioned:
            for _, data in queued:
                msg = wire.decode(data)
                assert isinstance(msg, wire.Heartbeat)
                mapped = guard.accept("D", msg.seq, msg.sent_at, t)
                assert mapped is not None
                res = table.renew_handles(msg.handles, t, sent_at=mapped)
                if res.min_expiry is not None:
                    ack = wire.LeaseAck(
                        echo_seq=msg.seq,
                        holder_now=t,
                        expiry=res.min_expiry,
                        handles=res.renewed.tolist(),
                    )
                    acks.append(wire.encode(ack))
                if res.ignored:
                    lost = wire.LeaseLost(
                        echo_seq=msg.seq,
                        holder_now=t,
                        reason=wire.LostReason.EXPIRED,
                        handles=list(res.ignored),
                    )
                    acks.append(wire.encode(lost))
            queued.clear()
        table.expire(t)
        t += 0.5
    lease = table.lease("a")
    assert lease is not None
    # The last heartbeat before the cut was sent at 25 (P time) -> expiry 45; the lease expired
    # then. The burst at 61 (sent 30..60) neither revived it nor pushed it to 61 + 20.
    assert lease.expiry == pytest.approx(45.0, abs=0.01)
    assert lease.ended_at == pytest.approx(45.0, abs=0.5)
    assert table.counters.renew_ignored >= 1
    # D learns of the loss, and every ack it got rebases to a deadline no later than P's.
    kinds = [type(wire.decode(a)) for a in acks]
    assert wire.LeaseLost in kinds
    confirmed = 0
    for a in acks:
        msg = wire.decode(a)
        if isinstance(msg, wire.LeaseAck):
            assert msg.handles == (lease_handle("a"),)
            pairs = [("a", msg.expiry)]
            local = tracker.rebase_ack("P", msg.echo_seq, msg.holder_now, pairs)
            assert local is not None
            assert local["a"] - skew <= msg.expiry + 1e-6
            confirmed += 1
    assert confirmed >= 5


def test_rebase_ack_uses_the_batch_send_time_and_refuses_strangers() -> None:
    t = HeartbeatTracker(INTERVAL)
    t.track("d1", "p0", "r1", 100.0)
    (batch,) = t.due(100.0)
    # P (clock 5000 ahead, 0.2 s away) renewed at 5100.2 until 5120.2.
    assert t.rebase_ack("p0", batch.seq, 5100.2, [("r1", 5120.2)]) == {"r1": pytest.approx(120.0)}
    assert t.rebase_ack("p1", batch.seq, 5100.2, [("r1", 5120.2)]) is None  # wrong engine
    assert t.rebase_ack("p0", batch.seq + 1, 5100.2, [("r1", 5120.2)]) is None  # never sent
    for now in range(105, 105 + 5 * (REMEMBER_BATCHES + 1), 5):
        t.due(float(now))
    assert t.rebase_ack("p0", batch.seq, 5100.2, [("r1", 5120.2)]) is None  # forgotten


def test_renew_result_maps_onto_lost_reasons() -> None:
    # The P/D connector turns RenewIgnored into LostReason by name (STALE leases are live:
    # they get an ack with their unchanged expiry instead).
    for reason in RenewIgnored:
        if reason is not RenewIgnored.STALE:
            assert wire.LostReason[reason.name]
