"""``example-tcp``: a small, honest cross-process transport over TCP sockets.

Capability card
---------------

=======================  =========================================================
memory kinds             ``HOST`` only
READ / WRITE             both; the *passive* side serves them from its
                         ``progress()`` / ``drain_notifications()`` (like NIXL
                         without a progress thread), so it must call one of them
                         at least every few milliseconds
notifications            yes, up to 64 KiB, ordered per sender; a post's
                         notification only after every byte landed (a READ's is
                         sent by the reader once it copied the answer into its
                         blocks, a WRITE's queued by the target once it wrote
                         them)
cross process            yes (and cross host, on a reachable ``host``)
cancellation             ``release`` of a pending READ returns at once (a late
                         answer is ignored); of a pending WRITE, waits for the
                         peer's answer (bytes on the wire cannot be recalled)
=======================  =========================================================

Options (``TransportParams.options``; unknown keys and bad values raise ``ConfigError``
naming the key):

- ``host`` (str, default ``"127.0.0.1"``) — address to listen on and to advertise.
- ``connect_timeout`` (float seconds, default 5.0) — for ``add_peer``.

Peers: ``add_peer`` of a known name is a rebuild (the SPI's rule): the old connection is
closed, its pending transfers fail with ``PeerUnreachableError``, and a new one is opened.
Remote layouts prepared for the same incarnation keep working; a restarted peer's old ones
are refused.

The contract code every transport shares — option parsing, the closed guard, payload and op
checks, descriptor pairing, the peer table, transfer records — comes from
:mod:`kvframe.spi.transport_kit`; this module is only what is particular to TCP.

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

import contextlib
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
    PeerUnreachableError,
    TransferFailedError,
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
    notification_after_data=True,
)

_FRAME = struct.Struct(">I")
_MAX_FRAME = 1 << 30
_OPTIONS = kit.TransportOptions(
    "example-tcp", kit.text("host", "127.0.0.1"), kit.seconds("connect_timeout", 5.0)
)


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
    def __init__(self, name: str, regions: list[MemoryRegion], conn: _Conn):
        self.name = name
        self.regions = regions
        self.conn = conn


class _Pending:
    def __init__(self, op: Op, peer: _Peer, local: list[tuple[int, int]]):
        self.op = op
        self.peer = peer
        self.local = local  # (addr, len) of local descriptors, in request order
        self.notification: bytes | None = None


def _inside(addr: int, length: int, regions: Sequence[MemoryRegion]) -> bool:
    return any(r.addr <= addr and addr + length <= r.addr + r.length for r in regions)


class TcpTransport(Transport):
    """The ``example-tcp`` transport. See the module docstring for the capability card.

    Raises :class:`~kvframe.errors.ConfigError` for unknown or ill-typed options and
    ``OSError``-caused :class:`~kvframe.errors.ConfigError` when it cannot listen on ``host``.
    """

    capabilities = CAPABILITIES

    def __init__(self, params: TransportParams) -> None:
        opts = _OPTIONS.parse(params.options)
        host: str = opts["host"]
        self._name = params.name
        self._who = f"example-tcp transport {params.name!r}"
        self._host = host
        self._timeout: float = opts["connect_timeout"]
        try:
            self._listener = socket.create_server((host, 0))
        except OSError as exc:
            raise _OPTIONS.error("host", host, f"an address to listen on ({exc})") from exc
        self._listener.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._incarnation = uuid.uuid4().hex
        self._regions: list[MemoryRegion] = []
        self._peers: kit.PeerTable[_Peer] = kit.PeerTable(self._who, self._drop_peer)
        self._incoming: list[_Conn] = []
        self._pending: dict[int, kit.Transfer[_Pending]] = {}
        self._ids = itertools.count(1)
        self._inbox: list[Notification] = []
        self._guard = kit.OpenGuard(self._who)

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
        self._guard.check()
        self._regions.extend(kit.check_regions(regions, self.capabilities, self._who))

    def local_metadata(self) -> bytes:
        """msgpack of name, address, port, incarnation and registered regions."""
        self._guard.check()
        port = self._listener.getsockname()[1]
        blob: bytes = msgpack.packb(
            {
                "name": self._name,
                "host": self._host,
                "port": port,
                "inc": self._incarnation,
                "regions": [[r.addr, r.length] for r in self._regions],
            },
            use_bin_type=True,
        )
        return blob

    def add_peer(self, metadata: bytes) -> str:
        """Connect to the peer the metadata describes; a known name is rebuilt (its old
        connection closed first). See the SPI contract."""
        self._guard.check()
        try:
            meta = msgpack.unpackb(metadata, raw=False)
            name, host, port = str(meta["name"]), str(meta["host"]), int(meta["port"])
            incarnation = str(meta["inc"])
            regions = [MemoryRegion(addr=int(a), length=int(n)) for a, n in meta["regions"]]
        except Exception as exc:
            raise PeerUnreachableError("example-tcp: peer metadata does not decode") from exc

        def connect() -> _Peer:
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
            return _Peer(name, regions, conn)

        self._peers.add(name, incarnation, connect)
        return name

    def remove_peer(self, peer: str) -> None:
        """Close the connection to ``peer``; its pending transfers fail. Unknown: ignored."""
        self._guard.check()
        self._peers.remove(peer)

    def prepare_local(self, layout: BlockLayout) -> LayoutHandle:
        """Descriptors of a local layout; ``ValueError`` if not inside registered memory."""
        self._guard.check()
        kit.check_inside(layout, self._regions, "this endpoint")
        return LayoutHandle(
            layout=layout, peer=None, native=kit.Prepared.local(self, _descs(layout))
        )

    def prepare_remote(self, peer: str, layout: BlockLayout) -> LayoutHandle:
        """Descriptors of a peer's layout; ``ValueError`` if not inside its registered memory,
        :class:`~kvframe.errors.PeerUnreachableError` for an unknown peer."""
        self._guard.check()
        target = self._live_peer(peer)
        kit.check_inside(layout, target.regions, f"peer {peer!r}")
        native = self._peers.prepared(self, peer, _descs(layout))
        return LayoutHandle(layout=layout, peer=peer, native=native)

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
        self._guard.check()
        # op, layouts (and the peer's incarnation), blocks, notification: ValueError,
        # CapabilityError or PeerUnreachableError before anything starts
        req = kit.check_post(
            self, self._peers, op, local, local_blocks, remote, remote_blocks,
            regions=regions, notification=notification,
        )  # fmt: skip
        ldesc, rdesc = req.local[req.pairs.local], req.remote[req.pairs.remote]
        notification = req.notification
        target = self._live_peer(req.peer.name)
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
        pending = _Pending(op, target, [(a, n) for a, n in ldesc.tolist()])
        if op is Op.READ:
            pending.notification = notification  # sent by us once the bytes landed here
        handle, tr = kit.Transfer.post(self, pending, op=op, peer=target.name, pairs=req.pairs)
        target.conn.queue(frame)
        target.conn.flush()
        self._pending[xid] = tr
        return handle

    def poll(self, handle: XferHandle) -> XferStatus:
        """Make progress, then answer the transfer's status."""
        self._guard.check()
        tr = kit.Transfer.polling(handle, self, _Pending)  # TransportClosedError once released
        self.progress()
        return tr.status

    def release(self, handle: XferHandle) -> None:
        """Forget the handle. Idempotent.

        A late answer to a released READ is ignored, so no byte lands here afterwards. A
        pending WRITE cannot be recalled once its bytes are on the wire, so release waits for
        the peer's answer (at most ``connect_timeout``); a peer that does not answer in time
        is dropped as broken, and its bytes may still land there.
        """
        tr = kit.Transfer.of(handle, self, _Pending)
        if not tr.release() or not tr.pending:
            return
        xid = next((x for x, t in self._pending.items() if t is tr), None)
        if xid is None:
            return
        peer = tr.record.peer
        if handle.op is Op.WRITE and not self._guard.closed:
            deadline = time.monotonic() + self._timeout
            while xid in self._pending and not peer.conn.dead:
                if time.monotonic() > deadline:
                    self._peers.remove(peer.name, "no answer to a released WRITE")
                    break
                self.progress()
                time.sleep(0.0002)
        if self._pending.pop(xid, None) is not None:
            tr.fail(TransferFailedError("released while pending"))

    # -- notifications ----------------------------------------------------------------------
    def send_notification(self, peer: str, payload: bytes) -> None:
        """Queue ``payload`` on the connection to ``peer`` and try to send it."""
        self._guard.check()
        data = kit.check_notification(payload, self.capabilities, self._who)
        target = self._live_peer(peer)
        target.conn.queue({"t": "notif", "payload": data})
        target.conn.flush()

    def drain_notifications(self) -> list[Notification]:
        """Make progress, then return what arrived, oldest first."""
        self._guard.check()
        self.progress()
        out, self._inbox = self._inbox, []
        return out

    def progress(self) -> None:
        """Accept connections, serve requests, collect answers, send queued bytes."""
        self._guard.check()
        for key, _ in self._sel.select(timeout=0):
            if key.data is None:
                self._accept()
                continue
            conn: _Conn = key.data
            for frame in conn.receive():
                self._handle(conn, frame)
        for conn in [*self._incoming, *(e.conn.conn for e in self._peers)]:
            conn.flush()
        self._reap()

    def close(self) -> None:
        """Close every socket. Idempotent."""
        if not self._guard.close():
            return
        for tr in self._pending.values():
            tr.fail(TransferFailedError(f"{self._who} was closed"))
        self._pending.clear()
        self._peers.clear("the transport was closed")
        for conn in self._incoming:
            conn.sock.close()
        self._listener.close()
        self._sel.close()
        self._incoming.clear()

    # -- internals --------------------------------------------------------------------------
    def _live_peer(self, name: str) -> _Peer:
        peer = self._peers.get(name).conn
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
            pending.fail(TransferFailedError(f"peer refused: {frame.get('msg')}"))
            return
        if pending.record.op is Op.READ:
            data = frame["data"]
            view = np.frombuffer(data, dtype=np.uint8)
            offset = 0
            base = view.ctypes.data if view.size else 0
            rec = pending.record
            for addr, n in rec.local:
                ctypes.memmove(addr, base + offset, n)
                offset += n
            if rec.notification is not None and not rec.peer.conn.dead:
                rec.peer.conn.queue({"t": "notif", "payload": rec.notification})
                rec.peer.conn.flush()
        pending.done()

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

    def _reap(self) -> None:
        for conn in [c for c in self._incoming if c.dead]:
            self._incoming.remove(conn)
            self._sel.unregister(conn.sock)
            conn.sock.close()
        for entry in self._peers:
            if entry.conn.conn.dead:
                self._fail_transfers(entry.conn, f"connection to {entry.name!r} broke")

    def _fail_transfers(self, peer: _Peer, why: str) -> None:
        for xid, pending in list(self._pending.items()):
            if pending.record.peer is peer:
                del self._pending[xid]
                pending.fail(PeerUnreachableError(why))

    def _drop_peer(self, peer: _Peer, why: str) -> None:
        """The peer table's teardown: fail the peer's transfers, close its connection."""
        self._fail_transfers(peer, why)
        if peer.conn.sock.fileno() >= 0:
            with contextlib.suppress(Exception):
                self._sel.unregister(peer.conn.sock)
            peer.conn.sock.close()


def _descs(layout: BlockLayout) -> np.ndarray[Any, Any]:
    """(addr, len) rows, region-major: row ``r * num_blocks + b`` is block ``b`` of region
    ``r``."""
    addrs, lens = kit.block_table(layout)
    return np.stack([addrs, lens], axis=1)
