"""OutputAggregator: finished only when every rank reported; merge rules; order independence."""

from __future__ import annotations

from collections import Counter

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvframe.protocol.aggregate import OutputAggregator
from kvframe.protocol.messages import ConnectorOutput, KVEvent, Stats

# A schedule: for each step, the (rank, sending ids, recving ids) reports that arrive in it.
Report = tuple[int, frozenset[str], frozenset[str]]


@st.composite
def schedules(draw: st.DrawFn) -> tuple[int, list[list[Report]]]:
    ranks = draw(st.integers(1, 4))
    reqs = draw(st.lists(st.sampled_from("abcdefgh"), unique=True, max_size=8))
    # Every rank reports each request at least once in each direction, possibly twice
    # (a duplicate), in an arbitrary step.
    reports: list[tuple[int, int, str, str]] = []
    for rid in reqs:
        for rank in range(ranks):
            for direction in ("send", "recv"):
                for _ in range(draw(st.integers(1, 2))):
                    reports.append((draw(st.integers(0, 5)), rank, direction, rid))
    steps: list[list[Report]] = [[] for _ in range(6)]
    for step, rank, direction, rid in reports:
        s = frozenset({rid}) if direction == "send" else frozenset()
        r = frozenset({rid}) if direction == "recv" else frozenset()
        steps[step].append((rank, s, r))
    for step in steps:
        order = draw(st.permutations(range(len(step))))
        step[:] = [step[i] for i in order]
    return ranks, steps


def _run(ranks: int, steps: list[list[Report]]) -> list[ConnectorOutput]:
    agg = OutputAggregator(ranks)
    out = []
    for step in steps:
        for rank, s, r in step:
            agg.add(rank, ConnectorOutput(finished_sending=s, finished_recving=r))
        out.append(agg.take())
    return out


@given(schedules())
def test_each_request_is_reported_once_and_only_after_every_rank(
    sched: tuple[int, list[list[Report]]],
) -> None:
    ranks, steps = sched
    results = _run(ranks, steps)
    for attr, idx in (("finished_sending", 1), ("finished_recving", 2)):
        seen: dict[str, set[int]] = {}
        emitted: Counter[str] = Counter()
        for step, result in zip(steps, results, strict=True):
            for report in step:
                for rid in report[idx]:
                    seen.setdefault(rid, set()).add(report[0])
            for rid in getattr(result, attr):
                assert seen[rid] == set(range(ranks)), f"{rid} reported before every rank"
                emitted[rid] += 1
        # No double reporting, and nothing is lost.
        assert all(n == 1 for n in emitted.values())
        assert set(emitted) == set(seen)


@given(schedules(), st.randoms(use_true_random=False))
def test_order_of_reports_within_a_step_does_not_matter(
    sched: tuple[int, list[list[Report]]], rnd: object
) -> None:
    ranks, steps = sched
    shuffled = [list(step) for step in steps]
    for step in shuffled:
        rnd.shuffle(step)  # type: ignore[attr-defined]
    assert _run(ranks, steps) == _run(ranks, shuffled)


def test_sending_and_receiving_are_tracked_separately() -> None:
    agg = OutputAggregator(2)
    agg.add(0, ConnectorOutput(finished_sending={"r"}))
    agg.add(1, ConnectorOutput(finished_recving={"r"}))
    out = agg.take()
    assert out.finished_sending == frozenset()
    assert out.finished_recving == frozenset()
    assert agg.pending() == {"sending": {"r": frozenset({0})}, "receiving": {"r": frozenset({1})}}
    agg.add(1, ConnectorOutput(finished_sending={"r"}))
    assert agg.take().finished_sending == {"r"}


def test_invalid_blocks_union_and_failures_are_reported_once_with_lowest_rank_reason() -> None:
    agg = OutputAggregator(3)
    agg.add(2, ConnectorOutput(invalid_block_ids={1, 2}, failures={"r": "rank 2 broke"}))
    agg.add(1, ConnectorOutput(invalid_block_ids={2, 3}, failures={"r": "rank 1 broke"}))
    out = agg.take()
    assert out.invalid_block_ids == {1, 2, 3}
    assert dict(out.failures) == {"r": "rank 1 broke"}
    agg.add(0, ConnectorOutput(failures={"r": "rank 0 late"}))
    out = agg.take()
    assert dict(out.failures) == {}
    assert out.invalid_block_ids == frozenset()


def test_stats_counters_add_and_gauges_take_latest_per_rank_then_max() -> None:
    agg = OutputAggregator(2)
    agg.add(0, ConnectorOutput(stats=Stats(counters={"bytes": 10}, gauges={"inflight": 9})))
    agg.add(0, ConnectorOutput(stats=Stats(counters={"bytes": 5}, gauges={"inflight": 1})))
    agg.add(1, ConnectorOutput(stats=Stats(counters={"bytes": 1.5}, gauges={"inflight": 4})))
    stats = agg.take().stats
    assert dict(stats.counters) == {"bytes": 16.5}
    assert dict(stats.gauges) == {"inflight": 4}
    assert agg.take().stats.is_empty


def test_events_concatenate_in_rank_order() -> None:
    agg = OutputAggregator(2)
    e = [KVEvent(kind=f"k{i}") for i in range(4)]
    agg.add(1, ConnectorOutput(events=[e[0]]))
    agg.add(0, ConnectorOutput(events=[e[1], e[2]]))
    agg.add(1, ConnectorOutput(events=[e[3]]))
    assert agg.take().events == (e[1], e[2], e[0], e[3])
    assert agg.take().events == ()


def test_late_duplicates_beyond_memory_are_forgotten_oldest_first() -> None:
    agg = OutputAggregator(1, remember=2)
    for rid in "abc":
        agg.add(0, ConnectorOutput(finished_sending={rid}))
    assert agg.take().finished_sending == {"a", "b", "c"}
    for rid in "bca":
        agg.add(0, ConnectorOutput(finished_sending={rid}))
    # "a" fell out of the bounded memory; "b" and "c" are still recognised as duplicates.
    assert agg.take().finished_sending == {"a"}


def test_aggregate_takes_one_output_per_rank() -> None:
    agg = OutputAggregator(2)
    out = agg.aggregate(
        [ConnectorOutput(finished_recving={"x"}), ConnectorOutput(finished_recving={"x"})]
    )
    assert out.finished_recving == {"x"}
    with pytest.raises(ValueError, match="expects one per rank"):
        agg.aggregate([ConnectorOutput()])


@pytest.mark.parametrize("rank", [-1, 2, True, "0"])
def test_bad_rank_is_refused(rank: object) -> None:
    with pytest.raises(ValueError, match=r"expects ranks 0\.\.1"):
        OutputAggregator(2).add(rank, ConnectorOutput())  # type: ignore[arg-type]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="number of worker ranks"):
        OutputAggregator(0)
    with pytest.raises(ValueError, match="remember"):
        OutputAggregator(1, remember=0)
    with pytest.raises(TypeError, match="expected a ConnectorOutput"):
        OutputAggregator(1).add(0, {})  # type: ignore[arg-type]


class AggregatorMachine(RuleBasedStateMachine):
    """Random add/take interleavings against a plain model: a request id is emitted in the
    first take after all ranks reported it, exactly once; failures are emitted once."""

    def __init__(self) -> None:
        super().__init__()
        self.ranks = 3
        self.agg = OutputAggregator(self.ranks)
        self.reported: dict[str, set[int]] = {}
        self.emitted: set[str] = set()
        self.failed_reported: set[str] = set()
        self.failed_emitted: set[str] = set()

    @rule(rank=st.integers(0, 2), rid=st.sampled_from("abcdef"), fail=st.booleans())
    def add(self, rank: int, rid: str, fail: bool) -> None:
        failures = {rid: f"rank {rank}"} if fail else {}
        self.agg.add(rank, ConnectorOutput(finished_recving={rid}, failures=failures))
        self.reported.setdefault(rid, set()).add(rank)
        if fail:
            self.failed_reported.add(rid)

    @rule()
    def take(self) -> None:
        out = self.agg.take()
        due = {r for r, ranks in self.reported.items() if len(ranks) == self.ranks}
        assert set(out.finished_recving) == due - self.emitted
        self.emitted |= set(out.finished_recving)
        assert set(out.failures) == self.failed_reported - self.failed_emitted
        self.failed_emitted |= set(out.failures)

    @invariant()
    def pending_matches_model(self) -> None:
        pending = self.agg.pending()["receiving"]
        expected = {
            r: frozenset(ranks)
            for r, ranks in self.reported.items()
            if len(ranks) < self.ranks and r not in self.emitted
        }
        assert pending == expected


TestAggregatorMachine = AggregatorMachine.TestCase


@attrs.frozen(kw_only=True)
class Record:
    rank: int
    n: int


@attrs.frozen(kw_only=True)
class RecordsOutput(ConnectorOutput):
    """A connector's own output: typed per-rank records besides the generic parts."""

    records: tuple[Record, ...] = ()
    notes: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class OtherOutput(ConnectorOutput):
    other: tuple[int, ...] = ()


def test_typed_records_concatenate_in_rank_order_and_keep_their_class() -> None:
    agg = OutputAggregator(2)
    agg.add(1, RecordsOutput(records=(Record(rank=1, n=0),), finished_sending={"r"}))
    agg.add(0, ConnectorOutput(finished_sending={"r"}))  # a plain output adds nothing
    agg.add(0, RecordsOutput(records=(Record(rank=0, n=1),), notes=("a",)))
    out = agg.take()
    assert type(out) is RecordsOutput
    assert out.records == (Record(rank=0, n=1), Record(rank=1, n=0))
    assert out.notes == ("a",)
    assert out.finished_sending == {"r"}
    # Nothing reported since: a plain, empty output.
    again = agg.take()
    assert type(again) is ConnectorOutput
    assert again.is_empty


def test_two_output_classes_in_one_take_are_refused_and_nothing_is_recorded() -> None:
    agg = OutputAggregator(2)
    agg.add(0, RecordsOutput(records=(Record(rank=0, n=0),)))
    with pytest.raises(TypeError, match="rank 1 reported a OtherOutput, but a RecordsOutput"):
        agg.add(1, OtherOutput(other=(1,), finished_sending={"x"}))
    out = agg.take()
    assert out == RecordsOutput(records=(Record(rank=0, n=0),))
    agg.add(1, OtherOutput(other=(1,)))  # a new take may carry another class
    assert agg.take() == OtherOutput(other=(1,))


@given(st.permutations([(0, 0), (0, 1), (1, 2), (2, 3), (1, 4)]))
def test_typed_records_do_not_depend_on_the_order_of_reports(order: list[tuple[int, int]]) -> None:
    agg = OutputAggregator(3)
    for rank, n in order:
        agg.add(rank, RecordsOutput(records=(Record(rank=rank, n=n),)))
    out = agg.take()
    assert isinstance(out, RecordsOutput)
    assert [r.rank for r in out.records] == sorted(r.rank for r in out.records)
    assert sorted(r.n for r in out.records) == [0, 1, 2, 3, 4]
    # Within a rank, records keep the order that rank reported them in.
    for rank in range(3):
        mine = [n for r, n in order if r == rank]
        assert [r.n for r in out.records if r.rank == rank] == mine
