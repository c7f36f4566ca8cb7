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

from kvframe.config import KVTransferConfig
from kvframe.connectors.pd import PDConnector
from kvframe.connectors.pd.metadata import PDLoad, PDMetadata, RemoteEngineAddr
from kvframe.errors import CodecError, UnknownMessageTypeError, UnsupportedVersionError
from kvframe.protocol.codec import (
    DEFAULT_CODEC,
    MAGIC,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    Codec,
    type_checked,
)
from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput, FrozenDict, LoadSpec
from kvframe.spi.connector import codec_for

from .strategies import ids, load_specs, metadata, outputs


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
    assert data[: 11 + len(tag)] == DEFAULT_CODEC.envelope(tag.decode(), b"")
    body = msgpack.unpackb(data[11 + len(tag) :])
    assert body["step"] == 7
    assert set(body) == {f.name for f in attrs.fields(ConnectorMetadata)}


def _with_header(
    body: bytes, *, tag: bytes = b"kvframe.output", version: int = PROTOCOL_VERSION
) -> bytes:
    """``body`` in an envelope written by hand (the tag's layout checksum where it has one)."""
    try:
        layout = CUSTOM.envelope(tag.decode(), b"")[-4:]
    except (KeyError, UnicodeDecodeError):
        layout = b"\x00" * 4
    return struct.pack(">4sHB", MAGIC, version, len(tag)) + tag + layout + body


def test_a_sender_with_another_layout_is_refused() -> None:
    @attrs.frozen(kw_only=True)
    class CustomMeta(ConnectorMetadata):  # the same name and tag, one more field
        tokens: tuple[int, ...] = ()
        more: int = 0

    other = DEFAULT_CODEC.with_types({"tests.custom": CustomMeta})
    with pytest.raises(CodecError, match="has another layout"):
        CUSTOM.decode(other.encode(CustomMeta()))


def test_version_1_messages_are_refused() -> None:
    data = struct.pack(">4sHB", MAGIC, 1, 14) + b"kvframe.output" + msgpack.packb({})
    with pytest.raises(UnsupportedVersionError, match="protocol version 1"):
        DEFAULT_CODEC.decode(data)


def test_unknown_tag_raises_unknown_message_type() -> None:
    data = CUSTOM.encode(CustomMeta(step=1))
    with pytest.raises(UnknownMessageTypeError, match=r"tests\.custom"):
        DEFAULT_CODEC.decode(data)


@pytest.mark.parametrize("version", [0, 1, 3, 65535])
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
        (struct.pack(">4sHB", MAGIC, PROTOCOL_VERSION, 0), "empty type tag"),
        (struct.pack(">4sHB", MAGIC, PROTOCOL_VERSION, 9) + b"kv", "truncated"),
        (struct.pack(">4sHB", MAGIC, PROTOCOL_VERSION, 14) + b"kvframe.output", "truncated"),
        (_with_header(b"", tag=b"kvframe.output"), "Input data was truncated"),
        (_with_header(msgpack.packb({}) + b"\x00"), "trailing characters"),
        (_with_header(msgpack.packb([1, 2])), "Expected `object`, got `array`"),
        (_with_header(msgpack.packb({"finished_sending": "abc"})), "Expected `array`"),
        (_with_header(msgpack.packb({"finished_sending": [1]})), "Expected `str`"),
        (_with_header(msgpack.packb({"invalid_block_ids": [-1]})), ">= 0"),
        (
            _with_header(msgpack.packb({"invalid_block_ids": [1, True]})),
            r"Expected `int`, got `bool` - at `\$.invalid_block_ids\[1\]`",
        ),
        (_with_header(msgpack.packb({"stats": {"counters": {"x": -1}}})), "never go negative"),
        (
            _with_header(msgpack.packb({"events": [{"kind": "k", "data": {"a": {1: 2}}}]})),
            "mapping keys must be str",
        ),
        (_with_header(msgpack.packb({"failures": {"r": msgpack.ExtType(3, b"x")}})), "ext"),
        (
            _with_header(
                msgpack.packb(
                    {"loads": [{"request_id": "r", "local_block_ids": [[1, 2]]}]},
                ),
                tag=b"kvframe.metadata",
            ),
            r"missing required field `remote_engine_id` - at `\$.loads\[0\]`",
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
    with pytest.raises(CodecError, match="trailing characters"):
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


def test_a_wrongly_typed_field_is_refused_by_the_decoder_naming_it() -> None:
    msg = attrs.evolve(CustomMeta(), note=3)  # type: ignore[arg-type]
    with pytest.raises(CodecError, match=r"Expected `str \| null`, got `int` - at `\$.note`"):
        CUSTOM.decode(CUSTOM.encode(msg))


def test_encoding_a_value_msgspec_cannot_write_is_a_type_error() -> None:
    msg = attrs.evolve(CustomMeta(), note=object())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="cannot encode CustomMeta"):
        CUSTOM.encode(msg)
    with pytest.raises(TypeError, match="cannot encode CustomMeta"):
        CUSTOM.encode(attrs.evolve(CustomMeta(), tokens=(2**70,)))


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
    head = 11 + len(b"tests.painted")
    body = msgpack.unpackb(data[head:])
    body["colour"] = "green"
    bad = data[:head] + msgpack.packb(body)
    with pytest.raises(CodecError, match=r"Invalid enum value 'green' - at `\$.colour`"):
        PAINTED.decode(bad)
    body["colour"] = 1  # the right kind matters too: an int is not a str-valued member
    with pytest.raises(CodecError, match=r"Expected `str`, got `int` - at `\$.colour`"):
        PAINTED.decode(data[:head] + msgpack.packb(body))


class Mixed(enum.Enum):
    A = "a"
    B = 2


@attrs.frozen
class MixedHolder:
    m: Mixed


def test_enums_of_mixed_or_other_values_are_refused_at_registration() -> None:
    with pytest.raises(TypeError, match=r"MixedHolder\.m: the codec carries enums whose values"):
        DEFAULT_CODEC.with_types({"tests.bad": MixedHolder})


def test_a_non_member_is_refused_by_the_decoder_naming_the_field() -> None:
    data = PAINTED.encode(attrs.evolve(Painted(), colour="purple"))  # type: ignore[arg-type]
    with pytest.raises(CodecError, match=r"Invalid enum value 'purple' - at `\$.colour`"):
        PAINTED.decode(data)


# -- on msgspec: what the finishing pass does ------------------------------------------------


def test_decoded_maps_are_frozen_dicts_and_inputs_may_be_any_buffer() -> None:
    msg = ConnectorMetadata(step=2, extra={"a": {"b": [1]}})
    data = DEFAULT_CODEC.encode(msg)
    for raw in (data, bytearray(data), memoryview(data)):
        back = DEFAULT_CODEC.decode_as(raw, ConnectorMetadata)
        assert back == msg
        assert type(back.extra) is FrozenDict
        assert type(back.extra["a"]) is FrozenDict
        assert back.extra["a"]["b"] == (1,)
        with pytest.raises(TypeError, match="read-only"):
            back.extra.update(x=1)  # type: ignore[attr-defined]


def _count_calls(value: tuple[int, ...]) -> tuple[int, ...]:
    CALLS.append(value)
    if any(v > 100 for v in value):
        raise ValueError(f"{value!r}: at most 100")
    return tuple(value)


CALLS: list[tuple[int, ...]] = []


def _as_tuple(value: tuple[int, ...]) -> tuple[int, ...]:
    CALLS.append(value)
    return tuple(value)


type_checked(_as_tuple)


@attrs.frozen(kw_only=True)
class Converted(ConnectorMetadata):
    small: tuple[int, ...] = attrs.field(default=(), converter=_count_calls)
    big: tuple[int, ...] = attrs.field(default=(), converter=_as_tuple)


CONVERTED = DEFAULT_CODEC.with_types({"tests.converted": Converted})


def test_converters_run_on_decoding_unless_type_checked_or_default() -> None:
    msg, empty = Converted(small=(1, 2), big=(7,)), Converted()
    data, empty_data = CONVERTED.encode(msg), CONVERTED.encode(empty)
    CALLS.clear()
    assert CONVERTED.decode(data) == msg
    assert CALLS == [(1, 2)]  # `big`'s converter is marked: not run
    CALLS.clear()
    assert CONVERTED.decode(empty_data) == empty
    assert CALLS == []  # the default: its converted value was computed at registration
    body = msgpack.packb({"small": [101]})
    with pytest.raises(CodecError, match=r"Converted\.small: not a valid Converted: .*at most"):
        CONVERTED.decode(CONVERTED.envelope("tests.converted", body))


def test_maps_with_other_keys_and_sets_of_mixed_kinds_are_encoded() -> None:
    @attrs.frozen(kw_only=True)
    class Odd(ConnectorMetadata):
        by_key: Mapping[bytes, int] = attrs.field(factory=dict)
        mixed: frozenset[int | str] = frozenset()

    odd = DEFAULT_CODEC.with_types({"tests.odd": Odd})
    msg = Odd(by_key={b"k": 1}, mixed=frozenset({1, "a"}))
    assert odd.decode(odd.encode(msg)) == msg


def test_envelope_is_what_encode_writes_before_the_body() -> None:
    data = DEFAULT_CODEC.encode(ConnectorOutput())
    head = DEFAULT_CODEC.envelope("kvframe.output", b"")
    assert data.startswith(head)
    assert DEFAULT_CODEC.decode(DEFAULT_CODEC.envelope("kvframe.output", data[len(head) :])) == (
        ConnectorOutput()
    )
    with pytest.raises(KeyError):
        DEFAULT_CODEC.envelope("tests.nope", b"")


PD_CODEC = codec_for(PDConnector, KVTransferConfig(kv_connector="PDConnector", kv_role="kv_both"))
_addrs = st.builds(
    RemoteEngineAddr,
    engine_id=ids,
    host=st.text(max_size=8),
    port=st.integers(0, 65535),
    tp_size=st.integers(1, 8),
    ports=st.lists(st.integers(0, 65535), max_size=2).map(tuple),
)
pd_metas = st.builds(
    PDMetadata,
    step=st.integers(0, 2**40),
    now=st.floats(allow_nan=False),
    pd_loads=st.lists(
        st.builds(
            PDLoad,
            request_id=ids,
            remote=_addrs,
            remote_request_id=ids,
            local_block_ids=st.just(((1, 2),)),
            remote_block_ids=st.just(((3, 4),)),
        ),
        max_size=3,
    ).map(tuple),
    pd_heartbeats=st.dictionaries(ids, st.lists(ids, max_size=2).map(tuple), max_size=2),
    abort_request_ids=st.frozensets(ids, max_size=3),
)


@given(pd_metas, st.data())
def test_pd_metadata_round_trips_and_its_mutations_raise_only_codec_errors(
    msg: PDMetadata, data: st.DataObject
) -> None:
    raw = bytearray(PD_CODEC.encode(msg))
    assert PD_CODEC.decode(bytes(raw)) == msg
    pos = data.draw(st.integers(0, len(raw) - 1))
    raw[pos] ^= data.draw(st.integers(1, 255))
    _decode_only_codec_errors(PD_CODEC, bytes(raw))
    del raw[data.draw(st.integers(0, len(raw) - 1)) :]
    _decode_only_codec_errors(PD_CODEC, bytes(raw))


def test_a_converter_that_checks_more_than_the_type_still_runs_for_pd() -> None:
    body = msgpack.packb({"pd_heartbeats": {"": ["lease"]}})
    with pytest.raises(CodecError, match="remote engine ids are non-empty str"):
        PD_CODEC.decode(PD_CODEC.envelope("pd.metadata", body))
