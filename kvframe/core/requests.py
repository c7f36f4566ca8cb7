"""The P/D scheduler's request states, for both roles, as transition tables.

The scheduler half of the P/D connector tracks each request it is responsible for in one of
these states and moves it only through :data:`DECODE_REQUEST_TRANSITIONS` or
:data:`PREFILL_REQUEST_TRANSITIONS` (an illegal move raises
:class:`~kvframe.errors.InvalidTransitionError`). The docs draw both tables.

**Decode (D).** A remote-prefill request is ``waiting`` from the moment it enters the scheduler
(its lease is heartbeated from then on), ``loading`` once the engine allocated its blocks and
the workers were told to read, and ``done`` when the workers reported the load stopped
(``finished_recving``), when its KV was found locally, or when it ended before a load began. A
request the engine finishes while ``loading`` is ``aborting`` until the workers report its
transfer stopped: only then may the engine reuse its blocks.

**Prefill (P).** A request that finished with ``do_remote_decode`` is ``held`` under a lease
until the workers report the lease ended (``finished_sending``): consumed, released or expired.
"""

from __future__ import annotations

import enum

from kvframe.core.machine import Step, TransitionTable

__all__ = [
    "DECODE_REQUEST_TRANSITIONS",
    "PREFILL_REQUEST_TRANSITIONS",
    "DecodeRequestEvent",
    "DecodeRequestState",
    "PrefillRequestEvent",
    "PrefillRequestState",
    "decode_diagram",
    "decode_table",
    "prefill_table",
]


class DecodeRequestState(enum.Enum):
    """A remote-prefill request on D's scheduler."""

    WAITING = "waiting"
    """Known and heartbeated; no blocks allocated for its load yet."""
    LOADING = "loading"
    """Blocks allocated; the workers are reading."""
    ABORTING = "aborting"
    """Finished by the engine while loading; the workers are stopping the read."""
    DONE = "done"
    """Nothing more to do for it (loaded, failed, released or stopped)."""


class DecodeRequestEvent(enum.Enum):
    """What happens to a remote-prefill request on D's scheduler."""

    ALLOCATED = "allocated"
    """``update_state_after_alloc`` with external tokens to load."""
    LOCAL_HIT = "local_hit"
    """Everything loadable is in the local prefix cache (or nothing was allocated)."""
    FINISHED = "finished"
    """``request_finished`` (any reason)."""
    LOAD_STOPPED = "load_stopped"
    """The workers reported it in ``finished_recving`` (completed, failed or aborted)."""


class PrefillRequestState(enum.Enum):
    """A request P keeps for a remote decoder."""

    HELD = "held"
    """Its blocks are kept under a lease."""
    ENDED = "ended"
    """The lease ended; the engine frees the blocks."""


class PrefillRequestEvent(enum.Enum):
    """What happens to a request P keeps."""

    LEASE_ENDED = "lease_ended"
    """The workers reported it in ``finished_sending``."""


_D, _DE = DecodeRequestState, DecodeRequestEvent

#: D's scheduler: every legal move of a remote-prefill request.
DECODE_REQUEST_TRANSITIONS: TransitionTable[DecodeRequestState, DecodeRequestEvent] = (
    TransitionTable(
        "remote-prefill request",
        DecodeRequestState,
        DecodeRequestEvent,
        [
            Step(
                source=_D.WAITING,
                event=_DE.ALLOCATED,
                target=_D.LOADING,
                effect="load instruction to the workers",
            ),
            Step(
                source=_D.WAITING,
                event=_DE.LOCAL_HIT,
                target=_D.DONE,
                effect="heartbeats stop; release sent to P",
            ),
            Step(
                source=_D.WAITING,
                event=_DE.FINISHED,
                target=_D.DONE,
                effect="heartbeats stop; release sent to P",
            ),
            Step(
                source=_D.LOADING,
                event=_DE.LOAD_STOPPED,
                target=_D.DONE,
                effect="heartbeats stop; the engine schedules it",
            ),
            Step(
                source=_D.LOADING,
                event=_DE.FINISHED,
                target=_D.ABORTING,
                effect="abort to the workers; the engine keeps the blocks",
            ),
            Step(
                source=_D.ABORTING,
                event=_DE.LOAD_STOPPED,
                target=_D.DONE,
                effect="the engine frees the blocks",
            ),
        ],
        terminal=(_D.DONE,),
    )
)

_P, _PE = PrefillRequestState, PrefillRequestEvent

#: P's scheduler: every legal move of a kept request.
PREFILL_REQUEST_TRANSITIONS: TransitionTable[PrefillRequestState, PrefillRequestEvent] = (
    TransitionTable(
        "kept request",
        PrefillRequestState,
        PrefillRequestEvent,
        [
            Step(
                source=_P.HELD,
                event=_PE.LEASE_ENDED,
                target=_P.ENDED,
                effect="finished_sending: the engine frees the blocks",
            ),
        ],
        terminal=(_P.ENDED,),
    )
)
del _D, _DE, _P, _PE


def decode_diagram() -> str:
    """D's request states as a mermaid block (embedded in ``docs/pd.md``)."""
    return DECODE_REQUEST_TRANSITIONS.diagram(DecodeRequestState.WAITING)


def decode_table() -> str:
    """D's request transitions as a markdown table (embedded in ``docs/pd.md``)."""
    return DECODE_REQUEST_TRANSITIONS.markdown()


def prefill_table() -> str:
    """P's request transitions as a markdown table (embedded in ``docs/pd.md``)."""
    return PREFILL_REQUEST_TRANSITIONS.markdown()
