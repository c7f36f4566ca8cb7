"""The offloading connector's scheduler side: lookups, load and store plans, job outcomes.

**When blocks are stored.** As soon as they are computed: when the engine reports per-step
state (:class:`~kvframe.spi.connector.SchedulerStep` ``num_computed_tokens``, ``new_block_ids``
and ``block_hashes``), every step stores each scheduled request's full blocks whose KV is
complete once the step's forward pass ran and whose hash is known, during prefill and decode
alike. The workers copy them out layer by layer from ``save_kv_layer`` (right after the layer
wrote them) and finish before ``wait_for_save`` returns, because the engine may free and
reuse a running request's blocks right after the step. So a second request sharing the prefix
hits them while the first one is still decoding, and ``request_finished`` has nothing left to
store: it returns ``delay_free=False``.

``request_finished`` stores what is left (``delay_free=True``; the engine keeps the blocks
until the workers report the request in ``finished_sending``): everything for an engine that
does not report per-step state, and the full blocks a step could not name (their hash came
after their KV).

**Only computed KV is stored** (vLLM issue #34526): a request that was never scheduled after
its allocation (its external KV was still loading, by this connector or by another one in a
MultiConnector, when it was aborted) stores only the blocks it had locally at allocation; a
request that ran stores what ``num_computed_tokens`` says it computed. A store during a step
whose request had a block reported invalid (a failed load) drops every key from the first
invalid block on: that KV was computed over undefined input.

**Loads** are synchronous (``load_is_async=False``): the blocks found ready in the memory tier
are pinned at lookup and copied layer by layer during the next forward pass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import msgpack

from kvframe.config import KVTransferConfig
from kvframe.connectors.offload.manager import TieredOffloadManager
from kvframe.connectors.offload.metadata import (
    CopyJob,
    JobReport,
    LoadJob,
    OffloadMetadata,
    OffloadOutput,
    RemoveJob,
    StoreJob,
)
from kvframe.connectors.offload.options import OffloadOptions
from kvframe.errors import ConfigError, KVFrameError
from kvframe.protocol.messages import ConnectorOutput, KVEvent, Stats
from kvframe.spi.connector import EngineInfo, KVConnectorScheduler, PluginLookup, SchedulerStep
from kvframe.spi.offload import (
    EvictionPolicy,
    LookupStatus,
    OffloadTier,
    PolicyConfig,
    TierConfig,
    offload_key,
)
from kvframe.spi.request import BlockIds, RequestView

__all__ = ["OffloadingScheduler", "build_tiers", "check_components"]


@attrs.define(eq=False)
class _Req:
    keys: list[bytes] = attrs.Factory(list)
    hashes: int = 0
    pinned: tuple[bytes, ...] = ()
    slots: tuple[int, ...] = ()
    first_block: int = 0
    waited: int = 0
    computed_at_alloc: int = 0
    allocated: bool = False
    ran_after_alloc: bool = False
    block_ids: list[int] = attrs.Factory(list)
    # Leading blocks already handled by stores during steps (stored, present, or refused).
    stored: int = 0


@attrs.frozen
class _StepStore:
    request_id: str
    keys: tuple[bytes, ...]
    positions: tuple[int, ...]
    """Block index in the request of each key."""
    blocks: tuple[int, ...]
    """The request's blocks up to the last one stored, to find an invalid block before them."""


def check_components(host: PluginLookup, options: OffloadOptions) -> None:
    """Raise :class:`~kvframe.errors.ConfigError` naming the key when a configured tier or the
    eviction policy is not registered in ``host`` (the message lists what is)."""
    for t in options.tiers:
        try:
            host.offload_tier(t.tier)
        except KVFrameError as exc:
            raise ConfigError(f"{t.path}.tier: {exc}") from exc
    try:
        host.eviction_policy(options.eviction_policy)
    except KVFrameError as exc:
        raise ConfigError(f"kv_connector_extra_config.eviction_policy: {exc}") from exc


def build_tiers(host: PluginLookup, options: OffloadOptions, block_bytes: int) -> list[OffloadTier]:
    """Build every configured tier through its registered factory (nothing is opened).

    Raises :class:`~kvframe.errors.ConfigError` for a factory that refuses its options, that
    returns something that is not an :class:`~kvframe.spi.offload.OffloadTier`, or when tier
    0 is not a :class:`~kvframe.spi.offload.MemoryTier`.
    """
    from kvframe.spi.offload import MemoryTier

    tiers: list[OffloadTier] = []
    for i, t in enumerate(options.tiers):
        config = TierConfig(
            name=t.tier,
            index=i,
            capacity_bytes=t.capacity_bytes,
            block_bytes=block_bytes,
            options=t.options,
            path=t.path,
        )
        factory = host.offload_tier(t.tier)
        tier = factory(config)
        if not isinstance(tier, OffloadTier):
            raise ConfigError(
                f"{t.path}.tier: the factory of tier {t.tier!r} returned "
                f"{type(tier).__name__}, not a kvframe.spi.offload.OffloadTier"
            )
        if i == 0 and not isinstance(tier, MemoryTier):
            raise ConfigError(
                f"{t.path}.tier: the first tier must be a memory tier (loads copy from it); "
                f"{t.tier!r} is not a kvframe.spi.offload.MemoryTier. Put 'cpu' first"
            )
        if tier.capacity_blocks < 1:
            raise ConfigError(
                f"{t.path}.capacity_bytes: got {t.capacity_bytes}; it holds no block of "
                f"{block_bytes} bytes"
            )
        tiers.append(tier)
    return tiers


class OffloadingScheduler(KVConnectorScheduler):
    """Scheduler half of :class:`~kvframe.connectors.offload.OffloadingConnector`.

    The manager is built when the workers' handshake metadata arrives
    (``set_xfer_handshake_metadata``: it carries the bytes per block and the KV layout); until
    then every lookup is a miss and nothing is stored.
    """

    def __init__(
        self,
        config: KVTransferConfig,
        engine: EngineInfo,
        options: OffloadOptions,
        host: PluginLookup,
    ) -> None:
        check_components(host, options)
        self._config = config
        self._engine = engine
        self._options = options
        self._host = host
        self.manager: TieredOffloadManager | None = None
        self._namespace = b""
        self._reqs: dict[str, _Req] = {}
        self._loads: list[LoadJob] = []
        self._sent_loads: list[tuple[bytes, ...]] = []
        self._stores: list[StoreJob] = []
        self._store_keys: dict[int, tuple[bytes, ...]] = {}
        self._step_jobs: dict[int, _StepStore] = {}
        self._poisoned: dict[int, set[bytes]] = {}
        self._held: set[str] = set()
        self._reports: dict[int, list[JobReport]] = {}
        self._events: list[KVEvent] = []
        self._counters: dict[str, int] = {}
        self._warned = False

    # -- start-up ----------------------------------------------------------------------------
    def set_xfer_handshake_metadata(self, metadata: Mapping[int, bytes]) -> None:
        """Build the manager from the workers' block size and layout (all ranks must agree on
        the layout; ``block_bytes`` is per rank, so capacities are per rank too)."""
        infos: list[dict[str, Any]] = []
        for rank, blob in sorted(metadata.items()):
            try:
                info = msgpack.unpackb(blob, raw=False)
                infos.append(
                    {"block_bytes": int(info["block_bytes"]), "layout": str(info["layout"])}
                )
            except Exception as exc:
                raise ConfigError(
                    f"worker {rank} sent malformed offloading handshake metadata: {exc}"
                ) from exc
        if not infos:
            return
        if len({(i["block_bytes"], i["layout"]) for i in infos}) > 1:
            raise ConfigError(
                f"workers disagree on the KV layout: {infos}; every rank must hold equal slices"
            )
        block_bytes = infos[0]["block_bytes"]
        self._namespace = "|".join(
            (
                self._engine.model,
                str(self._engine.block_size),
                infos[0]["layout"],
                self._options.namespace,
            )
        ).encode()
        tiers = build_tiers(self._host, self._options, block_bytes)
        policy_factory = self._host.eviction_policy(self._options.eviction_policy)
        specs: list[tuple[int, EvictionPolicy]] = []
        recovered: dict[int, list[bytes]] = {}
        for i, tier in enumerate(tiers):
            policy = policy_factory(
                PolicyConfig(
                    name=self._options.eviction_policy,
                    capacity_blocks=tier.capacity_blocks,
                    options=self._options.eviction_options,
                )
            )
            if not isinstance(policy, EvictionPolicy):
                raise ConfigError(
                    f"kv_connector_extra_config.eviction_policy: the factory of "
                    f"{self._options.eviction_policy!r} returned {type(policy).__name__}, not a "
                    "kvframe.spi.offload.EvictionPolicy"
                )
            specs.append((tier.capacity_blocks, policy))
            if tier.persistent:
                recovered[i] = list(tier.scan())
            tier.close()
        self.manager = TieredOffloadManager(specs, recovered=recovered)

    # -- helpers -----------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def _keys(self, request: RequestView) -> list[bytes]:
        req = self._reqs.setdefault(request.request_id, _Req())
        return self._extend_keys(req, request.block_hashes)

    def _extend_keys(self, req: _Req, hashes: tuple[bytes, ...]) -> list[bytes]:
        if len(hashes) < req.hashes:
            # The request's tokens changed (the engine rolled it back): start over.
            req.keys, req.hashes, req.stored = [], 0, 0
        for h in hashes[req.hashes :]:
            req.keys.append(offload_key(h, self._namespace))
        req.hashes = len(hashes)
        return req.keys

    def _unpin(self, req: _Req) -> None:
        if req.pinned and self.manager is not None:
            self.manager.complete_load(req.pinned)
        req.pinned, req.slots = (), ()

    # -- SPI ---------------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.manager is None:
            if not self._warned:
                # Without the workers' handshake the block size in bytes is unknown: say so
                # once instead of silently offloading nothing.
                self._warned = True
                self._events.append(
                    KVEvent(
                        kind="offload.inactive",
                        data={
                            "reason": "the engine never called set_xfer_handshake_metadata() "
                            "with the workers' get_handshake_metadata(); nothing is offloaded"
                        },
                    )
                )
            return 0, False
        bs = self._engine.block_size
        keys = self._keys(request)
        req = self._reqs[request.request_id]
        self._unpin(req)
        if num_computed_tokens % bs:
            return 0, False  # a partly computed block cannot take a whole loaded block
        first = num_computed_tokens // bs
        # The engine computes the last prompt token itself: only blocks before it are loaded.
        last = min(len(keys), max(0, request.num_prompt_tokens - 1) // bs)
        if last <= first:
            return 0, False
        wanted = keys[first:last]
        result = self.manager.lookup(wanted, protect=keys)
        if result.status in (LookupStatus.NOT_READY, LookupStatus.ASK_AGAIN):
            if req.waited < self._options.max_wait_steps:
                req.waited += 1
                self._count("lookups_deferred")
                return None, False
            self._count("lookups_gave_up_waiting")
        n = result.ready
        if n == 0:
            return 0, False
        slots = self.manager.prepare_load(wanted[:n])
        if slots is None:  # cannot happen: lookup just said ready; stay safe
            return 0, False
        req.pinned, req.slots, req.first_block = tuple(wanted[:n]), slots, first
        return n * bs, False

    def update_state_after_alloc(
        self, request: RequestView, blocks: BlockIds, num_external_tokens: int
    ) -> None:
        req = self._reqs.setdefault(request.request_id, _Req())
        req.allocated = True
        req.ran_after_alloc = False
        req.computed_at_alloc = request.num_computed_tokens
        req.block_ids = list(blocks[0]) if blocks else []
        if num_external_tokens <= 0 or not req.pinned:
            self._unpin(req)
            return
        n = len(req.pinned)
        ids = blocks[0][req.first_block : req.first_block + n] if blocks else ()
        if len(ids) != n:
            raise ValueError(
                f"request {request.request_id!r}: the engine allocated {len(blocks[0])} blocks; "
                f"blocks {req.first_block}..{req.first_block + n} are needed for the load"
            )
        self._loads.append(LoadJob(request_id=request.request_id, block_ids=ids, slots=req.slots))
        self._sent_loads.append(req.pinned)
        req.pinned, req.slots = (), ()
        self._count("load_blocks", n)

    def build_connector_meta(self, scheduler_output: SchedulerStep) -> OffloadMetadata:
        for rid in (*scheduler_output.new_requests, *scheduler_output.cached_requests):
            req = self._reqs.get(rid)
            if req is not None and req.allocated:
                req.ran_after_alloc = True
        if self.manager is not None:
            for rid, computed in scheduler_output.num_computed_tokens.items():
                self._store_computed(rid, computed, scheduler_output)
        jobs = self.manager.take_jobs() if self.manager is not None else []
        meta = OffloadMetadata(
            step=scheduler_output.step,
            offload_loads=tuple(self._loads),
            offload_stores=tuple(self._stores),
            copies=tuple(j for j in jobs if isinstance(j, CopyJob)),
            removes=tuple(j for j in jobs if isinstance(j, RemoveJob)),
        )
        self._loads.clear()
        self._stores.clear()
        return meta

    def _store_computed(self, rid: str, computed: int, step: SchedulerStep) -> None:
        """Plan the store of ``rid``'s full blocks that are computed once ``step`` ran."""
        assert self.manager is not None
        req = self._reqs.setdefault(rid, _Req())
        blocks = step.new_block_ids.get(rid)
        if blocks:
            if rid in step.new_requests:
                req.block_ids = list(blocks[0])
            else:
                req.block_ids.extend(blocks[0])
        hashes = step.block_hashes.get(rid)
        keys = self._extend_keys(req, hashes) if hashes is not None else req.keys
        full = min(computed // self._engine.block_size, len(keys), len(req.block_ids))
        if full <= req.stored:
            return
        first, req.stored = req.stored, full
        wanted = keys[first:full]
        reserved = self.manager.prepare_store(wanted, protect=keys[:full])
        if not reserved:
            return
        position: dict[bytes, int] = {}
        for i, k in enumerate(wanted, start=first):
            position.setdefault(k, i)
        job = StoreJob(
            job_id=self.manager.next_job_id(),
            request_id=rid,
            block_ids=tuple(req.block_ids[position[k]] for k, _ in reserved),
            keys=tuple(k for k, _ in reserved),
            slots=tuple(s for _, s in reserved),
            held=False,
        )
        self._stores.append(job)
        self._store_keys[job.job_id] = job.keys
        self._step_jobs[job.job_id] = _StepStore(
            request_id=rid,
            keys=job.keys,
            positions=tuple(position[k] for k in job.keys),
            blocks=tuple(req.block_ids[:full]),
        )
        self._count("store_blocks", len(reserved))
        self._count("stores_during_steps", len(reserved))

    def _poison(self, invalid: frozenset[int]) -> None:
        """Keys of step stores at or after a block whose load failed are not trustworthy."""
        for job_id, st in self._step_jobs.items():
            bad = next((i for i, b in enumerate(st.blocks) if b in invalid), None)
            if bad is None:
                continue
            keys = {k for k, p in zip(st.keys, st.positions, strict=True) if p >= bad}
            if keys:
                self._poisoned.setdefault(job_id, set()).update(keys)
            req = self._reqs.get(st.request_id)
            if req is not None:
                # Recomputed blocks are stored again once they are computed again.
                req.stored = min(req.stored, bad)

    def update_connector_output(self, output: ConnectorOutput) -> None:
        manager = self.manager
        if manager is None:
            return
        if output.invalid_block_ids and self._step_jobs:
            self._poison(output.invalid_block_ids)
        # This step's loads ran in its forward pass: they are over (failed ones surfaced as
        # invalid blocks, which the engine recomputes).
        for keys in self._sent_loads:
            manager.complete_load(keys)
        self._sent_loads.clear()
        if output.invalid_block_ids:
            self._count("load_failed_blocks", len(output.invalid_block_ids))
        # The workers' job reports (a plain ConnectorOutput, from an engine that did not
        # collect build_connector_worker_output, carries none).
        for report in output.jobs if isinstance(output, OffloadOutput) else ():
            self._reports.setdefault(report.job_id, []).append(report)
        for job_id in list(self._reports):
            reports = self._reports[job_id]
            if len({r.rank for r in reports}) < self._engine.world_size:
                continue
            del self._reports[job_id]
            failed: dict[bytes, str] = {}
            for r in reports:
                for k, code in r.failed.items():
                    failed.setdefault(k, code)
            for k in self._poisoned.pop(job_id, ()):
                failed.setdefault(k, "invalid")
                self._count("stores_dropped_invalid")
            self._step_jobs.pop(job_id, None)
            self._complete(job_id, failed)
        for rid in output.finished_sending:
            self._held.discard(rid)

    def _complete(self, job_id: int, failed: Mapping[bytes, str]) -> None:
        assert self.manager is not None
        keys = self._store_keys.pop(job_id, None)
        if keys is not None:
            good = [k for k in keys if k not in failed]
            bad = [k for k in keys if k in failed]
            if good:
                self.manager.complete_store(good, ok=True)
            if bad:
                self.manager.complete_store(bad, ok=False)
            return
        if self.manager.copy_in_flight(job_id):
            self.manager.complete_copy(job_id, failed)
        else:
            self._count("unknown_job_reports")

    def request_finished(
        self, request: RequestView, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        req = self._reqs.get(request.request_id)
        keys = self._keys(request) if self.manager is not None else []
        self._reqs.pop(request.request_id, None)
        if req is not None:
            self._unpin(req)
        if self.manager is None or not block_ids or not block_ids[0]:
            return False, None
        if req is not None and req.allocated and not req.ran_after_alloc:
            computed = req.computed_at_alloc
            self._count("stores_limited_to_allocation")
        else:
            computed = request.num_computed_tokens
        full = min(computed // self._engine.block_size, len(keys), len(block_ids[0]))
        # Blocks stored during steps are done (wait_for_save waited for them): only the rest.
        first = min(req.stored, full) if req is not None else 0
        if full <= first:
            return False, None
        wanted = keys[first:full]
        reserved = self.manager.prepare_store(wanted, protect=keys[:full])
        if not reserved:
            return False, None
        index: dict[bytes, int] = {}
        for i, k in enumerate(wanted, start=first):
            index.setdefault(k, i)
        job = StoreJob(
            job_id=self.manager.next_job_id(),
            request_id=request.request_id,
            block_ids=tuple(block_ids[0][index[k]] for k, _ in reserved),
            keys=tuple(k for k, _ in reserved),
            slots=tuple(s for _, s in reserved),
        )
        self._stores.append(job)
        self._store_keys[job.job_id] = job.keys
        self._held.add(request.request_id)
        self._count("store_blocks", len(reserved))
        return True, None

    def has_pending_work(self) -> bool:
        return bool(
            self._held
            or self._stores
            or self._loads
            or self._store_keys
            or (self.manager is not None and self.manager.has_jobs_in_flight())
        )

    def reset(self) -> None:
        """Drop every offloaded block that is not in flight (the prefix-cache reset)."""
        if self.manager is not None:
            self.manager.reset()

    def get_stats(self) -> Stats:
        counters: dict[str, int | float] = dict(self._counters)
        self._counters.clear()
        gauges: dict[str, int | float] = {}
        if self.manager is not None:
            for name, value in self.manager.counters.items():
                counters[name] = value
            self.manager.counters.clear()
            for i in range(self.manager.num_tiers):
                used, cap = self.manager.tier_usage(i)
                gauges[f"tier{i}_used_blocks"] = used
                gauges[f"tier{i}_capacity_blocks"] = cap
        return Stats(counters=counters, gauges=gauges)

    def take_events(self) -> tuple[KVEvent, ...]:
        out = list(self._events)
        self._events.clear()
        if self.manager is not None:
            out.extend(self.manager.take_events())
        return tuple(out)

    def shutdown(self) -> None:
        self._reqs.clear()
        self._loads.clear()
        self._stores.clear()
        self._step_jobs.clear()
        self._poisoned.clear()
