"""A minimal engine around one connector: scheduler and worker in one process, talking only
through codec bytes, with block-major KV tensors. Enough to drive the P/D connector step by
step without a model; the reference engine (contrib/kvframe-refengine) is the full one."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kvframe.config import KVTransferConfig
from kvframe.connectors.pd import PDConnector
from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.connector import BuildContext, EngineInfo, SchedulerStep, codec_for
from kvframe.spi.request import RequestView

BLOCK = 16
LAYERS = 2
SHAPE = (2, BLOCK, 2, 8)  # K/V, tokens, kv heads, head dim  -> 1 KiB per block per layer (fp32)


class Driver:
    def __init__(
        self,
        engine_id: str,
        role: str,
        *,
        num_blocks: int = 32,
        lease: float = 3.0,
        transport: str = "inprocess",
        extra: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        ttl: float | None = None,
        block_size: int = BLOCK,
        num_kv_heads: int | None = None,
    ) -> None:
        self.config = KVTransferConfig.from_dict(
            {
                "kv_connector": "PDConnector",
                "kv_role": role,
                "engine_id": engine_id,
                "kv_lease_duration": lease,
                **({"decoder_kv_blocks_ttl": ttl} if ttl is not None else {}),
                "kv_connector_extra_config": {"transport": transport, **(extra or {})},
            }
        )
        # With num_kv_heads the caches are NHD of that many heads (2 by default's shape).
        self.info = EngineInfo(block_size=block_size, model="test-model", num_kv_heads=num_kv_heads)
        self.shape = (2, block_size, num_kv_heads or SHAPE[2], SHAPE[3])
        self.clock = clock
        host = PluginHost()
        host.load()
        ctx = BuildContext(host=host, clock=clock)
        self.sched = PDConnector.build_scheduler(self.config, self.info, ctx)
        self.worker = PDConnector.build_worker(self.config, self.info, 0, ctx)
        self.codec = codec_for(PDConnector, self.config)
        self.kv = {f"layer{i}": torch.zeros((num_blocks, *self.shape)) for i in range(LAYERS)}
        self.worker.register_kv_caches(self.kv)
        meta = self.worker.get_handshake_metadata()
        if meta is not None:
            self.sched.set_xfer_handshake_metadata({0: meta})
        self.step_no = 0
        self.outputs: list[ConnectorOutput] = []

    def step(self) -> ConnectorOutput:
        meta = self.sched.build_connector_meta(SchedulerStep(step=self.step_no, now=self.clock()))
        self.step_no += 1
        self.worker.bind_connector_metadata(
            self.codec.decode_as(self.codec.encode(meta), ConnectorMetadata)
        )
        self.worker.start_load_kv(None)
        out = self.worker.build_connector_worker_output()
        self.worker.clear_connector_metadata()
        out = self.codec.decode_as(self.codec.encode(out), ConnectorOutput)
        self.sched.update_connector_output(out)
        self.outputs.append(out)
        return out

    def fill(self, blocks: list[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for t in self.kv.values():
            for b in blocks:
                t[b] = torch.rand(self.shape, generator=g)

    def blocks(self, blocks: list[int]) -> list[torch.Tensor]:
        return [t[blocks].clone() for t in self.kv.values()]

    def shutdown(self) -> None:
        self.sched.shutdown()
        self.worker.shutdown()


def view(rid: str, n: int, params: dict[str, Any] | None, **kw: Any) -> RequestView:
    """A request of ``n`` prompt tokens (by default the tokens ``0 .. n-1``: P's and D's views
    of one prompt agree)."""
    kw.setdefault("prompt_token_ids", list(range(n)))
    return RequestView(request_id=rid, num_prompt_tokens=n, kv_transfer_params=params, **kw)


def run_until(
    drivers: list[Driver], cond: Callable[[], bool], timeout: float = 10.0, sleep: float = 0.001
) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        for d in drivers:
            d.step()
        time.sleep(sleep)
