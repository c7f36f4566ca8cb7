"""A permuting load whose READ fails half-way (``allow_layout_permute``, issue 14 item 3): the
bytes that landed stay in D's staging area, nothing reaches D's KV cache, and the load is not
reported valid (no external tokens; the staging slots are free again; both engines clean).

Two reference engines (P HND, D NHD) over the in-process transport, whose fault rules make the
READ fail after half of its descriptors were copied. The paths that succeed run over NIXL in
``test_layout_permute_nixl.py``.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from kvframe_refengine import Engine, EngineConfig, FinishReason, ModelConfig

from kvframe.config import KVTransferConfig
from kvframe.runtime.plugins import PluginHost
from kvframe.testing.faults import Faults

MODEL = ModelConfig(seed=5)


def _engine(role: str, engine_id: str, order: str, host: PluginHost, **extra: Any) -> Engine:
    kv = KVTransferConfig.from_dict(
        {
            "kv_connector": "PDConnector",
            "kv_role": role,
            "engine_id": engine_id,
            "kv_lease_duration": 1.2,
            "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {"transport": "inprocess", **extra},
        }
    )
    cfg = EngineConfig(model=MODEL, block_size=8, num_blocks=32, kv_cache_order=order)
    return Engine(cfg, kv, plugin_host=host)


def _step_until(engines: list[Engine], cond: Any, timeout: float = 6.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        for e in engines:
            e.step()
        time.sleep(0.001)


def test_a_half_failed_permuting_read_never_reaches_the_cache() -> None:
    host = PluginHost(autoload=False, env={})
    host.load()
    p = _engine("kv_producer", "lfP", "HND", host)
    d = _engine("kv_consumer", "lfD", "NHD", host, allow_layout_permute=True)
    try:
        prompt = torch.randint(
            0, MODEL.vocab_size, (33,), generator=torch.Generator().manual_seed(1)
        )
        p.add_request("r", prompt.tolist(), 1, {"do_remote_decode": True})
        params: dict[str, Any] = {}

        def prefilled() -> bool:
            for out in p.step():
                if out.finished and out.kv_transfer_params is not None:
                    params.update(out.kv_transfer_params)
            return bool(params)

        _step_until([], prefilled)
        worker: Any = d.connector_worker
        transport = worker.transport
        Faults.of(transport.fabric).fail_transfers(endpoint=transport.name, written=0.5)
        d.add_request("d", prompt.tolist(), 4, params)
        finals: dict[str, Any] = {}

        def finished() -> bool:
            for out in d.step():
                if out.finished:
                    finals[out.request_id] = out
            return "d" in finals

        _step_until([p], finished)
        out = finals["d"]
        assert out.finish_reason is FinishReason.ERROR
        assert out.num_external_tokens == 0  # nothing loaded was reported valid
        # Half of the READ landed, in the staging area only; D's cache never saw a byte.
        assert any(int(t.count_nonzero()) for t in worker._staging_tensors)
        assert all(int(t.count_nonzero()) == 0 for t in d.runner.kv_caches)
        stats = d.connector_stats()
        assert stats.get("loads_permuted", 0) == 0
        assert stats.get("loads_done", 0) == 0
        assert worker._staging.free == worker._staging.size
        _step_until([p, d], lambda: not (p.has_unfinished_work() or d.has_unfinished_work()))
        p.check_no_leaks()
        d.check_no_leaks()
    finally:
        d.shutdown()
        p.shutdown()


def test_an_hnd_engine_computes_with_an_hnd_cache() -> None:
    # The same prompts on an NHD and an HND engine: the same tokens (the greedy reference's),
    # and each cache holds the same K/V, in its own order (the model wrote it so).
    from kvframe_refengine import greedy_reference
    from kvframe_refengine.model import TinyLM

    prompts = [[(7 * i + 3) % MODEL.vocab_size for i in range(21)], [5, 9, 2]]
    caches: dict[str, Any] = {}
    for order in ("NHD", "HND"):
        cfg = EngineConfig(model=MODEL, block_size=8, num_blocks=16, kv_cache_order=order)
        with Engine(cfg) as engine:
            outs = engine.generate(prompts, 3)
            want = [greedy_reference(TinyLM(MODEL), p, 3) for p in prompts]
            assert [list(o.token_ids) for o in outs] == want
            (caches[order],) = engine.read_kv(list(range(16)))
            assert engine.engine_info().kv_cache_order == order
    nhd, hnd = caches["NHD"], caches["HND"]
    assert hnd.shape == (nhd.shape[0], 16, 2, MODEL.num_kv_heads, 8, nhd.shape[-1])
    assert int(nhd.count_nonzero()) > 0
    assert torch.equal(hnd.transpose(3, 4), nhd)
    with pytest.raises(ValueError, match="kv_cache_order"):
        EngineConfig(model=MODEL, kv_cache_order="block-major")
