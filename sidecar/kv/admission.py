"""Admission to the CPU pool: the one place that decides what may be staged now.

Every path that stages blocks — an engine ``store``, a whole-chain ``restore``, a prefetch
session's chunk — goes through :class:`PoolManager`, in the spirit of vLLM's
``v1/kv_offload`` (prepare → complete):

* :meth:`PoolManager.prepare_stage` ``(chain, start, limit, purpose)`` → a :class:`StagePlan`
  (STAGING blocks for the contiguous run of keys from ``start`` that nobody is staging yet, and
  a lease on the resident prefix ``[0, start)`` so the first staged block's parent cannot be
  evicted) or a :class:`Refusal` saying which resource ran out;
* :meth:`PoolManager.complete` ``(plan, per-block ok)`` publishes the leading blocks whose data
  landed, in chain order, and frees the rest (a failed block cuts the prefix there);
* :meth:`PoolManager.abandon` ``(plan)`` frees every block unpublished.

Exactly one of complete / abandon ends a plan, and never while a read may still write into its
blocks (the caller's contract: drain first).  Prefetch sessions stage non-contiguous positions
of a chunk and publish through their own machine; they use the same limits through
:meth:`headroom` and the same allocation through :meth:`allocate`.

The limits, computed only here (``*_limit`` bytes over ``block_bytes``):

* **reserved**: blocks STAGING, for any purpose, ≤ ``reserved_bytes_limit``;
* **pinned**: blocks pinned now plus staged blocks that will be pinned once published (a
  session's reads, ``pin_reserved``) ≤ ``pinned_bytes_limit`` (pin admission reserves room for
  what staging will become).
"""

from __future__ import annotations

import collections
import dataclasses

from kvsidecar.shm.errors import ErrorCode

from kvsidecar.shm.chain import count as id_count, key as chain_key, length as chain_len, span as chain_span
from kvsidecar.sidecar.kv.index import PrefixIndex, unpack_ids
from kvsidecar.sidecar.kv.leases import Lease, LeaseTable


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Nothing was staged.  ``resource``: "reserved" | "allocator" (every block pinned or staging)."""

    resource: str
    message: str
    code: ErrorCode = ErrorCode.LIMIT


@dataclasses.dataclass
class StagePlan:
    purpose: str  # "store" | "restore"
    chain: bytes  # keys of the staged blocks only
    start: int  # chain position of the first staged block
    blocks: bytes  # packed uint32 ids, STAGING
    parent: int  # resident block before the first staged one (-1: chain head)
    prefix_lease: Lease | None  # pins [0, start) until the plan ends
    ended: bool = False  # completed or abandoned (exactly once)

    @property
    def count(self) -> int:
        return id_count(self.blocks)


class PoolManager:
    def __init__(self, index: PrefixIndex, leases: LeaseTable, *, reserved_limit_bytes: int,
                 pinned_limit_bytes: int):
        self.index = index
        self.leases = leases
        self.reserved_limit_blocks = reserved_limit_bytes // index.block_bytes
        self.pinned_limit_blocks = pinned_limit_bytes // index.block_bytes
        self.refusals: collections.Counter = collections.Counter()  # by resource

    # -- limits --------------------------------------------------------------------------------
    def headroom(self, pin_reserved: int = 0) -> tuple[int, int]:
        """(blocks that may still be staged, blocks that may still become pinned)."""
        idx = self.index
        return (self.reserved_limit_blocks - idx.staged,
                self.pinned_limit_blocks - idx.pinned - pin_reserved)

    def pins_fit(self, new_pins: int, pin_reserved: int = 0) -> bool:
        """Whether ``new_pins`` more pinned blocks stay within the pinned limit (the GET path)."""
        return new_pins + pin_reserved + self.index.pinned <= self.pinned_limit_blocks

    def allocate(self, n: int) -> bytes:
        """Up to ``n`` FREE blocks into STAGING, evicting LRU unpinned leaves for the shortfall."""
        short = n - self.index.free
        if short > 0:
            self.index.evict(short)
        return self.index.alloc(n) if n > 0 else b""

    def refuse(self, resource: str, message: str) -> Refusal:
        self.refusals[resource] += 1
        return Refusal(resource, message)

    # -- contiguous spans (store, restore) -------------------------------------------------------
    def prepare_stage(self, chain: bytes, start: int, limit: int | None, purpose: str, *,
                      prefix_ttl_s: float, owner, now: float) -> StagePlan | Refusal:
        """Stage the run of ``chain`` from ``start`` (the resident prefix length) up to the first
        key someone else is staging, at most ``limit`` blocks.  An empty run is an empty plan."""
        idx = self.index
        total = chain_len(chain)
        end = total if limit is None else min(total, start + limit)
        stop = start
        while stop < end and chain_key(chain, stop) not in idx.staging:
            stop += 1  # blocks being staged by another writer are not written twice: stop there
        want = stop - start
        if want <= 0:
            return StagePlan(purpose, b"", start, b"", -1, None)
        want = min(want, max(self.headroom()[0], 0))
        if want <= 0:
            return self.refuse("reserved", "reserved_bytes_limit reached: no staging available")
        prefix_lease, parent = None, -1
        if start:
            prefix = idx.resident_ids(chain, start)
            parent = unpack_ids(prefix[-4:])[0]
            prefix_lease = self.leases.new(prefix, ttl_s=prefix_ttl_s, now=now, kind=f"{purpose}_prefix",
                                           owner=owner)
        blocks = self.allocate(want)
        if not blocks:
            if prefix_lease is not None:
                self.leases.drop(prefix_lease, f"{purpose}_refused")
            return self.refuse("allocator", "pool full: every block is pinned or staging")
        plan = StagePlan(purpose, chain_span(chain, start, start + id_count(blocks)), start, blocks, parent,
                         prefix_lease)
        for i, b in enumerate(unpack_ids(blocks)):
            idx.stage(chain_key(plan.chain, i), b)
        return plan

    def complete(self, plan: StagePlan, ok) -> int:
        """The plan's data landed where ``ok`` says: publish the leading landed blocks in chain
        order, free the rest; returns how many were published."""
        if plan.ended:
            raise ValueError("stage plan already ended")
        n = 0
        while n < len(ok) and ok[n]:
            n += 1
        idx = self.index
        parent = plan.parent
        for i, b in enumerate(unpack_ids(plan.blocks)):
            key = chain_key(plan.chain, i)
            if i < n:
                idx.publish(key, b, parent)
                parent = b
            else:
                idx.drop_staging(key, b)
        self._end(plan, "done")
        return n

    def abandon(self, plan: StagePlan, reason: str = "abandoned") -> None:
        """Free every block of the plan unpublished (its data never landed, or must not be used)."""
        if plan.ended:
            raise ValueError("stage plan already ended")
        idx = self.index
        for i, b in enumerate(unpack_ids(plan.blocks)):
            idx.drop_staging(chain_key(plan.chain, i), b)
        self._end(plan, reason)

    def _end(self, plan: StagePlan, reason: str) -> None:
        plan.ended = True
        if plan.prefix_lease is not None:
            self.leases.drop(plan.prefix_lease, f"{plan.purpose}_{reason}")
            plan.prefix_lease = None
