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


def test_nested_policy_wins_over_vllm_policy() -> None:
    cfg = AdapterConfig.from_fields(
        kv_role="kv_both",
        engine_id="e",
        kv_load_failure_policy="fail",
        extra={"kvframe": {"kv_load_failure_policy": "recompute"}},
    )
    assert cfg.config.kv_load_failure_policy == "recompute"


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
