"""The push wire format (``kvframe.core.push``, magic ``b"KP"``): round trips, the documented
layout, the size limit, constructor validation, telling it apart from the heartbeat format,
and fuzzing the decoder (it raises :class:`~kvframe.errors.CodecError` and nothing else)."""

from __future__ import annotations

import string
import struct
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvframe.core import push as pushwire
from kvframe.core import wire
from kvframe.core.push import (
    MAX_PUSH_MESSAGE_BYTES,
    PushRefused,
    PushRegister,
    RefuseReason,
    is_push_message,
)
from kvframe.errors import CodecError

IDENT = st.text(string.ascii_letters + string.digits + "_-", min_size=1, max_size=64)
DIGEST = st.one_of(st.just(""), st.text("0123456789abcdef", min_size=32, max_size=32))
U32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 1, 2**32 - 1]))
GROUPS = st.one_of(
    st.lists(st.lists(U32, max_size=8), min_size=1, max_size=4),
    # up to the group limit (built, not drawn group by group: cheap)
    st.tuples(st.integers(60, 64), st.lists(U32, max_size=2)).map(lambda t: [t[1]] * t[0]),
)
REGISTERS = st.builds(
    PushRegister,
    push_id=IDENT,
    lease_id=IDENT,
    first_block=U32,
    num_tokens=U32,
    prompt_digest=DIGEST,
    groups=GROUPS,
)
REFUSALS = st.builds(PushRefused, lease_id=IDENT, reason=st.sampled_from(RefuseReason))
MESSAGES = st.one_of(REGISTERS, REFUSALS)

# The heartbeat format's messages (kvframe.core.wire), to tell the two apart.
HANDLES = st.lists(st.integers(2, 2**64 - 1), min_size=1, max_size=8, unique=True)
TIMES = st.floats(allow_nan=False, allow_infinity=False)
SEQS = st.integers(0, 2**32 - 1)
WIRE_MESSAGES = st.one_of(
    st.builds(wire.Heartbeat, seq=SEQS, sent_at=TIMES, handles=HANDLES),
    st.builds(wire.LeaseAck, echo_seq=SEQS, holder_now=TIMES, expiry=TIMES, handles=HANDLES),
    st.builds(
        wire.LeaseLost,
        echo_seq=SEQS,
        holder_now=TIMES,
        reason=st.sampled_from(wire.LostReason),
        handles=HANDLES,
    ),
    st.builds(
        wire.LeaseDone,
        seq=SEQS,
        sent_at=TIMES,
        reason=st.sampled_from(wire.DoneReason),
        handles=HANDLES,
    ),
)

DIGEST_A = "0123456789abcdef" * 2


def _text(s: str) -> bytes:
    return bytes((len(s),)) + s.encode("ascii")


def layout_register(m: PushRegister) -> bytes:
    """A registration's bytes as the module docstring lays them out, written independently."""
    out = b"KP" + bytes((1, 1)) + _text(m.push_id) + _text(m.lease_id)
    out += struct.pack(">II", m.first_block, m.num_tokens) + _text(m.prompt_digest)
    out += bytes((len(m.groups),))
    for g in m.groups:
        out += struct.pack(">I", len(g)) + b"".join(struct.pack(">I", b) for b in g)
    return out


def layout_refused(m: PushRefused) -> bytes:
    return b"KP" + bytes((1, 2)) + _text(m.lease_id) + bytes((int(m.reason),))


def header_bytes(push_id: str, lease_id: str, digest: str, groups: int) -> int:
    """Bytes of a registration before its block ids (each block id is 4 more)."""
    return 4 + 1 + len(push_id) + 1 + len(lease_id) + 8 + 1 + len(digest) + 1 + 4 * groups


# -- round trips and layout ---------------------------------------------------------------------
@given(MESSAGES)
@example(
    PushRegister(
        push_id="p", lease_id="L", first_block=0, num_tokens=0, prompt_digest="", groups=[[]]
    )
)
def test_every_valid_message_round_trips(msg: Any) -> None:
    data = pushwire.encode(msg)
    assert isinstance(data, bytes)
    assert len(data) <= MAX_PUSH_MESSAGE_BYTES
    assert is_push_message(data)
    assert pushwire.decode(data) == msg
    assert pushwire.decode(bytearray(data)) == msg
    assert pushwire.decode(memoryview(data)) == msg


@given(REGISTERS)
def test_a_registration_has_the_documented_layout(msg: PushRegister) -> None:
    assert pushwire.encode(msg) == layout_register(msg)


@given(REFUSALS)
def test_a_refusal_has_the_documented_layout(msg: PushRefused) -> None:
    assert pushwire.encode(msg) == layout_refused(msg)


def test_the_reason_bytes_are_the_documented_ones() -> None:
    assert {r.name: int(r) for r in RefuseReason} == {
        "UNKNOWN": 1,
        "ABANDONED": 2,
        "PROMPT": 3,
        "BLOCKS": 4,
        "DUPLICATE": 5,
        "GAVE_UP": 6,
    }
    texts = [r.text() for r in RefuseReason]
    assert all(texts)
    assert len(set(texts)) == len(texts)


# -- the size limit -----------------------------------------------------------------------------
def test_a_registration_of_exactly_the_limit_encodes_and_one_more_block_is_refused() -> None:
    pid, lid = "p" * 64, "L" * 64
    fixed = header_bytes(pid, lid, DIGEST_A, 2)
    n = (MAX_PUSH_MESSAGE_BYTES - fixed) // 4
    assert fixed + 4 * n == MAX_PUSH_MESSAGE_BYTES  # the fields above fill it exactly

    def reg(blocks: int) -> PushRegister:
        return PushRegister(
            push_id=pid,
            lease_id=lid,
            first_block=0,
            num_tokens=7,
            prompt_digest=DIGEST_A,
            groups=[list(range(blocks // 2)), list(range(blocks - blocks // 2))],
        )

    data = pushwire.encode(reg(n))
    assert len(data) == MAX_PUSH_MESSAGE_BYTES
    assert pushwire.decode(data) == reg(n)
    with pytest.raises(CodecError, match=r"registration of \d+ blocks is 16388 bytes"):
        pushwire.encode(reg(n + 1))


def test_an_oversize_registration_is_refused_naming_the_block_count() -> None:
    msg = PushRegister(
        push_id="p",
        lease_id="L",
        first_block=0,
        num_tokens=1,
        prompt_digest="",
        groups=[list(range(5000))],
    )
    with pytest.raises(CodecError, match="5000 blocks") as err:
        pushwire.encode(msg)
    assert "16384" in str(err.value)


@given(extra=st.integers(1, 64))
def test_decode_refuses_input_over_the_limit(extra: int) -> None:
    valid = pushwire.encode(PushRefused(lease_id="L", reason=RefuseReason.UNKNOWN))
    data = valid + b"\0" * (MAX_PUSH_MESSAGE_BYTES - len(valid) + extra)
    with pytest.raises(CodecError, match="limit"):
        pushwire.decode(data)


def test_a_group_claiming_more_blocks_than_fit_is_refused_before_reading_them() -> None:
    data = b"KP\x01\x01" + _text("p") + _text("L") + struct.pack(">II", 0, 1) + _text("")
    data += b"\x01" + struct.pack(">I", 2**32 - 1)
    with pytest.raises(CodecError, match="claims 4294967295 blocks"):
        pushwire.decode(data)


# -- malformed input ----------------------------------------------------------------------------
def _reg_bytes(**over: Any) -> bytes:
    fields: dict[str, Any] = {
        "push_id": "p1",
        "lease_id": "L1",
        "first_block": 0,
        "num_tokens": 5,
        "prompt_digest": DIGEST_A,
        "groups": [[1, 2]],
    }
    fields.update(over)
    return pushwire.encode(PushRegister(**fields))


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "magic"),
        (b"K", "magic"),
        (b"XP\x01\x02\x01L\x01", "bad magic"),
        (b"KP\x02\x02\x01L\x01", "version 2"),
        (b"KP\x01\x03\x01L\x01", "unknown push message type 3"),
        (b"KP\x01\x02\x01L\x07", "unknown refusal reason byte 7"),
        (b"KP\x01\x02\x01L\x00", "unknown refusal reason byte 0"),
        (b"KP\x01\x02\x01\xff\x01", "not ASCII"),
        (b"KP\x01\x02\x01!\x01", "malformed push message: lease_id"),
        (b"KP\x01\x02\x00\x01", "malformed push message: lease_id"),
        (b"KP\x01\x02\x01L\x01\x00", "1 trailing bytes"),
        (b"KP\x01\x02\x01L", "truncated push message: reason"),
        (_reg_bytes()[:-1], "truncated"),
        (_reg_bytes() + b"\x00\x00", "2 trailing bytes"),
        # a group count of zero, and of 65
        (_reg_bytes(groups=[[]])[:-5] + b"\x00", "1..64 groups, got 0"),
        (_reg_bytes(groups=[[]] * 64)[: -64 * 4 - 1] + b"\x41" + b"\0" * 65 * 4, "got 65"),
        # a prompt digest of the wrong length or alphabet
        (_reg_bytes(prompt_digest="").replace(b"\x00\x01", b"\x01x\x01", 1), "prompt_digest"),
    ],
)
def test_malformed_messages_are_refused_naming_what_is_wrong(data: bytes, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        pushwire.decode(data)


@pytest.mark.parametrize("data", [None, "KP", 7, [1, 2], object()])
def test_decode_refuses_what_is_not_bytes(data: Any) -> None:
    with pytest.raises(CodecError, match="expected bytes"):
        pushwire.decode(data)


def _decodes_only_to_itself(data: bytes) -> None:
    """``decode`` either raises CodecError or returns a message that encodes to ``data``
    (the format has one encoding per message)."""
    try:
        msg = pushwire.decode(data)
    except CodecError:
        return
    assert pushwire.encode(msg) == bytes(data)


@given(st.binary(max_size=300))
@example(b"KP\x01\x01")
@example(b"KP\x01\x02")
def test_random_bytes_decode_or_raise_codec_error(data: bytes) -> None:
    _decodes_only_to_itself(data)


@given(st.binary(min_size=2, max_size=300).map(lambda b: b"KP\x01" + b[:1] + b[1:]))
def test_random_bytes_behind_a_valid_header_decode_or_raise_codec_error(data: bytes) -> None:
    _decodes_only_to_itself(data)


@given(MESSAGES, st.data())
def test_every_truncation_of_a_valid_message_is_refused(msg: Any, data: st.DataObject) -> None:
    full = pushwire.encode(msg)
    cut = data.draw(st.integers(0, len(full) - 1), label="length")
    with pytest.raises(CodecError):
        pushwire.decode(full[:cut])


@given(MESSAGES, st.binary(min_size=1, max_size=40))
def test_trailing_bytes_after_a_valid_message_are_refused(msg: Any, tail: bytes) -> None:
    with pytest.raises(CodecError, match="trailing bytes"):
        pushwire.decode(pushwire.encode(msg) + tail)


@given(
    MESSAGES,
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
)
def test_mutations_of_a_valid_message_decode_or_raise_codec_error(
    msg: Any, edits: list[tuple[int, int]]
) -> None:
    data = bytearray(pushwire.encode(msg))
    for pos, value in edits:
        data[pos % len(data)] = value
    _decodes_only_to_itself(bytes(data))


@given(MESSAGES, st.integers(0, 10_000), st.binary(min_size=1, max_size=8))
def test_insertions_into_a_valid_message_decode_or_raise_codec_error(
    msg: Any, pos: int, extra: bytes
) -> None:
    data = pushwire.encode(msg)
    at = pos % (len(data) + 1)
    _decodes_only_to_itself(data[:at] + extra + data[at:])


# -- telling the formats apart ------------------------------------------------------------------
@given(WIRE_MESSAGES)
def test_heartbeat_messages_are_not_push_messages(msg: wire.Message) -> None:
    data = wire.encode(msg)
    assert not is_push_message(data)
    with pytest.raises(CodecError, match="bad magic"):
        pushwire.decode(data)


@given(MESSAGES)
def test_push_messages_are_not_heartbeat_messages(msg: Any) -> None:
    data = pushwire.encode(msg)
    assert is_push_message(data)
    assert is_push_message(memoryview(data))
    assert is_push_message(bytearray(data))
    with pytest.raises(CodecError):
        wire.decode(data)


@pytest.mark.parametrize("data", [b"", b"K", b"PK", b"kp", b"KQ\x01\x02"])
def test_short_or_other_magic_is_not_a_push_message(data: bytes) -> None:
    assert not is_push_message(data)


# -- constructor validation ---------------------------------------------------------------------
GOOD: dict[str, Any] = {
    "push_id": "p",
    "lease_id": "L",
    "first_block": 0,
    "num_tokens": 1,
    "prompt_digest": "",
    "groups": [[0]],
}


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("push_id", "", "push_id"),
        ("push_id", "x" * 65, "push_id"),
        ("push_id", "a b", "push_id"),
        ("push_id", "é", "push_id"),
        ("push_id", 7, "push_id"),
        ("lease_id", "", "lease_id"),
        ("lease_id", "L/1", "lease_id"),
        ("first_block", -1, "first_block"),
        ("first_block", 2**32, "first_block"),
        ("first_block", True, "first_block"),
        ("num_tokens", 1.0, "num_tokens"),
        ("prompt_digest", "0" * 31, "prompt_digest"),
        ("prompt_digest", "A" * 32, "prompt_digest"),
        ("prompt_digest", "0" * 64, "prompt_digest"),
        ("groups", [], "1..64 groups"),
        ("groups", [[0]] * 65, "1..64 groups"),
        ("groups", [[-1]], "block ids"),
        ("groups", [[2**32]], "block ids"),
        ("groups", [[True]], "block ids"),
        ("groups", "abc", "sequence"),
    ],
)
def test_a_registration_with_a_field_out_of_range_is_refused(
    field: str, value: Any, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        PushRegister(**{**GOOD, field: value})


def test_a_refusal_with_a_bad_field_is_refused() -> None:
    with pytest.raises(ValueError, match="lease_id"):
        PushRefused(lease_id="", reason=RefuseReason.UNKNOWN)
    with pytest.raises(ValueError, match="99"):
        PushRefused(lease_id="L", reason=99)
    assert PushRefused(lease_id="L", reason=3).reason is RefuseReason.PROMPT


def test_groups_are_kept_as_tuples() -> None:
    reg = PushRegister(**{**GOOD, "groups": [[1, 2], [3]]})
    assert reg.groups == ((1, 2), (3,))
    assert hash(reg) == hash(PushRegister(**{**GOOD, "groups": ((1, 2), (3,))}))
