"""The P/D side-channel handshake over real pyzmq sockets on loopback, and its frame reader:
total (only HandshakeError escapes, fuzzed), and a peer of another version or compatibility
hash never reaches the payload decoder."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from typing import Any

import attrs
import msgpack
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from kvframe.connectors.pd import handshake as hs
from kvframe.connectors.pd.handshake import (
    HANDSHAKE_CODEC,
    HANDSHAKE_VERSION,
    MAX_PAYLOAD,
    ClockPing,
    ClockPong,
    HandshakeAccept,
    HandshakeRefusal,
    HandshakeRequest,
    HandshakeResponse,
    HandshakeServer,
    compat_hash,
    decode_frame,
    encode_frame,
    handshake,
)
from kvframe.errors import HandshakeError, HandshakeTimeoutError, IncompatiblePeerError
from kvframe.protocol.codec import DEFAULT_CODEC, PROTOCOL_VERSION
from kvframe.protocol.messages import ConnectorOutput
from kvframe.spi.transport import BlockLayout, MemoryKind, MemoryRegion

CHASH = compat_hash(dtype="float16", block_size=32, layers=2)
LAYOUT = BlockLayout(
    regions=(MemoryRegion(addr=4096, length=1 << 20), MemoryRegion(addr=1 << 30, length=1 << 20)),
    block_lens=(8192, 8192),
    num_blocks=128,
)


def _respond(req: HandshakeRequest, session: bytes | None = None) -> HandshakeResponse:
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
        incarnation=f"seen-{req.engine_id}",
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
    assert result.response.incarnation == "seen-D"
    assert result.response == _respond(REQ)
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


OTHER = compat_hash(other=1)
HEADER = b"KVFH" + bytes([HANDSHAKE_VERSION]) + CHASH


def _envelope(tag: bytes, body: Any) -> bytes:
    """A codec envelope written by hand (what a hostile peer can send)."""
    try:
        return HANDSHAKE_CODEC.envelope(tag.decode(), msgpack.packb(body))
    except KeyError:  # a tag the codec does not know: no layout checksum to copy
        return b"KVFM" + struct.pack(">HB", PROTOCOL_VERSION, len(tag)) + tag + msgpack.packb(body)


@pytest.mark.parametrize(
    ("frame", "fragment"),
    [
        (b"", "0 bytes is shorter than its 21-byte header"),
        (b"garbage", "7 bytes is shorter"),
        (b"KVFX" + bytes([HANDSHAKE_VERSION]) + CHASH, "not a kvframe handshake frame"),
        (HEADER + b"\xc1\xc1", "undecodable handshake payload"),
        (HEADER + msgpack.packb({"engine_id": "D"}), "undecodable handshake payload: bad magic"),
        (
            HEADER + _envelope(b"pd.handshake.request", {"engine_id": 5}),
            "Expected `str`, got `int` - at `$.engine_id`",
        ),
        (
            HEADER + _envelope(b"pd.handshake.request", {"engine_id": "D", "rank": 0}),
            "not a valid HandshakeRequest",
        ),
        (HEADER + _envelope(b"pd.nope", {}), "unknown message type 'pd.nope'"),
        (HEADER + DEFAULT_CODEC.encode(ConnectorOutput()), "unexpected handshake message"),
        (
            encode_frame(HandshakeRefusal(code="refused", message="no"), CHASH),
            "unexpected handshake message HandshakeRefusal",
        ),
        (b"KVFH" + bytes([1, 1]) + CHASH + msgpack.packb({}), "handshake version 1"),
        (b"KVFH" + bytes([9]) + CHASH + b"\xc1", "handshake version 9 is not supported"),
        (encode_frame(REQ, OTHER), "compatibility hash mismatch"),
    ],
)
def test_malformed_frames_are_refused_precisely_and_the_server_keeps_serving(
    server: HandshakeServer, frame: bytes, fragment: str
) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        sock.send(frame)
        assert sock.poll(2000, zmq.POLLIN)
        refusal = decode_frame(sock.recv(), CHASH)  # under the server's own hash
    finally:
        sock.close()
    assert isinstance(refusal, HandshakeRefusal)
    assert fragment in refusal.message
    incompatible = "version" in fragment or "hash" in fragment
    assert refusal.code == ("incompatible" if incompatible else "malformed")
    assert server.rejected == 1
    assert server.last_error == refusal.message
    # still serving
    assert handshake("127.0.0.1", server.port, REQ, chash=CHASH).response.engine_id == "P"


def test_clock_pings_are_answered_with_the_server_clock(server: HandshakeServer) -> None:
    pong = decode_frame(server._answer(b"test", encode_frame(ClockPing(), CHASH)), CHASH)
    assert isinstance(pong, ClockPong)
    assert abs(pong.now - time.monotonic()) < 5


def test_a_version_1_answer_is_incompatible_on_the_client() -> None:
    # What a P running the msgpack-map side channel (version 1) answers.
    ctx = zmq.Context.instance()
    srv = ctx.socket(zmq.ROUTER)
    srv.setsockopt(zmq.LINGER, 0)
    port = srv.bind_to_random_port("tcp://127.0.0.1")
    try:

        def answer() -> None:
            if srv.poll(2000, zmq.POLLIN):
                ident, _ = srv.recv_multipart()
                srv.send_multipart([ident, b"KVFH" + bytes([1, 2]) + CHASH + msgpack.packb({})])

        t = threading.Thread(target=answer)
        t.start()
        with pytest.raises(IncompatiblePeerError, match="handshake version 1 is not supported"):
            handshake("127.0.0.1", port, REQ, chash=CHASH, timeout=2)
        t.join()
    finally:
        srv.close()


class _NoDecoding:
    """Stands in for the side channel's codec: encodes as it does, fails the test on decode."""

    def __init__(self) -> None:
        self.decoded = 0

    def encode(self, message: object) -> bytes:
        return HANDSHAKE_CODEC.encode(message)

    def decode(self, data: bytes) -> object:
        self.decoded += 1
        raise AssertionError("the payload was decoded")


def test_another_hash_or_version_is_refused_before_the_payload_is_decoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = _NoDecoding()
    monkeypatch.setattr(hs, "HANDSHAKE_CODEC", spy)
    hostile = b"\xc1" * 64  # would make any decoder fail
    for frame, fragment in [
        (b"KVFH" + bytes([HANDSHAKE_VERSION]) + OTHER + hostile, "compatibility hash mismatch"),
        (b"KVFH" + bytes([HANDSHAKE_VERSION + 1]) + CHASH + hostile, "is not supported"),
    ]:
        with pytest.raises(IncompatiblePeerError, match=fragment):
            decode_frame(frame, CHASH)
    # The same over the wire, on both sides: the server refuses a client of another hash
    # without decoding its request, and the client refuses the refusal (signed with the
    # server's hash) without decoding it either.
    srv = HandshakeServer("127.0.0.1", 0, chash=CHASH, respond=_respond)
    try:
        with pytest.raises(IncompatiblePeerError, match=f"theirs {CHASH.hex()}"):
            handshake("127.0.0.1", srv.port, REQ, chash=OTHER, timeout=2)
        assert srv.rejected == 1
        assert "compatibility hash mismatch" in (srv.last_error or "")
    finally:
        srv.close()
    assert spy.decoded == 0


def test_oversized_payloads_are_refused_unread() -> None:
    frame = HEADER + b"\x00" * (MAX_PAYLOAD + 1)
    with pytest.raises(HandshakeError, match=f"over the limit of {MAX_PAYLOAD} bytes"):
        decode_frame(frame, CHASH)
    big = HandshakeRequest(
        engine_id="D", rank=0, transport="x", transport_metadata=b"m" * MAX_PAYLOAD
    )
    with pytest.raises(ValueError, match="over the limit"):
        encode_frame(big, CHASH)
    with pytest.raises(HandshakeError, match="cannot send the handshake request"):
        handshake("127.0.0.1", _free_port(), big, chash=CHASH, timeout=0.3)


_ACCEPT = HandshakeAccept(response=_respond(REQ), now=12.5)
_VALID = [
    encode_frame(m, CHASH)
    for m in (
        REQ,
        _ACCEPT,
        ClockPing(),
        ClockPong(now=1.0),
        HandshakeRefusal(code="refused", message="x"),
    )
]


@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_handshake_errors(data: bytes) -> None:
    for frame in (data, HEADER + data, b"KVFH" + data):
        with contextlib.suppress(HandshakeError):  # anything else fails the test
            decode_frame(frame, CHASH)


@given(st.sampled_from(_VALID), st.data())
def test_mutated_frames_raise_only_handshake_errors(frame: bytes, data: st.DataObject) -> None:
    buf = bytearray(frame)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, len(buf)))
        if op == "flip" and at < len(buf):
            buf[at] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del buf[at : at + data.draw(st.integers(1, 8))]
        else:
            buf[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    with contextlib.suppress(HandshakeError):  # anything else fails the test
        decode_frame(bytes(buf), CHASH)


def test_every_side_channel_message_round_trips() -> None:
    for frame, message in zip(
        _VALID,
        (
            REQ,
            _ACCEPT,
            ClockPing(),
            ClockPong(now=1.0),
            HandshakeRefusal(code="refused", message="x"),
        ),
        strict=True,
    ):
        assert decode_frame(frame, CHASH) == message
    device = BlockLayout(
        regions=(MemoryRegion(addr=1 << 40, length=1 << 20, kind=MemoryKind.DEVICE, device_id=3),),
        block_lens=(4096,),
        num_blocks=256,
    )
    accept = HandshakeAccept(response=attrs.evolve(_respond(REQ), layout=device), now=0.0)
    back = decode_frame(encode_frame(accept, CHASH), CHASH)
    assert back == accept
    assert isinstance(back, HandshakeAccept)
    assert back.response.layout.regions[0].kind is MemoryKind.DEVICE


def test_an_invalid_layout_or_value_in_an_answer_is_a_precise_handshake_error() -> None:
    body = HANDSHAKE_CODEC.encode(_ACCEPT)
    # The same frame with a region whose memory kind does not exist.
    bad = HEADER + body.replace(b"host", b"disk")
    with pytest.raises(HandshakeError, match=r"Invalid enum value 'disk' - at `\$.response.layout"):
        decode_frame(bad, CHASH)
    nan = HEADER + _envelope(b"pd.handshake.pong", {"now": float("nan")})
    with pytest.raises(HandshakeError, match="now = nan; it must be a finite number"):
        decode_frame(nan, CHASH)
    refusal = HEADER + _envelope(b"pd.handshake.refusal", {"code": "whatever", "message": ""})
    with pytest.raises(HandshakeError, match="code = 'whatever'; it must be one of"):
        decode_frame(refusal, CHASH)


def test_port_in_use_is_a_clear_error(server: HandshakeServer) -> None:
    with pytest.raises(HandshakeError, match="side_channel_port"):
        HandshakeServer("127.0.0.1", server.port, chash=CHASH, respond=_respond)
