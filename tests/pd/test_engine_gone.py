"""Liveness feeds the leases: ``PDConnectorWorker.engine_gone`` on a fake clock.

A decoder that is gone has its claimed leases aborted by the prefill engine at once (no time
passes), and so are the leases granted for it (the prefill request's ``decode_engine_id``) that
nobody claimed yet; a prefill engine that is gone fails the decoder's pending loads at once; an
engine nobody reports gone is bounded by its leases exactly as before."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvframe.testing.clock import FakeClock
from tests.pd.driver import Driver, view
from tests.pd.test_pd_fake_clock import (
    LEASE,
    _arrive,
    _ended,
    _failure,
    _prefill,
    _schedule,
    _steps,
)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(500.0)


@pytest.fixture
def pd(clock: FakeClock) -> Iterator[tuple[Driver, Driver]]:
    p = Driver(f"Pgone{id(clock)}", "kv_producer", lease=LEASE, clock=clock)
    # No lease table: D's loads wait for P's acknowledgement, so one is still in flight when
    # P is reported gone.
    d = Driver(
        f"Dgone{id(clock)}",
        "kv_consumer",
        lease=LEASE,
        clock=clock,
        extra={"lease_table_slots": 0},
    )
    yield p, d
    d.shutdown()
    p.shutdown()


def _counter(drv: Driver, name: str) -> float:
    return sum(o.stats.counters.get(name, 0) for o in drv.outputs)


def test_a_gone_decoder_has_its_claimed_leases_aborted_at_once(
    pd: tuple[Driver, Driver], clock: FakeClock
) -> None:
    p, d = pd
    claimed = _prefill(p, "r", [1, 2])
    _prefill(p, "u", [3])
    _arrive(d, "q", claimed, clock)
    engine = claimed["remote_engine_id"]
    _steps(
        [d, p],
        lambda: d.worker.reader.confirmed_bound(engine, claimed["remote_request_id"]) > clock(),
    )
    assert p.worker.holder.live_count == 2
    before = clock()
    p.worker.engine_gone(d.config.engine_id, "its registration expired")
    p.step()
    assert clock() == before  # no time passed: the lease ended long before its expiry
    assert _ended(p, "r", "finished_sending")
    assert _counter(p, "leases_aborted_engine_gone") == 1
    assert _counter(p, "leases_aborted") == 1
    # A lease nobody claimed is not "for" any decoder: it stays until its own expiry.
    assert not _ended(p, "u", "finished_sending")
    assert p.worker.holder.live_count == 1
    # Why a reader reported gone must really be gone (or fenced): this one is alive and
    # still holds a confirmed bound, so it reads the freed blocks (one-sided: P only learns
    # of it from the done notice for a lease it no longer has).
    _schedule(d, "q", claimed, [5, 6])
    _steps([d, p], lambda: _ended(d, "q", "finished_recving"))
    assert _counter(p, "done_for_unknown_lease") == 1


def _prefill_for(p: Driver, rid: str, blocks: list[int], decoder: str) -> dict:
    """P prefills ``rid`` for the decode engine ``decoder`` (``decode_engine_id``)."""
    p.fill(blocks, seed=len(rid))
    params = {"do_remote_decode": True, "decode_engine_id": decoder}
    _, ticket = p.sched.request_finished(
        view(rid, 16 * len(blocks), params, finish_reason="length"), (tuple(blocks),)
    )
    assert ticket is not None
    p.step()
    return ticket


def test_a_lease_meant_for_a_gone_decoder_that_never_claimed_it_is_aborted_at_once(
    pd: tuple[Driver, Driver], clock: FakeClock
) -> None:
    p, d = pd
    mine = _prefill_for(p, "r", [1, 2], d.config.engine_id)
    _prefill_for(p, "o", [3], "another-decoder")
    _prefill(p, "n", [4])  # names no decode engine
    assert p.worker.holder.meant_for(mine["remote_request_id"]) == d.config.engine_id
    assert p.worker.holder.meant_count == 2
    before = clock()
    p.worker.engine_gone(d.config.engine_id, "its registration expired")
    p.step()
    assert clock() == before  # no time passed: the lease ended long before its expiry
    assert _ended(p, "r", "finished_sending")
    assert _counter(p, "leases_aborted_engine_gone") == 1
    assert _counter(p, "leases_aborted") == 1
    # The lease meant for another decoder and the one meant for nobody stay.
    assert not _ended(p, "o", "finished_sending")
    assert not _ended(p, "n", "finished_sending")
    assert p.worker.holder.live_count == 2
    assert p.worker.holder.meant_count == 1


def test_a_lease_meant_for_a_gone_decoder_but_claimed_by_another_is_not_aborted(
    pd: tuple[Driver, Driver], clock: FakeClock
) -> None:
    p, d = pd
    # The router meant the ticket for "vanished", then (say, a retry) handed it to d.
    ticket = _prefill_for(p, "r", [1, 2], "vanished")
    _arrive(d, "q", ticket, clock)
    engine = ticket["remote_engine_id"]
    lid = ticket["remote_request_id"]
    _steps([d, p], lambda: d.worker.reader.confirmed_bound(engine, lid) > clock())
    assert p.worker.holder.claimant(lid) is not None
    p.worker.engine_gone("vanished", "its registration expired")
    p.step()
    assert _counter(p, "leases_aborted_engine_gone") == 0
    assert p.worker.holder.live_count == 1  # the claim decides: d reads it
    _schedule(d, "q", ticket, [5, 6])
    _steps([d, p], lambda: _ended(d, "q", "finished_recving"))
    assert not any("q" in o.failures for o in d.outputs)
    _steps([d, p], lambda: _ended(p, "r", "finished_sending"))
    assert _counter(p, "leases_consumed") == 1


def test_a_decoder_naming_a_lease_aborted_for_a_gone_decoder_is_refused_and_reads_nothing(
    pd: tuple[Driver, Driver], clock: FakeClock
) -> None:
    p, d = pd
    ticket = _prefill_for(p, "r", [1, 2], "vanished")
    p.worker.engine_gone("vanished", "its registration expired")
    p.step()
    assert _ended(p, "r", "finished_sending")
    assert _counter(p, "leases_aborted_engine_gone") == 1
    # A router retry hands the ticket to d afterwards: P answers ABORTED, d never confirms
    # the lease, and its load fails (kv_load_failure_policy: the engine recomputes).
    _arrive(d, "q", ticket, clock)
    _schedule(d, "q", ticket, [5, 6])
    _steps([d, p], lambda: _ended(d, "q", "finished_recving"))
    assert "q" in {rid for o in d.outputs for rid in o.failures}
    assert (
        d.worker.reader.confirmed_bound(ticket["remote_engine_id"], ticket["remote_request_id"])
        <= clock()
    )
    assert p.worker.holder.live_count == 0


@pytest.mark.parametrize("bad", ["", "has space", "-lead", "x" * 129, 7, None, ["D"]])
def test_a_bad_decode_engine_id_keeps_nothing_and_names_the_field(
    pd: tuple[Driver, Driver], bad: object
) -> None:
    p, _ = pd
    p.fill([1], seed=1)
    params = {"do_remote_decode": True, "decode_engine_id": bad}
    delay, ticket = p.sched.request_finished(view("r", 16, params, finish_reason="length"), ((1,),))
    assert (delay, ticket) == (False, None)
    (event,) = [e for e in p.sched.take_events() if e.kind == "pd.not_kept"]
    assert "kv_transfer_params.decode_engine_id" in event.data["error"]
    assert "1-128 letters" in event.data["error"]


def test_a_gone_prefill_engine_fails_the_decoders_loads_at_once(
    pd: tuple[Driver, Driver], clock: FakeClock
) -> None:
    p, d = pd
    params = _prefill(p, "r", [1])
    _arrive(d, "q", params, clock)
    _schedule(d, "q", params, [5])
    d.step()
    assert d.worker.reader.state("q") is not None
    before = clock()
    d.worker.engine_gone(p.config.engine_id, "its registration expired")
    d.step()
    assert clock() == before
    assert _ended(d, "q", "finished_recving")
    assert "left the fleet (its registration expired)" in _failure(d, "q")
    assert _counter(d, "engines_gone") == 1
    assert len(d.worker.reader) == 0


def test_an_unknown_engine_changes_nothing_and_leases_still_bound_everything(
    pd: tuple[Driver, Driver], clock: FakeClock
) -> None:
    p, d = pd
    params = _prefill(p, "r", [1])
    _arrive(d, "q", params, clock)
    engine = params["remote_engine_id"]
    _steps(
        [d, p],
        lambda: d.worker.reader.confirmed_bound(engine, params["remote_request_id"]) > clock(),
    )
    p.worker.engine_gone("someone-else")
    p.step()
    assert p.worker.holder.live_count == 1
    # Discovery says nothing about the silent decoder: its lease ends at its expiry, as
    # without discovery (one extension after its last heartbeat).
    expiry = p.worker.holder.table.lease(params["remote_request_id"]).expiry
    clock.advance(expiry - clock() + 0.001)
    p.step()
    assert _ended(p, "r", "finished_sending")
    assert _counter(p, "leases_expired") == 1


def test_engine_gone_refuses_a_bad_engine_id(pd: tuple[Driver, Driver]) -> None:
    p, _ = pd
    with pytest.raises(ValueError, match="engine_id must be a non-empty string"):
        p.worker.engine_gone("")


def test_a_fenced_decoder_claims_nothing_and_fails_its_loads_at_once(
    pd: tuple[Driver, Driver], clock: FakeClock
) -> None:
    p, d = pd
    first = _prefill(p, "r1", [1])
    _arrive(d, "q1", first, clock)
    engine = first["remote_engine_id"]
    # Connected and confirmed before the fence (the load then waits for its blocks).
    _steps(
        [d, p],
        lambda: d.worker.reader.confirmed_bound(engine, first["remote_request_id"]) > clock(),
    )
    _schedule(d, "q1", first, [5])
    d.worker.fence("registration lapsed")
    d.step()
    assert d.worker.fenced
    assert "this engine is fenced: registration lapsed" in _failure(d, "q1")
    # A load added while fenced fails at once, and its lease is never claimed at P.
    second = _prefill(p, "r2", [2])
    _arrive(d, "q2", second, clock)
    _schedule(d, "q2", second, [6])
    for _ in range(50):
        d.step()
        p.step()
    assert "fenced" in _failure(d, "q2")
    assert p.worker.holder.claimant(second["remote_request_id"]) is None
    # So aborting everything this decoder claimed frees nothing it could still be reading.
    p.worker.engine_gone(d.config.engine_id)
    p.step()
    assert _counter(p, "leases_aborted_engine_gone") == 1  # r1, claimed before the fence
    assert p.worker.holder.live_count >= 1  # r2 (never claimed) stays until its expiry
    d.worker.unfence()
    d.step()
    assert not d.worker.fenced
    # The fence dropped the connection: the next request handshakes again, after the
    # handshake retry backoff (at most 75 ms after one failure).
    clock.advance(0.1)
    third = _prefill(p, "r3", [3])
    _arrive(d, "q3", third, clock)
    _schedule(d, "q3", third, [7])
    _steps([d, p], lambda: _ended(d, "q3", "finished_recving"))
    assert not any("q3" in o.failures for o in d.outputs)
