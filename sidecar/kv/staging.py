"""Staging for engine stores: blocks being written by the ranks of a group.

A staging record owns STAGING blocks for keys ``chain[start:start+n]`` plus a lease
on the resident prefix ``[0, start)`` (so the parent of the first staged block cannot
be evicted before publication — no holes).  Each writer rank commits once; when every
writer has committed the blocks are published in chain order and the prefix lease is
dropped.  A failed commit, a writer's death, the last rank of the group leaving or the
TTL aborts: the blocks go back to FREE unpublished.  Exactly one of publish / abort happens.
"""

from __future__ import annotations

import dataclasses
import itertools

from kvsidecar.sidecar.kv.admission import PoolManager, StagePlan
from kvsidecar.sidecar.deadlines import DeadlineHeap

STAGING_ID_BASE = 2 << 40


@dataclasses.dataclass
class Staging:
    id: int
    group: str
    plan: StagePlan  # the staged blocks and the prefix lease (kvsidecar.sidecar.kv.admission)
    writers: set  # ranks that still have to commit
    deadline: float
    ns: str = ""
    l3: bool = False  # write to L3 after publication
    source: str = "engine"  # "engine" (ranks write it) or "l3" (an L3 read fills it)

    @property
    def chain(self) -> bytes:  # keys of the staged blocks only
        return self.plan.chain

    @property
    def blocks(self) -> bytes:  # packed uint32 ids
        return self.plan.blocks

    @property
    def start(self) -> int:  # chain position of the first staged block
        return self.plan.start

    @property
    def count(self) -> int:
        return self.plan.count


class StagingTable:
    def __init__(self, pool: PoolManager):
        self.pool = pool
        self.records: dict[int, Staging] = {}
        self._ids = itertools.count(STAGING_ID_BASE)
        self._deadlines = DeadlineHeap(self.records, lambda st: st.deadline)
        self.published_blocks = 0
        self.aborted_blocks = 0

    def open(self, plan: StagePlan, *, group: str, writers: set, ttl_s: float | None, now: float, ns: str = "",
             l3: bool = False, source: str = "engine") -> Staging:
        """A record over a prepared plan.  ``ttl_s=None``: no deadline — for L3 reads, whose blocks
        must never be recycled while the read may still be in flight (only its completion ends it)."""
        deadline = float("inf") if ttl_s is None else now + ttl_s
        st = Staging(next(self._ids), group, plan, set(writers), deadline, ns, l3, source)
        self.records[st.id] = st
        self._deadlines.push(st.deadline, st.id)  # no deadline (inf) for L3 reads
        return st

    def complete_load(self, st: Staging, ok: list) -> int:
        """An L3 read finished: publish the leading blocks whose data landed, free the rest.

        A failed block cuts the prefix there (later blocks would be a hole).  Returns how
        many blocks were published.
        """
        del self.records[st.id]
        n = self.pool.complete(st.plan, ok)
        self.published_blocks += n
        self.aborted_blocks += st.count - n
        return n

    def commit(self, st: Staging, rank: int) -> bool:
        """Record ``rank``'s commit; True when this completed the record (now published)."""
        st.writers.discard(rank)
        if st.writers:
            return False
        del self.records[st.id]
        self.pool.complete(st.plan, [True] * st.count)
        self.published_blocks += st.count
        return True

    def abort(self, st: Staging, reason: str) -> None:
        if self.records.pop(st.id, None) is None:
            return
        self.pool.abandon(st.plan, reason)
        self.aborted_blocks += st.count

    def client_gone(self, group: str | None, rank: int) -> int:
        n = 0
        for st in list(self.records.values()):
            if st.source == "engine" and st.group == group and rank in st.writers:
                self.abort(st, "writer_gone")
                n += 1
        return n

    def group_gone(self, group: str) -> int:
        """The last rank of ``group`` left: abort its engine stagings still waiting for a
        writer (one that never attached would keep them staged until their TTL)."""
        gone = [st for st in self.records.values() if st.source == "engine" and st.group == group]
        for st in gone:
            self.abort(st, "group_gone")
        return len(gone)

    def reap(self, now: float) -> int:
        due = self._deadlines.pop_due(now)
        for st in due:
            self.abort(st, "expired")
        return len(due)

    def next_deadline(self) -> float | None:
        return self._deadlines.next_due()

    def pins_per_block(self) -> dict:
        return {}  # its prefix pins are leases, counted by the lease table

    def staged_blocks(self) -> int:
        return sum(st.count for st in self.records.values())
