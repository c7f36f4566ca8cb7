"""A simulated P/D deployment for the core's P/D machines: one holder, readers, a lossy network.

:class:`World` plays the part of the P/D connector's workers (``kvframe/connectors/pd/worker.py``)
around one :class:`~kvframe.core.holder.LeaseHolder` and one or more
:class:`~kvframe.core.reader.LeaseReader` s: it carries out the actions the readers return, in
order, exactly as the worker does, and feeds the machines what a network and a transport would
report. Everything the machines are not allowed to see is modelled here:

- **true time** (``World.t``) and one clock per side (:class:`Clock`: any offset, a rate within
  the drift the reader allows, changeable at any moment);
- **the network** (:class:`Network`): every message sits in flight until a driver delivers,
  drops or duplicates it; unordered, or first-in-first-out per (sender, receiver) pair;
- **transfers**: a posted READ is in flight until a driver lands it (its notification then goes
  to the holder, at once or through the network), fails it, or the reader stops it;
- **the holder's memory**: each lease's blocks carry a version, bumped when the holder ends the
  lease (its blocks are reused), so a read that overlaps a reuse is known to hold garbage;
- **the holder's lease table** (:mod:`kvframe.core.slots`): a lease's tag is in it from its
  grant until the holder ends it (cleared before the blocks are reused); a reader's table READ
  (:meth:`World.check_table`) finds the tag, an empty slot, another lease's tag, or a tag it
  read before the completion was seen (a READ posted too early), and the reader is told with
  :meth:`LeaseReader.lease_seen`.

Every check the machines must pass is an ``assert`` here, made where the fact is observed or in
:meth:`World.check` (which drivers call after every step) and :meth:`World.finish`:

- **no read of freed blocks is accepted**: a ``LoadEnded(DONE)`` needs a read that landed
  while its lease was live, on the block version it was posted on (replayed and duplicated
  tickets included);
- **stop before you report**: no load is reported ended while its read is in flight;
- **every load ends exactly once**, no later than ``add`` + ``reader.bound()`` on the reader's
  clock: after any ``tick(now)`` no load older than that is left, ``next_deadline()`` is never
  later than any load's bound (nor, for a posted read, than its transfer timeout), and a tick
  at ``next_deadline()`` always moves it; :meth:`World.finish` lets time run and checks that
  every load and every lease ended;
- **confirmed bounds are sound**: a read is posted with at least ``margin`` of confirmed lease
  left (an optimistic reader's read may go before any confirmation: it is *early*, and only
  the first invariant holds it to account), and while a load confirms or reads, its
  confirmed bound never lies beyond the holder's expiry (mapped with the worst drift allowed
  from now on);
- **the holder never frees blocks under a read**: no lease ends by a notice (consumed,
  released) while a read of it is in flight, and no reader releases a lease its own read is
  reading; only expiry may (and the first invariant then rejects the read); early reads are
  exempt (a replayed ticket's early read may be in flight when the lease's claimant ends it:
  the first invariant must then reject it);
- **one reader per lease**: the holder acknowledges a lease to one reader only, and only that
  reader ends it; its claims match the model;
- the readers' loads, the holder's deadline and every lease's single end match the model.

The drivers are ``test_pd_network.py``'s state machine and event loop.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable

import attrs
import numpy as np

from kvframe.core import wire
from kvframe.core.holder import LeaseHolder
from kvframe.core.lease import Lease, LeasePolicy, LeaseState, lease_handle
from kvframe.core.reader import (
    Action,
    LeaseReader,
    LoadEnded,
    PostRead,
    ReaderTimeouts,
    ReadState,
    Reconnect,
    SendMessage,
    StopRead,
)
from kvframe.core.slots import LeaseSlots, slot_of, slot_tag

ENGINE = "P"
"""The holder's engine id, as the readers know it."""
INCARNATION = "inc-1"
"""The holder's instance token (it never restarts here)."""
STALE_INCARNATION = "inc-0"
"""A previous instance of the holder: tickets naming it name leases that are gone."""
MAX_DRIFT = 0.02
"""The drift both machines allow; each clock's rate stays within ``1 ± MAX_DRIFT / 2``, so the
ratio of any two rates stays within ``1 ± MAX_DRIFT``. Large, so that a machine that forgot
the drift loses a race the simulation can see."""
RATE_LOW = 1 - MAX_DRIFT / 2
RATE_HIGH = 1 + MAX_DRIFT / 2
POLICY = LeasePolicy.from_duration(6.0)
"""Duration 6 s, heartbeat interval 1 s, extension 4 s."""
TIMEOUTS = ReaderTimeouts.from_policy(POLICY, peer_timeout=3.0, margin=0.5)
"""Margin 0.5 s, peer 3 s, confirmation 4 s, transfer 4 s, resend every 1 s (bound: 11 s)."""
TABLE_SLOTS = 64
"""The holder's lease table: small, so that leases share slots now and then."""
EPS = 1e-6
"""Slack for float rounding in the simulator's own arithmetic (clocks are offset by up to
10,000 s, so a reading carries about 1e-12 s of rounding)."""


class Clock:
    """One side's monotonic clock: it reads ``base + rate * (true - since)``."""

    def __init__(self, offset: float, rate: float) -> None:
        self.since = 0.0
        self.base = offset
        self.rate = rate

    def at(self, true: float) -> float:
        """The reading at true time ``true`` (not earlier than the last rate change)."""
        return self.base + self.rate * (true - self.since)

    def when(self, local: float) -> float:
        """The earliest true time at which the clock reads at least ``local`` (at the current
        rate)."""
        t = self.since + (local - self.base) / self.rate
        while self.at(t) < local:
            t = math.nextafter(t, math.inf)
        return t

    def set_rate(self, true: float, rate: float) -> None:
        """From true time ``true`` on, run at ``rate`` (the reading stays continuous)."""
        self.base = self.at(true)
        self.since = true
        self.rate = rate


@attrs.define(eq=False)
class Packet:
    """A message in flight from ``src`` to ``dst``."""

    src: str
    dst: str
    message: wire.Message
    sent: float
    """True time it was sent."""
    due: float = math.inf
    """True time an event loop delivers it (unused by the state machine)."""


class Network:
    """Messages in flight. ``ordered``: between one sender and one receiver they are delivered
    in the order sent (they may still be dropped or duplicated)."""

    def __init__(self, *, ordered: bool) -> None:
        self.ordered = ordered
        self.packets: list[Packet] = []
        self.sent = 0
        self.delivered = 0

    def send(self, packet: Packet) -> None:
        # Every message goes through the codec, as the connector's do: it must encode, and the
        # receiver sees what decodes.
        decoded = wire.decode(wire.encode(packet.message))
        self.packets.append(attrs.evolve(packet, message=decoded))
        self.sent += 1

    def deliverable(self) -> list[int]:
        """Indices of the packets that may be delivered next."""
        if not self.ordered:
            return list(range(len(self.packets)))
        heads: dict[tuple[str, str], int] = {}
        for i, p in enumerate(self.packets):
            heads.setdefault((p.src, p.dst), i)
        return sorted(heads.values())

    def take(self, index: int) -> Packet:
        self.delivered += 1
        return self.packets.pop(index)

    def drop(self, index: int) -> None:
        del self.packets[index]

    def duplicate(self, index: int) -> None:
        """A copy of a packet, sent again now (it queues behind what is in flight)."""
        self.packets.append(attrs.evolve(self.packets[index]))


@attrs.define(eq=False)
class LeaseRec:
    """What the simulation knows of one lease the holder granted."""

    lid: str
    granted: float
    version: int = 0
    """The version of the blocks it holds: bumped when the holder ends the lease (reused)."""
    ended: float | None = None
    """True time the holder ended it."""
    how: LeaseState | None = None
    ends: int = 0
    claim: str | None = None
    """The first reader the holder acknowledged it to."""


@attrs.define(eq=False)
class Transfer:
    """One posted READ."""

    tid: int
    reader: str
    rid: str
    lid: str
    notification: wire.LeaseDone
    posted: float
    version: int
    """The lease's block version when the read was posted."""
    state: str = "flight"
    """``flight``, ``landed``, ``stopped`` (before landing) or ``failed``."""
    landed: float | None = None
    valid: bool = False
    """Landed while the lease was live, on the blocks' version at posting: the data is good."""
    released: bool = False
    """The reader stopped it or ended its load: its result is not reported any more."""
    early: bool = False
    """Posted by an optimistic reader before a confirmation covered it (``margin`` left)."""
    reported_r: float | None = None
    """The reader's clock when its worker reported it done (:meth:`World.report`)."""
    notify_when_done: bool = False
    """Posted without its notification: the reader's worker sends it once it sees the READ
    done (:meth:`PDWorld.report`), not the transport when the bytes land."""


@attrs.define(eq=False)
class LoadRec:
    """One load a reader was given (:meth:`LeaseReader.add`)."""

    rid: str
    reader: str
    lid: str
    added_r: float
    hard_r: float
    """``added_r + reader.bound()``: no deadline of the load may be later."""
    replay: bool
    """Its ticket had been handed out before (a router retry)."""
    ends: list[LoadEnded] = attrs.Factory(list)
    transfer: Transfer | None = None
    posted_r: float = -math.inf
    bound_at_post: float = -math.inf
    posts: int = 0


@attrs.define(eq=False)
class Side:
    """One reader and what the simulation knows of its connection to the holder."""

    name: str
    reader: LeaseReader
    clock: Clock
    ready: bool = False
    """The reader was told the connection is usable (and not told otherwise since)."""
    unsent: int = 0
    """Messages the reader asked to send while not connected (the worker drops them)."""
    optimistic: bool = False
    """Its reader posts READs before their confirmation (``LeaseReader(optimistic=True)``)."""
    heartbeated: dict[int, float] = attrs.field(factory=dict)
    """Lease handle -> the reader time of the last heartbeat naming it (one per moment)."""


class World:
    """One holder, the given readers, a network; see the module docs.

    :param ordered: the network keeps each (sender, receiver) pair's messages in order.
    :param holder_clock: the holder's clock; :param reader_clocks: one per reader name.
    :param optimistic: the readers built with ``optimistic=True`` (READ before confirmation).
    """

    def __init__(
        self,
        *,
        ordered: bool,
        holder_clock: Clock,
        reader_clocks: dict[str, Clock],
        remember: int = 65_536,
        optimistic: Iterable[str] = (),
    ) -> None:
        self.t = 0.0
        early = set(optimistic)
        self.net = Network(ordered=ordered)
        self.hclock = holder_clock
        self.slots = LeaseSlots(np.zeros(TABLE_SLOTS, dtype=np.uint64))
        self.holder: LeaseHolder[int] = LeaseHolder(POLICY, max_drift=MAX_DRIFT, slots=self.slots)
        self.sides = {
            name: Side(
                name=name,
                reader=LeaseReader(
                    POLICY,
                    TIMEOUTS,
                    max_drift=MAX_DRIFT,
                    remember=remember,
                    optimistic=name in early,
                ),
                clock=clock,
                optimistic=name in early,
            )
            for name, clock in reader_clocks.items()
        }
        self.leases: dict[str, LeaseRec] = {}
        self.by_handle: dict[int, str] = {}  # wire handle -> lease id
        self.loads: dict[str, LoadRec] = {}
        self.transfers: list[Transfer] = []
        self.handed: collections.Counter[str] = collections.Counter()
        self.expired: list[str] = []
        self.outcomes: collections.Counter[str] = collections.Counter()
        """How loads ended (for statistics)."""
        self._n = 0

    # -- clocks ---------------------------------------------------------------------------
    def now_h(self) -> float:
        return self.hclock.at(self.t)

    def now_r(self, name: str) -> float:
        return self.sides[name].clock.at(self.t)

    def _id(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    # -- inputs from "the schedulers" -----------------------------------------------------
    def grant(self) -> str:
        lid = self._id("L")
        self.holder.grant(lid, self.now_h(), self._n)
        self.leases[lid] = LeaseRec(lid=lid, granted=self.t)
        self.by_handle[lease_handle(lid)] = lid
        self.holder.publish(lid)  # the worker enters every pull lease it grants
        return lid

    def stale_ticket(self) -> str:
        """A lease id of a previous holder instance (unknown here)."""
        return self._id("X")

    def add(self, name: str, lid: str, incarnation: str | None) -> str:
        side = self.sides[name]
        rid = self._id(f"{name}-q")
        now = self.now_r(name)
        self.loads[rid] = LoadRec(
            rid=rid,
            reader=name,
            lid=lid,
            added_r=now,
            hard_r=now + side.reader.bound(),
            replay=self.handed[lid] > 0,
        )
        self.handed[lid] += 1
        self._run(side, side.reader.add(rid, ENGINE, lid, now, incarnation=incarnation))
        return rid

    def release(self, name: str, lid: str) -> None:
        """A request holding this ticket ended before its load (or found its KV locally)."""
        side = self.sides[name]
        self.handed[lid] += 1
        self._run(side, side.reader.release(ENGINE, [lid], self.now_r(name)))

    def heartbeat(self, name: str, lids: Iterable[str]) -> None:
        side = self.sides[name]
        self._run(side, side.reader.heartbeat(ENGINE, list(lids), self.now_r(name)))

    def abort(self, rid: str) -> None:
        side = self.sides[self.loads[rid].reader]
        self._run(side, side.reader.abort(rid, self.now_r(side.name)))

    # -- connections ----------------------------------------------------------------------
    def connect(self, name: str, incarnation: str | None) -> None:
        """A handshake completed: the holder sees the reader (re)connect, the reader sees the
        connection ready."""
        side = self.sides[name]
        self.holder.connected(name)
        side.ready = True
        self._run(side, side.reader.peer_ready(ENGINE, self.now_r(name), incarnation=incarnation))

    def lose_peer(self, name: str) -> None:
        side = self.sides[name]
        side.ready = False
        self._run(side, side.reader.peer_lost(ENGINE, self.now_r(name)))

    def fail_peer(self, name: str) -> None:
        side = self.sides[name]
        side.ready = False
        self._run(side, side.reader.peer_failed(ENGINE, "handshake failed", self.now_r(name)))

    # -- the network ----------------------------------------------------------------------
    def deliver(self, index: int) -> None:
        packet = self.net.take(index)
        if packet.dst == ENGINE:
            self._to_holder(packet.src, packet.message)
        else:
            side = self.sides[packet.dst]
            now = self.now_r(side.name)
            self._run(side, side.reader.receive(ENGINE, packet.message, now))

    # -- transfers ------------------------------------------------------------------------
    def flying(self) -> list[Transfer]:
        return [tr for tr in self.transfers if tr.state == "flight"]

    def landed_unreported(self) -> list[Transfer]:
        return [tr for tr in self.transfers if tr.state == "landed" and not tr.released]

    def land(self, tr: Transfer, *, notify_now: bool) -> None:
        """Every byte of the read landed; the transport sends its notification (to the holder
        at once, or into the network)."""
        assert tr.state == "flight"
        lease = self.leases.get(tr.lid)
        tr.state = "landed"
        tr.landed = self.t
        tr.valid = lease is not None and lease.ended is None and lease.version == tr.version
        if tr.notify_when_done:
            return  # posted without it: the worker sends it once it sees the READ done
        if notify_now:
            self._to_holder(tr.reader, tr.notification)
        else:
            self.net.send(Packet(src=tr.reader, dst=ENGINE, message=tr.notification, sent=self.t))

    def report(self, tr: Transfer) -> None:
        """The reader's worker polls the landed transfer and reports it complete."""
        assert tr.state == "landed"
        assert not tr.released
        side = self.sides[tr.reader]
        tr.released = True
        tr.reported_r = self.now_r(side.name)
        if tr.notify_when_done:
            # As the worker does: the done notice goes now, after every message the reader
            # sent since the post (the heartbeat asking the holder to claim the lease).
            if side.ready:
                self.net.send(
                    Packet(src=tr.reader, dst=ENGINE, message=tr.notification, sent=self.t)
                )
            else:
                side.unsent += 1
        self._run(side, side.reader.transfer_done(tr.rid, self.now_r(side.name)))

    def verifying(self) -> list[Transfer]:
        """Reported reads whose load waits for a confirmation (a table READ may prove it)."""
        return [
            tr
            for tr in self.transfers
            if tr.reported_r is not None
            and not self.loads[tr.rid].ends
            and self.sides[tr.reader].reader.state(tr.rid) is ReadState.VERIFYING
        ]

    def check_table(self, tr: Transfer, found: str) -> None:
        """The reader's worker READs the lease's slot of the holder's table after the read
        was reported done: ``table`` what is there now (the tag while the lease lives, else
        zero), ``zero`` or ``other`` (an empty slot, another lease's tag: not entered yet, a
        collision), ``early`` the lease's tag as a READ posted before the completion was seen
        would have found it (whatever happened since)."""
        side = self.sides[tr.reader]
        now = self.now_r(side.name)
        tag = slot_tag(lease_handle(tr.lid))
        assert tr.reported_r is not None
        checked_at = now
        if found == "table":
            value = int(self.slots.table[slot_of(tag, TABLE_SLOTS)])
        elif found == "zero":
            value = 0
        elif found == "other":
            value = tag ^ 0xFF
        else:
            assert found == "early"
            value, checked_at = tag, tr.reported_r - 1e-3
        self._run(side, side.reader.lease_seen(tr.rid, value, checked_at, now))

    def fail(self, tr: Transfer, *, broken: bool) -> None:
        """The transport failed the read (``broken``: the connection died with it)."""
        assert tr.state == "flight"
        side = self.sides[tr.reader]
        tr.state = "failed"
        tr.released = True
        now = self.now_r(side.name)
        actions = side.reader.transfer_failed(tr.rid, "boom", now, peer_broken=broken)
        if broken:
            side.ready = False  # the worker marks the engine failed and handshakes again
        self._run(side, actions)

    # -- time -----------------------------------------------------------------------------
    def tick_reader(self, name: str) -> None:
        side = self.sides[name]
        now = self.now_r(name)
        self._run(side, side.reader.tick(now))
        for rid in side.reader.loads():
            assert self.loads[rid].hard_r > now, f"{rid} outlived its bound: tick({now}) kept it"
        deadline = side.reader.next_deadline()
        assert deadline is None or deadline > now, f"{name}: tick({now}) left {deadline} due"

    def expire_holder(self) -> None:
        now = self.now_h()
        self._ended(self.holder.expire(now).ended, by=None)
        deadline = self.holder.next_deadline()
        assert deadline is None or deadline > now

    def set_rate(self, name: str | None, rate: float) -> None:
        clock = self.hclock if name is None else self.sides[name].clock
        clock.set_rate(self.t, rate)

    def next_event(self) -> float | None:
        """The true time of the earliest deadline either machine asked to be woken at."""
        times: list[float] = []
        for side in self.sides.values():
            d = side.reader.next_deadline()
            if d is not None:
                times.append(side.clock.when(d))
        d = self.holder.next_deadline()
        if d is not None:
            times.append(self.hclock.when(d))
        return min(times) if times else None

    def advance(self, dt: float, *, drive: bool) -> None:
        """Let ``dt`` seconds of true time pass. ``drive``: wake each machine at every deadline
        it reported (``next_deadline``), as an event loop would."""
        target = self.t + dt
        if drive:
            self.drive_until(target)
        self.t = max(self.t, target)

    def drive_until(self, target: float) -> None:
        for _ in range(10_000):
            nxt = self.next_event()
            if nxt is None or nxt > target:
                return
            self.t = max(self.t, nxt)
            self.wake_due()
        raise AssertionError("the machines' deadlines do not move forward")

    def wake_due(self) -> None:
        for side in self.sides.values():
            d = side.reader.next_deadline()
            if d is not None and d <= self.now_r(side.name):
                self.tick_reader(side.name)
        d = self.holder.next_deadline()
        if d is not None and d <= self.now_h():
            self.expire_holder()

    # -- carrying out the readers' actions (as the P/D worker does) ----------------------
    def _run(self, side: Side, actions: list[Action]) -> None:
        todo: collections.deque[Action] = collections.deque(actions)
        while todo:
            action = todo.popleft()
            if isinstance(action, SendMessage):
                self._send(side, action)
            elif isinstance(action, PostRead):
                self._post(side, action)
            elif isinstance(action, StopRead):
                self._stop(action)
            elif isinstance(action, LoadEnded):
                self._load_ended(side, action)
            else:
                assert isinstance(action, Reconnect)
                assert action.engine == ENGINE
                side.ready = False
                todo.extend(side.reader.peer_lost(ENGINE, self.now_r(side.name)))

    def _send(self, side: Side, action: SendMessage) -> None:
        assert action.engine == ENGINE
        msg = action.message
        if isinstance(msg, wire.LeaseDone):
            assert msg.reason is wire.DoneReason.RELEASED, f"{side.name} sent a READ notice itself"
            for lid in self._lids(msg.handles):
                flying = [
                    tr.rid for tr in self.flying() if tr.reader == side.name and tr.lid == lid
                ]
                assert not flying, (
                    f"{side.name} releases lease {lid} while its own read {flying} of it is in "
                    "flight: the holder frees the blocks under the read"
                )
        if isinstance(msg, wire.Heartbeat):
            for h in msg.handles:
                assert side.heartbeated.get(h) != msg.sent_at, (
                    f"{side.name} named lease {self._lids((h,))} in two heartbeats at {msg.sent_at}"
                )
                side.heartbeated[h] = msg.sent_at
        if not side.ready:
            side.unsent += 1
            return
        self.net.send(Packet(src=side.name, dst=ENGINE, message=msg, sent=self.t))

    def _post(self, side: Side, action: PostRead) -> None:
        assert action.engine == ENGINE
        load = self.loads[action.request_id]
        assert not load.ends, f"{load.rid} posted after it ended"
        assert side.ready, f"{load.rid} posted without a connection"
        assert load.transfer is None or load.transfer.state != "flight", "two reads of one load"
        note = action.notification
        assert (note.reason, note.handles) == (wire.DoneReason.READ, (lease_handle(load.lid),))
        now = self.now_r(side.name)
        bound = side.reader.confirmed_bound(ENGINE, load.lid)
        early = bound - now < TIMEOUTS.margin - EPS
        assert side.optimistic or not early, f"{load.rid} posted with {bound - now} s left"
        self._check_bound(side, load.lid, bound, why=f"posting {load.rid}")
        lease = self.leases.get(load.lid)
        tr = Transfer(
            tid=len(self.transfers),
            reader=side.name,
            rid=load.rid,
            lid=load.lid,
            notification=action.notification,
            posted=self.t,
            version=lease.version if lease is not None else -1,
            early=early,
            notify_when_done=action.notify_when_done,
        )
        self.transfers.append(tr)
        load.transfer = tr
        load.posted_r = now
        load.bound_at_post = bound
        load.posts += 1
        assert load.posts <= 2, f"{load.rid} read more than twice"

    def _stop(self, action: StopRead) -> None:
        tr = self.loads[action.request_id].transfer
        assert tr is not None, f"StopRead for {action.request_id}, which never posted"
        if tr.state == "flight":
            tr.state = "stopped"
        tr.released = True

    def _load_ended(self, side: Side, action: LoadEnded) -> None:
        load = self.loads[action.request_id]
        assert action.engine == ENGINE
        assert load.reader == side.name
        assert not load.ends, f"{load.rid} ended twice: {load.ends[0]} and then {action}"
        load.ends.append(action)
        self.outcomes[f"{action.state.value}{' (replayed ticket)' if load.replay else ''}"] += 1
        tr = load.transfer
        assert tr is None or tr.state != "flight", (
            f"{load.rid} reported {action.state.value} while its read is in flight (no StopRead)"
        )
        if tr is not None:
            tr.released = True
        if action.state is ReadState.DONE:
            assert tr is not None, f"{load.rid} done without a read"
            assert tr.state == "landed", f"{load.rid} done, its read {tr.state}"
            lease = self.leases[load.lid]
            assert tr.valid, (
                f"{load.rid} accepted a read of reused blocks: lease {load.lid} ended "
                f"({lease.how}) at t={lease.ended}, the read landed at t={tr.landed}"
                + (" (a replayed ticket)" if load.replay else "")
            )
            assert tr.landed is not None
            assert lease.ended is None or tr.landed <= lease.ended
        else:
            assert action.state in (ReadState.FAILED, ReadState.ABORTED)
            assert action.reason, f"{load.rid} {action.state.value} without a reason"

    # -- the holder -----------------------------------------------------------------------
    def _lids(self, handles: tuple[int, ...]) -> list[str]:
        # The lease ids of the handles a message names (leases granted here; others unnamed).
        return [self.by_handle.get(h, f"<handle {h:#x}>") for h in handles]

    def _to_holder(self, reader: str, msg: wire.Message) -> None:
        out = self.holder.receive(reader, msg, self.now_h())
        for reply in out.replies:
            if isinstance(reply, wire.LeaseAck):
                for lid in self._lids(reply.handles):
                    rec = self.leases[lid]
                    if rec.claim is None:
                        rec.claim = reader
                    assert rec.claim == reader, (
                        f"{lid} renewed for {reader}, claimed by {rec.claim}"
                    )
            self.net.send(Packet(src=ENGINE, dst=reader, message=reply, sent=self.t))
        self._ended(out.ended, by=reader)

    def _ended(self, ended: Iterable[Lease[int]], *, by: str | None) -> None:
        for lease in ended:
            rec = self.leases[lease.request_id]
            rec.ends += 1
            assert rec.ends == 1, f"lease {rec.lid} ended twice"
            if by is None:
                assert lease.state is LeaseState.EXPIRED
                self.expired.append(rec.lid)
            else:
                assert lease.state in (LeaseState.CONSUMED, LeaseState.ABORTED)
                assert rec.claim in (None, by), f"{by} ended {rec.lid}, claimed by {rec.claim}"
                flying = [tr.rid for tr in self.flying() if tr.lid == rec.lid and not tr.early]
                assert not flying, (
                    f"the holder freed lease {rec.lid} ({lease.state.value}, on a notice from "
                    f"{by}) while the read {flying} of it is in flight"
                )
            # Out of the holder's lease table before its blocks are reused (the version bump).
            assert int(self.slots.table[slot_of(slot_tag(lease.handle), TABLE_SLOTS)]) != (
                slot_tag(lease.handle)
            ), f"lease {rec.lid} ended with its tag still in the lease table"
            rec.ended = self.t
            rec.how = lease.state
            rec.version += 1

    # -- checks ---------------------------------------------------------------------------
    def _check_bound(self, side: Side, lid: str, bound: float, *, why: str) -> None:
        """A confirmed bound still ahead must be sound: the holder keeps the lease at least
        until then, whatever the clocks do within the allowed drift from now on."""
        now = self.now_r(side.name)
        if bound <= now:
            return
        rec = self.leases.get(lid)
        assert rec is not None, f"{why}: {side.name} confirmed {lid}, which was never granted"
        lease = self.holder.table.lease(lid)
        assert rec.ended is None, (
            f"{why}: {side.name} believes {lid} lasts {bound - now:.6f} s more, but the holder "
            f"ended it ({rec.how}) at t={rec.ended}"
        )
        assert lease is not None
        assert lease.state is LeaseState.LIVE
        worst = (lease.expiry - self.now_h()) * RATE_LOW / RATE_HIGH
        assert bound - now <= worst + EPS, (
            f"{why}: {side.name} believes {lid} lasts {bound - now:.6f} s more; the holder may "
            f"end it in {worst:.6f} s of {side.name}'s clock"
        )

    def check(self) -> None:
        """The invariants that hold between any two steps."""
        for side in self.sides.values():
            reader = side.reader
            open_loads = {rid for rid, ld in self.loads.items() if ld.reader == side.name}
            open_loads = {rid for rid in open_loads if not self.loads[rid].ends}
            assert set(reader.loads()) == open_loads, "the reader's loads and the model differ"
            deadline = reader.next_deadline()
            for rid in open_loads:
                load = self.loads[rid]
                state = reader.state(rid)
                assert deadline is not None
                assert deadline <= load.hard_r, (
                    f"{side.name}.next_deadline() = {deadline} is later than {rid}'s bound "
                    f"{load.hard_r}"
                )
                tr = load.transfer
                if tr is not None and tr.state == "flight":
                    assert state is ReadState.POSTED, f"{rid}: a read in flight but {state}"
                    assert deadline <= load.posted_r + TIMEOUTS.transfer_timeout + EPS
                if state is ReadState.POSTED:
                    assert tr is not None
                    assert tr.state in ("flight", "landed")
                    if tr.state == "flight":
                        bound = max(load.bound_at_post, reader.confirmed_bound(ENGINE, load.lid))
                        self._check_bound(side, load.lid, bound, why=f"{rid} posted")
                elif state is ReadState.CONFIRMING:
                    bound = reader.confirmed_bound(ENGINE, load.lid)
                    self._check_bound(side, load.lid, bound, why=f"{rid} confirming")
        deadline = self.holder.next_deadline()
        live = [lease.expiry for lease in self.holder.table.leases()]
        assert (deadline is None) == (not live)
        assert not live or deadline == min(live)
        for rec in self.leases.values():
            if rec.ended is None:
                assert self.holder.claimant(rec.lid) == rec.claim, f"{rec.lid}: claims differ"

    def finish(self) -> None:
        """Let time run (waking the machines at their deadlines) until every load must have
        ended, then check that each did, exactly once, and that every lease ended once."""
        longest = TIMEOUTS.peer_timeout + TIMEOUTS.confirm_timeout + TIMEOUTS.transfer_timeout
        for side in self.sides.values():
            assert side.reader.bound() == longest
        self.advance(2 * (longest + POLICY.duration) / RATE_LOW, drive=True)
        self.check()
        for load in self.loads.values():
            assert len(load.ends) == 1, f"{load.rid} never ended"
        for side in self.sides.values():
            assert len(side.reader) == 0
            assert side.reader.next_deadline() is None
        for rec in self.leases.values():
            assert rec.ends == 1, f"lease {rec.lid} never ended"
        assert self.holder.live_count == 0
