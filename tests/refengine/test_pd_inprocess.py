"""Two reference engines joined by kvframe's real P/D connector over the in-process transport:
prefill on P, decode on D, tokens equal to the dense reference, both engines clean after."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
import torch
from kvframe_refengine import Engine, EngineConfig, FinishReason, ModelConfig, TinyLM
from kvframe_refengine import greedy_reference as _greedy

from kvframe.config import KVTransferConfig
from kvframe.runtime.plugins import PluginHost

MODEL = ModelConfig(seed=3)
_REF = TinyLM(MODEL)
_ids = itertools.count()


def _engine(role: str, engine_id: str, host: PluginHost) -> Engine:
    kv = KVTransferConfig.from_dict(
        {
            "kv_connector": "PDConnector",
            "kv_role": role,
            "engine_id": engine_id,
            "kv_lease_duration": 5.0,
            "kv_connector_extra_config": {"transport": "inprocess"},
        }
    )
    cfg = EngineConfig(model=MODEL, block_size=8, num_blocks=64)
    return Engine(cfg, kv, plugin_host=host)


@pytest.fixture
def pd() -> Any:
    host = PluginHost(autoload=False, env={})
    host.load()
    n = next(_ids)
    p = _engine("kv_producer", f"refengine-P{n}", host)
    d = _engine("kv_consumer", f"refengine-D{n}", host)
    yield p, d
    d.shutdown()
    p.shutdown()


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (n,), generator=g).tolist()


def test_pd_connector_between_two_engines_gives_reference_tokens(pd: Any) -> None:
    p, d = pd
    prompts = [_prompt(1, 21), _prompt(2, 16), _prompt(3, 5)]
    for i, prompt in enumerate(prompts):
        p.add_request(f"r{i}", prompt, 1, {"do_remote_decode": True})
    params: dict[str, dict[str, Any]] = {}
    for _ in range(100):
        for out in p.step():
            if out.finished:
                assert out.finish_reason is FinishReason.LENGTH
                assert out.kv_transfer_params is not None
                params[out.request_id] = dict(out.kv_transfer_params)
        if len(params) == len(prompts):
            break
    assert len(params) == len(prompts)
    # P now holds every prompt's blocks under a lease.
    assert p.has_unfinished_work()
    for i, prompt in enumerate(prompts):
        d.add_request(f"r{i}-d", prompt, 6, params[f"r{i}"])
    finals = {}
    for _ in range(2000):
        for out in p.step() + d.step():
            if out.finished:
                finals[out.request_id] = out
        if not (p.has_unfinished_work() or d.has_unfinished_work()):
            break
        if not (p.last_step_ran_tokens or d.last_step_ran_tokens):
            time.sleep(0.001)  # waiting on transfers and notifications
    for i, prompt in enumerate(prompts):
        out = finals[f"r{i}-d"]
        assert out.finish_reason is FinishReason.LENGTH, out.error
        assert list(out.token_ids) == _greedy(_REF, prompt, 6)
        assert out.num_external_tokens == len(prompt) - 1
    # D computed only each prompt's last token and the decodes: the KV came from P.
    assert d.scheduler.counters["tokens_computed"] == len(prompts) * (1 + 5)
    p.check_no_leaks()
    d.check_no_leaks()
