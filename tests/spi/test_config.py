"""KVTransferConfig: parsing, error messages with key paths, round trips."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvframe.config import KV_ROLES, MIN_LEASE_DURATION, KVTransferConfig, reference_table
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
seconds = st.floats(min_value=MIN_LEASE_DURATION, max_value=1e9) | st.integers(1, 10**6)
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


def _ttl_covers_the_lease(data: dict[str, Any]) -> bool:
    lease = data.get("kv_lease_duration", 30.0)
    return bool(data.get("decoder_kv_blocks_ttl", max(480.0, lease)) >= lease)


configs = configs.filter(_ttl_covers_the_lease)


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


# -- the timing rules (docs/configuration.md#the-timing-rules) --------------------------------
TIMING_BAD: list[tuple[dict[str, Any], list[str]]] = [
    (
        _with(kv_lease_duration=0.001),
        [
            "kv_lease_duration: got 0.001 (float)",
            "expected at least 0.1 seconds (6 or more outside tests)",
            "heartbeat every 0.00017 s",
            "only 0.00067 s",
        ],
    ),
    (_with(kv_lease_duration=0.09), ["at least 0.1 seconds"]),
    (
        _with(kv_lease_duration=60, decoder_kv_blocks_ttl=30),
        [
            "decoder_kv_blocks_ttl: got 30 with kv_lease_duration 60",
            "raise it to 60 or more",
        ],
    ),
    (
        _multi({"kv_connector": "a", "kv_lease_duration": 0.01}),
        ["kv_connector_extra_config.connectors[0].kv_lease_duration: got 0.01"],
    ),
    (
        _multi({"kv_connector": "a", "kv_lease_duration": 90, "decoder_kv_blocks_ttl": 60}),
        ["kv_connector_extra_config.connectors[0].decoder_kv_blocks_ttl: got 60"],
    ),
    # NixlConnector's flat keys are top-level keys here: the error names that form.
    (
        _with(kv_connector_extra_config={"kv_lease_duration": 60}),
        [
            "kv_connector_extra_config.kv_lease_duration: 60 is a key of the configuration",
            "write it as kv_lease_duration",
            '"kv_lease_duration": 60',
        ],
    ),
    (
        _multi({"kv_connector": "a", "kv_connector_extra_config": {"decoder_kv_blocks_ttl": 9}}),
        ["write it as kv_connector_extra_config.connectors[0].decoder_kv_blocks_ttl"],
    ),
    (
        _with(kv_connector_extra_config={"kv_load_failure_policy": "fail"}),
        ["write it as kv_load_failure_policy"],
    ),
]


@pytest.mark.parametrize(("data", "fragments"), TIMING_BAD)
def test_nonsensical_timing_is_refused_with_what_would_work(
    data: dict[str, Any], fragments: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        KVTransferConfig.from_dict(data)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_the_constructor_applies_the_timing_rules_too() -> None:
    with pytest.raises(ConfigError, match=r"at least 0\.1 seconds"):
        KVTransferConfig(kv_connector="pd", kv_role="kv_both", kv_lease_duration=0.001)
    with pytest.raises(ConfigError, match="decoder_kv_blocks_ttl: got 5 with"):
        KVTransferConfig(
            kv_connector="pd", kv_role="kv_both", kv_lease_duration=10, decoder_kv_blocks_ttl=5
        )


@pytest.mark.parametrize("lease", [MIN_LEASE_DURATION, 0.2, 5, 6, 30, 479.5])
def test_leases_from_the_floor_up_are_accepted(lease: float) -> None:
    cfg = KVTransferConfig.from_dict(_with(kv_lease_duration=lease))
    assert (cfg.kv_lease_duration, cfg.decoder_kv_blocks_ttl) == (lease, 480.0)


def test_the_default_bound_follows_a_longer_lease() -> None:
    cfg = KVTransferConfig.from_dict(_with(kv_lease_duration=600))
    assert cfg.decoder_kv_blocks_ttl == 600.0
    assert (
        KVTransferConfig(
            kv_connector="pd", kv_role="kv_both", kv_lease_duration=900
        ).decoder_kv_blocks_ttl
        == 900.0
    )
    multi = KVTransferConfig.from_dict(
        _multi({"kv_connector": "a", "kv_lease_duration": 700}, {"kv_connector": "b"})
    )
    a, b = multi.connectors
    assert (a.decoder_kv_blocks_ttl, b.decoder_kv_blocks_ttl) == (700.0, 480.0)
    assert KVTransferConfig.from_dict(multi.to_dict()) == multi


@pytest.mark.parametrize(
    ("lease", "margin", "ok"),
    [(30, 19.9, True), (30, 20, False), (30, 25, False), (5, 3.3, True), (5, 3.34, False)],
)
def test_a_read_margin_at_or_above_the_extension_is_refused(
    lease: float, margin: float, ok: bool
) -> None:
    from kvframe.connectors.pd.options import PDOptions

    extra = {"read_margin": margin}
    assert PDOptions.from_extra(extra).read_margin == margin  # without a lease: not checked
    if ok:
        assert PDOptions.from_extra(extra, lease).read_margin == margin
        return
    with pytest.raises(ConfigError) as info:
        PDOptions.from_extra(extra, lease)
    message = str(info.value)
    assert f"kv_connector_extra_config.read_margin = {margin:g}" in message
    assert "expected less than the lease extension" in message
    assert "leave it out (default extension / 4" in message


def test_the_pd_connector_refuses_a_read_margin_above_the_extension_at_build() -> None:
    from kvframe.connectors.pd import PDConnector
    from kvframe.runtime.plugins import PluginHost
    from kvframe.spi.connector import BuildContext, EngineInfo

    cfg = KVTransferConfig.from_dict(
        _with(
            kv_connector="PDConnector",
            engine_id="p0",
            kv_lease_duration=6,
            kv_connector_extra_config={"transport": "inprocess", "read_margin": 4},
        )
    )
    host = PluginHost()
    host.load()
    ctx = BuildContext(host=host)
    info = EngineInfo(block_size=16, model="m")
    with pytest.raises(ConfigError, match="4 s for kv_lease_duration 6"):
        PDConnector.build_scheduler(cfg, info, ctx)
    with pytest.raises(ConfigError, match="read_margin = 4"):
        PDConnector.build_worker(cfg, info, 0, ctx)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, 1.0),
        ({"handshake_timeout": 0.3}, 0.3),  # the default never exceeds handshake_timeout
        ({"warmup_timeout": 0}, 0.0),
        ({"warmup_timeout": 2.5, "handshake_timeout": 3}, 2.5),
    ],
)
def test_warmup_timeout(extra: dict[str, Any], expected: float) -> None:
    from kvframe.connectors.pd.options import PDOptions

    assert PDOptions.from_extra(extra).warmup_timeout == expected


@pytest.mark.parametrize("value", [-0.1, 6.0, float("nan"), float("inf"), True, "1", None])
def test_a_bad_warmup_timeout_is_refused(value: object) -> None:
    from kvframe.connectors.pd.options import PDOptions

    with pytest.raises(ConfigError, match="warmup_timeout") as info:
        PDOptions.from_extra({"warmup_timeout": value})
    assert "handshake_timeout (5)" in str(info.value)
