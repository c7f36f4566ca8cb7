"""The offloading connector's CPU tier on a device's KV cache: GPU → CPU tier → GPU.

The KV cache (``layers`` tensors of ``[blocks, layer_block_bytes]`` uint8) lives on ``device``;
the offloading connector's worker stores every block into its CPU tier (pinned host memory when
CUDA is present: :class:`~kvframe.connectors.offload.tiers.CPUTier`), the cache is zeroed, and
the worker loads every block back. Every byte is compared with what was stored. Beside it, the
same bytes go device → pinned host → device with plain torch ``copy_`` (one copy per layer), the
ceiling for the tier's copies. Run on ``cpu`` (the dry run) the same code moves host tensors
into an unpinned tier.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from kvframe.config import KVTransferConfig
from kvframe.connectors.offload import OffloadingConnector
from kvframe.connectors.offload.metadata import LoadJob, OffloadMetadata, StoreJob
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.connector import BuildContext, EngineInfo


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def measure(
    device: str, *, blocks: int, layers: int, layer_block_bytes: int, repeat: int
) -> dict[str, Any]:
    """Store and load through the CPU tier and the torch baseline; returns the report entry.

    Raises ``AssertionError`` naming the first layer whose bytes came back wrong.
    """
    dev = torch.device(device)
    total = blocks * layers * layer_block_bytes
    config = KVTransferConfig.from_dict(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"tiers": [{"tier": "cpu", "capacity_bytes": total}]},
        }
    )
    host = PluginHost()
    host.load()
    worker: Any = OffloadingConnector.build_worker(
        config, EngineInfo(block_size=16), 0, BuildContext(host=host)
    )
    gen = torch.Generator(device=dev).manual_seed(0)
    kv = {
        f"layers.{i}": torch.randint(
            0, 256, (blocks, layer_block_bytes), dtype=torch.uint8, device=dev, generator=gen
        )
        for i in range(layers)
    }
    stored = {name: t.clone() for name, t in kv.items()}
    ids = tuple(range(blocks))
    keys = tuple(i.to_bytes(32, "little") for i in ids)
    store_s: list[float] = []
    load_s: list[float] = []
    checked = 0
    try:
        worker.register_kv_caches(kv)
        tier = worker.tiers[0]
        pinned = bool(getattr(tier, "pinned", False))
        for n in range(1, repeat + 1):
            for name, t in kv.items():  # the same bytes every round, from the snapshot
                t.copy_(stored[name])
            _sync(dev)
            job = StoreJob(job_id=n, request_id=f"r{n}", block_ids=ids, keys=keys, slots=ids)
            worker.bind_connector_metadata(OffloadMetadata(offload_stores=(job,)))
            t0 = time.perf_counter()
            worker.start_load_kv(None)
            for name, t in kv.items():
                worker.save_kv_layer(name, t, None)
            worker.wait_for_save()
            worker.wait_idle()
            store_s.append(time.perf_counter() - t0)
            if not worker.build_connector_worker_output().finished_sending:
                raise AssertionError("the store did not report finished")
            worker.clear_connector_metadata()
            for t in kv.values():
                t.zero_()
            _sync(dev)
            worker.bind_connector_metadata(
                OffloadMetadata(
                    offload_loads=(LoadJob(request_id=f"r{n}", block_ids=ids, slots=ids),)
                )
            )
            t0 = time.perf_counter()
            worker.start_load_kv(None)
            for name in kv:
                worker.wait_for_layer_load(name)
            _sync(dev)
            load_s.append(time.perf_counter() - t0)
            worker.clear_connector_metadata()
            for name, t in kv.items():
                if not torch.equal(t, stored[name]):
                    raise AssertionError(
                        f"{name}: bytes loaded from the cpu tier differ from those stored"
                    )
            checked += total
    finally:
        worker.shutdown()
    baseline = _torch_round_trip(stored, dev, repeat)
    store, load = statistics.median(store_s), statistics.median(load_s)
    return {
        "device": device,
        "bytes": total,
        "blocks": blocks,
        "layers": layers,
        "layer_block_bytes": layer_block_bytes,
        "tier_pinned": pinned,
        "tier_store_gbps": _gbps(total, store),
        "tier_load_gbps": _gbps(total, load),
        "torch_d2h_gbps": _gbps(total, baseline["d2h_s"]),
        "torch_h2d_gbps": _gbps(total, baseline["h2d_s"]),
        "store_ratio": baseline["d2h_s"] / store,
        "load_ratio": baseline["h2d_s"] / load,
        "bytes_checked": checked + baseline["bytes_checked"],
    }


def _torch_round_trip(
    layers: dict[str, torch.Tensor], dev: torch.device, repeat: int
) -> dict[str, Any]:
    """The same bytes device → host (pinned where CUDA is) → device, one ``copy_`` per layer."""
    pin = dev.type == "cuda"
    host = {n: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for n, t in layers.items()}
    back = {n: torch.empty_like(t) for n, t in layers.items()}
    d2h: list[float] = []
    h2d: list[float] = []
    checked = 0
    for _ in range(repeat):
        _sync(dev)
        t0 = time.perf_counter()
        for n, t in layers.items():
            host[n].copy_(t)
        _sync(dev)
        t1 = time.perf_counter()
        for n, t in back.items():
            t.copy_(host[n])
        _sync(dev)
        t2 = time.perf_counter()
        d2h.append(t1 - t0)
        h2d.append(t2 - t1)
        for n, t in layers.items():
            if not torch.equal(back[n], t):
                raise AssertionError(f"{n}: the torch round trip changed bytes")
            checked += t.numel()
    return {
        "d2h_s": statistics.median(d2h),
        "h2d_s": statistics.median(h2d),
        "bytes_checked": checked,
    }
