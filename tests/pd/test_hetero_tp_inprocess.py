"""Heterogeneous tensor parallelism at the worker level, over the in-process transport: every
rank of both engines in this process (the bench's harness, ``kvframe.bench.transfer_tp``),
so a failure can be injected into one source of a split read.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from kvframe.bench.transfer_tp import BLOCK_TOKENS, _TPEngine
from kvframe.core.lease import LeaseState

HEADS = 4
DIM = 8
NUM_BLOCKS = 8


def _pair(p_tp: int, d_tp: int, tag: str) -> tuple[_TPEngine, _TPEngine, np.ndarray]:
    p = _TPEngine(
        "kv_producer", p_tp, DIM, NUM_BLOCKS, f"P{tag}", transport="inprocess", heads=HEADS
    )
    d = _TPEngine(
        "kv_consumer", d_tp, DIM, NUM_BLOCKS, f"D{tag}", transport="inprocess", heads=HEADS
    )
    whole = (
        np.random.default_rng(1)
        .standard_normal((NUM_BLOCKS, 2, BLOCK_TOKENS, HEADS, DIM))
        .astype(np.float32)
    )
    p.fill(whole)
    return p, d, whole


def _until(engines: list[_TPEngine], cond: Callable[[], bool], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        for e in engines:
            e.step()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2), (4, 2), (2, 4)])
def test_split_reads_move_each_ranks_heads(p_tp: int, d_tp: int) -> None:
    p, d, whole = _pair(p_tp, d_tp, f"ok{p_tp}{d_tp}")
    try:
        params = p.grant("r", [1, 2, 3])
        p.step()
        d.schedule("d", params, [5, 6, 7])
        _until([d, p], lambda: "d" in d.recving)
        assert d.failures == {}
        for r, cache in enumerate(d.caches):
            assert np.array_equal(cache.numpy()[[5, 6, 7]], whole[[1, 2, 3]][:, :, :, d.heads[r]])
        _until([p, d], lambda: "r" in p.sending)  # every P rank ended its lease
        for w in p.workers:
            assert w.holder.live_count == 0
    finally:
        d.close()
        p.close()


def test_one_lost_source_fails_the_request_after_the_other_stopped() -> None:
    """P2 -> D1: D's one rank reads from P rank 0 and P rank 1. P rank 1 aborts its lease
    before D reads: the load from it ends on the loss notice; the load from P rank 0 either
    completed already or is stopped (its lease then released): either way P rank 0's lease
    ends by D's report, not by expiry, and the request is reported once, failed, with every
    block invalid."""
    p, d, _ = _pair(2, 1, "lost")
    try:
        params = p.grant("r", [1, 2])
        p.step()
        lease_id = params["remote_request_id"]
        ended = p.workers[1].holder.abort(lease_id, time.monotonic()).ended
        assert [x.state for x in ended] == [LeaseState.ABORTED]
        d.schedule("d", params, [4, 5])
        _until([d, p], lambda: "d" in d.recving)
        assert "d" in d.failures
        assert d.invalid == {4, 5}
        assert len(d.workers[0].reader) == 0  # both per-source loads ended
        # P rank 0's lease ended by D's report (read, or released by the stopped load).
        _until([p, d], lambda: p.workers[0].holder.live_count == 0, seconds=3.0)
        assert p.workers[0].holder.table.state(lease_id) in (
            LeaseState.CONSUMED,
            LeaseState.ABORTED,
        )
    finally:
        d.close()
        p.close()


def test_a_prefill_rank_frees_only_after_both_decode_ranks_reported() -> None:
    """P1 -> D2: both D ranks read from P's one rank (a reader group of two). D rank 1's
    notifications are held back until D rank 0's done notice reached P: the lease stays live
    and P frees nothing, however long P steps alone; once D rank 1's reach P too, the lease is
    consumed and P frees it."""
    p, d, _ = _pair(1, 2, "group")
    try:
        # D rank 1 may read and send its done notice in the step that hands it the load (its
        # READ can complete inside the post): hold everything it sends until released.
        rank1 = d.workers[1].transport
        held: list[tuple[str, bytes]] = []
        send = rank1.send_notification
        rank1.send_notification = lambda peer, payload: held.append((peer, payload))  # type: ignore[method-assign]
        params = p.grant("r", [1])
        p.step()
        lease_id = params["remote_request_id"]
        d.schedule("d", params, [3])
        d.step()  # both D ranks have the load now
        holder = p.workers[0].holder
        deadline = time.monotonic() + 10
        while not holder.reported(lease_id):
            assert time.monotonic() < deadline, "D rank 0's done notice never reached P"
            d.workers[0].progress()
            p.step()
        assert holder.reported(lease_id) == (0,)
        for _ in range(50):
            p.step()
        assert holder.table.state(lease_id) is LeaseState.LIVE
        assert "r" not in p.sending
        rank1.send_notification = send  # type: ignore[method-assign]
        for peer, payload in held:
            send(peer, payload)
        _until([d, p], lambda: "d" in d.recving and "r" in p.sending)
        assert holder.table.state(lease_id) is LeaseState.CONSUMED
        assert d.failures == {}
    finally:
        d.close()
        p.close()
