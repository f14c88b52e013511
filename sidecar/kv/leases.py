"""The lease table: who pins which resident blocks, until when.

A lease pins its blocks (refcount +1 each) from creation until it is dropped,
exactly once, by one of: release by its owner(s), its owner's death (for a group
lease: the last rank of the group leaving), TTL expiry
(the reaper releases, never forgets), or sidecar shutdown.

* **Plain lease**: owned by one client incarnation (slot + token).
* **Group lease**: a decision shared by every rank of a TP group (DESIGN §6); each
  rank holds one share and the lease drops when the last share is released.

Release is idempotent: re-releasing a dropped lease answers "not held" instead of an
error; a never-issued id is ``UNKNOWN_ID``; another client's lease is ``NOT_OWNER``.
Ids are issued in increasing order, so "issued and dropped" is any id below the next one
that is not live — no memory of dropped leases is kept (flat under unbounded churn).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

from kvsidecar.shm.chain import count as id_count
from kvsidecar.shm.errors import ErrorCode

from kvsidecar.sidecar.deadlines import DeadlineHeap
from kvsidecar.sidecar.kv.index import PrefixIndex, unpack_ids

LEASE_ID_BASE = 1 << 40  # ids are namespaced by kind: leases here, staging ids elsewhere


class LeaseError(Exception):
    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclasses.dataclass
class Lease:
    id: int
    blocks: bytes  # packed uint32 ids
    deadline: float
    kind: str
    owner: tuple | None = None  # (slot, token) for a plain lease
    group: str | None = None
    holders: set | None = None  # ranks still holding a share (group lease)
    created: float = 0.0

    @property
    def count(self) -> int:
        return id_count(self.blocks)


class LeaseTable:
    def __init__(self, index: PrefixIndex):
        self.index = index
        self.leases: dict[int, Lease] = {}
        self._ids = itertools.count(LEASE_ID_BASE)
        self._next_id = LEASE_ID_BASE
        self._deadlines = DeadlineHeap(self.leases, lambda lease: lease.deadline)
        self.counters = collections.Counter()
        self.drops = collections.Counter()  # reason -> leases dropped (the snapshot's causes)

    def new(self, blocks: bytes, *, ttl_s: float, now: float, kind: str, owner=None, group=None,
            holders=None) -> Lease:
        """Pin ``blocks`` and hold them under a new lease."""
        self.index.pin(blocks)
        return self.adopt(blocks, ttl_s=ttl_s, now=now, kind=kind, owner=owner, group=group, holders=holders)

    def adopt(self, blocks: bytes, *, ttl_s: float, now: float, kind: str, owner=None, group=None,
              holders=None) -> Lease:
        """A lease over blocks the caller has already pinned (the pins move to the lease)."""
        lid = next(self._ids)
        self._next_id = lid + 1
        lease = Lease(lid, blocks, now + ttl_s, kind, owner, group,
                      set(holders) if holders is not None else None, now)
        self.leases[lease.id] = lease
        self._deadlines.push(lease.deadline, lease.id)
        self.counters[f"leases_{kind}"] += 1
        return lease

    def drop(self, lease: Lease, reason: str) -> None:
        """Unpin and forget ``lease`` (exactly once)."""
        if self.leases.pop(lease.id, None) is None:
            return
        self.index.unpin(lease.blocks)
        self.counters[f"dropped_{reason}"] += 1
        self.drops[reason] += 1

    def release(self, lease_id: int, owner: tuple, group: str | None, rank: int) -> bool:
        """Release the caller's hold; True if it held one.  Raises LeaseError on misuse."""
        lease = self.leases.get(lease_id)
        if lease is None:
            if LEASE_ID_BASE <= lease_id < self._next_id:
                return False  # issued here and already dropped
            raise LeaseError(ErrorCode.UNKNOWN_ID, f"lease {lease_id} was never issued here")
        if lease.holders is None:
            if lease.owner != owner:
                raise LeaseError(ErrorCode.NOT_OWNER, f"lease {lease_id} belongs to another client")
            self.drop(lease, "released")
            return True
        if lease.group != group:
            raise LeaseError(ErrorCode.NOT_OWNER, f"lease {lease_id} belongs to another group")
        if rank not in lease.holders:
            return False
        lease.holders.discard(rank)
        if not lease.holders:
            self.drop(lease, "released")
        return True

    def join(self, lease_id: int, group: str, rank: int) -> bool:
        """Give ``rank`` a share of the live group lease ``lease_id`` (no-op if it holds one).

        The one way a replayed group answer becomes safe for a rank that holds no share (it
        was away when the lease was made, or died and came back): its blocks are still
        pinned by the others, so the ids are the right bytes, and from here until this rank
        releases they stay pinned on its behalf too.  False when the lease is gone (released,
        expired, its group gone) or is not this group's: the ids must not be handed out."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.holders is None or lease.group != group:
            return False
        if rank not in lease.holders:
            lease.holders.add(rank)
            self.counters["shares_joined"] += 1
        return True

    def client_gone(self, owner: tuple, group: str | None, rank: int | None) -> int:
        """Release everything a dead or detached client held — its plain leases, and its rank's
        shares of group leases unless ``rank`` is None (another client of that rank stays);
        returns leases touched."""
        touched = 0
        for lease in list(self.leases.values()):
            if lease.holders is None:
                if lease.owner == owner:
                    self.drop(lease, "client_gone")
                    touched += 1
            elif lease.group == group and rank in lease.holders:
                lease.holders.discard(rank)
                touched += 1
                if not lease.holders:
                    self.drop(lease, "client_gone")
        return touched

    def group_gone(self, group: str) -> int:
        """The last rank of ``group`` left: drop its group leases.  A share still held is one
        for a rank that never attached (nobody is left to release it); returns how many."""
        gone = [lease for lease in self.leases.values() if lease.holders is not None and lease.group == group]
        for lease in gone:
            self.drop(lease, "group_gone")
        return len(gone)

    def reap(self, now: float) -> int:
        """Drop leases past their deadline; returns how many."""
        due = self._deadlines.pop_due(now)
        for lease in due:
            self.drop(lease, "expired")
        return len(due)

    def next_deadline(self) -> float | None:
        return self._deadlines.next_due()

    def pins_per_block(self) -> collections.Counter:
        c = collections.Counter()
        for lease in self.leases.values():
            c.update(unpack_ids(lease.blocks))
        return c

    def staged_blocks(self) -> int:
        return 0  # leases pin resident blocks only

    def stats(self, now: float) -> dict:
        ages = [now - lease.created for lease in self.leases.values()]
        return {"live": len(self.leases), "oldest_age_s": round(max(ages), 3) if ages else 0.0,
                **dict(self.counters)}
