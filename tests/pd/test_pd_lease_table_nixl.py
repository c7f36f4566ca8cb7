"""The lease table through real NIXL: D proves a lease by READing P's table, in the step its
bytes landed, without waiting for P's acknowledgement (``kvframe.core.slots``).

D runs in this process (the benchmark's minimal engine around the P/D connector), P in the
benchmark's child process, which makes progress every 0.5 ms.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import numpy as np
import pytest

pytest.importorskip("nixl_cu12", reason="the NIXL transport needs nixl-cu12")

from kvframe.bench import transfer as bench
from kvframe.spi.transport import BlockLayout, MemoryRegion
from tests.pd.nixl_bench_env import BLOCK, POOL, bench_env

pytestmark = pytest.mark.nixl


@pytest.fixture(scope="module")
def env() -> Iterator[bench.BenchEnv]:
    with bench_env(BLOCK, POOL) as e:
        yield e


def _method(env: bench.BenchEnv, **extra: object) -> bench._PDConnectorMethod:
    method = bench._PDConnectorMethod(env)
    if extra:
        # The same engine as setup() builds, with D's options changed.
        env.child.call(None, "pd_setup", block_size=BLOCK, num_blocks=POOL // BLOCK)
        method.engine = bench._PDEngine(
            "kv_consumer",
            env.memory.tensor(env.pool),
            BLOCK,
            POOL // BLOCK,
            name="-table",
            extra=dict(extra),
        )
    else:
        method.setup(BLOCK, POOL // BLOCK)
    return method


def _loads(method: bench._PDConnectorMethod, env: bench.BenchEnv, n: int) -> list[int]:
    """``n`` loads of two blocks each, one after the other; every byte checked against P's
    pool. Returns the engine steps each took."""
    engine = method.engine
    assert engine is not None
    source = bench._p_content(POOL).reshape(-1, BLOCK)
    mine = env.pool[:POOL].reshape(-1, BLOCK)
    steps = []
    for i in range(n):
        dst, src = np.array([2 * i, 2 * i + 1]), np.array([100 + 3 * i, 101 + 3 * i])
        mine[dst] = 0
        method.prepare(dst, src)
        before = engine.n
        method.run_once(dst, src)
        steps.append(engine.n - before)
        assert np.array_equal(mine[dst], source[src]), f"load {i}: D's blocks differ from P's"
    return steps


def test_a_load_is_proven_by_ps_lease_table_in_the_step_its_bytes_land(
    env: bench.BenchEnv,
) -> None:
    """P holds each lease from before D reads (the benchmark's P applies the grant first, as
    an engine's P does while its answer travels through the router). D's optimistic READ
    lands inside its post, the READ of P's table that follows finds the lease's tag, and the
    load ends in the step that posted it: one engine step per load, where waiting for P's
    acknowledgement took several. A table READ that does not complete inside its post (a busy
    machine) may find the lease already consumed by the done notice that follows it: that
    load waits for the acknowledgement instead, so a few may."""
    method = _method(env)
    try:
        steps = _loads(method, env, 12)
        engine = method.engine
        assert engine is not None
        c = engine.counters
        assert c.get("lease_checks_posted", 0) == 12
        proven = c.get("reads_proven_by_table", 0)
        # Every posted check ends counted once: proven, unproven, failed, or unused (its load
        # ended first, P's acknowledgement having come before the check's answer).
        ends = ("lease_checks_unproven", "lease_check_failures", "lease_checks_unused")
        assert proven + sum(c.get(name, 0) for name in ends) == 12, c
        assert proven >= 9, c
        assert c.get("loads_done", 0) == 12
        assert sorted(steps)[len(steps) // 2] == 1, steps
    finally:
        method.close()


def test_a_decoder_with_the_table_off_waits_for_the_acknowledgement(
    env: bench.BenchEnv,
) -> None:
    method = _method(env, lease_table_slots=0)
    try:
        _loads(method, env, 4)
        engine = method.engine
        assert engine is not None
        c = engine.counters
        assert "lease_checks_posted" not in c
        assert "reads_proven_by_table" not in c
        assert c.get("loads_done", 0) == 4
    finally:
        method.close()


@pytest.mark.parametrize(
    "bad",
    [
        {"block_lens": [16]},  # not 8-byte entries
        {"num_blocks": 3},  # not a power of two
        {"regions": 2},
    ],
    ids=["entry_size", "slots", "regions"],
)
def test_a_lease_table_of_another_shape_is_ignored(
    env: bench.BenchEnv, bad: dict[str, object]
) -> None:
    """A prefill engine that advertises a table D cannot use (another version, or a hostile
    one) only loses the shortcut: D reads none of it, and its loads wait for the
    acknowledgement."""
    method = _method(env)
    try:
        _loads(method, env, 1)  # the handshake is done
        engine = method.engine
        assert engine is not None
        worker = engine.worker
        region = MemoryRegion(addr=4096, length=1 << 20)
        table = BlockLayout(
            regions=[region] * (2 if bad.get("regions") else 1),
            block_lens=bad.get("block_lens", [8]) * (2 if bad.get("regions") else 1),
            num_blocks=int(bad.get("num_blocks", 1024)),  # type: ignore[call-overload]
        )
        for entry in worker._engines.entries():  # type: ignore[attr-defined]
            if entry.response is not None:
                entry.response = attrs.evolve(entry.response, lease_table=table)
        worker._tables.clear()  # type: ignore[attr-defined]
        posted = engine.counters.get("lease_checks_posted", 0)
        _loads(method, env, 3)
        c = engine.counters
        assert c.get("lease_checks_posted", 0) == posted
        assert c.get("lease_tables_refused", 0) >= 1
        assert c.get("loads_done", 0) == 4
    finally:
        method.close()
