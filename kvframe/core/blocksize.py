"""Block-size conversion: moving a request's KV between engines of different block sizes.

A prefill engine (P) at block size ``bp`` and a decode engine (D) at block size ``bd`` hold
the same tokens in differently cut blocks: token ``t`` of a request lies in P's block
``t // bp`` at offset ``t % bp`` and in D's block ``t // bd`` at offset ``t % bd`` (each side
counting from its first listed block). KV can move between them when one size is a whole
multiple of the other (:func:`block_size_problem`): then ``chunk = min(bp, bd)`` tokens that
start at a multiple of ``chunk`` always lie in one block on *both* sides, and a chunk of one
K or V is contiguous in memory when the cache order lets a token range be addressed:

- ``NHD`` ``[blocks, 2, block_size, heads, head_size]``: a chunk of K (or V) is one run of
  ``chunk * heads * head_size`` elements;
- ``HND`` ``[blocks, 2, heads, block_size, head_size]``: one run per head, ``chunk *
  head_size`` elements each;
- ``block-major`` (not interpreted): a token range cannot be addressed, so it is refused.

:func:`token_runs` pairs the two sides' blocks token range by token range; :func:`chunk_units`
numbers the runs as *units* (equal-sized pieces of a block: a transport that moves equal-sized
blocks moves them as its blocks, as :mod:`kvframe.core.tp` does for head runs) and
:func:`head_units` composes the conversion with heterogeneous tensor parallelism (NHD units of
``unit`` heads of one token's K or V, per token). When the loaded tokens end inside D's last
block, the rest of that block (:func:`stale_tail`) may hold a chunk's over-read or an earlier
request's KV; D zeroes it once the transfer is done.

Pure functions of integers: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

__all__ = [
    "CUTTABLE_ORDERS",
    "TokenRun",
    "block_size_problem",
    "chunk_of",
    "chunk_units",
    "head_units",
    "stale_tail",
    "token_axis",
    "token_runs",
]

#: The cache orders whose blocks can be cut into token ranges, with the index of the token
#: dimension in a layer's shape after the block dimension.
CUTTABLE_ORDERS: dict[str, int] = {"NHD": 1, "HND": 2}


def token_axis(order: str) -> int | None:
    """The index of the token dimension in a layer's shape after the block dimension
    (``1`` for NHD's ``[2, block_size, heads, head_size]``, ``2`` for HND's), ``None`` for an
    order whose blocks cannot be cut into token ranges."""
    return CUTTABLE_ORDERS.get(order)


def block_size_problem(mine: int, theirs: int, order_mine: str, order_theirs: str) -> str | None:
    """Why KV cannot move between blocks of ``mine`` and ``theirs`` tokens in these cache
    orders, as one sentence naming both sizes and what would work; ``None`` when it can
    (equal sizes, or one a whole multiple of the other with both orders cuttable into token
    ranges, :data:`CUTTABLE_ORDERS`).

    Symmetric in the two sides: both directions (several source blocks filling one
    destination block, one source block split over several) are supported alike."""
    if mine == theirs:
        return None
    head = f"block size: this engine {mine} tokens, the peer {theirs} tokens; "
    one = f"run both engines at one block size ({mine} or {theirs})"
    if max(mine, theirs) % min(mine, theirs):
        lcm = math.lcm(mine, theirs)
        return (
            head + f"KV moves between different block sizes only when one is a whole multiple of "
            f"the other: {one}, or at sizes such as {mine} and {lcm}"
        )
    bad = [o for o in dict.fromkeys((order_mine, order_theirs)) if o not in CUTTABLE_ORDERS]
    if bad:
        return (
            head
            + f"a {'/'.join(bad)} cache cannot be cut into token ranges: {one}, or describe both "
            "caches as NHD (give both connectors EngineInfo.num_kv_heads) so blocks of "
            f"{min(mine, theirs)} tokens can be regrouped into blocks of {max(mine, theirs)}"
        )
    return None


@attrs.frozen
class TokenRun:
    """Tokens that lie in one block on both sides: ``length`` tokens from offset
    ``local_offset`` of block ``local_block`` and from offset ``remote_offset`` of block
    ``remote_block``."""

    local_block: int
    local_offset: int
    remote_block: int
    remote_offset: int
    length: int


def _check_nat(name: str, value: object, lowest: int = 0) -> int:
    if type(value) is not int or value < lowest:
        raise ValueError(f"{name} = {value!r}; it must be an int of at least {lowest}")
    return value


def token_runs(
    start: int,
    stop: int,
    local_blocks: Sequence[int],
    local_bs: int,
    local_first: int,
    remote_blocks: Sequence[int],
    remote_bs: int,
    remote_first: int,
) -> list[TokenRun]:
    """Tokens ``start .. stop - 1`` as maximal runs that lie in one block on both sides, in
    token order. ``local_blocks`` are this side's blocks of ``local_bs`` tokens holding tokens
    from ``local_first`` on (``local_blocks[i]`` holds tokens ``local_first + i * local_bs``
    ..), ``remote_blocks`` the other side's likewise.

    :raises ValueError: a size that is not a positive int, ``start`` before a side's first
        token, or a side whose blocks end before ``stop`` (the message names the side and how
        many blocks it needs).
    """
    _check_nat("local_bs", local_bs, 1)
    _check_nat("remote_bs", remote_bs, 1)
    _check_nat("start", start)
    _check_nat("stop", stop)
    if stop <= start:
        return []
    for side, blocks, bs, first in (
        ("local", local_blocks, local_bs, local_first),
        ("remote", remote_blocks, remote_bs, remote_first),
    ):
        _check_nat(f"{side}_first", first)
        if start < first:
            raise ValueError(
                f"token {start} lies before the {side} blocks' first token {first}; the "
                f"{side} block list must start at or before the first token loaded"
            )
        need = math.ceil((stop - first) / bs)
        if len(blocks) < need:
            raise ValueError(
                f"{len(blocks)} {side} blocks of {bs} tokens from token {first} do not hold "
                f"tokens {start}..{stop - 1}; {need} are needed"
            )
    out: list[TokenRun] = []
    t = start
    while t < stop:
        li, lo = divmod(t - local_first, local_bs)
        ri, ro = divmod(t - remote_first, remote_bs)
        n = min(stop - t, local_bs - lo, remote_bs - ro)
        out.append(TokenRun(local_blocks[li], lo, remote_blocks[ri], ro, n))
        t += n
    return out


def chunk_of(local_bs: int, remote_bs: int, start: int, local_first: int, remote_first: int) -> int:
    """The largest chunk (in tokens) in which :func:`token_runs` of these arguments cut every
    run on both sides: the greatest common divisor of both block sizes and of where ``start``
    lies in each side's first block (``min(bp, bd)`` when one size is a multiple of the other
    and the load starts at a block boundary on both sides)."""
    return math.gcd(local_bs, remote_bs, start - local_first, start - remote_first)


def _order_units(order: str) -> None:
    if order not in CUTTABLE_ORDERS:
        raise ValueError(
            f"order = {order!r}; only {sorted(CUTTABLE_ORDERS)} blocks can be cut into token ranges"
        )


def chunk_units(
    runs: Sequence[TokenRun],
    order: str,
    local_bs: int,
    remote_bs: int,
    chunk: int,
    heads: int = 1,
) -> tuple[list[int], list[int]]:
    """The units each side moves for ``runs`` (from :func:`token_runs`), in a unit layout of
    ``chunk`` tokens of one K or V per unit: NHD blocks cut into ``2 * bs / chunk`` units (all
    heads of ``chunk`` tokens), HND blocks into ``2 * heads * bs / chunk`` units (``chunk``
    tokens of one head). Unit ``i`` of one list holds the same tokens, K/V and heads as unit
    ``i`` of the other. A run whose length is not a multiple of ``chunk`` (the last, when the
    loaded tokens end inside a chunk) is rounded up: the rest of that chunk lies in the same
    block on both sides, and is the destination's stale tail.

    :raises ValueError: an order other than NHD or HND, ``chunk`` not dividing both block
        sizes, or a run that does not start at a multiple of ``chunk`` on both sides.
    """
    _order_units(order)
    _check_nat("chunk", chunk, 1)
    _check_nat("heads", heads, 1)
    if local_bs % chunk or remote_bs % chunk:
        raise ValueError(
            f"chunk = {chunk} tokens does not divide both block sizes ({local_bs} and {remote_bs})"
        )
    lper, rper = local_bs // chunk, remote_bs // chunk
    local: list[int] = []
    remote: list[int] = []
    for run in runs:
        if run.local_offset % chunk or run.remote_offset % chunk:
            raise ValueError(
                f"a run at offsets {run.local_offset} and {run.remote_offset} does not start "
                f"at a multiple of the {chunk}-token chunk"
            )
        n = math.ceil(run.length / chunk)
        lc, rc = run.local_offset // chunk, run.remote_offset // chunk
        rows = 2 if order == "NHD" else 2 * heads
        for row in range(rows):
            lbase = (run.local_block * rows + row) * lper + lc
            rbase = (run.remote_block * rows + row) * rper + rc
            local.extend(range(lbase, lbase + n))
            remote.extend(range(rbase, rbase + n))
    return local, remote


def head_units(
    runs: Sequence[TokenRun],
    local_bs: int,
    remote_bs: int,
    local_heads: int,
    remote_heads: int,
    local_offset: int,
    remote_offset: int,
    count: int,
    unit: int,
) -> tuple[list[int], list[int]]:
    """The units each side moves for ``runs`` (from :func:`token_runs`) when only ``count``
    heads move, from the remote side's local heads ``remote_offset ..`` into this side's
    ``local_offset ..`` (heterogeneous tensor parallelism, :func:`kvframe.core.tp.head_sources`),
    in NHD unit layouts of ``unit`` heads of one token's K or V (:func:`kvframe.core.tp.unit_count`
    with each side's own block size and heads per token). Unit ``i`` of one list holds the same
    token, K/V and heads as unit ``i`` of the other. With equal block sizes and whole blocks
    this is :func:`kvframe.core.tp.slice_units` of both sides.

    :raises ValueError: ``unit`` not dividing the offsets, the count or either side's heads,
        or the slice outside either side's heads.
    """
    _check_nat("unit", unit, 1)
    for name, heads, off in (
        ("local", local_heads, local_offset),
        ("remote", remote_heads, remote_offset),
    ):
        _check_nat(f"{name}_heads", heads, 1)
        if heads % unit or off % unit or count % unit or count <= 0:
            raise ValueError(
                f"a slice of {count} heads at {name} offset {off} of {heads} heads is not a "
                f"whole number of {unit}-head units"
            )
        if off < 0 or off + count > heads:
            raise ValueError(
                f"heads {off}..{off + count - 1} lie outside the {heads} heads a {name} block "
                "holds per token"
            )
    lper, rper = local_heads // unit, remote_heads // unit
    lfirst, rfirst, n = local_offset // unit, remote_offset // unit, count // unit
    local: list[int] = []
    remote: list[int] = []
    for run in runs:
        for kv in range(2):
            lrow = (run.local_block * 2 + kv) * local_bs + run.local_offset
            rrow = (run.remote_block * 2 + kv) * remote_bs + run.remote_offset
            for i in range(run.length):
                lbase = (lrow + i) * lper + lfirst
                rbase = (rrow + i) * rper + rfirst
                local.extend(range(lbase, lbase + n))
                remote.extend(range(rbase, rbase + n))
    return local, remote


def stale_tail(
    stop: int, local_blocks: Sequence[int], local_bs: int, local_first: int
) -> tuple[int, int] | None:
    """Where this side's last block holding token ``stop - 1`` goes on past the loaded
    tokens: ``(block id, first stale offset)``, or ``None`` when ``stop`` ends on a block
    boundary (or nothing was loaded). The stale offsets ``offset .. local_bs - 1`` hold
    whatever was there before (or a rounded-up chunk's over-read) until they are zeroed."""
    _check_nat("local_bs", local_bs, 1)
    if stop <= local_first or not local_blocks:
        return None
    index, offset = divmod(stop - local_first, local_bs)
    if offset == 0:
        return None
    if index >= len(local_blocks):
        raise ValueError(
            f"{len(local_blocks)} local blocks of {local_bs} tokens from token {local_first} "
            f"do not hold token {stop - 1}"
        )
    return local_blocks[index], offset
