"""What a prefetch session holds in the pool: its pins and its claimed chunks (owned by ``kv/``).

Plain records; only :class:`kvsidecar.sidecar.kv.admission.PoolManager` changes the block state
they describe (the executor reads them and turns them into L3 jobs and replies).

* A :class:`SessionHold` is one session's set of pins, by chain position: its resident prefix at
  start, the resident blocks of its chunks, what it awaited and saw published, what it published.
* A :class:`ChunkPlan` is one claimed chunk ``[start, start + count)``, each position classified
  by a :class:`ChunkKind`.  Its ``own_blocks`` are STAGING blocks only its read may fill: they are
  published or freed only after that read ended (a plan the session stopped waiting for becomes
  an *orphan* of the manager until then).  ``attached`` is False once the session no longer counts
  on the plan (published, dropped, withdrawn, handed over or abandoned).
"""

from __future__ import annotations

import dataclasses
import enum


class ChunkKind(str, enum.Enum):
    """How a claimed position is served."""

    RESIDENT = "resident"  # resident now: pinned at once, nothing to read
    SHARED = "shared"  # being staged by another writer: awaited (one publication serves all)
    OWN = "own"  # ours to read from L3 into a STAGING block


# (module constants: an Enum member lookup on the class is a descriptor call on the hot path)
RESIDENT, SHARED, OWN = ChunkKind.RESIDENT, ChunkKind.SHARED, ChunkKind.OWN


@dataclasses.dataclass(eq=False)
class SessionHold:
    id: int  # the session's id
    chain: bytes
    pins: dict = dataclasses.field(default_factory=dict)  # position -> block pinned by the session
    plans: dict = dataclasses.field(default_factory=dict)  # chunk -> attached ChunkPlan


@dataclasses.dataclass(eq=False)
class ChunkPlan:
    hold: SessionHold
    chunk: int
    start: int
    count: int
    kinds: tuple  # per position: ChunkKind
    own_blocks: dict  # position -> STAGING block (ChunkKind.OWN)
    shared_ok: dict  # position -> None (awaited) | bool (published by its writer) (ChunkKind.SHARED)
    read_ok: dict | None = None  # position -> bool once our read ended ({} when there is none)
    on_shared: object = None  # fn(plan): an awaited position was resolved
    cancel_read: object = None  # fn() -> bool: withdraw our read if it has not started (the executor's)
    attached: bool = True

    def landed(self, ok) -> None:
        """Our read ended: ``ok`` per own block, in chain order."""
        self.read_ok = dict(zip(sorted(self.own_blocks), ok))

    @property
    def resolved(self) -> bool:
        """Every position's outcome is known (our read ended, every awaited block resolved)."""
        return self.read_ok is not None and all(v is not None for v in self.shared_ok.values())

    def outcome(self) -> tuple:
        """Per position of a resolved plan: whether its data is in the pool."""
        out = []
        for off, kind in enumerate(self.kinds):
            pos = self.start + off
            out.append(True if kind is RESIDENT else self.shared_ok[pos] if kind is SHARED else self.read_ok[pos])
        return tuple(out)
