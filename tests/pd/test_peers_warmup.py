"""RemoteEngines warms a new connection before it counts as ready (kvframe.connectors.pd.peers).

A fake transport stands in (it records calls and answers warm-ups as each test says), and the
handshake is replaced by a function that answers at once, so every case runs on a fake clock:
the warm-up's bound is ``warmup_timeout`` on the clock ``poll`` is given.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvframe.connectors.pd import peers
from kvframe.connectors.pd.handshake import HandshakeResponse, HandshakeResult
from kvframe.connectors.pd.peers import PeerState, RemoteEngines
from kvframe.errors import CapabilityError, PeerUnreachableError, TransferFailedError
from kvframe.spi.transport import (
    BlockLayout,
    LayoutHandle,
    MemoryRegion,
    Op,
    TransportCapabilities,
    XferHandle,
    XferStatus,
)

LAYOUT = BlockLayout(regions=[MemoryRegion(addr=4096, length=4096)], block_lens=[64], num_blocks=8)


def _caps(warm_up: bool) -> TransportCapabilities:
    return TransportCapabilities(
        memory_kinds=frozenset(),
        read=True,
        write=False,
        notifications=True,
        max_notification_bytes=1024,
        warm_up=warm_up,
    )


class FakeTransport:
    """What RemoteEngines calls, recorded; ``warm`` says how warm-ups go: ``"pending"`` (until
    a test sets ``status``), or an exception ``warm_up`` raises."""

    def __init__(self, *, warm_up: bool = True) -> None:
        self.capabilities = _caps(warm_up)
        self.name = "D"
        self.warm: str | Exception = "pending"
        self.status = XferStatus.pending()
        self.warmed: list[XferHandle] = []
        self.released: list[XferHandle] = []
        self.removed: list[str] = []
        self.peers: list[str] = []

    def add_peer(self, metadata: bytes) -> str:
        name = metadata.decode()
        self.peers.append(name)
        return name

    def prepare_remote(self, peer: str, layout: BlockLayout) -> LayoutHandle:
        return LayoutHandle(layout=layout, peer=peer)

    def remove_peer(self, peer: str) -> None:
        self.removed.append(peer)

    def warm_up(self, peer: str) -> XferHandle:
        if isinstance(self.warm, Exception):
            raise self.warm
        h = XferHandle(op=Op.READ, peer=peer, nbytes=64, num_descriptors=1)
        self.warmed.append(h)
        return h

    def poll(self, handle: XferHandle) -> XferStatus:
        assert handle in self.warmed
        assert handle not in self.released, "polled after release"
        return self.status

    def release(self, handle: XferHandle) -> None:
        self.released.append(handle)


@pytest.fixture(autouse=True)
def instant_handshake(monkeypatch: pytest.MonkeyPatch) -> None:
    """``handshake`` answers at once, naming the port as the peer's transport name."""

    def answer(host: str, port: int, request: Any, **kw: Any) -> HandshakeResult:
        resp = HandshakeResponse(
            engine_id=kw["expect_engine"],
            rank=0,
            tp_size=1,
            transport="fake",
            transport_metadata=f"P{port}".encode(),
            layout=LAYOUT,
            kv_lease_duration=6.0,
        )
        return HandshakeResult(response=resp, samples=())

    monkeypatch.setattr(peers, "handshake", answer)


_OPEN: list[RemoteEngines] = []


@pytest.fixture(autouse=True)
def close_engines() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


def _engines(t: FakeTransport, warmup_timeout: float = 0.5) -> RemoteEngines:
    engines = RemoteEngines(
        t,  # type: ignore[arg-type]
        engine_id="D",
        rank=0,
        transport_name="fake",
        chash=b"\0" * 16,
        timeout=1.0,
        idle_ttl=600.0,
        clock=lambda: 0.0,
        local_metadata=b"D",
        rng=random.Random(0),
        warmup_timeout=warmup_timeout,
    )
    _OPEN.append(engines)
    return engines


def _answered(engines: RemoteEngines, now: float) -> list[Any]:
    """Poll until the background thread's answer was applied (the fake answers at once)."""
    for _ in range(500):
        changed = engines.poll(now, lambda engine: False)
        entry = engines.get("P", 0)
        if changed or (entry is not None and entry.peer is not None):
            return changed
        time.sleep(0.01)
    raise AssertionError("the handshake was never answered")


def test_connection_is_ready_only_once_its_warm_up_is_done() -> None:
    t = FakeTransport()
    engines = _engines(t)
    entry = engines.ensure("P", 0, "h", 1, now=10.0)
    assert _answered(engines, 10.0) == []  # answered, but warming: nothing changed yet
    assert entry.state is PeerState.CONNECTING
    assert entry.peer == "P1"
    assert len(t.warmed) == 1
    assert engines.poll(10.1, lambda e: False) == []
    t.status = XferStatus.done(64)
    assert engines.poll(10.2, lambda e: False) == [entry]
    assert entry.state is PeerState.READY
    assert entry.warmup_outcome == "done"
    assert entry.warmup_seconds == pytest.approx(0.2)
    assert entry.ready_at == 10.2
    assert entry.started_at == 10.0
    assert t.released == t.warmed
    assert engines.take_counts() == {"warmups_done": 1}
    assert engines.take_counts() == {}
    assert engines.handshakes == 1


def test_a_warm_up_that_never_ends_is_stopped_at_the_bound() -> None:
    """The connection is ready at ``warmup_timeout`` after the warm-up started, never later,
    and the warm-up is released (stopped) then."""
    t = FakeTransport()
    engines = _engines(t, warmup_timeout=0.5)
    entry = engines.ensure("P", 0, "h", 1, now=0.0)
    _answered(engines, 1.0)
    assert engines.poll(1.49, lambda e: False) == []
    assert entry.state is PeerState.CONNECTING
    assert engines.poll(1.5, lambda e: False) == [entry]
    assert entry.state is PeerState.READY
    assert entry.warmup_outcome == "timed_out"
    assert t.released == t.warmed
    assert engines.take_counts() == {"warmups_timed_out": 1}


def test_a_warm_up_failing_with_an_unreachable_peer_fails_the_handshake() -> None:
    t = FakeTransport()
    engines = _engines(t)
    entry = engines.ensure("P", 0, "h", 1, now=0.0)
    _answered(engines, 0.0)
    t.status = XferStatus.failed(PeerUnreachableError("the peer disconnected"))
    assert engines.poll(0.1, lambda e: False) == [entry]
    assert entry.state is PeerState.FAILED
    assert "warming the connection" in (entry.error or "")
    assert t.removed == ["P1"]
    assert entry.peer is None
    assert engines.handshake_failures == 1
    assert engines.handshakes == 0
    assert engines.take_counts() == {"warmups_failed": 1}


def test_a_warm_up_failing_otherwise_is_skipped() -> None:
    t = FakeTransport()
    engines = _engines(t)
    entry = engines.ensure("P", 0, "h", 1, now=0.0)
    _answered(engines, 0.0)
    t.status = XferStatus.failed(TransferFailedError("one transfer failed"))
    assert engines.poll(0.1, lambda e: False) == [entry]
    assert entry.state is PeerState.READY
    assert entry.warmup_outcome == "failed"
    assert engines.take_counts() == {"warmups_failed": 1}


@pytest.mark.parametrize(
    ("error", "state", "counts"),
    [
        (CapabilityError("no warm-up buffer"), PeerState.READY, {"warmups_unsupported": 1}),
        (TransferFailedError("refused"), PeerState.READY, {"warmups_failed": 1}),
        (PeerUnreachableError("gone"), PeerState.FAILED, {"warmups_failed": 1}),
    ],
)
def test_warm_up_raising(error: Exception, state: PeerState, counts: dict[str, int]) -> None:
    """A peer without a warm-up buffer, or a refused post: ready at once; an unreachable peer:
    the handshake failed."""
    t = FakeTransport()
    t.warm = error
    engines = _engines(t)
    entry = engines.ensure("P", 0, "h", 1, now=0.0)
    assert _answered(engines, 0.0) == [entry]
    assert entry.state is state
    assert engines.take_counts() == counts


@pytest.mark.parametrize(("capable", "timeout"), [(False, 0.5), (True, 0.0)])
def test_no_warm_up_without_the_capability_or_with_timeout_zero(
    capable: bool, timeout: float
) -> None:
    t = FakeTransport(warm_up=capable)
    engines = _engines(t, warmup_timeout=timeout)
    entry = engines.ensure("P", 0, "h", 1, now=0.0)
    assert _answered(engines, 0.0) == [entry]
    assert entry.state is PeerState.READY
    assert entry.warmup_outcome is None
    assert t.warmed == []
    assert engines.take_counts() == {}


def test_a_connection_replaced_while_warming_releases_its_warm_up() -> None:
    """The engine moved (another address) during the warm-up: the warm-up is released and
    the old peer removed; the new handshake warms its own connection."""
    t = FakeTransport()
    engines = _engines(t)
    old = engines.ensure("P", 0, "h", 1, now=0.0)
    _answered(engines, 0.0)
    new = engines.ensure("P", 0, "h", 2, now=0.1)
    assert new is not old
    assert t.released == t.warmed[:1]
    assert t.removed == ["P1"]
    _answered(engines, 0.1)
    assert new.peer == "P2"
    assert len(t.warmed) == 2
    t.status = XferStatus.done(64)
    assert engines.poll(0.2, lambda e: False) == [new]
    assert new.state is PeerState.READY
