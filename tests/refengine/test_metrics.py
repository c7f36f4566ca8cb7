"""The reference engines' and the router's ``/metrics``, scraped from real servers: every
family of kvframe's catalogue is there from the start at zero, the output passes
:func:`kvframe.runtime.metrics.lint` (``prometheus_client``'s parser, kvframe's dashboard rules
and ``promtool check metrics`` where it is installed) before and after traffic, and the
numbers are the traffic's: loads per remote engine, one histogram observation per load,
leases on P, requests and backend failures on the router."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvframe.runtime.metrics import CATALOGUE, lint
from tests.refengine._http import Served, complete, engine_server, request, router_server

BODY = {"prompt": "a prompt of a few more tokens than one block", "max_tokens": 3}
ROUTER_FAMILIES = {
    "kvframe_router_requests": "counter",
    "kvframe_router_request_seconds": "histogram",
    "kvframe_router_backend_requests": "counter",
    "kvframe_router_backend_failures": "counter",
    "kvframe_router_backend_seconds": "histogram",
}


def _scrape(served: Served) -> tuple[str, dict[tuple[str, frozenset[tuple[str, str]]], float]]:
    code, text = request(served, "GET", "/metrics")
    assert code == 200, text
    assert isinstance(text, str)
    assert lint(text) == [], text
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    return text, samples


def _get(
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str
) -> float:
    return samples[(name, frozenset(labels.items()))]


@pytest.fixture(scope="module")
def pd() -> Iterator[tuple[Served, Served, Served]]:
    with (
        engine_server("kv_producer", engine_id="mP") as p,
        engine_server("kv_consumer", engine_id="mD") as d,
        router_server(p.url, d.url) as r,
    ):
        yield p, d, r


def test_every_family_is_there_at_zero_then_counts_the_traffic(
    pd: tuple[Served, Served, Served],
) -> None:
    p, d, r = pd
    for served in (p, d):
        text, s = _scrape(served)
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {"kvframe_" + spec.family for spec in CATALOGUE} <= names
        eid = "mP" if served is p else "mD"
        assert _get(s, "kvframe_failures_total", engine_id=eid, reason="load_failed") == 0
        assert _get(s, "kvframe_transfer_seconds_count", engine_id=eid) == 0
    text, s = _scrape(r)
    assert {f.name: f.type for f in text_string_to_metric_families(text)} == ROUTER_FAMILIES
    assert _get(s, "kvframe_router_requests_total", outcome="routed") == 0
    assert _get(s, "kvframe_router_backend_failures_total", backend="decode", reason="timeout") == 0

    n = 2
    for i in range(n):
        code, body = complete(r, {**BODY, "prompt": f"{BODY['prompt']} {i}"})
        assert code == 200, body
        assert body["usage"]["external_tokens"] > 0  # D loaded from P

    _, s = _scrape(d)
    assert (
        _get(s, "kvframe_loads_ended_total", engine_id="mD", remote_engine="mP", outcome="done")
        == n
    )
    assert (
        _get(s, "kvframe_loads_ended_total", engine_id="mD", remote_engine="mP", outcome="failed")
        == 0
    )
    for hist in ("transfer_seconds", "load_wait_seconds", "post_seconds", "load_bytes"):
        assert _get(s, f"kvframe_{hist}_count", engine_id="mD") == n, hist
        assert _get(s, f"kvframe_{hist}_bucket", engine_id="mD", le="+Inf") == n, hist
    read = _get(s, "kvframe_kv_read_bytes_total", engine_id="mD", remote_engine="mP")
    assert read > 0
    assert _get(s, "kvframe_load_bytes_sum", engine_id="mD") == read
    assert _get(s, "kvframe_scheduler_remote_requests_total", engine_id="mD") == n

    _, s = _scrape(p)
    assert _get(s, "kvframe_leases_granted_total", engine_id="mP") == n
    assert _get(s, "kvframe_scheduler_leases_offered_total", engine_id="mP") == n

    _, s = _scrape(r)
    assert _get(s, "kvframe_router_requests_total", outcome="routed") == n
    assert _get(s, "kvframe_router_request_seconds_count") == n
    for backend in ("prefill", "decode"):
        assert _get(s, "kvframe_router_backend_requests_total", backend=backend) == n
        assert _get(s, "kvframe_router_backend_seconds_count", backend=backend) == n


def test_the_router_counts_a_backend_it_cannot_reach_and_a_refused_request() -> None:
    with router_server("http://127.0.0.1:9", "http://127.0.0.1:9") as r:
        code, _ = complete(r, BODY)
        assert code == 502
        code, _ = complete(r, {"prompt": "x", "max_tokens": "three"})
        assert code == 400
        _, s = _scrape(r)
    assert _get(s, "kvframe_router_requests_total", outcome="failed") == 1
    assert _get(s, "kvframe_router_requests_total", outcome="refused") == 1
    assert (
        _get(s, "kvframe_router_backend_failures_total", backend="prefill", reason="unreachable")
        == 1
    )
    assert _get(s, "kvframe_router_backend_requests_total", backend="decode") == 0
