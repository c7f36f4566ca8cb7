"""The NIXL transport: one-sided READ/WRITE of KV blocks over NIXL (UCX), with notifications.

## Capability card

- **Memory kinds:** `HOST` (NIXL `DRAM`) and `DEVICE` (NIXL `VRAM`, with a CUDA-enabled UCX),
  through one code path chosen by `MemoryRegion.kind`. A layout holds one kind (a NIXL
  descriptor list has one memory type); mixing kinds raises `CapabilityError`.
- **Read / write:** both. `Op.READ` pulls remote blocks into local ones, `Op.WRITE` pushes.
- **Notifications:** yes, at most `MAX_NOTIFICATION_BYTES` (64 KiB) per payload, standalone or
  attached to a transfer. An attached notification reaches the peer after every byte of its
  transfer landed (NIXL sends it on completion).
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
  `transfers_done`, `transfers_failed`, `descriptors` (posted), `post_time_us` (caller time
  spent in `post`), `nixl_post_us` and `nixl_xfer_us` (NIXL's own telemetry of completed
  transfers), `notifications_sent`, `notifications_received`, `peers_rebuilt` (`add_peer`
  calls that replaced a known peer), `peers`.

**Threads.** Like every transport, one caller thread at a time. With `post_thread` on, a
private worker thread makes the NIXL calls of posting; the caller's `poll`, `progress` and
`drain_notifications` never wait for it (they answer from what is known, and the worker
collects notifications after each transfer), while `send_notification` (when nothing is
queued), `release` of a running transfer and `close` do wait for the transfer in progress.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import operator
import os
import queue
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
    TransportClosedError,
    TransportError,
)
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
    XferState,
)

__all__ = [
    "CAPABILITIES",
    "MAX_NOTIFICATION_BYTES",
    "METADATA_VERSION",
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
)
"""What :class:`NixlTransport` supports (registered with the plugin host)."""

_NIXL_MEM: Final = {MemoryKind.HOST: "DRAM", MemoryKind.DEVICE: "VRAM"}
_NIXL_OP: Final = {Op.READ: "READ", Op.WRITE: "WRITE"}
_OPTION_KEYS: Final = (
    "backends",
    "progress_thread",
    "num_threads",
    "post_thread",
    "inline_post_bytes",
    "ucx_env",
)


# -- options ---------------------------------------------------------------------------------


def _option_error(key: str, value: object, allowed: str) -> ConfigError:
    return ConfigError(f"nixl transport option {key!r} = {value!r} is invalid: {allowed}")


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
    ucx_env: Mapping[str, str] = attrs.field(factory=dict)

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> NixlOptions:
        """Validate ``options`` and build the value.

        Raises :class:`~kvframe.errors.ConfigError` naming the key, the value and what is
        allowed, for an unknown key or a value of the wrong type or range.
        """
        if not isinstance(options, Mapping):
            raise ConfigError(f"nixl transport options must be a mapping, got {options!r}")
        unknown = sorted(str(k) for k in options if k not in _OPTION_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown nixl transport option(s) {unknown}; allowed: {list(_OPTION_KEYS)}"
            )
        kw: dict[str, Any] = {}
        if "backends" in options:
            v = options["backends"]
            if (
                isinstance(v, str | bytes)
                or not isinstance(v, Sequence)
                or not v
                or not all(isinstance(b, str) and b for b in v)
            ):
                raise _option_error("backends", v, 'give a non-empty list of names, e.g. ["UCX"]')
            kw["backends"] = tuple(v)
        for key in ("progress_thread", "post_thread"):
            if key in options:
                v = options[key]
                if not isinstance(v, bool):
                    raise _option_error(key, v, "give true or false")
                kw[key] = v
        if "inline_post_bytes" in options:
            v = options["inline_post_bytes"]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise _option_error(
                    "inline_post_bytes", v, "give an integer >= 0 (0: always use the worker)"
                )
            kw["inline_post_bytes"] = v
        if "num_threads" in options:
            v = options["num_threads"]
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise _option_error("num_threads", v, "give an integer >= 0 (0: NIXL decides)")
            kw["num_threads"] = v
        if "ucx_env" in options:
            v = options["ucx_env"]
            if not isinstance(v, Mapping) or not all(
                isinstance(k, str) and k.startswith("UCX_") and isinstance(s, str)
                for k, s in v.items()
            ):
                raise _option_error(
                    "ucx_env",
                    v,
                    'give a mapping of UCX_* names to strings, e.g. {"UCX_TLS": "tcp"}',
                )
            kw["ucx_env"] = dict(v)
        return cls(**kw)


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
class _Prepared:
    """What ``LayoutHandle.native`` holds: the NIXL prepared list and who it belongs to."""

    owner: NixlTransport
    dlist: Any  # nixl_prepped_dlist_handle
    mem: str
    peer: str | None
    epoch: int
    released: bool = False


@attrs.define(eq=False)
class _Peer:
    name: str
    metadata: bytes
    epoch: int
    prepared: dict[BlockLayout, LayoutHandle] = attrs.field(factory=dict)
    inflight: set[XferHandle] = attrs.field(factory=set)


@attrs.define(eq=False)
class _Xfer:
    """What ``XferHandle.native`` holds."""

    owner: NixlTransport
    epoch: int
    handle: Any = None  # nixl_xfer_handle once made
    # Set by whoever posted (the caller or the worker); read by poll.
    posted: bool = False
    status: str = ""  # NIXL's answer to transfer(): "DONE", "PROC" or "ERR"
    native_error: Exception | None = None
    cancelled: bool = False
    telemetry: tuple[float, float] | None = None  # NIXL's (post µs, transfer µs)
    empty_notification: bool = False  # NIXL treats b"" as "no notification": send on DONE


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


_SCALAR_MAX_DESCRIPTORS: Final = 64
"""Up to this many descriptors, ids are computed with plain Python: each numpy call costs
2-5 µs with cold CPU caches (as after an engine's forward pass), more than the work itself."""


def _blocks_list(blocks: Sequence[int] | npt.NDArray[Any], side: str) -> list[int]:
    if isinstance(blocks, np.ndarray):
        if blocks.size and blocks.dtype.kind not in "iu":
            raise ValueError(f"{side}_blocks must hold integers, got dtype {blocks.dtype}")
        out: list[int] = blocks.reshape(-1).tolist()
        return out
    try:
        return [operator.index(b) for b in blocks]
    except TypeError as exc:
        raise ValueError(f"{side}_blocks must be a sequence of integers: {exc}") from exc


def _pair_ids(
    local: BlockLayout,
    remote: BlockLayout,
    local_blocks: Sequence[int] | npt.NDArray[Any],
    remote_blocks: Sequence[int] | npt.NDArray[Any],
    regions: Sequence[int] | None,
) -> tuple[list[int] | npt.NDArray[np.int32], list[int] | npt.NDArray[np.int32], int]:
    """Descriptor ids of both sides (the same values as :func:`descriptor_ids`, region-major)
    and the bytes moved, validated together.

    Small requests get Python lists (see :data:`_SCALAR_MAX_DESCRIPTORS`), larger ones int32
    numpy arrays computed vectorised. Raises ``ValueError`` for lists of different lengths,
    out-of-range blocks or regions, layouts whose region counts differ (without ``regions``)
    or block lengths that differ in a selected region.
    """
    lb = _blocks_list(local_blocks, "local")
    rb = _blocks_list(remote_blocks, "remote")
    if len(lb) != len(rb):
        raise ValueError(
            f"local_blocks has {len(lb)} entries but remote_blocks has {len(rb)}; "
            "they pair up one to one"
        )
    if regions is None:
        if local.num_regions != remote.num_regions:
            raise ValueError(
                f"local layout has {local.num_regions} regions, remote has "
                f"{remote.num_regions}; pass regions= to select matching ones"
            )
        sel = list(range(local.num_regions))
    else:
        sel = _blocks_list(regions, "region")
        limit = min(local.num_regions, remote.num_regions)
        bad = [r for r in sel if not 0 <= r < limit]
        if bad:
            raise ValueError(
                f"region index out of range: layouts have {local.num_regions} (local) and "
                f"{remote.num_regions} (remote) regions, got {bad}"
            )
    for r in sel:
        if local.block_lens[r] != remote.block_lens[r]:
            raise ValueError(
                f"region {r}: local blocks are {local.block_lens[r]} bytes, remote blocks "
                f"{remote.block_lens[r]}; they must match"
            )
    nbytes = len(lb) * sum(local.block_lens[r] for r in sel)
    for blocks, nb, side in ((lb, local.num_blocks, "local"), (rb, remote.num_blocks, "remote")):
        if blocks and (min(blocks) < 0 or max(blocks) >= nb):
            raise ValueError(
                f"{side} block index out of range: layout has {nb} blocks, "
                f"got min {min(blocks)}, max {max(blocks)}"
            )
    lnb, rnb = local.num_blocks, remote.num_blocks
    if len(lb) * len(sel) <= _SCALAR_MAX_DESCRIPTORS:
        return (
            [r * lnb + b for r in sel for b in lb],
            [r * rnb + b for r in sel for b in rb],
            nbytes,
        )
    reg = np.asarray(sel, dtype=np.int64)[:, None]
    lids = (reg * lnb + np.asarray(lb, dtype=np.int64)[None, :]).reshape(-1).astype(np.int32)
    rids = (reg * rnb + np.asarray(rb, dtype=np.int64)[None, :]).reshape(-1).astype(np.int32)
    return lids, rids, nbytes


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
        with _translate("creating the NIXL agent"), _environment(self._opts.ucx_env):
            agent = nixl_cu12.nixl_agent(name, conf)
            available = list(agent.get_plugin_list())
            missing = [b for b in self._opts.backends if b not in available]
            if missing:
                raise ConfigError(
                    f"nixl transport option 'backends' names {missing}, which this NIXL "
                    f"installation does not have; available: {available}"
                )
            for backend in self._opts.backends:
                init: dict[str, str] = {}
                if self._opts.num_threads and backend in ("UCX", "OBJ", "LIBFABRIC"):
                    init["num_threads"] = str(self._opts.num_threads)
                agent.create_backend(backend, init)
        self._agent: Any = agent
        self._closed = False
        self._lock = threading.Lock()  # serialises NIXL calls between caller and worker
        self._registered: list[tuple[MemoryRegion, Any]] = []
        self._local: dict[BlockLayout, LayoutHandle] = {}
        self._peers: dict[str, _Peer] = {}
        self._epoch = 0
        self._inbox: collections.deque[Notification] = collections.deque()
        self._orphans: list[XferHandle] = []  # handles that failed with a removed peer
        self._stats: dict[str, float] = dict.fromkeys(
            (
                "bytes",
                "transfers_posted",
                "transfers_done",
                "transfers_failed",
                "descriptors",
                "post_time_us",
                "nixl_post_us",
                "nixl_xfer_us",
                "notifications_sent",
                "notifications_received",
                "peers_rebuilt",
            ),
            0.0,
        )
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

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosedError(f"nixl transport {self._name!r} is closed")

    # -- memory --------------------------------------------------------------------------

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        """Register regions with every backend that supports their kind (one NIXL call per
        kind).

        Raises :class:`~kvframe.errors.CapabilityError` when no backend supports a kind (for
        example ``DEVICE`` memory with a UCX built without CUDA), ``ValueError`` for something
        that is not a :class:`MemoryRegion`, and :class:`~kvframe.errors.TransportError` when
        NIXL refuses. On any error nothing was registered.
        """
        self._check_open()
        regions = list(regions)
        for r in regions:
            if not isinstance(r, MemoryRegion):
                raise ValueError(f"register_memory takes MemoryRegion values, got {r!r}")
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

    def _check_registered(self, layout: BlockLayout) -> None:
        for i, (region, blen) in enumerate(zip(layout.regions, layout.block_lens, strict=True)):
            end = region.addr + blen * layout.num_blocks
            if not any(
                r.kind == region.kind
                and r.device_id == region.device_id
                and r.addr <= region.addr
                and end <= r.addr + r.length
                for r, _ in self._registered
            ):
                raise ValueError(
                    f"layout region {i} ({region.kind.value} 0x{region.addr:x}, "
                    f"{blen * layout.num_blocks} bytes) is not inside registered memory; "
                    "call register_memory with it first"
                )

    def local_metadata(self) -> bytes:
        """This endpoint's address for :meth:`add_peer`: NIXL agent metadata (it lists the
        registered memory, so export it after :meth:`register_memory`) in a small msgpack
        envelope with the transport kind, version and name."""
        self._check_open()
        with self._lock, _translate("exporting agent metadata"):
            md = self._agent.get_agent_metadata()
        packed: bytes = msgpack.packb(
            {"kvframe": "nixl", "v": METADATA_VERSION, "name": self._name, "agent": bytes(md)},
            use_bin_type=True,
        )
        return packed

    @staticmethod
    def _unpack_metadata(metadata: bytes) -> tuple[str, bytes]:
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
        return name, agent

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
        """
        self._check_open()
        if not isinstance(metadata, bytes | bytearray | memoryview):
            raise ValueError(f"add_peer takes the peer's metadata bytes, got {type(metadata)}")
        metadata = bytes(metadata)
        name, agent_md = self._unpack_metadata(metadata)
        if name == self._name:
            raise PeerUnreachableError(
                f"peer metadata names this endpoint itself ({name!r}); give every endpoint a "
                "unique name"
            )
        old = self._peers.get(name)
        # Same metadata: the same incarnation, whose memory is unchanged, so its prepared
        # layouts stay meaningful and are prepared again on the new connection below.
        keep = list(old.prepared.values()) if old is not None and old.metadata == metadata else []
        if old is not None:
            # A rebuild, even with equal metadata: the old connection may be one that failed.
            self.remove_peer(name)
            self._stats["peers_rebuilt"] += 1
        with self._lock, _translate("adding a peer", peer=name, default=PeerUnreachableError):
            try:
                loaded = _as_str(self._agent.add_remote_agent(agent_md))
            except Exception as exc:
                if _nixl_error_name(exc) != "nixlNotAllowedError":
                    raise
                # NIXL still holds an agent of this name that this transport does not know
                # (an earlier removal failed): drop it and load the new metadata.
                self._agent.remove_remote_agent(name)
                loaded = _as_str(self._agent.add_remote_agent(agent_md))
        if loaded != name:
            with contextlib.suppress(Exception), self._lock:
                self._agent.remove_remote_agent(loaded)
            raise PeerUnreachableError(
                f"peer metadata is inconsistent: envelope names {name!r}, agent blob {loaded!r}"
            )
        self._epoch += 1
        entry = _Peer(name=name, metadata=metadata, epoch=self._epoch)
        self._peers[name] = entry
        for lh in keep:
            self._reprepare(entry, lh)
        return name

    def _reprepare(self, entry: _Peer, lh: LayoutHandle) -> None:
        """Give a released remote layout handle a new NIXL list on ``entry``'s connection, so
        a caller's handles survive a rebuild with the same metadata. A list NIXL refuses
        leaves the handle released (it raises ``PeerUnreachableError`` when used)."""
        prep: _Prepared = lh.native
        descs, mem = self._descs(lh.layout)
        try:
            with self._lock:
                dlist = self._agent.prep_xfer_dlist(entry.name, descs, mem)
        except Exception:
            return
        prep.dlist, prep.epoch, prep.released = dlist, entry.epoch, False
        entry.prepared[lh.layout] = lh

    def remove_peer(self, peer: str) -> None:
        """Forget a peer: its in-flight transfers stop and poll ``FAILED`` with
        :class:`~kvframe.errors.PeerUnreachableError`, its prepared layouts are released and
        NIXL disconnects. Unknown names are ignored. Never raises for NIXL teardown errors."""
        self._check_open()
        entry = self._peers.pop(peer, None)
        if entry is None:
            return
        err = PeerUnreachableError(f"peer {peer!r} was removed")
        for h in list(entry.inflight):
            self._stop(h, err)
        with self._lock:
            for lh in entry.prepared.values():
                self._release_prepared(lh)
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(peer)

    def _release_prepared(self, lh: LayoutHandle) -> None:
        prep: _Prepared = lh.native
        if not prep.released:
            prep.released = True
            with contextlib.suppress(Exception):
                prep.dlist.release()

    def _descs(self, layout: BlockLayout) -> tuple[npt.NDArray[np.uint64], str]:
        kinds = {r.kind for r in layout.regions}
        if len(kinds) != 1:
            raise CapabilityError(
                "a NIXL descriptor list holds one memory kind; this layout mixes "
                f"{sorted(k.value for k in kinds)}: split it into one layout per kind"
            )
        nb = layout.num_blocks
        blocks = np.arange(nb, dtype=np.uint64)
        # Region-major, matching descriptor_ids: row r * num_blocks + b is block b of region r.
        parts = [
            np.stack(
                [
                    np.uint64(r.addr) + blocks * np.uint64(blen),
                    np.full(nb, blen, dtype=np.uint64),
                    np.full(nb, r.device_id, dtype=np.uint64),
                ],
                axis=1,
            )
            for r, blen in zip(layout.regions, layout.block_lens, strict=True)
        ]
        return np.concatenate(parts), _NIXL_MEM[kinds.pop()]

    def prepare_local(self, layout: BlockLayout) -> LayoutHandle:
        """Prepare (once) NIXL's descriptor list for a layout of this side's registered memory.

        Preparing an equal layout again returns the same handle. Raises ``ValueError`` when a
        region is not inside registered memory, :class:`~kvframe.errors.CapabilityError` for
        a layout mixing memory kinds, :class:`~kvframe.errors.TransportError` when NIXL
        refuses. On error nothing was prepared.
        """
        self._check_open()
        if not isinstance(layout, BlockLayout):
            raise ValueError(f"prepare_local takes a BlockLayout, got {layout!r}")
        cached = self._local.get(layout)
        if cached is not None:
            return cached
        descs, mem = self._descs(layout)
        self._check_registered(layout)
        with self._lock, _translate("preparing a local descriptor list"):
            dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, mem)
        lh = LayoutHandle(
            layout=layout, peer=None, native=_Prepared(self, dlist, mem, None, epoch=0)
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
        self._check_open()
        if not isinstance(layout, BlockLayout):
            raise ValueError(f"prepare_remote takes a BlockLayout, got {layout!r}")
        entry = self._peers.get(peer)
        if entry is None:
            raise PeerUnreachableError(
                f"unknown peer {peer!r}; add it with add_peer(metadata) first"
            )
        cached = entry.prepared.get(layout)
        if cached is not None:
            return cached
        descs, mem = self._descs(layout)
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
        lh = LayoutHandle(
            layout=layout, peer=peer, native=_Prepared(self, dlist, mem, peer, entry.epoch)
        )
        entry.prepared[layout] = lh
        return lh

    # -- transfers -----------------------------------------------------------------------

    def _own_layout(self, lh: LayoutHandle, side: str) -> _Prepared:
        prep = lh.native if isinstance(lh, LayoutHandle) else None
        if not isinstance(prep, _Prepared) or prep.owner is not self:
            raise ValueError(f"unknown {side} layout handle: it was not prepared by this transport")
        return prep

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

        Descriptor ids are computed vectorised (region-major, :func:`descriptor_ids`), so the
        cost per request does not grow with the layout. An empty block list moves nothing
        and still sends the notification. See :meth:`Transport.post` for the contract; with
        ``post_thread`` on, errors NIXL reports while posting arrive through :meth:`poll`.
        """
        t0 = time.perf_counter()
        self._check_open()
        if not isinstance(op, Op):
            raise ValueError(f"op must be Op.READ or Op.WRITE, got {op!r}")
        lp = self._own_layout(local, "local")
        rp = self._own_layout(remote, "remote")
        if lp.peer is not None:
            raise ValueError("the local handle was prepared for a peer; use prepare_local")
        if rp.peer is None or remote.peer is None:
            raise ValueError("the remote handle is local; use prepare_remote(peer, layout)")
        peer = rp.peer
        entry = self._peers.get(peer)
        if entry is None or entry.epoch != rp.epoch or rp.released:
            raise PeerUnreachableError(
                f"peer {peer!r} was removed or replaced since this remote layout was "
                "prepared; add it and prepare its layout again"
            )
        lids, rids, nbytes = _pair_ids(
            local.layout, remote.layout, local_blocks, remote_blocks, regions
        )
        notif = self._check_payload(notification)
        handle = XferHandle(op=op, peer=peer, nbytes=nbytes, num_descriptors=len(lids), native=None)
        rec = _Xfer(owner=self, epoch=entry.epoch, empty_notification=notification == b"")
        handle.native = rec
        job = (
            handle,
            _NIXL_OP[op],
            lp.dlist,
            lids,
            rp.dlist,
            rids,
            notif,
        )
        if len(lids) == 0:
            # NIXL refuses an empty request; there is nothing to move, only to notify.
            if notification is not None:
                self.send_notification(peer, notif)
            rec.posted, rec.status, rec.empty_notification = True, "DONE", False
        elif not self._post_inline(nbytes):
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
                raise _translate_exc(
                    rec.native_error,
                    doing="posting a transfer",
                    peer=peer,
                    default=TransferFailedError,
                ) from rec.native_error
        entry.inflight.add(handle)
        self._stats["transfers_posted"] += 1
        self._stats["descriptors"] += len(lids)
        self._stats["post_time_us"] += (time.perf_counter() - t0) * 1e6
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
        _, op, ldl, lids, rdl, rids, notif = job
        try:
            rec.handle = self._agent.make_prepped_xfer(op, ldl, lids, rdl, rids, notif)
            rec.status = self._agent.transfer(rec.handle)
            if rec.status == "DONE":
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
                    handle: XferHandle = body[0]
                    rec: _Xfer = handle.native
                    if not rec.cancelled:
                        self._post_native(rec, body)
                elif kind == "notif":
                    peer, payload = body
                    with contextlib.suppress(Exception):
                        self._agent.send_notif(peer, payload)
                # Progress while the caller cannot (it never waits for this lock in poll).
                self._collect_notifications()
            finally:
                if self._worker is not None:
                    self._worker.job_done()

    def _check_payload(self, payload: bytes | None) -> bytes:
        if payload is None:
            return b""
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise ValueError(f"a notification payload must be bytes, got {type(payload)}")
        payload = bytes(payload)
        if len(payload) > MAX_NOTIFICATION_BYTES:
            raise CapabilityError(
                f"notification of {len(payload)} bytes exceeds the NIXL transport's limit of "
                f"{MAX_NOTIFICATION_BYTES}; send a key and fetch large data through a transfer"
            )
        return payload

    def poll(self, handle: XferHandle) -> XferState:
        """Check a transfer. Answers ``FAILED`` (with ``handle.error``) instead of raising for
        a failed transfer; raises :class:`~kvframe.errors.TransportClosedError` for a
        released handle or a closed transport, ``ValueError`` for a foreign handle."""
        self._check_open()
        rec = self._own_xfer(handle)
        if handle.released:
            raise TransportClosedError("the transfer handle was released")
        if handle.state is not XferState.PENDING:
            return handle.state
        if not rec.posted:
            # The worker needs the GIL to finish posting; a caller spinning on poll would hold
            # it for a whole switch interval (5 ms). Releasing it once lets the worker run now.
            time.sleep(0)
            return XferState.PENDING
        if rec.native_error is not None:
            self._fail(handle, rec.native_error, "posting a transfer")
            return handle.state
        if rec.status == "PROC":
            if not self._lock.acquire(blocking=self._worker is None):
                time.sleep(0)  # the worker is inside NIXL: answer from what we know, yield
                return XferState.PENDING
            try:
                rec.status = self._agent.check_xfer_state(rec.handle)
                if rec.status == "DONE":
                    self._read_telemetry(rec)
            except Exception as exc:
                rec.native_error = exc
            finally:
                self._lock.release()
            if rec.native_error is not None:
                self._fail(handle, rec.native_error, "checking a transfer")
                return handle.state
        if rec.status == "DONE":
            self._finish(handle)
        elif rec.status != "PROC":
            self._fail(handle, None, "checking a transfer")
        return handle.state

    def _read_telemetry(self, rec: _Xfer) -> None:
        """Keep NIXL's timing of a completed transfer; the caller holds ``self._lock``."""
        with contextlib.suppress(Exception):
            tel = self._agent.get_xfer_telemetry(rec.handle)
            rec.telemetry = (float(tel.postDuration), float(tel.xferDuration))

    def _own_xfer(self, handle: XferHandle) -> _Xfer:
        rec = handle.native if isinstance(handle, XferHandle) else None
        if not isinstance(rec, _Xfer) or rec.owner is not self:
            raise ValueError("unknown transfer handle: it was not posted by this transport")
        return rec

    def _finish(self, handle: XferHandle) -> None:
        rec: _Xfer = handle.native
        if rec.telemetry is not None:
            self._stats["nixl_post_us"] += rec.telemetry[0]
            self._stats["nixl_xfer_us"] += rec.telemetry[1]
            handle.transfer_seconds = rec.telemetry[1] / 1e6
        if rec.empty_notification and handle.peer in self._peers:
            with contextlib.suppress(TransportError):
                self.send_notification(handle.peer, b"")
        handle.state = XferState.DONE
        self._stats["transfers_done"] += 1
        self._stats["bytes"] += handle.nbytes
        self._forget(handle)

    def _fail(self, handle: XferHandle, exc: Exception | None, doing: str) -> None:
        if exc is None:
            err: TransportError = TransferFailedError(
                f"{doing} with peer {handle.peer!r}: NIXL reported an error state"
            )
        else:
            err = _translate_exc(exc, doing=doing, peer=handle.peer, default=TransferFailedError)
            err.__cause__ = exc
        handle.state = XferState.FAILED
        handle.error = err
        self._stats["transfers_failed"] += 1
        self._forget(handle)

    def _forget(self, handle: XferHandle) -> None:
        entry = self._peers.get(handle.peer)
        if entry is not None:
            entry.inflight.discard(handle)

    def _stop(self, handle: XferHandle, err: TransportError) -> None:
        """Stop a pending transfer (peer removed, transport closing) and free its handle."""
        rec: _Xfer = handle.native
        rec.cancelled = True
        with self._lock:  # waits for the worker if it is posting this very transfer
            if rec.handle is not None:
                with contextlib.suppress(Exception):
                    rec.handle.release()
                rec.handle = None
        if handle.state is XferState.PENDING:
            handle.state = XferState.FAILED
            handle.error = err
            self._stats["transfers_failed"] += 1
        self._forget(handle)

    def release(self, handle: XferHandle) -> None:
        """Free the transfer's NIXL handle; a pending transfer is stopped first (NIXL aborts
        it; its destination bytes are undefined). Releasing twice is a no-op; releasing after
        :meth:`close` is a no-op too (close released everything)."""
        rec = self._own_xfer(handle)
        if handle.released:
            return
        handle.released = True
        if self._closed:
            return
        if handle.state is XferState.PENDING:
            self._stop(handle, TransferFailedError("the transfer was released while pending"))
        elif rec.handle is not None:
            with self._lock, contextlib.suppress(Exception):
                rec.handle.release()
            rec.handle = None

    # -- notifications -------------------------------------------------------------------

    def send_notification(self, peer: str, payload: bytes) -> None:
        """Send a standalone notification (best effort, see the capability card).

        Raises :class:`~kvframe.errors.CapabilityError` over :data:`MAX_NOTIFICATION_BYTES`,
        :class:`~kvframe.errors.PeerUnreachableError` for an unknown peer or one NIXL knows
        to be disconnected. With ``post_thread`` on and transfers queued, the notification is
        queued behind them so it cannot overtake them.
        """
        self._check_open()
        data = self._check_payload(payload)
        if peer not in self._peers:
            raise PeerUnreachableError(
                f"unknown peer {peer!r}; add it with add_peer(metadata) first"
            )
        if self._worker is not None and self._worker.busy:
            self._worker.submit(("notif", (peer, data)))
        else:
            with (
                self._lock,
                _translate("sending a notification", peer=peer, default=PeerUnreachableError),
            ):
                self._agent.send_notif(peer, data)
        self._stats["notifications_sent"] += 1

    def _collect_notifications(self) -> None:
        """get_new_notifs into the inbox; the caller holds ``self._lock``."""
        with contextlib.suppress(Exception):
            for sender, msgs in self._agent.get_new_notifs().items():
                who = _as_str(sender)
                for m in msgs:
                    self._inbox.append(Notification(sender=who, payload=bytes(m)))

    def progress(self) -> None:
        """Drive NIXL (``get_new_notifs``), keeping received notifications for
        :meth:`drain_notifications`. Never waits for the post worker."""
        self._check_open()
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
        return out

    def close(self) -> None:
        """Stop every pending transfer, release every handle and prepared list, forget every
        peer, deregister memory, stop the post worker and drop the NIXL agent. Always
        completes; a second call is a no-op."""
        if self._closed:
            return
        self._closed = True
        for entry in self._peers.values():
            for h in entry.inflight:
                h.native.cancelled = True  # the worker skips what it has not started
        if self._worker is not None:
            with contextlib.suppress(Exception):
                self._worker.stop()
            self._worker = None
        closed = TransportClosedError(f"nixl transport {self._name!r} was closed")
        with contextlib.suppress(Exception):
            for entry in list(self._peers.values()):
                for h in list(entry.inflight):
                    self._stop(h, closed)
                for lh in entry.prepared.values():
                    self._release_prepared(lh)
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(entry.name)
            self._peers.clear()
            for lh in self._local.values():
                self._release_prepared(lh)
            self._local.clear()
            for _, reg in self._registered:
                if reg is not None:
                    with contextlib.suppress(Exception):
                        self._agent.deregister_memory(reg)
            self._registered.clear()
        self._agent = None

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._peers)} peers"
        return f"<NixlTransport {self._name!r} {state}>"


def create(params: TransportParams) -> NixlTransport:
    """:meth:`NixlTransport.create` as a module-level callable, for places that name a factory
    as a ``"module:callable"`` string (``"kvframe_nixl.transport:create"``)."""
    return NixlTransport.create(params)
