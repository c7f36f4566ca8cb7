"""The head map of heterogeneous tensor parallelism (kvframe.core.tp) against brute force.

The brute-force map derives each rank's KV heads independently of the module: a rank holds
the KV heads its query heads use (``num_heads = num_kv_heads * group`` query heads split in
order across the ranks, query head ``q`` using KV head ``q // group``), as a model shards them.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvframe.core.tp import (
    HeadSlice,
    check_tp_pair,
    consumers_of,
    head_sources,
    idle_ranks_of,
    kv_heads_of,
    slice_units,
    unit_count,
    unit_heads,
)


def brute_heads(rank: int, tp: int, kv_heads: int) -> list[int]:
    group = tp  # enough query heads per KV head that every rank owns at least one
    q_per_rank = kv_heads * group // tp
    return sorted({q // group for q in range(rank * q_per_rank, (rank + 1) * q_per_rank)})


@st.composite
def pairs(draw: st.DrawFn) -> tuple[int, int, int]:
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    sizes = sorted(
        {d for d in range(1, heads + 1) if heads % d == 0} | {heads * m for m in (2, 3, 4)}
    )
    return draw(st.sampled_from(sizes)), draw(st.sampled_from(sizes)), heads


@settings(max_examples=300, deadline=None)
@given(pairs())
def test_kv_heads_of_matches_the_query_head_derivation(pair: tuple[int, int, int]) -> None:
    p_tp, _, heads = pair
    for r in range(p_tp):
        assert list(kv_heads_of(r, p_tp, heads)) == brute_heads(r, p_tp, heads)


@settings(max_examples=300, deadline=None)
@given(pairs())
def test_every_head_of_a_decode_rank_is_read_once_from_a_holder(
    pair: tuple[int, int, int],
) -> None:
    p_tp, d_tp, heads = pair
    for d in range(d_tp):
        want = brute_heads(d, d_tp, heads)
        slices = head_sources(d, d_tp, p_tp, heads)
        got = [h for s in slices for h in s.heads]
        assert got == want  # each once, in order
        for s in slices:
            held = brute_heads(s.p_rank, p_tp, heads)
            assert list(s.heads) == held[s.p_offset : s.p_offset + len(s)]
            assert list(s.heads) == want[s.d_offset : s.d_offset + len(s)]
        # One slice per source rank: no P rank is read twice by one D rank.
        assert len({s.p_rank for s in slices}) == len(slices)
        # One unit cuts every slice on both sides.
        unit = unit_heads(d, d_tp, p_tp, heads)
        for s in slices:
            assert len(s) % unit == 0
            assert s.p_offset % unit == 0
            assert s.d_offset % unit == 0
            assert len(brute_heads(s.p_rank, p_tp, heads)) % unit == 0


@settings(max_examples=300, deadline=None)
@given(pairs())
def test_consumers_are_the_decode_ranks_reading_each_prefill_rank(
    pair: tuple[int, int, int],
) -> None:
    p_tp, d_tp, heads = pair
    seen: dict[int, set[int]] = {p: set() for p in range(p_tp)}
    for d in range(d_tp):
        for s in head_sources(d, d_tp, p_tp, heads):
            seen[s.p_rank].add(d)
    for p in range(p_tp):
        assert consumers_of(p, p_tp, d_tp, heads) == tuple(sorted(seen[p]))
        if p_tp <= heads:  # no replica on P: every D rank sharing a head with p reads it
            mine = set(brute_heads(p, p_tp, heads))
            assert set(consumers_of(p, p_tp, d_tp, heads)) == {
                d for d in range(d_tp) if mine & set(brute_heads(d, d_tp, heads))
            }


@settings(max_examples=300, deadline=None)
@given(pairs())
def test_every_prefill_rank_is_read_or_told_to_free_by_one_decode_rank(
    pair: tuple[int, int, int],
) -> None:
    p_tp, d_tp, heads = pair
    told = [p for d in range(d_tp) for p in idle_ranks_of(d, d_tp, p_tp, heads)]
    assert len(told) == len(set(told))
    read = {p for p in range(p_tp) if consumers_of(p, p_tp, d_tp, heads)}
    assert read.isdisjoint(told)
    assert read | set(told) == set(range(p_tp))
    if p_tp <= heads:
        assert told == []


@settings(max_examples=100, deadline=None)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]))
def test_replicas_spread_decode_ranks(p_tp: int, d_tp: int) -> None:
    heads = 1  # every rank of both engines holds the single head
    used = {head_sources(d, d_tp, p_tp, heads)[0].p_rank for d in range(d_tp)}
    assert len(used) == min(p_tp, d_tp)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_homogeneous_reads_the_same_rank(n: int) -> None:
    for r in range(n):
        local = len(kv_heads_of(r, n, 4 if n <= 4 else n))
        heads = 4 if n <= 4 else n
        assert head_sources(r, n, n, heads) == (
            HeadSlice(p_rank=r, heads=kv_heads_of(r, n, heads), p_offset=0, d_offset=0),
        )
        assert local >= 1


def test_refused_sizes_name_what_works() -> None:
    with pytest.raises(ValueError, match=r"tp_size = 3 .*num_kv_heads = 4.*1, 2, 4"):
        kv_heads_of(0, 3, 4)
    with pytest.raises(ValueError, match="the decode engine's tp_size = 6"):
        check_tp_pair(2, 6, 4)
    with pytest.raises(ValueError, match="rank = 2"):
        kv_heads_of(2, 2, 4)
    with pytest.raises(ValueError, match="tp_size = 0"):
        head_sources(0, 0, 1, 2)


@settings(max_examples=150, deadline=None)
@given(pairs(), st.integers(1, 3), st.integers(1, 4), st.data())
def test_units_move_exactly_the_decode_ranks_heads(
    pair: tuple[int, int, int], block_size: int, dim: int, data: st.DataObject
) -> None:
    """Copy every slice unit by unit from the P ranks' caches into fresh D caches: the result
    equals each D rank's shard of the whole cache, for random block pairings."""
    p_tp, d_tp, heads = pair
    nblocks = 5
    full = np.arange(nblocks * 2 * block_size * heads * dim, dtype=np.int64).reshape(
        nblocks, 2, block_size, heads, dim
    )
    p_cache = [full[:, :, :, kv_heads_of(p, p_tp, heads), :].copy() for p in range(p_tp)]
    n = data.draw(st.integers(1, nblocks))
    src = data.draw(st.permutations(range(nblocks)))[:n]
    dst = data.draw(st.permutations(range(nblocks)))[:n]
    for d in range(d_tp):
        mine = kv_heads_of(d, d_tp, heads)
        d_cache = np.zeros((nblocks, 2, block_size, len(mine), dim), dtype=np.int64)
        slices = head_sources(d, d_tp, p_tp, heads)
        unit = unit_heads(d, d_tp, p_tp, heads)
        for s in slices:
            p_local = len(kv_heads_of(s.p_rank, p_tp, heads))
            r_units = slice_units(src, block_size, p_local, s.p_offset, len(s), unit)
            l_units = slice_units(dst, block_size, len(mine), s.d_offset, len(s), unit)
            assert len(r_units) == len(l_units)
            pv = p_cache[s.p_rank].reshape(-1, unit * dim)
            dv = d_cache.reshape(-1, unit * dim)
            assert pv.shape[0] == unit_count(nblocks, block_size, p_local, unit)
            assert dv.shape[0] == unit_count(nblocks, block_size, len(mine), unit)
            dv[l_units] = pv[r_units]
        want = full[:, :, :, mine, :]
        assert np.array_equal(d_cache[dst], want[src])
        untouched = sorted(set(range(nblocks)) - set(dst))
        assert not d_cache[untouched].any()


def test_unit_heads_examples() -> None:
    assert unit_heads(0, 1, 2, 4) == 2  # P2 -> D1, 4 heads: 2-head slices
    assert unit_heads(0, 2, 3, 6) == 1  # slices of 2 and 1 heads
    assert unit_heads(0, 4, 2, 2) == 1  # replicated on D
    assert unit_heads(1, 2, 2, 8) == 4  # homogeneous: the whole block row


def test_slice_units_refuses_a_slice_it_cannot_cut() -> None:
    with pytest.raises(ValueError, match="whole number of 2-head units"):
        slice_units([0], 4, 4, 1, 2, 2)
    with pytest.raises(ValueError, match="outside the 4 heads"):
        slice_units([0], 4, 4, 2, 4, 2)
    with pytest.raises(ValueError, match="does not divide the 3 heads"):
        unit_count(2, 4, 3, 2)
