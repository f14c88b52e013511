"""Carries out a session machine's actions: L3 jobs, calls into the pool manager, events back.

The block state a session holds (pins, staged chunks, orphaned reads, the result lease) is owned
by the pool manager (``kvsidecar.sidecar.kv.admission.PoolManager``); this module only turns the
pure machine's actions into calls on it, into L3 jobs on the read lane, and into events fed back
to the machine (through the continuations the session manager gives it at construction):

* **Query** → an L3 existence query; its answer is ``query_done(sid, hits)``.
* **Claim** → :meth:`PoolManager.claim` (a classified plan, or a ``Refusal``); a plan shorter
  than the claim is a ``ClaimShort`` event; our blocks are read on the L3 read lane, and once
  every position is resolved the chunk's outcome is posted as ``chunk_done(sid, chunk, ok)``
  (never re-entered from inside a claim).
* **Publish** / **Drop** → the manager publishes in chain order / frees from a position — only
  ever after the chunk's read completed.
* **Detach** → the probe's read goes on without the session (:meth:`PoolManager.leave_behind`:
  an orphan, published if it lands in chain order); the tier still measures it.  With
  ``withdraw`` (a chunk read with the query, wholly past L3's hit) the read is taken back from
  the sender queue if it has not started (:meth:`PoolManager.withdraw`), else left behind so.
* **Finish** → ``finished(rec, action)`` (the session manager keeps the result and ends it).
* After a stop trigger, reads not yet started leave the sender queue (:meth:`withdraw_queued`);
  when the drain budget runs out, reads still in flight are left behind (:meth:`abandon_in_flight`).
"""

from __future__ import annotations

import collections
import logging

from kvsidecar.shm.chain import key as chain_key, span as chain_span
from kvsidecar.sidecar.kv.admission import PoolManager, Refusal
from kvsidecar.sidecar.kv.chunks import ChunkPlan
from kvsidecar.sidecar.kv.index import pack_ids
from kvsidecar.sidecar.l3.interface import SessionTier, read_priority
from kvsidecar.sidecar.prefetch.events import (ChunkAbandoned, ChunkWithdrawn, Claim, ClaimShort, Detach,
                                               Drop, Finish, Publish, Query, State)
from kvsidecar.sidecar.prefetch.records import ChunkIO, Record
from kvsidecar.sidecar.service import Host

log = logging.getLogger(__name__)


class SessionExecutor:
    def __init__(self, pool: PoolManager, tier: SessionTier | None, host: Host, clock, counters: collections.Counter, *,
                 query_done, chunk_done, finished, session_of, read_ended=lambda: None):
        """``tier``: the L3 tier (its contract: ``kvsidecar.sidecar.l3.interface``), None without L3;
        ``query_done(sid, hits)``, ``chunk_done(sid, chunk, ok)``: events for a session (posted);
        ``finished(rec, Finish)``: the session ended; ``session_of(sid)``: its record or None;
        ``read_ended()``: an L3 read ended (posted: the tier has measured it by then)."""
        self.pool = pool
        self.tier = tier
        self.host = host
        self.clock = clock
        self.counters = counters
        self._query_done = query_done
        self._chunk_done = chunk_done
        self._finished = finished
        self._session_of = session_of
        self._read_ended = read_ended

    def carry_out(self, rec: Record, actions: list) -> None:
        """Carry out actions; executing one may produce more (e.g. a limit shrinks a claim)."""
        queue = collections.deque(actions)
        withdrawn = False
        while True:
            if not queue:
                m = rec.machine
                # A stop trigger (deadline, demand, abort, a failed block) withdraws reads not yet
                # started; a capacity stop (and a cost stop whose claims still pay) only stops new
                # claims: what was admitted is read.
                if withdrawn or not m.sealed or m.state == State.TERMINAL or m.keep_admitted:
                    break
                withdrawn = True
                queue.extend(self.withdraw_queued(rec))
                continue
            a = queue.popleft()
            if isinstance(a, Query):
                self._query(rec, a)
            elif isinstance(a, Claim):
                queue.extend(self._claim(rec, a))
            elif isinstance(a, Publish):
                self._publish(rec, a)
            elif isinstance(a, Drop):
                self._drop(rec, a)
            elif isinstance(a, Detach):
                self._detach(rec, a)
            elif isinstance(a, Finish):
                self._finished(rec, a)

    # -- actions ----------------------------------------------------------------------------------
    def _query(self, rec: Record, a: Query) -> None:
        if self.tier is None:
            self.host.post(self._query_done, rec.id, 0)
            return
        self.tier.lookup(rec.ns, chain_span(rec.chain, a.start), lambda hits: self._query_done(rec.id, hits))

    def _claim(self, rec: Record, a: Claim) -> list:
        plan = self.pool.claim(rec.hold, a.chunk, a.start, a.count, on_shared=self._shared_resolved)
        granted = 0 if isinstance(plan, Refusal) else plan.count
        extra = []
        if granted < a.count:
            self.counters["claims_limited"] += 1
            if rec.machine.chunk_pending(a.chunk):  # (a probe detached in the same decision: no longer)
                extra = rec.machine.handle(ClaimShort(a.chunk, granted, self.clock()))
            if granted == 0:
                return extra
        io = ChunkIO(plan)
        rec.chunks[a.chunk] = io
        if plan.shared_ok:  # awaited, not read twice
            self.counters["blocks_deduplicated"] += len(plan.shared_ok)
        io.t0 = self.clock()
        rec.events.append(("claim", io.t0, [a.chunk, a.start, granted, len(plan.own_blocks)]))
        if plan.own_blocks:
            keys = b"".join(chain_key(rec.chain, p) for p in plan.own_blocks)
            io.job = self.tier.load(rec.ns, keys, pack_ids(list(plan.own_blocks.values())),
                                    lambda result, sid=rec.id, ch=a.chunk: self._read_done(sid, ch, result),
                                    priority=read_priority(rec.demanded, rec.id))
            plan.cancel_read = io.job.cancel  # a store of these keys may supersede it (PoolManager)
        else:
            self._maybe_chunk_done(rec, a.chunk)
        return extra

    def _read_done(self, sid: int, chunk: int, result) -> None:
        """A chunk's L3 read ended (``result``: per-block success and its own timing)."""
        ok = result.ok
        self.host.post(self._read_ended)
        orphan = self.pool.resolve_orphan((sid, chunk), ok)
        if orphan is not None:
            for outcome, n in zip(("published", "dropped"), orphan):
                if n:
                    self.counters[f"orphan_blocks_{outcome}"] += n
            return
        freed = self.pool.end_superseded_read((sid, chunk))
        if freed is not None:  # a store took its keys over in flight: its plan awaits the store
            self.counters["superseded_blocks_freed"] += freed
            return
        rec = self._session_of(sid)
        io = rec.chunks.get(chunk) if rec else None
        if io is None:
            return
        io.plan.landed(ok)
        rec.transfer_times.append(result.seconds * 1e3)
        rec.events.append(("read", self.clock(), [chunk, len(ok), result.seconds]))
        if ok:
            rec.read_s_per_block.append(result.seconds / len(ok))
        self._maybe_chunk_done(rec, chunk)

    def _shared_resolved(self, plan: ChunkPlan) -> None:
        """A block this chunk awaited was published or dropped by its writer."""
        rec = self._session_of(plan.hold.id)
        if rec is not None and plan.chunk in rec.chunks:
            self._maybe_chunk_done(rec, plan.chunk)

    def _maybe_chunk_done(self, rec: Record, chunk: int) -> None:
        io = rec.chunks[chunk]
        if not io.plan.resolved:
            return
        rec.chunk_times.append((self.clock() - io.t0) * 1e3)
        rec.events.append(("landed", self.clock(), [chunk, io.count]))
        # deliver as an event so it is never re-entered from inside a claim
        self.host.post(self._chunk_done, rec.id, chunk, io.plan.outcome())

    def _publish(self, rec: Record, a: Publish) -> None:
        io = rec.chunks[a.chunk]
        rec.restored += self.pool.publish(io.plan, a.count)
        if a.count == io.count:
            del rec.chunks[a.chunk]

    def _drop(self, rec: Record, a: Drop) -> None:
        io = rec.chunks.pop(a.chunk, None)
        if io is not None:
            self.pool.drop(io.plan, a.offset, rec.machine.published)

    def _detach(self, rec: Record, a: Detach) -> None:
        io = rec.chunks.pop(a.chunk, None)
        if io is None:  # (a limit refused the whole claim)
            return
        rec.events.append(("detach", self.clock(), [a.chunk, io.count]))
        if not a.withdraw:  # a probe: its read goes on, for the estimate
            self.pool.leave_behind(io.plan, rec.machine.published)
            self.counters["probes_detached"] += 1
            return
        # read with the query, wholly past L3's hit: taken back unless its read started (or
        # other sessions await its blocks: then it goes on for them)
        plan = io.plan
        if io.reading and io.job is not None and not self.pool.awaited(plan) and io.job.cancel():
            self.counters["reads_with_query_withdrawn"] += 1
            self.pool.withdraw(plan, rec.machine.published)
        elif not io.reading and not plan.resolved and not (plan.own_blocks and self.pool.awaited(plan)):
            self.counters["reads_with_query_withdrawn"] += 1  # (it only awaited other writers' blocks)
            self.pool.withdraw(plan, rec.machine.published)
        else:
            self.counters["reads_with_query_left"] += 1
            self.pool.leave_behind(plan, rec.machine.published)

    # -- after a stop -----------------------------------------------------------------------------
    def withdraw_queued(self, rec: Record) -> list:
        """After a stop, chunks whose read has not started leave the sender queue, and chunks
        that wait only on other writers' blocks are let go.

        Cancellation is atomic with the read lane picking the job up, so these blocks
        were never touched by L3 and go straight back to FREE; only reads already in
        flight are drained.  This keeps stop latency within one chunk's transfer: a stopped
        session never waits on a read another session owns (queued behind the lane at that
        session's priority, it could take any time).  A chunk other sessions wait on is not
        cancelled: its read is handed over to them (shared blocks survive a stop; only a real
        L3 failure fails a waiter).
        """
        out = []
        for chunk, io in list(rec.chunks.items()):
            plan = io.plan
            if io.reading:
                if io.job is None:
                    continue
                if self.pool.awaited(plan):
                    # Other sessions wait on these blocks: the read goes on for them (the manager
                    # keeps it as an orphan); this session just stops counting on the chunk.
                    self.pool.hand_over(plan, rec.machine.published)
                    del rec.chunks[chunk]
                    self.counters["reads_handed_over"] += 1
                    out += rec.machine.handle(ChunkWithdrawn(chunk, self.clock()))
                    continue
                if not io.job.cancel():
                    continue  # in flight: drained
            elif plan.resolved or not rec.machine.chunk_pending(chunk) or (plan.own_blocks and self.pool.awaited(plan)):
                continue  # nothing of it is queued; or what it read, others await
            # (left: our read never started, or only another writer's blocks are awaited -- a
            # read this session did not start and cannot hurry: a stop does not wait on it)
            n = self.pool.withdraw(plan, rec.machine.published)
            rec.withdrawn += n
            self.counters["blocks_withdrawn"] += n
            del rec.chunks[chunk]
            self.counters["chunks_withdrawn"] += 1
            out += rec.machine.handle(ChunkWithdrawn(chunk, self.clock()))
        return out

    def abandon_in_flight(self, rec: Record, expected: bool = False) -> list:
        """The drain budget ran out (``expected``: the engine's own bound on a demand, no fault):
        stop waiting on reads still in flight (they become orphans).  Returns the machine's
        actions; the caller runs them and wakes the session's waiters."""
        now = self.clock()
        actions, left = [], 0
        for chunk, io in list(rec.chunks.items()):
            if not rec.machine.chunk_pending(chunk):
                continue  # its data landed (it waits for a predecessor) or it is being dropped
            del rec.chunks[chunk]
            self.pool.leave_behind(io.plan, rec.machine.published)
            rec.abandoned += 1
            left += 1
            self.counters["chunks_abandoned"] += 1
            actions += rec.machine.handle(ChunkAbandoned(chunk, now))
        if left and expected:
            self.counters["chunks_left_at_demand"] += left
            log.debug("session %d: the engine admits the request now, %d chunk(s) in flight left behind",
                      rec.id, left)
        elif left:
            log.warning("session %d: drain budget ran out, %d chunk(s) still in flight left behind",
                        rec.id, rec.abandoned)
        return actions


__all__ = ["SessionExecutor"]
