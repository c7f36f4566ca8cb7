"""Run kvframe connectors inside vLLM.

Load it with vLLM's ``--kv-transfer-config``::

    {"kv_connector": "KVFrameConnector", "kv_connector_module_path": "kvframe_vllm",
     "kv_role": "kv_both", "engine_id": "prefill-0",
     "kv_connector_extra_config": {"kvframe_connector": "PDConnector",
                                   "transport": "nixl"}}

See ``docs/vllm.md`` and :mod:`kvframe_vllm.config` for the keys.
"""

from __future__ import annotations

from kvframe_vllm.config import AdapterConfig
from kvframe_vllm.connector import (
    KVFrameConnector,
    KVFrameHandshake,
    KVFrameMetadata,
    KVFrameWorkerMeta,
    connector_class,
)
from kvframe_vllm.stats import KVFramePromMetrics, KVFrameStats

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
