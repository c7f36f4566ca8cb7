"""The NIXL transport: one-sided READ/WRITE of KV blocks over NIXL (UCX), with notifications.

## Capability card

- **Memory kinds:** `HOST` (NIXL `DRAM`) and `DEVICE` (NIXL `VRAM`, with a CUDA-enabled UCX),
  through one code path chosen by `MemoryRegion.kind`. A layout holds one kind (a NIXL
  descriptor list has one memory type); mixing kinds raises `CapabilityError`.
- **Read / write:** both. `Op.READ` pulls remote blocks into local ones, `Op.WRITE` pushes.
- **Notifications:** yes, at most `MAX_NOTIFICATION_BYTES` (64 KiB) per payload, standalone or
  attached to a transfer. An attached notification reaches the peer after every byte of its
  transfer landed (`notification_after_data=True`): NIXL's UCX backend sends it as an active
  message only once every READ/WRITE request of the transfer completed (ai-dynamo/nixl#252,
  merged in May 2025, well before the nixl-cu12 1.5 that `./dev` installs; before it a flush
  could let the notification overtake data on another lane). The conformance kit checks it
  by bytes, cross-process.
- **Ordering:** between one pair of endpoints, notifications arrive in the order they were
  sent (one UCX endpoint); with `post_thread` on, a standalone notification sent after a post
  is queued behind it. `drain_notifications` groups by sender. Delivery is best effort: a send
  that returned may still be lost or delayed when the peer or the link fails.
- **Cross-process:** yes; same host (UCX `cma`, shared memory) or across hosts (`tcp`, RDMA).
- **Configuration** (`TransportParams.options`, all optional; unknown keys and bad values
  raise `ConfigError` naming the key):
    - `backends` (list of str, default `["UCX"]`): NIXL backends to create; one this NIXL
      lacks is a `ConfigError`.
    - `progress_thread` (bool, default `False`): NIXL's own progress thread. Off because it
      spins a core at 100 % even when idle, halves throughput on small machines and raises
      notification latency from about 8 µs to 4 ms; with it off the caller drives progress.
    - `num_threads` (int ≥ 0, default 0): backend worker threads (UCX `num_threads`); 0 lets
      NIXL decide.
    - `post_thread` (bool, default `True`): hand each transfer to one worker thread so `post`
      returns in tens of microseconds even where NIXL's `transfer()` is synchronous (under UCX
      `cma` the copy happens inside it: 4-19 ms for 64 MiB on our two-core machines, which
      would stall the engine's step). Turn it off for backends that post asynchronously
      (RDMA, `cuda_ipc`, `tcp`) to save the hand-off; docs/nixl.md has the measurements.
    - `inline_post_bytes` (int ≥ 0, default 262144): with `post_thread` on, a request of at
      most this many bytes is still posted in the caller's thread when the worker is idle: its
      copy (about 20 µs for 256 KiB) is shorter than the hand-off to the worker (50-80 µs on
      two busy cores). 0 sends every request to the worker.
    - `merge_runs` (bool, default `False`): post a request whose blocks are adjacent on both
      sides as one NIXL descriptor per contiguous run and region (through NIXL's
      `initialize_xfer`, since a prepared list has one descriptor per block), instead of one
      per block (`make_prepped_xfer`). Off by default: under UCX `cma` the merged post costs
      about 40 µs more per request than the prepared one and the copy is no faster
      (docs/nixl.md has the figures); turn it on where each descriptor is a network operation
      (RDMA, `tcp`).
    - `notify_agent` (bool, default `True`): send notifications from a second NIXL agent,
      `<name>#notify` (its own UCX worker and endpoints), so that no notification goes on
      the endpoint this side's READs and WRITEs use: after one there, NIXL completes the
      next transfer only at the peer's next progress point instead of inside the post
      (docs/nixl.md has the figures). Per peer, and only once proven: `warm_up(peer)` ends
      with one READ through that agent, and only when it completed do notifications to the
      peer leave from it (before, or if it fails, they leave from the transport's own agent,
      as with the option off). A notification attached to a transfer is then sent by this
      transport once a `poll` (or `post` itself) sees the transfer DONE, still after every
      byte landed. Receivers report a notification agent's messages as from the transport
      itself, whichever setting either side has; a transport name ending in `#notify` is
      refused. Costs one more NIXL agent, one more `add_remote_agent` per peer, one READ
      in each warm-up, and one progress call of that agent after each send.
    - `ucx_env` (mapping of `UCX_*` names to str, default empty): UCX settings applied while
      the backends are created (UCX reads its configuration then), e.g.
      `{"UCX_TLS": "tcp", "UCX_TCP_USER_TIMEOUT": "5s"}`. Without `UCX_TCP_USER_TIMEOUT` a cut
      TCP link stalls transfers without bound.
- **Peers:** `add_peer` of a name already known is always a rebuild, with the same metadata
  or new: the old connection is torn down (`remove_remote_agent`, the peer's NIXL descriptor
  lists released, its in-flight transfers failed) and a new one made, so the next READ and
  notification use it. This is how a connection either side saw fail is recovered: NIXL never
  repairs one (after a healed partition the old connection stays dead while
  `check_remote_metadata` still answers True), so both sides re-add the other when they
  handshake again. With the same metadata (the same incarnation) the peer's prepared remote
  layouts are prepared again on the new connection and their handles keep working; with new
  metadata (a restarted peer) they are dropped and raise `PeerUnreachableError` when used.
  `remove_peer` then `add_peer` rebuilds too, and drops every prepared layout. Call
  `add_peer` again only to reconnect; it is not a cheap lookup.
- **Progress:** the caller calls `progress()` or `drain_notifications()` at least once per
  engine step and at least every millisecond while it waits for anything, *including while a
  peer connects to it*: with the progress thread off, an endpoint that is not polled never
  completes a peer's connection setup.
- **Failure:** NIXL reports failures as exceptions, translated in one place (`_translate` /
  `_translate_exc`): a dead or disconnected peer becomes `PeerUnreachableError` (`post`
  raises it, or `poll` answers `FAILED` with it; `add_peer` again, with or without
  `remove_peer` first, recovers), a backend error on one transfer `TransferFailedError`, an
  unsupported request `CapabilityError`. A peer killed mid-transfer is noticed within
  milliseconds under `cma`, and the destination blocks are then partly written. A dead peer
  that is only a target is noticed when it is next used. With `post_thread` on, errors NIXL
  raises while posting arrive through `poll` rather than from `post`.
- **Telemetry:** `stats()` keys: `bytes` (of completed transfers), `transfers_posted`,
  `transfers_done`, `transfers_failed`, `descriptors` (NIXL descriptors posted, each side;
  with `merge_runs` one per contiguous run and region), `descriptors_merged` (block
  descriptors `merge_runs` saved), `post_time_us` (caller time
  spent in `post`), `nixl_post_us` and `nixl_xfer_us` (NIXL's own telemetry of completed
  transfers), `notifications_sent`, `notifications_received`, `peers_rebuilt` (`add_peer`
  calls that replaced a known peer), `peers`, `warmups` (`warm_up` calls),
  `warmup_notifications_dropped` (peers' warm-up notifications received and dropped),
  `notify_agent_peers` (peers whose notifications leave from the notification agent).
- **Warm-up** (`warm_up=True`): each transport registers a one-page buffer of its own
  (`WARMUP_BUFFER_BYTES`) and names it, with a random 16-byte token, in its metadata
  envelope (optional keys, validated: a bad value refuses the metadata). `warm_up(peer)`
  sends the peer's token as a notification (the peer's transport drops it: its caller never
  sees it), then READs `WARMUP_BYTES` of the peer's buffer into this side's, again until one
  READ completes inside its post (at most `WARMUP_ROUNDS`). Measured (docs/nixl.md): the
  first READ on a new connection waits for the peer's progress, once or twice, while UCX
  wires the endpoint up, and the first notification costs about 0.8 ms more than later ones;
  a warm-up pays both before any real transfer. No caller memory is read or written.

**Threads.** Like every transport, one caller thread at a time. With `post_thread` on, a
private worker thread makes the NIXL calls of posting; the caller's `poll`, `progress` and
`drain_notifications` never wait for it (they answer from what is known, and the worker
collects notifications after each transfer), while `send_notification` (when nothing is
queued), `release` of a running transfer and `close` do wait for the transfer in progress.
The worker touches only a transfer's NIXL record (`_Xfer`), never the kit's `Transfer` state,
the peer table or the statistics, which belong to the caller's thread.

The contract code every transport shares (option parsing, the closed guard, payload and op
checks, descriptor pairing, the peer table with its rebuild rule, transfer records) is
`kvframe.spi.transport_kit`; this module is what is particular to NIXL.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

import attrs
import msgpack
import numpy as np
import numpy.typing as npt

from kvframe.errors import (
    CapabilityError,
    ConfigError,
    PeerUnreachableError,
    TransferFailedError,
    TransportError,
)
from kvframe.spi import transport_kit as kit
from kvframe.spi.transport import (
    BlockLayout,
    LayoutHandle,
    MemoryKind,
    MemoryRegion,
    Notification,
    Op,
    Transport,
    TransportCapabilities,
    TransportParams,
    XferHandle,
    XferStatus,
)

__all__ = [
    "CAPABILITIES",
    "MAX_NOTIFICATION_BYTES",
    "METADATA_VERSION",
    "WARMUP_BUFFER_BYTES",
    "WARMUP_BYTES",
    "NixlOptions",
    "NixlTransport",
    "create",
]

MAX_NOTIFICATION_BYTES: Final = 64 * 1024
"""Largest notification payload accepted. NIXL itself delivered 8 MiB notifications in our
tests; kvframe's control messages are well under 1 KiB, and the cap keeps a notification a
single small UCX active message that never competes with bulk data."""

METADATA_VERSION: Final = 1
"""Version of the envelope :meth:`NixlTransport.local_metadata` wraps NIXL's agent metadata in."""

CAPABILITIES: Final = TransportCapabilities(
    memory_kinds=frozenset({MemoryKind.HOST, MemoryKind.DEVICE}),
    read=True,
    write=True,
    notifications=True,
    max_notification_bytes=MAX_NOTIFICATION_BYTES,
    cross_process=True,
    ordered_notifications=True,
    notification_after_data=True,
    warm_up=True,
)
"""What :class:`NixlTransport` supports (registered with the plugin host)."""

WARMUP_BYTES: Final = 64
"""Bytes a warm-up READ moves (:meth:`NixlTransport.warm_up`): between two buffers of
:data:`WARMUP_BUFFER_BYTES` each transport registers for warm-ups alone."""
WARMUP_BUFFER_BYTES: Final = 4096
"""The size of the buffer each transport registers for warm-ups (one page)."""
WARMUP_ROUNDS: Final = 3
NOTIFY_SUFFIX: Final = "#notify"
"""With ``notify_agent`` on, a transport named ``N`` sends its notifications from a second
NIXL agent named ``N#notify``; receivers report them as from ``N``."""
"""At most this many warm-up READs, one after the other, per :meth:`NixlTransport.warm_up`
(it stops earlier at one that completes inside its post)."""

_NIXL_MEM: Final = {MemoryKind.HOST: "DRAM", MemoryKind.DEVICE: "VRAM"}
_NIXL_OP: Final = {Op.READ: "READ", Op.WRITE: "WRITE"}


# -- options ---------------------------------------------------------------------------------

_OPTIONS: Final = kit.TransportOptions(
    "nixl",
    kit.names("backends", example='["UCX"]'),
    kit.flag("progress_thread"),
    kit.integer("num_threads", minimum=0, note="0: NIXL decides"),
    kit.flag("post_thread"),
    kit.integer("inline_post_bytes", minimum=0, note="0: always use the worker"),
    kit.flag("merge_runs"),
    kit.flag("notify_agent"),
    kit.text_map("ucx_env", key_prefix="UCX_", example='{"UCX_TLS": "tcp"}'),
)


@attrs.frozen(kw_only=True)
class NixlOptions:
    """The NIXL transport's configuration (see the capability card for each key's meaning).

    Build it from ``TransportParams.options`` with :meth:`from_mapping`, which validates.
    """

    backends: tuple[str, ...] = ("UCX",)
    progress_thread: bool = False
    num_threads: int = 0
    post_thread: bool = True
    inline_post_bytes: int = 256 * 1024
    merge_runs: bool = False
    notify_agent: bool = True
    ucx_env: Mapping[str, str] = attrs.field(factory=dict)

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> NixlOptions:
        """Validate ``options`` and build the value.

        Raises :class:`~kvframe.errors.ConfigError` naming the key, the value and what is
        allowed (the closest known key for a typo), for an unknown key or a value of the
        wrong type or range.
        """
        return cls(**_OPTIONS.parse(options))


# -- the one place where NIXL's exceptions become kvframe's --------------------------------


def _nixl_error_name(exc: BaseException) -> str:
    return type(exc).__name__


def _translate_exc(
    exc: Exception, *, doing: str, peer: str | None, default: type[TransportError]
) -> TransportError:
    """Map a native NIXL exception to a kvframe error (the caller raises it ``from exc``).

    ``default`` is the class used when the exception says nothing more specific (a backend
    error while posting is a failed transfer; while registering it is a transport error).
    """
    kind = _nixl_error_name(exc)
    where = f" with peer {peer!r}" if peer is not None else ""
    if kind == "nixlRemoteDisconnectError":
        return PeerUnreachableError(
            f"{doing}{where}: the peer disconnected or died ({kind}); remove it and handshake "
            "again before reuse"
        )
    if kind == "nixlNotFoundError" and peer is not None and default is PeerUnreachableError:
        return PeerUnreachableError(f"{doing}{where}: NIXL does not know the peer ({kind})")
    if kind == "nixlNotSupportedError":
        return CapabilityError(f"{doing}{where}: not supported by the NIXL backend ({kind})")
    if kind == "nixlCancelledError":
        return TransferFailedError(f"{doing}{where}: cancelled ({kind})")
    return default(f"{doing}{where} failed: {kind}: {exc}")


@contextlib.contextmanager
def _translate(
    doing: str, *, peer: str | None = None, default: type[TransportError] = TransportError
) -> Iterator[None]:
    """Run NIXL calls; re-raise their exceptions as kvframe errors (``from`` the native one).

    kvframe's own errors and ``ValueError`` raised inside pass through unchanged.
    """
    try:
        yield
    except (TransportError, ValueError):
        raise
    except Exception as exc:
        if not type(exc).__module__.startswith("nixl") and not isinstance(exc, RuntimeError):
            raise
        raise _translate_exc(exc, doing=doing, peer=peer, default=default) from exc


# -- internal records ------------------------------------------------------------------------


@attrs.define(eq=False)
class _List:
    """The descriptor table of a prepared layout (``kit.Prepared.table``): NIXL's prepared
    list. A rebuild with the same metadata gives a remote one a new list in place."""

    dlist: Any  # nixl_prepped_dlist_handle
    mem: str
    released: bool = False


@attrs.define(eq=False)
class _Peer:
    """A peer's connection (``kit.PeerEntry.conn``): its prepared layouts and transfers."""

    name: str
    prepared: dict[BlockLayout, LayoutHandle] = attrs.field(factory=dict)
    inflight: set[kit.Transfer[_Xfer]] = attrs.field(factory=set)
    warm: Any = None  # NIXL's prepared list of the peer's warm-up buffer (None: it has none)
    warm_token: bytes | None = None  # the peer's warm-up notification (it drops it unread)
    # A transfer with the peer failed as unreachable: notifications are refused until a
    # rebuild (the notification agent's own endpoint would not know).
    unreachable: str | None = None
    # The notification agent's prepared list of the peer's warm-up buffer, and whether a READ
    # through it completed (only then do notifications to this peer leave from that agent).
    notify_warm: Any = None
    notify_ok: bool = False


@attrs.define(eq=False)
class _Xfer:
    """A transfer's NIXL side (the record of its ``kit.Transfer``); the post worker sets the
    posting fields."""

    peer: _Peer
    handle: Any = None  # nixl_xfer_handle once made
    # Set by whoever posted (the caller or the worker); read by poll.
    posted: bool = False
    status: str = ""  # NIXL's answer to transfer(): "DONE", "PROC" or "ERR"
    native_error: Exception | None = None
    cancelled: bool = False
    telemetry: tuple[float, float] | None = None  # NIXL's (post µs, transfer µs)
    # A notification to send once the transfer is seen DONE (not handed to NIXL with it):
    # b"" (NIXL takes b"" for "no notification"), or any with the notification agent on.
    deferred: bytes | None = None
    sync: bool = False  # transfer() itself answered DONE (the copy happened in the post)
    warm_job: tuple[Any, ...] | None = None  # a warm-up's job, posted again until warm
    agent: Any = None  # the NIXL agent it was posted on (None: the transport's own)
    rounds: int = 0  # warm-up READs completed so far


class _PostWorker:
    """One thread that runs queued NIXL posting calls in order (``post_thread`` on)."""

    def __init__(self, run: Any) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._run = run
        self._count_lock = threading.Lock()
        self._outstanding = 0  # jobs queued or running
        self._thread = threading.Thread(target=self._loop, name="kvframe-nixl-post", daemon=True)
        self._thread.start()

    def submit(self, job: Any) -> None:
        with self._count_lock:
            self._outstanding += 1
        self._queue.put(job)

    def job_done(self) -> None:
        with self._count_lock:
            self._outstanding -= 1

    @property
    def busy(self) -> bool:
        """Whether jobs are queued or running."""
        with self._count_lock:
            return self._outstanding > 0

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._run(job)

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()


# -- the transport ---------------------------------------------------------------------------


def _quiet_nixl_logging() -> None:
    # NIXL's Python logger writes INFO lines to *stdout* on every agent creation, which
    # corrupts machine-readable output (``kvframe bench ... --json``). Respect an explicit
    # NIXL_LOG_LEVEL; otherwise keep only warnings.
    import nixl_cu12  # noqa: F401  (NIXL configures its logger on import; adjust after)

    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def _as_str(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name


class NixlTransport(Transport):
    """A :class:`~kvframe.spi.transport.Transport` over one NIXL agent.

    Build it with :meth:`create` (what the plugin registers). The module docstring is the
    capability card: memory kinds, options, the progress rule, failure behaviour, stats keys.
    """

    capabilities = CAPABILITIES

    def __init__(self, name: str, options: NixlOptions | None = None) -> None:
        """Create the NIXL agent and its backends.

        Raises :class:`~kvframe.errors.ConfigError` for an empty name or a backend NIXL does
        not have, and :class:`~kvframe.errors.TransportError` when NIXL cannot create the
        agent. Nothing is left behind on failure.
        """
        if not isinstance(name, str) or not name:
            raise ConfigError(f"transport name must be a non-empty string, got {name!r}")
        self._name = name
        self._who = f"nixl transport {name!r}"
        self._opts = options if options is not None else NixlOptions()
        _quiet_nixl_logging()
        import nixl_cu12

        sync = (
            nixl_cu12.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT if self._opts.post_thread else None
        )
        conf = nixl_cu12.nixl_agent_config(
            enable_prog_thread=self._opts.progress_thread,
            enable_listen_thread=False,
            capture_telemetry=True,
            num_threads=self._opts.num_threads,
            backends=[],  # created below, so that a missing backend is an error, not a warning
            sync_mode=sync,
        )
        if name.endswith(NOTIFY_SUFFIX):
            raise ConfigError(
                f"nixl: the transport name {name!r} ends with {NOTIFY_SUFFIX!r}, which names "
                "a transport's notification agent: choose another name"
            )

        def new_agent(agent_name: str) -> Any:
            agent = nixl_cu12.nixl_agent(agent_name, conf)
            available = list(agent.get_plugin_list())
            missing = [b for b in self._opts.backends if b not in available]
            if missing:
                raise _OPTIONS.error(
                    "backends",
                    list(self._opts.backends),
                    f"backends this NIXL installation has ({missing} missing)",
                    f"available: {available}",
                )
            for backend in self._opts.backends:
                init: dict[str, str] = {}
                if self._opts.num_threads and backend in ("UCX", "OBJ", "LIBFABRIC"):
                    init["num_threads"] = str(self._opts.num_threads)
                agent.create_backend(backend, init)
            return agent

        with _translate("creating the NIXL agent"), _environment(self._opts.ucx_env):
            agent = new_agent(name)
            # Notifications leave through an agent of their own (its own UCX worker, so its
            # own endpoints): a notification on the endpoint the READs use makes the next
            # READ wait for the peer's progress (docs/nixl.md); from this one it does not.
            notifier = new_agent(name + NOTIFY_SUFFIX) if self._opts.notify_agent else None
            self._notifier: Any = notifier
        self._agent: Any = agent
        self._guard = kit.OpenGuard(self._who)
        self._lock = threading.Lock()  # serialises NIXL calls between caller and worker
        self._registered: list[tuple[MemoryRegion, Any]] = []
        self._local: dict[BlockLayout, LayoutHandle] = {}
        # incarnation = the peer's metadata bytes: equal metadata, the same life of the peer
        self._peers: kit.PeerTable[_Peer] = kit.PeerTable(self._who, self._teardown_peer)
        self._inbox: collections.deque[Notification] = collections.deque()
        self._stats: dict[str, float] = dict.fromkeys(
            (
                "bytes",
                "transfers_posted",
                "transfers_done",
                "transfers_failed",
                "descriptors",
                "descriptors_merged",
                "post_time_us",
                "nixl_post_us",
                "nixl_xfer_us",
                "notifications_sent",
                "notifications_received",
                "peers_rebuilt",
            ),
            0.0,
        )
        self._stats["warmups"] = 0.0
        self._warm_dropped = 0  # peers' warm-up notifications dropped (under self._lock)
        # A peer's warm-up starts with this notification, which warms the notification path
        # too; dropped on arrival. Random per transport, and only in this side's metadata.
        self._warm_token = secrets.token_bytes(16)
        # The warm-up buffer: registered for warm-up READs alone (peers read its first
        # WARMUP_BYTES, and this side's warm-ups land there); its bytes are never used.
        self._warm_buf = np.zeros(WARMUP_BUFFER_BYTES, dtype=np.uint8)
        addr = int(self._warm_buf.ctypes.data)
        reg = None
        try:
            with _translate("registering the warm-up buffer"):
                reg = agent.register_memory(_warm_row(addr, WARMUP_BUFFER_BYTES), "DRAM")
                self._warm_local = agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", _warm_row(addr, WARMUP_BYTES), "DRAM"
                )
        except TransportError:
            if reg is not None:
                with contextlib.suppress(Exception):
                    agent.deregister_memory(reg)
            raise
        self._warm_reg = reg
        self._notify_reg: Any = None
        self._notify_warm_local: Any = None
        if self._notifier is not None:
            # The notification agent reads into the same warm-up buffer: the READ that proves
            # its connection to a peer works (see warm_up).
            try:
                with _translate("registering the warm-up buffer with the notification agent"):
                    self._notify_reg = self._notifier.register_memory(
                        _warm_row(addr, WARMUP_BUFFER_BYTES), "DRAM"
                    )
                    self._notify_warm_local = self._notifier.prep_xfer_dlist(
                        "NIXL_INIT_AGENT", _warm_row(addr, WARMUP_BYTES), "DRAM"
                    )
            except TransportError:
                with contextlib.suppress(Exception):
                    agent.deregister_memory(reg)
                raise
        self._worker = _PostWorker(self._run_job) if self._opts.post_thread else None

    @classmethod
    def create(cls, params: TransportParams) -> NixlTransport:
        """The factory registered with kvframe: validates ``params.options`` (see the
        capability card) and creates the transport.

        Raises :class:`~kvframe.errors.ConfigError` for unknown or invalid options.
        """
        return cls(params.name, NixlOptions.from_mapping(params.options))

    @property
    def name(self) -> str:
        """This endpoint's name (the NIXL agent name peers see)."""
        return self._name

    @property
    def options(self) -> NixlOptions:
        """The validated options this transport was created with."""
        return self._opts

    # -- memory --------------------------------------------------------------------------

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        """Register regions with every backend that supports their kind (one NIXL call per
        kind).

        Raises :class:`~kvframe.errors.CapabilityError` when no backend supports a kind (for
        example ``DEVICE`` memory with a UCX built without CUDA), ``ValueError`` for something
        that is not a :class:`MemoryRegion`, and :class:`~kvframe.errors.TransportError` when
        NIXL refuses. On any error nothing was registered.
        """
        self._guard.check()
        regions = kit.check_regions(regions, self.capabilities, self._who)
        by_kind: dict[MemoryKind, list[MemoryRegion]] = {}
        for r in regions:
            by_kind.setdefault(r.kind, []).append(r)
        for kind in by_kind:
            seg = _NIXL_MEM[kind] + "_SEG"
            if not any(seg in self._agent.get_backend_mem_types(b) for b in self._opts.backends):
                raise CapabilityError(
                    f"no NIXL backend of {list(self._opts.backends)} supports {kind.value} "
                    f"memory ({_NIXL_MEM[kind]}) in this installation"
                )
        done: list[tuple[list[MemoryRegion], Any]] = []
        try:
            with self._lock, _translate("registering memory"):
                for kind, group in by_kind.items():
                    arr = np.array(
                        [(r.addr, r.length, r.device_id) for r in group], dtype=np.uint64
                    )
                    done.append((group, self._agent.register_memory(arr, _NIXL_MEM[kind])))
        except BaseException:
            with contextlib.suppress(Exception), self._lock:
                for _, reg in done:
                    self._agent.deregister_memory(reg)
            raise
        for group, reg in done:
            # One NIXL list per kind; deregistered once (on the first region of the group).
            self._registered.extend((r, reg if i == 0 else None) for i, r in enumerate(group))

    def local_metadata(self) -> bytes:
        """This endpoint's address for :meth:`add_peer`: NIXL agent metadata (it lists the
        registered memory, so export it after :meth:`register_memory`) in a small msgpack
        envelope with the transport kind, version and name."""
        self._guard.check()
        with self._lock, _translate("exporting agent metadata"):
            md = self._agent.get_agent_metadata()
        packed: bytes = msgpack.packb(
            {
                "kvframe": "nixl",
                "v": METADATA_VERSION,
                "name": self._name,
                "agent": bytes(md),
                # Where peers' warm-up READs read, and the notification that starts a warm-up
                # (optional keys: older peers ignore them).
                "warm": int(self._warm_buf.ctypes.data),
                "warm_token": self._warm_token,
            },
            use_bin_type=True,
        )
        return packed

    @staticmethod
    def _unpack_metadata(metadata: bytes) -> tuple[str, bytes, int | None, bytes | None]:
        try:
            env = msgpack.unpackb(metadata, raw=False)
        except Exception as exc:
            raise PeerUnreachableError(
                "peer metadata does not decode; pass the bytes of the peer's "
                "NixlTransport.local_metadata() unchanged"
            ) from exc
        if not isinstance(env, dict) or env.get("kvframe") != "nixl":
            raise PeerUnreachableError(
                "peer metadata is not from a kvframe NIXL transport; both engines must use "
                "the 'nixl' transport"
            )
        if env.get("v") != METADATA_VERSION:
            raise PeerUnreachableError(
                f"peer metadata has envelope version {env.get('v')!r}; this side reads "
                f"{METADATA_VERSION}: upgrade the older side"
            )
        name, agent = env.get("name"), env.get("agent")
        if not isinstance(name, str) or not name or not isinstance(agent, bytes):
            raise PeerUnreachableError("peer metadata lacks a name or agent blob")
        warm = env.get("warm")
        if warm is not None and (type(warm) is not int or not 0 < warm < 2**64 - WARMUP_BYTES):
            raise PeerUnreachableError(
                f"peer metadata has a warm-up buffer address of {str(warm)[:40]!r}; expected an "
                "address (a positive int): pass the peer's local_metadata() unchanged"
            )
        token = env.get("warm_token")
        if token is not None and (not isinstance(token, bytes) or len(token) != 16):
            raise PeerUnreachableError(
                "peer metadata has a malformed warm-up token (expected 16 bytes): pass the "
                "peer's local_metadata() unchanged"
            )
        return name, agent, warm, token

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata and connect afresh; returns its name.

        Adding a name that is already known is always a **rebuild**, whether the metadata is
        the same (the peer handshook again, e.g. after a failure or a healed partition) or
        new (a restarted peer): the old connection is torn down as :meth:`remove_peer` does
        (its in-flight transfers poll ``FAILED`` with
        :class:`~kvframe.errors.PeerUnreachableError`, its NIXL descriptor lists are released,
        NIXL's remote agent is removed) and the peer is loaded again, so the next transfer and
        notification use a new connection. NIXL cannot repair a connection it saw fail (a
        healed link stays dead although ``check_remote_metadata`` answers True), so a caller
        that re-handshakes needs exactly this. With the same metadata (the same incarnation,
        its memory unchanged) the peer's prepared remote layouts are prepared again on the new
        connection and their handles keep working; with new metadata they are dropped and
        raise ``PeerUnreachableError`` when used (prepare again). ``remove_peer`` then
        ``add_peer`` is the same rebuild, except that every prepared layout is dropped.

        Raises :class:`~kvframe.errors.PeerUnreachableError` when the metadata is not usable
        (not from this transport, a wrong version, one's own metadata, NIXL refuses it); the
        transport stays usable, and no peer of that name is left (a known one was removed).
        The rebuild rule itself is :class:`kvframe.spi.transport_kit.PeerTable`'s.
        """
        self._guard.check()
        if not isinstance(metadata, bytes | bytearray | memoryview):
            raise ValueError(f"add_peer takes the peer's metadata bytes, got {type(metadata)}")
        metadata = bytes(metadata)
        name, agent_md, warm, token = self._unpack_metadata(metadata)
        if name.endswith(NOTIFY_SUFFIX):
            raise PeerUnreachableError(
                f"peer metadata names {name!r}, a notification agent's name (ends with "
                f"{NOTIFY_SUFFIX!r}); pass the peer transport's own local_metadata()"
            )
        if name == self._name:
            raise PeerUnreachableError(
                f"peer metadata names this endpoint itself ({name!r}); give every endpoint a "
                "unique name"
            )

        def connect() -> _Peer:
            with self._lock, _translate("adding a peer", peer=name, default=PeerUnreachableError):
                try:
                    loaded = _as_str(self._agent.add_remote_agent(agent_md))
                except Exception as exc:
                    if _nixl_error_name(exc) != "nixlNotAllowedError":
                        raise
                    # NIXL still holds an agent of this name that this transport does not
                    # know (an earlier removal failed): drop it and load the new metadata.
                    self._agent.remove_remote_agent(name)
                    loaded = _as_str(self._agent.add_remote_agent(agent_md))
            if loaded != name:
                with contextlib.suppress(Exception), self._lock:
                    self._agent.remove_remote_agent(loaded)
                raise PeerUnreachableError(
                    f"peer metadata is inconsistent: envelope names {name!r}, agent blob {loaded!r}"
                )
            notify_warm = None
            if self._notifier is not None:
                try:
                    with (
                        self._lock,
                        _translate(
                            "adding a peer to the notification agent",
                            peer=name,
                            default=PeerUnreachableError,
                        ),
                    ):
                        with contextlib.suppress(Exception):
                            self._notifier.remove_remote_agent(name)  # a stale one, if any
                        self._notifier.add_remote_agent(agent_md)
                        if warm is not None:
                            with contextlib.suppress(Exception):
                                notify_warm = self._notifier.prep_xfer_dlist(
                                    name, _warm_row(warm, WARMUP_BYTES), "DRAM"
                                )
                except PeerUnreachableError:
                    with contextlib.suppress(Exception), self._lock:
                        self._agent.remove_remote_agent(name)
                    raise
            conn = _Peer(name=name, warm_token=token, notify_warm=notify_warm)
            if warm is not None:
                # The peer's warm-up buffer, prepared now so a warm-up costs one post. NIXL
                # refuses an address outside the peer's registered memory: no warm-ups then.
                with contextlib.suppress(Exception), self._lock:
                    conn.warm = self._agent.prep_xfer_dlist(
                        name, _warm_row(warm, WARMUP_BYTES), "DRAM"
                    )
            return conn

        # A rebuild, even with equal metadata: the old connection may be one that failed.
        added = self._peers.add(name, metadata, connect)
        self._stats["peers_rebuilt"] = float(self._peers.rebuilds)
        if added.layouts_kept and added.replaced is not None:
            # The same incarnation, its memory unchanged: its prepared layouts stay
            # meaningful and get new NIXL lists on the new connection.
            for lh in added.replaced.conn.prepared.values():
                self._reprepare(added.entry.conn, lh)
        return name

    def _reprepare(self, peer: _Peer, lh: LayoutHandle) -> None:
        """Give a released remote layout handle a new NIXL list on ``peer``'s connection, so
        a caller's handles survive a rebuild with the same metadata. A list NIXL refuses
        leaves the handle released (it raises ``PeerUnreachableError`` when used)."""
        nl: _List = lh.native.table
        descs, mem = _descs(lh.layout)
        try:
            with self._lock:
                dlist = self._agent.prep_xfer_dlist(peer.name, descs, mem)
        except Exception:
            return
        nl.dlist, nl.released = dlist, False
        peer.prepared[lh.layout] = lh

    def remove_peer(self, peer: str) -> None:
        """Forget a peer: its in-flight transfers stop and poll ``FAILED`` with
        :class:`~kvframe.errors.PeerUnreachableError`, its prepared layouts are released (and
        refused from now on, also after it is added again) and NIXL disconnects. Unknown
        names are ignored. Never raises for NIXL teardown errors."""
        self._guard.check()
        self._peers.remove(peer)

    def _teardown_peer(self, peer: _Peer, why: str) -> None:
        """The peer table's teardown (a removal, or a rebuild before the new connection)."""
        err = PeerUnreachableError(f"nixl: {why}")
        for tr in list(peer.inflight):
            self._stop(tr, err)
        with self._lock:
            for lh in peer.prepared.values():
                self._release_prepared(lh)
            for dl in (peer.warm, peer.notify_warm):
                if dl is not None:
                    with contextlib.suppress(Exception):
                        dl.release()
            peer.warm = peer.notify_warm = None
            peer.notify_ok = False
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(peer.name)
            if self._notifier is not None:
                with contextlib.suppress(Exception):
                    self._notifier.remove_remote_agent(peer.name)

    def _release_prepared(self, lh: LayoutHandle) -> None:
        nl: _List = lh.native.table
        if not nl.released:
            nl.released = True
            with contextlib.suppress(Exception):
                nl.dlist.release()

    def prepare_local(self, layout: BlockLayout) -> LayoutHandle:
        """Prepare (once) NIXL's descriptor list for a layout of this side's registered memory.

        Preparing an equal layout again returns the same handle. Raises ``ValueError`` when a
        region is not inside registered memory, :class:`~kvframe.errors.CapabilityError` for
        a layout mixing memory kinds, :class:`~kvframe.errors.TransportError` when NIXL
        refuses. On error nothing was prepared.
        """
        self._guard.check()
        if not isinstance(layout, BlockLayout):
            raise ValueError(f"prepare_local takes a BlockLayout, got {layout!r}")
        cached = self._local.get(layout)
        if cached is not None:
            return cached
        descs, mem = _descs(layout)
        kit.check_inside(layout, [r for r, _ in self._registered], "this endpoint")
        with self._lock, _translate("preparing a local descriptor list"):
            dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, mem)
        lh = LayoutHandle(
            layout=layout, peer=None, native=kit.Prepared.local(self, _List(dlist, mem))
        )
        self._local[layout] = lh
        return lh

    def prepare_remote(self, peer: str, layout: BlockLayout) -> LayoutHandle:
        """Prepare (once per peer and layout) NIXL's descriptor list for a peer's layout.

        Preparing an equal layout for the same peer again returns the same handle; the
        handle becomes unusable when the peer is removed or replaced. Raises
        :class:`~kvframe.errors.PeerUnreachableError` for an unknown peer or a layout the
        peer's metadata does not cover (its memory is not registered there),
        :class:`~kvframe.errors.CapabilityError` for a layout mixing memory kinds.
        """
        self._guard.check()
        if not isinstance(layout, BlockLayout):
            raise ValueError(f"prepare_remote takes a BlockLayout, got {layout!r}")
        conn = self._peers.get(peer).conn
        cached = conn.prepared.get(layout)
        if cached is not None:
            return cached
        descs, mem = _descs(layout)
        with (
            self._lock,
            _translate(
                "preparing a remote descriptor list (is the layout inside the peer's "
                "registered memory?)",
                peer=peer,
                default=PeerUnreachableError,
            ),
        ):
            dlist = self._agent.prep_xfer_dlist(peer, descs, mem)
        native = self._peers.prepared(self, peer, _List(dlist, mem))
        lh = LayoutHandle(layout=layout, peer=peer, native=native)
        conn.prepared[layout] = lh
        return lh

    # -- transfers -----------------------------------------------------------------------

    def post(
        self,
        op: Op,
        local: LayoutHandle,
        local_blocks: Sequence[int] | npt.NDArray[Any],
        remote: LayoutHandle,
        remote_blocks: Sequence[int] | npt.NDArray[Any],
        *,
        regions: Sequence[int] | None = None,
        notification: bytes | None = None,
    ) -> XferHandle:
        """Start one prepared NIXL transfer (``make_prepped_xfer`` + ``transfer``).

        Descriptor ids come from :func:`kvframe.spi.transport_kit.check_post` (region-major,
        vectorised for large requests), so the cost per request does not grow with the
        layout. An empty block list moves nothing
        and still sends the notification. See :meth:`Transport.post` for the contract; with
        ``post_thread`` on, errors NIXL reports while posting arrive through :meth:`poll`.
        """
        t0 = time.perf_counter()
        self._guard.check()
        req = kit.check_post(
            self, self._peers, op, local, local_blocks, remote, remote_blocks,
            regions=regions, notification=notification, dtype=np.int32,
        )  # fmt: skip
        lp: _List = req.local
        rp: _List = req.remote
        peer, conn = req.peer.name, req.peer.conn
        if rp.released:
            raise PeerUnreachableError(
                f"nixl: peer {peer!r} was rebuilt but NIXL refused to prepare this remote "
                "layout again; call prepare_remote again"
            )
        lids, rids, nbytes = req.pairs.local, req.pairs.remote, req.pairs.nbytes
        notif = req.notification if req.notification is not None else b""
        rec = _Xfer(peer=conn)
        if req.notification is not None and (conn.notify_ok or notif == b""):
            # Sent by send_notification once the transfer is seen DONE (see _finish): from
            # the proven notification agent, or (b"", which NIXL takes for none) as usual.
            rec.deferred, notif = req.notification, b""
        handle, tr = kit.Transfer.post(self, rec, op=req.op, peer=peer, pairs=req.pairs)
        ndesc = len(lids)
        job: tuple[Any, ...] = (rec, _NIXL_OP[req.op], lp.dlist, lids, rp.dlist, rids, notif)
        if ndesc > 1 and self._opts.merge_runs:
            runs = kit.contiguous_runs(local.layout, remote.layout, req.pairs)
            if runs.count < ndesc:
                # Adjacent blocks become one descriptor per run and region: fewer UCX
                # operations for one extra NIXL preparation of the merged lists.
                ndesc = runs.count
                job = (rec, _NIXL_OP[req.op], *_run_descs(local.layout, remote.layout, runs))
                job = (*job, peer, notif)
        if len(lids) == 0:
            # NIXL refuses an empty request; there is nothing to move, only to notify.
            if req.notification is not None:
                self.send_notification(peer, req.notification)
            rec.posted, rec.status, rec.deferred = True, "DONE", None
        else:
            self._dispatch(rec, job, nbytes, peer)
        conn.inflight.add(tr)
        self._stats["transfers_posted"] += 1
        self._stats["descriptors"] += ndesc
        self._stats["descriptors_merged"] += len(lids) - ndesc
        self._stats["post_time_us"] += (time.perf_counter() - t0) * 1e6
        return handle

    def _dispatch(self, rec: _Xfer, job: tuple[Any, ...], nbytes: int, peer: str) -> None:
        """Post ``job`` inline or through the worker; raises what an inline post raised."""
        if not self._post_inline(nbytes):
            assert self._worker is not None
            self._worker.submit(("xfer", job))
        else:
            try:  # _post_inline took the lock
                self._post_native(rec, job)
            finally:
                self._lock.release()
            if rec.native_error is not None or rec.status == "ERR":
                self._stats["transfers_failed"] += 1
                if rec.native_error is None:
                    raise TransferFailedError(
                        f"posting a transfer with peer {peer!r}: NIXL answered ERR"
                    )
                err = _translate_exc(
                    rec.native_error,
                    doing="posting a transfer",
                    peer=peer,
                    default=TransferFailedError,
                )
                if isinstance(err, PeerUnreachableError):
                    rec.peer.unreachable = str(err)
                raise err from rec.native_error

    def warm_up(self, peer: str) -> XferHandle:
        """Send ``peer``'s warm-up token as a notification (dropped by the peer's transport),
        then READ :data:`WARMUP_BYTES` of ``peer``'s warm-up buffer into this side's until a
        READ completes inside its post (see :meth:`Transport.warm_up` and the capability
        card): the first READ on a new connection waits for UCX to wire the endpoint up, which
        needs the peer's progress (one or two of its progress points measured), and this pays
        that before any real transfer. Neither buffer holds anyone's data.

        Raises :class:`~kvframe.errors.PeerUnreachableError` for an unknown peer (or one the
        notification finds disconnected),
        :class:`~kvframe.errors.CapabilityError` when the peer's metadata named no warm-up
        buffer (a kvframe-nixl before warm-ups) or NIXL refused it. Poll and release the
        handle as any transfer's; a failure arrives as from :meth:`post`.
        """
        self._guard.check()
        conn = self._peers.get(peer).conn  # PeerUnreachableError for an unknown peer
        if conn.warm is None:
            raise CapabilityError(
                f"nixl: peer {peer!r} advertised no warm-up buffer (an older kvframe-nixl); "
                "its first transfer sets the connection up"
            )
        if conn.warm_token is not None:
            # The first notification on a connection sets its path up too (about 0.8 ms
            # measured): pay it here, first, since a READ posted after a notification waits
            # for the peer's progress and the READs below end with one that did not. The
            # peer drops it on arrival.
            self.send_notification(peer, conn.warm_token)
        pairs = kit.DescriptorPairs(local=[0], remote=[0], nbytes=WARMUP_BYTES, regions=(0,))
        rec = _Xfer(peer=conn)
        handle, tr = kit.Transfer.post(self, rec, op=Op.READ, peer=peer, pairs=pairs)
        job = (rec, "READ", self._warm_local, [0], conn.warm, [0], b"")
        rec.warm_job = job
        self._dispatch(rec, job, WARMUP_BYTES, peer)
        conn.inflight.add(tr)
        self._stats["warmups"] += 1
        return handle

    def _post_inline(self, nbytes: int) -> bool:
        """Whether to post in the caller's thread; if so, ``self._lock`` is now held.

        Inline without a worker; with one, only a request of at most ``inline_post_bytes``
        while the worker is idle (so it cannot overtake queued transfers, and its synchronous
        copy is shorter than a hand-off to the worker)."""
        if self._worker is None:
            self._lock.acquire()
            return True
        if nbytes > self._opts.inline_post_bytes or self._worker.busy:
            return False
        return self._lock.acquire(blocking=False)

    def _post_native(self, rec: _Xfer, job: tuple[Any, ...]) -> None:
        """make_prepped_xfer + transfer; the caller holds ``self._lock``. Never raises:
        a native error is kept in ``rec.native_error`` (and the native handle released)."""
        agent = self._agent_of(rec)
        try:
            if len(job) == 7:  # prepared lists and descriptor ids
                _, op, ldl, lids, rdl, rids, notif = job
                rec.handle = agent.make_prepped_xfer(op, ldl, lids, rdl, rids, notif)
            else:  # merged runs: (address, length, device) rows of both sides
                _, op, (lrows, mem), rrows, peer, notif = job
                rec.handle = self._agent.initialize_xfer(
                    op,
                    self._agent.get_xfer_descs(lrows, mem),
                    self._agent.get_xfer_descs(rrows, mem),
                    peer,
                    notif,
                )
            rec.status = agent.transfer(rec.handle)
            rec.sync = rec.status == "DONE"
            if rec.sync:
                self._read_telemetry(rec)
        except Exception as exc:
            rec.native_error = exc
            if rec.handle is not None:
                with contextlib.suppress(Exception):
                    rec.handle.release()
        rec.posted = True

    def _run_job(self, job: tuple[str, Any]) -> None:
        """The worker thread's body for one job."""
        kind, body = job
        with self._lock:
            try:
                if kind == "xfer":
                    rec: _Xfer = body[0]
                    if not rec.cancelled:
                        self._post_native(rec, body)
                elif kind == "notif":
                    peer, payload, via = body
                    with contextlib.suppress(Exception):
                        self._send_notif(peer, payload, via)
                # Progress while the caller cannot (it never waits for this lock in poll).
                self._collect_notifications()
            finally:
                if self._worker is not None:
                    self._worker.job_done()

    def poll(self, handle: XferHandle) -> XferStatus:
        """Check a transfer. Answers a ``FAILED`` status (with its ``error``) instead of
        raising for a failed transfer; raises :class:`~kvframe.errors.TransportClosedError`
        for a released handle or a closed transport, ``ValueError`` for a foreign handle. A
        ``DONE`` status carries NIXL's own transfer time (``transfer_seconds``)."""
        self._guard.check()
        tr = kit.Transfer.polling(handle, self, _Xfer)  # TransportClosedError once released
        if not tr.pending:
            return tr.status
        rec = tr.record
        if not rec.posted:
            # The worker needs the GIL to finish posting; a caller spinning on poll would hold
            # it for a whole switch interval (5 ms). Releasing it once lets the worker run now.
            time.sleep(0)
            return tr.status
        if rec.native_error is not None:
            if self._probe_failed(tr):
                return tr.status
            self._fail(tr, rec.native_error, "posting a transfer")
            return tr.status
        if rec.status == "PROC":
            if not self._lock.acquire(blocking=self._worker is None):
                time.sleep(0)  # the worker is inside NIXL: answer from what we know, yield
                return tr.status
            try:
                rec.status = self._agent_of(rec).check_xfer_state(rec.handle)
                if rec.status == "DONE":
                    self._read_telemetry(rec)
            except Exception as exc:
                rec.native_error = exc
            finally:
                self._lock.release()
            if rec.native_error is not None:
                if self._probe_failed(tr):
                    return tr.status
                self._fail(tr, rec.native_error, "checking a transfer")
                return tr.status
        if rec.status == "DONE" and rec.warm_job is not None and self._warm_again(tr):
            return tr.status
        if rec.status == "DONE":
            self._finish(tr)
        elif rec.status != "PROC" and not self._probe_failed(tr):
            self._fail(tr, None, "checking a transfer")
        return tr.status

    def _probe_failed(self, tr: kit.Transfer[_Xfer]) -> bool:
        """A warm-up's READ through the notification agent failed: the warm-up itself (the
        READs on the transport's own agent) succeeded, so it ends DONE, and notifications to
        the peer keep leaving from the transport's own agent. ``False`` for any other
        transfer."""
        rec = tr.record
        if rec.agent is None or rec.warm_job is None:
            return False
        if rec.handle is not None:
            with self._lock, contextlib.suppress(Exception):
                rec.handle.release()
            rec.handle = None
        rec.native_error, rec.status = None, "DONE"
        self._finish(tr)
        return True

    def _warm_again(self, tr: kit.Transfer[_Xfer]) -> bool:
        """A warm-up READ completed: post another one (and answer ``True``: still pending)
        unless this one completed inside its post, which under UCX ``cma`` means the
        endpoint is wired and READs no longer wait for the peer, or :data:`WARMUP_ROUNDS`
        completed (a backend whose READs always complete later: RDMA, ``tcp``). Measured
        with the peer's progress every 20-200 ms: the first READ on a new connection
        completes after one or two of the peer's progress points, and the endpoint is
        fully wired only after two."""
        rec = tr.record
        peer = rec.peer
        if rec.agent is not None:
            # The notification agent's READ completed: its connection to the peer works, so
            # notifications to the peer leave from it from now on.
            peer.notify_ok = True
            return False
        rec.rounds += 1
        if not (rec.sync or rec.rounds >= WARMUP_ROUNDS):
            job = rec.warm_job
        elif self._notifier is not None and peer.notify_warm is not None and not peer.notify_ok:
            # One READ through the notification agent proves its connection (a notification
            # there would otherwise leave unconfirmed, and a connection that never came up
            # would swallow every one of them).
            rec.agent = self._notifier
            job = (rec, "READ", self._notify_warm_local, [0], peer.notify_warm, [0], b"")
            rec.warm_job = job
        else:
            return False
        assert job is not None
        with self._lock:
            if rec.handle is not None:
                with contextlib.suppress(Exception):
                    rec.handle.release()
            rec.handle, rec.posted, rec.status, rec.sync = None, False, "", False
        try:
            self._dispatch(rec, job, WARMUP_BYTES, peer.name)
        except TransportError as exc:  # counted as a failed transfer by _dispatch
            if rec.agent is not None:
                self._stats["transfers_failed"] -= 1  # not the warm-up's failure: see poll
                self._probe_failed(tr)
                return True
            tr.fail(exc)
            peer.inflight.discard(tr)
        return True

    def _agent_of(self, rec: _Xfer) -> Any:
        """The NIXL agent ``rec`` was posted on (the notification agent for a warm-up's
        proof READ, else the transport's own)."""
        return self._agent if rec.agent is None else rec.agent

    def _read_telemetry(self, rec: _Xfer) -> None:
        """Keep NIXL's timing of a completed transfer; the caller holds ``self._lock``."""
        with contextlib.suppress(Exception):
            tel = self._agent_of(rec).get_xfer_telemetry(rec.handle)
            rec.telemetry = (float(tel.postDuration), float(tel.xferDuration))

    def _finish(self, tr: kit.Transfer[_Xfer]) -> None:
        rec = tr.record
        seconds = None
        if rec.telemetry is not None:
            self._stats["nixl_post_us"] += rec.telemetry[0]
            self._stats["nixl_xfer_us"] += rec.telemetry[1]
            seconds = rec.telemetry[1] / 1e6
        if rec.deferred is not None and rec.peer.name in self._peers:
            with contextlib.suppress(TransportError):
                self.send_notification(rec.peer.name, rec.deferred)
        tr.done(seconds)
        self._stats["transfers_done"] += 1
        self._stats["bytes"] += tr.nbytes
        rec.peer.inflight.discard(tr)

    def _fail(self, tr: kit.Transfer[_Xfer], exc: Exception | None, doing: str) -> None:
        peer = tr.record.peer.name
        if exc is None:
            err: TransportError = TransferFailedError(
                f"{doing} with peer {peer!r}: NIXL reported an error state"
            )
        else:
            err = _translate_exc(exc, doing=doing, peer=peer, default=TransferFailedError)
            err.__cause__ = exc
            if isinstance(err, PeerUnreachableError):
                tr.record.peer.unreachable = str(err)
        tr.fail(err)
        self._stats["transfers_failed"] += 1
        tr.record.peer.inflight.discard(tr)

    def _stop(self, tr: kit.Transfer[_Xfer], err: TransportError) -> None:
        """Stop a pending transfer (peer removed, transport closing) and free its handle."""
        rec = tr.record
        rec.cancelled = True
        with self._lock:  # waits for the worker if it is posting this very transfer
            if rec.handle is not None:
                with contextlib.suppress(Exception):
                    rec.handle.release()
                rec.handle = None
        if tr.fail(err):
            self._stats["transfers_failed"] += 1
        rec.peer.inflight.discard(tr)

    def release(self, handle: XferHandle) -> None:
        """Free the transfer's NIXL handle; a pending transfer is stopped first (NIXL aborts
        it; its destination bytes are undefined). Releasing twice is a no-op; releasing after
        :meth:`close` is a no-op too (close released everything)."""
        tr = kit.Transfer.of(handle, self, _Xfer)
        rec = tr.record
        if not tr.release() or self._guard.closed:
            return
        if tr.pending:
            self._stop(tr, TransferFailedError("the transfer was released while pending"))
        elif rec.handle is not None:
            with self._lock, contextlib.suppress(Exception):
                rec.handle.release()
            rec.handle = None

    # -- notifications -------------------------------------------------------------------

    def send_notification(self, peer: str, payload: bytes) -> None:
        """Send a standalone notification (best effort, see the capability card).

        Raises ``ValueError`` for a payload that is not bytes,
        :class:`~kvframe.errors.CapabilityError` over :data:`MAX_NOTIFICATION_BYTES`,
        :class:`~kvframe.errors.PeerUnreachableError` for an unknown peer or one NIXL knows
        to be disconnected. With ``post_thread`` on and transfers queued, the notification is
        queued behind them so it cannot overtake them.
        """
        self._guard.check()
        data = kit.check_notification(payload, self.capabilities, self._who)
        conn = self._peers.get(peer).conn  # PeerUnreachableError for an unknown peer
        if conn.unreachable is not None:
            raise PeerUnreachableError(
                f"nixl: not sending to {peer!r}: a transfer found it unreachable "
                f"({conn.unreachable}); add_peer again to reconnect"
            )
        via = self._notifier if conn.notify_ok else None
        if self._worker is not None and self._worker.busy:
            self._worker.submit(("notif", (peer, data, via)))
        else:
            with (
                self._lock,
                _translate("sending a notification", peer=peer, default=PeerUnreachableError),
            ):
                self._send_notif(peer, data, via)
        self._stats["notifications_sent"] += 1

    def _send_notif(self, peer: str, data: bytes, via: Any) -> None:
        """NIXL's send, from ``via`` (the notification agent, once a READ through it proved
        its connection to ``peer``: see :meth:`warm_up`) or else from the transport's own
        agent; the caller holds ``self._lock``. The notification agent is driven once right
        after, or the message waits in it until the next :meth:`progress`."""
        if via is None:
            self._agent.send_notif(peer, data)
            return
        via.send_notif(peer, data)
        with contextlib.suppress(Exception):
            via.get_new_notifs()

    def _collect_notifications(self) -> None:
        """get_new_notifs into the inbox; the caller holds ``self._lock``."""
        if self._notifier is not None:
            with contextlib.suppress(Exception):
                self._notifier.get_new_notifs()  # drives its sends; nobody notifies it
        with contextlib.suppress(Exception):
            for sender, msgs in self._agent.get_new_notifs().items():
                who = _as_str(sender)
                if who.endswith(NOTIFY_SUFFIX):
                    who = who[: -len(NOTIFY_SUFFIX)]  # a peer's notification agent: the peer
                for m in msgs:
                    payload = bytes(m)
                    if payload == self._warm_token:  # a peer's warm-up: not for callers
                        self._warm_dropped += 1
                        continue
                    self._inbox.append(Notification(sender=who, payload=payload))

    def progress(self) -> None:
        """Drive NIXL (``get_new_notifs``), keeping received notifications for
        :meth:`drain_notifications`. Never waits for the post worker."""
        self._guard.check()
        if self._lock.acquire(blocking=self._worker is None):
            try:
                self._collect_notifications()
            finally:
                self._lock.release()

    def drain_notifications(self) -> list[Notification]:
        """Every notification received since the last call (per sender in arrival order);
        also makes progress."""
        self.progress()
        out: list[Notification] = []
        while self._inbox:
            out.append(self._inbox.popleft())
        self._stats["notifications_received"] += len(out)
        return out

    # -- telemetry and lifetime ------------------------------------------------------------

    def stats(self) -> Mapping[str, float]:
        """Counters (keys listed in the capability card); a snapshot copy."""
        out = dict(self._stats)
        out["peers"] = float(len(self._peers))
        out["warmup_notifications_dropped"] = float(self._warm_dropped)
        out["notify_agent_peers"] = float(sum(1 for e in self._peers if e.conn.notify_ok))
        return out

    def close(self) -> None:
        """Stop every pending transfer, release every handle and prepared list, forget every
        peer, deregister memory, stop the post worker and drop the NIXL agent. Always
        completes; a second call is a no-op."""
        if not self._guard.close():
            return
        for entry in self._peers:
            for tr in entry.conn.inflight:
                tr.record.cancelled = True  # the worker skips what it has not started
        if self._worker is not None:
            with contextlib.suppress(Exception):
                self._worker.stop()
            self._worker = None
        with contextlib.suppress(Exception):
            # every peer's teardown: transfers stopped (their status can no longer be polled),
            # prepared lists released, NIXL's remote agents removed
            self._peers.clear("the transport was closed")
            for lh in self._local.values():
                self._release_prepared(lh)
            self._local.clear()
            for _, reg in self._registered:
                if reg is not None:
                    with contextlib.suppress(Exception):
                        self._agent.deregister_memory(reg)
            self._registered.clear()
            with contextlib.suppress(Exception):
                self._warm_local.release()
            with contextlib.suppress(Exception):
                self._agent.deregister_memory(self._warm_reg)
            if self._notifier is not None:
                with contextlib.suppress(Exception):
                    self._notify_warm_local.release()
                with contextlib.suppress(Exception):
                    self._notifier.deregister_memory(self._notify_reg)
        self._agent = None
        self._notifier = None

    def __repr__(self) -> str:
        state = "closed" if self._guard.closed else f"{len(self._peers)} peers"
        return f"<NixlTransport {self._name!r} {state}>"


def _descs(layout: BlockLayout) -> tuple[npt.NDArray[np.uint64], str]:
    """NIXL's (address, length, device) rows of a layout, region-major (row ``r * num_blocks
    + b`` is block ``b`` of region ``r``, as ``kit.block_table``), and its memory type.
    Raises :class:`~kvframe.errors.CapabilityError` for a layout mixing memory kinds."""
    kinds = {r.kind for r in layout.regions}
    if len(kinds) != 1:
        raise CapabilityError(
            "a NIXL descriptor list holds one memory kind; this layout mixes "
            f"{sorted(k.value for k in kinds)}: split it into one layout per kind"
        )
    addrs, lens = kit.block_table(layout)
    devs = np.repeat([r.device_id for r in layout.regions], layout.num_blocks)
    table = np.stack([addrs, lens, devs], axis=1).astype(np.uint64)
    return table, _NIXL_MEM[kinds.pop()]


def _run_descs(
    local: BlockLayout, remote: BlockLayout, runs: kit.Runs
) -> tuple[tuple[npt.NDArray[np.uint64], str], npt.NDArray[np.uint64]]:
    """NIXL's (address, length, device) rows of merged runs on both sides, with the memory
    type (one per layout: :func:`_descs` refused a mixed one when it was prepared)."""
    ldev = np.array([r.device_id for r in local.regions], dtype=np.int64)[runs.local_regions]
    rdev = np.array([r.device_id for r in remote.regions], dtype=np.int64)[runs.remote_regions]
    lrows = np.stack([runs.local, runs.lengths, ldev], axis=1).astype(np.uint64)
    rrows = np.stack([runs.remote, runs.lengths, rdev], axis=1).astype(np.uint64)
    return (lrows, _NIXL_MEM[local.regions[0].kind]), rrows


def _warm_row(addr: int, length: int) -> npt.NDArray[np.uint64]:
    """One (address, length, device) row of host memory: a warm-up buffer's descriptor."""
    return np.array([[addr, length, 0]], dtype=np.uint64)


def create(params: TransportParams) -> NixlTransport:
    """:meth:`NixlTransport.create` as a module-level callable, for places that name a factory
    as a ``"module:callable"`` string (``"kvframe_nixl.transport:create"``)."""
    return NixlTransport.create(params)
