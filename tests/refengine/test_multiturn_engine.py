"""The reference engine's side of multi-turn mode, with the fake connector: every view carries
the request's output tokens, and a request that does not fit makes the engine ask the connector
for blocks it keeps for later (``reclaim_blocks``), once per step, then use the freed blocks."""

from __future__ import annotations

from typing import Any

import torch
from kvframe_refengine import Engine, EngineConfig, FinishReason, ModelConfig, TinyLM
from kvframe_refengine import greedy_reference as _greedy
from kvframe_refengine.scheduler import RECLAIM_PATIENCE_STEPS

from kvframe.config import KVTransferConfig
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.connector import (
    BuildContext,
    EngineInfo,
    KVConnectorScheduler,
)
from kvframe.spi.hookspecs import hookimpl
from kvframe.spi.request import BlockIds, RequestView
from tests.refengine._refengine_fake import FakeConnector, FakeScheduler

MODEL = ModelConfig(seed=11)
_REF = TinyLM(MODEL)


class KeeperScheduler(FakeScheduler):
    """The fake producer, which also keeps a request's blocks for later and gives them back,
    oldest first, when the engine asks (the store's entry expires: the worker reports it in
    ``finished_sending`` at its next ``get_finished``). With ``promise_only`` it says it frees
    blocks but never does (a broken connector)."""

    promise_only = False

    def __init__(self, config: KVTransferConfig, engine: EngineInfo) -> None:
        super().__init__(config, engine)
        self.reclaims: list[tuple[int, float]] = []
        self.finished_views: list[RequestView] = []
        self.kept: list[tuple[str, int]] = []

    def request_finished(
        self, request: RequestView, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        self.finished_views.append(request)
        delay, params = super().request_finished(request, block_ids)
        if delay:
            self.kept.append((request.request_id, len(block_ids[0])))
        return delay, params

    def reclaim_blocks(self, num_blocks: int, now: float) -> int:
        self.reclaims.append((num_blocks, now))
        given = 0
        while self.kept and given < num_blocks:
            rid, n = self.kept.pop(0)
            if not self.promise_only:
                self.store.entries[rid].steps_left = 0
            given += n
        return given


class BrokenPromises(KeeperScheduler):
    promise_only = True


class Keeper(FakeConnector):
    scheduler_class: type[KeeperScheduler] = KeeperScheduler

    @classmethod
    def build_scheduler(
        cls, config: KVTransferConfig, engine: EngineInfo, ctx: BuildContext
    ) -> KVConnectorScheduler:
        return cls.scheduler_class(config, engine)


class BrokenKeeper(Keeper):
    scheduler_class = BrokenPromises


class KeeperPlugin:
    @hookimpl
    def kvframe_register_connectors(self, register: Any) -> None:
        register("keeper", Keeper)
        register("broken", BrokenKeeper)


def _engine(host: PluginHost, store: str, kind: str = "keeper") -> Engine:
    host.register(KeeperPlugin(), name="refengine-keeper")
    kv = KVTransferConfig(
        kv_connector=kind,
        kv_role="kv_both",
        kv_connector_extra_config={"store": store},
    )
    cfg = EngineConfig(model=MODEL, block_size=4, num_blocks=8, max_num_batched_tokens=64)
    return Engine(cfg, kv, plugin_host=host)


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, MODEL.vocab_size, (n,), generator=g).tolist()


def _keep_three(e: Engine) -> KeeperScheduler:
    """Three finished requests whose 2 blocks each the connector keeps: 6 of 8 blocks held."""
    sched = e.connector_scheduler
    assert isinstance(sched, KeeperScheduler)
    for i in range(3):
        e.add_request(f"kept{i}", _prompt(i, 7), 2, {"do_remote_decode": True})
    for _ in range(20):
        e.step()
        if len(sched.kept) == 3:
            break
    e.step()  # the worker saves the last one into the store
    assert len(e.pool.held_blocks()) == 6
    return sched


def test_views_carry_the_output_tokens(host: PluginHost, store: str) -> None:
    e = _engine(host, store)
    sched = e.connector_scheduler
    assert isinstance(sched, KeeperScheduler)
    prompt = _prompt(5, 6)
    [out] = e.generate([prompt], 3)
    [view] = sched.finished_views
    assert list(view.output_token_ids) == list(out.token_ids) == _greedy(_REF, prompt, 3)
    assert list(view.prompt_token_ids) == prompt
    e.run_until_idle()
    e.check_no_leaks()


def test_a_request_short_of_blocks_gets_the_kept_ones(host: PluginHost, store: str) -> None:
    e = _engine(host, store)
    sched = _keep_three(e)
    prompt = _prompt(9, 13)  # 13 + 4 - 1 tokens: 4 blocks, 2 free
    e.add_request("big", prompt, 4)
    e.step()  # does not fit: the engine asks for the 2 missing blocks
    assert [n for n, _ in sched.reclaims] == [2]
    assert "big" in {r.request_id for r in e.scheduler.waiting}
    assert e.scheduler.counters["reclaim_promised_blocks"] == 2
    outs = []
    for _ in range(20):
        outs += e.step()
        if any(o.finished for o in outs):
            break
    [final] = [o for o in outs if o.finished]
    assert final.finish_reason is FinishReason.LENGTH
    assert list(final.token_ids) == _greedy(_REF, prompt, 4)
    # Asked once: the promised blocks were not asked for again while they were on their way.
    assert [n for n, _ in sched.reclaims] == [2]
    # Only the oldest kept request was given back.
    assert [rid for rid, _ in sched.kept] == ["kept1", "kept2"]
    assert set(e.scheduler.held) == {"kept1", "kept2"}


def test_a_promise_never_kept_is_asked_again_after_patience(host: PluginHost, store: str) -> None:
    e = _engine(host, store, "broken")
    sched = _keep_three(e)
    e.add_request("big", _prompt(9, 13), 4)
    for _ in range(RECLAIM_PATIENCE_STEPS + 2):
        e.step()
    # The first promise (2 blocks, from kept0) never came; after the patience the engine
    # stops counting on it and asks again (kept1 is promised now).
    assert [n for n, _ in sched.reclaims] == [2, 2]
    assert "big" in e.scheduler.requests
    e.abort("big")
    e.step()


def test_without_anything_to_give_back_the_engine_asks_once_a_step(
    host: PluginHost, store: str
) -> None:
    e = _engine(host, store)
    e.add_request("a", _prompt(1, 20), 10)  # 29 tokens: 8 blocks, the whole pool
    e.add_request("b", _prompt(2, 5), 2)
    sched = e.connector_scheduler
    assert isinstance(sched, KeeperScheduler)
    for _ in range(3):
        e.step()
    assert [n for n, _ in sched.reclaims] == [2, 2, 2]  # each step: b waits for a's blocks
    assert all(isinstance(now, float) for _, now in sched.reclaims)
    e.run_until_idle()
    e.check_no_leaks()
