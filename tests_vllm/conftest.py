"""Fixtures of the vLLM suite: tiny models built here, and vLLM engine processes shared by the
tests of a module (engine start-up is most of the cost).

This directory runs only in the separate ``.venv-vllm`` virtualenv (``./dev test`` sets it up
and runs it after the main suite); the main ``.venv`` has no vLLM.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvframe_vllm.host import EngineProcess
from kvframe_vllm.tiny import build_in_subprocess

LEASE_SECONDS = 4.0
"""P's kv_lease_duration in these tests: short, so the decode-death test waits seconds."""


def kv_config(engine_id: str, *, lease: float = LEASE_SECONDS) -> dict[str, Any]:
    """vLLM's --kv-transfer-config running kvframe's P/D connector over NIXL (nested form)."""
    return {
        "kv_connector": "KVFrameConnector",
        "kv_connector_module_path": "kvframe_vllm",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            "kvframe_connector": "PDConnector",
            "kvframe": {
                "kv_lease_duration": lease,
                "kv_connector_extra_config": {"transport": "nixl"},
            },
        },
    }


def multi_kv_config(engine_id: str, *, lease: float = LEASE_SECONDS) -> dict[str, Any]:
    """A decode engine's configuration: kvframe's MultiConnector with the P/D connector (loads
    from prefill engines) and the offloading connector (keeps what was loaded in a CPU tier).
    A failed load is recomputed locally (vLLM's own key, passed on to kvframe)."""
    return {
        "kv_connector": "KVFrameConnector",
        "kv_connector_module_path": "kvframe_vllm",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "kvframe_connector": "MultiConnector",
            "kvframe": {
                "kv_lease_duration": lease,
                "kv_connector_extra_config": {
                    "connectors": [
                        {
                            "kv_connector": "PDConnector",
                            "kv_connector_extra_config": {"transport": "nixl"},
                        },
                        {
                            "kv_connector": "OffloadingConnector",
                            "kv_connector_extra_config": {
                                "tiers": [{"tier": "cpu", "capacity_bytes": 64 << 20}]
                            },
                        },
                    ]
                },
            },
        },
    }


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny Llamas with one tokenizer: ``a`` (seed 0) and ``b`` (seed 1, other weights)."""
    root = tmp_path_factory.mktemp("models")
    return {
        "a": build_in_subprocess(root / "a", seed=0),
        "b": build_in_subprocess(root / "b", seed=1),
    }


@pytest.fixture(scope="module")
def engines(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, EngineProcess]]:
    """P (weights a), D (weights a; MultiConnector: P/D + offloading) and P2 (weights b),
    started together; each on its own core where possible. Closed (or killed) at the end of
    the module."""
    logs = tmp_path_factory.mktemp("engine-logs")
    specs = {
        "P": ("prefill-0", models["a"], 0),
        "D": ("decode-0", models["a"], 1),
        "P2": ("prefill-1", models["b"], 0),
    }
    procs: dict[str, EngineProcess] = {}
    try:
        for name, (eid, model, core) in specs.items():
            config = multi_kv_config(eid) if name == "D" else kv_config(eid)
            procs[name] = EngineProcess(
                name, model=model, kv_transfer_config=config, log_dir=logs, core=core
            )
        with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
            for fut in [pool.submit(p.wait_ready, 300.0) for p in procs.values()]:
                fut.result()
        yield procs
    finally:
        for p in procs.values():
            p.close()
