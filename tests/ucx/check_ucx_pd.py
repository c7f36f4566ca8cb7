"""The P/D connector's in-process driver flow (tests/pd/driver.py) over the ``ucx`` transport:
both engines in one process, each with its own UCX context and worker, KV moved by the
two-sided READ that P serves from its own steps."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("ucxx", reason="the UCX tests need ucxx-cu12 (./dev installs it)")
pytest.importorskip("kvframe_ucx", reason="install plugins/kvframe-ucx (./dev does)")

from tests.pd.driver import Driver, run_until, view

pytestmark = pytest.mark.ucx

_ids = itertools.count()


@pytest.fixture
def pd() -> Iterator[tuple[Driver, Driver]]:
    n = next(_ids)
    p = Driver(f"Pucx{n}", "kv_producer", transport="ucx")
    d = Driver(f"Ducx{n}", "kv_consumer", transport="ucx")
    yield p, d
    d.shutdown()
    p.shutdown()


def _prefill(p: Driver, rid: str, blocks: list[int], tokens: int, seed: int) -> dict:
    p.fill(blocks, seed=seed)
    delay, params = p.sched.request_finished(
        view(rid, tokens, {"do_remote_decode": True}, finish_reason="length"), (tuple(blocks),)
    )
    assert delay is True
    assert params is not None
    return params


def _load(d: Driver, rid: str, params: dict, blocks: list[int], computed: int = 0) -> int:
    req = view(rid, params["remote_num_tokens"], params, num_computed_tokens=computed)
    d.sched.on_new_request(req)
    n, is_async = d.sched.get_num_new_matched_tokens(req, computed)
    assert is_async is (n > 0)
    if n:
        d.sched.update_state_after_alloc(req, (tuple(blocks),), n)
    return n


def _ended(drv: Driver, rid: str, field: str) -> bool:
    return any(rid in getattr(o, field) for o in drv.outputs)


def test_happy_path_over_ucx_moves_exact_bytes_and_frees_p(pd: tuple[Driver, Driver]) -> None:
    p, d = pd
    params = _prefill(p, "r1", [3, 4, 5, 6], tokens=60, seed=7)
    p.step()
    assert _load(d, "d1", params, [10, 11, 12, 13]) == 59
    run_until([p, d], lambda: _ended(d, "d1", "finished_recving"))
    assert not any(o.invalid_block_ids for o in d.outputs)
    for a, b in zip(p.blocks([3, 4, 5, 6]), d.blocks([10, 11, 12, 13]), strict=True):
        assert torch.equal(a, b)
    run_until([p, d], lambda: _ended(p, "r1", "finished_sending"))
    assert not p.sched.has_pending_work()
    assert not d.sched.has_pending_work()


def test_two_requests_and_a_partial_prefix_over_ucx(pd: tuple[Driver, Driver]) -> None:
    p, d = pd
    params1 = _prefill(p, "r1", [1, 2, 3, 4], tokens=64, seed=1)
    params2 = _prefill(p, "r2", [7, 8], tokens=32, seed=2)
    d.fill([20, 21], seed=99)
    before = d.blocks([20, 21])
    assert _load(d, "d1", params1, [20, 21, 22, 23], computed=32) == 31
    assert _load(d, "d2", params2, [25, 26]) == 31
    run_until(
        [p, d],
        lambda: _ended(d, "d1", "finished_recving") and _ended(d, "d2", "finished_recving"),
    )
    for a, b in zip(before, d.blocks([20, 21]), strict=True):
        assert torch.equal(a, b)  # D's own prefix blocks are untouched
    for a, b in zip(p.blocks([3, 4]), d.blocks([22, 23]), strict=True):
        assert torch.equal(a, b)
    for a, b in zip(p.blocks([7, 8]), d.blocks([25, 26]), strict=True):
        assert torch.equal(a, b)
    run_until(
        [p, d],
        lambda: _ended(p, "r1", "finished_sending") and _ended(p, "r2", "finished_sending"),
    )
    assert not p.sched.has_pending_work()


def test_p_serves_a_reader_only_the_blocks_of_leases_it_claimed(
    pd: tuple[Driver, Driver],
) -> None:
    # Issue 16: UCX serves peers' requests itself, so P checks each one: a READ of blocks no
    # lease of this reader covers, or any WRITE, fails on the reader with no byte moved.
    from kvframe.errors import TransferFailedError
    from kvframe.spi.transport import Op, XferState

    p, d = pd
    params = _prefill(p, "r1", [3, 4], tokens=32, seed=5)
    p.step()
    assert _load(d, "d1", params, [10, 11]) == 31
    run_until([p, d], lambda: _ended(d, "d1", "finished_recving"))
    p.fill([0, 1], seed=9)  # another request's KV, under no lease of D's
    secret = p.blocks([0, 1])
    entry = d.worker._engines.find(p.config.engine_id)  # D's connection to P, as a fleet member
    assert entry is not None
    assert entry.remote is not None
    transport = d.worker.transport
    before = d.blocks([20, 21])
    for op, local, remote in ((Op.READ, [20, 21], [0, 1]), (Op.WRITE, [10, 11], [0, 1])):
        handle = transport.post(op, d.worker._local, local, entry.remote, remote)
        status = transport.poll(handle)
        run_until([p, d], lambda h=handle: transport.poll(h).state is not XferState.PENDING)
        status = transport.poll(handle)
        assert status.state is XferState.FAILED
        assert isinstance(status.error, TransferFailedError)
        assert "access refused" in str(status.error)
        transport.release(handle)
    for a, b in zip(secret, p.blocks([0, 1]), strict=True):
        assert torch.equal(a, b)  # nothing written into P
    for a, b in zip(before, d.blocks([20, 21]), strict=True):
        assert torch.equal(a, b)  # nothing of P's landed in D
    assert p.worker.transport.stats()["requests_refused"] == 2
    # D serves nobody either: P (a fleet member) can neither READ nor WRITE D's blocks.
    back = p.worker._reader_peers[(d.config.engine_id, 0)]
    remote_d = p.worker.transport.prepare_remote(back, d.worker._layout)
    for op in (Op.READ, Op.WRITE):
        handle = p.worker.transport.post(op, p.worker._local, [0], remote_d, [20])
        run_until(
            [p, d], lambda h=handle: p.worker.transport.poll(h).state is not XferState.PENDING
        )
        assert p.worker.transport.poll(handle).state is XferState.FAILED
        p.worker.transport.release(handle)
    assert d.worker.transport.stats()["requests_refused"] == 2
