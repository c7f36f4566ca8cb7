"""The holder's lease table (kvframe.core.slots): entries, collisions, and tags."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvframe.core.lease import lease_handle
from kvframe.core.slots import MAX_SLOTS, LeaseSlots, slot_of, slot_tag


def table(n: int = 64) -> LeaseSlots:
    return LeaseSlots(np.zeros(n, dtype=np.uint64))


def test_a_published_lease_is_its_tag_in_its_slot_until_withdrawn() -> None:
    slots = table()
    h = lease_handle("lease-a")
    assert slots.publish(h)
    tag = slot_tag(h)
    assert int(slots.table[slot_of(tag, 64)]) == tag
    assert np.count_nonzero(slots.table) == 1
    assert len(slots) == 1
    slots.withdraw(h)
    assert not slots.table.any()
    assert len(slots) == 0
    slots.withdraw(h)  # twice: nothing left to clear
    assert not slots.table.any()


def test_a_lease_whose_slot_is_taken_gets_no_entry_and_clears_nothing() -> None:
    slots = table(1)  # one slot: every lease collides with the first
    a, b = lease_handle("a"), lease_handle("b")
    assert slots.publish(a)
    assert not slots.publish(b)
    assert not slots.publish(a)  # already entered
    assert slots.collisions == 1
    slots.withdraw(b)  # b never had the slot: a's tag stays
    assert int(slots.table[0]) == slot_tag(a)
    slots.clear()
    assert not slots.table.any()


@pytest.mark.parametrize(
    "array",
    [
        np.zeros(3, dtype=np.uint64),  # not a power of two
        np.zeros(0, dtype=np.uint64),
        np.zeros(4, dtype=np.int64),
        np.zeros((2, 2), dtype=np.uint64),
        np.ones(4, dtype=np.uint64),  # not empty
    ],
)
def test_a_table_of_the_wrong_shape_or_content_is_refused(array: np.ndarray) -> None:
    with pytest.raises(ValueError, match="lease table"):
        LeaseSlots(array)


def test_the_largest_table_is_accepted() -> None:
    assert LeaseSlots(np.zeros(MAX_SLOTS, dtype=np.uint64)).slots == MAX_SLOTS


@given(st.integers(min_value=0, max_value=2**64 - 1))
def test_a_tag_has_no_zero_byte_and_is_not_the_handle(handle: int) -> None:
    """No zero byte: a READ torn between a tag and the zero clearing it never equals the tag.
    Not the handle: the table does not give away what heartbeats and notices carry."""
    tag = slot_tag(handle)
    assert all(tag.to_bytes(8, "big"))
    assert tag != handle
    assert slot_tag(handle) == tag  # a function of the handle alone: reader and holder agree
