"""kvframe's metrics inside vLLM: the families vLLM's own ``KVConnectorProm`` gets from
``KVFrameConnector.build_prom_metrics`` are kvframe's metric catalogue under ``vllm:kvframe_*``
(the reference engine's names, labels, buckets and values), every known series is there at
zero from the start, a worker's report aggregated with the scheduler half's (as vLLM's
scheduler does) lands in the right families, and the output passes
:func:`kvframe.runtime.metrics.lint` (``prometheus_client``'s parser, kvframe's rules and
``promtool check metrics`` where installed, less promtool's rule against the ``:`` that vLLM
puts in every metric name).

vLLM is imported inside the tests: its import makes torch emit deprecation warnings that are
not ours (warnings are errors in this suite), ignored here only.
"""

from __future__ import annotations

import collections
import math
import types
from typing import Any

import pytest

from kvframe.protocol.messages import Stats

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

COLON = ("should not contain ':'",)
LABELS = {"model_name": "tiny", "engine": "0"}


def _prom() -> tuple[Any, Any]:
    """vLLM's KVConnectorProm for KVFrameConnector, its metric classes bound to a registry
    of the test's own (as vLLM's Ray variant binds its own classes)."""
    import prometheus_client
    from prometheus_client import Counter, Gauge, Histogram
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    registry = prometheus_client.CollectorRegistry()

    def bound(cls: type) -> type:
        class Registered(cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args: object, **kwargs: object) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return Registered

    class Prom(KVConnectorProm):
        _gauge_cls = bound(Gauge)
        _counter_cls = bound(Counter)
        _histogram_cls = bound(Histogram)

    kv = KVTransferConfig(
        kv_connector="KVFrameConnector",
        kv_connector_module_path="kvframe_vllm",
        kv_role="kv_both",
        engine_id="D0",
        kv_connector_extra_config={"kvframe_connector": "PDConnector"},
    )
    prom = Prom(
        types.SimpleNamespace(kv_transfer_config=kv),
        list(LABELS),
        {0: list(LABELS.values())},
    )
    return prom, registry


def _text(registry: Any) -> str:
    import prometheus_client

    return str(prometheus_client.generate_latest(registry).decode())


def _samples(text: str, prefix: str, drop: set[str]) -> dict[tuple[str, Any], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, Any], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            labels = frozenset((k, v) for k, v in s.labels.items() if k not in drop)
            out[(s.name.removeprefix(prefix), labels)] = s.value
    return out


def _observed(name: str, values: list[float], engine: str | None = None) -> dict[str, float]:
    """What the P/D worker reports for these observations (the sum, the bucket counts)."""
    from kvframe.connectors.pd.worker import observation_key

    total = {name: sum(values)} | ({f"{name}.{engine}": sum(values)} if engine else {})
    return total | dict(collections.Counter(observation_key(name, v) for v in values))


def test_every_catalogued_family_is_registered_at_zero_and_lints_clean() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from kvframe.runtime.metrics import CATALOGUE, lint

    prom, registry = _prom()
    assert type(prom.prom_metrics).__name__ == "KVFramePromMetrics"
    text = _text(registry)
    assert lint(text, promtool_ignore=COLON) == [], text
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    for spec in CATALOGUE:
        assert families.get("vllm:kvframe_" + spec.family) == spec.kind, spec.name
    s = _samples(text, "vllm:kvframe_", set())
    engine = frozenset(LABELS.items())
    assert s[("failures_total", engine | {("reason", "load_failed")})] == 0
    assert s[("leases_ended_total", engine | {("outcome", "expired")})] == 0
    assert s[("transfer_seconds_count", engine)] == 0
    assert s[("leases_held", engine)] == 0
    assert "vllm:kvframe_counter_total" not in text  # the old catch-all family is gone


def test_a_step_report_gives_the_reference_engines_values_under_vllm_names() -> None:
    from kvframe_vllm.stats import KVFrameStats

    from kvframe.runtime.metrics import lint, to_prometheus

    worker = Stats(
        counters={
            **_observed("bytes_read", [5000.0, 300_000.0], "P0"),
            **_observed("transfer_seconds", [0.0004, 0.003]),
            **_observed("load_wait_seconds", [0.001, 0.02]),
            **_observed("post_seconds", [5e-05, 0.0001]),
            "loads_done.P0": 2,
            "heartbeats_sent.P0": 3,
            "heartbeats_sent": 3,
            "notifications_unsent": 1,
            "acks": 4,  # not catalogued: a family of its own
        },
        gauges={"loads_in_flight": 1, "remote_engines": 1},
    )
    scheduler = Stats(counters={"remote_requests": 2, "bad_params": 1}, gauges={"x_level": 5})
    # vLLM's scheduler adds the scheduler half's report to the workers' before sending it on.
    report = KVFrameStats.from_kvframe(worker).aggregate(
        KVFrameStats.from_kvframe(Stats(), scheduler)
    )
    prom, registry = _prom()
    prom.observe(report.to_dict(), 0)
    text = _text(registry)
    assert lint(text, promtool_ignore=COLON) == [], text

    ours = _samples(text, "vllm:kvframe_", set(LABELS))
    reference = _samples(to_prometheus(worker, scheduler), "kvframe_", set())
    assert set(ours) == set(reference)
    for key, value in reference.items():
        assert math.isclose(ours[key], value, rel_tol=1e-9, abs_tol=1e-12), key
    done = ("loads_ended_total", frozenset({("remote_engine", "P0"), ("outcome", "done")}))
    assert ours[done] == 2
    assert ours[("failures_total", frozenset({("reason", "notification_unsent")}))] == 1
    assert ours[("failures_total", frozenset({("reason", "bad_params")}))] == 1
    assert ours[("load_bytes_count", frozenset())] == 2
    assert ours[("connector_acks_total", frozenset())] == 4
    assert ours[("scheduler_x_level", frozenset())] == 5

    prom.observe(report.to_dict(), 0)  # counters add up, gauges stay levels
    again = _samples(_text(registry), "vllm:kvframe_", set(LABELS))
    assert again[done] == 4
    assert again[("transfer_seconds_count", frozenset())] == 4
    assert again[("loads_in_flight", frozenset())] == 1


def test_scheduler_stats_aggregate_apart_and_the_log_line_skips_buckets() -> None:
    from kvframe_vllm.stats import KVFrameStats

    a = KVFrameStats.from_kvframe(
        Stats(counters={"loads_done": 1, "transfer_seconds:le=0.005": 1}), Stats(gauges={"g": 1})
    )
    b = KVFrameStats.from_kvframe(Stats(), Stats(counters={"c": 2}, gauges={"g": 3}))
    agg = a.aggregate(b)
    assert isinstance(agg, KVFrameStats)
    assert agg.scheduler_stats() == Stats(counters={"c": 2}, gauges={"g": 3})
    assert agg.reduce() == {"loads_done": 1, "scheduler.c": 2, "scheduler.now.g": 3}
    assert not KVFrameStats.from_kvframe(Stats(), Stats(counters={"c": 1})).is_empty()
    assert KVFrameStats.from_kvframe(Stats()).is_empty()
