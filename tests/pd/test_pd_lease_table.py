"""The lease table in the P/D workers (in-process transport, fake clock): P enters a pull
lease's tag when its worker applies the grant and clears it when the lease ends, whichever
way, before ``finished_sending`` reports the blocks; D ends a load whose READ landed before
P's acknowledgement as soon as its READ of the table finds the tag."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvframe.core.lease import lease_handle
from kvframe.core.slots import ENTRY_BYTES, slot_of, slot_tag
from kvframe.testing.clock import FakeClock
from kvframe.testing.faults import Faults
from tests.pd.driver import Driver
from tests.pd.test_pd_fake_clock import LEASE, _arrive, _ended, _prefill, _schedule, _steps


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(2000.0)


def _pair(clock: FakeClock, **extra: object) -> tuple[Driver, Driver]:
    p = Driver(f"Plt{id(clock)}", "kv_producer", lease=LEASE, clock=clock, extra=dict(extra))
    d = Driver(f"Dlt{id(clock)}", "kv_consumer", lease=LEASE, clock=clock)
    return p, d


@pytest.fixture
def pd(clock: FakeClock) -> Iterator[tuple[Driver, Driver]]:
    p, d = _pair(clock)
    yield p, d
    d.shutdown()
    p.shutdown()


def _counter(drv: Driver, name: str) -> float:
    return sum(o.stats.counters.get(name, 0) for o in drv.outputs)


def _table(p: Driver) -> np.ndarray:
    table = p.worker._slot_table  # type: ignore[attr-defined]
    assert table is not None
    return table


def _entered(p: Driver, lease_id: str) -> bool:
    table = _table(p)
    tag = slot_tag(lease_handle(lease_id))
    return int(table[slot_of(tag, len(table))]) == tag


def test_a_load_is_proven_by_the_table_and_p_clears_the_entry_when_it_ends(
    pd: tuple[Driver, Driver], clock: FakeClock
) -> None:
    p, d = pd
    params = _prefill(p, "r", [1, 2])
    lease_id = params["remote_request_id"]
    assert _entered(p, lease_id)  # from the step that applied the grant
    assert np.count_nonzero(_table(p)) == 1
    _arrive(d, "q", params, clock)
    _schedule(d, "q", params, [5, 6])
    _steps([d], lambda: _ended(d, "q", "finished_recving"))  # P does not step meanwhile
    assert not any(o.failures for o in d.outputs)
    assert _counter(d, "reads_proven_by_table") == 1
    assert _counter(d, "acks") == 0  # done before P answered anything
    for a, b in zip(p.blocks([1, 2]), d.blocks([5, 6]), strict=True):
        assert np.array_equal(a.numpy(), b.numpy())
    _steps([p, d], lambda: _ended(p, "r", "finished_sending"))
    assert not _table(p).any()


def test_an_expired_lease_leaves_the_table_in_the_step_that_reclaims_it(
    pd: tuple[Driver, Driver], clock: FakeClock
) -> None:
    p, _ = pd
    params = _prefill(p, "r", [1])
    assert _entered(p, params["remote_request_id"])
    clock.advance(LEASE - 0.001)
    p.step()
    assert _entered(p, params["remote_request_id"])
    clock.advance(0.002)
    p.step()
    assert _ended(p, "r", "finished_sending")
    assert not _table(p).any()


def test_a_prefill_engine_without_a_table_leaves_its_decoders_to_the_acknowledgement(
    clock: FakeClock,
) -> None:
    p, d = _pair(clock, lease_table_slots=0)
    try:
        assert p.worker._slot_table is None  # type: ignore[attr-defined]
        params = _prefill(p, "r", [1])
        _arrive(d, "q", params, clock)
        _schedule(d, "q", params, [5])
        _steps([d, p], lambda: _ended(d, "q", "finished_recving"))
        assert not any(o.failures for o in d.outputs)
        assert _counter(d, "lease_checks_posted") == 0
        assert _counter(d, "acks") >= 1
    finally:
        d.shutdown()
        p.shutdown()


def test_a_check_outrun_by_ps_acknowledgement_is_counted_unused(
    pd: tuple[Driver, Driver], clock: FakeClock
) -> None:
    """The table READ is held back (an 8-byte READ of D's, delayed far beyond the test), so P's
    acknowledgement ends the load first: the load is done, and the pending check is dropped
    and counted once, as unused. Every posted check ends counted once: proven, unproven,
    failed or unused."""
    p, d = pd
    Faults.of(d.worker.transport.fabric).delay_transfers(
        10**9, endpoint=d.worker.transport.name, when=lambda e: e.nbytes == ENTRY_BYTES
    )
    params = _prefill(p, "r", [1, 2])
    _arrive(d, "q", params, clock)
    _schedule(d, "q", params, [5, 6])
    _steps([d, p], lambda: _ended(d, "q", "finished_recving"))
    assert not any(o.failures for o in d.outputs)
    for a, b in zip(p.blocks([1, 2]), d.blocks([5, 6]), strict=True):
        assert np.array_equal(a.numpy(), b.numpy())
    assert _counter(d, "lease_checks_posted") == 1
    assert _counter(d, "reads_proven_by_table") == 0
    assert _counter(d, "acks") >= 1
    ends = ("reads_proven_by_table", "lease_checks_unproven", "lease_check_failures")
    assert sum(_counter(d, name) for name in ends) == 0
    assert _counter(d, "lease_checks_unused") == 1
