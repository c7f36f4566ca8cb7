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
