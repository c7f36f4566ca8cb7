"""Requests as the engine tracks them, and what the engine returns to its caller."""

from __future__ import annotations

import enum
import types
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from kvframe.spi.request import next_block_hash, root_block_hash

__all__ = ["FinishReason", "Request", "RequestOutput", "RequestStatus"]


class RequestStatus(enum.Enum):
    """Where a live request is in the scheduler."""

    WAITING = "waiting"
    """Queued; not yet admitted (or re-queued after its asynchronous load finished)."""
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    """Admitted, blocks allocated, parked until the connector reports its load finished."""
    RUNNING = "running"
    """Scheduled every step until it finishes."""


class FinishReason(enum.Enum):
    """Why a request ended."""

    LENGTH = "length"
    """It generated ``max_tokens`` tokens."""
    ABORT = "abort"
    """:meth:`~kvframe_refengine.engine.Engine.abort` was called."""
    ERROR = "error"
    """It failed (a failed KV load under policy ``fail``, or the connector refused it)."""


@attrs.frozen(kw_only=True)
class RequestOutput:
    """What :meth:`~kvframe_refengine.engine.Engine.step` reports for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]
    """Tokens generated in this step (empty for a finish without a new token)."""
    token_ids: tuple[int, ...]
    """Every token generated so far."""
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    """Why the request failed (``finish_reason`` is ``ERROR``), else ``None``."""
    kv_transfer_params: Mapping[str, Any] | None = attrs.field(default=None, hash=False)
    """What the connector's ``request_finished`` returned for the client (final output only):
    for a prefill engine, the parameters a decode engine needs to pull the KV."""
    num_cached_tokens: int = 0
    """Prompt tokens taken from this engine's prefix cache."""
    num_external_tokens: int = 0
    """Prompt tokens the connector loaded from elsewhere (0 when a load failed)."""


class Request:
    """One request's mutable state inside the engine (never shown to connectors: they get a
    :class:`~kvframe.spi.request.RequestView` built from it)."""

    def __init__(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        block_size: int,
        kv_transfer_params: Mapping[str, Any] | None,
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.prompt: tuple[int, ...] = tuple(prompt)
        self.output: list[int] = []
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.kv_transfer_params = (
            None if kv_transfer_params is None else types.MappingProxyType(dict(kv_transfer_params))
        )
        self.arrival_time = arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        """Tokens whose KV is in the request's blocks (and trusted)."""
        self.block_ids: list[int] = []
        self.num_cached_blocks = 0
        """Leading blocks already registered in (or taken from) the prefix cache."""
        self.num_local_hit_tokens = 0
        self.num_external_tokens = 0
        self.allocated = False
        """Blocks were allocated and the connector told (``update_state_after_alloc``)."""
        self.ever_scheduled = False
        self.load_is_sync = False
        """A synchronous (layer-wise) load goes with the request's next forward pass."""
        self.block_hashes: list[bytes] = []
        self._extend_hashes()

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt) + len(self.output)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens."""
        return [*self.prompt, *self.output]

    @property
    def num_lifetime_blocks(self) -> int:
        """Blocks this request holds at its largest: every token but the last generated one
        gets KV (the last one is only sampled)."""
        tokens = len(self.prompt) + self.max_tokens - 1
        return -(-tokens // self.block_size)

    def append_token(self, token: int) -> None:
        """Add a generated token (and the hash of a block it completes)."""
        self.output.append(token)
        self._extend_hashes()

    def _extend_hashes(self) -> None:
        bs = self.block_size
        full = self.num_tokens // bs
        if len(self.block_hashes) == full:
            return
        tokens = self.all_token_ids
        parent = self.block_hashes[-1] if self.block_hashes else root_block_hash()
        for i in range(len(self.block_hashes), full):
            parent = next_block_hash(parent, tokens[i * bs : (i + 1) * bs])
            self.block_hashes.append(parent)
