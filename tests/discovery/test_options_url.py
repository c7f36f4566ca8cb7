"""Discovery URLs (kvframe.discovery.options.parse_discovery_url) and the record's optional
fields (api_port, no side-channel port)."""

from __future__ import annotations

import pytest

from kvframe.core.fleet import EngineRecord, EngineRole, decode_record, encode_record
from kvframe.discovery.options import parse_discovery_url
from kvframe.errors import CodecError, ConfigError


@pytest.mark.parametrize(
    ("url", "backend", "options"),
    [
        ("etcd://127.0.0.1:2379", "etcd", {"endpoint": "http://127.0.0.1:2379"}),
        (
            "etcd+https://etcd.example:2379/kv/fleet-a/?ttl=5&request_timeout=1.5",
            "etcd",
            {
                "endpoint": "https://etcd.example:2379",
                "prefix": "/kv/fleet-a/",
                "ttl": 5,
                "request_timeout": 1.5,
            },
        ),
        (
            "file:///run/kvframe?ttl=2&poll_interval=0.05",
            "file",
            {"directory": "/run/kvframe", "ttl": 2, "poll_interval": 0.05},
        ),
        ("consul:?addr=10.0.0.1", "consul", {"addr": "10.0.0.1"}),
    ],
)
def test_urls_name_a_backend_and_its_options(url: str, backend: str, options: dict) -> None:
    assert parse_discovery_url(url) == (backend, options)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("127.0.0.1:2379", "scheme"),
        ("nothing", "scheme"),
        ("etcd:///x", "HOST:PORT"),
        ("file://relative/dir", "absolute"),
        ("mem://", "one process"),
        ("etcd://h:1?ttl=1&ttl=2", "twice"),
        ("etcd://h:1#frag", "fragment"),
        ("consul://host", "query only"),
    ],
)
def test_bad_urls_say_what_to_write(url: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        parse_discovery_url(url)


def _rec(**kw: object) -> EngineRecord:
    fields: dict = {
        "engine_id": "d0",
        "role": EngineRole.CONSUMER,
        "host": "10.0.0.1",
        "side_channel_ports": (),
        "transport": "nixl",
        "tp_size": 2,
        "incarnation": "i",
    }
    fields.update(kw)
    return EngineRecord(**fields)


def test_api_port_and_no_side_channel_round_trip() -> None:
    rec = _rec(api_port=8102)
    assert decode_record(encode_record(rec)) == rec
    plain = _rec()
    assert b"api_port" not in encode_record(plain)  # older readers' encoding unchanged
    assert decode_record(encode_record(plain)) == plain


@pytest.mark.parametrize("bad", [0, 65536, True, "80", 1.5])
def test_a_bad_api_port_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="api_port"):
        _rec(api_port=bad)
    data = encode_record(_rec(api_port=80)).replace(
        b'"api_port":80',
        b'"api_port":' + str(bad).lower().encode()
        if not isinstance(bad, str)
        else b'"api_port":"80"',
    )
    with pytest.raises(CodecError):
        decode_record(data)


def test_ports_when_given_are_one_per_rank() -> None:
    with pytest.raises(ValueError, match="one port per TP rank"):
        _rec(side_channel_ports=(5600,))
