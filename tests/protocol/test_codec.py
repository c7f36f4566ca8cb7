"""The codec: round trips, the envelope, the type registry, and totality of decoding."""

from __future__ import annotations

import enum
import struct
from collections.abc import Mapping
from typing import Any

import attrs
import msgpack
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvframe.errors import CodecError, UnknownMessageTypeError, UnsupportedVersionError
from kvframe.protocol.codec import (
    DEFAULT_CODEC,
    MAGIC,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    Codec,
)
from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput, LoadSpec

from .strategies import load_specs, metadata, outputs


@attrs.frozen(kw_only=True)
class CustomMeta(ConnectorMetadata):
    """A connector's own metadata, as a plugin would define it."""

    tokens: tuple[int, ...] = ()
    note: str | None = None
    ratio: float = 0.0
    by_peer: Mapping[str, LoadSpec] = attrs.field(factory=dict)
    flags: frozenset[str] = frozenset()
    blob: bytes = b""


CUSTOM = DEFAULT_CODEC.with_types({"tests.custom": CustomMeta})

custom_metas = st.builds(
    CustomMeta,
    step=st.integers(0, 100),
    tokens=st.lists(st.integers(0, 2**32)).map(tuple),
    note=st.none() | st.text(max_size=8),
    ratio=st.floats(allow_nan=False),
    by_peer=st.dictionaries(st.text(max_size=5), load_specs(), max_size=2),
    flags=st.frozensets(st.text(max_size=5), max_size=3),
    blob=st.binary(max_size=16),
)
messages = metadata | outputs | custom_metas


@given(messages)
def test_every_message_type_round_trips(msg: Any) -> None:
    data = CUSTOM.encode(msg)
    back = CUSTOM.decode(data)
    assert type(back) is type(msg)
    assert back == msg
    # Encoding is deterministic: equal values (sets included) give equal bytes.
    assert CUSTOM.encode(back) == data


@given(metadata | outputs)
def test_default_codec_round_trips_builtins(msg: Any) -> None:
    assert DEFAULT_CODEC.decode(DEFAULT_CODEC.encode(msg)) == msg


def test_envelope_layout() -> None:
    data = DEFAULT_CODEC.encode(ConnectorMetadata(step=7))
    tag = b"kvframe.metadata"
    assert data[:4] == MAGIC == b"KVFM"
    assert struct.unpack(">H", data[4:6]) == (PROTOCOL_VERSION,)
    assert data[6] == len(tag)
    assert data[7 : 7 + len(tag)] == tag
    body = msgpack.unpackb(data[7 + len(tag) :])
    assert body["step"] == 7
    assert set(body) == {f.name for f in attrs.fields(ConnectorMetadata)}


def _with_header(body: bytes, *, tag: bytes = b"kvframe.output", version: int = 1) -> bytes:
    return struct.pack(">4sHB", MAGIC, version, len(tag)) + tag + body


def test_unknown_tag_raises_unknown_message_type() -> None:
    data = CUSTOM.encode(CustomMeta(step=1))
    with pytest.raises(UnknownMessageTypeError, match=r"tests\.custom"):
        DEFAULT_CODEC.decode(data)


@pytest.mark.parametrize("version", [0, 2, 65535])
def test_unsupported_version(version: int) -> None:
    assert version not in SUPPORTED_VERSIONS
    data = _with_header(msgpack.packb({}), version=version)
    with pytest.raises(UnsupportedVersionError, match=f"protocol version {version}"):
        DEFAULT_CODEC.decode(data)


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (b"", "shorter than the 7-byte header"),
        (b"KVF", "shorter"),
        (b"JSON\x00\x01\x01x{}", "bad magic"),
        (struct.pack(">4sHB", MAGIC, 1, 0), "empty type tag"),
        (struct.pack(">4sHB", MAGIC, 1, 9) + b"kv", "truncated"),
        (_with_header(b"", tag=b"kvframe.output"), "not valid msgpack"),
        (_with_header(msgpack.packb({}) + b"\x00"), "not valid msgpack"),
        (_with_header(msgpack.packb([1, 2])), "expected a map"),
        (_with_header(msgpack.packb({"nope": 1})), "has no field 'nope'"),
        (_with_header(msgpack.packb({"finished_sending": "abc"})), "expected an array"),
        (_with_header(msgpack.packb({"finished_sending": [1]})), "expected str"),
        (_with_header(msgpack.packb({"invalid_block_ids": [-1]})), "non-negative"),
        (_with_header(msgpack.packb({"invalid_block_ids": [1, True]})), r"\[1\]: expected int"),
        (_with_header(msgpack.packb({"stats": {"counters": {"x": -1}}})), "never go negative"),
        (
            _with_header(msgpack.packb({"events": [{"kind": "k", "data": {"a": {1: 2}}}]})),
            "msgpack",
        ),
        (_with_header(msgpack.packb({"failures": {"r": msgpack.ExtType(3, b"x")}})), "ext"),
        (
            _with_header(
                msgpack.packb(
                    {"loads": [{"request_id": "r", "local_block_ids": [[1, 2]]}]},
                ),
                tag=b"kvframe.metadata",
            ),
            "not a valid LoadSpec",
        ),
    ],
)
def test_malformed_input_raises_codec_error(data: bytes, fragment: str) -> None:
    with pytest.raises(CodecError, match=fragment):
        DEFAULT_CODEC.decode(data)


def test_oversized_input_is_rejected_unread() -> None:
    small = Codec(max_message_bytes=64)
    with pytest.raises(CodecError, match="over the limit of 64"):
        small.decode(b"\x00" * 65)
    with pytest.raises(ValueError, match="over the limit"):
        small.encode(ConnectorMetadata(extra={"x": "y" * 100}))


def _decode_only_codec_errors(codec: Codec, data: bytes) -> None:
    """Decoding either raises a CodecError or yields a valid message (one that re-encodes);
    any other exception fails the test."""
    try:
        msg = codec.decode(data)
    except CodecError:
        return
    assert type(msg) in codec.tags.values()
    # Compared as bytes: a mutated float may be NaN, which is not equal to itself.
    again = codec.encode(msg)
    assert codec.encode(codec.decode(again)) == again


@given(st.binary(max_size=256))
def test_arbitrary_bytes_raise_only_codec_errors(data: bytes) -> None:
    _decode_only_codec_errors(CUSTOM, data)
    _decode_only_codec_errors(CUSTOM, MAGIC + data)
    _decode_only_codec_errors(CUSTOM, _with_header(data))
    _decode_only_codec_errors(CUSTOM, _with_header(data, tag=b"tests.custom"))


msgpack_values: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=6)
    | st.binary(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=6) | st.binary(max_size=3), inner, max_size=4)
    ),
    max_leaves=16,
)
field_names = st.sampled_from(
    sorted(
        {f.name for c in (ConnectorMetadata, ConnectorOutput, CustomMeta) for f in attrs.fields(c)}
    )
)


@given(
    st.sampled_from([b"kvframe.metadata", b"kvframe.output", b"tests.custom"]),
    st.dictionaries(field_names, msgpack_values, max_size=4),
)
def test_well_formed_msgpack_of_wrong_shape_raises_only_codec_errors(
    tag: bytes, body: dict[str, Any]
) -> None:
    _decode_only_codec_errors(CUSTOM, _with_header(msgpack.packb(body), tag=tag))


@given(messages, st.data())
@example(ConnectorMetadata(step=1), None)
def test_mutated_encodings_raise_only_codec_errors(msg: Any, data: st.DataObject | None) -> None:
    raw = bytearray(CUSTOM.encode(msg))
    if data is None:
        mutated = bytes(raw[:-1])
    else:
        kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "delete", "append"]))
        pos = data.draw(st.integers(0, len(raw) - 1))
        if kind == "flip":
            raw[pos] ^= data.draw(st.integers(1, 255))
        elif kind == "truncate":
            del raw[pos:]
        elif kind == "insert":
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=4))
        elif kind == "delete":
            del raw[pos : pos + data.draw(st.integers(1, 4))]
        else:
            raw += data.draw(st.binary(min_size=1, max_size=4))
        mutated = bytes(raw)
    _decode_only_codec_errors(CUSTOM, mutated)


def test_trailing_bytes_are_refused() -> None:
    data = DEFAULT_CODEC.encode(ConnectorOutput())
    with pytest.raises(CodecError, match="not valid msgpack"):
        DEFAULT_CODEC.decode(data + b"\xc0")


def test_deep_nesting_is_a_codec_error() -> None:
    body = b"\x81\xa5extra\x81\xa1k" + b"\x91" * 5000 + b"\xc0"
    with pytest.raises(CodecError):
        DEFAULT_CODEC.decode(_with_header(body, tag=b"kvframe.metadata"))


# -- the registry --------------------------------------------------------------------------


def test_with_types_returns_a_new_codec_and_leaves_the_default_alone() -> None:
    assert "tests.custom" in CUSTOM.tags
    assert "tests.custom" not in DEFAULT_CODEC.tags
    assert set(DEFAULT_CODEC.tags) == {"kvframe.metadata", "kvframe.output"}
    with pytest.raises(TypeError, match="not registered"):
        DEFAULT_CODEC.encode(CustomMeta())


def test_with_types_keeps_earlier_registrations() -> None:
    @attrs.frozen(kw_only=True)
    class Other(ConnectorMetadata):
        x: int = 0

    both = CUSTOM.with_types({"tests.other": Other})
    assert both.decode(both.encode(Other(x=3))) == Other(x=3)
    assert both.decode(both.encode(CustomMeta(step=2))) == CustomMeta(step=2)


@pytest.mark.parametrize(
    ("tag", "cls", "error", "fragment"),
    [
        ("tests.custom", ConnectorMetadata, ValueError, "already registered"),
        ("tests.again", CustomMeta, ValueError, "already registered under tag 'tests.custom'"),
        ("kvframe.mine", attrs.make_class("M", {"a": attrs.field()}), ValueError, "reserved"),
        ("nodots", CustomMeta, ValueError, "dotted lowercase"),
        ("Tests.Upper", CustomMeta, ValueError, "dotted lowercase"),
        ("tests." + "x" * 64, CustomMeta, ValueError, "at most 64"),
        ("tests.plain", dict, TypeError, "not an attrs class"),
    ],
)
def test_with_types_rejects_bad_registrations(
    tag: str, cls: type, error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        CUSTOM.with_types({tag: cls})


def test_unsupported_field_types_are_refused_at_registration() -> None:
    @attrs.frozen
    class Bad:
        when: set[int]

    with pytest.raises(TypeError, match=r"Bad\.when.*cannot carry"):
        DEFAULT_CODEC.with_types({"tests.bad": Bad})


def test_recursive_types_are_refused() -> None:
    @attrs.frozen
    class Node:
        child: Node | None

    with pytest.raises(TypeError, match="recursive"):
        DEFAULT_CODEC.with_types({"tests.node": Node})


def test_encoding_a_wrongly_typed_field_names_it() -> None:
    msg = attrs.evolve(CustomMeta(), note=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"CustomMeta\.note = 3"):
        CUSTOM.encode(msg)


def test_decode_as_checks_the_type() -> None:
    data = DEFAULT_CODEC.encode(ConnectorOutput())
    assert DEFAULT_CODEC.decode_as(data, ConnectorOutput) == ConnectorOutput()
    with pytest.raises(CodecError, match="expected a ConnectorMetadata, got a ConnectorOutput"):
        DEFAULT_CODEC.decode_as(data, ConnectorMetadata)


def test_decode_refuses_non_bytes() -> None:
    with pytest.raises(TypeError, match="takes bytes"):
        DEFAULT_CODEC.decode("KVFM")  # type: ignore[arg-type]


def test_decoded_values_are_read_only() -> None:
    msg = ConnectorMetadata(extra={"a": [1, {"b": 2}], "m": {"p": ["r"]}})
    back = DEFAULT_CODEC.decode_as(DEFAULT_CODEC.encode(msg), ConnectorMetadata)
    assert back.extra["a"] == (1, {"b": 2})
    with pytest.raises(TypeError):
        back.extra["a"][1]["b"] = 3  # type: ignore[index]
    with pytest.raises(TypeError):
        back.extra["m"]["q"] = ()  # type: ignore[index]


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


@attrs.frozen(kw_only=True)
class Painted(ConnectorMetadata):
    colour: Colour = Colour.RED
    level: Level | None = None
    palette: tuple[Colour, ...] = ()


PAINTED = DEFAULT_CODEC.with_types({"tests.painted": Painted})


@given(
    st.builds(
        Painted,
        colour=st.sampled_from(Colour),
        level=st.none() | st.sampled_from(Level),
        palette=st.lists(st.sampled_from(Colour), max_size=3).map(tuple),
    )
)
def test_enums_travel_as_their_values(msg: Painted) -> None:
    back = PAINTED.decode_as(PAINTED.encode(msg), Painted)
    assert back == msg
    assert type(back.colour) is Colour
    assert back.level is None or type(back.level) is Level


def test_an_enum_value_the_class_does_not_have_is_a_codec_error() -> None:
    data = PAINTED.encode(Painted())
    body = msgpack.unpackb(data[7 + len(b"tests.painted") :])
    body["colour"] = "green"
    bad = data[: 7 + len(b"tests.painted")] + msgpack.packb(body)
    with pytest.raises(CodecError, match=r"'green' is not a Colour \(one of \['blue', 'red'\]\)"):
        PAINTED.decode(bad)
    body["colour"] = 1  # the right kind matters too: an int is not a str-valued member
    with pytest.raises(CodecError, match="is not a Colour"):
        PAINTED.decode(data[: 7 + len(b"tests.painted")] + msgpack.packb(body))


class Mixed(enum.Enum):
    A = "a"
    B = 2


@attrs.frozen
class MixedHolder:
    m: Mixed


def test_enums_of_mixed_or_other_values_are_refused_at_registration() -> None:
    with pytest.raises(TypeError, match=r"MixedHolder\.m: the codec carries enums whose values"):
        DEFAULT_CODEC.with_types({"tests.bad": MixedHolder})


def test_encoding_a_non_member_names_the_field() -> None:
    with pytest.raises(TypeError, match=r"Painted\.colour = 'red'; expected a Colour"):
        PAINTED.encode(attrs.evolve(Painted(), colour="red"))  # type: ignore[arg-type]
