"""What the offloading connector's scheduler tells its workers each step, and the job records
the workers report back.

Two messages, registered through ``OffloadingConnector.metadata_types``:
:class:`OffloadMetadata` (tag ``offload.metadata``, scheduler → workers) and
:class:`OffloadOutput` (tag ``offload.output``, each worker → scheduler: the generic output plus
one :class:`JobReport` per finished job of that rank, which the scheduler reads back in
``update_connector_output``). Keys are the 32-byte offload keys
(:func:`kvframe.spi.offload.offload_key`); slots are tier slots.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import attrs

from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput

__all__ = [
    "FAILURE_CODES",
    "CopyJob",
    "JobReport",
    "LoadJob",
    "OffloadMetadata",
    "OffloadOutput",
    "RemoveJob",
    "StoreJob",
]

FAILURE_CODES = frozenset({"nospace", "corrupt", "error"})
"""Why a worker could not store or copy a key: the tier is full, the entry is corrupt, anything
else."""


def _same_length(instance: Any, *names: str) -> None:
    lengths = {n: len(getattr(instance, n)) for n in names}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{type(instance).__name__}: lengths differ: {lengths}")


@attrs.frozen(kw_only=True)
class LoadJob:
    """Copy memory-tier slots into the request's KV blocks, layer by layer, this step
    (synchronous load: each layer waits in ``wait_for_layer_load``)."""

    request_id: str
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        _same_length(self, "block_ids", "slots")


@attrs.frozen(kw_only=True)
class StoreJob:
    """Copy KV blocks into memory-tier slots, layer by layer from ``save_kv_layer``.

    Two kinds, by :attr:`held`: a store *during a step* (the blocks' last tokens were computed
    in this step's forward pass, or earlier; the request is running and the engine may reuse
    its blocks right after the step, so ``wait_for_save`` waits for the copy), and a store *at
    finish* (the engine keeps the finished request's blocks until the worker reports the
    request in ``finished_sending``)."""

    job_id: int
    request_id: str
    block_ids: tuple[int, ...]
    keys: tuple[bytes, ...]
    slots: tuple[int, ...]
    held: bool = True
    """``True``: the engine holds the blocks (``delay_free``) until ``finished_sending``;
    ``False``: a store during a step, done before ``wait_for_save`` returns."""

    def __attrs_post_init__(self) -> None:
        _same_length(self, "block_ids", "keys", "slots")


@attrs.frozen(kw_only=True)
class CopyJob:
    """Copy whole blocks between tiers: a write to a lower tier (``src_tier < dst_tier``) or a
    promotion to the memory tier (``dst_tier == 0``)."""

    job_id: int
    src_tier: int
    dst_tier: int
    keys: tuple[bytes, ...]
    src_slots: tuple[int, ...]
    dst_slots: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        _same_length(self, "keys", "src_slots", "dst_slots")


@attrs.frozen(kw_only=True)
class RemoveJob:
    """Delete blocks from a tier (evicted, corrupt, reset). Best effort; not reported."""

    tier: int
    keys: tuple[bytes, ...]
    slots: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        _same_length(self, "keys", "slots")


@attrs.frozen(kw_only=True)
class OffloadMetadata(ConnectorMetadata):
    """One step's instructions from the offloading scheduler to every worker."""

    offload_loads: tuple[LoadJob, ...] = ()
    offload_stores: tuple[StoreJob, ...] = ()
    copies: tuple[CopyJob, ...] = ()
    removes: tuple[RemoveJob, ...] = ()

    @property
    def is_empty(self) -> bool:
        return super().is_empty and not (
            self.offload_loads or self.offload_stores or self.copies or self.removes
        )


def _non_negative(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if type(value) is not int or value < 0:
        raise ValueError(f"{attribute.name} = {value!r}; it must be a non-negative int")


def _failed(value: Mapping[bytes, str]) -> Mapping[bytes, str]:
    out = dict(value)
    for key, code in out.items():
        if not isinstance(key, bytes) or code not in FAILURE_CODES:
            raise ValueError(
                f"failed[{key!r}] = {code!r}; keys are bytes and codes one of "
                f"{sorted(FAILURE_CODES)}"
            )
    return types.MappingProxyType(out)


@attrs.frozen(kw_only=True)
class JobReport:
    """One rank's outcome of one job."""

    job_id: int = attrs.field(validator=_non_negative)
    rank: int = attrs.field(validator=_non_negative)
    """The worker rank that ran it (the scheduler waits for every rank's report)."""
    failed: Mapping[bytes, str] = attrs.field(factory=dict, converter=_failed, hash=False)
    """Key → failure code (one of :data:`FAILURE_CODES`) for the keys that failed; empty when
    the whole job succeeded."""
    error: str = ""
    """A human-readable reason for the first failure."""


def _jobs(value: Any) -> tuple[JobReport, ...]:
    out = tuple(value)
    for i, v in enumerate(out):
        if not isinstance(v, JobReport):
            raise TypeError(f"jobs[{i}] is {v!r}; expected a JobReport")
    return out


@attrs.frozen(kw_only=True)
class OffloadOutput(ConnectorOutput):
    """One worker rank's report: the generic output and the jobs that finished on this rank
    since the last report. Aggregated over ranks, ``jobs`` holds every rank's reports."""

    jobs: tuple[JobReport, ...] = attrs.field(default=(), converter=_jobs)
