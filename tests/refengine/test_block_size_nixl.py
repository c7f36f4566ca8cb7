"""P/D between engines of different block sizes over real NIXL (issue 14, item 2).

P at block size 16 → D at 32 (two P blocks fill one D block), P at 32 → D at 16 (one P block
split over two D blocks), and P 16 at TP 2 → D 32 at TP 1 (the conversion composed with
heterogeneous tensor parallelism: head runs per token). Checked per pairing: D's outputs
equal a one-process engine's; D computed only each prompt's last token (the KV came from P);
D's KV of every transferred token is byte-equal, token by token, to P's KV of that token and
to what a same-block-size transfer from the same P delivered (a second decoder at P's block
size, fed tickets of the same prompts); the tail of D's last loaded block after the tokens D
holds was zeroed (D's and P's caches are filled with marker values before the transfer, so a
tail not zeroed would still hold D's, or P's where a whole chunk was read); the leak oracle is
clean on both engines. Then a pair of sizes that cannot be regrouped (16 and 24) is refused
with both sizes named, by D's scheduler (the ticket names P's size) and, for a ticket without
it, by the handshake; D computes the prompt itself and answers the single engine's tokens.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

pytest.importorskip("nixl_cu12", reason="the NIXL transport needs nixl-cu12")

from kvframe_refengine import Engine, EngineConfig, FinishReason, ModelConfig

from kvframe.config import KVTransferConfig
from kvframe.core.tp import kv_heads_of
from kvframe.errors import ConfigError
from tests.refengine._pd_steps import prefill_tickets, run_engines

MODEL = ModelConfig(seed=11)  # 2 KV heads
PROMPTS = [
    [(7 * i + 3) % MODEL.vocab_size for i in range(21)],
    [(13 * i + 1) % MODEL.vocab_size for i in range(11)],
    [(5 * i + 2) % MODEL.vocab_size for i in range(40)],
]
MAX_TOKENS = 4
MARK = 7.0  # D's cache before the transfer: what a tail left unzeroed would still hold
P_MARK = 5.0  # P's cache before the prefill
_ids = itertools.count()


def _engine(role: str, engine_id: str, block_size: int, tp: int = 1, lease: float = 6.0) -> Engine:
    kv = KVTransferConfig.from_dict(
        {
            "kv_connector": "PDConnector",
            "kv_role": role,
            "engine_id": engine_id,
            "kv_lease_duration": lease,
            "kv_connector_extra_config": {"transport": "nixl", "handshake_timeout": 2.0},
        }
    )
    blocks = 1024 // block_size
    return Engine(
        EngineConfig(model=MODEL, block_size=block_size, num_blocks=blocks, tp_size=tp), kv
    )


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    with Engine(EngineConfig(model=MODEL, block_size=16, num_blocks=64)) as single:
        return [list(o.token_ids) for o in single.generate(PROMPTS, MAX_TOKENS)]


def _tokens(kv: torch.Tensor) -> torch.Tensor:
    """``[layers, blocks, 2, block_size, heads, dim]`` → ``[layers, 2, tokens, heads, dim]``."""
    layers, blocks, two, bs, heads, dim = kv.shape
    return kv.permute(0, 2, 1, 3, 4, 5).reshape(layers, two, blocks * bs, heads, dim)


def _whole(ranks: list[torch.Tensor], heads: int) -> torch.Tensor:
    """The ranks' KV put together, ``[layers, 2, tokens, all heads, dim]``."""
    parts: dict[int, torch.Tensor] = {}
    for r, kv in enumerate(ranks):
        mine = _tokens(kv)
        for j, h in enumerate(kv_heads_of(r, len(ranks), heads)):
            parts.setdefault(h, mine[:, :, :, j])
    return torch.stack([parts[h] for h in range(heads)], dim=3)


@pytest.mark.parametrize(
    ("p_bs", "d_bs", "p_tp"),
    [(16, 32, 1), (32, 16, 1), (16, 32, 2)],
    ids=["P16-D32", "P32-D16", "P16tp2-D32tp1"],
)
def test_pull_between_block_sizes_over_nixl(
    p_bs: int, d_bs: int, p_tp: int, want: list[list[int]]
) -> None:
    heads = MODEL.num_kv_heads
    n = next(_ids)
    p = _engine("kv_producer", f"bsP{n}", p_bs, p_tp)
    d = _engine("kv_consumer", f"bsD{n}", d_bs)
    # The same transfer at one block size (P's), from the same P: what D must hold too.
    same = _engine("kv_consumer", f"bsS{n}", p_bs)
    try:
        for cache in d.runner.kv_caches:
            cache.fill_(MARK)
        if p_tp == 1:
            # P's blocks past its tokens hold a marker too: a chunk read over them lands in
            # D's tail, which must be zeroed all the same.
            for cache in p.runner.kv_caches:
                cache.fill_(P_MARK)
        params = prefill_tickets(p, PROMPTS)
        params.update(prefill_tickets(p, PROMPTS, tag="s"))
        assert all(pp["remote_block_size"] == p_bs for pp in params.values())
        sent = {
            rid: _whole(p.read_kv(pp["remote_block_ids"][0]), heads) for rid, pp in params.items()
        }
        for i, prompt in enumerate(PROMPTS):
            d.add_request(f"d{i}", prompt, MAX_TOKENS, params[f"r{i}"])
            same.add_request(f"s{i}", prompt, MAX_TOKENS, params[f"s{i}"])
        d_blocks: dict[str, list[int]] = {}
        finals = run_engines(p, d, same, blocks=d_blocks)
        tails = 0
        for i, prompt in enumerate(PROMPTS):
            out = finals[f"d{i}"]
            assert out.finish_reason is FinishReason.LENGTH, out.error
            assert list(out.token_ids) == want[i]
            loaded = len(prompt) - 1
            assert out.num_external_tokens == loaded
            assert list(finals[f"s{i}"].token_ids) == want[i]
            got = _tokens(d.read_kv(d_blocks[f"d{i}"])[0])
            ref = _tokens(same.read_kv(d_blocks[f"s{i}"])[0])
            # Token by token: D's KV of each loaded token is P's KV of it, and what the
            # same-block-size transfer put there.
            for t in range(loaded):
                mine = got[:, :, t].numpy().tobytes()
                assert mine == sent[f"r{i}"][:, :, t].numpy().tobytes(), (i, t)
                assert mine == ref[:, :, t].numpy().tobytes(), (i, t)
            # D computed the positions loaded .. loaded + MAX_TOKENS - 1 itself; the rest of
            # the last loaded block was zeroed (it held MARK, or P's over-read chunk).
            end = math.ceil(loaded / d_bs) * d_bs
            written = loaded + MAX_TOKENS
            if loaded % d_bs:
                tails += 1
            if written < end:
                assert (got[:, :, written:end] == 0).all(), (i, written, end)
            assert (got[:, :, :written] != MARK).all()
            assert (got[:, :, :written] != P_MARK).all()
        assert d.scheduler.counters["tokens_computed"] == len(PROMPTS) * MAX_TOKENS
        ps, ds = p.connector_stats(), d.connector_stats()
        assert ds.get("stale_tails_zeroed", 0) == tails
        assert ds.get("loads_done", 0) == len(PROMPTS)
        assert ps.get("leases_expired", 0) == 0
        assert ps.get("leases_consumed", 0) == 2 * p_tp * len(PROMPTS)
        p.check_no_leaks()
        d.check_no_leaks()
        same.check_no_leaks()
    finally:
        same.shutdown()
        d.shutdown()
        p.shutdown()


def test_sizes_that_cannot_be_regrouped_are_refused_naming_both(want: list[list[int]]) -> None:
    n = next(_ids)
    p = _engine("kv_producer", f"brP{n}", 16, lease=1.0)
    d = _engine("kv_consumer", f"brD{n}", 24)
    try:
        params = prefill_tickets(p, PROMPTS[:2])
        # The ticket names P's block size: D refuses the request when it is added, before
        # anything is allocated (the reference engine asks its connector at admission).
        with pytest.raises(
            ConfigError,
            match=r"remote_block_size = 16: block size: this engine 24 tokens, the peer 16 "
            r"tokens; KV moves between different block sizes only when one is a whole multiple "
            r"of the other: run both engines at one block size \(24 or 16\)",
        ):
            d.add_request("d0", PROMPTS[0], MAX_TOKENS, params["r0"])
        # A ticket without it (an old or altered P): its block count fits D's size, so the
        # handshake is where the sizes meet, and P refuses them; D computes the prompt itself.
        bare = {k: v for k, v in params["r1"].items() if k != "remote_block_size"}
        d.add_request("d1", PROMPTS[1], MAX_TOKENS, bare)
        # P's lease of r0 (refused by D) ends at its expiry, before the loop below returns.
        finals = run_engines(p, d)
        out = finals["d1"]
        assert out.finish_reason is FinishReason.LENGTH, out.error
        assert list(out.token_ids) == want[1]
        assert out.num_external_tokens == 0  # computed on D
        failed = [
            str(e.data.get("error")) for e in d.take_events() if e.kind == "pd.handshake_failed"
        ]
        assert failed
        assert "block size: this engine 16 tokens, the peer 24 tokens" in failed[0]
        assert "whole multiple" in failed[0]
        p.check_no_leaks()
        d.check_no_leaks()
    finally:
        d.shutdown()
        p.shutdown()
