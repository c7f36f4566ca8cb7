"""LeaseTable behaviour: reaping order, renewals, stale heartbeats, time going backwards."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvframe.core.lease import (
    EndedLeases,
    LeasePolicy,
    LeaseState,
    LeaseTable,
    RenewIgnored,
    lease_handle,
)
from kvframe.errors import ConfigError, InvalidTransitionError, LeaseError

POLICY = LeasePolicy.from_duration(30.0)  # interval 5, extension 20


def new_table(**kwargs: int) -> LeaseTable[int]:
    return LeaseTable(POLICY, **kwargs)


def test_grant_renew_consume_round_trip() -> None:
    t = new_table()
    lease = t.grant("a", 10.0, 7)
    assert (lease.state, lease.granted_at, lease.expiry, lease.payload) == (
        LeaseState.LIVE,
        10.0,
        40.0,
        7,
    )
    assert t.next_deadline() == 40.0
    res = t.renew(["a"], 30.0)
    assert res.renewed == {"a": 50.0}
    assert not res.ignored
    assert t.next_deadline() == 50.0
    ended = t.consume("a", 31.0)
    assert (ended.state, ended.ended_at, ended.payload, ended.renewals) == (
        LeaseState.CONSUMED,
        31.0,
        7,
        1,
    )
    assert len(t) == 0
    assert t.next_deadline() is None
    assert t.expire(1000.0) == []
    c = t.counters
    assert (c.granted, c.renewed, c.consumed, c.expired) == (1, 1, 1, 0)


def test_renew_never_shortens() -> None:
    t = new_table()
    t.grant("a", 0.0, 0)  # expiry 30
    assert t.renew(["a"], 1.0).renewed == {"a": 30.0}  # 1 + 20 < 30: keeps 30
    assert t.lease("a").expiry == 30.0  # type: ignore[union-attr]


def test_renew_ignores_and_counts_unknown_and_ended_ids_without_creating_them() -> None:
    t = new_table()
    t.grant("live", 0.0, 0)
    t.grant("done", 0.0, 0)
    t.grant("gone", 0.0, 0)
    t.consume("done", 1.0)
    t.abort("gone", 1.0)
    res = t.renew(["live", "nobody", "done", "gone", "nobody"], 2.0)
    assert res.renewed == {"live": 30.0}
    assert res.ignored == {
        "nobody": RenewIgnored.UNKNOWN,
        "done": RenewIgnored.CONSUMED,
        "gone": RenewIgnored.ABORTED,
    }
    assert t.counters.renew_ignored == 3
    assert "nobody" not in t
    assert t.lease("nobody") is None
    assert len(t) == 1


def test_expire_finds_every_due_lease_whatever_the_order() -> None:
    """vLLM #58222: a reaper that scans from the head of a grant-ordered list stops at the
    first live lease and strands the due ones behind it. The heap must not."""
    t = new_table()
    for i in range(10):
        t.grant(f"r{i}", float(i), i)  # expiries 30..39
    t.renew(["r0", "r1"], 25.0)  # the two oldest now run to 45
    due = t.expire(40.0)
    assert [x.request_id for x in due] == [f"r{i}" for i in range(2, 10)]
    assert all(x.state is LeaseState.EXPIRED and x.ended_at == 40.0 for x in due)
    assert t.next_deadline() == 45.0
    assert {x.request_id for x in t.expire(45.0)} == {"r0", "r1"}
    assert t.counters.expired == 10


def test_expiry_is_inclusive() -> None:
    t = new_table()
    t.grant("a", 0.0, 0)
    assert t.expire(29.999) == []
    assert [x.request_id for x in t.expire(30.0)] == ["a"]


def test_a_due_lease_is_not_revived_by_a_late_renewal() -> None:
    t = new_table()
    t.grant("a", 0.0, 0)
    res = t.renew(["a"], 30.0)  # expiry 30 has been reached; not reaped yet
    assert res.ignored == {"a": RenewIgnored.EXPIRED}
    assert t.lease("a").expiry == 30.0  # type: ignore[union-attr]
    assert [x.request_id for x in t.expire(30.0)] == ["a"]
    assert t.renew(["a"], 31.0).ignored == {"a": RenewIgnored.EXPIRED}


def test_a_due_but_unreaped_lease_can_still_be_consumed() -> None:
    t = new_table()
    t.grant("a", 0.0, 0)
    assert t.consume("a", 35.0).state is LeaseState.CONSUMED
    assert t.expire(40.0) == []


def test_stale_heartbeat_does_not_prolong() -> None:
    t = new_table()
    t.grant("a", 0.0, 0)
    t.renew(["a"], 5.0)  # 25
    # A heartbeat sent at 6 that arrives at 24 (queued during a partition) extends to 26 only.
    assert t.renew(["a"], 24.0, sent_at=6.0).renewed == {"a": 30.0}  # max(30 initial, 26)
    t2 = new_table()
    t2.grant("a", 0.0, 0)
    t2.renew(["a"], 15.0)  # 35
    res = t2.renew(["a"], 34.0, sent_at=10.0)  # 10 + 20 = 30 <= now: stale
    assert res.ignored == {"a": RenewIgnored.STALE}
    assert t2.lease("a").expiry == 35.0  # type: ignore[union-attr]
    assert t2.lease("a").renewals == 1  # type: ignore[union-attr]
    # A sent_at in the future (clock mix-up) counts as now, never later.
    assert t2.renew(["a"], 34.0, sent_at=1e9).renewed == {"a": 54.0}


def test_time_going_backwards_is_clamped() -> None:
    t = new_table()
    t.grant("a", 100.0, 0)  # 130
    t.renew(["a"], 120.0)  # 140
    assert t.renew(["a"], 50.0).renewed == {"a": 140.0}  # clamped to 120: 140, not 70
    assert [x.request_id for x in t.expire(140.0)] == ["a"]
    t.grant("b", 10.0, 0)  # clamped to 140: expiry 170, not 40
    assert t.lease("b").granted_at == 140.0  # type: ignore[union-attr]
    assert t.lease("b").expiry == 170.0  # type: ignore[union-attr]
    assert t.expire(0.0) == []  # backwards: expires nothing, revives nothing
    assert t.state("a") is LeaseState.EXPIRED
    assert t.counters.clock_regressions == 3
    assert t.now == 140.0


def test_precise_errors_leave_the_table_unchanged() -> None:
    t = new_table()
    t.grant("a", 0.0, 1)
    with pytest.raises(InvalidTransitionError, match=r"cannot grant for request id 'a'.*live"):
        t.grant("a", 1.0, 2)
    assert t.lease("a").payload == 1  # type: ignore[union-attr]
    with pytest.raises(InvalidTransitionError, match=r"'b'.*absent"):
        t.consume("b", 1.0)
    with pytest.raises(InvalidTransitionError, match="absent"):
        t.abort("b", 1.0)
    t.consume("a", 2.0)
    with pytest.raises(InvalidTransitionError, match=r"consumed.*ended at t=2\.0.*single-use"):
        t.abort("a", 3.0)
    with pytest.raises(InvalidTransitionError, match="single-use"):
        t.grant("a", 3.0, 3)
    for bad in (math.nan, math.inf, "1", None, True):
        with pytest.raises(LeaseError, match="now must be a finite number"):
            t.grant("c", bad, 0)  # type: ignore[arg-type]
        with pytest.raises(LeaseError, match="now"):
            t.expire(bad)  # type: ignore[arg-type]
    with pytest.raises(LeaseError, match="sent_at"):
        t.renew(["a"], 3.0, sent_at=math.nan)
    with pytest.raises(LeaseError, match="wrap it in a list"):
        t.renew("abc", 3.0)
    with pytest.raises(LeaseError, match="non-empty str"):
        t.grant("", 3.0, 0)
    with pytest.raises(LeaseError, match="non-empty str"):
        t.grant(7, 3.0, 0)  # type: ignore[arg-type]
    assert t.now == 2.0
    assert "c" not in t
    assert t.counters.granted == 1


def test_bad_construction() -> None:
    with pytest.raises(ConfigError, match="LeasePolicy"):
        LeaseTable(30.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="remember_ended"):
        LeaseTable(POLICY, remember_ended=-1)
    with pytest.raises(ConfigError, match="remember_ended"):
        LeaseTable(POLICY, remember_ended=True)


def test_ended_leases_are_forgotten_oldest_first() -> None:
    t = new_table(remember_ended=2)
    for rid in "abc":
        t.grant(rid, 0.0, 0)
        t.consume(rid, 1.0)
    assert t.lease("a") is None
    assert t.state("a") is LeaseState.ABSENT
    assert t.lease("b").state is LeaseState.CONSUMED  # type: ignore[union-attr]
    assert t.renew(["a", "c"], 2.0).ignored == {
        "a": RenewIgnored.UNKNOWN,
        "c": RenewIgnored.CONSUMED,
    }
    t.grant("a", 2.0, 9)  # forgotten ids are absent again
    assert t.lease("a").payload == 9  # type: ignore[union-attr]


def test_nothing_remembered() -> None:
    t = new_table(remember_ended=0)
    t.grant("a", 0.0, 0)
    assert t.consume("a", 1.0).state is LeaseState.CONSUMED
    assert t.lease("a") is None


def test_storage_stays_bounded_under_many_renewals_and_ends() -> None:
    t = new_table()
    ids = [f"r{i}" for i in range(100)]
    for i, rid in enumerate(ids):
        t.grant(rid, 0.0, i)
    for step in range(1, 200):
        t.renew(ids, float(step))
    assert t.next_deadline() == 199.0 + 20.0
    for i in range(50):
        t.consume(f"r{i}", 200.0)
    assert len(t.expire(219.0)) == 50
    # Many generations of leases through the same table: slots are reused and the handle
    # index is rebuilt from its tombstones, so neither grows with the number ever granted.
    for gen in range(40):
        batch = [f"g{gen}-{i}" for i in range(100)]
        t0 = 1000.0 + 100.0 * gen
        for rid in batch:
            t.grant(rid, t0, None)
        t.renew_handles([lease_handle(r) for r in batch[:50]], t0 + 0.5)
        for rid in batch[:50]:
            t.abort(rid, t0 + 0.5)
        assert len(t.expire(t0 + 50.0)) == 50
    assert len(t) == 0
    assert t._n <= 100  # slots ever used
    assert len(t._ids) <= 129  # and the arrays holding them
    assert len(t._handles.keys) <= 1024


def test_out_of_order_renewals_are_still_reaped_in_expiry_order() -> None:
    t = new_table()
    for i in range(6):
        t.grant(f"r{i}", 0.0, i)  # all 30
    # Heartbeats as of decreasing send times: expiries 45, 44, 43 (out of push order).
    t.renew(["r0"], 26.0, sent_at=25.0)
    t.renew(["r1"], 26.0, sent_at=24.0)
    t.renew(["r2"], 26.0, sent_at=23.0)
    assert t.next_deadline() == 30.0
    assert [x.request_id for x in t.expire(30.0)] == ["r3", "r4", "r5"]
    assert t.next_deadline() == 43.0
    assert [(x.request_id, x.expiry) for x in t.expire(50.0)] == [
        ("r2", 43.0),
        ("r1", 44.0),
        ("r0", 45.0),
    ]


def test_leases_lists_live_snapshots_in_grant_order() -> None:
    t = new_table()
    t.grant("b", 0.0, 2)
    t.grant("a", 1.0, 1)
    t.grant("c", 2.0, 3)
    t.abort("b", 3.0)
    assert [(x.request_id, x.payload) for x in t.leases()] == [("a", 1), ("c", 3)]
    assert t.live_count == 2


@given(
    st.lists(st.floats(min_value=0.0, max_value=19.99), min_size=1, max_size=40),
    st.floats(min_value=0.0, max_value=100.0),
)
def test_renewed_within_the_extension_never_expires(gaps: list[float], start: float) -> None:
    """Renewed at gaps shorter than the extension, a lease never expires (with reaping at
    every step); after the last renewal at t it expires no later than
    max(t + extension, granted_at + duration)."""
    t = new_table()
    t.grant("a", start, 0)
    now = start
    for gap in gaps:
        now += gap
        assert t.expire(now) == [], f"expired at {now} despite renewal gaps {gaps}"
        t.renew(["a"], now)
    bound = max(now + POLICY.extension, start + POLICY.duration)
    assert t.lease("a").expiry == bound  # type: ignore[union-attr]
    assert [x.request_id for x in t.expire(bound)] == ["a"]


def test_forged_handles_name_nothing() -> None:
    t = new_table()
    for i in range(1000):
        t.grant(f"r{i}", 0.0, i)
    rng = np.random.default_rng(7)
    forged = rng.integers(0, 2**63, 10_000, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    forged = np.concatenate([forged, np.array([0, 1], dtype=np.uint64)])
    got = t.renew_handles(forged, 1.0)
    assert got.renewed.size == 0
    assert got.min_expiry is None
    assert set(got.ignored.values()) == {RenewIgnored.UNKNOWN}
    assert len(got.ignored) == len(set(forged.tolist()))
    assert all(t.request_id_for(int(h)) is None for h in forged[:100])
    assert t.counters.renewed == 0
    assert t.next_deadline() == 30.0  # nothing was extended


@pytest.mark.parametrize("bad", [[-1], [2**64], ["x"], [1.5j]])
def test_renew_handles_refuses_what_is_not_a_64_bit_handle(bad: list[object]) -> None:
    t = new_table()
    t.grant("a", 0.0, 0)
    with pytest.raises(LeaseError, match="handles must be integers"):
        t.renew_handles(bad, 1.0)  # type: ignore[arg-type]
    assert t.lease("a").renewals == 0  # type: ignore[union-attr]


def test_renew_handles_matches_renew_by_id() -> None:
    a, b = new_table(), new_table()
    ids = [f"r{i}" for i in range(50)]
    for rid in ids:
        a.grant(rid, 0.0, None)
        b.grant(rid, 0.0, None)
    a.consume("r3", 1.0)
    b.consume("r3", 1.0)
    names = [*ids[::2], "stranger"]
    by_id = a.renew(names, 15.0)
    by_handle = b.renew_handles([lease_handle(r) for r in names], 15.0)
    assert {lease_handle(r): x for r, x in by_id.renewed.items()} == dict(
        zip(by_handle.renewed.tolist(), by_handle.expiries.tolist(), strict=True)
    )
    assert {lease_handle(r): w for r, w in by_id.ignored.items()} == by_handle.ignored
    assert [x.expiry for x in a.leases()] == [x.expiry for x in b.leases()]
    assert a.lease("r0").handle == lease_handle("r0")  # type: ignore[union-attr]


def test_expire_returns_columns_and_rows_that_agree() -> None:
    t = new_table()
    for i in range(5):
        t.grant(f"r{i}", float(i), i * 10)
    t.renew(["r1"], 15.0)  # r1: expiry 35, live past 33
    out = t.expire(33.0)
    assert isinstance(out, EndedLeases)
    assert out.request_ids == ("r0", "r2", "r3")
    assert out.payloads == (0, 20, 30)
    assert out.handles == tuple(lease_handle(r) for r in ("r0", "r2", "r3"))
    assert out.expiries.tolist() == [30.0, 32.0, 33.0]
    assert out.granted_at.tolist() == [0.0, 2.0, 3.0]
    assert out.renewals.tolist() == [0, 0, 0]
    assert t.lease("r1").renewals == 1  # type: ignore[union-attr]
    assert (out.state, out.ended_at) == (LeaseState.EXPIRED, 33.0)
    with pytest.raises(ValueError, match="read-only"):
        out.expiries[0] = 1.0
    rows = out.rows()
    assert [x.request_id for x in rows] == ["r0", "r2", "r3"]
    assert out == rows
    assert out == tuple(rows)
    assert out[1] == rows[1]
    assert out[-2:] == rows[-2:]
    assert out != rows[:2]
    assert out != "r0"
    assert rows[0] == t.lease("r0")  # remembered as it ended
    assert out.by_handle(lease_handle("r2")) == rows[1]
    assert out.by_handle(lease_handle("r1")) is None
    assert t.expire(33.0) == []
    assert len(t.expire(33.0)) == 0


def test_many_chunks_expire_exactly_what_a_dict_model_says() -> None:
    # Thousands of leases over many chunks of 1024 slots, granted in waves (so a wave's
    # leases share chunks and expire scans only the chunks whose bound is due), renewed
    # (their chunks' bounds stay low: still valid), restarted (lowered), ended early (slots
    # reused across chunks): every call must agree with a plain dict.
    rng = np.random.default_rng(7)
    t = new_table(remember_ended=0)
    model: dict[str, float] = {}
    now, serial = 0.0, 0
    for wave in range(80):
        ttl = 30.0 if wave % 10 else float(rng.uniform(1.0, 60.0))
        for _ in range(int(rng.integers(100, 400))):
            rid = f"r{serial}"
            serial += 1
            t.grant(rid, now, None, ttl=ttl + float(rng.uniform(0.0, 0.5)))
            model[rid] = t.lease(rid).expiry  # type: ignore[union-attr]
        live = sorted(model)
        pick = [live[i] for i in rng.choice(len(live), size=min(len(live), 100))]
        for rid, expiry in t.renew(pick, now).renewed.items():
            model[rid] = expiry
        for rid in pick[:5]:
            new = t.restart(rid, now, sent_at=now - float(rng.uniform(0.0, 19.0)))
            if new is not None:
                model[rid] = new
        for rid in pick[5:15]:
            if rid in model and model[rid] > now:
                t.abort(rid, now)
                del model[rid]
        now += float(rng.uniform(0.5, 1.5))
        due = sorted((e, r) for r, e in model.items() if e <= now)
        out = t.expire(now)
        assert sorted(zip(out.expiries.tolist(), out.request_ids, strict=True)) == due
        assert list(out.expiries) == sorted(out.expiries)
        for _, r in due:
            del model[r]
        assert len(t) == len(model)
        if wave % 3 == 0:  # sometimes: an exact bound before the next expire, sometimes not
            assert t.next_deadline() == (min(model.values()) if model else None)
    assert len(t._cmin) >= 8  # the table spans many chunks
