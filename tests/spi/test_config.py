"""KVTransferConfig: parsing, error messages with key paths, round trips."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvframe.config import KV_ROLES, KVTransferConfig, reference_table
from kvframe.errors import ConfigError

BASE: dict[str, Any] = {"kv_connector": "pd", "kv_role": "kv_both"}


def _with(**kw: Any) -> dict[str, Any]:
    return {**BASE, **kw}


def _multi(*subs: Any) -> dict[str, Any]:
    return _with(kv_connector_extra_config={"connectors": list(subs)})


BAD: list[tuple[Any, list[str]]] = [
    ({"kv_role": "kv_both"}, ["kv_connector: missing", "required"]),
    ({"kv_connector": "pd"}, ["kv_role: missing", "'kv_producer', 'kv_consumer', 'kv_both'"]),
    (_with(kv_rol="kv_both"), ["kv_rol: unknown key", "'kv_both'", "did you mean 'kv_role'?"]),
    (_with(kv_lease_duraton=3), ["kv_lease_duraton", "did you mean 'kv_lease_duration'?"]),
    (_with(zzz=1), ["zzz: unknown key", "known keys: kv_connector, kv_role"]),
    (
        _with(kv_role="kv_producr"),
        ["kv_role: got 'kv_producr' (str)", "did you mean 'kv_producer'"],
    ),
    (_with(kv_role="both"), ["kv_role: got 'both'", "one of 'kv_producer'"]),
    (_with(kv_role=1), ["kv_role: got 1 (int)", "one of"]),
    (_with(kv_connector=""), ["kv_connector: got '' (str)", "non-empty string"]),
    (_with(kv_connector=None), ["kv_connector: got None (null)", "non-empty string"]),
    (_with(engine_id=7), ["engine_id: got 7 (int)", "non-empty string"]),
    (
        _with(kv_load_failure_policy="retry"),
        ["kv_load_failure_policy: got 'retry'", "'fail', 'recompute'"],
    ),
    (_with(kv_load_failure_policy="recompte"), ["did you mean 'recompute'?"]),
    (_with(kv_lease_duration=0), ["kv_lease_duration: got 0 (int)", "seconds > 0"]),
    (_with(kv_lease_duration=-2.5), ["kv_lease_duration: got -2.5"]),
    (_with(kv_lease_duration="30"), ["kv_lease_duration: got '30' (str)", "number of seconds"]),
    (_with(kv_lease_duration=True), ["kv_lease_duration: got True (bool)"]),
    (_with(kv_lease_duration=float("inf")), ["kv_lease_duration: got inf", "finite"]),
    (_with(decoder_kv_blocks_ttl=float("nan")), ["decoder_kv_blocks_ttl: got nan", "finite"]),
    (_with(kv_connector_extra_config=[1]), ["kv_connector_extra_config: got [1] (list)", "object"]),
    (
        _with(kv_connector_extra_config={"a": {"b": {1, 2}}}),
        ["kv_connector_extra_config.a.b: got {1, 2} (set)", "a JSON value"],
    ),
    (
        _with(kv_connector_extra_config={"transport_options": "fast"}),
        ["kv_connector_extra_config.transport_options: got 'fast'", "an object"],
    ),
    (
        _with(kv_connector_extra_config={"connectors": []}),
        ["kv_connector_extra_config.connectors: got []", "non-empty list"],
    ),
    (_multi("nixl"), ["kv_connector_extra_config.connectors[0]: got 'nixl' (str)", "an object"]),
    (
        _multi({"kv_connector": "a"}, {"kv_connector": "b", "kv_role": "kv_consumr"}),
        [
            "kv_connector_extra_config.connectors[1].kv_role: got 'kv_consumr'",
            "did you mean 'kv_consumer'?",
        ],
    ),
    (
        _multi({"kv_connector": "a", "kv_rol": "x"}),
        ["kv_connector_extra_config.connectors[0].kv_rol: unknown key", "did you mean 'kv_role'"],
    ),
    (
        _multi({"kv_role": "kv_both"}),
        ["kv_connector_extra_config.connectors[0].kv_connector: missing"],
    ),
    (
        _multi({"kv_connector": "outer", "kv_connector_extra_config": {"connectors": [{}]}}),
        ["kv_connector_extra_config.connectors[0].kv_connector_extra_config.connectors[0]."],
    ),
    (_with(kv_buffer_device="cuda"), ["kv_buffer_device: 'cuda' is a vLLM option", "remove it"]),
    (_with(kv_connector_module_path="x.y"), ["vLLM option", "kvframe plugin"]),
    ([BASE], ["kv_transfer_config: got", "(list); expected a JSON object"]),
]


@pytest.mark.parametrize(("data", "fragments"), BAD)
def test_bad_config_messages_name_key_value_and_what_is_allowed(
    data: Any, fragments: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        KVTransferConfig.from_dict(data)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"kv_connector": "pd",', "not valid JSON: Expecting property name"),
        ('{"kv_connector": "pd"} x', "line 1 column 24"),
        ('{"kv_connector": "a", "kv_connector": "b", "kv_role": "kv_both"}', "given twice"),
        (b"\xff\xfe", "not UTF-8"),
        ("[]", "expected a JSON object"),
    ],
)
def test_bad_json(text: str | bytes, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        KVTransferConfig.from_json(text)


def test_a_vllm_style_json_parses_with_defaults() -> None:
    cfg = KVTransferConfig.from_json(
        b'{"kv_connector": "pd", "kv_role": "kv_consumer", "engine_id": "d0",'
        b' "kv_connector_extra_config": {"transport": "nixl"}}'
    )
    assert cfg.kv_role == "kv_consumer"
    assert cfg.engine_id == "d0"
    assert cfg.kv_load_failure_policy == "recompute"
    assert cfg.kv_lease_duration == 30.0
    assert cfg.decoder_kv_blocks_ttl == 480.0
    assert cfg.is_consumer
    assert not cfg.is_producer
    assert cfg.connectors == ()


@pytest.mark.parametrize(
    ("role", "producer", "consumer"),
    [("kv_producer", True, False), ("kv_consumer", False, True), ("kv_both", True, True)],
)
def test_role_properties(role: str, producer: bool, consumer: bool) -> None:
    cfg = KVTransferConfig.from_dict(_with(kv_role=role))
    assert (cfg.is_producer, cfg.is_consumer) == (producer, consumer)


def test_sub_connectors_inherit_unset_keys() -> None:
    cfg = KVTransferConfig.from_dict(
        _with(
            engine_id="e",
            kv_lease_duration=5,
            kv_connector_extra_config={
                "connectors": [
                    {"kv_connector": "a"},
                    {"kv_connector": "b", "kv_role": "kv_consumer", "kv_lease_duration": 2},
                ]
            },
        )
    )
    a, b = cfg.connectors
    assert (a.kv_connector, a.kv_role, a.engine_id, a.kv_lease_duration) == ("a", "kv_both", "e", 5)
    assert (b.kv_role, b.kv_lease_duration) == ("kv_consumer", 2)


def test_constructor_validates_too() -> None:
    with pytest.raises(ConfigError, match="kv_role: got 'x'"):
        KVTransferConfig(kv_connector="pd", kv_role="x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="kv_lease_duration: got '1'"):
        KVTransferConfig(kv_connector="pd", kv_role="kv_both", kv_lease_duration="1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"connectors\[0\]\.kv_connector: missing"):
        KVTransferConfig(
            kv_connector="pd", kv_role="kv_both", kv_connector_extra_config={"connectors": [{}]}
        )


def test_extra_config_is_read_only() -> None:
    raw = {"transport_options": {"n": [1, 2]}}
    cfg = KVTransferConfig.from_dict(_with(kv_connector_extra_config=raw))
    raw["transport_options"]["n"].append(3)  # type: ignore[index]
    assert cfg.kv_connector_extra_config["transport_options"]["n"] == (1, 2)
    with pytest.raises(TypeError):
        cfg.kv_connector_extra_config["x"] = 1  # type: ignore[index]


json_values: st.SearchStrategy[Any] = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=10,
)
seconds = st.floats(min_value=1e-6, max_value=1e9) | st.integers(1, 10**6)
configs = st.fixed_dictionaries(
    {"kv_connector": st.text(min_size=1).filter(str.strip), "kv_role": st.sampled_from(KV_ROLES)},
    optional={
        "engine_id": st.none() | st.text(min_size=1).filter(str.strip),
        "kv_load_failure_policy": st.sampled_from(["fail", "recompute"]),
        "kv_lease_duration": seconds,
        "decoder_kv_blocks_ttl": seconds,
        "kv_connector_extra_config": st.dictionaries(
            st.text(max_size=8).filter(lambda k: k not in ("connectors", "transport_options")),
            json_values,
            max_size=4,
        ),
    },
)


@given(configs)
def test_round_trips(data: dict[str, Any]) -> None:
    cfg = KVTransferConfig.from_dict(data)
    assert KVTransferConfig.from_dict(cfg.to_dict()) == cfg
    assert KVTransferConfig.from_json(cfg.to_json()) == cfg
    assert KVTransferConfig.from_json(json.dumps(data)) == cfg
    for key, value in data.items():
        if key != "kv_connector_extra_config":
            assert cfg.to_dict()[key] == value


def test_multi_connector_round_trips() -> None:
    data = _multi({"kv_connector": "a"}, {"kv_connector": "b", "kv_role": "kv_producer"})
    cfg = KVTransferConfig.from_dict(data)
    assert cfg.to_dict()["kv_connector_extra_config"] == data["kv_connector_extra_config"]
    assert KVTransferConfig.from_json(cfg.to_json()) == cfg


def test_reference_table_lists_every_key() -> None:
    table = reference_table()
    for key in KVTransferConfig.__attrs_attrs__:
        assert f"| `{key.name}` |" in table
