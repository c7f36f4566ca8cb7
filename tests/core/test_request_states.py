"""The P/D transition tables as data: the scheduler's request states (D and P) and D's loads.

For each table: every listed step is taken by ``TransitionTable.next`` and lands where the table
says; every other (state x event) pair raises ``InvalidTransitionError`` naming the subject,
the state, the event and what is legal there; terminal states lead nowhere; every state is
reachable and can reach an end; the docs' diagram and table show every step. How the reader
takes each of its steps through its public API is in ``test_reader.py``.
"""

from __future__ import annotations

import enum
import itertools
from typing import Any

import pytest

from kvframe.core.machine import Step, TransitionTable
from kvframe.core.reader import READ_TRANSITIONS, ReadEvent, ReadState
from kvframe.core.requests import (
    DECODE_REQUEST_TRANSITIONS,
    PREFILL_REQUEST_TRANSITIONS,
    DecodeRequestEvent,
    DecodeRequestState,
    PrefillRequestEvent,
    PrefillRequestState,
)
from kvframe.errors import InvalidTransitionError

AnyTable = TransitionTable[Any, Any]

TABLES: dict[str, tuple[AnyTable, enum.Enum]] = {
    "load": (READ_TRANSITIONS, ReadState.WAITING_PEER),
    "decode request": (DECODE_REQUEST_TRANSITIONS, DecodeRequestState.WAITING),
    "prefill request": (PREFILL_REQUEST_TRANSITIONS, PrefillRequestState.HELD),
}

D, DE = DecodeRequestState, DecodeRequestEvent
P, PE = PrefillRequestState, PrefillRequestEvent
R, RE = ReadState, ReadEvent

#: The tables as the module docs describe them, written out once more by hand.
EXPECTED: dict[str, dict[tuple[enum.Enum, enum.Enum], enum.Enum]] = {
    "decode request": {
        (D.WAITING, DE.ALLOCATED): D.LOADING,
        (D.WAITING, DE.LOCAL_HIT): D.DONE,
        (D.WAITING, DE.FINISHED): D.DONE,
        (D.LOADING, DE.LOAD_STOPPED): D.DONE,
        (D.LOADING, DE.FINISHED): D.ABORTING,
        (D.ABORTING, DE.LOAD_STOPPED): D.DONE,
    },
    "prefill request": {(P.HELD, PE.LEASE_ENDED): P.ENDED},
    "load": {
        (R.WAITING_PEER, RE.PEER_READY): R.CONFIRMING,
        (R.WAITING_PEER, RE.PEER_FAILED): R.FAILED,
        (R.WAITING_PEER, RE.LOST): R.FAILED,
        (R.WAITING_PEER, RE.ABORT): R.ABORTED,
        (R.WAITING_PEER, RE.TIMEOUT): R.FAILED,
        (R.CONFIRMING, RE.CONFIRMED): R.POSTED,
        (R.CONFIRMING, RE.POST_EARLY): R.POSTED,
        (R.POSTED, RE.TRANSFER_UNCONFIRMED): R.VERIFYING,
        (R.VERIFYING, RE.CONFIRMED): R.DONE,
        (R.VERIFYING, RE.CONFIRMED_LATE): R.FAILED,
        (R.VERIFYING, RE.SEEN_LIVE): R.DONE,
        (R.VERIFYING, RE.LOST): R.FAILED,
        (R.VERIFYING, RE.PEER_FAILED): R.FAILED,
        (R.VERIFYING, RE.ABORT): R.ABORTED,
        (R.VERIFYING, RE.TIMEOUT): R.FAILED,
        (R.CONFIRMING, RE.PEER_LOST): R.WAITING_PEER,
        (R.CONFIRMING, RE.PEER_FAILED): R.FAILED,
        (R.CONFIRMING, RE.LOST): R.FAILED,
        (R.CONFIRMING, RE.ABORT): R.ABORTED,
        (R.CONFIRMING, RE.TIMEOUT): R.FAILED,
        (R.POSTED, RE.TRANSFER_DONE): R.DONE,
        (R.POSTED, RE.TRANSFER_LATE): R.FAILED,
        (R.POSTED, RE.TRANSFER_FAILED): R.FAILED,
        (R.POSTED, RE.LOST): R.FAILED,
        (R.POSTED, RE.PEER_FAILED): R.FAILED,
        (R.POSTED, RE.PEER_BROKEN): R.WAITING_PEER,
        (R.POSTED, RE.ABORT): R.ABORTED,
        (R.POSTED, RE.TIMEOUT): R.FAILED,
    },
}
TERMINAL = {
    "decode request": {D.DONE},
    "prefill request": {P.ENDED},
    "load": {R.DONE, R.FAILED, R.ABORTED},
}


def _members(kind: Any) -> list[Any]:
    return list(kind)


def _pairs() -> list[tuple[str, enum.Enum, enum.Enum]]:
    return [
        (name, s, e)
        for name, (table, _) in TABLES.items()
        for s, e in itertools.product(_members(table.states), _members(table.events))
    ]


def _steps() -> list[tuple[str, Step[Any, Any]]]:
    return [(name, step) for name, (table, _) in TABLES.items() for step in table.steps]


@pytest.mark.parametrize("name", list(TABLES))
def test_the_table_is_the_documented_one(name: str) -> None:
    table, _ = TABLES[name]
    assert {(s.source, s.event): s.target for s in table.steps} == EXPECTED[name]
    assert len(table.steps) == len(EXPECTED[name])  # no pair listed twice
    assert table.terminal == TERMINAL[name]
    assert all(s.effect for s in table.steps)


@pytest.mark.parametrize(
    ("name", "step"),
    _steps(),
    ids=lambda v: v if isinstance(v, str) else f"{v.source.value}-{v.event.value}",
)
def test_every_step_is_taken(name: str, step: Step[Any, Any]) -> None:
    table, _ = TABLES[name]
    assert table.legal(step.source, step.event)
    assert table.next(step.source, step.event, "r1") is step.target


@pytest.mark.parametrize(
    ("name", "state", "event"),
    [p for p in _pairs() if not TABLES[p[0]][0].legal(p[1], p[2])],
    ids=lambda v: v if isinstance(v, str) else v.value,
)
def test_every_other_pair_is_refused(name: str, state: enum.Enum, event: enum.Enum) -> None:
    table, _ = TABLES[name]
    legal_here = sorted(s.event.value for s in table.steps if s.source is state)
    with pytest.raises(InvalidTransitionError) as info:
        table.next(state, event, "r1")
    message = str(info.value)
    assert message.startswith(f"{table.name} 'r1': {event.value} is illegal")
    assert repr(state.value) in message
    assert (", ".join(legal_here) or "nothing (terminal)") in message
    # Without a subject the message still names the table, the state and the event.
    with pytest.raises(InvalidTransitionError, match=f"^{table.name}: {event.value} is illegal"):
        table.next(state, event)


@pytest.mark.parametrize("name", list(TABLES))
def test_every_state_is_reachable_and_can_end(name: str) -> None:
    table, initial = TABLES[name]
    states = _members(table.states)
    out: dict[Any, set[Any]] = {s: set() for s in states}
    for step in table.steps:
        out[step.source].add(step.target)
    seen, todo = {initial}, [initial]
    while todo:
        for nxt in out[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    assert seen == set(states)
    for state in states:
        assert (not out[state]) == (state in table.terminal)
        ends, todo = set(), [state]
        visited = {state}
        while todo:
            s = todo.pop()
            if s in table.terminal:
                ends.add(s)
            for nxt in out[s] - visited:
                visited.add(nxt)
                todo.append(nxt)
        assert ends, f"{state} can never end"


@pytest.mark.parametrize("name", list(TABLES))
def test_the_docs_draw_every_step(name: str) -> None:
    table, initial = TABLES[name]
    diagram = table.diagram(initial)
    assert diagram.startswith("```mermaid\nstateDiagram-v2\n")
    assert f"    [*] --> {initial.value}\n" in diagram
    rows = table.markdown().splitlines()
    assert rows[:2] == ["| state | event | next state | effect |", "|---|---|---|---|"]
    assert len(rows) == 2 + len(table.steps)
    for step in table.steps:
        assert f"    {step.source.value} --> {step.target.value}: {step.event.value}" in diagram
        row = f"| `{step.source.value}` | `{step.event.value}` | `{step.target.value}` |"
        assert any(r.startswith(row) for r in rows)
    for end in table.terminal:
        assert f"    {end.value} --> [*]" in diagram


class _S(enum.Enum):
    A = "a"
    B = "b"


class _E(enum.Enum):
    GO = "go"


def test_a_table_refuses_a_pair_listed_twice_or_a_way_out_of_an_end() -> None:
    step = Step(source=_S.A, event=_E.GO, target=_S.B, effect="x")
    with pytest.raises(ValueError, match=r"\(A, GO\) listed twice"):
        TransitionTable("t", _S, _E, [step, step])
    with pytest.raises(ValueError, match="terminal state A has a step out"):
        TransitionTable("t", _S, _E, [step], terminal=[_S.A])
    table = TransitionTable("t", _S, _E, [step], terminal=[_S.B])
    with pytest.raises(InvalidTransitionError, match="legal there: nothing"):
        table.next(_S.B, _E.GO)
