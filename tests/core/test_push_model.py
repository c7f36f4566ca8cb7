"""The push protocol as the P/D worker composes it, against a model, over a lossy network.

``kvframe/connectors/pd/worker.py`` in push mode composes the core's machines so:

- **D** (the decoder) holds its destination blocks under its own lease (a
  :class:`~kvframe.core.holder.LeaseHolder`, granted in ``_push_add``) and leaves every decision
  to :class:`~kvframe.core.receiver.PushReceiver` (send the registration once the handshake is
  ready, fail an unsent one after ``2 * handshake_timeout`` or on a failed handshake or send,
  revoke on an abort or at the cap ``3 * kv_lease_duration`` after the send, free at once on a
  refusal, end when the lease ends); the worker only carries out its actions (``_push_peer``,
  ``_run_receiver``, ``_send_registration``, ``_push_abort``, ``_push_tick``,
  ``_on_push_message``, ``_push_lease_ended``, ``_push_finished``);
- **P** (the prefill engine) matches its finished prefills with D's registrations in either
  order (:class:`~kvframe.core.push.PushSource`, ``_run_push``) and writes under D's lease with
  the reader machine (:class:`~kvframe.core.reader.LeaseReader` with
  ``release_after_loss=True``: ``_run_writer``, ``_post_write``, ``_write_state``,
  ``_write_ended``); a loss notice from D also drops the registrations that wait
  (``PushSource.revoked`` then a release); a decoder that handshakes again is forgotten first
  (``PushSource.peer_gone``, ``LeaseReader.peer_failed``); with ``push_layerwise`` P writes
  each layer's computed blocks to a waiting registration whose lease is confirmed with margin
  (``_write_layer``), stops them on a failure or at the confirmed bound (``_poll_pre``), on a
  loss notice and before a refusal (``_drop_pre``), and the final write carries what some layer
  lacks and sends its notice once every layer WRITE is done (``_Write.pre``).

:class:`World` mirrors those rules line by line (each method names the worker method it
mirrors) around the real core machines, and models everything else: true time and a clock
per side (any offset, rates within the drift the machines allow), a network that drops,
delays, duplicates and reorders every message in both directions (unordered, or in order per
pair), D's handshake with P, a transport whose posted WRITE lands its bytes at some later time
unless it is stopped (``StopRead``), fails, or is posted and fails at once, the notice of a
WRITE (sent by the transport with the data, or by the worker after ``poll`` said DONE for a
transport without ``notification_after_data``), the death of P or D at any moment, and a
restarted D. D's memory is modelled block by block: a block D frees gets a new version and
goes to the next push that allocates (most recently freed first, so reuse is immediate).

The invariants (each an ``assert`` where the fact is observed, or in :meth:`World.check` after
every step):

1. **no write ever lands in blocks D has freed**: when D frees a push's blocks, no WRITE into
   them is in flight (any byte of one may land at any moment until it completes or stops),
   and a landing WRITE finds its blocks still held for its lease, on the version it was
   posted on;
2. **a push D reports done has P's bytes**: every destination block holds the bytes of P's
   block it was paired with, written on its current version (the WRITE landed fully before
   its notice was accepted);
3. **every push ends exactly once on both sides, within a bound**: on D (consumed, aborted,
   failed on a refusal, revoked or expired) no later than ``send_timeout + cap + extension``
   after its grant (``D_BOUND``: the unsent deadline, the cap, then at most one extension of a
   lease nobody renews; within the receiver's documented ``send_timeout + cap +
   kv_lease_duration``), and D frees a push's blocks only once its lease ended; on P
   (``finished_sending``) no later than ``wait_timeout + writer.bound()`` after its offer
   (``P_BOUND``: the wait for a registration, then the writer's overall bound);
4. no double free or double end on either side; P never frees a source block (ends its
   request) under a WRITE in flight; D's holder and the worker's push table agree; P's writer
   and the worker's write table agree; a confirmed bound a write relies on never lies beyond
   D's expiry (with the worst drift allowed from now on); D's receiver, holder and push table
   agree. Invariant 1 covers layer WRITEs too: no layer WRITE lands in blocks D freed.

Assumptions (the code cannot be fenced without them; each is a rule here):

- **A (progress)**: a live worker reaches a progress point no later than its machines' next
  deadline (``advance`` wakes P at ``PushSource``/writer deadlines and at the confirmed bound
  of a layer WRITE in flight, and D at its holder and receiver deadlines, P first at equal
  times); extra progress points may come at any time;
- **B (a dead P's transport)**: no byte of a WRITE posted by a P that died lands after the
  writer's confirmed bound for its lease (the NIC completes or drops what is queued by then);
  ``advance`` stops such a WRITE at that bound;
- **C (drift)**: each clock runs at a rate within ``1 ± max_drift / 2`` of true time, with
  ``max_drift`` the machines' default (``DEFAULT_MAX_DRIFT``, as the worker builds them);
- **D (dead memory)**: after D dies its memory is nobody's: writes into it are not checked.

Every message is duplicated here, registrations included. (A prefill that finishes while its
layer WRITEs are in flight and the final write cannot post at once left those WRITEs unwatched
until the writer's confirm timeout: found by this model, see
:func:`test_layer_writes_outlive_their_bound_while_the_final_write_confirms`; they now stay
watched, and stopped at their bound, until the final write takes them.)
"""

from __future__ import annotations

import collections
import math
import sys
from collections.abc import Iterable

import attrs
import pytest
from hypothesis import Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvframe.core import push as pushwire
from kvframe.core import wire
from kvframe.core.clock import DEFAULT_MAX_DRIFT
from kvframe.core.holder import HolderOutput, LeaseHolder
from kvframe.core.lease import Lease, LeasePolicy, LeaseState, lease_handle
from kvframe.core.push import (
    EndSource,
    Keepalive,
    PushAction,
    PushRefused,
    PushRegister,
    PushSource,
    Refuse,
    StartWrite,
)
from kvframe.core.reader import (
    Action,
    LeaseReader,
    LoadEnded,
    PostRead,
    ReaderTimeouts,
    ReadState,
    SendMessage,
    StopRead,
)
from kvframe.core.receiver import (
    Fence,
    FreeNow,
    PushEnded,
    PushReceiver,
    ReceiverAction,
    ReceiveState,
    Revoke,
    SendRegistration,
)
from tests.core import pdsim
from tests.core.pdsim import Clock

POLICY = LeasePolicy.from_duration(6.0)
"""``kv_lease_duration`` 6 s: heartbeat interval 1 s, extension 4 s."""
HANDSHAKE_TIMEOUT = 1.5
WRITER_TIMEOUTS = ReaderTimeouts.from_policy(
    POLICY, peer_timeout=2 * HANDSHAKE_TIMEOUT, margin=None
)
"""As the worker builds its writer (``read_margin`` unset: margin = extension / 4 = 1 s)."""
MAX_DRIFT = DEFAULT_MAX_DRIFT
RATE_LOW = 1 - MAX_DRIFT / 2
RATE_HIGH = 1 + MAX_DRIFT / 2
SEND_TIMEOUT = 2 * HANDSHAKE_TIMEOUT
CAP = 3 * POLICY.duration
"""The worker's PushReceiver: ``send_timeout = 2 * handshake_timeout``, ``cap = 3 *
kv_lease_duration``."""
D_BOUND_DOCUMENTED = SEND_TIMEOUT + CAP + POLICY.duration
"""The receiver's documented bound: ``send_timeout + cap + kv_lease_duration``."""
D_BOUND = SEND_TIMEOUT + CAP + POLICY.extension
"""Grant to end of a push on D, D's clock: the documented bound with the last lease duration
an extension (at the cap no lease has more than one extension left, and a revoked lease is not
renewed); no larger than :data:`D_BOUND_DOCUMENTED`."""
assert D_BOUND <= D_BOUND_DOCUMENTED
LAYERS = 2
"""P's (and D's) KV layers: a layer WRITE lands one, the final WRITE all."""
P_BOUND = POLICY.duration + (
    WRITER_TIMEOUTS.peer_timeout
    + WRITER_TIMEOUTS.confirm_timeout
    + WRITER_TIMEOUTS.transfer_timeout
)
"""Offer to ``finished_sending`` on P, P's clock: ``wait_timeout`` + the writer's bound."""
EPS = 1e-6
P = "P"
D_BLOCKS = 8
DIGEST = "0123456789abcdef" * 2
OTHER_DIGEST = "fedcba9876543210" * 2
Payload = tuple[str, tuple[tuple[int, ...], ...]]


# -- the simulated world ------------------------------------------------------------------------
@attrs.define(eq=False)
class Packet:
    src: str
    dst: str
    data: bytes
    kind: str
    """For the rules and the statistics: ``register``, ``refused`` or a wire message name."""


class Network(pdsim.Network):
    """Notifications in flight, as bytes (both formats); ``ordered``: in order per (sender,
    receiver). Delivery order, drops and copies as in ``pdsim``."""

    packets: list[Packet]  # type: ignore[assignment]

    def send(self, src: str, dst: str, data: bytes) -> None:  # type: ignore[override]
        if pushwire.is_push_message(data):
            kind = type(pushwire.decode(data)).__name__
            kind = "register" if kind == "PushRegister" else "refused"
        else:
            kind = type(wire.decode(data)).__name__
        self.packets.append(Packet(src, dst, data, kind))

    def duplicable(self) -> list[int]:
        return list(range(len(self.packets)))


@attrs.define(eq=False)
class Request:
    """One request the router sent both legs of (one push id)."""

    push_id: str
    p_blocks: tuple[tuple[int, ...], ...]
    tokens: int
    first: int
    d_per_group: int
    d_tokens: int
    d_digest: str
    kind: str


@attrs.define(eq=False)
class Transfer:
    """One posted WRITE, P's blocks into D's."""

    tid: int
    rid: str
    d: DSide
    lid: str
    pairs: list[tuple[int, int]]
    """(P block, D block), in the order the worker flattens the groups."""
    versions: dict[int, int]
    """D block -> its version when the WRITE was posted."""
    notice: bytes | None
    """The lease-done notice the transport sends once the data landed (None: the worker
    sends it after poll said DONE)."""
    posted_t: float
    bound_p: float
    """The writer's confirmed bound for the lease, P's clock (the latest seen)."""
    state: str = "flight"
    """``flight``, ``landed``, ``stopped`` or ``failed``."""
    released: bool = False
    """The worker dropped its handle (stopped, failed, or reported)."""
    stop_by: float = math.inf
    """True time by which a dead P's WRITE stops (assumption B)."""
    layers: tuple[int, ...] = tuple(range(LAYERS))
    """The layers it writes: all (the final WRITE), or one (a layer WRITE)."""
    kind: str = "final"
    """``final`` or ``layer``."""


@attrs.define(eq=False)
class DPush:
    """What the model knows of one push D's scheduler handed to D's worker."""

    rid: str
    d: DSide
    req: Request
    lid: str
    blocks: tuple[tuple[int, ...], ...]
    granted_d: float
    ends: list[str] = attrs.Factory(list)


@attrs.define(eq=False)
class POffer:
    """One finished prefill P's scheduler offered."""

    rid: str
    req: Request
    offered_p: float
    ends: int = 0


@attrs.define(eq=False)
class PushIn:
    """The worker's ``_PushIn`` (the decisions are the receiver's)."""

    lease_id: str
    engine: str
    block_ids: tuple[tuple[int, ...], ...]
    registration: bytes
    sent_to: str | None = None
    sent_at: float = 0.0


@attrs.define(eq=False)
class WriteRec:
    """The worker's ``_Write``."""

    peer: str
    lease_id: str
    local_block_ids: tuple[tuple[int, ...], ...]
    remote_block_ids: tuple[tuple[int, ...], ...]
    first_block: int = 0
    transfer: Transfer | None = None
    notice: bytes | None = None
    pre: list[Transfer] = attrs.Factory(list)
    """The layer WRITEs made before the offer, still to complete (``_Write.pre``)."""
    posted: bool = False


@attrs.define(eq=False)
class Pre:
    """The worker's ``_Pre``: layer WRITEs made early for one of D's leases."""

    peer: str
    written: list[int]
    """Per layer, P's block index up to which that layer was written."""
    handles: list[Transfer] = attrs.Factory(list)


class DSide:
    """One decoder instance: the worker's push-mode D rules around a LeaseHolder and the real
    :class:`~kvframe.core.receiver.PushReceiver`, composed as ``_push_add``, ``_push_peer``,
    ``_run_receiver``, ``_send_registration``, ``_push_abort``, ``_push_tick``,
    ``_on_push_message``, ``_push_lease_ended`` and ``_push_finished`` compose them."""

    def __init__(self, world: World, name: str, clock: Clock) -> None:
        self.w = world
        self.name = name
        self.clock = clock
        self.alive = True
        self.holder: LeaseHolder[Payload] = LeaseHolder(POLICY)
        self.receiver = PushReceiver(send_timeout=SEND_TIMEOUT, cap=CAP)
        self.pushes: dict[str, PushIn] = {}
        self.push_leases: set[str] = set()
        self.handshake = "none"  # none | connecting | ready | failed
        self.send_fails = False
        """The transport's send_notification raises (the registration never leaves)."""
        self.owner: dict[int, str | None] = dict.fromkeys(range(D_BLOCKS))
        self.version: dict[int, int] = dict.fromkeys(range(D_BLOCKS), 0)
        self.content: dict[tuple[int, int], tuple[int, int]] = {}
        """(block, layer) -> (version, P block) landed."""
        self.free: list[int] = list(range(D_BLOCKS))

    def now(self) -> float:
        return self.clock.at(self.w.t)

    def next_deadline(self) -> float | None:
        times = []
        if self.pushes and (d := self.receiver.next_deadline()) is not None:
            times.append(d)
        if (d := self.holder.next_deadline()) is not None:
            times.append(d)
        return min(times) if times else None

    # _push_add
    def push_add(self, rid: str, req: Request, *, retry: bool) -> bool:
        n = self.w.groups * req.d_per_group
        if n > len(self.free):
            return False  # the scheduler waits for free blocks
        blocks = tuple(
            tuple(self.free.pop() for _ in range(req.d_per_group)) for _ in range(self.w.groups)
        )
        now = self.now()
        lid = f"{rid}-lease"
        registration = pushwire.encode(
            PushRegister(
                push_id=req.push_id,
                lease_id=lid,
                first_block=req.first,
                num_tokens=req.d_tokens,
                prompt_digest=req.d_digest,
                groups=blocks,
            )
        )
        self.holder.grant(lid, now, (rid, blocks))
        for group in blocks:
            for b in group:
                assert self.owner[b] is None, f"D allocated block {b} twice"
                self.owner[b] = lid
        self.push_leases.add(lid)
        self.pushes[rid] = PushIn(
            lease_id=lid, engine=P, block_ids=blocks, registration=registration
        )
        self.receiver.add(rid, P, lid, now)
        self.w.dpushes[rid] = DPush(rid=rid, d=self, req=req, lid=lid, blocks=blocks, granted_d=now)
        if self.handshake == "none" or (self.handshake == "failed" and retry):
            self.handshake = "connecting"  # _ensure starts a handshake
        self.push_peer()
        return True

    # _push_peer
    def push_peer(self) -> None:
        now = self.now()
        if self.handshake == "ready":
            self.run_receiver(self.receiver.peer_ready(P, now))
        elif self.handshake == "failed":
            self.run_receiver(self.receiver.peer_failed(P, "failed", now))

    # _run_receiver
    def run_receiver(self, actions: list[ReceiverAction]) -> None:
        now = self.now()
        todo = collections.deque(actions)
        while todo:
            action = todo.popleft()
            push = self.pushes.get(action.request_id)
            if isinstance(action, SendRegistration):
                assert push is not None
                todo.extend(self.send_registration(action.request_id, push))
            elif isinstance(action, Revoke):
                assert push is not None
                self.holder.revoke(action.lease_id, now)
                if any(tr.lid == action.lease_id for tr in self.w.flying()):
                    self.w.outcomes["revoked under a WRITE"] += 1
                if push.sent_to is not None:
                    notice = wire.LeaseLost(
                        echo_seq=0,
                        holder_now=now,
                        reason=wire.LostReason.ABORTED,
                        handles=(lease_handle(action.lease_id),),
                    )
                    self.reply(push.sent_to, [notice])
            elif isinstance(action, FreeNow):
                self.lease_output(self.holder.abort(action.lease_id, now))
            elif isinstance(action, Fence):
                # _fence drops the connection to P: on a two-sided transport that cancels the
                # receives D serves; the model's WRITEs are one-sided (NIXL, the stricter
                # case), so nothing it holds in flight stops here.
                self.w.outcomes["fenced"] += 1
            else:
                assert isinstance(action, PushEnded)
                self.push_finished(action)

    # _send_registration
    def send_registration(self, rid: str, push: PushIn) -> list[ReceiverAction]:
        now = self.now()
        if self.handshake != "ready" or self.send_fails:
            return self.receiver.send_failed(rid, "boom", now)
        self.w.send(self.name, P, push.registration)
        push.sent_to = P
        push.sent_at = now
        self.holder.connected(P)
        return []

    # _push_abort
    def push_abort(self, rid: str) -> None:
        self.run_receiver(self.receiver.abort(rid, self.now()))

    # _progress, D's part: _push_tick (when pushes wait), then the holder's expiry
    def tick(self) -> None:
        if self.pushes:
            self.run_receiver(self.receiver.tick(self.now()))
        self.lease_output(self.holder.expire(self.now()))
        now = self.now()
        for rid in self.pushes:
            rec = self.w.dpushes[rid]
            assert now < rec.granted_d + D_BOUND + EPS, (
                f"D's push {rid} outlived its bound: granted at {rec.granted_d}, now {now}"
            )
        d = self.next_deadline()
        assert d is None or d > now, f"D: a progress point at {now} left {d} due"

    # _reply
    def reply(self, peer: str, messages: Iterable[wire.Message]) -> None:
        for msg in messages:
            self.w.send(self.name, peer, wire.encode(msg))

    # _on_notification, D's part
    def receive(self, sender: str, data: bytes) -> None:
        now = self.now()
        if pushwire.is_push_message(data):
            msg = pushwire.decode(data)
            assert isinstance(msg, PushRefused), "D received a registration"
            # _on_push_message
            rid = self.receiver.request_of(msg.lease_id)
            push = self.pushes.get(rid) if rid is not None else None
            if push is None or push.sent_to != sender:
                return
            reason = f"push refused: {msg.reason.name.lower()}"
            self.run_receiver(self.receiver.refused(push.engine, msg.lease_id, reason, now))
            return
        wmsg = wire.decode(data)
        if isinstance(wmsg, wire.Heartbeat | wire.LeaseDone):
            out = self.holder.receive(sender, wmsg, now)
            self.reply(sender, out.replies)
            self.lease_output(out)

    def lease_output(self, out: HolderOutput[Payload]) -> None:
        for lease in out.ended:
            self.push_lease_ended(lease)

    # _push_lease_ended
    def push_lease_ended(self, lease: Lease[Payload]) -> None:
        assert lease.request_id in self.push_leases, "a lease D did not grant ended"
        self.push_leases.discard(lease.request_id)
        self.run_receiver(self.receiver.lease_ended(lease.request_id, lease.state, self.now()))

    # _push_finished
    def push_finished(self, action: PushEnded) -> None:
        push = self.pushes.pop(action.request_id, None)
        assert push is not None, f"the receiver ended {action.request_id}, which D lacks"
        outcome = {
            ReceiveState.DONE: "done",
            ReceiveState.ABORTED: "aborted",
            ReceiveState.FAILED: "failed",
        }[action.state]
        self.w.d_finished(self, action.request_id, outcome)


class PSide:
    """The prefill engine: the worker's push-mode P rules around a PushSource and a writer,
    with ``push_layerwise`` when ``layerwise``."""

    def __init__(
        self, world: World, clock: Clock, *, require_digest: bool, layerwise: bool
    ) -> None:
        self.w = world
        self.clock = clock
        self.alive = True
        self.layerwise = layerwise
        self.push = PushSource(
            wait_timeout=POLICY.duration,
            heartbeat_interval=POLICY.heartbeat_interval,
            require_digest=require_digest,
        )
        self.writer = LeaseReader(POLICY, WRITER_TIMEOUTS, release_after_loss=True)
        self.writes: dict[str, WriteRec] = {}
        self.pre: dict[str, Pre] = {}  # D's lease id -> layer WRITEs made early
        self.reader_peers: dict[str, str] = {}  # D's engine id -> its transport peer
        self.readers: set[str] = set()
        self.post_fails = False

    def now(self) -> float:
        return self.clock.at(self.w.t)

    def next_deadline(self) -> float | None:
        times = [
            d for d in (self.push.next_deadline(), self.writer.next_deadline()) if d is not None
        ]
        # Assumption A for push_layerwise: a layer WRITE's confirmed bound is a progress
        # point (_poll_pre stops it there).
        times += [
            self.writer.confirmed_bound(pre.peer, lid)
            for lid, pre in self.pre.items()
            if any(tr.state == "flight" for tr in pre.handles)
        ]
        return min(times) if times else None

    # _add_pending_peers + the start of _progress: a decoder handshook
    def add_peer(self, peer: str) -> None:
        now = self.now()
        old = self.reader_peers.pop("D", None)
        gone = []
        if old is not None:
            self.readers.discard(old)
            gone.append(old)
        self.reader_peers["D"] = peer
        self.readers.add(peer)
        for g in gone:
            self.run_push(self.push.peer_gone(g, now))
            self.run_writer(self.writer.peer_failed(g, "the decoder connected again", now))
        self.run_writer(self.writer.peer_ready(peer, now))

    # _apply: push_sources, push_abandoned
    def offer(self, rid: str, req: Request) -> None:
        now = self.now()
        self.w.poffers[rid] = POffer(rid=rid, req=req, offered_p=now)
        self.run_push(self.push.offer(rid, req.push_id, req.p_blocks, req.tokens, DIGEST, now))

    def abandon(self, push_id: str) -> None:
        self.run_push(self.push.abandon(push_id, self.now()))

    # _on_notification, P's part
    def receive(self, sender: str, data: bytes) -> None:
        now = self.now()
        if pushwire.is_push_message(data):
            msg = pushwire.decode(data)
            assert isinstance(msg, PushRegister), "P received a refusal"
            if sender not in self.readers:
                return  # notifications_unroutable
            self.w.registered.add(msg.lease_id)
            self.run_push(self.push.register(sender, msg, now))
            return
        wmsg = wire.decode(data)
        if sender not in self.readers:
            return
        if isinstance(wmsg, wire.LeaseLost):
            dropped = self.push.revoked(sender, wmsg.handles, now)
            for lid in dropped:
                self.drop_pre(lid)  # stopped before the release says so
            if dropped:
                self.run_writer(self.writer.release(sender, dropped, now))
        self.run_writer(self.writer.receive(sender, wmsg, now))

    # _run_push
    def run_push(self, actions: list[PushAction]) -> None:
        for action in actions:
            if isinstance(action, StartWrite):
                assert action.lease_id in self.w.registered, "a write for no registration"
                assert action.request_id in self.w.poffers, "a write for no offer"
                rec = self.w.dpushes.get(action.lease_id.removesuffix("-lease"))
                assert rec is not None
                assert rec.blocks == action.remote_block_ids
                # the layer WRITEs stay in self.pre (watched) until the final write posts
                self.writes[action.request_id] = WriteRec(
                    peer=action.engine,
                    lease_id=action.lease_id,
                    local_block_ids=action.local_block_ids,
                    remote_block_ids=action.remote_block_ids,
                    first_block=action.first_block,
                )
                self.run_writer(
                    self.writer.add(action.request_id, action.engine, action.lease_id, self.now())
                )
            elif isinstance(action, Refuse):
                self.drop_pre(action.lease_id)
                refusal = PushRefused(lease_id=action.lease_id, reason=action.reason)
                self.send(action.engine, pushwire.encode(refusal))
                self.writer.spend(action.engine, [action.lease_id], self.now())
            elif isinstance(action, EndSource):
                self.w.p_finished(action.request_id)
            else:
                assert isinstance(action, Keepalive)
                self.run_writer(self.writer.heartbeat(action.engine, action.lease_ids, self.now()))

    def send(self, peer: str, data: bytes) -> None:
        self.w.send(P, peer, data)

    # _run_writer
    def run_writer(self, actions: list[Action]) -> None:
        todo = collections.deque(actions)
        while todo:
            action = todo.popleft()
            if isinstance(action, SendMessage):
                self.send(action.engine, wire.encode(action.message))
            elif isinstance(action, PostRead):
                todo.extend(self.post_write(action))
            elif isinstance(action, StopRead):
                wr = self.writes.get(action.request_id)
                if wr is not None:
                    self.stop_write(wr)
                    self.drop_pre(wr.lease_id)
            elif isinstance(action, LoadEnded):
                self.write_ended(action)
            else:
                raise AssertionError(f"the writer asked for {action!r}")

    # _post_write
    def post_write(self, action: PostRead) -> list[Action]:
        now = self.now()
        wr = self.writes[action.request_id]
        local_groups, remote_groups = wr.local_block_ids, wr.remote_block_ids
        pre = self.pre.pop(wr.lease_id, None)
        if pre is not None and pre.peer == wr.peer:
            # What every layer already has needs no second write.
            skip = min(pre.written) - wr.first_block
            if skip > 0:
                local_groups = tuple(g[skip:] for g in local_groups)
                remote_groups = tuple(g[skip:] for g in remote_groups)
            wr.pre = pre.handles
        elif pre is not None:
            self.release_all(pre.handles)
        local = [b for g in local_groups for b in g]
        remote = [b for g in remote_groups for b in g]
        notice = wire.encode(action.notification)
        lid = wr.lease_id
        assert action.notification.handles == (lease_handle(lid),)
        bound = self.writer.confirmed_bound(wr.peer, lid)
        assert bound - now >= WRITER_TIMEOUTS.margin - EPS, "a WRITE posted without its margin"
        self.w.check_bound(wr.peer, lid, bound, f"posting {action.request_id}")
        wr.posted = True
        if not local:
            # Nothing (more) to write: the notice goes once the layer WRITEs are done.
            wr.notice = notice
            self.poll_write(action.request_id, wr)  # _settle_writes
            return []
        if self.post_fails:
            self.stop_write(wr)
            return self.writer.transfer_failed(
                action.request_id, "posting the write failed: boom", now
            )
        d = self.w.d_named(wr.peer)
        tr = self.w.post(action.request_id, d, lid, list(zip(local, remote, strict=True)), bound)
        if wr.pre or not self.w.after_data:
            wr.notice = notice
        else:
            tr.notice = notice
        wr.transfer = tr
        return []

    def release_all(self, handles: Iterable[Transfer]) -> None:
        for tr in handles:
            self.w.stop(tr)

    # _stop_write
    def stop_write(self, wr: WriteRec) -> None:
        if wr.transfer is not None:
            self.w.stop(wr.transfer)
            wr.transfer = None
        self.release_all(wr.pre)
        wr.pre = []

    # _write_status: the final WRITE and the layer WRITEs still in flight, as one transfer
    @staticmethod
    def write_status(wr: WriteRec) -> str:
        states = [tr.state for tr in wr.pre]
        if wr.transfer is not None:
            states.append(wr.transfer.state)
        if "failed" in states:
            return "failed"
        return "pending" if "flight" in states else "done"

    # _poll_writes + _write_state, for one write
    def poll_write(self, rid: str, wr: WriteRec) -> None:
        if self.writes.get(rid) is not wr or not wr.posted:
            return
        status = self.write_status(wr)
        if status == "pending":
            return
        now = self.now()
        if status == "failed":
            self.stop_write(wr)
            self.run_writer(self.writer.transfer_failed(rid, "boom", now))
            return
        wr.posted = False
        if wr.transfer is not None:
            wr.transfer.released = True
            wr.transfer = None
        if wr.notice is not None:
            notice, wr.notice = wr.notice, None
            self.send(wr.peer, notice)
        self.release_all(wr.pre)
        wr.pre = []
        self.run_writer(self.writer.transfer_done(rid, now))

    def write_state(self, tr: Transfer) -> None:
        """P's worker polls the write ``tr`` belongs to (``tr`` landed or failed)."""
        for rid, wr in list(self.writes.items()):
            if wr.transfer is tr or tr in wr.pre:
                self.poll_write(rid, wr)
                return
        self.poll_pre()

    # _write_ended
    def write_ended(self, action: LoadEnded) -> None:
        wr = self.writes.pop(action.request_id, None)
        if wr is not None:
            self.stop_write(wr)
            self.drop_pre(wr.lease_id)
        self.w.p_finished(action.request_id)

    # -- push_layerwise ------------------------------------------------------------------------
    # _write_layer: layer ``i`` of the prefill for ``req`` computed ``full`` blocks
    def write_layer(self, req: Request, i: int, full: int) -> None:
        now = self.now()
        found = self.push.registration(req.push_id)
        if found is None:
            return
        peer, reg = found
        if self.push.fits(reg, req.p_blocks, req.tokens, DIGEST, partial=True):
            return  # the offer will refuse it
        bound = self.writer.confirmed_bound(peer, reg.lease_id)
        if bound - now < WRITER_TIMEOUTS.margin:
            return  # not confirmed (yet): the final write carries these blocks
        pre = self.pre.get(reg.lease_id)
        if pre is None or pre.peer != peer:
            pre = self.pre[reg.lease_id] = Pre(peer=peer, written=[0] * LAYERS)
        lo = max(reg.first_block, pre.written[i])
        local: list[int] = []
        remote: list[int] = []
        his = []
        for pg, dg in zip(req.p_blocks, reg.groups, strict=True):
            hi = min(full, reg.first_block + len(dg), len(pg))
            his.append(hi)
            if hi > lo:
                local += pg[lo:hi]
                remote += dg[lo - reg.first_block : hi - reg.first_block]
        if not local:
            return
        self.w.check_bound(peer, reg.lease_id, bound, f"posting layer {i} of {req.push_id}")
        if self.post_fails:
            self.drop_pre(reg.lease_id)
            return
        d = self.w.d_named(peer)
        tr = self.w.post(
            req.push_id, d, reg.lease_id, list(zip(local, remote, strict=True)), bound, layer=i
        )
        pre.handles.append(tr)
        pre.written[i] = min(his)
        self.w.outcomes["layer WRITE posted"] += 1

    # _poll_pre
    def poll_pre(self) -> None:
        now = self.now()
        for lid, pre in list(self.pre.items()):
            pending = []
            failed = False
            for tr in pre.handles:
                if tr.state == "flight":
                    pending.append(tr)
                elif tr.state == "failed":
                    failed = True
                else:
                    tr.released = True
            pre.handles = pending
            if failed or (pending and self.writer.confirmed_bound(pre.peer, lid) <= now):
                if pending and not failed:
                    self.w.outcomes["layer WRITE stopped at its bound"] += 1
                self.drop_pre(lid)

    # _drop_pre
    def drop_pre(self, lease_id: str) -> None:
        pre = self.pre.pop(lease_id, None)
        if pre is not None:
            self.release_all(pre.handles)

    # _progress, P's part: poll the layer WRITEs and the writes, then the deadlines
    def tick(self, *, poll: bool) -> None:
        if self.pre:
            self.poll_pre()
        if poll:
            for rid, wr in list(self.writes.items()):
                self.poll_write(rid, wr)
        now = self.now()
        self.run_push(self.push.tick(now))
        self.run_writer(self.writer.tick(now))
        for rid, rec in self.w.poffers.items():
            if not rec.ends:
                assert now < rec.offered_p + P_BOUND + EPS, f"P's offer {rid} outlived its bound"
        d = self.next_deadline()
        assert d is None or d > now, f"P: a progress point at {now} left {d} due"


class World:
    """One P, a sequence of D instances (one alive at a time), a network, true time."""

    def __init__(
        self,
        *,
        ordered: bool,
        after_data: bool,
        groups: int,
        p_clock: Clock,
        d_clock: Clock,
        require_digest: bool,
        layerwise: bool = False,
    ) -> None:
        self.t = 0.0
        self.net = Network(ordered=ordered)
        self.after_data = after_data
        self.groups = groups
        self.p = PSide(self, p_clock, require_digest=require_digest, layerwise=layerwise)
        self.ds: list[DSide] = []
        self.d = self._new_d(d_clock)
        self.transfers: list[Transfer] = []
        self.dpushes: dict[str, DPush] = {}
        self.poffers: dict[str, POffer] = {}
        self.registered: set[str] = set()  # lease ids P received a registration for
        self.outcomes: collections.Counter[str] = collections.Counter()
        self._n = 0
        self._next_p_block = 1000

    def _new_d(self, clock: Clock) -> DSide:
        d = DSide(self, f"D{len(self.ds) + 1}", clock)
        self.ds.append(d)
        return d

    def d_named(self, name: str) -> DSide:
        [d] = [d for d in self.ds if d.name == name]
        return d

    def ident(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    # -- the router ---------------------------------------------------------------------------
    def new_request(self, kind: str, nblocks: int, first: int) -> Request:
        # D lacks at least one block of P's, unless it has them all (``all_local``)
        first = nblocks if kind == "all_local" else min(first, nblocks - 1)
        p_blocks = []
        for _ in range(self.groups):
            p_blocks.append(tuple(range(self._next_p_block, self._next_p_block + nblocks)))
            self._next_p_block += nblocks
        per = nblocks - first + (1 if kind == "blocks" else 0)
        return Request(
            push_id=self.ident("push"),
            p_blocks=tuple(p_blocks),
            tokens=16 * nblocks + 3,
            first=first,
            d_per_group=per,
            d_tokens=16 * nblocks + 3 + (1 if kind == "prompt" else 0),
            d_digest=OTHER_DIGEST if kind == "digest" else DIGEST,
            kind=kind,
        )

    # -- the network --------------------------------------------------------------------------
    def send(self, src: str, dst: str, data: bytes) -> None:
        self.net.send(src, dst, data)

    def deliver(self, index: int) -> None:
        packet = self.net.packets.pop(index)
        if packet.dst == P:
            if self.p.alive:
                self.p.receive(packet.src, packet.data)
        else:
            d = self.d_named(packet.dst)
            if d.alive:
                d.receive(packet.src, packet.data)

    # -- the transport ------------------------------------------------------------------------
    def post(
        self,
        rid: str,
        d: DSide,
        lid: str,
        pairs: list[tuple[int, int]],
        bound: float,
        *,
        layer: int | None = None,
    ) -> Transfer:
        """A WRITE of P's request ``rid`` (a layer WRITE: of push id ``rid``)."""
        if layer is None:
            flying = [tr for tr in self.flying() if tr.rid == rid and tr.kind == "final"]
            assert not flying, f"two WRITEs of {rid}"
        if d.alive:
            for _, b in pairs:
                assert d.owner[b] == lid, f"a WRITE for {lid} posted into block {b} it lacks"
        tr = Transfer(
            tid=len(self.transfers),
            rid=rid,
            d=d,
            lid=lid,
            pairs=pairs,
            versions={b: d.version[b] for _, b in pairs},
            notice=None,
            posted_t=self.t,
            bound_p=bound,
            layers=tuple(range(LAYERS)) if layer is None else (layer,),
            kind="final" if layer is None else "layer",
        )
        self.transfers.append(tr)
        return tr

    def flying(self) -> list[Transfer]:
        return [tr for tr in self.transfers if tr.state == "flight"]

    def reportable(self) -> list[Transfer]:
        return [tr for tr in self.transfers if tr.state == "landed" and not tr.released]

    def stop(self, tr: Transfer) -> None:
        if tr.state == "flight":
            tr.state = "stopped"
            self.outcomes["WRITE stopped"] += 1
        tr.released = True

    def land(self, tr: Transfer) -> None:
        """Every byte of the WRITE landed; the transport sends its notice (if it does)."""
        assert tr.state == "flight"
        d = tr.d
        if d.alive:
            for pb, db in tr.pairs:
                assert (d.owner[db], d.version[db]) == (tr.lid, tr.versions[db]), (
                    f"the WRITE of {tr.rid} (lease {tr.lid}) landed in block {db}, which D freed"
                    f" (now held for {d.owner[db]}, version {d.version[db]}, posted on "
                    f"{tr.versions[db]})"
                )
                for layer in tr.layers:
                    d.content[(db, layer)] = (d.version[db], pb)
        tr.state = "landed"
        if tr.notice is not None:
            self.send(P, d.name, tr.notice)

    def fail(self, tr: Transfer) -> None:
        assert tr.state == "flight"
        tr.state = "failed"

    # -- ends ---------------------------------------------------------------------------------
    def p_finished(self, rid: str) -> None:
        """P's finished_sending: its source blocks are freed."""
        rec = self.poffers[rid]
        rec.ends += 1
        assert rec.ends == 1, f"P ended {rid} twice"
        flying = [tr.tid for tr in self.flying() if tr.rid in (rid, rec.req.push_id)]
        assert not flying, f"P freed {rid}'s blocks under its WRITE in flight"
        now = self.p.now()
        assert now < rec.offered_p + P_BOUND + EPS, f"P's offer {rid} ended late"
        self.outcomes["p ended"] += 1

    def d_finished(self, d: DSide, rid: str, outcome: str) -> None:
        """D's finished_recving; its blocks go back to the free list."""
        rec = self.dpushes[rid]
        rec.ends.append(outcome)
        assert len(rec.ends) == 1, f"D ended {rid} twice: {rec.ends}"
        state = d.holder.table.state(rec.lid)
        assert state is not LeaseState.LIVE, (
            f"D freed the blocks of {rid} ({outcome}) while its lease {rec.lid} is live"
        )
        flying = [tr for tr in self.flying() if tr.d is d and tr.lid == rec.lid]
        assert not flying, (
            f"D freed the blocks of {rid} (lease {rec.lid} {state.value}, outcome "
            f"{outcome}) while P's {flying[0].kind} WRITE into them is in flight"
        )
        if outcome == "done":
            req = rec.req
            for g, group in enumerate(rec.blocks):
                for j, b in enumerate(group):
                    want = req.p_blocks[g][req.first + j]
                    for layer in range(LAYERS):
                        assert d.content.get((b, layer)) == (d.version[b], want), (
                            f"D reports {rid} done but block {b} lacks P's block {want} "
                            f"in layer {layer}"
                        )
        for group in rec.blocks:
            for b in group:
                assert d.owner[b] == rec.lid, f"D frees block {b} twice"
                d.owner[b] = None
                d.version[b] += 1
                d.free.append(b)
        self.outcomes[f"d {outcome}"] += 1

    # -- deaths -------------------------------------------------------------------------------
    def p_dies(self) -> None:
        self.p.alive = False
        if self.flying():
            self.outcomes["P died under a WRITE"] += 1
        if self.reportable():
            self.outcomes["P died after a WRITE landed"] += 1
        for tr in self.flying():
            tr.stop_by = max(self.t, self.p.clock.when(tr.bound_p))

    def d_dies(self) -> None:
        self.d.alive = False
        if any(tr.d is self.d for tr in self.flying()):
            self.outcomes["D died under a WRITE"] += 1

    def d_restarts(self, clock: Clock) -> None:
        assert not self.d.alive
        self.d = self._new_d(clock)

    # -- time ---------------------------------------------------------------------------------
    def next_event(self) -> float | None:
        times = [tr.stop_by for tr in self.flying() if tr.stop_by < math.inf]
        if self.p.alive and (d := self.p.next_deadline()) is not None:
            times.append(self.p.clock.when(d))
        if self.d.alive and (d := self.d.next_deadline()) is not None:
            times.append(self.d.clock.when(d))
        return min(times) if times else None

    def advance(self, dt: float, *, poll: bool) -> None:
        target = self.t + dt
        for _ in range(10_000):
            nxt = self.next_event()
            if nxt is None or nxt > target:
                break
            self.t = max(self.t, nxt)
            self.wake_due(poll=poll)
        else:
            raise AssertionError("the machines' deadlines do not move forward")
        self.t = max(self.t, target)

    def wake_due(self, *, poll: bool) -> None:
        for tr in self.flying():
            if tr.stop_by <= self.t:
                self.stop(tr)  # assumption B
        if self.p.alive and (d := self.p.next_deadline()) is not None and d <= self.p.now():
            self.p.tick(poll=poll)
        if self.d.alive and (d := self.d.next_deadline()) is not None and d <= self.d.now():
            self.d.tick()

    # -- checks -------------------------------------------------------------------------------
    def check_bound(self, peer: str, lid: str, bound: float, why: str) -> None:
        """A bound the writer relies on must be sound: D keeps the lease at least that long,
        whatever the clocks do within the allowed drift from now on."""
        now = self.p.now()
        d = self.d_named(peer)
        if bound <= now or not d.alive:
            return
        lease = d.holder.table.lease(lid)
        state = lease.state if lease is not None else LeaseState.ABSENT
        assert state is LeaseState.LIVE, (
            f"{why}: P believes D's lease {lid} lasts {bound - now:.6f} s more, but D ended it "
            f"({state.value})"
        )
        assert lease is not None
        worst = (lease.expiry - d.now()) * RATE_LOW / RATE_HIGH
        assert bound - now <= worst + EPS, (
            f"{why}: P believes {lid} lasts {bound - now:.6f} s more; D may end it in "
            f"{worst:.6f} s of P's clock"
        )

    def check(self) -> None:
        p = self.p
        if p.alive:
            assert set(p.writer.loads()) == set(p.writes), "the writer's loads and writes differ"
            for rid, wr in p.writes.items():
                state = p.writer.state(rid)
                tr = wr.transfer
                if tr is not None and tr.state == "flight":
                    assert state is ReadState.POSTED, f"{rid}: a WRITE in flight but {state}"
                    lid = tr.lid
                    tr.bound_p = max(tr.bound_p, p.writer.confirmed_bound(wr.peer, lid))
                    self.check_bound(wr.peer, lid, tr.bound_p, f"{rid} writing")
                elif state is ReadState.CONFIRMING:
                    bound = p.writer.confirmed_bound(wr.peer, wr.lease_id)
                    self.check_bound(wr.peer, wr.lease_id, bound, f"{rid} confirming")
        for tr in self.flying():
            if p.alive:
                tracked = any(tr in pre.handles for pre in p.pre.values()) or any(
                    wr.transfer is tr or tr in wr.pre for wr in p.writes.values()
                )
                assert tracked, f"a {tr.kind} WRITE of {tr.rid} nobody tracks"
            d = tr.d
            if d.alive:
                for _, b in tr.pairs:
                    assert d.owner[b] == tr.lid
                    assert d.version[b] == tr.versions[b]
        for d in self.ds:
            if not d.alive:
                continue
            live = {lease.request_id for lease in d.holder.table.leases()}
            assert live == {push.lease_id for push in d.pushes.values()}
            assert live == set(d.push_leases)
            assert len(d.receiver) == len(d.pushes)
            for rid, push in d.pushes.items():
                assert d.receiver.lease_of(rid) == push.lease_id
            assert sorted(d.free + [b for b, o in d.owner.items() if o]) == list(range(D_BLOCKS))

    def finish(self) -> None:
        """Let time run, waking the live workers at their deadlines, until every push must
        have ended; then each did, exactly once, on every side still alive."""
        self.advance(2 * (D_BOUND + P_BOUND) / RATE_LOW, poll=True)
        self.check()
        for rec in self.dpushes.values():
            if rec.d.alive:
                assert len(rec.ends) == 1, f"D's push {rec.rid} never ended"
        for d in self.ds:
            if d.alive:
                assert d.holder.live_count == 0
                assert not d.pushes
                assert not d.push_leases
        if self.p.alive:
            for off in self.poffers.values():
                assert off.ends == 1, f"P's offer {off.rid} never ended"
            assert len(self.p.writer) == 0
            assert len(self.p.push) == 0
            assert not self.p.writes
            assert not any(pre.handles for pre in self.p.pre.values())
        assert not self.flying(), "a WRITE still in flight after every bound"


# -- the state machine --------------------------------------------------------------------------
OFFSETS = st.one_of(
    st.sampled_from([0.0, -5_000.0, 5_000.0]),
    st.floats(min_value=-5_000.0, max_value=5_000.0, allow_nan=False),
)
RATES = st.one_of(
    st.sampled_from([RATE_LOW, 1.0, RATE_HIGH]), st.floats(min_value=RATE_LOW, max_value=RATE_HIGH)
)
CLOCKS = st.tuples(OFFSETS, RATES)
DT = st.one_of(
    st.sampled_from([0.0, 0.01, 0.5, 1.0, 2.0, 4.0, 6.5, 20.0]),
    st.floats(min_value=0.0, max_value=8.0),
)
NBLOCKS = st.integers(1, 3)
FIRSTS = st.integers(0, 2)
THEN = st.sampled_from(
    [
        *("", "", "", "p_dies", "d_dies", "d_aborts", "handshake_again"),
        *("landed_p_dies", "landed_d_dies", "landed_d_aborts"),
    ]
)
FLOWS = st.sampled_from(["later", "legs", "settle", "settle", "write", "write"])
RARELY = st.sampled_from([False] * 7 + [True])
KINDS = st.sampled_from(
    ["ok"] * 8 + ["prompt", "digest", "blocks", "no_p", "no_d", "twice_d", "all_local"]
)


class PushProtocol(RuleBasedStateMachine):
    """P and D as the worker composes them; anything may happen in any order."""

    def __init__(self) -> None:
        super().__init__()
        self.world: World | None = None
        self.p_legs: list[Request] = []
        self.d_legs: list[Request] = []

    @property
    def w(self) -> World:
        assert self.world is not None
        return self.world

    @initialize(
        ordered=st.booleans(),
        after_data=st.booleans(),
        groups=st.integers(1, 2),
        p_clock=CLOCKS,
        d_clock=CLOCKS,
        require_digest=st.booleans(),
        layerwise=st.booleans(),
        requests=st.lists(st.tuples(KINDS, NBLOCKS, FIRSTS, FLOWS, THEN), min_size=1, max_size=3),
    )
    def setup(
        self,
        ordered: bool,
        after_data: bool,
        groups: int,
        p_clock: tuple[float, float],
        d_clock: tuple[float, float],
        require_digest: bool,
        layerwise: bool,
        requests: list[tuple[str, int, int, str, str]],
    ) -> None:
        self.world = World(
            ordered=ordered,
            after_data=after_data,
            groups=groups,
            p_clock=Clock(*p_clock),
            d_clock=Clock(*d_clock),
            require_digest=require_digest,
            layerwise=layerwise,
        )
        for args in requests:
            self.request(*args)

    # -- the router and the schedulers --------------------------------------------------------
    @rule(
        kind=KINDS,
        nblocks=NBLOCKS,
        first=FIRSTS,
        flow=FLOWS,
        then=THEN,
    )
    def request(self, kind: str, nblocks: int, first: int, flow: str, then: str) -> None:
        """The router sends both legs with one push id (``no_p``/``no_d``: one leg is lost;
        ``twice_d``: the decode leg reaches D twice). ``flow``: the legs wait for later rules,
        or arrive at once (``legs``), then a calm moment follows (``settle``: D's handshake
        completes if it is under way, the network delivers in order), and the WRITE lands
        and is polled (``write``). ``then``, after a ``settle``: while the WRITE is in flight
        (or after it landed, before P polled it: ``landed_``), P or D dies, D aborts, or D
        handshakes again."""
        req = self.w.new_request(kind, nblocks, first)
        if kind != "no_p":
            self.p_legs.append(req)
        if kind != "no_d":
            self.d_legs.append(req)
        if kind == "twice_d":
            self.d_legs.append(req)
        if flow == "later":
            return
        for _ in range(2):
            if self.d_legs and self.d_legs[-1] is req:
                self.d_register(len(self.d_legs) - 1, retry=True)
        if self.p_legs and self.p_legs[-1] is req:
            if self.w.p.layerwise and flow != "legs":
                # progressive push: the registration and its confirmation arrive, then
                # P's prefill computes every layer
                self.calm(land=False)
                for layer in range(LAYERS):
                    self.w.p.write_layer(req, layer, nblocks)
            self.p_offer(len(self.p_legs) - 1, abandon=False)
        if flow == "legs":
            return
        self.calm(land=flow == "write")
        mine = [tr for tr in self.w.flying() if tr.rid in self.w.poffers]
        if flow != "settle" or not then or not mine or not (self.w.p.alive and self.w.d.alive):
            return
        tr = mine[-1]
        if then.startswith("landed_"):
            self.land(tr, report=False)
            then = then.removeprefix("landed_")
        if then == "p_dies":
            self.w.p_dies()
        elif then == "d_dies":
            self.w.d_dies()
        elif then == "d_aborts":
            rid = tr.lid.removesuffix("-lease")
            if rid in self.w.d.pushes:
                self.w.d.push_abort(rid)
        else:
            self.handshake_again()

    def calm(self, *, land: bool) -> None:
        w = self.w
        if w.d.alive and w.d.handshake == "connecting":
            self.handshake(True)
        for _ in range(4):
            self.pump(20)
            if land:
                for tr in w.flying():
                    self.land(tr, report=True)

    @precondition(lambda self: bool(self.p_legs))
    @rule(data=st.data(), abandon=st.booleans())
    def p_leg(self, data: st.DataObject, abandon: bool) -> None:
        """P's prefill finished (its KV is offered) or ended without KV (abandoned)."""
        self.p_offer(data.draw(st.integers(0, len(self.p_legs) - 1), label="leg"), abandon)

    def p_offer(self, index: int, abandon: bool) -> None:
        req = self.p_legs.pop(index)
        p = self.w.p
        if not p.alive:
            return
        if abandon:
            self.w.p.abandon(req.push_id)
        else:
            self.w.p.offer(self.w.ident("p-req"), req)

    @precondition(lambda self: bool(self.p_legs) and self.w.p.layerwise and self.w.p.alive)
    @rule(data=st.data(), layer=st.integers(0, LAYERS - 1), full=st.integers(0, 3))
    def p_layer(self, data: st.DataObject, layer: int, full: int) -> None:
        """push_layerwise: P's prefill computed ``full`` blocks of a layer (save_kv_layer)."""
        req = self.p_legs[data.draw(st.integers(0, len(self.p_legs) - 1), label="leg")]
        self.w.p.write_layer(req, layer, full)

    @precondition(lambda self: bool(self.d_legs))
    @rule(data=st.data(), retry=st.booleans())
    def d_leg(self, data: st.DataObject, retry: bool) -> None:
        """D's scheduler allocated the request's blocks: register them for the push."""
        self.d_register(data.draw(st.integers(0, len(self.d_legs) - 1), label="leg"), retry=retry)

    def d_register(self, index: int, *, retry: bool) -> None:
        req = self.d_legs[index]
        if not self.w.d.alive:
            self.d_legs.pop(index)
            return
        if self.w.d.push_add(self.w.ident("d-req"), req, retry=retry):
            self.d_legs.pop(index)

    @precondition(lambda self: bool(self.w.d.pushes) and self.w.d.alive)
    @rule(data=st.data())
    def d_abort(self, data: st.DataObject) -> None:
        """D's engine aborts a request whose push has not ended."""
        self.w.d.push_abort(data.draw(st.sampled_from(sorted(self.w.d.pushes)), label="push"))

    # -- handshakes, deaths -------------------------------------------------------------------
    @precondition(lambda self: self.w.d.alive and self.w.d.handshake == "connecting")
    @rule(ok=st.booleans())
    def handshake(self, ok: bool) -> None:
        """D's handshake with P completes (P sees the new peer) or fails."""
        d = self.w.d
        if ok and self.w.p.alive:
            d.handshake = "ready"
            self.w.p.add_peer(d.name)
        else:
            d.handshake = "failed"
        d.push_peer()

    @precondition(lambda self: self.w.d.alive and self.w.d.handshake == "ready" and self.w.p.alive)
    @rule()
    def handshake_again(self) -> None:
        """D handshakes P again (its connection failed): P forgets the peer, then adds it."""
        self.w.p.add_peer(self.w.d.name)

    @precondition(lambda self: self.w.p.alive)
    @rule(really=RARELY)
    def p_dies(self, really: bool) -> None:
        """P dies: it does nothing more; what it sent may still arrive."""
        if really:
            self.w.p_dies()

    @precondition(lambda self: self.w.d.alive)
    @rule(really=RARELY)
    def d_dies(self, really: bool) -> None:
        """D dies: it does nothing more; what it sent may still arrive."""
        if really:
            self.w.d_dies()

    @precondition(lambda self: bool(self.w.flying()) and self.w.p.alive and self.w.d.alive)
    @rule(side=st.sampled_from(["P", "D"]))
    def dies_mid_write(self, side: str) -> None:
        """P or D dies while a WRITE is in flight."""
        if side == "P":
            self.w.p_dies()
        else:
            self.w.d_dies()

    @precondition(lambda self: bool(self.w.reportable()) and self.w.p.alive and self.w.d.alive)
    @rule(side=st.sampled_from(["P", "D"]))
    def dies_after_write(self, side: str) -> None:
        """P or D dies after a WRITE landed, before P polled it (its notice may be in
        flight)."""
        self.dies_mid_write(side)

    @precondition(lambda self: not self.w.d.alive and len(self.w.ds) < 3)
    @rule(clock=CLOCKS)
    def d_restarts(self, clock: tuple[float, float]) -> None:
        """A new decoder instance takes the dead one's place (another transport name)."""
        self.w.d_restarts(Clock(*clock))

    # -- the network --------------------------------------------------------------------------
    @precondition(lambda self: bool(self.w.net.packets))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        self.w.deliver(data.draw(st.sampled_from(self.w.net.deliverable()), label="packet"))

    @precondition(lambda self: bool(self.w.net.packets))
    @rule(limit=st.integers(1, 12))
    def pump(self, limit: int) -> None:
        """A calm network for a moment: the oldest messages arrive, in order."""
        for _ in range(limit):
            if not self.w.net.packets:
                return
            self.w.deliver(0)

    @precondition(lambda self: bool(self.w.net.packets))
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        del self.w.net.packets[data.draw(st.integers(0, len(self.w.net.packets) - 1))]

    @precondition(lambda self: bool(self.w.net.duplicable()))
    @rule(data=st.data())
    def duplicate(self, data: st.DataObject) -> None:
        packet = self.w.net.packets[data.draw(st.sampled_from(self.w.net.duplicable()))]
        self.w.net.packets.append(attrs.evolve(packet))

    # -- the transport ------------------------------------------------------------------------
    @precondition(lambda self: bool(self.w.flying()))
    @rule(data=st.data(), report=st.booleans())
    def land_write(self, data: st.DataObject, report: bool) -> None:
        self.land(data.draw(st.sampled_from(self.w.flying()), label="write"), report=report)

    def land(self, tr: Transfer, *, report: bool) -> None:
        self.w.land(tr)
        if report and self.w.p.alive:
            self.w.p.write_state(tr)

    @rule(land=st.booleans())
    def calm_moment(self, land: bool) -> None:
        """The network delivers what is in flight in order (and the WRITEs land)."""
        self.calm(land=land)

    @precondition(lambda self: bool(self.w.reportable()) and self.w.p.alive)
    @rule(data=st.data())
    def report(self, data: st.DataObject) -> None:
        """P's worker polls a landed WRITE: DONE."""
        self.w.p.write_state(data.draw(st.sampled_from(self.w.reportable()), label="write"))

    @precondition(lambda self: bool(self.w.flying()) and self.w.p.alive)
    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        """The transport fails a WRITE in flight (P's worker polls it: FAILED)."""
        tr = data.draw(st.sampled_from(self.w.flying()), label="write")
        self.w.fail(tr)
        self.w.p.write_state(tr)

    @rule(fails=RARELY)
    def posting_fails(self, fails: bool) -> None:
        self.w.p.post_fails = fails

    @rule(fails=RARELY)
    def registration_send_fails(self, fails: bool) -> None:
        """D's transport fails to send notifications (a registration never leaves)."""
        self.w.d.send_fails = fails

    # -- time ---------------------------------------------------------------------------------
    @rule(dt=DT, poll=st.booleans())
    def advance(self, dt: float, poll: bool) -> None:
        self.w.advance(dt, poll=poll)

    @precondition(lambda self: self.w.p.alive)
    @rule(poll=st.booleans())
    def tick_p(self, poll: bool) -> None:
        self.w.p.tick(poll=poll)

    @precondition(lambda self: self.w.d.alive)
    @rule()
    def tick_d(self) -> None:
        self.w.d.tick()

    @rule(side=st.sampled_from(["P", "D"]), rate=RATES)
    def drift(self, side: str, rate: float) -> None:
        clock = self.w.p.clock if side == "P" else self.w.d.clock
        if side == "P" and not self.w.p.alive:
            return  # a dead P's writes stop by its bound on the clock it died with
        clock.set_rate(self.w.t, rate)

    # -- checks -------------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if self.world is not None:
            self.world.check()

    def teardown(self) -> None:
        if self.world is not None and sys.exc_info()[1] is None:
            for kind, n in self.world.outcomes.items():
                event(f"{kind}: {min(n, 3)}{'+' if n >= 3 else ''}")
            event(f"writes posted: {min(len(self.world.transfers), 3)}")
            self.world.finish()


TestPushProtocol = PushProtocol.TestCase
TestPushProtocol.settings = settings(
    TestPushProtocol.settings,
    max_examples=min(settings().max_examples, 300),
    stateful_step_count=50,
    report_multiple_bugs=False,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)


# -- what a duplicated registration does -----------------------------------------------------
def calm_world(*, layerwise: bool) -> World:
    """One group, clocks in step, an ordered network, notices with the data."""
    return World(
        ordered=True,
        after_data=True,
        groups=1,
        p_clock=Clock(0.0, 1.0),
        d_clock=Clock(0.0, 1.0),
        require_digest=False,
        layerwise=layerwise,
    )


def test_a_duplicated_registration_must_not_free_blocks_under_a_write() -> None:
    """A transport that delivers a notification twice: D's registration reaches P, P matches
    it and posts the WRITE; the copy reaches P, which ignores it (the same decoder and lease
    as the registration it took: refusing it ``DUPLICATE`` made D free its blocks under the
    WRITE, found by this model); the WRITE lands and D's push ends done with P's bytes."""
    w = calm_world(layerwise=False)
    req = w.new_request("ok", 2, 0)
    w.p.offer("p-req", req)
    if not w.d.push_add("d-req", req, retry=True):
        pytest.fail("no blocks")
    w.d.handshake = "ready"
    w.p.add_peer(w.d.name)
    w.d.push_peer()
    if [p.kind for p in w.net.packets] != ["register"]:
        pytest.fail(f"expected the registration alone in flight: {w.net.packets}")
    w.net.packets.append(attrs.evolve(w.net.packets[0]))  # the transport delivers it twice
    w.deliver(0)  # P matches: StartWrite; the writer heartbeats D's lease
    for _ in range(10):  # D acks; P posts the WRITE
        if w.flying():
            break
        w.deliver(next(i for i, p in enumerate(w.net.packets) if p.kind != "register"))
    if not w.flying() or [p.kind for p in w.net.packets] != ["register"]:
        pytest.fail(f"expected a WRITE in flight and the copy: {w.net.packets}")
    w.deliver(0)  # the copy: P ignores it
    assert [p.kind for p in w.net.packets] == [], w.net.packets
    [tr] = w.flying()
    w.land(tr)
    for _ in range(10):  # the completion notice, and what follows it
        if not w.net.packets:
            break
        w.deliver(0)
    assert w.outcomes["d done"] == 1, w.outcomes


# -- progressive push: layer WRITEs handed to a final write that cannot post yet ---------------
def test_layer_writes_outlive_their_bound_while_the_final_write_confirms() -> None:
    """push_layerwise: D's registration waits at P, its lease is confirmed, P writes a layer
    early; the acknowledgements then stop coming (dropped), so when P's prefill finishes its
    bound is too short for the final write, which waits for a confirmation with the layer
    WRITE still in flight. Nothing stops that WRITE at the confirmed bound: D's lease expires,
    D frees the blocks, and the layer WRITE may still land in them. It must be stopped by
    then (as ``_poll_pre`` stops one before the offer)."""
    w = calm_world(layerwise=True)
    req = w.new_request("ok", 2, 0)
    if not w.d.push_add("d-req", req, retry=True):
        pytest.fail("no blocks")
    w.d.handshake = "ready"
    w.p.add_peer(w.d.name)
    w.d.push_peer()
    for _ in range(3):  # the registration; P's keepalive heartbeat; D's ack
        w.deliver(0)
    lid = "d-req-lease"
    bound = w.p.writer.confirmed_bound(w.d.name, lid)
    if not bound - w.p.now() >= WRITER_TIMEOUTS.margin:
        pytest.fail(f"the lease is not confirmed: {bound}")
    w.p.write_layer(req, 0, 2)
    [layer] = w.flying()
    assert layer.kind == "layer"
    w.net.packets.clear()
    w.advance(bound - w.p.now() - WRITER_TIMEOUTS.margin / 2, poll=True)
    w.net.packets.clear()  # P's heartbeats are lost
    w.p.offer("p-req", req)  # the final write waits for a confirmation
    assert w.p.writer.state("p-req") is ReadState.CONFIRMING
    assert layer.state == "flight"
    for _ in range(40):  # time passes; every message is lost
        w.net.packets.clear()
        w.advance(0.25, poll=True)
    assert layer.state == "stopped", "the layer WRITE was never stopped"
    assert w.dpushes["d-req"].ends == ["failed"]
