"""A fake clock for tests: time moves only when the test says so."""

from __future__ import annotations

import math

__all__ = ["FakeClock"]


class FakeClock:
    """A clock a test drives by hand (like trio's ``MockClock`` with ``rate = 0``).

    ``now()`` (or calling the clock) answers the current time in seconds; :meth:`advance`
    and :meth:`set` change it. Time may be set backwards on purpose, to test code that must
    survive a clock step (NTP, a VM migration): the lease core takes ``now`` from the caller,
    and this clock is how tests feed it a misbehaving one.
    """

    def __init__(self, start: float = 0.0) -> None:
        """Start at ``start`` seconds. Raises ``ValueError`` for a NaN or infinite start."""
        self._now = self._finite(start, "start")

    def now(self) -> float:
        """The current fake time in seconds."""
        return self._now

    def __call__(self) -> float:
        """Same as :meth:`now`, so the clock can be passed where ``Callable[[], float]`` is
        expected (``time.monotonic``'s shape)."""
        return self._now

    def advance(self, dt: float) -> float:
        """Move the time by ``dt`` seconds (negative goes backwards) and return the new time.

        Raises ``ValueError`` for a NaN or infinite ``dt``; the time is then unchanged.
        """
        self._now = self._finite(self._now + self._finite(dt, "dt"), "the new time")
        return self._now

    def set(self, t: float) -> None:
        """Jump to ``t`` seconds, forwards or backwards.

        Raises ``ValueError`` for a NaN or infinite ``t``; the time is then unchanged.
        """
        self._now = self._finite(t, "t")

    def __repr__(self) -> str:
        return f"FakeClock(now={self._now!r})"

    @staticmethod
    def _finite(value: float, what: str) -> float:
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"FakeClock: {what} = {value!r}; give a finite number of seconds")
        return value
