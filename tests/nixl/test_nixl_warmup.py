"""NixlTransport.warm_up: a READ between the two transports' warm-up buffers, cross-process.

The peer child drives its progress every 200 ms between commands (a slow engine's step pace),
so a READ that waits for the peer's progress stays pending for a whole step: the first READ
on a new connection does (UCX wires the endpoint up with the peer's help), and after a
warm-up it does not.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from conftest import NUM_BLOCKS, Local, Peer, settle
from kvframe_nixl import NixlTransport
from kvframe_nixl.transport import WARMUP_BYTES

from kvframe.errors import CapabilityError, PeerUnreachableError
from kvframe.spi.transport import Op, TransportParams, XferState

SLOW = 0.2


@pytest.fixture(params=[False, True], ids=["inline", "post_thread"])
def fresh(request: pytest.FixtureRequest) -> Iterator[tuple[Local, Peer]]:
    """A new endpoint and a new slow peer, not connected yet."""
    mode = "t" if request.param else "i"
    end = Local(f"W-{mode}-{os.getpid()}", {"post_thread": request.param})
    peer = Peer(f"WP-{mode}-{os.getpid()}", pump_interval=SLOW)
    yield end, peer
    peer.stop()
    end.t.close()


def test_capability_card_says_warm_up() -> None:
    assert NixlTransport.capabilities.warm_up is True


def test_warm_up_reads_only_the_warm_up_buffers(fresh: tuple[Local, Peer]) -> None:
    """The warm-up completes, counts in ``stats()["warmups"]``, moves WARMUP_BYTES, and
    leaves every registered byte on both sides as it was."""
    end, peer = fresh
    remote = end.connect(peer)
    mine = [b.copy() for b in end.bufs]
    h = end.t.warm_up(peer.name)
    assert h.nbytes == WARMUP_BYTES
    assert h.num_descriptors == 1
    assert h.op is Op.READ
    assert settle(end.t, h) is XferState.DONE
    end.t.release(h)
    assert end.t.stats()["warmups"] == 1
    # The warm-up ended with the peer's warm-up token as a notification: the peer dropped it
    # (its caller never sees it).
    deadline = time.monotonic() + 5
    while peer.call("stats", drive=end.t)["warmup_notifications_dropped"] < 1:
        assert time.monotonic() < deadline, "the peer never got the warm-up notification"
    assert peer.call("drain", drive=end.t) == []
    for region, before in enumerate(mine):
        np.testing.assert_array_equal(end.bufs[region], before)
        np.testing.assert_array_equal(
            np.frombuffer(peer.call("get", drive=end.t, region=region), np.uint8),
            peer.expected(region),
        )
    # The connection carries real READs afterwards.
    h = end.t.post(Op.READ, end.local, [0, 1], remote, [2, 3])
    assert settle(end.t, h) is XferState.DONE
    end.t.release(h)
    np.testing.assert_array_equal(end.view(0)[:2], peer.expected(0).reshape(NUM_BLOCKS, -1)[2:4])


def test_after_a_warm_up_the_first_read_does_not_wait_for_the_peer(
    fresh: tuple[Local, Peer],
) -> None:
    """Without a warm-up the first READ stays pending until the slow peer's next progress;
    after one, a READ completes inside its post (UCX's cma copies in the caller), or at its
    first poll with the post worker: the peer's progress is no longer needed."""
    end, peer = fresh
    remote = end.connect(peer)
    h = end.t.warm_up(peer.name)
    t0 = time.monotonic()
    assert settle(end.t, h) is XferState.DONE
    end.t.release(h)
    waited = time.monotonic() - t0
    posted = time.monotonic()
    h = end.t.post(Op.READ, end.local, [5], remote, [6])
    assert settle(end.t, h) is XferState.DONE
    end.t.release(h)
    # A statement of what happened, not a timing bar: the warm-up waited for the peer's
    # progress (tens of ms at least), the READ after it did not wait for another step.
    read_took = time.monotonic() - posted
    assert read_took < SLOW / 2, (waited, read_took)


def test_unknown_peer_and_closed_transport() -> None:
    t = NixlTransport.create(TransportParams(name=f"W-alone-{os.getpid()}"))
    with pytest.raises(PeerUnreachableError):
        t.warm_up("nobody")
    t.close()
    with pytest.raises(Exception, match="closed"):
        t.warm_up("nobody")


def _envelope(meta: bytes, **change: Any) -> bytes:
    env = msgpack.unpackb(meta, raw=False)
    for key, value in change.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    packed: bytes = msgpack.packb(env, use_bin_type=True)
    return packed


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        *(("warm", v, "warm-up buffer address") for v in (-1, 0, "0x1000", 2**64 - 1, 1.5, True)),
        ("warm", [1, 2], "warm-up buffer address"),
        ("warm_token", b"short", "warm-up token"),
        ("warm_token", "a" * 16, "warm-up token"),
        ("warm_token", 7, "warm-up token"),
    ],
)
def test_hostile_warm_up_fields_are_refused(key: str, value: Any, match: str) -> None:
    """A warm-up address that is not a plausible address, or a token that is not 16 bytes,
    refuses the metadata (nothing is added); the transport stays usable."""
    t = NixlTransport.create(TransportParams(name=f"W-host-{os.getpid()}"))
    other = NixlTransport.create(TransportParams(name=f"W-other-{os.getpid()}"))
    try:
        with pytest.raises(PeerUnreachableError, match=match):
            t.add_peer(_envelope(other.local_metadata(), **{key: value}))
        assert t.stats()["peers"] == 0
        assert t.add_peer(other.local_metadata()) == other.name
    finally:
        t.close()
        other.close()


@pytest.mark.parametrize("change", ["absent", "outside"])
def test_peer_without_a_usable_warm_up_buffer(change: str) -> None:
    """An older peer (no ``warm`` key) or one naming memory it did not register: the peer is
    added, and warm_up raises CapabilityError (the caller skips the warm-up)."""
    t = NixlTransport.create(TransportParams(name=f"W-old-{os.getpid()}"))
    other = NixlTransport.create(TransportParams(name=f"W-older-{os.getpid()}"))
    stray = np.zeros(4096, np.uint8)  # never registered by the peer
    warm = None if change == "absent" else int(stray.ctypes.data)
    try:
        name = t.add_peer(_envelope(other.local_metadata(), warm=warm))
        with pytest.raises(CapabilityError, match="warm-up buffer"):
            t.warm_up(name)
        assert t.stats()["warmups"] == 0
    finally:
        t.close()
        other.close()
