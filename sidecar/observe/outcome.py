"""What a prefetch session looked like when it ended, and who is told.

The executor builds one :class:`SessionOutcome` at a session's terminal transition and hands
it to its :class:`SessionObserver` (given at construction) on the control thread.  Observers
must be cheap and must not raise into the executor: :class:`Observers` fans out and logs (never
re-raises) an observer's failure.  Policies and statuses are plain strings (``cost_aware`` /
``cost`` included), so a new policy needs no change here.
"""

from __future__ import annotations

import dataclasses
import logging

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SessionOutcome:
    session: int
    request: str
    group: str
    policy: str
    status: str  # complete | timeout | demanded | aborted | failed | cost | no_hit
    reason: str
    trigger: str  # what stopped it first: demand | deadline | abort | "" (ran to its end)
    blocks_total: int  # blocks in the chain
    blocks_resident: int  # leading blocks resident in the CPU pool when it started
    blocks_target: int  # end of the L3 hit range (resident + L3 hits)
    blocks_published: int  # contiguous prefix it vouched for
    prefix: int  # what the result lease pins (published, cut to a checkpoint)
    blocks_restored: int  # read from L3 and published by this session
    blocks_withdrawn: int  # queued reads withdrawn at the seal (never touched)
    chunks: int
    chunks_abandoned: int
    elapsed_s: float  # created -> terminal
    stop_latency_s: float | None  # trigger -> terminal
    drain_s: float | None  # sealed -> terminal
    chunk_s: tuple = ()  # claim -> data landed, per chunk
    read_s_per_block: tuple = ()  # the L3 read itself over its blocks, per read
    tokens_per_block: int = 0
    prefill_s_per_block: float = 0.0  # cost_aware: the engine's reported prefill cost of one block (0: none)


class SessionObserver:
    """Told about every session that ended (control thread; must be cheap, must not block)."""

    def session_ended(self, outcome: SessionOutcome) -> None:
        return None


class Observers(SessionObserver):
    """Several observers; one failing is logged and never reaches the executor."""

    def __init__(self, *observers: SessionObserver):
        self.observers = [o for o in observers if o is not None]

    def session_ended(self, outcome: SessionOutcome) -> None:
        for o in self.observers:
            try:
                o.session_ended(outcome)
            except Exception:
                log.exception("%s.session_ended failed", type(o).__name__)
