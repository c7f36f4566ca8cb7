from __future__ import annotations

from kvframe.protocol.messages import Stats
from kvframe.runtime.metrics import StatsAccumulator, to_prometheus


def test_prometheus_text_with_engine_labels() -> None:
    acc = StatsAccumulator()
    acc.add(Stats(counters={"bytes_read": 10, "bytes_read.P0": 10}, gauges={"leases_held": 3}))
    acc.add(Stats(counters={"bytes_read": 5, "bytes_read.P1": 5}, gauges={"leases_held": 1}))
    text = to_prometheus(acc.snapshot(), labels={"engine_id": "D0"})
    assert "# TYPE kvframe_bytes_read_total counter" in text
    assert 'kvframe_bytes_read_total{engine_id="D0"} 15' in text
    assert 'kvframe_bytes_read_total{engine_id="D0",remote_engine="P0"} 10' in text
    assert 'kvframe_bytes_read_total{engine_id="D0",remote_engine="P1"} 5' in text
    assert 'kvframe_leases_held{engine_id="D0"} 1' in text
    assert text.count("# TYPE kvframe_bytes_read_total") == 1


def test_empty_stats_render_nothing() -> None:
    assert to_prometheus(Stats()) == ""


def test_multiconnector_child_prefixes_become_a_child_label() -> None:
    stats = Stats(
        counters={
            "0.PDConnector.loads_done": 2,
            "0.PDConnector.loads_done.P1": 2,
            "1.OffloadingConnector.stores": 3,
        },
        gauges={"holding": 1},
    )
    text = to_prometheus(stats)
    assert 'kvframe_loads_done_total{child="0.PDConnector"} 2' in text
    assert 'kvframe_loads_done_total{child="0.PDConnector",remote_engine="P1"} 2' in text
    assert 'kvframe_stores_total{child="1.OffloadingConnector"} 3' in text
    assert "kvframe_holding 1" in text
    assert 'remote_engine="PDConnector' not in text
