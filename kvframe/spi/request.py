"""kvframe's own view of an engine request, and deterministic chained block hashes.

A connector never sees an engine's request object. The engine adapter builds a
:class:`RequestView` (a frozen value) whenever it calls the connector SPI, so no engine type
leaks into connectors and a connector works unchanged under any engine.

Block hashes identify the *content* of a full KV block: block ``i``'s hash covers the hash of
block ``i - 1`` and the token ids of block ``i``, so equal hashes mean equal prefixes. They are
computed with SHA-256 over fixed-width little-endian token ids, never with Python's ``hash()``
(which is salted per process), so every process and every host computes the same bytes.
"""

from __future__ import annotations

import hashlib
import math
import struct
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from kvframe.protocol.blocks import BlockIds, as_block_ids

__all__ = [
    "BLOCK_HASH_SIZE",
    "FINISH_REASONS",
    "BlockIds",
    "RequestView",
    "as_block_ids",
    "block_hashes",
    "next_block_hash",
    "root_block_hash",
]

BLOCK_HASH_SIZE = 32
"""Length in bytes of every block hash (SHA-256)."""

_ROOT_DOMAIN = b"kvframe.block_hash.v1\x00"
# Token ids are packed as unsigned 64-bit little-endian integers: wide enough for any
# vocabulary, and fixed width so that the byte string of a block is unambiguous.
_TOKEN = struct.Struct("<Q")
_MAX_TOKEN = 2**64 - 1


# Kept for modules that imported the converter before it was public.
_block_ids = as_block_ids


def _block_hashes(value: Iterable[bytes]) -> tuple[bytes, ...]:
    out = tuple(value)
    for i, h in enumerate(out):
        if not isinstance(h, bytes) or len(h) != BLOCK_HASH_SIZE:
            raise ValueError(
                f"block_hashes[{i}] is {h!r}; each block hash is {BLOCK_HASH_SIZE} bytes "
                "(use kvframe.spi.request.block_hashes to compute them)"
            )
    return out


def _params(value: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"kv_transfer_params must be a mapping or None, got {value!r}")
    # A read-only copy: the engine may keep mutating its own dict after building the view.
    return types.MappingProxyType(dict(value))


def _non_negative(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"{attribute.name} = {value!r}; it must be a non-negative int")


def _non_empty_str(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{attribute.name} = {value!r}; it must be a non-empty str")


def _finite(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{attribute.name} = {value!r}; it must be a finite number (seconds)")


FINISH_REASONS = frozenset({"stop", "length", "abort", "error"})
"""The values :attr:`RequestView.finish_reason` takes once a request has finished."""


def _finish_reason(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and value not in FINISH_REASONS:
        raise ValueError(
            f"finish_reason = {value!r}; it must be None or one of {sorted(FINISH_REASONS)}"
        )


@attrs.frozen(kw_only=True)
class RequestView:
    """What a connector may know about one engine request, frozen at the moment of the call.

    The engine adapter builds a fresh view for each SPI call; a connector may keep a view (it
    never changes) but must not expect it to track the request afterwards.

    Raises ``ValueError`` or ``TypeError`` at construction for a malformed field (an empty
    request id, a negative count, a block hash of the wrong length).
    """

    request_id: str = attrs.field(validator=_non_empty_str)
    """The engine's request id, unique among live requests of this engine."""
    num_prompt_tokens: int = attrs.field(validator=_non_negative)
    """Number of prompt tokens."""
    num_computed_tokens: int = attrs.field(default=0, validator=_non_negative)
    """Tokens whose KV is already in this engine's cache (local prefix-cache hits included)."""
    block_ids: BlockIds = attrs.field(default=(), converter=as_block_ids)
    """Blocks allocated to the request so far, per KV cache group (empty before allocation)."""
    block_hashes: tuple[bytes, ...] = attrs.field(default=(), converter=_block_hashes)
    """Chained hashes of the request's *full* blocks, in order (see :func:`block_hashes`)."""
    kv_transfer_params: Mapping[str, Any] | None = attrs.field(
        default=None, converter=_params, hash=False
    )
    """The ``kv_transfer_params`` the client sent with the request, or ``None``. A read-only
    shallow copy: nested values are the engine's (JSON values, which connectors only read)."""
    prompt_token_ids: Sequence[int] = attrs.field(default=(), eq=False, hash=False, repr=False)
    """The prompt's token ids when the engine gives them (empty otherwise): the engine's own
    sequence, not copied, which connectors only read. The P/D connector binds its tickets to the
    prompt with them (``remote_prompt_digest``), so a ticket cannot serve another prompt."""
    output_token_ids: Sequence[int] = attrs.field(default=(), eq=False, hash=False, repr=False)
    """The tokens the request has generated so far, in order, when the engine gives them
    (empty otherwise; the engine's own sequence, which connectors only read). A decoder that
    keeps a conversation's KV for its next turn (bidirectional mode) binds the kept blocks to
    prompt and answer with them."""
    arrival_time: float = attrs.field(default=0.0, validator=_finite)
    """When the request arrived, in seconds on the engine's clock (the same clock as ``now``
    in :class:`~kvframe.spi.connector.SchedulerStep`)."""
    finish_reason: str | None = attrs.field(default=None, validator=_finish_reason)
    """Why the request finished, in views given to ``request_finished``: ``"stop"`` (a stop
    token or string), ``"length"`` (``max_tokens`` reached), ``"abort"`` (the client or the
    engine gave up) or ``"error"``; ``None`` while it runs. A producer keeps KV for a remote
    reader only for requests that finished normally (``stop`` or ``length``)."""


def root_block_hash(salt: bytes = b"") -> bytes:
    """The parent hash of a request's first block.

    ``salt`` separates caches that must never share blocks even for equal tokens (a LoRA
    adapter, a multimodal input digest, a tenant's cache salt). Returns
    :data:`BLOCK_HASH_SIZE` bytes. Raises ``TypeError`` when ``salt`` is not bytes.
    """
    if not isinstance(salt, bytes):
        raise TypeError(f"salt must be bytes, got {type(salt).__name__}")
    return hashlib.sha256(_ROOT_DOMAIN + salt).digest()


def next_block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of one block: SHA-256 over ``parent`` followed by the block's token ids, each
    packed as an unsigned 64-bit little-endian integer.

    ``parent`` is the previous block's hash (or :func:`root_block_hash` for the first block).
    Raises ``ValueError`` for a parent of the wrong length or a token id that is not an int in
    ``[0, 2**64)``; nothing is computed then.
    """
    if not isinstance(parent, bytes) or len(parent) != BLOCK_HASH_SIZE:
        raise ValueError(
            f"parent hash must be {BLOCK_HASH_SIZE} bytes, got {parent!r}; "
            "use root_block_hash() for the first block"
        )
    h = hashlib.sha256(parent)
    buf = bytearray(_TOKEN.size * len(token_ids))
    for i, t in enumerate(token_ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _MAX_TOKEN:
            raise ValueError(f"token_ids[{i}] = {t!r}; token ids are ints in [0, 2**64)")
        _TOKEN.pack_into(buf, i * _TOKEN.size, t)
    h.update(buf)
    return h.digest()


def block_hashes(
    token_ids: Sequence[int], block_size: int, *, salt: bytes = b""
) -> tuple[bytes, ...]:
    """Chained hashes of every *full* block of ``token_ids`` (a trailing partial block has no
    hash: its content is not final).

    Deterministic across processes, hosts and Python versions. Two requests share a prefix of
    ``n`` full blocks exactly when (with the same ``block_size`` and ``salt``) their first ``n``
    hashes are equal. Raises ``ValueError`` for ``block_size < 1`` or a bad token id.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size = {block_size!r}; it must be a positive int")
    parent = root_block_hash(salt)
    out: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = next_block_hash(parent, token_ids[start : start + block_size])
        out.append(parent)
    return tuple(out)
