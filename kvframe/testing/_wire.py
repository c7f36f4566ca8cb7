"""What :class:`~kvframe.testing.endpoint.ChildEndpoint` and its child process say to each other.

One frozen message per command (parent → child) and per answer (child → parent), encoded by
the one codec, :mod:`kvframe.protocol.codec` (magic, protocol version, type tag, a msgpack body
built from the declared field types; never pickle). On the stream socket each envelope is
preceded by its length, a big-endian uint32; a length over :data:`MAX_FRAME` is refused before
the body is read (the stream cannot continue after it, so it counts as a closed connection).

Layouts, regions, capabilities and notifications travel as the SPI's own frozen values
(:class:`~kvframe.spi.transport.BlockLayout`, ...), not as hand-written maps.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

import attrs

from kvframe.protocol.codec import Codec
from kvframe.protocol.frames import recv_frame, send_frame
from kvframe.protocol.messages import freeze_plain
from kvframe.spi.transport import (
    BlockLayout,
    MemoryRegion,
    Notification,
    Op,
    TransportCapabilities,
    XferState,
)

__all__ = [
    "CODEC",
    "MAX_FRAME",
    "AddPeer",
    "Alloc",
    "Allocated",
    "Checksum",
    "Close",
    "Create",
    "Created",
    "Done",
    "Drain",
    "Drained",
    "Exit",
    "Failure",
    "Metadata",
    "Notify",
    "Poll",
    "Polled",
    "Post",
    "PrepareLocal",
    "PrepareRemote",
    "Read",
    "Register",
    "Release",
    "RemovePeer",
    "Sighted",
    "Sighting",
    "Sightings",
    "Watch",
    "Write",
    "recv",
    "send",
]

MAX_FRAME = 256 * 1024 * 1024
"""The largest envelope (bytes) either side reads or writes."""


def _options(value: Mapping[str, Any]) -> Mapping[str, Any]:
    frozen: Mapping[str, Any] = freeze_plain(value, "options")
    return frozen


def _plain(value: Any) -> Any:
    return freeze_plain(value, "value")


# -- commands (parent → child) ------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Create:
    """Build a transport (closing the previous one and its buffers): the portable parts of a
    :class:`~kvframe.testing.endpoint.TransportSpec` and the endpoint's name."""

    name: str
    options: Mapping[str, Any] = attrs.field(factory=dict, converter=_options, hash=False)
    """Plain values, read-only (the child gives the transport plain dicts and lists)."""
    factory: str | None = None
    endpoint_name: str


@attrs.frozen(kw_only=True)
class Exit:
    """Shut the endpoint down and leave the command loop."""


@attrs.frozen(kw_only=True)
class Alloc:
    nbytes: int


@attrs.frozen(kw_only=True)
class Write:
    addr: int
    data: bytes


@attrs.frozen(kw_only=True)
class Read:
    addr: int
    length: int


@attrs.frozen(kw_only=True)
class Checksum:
    addr: int
    length: int


@attrs.frozen(kw_only=True)
class Register:
    regions: tuple[MemoryRegion, ...]


@attrs.frozen(kw_only=True)
class Metadata:
    """Ask for the transport's ``local_metadata()``."""


@attrs.frozen(kw_only=True)
class AddPeer:
    metadata: bytes


@attrs.frozen(kw_only=True)
class RemovePeer:
    peer: str


@attrs.frozen(kw_only=True)
class PrepareLocal:
    layout: BlockLayout


@attrs.frozen(kw_only=True)
class PrepareRemote:
    peer: str
    layout: BlockLayout


@attrs.frozen(kw_only=True)
class Post:
    op: Op
    local: int
    local_blocks: tuple[int, ...]
    remote: int
    remote_blocks: tuple[int, ...]
    regions: tuple[int, ...] | None = None
    notification: bytes | None = None


@attrs.frozen(kw_only=True)
class Poll:
    xfer: int


@attrs.frozen(kw_only=True)
class Release:
    xfer: int


@attrs.frozen(kw_only=True)
class Notify:
    peer: str
    payload: bytes


@attrs.frozen(kw_only=True)
class Drain:
    """Hand over the notifications drained so far."""


@attrs.frozen(kw_only=True)
class Close:
    """Close the transport (the endpoint's buffers stay)."""


@attrs.frozen(kw_only=True)
class Watch:
    """On draining a notification with ``payload``: digest ``digest``, then invert ``invert``
    (see :meth:`~kvframe.testing.endpoint.LocalEndpoint.watch`)."""

    payload: bytes
    digest: tuple[MemoryRegion, ...] = ()
    invert: tuple[MemoryRegion, ...] = ()


@attrs.frozen(kw_only=True)
class DenyAccess:
    """Install an access check that refuses every peer READ and WRITE with ``reason`` (see
    :meth:`~kvframe.spi.transport.Transport.set_access_check`); ``reason`` empty removes it."""

    reason: str


@attrs.frozen(kw_only=True)
class Sightings:
    """Hand over what the watches saw so far."""


# -- answers (child → parent) -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Failure:
    """The command raised: the exception's class name and message."""

    type_name: str
    message: str


@attrs.frozen(kw_only=True)
class Created:
    name: str
    capabilities: TransportCapabilities


@attrs.frozen(kw_only=True)
class Done:
    """The command's result, a plain value (``None``, an id, bytes, a name, a digest)."""

    value: Any = attrs.field(default=None, converter=_plain)


@attrs.frozen(kw_only=True)
class Allocated:
    region: MemoryRegion


@attrs.frozen(kw_only=True)
class Polled:
    """A :class:`~kvframe.spi.transport.XferStatus`, its error as a :class:`Failure`."""

    state: XferState
    error: Failure | None = None
    nbytes: int = 0
    transfer_seconds: float | None = None


@attrs.frozen(kw_only=True)
class Drained:
    notifications: tuple[Notification, ...] = ()


@attrs.frozen(kw_only=True)
class Sighting:
    """A watch that fired: its payload and the sha256 hex digest of each watched range."""

    payload: bytes
    digests: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class Sighted:
    sightings: tuple[Sighting, ...] = ()


CODEC = Codec(max_message_bytes=MAX_FRAME).with_types(
    {
        f"endpoint.{tag}": cls
        for tag, cls in {
            "create": Create,
            "exit": Exit,
            "alloc": Alloc,
            "write": Write,
            "read": Read,
            "checksum": Checksum,
            "register": Register,
            "metadata": Metadata,
            "add_peer": AddPeer,
            "remove_peer": RemovePeer,
            "prepare_local": PrepareLocal,
            "prepare_remote": PrepareRemote,
            "post": Post,
            "poll": Poll,
            "release": Release,
            "notify": Notify,
            "drain": Drain,
            "close": Close,
            "watch": Watch,
            "deny_access": DenyAccess,
            "sightings": Sightings,
            "failure": Failure,
            "created": Created,
            "done": Done,
            "allocated": Allocated,
            "polled": Polled,
            "drained": Drained,
            "sighting": Sighting,
            "sighted": Sighted,
        }.items()
    }
)
"""The codec of the endpoint wire: every command and answer above."""


def send(sock: socket.socket, message: object) -> None:
    """Write ``message`` as one frame. Raises ``TypeError``/``ValueError`` for a message the
    codec refuses (nothing is written then) and ``OSError`` when the socket fails."""
    send_frame(sock, CODEC, message)


def recv(sock: socket.socket) -> object:
    """Read one frame's message.

    Raises ``EOFError`` when the other end closed the connection or announced a frame over
    :data:`MAX_FRAME` (its body is not read, so the stream cannot continue),
    :class:`~kvframe.errors.CodecError` for a body that is not a message of :data:`CODEC` (the
    stream stays usable) and ``OSError`` when the socket fails.
    """
    return recv_frame(sock, CODEC, max_bytes=MAX_FRAME, what="endpoint")
