"""The tiered offload manager against a plain model, for LRU and ARC (Hypothesis state machine).

The model keeps, per tier, each key's state (storing / ready) and pin count, and for LRU the
recency order of tier 0. Every manager answer is checked against it: what a store reserves
(all new keys or nothing, and nothing only when the model agrees there is no room), which
blocks eviction takes (only ready, unpinned, unprotected ones; for LRU exactly the least
recently used), what a lookup reports, and that a failed store returns its room.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvframe.connectors.offload.manager import EntryState, TieredOffloadManager
from kvframe.connectors.offload.metadata import CopyJob
from kvframe.connectors.offload.policies import ARCPolicy, LRUPolicy
from kvframe.spi.offload import LookupStatus, PolicyConfig

KEYS = [bytes([i]) * 32 for i in range(10)]
CAP = (4, 6)
key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=5, unique=True)


class ManagerMachine(RuleBasedStateMachine):
    policy_cls: type = LRUPolicy

    def __init__(self) -> None:
        super().__init__()
        pols = [self.policy_cls(PolicyConfig(name="p", capacity_blocks=c)) for c in CAP]
        self.m = TieredOffloadManager(list(zip(CAP, pols, strict=True)))
        self.tiers: list[dict[bytes, list]] = [{}, {}]  # key -> [state, pins]
        self.lru: list[bytes] = []  # tier 0 ready keys, least recent first
        self.stores: list[tuple[bytes, ...]] = []
        self.loads: list[tuple[bytes, ...]] = []
        self.copies: dict[int, CopyJob] = {}

    # -- model helpers -------------------------------------------------------------------
    def _evictable(self, t: int, protect: set[bytes]) -> list[bytes]:
        return [
            k for k, (s, p) in self.tiers[t].items() if s == "ready" and p == 0 and k not in protect
        ]

    def _apply_events(self, protect: set[bytes]) -> list[bytes]:
        evicted0: list[bytes] = []
        for ev in self.m.take_events():
            if "keys" not in ev.data:
                assert ev.kind == "offload.tier_disabled"
                continue
            t = ev.data["tier"]
            keys = list(ev.data["keys"])
            if ev.kind == "offload.removed" and ev.data["reason"] == "evicted":
                for k in keys:
                    state, pins = self.tiers[t][k]
                    assert state == "ready", "evicted a block being stored"
                    assert pins == 0, "evicted a pinned block"
                    assert k not in protect or t > 0, "evicted a protected block"
                    del self.tiers[t][k]
                    if t == 0:
                        evicted0.append(k)
                        self.lru.remove(k)
        return evicted0

    def _take_jobs(self) -> None:
        for job in self.m.take_jobs():
            if isinstance(job, CopyJob):
                self.copies[job.job_id] = job
                for k in job.keys:
                    self.tiers[job.src_tier][k][1] += 1
                    assert k not in self.tiers[job.dst_tier] or job.dst_tier == 0
                    self.tiers[job.dst_tier][k] = ["storing", 0]

    # -- rules ---------------------------------------------------------------------------
    @rule(keys=key_lists)
    def store(self, keys: list[bytes]) -> None:
        new = [k for k in keys if k not in self.tiers[0]]
        room = CAP[0] - len(self.tiers[0]) + len(self._evictable(0, set(keys)))
        lru_before = list(self.lru)
        got = self.m.prepare_store(keys, protect=keys)
        evicted = self._apply_events(set(keys))
        if not new or room < len(new):
            assert got == ()
            assert not evicted
        else:
            assert [k for k, _ in got] == new
            need = len(new) - (CAP[0] - len(self.tiers[0]) - len(evicted))
            assert len(evicted) == max(0, need)
            if self.policy_cls is LRUPolicy:
                order = [
                    k for k in lru_before if k in set(self._evictable(0, set(keys))) | set(evicted)
                ]
                assert evicted == order[: len(evicted)], "LRU evicted out of order"
            for k in new:
                self.tiers[0][k] = ["storing", 0]
            self.stores.append(tuple(new))
        for k in keys:
            if k in self.lru:
                self.lru.remove(k)
                self.lru.append(k)

    @precondition(lambda self: self.stores)
    @rule(ok=st.booleans(), data=st.data())
    def finish_store(self, ok: bool, data: st.DataObject) -> None:
        keys = self.stores.pop(data.draw(st.integers(0, len(self.stores) - 1)))
        self.m.complete_store(keys, ok=ok)
        self._apply_events(set())
        for k in keys:
            if ok:
                self.tiers[0][k] = ["ready", 0]
                self.lru.append(k)
            else:
                del self.tiers[0][k]
        self._take_jobs()

    @precondition(lambda self: self.copies)
    @rule(data=st.data())
    def finish_copy(self, data: st.DataObject) -> None:
        job_id = data.draw(st.sampled_from(sorted(self.copies)))
        job = self.copies.pop(job_id)
        codes = st.sampled_from([None, None, "error", "corrupt", "nospace"])
        failed = {k: c for k in job.keys if (c := data.draw(codes)) is not None}
        self.m.complete_copy(job_id, failed)
        for k in job.keys:
            src = self.tiers[job.src_tier].get(k)
            if src is not None:
                src[1] -= 1
            if k in failed:
                del self.tiers[job.dst_tier][k]
                if failed[k] == "corrupt" and src is not None and src[1] == 0:
                    del self.tiers[job.src_tier][k]
                    if job.src_tier == 0:
                        self.lru.remove(k)  # a damaged source leaves the recency order too
            else:
                self.tiers[job.dst_tier][k] = ["ready", 0]
                if job.dst_tier == 0:
                    self.lru.append(k)
        self._apply_events(set())
        self.m.take_jobs()

    @rule(keys=key_lists)
    def lookup(self, keys: list[bytes]) -> None:
        ready = 0
        for k in keys:
            if self.tiers[0].get(k, [None])[0] != "ready":
                break
            ready += 1
        r = self.m.lookup(keys, protect=keys)
        self._apply_events(set(keys))
        assert r.ready == ready
        if r.status is LookupStatus.MISS:
            assert ready == 0
            assert r.pending == 0
        if r.status is LookupStatus.HIT:
            assert ready > 0
            assert r.pending == 0
        self._take_jobs()

    @rule(keys=key_lists)
    def load(self, keys: list[bytes]) -> None:
        all_ready = all(self.tiers[0].get(k, [None])[0] == "ready" for k in keys)
        slots = self.m.prepare_load(keys)
        assert (slots is not None) == all_ready
        if slots is not None:
            for k in keys:
                self.tiers[0][k][1] += 1
                self.lru.remove(k)
                self.lru.append(k)
            self.loads.append(tuple(keys))

    @precondition(lambda self: self.loads)
    @rule()
    def finish_load(self) -> None:
        keys = self.loads.pop(0)
        self.m.complete_load(keys)
        for k in keys:
            self.tiers[0][k][1] -= 1

    @rule()
    def reset(self) -> None:
        self.m.reset()
        for t in (0, 1):
            for k in self._evictable(t, set()):
                del self.tiers[t][k]
                if t == 0:
                    self.lru.remove(k)
        self.m.take_events()
        self.m.take_jobs()

    @invariant()
    def agrees_with_model(self) -> None:
        self.m.check_invariants()
        for t in (0, 1):
            assert self.m.keys(t) == frozenset(self.tiers[t])
            assert len(self.tiers[t]) <= CAP[t]
            for k, (state, pins) in self.tiers[t].items():
                got = self.m.state(t, k)
                assert got is not None
                assert got[0] is (EntryState.READY if state == "ready" else EntryState.STORING)
                assert got[1] == pins


class ARCMachine(ManagerMachine):
    policy_cls = ARCPolicy


TestLRUManager = ManagerMachine.TestCase
TestLRUManager.settings = settings(stateful_step_count=40)
TestARCManager = ARCMachine.TestCase
TestARCManager.settings = settings(stateful_step_count=40)
