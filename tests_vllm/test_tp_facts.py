"""The tensor-parallel facts the adapter gives kvframe (EngineInfo and the worker's rank), from
vLLM's own configuration objects; no engine runs (well under a second each).

What the adapter passes: vLLM's tensor-parallel size as ``EngineInfo.world_size`` (kvframe's
``tp_size``), vLLM's tensor-parallel rank as the worker's rank, and not ``num_kv_heads``: the
last test shows why (kvframe's heterogeneous-TP layout check refuses vLLM's cache shape).
"""

from __future__ import annotations

import re
import types
from typing import Any

import attrs
import pytest
import torch
from kvframe_vllm.config import AdapterConfig
from kvframe_vllm.mapping import kv_regions

from kvframe.errors import ConfigError
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.connector import BuildContext
from kvframe.spi.request import RequestView

# Importing vLLM imports torch's compiler, which warns of its own deprecations.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

HEADS, HEAD_SIZE, BLOCK, BLOCKS = 4, 32, 32, 8


def _adapter() -> Any:
    from kvframe_vllm import connector

    return connector


def _vllm_config(tp: int = 1, pp: int = 1, served: Any = ("tiny",)) -> Any:
    # vLLM's own config classes for what the adapter reads from them; the model config is a
    # stand-in (vLLM's ModelConfig loads the model's files).
    from vllm.config import CacheConfig, ParallelConfig

    return types.SimpleNamespace(
        parallel_config=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        cache_config=CacheConfig(block_size=BLOCK),
        model_config=types.SimpleNamespace(served_model_name=served, model="/models/tiny"),
    )


def test_engine_info_carries_vllms_tensor_parallel_size_block_size_and_model() -> None:
    for tp in (1, 2, 4):
        info = _adapter()._engine_info(_vllm_config(tp=tp), None)
        assert info.world_size == tp
        assert (info.block_size, info.num_kv_groups, info.model) == (BLOCK, 1, "tiny")
        # Not passed: vLLM's cache shape is not the one heterogeneous TP needs (below).
        assert info.num_kv_heads is None
    groups = types.SimpleNamespace(kv_cache_groups=[object()])
    assert _adapter()._engine_info(_vllm_config(served=None), groups).model == "/models/tiny"


def test_the_workers_rank_is_vllms_tensor_parallel_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.distributed.parallel_state as ps

    # No tensor-parallel group set up (one process): rank 0 at size 1, an error above (all
    # ranks would call themselves 0).
    assert _adapter()._tp_rank(1) == 0
    with pytest.raises(RuntimeError, match="tensor_parallel_size 2 could not read its rank"):
        _adapter()._tp_rank(2)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 3)
    assert _adapter()._tp_rank(4) == 3


def test_pipeline_parallelism_is_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size = 2: .*size 1"):
        _adapter()._engine_info(_vllm_config(tp=2, pp=2), None)


def _pd(role: str) -> tuple[Any, Any, BuildContext]:
    cfg = AdapterConfig.from_fields(
        kv_role=role, engine_id="e0", extra={"kv_lease_duration": 6, "transport": "inprocess"}
    )
    host = PluginHost()
    host.load()
    return host.connector(cfg.connector), cfg.config, BuildContext(host=host)


def test_vllms_cache_shape_registers_without_num_kv_heads_and_is_refused_with_it() -> None:
    # What vLLM 0.32 hands register_kv_caches on CPU (its LBHNC layout):
    # [blocks, KV heads, block_size, 2 * head_size] per layer, K and V side by side.
    cache = {"layers.0.attn": torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE)}
    cls, config, ctx = _pd("kv_both")
    info = _adapter()._engine_info(_vllm_config(), None)
    worker = cls.build_worker(config, info, 0, ctx)
    try:
        worker.register_kv_caches(kv_regions(cache, BLOCKS))
    finally:
        worker.shutdown()
    # Given the model's KV heads, kvframe would need [blocks, 2, block_size, heads, head_dim]
    # and refuses vLLM's shape, naming what it needs: so the adapter does not pass them.
    worker = cls.build_worker(config, attrs.evolve(info, num_kv_heads=HEADS), 0, ctx)
    try:
        with pytest.raises(ValueError, match=r"needs a contiguous \[blocks, 2, 32, 4, head_dim\]"):
            worker.register_kv_caches(kv_regions(cache, BLOCKS))
    finally:
        worker.shutdown()


def test_a_prefill_engine_of_another_tp_size_is_refused_naming_num_kv_heads() -> None:
    cls, config, ctx = _pd("kv_consumer")
    info = _adapter()._engine_info(_vllm_config(tp=2), None)
    sched = cls.build_scheduler(config, info, ctx)
    ticket = {
        "do_remote_prefill": True,
        "remote_engine_id": "P",
        "remote_request_id": "0" * 32,
        "remote_host": "127.0.0.1",
        "remote_port": 5555,
        "remote_block_ids": [[1, 2]],
        "remote_num_tokens": 64,
        "transport": "inprocess",
        "lease_duration": 6.0,
        "lease_expires_at": 100.0,
    }
    try:
        # Equal sizes are served; another size is refused (D prefills it locally instead).
        sched.check_request(_view({**ticket, "tp_size": 2}))
        with pytest.raises(ConfigError, match=r"tp_size = 4 but this engine has 2 .*num_kv_heads"):
            sched.check_request(_view({**ticket, "tp_size": 4}))
    finally:
        sched.shutdown()


def _view(params: dict[str, Any]) -> RequestView:
    return RequestView(
        request_id="r",
        num_prompt_tokens=65,
        prompt_token_ids=list(range(65)),
        kv_transfer_params=params,
    )


def _layer_cache(head_size: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    # vLLM 0.32's CPU KV cache of one layer, as register_kv_caches receives it.
    return {
        "model.layers.0.self_attn.attn": torch.zeros(
            BLOCKS, HEADS, BLOCK, 2 * head_size, dtype=dtype
        )
    }


_LAYOUT_CASES = [
    ("same", _layer_cache(HEAD_SIZE), ""),
    (
        "head_size",
        _layer_cache(2 * HEAD_SIZE),
        r"layer 'model\.layers\.0\.self_attn\.attn': this engine \[4, 32, 64\] torch\.float32, "
        r"the peer \[4, 32, 128\] torch\.float32; serve the same model with the same KV cache "
        r"shape on both engines",
    ),
    (
        "dtype",
        _layer_cache(HEAD_SIZE, torch.bfloat16),
        r"dtype: this engine torch\.float32, the peer torch\.bfloat16; run both engines with one "
        r"KV cache dtype",
    ),
]


@pytest.mark.parametrize(
    ("name", "d_cache", "expected"), _LAYOUT_CASES, ids=[c[0] for c in _LAYOUT_CASES]
)
def test_two_vllm_engines_layout_mismatch_is_refused_at_the_handshake(
    name: str, d_cache: dict[str, torch.Tensor], expected: str
) -> None:
    # Two workers as the adapter builds them (its EngineInfo, vLLM's CPU cache through
    # kv_regions), handshaking over pyzmq on loopback as two vLLM engines would.
    import time

    from kvframe.connectors.pd.peers import PeerState

    cls, _, ctx = _pd("kv_both")
    info = _adapter()._engine_info(_vllm_config(), None)

    def worker(role: str, engine_id: str, cache: dict[str, torch.Tensor]) -> Any:
        cfg = AdapterConfig.from_fields(
            kv_role=role, engine_id=engine_id, extra={"transport": "inprocess"}
        )
        w = cls.build_worker(cfg.config, info, 0, ctx)
        w.register_kv_caches(kv_regions(cache, BLOCKS))
        return w

    p = worker("kv_producer", "P", _layer_cache(HEAD_SIZE))
    d = worker("kv_consumer", "D", d_cache)
    try:
        entry = d._engines.ensure("P", 0, "127.0.0.1", p._server.port, time.monotonic())
        deadline = time.monotonic() + 10
        while entry.state is PeerState.CONNECTING and time.monotonic() < deadline:
            time.sleep(0.02)
            d._engines.poll(time.monotonic(), lambda _e: True)
        if not expected:
            assert entry.state is PeerState.READY
            facts = entry.response.kv_layout
            assert (facts.order, facts.block_size, facts.tp_size) == ("block-major", BLOCK, 1)
            assert (facts.head_size, facts.num_kv_heads) == (0, 0)
            assert [(x.shape, x.dtype) for x in facts.layers] == [
                ((HEADS, BLOCK, 2 * HEAD_SIZE), "torch.float32")
            ]
            return
        assert entry.state is PeerState.FAILED
        assert entry.peer is None
        assert "KV layout mismatch with the decoder, nothing is read" in (entry.error or "")
        assert re.search(expected, entry.error or ""), entry.error
    finally:
        d.shutdown()
        p.shutdown()
