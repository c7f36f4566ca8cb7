"""Liveness feeds the leases, on a real etcd: P and D connectors (in-process transport) whose
engines register through the etcd backend and follow the fleet with FleetLiveness."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvframe.core.fleet import EngineRecord, EngineRole
from kvframe.runtime.fleet import FleetLiveness
from kvframe.spi.discovery import Discovery
from tests.discovery.helpers import record, start_registered_child, stop_child, wait_for
from tests.etcd.server import EtcdServer, Proxy
from tests.pd.driver import Driver, run_until, view
from tests.pd.test_pd_fake_clock import _ended, _prefill, _schedule

Make = Callable[..., Discovery]
LEASE = 20.0  # far longer than the etcd TTLs: an early end is the discovery's doing


def rec_of(drv: Driver, role: EngineRole) -> EngineRecord:
    assert drv.config.engine_id is not None
    return record(drv.config.engine_id, role)


@contextmanager
def pair(tag: str) -> Iterator[tuple[Driver, Driver]]:
    p = Driver(f"P{tag}{time.monotonic_ns()}", "kv_producer", lease=LEASE)
    # No lease table: D's loads wait for P's acknowledgement, so a load is still waiting
    # when P dies (with the table it would be done in its first step).
    d = Driver(
        f"D{tag}{time.monotonic_ns()}",
        "kv_consumer",
        lease=LEASE,
        extra={"lease_table_slots": 0},
    )
    try:
        yield p, d
    finally:
        d.shutdown()
        p.shutdown()


def counter(drv: Driver, name: str) -> float:
    return sum(o.stats.counters.get(name, 0) for o in drv.outputs)


def claim(p: Driver, d: Driver, rid: str, blocks: list[int]) -> dict:
    """Prefill ``rid`` on P; D learns of it and heartbeats its lease until P confirmed it."""
    params = _prefill(p, rid, blocks)
    d.sched.on_new_request(view("q" + rid, params["remote_num_tokens"], params))
    engine, lease_id = params["remote_engine_id"], params["remote_request_id"]
    run_until([d, p], lambda: d.worker.reader.confirmed_bound(engine, lease_id) > time.monotonic())
    assert p.worker.holder.claimant(lease_id) is not None
    return params


def test_a_decoder_that_dies_has_its_leases_freed_through_the_watch(
    backends: Make, etcd: EtcdServer
) -> None:
    with pair("kill") as (p, d):
        live = FleetLiveness(backends(), rec_of(p, EngineRole.PRODUCER), [p.worker], hold=1.0)
        assert d.config.engine_id is not None
        child = start_registered_child(
            "etcd", {"endpoint": etcd.endpoint, "ttl": 2}, d.config.engine_id
        )
        try:
            wait_for(lambda: len(live.watch.live()) == 2, 5, "both engines watched")
            claim(p, d, "r", [1, 2])
            child.send_signal(signal.SIGKILL)  # the decoder engine dies (D is never stepped again)
            killed = time.monotonic()
            run_until([p], lambda: _ended(p, "r", "finished_sending"), timeout=10)
            freed = time.monotonic() - killed
        finally:
            stop_child(child)
            live.close()
        print(f"leases freed {freed:.2f} s after the decoder was killed (ttl 2 s)")
        assert freed <= 2.0 + 0.6 + 0.2, freed  # the TTL, etcd's expiry sweep, a step
        assert [e.record.engine_id for e in live.gone] == [d.config.engine_id]
        assert counter(p, "leases_aborted_engine_gone") == 1
        assert p.worker.holder.live_count == 0  # nothing leaked


def test_etcd_restarted_mid_run_frees_nothing_early_and_leaks_nothing(
    backends: Make, etcd: EtcdServer
) -> None:
    with pair("restart") as (p, d):
        lp = FleetLiveness(backends(ttl=4), rec_of(p, EngineRole.PRODUCER), [p.worker], hold=1.0)
        ld = FleetLiveness(backends(ttl=4), rec_of(d, EngineRole.CONSUMER), [d.worker], hold=1.0)
        try:
            wait_for(lambda: len(lp.watch.live()) == 2 and len(ld.watch.live()) == 2, 5, "watched")
            params = claim(p, d, "r", [1, 2])
            etcd.stop(signal.SIGKILL)
            end = time.monotonic() + 1.5
            run_until([d, p], lambda: time.monotonic() > end)  # heartbeats go on meanwhile
            etcd.start()
            end = time.monotonic() + 2.0
            run_until([d, p], lambda: time.monotonic() > end)
            assert lp.gone == []
            assert ld.gone == []
            assert not d.worker.fenced
            assert counter(p, "leases_aborted_engine_gone") == 0
            assert p.worker.holder.live_count == 1  # still held: nothing freed early
            _schedule(d, "qr", params, [5, 6])
            run_until([d, p], lambda: _ended(d, "qr", "finished_recving"))
            run_until([d, p], lambda: _ended(p, "r", "finished_sending"))
        finally:
            ld.close()
            lp.close()
        assert not any("qr" in o.failures for o in d.outputs)
        assert torch_equal(p.blocks([1, 2]), d.blocks([5, 6]))
        assert p.worker.holder.live_count == 0  # consumed: nothing leaked
        assert counter(p, "leases_consumed") == 1


def torch_equal(a: list, b: list) -> bool:
    return all(bool((x == y).all()) for x, y in zip(a, b, strict=True))


def test_a_partitioned_decoder_fences_itself_before_the_prefill_engine_frees_its_leases(
    backends: Make, etcd: EtcdServer
) -> None:
    proxy = Proxy(etcd.client_port)
    with pair("part") as (p, d):
        lp = FleetLiveness(backends(), rec_of(p, EngineRole.PRODUCER), [p.worker], hold=1.0)
        ld = FleetLiveness(
            backends(endpoint=proxy.endpoint, request_timeout=0.5),
            rec_of(d, EngineRole.CONSUMER),
            [d.worker],
            hold=1.0,
        )
        try:
            wait_for(lambda: len(lp.watch.live()) == 2, 5, "both watched")
            claim(p, d, "r1", [1])
            proxy.cut()  # D loses etcd, not P: D keeps running
            run_until([d, p], lambda: d.worker.fenced, timeout=5)
            fenced_at = time.monotonic()
            run_until([d, p], lambda: _ended(p, "r1", "finished_sending"), timeout=5)
            freed_at = time.monotonic()
            assert fenced_at < freed_at  # D stopped reading before P freed anything
            assert [e.record.engine_id for e in lp.gone] == [d.config.engine_id]
            assert counter(p, "leases_aborted_engine_gone") == 1  # r1, long before its expiry
            # While fenced D claims nothing: a new lease stays unclaimed.
            second = _prefill(p, "r2", [2])
            d.sched.on_new_request(view("qr2", second["remote_num_tokens"], second))
            end = time.monotonic() + 0.5
            run_until([d, p], lambda: time.monotonic() > end)
            assert p.worker.holder.claimant(second["remote_request_id"]) is None
            proxy.restore()  # back: D registers again and reads again after the hold
            run_until([d, p], lambda: not ld.fenced and not d.worker.fenced, timeout=10)
            third = claim(p, d, "r3", [3])
            _schedule(d, "qr3", third, [7])
            run_until([d, p], lambda: _ended(d, "qr3", "finished_recving"))
            assert not any("qr3" in o.failures for o in d.outputs)
        finally:
            ld.close()
            lp.close()
            proxy.close()


def test_a_prefill_engine_that_dies_fails_the_decoders_loads_through_the_watch(
    backends: Make, etcd: EtcdServer
) -> None:
    with pair("pkill") as (p, d):
        live = FleetLiveness(backends(), rec_of(d, EngineRole.CONSUMER), [d.worker], hold=1.0)
        assert p.config.engine_id is not None
        child = start_registered_child(
            "etcd", {"endpoint": etcd.endpoint, "ttl": 2}, p.config.engine_id
        )
        try:
            wait_for(lambda: len(live.watch.live()) == 2, 5, "both engines watched")
            params = _prefill(p, "r", [1])
            d.sched.on_new_request(view("qr", params["remote_num_tokens"], params))
            _schedule(d, "qr", params, [5])
            d.step()  # P is never stepped again: it died before answering
            child.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            run_until([d], lambda: _ended(d, "qr", "finished_recving"), timeout=10)
            failed = time.monotonic() - killed
        finally:
            stop_child(child)
            live.close()
        # Without discovery the load would wait for a confirmation (one lease extension).
        print(f"loads failed {failed:.2f} s after the prefill engine was killed (ttl 2 s)")
        assert failed <= 2.0 + 0.6 + 0.2, failed
        reason = next(o.failures["qr"] for o in d.outputs if "qr" in o.failures)
        assert "left the fleet" in reason
        assert len(d.worker.reader) == 0
