"""Heterogeneous tensor parallelism: which prefill rank holds which KV heads of a decode rank.

Both engines shard the KV heads the way Megatron-LM and vLLM do. With ``num_kv_heads`` heads
and ``tp_size`` ranks, rank ``r`` holds

- ``num_kv_heads // tp_size`` consecutive heads, ``[r * k, (r + 1) * k)``, when ``tp_size``
  divides ``num_kv_heads``;
- one head, ``r // (tp_size // num_kv_heads)``, when ``tp_size`` is a multiple of
  ``num_kv_heads`` (each head is *replicated* on ``tp_size // num_kv_heads`` ranks).

Any other size is refused (:func:`kv_heads_of` raises :class:`ValueError` naming the sizes
that work). A decode (D) rank needs exactly its own heads; :func:`head_sources` says which
prefill (P) ranks it reads them from, each head **once**: when P replicates a head, D rank
``d`` reads it from replica ``d % replicas`` (so D ranks that need the same head spread over
its replicas; a replica nobody reads is told to free its blocks by one D rank,
:func:`idle_ranks_of`). Heads a D rank reads from one P rank form one contiguous :class:`HeadSlice`
(contiguous on both sides, since both shard heads in order). :func:`consumers_of` is the
reverse view that P needs: the D ranks that read from a P rank, so that P frees a request's
blocks only after every one of them reported.

:func:`slice_units` turns a slice into transfer units of a block-major cache whose heads are
the innermost dimension but one (``[blocks, 2, block_size, heads, head_dim]``, the reference
engine's and vLLM's NHD layout): a head slice of a block is then ``2 * block_size`` contiguous
runs, one per (K/V, token), each ``len(slice) * head_dim`` elements. A *unit layout* cuts each
layer region into equal runs of ``unit_heads`` heads, so a transport that moves equal-sized
blocks moves head slices as its "blocks" without knowing about heads.

Pure functions of integers: no I/O, no clock.
"""

from __future__ import annotations

import math

import attrs

__all__ = [
    "HeadSlice",
    "check_tp_pair",
    "consumers_of",
    "head_sources",
    "idle_ranks_of",
    "kv_heads_of",
    "slice_units",
    "unit_count",
    "unit_heads",
]


def _positive(name: str, value: object) -> int:
    if type(value) is not int or value < 1:
        raise ValueError(f"{name} = {value!r}; it must be a positive int")
    return value


def _rank(rank: object, tp_size: int) -> int:
    if type(rank) is not int or not 0 <= rank < tp_size:
        raise ValueError(f"rank = {rank!r}; it must lie in 0..{tp_size - 1} (tp_size {tp_size})")
    return rank


def _check_size(tp_size: object, num_kv_heads: object) -> tuple[int, int]:
    n = _positive("tp_size", tp_size)
    h = _positive("num_kv_heads", num_kv_heads)
    if h % n and n % h:
        divisors = [d for d in range(1, h + 1) if h % d == 0]
        raise ValueError(
            f"tp_size = {n} neither divides num_kv_heads = {h} nor is a multiple of it; KV "
            f"heads are split across ranks or replicated, so use a divisor of {h} "
            f"({', '.join(map(str, divisors))}) or a multiple of it"
        )
    return n, h


def kv_heads_of(rank: int, tp_size: int, num_kv_heads: int) -> range:
    """The KV heads (global indices) that rank ``rank`` of ``tp_size`` holds, in order.

    :raises ValueError: a size that neither divides nor is a multiple of ``num_kv_heads``, or
        a rank outside ``0 .. tp_size - 1``.
    """
    n, h = _check_size(tp_size, num_kv_heads)
    r = _rank(rank, n)
    if n <= h:
        k = h // n
        return range(r * k, (r + 1) * k)
    head = r // (n // h)
    return range(head, head + 1)


def _holders(head: int, tp_size: int, num_kv_heads: int) -> range:
    # The ranks that hold global head ``head``.
    if tp_size <= num_kv_heads:
        k = num_kv_heads // tp_size
        return range(head // k, head // k + 1)
    reps = tp_size // num_kv_heads
    return range(head * reps, (head + 1) * reps)


@attrs.frozen
class HeadSlice:
    """Heads a decode rank reads from one prefill rank: ``heads`` (global, contiguous) are
    the prefill rank's local heads ``p_offset ..`` and the decode rank's local heads
    ``d_offset ..``."""

    p_rank: int
    """The prefill rank to read from."""
    heads: range
    """The global KV heads read (contiguous, non-empty)."""
    p_offset: int
    """Index of ``heads[0]`` among the prefill rank's own heads."""
    d_offset: int
    """Index of ``heads[0]`` among the decode rank's own heads."""

    def __len__(self) -> int:
        """The number of heads in the slice."""
        return len(self.heads)


def check_tp_pair(p_tp: int, d_tp: int, num_kv_heads: int) -> None:
    """Raise :class:`ValueError` unless both sizes shard ``num_kv_heads`` heads (a divisor or
    a multiple of it), naming the one that does not."""
    for side, n in (("the prefill engine's", p_tp), ("the decode engine's", d_tp)):
        try:
            _check_size(n, num_kv_heads)
        except ValueError as exc:
            raise ValueError(f"{side} {exc}") from None


def head_sources(d_rank: int, d_tp: int, p_tp: int, num_kv_heads: int) -> tuple[HeadSlice, ...]:
    """Where decode rank ``d_rank`` of ``d_tp`` reads its KV heads from a prefill engine at
    ``p_tp``: one :class:`HeadSlice` per source prefill rank, in head order. Every head the
    decode rank holds is in exactly one slice; a head the prefill engine replicates is read
    from replica ``d_rank % replicas``.

    :raises ValueError: a size that does not shard ``num_kv_heads`` or a rank out of range.
    """
    check_tp_pair(p_tp, d_tp, num_kv_heads)
    mine = kv_heads_of(d_rank, d_tp, num_kv_heads)
    out: list[HeadSlice] = []
    for j, head in enumerate(mine):
        holders = _holders(head, p_tp, num_kv_heads)
        p = holders[d_rank % len(holders)]
        p_off = head - kv_heads_of(p, p_tp, num_kv_heads).start
        last = out[-1] if out else None
        if last is not None and last.p_rank == p and last.heads.stop == head:
            out[-1] = attrs.evolve(last, heads=range(last.heads.start, head + 1))
        else:
            out.append(HeadSlice(p_rank=p, heads=range(head, head + 1), p_offset=p_off, d_offset=j))
    return tuple(out)


def consumers_of(p_rank: int, p_tp: int, d_tp: int, num_kv_heads: int) -> tuple[int, ...]:
    """The decode ranks (of ``d_tp``) that read from prefill rank ``p_rank`` (of ``p_tp``),
    ascending; empty when none does (a replica nobody picked)."""
    check_tp_pair(p_tp, d_tp, num_kv_heads)
    _rank(p_rank, p_tp)
    return tuple(
        d
        for d in range(d_tp)
        if any(s.p_rank == p_rank for s in head_sources(d, d_tp, p_tp, num_kv_heads))
    )


def idle_ranks_of(d_rank: int, d_tp: int, p_tp: int, num_kv_heads: int) -> tuple[int, ...]:
    """The prefill ranks no decode rank reads from (replicas nobody picked: only when
    ``p_tp`` exceeds ``num_kv_heads``) that decode rank ``d_rank`` tells to free their blocks
    at once: prefill rank ``p`` is told by decode rank ``p % d_tp``. Every idle rank is told by
    exactly one decode rank."""
    check_tp_pair(p_tp, d_tp, num_kv_heads)
    _rank(d_rank, d_tp)
    return tuple(
        p for p in range(d_rank, p_tp, d_tp) if not consumers_of(p, p_tp, d_tp, num_kv_heads)
    )


def unit_heads(d_rank: int, d_tp: int, p_tp: int, num_kv_heads: int) -> int:
    """The largest unit (in heads) that cuts every slice of :func:`head_sources` on both sides:
    the greatest common divisor of the slices' lengths and offsets and of the heads per token
    of the decode rank and of each source rank (``2`` for 4 heads read from P at TP 2 into D
    at TP 1; ``1`` when 6 heads at TP 3 are read at TP 2, where slices of 2 and 1 heads meet)."""
    slices = head_sources(d_rank, d_tp, p_tp, num_kv_heads)
    g = len(kv_heads_of(d_rank, d_tp, num_kv_heads))
    for s in slices:
        g = math.gcd(g, len(s), s.p_offset, s.d_offset)
        g = math.gcd(g, len(kv_heads_of(s.p_rank, p_tp, num_kv_heads)))
    return g


def unit_count(num_blocks: int, block_size: int, local_heads: int, unit_heads: int) -> int:
    """The units a unit layout cuts one ``[num_blocks, 2, block_size, local_heads, dim]``
    region into (each ``unit_heads`` heads of one token's K or V).

    :raises ValueError: ``unit_heads`` does not divide ``local_heads``, or a size is not a
        positive int.
    """
    for name, v in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("local_heads", local_heads),
        ("unit_heads", unit_heads),
    ):
        _positive(name, v)
    if local_heads % unit_heads:
        raise ValueError(
            f"unit_heads = {unit_heads} does not divide the {local_heads} heads a block holds "
            "per token; a unit is a whole number of heads of one token"
        )
    return num_blocks * 2 * block_size * (local_heads // unit_heads)


def slice_units(
    blocks: list[int] | tuple[int, ...],
    block_size: int,
    local_heads: int,
    offset: int,
    count: int,
    unit_heads: int,
) -> list[int]:
    """Unit indices of heads ``offset .. offset + count - 1`` of every (K/V, token) of each
    block in ``blocks``, in (block, K/V, token, head) order, in a unit layout of
    ``unit_heads`` heads per unit (see :func:`unit_count`). Two sides' lists of the same slice
    pair up element by element: unit ``i`` of one holds the same token, K/V and heads as unit
    ``i`` of the other.

    :raises ValueError: ``offset`` or ``count`` not a multiple of ``unit_heads``, or the slice
        outside the ``local_heads`` heads.
    """
    _positive("unit_heads", unit_heads)
    if offset % unit_heads or count % unit_heads or count <= 0:
        raise ValueError(
            f"a slice of {count} heads at offset {offset} is not a whole number of "
            f"{unit_heads}-head units"
        )
    if offset < 0 or offset + count > local_heads:
        raise ValueError(
            f"heads {offset}..{offset + count - 1} lie outside the {local_heads} heads a block "
            "holds per token"
        )
    per_token = local_heads // unit_heads
    first, n = offset // unit_heads, count // unit_heads
    rows = 2 * block_size
    out: list[int] = []
    for b in blocks:
        base = b * rows
        for row in range(base, base + rows):
            start = row * per_token + first
            out.extend(range(start, start + n))
    return out
