"""The reference engine at tensor parallelism > 1 (issue 14, item 4).

Each engine here starts ``tp_size`` worker processes (gloo on loopback); the default tiny model
has 8 query heads and 2 KV heads, so TP 2 splits the KV heads (one per rank) and TP 4
replicates them (each on two ranks). Greedy outputs equal the one-process engine's token for
token, and each rank's KV cache holds exactly its heads of the one-process engine's cache (up
to the all-reduce's rounding: measured below).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from kvframe_refengine import Engine, EngineConfig, FinishReason, ModelConfig
from kvframe_refengine.model import TPShard, check_tp_size
from kvframe_refengine.scheduler import ScheduledBatch, ScheduledSeq
from kvframe_refengine.tp import WorkerFailed

from tests.refengine._http import complete, engine_server, request

MODEL = ModelConfig(seed=7)
PROMPTS = [list(range(1, 21)), [40, 41, 42], [7] * 9, [300, 5, 77, 201, 9, 13, 64]]
CFG = {"model": MODEL, "block_size": 8, "num_blocks": 32}


@pytest.fixture(scope="module")
def one_rank() -> tuple[list[list[int]], list[torch.Tensor]]:
    """The one-process engine's tokens and KV cache (blocks 0..7) for PROMPTS."""
    with Engine(EngineConfig(**CFG)) as e:
        outs = e.generate(PROMPTS, 6)
        return [list(o.token_ids) for o in outs], e.read_kv(range(8))


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_outputs_and_kv_equal_one_rank(
    tp: int, one_rank: tuple[list[list[int]], list[torch.Tensor]]
) -> None:
    tokens, (kv1,) = one_rank
    with Engine(EngineConfig(**CFG, tp_size=tp)) as e:
        assert e.workers is not None
        assert len(e.workers.pids()) == tp
        assert e.connector_worker is None
        outs = e.generate(PROMPTS, 6)
        assert [o.finish_reason for o in outs] == [FinishReason.LENGTH] * len(PROMPTS)
        assert [list(o.token_ids) for o in outs] == tokens
        ranks = e.read_kv(range(8))
        e.check_no_leaks()
    assert len(ranks) == tp
    for r, kv in enumerate(ranks):
        heads = TPShard(rank=r, size=tp).kv_heads(MODEL)
        assert kv.shape[-2] == len(heads)
        want = kv1[..., heads.start : heads.stop, :]
        # Layer 0's K/V come from the replicated embedding: bit-equal. Later layers see the
        # residual stream after all-reduces, whose summation order differs from one rank's
        # matmul: float32 rounding only.
        assert torch.equal(kv[0], want[0])
        assert torch.allclose(kv, want, rtol=0, atol=1e-4), (kv - want).abs().max()


def test_tp_sizes_that_do_not_fit_are_refused_with_what_works() -> None:
    with pytest.raises(
        ValueError, match=r"EngineConfig\.tp_size = 3 .*sizes that fit.*\[1, 2, 4, 8\]"
    ):
        EngineConfig(tp_size=3)
    odd = ModelConfig(num_heads=12, num_kv_heads=4, intermediate_size=96)
    assert check_tp_size(odd, 4) == 4
    with pytest.raises(ValueError, match="neither divides num_kv_heads = 4 nor is a multiple"):
        check_tp_size(odd, 6)
    with pytest.raises(ValueError, match="tp_size = 0"):
        EngineConfig(tp_size=0)


def test_a_dead_worker_fails_every_request_and_the_next_steps_at_once() -> None:
    with Engine(EngineConfig(**CFG, tp_size=2, worker_timeout_s=10.0)) as e:
        assert e.workers is not None
        e.add_request("a", PROMPTS[0], 50)
        e.add_request("b", PROMPTS[1], 50)
        e.step()
        os.kill(e.workers.pids()[1], signal.SIGKILL)
        t0 = time.monotonic()
        finals = {}
        for _ in range(3):
            for out in e.step():
                if out.finished:
                    finals[out.request_id] = out
        assert time.monotonic() - t0 < 5.0
        assert set(finals) == {"a", "b"}
        for out in finals.values():
            assert out.finish_reason is FinishReason.ERROR
            assert out.error is not None
            assert "worker rank 1" in out.error
        assert e.workers.broken is not None
        # A later request fails in its first step, without waiting.
        e.add_request("c", PROMPTS[2], 2)
        (out,) = e.step()
        assert out.finish_reason is FinishReason.ERROR
        assert "not serving" in (out.error or "")
        with pytest.raises(WorkerFailed):
            e.read_kv([0])
        e.check_no_leaks()


def test_workers_that_cannot_start_fail_the_engine_naming_the_rank() -> None:
    # A device this machine lacks: each rank fails building its shard, after the rendezvous.
    device = "meta-not-a-device"
    with pytest.raises(WorkerFailed, match=r"worker rank \d could not start: .*"):
        Engine(EngineConfig(**CFG, tp_size=2, device=device))


_ORPHAN = """
import os, sys, torch
from kvframe_refengine import Engine, EngineConfig
e = Engine(EngineConfig(num_blocks=8, tp_size=2))
print(" ".join(map(str, e.workers.pids())), flush=True)
os._exit(0)  # the engine process dies without shutting anything down
"""


def test_workers_exit_when_the_engine_process_dies() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _ORPHAN], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        time.sleep(0.05)
    assert not alive, f"workers {alive} outlived their engine"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_step_every_rank_refuses_fails_alone_and_the_workers_go_on(
    one_rank: tuple[list[list[int]], list[torch.Tensor]],
) -> None:
    tokens, _ = one_rank
    with Engine(EngineConfig(**CFG, tp_size=2)) as e:
        assert e.workers is not None
        # Block 99 is outside every rank's 32-block cache: each rank raises at the same point
        # (layer 0's cache write, before any all-reduce) and answers with its error.
        bad = ScheduledBatch(
            step=0,
            seqs=(ScheduledSeq(request_id="x", token_ids=(1, 2), start=0, block_ids=(99,)),),
            connector_metadata=None,
            finished_request_ids=frozenset(),
        )
        with pytest.raises(WorkerFailed, match=r"step 0 failed: rank 0: .*; rank 1: "):
            e.workers.execute(bad)
        assert e.workers.broken is None
        assert [list(o.token_ids) for o in e.generate(PROMPTS, 6)] == tokens
        e.check_no_leaks()


@pytest.mark.parametrize("seen_when", ["sending", "either"])
def test_server_with_dead_workers_answers_500_then_health_503(seen_when: str) -> None:
    # "sending": the rank has exited before the next step, so the step's order meets a broken
    # pipe; "either": the next request races the kill, so the death may be seen while sending
    # the order or while reading the reply. Both name the rank the same way.
    with engine_server(None, tp_size=2) as served:
        assert served.service is not None
        code, body = complete(served, {"prompt": [1, 2, 3], "max_tokens": 2})
        assert code == 200, body
        workers = served.service.engine.workers
        assert workers is not None
        os.kill(workers.pids()[0], signal.SIGKILL)
        if seen_when == "sending":
            workers._procs[0].wait(timeout=10)
        code, body = complete(served, {"prompt": [1, 2, 3], "max_tokens": 2})
        assert code == 500, body
        assert "worker rank 0" in body["error"]["message"]
        if seen_when == "sending":
            assert "worker rank 0 exited with status -9" in body["error"]["message"]
            assert "Broken pipe" in body["error"]["message"]
        code, body = request(served, "GET", "/health")
        assert code == 503, body
        assert body["error"]["type"] == "tp_workers_failed"
