"""kvframe.testing: the conformance kit for transport plugins, and test helpers.

- :class:`TransportConformance` — subclass it to run the kit against your transport; enable
  the fixtures with ``pytest_plugins = ["kvframe.testing.pytest_plugin"]``.
- :func:`run_transport_state_machine` — the kit's Hypothesis state machine.
- :class:`Pair`, :func:`make_pair` (:mod:`kvframe.testing.pair`) — two connected endpoints of
  the transport under test, waiting on a fake clock when both are in this process.
- :class:`LocalEndpoint`, :class:`ChildEndpoint`, :class:`TransportSpec` — drive endpoints in
  this process or in a child process (msgpack over a socket pair).
- :class:`Faults`, :class:`FaultRule`, :class:`FaultEvent` (:mod:`kvframe.testing.faults`) —
  fault injection for the in-process transport.
- :class:`FakeClock` — a clock that moves only when told to.
- :class:`XferStatus` — what ``Transport.poll`` answers, re-exported from
  :mod:`kvframe.spi.transport` (it used to be a two-field type of the kit's own).

The names that need pytest or Hypothesis are imported on first use, so
``python -m kvframe.testing._endpoint`` starts without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvframe.spi.transport import XferStatus
from kvframe.testing.clock import FakeClock
from kvframe.testing.endpoint import (
    ChildEndpoint,
    Endpoint,
    LocalEndpoint,
    RemoteError,
    TransportSpec,
)
from kvframe.testing.faults import FaultEvent, FaultRule, Faults
from kvframe.testing.pair import Pair, make_pair

if TYPE_CHECKING:
    from kvframe.testing.conformance import TransportConformance
    from kvframe.testing.stateful import TransportStateMachine, run_transport_state_machine

__all__ = [
    "ChildEndpoint",
    "Endpoint",
    "FakeClock",
    "FaultEvent",
    "FaultRule",
    "Faults",
    "LocalEndpoint",
    "Pair",
    "RemoteError",
    "TransportConformance",
    "TransportSpec",
    "TransportStateMachine",
    "XferStatus",
    "make_pair",
    "run_transport_state_machine",
]

_LAZY = {
    "TransportConformance": "kvframe.testing.conformance",
    "TransportStateMachine": "kvframe.testing.stateful",
    "run_transport_state_machine": "kvframe.testing.stateful",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvframe.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
