"""kvframe's P/D connector inside real vLLM engines (CPU), over NIXL on loopback.

One prefill engine (P), one decode engine (D) and a prefill engine with other weights (P2),
each a separate process running ``vllm.LLM`` with ``KVFrameConnector``: P and P2 run the P/D
connector, D runs kvframe's MultiConnector (the P/D connector, then the offloading connector
keeping what D computed or loaded in a CPU tier), as a decode tier would. Tests run in file
order and share the engines; the last one kills D.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from kvframe_vllm.host import EngineError, EngineProcess
from kvframe_vllm.tiny import prompt_ids

from .conftest import LEASE_SECONDS

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 8
PD = "0.PDConnector."  # D's counters come from MultiConnector children, prefixed by label
OFF = "1.OffloadingConnector."


# What vLLM's example disaggregation proxy sends to the prefill engine: kvframe must accept the
# router contract NixlConnector users already have.
PROXY_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill(
    p: EngineProcess, prompts: list[list[int]], ask: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    out = p.call(
        "generate",
        prompts=prompts,
        max_tokens=1,
        params=[ask or {"do_remote_decode": True}] * len(prompts),
    )
    params = [o["kv_transfer_params"] for o in out["outputs"]]
    assert all(isinstance(x, dict) and x["do_remote_prefill"] for x in params), params
    return params


def generate(e: EngineProcess, prompts: list[list[int]], params: list[Any]) -> list[list[int]]:
    out = e.call("generate", prompts=prompts, max_tokens=MAX_TOKENS, params=params)
    return [o["token_ids"] for o in out["outputs"]]


def wait_idle(e: EngineProcess, timeout: float = 10.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = e.call("state")
        if not st["has_requests"] or time.monotonic() > deadline:
            return st
        time.sleep(0.05)


def test_decode_outputs_equal_single_engine_outputs(engines: dict[str, EngineProcess]) -> None:
    p, d = engines["P"], engines["D"]
    # One block, several blocks, and a partial last block (block_size 32).
    prompts = [prompt_ids(i, n) for i, n in enumerate((32, 70, 129))]
    reference = generate(p, prompts, [None] * len(prompts))
    before = d.call("state")["worker"]
    params = prefill(p, prompts, PROXY_PREFILL_PARAMS)
    for x, prompt in zip(params, prompts, strict=True):
        assert x["remote_engine_id"] == "prefill-0"
        assert x["remote_num_tokens"] == len(prompt)
        # vLLM's tensor-parallel size, through the adapter's EngineInfo: one rank, one port.
        assert x["tp_size"] == 1
        assert len(x["remote_ports"]) == 1
    decoded = generate(d, prompts, params)
    assert decoded == reference
    after = d.call("state")["worker"]
    assert after.get(PD + "loads_done", 0) - before.get(PD + "loads_done", 0) == len(prompts)
    assert after.get(PD + "loads_failed", 0) == before.get(PD + "loads_failed", 0)
    assert after.get(PD + "bytes_read", 0) > before.get(PD + "bytes_read", 0)
    # P learnt that D read: every lease consumed, not expired.
    st = wait_idle(p)
    assert st["scheduler"]["workers.leases_consumed"] >= len(prompts)
    assert st["worker"]["leases_held"] == 0


def test_decode_uses_the_pulled_kv_weight_swap(engines: dict[str, EngineProcess]) -> None:
    # P2 prefills with other weights. Had D recomputed the prompt, it would produce P's
    # (weights a) outputs; with P2's KV it cannot.
    p, p2, d = engines["P"], engines["P2"], engines["D"]
    prompts = [prompt_ids(10 + i, 64 + 16 * i) for i in range(3)]
    with_a = generate(p, prompts, [None] * len(prompts))
    with_b = generate(p2, prompts, [None] * len(prompts))
    assert with_a != with_b, "the two weight sets must differ for this check to mean anything"
    before = d.call("state")["worker"]
    decoded = generate(d, prompts, prefill(p2, prompts))
    after = d.call("state")["worker"]
    key = PD + "loads_done.prefill-1"
    assert after.get(key, 0) - before.get(key, 0) == 3
    for got, a in zip(decoded, with_a, strict=True):
        assert got != a
    # Not checked again with P's KV for these prompts: D's prefix cache now holds the blocks
    # it loaded from P2 (keyed by tokens, as vLLM does), so local hits would reuse them.


def test_decode_tier_keeps_pulled_kv_in_its_offload_tier(
    engines: dict[str, EngineProcess],
) -> None:
    # MultiConnector inside vLLM: the P/D child loads, the offloading child stores what the
    # request held when it finished; with vLLM's prefix cache emptied, a repeat of the prompt
    # on D alone is served from the CPU tier, and decodes to the same tokens.
    p, d = engines["P"], engines["D"]
    prompts = [prompt_ids(20 + i, 96) for i in range(2)]  # 3 full blocks each
    reference = generate(p, prompts, [None] * len(prompts))
    assert generate(d, prompts, prefill(p, prompts)) == reference
    before = wait_idle(d)
    assert before["worker"].get(OFF + "store_blocks", 0) >= 6, before
    assert d.call("reset_prefix_cache")["ok"]
    assert generate(d, prompts, [None] * len(prompts)) == reference
    after = wait_idle(d)
    hits = after["scheduler"].get("workers." + OFF + "load_blocks", 0)
    assert hits - before["scheduler"].get("workers." + OFF + "load_blocks", 0) >= 4, after
    assert after["worker"][PD + "loads_done"] == before["worker"][PD + "loads_done"]


def test_no_leaks_after_normal_traffic(engines: dict[str, EngineProcess]) -> None:
    for name in ("P", "P2", "D"):
        st = wait_idle(engines[name])
        assert not st["has_requests"], (name, st)
        assert st["requests"] == 0, (name, st)
        # Every block but vLLM's reserved null block is free (prefix-cached blocks count).
        assert st["free_blocks"] == st["total_blocks"] - 1, (name, st)
        pd = PD if name == "D" else ""
        assert st["worker"][pd + "leases_held"] == 0, (name, st)
        assert st["scheduler"][pd + "scheduler_leases_held"] == 0, (name, st)
        assert st["worker"].get(pd + "loads_in_flight", 0) == 0, (name, st)


def test_prefill_engine_dies_before_the_read_decode_recomputes(
    engines: dict[str, EngineProcess],
) -> None:
    # P2 (weights b) prefills and dies. D's read fails (the peer is gone), the blocks are
    # reported invalid, and vLLM recomputes them with D's own weights (policy "recompute"):
    # D's output is then weights a's reference, not what P2's KV would have produced.
    p, p2, d = engines["P"], engines["P2"], engines["D"]
    prompts = [prompt_ids(40, 96)]
    reference = generate(p, prompts, [None])
    params = prefill(p2, prompts)
    p2.kill()
    before = d.call("state")["worker"]
    assert generate(d, prompts, params) == reference
    after = d.call("state")["worker"]
    # One attempt: once a load failed, the adapter never offers the same source again.
    assert after.get(PD + "loads_failed", 0) - before.get(PD + "loads_failed", 0) == 1
    assert after.get(PD + "loads_done", 0) == before.get(PD + "loads_done", 0)
    st = wait_idle(d)
    assert st["free_blocks"] == st["total_blocks"] - 1
    assert st["worker"].get(PD + "loads_in_flight", 0) == 0


def test_decode_killed_mid_flight_prefill_reclaims_at_lease_expiry(
    engines: dict[str, EngineProcess],
) -> None:
    p, d = engines["P"], engines["D"]
    base = wait_idle(p)
    prompt = prompt_ids(99, 96)  # 3 blocks
    expired_before = base["worker"].get("leases_expired", 0)
    params = prefill(p, [prompt])[0]
    t_grant = time.monotonic()
    held = p.call("state")
    assert held["worker"]["leases_held"] == 1
    assert held["free_blocks"] <= base["free_blocks"] - 3
    # D accepts the request (its connector starts tracking it) and crashes before reading.
    with pytest.raises(EngineError, match="exited"):
        d.call("submit", prompt=prompt, max_tokens=MAX_TOKENS, params=params, die=True)
    assert d.proc.returncode is not None
    # Well before the lease runs out P still holds the blocks: D might still read them.
    time.sleep(LEASE_SECONDS / 2 - (time.monotonic() - t_grant))
    assert p.call("state")["worker"]["leases_held"] == 1
    # Then P reclaims them by itself (idle: vLLM keeps stepping for the held request).
    deadline = t_grant + LEASE_SECONDS + 10
    while True:
        st = p.call("state")
        if st["free_blocks"] == base["free_blocks"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    reclaimed_after = time.monotonic() - t_grant
    assert st["free_blocks"] == base["free_blocks"], st
    assert st["worker"]["leases_expired"] == expired_before + 1
    assert st["worker"]["leases_held"] == 0
    assert st["scheduler"]["scheduler_leases_held"] == 0
    assert not st["has_requests"]
    assert LEASE_SECONDS * 0.9 <= reclaimed_after <= LEASE_SECONDS + 5, reclaimed_after
