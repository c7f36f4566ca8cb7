"""The heartbeat wire format: round trips, limits, splitting, and fuzzing every decoder."""

from __future__ import annotations

import itertools
import math
import struct

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvframe.core import wire
from kvframe.errors import CodecError, UnknownMessageTypeError, UnsupportedVersionError

REQUEST_ID = st.text(
    alphabet=st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=80
).filter(lambda s: len(s.encode("utf-8")) <= wire.MAX_ID_BYTES)
IDS = st.lists(REQUEST_ID, min_size=1, max_size=60, unique=True)
SEQ = st.integers(0, 2**32 - 1)
TIME = st.floats(allow_nan=False, allow_infinity=False)

HEARTBEATS = st.builds(wire.Heartbeat, seq=SEQ, sent_at=TIME, request_ids=IDS)
ACKS = st.builds(
    wire.LeaseAck,
    echo_seq=SEQ,
    holder_now=TIME,
    expiries=IDS.flatmap(lambda ids: st.tuples(*[st.tuples(st.just(i), TIME) for i in ids])),
)
LOSTS = st.builds(
    wire.LeaseLost,
    echo_seq=SEQ,
    holder_now=TIME,
    lost=IDS.flatmap(
        lambda ids: st.tuples(
            *[st.tuples(st.just(i), st.sampled_from(wire.LostReason)) for i in ids]
        )
    ),
)
DONES = st.builds(
    wire.LeaseDone,
    seq=SEQ,
    sent_at=TIME,
    done=IDS.flatmap(
        lambda ids: st.tuples(
            *[st.tuples(st.just(i), st.sampled_from(wire.DoneReason)) for i in ids]
        )
    ),
)
MESSAGES = st.one_of(HEARTBEATS, ACKS, LOSTS, DONES)


@given(MESSAGES)
def test_round_trip(msg: wire.Message) -> None:
    data = wire.encode(msg)
    assert len(data) == wire.encoded_size(msg)
    back = wire.decode(data)
    assert back == msg
    assert wire.encode(back) == data  # canonical
    assert wire.decode(bytearray(data)) == msg
    assert wire.decode(memoryview(data)) == msg


@given(st.integers(1, 255), st.integers(1, 100))
def test_heartbeat_costs_len_plus_one_byte_per_id(length: int, n: int) -> None:
    n = min(n, (wire.MAX_MESSAGE_BYTES - wire.HEADER_BYTES) // (length + 1))
    ids = list(dict.fromkeys(f"{i:x}".rjust(length, "-")[-length:] for i in range(n)))
    msg = wire.Heartbeat(seq=1, sent_at=1.0, request_ids=ids)
    assert len(wire.encode(msg)) == wire.HEADER_BYTES + len(ids) * (length + 1)


def test_layout_is_as_documented() -> None:
    data = wire.encode(wire.Heartbeat(seq=7, sent_at=2.5, request_ids=["ab", "c"]))
    assert data == b"KH\x01\x01" + struct.pack(">IdH", 7, 2.5, 2) + b"\x02ab\x01c"
    ack = wire.encode(wire.LeaseAck(echo_seq=7, holder_now=3.0, expiries=[("ab", 23.0)]))
    assert ack == b"KH\x01\x02" + struct.pack(">IdH", 7, 3.0, 1) + b"\x02ab" + struct.pack(
        ">d", 23.0
    )
    lost = wire.encode(
        wire.LeaseLost(echo_seq=7, holder_now=3.0, lost=[("ab", wire.LostReason.EXPIRED)])
    )
    assert lost == b"KH\x01\x03" + struct.pack(">IdH", 7, 3.0, 1) + b"\x02ab\x04"
    done = wire.encode(wire.LeaseDone(seq=8, sent_at=4.0, done=[("ab", wire.DoneReason.READ)]))
    assert done == b"KH\x01\x04" + struct.pack(">IdH", 8, 4.0, 1) + b"\x02ab\x01"


# -- fuzzing: arbitrary bytes raise only CodecError ---------------------------------------------


def decode_or_codec_error(data: bytes) -> wire.Message | None:
    try:
        return wire.decode(data)
    except CodecError:
        return None


@given(st.binary(max_size=400))
@example(b"")
@example(b"KH")
@example(b"KH\x01\x01")
@example(b"KH\x01\x01" + b"\x00" * 14)
def test_arbitrary_bytes(data: bytes) -> None:
    decode_or_codec_error(data)


@given(st.sampled_from([t.value for t in wire.MessageType]), st.binary(max_size=300))
def test_arbitrary_bodies_behind_a_valid_header(mtype: int, body: bytes) -> None:
    msg = decode_or_codec_error(b"KH\x01" + bytes([mtype]) + body)
    if msg is not None:
        assert wire.encode(msg) == b"KH\x01" + bytes([mtype]) + body


@given(MESSAGES, st.data())
def test_mutated_messages(msg: wire.Message, data: st.DataObject) -> None:
    raw = bytearray(wire.encode(msg))
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
    decode_or_codec_error(bytes(raw))


def test_precise_decode_errors() -> None:
    good = wire.encode(wire.Heartbeat(seq=1, sent_at=1.0, request_ids=["a"]))
    with pytest.raises(UnsupportedVersionError, match="version 2"):
        wire.decode(good[:2] + b"\x02" + good[3:])
    with pytest.raises(UnknownMessageTypeError, match="type 9"):
        wire.decode(good[:3] + b"\x09" + good[4:])
    cases = {
        "bad magic": b"XX" + good[2:],
        "truncated": good[:-1],
        "trailing": good + b"\x00",
        "entry count 0": good[:16] + b"\x00\x00",
        "empty request id": good[:18] + b"\x00",
        "not valid UTF-8": good[:18] + b"\x01\xff",
        "not finite": good[:8] + struct.pack(">d", math.nan) + good[16:],
        "repeated": good[:16] + b"\x00\x02\x01a\x01a",
        "limit is": good + b"\x00" * wire.MAX_MESSAGE_BYTES,
        "expected bytes": "KH",
    }
    for what, data in cases.items():
        with pytest.raises(CodecError, match=what):
            wire.decode(data)  # type: ignore[arg-type]
    lost = bytearray(
        wire.encode(
            wire.LeaseLost(echo_seq=1, holder_now=1.0, lost=[("a", wire.LostReason.UNKNOWN)])
        )
    )
    lost[-1] = 9
    with pytest.raises(CodecError, match="reason byte 9"):
        wire.decode(bytes(lost))
    done = bytearray(
        wire.encode(wire.LeaseDone(seq=1, sent_at=1.0, done=[("a", wire.DoneReason.RELEASED)]))
    )
    done[-1] = 3
    with pytest.raises(CodecError, match="reason byte 3"):
        wire.decode(bytes(done))
    ack = bytearray(wire.encode(wire.LeaseAck(echo_seq=1, holder_now=1.0, expiries=[("a", 1.0)])))
    ack[-8:] = struct.pack(">d", math.inf)
    with pytest.raises(CodecError, match="expiry is not finite"):
        wire.decode(bytes(ack))


# -- limits and splitting -----------------------------------------------------------------------


def test_encode_refuses_oversized_input_and_points_to_split() -> None:
    with pytest.raises(CodecError, match=r"256 UTF-8 bytes.*at most 255"):
        wire.encode(wire.Heartbeat(seq=1, sent_at=0.0, request_ids=["x" * 256]))
    many = [f"r{i}" for i in range(wire.MAX_IDS_PER_MESSAGE + 1)]
    with pytest.raises(CodecError, match=r"1025 entries.*split\(\)"):
        wire.encode(wire.Heartbeat(seq=1, sent_at=0.0, request_ids=many))
    big = [f"{i:0200d}" for i in range(100)]
    with pytest.raises(CodecError, match=r"bytes; the limit is 16384.*split\(\)"):
        wire.encode(wire.Heartbeat(seq=1, sent_at=0.0, request_ids=big))
    with pytest.raises(TypeError, match="not a wire message"):
        wire.encode("hello")  # type: ignore[arg-type]


@given(
    st.lists(REQUEST_ID, min_size=1, max_size=400, unique=True),
    st.integers(min_value=18 + 256, max_value=20_000),
)
def test_split_preserves_entries_and_fits(ids: list[str], max_bytes: int) -> None:
    msg = wire.Heartbeat(seq=3, sent_at=9.0, request_ids=ids)
    parts = wire.split(msg, max_bytes)
    assert [rid for p in parts for rid in p.request_ids] == ids  # type: ignore[union-attr]
    for p in parts:
        assert isinstance(p, wire.Heartbeat)
        assert (p.seq, p.sent_at) == (3, 9.0)
        data = wire.encode(p)
        assert len(data) <= min(max_bytes, wire.MAX_MESSAGE_BYTES)
    if len(parts) == 1:
        assert parts[0] is msg
    else:  # greedy: each part but the last was full (the next id would not have fitted)
        for part, nxt in itertools.pairwise(parts):
            grown = wire.Heartbeat(
                seq=3,
                sent_at=9.0,
                request_ids=(*part.request_ids, nxt.request_ids[0]),  # type: ignore[union-attr]
            )
            assert wire.encoded_size(grown) > min(max_bytes, wire.MAX_MESSAGE_BYTES)


def test_split_respects_the_id_count_limit_and_every_type() -> None:
    ids = [f"r{i}" for i in range(2500)]
    parts = wire.split(wire.Heartbeat(seq=0, sent_at=0.0, request_ids=ids))
    assert [len(p.request_ids) for p in parts] == [1024, 1024, 452]  # type: ignore[union-attr]
    acks = wire.split(
        wire.LeaseAck(echo_seq=0, holder_now=0.0, expiries=[(i, 1.0) for i in ids]), 1000
    )
    assert all(len(wire.encode(a)) <= 1000 for a in acks)
    assert sum(len(a.expiries) for a in acks) == 2500  # type: ignore[union-attr]
    losts = wire.split(
        wire.LeaseLost(echo_seq=0, holder_now=0.0, lost=[(i, wire.LostReason(1)) for i in ids]),
        500,
    )
    assert sum(len(x.lost) for x in losts) == 2500  # type: ignore[union-attr]
    dones = wire.split(
        wire.LeaseDone(seq=0, sent_at=0.0, done=[(i, wire.DoneReason.READ) for i in ids]), 700
    )
    assert all(isinstance(d, wire.LeaseDone) and d.seq == 0 for d in dones)
    assert sum(len(d.done) for d in dones) == 2500  # type: ignore[union-attr]
    with pytest.raises(CodecError, match="alone"):
        wire.split(wire.Heartbeat(seq=0, sent_at=0.0, request_ids=["x" * 100]), 100)
    with pytest.raises(ValueError, match="max_bytes"):
        wire.split(wire.Heartbeat(seq=0, sent_at=0.0, request_ids=["x"]), 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq": -1, "sent_at": 0.0, "request_ids": ["a"]}, "seq"),
        ({"seq": 2**32, "sent_at": 0.0, "request_ids": ["a"]}, "seq"),
        ({"seq": True, "sent_at": 0.0, "request_ids": ["a"]}, "seq"),
        ({"seq": 0, "sent_at": math.nan, "request_ids": ["a"]}, "sent_at"),
        ({"seq": 0, "sent_at": 0.0, "request_ids": []}, "at least one"),
        ({"seq": 0, "sent_at": 0.0, "request_ids": ["a", "a"]}, "distinct"),
        ({"seq": 0, "sent_at": 0.0, "request_ids": [""]}, "non-empty"),
        ({"seq": 0, "sent_at": 0.0, "request_ids": [b"a"]}, "non-empty str"),
        ({"seq": 0, "sent_at": 0.0, "request_ids": "abc"}, "not one str"),
    ],
)
def test_message_values_validate(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        wire.Heartbeat(**kwargs)  # type: ignore[arg-type]


def test_ack_and_lost_values_validate() -> None:
    with pytest.raises(ValueError, match="expiry of 'a' must be finite"):
        wire.LeaseAck(echo_seq=0, holder_now=0.0, expiries=[("a", math.inf)])
    with pytest.raises(ValueError, match="must be a number"):
        wire.LeaseAck(echo_seq=0, holder_now=0.0, expiries=[("a", "1")])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="LostReason"):
        wire.LeaseLost(echo_seq=0, holder_now=0.0, lost=[("a", 1)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="DoneReason"):
        wire.LeaseDone(seq=0, sent_at=0.0, done=[("a", 1)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="distinct"):
        wire.LeaseDone(seq=0, sent_at=0.0, done=[("a", wire.DoneReason.READ)] * 2)
