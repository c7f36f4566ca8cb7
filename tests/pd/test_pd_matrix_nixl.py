"""The cross-process P/D matrix (issue 12, item 5): the same scenarios in pull and in push mode,
P and D in separate processes (``tests/pd/node.py``) over NIXL; ``tests/ucx/check_ucx_pd_matrix.py``
runs these very tests over the ``ucx`` transport (it imports them with another ``transport``).

Every node runs under ``UCX_TLS=tcp``, where a transfer lands only while the *target* makes
progress, so a stalled node (``pause``, or ``hold``: a stall that starts right after an event of
its own) holds a transfer in flight. Leases are short (``LEASE`` = 1.5 s: heartbeat every
0.25 s, extension 1 s). Each test ends with the leak oracle on every side still alive: no live
lease in the holder, no read or write machine load, no push offer or registration waiting,
nothing pending in the scheduler.

Bounds used below, from the code:

- a push offer waits ``kv_lease_duration`` for its registration (``PushSource(wait_timeout=)``),
  then P frees it (``push_unsent``);
- D's push lease is granted for ``kv_lease_duration`` at registration and each of P's
  heartbeats extends it to ``extension`` after the acknowledgement; nobody renews it once P
  died, so D fails the load within ``LEASE`` of the kill;
- P's posted WRITE (the writer, a ``LeaseReader``) ends by ``transfer_timeout`` = ``extension``
  after the post, or the confirmed bound (at most ``extension`` after D's last acknowledgement);
- D's read ends within the reader's bound, ``2 * handshake_timeout + 2 * extension`` after
  it was added (``LeaseReader.bound``), earlier when the transport sees the peer die;
- P's pull lease ends ``extension`` after D's last heartbeat (at most one ``interval`` before
  D's death).

``SLACK`` covers a loaded 2-core machine stepping late.
"""

from __future__ import annotations

import importlib.util
import itertools
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.pd.nodes import Node

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("nixl_cu12") is None, reason="the NIXL transport needs nixl-cu12"
)

LEASE = 1.5
INTERVAL = LEASE / 6
EXTENSION = LEASE * 2 / 3
HANDSHAKE = 1.0
READ_BOUND = 2 * HANDSHAKE + 2 * EXTENSION
SLACK = 1.0
ENV = {"UCX_TLS": "tcp"}
MODES = ["pull", "push"]
_n = itertools.count()


class Pair:
    """A prefill and a decode node shared by the tests of one module (and transport)."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.p = spawn(transport, "kv_producer", "Pmx")
        self.d = spawn(transport, "kv_consumer", "Dmx")

    def close(self) -> None:
        self.d.close()
        self.p.close()


def spawn(transport: str, role: str, name: str) -> Node:
    return Node(
        f"{name}{transport}{next(_n)}",
        role,
        lease=LEASE,
        transport=transport,
        env=ENV,
        extra={"handshake_timeout": HANDSHAKE},
    )


@pytest.fixture(scope="module")
def transport() -> str:
    return "nixl"


@pytest.fixture(scope="module")
def pair(transport: str) -> Iterator[Pair]:
    pr = Pair(transport)
    try:
        for mode in MODES:  # connections both ways, so that each test starts warm
            warm_up(pr.p, pr.d, mode, 63)
        yield pr
    finally:
        pr.close()


class Req:
    """One request through P and D, in pull or push mode."""

    def __init__(self, mode: str, p_blocks: list[int], d_blocks: list[int]) -> None:
        self.mode = mode
        k = next(_n)
        self.rid_p, self.rid_d = f"r{k}", f"d{k}"
        self.seed = k
        self.p_blocks, self.d_blocks = p_blocks, d_blocks
        self.tokens = 16 * len(p_blocks)
        self.push_id = secrets.token_urlsafe(16)
        self.params: dict[str, Any] | None = None  # D's leg

    def d_leg(self, p: Node) -> dict[str, Any]:
        """Push: the D leg (P's address and the push id), known before P finishes."""
        address = p.call("address")["address"]
        return {
            "do_remote_prefill": True,
            "transfer_mode": "push",
            "push_id": self.push_id,
            **address,
        }

    def finish(self, p: Node, reason: str = "length") -> None:
        """P's prefill of the request finishes (``reason`` "abort": P gives it up)."""
        if self.mode == "pull":
            self.params = p.call(
                "prefill", rid=self.rid_p, blocks=self.p_blocks, tokens=self.tokens, seed=self.seed
            )["params"]
            return
        leg = {"do_remote_decode": True, "transfer_mode": "push", "push_id": self.push_id}
        out = p.call(
            "push_prefill",
            rid=self.rid_p,
            blocks=self.p_blocks,
            tokens=self.tokens,
            seed=self.seed,
            leg=leg,
            finish_reason=reason,
        )
        assert out["delay"] is (reason == "length"), out
        assert out["params"] == {"transfer_mode": "push", "push_id": self.push_id}
        if self.params is None:
            self.params = self.d_leg(p)

    def arrive(self, d: Node, p: Node | None = None) -> None:
        """Pull only: D has the request queued (heartbeating), not yet scheduled."""
        assert self.mode == "pull"
        assert self.params is not None
        d.call("arrive", rid=self.rid_d, tokens=self.tokens, params=self.params)

    def start(self, d: Node, p: Node | None = None, *, arrived: bool = False) -> None:
        """D gets the request and its blocks (push: registers them with P)."""
        if self.mode == "pull":
            assert self.params is not None, "pull: P finishes first"
            if not arrived:
                self.arrive(d)
            out = d.call(
                "schedule",
                rid=self.rid_d,
                tokens=self.tokens,
                params=self.params,
                blocks=self.d_blocks,
            )
            assert out["external"] == self.tokens - 1
            return
        if self.params is None:
            assert p is not None, "push before P finished: give P for its address"
            self.params = self.d_leg(p)
        out = d.call(
            "push_start", rid=self.rid_d, tokens=self.tokens, leg=self.params, blocks=self.d_blocks
        )
        assert (out["external"], out["async"]) == (self.tokens - 1, True), out

    def abort_d(self, d: Node) -> bool:
        assert self.params is not None
        delay: bool = d.call(
            "abort", rid=self.rid_d, tokens=self.tokens, params=self.params, blocks=self.d_blocks
        )["delay"]
        return delay

    def d_ended(self, d: Node, timeout: float = 10.0) -> dict[str, Any]:
        return d.wait(lambda s: self.rid_d in s["finished_recving"], timeout=timeout, interval=0.01)

    def p_ended(self, p: Node, timeout: float = 10.0) -> dict[str, Any]:
        return p.wait(lambda s: self.rid_p in s["finished_sending"], timeout=timeout, interval=0.01)

    def wait_done(self, p: Node, d: Node) -> None:
        st = self.d_ended(d)
        assert self.rid_d not in st["failures"], st["failures"]
        assert not set(self.d_blocks) & set(st["invalid"])
        self.p_ended(p)
        assert digest(p, self.p_blocks) == digest(d, self.d_blocks)

    def failed(self, st: dict[str, Any]) -> str:
        """D reported the load failed, with every block invalid: its reason."""
        assert self.rid_d in st["failures"], (self.rid_d, st["failures"])
        assert set(self.d_blocks) <= set(st["invalid"])
        reason: str = st["failures"][self.rid_d]
        return reason


def warm_up(p: Node, d: Node, mode: str, block: int) -> None:
    """One whole request, so that D and P have their connections."""
    req = Req(mode, [block], [block])
    req.finish(p)
    req.start(d)
    req.wait_done(p, d)


def digest(node: Node, blocks: list[int]) -> str:
    out: str = node.call("digest", blocks=blocks)["digest"]
    return out


def state(node: Node, rid: str | None = None) -> dict[str, Any]:
    return node.call("push_state", rid=rid)


def wait_state(
    node: Node, pred: Callable[[dict[str, Any]], bool], rid: str | None = None, timeout: float = 5.0
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = state(node, rid)
        if pred(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"{node.engine_id}: condition not met; push state {st}")
        time.sleep(0.005)


def wait_posted(p: Node, req: Req) -> bool:
    """Wait until P posted the request's WRITE; whether P already saw it complete (over NIXL a
    small WRITE completes on the writer as soon as its bytes left, landed or not)."""
    deadline = time.monotonic() + 5
    while True:
        if state(p, req.rid_p)["writer"] == "posted":
            return False
        if req.rid_p in p.status()["finished_sending"]:
            return True
        assert time.monotonic() < deadline, f"P never posted the WRITE: {state(p, req.rid_p)}"
        time.sleep(0.005)


def leak_free(*nodes: Node, timeout: float = 2 * LEASE + SLACK) -> None:
    """The leak oracle: nothing live, waiting or pending on each node (within ``timeout``)."""
    for node in nodes:
        wait_state(
            node,
            lambda s: (
                s["leases_live"] == 0
                and s["writes"] == 0
                and s["reads"] == 0
                and s["push_waiting"] == 0
                and not s["pending"]
            ),
            timeout=timeout,
        )


def once(st: dict[str, Any], rid: str, field: str) -> None:
    assert st[field].count(rid) == 1, (rid, field, st[field])


def unchanged_after(d: Node, blocks: list[int], seconds: float = 0.3) -> None:
    """The engine reuses the blocks now: nothing may land in them afterwards."""
    d.call("poke", blocks=blocks, seed=next(_n) + 10_000)
    before = digest(d, blocks)
    time.sleep(seconds)
    assert digest(d, blocks) == before, "bytes landed in blocks D had already given up"


# -- happy path --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("mode", "order"), [("pull", "p_first"), ("push", "p_first"), ("push", "d_first")]
)
def test_happy_path_byte_exact(pair: Pair, mode: str, order: str) -> None:
    p, d = pair.p, pair.d
    req = Req(mode, [1, 2, 3, 4], [10, 11, 12, 13])
    if order == "p_first":
        req.finish(p)
        req.start(d)
    else:
        req.start(d, p)
        # the registration waits on P for the prefill, heartbeated
        wait_state(p, lambda s: s["push_waiting"] == 1)
        req.finish(p)
    req.wait_done(p, d)
    once(d.status(), req.rid_d, "finished_recving")
    once(p.status(), req.rid_p, "finished_sending")
    leak_free(p, d)


# -- D aborts ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_d_aborts_before_registration(pair: Pair, mode: str) -> None:
    """Pull: D aborts a queued request (heartbeating, not scheduled): P frees it at once on
    D's release. Push: D aborts while its handshake with P cannot complete (the leg names a
    port that never answers), so its registration never left: D ends the load at once, P's
    offer is freed when nobody registered within ``kv_lease_duration``."""
    p, d = pair.p, pair.d
    req = Req(mode, [5, 6], [14, 15])
    req.finish(p)
    t0 = time.monotonic()
    if mode == "pull":
        req.arrive(d)
        time.sleep(0.1)
        t0 = time.monotonic()
        assert req.abort_d(d) is False
        st = req.p_ended(p, timeout=5)
        assert st["times"][f"sent:{req.rid_p}"] - t0 < EXTENSION, "freed by expiry, not release"
    else:
        import zmq

        silent: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        silent.setsockopt(zmq.LINGER, 0)
        try:
            assert req.params is not None
            # another engine id: D's connection to the real P stays as it is
            req.params = {
                **req.params,
                "remote_engine_id": f"Psilent{next(_n)}",
                "remote_port": silent.bind_to_random_port("tcp://127.0.0.1"),
            }
            req.params.pop("remote_ports", None)
            req.start(d)
            time.sleep(0.1)
            assert state(d)["leases_live"] == 1  # D holds its blocks, unregistered
            req.abort_d(d)
            st = req.d_ended(d, timeout=2)
            assert req.rid_d not in st["failures"]  # aborted, nothing to recompute
            st = req.p_ended(p, timeout=LEASE + SLACK)
            assert st["times"][f"sent:{req.rid_p}"] - t0 >= LEASE * 0.9
            assert state(p)["counters"].get("push_unsent", 0) >= 1
        finally:
            silent.close(linger=0)
    leak_free(p, d)


@pytest.mark.parametrize("mode", MODES)
def test_d_aborts_registered_before_the_transfer(pair: Pair, mode: str) -> None:
    """Pull: D's lease is not confirmed yet (P stalls, answering nothing) when D aborts.
    Push: D registered before P's prefill finished (P heartbeats the registration); D aborts
    and revokes; P drops the registration and frees the prefill when it finishes."""
    p, d = pair.p, pair.d
    req = Req(mode, [7, 8], [16, 17])
    if mode == "pull":
        req.finish(p)
        p.call("pause", seconds=0.8)
        req.start(d)
        # Over NIXL the READ went beside the unanswered heartbeat (optimistic_read); P makes
        # no progress, so it cannot complete. UCX has access control (a READ ahead of its
        # claim would be refused): no optimistic reads, the load waits for the confirmation.
        expected = "confirming" if pair.transport == "ucx" else "posted"
        assert d.call("load_state", rid=req.rid_d)["state"] == expected
        req.abort_d(d)
    else:
        req.start(d, p)
        wait_state(p, lambda s: s["push_waiting"] == 1)
        req.abort_d(d)
        # P told D it will not write (a release of the revoked lease): D ends at once
        st = req.d_ended(d, timeout=EXTENSION)
        assert req.rid_d not in st["failures"]
        wait_state(p, lambda s: s["push_waiting"] == 0)
        req.finish(p)  # the push id was abandoned: P frees the prefill at once
    st = req.d_ended(d, timeout=5)
    assert req.rid_d not in st["failures"]
    once(st, req.rid_d, "finished_recving")
    once(req.p_ended(p, timeout=LEASE + SLACK), req.rid_p, "finished_sending")
    leak_free(p, d)


@pytest.mark.parametrize("mode", MODES)
def test_d_aborts_with_the_transfer_in_flight(pair: Pair, mode: str) -> None:
    """The transfer is posted and held in flight by its target's stall (pull: P stalls
    after confirming the lease, D's READ is posted; push: D stalls after confirming its lease
    to P, P's WRITE is posted); D aborts. D reports the request once, aborted, and only after
    the transfer stopped: its blocks stay as they are from then on."""
    p, d = pair.p, pair.d
    blocks = list(range(20, 36))
    req = Req(mode, blocks, list(range(30, 46)))
    if mode == "pull":
        req.finish(p)
        p.call("hold", when="counter:leases_renewed", seconds=1.0)
        req.arrive(d)
        wait_state(p, lambda s: s["paused"])
        req.start(d, arrived=True)
        assert d.call("load_state", rid=req.rid_d)["state"] == "posted"
    else:
        req.finish(p)
        d.call("hold", when="counter:leases_renewed", seconds=1.0)
        req.start(d)
        wait_state(p, lambda s: s["writer"] == "posted", rid=req.rid_p)
    req.abort_d(d)
    st = req.d_ended(d, timeout=5)
    assert req.rid_d not in st["failures"], st["failures"]
    once(st, req.rid_d, "finished_recving")
    unchanged_after(d, req.d_blocks)
    once(req.p_ended(p, timeout=LEASE + SLACK), req.rid_p, "finished_sending")
    leak_free(p, d)


# -- P dies ------------------------------------------------------------------------------
#: Whether a posted WRITE lands while the writer makes no progress (NIXL: the data leaves at
#: the post; its notification only once the writer sees the WRITE complete).
WRITE_LANDS_WITHOUT_WRITER_PROGRESS = True


@pytest.mark.parametrize("mode", MODES)
def test_p_killed_before_registration_and_mid_transfer(
    pair: Pair, transport: str, mode: str
) -> None:
    """One prefill node dies with two requests: ``early`` finished on P, D takes it only after
    the death (push: registers after it; pull: loads after it), and ``mid`` in transfer
    (pull: P stalls after confirming the lease, D's READ is posted; push: P stalls right after
    posting the WRITE, see WRITE_LANDS_WITHOUT_WRITER_PROGRESS: over NIXL its bytes land in D
    but the completion notice never leaves, so this is "after the WRITE, before the notice").
    D fails both within their bounds with every block invalid, and nothing lands later."""
    d = pair.d
    victim = spawn(transport, "kv_producer", "Pv")
    try:
        warm_up(victim, d, mode, 62)
        early = Req(mode, [1, 2], [40, 41])
        mid = Req(mode, list(range(3, 19)), list(range(42, 58)))
        early.finish(victim)
        mid.finish(victim)
        d.call("poke", blocks=mid.d_blocks, seed=1)
        untouched = digest(d, mid.d_blocks)
        if mode == "pull":
            victim.call("hold", when="counter:leases_renewed", seconds=30)
            mid.arrive(d)
            wait_state(victim, lambda s: s["paused"])
            mid.start(d, arrived=True)
            assert d.call("load_state", rid=mid.rid_d)["state"] == "posted"
        else:
            victim.call("hold", when="write_posted", seconds=30)
            mid.start(d)
            wait_state(victim, lambda s: s["paused"] and s["writer"] == "posted", rid=mid.rid_p)
            if WRITE_LANDS_WITHOUT_WRITER_PROGRESS:
                want = digest(victim, mid.p_blocks)
                deadline = time.monotonic() + 2
                while digest(d, mid.d_blocks) != want:
                    assert time.monotonic() < deadline, "the WRITE did not land"
                    time.sleep(0.01)
            else:
                time.sleep(0.2)
                assert digest(d, mid.d_blocks) == untouched
            assert mid.rid_d not in d.status()["finished_recving"], "the notice left a stalled P"
        killed = victim.kill()
        early.start(d)
        started = time.monotonic()
        st = mid.d_ended(d, timeout=READ_BOUND + SLACK)
        bound = LEASE if mode == "push" else READ_BOUND
        assert st["times"][f"recv:{mid.rid_d}"] - killed <= bound + SLACK
        mid.failed(st)
        st = early.d_ended(d, timeout=READ_BOUND + SLACK)
        assert st["times"][f"recv:{early.rid_d}"] - started <= bound + SLACK
        early.failed(st)
        unchanged_after(d, mid.d_blocks)
        unchanged_after(d, early.d_blocks, 0.0)
        leak_free(d)
    finally:
        victim.close()


def test_p_killed_mid_write_with_d_stalled(pair: Pair, transport: str) -> None:
    """Push: the WRITE is in flight because D stalls right after confirming its lease (P
    posts the WRITE, whose bytes land only with D's progress); P dies during the stall. When
    D resumes it fails the load (its lease was renewed by nobody: expired) and nothing lands
    in the blocks afterwards. (Pull's death of P mid-READ is the ``mid`` request above.)"""
    d = pair.d
    victim = spawn(transport, "kv_producer", "Pw")
    try:
        warm_up(victim, d, "push", 62)
        req = Req("push", list(range(20, 36)), list(range(20, 36)))
        req.finish(victim)
        stall = LEASE
        d.call("hold", when="counter:leases_renewed", seconds=stall)
        req.start(d)
        completed = wait_posted(victim, req)
        assert wait_state(d, lambda s: s["paused"])["paused"]
        killed = victim.kill()
        st = req.d_ended(d, timeout=stall + LEASE + SLACK)
        assert st["times"][f"recv:{req.rid_d}"] - killed <= stall + LEASE + SLACK
        if completed:
            # P saw its WRITE complete and sent the notice before it died (over NIXL a small
            # WRITE completes on the writer once its bytes left): bytes and notice travel in
            # order to D, which finds the whole KV, and only then the notice, when it resumes.
            assert req.rid_d not in st["failures"], st["failures"]
            assert not set(req.d_blocks) & set(st["invalid"])
        else:
            req.failed(st)
        unchanged_after(d, req.d_blocks)
        leak_free(d)
    finally:
        victim.close()


def test_p_stalled_mid_write_past_the_lease(pair: Pair) -> None:
    """Push: P stalls right after posting its WRITE, for longer than D's lease, and then
    resumes (it does not die). D fails the load when its lease expires (nobody renewed it)
    and the engine reuses the blocks; when P resumes, nothing of its WRITE may land in them
    (the fence: a WRITE never lands after D gave its blocks up)."""
    p, d = pair.p, pair.d
    req = Req("push", list(range(20, 36)), list(range(46, 62)))
    req.finish(p)
    stall = 2 * LEASE
    p.call("hold", when="write_posted", seconds=stall)
    req.start(d)
    wait_state(p, lambda s: s["paused"] and s["writer"] == "posted", rid=req.rid_p)
    st = req.d_ended(d, timeout=LEASE + SLACK)
    req.failed(st)
    d.call("poke", blocks=req.d_blocks, seed=next(_n))
    reused = digest(d, req.d_blocks)
    st = req.p_ended(p, timeout=stall + EXTENSION + SLACK)  # P resumed and gave up the WRITE
    time.sleep(0.2)
    assert digest(d, req.d_blocks) == reused, "P's WRITE landed after D's lease ended"
    once(st, req.rid_p, "finished_sending")
    leak_free(p, d)


# -- D dies ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_d_killed_before_registration_and_mid_transfer(
    pair: Pair, transport: str, mode: str
) -> None:
    """One decode node dies with two requests of P's: ``early`` not registered yet (push: D
    got it while stalled, so its worker never sent the registration; pull: queued,
    heartbeating, not scheduled) and ``mid`` in transfer (push: D stalls right after
    confirming its lease, P's WRITE is posted; pull: D stalls right after posting its READ).
    P frees both within its bounds and is clean."""
    p = pair.p
    victim = spawn(transport, "kv_consumer", "Dv")
    try:
        warm_up(p, victim, mode, 61)
        early = Req(mode, [50, 51], [1, 2])
        mid = Req(mode, list(range(30, 46)), list(range(10, 26)))
        early.finish(p)
        mid.finish(p)
        if mode == "push":
            victim.call("hold", when="counter:leases_renewed", seconds=30)
            mid.start(victim)
            wait_posted(p, mid)
            early.start(victim)  # the worker never sees it: D is stalled
        else:
            early.arrive(victim)
            time.sleep(2 * INTERVAL)  # a heartbeat or two
            victim.call("hold", when="read_posted", seconds=30)
            mid.start(victim)
        wait_state(victim, lambda s: s["paused"])
        killed = victim.kill()
        st = mid.p_ended(p, timeout=LEASE + SLACK)
        # push: the writer's WRITE ends at its transfer timeout (one extension) or the
        # transport's error; pull: the lease one extension after D's last heartbeat
        mid_bound = EXTENSION + (0 if mode == "push" else INTERVAL)
        assert st["times"][f"sent:{mid.rid_p}"] - killed <= mid_bound + SLACK
        st = early.p_ended(p, timeout=LEASE + SLACK)
        # push: nobody registered within kv_lease_duration of the offer
        early_bound = LEASE if mode == "push" else EXTENSION + INTERVAL
        assert st["times"][f"sent:{early.rid_p}"] - killed <= early_bound + SLACK
        once(st, mid.rid_p, "finished_sending")
        once(st, early.rid_p, "finished_sending")
        if mode == "push":
            assert state(p)["counters"].get("pushes_failed", 0) >= 1
            assert state(p)["counters"].get("push_unsent", 0) >= 1
        leak_free(p)
    finally:
        victim.close()
