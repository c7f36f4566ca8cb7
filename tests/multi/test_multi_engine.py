"""MultiConnector inside the reference engine: its children come from the engine's own plugin
host (connectors registered by code included), and two children whose ``kv_transfer_params``
clash fail that request's hand-off without raising out of the step or leaking a block."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from kvframe_refengine import Engine, EngineConfig, FinishReason, ModelConfig, TinyLM
from kvframe_refengine import greedy_reference as _greedy

from kvframe.config import KVTransferConfig
from kvframe.protocol.messages import ConnectorMetadata
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.connector import (
    BuildContext,
    EngineInfo,
    KVConnector,
    KVConnectorScheduler,
    KVConnectorWorker,
    SchedulerStep,
)
from kvframe.spi.hookspecs import hookimpl
from kvframe.spi.request import BlockIds, RequestView
from kvframe.testing import FakeClock
from tests.multi.fakes import NullWorker

MODEL = ModelConfig(seed=3)
_REF = TinyLM(MODEL)
_CPU = {"tiers": [{"tier": "cpu", "capacity_bytes": 1 << 20}]}


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (n,), generator=g).tolist()


class _WatchScheduler(KVConnectorScheduler):
    def get_num_new_matched_tokens(self, request: RequestView, n: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: RequestView, blocks: BlockIds, k: int) -> None:
        _Watch.seen.append(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerStep) -> ConnectorMetadata:
        return ConnectorMetadata()


class _Watch(KVConnector):
    """Loads nothing; records the requests it was told about."""

    seen: ClassVar[list[str]] = []

    @classmethod
    def build_scheduler(
        cls, config: KVTransferConfig, engine: EngineInfo, ctx: BuildContext
    ) -> KVConnectorScheduler:
        return _WatchScheduler()

    @classmethod
    def build_worker(
        cls, config: KVTransferConfig, engine: EngineInfo, rank: int, ctx: BuildContext
    ) -> KVConnectorWorker:
        return NullWorker()


class _WatchPlugin:
    @hookimpl
    def kvframe_register_connectors(self, register: Any) -> None:
        register("watch", _Watch)


def _host() -> PluginHost:
    host = PluginHost(autoload=False, env={})
    host.load()
    return host


def test_a_child_registered_by_code_is_found_in_the_engines_host() -> None:
    host = _host()
    host.register(_WatchPlugin(), name="watch-plugin")
    cfg = EngineConfig(model=MODEL, block_size=8, num_blocks=48, torch_threads=1)
    prompt = _prompt(1, 21)
    _Watch.seen.clear()
    alone = KVTransferConfig.from_dict({"kv_connector": "watch", "kv_role": "kv_both"})
    with Engine(cfg, alone, plugin_host=host) as engine:
        (out,) = engine.generate([prompt], max_tokens=3)
        engine.check_no_leaks()
    assert list(out.token_ids) == _greedy(_REF, prompt, 3)
    multi = KVTransferConfig.from_dict(
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "connectors": [
                    {"kv_connector": "watch"},
                    {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": _CPU},
                ]
            },
        }
    )
    with Engine(cfg, multi, plugin_host=host) as engine:
        (out,) = engine.generate([prompt], max_tokens=3)
        engine.run_until_idle()
        engine.check_no_leaks()
    assert list(out.token_ids) == _greedy(_REF, prompt, 3)
    assert _Watch.seen == ["gen-0", "gen-0"]  # alone, then as child 0


def _two_pd_producers(engine_id: str) -> KVTransferConfig:
    def pd(child: str) -> dict[str, Any]:
        # Each child its own engine id: they open in-process endpoints under that name.
        return {
            "kv_connector": "PDConnector",
            "engine_id": f"{engine_id}-{child}",
            "kv_connector_extra_config": {"transport": "inprocess"},
        }

    return KVTransferConfig.from_dict(
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_producer",
            "engine_id": engine_id,
            "kv_lease_duration": 2.0,
            "kv_connector_extra_config": {"connectors": [pd("a"), pd("b")]},
        }
    )


def test_a_params_clash_fails_the_hand_off_and_frees_every_block() -> None:
    # Two P/D children on P both grant a lease and both return do_remote_prefill, ...: the
    # parameters clash. The step must not raise, the client gets no parameters (nobody can
    # read either lease), and the blocks come back when both leases expired unread.
    clock = FakeClock(1000.0)
    kv = _two_pd_producers("P-clash")
    cfg = EngineConfig(model=MODEL, block_size=8, num_blocks=48, torch_threads=1)
    with Engine(cfg, kv, plugin_host=_host(), clock=clock) as engine:
        free_before = engine.pool.num_free
        engine.add_request("r0", _prompt(2, 21), 1, {"do_remote_decode": True})
        final = None
        for _ in range(50):
            for out in engine.step():
                if out.finished:
                    final = out
            if final is not None:
                break
        assert final is not None
        assert final.finish_reason is FinishReason.LENGTH
        assert final.kv_transfer_params is None
        # Both children still hold the blocks under their leases; the engine keeps stepping
        # and serves later requests meanwhile.
        assert engine.has_unfinished_work()
        assert engine.pool.num_free < free_before
        prompt = _prompt(3, 13)
        (later,) = engine.generate([prompt], max_tokens=4)
        assert list(later.token_ids) == _greedy(_REF, prompt, 4)
        assert engine.has_unfinished_work()
        clock.advance(2.5)  # past both leases: each child reports its blocks released
        engine.run_until_idle()
        engine.check_no_leaks()
        assert engine.pool.num_free == free_before
        stats = engine.connector_stats()
        events = engine.take_events()
    failed = [e for e in events if e.kind == "multi.request_failed"]
    assert [e.data["request_id"] for e in failed] == ["r0"]
    assert "is returned by both 0.PDConnector and 1.PDConnector" in failed[0].data["reason"]
    assert stats["params_clashes"] == 1
    assert stats["0.PDConnector.leases_expired"] == 1
    assert stats["1.PDConnector.leases_expired"] == 1
