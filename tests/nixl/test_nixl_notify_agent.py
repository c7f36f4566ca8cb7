"""``notify_agent``: notifications leave through a second NIXL agent, so they no longer hold up
the next READ on the endpoint the READs use.

The peer child drives its progress every 200 ms between commands (a slow engine's step pace).
Measured with raw NIXL (docs/nixl.md): after a notification on the endpoint, the next READ
completes only at the peer's next progress point (NIXL ends each transfer with a flush of the
endpoint, and the flush waits for the notification); from a second agent it completes inside
its post. These tests state both facts through the transport, with the option off and on, and
check what the option must keep: who the receiver says sent the message, that an attached
notification still follows its data, and the names it refuses.
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
from kvframe_nixl.transport import NOTIFY_SUFFIX

from kvframe.errors import ConfigError, PeerUnreachableError
from kvframe.spi.transport import Op, TransportParams, XferState

pytestmark = pytest.mark.nixl

SLOW = 0.2
ROUNDS = 4


def _drain(p: Peer, t: NixlTransport, want: int, timeout: float = 5.0) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += p.call("drain", drive=t)
    return got


@pytest.fixture(params=[False, True], ids=["one_agent", "notify_agent"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Local, Peer, Any, bool]]:
    """A new endpoint (posting inline) and a new slow peer, connected and warmed up."""
    on = bool(request.param)
    mode = "n" if on else "o"
    end = Local(f"N-{mode}-{os.getpid()}", {"post_thread": False, "notify_agent": on})
    peer = Peer(f"NP-{mode}-{os.getpid()}", pump_interval=SLOW)
    remote = end.connect(peer)
    h = end.t.warm_up(peer.name)
    assert settle(end.t, h) is XferState.DONE
    end.t.release(h)
    # The warm-up's last READ went through the notification agent: proven, it carries the
    # notifications to this peer from now on.
    assert end.t.stats()["notify_agent_peers"] == (1 if on else 0)
    yield end, peer, remote, on
    peer.stop()
    end.t.close()


def test_a_read_after_a_notification_waits_for_the_peer_only_with_one_agent(
    pair: tuple[Local, Peer, Any, bool],
) -> None:
    """Each round: a READ, a standalone notification (a heartbeat, say), another READ. With
    one agent the second READ waits for the slow peer's progress (most rounds: the peer may
    happen to progress right then); with the notification agent it never does. A statement
    of what happened, not a timing bar: the peer steps every 200 ms, a READ that does not
    wait for it takes well under a millisecond."""
    end, peer, remote, on = pair
    waited = 0
    for r in range(ROUNDS):
        h = end.t.post(Op.READ, end.local, [0], remote, [1])
        assert settle(end.t, h) is XferState.DONE
        end.t.release(h)
        end.t.send_notification(peer.name, b"hb-%d" % r)
        t0 = time.monotonic()
        h = end.t.post(Op.READ, end.local, [2 + r], remote, [10 + r])
        assert settle(end.t, h) is XferState.DONE
        end.t.release(h)
        if time.monotonic() - t0 > SLOW / 4:
            waited += 1
    np.testing.assert_array_equal(
        end.view(0)[2 : 2 + ROUNDS], peer.expected(0).reshape(NUM_BLOCKS, -1)[10 : 10 + ROUNDS]
    )
    if on:
        assert waited == 0, f"{waited} of {ROUNDS} READs waited for the peer"
    else:
        assert waited >= ROUNDS - 1, f"only {waited} of {ROUNDS} READs waited for the peer"
    # Every heartbeat arrived, in order, from this endpoint's name (not its notifier's).
    got = _drain(peer, end.t, ROUNDS)
    assert got == [[end.t.name, b"hb-%d" % r] for r in range(ROUNDS)]


def test_an_attached_notification_follows_its_data(pair: tuple[Local, Peer, Any, bool]) -> None:
    """A READ with a notification: the peer hears of it, from this endpoint's name, once the
    bytes landed here (the transport sends it when it sees the READ done)."""
    end, peer, remote, _ = pair
    h = end.t.post(Op.READ, end.local, [7, 8], remote, [20, 21], notification=b"read-done")
    assert settle(end.t, h) is XferState.DONE
    end.t.release(h)
    np.testing.assert_array_equal(end.view(0)[7:9], peer.expected(0).reshape(NUM_BLOCKS, -1)[20:22])
    assert _drain(peer, end.t, 1) == [[end.t.name, b"read-done"]]
    assert end.t.stats()["notifications_sent"] >= 1


@pytest.mark.parametrize(("mine", "theirs"), [(True, False), (False, True)])
def test_mixed_settings_still_name_the_sender(mine: bool, theirs: bool) -> None:
    """One side with the notification agent, the other without: both hear each other under
    the transport names."""
    end = Local(f"NM-{int(mine)}-{os.getpid()}", {"post_thread": False, "notify_agent": mine})
    peer = Peer(f"NMP-{int(theirs)}-{os.getpid()}", options={"notify_agent": theirs})
    try:
        end.connect(peer)
        end.t.send_notification(peer.name, b"to-peer")
        assert _drain(peer, end.t, 1) == [[end.t.name, b"to-peer"]]
        peer.call("notify", drive=end.t, peer=end.t.name, payload=b"to-end")
        deadline = time.monotonic() + 5
        got: list[Any] = []
        while not got and time.monotonic() < deadline:
            got = [(n.sender, n.payload) for n in end.t.drain_notifications()]
        assert got == [(peer.name, b"to-end")]
    finally:
        peer.stop()
        end.t.close()


def test_a_notifier_name_is_refused_as_a_transport_or_a_peer() -> None:
    with pytest.raises(ConfigError, match="notification agent"):
        NixlTransport.create(TransportParams(name=f"x{NOTIFY_SUFFIX}"))
    a = NixlTransport.create(TransportParams(name=f"NR-a-{os.getpid()}"))
    b = NixlTransport.create(TransportParams(name=f"NR-b-{os.getpid()}"))
    try:
        env = msgpack.unpackb(b.local_metadata(), raw=False)
        env["name"] = b.name + NOTIFY_SUFFIX
        with pytest.raises(PeerUnreachableError, match="notification agent"):
            a.add_peer(msgpack.packb(env, use_bin_type=True))
        assert a.stats()["peers"] == 0
    finally:
        a.close()
        b.close()


def test_the_option_is_validated() -> None:
    with pytest.raises(ConfigError, match="notify_agent"):
        NixlTransport.create(TransportParams(name=f"NV-{os.getpid()}", options={"notify_agent": 1}))


def _waits_after_a_notification(end: Local, peer: Peer, remote: Any, rounds: int) -> int:
    """How many of ``rounds`` READs right after a standalone notification waited for the
    slow peer."""
    waited = 0
    for r in range(rounds):
        end.t.send_notification(peer.name, b"n-%d" % r)
        t0 = time.monotonic()
        h = end.t.post(Op.READ, end.local, [30 + r], remote, [30 + r])
        assert settle(end.t, h) is XferState.DONE
        end.t.release(h)
        waited += time.monotonic() - t0 > SLOW / 4
    return waited


def test_notifications_use_the_notification_agent_only_once_a_warm_up_proved_it() -> None:
    """Until a warm-up's READ through the notification agent completed, notifications leave
    from the transport's own agent (as with the option off: a READ after one waits for the
    slow peer); after it, they leave from the notification agent. A connection of the
    notification agent that never came up therefore cannot swallow them."""
    end = Local(f"NW-{os.getpid()}", {"post_thread": False, "notify_agent": True})
    peer = Peer(f"NWP-{os.getpid()}", pump_interval=SLOW)
    try:
        remote = end.connect(peer)
        # Wire the READ endpoint up without a warm-up: one READ polled to completion.
        h = end.t.post(Op.READ, end.local, [0], remote, [0])
        assert settle(end.t, h) is XferState.DONE
        end.t.release(h)
        assert end.t.stats()["notify_agent_peers"] == 0
        assert _waits_after_a_notification(end, peer, remote, 3) >= 2
        h = end.t.warm_up(peer.name)
        assert settle(end.t, h) is XferState.DONE
        end.t.release(h)
        assert end.t.stats()["notify_agent_peers"] == 1
        assert _waits_after_a_notification(end, peer, remote, 3) == 0
        got = _drain(peer, end.t, 6)
        assert got == [[end.t.name, b"n-%d" % (r % 3)] for r in range(6)]
    finally:
        peer.stop()
        end.t.close()


def test_a_failed_proof_leaves_the_warm_up_done_and_notifications_on_the_own_agent() -> None:
    """The notification agent's READ fails (simulated: NIXL refuses it): the warm-up still
    ends DONE (the READs of the transport's own agent succeeded), nothing counts as a failed
    transfer, and notifications keep leaving from the transport's own agent."""

    class Refusing:
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def make_prepped_xfer(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("nixlBackendError: refused for the test")

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

    end = Local(f"NF-{os.getpid()}", {"post_thread": False, "notify_agent": True})
    peer = Peer(f"NFP-{os.getpid()}", pump_interval=SLOW)
    try:
        end.connect(peer)
        end.t._notifier = Refusing(end.t._notifier)  # type: ignore[attr-defined]
        failed = end.t.stats()["transfers_failed"]
        h = end.t.warm_up(peer.name)
        assert settle(end.t, h) is XferState.DONE
        end.t.release(h)
        assert end.t.stats()["notify_agent_peers"] == 0
        assert end.t.stats()["transfers_failed"] == failed
        end.t.send_notification(peer.name, b"still-here")
        assert _drain(peer, end.t, 1) == [[end.t.name, b"still-here"]]
    finally:
        peer.stop()
        end.t.close()
