"""The in-process transport beyond the kit: fabric isolation, options, async completion, faults."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest

from kvframe.errors import (
    CapabilityError,
    ConfigError,
    PeerUnreachableError,
    TransferFailedError,
    TransportClosedError,
)
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.transport import (
    BlockLayout,
    LayoutHandle,
    MemoryKind,
    MemoryRegion,
    Op,
    TransportParams,
    XferHandle,
    XferState,
    XferStatus,
)
from kvframe.testing.faults import FaultEvent, Faults
from kvframe.transports.inprocess import (
    FabricHooks,
    InProcessFabric,
    InProcessTransport,
    NotificationVerdict,
    TransferVerdict,
    capabilities,
    default_fabric,
)

NB, BL = 8, 128


class Side:
    """One endpoint with a registered two-region buffer."""

    def __init__(self, t: InProcessTransport, seed: int) -> None:
        self.t = t
        self.buf = np.random.default_rng(seed).integers(0, 256, 2 * NB * BL, dtype=np.uint8)
        base = self.buf.ctypes.data
        t.register_memory([MemoryRegion(addr=base, length=self.buf.nbytes)])
        self.layout = BlockLayout(
            regions=[
                MemoryRegion(addr=base, length=NB * BL),
                MemoryRegion(addr=base + NB * BL, length=NB * BL),
            ],
            block_lens=[BL, BL],
            num_blocks=NB,
        )
        self.local = t.prepare_local(self.layout)

    def block(self, region: int, b: int) -> bytes:
        start = region * NB * BL + b * BL
        return self.buf[start : start + BL].tobytes()


class Link:
    def __init__(self, fabric: InProcessFabric, **options: Any) -> None:
        self.fabric = fabric
        self.d = Side(fabric.transport("D", **options), 1)
        self.p = Side(fabric.transport("P", **options), 2)
        self.d.t.add_peer(self.p.t.local_metadata())
        self.p.t.add_peer(self.d.t.local_metadata())
        self.remote: LayoutHandle = self.d.t.prepare_remote("P", self.p.layout)

    def read(self, local: list[int], remote: list[int], **kw: Any) -> XferHandle:
        return self.d.t.post(Op.READ, self.d.local, local, self.remote, remote, **kw)

    def run(self, h: XferHandle, polls: int = 50) -> XferState:
        return self.status(h, polls).state

    def status(self, h: XferHandle, polls: int = 50) -> XferStatus:
        for _ in range(polls):
            status = self.d.t.poll(h)
            if status.stopped:
                break
        return status

    @property
    def faults(self) -> Faults:
        return Faults.of(self.fabric)

    def close(self) -> None:
        self.d.t.close()
        self.p.t.close()


@pytest.fixture
def fabric() -> InProcessFabric:
    return InProcessFabric()


@pytest.fixture
def link(fabric: InProcessFabric) -> Iterator[Link]:
    lk = Link(fabric)
    yield lk
    lk.close()


# -- fabric, options, registration ---------------------------------------------------------


def test_fabrics_are_isolated(fabric: InProcessFabric) -> None:
    other = InProcessFabric()
    a = fabric.transport("same")
    b = other.transport("same")  # the same name in another fabric is fine
    with pytest.raises(PeerUnreachableError, match="another InProcessFabric"):
        a.add_peer(b.local_metadata())
    with pytest.raises(ConfigError, match="already exists"):
        fabric.transport("same")
    a.close()
    assert fabric.endpoints == ()
    fabric.transport("same").close()  # the name is free again after close
    b.close()


def test_default_fabric_is_shared_and_left_on_close() -> None:
    t = InProcessTransport(TransportParams(name="default-fabric-test"))
    assert t.fabric is default_fabric()
    assert "default-fabric-test" in default_fabric().endpoints
    t.close()
    assert "default-fabric-test" not in default_fabric().endpoints


def test_registered_through_the_plugin_host_like_any_plugin(fabric: InProcessFabric) -> None:
    host = PluginHost(env={})
    host.load()
    info = host.transport_info("inprocess")
    assert info.capabilities == capabilities()
    assert info.capabilities.cross_process is False
    t = host.create_transport(
        "inprocess", TransportParams(name="via-host", options={"fabric": fabric})
    )
    assert isinstance(t, InProcessTransport)
    assert fabric.endpoints == ("via-host",)
    t.close()


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"colour": 1}, "colour"),
        ({"completion_polls": 0}, "completion_polls"),
        ({"completion_polls": True}, "completion_polls"),
        ({"completion_polls": 1.5}, "completion_polls"),
        ({"max_notification_bytes": 0}, "max_notification_bytes"),
        ({"read": "yes"}, "read"),
        ({"fabric": "nope"}, "fabric"),
    ],
)
def test_bad_options_raise_configerror_naming_the_key(
    fabric: InProcessFabric, options: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle):
        fabric.transport("x", **options)
    assert fabric.endpoints == ()


def test_create_refuses_a_foreign_fabric_option(fabric: InProcessFabric) -> None:
    with pytest.raises(ConfigError, match="another fabric"):
        fabric.create(TransportParams(name="x", options={"fabric": InProcessFabric()}))


def test_device_memory_without_cuda_is_a_capability_error(fabric: InProcessFabric) -> None:
    t = fabric.transport("x")
    if MemoryKind.DEVICE in t.capabilities.memory_kinds:
        pytest.skip("CUDA is available here; test_device_copies covers device memory")
    with pytest.raises(CapabilityError, match="device"):
        t.register_memory([MemoryRegion(addr=4096, length=64, kind=MemoryKind.DEVICE)])
    t.close()


def test_layout_outside_registered_memory_is_rejected(link: Link) -> None:
    outside = BlockLayout(
        regions=[MemoryRegion(addr=link.d.buf.ctypes.data + 64, length=NB * BL * 2)],
        block_lens=[2 * BL],
        num_blocks=NB,
    )
    with pytest.raises(ValueError, match="not inside memory registered"):
        link.d.t.prepare_local(outside)
    with pytest.raises(ValueError, match="peer 'P'"):
        link.d.t.prepare_remote("P", outside)


def test_handles_of_another_transport_are_rejected(link: Link) -> None:
    with pytest.raises(ValueError, match="unknown layout handle"):
        link.d.t.post(Op.READ, link.p.local, [0], link.remote, [0])
    with pytest.raises(ValueError, match="prepare_remote"):
        link.d.t.post(Op.READ, link.remote, [0], link.remote, [0])


def test_capabilities_can_be_switched_off(fabric: InProcessFabric) -> None:
    lk = Link(fabric, read=False, notifications=False)
    assert lk.d.t.capabilities.max_notification_bytes == 0
    with pytest.raises(CapabilityError, match="READ"):
        lk.read([0], [0])
    with pytest.raises(CapabilityError, match="notifications"):
        lk.d.t.send_notification("P", b"x")
    h = lk.d.t.post(Op.WRITE, lk.d.local, [0], lk.remote, [1])
    assert lk.run(h) is XferState.DONE
    lk.close()


# -- completion ------------------------------------------------------------------------------


def test_transfer_completes_on_a_later_poll_not_inside_post(fabric: InProcessFabric) -> None:
    lk = Link(fabric, completion_polls=3)
    before = lk.d.block(0, 0)
    h = lk.read([0], [5], regions=[0])
    assert lk.d.block(0, 0) == before
    assert lk.d.t.poll(h) == XferStatus.pending()
    lk.d.t.progress()  # any progress step counts
    assert lk.d.block(0, 0) == before
    assert lk.d.t.poll(h) == XferStatus.done(BL)
    assert lk.d.block(0, 0) == lk.p.block(0, 5)
    assert lk.d.block(1, 0) != lk.p.block(1, 5)  # region 1 was not selected
    stats = lk.d.t.stats()
    assert stats["bytes_read"] == BL
    assert stats["transfers_done"] == 1
    lk.close()


def test_contiguous_blocks_are_copied_correctly(link: Link) -> None:
    h = link.read(list(range(NB)), list(range(NB)))
    assert link.run(h) is XferState.DONE
    np.testing.assert_array_equal(link.d.buf, link.p.buf)


def test_peer_closing_fails_pending_transfers(link: Link) -> None:
    h = link.read([0], [0])
    link.p.t.close()
    status = link.status(h)
    assert status.state is XferState.FAILED
    assert isinstance(status.error, PeerUnreachableError)
    with pytest.raises(PeerUnreachableError):
        link.read([0], [0])


def test_restarted_peer_replaces_the_old_entry(link: Link, fabric: InProcessFabric) -> None:
    h = link.read([0], [0])
    link.p.t.close()
    restarted = Side(fabric.transport("P"), 3)
    assert link.d.t.add_peer(restarted.t.local_metadata()) == "P"
    assert link.run(h) is XferState.FAILED
    with pytest.raises(PeerUnreachableError, match="prepare_remote again"):
        link.read([0], [0])
    remote = link.d.t.prepare_remote("P", restarted.layout)
    h2 = link.d.t.post(Op.READ, link.d.local, [1], remote, [2], regions=[1])
    assert link.run(h2) is XferState.DONE
    assert link.d.block(1, 1) == restarted.block(1, 2)
    restarted.t.close()


def test_stale_metadata_of_a_closed_endpoint_is_unreachable(fabric: InProcessFabric) -> None:
    a, b = fabric.transport("a"), fabric.transport("b")
    meta = b.local_metadata()
    b.close()
    with pytest.raises(PeerUnreachableError, match="closed"):
        a.add_peer(meta)
    b2 = fabric.transport("b")
    with pytest.raises(PeerUnreachableError, match="closed"):
        a.add_peer(meta)  # an older incarnation of "b"
    assert a.add_peer(b2.local_metadata()) == "b"
    a.close()
    b2.close()


def test_close_fails_pending_handles_and_release_is_safe(link: Link) -> None:
    h = link.read([0], [0])
    link.d.t.close()
    with pytest.raises(TransportClosedError):
        link.d.t.poll(h)
    link.d.t.release(h)  # releasing after close is harmless
    link.d.t.close()


# -- notifications ---------------------------------------------------------------------------


def test_post_notification_is_sent_only_after_the_bytes_landed(link: Link) -> None:
    h = link.read([2], [3], notification=b"done")
    assert link.p.t.drain_notifications() == []
    assert link.run(h) is XferState.DONE
    got = link.p.t.drain_notifications()
    assert [(n.sender, n.payload) for n in got] == [("D", b"done")]


def test_notification_limit_is_configurable(fabric: InProcessFabric) -> None:
    lk = Link(fabric, max_notification_bytes=8)
    lk.d.t.send_notification("P", b"12345678")
    with pytest.raises(CapabilityError, match="limit of 8"):
        lk.d.t.send_notification("P", b"123456789")
    with pytest.raises(ValueError, match="payload is bytes"):
        lk.d.t.send_notification("P", "text")  # type: ignore[arg-type]
    lk.close()


# -- faults ----------------------------------------------------------------------------------


def _payloads(t: InProcessTransport) -> list[bytes]:
    return [n.payload for n in t.drain_notifications()]


def test_drop_the_nth_notification_to_a_peer(link: Link) -> None:
    rule = link.faults.drop_notifications(peer="P", nth=2)
    for i in range(4):
        link.d.t.send_notification("P", b"%d" % i)
    link.p.t.send_notification("D", b"other way")
    assert _payloads(link.p.t) == [b"0", b"2", b"3"]
    assert _payloads(link.d.t) == [b"other way"]
    assert (rule.matched, rule.fired) == (4, 1)


def test_drop_by_predicate_at_most_times(link: Link) -> None:
    seen: list[FaultEvent] = []

    def odd(event: FaultEvent) -> bool:
        seen.append(event)
        return event.payload is not None and event.payload[0] % 2 == 1

    link.faults.drop_notifications(when=odd, times=2)
    for i in range(8):
        link.d.t.send_notification("P", bytes([i]))
    assert _payloads(link.p.t) == [bytes([i]) for i in (0, 2, 4, 5, 6, 7)]
    assert seen[0] == FaultEvent(
        kind="notification", endpoint="D", peer="P", nbytes=1, payload=b"\x00"
    )


def test_delay_keeps_per_sender_order(link: Link) -> None:
    link.faults.delay_notifications(3, endpoint="D", nth=1)
    link.d.t.send_notification("P", b"first")
    link.d.t.send_notification("P", b"second")
    assert _payloads(link.p.t) == []
    assert _payloads(link.p.t) == []
    assert _payloads(link.p.t) == [b"first", b"second"]


def test_corrupt_notifications(link: Link) -> None:
    rule = link.faults.corrupt_notifications()
    link.d.t.send_notification("P", b"\x00\x0f")
    link.d.t.send_notification("P", b"")
    assert _payloads(link.p.t) == [b"\xff\xf0", b"\xff"]
    rule.cancel()
    rule.cancel()
    link.faults.corrupt_notifications(lambda p: p[::-1], endpoint="D")
    link.d.t.send_notification("P", b"abc")
    assert _payloads(link.p.t) == [b"cba"]


def test_fail_transfer_before_any_byte(link: Link) -> None:
    link.faults.fail_transfers(peer="P", op=Op.READ)
    before = link.d.buf.copy()
    h = link.read([0, 1], [2, 3], notification=b"never")
    status = link.status(h)
    assert status.state is XferState.FAILED
    assert isinstance(status.error, TransferFailedError)
    assert status.nbytes == 0
    np.testing.assert_array_equal(link.d.buf, before)
    assert link.p.t.drain_notifications() == []
    # the transport stays usable: WRITE is not selected by the rule
    w = link.d.t.post(Op.WRITE, link.d.local, [0], link.remote, [0])
    assert link.run(w) is XferState.DONE


def test_fail_transfer_after_partial_writes(link: Link) -> None:
    link.faults.fail_transfers(written=0.5, nth=2)
    ok = link.read([7], [7], regions=[0])
    assert link.run(ok) is XferState.DONE
    before = link.d.buf.copy()
    h = link.read([0, 2], [4, 6], regions=[0])  # two descriptors, not contiguous: one lands
    status = link.status(h)
    assert status.state is XferState.FAILED
    assert "after 1 of 2" in str(status.error)
    assert link.d.block(0, 0) == link.p.block(0, 4)
    start = 2 * BL
    np.testing.assert_array_equal(link.d.buf[start : start + BL], before[start : start + BL])


def test_delay_transfers(link: Link) -> None:
    link.faults.delay_transfers(5, peer="P")
    h = link.read([0], [1])
    for _ in range(5):
        assert link.d.t.poll(h).state is XferState.PENDING
    assert link.d.t.poll(h).state is XferState.DONE


def test_vanish_fails_everything_and_restore_allows_a_new_handshake(link: Link) -> None:
    faults = link.faults
    pending = link.read([0], [0])
    link.p.t.send_notification("D", b"in flight")
    faults.vanish("P")
    assert faults.is_vanished("P")
    status = link.status(pending)
    assert status.state is XferState.FAILED
    assert isinstance(status.error, PeerUnreachableError)
    with pytest.raises(PeerUnreachableError):
        link.read([0], [0])
    with pytest.raises(PeerUnreachableError):
        link.d.t.send_notification("P", b"x")
    with pytest.raises(PeerUnreachableError):
        link.p.t.send_notification("D", b"x")  # the link is cut both ways
    with pytest.raises(PeerUnreachableError, match="vanished"):
        link.d.t.add_peer(link.p.t.local_metadata())
    assert link.d.t.drain_notifications() == []  # sent before it vanished, never drained
    faults.restore("P")
    link.d.t.add_peer(link.p.t.local_metadata())  # a rebuild
    remote = link.d.t.prepare_remote("P", link.p.layout)
    h = link.d.t.post(Op.READ, link.d.local, [0], remote, [0])
    assert link.run(h) is XferState.DONE


def test_bad_fault_parameters(link: Link) -> None:
    faults = link.faults
    with pytest.raises(ValueError, match="nth=0"):
        faults.drop_notifications(nth=0)
    with pytest.raises(ValueError, match="times=0"):
        faults.fail_transfers(times=0)
    with pytest.raises(ValueError, match="written"):
        faults.fail_transfers(written=1.5)
    with pytest.raises(ValueError, match="polls"):
        faults.delay_notifications(0)
    assert faults.rules == ()
    faults.drop_notifications()
    faults.vanish("P")
    faults.clear()
    assert faults.rules == ()
    assert not faults.is_vanished("P")


@pytest.mark.skipif(
    MemoryKind.DEVICE not in capabilities().memory_kinds, reason="needs torch with CUDA"
)
def test_device_copies(fabric: InProcessFabric) -> None:  # pragma: no cover - GPU machines
    import torch

    a, b = fabric.transport("ga"), fabric.transport("gb")
    src = torch.arange(4 * 256, dtype=torch.uint8, device="cuda").reshape(4, 256)
    dst = torch.zeros(4 * 256, dtype=torch.uint8)  # host destination: device -> host
    ra, rb = MemoryRegion.from_tensor(dst), MemoryRegion.from_tensor(src)
    a.register_memory([ra])
    b.register_memory([rb])
    a.add_peer(b.local_metadata())
    la = a.prepare_local(BlockLayout(regions=[ra], block_lens=[256], num_blocks=4))
    lb = a.prepare_remote("gb", BlockLayout(regions=[rb], block_lens=[256], num_blocks=4))
    h = a.post(Op.READ, la, [0, 1], lb, [3, 2])
    while not (status := a.poll(h)).stopped:
        pass
    assert status.state is XferState.DONE
    assert torch.equal(dst.reshape(4, 256)[:2], src[[3, 2]].cpu())
    a.close()
    b.close()


def test_mismatched_requests_say_what_is_wrong(link: Link, fabric: InProcessFabric) -> None:
    with pytest.raises(ValueError, match="2 entries but remote_blocks has 1"):
        link.read([0, 1], [0])
    one_region = BlockLayout(regions=link.p.layout.regions[:1], block_lens=[BL], num_blocks=NB)
    remote = link.d.t.prepare_remote("P", one_region)
    with pytest.raises(ValueError, match="pass regions="):
        link.d.t.post(Op.READ, link.d.local, [0], remote, [0])
    h = link.d.t.post(Op.READ, link.d.local, [0], remote, [1], regions=[0])
    assert link.run(h) is XferState.DONE
    assert link.d.block(0, 0) == link.p.block(0, 1)
    narrow = BlockLayout(regions=link.p.layout.regions[:1], block_lens=[BL // 2], num_blocks=NB)
    narrow_remote = link.d.t.prepare_remote("P", narrow)
    with pytest.raises(ValueError, match="block lengths differ"):
        link.d.t.post(Op.READ, link.d.local, [0], narrow_remote, [0], regions=[0])


# -- peers: a re-add is a rebuild --------------------------------------------------------------


def test_adding_a_known_peer_again_rebuilds_it(link: Link) -> None:
    h = link.read([0], [0])
    assert link.d.t.add_peer(link.p.t.local_metadata()) == "P"  # the same metadata
    status = link.status(h)
    assert status.state is XferState.FAILED
    assert isinstance(status.error, PeerUnreachableError)
    assert "added again" in str(status.error)
    h2 = link.read([1], [2])  # the remote layout of the same incarnation still works
    assert link.run(h2) is XferState.DONE
    link.d.t.remove_peer("P")
    link.d.t.add_peer(link.p.t.local_metadata())
    with pytest.raises(PeerUnreachableError, match="prepare_remote again"):
        link.read([0], [0])  # prepared before the removal


# -- hooks -------------------------------------------------------------------------------------


class Recorder(FabricHooks):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str, int]] = []

    def transfer(self, *, endpoint: str, peer: str, op: Op, nbytes: int) -> TransferVerdict:
        self.seen.append(("transfer", endpoint, peer, nbytes))
        return TransferVerdict(delay=2)

    def notification(self, *, endpoint: str, peer: str, payload: bytes) -> NotificationVerdict:
        self.seen.append(("notification", endpoint, peer, len(payload)))
        return NotificationVerdict(payload=payload.upper())


def test_the_fabric_asks_its_hooks() -> None:
    hooks = Recorder()
    lk = Link(InProcessFabric(hooks=hooks))
    h = lk.read([0], [0], notification=b"done")
    assert lk.d.t.poll(h).state is XferState.PENDING  # due, but the hooks add two steps
    assert lk.d.t.poll(h).state is XferState.PENDING
    assert lk.d.t.poll(h) == XferStatus.done(2 * BL)
    assert _payloads(lk.p.t) == [b"DONE"]
    assert hooks.seen == [("transfer", "D", "P", 2 * BL), ("notification", "D", "P", 4)]
    with pytest.raises(ValueError, match="other hooks"):
        Faults.of(lk.fabric)
    lk.close()


def test_faults_install_once_and_rules_are_fixed(fabric: InProcessFabric) -> None:
    faults = Faults.of(fabric)
    assert Faults.of(fabric) is faults
    assert fabric.hooks is faults
    rule = faults.delay_transfers(3)
    with pytest.raises(attrs.exceptions.FrozenAttributeError):
        rule.polls = 5  # type: ignore[misc]
    assert (rule.matched, rule.fired, rule.active) == (0, 0, True)
    rule.cancel()
    assert not rule.active
    with pytest.raises(ValueError, match="fail_after"):
        TransferVerdict(fail_after=2.0)
