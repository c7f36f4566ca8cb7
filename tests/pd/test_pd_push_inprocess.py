"""Push mode end to end in one process over the in-process transport: P writes into the
blocks D registered, in every order of finish and registration, and every abort order."""

from __future__ import annotations

import itertools
import secrets
from typing import Any

import pytest
import torch

from tests.pd.driver import Driver, run_until, view

_ids = itertools.count()


@pytest.fixture
def pd() -> Any:
    n = next(_ids)
    p = Driver(f"P{n}", "kv_producer")
    d = Driver(f"D{n}", "kv_consumer")
    yield p, d
    d.shutdown()
    p.shutdown()


def legs(p: Driver) -> tuple[dict[str, Any], dict[str, Any]]:
    push_id = secrets.token_urlsafe(16)
    p_leg = {"do_remote_decode": True, "transfer_mode": "push", "push_id": push_id}
    d_leg = {
        "do_remote_prefill": True,
        "transfer_mode": "push",
        "push_id": push_id,
        **p.sched.kv_address(),
    }
    return p_leg, d_leg


def finish_p(
    p: Driver, rid: str, p_leg: dict[str, Any], blocks: list[int], n: int, fill: bool = True
) -> None:
    if fill:
        p.fill(blocks, seed=hash(rid) % 1000)
    delay, params = p.sched.request_finished(
        view(rid, n, p_leg, finish_reason="length"), (tuple(blocks),)
    )
    assert delay is True
    assert params == {"transfer_mode": "push", "push_id": p_leg["push_id"]}


def start_d(d: Driver, rid: str, d_leg: dict[str, Any], blocks: list[int], n: int) -> None:
    req = view(rid, n, d_leg)
    d.sched.on_new_request(req)
    k, is_async = d.sched.get_num_new_matched_tokens(req, 0)
    assert (k, is_async) == (n - 1, True)
    d.sched.update_state_after_alloc(req, (tuple(blocks),), k)


def counter(drv: Driver, name: str) -> float:
    """A worker counter summed over every step's output."""
    return sum(o.stats.counters.get(name, 0) for o in drv.outputs)


def ended(drv: Driver, rid: str, field: str) -> bool:
    return any(rid in getattr(o, field) for o in drv.outputs)


def both_done(p: Driver, d: Driver, prid: str, drid: str) -> None:
    run_until(
        [p, d],
        lambda: ended(d, drid, "finished_recving") and ended(p, prid, "finished_sending"),
    )
    assert not p.sched.has_pending_work()
    assert not d.sched.has_pending_work()
    assert p.worker.holder.live_count == 0
    assert d.worker.holder.live_count == 0


@pytest.mark.parametrize("order", ["p_first", "d_first"])
def test_push_lands_exact_bytes_in_either_order(pd: Any, order: str) -> None:
    p, d = pd
    p_leg, d_leg = legs(p)
    if order == "p_first":
        finish_p(p, "r1", p_leg, [3, 4, 5, 6], 60)
        p.step()
        start_d(d, "d1", d_leg, [10, 11, 12, 13], 60)
    else:
        start_d(d, "d1", d_leg, [10, 11, 12, 13], 60)
        run_until([p, d], lambda: len(p.worker.push_source) == 1)
        finish_p(p, "r1", p_leg, [3, 4, 5, 6], 60)
    both_done(p, d, "r1", "d1")
    assert not any(o.invalid_block_ids for o in d.outputs)
    for a, b in zip(p.blocks([3, 4, 5, 6]), d.blocks([10, 11, 12, 13]), strict=True):
        assert torch.equal(a, b)


def step_p_layerwise(p: Driver, rid: str, blocks: list[int], computed: int, new: bool) -> None:
    """One P engine step that computes ``rid`` up to ``computed`` tokens, calling
    ``save_kv_layer`` per layer as an engine does (the driver's plain step does not)."""
    from kvframe.protocol.messages import ConnectorMetadata
    from kvframe.spi.connector import SchedulerStep

    step = SchedulerStep(
        step=p.step_no,
        now=p.clock(),
        new_requests={rid: computed} if new else {},
        cached_requests={} if new else {rid: computed},
        new_block_ids={rid: (tuple(blocks),)},
        num_computed_tokens={rid: computed},
    )
    p.step_no += 1
    meta = p.sched.build_connector_meta(step)
    p.worker.bind_connector_metadata(p.codec.decode_as(p.codec.encode(meta), ConnectorMetadata))
    p.worker.start_load_kv(None)
    for name, t in p.kv.items():
        p.worker.save_kv_layer(name, t, None)
    out = p.worker.build_connector_worker_output()
    p.worker.clear_connector_metadata()
    p.sched.update_connector_output(out)
    p.outputs.append(out)


def test_layerwise_push_writes_layers_during_the_prefill() -> None:
    n = next(_ids)
    p = Driver(f"P{n}", "kv_producer", extra={"push_layerwise": True})
    d = Driver(f"D{n}", "kv_consumer")
    try:
        p_leg, d_leg = legs(p)
        start_d(d, "d1", d_leg, [10, 11, 12, 13], 60)
        req = view("r1", 60, p_leg)
        p.sched.on_new_request(req)
        run_until([p, d], lambda: len(p.worker.push_source) == 1)
        # the registration is confirmed before the prefill starts
        run_until(
            [p, d],
            lambda: p.worker.writer.confirmed_bound(*_reg(p, p_leg["push_id"])) > p.clock() + 1.2,
        )
        p.fill([3, 4, 5, 6], seed=5)
        step_p_layerwise(p, "r1", [3, 4], 32, new=True)  # chunk 1: blocks 3, 4 full
        step_p_layerwise(p, "r1", [5, 6], 60, new=False)  # chunk 2: the rest
        assert counter(p, "push_layer_writes") == 4  # 2 layers x 2 chunks
        finish_p(p, "r1", p_leg, [3, 4, 5, 6], 60, fill=False)
        both_done(p, d, "r1", "d1")
        assert not any(o.invalid_block_ids for o in d.outputs)
        for a, b in zip(p.blocks([3, 4, 5, 6]), d.blocks([10, 11, 12, 13]), strict=True):
            assert torch.equal(a, b)
    finally:
        d.shutdown()
        p.shutdown()


def _reg(p: Driver, push_id: str) -> tuple[str, str]:
    found = p.worker.push_source.registration(push_id)
    assert found is not None
    return found[0], found[1].lease_id


def failures(d: Driver, rid: str) -> list[str]:
    return [o.failures[rid] for o in d.outputs if rid in o.failures]


def test_d_abort_after_registration_revokes_and_frees_when_p_stops(pd: Any) -> None:
    p, d = pd
    p_leg, d_leg = legs(p)
    start_d(d, "d1", d_leg, [10, 11, 12, 13], 60)
    run_until([p, d], lambda: len(p.worker.push_source) == 1)
    d.fill([10, 11, 12, 13], seed=7)
    before = d.blocks([10, 11, 12, 13])
    d.sched.request_finished(view("d1", 60, d_leg, finish_reason="abort"), ((10, 11, 12, 13),))
    # D keeps the blocks until P says it stopped (its release), long before the lease expiry
    run_until([p, d], lambda: ended(d, "d1", "finished_recving"), timeout=2.0)
    assert len(p.worker.push_source) == 0
    finish_p(p, "r1", p_leg, [3, 4, 5, 6], 60)  # P's prefill finishes later: refused at once
    run_until([p, d], lambda: ended(p, "r1", "finished_sending"), timeout=2.0)
    for a, b in zip(before, d.blocks([10, 11, 12, 13]), strict=True):
        assert torch.equal(a, b)  # nothing was written
    assert not p.sched.has_pending_work()
    assert not d.sched.has_pending_work()
    assert d.worker.holder.live_count == 0


def test_p_abandons_its_request_and_d_fails_at_once(pd: Any) -> None:
    p, d = pd
    p_leg, d_leg = legs(p)
    start_d(d, "d1", d_leg, [10, 11, 12, 13], 60)
    run_until([p, d], lambda: len(p.worker.push_source) == 1)
    delay, _ = p.sched.request_finished(view("r1", 60, p_leg, finish_reason="abort"), ((3, 4),))
    assert delay is False
    run_until([p, d], lambda: ended(d, "d1", "finished_recving"), timeout=2.0)
    (why,) = failures(d, "d1")
    assert "abandoned" in why
    assert {10, 11, 12, 13} <= set().union(*(o.invalid_block_ids for o in d.outputs))
    assert d.worker.holder.live_count == 0
    assert not d.sched.has_pending_work()


def test_another_prompt_is_refused_and_both_sides_free(pd: Any) -> None:
    p, d = pd
    p_leg, d_leg = legs(p)
    req = view("d1", 60, d_leg, prompt_token_ids=list(range(100, 160)))
    d.sched.on_new_request(req)
    k, _ = d.sched.get_num_new_matched_tokens(req, 0)
    d.sched.update_state_after_alloc(req, ((10, 11, 12, 13),), k)
    finish_p(p, "r1", p_leg, [3, 4, 5, 6], 60)
    both_done(p, d, "r1", "d1")
    (why,) = failures(d, "d1")
    assert "another prompt" in why
    assert counter(p, "pushes_done") == 0


def test_a_push_id_is_single_use(pd: Any) -> None:
    p, d = pd
    p_leg, d_leg = legs(p)
    finish_p(p, "r1", p_leg, [3, 4, 5, 6], 60)
    start_d(d, "d1", d_leg, [10, 11, 12, 13], 60)
    both_done(p, d, "r1", "d1")
    start_d(d, "d2", d_leg, [20, 21, 22, 23], 60)  # a router retry of the same legs
    run_until([p, d], lambda: ended(d, "d2", "finished_recving"), timeout=2.0)
    (why,) = failures(d, "d2")
    assert "single-use" in why


def test_no_prefill_ever_comes_then_d_is_refused_within_the_wait(pd: Any) -> None:
    p, d = pd
    _, d_leg = legs(p)
    start_d(d, "d1", d_leg, [10, 11, 12, 13], 60)
    t0 = d.clock()
    run_until([p, d], lambda: ended(d, "d1", "finished_recving"), timeout=6.0)
    # P waits kv_lease_duration (3 s here) for its prefill, then refuses
    assert 2.5 < d.clock() - t0 < 4.5
    (why,) = failures(d, "d1")
    assert "no request with this push id" in why
    assert d.worker.holder.live_count == 0


def test_no_registration_ever_comes_then_p_frees_within_the_wait(pd: Any) -> None:
    p, d = pd
    p_leg, _ = legs(p)
    finish_p(p, "r1", p_leg, [3, 4, 5, 6], 60)
    t0 = p.clock()
    run_until([p, d], lambda: ended(p, "r1", "finished_sending"), timeout=6.0)
    assert 2.5 < p.clock() - t0 < 4.5
    assert counter(p, "push_unsent") == 1
    assert not p.sched.has_pending_work()


def test_d_gone_after_registering_then_p_frees_within_its_bound(pd: Any) -> None:
    p, d = pd
    p_leg, d_leg = legs(p)
    start_d(d, "d1", d_leg, [10, 11, 12, 13], 60)
    run_until([p, d], lambda: len(p.worker.push_source) == 1)
    d.worker.shutdown()  # D's transport is gone: nothing answers P any more
    finish_p(p, "r1", p_leg, [3, 4, 5, 6], 60)
    t0 = p.clock()
    run_until([p], lambda: ended(p, "r1", "finished_sending"), timeout=12.0)
    # bound: the writer's confirmation wait, one extension (2 s for a 3 s lease), plus margin
    assert p.clock() - t0 < 4.0
    assert not p.sched.has_pending_work()
