"""Layout permutation on arrival (``allow_layout_permute``): D reads blocks of P's KV cache
order into a staging area and permutes them into its own.

**What may be permuted.** Only the two orders whose dimensions the connector knows
(:data:`~kvframe.connectors.pd.handshake.LAYOUT_ORDERS`): ``"NHD"`` ``[blocks, 2, block_size,
heads, head_size]`` and ``"HND"`` ``[blocks, 2, heads, block_size, head_size]``, when
everything else the handshake compares is equal (dtype, head size, block size, KV heads, the
layers) and so are the tensor-parallel sizes (:func:`permutable`). ``"block-major"`` (the
engine does not say what its blocks hold) is never permuted; neither is a block-size or
tensor-parallel difference at the same time (refused at the handshake, every field named).

**Where the bytes go.** Nothing is read into a layout it does not match: a READ from a peer of
the other order lands in a :class:`StagingArea` (slots of one block of every layer, registered
with the transport next to the KV cache), and only once the READ is DONE does
:func:`permute_blocks` write the blocks, in this engine's order, into the cache's destination
blocks; then the load is reported done. A READ that failed, was stopped, or is partial never
reaches the cache: its slots are freed and the load fails (its blocks are recomputed like any
failed load's).

**Bounds.** The staging area holds ``permute_staging_blocks`` slots (memory: that many blocks
of every layer, allocated on the cache's device when the KV caches are registered). A load
that needs more slots than the whole area fails at once, naming the option. A load that finds
too few free slots waits, in arrival order, for the loads ahead of it to end; it is heartbeated
as a posted load, and it ends like one by the reader's deadline of a posted load (the earlier
of the confirmed lease bound and ``transfer_timeout`` after the reader asked for the post), so
every request still ends within :meth:`LeaseReader.bound <kvframe.core.reader.LeaseReader.bound>`.

**Threads.** None of its own: the permutation runs on the worker's thread at the progress
point that saw the READ done (a ``torch`` gather, transpose and scatter on the cache's device),
before that progress point reports the load.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

from kvframe.connectors.pd.handshake import KVLayerFacts, KVLayoutFacts, layout_mismatches

if TYPE_CHECKING:
    import torch

__all__ = [
    "PERMUTABLE_ORDERS",
    "StagingArea",
    "as_order",
    "order_refusal",
    "permutable",
    "permute_blocks",
    "permute_refusal",
]

#: The orders a block can be permuted between (the tokens and heads dimensions swap).
PERMUTABLE_ORDERS = frozenset({"NHD", "HND"})


def as_order(facts: KVLayoutFacts, order: str) -> KVLayoutFacts:
    """``facts`` as they would read in ``order`` (``"NHD"`` or ``"HND"``): each layer's shape
    with its tokens and heads dimensions swapped when ``order`` differs from ``facts.order``.
    Raises ``ValueError`` for an order or facts that cannot be permuted."""
    if order not in PERMUTABLE_ORDERS or facts.order not in PERMUTABLE_ORDERS:
        raise ValueError(
            f"cannot permute KV cache order {facts.order!r} into {order!r}; only NHD and HND"
        )
    if order == facts.order:
        return facts
    layers = []
    for layer in facts.layers:
        if len(layer.shape) != 4:
            raise ValueError(
                f"layer {layer.name!r} has shape {list(layer.shape)}; an {facts.order} layer "
                "is [2, tokens or heads, heads or tokens, head_size]"
            )
        two, a, b, d = layer.shape
        layers.append(KVLayerFacts(name=layer.name, shape=(two, b, a, d), dtype=layer.dtype))
    # evolve runs the validators again, as building them does.
    return attrs.evolve(facts, order=order, layers=tuple(layers))


def permute_refusal(mine: KVLayoutFacts, theirs: KVLayoutFacts) -> list[str]:
    """Why KV of ``theirs`` cannot be permuted on arrival into ``mine`` (one sentence per
    reason, empty when it can): the orders are not NHD and HND, the tensor-parallel sizes or
    the block sizes differ (never combined with heterogeneous tensor parallelism or a
    block-size conversion), or anything else besides the order differs
    (:func:`layout_mismatches` of the permuted facts)."""
    if mine.order == theirs.order:
        return ["the KV cache orders are equal; there is nothing to permute"]
    if not {mine.order, theirs.order} <= PERMUTABLE_ORDERS:
        # A block-major cache is opaque: never permuted (the order sentence says NHD and
        # HND only).
        return layout_mismatches(mine, theirs)
    out: list[str] = []
    if mine.tp_size != theirs.tp_size:
        out.append(
            f"tensor-parallel size: this engine {mine.tp_size}, the peer {theirs.tp_size}; "
            "allow_layout_permute needs equal sizes (heterogeneous tensor parallelism reads "
            "head runs of NHD caches only): configure both engines' KV cache order alike"
        )
    if mine.block_size != theirs.block_size:
        # Said here, whatever layout_mismatches says of block sizes: a permutation is never
        # combined with a block-size conversion.
        out.append(
            f"block size: this engine {mine.block_size} tokens, the peer {theirs.block_size} "
            "tokens; allow_layout_permute permutes blocks of one size only (no block-size "
            "conversion at the same time): run both engines at one block size or configure "
            "both engines' KV cache order alike"
        )
    try:
        seen = as_order(theirs, mine.order)
    except ValueError as exc:
        return [*out, str(exc)]
    out.extend(x for x in layout_mismatches(mine, seen) if not x.startswith("block size:"))
    return out


def permutable(mine: KVLayoutFacts, theirs: KVLayoutFacts) -> bool:
    """Whether the peer's KV (``theirs``) differs from ``mine`` in the NHD/HND order alone, at
    equal tensor-parallel sizes: what ``allow_layout_permute`` permutes on arrival."""
    return mine.order != theirs.order and not permute_refusal(mine, theirs)


def permute_blocks(
    src: torch.Tensor, src_order: str, dst_order: str, *, block_size: int, heads: int
) -> torch.Tensor:
    """Blocks ``src`` of ``src_order`` in ``dst_order``, as a new contiguous tensor of the
    same shape and dtype.

    ``src`` is ``[n, block_bytes]`` of any dtype whose last dimension holds one block of one
    layer (``2 * block_size * heads * head_size`` elements): the bytes of one head of one token
    stay together, so the permutation does not depend on the element type. Equal orders give
    a copy. Raises ``ValueError`` for an order other than NHD or HND or a block length that is
    not ``2 * block_size * heads`` equal rows.
    """
    for order in (src_order, dst_order):
        if order not in PERMUTABLE_ORDERS:
            raise ValueError(f"cannot permute KV cache order {order!r}; only NHD and HND")
    n, width = int(src.shape[0]), int(src.shape[1])
    rows = 2 * block_size * heads
    if block_size < 1 or heads < 1 or width % rows:
        raise ValueError(
            f"blocks of {width} elements do not hold 2 x {block_size} tokens x {heads} heads "
            "of equal size"
        )
    a, b = (block_size, heads) if src_order == "NHD" else (heads, block_size)
    blocks = src.reshape(n, 2, a, b, width // rows)
    if src_order != dst_order:
        blocks = blocks.transpose(2, 3)
    return blocks.contiguous().reshape(n, width)


class StagingArea:
    """The slots a permuting load reads into: ``size`` slots of one block of every layer.

    A pure allocator (the tensors are the worker's): :meth:`take` gives a load its slots in
    arrival order, :meth:`give` returns them. Not thread-safe (the worker's thread only).
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a staging area needs at least one slot, got {size}")
        self.size = size
        self._free: collections.deque[int] = collections.deque(range(size))
        self._held: dict[str, list[int]] = {}

    @property
    def free(self) -> int:
        """Slots no load holds."""
        return len(self._free)

    def holds(self, owner: str) -> bool:
        """Whether ``owner`` holds slots."""
        return owner in self._held

    def take(self, owner: str, n: int) -> list[int] | None:
        """``n`` slots for ``owner`` (its slot ids, in order), or ``None`` when fewer are free
        now. Raises ``ValueError`` for ``n`` above :attr:`size` (it could never fit) or an
        owner that already holds slots."""
        if n > self.size:
            raise ValueError(f"{n} blocks do not fit a staging area of {self.size}")
        if owner in self._held:
            raise ValueError(f"{owner!r} already holds staging slots")
        if n > len(self._free):
            return None
        got = [self._free.popleft() for _ in range(n)]
        self._held[owner] = got
        return got

    def give(self, owner: str) -> None:
        """Return ``owner``'s slots (nothing when it holds none). Only once no byte of a
        transfer into them can land any more."""
        for slot in self._held.pop(owner, ()):
            self._free.append(slot)

    def slots(self, owner: str) -> Sequence[int]:
        """``owner``'s slots (empty when it holds none)."""
        return self._held.get(owner, [])


def order_refusal(mine: KVLayoutFacts, theirs: KVLayoutFacts) -> list[str]:
    """What the orders forbid whatever ``allow_layout_permute`` says: an HND cache at a
    different tensor-parallel size than the peer's (heterogeneous tensor parallelism reads
    head runs of NHD blocks only, :mod:`kvframe.core.tp`). Empty when nothing."""
    if mine.tp_size == theirs.tp_size or "HND" not in (mine.order, theirs.order):
        return []
    return [
        f"tensor-parallel size: this engine {mine.tp_size} ({mine.order}), the peer "
        f"{theirs.tp_size} ({theirs.order}); engines of different tensor-parallel sizes "
        "exchange KV only when both caches are NHD: configure both engines' KV cache order as "
        "NHD or run them at one tensor-parallel size"
    ]
