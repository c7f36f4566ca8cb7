"""Time across processes: clamping, deadline rebasing, clock-offset estimation, send-time mapping.

Every process reads its own monotonic clock, and two processes' monotonic clocks share no
epoch: a reading from another process is meaningless here until it is *mapped*. This module
never reads a clock; callers pass their readings in.

Three rules keep leases safe across processes:

1. **Ship remaining time, not timestamps.** A deadline granted in one process travels with the
   granting side's clock reading at the moment it was computed (``deadline``, ``sender_now``).
   The receiver keeps the *remaining time* and adds it to a local reading taken no later than
   the sender's (:func:`rebase_deadline`): the time it sent the request that caused the
   grant. Transit time then only ever shortens the local deadline.
2. **Estimate the offset from the lowest round trip.** :class:`ClockOffsetEstimator` takes
   handshake samples ``(t_send, remote_ts, t_recv)`` and keeps the one with the smallest round
   trip: ``offset = remote_ts - (t_send + t_recv) / 2``, accurate to ``± rtt / 2``.
3. **Never let time run backwards.** :class:`MonotonicClamp` turns the ``now`` values a
   caller passes into a non-decreasing sequence, so a caller bug (or a clock mixed up between
   threads) can never shorten or un-expire anything.
"""

from __future__ import annotations

import attrs

from kvframe.core._checks import check_config_seconds, check_now
from kvframe.errors import ConfigError, LeaseError

__all__ = [
    "DEFAULT_MAX_DRIFT",
    "ClockOffsetEstimator",
    "ClockSample",
    "DecoderBlocksTTL",
    "MonotonicClamp",
    "SendTimeMapper",
    "rebase_deadline",
]

#: Largest rate (seconds per second) at which two hosts' monotonic clocks are assumed to drift
#: apart: 500 ppm, the most NTP ever slews a clock.
DEFAULT_MAX_DRIFT = 500e-6


class MonotonicClamp:
    """Turns caller-supplied ``now`` values into a non-decreasing sequence.

    :meth:`advance` answers ``max(previous, now)``. A smaller ``now`` than before is a caller
    bug or a reading from another clock; it is clamped (and counted in :attr:`regressions`)
    rather than rejected, because refusing it would leave leases un-reaped, and honouring it
    could shorten a lease or revive an expired one.
    """

    __slots__ = ("_latest", "regressions")

    def __init__(self) -> None:
        self._latest: float | None = None
        self.regressions = 0
        """How many times :meth:`advance` was given a ``now`` smaller than an earlier one."""

    @property
    def latest(self) -> float | None:
        """The largest ``now`` seen, or ``None`` before the first call."""
        return self._latest

    def advance(self, now: float) -> float:
        """Record ``now`` and return ``max(now, every earlier now)``.

        Raises :class:`~kvframe.errors.LeaseError` for a NaN, infinite or non-numeric
        ``now``; nothing is recorded then.
        """
        t = check_now(now)
        latest = self._latest
        if latest is None or t >= latest:
            self._latest = t
            return t
        self.regressions += 1
        return latest


def rebase_deadline(
    deadline: float, sender_now: float, local_now: float, *, margin: float = 0.0
) -> float:
    """A deadline from another process's clock, mapped onto this process's clock.

    :param deadline: the deadline on the sender's clock (for example a lease expiry).
    :param sender_now: the sender's clock reading when it computed ``deadline``.
    :param local_now: a local reading taken *no later than* the moment the sender read
        ``sender_now``. The time this side sent the request that caused the answer qualifies
        (the answer cannot have been computed before the request left). The receive time does
        not: it is later by the transit time, which would lengthen the deadline.
    :param margin: seconds to subtract for safety (e.g. the time a read needs to finish).
    :returns: ``local_now + (deadline - sender_now) - margin``. It may be ``<= local_now``:
        the deadline has already passed (or will within the margin).
    :raises LeaseError: for any NaN, infinite or non-numeric argument, or a negative margin.
    """
    d = check_now(deadline, "deadline")
    s = check_now(sender_now, "sender_now")
    n = check_now(local_now, "local_now")
    m = check_now(margin, "margin")
    if m < 0:
        raise LeaseError(f"margin must be >= 0 seconds, got {margin!r}")
    return n + (d - s) - m


def _check_sample(instance: ClockSample, attribute: attrs.Attribute[float], value: float) -> None:
    check_now(value, attribute.name)


@attrs.frozen(kw_only=True)
class ClockSample:
    """One handshake round trip: this side sent at ``t_send``, the peer stamped ``remote_ts``
    (its clock), this side received the answer at ``t_recv``.

    Raises :class:`~kvframe.errors.LeaseError` for non-finite values or ``t_recv < t_send``.
    """

    t_send: float = attrs.field(validator=_check_sample)
    remote_ts: float = attrs.field(validator=_check_sample)
    t_recv: float = attrs.field(validator=_check_sample)

    def __attrs_post_init__(self) -> None:
        if self.t_recv < self.t_send:
            raise LeaseError(
                f"t_recv ({self.t_recv!r}) is earlier than t_send ({self.t_send!r}): both must "
                "come from this side's monotonic clock, read before sending and after receiving"
            )

    @property
    def rtt(self) -> float:
        """Round-trip time in seconds."""
        return self.t_recv - self.t_send

    @property
    def offset(self) -> float:
        """``remote_ts - (t_send + t_recv) / 2``: the peer's clock minus this side's, assuming
        a symmetric path. Off by at most ``rtt / 2`` whatever the asymmetry."""
        return self.remote_ts - (self.t_send + self.t_recv) / 2


class ClockOffsetEstimator:
    """The offset between a peer's clock and this side's, from handshake round trips.

    Keeps the sample with the lowest round-trip time (the least queueing, hence the tightest
    bound). With that sample's offset ``o`` and round trip ``r``, a peer reading ``x``
    happened at local time ``x - o``, give or take ``r / 2``.
    """

    __slots__ = ("_best", "samples")

    def __init__(self) -> None:
        self._best: ClockSample | None = None
        self.samples = 0
        """Number of samples offered to :meth:`add`."""

    def add(self, t_send: float, remote_ts: float, t_recv: float) -> ClockSample:
        """Offer one round trip; returns the best sample kept (possibly an earlier one).

        Raises :class:`~kvframe.errors.LeaseError` for a malformed sample (see
        :class:`ClockSample`); the estimator is unchanged then.
        """
        sample = ClockSample(t_send=t_send, remote_ts=remote_ts, t_recv=t_recv)
        self.samples += 1
        if self._best is None or sample.rtt < self._best.rtt:
            self._best = sample
        return self._best

    @property
    def best(self) -> ClockSample | None:
        """The lowest-round-trip sample so far, or ``None`` before the first."""
        return self._best

    def _require(self) -> ClockSample:
        if self._best is None:
            raise LeaseError("no clock sample yet: call add() with a handshake round trip first")
        return self._best

    @property
    def offset(self) -> float:
        """Peer clock minus local clock, in seconds. Raises LeaseError before any sample."""
        return self._require().offset

    @property
    def uncertainty(self) -> float:
        """Half the best round trip: the offset is right to within this many seconds.
        Raises LeaseError before any sample."""
        return self._require().rtt / 2

    def to_local(self, remote_ts: float) -> float:
        """A peer clock reading mapped onto the local clock (central estimate; subtract
        :attr:`uncertainty` for a bound that is never late). Raises LeaseError before any
        sample or for a non-finite reading."""
        return check_now(remote_ts, "remote_ts") - self.offset

    def to_remote(self, local_ts: float) -> float:
        """A local clock reading mapped onto the peer's clock (central estimate). Raises
        LeaseError before any sample or for a non-finite reading."""
        return check_now(local_ts, "local_ts") + self.offset


class SendTimeMapper:
    """Maps a peer's send timestamps onto this side's clock, never too early, for staleness.

    Every message the peer stamps with its send time ``s`` and this side receives at ``r``
    bounds the true mapping: ``local(s) <= r`` (transit takes no negative time), so
    ``base = r - s`` is an upper bound on "local minus peer". The mapper keeps the smallest
    such bound seen and returns ``s + base`` for each new message: the message's send time on
    the local clock, late by at most the fastest transit seen (microseconds on a LAN). A
    message that sat in a queue for 31 s is mapped 31 s into the past, however late it
    arrives, which is what lets a holder ignore a stale burst of heartbeats.

    Clocks drift: a bound set an hour ago may have become too small. The bound is therefore
    widened by ``max_drift`` seconds per second of its age, so it stays an upper bound for
    any drift up to ``max_drift`` (default :data:`DEFAULT_MAX_DRIFT`). Seed it with the
    handshake sample (``observe(sample.remote_ts, sample.t_recv)``) so that the first
    heartbeats cannot set a loose bound.
    """

    __slots__ = ("_at", "_base", "max_drift")

    def __init__(self, max_drift: float = DEFAULT_MAX_DRIFT) -> None:
        self.max_drift = check_config_seconds("max_drift", max_drift, allow_zero=True)
        self._base: float | None = None
        self._at = 0.0

    def bound(self, now: float) -> float | None:
        """The current upper bound on "local clock minus peer clock" at local time ``now``
        (widened for drift), or ``None`` before the first observation."""
        if self._base is None:
            return None
        return self._base + self.max_drift * max(0.0, check_now(now) - self._at)

    def observe(self, remote_sent: float, local_recv: float) -> float:
        """Record a message the peer sent at ``remote_sent`` (its clock) and this side
        received at ``local_recv``; return its send time on the local clock.

        The result is ``<= local_recv`` and is never earlier than the true send time (for
        drift up to ``max_drift``). Raises :class:`~kvframe.errors.LeaseError` for non-finite
        readings; nothing is recorded then.
        """
        s = check_now(remote_sent, "remote_sent")
        r = check_now(local_recv, "local_recv")
        candidate = r - s
        current = self.bound(r)
        if current is None or candidate <= current:
            self._base = candidate
            self._at = r
            return r
        return min(r, s + current)


@attrs.frozen(kw_only=True)
class DecoderBlocksTTL:
    """How long D keeps a finished request's KV blocks in bidirectional (multi-turn) mode,
    and how P turns D's deadline into one it can safely act on.

    D keeps the blocks until ``holder_expiry(now) = now + ttl`` on its own clock and tells P
    that deadline together with its clock reading. P maps it with
    :meth:`reader_deadline`: through the offset estimator, minus the estimator's uncertainty
    and ``safety_margin``. P starts a read of those blocks only before that deadline.

    Build it with :meth:`from_config`.
    """

    ttl: float
    """``decoder_kv_blocks_ttl``: seconds D keeps the blocks (default 480)."""
    safety_margin: float
    """Seconds P subtracts to cover drift, the read itself and scheduling delays."""

    @classmethod
    def from_config(
        cls, decoder_kv_blocks_ttl: float = 480.0, safety_margin: float = 30.0
    ) -> DecoderBlocksTTL:
        """Validate and build.

        Raises :class:`~kvframe.errors.ConfigError` naming the value when either is not a
        finite positive number (bool excluded; ``safety_margin`` may be 0) or when
        ``safety_margin >= decoder_kv_blocks_ttl`` (P could never read).
        """
        ttl = check_config_seconds("decoder_kv_blocks_ttl", decoder_kv_blocks_ttl)
        margin = check_config_seconds("safety_margin", safety_margin, allow_zero=True)
        if margin >= ttl:
            raise ConfigError(
                f"safety_margin ({safety_margin!r}) must be smaller than decoder_kv_blocks_ttl "
                f"({decoder_kv_blocks_ttl!r}), or the reader could never use the blocks"
            )
        return cls(ttl=ttl, safety_margin=margin)

    def holder_expiry(self, now: float) -> float:
        """D's side: the deadline (D's clock) for blocks finished at ``now``."""
        return check_now(now) + self.ttl

    def reader_deadline(self, remote_expiry: float, estimator: ClockOffsetEstimator) -> float:
        """P's side: D's ``remote_expiry`` (D's clock) as a deadline on P's clock, early by the
        estimator's uncertainty plus ``safety_margin``.

        Raises :class:`~kvframe.errors.LeaseError` when the estimator has no sample yet or the
        expiry is not finite.
        """
        return estimator.to_local(remote_expiry) - estimator.uncertainty - self.safety_margin
