"""LeaseReader and LeaseHolder together, through a network that delays, reorders, duplicates
and drops, with skewed and drifting clocks, transfers that take any time or fail, and a holder
whose freed blocks are reused at once (``pdsim.py`` models all of it and makes the checks).

Two drivers:

- :class:`PDNetwork`, a Hypothesis state machine in which anything may happen in any order
  (safety: no read is accepted unless it landed before the holder ended its lease, whatever
  the network did; every load ends exactly once, within the reader's bound);
- :func:`test_leases_renewed_on_time_never_expire`, an event loop in which every message
  arrives within less than a heartbeat interval, in order or not (liveness: a lease its reader
  keeps heartbeating is never reclaimed).

Before them, the schedules the state machine cannot easily reach, written out step by step.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import sys

import attrs
import pytest
from hypothesis import Phase, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from kvframe.core import wire
from kvframe.core.heartbeat import HeartbeatTracker, StopReason
from kvframe.core.holder import LeaseHolder
from kvframe.core.lease import Lease
from kvframe.core.reader import Action, LeaseReader, LoadEnded, PostRead, ReadState, SendMessage
from tests.core import pdsim
from tests.core.pdsim import ENGINE, INCARNATION, RATE_HIGH, RATE_LOW, STALE_INCARNATION

READERS = ["D1", "D2"]
OFFSETS = st.one_of(
    st.sampled_from([0.0, -10_000.0, 10_000.0]),
    st.floats(min_value=-10_000.0, max_value=10_000.0, allow_nan=False),
)
RATES = st.one_of(
    st.sampled_from([RATE_LOW, 1.0, RATE_HIGH]),
    st.floats(min_value=RATE_LOW, max_value=RATE_HIGH),
)
DT = st.one_of(
    st.sampled_from([0.0, 0.01, 0.3, 0.6, 1.0, 2.5, 4.5, 12.0]),
    st.floats(min_value=0.0, max_value=6.0),
)


# -- known schedules ---------------------------------------------------------------------------
def _pair() -> tuple[LeaseHolder[str], LeaseReader]:
    holder: LeaseHolder[str] = LeaseHolder(pdsim.POLICY, max_drift=pdsim.MAX_DRIFT)
    holder.grant("L", 0.0, "blocks")
    reader = LeaseReader(pdsim.POLICY, pdsim.TIMEOUTS, max_drift=pdsim.MAX_DRIFT)
    assert reader.peer_ready(ENGINE, 0.0, incarnation=INCARNATION) == []
    return holder, reader


def _message(actions: list[Action]) -> wire.Message:
    [action] = [a for a in actions if isinstance(a, SendMessage)]
    return action.message


def test_a_release_by_a_retried_request_does_not_free_a_read_in_flight() -> None:
    """A router retry put the same ticket in two requests on one decoder: q1 loads; q2 ends
    before its load, so the scheduler releases the ticket while q1's READ is in flight."""
    holder, reader = _pair()
    hb = _message(reader.add("q1", ENGINE, "L", 0.0, incarnation=INCARNATION))
    [ack] = holder.receive("D", hb, 0.0).replies
    [post] = reader.receive(ENGINE, ack, 0.0)
    assert isinstance(post, PostRead)
    freed: list[Lease[str]] = []
    for action in reader.release(ENGINE, ["L"], 0.1):  # q2 ended before its load
        assert isinstance(action, SendMessage)
        freed += holder.receive("D", action.message, 0.1).ended
    [end] = reader.transfer_done("q1", 0.2)
    assert isinstance(end, LoadEnded)
    assert not (freed and end.state is ReadState.DONE), (
        "q1 accepted a read of blocks the holder freed (on q2's release) while it was in flight"
    )


def test_a_replayed_ticket_is_not_read_while_a_release_of_its_first_use_is_in_flight() -> None:
    """q1's load is aborted before any answer came (its release sits in the network); 5 s
    later a router retry hands the same ticket to this decoder again (q2)."""
    holder, reader = _pair()
    reader.add("q1", ENGINE, "L", 0.0, incarnation=INCARNATION)  # its heartbeat is lost
    release = _message(reader.abort("q1", 0.1))  # delayed in the network
    reader.tick(5.0)
    out = reader.add("q2", ENGINE, "L", 5.0, incarnation=INCARNATION)
    if any(isinstance(a, LoadEnded) for a in out):
        return  # refused at once: single-use
    [ack] = holder.receive("D", _message(out), 5.0).replies
    [post] = reader.receive(ENGINE, ack, 5.0)
    assert isinstance(post, PostRead)
    freed = holder.receive("D", release, 5.1).ended  # q1's release arrives at last
    [end] = reader.transfer_done("q2", 5.2)
    assert isinstance(end, LoadEnded)
    assert not (freed and end.state is ReadState.DONE), (
        "q2 accepted a read of blocks the holder freed (on q1's late release) while it was in "
        "flight: the reader forgot that the ticket was spent"
    )


@pytest.mark.parametrize("found", ["table", "early"])
def test_a_table_read_never_vouches_for_a_read_that_landed_after_the_lease_ended(
    found: str,
) -> None:
    """A router retry: D2 reads a ticket D1 already consumed. D2's optimistic READ lands on
    reused blocks and is reported before any answer; then its worker READs the holder's table.
    Found now (``table``), the slot is empty; a tag read before the completion was seen
    (``early``) is still the lease's, but the reader must not take it."""
    w = pdsim.World(
        ordered=True,
        holder_clock=pdsim.Clock(0.0, 1.0),
        reader_clocks={"D1": pdsim.Clock(0.0, 1.0), "D2": pdsim.Clock(0.0, 1.0)},
        optimistic=["D1", "D2"],
    )
    w.connect("D1", INCARNATION)
    w.connect("D2", INCARNATION)
    lid = w.grant()
    w.add("D1", lid, INCARNATION)
    [first] = w.flying()
    w.land(first, notify_now=False)
    w.report(first)
    w.check_table(first, "table")  # D1's own read: proven by the table
    assert w.loads[first.rid].ends[0].state is ReadState.DONE
    while w.net.packets:  # D1's heartbeat and done notice: the holder ends the lease
        w.deliver(0)
    assert w.leases[lid].ended is not None
    w.add("D2", lid, INCARNATION)
    [second] = w.flying()
    w.land(second, notify_now=False)
    w.report(second)
    assert [tr.rid for tr in w.verifying()] == [second.rid]
    w.check_table(second, found)
    w.check()
    assert not w.loads[second.rid].ends
    assert w.sides["D2"].reader.state(second.rid) is ReadState.VERIFYING


@attrs.frozen
class Ticket:
    """One request on a reader's scheduler, holding a ticket (``kv_transfer_params``)."""

    reader: str
    lid: str
    incarnation: str | None


class PDNetwork(RuleBasedStateMachine):
    """One holder, two readers, everything adversarial; the checks live in ``pdsim.World``."""

    tickets = Bundle("tickets")

    def __init__(self) -> None:
        super().__init__()
        self.world: pdsim.World | None = None

    @property
    def w(self) -> pdsim.World:
        assert self.world is not None
        return self.world

    @initialize(
        ordered=st.booleans(),
        holder=st.tuples(OFFSETS, RATES),
        d1=st.tuples(OFFSETS, RATES),
        d2=st.tuples(OFFSETS, RATES),
        connected=st.sampled_from([READERS, READERS, ["D1"], []]),
        leases=st.integers(0, 3),
        optimistic=st.sampled_from([[], READERS, ["D1"], ["D2"]]),
    )
    def setup(
        self,
        ordered: bool,
        holder: tuple[float, float],
        d1: tuple[float, float],
        d2: tuple[float, float],
        connected: list[str],
        leases: int,
        optimistic: list[str],
    ) -> None:
        self.world = pdsim.World(
            ordered=ordered,
            holder_clock=pdsim.Clock(*holder),
            reader_clocks={"D1": pdsim.Clock(*d1), "D2": pdsim.Clock(*d2)},
            optimistic=optimistic,
        )
        for reader in connected:
            self.world.connect(reader, INCARNATION)
        for _ in range(leases):
            self.world.grant()

    # -- the schedulers ----------------------------------------------------------------
    @rule()
    def grant(self) -> None:
        self.w.grant()

    @rule(
        target=tickets,
        data=st.data(),
        readers=st.lists(st.sampled_from(READERS), min_size=1, max_size=3),
        incarnation=st.sampled_from([None, INCARNATION]),
        kind=st.sampled_from(["fresh"] * 3 + ["granted"] * 3 + ["unknown", "stale"]),
        load_now=st.sampled_from(["no", "load", "settle", "read"]),
    )
    def request(
        self,
        data: st.DataObject,
        readers: list[str],
        incarnation: str | None,
        kind: str,
        load_now: str,
    ) -> MultipleResults[Ticket]:
        """Requests arrive with a ticket: one request or several (router retries: the same
        ticket twice on one reader, or on both), for a lease granted just now or any lease
        granted so far (before or after it was used), for a lease the holder never granted,
        or from a previous instance of the holder. The first may be loaded at once (and
        ``read``: its READ land at once too, if posted); the others wait in the bundle."""
        if kind == "fresh" or (kind == "granted" and not self.w.leases):
            lid = self.w.grant()
        elif kind == "granted":
            lid = data.draw(st.sampled_from(sorted(self.w.leases)), label="lease")
        else:
            lid = self.w.stale_ticket()
            if kind == "stale":
                incarnation = STALE_INCARNATION
        tickets = [Ticket(reader=r, lid=lid, incarnation=incarnation) for r in readers]
        if load_now != "no":
            ticket = tickets.pop(0)
            self.load(ticket, settle=load_now != "load")
            for tr in self.w.flying():
                if load_now == "read" and tr.reader == ticket.reader and tr.lid == lid:
                    self.w.land(tr, notify_now=False)
                    self.w.report(tr)
        return multiple(*tickets)

    @rule(ticket=consumes(tickets), settle=st.booleans())
    def load(self, ticket: Ticket, settle: bool) -> None:
        """The engine allocated the request's blocks: load. ``settle``: then deliver what is
        in flight, in order (so that a read is posted often enough to matter)."""
        self.w.add(ticket.reader, ticket.lid, ticket.incarnation)
        if settle:
            if not self.w.sides[ticket.reader].ready:
                self.w.connect(ticket.reader, INCARNATION)
            self.pump(8)

    @rule(ticket=consumes(tickets))
    def end_before_load(self, ticket: Ticket) -> None:
        """The request finished (or found its KV locally) before a load began: release."""
        self.w.release(ticket.reader, ticket.lid)

    @precondition(lambda self: bool(self.w.leases))
    @rule(data=st.data(), reader=st.sampled_from(READERS))
    def scheduler_heartbeat(self, data: st.DataObject, reader: str) -> None:
        lids = data.draw(
            st.lists(st.sampled_from(sorted(self.w.leases)), min_size=1, max_size=4), label="ids"
        )
        self.w.heartbeat(reader, lids)

    @precondition(lambda self: bool(self.w.loads))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.w.abort(data.draw(st.sampled_from(sorted(self.w.loads)), label="load"))

    # -- connections -------------------------------------------------------------------
    @rule(reader=st.sampled_from(READERS), incarnation=st.sampled_from([INCARNATION, None]))
    def connect(self, reader: str, incarnation: str | None) -> None:
        if not self.w.sides[reader].ready:
            self.w.connect(reader, incarnation)

    @rule(reader=st.sampled_from(READERS))
    def lose_peer(self, reader: str) -> None:
        if self.w.sides[reader].ready:
            self.w.lose_peer(reader)

    @rule(reader=st.sampled_from(READERS))
    def handshake_fails(self, reader: str) -> None:
        if not self.w.sides[reader].ready:
            self.w.fail_peer(reader)

    @rule(reader=st.sampled_from(READERS))
    def peer_unreachable(self, reader: str) -> None:
        """A send to the holder found it unreachable (the worker reports the peer failed)."""
        if self.w.sides[reader].ready:
            self.w.fail_peer(reader)

    # -- the network -------------------------------------------------------------------
    @precondition(lambda self: bool(self.w.net.packets))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        self.w.deliver(data.draw(st.sampled_from(self.w.net.deliverable()), label="packet"))

    @precondition(lambda self: bool(self.w.net.packets))
    @rule(limit=st.integers(1, 12))
    def pump(self, limit: int) -> None:
        """A calm network for a moment: deliver the oldest messages, in order."""
        for _ in range(limit):
            if not self.w.net.packets:
                return
            self.w.deliver(0)

    @precondition(lambda self: bool(self.w.net.packets))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        self.w.net.drop(data.draw(st.integers(0, len(self.w.net.packets) - 1), label="packet"))

    @precondition(lambda self: bool(self.w.net.packets))
    @rule(data=st.data())
    def duplicate(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.w.net.packets) - 1), label="packet")
        self.w.net.duplicate(index)

    # -- transfers ---------------------------------------------------------------------
    @precondition(lambda self: bool(self.w.flying()))
    @rule(data=st.data(), notify_now=st.booleans(), report=st.booleans())
    def land(self, data: st.DataObject, notify_now: bool, report: bool) -> None:
        tr = data.draw(st.sampled_from(self.w.flying()), label="transfer")
        self.w.land(tr, notify_now=notify_now)
        if report:
            self.w.report(tr)

    @precondition(lambda self: bool(self.w.landed_unreported()))
    @rule(data=st.data())
    def report(self, data: st.DataObject) -> None:
        self.w.report(data.draw(st.sampled_from(self.w.landed_unreported()), label="transfer"))

    @precondition(lambda self: bool(self.w.verifying()))
    @rule(data=st.data(), found=st.sampled_from(["table", "table", "zero", "other", "early"]))
    def check_table(self, data: st.DataObject, found: str) -> None:
        self.w.check_table(data.draw(st.sampled_from(self.w.verifying())), found)

    @precondition(lambda self: bool(self.w.flying()))
    @rule(data=st.data(), broken=st.booleans())
    def fail_transfer(self, data: st.DataObject, broken: bool) -> None:
        self.w.fail(data.draw(st.sampled_from(self.w.flying()), label="transfer"), broken=broken)

    # -- time --------------------------------------------------------------------------
    @rule(dt=DT, drive=st.booleans())
    def advance(self, dt: float, drive: bool) -> None:
        self.w.advance(dt, drive=drive)

    @rule(reader=st.sampled_from(READERS))
    def tick_reader(self, reader: str) -> None:
        self.w.tick_reader(reader)

    @rule()
    def expire_holder(self) -> None:
        self.w.expire_holder()

    @rule(side=st.sampled_from([None, *READERS]), rate=RATES)
    def drift(self, side: str | None, rate: float) -> None:
        self.w.set_rate(side, rate)

    # -- checks ------------------------------------------------------------------------
    @invariant()
    def world_is_consistent(self) -> None:
        if self.world is not None:
            self.world.check()

    def teardown(self) -> None:
        # Hypothesis calls this in a ``finally``: after a failed step, leave the failure alone.
        if self.world is not None and sys.exc_info()[1] is None:
            before = dict(self.world.outcomes)
            for kind in before:
                event(f"a load ended {kind} before the final drive")
            posted = sum(ld.posts > 0 for ld in self.world.loads.values())
            event(f"loads posted: {min(posted, 5)}{'+' if posted >= 5 else ''}")
            self.world.finish()


TestPDNetwork = PDNetwork.TestCase
# One failure at a time, and no "explain" phase: shrinking every distinct failure of a
# 50-step run and explaining it takes minutes.
TestPDNetwork.settings = settings(
    TestPDNetwork.settings,
    report_multiple_bugs=False,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)


# -- liveness: heartbeats on time keep their leases ---------------------------------------------
@attrs.define(eq=False)
class _Req:
    """One request on a reader's scheduler, in the event loop below."""

    reader: str
    granted: float
    arrives: float
    load_at: float | None
    """True time its load is added (``None``: it ends before a load, at ``end_at``)."""
    end_at: float
    lid: str = ""
    rid: str | None = None
    tracked: bool = False


def _loop(w: pdsim.World, reqs: list[_Req], rnd: random.Random, horizon: float) -> None:
    """Run ``w`` as a deployment would until ``horizon``: each reader's scheduler tracks its
    requests in a real ``HeartbeatTracker`` and heartbeats when it is due; every message
    arrives within 0.9 heartbeat intervals (in order if the network is ordered); reads take up
    to 2 s; both machines are woken at their deadlines. Fails as soon as a lease expires while
    a request heartbeats it."""
    max_delay = 0.9 * pdsim.POLICY.heartbeat_interval
    trackers = {name: HeartbeatTracker.from_policy(pdsim.POLICY) for name in w.sides}
    tiebreak = itertools.count()
    events: list[tuple[float, int, str, int]] = []
    for i, req in enumerate(reqs):
        heapq.heappush(events, (req.granted, next(tiebreak), "grant", i))
    channel_due: dict[tuple[str, str], float] = {}
    lands: dict[int, float] = {}
    expired_seen = 0

    def stop_tracking(req: _Req, reason: StopReason) -> None:
        if req.tracked:
            req.tracked = False
            trackers[req.reader].stop(req.lid, w.now_r(req.reader), reason)

    while True:
        for p in w.net.packets:
            if p.due == math.inf:
                p.due = p.sent + rnd.uniform(0.0, max_delay)
                if w.net.ordered:  # never before the previous message of the same pair
                    key = (p.src, p.dst)
                    p.due = max(channel_due.get(key, 0.0), p.due)
                    channel_due[key] = p.due
        flying = w.flying()
        for tr in flying:
            lands.setdefault(tr.tid, tr.posted + rnd.uniform(0.0, 2.0))
        options: list[tuple[float, str]] = []
        if events:
            options.append((events[0][0], "event"))
        if w.net.packets:
            options.append((min(p.due for p in w.net.packets), "packet"))
        if flying:
            options.append((min(lands[tr.tid] for tr in flying), "land"))
        deadline = w.next_event()
        if deadline is not None:
            options.append((deadline, "deadline"))
        for name, tracker in trackers.items():
            due = tracker.next_deadline()
            if due is not None:
                options.append((w.sides[name].clock.when(due), name))
        when, kind = min(options, default=(math.inf, ""))
        if when > horizon:
            return
        w.t = max(w.t, when)
        if kind == "event":
            _, _, what, i = heapq.heappop(events)
            req = reqs[i]
            if what == "grant":
                req.lid = w.grant()
                heapq.heappush(events, (req.arrives, next(tiebreak), "arrive", i))
            elif what == "arrive":
                # The scheduler tracks it, and heartbeats it at once (to confirm it early).
                req.tracked = True
                trackers[req.reader].track(req.lid, ENGINE, req.lid, w.now_r(req.reader))
                w.heartbeat(req.reader, [req.lid])
                if req.load_at is not None and req.load_at < req.end_at:
                    heapq.heappush(events, (req.load_at, next(tiebreak), "load", i))
                heapq.heappush(events, (req.end_at, next(tiebreak), "end", i))
            elif what == "load":
                req.rid = w.add(req.reader, req.lid, INCARNATION)
            elif req.rid is None:
                stop_tracking(req, StopReason.FINISHED)
                w.release(req.reader, req.lid)
            elif not w.loads[req.rid].ends:
                stop_tracking(req, StopReason.ABORTED)
                w.abort(req.rid)
        elif kind == "packet":
            w.deliver(min(range(len(w.net.packets)), key=lambda j: w.net.packets[j].due))
        elif kind == "land":
            tr = min(flying, key=lambda x: lands[x.tid])
            w.land(tr, notify_now=False)
            w.report(tr)
        elif kind == "deadline":
            w.wake_due()
        else:
            for batch in trackers[kind].due(w.now_r(kind)):
                w.heartbeat(kind, batch.request_ids)
        # finished_recving: the scheduler stops heartbeating a request whose load ended.
        for req in reqs:
            if req.tracked and req.rid is not None and w.loads[req.rid].ends:
                stop_tracking(req, StopReason.TRANSFER_DONE)
        for lid in w.expired[expired_seen:]:
            assert not [r for r in reqs if r.lid == lid and r.tracked], (
                f"lease {lid} expired while its request still heartbeats it"
            )
        expired_seen = len(w.expired)
        w.check()


@given(
    ordered=st.booleans(),
    holder=st.tuples(OFFSETS, RATES),
    readers=st.lists(st.tuples(OFFSETS, RATES), min_size=1, max_size=2),
    n=st.integers(1, 10),
    rnd=st.randoms(use_true_random=True),
    optimistic=st.booleans(),
)
def test_leases_renewed_on_time_never_expire(
    ordered: bool,
    holder: tuple[float, float],
    readers: list[tuple[float, float]],
    n: int,
    rnd: random.Random,
    optimistic: bool,
) -> None:
    """Requests arrive within a second of their grant, load or not, end at any time; every
    message arrives within 0.9 heartbeat intervals, in order or not (transports may declare
    ``ordered_notifications=False``): no lease expires while a request still heartbeats it
    (the extension is four intervals), and every load ends."""
    names = [f"D{i + 1}" for i in range(len(readers))]
    w = pdsim.World(
        ordered=ordered,
        holder_clock=pdsim.Clock(*holder),
        reader_clocks={name: pdsim.Clock(*c) for name, c in zip(names, readers, strict=True)},
        optimistic=names if optimistic else (),
    )
    for name in names:
        w.connect(name, INCARNATION)
    reqs = []
    for _ in range(n):
        granted = rnd.uniform(0.0, 12.0)
        arrives = granted + rnd.uniform(0.0, 1.0)
        reqs.append(
            _Req(
                reader=rnd.choice(names),
                granted=granted,
                arrives=arrives,
                load_at=arrives + rnd.uniform(0.0, 15.0) if rnd.random() < 0.7 else None,
                end_at=arrives + rnd.uniform(0.0, 40.0),
            )
        )
    _loop(w, reqs, rnd, horizon=60.0)
    w.finish()
