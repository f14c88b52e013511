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
blocks (the caller's contract: drain first).

Prefetch sessions stage non-contiguous positions of a chunk and publish in the order their
machine decides; the manager owns that block state too (``kvsidecar.sidecar.kv.chunks``), and the
executor only turns the machine's actions into these calls, L3 jobs and replies:

* :meth:`open_hold` pins the resident prefix a session starts from;
* :meth:`claim` classifies a chunk's positions (:class:`ChunkKind`) and stages its own blocks
  within the limits → a :class:`ChunkPlan` (possibly shorter than asked) or a :class:`Refusal`;
  awaited positions resolve when their writer publishes or drops them (in-flight de-dup);
* :meth:`publish` / :meth:`drop` (from a position) once the read ended; :meth:`withdraw` a read
  that never started; :meth:`hand_over` a queued read other sessions await, or
  :meth:`leave_behind` one still in flight (both become orphans: their blocks stay STAGING until
  :meth:`resolve_orphan` publishes what landed or frees it);
* :meth:`finish` moves the result prefix into a prefetch lease, which the request's GET
  :meth:`hand_off` drops once it took its own reference.

Every publish or drop of a staged key goes through here, so the manager wakes the sessions that
await it without being told by the index.

**A store supersedes a session's read.**  An engine store of keys a session stages for an L3
read (the engine computed them meanwhile: the read is slower than the prefill, or queued behind
others) stages the keys itself; the session's positions become awaited ones (SHARED) on the
store's blocks, so the session and its waiters resolve when the store publishes or drops them.
A read still queued in the lane is withdrawn (``ChunkPlan.cancel_read``, atomic with the lane
starting it).  A read in flight writes on into its blocks: they stay STAGING without a key
(``unkeyed``: invisible to lookups and claims, counted against the reserved limit) and are freed,
never published, when it ends (:meth:`end_superseded_read`).  Without it a store stops at the
first such key: the engine's freshly computed prefix is stored nowhere, and a request behind it
waits for the slower read of what the engine just computed (or recomputes it).  A store takes
over a read only when it stages every key of it (it covers them, and the reserved limit and the
allocator leave room for the whole run).

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
from kvsidecar.sidecar.kv.chunks import OWN, RESIDENT, SHARED, ChunkKind, ChunkPlan, SessionHold  # noqa: F401
from kvsidecar.sidecar.kv.index import PrefixIndex, pack_ids, unpack_ids
from kvsidecar.sidecar.kv.leases import Lease, LeaseTable


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Nothing was staged.  ``resource``: "reserved" | "pinned" | "allocator" (every block pinned
    or staging)."""

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
        # prefetch sessions' block state (see the module docstring)
        self.holds: dict[int, SessionHold] = {}  # session id -> its pins and attached plans
        self.waiters: dict[bytes, list] = collections.defaultdict(list)  # staged key -> [(plan, pos)]
        self.orphans: dict[tuple, ChunkPlan] = {}  # (session, chunk) -> a read nobody waits for
        self.results: dict[tuple, Lease] = {}  # request -> its session's result (prefetch) lease
        self.handoffs = 0  # results dropped by their request's GET
        self.staged_by: dict[bytes, ChunkPlan] = {}  # key -> the session plan (or orphan) staging it
        self.superseded_blocks = 0  # blocks of session reads a store took over (it staged their keys)
        self.superseded_in_flight = 0  # ... of them, blocks of reads in flight (keyless until they end)
        # (session, chunk) -> blocks a superseded read in flight still writes into: STAGING, keyless,
        # freed when that read ends (end_superseded_read)
        self.unkeyed: dict[tuple, list] = {}
        self._unkeyed = 0
        # blocks in sessions' plans and orphans (pinned once published): changed only where such a
        # block enters STAGING (claim) or leaves it (_own_published, _own_freed); check() recounts
        self._session_staged = 0

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
        superseded: list[bytes] = []
        while stop < end:
            key = chain_key(chain, stop)
            if key in idx.staging and not (purpose == "store" and self._supersede(key, chain, start, end, superseded)):
                break  # blocks being staged by another writer are not written twice: stop there
            stop += 1
        want = stop - start
        if want > 0:
            want = min(want, max(self.headroom()[0], 0))
        if superseded:
            self.superseded_blocks += len(superseded)
        try:
            if want <= 0:
                if stop == start:
                    return StagePlan(purpose, b"", start, b"", -1, None)
                return self.refuse("reserved", "reserved_bytes_limit reached: no staging available")
            return self._stage_run(chain, start, want, purpose, prefix_ttl_s, owner, now)
        finally:
            for key in superseded:  # a superseded key this store did not stage: its waiters fail
                if key not in idx.staging and key in self.waiters:
                    self._resolved(key, False)

    def _stage_run(self, chain: bytes, start: int, want: int, purpose: str, prefix_ttl_s: float, owner,
                   now: float) -> StagePlan | Refusal:
        idx = self.index
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

    def _supersede(self, key: bytes, chain: bytes, start: int, end: int, superseded: list) -> bool:
        """A store of ``chain`` from ``start`` reaching ``key``, staged by a session's (or an
        orphan's) read: take that read over when the store stages every key it stages — they lie
        in ``chain``'s run to ``end`` and, for a read in flight (whose blocks stay STAGING), the
        reserved limit and the allocator leave room for the run up to its last key.  Its
        positions then await the store's blocks.  True when ``key`` is free for the store; the
        read's keys are appended to ``superseded``."""
        plan = self.staged_by.get(key)
        if plan is None or plan.read_ok is not None or plan.cancel_read is None:
            return False  # a store's or a restore's staging, or a read that already ended
        hold = plan.hold
        keys = {pos: chain_key(hold.chain, pos) for pos in plan.own_blocks}
        if not all(pos < end and chain_key(chain, pos) == k for pos, k in keys.items()):
            return False  # the store would not stage all of them: the read goes on
        idx = self.index
        if not plan.cancel_read():  # it started: its data is on the way into blocks we keep
            run = max(keys) + 1 - start
            if run > self.headroom()[0] or run > idx.free + idx.evictable:
                return False  # the store could not stage them all: the read goes on
            blocks = list(plan.own_blocks.values())
            for k in keys.values():
                del idx.staging[k]  # keyless: the read writes on, nobody finds the block
            self.unkeyed[(hold.id, plan.chunk)] = blocks
            self._unkeyed += len(blocks)
            self.superseded_in_flight += len(blocks)
        else:
            for pos, b in plan.own_blocks.items():
                idx.drop_staging(keys[pos], b)  # FREE again; the key's waiters stay for the store
        for k in keys.values():
            del self.staged_by[k]
            superseded.append(k)
        self._session_staged -= len(keys)
        orphan = self.orphans.pop((hold.id, plan.chunk), None)
        if orphan is None and plan.attached:
            kinds = list(plan.kinds)
            for pos in plan.own_blocks:
                kinds[pos - plan.start] = SHARED
                plan.shared_ok[pos] = None
                self.waiters[keys[pos]].append((plan, pos))
            plan.kinds = tuple(kinds)
        plan.own_blocks.clear()
        plan.read_ok = {}  # no read of ours any more
        return True

    def end_superseded_read(self, key: tuple) -> int | None:
        """The read of ``key`` ((session, chunk)) ended after a store took it over: its keyless
        blocks go back to FREE (never published).  Returns how many, or None when ``key`` names
        no such read."""
        blocks = self.unkeyed.pop(key, None)
        if blocks is None:
            return None
        for b in blocks:
            self.index.release_staging(b)
        self._unkeyed -= len(blocks)
        return len(blocks)

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
                self._publish_key(key, b, parent)
                parent = b
            else:
                self._unstage_key(key, b)
        self._end(plan, "done")
        return n

    def abandon(self, plan: StagePlan, reason: str = "abandoned") -> None:
        """Free every block of the plan unpublished (its data never landed, or must not be used)."""
        if plan.ended:
            raise ValueError("stage plan already ended")
        for i, b in enumerate(unpack_ids(plan.blocks)):
            self._unstage_key(chain_key(plan.chain, i), b)
        self._end(plan, reason)

    def _end(self, plan: StagePlan, reason: str) -> None:
        plan.ended = True
        if plan.prefix_lease is not None:
            self.leases.drop(plan.prefix_lease, f"{plan.purpose}_{reason}")
            plan.prefix_lease = None

    # -- staged keys: every publish / drop goes through here (it wakes the key's waiters) -------
    def _publish_key(self, key: bytes, block: int, parent: int) -> None:
        if self.index.publish(key, block, parent) and key in self.waiters:
            self._resolved(key, True)

    def _unstage_key(self, key: bytes, block: int) -> None:
        if self.index.drop_staging(key, block) and key in self.waiters:
            self._resolved(key, False)

    def _resolved(self, key: bytes, published: bool) -> None:
        """A staged key was published or dropped (by whichever writer): resolve its waiters.
        A published block is pinned for each waiter at once: it must still be there when the
        waiter publishes past it."""
        for plan, pos in self.waiters.pop(key, ()):
            if not plan.attached:
                continue  # its session stopped counting on the chunk meanwhile
            if published:
                b = self.index.find(key)
                self.index.pin(pack_ids([b]))
                plan.hold.pins[pos] = b
            plan.shared_ok[pos] = published
            plan.on_shared(plan)

    # -- prefetch sessions ------------------------------------------------------------------------
    def open_hold(self, sid: int, chain: bytes, resident: int) -> SessionHold:
        """A session over ``chain`` starts: pin its resident prefix ``[0, resident)`` (it must not
        shrink while the session runs)."""
        hold = SessionHold(sid, chain)
        if resident:
            ids = self.index.resident_ids(chain, resident)
            self.index.pin(ids)
            hold.pins.update(enumerate(unpack_ids(ids)))
        self.holds[sid] = hold
        return hold

    def reads_ahead(self, chain: bytes, start: int) -> tuple[int, set]:
        """``(n, sessions)``: positions ``[start, start + n)`` of ``chain`` are staged by sessions'
        L3 reads (attached plans or orphans) that have not failed them — a claim of them would
        await those reads (SHARED), not read them again — and the ids of the sessions that
        claimed them.  Stops at the first position that is not so: resident, free, a store's or a
        restore's staging, or a block whose read ended without it."""
        n, sessions = 0, set()
        for pos in range(start, id_count(chain)):
            plan = self.staged_by.get(chain_key(chain, pos))
            # (a key names its position too — it chains its parent's — so the writer stages it there)
            if plan is None or pos not in plan.own_blocks or (plan.read_ok is not None and not plan.read_ok.get(pos)):
                break
            sessions.add(plan.hold.id)
            n += 1
        return n, sessions

    def claim(self, hold: SessionHold, chunk: int, start: int, count: int, on_shared) -> ChunkPlan | Refusal:
        """Claim positions ``[start, start + count)`` of the session's chain: resident ones are
        pinned, ones another writer stages are awaited (``on_shared(plan)`` when one resolves),
        the rest are staged for our read.  Staging stays within ``reserved_bytes_limit``, and
        pinned + sessions' staging within ``pinned_bytes_limit``; at the first position over a
        limit (or when the allocator cannot make room) the plan stops short.  A plan of no
        position is a :class:`Refusal` (the last limit hit)."""
        idx = self.index
        # sessions' staged blocks become pins once published: pin admission counts them already
        reserved_room, pinned_room = self.headroom(pin_reserved=self._session_staged)
        kinds, own_positions = [], []
        refusal = None
        for pos in range(start, start + count):
            key = chain_key(hold.chain, pos)
            b = idx.find(key)
            if b >= 0:
                kind, need = RESIDENT, 1 if idx.refcount(b) == 0 else 0
            elif key in idx.staging:
                kind, need = SHARED, 0
            else:
                kind, need = OWN, 1
            if kind is OWN and len(own_positions) + 1 > reserved_room:
                refusal = self.refuse("reserved", "session claim over reserved_bytes_limit")
                break
            if len(own_positions) + need > pinned_room:
                refusal = self.refuse("pinned", "session claim over pinned_bytes_limit")
                break
            if kind is OWN:
                own_positions.append(pos)
            kinds.append(kind)
        blocks = list(unpack_ids(self.allocate(len(own_positions)))) if own_positions else []
        if len(blocks) < len(own_positions):  # cannot make room: everything else is pinned or staging
            refusal = self.refuse("allocator", "session claim: pool full")
            kinds = kinds[:min(len(kinds), own_positions[len(blocks)] - start)]
            own_positions = own_positions[:len(blocks)]
        if not kinds:
            return refusal
        plan = ChunkPlan(hold, chunk, start, len(kinds), tuple(kinds), {}, {}, on_shared=on_shared)
        for pos, b in zip(own_positions, blocks):
            plan.own_blocks[pos] = b
            key = chain_key(hold.chain, pos)
            idx.stage(key, b)
            self.staged_by[key] = plan
        self._session_staged += len(blocks)
        for off, kind in enumerate(kinds):
            pos = start + off
            if kind is RESIDENT:
                b = idx.find(chain_key(hold.chain, pos))
                idx.pin(pack_ids([b]))
                hold.pins[pos] = b
            elif kind is SHARED:
                plan.shared_ok[pos] = None
                self.waiters[chain_key(hold.chain, pos)].append((plan, pos))
        if not own_positions:
            plan.read_ok = {}
        hold.plans[chunk] = plan
        return plan

    def awaited(self, plan: ChunkPlan) -> bool:
        """Whether other sessions wait on blocks this plan stages."""
        chain = plan.hold.chain
        return any(chain_key(chain, pos) in self.waiters for pos in plan.own_blocks)

    def publish(self, plan: ChunkPlan, count: int) -> int:
        """The plan's first ``count`` positions landed and their predecessors are published: our
        blocks among them become resident (each parent is pinned by the session) and stay
        pinned.  Returns how many of ours were published."""
        hold = plan.hold
        n = 0
        for pos in range(plan.start, plan.start + count):
            b = plan.own_blocks.pop(pos, None)
            if b is not None:
                self._own_published(chain_key(hold.chain, pos), b, hold.pins[pos - 1] if pos else -1)
                self.index.pin(pack_ids([b]))
                hold.pins[pos] = b
                n += 1
        if count == plan.count:
            self._detach(plan)
        return n

    def drop(self, plan: ChunkPlan, offset: int, published: int) -> None:
        """Release the plan from ``offset`` on (its read ended: failed, or beyond a cut): our
        blocks go back to FREE, pins beyond the session's published prefix are dropped."""
        self._detach(plan)
        hold = plan.hold
        for pos in range(plan.start + offset, plan.start + plan.count):
            b = plan.own_blocks.pop(pos, None)
            if b is not None:
                self._own_freed(chain_key(hold.chain, pos), b)
            elif pos in hold.pins and pos >= published:
                self.index.unpin(pack_ids([hold.pins.pop(pos)]))

    def withdraw(self, plan: ChunkPlan, published: int) -> int:
        """A read that never started (cancelled in the sender queue), or a plan that only awaits
        other writers' blocks: free our blocks, drop the plan's pins, stop awaiting.  Returns
        how many of our blocks were withdrawn."""
        n = len(plan.own_blocks)
        self._free_own(plan)
        self._unpin_resident(plan, published)
        self._detach(plan)
        return n

    def hand_over(self, plan: ChunkPlan, published: int) -> None:
        """A queued read other sessions await goes on for them: the session lets go of the plan's
        pins, and the read's blocks become an orphan (published when its data lands, which
        resolves the waiters)."""
        self._unpin_resident(plan, published)
        self._detach(plan)
        self.orphans[(plan.hold.id, plan.chunk)] = plan

    def leave_behind(self, plan: ChunkPlan, published: int) -> bool:
        """The session stops waiting for a plan still in flight (the drain budget ran out).  Its
        resident pins go; a read still in flight keeps its blocks as an orphan (True); if only an
        awaited block is late, our blocks are freed now (False)."""
        self._unpin_resident(plan, published)
        self._detach(plan)
        if plan.read_ok is None and plan.own_blocks:
            self.orphans[(plan.hold.id, plan.chunk)] = plan
            return True
        self._free_own(plan)
        return False

    def resolve_orphan(self, key: tuple, ok) -> tuple | None:
        """The read of orphan ``key`` ((session, chunk)) ended: publish what landed in chain order
        (while each parent is still resident), free the rest.  Returns (published, dropped), or
        None when ``key`` is no orphan."""
        plan = self.orphans.pop(key, None)
        if plan is None:
            return None
        idx, chain = self.index, plan.hold.chain
        published = dropped = 0
        for pos, good in zip(sorted(plan.own_blocks), ok):
            b = plan.own_blocks[pos]
            parent = idx.find(chain_key(chain, pos - 1)) if pos else -1
            if good and (pos == 0 or parent >= 0):
                self._own_published(chain_key(chain, pos), b, parent)
                published += 1
            else:
                self._own_freed(chain_key(chain, pos), b)
                dropped += 1
        plan.own_blocks.clear()
        return published, dropped

    def finish(self, hold: SessionHold, prefix: int, request, *, retain: bool, ttl_s: float,
               now: float) -> Lease | None:
        """The session ended with the prefix ``[0, prefix)``: with ``retain``, its pins move into a
        prefetch lease kept for ``request``'s GET (:meth:`hand_off`); every other pin is dropped."""
        del self.holds[hold.id]
        prefix_ids = [hold.pins.pop(p) for p in range(prefix)]
        rest = list(hold.pins.values())
        hold.pins.clear()
        if rest:
            self.index.unpin(pack_ids(rest))
        if prefix_ids and retain:
            lease = self.leases.adopt(pack_ids(prefix_ids), ttl_s=ttl_s, now=now, kind="prefetch",
                                      owner=("session", hold.id))
            self.results[request] = lease
            return lease
        if prefix_ids:
            self.index.unpin(pack_ids(prefix_ids))
        return None

    def result_of(self, request, sid: int) -> Lease | None:
        """Session ``sid``'s result lease, while it is kept for ``request``."""
        lease = self.results.get(request)
        return lease if lease is not None and lease.owner == ("session", sid) else None

    def hand_off(self, request) -> bool:
        """``request``'s GET took its own reference: its prefetch result is no longer needed."""
        lease = self.results.pop(request, None)
        if lease is None:
            return False
        self.leases.drop(lease, "handed_off")
        self.handoffs += 1
        return True

    def drop_result(self, request, sid: int, reason: str) -> None:
        """Session ``sid``'s result is not needed (the request left, its group is gone)."""
        if self.result_of(request, sid) is not None:
            self.leases.drop(self.results.pop(request), reason)

    def forget_result(self, request, sid: int) -> None:
        """Session ``sid`` is forgotten: its request no longer finds a result (the lease itself
        ends by its TTL)."""
        if self.result_of(request, sid) is not None:
            del self.results[request]

    def _own_published(self, key: bytes, block: int, parent: int) -> None:
        """A session's staged block (its data landed) becomes resident."""
        self._session_staged -= 1
        self.staged_by.pop(key, None)
        self._publish_key(key, block, parent)

    def _own_freed(self, key: bytes, block: int) -> None:
        """A session's staged block goes back to FREE unpublished."""
        self._session_staged -= 1
        self.staged_by.pop(key, None)
        self._unstage_key(key, block)

    def _detach(self, plan: ChunkPlan) -> None:
        """The session stops counting on the plan: it leaves the waiters of every block it still
        awaits (a key nobody else waits on then wakes no one when its writer resolves it)."""
        plan.attached = False
        plan.hold.plans.pop(plan.chunk, None)
        chain = plan.hold.chain
        for pos, ok in plan.shared_ok.items():
            if ok is None:
                key = chain_key(chain, pos)
                waiting = self.waiters.get(key)
                if waiting is not None:
                    waiting[:] = [w for w in waiting if w[0] is not plan]
                    if not waiting:
                        del self.waiters[key]

    def _free_own(self, plan: ChunkPlan) -> None:
        chain = plan.hold.chain
        for pos, b in plan.own_blocks.items():
            self._own_freed(chain_key(chain, pos), b)
        plan.own_blocks.clear()

    def _unpin_resident(self, plan: ChunkPlan, published: int) -> None:
        """Drop the pins the session took for the plan's resident positions (beyond its
        published prefix: those it vouches for stay)."""
        hold = plan.hold
        for off, kind in enumerate(plan.kinds):
            pos = plan.start + off
            if kind is RESIDENT and pos in hold.pins and pos >= published:
                self.index.unpin(pack_ids([hold.pins.pop(pos)]))

    # -- the books (KVCore.check) ------------------------------------------------------------------
    def pins_per_block(self) -> collections.Counter:
        """Pins held by running sessions (a finished session's result is a lease)."""
        return collections.Counter(b for hold in self.holds.values() for b in hold.pins.values())

    def staged_blocks(self) -> int:
        return self._session_staged + self._unkeyed

    def unkeyed_blocks(self) -> int:
        """STAGING blocks without a key: superseded reads still in flight."""
        return self._unkeyed

    def check(self) -> str:
        counted = sum(len(p.own_blocks) for hold in self.holds.values() for p in hold.plans.values())
        counted += sum(len(p.own_blocks) for p in self.orphans.values())
        if counted != self._session_staged:
            return f"sessions' plans stage {counted} blocks, the manager counts {self._session_staged}"
        if len(self.staged_by) != counted:
            return f"sessions' plans stage {counted} blocks, {len(self.staged_by)} keys are mapped to them"
        unkeyed = sum(len(v) for v in self.unkeyed.values())
        if unkeyed != self._unkeyed:
            return f"superseded reads write into {unkeyed} blocks, the manager counts {self._unkeyed}"
        return ""
