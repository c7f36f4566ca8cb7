"""The cold path through real NIXL across two processes: a new decoder's connection to P is
warmed during its handshake, and its first load then works like any later one.

D runs in this process (the benchmark's minimal engine around the P/D connector), P in the
benchmark's child process, which makes progress every 0.5 ms.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("nixl_cu12", reason="the NIXL transport needs nixl-cu12")

from kvframe.bench import transfer as bench
from tests.pd.nixl_bench_env import BLOCK, POOL, bench_env

pytestmark = pytest.mark.nixl


@pytest.fixture(scope="module")
def env() -> Iterator[bench.BenchEnv]:
    with bench_env(BLOCK, POOL) as env:
        env.child.call(None, "pd_setup", block_size=BLOCK, num_blocks=POOL // BLOCK)
        yield env


def _load(env: bench.BenchEnv, engine: bench._PDEngine, rid: str, blocks: list[int]) -> None:
    src = [b + 100 for b in blocks]
    params = env.child.call(engine.step, "pd_grant", rid=f"p-{rid}", blocks=src)
    engine.schedule(rid, params, blocks)
    deadline = time.monotonic() + 30
    while rid not in engine.finished_recving:
        engine.step()
        assert time.monotonic() < deadline, f"load {rid} did not finish"
    assert rid not in engine.failures, engine.failures.get(rid)
    # The bytes are P's (its pool is the benchmark's seeded content).
    got = env.pool[:POOL].reshape(-1, BLOCK)[blocks]
    want = bench._p_content(POOL).reshape(-1, BLOCK)[src]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["a", "b"])
def test_a_new_decoder_warms_its_connection_during_the_handshake(
    env: bench.BenchEnv, name: str
) -> None:
    engine = bench._PDEngine(
        "kv_consumer", env.memory.tensor(env.pool), BLOCK, POOL // BLOCK, name=f"-warm{name}"
    )
    try:
        _load(env, engine, "first", [0, 1, 2])
        (entry,) = engine.worker.remote_engines
        assert entry.warmup_outcome == "done"
        assert entry.warmup_seconds is not None
        assert entry.ready_at is not None
        assert entry.ready_at >= entry.started_at
        assert engine.counters.get("warmups_done") == 1
        events = [e for e in engine.events if e.kind == "pd.warmup"]
        assert [e.data["outcome"] for e in events] == ["done"]
        stats = engine.worker.transport.stats()
        assert stats["warmups"] == 1
        _load(env, engine, "second", [3, 4])
        assert engine.counters.get("warmups_done") == 1  # once per connection
    finally:
        engine.close()


def test_warm_up_off(env: bench.BenchEnv) -> None:
    engine = bench._PDEngine(
        "kv_consumer",
        env.memory.tensor(env.pool),
        BLOCK,
        POOL // BLOCK,
        name="-nowarm",
        extra={"warmup_timeout": 0},
    )
    try:
        _load(env, engine, "first", [5, 6])
        (entry,) = engine.worker.remote_engines
        assert entry.warmup_outcome is None
        assert engine.worker.transport.stats()["warmups"] == 0
        assert not any(k.startswith("warmups_") for k in engine.counters)
        assert not any(e.kind == "pd.warmup" for e in engine.events)
    finally:
        engine.close()
