"""The P/D side-channel handshake over real pyzmq sockets on loopback."""

from __future__ import annotations

import socket
import time

import msgpack
import pytest
import zmq

from kvframe.connectors.pd.handshake import (
    HandshakeRequest,
    HandshakeResponse,
    HandshakeServer,
    compat_hash,
    handshake,
)
from kvframe.errors import HandshakeError, HandshakeTimeoutError, IncompatiblePeerError
from kvframe.spi.transport import BlockLayout, MemoryRegion

CHASH = compat_hash(dtype="float16", block_size=32, layers=2)
LAYOUT = BlockLayout(
    regions=(MemoryRegion(addr=4096, length=1 << 20), MemoryRegion(addr=1 << 30, length=1 << 20)),
    block_lens=(8192, 8192),
    num_blocks=128,
)


def _respond(req: HandshakeRequest) -> HandshakeResponse:
    if req.transport != "inprocess":
        raise ValueError(f"transport {req.transport!r} is not the one this engine uses")
    return HandshakeResponse(
        engine_id="P",
        rank=0,
        tp_size=1,
        transport="inprocess",
        transport_metadata=b"meta-of-P",
        layout=LAYOUT,
        kv_lease_duration=30.0,
        extra={"peer_seen": req.engine_id},
    )


@pytest.fixture
def server() -> HandshakeServer:
    srv = HandshakeServer("127.0.0.1", 0, chash=CHASH, respond=_respond)
    yield srv
    srv.close()
    srv.close()


REQ = HandshakeRequest(
    engine_id="D", rank=0, transport="inprocess", transport_metadata=b"meta-of-D"
)


def test_happy_path_returns_layout_and_clock_samples(server: HandshakeServer) -> None:
    result = handshake("127.0.0.1", server.port, REQ, chash=CHASH, samples=3)
    assert result.response.layout == LAYOUT
    assert result.response.transport_metadata == b"meta-of-P"
    assert result.response.extra == {"peer_seen": "D"}
    assert len(result.samples) == 3
    for s in result.samples:
        assert s.rtt >= 0
        # same host, same monotonic clock: the offset is within the round trip
        assert abs(s.offset) <= s.rtt + 1e-3
    assert server.served == 1


def test_skewed_server_clock_is_seen_in_the_offset() -> None:
    srv = HandshakeServer(
        "127.0.0.1", 0, chash=CHASH, respond=_respond, clock=lambda: time.monotonic() + 10_000
    )
    try:
        result = handshake("127.0.0.1", srv.port, REQ, chash=CHASH, samples=2)
    finally:
        srv.close()
    best = min(result.samples, key=lambda s: s.rtt)
    assert best.offset == pytest.approx(10_000, abs=best.rtt + 1e-3)


def test_hash_mismatch_is_incompatible_and_named(server: HandshakeServer) -> None:
    with pytest.raises(IncompatiblePeerError, match="compatibility hash mismatch"):
        handshake("127.0.0.1", server.port, REQ, chash=compat_hash(other=1), timeout=2)
    assert server.rejected == 1


def test_refused_by_responder(server: HandshakeServer) -> None:
    bad = HandshakeRequest(engine_id="D", rank=0, transport="nixl", transport_metadata=b"")
    with pytest.raises(HandshakeError, match="not the one this engine uses"):
        handshake("127.0.0.1", server.port, bad, chash=CHASH, timeout=2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_nobody_listening_times_out_quickly() -> None:
    t0 = time.monotonic()
    with pytest.raises(HandshakeTimeoutError, match="no handshake answer"):
        handshake("127.0.0.1", _free_port(), REQ, chash=CHASH, timeout=0.3)
    assert time.monotonic() - t0 < 2


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"garbage",
        b"KVFH" + bytes([1, 1]) + CHASH + b"\xc1\xc1",  # reserved msgpack byte
        b"KVFH" + bytes([1, 1]) + CHASH + msgpack.packb([1, 2, 3]),
        b"KVFH" + bytes([1, 1]) + CHASH + msgpack.packb({"engine_id": 5}),
        b"KVFH" + bytes([9, 1]) + CHASH + msgpack.packb({}),
        b"KVFH" + bytes([1, 7]) + CHASH + msgpack.packb({}),
    ],
)
def test_malformed_frames_are_rejected_and_server_keeps_serving(
    server: HandshakeServer, frame: bytes
) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        sock.send(frame)
        assert sock.poll(2000, zmq.POLLIN)
        reply = sock.recv()
        assert reply[5] == 3  # an error frame
    finally:
        sock.close()
    assert server.rejected == 1
    # still serving
    assert handshake("127.0.0.1", server.port, REQ, chash=CHASH).response.engine_id == "P"


def test_port_in_use_is_a_clear_error(server: HandshakeServer) -> None:
    with pytest.raises(HandshakeError, match="side_channel_port"):
        HandshakeServer("127.0.0.1", server.port, chash=CHASH, respond=_respond)
