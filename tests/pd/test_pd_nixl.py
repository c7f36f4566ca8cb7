"""P and D as separate processes on loopback, moving KV through real NIXL under leases.

Each node process steps its engine every millisecond (an idle P keeps stepping because its
connector reports pending work). Leases are short (2.4 s: heartbeat every 0.4 s, extension
1.6 s) so that expiry paths run in seconds, yet long enough that a loaded 2-core CI machine
that stalls a process for a few hundred milliseconds does not expire a lease that D renews.
"""

from __future__ import annotations

import itertools
import time

import pytest

pytest.importorskip("nixl_cu12", reason="the NIXL transport needs nixl-cu12")

from tests.pd.nodes import Node

LEASE = 2.4
INTERVAL = LEASE / 6
EXTENSION = LEASE * 2 / 3
_n = itertools.count()


@pytest.fixture(scope="module")
def producer() -> Node:
    node = Node("Pnixl", "kv_producer", lease=LEASE)
    yield node
    node.close()


@pytest.fixture(scope="module")
def consumer() -> Node:
    node = Node("Dnixl", "kv_consumer", lease=LEASE)
    yield node
    node.close()


def _rid(prefix: str) -> str:
    return f"{prefix}{next(_n)}"


def _prefill(p: Node, blocks: list[int], tokens: int) -> tuple[str, dict]:
    rid = _rid("r")
    params = p.call("prefill", rid=rid, blocks=blocks, tokens=tokens, seed=next(_n))["params"]
    return rid, params


def _load(d: Node, params: dict, blocks: list[int]) -> str:
    rid = _rid("d")
    n = params["remote_num_tokens"]
    d.call("arrive", rid=rid, tokens=n, params=params)
    assert d.call("schedule", rid=rid, tokens=n, params=params, blocks=blocks)["external"] > 0
    return rid


def test_happy_path_byte_exact_over_nixl(producer: Node, consumer: Node) -> None:
    rid_p, params = _prefill(producer, [1, 2, 3, 4], tokens=64)
    rid_d = _load(consumer, params, [10, 11, 12, 13])
    st = consumer.wait(lambda s: rid_d in s["finished_recving"])
    assert rid_d not in st["failures"], st["failures"]
    assert not st["invalid"]
    src = producer.call("digest", blocks=[1, 2, 3, 4])["digest"]
    dst = consumer.call("digest", blocks=[10, 11, 12, 13])["digest"]
    assert src == dst
    producer.wait(lambda s: rid_p in s["finished_sending"])
    assert producer.status()["counters"].get("leases_consumed", 0) >= 1


def test_queued_three_lease_durations_while_heartbeating(producer: Node, consumer: Node) -> None:
    rid_p, params = _prefill(producer, [5, 6], tokens=32)
    rid_d = _rid("d")
    consumer.call("arrive", rid=rid_d, tokens=32, params=params)
    time.sleep(3 * LEASE)
    assert rid_p not in producer.status()["finished_sending"], "freed while D heartbeated"
    consumer.call("schedule", rid=rid_d, tokens=32, params=params, blocks=[20, 21])
    st = consumer.wait(lambda s: rid_d in s["finished_recving"])
    assert rid_d not in st["failures"], st["failures"]
    assert producer.call("digest", blocks=[5, 6]) == consumer.call("digest", blocks=[20, 21])


def test_abort_before_scheduling_frees_p_at_once(producer: Node, consumer: Node) -> None:
    rid_p, params = _prefill(producer, [7], tokens=16)
    rid_d = _rid("d")
    consumer.call("arrive", rid=rid_d, tokens=16, params=params)
    time.sleep(0.1)
    t0 = time.monotonic()
    assert consumer.call("abort", rid=rid_d, tokens=16, params=params, blocks=[])["delay"] is False
    st = producer.wait(lambda s: rid_p in s["finished_sending"], timeout=5)
    assert st["times"][f"sent:{rid_p}"] - t0 < EXTENSION, "freed by expiry, not by the release"


def test_forged_and_malformed_notifications_are_rejected(producer: Node, consumer: Node) -> None:
    from kvframe.core import wire
    from kvframe.core.lease import lease_handle

    name = producer.status()["name"]
    before = producer.status()["counters"]
    consumer.call("notify", peer=name, payload=b"\xff\xfe not a message")
    forged = wire.LeaseDone(
        seq=7, sent_at=0.0, reason=wire.DoneReason.READ, handles=[lease_handle("r999~deadbeef")]
    )
    consumer.call("notify", peer=name, payload=wire.encode(forged))
    after = producer.wait(
        lambda s: (
            s["counters"].get("done_for_unknown_lease", 0) > before.get("done_for_unknown_lease", 0)
        )
    )["counters"]
    assert after.get("notifications_rejected", 0) == before.get("notifications_rejected", 0) + 1
    # P is still healthy
    test_happy_path_byte_exact_over_nixl(producer, consumer)


def test_d_killed_while_waiting_p_reclaims_by_the_lease_rules(producer: Node) -> None:
    d = Node(f"Dkill{next(_n)}", "kv_consumer", lease=LEASE)
    rid_p, params = _prefill(producer, [8, 9], tokens=32)
    rid_d = _rid("d")
    d.call("arrive", rid=rid_d, tokens=32, params=params)
    time.sleep(2 * LEASE)  # heartbeats keep it alive...
    assert rid_p not in producer.status()["finished_sending"]
    killed_at = d.kill()  # ...until D dies
    st = producer.wait(lambda s: rid_p in s["finished_sending"], timeout=10)
    reclaimed_after = st["times"][f"sent:{rid_p}"] - killed_at
    # the last heartbeat was at most one interval before the kill; its extension then runs out
    assert reclaimed_after <= EXTENSION + INTERVAL + 0.5, reclaimed_after
    assert st["counters"].get("leases_expired", 0) >= 1
    d.close()


@pytest.mark.parametrize("skew", [10_000.0, -10_000.0])
def test_clock_skew_between_processes(skew: float, producer: Node) -> None:
    d = Node(f"Dskew{next(_n)}", "kv_consumer", lease=LEASE, skew=skew)
    try:
        # no premature expiry: a request queued past the initial lease still reads
        _, params = _prefill(producer, [30, 31], tokens=32)
        rid_d = _rid("d")
        d.call("arrive", rid=rid_d, tokens=32, params=params)
        time.sleep(2 * LEASE)
        d.call("schedule", rid=rid_d, tokens=32, params=params, blocks=[40, 41])
        st = d.wait(lambda s: rid_d in s["finished_recving"])
        assert rid_d not in st["failures"], st["failures"]
        assert producer.call("digest", blocks=[30, 31]) == d.call("digest", blocks=[40, 41])
        # no eternal hold: a request D stops caring about (killed) is reclaimed in time
        rid_p2, params2 = _prefill(producer, [32], tokens=16)
        d.call("arrive", rid=_rid("d"), tokens=16, params=params2)
        time.sleep(LEASE)
        killed_at = d.kill()
        st = producer.wait(lambda s: rid_p2 in s["finished_sending"], timeout=10)
        assert st["times"][f"sent:{rid_p2}"] - killed_at <= EXTENSION + INTERVAL + 0.5
    finally:
        d.close()


def test_p_dead_at_handshake_fails_the_load(consumer: Node) -> None:
    p = Node(f"Pdead{next(_n)}", "kv_producer", lease=LEASE)
    _, params = _prefill(p, [1], tokens=16)
    p.kill()
    p.close()
    rid_d = _load(consumer, params, [50])
    st = consumer.wait(lambda s: rid_d in s["finished_recving"], timeout=15)
    assert "handshake" in st["failures"][rid_d]
    assert 50 in st["invalid"]


def test_p_killed_mid_transfer_fails_and_nothing_lands_later(consumer: Node) -> None:
    p = Node(f"Pmid{next(_n)}", "kv_producer", lease=LEASE)
    blocks = list(range(40))
    _, params = _prefill(p, blocks, tokens=40 * 16)
    # make sure D has handshaken with P (a first small request completes)
    _, warm = _prefill(p, [63], tokens=16)
    rid_w = _load(consumer, warm, [63])
    consumer.wait(lambda s: rid_w in s["finished_recving"])
    local = list(range(10, 50))
    rid_d = _load(consumer, params, local)
    p.kill()
    p.close()
    st = consumer.wait(lambda s: rid_d in s["finished_recving"], timeout=15)
    if rid_d in st["failures"]:
        assert set(local) <= set(st["invalid"])
        # the engine would now reuse the blocks: nothing may land in them afterwards
        consumer.call("poke", blocks=local, seed=12345)
        before = consumer.call("digest", blocks=local)
        time.sleep(0.3)
        assert consumer.call("digest", blocks=local) == before
    else:
        # the read won the race against the kill: then it must be complete and exact
        assert not (set(local) & set(st["invalid"]))
