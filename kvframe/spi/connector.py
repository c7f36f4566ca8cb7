"""The connector SPI: what a KV connector implements, and what an engine adapter calls.

A *connector* decides which KV blocks of a request come from (or go to) somewhere else and moves
them. It has two halves that live in different processes:

- :class:`KVConnectorScheduler` runs inside the engine's scheduler (one per engine). It answers
  "how many tokens of this request can be loaded from elsewhere?", learns which blocks the
  engine allocated, and builds one :class:`~kvframe.protocol.messages.ConnectorMetadata` per
  step telling the workers what to do. It never touches KV memory.
- :class:`KVConnectorWorker` runs in each worker (one per rank: tensor/pipeline parallel). It
  registers the KV cache with a transport, executes the step's metadata (loads, saves,
  heartbeats), and reports what finished in a :class:`~kvframe.protocol.messages.ConnectorOutput`.

The registered object is a :class:`KVConnector` subclass: a class with two factory
classmethods. The method names and semantics follow vLLM's ``KVConnectorBase_V1`` so that engine
developers recognise them, but every argument is a kvframe value (:class:`RequestView`,
:class:`SchedulerStep`, :class:`EngineInfo`, :class:`~kvframe.config.KVTransferConfig`), never
an engine type.

One engine step, in call order (``docs/connectors.md`` has the diagram)::

    scheduler process                                 each worker process (rank r)
    -----------------                                 ----------------------------
    on_new_request(req)              (new arrivals)
    get_num_new_matched_tokens(req, n)  (per waiting request)
    update_state_after_alloc(req, blocks, k)
    meta = build_connector_meta(step)  ──bytes──▶     bind_connector_metadata(meta)
                                                      start_load_kv(ctx)
                                                      per layer: wait_for_layer_load(name)
                                                                 ... attention ...
                                                                 save_kv_layer(name, kv, attn)
                                                      wait_for_save()
    update_connector_output(agg)  ◀──bytes── aggregate  out = build_connector_worker_output(ids)
    request_finished(req, blocks)    (finished ones)  clear_connector_metadata()

**Threads.** The engine calls each half from one thread at a time; methods are not re-entrant.
A connector may run its own threads but never calls back into the engine from them.

**Errors.** Connectors raise :mod:`kvframe.errors` exceptions on purpose. Failures of remote
work (a peer died, a transfer failed) are *not* raised: they are reported as data
(``finished_recving`` plus ``invalid_block_ids`` and ``failures``), and the engine applies
``kv_load_failure_policy``. An exception out of a per-request scheduler method means the
connector refused that request; the connector's state for other requests is unchanged.
"""

from __future__ import annotations

import abc
import math
import time
import types
from collections.abc import Callable, Mapping, Set
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

from kvframe.config import KVTransferConfig
from kvframe.errors import ConfigError
from kvframe.protocol.codec import DEFAULT_CODEC, Codec
from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput, KVEvent, Stats
from kvframe.spi.request import BLOCK_HASH_SIZE, BlockIds, RequestView, as_block_ids
from kvframe.spi.transport import Transport, TransportParams

if TYPE_CHECKING:
    import torch

__all__ = [
    "BuildContext",
    "EngineInfo",
    "KVConnector",
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "PluginLookup",
    "SchedulerStep",
    "codec_for",
]


def _positive(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if type(value) is not int or value < 1:
        raise ValueError(f"{attribute.name} = {value!r}; it must be a positive int")


def _token_counts(value: Mapping[str, int]) -> Mapping[str, int]:
    if not isinstance(value, Mapping):
        raise TypeError(f"expected a mapping of request id to token count, got {value!r}")
    for k, v in value.items():
        if not isinstance(k, str) or type(v) is not int or v < 0:
            raise ValueError(
                f"{k!r}: {v!r}; token counts map request ids (str) to non-negative ints"
            )
    return types.MappingProxyType(dict(value))


def _id_set(value: Any) -> frozenset[str]:
    if isinstance(value, str):
        raise TypeError(f"expected a set of request ids, got the single str {value!r}")
    out = frozenset(value)
    for v in out:
        if not isinstance(v, str):
            raise TypeError(f"request ids are str, got {v!r}")
    return out


def _per_request_blocks(value: Mapping[str, Any]) -> Mapping[str, BlockIds]:
    if not isinstance(value, Mapping):
        raise TypeError(
            f"new_block_ids: expected a mapping of request id to BlockIds, got {value!r}"
        )
    out: dict[str, BlockIds] = {}
    for k, v in value.items():
        if not isinstance(k, str):
            raise TypeError(f"new_block_ids: request ids are str, got {k!r}")
        try:
            out[k] = as_block_ids(v)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"new_block_ids[{k!r}]: {exc}") from exc
    return types.MappingProxyType(out)


def _per_request_hashes(value: Mapping[str, Any]) -> Mapping[str, tuple[bytes, ...]]:
    if not isinstance(value, Mapping):
        raise TypeError(f"block_hashes: expected a mapping of request id to hashes, got {value!r}")
    out: dict[str, tuple[bytes, ...]] = {}
    for k, v in value.items():
        if not isinstance(k, str) or isinstance(v, (str, bytes)):
            raise TypeError(
                f"block_hashes[{k!r}] = {v!r}; block_hashes maps request ids (str) to sequences "
                "of block hashes"
            )
        hashes = tuple(v)
        for i, h in enumerate(hashes):
            if not isinstance(h, bytes) or len(h) != BLOCK_HASH_SIZE:
                raise ValueError(
                    f"block_hashes[{k!r}][{i}] is {h!r}; each block hash is {BLOCK_HASH_SIZE} "
                    "bytes (use kvframe.spi.request.block_hashes to compute them)"
                )
        out[k] = hashes
    return types.MappingProxyType(out)


def _step_number(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"step = {value!r}; it must be a non-negative int")


def _now(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"now = {value!r}; it must be a finite number of seconds")


@attrs.frozen(kw_only=True)
class SchedulerStep:
    """What the engine scheduled in one step: the engine-independent scheduler output.

    Raises ``ValueError``/``TypeError`` at construction for a malformed field.
    """

    step: int = attrs.field(validator=_step_number)
    """The step number; increases by one each step, starting at 0."""
    new_requests: Mapping[str, int] = attrs.field(factory=dict, converter=_token_counts, hash=False)
    """Requests scheduled for the first time (or again after preemption) → tokens scheduled."""
    cached_requests: Mapping[str, int] = attrs.field(
        factory=dict, converter=_token_counts, hash=False
    )
    """Requests that were already running → tokens scheduled this step."""
    finished_request_ids: frozenset[str] = attrs.field(factory=frozenset, converter=_id_set)
    """Requests that finished since the previous step (``request_finished`` was called)."""
    now: float = attrs.field(validator=_now)
    """The engine's clock in seconds (monotonic; the same clock as ``RequestView.arrival_time``).
    Connectors take time from here and never read a clock themselves in scheduling logic."""
    new_block_ids: Mapping[str, BlockIds] = attrs.field(
        factory=dict, converter=_per_request_blocks, hash=False
    )
    """Scheduled request → the blocks it was given since the previous step, per KV group, in
    token order. For a request in :attr:`new_requests`: *all* its blocks (they replace what a
    connector knew, since a preempted request's blocks were freed); for one in
    :attr:`cached_requests`: the blocks appended since the previous step (a request that got
    none may be absent). Empty when the engine does not report blocks per step; connectors then
    know a request's blocks only from ``update_state_after_alloc`` and ``request_finished``."""
    num_computed_tokens: Mapping[str, int] = attrs.field(
        factory=dict, converter=_token_counts, hash=False
    )
    """Scheduled request → how many of its leading tokens have valid KV once this step's forward
    pass has run (``save_kv_layer`` of a layer runs right after that layer wrote them): the
    tokens computed before the step (prefix-cache hits and loaded tokens included) plus the
    tokens scheduled this step, minus speculative tokens (their KV may be rejected). Empty when
    the engine does not report it."""
    block_hashes: Mapping[str, tuple[bytes, ...]] = attrs.field(
        factory=dict, converter=_per_request_hashes, hash=False
    )
    """Scheduled request → the chained hashes of its full blocks known when the step was
    scheduled (:attr:`RequestView.block_hashes <kvframe.spi.request.RequestView.block_hashes>`
    semantics; generated tokens included), so a connector can name blocks filled during
    decode. A hash may precede the block's KV: compare with :attr:`num_computed_tokens`. Empty
    when the engine does not report it."""

    def __attrs_post_init__(self) -> None:
        scheduled = self.new_requests.keys() | self.cached_requests.keys()
        for name in ("new_block_ids", "num_computed_tokens", "block_hashes"):
            stray = sorted(getattr(self, name).keys() - scheduled)
            if stray:
                raise ValueError(
                    f"{name} names requests that are not scheduled this step: {stray}; "
                    "per-request fields cover only requests in new_requests or cached_requests"
                )
        both = sorted(self.new_requests.keys() & self.cached_requests.keys())
        if both:
            raise ValueError(
                f"requests {both} are in both new_requests and cached_requests; a request is "
                "either scheduled anew (first time or after preemption) or still running"
            )

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens scheduled this step over all requests."""
        return sum(self.new_requests.values()) + sum(self.cached_requests.values())


@attrs.frozen(kw_only=True)
class EngineInfo:
    """Facts about the engine a connector is built for (engine-independent)."""

    block_size: int = attrs.field(validator=_positive)
    """Tokens per KV block. The P/D connector moves KV only between engines of one block size
    (its handshake refuses another, naming both)."""
    num_kv_groups: int = attrs.field(default=1, validator=_positive)
    """KV cache groups (1 unless the model mixes attention types)."""
    world_size: int = attrs.field(default=1, validator=_positive)
    """Worker ranks (tensor × pipeline parallel); ranks are ``0 .. world_size - 1``. The P/D
    connector takes it as the engine's tensor-parallel size (``tp_size`` in
    ``kv_transfer_params`` and the handshake); the vLLM adapter gives vLLM's
    ``tensor_parallel_size`` and refuses pipeline parallelism."""
    model: str = ""
    """What the engine serves (a model name or digest); connectors compare it in the handshake
    so that KV never moves between engines serving different models."""
    num_kv_heads: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_positive)
    )
    """The model's KV heads (all of them, not one rank's share), or ``None`` when the engine
    does not say. Given, it lets the P/D connector move KV between engines of different
    tensor-parallel sizes (each rank's cache then must be ``[blocks, 2, block_size,
    heads of this rank, head_dim]``); ``None`` allows equal sizes only."""
    kv_cache_order: str = attrs.field(default="NHD", validator=attrs.validators.in_(("NHD", "HND")))
    """The dimension order of each rank's cache when :attr:`num_kv_heads` is given: ``"NHD"``
    ``[blocks, 2, block_size, heads, head_dim]`` (tokens, then heads) or ``"HND"`` ``[blocks,
    2, heads, block_size, head_dim]`` (heads, then tokens). The P/D connector moves KV between
    engines of different orders only with ``allow_layout_permute`` on the decoder (it then
    permutes on arrival), and between different tensor-parallel sizes only when both are
    ``"NHD"``. Ignored without :attr:`num_kv_heads` (whole blocks, not interpreted)."""


@runtime_checkable
class PluginLookup(Protocol):
    """The plugin host as a connector sees it: the plugins a connector builds on, by name.

    :class:`kvframe.runtime.plugins.PluginHost` implements it; the engine loads the host before
    it builds a connector. A connector asks only through this (never builds a host of its own),
    so plugins registered by code (``host.register(...)``) and the host's block list apply to
    what it builds too. Every method raises :class:`~kvframe.errors.PluginNotFoundError` for a
    name nothing registered (the message lists what is installed) and
    :class:`~kvframe.errors.PluginConflictError` for a name two plugins registered.
    """

    def connector(self, name: str) -> type[KVConnector]:
        """The connector class registered as ``name`` (a composite connector's children)."""
        ...

    def create_transport(self, name: str, params: TransportParams) -> Transport:
        """A new transport from the factory registered as ``name``; the caller closes it."""
        ...

    def offload_tier(self, name: str) -> Callable[..., Any]:
        """The offload-tier factory registered as ``name``
        (:data:`~kvframe.spi.offload.OffloadTierFactory`)."""
        ...

    def eviction_policy(self, name: str) -> Callable[..., Any]:
        """The eviction-policy factory registered as ``name``
        (:data:`~kvframe.spi.offload.EvictionPolicyFactory`)."""
        ...


def _lookup(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, PluginLookup):
        raise TypeError(
            f"BuildContext.host = {value!r}; it must be a plugin host with connector(), "
            "create_transport(), offload_tier() and eviction_policy() (a loaded "
            "kvframe.runtime.plugins.PluginHost)"
        )


def _clock(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not callable(value):
        raise TypeError(f"BuildContext.clock = {value!r}; it must be callable (time.monotonic)")


@attrs.frozen(kw_only=True)
class BuildContext:
    """What the engine gives a connector to build with: everything a connector may use
    besides its configuration and :class:`EngineInfo`.

    Passed to every :class:`KVConnector` class method that may need plugins
    (:meth:`~KVConnector.build_scheduler`, :meth:`~KVConnector.build_worker`,
    :meth:`~KVConnector.requires_piecewise_for_cudagraph`,
    :meth:`~KVConnector.get_required_kvcache_layout`). A connector that contains others
    (MultiConnector) passes the same context on to its children. One context serves both
    halves and every rank; the rank is :meth:`~KVConnector.build_worker`'s own argument,
    because it differs per worker process.

    Raises ``TypeError`` at construction when ``host`` is not a :class:`PluginLookup` or
    ``clock`` is not callable.
    """

    host: PluginLookup = attrs.field(validator=_lookup)
    """Where the connector looks up what it builds on: transports, child connectors, offload
    tiers and eviction policies. Loaded already."""
    clock: Callable[[], float] = attrs.field(default=time.monotonic, validator=_clock)
    """The worker half's monotonic clock in seconds (lease expiry, timeouts, measured
    durations); tests pass a fake or skewed one. The scheduler half takes its time from
    :attr:`SchedulerStep.now` instead, so scheduling decisions follow the engine's steps."""


class KVConnectorScheduler(abc.ABC):
    """The scheduler-side half of a connector: decides, never moves bytes.

    Lives in the engine's scheduler process. Every method is called from the scheduler's thread
    and must return quickly (no blocking I/O, no waiting on transfers): it runs on the critical
    path of every step. Built by :meth:`KVConnector.build_scheduler`.
    """

    def check_request(self, request: RequestView) -> None:  # noqa: B027 - optional hook
        """Refuse a request whose ``kv_transfer_params`` this connector cannot honour.

        Called by an engine when it admits a request, before anything is allocated for it, so
        the engine can answer the client with an error (HTTP 400) instead of serving it. Raises
        :class:`~kvframe.errors.ConfigError` naming the bad field and what to do; returns
        ``None`` for a request it accepts or does not handle. Must not change any state. An
        engine that does not call it still gets safe behaviour: a connector refuses the same
        parameters later and the request is served without them (for P/D: prefilled locally).
        Default: accept everything.
        """

    def on_new_request(self, request: RequestView) -> None:  # noqa: B027 - optional hook
        """Called once when the engine accepts a request, before it is first scheduled.

        A connector may start remote work here (a lookup, a handshake with the engine named in
        ``request.kv_transfer_params``) so that :meth:`get_num_new_matched_tokens` can answer
        sooner. Must not raise for a request it does not handle. Default: nothing.
        """

    @abc.abstractmethod
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """How many tokens beyond ``num_computed_tokens`` can be loaded from outside this engine.

        Called each step for each waiting request, before allocation, with the number of
        tokens already available locally (prefix-cache hits). Returns
        ``(num_external_tokens, load_is_async)``:

        - ``(0, False)``: nothing to load; schedule normally.
        - ``(n, False)`` with ``n > 0``: ``n`` tokens will be loaded *during* the next forward
          pass (layer by layer, via ``start_load_kv`` / ``wait_for_layer_load``).
        - ``(n, True)``: ``n`` tokens will be loaded asynchronously; the engine allocates the
          blocks, calls :meth:`update_state_after_alloc`, and keeps the request waiting until
          a worker reports it in ``finished_recving``.
        - ``(None, False)``: not known yet (a lookup or handshake is in flight); the engine
          leaves the request waiting and asks again next step. Nothing is allocated.

        May be called several times for one request (the answer may change until
        :meth:`update_state_after_alloc`). Must not count the last prompt token when the engine
        needs to compute at least one token itself. Raises only for a request the connector
        cannot serve at all (its ``kv_transfer_params`` are malformed:
        :class:`~kvframe.errors.ConfigError`); the engine then fails that request.
        """

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: RequestView, blocks: BlockIds, num_external_tokens: int
    ) -> None:
        """Called once after the engine allocated blocks for a request it just scheduled.

        ``blocks`` are the request's blocks per KV group (all of them, prefix-cache hits
        included); ``num_external_tokens`` is what :meth:`get_num_new_matched_tokens` last
        answered (0 when the engine decided not to load, e.g. because the blocks could not be
        allocated, in which case the connector must drop its plans for the request and release
        any remote resources it holds). The connector records what to load or save; the work
        appears in the next :meth:`build_connector_meta`.
        """

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerStep) -> ConnectorMetadata:
        """Called once per step, after scheduling: the instructions for every worker this step.

        Must move the connector's per-step state into the returned value and reset it (each
        load or save appears in exactly one metadata). Must not block. The result is encoded
        with the connector's codec and bound in each worker; an empty
        :class:`~kvframe.protocol.messages.ConnectorMetadata` is the usual answer.
        """

    def update_connector_output(self, output: ConnectorOutput) -> None:  # noqa: B027
        """Called once per step with the workers' aggregated output (every rank reported it,
        see :class:`~kvframe.protocol.aggregate.OutputAggregator`), before the engine frees
        blocks of ``output.finished_sending`` and reschedules ``output.finished_recving``.
        Default: nothing."""

    def request_finished(
        self, request: RequestView, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called once when a request finishes for any reason (stop, length, abort), before
        its blocks are freed. Returns ``(delay_free, kv_transfer_params)``:

        - ``delay_free``: when ``True`` the engine must keep ``block_ids`` allocated until a
          later :class:`~kvframe.protocol.messages.ConnectorOutput` lists the request in
          ``finished_sending`` (a producer holding the blocks under a lease for a remote
          reader). The connector guarantees that report comes, at the latest when the lease
          expires: for the P/D connector one extension (``kv_lease_duration * 2 // 3``)
          after the reader's last heartbeat, or, for a decoder's blocks kept for a
          conversation's next turn that no prefill engine claimed, ``decoder_kv_blocks_ttl``
          after the request finished (see ``docs/leases.md``).
        - ``kv_transfer_params``: JSON-compatible values returned to the client with the
          response (what a decoder needs to pull the KV), or ``None``.

        Must not raise: the request has already ended, and an engine could not tell which of
        its blocks the connector still uses. A connector that cannot give its parameters
        returns ``None`` for them (and its ``delay_free`` as it is) and reports why in an
        event. Default: ``(False, None)``.
        """
        return False, None

    def reclaim_blocks(self, num_blocks: int, now: float) -> int:
        """The engine is short of ``num_blocks`` free blocks for running requests: give back
        blocks held only for possible future use.

        The P/D connector gives back a decoder's blocks kept for a conversation's next turn
        (bidirectional mode), oldest turn first, until ``num_blocks`` are covered or none is
        left; blocks a transfer may still touch are never among them. The blocks are freed
        the usual way, through ``finished_sending`` of a coming step (normally the next one),
        so the engine retries its allocation after that. ``now`` is the engine's clock.

        Returns how many blocks will be so reported (0 when nothing can be given back).
        Must not raise. Default: 0.
        """
        return 0

    def set_xfer_handshake_metadata(self, metadata: Mapping[int, bytes]) -> None:  # noqa: B027
        """Called once after start-up with every worker rank's
        :meth:`KVConnectorWorker.get_handshake_metadata` (rank → bytes; ranks that returned
        ``None`` are absent). A connector that serves handshakes from the scheduler process
        publishes these. Default: nothing."""

    def has_pending_work(self) -> bool:
        """Whether the engine must keep stepping although it has no requests to run.

        ``True`` while the connector holds leases for remote readers, waits for remote
        transfers or must send heartbeats: an idle producer holding leases still has to step
        so that completions, heartbeats and expiries are processed and blocks are freed.
        Called once per idle loop iteration; must be cheap. Default: ``False``.
        """
        return False

    def next_deadline(self) -> float | None:
        """When the engine must step again although nothing else happens, on the engine's clock
        (the clock of :attr:`SchedulerStep.now`), so that an idle engine can sleep instead of
        spinning.

        Asked only while :meth:`has_pending_work` is ``True``. A time at or before now means
        "step again at once" (keep stepping at the engine's idle pace: notifications or
        transfers are expected at any moment); a later time lets the engine sleep until then
        (or until a new request arrives); ``None`` means no timed work is due. Must be cheap.
        Default: ``-inf`` while :meth:`has_pending_work` is ``True`` (the behaviour of engines
        that do not ask: keep stepping), else ``None``.
        """
        return -math.inf if self.has_pending_work() else None

    def get_stats(self) -> Stats:
        """Scheduler-side statistics since the last call (counters) and now (gauges).
        Default: empty."""
        return Stats()

    def take_events(self) -> tuple[KVEvent, ...]:
        """Events since the last call, oldest first; each is returned once. Default: none."""
        return ()

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release everything (threads, sockets, leases). Called once when the engine stops;
        must not raise. Default: nothing."""


class KVConnectorWorker(abc.ABC):
    """The worker-side half of a connector: moves bytes.

    Lives in each worker process (one per rank). Built by :meth:`KVConnector.build_worker`.
    Every method is called from the worker's model-runner thread. Remote failures are never
    raised from the per-step methods: they surface as ``finished_recving`` plus
    ``invalid_block_ids`` and ``failures`` in :meth:`build_connector_worker_output`.
    """

    _connector_metadata: ConnectorMetadata | None = None

    @abc.abstractmethod
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Called once at start-up, after the engine allocated its KV cache: layer name →
        that layer's KV tensor (CPU or CUDA). The connector registers the memory with its
        transport and prepares descriptors. The tensors stay alive and at the same address
        until :meth:`shutdown`.

        Raises :class:`~kvframe.errors.CapabilityError` when the transport cannot use this
        memory and ``ValueError`` for tensors of an unexpected layout; the engine then stops
        (nothing stays registered).
        """

    def bind_connector_metadata(self, meta: ConnectorMetadata) -> None:
        """Called once per step before the forward pass with the scheduler's metadata for this
        step (decoded from bytes). Keeps it for the step's other calls."""
        self._connector_metadata = meta

    def clear_connector_metadata(self) -> None:
        """Called once per step after the forward pass and the step's output. Forgets the
        metadata; never raises."""
        self._connector_metadata = None

    @property
    def connector_metadata(self) -> ConnectorMetadata:
        """The metadata bound for the current step.

        Raises ``RuntimeError`` outside ``bind_connector_metadata`` …
        ``clear_connector_metadata`` (an engine adapter calling out of order).
        """
        if self._connector_metadata is None:
            raise RuntimeError(
                "no connector metadata is bound; the engine must call bind_connector_metadata() "
                "before the step's other worker calls"
            )
        return self._connector_metadata

    @abc.abstractmethod
    def start_load_kv(self, forward_context: Any) -> None:
        """Called once per step before the forward pass: start this step's loads (post the
        transfers). Must not wait for them. ``forward_context`` is the engine's own object,
        passed through opaquely (connectors that need none ignore it)."""

    @abc.abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None:
        """Called before layer ``layer_name``'s attention runs: block until that layer's
        synchronous loads (``load_is_async=False``) landed. Returns at once when there are
        none. A failed load does not raise: its blocks go to
        :meth:`get_block_ids_with_load_errors`."""

    @abc.abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Called after layer ``layer_name``'s attention wrote its KV: start saving what the
        metadata's ``saves`` ask for from ``kv_layer``. Must not wait for completion."""

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """Called once per step after the forward pass: block until this step's saves no
        longer need the KV memory as it is now (the engine may overwrite those blocks next
        step)."""

    def get_finished(self, finished_req_ids: Set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose transfers stopped since the last call: ``(finished_sending,
        finished_recving)``; ``None`` means none.

        ``finished_req_ids`` are the requests the scheduler finished since the previous step.
        Each request id is reported once, by every rank. Default: ``(None, None)``.
        """
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local block ids whose loads failed since the last call (contents undefined); each
        reported once. Their requests also appear in ``finished_recving``. Default: empty."""
        return set()

    def get_handshake_metadata(self) -> bytes | None:
        """This rank's handshake payload (transport metadata, layout), called once after
        :meth:`register_kv_caches`; forwarded to
        :meth:`KVConnectorScheduler.set_xfer_handshake_metadata`. Default: ``None``."""
        return None

    def get_stats(self) -> Stats:
        """This rank's statistics since the last call. Default: empty."""
        return Stats()

    def take_events(self) -> tuple[KVEvent, ...]:
        """This rank's events since the last call, oldest first. Default: none."""
        return ()

    def take_failures(self) -> Mapping[str, str]:
        """Request id → reason for transfers that failed since the last call. Default: none."""
        return {}

    def build_connector_worker_output(
        self, finished_req_ids: Set[str] = frozenset()
    ) -> ConnectorOutput:
        """This rank's report for the step, in one value (called after :meth:`wait_for_save`).

        The default combines :meth:`get_finished`, :meth:`get_block_ids_with_load_errors`,
        :meth:`get_stats`, :meth:`take_events` and :meth:`take_failures`, so an engine adapter
        calls either this or those (they drain what they report), never both in one step. A
        connector whose output is a subclass of ``ConnectorOutput`` (typed records for its
        scheduler half, registered in :meth:`KVConnector.metadata_types`) reports those
        records only here; engines call this method.
        """
        sending, recving = self.get_finished(finished_req_ids)
        return ConnectorOutput(
            finished_sending=sending or frozenset(),
            finished_recving=recving or frozenset(),
            invalid_block_ids=self.get_block_ids_with_load_errors(),
            failures=self.take_failures(),
            stats=self.get_stats(),
            events=self.take_events(),
        )

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Stop transfers, deregister memory, close the transport. Called once when the worker
        stops; must not raise. Default: nothing."""


class KVConnector(abc.ABC):
    """The class a plugin registers (``register(name, MyConnector)``): two factories and the
    engine-level requirements. Never instantiated by the engine.

    Subclasses implement :meth:`build_scheduler` and :meth:`build_worker`; the plugin host
    refuses a class that leaves either abstract. Every class method that may need other
    plugins receives the engine's :class:`BuildContext` (``ctx``): it is the only way a
    connector reaches the plugin host and the clock.
    """

    @classmethod
    def requires_piecewise_for_cudagraph(
        cls, extra_config: Mapping[str, Any], ctx: BuildContext
    ) -> bool:
        """Whether the connector needs the engine to capture CUDA graphs piecewise (so that
        the per-layer hooks ``wait_for_layer_load`` / ``save_kv_layer`` run eagerly between
        captured pieces). ``extra_config`` is ``kv_connector_extra_config``. Default: ``False``.
        """
        return False

    @classmethod
    def get_required_kvcache_layout(cls, config: KVTransferConfig, ctx: BuildContext) -> str | None:
        """The KV cache memory layout the connector needs (``"NHD"`` or ``"HND"``), or
        ``None`` to accept the engine's default. Called before the KV cache is allocated.
        Default: ``None``."""
        return None

    @classmethod
    def metadata_types(cls, config: KVTransferConfig) -> Mapping[str, type[Any]]:
        """Every message class the connector sends between its two halves, by codec tag: its
        subclass of :class:`~kvframe.protocol.messages.ConnectorMetadata` (scheduler →
        workers) and of :class:`~kvframe.protocol.messages.ConnectorOutput` (each worker →
        scheduler), if it has them. :func:`codec_for` builds the one codec that carries them
        from this answer; engines, composite connectors and tests all use it, so the tag →
        class map is written once, here.

        Tags follow :meth:`kvframe.protocol.codec.Codec.with_types` (dotted lowercase, not
        starting with ``kvframe.``). ``config`` is the connector's configuration, for a
        connector whose classes depend on it. Messages that do not travel between the halves
        (a side channel between engines) do not belong here. Default: none (the connector
        uses the generic messages only)."""
        return {}

    @classmethod
    @abc.abstractmethod
    def build_scheduler(
        cls, config: KVTransferConfig, engine: EngineInfo, ctx: BuildContext
    ) -> KVConnectorScheduler:
        """Build the scheduler-side half, in the scheduler process, once at engine start.
        ``ctx.host`` is where the plugins it builds on come from.

        Raises :class:`~kvframe.errors.ConfigError` for connector options it rejects (in
        ``config.kv_connector_extra_config``; the message names the key path). Nothing is left
        running after an error.
        """

    @classmethod
    @abc.abstractmethod
    def build_worker(
        cls, config: KVTransferConfig, engine: EngineInfo, rank: int, ctx: BuildContext
    ) -> KVConnectorWorker:
        """Build the worker-side half for ``rank`` (``0 .. engine.world_size - 1``), in that
        worker's process, once at start. The transport comes from ``ctx.host``
        (:meth:`PluginLookup.create_transport`), the time from ``ctx.clock``.

        Raises :class:`~kvframe.errors.ConfigError` as :meth:`build_scheduler` does, and
        :class:`~kvframe.errors.PluginNotFoundError` when the configured transport is not
        installed. Nothing is left running after an error.
        """


def codec_for(connector: type[KVConnector], config: KVTransferConfig) -> Codec:
    """The codec that carries ``connector``'s messages between its halves:
    :data:`~kvframe.protocol.codec.DEFAULT_CODEC` plus ``connector.metadata_types(config)``.

    What an engine encodes the step's metadata and the workers' outputs with, what
    MultiConnector encodes each child's messages with, and what tests use: no codec is built
    from a hand-written tag → class map. Raises :class:`~kvframe.errors.ConfigError` naming
    the connector when its types cannot be registered (a malformed or reserved tag, a class
    or field type the codec cannot carry).
    """
    try:
        return DEFAULT_CODEC.with_types(connector.metadata_types(config))
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"connector {config.kv_connector!r} ({connector.__qualname__}): its "
            f"metadata_types() cannot be registered with the codec: {exc}"
        ) from exc
