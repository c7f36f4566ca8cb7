"""What the P/D connector's scheduler tells its workers each step (on top of the generic parts
of :class:`~kvframe.protocol.messages.ConnectorMetadata`).

Registered with the codec under the tag ``pd.metadata`` through ``PDConnector.metadata_types``:
``codec_for(PDConnector, config)`` (:func:`kvframe.spi.connector.codec_for`) carries it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from kvframe.protocol.codec import type_checked
from kvframe.protocol.messages import ConnectorMetadata, FrozenDict
from kvframe.spi.request import BlockIds, _block_ids

__all__ = [
    "PDGrant",
    "PDLoad",
    "PDMetadata",
    "PDPushProgress",
    "PDPushSource",
    "PDWorkerAddress",
    "RemoteEngineAddr",
    "RemoteRelease",
]


def _checked(value: Any, cls: type) -> tuple[Any, ...]:
    out = tuple(value)
    for i, v in enumerate(out):
        if not isinstance(v, cls):
            raise TypeError(f"item {i} is {v!r}; expected a {cls.__name__}")
    return out


def _blocks(value: Any) -> BlockIds:
    return _block_ids(value)


def _loads(value: Any) -> tuple[PDLoad, ...]:
    return _checked(value, PDLoad)


def _grants(value: Any) -> tuple[PDGrant, ...]:
    return _checked(value, PDGrant)


def _sources(value: Any) -> tuple[PDPushSource, ...]:
    return _checked(value, PDPushSource)


def _progress(value: Any) -> tuple[PDPushProgress, ...]:
    return _checked(value, PDPushProgress)


def _strs(value: Any) -> tuple[str, ...]:
    return _checked(value, str)


def _heartbeats(value: Mapping[str, Iterable[str]]) -> Mapping[str, tuple[str, ...]]:
    if not isinstance(value, Mapping):
        raise TypeError(f"pd_heartbeats must map remote engine ids to lease ids, got {value!r}")
    out: dict[str, tuple[str, ...]] = {}
    for engine, ids in value.items():
        if not isinstance(engine, str) or not engine:
            raise TypeError(f"pd_heartbeats key {engine!r}: remote engine ids are non-empty str")
        if isinstance(ids, (str, bytes)):
            raise TypeError(
                f"pd_heartbeats[{engine!r}] = {ids!r}; give a sequence of lease ids, not one str"
            )
        tup = tuple(ids)
        for r in tup:
            if not isinstance(r, str):
                raise TypeError(f"pd_heartbeats[{engine!r}] contains {r!r}; lease ids are str")
        out[engine] = tup
    return FrozenDict(out)


def _releases(value: Any) -> tuple[RemoteRelease, ...]:
    return _checked(value, RemoteRelease)


def _addrs(value: Any) -> tuple[RemoteEngineAddr, ...]:
    return _checked(value, RemoteEngineAddr)


def _ports(value: Any) -> tuple[int, ...]:
    return tuple(int(p) for p in value)


# They check only what the fields' types say: the codec skips them on decoding (hot path).
type_checked(_blocks, _loads, _grants, _sources, _progress, _strs, _releases, _addrs, _ports)


@attrs.frozen(kw_only=True)
class RemoteEngineAddr:
    """Where a remote (prefill) engine's side channel listens."""

    engine_id: str
    host: str
    port: int
    """Base port: rank ``r`` listens on ``port + r`` (unless ``ports`` is given)."""
    tp_size: int
    ports: tuple[int, ...] = attrs.field(default=(), converter=_ports)
    """Per-rank ports, when the remote workers bound ephemeral ports."""

    def port_for(self, rank: int) -> int:
        """The side-channel port of remote worker ``rank``."""
        return self.ports[rank % len(self.ports)] if self.ports else self.port + rank


@attrs.frozen(kw_only=True)
class PDLoad:
    """Receive one request's KV from a remote engine (D side): pull it (``push_id`` empty) or
    have it pushed (``push_id`` set: register ``local_block_ids`` with the remote engine)."""

    request_id: str
    remote: RemoteEngineAddr
    remote_request_id: str
    local_block_ids: BlockIds = attrs.field(converter=_blocks)
    """Destination blocks per KV group."""
    remote_block_ids: BlockIds = attrs.field(converter=_blocks)
    """Source blocks per KV group, aligned with ``local_block_ids`` (same lengths)."""
    remote_incarnations: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    """Per remote rank, the instance that granted the lease (empty: unknown). A worker whose
    connection is to another instance reconnects before it reads."""
    push_id: str = ""
    """Push mode: the router's push id naming the request on P (empty: pull mode)."""
    first_block: int = 0
    """Push mode: the index of the first block P writes (D has the blocks before it)."""
    num_tokens: int = 0
    """Push mode: the prompt's length in tokens."""
    prompt_digest: str = ""
    """Push mode: the prompt's digest (``''``: the engine gives no token ids)."""
    kept_until: float | None = None
    """Bidirectional mode (P pulling a conversation's history): the decoder's kept-blocks
    expiry on the *decoder's* clock. The worker maps it through its clock-offset estimate of
    that engine and reads only before the result (``None``: an ordinary lease)."""
    remote_block_size: int = 0
    """Pull mode: tokens per block of the remote engine as its ticket says (``0``: not said,
    as large as this engine's); the worker reads only when the remote engine's handshake says
    the same. Equal to this engine's (or ``0``): the blocks pair up one to one with
    ``local_block_ids``. Different: ``remote_block_ids`` are the remote blocks holding tokens
    ``load_start .. load_stop - 1`` (the first holding token ``load_start``), and the worker
    regroups them into ``local_block_ids`` (the first holding token ``load_start``) token
    range by token range (:mod:`kvframe.core.blocksize`), zeroing the last local block after
    ``load_stop``."""
    load_start: int = 0
    """With ``remote_block_size``: the first token loaded."""
    load_stop: int = 0
    """With ``remote_block_size``: the token after the last one loaded."""


@attrs.frozen(kw_only=True)
class PDPushSource:
    """Push one finished request's KV to the decoder that registers its push id (P side)."""

    request_id: str
    """The local request id (reported in ``finished_sending`` when the push ended)."""
    push_id: str
    block_ids: BlockIds = attrs.field(converter=_blocks)
    num_tokens: int
    prompt_digest: str = ""


@attrs.frozen(kw_only=True)
class PDGrant:
    """Keep one finished request's blocks under a lease for a remote reader (P side)."""

    request_id: str
    """The local request id (reported in ``finished_sending`` when the lease ends)."""
    lease_id: str
    """The lease id D names in its heartbeats (random, bounded: see ``docs/pd.md``)."""
    block_ids: BlockIds = attrs.field(converter=_blocks)
    ttl: float | None = None
    """Bidirectional mode, D: keep the blocks this many seconds for the conversation's next
    turn (a kept lease: :meth:`~kvframe.core.holder.LeaseHolder.keep`); ``None``: an ordinary
    lease."""
    decode_engine: str | None = None
    """The decode engine the lease is meant for (the prefill request's ``decode_engine_id``;
    ``None``: not named). The worker aborts the lease at once, while nobody claimed it, when
    that engine leaves the fleet (:meth:`~kvframe.core.holder.LeaseHolder.abort_unclaimed_for`)."""


@attrs.frozen(kw_only=True)
class PDPushProgress:
    """Push mode with ``push_layerwise``, P side: this step's forward pass computes request
    ``request_id``'s KV up to ``computed_tokens``; each layer's finished blocks may be written
    to the registered decoder as soon as ``save_kv_layer`` saw that layer."""

    request_id: str
    push_id: str
    block_ids: BlockIds = attrs.field(converter=_blocks)
    """Every block of the request so far, per KV group, in token order."""
    computed_tokens: int
    """Tokens with valid KV once this step's forward pass has run."""
    num_tokens: int
    """The prompt's length in tokens."""
    prompt_digest: str = ""


@attrs.frozen(kw_only=True)
class RemoteRelease:
    """Tell a remote engine it may free a request's blocks now (no read will come, or the local
    prefix cache already had them)."""

    remote: RemoteEngineAddr
    remote_request_id: str


@attrs.frozen(kw_only=True)
class PDMetadata(ConnectorMetadata):
    """One step's instructions from the P/D scheduler to every worker.

    Generic fields used: ``abort_request_ids`` (D: stop these loads and report them in
    ``finished_recving`` once their transfers stopped).
    """

    now: float = 0.0
    """The scheduler's clock when the metadata was built (for rebasing deadlines)."""
    grants: tuple[PDGrant, ...] = attrs.field(default=(), converter=_grants)
    """P: requests finished with ``do_remote_decode``: grant each a lease over its blocks."""
    pd_heartbeats: Mapping[str, tuple[str, ...]] = attrs.field(
        factory=dict, converter=_heartbeats, hash=False
    )
    """D: remote engine id → lease ids to heartbeat now (the schedule's due batches and the
    leases of requests that arrived this step, one batch per engine)."""
    pd_loads: tuple[PDLoad, ...] = attrs.field(default=(), converter=_loads)
    releases: tuple[RemoteRelease, ...] = attrs.field(default=(), converter=_releases)
    engines: tuple[RemoteEngineAddr, ...] = attrs.field(default=(), converter=_addrs)
    """Remote engines that requests named this step: handshake with them now (proactively)."""
    push_sources: tuple[PDPushSource, ...] = attrs.field(default=(), converter=_sources)
    """P: push-mode requests whose prefill finished: write each to its registered decoder."""
    push_abandoned: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    """P: push ids whose requests ended without KV to push: refuse their registrations."""
    push_progress: tuple[PDPushProgress, ...] = attrs.field(default=(), converter=_progress)
    """P (``push_layerwise``): push-mode requests this step computes, layer by layer."""
    evictions: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    """D, bidirectional mode: lease ids of kept blocks the engine wants back
    (:meth:`~kvframe.core.holder.LeaseHolder.evict`)."""

    @property
    def is_empty(self) -> bool:
        return super().is_empty and not (
            self.grants
            or self.pd_heartbeats
            or self.pd_loads
            or self.releases
            or self.engines
            or self.push_sources
            or self.push_abandoned
            or self.push_progress
            or self.evictions
        )


def _port(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError(f"{attribute.name} = {value!r}; expected a port 1..65535")


def _text(limit: int) -> Any:
    def check(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
        if not isinstance(value, str) or not 0 < len(value) <= limit:
            raise ValueError(f"{attribute.name} = {value!r}; expected 1..{limit} characters")

    return check


@attrs.frozen(kw_only=True)
class PDWorkerAddress:
    """What a P worker tells its scheduler half through the engine
    (``get_handshake_metadata`` → ``set_xfer_handshake_metadata``): where its side channel
    listens and which instance it is. The scheduler puts both into every ticket."""

    host: str = attrs.field(validator=_text(255))
    port: int = attrs.field(validator=_port)
    incarnation: str = attrs.field(validator=_text(64))
