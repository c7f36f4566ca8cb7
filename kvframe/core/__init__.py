"""The sans-I/O core: pure state machines that take ``now`` and return what must happen.

Imports only the standard library and attrs. Never reads a clock, sleeps, starts a thread, opens
a socket or logs.

- :mod:`kvframe.core.lease` — P's lease table and the one-number timing policy.
- :mod:`kvframe.core.heartbeat` — D's heartbeat tracker and P's heartbeat guard.
- :mod:`kvframe.core.clock` — clamping, deadline rebasing, clock-offset estimation.
- :mod:`kvframe.core.wire` — the heartbeat / lease-ack wire format.
"""

from kvframe.core import wire
from kvframe.core.clock import (
    ClockOffsetEstimator,
    ClockSample,
    DecoderBlocksTTL,
    MonotonicClamp,
    SendTimeMapper,
    rebase_deadline,
)
from kvframe.core.heartbeat import HeartbeatBatch, HeartbeatGuard, HeartbeatTracker, StopReason
from kvframe.core.lease import (
    TRANSITIONS,
    Lease,
    LeaseCounters,
    LeaseEvent,
    LeasePolicy,
    LeaseState,
    LeaseTable,
    RenewIgnored,
    RenewResult,
    Transition,
    next_state,
    state_diagram,
    transition_table,
)

__all__ = [
    "TRANSITIONS",
    "ClockOffsetEstimator",
    "ClockSample",
    "DecoderBlocksTTL",
    "HeartbeatBatch",
    "HeartbeatGuard",
    "HeartbeatTracker",
    "Lease",
    "LeaseCounters",
    "LeaseEvent",
    "LeasePolicy",
    "LeaseState",
    "LeaseTable",
    "MonotonicClamp",
    "RenewIgnored",
    "RenewResult",
    "SendTimeMapper",
    "StopReason",
    "Transition",
    "next_state",
    "rebase_deadline",
    "state_diagram",
    "transition_table",
    "wire",
]
