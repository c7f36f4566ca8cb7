"""The offloading connector's worker side: every copy runs in a thread pool.

The engine's thread only submits work and collects finished work; it waits only where the SPI
says it must:

- ``start_load_kv`` posts one copy per layer (memory tier → KV cache) for the step's loads,
  plus the step's tier-to-tier copies (write-through to disk, promotions) and removals;
- ``wait_for_layer_load(layer)`` waits for that layer's copy only (the per-layer pipeline:
  layer ``i + 1`` is still being copied while layer ``i``'s attention runs);
- ``save_kv_layer(layer)`` posts that layer's copy-out (KV cache → memory tier) of the step's
  stores, right after the layer wrote its KV, so the copy of layer ``i`` overlaps the compute
  of layer ``i + 1``;
- ``wait_for_save`` posts the layers that did not run (a step without a forward pass), then
  **waits for this step's stores of running requests** (``StoreJob.held`` false): the engine
  may free and reuse their blocks as soon as the step ends (a request that finishes or is
  preempted), so the copy must be done before ``wait_for_save`` returns — the SPI's contract.
  What is left to wait for is the copy-out of the last layers (the earlier ones ran during
  the forward pass); the time is counted in the ``save_wait_us`` counter. Stores at finish
  (``held``) are not waited for: the engine keeps those blocks (``delay_free``) until this
  worker reports the request in ``finished_sending``;
- ``get_finished`` collects finished stores (``finished_sending`` for held ones) and finished
  copies; ``build_connector_worker_output`` reports every finished job as a
  :class:`~kvframe.connectors.offload.metadata.JobReport` in its
  :class:`~kvframe.connectors.offload.metadata.OffloadOutput`, which the scheduler side reads
  back (an engine that collects only the separate getters never hands the reports over).

A copy between the KV cache and the memory tier is one strided copy per layer and run of
consecutive blocks and slots, straight between the two (no staging). When the KV cache is in
host memory, it is ``np.copyto`` on numpy views of both (numpy releases the GIL), one thread
per copy; torch's ``copy_`` would also split each copy over its own intra-op threads, so two
pool threads ran four copy threads on two cores (figures in ``docs/offloading.md``). A KV
cache on a device is copied with torch's ``copy_``.

Copies between the KV cache and the memory tier (loads, stores: on the step's critical path)
run in their own pool, apart from tier-to-tier copies and removals (disk I/O), so a slow disk
write queued before them never delays a step.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
from collections.abc import Mapping, Set
from typing import TYPE_CHECKING, Any

import attrs
import msgpack
import numpy as np

from kvframe.config import KVTransferConfig
from kvframe.connectors._reports import WorkerReports
from kvframe.connectors.offload.metadata import (
    CopyJob,
    JobReport,
    LoadJob,
    OffloadMetadata,
    OffloadOutput,
    StoreJob,
)
from kvframe.connectors.offload.options import OffloadOptions
from kvframe.connectors.offload.scheduler import build_tiers, check_components
from kvframe.protocol.messages import ConnectorMetadata, Stats
from kvframe.spi.connector import EngineInfo, KVConnectorWorker, PluginLookup
from kvframe.spi.offload import (
    ByteArray,
    CorruptEntryError,
    MemoryTier,
    OffloadTier,
    TierFullError,
)

if TYPE_CHECKING:
    import torch

__all__ = ["OffloadingWorker"]


def _code(exc: BaseException) -> str:
    if isinstance(exc, TierFullError):
        return "nospace"
    if isinstance(exc, CorruptEntryError):
        return "corrupt"
    return "error"


_Run = tuple[int, int, int]


class _Store:
    def __init__(self, job: StoreJob, layers: int) -> None:
        self.job = job
        self.futures: dict[str, cf.Future[None]] = {}
        self.layers = layers
        # The job's copy runs, made by the first layer's copy and shared by the others.
        self.runs: list[_Run] | None = None


class _Loads:
    """A step's loads and their copy runs (made once, by the first layer's copy)."""

    def __init__(self, loads: tuple[LoadJob, ...]) -> None:
        self.loads = loads
        self.runs: list[_Run] | None = None


class OffloadingWorker(WorkerReports, KVConnectorWorker):
    """Worker half of :class:`~kvframe.connectors.offload.OffloadingConnector`.

    ``host`` is the plugin host the tiers come from. Tiers are built and opened in
    :meth:`register_kv_caches`, when the bytes per block are known.
    """

    def __init__(
        self,
        config: KVTransferConfig,
        engine: EngineInfo,
        rank: int,
        options: OffloadOptions,
        host: PluginLookup,
    ) -> None:
        check_components(host, options)
        self._config = config
        self._engine = engine
        self._rank = rank
        self._options = options
        self._host = host
        self._pool = cf.ThreadPoolExecutor(
            max_workers=options.io_threads, thread_name_prefix=f"kvframe-offload-{rank}"
        )
        self._io_pool = cf.ThreadPoolExecutor(
            max_workers=options.io_threads, thread_name_prefix=f"kvframe-offload-io-{rank}"
        )
        self._tiers: list[OffloadTier] = []
        self._memory: MemoryTier | None = None
        self._contiguous: torch.Tensor | None = None
        self._layers: dict[str, torch.Tensor] = {}
        # Numpy views of the layers in host memory and of the memory tier's slots: their
        # copies run in numpy (which releases the GIL), one thread per copy; torch would split
        # each copy over its own intra-op threads as well, more threads than cores.
        self._host_layers: dict[str, ByteArray] = {}
        self._host_slots: ByteArray | None = None
        self._offsets: dict[str, tuple[int, int]] = {}
        self.block_bytes = 0
        self._layout = ""
        self._load_futures: dict[str, tuple[cf.Future[None], tuple[LoadJob, ...]]] = {}
        self._stores: list[_Store] = []
        self._step_stores: list[_Store] = []
        self._copies: list[tuple[CopyJob, cf.Future[dict[bytes, tuple[str, str]]]]] = []
        self._removing: dict[tuple[int, bytes], cf.Future[None]] = {}
        self._lock = threading.Lock()
        self._finished_sending: set[str] = set()
        self._jobs: list[JobReport] = []
        self._init_reports()
        self._counters: dict[str, int] = {}
        self._closed = False

    # -- start-up ----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Check the layout (block-major: dimension 0 is the block id, contiguous, equal block
        counts), build and open the tiers. Raises ``ValueError`` for another layout and
        :class:`~kvframe.errors.ConfigError` for tiers that cannot be built."""
        import torch

        if not kv_caches:
            raise ValueError("register_kv_caches got no layers")
        num_blocks = None
        offset = 0
        parts: list[str] = []
        for name, t in kv_caches.items():
            if not isinstance(t, torch.Tensor) or t.dim() < 2 or not t.is_contiguous():
                raise ValueError(
                    f"layer {name!r}: expected a contiguous block-major tensor "
                    "[num_blocks, ...]; the offloading connector copies whole blocks"
                )
            if num_blocks is None:
                num_blocks = t.shape[0]
            elif t.shape[0] != num_blocks:
                raise ValueError(
                    f"layer {name!r} has {t.shape[0]} blocks, other layers {num_blocks}"
                )
            per_block = t[0].numel() * t.element_size()
            self._layers[name] = t.view(torch.uint8).reshape(t.shape[0], per_block)
            if t.device.type == "cpu":
                self._host_layers[name] = self._layers[name].detach().numpy()
            self._offsets[name] = (offset, per_block)
            offset += per_block
            parts.append(f"{name}:{t.dtype}:{tuple(t.shape[1:])}")
        self.block_bytes = offset
        self._layout = ";".join(parts)
        tiers = build_tiers(self._host, self._options, self.block_bytes)
        try:
            for tier in tiers:
                tier.open()
        except BaseException:
            for tier in tiers:
                tier.close()
            raise
        self._tiers = tiers
        first = tiers[0]
        assert isinstance(first, MemoryTier)
        self._memory = first
        whole = first.contiguous_array()
        if whole is not None:
            import torch

            self._contiguous = torch.from_numpy(whole)
            self._host_slots = whole

    def get_handshake_metadata(self) -> bytes | None:
        """The bytes per block and the layout, for the scheduler's manager."""
        return bytes(msgpack.packb({"block_bytes": self.block_bytes, "layout": self._layout}))

    @property
    def tiers(self) -> tuple[OffloadTier, ...]:
        """The opened tiers, fastest first."""
        return tuple(self._tiers)

    # -- copies (run in the pool) ------------------------------------------------------------
    def _slots(self, first: int, count: int) -> torch.Tensor:
        """Slots ``first .. first + count - 1`` as a [count, block_bytes] uint8 tensor view."""
        import torch

        assert self._memory is not None
        if self._contiguous is not None:
            return self._contiguous[first : first + count]
        assert count == 1
        return torch.from_numpy(self._memory.slot_array(first)).view(1, -1)

    def _runs(self, blocks: tuple[int, ...], slots: tuple[int, ...]) -> list[_Run]:
        """``(first block, first slot, length)`` runs where both ids step by one: each run is
        one strided copy instead of one copy per block (the per-call cost dominates small
        blocks). Made once per job, not per layer: 40 µs for 256 blocks, 8 times over, was
        3 % of a store."""
        runs: list[_Run] = []
        merge = self._contiguous is not None
        for b, s in zip(blocks, slots, strict=True):
            if merge and runs:
                b0, s0, n = runs[-1]
                if b == b0 + n and s == s0 + n:
                    runs[-1] = (b0, s0, n + 1)
                    continue
            runs.append((b, s, 1))
        return runs

    def _load_layer(self, name: str, loads: _Loads) -> None:
        off, size = self._offsets[name]
        layer = self._layers[name]
        runs = loads.runs
        if runs is None:  # two layers may both get here first: they make equal lists
            runs = [r for j in loads.loads for r in self._runs(j.block_ids, j.slots)]
            loads.runs = runs
        host = self._host_layers.get(name)
        if host is not None and self._host_slots is not None:
            slots = self._host_slots
            for b, s, n in runs:
                np.copyto(host[b : b + n], slots[s : s + n, off : off + size])
            return
        for b, s, n in runs:
            layer[b : b + n].copy_(self._slots(s, n)[:, off : off + size])

    def _store_layer(self, name: str, store: _Store) -> None:
        off, size = self._offsets[name]
        layer = self._layers[name]
        runs = store.runs
        if runs is None:
            runs = store.runs = self._runs(store.job.block_ids, store.job.slots)
        host = self._host_layers.get(name)
        if host is not None and self._host_slots is not None:
            slots = self._host_slots
            for b, s, n in runs:
                # One copy straight from the KV cache into the slots (views, no staging).
                np.copyto(slots[s : s + n, off : off + size], host[b : b + n])
            return
        for b, s, n in runs:
            self._slots(s, n)[:, off : off + size].copy_(layer[b : b + n])

    def _copy(self, job: CopyJob) -> dict[bytes, tuple[str, str]]:
        failed: dict[bytes, tuple[str, str]] = {}
        src = self._tiers[job.src_tier]
        dst = self._tiers[job.dst_tier]
        assert self._memory is not None
        for key, s, d in zip(job.keys, job.src_slots, job.dst_slots, strict=True):
            pending = self._removing.get((job.dst_tier, key))
            if pending is not None:
                # A removal of an older copy of this key was posted earlier: let it land first
                # so that it cannot delete the file written now.
                cf.wait([pending])
            try:
                if job.src_tier == 0:
                    dst.write(key, d, self._memory.slot_array(s))
                elif job.dst_tier == 0:
                    src.read(key, s, self._memory.slot_array(d))
                else:
                    buf = np.empty(self.block_bytes, dtype=np.uint8)
                    src.read(key, s, buf)
                    dst.write(key, d, buf)
            except Exception as exc:
                failed[key] = (_code(exc), f"{type(exc).__name__}: {exc}")
                if isinstance(exc, TierFullError):
                    # Every later write to this tier would fail the same way.
                    for rest in job.keys[job.keys.index(key) + 1 :]:
                        failed[rest] = ("nospace", "the tier is full")
                    break
        return failed

    def _remove(self, tier: OffloadTier, key: bytes, slot: int) -> None:
        with contextlib.suppress(Exception):  # removal is best effort by contract
            tier.remove(key, slot)

    # -- the step ----------------------------------------------------------------------------
    def bind_connector_metadata(self, meta: ConnectorMetadata) -> None:
        if not isinstance(meta, OffloadMetadata):
            raise TypeError(
                f"OffloadingConnector's worker got {type(meta).__qualname__}; the engine must "
                "decode metadata with codec_for(OffloadingConnector, config)"
            )
        super().bind_connector_metadata(meta)

    def _meta(self) -> OffloadMetadata:
        meta = self.connector_metadata
        assert isinstance(meta, OffloadMetadata)
        return meta

    def start_load_kv(self, forward_context: Any) -> None:
        meta = self._meta()
        if meta.offload_loads:
            loads = _Loads(meta.offload_loads)
            for name in self._layers:
                fut = self._pool.submit(self._load_layer, name, loads)
                self._load_futures[name] = (fut, meta.offload_loads)
            self._count("load_blocks", sum(len(j.block_ids) for j in meta.offload_loads))
        for rm in meta.removes:
            tier = self._tiers[rm.tier]
            for key, slot in zip(rm.keys, rm.slots, strict=True):
                self._removing[(rm.tier, key)] = self._io_pool.submit(self._remove, tier, key, slot)
        for job in meta.copies:
            self._copies.append((job, self._io_pool.submit(self._copy, job)))
        self._step_stores = [_Store(job, len(self._layers)) for job in meta.offload_stores]
        self._stores.extend(self._step_stores)

    def wait_for_layer_load(self, layer_name: str) -> None:
        entry = self._load_futures.pop(layer_name, None)
        if entry is None:
            return
        fut, loads = entry
        try:
            fut.result()
        except Exception as exc:
            self._load_failed(loads, f"{layer_name}: {type(exc).__name__}: {exc}")

    def _load_failed(self, loads: tuple[LoadJob, ...], reason: str) -> None:
        self._count("load_failures")
        for load in loads:
            self._invalid.update(load.block_ids)
            self._failures.setdefault(load.request_id, f"offload load failed: {reason}")

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        for store in self._step_stores:
            if layer_name in self._layers and layer_name not in store.futures:
                store.futures[layer_name] = self._pool.submit(self._store_layer, layer_name, store)

    def wait_for_save(self) -> None:
        # Layers whose loads were never waited for (no forward pass ran them) must still land
        # before the step ends: nothing may write into the KV cache afterwards.
        for name in list(self._load_futures):
            self.wait_for_layer_load(name)
        for store in self._step_stores:
            for name in self._layers:
                if name not in store.futures:
                    store.futures[name] = self._pool.submit(self._store_layer, name, store)
        running = [f for s in self._step_stores if not s.job.held for f in s.futures.values()]
        self._step_stores = []
        if running:
            t0 = time.perf_counter()
            cf.wait(running)
            self._count("save_wait_us", round((time.perf_counter() - t0) * 1e6))
            self._count("save_waits")

    def get_finished(self, finished_req_ids: Set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._poll()
        sending, self._finished_sending = self._finished_sending, set()
        return sending or None, None

    def _poll(self) -> None:
        still: list[_Store] = []
        for store in self._stores:
            if len(store.futures) < store.layers or not all(
                f.done() for f in store.futures.values()
            ):
                still.append(store)
                continue
            errors = [f.exception() for f in store.futures.values() if f.exception() is not None]
            failed = dict.fromkeys(store.job.keys, "error") if errors else {}
            self._report(store.job.job_id, failed, str(errors[0]) if errors else "")
            if store.job.held:
                self._finished_sending.add(store.job.request_id)
            self._count("store_blocks", len(store.job.keys))
        self._stores = still
        pending: list[tuple[CopyJob, cf.Future[dict[bytes, tuple[str, str]]]]] = []
        for job, fut in self._copies:
            if not fut.done():
                pending.append((job, fut))
                continue
            exc = fut.exception()
            result = {k: ("error", str(exc)) for k in job.keys} if exc is not None else fut.result()
            first = next(iter(result.values()), ("", ""))[1]
            self._report(job.job_id, {k: c for k, (c, _) in result.items()}, first)
            self._count("copy_blocks", len(job.keys) - len(result))
            self._count("copy_failures", len(result))
        self._copies = pending
        for where, removal in list(self._removing.items()):
            if removal.done():
                del self._removing[where]

    def _report(self, job_id: int, failed: Mapping[bytes, str], error: str) -> None:
        self._jobs.append(JobReport(job_id=job_id, rank=self._rank, failed=failed, error=error))

    def build_connector_worker_output(
        self, finished_req_ids: Set[str] = frozenset()
    ) -> OffloadOutput:
        """This rank's report: the generic output and the jobs finished since the last one."""
        out = super().build_connector_worker_output(finished_req_ids)
        jobs, self._jobs = tuple(self._jobs), []
        return OffloadOutput(**attrs.asdict(out, recurse=False), jobs=jobs)

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def get_stats(self) -> Stats:
        counters: dict[str, int | float] = dict(self._counters)
        self._counters.clear()
        return Stats(
            counters=counters,
            gauges={
                "worker_stores_in_flight": len(self._stores),
                "worker_copies_in_flight": len(self._copies),
            },
        )

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Block until every posted copy finished (tests and benchmarks). Raises
        ``TimeoutError`` after ``timeout`` seconds."""
        futures: list[cf.Future[Any]] = [f for _, f in self._copies]
        futures += [f for s in self._stores for f in s.futures.values()]
        futures += list(self._removing.values())
        _, not_done = cf.wait(futures, timeout=timeout)
        if not_done:
            raise TimeoutError(f"{len(not_done)} offload copies still running after {timeout} s")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Copies in flight write into tier memory and the KV cache: let them finish before
        # the memory goes away.
        self._pool.shutdown(wait=True, cancel_futures=False)
        self._io_pool.shutdown(wait=True, cancel_futures=False)
        for tier in self._tiers:
            with contextlib.suppress(Exception):  # shutdown never raises
                tier.close()
