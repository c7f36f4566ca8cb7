"""The adapter's vLLM-facing values without an engine: stats aggregation and reduction (the
Prometheus families are in test_metrics.py), and the worker report that carries failures,
events and typed records.

vLLM is imported inside the tests: its import makes torch emit deprecation warnings that are
not ours (warnings are errors in this suite), ignored here only.
"""

from __future__ import annotations

import types

import pytest

from kvframe.protocol.messages import KVEvent, Stats

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def test_stats_add_counters_and_take_the_max_of_gauges() -> None:
    from kvframe_vllm.stats import KVFrameStats

    a = KVFrameStats.from_kvframe(Stats(counters={"loads_done": 2}, gauges={"leases_held": 1}))
    b = KVFrameStats.from_kvframe(
        Stats(counters={"loads_done": 3, "bytes_read": 10}, gauges={"leases_held": 4})
    )
    agg = a.aggregate(b)
    assert agg.data == {
        "counters": {"loads_done": 5, "bytes_read": 10},
        "gauges": {"leases_held": 4},
    }
    assert agg.reduce() == {"loads_done": 5, "bytes_read": 10, "now.leases_held": 4}
    assert not agg.is_empty()
    assert agg.as_kvframe().counters["loads_done"] == 5
    agg.reset()
    assert agg.is_empty()


def test_worker_report_round_trips_and_aggregates_across_ranks() -> None:
    from kvframe_vllm.connector import KVFrameWorkerMeta

    from kvframe.config import KVTransferConfig
    from kvframe.connectors.offload import JobReport, OffloadingConnector, OffloadOutput
    from kvframe.spi.connector import codec_for

    codec = codec_for(
        OffloadingConnector, KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both")
    )
    # What vLLM carries itself (finished ids, invalid blocks, stats) is left out of the report.
    assert KVFrameWorkerMeta.pack(codec, OffloadOutput(finished_sending={"x"})) is None
    rank0 = OffloadOutput(
        failures={"r1": "transfer failed"},
        events=(KVEvent(kind="pd.x"),),
        jobs=(JobReport(job_id=3, rank=0),),
        finished_sending={"x"},
        stats=Stats(counters={"n": 1}),
    )
    rank1 = OffloadOutput(
        failures={"r1": "later reason", "r2": "lease lost"},
        events=(KVEvent(kind="pd.y", data={"a": [1]}),),
        jobs=(JobReport(job_id=3, rank=1),),
    )
    r0 = KVFrameWorkerMeta(reports=(KVFrameWorkerMeta.pack(codec, rank0) or b"",))
    r1 = KVFrameWorkerMeta(reports=(KVFrameWorkerMeta.pack(codec, rank1) or b"",))
    both = r0.aggregate(r1)
    assert isinstance(both, KVFrameWorkerMeta)
    out = both.unpack(codec)
    assert isinstance(out, OffloadOutput)  # the connector's own output class, typed records
    assert dict(out.failures) == {"r1": "transfer failed", "r2": "lease lost"}
    assert [e.kind for e in out.events] == ["pd.x", "pd.y"]
    assert out.events[1].data["a"] == (1,)
    assert [(j.job_id, j.rank) for j in out.jobs] == [(3, 0), (3, 1)]
    assert not out.finished_sending
    assert out.stats.is_empty
    with pytest.raises(ValueError, match="malformed kvframe worker report"):
        KVFrameWorkerMeta(reports=(b"\xc1",)).unpack(codec)
    with pytest.raises(TypeError, match="cannot aggregate"):
        r0.aggregate(object())  # type: ignore[arg-type]


def test_class_level_requirements_come_from_the_kvframe_connector() -> None:
    from kvframe_vllm.connector import KVFrameConnector

    from kvframe.runtime.plugins import PluginHost
    from kvframe.spi.connector import BuildContext

    host = PluginHost()
    host.load()
    ctx = BuildContext(host=host)
    for name in ("PDConnector", "OffloadingConnector"):
        extra = {"kvframe_connector": name}
        if name == "OffloadingConnector":
            extra["tiers"] = [{"tier": "cpu", "capacity_bytes": 1 << 20}]  # type: ignore[assignment]
        inner = {k: v for k, v in extra.items() if k != "kvframe_connector"}
        assert KVFrameConnector.requires_piecewise_for_cudagraph(extra) == host.connector(
            name
        ).requires_piecewise_for_cudagraph(inner, ctx)
        vllm_config = types.SimpleNamespace(
            kv_transfer_config=types.SimpleNamespace(
                kv_role="kv_both",
                engine_id="e",
                kv_connector_extra_config=extra,
                kv_load_failure_policy="recompute",
            )
        )
        assert KVFrameConnector.get_required_kvcache_layout(vllm_config) is None


def test_unknown_kvframe_connector_lists_the_installed_ones() -> None:
    from kvframe_vllm.config import AdapterConfig
    from kvframe_vllm.connector import connector_class

    from kvframe.errors import PluginNotFoundError

    adapter = AdapterConfig.from_fields(
        kv_role="kv_both", engine_id="e", extra={"kvframe_connector": "PDConector"}
    )
    with pytest.raises(PluginNotFoundError, match="PDConnector"):
        connector_class(adapter)
