"""The adapter's parsing of vLLM's kv_connector_extra_config and its pure mappings (no
engine; these run in well under a second)."""

from __future__ import annotations

import types

import pytest
from kvframe_vllm.config import AdapterConfig
from kvframe_vllm.mapping import BlockHashCache, finish_reason, monotonic_from_wall, request_view

from kvframe.errors import ConfigError


def test_nested_form_maps_vllm_keys_and_kvframe_keys() -> None:
    cfg = AdapterConfig.from_fields(
        kv_role="kv_producer",
        engine_id="p0",
        kv_load_failure_policy="fail",
        extra={
            "kvframe_connector": "PDConnector",
            "kvframe": {
                "kv_lease_duration": 7,
                "kv_connector_extra_config": {"transport": "nixl", "side_channel_port": 5000},
            },
        },
    )
    assert cfg.connector == "PDConnector"
    c = cfg.config
    assert (c.kv_connector, c.kv_role, c.engine_id) == ("PDConnector", "kv_producer", "p0")
    assert c.kv_load_failure_policy == "fail"
    assert c.kv_lease_duration == 7.0
    assert dict(c.kv_connector_extra_config) == {"transport": "nixl", "side_channel_port": 5000}


def test_merged_form_and_default_connector() -> None:
    cfg = AdapterConfig.from_fields(kv_role="kv_both", engine_id=None, extra={"transport": "nixl"})
    assert cfg.connector == "PDConnector"
    assert dict(cfg.config.kv_connector_extra_config) == {"transport": "nixl"}
    assert cfg.config.engine_id is None


def test_a_policy_in_the_extra_config_must_agree_with_vllms() -> None:
    # vLLM's scheduler applies its own top-level key; the adapter does not pretend otherwise.
    for extra in (
        {"kv_load_failure_policy": "recompute"},
        {"kvframe": {"kv_load_failure_policy": "recompute"}},
    ):
        agreed = AdapterConfig.from_fields(
            kv_role="kv_both", engine_id="e", kv_load_failure_policy="recompute", extra=extra
        )
        assert agreed.config.kv_load_failure_policy == "recompute"
        with pytest.raises(ConfigError) as info:
            AdapterConfig.from_fields(
                kv_role="kv_both", engine_id="e", kv_load_failure_policy="fail", extra=extra
            )
        message = str(info.value)
        assert "vLLM's own kv_load_failure_policy is 'fail'" in message
        assert '"kv_load_failure_policy": "recompute" at the top level' in message


def test_nixlconnector_flat_keys_are_accepted_as_written() -> None:
    # The seed's own example, what NixlConnector users write.
    cfg = AdapterConfig.from_fields(
        kv_role="kv_both",
        engine_id="p0",
        kv_load_failure_policy="fail",
        extra={
            "kv_lease_duration": 60,
            "decoder_kv_blocks_ttl": 600,
            "kv_load_failure_policy": "fail",
            "engine_ttl": 1200,
            "backends": ["UCX"],
            "num_threads": 4,
            "enforce_handshake_compat": True,
            "bidirectional_kv_xfer": False,
        },
    )
    c = cfg.config
    assert (c.kv_lease_duration, c.decoder_kv_blocks_ttl) == (60.0, 600.0)
    assert c.kv_load_failure_policy == "fail"
    extra = c.kv_connector_extra_config
    assert extra["peer_idle_ttl"] == 1200
    assert dict(extra["transport_options"]) == {"backends": ("UCX",), "num_threads": 4}
    assert set(extra) == {"peer_idle_ttl", "transport_options"}


def test_flat_keys_beside_the_nested_form_and_into_a_multiconnector() -> None:
    nested = AdapterConfig.from_fields(
        kv_role="kv_both",
        engine_id="d0",
        extra={
            "kv_lease_duration": 12,
            "engine_ttl": 99,
            "kvframe": {"kv_connector_extra_config": {"transport": "nixl"}},
        },
    )
    assert nested.config.kv_lease_duration == 12.0
    assert dict(nested.config.kv_connector_extra_config) == {
        "transport": "nixl",
        "peer_idle_ttl": 99,
    }
    multi = AdapterConfig.from_fields(
        kv_role="kv_both",
        engine_id="d0",
        extra={
            "kvframe_connector": "MultiConnector",
            "kv_lease_duration": 9,
            "connectors": [{"kv_connector": "PDConnector"}],
        },
    )
    assert [c.kv_lease_duration for c in multi.config.connectors] == [9.0]


def test_the_adapter_config_builds_the_connector_halves() -> None:
    from kvframe.runtime.plugins import PluginHost
    from kvframe.spi.connector import BuildContext, EngineInfo

    cfg = AdapterConfig.from_fields(
        kv_role="kv_both",
        engine_id="p0",
        extra={"kv_lease_duration": 60, "engine_ttl": 300, "transport": "inprocess"},
    )
    host = PluginHost()
    host.load()
    cls = host.connector(cfg.connector)
    ctx = BuildContext(host=host)
    info = EngineInfo(block_size=32, model="m")
    cls.build_scheduler(cfg.config, info, ctx).shutdown()
    cls.build_worker(cfg.config, info, 0, ctx).shutdown()


@pytest.mark.parametrize(
    ("extra", "fragments"),
    [
        (
            {"kv_lease_duraton": 60},
            ["kv_lease_duraton: not a key the adapter reads", "did you mean 'kv_lease_duration'?"],
        ),
        ({"kvframe_conector": "PDConnector"}, ["did you mean 'kvframe_connector'?"]),
        (
            {"kvframe": {"kv_lease_duraton": 3}},
            ["kvframe.kv_lease_duraton: not allowed here", "did you mean 'kv_lease_duration'?"],
        ),
        (
            {"kv_lease_duration": 5, "kvframe": {"kv_lease_duration": 6}},
            [
                "kv_lease_duration and kv_connector_extra_config.kvframe.kv_lease_duration",
                "keep one",
            ],
        ),
        ({"kv_lease_duration": 0.001}, ["at least 0.1 seconds"]),
        (
            {"kv_lease_duration": 600, "decoder_kv_blocks_ttl": 480},
            ["decoder_kv_blocks_ttl: got 480 with kv_lease_duration 600"],
        ),
        ({"read_margin": 20, "kv_lease_duration": 30}, ["read_margin", "extension"]),
        (
            {"kv_recompute_threshold": 64},
            ["kv_recompute_threshold = 64: a NixlConnector option kvframe does not use"],
        ),
        ({"push_registration_timeout": 5}, ["NixlPushConnector"]),
        ({"enforce_handshake_compat": False}, ["only true is accepted", "layout checksum"]),
        ({"bidirectional_kv_xfer": True}, ["only false is accepted"]),
        (
            {"backends": ["UCX"], "transport": "ucx"},
            ["an option of the NIXL transport", "transport is 'ucx'"],
        ),
        (
            {"num_threads": 2, "transport_options": {"num_threads": 3}},
            ["num_threads and kv_connector_extra_config.transport_options.num_threads"],
        ),
        (
            {"kvframe_connector": "MultiConnector", "engine_ttl": 5, "connectors": [{}]},
            ["maps onto PDConnector's peer_idle_ttl", "kvframe_connector is 'MultiConnector'"],
        ),
    ],
)
def test_a_key_kvframe_does_not_take_names_the_form_that_works(
    extra: dict[str, object], fragments: list[str]
) -> None:
    from kvframe.runtime.plugins import PluginHost
    from kvframe.spi.connector import BuildContext, EngineInfo

    def parse_and_build() -> None:
        cfg = AdapterConfig.from_fields(kv_role="kv_both", engine_id="e", extra=extra)
        # Options only the connector checks (read_margin) are refused when it is built.
        host = PluginHost()
        host.load()
        ctx = BuildContext(host=host)
        host.connector(cfg.connector).build_scheduler(
            cfg.config, EngineInfo(block_size=32, model="m"), ctx
        )

    with pytest.raises(ConfigError) as info:
        parse_and_build()
    for fragment in fragments:
        assert fragment in str(info.value)


def test_every_vllm_configuration_in_the_docs_parses_and_builds() -> None:
    from tests.test_docs_configs import build_halves, vllm_examples

    examples = vllm_examples()
    assert len(examples) >= 4
    for where, data in examples:
        cfg = AdapterConfig.from_fields(
            kv_role=data["kv_role"],
            engine_id=data.get("engine_id"),
            extra=data.get("kv_connector_extra_config"),
            kv_load_failure_policy=data.get("kv_load_failure_policy", "fail"),
        )
        assert data["kv_connector_module_path"] == "kvframe_vllm", where
        assert len(build_halves(cfg.config)) == 2, where


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kv_role": None, "extra": {}}, "kv_role: missing"),
        ({"kv_role": "kv_both", "extra": {"kvframe_connector": ""}}, "kvframe_connector"),
        ({"kv_role": "kv_both", "extra": {"kvframe": [1]}}, r"kvframe = \[1\]"),
        (
            {"kv_role": "kv_both", "extra": {"kvframe": {}, "transport": "nixl"}},
            "not both",
        ),
        (
            {"kv_role": "kv_both", "extra": {"kvframe": {"engine_id": "x"}}},
            "kvframe.engine_id: not allowed here; it comes from vLLM",
        ),
        (
            {"kv_role": "kv_both", "extra": {"kvframe": {"kv_lease_duraton": 3}}},
            "kvframe.kv_lease_duraton: not allowed here",
        ),
        (
            {"kv_role": "kv_both", "extra": {"kvframe": {"kv_lease_duration": -1}}},
            "kv_lease_duration",
        ),
        ({"kv_role": "kv_bot", "extra": {}}, "did you mean 'kv_both'"),
    ],
)
def test_bad_config_names_the_key(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        AdapterConfig.from_fields(engine_id="e", **kwargs)  # type: ignore[arg-type]


def test_from_vllm_reads_the_vllm_object() -> None:
    vllm_cfg = types.SimpleNamespace(
        kv_role="kv_consumer",
        engine_id="d0",
        kv_connector_extra_config={"transport": "nixl"},
        kv_load_failure_policy="recompute",
    )
    cfg = AdapterConfig.from_vllm(vllm_cfg)
    assert cfg.config.kv_role == "kv_consumer"
    assert cfg.config.engine_id == "d0"


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        ("FINISHED_STOPPED", "stop"),
        ("FINISHED_LENGTH_CAPPED", "length"),
        ("FINISHED_ABORTED", "abort"),
        ("FINISHED_ERROR", "error"),
        ("FINISHED_SOMETHING_NEW", "error"),
        ("RUNNING", None),
    ],
)
def test_finish_reason(status: str, reason: str | None) -> None:
    assert finish_reason(types.SimpleNamespace(name=status)) == reason


def test_request_view_maps_a_vllm_request() -> None:
    import time

    req = types.SimpleNamespace(
        request_id="r1",
        num_prompt_tokens=70,
        num_computed_tokens=0,
        all_token_ids=list(range(70)),
        kv_transfer_params={"do_remote_decode": True},
        arrival_time=time.time(),
        status=types.SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
        cache_salt=None,
    )
    cache = BlockHashCache(32)
    view = request_view(req, hashes=cache, num_computed_tokens=32, block_ids=((1, 2, 3),))
    assert view.num_computed_tokens == 32
    assert len(view.block_hashes) == 2  # two full blocks of 32
    assert view.finish_reason is None
    assert abs(view.arrival_time - time.monotonic()) < 1.0
    done = request_view(req, hashes=cache, finished=True)
    assert done.finish_reason == "length"
    cache.forget("r1")
    assert len(cache) == 0
    assert abs(monotonic_from_wall(time.time()) - time.monotonic()) < 0.1


def test_kv_regions_keeps_block_major_and_splits_kv_first() -> None:
    import torch
    from kvframe_vllm.mapping import kv_regions

    block_major = torch.zeros(8, 4, 64, 32)
    kv_first = torch.zeros(2, 8, 32, 4, 32)
    out = kv_regions({"l0": block_major, "l1": kv_first}, num_blocks=8)
    assert list(out) == ["l0", "l1.k", "l1.v"]
    assert out["l0"] is block_major
    assert out["l1.k"].shape == (8, 32, 4, 32)
    assert out["l1.v"].data_ptr() == kv_first[1].data_ptr()
    with pytest.raises(ValueError, match=r"layer 'bad' has shape \(3, 8\)"):
        kv_regions({"bad": torch.zeros(3, 8)}, num_blocks=8)
    with pytest.raises(ValueError, match="not contiguous"):
        kv_regions({"t": torch.zeros(4, 8).t()}, num_blocks=8)


def test_bench_launcher_without_a_vllm_venv_says_how_to_make_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from kvframe.bench import vllm as launcher

    monkeypatch.setenv("KVFRAME_VLLM_PYTHON", "/nonexistent/python")
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    assert launcher.run(parser.parse_args([])) == 2
    assert "./dev vllm-setup" in capsys.readouterr().err
