"""P/D between engines of different KV cache orders over real NIXL (issue 14 item 3): an HND
prefill engine and an NHD decoder, and the reverse, with ``allow_layout_permute`` on D.

Each engine computes with its own cache order (``EngineConfig.kv_cache_order``). Checked: D's
outputs equal a one-engine run; D computed only each prompt's last token (the KV came from P);
D's KV of the transferred tokens, read in D's order, is byte-equal to P's KV of those tokens
put into D's order (what a transfer between engines of one order delivers); the leak oracle is
clean on both engines (every lease ended, every block free, every staging slot free). Without
the option the handshake is refused naming both orders and the option, and D recomputes. A
staging area too small for two loads at once makes the second wait; one too small for a load
fails that load, and D recomputes it.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

pytest.importorskip("nixl_cu12", reason="the NIXL transport needs nixl-cu12")

from kvframe_refengine import Engine, EngineConfig, FinishReason, ModelConfig

from kvframe.config import KVTransferConfig
from tests.refengine._pd_steps import prefill_tickets, run_engines

MODEL = ModelConfig(seed=11)
CFG = {"model": MODEL, "block_size": 8, "num_blocks": 48}
PROMPTS = [
    [(7 * i + 3) % MODEL.vocab_size for i in range(21)],  # 3 blocks
    [(13 * i + 1) % MODEL.vocab_size for i in range(11)],  # 2 blocks
]
MAX_TOKENS = 4
_ids = itertools.count()


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    with Engine(EngineConfig(**CFG)) as single:
        return [list(o.token_ids) for o in single.generate(PROMPTS, MAX_TOKENS)]


def _engine(role: str, engine_id: str, order: str, lease: float = 6.0, **extra: Any) -> Engine:
    kv = KVTransferConfig.from_dict(
        {
            "kv_connector": "PDConnector",
            "kv_role": role,
            "engine_id": engine_id,
            "kv_lease_duration": lease,
            "kv_connector_extra_config": {"transport": "nixl", **extra},
        }
    )
    return Engine(EngineConfig(**CFG, kv_cache_order=order), kv)


def _tokens(kv: torch.Tensor, order: str, n: int) -> torch.Tensor:
    """``read_kv``'s blocks of ``order`` → the first ``n`` tokens' K/V, ``[layers, 2, n,
    heads, dim]``."""
    if order == "HND":  # [layers, blocks, 2, heads, bs, dim] -> NHD's
        kv = kv.transpose(3, 4)
    layers, blocks, two, bs, heads, dim = kv.shape
    return kv.permute(0, 2, 1, 3, 4, 5).reshape(layers, two, blocks * bs, heads, dim)[:, :, :n]


def _staging_free(d: Engine) -> tuple[int, int]:
    worker = d.connector_worker
    assert worker is not None
    staging = worker._staging
    assert staging is not None
    return staging.free, staging.size


@pytest.mark.parametrize(("p_order", "d_order"), [("HND", "NHD"), ("NHD", "HND")])
def test_pull_between_orders_permutes_on_arrival(
    p_order: str, d_order: str, want: list[list[int]]
) -> None:
    n = next(_ids)
    p = _engine("kv_producer", f"lpP{n}", p_order)
    d = _engine("kv_consumer", f"lpD{n}", d_order, allow_layout_permute=True)
    try:
        params = prefill_tickets(p, PROMPTS)
        p_kv = {rid: p.read_kv(pp["remote_block_ids"][0])[0] for rid, pp in params.items()}
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
            sent = _tokens(p_kv[f"r{i}"], p_order, loaded)
            (d_kv,) = d.read_kv(d_blocks[f"d{i}"])
            # D's blocks really are in D's order (the engine computed with them), and hold
            # P's tokens byte for byte.
            got = _tokens(d_kv, d_order, loaded)
            assert got.numpy().tobytes() == sent.numpy().tobytes(), i
            assert got.abs().sum() > 0
        ds, ps = d.connector_stats(), p.connector_stats()
        assert ds.get("loads_permuted", 0) == len(PROMPTS)
        assert ds.get("blocks_permuted", 0) == sum(-(-(len(x) - 1) // 8) for x in PROMPTS)
        assert ds.get("loads_done", 0) == len(PROMPTS)
        assert ps.get("leases_consumed", 0) == len(PROMPTS)
        assert ps.get("leases_expired", 0) == 0
        assert _staging_free(d)[0] == _staging_free(d)[1]
        p.check_no_leaks()
        d.check_no_leaks()
    finally:
        d.shutdown()
        p.shutdown()


def test_without_the_option_the_orders_are_refused_and_d_recomputes(
    want: list[list[int]],
) -> None:
    n = next(_ids)
    p = _engine("kv_producer", f"lrP{n}", "HND", lease=2.0)
    d = _engine("kv_consumer", f"lrD{n}", "NHD", lease=2.0, handshake_timeout=1.0)
    try:
        params = prefill_tickets(p, PROMPTS[:1])
        d.add_request("d0", PROMPTS[0], MAX_TOKENS, params["r0"])
        finals = run_engines(p, d, seconds=30)
        out = finals["d0"]
        assert out.finish_reason is FinishReason.LENGTH, out.error
        assert list(out.token_ids) == want[0]
        assert out.num_external_tokens == 0  # nothing read: recomputed on D
        worker = d.connector_worker
        assert worker is not None
        assert worker._engines is not None
        (entry,) = worker._engines.entries()
        error = entry.error or ""
        assert "KV layout mismatch with the prefill engine, nothing is read" in error
        assert "cache order: this engine NHD [blocks, 2, block_size, heads, head_size]" in error
        assert "the peer HND [blocks, 2, heads, block_size, head_size]" in error
        assert "set allow_layout_permute on the decoder" in error
        assert entry.remote is None  # nothing was prepared for reading
        assert worker._staging is None  # no staging area without the option
        assert d.connector_stats().get("loads_permuted", 0) == 0
        p.check_no_leaks()
        d.check_no_leaks()
    finally:
        d.shutdown()
        p.shutdown()


def test_a_full_staging_area_makes_a_load_wait_and_a_too_large_load_fail(
    want: list[list[int]],
) -> None:
    # Three slots: the 3-block load and the 2-block load cannot be staged at once, so one of
    # them waits for the other; both are permuted and answer the single engine's tokens.
    n = next(_ids)
    p = _engine("kv_producer", f"lsP{n}", "HND")
    d = _engine(
        "kv_consumer", f"lsD{n}", "NHD", allow_layout_permute=True, permute_staging_blocks=3
    )
    try:
        params = prefill_tickets(p, PROMPTS)
        for i, prompt in enumerate(PROMPTS):
            d.add_request(f"d{i}", prompt, MAX_TOKENS, params[f"r{i}"])
        finals = run_engines(p, d, seconds=60)
        for i, prompt in enumerate(PROMPTS):
            out = finals[f"d{i}"]
            assert out.finish_reason is FinishReason.LENGTH, out.error
            assert list(out.token_ids) == want[i]
            assert out.num_external_tokens == len(prompt) - 1
        ds = d.connector_stats()
        assert ds.get("permute_waits", 0) == 1
        assert ds.get("loads_permuted", 0) == 2
        assert _staging_free(d) == (3, 3)
        p.check_no_leaks()
        d.check_no_leaks()
    finally:
        d.shutdown()
        p.shutdown()
    # Two slots: the 3-block load can never be staged: it fails at once, D recomputes it.
    n = next(_ids)
    p = _engine("kv_producer", f"lsP{n}", "HND")
    d = _engine(
        "kv_consumer", f"lsD{n}", "NHD", allow_layout_permute=True, permute_staging_blocks=2
    )
    try:
        params = prefill_tickets(p, PROMPTS[:1])
        d.add_request("d0", PROMPTS[0], MAX_TOKENS, params["r0"])
        finals = run_engines(p, d, seconds=30)
        out = finals["d0"]
        assert out.finish_reason is FinishReason.LENGTH, out.error
        assert list(out.token_ids) == want[0]
        assert out.num_external_tokens == 0
        ds = d.connector_stats()
        assert ds.get("permute_refused", 0) == 1
        assert ds.get("loads_permuted", 0) == 0
        assert _staging_free(d) == (2, 2)
        p.check_no_leaks()
        d.check_no_leaks()
    finally:
        d.shutdown()
        p.shutdown()
