"""kvframe statistics in vLLM's logging and Prometheus.

A kvframe worker reports :class:`~kvframe.protocol.messages.Stats` (counters add up, gauges
are levels). vLLM carries a connector's stats from the workers to the scheduler and the
frontend as a ``KVConnectorStats`` whose ``data`` is plain values; here ``data`` is
``{"counters": {name: number}, "gauges": {name: number}}`` (the workers'), plus
``"scheduler": {"counters": ..., "gauges": ...}`` for the scheduler half's, which the
scheduler-side connector reports and vLLM adds to the workers'. Aggregation follows kvframe's
rule: counters add, gauges take the maximum (the most loaded rank).

In Prometheus the families are kvframe's metric catalogue
(:data:`kvframe.runtime.metrics.CATALOGUE`, docs/metrics.md) under ``vllm:kvframe_*``: the
same names, labels and buckets as the reference engine's ``kvframe_*``, with vLLM's own labels
(``model_name``, ``engine``) first.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvframe.protocol.messages import Stats
from kvframe.runtime.metrics import CATALOGUE, HistogramSample, MetricSpec, collect, replay

__all__ = ["PROM_PREFIX", "KVFramePromMetrics", "KVFrameStats"]

#: What vLLM's kvframe families are called: ``vllm:kvframe_<catalogue name>``.
PROM_PREFIX = "vllm:kvframe_"

_log = logging.getLogger(__name__)
_SIDES = ("counters", "gauges")


def _part(data: Any) -> dict[str, dict[str, float]]:
    data = data if isinstance(data, dict) else {}
    return {k: dict(data.get(k) or {}) for k in _SIDES}


def _merge(a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]) -> None:
    for k, v in b["counters"].items():
        a["counters"][k] = a["counters"].get(k, 0) + v
    for k, v in b["gauges"].items():
        a["gauges"][k] = max(a["gauges"].get(k, v), v)


class KVFrameStats(KVConnectorStats):
    """kvframe counters and gauges as vLLM connector stats (``data`` holds plain dicts)."""

    @classmethod
    def from_kvframe(cls, stats: Stats, scheduler: Stats | None = None) -> KVFrameStats:
        """Wrap one report (a worker's ``stats``; the scheduler half's ``scheduler``)."""
        data: dict[str, Any] = {"counters": dict(stats.counters), "gauges": dict(stats.gauges)}
        if scheduler is not None:
            data["scheduler"] = {
                "counters": dict(scheduler.counters),
                "gauges": dict(scheduler.gauges),
            }
        return cls(data=data)

    def as_kvframe(self) -> Stats:
        """The workers' kvframe value; raises ``ValueError``/``TypeError`` for malformed
        ``data``."""
        return Stats(
            counters=dict(self.data.get("counters", {})), gauges=dict(self.data.get("gauges", {}))
        )

    def scheduler_stats(self) -> Stats | None:
        """The scheduler half's kvframe value, if this carries one (raises like
        :meth:`as_kvframe`)."""
        part = self.data.get("scheduler")
        if part is None:
            return None
        return Stats(counters=dict(part.get("counters", {})), gauges=dict(part.get("gauges", {})))

    def reset(self) -> None:
        """Forget everything."""
        self.data: dict[str, Any] = {"counters": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Counters add, gauges take the maximum, the workers' and the scheduler half's
        apart. Returns ``self`` (updated)."""
        mine = _part(self.data)
        _merge(mine, _part(other.data))
        data: dict[str, Any] = dict(mine)
        if "scheduler" in self.data or "scheduler" in other.data:
            sched = _part(self.data.get("scheduler"))
            _merge(sched, _part(other.data.get("scheduler")))
            data["scheduler"] = sched
        self.data = data
        return self

    def reduce(self) -> dict[str, int | float]:
        """One flat mapping for vLLM's log line: counters, gauges prefixed ``now.``, the
        scheduler half's prefixed ``scheduler.`` (histogram bucket counts left out)."""
        out: dict[str, int | float] = {}
        for prefix, part in (("", self.data), ("scheduler.", self.data.get("scheduler"))):
            p = _part(part)
            out.update({prefix + k: v for k, v in p["counters"].items() if ":le=" not in k})
            out.update({f"{prefix}now.{k}": v for k, v in p["gauges"].items()})
        return out

    def is_empty(self) -> bool:
        """True when there is neither a counter nor a gauge."""
        sched = _part(self.data.get("scheduler"))
        return not (
            self.data.get("counters")
            or self.data.get("gauges")
            or sched["counters"]
            or sched["gauges"]
        )


class KVFramePromMetrics(KVConnectorPromMetrics):
    """kvframe's metric catalogue as vLLM Prometheus metrics (``vllm:kvframe_*``).

    Every family is registered at start through vLLM's metric classes (so vLLM's multiprocess
    and Ray modes apply), and every series whose labels are known is created at zero for each
    of vLLM's engines. :meth:`observe` adds a report's counters, sets its gauges and observes
    its histogram counts (through :func:`~kvframe.runtime.metrics.replay`: exactly the counts
    and sum kvframe reported). Stats the catalogue does not name get a family each on first
    sight (``vllm:kvframe_connector_<name>``, ``vllm:kvframe_scheduler_<name>``)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._base_labels = list(labelnames)
        self._metrics: dict[str, Any] = {}
        for spec in CATALOGUE:
            metric = self._register(spec)
            if spec.per_engine:
                continue  # its series come with the remote engines
            for values in per_engine_labelvalues.values():
                engine = [str(v) for v in values]
                for label_value in spec.by or (None,):
                    metric.labels(*engine, *(() if label_value is None else (label_value,)))

    def _register(self, spec: MetricSpec) -> Any:
        name = PROM_PREFIX + spec.family
        labelnames = [*self._base_labels, *spec.labelnames]
        metric: Any
        if spec.kind == "counter":
            metric = self._counter_cls(name=name, documentation=spec.help, labelnames=labelnames)
        elif spec.kind == "gauge":
            metric = self._gauge_cls(
                name=name,
                documentation=spec.help,
                labelnames=labelnames,
                multiprocess_mode="mostrecent",
            )
        else:
            metric = self._histogram_cls(
                name=name,
                documentation=spec.help,
                labelnames=labelnames,
                buckets=list(spec.buckets),
            )
        self._metrics[spec.name] = metric
        return metric

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Record one (aggregated) stats report of vLLM engine ``engine_idx``."""
        stats = KVFrameStats(data=transfer_stats_data)
        try:
            worker, scheduler = stats.as_kvframe(), stats.scheduler_stats()
        except (TypeError, ValueError) as exc:
            _log.warning("kvframe: malformed connector stats left out of Prometheus: %s", exc)
            return
        engine = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        for fam in collect(worker, scheduler, zeros=False):
            metric = self._metrics.get(fam.spec.name)
            if metric is None:
                metric = self._register(fam.spec)
            for s in fam.samples:
                if fam.spec.per_engine and fam.spec.by:
                    for label_value in fam.spec.by:  # every outcome of a remote engine seen
                        metric.labels(*engine, s.labels[0], label_value)
                child = metric.labels(*engine, *s.labels)
                if isinstance(s, HistogramSample):
                    for value in replay(s.buckets, s.sum):
                        child.observe(value)
                elif fam.spec.kind == "counter":
                    if s.value > 0:
                        child.inc(s.value)
                else:
                    child.set(s.value)
