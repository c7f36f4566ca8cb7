"""The built-in in-process transport: memcpy between registered regions of one process.

Capability card
---------------

=======================  =========================================================
memory kinds             ``HOST`` (``ctypes.memmove``); ``DEVICE`` too when
                         ``torch.cuda.is_available()`` (copied with torch)
READ / WRITE             both (each can be switched off with an option, to test a
                         connector's capability checks)
notifications            yes, up to ``max_notification_bytes`` (default 64 KiB),
                         ordered per sender
cross process            no: endpoints find each other through an
                         :class:`InProcessFabric` in the same process
completion               asynchronous: a transfer moves its bytes on a *later*
                         progress step (``poll``, ``progress`` or
                         ``drain_notifications``), never inside ``post``
=======================  =========================================================

Options (``TransportParams.options``; unknown keys raise :class:`~kvframe.errors.ConfigError`):

- ``fabric`` — the :class:`InProcessFabric` to join. Default: the process's default fabric
  (:func:`default_fabric`), which is what the factory registered under the name ``inprocess``
  uses. Tests should build their own fabric so that endpoint names and faults cannot leak
  between tests.
- ``completion_polls`` (int ≥ 1, default 1) — how many progress steps of the posting endpoint
  pass before a transfer moves its bytes and answers ``DONE``.
- ``max_notification_bytes`` (int ≥ 1, default 65536).
- ``read``, ``write``, ``notifications`` (bool, default True) — switch a capability off.

Fault injection
---------------

Every fabric owns a :class:`Faults` object. Rules added to it select operations by endpoint,
by peer, by operation, by the n-th matching operation or by a predicate over a
:class:`FaultEvent`, and then drop, delay or corrupt notifications, delay or fail transfers
(before any byte or after some of them), or make an endpoint vanish::

    fabric = InProcessFabric()
    fabric.faults.fail_transfers(peer="P", nth=2, written=0.5)  # 2nd transfer to P: half lands
    fabric.faults.drop_notifications(endpoint="D", when=lambda e: e.payload == b"done")
    fabric.faults.vanish("P")  # every transfer with P fails

Nothing here reads a clock: delays are counted in progress steps, so tests are deterministic.
"""

from __future__ import annotations

import ctypes
import itertools
import uuid
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import attrs
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
    XferState,
    descriptor_ids,
)

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = [
    "DEFAULT_MAX_NOTIFICATION_BYTES",
    "TRANSPORT_NAME",
    "FaultEvent",
    "FaultRule",
    "Faults",
    "InProcessFabric",
    "InProcessTransport",
    "capabilities",
    "default_fabric",
    "kvframe_register_transports",
]

#: The name under which the built-in transport is registered.
TRANSPORT_NAME = "inprocess"
#: Default limit of a notification payload.
DEFAULT_MAX_NOTIFICATION_BYTES = 64 * 1024

_OPTION_KEYS = frozenset(
    {"fabric", "completion_polls", "max_notification_bytes", "read", "write", "notifications"}
)
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
    )


# -- fault injection ------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class FaultEvent:
    """One operation as fault rules see it."""

    kind: Literal["transfer", "notification"]
    endpoint: str
    """The endpoint that posted the transfer or sent the notification."""
    peer: str
    """The other endpoint: the transfer's remote side or the notification's receiver."""
    op: Op | None = None
    """``READ`` or ``WRITE`` for a transfer; ``None`` for a notification."""
    nbytes: int = 0
    """Bytes the transfer moves, or the notification's payload size."""
    payload: bytes | None = None
    """The notification's payload (``None`` for a transfer)."""


_Action = Literal["drop", "delay", "corrupt", "fail", "delay_transfer"]


def _flip_bits(payload: bytes) -> bytes:
    return bytes(b ^ 0xFF for b in payload) if payload else b"\xff"


@attrs.define(eq=False, kw_only=True)
class FaultRule:
    """One rule of a :class:`Faults` object; returned by the methods that add rules.

    A rule *matches* an event when every given selector agrees (``endpoint``, ``peer``,
    ``op``, ``when``). It *fires* on every match, or only on the ``nth`` match (1-based) when
    ``nth`` is given, and at most ``times`` times when ``times`` is given. ``matched`` and
    ``fired`` count what happened so far; :meth:`cancel` removes the rule.
    """

    action: _Action
    kind: Literal["transfer", "notification"]
    endpoint: str | None = None
    peer: str | None = None
    op: Op | None = None
    nth: int | None = None
    when: Callable[[FaultEvent], bool] | None = None
    times: int | None = None
    polls: int = 0
    """Delay in progress steps (for the delay actions)."""
    written: float = 0.0
    """Fraction of descriptors copied before an injected transfer failure."""
    corrupt: Callable[[bytes], bytes] = _flip_bits
    matched: int = 0
    fired: int = 0
    active: bool = True
    _owner: Faults | None = attrs.field(default=None, repr=False, alias="owner")

    def cancel(self) -> None:
        """Remove the rule; later operations are not affected by it. Idempotent."""
        self.active = False
        if self._owner is not None and self in self._owner._rules:
            self._owner._rules.remove(self)

    def _check(self, event: FaultEvent) -> bool:
        if not self.active or event.kind != self.kind:
            return False
        if self.endpoint is not None and event.endpoint != self.endpoint:
            return False
        if self.peer is not None and event.peer != self.peer:
            return False
        if self.op is not None and event.op is not self.op:
            return False
        if self.when is not None and not self.when(event):
            return False
        self.matched += 1
        if self.nth is not None and self.matched != self.nth:
            return False
        if self.times is not None and self.fired >= self.times:
            return False
        self.fired += 1
        return True


def _check_selectors(nth: int | None, times: int | None) -> None:
    if nth is not None and nth < 1:
        raise ValueError(f"nth={nth}: operations are counted from 1")
    if times is not None and times < 1:
        raise ValueError(f"times={times}: a rule must be allowed to fire at least once")


class Faults:
    """Fault injection for one :class:`InProcessFabric` (``fabric.faults``).

    Every method that adds a rule takes the same selectors — ``endpoint`` (the posting or
    sending side), ``peer`` (the other side), ``nth`` (fire only on the n-th matching
    operation, counted from 1), ``when`` (a predicate over a :class:`FaultEvent`) and ``times``
    (fire at most that often) — and returns the :class:`FaultRule`, which counts matches and
    can be cancelled. Rules apply in the order they were added. Raises ``ValueError`` for a
    selector or parameter out of range; then no rule was added.
    """

    def __init__(self) -> None:
        self._rules: list[FaultRule] = []
        self._vanished: set[str] = set()

    # -- notifications ----------------------------------------------------------------------
    def drop_notifications(
        self,
        *,
        endpoint: str | None = None,
        peer: str | None = None,
        nth: int | None = None,
        when: Callable[[FaultEvent], bool] | None = None,
        times: int | None = None,
    ) -> FaultRule:
        """Lose matching notifications silently (the send still returns normally)."""
        return self._add("drop", "notification", endpoint, peer, None, nth, when, times)

    def delay_notifications(
        self,
        polls: int,
        *,
        endpoint: str | None = None,
        peer: str | None = None,
        nth: int | None = None,
        when: Callable[[FaultEvent], bool] | None = None,
        times: int | None = None,
    ) -> FaultRule:
        """Hold matching notifications back for ``polls`` progress steps of the receiver.

        Later notifications from the same sender wait behind a delayed one (order per sender
        is kept, as on a real link that stalls and then delivers a burst).
        """
        if polls < 1:
            raise ValueError(f"polls={polls}: a delay must be at least one progress step")
        rule = self._add("delay", "notification", endpoint, peer, None, nth, when, times)
        rule.polls = polls
        return rule

    def corrupt_notifications(
        self,
        corrupt: Callable[[bytes], bytes] = _flip_bits,
        *,
        endpoint: str | None = None,
        peer: str | None = None,
        nth: int | None = None,
        when: Callable[[FaultEvent], bool] | None = None,
        times: int | None = None,
    ) -> FaultRule:
        """Replace matching payloads by ``corrupt(payload)`` (default: every bit flipped)."""
        rule = self._add("corrupt", "notification", endpoint, peer, None, nth, when, times)
        rule.corrupt = corrupt
        return rule

    # -- transfers --------------------------------------------------------------------------
    def fail_transfers(
        self,
        *,
        written: float = 0.0,
        endpoint: str | None = None,
        peer: str | None = None,
        op: Op | None = None,
        nth: int | None = None,
        when: Callable[[FaultEvent], bool] | None = None,
        times: int | None = None,
    ) -> FaultRule:
        """Make matching transfers fail with :class:`~kvframe.errors.TransferFailedError`.

        ``written`` is the fraction of the transfer's descriptors copied before it fails
        (0.0: no byte lands; 0.5: the first half lands). Its notification is not sent.
        """
        if not 0.0 <= written <= 1.0:
            raise ValueError(f"written={written}: give a fraction between 0.0 and 1.0")
        rule = self._add("fail", "transfer", endpoint, peer, op, nth, when, times)
        rule.written = written
        return rule

    def delay_transfers(
        self,
        polls: int,
        *,
        endpoint: str | None = None,
        peer: str | None = None,
        op: Op | None = None,
        nth: int | None = None,
        when: Callable[[FaultEvent], bool] | None = None,
        times: int | None = None,
    ) -> FaultRule:
        """Make matching transfers take ``polls`` more progress steps to complete."""
        if polls < 1:
            raise ValueError(f"polls={polls}: a delay must be at least one progress step")
        rule = self._add("delay_transfer", "transfer", endpoint, peer, op, nth, when, times)
        rule.polls = polls
        return rule

    # -- peers ------------------------------------------------------------------------------
    def vanish(self, endpoint: str) -> None:
        """Cut ``endpoint`` off, as if its process died: every transfer with it (either way)
        fails with :class:`~kvframe.errors.PeerUnreachableError` on the next progress step,
        new posts, notifications and ``add_peer`` with it raise it, and notifications it sent
        that were not yet drained are lost. The endpoint itself stays open."""
        self._vanished.add(endpoint)

    def restore(self, endpoint: str) -> None:
        """Undo :meth:`vanish`. Transfers that already failed stay failed; as after a real
        outage, peers should ``remove_peer`` and ``add_peer`` again."""
        self._vanished.discard(endpoint)

    def is_vanished(self, endpoint: str) -> bool:
        """Whether :meth:`vanish` cut ``endpoint`` off."""
        return endpoint in self._vanished

    @property
    def rules(self) -> tuple[FaultRule, ...]:
        """The active rules, in the order they apply."""
        return tuple(self._rules)

    def clear(self) -> None:
        """Cancel every rule and restore every vanished endpoint."""
        for rule in list(self._rules):
            rule.cancel()
        self._vanished.clear()

    def _add(
        self,
        action: _Action,
        kind: Literal["transfer", "notification"],
        endpoint: str | None,
        peer: str | None,
        op: Op | None,
        nth: int | None,
        when: Callable[[FaultEvent], bool] | None,
        times: int | None,
    ) -> FaultRule:
        _check_selectors(nth, times)
        rule = FaultRule(
            action=action,
            kind=kind,
            endpoint=endpoint,
            peer=peer,
            op=op,
            nth=nth,
            when=when,
            times=times,
            owner=self,
        )
        self._rules.append(rule)
        return rule

    def _firing(self, event: FaultEvent) -> list[FaultRule]:
        # Every rule sees every event (so nth counts all matches), in insertion order.
        return [rule for rule in list(self._rules) if rule._check(event)]


# -- the fabric -----------------------------------------------------------------------------


class InProcessFabric:
    """A registry through which in-process transports of one process find each other.

    Each fabric is independent: endpoint names, peers and :attr:`faults` never cross
    fabrics, so a test that builds its own fabric cannot see another test's endpoints.
    """

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex
        """Identifies the fabric in endpoint metadata."""
        self.faults = Faults()
        """The fault rules applied to every endpoint of this fabric."""
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
                "option 'fabric' names another fabric than the one whose create() was called; "
                "drop the option or call that fabric's create()"
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


@attrs.define(eq=False)
class _Prepared:
    owner: InProcessTransport
    peer: InProcessTransport | None  # the peer object the layout was prepared for
    addrs: npt.NDArray[np.int64]
    lens: npt.NDArray[np.int64]
    devs: npt.NDArray[np.int64]


@attrs.define(eq=False)
class _Transfer:
    handle: XferHandle
    peer: InProcessTransport
    src: npt.NDArray[np.int64]
    dst: npt.NDArray[np.int64]
    lens: npt.NDArray[np.int64]
    src_devs: npt.NDArray[np.int64]
    dst_devs: npt.NDArray[np.int64]
    due: int
    notification: bytes | None
    checked: bool = False  # fault rules are consulted once per transfer
    failing: FaultRule | None = None


@attrs.define(eq=False)
class _Incoming:
    seq: int
    sender: InProcessTransport
    payload: bytes
    ready_at: int


def _option(options: Mapping[str, Any], key: str, default: Any, kind: type) -> Any:
    value = options.get(key, default)
    # bool is an int subclass; a flag given as 1 or a count given as True is a config mistake
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(
            f"in-process transport option {key!r} = {value!r}: expected {kind.__name__}"
        )
    return value


class InProcessTransport(Transport):
    """An endpoint of an :class:`InProcessFabric`. See the module docstring for the card.

    Build it through a fabric (:meth:`InProcessFabric.create`) or the registered factory.
    Raises :class:`~kvframe.errors.ConfigError` for unknown or ill-typed options and for a
    name already open in the fabric; then nothing was created.
    """

    def __init__(self, params: TransportParams) -> None:
        unknown = set(params.options) - _OPTION_KEYS
        if unknown:
            raise ConfigError(
                f"unknown in-process transport option(s) {sorted(unknown)}; "
                f"known options are {sorted(_OPTION_KEYS)}"
            )
        if not params.name:
            raise ConfigError("an in-process endpoint needs a non-empty name")
        opts = params.options
        fabric = opts.get("fabric", None)
        if fabric is None:
            fabric = default_fabric()
        if not isinstance(fabric, InProcessFabric):
            raise ConfigError(f"option 'fabric' = {fabric!r}: expected an InProcessFabric")
        self._completion_polls: int = _option(opts, "completion_polls", 1, int)
        if self._completion_polls < 1:
            raise ConfigError(
                f"option 'completion_polls' = {self._completion_polls}: transfers complete on "
                "a later progress step, so it must be at least 1"
            )
        max_notif: int = _option(
            opts, "max_notification_bytes", DEFAULT_MAX_NOTIFICATION_BYTES, int
        )
        if max_notif < 1:
            raise ConfigError(f"option 'max_notification_bytes' = {max_notif}: must be >= 1")
        self.capabilities = capabilities(
            read=_option(opts, "read", True, bool),
            write=_option(opts, "write", True, bool),
            notifications=_option(opts, "notifications", True, bool),
            max_notification_bytes=max_notif,
        )
        self._name = params.name
        self._fabric = fabric
        self._closed = False
        self._tick = 0
        self._regions: list[MemoryRegion] = []
        self._peers: dict[str, InProcessTransport] = {}
        self._pending: list[_Transfer] = []
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

    # -- memory -----------------------------------------------------------------------------
    def register_memory(self, regions: Sequence[MemoryRegion]) -> None:
        """Record regions as transferable. ``DEVICE`` memory needs torch with CUDA.

        Raises :class:`~kvframe.errors.CapabilityError` for an unsupported memory kind and
        ``TypeError`` for something that is not a :class:`MemoryRegion`; then nothing was
        registered.
        """
        self._check_open()
        regions = list(regions)
        for region in regions:
            if not isinstance(region, MemoryRegion):
                raise TypeError(f"expected MemoryRegion, got {type(region).__name__}")
            if region.kind not in self.capabilities.memory_kinds:
                raise CapabilityError(
                    f"in-process transport cannot register {region.kind.value} memory here "
                    "(device memory needs torch with a visible CUDA device)"
                )
        self._regions.extend(regions)

    def local_metadata(self) -> bytes:
        """msgpack of the fabric id, this endpoint's name and its incarnation."""
        self._check_open()
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
        """Find the endpoint the metadata describes in this fabric; see the SPI contract.

        Raises :class:`~kvframe.errors.PeerUnreachableError` for metadata that does not
        decode, comes from another fabric (or process), names a closed endpoint or an older
        incarnation, or names a vanished endpoint.
        """
        self._check_open()
        try:
            meta = msgpack.unpackb(metadata, raw=False)
            version, fabric_id = meta["v"], meta["fabric"]
            name, incarnation = meta["name"], meta["incarnation"]
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
        peer = self._fabric._lookup(name)
        if peer is None or peer._incarnation != incarnation:
            raise PeerUnreachableError(f"in-process peer {name!r} is closed (stale metadata)")
        if self._cut_off(name):
            raise PeerUnreachableError(f"in-process peer {name!r} is unreachable (vanished)")
        old = self._peers.get(name)
        if old is not None and old is not peer:
            self._fail_peer_transfers(old, f"peer {name!r} restarted")
        self._peers[name] = peer
        return str(name)

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer``; its pending transfers answer ``FAILED`` (PeerUnreachableError)."""
        self._check_open()
        old = self._peers.pop(peer, None)
        if old is not None:
            # notifications it sent before the removal arrived already; they stay drainable
            self._fail_peer_transfers(old, f"peer {peer!r} was removed")

    def prepare_local(self, layout: BlockLayout) -> LayoutHandle:
        """Descriptors for a layout of this endpoint's registered memory.

        Raises ``ValueError`` when a region of the layout is not inside registered memory.
        """
        self._check_open()
        self._check_inside(layout, self._regions, "this endpoint")
        return LayoutHandle(layout=layout, peer=None, native=self._descriptors(layout, None))

    def prepare_remote(self, peer: str, layout: BlockLayout) -> LayoutHandle:
        """Descriptors for a peer's layout.

        Raises :class:`~kvframe.errors.PeerUnreachableError` for an unknown or unreachable
        peer and ``ValueError`` when the layout is not inside the peer's registered memory.
        """
        self._check_open()
        target = self._reachable(peer)
        self._check_inside(layout, target._regions, f"peer {peer!r}")
        return LayoutHandle(layout=layout, peer=peer, native=self._descriptors(layout, target))

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
        self._check_open()
        if op is Op.READ:
            self._require("READ", self.capabilities.read)
        elif op is Op.WRITE:
            self._require("WRITE", self.capabilities.write)
        else:
            raise ValueError(f"op must be Op.READ or Op.WRITE, got {op!r}")
        lp = self._own_handle(local, local=True)
        rp = self._own_handle(remote, local=False)
        lids = descriptor_ids(local.layout, local_blocks, regions)
        rids = descriptor_ids(remote.layout, remote_blocks, regions)
        if lids.size != rids.size:
            n_local, n_remote = np.size(local_blocks), np.size(remote_blocks)
            if n_local != n_remote:
                raise ValueError(
                    f"local_blocks has {n_local} entries but remote_blocks has {n_remote}; "
                    "they pair one to one"
                )
            raise ValueError(
                f"the local layout has {local.layout.num_regions} regions and the remote one "
                f"{remote.layout.num_regions}; pass regions= to select regions both have"
            )
        lens = lp.lens[lids]
        if not np.array_equal(lens, rp.lens[rids]):
            raise ValueError(
                "local and remote block lengths differ in a selected region; both layouts "
                "must cut each selected region into blocks of the same size"
            )
        if notification is not None:
            self._check_payload(notification)
        assert remote.peer is not None
        target = self._reachable(remote.peer)
        if rp.peer is not target:
            raise PeerUnreachableError(
                f"peer {remote.peer!r} was re-added since this remote layout was prepared; "
                "call prepare_remote again"
            )
        if op is Op.READ:
            src, sdev, dst, ddev = rp.addrs[rids], rp.devs[rids], lp.addrs[lids], lp.devs[lids]
        else:
            src, sdev, dst, ddev = lp.addrs[lids], lp.devs[lids], rp.addrs[rids], rp.devs[rids]
        handle = XferHandle(
            op=op, peer=target.name, nbytes=int(lens.sum()), num_descriptors=int(lids.size)
        )
        xfer = _Transfer(
            handle=handle,
            peer=target,
            src=src,
            dst=dst,
            lens=lens,
            src_devs=sdev,
            dst_devs=ddev,
            due=self._tick + self._completion_polls,
            notification=notification,
        )
        handle.native = xfer
        self._pending.append(xfer)
        return handle

    def poll(self, handle: XferHandle) -> XferState:
        """Make one progress step, then answer the handle's state."""
        self._check_open()
        if handle.released:
            raise TransportClosedError("this transfer handle was released; do not poll it again")
        if not isinstance(handle.native, _Transfer) or handle.native.handle is not handle:
            raise ValueError("this handle was not posted by an in-process transport")
        self._step()
        return handle.state

    def release(self, handle: XferHandle) -> None:
        """Stop a pending transfer (none of its bytes move) and forget it. Idempotent."""
        if handle.released:
            return
        handle.released = True
        xfer = handle.native
        if isinstance(xfer, _Transfer) and xfer in self._pending:
            self._pending.remove(xfer)
            handle.state = XferState.FAILED
            handle.error = TransferFailedError("released while pending")

    # -- notifications ----------------------------------------------------------------------
    def send_notification(self, peer: str, payload: bytes) -> None:
        """Deliver ``payload`` to ``peer``'s inbox (subject to the fabric's faults)."""
        self._check_open()
        self._require("notifications", self.capabilities.notifications)
        self._check_payload(payload)
        target = self._reachable(peer)
        self._deliver(target, bytes(payload))

    def drain_notifications(self) -> list[Notification]:
        """Make one progress step, then return every ready notification, oldest first."""
        self._check_open()
        self._step()
        ready: list[_Incoming] = []
        for sender, queue in list(self._inbox.items()):
            if self._fabric.faults.is_vanished(sender):
                queue.clear()  # sent by an endpoint that "died" before we drained it
            while queue and queue[0].ready_at <= self._tick:
                ready.append(queue.popleft())
        ready.sort(key=lambda n: n.seq)
        self._stats["notifications_received"] += len(ready)
        return [Notification(sender=n.sender.name, payload=n.payload) for n in ready]

    def progress(self) -> None:
        """Make one progress step: due transfers move their bytes."""
        self._check_open()
        self._step()

    def stats(self) -> Mapping[str, float]:
        """Counters: ``bytes_read``, ``bytes_written``, ``transfers_done``,
        ``transfers_failed``, ``notifications_sent``, ``notifications_received``."""
        return dict(self._stats)

    def close(self) -> None:
        """Leave the fabric and forget everything; pending transfers move no more bytes.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        for xfer in self._pending:
            xfer.handle.state = XferState.FAILED
            xfer.handle.error = TransportClosedError("the transport was closed")
        self._pending.clear()
        self._peers.clear()
        self._inbox.clear()
        self._regions.clear()
        self._fabric._leave(self)

    # -- internals --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosedError(f"in-process transport {self._name!r} is closed")

    def _check_payload(self, payload: bytes) -> None:
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise TypeError(f"a notification payload is bytes, got {type(payload).__name__}")
        self._require("notifications", self.capabilities.notifications)
        limit = self.capabilities.max_notification_bytes
        if len(payload) > limit:
            raise CapabilityError(
                f"notification of {len(payload)} bytes exceeds this transport's limit of "
                f"{limit} bytes (capabilities.max_notification_bytes)"
            )

    def _cut_off(self, peer: str) -> bool:
        faults = self._fabric.faults
        return faults.is_vanished(peer) or faults.is_vanished(self._name)

    def _alive(self, peer: InProcessTransport) -> bool:
        return (
            not peer._closed
            and self._fabric._lookup(peer.name) is peer
            and not self._cut_off(peer.name)
        )

    def _reachable(self, name: str) -> InProcessTransport:
        peer = self._peers.get(name)
        if peer is None:
            raise PeerUnreachableError(f"unknown peer {name!r}; call add_peer first")
        if not self._alive(peer):
            raise PeerUnreachableError(f"peer {name!r} is unreachable (closed or vanished)")
        return peer

    def _own_handle(self, handle: LayoutHandle, *, local: bool) -> _Prepared:
        prep = handle.native
        if not isinstance(prep, _Prepared) or prep.owner is not self:
            raise ValueError("unknown layout handle: prepare it with this transport first")
        if local and handle.peer is not None:
            raise ValueError("the local layout handle came from prepare_remote")
        if not local and handle.peer is None:
            raise ValueError("the remote layout handle came from prepare_local")
        return prep

    @staticmethod
    def _check_inside(layout: BlockLayout, registered: Sequence[MemoryRegion], who: str) -> None:
        for i, region in enumerate(layout.regions):
            span = layout.block_lens[i] * layout.num_blocks
            if not any(
                reg.kind is region.kind
                and reg.device_id == region.device_id
                and reg.addr <= region.addr
                and region.addr + span <= reg.addr + reg.length
                for reg in registered
            ):
                raise ValueError(
                    f"layout region {i} ({region.kind.value} memory at {region.addr:#x}, "
                    f"{span} bytes used) is not inside memory registered by {who}; "
                    "register_memory it first"
                )

    def _descriptors(self, layout: BlockLayout, peer: InProcessTransport | None) -> _Prepared:
        nb = layout.num_blocks
        base = np.array([r.addr for r in layout.regions], dtype=np.int64)
        blen = np.array(layout.block_lens, dtype=np.int64)
        dev = np.array(
            [r.device_id if r.kind is MemoryKind.DEVICE else _HOST for r in layout.regions],
            dtype=np.int64,
        )
        blocks = np.arange(nb, dtype=np.int64)
        # region-major, matching descriptor_ids: index r * num_blocks + b
        addrs = (base[:, None] + blocks[None, :] * blen[:, None]).reshape(-1)
        lens = np.repeat(blen, nb)
        devs = np.repeat(dev, nb)
        return _Prepared(owner=self, peer=peer, addrs=addrs, lens=lens, devs=devs)

    def _step(self) -> None:
        self._tick += 1
        for xfer in list(self._pending):
            if xfer not in self._pending:
                continue  # stopped by a fault rule's callback
            if not self._alive(xfer.peer):
                self._finish(
                    xfer, PeerUnreachableError(f"peer {xfer.peer.name!r} became unreachable")
                )
            elif xfer.due <= self._tick:
                self._execute(xfer)

    def _execute(self, xfer: _Transfer) -> None:
        handle = xfer.handle
        if not xfer.checked:
            xfer.checked = True
            event = FaultEvent(
                kind="transfer",
                endpoint=self._name,
                peer=xfer.peer.name,
                op=handle.op,
                nbytes=handle.nbytes,
            )
            delay = 0
            for rule in self._fabric.faults._firing(event):
                if rule.action == "fail" and xfer.failing is None:
                    xfer.failing = rule
                elif rule.action == "delay_transfer":
                    delay += rule.polls
            if delay:
                xfer.due = self._tick + delay
                return
        failing = xfer.failing
        n = len(xfer.lens)
        count = n if failing is None else int(n * failing.written)
        try:
            _copy(xfer.src[:count], xfer.dst[:count], xfer.lens[:count], xfer, count)
        except Exception as exc:
            self._finish(xfer, TransferFailedError(f"copy failed: {exc}"))
            return
        if failing is not None:
            self._finish(
                xfer,
                TransferFailedError(
                    f"injected fault: transfer to {xfer.peer.name!r} failed after "
                    f"{count} of {n} descriptors"
                ),
            )
            return
        key = "bytes_read" if handle.op is Op.READ else "bytes_written"
        self._stats[key] += handle.nbytes
        self._finish(xfer, None)
        if xfer.notification is not None:
            self._deliver(xfer.peer, xfer.notification)

    def _finish(self, xfer: _Transfer, error: TransportError | None) -> None:
        self._pending.remove(xfer)
        if error is None:
            xfer.handle.state = XferState.DONE
            self._stats["transfers_done"] += 1
        else:
            xfer.handle.state = XferState.FAILED
            xfer.handle.error = error
            self._stats["transfers_failed"] += 1

    def _fail_peer_transfers(self, peer: InProcessTransport, why: str) -> None:
        for xfer in list(self._pending):
            if xfer.peer is peer:
                self._finish(xfer, PeerUnreachableError(why))

    def _deliver(self, target: InProcessTransport, payload: bytes) -> None:
        self._stats["notifications_sent"] += 1
        event = FaultEvent(
            kind="notification",
            endpoint=self._name,
            peer=target.name,
            nbytes=len(payload),
            payload=payload,
        )
        delay = 0
        for rule in self._fabric.faults._firing(event):
            if rule.action == "drop":
                return
            if rule.action == "corrupt":
                payload = bytes(rule.corrupt(payload))
            elif rule.action == "delay":
                delay += rule.polls
        queue = target._inbox.setdefault(self._name, deque())
        # keep per-sender order: nothing overtakes a delayed notification
        ready_at = target._tick + delay
        if queue:
            ready_at = max(ready_at, queue[-1].ready_at)
        queue.append(
            _Incoming(
                seq=next(self._fabric._notification_seq),
                sender=self,
                payload=payload,
                ready_at=ready_at,
            )
        )


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
    xfer: _Transfer,
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
