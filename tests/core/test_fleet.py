"""The fleet view and the keep-alive clock: pure machines, driven by hand with ``now``."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvframe.core.fleet import (
    EngineAdded,
    EngineChanged,
    EngineRecord,
    EngineRole,
    EngineVanished,
    FleetView,
    KeepAliveClock,
    decode_record,
    encode_record,
)
from kvframe.errors import CodecError


def rec(engine_id: str = "p0", incarnation: str = "a1", **kw: object) -> EngineRecord:
    fields: dict[str, object] = {
        "engine_id": engine_id,
        "role": EngineRole.PRODUCER,
        "host": "10.0.0.1",
        "side_channel_ports": (5600,),
        "transport": "nixl",
        "tp_size": 1,
        "capabilities": frozenset({"push"}),
        "incarnation": incarnation,
    }
    fields.update(kw)
    return EngineRecord(**fields)  # type: ignore[arg-type]


def key(engine_id: str) -> str:
    return f"/kvframe/fleet/engines/{engine_id}"


def test_a_record_round_trips_as_json() -> None:
    r = rec(side_channel_ports=(5600, 5601), tp_size=2)
    data = encode_record(r)
    assert json.loads(data)["kvframe_engine"] == 1
    assert decode_record(data) == r


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"engine_id": "../etc"}, "engine_id '../etc' is not allowed"),
        ({"host": ""}, "host '' is not allowed"),
        ({"side_channel_ports": (0,)}, "0 is not a TCP port"),
        ({"tp_size": 2}, "lists 1 port(s) for tp_size 2"),
        ({"transport": "a b"}, "transport 'a b' is not allowed"),
        ({"incarnation": ""}, "incarnation '' is not allowed"),
    ],
)
def test_a_bad_record_names_the_field(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        rec(**change)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff", "not UTF-8 JSON"),
        (b"[]", "must be a JSON object"),
        (b'{"kvframe_engine": 2}', "schema 2 is not 1"),
        (b"x" * 20000, "exceeds"),
        (encode_record(rec()).replace(b'"tp_size":1', b'"tp_size":1,"extra":1'), "unknown"),
        (encode_record(rec()).replace(b'"tp_size":1', b'"tp_size":"1"'), "tp_size"),
        (encode_record(rec()).replace(b'"role":"kv_producer"', b'"role":"boss"'), "invalid"),
        (encode_record(rec()).replace(b'["push"]', b"[1]"), "capabilities must be strings"),
    ],
)
def test_decode_refuses_hostile_bytes_with_a_codec_error(data: bytes, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        decode_record(data)


@given(st.binary(max_size=300))
def test_decode_is_total(data: bytes) -> None:
    with contextlib.suppress(CodecError):
        decode_record(data)


def test_the_view_reports_added_changed_replaced_and_vanished() -> None:
    v = FleetView()
    a = rec()
    assert v.put(key("p0"), encode_record(a), 1.0) == [EngineAdded(record=a, at=1.0)]
    assert v.put(key("p0"), encode_record(a), 2.0) == []  # a keep-alive rewrite: nothing
    b = rec(capabilities=frozenset())
    assert v.put(key("p0"), encode_record(b), 3.0) == [EngineChanged(old=a, record=b, at=3.0)]
    c = rec(incarnation="a2")
    assert v.put(key("p0"), encode_record(c), 4.0) == [
        EngineVanished(record=b, at=4.0, reason="replaced"),
        EngineAdded(record=c, at=4.0),
    ]
    assert v.delete(key("p0"), 5.0) == [EngineVanished(record=c, at=5.0, reason="deleted")]
    assert v.vanished_at("p0") == 5.0
    assert v.live() == ()
    assert v.delete(key("p0"), 6.0) == []


def test_a_malformed_record_is_skipped_and_counted_and_changes_nothing() -> None:
    v = FleetView()
    a = rec()
    v.put(key("p0"), encode_record(a), 1.0)
    assert v.put(key("p0"), b"garbage", 2.0) == []
    assert v.put(key("d9"), encode_record(rec("d1")), 2.0) == []  # someone else's key
    assert v.malformed == 2
    assert "holds the record of engine 'd1'" in (v.last_error or "")
    assert v.live() == (a,)


def test_the_same_malformed_bytes_count_once_across_polls() -> None:
    # A listing backend (file) hands the same directory to every poll: a bad file is one
    # malformed record, not one per poll; new bytes under its key count again, and so does
    # an entry that left the listing and came back.
    v = FleetView(remember_malformed=2)
    good = encode_record(rec("p0"))
    listing = {key("p0"): good, key("x"): b"garbage"}
    for t in range(1, 6):
        v.snapshot(listing, float(t))
    assert v.malformed == 1
    v.put(key("x"), b"garbage", 6.0)
    assert v.malformed == 1
    v.put(key("x"), b"other garbage", 7.0)
    assert v.malformed == 2
    v.snapshot({key("p0"): good}, 8.0)
    v.snapshot({key("p0"): good, key("x"): b"other garbage"}, 9.0)
    assert v.malformed == 3
    v.delete(key("x"), 10.0)
    v.put(key("x"), b"other garbage", 11.0)
    assert v.malformed == 4
    # Bounded: with room for two, a third bad key pushes the oldest out.
    v.put(key("y"), b"bad y", 12.0)
    v.put(key("z"), b"bad z", 13.0)
    assert v.malformed == 6
    v.put(key("x"), b"other garbage", 14.0)
    assert v.malformed == 7
    assert [r.engine_id for r in v.live()] == ["p0"]


def test_a_snapshot_diffs_against_the_view() -> None:
    v = FleetView()
    a, b, c = rec("a"), rec("b"), rec("c")
    v.snapshot({key("a"): encode_record(a), key("b"): encode_record(b)}, 1.0)
    events = v.snapshot({key("b"): encode_record(b), key("c"): encode_record(c)}, 2.0)
    assert events == [
        EngineVanished(record=a, at=2.0, reason="missing"),
        EngineAdded(record=c, at=2.0),
    ]
    assert [r.engine_id for r in v.live()] == ["b", "c"]


def test_only_observations_make_engines_vanish() -> None:
    # A backend that lost the service feeds nothing; the view keeps what it saw.
    v = FleetView()
    v.put(key("a"), encode_record(rec("a")), 1.0)
    assert [r.engine_id for r in v.live()] == ["a"]
    assert v.vanished_at("a") is None


def test_now_must_be_finite() -> None:
    with pytest.raises(ValueError, match="finite"):
        FleetView().delete(key("a"), math.nan)


def test_the_keepalive_clock_bounds_the_registration_from_send_times() -> None:
    c = KeepAliveClock(6.0)  # interval 2, margin 0.3
    assert c.lost(0.0)
    c.registered(10.0, 6.0)
    assert c.confirmed_until == 16.0
    assert c.next_keepalive() == 12.0
    assert not c.lost(15.69)
    assert c.lost(15.7)
    c.renewed(12.0, 6.0)
    c.renewed(11.0, 6.0)  # a late answer to an older keep-alive moves nothing back
    assert c.confirmed_until == 18.0
    c.attempted(14.0)
    assert c.next_keepalive() == 16.0
    c.forget()
    assert c.lost(14.0)


def test_the_keepalive_clock_refuses_a_lapsing_interval() -> None:
    with pytest.raises(ValueError, match="must be shorter than ttl"):
        KeepAliveClock(2.0, interval=2.0)
    with pytest.raises(ValueError, match="positive"):
        KeepAliveClock(0.0)
