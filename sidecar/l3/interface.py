"""The session executor's contract with an L3 tier: what prefetch sessions call, and what they
may count on.

Three things implement it: the real :class:`~kvsidecar.sidecar.l3.tier.L3Tier` (worker lanes,
a backend), the executor bench's test-driven fake and the virtual-time simulator's serial lane
(both in ``scripts/fake_tier.py``).  ``tests/unit/sidecar/l3/test_tier_contract.py`` runs the
same checks against all three, so a fake that drifts from the real tier fails there.

Every method is called on the control thread and returns at once; answers come back later as
callbacks, **on the control thread**, never from inside the call that asked (a caller may be
half-way through a state change when it asks).  The value types a session sees (``ReadResult``,
``ReadOutlook``, the read priorities) are defined here so the executor needs nothing else from
the tier module.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol, runtime_checkable

from kvsidecar.sidecar.l3.cost_model import ReadEstimate

DEMANDED, QUEUED = 0, 1 << 40  # read priority classes (lower runs first)


def read_priority(demanded: bool, order: int = 0) -> int:
    """A read's lane priority: reads a scheduling candidate waits on run first; within a class,
    lower ``order`` first — sessions pass their id, so the older request's chunks go ahead of a
    younger one's (the engine admits in queue order; interleaving them would delay both)."""
    return (DEMANDED if demanded else QUEUED) + order


@dataclasses.dataclass(frozen=True)
class ReadOutlook:
    """What a new read of some priority faces: the cost estimate and the lane work ahead of it."""

    estimate: ReadEstimate
    backlog_s: float  # expected seconds of reads that run before it


@dataclasses.dataclass(frozen=True)
class ReadResult:
    """What one L3 read did: per-block success (one flag per block, in chain order) and how
    long the backend call took."""

    ok: list
    seconds: float

    @property
    def landed(self) -> int:
        return sum(self.ok)


@runtime_checkable
class ReadJob(Protocol):
    """A read handed to the tier's read lane (what :meth:`SessionTier.load` returns)."""

    def cancel(self) -> bool:
        """Withdraw the read if it has not started.  True: it never runs — its ``done`` is never
        called and its pool blocks were never touched, so the caller frees them at once.
        False: it started (or ended) and its ``done`` is (or was) called exactly once."""

    def raise_priority(self, priority: int) -> None:
        """Run sooner if still queued (its request became a scheduling candidate); a no-op once
        started or when ``priority`` is not lower than the current one."""


@runtime_checkable
class SessionTier(Protocol):
    """The L3 tier as the session executor and its estimates use it (control thread only)."""

    @property
    def read_s_per_block(self) -> float | None:
        """Running estimate of one block's read time in seconds: None until a read landed at
        least one block, then positive (a read that landed nothing does not change it)."""

    @property
    def query_s(self) -> float:
        """Running estimate of an existence query's latency as a session waits it (0.0: none
        measured yet); never negative."""

    @property
    def read_cost_error(self) -> float:
        """The read-cost estimator's own measured relative prediction error (0.0 when unknown);
        never negative.  ``cost_aware`` inflates its per-block estimate by it."""

    def lookup(self, ns: str, chain: bytes, done: Callable[[int], None]) -> None:
        """Ask how many leading blocks of ``chain`` L3 holds for namespace ``ns``.

        ``done(hits)`` is called exactly once, later, on the control thread: ``0 <= hits <=
        len(chain) // KEY``, counting from the first block up to the first one L3 lacks; an
        error answers 0 (a miss, never an exception)."""

    def load(self, ns: str, chain: bytes, blocks: bytes, done: Callable[[ReadResult], None],
             priority: int = QUEUED) -> ReadJob:
        """Read ``chain``'s blocks (one key each) into pool ``blocks`` (packed ids, same count).

        Reads of lower ``priority`` start first.  Unless the returned job is cancelled (see
        :meth:`ReadJob.cancel`), ``done(ReadResult)`` is called exactly once, later, on the
        control thread, with one flag per block: True only when that block's bytes landed (and,
        with checksums, matched).  A failed block is False, never an exception; a tier that
        stops with the read still queued answers it all False."""

    def read_outlook(self, priority: int = QUEUED) -> ReadOutlook:
        """The cost estimate and the expected seconds of reads that run before a new read of
        ``priority`` (queued or in flight, cancelled ones excluded); no side effects.  The
        backlog is never negative and never larger for a lower (sooner) priority."""


__all__ = ["DEMANDED", "QUEUED", "ReadJob", "ReadOutlook", "ReadResult", "SessionTier", "read_priority"]
