"""The built-in eviction policies: ``"lru"`` and ``"arc"``.

Both implement :class:`kvframe.spi.offload.EvictionPolicy`: pure bookkeeping over ordered
dicts, O(1) per insert/touch/remove; :meth:`victims` walks from the coldest end and skips keys
the manager may not evict, so it costs O(n + skipped).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvframe.spi.offload import EvictionPolicy, PolicyConfig

__all__ = ["ARCPolicy", "LRUPolicy"]


class LRUPolicy(EvictionPolicy):
    """Least recently used first: a hit or a store makes a block the most recent."""

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        if key in self._order:
            raise KeyError(f"LRU: key {key.hex()[:16]}… inserted twice")
        self._order[key] = None

    def touch(self, key: bytes) -> None:
        self._order.move_to_end(key)

    def remove(self, key: bytes, *, evicted: bool) -> None:
        del self._order[key]

    def victims(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        out: list[bytes] = []
        if n <= 0:
            return out
        for key in self._order:
            if can_evict(key):
                out.append(key)
                if len(out) == n:
                    return out
        return None

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def order(self) -> list[bytes]:
        """Keys from least to most recently used (diagnostics and tests)."""
        return list(self._order)


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo and Modha, FAST 2003).

    Two lists of resident blocks: ``T1`` (seen once recently) and ``T2`` (seen at least
    twice), and two *ghost* lists of recently evicted keys, ``B1`` and ``B2``, which hold no
    data. A store of a key found in ``B1`` means recency was undervalued: the target size
    ``p`` of ``T1`` grows; one found in ``B2`` shrinks it. Eviction takes ``T1``'s oldest
    while ``T1`` is above ``p``, else ``T2``'s oldest. A scan of one-off prefixes therefore
    flows through ``T1`` without flushing the blocks that are reused (``T2``), which is what
    multi-turn chat traffic looks like: a shared system prompt reused by every turn among many
    unique tails.

    The resident lists are sized by the tier (the manager evicts before inserting); the ghost
    lists are trimmed to the tier's capacity each.
    """

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self._c = config.capacity_blocks
        self._p = 0.0
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()

    @property
    def target(self) -> float:
        """ARC's ``p``: the adaptive target size of the recency list ``T1``."""
        return self._p

    def insert(self, key: bytes) -> None:
        if key in self._t1 or key in self._t2:
            raise KeyError(f"ARC: key {key.hex()[:16]}… inserted twice")
        if key in self._b1:
            self._p = min(float(self._c), self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None

    def touch(self, key: bytes) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def remove(self, key: bytes, *, evicted: bool) -> None:
        if key in self._t1:
            del self._t1[key]
            if evicted:
                self._b1[key] = None
        else:
            del self._t2[key]
            if evicted:
                self._b2[key] = None
        self._trim()

    def _trim(self) -> None:
        while len(self._b1) > self._c:
            self._b1.popitem(last=False)
        while len(self._b2) > self._c:
            self._b2.popitem(last=False)

    def victims(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        out: list[bytes] = []
        if n <= 0:
            return out
        t1 = _evictable(self._t1, can_evict)
        t2 = _evictable(self._t2, can_evict)
        t1_size = len(self._t1)
        next1 = next(t1, None)
        next2 = next(t2, None)
        while len(out) < n:
            if next1 is None and next2 is None:
                return None
            take_t1 = next1 is not None and (next2 is None or t1_size > self._p or t1_size == 0)
            if take_t1:
                assert next1 is not None
                out.append(next1)
                t1_size -= 1
                next1 = next(t1, None)
            else:
                assert next2 is not None
                out.append(next2)
                next2 = next(t2, None)
        return out

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def lists(self) -> dict[str, list[bytes]]:
        """The four lists, oldest first (diagnostics and tests)."""
        return {
            "t1": list(self._t1),
            "t2": list(self._t2),
            "b1": list(self._b1),
            "b2": list(self._b2),
        }


def _evictable(
    order: OrderedDict[bytes, None], can_evict: Callable[[bytes], bool]
) -> Iterator[bytes]:
    return (k for k in order if can_evict(k))
