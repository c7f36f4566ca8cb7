"""P/D at different tensor-parallel sizes over real NIXL (issue 14): P4→D2, P2→D4, P1→D2, P2→D1.

The tiny model has 2 KV heads (8 query heads): at TP 4 each head is replicated on two ranks,
at TP 2 each rank holds one head, at TP 1 the one rank holds both. Each D rank reads its heads
from the P ranks :func:`kvframe.core.tp.head_sources` names (each head once), as head runs of
P's NHD blocks. Checked per pairing: D's outputs equal a one-process engine's; D computed only
each prompt's last token (the KV came from P); D's KV of the transferred tokens is byte-equal,
rank by rank, to P's KV of those heads (what a homogeneous transfer delivers); the leak oracle
is clean on both engines afterwards (every lease ended, every block free). Then a P rank or a
D rank is killed and the request fails cleanly.
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from typing import Any

import pytest
import torch

pytest.importorskip("nixl_cu12", reason="the NIXL transport needs nixl-cu12")

from kvframe_refengine import Engine, EngineConfig, FinishReason, ModelConfig

from kvframe.config import KVTransferConfig
from kvframe.core.tp import head_sources, kv_heads_of
from tests.refengine._pd_steps import prefill_tickets, run_engines

MODEL = ModelConfig(seed=11)
CFG = {"model": MODEL, "block_size": 8, "num_blocks": 48}
PROMPTS = [
    [(7 * i + 3) % MODEL.vocab_size for i in range(21)],
    [(13 * i + 1) % MODEL.vocab_size for i in range(11)],
]
MAX_TOKENS = 4
_ids = itertools.count()


#: 4 KV heads: at P2 -> D1 each source rank gives a run of two heads (units of two heads).
MODEL4 = ModelConfig(seed=11, num_kv_heads=4)


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    with Engine(EngineConfig(**CFG)) as single:
        return [list(o.token_ids) for o in single.generate(PROMPTS, MAX_TOKENS)]


def _engine(
    role: str,
    engine_id: str,
    tp: int,
    lease: float = 6.0,
    model: ModelConfig = MODEL,
    **extra: Any,
) -> Engine:
    kv = KVTransferConfig.from_dict(
        {
            "kv_connector": "PDConnector",
            "kv_role": role,
            "engine_id": engine_id,
            "kv_lease_duration": lease,
            "kv_connector_extra_config": {"transport": "nixl", **extra},
        }
    )
    return Engine(EngineConfig(**{**CFG, "model": model}, tp_size=tp), kv)


def _tokens_of(kv: torch.Tensor, n: int) -> torch.Tensor:
    """``[layers, blocks, 2, block_size, heads, dim]`` → the first ``n`` tokens' K/V,
    ``[layers, 2, n, heads, dim]``."""
    layers, blocks, two, bs, heads, dim = kv.shape
    return kv.permute(0, 2, 1, 3, 4, 5).reshape(layers, two, blocks * bs, heads, dim)[:, :, :n]


def _whole(ranks: list[torch.Tensor], n: int, heads: int) -> torch.Tensor:
    """The ranks' KV put together: ``[layers, 2, n, all heads, dim]`` (a replicated head
    taken from its first holder)."""
    tp = len(ranks)
    parts: dict[int, torch.Tensor] = {}
    for r, kv in enumerate(ranks):
        mine = _tokens_of(kv, n)
        for j, h in enumerate(kv_heads_of(r, tp, heads)):
            parts.setdefault(h, mine[:, :, :, j])
    return torch.stack([parts[h] for h in range(heads)], dim=3)


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "model"),
    [(4, 2, MODEL), (2, 4, MODEL), (1, 2, MODEL), (2, 1, MODEL), (2, 1, MODEL4)],
    ids=["P4-D2", "P2-D4", "P1-D2", "P2-D1", "P2-D1-4heads"],
)
def test_heterogeneous_pull_over_nixl(
    p_tp: int, d_tp: int, model: ModelConfig, want: list[list[int]]
) -> None:
    if model is not MODEL:
        with Engine(EngineConfig(**{**CFG, "model": model})) as single:
            want = [list(o.token_ids) for o in single.generate(PROMPTS, MAX_TOKENS)]
    heads = model.num_kv_heads
    n = next(_ids)
    p = _engine("kv_producer", f"htP{n}", p_tp, model=model)
    d = _engine("kv_consumer", f"htD{n}", d_tp, model=model)
    try:
        params = prefill_tickets(p, PROMPTS)
        assert all(pp["tp_size"] == p_tp for pp in params.values())
        p_kv = {rid: p.read_kv(pp["remote_block_ids"][0]) for rid, pp in params.items()}
        for i, prompt in enumerate(PROMPTS):
            d.add_request(f"d{i}", prompt, MAX_TOKENS, params[f"r{i}"])
        d_blocks: dict[str, list[int]] = {}
        finals = run_engines(p, d, seconds=60, blocks=d_blocks)
        for i, prompt in enumerate(PROMPTS):
            out = finals[f"d{i}"]
            assert out.finish_reason is FinishReason.LENGTH, out.error
            assert list(out.token_ids) == want[i]
            assert out.num_external_tokens == len(prompt) - 1
        assert d.scheduler.counters["tokens_computed"] == len(PROMPTS) * MAX_TOKENS
        for i, prompt in enumerate(PROMPTS):
            loaded = len(prompt) - 1
            sent = _whole(p_kv[f"r{i}"], loaded, heads)
            d_kv = d.read_kv(d_blocks[f"d{i}"])
            assert len(d_kv) == d_tp
            for rank in range(d_tp):
                mine = list(kv_heads_of(rank, d_tp, heads))
                got = _tokens_of(d_kv[rank], loaded)
                assert got.numpy().tobytes() == sent[:, :, :, mine].numpy().tobytes(), (i, rank)
        # Every P rank's lease ended by the D ranks' reports, none by expiry: read ones were
        # consumed (after all their consumer ranks read), unread replicas released at once.
        ps, ds = p.connector_stats(), d.connector_stats()
        read = len({s.p_rank for r in range(d_tp) for s in head_sources(r, d_tp, p_tp, heads)})
        assert ps.get("leases_expired", 0) == 0
        assert ps.get("leases_consumed", 0) == read * len(PROMPTS)
        assert ps.get("leases_aborted", 0) == (p_tp - read) * len(PROMPTS)
        assert ds.get("loads_done", 0) == d_tp * len(PROMPTS)
        p.check_no_leaks()
        d.check_no_leaks()
    finally:
        d.shutdown()
        p.shutdown()


def test_a_dead_p_rank_fails_the_split_read_and_d_recomputes(want: list[list[int]]) -> None:
    """P2→D1: D's one rank reads head 0 from P rank 0 and head 1 from P rank 1. P rank 1 is
    killed before D reads: the read from it fails, the read from rank 0 is stopped, the request
    fails as a whole (policy ``recompute``: D computes the prompt itself and answers the single
    engine's tokens), and D ends clean."""
    n = next(_ids)
    p = _engine("kv_producer", f"hkP{n}", 2)
    d = _engine("kv_consumer", f"hkD{n}", 1, handshake_timeout=1.0)
    try:
        params = prefill_tickets(p, PROMPTS[:1])
        assert p.workers is not None
        os.kill(p.workers.pids()[1], signal.SIGKILL)
        d.add_request("d0", PROMPTS[0], MAX_TOKENS, params["r0"])
        t0 = time.monotonic()
        finals = run_engines(p, d, seconds=30)
        took = time.monotonic() - t0
        out = finals["d0"]
        assert out.finish_reason is FinishReason.LENGTH, out.error
        assert list(out.token_ids) == want[0]
        assert out.num_external_tokens == 0  # nothing loaded: recomputed on D
        assert took < 15, took
        d.check_no_leaks()
    finally:
        d.shutdown()
        p.shutdown()


def test_a_dead_d_rank_leaves_p_clean_by_its_lease() -> None:
    """P1→D2: P's one rank serves both D ranks (one reader group of two). D rank 1 is killed
    before D reads: D's engine stops (its request fails), and P, which heard at most one of
    the two ranks report, frees the request's blocks when its lease ends, not before."""
    n = next(_ids)
    p = _engine("kv_producer", f"hdP{n}", 1, lease=2.0)
    d = _engine("kv_consumer", f"hdD{n}", 2, lease=2.0)
    try:
        params = prefill_tickets(p, PROMPTS[:1])
        assert d.workers is not None
        os.kill(d.workers.pids()[1], signal.SIGKILL)
        d.add_request("d0", PROMPTS[0], MAX_TOKENS, params["r0"])
        t0 = time.monotonic()
        finals = run_engines(p, d, seconds=30)
        took = time.monotonic() - t0
        out = finals["d0"]
        assert out.finish_reason is not FinishReason.LENGTH
        assert d.workers.broken is not None
        assert "worker rank 1" in d.workers.broken
        assert took < 10, took
        # Ended by its lease: D rank 1 never reported.
        assert p.connector_stats().get("leases_expired", 0) == 1
        p.check_no_leaks()
    finally:
        d.shutdown()
        p.shutdown()
