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


def finish_p(p: Driver, rid: str, p_leg: dict[str, Any], blocks: list[int], n: int) -> None:
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
