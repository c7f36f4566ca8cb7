"""The P/D connector's worker side: an executor for the core's P/D machines.

Every decision lives in :mod:`kvframe.core`: P's in :class:`~kvframe.core.holder.LeaseHolder`
(renew, consume, abort, expire, who may name a lease, the replies), D's in
:class:`~kvframe.core.reader.LeaseReader` (when a lease is confirmed, when to post, whether a
finished read may be kept, what a loss notice or a broken peer means, when a load times out).
This module only gathers what happened — the step's metadata, the transport's notifications,
the transfers' states, the handshakes' results — reads the clock **once per progress
point**, after it observed everything it will stamp with that reading (so a completion or a
receipt is never stamped earlier than it happened), feeds it to the machines, and carries out
the actions they return, in order. (One exception, taken with the same rule: when a READ
posted in this progress point has already completed by the end of it, a second reading stamps
that completion, so the load ends at once rather than a progress point later.)

Progress points are ``start_load_kv`` (before the forward pass: a READ posted there overlaps
it) and ``get_finished`` (after it), so two readings per engine step, and :meth:`progress` for
engines that drive the worker between steps. One reading per step was measured: a READ posted
in ``get_finished`` (after an acknowledgement arrived there) would then be seen complete only a
whole step later, 1–2.5 ms more per request in ``kvframe bench transfer``. A reading cannot be
reused across progress points: a notification drained after it might have been sent after it,
and the holder's acknowledgement would then overstate the lease's remaining time.

**Producer (P) rank.** Serves handshakes on the side channel, holds a lease per finished
request, answers heartbeats and lease-done notices, reclaims expired leases, and reports each
ended lease once in ``finished_sending``.

**Consumer (D) rank.** Handshakes with prefill engines, heartbeats the leases the scheduler
names, reads each load under a confirmed lease, and reports each load once in
``finished_recving`` — failed ones with every local block in ``invalid_block_ids`` and a
reason, only after their transfers stopped. With ``allow_layout_permute``, a load from an
engine of the other NHD/HND order is read into a staging area and permuted into the cache
before it is reported (:mod:`kvframe.connectors.pd.permute`).

Threads
-------
Two background threads exist, and each shares only queues with the engine thread:

- P's handshake server thread (:class:`~.handshake.HandshakeServer`) answers with values the
  engine thread prepared before the server started (the transport metadata, the layout, the
  incarnation token: immutable after ``register_kv_caches``) and puts each requester's
  ``(engine id, rank, transport metadata, session key)`` on ``_pending_peers`` (a bounded
  :class:`queue.Queue`: when full, the handshake is refused as busy). It
  never calls the transport; the engine thread adds the peers in its next progress point.
- D's handshake client thread (:class:`~.peers.RemoteEngines`) takes jobs from one queue and
  puts results on another; results are applied to the transport on the engine thread.

Everything else, the transport included, is used from the engine thread only (the staging
area of ``allow_layout_permute`` and the permutation into the cache too).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import math
import queue
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import numpy.typing as npt

from kvframe.config import KVTransferConfig
from kvframe.connectors._reports import WorkerReports
from kvframe.connectors.pd.auth import TAG_BYTES, tag, untag, warn_unauthenticated
from kvframe.connectors.pd.handshake import (
    HandshakeRequest,
    HandshakeResponse,
    HandshakeServer,
    KVLayerFacts,
    KVLayoutFacts,
    compat_hash,
)
from kvframe.connectors.pd.metadata import (
    PDLoad,
    PDMetadata,
    PDPushProgress,
    PDWorkerAddress,
    RemoteEngineAddr,
)
from kvframe.connectors.pd.options import PDOptions
from kvframe.connectors.pd.peers import PeerState, RemoteEngine, RemoteEngines
from kvframe.connectors.pd.permute import StagingArea
from kvframe.core import push as pushwire
from kvframe.core import wire
from kvframe.core.blocksize import (
    chunk_of,
    chunk_units,
    head_units,
    stale_tail,
    token_axis,
    token_runs,
)
from kvframe.core.holder import HolderOutput, LeaseHolder
from kvframe.core.lease import Lease, LeasePolicy, LeaseState, lease_handle
from kvframe.core.push import (
    EndSource,
    Keepalive,
    PushAction,
    PushRefused,
    PushRegister,
    PushSource,
    Refuse,
    StartWrite,
)
from kvframe.core.reader import (
    Action,
    LeaseReader,
    LoadEnded,
    PostRead,
    ReaderTimeouts,
    ReadState,
    Reconnect,
    SendMessage,
    StopRead,
)
from kvframe.core.receiver import (
    Fence,
    FreeNow,
    PushEnded,
    PushReceiver,
    ReceiverAction,
    ReceiveState,
    Revoke,
    SendRegistration,
)
from kvframe.core.slots import ENTRY_BYTES, MAX_SLOTS, LeaseSlots, slot_of, slot_tag
from kvframe.core.tp import (
    HeadSlice,
    check_tp_pair,
    consumers_of,
    head_sources,
    idle_ranks_of,
    kv_heads_of,
    slice_units,
    unit_heads,
)
from kvframe.errors import CodecError, KVFrameError, PeerUnreachableError, TransportError
from kvframe.protocol.codec import Codec
from kvframe.protocol.messages import ConnectorMetadata, KVEvent, Stats
from kvframe.spi.connector import EngineInfo, KVConnectorWorker, PluginLookup
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
    XferStatus,
)

if TYPE_CHECKING:
    import torch

__all__ = ["OBSERVATION_BUCKETS", "PDConnectorWorker", "observation_key"]

_SECONDS = (5e-05, 1e-04, 2.5e-04, 5e-04, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
_SECONDS_LONG = (*_SECONDS, 0.5, 1.0, 2.5, 5.0, 10.0)

#: The per-read observations D reports as histogram counts, and their buckets' upper bounds.
#: Each observation adds its value to the counter ``<name>`` (the sum, as before) and 1 to
#: ``<name>:le=<bound>`` for the first bound that holds it (``+Inf`` above the last): counts
#: that add across steps and ranks like every counter. ``kvframe.runtime.metrics`` renders
#: them as Prometheus histograms.
OBSERVATION_BUCKETS: Mapping[str, tuple[float, ...]] = {
    "transfer_seconds": _SECONDS_LONG,
    "post_seconds": _SECONDS_LONG,
    "load_wait_seconds": _SECONDS_LONG,
    "load_done_seen_seconds": _SECONDS_LONG,
    "load_report_seconds": _SECONDS_LONG,
    "bytes_read": tuple(float(4**i) for i in range(6, 18)),  # 4 KiB .. 16 GiB
    "push_seconds": _SECONDS_LONG,
    "push_post_seconds": _SECONDS_LONG,
    "bytes_written": tuple(float(4**i) for i in range(6, 18)),
}


def _unit_layout(
    layout: BlockLayout, block_size: int, heads: int, unit: int, whose: str
) -> BlockLayout:
    """``layout`` (NHD blocks of ``heads`` heads per token) cut into runs of ``unit`` heads of
    one token's K or V: a transport moves them as its blocks (:func:`kvframe.core.tp.slice_units`
    numbers them)."""
    rows = 2 * block_size * heads
    lens: list[int] = []
    for blen in layout.block_lens:
        if blen % rows:
            raise ValueError(
                f"{whose} blocks of {blen} bytes do not hold 2 x {block_size} tokens x "
                f"{heads} heads of equal size; the KV layout is not NHD"
            )
        lens.append(blen // rows * unit)
    return BlockLayout(
        regions=layout.regions,
        block_lens=lens,
        num_blocks=layout.num_blocks * rows // unit,
    )


def _cut_layout(layout: BlockLayout, parts: int, whose: str) -> BlockLayout:
    """``layout`` with each block cut into ``parts`` equal units (token chunks of one K or V,
    :func:`kvframe.core.blocksize.chunk_units` numbers them)."""
    lens: list[int] = []
    for blen in layout.block_lens:
        if blen % parts:
            raise ValueError(
                f"{whose} blocks of {blen} bytes do not split into {parts} equal token chunks"
            )
        lens.append(blen // parts)
    return BlockLayout(
        regions=layout.regions, block_lens=lens, num_blocks=layout.num_blocks * parts
    )


def observation_key(name: str, value: float) -> str:
    """The counter that one observation ``value`` of ``name`` adds 1 to:
    ``<name>:le=<bound>`` (see :data:`OBSERVATION_BUCKETS`)."""
    bounds = OBSERVATION_BUCKETS[name]
    i = bisect.bisect_left(bounds, value)
    return f"{name}:le={bounds[i]!r}" if i < len(bounds) else f"{name}:le=+Inf"


#: Lease-table READs a decode worker keeps in flight at most (one 8-byte word each); a load
#: whose READ lands while all are busy waits for P's acknowledgement instead.
_CHECKS = 256

#: Bytes an endpoint flush READ moves: from the start of the prefill engine's first region
#: into a scratch buffer of this worker's (nothing of value; one descriptor).
_FLUSH_BYTES = 64

#: Handshakes whose peers wait for the engine thread at most (more are refused as busy).
_MAX_PENDING_PEERS = 256
_SERVER_COUNTERS = ("handshakes_served", "handshakes_refused", "handshakes_rate_limited")
_ENDED_COUNTER = {
    LeaseState.CONSUMED: "leases_consumed",
    LeaseState.ABORTED: "leases_aborted",
    LeaseState.EXPIRED: "leases_expired",
}


@attrs.define(eq=False)
class _Write:
    """P, push mode: one request's WRITE into a decoder's registered blocks."""

    peer: str
    """The decoder's transport peer (the writer machine's engine key)."""
    lease_id: str
    """D's lease the write is under."""
    local_block_ids: tuple[tuple[int, ...], ...]
    remote_block_ids: tuple[tuple[int, ...], ...]
    first_block: int = 0
    """The index in P's block list of ``local_block_ids``' first block."""
    handle: XferHandle | None = None
    posted_at: float = 0.0
    notice: bytes | None = None
    """The encoded completion notice, when it must wait for more than the final WRITE (the
    layer WRITEs still in flight, or a transport without ``notification_after_data``)."""
    pre: list[XferHandle] = attrs.field(factory=list)
    """Layer WRITEs posted during the prefill (``push_layerwise``) and not yet seen done: the
    push completes only with them."""
    posted: bool = False


@attrs.define(eq=False)
class _Pre:
    """P, ``push_layerwise``: the layer WRITEs made for one registration before its request
    finished."""

    peer: str
    written: list[int]
    """Per layer, P's block index up to which that layer was written."""
    handles: list[XferHandle] = attrs.field(factory=list)


@attrs.define(eq=False)
class _PushIn:
    """D, push mode: what the worker keeps of one push (the decisions are the receiver's)."""

    lease_id: str
    engine: str
    block_ids: tuple[tuple[int, ...], ...]
    registration: bytes
    sent_to: str | None = None
    """The prefill engine's transport peer the registration went to."""
    sent_at: float = 0.0


@attrs.define(eq=False)
class _Flush:
    """D: the endpoint flush of one prefill engine rank's connection (see
    ``PDConnectorWorker._flush_endpoints``)."""

    entry: RemoteEngine
    remote: LayoutHandle | None = None
    """The flush READ's source (prepared once per connection)."""
    handle: XferHandle | None = None
    """The flush READ in flight."""
    dirty: bool = True
    """A notification went to the peer since the flush READ in flight (or the last one) was
    posted."""


@attrs.define(eq=False)
class _Check:
    """D: a READ of a prefill engine's lease table for one load whose bytes landed before
    P's acknowledgement (see ``PDConnectorWorker._check_lease``)."""

    handle: XferHandle
    index: int
    """Where in the check buffer the slot's word lands."""
    at: float
    """The reader's clock when it was posted (after the load's READ was seen done)."""


@attrs.define(eq=False)
class _TableRef:
    """D: one prefill engine rank's lease table, prepared on the connection that uses it."""

    entry: RemoteEngine
    remote: LayoutHandle
    slots: int


@attrs.define(eq=False)
class _Split:
    """A request read from several prefill ranks: its per-source loads, and how they ended."""

    subs: list[str]
    ended: dict[str, ReadState] = attrs.field(factory=dict)
    failure: str | None = None
    """The first failure's reason (the other loads are then stopped before it is reported)."""
    perf: tuple[float, float] = (0.0, 0.0)


@attrs.define(eq=False)
class _Read:
    """A load the reader was told about: what to read, and its transfer once posted."""

    spec: PDLoad
    key: str = ""
    """The reader's engine key of the source rank (the engine id when the engines' tensor
    parallel sizes are equal; ``<engine id>#<rank>`` otherwise)."""
    heads: HeadSlice | None = None
    """Heterogeneous tensor parallelism: the heads read from the source rank (``None``: whole
    blocks)."""
    parent: str = ""
    """The request id (this load is one of its per-source loads when it differs)."""
    handle: XferHandle | None = None
    posted_at: float = 0.0
    notice: bytes | None = None
    """The encoded done notice, sent once the READ is DONE: for an optimistic READ (posted
    before the heartbeat that asks P to claim its lease, ``PostRead.notify_when_done``), or
    when the transport does not promise a post's notification only after the data
    (``notification_after_data`` False)."""
    post_perf: float = 0.0
    """``time.perf_counter()`` when the READ was posted (timing statistics only)."""
    done_perf: float = 0.0
    """``time.perf_counter()`` at the first poll that saw the READ done (0: not yet)."""
    reported: bool = False
    """Its completion went to the reader, which waits for P's acknowledgement (an optimistic
    READ that completed first): not polled again."""
    permute_from: str | None = None
    """``allow_layout_permute``: the source's KV cache order, when the READ went into the
    staging area and is permuted into this engine's order once DONE (``None``: read in
    place)."""


class PDConnectorWorker(WorkerReports, KVConnectorWorker):
    """Worker half of :class:`~kvframe.connectors.pd.PDConnector` (one per rank)."""

    def __init__(
        self,
        config: KVTransferConfig,
        engine: EngineInfo,
        rank: int,
        options: PDOptions,
        *,
        host: PluginLookup,
        clock: Callable[[], float] = time.monotonic,
        codec: Codec,
    ) -> None:
        assert config.engine_id is not None
        self._config = config
        self._engine = engine
        self._rank = rank
        self._options = options
        self._clock = clock
        self._codec = codec
        self._engine_id = config.engine_id
        self._policy = LeasePolicy.from_duration(config.kv_lease_duration)
        self._ttl = options.decoder_ttl(config.decoder_kv_blocks_ttl)
        # Loads of a decoder's kept blocks added before that engine's clock offset was known:
        # request id -> (engine id, kept_until on the decoder's clock).
        self._uncapped: dict[str, tuple[str, float]] = {}
        self._name = f"{config.engine_id}.{rank}"
        self._incarnation = secrets.token_hex(8)
        self._transport: Transport = host.create_transport(
            options.transport,
            TransportParams(name=self._name, options=dict(options.transport_options)),
        )
        caps = self._transport.capabilities
        if not (caps.read and caps.notifications):
            self._transport.close()
            raise KVFrameError(
                f"transport {options.transport!r} lacks READ or notifications; PDConnector "
                "needs both"
            )
        self._max_notif = caps.max_notification_bytes
        self._tag_bytes = TAG_BYTES if options.keys is not None else 0
        self._local: LayoutHandle | None = None
        self._local_heads = 0  # KV heads of this rank (num_kv_heads given)
        self._kv_tensors: list[torch.Tensor] = []  # to zero a regrouped load's stale tail
        self._layout: BlockLayout | None = None
        self._kv_facts: KVLayoutFacts | None = None
        # allow_layout_permute (D): the staging area, its prepared layout, its tensors and
        # the caches' byte views (permute.py); the permuting loads waiting for free slots.
        self._staging: StagingArea | None = None
        self._staging_handle: LayoutHandle | None = None
        self._staging_tensors: list[Any] = []
        self._cache_bytes: list[Any] = []
        self._staging_wait: collections.deque[PostRead] = collections.deque()
        self._chash = b""
        self._local_meta = b""
        self._server: HandshakeServer | None = None
        self._server_seen = (0, 0, 0)
        self._region_bases: list[tuple[int, int, int]] = []  # (address, length, block length)
        self._block_leases: dict[int, set[str]] = {}  # block -> live lease ids (access check)
        self._engines: RemoteEngines | None = None
        # P. The lease table (kvframe.core.slots), in host memory (P's CPU writes it), on
        # a transport whose READs need no code of P's (no access_control); registered with
        # the KV caches. The holder clears a lease's entry in the call that ends it.
        self._slots: LeaseSlots | None = None
        self._slot_layout: BlockLayout | None = None
        self._slot_table: npt.NDArray[np.uint64] | None = None
        if options.lease_table_slots and config.is_producer and not caps.access_control:
            self._slot_table = np.zeros(options.lease_table_slots, dtype=np.uint64)
            self._slots = LeaseSlots(self._slot_table)
        self._holder: LeaseHolder[tuple[str, tuple[tuple[int, ...], ...]]] = LeaseHolder(
            self._policy, slots=self._slots
        )
        # (D engine, rank, transport metadata, session key) from the handshake thread; bounded,
        # so a flood of handshakes cannot queue unbounded work for the engine thread.
        self._pending_peers: queue.Queue[
            tuple[str, int, bytes, bytes | None, BlockLayout | None, int]
        ] = queue.Queue(maxsize=_MAX_PENDING_PEERS)
        self._reader_peers: dict[tuple[str, int], str] = {}  # (D engine, rank) -> peer
        self._readers: dict[str, str] = {}  # transport peer -> D engine id
        self._peer_keys: dict[str, bytes] = {}  # transport peer (a reader) -> session key
        # P, push mode: registrations matched with finished prefills, and the writes. The
        # writer is the reader machine with the roles swapped (its engine keys are peers).
        self._push = PushSource(
            wait_timeout=self._policy.duration,
            heartbeat_interval=self._policy.heartbeat_interval,
            require_digest=options.keys is not None,
        )
        self._writer = LeaseReader(
            self._policy,
            ReaderTimeouts.from_policy(
                self._policy,
                peer_timeout=2 * options.handshake_timeout,
                margin=options.read_margin,
            ),
            release_after_loss=True,
        )
        self._writes: dict[str, _Write] = {}
        self._reader_layouts: dict[str, BlockLayout] = {}  # reader peer -> its layout
        self._reader_handles: dict[str, LayoutHandle] = {}
        self._new_reader_peers: list[str] = []
        self._gone_reader_peers: list[str] = []
        self._writes_posted_now: list[str] = []
        self._pre: dict[str, _Pre] = {}  # D's lease id -> layer writes made early
        self._step_progress: list[PDPushProgress] = []
        self._layer_index: dict[str, int] = {}
        # D, push mode: destination blocks held under D's own leases
        self._pushes: dict[str, _PushIn] = {}  # request id -> push
        self._push_leases: set[str] = set()  # D's live push lease ids
        self._receiver = PushReceiver(
            send_timeout=2 * options.handshake_timeout, cap=3 * self._policy.duration
        )
        self._push_blocks: dict[int, set[str]] = {}  # block -> live push lease ids
        self._keys = options.keys
        if self._keys is None:
            warn_unauthenticated("worker")
        # D
        self._reader = LeaseReader(
            self._policy,
            ReaderTimeouts.from_policy(
                self._policy,
                peer_timeout=2 * options.handshake_timeout,
                margin=options.read_margin,
            ),
            # Not where the holder's transport checks each READ against the leases the
            # reader claimed (access_control): a READ ahead of its claim would be refused.
            optimistic=options.optimistic_read and not caps.access_control,
        )
        self._reads: dict[str, _Read] = {}  # per-source load id -> its read
        # Heterogeneous tensor parallelism: request id -> its per-source loads; (engine id,
        # its tp size) -> the reader keys and head slices of this rank's sources; reader key
        # -> (engine id, source rank); engine id -> its reader keys.
        self._splits: dict[str, _Split] = {}
        self._sources: dict[
            tuple[str, int], tuple[list[tuple[str, int, HeadSlice | None]], tuple[int, ...]]
        ] = {}
        self._engine_tp: dict[str, int] = {}
        self._key_rank: dict[str, tuple[str, int]] = {}
        self._rank_key: dict[tuple[str, int], str] = {}
        self._idle_keys: dict[str, list[str]] = {}
        self._engine_keys: dict[str, list[str]] = {}
        self._unit_handles: dict[tuple[str | None, int], LayoutHandle] = {}
        self._members: dict[str, int] = {}  # P: reader peer -> its member id in its group
        # (what, engine id, reason) from engine_gone / fence / unfence (any thread; deque
        # appends and pops are atomic), applied at the next progress point
        self._liveness: collections.deque[tuple[str, str, str]] = collections.deque()
        self._fenced: str | None = None  # why this engine may not read now
        self._posted_now: list[str] = []  # READs posted in the current progress point
        # D: a flush READ after notifications, per transport peer (see _flush_endpoints); its
        # local side is a scratch buffer registered with the KV caches (None: off).
        self._flushes: dict[str, _Flush] = {}
        self._flush_local: LayoutHandle | None = None
        self._scratch: Any = None
        # The lease table (kvframe.core.slots): P enters each pull lease's tag while it lives
        # (None: no table); D reads a prefill engine's after an optimistic READ landed, into
        # the check buffer, one word per check in flight (None: no checks).
        self._check_buf: npt.NDArray[np.uint64] | None = None
        self._check_local: LayoutHandle | None = None
        self._check_free: list[int] = []
        self._checks: dict[str, _Check] = {}
        self._tables: dict[str, _TableRef] = {}  # transport peer -> its prepared table
        # Loads that ended DONE and are not yet reported: request id -> (posted, done seen),
        # perf_counter readings for the per-request timing (statistics, not decisions).
        self._timing: dict[str, tuple[float, float]] = {}
        self._pending_meta: collections.deque[PDMetadata] = collections.deque()
        # reporting
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        self._init_reports()
        self._counters: dict[str, float] = {}
        self._closed = False

    # -- set-up --------------------------------------------------------------------------
    @property
    def transport(self) -> Transport:
        """The transport this worker drives (for diagnostics and tests)."""
        return self._transport

    @property
    def incarnation(self) -> str:
        """A random token naming this worker instance (P: sent to D in the handshake and in
        ``kv_transfer_params``; a restarted worker has a new one)."""
        return self._incarnation

    @property
    def reader(self) -> LeaseReader:
        """D's reader machine (read-only use: tests and diagnostics)."""
        return self._reader

    @property
    def remote_engines(self) -> list[RemoteEngine]:
        """D's connection entries, one per remote engine rank (read-only use: diagnostics,
        benchmarks); empty on a producer-only worker."""
        return self._engines.entries() if self._engines is not None else []

    @property
    def push_source(self) -> PushSource:
        """P's push matcher (read-only use: tests and diagnostics)."""
        return self._push

    @property
    def writer(self) -> LeaseReader:
        """P's writer machine in push mode (read-only use: tests and diagnostics)."""
        return self._writer

    @property
    def holder(self) -> LeaseHolder[tuple[str, tuple[tuple[int, ...], ...]]]:
        """P's holder machine (read-only use: tests and diagnostics)."""
        return self._holder

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Register every layer's KV tensor (block-major: dim 0 is the block id) as one region
        and start the side channel."""
        if not kv_caches:
            raise ValueError("register_kv_caches() got no KV caches")
        regions: list[MemoryRegion] = []
        block_lens: list[int] = []
        num_blocks: int | None = None
        facts: list[Any] = []
        for name, t in kv_caches.items():
            n = int(t.shape[0])
            if num_blocks is None:
                num_blocks = n
            elif n != num_blocks:
                raise ValueError(
                    f"KV cache {name!r} has {n} blocks but the first layer has {num_blocks}; "
                    "PDConnector needs a block-major layout with one block count"
                )
            region = MemoryRegion.from_tensor(t)
            regions.append(region)
            block_lens.append(region.length // n)
            facts.append((name, tuple(t.shape[1:]), str(t.dtype)))
        assert num_blocks is not None
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self._kv_tensors = list(kv_caches.values())
        self._layout = BlockLayout(regions=regions, block_lens=block_lens, num_blocks=num_blocks)
        heads = self._engine.num_kv_heads
        order = self._engine.kv_cache_order if heads is not None else "block-major"
        if heads is not None:
            # The caches are NHD or HND (heterogeneous tensor parallelism is possible between
            # NHD caches), and what both sides must agree on is the whole model's shape, not
            # this rank's share.
            facts = self._head_facts(kv_caches, heads, order)
        # The layout travels as fields, compared field by field at the handshake; the hash
        # covers the rest both sides must agree on.
        self._kv_facts = KVLayoutFacts(
            order=order,
            block_size=self._engine.block_size,
            head_size=facts[0][1][3] if heads is not None else 0,
            num_kv_heads=heads or 0,
            kv_heads_per_rank=self._local_heads if heads is not None else 0,
            tp_size=self._engine.world_size,
            layers=tuple(
                KVLayerFacts(name=n, shape=tuple(int(x) for x in sh), dtype=dt)
                for n, sh, dt in facts
            ),
        )
        self._chash = compat_hash(
            model=self._engine.model,
            transport=self._options.transport,
            groups=self._engine.num_kv_groups,
        )
        staging_regions: list[MemoryRegion] = []
        if self._options.allow_layout_permute and heads is not None and self._config.is_consumer:
            staging_regions = self._make_staging(kv_caches, block_lens)
        scratch = None
        if (
            self._config.is_consumer
            and self._options.flush_endpoints
            and not self._transport.capabilities.access_control
        ):
            # The flush READ's destination: a few bytes next to the KV caches (same device),
            # registered with them, in no layout a peer sees.
            first = next(iter(kv_caches.values()))
            self._scratch = first.new_zeros(-(-_FLUSH_BYTES // first.element_size()))
            scratch = MemoryRegion.from_tensor(self._scratch)
        table_regions: list[MemoryRegion] = []
        slots = self._options.lease_table_slots
        if slots and not self._transport.capabilities.access_control:
            # Host memory whatever the KV caches' device: P's CPU writes the entries.
            if self._slot_table is not None:
                table = self._slot_table
                region = MemoryRegion(addr=int(table.ctypes.data), length=table.nbytes)
                self._slot_layout = BlockLayout(
                    regions=[region], block_lens=[ENTRY_BYTES], num_blocks=slots
                )
                table_regions.append(region)
            if self._config.is_consumer:
                self._check_buf = np.zeros(_CHECKS, dtype=np.uint64)
                table_regions.append(
                    MemoryRegion(
                        addr=int(self._check_buf.ctypes.data), length=self._check_buf.nbytes
                    )
                )
                self._check_free = list(range(_CHECKS))
        self._transport.register_memory(
            [*regions, *staging_regions, *([] if scratch is None else [scratch]), *table_regions]
        )
        self._local = self._transport.prepare_local(self._layout)
        if staging_regions:
            self._staging_handle = self._transport.prepare_local(
                BlockLayout(
                    regions=staging_regions,
                    block_lens=block_lens,
                    num_blocks=self._options.permute_staging_blocks,
                )
            )
        if scratch is not None:
            self._flush_local = self._transport.prepare_local(
                BlockLayout(regions=[scratch], block_lens=[_FLUSH_BYTES], num_blocks=1)
            )
        if self._check_buf is not None:
            self._check_local = self._transport.prepare_local(
                BlockLayout(
                    regions=[table_regions[-1]], block_lens=[ENTRY_BYTES], num_blocks=_CHECKS
                )
            )
        # Read on the engine thread, before the server thread that answers with it exists.
        self._local_meta = self._transport.local_metadata()
        if self._transport.capabilities.access_control:
            # A two-sided transport asks before it serves a peer: READs of claimed pull
            # leases' blocks only (a decode-only engine grants none, so it serves no READ),
            # WRITEs only into claimed push leases' blocks (registered by this engine).
            self._region_bases = sorted(
                (r.addr, r.length, bl) for r, bl in zip(regions, block_lens, strict=True)
            )
            self._transport.set_access_check(self._check_access)
        if self._config.is_producer:
            port = self._options.side_channel_port
            self._server = HandshakeServer(
                self._options.side_channel_host,
                port + self._rank if port else 0,
                chash=self._chash,
                respond=self._respond,
                engine_id=self._engine_id,
                rank=self._rank,
                keys=self._keys,
                clock=self._clock,
                kv_layout=self._kv_facts,
            )
        if self._config.is_consumer:
            self._engines = RemoteEngines(
                self._transport,
                engine_id=self._engine_id,
                rank=self._rank,
                transport_name=self._options.transport,
                chash=self._chash,
                timeout=self._options.handshake_timeout,
                idle_ttl=self._options.peer_idle_ttl,
                clock=self._clock,
                local_metadata=self._local_meta,
                keys=self._keys,
                layout=self._layout,
                tp_size=self._engine.world_size,
                kv_layout=self._kv_facts,
                allow_permute=self._options.allow_layout_permute,
                warmup_timeout=self._options.warmup_timeout,
            )

    def _head_facts(
        self, kv_caches: Mapping[str, torch.Tensor], heads: int, order: str
    ) -> list[Any]:
        # Each layer must be [blocks, 2, block_size, this rank's heads, head_dim] (NHD) or
        # [blocks, 2, this rank's heads, block_size, head_dim] (HND); the facts hashed name
        # the whole model's head count instead of this rank's.
        try:
            local = len(kv_heads_of(self._rank, self._engine.world_size, heads))
        except ValueError as exc:
            raise ValueError(f"EngineInfo.num_kv_heads = {heads}: {exc}") from None
        facts: list[Any] = []
        bs = self._engine.block_size
        nhd = order == "NHD"
        dims = (2, bs, local) if nhd else (2, local, bs)
        want = f"[blocks, 2, {dims[1]}, {dims[2]}, head_dim]"
        what = "K/V, tokens, then heads" if nhd else "K/V, heads, then tokens"
        for name, t in kv_caches.items():
            shape = tuple(int(x) for x in t.shape)
            if len(shape) != 5 or shape[1:4] != dims or not t.is_contiguous():
                raise ValueError(
                    f"KV cache {name!r} has shape {list(shape)}; with EngineInfo.num_kv_heads "
                    f"= {heads} at tensor-parallel size {self._engine.world_size}, rank "
                    f"{self._rank} needs a contiguous {want} ({what}: the {order} layout, "
                    "EngineInfo.kv_cache_order). Leave num_kv_heads unset to move whole "
                    "blocks between engines of equal tensor-parallel sizes only"
                )
            whole = (2, bs, heads, shape[4]) if nhd else (2, heads, bs, shape[4])
            facts.append((name, whole, str(t.dtype)))
        self._local_heads = local
        return facts

    def _make_staging(
        self, kv_caches: Mapping[str, torch.Tensor], block_lens: list[int]
    ) -> list[MemoryRegion]:
        # allow_layout_permute: a staging area of permute_staging_blocks slots (one block of
        # every layer each, on the cache's device) that READs from a peer of the other order
        # land in, and byte views of the caches the permuted blocks are written into.
        import torch

        size = self._options.permute_staging_blocks
        self._staging = StagingArea(size)
        self._staging_tensors = []
        self._cache_bytes = []
        regions = []
        for t, blen in zip(kv_caches.values(), block_lens, strict=True):
            st = torch.zeros((size, blen), dtype=torch.uint8, device=t.device)
            self._staging_tensors.append(st)
            self._cache_bytes.append(t.view(torch.uint8).reshape(int(t.shape[0]), blen))
            regions.append(MemoryRegion.from_tensor(st))
        return regions

    def _check_access(self, peer: str, op: Op, ranges: Sequence[tuple[int, int]]) -> str | None:
        # Runs inside the transport's progress, on the engine thread (the holder's thread).
        # Each block asked for must belong to a live lease this peer claimed (a READ: a pull
        # lease this engine granted; a WRITE: a push lease on blocks this engine registered):
        # the leases of the blocks come from the index (a block shared by prefix caching has
        # several), and each distinct lease is asked once.
        index = self._block_leases if op is Op.READ else self._push_blocks
        if not index:
            self._count("access_refused")
            return (
                "this engine holds no lease for a READ of its KV cache"
                if op is Op.READ
                else "this engine registered no blocks for a WRITE into its KV cache"
            )
        owners: list[set[str]] = []
        bases = self._region_bases
        for addr, length in ranges:
            i = bisect.bisect_right(bases, (addr, math.inf, math.inf)) - 1
            if i < 0 or length <= 0:
                break
            base, size, block_len = bases[i]
            if addr + length > base + size:
                break
            first, last = (addr - base) // block_len, (addr + length - 1 - base) // block_len
            leases = [index.get(b) for b in range(first, last + 1)]
            if not all(leases):
                break
            owners.extend(x for x in leases if x)
        else:
            group = self._holder.group_of(peer)
            mine = {lid for lid in set().union(*owners) if self._holder.claimant(lid) == group}
            if all(not mine.isdisjoint(x) for x in owners):
                return None
        self._count("access_refused")
        return (
            "the range is not in a block of a lease this peer claimed (heartbeat the lease "
            "before reading or writing its blocks)"
        )

    def _index(
        self, index: dict[int, set[str]], lease_id: str, block_ids: tuple[tuple[int, ...], ...]
    ) -> None:
        # The access check's index (block -> its live leases), kept only when it is installed.
        if self._region_bases:
            for group in block_ids:
                for b in group:
                    index.setdefault(b, set()).add(lease_id)

    def _unindex(
        self, index: dict[int, set[str]], lease: Lease[tuple[str, tuple[tuple[int, ...], ...]]]
    ) -> None:
        if self._region_bases:
            for group in lease.payload[1]:
                for b in group:
                    held = index.get(b)
                    if held is not None:
                        held.discard(lease.request_id)
                        if not held:
                            del index[b]

    def get_handshake_metadata(self) -> bytes | None:
        if self._server is None:
            return None
        return self._codec.encode(
            PDWorkerAddress(
                host=self._server.host, port=self._server.port, incarnation=self._incarnation
            )
        )

    def _respond(self, request: HandshakeRequest, session: bytes | None) -> HandshakeResponse:
        # Runs on the handshake server thread: immutable values and one queue put only.
        if request.transport != self._options.transport:
            raise ValueError(
                f"this engine uses transport {self._options.transport!r}, not {request.transport!r}"
            )
        assert self._layout is not None
        mine = self._engine.world_size
        if request.tp_size != mine:
            heads = self._engine.num_kv_heads
            if heads is None:
                raise ValueError(
                    f"decoder {request.engine_id!r} runs at tensor-parallel size "
                    f"{request.tp_size} and this engine at {mine}; engines of different sizes "
                    "need both to give their connector EngineInfo.num_kv_heads"
                )
            check_tp_pair(mine, request.tp_size, heads)
            if request.rank >= request.tp_size:
                raise ValueError(
                    f"decoder rank {request.rank} is outside its tp_size {request.tp_size}"
                )
        try:
            self._pending_peers.put_nowait(
                (
                    request.engine_id,
                    request.rank,
                    request.transport_metadata,
                    session,
                    # Push mode writes whole blocks in the decoder's order: never into a
                    # layout of another order (a permuting decoder pulls only) or block size.
                    request.layout
                    if request.kv_layout is None
                    or self._kv_facts is None
                    or (
                        request.kv_layout.order == self._kv_facts.order
                        and request.kv_layout.block_size == self._engine.block_size
                    )
                    else None,
                    request.tp_size,
                )
            )
        except queue.Full:
            raise ValueError(
                f"busy: {_MAX_PENDING_PEERS} handshakes wait for this engine to add their "
                "peers; try again shortly"
            ) from None
        return HandshakeResponse(
            engine_id=self._engine_id,
            rank=self._rank,
            tp_size=self._engine.world_size,
            transport=self._options.transport,
            transport_metadata=self._local_meta,
            layout=self._layout,
            kv_lease_duration=self._policy.duration,
            incarnation=self._incarnation,
            lease_table=self._slot_layout,
        )

    # -- per step ------------------------------------------------------------------------
    def bind_connector_metadata(self, meta: ConnectorMetadata) -> None:
        super().bind_connector_metadata(meta)
        if isinstance(meta, PDMetadata) and not meta.is_empty:
            self._pending_meta.append(meta)

    def start_load_kv(self, forward_context: Any) -> None:
        """A progress point before the forward pass: the step's instructions are carried out
        (a READ posted here overlaps the forward pass)."""
        self._progress()

    def wait_for_layer_load(self, layer_name: str) -> None:
        """P/D loads are asynchronous (whole request, pulled or pushed, before it is
        scheduled): nothing to wait for layer by layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Pull mode: P keeps the KV in place for D to read, nothing to save. Push mode with
        ``push_layerwise``: write this layer's blocks that this step completed to each
        registered decoder whose lease is confirmed for ``read_margin`` more."""
        if self._step_progress:
            self._write_layer(layer_name)

    def wait_for_save(self) -> None:
        """Nothing is saved, so nothing to wait for."""

    def get_finished(self, finished_req_ids: Set[str]) -> tuple[set[str] | None, set[str] | None]:
        """A progress point after the forward pass; then every READ still in flight is polled
        once more just before returning, so a load whose bytes landed during this progress
        point is reported in this step, not the next; and where an optimistic READ landed but
        P's acknowledgement had not come yet, notifications are drained once more."""
        self._progress()
        if not self._closed and self._engines is not None:
            self._settle([rid for rid, rd in self._reads.items() if rd.handle is not None])
            if any(rd.reported for rd in self._reads.values()):
                # An optimistic READ landed before P's acknowledgement (P answers just after
                # its progress completed the READ): one more look for it.
                self._progress()
            else:
                self._flush_endpoints()  # the settle may have sent done notices
        self._step_progress = []
        sending, recving = self._finished_sending, self._finished_recving
        self._finished_sending, self._finished_recving = set(), set()
        if self._timing:
            self._report_timing(time.perf_counter())
        return (sending or None), (recving or None)

    def _report_timing(self, reported: float) -> None:
        # Per-request timing of the loads reported now: post -> first poll seeing the READ
        # done -> handed to the scheduler (get_finished returning it).
        for rid, (posted, seen) in self._timing.items():
            self._observe("load_done_seen_seconds", max(0.0, seen - posted))
            self._observe("load_report_seconds", max(0.0, reported - seen))
            self._event(
                "pd.load_timing",
                request_id=rid,
                done_seen_us=round((seen - posted) * 1e6, 1),
                reported_us=round((reported - posted) * 1e6, 1),
            )
        self._timing.clear()

    def get_stats(self) -> Stats:
        for name, n in self._reader.take_counts().items():
            self._count(name, n)
        for name, n in self._holder.take_counts().items():
            self._count(name, n)
        for name, n in self._push.take_counts().items():
            if name != "push_refused":  # counted where each refusal is sent
                self._count(name, n)
        for name, n in self._writer.take_counts().items():
            self._count(f"push_writer_{name}", n)
        if self._engines is not None:
            for name, n in self._engines.take_counts().items():
                self._count(name, n)
        if self._server is not None:
            # The server thread's totals, as counts since the last report.
            srv = self._server
            totals = (srv.served, srv.rejected, srv.rate_limited)
            for name, total, seen in zip(_SERVER_COUNTERS, totals, self._server_seen, strict=True):
                self._count(name, total - seen)
            self._server_seen = totals
        counters = {k: v for k, v in self._counters.items() if v}
        self._counters.clear()
        in_flight = len(self._reader.loads(ReadState.POSTED)) + self._receiver.count(
            ReceiveState.SENT
        )
        waiting = len(self._reader) + len(self._receiver) - in_flight
        gauges: dict[str, float] = {
            "leases_held": self._holder.live_count - len(self._push_leases),
            # The scheduler paces on it: kept turns nobody claimed need only a slow poll.
            "leases_active": self._holder.live_count
            - len(self._push_leases)
            - self._holder.kept_count,
            "loads_in_flight": in_flight,
            "loads_waiting": waiting,
            "pushes_open": len(self._push) + len(self._writes),
            "remote_engines": len(self._engines) if self._engines is not None else 0,
        }
        return Stats(counters=counters, gauges=gauges)

    def _count(self, name: str, n: float = 1, engine: str | None = None) -> None:
        self._counters[name] = self._counters.get(name, 0) + n
        if engine is not None:
            key = f"{name}.{engine}"
            self._counters[key] = self._counters.get(key, 0) + n

    def _observe(self, name: str, value: float, engine: str | None = None) -> None:
        self._count(name, value, engine)
        self._count(observation_key(name, value))

    def _event(self, kind: str, **data: Any) -> None:
        self._events.append(KVEvent(kind=kind, data=dict(data)))

    # -- progress ------------------------------------------------------------------------
    def progress(self) -> None:
        """Make progress without an engine step (for a driver thread or an idle loop)."""
        self._progress()

    def progress_wanted(self) -> bool:
        """Whether a peer may be waiting for this worker's next progress point: it holds a
        lease a reader may claim or is reading (any but a decoder's kept turns nobody claimed
        yet), or has loads, pushes or writes under way. A driver loop may call
        :meth:`progress` at a short interval while this is true and slow down when it is
        false: P then answers a heartbeat, and lets a READ that follows a notification
        complete, within that interval instead of at the engine's step pace (see
        ``docs/demo.md``, "Where the connector's fixed cost goes"). Cheap; any thread."""
        if self._closed:
            return False
        return (
            self._holder.live_count > self._holder.kept_count
            or bool(self._reads)
            or bool(self._writes)
            or len(self._push) > 0
        )

    def _progress(self) -> None:
        if self._closed:
            return
        self._add_pending_peers()
        try:
            notes = self._transport.drain_notifications()
        except TransportError as exc:
            self._count("drain_errors")
            self._event("pd.drain_error", error=str(exc))
            notes = []
        states = self._poll(list(self._reads))
        wstates = self._poll_writes(list(self._writes))
        if self._flushes:
            self._poll_flushes()  # before this progress point posts any READ
        checks = [(r, c, self._check_state(c)) for r, c in self._checks.items()]
        # The clock reading of this progress point: after every observation above, so that
        # no completion or receipt is stamped earlier than it happened.
        now = self._clock()
        self._posted_now = []
        self._writes_posted_now = []
        for peer in self._gone_reader_peers:
            self._reader_peer_gone(peer, "the decoder connected again", now)
        self._gone_reader_peers = []
        while self._liveness:
            self._apply_liveness(*self._liveness.popleft(), now)
        for peer in self._new_reader_peers:
            self._run_writer(self._writer.peer_ready(peer, now), now)
        self._new_reader_peers = []
        self._apply_pending(now)
        for note in notes:
            self._on_notification(note.sender, note.payload, now)
        if self._engines is not None:
            self._poll_peers(now)
            for rid, state, handle in states:
                self._transfer_state(rid, state, handle, now)
            self._run(self._reader.tick(now), now)
            if self._staging_wait:
                self._post_waiting(now)
            self._settle_posted()
            if self._pushes:
                self._push_tick(now)
            self._flush_endpoints()
            for rid, check, xstate in checks:
                self._checked(rid, check, xstate, now)
        if self._pre:
            self._poll_pre(now)
        if self._writes or len(self._push):
            for rid, state, wr in wstates:
                self._write_state(rid, state, wr, now)
            self._run_push(self._push.tick(now), now)
            self._run_writer(self._writer.tick(now), now)
            self._settle_writes()
        self._lease_output(self._holder.expire(now), now)

    # -- liveness --------------------------------------------------------------------------
    def engine_gone(self, engine_id: str, reason: str = "it left the fleet") -> None:
        """Engine ``engine_id`` is gone for good (dead, or withdrawn from the fleet): act now
        instead of waiting for leases and timeouts to notice.

        Safe to call from any thread (a discovery watcher's, an operator's); it takes effect
        at this worker's next progress point. As a **holder** (P) every live lease that a
        worker of that engine claimed, or that was granted for it (``decode_engine_id``) and
        nobody claimed yet, is aborted at once (its blocks reported in
        ``finished_sending``), and writes to it in push mode stop. As a **reader** (D) every
        pending load from that engine fails at once with ``reason`` (failure policy applies;
        posted READs are stopped first) and its connection is dropped; a later request naming
        the engine handshakes again. Unknown engines are ignored.

        Call it only for an engine that can no longer be reading from this one: aborting a
        live reader's leases frees blocks under a bound this worker confirmed to it.
        kvframe's discovery backends report an engine gone only after its registration
        lapsed, and a registrant reports its own registration lost before that (see
        ``docs/fleet.md``). Without any call, leases bound everything as before.
        """
        if not isinstance(engine_id, str) or not engine_id:
            raise ValueError(f"engine_id must be a non-empty string, got {engine_id!r}")
        self._liveness.append(("gone", engine_id, str(reason)))

    def fence(self, reason: str) -> None:
        """This engine may have been reported gone (its own fleet registration lapsed): stop
        reading at once. Any thread; effective at the next progress point.

        Every pending load fails with ``reason`` (posted READs are stopped first), every
        connection to a prefill engine is dropped (the next request handshakes again), every
        load the scheduler adds while fenced fails at once, and no heartbeat is sent, so no
        lease is claimed or renewed: a prefill engine that saw this engine vanish and aborted its
        leases can free their blocks safely. :meth:`unfence` ends it.
        """
        self._liveness.append(("fence", "", str(reason)))

    def unfence(self) -> None:
        """Read again (the registration is confirmed again). Any thread."""
        self._liveness.append(("unfence", "", ""))

    @property
    def fenced(self) -> bool:
        """Whether the worker is fenced (as of its latest progress point)."""
        return self._fenced is not None

    def _apply_liveness(self, what: str, engine_id: str, reason: str, now: float) -> None:
        if what == "gone":
            self._engine_gone(engine_id, reason, now)
        elif what == "fence":
            if self._fenced is None:
                self._count("fenced")
                self._event("pd.fenced", reason=reason)
            self._fenced = reason
            self._fail_fenced(now, sweep=True)
        else:
            if self._fenced is not None:
                self._event("pd.unfenced")
            self._fenced = None

    def _fail_fenced(self, now: float, *, sweep: bool = False) -> None:
        # Fail every load; on entering the fence (sweep) also drop every connection, so that
        # heartbeats deferred for a handshake under way are dropped with it and, once
        # unfenced, the next request handshakes again and the reader hears the peer ready.
        why = f"this engine is fenced: {self._fenced}"
        engines = {rd.key for rd in self._reads.values()}
        if sweep and self._engines is not None:
            for entry in self._engines.entries():
                engines.add(self._key_of(entry))
                self._engines.mark_failed(entry, now, why)
        for engine in sorted(engines):
            self._run(self._reader.peer_failed(engine, why, now), now)
        for rid in list(self._pushes):
            self._push_abort(rid, now)

    def _engine_gone(self, engine_id: str, reason: str, now: float) -> None:
        self._count("engines_gone")
        self._event("pd.engine_gone", engine=engine_id, reason=reason)
        for (eid, _rank), peer in list(self._reader_peers.items()):
            if eid != engine_id:
                continue
            out = self._holder.abort_claims(peer, now)
            self._count("leases_aborted_engine_gone", len(out.ended))
            self._lease_output(out, now)
            self._reader_peer_gone(peer, f"decoder {engine_id!r} is gone: {reason}", now)
        # Leases granted for it (the request's decode_engine_id) that nobody claimed yet.
        out = self._holder.abort_unclaimed_for(engine_id, now)
        self._count("leases_aborted_engine_gone", len(out.ended))
        self._lease_output(out, now)
        if self._engines is None:
            return
        why = f"left the fleet ({reason})"
        entries = self._engines.find_all(engine_id)
        for entry in entries:
            self._engines.mark_failed(entry, now, why)
        if entries and self._pushes:
            self._run_receiver(self._receiver.peer_failed(engine_id, why, now), now)
        for key in self._keys_of(engine_id) + self._idle_keys.get(engine_id, []):
            self._run(self._reader.peer_failed(key, why, now), now)

    def _reader_peer_gone(self, peer: str, reason: str, now: float) -> None:
        for lid in [lid for lid, pre in self._pre.items() if pre.peer == peer]:
            self._drop_pre(lid)
        self._run_push(self._push.peer_gone(peer, now), now)
        self._run_writer(self._writer.peer_failed(peer, reason, now), now)

    def _poll(self, rids: Iterable[str]) -> list[tuple[str, XferStatus, XferHandle]]:
        out = []
        for rid in rids:
            rd = self._reads.get(rid)
            if rd is None or rd.handle is None or rd.reported:
                continue
            status = self._transport.poll(rd.handle)
            if status.state is XferState.DONE and not rd.done_perf:
                rd.done_perf = time.perf_counter()
            out.append((rid, status, rd.handle))
        return out

    def _settle_posted(self) -> None:
        # READs posted in this progress point often complete inside the post (NIXL under
        # cma, the in-process fabric): look once more, and if any did, take a second reading
        # for them (after that observation), so the load ends now instead of a progress
        # point later.
        posted, self._posted_now = self._posted_now, []
        self._settle(posted)

    def _settle(self, rids: Iterable[str]) -> None:
        states = self._poll(rids)
        if not any(st.state is not XferState.PENDING for _, st, _ in states):
            return
        later = self._clock()
        for rid, st, handle in states:
            self._transfer_state(rid, st, handle, later)

    def _apply_pending(self, now: float) -> None:
        while self._pending_meta:
            self._apply(self._pending_meta.popleft(), now)

    def _apply(self, meta: PDMetadata, now: float) -> None:
        for grant in meta.grants:
            if grant.ttl is None:
                self._holder.grant(
                    grant.lease_id,
                    now,
                    (grant.request_id, grant.block_ids),
                    engine=grant.decode_engine,
                )
                self._count("leases_granted")
                # Never a kept turn's (a decoder's engine may reuse those blocks before its
                # connector hears of the eviction): readers read those only once confirmed.
                if self._slots is not None and not self._holder.publish(grant.lease_id):
                    self._count("lease_table_collisions")
            else:
                self._holder.keep(
                    grant.lease_id, now, (grant.request_id, grant.block_ids), grant.ttl
                )
                self._count("leases_kept")
            self._index(self._block_leases, grant.lease_id, grant.block_ids)
        for lease_id in meta.evictions:
            self._lease_output(self._holder.evict(lease_id, now), now)
        for src in meta.push_sources:
            self._count("push_sources")
            self._run_push(
                self._push.offer(
                    src.request_id,
                    src.push_id,
                    src.block_ids,
                    src.num_tokens,
                    src.prompt_digest,
                    now,
                ),
                now,
            )
        for push_id in meta.push_abandoned:
            self._run_push(self._push.abandon(push_id, now), now)
        self._step_progress.extend(meta.push_progress)
        if self._engines is None:
            return
        for addr in meta.engines:
            self._ensure(addr, now)
        for load in meta.pd_loads:
            self._count("loads_requested")
            if load.push_id:
                self._push_add(load, now)
                continue
            self._add_load(load, now)
        if self._fenced is not None:
            self._fail_fenced(now)
        for rid in meta.abort_request_ids:
            if rid in self._pushes:
                self._push_abort(rid, now)
            else:
                split = self._splits.get(rid)
                for sub in split.subs if split is not None else [rid]:
                    self._run(self._reader.abort(sub, now), now)
        reading = (
            {rd.spec.remote_request_id for rd in self._reads.values()}
            if self._flush_local is not None and meta.pd_heartbeats
            else set()
        )
        for engine_id, ids in meta.pd_heartbeats.items():
            if self._fenced is not None:
                self._count("heartbeats_fenced", len(ids))
                continue
            # A batch naming a lease no load reads yet (a request waiting for its load) is
            # followed by a flush READ: that load's READ then completes inside its post.
            waiting = self._flush_local is not None and any(i not in reading for i in ids)
            # Every source rank of this rank hears each heartbeat batch.
            for key in self._keys_of(engine_id):
                self._run(self._reader.heartbeat(key, ids, now), now)
                if waiting:
                    self._flush_after(key)
        releases: dict[str, list[str]] = {}
        for rel in meta.releases:
            self._ensure(rel.remote, now)
            releases.setdefault(rel.remote.engine_id, []).append(rel.remote_request_id)
        for engine_id, lids in releases.items():
            for key in self._keys_of(engine_id) + self._idle_keys.get(engine_id, []):
                self._run(self._reader.release(key, lids, now), now)

    def _add_load(self, load: PDLoad, now: float) -> None:
        # One load per source rank of this rank (one: equal tensor-parallel sizes, whole
        # blocks under the request id); the request ends when all of them ended.
        sources = self._sources_of(load.remote)
        rid = load.request_id
        entry = self._ensure(load.remote, now, load.remote_incarnations)
        subs = [rid] if len(sources) == 1 else [f"{rid}#{rank}" for _, rank, _ in sources]
        if len(subs) > 1:
            self._splits[rid] = _Split(subs=subs)
        for key in self._idle_keys.get(load.remote.engine_id, ()):
            # A replica of P nobody reads: it may free this request's blocks now.
            self._run(self._reader.release(key, [load.remote_request_id], now), now)
        for sub, (key, rank, heads) in zip(subs, sources, strict=True):
            self._reads[sub] = _Read(spec=load, key=key, heads=heads, parent=rid)
            incs = load.remote_incarnations
            incarnation = incs[rank] if rank < len(incs) else None
            not_after = None
            if load.kept_until is not None:
                not_after = self._kept_cap(entry, load.kept_until)
                if not_after is None:  # no clock sample yet: capped before the peer is ready
                    self._uncapped[sub] = (load.remote.engine_id, load.kept_until)
            if self._fenced is not None:
                # The peer marked down first: the load waits for it, sending nothing, and
                # fails with the others below.
                why = f"this engine is fenced: {self._fenced}"
                self._run(self._reader.peer_failed(key, why, now), now)
            self._run(
                self._reader.add(
                    sub,
                    key,
                    load.remote_request_id,
                    now,
                    incarnation=incarnation,
                    not_after=not_after,
                    # A decoder's kept turn may be evicted (its blocks reused by its engine)
                    # at any moment until claimed: read it only once confirmed.
                    optimistic=False if load.kept_until is not None else None,
                ),
                now,
            )

    # -- notifications -------------------------------------------------------------------
    def _seal(self, key: bytes | None, payload: bytes) -> bytes | None:
        # With a fleet key every notification carries a tag under the connection's session
        # key; a connection without one (cannot happen when authenticated) sends nothing.
        if self._keys is None:
            return payload
        return None if key is None else tag(key, payload)

    def _open(self, sender: str, data: bytes) -> bytes | None:
        if self._keys is None:
            return data
        # A worker may be both holder (sender is a reader) and reader (sender is a holder).
        for key in (self._peer_keys.get(sender), self._engine_key(sender)):
            if key is not None:
                payload = untag(key, data)
                if payload is not None:
                    return payload
        return None

    def _engine_key(self, sender: str) -> bytes | None:
        entry = self._engines.by_peer(sender) if self._engines is not None else None
        return None if entry is None else entry.session_key

    def _on_notification(self, sender: str, data: bytes, now: float) -> None:
        payload = self._open(sender, data)
        if payload is None:
            self._count("notifications_unauthenticated")
            self._event("pd.unauthenticated_notification", sender=sender[:64])
            return
        if pushwire.is_push_message(payload):
            self._on_push_message(sender, payload, now)
            return
        try:
            msg = wire.decode(payload)
        except CodecError as exc:
            self._count("notifications_rejected")
            self._event("pd.bad_notification", sender=sender, error=str(exc))
            return
        if isinstance(msg, wire.Heartbeat | wire.LeaseDone):
            if sender not in self._readers:
                # A reader whose handshake was answered after this progress point took the
                # new peers: take it now, so a decoder's rank is in its reader group before
                # its first heartbeat claims anything.
                self._add_pending_peers()
            if isinstance(msg, wire.Heartbeat):
                self._count("heartbeats_received")
            out = self._holder.receive(sender, msg, now)
            self._reply(sender, out.replies)
            self._lease_output(out, now)
            return
        entry = self._engines.by_peer(sender) if self._engines is not None else None
        writer = sender in self._readers
        if entry is None and not writer:
            self._count("notifications_unroutable")
            return
        if isinstance(msg, wire.LeaseAck):
            self._count("acks_received")
        if writer:
            # A decoder answers the heartbeats this engine's writer sent for its leases.
            if isinstance(msg, wire.LeaseLost):
                dropped = self._push.revoked(sender, msg.handles, now)
                for lid in dropped:
                    self._drop_pre(lid)  # stopped before the release says so
                if dropped:
                    self._run_writer(self._writer.release(sender, dropped, now), now)
            self._run_writer(self._writer.receive(sender, msg, now), now)
        if entry is not None:
            self._run(self._reader.receive(self._key_of(entry), msg, now), now)

    def _lease_output(
        self, out: HolderOutput[tuple[str, tuple[tuple[int, ...], ...]]], now: float
    ) -> None:
        for lease in out.ended:
            self._lease_ended(lease, now)

    def _lease_ended(
        self, lease: Lease[tuple[str, tuple[tuple[int, ...], ...]]], now: float
    ) -> None:
        if lease.request_id in self._push_leases:
            self._push_lease_ended(lease, now)
            return
        self._finished_sending.add(lease.payload[0])
        self._unindex(self._block_leases, lease)
        self._count(_ENDED_COUNTER.get(lease.state, "leases_ended"))

    def _reply(self, peer: str, messages: Iterable[wire.Message]) -> None:
        for msg in messages:
            if isinstance(msg, wire.LeaseAck):
                # Once per heartbeat batch of a decoder, whatever its number of ranks reading
                # from this one: its other members' acks are not counted again.
                if not self._members.get(peer):
                    self._count("leases_renewed", len(msg.handles))
            elif isinstance(msg, wire.LeaseLost):
                self._count("heartbeat_ids_ignored", len(msg.handles))
            key = self._peer_keys.get(peer) or self._engine_key(peer)
            for part in wire.split(msg, self._max_notif - self._tag_bytes):
                sealed = self._seal(key, wire.encode(part))
                if sealed is None:
                    self._count("notifications_unsent")
                    return
                try:
                    self._transport.send_notification(peer, sealed)
                except TransportError as exc:
                    self._count("notify_failures")
                    self._event("pd.notify_failed", peer=peer, error=str(exc))
                    return

    def _add_pending_peers(self) -> None:
        while True:
            try:
                engine_id, rank, meta, session, layout, tp = self._pending_peers.get_nowait()
            except queue.Empty:
                return
            # A reader that handshakes again saw its connection fail, or restarted: rebuild
            # ours too, so replies go over a fresh connection.
            old = self._reader_peers.pop((engine_id, rank), None)
            if old is not None:
                with contextlib.suppress(TransportError):
                    self._transport.remove_peer(old)
                self._readers.pop(old, None)
                self._holder.leave(old)
                self._members.pop(old, None)
                self._peer_keys.pop(old, None)
                self._reader_layouts.pop(old, None)
                self._reader_handles.pop(old, None)
                self._count("peers_rebuilt")
                self._forget_writer_peer(old)
            try:
                peer = self._transport.add_peer(meta)
            except TransportError as exc:
                self._count("peer_add_failures")
                self._event("pd.peer_add_failed", engine=engine_id, error=str(exc))
                continue
            self._reader_peers[(engine_id, rank)] = peer
            self._readers[peer] = engine_id
            if session is not None:
                self._peer_keys[peer] = session
            if layout is not None:
                self._reader_layouts[peer] = layout
                self._new_reader_peers.append(peer)
            self._holder.connected(peer)
            self._join(peer, engine_id, rank, tp)

    def _join(self, peer: str, engine_id: str, rank: int, tp: int) -> None:
        # Heterogeneous tensor parallelism: the decoder's ranks that read from this rank
        # form one reader group; a lease they claim ends at the last one's report.
        heads = self._engine.num_kv_heads
        if tp == self._engine.world_size or heads is None:
            return
        consumers = consumers_of(self._rank, self._engine.world_size, tp, heads)
        if rank in consumers:
            member = consumers.index(rank)
            self._holder.join(peer, engine_id, member, len(consumers))
            self._members[peer] = member

    # -- D: peers ------------------------------------------------------------------------
    def _remote_rank(self, addr: RemoteEngineAddr) -> int:
        return self._rank % max(1, addr.tp_size)

    def _sources_of(self, addr: RemoteEngineAddr) -> list[tuple[str, int, HeadSlice | None]]:
        """This rank's sources at ``addr``: (reader key, remote rank, heads or None). Equal
        tensor-parallel sizes: rank ``r`` reads whole blocks from rank ``r`` under the engine
        id. Different sizes: the ranks :func:`~kvframe.core.tp.head_sources` names, each under
        ``<engine id>#<rank>`` (the scheduler refused the pair unless num_kv_heads is given
        and both sizes shard it)."""
        eid, tp = addr.engine_id, addr.tp_size
        cached = self._sources.get((eid, tp))
        if cached is None:
            world, heads = self._engine.world_size, self._engine.num_kv_heads
            idle: tuple[int, ...] = ()
            found: list[tuple[str, int, HeadSlice | None]]
            if tp == world or heads is None:
                found = [(eid, self._remote_rank(addr), None)]
            else:
                found = [
                    (f"{eid}#{sl.p_rank}", sl.p_rank, sl)
                    for sl in head_sources(self._rank, world, tp, heads)
                ]
                idle = idle_ranks_of(self._rank, world, tp, heads)
            if len(self._sources) > 4096:  # engines come and go: bounded
                self._sources.clear()
            cached = self._sources[(eid, tp)] = (found, idle)
        found, idle = cached[0], cached[1]
        if self._engine_tp.get(eid) != tp:
            # First seen, or restarted at another size: its ranks' keys change.
            self._engine_tp[eid] = tp
            for key in self._engine_keys.pop(eid, []) + self._idle_keys.pop(eid, []):
                rank = self._key_rank.pop(key, (eid, -1))[1]
                self._rank_key.pop((eid, rank), None)
            self._engine_keys[eid] = [key for key, _, _ in found]
            # Replicas nobody reads (told by this rank to free their blocks at once).
            self._idle_keys[eid] = [f"{eid}#{p}" for p in idle]
            ranks = [(key, rank) for key, rank, _ in found]
            ranks += [(f"{eid}#{p}", p) for p in idle]
            for key, rank in ranks:
                self._key_rank[key] = (eid, rank)
                self._rank_key[(eid, rank)] = key
        return found

    def _keys_of(self, engine_id: str) -> list[str]:
        """The reader keys of ``engine_id`` (its engine id alone until a load names it)."""
        return self._engine_keys.get(engine_id) or [engine_id]

    def _key_of(self, entry: RemoteEngine) -> str:
        """The reader key of a remote engine rank's entry."""
        return self._rank_key.get((entry.engine_id, entry.rank), entry.engine_id)

    def _engine_of(self, key: str) -> str:
        found = self._key_rank.get(key)
        return key if found is None else found[0]

    def _ensure(
        self, addr: RemoteEngineAddr, now: float, incarnations: Sequence[str] = ()
    ) -> RemoteEngine:
        """Start (or keep) the connection to every source rank at ``addr``; returns the first
        one's entry."""
        assert self._engines is not None
        first: RemoteEngine | None = None
        for key, rank, _ in self._sources_of(addr):
            incarnation = incarnations[rank] if rank < len(incarnations) else None
            before = self._engines.get(addr.engine_id, rank)
            entry = self._engines.ensure(
                addr.engine_id, rank, addr.host, addr.port_for(rank), now, incarnation=incarnation
            )
            if before is not None and before is not entry and before.state is PeerState.READY:
                # A new handshake replaced a usable connection (the engine moved).
                self._run(self._reader.peer_lost(key, now), now)
            first = first or entry
        for key in self._idle_keys.get(addr.engine_id, ()):
            rank = self._key_rank[key][1]
            self._engines.ensure(addr.engine_id, rank, addr.host, addr.port_for(rank), now)
        assert first is not None
        return first

    def _kept_cap(self, entry: RemoteEngine, kept_until: float) -> float | None:
        # A decoder's kept-blocks expiry (its clock) on this worker's clock: early by the
        # offset estimate's uncertainty and ttl_safety_margin. None before any clock sample.
        if entry.state is not PeerState.READY or entry.clock.best is None:
            return None
        return self._ttl.reader_deadline(kept_until, entry.clock)

    def _cap_loads(self, entry: RemoteEngine, now: float) -> None:
        # Before the reader hears the peer is ready: cap the loads of kept blocks added while
        # the offset was unknown (no read can be posted before then).
        for rid, (engine_id, kept_until) in list(self._uncapped.items()):
            if engine_id != entry.engine_id:
                continue
            cap = self._kept_cap(entry, kept_until)
            if cap is not None:
                del self._uncapped[rid]
                self._run(self._reader.cap(rid, cap, now), now)

    def _entry(self, key: str) -> RemoteEngine | None:
        assert self._engines is not None
        found = self._key_rank.get(key)
        if found is not None:
            return self._engines.get(*found)
        return self._engines.find(key)

    def _poll_peers(self, now: float) -> None:
        assert self._engines is not None
        for entry in self._engines.poll(now, self._engine_busy):
            if entry.state is PeerState.READY and entry.peer is not None:
                # A new connection: a writer's heartbeats over it (push mode) start a new
                # sequence at this holder.
                self._holder.connected(entry.peer)
            if self._pushes:
                self._push_peer(entry, now)
            if entry.warmup_outcome is not None:
                self._event(
                    "pd.warmup",
                    engine=entry.engine_id,
                    outcome=entry.warmup_outcome,
                    seconds=entry.warmup_seconds,
                )
            if entry.state is PeerState.READY:
                if self._uncapped:
                    self._cap_loads(entry, now)
                self._run(
                    self._reader.peer_ready(
                        self._key_of(entry), now, incarnation=entry.incarnation
                    ),
                    now,
                )
            elif entry.state is PeerState.FAILED:
                self._event("pd.handshake_failed", engine=entry.engine_id, error=entry.error)
                self._run(
                    self._reader.peer_failed(self._key_of(entry), entry.error or "failed", now),
                    now,
                )

    def _peer_broke(self, entry: RemoteEngine, reason: str, now: float) -> list[Action]:
        assert self._engines is not None
        self._engines.mark_failed(entry, now, reason)
        return self._reader.peer_failed(self._key_of(entry), reason, now)

    # -- D: executing the reader's actions -----------------------------------------------
    def _run(self, actions: list[Action], now: float) -> None:
        todo = collections.deque(actions)
        while todo:
            action = todo.popleft()
            if isinstance(action, SendMessage):
                todo.extend(self._send(action, now))
            elif isinstance(action, PostRead):
                todo.extend(self._post(action, now))
            elif isinstance(action, StopRead):
                self._stop(action.request_id)
            elif isinstance(action, LoadEnded):
                self._load_ended(action, now)
            elif isinstance(action, Reconnect):
                todo.extend(self._reconnect(action, now))

    def _send(self, action: SendMessage, now: float) -> list[Action]:
        entry = self._entry(action.engine)
        if entry is None or entry.state is not PeerState.READY or entry.peer is None:
            self._count("notifications_unsent")
            return []
        msg = action.message
        for part in wire.split(msg, self._max_notif - self._tag_bytes):
            sealed = self._seal(entry.session_key, wire.encode(part))
            if sealed is None:
                self._count("notifications_unsent")
                return []
            try:
                self._transport.send_notification(entry.peer, sealed)
            except TransportError as exc:
                self._count("notify_failures", engine=entry.engine_id)
                self._event("pd.notify_failed", engine=entry.engine_id, error=str(exc))
                if isinstance(exc, PeerUnreachableError):
                    # The prefill engine is gone: loads waiting on it fail now instead of
                    # waiting for a confirmation that cannot come.
                    return self._peer_broke(entry, f"unreachable: {exc}", now)
                return []
        if isinstance(msg, wire.Heartbeat):
            self._count("heartbeats_sent", engine=entry.engine_id)
        return []

    def _post(self, action: PostRead, now: float, *, waited: bool = False) -> list[Action]:
        rd = self._reads.get(action.request_id)
        if rd is None or self._reader.state(action.request_id) is not ReadState.POSTED:
            # Ended since the reader asked for the post, by an action before it in the same
            # list (a send that found the prefill engine unreachable). The reader already
            # reported the end (its LoadEnded follows); posting or failing it again would
            # report it twice.
            self._count("posts_skipped_ended")
            return []
        entry = self._entry(action.engine)
        if (
            entry is None
            or entry.state is not PeerState.READY
            or entry.remote is None
            or entry.peer is None
            or self._local is None
        ):
            return self._reader.transfer_failed(
                action.request_id, "no connection to the prefill engine", now
            )
        spec = rd.spec
        local = [b for g in spec.local_block_ids for b in g]
        remote = [b for g in spec.remote_block_ids for b in g]
        if not local:
            return self._reader.transfer_done(action.request_id, now)
        local_handle, remote_handle = self._local, entry.remote
        mine_bs = self._engine.block_size
        theirs_bs = spec.remote_block_size or mine_bs
        facts = entry.response.kv_layout if entry.response is not None else None
        said = facts.block_size if facts is not None else mine_bs
        if said != theirs_bs:
            # The ticket (hostile until proven otherwise) and the handshake disagree: reading
            # with either size could put tokens in the wrong places.
            named = "remote_block_size" if spec.remote_block_size else "no remote_block_size"
            return self._reader.transfer_failed(
                action.request_id,
                f"the ticket's blocks are of {theirs_bs} tokens ({named}) but the prefill "
                f"engine's handshake says {said}; pass P's kv_transfer_params through unchanged",
                now,
            )
        permute = self._permute_order(entry)
        if permute is not None:
            # allow_layout_permute: P's blocks land in staging slots, permuted into this
            # engine's order once DONE (_transfer_state); nothing lands in the cache as read.
            staging = self._staging
            if (
                staging is None
                or self._staging_handle is None
                or rd.heads is not None
                or theirs_bs != mine_bs
            ):
                return self._reader.transfer_failed(
                    action.request_id,
                    "the prefill engine's KV cache order differs and this engine has no "
                    "staging area to permute it in (allow_layout_permute with "
                    "EngineInfo.num_kv_heads, equal tensor-parallel and block sizes)",
                    now,
                )
            if len(local) > staging.size:
                self._count("permute_refused")
                return self._reader.transfer_failed(
                    action.request_id,
                    f"the load's {len(local)} blocks need permuting and do not fit the staging "
                    f"area of {staging.size} blocks; raise permute_staging_blocks",
                    now,
                )
            if (self._staging_wait and not waited) or staging.take(
                action.request_id, len(local)
            ) is None:
                # Too few free slots (or loads waiting ahead): wait, in arrival order, for
                # the loads ahead to end; the reader's deadline of a posted load bounds it.
                if waited:  # cannot happen (_post_waiting saw the slots free): keep its turn
                    self._staging_wait.appendleft(action)
                else:
                    self._staging_wait.append(action)
                    self._count("permute_waits")
                return []
            rd.permute_from = permute
            local_handle, local = self._staging_handle, list(staging.slots(action.request_id))
        if theirs_bs != mine_bs:
            # Blocks of another size: regrouped token range by token range.
            try:
                local_handle, remote_handle, local, remote = self._regrouped(spec, rd.heads, entry)
            except (TransportError, ValueError) as exc:
                return self._reader.transfer_failed(
                    action.request_id,
                    f"regrouping blocks of {theirs_bs} tokens into blocks of {mine_bs} "
                    f"failed: {exc}",
                    now,
                )
        elif rd.heads is not None:
            # Heterogeneous tensor parallelism: this rank's heads of each block, from the
            # source rank's share, as units of a layout cut into head runs.
            try:
                local_handle, remote_handle, local, remote = self._head_units(
                    rd.heads, spec.remote, entry, local, remote
                )
            except (TransportError, ValueError) as exc:
                return self._reader.transfer_failed(
                    action.request_id, f"cutting the heads to read failed: {exc}", now
                )
        t0 = time.perf_counter()  # a statistic, not a decision: not the step's clock
        notice = self._seal(entry.session_key, wire.encode(action.notification))
        if notice is None:
            return self._reader.transfer_failed(
                action.request_id, "the connection to the prefill engine is not authenticated", now
            )
        if action.notify_when_done or not self._transport.capabilities.notification_after_data:
            # An optimistic READ, posted before the heartbeat asking P to claim its lease: the
            # done notice must follow the heartbeat, or P consumes the unclaimed lease and
            # answers the heartbeat with a loss. Or the transport may deliver a post's
            # notification before the bytes land, and the prefill engine reuses the blocks on
            # receipt. Either way: send it ourselves once DONE.
            rd.notice, notice = notice, None
        try:
            rd.handle = self._transport.post(
                Op.READ,
                local_handle,
                local,
                remote_handle,
                remote,
                notification=notice,
            )
        except (TransportError, ValueError) as exc:
            if self._staging is not None:
                self._staging.give(action.request_id)
            broken = isinstance(exc, PeerUnreachableError)
            if broken and action.notify_when_done:
                # An optimistic READ goes first in its progress point: its post is where D
                # learns the prefill engine is gone (the heartbeat behind it would have). Loads
                # waiting on that engine fail now, as when a send finds it unreachable, rather
                # than waiting for a new connection that nothing would ask for.
                return self._peer_broke(entry, f"unreachable: {exc}", now)
            out = self._reader.transfer_failed(
                action.request_id, f"posting the read failed: {exc}", now, peer_broken=broken
            )
            if broken:
                assert self._engines is not None
                self._engines.mark_failed(entry, now, str(exc))
            return out
        rd.posted_at = now
        rd.post_perf = t0
        self._posted_now.append(action.request_id)
        self._observe("post_seconds", time.perf_counter() - t0)
        self._count("descriptors", rd.handle.num_descriptors)
        assert self._engines is not None
        self._engines.touch(entry, now)
        return []

    def _permute_order(self, entry: RemoteEngine) -> str | None:
        """The source's KV cache order when it differs from this engine's (the handshake let
        it through only with ``allow_layout_permute``), else ``None``."""
        theirs = entry.response.kv_layout if entry.response is not None else None
        if theirs is None or self._kv_facts is None or theirs.order == self._kv_facts.order:
            return None
        return theirs.order

    def _post_waiting(self, now: float) -> None:
        # Permuting loads that found too few free staging slots, in arrival order: post the
        # first ones that fit now; loads that ended meanwhile are dropped.
        staging = self._staging
        while self._staging_wait and staging is not None:
            action = self._staging_wait[0]
            rid = action.request_id
            rd = self._reads.get(rid)
            if (
                rd is None
                or rd.handle is not None
                or self._reader.state(rid) is not ReadState.POSTED
            ):
                self._staging_wait.popleft()
                continue
            need = sum(len(g) for g in rd.spec.local_block_ids)
            if need > staging.free:
                return
            self._staging_wait.popleft()
            self._run(self._post(action, now, waited=True), now)

    def _permute_in(self, rd: _Read, rid: str) -> None:
        """Write the staged blocks of ``rid``, permuted into this engine's order, into its
        destination blocks (every layer), on this thread."""
        import torch

        from kvframe.connectors.pd.permute import permute_blocks

        assert self._staging is not None
        assert self._kv_facts is not None
        assert rd.permute_from is not None
        slots = list(self._staging.slots(rid))
        local = [b for g in rd.spec.local_block_ids for b in g]
        for staged, cache in zip(self._staging_tensors, self._cache_bytes, strict=True):
            src = staged.index_select(0, torch.tensor(slots, device=staged.device))
            out = permute_blocks(
                src,
                rd.permute_from,
                self._kv_facts.order,
                block_size=self._engine.block_size,
                heads=self._local_heads,
            )
            cache[torch.tensor(local, device=cache.device)] = out
        self._count("loads_permuted")
        self._count("blocks_permuted", len(local))

    def _flush_after(self, key: str) -> None:
        # Notifications went to this source's peer: the next READ to it completes only at the
        # peer's next progress point unless a flush READ completes first.
        entry = self._entry(key)
        if entry is None or entry.peer is None or entry.state is not PeerState.READY:
            return
        fl = self._flushes.get(entry.peer)
        if fl is None or fl.entry is not entry:
            self._flushes[entry.peer] = _Flush(entry=entry)
        else:
            fl.dirty = True

    def _flush_endpoints(self) -> None:
        """D: after a heartbeat batch that names a lease no load reads yet (a request waiting
        for its load), post a tiny READ from that prefill engine (one at a time per
        connection) and release it once done.

        NIXL (UCX backend) ends every posted transfer with a flush of the endpoint, and a
        flush waits for the notifications sent before it on that endpoint, which complete
        only at the peer's next progress point: a READ posted after any notification (a
        heartbeat, a lease-done notice, the previous READ's own notification) is seen done
        only then, however long ago the notification went. A READ that flushed the endpoint
        since clears that, so the waiting request's READ (by then usually confirmed, so it is
        posted with its notification and the load ends in that progress point) completes
        inside its post. After a load's own notifications (its heartbeat, its done notice) no
        flush is posted: an optimistic READ waits for P's acknowledgement anyway, which comes
        at the same progress point of P as the flush would complete, and the flush's post
        costs D about as much as it would save there. This READ moves
        ``_FLUSH_BYTES`` from the start of the engine's first registered region into a scratch
        buffer: it reads nothing of value and touches no KV block, so no lease is involved.
        Off with ``flush_endpoints`` false and on transports with ``access_control`` (the
        holder would refuse a READ outside its leases)."""
        if not self._flushes:
            return
        self._poll_flushes()
        for peer, fl in list(self._flushes.items()):
            if fl.handle is not None or not fl.dirty:
                continue
            entry = fl.entry
            if (
                entry.peer != peer
                or entry.state is not PeerState.READY
                or entry.remote is None
                or self._flush_local is None
            ):
                del self._flushes[peer]  # the connection went; a new one starts clean
                continue
            try:
                if fl.remote is None:
                    region = entry.remote.layout.regions[0]
                    fl.remote = self._transport.prepare_remote(
                        peer,
                        BlockLayout(
                            regions=[region],
                            block_lens=[_FLUSH_BYTES],
                            num_blocks=1,
                        ),
                    )
                fl.handle = self._transport.post(Op.READ, self._flush_local, [0], fl.remote, [0])
            except (TransportError, ValueError):
                self._count("endpoint_flush_failures")
                del self._flushes[peer]
                continue
            fl.dirty = False
            self._count("endpoint_flushes")

    def _poll_flushes(self) -> None:
        # Flush READs that completed are released (a READ posted after this completes inside
        # its post, if no notification went since); a failed one drops its connection's
        # record (a new one starts with the next notification).
        for peer, fl in list(self._flushes.items()):
            if fl.handle is None:
                continue
            st = self._transport.poll(fl.handle)
            if st.state is XferState.PENDING:
                continue
            self._transport.release(fl.handle)
            fl.handle = None
            if st.state is XferState.FAILED:
                self._count("endpoint_flush_failures")
                del self._flushes[peer]

    def _head_units(
        self,
        heads: HeadSlice,
        addr: RemoteEngineAddr,
        entry: RemoteEngine,
        local: list[int],
        remote: list[int],
    ) -> tuple[LayoutHandle, LayoutHandle, list[int], list[int]]:
        assert self._local is not None
        assert entry.remote is not None
        assert entry.peer is not None
        num_kv_heads = self._engine.num_kv_heads
        assert num_kv_heads is not None
        bs = self._engine.block_size
        unit = unit_heads(self._rank, self._engine.world_size, addr.tp_size, num_kv_heads)
        theirs = len(kv_heads_of(heads.p_rank, addr.tp_size, num_kv_heads))
        lh = self._unit_handles.get((None, unit))
        if lh is None:
            layout = _unit_layout(self._local.layout, bs, self._local_heads, unit, "this rank's")
            lh = self._unit_handles[(None, unit)] = self._transport.prepare_local(layout)
        rlayout = _unit_layout(entry.remote.layout, bs, theirs, unit, "the prefill rank's")
        if rlayout.block_lens != lh.layout.block_lens:
            raise ValueError(
                f"a head of the prefill rank's blocks is {rlayout.block_lens[0] // unit} bytes "
                f"per token, here {lh.layout.block_lens[0] // unit}: the engines' KV dtypes or "
                "head sizes differ"
            )
        rh = self._transport.prepare_remote(entry.peer, rlayout)
        n = len(heads)
        return (
            lh,
            rh,
            slice_units(local, bs, self._local_heads, heads.d_offset, n, unit),
            slice_units(remote, bs, theirs, heads.p_offset, n, unit),
        )

    def _regrouped(
        self, spec: PDLoad, heads: HeadSlice | None, entry: RemoteEngine
    ) -> tuple[LayoutHandle, LayoutHandle, list[int], list[int]]:
        """The handles and units that move ``spec``'s tokens from the remote engine's blocks
        of ``spec.remote_block_size`` tokens into this engine's (:mod:`kvframe.core.blocksize`):
        chunks of ``min`` of both sizes of one K or V (all this rank's heads), or, with a head
        slice of heterogeneous tensor parallelism, runs of ``unit`` heads of one token."""
        assert self._local is not None
        assert entry.remote is not None
        assert entry.peer is not None
        assert self._kv_facts is not None
        bd, bp = self._engine.block_size, spec.remote_block_size
        order = self._kv_facts.order
        start, stop = spec.load_start, spec.load_stop
        lfirst, rfirst = start // bd * bd, start // bp * bp
        if len(spec.local_block_ids) != 1 or len(spec.remote_block_ids) != 1:
            raise ValueError(
                f"{len(spec.local_block_ids)} local and {len(spec.remote_block_ids)} remote KV "
                "groups; blocks of different sizes are regrouped for one KV group only"
            )
        runs = token_runs(
            start,
            stop,
            spec.local_block_ids[0],
            bd,
            lfirst,
            spec.remote_block_ids[0],
            bp,
            rfirst,
        )
        if heads is None:
            if token_axis(order) is None:
                raise ValueError(f"a {order} cache cannot be cut into token ranges")
            chunk = chunk_of(bd, bp, start, lfirst, rfirst)
            rows = 2 if order == "NHD" else 2 * self._local_heads
            key = f"tokens/{rows * bd // chunk}"
            lh = self._unit_handles.get((key, 0))
            if lh is None:
                layout = _cut_layout(self._local.layout, rows * bd // chunk, "this engine's")
                lh = self._unit_handles[(key, 0)] = self._transport.prepare_local(layout)
            rlayout = _cut_layout(entry.remote.layout, rows * bp // chunk, "the prefill engine's")
            local, remote = chunk_units(runs, order, bd, bp, chunk, self._local_heads)
        else:
            num_kv_heads = self._engine.num_kv_heads
            assert num_kv_heads is not None
            tp = spec.remote.tp_size
            unit = unit_heads(self._rank, self._engine.world_size, tp, num_kv_heads)
            theirs = len(kv_heads_of(heads.p_rank, tp, num_kv_heads))
            key = f"heads/{bd}"
            lh = self._unit_handles.get((key, unit))
            if lh is None:
                layout = _unit_layout(
                    self._local.layout, bd, self._local_heads, unit, "this rank's"
                )
                lh = self._unit_handles[(key, unit)] = self._transport.prepare_local(layout)
            rlayout = _unit_layout(entry.remote.layout, bp, theirs, unit, "the prefill rank's")
            local, remote = head_units(
                runs,
                bd,
                bp,
                self._local_heads,
                theirs,
                heads.d_offset,
                heads.p_offset,
                len(heads),
                unit,
            )
        if rlayout.block_lens != lh.layout.block_lens:
            raise ValueError(
                f"a unit of the prefill engine's blocks is {rlayout.block_lens[0]} bytes, here "
                f"{lh.layout.block_lens[0]}: the engines' KV dtypes, head sizes or heads differ"
            )
        return lh, self._transport.prepare_remote(entry.peer, rlayout), local, remote

    def _zero_stale_tail(self, spec: PDLoad) -> None:
        """After a regrouped load is done: zero what the last local block holds after the
        loaded tokens (an earlier request's KV, or a chunk's over-read), every layer."""
        bd = self._engine.block_size
        assert self._kv_facts is not None
        axis = token_axis(self._kv_facts.order)
        if axis is None:
            return
        tail = stale_tail(spec.load_stop, spec.local_block_ids[0], bd, spec.load_start // bd * bd)
        if tail is None:
            return
        block, offset = tail
        for t in self._kv_tensors:
            # NHD [blocks, 2, tokens, ...] or HND [blocks, 2, heads, tokens, ...]
            t[block].narrow(axis, offset, t.shape[axis + 1] - offset).zero_()
        self._count("stale_tails_zeroed")

    def _transfer_state(self, rid: str, status: XferStatus, handle: XferHandle, now: float) -> None:
        rd = self._reads.get(rid)
        if rd is None or rd.handle is not handle or status.state is XferState.PENDING:
            return  # ended meanwhile (aborted, lost) or still moving
        if status.state is XferState.FAILED:
            err = status.error
            broken = isinstance(err, PeerUnreachableError)
            actions = self._reader.transfer_failed(rid, str(err), now, peer_broken=broken)
            if broken:
                entry = self._entry(rd.key)
                if entry is not None:
                    assert self._engines is not None
                    self._engines.mark_failed(entry, now, str(err))
            self._run(actions, now)
            return
        if rd.permute_from is not None:
            # The READ landed in staging slots, all of it (DONE): permute it into the cache's
            # destination blocks now, before the load can be reported; the slots are free
            # again after (no byte of a DONE transfer lands later).
            assert self._staging is not None
            try:
                self._permute_in(rd, rid)
            except Exception as exc:  # the blocks are then invalid: the load fails
                self._run(
                    self._reader.transfer_failed(
                        rid, f"permuting the blocks read failed: {type(exc).__name__}: {exc}", now
                    ),
                    now,
                )
                return
            finally:
                self._staging.give(rid)
                rd.permute_from = None
        engine = rd.spec.remote.engine_id
        if self._check_local is not None and rd.notice is not None:
            # An optimistic READ landed: read P's lease table before the done notice goes
            # (that notice lets P end the lease).
            self._check_lease(rid, rd, handle.peer, now)
        if rd.notice is not None:
            # An optimistic READ, or notification_after_data is False: the done notice goes
            # only now, after DONE (and after the heartbeat that followed the post)
            notice, rd.notice = rd.notice, None
            try:
                self._transport.send_notification(handle.peer, notice)
            except TransportError as exc:  # the lease then ends by expiry on the holder
                self._count("notify_failures", engine=engine)
                self._event("pd.notify_failed", engine=engine, error=str(exc))
        self._observe("bytes_read", status.nbytes, engine=engine)
        moved = status.transfer_seconds
        self._observe("transfer_seconds", moved if moved is not None else now - rd.posted_at)
        self._observe("load_wait_seconds", now - rd.posted_at)
        rd.reported = True
        self._run(self._reader.transfer_done(rid, now), now)
        check = self._checks.get(rid)
        if check is not None:  # usually done inside its post
            self._checked(rid, check, self._check_state(check), now)

    def _check_lease(self, rid: str, rd: _Read, peer: str, now: float) -> None:
        """D: an optimistic READ of load ``rid`` was seen done before P confirmed its lease:
        READ the lease's slot of P's lease table (when P has one and the load is not already
        confirmed); what it finds goes to :meth:`LeaseReader.lease_seen
        <kvframe.core.reader.LeaseReader.lease_seen>` once it completes, usually inside its
        post (``_checked``). Any failure only leaves the load waiting for P's
        acknowledgement, as without the table."""
        if self._reader.confirmed_bound(rd.key, rd.spec.remote_request_id) > now:
            return  # transfer_done will end it: nothing to prove
        self._abandon_check(rid)  # a READ again on a new connection: an older check proves less
        if not self._check_free:
            self._count("lease_checks_skipped")
            return
        entry = self._entry(rd.key)
        ref = self._tables.get(peer)
        if ref is None or ref.entry is not entry:
            ref = self._table_of(entry, peer)
            if ref is None:
                return
        slot = slot_of(slot_tag(lease_handle(rd.spec.remote_request_id)), ref.slots)
        index = self._check_free.pop()
        assert self._check_buf is not None
        assert self._check_local is not None
        self._check_buf[index] = 0
        try:
            handle = self._transport.post(Op.READ, self._check_local, [index], ref.remote, [slot])
        except (TransportError, ValueError):
            self._check_free.append(index)
            self._count("lease_check_failures")
            return
        self._checks[rid] = _Check(handle=handle, index=index, at=now)
        self._count("lease_checks_posted")

    def _table_of(self, entry: RemoteEngine | None, peer: str) -> _TableRef | None:
        # The prefill engine rank's lease table, prepared once per connection; None when it
        # advertised none (or an unusable one: then no check is ever posted to it).
        self._tables.pop(peer, None)
        if entry is None or entry.peer != peer or entry.response is None:
            return None
        table = entry.response.lease_table
        if table is None:
            return None
        n = table.num_blocks
        if (
            len(table.regions) != 1
            or table.block_lens != (ENTRY_BYTES,)
            or n & (n - 1)
            or n > MAX_SLOTS
            or table.regions[0].kind is not MemoryKind.HOST
        ):
            self._count("lease_tables_refused")
            return None
        try:
            remote = self._transport.prepare_remote(peer, table)
        except (TransportError, ValueError):
            self._count("lease_tables_refused")
            return None
        ref = _TableRef(entry=entry, remote=remote, slots=n)
        self._tables[peer] = ref
        return ref

    def _check_state(self, check: _Check) -> XferState:
        try:
            return self._transport.poll(check.handle).state
        except TransportError:
            return XferState.FAILED

    def _checked(self, rid: str, check: _Check, state: XferState, now: float) -> None:
        # A lease-table READ ended (``state``, polled before ``now`` was read, or in the
        # progress point that posted it): what it found goes to the reader; failed, it is
        # dropped (the load waits for P's acknowledgement).
        if state is XferState.PENDING or self._checks.get(rid) is not check:
            return
        self._drop_check(rid)
        if state is not XferState.DONE:
            self._count("lease_check_failures")
            return
        assert self._check_buf is not None
        found = int(self._check_buf[check.index])
        self._run(self._reader.lease_seen(rid, found, check.at, max(now, check.at)), now)

    def _abandon_check(self, rid: str) -> None:
        # Load rid's lease-table READ, if any, will never be answered: dropped and counted
        # unused (so every posted check is counted once: proven, unproven, failed or unused).
        if rid in self._checks:
            self._drop_check(rid)
            self._count("lease_checks_unused")

    def _drop_check(self, rid: str) -> None:
        # Stop and forget load rid's lease-table READ, if any; its buffer word is free again.
        check = self._checks.pop(rid, None)
        if check is not None:
            with contextlib.suppress(TransportError):
                self._transport.release(check.handle)
            self._check_free.append(check.index)

    def _stop(self, request_id: str) -> None:
        rd = self._reads.get(request_id)
        if rd is not None and rd.handle is not None:
            # Stops the transfer: when this returns no byte of it lands any more.
            self._transport.release(rd.handle)
            rd.handle = None
        if self._staging is not None:
            self._staging.give(request_id)

    def _load_ended(self, action: LoadEnded, now: float) -> None:
        sub = action.request_id
        self._uncapped.pop(sub, None)
        self._abandon_check(sub)  # ended first (P's acknowledgement came first, or it failed)
        rd = self._reads.pop(sub, None)
        if rd is not None and rd.handle is not None:
            self._transport.release(rd.handle)
            rd.handle = None
        if self._staging is not None:
            self._staging.give(sub)
        engine = self._engine_of(action.engine)
        rid = rd.parent if rd is not None and rd.parent else sub
        state, reason = action.state, action.reason
        timing = (rd.post_perf, rd.done_perf or rd.post_perf) if rd is not None else (0.0, 0.0)
        split = self._splits.get(rid)
        if split is not None:
            # One of several per-source loads: the request ends when every one has ended
            # (each stopped its transfer before its LoadEnded); the first failure stops the
            # others, and the request fails with its reason.
            split.ended[sub] = state
            if state is ReadState.DONE and timing[0]:
                first = min(split.perf[0], timing[0]) if split.perf[0] else timing[0]
                split.perf = (first, max(split.perf[1], timing[1]))
            if state not in (ReadState.DONE, ReadState.ABORTED) and split.failure is None:
                split.failure = reason or "failed"
                for other in split.subs:
                    if other not in split.ended:
                        self._run(self._reader.abort(other, now), now)
            if self._splits.get(rid) is not split or len(split.ended) < len(split.subs):
                return  # others still running, or a nested call reported the request
            del self._splits[rid]
            timing = split.perf
            if split.failure is not None:
                state, reason = ReadState.FAILED, split.failure
            elif any(st is ReadState.ABORTED for st in split.ended.values()):
                state = ReadState.ABORTED
        if (
            state is ReadState.DONE
            and rd is not None
            and rd.spec.remote_block_size not in (0, self._engine.block_size)
        ):
            # Every per-source transfer has stopped: nothing lands in the tail after this.
            self._zero_stale_tail(rd.spec)
        self._finished_recving.add(rid)
        if state is ReadState.DONE:
            self._count("loads_done", engine=engine)
            if timing[0]:
                self._timing[rid] = timing
        elif state is ReadState.ABORTED:
            self._count("loads_aborted", engine=engine)
        else:
            blocks = rd.spec.local_block_ids if rd is not None else ()
            self._fail_blocks(rid, blocks, reason or "failed", engine)

    def _reconnect(self, action: Reconnect, now: float) -> list[Action]:
        entry = self._entry(action.engine)
        if entry is None:
            return []
        assert self._engines is not None
        self._engines.reconnect(entry, now, incarnation=action.incarnation)
        self._count("reconnects", engine=action.engine)
        return self._reader.peer_lost(action.engine, now)

    # -- P, push mode: matching and writing -------------------------------------------------
    def _forget_writer_peer(self, peer: str) -> None:
        self._gone_reader_peers.append(peer)

    def _run_push(self, actions: list[PushAction], now: float) -> None:
        for action in actions:
            if isinstance(action, StartWrite):
                # Layer WRITEs made during the prefill stay watched (_poll_pre: stopped at
                # their bound or on failure) until the final WRITE is posted and takes them.
                self._writes[action.request_id] = _Write(
                    peer=action.engine,
                    lease_id=action.lease_id,
                    local_block_ids=action.local_block_ids,
                    remote_block_ids=action.remote_block_ids,
                    first_block=action.first_block,
                )
                self._run_writer(
                    self._writer.add(action.request_id, action.engine, action.lease_id, now),
                    now,
                )
            elif isinstance(action, Refuse):
                self._drop_pre(action.lease_id)
                self._count("push_refused")
                self._event(
                    "pd.push_refused", peer=action.engine[:64], reason=action.reason.name.lower()
                )
                refusal = PushRefused(lease_id=action.lease_id, reason=action.reason)
                self._send_raw(action.engine, pushwire.encode(refusal))
                # The writer never uses that lease again, whatever bound it confirmed.
                self._writer.spend(action.engine, [action.lease_id], now)
            elif isinstance(action, EndSource):
                self._finished_sending.add(action.request_id)
                self._count("push_unsent")
                self._event("pd.push_unsent", request_id=action.request_id, reason=action.reason)
            elif isinstance(action, Keepalive):
                self._run_writer(self._writer.heartbeat(action.engine, action.lease_ids, now), now)

    def _send_raw(self, peer: str, payload: bytes) -> bool:
        # To a decoder that handshook with this engine (a reader peer), sealed under its key.
        sealed = self._seal(self._peer_keys.get(peer), payload)
        if sealed is None:
            self._count("notifications_unsent")
            return False
        try:
            self._transport.send_notification(peer, sealed)
        except TransportError as exc:
            self._count("notify_failures")
            self._event("pd.notify_failed", peer=peer[:64], error=str(exc))
            return False
        return True

    def _run_writer(self, actions: list[Action], now: float) -> None:
        todo = collections.deque(actions)
        while todo:
            action = todo.popleft()
            if isinstance(action, SendMessage):
                if isinstance(action.message, wire.Heartbeat):
                    self._count("push_heartbeats_sent")
                for part in wire.split(action.message, self._max_notif - self._tag_bytes):
                    if not self._send_raw(action.engine, wire.encode(part)):
                        break
            elif isinstance(action, PostRead):
                todo.extend(self._post_write(action, now))
            elif isinstance(action, StopRead):
                wr = self._writes.get(action.request_id)
                if wr is not None:
                    # Stops the WRITEs: when this returns no byte of them lands any more.
                    self._stop_write(wr)
                    self._drop_pre(wr.lease_id)
            elif isinstance(action, LoadEnded):
                self._write_ended(action)
            # Reconnect: never asked (the writer gives no incarnation)

    def _post_write(self, action: PostRead, now: float) -> list[Action]:
        wr = self._writes[action.request_id]
        peer = wr.peer
        local_groups, remote_groups = wr.local_block_ids, wr.remote_block_ids
        pre = self._pre.pop(wr.lease_id, None)
        if pre is not None and pre.peer == peer:
            # What every layer already has needs no second write; the layer WRITEs still
            # moving become part of this one (posted under the same confirmed bound).
            skip = min(pre.written) - wr.first_block
            if skip > 0:
                local_groups = tuple(g[skip:] for g in local_groups)
                remote_groups = tuple(g[skip:] for g in remote_groups)
            wr.pre = pre.handles
        elif pre is not None:
            self._release_all(pre.handles)
        local = [b for g in local_groups for b in g]
        remote = [b for g in remote_groups for b in g]
        notice = self._seal(self._peer_keys.get(peer), wire.encode(action.notification))
        if notice is None or self._local is None:
            return self._writer.transfer_failed(
                action.request_id, "the connection to the decoder is not authenticated", now
            )
        wr.posted = True
        wr.posted_at = now
        if not local:
            # Nothing (more) to write: the notice goes once the layer WRITEs are done.
            wr.notice = notice
            self._writes_posted_now.append(action.request_id)
            return []
        t0 = time.perf_counter()
        try:
            handle = self._remote_handle(peer)
            if wr.pre or not self._transport.capabilities.notification_after_data:
                wr.notice, notice = notice, None
            wr.handle = self._transport.post(
                Op.WRITE, self._local, local, handle, remote, notification=notice
            )
        except (TransportError, ValueError) as exc:
            self._stop_write(wr)
            return self._writer.transfer_failed(
                action.request_id, f"posting the write failed: {exc}", now
            )
        self._writes_posted_now.append(action.request_id)
        self._observe("push_post_seconds", time.perf_counter() - t0)
        self._count("descriptors", wr.handle.num_descriptors)
        return []

    def _remote_handle(self, peer: str) -> LayoutHandle:
        handle = self._reader_handles.get(peer)
        if handle is None:
            layout = self._reader_layouts.get(peer)
            if layout is None:
                raise TransportError(
                    "the decoder sent no KV layout in its handshake, or one of another block "
                    "size (push mode writes whole blocks: run both engines at one block size, "
                    "or use pull mode, which regroups blocks of different sizes)"
                )
            handle = self._reader_handles[peer] = self._transport.prepare_remote(peer, layout)
        return handle

    def _release_all(self, handles: Iterable[XferHandle]) -> None:
        for h in handles:
            with contextlib.suppress(TransportError):
                self._transport.release(h)

    def _stop_write(self, wr: _Write) -> None:
        if wr.handle is not None:
            self._transport.release(wr.handle)
            wr.handle = None
        self._release_all(wr.pre)
        wr.pre = []

    def _write_status(self, wr: _Write) -> XferStatus:
        # The final WRITE and the layer WRITEs still in flight, as one transfer.
        statuses = [self._transport.poll(h) for h in wr.pre]
        if wr.handle is not None:
            statuses.append(self._transport.poll(wr.handle))
        for st in statuses:
            if st.state is XferState.FAILED:
                return st
        if any(st.state is XferState.PENDING for st in statuses):
            return XferStatus.pending()
        nbytes = sum(st.nbytes for st in statuses)
        last = statuses[-1].transfer_seconds if statuses and wr.handle is not None else None
        return XferStatus.done(nbytes, last)

    def _poll_writes(self, rids: Iterable[str]) -> list[tuple[str, XferStatus, _Write]]:
        return [
            (rid, self._write_status(wr), wr)
            for rid in rids
            if (wr := self._writes.get(rid)) is not None and wr.posted
        ]

    def _settle_writes(self) -> None:
        posted, self._writes_posted_now = self._writes_posted_now, []
        states = self._poll_writes(posted)
        if not any(st.state is not XferState.PENDING for _, st, _ in states):
            return
        later = self._clock()
        for rid, st, wr in states:
            self._write_state(rid, st, wr, later)

    def _write_state(self, rid: str, status: XferStatus, wr: _Write, now: float) -> None:
        if self._writes.get(rid) is not wr or not wr.posted or status.state is XferState.PENDING:
            return
        if status.state is XferState.FAILED:
            self._stop_write(wr)
            self._run_writer(self._writer.transfer_failed(rid, str(status.error), now), now)
            return
        wr.posted = False
        if wr.notice is not None:
            notice, wr.notice = wr.notice, None
            try:
                self._transport.send_notification(wr.peer, notice)
            except TransportError as exc:  # the decoder's lease then ends by expiry
                self._count("notify_failures")
                self._event("pd.notify_failed", peer=wr.peer[:64], error=str(exc))
        self._release_all(wr.pre)
        wr.pre = []
        self._observe("bytes_written", status.nbytes)
        moved = status.transfer_seconds
        self._observe("push_seconds", moved if moved is not None else now - wr.posted_at)
        self._run_writer(self._writer.transfer_done(rid, now), now)

    # -- P, push_layerwise: layer WRITEs during the prefill ---------------------------------
    def _write_layer(self, layer_name: str) -> None:
        i = self._layer_index.get(layer_name)
        if i is None or self._local is None:
            return
        now = self._clock()  # after the layer's compute: a bound check, read fresh
        margin = self._options.margin(self._policy)
        bs = self._engine.block_size
        nlayers = len(self._layer_index)
        for entry in self._step_progress:
            found = self._push.registration(entry.push_id)
            if found is None:
                continue
            peer, reg = found
            if self._push.fits(
                reg, entry.block_ids, entry.num_tokens, entry.prompt_digest, partial=True
            ):
                continue  # the offer will refuse it
            if self._writer.confirmed_bound(peer, reg.lease_id) - now < margin:
                continue  # not confirmed (yet): the final write carries these blocks
            pre = self._pre.get(reg.lease_id)
            if pre is None or pre.peer != peer:
                pre = self._pre[reg.lease_id] = _Pre(peer=peer, written=[0] * nlayers)
            done = entry.computed_tokens
            full = -(-done // bs) if done >= entry.num_tokens else done // bs
            lo = max(reg.first_block, pre.written[i])
            local: list[int] = []
            remote: list[int] = []
            his = []
            for pg, dg in zip(entry.block_ids, reg.groups, strict=True):
                hi = min(full, reg.first_block + len(dg), len(pg))
                his.append(hi)
                if hi > lo:
                    local += pg[lo:hi]
                    remote += dg[lo - reg.first_block : hi - reg.first_block]
            if not local:
                continue
            try:
                h = self._transport.post(
                    Op.WRITE, self._local, local, self._remote_handle(peer), remote, regions=[i]
                )
            except (TransportError, ValueError) as exc:
                self._count("push_layer_failures")
                self._event("pd.push_layer_failed", peer=peer[:64], error=str(exc))
                self._drop_pre(reg.lease_id)
                continue
            pre.handles.append(h)
            pre.written[i] = min(his)
            self._count("push_layer_writes")

    def _poll_pre(self, now: float) -> None:
        margin_end = self._writer.confirmed_bound
        for lid, pre in list(self._pre.items()):
            pending = []
            failed = False
            for h in pre.handles:
                st = self._transport.poll(h)
                if st.state is XferState.PENDING:
                    pending.append(h)
                elif st.state is XferState.FAILED:
                    failed = True
                else:
                    self._transport.release(h)
            pre.handles = pending
            if failed or (pending and margin_end(pre.peer, lid) <= now):
                # A failed layer WRITE leaves its blocks undefined, and one still moving past
                # the confirmed bound must stop: the final write then carries every block.
                self._count("push_layer_failures")
                self._drop_pre(lid)

    def _drop_pre(self, lease_id: str) -> None:
        pre = self._pre.pop(lease_id, None)
        if pre is not None:
            self._release_all(pre.handles)

    def _write_ended(self, action: LoadEnded) -> None:
        wr = self._writes.pop(action.request_id, None)
        if wr is not None:
            self._stop_write(wr)
            self._drop_pre(wr.lease_id)
        self._finished_sending.add(action.request_id)
        if action.state is ReadState.DONE:
            self._count("pushes_done")
        else:
            self._count("pushes_failed")
            self._event("pd.push_failed", request_id=action.request_id, reason=action.reason)

    # -- D, push mode: registering and holding the destination blocks ----------------------
    def _engine_busy(self, engine: str) -> bool:
        return self._receiver.engine_busy(engine) or any(
            self._reader.engine_busy(key) for key in self._keys_of(engine)
        )

    def _push_add(self, load: PDLoad, now: float) -> None:
        rid = load.request_id
        lease_id = secrets.token_hex(16)
        rank = self._remote_rank(load.remote)
        try:
            registration = pushwire.encode(
                PushRegister(
                    push_id=load.push_id,
                    lease_id=lease_id,
                    first_block=load.first_block,
                    num_tokens=load.num_tokens,
                    prompt_digest=load.prompt_digest,
                    groups=load.local_block_ids,
                )
            )
            if len(registration) + self._tag_bytes > self._max_notif:
                raise CodecError(
                    f"a registration of {len(registration)} bytes exceeds the transport's "
                    f"{self._max_notif}-byte notifications"
                )
        except (CodecError, ValueError) as exc:
            self._finished_recving.add(rid)
            self._fail_blocks(rid, load.local_block_ids, f"cannot register for push: {exc}")
            return
        self._holder.grant(lease_id, now, (rid, load.local_block_ids))
        self._push_leases.add(lease_id)
        self._count("push_registrations")
        self._index(self._push_blocks, lease_id, load.local_block_ids)
        incarnation = (
            load.remote_incarnations[rank] if rank < len(load.remote_incarnations) else None
        )
        self._pushes[rid] = _PushIn(
            lease_id=lease_id,
            engine=load.remote.engine_id,
            block_ids=load.local_block_ids,
            registration=registration,
        )
        self._receiver.add(rid, load.remote.engine_id, lease_id, now)
        entry = self._ensure(load.remote, now, load.remote_incarnations)
        if (
            entry.state is PeerState.READY
            and incarnation is not None
            and entry.incarnation not in (None, incarnation)
        ):
            # The connection is to another instance of P (it restarted): register with the
            # one the router named, over a new connection.
            self._run(
                self._reconnect(Reconnect(engine=entry.engine_id, incarnation=incarnation), now),
                now,
            )
            return
        self._push_peer(entry, now)

    def _push_peer(self, entry: RemoteEngine, now: float) -> None:
        if entry.state is PeerState.READY and entry.peer is not None:
            self._run_receiver(self._receiver.peer_ready(entry.engine_id, now), now)
        elif entry.state is PeerState.FAILED:
            self._run_receiver(
                self._receiver.peer_failed(entry.engine_id, entry.error or "failed", now), now
            )

    def _run_receiver(self, actions: list[ReceiverAction], now: float) -> None:
        todo = collections.deque(actions)
        while todo:
            action = todo.popleft()
            push = self._pushes.get(action.request_id)
            if isinstance(action, SendRegistration):
                assert push is not None
                todo.extend(self._send_registration(action.request_id, push, now))
            elif isinstance(action, Revoke):
                assert push is not None
                self._holder.revoke(action.lease_id, now)
                self._count("push_revoked")
                if push.sent_to is not None:
                    notice = wire.LeaseLost(
                        echo_seq=0,
                        holder_now=now,
                        reason=wire.LostReason.ABORTED,
                        handles=(lease_handle(action.lease_id),),
                    )
                    self._reply(push.sent_to, [notice])
            elif isinstance(action, FreeNow):
                self._lease_output(self._holder.abort(action.lease_id, now), now)
            elif isinstance(action, Fence):
                if push is not None and push.sent_to is not None:
                    self._fence(push.sent_to, action.engine, now)
            elif isinstance(action, PushEnded):
                self._push_finished(action, now)

    def _send_registration(self, rid: str, push: _PushIn, now: float) -> list[ReceiverAction]:
        entry = self._entry(push.engine)
        try:
            if entry is None or entry.peer is None or entry.state is not PeerState.READY:
                raise TransportError("no connection to the prefill engine")
            facts = entry.response.kv_layout if entry.response is not None else None
            if facts is not None and facts.block_size != self._engine.block_size:
                # P writes whole blocks into ours: only blocks of one size (pull regroups).
                return self._receiver.send_failed(
                    rid,
                    f"push mode needs one block size: the prefill engine's blocks hold "
                    f"{facts.block_size} tokens, this engine's {self._engine.block_size}; run "
                    "both engines at one block size, or pull (which regroups them)",
                    now,
                )
            sealed = self._seal(entry.session_key, push.registration)
            if sealed is None:
                raise TransportError("the connection is not authenticated")
            self._transport.send_notification(entry.peer, sealed)
        except TransportError as exc:
            return self._receiver.send_failed(rid, str(exc), now)
        push.sent_to = entry.peer
        push.sent_at = now
        return []

    def _fence(self, peer: str, engine: str, now: float) -> None:
        # A two-sided transport (UCX) serves a peer's WRITE by posting receives into the
        # blocks; removing the peer cancels them, so nothing lands after the blocks are freed.
        # (A one-sided WRITE, NIXL's, is fenced by the writer's confirmed bound alone.)
        self._count("push_fenced", engine=engine)
        self._event("pd.push_fenced", engine=engine)
        with contextlib.suppress(TransportError):
            self._transport.remove_peer(peer)
        entry = self._engines.by_peer(peer) if self._engines is not None else None
        if entry is not None:
            self._run(self._peer_broke(entry, "cut off: a push lease expired under it", now), now)

    def _push_abort(self, rid: str, now: float) -> None:
        self._run_receiver(self._receiver.abort(rid, now), now)

    def _push_tick(self, now: float) -> None:
        self._run_receiver(self._receiver.tick(now), now)

    def _on_push_message(self, sender: str, payload: bytes, now: float) -> None:
        try:
            msg = pushwire.decode(payload)
        except CodecError as exc:
            self._count("notifications_rejected")
            self._event("pd.bad_notification", sender=sender[:64], error=str(exc))
            return
        if isinstance(msg, PushRegister):
            if sender not in self._readers or not self._config.is_producer:
                self._count("notifications_unroutable")
                return
            self._count("push_registrations_received")
            self._run_push(self._push.register(sender, msg, now), now)
            return
        rid = self._receiver.request_of(msg.lease_id)
        push = self._pushes.get(rid) if rid is not None else None
        if push is None or push.sent_to != sender:
            self._count("notifications_unroutable")
            return
        reason = f"{msg.reason.text()} (push refused: {msg.reason.name.lower()})"
        self._run_receiver(self._receiver.refused(push.engine, msg.lease_id, reason, now), now)

    def _push_lease_ended(
        self, lease: Lease[tuple[str, tuple[tuple[int, ...], ...]]], now: float
    ) -> None:
        self._push_leases.discard(lease.request_id)
        self._unindex(self._push_blocks, lease)
        self._run_receiver(self._receiver.lease_ended(lease.request_id, lease.state, now), now)

    def _push_finished(self, action: PushEnded, now: float) -> None:
        push = self._pushes.pop(action.request_id, None)
        self._finished_recving.add(action.request_id)
        engine = action.engine
        if action.state is ReceiveState.DONE:
            self._count("loads_done", engine=engine)
            if push is not None and push.sent_to is not None:
                # From the registration to P's completion notice: what D waited for its KV.
                self._observe("load_wait_seconds", max(0.0, now - push.sent_at))
        elif action.state is ReceiveState.ABORTED:
            self._count("loads_aborted", engine=engine)
        else:
            blocks = push.block_ids if push is not None else ()
            self._fail_blocks(action.request_id, blocks, action.reason or "failed", engine)

    def _fail_blocks(
        self,
        rid: str,
        block_ids: tuple[tuple[int, ...], ...],
        reason: str,
        engine: str | None = None,
    ) -> None:
        for group in block_ids:
            self._invalid.update(group)
        self._failures[rid] = reason
        self._count("loads_failed", engine=engine)
        self._event("pd.load_failed", request_id=rid, reason=reason)

    # -- lifetime ------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        handles = [x.handle for x in self._reads.values()]
        handles += [x.handle for x in self._writes.values()]
        handles += [h for x in self._writes.values() for h in x.pre]
        handles += [h for x in self._pre.values() for h in x.handles]
        handles += [x.handle for x in self._flushes.values()]
        handles += [x.handle for x in self._checks.values()]
        self._flushes.clear()
        self._checks.clear()
        for h in handles:
            if h is not None:
                with contextlib.suppress(TransportError):
                    self._transport.release(h)
        self._reads.clear()
        self._writes.clear()
        if self._server is not None:
            self._server.close()
        if self._engines is not None:
            self._engines.close()
        self._transport.close()
