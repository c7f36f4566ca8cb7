"""The lease transition table: every legal transition, and every (state x event) pair."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvframe.core.lease import (
    TRANSITIONS,
    LeaseEvent,
    LeasePolicy,
    LeaseState,
    LeaseTable,
    RenewIgnored,
    Transition,
    next_state,
    state_diagram,
    transition_table,
)
from kvframe.errors import ConfigError, InvalidTransitionError

POLICY = LeasePolicy.from_duration(30.0)  # interval 5, extension 20
RID = "req-1"
LEGAL = {(t.source, t.event): t.target for t in TRANSITIONS}


def table_in(state: LeaseState) -> LeaseTable[str]:
    """A table where RID's lease is in ``state`` (the clock at 100)."""
    table: LeaseTable[str] = LeaseTable(POLICY)
    table.grant("other", 0.0, "other-blocks")  # a bystander that must never be disturbed
    if state is LeaseState.ABSENT:
        table.expire(100.0)
        return table
    table.grant(RID, 80.0, "blocks")
    if state is LeaseState.CONSUMED:
        table.consume(RID, 90.0)
    elif state is LeaseState.ABORTED:
        table.abort(RID, 90.0)
    elif state is LeaseState.EXPIRED:
        assert [x.request_id for x in table.expire(110.0)] == ["other", RID]
    table.expire(100.0)
    return table


def apply(table: LeaseTable[str], event: LeaseEvent, now: float) -> None:
    if event is LeaseEvent.GRANT:
        table.grant(RID, now, "new-blocks")
    elif event is LeaseEvent.RENEW:
        table.renew([RID], now)
    elif event is LeaseEvent.CONSUME:
        table.consume(RID, now)
    elif event is LeaseEvent.ABORT:
        table.abort(RID, now)
    else:
        lease = table.lease(RID)
        table.expire(max(now, lease.expiry if lease is not None else now))


def observable(table: LeaseTable[str]) -> tuple[object, ...]:
    return (table.lease(RID), table.lease("other"), len(table), table.next_deadline())


def test_the_table_covers_exactly_the_documented_legal_pairs() -> None:
    assert len(LEGAL) == len(TRANSITIONS), "a (state, event) pair is listed twice"
    assert set(LEGAL) == {
        (LeaseState.ABSENT, LeaseEvent.GRANT),
        (LeaseState.ABSENT, LeaseEvent.RENEW),
        (LeaseState.LIVE, LeaseEvent.RENEW),
        (LeaseState.LIVE, LeaseEvent.CONSUME),
        (LeaseState.LIVE, LeaseEvent.ABORT),
        (LeaseState.LIVE, LeaseEvent.EXPIRE),
        (LeaseState.CONSUMED, LeaseEvent.RENEW),
        (LeaseState.ABORTED, LeaseEvent.RENEW),
        (LeaseState.EXPIRED, LeaseEvent.RENEW),
    }
    # Ended states are terminal: nothing leads out of them.
    for (source, _), target in LEGAL.items():
        if source.ended:
            assert target is source


@pytest.mark.parametrize("rule", TRANSITIONS, ids=lambda t: f"{t.source.value}-{t.event.value}")
def test_every_legal_transition(rule: Transition) -> None:
    table = table_in(rule.source)
    assert table.state(RID) is rule.source
    before = table.counters
    apply(table, rule.event, 101.0)
    assert table.state(RID) is rule.target
    after = table.counters
    lease = table.lease(RID)
    if rule.event is LeaseEvent.GRANT:
        assert lease is not None
        assert (lease.granted_at, lease.expiry, lease.payload) == (101.0, 131.0, "new-blocks")
        assert after.granted == before.granted + 1
    elif rule.event is LeaseEvent.RENEW and rule.source is LeaseState.LIVE:
        assert lease is not None
        assert lease.expiry == 121.0  # max(80 + 30, 101 + 20)
        assert lease.renewals == 1
        assert after.renewed == before.renewed + 1
    elif rule.event is LeaseEvent.RENEW:
        assert after.renew_ignored == before.renew_ignored + 1
        assert after.renewed == before.renewed
    else:
        assert lease is not None
        assert lease.state is rule.target
        assert lease.ended_at is not None
        assert lease.payload == "blocks"
        counter = {
            LeaseEvent.CONSUME: "consumed",
            LeaseEvent.ABORT: "aborted",
            LeaseEvent.EXPIRE: "expired",
        }[rule.event]
        assert getattr(after, counter) == getattr(before, counter) + 1
    # The bystander's 30 s ran out by t=100 in every starting table; nothing revived it.
    assert table.state("other") is LeaseState.EXPIRED


@pytest.mark.parametrize("event", list(LeaseEvent), ids=lambda e: e.value)
@pytest.mark.parametrize("state", list(LeaseState), ids=lambda s: s.value)
def test_every_state_event_pair(state: LeaseState, event: LeaseEvent) -> None:
    """Exhaustive: legal pairs move to the table's target; illegal ones raise a precise
    InvalidTransitionError and change nothing observable."""
    table = table_in(state)
    if (state, event) in LEGAL:
        assert next_state(state, event) is LEGAL[(state, event)]
        apply(table, event, 101.0)
        assert table.state(RID) is LEGAL[(state, event)]
        return
    with pytest.raises(InvalidTransitionError) as info:
        next_state(state, event, RID)
    message = str(info.value)
    assert event.value in message
    assert state.value in message
    assert RID in message
    before = observable(table)
    counters = table.counters
    if event is LeaseEvent.EXPIRE:
        # The API has no per-id expire: reaping must simply leave this lease alone.
        table.expire(101.0)
        assert table.state(RID) is state
    else:
        with pytest.raises(InvalidTransitionError, match=event.value):
            apply(table, event, 101.0)
    assert observable(table) == before
    assert table.counters.granted == counters.granted
    assert table.counters.expired == counters.expired


def test_state_diagram_is_drawn_from_the_table() -> None:
    diagram = state_diagram()
    assert diagram.startswith("```mermaid\nstateDiagram-v2\n")
    assert diagram.rstrip().endswith("```")
    for t in TRANSITIONS:
        assert f"{t.source.value} --> {t.target.value}: {t.event.value}" in diagram
    arrows = [line for line in diagram.splitlines() if "-->" in line and "[*]" not in line]
    assert len(arrows) == len(TRANSITIONS)


def test_transition_table_lists_legal_and_illegal_pairs() -> None:
    text = transition_table()
    for t in TRANSITIONS:
        assert f"| `{t.source.value}` | `{t.event.value}` | `{t.target.value}` |" in text
    assert "`live` × `grant`" in text
    assert "`absent` × `consume`" in text


# -- the timing policy ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("duration", "interval", "extension"),
    [
        (30.0, 5.0, 20.0),
        (30, 5.0, 20.0),
        (31.0, 5.0, 20.0),
        (6.0, 1.0, 4.0),
        (100.5, 16.0, 67.0),
        (5.0, 5 / 6, 10 / 3),
        (0.6, 0.1, 0.4),
    ],
)
def test_policy_from_one_number(duration: float, interval: float, extension: float) -> None:
    p = LeasePolicy.from_duration(duration)
    assert p.duration == duration
    assert p.heartbeat_interval == pytest.approx(interval)
    assert p.extension == pytest.approx(extension)


def test_policy_default_is_thirty_seconds() -> None:
    assert LeasePolicy.from_duration() == LeasePolicy(
        duration=30.0, heartbeat_interval=5.0, extension=20.0
    )


@given(st.floats(min_value=1e-6, max_value=1e7, allow_nan=False, allow_infinity=False))
def test_policy_is_always_usable(duration: float) -> None:
    p = LeasePolicy.from_duration(duration)
    assert 0 < p.heartbeat_interval < p.extension < p.duration
    # Four intervals per extension: three heartbeats in a row may be lost.
    assert p.extension >= 4 * p.heartbeat_interval * (1 - 1e-12)


@pytest.mark.parametrize(
    "bad", [0, 0.0, -1.0, -30, math.nan, math.inf, -math.inf, True, False, "30", None, [30]]
)
def test_policy_rejects_bad_durations_naming_the_value(bad: object) -> None:
    with pytest.raises(ConfigError, match="kv_lease_duration") as info:
        LeasePolicy.from_duration(bad)  # type: ignore[arg-type]
    assert repr(bad) in str(info.value)


def test_direct_policy_needs_interval_below_extension() -> None:
    with pytest.raises(ConfigError, match="heartbeat_interval"):
        LeasePolicy(duration=30.0, heartbeat_interval=20.0, extension=20.0)
    with pytest.raises(ConfigError, match="extension"):
        LeasePolicy(duration=30.0, heartbeat_interval=5.0, extension=math.nan)


def test_renew_reasons_cover_every_ended_state() -> None:
    reasons = {r.value for r in RenewIgnored}
    assert {s.value for s in LeaseState if s.ended} <= reasons
