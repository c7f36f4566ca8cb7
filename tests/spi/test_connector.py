"""The connector SPI: ABC behaviour, and a tiny in-process P/D connector driven through the
engine's call sequence (metadata and outputs cross as codec bytes, ranks aggregate)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Set
from typing import Any

import attrs
import pytest
import torch

from kvframe.config import KVTransferConfig
from kvframe.errors import PluginNotFoundError
from kvframe.protocol.aggregate import OutputAggregator
from kvframe.protocol.codec import DEFAULT_CODEC
from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput, LoadSpec, Stats
from kvframe.spi.connector import (
    BuildContext,
    EngineInfo,
    KVConnector,
    KVConnectorScheduler,
    KVConnectorWorker,
    PluginLookup,
    SchedulerStep,
)
from kvframe.spi.request import BlockIds, RequestView, as_block_ids
from kvframe.spi.transport import Transport, TransportParams


class _NoPlugins:
    """A plugin lookup that knows nothing: what a connector needing no plugin is built with."""

    def connector(self, name: str) -> type[KVConnector]:
        raise PluginNotFoundError(f"no connector named {name!r}")

    def create_transport(self, name: str, params: TransportParams) -> Transport:
        raise PluginNotFoundError(f"no transport named {name!r}")

    def offload_tier(self, name: str) -> Any:
        raise PluginNotFoundError(f"no offload tier named {name!r}")

    def eviction_policy(self, name: str) -> Any:
        raise PluginNotFoundError(f"no eviction policy named {name!r}")


CTX = BuildContext(host=_NoPlugins())

# -- the abstract classes --------------------------------------------------------------------


def test_abstract_methods_are_exactly_those_without_a_vllm_default() -> None:
    assert KVConnectorScheduler.__abstractmethods__ == {
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "build_connector_meta",
    }
    assert KVConnectorWorker.__abstractmethods__ == {
        "register_kv_caches",
        "start_load_kv",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_save",
    }
    assert KVConnector.__abstractmethods__ == {"build_scheduler", "build_worker"}
    with pytest.raises(TypeError, match="abstract"):
        KVConnectorScheduler()  # type: ignore[abstract]
    with pytest.raises(TypeError, match="abstract"):
        KVConnectorWorker()  # type: ignore[abstract]


class _MinimalScheduler(KVConnectorScheduler):
    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: RequestView, blocks: BlockIds, num_external_tokens: int
    ) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerStep) -> ConnectorMetadata:
        return ConnectorMetadata(step=scheduler_output.step)


class _MinimalWorker(KVConnectorWorker):
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        pass

    def start_load_kv(self, forward_context: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        pass

    def wait_for_save(self) -> None:
        pass


def test_scheduler_defaults() -> None:
    s = _MinimalScheduler()
    view = RequestView(request_id="r", num_prompt_tokens=3)
    assert s.on_new_request(view) is None  # type: ignore[func-returns-value]
    assert s.request_finished(view, ((1,),)) == (False, None)
    assert s.has_pending_work() is False
    assert s.get_stats() == Stats()
    assert s.take_events() == ()
    s.update_connector_output(ConnectorOutput())
    s.set_xfer_handshake_metadata({0: b"x"})
    s.shutdown()


def test_worker_defaults_and_metadata_binding() -> None:
    w = _MinimalWorker()
    assert w.get_finished({"r"}) == (None, None)
    assert w.get_block_ids_with_load_errors() == set()
    assert w.get_handshake_metadata() is None
    assert w.build_connector_worker_output() == ConnectorOutput()
    with pytest.raises(RuntimeError, match="bind_connector_metadata"):
        _ = w.connector_metadata
    meta = ConnectorMetadata(step=4)
    w.bind_connector_metadata(meta)
    assert w.connector_metadata is meta
    w.clear_connector_metadata()
    with pytest.raises(RuntimeError):
        _ = w.connector_metadata
    w.shutdown()


def test_connector_class_defaults_and_abstract_factories() -> None:
    class Half(KVConnector):
        @classmethod
        def build_scheduler(
            cls, config: KVTransferConfig, engine: EngineInfo, ctx: BuildContext
        ) -> Any:
            return _MinimalScheduler()

    cfg = KVTransferConfig(kv_connector="x", kv_role="kv_both")
    assert Half.requires_piecewise_for_cudagraph({}, CTX) is False
    assert Half.get_required_kvcache_layout(cfg, CTX) is None
    assert Half.__abstractmethods__ == frozenset({"build_worker"})


def test_build_context_holds_a_plugin_lookup_and_a_clock() -> None:
    import time

    from kvframe.runtime.plugins import PluginHost

    assert isinstance(PluginHost(autoload=False, env={}), PluginLookup)
    assert CTX.clock is time.monotonic
    ticks = iter(range(100))
    ctx = BuildContext(host=_NoPlugins(), clock=lambda: float(next(ticks)))
    assert (ctx.clock(), ctx.clock()) == (0.0, 1.0)
    with pytest.raises(TypeError, match=r"BuildContext\.host = 'nixl'; it must be a plugin host"):
        BuildContext(host="nixl")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"BuildContext\.clock = 3\.0; it must be callable"):
        BuildContext(host=_NoPlugins(), clock=3.0)  # type: ignore[arg-type]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        ctx.clock = time.monotonic  # type: ignore[misc]


def test_scheduler_step_and_engine_info_validate() -> None:
    step = SchedulerStep(step=2, new_requests={"a": 3}, cached_requests={"b": 1}, now=1.0)
    assert step.num_scheduled_tokens == 4
    with pytest.raises(TypeError):
        step.new_requests["c"] = 1  # type: ignore[index]
    with pytest.raises(ValueError, match="now"):
        SchedulerStep(step=0, now=math.inf)
    with pytest.raises(ValueError, match="step"):
        SchedulerStep(step=-1, now=0.0)
    with pytest.raises(ValueError, match="token counts"):
        SchedulerStep(step=0, new_requests={"a": -1}, now=0.0)
    with pytest.raises(TypeError, match="single str"):
        SchedulerStep(step=0, finished_request_ids="abc", now=0.0)
    with pytest.raises(ValueError, match="block_size"):
        EngineInfo(block_size=0)


# -- a tiny connector: D copies P's blocks straight out of P's registered tensors ----------


@attrs.define
class Fabric:
    """In-process stand-in for remote memory: what each engine's ranks registered, and which
    requests each P rank's reader has released."""

    caches: dict[tuple[str, int], Mapping[str, torch.Tensor]] = attrs.Factory(dict)
    released: dict[tuple[str, int], set[str]] = attrs.Factory(dict)


FABRICS: dict[str, Fabric] = {}


class CopyScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        self.asked: dict[str, int] = {}
        self.loads: list[LoadSpec] = []
        self.held: set[str] = set()

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        n = self.asked[request.request_id] = self.asked.get(request.request_id, 0) + 1
        if n <= params.get("wait_steps", 0):
            return None, False  # "the handshake is still in flight"
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(
        self, request: RequestView, blocks: BlockIds, num_external_tokens: int
    ) -> None:
        if num_external_tokens == 0:
            return
        params = request.kv_transfer_params
        assert params is not None
        self.loads.append(
            LoadSpec(
                request_id=request.request_id,
                local_block_ids=blocks,
                remote_engine_id=params["remote_engine_id"],
                remote_block_ids=as_block_ids(params["remote_block_ids"]),
                remote_request_id=params["remote_request_id"],
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerStep) -> ConnectorMetadata:
        meta = ConnectorMetadata(step=scheduler_output.step, loads=self.loads)
        self.loads = []
        return meta

    def update_connector_output(self, output: ConnectorOutput) -> None:
        self.held -= output.finished_sending

    def request_finished(
        self, request: RequestView, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if self.config.is_producer and params and params.get("do_remote_decode"):
            self.held.add(request.request_id)
            return True, {
                "do_remote_prefill": True,
                "remote_engine_id": self.config.engine_id,
                "remote_request_id": request.request_id,
                "remote_block_ids": [list(g) for g in block_ids],
            }
        return False, None

    def has_pending_work(self) -> bool:
        return bool(self.held)


class CopyWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, rank: int) -> None:
        assert config.engine_id is not None
        self.engine_id = config.engine_id
        self.rank = rank
        self.fabric = FABRICS[config.kv_connector_extra_config["fabric"]]
        self.caches: Mapping[str, torch.Tensor] = {}
        self.recving: set[str] = set()
        self.invalid: set[int] = set()
        self.failures: dict[str, str] = {}

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self.caches = kv_caches
        self.fabric.caches[(self.engine_id, self.rank)] = kv_caches

    def start_load_kv(self, forward_context: Any) -> None:
        for load in self.connector_metadata.loads:
            self.recving.add(load.request_id)
            src = self.fabric.caches.get((load.remote_engine_id, self.rank))
            if src is None:
                self.invalid.update(b for g in load.local_block_ids for b in g)
                self.failures[load.request_id] = f"unknown engine {load.remote_engine_id!r}"
                continue
            (local,), (remote,) = load.local_block_ids, load.remote_block_ids
            for name, dst in self.caches.items():
                dst[list(local)] = src[name][list(remote[len(remote) - len(local) :])]
            key = (load.remote_engine_id, self.rank)
            self.fabric.released.setdefault(key, set()).add(load.remote_request_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # every load here is asynchronous and already complete

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        pass  # P's blocks are read in place

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: Set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending = self.fabric.released.pop((self.engine_id, self.rank), set())
        recving, self.recving = self.recving, set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self.invalid = self.invalid, set()
        return out

    def take_failures(self) -> Mapping[str, str]:
        out, self.failures = self.failures, {}
        return out


class CopyConnector(KVConnector):
    @classmethod
    def build_scheduler(
        cls, config: KVTransferConfig, engine: EngineInfo, ctx: BuildContext
    ) -> CopyScheduler:
        return CopyScheduler(config)

    @classmethod
    def build_worker(
        cls, config: KVTransferConfig, engine: EngineInfo, rank: int, ctx: BuildContext
    ) -> CopyWorker:
        return CopyWorker(config, rank)


class MiniEngine:
    """Just enough of an engine to call the SPI in the documented order. Every request has
    ``max_tokens=1``: it finishes right after its prefill (or its load)."""

    LAYERS = ("layer0", "layer1")

    def __init__(self, config: KVTransferConfig, *, ranks: int = 2, num_blocks: int = 8) -> None:
        self.info = EngineInfo(block_size=4, world_size=ranks)
        self.scheduler = CopyConnector.build_scheduler(config, self.info, CTX)
        self.workers = [CopyConnector.build_worker(config, self.info, r, CTX) for r in range(ranks)]
        self.caches = [
            {name: torch.zeros(num_blocks, 4, 2) for name in self.LAYERS} for _ in range(ranks)
        ]
        for worker, cache in zip(self.workers, self.caches, strict=True):
            worker.register_kv_caches(cache)
        self.aggregator = OutputAggregator(ranks)
        self.free = list(range(num_blocks))
        self.waiting: dict[str, RequestView] = {}
        self.loading: dict[str, BlockIds] = {}
        self.held: dict[str, BlockIds] = {}
        self.results: dict[str, dict[str, Any] | None] = {}
        self.allocated: dict[str, BlockIds] = {}
        self.step_no = 0
        self.finished_ids: set[str] = set()

    def add(self, rid: str, prompt: int, params: Mapping[str, Any] | None = None) -> None:
        view = RequestView(request_id=rid, num_prompt_tokens=prompt, kv_transfer_params=params)
        self.scheduler.on_new_request(view)
        self.waiting[rid] = view

    def _finish(self, view: RequestView, blocks: BlockIds) -> None:
        delay, params = self.scheduler.request_finished(view, blocks)
        self.results[view.request_id] = params
        self.finished_ids.add(view.request_id)
        if delay:
            self.held[view.request_id] = blocks
        else:
            self.free.extend(blocks[0])

    def step(self) -> ConnectorOutput:
        new: dict[str, int] = {}
        for rid, view in list(self.waiting.items()):
            n, is_async = self.scheduler.get_num_new_matched_tokens(view, 0)
            if n is None:
                continue
            blocks: BlockIds = (
                tuple(self.free.pop(0) for _ in range(-(-view.num_prompt_tokens // 4))),
            )
            self.scheduler.update_state_after_alloc(view, blocks, n)
            self.allocated[rid] = blocks
            del self.waiting[rid]
            if is_async:
                self.loading[rid] = blocks
                continue
            new[rid] = view.num_prompt_tokens
            for rank, cache in enumerate(self.caches):  # "prefill": rank- and request-specific KV
                for layer in cache.values():
                    layer[list(blocks[0])] = float(sum(map(ord, rid)) + 1000 * rank)
            self._finish(attrs.evolve(view, block_ids=blocks), blocks)
        step = SchedulerStep(
            step=self.step_no, new_requests=new, finished_request_ids=self.finished_ids, now=0.0
        )
        self.finished_ids = set()
        wire = DEFAULT_CODEC.encode(self.scheduler.build_connector_meta(step))
        for rank, worker in enumerate(self.workers):
            worker.bind_connector_metadata(DEFAULT_CODEC.decode_as(wire, ConnectorMetadata))
            worker.start_load_kv(None)
            for name, layer in self.caches[rank].items():
                worker.wait_for_layer_load(name)
                worker.save_kv_layer(name, layer, None)
            worker.wait_for_save()
            out = worker.build_connector_worker_output(step.finished_request_ids)
            self.aggregator.add(
                rank, DEFAULT_CODEC.decode_as(DEFAULT_CODEC.encode(out), ConnectorOutput)
            )
            worker.clear_connector_metadata()
        output = self.aggregator.take()
        self.scheduler.update_connector_output(output)
        for rid in output.finished_sending:
            self.free.extend(self.held.pop(rid)[0])
        for rid in output.finished_recving:
            blocks = self.loading.pop(rid)
            self._finish(RequestView(request_id=rid, num_prompt_tokens=1, block_ids=blocks), blocks)
        self.step_no += 1
        return output


def _config(role: str, engine_id: str) -> KVTransferConfig:
    return KVTransferConfig.from_dict(
        {
            "kv_connector": "copy",
            "kv_role": role,
            "engine_id": engine_id,
            "kv_connector_extra_config": {"fabric": "f"},
        }
    )


@pytest.fixture
def fabric() -> Any:
    FABRICS["f"] = Fabric()
    yield FABRICS["f"]
    del FABRICS["f"]


def test_prefill_decode_through_the_spi(fabric: Fabric) -> None:
    p = MiniEngine(_config("kv_producer", "P"))
    d = MiniEngine(_config("kv_consumer", "D"))
    p.free.reverse()  # so P's and D's block ids differ

    p.add("p1", prompt=6, params={"do_remote_decode": True})
    p.step()
    params = p.results["p1"]
    assert params is not None
    assert params["remote_engine_id"] == "P"
    assert "p1" in p.held  # delay_free: P keeps the blocks for D
    assert p.scheduler.has_pending_work()  # an idle P holding blocks keeps stepping

    d.add("d1", prompt=6, params={**params, "wait_steps": 1})
    assert d.step().is_empty  # "not known yet": nothing allocated
    assert "d1" in d.waiting
    out = d.step()
    assert out.finished_recving == {"d1"}
    assert out.failures == {}
    (p_blocks,) = params["remote_block_ids"]
    (d_blocks,) = d.allocated["d1"]
    assert set(d_blocks).isdisjoint(p_blocks)
    for rank in range(2):
        for name in MiniEngine.LAYERS:
            p_cache = p.caches[rank][name]
            assert p_cache[p_blocks].abs().sum() > 0
            assert torch.equal(d.caches[rank][name][list(d_blocks)], p_cache[p_blocks])
    assert (
        d.caches[0]["layer0"][list(d_blocks)][0, 0, 0]
        != d.caches[1]["layer0"][list(d_blocks)][0, 0, 0]
    )

    # P learns that D read the blocks on its next step, on every rank, and frees them once.
    free_before = len(p.free)
    out = p.step()
    assert out.finished_sending == {"p1"}
    assert len(p.free) == free_before + 2
    assert not p.scheduler.has_pending_work()
    assert p.step().finished_sending == frozenset()


def test_a_failed_load_reports_invalid_blocks_and_a_reason(fabric: Fabric) -> None:
    d = MiniEngine(_config("kv_consumer", "D"))
    d.add(
        "d1",
        prompt=8,
        params={
            "do_remote_prefill": True,
            "remote_engine_id": "gone",
            "remote_request_id": "x",
            "remote_block_ids": [[0, 1]],
        },
    )
    out = d.step()
    assert out.finished_recving == {"d1"}
    assert out.invalid_block_ids == {0, 1}
    assert dict(out.failures) == {"d1": "unknown engine 'gone'"}
