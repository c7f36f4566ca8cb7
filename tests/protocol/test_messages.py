"""Message construction: validation, read-only values, plain values."""

from __future__ import annotations

import math

import attrs
import pytest

from kvframe.protocol.messages import (
    ConnectorMetadata,
    ConnectorOutput,
    KVEvent,
    LoadSpec,
    SaveSpec,
    Stats,
    extension_fields,
    freeze_plain,
    thaw_plain,
)


def _load(**kw: object) -> LoadSpec:
    args: dict[str, object] = {
        "request_id": "r",
        "local_block_ids": [[1]],
        "remote_engine_id": "p",
        "remote_block_ids": [[5]],
        "remote_request_id": "pr",
    }
    args.update(kw)
    return LoadSpec(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "error", "fragment"),
    [
        (lambda: _load(local_block_ids=[[1], [2]]), ValueError, "2 local KV groups but 1"),
        (lambda: _load(local_block_ids=[[1, 2]]), ValueError, "group 0: 2 local blocks but only 1"),
        (lambda: _load(request_id=""), ValueError, "request_id"),
        (lambda: _load(remote_block_ids=[[-3]]), ValueError, "non-negative"),
        (lambda: _load(remote_block_ids="ab"), TypeError, "sequence of sequences"),
        (lambda: SaveSpec(request_id="r", block_ids=[[1.5]]), ValueError, "block_ids"),
        (lambda: ConnectorMetadata(step=-1), ValueError, "step"),
        (lambda: ConnectorMetadata(free_request_ids="abc"), TypeError, "single value"),
        (lambda: ConnectorMetadata(loads=[object()]), TypeError, "expected a LoadSpec"),
        (lambda: ConnectorMetadata(extra={"k": {1, 2}}), TypeError, r"extra\['k'\] has type set"),
        (lambda: ConnectorMetadata(extra={"k": 2**64}), TypeError, "64 bits"),
        (lambda: ConnectorMetadata(extra={1: 2}), TypeError, "keys must be str"),
        (lambda: ConnectorOutput(invalid_block_ids={-1}), ValueError, "non-negative"),
        (lambda: ConnectorOutput(failures={"r": 1}), TypeError, "reasons are str"),
        (lambda: Stats(counters={"c": -1}), ValueError, "never go negative"),
        (lambda: Stats(gauges={"g": math.nan}), ValueError, "finite"),
        (lambda: Stats(gauges={"g": True}), ValueError, "finite ints or floats"),
        (lambda: KVEvent(kind=""), ValueError, "kind"),
    ],
)
def test_malformed_messages_are_refused_with_a_precise_message(
    make: object, error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        make()  # type: ignore[operator]


def test_messages_are_frozen_and_normalised() -> None:
    meta = ConnectorMetadata(loads=[_load()], free_request_ids=["a", "a"], extra={"l": [1]})
    assert meta.loads == (_load(),)
    assert meta.free_request_ids == frozenset({"a"})
    assert meta.extra["l"] == (1,)
    with pytest.raises(AttributeError):
        meta.step = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        meta.extra["l"] = 2  # type: ignore[index]


def test_partial_local_prefix_is_allowed() -> None:
    spec = _load(local_block_ids=[[7]], remote_block_ids=[[1, 2, 3]])
    assert spec.local_block_ids == ((7,),)


def test_is_empty() -> None:
    assert ConnectorMetadata(step=5).is_empty
    assert not ConnectorMetadata(abort_request_ids={"r"}).is_empty
    assert ConnectorOutput().is_empty
    assert not ConnectorOutput(stats=Stats(gauges={"g": 0})).is_empty


def test_freeze_and_thaw_plain() -> None:
    value = {"a": [1, {"b": b"x", "c": None}], "d": 1.5}
    frozen = freeze_plain(value)
    assert thaw_plain(frozen) == value
    with pytest.raises(TypeError, match=r"v\['a'\]\[1\] has type object"):
        freeze_plain({"a": [0, object()]}, "v")


@attrs.frozen(kw_only=True)
class JobsOutput(ConnectorOutput):
    jobs: tuple[int, ...] = ()
    names: tuple[str, ...] = ()


def test_a_subclass_adds_tuple_fields_that_is_empty_covers() -> None:
    assert extension_fields(ConnectorOutput) == ()
    assert extension_fields(JobsOutput) == ("jobs", "names")
    assert JobsOutput().is_empty
    assert not JobsOutput(jobs=(1,)).is_empty
    with pytest.raises(TypeError, match=r"JobsOutput\.jobs = \[1\]; the fields a ConnectorOutput"):
        JobsOutput(jobs=[1])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not an attrs subclass of ConnectorOutput"):
        extension_fields(ConnectorMetadata)  # type: ignore[arg-type]


def test_a_typed_output_round_trips_through_its_codec_as_its_own_class() -> None:
    from kvframe.protocol.codec import DEFAULT_CODEC

    codec = DEFAULT_CODEC.with_types({"tests.jobs": JobsOutput})
    out = JobsOutput(jobs=(3, 1), names=("a",), finished_sending={"r"})
    back = codec.decode_as(codec.encode(out), ConnectorOutput)
    assert type(back) is JobsOutput
    assert back == out
