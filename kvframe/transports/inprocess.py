"""The built-in in-process transport: memcpy between registered regions of one process.

Capability card
---------------

=======================  =========================================================
memory kinds             ``HOST`` (``ctypes.memmove``); ``DEVICE`` too when
                         ``torch.cuda.is_available()`` (copied with torch)
READ / WRITE             both (each can be switched off with an option, to test a
                         connector's capability checks)
notifications            yes, up to ``max_notification_bytes`` (default 64 KiB),
                         ordered per sender; a post's notification is queued only
                         after its bytes were copied (``notification_after_data``)
cross process            no: endpoints find each other through an
                         :class:`InProcessFabric` in the same process
completion               asynchronous: a transfer moves its bytes on a *later*
                         progress step (``poll``, ``progress`` or
                         ``drain_notifications``), never inside ``post``
=======================  =========================================================

Options (``TransportParams.options``; unknown keys and bad values raise
:class:`~kvframe.errors.ConfigError` naming the key):

- ``fabric`` — the :class:`InProcessFabric` to join. Default: the process's default fabric
  (:func:`default_fabric`), which is what the factory registered under the name ``inprocess``
  uses. Tests should build their own fabric so that endpoint names and faults cannot leak
  between tests.
- ``completion_polls`` (int ≥ 1, default 1) — how many progress steps of the posting endpoint
  pass before a transfer moves its bytes and answers ``DONE``.
- ``max_notification_bytes`` (int ≥ 1, default 65536).
- ``read``, ``write``, ``notifications`` (bool, default True) — switch a capability off.

Peers: ``add_peer`` of a known name is a rebuild (the SPI's rule): the old entry's pending
transfers fail with :class:`~kvframe.errors.PeerUnreachableError`; remote layouts prepared for
the same incarnation of the peer keep working, those of a closed endpoint's older incarnation
are refused.

Hooks
-----

Before a transfer moves its bytes and before a notification is queued, the fabric asks its
:attr:`InProcessFabric.hooks` (a :class:`FabricHooks`) what to do, and whether an endpoint is
cut off. The default hooks change nothing. Fault injection — dropping, delaying or corrupting
notifications, failing or delaying transfers, making an endpoint vanish — is
:class:`kvframe.testing.faults.Faults`, which installs itself as a fabric's hooks::

    from kvframe.testing.faults import Faults

    faults = Faults.of(fabric)
    faults.fail_transfers(peer="P", nth=2, written=0.5)  # 2nd transfer to P: half lands

Nothing here reads a clock: delays are counted in progress steps, so tests are deterministic.
"""

from __future__ import annotations

import ctypes
import itertools
import uuid
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import msgpack
import numpy as np

from kvframe.errors import (
    ConfigError,
    PeerUnreachableError,
    TransferFailedError,
    TransportClosedError,
    TransportError,
)
from kvframe.spi import transport_kit as kit
from kvframe.spi.hookspecs import TransportRegistrar, hookimpl
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

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = [
    "DEFAULT_MAX_NOTIFICATION_BYTES",
    "TRANSPORT_NAME",
    "FabricHooks",
    "InProcessFabric",
    "InProcessTransport",
    "NotificationVerdict",
    "TransferVerdict",
    "capabilities",
    "default_fabric",
    "kvframe_register_transports",
]

#: The name under which the built-in transport is registered.
TRANSPORT_NAME = "inprocess"
#: Default limit of a notification payload.
DEFAULT_MAX_NOTIFICATION_BYTES = 64 * 1024

_METADATA_VERSION = 1
_HOST = -1  # device id used for host memory in descriptor arrays


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def capabilities(
    *,
    read: bool = True,
    write: bool = True,
    notifications: bool = True,
    max_notification_bytes: int = DEFAULT_MAX_NOTIFICATION_BYTES,
) -> TransportCapabilities:
    """The capability card of an in-process transport built with these options.

    ``DEVICE`` memory is included only when torch is installed and sees a CUDA device.
    """
    kinds: set[MemoryKind] = {MemoryKind.HOST}
    if _cuda_available():
        kinds.add(MemoryKind.DEVICE)
    return TransportCapabilities(
        memory_kinds=frozenset(kinds),
        read=read,
        write=write,
        notifications=notifications,
        max_notification_bytes=max_notification_bytes if notifications else 0,
        cross_process=False,
        ordered_notifications=True,
        notification_after_data=True,
    )


# -- hooks ----------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TransferVerdict:
    """What :meth:`FabricHooks.transfer` answers for one transfer."""

    delay: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """More progress steps to wait before the bytes move (asked once per transfer)."""
    fail_after: float | None = attrs.field(default=None)
    """Fail the transfer with :class:`~kvframe.errors.TransferFailedError` after copying this
    fraction of its descriptors (0.0: no byte lands); ``None``: it succeeds."""

    @fail_after.validator
    def _check_fail_after(self, attribute: attrs.Attribute[Any], value: float | None) -> None:
        if value is not None and not 0.0 <= value <= 1.0:
            raise ValueError(f"fail_after={value}: give a fraction between 0.0 and 1.0")


@attrs.frozen(kw_only=True)
class NotificationVerdict:
    """What :meth:`FabricHooks.notification` answers for one notification."""

    payload: bytes | None
    """What the receiver gets; ``None`` drops the notification (the send still returns)."""
    delay: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Progress steps of the receiver before it can drain it; later notifications from the
    same sender wait behind it."""


_GO = TransferVerdict()


class FabricHooks:
    """What a fabric asks before it acts. This base changes nothing; override what you need.

    :class:`kvframe.testing.faults.Faults` is the fault-injecting subclass. Hooks are called
    from the transport's caller thread, inside ``post``/``poll``/``progress``/
    ``drain_notifications``/``send_notification``; they must not call the transport back.
    """

    def transfer(self, *, endpoint: str, peer: str, op: Op, nbytes: int) -> TransferVerdict:
        """Asked once per transfer, when it is first due: ``endpoint`` posted it to ``peer``."""
        return _GO

    def notification(self, *, endpoint: str, peer: str, payload: bytes) -> NotificationVerdict:
        """Asked once per notification ``endpoint`` sends to ``peer`` (standalone or after a
        transfer)."""
        return NotificationVerdict(payload=payload)

    def cut_off(self, endpoint: str) -> bool:
        """Whether ``endpoint`` is unreachable, as if its process died: transfers with it fail
        with :class:`~kvframe.errors.PeerUnreachableError`, sends and ``add_peer`` with it
        raise it, and what it sent but nobody drained is lost."""
        return False


# -- the fabric -----------------------------------------------------------------------------


class InProcessFabric:
    """A registry through which in-process transports of one process find each other.

    Each fabric is independent: endpoint names, peers and :attr:`hooks` never cross fabrics,
    so a test that builds its own fabric cannot see another test's endpoints.
    """

    def __init__(self, hooks: FabricHooks | None = None) -> None:
        """An empty fabric asking ``hooks`` (default: hooks that change nothing)."""
        self.id = uuid.uuid4().hex
        """Identifies the fabric in endpoint metadata."""
        self.hooks: FabricHooks = hooks if hooks is not None else FabricHooks()
        """What the fabric asks before it moves bytes or delivers a notification; replace it
        to inject faults (:meth:`kvframe.testing.faults.Faults.of` does)."""
        self._endpoints: dict[str, InProcessTransport] = {}
        self._incarnations = itertools.count(1)
        self._notification_seq = itertools.count()  # orders one drain across senders

    def create(self, params: TransportParams) -> InProcessTransport:
        """A :class:`~kvframe.spi.transport.TransportFactory` bound to this fabric.

        Raises :class:`~kvframe.errors.ConfigError` for bad options or a name already used
        by an open endpoint of this fabric; then nothing was created.
        """
        options = dict(params.options)
        if "fabric" in options and options["fabric"] is not self:
            raise ConfigError(
                "inprocess transport_options.fabric names another fabric than the one whose "
                "create() was called; drop the option or call that fabric's create()"
            )
        options["fabric"] = self
        return InProcessTransport(TransportParams(name=params.name, options=options))

    def transport(self, name: str, **options: Any) -> InProcessTransport:
        """Shorthand for ``create(TransportParams(name=name, options=options))``."""
        return self.create(TransportParams(name=name, options=options))

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Names of the open endpoints of this fabric."""
        return tuple(self._endpoints)

    def _join(self, transport: InProcessTransport) -> int:
        if transport.name in self._endpoints:
            raise ConfigError(
                f"an open in-process endpoint named {transport.name!r} already exists in this "
                "fabric; close it first or give the new endpoint another name"
            )
        self._endpoints[transport.name] = transport
        return next(self._incarnations)

    def _leave(self, transport: InProcessTransport) -> None:
        if self._endpoints.get(transport.name) is transport:
            del self._endpoints[transport.name]

    def _lookup(self, name: str) -> InProcessTransport | None:
        return self._endpoints.get(name)


_DEFAULT_FABRIC: InProcessFabric | None = None


def default_fabric() -> InProcessFabric:
    """The process's default fabric, used when no ``fabric`` option is given.

    It lives as long as the process. Endpoints leave it when closed, so code that closes its
    transports can share it; tests that inject faults should build their own fabric.
    """
    global _DEFAULT_FABRIC
    if _DEFAULT_FABRIC is None:
        _DEFAULT_FABRIC = InProcessFabric()
    return _DEFAULT_FABRIC


# -- the transport --------------------------------------------------------------------------


@attrs.frozen(eq=False)
class _Table:
    """A layout's descriptors, region-major: address, length and device (``_HOST``) each."""

    addrs: npt.NDArray[np.int64]
    lens: npt.NDArray[np.int64]
    devs: npt.NDArray[np.int64]


@attrs.define(eq=False)
class _Copy:
    """What a pending in-process transfer copies, and when."""

    op: Op
    peer: InProcessTransport
    src: npt.NDArray[np.int64]
    dst: npt.NDArray[np.int64]
    lens: npt.NDArray[np.int64]
    src_devs: npt.NDArray[np.int64]
    dst_devs: npt.NDArray[np.int64]
    due: int
    notification: bytes | None
    asked: bool = False  # the hooks are asked once per transfer
    fail_after: float | None = None


@attrs.define(eq=False)
class _Incoming:
    seq: int
    sender: InProcessTransport
    payload: bytes
    ready_at: int


_OPTIONS = kit.TransportOptions(
    TRANSPORT_NAME,
    kit.instance("fabric", InProcessFabric, None),
    kit.integer(
        "completion_polls", 1, minimum=1, note="transfers complete on a later progress step"
    ),
    kit.integer("max_notification_bytes", DEFAULT_MAX_NOTIFICATION_BYTES, minimum=1),
    kit.flag("read", True),
    kit.flag("write", True),
    kit.flag("notifications", True),
)


class InProcessTransport(Transport):
    """An endpoint of an :class:`InProcessFabric`. See the module docstring for the card.

    Build it through a fabric (:meth:`InProcessFabric.create`) or the registered factory.
    Raises :class:`~kvframe.errors.ConfigError` for unknown or ill-typed options and for a
    name already open in the fabric; then nothing was created.
    """

    def __init__(self, params: TransportParams) -> None:
        opts = _OPTIONS.parse(params.options)
        if not params.name:
            raise ConfigError("an in-process endpoint needs a non-empty name")
        fabric: InProcessFabric = opts["fabric"] or default_fabric()
        self._completion_polls: int = opts["completion_polls"]
        self.capabilities = capabilities(
            read=opts["read"],
            write=opts["write"],
            notifications=opts["notifications"],
            max_notification_bytes=opts["max_notification_bytes"],
        )
        self._name = params.name
        self._who = f"in-process transport {params.name!r}"
        self._fabric = fabric
        self._guard = kit.OpenGuard(self._who)
        self._tick = 0
        self._regions: list[MemoryRegion] = []
        self._peers: kit.PeerTable[InProcessTransport] = kit.PeerTable(
            self._who, self._teardown_peer
        )
        self._pending: list[kit.Transfer[_Copy]] = []
        self._inbox: dict[str, deque[_Incoming]] = {}
        self._stats: dict[str, float] = dict.fromkeys(
            (
                "bytes_read",
                "bytes_written",
                "transfers_done",
                "transfers_failed",
                "notifications_sent",
                "notifications_received",
            ),
            0.0,
        )
        self._incarnation = fabric._join(self)

    @property
    def name(self) -> str:
        """This endpoint's name, unique among the open endpoints of its fabric."""
        return self._name

    @property
    def fabric(self) -> InProcessFabric:
        """The fabric this endpoint belongs to."""
        return self._fabric

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._guard.closed

    # -- memory -----------------------------------------------------------------------------
    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        """Record regions as transferable. ``DEVICE`` memory needs torch with CUDA.

        Raises :class:`~kvframe.errors.CapabilityError` for an unsupported memory kind and
        ``ValueError`` for something that is not a :class:`MemoryRegion`; then nothing was
        registered.
        """
        self._guard.check()
        hint = "device memory needs torch with a visible CUDA device"
        self._regions.extend(kit.check_regions(regions, self.capabilities, self._who, hint))

    def local_metadata(self) -> bytes:
        """msgpack of the fabric id, this endpoint's name and its incarnation."""
        self._guard.check()
        blob: bytes = msgpack.packb(
            {
                "v": _METADATA_VERSION,
                "fabric": self._fabric.id,
                "name": self._name,
                "incarnation": self._incarnation,
            },
            use_bin_type=True,
        )
        return blob

    def add_peer(self, metadata: bytes) -> str:
        """Find the endpoint the metadata describes in this fabric; see the SPI contract (a
        known name is rebuilt: its pending transfers fail).

        Raises :class:`~kvframe.errors.PeerUnreachableError` for metadata that does not
        decode or comes from another fabric (or process) — a known peer is left as it was
        then — and for metadata that names a closed endpoint, an older incarnation or a
        vanished endpoint — a known peer of that name was torn down first then.
        """
        self._guard.check()
        try:
            meta = msgpack.unpackb(metadata, raw=False)
            version, fabric_id = meta["v"], meta["fabric"]
            name, incarnation = str(meta["name"]), meta["incarnation"]
        except Exception as exc:
            raise PeerUnreachableError(
                "in-process peer metadata does not decode; pass the bytes another in-process "
                "endpoint's local_metadata() returned"
            ) from exc
        if version != _METADATA_VERSION:
            raise PeerUnreachableError(f"in-process metadata version {version!r} is not 1")
        if fabric_id != self._fabric.id:
            raise PeerUnreachableError(
                f"peer {name!r} belongs to another InProcessFabric (or another process); "
                "in-process endpoints only reach endpoints of their own fabric"
            )

        def connect() -> InProcessTransport:
            peer = self._fabric._lookup(name)
            if peer is None or peer._incarnation != incarnation:
                raise PeerUnreachableError(f"in-process peer {name!r} is closed (stale metadata)")
            if self._cut_off(name):
                raise PeerUnreachableError(f"in-process peer {name!r} is unreachable (vanished)")
            return peer

        self._peers.add(name, incarnation, connect)
        return name

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer``; its pending transfers answer ``FAILED`` (PeerUnreachableError)."""
        self._guard.check()
        # notifications it sent before the removal arrived already; they stay drainable
        self._peers.remove(peer)

    def prepare_local(self, layout: BlockLayout) -> LayoutHandle:
        """Descriptors for a layout of this endpoint's registered memory.

        Raises ``ValueError`` when a region of the layout is not inside registered memory.
        """
        self._guard.check()
        kit.check_inside(layout, self._regions, "this endpoint")
        return LayoutHandle(
            layout=layout, peer=None, native=kit.Prepared.local(self, _table(layout))
        )

    def prepare_remote(self, peer: str, layout: BlockLayout) -> LayoutHandle:
        """Descriptors for a peer's layout.

        Raises :class:`~kvframe.errors.PeerUnreachableError` for an unknown or unreachable
        peer and ``ValueError`` when the layout is not inside the peer's registered memory.
        """
        self._guard.check()
        target = self._reachable(peer)
        kit.check_inside(layout, target._regions, f"peer {peer!r}")
        prepared = self._peers.prepared(self, peer, _table(layout))
        return LayoutHandle(layout=layout, peer=peer, native=prepared)

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
        """Queue a transfer; its bytes move on a later progress step. See the SPI contract."""
        self._guard.check()
        req = kit.check_post(
            self, self._peers, op, local, local_blocks, remote, remote_blocks,
            regions=regions, notification=notification,
        )  # fmt: skip
        target = self._reachable(req.peer.name)
        lt: _Table = req.local
        rt: _Table = req.remote
        lids, rids = req.pairs.local, req.pairs.remote
        if op is Op.READ:
            src, sdev, dst, ddev = rt.addrs[rids], rt.devs[rids], lt.addrs[lids], lt.devs[lids]
        else:
            src, sdev, dst, ddev = lt.addrs[lids], lt.devs[lids], rt.addrs[rids], rt.devs[rids]
        copy = _Copy(
            op=op,
            peer=target,
            src=src,
            dst=dst,
            lens=lt.lens[lids],
            src_devs=sdev,
            dst_devs=ddev,
            due=self._tick + self._completion_polls,
            notification=req.notification,
        )
        handle, tr = kit.Transfer.post(self, copy, op=op, peer=target.name, pairs=req.pairs)
        self._pending.append(tr)
        return handle

    def poll(self, handle: XferHandle) -> XferStatus:
        """Make one progress step, then answer the transfer's status."""
        self._guard.check()
        tr = kit.Transfer.polling(handle, self, _Copy)  # TransportClosedError once released
        self._step()
        return tr.status

    def release(self, handle: XferHandle) -> None:
        """Stop a pending transfer (none of its bytes move) and forget it. Idempotent."""
        tr = kit.Transfer.of(handle, self, _Copy)
        if tr.release() and tr in self._pending:
            self._pending.remove(tr)
            tr.fail(TransferFailedError("released while pending"))

    # -- notifications ----------------------------------------------------------------------
    def send_notification(self, peer: str, payload: bytes) -> None:
        """Deliver ``payload`` to ``peer``'s inbox (subject to the fabric's hooks)."""
        self._guard.check()
        data = kit.check_notification(payload, self.capabilities, self._who)
        target = self._reachable(peer)
        self._deliver(target, data)

    def drain_notifications(self) -> list[Notification]:
        """Make one progress step, then return every ready notification, oldest first."""
        self._guard.check()
        self._step()
        ready: list[_Incoming] = []
        for sender, queue in list(self._inbox.items()):
            if self._fabric.hooks.cut_off(sender):
                queue.clear()  # sent by an endpoint that "died" before we drained it
            while queue and queue[0].ready_at <= self._tick:
                ready.append(queue.popleft())
        ready.sort(key=lambda n: n.seq)
        self._stats["notifications_received"] += len(ready)
        return [Notification(sender=n.sender.name, payload=n.payload) for n in ready]

    def progress(self) -> None:
        """Make one progress step: due transfers move their bytes."""
        self._guard.check()
        self._step()

    def stats(self) -> Mapping[str, float]:
        """Counters: ``bytes_read``, ``bytes_written``, ``transfers_done``,
        ``transfers_failed``, ``notifications_sent``, ``notifications_received``."""
        return dict(self._stats)

    def close(self) -> None:
        """Leave the fabric and forget everything; pending transfers move no more bytes.
        Idempotent."""
        if not self._guard.close():
            return
        for tr in self._pending:
            tr.fail(TransportClosedError(f"{self._who} was closed"))
        self._pending.clear()
        self._peers.clear("the transport was closed")
        self._inbox.clear()
        self._regions.clear()
        self._fabric._leave(self)

    # -- internals --------------------------------------------------------------------------
    def _cut_off(self, peer: str) -> bool:
        hooks = self._fabric.hooks
        return hooks.cut_off(peer) or hooks.cut_off(self._name)

    def _alive(self, peer: InProcessTransport) -> bool:
        return (
            not peer.closed
            and self._fabric._lookup(peer.name) is peer
            and not self._cut_off(peer.name)
        )

    def _reachable(self, name: str) -> InProcessTransport:
        peer = self._peers.get(name).conn
        if not self._alive(peer):
            raise PeerUnreachableError(f"peer {name!r} is unreachable (closed or vanished)")
        return peer

    def _teardown_peer(self, peer: InProcessTransport, why: str) -> None:
        for tr in list(self._pending):
            if tr.record.peer is peer:
                self._finish(tr, PeerUnreachableError(why))

    def _step(self) -> None:
        self._tick += 1
        for tr in list(self._pending):
            if tr not in self._pending:
                continue  # stopped by a hook meanwhile
            if not self._alive(tr.record.peer):
                self._finish(
                    tr, PeerUnreachableError(f"peer {tr.record.peer.name!r} became unreachable")
                )
            elif tr.record.due <= self._tick:
                self._execute(tr)

    def _execute(self, tr: kit.Transfer[_Copy]) -> None:
        copy = tr.record
        if not copy.asked:
            copy.asked = True
            verdict = self._fabric.hooks.transfer(
                endpoint=self._name, peer=copy.peer.name, op=tr.record.op, nbytes=tr.nbytes
            )
            copy.fail_after = verdict.fail_after
            if verdict.delay:
                copy.due = self._tick + verdict.delay
                return
        n = len(copy.lens)
        count = n if copy.fail_after is None else int(n * copy.fail_after)
        try:
            _copy(copy.src[:count], copy.dst[:count], copy.lens[:count], copy, count)
        except Exception as exc:
            self._finish(tr, TransferFailedError(f"copy failed: {exc}"))
            return
        if copy.fail_after is not None:
            self._finish(
                tr,
                TransferFailedError(
                    f"injected fault: transfer to {copy.peer.name!r} failed after "
                    f"{count} of {n} descriptors"
                ),
            )
            return
        key = "bytes_read" if tr.record.op is Op.READ else "bytes_written"
        self._stats[key] += tr.nbytes
        self._finish(tr, None)
        if copy.notification is not None:
            self._deliver(copy.peer, copy.notification)

    def _finish(self, tr: kit.Transfer[_Copy], error: TransportError | None) -> None:
        self._pending.remove(tr)
        if error is None:
            tr.done()
            self._stats["transfers_done"] += 1
        else:
            tr.fail(error)
            self._stats["transfers_failed"] += 1

    def _deliver(self, target: InProcessTransport, payload: bytes) -> None:
        self._stats["notifications_sent"] += 1
        verdict = self._fabric.hooks.notification(
            endpoint=self._name, peer=target.name, payload=payload
        )
        if verdict.payload is None:
            return
        queue = target._inbox.setdefault(self._name, deque())
        # keep per-sender order: nothing overtakes a delayed notification
        ready_at = target._tick + verdict.delay
        if queue:
            ready_at = max(ready_at, queue[-1].ready_at)
        queue.append(
            _Incoming(
                seq=next(self._fabric._notification_seq),
                sender=self,
                payload=bytes(verdict.payload),
                ready_at=ready_at,
            )
        )


def _table(layout: BlockLayout) -> _Table:
    addrs, lens = kit.block_table(layout)
    dev = np.array(
        [r.device_id if r.kind is MemoryKind.DEVICE else _HOST for r in layout.regions],
        dtype=np.int64,
    )
    return _Table(addrs=addrs, lens=lens, devs=np.repeat(dev, layout.num_blocks))


class _CudaPointer:
    """Exposes a raw device pointer to torch through ``__cuda_array_interface__``."""

    def __init__(self, addr: int, length: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (length,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 2,
            "strides": None,
        }


def _torch_view(addr: int, length: int, dev: int) -> Any:
    import torch

    if dev == _HOST:
        buf = (ctypes.c_ubyte * length).from_address(addr)
        return torch.frombuffer(buf, dtype=torch.uint8)
    return torch.as_tensor(_CudaPointer(addr, length), device=f"cuda:{dev}")


def _copy(
    src: npt.NDArray[np.int64],
    dst: npt.NDArray[np.int64],
    lens: npt.NDArray[np.int64],
    xfer: _Copy,
    count: int,
) -> None:
    if count == 0:
        return
    sdev, ddev = xfer.src_devs[:count], xfer.dst_devs[:count]
    if bool((sdev == _HOST).all() and (ddev == _HOST).all()):
        # coalesce runs that are contiguous on both sides into one memmove
        ends_s, ends_d = src + lens, dst + lens
        breaks = np.flatnonzero((src[1:] != ends_s[:-1]) | (dst[1:] != ends_d[:-1])) + 1
        starts = np.concatenate(([0], breaks))
        run_lens = np.add.reduceat(lens, starts)
        for s, d, n in zip(
            src[starts].tolist(), dst[starts].tolist(), run_lens.tolist(), strict=True
        ):
            ctypes.memmove(d, s, n)
        return
    import torch

    devices: set[int] = set()
    for s, d, n, sd, dd in zip(
        src.tolist(), dst.tolist(), lens.tolist(), sdev.tolist(), ddev.tolist(), strict=True
    ):
        _torch_view(d, n, dd).copy_(_torch_view(s, n, sd))
        devices.update(x for x in (sd, dd) if x != _HOST)
    for dev in devices:
        torch.cuda.synchronize(dev)  # DONE promises every byte landed


def _default_factory(params: TransportParams) -> Transport:
    return InProcessTransport(params)


@hookimpl
def kvframe_register_transports(register: TransportRegistrar) -> None:
    """Register the built-in ``inprocess`` transport (on the default fabric unless the
    ``fabric`` option names another)."""
    register(TRANSPORT_NAME, _default_factory, capabilities=capabilities())
