"""``KVFrameConnector``: any kvframe connector, run inside vLLM as a ``KVConnectorBase_V1``.

vLLM builds one instance per role: in the scheduler process (``KVConnectorRole.SCHEDULER``) it
wraps the kvframe connector's scheduler half, in each worker (``KVConnectorRole.WORKER``) its
worker half. Every vLLM call is mapped onto kvframe's engine-independent SPI
(:mod:`kvframe.spi.connector`):

=====================================  ====================================================
vLLM calls                             kvframe receives
=====================================  ====================================================
``on_new_request(Request)``            ``on_new_request(RequestView)``
``get_num_new_matched_tokens``         the same, with a ``RequestView``
``update_state_after_alloc``           ``BlockIds`` per KV group; the view's
                                       ``num_computed_tokens`` is the local hit count vLLM
                                       passed to ``get_num_new_matched_tokens``
``build_connector_meta(SchedulerOut)``  ``SchedulerStep`` (:func:`scheduler_step`: block ids,
                                       computed tokens and block hashes per scheduled
                                       request; ``now`` = ``time.monotonic()``);
                                       the result travels as codec bytes in
                                       :class:`KVFrameMetadata` (never pickled objects)
``update_connector_output``            an aggregated ``ConnectorOutput`` of the connector's
                                       class (failures, events and the connector's own typed
                                       records ride in :class:`KVFrameWorkerMeta`)
``request_finished(Request, ids)``     ``RequestView`` with ``finish_reason``; the returned
                                       ``kv_transfer_params`` go back to the client as is
``has_pending_push_work()``            ``has_pending_work()``: vLLM keeps stepping while a
                                       producer holds leases or a consumer waits
``register_kv_caches``                 block-major regions (:func:`kv_regions`)
``get_transfer_results``               ``build_connector_worker_output``: finished ids,
                                       failed loads (``failed_recving``), stats, events
``get_kv_connector_stats``             :class:`~kvframe_vllm.stats.KVFrameStats`
=====================================  ====================================================

The clock: kvframe connectors take time from ``SchedulerStep.now`` and compare it with the
worker's clock (``BuildContext.clock``: ``time.monotonic``); vLLM's wall-clock
``arrival_time`` is mapped onto it. The build context's plugin host is the one the adapter
loaded the kvframe connector from.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from kvframe.errors import CodecError, ConfigError
from kvframe.protocol.aggregate import OutputAggregator
from kvframe.protocol.codec import Codec
from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput, KVEvent, Stats
from kvframe.runtime.metrics import StatsAccumulator
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.connector import (
    BuildContext,
    EngineInfo,
    KVConnector,
    KVConnectorScheduler,
    KVConnectorWorker,
    codec_for,
)
from kvframe.spi.request import BlockIds, as_block_ids
from kvframe_vllm.config import AdapterConfig
from kvframe_vllm.mapping import BlockHashCache, kv_regions, request_view, scheduler_step
from kvframe_vllm.stats import KVFramePromMetrics, KVFrameStats

if TYPE_CHECKING:
    import torch

__all__ = [
    "KVFrameConnector",
    "KVFrameHandshake",
    "KVFrameMetadata",
    "KVFrameWorkerMeta",
    "connector_class",
]

# A child of vLLM's logger, so that vLLM's logging configuration (handlers, level) applies.
logger = logging.getLogger("vllm.kvframe_vllm")

_TROUBLE = ("fail", "error", "bad", "lost", "reject")


def _log_event(event: KVEvent) -> None:
    # Failures are what an operator must see; the rest (job completions, ...) is chatter.
    level = logging.WARNING if any(w in event.kind for w in _TROUBLE) else logging.DEBUG
    logger.log(level, "kvframe event %s %s", event.kind, _thaw(event.data))


@dataclasses.dataclass(frozen=True)
class KVFrameMetadata(KVConnectorMetadata):
    """One step's kvframe ``ConnectorMetadata``, as the kvframe connector's codec bytes."""

    payload: bytes


@dataclasses.dataclass(frozen=True)
class KVFrameHandshake(KVConnectorHandshakeMetadata):
    """A worker rank's kvframe handshake payload (``get_handshake_metadata`` bytes)."""

    payload: bytes


@dataclasses.dataclass(frozen=True)
class KVFrameWorkerMeta(KVConnectorWorkerMetadata):
    """What kvframe workers report that vLLM's ``KVConnectorOutput`` has no field for: each
    rank's kvframe output less what vLLM carries itself (finished ids, invalid blocks, stats)
    — failure reasons, events and the connector's own typed records — encoded with the
    connector's codec, one entry per report, in rank order."""

    reports: tuple[bytes, ...] = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """Concatenate two ranks' reports; raises ``TypeError`` for another metadata type."""
        if not isinstance(other, KVFrameWorkerMeta):
            raise TypeError(f"cannot aggregate KVFrameWorkerMeta with {type(other).__name__}")
        return KVFrameWorkerMeta(reports=self.reports + other.reports)

    @staticmethod
    def pack(codec: Codec, output: ConnectorOutput) -> bytes | None:
        """One rank's report: ``output`` (of the connector's output class) less what vLLM
        carries itself, encoded with the connector's ``codec``; ``None`` when nothing is left
        to report."""
        rest = attrs.evolve(
            output,
            finished_sending=frozenset(),
            finished_recving=frozenset(),
            invalid_block_ids=frozenset(),
            stats=Stats(),
        )
        return None if rest.is_empty else codec.encode(rest)

    def unpack(self, codec: Codec) -> ConnectorOutput:
        """All reports merged as kvframe aggregates ranks
        (:class:`~kvframe.protocol.aggregate.OutputAggregator`: a failure keeps the first
        report's reason, events and typed records are concatenated), in the connector's output
        class. Raises ``ValueError`` for bytes that are not a report (nothing else in the
        engine is affected)."""
        agg = OutputAggregator(max(1, len(self.reports)))
        for i, blob in enumerate(self.reports):
            try:
                agg.add(i, codec.decode_as(blob, ConnectorOutput))
            except (CodecError, TypeError) as exc:
                raise ValueError(f"malformed kvframe worker report: {exc}") from exc
        return agg.take()


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _thaw(v) for k, v in value.items()}
    return value


def connector_class(adapter: AdapterConfig, host: PluginHost | None = None) -> type[KVConnector]:
    """The kvframe connector class ``adapter`` names, from a loaded plugin host.

    Raises :class:`~kvframe.errors.PluginNotFoundError` listing the installed connectors when
    the name is unknown.
    """
    if host is None:
        host = _loaded_host()
    cls: type[KVConnector] = host.connector(adapter.connector)
    return cls


def _loaded_host() -> PluginHost:
    # The adapter is the runtime here: one host per vLLM connector object (and per class-level
    # question, which vLLM asks before any object exists).
    host = PluginHost()
    host.load()
    return host


def _engine_info(vllm_config: Any, kv_cache_config: Any) -> EngineInfo:
    """kvframe's :class:`~kvframe.spi.connector.EngineInfo` for a vLLM engine.

    - ``block_size``: ``cache_config.block_size``; ``num_kv_groups``: the KV cache groups.
    - ``world_size``: ``parallel_config.tensor_parallel_size`` (kvframe's tensor-parallel size;
      each worker's rank is vLLM's tensor-parallel rank, :func:`_tp_rank`). The P/D connector
      puts it in ``kv_transfer_params.tp_size`` and its handshake.
    - ``model``: the served model name (else the model path).
    - ``num_kv_heads`` is **not** passed: kvframe's heterogeneous tensor parallelism needs each
      rank's cache as ``[blocks, 2, block_size, heads, head_size]`` (K/V outermost), and
      vLLM 0.32 hands connectors ``[blocks, heads, block_size, 2 * head_size]`` per layer (its
      ``LBHNC`` layout: K and V side by side in the last dimension), which kvframe's
      ``register_kv_caches`` would refuse. Without it equal tensor-parallel sizes work and a
      different size is refused by the P/D scheduler, naming ``EngineInfo.num_kv_heads``.

    Raises :class:`~kvframe.errors.ConfigError` for ``pipeline_parallel_size`` > 1: ranks
    would then repeat across pipeline stages, and kvframe names a worker by its rank alone.
    """
    model = vllm_config.model_config
    served = getattr(model, "served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or [None]
    parallel = vllm_config.parallel_config
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if pp != 1:
        raise ConfigError(
            f"pipeline_parallel_size = {pp}: KVFrameConnector supports tensor parallelism "
            "only (each worker is named by its tensor-parallel rank); run with "
            "--pipeline-parallel-size 1"
        )
    return EngineInfo(
        block_size=int(vllm_config.cache_config.block_size),
        num_kv_groups=len(groups),
        world_size=int(parallel.tensor_parallel_size),
        # The served name, not the weights' path: two engines serving one model from
        # different directories must still be allowed to exchange KV.
        model=str(served or model.model),
    )


class KVFrameConnector(KVConnectorBase_V1):
    """vLLM's connector class for every kvframe connector (see the module docstring).

    Construct it through vLLM (``kv_connector="KVFrameConnector"``,
    ``kv_connector_module_path="kvframe_vllm"``). Raises
    :class:`~kvframe.errors.ConfigError` for a bad ``kv_connector_extra_config`` (the message
    names the key) and :class:`~kvframe.errors.PluginNotFoundError` for an unknown
    ``kvframe_connector``; nothing is left running then.
    """

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._adapter = AdapterConfig.from_vllm(vllm_config.kv_transfer_config)
        host = _loaded_host()
        # The kvframe connector's build context: this host, and the worker's time.monotonic
        # (kvframe compares it with SchedulerStep.now, which is time.monotonic() too).
        self._ctx = BuildContext(host=host, clock=time.monotonic)
        self._cls = connector_class(self._adapter, host)
        # The SPI's rule: the default codec plus the connector's own message classes.
        self._codec = codec_for(self._cls, self._adapter.config)
        self._engine = _engine_info(vllm_config, kv_cache_config)
        self._num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
        self._scheduler: KVConnectorScheduler | None = None
        self._worker: KVConnectorWorker | None = None
        # scheduler side
        self._step = 0
        self._hashes = BlockHashCache(self._engine.block_size)
        self._local_hits: dict[str, int] = {}
        # Live requests (from allocation to finish): the hashes of blocks filled by generated
        # tokens, which SchedulerStep.block_hashes carries, come from their token ids.
        self._requests: dict[str, Any] = {}
        # Requests whose remote load failed. vLLM recomputes them (policy "recompute") and
        # asks the connector again; without this the same dead source would be tried again.
        self._failed_loads: set[str] = set()
        self._block_pool: Any = None
        # The scheduler half's stats not yet handed to vLLM (get_kv_connector_stats).
        self._sched_stats = StatsAccumulator()
        # worker side
        self._split: dict[str, tuple[str, str]] = {}
        self._pending: ConnectorOutput | None = None
        # Lifetime totals (counters summed, gauges latest), for tests and diagnostics.
        self._totals: dict[str, float] = {}
        self._gauges: dict[str, float] = {}
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._cls.build_scheduler(
                self._adapter.config, self._engine, self._ctx
            )
        else:
            rank = _tp_rank(self._engine.world_size)
            self._worker = self._cls.build_worker(
                self._adapter.config, self._engine, rank, self._ctx
            )

    # -- introspection -----------------------------------------------------------------
    @property
    def adapter_config(self) -> AdapterConfig:
        """The parsed adapter configuration."""
        return self._adapter

    @property
    def kvframe_scheduler(self) -> KVConnectorScheduler | None:
        """The kvframe scheduler half (scheduler role), else ``None``."""
        return self._scheduler

    @property
    def kvframe_worker(self) -> KVConnectorWorker | None:
        """The kvframe worker half (worker role), else ``None``."""
        return self._worker

    def totals(self) -> dict[str, float]:
        """Counters summed since start and the latest gauges of this side's kvframe stats.

        Worker role: this rank's. Scheduler role: the scheduler half's under their own names,
        the workers' (aggregated over ranks, as ``update_connector_output`` received them)
        prefixed ``workers.``, and ``free_blocks`` of vLLM's block pool once it is bound."""
        out = dict(self._totals)
        out.update(self._gauges)
        if self._block_pool is not None:
            out["free_blocks"] = float(self._block_pool.get_num_free_blocks())
        return out

    def _absorb(self, stats: Stats, prefix: str = "") -> None:
        for k, v in stats.counters.items():
            self._totals[prefix + k] = self._totals.get(prefix + k, 0.0) + float(v)
        self._gauges.update({prefix + k: float(v) for k, v in stats.gauges.items()})

    # -- class-level requirements ----------------------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """The kvframe connector's required layout (``"NHD"``/``"HND"``) or ``None``."""
        adapter = AdapterConfig.from_vllm(vllm_config.kv_transfer_config)
        host = _loaded_host()
        ctx = BuildContext(host=host)
        return connector_class(adapter, host).get_required_kvcache_layout(adapter.config, ctx)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Whether the kvframe connector runs per-layer hooks that CUDA graphs would skip."""
        adapter = AdapterConfig.from_fields(kv_role="kv_both", engine_id=None, extra=extra_config)
        inner = adapter.config.kv_connector_extra_config
        host = _loaded_host()
        ctx = BuildContext(host=host)
        return connector_class(adapter, host).requires_piecewise_for_cudagraph(inner, ctx)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVFrameStats:
        """vLLM's stats object for kvframe's counters and gauges."""
        return KVFrameStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVFramePromMetrics:
        """Prometheus metrics for kvframe stats (see :class:`KVFramePromMetrics`)."""
        return KVFramePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- scheduler side --------------------------------------------------------------------
    def _sched(self) -> KVConnectorScheduler:
        if self._scheduler is None:
            raise RuntimeError("a scheduler-side method was called on a worker-role connector")
        return self._scheduler

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """Keep the block pool to report ``free_blocks`` in :meth:`totals`."""
        self._block_pool = gpu_block_pool

    def on_new_request(self, request: Any) -> None:
        """Forward the new request (a consumer starts heartbeats and the handshake here)."""
        self._sched().on_new_request(request_view(request, hashes=self._hashes))

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Forwarded; remembers ``num_computed_tokens`` for ``update_state_after_alloc``. A
        request whose remote load already failed is shown without its ``kv_transfer_params``,
        so it is computed locally rather than loaded again from the same source."""
        self._local_hits[request.request_id] = num_computed_tokens
        view = request_view(
            request,
            hashes=self._hashes,
            num_computed_tokens=num_computed_tokens,
            drop_params=request.request_id in self._failed_loads,
        )
        return self._sched().get_num_new_matched_tokens(view, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Forwarded with the request's blocks per KV group."""
        ids = as_block_ids(blocks.get_block_ids())
        hits = self._local_hits.pop(request.request_id, request.num_computed_tokens)
        self._requests[request.request_id] = request
        view = request_view(
            request,
            hashes=self._hashes,
            num_computed_tokens=hits,
            block_ids=ids,
            drop_params=request.request_id in self._failed_loads,
        )
        self._sched().update_state_after_alloc(view, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVFrameMetadata:
        """The step's kvframe metadata, encoded with the connector's codec."""
        step = scheduler_step(
            scheduler_output,
            step=self._step,
            now=time.monotonic(),
            hashes=self._hashes,
            requests=self._requests,
        )
        self._step += 1
        meta = self._sched().build_connector_meta(step)
        return KVFrameMetadata(payload=self._codec.encode(meta))

    def update_connector_output(self, connector_output: Any) -> None:
        """Hand the aggregated worker output to the kvframe scheduler half (of the connector's
        output class when the workers reported one)."""
        rest = ConnectorOutput()
        wmeta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wmeta, KVFrameWorkerMeta):
            rest = wmeta.unpack(self._codec)
        failures = dict(rest.failures)
        for rid in getattr(connector_output, "failed_recving", None) or ():
            failures.setdefault(rid, "load failed")
        stats = Stats()
        raw = getattr(connector_output, "kv_connector_stats", None)
        if isinstance(raw, KVFrameStats):
            stats = raw.as_kvframe()
            self._absorb(stats, "workers.")
        for ev in rest.events:
            _log_event(ev)
        recving = frozenset(connector_output.finished_recving or ())
        self._failed_loads.update(rid for rid in failures if rid in recving)
        out = attrs.evolve(
            rest,
            finished_sending=frozenset(connector_output.finished_sending or ()),
            finished_recving=recving,
            invalid_block_ids=frozenset(connector_output.invalid_block_ids or ()),
            failures=failures,
            stats=stats,
        )
        self._sched().update_connector_output(out)
        sched_stats = self._sched().get_stats()
        self._absorb(sched_stats)
        self._sched_stats.add(sched_stats)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Forwarded with ``finish_reason``; ``(delay_free, kv_transfer_params)`` back."""
        ids: BlockIds = as_block_ids([block_ids])
        view = request_view(request, hashes=self._hashes, block_ids=ids, finished=True)
        self._hashes.forget(request.request_id)
        self._local_hits.pop(request.request_id, None)
        self._requests.pop(request.request_id, None)
        self._failed_loads.discard(request.request_id)
        return self._sched().request_finished(view, ids)

    def take_events(self) -> Iterable[Any]:
        """kvframe events are connector-specific, not vLLM ``KVCacheEvent`` values: they are
        logged on the ``vllm.kvframe_vllm`` logger (failures as warnings, the rest at debug
        level) instead of published. Returns nothing."""
        for ev in self._sched().take_events():
            _log_event(ev)
        return ()

    def has_pending_push_work(self) -> bool:
        """The kvframe scheduler's ``has_pending_work()``: keeps vLLM's loop stepping while
        leases are held or loads wait, so expiries and completions free blocks when idle."""
        return self._scheduler is not None and self._scheduler.has_pending_work()

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Forward every rank's :class:`KVFrameHandshake` payload."""
        blobs = {int(r): m.payload for r, m in metadata.items() if isinstance(m, KVFrameHandshake)}
        if blobs:
            self._sched().set_xfer_handshake_metadata(blobs)

    # -- worker side -----------------------------------------------------------------------
    def _work(self) -> KVConnectorWorker:
        if self._worker is None:
            raise RuntimeError("a worker-side method was called on a scheduler-role connector")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register vLLM's KV tensors as block-major regions (K/V-first layouts split)."""
        num_blocks = self._num_blocks or int(next(iter(kv_caches.values())).shape[0])
        regions = kv_regions(kv_caches, num_blocks)
        for name in kv_caches:
            if name not in regions:
                self._split[name] = (f"{name}.k", f"{name}.v")
        self._work().register_kv_caches(regions)

    def get_handshake_metadata(self) -> KVFrameHandshake | None:
        """This rank's kvframe handshake payload, wrapped."""
        blob = self._work().get_handshake_metadata()
        return None if blob is None else KVFrameHandshake(payload=blob)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Decode the step's metadata and bind it in the kvframe worker."""
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, KVFrameMetadata):
            raise TypeError(
                f"KVFrameConnector got {type(connector_metadata).__name__} metadata; the "
                "scheduler and the workers must run the same connector"
            )
        meta = self._codec.decode_as(connector_metadata.payload, ConnectorMetadata)
        self._work().bind_connector_metadata(meta)

    def clear_connector_metadata(self) -> None:
        """Forget the step's metadata on both sides."""
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Forwarded (``forward_context`` passes through opaquely)."""
        self._work().start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Forwarded, once per registered region of the layer."""
        for name in self._split.get(layer_name, (layer_name,)):
            self._work().wait_for_layer_load(name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Forwarded; a K/V-first layer is given as its two block-major halves."""
        split = self._split.get(layer_name)
        if split is None:
            self._work().save_kv_layer(layer_name, kv_layer, attn_metadata)
        else:
            self._work().save_kv_layer(split[0], kv_layer[0], attn_metadata)
            self._work().save_kv_layer(split[1], kv_layer[1], attn_metadata)

    def wait_for_save(self) -> None:
        """Forwarded."""
        self._work().wait_for_save()

    def _collect(self, finished_req_ids: set[str]) -> ConnectorOutput:
        out = self._work().build_connector_worker_output(frozenset(finished_req_ids))
        self._pending = out
        self._absorb(out.stats)
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished sends and receives (the rest of the report waits for the other
        getters of this step)."""
        out = self._collect(finished_req_ids)
        return set(out.finished_sending) or None, set(out.finished_recving) or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished sends and receives, and failed receives (kvframe ``failures``)."""
        out = self._collect(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(out.finished_sending),
            finished_recving=set(out.finished_recving),
            failed_recving=set(out.failures) & set(out.finished_recving),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose loads failed (from this step's report)."""
        if self._pending is None:
            return set(self._work().get_block_ids_with_load_errors())
        return set(self._pending.invalid_block_ids)

    def get_kv_connector_stats(self) -> KVFrameStats | None:
        """This step's kvframe stats, or ``None`` when empty (scheduler role: the scheduler
        half's since the last call, which vLLM adds to the workers')."""
        if self._scheduler is not None:
            taken, self._sched_stats = self._sched_stats.snapshot(), StatsAccumulator()
            return None if taken.is_empty else KVFrameStats.from_kvframe(Stats(), taken)
        if self._pending is None or self._pending.stats.is_empty:
            return None
        return KVFrameStats.from_kvframe(self._pending.stats)

    def build_connector_worker_meta(self) -> KVFrameWorkerMeta | None:
        """Failures, events and typed records of this step's report (then the report is
        done)."""
        out, self._pending = self._pending, None
        blob = None if out is None else KVFrameWorkerMeta.pack(self._codec, out)
        return None if blob is None else KVFrameWorkerMeta(reports=(blob,))

    # -- both ------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Shut the kvframe half down (it releases leases, transfers and sockets)."""
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()


def _tp_rank(tp_size: int = 1) -> int:
    """This worker's vLLM tensor-parallel rank: 0 in a one-rank engine whose tensor-parallel
    group is not set up; raises ``RuntimeError`` when ``tp_size`` > 1 and vLLM cannot say
    (every rank would otherwise call itself 0)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, ImportError) as exc:
        if tp_size > 1:
            raise RuntimeError(
                f"KVFrameConnector's worker at tensor_parallel_size {tp_size} could not read "
                f"its rank from vLLM ({type(exc).__name__}: {exc}); vLLM builds worker "
                "connectors after its tensor-parallel group, so this is a vLLM version the "
                "adapter does not know"
            ) from exc
        return 0
