"""The decoder TTL's clock-offset rule and the reader's cap (bidirectional mode), as properties.

P pulls a decoder's kept blocks under ``not_after`` = D's expiry mapped onto P's clock by
:meth:`DecoderBlocksTTL.reader_deadline`: through the lowest-round-trip handshake sample, less
its uncertainty (half that round trip) and ``safety_margin``. With a true offset ``theta`` (D's
clock minus P's) and that sample's outbound and return transits ``a`` and ``b``, the sample's
offset is ``theta + (a - b) / 2`` and its uncertainty ``(a + b) / 2``, so the deadline is

    expiry - theta - a - safety_margin

exactly: never later than the true local time of D's expiry less the margin, and early by
the margin plus ``a``, which lies in ``[0, rtt_best]`` (= twice the uncertainty) whatever the
asymmetry. :class:`~kvframe.core.reader.LeaseReader` then never posts a read with less than
``margin`` left before the cap, never holds a confirmed bound beyond it, discards a read that
completes after it, fails at once a load added too close to it, and ``cap()`` only lowers.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import Phase, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvframe.core import wire
from kvframe.core.clock import ClockOffsetEstimator, DecoderBlocksTTL
from kvframe.core.lease import LeasePolicy, lease_handle
from kvframe.core.reader import (
    Action,
    LeaseReader,
    LoadEnded,
    PostRead,
    ReaderTimeouts,
    ReadState,
    SendMessage,
)

EPS = 1e-6  # readings reach ~3e6 s: a few roundings of ~5e-10 s each


# -- the offset rule ---------------------------------------------------------------------------
@settings(max_examples=min(settings().max_examples, 200))
@given(
    theta=st.floats(min_value=-1e6, max_value=1e6),
    trips=st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=1e5),  # P's send time
            st.floats(min_value=0.0, max_value=1.0),  # outbound transit
            st.floats(min_value=0.0, max_value=1.0),  # return transit
        ),
        min_size=1,
        max_size=8,
    ),
    expiry=st.floats(min_value=-2e6, max_value=2e6),
    margin=st.floats(min_value=0.0, max_value=60.0),
)
def test_reader_deadline_is_never_late_and_early_by_the_outbound_transit_at_most(
    theta: float, trips: list[tuple[float, float, float]], expiry: float, margin: float
) -> None:
    est = ClockOffsetEstimator()
    best: tuple[float, float] | None = None  # (rtt as the estimator computes it, outbound)
    for t_send, there, back in trips:
        # D stamps its clock (= P's + theta) when the handshake arrives; the answer takes `back`.
        t_recv = t_send + there + back
        est.add(t_send, t_send + there + theta, t_recv)
        rtt = t_recv - t_send
        if best is None or rtt < best[0]:
            best = (rtt, there)
    assert best is not None
    ttl = DecoderBlocksTTL.from_config(480.0, margin)
    got = ttl.reader_deadline(expiry, est)
    true_local = expiry - theta  # when D's clock reads `expiry`, on P's clock
    assert got <= true_local - margin + EPS, "late: P could read blocks D has dropped"
    assert got >= true_local - margin - est.uncertainty * 2 - EPS
    assert got == pytest.approx(true_local - margin - best[1], abs=EPS)


@settings(max_examples=min(settings().max_examples, 200))
@given(
    theta=st.floats(min_value=-1e6, max_value=1e6),
    finished=st.floats(min_value=0.0, max_value=1e5),
    there=st.floats(min_value=0.0, max_value=1.0),
    back=st.floats(min_value=0.0, max_value=1.0),
    ttl_s=st.floats(min_value=1.0, max_value=3600.0),
)
def test_a_kept_ticket_is_usable_for_ttl_less_margin_less_transit(
    theta: float, finished: float, there: float, back: float, ttl_s: float
) -> None:
    """D keeps blocks finished at ``finished`` (P's clock) for ``ttl`` on its own clock; the
    margin the connector uses by default, min(30, ttl / 4). P's cap lies in
    [end - margin - rtt, end - margin] for the true end."""
    margin = min(30.0, ttl_s / 4)
    ttl = DecoderBlocksTTL.from_config(ttl_s, margin)
    est = ClockOffsetEstimator()
    est.add(finished, finished + there + theta, finished + there + back)
    cap = ttl.reader_deadline(ttl.holder_expiry(finished + there + theta), est)
    true_end = finished + there + ttl_s
    assert true_end - margin - (there + back) - EPS <= cap <= true_end - margin + EPS


# -- the reader's cap --------------------------------------------------------------------------
E = "D"
POLICY = LeasePolicy.from_duration(6.0)  # interval 1, extension 4
T = ReaderTimeouts(
    margin=0.5, peer_timeout=3.0, confirm_timeout=4.0, transfer_timeout=5.0, resend_after=1.0
)
HOLDER = 5000.0  # the holder's clock reads this much more than the reader's


def ticks(lo: int, hi: int) -> st.SearchStrategy[float]:
    """Seconds in [lo/64, hi/64], multiples of 1/64 (exact in binary floating point)."""
    return st.integers(min_value=lo, max_value=hi).map(lambda k: k / 64)


# Seconds from now to a cap: around the margin (0.5) and well beyond it.
LEFT = st.sampled_from([-1.0, 0.0, 0.25, 0.5, 0.5 + 1 / 64, 1.0, 2.0, 3.0, 5.0, 8.0, 12.0])


class CappedReader(RuleBasedStateMachine):
    """One LeaseReader loading kept leases under caps; the holder is played by hand (it acks
    any heartbeat with any remaining time, as late as it likes), so only the cap keeps the
    reader's bounds down. Every action list the reader returns is checked."""

    def __init__(self) -> None:
        super().__init__()
        self.r = LeaseReader(POLICY, T, max_drift=0.0)
        self.t = 0.0
        self.n = 0
        self.ready = False
        self.caps: dict[str, float] = {}  # lease id -> the lowest cap given (inf: none)
        self.lease_of: dict[str, str] = {}  # load -> its lease id
        self.live: set[str] = set()  # loads not ended
        self.by_handle: dict[int, str] = {}
        self.beats: list[wire.Heartbeat] = []  # heartbeats sent, not yet answered
        self.connection(up=True)

    # -- helpers ---------------------------------------------------------------------------
    def _lid(self, k: int) -> str:
        lid = f"K{k}"
        self.by_handle[lease_handle(lid)] = lid
        return lid

    def _cap(self, lid: str) -> float:
        return self.caps.get(lid, math.inf)

    def _run(self, out: list[Action]) -> None:
        for a in out:
            if isinstance(a, SendMessage):
                assert self.ready, f"sent {a} while not connected"
                if isinstance(a.message, wire.Heartbeat):
                    self.beats.append(a.message)
            elif isinstance(a, PostRead):
                lid = self.lease_of[a.request_id]
                left = self._cap(lid) - self.t
                assert left >= T.margin, f"{a.request_id} posted {left} s before its cap"
                assert self.r.confirmed_bound(E, lid) <= self._cap(lid)
                event("posted under a cap" if left < math.inf else "posted, no cap")
            elif isinstance(a, LoadEnded):
                assert a.request_id in self.live, f"{a.request_id} ended twice"
                self.live.discard(a.request_id)
                if a.state is ReadState.DONE:
                    assert self.t < self._cap(self.lease_of[a.request_id]), "read kept past cap"

    # -- rules -----------------------------------------------------------------------------
    @rule(dt=st.sampled_from([0.0, 0.0, 1 / 64, 0.25, 0.5, 1.0, 2.0, 4.0]))
    def advance(self, dt: float) -> None:
        self.t += dt

    @rule(up=st.sampled_from([True, True, False]))
    def connection(self, up: bool) -> None:
        if up and not self.ready:
            self.ready = True
            self._run(self.r.peer_ready(E, self.t))
        elif not up and self.ready:
            self.ready = False
            self._run(self.r.peer_lost(E, self.t))

    @rule()
    def heartbeat_ahead(self) -> None:
        """Symmetric leases: P heartbeats the next load's lease before the load exists."""
        self._run(self.r.heartbeat(E, [self._lid(self.n + 1)], self.t))

    @rule(left=st.one_of(st.none(), LEFT, ticks(-64, 64 * 12)))
    def add(self, left: float | None) -> None:
        self.n += 1
        rid, lid = f"q{self.n}", self._lid(self.n)
        self.lease_of[rid] = lid
        self.live.add(rid)
        cap = None if left is None else self.t + left
        if cap is not None:
            self.caps[lid] = cap
        out = self.r.add(rid, E, lid, self.t, not_after=cap)
        self._run(out)
        if cap is not None and cap - self.t <= T.margin:
            # Too close: it fails at once, the lease is released, nothing is asked or read.
            event("added past its cap")
            assert rid not in self.live
            (end,) = [a for a in out if isinstance(a, LoadEnded)]
            assert end.state is ReadState.FAILED
            assert "recompute" in (end.reason or "")
            assert not any(isinstance(a, PostRead) for a in out)
            msgs = [a.message for a in out if isinstance(a, SendMessage)]
            if self.ready:
                (done,) = msgs
                assert isinstance(done, wire.LeaseDone)
                assert done.reason is wire.DoneReason.RELEASED
                assert done.handles == (lease_handle(lid),)
            else:
                assert msgs == []
        else:
            assert rid in self.live

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), left=st.one_of(LEFT, ticks(-64, 64 * 12)))
    def cap(self, data: st.DataObject, left: float) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        lid = self.lease_of[rid]
        before = (self.r.state(rid), self.r.confirmed_bound(E, lid))
        due = self.r.next_deadline()
        new = self.t + left
        out = self.r.cap(rid, new, self.t)
        if new < self._cap(lid):
            self.caps[lid] = new
        elif self.r.state(rid) is not None:
            # A cap only lowers: a higher one changes nothing.
            assert out == []
            assert (self.r.state(rid), self.r.confirmed_bound(E, lid)) == before
        else:
            # ... except that any call may end a load already past its deadline.
            assert due is not None
            assert due <= self.t
        self._run(out)

    @precondition(lambda self: bool(self.beats))
    @rule(
        data=st.data(),
        lag=ticks(0, 64 * 2),
        remaining=st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 30.0]),
    )
    def ack(self, data: st.DataObject, lag: float, remaining: float) -> None:
        """The holder answers a heartbeat: each lease lasts ``remaining`` more seconds of its
        clock, stamped ``lag`` after the heartbeat left (the reader may hear it much later)."""
        hb = self.beats.pop(data.draw(st.integers(0, len(self.beats) - 1)))
        holder_now = hb.sent_at + HOLDER + lag
        msg = wire.LeaseAck(
            echo_seq=hb.seq,
            holder_now=holder_now,
            expiry=holder_now + remaining,
            handles=hb.handles,
        )
        self._run(self.r.receive(E, msg, self.t))

    @precondition(lambda self: bool(self.r.loads(ReadState.POSTED)))
    @rule(data=st.data(), late=st.sampled_from([None, 0.0, 1 / 64]))
    def transfer_done(self, data: st.DataObject, late: float | None) -> None:
        """A posted read completes now or (``late``) at or just after its cap, untimed."""
        rid = data.draw(st.sampled_from(sorted(self.r.loads(ReadState.POSTED))))
        lid = self.lease_of[rid]
        if late is not None and self._cap(lid) < math.inf:
            self.t = max(self.t, self._cap(lid) + late)
        out = self.r.transfer_done(rid, self.t)
        self._run(out)
        (end,) = [a for a in out if isinstance(a, LoadEnded)]
        if self.t >= self._cap(lid):
            event("read completed after its cap")
            assert end.state is ReadState.FAILED, "a read completed after the cap was kept"

    @rule()
    def tick(self) -> None:
        self._run(self.r.tick(self.t))
        for rid in self.r.loads():
            # Nothing waits, confirms or reads within `margin` of its cap.
            assert self._cap(self.lease_of[rid]) - T.margin > self.t

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self._run(self.r.abort(data.draw(st.sampled_from(sorted(self.live))), self.t))

    # -- invariants ------------------------------------------------------------------------
    @invariant()
    def bounds_never_pass_the_cap(self) -> None:
        for lid in self.caps:
            assert self.r.confirmed_bound(E, lid) <= self.caps[lid]

    @invariant()
    def loads_match(self) -> None:
        assert set(self.r.loads()) == self.live


TestCappedReader = CappedReader.TestCase
TestCappedReader.settings = settings(
    TestCappedReader.settings,
    max_examples=min(settings().max_examples, 80),
    stateful_step_count=40,
    report_multiple_bugs=False,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)
