"""Two NIXL endpoints in separate network namespaces over UCX ``tcp``: a cut link is declared
dead on both sides within ``UCX_TCP_USER_TIMEOUT``, the old connection stays dead after the
link heals, and ``add_peer`` again (directly on one side, ``remove_peer`` first on the other)
rebuilds a working connection with the same metadata.

Both endpoints are child processes (``nixl_peer.py``), each inside its own namespace made by
:class:`tests.netns.VethPair`; the test process hosts no NIXL agent. Without ``UCX_TLS=tcp``
the data would still go through CMA (same kernel) and the cut would not stop it
(``shared/FACTS.md``). Where network namespaces cannot be made the test fails, it does not
skip.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from conftest import BLOCK_LENS, NUM_BLOCKS, Peer
from nixl_peer import encode_layout

from tests.netns import VethPair

pytestmark = pytest.mark.nixl

USER_TIMEOUT = 2.0
"""``UCX_TCP_USER_TIMEOUT`` in seconds: how long unacknowledged data may wait on a cut link."""
UCX = {"UCX_TLS": "tcp", "UCX_TCP_USER_TIMEOUT": f"{USER_TIMEOUT:g}s"}


def _reply(p: Peer, timeout: float) -> Any:
    """The child's next raw reply (errors included, as ``{"error": ...}``)."""
    return p._read(timeout, None)


def _failed_unreachable(reply: Any) -> bool:
    """Whether a ``post`` reply says the peer is unreachable (raised at post, or polled)."""
    if isinstance(reply, dict):
        return "PeerUnreachableError" in reply.get("error", "")
    return reply == ["failed", "PeerUnreachableError"]


def _read_exact(dst: Peer, src: Peer, local: list[int], remote: list[int], tag: bytes) -> None:
    """``dst`` READs ``src``'s blocks ``remote`` into its ``local`` ones (every region) with a
    notification; checks the bytes and that ``src`` was told."""
    reply = dst.call(
        "post", kind="read", peer=src.name, local=local, remote=remote, notification=tag
    )
    assert reply == ["done", None], reply
    for r in range(len(BLOCK_LENS)):
        got = np.frombuffer(dst.call("get", region=r), dtype=np.uint8).reshape(NUM_BLOCKS, -1)
        want = src.expected(r).reshape(NUM_BLOCKS, -1)[remote]
        np.testing.assert_array_equal(got[local], want, err_msg=f"region {r}")
    _expect_notes(src, [[dst.name, tag]])


def _expect_notes(p: Peer, want: list[list[Any]], timeout: float = 5.0) -> None:
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < len(want) and time.monotonic() < deadline:
        got += p.call("drain")
        time.sleep(0.005)
    assert got == want


@pytest.mark.timeout(60)
def test_partition_is_declared_on_both_sides_and_add_peer_rebuilds() -> None:
    opts_a = {"post_thread": False, "ucx_env": UCX}
    opts_b = {"post_thread": True, "inline_post_bytes": 0, "ucx_env": UCX}
    with VethPair() as net:
        a = b = None
        try:
            a = Peer("part-A", seed=21, options=opts_a, prefix=net.prefix("a"))
            b = Peer("part-B", seed=22, options=opts_b, prefix=net.prefix("b"))
            assert a.call("add_peer", meta=b.meta) == b.name
            assert b.call("add_peer", meta=a.meta) == a.name
            a.call("prepare_remote", peer=b.name, layout=encode_layout(b.layout))
            b.call("prepare_remote", peer=a.name, layout=encode_layout(a.layout))
            _read_exact(a, b, [0, 1], [2, 3], b"before-a")
            _read_exact(b, a, [0, 1], [2, 3], b"before-b")

            # Cut, with a READ in flight each way: both stall, then fail within the timeout.
            cut_at = net.cut()
            a.send("post", kind="read", peer=b.name, local=[4], remote=[5], notification=b"x")
            b.send("post", kind="read", peer=a.name, local=[4], remote=[5], notification=b"y")
            ra = _reply(a, USER_TIMEOUT + 8)
            a_dead = time.monotonic() - cut_at
            rb = _reply(b, USER_TIMEOUT + 8)
            b_dead = time.monotonic() - cut_at
            print(f"declared dead after the cut: A {a_dead:.2f} s, B {b_dead:.2f} s")
            assert _failed_unreachable(ra), ra
            assert _failed_unreachable(rb), rb
            # They waited for UCX (the data really went over the link), but not much longer.
            assert 0.5 * USER_TIMEOUT <= a_dead <= USER_TIMEOUT + 4, a_dead
            assert 0.5 * USER_TIMEOUT <= b_dead <= USER_TIMEOUT + 4, b_dead
            a.send("notify", peer=b.name, payload=b"into the void")
            assert "PeerUnreachableError" in _reply(a, 5).get("error", "")

            net.heal()
            # NIXL does not repair the connection: the old one stays dead after the heal.
            a.send("post", kind="read", peer=b.name, local=[4], remote=[5])
            assert _failed_unreachable(_reply(a, USER_TIMEOUT + 8))

            # A: add_peer again with the same metadata (no remove_peer): rebuilt, and its
            # prepared remote layout is prepared again. B: remove_peer, then add_peer.
            assert a.call("add_peer", meta=b.meta) == b.name
            b.call("remove_peer", peer=a.name)
            assert b.call("add_peer", meta=a.meta) == a.name
            b.call("prepare_remote", peer=a.name, layout=encode_layout(a.layout))
            _read_exact(a, b, [6, 7], [8, 9], b"after-a")
            _read_exact(b, a, [6, 7], [8, 9], b"after-b")
            a.call("notify", peer=b.name, payload=b"hello-b")
            b.call("notify", peer=a.name, payload=b"hello-a")
            _expect_notes(b, [[a.name, b"hello-b"]])
            _expect_notes(a, [[b.name, b"hello-a"]])
            assert a.call("stats")["peers_rebuilt"] == 1
        finally:
            for p in (a, b):
                if p is not None:
                    p.kill()
