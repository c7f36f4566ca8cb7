"""What the offloading connector's scheduler tells its workers each step, and the job records
the workers report back.

Registered with the codec under the tag ``offload.metadata`` (:data:`OFFLOAD_CODEC`). Keys are
the 32-byte offload keys (:func:`kvframe.spi.offload.offload_key`); slots are tier slots.
Workers report each finished job in one ``offload.job`` :class:`~kvframe.protocol.messages.KVEvent`
per rank (:func:`job_event`), which the scheduler reads back in ``update_connector_output``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvframe.protocol.codec import DEFAULT_CODEC
from kvframe.protocol.messages import ConnectorMetadata, KVEvent

__all__ = [
    "JOB_EVENT",
    "OFFLOAD_CODEC",
    "CopyJob",
    "JobReport",
    "LoadJob",
    "OffloadMetadata",
    "RemoveJob",
    "StoreJob",
    "job_event",
    "parse_job_event",
]

JOB_EVENT = "offload.job"
"""The event kind a worker reports a finished job under."""


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


#: The codec that knows the offloading metadata (and every generic message).
OFFLOAD_CODEC = DEFAULT_CODEC.with_types({"offload.metadata": OffloadMetadata})


@attrs.frozen(kw_only=True)
class JobReport:
    """One rank's outcome of one job."""

    job_id: int
    rank: int
    failed: Mapping[bytes, str] = attrs.field(factory=dict)
    """Key → failure code (``"nospace"``, ``"corrupt"`` or ``"error"``) for the keys that
    failed; empty when the whole job succeeded."""
    error: str = ""
    """A human-readable reason for the first failure."""


def job_event(report: JobReport) -> KVEvent:
    """The event a worker emits for ``report``."""
    return KVEvent(
        kind=JOB_EVENT,
        data={
            "job": report.job_id,
            "rank": report.rank,
            "failed": [[k, code] for k, code in report.failed.items()],
            "error": report.error,
        },
    )


def parse_job_event(event: KVEvent) -> JobReport:
    """The report in an ``offload.job`` event. Raises ``ValueError`` naming what is wrong for
    a malformed one (a foreign or corrupted event)."""
    data = event.data
    try:
        failed = {bytes(k): str(code) for k, code in data["failed"]}
        return JobReport(
            job_id=int(data["job"]),
            rank=int(data["rank"]),
            failed=failed,
            error=str(data.get("error", "")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed {JOB_EVENT} event {dict(data)!r}: {exc}") from exc
