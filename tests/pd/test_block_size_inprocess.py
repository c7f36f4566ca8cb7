"""Block-size conversion over the in-process transport (no NIXL needed): a pull between P at
16 tokens per block and D at 32, both ways, moves every token to its place (compared token by
token) and zeroes the stale tail; a ticket whose block size contradicts P's handshake is not
read; push mode between block sizes is refused with both sizes named."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

from tests.pd.driver import Driver, run_until, view
from tests.pd.test_pd_push_inprocess import legs

_ids = itertools.count()


def _pair(p_bs: int, d_bs: int) -> tuple[Driver, Driver]:
    n = next(_ids)
    p = Driver(f"bP{n}", "kv_producer", block_size=p_bs, num_kv_heads=2)
    d = Driver(f"bD{n}", "kv_consumer", block_size=d_bs, num_kv_heads=2)
    return p, d


def _tokens(drv: Driver, blocks: list[int]) -> list[torch.Tensor]:
    """Per layer, ``[2, tokens, heads, dim]`` of ``blocks`` in order."""
    out = []
    for t in drv.kv.values():
        sel = t[blocks]  # [n, 2, bs, heads, dim]
        out.append(sel.permute(1, 0, 2, 3, 4).reshape(2, -1, *sel.shape[3:]))
    return out


def _ended(drv: Driver, rid: str) -> bool:
    return any(rid in o.finished_recving for o in drv.outputs)


def _pull(p: Driver, d: Driver, n: int, d_blocks: list[int], **alter: Any) -> dict[str, Any]:
    p_blocks = list(range(3, 3 + math.ceil(n / p.info.block_size)))
    p.fill(p_blocks, seed=5)
    for t in d.kv.values():
        t.fill_(7.0)  # what a tail not zeroed would still hold
    _, params = p.sched.request_finished(
        view("r", n, {"do_remote_decode": True}, finish_reason="length"), (tuple(p_blocks),)
    )
    assert params is not None
    assert params["remote_block_size"] == p.info.block_size
    params = {**params, **alter}
    req = view("d", n, params)
    d.sched.on_new_request(req)
    k, is_async = d.sched.get_num_new_matched_tokens(req, 0)
    assert (k, is_async) == (n - 1, True)
    d.sched.update_state_after_alloc(req, (tuple(d_blocks),), k)
    run_until([p, d], lambda: _ended(d, "d"))
    return {"p_blocks": p_blocks, "loaded": k}


@pytest.mark.parametrize(("p_bs", "d_bs"), [(16, 32), (32, 16)], ids=["P16-D32", "P32-D16"])
@pytest.mark.parametrize("n", [21, 33, 64, 65])
def test_a_pull_regroups_blocks_token_by_token(p_bs: int, d_bs: int, n: int) -> None:
    p, d = _pair(p_bs, d_bs)
    try:
        d_blocks = [9, 2, 11, 5, 0][: math.ceil((n - 1) / d_bs)]
        got = _pull(p, d, n, d_blocks)
        loaded = got["loaded"]
        assert not any(o.invalid_block_ids for o in d.outputs)
        sent = _tokens(p, got["p_blocks"])
        mine = _tokens(d, d_blocks)
        for layer in range(len(sent)):
            for t in range(loaded):
                assert torch.equal(mine[layer][:, t], sent[layer][:, t]), (layer, t)
            assert (mine[layer][:, loaded:] == 0).all()  # the stale tail, zeroed
        zeroed = sum(o.stats.counters.get("stale_tails_zeroed", 0) for o in d.outputs)
        assert zeroed == (1 if loaded % d_bs else 0)
    finally:
        d.shutdown()
        p.shutdown()


def test_a_ticket_whose_block_size_contradicts_the_handshake_is_not_read() -> None:
    # P at 16 hands out blocks of 16; the ticket is altered to say 32 (D's size): the block
    # count fits D's expectations, but the handshake says 16, so nothing is read.
    p, d = _pair(16, 32)
    try:
        _pull(p, d, 33, [4], remote_block_size=32, remote_block_ids=[[3]])
        failed = [o for o in d.outputs if o.invalid_block_ids]
        assert failed
        reasons = [str(e.data) for o in d.outputs for e in o.events]
        assert any(
            "the ticket's blocks are of 32 tokens (remote_block_size) but the prefill engine's "
            "handshake says 16" in r
            for r in reasons
        ), reasons
        assert (d.kv["layer0"][4] == 7.0).all()  # untouched
    finally:
        d.shutdown()
        p.shutdown()


def test_push_between_block_sizes_is_refused_naming_both() -> None:
    p, d = _pair(16, 32)
    try:
        p_leg, d_leg = legs(p)
        req = view("d", 33, d_leg)
        d.sched.on_new_request(req)
        k, _ = d.sched.get_num_new_matched_tokens(req, 0)
        d.sched.update_state_after_alloc(req, ((4, 5),), k)
        run_until([p, d], lambda: _ended(d, "d"))
        reasons = [str(e.data) for o in d.outputs for e in o.events]
        assert any(
            "push mode needs one block size: the prefill engine's blocks hold 16 tokens, this "
            "engine's 32" in r
            for r in reasons
        ), reasons
        assert any(o.invalid_block_ids for o in d.outputs)
        del p_leg
    finally:
        d.shutdown()
        p.shutdown()
