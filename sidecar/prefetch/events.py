"""The prefetch session machine's vocabulary: policies, states and statuses, the typed events
it accepts and the typed actions it emits, and which event each state accepts.

Data only (frozen dataclasses and enums), no behaviour: :mod:`kvsidecar.sidecar.prefetch.machine`
is the machine over it, the control thread (``sessions``) builds the events and its executor
carries out the actions.  :data:`TRANSITIONS` is the one table of (state, event type) →
``LEGAL`` or ``IGNORED``; a pair not in it is an :class:`IllegalTransition`.
"""

from __future__ import annotations

import dataclasses
import enum

from kvsidecar.sidecar.prefetch.cost import Outlook


class Policy(str, enum.Enum):
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"
    BEST_EFFORT = "best_effort"
    COST_AWARE = "cost_aware"


class State(str, enum.Enum):
    CREATED = "created"
    QUERYING = "querying"
    RUNNING = "running"
    DRAINING = "draining"
    TERMINAL = "terminal"


class Status(str, enum.Enum):
    COMPLETE = "complete"
    TIMEOUT = "timeout"
    DEMANDED = "demanded"
    ABORTED = "aborted"
    FAILED = "failed"  # a block read failed (the prefix is cut there), or L3 did not hold the span
    LIMIT = "limit"  # a healthy capacity stop: a pool limit shrank a claim; it ends with what it has
    COST = "cost"  # cost_aware stopped: restoring more would not lower TTFT
    NO_HIT = "no_hit"


# -- actions ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Query:
    start: int  # ask L3 how many consecutive blocks from here it holds


@dataclasses.dataclass(frozen=True)
class Claim:
    chunk: int
    start: int
    count: int  # reserve staging and read [start, start+count) from L3


@dataclasses.dataclass(frozen=True)
class Publish:
    chunk: int
    count: int  # make the chunk's first `count` blocks resident (data landed, predecessors published)


@dataclasses.dataclass(frozen=True)
class Drop:
    chunk: int
    offset: int  # free the chunk's blocks from `offset` on (failed, or beyond a cut)


@dataclasses.dataclass(frozen=True)
class Detach:
    chunk: int  # a chunk still in flight: the session stops counting on it
    # A probe's read goes on without it (its blocks are published if they land in chain order;
    # its timing still teaches the estimator); the probe's session is sealed.  ``withdraw``: a
    # chunk read with the query that the answer put wholly past L3's hit -- taken back from the
    # sender queue if its read has not started, else left to end on its own (nothing of it is
    # in L3: it publishes nothing).
    withdraw: bool = False


@dataclasses.dataclass(frozen=True)
class Finish:
    status: Status
    prefix: int  # the protected continuous prefix [0, prefix), on a valid checkpoint
    reason: str = ""


# -- events (inputs; every one carries the caller's clock) ---------------------------------------
@dataclasses.dataclass(frozen=True)
class Start:
    now: float
    # cost_aware: the engine sent its ETA with the prefetch, so the outlook at start is the
    # engine's own: a query whose best case cannot lower TTFT is not sent (the session ends at
    # once with the resident prefix).  Without one the ETA is only assumed "now": it queries.
    eta_given: bool = False


@dataclasses.dataclass(frozen=True)
class QueryDone:
    hits: int  # consecutive blocks from the Query's start that L3 holds
    now: float
    outlook: Outlook | None = None  # cost_aware: the cost inputs now


@dataclasses.dataclass(frozen=True)
class ClaimShort:
    chunk: int
    granted: int  # the executor could reserve only this many of the claimed blocks (a limit)
    now: float


@dataclasses.dataclass(frozen=True)
class ChunkDone:
    chunk: int
    ok: tuple  # per block of the chunk: its data landed
    now: float
    outlook: Outlook | None = None


@dataclasses.dataclass(frozen=True)
class ChunkWithdrawn:
    chunk: int  # after a seal: its read never started (taken back from the sender queue)
    now: float


@dataclasses.dataclass(frozen=True)
class ChunkAbandoned:
    chunk: int  # after a seal: its read is still in flight, the drain budget ran out
    now: float


@dataclasses.dataclass(frozen=True)
class Demand:
    now: float  # the request became a scheduling candidate
    outlook: Outlook | None = None  # cost_aware: re-plan with this (its eta is now)
    # the engine admits the request now with what has landed (SGLang's settler: ``demand``
    # with ``drain_s``): cost_aware, where restoring is dearer per block than prefill, stops
    # claiming and withdraws what has not started even where the reads in flight would pay at
    # the ETA -- landing after the admission, they are of no use to it (reads cheaper than
    # prefill are still worth the engine's next admission: re-planned as usual)
    admitted: bool = False


@dataclasses.dataclass(frozen=True)
class Replan:
    now: float  # the engine sent a new ETA (cost_aware re-plans; other policies ignore it)
    outlook: Outlook


@dataclasses.dataclass(frozen=True)
class Tick:
    now: float  # a timer fired (the deadline)


@dataclasses.dataclass(frozen=True)
class Abort:
    now: float  # the request left


class IllegalEvent(ValueError):
    """An event the machine cannot receive (a bug in the caller)."""


class IllegalTransition(IllegalEvent):
    """An event type the session's state does not accept (not in :data:`TRANSITIONS`)."""

    def __init__(self, state: State, event):
        super().__init__(f"{type(event).__name__} in state {state.value}")
        self.state = state
        self.event = event


LEGAL = "legal"  # the event is handled
IGNORED = "ignored"  # a late event that raced the end (a query answer, a repeated trigger)

# Every event type, and the state-independent ones: triggers and re-plans may come at any time.
EVENTS = (Start, QueryDone, ClaimShort, ChunkDone, ChunkWithdrawn, ChunkAbandoned, Demand, Replan, Tick, Abort)
_TRIGGERS = (Demand, Replan, Tick, Abort)

#: (state, event type) -> LEGAL | IGNORED; any other pair is an :class:`IllegalTransition`.
#: Chunks exist from RUNNING on, and while QUERYING only the one read with the query
#: (``Params.read_with_query``); a chunk is withdrawn or abandoned only after the seal, which
#: with anything in flight is DRAINING (a session sealed before its query answered ignores the
#: late answer there); after TERMINAL late answers and triggers are ignored, but chunk
#: bookkeeping is a bug.
TRANSITIONS: dict = {
    **{(State.CREATED, e): LEGAL for e in (Start, *_TRIGGERS)},
    **{(State.QUERYING, e): LEGAL for e in (QueryDone, ClaimShort, ChunkDone, *_TRIGGERS)},
    **{(State.RUNNING, e): LEGAL for e in (ClaimShort, ChunkDone, *_TRIGGERS)},
    **{(State.DRAINING, e): LEGAL for e in (ClaimShort, ChunkDone, ChunkWithdrawn, ChunkAbandoned, *_TRIGGERS)},
    (State.DRAINING, QueryDone): IGNORED,
    **{(State.TERMINAL, e): IGNORED for e in (Start, QueryDone, ChunkDone, *_TRIGGERS)},
}
