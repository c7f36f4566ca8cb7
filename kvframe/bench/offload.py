"""``kvframe bench offload``: the offload tiers against memcpy and plain file I/O, lookup cost,
and LRU versus ARC on a synthetic multi-turn trace.

Measured, in one run:

- **cpu tier**: a store (KV cache → CPU tier, through the worker's per-layer copy path in its
  thread pool, from ``save_kv_layer`` to the job's completion) and a load (CPU tier → KV cache,
  ``start_load_kv`` to the last ``wait_for_layer_load``) of ``--blocks`` blocks, against one
  ``np.copyto`` of the same bytes;
- **disk tier**: :class:`~kvframe.connectors.offload.tiers.DiskTier` ``write`` and ``read``
  of the same blocks (checksummed files, through the page cache) against ``os.pwrite`` /
  ``os.pread`` of the same bytes to one file per block;
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
                "repeat": int, "quick": bool},
     "results": {
        "cpu":  {"store_gbps": float, "load_gbps": float},
        "disk": {"write_gbps": float, "read_gbps": float},
        "baselines": {"memcpy_gbps": float, "pwrite_gbps": float, "pread_gbps": float},
        "store_engine_thread_us": float, "store_copy_out_ms": float,
        "step_store_engine_thread_us": float,
        "lookup_us_per_block": float,
        "hit_rates": {"lru": float, "arc": float}}}

GB/s are 10⁹ bytes per second, medians over ``--repeat`` runs. ``--quick`` shrinks every size
so that a test can check the shape in well under a second of measuring.
"""

from __future__ import annotations

import argparse
import json
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

from kvframe.config import KVTransferConfig
from kvframe.connectors.offload.manager import TieredOffloadManager
from kvframe.connectors.offload.metadata import LoadJob, OffloadMetadata, StoreJob
from kvframe.connectors.offload.policies import ARCPolicy, LRUPolicy
from kvframe.connectors.offload.tiers import DiskTier
from kvframe.spi.connector import BuildContext, EngineInfo
from kvframe.spi.offload import PolicyConfig, TierConfig

__all__ = ["add_arguments", "measure", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (see the module docstring)."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--blocks", type=int, default=256, help="blocks per copy (256)")
    parser.add_argument("--layers", type=int, default=8, help="KV layers (8)")
    parser.add_argument(
        "--layer-block-bytes", type=int, default=32768, help="bytes per block per layer (32768)"
    )
    parser.add_argument("--entries", type=int, default=1_000_000, help="indexed blocks (1e6)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per measurement (5)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (for tests)")


def _median(fn: Callable[[], float], repeat: int) -> float:
    return statistics.median(fn() for _ in range(repeat))


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


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


def _cpu(args: argparse.Namespace, blocks: int, layers: int, lb: int) -> dict[str, float]:
    worker, kv = _worker(layers, lb, blocks)
    ids = tuple(range(blocks))
    total = blocks * layers * lb
    job_ids = iter(range(1, 1 << 30))
    engine_us: list[float] = []
    copy_ms: list[float] = []

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

    try:
        store_s = _median(store, args.repeat)
        _median(step_store, args.repeat)
        load_s = _median(load, args.repeat)
    finally:
        worker.shutdown()
    return {
        "store_gbps": _gbps(total, store_s),
        "load_gbps": _gbps(total, load_s),
        "store_engine_thread_us": statistics.median(engine_us),
        "store_copy_out_ms": statistics.median(copy_ms),
        "step_store_engine_thread_us": statistics.median(step_us),
    }


def _memcpy(args: argparse.Namespace, total: int) -> float:
    src = np.random.default_rng(0).integers(0, 255, total, dtype=np.uint8)
    dst = np.empty_like(src)

    def once() -> float:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t0

    return _gbps(total, _median(once, args.repeat))


def _disk(args: argparse.Namespace, blocks: int, block_bytes: int) -> dict[str, float]:
    rng = np.random.default_rng(1)
    data = [rng.integers(0, 255, block_bytes, dtype=np.uint8) for _ in range(blocks)]
    out = np.empty(block_bytes, dtype=np.uint8)
    total = blocks * block_bytes
    keys = [i.to_bytes(32, "little") for i in range(blocks)]
    with tempfile.TemporaryDirectory(prefix="kvframe-bench-offload-") as tmp:
        tier = DiskTier(
            TierConfig(
                name="disk",
                index=1,
                capacity_bytes=(block_bytes + 64) * blocks,
                block_bytes=block_bytes,
                options={"path": str(Path(tmp) / "tier")},
            )
        )
        tier.open()
        plain = Path(tmp) / "plain"
        plain.mkdir()

        def tier_write() -> float:
            t0 = time.perf_counter()
            for k, d in zip(keys, data, strict=True):
                tier.write(k, 0, d)
            return time.perf_counter() - t0

        def tier_read() -> float:
            t0 = time.perf_counter()
            for k in keys:
                tier.read(k, 0, out)
            return time.perf_counter() - t0

        def pwrite() -> float:
            t0 = time.perf_counter()
            for i, d in enumerate(data):
                fd = os.open(plain / str(i), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.pwrite(fd, memoryview(d.data), 0)
                os.close(fd)
            return time.perf_counter() - t0

        def pread() -> float:
            t0 = time.perf_counter()
            for i in range(blocks):
                fd = os.open(plain / str(i), os.O_RDONLY)
                os.preadv(fd, [memoryview(out.data)], 0)
                os.close(fd)
            return time.perf_counter() - t0

        results = {
            "write_gbps": _gbps(total, _median(tier_write, args.repeat)),
            "read_gbps": _gbps(total, _median(tier_read, args.repeat)),
            "pwrite_gbps": _gbps(total, _median(pwrite, args.repeat)),
            "pread_gbps": _gbps(total, _median(pread, args.repeat)),
        }
        tier.close()
    return results


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

    return _median(once, args.repeat) / (len(queries) * 16) * 1e6


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
    cpu = _cpu(args, blocks, layers, lb)
    disk = _disk(args, blocks, layers * lb)
    trace = _trace(quick)
    distinct = len({k for req in trace for k in req})
    capacity = max(16, distinct // 6)
    return {
        "benchmark": "offload",
        "params": {
            "blocks": blocks,
            "block_bytes": layers * lb,
            "layers": layers,
            "entries": entries,
            "repeat": repeat,
            "quick": quick,
        },
        "results": {
            "cpu": {"store_gbps": cpu["store_gbps"], "load_gbps": cpu["load_gbps"]},
            "disk": {"write_gbps": disk["write_gbps"], "read_gbps": disk["read_gbps"]},
            "baselines": {
                "memcpy_gbps": _memcpy(args, blocks * layers * lb),
                "pwrite_gbps": disk["pwrite_gbps"],
                "pread_gbps": disk["pread_gbps"],
            },
            "store_engine_thread_us": cpu["store_engine_thread_us"],
            "store_copy_out_ms": cpu["store_copy_out_ms"],
            "step_store_engine_thread_us": cpu["step_store_engine_thread_us"],
            "lookup_us_per_block": _lookup_cost(args, entries),
            "hit_rates": {
                "lru": _hit_rate("lru", trace, capacity),
                "arc": _hit_rate("arc", trace, capacity),
            },
        },
    }


def _human(report: dict[str, Any]) -> str:
    p, r = report["params"], report["results"]
    lines = [
        f"kvframe bench offload: {p['blocks']} blocks of {p['block_bytes']} bytes "
        f"({p['layers']} layers), median of {p['repeat']}",
        "",
        f"{'copy':<34}{'GB/s':>8}",
        f"{'cpu tier store (KV -> CPU)':<34}{r['cpu']['store_gbps']:>8.2f}",
        f"{'cpu tier load (CPU -> KV)':<34}{r['cpu']['load_gbps']:>8.2f}",
        f"{'memcpy (np.copyto, one copy)':<34}{r['baselines']['memcpy_gbps']:>8.2f}",
        f"{'disk tier write':<34}{r['disk']['write_gbps']:>8.2f}",
        f"{'os.pwrite, file per block':<34}{r['baselines']['pwrite_gbps']:>8.2f}",
        f"{'disk tier read':<34}{r['disk']['read_gbps']:>8.2f}",
        f"{'os.pread, file per block':<34}{r['baselines']['pread_gbps']:>8.2f}",
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
    report = measure(args)
    print(json.dumps(report, indent=2) if args.json else _human(report))
    return 0
