"""Endpoints the conformance kit drives: one in this process, or one in a child process.

An *endpoint* is a transport plus the host buffers it moves, behind a small command set
(allocate, write, read, register, metadata, add_peer, prepare, post, poll, release, notify,
drain, close). :class:`LocalEndpoint` runs the commands on a transport in this process;
:class:`ChildEndpoint` sends them to ``python -m kvframe.testing._endpoint`` over a socket pair,
one frozen message per command and per answer, encoded by the one codec and length-prefixed
(:mod:`kvframe.testing._wire`; never pickle), and the child runs them on a
:class:`LocalEndpoint` of its own.

Watches: :meth:`Endpoint.watch` makes the endpoint act *the moment* it drains a given
notification — take digests of memory ranges, then invert ranges — before anything else
happens on it; :meth:`Endpoint.sightings` answers what the watches saw. In a child process the
watch runs in the child's own drain loop, so the conformance kit sees what the receiving side
held at receipt without a round trip to the parent in between.

Progress: the child calls ``drain_notifications()`` at least every millisecond between
commands and keeps what it drained until the parent asks, so transports that progress only
when called (NIXL without its progress thread) can accept connections and serve one-sided
transfers while the parent is busy. While the parent waits for the child's answer, it runs the
``pump`` callback it was given (usually its own endpoint's :meth:`LocalEndpoint.pump`) every
millisecond for the same reason.
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import hashlib
import importlib
import itertools
import os
import select
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import numpy as np

import kvframe.testing._wire as wire
from kvframe import errors
from kvframe.protocol.messages import thaw_plain
from kvframe.spi.transport import (
    BlockLayout,
    LayoutHandle,
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
    "ChildEndpoint",
    "Endpoint",
    "LocalEndpoint",
    "RemoteError",
    "TransportSpec",
    "serve_child",
]

_A = TypeVar("_A")


class RemoteError(Exception):
    """The child endpoint raised an exception that is not one of kvframe's or a builtin the
    kit maps back (``ValueError``, ``TypeError``, ``KeyError``). ``type_name`` names it."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name


@attrs.frozen(kw_only=True)
class TransportSpec:
    """How to build the transport under test, in this process or in a child.

    ``factory`` is ``None`` (ask the plugin host for ``name``, as an engine would), a
    ``"module:callable"`` string (imported in whichever process builds it), or a callable
    :class:`~kvframe.spi.transport.TransportFactory` (this process only). ``options`` go into
    :class:`~kvframe.spi.transport.TransportParams`; for a child they must be msgpack-able.
    """

    name: str
    options: Mapping[str, Any] = attrs.field(factory=dict)
    factory: str | Callable[[TransportParams], Transport] | None = None

    @property
    def portable(self) -> bool:
        """Whether a child process can build it (no callable factory)."""
        return not callable(self.factory)

    def build(self, endpoint_name: str) -> Transport:
        """Build a transport whose endpoint name is ``endpoint_name``.

        Raises whatever the factory or the plugin host raises (``PluginNotFoundError`` for an
        uninstalled name, ``ConfigError`` for bad options).
        """
        params = TransportParams(name=endpoint_name, options=dict(self.options))
        if callable(self.factory):
            return self.factory(params)
        if isinstance(self.factory, str):
            module, _, attr = self.factory.partition(":")
            if not attr:
                raise errors.ConfigError(
                    f"factory {self.factory!r}: write it as 'package.module:callable'"
                )
            factory: Any = importlib.import_module(module)
            for part in attr.split("."):
                factory = getattr(factory, part)
            transport: Transport = factory(params)
            return transport
        from kvframe.runtime.plugins import PluginHost

        host = PluginHost()
        host.load()
        built: Transport = host.create_transport(self.name, params)
        return built

    def for_child(self) -> TransportSpec:
        """The spec a child process should build: for a transport found through the plugin
        host, the host is asked *here* and the child gets the factory's import path, so the
        child imports only that plugin (loading every installed plugin can cost seconds).
        Falls back to the spec itself when the factory has no importable path.
        """
        if self.factory is not None:
            return self
        from kvframe.runtime.plugins import PluginHost

        host = PluginHost()
        host.load()
        factory = host.transport_info(self.name).factory
        module = getattr(factory, "__module__", None)
        qualname = getattr(factory, "__qualname__", "")
        if not module or not qualname or "<" in qualname:
            return self
        return attrs.evolve(self, factory=f"{module}:{qualname}")

    def to_wire(self) -> dict[str, Any]:
        """The spec as a msgpack-able mapping. Raises ``TypeError`` for a callable factory."""
        if not self.portable:
            raise TypeError(
                "a callable factory cannot cross a process boundary; give the transport's "
                "registered name or a 'module:callable' string instead"
            )
        return {"name": self.name, "options": dict(self.options), "factory": self.factory}


# -- errors on the wire ---------------------------------------------------------------------


_ERROR_TYPES: dict[str, type[BaseException]] = {
    name: getattr(errors, name) for name in errors.__all__
} | {"ValueError": ValueError, "TypeError": TypeError, "KeyError": KeyError}


def _error_to_wire(exc: BaseException, *, kvframe: bool = False) -> wire.Failure:
    """``kvframe=True``: name the nearest class of :mod:`kvframe.errors` (a plugin's own
    subclass of ``TransferFailedError`` travels as ``TransferFailedError``)."""
    name = type(exc).__name__
    if kvframe:
        name = next(c.__name__ for c in type(exc).__mro__ if c.__name__ in errors.__all__)
    return wire.Failure(type_name=name, message=str(exc))


def _error_from_wire(failure: wire.Failure) -> BaseException:
    cls = _ERROR_TYPES.get(failure.type_name)
    if cls is None:
        return RemoteError(failure.type_name, failure.message)
    return cls(failure.message)


# -- the endpoint interface -----------------------------------------------------------------


class Endpoint(abc.ABC):
    """The command set the conformance kit drives; see :class:`LocalEndpoint` for contracts.

    Layouts and transfers are named by integer ids local to the endpoint, so the same test
    code drives an endpoint in this process and one in a child.
    """

    name: str
    capabilities: TransportCapabilities

    @abc.abstractmethod
    def alloc(self, nbytes: int) -> MemoryRegion:
        """A zeroed host buffer of ``nbytes`` owned by the endpoint (64-byte aligned)."""

    @abc.abstractmethod
    def write(self, addr: int, data: bytes) -> None:
        """Copy ``data`` into an allocated buffer at ``addr``."""

    @abc.abstractmethod
    def read(self, addr: int, length: int) -> bytes:
        """Copy ``length`` bytes out of an allocated buffer at ``addr``."""

    @abc.abstractmethod
    def checksum(self, addr: int, length: int) -> str:
        """sha256 hex digest of ``length`` bytes of an allocated buffer at ``addr``."""

    @abc.abstractmethod
    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """``transport.register_memory(regions)``."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """``transport.local_metadata()``."""

    @abc.abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """``transport.add_peer(metadata)``."""

    @abc.abstractmethod
    def remove_peer(self, peer: str) -> None:
        """``transport.remove_peer(peer)``."""

    @abc.abstractmethod
    def prepare_local(self, layout: BlockLayout) -> int:
        """``transport.prepare_local(layout)``; returns a layout id."""

    @abc.abstractmethod
    def prepare_remote(self, peer: str, layout: BlockLayout) -> int:
        """``transport.prepare_remote(peer, layout)``; returns a layout id."""

    @abc.abstractmethod
    def post(
        self,
        op: Op,
        local: int,
        local_blocks: Sequence[int],
        remote: int,
        remote_blocks: Sequence[int],
        *,
        regions: Sequence[int] | None = None,
        notification: bytes | None = None,
    ) -> int:
        """``transport.post(...)`` with layout ids; returns a transfer id."""

    @abc.abstractmethod
    def poll(self, xfer: int) -> XferStatus:
        """``transport.poll(handle)``: the transfer's
        :class:`~kvframe.spi.transport.XferStatus` (from a child, its error is rebuilt as the
        nearest kvframe error class, with the message)."""

    @abc.abstractmethod
    def release(self, xfer: int) -> None:
        """``transport.release(handle)``."""

    @abc.abstractmethod
    def notify(self, peer: str, payload: bytes) -> None:
        """``transport.send_notification(peer, payload)``."""

    @abc.abstractmethod
    def drain(self) -> list[Notification]:
        """Every notification received so far and not yet returned, oldest first."""

    @abc.abstractmethod
    def pump(self) -> None:
        """Make progress (drain and keep notifications for :meth:`drain`)."""

    @abc.abstractmethod
    def watch(
        self,
        payload: bytes,
        *,
        digest: Sequence[MemoryRegion] = (),
        invert: Sequence[MemoryRegion] = (),
    ) -> None:
        """Arm a watch: when a notification with exactly ``payload`` is drained, take the sha256
        of each ``digest`` range, then invert every byte of each ``invert`` range (see
        :meth:`LocalEndpoint.watch`). Fires once."""

    @abc.abstractmethod
    def sightings(self) -> dict[bytes, tuple[str, ...]]:
        """The watches that fired so far: payload -> the hex digests of its ranges, in order."""

    @abc.abstractmethod
    def deny_access(self, reason: str) -> None:
        """``transport.set_access_check`` with a check that refuses every peer READ and WRITE
        with ``reason`` (an empty ``reason``: ``set_access_check(None)``)."""

    @abc.abstractmethod
    def close(self) -> None:
        """``transport.close()``; buffers stay allocated until :meth:`shutdown`."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Close the transport (if open) and free everything. Idempotent."""


_LIVE: weakref.WeakSet[LocalEndpoint] = weakref.WeakSet()
"""The local endpoints of this process (whose buffers a watch may digest)."""


def _owner(addr: int, length: int) -> LocalEndpoint:
    for ep in list(_LIVE):
        if ep._owns(addr, length):
            return ep
    raise ValueError(f"[{addr:#x}, +{length}) is not inside a buffer of a local endpoint")


class LocalEndpoint(Endpoint):
    """An endpoint in this process, wrapping ``transport`` (owned from here on).

    :attr:`transport` is the transport itself, for tests that call it directly. Every method
    raises what the transport raises; buffer accessors raise ``ValueError`` for an address
    range outside the endpoint's buffers.
    """

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.name = transport.name
        self.capabilities = transport.capabilities
        self._buffers: list[np.ndarray[Any, np.dtype[np.uint8]]] = []
        self._layouts: dict[int, LayoutHandle] = {}
        self._xfers: dict[int, XferHandle] = {}
        self._inbox: list[Notification] = []
        self._ids = itertools.count(1)
        self._closed = False
        self._watches: dict[bytes, wire.Watch] = {}
        self._seen: dict[bytes, tuple[str, ...]] = {}
        _LIVE.add(self)

    def alloc(self, nbytes: int) -> MemoryRegion:
        """See :meth:`Endpoint.alloc`; runs on the wrapped transport in this process."""
        if nbytes <= 0:
            raise ValueError(f"alloc({nbytes}): give a positive size")
        raw = np.zeros(nbytes + 64, dtype=np.uint8)
        offset = (-raw.ctypes.data) % 64
        buf = raw[offset : offset + nbytes]
        self._buffers.append(buf)
        return MemoryRegion(addr=int(buf.ctypes.data), length=nbytes)

    def _owns(self, addr: int, length: int) -> bool:
        for buf in self._buffers:
            start = int(buf.ctypes.data)
            if start <= addr and addr + length <= start + buf.nbytes:
                return True
        return False

    def _check_range(self, addr: int, length: int) -> None:
        if not self._owns(addr, length):
            raise ValueError(
                f"[{addr:#x}, +{length}) is not inside a buffer of endpoint {self.name}"
            )

    def write(self, addr: int, data: bytes) -> None:
        """See :meth:`Endpoint.write`; runs on the wrapped transport in this process."""
        self._check_range(addr, len(data))
        ctypes.memmove(addr, bytes(data), len(data))

    def read(self, addr: int, length: int) -> bytes:
        """See :meth:`Endpoint.read`; runs on the wrapped transport in this process."""
        self._check_range(addr, length)
        return ctypes.string_at(addr, length)

    def checksum(self, addr: int, length: int) -> str:
        """See :meth:`Endpoint.checksum`; runs on the wrapped transport in this process."""
        return hashlib.sha256(self.read(addr, length)).hexdigest()

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """See :meth:`Endpoint.register`; runs on the wrapped transport in this process."""
        self.transport.register_memory(list(regions))

    def metadata(self) -> bytes:
        """See :meth:`Endpoint.metadata`; runs on the wrapped transport in this process."""
        return self.transport.local_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """See :meth:`Endpoint.add_peer`; runs on the wrapped transport in this process."""
        return self.transport.add_peer(metadata)

    def remove_peer(self, peer: str) -> None:
        """See :meth:`Endpoint.remove_peer`; runs on the wrapped transport in this process."""
        self.transport.remove_peer(peer)

    def prepare_local(self, layout: BlockLayout) -> int:
        """See :meth:`Endpoint.prepare_local`; runs on the wrapped transport in this process."""
        lid = next(self._ids)
        self._layouts[lid] = self.transport.prepare_local(layout)
        return lid

    def prepare_remote(self, peer: str, layout: BlockLayout) -> int:
        """See :meth:`Endpoint.prepare_remote`; runs on the wrapped transport in this process."""
        lid = next(self._ids)
        self._layouts[lid] = self.transport.prepare_remote(peer, layout)
        return lid

    def layout(self, layout_id: int) -> LayoutHandle:
        """The :class:`LayoutHandle` behind a layout id. Raises ``KeyError`` if unknown."""
        return self._layouts[layout_id]

    def post(
        self,
        op: Op,
        local: int,
        local_blocks: Sequence[int],
        remote: int,
        remote_blocks: Sequence[int],
        *,
        regions: Sequence[int] | None = None,
        notification: bytes | None = None,
    ) -> int:
        """See :meth:`Endpoint.post`; runs on the wrapped transport in this process."""
        handle = self.transport.post(
            op,
            self._layouts[local],
            list(local_blocks),
            self._layouts[remote],
            list(remote_blocks),
            regions=None if regions is None else list(regions),
            notification=notification,
        )
        xid = next(self._ids)
        self._xfers[xid] = handle
        return xid

    def handle(self, xfer: int) -> XferHandle:
        """The :class:`XferHandle` behind a transfer id. Raises ``KeyError`` if unknown."""
        return self._xfers[xfer]

    def poll(self, xfer: int) -> XferStatus:
        """See :meth:`Endpoint.poll`; runs on the wrapped transport in this process."""
        return self.transport.poll(self._xfers[xfer])

    def release(self, xfer: int) -> None:
        """See :meth:`Endpoint.release`; runs on the wrapped transport in this process."""
        self.transport.release(self._xfers[xfer])

    def notify(self, peer: str, payload: bytes) -> None:
        """See :meth:`Endpoint.notify`; runs on the wrapped transport in this process."""
        self.transport.send_notification(peer, payload)

    def drain(self) -> list[Notification]:
        """See :meth:`Endpoint.drain`; runs on the wrapped transport in this process."""
        self.pump()
        out, self._inbox = self._inbox, []
        return out

    def pump(self) -> None:
        """See :meth:`Endpoint.pump`; runs on the wrapped transport in this process."""
        if not self._closed:
            notes = self.transport.drain_notifications()
            if self._watches:
                self._fire(notes)
            self._inbox.extend(notes)

    def watch(
        self,
        payload: bytes,
        *,
        digest: Sequence[MemoryRegion] = (),
        invert: Sequence[MemoryRegion] = (),
    ) -> None:
        """See :meth:`Endpoint.watch`. Runs right after the ``drain_notifications()`` call that
        returned the notification, before this endpoint does anything else.

        ``digest`` ranges may lie in a buffer of any :class:`LocalEndpoint` of this process
        (so a receiver can look at the poster's memory when both are here); ``invert`` ranges
        must be this endpoint's own. A second watch of the same payload replaces the first.
        Raises ``ValueError`` for a range outside those buffers; then nothing was armed.
        """
        for r in digest:
            if not any(ep._owns(r.addr, r.length) for ep in list(_LIVE)):
                raise ValueError(
                    f"digest range [{r.addr:#x}, +{r.length}) is not inside a buffer of an "
                    "endpoint of this process"
                )
        for r in invert:
            self._check_range(r.addr, r.length)
        self._watches[bytes(payload)] = wire.Watch(
            payload=bytes(payload), digest=tuple(digest), invert=tuple(invert)
        )

    def sightings(self) -> dict[bytes, tuple[str, ...]]:
        """See :meth:`Endpoint.sightings`; runs on the wrapped transport in this process."""
        return dict(self._seen)

    def deny_access(self, reason: str) -> None:
        """See :meth:`Endpoint.deny_access`; on the wrapped transport in this process."""
        self.transport.set_access_check((lambda peer, op, ranges: reason) if reason else None)

    def _fire(self, notes: Sequence[Notification]) -> None:
        for note in notes:
            armed = self._watches.pop(note.payload, None)
            if armed is None:
                continue
            self._seen[armed.payload] = tuple(
                _owner(r.addr, r.length).digest_range(r.addr, r.length) for r in armed.digest
            )
            for r in armed.invert:
                self.invert_range(r.addr, r.length)

    def digest_range(self, addr: int, length: int) -> str:
        """The sha256 hex digest of ``[addr, addr + length)`` of this endpoint's buffers (a
        subclass whose buffers are not host memory overrides both)."""
        return hashlib.sha256(ctypes.string_at(addr, length)).hexdigest()

    def invert_range(self, addr: int, length: int) -> None:
        """Invert every byte of ``[addr, addr + length)`` of this endpoint's buffers."""
        view = np.ctypeslib.as_array((ctypes.c_ubyte * length).from_address(addr))
        np.bitwise_not(view, out=view)

    def close(self) -> None:
        """See :meth:`Endpoint.close`; runs on the wrapped transport in this process."""
        self._closed = True
        self.transport.close()

    def shutdown(self) -> None:
        """See :meth:`Endpoint.shutdown`; runs on the wrapped transport in this process."""
        with contextlib.suppress(Exception):
            self.close()
        # only now, with the transport closed, can no transfer touch the buffers any more
        self._watches.clear()
        self._buffers.clear()
        self._xfers.clear()
        self._layouts.clear()


# -- the child side -------------------------------------------------------------------------


class ChildEndpoint(Endpoint):
    """An endpoint in a child process (``python -m kvframe.testing._endpoint``).

    :meth:`start` spawns the child (a fresh interpreter: no fork after threads) and builds
    the transport there from a portable :class:`TransportSpec`. Every call raises what the
    child's transport raised (kvframe errors and ``ValueError``/``TypeError`` map back to
    their own classes, anything else to :class:`RemoteError`) and
    :class:`~kvframe.errors.PeerUnreachableError` when the child is gone or does not answer
    within ``timeout`` seconds. ``pump`` runs every millisecond while waiting.
    """

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        sock: socket.socket,
        *,
        timeout: float,
        pump: Callable[[], None] | None,
    ) -> None:
        self._proc = proc
        self._sock = sock
        self._timeout = timeout
        self.pump_while_waiting = pump
        """Called every millisecond while waiting for the child (drives the parent's side)."""
        self.name = ""
        self.capabilities = TransportCapabilities(
            memory_kinds=frozenset(), read=False, write=False, notifications=False,
            max_notification_bytes=0,
        )  # fmt: skip

    @classmethod
    def start(
        cls,
        spec: TransportSpec,
        endpoint_name: str,
        *,
        timeout: float = 30.0,
        pump: Callable[[], None] | None = None,
        env: Mapping[str, str] | None = None,
    ) -> ChildEndpoint:
        """Spawn a child and build ``spec``'s transport there as ``endpoint_name``.

        Raises what building the transport raised in the child (the child is then stopped),
        and ``TypeError`` for a spec with a callable factory.
        """
        wire = spec.for_child().to_wire()
        parent_sock, child_sock = socket.socketpair()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvframe.testing._endpoint", str(child_sock.fileno())],
                pass_fds=[child_sock.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=sys.stderr.fileno() if _has_fileno(sys.stderr) else None,
                env=None if env is None else {**os.environ, **env},
            )
        finally:
            child_sock.close()
        ep = cls(proc, parent_sock, timeout=timeout, pump=pump)
        try:
            ep.create(wire, endpoint_name)
        except BaseException:
            ep.kill()
            raise
        return ep

    @property
    def pid(self) -> int:
        """The child's process id."""
        return self._proc.pid

    def create(self, wire_spec: Mapping[str, Any], endpoint_name: str) -> None:
        """Build a new transport in the child (closing the previous one and its buffers);
        ``wire_spec`` is what :meth:`TransportSpec.to_wire` gives."""
        created = self._call(
            wire.Create(
                name=wire_spec["name"],
                options=wire_spec.get("options", {}),
                factory=wire_spec.get("factory"),
                endpoint_name=endpoint_name,
            ),
            wire.Created,
        )
        self.name = created.name
        self.capabilities = created.capabilities

    def kill(self) -> None:
        """Kill the child at once (SIGKILL), as a crash would. Idempotent."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._sock.close()

    def _call(self, command: object, expected: type[_A]) -> _A:
        """Send ``command`` and return the child's answer, which must be an ``expected``."""
        if self._sock.fileno() < 0:
            raise errors.PeerUnreachableError("the child endpoint was stopped")
        name = type(command).__name__
        try:
            wire.send(self._sock, command)
        except OSError as exc:
            raise errors.PeerUnreachableError(f"child endpoint is gone: {exc}") from exc
        deadline = time.monotonic() + self._timeout
        while True:
            readable, _, _ = select.select([self._sock], [], [], 0.001)
            if readable:
                break
            if self.pump_while_waiting is not None:
                self.pump_while_waiting()
            if time.monotonic() > deadline:
                raise errors.PeerUnreachableError(
                    f"child endpoint did not answer {name} within {self._timeout} s"
                )
        try:
            reply = wire.recv(self._sock)
        except (EOFError, OSError) as exc:
            raise errors.PeerUnreachableError(f"child endpoint is gone: {exc}") from exc
        except errors.CodecError as exc:
            raise errors.PeerUnreachableError(
                f"child endpoint answered {name} with a malformed frame: {exc}"
            ) from exc
        if isinstance(reply, wire.Failure):
            raise _error_from_wire(reply)
        if not isinstance(reply, expected):
            raise errors.PeerUnreachableError(
                f"child endpoint answered {name} with a {type(reply).__name__}, not a "
                f"{expected.__name__}"
            )
        return reply

    def _value(self, command: object) -> Any:
        return self._call(command, wire.Done).value

    def alloc(self, nbytes: int) -> MemoryRegion:
        """See :meth:`Endpoint.alloc`; runs in the child process."""
        return self._call(wire.Alloc(nbytes=nbytes), wire.Allocated).region

    def write(self, addr: int, data: bytes) -> None:
        """See :meth:`Endpoint.write`; runs in the child process."""
        self._value(wire.Write(addr=addr, data=bytes(data)))

    def read(self, addr: int, length: int) -> bytes:
        """See :meth:`Endpoint.read`; runs in the child process."""
        data: bytes = self._value(wire.Read(addr=addr, length=length))
        return data

    def checksum(self, addr: int, length: int) -> str:
        """See :meth:`Endpoint.checksum`; runs in the child process."""
        digest: str = self._value(wire.Checksum(addr=addr, length=length))
        return digest

    def register(self, regions: Sequence[MemoryRegion]) -> None:
        """See :meth:`Endpoint.register`; runs in the child process."""
        self._value(wire.Register(regions=tuple(regions)))

    def metadata(self) -> bytes:
        """See :meth:`Endpoint.metadata`; runs in the child process."""
        blob: bytes = self._value(wire.Metadata())
        return blob

    def add_peer(self, metadata: bytes) -> str:
        """See :meth:`Endpoint.add_peer`; runs in the child process."""
        name: str = self._value(wire.AddPeer(metadata=metadata))
        return name

    def remove_peer(self, peer: str) -> None:
        """See :meth:`Endpoint.remove_peer`; runs in the child process."""
        self._value(wire.RemovePeer(peer=peer))

    def prepare_local(self, layout: BlockLayout) -> int:
        """See :meth:`Endpoint.prepare_local`; runs in the child process."""
        lid: int = self._value(wire.PrepareLocal(layout=layout))
        return lid

    def prepare_remote(self, peer: str, layout: BlockLayout) -> int:
        """See :meth:`Endpoint.prepare_remote`; runs in the child process."""
        lid: int = self._value(wire.PrepareRemote(peer=peer, layout=layout))
        return lid

    def post(
        self,
        op: Op,
        local: int,
        local_blocks: Sequence[int],
        remote: int,
        remote_blocks: Sequence[int],
        *,
        regions: Sequence[int] | None = None,
        notification: bytes | None = None,
    ) -> int:
        """See :meth:`Endpoint.post`; runs in the child process."""
        xid: int = self._value(
            wire.Post(
                op=op,
                local=local,
                local_blocks=tuple(int(b) for b in local_blocks),
                remote=remote,
                remote_blocks=tuple(int(b) for b in remote_blocks),
                regions=None if regions is None else tuple(int(r) for r in regions),
                notification=notification,
            )
        )
        return xid

    def poll(self, xfer: int) -> XferStatus:
        """See :meth:`Endpoint.poll`; runs in the child process."""
        polled = self._call(wire.Poll(xfer=xfer), wire.Polled)
        error = None if polled.error is None else _error_from_wire(polled.error)
        assert error is None or isinstance(error, errors.TransportError)
        return XferStatus(
            state=polled.state,
            error=error,
            nbytes=polled.nbytes,
            transfer_seconds=polled.transfer_seconds,
        )

    def release(self, xfer: int) -> None:
        """See :meth:`Endpoint.release`; runs in the child process."""
        self._value(wire.Release(xfer=xfer))

    def notify(self, peer: str, payload: bytes) -> None:
        """See :meth:`Endpoint.notify`; runs in the child process."""
        self._value(wire.Notify(peer=peer, payload=bytes(payload)))

    def drain(self) -> list[Notification]:
        """See :meth:`Endpoint.drain`; runs in the child process."""
        return list(self._call(wire.Drain(), wire.Drained).notifications)

    def pump(self) -> None:
        """Nothing to do: the child makes progress by itself every millisecond."""

    def watch(
        self,
        payload: bytes,
        *,
        digest: Sequence[MemoryRegion] = (),
        invert: Sequence[MemoryRegion] = (),
    ) -> None:
        """See :meth:`Endpoint.watch`; armed in the child, which fires it in its own drain
        loop (every range must be inside the child's buffers)."""
        self._value(wire.Watch(payload=bytes(payload), digest=tuple(digest), invert=tuple(invert)))

    def deny_access(self, reason: str) -> None:
        """See :meth:`Endpoint.deny_access`; runs in the child process."""
        self._value(wire.DenyAccess(reason=reason))

    def sightings(self) -> dict[bytes, tuple[str, ...]]:
        """See :meth:`Endpoint.sightings`; runs in the child process."""
        seen = self._call(wire.Sightings(), wire.Sighted).sightings
        return {s.payload: tuple(s.digests) for s in seen}

    def close(self) -> None:
        """See :meth:`Endpoint.close`; runs in the child process."""
        self._value(wire.Close())

    def shutdown(self) -> None:
        """See :meth:`Endpoint.shutdown`; runs in the child process."""
        if self._proc.poll() is None and self._sock.fileno() >= 0:
            with contextlib.suppress(Exception):
                self._value(wire.Exit())
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10)
        self.kill()


def _has_fileno(stream: Any) -> bool:
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True


class _Server:
    """The child's command loop around one :class:`LocalEndpoint` at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.endpoint: LocalEndpoint | None = None
        self.running = True

    def _ep(self) -> LocalEndpoint:
        if self.endpoint is None:
            raise ValueError("no transport yet: send 'create' first")
        return self.endpoint

    def handle(self, command: object) -> object:
        """Run one command; the answer to send back (raises what the endpoint raised)."""
        if isinstance(command, wire.Create):
            if self.endpoint is not None:
                self.endpoint.shutdown()
                self.endpoint = None
            spec = TransportSpec(
                name=command.name, options=thaw_plain(command.options), factory=command.factory
            )
            self.endpoint = LocalEndpoint(spec.build(command.endpoint_name))
            return wire.Created(name=self.endpoint.name, capabilities=self.endpoint.capabilities)
        if isinstance(command, wire.Exit):
            self.running = False
            return wire.Done()
        ep = self._ep()
        if isinstance(command, wire.Alloc):
            return wire.Allocated(region=ep.alloc(command.nbytes))
        if isinstance(command, wire.Poll):
            status = ep.poll(command.xfer)
            err = None if status.error is None else _error_to_wire(status.error, kvframe=True)
            return wire.Polled(
                state=status.state,
                error=err,
                nbytes=status.nbytes,
                transfer_seconds=status.transfer_seconds,
            )
        if isinstance(command, wire.Drain):
            return wire.Drained(notifications=tuple(ep.drain()))
        if isinstance(command, wire.Sightings):
            seen = ep.sightings().items()
            return wire.Sighted(
                sightings=tuple(wire.Sighting(payload=k, digests=v) for k, v in seen)
            )
        return wire.Done(value=self._run(ep, command))

    @staticmethod
    def _run(ep: LocalEndpoint, command: object) -> Any:
        """The commands whose answer is a plain value."""
        if isinstance(command, wire.Write):
            return ep.write(command.addr, command.data)
        if isinstance(command, wire.Read):
            return ep.read(command.addr, command.length)
        if isinstance(command, wire.Checksum):
            return ep.checksum(command.addr, command.length)
        if isinstance(command, wire.Register):
            return ep.register(command.regions)
        if isinstance(command, wire.Metadata):
            return ep.metadata()
        if isinstance(command, wire.AddPeer):
            return ep.add_peer(command.metadata)
        if isinstance(command, wire.RemovePeer):
            return ep.remove_peer(command.peer)
        if isinstance(command, wire.PrepareLocal):
            return ep.prepare_local(command.layout)
        if isinstance(command, wire.PrepareRemote):
            return ep.prepare_remote(command.peer, command.layout)
        if isinstance(command, wire.Post):
            return ep.post(
                command.op,
                command.local,
                command.local_blocks,
                command.remote,
                command.remote_blocks,
                regions=command.regions,
                notification=command.notification,
            )
        if isinstance(command, wire.Release):
            return ep.release(command.xfer)
        if isinstance(command, wire.Notify):
            return ep.notify(command.peer, command.payload)
        if isinstance(command, wire.Close):
            return ep.close()
        if isinstance(command, wire.Watch):
            return ep.watch(command.payload, digest=command.digest, invert=command.invert)
        if isinstance(command, wire.DenyAccess):
            return ep.deny_access(command.reason)
        raise ValueError(f"unknown endpoint command {type(command).__name__}")

    def serve(self) -> None:
        while self.running:
            readable, _, _ = select.select([self.sock], [], [], 0.001)
            if readable:
                reply: object
                try:
                    reply = self.handle(wire.recv(self.sock))
                except (EOFError, OSError):
                    break  # the parent is gone (or sent a frame the stream cannot survive)
                except Exception as exc:  # a malformed command included: answer, keep serving
                    reply = _error_to_wire(exc)
                try:
                    wire.send(self.sock, reply)
                except OSError:
                    break
                except (TypeError, ValueError) as exc:  # a result the wire cannot carry
                    wire.send(self.sock, _error_to_wire(exc))
            if self.endpoint is not None:
                # a failing peer must not take the child down; the parent sees it in poll()
                with contextlib.suppress(errors.TransportError):
                    self.endpoint.pump()
        if self.endpoint is not None:
            self.endpoint.shutdown()


def serve_child(fd: int) -> None:
    """Run the child's command loop on the inherited socket ``fd`` until told to exit or the
    parent goes away (used by ``python -m kvframe.testing._endpoint``)."""
    sock = socket.socket(fileno=fd)
    try:
        _Server(sock).serve()
    finally:
        sock.close()
