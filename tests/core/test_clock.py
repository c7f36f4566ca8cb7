"""Clock clamping, rebasing, offset estimation and send-time mapping, with large skews."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvframe.core.clock import (
    ClockOffsetEstimator,
    ClockSample,
    DecoderBlocksTTL,
    MonotonicClamp,
    SendTimeMapper,
    rebase_deadline,
)
from kvframe.errors import ConfigError, LeaseError

SKEW = st.floats(min_value=-10_000.0, max_value=10_000.0)
DELAY = st.floats(min_value=0.0, max_value=2.0)
TIME = st.floats(min_value=0.0, max_value=1e5)
EPS = 1e-6  # float error at magnitudes of 1e5 s is about 1e-11; stay well clear of it


@given(st.lists(st.floats(min_value=-1e6, max_value=1e6), min_size=1, max_size=30))
def test_clamp_is_the_running_maximum(values: list[float]) -> None:
    c = MonotonicClamp()
    out = [c.advance(v) for v in values]
    assert out == [max(values[: i + 1]) for i in range(len(values))]
    assert c.regressions == sum(values[i] < max(values[:i]) for i in range(1, len(values)))
    assert c.latest == max(values)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, "1", None, True])
def test_clamp_rejects_non_times(bad: object) -> None:
    c = MonotonicClamp()
    with pytest.raises(LeaseError, match="finite number of seconds"):
        c.advance(bad)  # type: ignore[arg-type]
    assert c.latest is None


@given(SKEW, TIME, DELAY, DELAY, st.floats(min_value=0.0, max_value=600.0))
def test_rebase_is_never_late(
    skew: float, t0: float, there: float, back: float, remaining: float
) -> None:
    """D sends at t0 (its clock); P (clock = D's + skew) reads its clock when the request
    arrives and grants `remaining` seconds; D rebases with its send time. The local deadline
    is the true one minus the outbound delay: never later, whatever the skew."""
    p_now = t0 + there + skew
    p_deadline = p_now + remaining
    local = rebase_deadline(p_deadline, p_now, t0)
    true_local = p_deadline - skew
    assert local <= true_local + EPS
    assert local == pytest.approx(true_local - there, abs=EPS)
    # Rebasing with the receive time instead would be late by the outbound delay.
    assert rebase_deadline(p_deadline, p_now, t0 + there + back) >= true_local - EPS


def test_rebase_margin_and_errors() -> None:
    assert rebase_deadline(130.0, 100.0, 5.0, margin=2.0) == 33.0
    assert rebase_deadline(90.0, 100.0, 5.0) == -5.0  # already passed: say so
    with pytest.raises(LeaseError, match="margin"):
        rebase_deadline(1.0, 1.0, 1.0, margin=-1.0)
    with pytest.raises(LeaseError, match="deadline"):
        rebase_deadline(math.nan, 1.0, 1.0)
    with pytest.raises(LeaseError, match="sender_now"):
        rebase_deadline(1.0, math.inf, 1.0)


@given(
    SKEW,
    st.lists(st.tuples(TIME, DELAY, DELAY), min_size=1, max_size=10),
)
def test_offset_estimate_within_half_the_best_round_trip(
    skew: float, trips: list[tuple[float, float, float]]
) -> None:
    est = ClockOffsetEstimator()
    for t_send, there, back in trips:
        # The peer stamps its clock (= ours + skew) on arrival; the answer takes `back`.
        est.add(t_send, t_send + there + skew, t_send + there + back)
    best = min(there + back for _, there, back in trips)
    assert est.best is not None
    assert est.best.rtt == pytest.approx(best, abs=EPS)
    assert abs(est.offset - skew) <= est.uncertainty + EPS
    assert est.samples == len(trips)
    x = 12_345.0
    assert est.to_remote(est.to_local(x)) == pytest.approx(x, abs=EPS)
    # A peer reading maps to a local time within the uncertainty of the truth.
    assert abs(est.to_local(x) - (x - skew)) <= est.uncertainty + EPS


def test_estimator_needs_a_sample_and_valid_samples() -> None:
    est = ClockOffsetEstimator()
    with pytest.raises(LeaseError, match="no clock sample"):
        _ = est.offset
    with pytest.raises(LeaseError, match="earlier than t_send"):
        est.add(10.0, 5.0, 9.0)
    with pytest.raises(LeaseError, match="remote_ts"):
        est.add(1.0, math.nan, 2.0)
    assert est.samples == 0
    s = est.add(1.0, 101.5, 2.0)
    assert (s.offset, s.rtt, est.uncertainty) == (100.0, 1.0, 0.5)
    est.add(3.0, 103.0, 5.0)  # slower round trip: not kept
    assert est.best == s


@given(
    SKEW,
    st.lists(st.tuples(st.floats(min_value=0.0, max_value=50.0), DELAY), min_size=1, max_size=20),
    st.floats(min_value=0.0, max_value=0.01),
)
def test_send_time_mapper_is_never_early_and_never_after_receipt(
    skew: float, msgs: list[tuple[float, float]], min_delay: float
) -> None:
    """Messages sent at local times s_i (peer stamps s_i + skew) arrive after delay d_i. The
    mapped send time lies in [true send, receipt], and is late by at most the smallest delay
    seen so far (no drift here)."""
    mapper = SendTimeMapper(max_drift=0.0)
    t = 0.0
    smallest = math.inf
    for gap, extra in msgs:
        t += gap
        delay = min_delay + extra
        smallest = min(smallest, delay)
        mapped = mapper.observe(t + skew, t + delay)
        assert t - EPS <= mapped <= t + delay + EPS
        assert mapped - t <= smallest + EPS


@given(
    st.floats(min_value=-500e-6, max_value=500e-6),
    SKEW,
    st.lists(st.tuples(st.floats(min_value=0.0, max_value=600.0), DELAY), min_size=2, max_size=20),
)
def test_send_time_mapper_with_drift_is_never_early(
    rate: float, skew: float, msgs: list[tuple[float, float]]
) -> None:
    """The peer's clock runs at (1 + rate) of ours, |rate| <= max_drift: the widened bound
    still never maps a send time earlier than the truth."""
    mapper = SendTimeMapper()
    t = 0.0
    for gap, delay in msgs:
        t += gap
        mapped = mapper.observe(skew + t * (1 + rate), t + delay)
        assert mapped >= t - EPS


def test_mapper_and_bound() -> None:
    m = SendTimeMapper(max_drift=0.001)
    assert m.bound(0.0) is None
    assert m.observe(1000.0, 1.5) == 1.5
    assert m.bound(1.5) == pytest.approx(-998.5)
    assert m.bound(11.5) == pytest.approx(-998.5 + 0.01)
    assert m.observe(1010.0, 40.0) == pytest.approx(11.5 + 0.001 * 38.5)
    with pytest.raises(ConfigError, match="max_drift"):
        SendTimeMapper(max_drift=-1.0)


@given(SKEW, DELAY, DELAY, st.floats(min_value=0.0, max_value=1e4))
def test_decoder_ttl_deadline_is_safe_under_skew(
    skew: float, there: float, back: float, finished: float
) -> None:
    """D finished at `finished` (P's clock) and keeps its blocks for ttl on its own clock
    (P's + skew). P's reader deadline is at least safety_margin before the true end."""
    ttl = DecoderBlocksTTL.from_config()
    assert (ttl.ttl, ttl.safety_margin) == (480.0, 30.0)
    est = ClockOffsetEstimator()
    est.add(0.0, there + skew, there + back)
    remote_expiry = ttl.holder_expiry(finished + skew)
    p_deadline = ttl.reader_deadline(remote_expiry, est)
    true_end = finished + ttl.ttl
    assert p_deadline <= true_end - ttl.safety_margin + EPS
    assert p_deadline >= true_end - ttl.safety_margin - (there + back) - EPS


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"decoder_kv_blocks_ttl": 0}, "decoder_kv_blocks_ttl"),
        ({"decoder_kv_blocks_ttl": math.nan}, "decoder_kv_blocks_ttl"),
        ({"decoder_kv_blocks_ttl": True}, "decoder_kv_blocks_ttl"),
        ({"decoder_kv_blocks_ttl": "480"}, "decoder_kv_blocks_ttl"),
        ({"safety_margin": -1.0}, "safety_margin"),
        ({"safety_margin": math.inf}, "safety_margin"),
        ({"decoder_kv_blocks_ttl": 10.0, "safety_margin": 10.0}, "smaller than"),
    ],
)
def test_decoder_ttl_rejects_bad_config(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DecoderBlocksTTL.from_config(**kwargs)  # type: ignore[arg-type]


def test_decoder_ttl_zero_margin_allowed() -> None:
    assert DecoderBlocksTTL.from_config(60.0, 0.0).safety_margin == 0.0


@given(SKEW, TIME, DELAY, DELAY)
def test_sample_properties(skew: float, t: float, there: float, back: float) -> None:
    assume(there + back > 0)
    s = ClockSample(t_send=t, remote_ts=t + there + skew, t_recv=t + there + back)
    assert s.rtt == pytest.approx(there + back, abs=EPS)
    assert abs(s.offset - skew) <= s.rtt / 2 + EPS
