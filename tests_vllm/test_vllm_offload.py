"""kvframe's offloading connector inside a real vLLM engine: the adapter runs a connector with
synchronous, layer-by-layer loads and stores during steps (from the per-step block ids,
computed tokens and block hashes the adapter maps from vLLM's scheduler output), unchanged."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvframe_vllm.host import EngineProcess
from kvframe_vllm.tiny import prompt_ids

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def engine(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    config = {
        "kv_connector": "KVFrameConnector",
        "kv_connector_module_path": "kvframe_vllm",
        "kv_role": "kv_both",
        "engine_id": "offload-0",
        # The merged form: the connector's own options next to kvframe_connector.
        "kv_connector_extra_config": {
            "kvframe_connector": "OffloadingConnector",
            "tiers": [{"tier": "cpu", "capacity_bytes": 64 << 20}],
        },
    }
    e = EngineProcess(
        "OFF",
        model=models["a"],
        kv_transfer_config=config,
        log_dir=tmp_path_factory.mktemp("offload-logs"),
        core=0,
    )
    try:
        e.wait_ready(300)
        yield e
    finally:
        e.close()


def _idle(e: EngineProcess) -> dict[str, Any]:
    deadline = time.monotonic() + 10
    while True:
        st = e.call("state")
        if not st["has_requests"] or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def test_second_run_loads_from_the_cpu_tier_and_matches(engine: EngineProcess) -> None:
    prompts = [prompt_ids(i, 100) for i in range(2)]  # 3 full blocks each
    first = engine.call("generate", prompts=prompts, max_tokens=8, params=[None, None])
    st = _idle(engine)
    assert st["worker"].get("store_blocks", 0) == 6, st
    # Stored in the steps that computed them, not at finish (no delayed free needed).
    assert st["scheduler"].get("stores_during_steps", 0) == 6, st
    assert st["free_blocks"] == st["total_blocks"] - 1  # stores done: blocks released
    # Empty vLLM's own prefix cache so that only the CPU tier can supply the prefix.
    assert engine.call("reset_prefix_cache")["ok"]
    second = engine.call("generate", prompts=prompts, max_tokens=8, params=[None, None])
    assert [o["token_ids"] for o in second["outputs"]] == [o["token_ids"] for o in first["outputs"]]
    st = _idle(engine)
    assert st["worker"].get("load_blocks", 0) == 6, st
    assert st["scheduler"].get("hit_blocks", 0) == 6, st
    assert not st["has_requests"]
    assert st["free_blocks"] == st["total_blocks"] - 1
