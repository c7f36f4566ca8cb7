"""Two worker ranks under one offloading scheduler: each rank keeps its slice of every block,
and a job counts as done only when both ranks reported it. The ranks' job reports travel as
typed values (OffloadOutput.jobs) through the connector's codec and the aggregator."""

from __future__ import annotations

import time

import pytest
import torch

from kvframe.config import KVTransferConfig
from kvframe.connectors.offload import JobReport, OffloadingConnector, OffloadOutput
from kvframe.errors import CodecError
from kvframe.protocol.aggregate import OutputAggregator
from kvframe.protocol.messages import ConnectorMetadata, ConnectorOutput
from kvframe.spi.connector import EngineInfo, SchedulerStep, codec_for
from kvframe.spi.request import RequestView, block_hashes
from tests.contexts import build_context

BS = 16


def test_store_waits_for_both_ranks_then_loads_each_slice() -> None:
    cfg = KVTransferConfig.from_dict(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"tiers": [{"tier": "cpu", "capacity_bytes": 1 << 18}]},
        }
    )
    info = EngineInfo(block_size=BS, world_size=2)
    ctx = build_context()
    sched = OffloadingConnector.build_scheduler(cfg, info, ctx)
    workers = [OffloadingConnector.build_worker(cfg, info, r, ctx) for r in range(2)]
    kvs = [{f"l{i}": torch.rand((16, 2, BS, 1, 8)) for i in range(2)} for _ in range(2)]
    for w, kv in zip(workers, kvs, strict=True):
        w.register_kv_caches(kv)
    sched.set_xfer_handshake_metadata(
        {r: w.get_handshake_metadata() or b"" for r, w in enumerate(workers)}
    )
    agg = OutputAggregator(2)
    codec = codec_for(OffloadingConnector, cfg)
    step_no = 0

    def build() -> bytes:
        nonlocal step_no
        meta = sched.build_connector_meta(SchedulerStep(step=step_no, now=time.monotonic()))
        step_no += 1
        return codec.encode(meta)

    def run(blob: bytes, ranks: tuple[int, ...] = (0, 1)) -> ConnectorOutput:
        for r in ranks:
            w, kv = workers[r], kvs[r]
            w.bind_connector_metadata(codec.decode_as(blob, ConnectorMetadata))
            w.start_load_kv(None)
            for name, t in kv.items():
                w.wait_for_layer_load(name)
                w.save_kv_layer(name, t, None)
            w.wait_for_save()
            w.wait_idle()
            out = w.build_connector_worker_output()
            agg.add(r, codec.decode_as(codec.encode(out), ConnectorOutput))
            w.clear_connector_metadata()
        out = agg.take()
        sched.update_connector_output(out)
        return out

    try:
        hashes = block_hashes(list(range(64)), BS)
        done = RequestView(
            request_id="a",
            num_prompt_tokens=64,
            num_computed_tokens=64,
            block_hashes=hashes,
            finish_reason="stop",
        )
        assert sched.request_finished(done, ((1, 2, 3, 4),)) == (True, None)
        expected = [{n: t[[1, 2, 3]].clone() for n, t in kv.items()} for kv in kvs]
        blob = build()
        out = run(blob, ranks=(0,))  # rank 1 has not run this step yet
        assert "a" not in out.finished_sending
        assert isinstance(out, OffloadOutput)
        assert [(j.rank, dict(j.failed)) for j in out.jobs] == [(0, {})]  # rank 0's store
        assert sched.manager is not None
        new = RequestView(request_id="b", num_prompt_tokens=64, block_hashes=hashes)
        assert sched.get_num_new_matched_tokens(new, 0) == (None, False)  # still being stored
        out = run(blob, ranks=(1,))
        assert "a" in out.finished_sending
        assert isinstance(out, OffloadOutput)
        assert [j.rank for j in out.jobs] == [1]
        assert sched.get_num_new_matched_tokens(new, 0) == (48, False)
        sched.update_state_after_alloc(new, ((9, 10, 11, 12),), 48)
        run(build())
        for kv, exp in zip(kvs, expected, strict=True):
            for n, t in kv.items():
                assert torch.equal(t[[9, 10, 11]], exp[n])
        assert not sched.has_pending_work()
    finally:
        for w in workers:
            w.shutdown()
        sched.shutdown()


def _cfg() -> KVTransferConfig:
    return KVTransferConfig.from_dict(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"tiers": [{"tier": "cpu", "capacity_bytes": 1 << 18}]},
        }
    )


def test_job_reports_round_trip_as_typed_values_and_aggregate_in_rank_order() -> None:
    codec = codec_for(OffloadingConnector, _cfg())
    key = bytes(range(32))
    r0 = OffloadOutput(jobs=(JobReport(job_id=7, rank=0, failed={key: "nospace"}, error="full"),))
    r1 = OffloadOutput(jobs=(JobReport(job_id=7, rank=1),), finished_sending={"a"})
    back = [codec.decode_as(codec.encode(o), ConnectorOutput) for o in (r0, r1)]
    assert back == [r0, r1]
    assert all(type(b) is OffloadOutput for b in back)
    agg = OutputAggregator(2)
    agg.add(1, back[1])
    agg.add(0, back[0])
    out = agg.take()
    assert isinstance(out, OffloadOutput)
    assert [(j.job_id, j.rank) for j in out.jobs] == [(7, 0), (7, 1)]
    assert out.jobs[0].failed == {key: "nospace"}
    assert not out.events  # the reports are no longer smuggled in events


def test_a_job_report_with_an_unknown_failure_code_is_refused() -> None:
    with pytest.raises(ValueError, match="codes one of"):
        JobReport(job_id=1, rank=0, failed={b"k": "gone"})
    codec = codec_for(OffloadingConnector, _cfg())
    job = JobReport(job_id=1, rank=0, failed={b"k": "nospace"})
    bad = codec.encode(OffloadOutput(jobs=(job,))).replace(b"nospace", b"nowhere")
    with pytest.raises(CodecError, match="not a valid JobReport"):
        codec.decode(bad)
