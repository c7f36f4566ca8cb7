"""``kvframe bench offload``: the offload tiers against memcpy and plain file I/O, lookup cost,
and LRU versus ARC on a synthetic multi-turn trace.

Measured, in one run, each tier beside its reference over the same bytes. The CPU tier's
sides and the two-thread reads alternate run by run, in an order that flips every run, so
that a machine that gets busier or quieter mid-run moves both. The disk tier's one-thread
writes and reads are **interleaved block by block**: in each run, for every block, the tier's
call and the reference's call, each timed alone, the order flipping block by block and run by
run; a side's run time is the sum of its calls. On a shared machine whose load comes and goes
within a run, whole runs let one side take a busy stretch alone (``docs/offloading.md`` gives
the spread of both ways on the same code).

- **cpu tier**: a store (KV cache → CPU tier, through the worker's per-layer copy path in its
  thread pool, from ``save_kv_layer`` to the job's completion) and a load (CPU tier → KV cache,
  ``start_load_kv`` to the last ``wait_for_layer_load``) of ``--blocks`` blocks, against one
  ``np.copyto`` of the same bytes;
- **disk tier**: :class:`~kvframe.connectors.offload.tiers.DiskTier` ``write`` and ``read``
  of the same blocks (checksummed files written in place, the trailer last, through the page
  cache; the tier keeps the files it wrote last open and reads them through a ``dup`` of the
  descriptor) against plain ``os.pwrite`` / ``os.pread`` of the same bytes, one file per block
  (each opened and closed, as a plain writer and reader do), under ``--dir`` (default the
  system's temporary directory; its filesystem is printed), in the *same* sub-directories as
  the tier's files (the reference's files are the tier's file names with another suffix):
  where a directory lies on the disk changed the time of the same writes by up to 1.45x on our
  virtual disk, so sides in separate directory trees measured the directories more than the
  tier. Blocks are written from the slots of CPU tiers and read into those of others
  (page-aligned, the fastest case for the kernel's copies: the references get it too); each
  side has its own source and destination holding the same bytes (so that, interleaved,
  neither finds the other's bytes in the CPU's cache), and they rotate between the sides run
  by run.
  One untimed run of writes comes first (the tier creates its sub-directories then, once in
  its life, as the reference's were made untimed). **Page cache state**: before each run of
  writes, both sides' files are deleted and
  ``os.sync()`` runs (untimed), so every write creates a new file with no dirty data pending
  (the tier of these rows has ``spare_files`` 0: it creates a file for every write, as the
  reference does); reads find the files just written, so they come from the page cache (a
  warm read, as a promotion soon after a write-through is). The reads are measured on one
  thread and again split over two threads (the connector's ``io_threads`` default), both
  sides alike;
- **disk tier at capacity**: a full tier evicting a block and writing another in its place,
  the steady state of a full tier, four sides interleaved block by block as above, in the
  same sub-directories (other keys): the tier's ``remove`` of block ``i`` of one generation
  then ``write`` of block ``i`` of the next (with ``spare_files`` = blocks, so the write
  overwrites the removed block's file); the same tier with ``spare_files`` 0 (it unlinks and
  creates: the tier's way before spare files); ``os.unlink`` of the old file then
  ``os.pwrite`` of a new one (a plain writer at capacity); and ``os.rename`` of the old file
  to the new name then ``os.pwrite`` over it (a plain writer that reuses files as the tier
  does, without a checksum or a trailer). Before each run (untimed) ``os.sync()`` runs and
  the files about to be evicted are dropped from the page cache (``POSIX_FADV_DONTNEED``),
  every side's: an evicted block is the least recently used one, seldom cached. After the
  runs the tier's last generation is read back and compared;
- **O_DIRECT references**: ``os.pwrite`` / ``os.pread`` with ``O_DIRECT`` (page-aligned
  buffers; the read is cold by construction), to show what bypassing the page cache costs or
  gains on this filesystem; reported as unsupported when the filesystem refuses ``O_DIRECT``
  (``EINVAL``) or the block size is not a multiple of 4096;
- **engine-thread cost of a store**: the time ``save_kv_layer`` × layers + ``wait_for_save``
  take on the engine's thread. For a store at finish they only post copies, beside the time
  until the copy-out is done (how long the engine keeps the finished request's blocks); for a
  store during a step (a running request's blocks) ``wait_for_save`` waits for the copy-out,
  measured with the layers posted back to back (no compute to overlap: the worst case);
- **lookup**: microseconds per block of :meth:`TieredOffloadManager.lookup` with
  ``--entries`` blocks indexed (a million by default);
- **hit rates**: the share of prompt blocks served by the CPU tier under ``lru`` and ``arc`` on
  a synthetic multi-turn chat trace (conversations sharing a system prompt, growing histories,
  and one-off long prompts that scan the cache), with a CPU tier smaller than the working set.

Human-readable table by default; ``--json`` prints one JSON object::

    {"benchmark": "offload",
     "params": {"blocks": int, "block_bytes": int, "layers": int, "entries": int,
                "repeat": int, "quick": bool, "dir": str, "filesystem": str},
     "results": {
        "cpu":  {"store_gbps": float, "load_gbps": float},
        "disk": {"write_gbps": float, "read_gbps": float},
        "baselines": {"memcpy_gbps": float, "pwrite_gbps": float, "pread_gbps": float},
        "comparisons": {NAME: {"gbps": float, "p90_gbps": float, "reference": str,
                               "ref_gbps": float, "ref_p90_gbps": float, "ratio": float,
                               "bar": float | null}},
        "o_direct": {"pwrite_gbps": float | null, "pread_gbps": float | null, "note": str},
        "store_engine_thread_us": float, "store_copy_out_ms": float,
        "step_store_engine_thread_us": float,
        "lookup_us_per_block": float,
        "hit_rates": {"lru": float, "arc": float}}}

The comparisons are ``cpu_store`` (vs memcpy, bar 0.9), ``cpu_load`` (vs memcpy), ``disk_write``
(new files, vs ``os.pwrite`` of new files, bar 0.9), ``disk_write_full`` (at capacity: the
tier's ``remove`` + ``write`` vs ``os.unlink`` + ``os.pwrite`` of a new file, bar 0.9),
``disk_write_full_reuse`` (the same tier side vs ``os.rename`` + ``os.pwrite`` over the old
file), ``disk_write_full_unspared`` (the tier with ``spare_files`` 0 at capacity vs
``os.unlink`` + ``os.pwrite``), ``disk_read`` (vs ``os.pread``, bar 0.8) and ``disk_read_2t``
(both on two threads). GB/s are 10⁹ bytes per second: ``gbps`` from the median time over
``--repeat`` runs of each side (writes, O_DIRECT), three times as many for the reads and five
times as many for the CPU tier (their runs take milliseconds); ``p90_gbps`` from the
90th-percentile (slow) time; ``ratio`` is the median's over the reference's median, in the
same run. ``--quick`` shrinks every size so that
a test can check the shape in well under a second of measuring.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import errno
import json
import mmap
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvframe.bench._stats import p90
from kvframe.bench.progress import Progress
from kvframe.config import KVTransferConfig
from kvframe.connectors.offload.manager import TieredOffloadManager
from kvframe.connectors.offload.metadata import LoadJob, OffloadMetadata, StoreJob
from kvframe.connectors.offload.policies import ARCPolicy, LRUPolicy
from kvframe.connectors.offload.tiers import DISK_TRAILER_BYTES, CPUTier, DiskTier
from kvframe.spi.connector import BuildContext, EngineInfo
from kvframe.spi.offload import PolicyConfig, TierConfig

__all__ = ["add_arguments", "measure", "run"]

_CPU_RUNS = 5
_READ_RUNS = 3
"""Runs per ``--repeat`` of the short measurements (the CPU tier's copies, warm reads)."""

BARS = {"cpu_store": 0.9, "disk_write": 0.9, "disk_write_full": 0.9, "disk_read": 0.8}
"""The ratios (tier over reference) the tiers must reach on the machine they run on."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (see the module docstring)."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--blocks", type=int, default=256, help="blocks per copy (256)")
    parser.add_argument("--layers", type=int, default=8, help="KV layers (8)")
    parser.add_argument(
        "--layer-block-bytes", type=int, default=32768, help="bytes per block per layer (32768)"
    )
    parser.add_argument("--entries", type=int, default=1_000_000, help="indexed blocks (1e6)")
    parser.add_argument("--repeat", type=int, default=9, help="runs per measurement (9)")
    parser.add_argument(
        "--dir", default=None, help="directory for the disk files (the system's temporary one)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (for tests)")


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def _paired(
    sides: dict[str, Callable[[], float]],
    repeat: int,
    before: Callable[[str], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds of each side, ``repeat`` runs alternating between the sides (the order flips
    every run); ``before(side)`` runs untimed before every timed run of ``side``."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(repeat):
        for name in names if r % 2 == 0 else names[::-1]:
            if before is not None:
                before(name)
            times[name].append(sides[name]())
    return times


def _compare(
    nbytes: int, times: dict[str, list[float]], side: str, ref: str, bar: float | None
) -> dict[str, Any]:
    a, b = times[side], times[ref]
    gbps, ref_gbps = _gbps(nbytes, statistics.median(a)), _gbps(nbytes, statistics.median(b))
    return {
        "gbps": gbps,
        "p90_gbps": _gbps(nbytes, p90(a)),
        "reference": ref,
        "ref_gbps": ref_gbps,
        "ref_p90_gbps": _gbps(nbytes, p90(b)),
        "ratio": gbps / ref_gbps,
        "bar": bar,
    }


def _timed(fn: Callable[[], object]) -> Callable[[], float]:
    def once() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return once


def _worker(layers: int, layer_bytes: int, blocks: int) -> Any:
    import torch

    from kvframe.connectors.offload import OffloadingConnector
    from kvframe.runtime.plugins import PluginHost

    config = KVTransferConfig.from_dict(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "tiers": [{"tier": "cpu", "capacity_bytes": blocks * layers * layer_bytes}]
            },
        }
    )
    host = PluginHost()
    host.load()
    ctx = BuildContext(host=host)
    worker = OffloadingConnector.build_worker(config, EngineInfo(block_size=16), 0, ctx)
    kv = {f"layers.{i}": torch.rand((blocks, layer_bytes // 4)) for i in range(layers)}
    worker.register_kv_caches(kv)
    return worker, kv


def _cpu(args: argparse.Namespace, blocks: int, layers: int, lb: int) -> dict[str, Any]:
    worker, kv = _worker(layers, lb, blocks)
    ids = tuple(range(blocks))
    total = blocks * layers * lb
    job_ids = iter(range(1, 1 << 30))
    engine_us: list[float] = []
    copy_ms: list[float] = []
    src = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)
    dst = np.empty_like(src)

    def store() -> float:
        job = StoreJob(
            job_id=next(job_ids),
            request_id="r",
            block_ids=ids,
            keys=tuple(i.to_bytes(32, "little") for i in ids),
            slots=ids,
        )
        worker.bind_connector_metadata(OffloadMetadata(offload_stores=(job,)))
        t0 = time.perf_counter()
        worker.start_load_kv(None)
        for name, t in kv.items():
            worker.save_kv_layer(name, t, None)
        worker.wait_for_save()
        t1 = time.perf_counter()
        worker.wait_idle()
        t2 = time.perf_counter()
        # The whole report, as an engine collects it (the job reports drain with it).
        if not worker.build_connector_worker_output().finished_sending:
            raise RuntimeError("the store did not finish")
        worker.clear_connector_metadata()
        engine_us.append((t1 - t0) * 1e6)
        copy_ms.append((t2 - t0) * 1e3)
        return t2 - t0

    step_us: list[float] = []

    def step_store() -> float:
        # A store during a step (a running request's blocks): wait_for_save waits for it.
        # Layers are posted back to back, with no compute between them to hide the copies
        # behind: the worst case for the engine's thread.
        job = StoreJob(
            job_id=next(job_ids),
            request_id="r",
            block_ids=ids,
            keys=tuple(i.to_bytes(32, "little") for i in ids),
            slots=ids,
            held=False,
        )
        worker.bind_connector_metadata(OffloadMetadata(offload_stores=(job,)))
        t0 = time.perf_counter()
        worker.start_load_kv(None)
        for name, t in kv.items():
            worker.save_kv_layer(name, t, None)
        worker.wait_for_save()
        t1 = time.perf_counter()
        worker.build_connector_worker_output()
        worker.clear_connector_metadata()
        step_us.append((t1 - t0) * 1e6)
        return t1 - t0

    def load() -> float:
        job = LoadJob(request_id="r", block_ids=ids, slots=ids)
        worker.bind_connector_metadata(OffloadMetadata(offload_loads=(job,)))
        t0 = time.perf_counter()
        worker.start_load_kv(None)
        for name in kv:
            worker.wait_for_layer_load(name)
        t1 = time.perf_counter()
        worker.clear_connector_metadata()
        return t1 - t0

    memcpy = _timed(lambda: np.copyto(dst, src))
    try:
        # One untimed round first: every page of the tier, the KV cache and dst is touched.
        store(), load(), memcpy()
        engine_us.clear()
        copy_ms.clear()
        # Each run takes milliseconds: five times as many runs steady the medians.
        times = _paired({"store": store, "load": load, "memcpy": memcpy}, args.repeat * _CPU_RUNS)
        for _ in range(args.repeat):
            step_store()
    finally:
        worker.shutdown()
    return {
        "cpu_store": _compare(total, times, "store", "memcpy", BARS["cpu_store"]),
        "cpu_load": _compare(total, times, "load", "memcpy", None),
        "store_engine_thread_us": statistics.median(engine_us),
        "store_copy_out_ms": statistics.median(copy_ms),
        "step_store_engine_thread_us": statistics.median(step_us),
    }


def _filesystem(path: Path) -> str:
    """``fstype device (mount point)`` of the mount holding ``path``, or ``"unknown"``."""
    best = ("", "unknown", "")
    with_mounts = Path("/proc/self/mounts")
    if not with_mounts.exists():
        return "unknown"
    real = str(path.resolve())
    for line in with_mounts.read_text().splitlines():
        dev, mnt, fstype = line.split()[:3]
        inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best[0]):
            best = (mnt, fstype, dev)
    return f"{best[1]} {best[2]} ({best[0]})" if best[0] else "unknown"


def _aligned(nbytes: int) -> memoryview:
    """A page-aligned writable buffer (anonymous memory), as O_DIRECT needs."""
    return memoryview(mmap.mmap(-1, nbytes))


def _parallel(pool: cf.ThreadPoolExecutor, threads: int, fn: Callable[[int], None], n: int) -> None:
    """``fn(i)`` for ``i`` in ``0..n-1``, split into ``threads`` interleaved shares."""

    def share(first: int) -> None:
        for i in range(first, n, threads):
            fn(i)

    for fut in [pool.submit(share, t) for t in range(threads)]:
        fut.result()


def _keys(blocks: int, generation: int = 0) -> list[bytes]:
    """Block ``i``'s key (``i`` little-endian; its last byte the ``generation``): the first
    byte, which names the sub-directory, is the same in every generation."""
    return [(i + (generation << 248)).to_bytes(32, "little") for i in range(blocks)]


def _layout(root: Path, blocks: int, suffix: str) -> list[str]:
    """The references' files: in the tier's own sub-directories under ``root`` (``ab/``),
    named as the tier names its files but with ``suffix`` instead of ``.kvb``, so that both
    sides create their files in the same directories. Where a directory lies on the disk
    decides much: on our virtual disk the same writes of new files ran up to 1.45x slower in
    one directory tree than in another, which swung the ratio more than anything the tier
    does. Strings made up front: the references pay nothing for their names."""
    paths = []
    for key in _keys(blocks):
        name = key.hex()
        (root / name[:2]).mkdir(parents=True, exist_ok=True)
        paths.append(str(root / name[:2] / name) + suffix)
    return paths


def _o_direct(
    args: argparse.Namespace, root: Path, blocks: int, block_bytes: int
) -> dict[str, Any]:
    """``os.pwrite`` / ``os.pread`` with O_DIRECT of the same blocks, one file per block."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return {"pwrite_gbps": None, "pread_gbps": None, "note": "no O_DIRECT on this OS"}
    if block_bytes % 4096:
        note = f"block of {block_bytes} bytes: not a multiple of 4096, O_DIRECT needs one"
        return {"pwrite_gbps": None, "pread_gbps": None, "note": note}
    paths = _layout(root, blocks, ".direct")
    buf = _aligned(block_bytes)
    buf[:] = np.random.default_rng(2).integers(0, 255, block_bytes, dtype=np.uint8).tobytes()

    def pwrite() -> None:
        for p in paths:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
            try:
                os.pwrite(fd, buf, 0)
            finally:
                os.close(fd)

    def pread() -> None:
        for p in paths:
            fd = os.open(p, os.O_RDONLY | flag)
            try:
                os.preadv(fd, [buf], 0)
            finally:
                os.close(fd)

    try:
        pwrite()
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        note = f"O_DIRECT refused by this filesystem ({exc.strerror}): the tier would fall back"
        return {"pwrite_gbps": None, "pread_gbps": None, "note": note}
    total = blocks * block_bytes
    times = _paired(
        {"pwrite": _timed(pwrite), "pread": _timed(pread)}, args.repeat, lambda _: os.sync()
    )
    return {
        "pwrite_gbps": _gbps(total, statistics.median(times["pwrite"])),
        "pread_gbps": _gbps(total, statistics.median(times["pread"])),
        "note": "one file per block, page-aligned buffer; the reads are cold (no page cache)",
    }


def _cpu_slots(blocks: int, block_bytes: int) -> Any:
    tier = CPUTier(
        TierConfig(
            name="cpu", index=0, capacity_bytes=blocks * block_bytes, block_bytes=block_bytes
        )
    )
    tier.open()
    return tier.contiguous_array()


def _interleaved(
    sides: dict[str, Callable[[int], None]],
    blocks: int,
    runs: int,
    before: Callable[[int], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds of each side per run: in each run, block by block, every side's call for that
    block, each timed alone, the order flipping block by block and run by run; a side's time
    for the run is the sum of its calls. ``before(run)`` runs untimed before every run. Both
    sides see the machine in the same state within microseconds of each other, so a load
    that comes and goes during a run moves both alike (alternating whole runs let one side
    take a busy stretch alone)."""
    names = list(sides)
    times: dict[str, list[float]] = {name: [] for name in names}
    fns = [sides[n] for n in names]
    clock = time.perf_counter
    for r in range(runs):
        if before is not None:
            before(r)
        total = [0.0] * len(names)
        for i in range(blocks):
            order = range(len(names)) if (i + r) % 2 == 0 else range(len(names) - 1, -1, -1)
            for j in order:
                t0 = clock()
                fns[j](i)
                total[j] += clock() - t0
        for j, name in enumerate(names):
            times[name].append(total[j])
    return times


def _disk(args: argparse.Namespace, blocks: int, block_bytes: int) -> dict[str, Any]:
    # Written from the slots of CPU tiers and read into the slots of others (page-aligned, as
    # the kernel copies fastest: the module docstring of the tiers says why). Four sources
    # holding the same bytes (one per side of the rows at capacity) and two destinations,
    # so that with the calls interleaved block by block no side finds another's bytes in the
    # CPU's cache; the sources rotate and the destinations swap run by run, so no side keeps
    # the better-placed memory.
    data = _cpu_slots(blocks, block_bytes)
    data[:] = np.random.default_rng(1).integers(0, 255, data.shape, dtype=np.uint8)
    sources = [data, *(_cpu_slots(blocks, block_bytes) for _ in range(3))]
    for src in sources[1:]:
        src[:] = data
    outs = [_cpu_slots(blocks, block_bytes), _cpu_slots(blocks, block_bytes)]
    for out in outs:
        out[:] = 0
    total = blocks * block_bytes
    keys = _keys(blocks)
    with tempfile.TemporaryDirectory(prefix="kvframe-bench-offload-", dir=args.dir) as tmp:
        root = Path(tmp)

        def disk_tier(spare_files: int) -> DiskTier:
            tier = DiskTier(
                TierConfig(
                    name="disk",
                    index=1,
                    capacity_bytes=(block_bytes + DISK_TRAILER_BYTES) * blocks,
                    block_bytes=block_bytes,
                    options={"path": str(root / "tier"), "spare_files": spare_files},
                )
            )
            tier.open()
            return tier

        # New files: a tier that unlinks removed blocks' files (spare_files 0), so that each
        # of its writes creates a file as the reference's does.
        tier = disk_tier(0)
        paths = _layout(root / "tier", blocks, ".pwrite")
        # At capacity: another tier in the same directories (other keys, the same first
        # byte), every removed block's file kept for reuse.
        full = disk_tier(blocks)
        gens = [_keys(blocks, generation=g) for g in (1, 2)]
        # And the code before spare files, beside it: a tier that unlinks and creates.
        unspared = disk_tier(0)
        unspared_gens = [_keys(blocks, generation=g) for g in (3, 4)]
        new_paths = [_layout(root / "tier", blocks, f".new{g}") for g in (1, 2)]
        reuse_paths = [_layout(root / "tier", blocks, f".reuse{g}") for g in (1, 2)]
        pool = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvframe-bench")

        def swap(run: int) -> None:
            sources.append(sources.pop(0))
            outs.reverse()

        def forget(run: int) -> None:
            # Untimed, before every run of writes: both sides write new files, no dirty data
            # pending.
            swap(run)
            for i, k in enumerate(keys):
                tier.remove(k, i)
                Path(paths[i]).unlink(missing_ok=True)
            os.sync()

        def write_tier(i: int) -> None:
            tier.write(keys[i], i, sources[0][i])

        def write_plain(i: int) -> None:
            fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.pwrite(fd, memoryview(sources[1][i].data), 0)
            os.close(fd)

        # At capacity, run r evicts generation r % 2's block i and writes generation
        # (r + 1) % 2's in its place.
        turn = [0]

        def evict_write_tier(i: int) -> None:
            old, new = gens[turn[0] % 2], gens[(turn[0] + 1) % 2]
            full.remove(old[i], i)
            full.write(new[i], i, sources[0][i])

        def evict_write_unspared(i: int) -> None:
            old, new = unspared_gens[turn[0] % 2], unspared_gens[(turn[0] + 1) % 2]
            unspared.remove(old[i], i)
            unspared.write(new[i], i, sources[3][i])

        def evict_write_new(i: int) -> None:
            os.unlink(new_paths[turn[0] % 2][i])
            fd = os.open(
                new_paths[(turn[0] + 1) % 2][i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644
            )
            os.pwrite(fd, memoryview(sources[1][i].data), 0)
            os.close(fd)

        def evict_write_reuse(i: int) -> None:
            new = reuse_paths[(turn[0] + 1) % 2][i]
            os.rename(reuse_paths[turn[0] % 2][i], new)
            fd = os.open(new, os.O_WRONLY)
            os.pwrite(fd, memoryview(sources[2][i].data), 0)
            os.close(fd)

        def fill(i: int) -> None:
            # Untimed: the full tier's and the references' first generation.
            full.write(gens[0][i], i, data[i])
            unspared.write(unspared_gens[0][i], i, data[i])
            for p in (new_paths[0][i], reuse_paths[0][i]):
                fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.pwrite(fd, memoryview(data[i].data), 0)
                os.close(fd)

        def evicted_cold(run: int) -> None:
            # Untimed, before every run at capacity: the files about to be evicted (the least
            # recently used blocks) written back and dropped from the page cache, every side's.
            if run:
                turn[0] += 1
            sources.append(sources.pop(0))  # each side's source moves on, run by run
            os.sync()
            g = turn[0] % 2
            tiers = [*map(full.file_of, gens[g]), *map(unspared.file_of, unspared_gens[g])]
            for p in [*map(str, tiers), *new_paths[g], *reuse_paths[g]]:
                fd = os.open(p, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)

        def read_tier(i: int) -> None:
            tier.read(keys[i], i, outs[0][i])

        def read_plain(i: int) -> None:
            fd = os.open(paths[i], os.O_RDONLY)
            os.preadv(fd, [memoryview(outs[1][i].data)], 0)
            os.close(fd)

        try:
            new_files: dict[str, Callable[[int], None]] = {
                "tier": write_tier,
                "pwrite": write_plain,
            }
            # One untimed run first: the tier learns its sub-directories (a mkdir each, once in
            # its life; the reference's were made untimed) and both sides' paths are cached.
            _interleaved(new_files, blocks, 1, forget)
            writes = _interleaved(new_files, blocks, args.repeat, forget)
            for i in range(blocks):
                fill(i)
            writes |= _interleaved(
                {
                    "tier_full": evict_write_tier,
                    "tier_full_unspared": evict_write_unspared,
                    "pwrite_new": evict_write_new,
                    "pwrite_reuse": evict_write_reuse,
                },
                blocks,
                args.repeat,
                evicted_cold,
            )
            full_out = outs[0].copy()
            for i, key in enumerate(gens[(turn[0] + 1) % 2]):
                full.read(key, i, full_out[i])
            if not np.array_equal(full_out, data):
                raise RuntimeError("the tier at capacity read back other bytes than it wrote")
            reads = _interleaved(
                {"tier": read_tier, "pread": read_plain},
                blocks,
                args.repeat * _READ_RUNS,
                swap,
            )
            # Two threads: whole runs alternate (the calls of one side overlap each other).
            reads |= _paired(
                {
                    "tier_2t": _timed(lambda: _parallel(pool, 2, read_tier, blocks)),
                    "pread_2t": _timed(lambda: _parallel(pool, 2, read_plain, blocks)),
                },
                args.repeat * _READ_RUNS,
            )
            if not all(np.array_equal(out, data) for out in outs):
                raise RuntimeError("a disk side read back other bytes than it wrote")
            direct = _o_direct(args, root / "tier", blocks, block_bytes)
        finally:
            pool.shutdown()
            tier.close()
            full.close()
            unspared.close()
    return {
        "disk_write": _compare(total, writes, "tier", "pwrite", BARS["disk_write"]),
        "disk_write_full": _compare(
            total, writes, "tier_full", "pwrite_new", BARS["disk_write_full"]
        ),
        "disk_write_full_reuse": _compare(total, writes, "tier_full", "pwrite_reuse", None),
        "disk_write_full_unspared": _compare(
            total, writes, "tier_full_unspared", "pwrite_new", None
        ),
        "disk_read": _compare(total, reads, "tier", "pread", BARS["disk_read"]),
        "disk_read_2t": _compare(total, reads, "tier_2t", "pread_2t", None),
        "o_direct": direct,
        "filesystem": _filesystem(root),
        "dir": str(root.parent),
    }


def _manager(policy: str, capacity: int) -> TieredOffloadManager:
    cls = LRUPolicy if policy == "lru" else ARCPolicy
    return TieredOffloadManager(
        [(capacity, cls(PolicyConfig(name=policy, capacity_blocks=capacity)))]
    )


def _lookup_cost(args: argparse.Namespace, entries: int) -> float:
    m = _manager("lru", entries)
    keys = [i.to_bytes(32, "little") for i in range(entries)]
    batch = 4096
    for i in range(0, entries, batch):
        got = m.prepare_store(keys[i : i + batch])
        m.complete_store([k for k, _ in got], ok=True)
    m.take_events()
    rng = random.Random(0)
    queries = [keys[s : s + 16] for s in (rng.randrange(0, entries - 16) for _ in range(2000))]

    def once() -> float:
        t0 = time.perf_counter()
        for q in queries:
            m.lookup(q)
        return time.perf_counter() - t0

    return statistics.median(once() for _ in range(args.repeat)) / (len(queries) * 16) * 1e6


def _trace(quick: bool) -> list[list[bytes]]:
    """Requests as key chains: conversations over a shared system prompt, and scans."""
    rng = random.Random(42)
    system = [b"sys%d" % i for i in range(8)]
    convs = 20 if quick else 60
    turns = 4 if quick else 8
    histories = [list(system) for _ in range(convs)]
    out: list[list[bytes]] = []
    serial = 0
    for _ in range(turns):
        order = list(range(convs))
        rng.shuffle(order)
        for c in order:
            serial += 1
            histories[c] += [b"c%d-%d" % (c, serial + j) for j in range(rng.randint(2, 5))]
            out.append(list(histories[c]))
            if rng.random() < 0.5:  # a one-off long document: scans the cache
                out.append([b"scan%d-%d" % (serial, j) for j in range(rng.randint(20, 40))])
    return [[k.ljust(32, b"\0") for k in req] for req in out]


def _hit_rate(policy: str, trace: list[list[bytes]], capacity: int) -> float:
    m = _manager(policy, capacity)
    hits = total = 0
    for req in trace:
        r = m.lookup(req)
        hits += r.ready
        total += len(req)
        # A hit is loaded: pin and unpin, which also counts as a use for the policy.
        if r.ready and m.prepare_load(req[: r.ready]) is not None:
            m.complete_load(req[: r.ready])
        got = m.prepare_store(req)
        if got:
            m.complete_store([k for k, _ in got], ok=True)
        m.take_events()
    return hits / total


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run every measurement; returns the JSON report (see the module docstring)."""
    quick = bool(args.quick)
    blocks = 8 if quick else args.blocks
    layers = 2 if quick else args.layers
    lb = 4096 if quick else args.layer_block_bytes
    entries = 5000 if quick else args.entries
    repeat = 1 if quick else args.repeat
    args = argparse.Namespace(**{**vars(args), "repeat": repeat})
    import torch  # noqa: F401  (the cpu rows need it: a missing torch is named before any line)

    progress = Progress("offload", total=4)
    progress(f"cpu tier store and load, {blocks} blocks of {layers} × {lb} bytes")
    cpu = _cpu(args, blocks, layers, lb)
    progress(f"disk tier write and read, {blocks} blocks of {layers * lb} bytes")
    disk = _disk(args, blocks, layers * lb)
    progress(f"lookup among {entries} indexed blocks")
    lookup = _lookup_cost(args, entries)
    progress("hit rates of LRU and ARC on a multi-turn trace")
    trace = _trace(quick)
    distinct = len({k for req in trace for k in req})
    capacity = max(16, distinct // 6)
    comparisons = {
        name: source[name]
        for source, names in ((cpu, ("cpu_store", "cpu_load")), (disk, _DISK_ROWS))
        for name in names
    }
    return {
        "benchmark": "offload",
        "params": {
            "blocks": blocks,
            "block_bytes": layers * lb,
            "layers": layers,
            "entries": entries,
            "repeat": repeat,
            "quick": quick,
            "dir": disk["dir"],
            "filesystem": disk["filesystem"],
        },
        "results": {
            "cpu": {
                "store_gbps": cpu["cpu_store"]["gbps"],
                "load_gbps": cpu["cpu_load"]["gbps"],
            },
            "disk": {
                "write_gbps": disk["disk_write"]["gbps"],
                "read_gbps": disk["disk_read"]["gbps"],
            },
            "baselines": {
                "memcpy_gbps": cpu["cpu_store"]["ref_gbps"],
                "pwrite_gbps": disk["disk_write"]["ref_gbps"],
                "pread_gbps": disk["disk_read"]["ref_gbps"],
            },
            "comparisons": comparisons,
            "o_direct": disk["o_direct"],
            "store_engine_thread_us": cpu["store_engine_thread_us"],
            "store_copy_out_ms": cpu["store_copy_out_ms"],
            "step_store_engine_thread_us": cpu["step_store_engine_thread_us"],
            "lookup_us_per_block": lookup,
            "hit_rates": {
                "lru": _hit_rate("lru", trace, capacity),
                "arc": _hit_rate("arc", trace, capacity),
            },
        },
    }


_DISK_ROWS = (
    "disk_write",
    "disk_write_full",
    "disk_write_full_reuse",
    "disk_write_full_unspared",
    "disk_read",
    "disk_read_2t",
)
_LABELS = {
    "cpu_store": ("cpu tier store (KV -> CPU)", "memcpy (np.copyto)"),
    "cpu_load": ("cpu tier load (CPU -> KV)", "memcpy (np.copyto)"),
    "disk_write": ("disk tier write, new file", "os.pwrite, new file"),
    "disk_write_full": ("disk tier full: evict+write", "unlink old, pwrite new file"),
    "disk_write_full_reuse": ("disk tier full: evict+write", "rename old, pwrite over it"),
    "disk_write_full_unspared": ("  same, spare_files 0", "unlink old, pwrite new file"),
    "disk_read": ("disk tier read (verified)", "os.pread, opening each file"),
    "disk_read_2t": ("disk tier read, 2 threads", "os.pread, 2 threads"),
}


def _human(report: dict[str, Any]) -> str:
    p, r = report["params"], report["results"]
    lines = [
        f"kvframe bench offload: {p['blocks']} blocks of {p['block_bytes']} bytes "
        f"({p['layers']} layers), {p['repeat']} runs per side, the sides alternating "
        "(one-thread disk rows: interleaved block by block)",
        f"disk files in {p['dir']} ({p['filesystem']}): writes create new files after an "
        "untimed os.sync(); reads are warm (page cache, the files just written)",
        "disk tier full: each block evicts one (remove + write, over the removed file) beside "
        "plain writers doing the same; the evicted files dropped from the page cache first",
        "GB/s: median time (p90 time, the slow tail); ratio = median / reference median",
        "",
        f"{'measurement':<28}{'GB/s':>7}{'p90':>7}  {'reference':<27}{'GB/s':>7}{'p90':>7}"
        f"{'ratio':>7}{'bar':>6}",
    ]
    for name, c in r["comparisons"].items():
        side, ref = _LABELS[name]
        bar = "" if c["bar"] is None else f"{c['bar']:.1f}"
        verdict = "" if c["bar"] is None else ("  ok" if c["ratio"] >= c["bar"] else "  BELOW")
        lines.append(
            f"{side:<28}{c['gbps']:>7.2f}{c['p90_gbps']:>7.2f}  {ref:<27}{c['ref_gbps']:>7.2f}"
            f"{c['ref_p90_gbps']:>7.2f}{c['ratio']:>7.2f}{bar:>6}{verdict}"
        )
    od = r["o_direct"]
    if od["pwrite_gbps"] is None:
        lines.append(f"O_DIRECT: {od['note']}")
    else:
        lines.append(
            f"O_DIRECT, same blocks: os.pwrite {od['pwrite_gbps']:.2f} GB/s, os.pread "
            f"{od['pread_gbps']:.2f} GB/s ({od['note']})"
        )
    lines += [
        "",
        f"store: {r['store_engine_thread_us']:.0f} µs on the engine thread, copy-out done after "
        f"{r['store_copy_out_ms']:.2f} ms (the engine keeps the blocks until then)",
        f"store during a step: {r['step_store_engine_thread_us']:.0f} µs on the engine thread "
        "(wait_for_save waits for the copy-out; layers back to back)",
        f"lookup with {p['entries']:,} blocks indexed: {r['lookup_us_per_block']:.2f} µs per block",
        f"hit rate on the multi-turn trace: lru {r['hit_rates']['lru']:.1%}, "
        f"arc {r['hit_rates']['arc']:.1%}",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print the report; returns the exit status (2 for bad options)."""
    for name in ("blocks", "layers", "layer_block_bytes", "entries", "repeat"):
        value = getattr(args, name)
        if value < 1 or (name == "entries" and value < 64):
            flag = "--" + name.replace("_", "-")
            print(f"kvframe bench offload: {flag} = {value}; it must be positive", file=sys.stderr)
            return 2
    if args.layer_block_bytes % 4:
        print("kvframe bench offload: --layer-block-bytes must be a multiple of 4", file=sys.stderr)
        return 2
    if args.dir is not None and not Path(args.dir).is_dir():
        print(f"kvframe bench offload: --dir {args.dir!r} is not a directory", file=sys.stderr)
        return 2
    report = measure(args)
    print(json.dumps(report, indent=2) if args.json else _human(report))
    return 0
