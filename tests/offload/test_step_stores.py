"""Stores during steps: the SPI's per-step fields, and the offloading connector storing each
full block in the step that computed it (prefill and decode), on the reference engine and
against a real worker."""

from __future__ import annotations

import time
from typing import Any

import attrs
import pytest
import torch
from kvframe_refengine import Engine, EngineConfig

from kvframe.config import KVTransferConfig
from kvframe.connectors.offload import OffloadingConnector
from kvframe.connectors.offload.metadata import OffloadMetadata
from kvframe.connectors.offload.scheduler import OffloadingScheduler
from kvframe.connectors.offload.worker import OffloadingWorker
from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput
from kvframe.spi.connector import EngineInfo, SchedulerStep, codec_for
from kvframe.spi.offload import offload_key
from kvframe.spi.request import RequestView, block_hashes
from tests.contexts import build_context

BS = 16
PROMPT = [(i * 11 + 5) % 240 + 1 for i in range(80)]  # 5 full blocks


def _kv(cpu: int = 1 << 20) -> KVTransferConfig:
    return KVTransferConfig.from_dict(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"tiers": [{"tier": "cpu", "capacity_bytes": cpu}]},
        }
    )


def _engine(**overrides: Any) -> Engine:
    cfg = EngineConfig(torch_threads=1, num_blocks=48, enable_prefix_caching=False, **overrides)
    return Engine(cfg, _kv())


def _sched(e: Engine) -> OffloadingScheduler:
    s = e.connector_scheduler
    assert isinstance(s, OffloadingScheduler)
    return s


def _ready_keys(e: Engine) -> frozenset[bytes]:
    from kvframe.connectors.offload.manager import EntryState

    m = _sched(e).manager
    assert m is not None
    return frozenset(k for k in m.keys(0) if (st := m.state(0, k)) and st[0] is EntryState.READY)


def _keys_of(e: Engine, tokens: list[int]) -> list[bytes]:
    ns = _sched(e)._namespace
    return [offload_key(h, ns) for h in block_hashes(tokens, BS)]


# -- the SPI -----------------------------------------------------------------------------------


def test_scheduler_step_per_request_fields_default_empty_and_are_read_only() -> None:
    step = SchedulerStep(step=0, now=0.0)
    assert (step.new_block_ids, step.num_computed_tokens, step.block_hashes) == ({}, {}, {})
    h = block_hashes(list(range(32)), BS)
    step = SchedulerStep(
        step=1,
        now=0.0,
        new_requests={"a": 32},
        cached_requests={"b": 1},
        new_block_ids={"a": [[1, 2]], "b": ((7,),)},
        num_computed_tokens={"a": 32, "b": 40},
        block_hashes={"a": list(h)},
    )
    assert step.new_block_ids == {"a": ((1, 2),), "b": ((7,),)}
    assert step.block_hashes["a"] == h
    with pytest.raises(TypeError):
        step.num_computed_tokens["a"] = 1  # type: ignore[index]


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"num_computed_tokens": {"x": 3}}, ValueError, r"not scheduled this step: \['x'\]"),
        ({"new_block_ids": {"x": ((1,),)}}, ValueError, "new_block_ids names requests"),
        ({"block_hashes": {"x": ()}}, ValueError, "block_hashes names requests"),
        ({"cached_requests": {"a": 1}}, ValueError, "in both new_requests and cached_requests"),
        ({"new_block_ids": {"a": ((-1,),)}}, ValueError, r"new_block_ids\['a'\]"),
        ({"new_block_ids": {"a": "12"}}, TypeError, r"new_block_ids\['a'\]"),
        ({"num_computed_tokens": {"a": -1}}, ValueError, "non-negative"),
        ({"block_hashes": {"a": [b"short"]}}, ValueError, r"block_hashes\['a'\]\[0\].*32 bytes"),
        ({"block_hashes": {"a": b"x" * 32}}, TypeError, "sequences of block hashes"),
    ],
)
def test_scheduler_step_rejects_malformed_per_request_fields(
    fields: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        SchedulerStep(step=0, now=0.0, new_requests={"a": 16}, **fields)


# -- on the reference engine --------------------------------------------------------------------


def test_blocks_are_stored_during_a_chunked_prefill_and_only_full_computed_ones() -> None:
    # 24-token chunks: after the first step 1.5 blocks are computed, so exactly one is stored.
    with _engine(max_num_batched_tokens=24) as e:
        keys = _keys_of(e, PROMPT)
        e.add_request("a", PROMPT, max_tokens=3)
        e.step()
        assert _ready_keys(e) == {keys[0]}
        e.step()  # 48 computed: blocks 0..2
        assert _ready_keys(e) == set(keys[:3])
        e.step()  # 72 computed: blocks 0..3; the fifth is not complete
        assert _ready_keys(e) == set(keys[:4])
        assert "a" in e.scheduler.requests  # still prefilling
        while "a" in e.scheduler.requests:
            e.step()
        # 80 prompt + 2 generated tokens have KV (the last sampled one never gets any).
        assert _ready_keys(e) == set(keys[:5])
        assert not e.scheduler.held  # nothing left for request_finished: no delayed free
        counters = e.connector_stats()
        assert counters.get("stores_during_steps", 0) == 5
        e.run_until_idle()
        e.check_no_leaks()


def test_decode_blocks_are_stored_when_their_last_token_is_computed() -> None:
    prompt = PROMPT[:40]  # 2.5 blocks; decoding fills the third at the 48th token
    with _engine() as e:
        e.add_request("a", prompt, max_tokens=12)
        outs = [t for o in e.step() for t in o.new_token_ids]  # prefill: 40 computed
        assert len(_ready_keys(e)) == 2
        while len(prompt) + len(outs) < 49:
            for o in e.step():
                outs.extend(o.new_token_ids)
        # 48 tokens computed now: the third block (with generated tokens in it) is stored.
        tokens = prompt + outs
        assert _ready_keys(e) == set(_keys_of(e, tokens[:48]))
        e.run_until_idle()
        e.check_no_leaks()


def test_a_second_request_hits_blocks_stored_while_the_first_is_still_decoding() -> None:
    with _engine() as e:
        e.add_request("first", PROMPT, max_tokens=20)
        e.step()
        e.step()
        assert "first" in e.scheduler.requests
        e.add_request("second", PROMPT, max_tokens=2)
        second = None
        while second is None:
            for o in e.step():
                if o.request_id == "second" and o.finished:
                    second = o
        assert "first" in e.scheduler.requests  # still decoding
        assert second.num_external_tokens == 64  # 4 blocks: the 5th holds the last token
        e.run_until_idle()
        e.check_no_leaks()


def test_stored_blocks_load_back_with_equal_output() -> None:
    with _engine(max_num_batched_tokens=24) as e:
        first = e.generate([PROMPT], max_tokens=6)[0]
        again = e.generate([PROMPT], max_tokens=6)[0]
        assert again.token_ids == first.token_ids
        assert again.num_external_tokens == 64
        e.run_until_idle()
        e.check_no_leaks()


def test_an_engine_without_per_step_state_still_stores_at_finish() -> None:
    # What an engine that fills only the old fields gets: the store at finish, delay_free.
    cfg = _kv()
    info = EngineInfo(block_size=BS)
    ctx = build_context()
    sched = OffloadingConnector.build_scheduler(cfg, info, ctx)
    worker = OffloadingConnector.build_worker(cfg, info, 0, ctx)
    kv = {f"l{i}": torch.rand((16, 2, BS, 1, 8)) for i in range(2)}
    try:
        worker.register_kv_caches(kv)
        sched.set_xfer_handshake_metadata({0: worker.get_handshake_metadata() or b""})
        hashes = block_hashes(list(range(64)), BS)
        req = RequestView(request_id="a", num_prompt_tokens=64, block_hashes=hashes)
        assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
        sched.update_state_after_alloc(req, ((1, 2, 3, 4),), 0)
        meta = sched.build_connector_meta(SchedulerStep(step=0, now=0.0, new_requests={"a": 64}))
        assert not meta.offload_stores
        done = RequestView(
            request_id="a",
            num_prompt_tokens=64,
            num_computed_tokens=64,
            block_hashes=hashes,
            finish_reason="length",
        )
        assert sched.request_finished(done, ((1, 2, 3, 4),)) == (True, None)
        meta = sched.build_connector_meta(SchedulerStep(step=1, now=0.0))
        assert [j.held for j in meta.offload_stores] == [True]
    finally:
        worker.shutdown()
        sched.shutdown()


# -- scheduler and worker, driven by hand --------------------------------------------------------


class _Pair:
    def __init__(self) -> None:
        cfg = _kv()
        info = EngineInfo(block_size=BS)
        ctx = build_context()
        self.sched = OffloadingConnector.build_scheduler(cfg, info, ctx)
        self.worker: OffloadingWorker = OffloadingConnector.build_worker(cfg, info, 0, ctx)
        self.kv = {f"l{i}": torch.rand((16, 2, BS, 1, 8)) for i in range(2)}
        self.worker.register_kv_caches(self.kv)
        self.sched.set_xfer_handshake_metadata({0: self.worker.get_handshake_metadata() or b""})
        self.codec = codec_for(OffloadingConnector, cfg)
        self.n = 0

    def step(self, invalid: frozenset[int] = frozenset(), **fields: Any) -> OffloadMetadata:
        meta = self.sched.build_connector_meta(
            SchedulerStep(step=self.n, now=time.monotonic(), **fields)
        )
        self.n += 1
        blob = self.codec.encode(meta)
        self.worker.bind_connector_metadata(self.codec.decode_as(blob, ConnectorMetadata))
        self.worker.start_load_kv(None)
        for name, t in self.kv.items():
            self.worker.wait_for_layer_load(name)
            self.worker.save_kv_layer(name, t, None)
        self.worker.wait_for_save()
        self.after_save()
        out = self.worker.build_connector_worker_output()
        self.worker.clear_connector_metadata()
        out = self.codec.decode_as(self.codec.encode(out), ConnectorOutput)
        if invalid:
            out = attrs.evolve(out, invalid_block_ids=invalid)
        self.sched.update_connector_output(out)
        self.last = out
        return meta

    clobber = False
    """Overwrite every KV block right after ``wait_for_save``, as an engine reusing freed
    blocks in the next step would."""

    def after_save(self) -> None:
        if self.clobber:
            for t in self.kv.values():
                t.fill_(-1.0)

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def test_wait_for_save_returns_only_after_the_step_stores_are_copied(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = OffloadingWorker._store_layer

    def slow(self: OffloadingWorker, name: str, job: Any) -> None:
        time.sleep(0.02)  # a copy still running when the engine would reuse the blocks
        real(self, name, job)

    monkeypatch.setattr(OffloadingWorker, "_store_layer", slow)
    p = _Pair()
    p.clobber = True
    try:
        before = {n: t[[1, 2]].clone() for n, t in p.kv.items()}
        hashes = block_hashes(list(range(40)), BS)
        meta = p.step(
            new_requests={"a": 40},
            new_block_ids={"a": ((1, 2, 3),)},
            num_computed_tokens={"a": 40},
            block_hashes={"a": hashes},
        )
        assert [(j.held, j.block_ids) for j in meta.offload_stores] == [(False, (1, 2))]
        assert not p.last.finished_sending  # the request holds nothing back
        assert p.last.stats.counters["save_waits"] == 1  # the engine thread waited once
        assert p.sched.manager is not None
        for t in p.kv.values():
            t.zero_()
        req = RequestView(request_id="b", num_prompt_tokens=40, block_hashes=hashes)
        assert p.sched.get_num_new_matched_tokens(req, 0) == (32, False)
        p.sched.update_state_after_alloc(req, ((5, 6, 7),), 32)
        p.clobber = False
        p.step()
        for n, t in p.kv.items():
            assert torch.equal(t[[5, 6]], before[n])  # the values of before the clobbering
    finally:
        p.shutdown()


def test_running_request_stores_new_blocks_as_steps_append_them() -> None:
    p = _Pair()
    try:
        tokens = list(range(64))
        hashes = block_hashes(tokens, BS)
        m1 = p.step(
            new_requests={"a": 20},
            new_block_ids={"a": ((4, 9),)},
            num_computed_tokens={"a": 20},
            block_hashes={"a": hashes[:1]},
        )
        assert [j.block_ids for j in m1.offload_stores] == [(4,)]
        # Hashes known beyond what is computed: nothing before its KV is complete.
        m2 = p.step(
            cached_requests={"a": 10}, num_computed_tokens={"a": 30}, block_hashes={"a": hashes}
        )
        assert not m2.offload_stores
        m3 = p.step(
            cached_requests={"a": 20},
            new_block_ids={"a": ((2,),)},
            num_computed_tokens={"a": 50},
            block_hashes={"a": hashes},
        )
        assert [j.block_ids for j in m3.offload_stores] == [(9, 2)]
        done = RequestView(
            request_id="a",
            num_prompt_tokens=64,
            num_computed_tokens=50,
            block_hashes=hashes,
            finish_reason="stop",
        )
        assert p.sched.request_finished(done, ((4, 9, 2, 11),)) == (False, None)
    finally:
        p.shutdown()


def test_a_failed_load_drops_the_stores_computed_over_it() -> None:
    p = _Pair()
    try:
        hashes = block_hashes(list(range(64)), BS)
        p.step(
            new_requests={"a": 64},
            new_block_ids={"a": ((1, 2, 3, 4),)},
            num_computed_tokens={"a": 64},
            block_hashes={"a": hashes},
            invalid=frozenset({2}),  # block 1 of the request failed to load this step
        )
        m = p.sched.manager
        assert m is not None
        ns = p.sched._namespace
        keys = [offload_key(h, ns) for h in hashes]
        assert m.keys(0) == {keys[0]}  # blocks from the bad one on are not trusted
        assert p.sched.get_stats().counters["stores_dropped_invalid"] == 3
        # The engine recomputes from the bad block; those blocks are stored once computed.
        meta = p.step(cached_requests={"a": 48}, num_computed_tokens={"a": 64})
        assert [j.keys for j in meta.offload_stores] == [tuple(keys[1:])]
        assert m.keys(0) == set(keys)
    finally:
        p.shutdown()
