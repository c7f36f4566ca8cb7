"""The block pool against a plain model: a Hypothesis state machine plus a few direct cases."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)
from kvframe_refengine.block_pool import BlockPool, OutOfBlocksError

NUM_BLOCKS = 8


def _h(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(4, "little")).digest()


class PoolMachine(RuleBasedStateMachine):
    """Holders allocate, share (touch), cache, free; the model tracks who holds what.

    Each bundle item is one *holding*: a list of blocks one holder owns one reference to. A
    holding is consumed when freed, so a double free can only come from the pool itself.
    """

    holdings = Bundle("holdings")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.refs = [0] * NUM_BLOCKS
        self.cached: dict[bytes, int] = {}
        self.next_hash = 0

    def _free_count(self) -> int:
        return self.refs.count(0)

    @rule(target=holdings, n=st.integers(0, NUM_BLOCKS))
    def allocate(self, n: int) -> list[int]:
        if n > self._free_count():
            with pytest.raises(OutOfBlocksError):
                self.pool.allocate(n)
            return []
        blocks = self.pool.allocate(n)
        assert len(set(blocks)) == n
        for b in blocks:
            assert self.refs[b] == 0, f"allocated held block {b}"
            self.refs[b] = 1
            # An evicted block loses its hash: drop it from the model too.
            self.cached = {h: c for h, c in self.cached.items() if c != b}
        return blocks

    @rule(holding=consumes(holdings))
    def free(self, holding: list[int]) -> None:
        self.pool.free(holding)
        for b in holding:
            self.refs[b] -= 1

    @rule(target=holdings, holding=holdings)
    def share(self, holding: list[int]) -> list[int]:
        # Another holder takes the same blocks, as a prefix-cache hit does.
        live = [b for b in holding if self.refs[b] > 0]
        self.pool.touch(live)
        for b in live:
            self.refs[b] += 1
        return live

    @rule(holding=holdings, data=st.data())
    def cache(self, holding: list[int], data: st.DataObject) -> None:
        live = [b for b in holding if self.refs[b] > 0]
        if not live:
            return
        b = data.draw(st.sampled_from(live))
        h = _h(self.next_hash)
        self.next_hash += 1
        took = self.pool.cache(b, h)
        assert took == (b not in self.cached.values())
        if took:
            self.cached[h] = b

    @precondition(lambda self: self.cached)
    @rule(target=holdings, data=st.data())
    def hit(self, data: st.DataObject) -> list[int]:
        h = data.draw(st.sampled_from(sorted(self.cached)))
        found = self.pool.lookup([h])
        assert found == [self.cached[h]]
        self.pool.touch(found)
        self.refs[found[0]] += 1
        return found

    @rule()
    def double_free_is_refused(self) -> None:
        free = [b for b in range(NUM_BLOCKS) if self.refs[b] == 0]
        if free:
            with pytest.raises(ValueError, match="double free"):
                self.pool.free([free[0]])

    @invariant()
    def matches_model(self) -> None:
        self.pool.check_invariants()
        assert self.pool.num_free == self._free_count()
        assert [self.pool.ref_count(b) for b in range(NUM_BLOCKS)] == self.refs
        assert self.pool.num_cached == len(self.cached)
        for h, b in self.cached.items():
            assert self.pool.cached_hash(b) == h


TestPoolMachine = PoolMachine.TestCase


def test_cached_blocks_are_evicted_last_and_lru() -> None:
    pool = BlockPool(4)
    a, b, c, d = pool.allocate(4)
    assert pool.cache(a, _h(0))
    assert pool.cache(b, _h(1))
    pool.free([a, b, c, d])
    # Uncached c, d go first; then the cached ones, b (freed after a, as the tail) first.
    assert sorted(pool.allocate(2)) == sorted([c, d])
    assert pool.allocate(1) == [b]
    assert pool.lookup([_h(0), _h(1)]) == [a]
    assert pool.num_evictions == 1


def test_lookup_stops_at_first_miss() -> None:
    pool = BlockPool(3)
    x, _y, z = pool.allocate(3)
    pool.cache(x, _h(0))
    pool.cache(z, _h(2))
    assert pool.lookup([_h(0), _h(1), _h(2)]) == [x]


def test_bad_arguments_name_the_problem() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    pool = BlockPool(2)
    with pytest.raises(IndexError, match="outside the pool"):
        pool.touch([5])
    with pytest.raises(ValueError, match="only held blocks"):
        pool.cache(0, _h(0))
    with pytest.raises(OutOfBlocksError, match="only 2 of 2"):
        pool.allocate(3)
    pool.check_invariants()
