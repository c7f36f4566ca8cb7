"""The P/D connector: prefill hands its KV to decode across processes and hosts, under leases.

Registered as ``"PDConnector"`` (built-in). See ``docs/pd.md`` for the protocol, the
``kv_transfer_params`` fields, the safety argument and the configuration keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvframe.config import KVTransferConfig
from kvframe.connectors.pd.options import PDOptions
from kvframe.connectors.pd.params import RemotePrefillParams
from kvframe.connectors.pd.scheduler import PDConnectorScheduler
from kvframe.connectors.pd.worker import PDConnectorWorker
from kvframe.errors import ConfigError
from kvframe.spi.connector import BuildContext, EngineInfo, KVConnector, codec_for
from kvframe.spi.hookspecs import hookimpl

__all__ = [
    "PDConnector",
    "PDConnectorScheduler",
    "PDConnectorWorker",
    "PDOptions",
    "RemotePrefillParams",
    "kvframe_register_connectors",
]


class PDConnector(KVConnector):
    """Prefill/decode disaggregation over any transport plugin with READ and notifications."""

    @classmethod
    def requires_piecewise_for_cudagraph(
        cls, extra_config: Mapping[str, Any], ctx: BuildContext
    ) -> bool:
        """No: loads are asynchronous and whole-request, no per-layer hook runs."""
        return False

    @classmethod
    def metadata_types(cls, config: KVTransferConfig) -> Mapping[str, type[Any]]:
        """The P/D step metadata (tag ``pd.metadata``) and each P worker's side-channel address
        (``pd.worker_address``, its handshake metadata); the workers report the generic
        ``ConnectorOutput``. (The side-channel handshake between engines has its own messages,
        in :mod:`kvframe.connectors.pd.handshake`: they never travel between the halves.)"""
        from kvframe.connectors.pd.metadata import PDMetadata, PDWorkerAddress

        return {"pd.metadata": PDMetadata, "pd.worker_address": PDWorkerAddress}

    @classmethod
    def build_scheduler(
        cls, config: KVTransferConfig, engine: EngineInfo, ctx: BuildContext
    ) -> PDConnectorScheduler:
        """Build the scheduler half (it needs no plugin: time comes from each step)."""
        return PDConnectorScheduler(
            config,
            engine,
            PDOptions.from_extra(config.kv_connector_extra_config, config.kv_lease_duration),
            codec=codec_for(cls, config),
        )

    @classmethod
    def build_worker(
        cls, config: KVTransferConfig, engine: EngineInfo, rank: int, ctx: BuildContext
    ) -> PDConnectorWorker:
        """Build a worker: its transport comes from ``ctx.host``, its time from ``ctx.clock``
        (tests pass a fake or skewed clock)."""
        options = PDOptions.from_extra(config.kv_connector_extra_config, config.kv_lease_duration)
        if config.engine_id is None:
            raise ConfigError("engine_id is required by PDConnector")
        return PDConnectorWorker(
            config,
            engine,
            rank,
            options,
            host=ctx.host,
            clock=ctx.clock,
            codec=codec_for(cls, config),
        )


@hookimpl
def kvframe_register_connectors(register: Any) -> None:
    """Register the built-in P/D connector."""
    register("PDConnector", PDConnector)
