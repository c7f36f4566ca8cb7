"""LRU and ARC in isolation, and a third-party policy plugged in through the hook."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

from kvframe.config import KVTransferConfig
from kvframe.connectors.offload import OffloadingConnector
from kvframe.connectors.offload.policies import ARCPolicy, LRUPolicy
from kvframe.runtime.plugins import PluginHost
from kvframe.spi.connector import BuildContext, EngineInfo
from kvframe.spi.hookspecs import hookimpl
from kvframe.spi.offload import EvictionPolicy, PolicyConfig
from tests.contexts import build_context


def k(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_lru_evicts_least_recent_and_skips_busy_keys() -> None:
    p = LRUPolicy(PolicyConfig(name="lru", capacity_blocks=4))
    for i in range(4):
        p.insert(k(i))
    p.touch(k(0))
    assert p.victims(2, lambda key: key != k(1)) == [k(2), k(3)]
    assert p.victims(4, lambda key: key != k(1)) is None  # all or nothing
    assert p.order() == [k(1), k(2), k(3), k(0)]  # victims() changed nothing


def test_arc_keeps_reused_blocks_through_a_scan() -> None:
    p = ARCPolicy(PolicyConfig(name="arc", capacity_blocks=4))
    hot = [k(100), k(101)]
    for key in hot:
        p.insert(key)
        p.touch(key)  # seen twice: frequency list T2
    for i in range(20):  # a one-off scan through the cache
        if len(p) == 4:
            (victim,) = p.victims(1, lambda key: True) or []
            p.remove(victim, evicted=True)
        p.insert(k(i))
    assert all(key in p for key in hot)
    assert set(p.lists()["t2"]) == set(hot)


def test_arc_ghost_hit_grows_the_recency_target() -> None:
    p = ARCPolicy(PolicyConfig(name="arc", capacity_blocks=2))
    p.insert(k(1))
    p.insert(k(2))
    p.remove(k(1), evicted=True)  # ghost in B1
    assert p.target == 0
    p.insert(k(1))  # a B1 ghost comes back: recency was undervalued
    assert p.target == 1
    assert k(1) in p.lists()["t2"]
    p.remove(k(2), evicted=False)  # a failure, not an eviction: no ghost
    assert k(2) not in p.lists()["b1"]


class FIFOPolicy(EvictionPolicy):
    """First in, first out: a policy written from the SPI docs alone."""

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self.keys: list[bytes] = []
        self.calls: list[str] = []

    def insert(self, key: bytes) -> None:
        self.keys.append(key)

    def touch(self, key: bytes) -> None:
        self.calls.append("touch")

    def remove(self, key: bytes, *, evicted: bool) -> None:
        self.keys.remove(key)

    def victims(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes] | None:
        out = [key for key in self.keys if can_evict(key)][:n]
        return out if len(out) == n else None

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self.keys


class _Plugin:
    @staticmethod
    @hookimpl
    def kvframe_register_eviction_policies(register: Any) -> None:
        register("fifo", FIFOPolicy)


def test_a_third_party_policy_is_found_through_the_plugin_host() -> None:
    host = PluginHost(env={}, entry_points=list)
    host.load()
    host.register(_Plugin(), "fifo-plugin")
    assert {"lru", "arc", "fifo"} <= set(host.eviction_policy_names())
    assert {"cpu", "disk"} <= set(host.offload_tier_names())
    kv = KVTransferConfig.from_dict(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "tiers": [{"tier": "cpu", "capacity_bytes": 4096}],
                "eviction_policy": "fifo",
            },
        }
    )
    sched = OffloadingConnector.build_scheduler(
        kv, EngineInfo(block_size=16), BuildContext(host=host)
    )
    sched.set_xfer_handshake_metadata({0: msgpack.packb({"block_bytes": 1024, "layout": "x"})})
    assert sched.manager is not None
    got = sched.manager.prepare_store([k(i) for i in range(4)])
    sched.manager.complete_store([key for key, _ in got], ok=True)
    got = sched.manager.prepare_store([k(9)])  # full: FIFO evicts k(0)
    assert [key for key, _ in got] == [k(9)]
    assert k(0) not in sched.manager.keys(0)


def test_without_the_workers_handshake_nothing_is_offloaded_and_it_says_so() -> None:
    kv = KVTransferConfig.from_dict(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"tiers": [{"tier": "cpu", "capacity_bytes": 4096}]},
        }
    )
    from kvframe.spi.request import RequestView

    sched = OffloadingConnector.build_scheduler(kv, EngineInfo(block_size=16), build_context())
    req = RequestView(request_id="r", num_prompt_tokens=40)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert [e.kind for e in sched.take_events()] == ["offload.inactive"]
    assert sched.request_finished(req, ((1, 2),)) == (False, None)
