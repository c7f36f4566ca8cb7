"""The scheduler-side index over the offload tiers: :class:`TieredOffloadManager`.

Tier 0 is the memory tier every load copies from; lower tiers (1, 2, ...) are written through
from tier 0 after a store completes, and a block found only in a lower tier is *promoted*
(copied back into tier 0) before it can be loaded. Each tier has its own slots and its own
eviction policy. Every block in a tier is in one of two states:

- ``storing``: its bytes are being written (a store, a write-through or a promotion); it is
  in no policy and is never evicted;
- ``ready``: readable; in the tier's policy; evictable unless *pinned* (a load, a
  write-through or a promotion reads it).

Eviction is all or nothing: a reservation of ``n`` slots either finds room for all of them
(evicting unpinned ready blocks that are not protected) or changes nothing.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from kvframe.connectors.offload.metadata import CopyJob, RemoveJob
from kvframe.protocol.messages import KVEvent
from kvframe.spi.offload import EvictionPolicy, LookupResult, LookupStatus, OffloadManager

__all__ = ["EntryState", "TieredOffloadManager"]

FAILURE_CODES = ("nospace", "corrupt", "error")


class EntryState(enum.Enum):
    """Where a block's bytes are in their life cycle in one tier."""

    STORING = "storing"
    READY = "ready"


@attrs.define
class _Entry:
    slot: int
    state: EntryState
    pins: int = 0


class _Tier:
    def __init__(self, index: int, capacity: int, policy: EvictionPolicy) -> None:
        self.index = index
        self.capacity = capacity
        self.policy = policy
        self.entries: dict[bytes, _Entry] = {}
        # Popping from the end hands out low slot numbers first.
        self.free: list[int] = list(range(capacity - 1, -1, -1))
        self.writable = True

    def ready(self, key: bytes) -> bool:
        e = self.entries.get(key)
        return e is not None and e.state is EntryState.READY


class TieredOffloadManager(OffloadManager):
    """The shipped :class:`~kvframe.spi.offload.OffloadManager`.

    Args:
        tiers: ``(capacity_blocks, policy)`` per tier, fastest first; tier 0 is the memory
            tier loads copy from.
        recovered: tier index → keys a persistent tier already holds (from ``scan()``); they
            start ``ready``. Keys beyond the tier's capacity are queued for removal.

    Raises ``ValueError`` for no tiers or a capacity below 1.
    """

    def __init__(
        self,
        tiers: Sequence[tuple[int, EvictionPolicy]],
        *,
        recovered: Mapping[int, Iterable[bytes]] | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("an offload manager needs at least one tier")
        for i, (cap, _) in enumerate(tiers):
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
                raise ValueError(f"tier {i}: capacity_blocks = {cap!r}; it must be >= 1")
        self._tiers = [_Tier(i, cap, pol) for i, (cap, pol) in enumerate(tiers)]
        self._jobs: list[CopyJob | RemoveJob] = []
        self._copies: dict[int, CopyJob] = {}
        self._events: list[KVEvent] = []
        self._ids = itertools.count(1)
        self.counters: dict[str, int] = {}
        for index, keys in (recovered or {}).items():
            self._recover(index, keys)

    # -- helpers -----------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def _event(self, kind: str, tier: int, keys: Sequence[bytes], **extra: Any) -> None:
        if keys:
            self._events.append(
                KVEvent(kind=kind, data={"tier": tier, "keys": list(keys), **extra})
            )

    def next_job_id(self) -> int:
        """A fresh job id (shared by the manager's jobs and the connector's store jobs)."""
        return next(self._ids)

    def _recover(self, index: int, keys: Iterable[bytes]) -> None:
        tier = self._tiers[index]
        dropped: list[bytes] = []
        for key in keys:
            if key in tier.entries:
                continue
            if not tier.free:
                dropped.append(key)
                continue
            tier.entries[key] = _Entry(tier.free.pop(), EntryState.READY)
            tier.policy.insert(key)
        if dropped:
            self._jobs.append(RemoveJob(tier=index, keys=tuple(dropped), slots=(0,) * len(dropped)))
        self._count(f"tier{index}_recovered", len(tier.entries))

    def _drop(self, tier: _Tier, key: bytes, *, evicted: bool, remove_job: bool = True) -> None:
        e = tier.entries.pop(key)
        if e.state is EntryState.READY:
            tier.policy.remove(key, evicted=evicted)
        tier.free.append(e.slot)
        if remove_job and tier.index > 0:
            self._jobs.append(RemoveJob(tier=tier.index, keys=(key,), slots=(e.slot,)))

    def _reserve(
        self, tier: _Tier, keys: Sequence[bytes], protect: frozenset[bytes]
    ) -> list[int] | None:
        """Slots for ``keys`` (absent from ``tier``), evicting atomically; None: no room."""
        need = len(keys) - len(tier.free)
        if need > 0:

            def can_evict(k: bytes) -> bool:
                e = tier.entries[k]
                return e.pins == 0 and e.state is EntryState.READY and k not in protect

            victims = tier.policy.victims(need, can_evict)
            if victims is None or len(victims) < need:
                self._count(f"tier{tier.index}_no_room")
                return None
            for v in victims:
                if not can_evict(v):
                    raise AssertionError(f"policy chose a block it may not evict: {v.hex()}")
            for v in victims:
                self._drop(tier, v, evicted=True)
            self._count(f"tier{tier.index}_evicted", len(victims))
            self._event("offload.removed", tier.index, victims, reason="evicted")
        slots = [tier.free.pop() for _ in keys]
        for k, s in zip(keys, slots, strict=True):
            tier.entries[k] = _Entry(s, EntryState.STORING)
        return slots

    # -- the contract ------------------------------------------------------------------------
    @property
    def num_tiers(self) -> int:
        """How many tiers the manager indexes."""
        return len(self._tiers)

    def tier_usage(self, index: int) -> tuple[int, int]:
        """``(used, capacity)`` blocks of tier ``index``."""
        t = self._tiers[index]
        return len(t.entries), t.capacity

    def state(self, index: int, key: bytes) -> tuple[EntryState, int] | None:
        """``(state, pins)`` of ``key`` in tier ``index``, or ``None`` when absent."""
        e = self._tiers[index].entries.get(key)
        return None if e is None else (e.state, e.pins)

    def keys(self, index: int) -> frozenset[bytes]:
        """Every key in tier ``index`` (any state)."""
        return frozenset(self._tiers[index].entries)

    def writable(self, index: int) -> bool:
        """False once a tier was disabled (it ran out of space)."""
        return self._tiers[index].writable

    def lookup(self, keys: Sequence[bytes], *, protect: Iterable[bytes] = ()) -> LookupResult:
        top = self._tiers[0]
        ready = 0
        for k in keys:
            if not top.ready(k):
                break
            ready += 1
        self._count("lookups")
        pending = 0
        promote: dict[int, list[bytes]] = {}
        for k in keys[ready:]:
            if k in top.entries:  # being stored or promoted
                pending += 1
                continue
            src = next((t for t in self._tiers[1:] if t.ready(k)), None)
            if src is None:
                break
            promote.setdefault(src.index, []).append(k)
            pending += 1
        if promote:
            guard = frozenset(protect) | frozenset(keys)
            wanted = [k for ks in promote.values() for k in ks]
            slots = self._reserve(top, wanted, guard)
            if slots is None:
                # No room to promote: the blocks before the first one to promote still count.
                first = next(i for i, k in enumerate(keys[ready:]) if k not in top.entries)
                pending = first
                promote = {}
            else:
                slot_of = dict(zip(wanted, slots, strict=True))
                for src_index, ks in promote.items():
                    src = self._tiers[src_index]
                    for k in ks:
                        src.entries[k].pins += 1
                    job = CopyJob(
                        job_id=self.next_job_id(),
                        src_tier=src_index,
                        dst_tier=0,
                        keys=tuple(ks),
                        src_slots=tuple(src.entries[k].slot for k in ks),
                        dst_slots=tuple(slot_of[k] for k in ks),
                    )
                    self._copies[job.job_id] = job
                    self._jobs.append(job)
                    self._count("promotions", len(ks))
        if pending and promote:
            return LookupResult(status=LookupStatus.ASK_AGAIN, ready=ready, pending=pending)
        if pending:
            return LookupResult(status=LookupStatus.NOT_READY, ready=ready, pending=pending)
        if ready:
            self._count("hit_blocks", ready)
            return LookupResult(status=LookupStatus.HIT, ready=ready)
        self._count("misses")
        return LookupResult(status=LookupStatus.MISS)

    def prepare_load(self, keys: Sequence[bytes]) -> tuple[int, ...] | None:
        top = self._tiers[0]
        if not all(top.ready(k) for k in keys):
            return None
        slots = []
        for k in keys:
            e = top.entries[k]
            e.pins += 1
            top.policy.touch(k)
            slots.append(e.slot)
        return tuple(slots)

    def complete_load(self, keys: Sequence[bytes]) -> None:
        top = self._tiers[0]
        for k in keys:
            e = top.entries[k]
            if e.pins <= 0:
                raise ValueError(f"complete_load of {k.hex()[:16]}…, which is not pinned")
            e.pins -= 1

    def prepare_store(
        self, keys: Sequence[bytes], *, protect: Iterable[bytes] = ()
    ) -> tuple[tuple[bytes, int], ...]:
        top = self._tiers[0]
        new: list[bytes] = []
        seen: set[bytes] = set()
        for k in keys:
            if k in seen:
                continue
            seen.add(k)
            if top.ready(k):
                top.policy.touch(k)
            elif k not in top.entries:
                new.append(k)
        if not new:
            return ()
        slots = self._reserve(top, new, frozenset(protect) | frozenset(keys))
        if slots is None:
            self._count("stores_refused", len(new))
            return ()
        self._count("stores_started", len(new))
        return tuple(zip(new, slots, strict=True))

    def complete_store(self, keys: Sequence[bytes], *, ok: bool) -> None:
        top = self._tiers[0]
        done: list[bytes] = []
        for k in keys:
            e = top.entries.get(k)
            if e is None or e.state is not EntryState.STORING:
                raise ValueError(f"complete_store of {k.hex()[:16]}…, which is not being stored")
            if ok:
                e.state = EntryState.READY
                top.policy.insert(k)
                done.append(k)
            else:
                self._drop(top, k, evicted=False)
        if not ok:
            self._count("stores_failed", len(keys))
            return
        self._count("stores_done", len(done))
        self._event("offload.stored", 0, done)
        self._write_through(done)

    def _write_through(self, keys: Sequence[bytes]) -> None:
        top = self._tiers[0]
        for tier in self._tiers[1:]:
            if not tier.writable:
                continue
            todo = [k for k in keys if k not in tier.entries and top.ready(k)]
            if not todo:
                continue
            slots = self._reserve(tier, todo, frozenset())
            if slots is None:
                continue
            for k in todo:
                top.entries[k].pins += 1
            job = CopyJob(
                job_id=self.next_job_id(),
                src_tier=0,
                dst_tier=tier.index,
                keys=tuple(todo),
                src_slots=tuple(top.entries[k].slot for k in todo),
                dst_slots=tuple(slots),
            )
            self._copies[job.job_id] = job
            self._jobs.append(job)

    def complete_copy(self, job_id: int, failed: Mapping[bytes, str]) -> None:
        """A :class:`CopyJob` finished; ``failed`` maps the keys that failed to a code from
        ``"nospace"`` (the destination is full: it is disabled for writes and a
        ``offload.tier_disabled`` event is emitted), ``"corrupt"`` (the source entry is
        damaged: it is dropped) or ``"error"``. Raises ``KeyError`` for an unknown job."""
        job = self._copies.pop(job_id)
        src = self._tiers[job.src_tier]
        dst = self._tiers[job.dst_tier]
        ok: list[bytes] = []
        corrupt: list[bytes] = []
        for k in job.keys:
            s = src.entries.get(k)
            if s is not None:
                s.pins -= 1
            code = failed.get(k)
            if code is None:
                dst.entries[k].state = EntryState.READY
                dst.policy.insert(k)
                ok.append(k)
                continue
            # The tier removed (or never finished) the destination entry itself.
            self._drop(dst, k, evicted=False, remove_job=code != "nospace")
            if code == "corrupt" and s is not None and s.pins == 0:
                self._drop(src, k, evicted=False, remove_job=False)
                corrupt.append(k)
        if corrupt:
            self._count("corrupt_entries", len(corrupt))
            self._event("offload.removed", src.index, corrupt, reason="corrupt")
        if failed:
            self._count(f"tier{dst.index}_copy_failures", len(failed))
        if "nospace" in failed.values() and dst.writable and dst.index > 0:
            dst.writable = False
            self._events.append(
                KVEvent(
                    kind="offload.tier_disabled",
                    data={"tier": dst.index, "reason": "no space left on the device"},
                )
            )
        if ok:
            self._event("offload.stored", dst.index, ok)

    def copy_in_flight(self, job_id: int) -> bool:
        """Whether copy job ``job_id`` is still waiting for its outcome."""
        return job_id in self._copies

    def touch(self, keys: Sequence[bytes]) -> None:
        for tier in self._tiers:
            for k in keys:
                if tier.ready(k):
                    tier.policy.touch(k)

    def take_jobs(self) -> list[CopyJob | RemoveJob]:
        out, self._jobs = self._jobs, []
        return out

    def take_events(self) -> tuple[KVEvent, ...]:
        out = tuple(self._events)
        self._events.clear()
        return out

    def has_jobs_in_flight(self) -> bool:
        """Whether any copy job awaits its outcome or jobs wait to be taken."""
        return bool(self._copies or self._jobs)

    def reset(self) -> None:
        for tier in self._tiers:
            gone = [
                k for k, e in tier.entries.items() if e.state is EntryState.READY and e.pins == 0
            ]
            for k in gone:
                self._drop(tier, k, evicted=False)
            self._event("offload.removed", tier.index, gone, reason="reset")
        self._count("resets")

    def check_invariants(self) -> None:
        for t in self._tiers:
            slots = [e.slot for e in t.entries.values()]
            assert len(slots) == len(set(slots)), f"tier {t.index}: a slot is used twice"
            assert not set(slots) & set(t.free), f"tier {t.index}: a used slot is also free"
            assert len(slots) + len(t.free) == t.capacity, f"tier {t.index}: slots leaked"
            ready = {k for k, e in t.entries.items() if e.state is EntryState.READY}
            assert len(t.policy) == len(ready), f"tier {t.index}: policy out of step"
            for k in ready:
                assert k in t.policy, f"tier {t.index}: ready block missing from the policy"
            for e in t.entries.values():
                assert e.pins >= 0, f"tier {t.index}: negative pins"
                if e.state is EntryState.STORING:
                    assert e.pins == 0, f"tier {t.index}: a block being stored is pinned"
        for job in self._copies.values():
            dst = self._tiers[job.dst_tier]
            for k in job.keys:
                target = dst.entries.get(k)
                assert target is not None, "copy target lost"
                assert target.state is EntryState.STORING, "copy target not in flight"
