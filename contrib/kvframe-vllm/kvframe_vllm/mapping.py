"""Pure mappings from vLLM's objects to kvframe's engine-independent values.

Duck-typed on purpose (attribute reads only), so that the adapter survives small changes in
vLLM's classes and these functions can be tested with plain stand-ins.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvframe.spi.connector import SchedulerStep
from kvframe.spi.request import BlockIds, RequestView, as_block_ids, block_hashes

__all__ = [
    "FINISH_REASON_BY_STATUS",
    "BlockHashCache",
    "finish_reason",
    "kv_regions",
    "monotonic_from_wall",
    "request_view",
    "scheduler_step",
]

FINISH_REASON_BY_STATUS: Mapping[str, str] = {
    "FINISHED_STOPPED": "stop",
    "FINISHED_REPETITION": "stop",
    "FINISHED_LENGTH_CAPPED": "length",
    "FINISHED_ABORTED": "abort",
    "FINISHED_IGNORED": "error",
    "FINISHED_ERROR": "error",
}
"""vLLM ``RequestStatus`` name → kvframe ``RequestView.finish_reason``."""


def finish_reason(status: Any) -> str | None:
    """kvframe's finish reason for a vLLM ``RequestStatus`` (``None`` while it runs; an
    unknown finished status counts as ``"error"``, so a producer never keeps its KV)."""
    name = getattr(status, "name", str(status))
    if name in FINISH_REASON_BY_STATUS:
        return FINISH_REASON_BY_STATUS[name]
    return "error" if name.startswith("FINISHED") else None


def monotonic_from_wall(wall: float) -> float:
    """Map a ``time.time()`` stamp (vLLM's ``Request.arrival_time``) onto ``time.monotonic()``
    (the clock kvframe connectors get in ``SchedulerStep.now``)."""
    return wall - time.time() + time.monotonic()


class BlockHashCache:
    """kvframe block hashes per live request, extended as the request grows (vLLM's own
    hashes use another function and may be salted per process; kvframe's are the same on
    every host). Not thread-safe: the scheduler calls it from one thread."""

    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._hashes: dict[str, tuple[bytes, ...]] = {}

    def hashes(self, request: Any) -> tuple[bytes, ...]:
        """The hashes of every full block of ``request.all_token_ids`` (salted with
        ``request.cache_salt`` when set)."""
        tokens: Sequence[int] = request.all_token_ids
        have = self._hashes.get(request.request_id, ())
        if len(have) == len(tokens) // self._block_size:
            return have
        salt = (getattr(request, "cache_salt", None) or "").encode()
        out = block_hashes(list(tokens), self._block_size, salt=salt)
        self._hashes[request.request_id] = out
        return out

    def forget(self, request_id: str) -> None:
        """Drop a finished request's hashes; never raises."""
        self._hashes.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._hashes)


def request_view(
    request: Any,
    *,
    hashes: BlockHashCache,
    num_computed_tokens: int | None = None,
    block_ids: BlockIds = (),
    finished: bool = False,
    drop_params: bool = False,
) -> RequestView:
    """A :class:`~kvframe.spi.request.RequestView` of a vLLM ``Request``.

    ``num_computed_tokens`` overrides the request's own count (vLLM updates it only after
    ``update_state_after_alloc``, so the adapter passes the local hits it was told).
    ``finished`` sets ``finish_reason`` from the request's status. ``drop_params`` hides the
    request's ``kv_transfer_params`` (the adapter does so once its remote load failed). Raises what
    ``RequestView`` raises for malformed fields (``ValueError``/``TypeError``).
    """
    params = None if drop_params else getattr(request, "kv_transfer_params", None)
    return RequestView(
        request_id=request.request_id,
        num_prompt_tokens=int(request.num_prompt_tokens),
        prompt_token_ids=getattr(request, "prompt_token_ids", None) or (),
        num_computed_tokens=int(
            request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        ),
        block_ids=block_ids,
        block_hashes=hashes.hashes(request),
        kv_transfer_params=params if isinstance(params, Mapping) else None,
        arrival_time=monotonic_from_wall(float(request.arrival_time)),
        finish_reason=finish_reason(request.status) if finished else None,
    )


def kv_regions(kv_caches: Mapping[str, Any], num_blocks: int) -> dict[str, Any]:
    """vLLM's per-layer KV tensors as block-major regions (dim 0 = block id), the layout
    kvframe connectors register.

    - ``[num_blocks, ...]`` (vLLM's CPU backend, and FlashAttention with
      ``HND``/``NHD`` cross-layer layouts): kept as is, under the layer's name.
    - ``[2, num_blocks, ...]`` (K/V-first): split into two block-major views named
      ``"<layer>.k"`` and ``"<layer>.v"``.

    Raises ``ValueError`` naming the layer for any other shape, or a non-contiguous block
    region (kvframe describes a block as one run of bytes).
    """
    out: dict[str, Any] = {}
    for name, t in kv_caches.items():
        shape = tuple(t.shape)
        if shape and shape[0] == num_blocks:
            parts = {name: t}
        elif len(shape) >= 2 and shape[0] == 2 and shape[1] == num_blocks:
            parts = {f"{name}.k": t[0], f"{name}.v": t[1]}
        else:
            raise ValueError(
                f"KV cache of layer {name!r} has shape {shape}; kvframe_vllm understands "
                f"[num_blocks={num_blocks}, ...] and [2, num_blocks={num_blocks}, ...]"
            )
        for part, view in parts.items():
            if not view.is_contiguous():
                raise ValueError(
                    f"KV cache region {part!r} (shape {tuple(view.shape)}, stride "
                    f"{tuple(view.stride())}) is not contiguous; a block must be one run of bytes"
                )
            out[part] = view
    return out


def scheduler_step(
    scheduler_output: Any,
    *,
    step: int,
    now: float,
    hashes: BlockHashCache | None = None,
    requests: Mapping[str, Any] | None = None,
) -> SchedulerStep:
    """kvframe's :class:`~kvframe.spi.connector.SchedulerStep` for a vLLM ``SchedulerOutput``.

    - ``new_requests``: ``scheduled_new_reqs`` and the cached requests vLLM lists in
      ``resumed_req_ids`` (back after preemption: their old blocks were freed), with their
      ``num_scheduled_tokens``; ``cached_requests``: the other cached ones.
    - ``new_block_ids``: ``NewRequestData.block_ids`` (all blocks), and
      ``CachedRequestData.new_block_ids`` (appended blocks; all blocks for a resumed request;
      ``None`` entries are left out).
    - ``num_computed_tokens``: vLLM's count before the step plus the scheduled tokens, minus
      the step's speculative tokens (``scheduled_spec_decode_tokens``: they may be rejected).
    - ``block_hashes``: kvframe's hashes of each scheduled request found in ``requests``
      (request id → vLLM ``Request``, which the adapter keeps from
      ``update_state_after_alloc``), computed through ``hashes``; left out without them.

    Raises what ``SchedulerStep`` raises for malformed values (``ValueError``/``TypeError``).
    """
    counts: Mapping[str, int] = scheduler_output.num_scheduled_tokens
    spec: Mapping[str, Any] = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    new: dict[str, int] = {}
    cached: dict[str, int] = {}
    blocks: dict[str, BlockIds] = {}
    computed: dict[str, int] = {}

    def after(rid: str, before: int) -> int:
        return max(0, int(before) + counts.get(rid, 0) - len(spec.get(rid, ())))

    for r in scheduler_output.scheduled_new_reqs:
        new[r.req_id] = counts.get(r.req_id, 0)
        blocks[r.req_id] = as_block_ids(r.block_ids)
        computed[r.req_id] = after(r.req_id, r.num_computed_tokens)
    c = scheduler_output.scheduled_cached_reqs
    resumed = set(getattr(c, "resumed_req_ids", None) or ())
    new_ids = list(getattr(c, "new_block_ids", None) or ())
    before = list(getattr(c, "num_computed_tokens", None) or ())
    for i, rid in enumerate(c.req_ids):
        (new if rid in resumed else cached)[rid] = counts.get(rid, 0)
        if i < len(new_ids) and new_ids[i] is not None:
            blocks[rid] = as_block_ids(new_ids[i])
        if i < len(before):
            computed[rid] = after(rid, before[i])
    known: dict[str, tuple[bytes, ...]] = {}
    if hashes is not None and requests is not None:
        for rid in (*new, *cached):
            req = requests.get(rid)
            if req is not None:
                known[rid] = hashes.hashes(req)
    return SchedulerStep(
        step=step,
        new_requests=new,
        cached_requests=cached,
        finished_request_ids=frozenset(scheduler_output.finished_req_ids),
        now=now,
        new_block_ids=blocks,
        num_computed_tokens=computed,
        block_hashes=known,
    )
