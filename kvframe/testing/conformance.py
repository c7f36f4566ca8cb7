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
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import pytest

from kvframe.errors import (
    CapabilityError,
    PeerUnreachableError,
    TransportClosedError,
    TransportError,
)
from kvframe.spi.transport import (
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
from kvframe.testing.endpoint import ChildEndpoint
from kvframe.testing.pair import BLOCK_LENS, NUM_BLOCKS, Pair, PairFactory, expected_after
from kvframe.testing.stateful import run_transport_state_machine

__all__ = ["TransportConformance"]


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
        """The card is a TransportCapabilities with HOST memory; the notification limit is 0
        exactly when notifications are off.
        """
        caps = kvframe_pair.caps
        assert isinstance(caps, TransportCapabilities)
        assert MemoryKind.HOST in caps.memory_kinds, "the kit needs HOST memory support"
        assert caps.read or caps.write, "a transport that can neither READ nor WRITE"
        if caps.notifications:
            assert caps.max_notification_bytes > 0
        else:
            assert caps.max_notification_bytes == 0
        assert kvframe_pair.a.transport.name == kvframe_pair.a.name

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

    def test_release_while_pending_stops_the_transfer(self, kvframe_pair: Pair) -> None:
        """Releasing a pending transfer works and leaves the transport usable."""
        p = kvframe_pair
        op = Op.READ if p.caps.read else Op.WRITE
        xid = p.a.post(op, p.a_local, list(range(NUM_BLOCKS)), p.a_remote, list(range(16)))
        p.a.release(xid)
        with pytest.raises(TransportClosedError):
            p.a.poll(xid)
        # the transport stays usable, and the released transfer's blocks may be reused at once
        self._check_transfer(p, op, [3, 4], [5, 6], None)

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
