"""kvframe statistics in vLLM's logging and Prometheus.

A kvframe worker reports :class:`~kvframe.protocol.messages.Stats` (counters add up, gauges
are levels). vLLM carries a connector's stats from the workers to the scheduler and the
frontend as a ``KVConnectorStats`` whose ``data`` is plain values; here ``data`` is
``{"counters": {name: number}, "gauges": {name: number}}``. Aggregation follows kvframe's rule:
counters add, gauges take the maximum (the most loaded rank).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvframe.protocol.messages import Stats

__all__ = ["KVFramePromMetrics", "KVFrameStats"]


class KVFrameStats(KVConnectorStats):
    """kvframe counters and gauges as vLLM connector stats (``data`` holds plain dicts)."""

    @classmethod
    def from_kvframe(cls, stats: Stats) -> KVFrameStats:
        """Wrap one report."""
        return cls(
            data={"counters": dict(stats.counters), "gauges": dict(stats.gauges)},
        )

    def as_kvframe(self) -> Stats:
        """The kvframe value; raises ``ValueError``/``TypeError`` for malformed ``data``."""
        return Stats(
            counters=dict(self.data.get("counters", {})), gauges=dict(self.data.get("gauges", {}))
        )

    def reset(self) -> None:
        """Forget everything."""
        self.data: dict[str, Any] = {"counters": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Counters add, gauges take the maximum. Returns ``self`` (updated)."""
        counters: dict[str, float] = dict(self.data.get("counters", {}))
        gauges: dict[str, float] = dict(self.data.get("gauges", {}))
        for k, v in other.data.get("counters", {}).items():
            counters[k] = counters.get(k, 0) + v
        for k, v in other.data.get("gauges", {}).items():
            gauges[k] = max(gauges.get(k, v), v)
        self.data = {"counters": counters, "gauges": gauges}
        return self

    def reduce(self) -> dict[str, int | float]:
        """One flat mapping for vLLM's log line (gauges prefixed ``now.``)."""
        out: dict[str, int | float] = dict(self.data.get("counters", {}))
        out.update({f"now.{k}": v for k, v in self.data.get("gauges", {}).items()})
        return out

    def is_empty(self) -> bool:
        """True when there is neither a counter nor a gauge."""
        return not self.data.get("counters") and not self.data.get("gauges")


class KVFramePromMetrics(KVConnectorPromMetrics):
    """Two labelled families: ``vllm:kvframe_counter_total{name=...}`` (counters, per
    engine) and ``vllm:kvframe_gauge{name=...}``. A per-remote-engine counter
    (``name.<engine>``) keeps its dotted name as the label value."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counter = self._counter_cls(
            name="vllm:kvframe_counter",
            documentation="kvframe connector counters (see the connector's docs for names)",
            labelnames=[*labelnames, "name"],
        )
        self._gauge = self._gauge_cls(
            name="vllm:kvframe_gauge",
            documentation="kvframe connector gauges (latest value, most loaded rank)",
            labelnames=[*labelnames, "name"],
            multiprocess_mode="mostrecent",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add the counters and set the gauges of one stats report."""
        labels = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for k, v in transfer_stats_data.get("counters", {}).items():
            if v > 0:
                self._counter.labels(*labels, k).inc(v)
        for k, v in transfer_stats_data.get("gauges", {}).items():
            self._gauge.labels(*labels, k).set(v)
