"""Prefetch sessions on the control thread: carries out the pure machine's actions.

One session per (group, request, attempt); any rank may send ``prefetch``, ``demand``,
``abort`` or ``poll``.  The executor owns the I/O side of each session:

* **Claim**: classify the chunk's positions — already resident (pinned now), being
  staged by someone else (awaited: in-flight de-duplication, one publication serves
  all), or ours to read.  Admission reserves staging within ``reserved_bytes_limit``
  and keeps pinned + outstanding staging within ``pinned_bytes_limit``; a shortfall
  shrinks the claim and the session stops claiming.  Our blocks are read on the L3
  read lane.
* **Publish**: our blocks become resident in chain order (the parent is always
  pinned by the session); every block of the prefix stays pinned by the session.
* **Drop**: our blocks go back to FREE — only ever after their read completed.
* **Finish**: the prefix ``[0, P)`` moves into a *prefetch lease* kept for
  ``retained_ttl_s``; a ``get`` for the request takes its own reference and then
  drops the prefetch lease in the same control-thread step (no eviction window).
"""

from __future__ import annotations

import collections
import itertools
import logging
import time

from kvsidecar.shm.errors import ErrorCode

from kvsidecar.shm.chain import key as chain_key, length as chain_len, span as chain_span
from kvsidecar.sidecar.kv.ops import KVCore
from kvsidecar.sidecar.kv.index import pack_ids
from kvsidecar.sidecar.l3.tier import L3Tier, read_priority
from kvsidecar.sidecar.observe.outcome import SessionObserver, SessionOutcome
from kvsidecar.sidecar.observe.sessionlog import SessionLog
from kvsidecar.sidecar.service import DEFERRED, OpError, Service
from kvsidecar.sidecar.prefetch.cost import Outlook
from kvsidecar.sidecar.prefetch.estimates import drain_budget, outlook
from kvsidecar.sidecar.prefetch.records import ChunkIO, Orphan, Record
from kvsidecar.sidecar.prefetch.waits import SessionWaits, satisfied
from kvsidecar.sidecar.prefetch.machine import (Abort, ChunkAbandoned, ChunkDone, ChunkWithdrawn, Claim, ClaimGranted, Demand, Drop, Finish,
                      Params, Policy, Publish, Query, QueryDone, Replan, Session, Start, State, Tick)

log = logging.getLogger(__name__)


class SessionManager(Service):
    def __init__(self, core: KVCore, tier: L3Tier | None, cfg, clock=time.monotonic,
                 observer: SessionObserver | None = None):
        self.clock = clock  # injected: the executor bench drives a fake clock
        # told of every terminal session (default: the structured log line, kvsidecar.sidecar.observe)
        self.observer = observer if observer is not None else SessionLog()
        self.core = core
        self.tier = tier
        self.cfg = cfg
        self.sidecar = core.sidecar
        self.index = core.index
        self.records: dict[tuple, Record] = {}
        self.by_id: dict[int, Record] = {}
        self._ids = itertools.count(1)
        self.waiters: dict[bytes, list] = collections.defaultdict(list)  # key -> [(sid, chunk, pos)]
        self.counters = collections.Counter()
        # recent stop / drain latencies (bounded: a long-running sidecar must not grow)
        self.stop_ms: dict[str, collections.deque] = collections.defaultdict(lambda: collections.deque(maxlen=4096))
        self.drain_ms: collections.deque = collections.deque(maxlen=4096)
        self.outstanding_staging = 0  # blocks staged by sessions (orphans included) and not yet resolved
        # Reads a stopped session stopped waiting for (the drain budget ran out, e.g. a dead
        # L3 master): their blocks stay STAGING until the read really ends, then they are
        # published (data landed, parent still resident) or freed.  (sid, chunk) -> Orphan
        self.orphans: dict[tuple, Orphan] = {}
        self.waits = SessionWaits(self.sidecar, self.clock)  # deferred ``wait`` replies
        core.holders.append(self)

    def ops(self) -> dict:
        return {"prefetch": self.op_prefetch, "demand": self.op_demand, "abort": self.op_abort,
                "poll": self.op_poll, "wait": self.op_wait}

    # -- ops --------------------------------------------------------------------------------------
    def _key(self, conn, msg) -> tuple:
        return (conn.info.group, msg["req"], msg.get("attempt", 0))

    def op_prefetch(self, conn, msg) -> dict:
        key = self._key(conn, msg)
        rec = self.records.get(key)
        if rec is not None:  # another rank (or a retry) of the same request: one session
            if rec.chain != msg["chain"]:
                raise OpError(ErrorCode.BAD_FIELD, f"request {msg['req']!r} (attempt {key[2]}) already has a "
                                                   "session over another chain (a reused request id?)")
            return self._view(rec, existed=True)
        c = self.cfg
        policy = c.policy_override or msg.get("policy") or c.default_policy
        try:
            policy = Policy(policy)
        except ValueError:
            raise OpError(ErrorCode.BAD_FIELD, f"unknown policy {policy!r}") from None
        chain = msg["chain"]
        total = chain_len(chain)
        now = self.clock()
        resident = self.index.match(chain)
        tokens = msg.get("tokens") or total * self.core.layout.tokens_per_block
        deadline = None
        budget = msg.get("budget_s")
        if policy == Policy.TIMEOUT:
            if budget is None:
                budget = min(c.timeout_max_s, c.timeout_base_s + c.timeout_per_ki_token_s * tokens / 1024)
            deadline = now + budget
        elif policy == Policy.COST_AWARE and budget is not None:
            deadline = now + budget  # an optional cap on new claims
        chunk = msg.get("chunk_max_blocks") or c.chunk_max_blocks
        rec = Record(next(self._ids), key, None, chain, msg.get("ns") or "", policy.value, now, {})
        if policy == Policy.COST_AWARE:
            rec.eta = now + msg["eta_s"] if msg.get("eta_s") is not None else None
            rec.prefill_s_per_block = msg.get("prefill_s_per_block") or c.prefill_s_per_block
        params = Params(policy, total, resident, chunk, c.window, deadline,
                        checkpoint_every=msg.get("checkpoint_every") or 0,
                        checkpoints=frozenset(msg.get("checkpoints") or ()), outlook=self._outlook(rec, now))
        rec.machine = Session(params)
        if resident:  # the resident prefix must not shrink while the session runs
            ids = self.index.resident_ids(chain, resident)
            self.index.pin(ids)
            rec.pins.update(enumerate(_unpack(ids)))
        self.records[key] = rec
        self.by_id[rec.id] = rec
        rec.events.append(("created", now, resident))
        self.counters[f"started_{policy.value}"] += 1
        if deadline is not None:
            self.sidecar.call_at(deadline, self._deadline_due, rec.id)
        self._run(rec, rec.machine.handle(Start(now)))
        return self._view(rec)

    def op_demand(self, conn, msg) -> dict:
        rec = self.records.get(self._key(conn, msg))
        if rec is None:
            raise OpError(ErrorCode.UNKNOWN_ID, f"no prefetch for request {msg['req']!r}")
        self._trigger(rec, "demand")
        if not rec.demanded:  # its queued reads go ahead of every request not yet a candidate
            for io in rec.chunks.values():
                if io.reading and io.job is not None:
                    io.job.raise_priority(read_priority(True, rec.id))
        rec.demanded = True
        now = self.clock()
        if rec.eta is None or rec.eta > now:
            rec.eta = now  # a scheduling candidate: its prefill could start now
        self._run(rec, rec.machine.handle(Demand(now, self._outlook(rec, now))))
        return self._view(rec)

    def op_abort(self, conn, msg) -> dict:
        rec = self.records.get(self._key(conn, msg))
        if rec is None:
            return {"state": "unknown"}  # idempotent: nothing to abort
        self._trigger(rec, "abort")
        self._run(rec, rec.machine.handle(Abort(self.clock())))
        if rec.result_lease is not None:  # the request left: its result is not needed
            self.core.leases.drop(rec.result_lease, "aborted")
            rec.result_lease = None
        return self._view(rec)

    def op_poll(self, conn, msg) -> dict:
        def compute(grouped):
            rec = self.records.get(self._key(conn, msg))
            if rec is None:
                return {"state": "unknown"}
            eta_s = msg.get("eta_s")
            if eta_s is not None and rec.policy == Policy.COST_AWARE.value and rec.machine.state != State.TERMINAL:
                now = self.clock()
                rec.eta = now + eta_s  # once per step: the group's first poll decides for every rank
                self._run(rec, rec.machine.handle(Replan(now, self._outlook(rec, now))))
            view = self._view(rec)
            if msg.get("events"):  # the session's own timeline (observability; no decision)
                view["events"] = [list(e) for e in rec.events]
            return view

        return self.core.decided(conn, "poll", msg, compute)

    def op_wait(self, conn, msg):
        """Deferred: the view once the session's L3 query is done (or ``until`` blocks are
        published; or, with ``terminal``, only at its end), once it is terminal, or at
        ``wait_s`` (see ``kvsidecar.sidecar.prefetch.waits``)."""
        rec = self.records.get(self._key(conn, msg))
        if rec is None:
            return {"state": "unknown"}
        until, terminal = msg.get("until"), bool(msg.get("terminal"))
        if satisfied(rec.machine, until, terminal):
            return self._view(rec)
        self.waits.add(conn, msg["id"], rec.id, until, terminal, msg.get("wait_s"), lambda: self._view(rec))
        return DEFERRED

    def _view(self, rec: Record, existed: bool = False) -> dict:
        m = rec.machine
        out = {"session": rec.id, "state": m.state.value, "policy": rec.policy, "published": m.published,
               "target": m.target, "existed": existed}
        if m.state == State.TERMINAL:
            out.update(status=m.status.value, prefix=m.prefix, reason=m.reason,
                       lease=rec.result_lease.id if rec.result_lease is not None else 0,
                       restored=rec.restored, chunks=len(rec.chunk_times),
                       chunk_ms_max=round(max(rec.chunk_times), 3) if rec.chunk_times else 0.0,
                       transfer_ms_max=round(max(rec.transfer_times), 3) if rec.transfer_times else 0.0,
                       stop_ms=round((rec.terminal_at - rec.trigger_at) * 1e3, 3) if rec.trigger_at else None,
                       drain_ms=round((rec.terminal_at - rec.sealed_at) * 1e3, 3) if rec.sealed_at else None)
        return out

    # -- event plumbing ---------------------------------------------------------------------------
    def _outlook(self, rec: Record, now: float) -> Outlook | None:
        return outlook(rec, now, self.tier, self.cfg)

    def _trigger(self, rec: Record, why: str) -> None:
        if rec.trigger_at is None and rec.machine.state != State.TERMINAL:
            rec.trigger_at = self.clock()
            rec.trigger = why
            rec.events.append(("stop", rec.trigger_at, why))

    def _deadline_due(self, sid: int) -> None:
        rec = self.by_id.get(sid)
        if rec is not None and rec.machine.state != State.TERMINAL:
            self._trigger(rec, "deadline")
        self._feed(sid, Tick(self.clock()))

    def _query_done(self, sid: int, hits: int) -> None:
        rec = self.by_id.get(sid)
        if rec is not None:
            now = self.clock()
            rec.events.append(("query", now, hits))
            self._run(rec, rec.machine.handle(QueryDone(hits, now, self._outlook(rec, now))))

    def _chunk_done(self, sid: int, chunk: int, ok: tuple) -> None:
        rec = self.by_id.get(sid)
        if rec is not None and chunk in rec.chunks:  # (not left behind by the drain budget meanwhile)
            now = self.clock()
            self._run(rec, rec.machine.handle(ChunkDone(chunk, ok, now, self._outlook(rec, now))))

    def _feed(self, sid: int, event) -> None:
        """One event into a session's machine (a forgotten session ignores it)."""
        rec = self.by_id.get(sid)
        if rec is not None:
            self._run(rec, rec.machine.handle(event))

    def _run(self, rec: Record, actions: list) -> None:
        """Carry out actions; executing one may produce more (e.g. a limit shrinks a claim)."""
        if rec.machine.sealed and rec.sealed_at is None:
            rec.sealed_at = self.clock()
            rec.events.append(("sealed", rec.sealed_at, rec.machine.reason or ""))
        self._carry_out(rec, actions)
        self.waits.wake(rec.id, rec.machine, lambda: self._view(rec))
        if rec.machine.state == State.DRAINING and not rec.drain_timer:
            rec.drain_timer = True
            self.sidecar.call_at(self.clock() + self._drain_budget(rec), self._drain_expired, rec.id)

    def _drain_budget(self, rec: Record) -> float:
        return drain_budget(rec, self.tier, self.cfg)

    def _drain_expired(self, sid: int) -> None:
        """The drain budget ran out: stop waiting on reads still in flight (they become orphans)."""
        rec = self.by_id.get(sid)
        if rec is None or rec.machine.state != State.DRAINING:
            return
        now = self.clock()
        actions = []
        for chunk, io in list(rec.chunks.items()):
            if not rec.machine.chunk_pending(chunk):
                continue  # its data landed (it waits for a predecessor) or it is being dropped
            del rec.chunks[chunk]
            for off, kind in enumerate(io.kinds):
                pos = io.start + off
                if kind == "have" and pos in rec.pins and pos >= rec.machine.published:
                    self.index.unpin(pack_ids([rec.pins.pop(pos)]))
            if io.read_ok is None and io.own_blocks:
                self.orphans[(sid, chunk)] = Orphan(rec.chain, io)  # the read still owns its blocks
            else:  # our part (if any) landed; only a shared block is late: free ours now
                for pos, b in io.own_blocks.items():
                    self.index.drop_staging(chain_key(rec.chain, pos), b)
                    self.outstanding_staging -= 1
                io.own_blocks.clear()
            rec.abandoned += 1
            self.counters["chunks_abandoned"] += 1
            actions += rec.machine.handle(ChunkAbandoned(chunk, now))
        if rec.abandoned:
            log.warning("session %d: drain budget ran out, %d chunk(s) still in flight left behind",
                        rec.id, rec.abandoned)
        self._carry_out(rec, actions)

    def _resolve_orphan(self, orphan: Orphan, ok: list) -> None:
        """A read a session stopped waiting for ended: publish what landed in chain order
        (while each parent is still resident), free the rest."""
        idx, chain, io = self.index, orphan.chain, orphan.io
        for pos, good in zip(sorted(io.own_blocks), ok):
            b = io.own_blocks[pos]
            key = chain_key(chain, pos)
            parent = idx.find(chain_key(chain, pos - 1)) if pos else -1
            self.outstanding_staging -= 1
            if good and (pos == 0 or parent >= 0):
                idx.publish(key, b, parent)
                self.counters["orphan_blocks_published"] += 1
            else:
                idx.drop_staging(key, b)
                self.counters["orphan_blocks_dropped"] += 1
        io.own_blocks.clear()

    def _carry_out(self, rec: Record, actions: list) -> None:
        queue = collections.deque(actions)
        withdrawn = False
        while True:
            if not queue:
                m = rec.machine
                # A stop trigger (deadline, demand, abort, a failed block) withdraws reads not yet
                # started; a limit seal (and a cost stop whose claims still pay) only stops new
                # claims: what was admitted is read.
                if withdrawn or not m.sealed or m.state == State.TERMINAL or m.keep_admitted:
                    break
                withdrawn = True
                queue.extend(self._withdraw_queued(rec))
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
            elif isinstance(a, Finish):
                self._finish(rec, a)

    def _withdraw_queued(self, rec: Record) -> list:
        """After a stop, chunks whose read has not started leave the sender queue.

        Cancellation is atomic with the read lane picking the job up, so these blocks
        were never touched by L3 and go straight back to FREE; only reads already in
        flight are drained.  This keeps stop latency within one chunk's transfer.  A
        chunk other sessions wait on is not cancelled: its read is handed over to them
        (shared blocks survive a stop; only a real L3 failure fails a waiter).
        """
        out = []
        for chunk, io in list(rec.chunks.items()):
            if not io.reading or io.shared_ok or io.job is None:
                continue
            if any(chain_key(rec.chain, pos) in self.waiters for pos in io.own_blocks):
                # Other sessions wait on these blocks: the read goes on for them.  Ownership
                # passes to the orphan table (published when its data lands, which resolves
                # the waiters); this session just stops counting on the chunk.
                for off, kind in enumerate(io.kinds):
                    pos = io.start + off
                    if kind == "have" and pos in rec.pins:
                        self.index.unpin(pack_ids([rec.pins.pop(pos)]))
                del rec.chunks[chunk]
                self.orphans[(rec.id, chunk)] = Orphan(rec.chain, io)
                self.counters["reads_handed_over"] += 1
                out += rec.machine.handle(ChunkWithdrawn(chunk, self.clock()))
                continue
            if not io.job.cancel():
                continue
            rec.withdrawn += len(io.own_blocks)
            self.counters["blocks_withdrawn"] += len(io.own_blocks)
            for pos, b in list(io.own_blocks.items()):
                self.index.drop_staging(chain_key(rec.chain, pos), b)
                self.outstanding_staging -= 1
            for off, kind in enumerate(io.kinds):
                pos = io.start + off
                if kind == "have" and pos in rec.pins:
                    self.index.unpin(pack_ids([rec.pins.pop(pos)]))
            del rec.chunks[chunk]
            self.counters["chunks_withdrawn"] += 1
            out += rec.machine.handle(ChunkWithdrawn(chunk, self.clock()))
        return out

    def _query(self, rec: Record, a: Query) -> None:
        if self.tier is None:
            self.sidecar.post(self._query_done, rec.id, 0)
            return
        self.tier.lookup(rec.ns, chain_span(rec.chain, a.start), lambda hits: self._query_done(rec.id, hits))

    def _claim(self, rec: Record, a: Claim) -> list:
        idx, pool = self.index, self.core.pool
        # our staged blocks become pins once published: pin admission counts them already
        reserved_room, pinned_room = pool.headroom(pin_reserved=self.outstanding_staging)
        kinds, own_positions = [], []
        granted = 0
        for pos in range(a.start, a.start + a.count):
            key = chain_key(rec.chain, pos)
            if idx.find(key) >= 0:
                kind = "have"
                need = 1 if idx.refcount(idx.find(key)) == 0 else 0
            elif key in idx.staging:
                kind, need = "shared", 0
            else:
                kind, need = "own", 1
            if kind == "own" and len(own_positions) + 1 > reserved_room:
                pool.refuse("reserved", "session claim over reserved_bytes_limit")
                break
            if len(own_positions) + need > pinned_room:
                pool.refuse("pinned", "session claim over pinned_bytes_limit")
                break
            if kind == "own":
                own_positions.append(pos)
            kinds.append(kind)
            granted += 1
        blocks = _unpack(pool.allocate(len(own_positions))) if own_positions else []
        if len(blocks) < len(own_positions):  # cannot make room: everything else is pinned or staging
            pool.refuse("allocator", "session claim: pool full")
            keep = len(blocks)
            granted = min(granted, own_positions[keep] - a.start)
            kinds = kinds[:granted]
            own_positions = own_positions[:keep]
        extra = []
        if granted < a.count:
            self.counters["claims_limited"] += 1
            extra = rec.machine.handle(ClaimGranted(a.chunk, granted, self.clock()))
            if granted == 0:
                return extra
        io = ChunkIO(a.start, granted, kinds, {}, {})
        rec.chunks[a.chunk] = io
        for pos, b in zip(own_positions, blocks):
            io.own_blocks[pos] = b
            idx.stage(chain_key(rec.chain, pos), b)
        self.outstanding_staging += len(blocks)
        for off, kind in enumerate(kinds):
            pos = a.start + off
            key = chain_key(rec.chain, pos)
            if kind == "have":
                b = idx.find(key)
                idx.pin(pack_ids([b]))
                rec.pins[pos] = b
            elif kind == "shared":
                io.shared_ok[pos] = None
                self.waiters[key].append((rec.id, a.chunk, pos))
                self.counters["blocks_deduplicated"] += 1
        io.t0 = self.clock()
        rec.events.append(("claim", io.t0, [a.chunk, a.start, granted, len(own_positions)]))
        if own_positions:
            io.reading = True
            keys = b"".join(chain_key(rec.chain, p) for p in own_positions)
            io.job = self.tier.load(rec.ns, keys, pack_ids(blocks),
                                    lambda result, sid=rec.id, ch=a.chunk: self._read_done(sid, ch, result),
                                    priority=read_priority(rec.demanded, rec.id))
        else:
            io.read_ok = {}
            self._maybe_chunk_done(rec, a.chunk)
        return extra

    def _read_done(self, sid: int, chunk: int, result) -> None:
        """A chunk's L3 read ended (``result``: per-block success and its own timing)."""
        ok = result.ok
        orphan = self.orphans.pop((sid, chunk), None)
        if orphan is not None:
            self._resolve_orphan(orphan, ok)
            return
        rec = self.by_id.get(sid)
        io = rec.chunks.get(chunk) if rec else None
        if io is None:
            return
        io.reading = False
        io.read_ok = dict(zip(sorted(io.own_blocks), ok))
        rec.transfer_times.append(result.seconds * 1e3)
        rec.events.append(("read", self.clock(), [chunk, len(ok), result.seconds]))
        if ok:
            rec.read_s_per_block.append(result.seconds / len(ok))
        self._maybe_chunk_done(rec, chunk)

    def key_resolved(self, key: bytes, published: bool) -> None:
        """A staged key was published or dropped (by whichever writer): wake its waiters."""
        for sid, chunk, pos in self.waiters.pop(key, ()):
            rec = self.by_id.get(sid)
            io = rec.chunks.get(chunk) if rec else None
            if io is None:
                continue
            if published:  # pin it now: it must still be there when we publish past it
                b = self.index.find(key)
                self.index.pin(pack_ids([b]))
                rec.pins[pos] = b
            io.shared_ok[pos] = published
            self._maybe_chunk_done(rec, chunk)

    def _maybe_chunk_done(self, rec: Record, chunk: int) -> None:
        io = rec.chunks[chunk]
        if io.read_ok is None or any(v is None for v in io.shared_ok.values()):
            return
        ok = []
        for off, kind in enumerate(io.kinds):
            pos = io.start + off
            ok.append(True if kind == "have" else io.shared_ok[pos] if kind == "shared" else io.read_ok[pos])
        rec.chunk_times.append((self.clock() - io.t0) * 1e3)
        rec.events.append(("landed", self.clock(), [chunk, io.count]))
        # deliver as an event so it is never re-entered from inside a claim
        self.sidecar.post(self._chunk_done, rec.id, chunk, tuple(ok))

    def _publish(self, rec: Record, a: Publish) -> None:
        io = rec.chunks[a.chunk]
        idx = self.index
        for pos in range(io.start, io.start + a.count):
            b = io.own_blocks.pop(pos, None)
            if b is not None:
                parent = rec.pins[pos - 1] if pos else -1
                idx.publish(chain_key(rec.chain, pos), b, parent)
                idx.pin(pack_ids([b]))
                rec.pins[pos] = b
                self.outstanding_staging -= 1
                rec.restored += 1
        if a.count == io.count:
            del rec.chunks[a.chunk]

    def _drop(self, rec: Record, a: Drop) -> None:
        io = rec.chunks.pop(a.chunk, None)
        if io is None:
            return
        idx = self.index
        for pos in range(io.start + a.offset, io.start + io.count):
            b = io.own_blocks.pop(pos, None)
            if b is not None:
                idx.drop_staging(chain_key(rec.chain, pos), b)
                self.outstanding_staging -= 1
            elif pos in rec.pins and pos >= rec.machine.published:
                idx.unpin(pack_ids([rec.pins.pop(pos)]))

    def _finish(self, rec: Record, a: Finish) -> None:
        now = self.clock()
        rec.terminal_at = now
        rec.events.append(("terminal", now, [a.status.value, a.prefix]))
        prefix_ids = [rec.pins.pop(p) for p in range(a.prefix)]
        rest = list(rec.pins.values())
        rec.pins.clear()
        if rest:
            self.index.unpin(pack_ids(rest))
        if prefix_ids and a.status.value != "aborted":
            rec.result_lease = self.core.leases.adopt(
                pack_ids(prefix_ids), ttl_s=self.cfg.retained_ttl_s, now=now, kind="prefetch",
                owner=("session", rec.id))
            self.core.arm_reaper(rec.result_lease.deadline)
        elif prefix_ids:
            self.index.unpin(pack_ids(prefix_ids))
        self.counters[f"terminal_{a.status.value}"] += 1
        self.counters["restored_blocks"] += rec.restored
        if rec.trigger_at is not None:
            self.stop_ms[rec.trigger or "other"].append((now - rec.trigger_at) * 1e3)
        if rec.sealed_at is not None:
            self.drain_ms.append((now - rec.sealed_at) * 1e3)
        self.sidecar.call_at(now + self.cfg.retained_ttl_s, self._forget, rec.id)
        self.observer.session_ended(self._outcome(rec, a, now))

    def _outcome(self, rec: Record, a: Finish, now: float) -> SessionOutcome:
        m = rec.machine
        return SessionOutcome(
            session=rec.id, request=str(rec.key[1]), group=rec.key[0], policy=rec.policy,
            status=a.status.value, reason=a.reason, trigger=rec.trigger, blocks_total=m.p.total,
            blocks_resident=m.p.resident, blocks_target=m.target, blocks_published=m.published, prefix=a.prefix,
            blocks_restored=rec.restored, blocks_withdrawn=rec.withdrawn, chunks=len(rec.chunk_times),
            chunks_abandoned=rec.abandoned, elapsed_s=now - rec.created,
            stop_latency_s=now - rec.trigger_at if rec.trigger_at is not None else None,
            drain_s=now - rec.sealed_at if rec.sealed_at is not None else None,
            chunk_s=tuple(t / 1e3 for t in rec.chunk_times), read_s_per_block=tuple(rec.read_s_per_block),
            tokens_per_block=self.core.layout.tokens_per_block)

    def _forget(self, sid: int) -> None:
        rec = self.by_id.pop(sid, None)
        if rec is not None:
            self.waits.forget(sid, lambda: self._view(rec))
        if rec is not None and self.records.get(rec.key) is rec:
            del self.records[rec.key]

    # -- hand-off and cleanup ---------------------------------------------------------------------
    def handoff(self, conn, msg) -> None:
        """After a GET took its own reference: the request's prefetch result is no longer needed."""
        if msg.get("req") is None:
            return
        rec = self.records.get(self._key(conn, msg))
        if rec is not None and rec.result_lease is not None:
            self.core.leases.drop(rec.result_lease, "handed_off")
            rec.result_lease = None
            self.counters["handoffs"] += 1

    def client_gone(self, conn) -> None:
        if conn.info is None:
            return
        group = conn.info.group
        if any(c is not conn and c.info is not None and c.info.group == group
               for c in self.sidecar.clients.values()):
            return  # other ranks of the group are still here
        for rec in list(self.records.values()):
            if rec.key[0] == group:
                self._trigger(rec, "abort")
                self._run(rec, rec.machine.handle(Abort(self.clock())))
                if rec.result_lease is not None:
                    self.core.leases.drop(rec.result_lease, "client_gone")
                    rec.result_lease = None
                # the key is free at once: a new incarnation of the group reusing the request
                # id starts its own session (this one finishes its drain under its id)
                if self.records.get(rec.key) is rec:
                    del self.records[rec.key]

    def pins_per_block(self) -> collections.Counter:
        """Pins held by running sessions (a terminal session's result is a lease)."""
        return collections.Counter(b for rec in self.by_id.values() for b in rec.pins.values())

    def staged_blocks(self) -> int:
        return self.outstanding_staging

    def check(self) -> str:
        counted = sum(len(io.own_blocks) for rec in self.by_id.values() for io in rec.chunks.values())
        counted += sum(len(o.io.own_blocks) for o in self.orphans.values())
        if counted != self.outstanding_staging:
            return f"sessions stage {counted} blocks, outstanding_staging says {self.outstanding_staging}"
        return ""

    def stats(self) -> dict:
        by_state = collections.Counter(r.machine.state.value for r in self.records.values())
        return {"sessions": {"by_state": dict(by_state), "outstanding_staging": self.outstanding_staging,
                             "orphans": len(self.orphans), **dict(self.counters)}}


def _unpack(blob: bytes) -> list:
    from kvsidecar.sidecar.kv.index import unpack_ids

    return list(unpack_ids(blob))
