"""kvframe's metrics for operators: one catalogue, rendered alike by every engine.

:data:`CATALOGUE` is the one list of kvframe's Prometheus metrics: name, type, unit, labels,
meaning and which :class:`~kvframe.protocol.messages.Stats` entries feed it. The reference
engine's ``/metrics`` renders it with :func:`to_prometheus` (names ``kvframe_*``); inside vLLM
the adapter registers the same families through vLLM's ``KVConnectorPromMetrics`` (names
``vllm:kvframe_*``), from the same :func:`collect`. docs/metrics.md lists them; a test keeps
the page and the catalogue equal.

The rules the catalogue keeps:

- one family per quantity, its unit in its name (``_bytes``, ``_seconds``; counters end in
  ``_total``), and HELP text for each;
- the remote prefill engine is a ``remote_engine`` label, never part of a name; a family has
  either per-engine series or a total, never both, so ``sum()`` never counts twice;
- every series whose labels are known in advance (no label, a ``reason``, an ``outcome``, the
  buckets of a histogram) is there from the start, at zero; per-engine series appear with the
  engine.

How stats become samples. A worker's counter ``name.<engine>`` is ``name`` for remote engine
``<engine>`` (the counter ``name`` is their total); ``name:le=<bound>`` counts the observations
of histogram ``name`` in the bucket with upper bound ``<bound>``
(:data:`~kvframe.connectors.pd.worker.OBSERVATION_BUCKETS`), the counter ``name`` being their
sum. A MultiConnector child's prefix ``<index>.<connector>.`` is dropped and its children's
values add up. Stats the catalogue does not name still show, each as its own family
``kvframe_connector_<name>`` (worker) or ``kvframe_scheduler_<name>`` (scheduler half), without
per-engine series.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Literal

import attrs
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvframe.connectors.pd.worker import OBSERVATION_BUCKETS
from kvframe.protocol.messages import Stats

__all__ = [
    "CATALOGUE",
    "CONTENT_TYPE",
    "Family",
    "HistogramSample",
    "MetricSpec",
    "Sample",
    "StatsAccumulator",
    "collect",
    "lint",
    "metric_families",
    "replay",
    "to_prometheus",
]

#: The ``Content-Type`` of what :func:`to_prometheus` renders (Prometheus text format 0.0.4).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Side = Literal["worker", "scheduler"]
Kind = Literal["counter", "gauge", "histogram"]

_BAD = re.compile(r"[^a-zA-Z0-9_]")
#: A MultiConnector child's prefix: ``<index>.<connector name>.`` (nested children repeat it).
_CHILD = re.compile(r"^\d+\.[A-Za-z_][\w-]*\.(.+)$")
_LE = ":le="


@attrs.frozen(kw_only=True)
class MetricSpec:
    """One metric family of the catalogue.

    ``name`` is the exposition name without the engine's prefix (``kvframe_`` or
    ``vllm:kvframe_``); a counter's ends in ``_total``. Samples come from the ``stat`` entry
    of the ``side``'s stats, or, for a family with a ``label`` (``reason``, ``outcome``), one
    stat per label value (``by``: value → stat). ``per_engine`` families read the stats'
    ``<stat>.<engine>`` entries into a ``remote_engine`` label. A histogram's ``buckets`` are
    its upper bounds (``+Inf`` implied).
    """

    name: str
    kind: Kind
    unit: Literal["bytes", "seconds", ""]
    help: str
    stat: str = ""
    side: Side = "worker"
    per_engine: bool = False
    label: str | None = None
    by: Mapping[str, str] = attrs.field(factory=dict)
    buckets: tuple[float, ...] = ()

    @property
    def family(self) -> str:
        """The family name as ``prometheus_client`` takes it (a counter's without ``_total``)."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name

    @property
    def labelnames(self) -> tuple[str, ...]:
        """The labels this family adds to the engine's own (``engine_id``, ``model_name``)."""
        return (("remote_engine",) if self.per_engine else ()) + (
            (self.label,) if self.label else ()
        )

    @property
    def stats(self) -> tuple[str, ...]:
        """Every stat name this family reads."""
        return tuple(self.by.values()) if self.by else (self.stat,)


def _counter(
    name: str,
    help: str,
    stat: str = "",
    *,
    unit: Literal["bytes", "seconds", ""] = "",
    side: Side = "worker",
    per_engine: bool = False,
    label: str | None = None,
    by: Mapping[str, str] | None = None,
) -> MetricSpec:
    return MetricSpec(
        name=name, kind="counter", unit=unit, help=help, stat=stat, side=side,
        per_engine=per_engine, label=label, by=dict(by or {}),
    )  # fmt: skip


def _gauge(name: str, help: str, stat: str, *, side: Side = "worker") -> MetricSpec:
    return MetricSpec(name=name, kind="gauge", unit="", help=help, stat=stat, side=side)


def _histogram(name: str, help: str, stat: str, unit: Literal["bytes", "seconds"]) -> MetricSpec:
    return MetricSpec(
        name=name, kind="histogram", unit=unit, help=help, stat=stat,
        buckets=OBSERVATION_BUCKETS[stat],
    )  # fmt: skip


#: Every kvframe metric, in the order the docs list them.
CATALOGUE: tuple[MetricSpec, ...] = (
    # -- decode side: loads ----------------------------------------------------------------
    _counter(
        "loads_requested_total",
        "Loads of remote KV cache the decode engine was asked to carry out.",
        "loads_requested",
    ),
    _counter(
        "loads_ended_total",
        "Loads of remote KV cache that ended, by remote prefill engine and outcome "
        "(done, aborted, failed).",
        per_engine=True,
        label="outcome",
        by={"done": "loads_done", "aborted": "loads_aborted", "failed": "loads_failed"},
    ),
    _counter(
        "kv_read_bytes_total",
        "Bytes of KV cache the decode engine read, by remote prefill engine.",
        "bytes_read",
        per_engine=True,
        unit="bytes",
    ),
    _counter(
        "read_descriptors_total",
        "Transfer descriptors in the READs the decode engine posted.",
        "descriptors",
    ),
    _counter(
        "reconnects_total",
        "Connections to a remote prefill engine dropped and made again (the engine restarted "
        "or moved).",
        "reconnects",
        per_engine=True,
    ),
    _histogram(
        "transfer_seconds",
        "Seconds one READ took to move a load's KV cache (the transport's own measure where "
        "it has one, else from post to completion).",
        "transfer_seconds",
        "seconds",
    ),
    _histogram(
        "post_seconds",
        "Seconds the decode engine spent posting one READ to the transport.",
        "post_seconds",
        "seconds",
    ),
    _histogram(
        "load_wait_seconds",
        "Seconds from posting a load's READ until the decode engine saw it complete.",
        "load_wait_seconds",
        "seconds",
    ),
    _histogram(
        "load_done_seen_seconds",
        "Seconds from posting a load's READ to the first poll that saw it done.",
        "load_done_seen_seconds",
        "seconds",
    ),
    _histogram(
        "load_report_seconds",
        "Seconds from the first poll that saw a load's READ done to the load handed to the "
        "engine's scheduler (get_finished returning it).",
        "load_report_seconds",
        "seconds",
    ),
    _histogram(
        "load_bytes",
        "Bytes of KV cache one load read (per worker rank).",
        "bytes_read",
        "bytes",
    ),
    _gauge(
        "loads_in_flight", "Loads whose READ is posted and not yet complete.", "loads_in_flight"
    ),
    _gauge(
        "loads_waiting",
        "Loads not yet posted (waiting for a connection or a confirmed lease).",
        "loads_waiting",
    ),
    _gauge(
        "remote_engines",
        "Remote prefill engines the decode engine has a connection entry for.",
        "remote_engines",
    ),
    # -- heartbeats and failures -----------------------------------------------------------
    _counter(
        "heartbeats_sent_total",
        "Heartbeats the decode engine sent to renew leases, by remote prefill engine.",
        "heartbeats_sent",
        per_engine=True,
    ),
    _counter(
        "heartbeats_received_total",
        "Heartbeats the prefill engine received from decode engines.",
        "heartbeats_received",
    ),
    _counter(
        "failures_total",
        "Failures in the connector, by reason: load_failed (a load ended failed), "
        "notify_failed (a notification could not be sent), notification_unsent (no connection "
        "to send it on), notification_rejected (one received could not be decoded), "
        "notification_unroutable (one came from an unknown peer), notification_unauthenticated "
        "(one whose tag did not verify under the connection's session key: dropped), "
        "access_refused (a peer READ outside its claimed leases, or a WRITE, refused), "
        "peer_add_failed (a decode "
        "engine's connection could not be added), drain_error (reading notifications failed), "
        "bad_params (a request's kv_transfer_params were refused), push_refused (the prefill "
        "engine refused a push registration: unknown, abandoned or used push id, another "
        "prompt, blocks that do not fit), push_layer_failed (a per-layer WRITE failed or "
        "outlived the decoder's confirmed lease: rewritten at the end).",
        label="reason",
        by={
            "load_failed": "loads_failed",
            "notify_failed": "notify_failures",
            "notification_unsent": "notifications_unsent",
            "notification_rejected": "notifications_rejected",
            "notification_unroutable": "notifications_unroutable",
            "notification_unauthenticated": "notifications_unauthenticated",
            "access_refused": "access_refused",
            "peer_add_failed": "peer_add_failures",
            "drain_error": "drain_errors",
            "bad_params": "scheduler:bad_params",
            "push_refused": "push_refused",
            "push_layer_failed": "push_layer_failures",
        },
    ),
    _counter(
        "handshakes_total",
        "Side-channel messages the prefill engine's handshake server handled, by outcome: "
        "served (a handshake accepted), refused (malformed, incompatible, unauthenticated or "
        "busy: answered with a refusal), rate_limited (over the per-address rate: dropped "
        "unanswered).",
        label="outcome",
        by={
            "served": "handshakes_served",
            "refused": "handshakes_refused",
            "rate_limited": "handshakes_rate_limited",
        },
    ),
    # -- prefill side: leases --------------------------------------------------------------
    _counter(
        "leases_granted_total",
        "Leases the prefill engine granted (one per request kept for a remote decode).",
        "leases_granted",
    ),
    _counter(
        "leases_renewed_total",
        "Lease renewals the prefill engine acknowledged.",
        "leases_renewed",
    ),
    _counter(
        "leases_ended_total",
        "Leases that ended on the prefill engine, by outcome: consumed (read and done), "
        "aborted, expired (not renewed in time: its blocks were reclaimed), other.",
        label="outcome",
        by={
            "consumed": "leases_consumed",
            "aborted": "leases_aborted",
            "expired": "leases_expired",
            "other": "leases_ended",
        },
    ),
    _gauge("leases_held", "Leases the prefill engine holds now.", "leases_held"),
    _gauge(
        "leases_active",
        "Leases held now that a reader holds or may claim at any moment: all but a decoder's "
        "kept turns nobody has claimed yet (bidirectional mode). While it is 0 an engine "
        "keeping turns steps only every kept_poll_interval.",
        "leases_active",
    ),
    # -- push mode -------------------------------------------------------------------------
    _counter(
        "push_registrations_total",
        "Push mode: registrations of destination blocks the decode engine sent to prefill "
        "engines (one per request and worker rank).",
        "push_registrations",
    ),
    _counter(
        "push_revoked_total",
        "Push mode: decode-side leases revoked (the request was aborted, or its push did not "
        "complete within three lease durations) while the prefill engine might still write.",
        "push_revoked",
    ),
    _counter(
        "pushes_ended_total",
        "Push mode: requests whose KV the prefill engine pushed, by outcome: done (written and "
        "acknowledged by the completion notice), failed (the write failed or the decoder's "
        "lease was lost), unsent (no decoder registered in time, or the registration was "
        "refused).",
        label="outcome",
        by={"done": "pushes_done", "failed": "pushes_failed", "unsent": "push_unsent"},
    ),
    _counter(
        "kv_written_bytes_total",
        "Push mode: bytes of KV cache the prefill engine wrote into decoders' blocks.",
        "bytes_written",
        unit="bytes",
    ),
    _counter(
        "push_layer_writes_total",
        "Push mode with push_layerwise: per-layer WRITEs the prefill engine posted while its "
        "prefill ran.",
        "push_layer_writes",
    ),
    _gauge(
        "pushes_open",
        "Push mode: requests whose KV the prefill engine keeps for a push now (waiting for the "
        "decoder's registration or being written).",
        "pushes_open",
    ),
    _histogram(
        "push_seconds",
        "Push mode: seconds one push took to move a request's KV cache (the final WRITE's "
        "own measure where the transport has one, else from its post to completion).",
        "push_seconds",
        "seconds",
    ),
    # -- bidirectional (multi-turn) mode ---------------------------------------------------
    _counter(
        "leases_kept_total",
        "Bidirectional mode: kept leases the decode engine's workers granted over a finished "
        "turn's blocks (for the conversation's next turn).",
        "leases_kept",
    ),
    _counter(
        "loads_past_cap_total",
        "Bidirectional mode: loads of a conversation's history the prefill engine gave up "
        "before reading, because the decoder's kept-blocks expiry (mapped through the clock "
        "offset, less its uncertainty and ttl_safety_margin) left no time for a read.",
        "loads_past_cap",
    ),
    _counter(
        "scheduler_history_kept_total",
        "Bidirectional mode: finished turns whose KV the decode scheduler kept for the "
        "conversation's next turn.",
        "history_kept",
        side="scheduler",
    ),
    _counter(
        "scheduler_history_not_kept_total",
        "Bidirectional mode: turns that asked to be kept (keep_for_next_turn) whose blocks the "
        "decode scheduler freed instead (abnormal finish, no token ids, kv_role not kv_both).",
        "history_not_kept",
        side="scheduler",
    ),
    _counter(
        "scheduler_history_loads_total",
        "Bidirectional mode: loads of a conversation's history from its decoder the prefill "
        "scheduler instructed.",
        "history_loads",
        side="scheduler",
    ),
    _counter(
        "scheduler_history_refused_total",
        "Bidirectional mode: kv_history the prefill scheduler did not pull (the prompt does "
        "not start with it, fewer than kv_recompute_threshold tokens, a bad or forged ticket): "
        "the prompt was recomputed.",
        "history_refused",
        side="scheduler",
    ),
    _counter(
        "scheduler_history_released_total",
        "Bidirectional mode: refused kv_history whose ticket passed the prefill scheduler's "
        "checks (another prefix, too few tokens): the decoder was told to free the kept turn "
        "at once instead of at its ttl.",
        "history_released",
        side="scheduler",
    ),
    _counter(
        "scheduler_kept_evicted_total",
        "Bidirectional mode: kept turns the decode scheduler gave back early because the engine "
        "needed blocks (reclaim_blocks).",
        "kept_evicted",
        side="scheduler",
    ),
    _gauge(
        "scheduler_kept",
        "Bidirectional mode: finished turns whose KV the decode scheduler keeps now.",
        "scheduler_kept",
        side="scheduler",
    ),
    # -- the scheduler half ----------------------------------------------------------------
    _counter(
        "scheduler_remote_requests_total",
        "Requests the decode scheduler took on with KV cache to load from a prefill engine.",
        "remote_requests",
        side="scheduler",
    ),
    _counter(
        "scheduler_full_local_hits_total",
        "Remote-prefill requests the decode scheduler found entirely in its local prefix "
        "cache (nothing loaded; the prefill engine told to free).",
        "full_local_hits",
        side="scheduler",
    ),
    _counter(
        "scheduler_load_failures_total",
        "Failed loads the decode scheduler was told of (the same loads as "
        'failures_total{reason="load_failed"}, counted by the scheduler).',
        "load_failures",
        side="scheduler",
    ),
    _counter(
        "scheduler_leases_offered_total",
        "Finished requests whose blocks the prefill scheduler kept for a remote decode.",
        "leases_offered",
        side="scheduler",
    ),
    _counter(
        "scheduler_remote_decode_not_kept_total",
        "Requests that asked for a remote decode whose blocks the prefill scheduler freed "
        "instead (abnormal finish, no blocks, refused parameters).",
        "remote_decode_not_kept",
        side="scheduler",
    ),
    _gauge(
        "scheduler_leases_held",
        "Requests the prefill scheduler holds blocks of for a remote decode now.",
        "scheduler_leases_held",
        side="scheduler",
    ),
    _gauge(
        "scheduler_remote_requests_open",
        "Remote-prefill requests the decode scheduler tracks now.",
        "scheduler_remote_requests",
        side="scheduler",
    ),
)


def _key(spec_side: Side, stat: str) -> tuple[Side, str]:
    # A ``by`` entry may name the other side: ``scheduler:bad_params``.
    side, colon, name = stat.partition(":")
    if colon and side in ("worker", "scheduler"):
        return side, name  # type: ignore[return-value]
    return spec_side, stat


_CATALOGUED: frozenset[tuple[Side, str]] = frozenset(
    _key(s.side, stat) for s in CATALOGUE for stat in s.stats
)


@attrs.frozen
class Sample:
    """One series of a counter or gauge: its labels (the family's, in order) and value."""

    labels: tuple[str, ...]
    value: float


@attrs.frozen
class HistogramSample:
    """One series of a histogram: per bucket (upper bound, ``inf`` last) the observations in
    it (not cumulative), and their sum."""

    labels: tuple[str, ...]
    buckets: tuple[tuple[float, float], ...]
    sum: float

    @property
    def count(self) -> float:
        """How many observations."""
        return sum(n for _, n in self.buckets)


@attrs.frozen
class Family:
    """A family and its series, as :func:`collect` reads them from stats."""

    spec: MetricSpec
    samples: tuple[Sample | HistogramSample, ...]


@attrs.define
class _Index:
    totals: dict[tuple[Side, str], float] = attrs.Factory(dict)
    engines: dict[tuple[Side, str], dict[str, float]] = attrs.Factory(dict)
    buckets: dict[tuple[Side, str], dict[float, float]] = attrs.Factory(dict)
    gauges: dict[tuple[Side, str], float] = attrs.Factory(dict)

    def read(self, side: Side, stats: Stats) -> None:
        for raw, value in stats.counters.items():
            name = _strip_children(raw)
            base, le, bound = name.partition(_LE)
            if le:
                counts = self.buckets.setdefault((side, base), {})
                b = _bound(bound)
                if b is not None:
                    counts[b] = counts.get(b, 0.0) + float(value)
                continue
            base, dot, engine = name.partition(".")
            if dot:
                per = self.engines.setdefault((side, base), {})
                per[engine] = per.get(engine, 0.0) + float(value)
            else:
                self.totals[(side, base)] = self.totals.get((side, base), 0.0) + float(value)
        for raw, value in stats.gauges.items():
            name = _strip_children(raw)
            self.gauges[(side, name)] = self.gauges.get((side, name), 0.0) + float(value)


def _strip_children(name: str) -> str:
    while (m := _CHILD.match(name)) is not None:
        name = m.group(1)
    return name


def _bound(text: str) -> float | None:
    try:
        b = float(text)
    except ValueError:
        return None
    return None if math.isnan(b) else b


def collect(worker: Stats, scheduler: Stats | None = None, *, zeros: bool = True) -> list[Family]:
    """The catalogue's families read from a worker's and a scheduler half's stats (totals for
    a scrape, or one report's increments), then one family for each stat the catalogue does
    not name. With ``zeros`` every family is there and every series whose labels are known,
    at zero if nothing was counted (per-engine series only for engines the stats name);
    without, only the families and series the stats have."""
    idx = _Index()
    idx.read("worker", worker)
    if scheduler is not None:
        idx.read("scheduler", scheduler)
    out = [_family(spec, idx, zeros) for spec in CATALOGUE]
    out.extend(_uncatalogued(idx, {s.family for s in CATALOGUE}))
    return out if zeros else [f for f in out if f.samples]


def _family(spec: MetricSpec, idx: _Index, zeros: bool) -> Family:
    samples: list[Sample | HistogramSample] = []
    if spec.kind == "histogram":
        key = (spec.side, spec.stat)
        counted = idx.buckets.get(key, {})
        bounds = (*spec.buckets, math.inf)
        # A bound the catalogue lacks (stats from another kvframe version) counts in the
        # next bucket up, so the count stays right.
        per = dict.fromkeys(bounds, 0.0)
        for b, n in counted.items():
            per[next(x for x in bounds if x >= b)] += n
        if zeros or counted:
            samples.append(HistogramSample((), tuple(per.items()), idx.totals.get(key, 0.0)))
        return Family(spec, tuple(samples))
    values = spec.by if spec.by else {"": spec.stat}
    for label_value, stat in values.items():
        key = _key(spec.side, stat)
        lab = (label_value,) if spec.by else ()
        if spec.per_engine:
            for engine, v in sorted(idx.engines.get(key, {}).items()):
                samples.append(Sample((engine, *lab), v))
            if zeros and spec.by:
                # Every outcome of an engine seen in any of them.
                seen = {
                    e for s in spec.by.values() for e in idx.engines.get(_key(spec.side, s), {})
                }
                have = set(idx.engines.get(key, {}))
                samples.extend(Sample((e, *lab), 0.0) for e in sorted(seen - have))
            continue
        source = idx.gauges if spec.kind == "gauge" else idx.totals
        if key in source:
            samples.append(Sample(lab, source[key]))
        elif zeros:
            samples.append(Sample(lab, 0.0))
    return Family(spec, tuple(samples))


def _uncatalogued(idx: _Index, taken: set[str]) -> Iterator[Family]:
    for kind, source in (("counter", idx.totals), ("gauge", idx.gauges)):
        for (side, stat), value in sorted(source.items()):
            if (side, stat) in _CATALOGUED:
                continue
            base = _BAD.sub("_", stat)
            name = f"connector_{base}" if side == "worker" else f"scheduler_{base}"
            family = name
            if kind == "counter":
                name += "_total"
            if family in taken:
                continue  # a clash (a counter and a gauge of one name): the first wins
            taken.add(family)
            spec = MetricSpec(
                name=name,
                kind=kind,  # type: ignore[arg-type]
                unit="",
                help=f"kvframe {side} {kind} {stat!r} (not in kvframe's metric catalogue; "
                "see the connector's documentation).",
                stat=stat,
                side=side,
            )
            yield Family(spec, (Sample((), value),))


def replay(buckets: Sequence[tuple[float, float]], total: float) -> list[float]:
    """Values whose observation gives exactly these bucket counts (``buckets`` as in
    :class:`HistogramSample`) and, as far as they allow, the sum ``total``.

    For a metrics library that only has ``observe()`` (vLLM's histogram classes): a
    Prometheus histogram keeps only the bucket counts, their sum and their count, so these
    values are as good as the ones observed. Each finite bucket's values lie at the same
    fraction of the way from its lower to its upper bound; ``+Inf``'s take the rest of the sum.
    """
    spans: list[tuple[float, float, int]] = []  # (lower, upper, count)
    lower = 0.0
    n_inf = 0
    for upper, n in buckets:
        k = round(n)
        if math.isinf(upper):
            n_inf += k
        elif k > 0:
            spans.append((lower, upper, k))
        if not math.isinf(upper):
            lower = upper
    base = sum(lo * k for lo, _, k in spans)
    width = sum((hi - lo) * k for lo, hi, k in spans)
    last = lower
    if n_inf:
        room = total - base - n_inf * last  # what the finite values may take above their floors
        t = 1.0 if width == 0 else min(1.0, max(0.0, room * (1 - 1e-9)) / width)
        rest = (total - base - t * width) / n_inf
        inf_value = rest if rest > last else math.nextafter(last, math.inf)
    else:
        t = 1.0 if width == 0 else min(1.0, max(0.0, (total - base) / width))
        inf_value = math.inf
    values: list[float] = []
    for lo, hi, k in spans:
        v = min(hi, lo + t * (hi - lo))
        if lo > 0 and v <= lo:
            v = math.nextafter(lo, math.inf)
        values.extend([v] * k)
    values.extend([inf_value] * n_inf)
    return values


class StatsAccumulator:
    """Adds up per-step counters and keeps the latest gauges, for a scrape endpoint."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        self.gauges: dict[str, float] = {}

    def add(self, stats: Stats) -> None:
        """Fold one step's stats in."""
        for k, v in stats.counters.items():
            self.counters[k] = self.counters.get(k, 0) + v
        self.gauges.update(stats.gauges)

    def snapshot(self) -> Stats:
        """Everything so far as one :class:`Stats`."""
        return Stats(counters=dict(self.counters), gauges=dict(self.gauges))


def _le(bound: float) -> str:
    # As prometheus_client's own Histogram writes it, so both engines' ``le`` values match.
    return str(floatToGoString(bound))  # type: ignore[no-untyped-call]


def metric_families(
    families: Iterable[Family], *, prefix: str = "kvframe_", labels: Mapping[str, str] | None = None
) -> Iterator[Metric]:
    """``prometheus_client`` metric families (for a custom collector) of ``families``, every
    series labelled with ``labels`` first."""
    names = list(labels or {})
    values = [str(v) for v in (labels or {}).values()]
    for fam in families:
        spec = fam.spec
        labelnames = [*names, *spec.labelnames]
        name = prefix + spec.family
        metric: CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily
        if spec.kind == "histogram":
            metric = HistogramMetricFamily(name, spec.help, labels=labelnames)
            for s in fam.samples:
                assert isinstance(s, HistogramSample)
                running = 0.0
                cumulative: list[tuple[str, float]] = []
                for b, n in s.buckets:
                    running += n
                    cumulative.append((_le(b), running))
                metric.add_metric([*values, *s.labels], cumulative, s.sum)
        else:
            cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            metric = cls(name, spec.help, labels=labelnames)
            for s in fam.samples:
                assert isinstance(s, Sample)
                metric.add_metric([*values, *s.labels], s.value)
        yield metric


class _Collector(Collector):
    def __init__(self, metrics: list[Metric]) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        yield from self._metrics


def to_prometheus(
    stats: Stats,
    scheduler: Stats | None = None,
    *,
    prefix: str = "kvframe_",
    labels: Mapping[str, str] | None = None,
) -> str:
    """The catalogue's families (and the stats it does not name) as Prometheus text.

    ``stats`` are a connector worker's (usually a :meth:`StatsAccumulator.snapshot`),
    ``scheduler`` its scheduler half's, both summed since start; ``labels`` go on every
    series (for example ``{"engine_id": "P0"}``).
    """
    registry = CollectorRegistry(auto_describe=False)
    metrics = list(metric_families(collect(stats, scheduler), prefix=prefix, labels=labels))
    registry.register(_Collector(metrics))
    return generate_latest(registry).decode()


_UNITS = ("bytes", "seconds")


def lint(text: str, *, promtool: bool = True, promtool_ignore: Iterable[str] = ()) -> list[str]:
    """What is wrong with Prometheus text ``text`` for a dashboard (empty: nothing).

    The text must parse (``prometheus_client``'s own parser); every family needs HELP and a
    TYPE; a counter's series end in ``_total``; a family whose name speaks of bytes or seconds
    ends in that unit; a histogram's buckets are cumulative, end at ``+Inf`` and agree with its
    ``_count``; no family has series both with and without ``remote_engine`` (a total beside
    per-engine series) and no family name contains a ``remote_engine`` value. With
    ``promtool`` and ``promtool`` on ``PATH``, ``promtool check metrics`` is run too and its
    complaints are added, but for those containing one of ``promtool_ignore`` (vLLM names
    every metric ``vllm:*``, which promtool's rule "metric names should not contain ':'"
    flags).
    """
    problems: list[str] = []
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        return [f"does not parse: {exc}"]
    engines: set[str] = set()
    for fam in families:
        for sample in fam.samples:
            if "remote_engine" in sample.labels:
                engines.add(sample.labels["remote_engine"])
    for fam in families:
        name = fam.name
        if not fam.documentation:
            problems.append(f"{name}: no HELP")
        if fam.type in ("unknown", "untyped"):
            problems.append(f"{name}: no TYPE")
        if fam.type == "counter":
            bad = {s.name for s in fam.samples if not s.name.endswith(("_total", "_created"))}
            if bad:
                problems.append(f"{name}: counter series not ending in _total: {sorted(bad)}")
        base = name.removesuffix("_created")
        for unit in _UNITS:
            if unit in base.split("_") and not base.endswith(f"_{unit}"):
                problems.append(f"{name}: speaks of {unit} but does not end in _{unit}")
        if any(e and e in name for e in engines):
            problems.append(f"{name}: a remote engine's id is part of the name")
        with_engine = {"remote_engine" in s.labels for s in fam.samples}
        if len(with_engine) > 1:
            problems.append(f"{name}: series with and without remote_engine (sum() counts twice)")
        if fam.type == "histogram":
            problems.extend(_lint_histogram(fam.name, fam.samples))
    if promtool and (exe := shutil.which("promtool")) is not None:
        run = subprocess.run(
            [exe, "check", "metrics"], input=text, capture_output=True, text=True, check=False
        )
        ignore = tuple(promtool_ignore)
        said = [
            line
            for line in (run.stdout + run.stderr).splitlines()
            if line.strip() and not any(i in line for i in ignore)
        ]
        if run.returncode != 0 and (said or not ignore):
            problems.append("promtool check metrics: " + "; ".join(said or ["failed"]))
    return problems


def _lint_histogram(name: str, samples: Sequence[object]) -> list[str]:
    series: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
    counts: dict[tuple[tuple[str, str], ...], float] = {}
    for s in samples:
        labels = dict(getattr(s, "labels", {}))
        le = labels.pop("le", None)
        key = tuple(sorted(labels.items()))
        sname, value = getattr(s, "name", ""), float(getattr(s, "value", 0.0))
        if sname.endswith("_bucket") and le is not None:
            series.setdefault(key, []).append((float(le), value))
        elif sname.endswith("_count"):
            counts[key] = value
    out: list[str] = []
    for key, buckets in series.items():
        values = [v for _, v in sorted(buckets)]
        if not math.isinf(max(b for b, _ in buckets)):
            out.append(f"{name}{dict(key)}: no +Inf bucket")
        if any(b > a for a, b in zip(values[1:], values, strict=False)):
            out.append(f"{name}{dict(key)}: buckets not cumulative")
        if counts.get(key) != values[-1]:
            out.append(f"{name}{dict(key)}: _count differs from the +Inf bucket")
    return out
