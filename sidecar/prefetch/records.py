"""What the executor keeps per session, per claimed chunk and per read it stopped waiting for.

Plain records, owned by the control thread (``kvsidecar.sidecar.prefetch.executor``).  A ``Record``'s
``pins`` are the blocks the session holds a reference on (its resident prefix and what it
published); a ``ChunkIO``'s ``own_blocks`` are STAGING blocks only its read may fill — they are
published or freed only after that read ended (an ``Orphan`` keeps them when the session no
longer waits).
"""

from __future__ import annotations

import dataclasses

from kvsidecar.sidecar.prefetch.machine import Session


@dataclasses.dataclass
class ChunkIO:
    start: int
    count: int
    kinds: list  # per position: "have" | "shared" | "own"
    own_blocks: dict  # position -> staging block
    shared_ok: dict  # position -> None (waiting) | bool
    read_ok: dict | None = None  # position -> bool once our read completed
    reading: bool = False
    job: object = None  # the read lane job (cancellable until it starts)
    t0: float = 0.0  # when the claim was carried out (chunk time = claim -> data landed)


@dataclasses.dataclass
class Orphan:
    chain: bytes
    io: ChunkIO


@dataclasses.dataclass
class Record:
    id: int
    key: tuple  # (group, req, attempt)
    machine: Session
    chain: bytes
    ns: str
    policy: str
    created: float
    pins: dict  # position -> block pinned by this session
    chunks: dict = dataclasses.field(default_factory=dict)
    result_lease: object = None
    trigger_at: float | None = None
    trigger: str = ""  # what stopped it first: demand | deadline | abort
    sealed_at: float | None = None
    terminal_at: float | None = None
    chunk_times: list = dataclasses.field(default_factory=list)  # claim -> data landed (incl. lane queue)
    transfer_times: list = dataclasses.field(default_factory=list)  # the L3 read itself
    restored: int = 0
    demanded: bool = False  # a scheduling candidate: its reads go ahead of queued requests'
    drain_timer: bool = False  # a drain deadline is armed
    abandoned: int = 0  # chunks whose read was still in flight when the drain budget ran out
    eta: float | None = None  # cost_aware: when the engine expects to start its prefill (None: now)
    prefill_s_per_block: float = 0.0  # cost_aware: the engine's prefill cost of one block
    withdrawn: int = 0  # blocks of queued reads withdrawn at the seal
    read_s_per_block: list = dataclasses.field(default_factory=list)  # per completed L3 read
    # the session's own timeline, [(event, clock, detail)] (bounded by its chunks): returned by
    # ``poll`` with ``events`` so an engine-side benchmark can place each phase of a request
    events: list = dataclasses.field(default_factory=list)
