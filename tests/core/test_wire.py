"""The heartbeat wire format (version 2, lease handles): round trips, the documented layout,
limits, splitting, constructor validation, and fuzzing the decoder."""

from __future__ import annotations

import itertools
import math
import random
import struct
from typing import Any

import attrs
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvframe.core import wire
from kvframe.errors import CodecError, UnknownMessageTypeError, UnsupportedVersionError

# What the module docstring documents, written out here independently of wire.py's tables.
KINDS: list[type[Any]] = [wire.Heartbeat, wire.LeaseAck, wire.LeaseLost, wire.LeaseDone]
TYPE_BYTE = {wire.Heartbeat: 1, wire.LeaseAck: 2, wire.LeaseLost: 3, wire.LeaseDone: 4}
EXTRA = {wire.Heartbeat: 0, wire.LeaseAck: 8, wire.LeaseLost: 1, wire.LeaseDone: 1}
SEQ_FIELD = {
    wire.Heartbeat: "seq",
    wire.LeaseAck: "echo_seq",
    wire.LeaseLost: "echo_seq",
    wire.LeaseDone: "seq",
}
TIME_FIELD = {
    wire.Heartbeat: "sent_at",
    wire.LeaseAck: "holder_now",
    wire.LeaseLost: "holder_now",
    wire.LeaseDone: "sent_at",
}
LOST_CODES = {1, 2, 3, 4, 5}
DONE_CODES = {1, 2}
U64 = 2**64

HANDLE = st.one_of(st.integers(2, U64 - 1), st.sampled_from([2, 3, U64 - 1, U64 - 2]))
HANDLES = st.lists(HANDLE, min_size=1, max_size=60, unique=True)
SEQ = st.integers(0, 2**32 - 1)
TIME = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.integers(-(2**53), 2**53),  # ints are accepted and travel as f64 (exactly, here)
)

HEARTBEATS = st.builds(wire.Heartbeat, seq=SEQ, sent_at=TIME, handles=HANDLES)
ACKS = st.builds(wire.LeaseAck, echo_seq=SEQ, holder_now=TIME, expiry=TIME, handles=HANDLES)
LOSTS = st.builds(
    wire.LeaseLost,
    echo_seq=SEQ,
    holder_now=TIME,
    reason=st.sampled_from(wire.LostReason),
    handles=HANDLES,
)
DONES = st.builds(
    wire.LeaseDone, seq=SEQ, sent_at=TIME, reason=st.sampled_from(wire.DoneReason), handles=HANDLES
)
MESSAGES = st.one_of(HEARTBEATS, ACKS, LOSTS, DONES)


def build(
    cls: type[Any],
    handles: Any,
    *,
    seq: Any = 7,
    t: Any = 2.5,
    expiry: Any = 30.0,
    lost: Any = wire.LostReason.EXPIRED,
    done: Any = wire.DoneReason.READ,
) -> Any:
    """A message of type ``cls`` with these handles and header fields."""
    if cls is wire.Heartbeat:
        return wire.Heartbeat(seq=seq, sent_at=t, handles=handles)
    if cls is wire.LeaseAck:
        return wire.LeaseAck(echo_seq=seq, holder_now=t, expiry=expiry, handles=handles)
    if cls is wire.LeaseLost:
        return wire.LeaseLost(echo_seq=seq, holder_now=t, reason=lost, handles=handles)
    return wire.LeaseDone(seq=seq, sent_at=t, reason=done, handles=handles)


def header_fields(msg: wire.Message) -> dict[str, Any]:
    """Every field but the handles."""
    d = attrs.asdict(msg, recurse=False)
    del d["handles"]
    return d


def documented_size(msg: wire.Message) -> int:
    return {wire.Heartbeat: 18, wire.LeaseAck: 26, wire.LeaseLost: 19, wire.LeaseDone: 19}[
        type(msg)
    ] + 8 * len(msg.handles)


def random_handles(n: int, seed: int | str) -> list[int]:
    """``n`` distinct handles in a random order, from ``seed``."""
    rng = random.Random(seed)
    handles: dict[int, None] = {}
    while len(handles) < n:
        handles[rng.randrange(2, U64)] = None
    return list(handles)


def decode_or_codec_error(data: bytes) -> wire.Message | None:
    """The decoded message, or None for a CodecError (anything else propagates and fails)."""
    try:
        msg = wire.decode(data)
    except CodecError:
        return None
    # Anything accepted is canonical: it encodes back to exactly the bytes it came from.
    assert wire.encode(msg) == bytes(data)
    return msg


# -- constants and round trips ------------------------------------------------------------------


def test_documented_constants() -> None:
    assert wire.MAGIC == b"KH"
    assert wire.VERSION == 2
    assert wire.HEADER_BYTES == 18
    assert wire.MAX_HANDLES_PER_MESSAGE == 1024
    assert wire.MAX_IDS_PER_MESSAGE == wire.MAX_HANDLES_PER_MESSAGE
    assert wire.MAX_MESSAGE_BYTES == 16 * 1024
    assert {t.name: t.value for t in wire.MessageType} == {
        "HEARTBEAT": 1,
        "LEASE_ACK": 2,
        "LEASE_LOST": 3,
        "LEASE_DONE": 4,
    }
    assert {r.name: r.value for r in wire.LostReason} == {
        "UNKNOWN": 1,
        "CONSUMED": 2,
        "ABORTED": 3,
        "EXPIRED": 4,
        "CLAIMED": 5,
    }
    assert {r.name: r.value for r in wire.DoneReason} == {"READ": 1, "RELEASED": 2}
    for name in wire.__all__:
        assert hasattr(wire, name), name


@given(MESSAGES)
@example(wire.Heartbeat(seq=0, sent_at=-0.0, handles=[2]))
@example(wire.LeaseAck(echo_seq=2**32 - 1, holder_now=5e-324, expiry=-1e308, handles=[U64 - 1]))
@example(wire.LeaseLost(echo_seq=1, holder_now=1.0, reason=wire.LostReason.CLAIMED, handles=[3]))
@example(wire.LeaseDone(seq=1, sent_at=1.0, reason=wire.DoneReason.RELEASED, handles=[2, 3]))
def test_round_trip(msg: wire.Message) -> None:
    data = wire.encode(msg)
    assert isinstance(data, bytes)
    assert len(data) == wire.encoded_size(msg) == documented_size(msg)
    back = wire.decode(data)
    assert type(back) is type(msg)
    assert back == msg
    assert back.handles == tuple(msg.handles)  # order kept
    assert wire.encode(back) == data  # canonical (keeps -0.0 and every float bit)
    assert wire.decode(bytearray(data)) == msg
    assert wire.decode(memoryview(data)) == msg
    assert wire.decode(memoryview(b"xx" + data + b"yy")[2:-2]) == msg


@pytest.mark.parametrize("cls", KINDS)
def test_round_trip_at_the_handle_limit(cls: type[Any]) -> None:
    handles = random_handles(wire.MAX_HANDLES_PER_MESSAGE, cls.__name__)
    msg = build(cls, handles)
    data = wire.encode(msg)
    assert len(data) == 18 + EXTRA[cls] + 8 * 1024 <= wire.MAX_MESSAGE_BYTES
    assert wire.decode(data) == msg


# -- the documented byte layout -----------------------------------------------------------------


def test_layout_literal_bytes() -> None:
    """Fixed messages against hand-written bytes (big-endian, offsets as documented)."""
    h1 = 0x0102030405060708
    handles_bytes = bytes.fromhex("0102030405060708") + bytes.fromhex("0000000000000002")
    seq_bytes = bytes.fromhex("0a0b0c0d")
    t_bytes = bytes.fromhex("4004000000000000")  # 2.5 as a big-endian f64
    count = b"\x00\x02"

    hb = wire.encode(wire.Heartbeat(seq=0x0A0B0C0D, sent_at=2.5, handles=[h1, 2]))
    assert hb == b"KH\x02\x01" + seq_bytes + t_bytes + count + handles_bytes
    assert len(hb) == 18 + 16

    ack = wire.encode(
        wire.LeaseAck(echo_seq=0x0A0B0C0D, holder_now=2.5, expiry=-2.0, handles=[h1, 2])
    )
    expiry_bytes = bytes.fromhex("c000000000000000")  # -2.0
    assert ack == b"KH\x02\x02" + seq_bytes + t_bytes + count + expiry_bytes + handles_bytes
    assert len(ack) == 26 + 16

    for code, reason in [(1, wire.LostReason.UNKNOWN), (5, wire.LostReason.CLAIMED)]:
        lost = wire.encode(
            wire.LeaseLost(echo_seq=0x0A0B0C0D, holder_now=2.5, reason=reason, handles=[h1, 2])
        )
        assert lost == b"KH\x02\x03" + seq_bytes + t_bytes + count + bytes([code]) + handles_bytes
        assert len(lost) == 19 + 16

    for code, dreason in [(1, wire.DoneReason.READ), (2, wire.DoneReason.RELEASED)]:
        done = wire.encode(
            wire.LeaseDone(seq=0x0A0B0C0D, sent_at=2.5, reason=dreason, handles=[h1, 2])
        )
        assert done == b"KH\x02\x04" + seq_bytes + t_bytes + count + bytes([code]) + handles_bytes
        assert len(done) == 19 + 16


@given(MESSAGES)
def test_layout_offsets_as_documented(msg: wire.Message) -> None:
    """Every field read back with ``struct`` at the docstring's offsets."""
    data = wire.encode(msg)
    cls = type(msg)
    n = len(msg.handles)
    assert data[0:2] == b"KH"
    assert data[2] == 2
    assert data[3] == TYPE_BYTE[cls]
    assert struct.unpack_from(">I", data, 4)[0] == getattr(msg, SEQ_FIELD[cls])
    t = getattr(msg, TIME_FIELD[cls])
    assert data[8:16] == struct.pack(">d", t)
    assert struct.unpack_from(">H", data, 16)[0] == n
    start = 18 + EXTRA[cls]
    if isinstance(msg, wire.LeaseAck):
        assert data[18:26] == struct.pack(">d", msg.expiry)
    elif isinstance(msg, wire.LeaseLost | wire.LeaseDone):
        assert data[18] == msg.reason.value
    assert len(data) == start + 8 * n
    for i, h in enumerate(msg.handles):
        assert data[start + 8 * i : start + 8 * i + 8] == h.to_bytes(8, "big")


@given(st.sampled_from(KINDS), st.integers(1, wire.MAX_HANDLES_PER_MESSAGE))
@example(wire.Heartbeat, 1)
@example(wire.LeaseAck, 1024)
def test_size_formula(cls: type[Any], n: int) -> None:
    msg = build(cls, range(2, 2 + n))
    expected = {wire.Heartbeat: 18, wire.LeaseAck: 26, wire.LeaseLost: 19, wire.LeaseDone: 19}[
        cls
    ] + 8 * n
    assert wire.encoded_size(msg) == expected
    assert len(wire.encode(msg)) == expected


def test_encoded_size_needs_no_limit() -> None:
    """encoded_size does not check limits (encode would refuse this one)."""
    msg = wire.Heartbeat(seq=0, sent_at=0.0, handles=range(2, 2 + 5000))
    assert wire.encoded_size(msg) == 18 + 8 * 5000


# -- fuzzing: any input raises only CodecError --------------------------------------------------


@given(st.binary(max_size=400))
@example(b"")
@example(b"K")
@example(b"KH")
@example(b"KH\x02")
@example(b"KH\x02\x01")
@example(b"KH\x02\x01" + b"\x00" * 14)
@example(b"KH\x02\x02" + b"\x00" * 22)
@example(b"KH\x02\x03" + b"\x00" * 15)
@example(b"KH\x01\x01" + b"\x00" * 14)
def test_arbitrary_bytes(data: bytes) -> None:
    decode_or_codec_error(data)


@given(st.sampled_from([t.value for t in wire.MessageType]), st.binary(max_size=300))
def test_arbitrary_bodies_behind_a_valid_prefix(mtype: int, body: bytes) -> None:
    decode_or_codec_error(b"KH\x02" + bytes([mtype]) + body)


F64_BITS = st.one_of(
    st.floats().map(lambda f: struct.pack(">d", f)),  # includes nan and +-inf
    st.integers(0, U64 - 1).map(lambda b: b.to_bytes(8, "big")),  # any bit pattern
)
RAW_HANDLES = st.lists(
    st.one_of(st.sampled_from([0, 1, 2, 3, U64 - 1]), st.integers(0, U64 - 1)), max_size=20
)


@given(
    mtype=st.sampled_from(KINDS),
    seq=SEQ,
    t_bits=F64_BITS,
    expiry_bits=F64_BITS,
    reason=st.one_of(st.integers(0, 255), st.sampled_from([1, 2, 5])),
    handles=RAW_HANDLES,
    count=st.one_of(st.none(), st.integers(0, 65535)),
)
def test_near_valid_messages_decode_exactly_when_valid(
    mtype: type[Any],
    seq: int,
    t_bits: bytes,
    expiry_bits: bytes,
    reason: int,
    handles: list[int],
    count: int | None,
) -> None:
    """Well-framed bytes with random field values: decode accepts them exactly when every field
    is valid, and then yields the message with those fields."""
    n = len(handles) if count is None else count
    extra = {
        wire.Heartbeat: b"",
        wire.LeaseAck: expiry_bits,
        wire.LeaseLost: bytes([reason]),
        wire.LeaseDone: bytes([reason]),
    }[mtype]
    raw = (
        b"KH\x02"
        + bytes([TYPE_BYTE[mtype]])
        + struct.pack(">I", seq)
        + t_bits
        + struct.pack(">H", n)
        + extra
        + b"".join(h.to_bytes(8, "big") for h in handles)
    )
    (t,) = struct.unpack(">d", t_bits)
    (expiry,) = struct.unpack(">d", expiry_bits)
    valid = (
        math.isfinite(t)
        and 1 <= n <= 1024
        and n == len(handles)
        and min(handles) >= 2
        and len(set(handles)) == len(handles)
        and (mtype is not wire.LeaseAck or math.isfinite(expiry))
        and (mtype is not wire.LeaseLost or reason in LOST_CODES)
        and (mtype is not wire.LeaseDone or reason in DONE_CODES)
    )
    if not valid:
        with pytest.raises(CodecError) as info:
            wire.decode(raw)
        assert not isinstance(info.value, UnsupportedVersionError | UnknownMessageTypeError)
        return
    msg = wire.decode(raw)
    assert msg == build(
        mtype,
        handles,
        seq=seq,
        t=t,
        expiry=expiry,
        lost=wire.LostReason(reason) if reason in LOST_CODES else None,
        done=wire.DoneReason(reason) if reason in DONE_CODES else None,
    )
    assert wire.encode(msg) == raw


@given(MESSAGES, st.data())
def test_mutated_messages(msg: wire.Message, data: st.DataObject) -> None:
    good = wire.encode(msg)
    raw = bytearray(good)
    how = data.draw(st.sampled_from(["flip", "truncate", "extend", "splice"]))
    if how == "flip":
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= data.draw(st.integers(1, 255))
    elif how == "truncate":
        del raw[data.draw(st.integers(0, len(raw) - 1)) :]
    elif how == "extend":
        raw += data.draw(st.binary(min_size=1, max_size=20))
    else:
        i = data.draw(st.integers(0, len(raw)))
        raw[i:i] = data.draw(st.binary(min_size=1, max_size=10))
    back = decode_or_codec_error(bytes(raw))
    if how in ("truncate", "extend"):
        assert back is None  # the count no longer matches the length
    assert wire.decode(good) == msg  # the decoder is stateless and stays usable


# -- precise errors -----------------------------------------------------------------------------


def good_bytes(cls: type[Any], handles: Any = (2,)) -> bytes:
    return wire.encode(build(cls, handles))


def assert_plain_codec_error(data: Any, match: str) -> None:
    with pytest.raises(CodecError, match=match) as info:
        wire.decode(data)
    assert not isinstance(info.value, UnsupportedVersionError | UnknownMessageTypeError)


@pytest.mark.parametrize("cls", KINDS)
def test_version_and_type_errors(cls: type[Any]) -> None:
    good = good_bytes(cls)
    for version in (0, 1, 3, 255):
        with pytest.raises(UnsupportedVersionError, match=f"version {version} "):
            wire.decode(good[:2] + bytes([version]) + good[3:])
    for mtype in (0, 5, 9, 255):
        with pytest.raises(UnknownMessageTypeError, match=f"type {mtype}"):
            wire.decode(good[:3] + bytes([mtype]) + good[4:])
    assert_plain_codec_error(b"XX" + good[2:], "bad magic")
    assert_plain_codec_error(b"HK" + good[2:], "bad magic")


def test_version_1_messages_are_refused() -> None:
    """Real version-1 bytes (request ids instead of handles) are unsupported, not misread."""
    v1_heartbeat = b"KH\x01\x01" + struct.pack(">IdH", 7, 2.5, 2) + b"\x02ab\x01c"
    v1_ack = b"KH\x01\x02" + struct.pack(">IdH", 7, 3.0, 1) + b"\x02ab" + struct.pack(">d", 23.0)
    v1_lost = b"KH\x01\x03" + struct.pack(">IdH", 7, 3.0, 1) + b"\x02ab\x04"
    v1_done = b"KH\x01\x04" + struct.pack(">IdH", 8, 4.0, 1) + b"\x02ab\x01"
    for data in (v1_heartbeat, v1_ack, v1_lost, v1_done):
        with pytest.raises(UnsupportedVersionError, match="version 1 "):
            wire.decode(data)


@pytest.mark.parametrize("cls", KINDS)
def test_truncated_headers(cls: type[Any]) -> None:
    good = good_bytes(cls)
    for length in range(18 + EXTRA[cls]):
        assert_plain_codec_error(good[:length], "truncated")


def with_count(raw: bytes, count: int) -> bytes:
    """``raw`` with its count field (offset 16, u16) replaced."""
    return raw[:16] + struct.pack(">H", count) + raw[18:]


@pytest.mark.parametrize("cls", KINDS)
def test_count_and_length_errors(cls: type[Any]) -> None:
    head = 18 + EXTRA[cls]
    one = good_bytes(cls)
    assert_plain_codec_error(with_count(one, 0), "handle count 0 ")
    assert_plain_codec_error(with_count(one, 0)[:head], "handle count 0 ")
    many = good_bytes(cls, range(2, 2 + 1024))
    assert_plain_codec_error(
        with_count(many, 1025) + (5000).to_bytes(8, "big"), "handle count 1025 "
    )
    assert_plain_codec_error(with_count(one, 65535), "handle count 65535 ")
    n = head + 8
    assert_plain_codec_error(one + b"\x00", f"1 handles need {n} bytes; the message has {n + 1}")
    assert_plain_codec_error(one[:-1], f"1 handles need {n} bytes; the message has {n - 1}")
    assert_plain_codec_error(one[:head], f"1 handles need {n} bytes; the message has {head}")
    assert_plain_codec_error(with_count(one, 2), f"2 handles need {n + 8} bytes")


@pytest.mark.parametrize("cls", KINDS)
def test_handle_errors(cls: type[Any]) -> None:
    head = 18 + EXTRA[cls]
    good = good_bytes(cls, [5, 6, 7])
    for bad in (0, 1):
        for pos in range(3):
            at = head + 8 * pos
            raw = good[:at] + bad.to_bytes(8, "big") + good[at + 8 :]
            assert_plain_codec_error(raw, "handle 0 or 1")
    for raw in (
        good[: head + 8] + (5).to_bytes(8, "big") + good[head + 16 :],  # 5 5 7
        good[: head + 16] + (5).to_bytes(8, "big"),  # 5 6 5
        good[: head + 16] + (6).to_bytes(8, "big"),  # 5 6 6
    ):
        assert_plain_codec_error(raw, "repeated handle")


@pytest.mark.parametrize("cls", KINDS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_times(cls: type[Any], bad: float) -> None:
    good = good_bytes(cls)
    assert_plain_codec_error(
        good[:8] + struct.pack(">d", bad) + good[16:], "time field is not finite"
    )
    if cls is wire.LeaseAck:
        raw = good[:18] + struct.pack(">d", bad) + good[26:]
        assert_plain_codec_error(raw, "expiry is not finite")


def test_signalling_nan_bits_are_refused() -> None:
    good = good_bytes(wire.LeaseAck)
    snan = bytes.fromhex("7ff0000000000001")
    assert_plain_codec_error(good[:8] + snan + good[16:], "time field is not finite")
    assert_plain_codec_error(good[:18] + snan + good[26:], "expiry is not finite")


def test_unknown_reason_bytes() -> None:
    lost = good_bytes(wire.LeaseLost)
    for code in range(256):
        raw = lost[:18] + bytes([code]) + lost[19:]
        if code in LOST_CODES:
            assert wire.decode(raw).reason == wire.LostReason(code)  # type: ignore[union-attr]
        else:
            assert_plain_codec_error(raw, f"unknown loss reason byte {code}$")
    done = good_bytes(wire.LeaseDone)
    for code in range(256):
        raw = done[:18] + bytes([code]) + done[19:]
        if code in DONE_CODES:
            assert wire.decode(raw).reason == wire.DoneReason(code)  # type: ignore[union-attr]
        else:
            assert_plain_codec_error(raw, f"unknown done reason byte {code}$")


@pytest.mark.parametrize("data", ["KH", None, 42, [75, 72, 2, 1], bytes, 3.5, object()])
def test_non_bytes_input(data: object) -> None:
    assert_plain_codec_error(data, "expected bytes")


def test_oversized_input() -> None:
    good = good_bytes(wire.Heartbeat)
    limit = wire.MAX_MESSAGE_BYTES
    assert_plain_codec_error(
        good + b"\x00" * (limit - len(good) + 1), f"{limit + 1} bytes; the limit is {limit}"
    )
    assert_plain_codec_error(b"\x00" * (10 * limit), "the limit is 16384")
    assert_plain_codec_error(bytearray(limit + 1), "the limit is 16384")
    # Exactly the limit is not refused for its size (but for its length: count says 1 handle).
    assert_plain_codec_error(good + b"\x00" * (limit - len(good)), "1 handles need 26 bytes")


# -- limits and splitting -----------------------------------------------------------------------


@pytest.mark.parametrize("cls", KINDS)
def test_encode_refuses_too_many_handles_and_points_to_split(cls: type[Any]) -> None:
    too_many = build(cls, range(2, 2 + wire.MAX_HANDLES_PER_MESSAGE + 1))
    with pytest.raises(
        CodecError, match=r"1025 handles in one message; the limit is 1024.*split\(\)"
    ):
        wire.encode(too_many)
    parts = wire.split(too_many)
    assert [len(p.handles) for p in parts] == [1024, 1]
    assert wire.encode(build(cls, range(2, 2 + wire.MAX_HANDLES_PER_MESSAGE)))


def test_non_messages_are_type_errors() -> None:
    for fn in (wire.encode, wire.encoded_size, wire.split):
        with pytest.raises(TypeError, match="not a wire message: str"):
            fn("hello")  # type: ignore[operator]

    @attrs.frozen(kw_only=True)
    class Lookalike:
        seq: int = 1
        sent_at: float = 0.0
        handles: tuple[int, ...] = (2,)

    with pytest.raises(TypeError, match="not a wire message: Lookalike"):
        wire.encode(Lookalike())  # type: ignore[arg-type]


@given(
    cls=st.sampled_from(KINDS),
    n=st.integers(1, 3000),
    seed=st.integers(0, 2**32),
    room=st.one_of(st.integers(0, 20_000), st.integers(0, 17)),
)
@example(cls=wire.Heartbeat, n=1024, seed=0, room=16_384 - 26)
@example(cls=wire.Heartbeat, n=1025, seed=0, room=10**9)
@example(cls=wire.LeaseAck, n=3, seed=0, room=0)
@example(cls=wire.LeaseLost, n=3, seed=0, room=16)
@example(cls=wire.LeaseDone, n=2000, seed=0, room=16_384)
def test_split_keeps_order_and_header_and_fits(
    cls: type[Any], n: int, seed: int, room: int
) -> None:
    max_bytes = 18 + EXTRA[cls] + 8 + room  # room for one handle, and `room` bytes more
    msg = build(cls, random_handles(n, seed), seq=n, t=-float(seed), expiry=seed * 0.5)
    parts = wire.split(msg, max_bytes)
    limit = min(max_bytes, wire.MAX_MESSAGE_BYTES)
    assert [h for p in parts for h in p.handles] == list(msg.handles)
    for p in parts:
        assert type(p) is cls
        assert header_fields(p) == header_fields(msg)
        assert 1 <= len(p.handles) <= wire.MAX_HANDLES_PER_MESSAGE
        data = wire.encode(p)
        assert len(data) <= limit
        assert wire.decode(data) == p
    fits = n <= wire.MAX_HANDLES_PER_MESSAGE and documented_size(msg) <= limit
    if fits:
        assert parts == [msg]
        assert parts[0] is msg
    else:
        assert len(parts) >= 2
        # Greedy: each part but the last is full (one more handle would break a limit).
        for part, nxt in itertools.pairwise(parts):
            grown = attrs.evolve(part, handles=(*part.handles, nxt.handles[0]))
            assert (
                len(grown.handles) > wire.MAX_HANDLES_PER_MESSAGE
                or wire.encoded_size(grown) > limit
            )


def test_split_examples_for_every_type() -> None:
    handles = list(range(2, 2 + 2500))
    hb = wire.split(wire.Heartbeat(seq=0, sent_at=0.0, handles=handles))
    assert [len(p.handles) for p in hb] == [1024, 1024, 452]
    acks = wire.split(build(wire.LeaseAck, handles), 1000)  # (1000 - 26) // 8 = 121 per part
    assert [len(p.handles) for p in acks] == [121] * 20 + [80]
    assert all(p.expiry == 30.0 for p in acks)  # type: ignore[union-attr]
    losts = wire.split(build(wire.LeaseLost, handles, lost=wire.LostReason.CLAIMED), 500)
    assert [len(p.handles) for p in losts] == [60] * 41 + [40]  # (500 - 19) // 8 = 60
    assert {p.reason for p in losts} == {wire.LostReason.CLAIMED}  # type: ignore[union-attr]
    dones = wire.split(build(wire.LeaseDone, handles, done=wire.DoneReason.RELEASED), 700)
    assert [len(p.handles) for p in dones] == [85] * 29 + [35]  # (700 - 19) // 8 = 85
    assert {p.reason for p in dones} == {wire.DoneReason.RELEASED}  # type: ignore[union-attr]
    # A limit above MAX_MESSAGE_BYTES changes nothing.
    assert wire.split(build(wire.LeaseAck, handles), 10**9) == wire.split(
        build(wire.LeaseAck, handles), wire.MAX_MESSAGE_BYTES
    )


@pytest.mark.parametrize("cls", KINDS)
def test_split_needs_room_for_one_handle(cls: type[Any]) -> None:
    one = 18 + EXTRA[cls] + 8
    msg = build(cls, [2, 3, 4])
    assert [p.handles for p in wire.split(msg, one)] == [(2,), (3,), (4,)]
    assert [p.handles for p in wire.split(msg, one + 7)] == [(2,), (3,), (4,)]
    assert [p.handles for p in wire.split(msg, one + 8)] == [(2, 3), (4,)]
    assert [p.handles for p in wire.split(msg, one + 15)] == [(2, 3), (4,)]
    assert [p.handles for p in wire.split(msg, one + 16)] == [(2, 3, 4)]
    for too_small in (one - 1, 18, 1):
        with pytest.raises(CodecError, match=f"one handle needs {one} bytes"):
            wire.split(msg, too_small)
        with pytest.raises(CodecError, match=f"one handle needs {one} bytes"):
            wire.split(build(cls, [2]), too_small)


@pytest.mark.parametrize("bad", [0, -1, -(10**9), True, False, 100.0, "100", None, 2.5])
def test_split_bad_max_bytes(bad: object) -> None:
    with pytest.raises(ValueError, match="max_bytes must be a positive int") as info:
        wire.split(wire.Heartbeat(seq=0, sent_at=0.0, handles=[2]), bad)  # type: ignore[arg-type]
    assert not isinstance(info.value, CodecError)


# -- constructors validate ----------------------------------------------------------------------


def kwargs_for(cls: type[Any], **override: Any) -> dict[str, Any]:
    base: dict[str, Any] = {SEQ_FIELD[cls]: 0, TIME_FIELD[cls]: 0.0, "handles": [2]}
    if cls is wire.LeaseAck:
        base["expiry"] = 1.0
    elif cls is wire.LeaseLost:
        base["reason"] = wire.LostReason.UNKNOWN
    elif cls is wire.LeaseDone:
        base["reason"] = wire.DoneReason.READ
    base.update(override)
    return base


BAD_SEQS = [-1, 2**32, 2**64, True, False, 1.0, "1", None]
BAD_TIMES = [math.nan, math.inf, -math.inf, True, "1.0", None, b"1"]
BAD_HANDLES: list[tuple[object, str]] = [
    ([], "needs at least one handle"),
    ((), "needs at least one handle"),
    ([2, 3, 2], "must be distinct"),
    ([0], r"\[2, 2\*\*64\), got 0"),
    ([1], r"\[2, 2\*\*64\), got 1"),
    ([-5], r"\[2, 2\*\*64\), got -5"),
    ([2**64], r"\[2, 2\*\*64\), got 18446744073709551616"),
    ([True], r"\[2, 2\*\*64\), got True"),
    ([2.0], r"\[2, 2\*\*64\), got 2.0"),
    (["2"], r"\[2, 2\*\*64\), got '2'"),
    ([None], r"\[2, 2\*\*64\), got None"),
    ("abc", "not one str"),
    (b"\x02\x03", "not one bytes"),
]


@pytest.mark.parametrize("cls", KINDS)
def test_constructors_validate_seq_and_times(cls: type[Any]) -> None:
    for bad in BAD_SEQS:
        with pytest.raises(ValueError, match=f"{SEQ_FIELD[cls]} must be an int in"):
            cls(**kwargs_for(cls, **{SEQ_FIELD[cls]: bad}))
    time_fields = [TIME_FIELD[cls]] + (["expiry"] if cls is wire.LeaseAck else [])
    for name in time_fields:
        for bad in BAD_TIMES:
            with pytest.raises(ValueError, match=f"{name} must be a finite number"):
                cls(**kwargs_for(cls, **{name: bad}))
    # The boundaries are accepted, ints included.
    ok = cls(**kwargs_for(cls, **{SEQ_FIELD[cls]: 2**32 - 1, TIME_FIELD[cls]: -3}))
    assert wire.decode(wire.encode(ok)) == ok
    assert cls(**kwargs_for(cls, **{SEQ_FIELD[cls]: 0, TIME_FIELD[cls]: 1.7e308}))


@pytest.mark.parametrize("cls", KINDS)
@pytest.mark.parametrize(("handles", "match"), BAD_HANDLES)
def test_constructors_validate_handles(cls: type[Any], handles: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cls(**kwargs_for(cls, handles=handles))


@pytest.mark.parametrize("cls", KINDS)
def test_constructors_accept_handle_iterables_and_bounds(cls: type[Any]) -> None:
    msg = cls(**kwargs_for(cls, handles=iter([U64 - 1, 2, 3])))
    assert msg.handles == (U64 - 1, 2, 3)
    assert isinstance(msg.handles, tuple)
    assert cls(**kwargs_for(cls, handles=range(2, 5))).handles == (2, 3, 4)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        msg.handles = (4,)


@pytest.mark.parametrize(
    ("cls", "bad", "match"),
    [
        (wire.LeaseLost, 1, "reason must be a LostReason, got 1"),
        (wire.LeaseLost, wire.DoneReason.READ, "reason must be a LostReason"),
        (wire.LeaseLost, "UNKNOWN", "reason must be a LostReason"),
        (wire.LeaseLost, None, "reason must be a LostReason"),
        (wire.LeaseDone, 1, "reason must be a DoneReason, got 1"),
        (wire.LeaseDone, wire.LostReason.UNKNOWN, "reason must be a DoneReason"),
        (wire.LeaseDone, True, "reason must be a DoneReason"),
        (wire.LeaseDone, None, "reason must be a DoneReason"),
    ],
)
def test_constructors_validate_reason(cls: type[Any], bad: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cls(**kwargs_for(cls, reason=bad))


# -- inputs that once escaped as other exceptions ------------------------------------------------


def test_released_memoryview_is_a_codec_error() -> None:
    view = memoryview(good_bytes(wire.Heartbeat))
    view.release()
    with pytest.raises(CodecError):
        wire.decode(view)


def test_int_time_too_large_for_f64_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="sent_at must be a finite number"):
        wire.Heartbeat(seq=0, sent_at=10**400, handles=[2])


def test_handles_that_are_not_iterable_are_a_value_error() -> None:
    with pytest.raises(ValueError, match="handles must be a sequence of ints"):
        wire.Heartbeat(seq=0, sent_at=0.0, handles=5)  # type: ignore[arg-type]
