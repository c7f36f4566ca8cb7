"""MultiConnector: several connectors behind one, each doing its own job.

Configured as::

    {"kv_connector": "MultiConnector", "kv_role": "kv_consumer", "engine_id": "d0",
     "kv_connector_extra_config": {"connectors": [
         {"kv_connector": "PDConnector", "kv_connector_extra_config": {"transport": "nixl"}},
         {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"tiers": [...]}}]}}

Rules (``docs/multi.md`` explains each):

- **Loads**: children are asked in order; the first with a non-zero answer *owns* the request's
  load; a ``None`` (not known yet) from a child asked before any owner makes the whole answer
  ``None``. The other children get ``update_state_after_alloc(..., 0)`` and never load it.
  Only the owner's ``finished_recving`` report reaches the engine, once.
- **Saves and finishes** go to every child. A request's blocks are released only when every
  child that asked to keep them (``delay_free``) reported it in ``finished_sending``.
- ``kv_transfer_params`` of the children are merged. Two children returning the same key
  *fail the hand-off* of that request: ``request_finished`` returns no parameters (nobody can
  read what the children keep), reports a :data:`REQUEST_FAILED_EVENT`, and keeps the blocks
  until every child that asked to keep them reported them released (a P/D child's lease then
  expires unread). It never raises: the request has already finished.
- **Children** are looked up in the plugin host of the
  :class:`~kvframe.spi.connector.BuildContext` the MultiConnector is built with, and built
  with that same context.
- **Stats and events** are kept per child *instance*: names are prefixed with the child's label
  ``"<index>.<kv_connector>"`` (``"1.OffloadingConnector.store_blocks"``,
  ``"0.PDConnector.pd.bad_params"``), so two children of one class stay apart.
- **Messages**: one :class:`MultiMetadata` holds each child's metadata as bytes encoded with
  *that child's* codec (:func:`~kvframe.spi.connector.codec_for` of the child); each worker
  answers with one :class:`MultiOutput`, the combined output the engine acts on plus every
  child's own output (:class:`ChildOutput`, encoded with that child's codec), which the
  scheduler side aggregates per child over ranks and gives back to that child. The engine
  only needs ``codec_for(MultiConnector, config)``: the children's classes never meet in
  one codec.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Set
from typing import TYPE_CHECKING, Any

import attrs
import msgpack

from kvframe.config import KVTransferConfig
from kvframe.errors import CodecError, ConfigError
from kvframe.protocol.aggregate import OutputAggregator
from kvframe.protocol.codec import Codec
from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput, KVEvent, Stats
from kvframe.spi.connector import (
    BuildContext,
    EngineInfo,
    KVConnector,
    KVConnectorScheduler,
    KVConnectorWorker,
    PluginLookup,
    SchedulerStep,
    codec_for,
)
from kvframe.spi.hookspecs import hookimpl
from kvframe.spi.request import BlockIds, RequestView

if TYPE_CHECKING:
    import torch

__all__ = [
    "REQUEST_FAILED_EVENT",
    "ChildOutput",
    "MultiConnector",
    "MultiConnectorScheduler",
    "MultiConnectorWorker",
    "MultiMetadata",
    "MultiOutput",
    "kvframe_register_connectors",
]

REQUEST_FAILED_EVENT = "multi.request_failed"
"""Kind of the scheduler-side event for a request whose hand-off failed because its children's
``kv_transfer_params`` clash; data: ``request_id``, ``key`` (the first clashing key),
``children`` (the two labels) and ``reason`` (a sentence naming all three)."""


def _holders(value: Mapping[str, Any]) -> Mapping[str, tuple[int, ...]]:
    return {str(k): tuple(int(i) for i in v) for k, v in value.items()}


def _owners(value: Mapping[str, Any]) -> Mapping[str, int]:
    return {str(k): int(v) for k, v in value.items()}


@attrs.frozen(kw_only=True)
class MultiMetadata(ConnectorMetadata):
    """One step's metadata of a MultiConnector."""

    children: tuple[bytes, ...] = ()
    """Each child's metadata, encoded with that child's codec (child order)."""
    holders: Mapping[str, tuple[int, ...]] = attrs.field(factory=dict, converter=_holders)
    """Requests finished since the last step whose blocks some children keep: request id →
    indexes of those children."""
    load_owners: Mapping[str, int] = attrs.field(factory=dict, converter=_owners)
    """Requests allocated since the last step with external tokens: request id → the index of
    the child that loads them."""

    @property
    def is_empty(self) -> bool:
        return False  # the children's metadata must reach their workers every step


def _index(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"{attribute.name} = {value!r}; it must be a non-negative int")


@attrs.frozen(kw_only=True)
class ChildOutput:
    """One child's own output of one worker rank, for the scheduler side to aggregate per
    child and give back to that child."""

    child: int = attrs.field(validator=_index)
    """The child's index (configuration order)."""
    rank: int = attrs.field(validator=_index)
    """The worker rank that reported it."""
    output: bytes
    """The child's :class:`~kvframe.protocol.messages.ConnectorOutput` (or its own subclass of
    it), encoded with the child's codec, as its metadata is: the children's message classes
    never need to be registered in one codec."""


def _child_outputs(value: Any) -> tuple[ChildOutput, ...]:
    out = tuple(value)
    for i, v in enumerate(out):
        if not isinstance(v, ChildOutput):
            raise TypeError(f"children[{i}] is {v!r}; expected a ChildOutput")
    return out


@attrs.frozen(kw_only=True)
class MultiOutput(ConnectorOutput):
    """One worker rank's report: the combined output the engine acts on (the generic fields)
    and every child's own output."""

    children: tuple[ChildOutput, ...] = attrs.field(default=(), converter=_child_outputs)
    """The children's outputs of this rank, in child order; a child with nothing to report is
    left out."""


def _label(index: int, config: KVTransferConfig) -> str:
    return f"{index}.{config.kv_connector}"


def _children(
    config: KVTransferConfig, host: PluginLookup
) -> list[tuple[KVTransferConfig, type[KVConnector]]]:
    subs = config.connectors
    if not subs:
        raise ConfigError(
            "kv_connector_extra_config.connectors: missing; MultiConnector needs a non-empty "
            "list of connector configurations"
        )
    out = []
    for i, sub in enumerate(subs):
        if sub.kv_connector == "MultiConnector":
            raise ConfigError(
                f"kv_connector_extra_config.connectors[{i}].kv_connector: a MultiConnector "
                "cannot contain another MultiConnector; list the connectors flat"
            )
        try:
            cls = host.connector(sub.kv_connector)
        except Exception as exc:
            raise ConfigError(
                f"kv_connector_extra_config.connectors[{i}].kv_connector: {exc}"
            ) from exc
        out.append((sub, cls))
    return out


def _prefixed_stats(label: str, stats: Stats) -> tuple[dict[str, Any], dict[str, Any]]:
    return (
        {f"{label}.{k}": v for k, v in stats.counters.items()},
        {f"{label}.{k}": v for k, v in stats.gauges.items()},
    )


def _prefixed_events(label: str, events: tuple[KVEvent, ...]) -> list[KVEvent]:
    return [KVEvent(kind=f"{label}.{e.kind}", data=e.data) for e in events]


class MultiConnectorScheduler(KVConnectorScheduler):
    """Scheduler half of :class:`MultiConnector` (rules in the module docstring)."""

    def __init__(
        self,
        labels: list[str],
        children: list[KVConnectorScheduler],
        codecs: list[Codec],
        world_size: int,
    ) -> None:
        self._labels = labels
        self._children = children
        self._codecs = codecs
        self._world = world_size
        self._matched: dict[str, int] = {}
        self._owners: dict[str, int] = {}
        self._new_owners: dict[str, int] = {}
        self._new_holders: dict[str, tuple[int, ...]] = {}
        self._holding: set[str] = set()
        self._aggs = [OutputAggregator(world_size) for _ in children]
        self._counters: dict[str, int] = {}
        self._events: list[KVEvent] = []

    @property
    def children(self) -> tuple[KVConnectorScheduler, ...]:
        """The children's scheduler halves, in configuration order."""
        return tuple(self._children)

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def check_request(self, request: RequestView) -> None:
        """Every child checks the request; the first refusal is raised."""
        for child in self._children:
            child.check_request(request)

    def on_new_request(self, request: RequestView) -> None:
        for child in self._children:
            child.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._matched.pop(request.request_id, None)
        for i, child in enumerate(self._children):
            n, is_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            if n is None:
                return None, False
            if n > 0:
                self._matched[request.request_id] = i
                return n, is_async
        return 0, False

    def update_state_after_alloc(
        self, request: RequestView, blocks: BlockIds, num_external_tokens: int
    ) -> None:
        owner = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0:
            owner = None
        for i, child in enumerate(self._children):
            child.update_state_after_alloc(
                request, blocks, num_external_tokens if i == owner else 0
            )
        if owner is not None:
            self._owners[request.request_id] = owner
            self._new_owners[request.request_id] = owner

    def build_connector_meta(self, scheduler_output: SchedulerStep) -> MultiMetadata:
        children = tuple(
            codec.encode(child.build_connector_meta(scheduler_output))
            for child, codec in zip(self._children, self._codecs, strict=True)
        )
        meta = MultiMetadata(
            step=scheduler_output.step,
            children=children,
            holders=self._new_holders,
            load_owners=self._new_owners,
        )
        self._new_holders = {}
        self._new_owners = {}
        return meta

    def update_connector_output(self, output: ConnectorOutput) -> None:
        """Give each child what its own workers reported (aggregated over ranks); ``output``
        is a :class:`MultiOutput` (a plain ``ConnectorOutput`` carries no child output)."""
        reports = output.children if isinstance(output, MultiOutput) else ()
        for report in reports:
            # A report this side cannot place (a child or rank it does not have, bytes the
            # child's codec refuses) is a bug on the worker side: count it, serve the rest.
            if report.child >= len(self._children):
                self._count("malformed_child_reports")
                continue
            try:
                child_out = self._codecs[report.child].decode_as(report.output, ConnectorOutput)
                self._aggs[report.child].add(report.rank, child_out)
            except (CodecError, TypeError, ValueError):
                self._count("malformed_child_reports")
        for i, child in enumerate(self._children):
            child.update_connector_output(self._aggs[i].take())
        for rid in output.finished_recving:
            self._owners.pop(rid, None)
        for rid in output.finished_sending:
            self._holding.discard(rid)

    def reclaim_blocks(self, num_blocks: int, now: float) -> int:
        """Ask the children in order (the first gives back first) until ``num_blocks`` are
        covered; returns the sum of what they give back."""
        given = 0
        for child in self._children:
            if given >= num_blocks:
                break
            given += child.reclaim_blocks(num_blocks - given, now)
        return given

    def request_finished(
        self, request: RequestView, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        self._matched.pop(request.request_id, None)
        holders: list[int] = []
        merged: dict[str, Any] = {}
        source: dict[str, int] = {}
        clash: dict[str, Any] | None = None
        for i, child in enumerate(self._children):
            delay, params = child.request_finished(request, block_ids)
            if delay:
                holders.append(i)
            for key, value in (params or {}).items():
                if key in merged and clash is None:
                    clash = {"key": key, "children": (self._labels[source[key]], self._labels[i])}
                merged.setdefault(key, value)
                source.setdefault(key, i)
        # Every child has answered, so the blocks of every child that keeps them are released
        # only when all of those reported them (finished_sending), whatever happens next.
        if holders:
            self._new_holders[request.request_id] = tuple(holders)
            self._holding.add(request.request_id)
        if clash is not None:
            # The request has finished: raising would take the engine's step down and lose
            # the blocks. Give no parameters instead: nobody can read what the children keep,
            # so each one's hold ends on its own (a lease expires unread).
            first, second = clash["children"]
            reason = (
                f"request {request.request_id!r}: kv_transfer_params key {clash['key']!r} is "
                f"returned by both {first} and {second}; its KV is not handed off (no "
                "kv_transfer_params). Configure the children so that their parameters do not "
                "overlap"
            )
            self._count("params_clashes")
            self._events.append(
                KVEvent(
                    kind=REQUEST_FAILED_EVENT,
                    data={"request_id": request.request_id, **clash, "reason": reason},
                )
            )
            return bool(holders), None
        return bool(holders), (merged or None)

    def set_xfer_handshake_metadata(self, metadata: Mapping[int, bytes]) -> None:
        per_child: list[dict[int, bytes]] = [{} for _ in self._children]
        for rank, blob in metadata.items():
            try:
                parts = msgpack.unpackb(blob, raw=False)
                if not isinstance(parts, list) or len(parts) != len(self._children):
                    raise ValueError(f"expected {len(self._children)} parts")
            except Exception as exc:
                raise ConfigError(
                    f"worker {rank} sent malformed MultiConnector handshake metadata: {exc}"
                ) from exc
            for i, part in enumerate(parts):
                if part is not None:
                    per_child[i][rank] = bytes(part)
        for child, meta in zip(self._children, per_child, strict=True):
            child.set_xfer_handshake_metadata(meta)

    def has_pending_work(self) -> bool:
        return bool(self._holding) or any(c.has_pending_work() for c in self._children)

    def next_deadline(self) -> float | None:
        """The earliest deadline of the children that have pending work (``-inf`` while this
        connector itself waits for a child's report)."""
        if self._holding:
            return -math.inf
        times = [
            t
            for c in self._children
            if c.has_pending_work() and (t := c.next_deadline()) is not None
        ]
        return min(times) if times else None

    def get_stats(self) -> Stats:
        counters: dict[str, Any] = dict(self._counters)
        self._counters.clear()
        gauges: dict[str, Any] = {"holding": len(self._holding)}
        for label, child in zip(self._labels, self._children, strict=True):
            c, g = _prefixed_stats(label, child.get_stats())
            counters.update(c)
            gauges.update(g)
        return Stats(counters=counters, gauges=gauges)

    def take_events(self) -> tuple[KVEvent, ...]:
        out, self._events = self._events, []
        for label, child in zip(self._labels, self._children, strict=True):
            out.extend(_prefixed_events(label, child.take_events()))
        return tuple(out)

    def shutdown(self) -> None:
        for child in self._children:
            with contextlib.suppress(Exception):  # never raises; the others still stop
                child.shutdown()


class MultiConnectorWorker(KVConnectorWorker):
    """Worker half of :class:`MultiConnector` (rules in the module docstring)."""

    def __init__(
        self, labels: list[str], children: list[KVConnectorWorker], codecs: list[Codec], rank: int
    ) -> None:
        self._labels = labels
        self._children = children
        self._codecs = codecs
        self._rank = rank
        self._owners: dict[str, int] = {}
        self._holders: dict[str, set[int]] = {}
        self._stash: MultiOutput | None = None
        self._counters: dict[str, int] = {}

    @property
    def children(self) -> tuple[KVConnectorWorker, ...]:
        """The children's worker halves, in configuration order."""
        return tuple(self._children)

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        for child in self._children:
            child.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> bytes | None:
        """Every child's handshake metadata (or ``None``), as one msgpack list."""
        return bytes(msgpack.packb([c.get_handshake_metadata() for c in self._children]))

    def bind_connector_metadata(self, meta: ConnectorMetadata) -> None:
        if not isinstance(meta, MultiMetadata):
            raise TypeError(
                f"MultiConnector's worker got {type(meta).__qualname__}; the engine must decode "
                "metadata with codec_for(MultiConnector, config)"
            )
        if len(meta.children) != len(self._children):
            raise ValueError(
                f"MultiMetadata holds {len(meta.children)} children's metadata; this worker "
                f"has {len(self._children)} children"
            )
        super().bind_connector_metadata(meta)
        for rid, owner in meta.load_owners.items():
            self._owners[rid] = owner
        for rid, holders in meta.holders.items():
            self._holders[rid] = set(holders)
        for child, codec, blob in zip(self._children, self._codecs, meta.children, strict=True):
            child.bind_connector_metadata(codec.decode_as(blob, ConnectorMetadata))

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for child in self._children:
            child.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any) -> None:
        for child in self._children:
            child.start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for child in self._children:
            child.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        for child in self._children:
            child.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        for child in self._children:
            child.wait_for_save()

    def _compose(self, finished_req_ids: Set[str]) -> MultiOutput:
        sending: set[str] = set()
        recving: set[str] = set()
        invalid: set[int] = set()
        failures: dict[str, str] = {}
        counters: dict[str, Any] = {}
        gauges: dict[str, Any] = {}
        events: list[KVEvent] = []
        reports: list[ChildOutput] = []
        for i, (label, child) in enumerate(zip(self._labels, self._children, strict=True)):
            out = child.build_connector_worker_output(finished_req_ids)
            for rid in out.finished_recving:
                if self._owners.get(rid) == i:
                    del self._owners[rid]
                    recving.add(rid)
                else:
                    self._count("ignored_finished_recving")
            for rid in out.finished_sending:
                holders = self._holders.get(rid)
                if holders is None or i not in holders:
                    self._count("ignored_finished_sending")
                    continue
                holders.discard(i)
                if not holders:
                    del self._holders[rid]
                    sending.add(rid)
            invalid |= out.invalid_block_ids
            for rid, reason in out.failures.items():
                failures.setdefault(rid, f"{label}: {reason}")
            c, g = _prefixed_stats(label, out.stats)
            counters.update(c)
            gauges.update(g)
            events.extend(_prefixed_events(label, out.events))
            if not out.is_empty:  # nothing to give back: spare the engine the bytes
                reports.append(
                    ChildOutput(child=i, rank=self._rank, output=self._codecs[i].encode(out))
                )
        counters.update(self._counters)
        self._counters.clear()
        return MultiOutput(
            finished_sending=sending,
            finished_recving=recving,
            invalid_block_ids=invalid,
            failures=failures,
            stats=Stats(counters=counters, gauges=gauges),
            events=tuple(events),
            children=tuple(reports),
        )

    def _count(self, name: str, n: int = 1) -> None:
        self._counters[name] = self._counters.get(name, 0) + n

    def build_connector_worker_output(
        self, finished_req_ids: Set[str] = frozenset()
    ) -> MultiOutput:
        """This rank's :class:`MultiOutput`: the combined output and every child's own (the
        children's outputs reach the scheduler side only through this method)."""
        stash, self._stash = self._stash, None
        return stash if stash is not None else self._compose(finished_req_ids)

    # The individual getters share one composed output per step, so an engine that calls
    # them one by one sees the same rules as one that calls build_connector_worker_output.
    def _take_stash(self) -> MultiOutput:
        if self._stash is None:
            self._stash = self._compose(frozenset())
        return self._stash

    def get_finished(self, finished_req_ids: Set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._stash = self._compose(finished_req_ids)
        out = self._stash
        self._stash = attrs.evolve(out, finished_sending=frozenset(), finished_recving=frozenset())
        return set(out.finished_sending) or None, set(out.finished_recving) or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out = self._take_stash()
        self._stash = attrs.evolve(out, invalid_block_ids=frozenset())
        return set(out.invalid_block_ids)

    def take_failures(self) -> Mapping[str, str]:
        out = self._take_stash()
        self._stash = attrs.evolve(out, failures={})
        return dict(out.failures)

    def get_stats(self) -> Stats:
        out = self._take_stash()
        self._stash = attrs.evolve(out, stats=Stats())
        return out.stats

    def take_events(self) -> tuple[KVEvent, ...]:
        out = self._take_stash()
        self._stash = attrs.evolve(out, events=())
        return out.events

    def shutdown(self) -> None:
        for child in self._children:
            with contextlib.suppress(Exception):  # never raises; the others still stop
                child.shutdown()


class MultiConnector(KVConnector):
    """Several connectors behind one (rules in the module docstring). The engine encodes its
    messages with ``codec_for(MultiConnector, config)``."""

    @classmethod
    def metadata_types(cls, config: KVTransferConfig) -> Mapping[str, type[Any]]:
        """``multi.metadata`` (:class:`MultiMetadata`) and ``multi.output``
        (:class:`MultiOutput`), whatever the children: their messages travel inside these as
        bytes encoded with each child's own codec, so their types never meet in one codec (two
        children may even use the same tag for different classes)."""
        return {"multi.metadata": MultiMetadata, "multi.output": MultiOutput}

    @classmethod
    def requires_piecewise_for_cudagraph(
        cls, extra_config: Mapping[str, Any], ctx: BuildContext
    ) -> bool:
        """True when any child needs it (asked with that child's own extra config; children
        are looked up in ``ctx.host``)."""
        subs = extra_config.get("connectors", ())
        for sub in subs:
            child = ctx.host.connector(sub["kv_connector"])
            extra = sub.get("kv_connector_extra_config", {})
            if child.requires_piecewise_for_cudagraph(extra, ctx):
                return True
        return False

    @classmethod
    def get_required_kvcache_layout(cls, config: KVTransferConfig, ctx: BuildContext) -> str | None:
        """The layout the children need: ``None`` when none needs one; raises
        :class:`~kvframe.errors.ConfigError` when two children need different ones."""
        wanted: dict[str, str] = {}
        for i, (sub, child) in enumerate(_children(config, ctx.host)):
            layout = child.get_required_kvcache_layout(sub, ctx)
            if layout is not None:
                wanted[_label(i, sub)] = layout
        if len(set(wanted.values())) > 1:
            raise ConfigError(
                f"MultiConnector children need different KV cache layouts: {wanted}; they "
                "cannot share one KV cache"
            )
        return next(iter(wanted.values()), None)

    @classmethod
    def build_scheduler(
        cls, config: KVTransferConfig, engine: EngineInfo, ctx: BuildContext
    ) -> MultiConnectorScheduler:
        """Build every child's scheduler half (in order; on error the ones built are shut
        down). The children are looked up in ``ctx.host`` and built with ``ctx``."""
        children = _children(config, ctx.host)
        # Before any child is built: a child whose types the codec refuses leaves nothing.
        codecs = [codec_for(c, sub) for sub, c in children]
        built: list[KVConnectorScheduler] = []
        try:
            for sub, child in children:
                built.append(child.build_scheduler(sub, engine, ctx))
        except BaseException:
            for b in built:
                b.shutdown()
            raise
        return MultiConnectorScheduler(
            [_label(i, sub) for i, (sub, _) in enumerate(children)],
            built,
            codecs,
            engine.world_size,
        )

    @classmethod
    def build_worker(
        cls, config: KVTransferConfig, engine: EngineInfo, rank: int, ctx: BuildContext
    ) -> MultiConnectorWorker:
        """Build every child's worker half for ``rank``; as :meth:`build_scheduler`."""
        children = _children(config, ctx.host)
        # Before any child is built: a child whose types the codec refuses leaves nothing.
        codecs = [codec_for(c, sub) for sub, c in children]
        built: list[KVConnectorWorker] = []
        try:
            for sub, child in children:
                built.append(child.build_worker(sub, engine, rank, ctx))
        except BaseException:
            for b in built:
                b.shutdown()
            raise
        return MultiConnectorWorker(
            [_label(i, sub) for i, (sub, _) in enumerate(children)],
            built,
            codecs,
            rank,
        )


@hookimpl
def kvframe_register_connectors(register: Any) -> None:
    """Register the built-in MultiConnector."""
    register("MultiConnector", MultiConnector)
