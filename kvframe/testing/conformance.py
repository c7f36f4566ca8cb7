"""The transport conformance kit: tests any transport plugin runs against itself.

Use it from a plugin's test suite (see ``docs/testing-plugins.md``)::

    # conftest.py
    pytest_plugins = ["kvframe.testing.pytest_plugin"]

    @pytest.fixture
    def kvframe_transport_name():
        return "fastwire"

    # test_conformance.py
    from kvframe.testing import TransportConformance

    class TestFastWire(TransportConformance):
        pass

Every test runs on a :class:`~kvframe.testing.pair.Pair` (see :mod:`kvframe.testing.pair`):
endpoint ``a`` in the test process (its transport is ``pair.a.transport``) and endpoint ``b`` —
in a child process when the transport's capabilities say ``cross_process``, else in this
process, where the pair waits on a fake clock instead of real time.

**Ordering.** For a card that says ``notification_after_data`` (the default), the kit checks
that a post's notification reaches the peer only after every byte landed, at the moment the
peer drains it (:meth:`~kvframe.testing.endpoint.Endpoint.watch`): for a WRITE the peer
digests its own destination blocks right then; for a READ it inverts the transfer's source
blocks right then — a byte read after the notification arrived lands inverted and the final
byte check fails — and, when both endpoints are in this process, digests the poster's
destination too. It does so for transfers of a few MiB and hundreds of descriptors
(:data:`ORDER_BLOCK_LENS`), for eight concurrent posts mixed with standalone notifications,
and with the poster held still after posting. For a card that says
``notification_after_data=False`` those tests are *skipped* as not applicable (a skip is never
counted as a pass).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import pytest

from kvframe.errors import (
    CapabilityError,
    PeerUnreachableError,
    TransferFailedError,
    TransportClosedError,
    TransportError,
)
from kvframe.spi.transport import (
    BlockLayout,
    LayoutHandle,
    MemoryKind,
    MemoryRegion,
    Notification,
    Op,
    TransportCapabilities,
    XferHandle,
    XferState,
    XferStatus,
)
from kvframe.testing.endpoint import ChildEndpoint, LocalEndpoint
from kvframe.testing.pair import (
    BLOCK_LENS,
    NUM_BLOCKS,
    POLL_INTERVAL,
    Pair,
    PairFactory,
    expected_after,
)
from kvframe.testing.stateful import run_transport_state_machine

__all__ = ["ORDER_BLOCK_LENS", "ORDER_NUM_BLOCKS", "TransportConformance"]

#: Block lengths of the layout the ordering and release checks use (40 KiB per block id).
ORDER_BLOCK_LENS = (16384, 4096, 12288, 8192)
#: Blocks per region of that layout: 6.25 MiB per endpoint, 640 descriptors for every block.
ORDER_NUM_BLOCKS = 160
#: Rounds of progress of the peer alone while the poster is held still after posting.
_HOLD_ROUNDS = 50


def _random_blocks(rng: random.Random, count: int) -> list[int]:
    return rng.sample(range(NUM_BLOCKS), count)


def _random_regions(rng: random.Random) -> list[int] | None:
    if rng.random() < 0.3:
        return None
    return sorted(rng.sample(range(len(BLOCK_LENS)), rng.randint(1, len(BLOCK_LENS))))


class TransportConformance:
    """Subclass this in a test module to run the kit (see the module docstring).

    Tests use the fixtures ``kvframe_pair`` (a fresh :class:`Pair`, shut down afterwards),
    ``kvframe_pair_factory`` (more pairs) and ``kvframe_transport_spec``, all provided by
    :mod:`kvframe.testing.pytest_plugin` from the plugin author's ``kvframe_transport_name``
    and ``kvframe_transport_options`` fixtures. A test that does not apply to the transport
    (for example a dead peer process, for a transport that is not cross-process) is *skipped*
    with the reason, never passed silently.
    """

    # -- identity, registration, metadata ---------------------------------------------------
    def test_capability_card_is_consistent(self, kvframe_pair: Pair) -> None:
        """The transport's ``capabilities`` is a TransportCapabilities with values of the
        declared types and HOST memory; the notification limit is 0 exactly when notifications
        are off; both endpoints (built with the same options, one of them in a child for a
        cross-process card) report the same card, and using the transport does not change it.
        """
        p = kvframe_pair
        caps = p.caps
        assert isinstance(caps, TransportCapabilities), (
            f"Transport.capabilities must be a kvframe.spi.transport.TransportCapabilities, "
            f"not {type(caps).__name__}"
        )
        assert isinstance(caps.memory_kinds, frozenset)
        assert all(isinstance(k, MemoryKind) for k in caps.memory_kinds), caps.memory_kinds
        assert MemoryKind.HOST in caps.memory_kinds, "the kit needs HOST memory support"
        flags = ("read", "write", "notifications", "cross_process", "ordered_notifications",
                 "notification_after_data", "access_control", "warm_up")  # fmt: skip
        for flag in flags:
            value = getattr(caps, flag)
            assert isinstance(value, bool), f"capabilities.{flag} = {value!r}, not a bool"
        limit = caps.max_notification_bytes
        assert type(limit) is int, f"capabilities.max_notification_bytes = {limit!r}"
        assert caps.read or caps.write, "a transport that can neither READ nor WRITE"
        if caps.notifications:
            assert limit > 0, "notifications on, but max_notification_bytes is 0"
        else:
            assert limit == 0, "notifications off, but max_notification_bytes is not 0"
        assert p.a.transport.name == p.a.name
        assert p.b.capabilities == caps, "two endpoints built alike report different cards"
        assert p.cross_process is caps.cross_process
        op = Op.READ if caps.read else Op.WRITE
        self._check_transfer(p, op, [0], [1], None)
        assert p.a.transport.capabilities == caps, "the card changed while the transport ran"

    def test_metadata_names_the_peer_and_add_peer_again_rebuilds(self, kvframe_pair: Pair) -> None:
        """add_peer returns the peer's endpoint name; adding a known peer again is a rebuild: a
        transfer in flight stops (FAILED with PeerUnreachableError, unless it was already DONE)
        and the remote layout prepared for the same incarnation keeps working.
        """
        p = kvframe_pair
        meta = p.b.metadata()
        assert isinstance(meta, bytes)
        assert meta
        assert p.peer_b == p.b.name
        assert p.peer_a == p.a.name
        op = Op.READ if p.caps.read else Op.WRITE
        inflight = p.a.post(op, p.a_local, [0, 1], p.a_remote, [2, 3])
        assert p.a.add_peer(meta) == p.peer_b  # the same metadata again: a rebuild
        state = p.wait(p.a, inflight)
        status = p.a.poll(inflight)
        if state is XferState.FAILED:
            assert isinstance(status.error, PeerUnreachableError), status.error
        p.a.release(inflight)
        self._check_transfer(p, op, [0, 1], [2, 3], None)  # the old layout handle still works
        self._check_transfer(p, op, [4], [5], [1])

    def test_garbage_metadata_is_rejected_and_transport_stays_usable(
        self, kvframe_pair: Pair
    ) -> None:
        """Undecodable metadata raises PeerUnreachableError and leaves the transport usable."""
        p = kvframe_pair
        with pytest.raises(PeerUnreachableError):
            p.a.add_peer(b"\x00 this is not metadata \xff")
        self._check_transfer(p, Op.READ if p.caps.read else Op.WRITE, [4], [5], None)

    # -- transfers --------------------------------------------------------------------------
    def _check_transfer(
        self,
        p: Pair,
        op: Op,
        local_blocks: list[int],
        remote_blocks: list[int],
        regions: list[int] | None,
        *,
        notification: bytes | None = None,
    ) -> None:
        before_a, before_b = p.read_a(), p.read_b()
        xid = p.a.post(
            op,
            p.a_local,
            local_blocks,
            p.a_remote,
            remote_blocks,
            regions=regions,
            notification=notification,
        )
        state = p.wait(p.a, xid)
        status = p.a.poll(xid)
        assert state is XferState.DONE, f"transfer ended {state}: {status.error!r}"
        assert status.state is XferState.DONE, "a DONE transfer must stay DONE"
        p.a.release(xid)
        after_a, after_b = p.read_a(), p.read_b()
        if op is Op.READ:
            want_a = expected_after(before_a, before_b, p.a_layout, local_blocks, remote_blocks,
                                    regions)  # fmt: skip
            np.testing.assert_array_equal(after_a, want_a, err_msg="READ destination bytes")
            np.testing.assert_array_equal(after_b, before_b, err_msg="READ changed its source")
        else:
            want_b = expected_after(before_b, before_a, p.a_layout, remote_blocks, local_blocks,
                                    regions)  # fmt: skip
            np.testing.assert_array_equal(after_b, want_b, err_msg="WRITE destination bytes")
            np.testing.assert_array_equal(after_a, before_a, err_msg="WRITE changed its source")

    @pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
    @pytest.mark.parametrize("seed", range(3))
    def test_transfer_moves_exactly_the_selected_blocks(
        self, kvframe_pair: Pair, op: Op, seed: int
    ) -> None:
        """READ/WRITE of random blocks and region subsets: exactly the selected destination blocks
        change, to the paired source bytes; the source is untouched.
        """
        p = kvframe_pair
        self._require_op(p, op)
        rng = random.Random(seed)
        for _ in range(3):
            n = rng.randint(1, NUM_BLOCKS)
            self._check_transfer(
                p, op, _random_blocks(rng, n), _random_blocks(rng, n), _random_regions(rng)
            )

    def test_empty_transfer_completes(self, kvframe_pair: Pair) -> None:
        """A transfer of zero blocks completes DONE."""
        p = kvframe_pair
        op = Op.READ if p.caps.read else Op.WRITE
        self._check_transfer(p, op, [], [], None)

    def test_peer_can_post_back(self, kvframe_pair: Pair) -> None:
        """The other endpoint can post too (both directions work)."""
        p = kvframe_pair
        op = Op.READ if p.caps.read else Op.WRITE
        before_a, before_b = p.read_a(), p.read_b()
        xid = p.b.post(op, p.b_local, [7, 8], p.b_remote, [9, 1], regions=[2, 0])
        assert p.wait(p.b, xid) is XferState.DONE
        p.b.release(xid)
        if op is Op.READ:
            want = expected_after(before_b, before_a, p.a_layout, [7, 8], [9, 1], [2, 0])
            np.testing.assert_array_equal(p.read_b(), want)
        else:
            want = expected_after(before_a, before_b, p.a_layout, [9, 1], [7, 8], [2, 0])
            np.testing.assert_array_equal(p.read_a(), want)

    def test_xfer_handle_fields_describe_the_post(self, kvframe_pair: Pair) -> None:
        """The frozen :class:`XferHandle` ``post`` returns says what was posted: ``op``;
        ``peer`` (the name ``add_peer`` returned); ``nbytes``, the sum over the selected
        regions of block length times block count; ``num_descriptors``, selected regions times
        blocks. Zero blocks: 0 and 0. Two posts of the same blocks are two handles (they
        compare by identity), and a DONE status counts the handle's ``nbytes``.
        """
        p = kvframe_pair
        cases: list[tuple[list[int], list[int], list[int] | None]] = [
            ([0, 5, 9], [2, 3, 15], None),
            ([4, 1], [7, 8], [2, 0]),
            ([], [], [1]),
        ]
        for op in (Op.READ, Op.WRITE):
            if not self._supported(p, op):
                continue
            for local_blocks, remote_blocks, regions in cases:
                sel = range(len(BLOCK_LENS)) if regions is None else regions
                xid = p.a.post(op, p.a_local, local_blocks, p.a_remote, remote_blocks,
                               regions=regions)  # fmt: skip
                handle = p.a.handle(xid)
                what = f"{op.name} of blocks {local_blocks} in regions {regions}"
                assert isinstance(handle, XferHandle), what
                assert handle.op is op, what
                assert handle.peer == p.peer_b, what
                want = len(local_blocks) * sum(BLOCK_LENS[r] for r in sel)
                assert handle.nbytes == want, f"{what}: nbytes {handle.nbytes}, want {want}"
                ndesc = len(local_blocks) * len(sel)
                assert handle.num_descriptors == ndesc, (
                    f"{what}: num_descriptors {handle.num_descriptors}, want {ndesc}"
                )
                assert p.wait(p.a, xid) is XferState.DONE, what
                assert p.a.poll(xid).nbytes == want, what
                p.a.release(xid)
            one = p.a.post(op, p.a_local, [3], p.a_remote, [3])
            two = p.a.post(op, p.a_local, [3], p.a_remote, [3])
            first, second = p.a.handle(one), p.a.handle(two)
            assert first is not second
            assert first != second, "two posts must be two handles (compared by identity)"
            assert len({first, second}) == 2
            for xid in (one, two):
                assert p.wait(p.a, xid) is XferState.DONE
                p.a.release(xid)

    def test_poll_states_and_release_twice(self, kvframe_pair: Pair) -> None:
        """PENDING then DONE, DONE stays DONE with an equal frozen status (bytes landed, no
        error), the handle is frozen with the right fields, release twice, poll after release
        raises TransportClosedError.
        """
        p = kvframe_pair
        op = Op.READ if p.caps.read else Op.WRITE
        xid = p.a.post(op, p.a_local, [0], p.a_remote, [1])
        handle = p.a.handle(xid)
        assert isinstance(handle, XferHandle)
        assert handle.op is op
        assert handle.peer == p.peer_b
        assert handle.nbytes == sum(BLOCK_LENS)
        assert handle.num_descriptors == len(BLOCK_LENS)
        with pytest.raises(attrs.exceptions.FrozenInstanceError):
            handle.nbytes = 0  # type: ignore[misc]
        first = p.a.transport.poll(handle)
        assert isinstance(first, XferStatus), f"poll must answer an XferStatus, not {first!r}"
        assert first.state in (XferState.PENDING, XferState.DONE)
        assert p.wait(p.a, xid) is XferState.DONE
        done = p.a.transport.poll(handle)
        assert done.state is XferState.DONE
        assert done.error is None
        assert done.nbytes == handle.nbytes, "a DONE status counts the handle's bytes"
        assert done.transfer_seconds is None or done.transfer_seconds >= 0
        assert p.a.transport.poll(handle) == done, "a stopped status must not change"
        p.a.release(xid)
        p.a.release(xid)  # a no-op
        with pytest.raises(TransportClosedError):
            p.a.poll(xid)

    def test_release_while_pending_stops_the_transfer(
        self, kvframe_pair_factory: PairFactory
    ) -> None:
        """Releasing a just-posted READ, then WRITE (6.25 MiB, 640 descriptors, shuffled): when
        ``release`` returns no byte of it lands any more, checked by bytes — the destination is
        overwritten at once with the complement of what the transfer would write, and after
        more progress on both sides every byte still holds it. ``poll`` then raises
        TransportClosedError, and the same blocks can be transferred again at once.
        """
        p = kvframe_pair_factory(block_lens=ORDER_BLOCK_LENS, num_blocks=ORDER_NUM_BLOCKS)
        for op in (Op.READ, Op.WRITE):
            if self._supported(p, op):
                self._release_round(p, op)

    def _release_round(self, p: Pair, op: Op) -> None:
        n = ORDER_NUM_BLOCKS
        src_blocks = random.Random(7).sample(range(n), n)
        dst_blocks = list(range(n))
        dst_ep, dst_buf = (p.a, p.a_buffer) if op is Op.READ else (p.b, p.b_buffer)
        before_a, before_b = p.read_a(), p.read_b()
        src, dst = (before_b, before_a) if op is Op.READ else (before_a, before_b)
        landed = expected_after(dst, src, p.a_layout, dst_blocks, src_blocks, None)
        local, remote = (dst_blocks, src_blocks) if op is Op.READ else (src_blocks, dst_blocks)
        xid = p.a.post(op, p.a_local, local, p.a_remote, remote)
        p.a.release(xid)
        fence = np.bitwise_not(landed)  # differs from every byte the transfer would write
        dst_ep.write(dst_buf.addr, fence.tobytes())
        with pytest.raises(TransportClosedError):
            p.a.poll(xid)
        p.settle(100)
        after = np.frombuffer(dst_ep.read(dst_buf.addr, dst_buf.length), np.uint8)
        late = np.flatnonzero(after != fence)
        assert late.size == 0, (
            f"{late.size} bytes of a released {op.name} landed after release() returned "
            f"(the first at offset {int(late[0])} of the destination buffer)"
        )
        # the transport stays usable, and the released transfer's blocks may be reused at once
        self._check_transfer(p, op, dst_blocks[:8], src_blocks[:8], None)

    @pytest.mark.parametrize(
        ("local_blocks", "remote_blocks", "regions", "why"),
        [
            ([NUM_BLOCKS], [0], None, "local block out of range"),
            ([0], [NUM_BLOCKS], None, "remote block out of range"),
            ([-1], [0], None, "negative block"),
            ([0, 1], [0], None, "lists of different length"),
            ([0], [0], [len(BLOCK_LENS)], "region out of range"),
            ([0], [0], [-1], "negative region"),
        ],
    )
    def test_invalid_indices_raise_valueerror_and_move_nothing(
        self,
        kvframe_pair: Pair,
        local_blocks: list[int],
        remote_blocks: list[int],
        regions: list[int] | None,
        why: str,
    ) -> None:
        """Bad block or region indices and mismatched lists raise ValueError; no byte changes on
        either side.
        """
        p = kvframe_pair
        before_a, before_b = p.read_a(), p.read_b()
        for op in (Op.READ, Op.WRITE):
            if not self._supported(p, op):
                continue
            with pytest.raises(ValueError):  # noqa: PT011 - the kit pins the class, not the text
                p.a.post(op, p.a_local, local_blocks, p.a_remote, remote_blocks, regions=regions)
        p.settle()
        np.testing.assert_array_equal(p.read_a(), before_a, err_msg=why)
        np.testing.assert_array_equal(p.read_b(), before_b, err_msg=why)

    def test_unsupported_operations_raise_capabilityerror(self, kvframe_pair: Pair) -> None:
        """Whatever the card leaves out (an op, notifications, DEVICE memory) raises
        CapabilityError.
        """
        p = kvframe_pair
        checked = 0
        for op in (Op.READ, Op.WRITE):
            if not self._supported(p, op):
                with pytest.raises(CapabilityError):
                    p.a.post(op, p.a_local, [0], p.a_remote, [0])
                checked += 1
        if not p.caps.notifications:
            with pytest.raises(CapabilityError):
                p.a.notify(p.peer_b, b"x")
            checked += 1
        if MemoryKind.DEVICE not in p.caps.memory_kinds:
            spare = p.a.alloc(4096)
            with pytest.raises(CapabilityError):
                p.a.register([MemoryRegion(addr=spare.addr, length=4096, kind=MemoryKind.DEVICE)])
            checked += 1
        if checked == 0:
            pytest.skip("the transport supports every capability the kit can switch off")

    def test_access_check_refuses_before_a_byte_moves(self, kvframe_pair: Pair) -> None:
        """With ``capabilities.access_control``: while ``b`` has an access check that refuses,
        ``a``'s READ from and WRITE into ``b`` fail with TransferFailedError naming the reason,
        and not a byte changes on either side; with the check removed they work again.
        Without it: ``set_access_check`` raises CapabilityError.
        """
        p = kvframe_pair
        if not p.caps.access_control:
            with pytest.raises(CapabilityError):
                p.b.deny_access("no")
            return
        p.b.deny_access("the kit refuses every access")
        try:
            for op in (Op.READ, Op.WRITE):
                if not self._supported(p, op):
                    continue
                before_a, before_b = p.read_a().copy(), p.read_b().copy()
                xid = p.a.post(op, p.a_local, [0, 3, 7], p.a_remote, [1, 2, 9])
                assert p.wait(p.a, xid) is XferState.FAILED, f"{op.name} was served"
                error = p.a.poll(xid).error
                assert isinstance(error, TransferFailedError), repr(error)
                assert "the kit refuses every access" in str(error), str(error)
                p.a.release(xid)
                p.pump()
                assert np.array_equal(p.read_a(), before_a), f"{op.name}: bytes landed in a"
                assert np.array_equal(p.read_b(), before_b), f"{op.name}: bytes landed in b"
        finally:
            p.b.deny_access("")
        for op in (Op.READ, Op.WRITE):
            if self._supported(p, op):
                self._check_transfer(p, op, [0, 3], [1, 2], None)

    # -- notifications ----------------------------------------------------------------------
    def _require_notifications(self, p: Pair) -> None:
        if not p.caps.notifications:
            pytest.skip("the transport does not support notifications")

    def test_notifications_arrive_in_order_both_ways(self, kvframe_pair: Pair) -> None:
        """Notifications arrive with the right sender, in order when the card promises it, both
        ways.
        """
        p = kvframe_pair
        self._require_notifications(p)
        sent = [f"n{i}".encode() for i in range(20)]
        for payload in sent:
            p.a.notify(p.peer_b, payload)
        got = p.wait_notifications(p.b, len(sent))
        assert all(n.sender == p.peer_a for n in got)
        if p.caps.ordered_notifications:
            assert [n.payload for n in got] == sent
        else:
            assert sorted(n.payload for n in got) == sorted(sent)
        p.b.notify(p.peer_a, b"back")
        assert p.wait_notifications(p.a, 1) == [Notification(sender=p.peer_b, payload=b"back")]

    def test_notification_size_limit(self, kvframe_pair: Pair) -> None:
        """A payload of exactly the limit arrives; one byte more raises CapabilityError (also in
        post).
        """
        p = kvframe_pair
        self._require_notifications(p)
        limit = p.caps.max_notification_bytes
        with pytest.raises(CapabilityError):
            p.a.notify(p.peer_b, b"x" * (limit + 1))
        op = Op.READ if p.caps.read else Op.WRITE
        with pytest.raises(CapabilityError):
            p.a.post(op, p.a_local, [0], p.a_remote, [0], notification=b"y" * (limit + 1))
        big = bytes(range(256)) * (limit // 256) + b"z" * (limit % 256)
        p.a.notify(p.peer_b, big)
        got = p.wait_notifications(p.b, 1)
        assert [n.payload for n in got] == [big], "a payload of exactly the limit must arrive"

    @pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
    def test_post_with_notification(self, kvframe_pair: Pair, op: Op) -> None:
        """A post's notification arrives at the peer after the transfer's bytes."""
        p = kvframe_pair
        self._require_op(p, op)
        self._require_notifications(p)
        self._check_transfer(p, op, [1, 2], [3, 4], [0, 2], notification=b"blocks-ready")
        got = p.wait_notifications(p.b, 1)
        assert got == [Notification(sender=p.peer_a, payload=b"blocks-ready")]

    @pytest.mark.parametrize("op", [Op.READ, Op.WRITE])
    def test_post_notification_arrives_only_after_every_byte(
        self, kvframe_pair_factory: PairFactory, op: Op
    ) -> None:
        """When the card says ``notification_after_data``: at the moment the peer drains a
        post's notification, every byte of that transfer is in the destination. Three rounds
        on a 6.25 MiB layout: one transfer of every block (640 descriptors) with the poster
        held still after posting; eight concurrent transfers mixed with standalone
        notifications; the same, held. The peer digests a WRITE's destination when it drains
        the notification, and inverts a READ's source blocks then (a byte read later lands
        inverted); in one process it also digests the READ's destination. Not applicable
        (skipped, never passed) for a card that says ``notification_after_data=False``.
        """
        p = kvframe_pair_factory(block_lens=ORDER_BLOCK_LENS, num_blocks=ORDER_NUM_BLOCKS)
        self._require_op(p, op)
        self._require_notifications(p)
        if not p.caps.notification_after_data:
            pytest.skip(
                "not applicable: the card says notification_after_data=False (a post's "
                "notification may reach the peer before its bytes), so there is no ordering "
                "to check; callers send their own notice after DONE"
            )
        rng = random.Random(f"order-{op.value}")
        for round_no, (groups, hold) in enumerate([(1, True), (8, False), (8, True)]):
            self._ordering_round(p, op, rng, round_no, groups=groups, hold=hold)

    def _ordering_round(
        self, p: Pair, op: Op, rng: random.Random, round_no: int, *, groups: int, hold: bool
    ) -> None:
        n = ORDER_NUM_BLOCKS
        per = n // groups
        src_all = rng.sample(range(n), n)  # shuffled pairing: no two neighbours coalesce
        before_a, before_b = p.read_a(), p.read_b()
        if op is Op.READ:
            dst_layout, src_layout, dst, src = p.a_layout, p.b_layout, before_a, before_b
        else:
            dst_layout, src_layout, dst, src = p.b_layout, p.a_layout, before_b, before_a
        want = expected_after(dst, src, p.a_layout, list(range(n)), src_all, None)
        want_src = src.copy()  # a READ's source, as the peer's watches leave it
        # a READ's destination is visible to the peer only when both are in this process
        see_dst = op is Op.WRITE or isinstance(p.b, LocalEndpoint)
        base = dst_layout.regions[0].addr
        plan = []
        for g in range(groups):
            dst_blocks = list(range(g * per, (g + 1) * per))
            src_blocks = src_all[g * per : (g + 1) * per]
            payload = f"kit-order-{op.value}-{round_no}-{g}".encode()
            ranges = _block_ranges(dst_layout, dst_blocks, contiguous=True)
            invert = [] if op is Op.WRITE else _block_ranges(src_layout, src_blocks)
            p.b.watch(payload, digest=ranges if see_dst else (), invert=invert)
            digests = [_digest(want[r.addr - base : r.addr - base + r.length]) for r in ranges]
            for r in invert:
                off = r.addr - src_layout.regions[0].addr
                want_src[off : off + r.length] = np.bitwise_not(want_src[off : off + r.length])
            plan.append((payload, dst_blocks, src_blocks, digests if see_dst else []))
        xids, fillers = [], 0
        for payload, dst_blocks, src_blocks, _ in plan:
            local, remote = (dst_blocks, src_blocks) if op is Op.READ else (src_blocks, dst_blocks)
            xids.append(p.a.post(op, p.a_local, local, p.a_remote, remote, notification=payload))
            if groups > 1:
                p.a.notify(p.peer_b, f"kit-filler-{round_no}-{fillers}".encode())
                fillers += 1
        if hold:  # the poster does nothing for a while; the peer drains
            for _ in range(_HOLD_ROUNDS):
                p.b.pump()
                p.sleep(POLL_INTERVAL)
        for xid in xids:
            state = p.wait(p.a, xid)
            assert state is XferState.DONE, f"{op.name} ended {state}: {p.a.poll(xid).error!r}"
            p.a.release(xid)
        got = p.wait_notifications(p.b, groups + fillers)
        payloads = sorted(note.payload for note in got)
        assert payloads == sorted([x[0] for x in plan] + [
            f"kit-filler-{round_no}-{i}".encode() for i in range(fillers)
        ]), "the notifications that arrived are not the ones sent"  # fmt: skip
        seen = p.b.sightings()
        nbytes = per * sum(ORDER_BLOCK_LENS)
        for g, (payload, _, _, digests) in enumerate(plan):
            assert payload in seen, f"the peer never drained {payload!r}"
            for i, (got_digest, want_digest) in enumerate(zip(seen[payload], digests,
                                                              strict=True)):  # fmt: skip
                assert got_digest == want_digest, (
                    f"{op.name} round {round_no}, transfer {g} of {groups} ({nbytes} bytes, "
                    f"{per * len(ORDER_BLOCK_LENS)} descriptors): its notification reached the "
                    f"peer before every byte landed (region {i} of the destination was not "
                    "complete when the peer drained it), yet the card says "
                    "notification_after_data"
                )
        after_dst = p.read_a() if op is Op.READ else p.read_b()
        late = np.flatnonzero(after_dst != want)
        assert late.size == 0, (
            f"{op.name} round {round_no}: {late.size} destination bytes differ after DONE"
            + (
                " (read after the peer had drained the notification and inverted the source: "
                "the notification came before the bytes, yet the card says "
                "notification_after_data)"
                if op is Op.READ
                else ""
            )
        )
        if op is Op.READ:  # the peer's watches really fired: its source blocks are inverted
            np.testing.assert_array_equal(
                p.read_b(), want_src, err_msg="the peer's watches did not invert the source"
            )

    # -- peers ------------------------------------------------------------------------------
    def test_remove_peer_stops_transfers_and_readd_works(self, kvframe_pair: Pair) -> None:
        """remove_peer stops pending transfers; the peer is then unreachable until re-added."""
        p = kvframe_pair
        op = Op.READ if p.caps.read else Op.WRITE
        before_a, before_b = p.read_a(), p.read_b()
        xid = p.a.post(op, p.a_local, [0, 1], p.a_remote, [2, 3])
        p.a.remove_peer(p.peer_b)
        p.a.remove_peer("no-such-peer")  # unknown names are ignored
        state = p.wait(p.a, xid)
        status = p.a.poll(xid)
        if state is XferState.FAILED:
            assert isinstance(status.error, TransportError)
        else:
            # it completed before the removal: then every byte must be right
            if op is Op.READ:
                want = expected_after(before_a, before_b, p.a_layout, [0, 1], [2, 3], None)
                np.testing.assert_array_equal(p.read_a(), want)
            else:
                want = expected_after(before_b, before_a, p.a_layout, [2, 3], [0, 1], None)
                np.testing.assert_array_equal(p.read_b(), want)
        p.a.release(xid)
        with pytest.raises(PeerUnreachableError):
            p.a.post(op, p.a_local, [0], p.a_remote, [0])
        if p.caps.notifications:
            with pytest.raises(PeerUnreachableError):
                p.a.notify(p.peer_b, b"gone")
        with pytest.raises(PeerUnreachableError):
            p.a.prepare_remote(p.peer_b, p.b_layout)
        assert p.a.add_peer(p.b.metadata()) == p.peer_b
        p.a_remote = p.a.prepare_remote(p.peer_b, p.b_layout)
        self._check_transfer(p, op, [5], [6], None)

    def test_dead_peer_process_fails_transfers_within_bound(self, kvframe_pair: Pair) -> None:
        """Cross-process only: after the peer process is killed, transfers with it stop and fail
        with PeerUnreachableError within the timeout.
        """
        p = kvframe_pair
        if not isinstance(p.b, ChildEndpoint):
            pytest.skip("the transport is not cross-process; there is no peer process to kill")
        op = Op.READ if p.caps.read else Op.WRITE
        inflight = p.a.post(op, p.a_local, list(range(NUM_BLOCKS)), p.a_remote, list(range(16)))
        p.b.kill()
        bound = p.timeout
        start = p.clock()
        state = p.wait(p.a, inflight, timeout=bound)
        assert state in (XferState.DONE, XferState.FAILED)  # it may have finished before
        p.a.release(inflight)
        # anything started after the death must fail, by raising or by polling FAILED
        try:
            late = p.a.post(op, p.a_local, [0], p.a_remote, [0])
        except PeerUnreachableError:
            pass
        else:
            state = p.wait(p.a, late, timeout=bound)
            status = p.a.poll(late)
            assert state is XferState.FAILED, "a transfer with a dead peer reported DONE"
            assert isinstance(status.error, PeerUnreachableError), status.error
            p.a.release(late)
        assert p.clock() - start < 2 * bound

    # -- lifetime ---------------------------------------------------------------------------
    def test_close_twice_and_use_after_close(self, kvframe_pair: Pair) -> None:
        """close() twice is a no-op; every other method raises TransportClosedError afterwards."""
        p = kvframe_pair
        t = p.a.transport
        op = Op.READ if p.caps.read else Op.WRITE
        xid = p.a.post(op, p.a_local, [0], p.a_remote, [0])
        local, remote = p.a.layout(p.a_local), p.a.layout(p.a_remote)
        handle = p.a.handle(xid)
        p.a.close()
        t.close()  # a no-op
        calls: list[tuple[str, Callable[[], object]]] = [
            ("register_memory", lambda: t.register_memory([p.a_buffer])),
            ("local_metadata", t.local_metadata),
            ("add_peer", lambda: t.add_peer(b"x")),
            ("remove_peer", lambda: t.remove_peer(p.peer_b)),
            ("prepare_local", lambda: t.prepare_local(p.a_layout)),
            ("prepare_remote", lambda: t.prepare_remote(p.peer_b, p.b_layout)),
            ("post", lambda: self._post_raw(t, op, local, remote)),
            ("poll", lambda: t.poll(handle)),
            ("send_notification", lambda: t.send_notification(p.peer_b, b"x")),
            ("drain_notifications", t.drain_notifications),
        ]
        for what, call in calls:
            try:
                call()
            except TransportClosedError:
                continue
            pytest.fail(f"{what} after close() did not raise TransportClosedError")

    @staticmethod
    def _post_raw(t: Any, op: Op, local: LayoutHandle, remote: LayoutHandle) -> object:
        return t.post(op, local, [0], remote, [0])

    def test_state_machine(self, kvframe_pair_factory: PairFactory) -> None:
        """The Hypothesis state machine (kvframe.testing.stateful) on fresh pairs."""
        run_transport_state_machine(kvframe_pair_factory)

    # -- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _supported(p: Pair, op: Op) -> bool:
        return p.caps.read if op is Op.READ else p.caps.write

    def _require_op(self, p: Pair, op: Op) -> None:
        if not self._supported(p, op):
            pytest.skip(f"the transport does not support {op.name}")


def _block_ranges(
    layout: BlockLayout, blocks: Sequence[int], *, contiguous: bool = False
) -> list[MemoryRegion]:
    """The byte ranges of ``blocks`` in every region of ``layout``: one range per region for
    consecutive blocks (``contiguous``), else one per block and region."""
    out = []
    for region, blen in zip(layout.regions, layout.block_lens, strict=True):
        if contiguous:
            out.append(MemoryRegion(addr=region.addr + blocks[0] * blen, length=len(blocks) * blen))
        else:
            out.extend(MemoryRegion(addr=region.addr + b * blen, length=blen) for b in blocks)
    return out


def _digest(data: np.ndarray[Any, Any]) -> str:
    return hashlib.sha256(data.tobytes()).hexdigest()
