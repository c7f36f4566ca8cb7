"""A Hypothesis state machine over a transport pair, checked against a plain model.

Rules: scribble new bytes into an idle block, post READ/WRITE (random blocks, region subsets,
with or without a notification), poll, release (also while pending), send notifications both
ways, drain them, check the buffers, close. The model holds the expected content of every
block of both buffers (or *unknown*, after a transfer was released while pending) and the
notifications each side must, may, or must not receive. Invariants: a healthy pair never
answers ``FAILED``; every known block holds exactly the model's bytes; notifications arrive
from the right sender, only once, in order when the transport says so; a released handle and
a closed transport raise :class:`~kvframe.errors.TransportClosedError`.

Run it with :func:`run_transport_state_machine` (the conformance kit's ``test_state_machine``
does). Transfers never overlap a pending transfer's blocks, because the SPI leaves such bytes
undefined.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any, ClassVar

import attrs
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvframe.errors import TransportClosedError
from kvframe.spi.transport import Op, XferState
from kvframe.testing.pair import BLOCK_LENS, NUM_BLOCKS, POLL_INTERVAL, Pair, PairFactory

__all__ = ["TransportStateMachine", "run_transport_state_machine"]

_SIDES = ("a", "b")


@attrs.define(eq=False)
class _Posted:
    xid: int
    op: Op
    local_blocks: list[int]
    remote_blocks: list[int]
    regions: list[int]
    payload: bytes | None
    src_bytes: list[tuple[int, int, bytes]]  # (region, dst block, bytes) to land on the dst


class TransportStateMachine(RuleBasedStateMachine):
    """The machine; :func:`run_transport_state_machine` subclasses it with a pair factory.

    ``make_pair`` (a class attribute) builds a fresh :class:`~kvframe.testing.Pair` per
    example; ``spare_pairs`` are used first (so a probe pair is not wasted).
    """

    make_pair: ClassVar[PairFactory | None] = None
    spare_pairs: ClassVar[list[Pair]] = []

    def __init__(self) -> None:
        super().__init__()
        cls = type(self)
        if cls.spare_pairs:
            self.p = cls.spare_pairs.pop()
        else:
            assert cls.make_pair is not None, "set make_pair (use run_transport_state_machine)"
            self.p = cls.make_pair()
        p = self.p
        self.model = {"a": p.a_data.copy(), "b": p.b_data.copy()}
        shape = (len(BLOCK_LENS), NUM_BLOCKS)
        self.known = {"a": np.ones(shape, bool), "b": np.ones(shape, bool)}
        self.busy = {"a": np.zeros(shape, bool), "b": np.zeros(shape, bool)}
        self.pending: list[_Posted] = []
        self.finished: list[_Posted] = []
        self.ordered: dict[str, deque[bytes]] = {"a": deque(), "b": deque()}
        # payload -> must it arrive? (post notifications: yes once DONE; no once released early)
        self.post_notes: dict[str, dict[bytes, bool]] = {"a": {}, "b": {}}
        self.counter = itertools.count()
        self.closed = False
        self.offsets = list(itertools.accumulate([0] + [b * NUM_BLOCKS for b in BLOCK_LENS]))
        self.ops = [op for op in (Op.READ, Op.WRITE) if self._supported(op)]

    # -- helpers ----------------------------------------------------------------------------
    def _supported(self, op: Op) -> bool:
        return self.p.caps.read if op is Op.READ else self.p.caps.write

    def _ep(self, side: str) -> Any:
        return self.p.a if side == "a" else self.p.b

    def _cell(self, side: str, region: int, block: int) -> np.ndarray[Any, Any]:
        blen = BLOCK_LENS[region]
        start = self.offsets[region] + block * blen
        return self.model[side][start : start + blen]

    def _sides(self, op: Op) -> tuple[str, str]:
        """(source side, destination side) of a transfer posted by ``a``."""
        return ("b", "a") if op is Op.READ else ("a", "b")

    def _land(self, posted: _Posted) -> None:
        _, dst = self._sides(posted.op)
        for region, block, data in posted.src_bytes:
            self._cell(dst, region, block)[:] = np.frombuffer(data, np.uint8)
            self.known[dst][region, block] = True
        self._unbusy(posted)

    def _unbusy(self, posted: _Posted) -> None:
        src, dst = self._sides(posted.op)
        src_blocks, dst_blocks = (
            (posted.remote_blocks, posted.local_blocks)
            if posted.op is Op.READ
            else (posted.local_blocks, posted.remote_blocks)
        )
        for r in posted.regions:
            for blk in src_blocks:
                self.busy[src][r, blk] = False
            for blk in dst_blocks:
                self.busy[dst][r, blk] = False

    def _stopped(self, posted: _Posted, status: Any) -> None:
        assert status.state is not XferState.FAILED, (
            f"a transfer between two healthy endpoints failed: {status.error!r}"
        )
        self.pending.remove(posted)
        self._land(posted)
        self.finished.append(posted)
        if posted.payload is not None and posted.payload in self.post_notes["b"]:
            # not received yet (it may legitimately arrive before the initiator sees DONE)
            self.post_notes["b"][posted.payload] = True

    def _receive(self, side: str) -> None:
        sender = self.p.peer_b if side == "a" else self.p.peer_a
        for note in self._ep(side).drain():
            assert note.sender == sender, f"notification from {note.sender!r}, not {sender!r}"
            queue = self.ordered[side]
            if queue and note.payload == queue[0]:
                queue.popleft()
            elif note.payload in self.post_notes[side]:
                del self.post_notes[side][note.payload]
            elif not self.p.caps.ordered_notifications and note.payload in queue:
                queue.remove(note.payload)
            else:
                raise AssertionError(
                    f"{side} received {note.payload!r}: unexpected, duplicated or out of order "
                    f"(next expected {list(queue)[:1]!r})"
                )

    # -- rules ------------------------------------------------------------------------------
    @precondition(lambda self: not self.closed)
    @rule(data=st.data())
    def scribble(self, data: st.DataObject) -> None:
        """Write fresh random bytes into an idle block of either side (the model follows)."""
        side = data.draw(st.sampled_from(_SIDES))
        free = np.argwhere(~self.busy[side])
        if len(free) == 0:
            return
        region, block = (int(x) for x in free[data.draw(st.integers(0, len(free) - 1))])
        fill = data.draw(st.binary(min_size=BLOCK_LENS[region], max_size=BLOCK_LENS[region]))
        self._ep(side).write(self._addr(side, region, block), fill)
        self._cell(side, region, block)[:] = np.frombuffer(fill, np.uint8)
        self.known[side][region, block] = True

    def _addr(self, side: str, region: int, block: int) -> int:
        buf = self.p.a_buffer if side == "a" else self.p.b_buffer
        return buf.addr + self.offsets[region] + block * BLOCK_LENS[region]

    @precondition(lambda self: not self.closed)
    @rule(data=st.data())
    def post(self, data: st.DataObject) -> None:
        """Post READ or WRITE of random idle blocks and regions, maybe with a notification."""
        p = self.p
        op = data.draw(st.sampled_from(self.ops))
        all_regions = data.draw(st.booleans())
        regions = (
            list(range(len(BLOCK_LENS)))
            if all_regions
            else sorted(
                data.draw(st.sets(st.integers(0, len(BLOCK_LENS) - 1), min_size=1, max_size=3))
            )
        )
        local_side_free = ~self.busy["a"][regions].any(axis=0)
        remote_side_free = ~self.busy["b"][regions].any(axis=0)
        local_free = [int(b) for b in np.flatnonzero(local_side_free)]
        remote_free = [int(b) for b in np.flatnonzero(remote_side_free)]
        most = min(len(local_free), len(remote_free))
        if most == 0:
            return
        n = data.draw(st.integers(1, most))
        local_blocks = data.draw(st.permutations(local_free))[:n]
        remote_blocks = data.draw(st.permutations(remote_free))[:n]
        payload = None
        if p.caps.notifications and data.draw(st.booleans()):
            payload = f"post-{next(self.counter)}".encode()
        xid = p.a.post(
            op,
            p.a_local,
            local_blocks,
            p.a_remote,
            remote_blocks,
            regions=None if all_regions else regions,
            notification=payload,
        )
        src, _ = self._sides(op)
        src_blocks, dst_blocks = (
            (remote_blocks, local_blocks) if op is Op.READ else (local_blocks, remote_blocks)
        )
        src_bytes = []
        for r in regions:
            for s_blk, d_blk in zip(src_blocks, dst_blocks, strict=True):
                src_bytes.append((r, d_blk, self._cell(src, r, s_blk).tobytes()))
        posted = _Posted(xid, op, local_blocks, remote_blocks, regions, payload, src_bytes)
        # unknown source bytes make the destination unknown too
        dst = self._sides(op)[1]
        unknown_dst = [
            (r, d_blk)
            for r in regions
            for s_blk, d_blk in zip(src_blocks, dst_blocks, strict=True)
            if not self.known[src][r, s_blk]
        ]
        for r in regions:
            for blk in src_blocks:
                self.busy[src][r, blk] = True
            for blk in dst_blocks:
                self.busy[dst][r, blk] = True
        self.pending.append(posted)
        unknown = set(unknown_dst)
        posted.src_bytes = [item for item in src_bytes if (item[0], item[1]) not in unknown]
        for r, blk in unknown_dst:
            self.known[dst][r, blk] = False
        if payload is not None:
            self.post_notes["b"][payload] = False  # may arrive early; must arrive once DONE

    @precondition(lambda self: not self.closed and bool(self.pending))
    @rule(data=st.data())
    def poll(self, data: st.DataObject) -> None:
        """Poll a pending transfer; when it stops it must be DONE, and the model lands its bytes."""
        posted = data.draw(st.sampled_from(self.pending))
        status = self.p.a.poll(posted.xid)
        if status.state is not XferState.PENDING:
            self._stopped(posted, status)

    @precondition(lambda self: not self.closed and bool(self.pending))
    @rule(data=st.data())
    def release_pending(self, data: st.DataObject) -> None:
        """Release a transfer the model still thinks pending (the interesting case)."""
        self._release(data.draw(st.sampled_from(self.pending)))

    @precondition(lambda self: not self.closed and bool(self.pending or self.finished))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        """Release any transfer (twice); a pending one's destination is reused at once and
        checked."""
        self._release(data.draw(st.sampled_from(self.pending + self.finished)))

    def _release(self, posted: _Posted) -> None:
        self.p.a.release(posted.xid)
        self.p.a.release(posted.xid)  # twice: a no-op
        if posted in self.pending:
            self.pending.remove(posted)
            self._unbusy(posted)
            self._reuse_destination(posted)
            if posted.payload is not None:
                self.post_notes["b"].pop(posted.payload, None)
                # it may still arrive (the transfer may have finished unseen): tolerate it once
                self.post_notes["b"][posted.payload] = False
        else:
            self.finished.remove(posted)
        try:
            self.p.a.poll(posted.xid)
        except TransportClosedError:
            pass
        else:
            raise AssertionError("poll of a released handle did not raise TransportClosedError")

    def _reuse_destination(self, posted: _Posted) -> None:
        """The SPI lets a caller reuse a released transfer's destination blocks at once: write
        fresh bytes there, let both sides make progress, and check that nothing overwrote
        them (a transfer that kept running after release would)."""
        _, dst = self._sides(posted.op)
        blocks = posted.local_blocks if dst == "a" else posted.remote_blocks
        ep = self._ep(dst)
        for r in posted.regions:
            for blk in blocks:
                fill = bytes([next(self.counter) % 251]) * BLOCK_LENS[r]
                ep.write(self._addr(dst, r, blk), fill)
                self._cell(dst, r, blk)[:] = np.frombuffer(fill, np.uint8)
                self.known[dst][r, blk] = True
        self.p.settle(3)
        self.check_buffers()

    @precondition(lambda self: not self.closed and self.p.caps.notifications)
    @rule(to_b=st.booleans(), count=st.integers(1, 3))
    def notify(self, to_b: bool, count: int) -> None:
        """Send a burst of notifications one way or the other; they must arrive, in order if
        promised (bursts make reordering bugs show up in short runs)."""
        for _ in range(count):
            payload = f"note-{next(self.counter)}".encode()
            if to_b:
                self.p.a.notify(self.p.peer_b, payload)
                self.ordered["b"].append(payload)
            else:
                self.p.b.notify(self.p.peer_a, payload)
                self.ordered["a"].append(payload)

    @precondition(lambda self: not self.closed)
    @rule(side=st.sampled_from(_SIDES))
    def drain(self, side: str) -> None:
        """Drain one side and match what arrived against the model."""
        self._receive(side)

    @precondition(lambda self: not self.closed)
    @rule()
    def check_buffers(self) -> None:
        """Every known, idle block of both buffers holds exactly the model's bytes."""
        actual = {"a": self.p.read_a(), "b": self.p.read_b()}
        for side in _SIDES:
            for r in range(len(BLOCK_LENS)):
                for blk in range(NUM_BLOCKS):
                    if self.known[side][r, blk] and not self.busy[side][r, blk]:
                        blen = BLOCK_LENS[r]
                        start = self.offsets[r] + blk * blen
                        assert (
                            actual[side][start : start + blen].tobytes()
                            == self._cell(side, r, blk).tobytes()
                        ), f"{side}: region {r} block {blk} differs from the model"

    @precondition(lambda self: not self.closed)
    @rule()
    def close(self) -> None:
        """Close ``a``; pending handles and later calls raise TransportClosedError."""
        handles = [self.p.a.handle(x.xid) for x in self.pending]
        self.p.a.close()
        self.p.a.transport.close()
        self.closed = True
        for handle in handles:
            try:
                self.p.a.transport.poll(handle)
            except TransportClosedError:
                continue
            raise AssertionError("poll after close() did not raise TransportClosedError")
        try:
            self.p.a.transport.drain_notifications()
        except TransportClosedError:
            pass
        else:
            raise AssertionError("drain_notifications after close() did not raise")

    @precondition(lambda self: self.closed)
    @rule()
    def closed_stays_closed(self) -> None:
        """After close, close is a no-op and other calls raise TransportClosedError."""
        t = self.p.a.transport
        t.close()  # a no-op
        for call in (t.local_metadata, t.drain_notifications, lambda: t.remove_peer("x")):
            try:
                call()
            except TransportClosedError:
                continue
            raise AssertionError("a closed transport accepted a call")

    @invariant()
    def nothing_busy_without_a_pending_transfer(self) -> None:
        """Invariant: blocks are busy only while a transfer is pending."""
        if not self.pending:
            assert not self.busy["a"].any()
            assert not self.busy["b"].any()

    def teardown(self) -> None:
        """Finish pending transfers, check buffers and notifications, shut the pair down."""
        try:
            if not self.closed:
                for posted in list(self.pending):
                    self.p.wait(self.p.a, posted.xid)
                    self._stopped(posted, self.p.a.poll(posted.xid))
                self.check_buffers()
                self._wait_for_notifications()
        finally:
            self.p.close()

    def _wait_for_notifications(self) -> None:
        deadline = self.p.clock() + self.p.timeout
        while True:
            for side in _SIDES:
                self._receive(side)
            missing = [
                (side, payload)
                for side in _SIDES
                for payload in [*self.ordered[side], *self.post_notes[side]]
                if payload in self.ordered[side] or self.post_notes[side].get(payload)
            ]
            if not missing:
                return
            assert self.p.clock() < deadline, f"notifications never arrived: {missing!r}"
            self.p.pump()
            self.p.sleep(POLL_INTERVAL)


def run_transport_state_machine(
    make_pair: PairFactory,
    *,
    cross_process_examples: int = 5,
    base_settings: settings | None = None,
) -> None:
    """Run :class:`TransportStateMachine` on pairs from ``make_pair``.

    In-process pairs use ``base_settings`` (default: the loaded Hypothesis profile);
    cross-process pairs (one child process per example) run at most
    ``cross_process_examples`` examples. Raises what the machine finds (an ``AssertionError``,
    or an ``ExceptionGroup`` of them when Hypothesis reports several distinct bugs).
    """
    parent = settings() if base_settings is None else base_settings
    probe = make_pair()
    examples = parent.max_examples
    if probe.cross_process:
        examples = min(examples, cross_process_examples)

    class Machine(TransportStateMachine):
        pass

    Machine.make_pair = make_pair
    Machine.spare_pairs = [probe]
    try:
        run_state_machine_as_test(
            Machine,
            # deadline=None: a step may wait on another process; the kit bounds waits itself
            settings=settings(parent, max_examples=examples, stateful_step_count=25, deadline=None),
        )
    finally:
        for pair in Machine.spare_pairs:
            pair.close()
