"""kvframe's exceptions: one tree, rooted at :class:`KVFrameError`.

Every error kvframe raises on purpose is a subclass of :class:`KVFrameError`, so an engine can
catch everything kvframe-specific in one place. Errors from backends (NIXL, UCX, pyzmq, the OS)
are translated at one boundary per plugin (``raise kvframe_error from native_error``), so the
original is always available as ``__cause__``.

The tree separates *local misuse* (you called something wrong; fix your code or configuration)
from *remote protocol violations* (a peer sent something illegal; count it, drop it, carry on)
and from *transport failures* (the data path broke; the request's blocks are unusable)::

    KVFrameError
    ├── ConfigError                  bad configuration value (also a ValueError)
    ├── PluginError                  a plugin could not be loaded or found
    │   ├── PluginNotFoundError      unknown name; lists what is installed and the closest match
    │   └── PluginConflictError      two distributions registered the same name
    ├── LeaseError                   illegal use of the lease core (local misuse)
    │   └── InvalidTransitionError   event not allowed in the lease's current state
    ├── CodecError                   bytes that do not decode (also a ValueError)
    │   ├── UnknownMessageTypeError  type tag not known to this version
    │   └── UnsupportedVersionError  protocol version this side cannot read
    ├── ProtocolViolationError       a peer sent a well-formed but illegal message
    ├── HandshakeError               side-channel handshake with a remote engine failed
    │   ├── HandshakeTimeoutError    no answer in time
    │   └── IncompatiblePeerError    version or compatibility hash mismatch
    └── TransportError               the data path failed
        ├── TransportClosedError     *you* closed the transport (or handle); a local bug
        ├── PeerUnreachableError     *the peer* broke: disconnected, died, or was removed
        ├── TransferFailedError      one transfer failed; its destination bytes are undefined
        └── CapabilityError          the transport does not support what was asked

What is left usable after each error is documented on the class and in ``docs/errors.md``.
"""

from __future__ import annotations

__all__ = [
    "CapabilityError",
    "CodecError",
    "ConfigError",
    "HandshakeError",
    "HandshakeTimeoutError",
    "IncompatiblePeerError",
    "InvalidTransitionError",
    "KVFrameError",
    "LeaseError",
    "PeerUnreachableError",
    "PluginConflictError",
    "PluginError",
    "PluginNotFoundError",
    "ProtocolViolationError",
    "TransferFailedError",
    "TransportClosedError",
    "TransportError",
    "UnknownMessageTypeError",
    "UnsupportedVersionError",
]


class KVFrameError(Exception):
    """Base of every error kvframe raises on purpose."""


class ConfigError(KVFrameError, ValueError):
    """A configuration value is wrong.

    The message names the key, the value given and what is allowed. Nothing was created: fix the
    configuration and build the object again.
    """


class PluginError(KVFrameError):
    """A plugin could not be loaded, registered or found. The plugin manager stays usable."""


class PluginNotFoundError(PluginError, LookupError):
    """No plugin provides the requested name. The message lists what is installed and the
    closest match."""


class PluginConflictError(PluginError):
    """Two plugins registered the same name. The message names both distributions; block one
    of them (``KVFRAME_BLOCK_PLUGINS``) to resolve it."""


class LeaseError(KVFrameError):
    """Illegal use of the lease core by the caller. The lease table is left unchanged."""


class InvalidTransitionError(LeaseError):
    """The event is not allowed in the lease's current state (for example granting a request id
    that already holds a lease). The lease table is left unchanged."""


class CodecError(KVFrameError, ValueError):
    """Bytes that do not decode into a valid message: truncated, oversized, wrong types, trailing
    garbage. Nothing was decoded; the decoder is stateless and stays usable."""


class UnknownMessageTypeError(CodecError):
    """The message's type tag is not one this version knows."""


class UnsupportedVersionError(CodecError):
    """The message's protocol version is not one this side can read. Upgrade the older side."""


class ProtocolViolationError(KVFrameError):
    """A remote peer sent a well-formed message that is illegal here (a forged request id, a
    completion for a lease it does not hold, ...). The message was dropped and counted; local
    state is unchanged."""


class HandshakeError(KVFrameError):
    """The side-channel handshake with a remote engine failed. No peer was added; the requests
    that needed it follow ``kv_load_failure_policy``. A later handshake may be tried."""


class HandshakeTimeoutError(HandshakeError, TimeoutError):
    """The remote engine did not answer the handshake in time."""


class IncompatiblePeerError(HandshakeError):
    """The remote engine speaks another protocol version or has an incompatible KV layout
    (compatibility hash mismatch). Retrying will not help until one side is reconfigured."""


class TransportError(KVFrameError):
    """The data path failed. See the subclasses for what is left usable."""


class TransportClosedError(TransportError):
    """The transport (or a handle) was already closed or released *by this process*: a local
    bug. Nothing happened."""


class PeerUnreachableError(TransportError):
    """The remote peer disconnected, died or is unknown. Transfers with it have stopped; their
    destination bytes are undefined. Remove the peer and handshake again before reuse. Other
    peers are unaffected."""


class TransferFailedError(TransportError):
    """One transfer failed. It has stopped (no more bytes will land); its destination bytes are
    undefined. The transport and other transfers stay usable."""


class CapabilityError(TransportError):
    """The transport does not support what was asked (a memory kind, WRITE, notifications, a
    notification larger than its limit). Nothing happened."""
