"""``kvframe bench pipeline``: layer-by-layer KV loading overlapped with compute, measured.

A decode-side engine (the reference engine, one torch thread) receives requests whose first
``prefix`` tokens have their KV on another process (P) and computes the remaining ``suffix``
tokens itself. The KV of the prefix comes over NIXL (kvframe's transport plugin, cross-process,
post worker on) in one of three ways, side by side in one run:

- **whole** — one READ of every layer, waited for in ``start_load_kv``, before any compute;
- **layerwise** — one READ per layer, all posted in ``start_load_kv``; the model waits for
  layer ``i``'s in ``wait_for_layer_load`` just before layer ``i``'s attention, so the transfer
  of later layers overlaps the compute of earlier ones;
- **compute only** — the same step with the prefix's KV assumed present (no transfer): the
  compute time alone.

The transfer alone (one READ of every layer, nothing else running) is measured too, and the
ideal pipelined time ``max(compute, transfer)`` reported beside the two real runs.

Only the decode side's load is pipelined here: the prefill side's KV is already in its cache
when the request reaches D (P's per-layer save does not apply to a pull protocol).

JSON keys (``--json``)::

    {"benchmark": "pipeline", "version": 1, "model": {...}, "quick": bool,
     "cases": [{"prefix_tokens", "suffix_tokens", "kv_bytes",
                "whole_s", "layerwise_s", "compute_s", "transfer_s", "ideal_s",
                "speedup": whole_s / layerwise_s, "efficiency": ideal_s / layerwise_s}]}
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Set
from typing import Any

import msgpack
import torch

from kvframe.bench.progress import Progress
from kvframe.config import KVTransferConfig
from kvframe.protocol.messages import ConnectorMetadata, LoadSpec
from kvframe.runtime.plugins import PluginHost
from kvframe.runtime.procs import ChildProcesses
from kvframe.spi.connector import (
    BuildContext,
    EngineInfo,
    KVConnector,
    KVConnectorScheduler,
    KVConnectorWorker,
    SchedulerStep,
)
from kvframe.spi.hookspecs import hookimpl
from kvframe.spi.request import BlockIds, RequestView
from kvframe.spi.transport import (
    BlockLayout,
    LayoutHandle,
    MemoryKind,
    MemoryRegion,
    Op,
    Transport,
    TransportParams,
    XferHandle,
    XferState,
)
from kvframe_refengine.engine import Engine, EngineConfig
from kvframe_refengine.model import ModelConfig, TinyLM

__all__ = ["add_arguments", "measure", "run"]

#: A model whose KV is heavy enough for the transfer to matter (16 KiB per token).
MODEL = ModelConfig(num_layers=4, num_heads=8, num_kv_heads=8, head_dim=64, intermediate_size=512)
BLOCK = 16


def _layout_wire(layout: BlockLayout) -> dict[str, Any]:
    return {
        "regions": [[r.addr, r.length] for r in layout.regions],
        "block_lens": list(layout.block_lens),
        "num_blocks": layout.num_blocks,
    }


def _layout_from(obj: Mapping[str, Any]) -> BlockLayout:
    return BlockLayout(
        regions=[MemoryRegion(addr=a, length=n, kind=MemoryKind.HOST) for a, n in obj["regions"]],
        block_lens=obj["block_lens"],
        num_blocks=obj["num_blocks"],
    )


def _caches(num_blocks: int) -> list[torch.Tensor]:
    shape = TinyLM(MODEL).kv_cache_shape(num_blocks, BLOCK)
    gen = torch.Generator().manual_seed(0)
    return [torch.rand(shape, generator=gen) for _ in range(MODEL.num_layers)]


def serve(reply_fd: int, num_blocks: int) -> None:
    """P: hold a KV cache and serve reads of it (NIXL progress every 0.5 ms)."""
    os.dup2(2, 1)
    caches = _caches(num_blocks)
    host = PluginHost()
    host.load()
    t = host.create_transport("nixl", TransportParams(name=f"pipe-P-{os.getpid()}"))
    regions = [MemoryRegion.from_tensor(c) for c in caches]
    t.register_memory(regions)
    layout = BlockLayout(
        regions=regions, block_lens=[r.length // num_blocks for r in regions], num_blocks=num_blocks
    )
    os.write(
        reply_fd,
        msgpack.packb({"meta": t.local_metadata(), "layout": _layout_wire(layout)}),
    )
    try:
        while True:
            ready, _, _ = select.select([0], [], [], 0.0005)
            t.progress()
            if ready and not os.read(0, 1024):
                return
    finally:
        t.close()


# -- the connector under test ---------------------------------------------------------------


class _Scheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig) -> None:
        self._loads: list[LoadSpec] = []
        self._bs = BLOCK

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        prefix = int(params.get("bench_prefix", 0))
        return max(0, prefix - num_computed_tokens), False  # synchronous: in the forward

    def update_state_after_alloc(
        self, request: RequestView, blocks: BlockIds, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        params = request.kv_transfer_params or {}
        n = num_external_tokens // self._bs
        self._loads.append(
            LoadSpec(
                request_id=request.request_id,
                local_block_ids=(tuple(blocks[0][:n]),),
                remote_engine_id="P",
                remote_block_ids=(tuple(params["bench_remote_blocks"][:n]),),
                remote_request_id=request.request_id,
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerStep) -> ConnectorMetadata:
        meta = ConnectorMetadata(step=scheduler_output.step, loads=tuple(self._loads))
        self._loads.clear()
        return meta


class _Worker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, ctx: BuildContext) -> None:
        extra = config.kv_connector_extra_config
        self.mode: str = extra["mode"]
        self._peer_meta = bytes.fromhex(extra["peer_meta"])
        self._peer_layout = _layout_from(extra["peer_layout"])
        self.t: Transport = ctx.host.create_transport(
            "nixl", TransportParams(name=f"pipe-D-{os.getpid()}-{self.mode}")
        )
        self.handles: dict[int, XferHandle] = {}
        self.layer_index: dict[str, int] = {}
        self.local: LayoutHandle | None = None
        self.remote: LayoutHandle | None = None

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        regions = [MemoryRegion.from_tensor(c) for c in kv_caches.values()]
        n = next(iter(kv_caches.values())).shape[0]
        self.layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.t.register_memory(regions)
        self.local = self.t.prepare_local(
            BlockLayout(regions=regions, block_lens=[r.length // n for r in regions], num_blocks=n)
        )
        peer = self.t.add_peer(self._peer_meta)
        self.remote = self.t.prepare_remote(peer, self._peer_layout)

    def _wait(self, h: XferHandle) -> None:
        while (status := self.t.poll(h)).state is XferState.PENDING:
            time.sleep(0)  # yield the GIL to the transport's post worker
        self.t.release(h)
        if status.state is not XferState.DONE:
            raise RuntimeError(f"pipeline bench READ failed: {status.error}")

    def start_load_kv(self, forward_context: Any) -> None:
        assert self.local is not None
        assert self.remote is not None
        for load in self.connector_metadata.loads:
            if self.mode == "skip":
                continue
            lb, rb = list(load.local_block_ids[0]), list(load.remote_block_ids[0])
            if self.mode == "whole":
                self._wait(self.t.post(Op.READ, self.local, lb, self.remote, rb))
            else:
                for i in range(len(self.layer_index)):
                    self.handles[i] = self.t.post(
                        Op.READ, self.local, lb, self.remote, rb, regions=[i]
                    )

    def wait_for_layer_load(self, layer_name: str) -> None:
        h = self.handles.pop(self.layer_index[layer_name], None)
        if h is not None:
            self._wait(h)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        return

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: Set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None

    def transfer_alone(self, blocks: list[int]) -> float:
        assert self.local is not None
        assert self.remote is not None
        t0 = time.perf_counter()
        self._wait(self.t.post(Op.READ, self.local, blocks, self.remote, blocks))
        return time.perf_counter() - t0

    def shutdown(self) -> None:
        self.t.close()


class PipelineBenchConnector(KVConnector):
    """The connector the benchmark measures (registered only in the benchmark's own host)."""

    @classmethod
    def build_scheduler(
        cls, config: KVTransferConfig, engine: EngineInfo, ctx: BuildContext
    ) -> KVConnectorScheduler:
        return _Scheduler(config)

    @classmethod
    def build_worker(
        cls, config: KVTransferConfig, engine: EngineInfo, rank: int, ctx: BuildContext
    ) -> KVConnectorWorker:
        return _Worker(config, ctx)


class _Plugin:
    @hookimpl
    def kvframe_register_connectors(self, register: Any) -> None:
        register("PipelineBench", PipelineBenchConnector)


# -- measurement ----------------------------------------------------------------------------


def _engine(mode: str, hello: dict[str, Any], num_blocks: int) -> Engine:
    host = PluginHost()
    host.load()
    host.register(_Plugin(), name="pipeline-bench")
    kv = KVTransferConfig.from_dict(
        {
            "kv_connector": "PipelineBench",
            "kv_role": "kv_consumer",
            "engine_id": f"pipe-{mode}",
            "kv_connector_extra_config": {
                "mode": mode,
                "peer_meta": hello["meta"].hex(),
                "peer_layout": hello["layout"],
            },
        }
    )
    return Engine(
        EngineConfig(
            model=MODEL,
            num_blocks=num_blocks,
            block_size=BLOCK,
            max_num_batched_tokens=4096,
            max_model_len=4096,
            enable_prefix_caching=False,
            torch_threads=1,
        ),
        kv,
        plugin_host=host,
    )


def _time_request(engine: Engine, prefix: int, suffix: int, rid: int) -> float:
    prompt = [(rid * 7 + i) % 256 for i in range(prefix + suffix)]
    params = {"bench_prefix": prefix, "bench_remote_blocks": list(range(prefix // BLOCK))}
    engine.add_request(f"r{rid}", prompt, 1, params)
    t0 = time.perf_counter()
    while True:
        outs = engine.step()
        if any(o.finished for o in outs):
            return time.perf_counter() - t0


def measure(cases: list[tuple[int, int]], repeats: int) -> dict[str, Any]:
    """Run every (prefix, suffix) case; see the module docstring for the result's shape."""
    num_blocks = max(p + s for p, s in cases) // BLOCK + 8
    progress = Progress("pipeline", total=len(cases))
    progress.note("starting P's process")
    r, w = os.pipe()
    children = ChildProcesses()  # its own process group, stopped on a signal
    child = children.popen(
        [
            sys.executable,
            "-m",
            "kvframe_refengine.bench_pipeline",
            "serve",
            str(w),
            str(num_blocks),
        ],
        stdin=subprocess.PIPE,
        pass_fds=[w],
    )
    os.close(w)
    unpacker = msgpack.Unpacker(raw=False)
    hello: dict[str, Any] | None = None
    deadline = time.monotonic() + 120
    while hello is None:
        if time.monotonic() > deadline or child.poll() is not None:
            raise RuntimeError("the pipeline benchmark's P process did not start")
        ready, _, _ = select.select([r], [], [], 0.1)
        if ready:
            unpacker.feed(os.read(r, 1 << 16))
            hello = next(iter(unpacker), None)
    engines = {m: _engine(m, hello, num_blocks) for m in ("whole", "layerwise", "skip")}
    out: list[dict[str, Any]] = []
    try:
        rid = 0
        for prefix, suffix in cases:
            progress(f"{prefix} + {suffix} tokens: whole, layer by layer, compute only")
            times: dict[str, list[float]] = {m: [] for m in engines}
            transfer: list[float] = []
            for i in range(repeats + 1):  # round 0 warms up (handshake, caches)
                for k in range(len(engines)):
                    mode = list(engines)[(i + k) % len(engines)]
                    rid += 1
                    times[mode].append(_time_request(engines[mode], prefix, suffix, rid))
                worker = engines["whole"].connector_worker
                assert isinstance(worker, _Worker)
                transfer.append(worker.transfer_alone(list(range(prefix // BLOCK))))
            med = {m: statistics.median(v[1:]) for m, v in times.items()}
            t_transfer = statistics.median(transfer[1:])
            ideal = max(med["skip"], t_transfer)
            kv_bytes = prefix * MODEL.num_layers * 2 * MODEL.num_kv_heads * MODEL.head_dim * 4
            out.append(
                {
                    "prefix_tokens": prefix,
                    "suffix_tokens": suffix,
                    "kv_bytes": kv_bytes,
                    "whole_s": med["whole"],
                    "layerwise_s": med["layerwise"],
                    "compute_s": med["skip"],
                    "transfer_s": t_transfer,
                    "ideal_s": ideal,
                    "speedup": med["whole"] / med["layerwise"],
                    "efficiency": ideal / med["layerwise"],
                }
            )
    finally:
        for e in engines.values():
            e.shutdown()
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
        os.close(r)
        children.close()
    return {
        "benchmark": "pipeline",
        "version": 1,
        "model": {
            "layers": MODEL.num_layers,
            "kv_heads": MODEL.num_kv_heads,
            "head_dim": MODEL.head_dim,
            "block_size": BLOCK,
            "kv_bytes_per_token": MODEL.num_layers * 2 * MODEL.num_kv_heads * MODEL.head_dim * 4,
        },
        "cases": out,
    }


FULL_CASES = [(1024, 16), (2048, 16), (3072, 16), (1024, 128), (2048, 256)]
QUICK_CASES = [(256, 32)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json``, ``--quick`` (one small case, for tests of the output's shape)."""
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="one small case; not for figures")


def _table(report: dict[str, Any]) -> str:
    lines = [
        "Decode-side prefill with the prefix's KV pulled over NIXL (ms, median)",
        "",
        "| prefix + suffix tokens | KV | whole then compute | layer by layer | speed-up "
        "| compute alone | transfer alone | ideal max(c, t) | efficiency |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["cases"]:
        lines.append(
            f"| {c['prefix_tokens']} + {c['suffix_tokens']} | {c['kv_bytes'] / 2**20:.1f} MiB "
            f"| {c['whole_s'] * 1e3:.1f} | {c['layerwise_s'] * 1e3:.1f} | {c['speedup']:.2f}x "
            f"| {c['compute_s'] * 1e3:.1f} | {c['transfer_s'] * 1e3:.1f} "
            f"| {c['ideal_s'] * 1e3:.1f} | {100 * c['efficiency']:.0f} % |"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark and print a table, or JSON with ``--json``."""
    report = measure(QUICK_CASES if args.quick else FULL_CASES, 1 if args.quick else 5)
    report["quick"] = bool(args.quick)
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "serve":
        serve(int(sys.argv[2]), int(sys.argv[3]))
    else:
        ap = argparse.ArgumentParser(prog="kvframe bench pipeline")
        add_arguments(ap)
        raise SystemExit(run(ap.parse_args()))
