"""Block-size conversion (kvframe.core.blocksize) against a token-by-token brute-force model.

The model: both caches are numpy arrays of their real shape (NHD ``[blocks, 2, bs, heads,
dim]`` or HND ``[blocks, 2, heads, bs, dim]``); the remote one holds a distinct value per
element. The units the module plans are copied as equal flat slices (what a transport does
with a unit layout), then every loaded token's K/V of every head is compared element by
element with where the token lies on each side, and every element written that is not a
loaded token must lie in the stale tail of the last local block (which D zeroes).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvframe.core.blocksize import (
    TokenRun,
    block_size_problem,
    chunk_of,
    chunk_units,
    head_units,
    stale_tail,
    token_axis,
    token_runs,
)
from kvframe.core.tp import slice_units

DIM = 2


def _cache(order: str, blocks: int, bs: int, heads: int) -> tuple[int, ...]:
    return (blocks, 2, bs, heads, DIM) if order == "NHD" else (blocks, 2, heads, bs, DIM)


def _at(cache: np.ndarray, order: str, block: int, kv: int, off: int, head: int) -> np.ndarray:
    if order == "NHD":
        return cache[block, kv, off, head]
    return cache[block, kv, head, off]


def _copy_units(
    src: np.ndarray, dst: np.ndarray, src_units: list[int], dst_units: list[int], ulen: int
) -> None:
    s, d = src.reshape(-1), dst.reshape(-1)
    assert s.size % ulen == 0
    assert d.size % ulen == 0
    assert len(src_units) == len(dst_units)
    for r, loc in zip(src_units, dst_units, strict=True):
        assert 0 <= r < s.size // ulen
        assert 0 <= loc < d.size // ulen
        d[loc * ulen : (loc + 1) * ulen] = s[r * ulen : (r + 1) * ulen]


@st.composite
def loads(draw: st.DrawFn) -> dict[str, int | list[int]]:
    base = draw(st.sampled_from([1, 2, 4]))
    k = draw(st.sampled_from([1, 2, 3, 4]))
    bp, bd = (base, base * k) if draw(st.booleans()) else (base * k, base)
    start = draw(st.integers(0, 3 * max(bp, bd)))
    stop = draw(st.integers(start, start + 5 * max(bp, bd)))
    lfirst, rfirst = start // bd * bd, start // bp * bp
    nl, nr = math.ceil((stop - lfirst) / bd), math.ceil((stop - rfirst) / bp)
    pool = 2 * max(nl, nr) + 2
    local = draw(st.permutations(range(pool)))[:nl]
    remote = draw(st.permutations(range(pool)))[:nr]
    return {
        "bp": bp,
        "bd": bd,
        "start": start,
        "stop": stop,
        "lfirst": lfirst,
        "rfirst": rfirst,
        "local": list(local),
        "remote": list(remote),
        "pool": pool,
    }


def _check_tokens(
    load: dict, order: str, p: np.ndarray, d: np.ndarray, heads: list[tuple[int, int]]
) -> None:
    """Every loaded token, K/V and (local head, remote head) pair of ``heads`` equal; every
    other written element in the stale tail."""
    bp, bd = load["bp"], load["bd"]
    written = d != -1
    for t in range(load["start"], load["stop"]):
        li, lo = divmod(t - load["lfirst"], bd)
        ri, ro = divmod(t - load["rfirst"], bp)
        lb, rb = load["local"][li], load["remote"][ri]
        for kv in range(2):
            for lh, rh in heads:
                got = _at(d, order, lb, kv, lo, lh)
                want = _at(p, order, rb, kv, ro, rh)
                assert (got == want).all(), (t, kv, lh)
                _at(written, order, lb, kv, lo, lh)[...] = False
    tail = stale_tail(load["stop"], load["local"], bd, load["lfirst"])
    if tail is not None:
        block, off = tail
        if order == "NHD":
            written[block, :, off:] = False
        else:
            written[block, :, :, off:] = False
    assert not written.any(), "an element outside the loaded tokens and the stale tail"


@settings(max_examples=200, deadline=None)
@given(loads(), st.sampled_from(["NHD", "HND"]), st.integers(1, 3))
def test_chunk_units_move_every_token_to_its_place(load: dict, order: str, heads: int) -> None:
    bp, bd = load["bp"], load["bd"]
    runs = token_runs(
        load["start"],
        load["stop"],
        load["local"],
        bd,
        load["lfirst"],
        load["remote"],
        bp,
        load["rfirst"],
    )
    assert sum(r.length for r in runs) == load["stop"] - load["start"]
    chunk = chunk_of(bd, bp, load["start"], load["lfirst"], load["rfirst"])
    if load["start"] % bd == 0:  # D loads from a block boundary (its prefix cache's end)
        assert chunk == min(bp, bd)
    local, remote = chunk_units(runs, order, bd, bp, chunk, heads)
    p = np.arange(math.prod(_cache(order, load["pool"], bp, heads))).reshape(
        _cache(order, load["pool"], bp, heads)
    )
    d = np.full(_cache(order, load["pool"], bd, heads), -1)
    ulen = chunk * DIM * (heads if order == "NHD" else 1)
    _copy_units(p, d, remote, local, ulen)
    _check_tokens(load, order, p, d, [(h, h) for h in range(heads)])


@st.composite
def head_slices(draw: st.DrawFn) -> tuple[int, int, int, int, int, int]:
    unit = draw(st.sampled_from([1, 2]))
    lheads = unit * draw(st.integers(1, 3))
    rheads = unit * draw(st.integers(1, 3))
    count = unit * draw(st.integers(1, min(lheads, rheads) // unit))
    loff = unit * draw(st.integers(0, (lheads - count) // unit))
    roff = unit * draw(st.integers(0, (rheads - count) // unit))
    return lheads, rheads, loff, roff, count, unit


@settings(max_examples=200, deadline=None)
@given(loads(), head_slices())
def test_head_units_compose_block_sizes_with_head_slices(load: dict, sl: tuple) -> None:
    lheads, rheads, loff, roff, count, unit = sl
    bp, bd = load["bp"], load["bd"]
    runs = token_runs(
        load["start"],
        load["stop"],
        load["local"],
        bd,
        load["lfirst"],
        load["remote"],
        bp,
        load["rfirst"],
    )
    local, remote = head_units(runs, bd, bp, lheads, rheads, loff, roff, count, unit)
    p = np.arange(math.prod(_cache("NHD", load["pool"], bp, rheads))).reshape(
        _cache("NHD", load["pool"], bp, rheads)
    )
    d = np.full(_cache("NHD", load["pool"], bd, lheads), -1)
    _copy_units(p, d, remote, local, unit * DIM)
    pairs = [(loff + j, roff + j) for j in range(count)]
    # Only the slice's heads are written, and only of loaded tokens (no rounding per token).
    _check_tokens_heads_only(load, p, d, pairs, d != -1)


def _check_tokens_heads_only(
    load: dict, p: np.ndarray, d: np.ndarray, pairs: list[tuple[int, int]], written: np.ndarray
) -> None:
    bp, bd = load["bp"], load["bd"]
    for t in range(load["start"], load["stop"]):
        li, lo = divmod(t - load["lfirst"], bd)
        ri, ro = divmod(t - load["rfirst"], bp)
        lb, rb = load["local"][li], load["remote"][ri]
        for kv in range(2):
            for lh, rh in pairs:
                assert (d[lb, kv, lo, lh] == p[rb, kv, ro, rh]).all(), (t, kv, lh)
                written[lb, kv, lo, lh] = False
    assert not written.any(), "an element outside the loaded tokens' slice heads"


def test_head_units_at_equal_block_sizes_are_slice_units() -> None:
    blocks = [3, 0, 5]
    runs = token_runs(0, 12, blocks, 4, 0, [7, 2, 1], 4, 0)
    local, remote = head_units(runs, 4, 4, 4, 2, 2, 0, 2, 1)
    assert local == slice_units(blocks, 4, 4, 2, 2, 1)
    assert remote == slice_units([7, 2, 1], 4, 2, 0, 2, 1)


def test_token_runs_of_a_worked_example() -> None:
    # P 16 -> D 32, 40 tokens: two P blocks fill D's first block, the third half of D's second.
    runs = token_runs(0, 40, [9, 4], 32, 0, [1, 2, 3], 16, 0)
    assert runs == [
        TokenRun(9, 0, 1, 0, 16),
        TokenRun(9, 16, 2, 0, 16),
        TokenRun(4, 0, 3, 0, 8),
    ]
    assert stale_tail(40, [9, 4], 32, 0) == (4, 8)
    assert stale_tail(64, [9, 4], 32, 0) is None
    # P 32 -> D 16 from token 16 on (D had its first block): P's block 0 splits.
    runs = token_runs(16, 40, [6, 7], 16, 16, [5, 8], 32, 0)
    assert runs == [TokenRun(6, 0, 5, 16, 16), TokenRun(7, 0, 8, 0, 8)]


def test_token_runs_refuse_too_few_blocks_naming_the_side() -> None:
    with pytest.raises(ValueError, match=r"2 remote blocks of 16 tokens .* 3 are needed"):
        token_runs(0, 40, [1, 2], 32, 0, [1, 2], 16, 0)
    with pytest.raises(ValueError, match="before the local blocks' first token"):
        token_runs(0, 40, [1, 2], 32, 16, [1, 2, 3], 16, 0)


def test_block_size_problem_names_both_sizes_and_what_would_work() -> None:
    assert block_size_problem(16, 16, "block-major", "block-major") is None
    assert block_size_problem(16, 32, "NHD", "NHD") is None
    assert block_size_problem(48, 16, "HND", "HND") is None
    ratio = block_size_problem(16, 24, "NHD", "NHD")
    assert ratio is not None
    assert "this engine 16 tokens, the peer 24 tokens" in ratio
    assert "whole multiple" in ratio
    assert "(16 or 24)" in ratio
    assert "16 and 48" in ratio
    opaque = block_size_problem(16, 32, "block-major", "block-major")
    assert opaque is not None
    assert "cannot be cut into token ranges" in opaque
    assert "EngineInfo.num_kv_heads" in opaque
    assert token_axis("NHD") == 1
    assert token_axis("HND") == 2
    assert token_axis("block-major") is None


def test_chunk_units_refuse_what_cannot_be_cut() -> None:
    runs = [TokenRun(0, 0, 0, 0, 4)]
    with pytest.raises(ValueError, match="only"):
        chunk_units(runs, "block-major", 4, 8, 4)
    with pytest.raises(ValueError, match="does not divide"):
        chunk_units(runs, "NHD", 4, 6, 4)
    with pytest.raises(ValueError, match="multiple of the 4-token chunk"):
        chunk_units([TokenRun(0, 2, 0, 0, 2)], "NHD", 4, 8, 4)
