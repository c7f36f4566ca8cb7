"""The P/D connector's timing logic on a fake clock: expiries, renewals and every wait's timeout
are driven by advancing time by hand, never by sleeping. (The side channel's handshake is real
pyzmq I/O on a thread; tests step until it is done, which takes milliseconds of real time and
no fake time.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from kvframe.core.reader import ReadState
from kvframe.testing.clock import FakeClock
from kvframe.testing.faults import Faults
from tests.pd.driver import Driver, view

LEASE = 6.0  # interval 1 s, extension 4 s, margin 1 s


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture
def pd(clock: FakeClock) -> Iterator[tuple[Driver, Driver]]:
    p = Driver(f"Pfc{id(clock)}", "kv_producer", lease=LEASE, clock=clock)
    d = Driver(
        f"Dfc{id(clock)}",
        "kv_consumer",
        lease=LEASE,
        clock=clock,
        # No lease table: these tests follow the loads that wait for P's acknowledgement
        # (test_pd_lease_table.py covers the table).
        extra={"handshake_timeout": 2.0, "lease_table_slots": 0},
    )
    yield p, d
    d.shutdown()
    p.shutdown()


def _steps(drivers: list[Driver], cond: Callable[[], bool], limit: int = 20_000) -> None:
    """Step without advancing fake time until ``cond`` (real I/O may need a few ms)."""
    end = time.monotonic() + 10
    for _ in range(limit):
        if cond():
            return
        for d in drivers:
            d.step()
        assert time.monotonic() < end, "condition not reached"
    raise AssertionError("condition not reached")


def _prefill(p: Driver, rid: str, blocks: list[int]) -> dict:
    p.fill(blocks, seed=len(rid))
    _, params = p.sched.request_finished(
        view(rid, 16 * len(blocks), {"do_remote_decode": True}, finish_reason="length"),
        (tuple(blocks),),
    )
    assert params is not None
    p.step()
    return params


def _arrive(d: Driver, rid: str, params: dict, clock: FakeClock) -> None:
    d.sched.on_new_request(view(rid, params["remote_num_tokens"], params, arrival_time=clock()))


def _schedule(d: Driver, rid: str, params: dict, blocks: list[int]) -> None:
    req = view(rid, params["remote_num_tokens"], params)
    n, _ = d.sched.get_num_new_matched_tokens(req, 0)
    d.sched.update_state_after_alloc(req, (tuple(blocks),), n)


def _ended(drv: Driver, rid: str, field: str) -> bool:
    return any(rid in getattr(o, field) for o in drv.outputs)


def _failure(drv: Driver, rid: str) -> str:
    return next(o.failures[rid] for o in drv.outputs if rid in o.failures)


def test_an_unread_lease_expires_exactly_at_its_expiry(clock: FakeClock) -> None:
    p = Driver("Pexpfc", "kv_producer", lease=LEASE, clock=clock)
    try:
        _prefill(p, "r", [1])
        clock.advance(LEASE - 0.001)
        p.step()
        assert not _ended(p, "r", "finished_sending")
        clock.advance(0.002)
        p.step()
        assert _ended(p, "r", "finished_sending")
        assert sum(o.stats.counters.get("leases_expired", 0) for o in p.outputs) == 1
    finally:
        p.shutdown()


def test_heartbeats_keep_a_queued_lease_for_ten_durations(
    pd: tuple[Driver, Driver], clock: FakeClock
) -> None:
    p, d = pd
    params = _prefill(p, "r", [1, 2])
    _arrive(d, "q", params, clock)
    engine, lease_id = params["remote_engine_id"], params["remote_request_id"]
    _steps([d, p], lambda: d.worker.reader.confirmed_bound(engine, lease_id) > clock())
    for _ in range(100):  # ten lease durations in steps of 0.6 s
        clock.advance(LEASE / 10)
        for _ in range(3):
            d.step()
            p.step()
    assert not _ended(p, "r", "finished_sending"), "P freed a lease D kept heartbeating"
    _schedule(d, "q", params, [5, 6])
    _steps([d, p], lambda: _ended(d, "q", "finished_recving"))
    assert not any(o.failures for o in d.outputs)


def test_no_confirmation_fails_the_load_after_confirm_timeout(
    pd: tuple[Driver, Driver], clock: FakeClock
) -> None:
    p, d = pd
    params = _prefill(p, "r", [1])
    Faults.of(d.worker.transport.fabric).drop_notifications(endpoint=d.worker.transport.name)
    _arrive(d, "q", params, clock)
    _schedule(d, "q", params, [5])
    # The READ went beside the unanswered heartbeat (optimistic_read, the default) and
    # completed; its bytes wait for a confirmation that never comes.
    _steps([d, p], lambda: d.worker.reader.state("q") is ReadState.VERIFYING)
    clock.advance(4.0 - 0.01)  # confirm_timeout is one extension
    d.step()
    assert d.worker.reader.state("q") is ReadState.VERIFYING
    clock.advance(0.02)
    d.step()
    assert _ended(d, "q", "finished_recving")
    assert "did not confirm" in _failure(d, "q")
    assert not d.sched.has_pending_work()


def test_a_posted_read_that_never_completes_fails_at_its_confirmed_bound(
    pd: tuple[Driver, Driver], clock: FakeClock
) -> None:
    p, d = pd
    params = _prefill(p, "r", [1, 2])
    Faults.of(d.worker.transport.fabric).delay_transfers(10**9, endpoint=d.worker.transport.name)
    _arrive(d, "q", params, clock)
    _schedule(d, "q", params, [5, 6])
    _steps([d, p], lambda: d.worker.reader.state("q") is ReadState.POSTED)
    # P keeps stepping and renewing, so the bound moves on; transfer_timeout still holds.
    t0 = clock()
    while not _ended(d, "q", "finished_recving"):
        clock.advance(0.5)
        d.step()
        p.step()
        assert clock() - t0 <= 4.0 + 0.5, "the read outlived transfer_timeout"
    assert "did not complete" in _failure(d, "q")
    assert d.worker.transport.stats().get("transfers_done", 0) == 0  # stopped, never landed


def test_no_connection_fails_the_load_after_peer_timeout(
    pd: tuple[Driver, Driver], clock: FakeClock
) -> None:
    p, d = pd
    params = dict(_prefill(p, "r", [1]))
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    params["remote_port"] = silent.bind_to_random_port("tcp://127.0.0.1")
    params.pop("remote_ports", None)
    try:
        _arrive(d, "q", params, clock)
        _schedule(d, "q", params, [5])
        d.step()
        assert d.worker.reader.state("q") is ReadState.WAITING_PEER
        clock.advance(2 * 2.0 - 0.01)  # peer_timeout is twice the handshake timeout
        d.step()
        assert d.worker.reader.state("q") is ReadState.WAITING_PEER
        clock.advance(0.02)
        d.step()
        assert _ended(d, "q", "finished_recving")
        assert "no connection" in _failure(d, "q") or "handshake" in _failure(d, "q")
    finally:
        silent.close(linger=0)


def test_each_worker_reads_the_clock_once_per_progress_point() -> None:
    """The worker takes one clock reading per progress point (start_load_kv, get_finished),
    whatever it does in it: granting, heartbeating, confirming, posting; a second one only to
    stamp a READ that completed within the point that posted it; and get_finished runs one
    more progress point only while a READ that landed waits for P's acknowledgement."""
    fake = FakeClock(50.0)
    calls = {"n": 0}

    def counting() -> float:
        if threading.current_thread() is threading.main_thread():  # not the handshake thread
            calls["n"] += 1
        return fake()

    p = Driver("Pcnt", "kv_producer", lease=LEASE, clock=fake)
    d = Driver("Dcnt", "kv_consumer", lease=LEASE, clock=counting)
    try:
        params = _prefill(p, "r", [1, 2])
        _arrive(d, "q", params, fake)
        _schedule(d, "q", params, [5, 6])
        seen = set()
        for _ in range(2000):
            before = calls["n"]
            ended_before = _ended(d, "q", "finished_recving")
            d.step()  # the driver reads the clock once itself, for SchedulerStep.now
            readings = calls["n"] - before
            # One per progress point, and one more only where a READ posted in that point had
            # already completed by its end (stamped then, so the load ends at once, or, posted
            # before P's acknowledgement, waits for it in VERIFYING), plus get_finished's extra
            # progress point while a READ that landed waits for that acknowledgement.
            assert readings == 3 or (
                readings in (4, 5)
                and not ended_before
                and (
                    _ended(d, "q", "finished_recving")
                    or d.worker.reader.state("q") is ReadState.VERIFYING
                )
            ), readings
            p.step()
            state = d.worker.reader.state("q")
            seen.add(state)
            if _ended(d, "q", "finished_recving"):
                break
        proven = sum(o.stats.counters.get("reads_proven_by_table", 0) for o in d.outputs)
        # Seen between steps, unless P's lease table proved the READ in the step that posted
        # it (the load then went from waiting for the connection to done in one step).
        assert seen & {ReadState.CONFIRMING, ReadState.POSTED, ReadState.VERIFYING} or proven
        assert _ended(d, "q", "finished_recving")
        assert not any(o.failures for o in d.outputs)
    finally:
        d.shutdown()
        p.shutdown()


def test_a_prefill_engine_gone_at_the_optimistic_post_fails_the_load_once(
    pd: tuple[Driver, Driver], clock: FakeClock
) -> None:
    # The optimistic READ and the heartbeat asking P to confirm go in one progress point, the
    # READ first. When posting it finds P unreachable, the load fails there at once (the peer
    # broke, as when a send finds it so), is reported once, and the heartbeat behind it is not
    # sent. (Once, with the heartbeat first, the READ queued behind a send that had ended the
    # load was reported a second time: InvalidTransitionError inside vLLM's decode engine,
    # tests_vllm/test_vllm_pd.py.)
    p, d = pd
    first = _prefill(p, "r1", [1])
    _arrive(d, "q1", first, clock)
    _schedule(d, "q1", first, [5])
    _steps([d, p], lambda: _ended(d, "q1", "finished_recving"))
    params = _prefill(p, "r2", [2])
    Faults.of(d.worker.transport.fabric).vanish(p.worker.transport.name)
    _arrive(d, "q2", params, clock)
    _schedule(d, "q2", params, [6])
    _steps([d], lambda: _ended(d, "q2", "finished_recving"))
    assert "unreachable" in _failure(d, "q2")
    assert d.worker.reader.state("q2") is None
    assert not d.sched.has_pending_work()
