"""A prefill engine and a decode engine driven by Hypothesis: random arrivals, shared prefixes,
aborts at any moment, failing loads under either policy, a pool small enough to evict. Every
finished request must carry the reference tokens, and both engines must end idle and clean."""

from __future__ import annotations

import functools
import itertools

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvframe_refengine import Engine, EngineConfig, FinishReason, ModelConfig, TinyLM
from kvframe_refengine import greedy_reference as _greedy

from kvframe.config import KVTransferConfig
from kvframe.runtime.plugins import PluginHost
from tests.refengine._refengine_fake import STORES, FakePlugin

MODEL = ModelConfig(seed=5)
_REF = TinyLM(MODEL)
MAX_TOKENS = 4
_PREFIXES = [
    torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(s)).tolist()
    for s in range(3)
]
_ids = itertools.count()


@functools.cache
def _reference(prompt: tuple[int, ...]) -> list[int]:
    return _greedy(_REF, list(prompt), MAX_TOKENS)


class TwoEngines(RuleBasedStateMachine):
    @initialize(
        async_load=st.booleans(),
        fail_loads=st.booleans(),
        policy=st.sampled_from(["fail", "recompute"]),
        chunk=st.sampled_from([5, 64]),
    )
    def build(self, async_load: bool, fail_loads: bool, policy: str, chunk: int) -> None:
        host = PluginHost(autoload=False, env={})
        host.load()
        host.register(FakePlugin(), name="refengine-fake")
        self.store = f"machine-{next(_ids)}"
        cfg = EngineConfig(
            model=MODEL, block_size=4, num_blocks=14, max_num_seqs=3, max_num_batched_tokens=chunk
        )

        def kv(role: str, **extra: object) -> KVTransferConfig:
            return KVTransferConfig(
                kv_connector="fake",
                kv_role=role,  # type: ignore[arg-type]
                kv_load_failure_policy=policy,  # type: ignore[arg-type]
                kv_connector_extra_config={"store": self.store, **extra},
            )

        self.p = Engine(cfg, kv("kv_producer", lease_steps=30), plugin_host=host)
        self.d = Engine(
            cfg,
            kv("kv_consumer", async_load=async_load, fail_loads=fail_loads, load_steps=2),
            plugin_host=host,
        )
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.live: set[str] = set()
        self.aborted: set[str] = set()
        self.policy = policy

    def teardown(self) -> None:
        if not hasattr(self, "p"):
            return
        try:
            for _ in range(400):
                if not (self.p.has_unfinished_work() or self.d.has_unfinished_work()):
                    break
                self._step()
            self.p.check_no_leaks()
            self.d.check_no_leaks()
        finally:
            self.p.shutdown()
            self.d.shutdown()
            STORES.pop(self.store, None)

    def _prompt(self, prefix: int, tail: list[int]) -> tuple[int, ...]:
        return tuple(_PREFIXES[prefix][: 4 + len(tail)] + tail)

    @rule(prefix=st.integers(0, 2), tail=st.lists(st.integers(0, 511), max_size=4))
    def add_local(self, prefix: int, tail: list[int]) -> None:
        rid = f"d{next(_ids)}"
        prompt = self._prompt(prefix, tail)
        self.prompts[rid] = prompt
        self.live.add(rid)
        self.d.add_request(rid, list(prompt), MAX_TOKENS)

    @rule(prefix=st.integers(0, 2), tail=st.lists(st.integers(0, 511), max_size=4))
    def add_disaggregated(self, prefix: int, tail: list[int]) -> None:
        rid = f"p{next(_ids)}"
        self.prompts[rid] = self._prompt(prefix, tail)
        self.live.add(rid)
        self.p.add_request(rid, list(self.prompts[rid]), 1, {"do_remote_decode": True})

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        engine = self.p if rid.startswith("p") and rid in self.p.scheduler.requests else self.d
        if engine.abort(rid):
            self.aborted.add(rid)

    @rule()
    def step(self) -> None:
        self._step()

    def _step(self) -> None:
        for out in self.p.step():
            if not out.finished:
                continue
            self.live.discard(out.request_id)
            if out.finish_reason is FinishReason.LENGTH and out.kv_transfer_params is not None:
                # Hand the request to the decode engine, as a router would.
                rid = f"{out.request_id}-d"
                self.prompts[rid] = self.prompts[out.request_id]
                self.live.add(rid)
                self.d.add_request(
                    rid, list(self.prompts[rid]), MAX_TOKENS, dict(out.kv_transfer_params)
                )
        for out in self.d.step():
            if not out.finished:
                continue
            self.live.discard(out.request_id)
            reason = out.finish_reason
            if reason is FinishReason.LENGTH:
                assert list(out.token_ids) == _reference(self.prompts[out.request_id])
            elif reason is FinishReason.ABORT:
                assert out.request_id in self.aborted
            else:
                assert reason is FinishReason.ERROR
                assert self.policy == "fail", out.error

    @invariant()
    def pools_are_sound(self) -> None:
        if hasattr(self, "p"):
            self.p.pool.check_invariants()
            self.d.pool.check_invariants()
            assert len(self.d.scheduler.running) + len(self.d.scheduler.loading) <= 3


# Each example builds two engines and steps them idle: cap the thorough profile's count so this
# test stays well under a minute there too.
TwoEngines.TestCase.settings = settings(
    stateful_step_count=25, max_examples=min(settings().max_examples, 80)
)
TestTwoEngines = TwoEngines.TestCase
