"""The scheduler↔worker messages: frozen values, validated on construction.

Each engine step the scheduler-side connector builds one :class:`ConnectorMetadata` (what the
workers must do this step) and every worker answers with one :class:`ConnectorOutput` (what
finished, what failed). Both cross a process boundary as bytes made by
:mod:`kvframe.protocol.codec`; the values themselves know nothing about encoding.

A connector that needs more than the generic parts either puts plain values in ``extra`` or
subclasses :class:`ConnectorMetadata` with its own attrs fields; its workers may likewise report
typed records in a subclass of :class:`ConnectorOutput` (each added field a tuple, see
:func:`extension_fields`). Both subclasses are registered with a codec
(:meth:`kvframe.protocol.codec.Codec.with_types`; a connector names them in
``KVConnector.metadata_types``).

*Plain values* (the type of ``extra``, event data) are what msgpack carries natively: ``None``,
``bool``, ``int`` (64-bit), ``float``, ``str``, ``bytes``, sequences of plain values and
mappings from ``str`` to plain values. On construction, sequences become tuples and mappings
become read-only mappings (:class:`FrozenDict`), so a message cannot change after it was built.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import attrs

from kvframe.protocol.blocks import BlockId, BlockIds, as_block_ids

__all__ = [
    "ConnectorMetadata",
    "ConnectorOutput",
    "FrozenDict",
    "KVEvent",
    "LoadSpec",
    "SaveSpec",
    "Stats",
    "extension_fields",
    "freeze_plain",
    "thaw_plain",
]

_INT64_MIN = -(2**63)
_UINT64_MAX = 2**64 - 1


def _read_only(self: object, *args: object, **kwargs: object) -> NoReturn:
    """Refused: a FrozenDict is read-only (raises ``TypeError``)."""
    raise TypeError(f"a {type(self).__name__} is read-only")


class FrozenDict(dict):  # type: ignore[type-arg]
    """The read-only mapping the messages hold: a ``dict`` whose mutating methods raise
    ``TypeError``.

    A ``dict`` (rather than :class:`types.MappingProxyType`) so that the codec's encoder
    writes it natively, without a per-mapping callback. Like any frozen value it is shared,
    never changed; it is not hashable (a message's mapping fields are left out of its hash).
    """

    __slots__ = ()
    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __repr__(self) -> str:
        return f"FrozenDict({dict.__repr__(self)})"

    def copy(self) -> dict[Any, Any]:
        """A mutable copy (a plain ``dict``)."""
        return dict(self)


def freeze_plain(value: Any, path: str = "value") -> Any:
    """Check that ``value`` is a plain value and return a read-only copy of it.

    Lists and tuples become tuples, mappings become a new :class:`FrozenDict`. Raises
    ``TypeError`` naming ``path`` (for example ``extra['k'][2]``) for anything else: sets,
    objects, non-``str`` mapping keys, ints outside the 64-bit range msgpack
    carries. Nothing is returned then.
    """
    if value is None or isinstance(value, (bool, str, bytes, float)):
        return value
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _UINT64_MAX:
            raise TypeError(f"{path} = {value}: ints must fit in 64 bits to cross processes")
        return value
    if isinstance(value, (list, tuple)):
        return tuple(freeze_plain(v, f"{path}[{i}]") for i, v in enumerate(value))
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(f"{path} has key {k!r}; mapping keys must be str")
            out[k] = freeze_plain(v, f"{path}[{k!r}]")
        return FrozenDict(out)
    raise TypeError(
        f"{path} has type {type(value).__name__}; only None, bool, int, float, str, bytes, "
        "lists and str-keyed mappings of those can cross processes"
    )


def thaw_plain(value: Any) -> Any:
    """The inverse of :func:`freeze_plain`: tuples become lists and read-only mappings become
    dicts, recursively (what ``json`` and ``msgpack`` accept). Never raises for a frozen plain
    value."""
    if isinstance(value, tuple):
        return [thaw_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: thaw_plain(v) for k, v in value.items()}
    return value


def _plain_map(value: Mapping[str, Any], path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{path} must be a mapping of plain values, got {type(value).__name__}")
    frozen: Mapping[str, Any] = freeze_plain(value, path)
    return frozen


def _extra(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return _plain_map(value, "extra")


def _event_data(value: Mapping[str, Any]) -> Mapping[str, Any]:
    return _plain_map(value, "data")


def _str_set(value: Iterable[str]) -> frozenset[str]:
    if isinstance(value, (str, bytes)):
        raise TypeError(f"expected a collection of request ids, got the single value {value!r}")
    out = frozenset(value)
    for v in out:
        if not isinstance(v, str):
            raise TypeError(f"request ids are str, got {v!r}")
    return out


def _int_set(value: Iterable[int]) -> frozenset[int]:
    out = frozenset(value)
    for v in out:
        if type(v) is not int or v < 0:
            raise ValueError(f"block ids are non-negative ints, got {v!r}")
    return out


def _non_empty_str(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{attribute.name} = {value!r}; it must be a non-empty str")


def _check_items(value: Iterable[Any], cls: type) -> tuple[Any, ...]:
    out = tuple(value)
    for i, v in enumerate(out):
        if not isinstance(v, cls):
            raise TypeError(f"item {i} is {v!r}; expected a {cls.__name__}")
    return out


@attrs.frozen(kw_only=True)
class LoadSpec:
    """Load one request's KV from a remote engine into local blocks.

    Group ``g`` of ``local_block_ids`` is filled from the *last* ``len(local_block_ids[g])``
    blocks of ``remote_block_ids[g]``: when the local engine already holds a prefix of the
    request in its own cache, it allocates (and loads) only the blocks after that prefix.

    Raises ``ValueError`` at construction when the group counts differ or a local group is
    longer than its remote group.
    """

    request_id: str = attrs.field(validator=_non_empty_str)
    """The local request id."""
    local_block_ids: BlockIds = attrs.field(converter=as_block_ids)
    """Local destination blocks per KV cache group."""
    remote_engine_id: str = attrs.field(validator=_non_empty_str)
    """The engine holding the source blocks (as in its ``engine_id`` configuration)."""
    remote_block_ids: BlockIds = attrs.field(converter=as_block_ids)
    """Source blocks on the remote engine, per KV cache group."""
    remote_request_id: str = attrs.field(validator=_non_empty_str)
    """The request's id on the remote engine (it holds the lease under this id)."""

    def __attrs_post_init__(self) -> None:
        if len(self.local_block_ids) != len(self.remote_block_ids):
            raise ValueError(
                f"request {self.request_id!r}: {len(self.local_block_ids)} local KV groups but "
                f"{len(self.remote_block_ids)} remote ones; both engines must use the same "
                "KV cache groups"
            )
        for g, (loc, rem) in enumerate(
            zip(self.local_block_ids, self.remote_block_ids, strict=True)
        ):
            if len(loc) > len(rem):
                raise ValueError(
                    f"request {self.request_id!r}, group {g}: {len(loc)} local blocks but only "
                    f"{len(rem)} remote blocks to load them from"
                )


@attrs.frozen(kw_only=True)
class SaveSpec:
    """Save (or keep available for remote reading) one request's blocks."""

    request_id: str = attrs.field(validator=_non_empty_str)
    block_ids: BlockIds = attrs.field(converter=as_block_ids)
    """The blocks to save, per KV cache group."""


@attrs.frozen(kw_only=True)
class KVEvent:
    """Something a connector reports for observers (blocks stored, removed, offloaded, ...).

    ``kind`` is a connector-chosen name (dotted by convention, e.g. ``"nixl.block_stored"``);
    ``data`` holds plain values.
    """

    kind: str = attrs.field(validator=_non_empty_str)
    data: Mapping[str, Any] = attrs.field(factory=dict, converter=_event_data, hash=False)


def _number_map(
    value: Mapping[str, int | float], allow_negative: bool
) -> Mapping[str, int | float]:
    if not isinstance(value, Mapping):
        raise TypeError(f"expected a mapping of names to numbers, got {value!r}")
    out: dict[str, int | float] = {}
    for k, v in value.items():
        if not isinstance(k, str) or not k:
            raise TypeError(f"stat names are non-empty str, got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"stat {k!r} = {v!r}; stats are finite ints or floats")
        if not allow_negative and v < 0:
            raise ValueError(f"counter {k!r} = {v!r}; counters never go negative")
        out[k] = v
    return FrozenDict(out)


def _counters(value: Mapping[str, int | float]) -> Mapping[str, int | float]:
    return _number_map(value, allow_negative=False)


def _gauges(value: Mapping[str, int | float]) -> Mapping[str, int | float]:
    return _number_map(value, allow_negative=True)


@attrs.frozen(kw_only=True)
class Stats:
    """A worker's statistics for one step.

    Two kinds, because they aggregate differently across worker ranks
    (:class:`~kvframe.protocol.aggregate.OutputAggregator`):

    - ``counters`` count things that happened since the last report (bytes moved, transfers
      done, failures). They are non-negative and *add* across ranks and across reports.
    - ``gauges`` are levels sampled now (in-flight transfers, blocks held, queue depth). Across
      reports of one rank the latest wins; across ranks the *maximum* wins, so the aggregate
      shows the most loaded rank. A connector that needs every rank's level reports it under
      one name per rank.
    """

    counters: Mapping[str, int | float] = attrs.field(factory=dict, converter=_counters, hash=False)
    gauges: Mapping[str, int | float] = attrs.field(factory=dict, converter=_gauges, hash=False)

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to report."""
        return not self.counters and not self.gauges


def _loads(value: Iterable[LoadSpec]) -> tuple[LoadSpec, ...]:
    return _check_items(value, LoadSpec)


def _saves(value: Iterable[SaveSpec]) -> tuple[SaveSpec, ...]:
    return _check_items(value, SaveSpec)


def _events(value: Iterable[KVEvent]) -> tuple[KVEvent, ...]:
    return _check_items(value, KVEvent)


def _step(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"step = {value!r}; it must be a non-negative int")


@attrs.frozen(kw_only=True)
class ConnectorMetadata:
    """What the scheduler-side connector tells every worker for one engine step.

    Built by :meth:`~kvframe.spi.connector.KVConnectorScheduler.build_connector_meta`, encoded
    once, and given to each worker's
    :meth:`~kvframe.spi.connector.KVConnectorWorker.bind_connector_metadata`. Every field is
    optional; an empty value means "nothing to do". Subclass it (attrs, frozen, keyword-only)
    for connector-specific fields and register the subclass with the codec.

    Raises ``TypeError`` or ``ValueError`` at construction for a malformed field; the message
    names it.
    """

    step: int = attrs.field(default=0, validator=_step)
    """The engine step this metadata belongs to (diagnostics and ordering checks)."""
    loads: tuple[LoadSpec, ...] = attrs.field(default=(), converter=_loads)
    """Requests whose KV the workers start loading this step."""
    saves: tuple[SaveSpec, ...] = attrs.field(default=(), converter=_saves)
    """Requests whose KV the workers save (or expose) this step."""
    free_request_ids: frozenset[str] = attrs.field(default=frozenset(), converter=_str_set)
    """Requests whose transfers completed or whose lease ended: release their handles."""
    abort_request_ids: frozenset[str] = attrs.field(default=frozenset(), converter=_str_set)
    """Requests to abandon: stop their transfers (destination bytes become undefined), release
    everything, and report them finished so their blocks can be freed."""
    extra: Mapping[str, Any] = attrs.field(factory=dict, converter=_extra, hash=False)
    """Connector-specific plain values."""

    @property
    def is_empty(self) -> bool:
        """True when the workers have nothing to do (``step`` aside)."""
        return not (
            self.loads
            or self.saves
            or self.free_request_ids
            or self.abort_request_ids
            or self.extra
        )


def _failures(value: Mapping[str, str]) -> Mapping[str, str]:
    if not isinstance(value, Mapping):
        raise TypeError(f"failures must map request ids to reasons, got {value!r}")
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"failures[{k!r}] = {v!r}; request ids and reasons are str")
    return FrozenDict(value)


@attrs.frozen(kw_only=True)
class ConnectorOutput:
    """What one worker rank reports after a step (and, aggregated over ranks, what the
    scheduler-side connector receives in
    :meth:`~kvframe.spi.connector.KVConnectorScheduler.update_connector_output`).

    Request ids in ``finished_sending`` and ``finished_recving`` are reported once each: a
    worker reports a request in the step its transfer stopped, never again.

    A connector whose workers report typed records to its scheduler half (finished jobs, a
    child connector's output) subclasses it (attrs, frozen, keyword-only) and registers the
    subclass with its codec. Every field a subclass adds (:func:`extension_fields`) is a
    ``tuple`` of records, empty by default: across ranks they are concatenated in rank order,
    like :attr:`events`, so each record should say which rank made it if the scheduler half
    needs to know. :attr:`is_empty` covers them.

    Raises ``TypeError`` or ``ValueError`` at construction for a malformed field (a
    subclass's added field that is not a tuple included); the message names it.
    """

    finished_sending: frozenset[str] = attrs.field(default=frozenset(), converter=_str_set)
    """Requests whose KV this side no longer needs to keep for a remote reader (it was read,
    the lease expired or it was aborted): their blocks may be freed."""
    finished_recving: frozenset[str] = attrs.field(default=frozenset(), converter=_str_set)
    """Requests whose asynchronous load stopped (completed or failed): they may be scheduled."""
    invalid_block_ids: frozenset[BlockId] = attrs.field(default=frozenset(), converter=_int_set)
    """Local blocks whose loaded contents are undefined (a failed or partial load)."""
    failures: Mapping[str, str] = attrs.field(factory=dict, converter=_failures, hash=False)
    """Request id → human-readable reason, for requests whose transfer failed this step."""
    stats: Stats = attrs.field(factory=Stats)
    events: tuple[KVEvent, ...] = attrs.field(default=(), converter=_events)

    def __attrs_post_init__(self) -> None:
        for name in extension_fields(type(self)):
            value = getattr(self, name)
            if not isinstance(value, tuple):
                raise TypeError(
                    f"{type(self).__qualname__}.{name} = {value!r}; the fields a ConnectorOutput "
                    "subclass adds are tuples (they are concatenated over worker ranks)"
                )

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to report (a subclass's added fields included)."""
        return (
            not (
                self.finished_sending
                or self.finished_recving
                or self.invalid_block_ids
                or self.failures
                or self.events
            )
            and self.stats.is_empty
            and not any(getattr(self, name) for name in extension_fields(type(self)))
        )


_EXTENSION_FIELDS: dict[type[Any], tuple[str, ...]] = {}


def extension_fields(cls: type[ConnectorOutput]) -> tuple[str, ...]:
    """The fields ``cls`` (``ConnectorOutput`` or an attrs subclass of it) adds to
    ``ConnectorOutput``, in declaration order: empty for ``ConnectorOutput`` itself.

    Each holds a tuple of connector-specific records;
    :class:`~kvframe.protocol.aggregate.OutputAggregator` concatenates them over ranks. Raises
    ``TypeError`` for a class that is not an attrs subclass of ``ConnectorOutput``.
    """
    known = _EXTENSION_FIELDS.get(cls)
    if known is not None:
        return known
    if not (isinstance(cls, type) and issubclass(cls, ConnectorOutput) and attrs.has(cls)):
        raise TypeError(f"{cls!r} is not an attrs subclass of ConnectorOutput")
    base = {f.name for f in attrs.fields(ConnectorOutput)}
    names = tuple(f.name for f in attrs.fields(cls) if f.init and f.name not in base)
    _EXTENSION_FIELDS[cls] = names  # classes are immutable; a race only computes it twice
    return names
