"""``kvframe bench transfer``'s tensor-parallel table: P4→D2 and P2→D4 against P2→D2.

One model (4 KV heads, one layer, ``BLOCK_TOKENS`` tokens per block, NHD caches, float32),
three pairs of engines in this process, each engine a P/D connector scheduler half and one
worker half per rank over NIXL, metadata and outputs crossing as codec bytes and the ranks'
outputs aggregated as an engine does (:class:`~kvframe.protocol.aggregate.OutputAggregator`).
Per request: P finishes it and grants its lease on every rank (untimed), then the timed part:
D's scheduler plans the load, every D rank reads its heads from the P ranks that hold them
(one READ per source rank; at P2→D2 one READ of whole blocks per rank), until D's aggregated
output reports the request received. The three pairings are measured in the same rounds
(their order rotating), on the same random block sets, and every load's bytes are checked
against P's (untimed). Ratios are time ratios: pairing median / P2→D2 median.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["BLOCK_TOKENS", "HEADS", "PAIRINGS", "measure_tp"]

HEADS = 4
"""KV heads of the benchmark's model (split at TP 2 and 4, never replicated)."""
BLOCK_TOKENS = 16
"""Tokens per KV block."""
PAIRINGS: tuple[tuple[int, int], ...] = ((2, 2), (4, 2), (2, 4))
"""(P's tp_size, D's tp_size); the first is the baseline of the ratios."""


def _name(pair: tuple[int, int]) -> str:
    return f"P{pair[0]}->D{pair[1]}"


class _TPEngine:
    """One engine: the P/D connector's scheduler half and ``tp`` worker halves (NIXL), each
    rank with a ``[num_blocks, 2, BLOCK_TOKENS, HEADS / tp, head_dim]`` float32 cache."""

    def __init__(
        self,
        role: str,
        tp: int,
        head_dim: int,
        num_blocks: int,
        tag: str,
        *,
        transport: str = "nixl",
        heads: int = HEADS,
        lease: float = 6.0,
    ) -> None:
        import torch

        from kvframe.config import KVTransferConfig
        from kvframe.connectors.pd import PDConnector
        from kvframe.core.tp import kv_heads_of
        from kvframe.protocol.aggregate import OutputAggregator
        from kvframe.runtime.plugins import PluginHost
        from kvframe.spi.connector import BuildContext, EngineInfo, codec_for

        config = KVTransferConfig.from_dict(
            {
                "kv_connector": "PDConnector",
                "kv_role": role,
                "engine_id": f"benchtp-{tag}-{os.getpid()}",
                "kv_lease_duration": lease,
                "kv_connector_extra_config": {"transport": transport},
            }
        )
        self.codec = codec_for(PDConnector, config)
        info = EngineInfo(
            block_size=BLOCK_TOKENS, world_size=tp, model="bench-tp", num_kv_heads=heads
        )
        host = PluginHost()
        host.load()
        ctx = BuildContext(host=host)
        self.tp = tp
        self.heads = [list(kv_heads_of(r, tp, heads)) for r in range(tp)]
        self.sched = PDConnector.build_scheduler(config, info, ctx)
        self.workers = []
        self.caches = []
        for r in range(tp):
            self.workers.append(PDConnector.build_worker(config, info, r, ctx))
            cache = torch.zeros(
                (num_blocks, 2, BLOCK_TOKENS, len(self.heads[r]), head_dim), dtype=torch.float32
            )
            self.caches.append(cache)
            self.workers[r].register_kv_caches({"layer0": cache})
        blobs = {r: w.get_handshake_metadata() for r, w in enumerate(self.workers)}
        if all(b is not None for b in blobs.values()):
            self.sched.set_xfer_handshake_metadata(blobs)  # type: ignore[arg-type]
        self.agg = OutputAggregator(tp)
        self.n = 0
        self.recving: set[str] = set()
        self.sending: set[str] = set()
        self.failures: dict[str, str] = {}
        self.invalid: set[int] = set()

    def fill(self, whole: np.ndarray[Any, Any]) -> None:
        """Each rank's cache := its heads of ``whole`` (``[blocks, 2, tokens, HEADS, dim]``)."""
        import torch

        for r, cache in enumerate(self.caches):
            cache.copy_(torch.from_numpy(np.ascontiguousarray(whole[:, :, :, self.heads[r]])))

    def step(self) -> None:
        """One engine step: metadata to every rank (codec bytes), their outputs aggregated."""
        from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput
        from kvframe.spi.connector import SchedulerStep

        meta = self.sched.build_connector_meta(SchedulerStep(step=self.n, now=time.monotonic()))
        self.n += 1
        data = self.codec.encode(meta)
        for r, w in enumerate(self.workers):
            w.bind_connector_metadata(self.codec.decode_as(data, ConnectorMetadata))
            w.start_load_kv(None)
            out = w.build_connector_worker_output()
            w.clear_connector_metadata()
            self.agg.add(r, self.codec.decode_as(self.codec.encode(out), ConnectorOutput))
        out = self.agg.take()
        self.sched.update_connector_output(out)
        self.recving |= out.finished_recving
        self.sending |= out.finished_sending
        self.failures.update(out.failures)
        self.invalid |= set(out.invalid_block_ids)

    def grant(self, rid: str, blocks: list[int]) -> dict[str, Any]:
        from kvframe.spi.request import RequestView

        view = RequestView(
            request_id=rid,
            num_prompt_tokens=len(blocks) * BLOCK_TOKENS + 1,
            kv_transfer_params={"do_remote_decode": True},
            finish_reason="length",
        )
        _, params = self.sched.request_finished(view, (tuple(blocks),))
        assert params is not None
        return params

    def schedule(self, rid: str, params: dict[str, Any], blocks: list[int]) -> None:
        from kvframe.spi.request import RequestView

        view = RequestView(
            request_id=rid,
            num_prompt_tokens=len(blocks) * BLOCK_TOKENS + 1,
            kv_transfer_params=params,
            arrival_time=time.monotonic(),
        )
        self.sched.on_new_request(view)
        n, _ = self.sched.get_num_new_matched_tokens(view, 0)
        self.sched.update_state_after_alloc(view, (tuple(blocks),), n or 0)

    def close(self) -> None:
        for w in self.workers:
            w.shutdown()
        self.sched.shutdown()


class _Pair:
    """P at ``p_tp`` and D at ``d_tp`` over one model."""

    def __init__(self, pair: tuple[int, int], head_dim: int, num_blocks: int) -> None:
        tag = f"{pair[0]}x{pair[1]}"
        self.name = _name(pair)
        self.p = _TPEngine("kv_producer", pair[0], head_dim, num_blocks, f"P{tag}")
        self.d = _TPEngine("kv_consumer", pair[1], head_dim, num_blocks, f"D{tag}")
        self.ids = 0

    def load(self, src: list[int], dst: list[int]) -> float:
        """Grant (untimed), then load; returns the seconds from planning to received."""
        self.ids += 1
        rid = f"r{self.ids}"
        params = self.p.grant(rid, src)
        self.p.step()  # every P rank holds the lease now
        t0 = time.perf_counter()
        self.d.schedule(f"d{self.ids}", params, dst)
        deadline = time.monotonic() + 30
        while f"d{self.ids}" not in self.d.recving:
            self.d.step()
            self.p.step()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: load d{self.ids} did not finish in 30 s")
        took = time.perf_counter() - t0
        if f"d{self.ids}" in self.d.failures:
            raise RuntimeError(f"{self.name}: load failed: {self.d.failures[f'd{self.ids}']}")
        while rid not in self.p.sending:  # untimed: P frees the blocks on every rank
            self.p.step()
            self.d.step()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: P did not free request {rid}")
        return took

    def check(self, whole: np.ndarray[Any, Any], src: list[int], dst: list[int]) -> bool:
        """D's blocks ``dst`` hold exactly P's blocks ``src``, rank by rank, head by head."""
        for r, cache in enumerate(self.d.caches):
            want = whole[src][:, :, :, self.d.heads[r]]
            if not np.array_equal(cache.numpy()[dst], want):
                return False
        return True

    def clear(self, dst: list[int]) -> None:
        for cache in self.d.caches:
            cache[dst] = 0

    def close(self) -> None:
        self.d.close()
        self.p.close()


def measure_tp(
    block_bytes: int,
    blocks: tuple[int, ...],
    repeats: int,
    rng: np.random.Generator,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The TP table: per number of blocks, each pairing's median and p90 seconds per request
    and its ratio to P2→D2. ``block_bytes`` is one block of the whole model (all heads);
    raises ``RuntimeError`` when a load fails or moves wrong bytes."""
    head_dim = block_bytes // (2 * BLOCK_TOKENS * HEADS * 4)
    if head_dim < 1:
        raise ValueError(f"block_bytes = {block_bytes}; at least {2 * BLOCK_TOKENS * HEADS * 4}")
    num_blocks = 2 * max(blocks) + 2
    whole = rng.standard_normal((num_blocks, 2, BLOCK_TOKENS, HEADS, head_dim)).astype(np.float32)
    pairs: list[_Pair] = []
    checked = 0
    rows: list[dict[str, Any]] = []
    try:
        for pair in PAIRINGS:
            pairs.append(_Pair(pair, head_dim, num_blocks))
            pairs[-1].p.fill(whole)
        for n in blocks:
            if progress is not None:
                progress(f"tensor parallel, {n} blocks")
            times: dict[str, list[float]] = {p.name: [] for p in pairs}
            for i in range(repeats + 1):  # round 0 warms up (handshakes) and is dropped
                src = rng.permutation(num_blocks)[:n].tolist()
                dst = rng.permutation(num_blocks)[:n].tolist()
                for j in range(len(pairs)):
                    p = pairs[(i + j) % len(pairs)]
                    p.clear(dst)
                    took = p.load(src, dst)
                    if not p.check(whole, src, dst):
                        raise RuntimeError(f"{p.name}: D's blocks differ from P's after a load")
                    checked += 1
                    if i:
                        times[p.name].append(took)
            results = {
                name: {"median_s": statistics.median(ts), "p90_s": _p90(ts)}
                for name, ts in times.items()
            }
            base = _name(PAIRINGS[0])
            rows.append(
                {
                    "blocks": n,
                    "bytes": n * block_bytes,
                    "results": results,
                    "ratios": {
                        f"{name}/{base}": results[name]["median_s"] / results[base]["median_s"]
                        for name in results
                        if name != base
                    },
                }
            )
    finally:
        for p in pairs:
            p.close()
    return {
        "heads": HEADS,
        "head_dim": head_dim,
        "block_tokens": BLOCK_TOKENS,
        "block_bytes": block_bytes,
        "pairings": [_name(p) for p in PAIRINGS],
        "rows": rows,
        "loads_checked": checked,
    }


def _p90(samples: list[float]) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, -(-9 * len(ordered) // 10) - 1))]
