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

from .deadlines import DeadlineHeap
from .index import KEY, PrefixIndex, unpack_ids
from .leases import Lease, LeaseTable

STAGING_ID_BASE = 2 << 40


@dataclasses.dataclass
class Staging:
    id: int
    group: str
    chain: bytes  # keys of the staged blocks only
    start: int  # index in the caller's chain of the first staged block
    blocks: bytes  # packed uint32 ids
    parent: int  # resident block before the first staged one (-1: chain head)
    prefix_lease: Lease | None
    writers: set  # ranks that still have to commit
    deadline: float
    ns: str = ""
    l3: bool = False  # write to L3 after publication
    source: str = "engine"  # "engine" (ranks write it) or "l3" (an L3 read fills it)


class StagingTable:
    def __init__(self, index: PrefixIndex, leases: LeaseTable):
        self.index = index
        self.leases = leases
        self.records: dict[int, Staging] = {}
        self._ids = itertools.count(STAGING_ID_BASE)
        self._deadlines = DeadlineHeap(self.records, lambda st: st.deadline)
        self.published_blocks = 0
        self.aborted_blocks = 0

    def open(self, *, group: str, chain: bytes, start: int, blocks: bytes, parent: int,
             prefix_lease: Lease | None, writers: set, ttl_s: float | None, now: float, ns: str = "",
             l3: bool = False, source: str = "engine") -> Staging:
        """Open a record.  ``ttl_s=None``: no deadline — for L3 reads, whose blocks must never
        be recycled while the read may still be in flight (only its completion ends it)."""
        deadline = float("inf") if ttl_s is None else now + ttl_s
        st = Staging(next(self._ids), group, chain, start, blocks, parent, prefix_lease, set(writers),
                     deadline, ns, l3, source)
        for i, b in enumerate(unpack_ids(blocks)):
            self.index.stage(chain[i * KEY:(i + 1) * KEY], b)
        self.records[st.id] = st
        self._deadlines.push(st.deadline, st.id)  # no deadline (inf) for L3 reads
        return st

    def complete_load(self, st: Staging, ok: list) -> int:
        """An L3 read finished: publish the leading blocks whose data landed, free the rest.

        A failed block cuts the prefix there (later blocks would be a hole).  Returns how
        many blocks were published.
        """
        n = 0
        while n < len(ok) and ok[n]:
            n += 1
        del self.records[st.id]
        ids = unpack_ids(st.blocks)
        parent = st.parent
        for i, b in enumerate(ids):
            key = st.chain[i * KEY:(i + 1) * KEY]
            if i < n:
                self.index.publish(key, b, parent)
                parent = b
            else:
                self.index.drop_staging(key, b)
        self.published_blocks += n
        self.aborted_blocks += len(ids) - n
        if st.prefix_lease is not None:
            self.leases.drop(st.prefix_lease, "load_done")
        return n

    def commit(self, st: Staging, rank: int) -> bool:
        """Record ``rank``'s commit; True when this completed the record (now published)."""
        st.writers.discard(rank)
        if st.writers:
            return False
        self._publish(st)
        return True

    def _publish(self, st: Staging) -> None:
        del self.records[st.id]
        parent = st.parent
        for i, b in enumerate(unpack_ids(st.blocks)):
            key = st.chain[i * KEY:(i + 1) * KEY]
            self.index.publish(key, b, parent)
            parent = b
        self.published_blocks += len(st.blocks) // 4
        if st.prefix_lease is not None:
            self.leases.drop(st.prefix_lease, "store_done")

    def abort(self, st: Staging, reason: str) -> None:
        if self.records.pop(st.id, None) is None:
            return
        for i, b in enumerate(unpack_ids(st.blocks)):
            self.index.drop_staging(st.chain[i * KEY:(i + 1) * KEY], b)
        self.aborted_blocks += len(st.blocks) // 4
        if st.prefix_lease is not None:
            self.leases.drop(st.prefix_lease, f"store_{reason}")

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
        return sum(len(st.blocks) // 4 for st in self.records.values())
