"""The holder's lease table in memory a reader can READ: proof of a lease without asking.

A holder (P) that serves one-sided READs (NIXL: no code of P's runs when D reads) keeps, in a
small registered array of 64-bit words, one entry per live lease: the lease's *tag*, a
BLAKE2b-64 digest of its handle (:func:`slot_tag`), at the slot ``tag % slots``. It writes the
entry when it grants the lease and clears it when the lease ends, **before** it reports the
lease's blocks free to its engine (:meth:`LeaseSlots.publish`, :meth:`LeaseSlots.withdraw`).

A reader (D) whose READ of the lease's blocks completed reads the lease's slot with a second
READ, posted only after it saw the first complete. If the slot still holds the lease's tag,
the lease had not ended when the second READ read it, so no block of the lease was freed, let
alone reused, while the first READ ran: its bytes are the holder's KV, and the load is done
without waiting for the holder's acknowledgement (:meth:`LeaseReader.lease_seen
<kvframe.core.reader.LeaseReader.lease_seen>`). Why that holds:

- the lease was granted before the reader held its ticket, so before the first READ began;
- the holder clears the slot before anything can reuse the blocks, and the order of its two
  writes (the slot, then the engine's next use of a block) is the order a later READ sees;
- the second READ began after the first had completed, and found the tag, so it ran before
  the clear: the first READ ended before any reuse;
- a lease's tag is in the table only while that lease lives: ids are random and single-use,
  and a slot taken by another lease (two tags in one slot, or a reused slot) holds another
  tag, which proves nothing (the 2**-64 chance of equal tags aside).

Anything else the second READ finds (zero, another tag, a READ that failed) proves nothing and
changes nothing: the load waits for the acknowledgement exactly as before, so the table only
ever shortens a load, never decides one that the acknowledgement would fail. The table holds
tags, not handles: reading it tells a peer which slots are busy, not a handle it could forge a
heartbeat or a done notice with.

Sans-I/O: the table is a numpy array the caller allocates and registers with its transport;
this module only reads and writes its words.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

__all__ = ["ENTRY_BYTES", "MAX_SLOTS", "LeaseSlots", "slot_of", "slot_tag"]

ENTRY_BYTES = 8
"""Bytes of one table entry (a little-endian unsigned 64-bit tag; 0 is an empty slot)."""

MAX_SLOTS = 1 << 22
"""The most slots a table may have (32 MiB); a reader refuses a larger one from a peer."""

_PERSON = b"kvframe-slot"


def slot_tag(handle: int) -> int:
    """The tag a lease with wire handle ``handle`` has in a lease table: BLAKE2b-64
    (personalised ``kvframe-slot``) of the handle's 8 big-endian bytes, each zero byte made
    1, as a big-endian unsigned integer. One-way: the table does not give away the handles
    that heartbeats and done notices carry. No byte is zero, so a READ torn between a tag and
    the zero that clears it never equals the tag."""
    digest = hashlib.blake2b(
        (handle & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big"), digest_size=8, person=_PERSON
    ).digest()
    return int.from_bytes(bytes(b or 1 for b in digest), "big")


def slot_of(tag: int, slots: int) -> int:
    """The slot of ``tag`` in a table of ``slots`` entries (a power of two)."""
    return tag & (slots - 1)


class LeaseSlots:
    """The holder's lease table over ``table`` (a 1-D ``uint64`` array whose length is a power
    of two, at most :data:`MAX_SLOTS`, all zero). See the module docs.

    :raises ValueError: ``table`` is not such an array.
    """

    def __init__(self, table: npt.NDArray[np.uint64]) -> None:
        n = int(table.shape[0]) if table.ndim == 1 else 0
        if table.dtype != np.uint64 or n < 1 or n & (n - 1) or n > MAX_SLOTS:
            raise ValueError(
                f"a lease table is a 1-D uint64 array of 1 to {MAX_SLOTS} entries, a power of "
                f"two; got dtype {table.dtype} and shape {table.shape}"
            )
        if table.any():
            raise ValueError("a lease table starts empty (all zero)")
        self.table = table
        self.slots = n
        self._owned: dict[int, int] = {}  # handle -> slot it holds
        self.collisions = 0
        """Leases that found their slot taken (they are proven by acknowledgement only)."""

    def __len__(self) -> int:
        """Leases with an entry."""
        return len(self._owned)

    def publish(self, handle: int) -> bool:
        """Enter the lease with wire handle ``handle``; ``False`` (nothing written) when its
        slot holds another lease's tag or the handle already has an entry."""
        if handle in self._owned:
            return False
        tag = slot_tag(handle)
        slot = tag & (self.slots - 1)
        if self.table[slot]:
            self.collisions += 1
            return False
        self.table[slot] = tag
        self._owned[handle] = slot
        return True

    def withdraw(self, handle: int) -> None:
        """Clear the entry of ``handle``'s lease, if it has one. Call it before the lease's
        blocks are reported free."""
        slot = self._owned.pop(handle, None)
        if slot is not None:
            self.table[slot] = 0

    def clear(self) -> None:
        """Clear every entry (the holder is shutting down)."""
        self._owned.clear()
        self.table[:] = 0
