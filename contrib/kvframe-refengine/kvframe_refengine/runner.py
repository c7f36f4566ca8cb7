"""The model runner: the worker side of a step, with the connector's worker half called where
vLLM calls it.

The runner owns the model and the KV cache tensors. It receives a
:class:`~kvframe_refengine.scheduler.ScheduledBatch` (plain values, the connector metadata
possibly as codec bytes) and returns a :class:`~kvframe_refengine.scheduler.StepResult`; it
shares no object with the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput
from kvframe.spi.connector import KVConnectorWorker
from kvframe_refengine.model import PagedBatch, SeqSlice, TinyLM
from kvframe_refengine.scheduler import ScheduledBatch, StepResult

__all__ = ["ForwardContext", "ModelRunner", "layer_name"]


def layer_name(layer: int) -> str:
    """The name a layer's KV cache is registered under (``"layers.0"``, ...)."""
    return f"layers.{layer}"


@attrs.frozen(kw_only=True)
class ForwardContext:
    """What ``start_load_kv`` receives (opaque to connectors that do not need it)."""

    step: int
    batch: PagedBatch | None
    """The step's flat batch, or ``None`` on a step with no tokens to run."""
    kv_caches: dict[str, torch.Tensor]


class _ConnectorHooks:
    """Forwards the model's per-layer hooks to the connector's worker half."""

    def __init__(
        self, worker: KVConnectorWorker, caches: list[torch.Tensor], batch: PagedBatch
    ) -> None:
        self._worker = worker
        self._caches = caches
        self._batch = batch

    def before_attention(self, layer: int) -> None:
        self._worker.wait_for_layer_load(layer_name(layer))

    def after_attention(self, layer: int) -> None:
        self._worker.save_kv_layer(layer_name(layer), self._caches[layer], self._batch)


class ModelRunner:
    """Runs steps on one device, for one rank: the engine's own with ``tp_size`` 1, each
    worker process's with ``tp_size > 1`` (:mod:`kvframe_refengine.tp_worker`; the model is
    then that rank's shard and the connector that rank's worker half).

    Args:
        model: the model (its device is the runner's device).
        num_blocks: blocks per layer cache.
        block_size: tokens per block.
        kv_cache_order: the cache's dimension order, ``"NHD"`` or ``"HND"``
            (:meth:`~kvframe_refengine.model.TinyLM.kv_cache_shape`).
        connector: the connector's worker half, or ``None``.
        decode_metadata: turns what the scheduler sent into a ``ConnectorMetadata``.
        encode_output: turns the worker's ``ConnectorOutput`` into what the scheduler receives
            (the codec round trip, or identity).

    The KV cache is allocated (zeroed) here and registered with the connector
    (``register_kv_caches``) before the first step.
    """

    def __init__(
        self,
        model: TinyLM,
        *,
        num_blocks: int,
        block_size: int,
        kv_cache_order: str = "NHD",
        connector: KVConnectorWorker | None,
        decode_metadata: Callable[[Any], ConnectorMetadata],
        encode_output: Callable[[ConnectorOutput], ConnectorOutput],
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_cache_order = kv_cache_order
        shape = model.kv_cache_shape(num_blocks, block_size, kv_cache_order)
        self.kv_caches = [
            torch.zeros(shape, dtype=torch.float32, device=model.device)
            for _ in range(model.config.num_layers)
        ]
        self.connector = connector
        self._decode = decode_metadata
        self._encode_output = encode_output
        if connector is not None:
            connector.register_kv_caches(self.named_kv_caches())

    def named_kv_caches(self) -> dict[str, torch.Tensor]:
        """Layer name → that layer's cache tensor, in layer order."""
        return {layer_name(i): t for i, t in enumerate(self.kv_caches)}

    def _build_batch(self, batch: ScheduledBatch) -> PagedBatch:
        dev = self.model.device
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        seqs: list[SeqSlice] = []
        for s in batch.seqs:
            n = len(s.token_ids)
            table = torch.tensor(s.block_ids, dtype=torch.long, device=dev)
            pos = torch.arange(s.start, s.start + n, device=dev)
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            seqs.append(
                SeqSlice(
                    start=len(token_ids),
                    end=len(token_ids) + n,
                    context_len=s.start + n,
                    block_table=table,
                )
            )
            token_ids += s.token_ids
            positions += range(s.start, s.start + n)
        return PagedBatch(
            token_ids=torch.tensor(token_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.cat(slots),
            seqs=tuple(seqs),
        )

    def execute(self, batch: ScheduledBatch) -> StepResult:
        """Run one step: connector calls around the forward pass, then greedy sampling.

        Raises whatever the connector or the model raises (a bug: the engine stops); the KV
        cache may then hold partial writes of this step.
        """
        paged = self._build_batch(batch) if batch.seqs else None
        worker = self.connector
        if worker is None:
            logits = (
                self.model.forward_paged(paged, self.kv_caches, order=self.kv_cache_order)
                if paged
                else None
            )
            return StepResult(sampled=self._sample(batch, logits), connector_output=None)
        worker.bind_connector_metadata(self._decode(batch.connector_metadata))
        try:
            worker.start_load_kv(
                ForwardContext(step=batch.step, batch=paged, kv_caches=self.named_kv_caches())
            )
            logits = None
            if paged is not None:
                hooks = _ConnectorHooks(worker, self.kv_caches, paged)
                logits = self.model.forward_paged(
                    paged, self.kv_caches, hooks, order=self.kv_cache_order
                )
            worker.wait_for_save()
            output = worker.build_connector_worker_output(batch.finished_request_ids)
        finally:
            worker.clear_connector_metadata()
        return StepResult(
            sampled=self._sample(batch, logits), connector_output=self._encode_output(output)
        )

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor | None) -> dict[str, int]:
        if logits is None:
            return {}
        tokens = logits.argmax(dim=-1).tolist()
        return {s.request_id: int(t) for s, t in zip(batch.seqs, tokens, strict=True)}
