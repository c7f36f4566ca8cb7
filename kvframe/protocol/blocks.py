"""Block ids: how every message and every SPI call names a request's KV blocks.

They live here, at the bottom of the contracts, because the messages carry them
(:class:`~kvframe.protocol.messages.LoadSpec`, :class:`~kvframe.protocol.messages.SaveSpec`)
and the connector SPI passes them (:mod:`kvframe.spi.request` re-exports both names).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

__all__ = ["BlockId", "BlockIds", "as_block_ids"]

BlockId = Annotated[int, msgspec.Meta(ge=0)]
"""One block id: a non-negative ``int``. The annotation lets the codec check the bound while it
decodes, so :func:`as_block_ids` need not run again on received messages."""

BlockIds = tuple[tuple[BlockId, ...], ...]
"""Block ids per KV cache group: ``block_ids[g]`` lists group ``g``'s blocks in token order.

A model with one attention type has one group; hybrid models (full attention plus sliding
window, say) have one group per KV cache layout.
"""


def as_block_ids(value: Any) -> BlockIds:
    """Convert nested sequences of block ids to :data:`BlockIds` (an attrs converter).

    Raises ``TypeError`` for a str or bytes (a common slip) and ``ValueError`` for an id that
    is not a non-negative int, naming the group.
    """
    if isinstance(value, (str, bytes)):
        raise TypeError(f"block_ids must be a sequence of sequences of ints, got {value!r}")
    out = tuple(tuple(group) for group in value)
    for g, group in enumerate(out):
        for b in group:
            if type(b) is not int or b < 0:
                raise ValueError(f"block_ids[{g}] contains {b!r}; block ids are non-negative ints")
    return out
