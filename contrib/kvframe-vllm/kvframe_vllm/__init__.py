"""Run kvframe connectors inside vLLM.

Load it with vLLM's ``--kv-transfer-config``::

    {"kv_connector": "KVFrameConnector", "kv_connector_module_path": "kvframe_vllm",
     "kv_role": "kv_both", "engine_id": "prefill-0",
     "kv_connector_extra_config": {"kvframe_connector": "PDConnector",
                                   "transport": "nixl"}}

See ``docs/vllm.md`` and :mod:`kvframe_vllm.config` for the keys. The names that need vLLM
are imported on first use, so that :mod:`kvframe_vllm.config`, :mod:`kvframe_vllm.host` and
:mod:`kvframe_vllm.tiny` load without importing vLLM (and torch).
"""

from __future__ import annotations

import importlib
from typing import Any

from kvframe_vllm.config import AdapterConfig

__all__ = [
    "AdapterConfig",
    "KVFrameConnector",
    "KVFrameHandshake",
    "KVFrameMetadata",
    "KVFramePromMetrics",
    "KVFrameStats",
    "KVFrameWorkerMeta",
    "connector_class",
]

_LAZY = {
    "KVFrameConnector": "kvframe_vllm.connector",
    "KVFrameHandshake": "kvframe_vllm.connector",
    "KVFrameMetadata": "kvframe_vllm.connector",
    "KVFrameWorkerMeta": "kvframe_vllm.connector",
    "connector_class": "kvframe_vllm.connector",
    "KVFramePromMetrics": "kvframe_vllm.stats",
    "KVFrameStats": "kvframe_vllm.stats",
}


def __getattr__(name: str) -> Any:
    # vLLM resolves kv_connector with getattr(module, name), which reaches this.
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvframe_vllm' has no attribute {name!r}")
