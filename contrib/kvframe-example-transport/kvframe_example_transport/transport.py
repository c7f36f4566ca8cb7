"""``example-tcp``: a small, honest cross-process transport over TCP sockets.

Capability card
---------------

=======================  =========================================================
memory kinds             ``HOST`` only
READ / WRITE             both; the *passive* side serves them from its
                         ``progress()`` / ``drain_notifications()`` (like NIXL
                         without a progress thread), so it must call one of them
                         at least every few milliseconds
notifications            yes, up to 64 KiB, ordered per sender
cross process            yes (and cross host, on a reachable ``host``)
cancellation             ``release`` of a pending READ returns at once (a late
                         answer is ignored); of a pending WRITE, waits for the
                         peer's answer (bytes on the wire cannot be recalled)
=======================  =========================================================

Options (``TransportParams.options``; unknown keys raise ``ConfigError``):

- ``host`` (str, default ``"127.0.0.1"``) — address to listen on and to advertise.
- ``connect_timeout`` (float seconds, default 5.0) — for ``add_peer``.

How it works: each endpoint listens on a TCP port. ``add_peer`` connects to the peer and
sends a hello; requests (READ, WRITE, notifications) travel on the connection *this* side
opened, answers come back on it. Every socket is non-blocking; all I/O happens in
``progress()``, which ``poll`` and ``drain_notifications`` call. The passive side checks every
requested address range against its registered memory before touching it.

Errors are translated to kvframe's in one place each: a refused or broken connection becomes
:class:`~kvframe.errors.PeerUnreachableError`, a request the peer rejected becomes
:class:`~kvframe.errors.TransferFailedError`.
"""

from __future__ import annotations

import ctypes
import itertools
import selectors
import socket
import struct
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import msgpack
import numpy as np

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
    descriptor_ids,
)

__all__ = ["CAPABILITIES", "MAX_NOTIFICATION_BYTES", "TcpTransport"]

MAX_NOTIFICATION_BYTES = 64 * 1024

CAPABILITIES = TransportCapabilities(
    memory_kinds=frozenset({MemoryKind.HOST}),
    read=True,
    write=True,
    notifications=True,
    max_notification_bytes=MAX_NOTIFICATION_BYTES,
    cross_process=True,
    ordered_notifications=True,
)

_FRAME = struct.Struct(">I")
_MAX_FRAME = 1 << 30
_OPTIONS = frozenset({"host", "connect_timeout"})


class _Conn:
    """One TCP connection with its unparsed input and unsent output."""

    def __init__(self, sock: socket.socket, peer: str | None) -> None:
        self.sock = sock
        self.peer = peer  # None for an incoming connection until its hello arrives
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.dead = False

    def queue(self, frame: Mapping[str, Any]) -> None:
        body: bytes = msgpack.packb(frame, use_bin_type=True)
        self.outbuf += _FRAME.pack(len(body)) + body

    def flush(self) -> None:
        while self.outbuf and not self.dead:
            try:
                sent = self.sock.send(self.outbuf)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.dead = True
                return
            del self.outbuf[:sent]

    def receive(self) -> list[dict[str, Any]]:
        """Read what is available; returns complete frames. Sets ``dead`` on EOF/error."""
        while not self.dead:
            try:
                chunk = self.sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                self.dead = True
                break
            if not chunk:
                self.dead = True
                break
            self.inbuf += chunk
        frames = []
        while len(self.inbuf) >= _FRAME.size:
            (size,) = _FRAME.unpack_from(self.inbuf)
            if size > _MAX_FRAME:
                self.dead = True  # a peer that sends this is broken; drop the connection
                break
            if len(self.inbuf) < _FRAME.size + size:
                break
            body = bytes(self.inbuf[_FRAME.size : _FRAME.size + size])
            del self.inbuf[: _FRAME.size + size]
            frames.append(msgpack.unpackb(body, raw=False))
        return frames


class _Peer:
    def __init__(self, name: str, incarnation: str, regions: list[list[int]], conn: _Conn):
        self.name = name
        self.incarnation = incarnation
        self.regions = regions
        self.conn = conn


class _Pending:
    def __init__(self, handle: XferHandle, peer: _Peer, local: list[tuple[int, int]]):
        self.handle = handle
        self.peer = peer
        self.local = local  # (addr, len) of local descriptors, in request order
        self.notification: bytes | None = None


def _inside(addr: int, length: int, regions: Sequence[Sequence[int]]) -> bool:
    return any(start <= addr and addr + length <= start + size for start, size in regions)


class TcpTransport(Transport):
    """The ``example-tcp`` transport. See the module docstring for the capability card.

    Raises :class:`~kvframe.errors.ConfigError` for unknown or ill-typed options and
    ``OSError``-caused :class:`~kvframe.errors.ConfigError` when it cannot listen on ``host``.
    """

    capabilities = CAPABILITIES

    def __init__(self, params: TransportParams) -> None:
        unknown = set(params.options) - _OPTIONS
        if unknown:
            raise ConfigError(
                f"example-tcp: unknown option(s) {sorted(unknown)}; known: {sorted(_OPTIONS)}"
            )
        host = params.options.get("host", "127.0.0.1")
        timeout = params.options.get("connect_timeout", 5.0)
        if not isinstance(host, str):
            raise ConfigError(f"example-tcp: option 'host' = {host!r}; expected a string")
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
            raise ConfigError(
                f"example-tcp: option 'connect_timeout' = {timeout!r}; expected seconds > 0"
            )
        self._name = params.name
        self._host = host
        self._timeout = float(timeout)
        try:
            self._listener = socket.create_server((host, 0))
        except OSError as exc:
            raise ConfigError(f"example-tcp: cannot listen on {host!r}: {exc}") from exc
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._incarnation = uuid.uuid4().hex
        self._regions: list[list[int]] = []
        self._peers: dict[str, _Peer] = {}
        self._incoming: list[_Conn] = []
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._inbox: list[Notification] = []
        self._closed = False

    @classmethod
    def create(cls, params: TransportParams) -> TcpTransport:
        """The factory registered with kvframe."""
        return cls(params)

    @property
    def name(self) -> str:
        """This endpoint's name."""
        return self._name

    # -- memory and peers -------------------------------------------------------------------
    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        """Allow peers to READ and WRITE these host regions."""
        self._check_open()
        regions = list(regions)
        for r in regions:
            if r.kind is not MemoryKind.HOST:
                raise CapabilityError(f"example-tcp moves host memory only, not {r.kind.value}")
        self._regions.extend([r.addr, r.length] for r in regions)

    def local_metadata(self) -> bytes:
        """msgpack of name, address, port, incarnation and registered regions."""
        self._check_open()
        port = self._listener.getsockname()[1]
        blob: bytes = msgpack.packb(
            {
                "name": self._name,
                "host": self._host,
                "port": port,
                "inc": self._incarnation,
                "regions": self._regions,
            },
            use_bin_type=True,
        )
        return blob

    def add_peer(self, metadata: bytes) -> str:
        """Connect to the peer the metadata describes (see the SPI contract)."""
        self._check_open()
        try:
            meta = msgpack.unpackb(metadata, raw=False)
            name, host, port = str(meta["name"]), str(meta["host"]), int(meta["port"])
            incarnation, regions = str(meta["inc"]), [list(r) for r in meta["regions"]]
        except Exception as exc:
            raise PeerUnreachableError("example-tcp: peer metadata does not decode") from exc
        old = self._peers.get(name)
        if old is not None and old.incarnation == incarnation and not old.conn.dead:
            return name
        if old is not None:
            self._drop_peer(old, f"peer {name!r} restarted")
        try:
            sock = socket.create_connection((host, port), timeout=self._timeout)
        except OSError as exc:
            raise PeerUnreachableError(f"example-tcp: cannot reach {name!r}: {exc}") from exc
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock, name)
        conn.queue({"t": "hello", "name": self._name})
        conn.flush()
        self._sel.register(sock, selectors.EVENT_READ, conn)
        self._peers[name] = _Peer(name, incarnation, regions, conn)
        return name

    def remove_peer(self, peer: str) -> None:
        """Close the connection to ``peer``; its pending transfers fail. Unknown: ignored."""
        self._check_open()
        old = self._peers.get(peer)
        if old is not None:
            self._drop_peer(old, f"peer {peer!r} was removed")

    def prepare_local(self, layout: BlockLayout) -> LayoutHandle:
        """Descriptors of a local layout; ``ValueError`` if not inside registered memory."""
        self._check_open()
        return LayoutHandle(layout=layout, peer=None, native=self._descs(layout, self._regions))

    def prepare_remote(self, peer: str, layout: BlockLayout) -> LayoutHandle:
        """Descriptors of a peer's layout; ``ValueError`` if not inside its registered memory,
        :class:`~kvframe.errors.PeerUnreachableError` for an unknown peer."""
        self._check_open()
        target = self._live_peer(peer)
        return LayoutHandle(layout=layout, peer=peer, native=self._descs(layout, target.regions))

    @staticmethod
    def _descs(layout: BlockLayout, regions: Sequence[Sequence[int]]) -> np.ndarray[Any, Any]:
        for i, region in enumerate(layout.regions):
            used = layout.block_lens[i] * layout.num_blocks
            if not _inside(region.addr, used, regions):
                raise ValueError(
                    f"layout region {i} at {region.addr:#x} ({used} bytes) is not inside "
                    "registered memory; register it first"
                )
        nb = layout.num_blocks
        base = np.array([r.addr for r in layout.regions], dtype=np.int64)
        blen = np.array(layout.block_lens, dtype=np.int64)
        addrs = (base[:, None] + np.arange(nb, dtype=np.int64)[None, :] * blen[:, None]).ravel()
        return np.stack([addrs, np.repeat(blen, nb)], axis=1)  # row r * nb + b: (addr, len)

    # -- transfers --------------------------------------------------------------------------
    def post(
        self,
        op: Op,
        local: LayoutHandle,
        local_blocks: Sequence[int] | np.ndarray[Any, Any],
        remote: LayoutHandle,
        remote_blocks: Sequence[int] | np.ndarray[Any, Any],
        *,
        regions: Sequence[int] | None = None,
        notification: bytes | None = None,
    ) -> XferHandle:
        """Send the request; the handle completes when the peer's answer arrives."""
        self._check_open()
        if op not in (Op.READ, Op.WRITE):
            raise ValueError(f"op must be Op.READ or Op.WRITE, got {op!r}")
        if local.peer is not None or remote.peer is None:
            raise ValueError("pass a prepare_local handle and a prepare_remote handle")
        lids = descriptor_ids(local.layout, local_blocks, regions)
        rids = descriptor_ids(remote.layout, remote_blocks, regions)
        if lids.size != rids.size:
            raise ValueError("local_blocks and remote_blocks must have the same length")
        ldesc, rdesc = local.native[lids], remote.native[rids]
        if not np.array_equal(ldesc[:, 1], rdesc[:, 1]):
            raise ValueError("local and remote block lengths differ in a selected region")
        if notification is not None:
            self._check_payload(notification)
        target = self._live_peer(remote.peer)
        xid = next(self._ids)
        frame: dict[str, Any] = {
            "t": op.value,
            "id": xid,
            "addrs": rdesc[:, 0].tobytes(),
            "lens": rdesc[:, 1].tobytes(),
        }
        if op is Op.WRITE:
            frame["data"] = b"".join(ctypes.string_at(a, n) for a, n in ldesc.tolist())
            frame["notif"] = notification  # the peer queues it once the bytes are written
        handle = XferHandle(
            op=op, peer=target.name, nbytes=int(ldesc[:, 1].sum()), num_descriptors=len(ldesc)
        )
        pending = _Pending(handle, target, [(a, n) for a, n in ldesc.tolist()])
        if op is Op.READ:
            pending.notification = notification  # sent by us once the bytes landed here
        handle.native = xid
        target.conn.queue(frame)
        target.conn.flush()
        self._pending[xid] = pending
        return handle

    def poll(self, handle: XferHandle) -> XferState:
        """Make progress, then answer the handle's state."""
        self._check_open()
        if handle.released:
            raise TransportClosedError("example-tcp: this handle was released")
        self.progress()
        return handle.state

    def release(self, handle: XferHandle) -> None:
        """Forget the handle. Idempotent.

        A late answer to a released READ is ignored, so no byte lands here afterwards. A
        pending WRITE cannot be recalled once its bytes are on the wire, so release waits for
        the peer's answer (at most ``connect_timeout``); a peer that does not answer in time
        is dropped as broken, and its bytes may still land there.
        """
        if handle.released:
            return
        handle.released = True
        xid = handle.native
        pending = self._pending.get(xid)
        if pending is None:
            return
        if handle.op is Op.WRITE and not self._closed:
            deadline = time.monotonic() + self._timeout
            while xid in self._pending and not pending.peer.conn.dead:
                if time.monotonic() > deadline:
                    self._drop_peer(pending.peer, "no answer to a released WRITE")
                    break
                self.progress()
                time.sleep(0.0002)
        if self._pending.pop(xid, None) is not None:
            handle.state = XferState.FAILED
            handle.error = TransferFailedError("released while pending")

    # -- notifications ----------------------------------------------------------------------
    def send_notification(self, peer: str, payload: bytes) -> None:
        """Queue ``payload`` on the connection to ``peer`` and try to send it."""
        self._check_open()
        self._check_payload(payload)
        target = self._live_peer(peer)
        target.conn.queue({"t": "notif", "payload": bytes(payload)})
        target.conn.flush()

    def drain_notifications(self) -> list[Notification]:
        """Make progress, then return what arrived, oldest first."""
        self._check_open()
        self.progress()
        out, self._inbox = self._inbox, []
        return out

    def progress(self) -> None:
        """Accept connections, serve requests, collect answers, send queued bytes."""
        self._check_open()
        for key, _ in self._sel.select(timeout=0):
            if key.data is None:
                self._accept()
                continue
            conn: _Conn = key.data
            for frame in conn.receive():
                self._handle(conn, frame)
        for conn in [*self._incoming, *(p.conn for p in self._peers.values())]:
            conn.flush()
        self._reap()

    def close(self) -> None:
        """Close every socket. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for conn in [*self._incoming, *(p.conn for p in self._peers.values())]:
            conn.sock.close()
        self._listener.close()
        self._sel.close()
        self._peers.clear()
        self._incoming.clear()
        self._pending.clear()

    # -- internals --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosedError(f"example-tcp transport {self._name!r} is closed")

    def _check_payload(self, payload: bytes) -> None:
        if len(payload) > MAX_NOTIFICATION_BYTES:
            raise CapabilityError(
                f"notification of {len(payload)} bytes is over the {MAX_NOTIFICATION_BYTES} "
                "byte limit"
            )

    def _live_peer(self, name: str) -> _Peer:
        peer = self._peers.get(name)
        if peer is None:
            raise PeerUnreachableError(f"example-tcp: unknown peer {name!r}; add_peer first")
        if peer.conn.dead:
            raise PeerUnreachableError(f"example-tcp: connection to {name!r} is broken")
        return peer

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock, None)
        self._incoming.append(conn)
        self._sel.register(sock, selectors.EVENT_READ, conn)

    def _handle(self, conn: _Conn, frame: Mapping[str, Any]) -> None:
        kind = frame.get("t")
        if conn in self._incoming:
            self._serve(conn, kind, frame)
            return
        # an answer on a connection we opened
        pending = self._pending.pop(frame.get("id", -1), None)
        if pending is None:
            return  # answer to a released transfer: ignore it, write nothing
        if kind == "err":
            self._finish(pending, TransferFailedError(f"peer refused: {frame.get('msg')}"))
            return
        if pending.handle.op is Op.READ:
            data = frame["data"]
            view = np.frombuffer(data, dtype=np.uint8)
            offset = 0
            base = view.ctypes.data if view.size else 0
            for addr, n in pending.local:
                ctypes.memmove(addr, base + offset, n)
                offset += n
            if pending.notification is not None and not pending.peer.conn.dead:
                pending.peer.conn.queue({"t": "notif", "payload": pending.notification})
                pending.peer.conn.flush()
        self._finish(pending, None)

    def _serve(self, conn: _Conn, kind: Any, frame: Mapping[str, Any]) -> None:
        if kind == "hello":
            conn.peer = str(frame["name"])
            return
        if conn.peer is None:
            conn.dead = True  # no hello first: not a kvframe peer
            return
        if kind == "notif":
            self._inbox.append(Notification(sender=conn.peer, payload=frame["payload"]))
            return
        addrs = np.frombuffer(frame["addrs"], dtype=np.int64)
        lens = np.frombuffer(frame["lens"], dtype=np.int64)
        descs = list(zip(addrs.tolist(), lens.tolist(), strict=True))
        bad = [(a, n) for a, n in descs if not _inside(a, n, self._regions)]
        if bad:
            conn.queue({"t": "err", "id": frame["id"], "msg": f"unregistered range {bad[0]}"})
        elif kind == "read":
            data = b"".join(ctypes.string_at(a, n) for a, n in descs)
            conn.queue({"t": "done", "id": frame["id"], "data": data})
        elif kind == "write":
            view = np.frombuffer(frame["data"], dtype=np.uint8)
            base = view.ctypes.data if view.size else 0
            offset = 0
            for a, n in descs:
                ctypes.memmove(a, base + offset, n)
                offset += n
            if frame.get("notif") is not None:
                self._inbox.append(Notification(sender=conn.peer, payload=frame["notif"]))
            conn.queue({"t": "done", "id": frame["id"]})
        else:
            conn.queue({"t": "err", "id": frame.get("id"), "msg": f"unknown request {kind!r}"})
        conn.flush()

    def _finish(self, pending: _Pending, error: TransportError | None) -> None:
        pending.handle.state = XferState.DONE if error is None else XferState.FAILED
        pending.handle.error = error

    def _reap(self) -> None:
        for conn in [c for c in self._incoming if c.dead]:
            self._incoming.remove(conn)
            self._sel.unregister(conn.sock)
            conn.sock.close()
        for peer in self._peers.values():
            if peer.conn.dead:
                self._fail_transfers(peer, f"connection to {peer.name!r} broke")

    def _fail_transfers(self, peer: _Peer, why: str) -> None:
        for xid, pending in list(self._pending.items()):
            if pending.peer is peer:
                del self._pending[xid]
                self._finish(pending, PeerUnreachableError(why))

    def _drop_peer(self, peer: _Peer, why: str) -> None:
        self._fail_transfers(peer, why)
        self._peers.pop(peer.name, None)
        if peer.conn.sock.fileno() >= 0:
            self._sel.unregister(peer.conn.sock)
            peer.conn.sock.close()
