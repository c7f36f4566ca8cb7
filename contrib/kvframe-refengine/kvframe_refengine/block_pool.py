"""The block pool: which KV blocks are in use, by how many holders, and which hold a known
prefix.

Every block is in exactly one of two places:

- **held**: its reference count is positive (requests using it, a delayed free keeping it for
  a remote reader);
- **free**: its count is zero and it sits in the free queue, oldest first.

A block whose content is final (a full block of a request's tokens) can be *cached* under its
chained block hash (:func:`kvframe.spi.request.block_hashes`). A cached block that becomes free
keeps its content and its hash: a later request with the same prefix takes it back with
:meth:`BlockPool.touch` instead of recomputing it. Allocation takes free blocks from the head of
the queue; uncached free blocks are kept at the head, so cached ones are evicted last, least
recently freed first (LRU).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

import attrs

__all__ = ["BlockPool", "CacheEvents", "CacheJournal", "OutOfBlocksError"]

#: Journal entries a :class:`CacheJournal` keeps by default (older ones are dropped; a reader
#: that fell behind them gets a snapshot instead).
JOURNAL_CAPACITY = 8192


@attrs.frozen
class CacheEvents:
    """What :meth:`CacheJournal.since` returns: the prefix cache's changes after a sequence
    number, or (``snapshot`` not ``None``) every cached hash when those changes are gone."""

    seq: int
    """The sequence number of the latest change included (ask ``since(seq)`` next)."""
    events: tuple[tuple[bool, bytes], ...]
    """``(stored, hash)`` in order: ``True`` cached, ``False`` dropped."""
    snapshot: tuple[bytes, ...] | None
    """Every hash cached now, when the reader asked for changes older than the journal keeps
    (replace what you knew); ``None`` otherwise."""
    more: bool
    """More changes follow ``seq`` (the answer was cut at ``limit``)."""


class CacheJournal:
    """The prefix cache's KV events: every block hash cached (``stored``) or dropped
    (``removed``: evicted, uncached), numbered from 1, the latest ``capacity`` kept.

    A router learns which prefixes an engine holds by reading it (``GET /v1/kv_events``).
    """

    def __init__(self, capacity: int = JOURNAL_CAPACITY) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity = {capacity!r}; it must be a positive int")
        self._entries: deque[tuple[int, bool, bytes]] = deque(maxlen=capacity)
        self.seq = 0
        """The latest change's number (0: none yet)."""

    def add(self, stored: bool, block_hash: bytes) -> None:
        self.seq += 1
        self._entries.append((self.seq, stored, block_hash))

    def since(self, after: int, cached: Iterable[bytes], limit: int) -> CacheEvents:
        """The changes numbered above ``after``, at most ``limit`` of them; a snapshot of
        ``cached`` (at most ``limit`` hashes) when ``after`` is older than the oldest change
        kept or newer than the latest (another instance's number)."""
        if limit < 1:
            raise ValueError(f"limit = {limit!r}; it must be >= 1")
        oldest = self._entries[0][0] if self._entries else self.seq + 1
        if after > self.seq or after < oldest - 1:
            snap = tuple(itertools.islice(cached, limit))
            return CacheEvents(self.seq, (), snap, False)
        start = after - oldest + 1  # index of the first change after ``after``
        picked = list(itertools.islice(self._entries, start, start + limit))
        last = picked[-1][0] if picked else after
        events = tuple((st, h) for _, st, h in picked)
        return CacheEvents(last, events, None, last < self.seq)


class OutOfBlocksError(RuntimeError):
    """:meth:`BlockPool.allocate` was asked for more blocks than are free. Nothing was
    allocated; free or evict blocks and try again (the engine's admission control prevents
    this; seeing it from the engine is a bug)."""


class BlockPool:
    """Reference-counted KV blocks with a prefix cache and LRU eviction.

    Args:
        num_blocks: how many blocks the KV cache tensors hold (ids ``0..num_blocks-1``).

    Raises ``ValueError`` for ``num_blocks < 1``. Every method leaves the pool unchanged when it
    raises.
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks = {num_blocks!r}; it must be a positive int")
        self.num_blocks = num_blocks
        self._refs = [0] * num_blocks
        # Keys only; OrderedDict gives O(1) removal from the middle and both ends.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[bytes, int] = {}
        self._block_to_hash: dict[int, bytes] = {}
        self.num_evictions = 0
        """How many cached blocks lost their hash to make room (a counter for tests)."""
        self.journal = CacheJournal()
        """Every hash cached or dropped: the engine's KV events (:class:`CacheJournal`)."""

    # -- queries -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that :meth:`allocate` can hand out now (cached free blocks included)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks currently registered under a block hash (held or free)."""
        return len(self._block_to_hash)

    def cached_hashes(self) -> Iterable[bytes]:
        """Every hash cached now (held or free blocks), in no particular order."""
        return iter(self._hash_to_block)

    def ref_count(self, block: int) -> int:
        """Holders of ``block``. Raises ``IndexError`` for an id outside the pool."""
        self._check_ids((block,))
        return self._refs[block]

    def is_free(self, block: int) -> bool:
        """True when ``block`` has no holder (it may still be cached)."""
        return self.ref_count(block) == 0

    def cached_hash(self, block: int) -> bytes | None:
        """The hash ``block`` is cached under, or ``None``."""
        return self._block_to_hash.get(block)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks holding the longest prefix of ``hashes`` (chained hashes, in order).

        Stops at the first hash that is not cached: a chained hash only means something after
        its parents. Changes nothing; take the blocks with :meth:`touch`.
        """
        out: list[int] = []
        for h in hashes:
            block = self._hash_to_block.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def num_touch_would_take(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` are free now, i.e. how much :meth:`touch` would shrink
        :attr:`num_free`."""
        return sum(1 for b in set(blocks) if self._refs[b] == 0)

    # -- changes -----------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks (reference count 1 each), evicting cached ones if needed.

        Raises ``ValueError`` for a negative ``n`` and :class:`OutOfBlocksError` when fewer than
        ``n`` blocks are free; nothing changes then.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocksError(
                f"asked for {n} blocks but only {len(self._free)} of {self.num_blocks} are free"
            )
        out: list[int] = []
        for _ in range(n):
            block, _unused = self._free.popitem(last=False)
            h = self._block_to_hash.pop(block, None)
            if h is not None:
                del self._hash_to_block[h]
                self.num_evictions += 1
                self.journal.add(False, h)
            self._refs[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[int]) -> None:
        """Add one holder to each of ``blocks`` (a prefix-cache hit); free ones leave the free
        queue. Raises ``IndexError`` for an unknown id; nothing changes then."""
        self._check_ids(blocks)
        for b in blocks:
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one holder from each of ``blocks``; blocks reaching zero become free.

        Blocks are released last-first, so the tail of a request's prefix is evicted before
        its head (a shared head is worth more). Raises ``ValueError`` when a block is already
        free (a double free: a bug in the caller) and ``IndexError`` for an unknown id; nothing
        changes then.
        """
        self._check_ids(blocks)
        drops: dict[int, int] = {}
        for b in blocks:
            drops[b] = drops.get(b, 0) + 1
        for b, n in drops.items():
            if self._refs[b] < n:
                raise ValueError(
                    f"double free of block {b}: it has {self._refs[b]} holder(s) but {n} "
                    "release(s) were asked; the caller freed something it did not hold"
                )
        for b in reversed(blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None
                if b not in self._block_to_hash:
                    # Uncached content is worthless: hand it out before any cached block.
                    self._free.move_to_end(b, last=False)

    def cache(self, block: int, block_hash: bytes) -> bool:
        """Register a held block's final content under ``block_hash``.

        Returns False (and changes nothing) when the hash is already cached in another block
        (equal content computed twice: the other copy stays the cached one) or when the block
        is already cached. Raises ``ValueError`` for a free block (its content may be reused at
        any moment) and ``IndexError`` for an unknown id.
        """
        self._check_ids((block,))
        if self._refs[block] == 0:
            raise ValueError(f"block {block} is free; only held blocks can be cached")
        if block_hash in self._hash_to_block or block in self._block_to_hash:
            return False
        self._hash_to_block[block_hash] = block
        self._block_to_hash[block] = block_hash
        self.journal.add(True, block_hash)
        return True

    def uncache(self, block: int) -> None:
        """Forget ``block``'s hash (its content turned out to be wrong). No-op if uncached."""
        self._check_ids((block,))
        h = self._block_to_hash.pop(block, None)
        if h is not None:
            del self._hash_to_block[h]
            self.journal.add(False, h)
            if self._refs[block] == 0:
                self._free.move_to_end(block, last=False)

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash; returns how many there were. Held blocks stay held."""
        n = len(self._block_to_hash)
        for block in list(self._block_to_hash):
            self.uncache(block)
        return n

    # -- checks ------------------------------------------------------------------------------
    def held_blocks(self) -> dict[int, int]:
        """Block id → holder count, for every block with at least one holder."""
        return {b: r for b, r in enumerate(self._refs) if r}

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant: every block is free xor
        held, counts are never negative, and the two hash maps mirror each other."""
        for b, r in enumerate(self._refs):
            assert r >= 0, f"block {b} has a negative count {r}"
            assert (r == 0) == (b in self._free), f"block {b}: count {r} but free={b in self._free}"
        assert len(self._free) == self._refs.count(0), "the free queue holds a block twice"
        assert len(self._hash_to_block) == len(self._block_to_hash), "hash maps differ in size"
        for h, b in self._hash_to_block.items():
            assert self._block_to_hash.get(b) == h, f"block {b} and hash {h.hex()[:8]} disagree"

    def _check_ids(self, blocks: Iterable[int]) -> None:
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise IndexError(f"block id {b} is outside the pool (0..{self.num_blocks - 1})")
