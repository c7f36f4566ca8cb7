"""The offloading connector: keeps KV blocks in host memory and on disk, loads them back.

Registered as ``"OffloadingConnector"`` (built-in), with the tiers ``"cpu"`` and ``"disk"``
and the eviction policies ``"lru"`` and ``"arc"``. See ``docs/offloading.md`` for the
configuration keys, the tier and policy contracts (:mod:`kvframe.spi.offload`) and the
failure behaviour.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvframe.config import KVTransferConfig
from kvframe.connectors.offload.manager import TieredOffloadManager
from kvframe.connectors.offload.metadata import JobReport, OffloadMetadata, OffloadOutput
from kvframe.connectors.offload.options import OffloadOptions
from kvframe.connectors.offload.policies import ARCPolicy, LRUPolicy
from kvframe.connectors.offload.scheduler import OffloadingScheduler
from kvframe.connectors.offload.tiers import CPUTier, DiskTier, create_cpu_tier, create_disk_tier
from kvframe.connectors.offload.worker import OffloadingWorker
from kvframe.spi.connector import BuildContext, EngineInfo, KVConnector
from kvframe.spi.hookspecs import hookimpl

__all__ = [
    "ARCPolicy",
    "CPUTier",
    "DiskTier",
    "JobReport",
    "LRUPolicy",
    "OffloadMetadata",
    "OffloadOptions",
    "OffloadOutput",
    "OffloadingConnector",
    "OffloadingScheduler",
    "OffloadingWorker",
    "TieredOffloadManager",
    "kvframe_register_connectors",
    "kvframe_register_eviction_policies",
    "kvframe_register_offload_tiers",
]


class OffloadingConnector(KVConnector):
    """Offload KV blocks to tiers (host memory, disk, plugins) and load them back layer by
    layer. The engine encodes its messages with ``codec_for(OffloadingConnector, config)``."""

    @classmethod
    def metadata_types(cls, config: KVTransferConfig) -> Mapping[str, type[Any]]:
        """The step metadata (tag ``offload.metadata``, :class:`OffloadMetadata`) and the
        workers' output with their job reports (tag ``offload.output``,
        :class:`OffloadOutput`)."""
        return {"offload.metadata": OffloadMetadata, "offload.output": OffloadOutput}

    @classmethod
    def requires_piecewise_for_cudagraph(
        cls, extra_config: Mapping[str, Any], ctx: BuildContext
    ) -> bool:
        """Yes: loads run layer by layer in the forward pass (``wait_for_layer_load``) and
        stores are posted from ``save_kv_layer``."""
        return True

    @classmethod
    def build_scheduler(
        cls, config: KVTransferConfig, engine: EngineInfo, ctx: BuildContext
    ) -> OffloadingScheduler:
        """Build the scheduler half; the tiers and the eviction policy come from
        ``ctx.host``."""
        options = OffloadOptions.from_extra(config.kv_connector_extra_config)
        return OffloadingScheduler(config, engine, options, ctx.host)

    @classmethod
    def build_worker(
        cls, config: KVTransferConfig, engine: EngineInfo, rank: int, ctx: BuildContext
    ) -> OffloadingWorker:
        """Build the worker half for ``rank``; the tiers come from ``ctx.host``."""
        options = OffloadOptions.from_extra(config.kv_connector_extra_config)
        return OffloadingWorker(config, engine, rank, options, ctx.host)


@hookimpl
def kvframe_register_connectors(register: Any) -> None:
    """Register the built-in offloading connector."""
    register("OffloadingConnector", OffloadingConnector)


@hookimpl
def kvframe_register_offload_tiers(register: Any) -> None:
    """Register the built-in tiers ``cpu`` and ``disk``."""
    register("cpu", create_cpu_tier)
    register("disk", create_disk_tier)


@hookimpl
def kvframe_register_eviction_policies(register: Any) -> None:
    """Register the built-in eviction policies ``lru`` and ``arc``."""
    register("lru", LRUPolicy)
    register("arc", ARCPolicy)
