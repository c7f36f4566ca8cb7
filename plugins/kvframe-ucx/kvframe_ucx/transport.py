"""The UCX transport: two-sided READ/WRITE of KV blocks and notifications over ucxx.

## Capability card

- **Memory kinds:** `HOST` only. ucxx can send from device memory, but this transport has not
  been tested on a CUDA machine, so it does not claim `DEVICE`.
- **Read / write:** both, **two-sided**. ucxx's Python API offers tag, active-message and stream
  transfers but no RMA (memory handles and remote keys exist only in its C++ API), so:
    - `Op.READ` sends a read request; **the peer serves it from its own `progress()` /
      `drain_notifications()`** by sending each requested block as a UCX tag message, which
      lands straight in the reader's destination block (the receive is posted on the
      destination memory: no staging copy). A READ therefore needs the peer's progress.
    - `Op.WRITE` asks the peer for receive slots; the peer checks the ranges against its
      registered memory, posts receives straight into the destination blocks and answers;
      then the blocks are sent. The peer's `progress()` completes it.
  Runs of blocks that are adjacent on both sides travel as one message.
- **Notifications:** yes, at most `MAX_NOTIFICATION_BYTES` (64 KiB), standalone or attached
  to a transfer; attached ones reach the peer after every byte landed
  (`notification_after_data=True`): a READ's is sent by the reader once every receive into
  its destination completed, a WRITE's is queued by the target itself when its receives into
  its memory completed, so neither can overtake the data. The conformance kit checks it by
  bytes, cross-process.
- **Ordering:** notifications between one pair of endpoints arrive in the order they were
  sent (one UCX tag stream per direction). Delivery is best effort.
- **Cross-process:** yes (same host over shared memory / `cma`, other hosts over `tcp` or RDMA,
  whatever UCX picks). Endpoints connect by UCX worker address, carried in the metadata; no
  listening socket. The first message to a peer carries this side's metadata, so the peer
  can answer without an `add_peer` of its own.
- **Progress:** all UCX work happens in the caller's thread, in `progress()` (which `poll`,
  `drain_notifications` and `release` call): it drives the UCX worker in polling mode, serves
  peers' requests and collects answers. No thread and no asyncio loop. The caller calls it at
  least once per engine step and at least every few milliseconds while *anyone* waits on this
  endpoint, including a peer reading from it.
- **Cancellation:** `release` of a pending transfer makes progress until it has stopped (the
  peer answers within its next `progress()`), at most `release_timeout` seconds; after that it
  drops the peer, which cancels every receive posted on its endpoint, so no byte lands later.
- **Peers:** `add_peer` of a known name is a rebuild (the SPI's rule): the old UCX endpoint is
  closed (cancelling every request posted on it; its transfers poll `FAILED` with
  `PeerUnreachableError`) and a new one is created. Remote layouts prepared for the same
  incarnation keep working; a restarted peer's old ones are refused. A peer's hello (the first
  message on a connection it opened) connects only when the peer is unknown, restarted or
  broken, so it never tears down a healthy connection.
- **Failure:** ucxx errors are translated in one place (`_translate`). A peer that died or
  disconnected is noticed through UCX's endpoint error handling (within milliseconds on
  loopback): its transfers poll `FAILED` with `PeerUnreachableError`, receives posted for it
  are cancelled by UCX (the destination bytes are undefined), and `post` /
  `send_notification` raise `PeerUnreachableError` until the peer is re-added with fresh
  metadata. A request the peer refuses (a range outside its registered memory) fails that
  transfer alone with `TransferFailedError`, with no byte written. Other transfers and peers
  are unaffected.
- **Access control:** yes (`access_control=True`): with `set_access_check(check)`, every peer
  READ or WRITE request is checked after the registered-memory check and before any byte
  moves; a refusal fails that transfer on the peer with `TransferFailedError` naming the
  reason (counted in `requests_refused`). The P/D connector uses it so that a reader can READ
  only the blocks of leases it claimed, and nobody can WRITE into P's cache.
- **Configuration** (`TransportParams.options`, all optional; unknown keys and bad values raise
  `ConfigError` naming the key and the value):
    - `release_timeout` (seconds > 0, default 5.0): how long `release` of a pending transfer
      waits for the peer before dropping it.
    - `ucx_config` (mapping of UCX setting names to str, default empty): UCX settings for this
      transport's UCX context, with or without the `UCX_` prefix, e.g. `{"TLS": "tcp"}`.
    - Refused, here or in the environment: `RCACHE_ENABLE` off and `UCX_MEM_MMAP_HOOK_MODE=none`.
      Without UCX's registration cache, UCX (the build inside ucxx 0.52) segfaults in worker
      progress when a peer dies while a large (rendezvous) send to it is pending.
- **Telemetry:** `stats()` keys: `bytes` (of completed transfers), `transfers_posted`,
  `transfers_done`, `transfers_failed`, `messages` (data messages posted by this side's
  requests), `requests_served` (peers' READ/WRITE requests answered), `requests_refused`
  (peers' requests the access check refused), `bytes_served`,
  `notifications_sent`, `notifications_received`, `frames_dropped` (control frames from peers
  that did not decode or were illegal), `peers`. `XferStatus.transfer_seconds` stays `None`:
  completion is seen only inside `progress()`, so a figure would measure the caller's polling;
  connectors then time from `post` to the `poll` that saw `DONE`.

**One process, one UCX binding.** Creating this transport where NIXL (`nixl_cu12`) is loaded
raises `ConfigError`: with ucxx loaded, NIXL in the same process reads wrong bytes after a
release or a peer removal (ucxx-cu12 0.52, nixl-cu12 1.5.1). Use NIXL or this transport per
process, not both.

**Threads.** One caller thread at a time, like every transport; the transport starts none.

The contract code every transport shares (option parsing, the closed guard, payload and op
checks, descriptor pairing, the peer table, transfer records) is
`kvframe.spi.transport_kit`; this module is what is particular to UCX.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import sys
import time
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
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
    AccessCheck,
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
    "UcxOptions",
    "UcxTransport",
]

MAX_NOTIFICATION_BYTES: Final = 64 * 1024
"""Largest notification payload accepted; keeps a notification a small eager UCX message."""

METADATA_VERSION: Final = 1
"""Version of the msgpack envelope :meth:`UcxTransport.local_metadata` returns."""

CAPABILITIES: Final = TransportCapabilities(
    memory_kinds=frozenset({MemoryKind.HOST}),
    read=True,
    write=True,
    notifications=True,
    max_notification_bytes=MAX_NOTIFICATION_BYTES,
    cross_process=True,
    ordered_notifications=True,
    notification_after_data=True,
    access_control=True,
)

# Tags: control frames use one tag; data messages set the top bit and carry a slot number
# allocated by the *receiving* side (so tags never collide between senders) and the message's
# index within its transfer.
_CTRL_TAG: Final = 1
_DATA_BIT: Final = 1 << 63
_INDEX_BITS: Final = 24
_MAX_MESSAGES: Final = 1 << _INDEX_BITS
_OPTIONS: Final = kit.TransportOptions(
    "ucx",
    kit.seconds("release_timeout"),
    kit.text_map("ucx_config", strip_prefix="UCX_", example='{"TLS": "tcp"}'),
)


@attrs.frozen(kw_only=True)
class UcxOptions:
    """The UCX transport's configuration (see the capability card for each key's meaning).

    Build it from ``TransportParams.options`` with :meth:`from_mapping`, which validates.
    """

    release_timeout: float = 5.0
    ucx_config: Mapping[str, str] = attrs.field(factory=dict)

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> UcxOptions:
        """Validate ``options`` and build the value.

        Raises :class:`~kvframe.errors.ConfigError` naming the key, the value and what is
        allowed (the closest known key for a typo), for an unknown key or a value of the
        wrong type or range.
        """
        return cls(**_OPTIONS.parse(options))


def _buffer(addr: int, length: int) -> memoryview:
    """A writable byte view of ``length`` bytes at ``addr`` (no copy)."""
    return memoryview((ctypes.c_char * length).from_address(addr)).cast("B")


def _inside(addr: int, length: int, regions: Sequence[MemoryRegion]) -> bool:
    return any(r.addr <= addr and addr + length <= r.addr + r.length for r in regions)


def _descs(
    layout: BlockLayout, registered: Sequence[MemoryRegion], who: str
) -> npt.NDArray[np.int64]:
    """(addr, len) rows, region-major (row ``r * num_blocks + b``), after checking the layout
    is host memory inside ``registered``."""
    for i, region in enumerate(layout.regions):
        if region.kind is not MemoryKind.HOST:
            raise CapabilityError(
                f"layout region {i} is {region.kind.value} memory; ucx moves host memory only"
            )
    kit.check_inside(layout, registered, who)
    addrs, lens = kit.block_table(layout)
    out: npt.NDArray[np.int64] = np.stack([addrs, lens], axis=1)
    return out


def _coalesce(
    ldesc: npt.NDArray[np.int64], rdesc: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Merge runs of descriptors adjacent on both sides; returns (local addrs, remote addrs,
    lengths) of the merged messages."""
    la, ra, ln = ldesc[:, 0], rdesc[:, 0], ldesc[:, 1]
    if la.size <= 1:
        return la.copy(), ra.copy(), ln.copy()
    joins = (la[1:] == la[:-1] + ln[:-1]) & (ra[1:] == ra[:-1] + ln[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    lens = np.add.reduceat(ln, starts)
    return la[starts], ra[starts], lens


class _Peer:
    def __init__(self, name: str, regions: list[MemoryRegion], ep: Any) -> None:
        self.name = name
        self.regions = regions
        self.ep = ep
        self.dead: str | None = None  # why, once the endpoint failed or was dropped
        self.hello_sent = False


class _Xfer:
    """One transfer posted by this side (the record of its ``Transfer``)."""

    def __init__(self, xid: int, op: Op, peer: _Peer, laddrs: Any, raddrs: Any, lens: Any):
        self.xid = xid
        self.op = op
        self.peer = peer
        self.laddrs: list[int] = laddrs
        self.raddrs: list[int] = raddrs
        self.lens: list[int] = lens
        self.requests: list[Any] = []  # UCX requests posted for it (receives or sends)
        self.buffers: list[Any] = []  # keeps the request buffers alive until they complete
        self.notification: bytes | None = None
        self.answer: str | None = None  # "ok", or the peer's refusal message


class _Served:
    """A peer's WRITE being received here."""

    def __init__(self, peer: _Peer, xid: int, requests: list[Any], buffers: list[Any]):
        self.peer = peer
        self.xid = xid
        self.requests = requests
        self.buffers = buffers
        self.notification: bytes | None = None
        self.nbytes = 0


class UcxTransport(Transport):
    """The ``ucx`` transport. See the module docstring for the capability card.

    Build it with :meth:`create`. Raises :class:`~kvframe.errors.ConfigError` for bad options
    or UCX settings UCX rejects.
    """

    capabilities = CAPABILITIES

    def __init__(self, params: TransportParams) -> None:
        self._opts = UcxOptions.from_mapping(params.options)
        self._who = f"ucx transport {params.name!r}"
        if "nixl_cu12" in sys.modules:
            raise ConfigError(
                "ucx transport: NIXL (nixl_cu12) is loaded in this process, and ucxx and NIXL "
                "corrupt each other's UCX state in one process (NIXL then reads wrong bytes); "
                "run the ucx transport in a process without NIXL"
            )
        unsafe = _unsafe_setting(os.environ, self._opts.ucx_config)
        if unsafe is not None:
            raise ConfigError(
                f"ucx transport: {unsafe} turns UCX's memory registration cache off, and without "
                "it UCX crashes the process (segfault in worker progress) when a peer dies while "
                "a large send to it is pending; remove that setting (the defaults keep the cache)"
            )
        ucx_api = _import_ucxx()
        self._api = ucx_api
        self._name = params.name
        try:
            self._context = ucx_api.UCXContext(
                config_dict=dict(self._opts.ucx_config), feature_flags=(ucx_api.Feature.TAG,)
            )
            self._worker = ucx_api.UCXWorker(self._context)
        except Exception as exc:
            raise _OPTIONS.error(
                "ucx_config", dict(self._opts.ucx_config), "settings this UCX accepts", str(exc)
            ) from exc
        self._address: bytes = self._worker.address.tobytes()
        self._incarnation = uuid.uuid4().hex
        self._regions: list[MemoryRegion] = []
        self._access: AccessCheck | None = None
        self._peers: kit.PeerTable[_Peer] = kit.PeerTable(self._who, self._drop_peer)
        self._xfers: dict[int, kit.Transfer[_Xfer]] = {}
        self._served: dict[int, _Served] = {}  # by receive slot
        self._sends: deque[tuple[Any, Any]] = deque()  # fire-and-forget sends in flight
        self._ctrl_recvs: deque[tuple[Any, bytearray]] = deque()
        self._inbox: list[Notification] = []
        self._ids = itertools.count(1)
        self._slots = itertools.count(1)
        self._stats: dict[str, float] = dict.fromkeys(
            (
                "bytes",
                "transfers_posted",
                "transfers_done",
                "transfers_failed",
                "messages",
                "requests_served",
                "requests_refused",
                "bytes_served",
                "notifications_sent",
                "notifications_received",
                "frames_dropped",
            ),
            0.0,
        )
        self._guard = kit.OpenGuard(self._who)

    @classmethod
    def create(cls, params: TransportParams) -> UcxTransport:
        """The factory registered with kvframe (see the class docstring for what it raises)."""
        return cls(params)

    @property
    def name(self) -> str:
        """This endpoint's name."""
        return self._name

    # -- memory and peers -------------------------------------------------------------------
    def set_access_check(self, check: AccessCheck | None) -> None:
        """Ask ``check`` before serving each peer READ or WRITE (see the card)."""
        self._guard.check()
        self._access = check

    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        """Allow peers to READ and WRITE these host regions.

        Raises :class:`~kvframe.errors.CapabilityError` for non-host memory (nothing is
        registered then).
        """
        self._guard.check()
        hint = "the ucx transport moves host memory only"
        self._regions.extend(kit.check_regions(regions, self.capabilities, self._who, hint))

    def local_metadata(self) -> bytes:
        """msgpack of version, name, incarnation, UCX worker address and registered regions."""
        self._guard.check()
        return self._metadata()

    def _metadata(self) -> bytes:
        blob: bytes = msgpack.packb(
            {
                "v": METADATA_VERSION,
                "name": self._name,
                "inc": self._incarnation,
                "addr": self._address,
                "regions": [[r.addr, r.length] for r in self._regions],
            },
            use_bin_type=True,
        )
        return blob

    def add_peer(self, metadata: bytes) -> str:
        """Create a UCX endpoint to the peer the metadata describes; a known name is rebuilt
        (its old endpoint closed first). See the SPI contract.

        Raises :class:`~kvframe.errors.PeerUnreachableError` for metadata that does not decode
        or a worker address UCX cannot reach; the transport stays usable.
        """
        self._guard.check()
        name = self._connect(metadata, rebuild=True)
        peer = self._peers.get(name).conn
        if not peer.hello_sent:
            peer.hello_sent = True
            self._send_ctrl(peer, {"k": "hello", "m": self._metadata()})
        return name

    def _connect(self, metadata: bytes, *, rebuild: bool) -> str:
        """Connect to the peer ``metadata`` names. ``rebuild`` (``add_peer``): always a new
        endpoint; without it (a peer's hello), a healthy endpoint of the same incarnation is
        kept."""
        try:
            meta = msgpack.unpackb(metadata, raw=False)
            if meta["v"] != METADATA_VERSION:
                raise ValueError(f"metadata version {meta['v']!r}, expected {METADATA_VERSION}")
            name, incarnation = str(meta["name"]), str(meta["inc"])
            address = bytes(meta["addr"])
            regions = [MemoryRegion(addr=int(a), length=int(n)) for a, n in meta["regions"]]
        except Exception as exc:
            raise PeerUnreachableError(
                f"ucx: peer metadata does not decode ({exc}); pass another ucx endpoint's "
                "local_metadata()"
            ) from exc
        old = self._peers.find(name)
        if (
            not rebuild
            and old is not None
            and old.incarnation == incarnation
            and old.conn.dead is None
        ):
            return name

        def connect() -> _Peer:
            try:
                ucx_address = self._api.UCXAddress.create_from_buffer(address)
                ep = self._worker.create_endpoint_from_worker_address(ucx_address, True)
            except Exception as exc:
                raise self._translate(exc, f"cannot reach peer {name!r}") from exc
            return _Peer(name, regions, ep)

        self._peers.add(name, incarnation, connect)
        return name

    def remove_peer(self, peer: str) -> None:
        """Close the endpoint to ``peer``; its pending transfers fail. Unknown: ignored."""
        self._guard.check()
        self._peers.remove(peer)

    def prepare_local(self, layout: BlockLayout) -> LayoutHandle:
        """Descriptors of a local layout; ``ValueError`` if not inside registered memory."""
        self._guard.check()
        table = _descs(layout, self._regions, "this endpoint")
        return LayoutHandle(layout=layout, peer=None, native=kit.Prepared.local(self, table))

    def prepare_remote(self, peer: str, layout: BlockLayout) -> LayoutHandle:
        """Descriptors of a peer's layout; ``ValueError`` if not inside its registered memory,
        :class:`~kvframe.errors.PeerUnreachableError` for an unknown or failed peer."""
        self._guard.check()
        target = self._live_peer(peer)
        table = _descs(layout, target.regions, f"peer {peer!r}")
        native = self._peers.prepared(self, peer, table)
        return LayoutHandle(layout=layout, peer=peer, native=native)

    # -- transfers --------------------------------------------------------------------------
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
        """Start a transfer (see the SPI contract and the capability card).

        Raises ``ValueError`` for malformed arguments,
        :class:`~kvframe.errors.CapabilityError` for an oversized notification,
        :class:`~kvframe.errors.PeerUnreachableError` for an unknown or failed peer and
        :class:`~kvframe.errors.TransferFailedError` when UCX refuses to post; on any error
        no handle exists and no byte moved.
        """
        self._guard.check()
        req = kit.check_post(
            self, self._peers, op, local, local_blocks, remote, remote_blocks,
            regions=regions, notification=notification,
        )  # fmt: skip
        ldesc, rdesc = req.local[req.pairs.local], req.remote[req.pairs.remote]
        notification = req.notification
        target = self._live_peer(req.peer.name)
        laddrs, raddrs, lens = _coalesce(ldesc, rdesc)
        if lens.size >= _MAX_MESSAGES:
            raise ValueError(f"a transfer may have at most {_MAX_MESSAGES - 1} messages")
        xid = next(self._ids)
        xfer = _Xfer(xid, op, target, laddrs.tolist(), raddrs.tolist(), lens.tolist())
        xfer.notification = notification
        handle, tr = kit.Transfer.post(self, xfer, op=op, peer=target.name, pairs=req.pairs)
        self._stats["transfers_posted"] += 1
        if not xfer.lens:
            # Nothing to move: done at once; a notification still travels, after "every" byte.
            self._xfers[xid] = tr
            if notification is not None:
                self._send_ctrl(target, {"k": "nt", "p": notification})
            xfer.answer = "ok"
            self._finish(tr, None)
            return handle
        try:
            if op is Op.READ:
                slot = next(self._slots)
                for i, (addr, n) in enumerate(zip(xfer.laddrs, xfer.lens, strict=True)):
                    buf = self._api_array(_buffer(addr, n))
                    xfer.buffers.append(buf)
                    xfer.requests.append(
                        target.ep.tag_recv(buf, self._api.UCXXTag(_data_tag(slot, i)))
                    )
                frame: dict[str, Any] = {"k": "rd", "x": xid, "g": slot}
            else:
                frame = {"k": "wr", "x": xid, "n": notification}
            frame["a"] = raddrs.tobytes()
            frame["l"] = lens.tobytes()
            self._send_ctrl(target, frame)
        except Exception as exc:
            err = self._translate(exc, f"cannot post {op.value} to {target.name!r}")
            if xfer.requests:
                # Receives are already posted into our memory: only dropping the endpoint
                # cancels them, so the caller can trust "no byte moved".
                self._peers.discard(target, str(err))
            raise err from exc
        self._stats["messages"] += len(xfer.lens)
        self._xfers[xid] = tr
        return handle

    def poll(self, handle: XferHandle) -> XferStatus:
        """Make progress, then answer the transfer's status. Raises
        :class:`~kvframe.errors.TransportClosedError` for a released handle."""
        self._guard.check()
        tr = kit.Transfer.polling(handle, self, _Xfer)  # TransportClosedError once released
        if tr.pending:
            self.progress()
        return tr.status

    def release(self, handle: XferHandle) -> None:
        """Forget the handle; idempotent. A pending transfer is first driven until it stops
        (at most ``release_timeout`` s; then its peer is dropped, which cancels its receives),
        so no byte lands afterwards."""
        tr = kit.Transfer.of(handle, self, _Xfer)
        if not tr.release():
            return
        xid = tr.record.xid
        if xid not in self._xfers or self._guard.closed:
            self._xfers.pop(xid, None)
            return
        deadline = time.monotonic() + self._opts.release_timeout
        while tr.pending:
            if time.monotonic() > deadline:
                self._peers.discard(tr.record.peer, "no answer to a released transfer in time")
                break
            self.progress()
        self._xfers.pop(xid, None)

    # -- notifications ----------------------------------------------------------------------
    def send_notification(self, peer: str, payload: bytes) -> None:
        """Send ``payload`` to ``peer`` (best effort). Raises
        :class:`~kvframe.errors.CapabilityError` over the size limit and
        :class:`~kvframe.errors.PeerUnreachableError` for an unknown or failed peer."""
        self._guard.check()
        data = kit.check_notification(payload, self.capabilities, self._who)
        target = self._live_peer(peer)
        self._send_ctrl(target, {"k": "nt", "p": data})
        self._stats["notifications_sent"] += 1

    def drain_notifications(self) -> list[Notification]:
        """Make progress, then return what arrived, oldest first."""
        self._guard.check()
        self.progress()
        out, self._inbox = self._inbox, []
        return out

    def progress(self) -> None:
        """Drive the UCX worker once, serve peers' requests, collect answers and failures."""
        self._guard.check()
        try:
            self._worker.progress()
        except Exception as exc:  # the worker itself failing is not recoverable per peer
            raise self._translate(exc, "UCX worker progress failed") from exc
        self._receive_ctrl()
        for entry in self._peers:
            peer = entry.conn
            if peer.dead is None and not peer.ep.alive:
                self._fail_peer(peer, f"UCX endpoint to {peer.name!r} failed (peer died?)")
        self._check_xfers()
        self._check_served()
        if self._sends:
            self._worker.progress()  # put what this call queued on the wire before returning
        self._reap_sends()

    def _reap_sends(self) -> None:
        while self._sends and self._sends[0][0].completed:
            self._sends.popleft()

    # -- telemetry and lifetime -------------------------------------------------------------
    def stats(self) -> Mapping[str, float]:
        """Counters (keys in the capability card)."""
        return {**self._stats, "peers": float(len(self._peers))}

    def close(self) -> None:
        """Close every endpoint (cancelling their requests) and drop the UCX worker; idempotent."""
        if not self._guard.close():
            return
        for entry in self._peers:
            self._close_ep(entry.conn)
        for tr in self._xfers.values():
            tr.fail(TransferFailedError(f"{self._who} was closed"))
        self._xfers.clear()
        self._peers = kit.PeerTable(self._who, self._drop_peer)  # forgotten, endpoints closed above
        self._served.clear()
        self._sends.clear()
        self._ctrl_recvs.clear()
        try:
            self._worker.cancel_inflight_requests()
            self._worker.progress()
        except Exception:  # teardown is best effort by contract
            pass

    # -- internals --------------------------------------------------------------------------
    def _api_array(self, view: memoryview | bytearray) -> Any:
        from ucxx._lib.arr import Array

        return Array(view)

    def _live_peer(self, name: str) -> _Peer:
        peer = self._peers.get(name).conn
        if peer.dead is None and not peer.ep.alive:
            self._fail_peer(peer, f"UCX endpoint to {name!r} failed (peer died?)")
        if peer.dead is not None:
            raise PeerUnreachableError(
                f"ucx: peer {name!r} is unreachable ({peer.dead}); remove it and add it again"
            )
        return peer

    def _translate(self, exc: BaseException, what: str) -> TransportError:
        """The one place ucxx errors become kvframe errors."""
        text = f"ucx: {what}: {type(exc).__name__}: {exc}"
        dead = (
            "ConnectionReset",
            "Unreachable",
            "NotConnected",
            "EndpointTimeout",
            "Canceled",
            "InvalidAddr",
            "Rejected",
        )
        if isinstance(exc, ValueError | TypeError) or any(d in type(exc).__name__ for d in dead):
            return PeerUnreachableError(text)
        return TransferFailedError(text)

    def _send_ctrl(self, peer: _Peer, frame: dict[str, Any]) -> None:
        frame["f"] = self._name
        frame["i"] = self._incarnation
        if not peer.hello_sent and frame["k"] != "hello":
            peer.hello_sent = True
            self._send_ctrl(peer, {"k": "hello", "m": self._metadata()})
        body = bytearray(msgpack.packb(frame, use_bin_type=True))
        buf = self._api_array(body)
        req = peer.ep.tag_send(buf, self._api.UCXXTag(_CTRL_TAG))
        self._sends.append((req, buf))

    def _receive_ctrl(self) -> None:
        api = self._api
        while True:
            probe = self._worker.tag_probe(api.UCXXTag(_CTRL_TAG), remove=True)
            if not probe.matched:
                break
            body = bytearray(probe.length)
            req = self._worker.tag_recv_with_handle(self._api_array(body), probe)
            self._ctrl_recvs.append((req, body))
        if self._ctrl_recvs:
            # A probed message's receive completes in the next worker progress: make it now,
            # not one caller step (often a millisecond) later.
            self._worker.progress()
        # In arrival order: a peer's frames must be handled in the order it sent them.
        while self._ctrl_recvs and self._ctrl_recvs[0][0].completed:
            req, body = self._ctrl_recvs.popleft()
            try:
                req.check_error()
                frame = msgpack.unpackb(bytes(body), raw=False)
                self._handle(frame)
            except Exception:  # a broken or illegal frame from a peer is dropped and counted
                self._stats["frames_dropped"] += 1

    def _handle(self, frame: dict[str, Any]) -> None:
        kind = frame["k"]
        if kind == "hello":
            self._connect(frame["m"], rebuild=False)
            return
        entry: kit.PeerEntry[_Peer] | None = self._peers.find(frame["f"])
        if entry is None or entry.incarnation != frame["i"] or entry.conn.dead is not None:
            return  # from a peer we dropped, or an older incarnation: stale
        peer = entry.conn
        if kind == "nt":
            self._inbox.append(Notification(sender=peer.name, payload=bytes(frame["p"])))
            self._stats["notifications_received"] += 1
        elif kind == "rd":
            self._serve_read(peer, frame)
        elif kind == "wr":
            self._serve_write(peer, frame)
        elif kind in ("go", "ok", "err"):
            tr = self._xfers.get(frame["x"])
            if tr is None or tr.record.peer is not peer or not tr.pending:
                return
            if kind == "go":
                self._push(tr.record, int(frame["g"]))
            else:
                tr.record.answer = "ok" if kind == "ok" else str(frame.get("m"))

    def _ranges(
        self, peer: _Peer, op: Op, frame: Mapping[str, Any]
    ) -> tuple[list[int], list[int], str | None]:
        addrs = np.frombuffer(frame["a"], dtype=np.int64).tolist()
        lens = np.frombuffer(frame["l"], dtype=np.int64).tolist()
        if len(addrs) != len(lens):
            return addrs, lens, "address and length lists differ in length"
        for a, n in zip(addrs, lens, strict=True):
            if n <= 0 or not _inside(a, n, self._regions):
                return addrs, lens, f"range {a:#x}+{n} is not inside registered memory"
        if self._access is not None:
            try:
                refused = self._access(peer.name, op, list(zip(addrs, lens, strict=True)))
            except Exception as exc:  # a broken check refuses; it never serves by accident
                refused = f"the access check failed: {type(exc).__name__}: {exc}"
            if refused is not None:
                self._stats["requests_refused"] += 1
                return addrs, lens, f"access refused: {refused}"
        return addrs, lens, None

    def _serve_read(self, peer: _Peer, frame: Mapping[str, Any]) -> None:
        addrs, lens, problem = self._ranges(peer, Op.READ, frame)
        slot = int(frame["g"])
        if problem is not None:
            # Complete each receive the reader posted with an empty message, so nothing lands
            # there and its requests stop; then say why.
            for i in range(len(lens)):
                self._send_data(peer, _data_tag(slot, i), bytearray())
            self._send_ctrl(peer, {"k": "err", "x": frame["x"], "m": problem})
            return
        for i, (a, n) in enumerate(zip(addrs, lens, strict=True)):
            self._send_data(peer, _data_tag(slot, i), _buffer(a, n))
        self._send_ctrl(peer, {"k": "ok", "x": frame["x"]})
        self._stats["requests_served"] += 1
        self._stats["bytes_served"] += sum(lens)

    def _serve_write(self, peer: _Peer, frame: Mapping[str, Any]) -> None:
        addrs, lens, problem = self._ranges(peer, Op.WRITE, frame)
        if problem is not None:
            self._send_ctrl(peer, {"k": "err", "x": frame["x"], "m": problem})
            return
        slot = next(self._slots)
        requests, buffers = [], []
        for i, (a, n) in enumerate(zip(addrs, lens, strict=True)):
            buf = self._api_array(_buffer(a, n))
            buffers.append(buf)
            requests.append(peer.ep.tag_recv(buf, self._api.UCXXTag(_data_tag(slot, i))))
        served = _Served(peer, int(frame["x"]), requests, buffers)
        served.notification = frame.get("n")
        served.nbytes = sum(lens)
        self._served[slot] = served
        self._send_ctrl(peer, {"k": "go", "x": frame["x"], "g": slot})

    def _push(self, xfer: _Xfer, slot: int) -> None:
        for i, (a, n) in enumerate(zip(xfer.laddrs, xfer.lens, strict=True)):
            buf = self._api_array(_buffer(a, n))
            xfer.buffers.append(buf)
            xfer.requests.append(xfer.peer.ep.tag_send(buf, self._api.UCXXTag(_data_tag(slot, i))))

    def _send_data(self, peer: _Peer, tag: int, view: memoryview | bytearray) -> None:
        buf = self._api_array(view)
        self._sends.append((peer.ep.tag_send(buf, self._api.UCXXTag(tag)), buf))

    def _check_xfers(self) -> None:
        for tr in list(self._xfers.values()):
            xfer = tr.record
            if not tr.pending:
                continue
            if not all(r.completed for r in xfer.requests):
                continue
            error: TransportError | None = None
            for r in xfer.requests:
                try:
                    r.check_error()
                except Exception as exc:
                    error = self._translate(exc, f"{xfer.op.value} from {xfer.peer.name!r}")
                    break
            if error is None and xfer.peer.dead is not None:
                error = PeerUnreachableError(f"ucx: {xfer.peer.dead}")
            if error is None and xfer.answer is None:
                # READ: the bytes are here; the peer's verdict follows on the same stream.
                # WRITE: sent, not yet known to have landed.
                continue
            if error is None and xfer.answer != "ok":
                error = TransferFailedError(f"ucx: peer {xfer.peer.name!r} refused: {xfer.answer}")
            if error is None and xfer.op is Op.READ and xfer.notification is not None:
                self._send_ctrl(xfer.peer, {"k": "nt", "p": xfer.notification})
            self._finish(tr, error)

    def _check_served(self) -> None:
        for slot, served in list(self._served.items()):
            if not all(r.completed for r in served.requests):
                continue
            del self._served[slot]
            ok = True
            for r in served.requests:
                try:
                    r.check_error()
                except Exception:
                    ok = False
            if not ok or served.peer.dead is not None:
                continue  # the writer is gone or its sends failed: it learns from its endpoint
            if served.notification is not None:
                self._inbox.append(
                    Notification(sender=served.peer.name, payload=bytes(served.notification))
                )
                self._stats["notifications_received"] += 1
            self._stats["requests_served"] += 1
            self._stats["bytes_served"] += served.nbytes
            self._send_ctrl(served.peer, {"k": "ok", "x": served.xid})

    def _finish(self, tr: kit.Transfer[_Xfer], error: TransportError | None) -> None:
        xfer = tr.record
        xfer.buffers.clear()
        xfer.requests.clear()
        if error is None:
            # transfer_seconds stays None: completion is only seen in a progress() call, so any
            # figure here would depend on how often the caller polls (see the SPI).
            tr.done()
            self._stats["transfers_done"] += 1
            self._stats["bytes"] += tr.nbytes
            if xfer.notification is not None:
                self._stats["notifications_sent"] += 1
        else:
            tr.fail(error)
            self._stats["transfers_failed"] += 1
        if tr.released:
            self._xfers.pop(xfer.xid, None)

    def _fail_peer(self, peer: _Peer, why: str) -> None:
        """Mark the peer dead. Its requests were cancelled by UCX (endpoint error handling);
        they complete with an error and the transfers fail in :meth:`_check_xfers`."""
        peer.dead = why
        for slot, served in list(self._served.items()):
            if served.peer is peer and all(r.completed for r in served.requests):
                del self._served[slot]

    def _close_ep(self, peer: _Peer) -> None:
        try:
            # ucxx 0.52 crashes closing an endpoint that already failed; UCX released it then.
            if peer.ep.alive:
                peer.ep.close()
        except Exception:
            pass

    def _drop_peer(self, peer: _Peer, why: str) -> None:
        """The peer table's teardown: close the peer's endpoint (cancelling every request
        posted on it) and fail its transfers now."""
        if peer.dead is None:
            peer.dead = why
        self._close_ep(peer)
        deadline = time.monotonic() + 1.0
        pending = [
            r for t in self._xfers.values() if t.record.peer is peer for r in t.record.requests
        ]
        pending += [r for s in self._served.values() if s.peer is peer for r in s.requests]
        # Cancellation completes inside worker progress; wait for it so no byte lands later.
        while any(not r.completed for r in pending) and time.monotonic() < deadline:
            self._worker.progress()
        for tr in list(self._xfers.values()):
            if tr.record.peer is peer and tr.pending:
                self._finish(tr, PeerUnreachableError(f"ucx: {why}"))
        for slot, served in list(self._served.items()):
            if served.peer is peer:
                del self._served[slot]


_OFF: Final = frozenset({"n", "no", "0", "off", "false"})


def _unsafe_setting(environ: Mapping[str, str], ucx_config: Mapping[str, str]) -> str | None:
    """The setting (as the user wrote it) that would turn UCX's registration cache off, if any.

    Found by the P/D matrix: with the cache off, a peer that dies while this side's rendezvous
    send to it is pending makes UCX abort the send through the missing cache (a NULL pointer).
    """
    if environ.get("UCX_MEM_MMAP_HOOK_MODE", "").strip().lower() == "none":
        return "UCX_MEM_MMAP_HOOK_MODE=none (in the environment)"
    if environ.get("UCX_RCACHE_ENABLE", "").strip().lower() in _OFF:
        return f"UCX_RCACHE_ENABLE={environ['UCX_RCACHE_ENABLE']} (in the environment)"
    value = ucx_config.get("RCACHE_ENABLE")
    if value is not None and value.strip().lower() in _OFF:
        return f"ucx_config RCACHE_ENABLE={value!r}"
    return None


def _import_ucxx() -> Any:
    """Import ucxx's synchronous layer without its process-wide side effect.

    Deferred so that listing plugins does not load UCX. Importing the ``ucxx`` package sets
    ``UCX_MEMTYPE_CACHE=n`` in ``os.environ`` when it is unset; the UCX inside ucxx 0.52 no
    longer reads it, while every later UCX context in the process (NIXL's, a child's) prints
    an "unused environment variable" warning on stdout, which breaks programs whose stdout is
    data. So the variable is removed again unless the user had set it.
    """
    saved = os.environ.get("UCX_MEMTYPE_CACHE")
    try:
        import ucxx._lib.libucxx as ucx_api
    finally:
        if saved is None:
            os.environ.pop("UCX_MEMTYPE_CACHE", None)
        else:
            os.environ["UCX_MEMTYPE_CACHE"] = saved
    return ucx_api


def _data_tag(slot: int, index: int) -> int:
    return _DATA_BIT | ((slot & ((1 << (63 - _INDEX_BITS)) - 1)) << _INDEX_BITS) | index
