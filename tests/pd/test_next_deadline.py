"""``next_deadline()``: what each connector tells an idle engine about when to step again, and
how the reference engine turns it into a sleep (issue 10: engines stop spinning)."""

from __future__ import annotations

import math
from typing import Any

from kvframe.connectors.pd.metadata import PDMetadata
from kvframe.spi.connector import KVConnectorScheduler, SchedulerStep
from kvframe.testing.clock import FakeClock
from tests.pd.driver import Driver, view


class _Idle(KVConnectorScheduler):
    pending = False

    def get_num_new_matched_tokens(self, request: Any, n: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, n: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        raise NotImplementedError

    def has_pending_work(self) -> bool:
        return self.pending


def test_default_keeps_stepping_while_pending_and_has_no_deadline_otherwise() -> None:
    s = _Idle()
    assert s.next_deadline() is None
    s.pending = True
    assert s.next_deadline() == -math.inf


def test_p_holding_a_lease_must_step_at_once() -> None:
    p = Driver("Pnd", "kv_producer")
    try:
        assert p.sched.next_deadline() is None
        p.sched.request_finished(
            view("r", 16, {"do_remote_decode": True}, finish_reason="length"), ((1,),)
        )
        assert p.sched.has_pending_work()
        assert p.sched.next_deadline() == -math.inf  # heartbeats must be answered promptly
    finally:
        p.shutdown()


def test_d_with_only_queued_requests_sleeps_until_the_next_heartbeat() -> None:
    clock = FakeClock(100.0)
    p = Driver("Pnd2", "kv_producer", lease=6.0)
    d = Driver("Dnd2", "kv_consumer", lease=6.0, clock=clock)
    try:
        _, params = p.sched.request_finished(
            view("r", 32, {"do_remote_decode": True}, finish_reason="length"), ((1, 2),)
        )
        assert params is not None
        d.sched.on_new_request(view("q", 32, params, arrival_time=clock()))
        # The new lease is confirmed at once: the next step is due now.
        assert d.sched.next_deadline() == -math.inf
        meta = d.sched.build_connector_meta(SchedulerStep(step=0, now=clock()))
        assert d.codec.decode_as(d.codec.encode(meta), PDMetadata).pd_heartbeats
        # Then nothing is due before the next heartbeat batch, one interval (1 s) later.
        assert d.sched.next_deadline() == clock() + 1.0
        clock.advance(1.0)
        d.sched.build_connector_meta(SchedulerStep(step=1, now=clock()))
        assert d.sched.next_deadline() == clock() + 1.0
    finally:
        d.shutdown()
        p.shutdown()


def test_reference_engine_sleeps_only_as_the_connector_allows() -> None:
    from kvframe_refengine import Engine, EngineConfig, ModelConfig

    from kvframe.config import KVTransferConfig
    from kvframe.runtime.plugins import PluginHost

    host = PluginHost(autoload=False, env={})
    host.load()
    kv = KVTransferConfig.from_dict(
        {
            "kv_connector": "PDConnector",
            "kv_role": "kv_producer",
            "engine_id": "Pidle",
            "kv_connector_extra_config": {"transport": "inprocess"},
        }
    )
    engine = Engine(EngineConfig(model=ModelConfig(seed=1), block_size=8), kv, plugin_host=host)
    try:
        assert engine.idle_wait() is None  # nothing at all: sleep until a request arrives
        engine.add_request("r", list(range(1, 20)), 1, {"do_remote_decode": True})
        while not any(o.finished for o in engine.step()):
            pass
        engine.step()
        assert engine.has_unfinished_work()  # P holds the lease
        assert engine.idle_wait() == engine.config.idle_sleep_s  # keep stepping, at idle pace
    finally:
        engine.shutdown()


def test_multi_connector_takes_the_earliest_child_deadline() -> None:
    from kvframe.connectors.multi import MultiConnectorScheduler
    from kvframe.protocol.codec import DEFAULT_CODEC

    class _Timed(_Idle):
        at: float | None = None

        def next_deadline(self) -> float | None:
            return self.at if self.pending else None

    a, b = _Timed(), _Timed()
    multi = MultiConnectorScheduler(["a", "b"], [a, b], [DEFAULT_CODEC, DEFAULT_CODEC], 1)
    assert multi.next_deadline() is None
    a.pending, a.at = True, 50.0
    b.pending, b.at = True, 20.0
    assert multi.next_deadline() == 20.0
    b.pending = False
    assert multi.next_deadline() == 50.0
