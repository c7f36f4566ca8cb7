from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvframe.testing import FakeClock

finite = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e9, max_value=1e9)


def test_starts_where_told_and_moves_only_when_told() -> None:
    clock = FakeClock(5.0)
    assert clock.now() == 5.0
    assert clock() == 5.0
    assert clock.advance(1.5) == 6.5
    clock.set(2.0)  # backwards, on purpose
    assert clock.now() == 2.0
    assert clock.advance(-1.0) == 1.0
    assert repr(clock) == "FakeClock(now=1.0)"
    assert FakeClock().now() == 0.0


@given(start=finite, steps=st.lists(finite, max_size=20))
def test_advance_adds_up(start: float, steps: list[float]) -> None:
    clock = FakeClock(start)
    expected = start
    for dt in steps:
        expected += dt
        assert clock.advance(dt) == expected
    assert clock.now() == expected


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_times_are_rejected_and_time_is_unchanged(bad: float) -> None:
    clock = FakeClock(3.0)
    with pytest.raises(ValueError, match="finite"):
        clock.advance(bad)
    with pytest.raises(ValueError, match="finite"):
        clock.set(bad)
    with pytest.raises(ValueError, match="finite"):
        FakeClock(bad)
    assert clock.now() == 3.0
