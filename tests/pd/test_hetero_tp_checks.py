"""Heterogeneous tensor parallelism: what the scheduler, the worker and the handshake refuse.

The transfers themselves are tested end to end in tests/refengine/test_tp_hetero_nixl.py; here
the refusals and their messages (each names what was wrong and what would work).
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

from kvframe.config import KVTransferConfig
from kvframe.connectors.pd import PDConnector
from kvframe.connectors.pd.handshake import HandshakeRequest
from kvframe.errors import ConfigError
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.connector import BuildContext, EngineInfo
from tests.pd.driver import view


def _config(role: str, **extra: Any) -> KVTransferConfig:
    return KVTransferConfig.from_dict(
        {
            "kv_connector": "PDConnector",
            "kv_role": role,
            "engine_id": "D",
            "kv_lease_duration": 6.0,
            "kv_connector_extra_config": {"transport": "inprocess", **extra},
        }
    )


def _ticket(tp_size: int, **kw: Any) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "remote_engine_id": "P",
        "remote_request_id": "0" * 32,
        "remote_host": "127.0.0.1",
        "remote_port": 5555,
        "remote_block_ids": [[1, 2]],
        "remote_num_tokens": 32,
        "tp_size": tp_size,
        "transport": "inprocess",
        "lease_duration": 6.0,
        "lease_expires_at": 100.0,
        **kw,
    }


def _scheduler(world: int, heads: int | None) -> Any:
    info = EngineInfo(block_size=16, world_size=world, model="m", num_kv_heads=heads)
    host = PluginHost()
    host.load()
    return PDConnector.build_scheduler(_config("kv_consumer"), info, BuildContext(host=host))


def test_a_pair_that_shards_the_heads_is_accepted_in_pull_mode() -> None:
    sched = _scheduler(2, 2)
    for tp in (1, 2, 4, 8):
        sched.check_request(view(f"r{tp}", 33, _ticket(tp)))


def test_without_num_kv_heads_only_equal_sizes_are_accepted() -> None:
    sched = _scheduler(2, None)
    sched.check_request(view("r", 33, _ticket(2)))
    with pytest.raises(ConfigError, match=r"tp_size = 4 .*EngineInfo\.num_kv_heads"):
        sched.check_request(view("r", 33, _ticket(4)))


def test_a_size_that_does_not_shard_the_heads_is_refused_naming_what_works() -> None:
    sched = _scheduler(2, 4)
    with pytest.raises(ConfigError, match=r"tp_size = 3: the prefill engine's .*1, 2, 4"):
        sched.check_request(view("r", 33, _ticket(3)))


def test_push_mode_is_refused_at_another_size() -> None:
    sched = _scheduler(2, 2)
    push = {
        "do_remote_prefill": True,
        "transfer_mode": "push",
        "push_id": "1" * 32,
        "remote_engine_id": "P",
        "remote_host": "127.0.0.1",
        "remote_port": 5555,
        "tp_size": 1,
        "transport": "inprocess",
    }
    with pytest.raises(ConfigError, match="pull mode only, not in push mode"):
        sched.check_request(view("r", 33, push))


def test_a_worker_with_num_kv_heads_needs_an_nhd_cache_of_its_heads() -> None:
    host = PluginHost()
    host.load()
    info = EngineInfo(block_size=16, world_size=2, model="m", num_kv_heads=4)
    worker = PDConnector.build_worker(_config("kv_consumer"), info, 1, BuildContext(host=host))
    try:
        with pytest.raises(ValueError, match=r"rank 1 needs a contiguous \[blocks, 2, 16, 2, "):
            worker.register_kv_caches({"l0": torch.zeros(4, 2, 16, 4, 8)})  # all 4 heads
        worker.register_kv_caches({"l0": torch.zeros(4, 2, 16, 2, 8)})
    finally:
        worker.shutdown()


def test_p_refuses_a_decoder_of_another_size_without_num_kv_heads() -> None:
    host = PluginHost()
    host.load()
    info = EngineInfo(block_size=16, world_size=1, model="m")
    worker = PDConnector.build_worker(_config("kv_producer"), info, 0, BuildContext(host=host))
    try:
        worker.register_kv_caches({"l0": torch.zeros(4, 2, 16, 2, 8)})
        req = HandshakeRequest(
            engine_id="D", rank=0, transport="inprocess", transport_metadata=b"x", tp_size=2
        )
        with pytest.raises(ValueError, match="need both to give their connector"):
            worker._respond(req, None)
        worker._respond(attrs.evolve(req, tp_size=1), None)  # equal sizes: served
    finally:
        worker.shutdown()
