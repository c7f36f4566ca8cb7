"""The P/D connector end to end in one process over the in-process transport."""

from __future__ import annotations

import gc
import itertools

import pytest
import torch

from kvframe.testing.faults import Faults
from tests.pd.driver import Driver, run_until, view

_ids = itertools.count()


@pytest.fixture
def pd() -> tuple[Driver, Driver]:
    n = next(_ids)
    p = Driver(f"P{n}", "kv_producer")
    d = Driver(f"D{n}", "kv_consumer")
    yield p, d
    d.shutdown()
    p.shutdown()


def prefill(p: Driver, rid: str, blocks: list[int], tokens: int) -> dict:
    p.fill(blocks, seed=hash(rid) % 1000)
    delay, params = p.sched.request_finished(
        view(rid, tokens, {"do_remote_decode": True}, finish_reason="length"), (tuple(blocks),)
    )
    assert delay is True
    assert params is not None
    return params


def test_happy_path_moves_exact_bytes_and_frees_p(pd: tuple[Driver, Driver]) -> None:
    p, d = pd
    params = prefill(p, "r1", [3, 4, 5, 6], tokens=60)
    assert params["do_remote_prefill"] is True
    p.step()
    req = view("d1", 60, params)
    d.sched.on_new_request(req)
    n, is_async = d.sched.get_num_new_matched_tokens(req, 0)
    assert (n, is_async) == (59, True)
    d.sched.update_state_after_alloc(req, ((10, 11, 12, 13),), n)
    run_until([p, d], lambda: any("d1" in o.finished_recving for o in d.outputs))
    assert not any(o.invalid_block_ids for o in d.outputs)
    for a, b in zip(p.blocks([3, 4, 5, 6]), d.blocks([10, 11, 12, 13]), strict=True):
        assert torch.equal(a, b)
    run_until([p, d], lambda: any("r1" in o.finished_sending for o in p.outputs))
    assert not p.sched.has_pending_work()
    assert not d.sched.has_pending_work()


def _start_load(d: Driver, rid: str, params: dict, blocks: list[int], computed: int = 0) -> int:
    req = view(rid, params["remote_num_tokens"], params, num_computed_tokens=computed)
    d.sched.on_new_request(req)
    n, is_async = d.sched.get_num_new_matched_tokens(req, computed)
    assert is_async is (n > 0)
    if n:
        d.sched.update_state_after_alloc(req, (tuple(blocks),), n)
    return n


def _ended(drv: Driver, rid: str, field: str = "finished_sending") -> bool:
    return any(rid in getattr(o, field) for o in drv.outputs)


def test_partial_prefix_hit_reads_only_the_suffix(pd: tuple[Driver, Driver]) -> None:
    p, d = pd
    params = prefill(p, "r1", [3, 4, 5, 6], tokens=64)
    d.fill([20, 21], seed=99)
    before = d.blocks([20, 21])
    # D already has the first two blocks (32 tokens) in its own cache
    n = _start_load(d, "d1", params, [20, 21, 22, 23], computed=32)
    assert n == 31  # tokens 32..62; the last prompt token is computed locally
    run_until([p, d], lambda: _ended(d, "d1", "finished_recving"))
    for a, b in zip(before, d.blocks([20, 21]), strict=True):
        assert torch.equal(a, b)  # untouched
    for a, b in zip(p.blocks([5, 6]), d.blocks([22, 23]), strict=True):
        assert torch.equal(a, b)
    run_until([p, d], lambda: _ended(p, "r1"))


def test_full_local_hit_sends_only_the_release(pd: tuple[Driver, Driver]) -> None:
    p, d = pd
    params = prefill(p, "r1", [3, 4], tokens=32)
    p.step()
    n = _start_load(d, "d1", params, [7, 8], computed=31)
    assert n == 0
    run_until([p, d], lambda: _ended(p, "r1"))
    stats = [o.stats.counters for o in p.outputs]
    assert sum(s.get("leases_aborted", 0) for s in stats) == 1
    assert sum(s.get("leases_consumed", 0) for s in stats) == 0


def test_abort_before_scheduling_frees_p_at_once(pd: tuple[Driver, Driver]) -> None:
    p, d = pd
    params = prefill(p, "r1", [3, 4], tokens=32)
    p.step()
    req = view("d1", 32, params)
    d.sched.on_new_request(req)
    run_until([p, d], lambda: d.sched.has_pending_work() and d.step_no > 3)
    delay, _ = d.sched.request_finished(view("d1", 32, params, finish_reason="abort"), ((),))
    assert delay is False
    run_until([p, d], lambda: _ended(p, "r1"), timeout=2.0)
    assert not d.sched.has_pending_work()


def test_abort_while_loading_keeps_blocks_until_transfer_stopped(pd: tuple[Driver, Driver]) -> None:
    p, d = pd
    params = prefill(p, "r1", [3, 4], tokens=32)
    Faults.of(d.worker.transport.fabric).delay_transfers(50, endpoint=d.worker.transport.name)
    _start_load(d, "d1", params, [7, 8])
    run_until([p, d], lambda: d.worker.get_stats().gauges["loads_in_flight"] == 1)
    delay, _ = d.sched.request_finished(view("d1", 32, params, finish_reason="abort"), ((7, 8),))
    # Not delay_free: D sends nothing. The engine keeps an async load's blocks until the load
    # is reported stopped in finished_recving (and never in finished_sending).
    assert delay is False
    run_until([p, d], lambda: _ended(d, "d1", "finished_recving"))
    assert not _ended(d, "d1")
    assert not any(o.invalid_block_ids for o in d.outputs)
    run_until([p, d], lambda: _ended(p, "r1"))
    assert not d.sched.has_pending_work()
    assert not p.sched.has_pending_work()


def test_unread_lease_expires_and_is_reported_once() -> None:
    p = Driver("Pexp", "kv_producer", lease=0.3)
    try:
        prefill(p, "r1", [3], tokens=16)
        run_until([p], lambda: _ended(p, "r1"), timeout=3.0)
        assert sum("r1" in o.finished_sending for o in p.outputs) == 1
        assert not p.sched.has_pending_work()
    finally:
        p.shutdown()


def test_heartbeats_keep_a_queued_request_alive_for_three_durations() -> None:
    # A 1 s lease (heartbeat every 0.17 s, extension 0.67 s): short, yet longer than a full
    # garbage collection of the suite's long-lived process, which stops every thread at once.
    gc.collect()
    p = Driver("Phb", "kv_producer", lease=1.0)
    d = Driver("Dhb", "kv_consumer", lease=1.0)
    try:
        params = prefill(p, "r1", [3, 4], tokens=32)
        req = view("d1", 32, params)
        d.sched.on_new_request(req)  # waiting in the queue; heartbeats start now
        import time as _t

        t0 = _t.monotonic()
        run_until([p, d], lambda: _t.monotonic() - t0 > 3.0, timeout=8)
        assert not _ended(p, "r1"), (
            "P freed the blocks while D was heartbeating",
            p.worker.get_stats(),
            d.worker.get_stats(),
        )
        n, _ = d.sched.get_num_new_matched_tokens(req, 0)
        d.sched.update_state_after_alloc(req, ((7, 8),), n)
        run_until([p, d], lambda: _ended(d, "d1", "finished_recving"))
        assert not any(o.invalid_block_ids for o in d.outputs)
        for a, b in zip(p.blocks([3, 4]), d.blocks([7, 8]), strict=True):
            assert torch.equal(a, b)
    finally:
        d.shutdown()
        p.shutdown()


def test_failed_transfer_reports_every_block_invalid(pd: tuple[Driver, Driver]) -> None:
    p, d = pd
    params = prefill(p, "r1", [3, 4, 5], tokens=48)
    Faults.of(d.worker.transport.fabric).fail_transfers(
        endpoint=d.worker.transport.name, written=0.5
    )
    _start_load(d, "d1", params, [7, 8, 9])
    run_until([p, d], lambda: _ended(d, "d1", "finished_recving"))
    invalid = set().union(*(o.invalid_block_ids for o in d.outputs))
    assert invalid == {7, 8, 9}
    failures = {k: v for o in d.outputs for k, v in o.failures.items()}
    assert "transfer failed" in failures["d1"]
    # D released the lease, so P frees without waiting for expiry
    run_until([p, d], lambda: _ended(p, "r1"), timeout=2.0)


def test_expired_lease_is_never_read(pd: tuple[Driver, Driver]) -> None:
    _, d = pd
    p2 = Driver("Pshort", "kv_producer", lease=0.2)
    try:
        params = prefill(p2, "r1", [3], tokens=16)
        run_until([p2], lambda: _ended(p2, "r1"), timeout=3)  # expired, reclaimed
        _start_load(d, "d1", params, [7])
        run_until([p2, d], lambda: _ended(d, "d1", "finished_recving"), timeout=5)
        assert set().union(*(o.invalid_block_ids for o in d.outputs)) == {7}
        reason = next(o.failures["d1"] for o in d.outputs if "d1" in o.failures)
        assert "expired" in reason or "lease" in reason
        reads = sum(o.stats.counters.get("loads_done", 0) for o in d.outputs)
        assert reads == 0
    finally:
        p2.shutdown()


def test_forged_and_malformed_notifications_are_counted_not_fatal(
    pd: tuple[Driver, Driver],
) -> None:
    from kvframe.core import wire
    from kvframe.core.lease import lease_handle

    p, d = pd
    params = prefill(p, "r1", [3], tokens=16)
    p.step()
    # D's transport talks to P directly: garbage, a forged completion, a forged heartbeat
    _start_load(d, "dx", params, [5])
    run_until([p, d], lambda: _ended(d, "dx", "finished_recving"))
    t = d.worker.transport
    peer = p.worker.transport.name
    t.send_notification(peer, b"\x00garbage")
    forged = wire.LeaseDone(
        seq=1, sent_at=0.0, reason=wire.DoneReason.READ, handles=[lease_handle("nope~0000")]
    )
    t.send_notification(peer, wire.encode(forged))
    beat = wire.Heartbeat(seq=9, sent_at=0.0, handles=[lease_handle("x")])
    t.send_notification(peer, wire.encode(beat))
    for _ in range(5):
        p.step()
        d.step()
    counters: dict[str, float] = {}
    for o in p.outputs:
        for k, v in o.stats.counters.items():
            counters[k] = counters.get(k, 0) + v
    assert counters.get("notifications_rejected", 0) == 1
    assert counters.get("done_for_unknown_lease", 0) == 1
    assert counters.get("heartbeat_ids_ignored", 0) >= 1


def test_bad_params_fall_back_to_local_prefill(pd: tuple[Driver, Driver]) -> None:
    _, d = pd
    bad = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_block_ids": "x"}
    req = view("d1", 32, bad)
    d.sched.on_new_request(req)
    assert d.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert d.sched.get_num_new_matched_tokens(req, 0) == (0, False)  # the engine asks again
    events = d.sched.take_events()
    assert [e.kind for e in events] == ["pd.bad_params"]  # once per request, however often asked
    assert "kv_transfer_params" in events[0].data["error"]
    assert d.sched.get_stats().counters["bad_params"] == 1
    assert not d.sched.has_pending_work()


def test_unreachable_prefill_engine_fails_the_load(pd: tuple[Driver, Driver]) -> None:
    p, _ = pd
    params = dict(prefill(p, "r1", [3], tokens=16))
    params["remote_port"] = 1  # nobody listens there
    params.pop("remote_ports", None)
    d2 = Driver("Dfast", "kv_consumer", extra={"handshake_timeout": 0.3})
    try:
        _start_load(d2, "d1", params, [5])
        run_until([d2], lambda: _ended(d2, "d1", "finished_recving"), timeout=5)
        reason = next(o.failures["d1"] for o in d2.outputs if "d1" in o.failures)
        assert "handshake" in reason
    finally:
        d2.shutdown()


def test_p_without_its_workers_ports_frees_at_once_and_gives_no_ticket() -> None:
    """side_channel_port 0 and an engine that never forwarded the workers' handshake metadata:
    P cannot say where D should connect. request_finished must not raise (it runs inside the
    engine's step): the blocks are freed now and the router gets no ticket."""
    from kvframe.config import KVTransferConfig
    from kvframe.connectors.pd import PDConnector
    from kvframe.runtime.plugins import PluginHost
    from kvframe.spi.connector import BuildContext, EngineInfo

    host = PluginHost()
    host.load()
    config = KVTransferConfig.from_dict(
        {
            "kv_connector": "PDConnector",
            "kv_role": "kv_producer",
            "engine_id": "Pnoports",
            "kv_connector_extra_config": {"transport": "inprocess"},
        }
    )
    sched = PDConnector.build_scheduler(config, EngineInfo(block_size=16), BuildContext(host=host))
    delay, params = sched.request_finished(
        view("r", 16, {"do_remote_decode": True}, finish_reason="length"), ((1,),)
    )
    assert (delay, params) == (False, None)
    (event,) = sched.take_events()
    assert event.kind == "pd.not_kept"
    assert "side_channel_port" in event.data["error"]
    assert not sched.has_pending_work()


def test_worker_handshake_metadata_is_a_codec_message_and_garbage_is_refused() -> None:
    from kvframe.config import KVTransferConfig
    from kvframe.connectors.pd import PDConnector
    from kvframe.connectors.pd.metadata import PDWorkerAddress
    from kvframe.errors import ConfigError
    from kvframe.runtime.plugins import PluginHost
    from kvframe.spi.connector import BuildContext, EngineInfo, codec_for

    p = Driver("Phsmeta", "kv_producer")
    try:
        blob = p.worker.get_handshake_metadata()
        assert blob is not None
        address = codec_for(PDConnector, p.config).decode_as(blob, PDWorkerAddress)
        assert address.incarnation == p.worker.incarnation
        host = PluginHost()
        host.load()
        config = KVTransferConfig.from_dict(
            {"kv_connector": "PDConnector", "kv_role": "kv_producer", "engine_id": "Pgarbage"}
        )
        sched = PDConnector.build_scheduler(
            config, EngineInfo(block_size=16), BuildContext(host=host)
        )
        with pytest.raises(ConfigError, match="worker 1 sent malformed handshake metadata"):
            sched.set_xfer_handshake_metadata({1: b"\x81\xa4port\x01"})  # a bare msgpack map
    finally:
        p.shutdown()
