"""Stepping reference engines by hand for the P/D tests over NIXL: prefill on P to get each
request's ticket, then step P and its decoders together until every request ended."""

from __future__ import annotations

import time
from typing import Any

from kvframe_refengine import Engine, FinishReason


def prefill_tickets(
    p: Engine, prompts: list[list[int]], tag: str = "r", seconds: float = 30.0
) -> dict[str, dict[str, Any]]:
    """Prefill ``prompts`` on ``p`` as requests ``{tag}0``, ``{tag}1``, …; returns each one's
    ``kv_transfer_params`` (P's ticket) by request id."""
    params: dict[str, dict[str, Any]] = {}
    for i, prompt in enumerate(prompts):
        p.add_request(f"{tag}{i}", prompt, 1, {"do_remote_decode": True})
    deadline = time.monotonic() + seconds
    while len(params) < len(prompts):
        assert time.monotonic() < deadline, "prefill did not finish"
        for out in p.step():
            if out.finished:
                assert out.finish_reason is FinishReason.LENGTH, out.error
                assert out.kv_transfer_params is not None
                params[out.request_id] = dict(out.kv_transfer_params)
    return params


def run_engines(
    p: Engine,
    *ds: Engine,
    seconds: float = 60.0,
    blocks: dict[str, list[int]] | None = None,
) -> dict[str, Any]:
    """Step ``p`` and the decoders ``ds`` until none has unfinished work (at most
    ``seconds``); returns every finished output by request id. With ``blocks``, records each
    decoder request's block ids as they are allocated."""
    finals: dict[str, Any] = {}
    engines = [p, *ds]
    deadline = time.monotonic() + seconds
    while any(e.has_unfinished_work() for e in engines):
        assert time.monotonic() < deadline, [e.describe() for e in engines]
        for out in [o for e in engines for o in e.step()]:
            if out.finished:
                finals[out.request_id] = out
        if blocks is not None:
            for d in ds:
                for rid, req in d.scheduler.requests.items():
                    if req.block_ids:
                        blocks[rid] = list(req.block_ids)
        if not any(e.last_step_ran_tokens for e in engines):
            time.sleep(0.001)
    return finals
