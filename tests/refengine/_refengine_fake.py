"""A small but real connector for the reference engine's tests.

It moves real KV between two engines in one process through a named in-memory store: a
producer's request with ``{"do_remote_decode": True}`` is saved into the store when it finishes
(its blocks are held, ``delay_free``, until a consumer read them or ``lease_steps`` steps
passed); a consumer's request with the returned parameters loads the blocks back, synchronously
(layer by layer in the forward pass) or asynchronously (``load_steps`` steps later). Options in
``kv_connector_extra_config``:

- ``store`` (str, required): the store's name; engines sharing it exchange KV.
- ``async_load`` (bool, default true), ``load_steps`` (int, default 1).
- ``unknown_steps`` (int, default 0): answer "not known yet" that many times per request.
- ``fail_loads`` (bool, default false): loads write garbage and report their blocks invalid.
- ``lease_steps`` (int, default 1000): steps a saved request is kept if nobody reads it.
- ``count_last_token`` (bool, default true): offer every prompt token (the engine must still
  compute the last one itself).

Requests whose ``kv_transfer_params`` hold ``refuse_new`` or ``refuse_alloc`` make
``on_new_request`` or ``update_state_after_alloc`` raise ``ConfigError``.

Every SPI call is appended to ``store.calls`` as ``(half, method, detail)`` so tests can check
where the engine calls what.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any

import attrs
import torch

from kvframe.config import KVTransferConfig
from kvframe.errors import ConfigError
from kvframe.protocol.messages import (
    ConnectorMetadata,
    ConnectorOutput,
    KVEvent,
    LoadSpec,
    SaveSpec,
    Stats,
)
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

__all__ = ["STORES", "FakeConnector", "FakePlugin", "Store"]


@attrs.define
class Entry:
    layers: list[torch.Tensor]
    read: bool = False
    steps_left: int = 0


@attrs.define
class Store:
    entries: dict[str, Entry] = attrs.Factory(dict)
    calls: list[tuple[str, str, Any]] = attrs.Factory(list)
    built: list[ConnectorMetadata] = attrs.Factory(list)
    bound: list[ConnectorMetadata] = attrs.Factory(list)
    outputs: list[ConnectorOutput] = attrs.Factory(list)
    gone: set[str] = attrs.Factory(set)
    """Keys whose entry was read or expired: the producer no longer has them."""


STORES: dict[str, Store] = {}


@attrs.frozen
class Options:
    store: str
    async_load: bool = True
    load_steps: int = 1
    unknown_steps: int = 0
    fail_loads: bool = False
    lease_steps: int = 1000
    count_last_token: bool = True


def _options(config: KVTransferConfig) -> Options:
    extra = dict(config.kv_connector_extra_config)
    if "store" not in extra:
        raise ConfigError("kv_connector_extra_config.store: missing; name the in-memory store")
    return Options(**extra)


class FakeScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, engine: EngineInfo) -> None:
        self.o = _options(config)
        self.bs = engine.block_size
        self.store = STORES.setdefault(self.o.store, Store())
        self.unknown_left: dict[str, int] = {}
        self.loads: list[LoadSpec] = []
        self.saves: list[SaveSpec] = []
        self.aborts: set[str] = set()
        self.loading: set[str] = set()
        self.sending: set[str] = set()

    def _log(self, method: str, detail: Any = None) -> None:
        self.store.calls.append(("sched", method, detail))

    def on_new_request(self, request: RequestView) -> None:
        self._log("on_new_request", request.request_id)
        if (request.kv_transfer_params or {}).get("refuse_new"):
            raise ConfigError("kv_transfer_params.refuse_new: refused on arrival")
        self.unknown_left[request.request_id] = self.o.unknown_steps

    def get_num_new_matched_tokens(
        self, request: RequestView, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._log("get_num_new_matched_tokens", request.request_id)
        p = request.kv_transfer_params
        if not p or not p.get("do_remote_prefill"):
            return 0, False
        if "key" not in p:
            raise ConfigError("kv_transfer_params.key: missing")
        if p["key"] in self.store.gone:
            return 0, False  # expired on the producer: compute everything here
        if p["key"] not in self.store.entries:
            return None, False  # the producer has not saved it yet: ask again next step
        if self.unknown_left[request.request_id] > 0:
            self.unknown_left[request.request_id] -= 1
            return None, False
        total = p["num_tokens"] if self.o.count_last_token else p["num_tokens"] - 1
        return max(0, total - num_computed_tokens), self.o.async_load

    def update_state_after_alloc(
        self, request: RequestView, blocks: BlockIds, num_external_tokens: int
    ) -> None:
        self._log("update_state_after_alloc", (request.request_id, num_external_tokens))
        if (request.kv_transfer_params or {}).get("refuse_alloc"):
            raise ConfigError("kv_transfer_params.refuse_alloc: refused after allocation")
        if num_external_tokens == 0:
            return
        p = request.kv_transfer_params
        assert p is not None
        first = request.num_computed_tokens // self.bs
        remote = tuple(range(-(-p["num_tokens"] // self.bs)))
        self.loads.append(
            LoadSpec(
                request_id=request.request_id,
                local_block_ids=(blocks[0][first:],),
                remote_engine_id="fake-producer",
                remote_block_ids=(remote,),
                remote_request_id=p["key"],
            )
        )
        if self.o.async_load:
            self.loading.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerStep) -> ConnectorMetadata:
        self._log("build_connector_meta", scheduler_output.step)
        meta = ConnectorMetadata(
            step=scheduler_output.step,
            loads=self.loads,
            saves=self.saves,
            abort_request_ids=self.aborts,
        )
        self.loads, self.saves, self.aborts = [], [], set()
        self.store.built.append(meta)
        return meta

    def update_connector_output(self, output: ConnectorOutput) -> None:
        self._log("update_connector_output", output)
        self.loading -= output.finished_recving
        self.sending -= output.finished_sending

    def request_finished(
        self, request: RequestView, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._log("request_finished", rid)
        if rid in self.loading:
            self.aborts.add(rid)
        p = request.kv_transfer_params
        if not (p and p.get("do_remote_decode") and block_ids[0]):
            return False, None
        self.saves.append(SaveSpec(request_id=rid, block_ids=block_ids))
        self.sending.add(rid)
        return True, {
            "do_remote_prefill": True,
            "key": rid,
            "num_tokens": request.num_prompt_tokens,
        }

    def has_pending_work(self) -> bool:
        return bool(self.loading or self.sending)

    def get_stats(self) -> Stats:
        return Stats(gauges={"sending": len(self.sending)})


class FakeWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, engine: EngineInfo) -> None:
        self.o = _options(config)
        self.store = STORES.setdefault(self.o.store, Store())
        self.caches: list[torch.Tensor] = []
        self.names: list[str] = []
        self.sync_loads: list[LoadSpec] = []
        self.in_flight: dict[str, tuple[LoadSpec, int]] = {}
        self.recving: set[str] = set()
        self.errors: set[int] = set()
        self.failures: dict[str, str] = {}
        self.saved: set[str] = set()
        self.events: list[KVEvent] = []
        self.loaded_blocks = 0
        self.gen = torch.Generator().manual_seed(1234)

    def _log(self, method: str, detail: Any = None) -> None:
        self.store.calls.append(("worker", method, detail))

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        self._log("register_kv_caches", tuple(kv_caches))
        self.names = list(kv_caches)
        self.caches = list(kv_caches.values())

    def bind_connector_metadata(self, meta: ConnectorMetadata) -> None:
        self._log("bind_connector_metadata", meta.step)
        self.store.bound.append(meta)
        super().bind_connector_metadata(meta)

    def clear_connector_metadata(self) -> None:
        self._log("clear_connector_metadata")
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: Any) -> None:
        self._log("start_load_kv")
        meta = self.connector_metadata
        for save in meta.saves:
            ids = torch.tensor(save.block_ids[0], dtype=torch.long)
            self.store.entries[save.request_id] = Entry(
                layers=[c[ids].clone() for c in self.caches], steps_left=self.o.lease_steps
            )
            self.saved.add(save.request_id)
        for rid in meta.abort_request_ids:
            if self.in_flight.pop(rid, None) is not None:
                self.recving.add(rid)
        for load in meta.loads:
            if self.o.async_load:
                self.in_flight[load.request_id] = (load, self.o.load_steps)
            else:
                self.sync_loads.append(load)

    def _copy(self, load: LoadSpec, layer: int) -> None:
        local = torch.tensor(load.local_block_ids[0], dtype=torch.long)
        entry = self.store.entries.get(load.remote_request_id)
        cache = self.caches[layer]
        if self.o.fail_loads or entry is None:
            # Garbage, as a broken transfer leaves: an engine that used it would go wrong.
            shape = (len(local), *cache.shape[1:])
            cache[local] = torch.randn(shape, generator=self.gen) * 50
            self.errors.update(load.local_block_ids[0])
            self.failures[load.request_id] = "injected load failure"
            return
        remote = torch.tensor(load.remote_block_ids[0][-len(local) :], dtype=torch.long)
        cache[local] = entry.layers[layer][remote]
        if layer == len(self.caches) - 1:
            entry.read = True

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._log("wait_for_layer_load", layer_name)
        layer = self.names.index(layer_name)
        for load in self.sync_loads:
            self._copy(load, layer)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        self._log("save_kv_layer", layer_name)
        assert kv_layer is self.caches[self.names.index(layer_name)]

    def wait_for_save(self) -> None:
        self._log("wait_for_save")
        self.sync_loads = []

    def get_finished(self, finished_req_ids: Set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._log("get_finished", frozenset(finished_req_ids))
        for rid, (load, left) in list(self.in_flight.items()):
            if left > 1:
                self.in_flight[rid] = (load, left - 1)
                continue
            del self.in_flight[rid]
            for layer in range(len(self.caches)):
                self._copy(load, layer)
            self.recving.add(rid)
            self.events.append(KVEvent(kind="fake.loaded", data={"request_id": rid}))
            self.loaded_blocks += len(load.local_block_ids[0])
        sending: set[str] = set()
        for rid in list(self.saved):
            entry = self.store.entries[rid]
            entry.steps_left -= 1
            if entry.read or entry.steps_left <= 0:
                sending.add(rid)
                self.saved.discard(rid)
                del self.store.entries[rid]
                self.store.gone.add(rid)
        recving, self.recving = self.recving, set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self.errors = self.errors, set()
        return out

    def take_events(self) -> tuple[KVEvent, ...]:
        out, self.events = tuple(self.events), []
        return out

    def get_stats(self) -> Stats:
        out, self.loaded_blocks = self.loaded_blocks, 0
        return Stats(counters={"loaded_blocks": out} if out else {})

    def take_failures(self) -> Mapping[str, str]:
        out, self.failures = self.failures, {}
        return out

    def build_connector_worker_output(
        self, finished_req_ids: Set[str] = frozenset()
    ) -> ConnectorOutput:
        out = super().build_connector_worker_output(finished_req_ids)
        self.store.outputs.append(out)
        return out


class FakeConnector(KVConnector):
    @classmethod
    def build_scheduler(
        cls, config: KVTransferConfig, engine: EngineInfo, ctx: BuildContext
    ) -> KVConnectorScheduler:
        return FakeScheduler(config, engine)

    @classmethod
    def build_worker(
        cls, config: KVTransferConfig, engine: EngineInfo, rank: int, ctx: BuildContext
    ) -> KVConnectorWorker:
        return FakeWorker(config, engine)


class HNDConnector(FakeConnector):
    @classmethod
    def get_required_kvcache_layout(cls, config: KVTransferConfig, ctx: BuildContext) -> str | None:
        return "HND"


class FakePlugin:
    @hookimpl
    def kvframe_register_connectors(self, register: Any) -> None:
        register("fake", FakeConnector)
        register("fake-hnd", HNDConnector)
