"""Combine the outputs of several worker ranks into what the scheduler-side connector sees.

With tensor (or pipeline) parallelism every worker rank holds a slice of each KV block and runs
its own transfers, so one request finishes at different times on different ranks. The
scheduler may free a request's blocks (or schedule a loaded request) only when *every* rank is
done with it. :class:`OutputAggregator` applies these rules:

- **Finished** (``finished_sending`` and ``finished_recving``, tracked separately): a request is
  reported once, in the :meth:`~OutputAggregator.take` after the last expected rank reported
  it. Reports of the same request by the same rank are idempotent, and a late duplicate of a
  request already reported is ignored (the aggregator remembers the most recent
  ``remember`` reported ids per direction).
- **Invalid block ids**: the union over ranks (a block is unusable if any slice of it is).
- **Failures**: a request failed if *any* rank failed it; it is reported in the next ``take``
  with the reason of the lowest rank that reported it then, and only once.
- **Stats**: counters add (across ranks and across reports); gauges keep each rank's latest
  value and report the maximum over ranks. Both cover what arrived since the last ``take``.
- **Events**: concatenated in rank order (rank 0's events first), each rank's in the order it
  reported them.
- **Typed records**: the fields a subclass of ``ConnectorOutput`` adds
  (:func:`~kvframe.protocol.messages.extension_fields`, tuples of a connector's own records)
  are concatenated like events, and the result is of that subclass. Every rank of one
  connector reports the same class (plain ``ConnectorOutput`` is accepted alongside it: it adds
  nothing); a take in which no rank reported a subclass gives a plain ``ConnectorOutput``.

The result does not depend on the order in which ranks report within one ``take``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

from kvframe.protocol.messages import ConnectorOutput, KVEvent, Stats, extension_fields

__all__ = ["OutputAggregator"]


class _Recent:
    """A bounded set of ids reported recently, forgetting the oldest first."""

    def __init__(self, capacity: int) -> None:
        self._cap = capacity
        self._set: set[str] = set()
        self._order: deque[str] = deque()

    def __contains__(self, item: str) -> bool:
        return item in self._set

    def add(self, item: str) -> None:
        if item in self._set:
            return
        self._set.add(item)
        self._order.append(item)
        if len(self._order) > self._cap:
            self._set.discard(self._order.popleft())


class _Direction:
    """Completion tracking for one direction (sending or receiving)."""

    def __init__(self, ranks: int, remember: int) -> None:
        self._ranks = ranks
        self.pending: dict[str, set[int]] = {}
        self.ready: list[str] = []
        self._recent = _Recent(remember)

    def report(self, rank: int, request_ids: frozenset[str]) -> None:
        for rid in request_ids:
            if rid in self._recent:
                continue
            seen = self.pending.setdefault(rid, set())
            seen.add(rank)
            if len(seen) == self._ranks:
                del self.pending[rid]
                self._recent.add(rid)
                self.ready.append(rid)

    def take(self) -> frozenset[str]:
        out = frozenset(self.ready)
        self.ready.clear()
        return out


class OutputAggregator:
    """Aggregates :class:`~kvframe.protocol.messages.ConnectorOutput` values of worker ranks
    ``0 .. expected_ranks - 1`` (rules in the module docstring).

    Typical use, once per engine step::

        agg.add(rank, output)      # for each rank's output that arrived
        scheduler.update_connector_output(agg.take())

    ``remember`` bounds the memory of already reported request ids used to ignore late
    duplicates. Raises ``ValueError`` for ``expected_ranks < 1`` or ``remember < 1``.
    """

    def __init__(self, expected_ranks: int, *, remember: int = 65536) -> None:
        if type(expected_ranks) is not int or expected_ranks < 1:
            raise ValueError(
                f"expected_ranks = {expected_ranks!r}; give the number of worker ranks (>= 1)"
            )
        if type(remember) is not int or remember < 1:
            raise ValueError(f"remember = {remember!r}; it must be a positive int")
        self._n = expected_ranks
        self._sending = _Direction(expected_ranks, remember)
        self._recving = _Direction(expected_ranks, remember)
        self._failed = _Recent(remember)
        self._failures: dict[str, tuple[int, str]] = {}
        self._invalid: set[int] = set()
        self._counters: dict[str, int | float] = {}
        self._gauges: list[dict[str, int | float]] = [{} for _ in range(expected_ranks)]
        self._events: list[list[KVEvent]] = [[] for _ in range(expected_ranks)]
        self._cls: type[ConnectorOutput] = ConnectorOutput
        self._records: list[dict[str, list[Any]]] = [{} for _ in range(expected_ranks)]

    @property
    def expected_ranks(self) -> int:
        """The number of ranks that must report a request before it counts as finished."""
        return self._n

    def pending(self) -> dict[str, dict[str, frozenset[int]]]:
        """Diagnostics: for ``"sending"`` and ``"receiving"``, each request some but not all
        ranks reported, with the ranks that did. A fresh dict; never raises."""
        return {
            "sending": {k: frozenset(v) for k, v in self._sending.pending.items()},
            "receiving": {k: frozenset(v) for k, v in self._recving.pending.items()},
        }

    def add(self, rank: int, output: ConnectorOutput) -> None:
        """Record one rank's output.

        Raises ``ValueError`` for a rank outside ``0 .. expected_ranks - 1`` and ``TypeError``
        for something that is not a ``ConnectorOutput`` or for a subclass other than the one
        another rank reported since the last :meth:`take`; nothing was recorded then.
        """
        if type(rank) is not int or not 0 <= rank < self._n:
            raise ValueError(f"rank = {rank!r}; this aggregator expects ranks 0..{self._n - 1}")
        if not isinstance(output, ConnectorOutput):
            raise TypeError(f"expected a ConnectorOutput, got {type(output).__name__}")
        cls = type(output)
        if cls is not ConnectorOutput:
            if self._cls is not ConnectorOutput and cls is not self._cls:
                raise TypeError(
                    f"rank {rank} reported a {cls.__qualname__}, but a {self._cls.__qualname__} "
                    "was reported since the last take; every rank of a connector reports the "
                    "same output class"
                )
            self._cls = cls
            records = self._records[rank]
            for name in extension_fields(cls):
                records.setdefault(name, []).extend(getattr(output, name))
        self._sending.report(rank, output.finished_sending)
        self._recving.report(rank, output.finished_recving)
        self._invalid.update(output.invalid_block_ids)
        for rid, reason in output.failures.items():
            if rid in self._failed:
                continue
            known = self._failures.get(rid)
            if known is None or rank < known[0]:
                self._failures[rid] = (rank, reason)
        for name, value in output.stats.counters.items():
            self._counters[name] = self._counters.get(name, 0) + value
        self._gauges[rank].update(output.stats.gauges)
        self._events[rank].extend(output.events)

    def take(self) -> ConnectorOutput:
        """Everything that became reportable since the last call, as one output (of the
        subclass the ranks reported, if any); resets the per-take state (stats, events, typed
        records, invalid blocks). Never raises."""
        gauges: dict[str, int | float] = {}
        for per_rank in self._gauges:
            for name, value in per_rank.items():
                gauges[name] = max(value, gauges.get(name, value))
            per_rank.clear()
        for rid in self._failures:
            self._failed.add(rid)
        records: dict[str, Any] = {
            name: tuple(r for rank_records in self._records for r in rank_records.get(name, ()))
            for name in extension_fields(self._cls)
        }
        out = self._cls(
            finished_sending=self._sending.take(),
            finished_recving=self._recving.take(),
            invalid_block_ids=frozenset(self._invalid),
            failures={rid: reason for rid, (_, reason) in self._failures.items()},
            stats=Stats(counters=self._counters, gauges=gauges),
            events=tuple(e for per_rank in self._events for e in per_rank),
            **records,
        )
        self._cls = ConnectorOutput
        for rank_records in self._records:
            rank_records.clear()
        self._invalid.clear()
        self._failures.clear()
        self._counters = {}
        for rank_events in self._events:
            rank_events.clear()
        return out

    def aggregate(self, outputs: Sequence[ConnectorOutput]) -> ConnectorOutput:
        """One step's outputs of all ranks at once (``outputs[r]`` is rank ``r``'s): :meth:`add`
        each, then :meth:`take`.

        Raises ``ValueError`` when ``len(outputs) != expected_ranks`` (nothing recorded) and
        ``TypeError`` as :meth:`add` does (the outputs before the bad one were recorded).
        """
        if len(outputs) != self._n:
            raise ValueError(
                f"got {len(outputs)} outputs; this aggregator expects one per rank ({self._n})"
            )
        for rank, output in enumerate(outputs):
            self.add(rank, output)
        return self.take()
