"""The scheduler: continuous batching over a paged KV cache, with the connector's scheduler
half called where vLLM calls it.

One step is :meth:`Scheduler.schedule` (decide what runs, build the connector metadata), then the
model runner executes it, then :meth:`Scheduler.update` (apply the worker's report: tokens,
finished transfers, failed loads). The scheduler never touches KV memory and never sees the
worker's objects: it sends a :class:`ScheduledBatch` and gets a :class:`StepResult` back.

**Admission reserves the worst case.** A request is admitted only when the pool can hold every
block it will ever need (prompt plus ``max_tokens - 1`` tokens) on top of what running requests
have reserved, so allocation never fails mid-flight and nothing is ever preempted. A tiny
engine buys simplicity with some idle capacity.

**Blocks held for later go first.** When a waiting request does not fit, the scheduler asks
the connector to give back blocks it holds only for possible future use
(``KVConnectorScheduler.reclaim_blocks(short_by, now)``: a decoder's blocks kept for a
conversation's next turn), at most once per step and only for what the connector has not
already promised. The connector frees them through ``finished_sending`` of a coming step; the
request is admitted in the step after that, when the blocks are free.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from kvframe.config import KVTransferConfig
from kvframe.errors import ConfigError, KVFrameError
from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput, KVEvent
from kvframe.spi.connector import KVConnectorScheduler, SchedulerStep
from kvframe.spi.request import RequestView
from kvframe_refengine.block_pool import BlockPool
from kvframe_refengine.request import FinishReason, Request, RequestOutput, RequestStatus

__all__ = [
    "RECLAIM_PATIENCE_STEPS",
    "HeldBlocks",
    "ScheduledBatch",
    "ScheduledSeq",
    "Scheduler",
    "StepResult",
]

RECLAIM_PATIENCE_STEPS = 8
"""Steps the scheduler waits for blocks the connector promised (``reclaim_blocks``) before it
stops counting on them and may ask again (the SPI says they come within a step or two)."""


@attrs.frozen(kw_only=True)
class ScheduledSeq:
    """One request's work in a step, as the model runner needs it."""

    request_id: str
    token_ids: tuple[int, ...]
    """The tokens to run (their KV is written at positions ``start ..``)."""
    start: int
    """Position of the first token: the request's computed tokens before this step."""
    block_ids: tuple[int, ...]
    """The request's blocks, covering ``start + len(token_ids)`` tokens."""


@attrs.frozen(kw_only=True)
class ScheduledBatch:
    """Everything the scheduler sends the worker for one step."""

    step: int
    seqs: tuple[ScheduledSeq, ...]
    connector_metadata: ConnectorMetadata | bytes | None
    """The connector's metadata for the step: the value, or its codec bytes when the engine
    routes metadata through the codec; ``None`` without a connector."""
    finished_request_ids: frozenset[str]
    """Requests finished since the previous step (passed to the worker's ``get_finished``)."""

    @property
    def num_tokens(self) -> int:
        """Tokens run through the model this step."""
        return sum(len(s.token_ids) for s in self.seqs)


@attrs.frozen(kw_only=True)
class StepResult:
    """What the worker reports back after a step."""

    sampled: Mapping[str, int]
    """Request id → greedy token from the logits of its last scheduled token."""
    connector_output: ConnectorOutput | None
    """The worker's connector report (already decoded), or ``None`` without a connector."""


@attrs.define(kw_only=True)
class HeldBlocks:
    """A finished request whose blocks the connector still needs."""

    block_ids: list[int]
    wait_sending: bool
    """Until the connector reports it in ``finished_sending`` (``delay_free``)."""
    wait_recving: bool
    """Until the connector reports its (aborted) load in ``finished_recving``."""


class Scheduler:
    """Queues, block accounting, prefix caching and the connector's scheduler half.

    Args:
        pool: the block pool (shared with nobody else).
        block_size: tokens per block.
        max_num_seqs: most requests holding blocks for compute (running or loading) at once.
        max_num_batched_tokens: most tokens run in one step (longer prompts are chunked).
        enable_prefix_caching: reuse cached blocks for equal prefixes.
        connector: the connector's scheduler half, or ``None``.
        kv_config: the KV-transfer configuration (for ``kv_load_failure_policy``).
        encode: turns metadata into what the worker receives (the codec, or identity).
        clock: the engine's monotonic clock, in seconds.
    """

    def __init__(
        self,
        *,
        pool: BlockPool,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool,
        connector: KVConnectorScheduler | None,
        kv_config: KVTransferConfig | None,
        encode: Callable[[ConnectorMetadata], ConnectorMetadata | bytes],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.connector = connector
        self.failure_policy = "recompute" if kv_config is None else kv_config.kv_load_failure_policy
        self._encode = encode
        self._clock = clock
        self.step_number = 0
        self.requests: dict[str, Request] = {}
        """Live requests (waiting, loading or running)."""
        self.waiting: deque[Request] = deque()
        self.loading: dict[str, Request] = {}
        self.running: list[Request] = []
        self.held: dict[str, HeldBlocks] = {}
        self._finished_since_step: set[str] = set()
        self._outputs: list[RequestOutput] = []
        self.events: deque[KVEvent] = deque(maxlen=10_000)
        """Connector events (both halves), oldest first; the oldest are dropped past 10,000."""
        self.worker_counters: dict[str, float] = {}
        """The worker's connector counters, summed over steps."""
        self.counters: dict[str, int] = {
            "tokens_computed": 0,
            "prefix_hit_tokens": 0,
            "external_tokens": 0,
            "load_failures": 0,
            "requests_refused": 0,
            "unknown_finished_reports": 0,
            "reclaim_asked_blocks": 0,
            "reclaim_promised_blocks": 0,
        }
        self._reclaim_pending = 0
        """Blocks the connector promised to free (``reclaim_blocks``) not yet seen freed."""
        self._reclaim_since = 0
        """The step of the latest promise (for :data:`RECLAIM_PATIENCE_STEPS`)."""
        self._reclaim_asked_step = -1

    # -- views -------------------------------------------------------------------------------
    def view(self, req: Request, finish_reason: str | None = None) -> RequestView:
        """The frozen view of ``req`` that connectors get (``finish_reason`` once it ended)."""
        return RequestView(
            finish_reason=finish_reason,
            request_id=req.request_id,
            num_prompt_tokens=len(req.prompt),
            prompt_token_ids=req.prompt,
            output_token_ids=req.output,
            num_computed_tokens=req.num_computed_tokens,
            block_ids=(tuple(req.block_ids),),
            block_hashes=tuple(req.block_hashes),
            kv_transfer_params=req.kv_transfer_params,
            arrival_time=req.arrival_time,
        )

    def _reserved(self) -> int:
        """Blocks promised to admitted requests but not yet allocated."""
        live = [*self.running, *self.loading.values()]
        live += [r for r in self.waiting if r.allocated]
        return sum(r.num_lifetime_blocks - len(r.block_ids) for r in live)

    def has_requests(self) -> bool:
        """Whether any request is live or any finished request still holds blocks."""
        return bool(self.requests or self.held)

    # -- arrivals and departures -------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Ask the connector whether it takes the request (``check_request``: a
        :class:`~kvframe.errors.ConfigError` for ``kv_transfer_params`` it refuses), tell it
        (``on_new_request``), then queue the request. If the connector raises, the exception
        propagates and nothing was queued or allocated."""
        if self.connector is not None:
            view = self.view(req)
            try:
                self.connector.check_request(view)
            except ConfigError:
                self.counters["requests_refused"] += 1
                raise
            self.connector.on_new_request(view)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> bool:
        """Finish a live request as aborted; False when it is not live."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._finish(req, FinishReason.ABORT)
        return True

    def _finish(
        self,
        req: Request,
        reason: FinishReason,
        error: str | None = None,
        new_token_ids: tuple[int, ...] = (),
    ) -> None:
        """End ``req``: leave the queues, ask the connector (``request_finished``), then free
        its blocks or hold them for the connector."""
        del self.requests[req.request_id]
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            del self.loading[req.request_id]
        else:
            self.waiting.remove(req)
        delay_free, params = False, None
        if self.connector is not None:
            delay_free, params = self.connector.request_finished(
                self.view(req, reason.value), (tuple(req.block_ids),)
            )
            self._finished_since_step.add(req.request_id)
        # A load still in flight writes into these blocks: they stay held until the worker
        # reports it stopped, whatever the connector answered.
        wait_recving = req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        if req.block_ids and (delay_free or wait_recving):
            self.held[req.request_id] = HeldBlocks(
                block_ids=req.block_ids, wait_sending=delay_free, wait_recving=wait_recving
            )
        else:
            self.pool.free(req.block_ids)
        req.block_ids = []
        self._outputs.append(
            RequestOutput(
                request_id=req.request_id,
                new_token_ids=new_token_ids,
                token_ids=tuple(req.output),
                finished=True,
                finish_reason=reason,
                error=error,
                kv_transfer_params=params,
                num_cached_tokens=req.num_local_hit_tokens,
                num_external_tokens=req.num_external_tokens,
            )
        )

    # -- one step: decide --------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Pick this step's work, allocate its blocks, build the connector's metadata."""
        budget = self.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        new_counts: dict[str, int] = {}
        cached_counts: dict[str, int] = {}
        new_blocks: dict[str, tuple[tuple[int, ...], ...]] = {}
        computed_after: dict[str, int] = {}
        hashes: dict[str, tuple[bytes, ...]] = {}

        def run(req: Request) -> None:
            nonlocal budget
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            end = req.num_computed_tokens + n
            missing = -(-end // self.block_size) - len(req.block_ids)
            fresh: list[int] = []
            if missing > 0:
                fresh = self.pool.allocate(missing)
                req.block_ids += fresh
            tokens = req.all_token_ids[req.num_computed_tokens : end]
            seqs.append(
                ScheduledSeq(
                    request_id=req.request_id,
                    token_ids=tuple(tokens),
                    start=req.num_computed_tokens,
                    block_ids=tuple(req.block_ids),
                )
            )
            (cached_counts if req.ever_scheduled else new_counts)[req.request_id] = n
            # The connector's per-step view (SchedulerStep): a new request's blocks are all
            # of them, a running one's only those appended now.
            added = fresh if req.ever_scheduled else req.block_ids
            if added:
                new_blocks[req.request_id] = (tuple(added),)
            computed_after[req.request_id] = end
            hashes[req.request_id] = tuple(req.block_hashes)
            req.ever_scheduled = True
            budget -= n

        for req in self.running:
            if budget == 0:
                break
            run(req)
        for req in list(self.waiting):
            if budget == 0:
                break
            if not req.allocated and len(self.running) + len(self.loading) >= self.max_num_seqs:
                break
            admitted = self._admit(req)
            if admitted is None:
                continue  # not known yet: ask again next step; later requests may go
            if not admitted:
                break  # no room: first come, first served
            if req.status is RequestStatus.RUNNING:
                run(req)

        self.step_number += 1
        meta: ConnectorMetadata | bytes | None = None
        finished = frozenset(self._finished_since_step)
        self._finished_since_step.clear()
        if self.connector is not None:
            built = self.connector.build_connector_meta(
                SchedulerStep(
                    step=self.step_number - 1,
                    new_requests=new_counts,
                    cached_requests=cached_counts,
                    finished_request_ids=finished,
                    now=self._clock(),
                    new_block_ids=new_blocks,
                    num_computed_tokens=computed_after,
                    block_hashes=hashes,
                )
            )
            meta = self._encode(built)
        return ScheduledBatch(
            step=self.step_number - 1,
            seqs=tuple(seqs),
            connector_metadata=meta,
            finished_request_ids=finished,
        )

    def _admit(self, req: Request) -> bool | None:
        """Try to move a waiting request to running (or to loading). Returns ``None`` when the
        connector does not know yet, ``False`` when the blocks do not fit, else ``True``."""
        if req.allocated:
            # Back from an asynchronous load: blocks and counts were settled then.
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            return True
        bs = self.block_size
        hits: list[int] = []
        if self.enable_prefix_caching:
            # At most len(prompt) - 1 tokens from the cache: the last prompt token must run to
            # give the logits of the first generated token.
            max_hit_blocks = (len(req.prompt) - 1) // bs
            hits = self.pool.lookup(req.block_hashes[:max_hit_blocks])
        num_local = len(hits) * bs
        ext, is_async = 0, False
        if self.connector is not None:
            req.num_computed_tokens = num_local
            try:
                answer, is_async = self.connector.get_num_new_matched_tokens(
                    self.view(req), num_local
                )
            except KVFrameError as exc:
                self._finish(req, FinishReason.ERROR, f"the connector refused the request: {exc}")
                return True
            if answer is None:
                return None
            ext = answer
            if type(ext) is not int or ext < 0 or num_local + ext > len(req.prompt):
                self._finish(
                    req,
                    FinishReason.ERROR,
                    f"the connector offered {ext!r} external tokens for a prompt of "
                    f"{len(req.prompt)} tokens with {num_local} cached locally",
                )
                return True
        need_blocks = req.num_lifetime_blocks - len(hits)
        available = self.pool.num_free - self.pool.num_touch_would_take(hits) - self._reserved()
        if need_blocks > available:
            self._reclaim(need_blocks - available)
            return False
        self.pool.touch(hits)
        computed = num_local + ext
        req.block_ids = hits + self.pool.allocate(-(-computed // bs) - len(hits))
        req.num_cached_blocks = len(hits)
        req.num_local_hit_tokens = num_local
        req.num_external_tokens = ext
        req.allocated = True
        self.counters["prefix_hit_tokens"] += num_local
        if self.connector is not None:
            try:
                self.connector.update_state_after_alloc(
                    self.view(req), (tuple(req.block_ids),), ext
                )
            except KVFrameError as exc:
                self._finish(req, FinishReason.ERROR, f"the connector refused the request: {exc}")
                return True
        self.waiting.remove(req)
        if ext and is_async:
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            req.num_computed_tokens = num_local
            self.loading[req.request_id] = req
            return True
        req.load_is_sync = ext > 0
        req.num_computed_tokens = self._computed_after_load(req, computed)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return True

    def _reclaim(self, short_by: int) -> None:
        """A waiting request is ``short_by`` blocks short: ask the connector for blocks it
        holds for later use (once per step, only beyond what it already promised)."""
        if self.connector is None or self._reclaim_asked_step == self.step_number:
            return
        self._reclaim_asked_step = self.step_number
        if self.step_number - self._reclaim_since > RECLAIM_PATIENCE_STEPS:
            self._reclaim_pending = 0  # never came: stop counting on it
        ask = short_by - self._reclaim_pending
        if ask <= 0:
            return
        self.counters["reclaim_asked_blocks"] += ask
        promised = self.connector.reclaim_blocks(ask, self._clock())
        if type(promised) is not int or promised <= 0:
            return
        self.counters["reclaim_promised_blocks"] += promised
        self._reclaim_pending += promised
        self._reclaim_since = self.step_number

    def _computed_after_load(self, req: Request, computed: int) -> int:
        # The last-prompt-token rule: a load that covers the whole prompt still leaves the
        # last prompt token to compute here, because its logits give the first output token.
        # Its KV slot is rewritten with equal values, after the layer's load landed.
        return min(computed, len(req.prompt) - 1)

    # -- one step: apply the worker's report -------------------------------------------------
    def update(self, batch: ScheduledBatch, result: StepResult) -> list[RequestOutput]:
        """Apply a step's result; returns the outputs of the step (new tokens, finishes)."""
        out = result.connector_output
        invalid: frozenset[int] = frozenset()
        if out is not None and self.connector is not None:
            self.connector.update_connector_output(out)
            invalid = out.invalid_block_ids
            for b in invalid:
                self.pool.uncache(b)
            self._finish_loads(out, invalid)
            self.events.extend(out.events)
            for name, value in out.stats.counters.items():
                self.worker_counters[name] = self.worker_counters.get(name, 0) + value
        if self.connector is not None:
            self.events.extend(self.connector.take_events())
        for seq in batch.seqs:
            req = self.requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # finished (aborted, failed) since it was scheduled
            self.counters["tokens_computed"] += len(seq.token_ids)
            if req.load_is_sync:
                req.load_is_sync = False
                if self._apply_load_errors(req, invalid, out, loaded_until=seq.start):
                    continue
                self.counters["external_tokens"] += req.num_external_tokens
            req.num_computed_tokens = seq.start + len(seq.token_ids)
            if req.num_computed_tokens < req.num_tokens:
                self._cache_full_blocks(req)  # a chunk of a long prompt: no token yet
                continue
            token = result.sampled[seq.request_id]
            req.append_token(token)
            self._cache_full_blocks(req)
            if len(req.output) >= req.max_tokens:
                self._finish(req, FinishReason.LENGTH, new_token_ids=(token,))
            else:
                self._outputs.append(self._token_output(req, token))
        if out is not None:
            for rid in out.finished_sending:
                held = self.held.get(rid)
                if held is None or not held.wait_sending:
                    self.counters["unknown_finished_reports"] += 1
                    continue
                held.wait_sending = False
                self._release_if_done(rid)
        outputs, self._outputs = self._outputs, []
        return outputs

    def _token_output(self, req: Request, token: int) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=(token,),
            token_ids=tuple(req.output),
            finished=False,
            num_cached_tokens=req.num_local_hit_tokens,
            num_external_tokens=req.num_external_tokens,
        )

    def _finish_loads(self, out: ConnectorOutput, invalid: frozenset[int]) -> None:
        for rid in out.finished_recving:
            held = self.held.get(rid)
            if held is not None and held.wait_recving:
                held.wait_recving = False
                self._release_if_done(rid)
                continue
            req = self.loading.pop(rid, None)
            if req is None:
                self.counters["unknown_finished_reports"] += 1
                continue
            req.status = RequestStatus.WAITING
            # Back to the head of the queue: its blocks are already paid for.
            self.waiting.appendleft(req)
            loaded_until = self._computed_after_load(
                req, req.num_local_hit_tokens + req.num_external_tokens
            )
            if self._apply_load_errors(req, invalid, out, loaded_until=loaded_until):
                continue
            req.num_computed_tokens = loaded_until
            self.counters["external_tokens"] += req.num_external_tokens
            self._cache_full_blocks(req)

    def _apply_load_errors(
        self,
        req: Request,
        invalid: frozenset[int],
        out: ConnectorOutput | None,
        *,
        loaded_until: int,
    ) -> bool:
        """Apply ``kv_load_failure_policy`` if a load into ``req``'s blocks failed; returns
        True if it did. ``loaded_until`` is the token count the load was to complete."""
        first_bad = next((i for i, b in enumerate(req.block_ids) if b in invalid), None)
        if first_bad is None:
            return False
        self.counters["load_failures"] += 1
        reason = (out.failures.get(req.request_id) if out is not None else None) or "no reason"
        # What was really loaded: the tokens of the blocks before the first bad one, past the
        # local hits. The outputs (and the router's usage) report that, not what was asked.
        good = min(loaded_until, first_bad * self.block_size)
        req.num_external_tokens = max(0, good - req.num_local_hit_tokens)
        if self.failure_policy == "fail":
            self._finish(
                req,
                FinishReason.ERROR,
                f"loading the KV of blocks {sorted(set(req.block_ids) & invalid)} failed "
                f"({reason}); kv_load_failure_policy is 'fail'",
            )
            return True
        # recompute: keep the good prefix (local hits and the blocks before the first bad
        # one), recompute everything from the first bad block on. Bad blocks were never
        # cached, so nobody else has read them.
        req.num_computed_tokens = good
        self.counters["external_tokens"] += req.num_external_tokens
        return True

    def _cache_full_blocks(self, req: Request) -> None:
        if not self.enable_prefix_caching:
            return
        full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        for i in range(req.num_cached_blocks, full):
            self.pool.cache(req.block_ids[i], req.block_hashes[i])
        req.num_cached_blocks = max(req.num_cached_blocks, full)

    def _release_if_done(self, rid: str) -> None:
        held = self.held[rid]
        if not (held.wait_sending or held.wait_recving):
            del self.held[rid]
            self.pool.free(held.block_ids)
            self._reclaim_pending = max(0, self._reclaim_pending - len(held.block_ids))

    # -- checks ------------------------------------------------------------------------------
    def describe_leaks(self) -> list[str]:
        """Human-readable reasons why the scheduler is not idle and clean (empty when it is)."""
        problems: list[str] = []
        if self.requests:
            problems.append(f"live requests: {sorted(self.requests)}")
        if self.held:
            problems.append(f"finished requests still holding blocks: {sorted(self.held)}")
        held = self.pool.held_blocks()
        if held:
            problems.append(f"blocks still held (id: holders): {held}")
        return problems

    def debug_state(self) -> dict[str, Any]:
        """Queue sizes and pool counts, for logs and failing tests."""
        return {
            "waiting": len(self.waiting),
            "loading": len(self.loading),
            "running": len(self.running),
            "held": len(self.held),
            "free_blocks": self.pool.num_free,
            "cached_blocks": self.pool.num_cached,
        }
