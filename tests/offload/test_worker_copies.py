"""The worker's copies: runs of consecutive blocks and slots, and scattered ones, land exactly."""

from __future__ import annotations

import random

import pytest
import torch

from kvframe.config import KVTransferConfig
from kvframe.connectors.offload import OffloadingConnector
from kvframe.connectors.offload.metadata import LoadJob, OffloadMetadata, StoreJob
from kvframe.spi.connector import EngineInfo
from tests.contexts import build_context


@pytest.mark.parametrize("host_copies", [True, False], ids=["numpy", "torch"])
def test_scattered_and_consecutive_blocks_round_trip_exactly(host_copies: bool) -> None:
    """Both copy paths: numpy's for a KV cache in host memory (the worker's choice here) and
    torch's, which a KV cache on a device takes (forced by dropping the host views)."""
    kv_cfg = KVTransferConfig.from_dict(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "tiers": [{"tier": "cpu", "capacity_bytes": 64 * 3 * 512}]
            },
        }
    )
    worker = OffloadingConnector.build_worker(kv_cfg, EngineInfo(block_size=16), 0, build_context())
    kv = {f"l{i}": torch.rand((40, 2, 4, 16)) for i in range(3)}  # 512 bytes per block per layer
    worker.register_kv_caches(kv)
    assert set(worker._host_layers) == set(kv)  # host memory: the numpy copies
    if not host_copies:
        worker._host_layers.clear()
    try:
        rng = random.Random(3)
        blocks = (*range(4, 12), *rng.sample(range(12, 40), 10))  # a run, then scattered
        slots = (*range(20, 28), *rng.sample(range(20), 10))
        keys = tuple(i.to_bytes(32, "little") for i in range(len(blocks)))
        expected = {n: t[list(blocks)].clone() for n, t in kv.items()}
        job = StoreJob(job_id=1, request_id="r", block_ids=blocks, keys=keys, slots=slots)
        worker.bind_connector_metadata(OffloadMetadata(offload_stores=(job,)))
        worker.start_load_kv(None)
        for name, t in kv.items():
            worker.save_kv_layer(name, t, None)
        worker.wait_for_save()
        worker.wait_idle()
        assert worker.get_finished(frozenset())[0] == {"r"}
        worker.clear_connector_metadata()
        for t in kv.values():
            t.zero_()
        targets = tuple(reversed(range(len(blocks))))  # other blocks, in another order
        worker.bind_connector_metadata(
            OffloadMetadata(
                offload_loads=(LoadJob(request_id="r", block_ids=targets, slots=slots),)
            )
        )
        worker.start_load_kv(None)
        for name in kv:
            worker.wait_for_layer_load(name)
        worker.wait_for_save()
        worker.clear_connector_metadata()
        assert worker.get_block_ids_with_load_errors() == set()
        for name, t in kv.items():
            assert torch.equal(t[list(targets)], expected[name])
    finally:
        worker.shutdown()
