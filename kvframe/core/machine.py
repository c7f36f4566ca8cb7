"""Transition tables as data: one small helper every P/D machine of the core uses.

A machine lists its legal ``(state, event) -> target`` steps as :class:`Step` rows in a
:class:`TransitionTable`. The machine asks the table for every event it applies
(:meth:`TransitionTable.next`): an illegal pair raises
:class:`~kvframe.errors.InvalidTransitionError` naming the state, the event, the subject and
what is legal, before anything changed. Tests enumerate the table; the docs draw it
(:meth:`TransitionTable.diagram`, :meth:`TransitionTable.markdown`), so the picture cannot
drift from the code. (:mod:`kvframe.core.lease` keeps its own, older table of the same shape.)
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Generic, TypeVar

import attrs

from kvframe.errors import InvalidTransitionError

__all__ = ["Step", "TransitionTable"]

_S = TypeVar("_S", bound=enum.Enum)
_E = TypeVar("_E", bound=enum.Enum)


@attrs.frozen(kw_only=True)
class Step(Generic[_S, _E]):
    """One legal step: in ``source``, ``event`` leads to ``target`` and does ``effect``."""

    source: _S
    event: _E
    target: _S
    effect: str
    """What happens, in a few words (shown in the docs)."""


class TransitionTable(Generic[_S, _E]):
    """The legal steps of one machine.

    :param name: what the subject is called in error messages (``"load"``, ``"request"``).
    :param states: the state enum; :param events: the event enum.
    :param steps: the legal steps; a ``(source, event)`` pair may appear once.
    :param terminal: states with no way out (drawn as ending in the diagram).
    :raises ValueError: a pair appears twice, or a terminal state has a step out.
    """

    def __init__(
        self,
        name: str,
        states: type[_S],
        events: type[_E],
        steps: Iterable[Step[_S, _E]],
        *,
        terminal: Iterable[_S] = (),
    ) -> None:
        self.name = name
        self.states = states
        self.events = events
        self.steps: tuple[Step[_S, _E], ...] = tuple(steps)
        self.terminal: frozenset[_S] = frozenset(terminal)
        self._index: dict[tuple[_S, _E], Step[_S, _E]] = {}
        for step in self.steps:
            key = (step.source, step.event)
            if key in self._index:
                raise ValueError(f"{name}: ({step.source.name}, {step.event.name}) listed twice")
            if step.source in self.terminal:
                raise ValueError(f"{name}: terminal state {step.source.name} has a step out")
            self._index[key] = step

    def legal(self, state: _S, event: _E) -> bool:
        """Whether ``event`` is legal in ``state``."""
        return (state, event) in self._index

    def next(self, state: _S, event: _E, subject: str | None = None) -> _S:
        """The state after ``event`` in ``state``.

        :raises InvalidTransitionError: the pair is not in the table; the message names the
            subject, the state, the event and the events legal in that state.
        """
        step = self._index.get((state, event))
        if step is None:
            legal = sorted(e.value for (s, e) in self._index if s is state)
            who = f" {subject!r}" if subject is not None else ""
            raise InvalidTransitionError(
                f"{self.name}{who}: {event.value} is illegal in state {state.value!r}; "
                f"legal there: {', '.join(legal) or 'nothing (terminal)'}"
            )
        return step.target

    def diagram(self, initial: _S) -> str:
        """A mermaid ``stateDiagram-v2`` block drawn from the steps."""
        lines = ["```mermaid", "stateDiagram-v2", f"    [*] --> {initial.value}"]
        lines += [f"    {s.source.value} --> {s.target.value}: {s.event.value}" for s in self.steps]
        lines += [f"    {t.value} --> [*]" for t in self.states if t in self.terminal]
        lines.append("```")
        return "\n".join(lines) + "\n"

    def markdown(self) -> str:
        """The steps as a markdown table (state, event, next state, effect)."""
        lines = ["| state | event | next state | effect |", "|---|---|---|---|"]
        lines += [
            f"| `{s.source.value}` | `{s.event.value}` | `{s.target.value}` | {s.effect} |"
            for s in self.steps
        ]
        return "\n".join(lines) + "\n"
