"""What a connector worker accumulates between two reports, and hands over once."""

from __future__ import annotations

from collections.abc import Mapping

from kvframe.protocol.messages import KVEvent

__all__ = ["WorkerReports"]


class WorkerReports:
    """Mixin for :class:`~kvframe.spi.connector.KVConnectorWorker` subclasses: keeps failed
    blocks, failure reasons and events until the engine collects them, each exactly once.

    Call :meth:`_init_reports` in ``__init__``; add to ``_invalid``, ``_failures`` and
    ``_events`` as things happen.
    """

    _invalid: set[int]
    _failures: dict[str, str]
    _events: list[KVEvent]

    def _init_reports(self) -> None:
        self._invalid = set()
        self._failures = {}
        self._events = []

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local blocks whose loads failed since the last call; each reported once."""
        out, self._invalid = self._invalid, set()
        return out

    def take_failures(self) -> Mapping[str, str]:
        """Request id → reason for loads that failed since the last call."""
        out, self._failures = self._failures, {}
        return out

    def take_events(self) -> tuple[KVEvent, ...]:
        """Events since the last call, oldest first; each returned once."""
        out = tuple(self._events)
        self._events.clear()
        return out
