"""kvframe's metric catalogue and its Prometheus rendering (``kvframe.runtime.metrics``): the
families a dashboard gets from stats, the checks :func:`lint` runs (and that they fail on
the old format), the histogram replay vLLM's path uses, and docs/metrics.md against the
catalogue. The real engines' output is checked in tests/refengine/test_metrics.py and
tests_vllm/test_metrics.py."""

from __future__ import annotations

import bisect
import math
import re
import shutil
import subprocess
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvframe.connectors.pd.worker import OBSERVATION_BUCKETS, observation_key
from kvframe.protocol.messages import Stats
from kvframe.runtime.metrics import (
    CATALOGUE,
    HistogramSample,
    collect,
    lint,
    replay,
    to_prometheus,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _observed(name: str, values: list[float], engine: str | None = None) -> dict[str, float]:
    """Counters as the P/D worker reports observations (its ``_observe``)."""
    out: dict[str, float] = {name: sum(values)}
    if engine is not None:
        out[f"{name}.{engine}"] = sum(values)
    for v in values:
        out[observation_key(name, v)] = out.get(observation_key(name, v), 0) + 1
    return out


def test_every_family_is_there_at_zero_before_anything_happened() -> None:
    text = to_prometheus(Stats(), Stats(), labels={"engine_id": "D0"})
    assert lint(text) == []
    names = {f.name for f in text_string_to_metric_families(text)}
    for spec in CATALOGUE:
        assert "kvframe_" + spec.family in names, spec.name
    s = _samples(text)
    assert s[("kvframe_failures_total", (("engine_id", "D0"), ("reason", "load_failed")))] == 0
    assert s[("kvframe_leases_ended_total", (("engine_id", "D0"), ("outcome", "expired")))] == 0
    assert s[("kvframe_transfer_seconds_bucket", (("engine_id", "D0"), ("le", "+Inf")))] == 0
    assert s[("kvframe_leases_held", (("engine_id", "D0"),))] == 0


def test_per_engine_series_never_share_a_family_with_their_total() -> None:
    stats = Stats(
        counters={
            **_observed("bytes_read", [10_000.0, 20_000.0], "P0"),
            "bytes_read.P1": 5,
            "bytes_read": 30_005,
            "loads_done.P0": 2,
            "loads_failed.P1": 1,
            "loads_failed": 1,
        },
        gauges={"leases_held": 3},
    )
    text = to_prometheus(stats, labels={"engine_id": "D0"})
    assert lint(text) == []
    s = _samples(text)
    reads = {k[1]: v for k, v in s.items() if k[0] == "kvframe_kv_read_bytes_total"}
    assert reads == {
        (("engine_id", "D0"), ("remote_engine", "P0")): 30_000,
        (("engine_id", "D0"), ("remote_engine", "P1")): 5,
    }
    ended = {
        (dict(k[1])["remote_engine"], dict(k[1])["outcome"]): v
        for k, v in s.items()
        if k[0] == "kvframe_loads_ended_total"
    }
    # Every outcome of every engine seen, zeros included.
    assert ended == {
        ("P0", "done"): 2, ("P0", "aborted"): 0, ("P0", "failed"): 0,
        ("P1", "done"): 0, ("P1", "aborted"): 0, ("P1", "failed"): 1,
    }  # fmt: skip
    assert s[("kvframe_failures_total", (("engine_id", "D0"), ("reason", "load_failed")))] == 1
    assert s[("kvframe_load_bytes_count", (("engine_id", "D0"),))] == 2
    assert s[("kvframe_load_bytes_sum", (("engine_id", "D0"),))] == 30_005
    assert s[("kvframe_load_bytes_bucket", (("engine_id", "D0"), ("le", "16384.0")))] == 1
    assert s[("kvframe_load_bytes_bucket", (("engine_id", "D0"), ("le", "65536.0")))] == 2
    assert s[("kvframe_leases_held", (("engine_id", "D0"),))] == 3


def test_children_add_up_and_uncatalogued_stats_get_a_family_each() -> None:
    stats = Stats(
        counters={
            "0.PDConnector.loads_done.P1": 2,
            "1.PDConnector.loads_done.P1": 1,
            "0.PDConnector.transfer_seconds:le=0.005": 1,
            "0.PDConnector.transfer_seconds": 0.004,
            "1.OffloadingConnector.stores_done": 3,
        },
        gauges={"holding": 1, "1.OffloadingConnector.tier0_used_blocks": 7},
    )
    text = to_prometheus(stats, Stats(counters={"heartbeat_batches": 4}))
    assert lint(text) == []
    s = _samples(text)
    key = (("outcome", "done"), ("remote_engine", "P1"))
    assert s[("kvframe_loads_ended_total", key)] == 3
    assert s[("kvframe_transfer_seconds_bucket", (("le", "0.005"),))] == 1
    assert s[("kvframe_transfer_seconds_bucket", (("le", "0.0025"),))] == 0
    assert s[("kvframe_connector_stores_done_total", ())] == 3
    assert s[("kvframe_connector_tier0_used_blocks", ())] == 7
    assert s[("kvframe_connector_holding", ())] == 1
    assert s[("kvframe_scheduler_heartbeat_batches_total", ())] == 4
    assert "PDConnector" not in text
    assert "OffloadingConnector" not in text


def test_lint_finds_what_the_old_formats_got_wrong() -> None:
    old_vllm = (
        "# TYPE vllm:kvframe_counter_total counter\n"
        'vllm:kvframe_counter_total{name="bytes_read.P0"} 3\n'
    )
    assert any("no HELP" in p for p in lint(old_vllm, promtool=False))
    old_refengine = (
        "# TYPE kvframe_bytes_read_total counter\n"
        'kvframe_bytes_read_total{engine_id="D0"} 15\n'
        'kvframe_bytes_read_total{engine_id="D0",remote_engine="P0"} 15\n'
        "# TYPE kvframe_P0_bytes gauge\n"
        'kvframe_P0_bytes{remote_engine="P0"} 1\n'
    )
    problems = lint(old_refengine, promtool=False)
    assert any("sum() counts twice" in p for p in problems), problems
    assert any("does not end in _bytes" in p for p in problems), problems
    assert any("remote engine's id is part of the name" in p for p in problems), problems
    bad_hist = (
        "# HELP h_seconds h\n# TYPE h_seconds histogram\n"
        'h_seconds_bucket{le="1.0"} 2\nh_seconds_bucket{le="+Inf"} 1\n'
        "h_seconds_count 2\nh_seconds_sum 1\n"
    )
    problems = lint(bad_hist, promtool=False)
    assert any("not cumulative" in p for p in problems), problems
    assert any("_count differs" in p for p in problems), problems
    assert lint("not a metric line {", promtool=False)[0].startswith("does not parse")
    if shutil.which("promtool"):
        assert any("promtool" in p for p in lint(old_vllm))


@given(
    st.lists(
        st.one_of(
            st.floats(min_value=0.0, max_value=30.0, allow_nan=False),
            st.sampled_from(OBSERVATION_BUCKETS["transfer_seconds"]),
        ),
        max_size=40,
    )
)
def test_replay_gives_the_same_buckets_and_sum(values: list[float]) -> None:
    counters = _observed("transfer_seconds", values) if values else {}
    (fam,) = [f for f in collect(Stats(counters=counters)) if f.spec.name == "transfer_seconds"]
    (sample,) = fam.samples
    assert isinstance(sample, HistogramSample)
    again = replay(sample.buckets, sample.sum)
    bounds = OBSERVATION_BUCKETS["transfer_seconds"]

    def buckets(vs: list[float]) -> list[int]:
        out = [0] * (len(bounds) + 1)
        for v in vs:
            out[bisect.bisect_left(bounds, v)] += 1
        return out

    assert buckets(again) == buckets(values)
    assert math.isclose(sum(again), sum(values), rel_tol=1e-6, abs_tol=1e-9)


def _doc_rows(text: str) -> dict[str, tuple[str, str]]:
    rows: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        m = re.match(r"\|\s*`kvframe_(\w+)`\s*\|\s*(\w+)\s*\|[^|]*\|\s*([^|]*)\|", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3).strip())
    return rows


def _router_families() -> dict[str, tuple[str, tuple[str, ...]]]:
    """The router's families (name without ``kvframe_``, with ``_total`` for counters): type
    and labels, read from a fresh router's own output."""
    from kvframe_refengine.router import RouterMetrics

    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for fam in text_string_to_metric_families(RouterMetrics().render()):
        name = fam.name.removeprefix("kvframe_") + ("_total" if fam.type == "counter" else "")
        labels = {k for smp in fam.samples for k in smp.labels if k != "le"}
        out[name] = (fam.type, tuple(sorted(labels)))
    return out


def test_the_docs_list_every_metric_with_its_type_and_labels() -> None:
    rows = _doc_rows(DOCS.read_text())
    for spec in CATALOGUE:
        assert spec.name in rows, f"docs/metrics.md lacks kvframe_{spec.name}"
        kind, labels = rows.pop(spec.name)
        assert kind == spec.kind, spec.name
        want = ", ".join(f"`{x}`" for x in spec.labelnames) or "—"
        assert labels == want, spec.name
    router = _router_families()
    assert set(rows) == set(router), "docs/metrics.md and the router's families differ"
    for name, (kind, names) in router.items():
        assert rows[name][0] == kind, name
        assert sorted(re.findall(r"`(\w+)`", rows[name][1])) == list(names), name


def _series() -> dict[str, set[str]]:
    """Every series name a query may use, with the labels it has."""
    out: dict[str, set[str]] = {}
    for spec in CATALOGUE:
        labels = {"engine_id", *spec.labelnames}
        if spec.kind == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                out[f"kvframe_{spec.name}{suffix}"] = labels | (
                    {"le"} if suffix == "_bucket" else set()
                )
        else:
            out[f"kvframe_{spec.name}"] = labels
    for name, (kind, labs) in _router_families().items():
        if kind == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                out[f"kvframe_{name}{suffix}"] = set(labs) | (
                    {"le"} if suffix == "_bucket" else set()
                )
        else:
            out[f"kvframe_{name}"] = set(labs)
    return out


def test_the_dashboard_queries_in_the_docs_name_real_series_and_labels(tmp_path: Path) -> None:
    queries = re.findall(r"```promql\n(.*?)```", DOCS.read_text(), re.S)
    assert len(queries) >= 10
    series = _series()
    for q in queries:
        used = re.findall(r"\b(kvframe_\w+)(\{[^}]*\})?", q)
        assert used, q
        labels: set[str] = set()
        for name, matchers in used:
            assert name in series, f"{name} in {q!r} is no series kvframe has"
            for label in re.findall(r"(\w+)\s*=", matchers):
                assert label in series[name], f"{name} has no label {label!r} ({q!r})"
            labels |= series[name]
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", q):
            for label in filter(None, (x.strip() for x in group.split(","))):
                assert label in labels, f"{label!r} is not a label of the series in {q!r}"
    promtool = shutil.which("promtool")
    if promtool is not None:
        rules = tmp_path / "rules.yml"
        lines = ["groups:", "  - name: docs", "    rules:"]
        for i, q in enumerate(queries):
            expr = " ".join(q.split()).replace("'", "''")
            lines += [f"      - record: docs:query_{i}", f"        expr: '{expr}'"]
        rules.write_text("\n".join(lines) + "\n")
        run = subprocess.run(
            [promtool, "check", "rules", str(rules)], capture_output=True, text=True
        )
        assert run.returncode == 0, run.stdout + run.stderr
