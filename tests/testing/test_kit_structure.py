"""The conformance kit's own structure: its modules import each other without a cycle, and a
pair in this process waits on a fake clock, never on real time."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from kvframe.spi.transport import Op, XferState
from kvframe.testing import FakeClock
from kvframe.testing.endpoint import TransportSpec
from kvframe.testing.pair import POLL_INTERVAL, Pair, make_pair
from kvframe.transports.inprocess import InProcessFabric

TESTING = Path(__file__).resolve().parents[2] / "kvframe" / "testing"


def _graph() -> dict[str, set[str]]:
    """kvframe.testing module -> the kvframe.testing modules it imports, anywhere in it (lazy
    imports inside functions count: they close a cycle all the same)."""
    names = {p.stem for p in TESTING.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in names:
        tree = ast.parse((TESTING / f"{name}.py").read_text())
        found: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        graph[name] = {m.rsplit(".", 1)[1] for m in found if m.startswith("kvframe.testing.")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == 1:
                return [*path[path.index(w) :], w]
            if w not in state and (found := visit(w)):
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def test_the_kit_modules_import_each_other_without_a_cycle() -> None:
    graph = _graph()
    assert "stateful" in graph["conformance"]  # the edge that used to close a cycle
    assert "conformance" not in graph["stateful"]
    cycle = _cycle(graph)
    assert cycle is None, "import cycle in kvframe.testing: " + " -> ".join(cycle or [])


def test_the_cycle_finder_sees_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def _inprocess_pair(timeout: float = 10.0, **options: object) -> Pair:
    fabric = InProcessFabric()
    spec = TransportSpec(name="inprocess", factory=fabric.create, options=options)
    return make_pair(spec, timeout=timeout)


def test_an_inprocess_pair_waits_on_a_fake_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    pair = _inprocess_pair()
    slow = _inprocess_pair(timeout=0.05, completion_polls=10**9)
    try:
        assert pair.fake_time
        assert isinstance(pair.clock, FakeClock)

        def no_real_sleep(seconds: float) -> None:
            raise AssertionError("a pair in this process slept in real time")

        monkeypatch.setattr(time, "sleep", no_real_sleep)
        xid = pair.a.post(Op.READ, pair.a_local, [0], pair.a_remote, [1])
        assert pair.wait(pair.a, xid) is XferState.DONE
        start = pair.clock()
        pair.settle(5)
        assert pair.clock() == pytest.approx(start + 5 * POLL_INTERVAL)
        # a transfer that never completes times out after the fake timeout: 250 rounds
        never = slow.a.post(Op.READ, slow.a_local, [2], slow.a_remote, [3])
        with pytest.raises(AssertionError, match=r"PENDING after 0.05 s \(fake time"):
            slow.wait(slow.a, never)
        assert slow.clock() == pytest.approx(0.05, abs=2 * POLL_INTERVAL)
    finally:
        monkeypatch.undo()
        pair.close()
        slow.close()


def test_fake_time_can_be_switched_off() -> None:
    fabric = InProcessFabric()
    spec = TransportSpec(name="inprocess", factory=fabric.create)
    pair = make_pair(spec, fake_time=False)
    try:
        assert not pair.fake_time
        assert pair.clock is time.monotonic
    finally:
        pair.close()
