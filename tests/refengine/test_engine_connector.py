"""The engine with a connector: the SPI is called at vLLM's points, prefill→decode through a
store moves real KV, and every failure path ends without leaks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kvframe_refengine import (
    Engine,
    EngineConfig,
    FinishReason,
    LeakError,
    ModelConfig,
    RequestOutput,
    TinyLM,
    greedy_reference,
)

from kvframe.config import KVTransferConfig
from kvframe.errors import ConfigError, PluginNotFoundError
from kvframe.runtime.plugins import PluginHost
from tests.refengine._refengine_fake import STORES

MODEL = ModelConfig(seed=11)
_REF = TinyLM(MODEL)
BS = 4


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (n,), generator=g).tolist()


def _engine(
    host: PluginHost, store: str, role: str = "kv_both", policy: str = "recompute", **extra: Any
) -> Engine:
    kv = KVTransferConfig(
        kv_connector="fake",
        kv_role=role,  # type: ignore[arg-type]
        kv_load_failure_policy=policy,  # type: ignore[arg-type]
        kv_connector_extra_config={"store": store, **extra},
    )
    return Engine(EngineConfig(model=MODEL, block_size=BS, num_blocks=64), kv, plugin_host=host)


def _run_until(engine: Engine, rid: str, limit: int = 200) -> RequestOutput:
    for _ in range(limit):
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out
    raise AssertionError(f"{rid} did not finish: {engine.describe()}")


def _prefill(p: Engine, rid: str, prompt: list[int]) -> dict[str, Any]:
    p.add_request(rid, prompt, 1, {"do_remote_decode": True})
    out = _run_until(p, rid)
    assert out.kv_transfer_params is not None
    return dict(out.kv_transfer_params)


def _step_both(p: Engine, d: Engine, limit: int = 300) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    for _ in range(limit):
        if not (p.has_unfinished_work() or d.has_unfinished_work()):
            return outs
        outs += p.step()
        outs += d.step()
    raise AssertionError(f"not idle: P {p.describe()} D {d.describe()}")


@pytest.mark.parametrize("async_load", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("n", [8, 11], ids=["whole-blocks", "partial-block"])
def test_prefill_then_decode_moves_real_kv(
    host: PluginHost, store: str, async_load: bool, n: int
) -> None:
    prompt = _prompt(n, n)
    p = _engine(host, store, "kv_producer")
    d = _engine(host, store, "kv_consumer", async_load=async_load)
    params = _prefill(p, "req", prompt)
    # P holds the blocks for the reader: stepping is still needed with no request live.
    assert p.has_unfinished_work()
    assert not p.scheduler.requests
    with pytest.raises(LeakError, match="holding blocks: \\['req'\\]"):
        p.check_no_leaks()
    d.add_request("req-d", prompt, 5, params)
    outs = [o for o in _step_both(p, d) if o.request_id == "req-d"]
    final = outs[-1]
    assert final.finished
    assert final.finish_reason is FinishReason.LENGTH
    assert list(final.token_ids) == greedy_reference(_REF, prompt, 5)
    # D computed only the last prompt token (the load covered the whole prompt) and 4 decodes.
    assert final.num_external_tokens == n
    assert d.scheduler.counters["tokens_computed"] == 1 + 4
    assert d.scheduler.counters["external_tokens"] == n
    p.check_no_leaks()
    d.check_no_leaks()


def test_load_after_local_prefix_hit_loads_only_the_rest(host: PluginHost, store: str) -> None:
    prompt = _prompt(5, 14)
    p = _engine(host, store, "kv_producer")
    d = _engine(host, store, "kv_consumer")
    d.generate([prompt[:9]], 1)  # caches the first 2 blocks (8 tokens) on D
    params = _prefill(p, "req", prompt)
    d.add_request("req-d", prompt, 3, params)
    final = [o for o in _step_both(p, d) if o.finished][-1]
    assert final.num_cached_tokens == 8
    assert final.num_external_tokens == 6
    assert list(final.token_ids) == greedy_reference(_REF, prompt, 3)
    loads = [
        m.loads[0] for m in STORES[store].built if m.loads and m.loads[0].request_id == "req-d"
    ]
    assert len(loads[0].local_block_ids[0]) == 2  # blocks 2 and 3 of 4 remote blocks
    p.check_no_leaks()
    d.check_no_leaks()


def test_connector_events_and_stats_reach_the_engine(host: PluginHost, store: str) -> None:
    prompt = _prompt(12, 10)
    p = _engine(host, store, "kv_producer")
    d = _engine(host, store, "kv_consumer")
    params = _prefill(p, "r", prompt)
    assert p.connector_stats() == {"sending": 1}
    d.add_request("r-d", prompt, 2, params)
    _step_both(p, d)
    assert [(e.kind, dict(e.data)) for e in d.take_events()] == [
        ("fake.loaded", {"request_id": "r-d"})
    ]
    assert d.take_events() == []
    assert d.connector_stats() == {"loaded_blocks": 3, "sending": 0}
    p.check_no_leaks()
    d.check_no_leaks()


def test_waiting_for_remote_kvs_until_finished_recving(host: PluginHost, store: str) -> None:
    prompt = _prompt(2, 10)
    p = _engine(host, store, "kv_producer")
    d = _engine(host, store, "kv_consumer", load_steps=4)
    params = _prefill(p, "r", prompt)
    p.step()  # P saves into the store
    d.add_request("r", prompt, 2, params)
    for _ in range(3):
        assert d.step() == []
        assert "r" in d.scheduler.loading
        assert d.scheduler.counters["tokens_computed"] == 0
    assert d.num_idle_steps == 3
    out = _run_until(d, "r")
    assert list(out.token_ids) == greedy_reference(_REF, prompt, 2)
    _step_both(p, d)
    p.check_no_leaks()
    d.check_no_leaks()


def test_not_known_yet_leaves_request_waiting_without_blocks(host: PluginHost, store: str) -> None:
    prompt = _prompt(3, 9)
    p = _engine(host, store, "kv_producer")
    d = _engine(host, store, "kv_consumer", unknown_steps=3)
    params = _prefill(p, "r", prompt)
    p.step()
    d.add_request("r-d", prompt, 2, params)
    d.add_request("local", _prompt(4, 5), 2)  # behind it in the queue, and not blocked by it
    outs = []
    for _ in range(3):
        outs += d.step()
        assert d.scheduler.requests["r-d"].block_ids == []
    calls = STORES[store].calls
    asks = [c for c in calls if c[1] == "get_num_new_matched_tokens" and c[2] == "r-d"]
    assert len(asks) == 3
    outs += _step_both(p, d)
    finals = {o.request_id: o for o in outs if o.finished}
    assert list(finals["r-d"].token_ids) == greedy_reference(_REF, prompt, 2)
    assert list(finals["local"].token_ids) == greedy_reference(_REF, _prompt(4, 5), 2)
    p.check_no_leaks()
    d.check_no_leaks()


def test_delayed_free_is_released_by_idle_steps(host: PluginHost, store: str) -> None:
    # Nobody reads the KV: the connector's lease (lease_steps) runs out during idle steps.
    p = _engine(host, store, "kv_producer", lease_steps=5)
    _prefill(p, "r", _prompt(6, 10))
    held = p.pool.held_blocks()
    assert len(held) == 3
    steps_before = p.num_steps
    p.run_until_idle()
    assert p.num_steps - steps_before == 5
    assert p.num_idle_steps >= 5
    p.check_no_leaks()
    # The freed blocks stay in the prefix cache.
    assert p.pool.num_cached == 2


@pytest.mark.parametrize("async_load", [True, False], ids=["async", "sync"])
def test_failed_load_with_policy_fail_ends_the_request(
    host: PluginHost, store: str, async_load: bool
) -> None:
    prompt = _prompt(7, 12)
    p = _engine(host, store, "kv_producer", lease_steps=20)
    d = _engine(host, store, "kv_consumer", "fail", async_load=async_load, fail_loads=True)
    params = _prefill(p, "r", prompt)
    p.step()
    d.add_request("r", prompt, 4, params)
    out = _run_until(d, "r")
    assert out.finish_reason is FinishReason.ERROR
    assert out.error is not None
    assert "injected load failure" in out.error
    assert "kv_load_failure_policy is 'fail'" in out.error
    assert d.scheduler.counters["load_failures"] == 1
    p.run_until_idle()
    d.run_until_idle()
    p.check_no_leaks()
    d.check_no_leaks()
    # The garbage blocks were never cached: the same prompt computed locally is right.
    (again,) = d.generate([prompt], 4)
    assert again.num_cached_tokens == 0
    assert list(again.token_ids) == greedy_reference(_REF, prompt, 4)


@pytest.mark.parametrize("async_load", [True, False], ids=["async", "sync"])
def test_failed_load_with_policy_recompute_gives_right_tokens(
    host: PluginHost, store: str, async_load: bool
) -> None:
    prompt = _prompt(8, 13)
    p = _engine(host, store, "kv_producer", lease_steps=20)
    d = _engine(host, store, "kv_consumer", "recompute", async_load=async_load, fail_loads=True)
    params = _prefill(p, "r", prompt)
    p.step()
    d.add_request("r", prompt, 4, params)
    out = _run_until(d, "r")
    assert out.finish_reason is FinishReason.LENGTH
    assert list(out.token_ids) == greedy_reference(_REF, prompt, 4)
    assert out.num_external_tokens == 0
    assert d.scheduler.counters["load_failures"] == 1
    recomputed = d.scheduler.counters["tokens_computed"]
    # Async: the whole prompt once, then 3 decodes. Sync: the failed step ran the last prompt
    # token on garbage first (its token is discarded), then everything again.
    assert recomputed == (13 + 3 if async_load else 1 + 13 + 3)
    p.run_until_idle()
    p.check_no_leaks()
    d.check_no_leaks()


def test_abort_while_loading_holds_blocks_until_load_stops(host: PluginHost, store: str) -> None:
    prompt = _prompt(9, 10)
    p = _engine(host, store, "kv_producer", lease_steps=20)
    d = _engine(host, store, "kv_consumer", load_steps=20)
    params = _prefill(p, "r", prompt)
    p.step()
    d.add_request("r", prompt, 3, params)
    d.step()
    assert "r" in d.scheduler.loading
    assert d.abort("r")
    # The transfer may still write into the blocks: they stay held until the worker says so.
    assert "r" in d.scheduler.held
    assert d.pool.held_blocks()
    outs = d.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("r", FinishReason.ABORT)]
    d.run_until_idle()
    aborts = [m.abort_request_ids for m in STORES[store].built if m.abort_request_ids]
    assert aborts == [frozenset({"r"})]
    d.check_no_leaks()
    p.run_until_idle()  # nobody read it: P's lease runs out
    p.check_no_leaks()


def test_spi_call_order_in_one_step(host: PluginHost, store: str) -> None:
    d = _engine(host, store)
    calls = STORES[store].calls
    assert calls[0] == ("worker", "register_kv_caches", tuple(f"layers.{i}" for i in range(4)))
    d.add_request("a", _prompt(1, 6), 2)
    assert calls[-1] == ("sched", "on_new_request", "a")
    calls.clear()
    d.step()
    names = [(half, method) for half, method, _ in calls]
    layerwise = []
    for _ in range(MODEL.num_layers):
        layerwise += [("worker", "wait_for_layer_load"), ("worker", "save_kv_layer")]
    assert names == [
        ("sched", "get_num_new_matched_tokens"),
        ("sched", "update_state_after_alloc"),
        ("sched", "build_connector_meta"),
        ("worker", "bind_connector_metadata"),
        ("worker", "start_load_kv"),
        *layerwise,
        ("worker", "wait_for_save"),
        ("worker", "get_finished"),
        ("worker", "clear_connector_metadata"),
        ("sched", "update_connector_output"),
    ]
    assert [c[2] for c in calls if c[1] == "wait_for_layer_load"] == [
        f"layers.{i}" for i in range(4)
    ]
    calls.clear()
    _run_until(d, "a")
    assert ("sched", "request_finished", "a") in calls
    # An idle step still builds metadata and runs the worker's step calls (no forward).
    calls.clear()
    d.step()
    assert [(h, m) for h, m, _ in calls] == [
        ("sched", "build_connector_meta"),
        ("worker", "bind_connector_metadata"),
        ("worker", "start_load_kv"),
        ("worker", "wait_for_save"),
        ("worker", "get_finished"),
        ("worker", "clear_connector_metadata"),
        ("sched", "update_connector_output"),
    ]
    # The finished request is passed to the worker's get_finished in the next step.
    d.check_no_leaks()


def test_metadata_crosses_as_codec_bytes(host: PluginHost, store: str) -> None:
    p = _engine(host, store, "kv_producer", lease_steps=20)
    _prefill(p, "r", _prompt(1, 9))
    p.run_until_idle(timeout_s=30)
    s = STORES[store]
    assert len(s.built) == len(s.bound) == p.num_steps
    assert any(m.saves for m in s.bound)
    for built, bound in zip(s.built, s.bound, strict=True):
        assert built == bound
        assert built is not bound


def test_connector_refusing_a_request_fails_only_that_request(host: PluginHost, store: str) -> None:
    d = _engine(host, store)
    d.add_request("bad", _prompt(1, 5), 2, {"do_remote_prefill": True})  # no "key"
    d.add_request("good", _prompt(2, 5), 2)
    outs = {o.request_id: o for o in d.run_until_idle() if o.finished}
    assert outs["bad"].finish_reason is FinishReason.ERROR
    assert outs["bad"].error is not None
    assert "kv_transfer_params.key" in outs["bad"].error
    assert outs["good"].finish_reason is FinishReason.LENGTH
    d.check_no_leaks()


def test_connector_refusing_after_allocation_frees_the_blocks(host: PluginHost, store: str) -> None:
    d = _engine(host, store)
    d.add_request("bad", _prompt(1, 9), 2, {"refuse_alloc": True})
    outs = {o.request_id: o for o in d.run_until_idle() if o.finished}
    assert outs["bad"].finish_reason is FinishReason.ERROR
    assert outs["bad"].error is not None
    assert "refused after allocation" in outs["bad"].error
    assert ("sched", "request_finished", "bad") in STORES[store].calls
    d.check_no_leaks()


def test_connector_refusing_on_arrival_queues_nothing(host: PluginHost, store: str) -> None:
    d = _engine(host, store)
    with pytest.raises(ConfigError, match="refused on arrival"):
        d.add_request("bad", _prompt(1, 9), 2, {"refuse_new": True})
    assert not d.has_unfinished_work()
    d.add_request("bad", _prompt(1, 9), 2)  # the id was never taken
    d.run_until_idle()
    d.check_no_leaks()


def test_connector_lookup_and_layout_errors(host: PluginHost, store: str) -> None:
    cfg = EngineConfig(model=MODEL, block_size=BS, num_blocks=8)
    with pytest.raises(PluginNotFoundError):
        Engine(cfg, KVTransferConfig(kv_connector="nope", kv_role="kv_both"), plugin_host=host)
    hnd = KVTransferConfig(
        kv_connector="fake-hnd", kv_role="kv_both", kv_connector_extra_config={"store": store}
    )
    with pytest.raises(ConfigError, match="'HND'"):
        Engine(cfg, hnd, plugin_host=host)
