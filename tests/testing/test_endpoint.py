"""The child endpoint: its wire (frozen messages in the one codec), error mapping, progress
while idle, death."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvframe.testing._wire as wire
from kvframe.errors import ConfigError, PeerUnreachableError
from kvframe.spi.transport import (
    MemoryKind,
    MemoryRegion,
    Notification,
    Op,
    TransportCapabilities,
    XferState,
)
from kvframe.testing import ChildEndpoint, LocalEndpoint, RemoteError, TransportSpec
from kvframe.testing.pair import BLOCK_LENS, NUM_BLOCKS, make_layout

EXAMPLE = Path(__file__).resolve().parents[2] / "contrib" / "kvframe-example-transport"
TCP = "kvframe_example_transport.transport:TcpTransport.create"


@pytest.fixture
def tcp_spec(monkeypatch: pytest.MonkeyPatch) -> TransportSpec:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    return TransportSpec(name="example-tcp", factory=TCP)


@pytest.fixture
def child(tcp_spec: TransportSpec) -> Iterator[ChildEndpoint]:
    ep = ChildEndpoint.start(tcp_spec, "child", timeout=10, env={"PYTHONPATH": str(EXAMPLE)})
    yield ep
    ep.shutdown()


def test_buffers_and_errors_cross_the_boundary(child: ChildEndpoint) -> None:
    assert child.name == "child"
    assert child.capabilities.cross_process
    region = child.alloc(100)
    assert region.addr % 64 == 0
    child.write(region.addr + 10, b"hello")
    assert child.read(region.addr + 8, 9) == b"\0\0hello\0\0"
    assert len(child.checksum(region.addr, 100)) == 64
    with pytest.raises(ValueError, match="not inside a buffer"):
        child.read(region.addr + 90, 20)
    with pytest.raises(PeerUnreachableError, match="does not decode"):
        child.add_peer(b"junk")
    with pytest.raises(KeyError):
        child.poll(12345)
    with pytest.raises(ValueError, match="unknown endpoint command Done"):
        child._call(wire.Done(), wire.Done)  # an answer sent as a command


def test_child_makes_progress_between_commands(
    child: ChildEndpoint, tcp_spec: TransportSpec
) -> None:
    local = LocalEndpoint(tcp_spec.build("parent"))
    try:
        size = sum(BLOCK_LENS) * NUM_BLOCKS
        mine, theirs = local.alloc(size), child.alloc(size)
        child.write(theirs.addr, bytes(range(256)) * (size // 256))
        local.register([mine])
        child.register([theirs])
        peer = local.add_peer(child.metadata())
        child.add_peer(local.metadata())
        lid = local.prepare_local(make_layout(mine, BLOCK_LENS, NUM_BLOCKS))
        rid = local.prepare_remote(peer, make_layout(theirs, BLOCK_LENS, NUM_BLOCKS))
        xid = local.post(Op.READ, lid, [0], rid, [1], regions=[0], notification=b"n")
        # no command goes to the child now: only its own loop can serve the READ
        deadline = time.monotonic() + 10
        while local.poll(xid).state is XferState.PENDING:
            assert time.monotonic() < deadline, "the child did not serve the READ while idle"
            time.sleep(0.001)
        assert local.read(mine.addr, 256) == bytes(range(256))
        time.sleep(0.05)  # the child drains while idle and keeps what it drained
        assert [(n.sender, n.payload) for n in child.drain()] == [("parent", b"n")]
    finally:
        local.shutdown()


def test_killed_child_is_peer_unreachable(child: ChildEndpoint) -> None:
    pid = child.pid
    child.kill()
    child.kill()
    with pytest.raises(PeerUnreachableError):
        child.metadata()
    assert pid > 0


def test_errors_while_building_propagate_and_stop_the_child(tcp_spec: TransportSpec) -> None:
    bad = TransportSpec(name="example-tcp", options={"colour": 1}, factory=TCP)
    with pytest.raises(ConfigError, match="colour"):
        ChildEndpoint.start(bad, "x", env={"PYTHONPATH": str(EXAMPLE)})
    weird = TransportSpec(name="x", factory="copy:deepcopy")  # returns params, not a transport
    with pytest.raises(RemoteError) as info:
        ChildEndpoint.start(weird, "x")
    assert info.value.type_name == "AttributeError"
    with pytest.raises(ConfigError, match="module:callable"):
        TransportSpec(name="x", factory="no-colon").build("x")


def test_callable_factories_cannot_cross_processes() -> None:
    spec = TransportSpec(name="x", factory=lambda params: None)  # type: ignore[arg-type,return-value]
    assert not spec.portable
    with pytest.raises(TypeError, match="cannot cross a process boundary"):
        ChildEndpoint.start(spec, "x")


def test_host_resolved_spec_names_the_factory_path() -> None:
    spec = TransportSpec(name="inprocess").for_child()
    assert spec.factory == "kvframe.transports.inprocess:_default_factory"


def test_the_child_answers_a_malformed_frame_and_keeps_serving(child: ChildEndpoint) -> None:
    body = b"KVFM" + bytes([0, 2, 5]) + b"nope." + b"\x80"  # a tag the wire does not know
    child._sock.sendall(len(body).to_bytes(4, "big") + body)
    failure = wire.recv(child._sock)
    assert isinstance(failure, wire.Failure)
    assert failure.type_name == "CodecError"
    assert "unknown message type 'nope.'" in failure.message
    assert child.read(child.alloc(8).addr, 8) == bytes(8)  # still serving


def test_every_wire_message_round_trips_as_a_typed_value() -> None:
    region = MemoryRegion(addr=4096, length=1 << 16)
    layout = make_layout(region, BLOCK_LENS, NUM_BLOCKS)
    caps = TransportCapabilities(
        memory_kinds=frozenset({MemoryKind.HOST, MemoryKind.DEVICE}),
        read=True,
        write=False,
        notifications=True,
        max_notification_bytes=64,
    )
    messages = [
        wire.Create(name="t", options={"a": [1, {"b": None}]}, factory="m:f", endpoint_name="e"),
        wire.Register(regions=(region,)),
        wire.PrepareRemote(peer="p", layout=layout),
        wire.Post(op=Op.WRITE, local=1, local_blocks=(0, 2), remote=3, remote_blocks=(1, 3)),
        wire.Created(name="e", capabilities=caps),
        wire.Polled(state=XferState.FAILED, error=wire.Failure(type_name="X", message="m")),
        wire.Drained(notifications=(Notification(sender="s", payload=b"p"),)),
        wire.Done(value=b"bytes"),
    ]
    for message in messages:
        assert wire.CODEC.decode(wire.CODEC.encode(message)) == message
