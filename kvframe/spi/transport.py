"""The transport SPI: what a transport plugin implements.

A *transport* moves bytes between memory regions of two processes (possibly on two hosts) and
carries small notifications between them. kvframe's connectors drive it; they never talk to
NIXL, UCX or sockets directly. A plugin provides a :class:`Transport` subclass and registers a
factory for it through the ``kvframe_register_transports`` hook (see :mod:`kvframe.spi.hookspecs`).

The life of a transport, in the order a connector calls it::

    t = factory(TransportParams(...))            # create; owns native resources from here on
    t.register_memory([MemoryRegion, ...])       # once, at start-up (host or device memory)
    local = t.prepare_local(layout)              # once per region set
    blob = t.local_metadata()                    # ship to peers over the side channel
    peer = t.add_peer(remote_blob)               # once per remote engine (and after a restart)
    remote = t.prepare_remote(peer, remote_layout)   # once per peer and region set
    w = t.warm_up(peer)                          # optional (capabilities.warm_up): poll, release
    h = t.post(READ, local, [3, 4], remote, [10, 11], notification=b"done")  # per request
    while not t.poll(h).stopped: ...             # or poll many handles once per engine step
    t.release(h)                                 # always, whatever the state
    t.send_notification(peer, b"...")            # small control messages
    for n in t.drain_notifications(): ...        # also drives progress; call it often
    t.close()                                    # always releases everything; safe twice

**Blocks and descriptors.** A :class:`BlockLayout` cuts each registered region into equal
blocks (a KV cache of one layer is typically one or two regions: K and V). Block ``b`` of region
``r`` is the byte range ``[base_r + b * block_len_r, base_r + (b + 1) * block_len_r)``.
:meth:`Transport.post` moves the listed blocks of the listed regions; local block ``i`` of the
request pairs with remote block ``i``. Transports prepare descriptor lists once in
``prepare_local``/``prepare_remote`` and compute per-request descriptor indices vectorised
(:func:`kvframe.spi.transport_kit.pair_descriptors`), so the per-request cost is independent
of the layout's size.

**Handles and status.** :meth:`Transport.post` returns a frozen :class:`XferHandle` (what the
transfer moves); :meth:`Transport.poll` answers a frozen :class:`XferStatus` (what it has done:
state, error, bytes landed, transfer time). Nothing a caller holds changes under it.

**Peers.** :meth:`Transport.add_peer` of a name that is already known is a *rebuild*: the old
connection is torn down first (its in-flight transfers fail with
:class:`~kvframe.errors.PeerUnreachableError`) and a new one is made. Remote layouts prepared
for the same incarnation (the same metadata) keep working; those of an older incarnation, or
prepared before a :meth:`~Transport.remove_peer`, are refused with ``PeerUnreachableError``.

The shared code every shipped transport uses for these rules — descriptor pairing, payload
checks, the peer table, option parsing, the closed guard, transfer records — is
:mod:`kvframe.spi.transport_kit`.

**Threads.** A transport is used from one thread at a time (the connector's). Methods are not
re-entrant. Implementations may use threads internally but must not call back into the caller.

**Progress.** Some backends (NIXL without its progress thread) make progress only when called.
The caller promises to call :meth:`Transport.progress` or :meth:`Transport.drain_notifications`
at least once per engine step, and at least every few milliseconds while it waits for
anything (a transfer, a notification, a connecting peer). Implementations that need no explicit
progress implement :meth:`~Transport.progress` as a no-op.

**Errors and what is left.** Native errors are translated to :mod:`kvframe.errors` in one place
per plugin (``raise ... from native``):

- :class:`~kvframe.errors.TransportClosedError` — *you* used something after ``close()`` or
  ``release()``. Nothing happened.
- :class:`~kvframe.errors.PeerUnreachableError` — the peer is gone or unknown. In-flight
  transfers with it are stopped (``poll`` answers ``FAILED``); add it again to reuse it.
- :class:`~kvframe.errors.TransferFailedError` — one transfer failed; it has stopped and its
  destination bytes are undefined. The transport stays usable.
- :class:`~kvframe.errors.CapabilityError` — not supported (memory kind, WRITE, a notification
  over the size limit). Nothing happened.
- ``ValueError`` (plain) — malformed arguments (block index out of range, length mismatch,
  unknown layout handle). Nothing happened.

A transfer that has *stopped* will write no more bytes: after ``poll`` returns ``DONE`` or
``FAILED``, or after ``release``, the destination blocks may be reused at once.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from kvframe.errors import CapabilityError, TransportError

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = [
    "AccessCheck",
    "BlockLayout",
    "LayoutHandle",
    "MemoryKind",
    "MemoryRegion",
    "Notification",
    "Op",
    "Transport",
    "TransportCapabilities",
    "TransportFactory",
    "TransportParams",
    "XferHandle",
    "XferState",
    "XferStatus",
]


class MemoryKind(enum.Enum):
    """Where a region lives."""

    HOST = "host"
    """Process memory (pageable or pinned)."""
    DEVICE = "device"
    """Accelerator memory (CUDA), identified by ``device_id``."""


class Op(enum.Enum):
    """Direction of a transfer, seen from the side that posts it."""

    READ = "read"
    """Pull: remote blocks are copied into local blocks."""
    WRITE = "write"
    """Push: local blocks are copied into remote blocks."""


class XferState(enum.Enum):
    """What :meth:`Transport.poll` answers."""

    PENDING = "pending"
    """Still moving; poll again later."""
    DONE = "done"
    """Every byte landed. The notification (if any) was sent to the peer."""
    FAILED = "failed"
    """Stopped without completing; destination bytes are undefined. ``XferStatus.error`` says
    why."""


@attrs.frozen(kw_only=True)
class MemoryRegion:
    """A contiguous range of memory to register with a transport.

    Build one from raw numbers or from a tensor with :meth:`from_tensor`.
    """

    addr: int = attrs.field(validator=attrs.validators.ge(0))
    """Start address (a virtual address for host memory, a device pointer for device memory)."""
    length: int = attrs.field(validator=attrs.validators.gt(0))
    """Size in bytes."""
    kind: MemoryKind = MemoryKind.HOST
    device_id: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Device index for ``DEVICE`` memory; 0 for host memory."""

    @classmethod
    def from_tensor(cls, tensor: Any) -> MemoryRegion:
        """The region covering a contiguous torch tensor (CPU or CUDA).

        Raises ``ValueError`` for a non-contiguous or empty tensor: a transport registers
        address ranges, and a strided view would silently register the wrong bytes.
        """
        if not tensor.is_contiguous():
            raise ValueError(
                "tensor is not contiguous; register the contiguous base tensor "
                "(or call .contiguous() and keep that copy alive)"
            )
        nbytes = int(tensor.numel() * tensor.element_size())
        if nbytes == 0:
            raise ValueError("tensor is empty; there is nothing to register")
        is_cuda = tensor.device.type == "cuda"
        return cls(
            addr=int(tensor.data_ptr()),
            length=nbytes,
            kind=MemoryKind.DEVICE if is_cuda else MemoryKind.HOST,
            device_id=int(tensor.device.index or 0) if is_cuda else 0,
        )


def _regions_tuple(value: Iterable[MemoryRegion]) -> tuple[MemoryRegion, ...]:
    return tuple(value)


def _ints_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _kinds_frozenset(value: Iterable[MemoryKind]) -> frozenset[MemoryKind]:
    return frozenset(value)


def _check_regions(
    instance: BlockLayout, attribute: attrs.Attribute[Any], value: tuple[MemoryRegion, ...]
) -> None:
    if not value:
        raise ValueError("a BlockLayout needs at least one region")


@attrs.frozen(kw_only=True)
class BlockLayout:
    """Registered regions, each cut into ``num_blocks`` equal blocks.

    ``block_lens[r]`` is the block size of region ``r`` in bytes; every region has the same
    number of blocks (a block id names the same logical block in every region, as a KV block id
    names the same tokens in every layer). A layout is a plain value: the remote side's layout
    travels in the handshake and is given to :meth:`Transport.prepare_remote`.
    """

    regions: tuple[MemoryRegion, ...] = attrs.field(
        converter=_regions_tuple, validator=_check_regions
    )
    block_lens: tuple[int, ...] = attrs.field(converter=_ints_tuple)
    num_blocks: int = attrs.field(validator=attrs.validators.gt(0))

    @block_lens.validator
    def _check_block_lens(self, attribute: attrs.Attribute[Any], value: tuple[int, ...]) -> None:
        if len(value) != len(self.regions):
            raise ValueError(
                f"block_lens has {len(value)} entries but there are {len(self.regions)} regions; "
                "give one block length per region"
            )
        for i, (region, blen) in enumerate(zip(self.regions, value, strict=True)):
            if blen <= 0:
                raise ValueError(f"block_lens[{i}] = {blen}; block lengths must be positive")
            if blen * self.num_blocks > region.length:
                raise ValueError(
                    f"region {i} is {region.length} bytes but {self.num_blocks} blocks of "
                    f"{blen} bytes need {blen * self.num_blocks}"
                )

    @property
    def num_regions(self) -> int:
        """The number of regions (a connector's layer count, typically)."""
        return len(self.regions)

    @property
    def bytes_per_block(self) -> int:
        """Bytes moved per block id across all regions."""
        return sum(self.block_lens)


@attrs.frozen(kw_only=True)
class TransportCapabilities:
    """What a transport supports; checked by connectors before they rely on it.

    Every transport sets one as its ``capabilities`` attribute (the same card for every
    instance built with the same options) and registers it with its factory. The conformance
    kit checks that the card is one of these, with consistent values, and holds the transport
    to every promise on it.
    """

    memory_kinds: frozenset[MemoryKind] = attrs.field(converter=_kinds_frozenset)
    """The kinds of memory :meth:`Transport.register_memory` accepts (at least ``HOST`` for
    the conformance kit); any other kind raises :class:`~kvframe.errors.CapabilityError`."""
    read: bool
    """``Op.READ`` (pull) is supported; else ``post(READ, ...)`` raises ``CapabilityError``."""
    write: bool
    """``Op.WRITE`` (push) is supported; else ``post(WRITE, ...)`` raises ``CapabilityError``."""
    notifications: bool
    """Notifications (standalone and attached to a post) are supported."""
    max_notification_bytes: int = attrs.field(validator=attrs.validators.ge(0))
    """Largest payload :meth:`Transport.send_notification` (and ``post(..., notification=)``)
    accepts; 0 when notifications are unsupported."""
    cross_process: bool = True
    """False for transports that only work inside one process (the in-process transport)."""
    ordered_notifications: bool = True
    """Notifications between one pair of peers arrive in the order they were sent (they may
    still be delayed or lost)."""
    notification_after_data: bool = True
    """A post's notification is delivered to the peer only after every byte of the transfer
    landed in the destination: when the peer drains it, a WRITE's bytes are in the peer's
    memory and a READ's are in the poster's, so the peer may reuse its blocks at once.

    A transport that cannot promise this (a backend that notifies when the transfer was
    *issued*, or whose notification can overtake its data on another lane) declares
    ``False``; then a caller that needs the guarantee posts without a notification and sends
    it with :meth:`Transport.send_notification` after :meth:`Transport.poll` answered
    ``DONE`` (the P/D connector does). The conformance kit checks a ``True`` card by bytes,
    under load, for READ and WRITE."""
    access_control: bool = False
    """The transport asks an :data:`AccessCheck` (set with :meth:`Transport.set_access_check`)
    before it serves a peer's READ of, or WRITE into, this side's memory, and refuses the
    transfer when the check says no: no byte of it moves. Only a transport that serves peers'
    requests itself (two-sided) can; a one-sided transport (RDMA READ/WRITE: NIXL) cannot see
    a peer's access and declares ``False``."""
    warm_up: bool = False
    """:meth:`Transport.warm_up` is supported: a tiny READ between two buffers the transports
    registered for that purpose alone (never a caller's memory), posted right after
    :meth:`Transport.add_peer` so that the connection's first real transfer does not pay
    the connection set-up (endpoint wire-up, remote keys) or wait for the peer's progress.
    A transport whose first transfer costs no more than later ones, or that refuses reads
    nobody claimed (``access_control``), declares ``False``."""


@attrs.frozen(kw_only=True)
class TransportParams:
    """What a connector passes to a transport factory."""

    name: str
    """This endpoint's unique name (peers see it as the sender of notifications)."""
    options: Mapping[str, Any] = attrs.field(factory=dict)
    """Plugin-specific options from ``kv_connector_extra_config["transport_options"]``. A plugin
    rejects unknown keys with :class:`~kvframe.errors.ConfigError`."""


@attrs.frozen(kw_only=True)
class Notification:
    """A notification received from a peer."""

    sender: str
    """The sending endpoint's name (as given in its :class:`TransportParams`)."""
    payload: bytes


@attrs.frozen(eq=False, kw_only=True)
class LayoutHandle:
    """A prepared descriptor list: a layout registered once, on this side or for a peer."""

    layout: BlockLayout
    peer: str | None
    """``None`` for a local layout, else the peer's name."""
    native: Any = attrs.field(default=None, repr=False)
    """The plugin's own object (a NIXL prepared-list handle, ...)."""


@attrs.frozen(eq=False, kw_only=True)
class XferHandle:
    """One posted transfer: what it moves, a frozen value. Pass it to :meth:`Transport.poll`
    until that answers a stopped :class:`XferStatus`, then to :meth:`Transport.release`.

    The handle never changes; what a transfer has done so far is the :class:`XferStatus`
    ``poll`` answers. Handles compare by identity (two posts of the same blocks are two
    transfers).
    """

    op: Op
    """The direction it was posted with (``READ`` or ``WRITE``)."""
    peer: str
    """The name of the peer the transfer moves blocks from (``READ``) or to (``WRITE``): the
    name :meth:`Transport.add_peer` returned."""
    nbytes: int
    """Bytes the transfer moves when it completes: for each selected region, its block
    length times the number of blocks (0 for an empty transfer)."""
    num_descriptors: int
    """Descriptors (region × block pairs) the transfer was posted with: the number of
    selected regions times the number of blocks, before any coalescing the backend does."""
    native: Any = attrs.field(default=None, repr=False)
    """The transport's own record of the transfer (a :class:`~kvframe.spi.transport_kit.Transfer`
    for the shipped transports); callers never touch it."""


def _check_status_error(
    instance: XferStatus, attribute: attrs.Attribute[Any], value: TransportError | None
) -> None:
    if instance.state is XferState.FAILED:
        if not isinstance(value, TransportError):
            raise ValueError(
                f"a FAILED XferStatus needs the TransportError that says why, got {value!r}"
            )
    elif value is not None:
        raise ValueError(f"an XferStatus in state {instance.state.name} carries no error")


def _check_status_nbytes(instance: XferStatus, attribute: attrs.Attribute[Any], value: int) -> None:
    if value < 0:
        raise ValueError(f"nbytes = {value}; a transfer cannot move a negative number of bytes")
    if value and instance.state is not XferState.DONE:
        raise ValueError(
            f"nbytes = {value} in state {instance.state.name}; only a DONE transfer counts its "
            "bytes (a failed one's destination is undefined)"
        )


def _check_status_seconds(
    instance: XferStatus, attribute: attrs.Attribute[Any], value: float | None
) -> None:
    if value is None:
        return
    if instance.state is not XferState.DONE:
        raise ValueError(f"transfer_seconds is only known once DONE, not {instance.state.name}")
    if not value >= 0:
        raise ValueError(f"transfer_seconds = {value!r}; give a duration >= 0")


@attrs.frozen(kw_only=True)
class XferStatus:
    """What :meth:`Transport.poll` answers: a frozen snapshot of one transfer.

    Build one with :meth:`pending`, :meth:`done` or :meth:`failed`; the validators refuse a
    status that contradicts itself (an error on a ``DONE`` transfer, bytes on a ``FAILED``
    one), with ``ValueError``.
    """

    state: XferState
    error: TransportError | None = attrs.field(default=None, validator=_check_status_error)
    """Why it failed: set exactly when ``state`` is ``FAILED``."""
    nbytes: int = attrs.field(default=0, validator=_check_status_nbytes)
    """Bytes that landed: the handle's ``nbytes`` once ``DONE``, else 0 (the destination of a
    failed or pending transfer is undefined, so nothing counts as moved)."""
    transfer_seconds: float | None = attrs.field(default=None, validator=_check_status_seconds)
    """How long the data movement itself took, once ``DONE``, when the transport knows it (a
    backend's telemetry or its own timing); ``None`` otherwise. Unlike the time from ``post``
    to the ``poll`` that saw ``DONE``, it does not depend on how often the caller polls."""

    @classmethod
    def pending(cls) -> XferStatus:
        """Still moving (the same value every time)."""
        return _PENDING

    @classmethod
    def done(cls, nbytes: int, transfer_seconds: float | None = None) -> XferStatus:
        """Every byte landed; ``nbytes`` is the handle's size."""
        return cls(state=XferState.DONE, nbytes=nbytes, transfer_seconds=transfer_seconds)

    @classmethod
    def failed(cls, error: TransportError) -> XferStatus:
        """Stopped without completing, because of ``error``."""
        return cls(state=XferState.FAILED, error=error)

    @property
    def stopped(self) -> bool:
        """``DONE`` or ``FAILED``: the transfer writes no more bytes."""
        return self.state is not XferState.PENDING


_PENDING = XferStatus(state=XferState.PENDING)


AccessCheck = Callable[[str, Op, Sequence[tuple[int, int]]], str | None]
"""``check(peer, op, ranges) -> None | reason``: may ``peer`` READ (``op`` ``Op.READ``) or WRITE
these ``(address, length)`` ranges of this side's registered memory? ``None`` allows it; a
string refuses it and says why (the peer's transfer fails with it). Called on the thread that
drives the transport; it must be quick and must not call the transport."""


class Transport(abc.ABC):
    """Base class of every transport. Subclasses implement the abstract methods.

    Read the module docstring first: it states the call order, the threading rule, the progress
    rule and what each error leaves usable.
    """

    #: Set by each subclass: what this transport supports.
    capabilities: TransportCapabilities

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """This endpoint's name, as peers see it."""

    # -- memory -------------------------------------------------------------------------
    @abc.abstractmethod
    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        """Register regions for transfers. Call before exporting metadata.

        Raises :class:`~kvframe.errors.CapabilityError` for a memory kind not in
        ``capabilities.memory_kinds``. On any error nothing was registered.
        """

    @abc.abstractmethod
    def local_metadata(self) -> bytes:
        """Opaque bytes a peer passes to :meth:`add_peer` to reach this endpoint."""

    @abc.abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Make a peer reachable from its :meth:`local_metadata`; returns the peer's name.

        Adding a name that is already known is a **rebuild**, with the same metadata or new:
        the old connection is torn down first (its in-flight transfers poll ``FAILED`` with
        :class:`~kvframe.errors.PeerUnreachableError`) and a new one made, so the next
        transfer and notification use it. Remote layouts prepared for the same incarnation
        keep working; with new metadata (a restarted peer) they raise
        ``PeerUnreachableError`` when used: prepare them again. Call it again only to
        reconnect (after a failure or a restart), not as a lookup.

        Raises :class:`~kvframe.errors.PeerUnreachableError` when the metadata is not usable;
        the transport stays usable, and no peer of that name is left (a known one was torn
        down).
        """

    @abc.abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forget a peer. Its in-flight transfers stop and poll ``FAILED``; its prepared remote
        layouts are refused from now on, even after it is added again. Unknown names are
        ignored."""

    @abc.abstractmethod
    def prepare_local(self, layout: BlockLayout) -> LayoutHandle:
        """Prepare descriptors for a layout of this side's registered memory (once)."""

    @abc.abstractmethod
    def prepare_remote(self, peer: str, layout: BlockLayout) -> LayoutHandle:
        """Prepare descriptors for a peer's layout (once per peer and region set).

        Raises :class:`~kvframe.errors.PeerUnreachableError` for an unknown peer.
        """

    # -- transfers ----------------------------------------------------------------------
    @abc.abstractmethod
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
        """Start moving blocks; returns at once with a handle.

        ``local_blocks[i]`` pairs with ``remote_blocks[i]``; both lists have the same length.
        ``regions`` selects region indices of the layouts (default: all), so a connector can
        move one layer at a time; both layouts must have the same block length in each selected
        region. ``notification`` is delivered to the peer after every byte landed (when
        ``capabilities.notification_after_data``; else it may arrive earlier, but only for a
        transfer that succeeds).

        Raises ``ValueError`` for mismatched lists, out-of-range indices or a notification
        that is not bytes, :class:`~kvframe.errors.CapabilityError` for an unsupported op or
        an oversized notification, :class:`~kvframe.errors.PeerUnreachableError` when the
        peer is gone or the remote layout was prepared for an older incarnation, and
        :class:`~kvframe.errors.TransferFailedError` when the backend refuses the post. On any
        error no handle exists and no byte moved.
        """

    @abc.abstractmethod
    def poll(self, handle: XferHandle) -> XferStatus:
        """Check progress and answer the transfer's :class:`XferStatus`.

        Never raises for a failed transfer: it answers a ``FAILED`` status whose ``error``
        says why. Once a status is ``DONE`` or ``FAILED``, every later poll answers an equal
        one. Raises :class:`~kvframe.errors.TransportClosedError` for a released handle or a
        closed transport, ``ValueError`` for a handle another transport posted.
        """

    @abc.abstractmethod
    def release(self, handle: XferHandle) -> None:
        """Free the handle's resources. A pending transfer is stopped first (its destination
        bytes are undefined): when this returns it writes no more bytes, so the caller may
        reuse its destination blocks at once. A backend that cannot cancel a transfer in
        flight waits here until it has stopped. Releasing twice is a no-op."""

    # -- notifications ------------------------------------------------------------------
    @abc.abstractmethod
    def send_notification(self, peer: str, payload: bytes) -> None:
        """Send a small message. Delivery is best effort: a send that returns may still be
        lost or delayed if the peer or link fails. Raises ``ValueError`` for a payload that is
        not bytes, :class:`~kvframe.errors.CapabilityError` for a payload over
        ``capabilities.max_notification_bytes`` (or when notifications are unsupported) and
        :class:`~kvframe.errors.PeerUnreachableError` for an unknown or failed peer."""

    @abc.abstractmethod
    def drain_notifications(self) -> list[Notification]:
        """Every notification received since the last call, oldest first. Also makes progress
        (see :meth:`progress`)."""

    def set_access_check(self, check: AccessCheck | None) -> None:
        """Ask ``check`` before serving every peer READ or WRITE of this side's memory
        (``None``: serve any request inside registered memory, the default). Raises
        :class:`~kvframe.errors.CapabilityError` unless ``capabilities.access_control``."""
        raise CapabilityError(
            f"{self.name}: this transport cannot check a peer's access to its memory "
            "(capabilities.access_control is False)"
        )

    def warm_up(self, peer: str) -> XferHandle:
        """Start warming the connection to ``peer``: READ a few bytes of the buffer the peer's
        transport registered for warm-ups into this side's own (``capabilities.warm_up``).
        Neither buffer is a caller's memory and the bytes are never used, so no lease or
        claim is involved. Poll and release the handle like any transfer's; ``DONE`` means the
        connection carried a READ. Raises :class:`~kvframe.errors.CapabilityError` unless
        ``capabilities.warm_up``, or when the peer's metadata advertised no warm-up buffer
        (an older peer), and :class:`~kvframe.errors.PeerUnreachableError` for an unknown or
        failed peer."""
        raise CapabilityError(
            f"{self.name}: this transport does not warm connections (capabilities.warm_up is False)"
        )

    def progress(self) -> None:  # noqa: B027 - intentionally a no-op by default
        """Drive the backend without consuming notifications. A no-op unless overridden."""

    # -- telemetry and lifetime ---------------------------------------------------------
    def stats(self) -> Mapping[str, float]:
        """Backend counters (bytes, transfers, ...); keys are the plugin's, documented in its
        capability card. Empty by default."""
        return {}

    @abc.abstractmethod
    def close(self) -> None:
        """Release every native resource: handles, prepared lists, registrations, peers.

        Always completes (errors during teardown are swallowed after best effort), and calling
        it twice is a no-op. Every other method raises
        :class:`~kvframe.errors.TransportClosedError` afterwards.
        """

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TransportFactory(Protocol):
    """What a plugin registers: a callable that builds a transport."""

    def __call__(self, params: TransportParams) -> Transport: ...
