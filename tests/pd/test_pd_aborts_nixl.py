"""Abort paths on D over real NIXL (issue 20, defect 1), and the bound on a read whose holder
stops making progress (issue 10, "a read can hang").

P and D are separate processes (``tests/pd/node.py``). Over ``UCX_TLS=tcp`` a READ completes
only while the target makes progress, so pausing P's loop holds a posted read in flight the
way an idle, unstepped P did. Each test ends with both sides clean: D has no pending work and
reported the request exactly once; P reclaimed the lease.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import pytest
import zmq

pytest.importorskip("nixl_cu12", reason="the NIXL transport needs nixl-cu12")

from tests.pd.nodes import Node

LEASE = 2.4
EXTENSION = LEASE * 2 / 3
TCP = {"UCX_TLS": "tcp"}
_n = itertools.count()


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Node, Node]]:
    p = Node("PabN", "kv_producer", lease=LEASE, env=TCP)
    d = Node("DabN", "kv_consumer", lease=LEASE, env=TCP, extra={"handshake_timeout": 2.0})
    yield p, d
    d.close()
    p.close()


def _prefill(p: Node, blocks: list[int], tokens: int) -> tuple[str, dict]:
    rid = f"r{next(_n)}"
    params = p.call("prefill", rid=rid, blocks=blocks, tokens=tokens, seed=next(_n))["params"]
    return rid, params


def _clean(p: Node, d: Node, rid_p: str, rid_d: str) -> None:
    st = d.wait(lambda s: rid_d in s["finished_recving"] and not s["pending"], timeout=10)
    assert st["finished_recving"].count(rid_d) == 1
    assert rid_d not in st["finished_sending"]
    p.wait(lambda s: rid_p in s["finished_sending"], timeout=10)
    p.wait(lambda s: s["gauges"]["leases_held"] == 0, timeout=10)


def _warm(p: Node, d: Node) -> None:
    """One full request, so that D has a connection to P."""
    rid_p, params = _prefill(p, [60], tokens=16)
    rid_d = f"w{next(_n)}"
    d.call("arrive", rid=rid_d, tokens=16, params=params)
    d.call("schedule", rid=rid_d, tokens=16, params=params, blocks=[60])
    st = d.wait(lambda s: rid_d in s["finished_recving"])
    assert rid_d not in st["failures"], st["failures"]
    p.wait(lambda s: rid_p in s["finished_sending"])


def test_abort_while_waiting_for_the_peer_over_nixl(pair: tuple[Node, Node]) -> None:
    p, d = pair
    rid_p, params = _prefill(p, [1, 2], tokens=32)
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        bad = {**params, "remote_port": port}
        bad.pop("remote_ports", None)
        rid_d = f"d{next(_n)}"
        d.call("arrive", rid=rid_d, tokens=32, params=bad)
        d.call("schedule", rid=rid_d, tokens=32, params=bad, blocks=[10, 11])
        assert d.call("load_state", rid=rid_d)["state"] == "waiting_peer"
        assert d.call("abort", rid=rid_d, tokens=32, params=bad, blocks=[10, 11])["delay"] is False
        st = d.wait(lambda s: rid_d in s["finished_recving"], timeout=3)
        assert rid_d not in st["failures"]  # aborted, not failed: nothing to recompute
        assert not st["invalid"] or not {10, 11} & set(st["invalid"])
        d.wait(lambda s: not s["pending"], timeout=5)
        # D never reached P: the lease expires there, and P reclaims it.
        p.wait(lambda s: rid_p in s["finished_sending"], timeout=LEASE + 3)
    finally:
        silent.close(linger=0)


def test_abort_while_waiting_for_the_lease_over_nixl(pair: tuple[Node, Node]) -> None:
    p, d = pair
    _warm(p, d)
    rid_p, params = _prefill(p, [3, 4], tokens=32)
    p.call("pause", seconds=1.0)  # P answers nothing: the lease stays unconfirmed
    rid_d = f"d{next(_n)}"
    d.call("arrive", rid=rid_d, tokens=32, params=params)
    d.call("schedule", rid=rid_d, tokens=32, params=params, blocks=[12, 13])
    d.wait(lambda s: True, timeout=1)
    # The READ went beside the unanswered heartbeat (optimistic_read): it cannot complete
    # while P makes no progress, and is stopped before the release goes.
    assert d.call("load_state", rid=rid_d)["state"] == "posted"
    d.call("abort", rid=rid_d, tokens=32, params=params, blocks=[12, 13])
    _clean(p, d, rid_p, rid_d)
    assert p.status()["counters"].get("leases_aborted", 0) >= 1  # D's release, not expiry


def test_abort_with_the_read_in_flight_over_nixl(pair: tuple[Node, Node]) -> None:
    p, d = pair
    _warm(p, d)
    blocks = list(range(20, 36))
    rid_p, params = _prefill(p, blocks, tokens=16 * 16)
    rid_d = f"d{next(_n)}"
    acks = d.status()["counters"].get("acks_received", 0)
    d.call("arrive", rid=rid_d, tokens=256, params=params)
    # The lease is confirmed (a heartbeat round trip), then P stops progressing.
    d.wait(lambda s: s["counters"].get("acks_received", 0) > acks, timeout=5)
    p.call("pause", seconds=1.5)
    local = list(range(30, 46))
    d.call("schedule", rid=rid_d, tokens=256, params=params, blocks=local)
    state = d.call("load_state", rid=rid_d)["state"]
    assert state == "posted", state
    d.call("abort", rid=rid_d, tokens=256, params=params, blocks=local)
    _clean(p, d, rid_p, rid_d)
    st = d.status()
    assert rid_d not in st["failures"], (state, st["failures"])
    # Reported only after the transfer stopped: the blocks stay as they are from now on.
    d.call("poke", blocks=local, seed=7)
    before = d.call("digest", blocks=local)
    time.sleep(0.3)
    assert d.call("digest", blocks=local) == before


def test_a_read_against_a_stalled_prefill_engine_ends_within_the_bound(
    pair: tuple[Node, Node],
) -> None:
    """A READ posted to a P that stops making progress (idle and not stepping) used to stay in
    flight for as long as P stayed idle. Now it fails at the confirmed lease bound at the
    latest (at most one extension after the last acknowledgement)."""
    p, d = pair
    _warm(p, d)
    blocks = list(range(40, 56))
    rid_p, params = _prefill(p, blocks, tokens=256)
    rid_d = f"d{next(_n)}"
    acks = d.status()["counters"].get("acks_received", 0)
    d.call("arrive", rid=rid_d, tokens=256, params=params)
    d.wait(lambda s: s["counters"].get("acks_received", 0) > acks, timeout=5)
    stall = 3 * LEASE
    p.call("pause", seconds=stall)
    t0 = time.monotonic()
    local = list(range(40, 56))
    d.call("schedule", rid=rid_d, tokens=256, params=params, blocks=local)
    st = d.wait(lambda s: rid_d in s["finished_recving"], timeout=stall)
    elapsed = time.monotonic() - t0
    assert rid_d in st["failures"], "the read completed although P made no progress"
    assert set(local) <= set(st["invalid"])
    assert elapsed < EXTENSION + 1.0, f"the load took {elapsed:.2f} s to fail"
    d.wait(lambda s: not s["pending"], timeout=5)
    p.wait(lambda s: rid_p in s["finished_sending"], timeout=stall + LEASE + 5)
