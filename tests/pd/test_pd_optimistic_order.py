"""The order in which D's worker sends an optimistic load's messages and posts its READ.

An optimistic READ is posted *before* the heartbeat that asks P to confirm (and claim) its
lease, without its lease-done notification; that notification goes on its own once the READ
is seen done, after the heartbeat. Posted behind a notification, a NIXL READ completes only at
P's next progress point instead of inside the post; a done notice ahead of the heartbeat would
consume the lease before this reader claimed it, and P would answer the heartbeat with a loss.
A recording wrapper around D's transport pins that order; the load must still end DONE with
P's bytes and P's lease consumed. After a heartbeat batch naming a request that waits for its
load, D posts an endpoint flush READ (a few bytes into a scratch buffer), so that the READ of
that load, posted later, is not held behind the heartbeat.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvframe.core import wire
from kvframe.spi.transport import Transport
from kvframe.testing.faults import Faults
from tests.pd.driver import Driver, run_until, view

_ids = itertools.count()


FLUSH_BYTES = 64  # an endpoint flush READ's one block (kvframe.connectors.pd.worker)


def record(transport: Transport, monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Wrap ``transport``'s ``post`` and ``send_notification``: each call appends
    ``("post", notification bytes or None)`` (a KV READ), ``("flush", None)`` (an endpoint
    flush READ: one block of ``FLUSH_BYTES`` into the scratch layout), ``("table", None)`` (a
    READ of one 8-byte word of P's lease table) or ``("notify", decoded message)``, in call
    order."""
    log: list[tuple[Any, ...]] = []
    post, send = transport.post, transport.send_notification

    def posting(*args: Any, **kwargs: Any) -> Any:
        local = args[1]
        flush = local.layout.block_lens == (FLUSH_BYTES,) and local.layout.num_blocks == 1
        table = local.layout.block_lens == (8,)
        kind = "flush" if flush else "table" if table else "post"
        log.append((kind, kwargs.get("notification")))
        return post(*args, **kwargs)

    def sending(peer: str, payload: bytes) -> None:
        try:
            msg: Any = wire.decode(payload)
        except Exception:  # not a lease message (none expected here)
            msg = payload
        log.append(("notify", msg))
        send(peer, payload)

    monkeypatch.setattr(transport, "post", posting)
    monkeypatch.setattr(transport, "send_notification", sending)
    return log


@pytest.fixture
def pd() -> Iterator[tuple[Driver, Driver]]:
    n = next(_ids)
    p = Driver(f"Pord{n}", "kv_producer")
    d = Driver(f"Dord{n}", "kv_consumer")
    yield p, d
    d.shutdown()
    p.shutdown()


def _counter(drv: Driver, name: str) -> float:
    return sum(o.stats.counters.get(name, 0) for o in drv.outputs)


def test_the_optimistic_read_goes_before_its_heartbeat_and_its_done_notice_after(
    pd: tuple[Driver, Driver], monkeypatch: pytest.MonkeyPatch
) -> None:
    p, d = pd
    log = record(d.worker.transport, monkeypatch)
    for i, (src, dst) in enumerate((([3, 4], [10, 11]), ([5, 6], [12, 13]))):
        p.fill(src, seed=i)
        _, params = p.sched.request_finished(
            view(f"r{i}", 32, {"do_remote_decode": True}, finish_reason="length"), (tuple(src),)
        )
        assert params is not None
        p.step()
        rid = f"d{i}"
        req = view(rid, 32, params)
        d.sched.on_new_request(req)
        n, _ = d.sched.get_num_new_matched_tokens(req, 0)
        d.sched.update_state_after_alloc(req, (tuple(dst),), n)
        start = len(log)
        run_until([p, d], lambda rid=rid: any(rid in o.finished_recving for o in d.outputs))
        assert not any(o.failures for o in d.outputs)
        for a, b in zip(p.blocks(src), d.blocks(dst), strict=True):
            assert torch.equal(a, b)
        mine = log[start:]
        posts = [k for k, e in enumerate(mine) if e[0] == "post"]
        assert len(posts) == 1, mine
        assert mine[posts[0]][1] is None, "the READ must be posted without its done notice"
        beats = [k for k, e in enumerate(mine) if isinstance(e[1], wire.Heartbeat)]
        dones = [
            k
            for k, e in enumerate(mine)
            if isinstance(e[1], wire.LeaseDone) and e[1].reason is wire.DoneReason.READ
        ]
        assert beats, mine
        assert len(dones) == 1, mine
        assert posts[0] < beats[0] < dones[0], mine
        # The READ landed before P's acknowledgement: P's lease table is read, before the
        # done notice (which lets P end the lease and clear the slot).
        tables = [k for k, e in enumerate(mine) if e[0] == "table"]
        assert len(tables) <= 1, mine
        assert all(posts[0] < k < dones[0] for k in tables), mine
        # Every heartbeat named a lease being read: no flush READ (the load waits for P's
        # acknowledgement anyway).
        assert not any(e[0] == "flush" for e in mine), mine
    run_until([p, d], lambda: _counter(p, "leases_consumed") == 2)
    assert _counter(d, "reads_posted_early") == 2
    assert _counter(d, "endpoint_flushes") == 0
    assert _counter(p, "leases_aborted") == 0
    assert not d.sched.has_pending_work()


def _arrive_then_load(p: Driver, d: Driver, rid: str, src: list[int], dst: list[int]) -> None:
    """P prefills; the request arrives at D and waits (D steps: its scheduler heartbeats the
    lease at once, P answers); then D allocates and loads it, to the end."""
    p.fill(src, seed=len(rid))
    _, params = p.sched.request_finished(
        view(f"p{rid}", 16 * len(src), {"do_remote_decode": True}, finish_reason="length"),
        (tuple(src),),
    )
    assert params is not None
    p.step()
    req = view(rid, 16 * len(src), params)
    d.sched.on_new_request(req)
    for _ in range(5):
        p.step()
        d.step()
    n, _ = d.sched.get_num_new_matched_tokens(req, 0)
    d.sched.update_state_after_alloc(req, (tuple(dst),), n)
    run_until([p, d], lambda: any(rid in o.finished_recving for o in d.outputs))
    for a, b in zip(p.blocks(src), d.blocks(dst), strict=True):
        assert torch.equal(a, b)


def test_a_heartbeat_for_a_waiting_request_is_followed_by_a_flush_read(
    pd: tuple[Driver, Driver], monkeypatch: pytest.MonkeyPatch
) -> None:
    p, d = pd
    log = record(d.worker.transport, monkeypatch)
    _arrive_then_load(p, d, "w0", [3], [10])  # connects D to P
    start = len(log)
    _arrive_then_load(p, d, "w1", [4, 5], [11, 12])
    mine = log[start:]
    beats = [k for k, e in enumerate(mine) if isinstance(e[1], wire.Heartbeat)]
    flushes = [k for k, e in enumerate(mine) if e[0] == "flush"]
    posts = [k for k, e in enumerate(mine) if e[0] == "post"]
    assert beats, mine
    assert flushes, mine
    assert len(posts) == 1, mine
    assert beats[0] < flushes[0] < posts[0], mine  # the waiting request's heartbeat, flushed
    assert all(mine[k][1] is None for k in flushes)
    assert mine[posts[0]][1] is not None  # confirmed by then: posted with its notice
    assert not any(o.failures for o in d.outputs)
    assert _counter(d, "endpoint_flushes") >= 1
    assert _counter(d, "endpoint_flush_failures") == 0


def test_without_optimistic_reads_the_read_carries_its_notice_after_the_ack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    n = next(_ids)
    p = Driver(f"Pord{n}", "kv_producer")
    d = Driver(
        f"Dord{n}", "kv_consumer", extra={"optimistic_read": False, "flush_endpoints": False}
    )
    try:
        log = record(d.worker.transport, monkeypatch)
        p.fill([3], seed=1)
        _, params = p.sched.request_finished(
            view("r", 16, {"do_remote_decode": True}, finish_reason="length"), ((3,),)
        )
        assert params is not None
        p.step()
        req = view("d", 16, params)
        d.sched.on_new_request(req)
        k, _ = d.sched.get_num_new_matched_tokens(req, 0)
        d.sched.update_state_after_alloc(req, ((9,),), k)
        run_until([p, d], lambda: any("d" in o.finished_recving for o in d.outputs))
        posts = [k for k, e in enumerate(log) if e[0] == "post"]
        beats = [k for k, e in enumerate(log) if isinstance(e[1], wire.Heartbeat)]
        assert len(posts) == 1
        assert beats
        assert beats[0] < posts[0]
        assert log[posts[0]][1] is not None  # the transport delivers it after the data
        assert not any(isinstance(e[1], wire.LeaseDone) for e in log)
        assert not any(e[0] == "flush" for e in log)  # flush_endpoints off
    finally:
        d.shutdown()
        p.shutdown()


def test_a_failed_flush_read_is_counted_and_harms_no_load(pd: tuple[Driver, Driver]) -> None:
    # Every flush READ fails (it moves FLUSH_BYTES; the loads move whole blocks): each failure
    # is counted, the connection is flushed again after its next heartbeat for a waiting
    # request, and the loads are untouched.
    p, d = pd
    Faults.of(d.worker.transport.fabric).fail_transfers(
        endpoint=d.worker.transport.name, when=lambda e: e.nbytes == FLUSH_BYTES
    )
    for i, (src, dst) in enumerate((([3], [10]), ([4], [11]), ([5], [12]))):
        _arrive_then_load(p, d, f"d{i}", src, dst)
    run_until([p, d], lambda: _counter(d, "endpoint_flush_failures") >= 2)
    run_until([p, d], lambda: _counter(p, "leases_consumed") == 3)
    assert not any(o.failures for o in d.outputs)
