"""What the session manager keeps per session and the executor per claimed chunk.

Plain records, owned by the control thread (``kvsidecar.sidecar.prefetch.sessions`` and
``.executor``).  The block state behind them is the pool manager's (``kvsidecar.sidecar.kv``): a
``Record``'s ``hold`` holds the session's pins (its resident prefix and what it published), a
``ChunkIO``'s ``plan`` the chunk's classified positions and its STAGING blocks.  Here only the
I/O side: the read-lane job, timings, counts for the outcome.
"""

from __future__ import annotations

import dataclasses

from kvsidecar.sidecar.kv.chunks import ChunkPlan, SessionHold
from kvsidecar.sidecar.prefetch.machine import Session


@dataclasses.dataclass
class ChunkIO:
    plan: ChunkPlan  # the claimed positions and their blocks (kvsidecar.sidecar.kv.chunks)
    job: object = None  # the read lane job (cancellable until it starts)
    t0: float = 0.0  # when the claim was carried out (chunk time = claim -> data landed)

    @property
    def reading(self) -> bool:
        """Our read of the chunk's own blocks is outstanding (none: all resident or awaited; or
        it ended; or a store superseded it, ``PoolManager``)."""
        return self.plan.read_ok is None and bool(self.plan.own_blocks)

    @property
    def count(self) -> int:
        return self.plan.count

    @property
    def own_blocks(self) -> dict:  # position -> STAGING block our read fills
        return self.plan.own_blocks

    @property
    def read_ok(self) -> dict | None:  # position -> bool once our read completed
        return self.plan.read_ok


@dataclasses.dataclass
class Record:
    id: int
    key: tuple  # (group, req, attempt)
    machine: Session
    chain: bytes
    ns: str
    policy: str
    created: float
    hold: SessionHold  # its pins, owned by the pool manager
    chunks: dict = dataclasses.field(default_factory=dict)  # chunk -> ChunkIO
    trigger_at: float | None = None
    trigger: str = ""  # what stopped it first: demand | deadline | abort
    sealed_at: float | None = None
    terminal_at: float | None = None
    chunk_times: list = dataclasses.field(default_factory=list)  # claim -> data landed (incl. lane queue)
    transfer_times: list = dataclasses.field(default_factory=list)  # the L3 read itself
    restored: int = 0
    demanded: bool = False  # a scheduling candidate: its reads go ahead of queued requests'
    drain_timer: bool = False  # a drain deadline is armed
    probe_timer: bool = False  # the re-plan at the probe deadline is armed (cost_aware)
    abandoned: int = 0  # chunks whose read was still in flight when the drain budget ran out
    eta: float | None = None  # cost_aware: when the engine expects to start its prefill (None: now)
    prefill_s_per_block: float = 0.0  # cost_aware: the engine's prefill cost of one block
    waiting: int = 0  # cost_aware: queued requests its prefill holds up, as the engine last said (0: queue_aware off)
    held: float = 0.0  # cost_aware: older requests still reading its prefill would hold up, at its last decision (ahead_aware)
    withdrawn: int = 0  # blocks of queued reads withdrawn at the seal
    read_s_per_block: list = dataclasses.field(default_factory=list)  # per completed L3 read
    # the session's own timeline, [(event, clock, detail)] (bounded by its chunks): returned by
    # ``poll`` with ``events`` so an engine-side benchmark can place each phase of a request
    events: list = dataclasses.field(default_factory=list)
