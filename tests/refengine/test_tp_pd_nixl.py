"""P/D at homogeneous tensor parallelism over real NIXL: P at TP 2 → D at TP 2 (issue 14).

Both engines live in the test process (their scheduler halves); each starts two worker
processes, and each worker holds its own NIXL agent (``<engine>.<rank>``) and side channel. D's
rank ``r`` reads its KV heads from P's rank ``r``. Checked: D's outputs equal a one-process
engine's; D's KV of the transferred tokens is byte-equal to P's, rank by rank; the leak oracle
is clean on both engines afterwards (no lease held, every block free).
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("nixl_cu12", reason="the NIXL transport needs nixl-cu12")

from kvframe_refengine import Engine, EngineConfig, FinishReason, ModelConfig
from kvframe_refengine import router as router_mod
from kvframe_refengine.router import Router, post_json
from kvframe_refengine.tokenizer import encode

from kvframe.config import KVTransferConfig
from tests.refengine._pd_steps import prefill_tickets

MODEL = ModelConfig(seed=11)
CFG = {"model": MODEL, "block_size": 8, "num_blocks": 48}
PROMPTS = [
    [(7 * i + 3) % MODEL.vocab_size for i in range(21)],
    [(13 * i + 1) % MODEL.vocab_size for i in range(16)],
    [(5 * i + 2) % MODEL.vocab_size for i in range(9)],
]
MAX_TOKENS = 5
_ids = itertools.count()


def _engine(role: str, engine_id: str, **extra: Any) -> Engine:
    kv = KVTransferConfig.from_dict(
        {
            "kv_connector": "PDConnector",
            "kv_role": role,
            "engine_id": engine_id,
            "kv_lease_duration": 6.0,
            "kv_connector_extra_config": {"transport": "nixl", **extra},
        }
    )
    return Engine(EngineConfig(**CFG, tp_size=2), kv)


def _tokens_of(kv: torch.Tensor, n: int) -> torch.Tensor:
    """``[layers, blocks, 2, block_size, heads, dim]`` → the first ``n`` tokens' K/V,
    ``[layers, 2, n, heads, dim]``."""
    layers, blocks, two, bs, heads, dim = kv.shape
    return kv.permute(0, 2, 1, 3, 4, 5).reshape(layers, two, blocks * bs, heads, dim)[:, :, :n]


def test_p_tp2_to_d_tp2_pull_over_nixl() -> None:
    with Engine(EngineConfig(**CFG)) as single:
        want = [list(o.token_ids) for o in single.generate(PROMPTS, MAX_TOKENS)]
    n = next(_ids)
    p = _engine("kv_producer", f"tpP{n}")
    d = _engine("kv_consumer", f"tpD{n}")
    try:
        params = prefill_tickets(p, PROMPTS)
        assert all(pp["tp_size"] == 2 for pp in params.values())
        assert all(len(pp["remote_ports"]) == 2 for pp in params.values())
        # P's KV of each prompt, read before any other request could reuse its blocks.
        p_kv = {rid: p.read_kv(pp["remote_block_ids"][0]) for rid, pp in params.items()}
        for i, prompt in enumerate(PROMPTS):
            d.add_request(f"d{i}", prompt, MAX_TOKENS, params[f"r{i}"])
        d_blocks: dict[str, list[int]] = {}
        finals = {}
        deadline = time.monotonic() + 60
        while p.has_unfinished_work() or d.has_unfinished_work():
            assert time.monotonic() < deadline, (p.describe(), d.describe())
            for out in p.step() + d.step():
                if out.finished:
                    finals[out.request_id] = out
            for rid, req in d.scheduler.requests.items():
                if req.block_ids:
                    d_blocks[rid] = list(req.block_ids)
            if not (p.last_step_ran_tokens or d.last_step_ran_tokens):
                time.sleep(0.001)
        for i, prompt in enumerate(PROMPTS):
            out = finals[f"d{i}"]
            assert out.finish_reason is FinishReason.LENGTH, out.error
            assert list(out.token_ids) == want[i]
            assert out.num_external_tokens == len(prompt) - 1
        # D computed only each prompt's last token and the decodes: the KV came from P.
        assert d.scheduler.counters["tokens_computed"] == len(PROMPTS) * MAX_TOKENS
        for i, prompt in enumerate(PROMPTS):
            loaded = len(prompt) - 1
            d_kv = d.read_kv(d_blocks[f"d{i}"])
            for rank in range(2):
                got = _tokens_of(d_kv[rank], loaded)
                sent = _tokens_of(p_kv[f"r{i}"][rank], loaded)
                assert got.numpy().tobytes() == sent.numpy().tobytes(), (i, rank)
            # The two ranks hold different heads (one KV head each).
            assert not torch.equal(d_kv[0], d_kv[1])
        p.check_no_leaks()
        d.check_no_leaks()
    finally:
        d.shutdown()
        p.shutdown()


def test_a_dead_p_rank_fails_p_and_d_recomputes_cleanly() -> None:
    """P's rank 1 is killed after the prefill, before D reads: P's next step finds it gone and
    stops its other worker too; D's loads fail on every rank (the peer is gone), D recomputes
    the prompts itself (policy ``recompute``) and answers the single engine's tokens, and ends
    clean, within a few seconds."""
    with Engine(EngineConfig(**CFG)) as single:
        want = [list(o.token_ids) for o in single.generate(PROMPTS[:2], MAX_TOKENS)]
    n = next(_ids)
    p = _engine("kv_producer", f"tpkP{n}")
    d = _engine("kv_consumer", f"tpkD{n}", handshake_timeout=1.0)
    try:
        params: dict[str, dict[str, Any]] = {}
        for i, prompt in enumerate(PROMPTS[:2]):
            p.add_request(f"r{i}", prompt, 1, {"do_remote_decode": True})
        while len(params) < 2:
            for out in p.step():
                if out.finished:
                    assert out.kv_transfer_params is not None
                    params[out.request_id] = dict(out.kv_transfer_params)
        assert p.workers is not None
        os.kill(p.workers.pids()[1], signal.SIGKILL)
        for i, prompt in enumerate(PROMPTS[:2]):
            d.add_request(f"d{i}", prompt, MAX_TOKENS, params[f"r{i}"])
        finals = {}
        t0 = time.monotonic()
        while d.has_unfinished_work() or p.has_unfinished_work():
            assert time.monotonic() - t0 < 30, d.describe()
            for out in p.step() + d.step():
                if out.finished:
                    finals[out.request_id] = out
            time.sleep(0.001)
        took = time.monotonic() - t0
        assert p.workers.broken is not None
        assert "worker rank 1" in p.workers.broken
        for i in range(2):
            out = finals[f"d{i}"]
            assert out.finish_reason is FinishReason.LENGTH, out.error
            assert list(out.token_ids) == want[i]
            assert out.num_external_tokens == 0  # nothing loaded: recomputed on D
        assert took < 15, took
        d.check_no_leaks()
    finally:
        d.shutdown()
        p.shutdown()


def test_tp2_servers_through_the_router_pull_and_push(tmp_path: Path) -> None:
    """``python -m kvframe_refengine.server --tp-size 2`` for P and D (two worker processes
    each), the router in front in pull mode, then in push mode: outputs equal a single
    engine's, every request's KV came from P, the leak oracle is clean on both."""
    from tests.security.fleet import EngineProcess, counters, get, reference

    prompts = [encode(f"Tensor parallel prefill and decode, request number {i}.") for i in range(3)]
    p = EngineProcess("tpsP", "kv_producer", key_file=None, log_dir=tmp_path, tp_size=2)
    d = EngineProcess("tpsD", "kv_consumer", key_file=None, log_dir=tmp_path, tp_size=2)
    try:
        p.wait_ready()
        d.wait_ready()
        want = reference(prompts, 6)
        loads = 0
        for mode in ("pull", "push"):
            router = Router(p.url, d.url, mode=mode)
            httpd = router_mod.serve(router, "127.0.0.1", 0)
            url = f"http://127.0.0.1:{httpd.server_address[1]}/v1/completions"
            try:
                answers = [
                    post_json(url, {"prompt": t, "max_tokens": 6}, timeout=60) for t in prompts
                ]
            finally:
                httpd.shutdown()
                httpd.server_close()
            for (code, body), tokens in zip(answers, want, strict=True):
                assert code == 200, (mode, body)
                assert body["choices"][0]["token_ids"] == tokens, mode
                assert body["usage"]["external_tokens"] > 0, mode
            loads += len(prompts)
            # Counters add over D's two ranks: each rank loads its heads of every request.
            assert counters(d.url)["connector.loads_done"] == 2 * loads, mode
        assert counters(p.url)["connector.pushes_done"] == 2 * len(prompts)
        for e in (p, d):
            deadline = time.monotonic() + 10
            while not get(f"{e.url}/leaks")["clean"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert get(f"{e.url}/leaks") == {"clean": True, "problems": ""}
            assert get(f"{e.url}/health")["ok"] is True
    finally:
        p.stop()
        d.stop()
