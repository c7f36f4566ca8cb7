"""kvframe.testing: the conformance kit for transport plugins, and test helpers.

- :class:`TransportConformance` — subclass it to run the kit against your transport; enable
  the fixtures with ``pytest_plugins = ["kvframe.testing.pytest_plugin"]``.
- :func:`run_transport_state_machine` — the kit's Hypothesis state machine.
- :class:`LocalEndpoint`, :class:`ChildEndpoint`, :class:`TransportSpec`, :func:`make_pair` —
  drive endpoints in this process or in a child process (msgpack over a socket pair).
- :class:`FakeClock` — a clock that moves only when told to.

The names that need pytest or Hypothesis are imported on first use, so
``python -m kvframe.testing._endpoint`` starts without them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvframe.testing.clock import FakeClock
from kvframe.testing.endpoint import (
    ChildEndpoint,
    Endpoint,
    LocalEndpoint,
    RemoteError,
    TransportSpec,
    XferStatus,
)

if TYPE_CHECKING:
    from kvframe.testing.conformance import Pair, TransportConformance, make_pair
    from kvframe.testing.stateful import TransportStateMachine, run_transport_state_machine

__all__ = [
    "ChildEndpoint",
    "Endpoint",
    "FakeClock",
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
    "Pair": "kvframe.testing.conformance",
    "TransportConformance": "kvframe.testing.conformance",
    "make_pair": "kvframe.testing.conformance",
    "TransportStateMachine": "kvframe.testing.stateful",
    "run_transport_state_machine": "kvframe.testing.stateful",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvframe.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
