"""MultiConnector: SPI coverage by reflection, load ownership, delayed free, params clash, the
children's outputs travelling as typed values (MultiOutput), and P/D + offloading on D never
storing blocks that did not finish loading (vLLM #34526)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Set
from typing import Any

import attrs
import pytest

from kvframe.config import KVTransferConfig
from kvframe.connectors.multi import (
    REQUEST_FAILED_EVENT,
    ChildOutput,
    MultiConnector,
    MultiConnectorScheduler,
    MultiConnectorWorker,
    MultiMetadata,
    MultiOutput,
)
from kvframe.connectors.offload.scheduler import OffloadingScheduler
from kvframe.errors import ConfigError
from kvframe.protocol.aggregate import OutputAggregator
from kvframe.protocol.codec import DEFAULT_CODEC
from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput
from kvframe.spi.connector import (
    EngineInfo,
    KVConnector,
    KVConnectorScheduler,
    KVConnectorWorker,
    SchedulerStep,
    codec_for,
)
from kvframe.spi.request import BlockIds, RequestView, block_hashes
from tests.contexts import build_context
from tests.multi.fakes import NullWorker


def _public(cls: type) -> set[str]:
    return {n for n, v in inspect.getmembers(cls) if not n.startswith("_") and callable(v)}


@pytest.mark.parametrize(
    ("base", "multi"),
    [
        (KVConnectorScheduler, MultiConnectorScheduler),
        (KVConnectorWorker, MultiConnectorWorker),
        (KVConnector, MultiConnector),
    ],
)
def test_every_spi_method_is_handled(base: type, multi: type) -> None:
    # A method added to the SPI and not overridden here would silently skip the children.
    exempt = {"connector_metadata"} if base is KVConnectorWorker else set()
    missing = sorted(n for n in _public(base) - exempt if n not in vars(multi))
    assert not missing, f"{multi.__name__} does not handle {missing}"


#: The engine's codec for a MultiConnector: what its metadata_types name, whatever the children.
MULTI = codec_for(
    MultiConnector, KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both")
)


def _bind(w: MultiConnectorWorker, **kw: Any) -> None:
    blobs = tuple(DEFAULT_CODEC.encode(ConnectorMetadata()) for _ in range(2))
    w.bind_connector_metadata(MULTI.decode(MULTI.encode(MultiMetadata(children=blobs, **kw))))


def test_finished_recving_only_from_the_owner_and_once() -> None:
    a, b = NullWorker(), NullWorker()
    w = MultiConnectorWorker(["0.A", "1.B"], [a, b], [DEFAULT_CODEC, DEFAULT_CODEC], 0)
    _bind(w, load_owners={"r": 0})
    a.recving, b.recving = {"r"}, {"r"}  # both report it: vLLM's union would report it twice
    out = w.build_connector_worker_output()
    assert out.finished_recving == {"r"}
    b.recving = {"r"}  # a late duplicate from the non-owner
    w.clear_connector_metadata()
    _bind(w)
    assert w.build_connector_worker_output().finished_recving == frozenset()


def test_blocks_freed_only_when_every_holder_is_done() -> None:
    a, b = NullWorker(), NullWorker()
    w = MultiConnectorWorker(["0.A", "1.B"], [a, b], [DEFAULT_CODEC, DEFAULT_CODEC], 0)
    _bind(w, holders={"r": (0, 1)})
    a.sending = {"r"}
    assert w.build_connector_worker_output().finished_sending == frozenset()
    b.sending = {"r"}
    assert w.build_connector_worker_output().finished_sending == {"r"}


class _FakeSched(KVConnectorScheduler):
    def __init__(
        self,
        answer: tuple[int | None, bool],
        params: dict[str, Any] | None,
        *,
        delay: bool = False,
    ) -> None:
        self.answer = answer
        self.params = params
        self.delay = delay
        self.allocs: list[int] = []

    def get_num_new_matched_tokens(self, request: RequestView, n: int) -> tuple[int | None, bool]:
        return self.answer

    def update_state_after_alloc(self, request: RequestView, blocks: BlockIds, k: int) -> None:
        self.allocs.append(k)

    def build_connector_meta(self, scheduler_output: SchedulerStep) -> ConnectorMetadata:
        return ConnectorMetadata()

    def request_finished(
        self, request: RequestView, block_ids: BlockIds
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.delay, self.params


def _sched(*children: _FakeSched) -> MultiConnectorScheduler:
    labels = [f"{i}.Fake" for i in range(len(children))]
    return MultiConnectorScheduler(labels, list(children), [DEFAULT_CODEC] * len(children), 1)


def test_first_non_zero_child_owns_the_load_and_none_means_not_known_yet() -> None:
    a, b, c = (
        _FakeSched((0, False), None),
        _FakeSched((32, True), None),
        _FakeSched((48, False), None),
    )
    m = _sched(a, b, c)
    req = RequestView(request_id="r", num_prompt_tokens=64)
    assert m.get_num_new_matched_tokens(req, 0) == (32, True)
    m.update_state_after_alloc(req, ((1, 2),), 32)
    assert (a.allocs, b.allocs, c.allocs) == ([0], [32], [0])
    assert _sched(_FakeSched((None, False), None), b).get_num_new_matched_tokens(req, 0) == (
        None,
        False,
    )


def test_kv_transfer_params_merge_and_a_clash_fails_the_hand_off() -> None:
    req = RequestView(request_id="r", num_prompt_tokens=4, finish_reason="stop")
    ok = _sched(_FakeSched((0, False), {"a": 1}), _FakeSched((0, False), {"b": 2}))
    assert ok.request_finished(req, ((1,),)) == (False, {"a": 1, "b": 2})
    # Child 0 keeps the blocks (a lease it granted), child 1's parameters clash with its own.
    bad = _sched(
        _FakeSched((0, False), {"a": 1}, delay=True),
        _FakeSched((0, False), {"a": 2}),
        _FakeSched((0, False), None, delay=True),
    )
    assert bad.request_finished(req, ((1,),)) == (True, None)  # never raises
    (event,) = bad.take_events()
    assert event.kind == REQUEST_FAILED_EVENT
    assert event.data["request_id"] == "r"
    assert event.data["key"] == "a"
    assert event.data["children"] == ("0.Fake", "1.Fake")
    assert "'a' is returned by both 0.Fake and 1.Fake" in event.data["reason"]
    assert bad.get_stats().counters["params_clashes"] == 1
    # Both children that keep blocks are still waited for: the blocks come back once both
    # reported them released, never earlier, never twice.
    meta = bad.build_connector_meta(SchedulerStep(step=0, now=0.0))
    assert meta.holders == {"r": (0, 2)}
    assert bad.has_pending_work()
    a, b, c = NullWorker(), NullWorker(), NullWorker()
    w = MultiConnectorWorker(["0.Fake", "1.Fake", "2.Fake"], [a, b, c], [DEFAULT_CODEC] * 3, 0)
    blobs = tuple(DEFAULT_CODEC.encode(ConnectorMetadata()) for _ in range(3))
    w.bind_connector_metadata(MultiMetadata(children=blobs, holders=meta.holders))
    a.sending = {"r"}
    assert w.build_connector_worker_output().finished_sending == frozenset()
    c.sending = {"r"}
    out = w.build_connector_worker_output()
    assert out.finished_sending == {"r"}
    bad.update_connector_output(out)
    assert not bad.has_pending_work()


@attrs.frozen(kw_only=True)
class _NotesOutput(ConnectorOutput):
    """A child connector's own output class: typed records for its scheduler half."""

    notes: tuple[str, ...] = ()


class _NotesConnector(KVConnector):
    @classmethod
    def metadata_types(cls, config: KVTransferConfig) -> Mapping[str, type[Any]]:
        return {"tests.notes_output": _NotesOutput}

    @classmethod
    def build_scheduler(cls, config: Any, engine: Any, ctx: Any) -> KVConnectorScheduler:
        raise NotImplementedError

    @classmethod
    def build_worker(cls, config: Any, engine: Any, rank: int, ctx: Any) -> KVConnectorWorker:
        raise NotImplementedError


NOTES = codec_for(_NotesConnector, KVTransferConfig(kv_connector="Notes", kv_role="kv_both"))


class _NotesWorker(NullWorker):
    def __init__(self) -> None:
        super().__init__()
        self.notes: list[str] = []

    def build_connector_worker_output(
        self, finished_req_ids: Set[str] = frozenset()
    ) -> _NotesOutput:
        out = super().build_connector_worker_output(finished_req_ids)
        notes, self.notes = tuple(self.notes), []
        return _NotesOutput(**attrs.asdict(out, recurse=False), notes=notes)


class _RecordingSched(_FakeSched):
    def __init__(self) -> None:
        super().__init__((0, False), None)
        self.outputs: list[ConnectorOutput] = []

    def update_connector_output(self, output: ConnectorOutput) -> None:
        self.outputs.append(output)


def test_children_outputs_travel_as_typed_values_and_reach_their_child_per_rank() -> None:
    codecs = [DEFAULT_CODEC, NOTES]
    blobs = tuple(c.encode(ConnectorMetadata()) for c in codecs)
    engine_agg = OutputAggregator(2)
    for rank in range(2):
        plain, notes = NullWorker(), _NotesWorker()
        w = MultiConnectorWorker(["0.Null", "1.Notes"], [plain, notes], codecs, rank)
        w.bind_connector_metadata(MULTI.decode(MULTI.encode(MultiMetadata(children=blobs))))
        notes.notes = [f"from rank {rank}"]
        out = w.build_connector_worker_output()
        assert type(out) is MultiOutput
        assert [(c.child, c.rank) for c in out.children] == [(1, rank)]  # child 0: nothing
        assert not out.events  # no child output is smuggled in an event any more
        child = NOTES.decode_as(out.children[0].output, ConnectorOutput)
        assert child == _NotesOutput(notes=(f"from rank {rank}",))
        wire = MULTI.decode_as(MULTI.encode(out), ConnectorOutput)
        assert wire == out
        engine_agg.add(rank, wire)
        w.clear_connector_metadata()
    aggregated = engine_agg.take()
    assert isinstance(aggregated, MultiOutput)
    assert [(c.child, c.rank) for c in aggregated.children] == [(1, 0), (1, 1)]
    a, b = _RecordingSched(), _RecordingSched()
    m = MultiConnectorScheduler(["0.Null", "1.Notes"], [a, b], codecs, 2)
    m.update_connector_output(aggregated)
    assert a.outputs == [ConnectorOutput()]
    assert b.outputs == [_NotesOutput(notes=("from rank 0", "from rank 1"))]
    assert "malformed_child_reports" not in m.get_stats().counters


def test_child_reports_that_cannot_be_placed_are_counted_and_the_rest_delivered() -> None:
    a, b = _RecordingSched(), _RecordingSched()
    m = MultiConnectorScheduler(["0.Null", "1.Notes"], [a, b], [DEFAULT_CODEC, NOTES], 1)
    good = NOTES.encode(_NotesOutput(notes=("ok",)))
    m.update_connector_output(
        MultiOutput(
            children=(
                ChildOutput(child=5, rank=0, output=good),  # no such child
                ChildOutput(child=1, rank=3, output=good),  # no such rank
                ChildOutput(child=1, rank=0, output=b"not a message"),
                ChildOutput(child=0, rank=0, output=good),  # child 0's codec has no notes
                ChildOutput(child=1, rank=0, output=good),
            )
        )
    )
    assert m.get_stats().counters["malformed_child_reports"] == 4
    assert b.outputs == [_NotesOutput(notes=("ok",))]
    m.update_connector_output(ConnectorOutput())  # an output without children: nothing to give
    assert b.outputs[-1] == ConnectorOutput()


def test_required_layouts_must_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvframe.connectors.offload import OffloadingConnector
    from kvframe.connectors.pd import PDConnector

    cfg = KVTransferConfig.from_dict(
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_consumer",
            "engine_id": "d",
            "kv_connector_extra_config": {
                "connectors": [
                    {
                        "kv_connector": "PDConnector",
                        "kv_connector_extra_config": {"transport": "inprocess"},
                    },
                    {
                        "kv_connector": "OffloadingConnector",
                        "kv_connector_extra_config": {
                            "tiers": [{"tier": "cpu", "capacity_bytes": 1 << 20}]
                        },
                    },
                ]
            },
        }
    )
    ctx = build_context()
    assert MultiConnector.get_required_kvcache_layout(cfg, ctx) is None
    monkeypatch.setattr(
        PDConnector, "get_required_kvcache_layout", classmethod(lambda c, k, x: "HND")
    )
    assert MultiConnector.get_required_kvcache_layout(cfg, ctx) == "HND"
    monkeypatch.setattr(
        OffloadingConnector, "get_required_kvcache_layout", classmethod(lambda c, k, x: "NHD")
    )
    with pytest.raises(ConfigError, match="different KV cache layouts"):
        MultiConnector.get_required_kvcache_layout(cfg, ctx)


# -- P/D + offloading on D, over the in-process transport --------------------------------------

BS = 16


class _MultiD:
    """D: a MultiConnector(P/D consumer, offloading) driven like tests/pd/driver.Driver."""

    def __init__(self, engine_id: str) -> None:
        import torch

        from tests.pd.driver import LAYERS, SHAPE

        self.config = KVTransferConfig.from_dict(
            {
                "kv_connector": "MultiConnector",
                "kv_role": "kv_consumer",
                "engine_id": engine_id,
                "kv_lease_duration": 3.0,
                "kv_connector_extra_config": {
                    "connectors": [
                        {
                            "kv_connector": "PDConnector",
                            "kv_connector_extra_config": {"transport": "inprocess"},
                        },
                        {
                            "kv_connector": "OffloadingConnector",
                            "kv_connector_extra_config": {
                                "tiers": [{"tier": "cpu", "capacity_bytes": 1 << 20}]
                            },
                        },
                    ]
                },
            }
        )
        ctx = build_context()
        info = EngineInfo(block_size=BS, model="test-model")
        self.sched = MultiConnector.build_scheduler(self.config, info, ctx)
        self.worker = MultiConnector.build_worker(self.config, info, 0, ctx)
        self.kv = {f"layer{i}": torch.zeros((32, *SHAPE)) for i in range(LAYERS)}
        self.worker.register_kv_caches(self.kv)
        self.sched.set_xfer_handshake_metadata({0: self.worker.get_handshake_metadata() or b""})
        self.step_no = 0
        self.outputs: list[ConnectorOutput] = []
        self.metas: list[MultiMetadata] = []
        self.scheduled: dict[str, int] = {}
        self.per_request: dict[str, Any] = {}
        """SchedulerStep's per-request fields for the next step (an engine that reports them)."""

    def step(self) -> ConnectorOutput:
        import time

        meta = self.sched.build_connector_meta(
            SchedulerStep(
                step=self.step_no,
                now=time.monotonic(),
                new_requests=self.scheduled,
                **self.per_request,
            )
        )
        self.scheduled = {}
        self.per_request = {}
        self.step_no += 1
        bound = MULTI.decode_as(MULTI.encode(meta), MultiMetadata)
        self.metas.append(bound)
        self.worker.bind_connector_metadata(bound)
        self.worker.start_load_kv(None)
        for name, t in self.kv.items():
            self.worker.wait_for_layer_load(name)
            self.worker.save_kv_layer(name, t, None)
        self.worker.wait_for_save()
        out = self.worker.build_connector_worker_output()
        self.worker.clear_connector_metadata()
        out = MULTI.decode_as(MULTI.encode(out), ConnectorOutput)
        assert isinstance(out, MultiOutput)
        self.sched.update_connector_output(out)
        self.outputs.append(out)
        return out

    def offload(self) -> OffloadingScheduler:
        child = self.sched.children[1]
        assert isinstance(child, OffloadingScheduler)
        return child

    def shutdown(self) -> None:
        self.sched.shutdown()
        self.worker.shutdown()


def _stored_requests(d: _MultiD) -> set[str]:
    from kvframe.connectors.offload import OffloadingConnector
    from kvframe.connectors.offload.metadata import OffloadMetadata

    out: set[str] = set()
    codec = codec_for(OffloadingConnector, d.config.connectors[1])
    for m in d.metas:
        om = codec.decode_as(m.children[1], OffloadMetadata)
        out |= {s.request_id for s in om.offload_stores}
    return out


@pytest.mark.parametrize(("abort", "per_step"), [(True, False), (False, False), (False, True)])
def test_pd_plus_offloading_never_stores_unloaded_blocks(abort: bool, per_step: bool) -> None:
    """``per_step``: D's engine reports per-step state (``SchedulerStep.num_computed_tokens``
    and friends), so the offloading child stores in the step that ran the request, not at
    finish."""
    from tests.pd.driver import Driver, run_until

    tokens = list(range(1, 65))
    p = Driver(f"P-multi-{abort}-{per_step}", "kv_producer")
    d = _MultiD(f"D-multi-{abort}-{per_step}")
    try:
        p.fill([3, 4, 5, 6], seed=7)
        _, params = p.sched.request_finished(
            RequestView(
                request_id="r1",
                num_prompt_tokens=64,
                kv_transfer_params={"do_remote_decode": True},
                finish_reason="length",
            ),
            ((3, 4, 5, 6),),
        )
        p.step()
        hashes = block_hashes(tokens, BS)
        req = RequestView(
            request_id="d1", num_prompt_tokens=64, kv_transfer_params=params, block_hashes=hashes
        )
        d.sched.on_new_request(req)
        n, is_async = d.sched.get_num_new_matched_tokens(req, 0)
        assert (n, is_async) == (63, True)  # the P/D child owns the load
        d.sched.update_state_after_alloc(req, ((10, 11, 12, 13),), n)
        if abort:
            # vLLM counts the external tokens as computed while they load (#34526).
            gone = RequestView(
                request_id="d1",
                num_prompt_tokens=64,
                num_computed_tokens=63,
                block_hashes=hashes,
                finish_reason="abort",
            )
            delay, _ = d.sched.request_finished(gone, ((10, 11, 12, 13),))
            # The P/D child stops the read and reports the request in finished_recving; the
            # engine keeps an async load's blocks until then, whatever request_finished says.
            assert delay is False
            run_until([p, d], lambda: any("d1" in o.finished_recving for o in d.outputs))  # type: ignore[list-item]
            assert "d1" not in _stored_requests(d)
            assert d.offload().manager is not None
            assert d.offload().manager.keys(0) == frozenset()
        else:
            run_until([p, d], lambda: any("d1" in o.finished_recving for o in d.outputs))  # type: ignore[list-item]
            assert sum("d1" in o.finished_recving for o in d.outputs) == 1
            # Nothing was stored while the blocks were loading (the request never ran).
            assert "d1" not in _stored_requests(d)
            d.scheduled = {"d1": 1}
            if per_step:
                d.per_request = {
                    "new_block_ids": {"d1": ((10, 11, 12, 13),)},
                    "num_computed_tokens": {"d1": 64},
                    "block_hashes": {"d1": hashes},
                }
            d.step()
            if per_step:
                # Stored in the step that ran it, before it finishes: all 4 blocks are in.
                assert "d1" in _stored_requests(d)
                manager = d.offload().manager
                assert manager is not None
                assert len(manager.keys(0)) == 4
            done = RequestView(
                request_id="d1",
                num_prompt_tokens=64,
                num_computed_tokens=64,
                block_hashes=hashes,
                finish_reason="length",
            )
            delay, _ = d.sched.request_finished(done, ((10, 11, 12, 13),))
            if per_step:
                assert delay is False  # stored already; nothing is left to copy out
            else:
                assert delay is True  # the offloading child copies the loaded blocks out
                run_until([p, d], lambda: any("d1" in o.finished_sending for o in d.outputs))  # type: ignore[list-item]
            assert "d1" in _stored_requests(d)
            run_until([p, d], lambda: not d.sched.has_pending_work())  # type: ignore[list-item]
            manager = d.offload().manager
            assert manager is not None
            assert len(manager.keys(0)) == 4
            counters = d.sched.get_stats().counters
            assert any(k.startswith("1.OffloadingConnector.") for k in counters)
    finally:
        d.shutdown()
        p.shutdown()


def test_two_offloading_children_on_the_reference_engine_stay_apart() -> None:
    from kvframe_refengine import Engine, EngineConfig

    cpu = {"tiers": [{"tier": "cpu", "capacity_bytes": 1 << 20}]}
    kv = KVTransferConfig.from_dict(
        {
            "kv_connector": "MultiConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "connectors": [
                    {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": cpu},
                    {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": cpu},
                ]
            },
        }
    )
    prompt = [(i * 5 + 1) % 200 + 1 for i in range(70)]
    cfg = EngineConfig(torch_threads=1, num_blocks=48, enable_prefix_caching=False)
    with Engine(cfg, kv) as engine:
        first = engine.generate([prompt], max_tokens=3)[0]
        engine.run_until_idle()
        second = engine.generate([prompt], max_tokens=3)[0]
        engine.run_until_idle()
        engine.check_no_leaks()  # blocks kept by both children were released once both were done
        assert second.token_ids == first.token_ids
        assert second.num_external_tokens == 64
        stats = engine.connector_stats()
        events = engine.take_events()
    # Each child stored the blocks once, under its own name.
    assert stats["0.OffloadingConnector.tier0_used_blocks"] == 4
    assert stats["1.OffloadingConnector.tier0_used_blocks"] == 4
    stored = [e.kind for e in events if e.kind.endswith("offload.stored")]
    assert sorted(set(stored)) == [
        "0.OffloadingConnector.offload.stored",
        "1.OffloadingConnector.offload.stored",
    ]
