"""The sans-I/O core: pure state machines that take ``now`` and return what must happen.

Imports only the standard library, attrs and numpy (the lease table's bulk paths). Never reads
a clock, sleeps, starts a thread, opens a socket or logs.

- :mod:`kvframe.core.lease` — P's lease table and the one-number timing policy.
- :mod:`kvframe.core.heartbeat` — D's heartbeat tracker and P's heartbeat guard.
- :mod:`kvframe.core.clock` — clamping, deadline rebasing, clock-offset estimation.
- :mod:`kvframe.core.wire` — the heartbeat / lease-ack wire format.
- :mod:`kvframe.core.holder` — P's side of the P/D protocol (:class:`LeaseHolder`).
- :mod:`kvframe.core.reader` — D's side of the P/D protocol (:class:`LeaseReader`).
- :mod:`kvframe.core.slots` — the holder's lease table that readers READ to prove a lease
  without asking (:class:`LeaseSlots`).
- :mod:`kvframe.core.push` — push mode: the registration wire format and P's matching
  (:class:`~kvframe.core.push.PushSource`).
- :mod:`kvframe.core.receiver` — push mode, D's side
  (:class:`~kvframe.core.receiver.PushReceiver`).
- :mod:`kvframe.core.requests` — the P/D scheduler's request states.
- :mod:`kvframe.core.tp` — heterogeneous tensor parallelism: which prefill rank holds which
  KV heads of a decode rank, and the transfer units of a head slice.
- :mod:`kvframe.core.blocksize` — block-size conversion: which token ranges of one engine's
  blocks fill which of another's, as transfer units, and the stale tail to zero.
- :mod:`kvframe.core.machine` — transition tables as data, shared by the machines above.
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
from kvframe.core.holder import HolderOutput, LeaseHolder
from kvframe.core.lease import (
    TRANSITIONS,
    EndedLeases,
    HandleRenewResult,
    Lease,
    LeaseCounters,
    LeaseEvent,
    LeasePolicy,
    LeaseState,
    LeaseTable,
    RenewIgnored,
    RenewResult,
    Transition,
    lease_handle,
    next_state,
    state_diagram,
    transition_table,
)
from kvframe.core.machine import Step, TransitionTable
from kvframe.core.reader import READ_TRANSITIONS, LeaseReader, ReaderTimeouts, ReadState
from kvframe.core.requests import (
    DECODE_REQUEST_TRANSITIONS,
    PREFILL_REQUEST_TRANSITIONS,
    DecodeRequestState,
    PrefillRequestState,
)
from kvframe.core.slots import LeaseSlots, slot_tag

__all__ = [
    "DECODE_REQUEST_TRANSITIONS",
    "PREFILL_REQUEST_TRANSITIONS",
    "READ_TRANSITIONS",
    "TRANSITIONS",
    "ClockOffsetEstimator",
    "ClockSample",
    "DecodeRequestState",
    "DecoderBlocksTTL",
    "EndedLeases",
    "HandleRenewResult",
    "HeartbeatBatch",
    "HeartbeatGuard",
    "HeartbeatTracker",
    "HolderOutput",
    "Lease",
    "LeaseCounters",
    "LeaseEvent",
    "LeaseHolder",
    "LeasePolicy",
    "LeaseReader",
    "LeaseSlots",
    "LeaseState",
    "LeaseTable",
    "MonotonicClamp",
    "PrefillRequestState",
    "ReadState",
    "ReaderTimeouts",
    "RenewIgnored",
    "RenewResult",
    "SendTimeMapper",
    "Step",
    "StopReason",
    "Transition",
    "TransitionTable",
    "lease_handle",
    "next_state",
    "rebase_deadline",
    "slot_tag",
    "state_diagram",
    "transition_table",
    "wire",
]
