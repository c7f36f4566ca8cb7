"""LeaseTable against a plain dict model, driven by a Hypothesis state machine."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvframe.core.lease import (
    LeasePolicy,
    LeaseState,
    LeaseTable,
    RenewIgnored,
    RenewResult,
    lease_handle,
)
from kvframe.errors import InvalidTransitionError

POLICY = LeasePolicy.from_duration(30.0)  # interval 5, extension 20
IDS = [f"r{i}" for i in range(12)]
REASON = {
    LeaseState.CONSUMED: RenewIgnored.CONSUMED,
    LeaseState.ABORTED: RenewIgnored.ABORTED,
    LeaseState.EXPIRED: RenewIgnored.EXPIRED,
}


class LeaseModel(RuleBasedStateMachine):
    """The model: a dict id -> {"state", "expiry", "granted_at", "renewals", "payload"} and a
    clock that only moves forward (calls may pass smaller values: the table must clamp them)."""

    def __init__(self) -> None:
        super().__init__()
        self.table: LeaseTable[int] = LeaseTable(POLICY)
        self.model: dict[str, dict[str, Any]] = {}
        self.now = 0.0  # the driver's time; calls pass it or something smaller
        self.clock: float | None = None  # the largest time passed so far (what the table uses)
        self.last_reap = -float("inf")
        self.seen_expiry: dict[str, float] = {}
        self.ends: dict[str, int] = {}
        self.payload = 0

    def _t(self, now: float) -> float:
        self.clock = now if self.clock is None else max(self.clock, now)
        return self.clock

    def _end(self, rid: str, state: LeaseState) -> None:
        self.model[rid]["state"] = state
        self.ends[rid] = self.ends.get(rid, 0) + 1

    # -- rules ------------------------------------------------------------------------------
    @rule(dt=st.floats(min_value=0.0, max_value=25.0))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(rid=st.sampled_from(IDS), back=st.sampled_from([0.0, 0.0, 3.0, 1e4]))
    def grant(self, rid: str, back: float) -> None:
        self.payload += 1
        if rid in self.model:
            try:
                self.table.grant(rid, self.now - back, self.payload)
            except InvalidTransitionError:
                return
            raise AssertionError(f"granted {rid} twice")
        now = self._t(self.now - back)
        lease = self.table.grant(rid, self.now - back, self.payload)
        self.model[rid] = {
            "state": LeaseState.LIVE,
            "expiry": now + POLICY.duration,
            "granted_at": now,
            "renewals": 0,
            "payload": self.payload,
            "last_renewal": None,  # latest send time (as of) among accepted renewals
        }
        assert lease.expiry == now + POLICY.duration

    @rule(
        rids=st.lists(st.sampled_from([*IDS, "stranger"]), max_size=6),
        back=st.sampled_from([0.0, 0.0, 2.0, 50.0]),
        delay=st.one_of(st.none(), st.floats(min_value=0.0, max_value=40.0)),
        by_handle=st.booleans(),
    )
    def renew(self, rids: list[str], back: float, delay: float | None, by_handle: bool) -> None:
        now = self._t(self.now - back)
        sent = None if delay is None else self.now - back - delay
        if by_handle:
            # The bulk path, by handle (distinct, as on the wire): same rules, same answers.
            distinct = list(dict.fromkeys(rids))
            named = {lease_handle(r): r for r in distinct}
            got = self.table.renew_handles(list(named), self.now - back, sent_at=sent)
            assert len(got.renewed) == len(got.expiries)
            result = RenewResult(
                renewed={
                    named[h]: x
                    for h, x in zip(got.renewed.tolist(), got.expiries.tolist(), strict=True)
                },
                ignored={named[h]: why for h, why in got.ignored.items()},
            )
            if got.min_expiry is not None:
                assert got.min_expiry == min(result.renewed.values())
        else:
            result = self.table.renew(rids, self.now - back, sent_at=sent)
        base = now if sent is None else min(sent, now)
        for rid in dict.fromkeys(rids):
            m = self.model.get(rid)
            if m is None:
                assert result.ignored[rid] is RenewIgnored.UNKNOWN
            elif m["state"] is not LeaseState.LIVE:
                assert result.ignored[rid] is REASON[m["state"]]
            elif m["expiry"] <= now:
                assert result.ignored[rid] is RenewIgnored.EXPIRED
            elif base + POLICY.extension <= now:
                assert result.ignored[rid] is RenewIgnored.STALE
            else:
                m["expiry"] = max(m["expiry"], base + POLICY.extension)
                m["renewals"] += 1
                # Heartbeats may be delivered out of order: the latest send time counts.
                prev = m["last_renewal"]
                m["last_renewal"] = base if prev is None else max(prev, base)
                assert result.renewed[rid] == m["expiry"]
        assert len(result.renewed) + len(result.ignored) == len(set(rids))

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), consume=st.booleans())
    def end(self, data: st.DataObject, consume: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model)))
        m = self.model[rid]
        call = self.table.consume if consume else self.table.abort
        if m["state"] is not LeaseState.LIVE:
            try:
                call(rid, self.now)
            except InvalidTransitionError:
                return
            raise AssertionError(f"ended {rid} again")
        self._t(self.now)
        lease = call(rid, self.now)
        state = LeaseState.CONSUMED if consume else LeaseState.ABORTED
        self._end(rid, state)
        assert lease.state is state
        assert lease.payload == m["payload"]

    @rule(back=st.sampled_from([0.0, 0.0, 0.0, 7.0]))
    def expire(self, back: float) -> None:
        now = self._t(self.now - back)
        out = self.table.expire(self.now - back)
        due = {
            rid
            for rid, m in self.model.items()
            if m["state"] is LeaseState.LIVE and m["expiry"] <= now
        }
        assert {x.request_id for x in out} == due
        expiries = [x.expiry for x in out]
        assert expiries == sorted(expiries)
        for lease in out:
            m = self.model[lease.request_id]
            # It really was due: neither the grant nor any renewal covered `now`.
            assert lease.expiry == m["expiry"] <= now
            assert lease.payload == m["payload"]
            # Renewed less than `extension` ago: it would not have expired.
            if m["last_renewal"] is not None:
                assert now - m["last_renewal"] >= POLICY.extension
            self._end(lease.request_id, LeaseState.EXPIRED)
        for rid, m in self.model.items():
            if m["state"] is LeaseState.LIVE:
                # After the last renewal at t it expires no later than t + extension (or the
                # end of its initial grant, if that is later).
                t = m["last_renewal"]
                bound = m["granted_at"] + POLICY.duration
                if t is not None:
                    bound = max(bound, t + POLICY.extension)
                assert now < bound, f"{rid} still live at {now}, past {bound}"
        self.last_reap = now

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def table_matches_model(self) -> None:
        live = 0
        for rid in IDS:
            m = self.model.get(rid)
            lease = self.table.lease(rid)
            if m is None:
                assert lease is None
                continue
            assert lease is not None
            assert lease.state is m["state"]
            assert lease.expiry == m["expiry"]
            assert lease.granted_at == m["granted_at"]
            assert lease.renewals == m["renewals"]
            live += m["state"] is LeaseState.LIVE
        assert len(self.table) == live

    @invariant()
    def expiry_never_decreases(self) -> None:
        for rid in IDS:
            lease = self.table.lease(rid)
            if lease is not None:
                assert lease.expiry >= self.seen_expiry.get(rid, lease.expiry)
                self.seen_expiry[rid] = lease.expiry

    @invariant()
    def nothing_expired_is_live(self) -> None:
        for lease in self.table.leases():
            assert lease.expiry > self.last_reap

    @invariant()
    def no_lease_ends_twice(self) -> None:
        assert all(n == 1 for n in self.ends.values())

    @invariant()
    def next_deadline_is_the_earliest_live_expiry(self) -> None:
        expiries = [x.expiry for x in self.table.leases()]
        deadline = self.table.next_deadline()
        if not expiries:
            assert deadline is None
        else:
            assert deadline is not None
            assert deadline <= min(expiries)
            assert deadline == min(expiries)

    @invariant()
    def counters_add_up(self) -> None:
        c = self.table.counters
        states = [m["state"] for m in self.model.values()]
        assert c.granted == len(states)
        assert c.consumed == states.count(LeaseState.CONSUMED)
        assert c.aborted == states.count(LeaseState.ABORTED)
        assert c.expired == states.count(LeaseState.EXPIRED)


TestLeaseModel = LeaseModel.TestCase
