"""The engine: a scheduler and a model runner in one process, and the public API.

::

    engine = Engine(EngineConfig(), kv_transfer_config=None)
    outputs = engine.generate([[1, 2, 3], [4, 5]], max_tokens=8)
    engine.check_no_leaks()
    engine.shutdown()

With a :class:`~kvframe.config.KVTransferConfig` the engine builds the named connector through
kvframe's plugin host and calls its two halves at the points described in
``docs/reference-engine.md``. The scheduler and the runner exchange only plain values; with
``EngineConfig(encode_metadata=True)`` (the default) the connector's metadata and output also
travel as codec bytes between them, as they would between processes.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch

from kvframe.config import KVTransferConfig
from kvframe.errors import ConfigError
from kvframe.protocol.codec import DEFAULT_CODEC, Codec
from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput, KVEvent, Stats
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.connector import (
    BuildContext,
    EngineInfo,
    KVConnector,
    KVConnectorScheduler,
    KVConnectorWorker,
    codec_for,
)
from kvframe_refengine.block_pool import BlockPool
from kvframe_refengine.model import ModelConfig, TinyLM, check_tp_size
from kvframe_refengine.request import FinishReason, Request, RequestOutput, RequestStatus
from kvframe_refengine.runner import ModelRunner
from kvframe_refengine.scheduler import ScheduledBatch, Scheduler, StepResult
from kvframe_refengine.tp import TPWorkers

__all__ = ["MAX_REQUEST_ID_BYTES", "Engine", "EngineConfig", "LeakError", "check_request_id"]

_log = logging.getLogger(__name__)

MAX_REQUEST_ID_BYTES = 128
"""The longest request id :meth:`Engine.add_request` (and the HTTP servers) accept, in UTF-8
bytes: 128 ASCII characters. Connectors may carry it, or ids built from it, on their own wires
(kvframe's heartbeat wire format carries at most 255 bytes per id), so an id without a bound
could be accepted here and fail later, inside a step."""


def check_request_id(value: object) -> str:
    """Return ``value`` if it is a usable request id: a ``str`` of printable characters, 1 to
    :data:`MAX_REQUEST_ID_BYTES` bytes in UTF-8. Raises ``ValueError`` saying what is wrong, what
    is allowed and what to do."""
    rule = (
        f"a request id is 1 to {MAX_REQUEST_ID_BYTES} bytes of printable UTF-8 text "
        f"({MAX_REQUEST_ID_BYTES} ASCII characters)"
    )
    if not isinstance(value, str):
        raise ValueError(
            f"request_id = {value!r} is of type {type(value).__name__}, not str; {rule}"
        )
    shown = repr(value) if len(value) <= 40 else f"{value[:40]!r}... ({len(value)} characters)"
    if not value:
        raise ValueError(f"request_id is empty; {rule}; leave it out to get a generated one")
    if not value.isprintable():
        bad = next(c for c in value if not c.isprintable())
        raise ValueError(f"request_id = {shown} contains {bad!r}, which is not printable; {rule}")
    size = len(value.encode("utf-8"))
    if size > MAX_REQUEST_ID_BYTES:
        raise ValueError(
            f"request_id = {shown} is {size} bytes in UTF-8; {rule}; use a shorter id "
            "(a UUID is 36 characters)"
        )
    return value


def _positive(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"EngineConfig.{attribute.name} = {value!r}; it must be a positive int")


def _non_negative_seconds(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"EngineConfig.{attribute.name} = {value!r}; it must be seconds >= 0")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """The engine's settings. Raises ``ValueError`` naming the field for a bad value."""

    model: ModelConfig = attrs.field(factory=ModelConfig)
    num_blocks: int = attrs.field(default=256, validator=_positive)
    """KV blocks per layer (the pool's size)."""
    block_size: int = attrs.field(default=16, validator=_positive)
    """Tokens per block."""
    max_num_seqs: int = attrs.field(default=16, validator=_positive)
    """Most requests running or loading at once."""
    max_num_batched_tokens: int = attrs.field(default=512, validator=_positive)
    """Most tokens in one forward pass; longer prompts are prefilled in chunks."""
    max_model_len: int = attrs.field(default=2048, validator=_positive)
    """Longest prompt plus ``max_tokens`` a request may ask for."""
    enable_prefix_caching: bool = True
    encode_metadata: bool = True
    """Send the connector's metadata and output between scheduler and runner as codec bytes
    (proves that nothing else is shared). Off: the values are passed as they are."""
    device: str = "cpu"
    """Torch device for the model and the KV cache (``"cpu"``, ``"cuda"``, ``"cuda:1"``)."""
    torch_threads: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive)
    )
    """If set, the engine calls ``torch.set_num_threads`` with it at construction (process-wide).
    The model is tiny: one thread is usually fastest, and several engines sharing few cores
    slow each other down badly with more. With ``tp_size > 1`` each worker process uses this
    many threads (1 when unset)."""
    idle_sleep_s: float = attrs.field(default=0.001, validator=_non_negative_seconds)
    """How long :meth:`Engine.generate` and :meth:`Engine.run_until_idle` sleep after a step
    that ran no tokens (waiting on the connector)."""
    tp_size: int = attrs.field(default=1, validator=_positive)
    """Tensor-parallel ranks. 1: the model runs in the engine's process. N > 1: N worker
    processes, each holding its shard of the model, the KV cache of its KV heads and its own
    connector worker half (:mod:`kvframe_refengine.tp`). Must fit the model
    (:func:`~kvframe_refengine.model.check_tp_size`)."""
    kv_cache_order: str = attrs.field(default="NHD", validator=attrs.validators.in_(("NHD", "HND")))
    """The KV cache's dimension order, which the model reads and writes: ``"NHD"`` (default)
    ``[block, K/V, token, head, dim]``, or ``"HND"`` ``[block, K/V, head, token, dim]``. The
    engine tells its connector (``EngineInfo.kv_cache_order``): the P/D connector moves KV
    between engines of different orders only with ``allow_layout_permute`` on the decoder,
    and between different tensor-parallel sizes only when both are NHD."""
    worker_timeout_s: float = attrs.field(default=60.0, validator=_non_negative_seconds)
    """With ``tp_size > 1``: the longest one step may take on the workers (and each
    all-reduce in it) before the engine declares them broken and fails every live request;
    the workers' start-up may take four times as long."""

    def __attrs_post_init__(self) -> None:
        try:
            check_tp_size(self.model, self.tp_size)
        except ValueError as exc:
            raise ValueError(f"EngineConfig.{exc}") from None
        if self.tp_size > 1 and not self.worker_timeout_s > 0:
            raise ValueError(
                f"EngineConfig.worker_timeout_s = {self.worker_timeout_s!r}; with tp_size > 1 "
                "it must be > 0 seconds"
            )


class LeakError(AssertionError):
    """:meth:`Engine.check_no_leaks` found something still held. The message lists it all."""


class Engine:
    """A tiny real LLM engine that embeds kvframe.

    Args:
        config: the engine's settings.
        kv_transfer_config: which connector to use and how, or ``None`` for no connector.
        plugin_host: where to look the connector up, and what it looks its own plugins up
            in (:class:`~kvframe.spi.connector.BuildContext`); loaded here. Default a fresh
            :class:`~kvframe.runtime.plugins.PluginHost` (entry points and built-ins).
        codec: encodes the connector's metadata and output when ``config.encode_metadata``;
            default :func:`~kvframe.spi.connector.codec_for` of the connector (the default
            codec plus the connector's own message classes, ``KVConnector.metadata_types``).
        clock: the engine's monotonic clock in seconds (``SchedulerStep.now``, arrival times,
            and the connector's ``BuildContext.clock``).

    Raises :class:`~kvframe.errors.PluginNotFoundError` for an unknown connector name,
    :class:`~kvframe.errors.ConfigError` for a connector that needs a KV layout this engine
    does not have, and whatever the connector's factories raise. Nothing is left running then.
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_transfer_config: KVTransferConfig | None = None,
        *,
        plugin_host: PluginHost | None = None,
        codec: Codec | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv_transfer_config = kv_transfer_config
        # What the connector builds with: this engine's plugin host and clock, nothing hidden.
        ctx: BuildContext | None = None
        if kv_transfer_config is not None:
            if plugin_host is None:
                plugin_host = PluginHost()
            plugin_host.load()
            ctx = BuildContext(host=plugin_host, clock=clock)
        self._codec = codec if codec is not None else self._default_codec(kv_transfer_config, ctx)
        self._clock = clock
        self._closed = False
        if config.torch_threads is not None:
            torch.set_num_threads(config.torch_threads)
        self._model: TinyLM | None = None
        self._runner: ModelRunner | None = None
        self.workers: TPWorkers | None = None
        """With ``tp_size > 1``: the worker processes (``None`` with one rank)."""
        sched_conn, worker_conn = self._build_connector(kv_transfer_config, ctx)
        self.connector_scheduler = sched_conn
        self.connector_worker = worker_conn
        """The connector's worker half with one rank; ``None`` with ``tp_size > 1`` (each
        worker process holds its own)."""
        self.pool = BlockPool(config.num_blocks)
        try:
            handshake: dict[int, bytes] = {}
            if config.tp_size == 1:
                self._model = TinyLM(config.model, device=config.device)
                self._runner = ModelRunner(
                    self._model,
                    num_blocks=config.num_blocks,
                    block_size=config.block_size,
                    kv_cache_order=config.kv_cache_order,
                    connector=worker_conn,
                    decode_metadata=self._decode_metadata,
                    encode_output=self._round_trip_output,
                )
                blob = worker_conn.get_handshake_metadata() if worker_conn is not None else None
                if blob is not None:
                    handshake[0] = blob
            else:
                self.workers = TPWorkers(
                    model=config.model,
                    tp_size=config.tp_size,
                    num_blocks=config.num_blocks,
                    block_size=config.block_size,
                    kv_cache_order=config.kv_cache_order,
                    device=config.device,
                    torch_threads=config.torch_threads or 1,
                    timeout_s=config.worker_timeout_s,
                    engine_model=self.engine_info().model,
                    kv_transfer_config=(
                        None if kv_transfer_config is None else kv_transfer_config.to_json()
                    ),
                    codec=self._codec,
                )
                handshake = self.workers.handshake_metadata
            if sched_conn is not None:
                sched_conn.set_xfer_handshake_metadata(handshake)
            self._handshake = dict(handshake)
        except BaseException:
            self._shutdown_connector()
            raise
        self.scheduler = Scheduler(
            pool=self.pool,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_prefix_caching=config.enable_prefix_caching,
            connector=sched_conn,
            kv_config=kv_transfer_config,
            encode=self._encode_metadata,
            clock=clock,
        )
        self.num_steps = 0
        self.num_idle_steps = 0
        self.num_failed_steps = 0
        """Steps that raised (see :meth:`step`)."""
        self.last_step_error: str | None = None
        """What the latest failed step raised, for operators (``None`` if none failed)."""
        self._failure_streak = 0
        self._last_step_ran_tokens = False
        self._generated = 0
        self._sched_counters: dict[str, float] = {}

    # -- construction helpers ----------------------------------------------------------------
    @property
    def model(self) -> TinyLM:
        """The model, with one rank. Raises ``RuntimeError`` with ``tp_size > 1``: each
        worker process holds its shard (:attr:`workers`)."""
        if self._model is None:
            raise RuntimeError(
                f"tp_size = {self.config.tp_size}: the model lives in the worker processes, "
                "one shard each (Engine.workers); use read_kv() to see their KV caches"
            )
        return self._model

    @property
    def runner(self) -> ModelRunner:
        """The model runner, with one rank. Raises ``RuntimeError`` with ``tp_size > 1``
        (each worker process runs its own)."""
        if self._runner is None:
            raise RuntimeError(
                f"tp_size = {self.config.tp_size}: each worker process runs its own model "
                "runner (Engine.workers)"
            )
        return self._runner

    def engine_info(self) -> EngineInfo:
        """What connectors learn about this engine; ``model`` is a digest of the model
        configuration, so engines with different weights never exchange KV; ``world_size``
        is ``tp_size``; ``num_kv_heads`` is the model's and ``kv_cache_order`` the cache's
        (:attr:`EngineConfig.kv_cache_order`), so engines of different tensor-parallel sizes
        exchange KV (NHD caches)."""
        digest = hashlib.sha256(repr(self.config.model).encode()).hexdigest()[:16]
        return EngineInfo(
            block_size=self.config.block_size,
            world_size=self.config.tp_size,
            model=f"refengine-tinylm-{digest}",
            num_kv_heads=self.config.model.num_kv_heads,
            kv_cache_order=self.config.kv_cache_order,
        )

    def side_channel_ports(self) -> tuple[int, ...]:
        """The P/D connector's side-channel port of every rank, rank order (what a fleet
        registration announces); empty when it runs no side channel (a decoder that only
        reads). Raises :class:`~kvframe.errors.ConfigError` for an engine without kvframe's
        ``PDConnector`` or whose ranks did not all tell their address."""
        from kvframe.connectors.pd import PDConnector
        from kvframe.connectors.pd.metadata import PDWorkerAddress

        kv = self.kv_transfer_config
        if kv is None or kv.kv_connector != "PDConnector":
            name = "none" if kv is None else kv.kv_connector
            raise ConfigError(
                f"this engine's connector is {name!r}: only kvframe's PDConnector has a side "
                "channel to announce; run the engine with kv_connector PDConnector"
            )
        if not self._handshake:
            return ()
        if len(self._handshake) != self.config.tp_size:
            raise ConfigError(
                f"{len(self._handshake)} of {self.config.tp_size} ranks told their side-channel "
                "address (the connector runs no side channel?)"
            )
        codec = codec_for(PDConnector, kv)
        ports = []
        for rank in sorted(self._handshake):
            address = codec.decode_as(self._handshake[rank], PDWorkerAddress)
            ports.append(address.port)
        return tuple(ports)

    @staticmethod
    def _default_codec(kv: KVTransferConfig | None, ctx: BuildContext | None) -> Codec:
        # The connector names its own message classes (KVConnector.metadata_types).
        if kv is None or ctx is None:
            return DEFAULT_CODEC
        return codec_for(ctx.host.connector(kv.kv_connector), kv)

    def _build_connector(
        self, kv: KVTransferConfig | None, ctx: BuildContext | None
    ) -> tuple[KVConnectorScheduler | None, KVConnectorWorker | None]:
        if kv is None or ctx is None:
            return None, None
        cls: type[KVConnector] = ctx.host.connector(kv.kv_connector)
        layout = cls.get_required_kvcache_layout(kv, ctx)
        if layout not in (None, self.config.kv_cache_order):
            raise ConfigError(
                f"kv_connector {kv.kv_connector!r} needs KV cache layout {layout!r}; this "
                f"engine's is {self.config.kv_cache_order!r}: set EngineConfig.kv_cache_order "
                "(NHD or HND)"
            )
        # With tp_size > 1 each worker process builds its own rank's half (tp_worker.py).
        info = self.engine_info()
        sched = cls.build_scheduler(kv, info, ctx)
        try:
            worker = cls.build_worker(kv, info, 0, ctx) if self.config.tp_size == 1 else None
        except BaseException:
            sched.shutdown()
            raise
        return sched, worker

    def _encode_metadata(self, meta: ConnectorMetadata) -> ConnectorMetadata | bytes:
        if not self.config.encode_metadata:
            return meta
        try:
            return self._codec.encode(meta)
        except (TypeError, ValueError) as exc:
            raise ConfigError(
                f"cannot encode the connector's metadata ({type(meta).__qualname__}): {exc}; "
                "list its message classes in the connector's metadata_types() (the engine's "
                "codec is codec_for(connector, config)), pass Engine(codec=...), or "
                "EngineConfig(encode_metadata=False)"
            ) from exc

    def _decode_metadata(self, sent: Any) -> ConnectorMetadata:
        if isinstance(sent, bytes):
            return self._codec.decode_as(sent, ConnectorMetadata)
        if not isinstance(sent, ConnectorMetadata):
            raise TypeError(f"expected connector metadata, got {type(sent).__name__}")
        return sent

    def _round_trip_output(self, output: ConnectorOutput) -> ConnectorOutput:
        if not self.config.encode_metadata:
            return output
        return self._codec.decode_as(self._codec.encode(output), ConnectorOutput)

    # -- the API -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        kv_transfer_params: Mapping[str, Any] | None = None,
    ) -> None:
        """Queue a request; its tokens come out of later :meth:`step` calls.

        Raises ``ValueError`` for an id that :func:`check_request_id` refuses (not 1 to
        :data:`MAX_REQUEST_ID_BYTES` bytes of printable text) or that is still in use (a
        finished request whose blocks the connector still holds keeps its id), an empty
        prompt, a token outside the vocabulary,
        ``max_tokens < 1``, a request longer than ``max_model_len`` or one that needs more
        blocks than the whole cache; ``TypeError`` for parameters that are not a mapping;
        :class:`~kvframe.errors.ConfigError` (a ``ValueError``) for ``kv_transfer_params`` the
        connector refuses (its ``check_request``: a bad ticket, out-of-bounds fields). The
        engine is unchanged then. Raises ``RuntimeError`` after :meth:`shutdown`.
        """
        self._check_open()
        sched = self.scheduler
        check_request_id(request_id)
        if request_id in sched.requests or request_id in sched.held:
            raise ValueError(
                f"request id {request_id!r} is still in use (live, or its blocks are held for "
                "the connector); pick another id"
            )
        prompt = list(prompt_token_ids)
        vocab = self.config.model.vocab_size
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        bad: list[object] = [
            t for t in prompt if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
        ]
        if bad:
            raise ValueError(
                f"request {request_id!r}: token {bad[0]!r} is not an int in [0, {vocab})"
            )
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"request {request_id!r}: max_tokens = {max_tokens!r}; must be >= 1")
        if len(prompt) + max_tokens > self.config.max_model_len:
            raise ValueError(
                f"request {request_id!r}: {len(prompt)} prompt tokens + max_tokens {max_tokens} "
                f"exceed max_model_len {self.config.max_model_len}"
            )
        if kv_transfer_params is not None and not isinstance(kv_transfer_params, Mapping):
            raise TypeError(
                f"request {request_id!r}: kv_transfer_params must be a mapping or None, got "
                f"{type(kv_transfer_params).__name__}"
            )
        req = Request(
            request_id,
            prompt,
            max_tokens,
            self.config.block_size,
            kv_transfer_params,
            self._clock(),
        )
        if req.num_lifetime_blocks > self.config.num_blocks:
            raise ValueError(
                f"request {request_id!r} needs {req.num_lifetime_blocks} blocks but the cache "
                f"has {self.config.num_blocks}; shorten it or raise EngineConfig.num_blocks"
            )
        sched.add(req)

    def step(self) -> list[RequestOutput]:
        """Run one engine step (possibly with no tokens: the connector still gets its
        metadata and reports). Returns the outputs of this step: new tokens and finishes
        (finishes carry ``kv_transfer_params``). Raises ``RuntimeError`` after
        :meth:`shutdown`.

        An ``Exception`` raised while stepping (by the model, the connector or the engine
        itself) does not escape: it is logged, counted (:attr:`num_failed_steps`,
        :attr:`last_step_error`), and the requests it concerns end with
        ``finish_reason=ERROR`` and an ``error`` naming it, in this step's outputs. Those are
        the requests of the step (running) and the ones whose KV the connector is loading (its
        worker half acts for them in every step); if the next step fails too, every live
        request ends, queued ones included. The engine stays usable.
        """
        self._check_open()
        batch: ScheduledBatch | None = None
        try:
            batch = self.scheduler.schedule()
            result = self._execute(batch)
            outputs = self.scheduler.update(batch, result)
        except Exception as exc:
            outputs = self._fail_step(batch, exc)
            self._last_step_ran_tokens = False
        else:
            self._failure_streak = 0
            self._last_step_ran_tokens = bool(batch.seqs)
            if not batch.seqs:
                self.num_idle_steps += 1
        self.num_steps += 1
        return outputs

    def _execute(self, batch: ScheduledBatch) -> StepResult:
        if self.workers is not None:
            return self.workers.execute(batch)
        return self.runner.execute(batch)

    def read_kv(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """A copy of the KV cache's blocks ``block_ids``, one tensor per rank (one with
        ``tp_size`` 1), each ``[layers, len(block_ids), 2, block_size, kv_heads, head_dim]``
        (``[layers, len(block_ids), 2, kv_heads, block_size, head_dim]`` with
        :attr:`EngineConfig.kv_cache_order` ``"HND"``) with that rank's KV heads
        (:meth:`~kvframe_refengine.model.TPShard.kv_heads`). For tests and diagnostics: it
        reads whatever the blocks hold, free or not.

        Raises ``ValueError`` for a block id outside the cache and
        :class:`~kvframe_refengine.tp.WorkerFailed` when the workers are not serving.
        """
        self._check_open()
        ids = tuple(block_ids)
        bad = [b for b in ids if type(b) is not int or not 0 <= b < self.config.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad} are not in 0..{self.config.num_blocks - 1}")
        if self.workers is not None:
            return self.workers.read_kv(ids)
        index = torch.tensor(ids, dtype=torch.long, device=self.config.device)
        return [torch.stack([c[index].cpu() for c in self.runner.kv_caches])]

    def _fail_step(self, batch: ScheduledBatch | None, exc: Exception) -> list[RequestOutput]:
        # The scheduler's state is whole between its calls; only the requests the failed step
        # touched may be half-done: end them (their blocks are freed, never cached half
        # written) so that everything else can go on.
        self.num_failed_steps += 1
        self._failure_streak += 1
        streak = self._failure_streak
        sched = self.scheduler
        what = f"engine step {sched.step_number} failed: {type(exc).__name__}: {exc}"
        self.last_step_error = what
        if streak & (streak - 1) == 0:  # the 1st, 2nd, 4th, 8th... of a run: no log flood
            _log.error("%s (%d in a row)", what, streak, exc_info=exc)
        ran = {s.request_id for s in batch.seqs} if batch is not None else set()
        doomed: list[tuple[Request, str]] = []
        for req in list(sched.requests.values()):
            if req.request_id in ran or req.status is RequestStatus.RUNNING:
                doomed.append((req, "it was running in that step"))
            elif req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                doomed.append((req, "it was waiting for its KV, which the connector loads"))
            elif streak > 1:
                doomed.append((req, f"{streak} steps in a row failed, so every request ends"))
        for req, why in doomed:
            sched._finish(req, FinishReason.ERROR, f"{what} ({why})")
        outputs, sched._outputs = sched._outputs, []
        return outputs

    @property
    def last_step_ran_tokens(self) -> bool:
        """Whether the latest :meth:`step` ran the model (False for an idle step, when a
        serving loop should sleep briefly before the next one)."""
        return self._last_step_ran_tokens

    def abort(self, request_id: str) -> bool:
        """Abort a live request. Its final output (``finish_reason`` ``ABORT``) comes from the
        next :meth:`step`. Returns False (and does nothing) when the id is not live: unknown or
        already finished, which a server racing a client's cancel must tolerate."""
        self._check_open()
        return self.scheduler.abort(request_id)

    def has_unfinished_work(self) -> bool:
        """Whether stepping is still needed: live requests, blocks held for the connector, or
        the connector's ``has_pending_work()``. Once the tensor-parallel workers stopped
        (:attr:`TPWorkers.broken <kvframe_refengine.tp.TPWorkers.broken>`), only live
        requests count (a step fails them); blocks the connector held stay held, and the leak
        oracle lists them."""
        if self.workers is not None and self.workers.broken is not None:
            return bool(self.scheduler.requests)
        if self.scheduler.has_requests():
            return True
        return self.connector_scheduler is not None and self.connector_scheduler.has_pending_work()

    def generate(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, *, timeout_s: float = 60.0
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; returns each one's final output, in order.

        Returns as soon as these requests have finished; blocks a connector still holds for
        them (a producer's delayed free) are released by later steps (:meth:`run_until_idle`).
        Raises ``ValueError`` as :meth:`add_request` does and ``TimeoutError`` when they are
        not done in ``timeout_s`` seconds (they are aborted first).
        """
        ids = [f"gen-{self._generated + i}" for i in range(len(prompts))]
        self._generated += len(prompts)
        for rid, prompt in zip(ids, prompts, strict=True):
            self.add_request(rid, prompt, max_tokens)
        final: dict[str, RequestOutput] = {}
        deadline = time.monotonic() + timeout_s
        while len(final) < len(ids):
            if time.monotonic() > deadline:
                for rid in ids:
                    self.abort(rid)
                raise TimeoutError(f"generate: {len(ids) - len(final)} requests still running")
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
            self._idle_pause()
        return [final[rid] for rid in ids]

    def run_until_idle(self, timeout_s: float = 10.0) -> list[RequestOutput]:
        """Step until :meth:`has_unfinished_work` is false; returns every output produced.

        Raises ``TimeoutError`` after ``timeout_s`` seconds (the engine is left as it is)."""
        outputs: list[RequestOutput] = []
        deadline = time.monotonic() + timeout_s
        while self.has_unfinished_work():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine still busy after {timeout_s} s: {self.describe()}")
            outputs += self.step()
            self._idle_pause()
        return outputs

    def idle_wait(self, cap: float = 0.05) -> float | None:
        """How long a serving loop may sleep before the next :meth:`step`, in seconds:

        - ``0`` after a step that ran tokens while requests remain (more work is ready);
        - ``idle_sleep_s`` while live requests wait on the connector (a load in flight), or
          while the connector says it must step at once (``next_deadline()`` now or past);
        - until the connector's ``next_deadline()`` (at most ``cap``) when it has pending work
          that is only timed (a heartbeat batch due later): an idle engine does not spin;
        - ``None`` when there is nothing to do at all (sleep until a request arrives).

        A loop that sleeps must wake up early for a new request (the reference server's loop
        waits on its command queue with this timeout).
        """
        if self.scheduler.requests:
            # More work is ready right after a step that ran tokens; otherwise the requests
            # wait on the connector (a load in flight). Finished requests whose blocks the
            # connector holds are the connector's to pace (below): a decoder's kept turns
            # need only a slow poll.
            return 0.0 if self._last_step_ran_tokens else self.config.idle_sleep_s
        sched = self.connector_scheduler
        if sched is None or not sched.has_pending_work():
            return None
        deadline = sched.next_deadline()
        if deadline is None:
            return cap
        wait = deadline - self._clock()
        if wait <= 0:
            return self.config.idle_sleep_s
        return min(wait, cap)

    def _idle_pause(self) -> None:
        wait = self.idle_wait()
        if wait:
            time.sleep(wait)

    def take_events(self) -> list[KVEvent]:
        """Connector events since the last call (the worker's from its step outputs, the
        scheduler half's from ``take_events``), oldest first; each is returned once."""
        events = list(self.scheduler.events)
        self.scheduler.events.clear()
        return events

    def connector_stats(self) -> dict[str, float]:
        """The worker's connector counters summed since start, plus
        :meth:`connector_scheduler_stats` (its counters summed since start and its gauges of
        this moment; scheduler keys win a clash). Empty without a connector."""
        out: dict[str, float] = dict(self.scheduler.worker_counters)
        stats = self.connector_scheduler_stats()
        out.update(stats.counters)
        out.update(stats.gauges)
        return out

    def connector_scheduler_stats(self) -> Stats:
        """The scheduler half's ``get_stats()``: counters summed since the engine started,
        gauges of this moment. Empty without a connector.

        ``get_stats()`` returns the counters since its previous call, so the engine is the
        only caller and keeps the sums: any number of readers see every count."""
        if self.connector_scheduler is None:
            return Stats()
        now = self.connector_scheduler.get_stats()
        for name, value in now.counters.items():
            self._sched_counters[name] = self._sched_counters.get(name, 0) + value
        return Stats(counters=dict(self._sched_counters), gauges=dict(now.gauges))

    def describe(self) -> dict[str, Any]:
        """Queue sizes, pool counts and counters (for logs and failing tests)."""
        return {
            **self.scheduler.debug_state(),
            **self.scheduler.counters,
            "steps": self.num_steps,
            "idle_steps": self.num_idle_steps,
            "failed_steps": self.num_failed_steps,
            "evictions": self.pool.num_evictions,
            "connector_pending": self.connector_scheduler is not None
            and self.connector_scheduler.has_pending_work(),
        }

    def check_no_leaks(self) -> None:
        """The leak oracle: raise :class:`LeakError` unless the engine is idle and clean.

        Clean means: no live request, no finished request holding blocks, every block free
        (cached free blocks are fine: the prefix cache may keep them), the block pool's own
        invariants hold, and the connector reports no pending work. Changes nothing.
        """
        problems = self.scheduler.describe_leaks()
        try:
            self.pool.check_invariants()
        except AssertionError as exc:
            problems.append(f"block pool corrupt: {exc}")
        if self.connector_scheduler is not None and self.connector_scheduler.has_pending_work():
            problems.append("the connector reports pending work (has_pending_work() is True)")
        if problems:
            raise LeakError("engine is not idle and clean: " + "; ".join(problems))

    def shutdown(self) -> None:
        """Stop the connector's halves and drop the KV cache. Safe to call twice; every other
        method raises ``RuntimeError`` afterwards. Live requests are simply dropped."""
        if self._closed:
            return
        self._closed = True
        self._shutdown_connector()

    def _shutdown_connector(self) -> None:
        # Worker first: it owns the transfers that write into the KV cache.
        if self.workers is not None:
            self.workers.shutdown()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine was shut down; build a new Engine")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
