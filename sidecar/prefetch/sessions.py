"""Prefetch sessions on the control thread: ops, records, timers and events for the pure machine.

One session per (group, request, attempt); any rank may send ``prefetch``, ``demand``,
``abort``, ``poll`` or ``wait``.  The session manager turns ops, timers and L3 answers into
events for each session's machine (``kvsidecar.sidecar.prefetch.machine``), hands the actions
it emits to the :class:`~kvsidecar.sidecar.prefetch.executor.SessionExecutor`, and answers.  The
block state is the pool manager's (``kvsidecar.sidecar.kv.admission.PoolManager``):

* **Start**: the resident prefix is pinned for the session (it must not shrink meanwhile).
* **Claim**: a chunk's positions are classified — already resident (pinned now), being staged by
  someone else (awaited: in-flight de-duplication, one publication serves all), or ours to read.
  Admission reserves staging within ``reserved_bytes_limit`` and keeps pinned + sessions'
  staging within ``pinned_bytes_limit``; a shortfall shrinks the claim and the session stops
  claiming (``Status.LIMIT``).  Our blocks are read on the L3 read lane.
* **Publish**: our blocks become resident in chain order (the parent is always pinned by the
  session); every block of the prefix stays pinned by the session.
* **Drop**: our blocks go back to FREE — only ever after their read completed.
* **Finish**: the prefix ``[0, P)`` moves into a *prefetch lease* kept for ``retained_ttl_s``; a
  ``get`` for the request takes its own reference and then drops the prefetch lease in the same
  control-thread step (``KVCore.op_get`` → ``PoolManager.hand_off``: no eviction window).
"""

from __future__ import annotations

import collections
import itertools
import time

from kvsidecar.shm.errors import ErrorCode

from kvsidecar.shm.chain import length as chain_len
from kvsidecar.sidecar.kv.ops import KVCore
from kvsidecar.sidecar.l3.interface import SessionTier, read_priority
from kvsidecar.sidecar.observe.outcome import SessionObserver, SessionOutcome
from kvsidecar.sidecar.observe.sessionlog import SessionLog
from kvsidecar.sidecar.service import DEFERRED, OpError, Service
from kvsidecar.sidecar.prefetch.cost import Outlook
from kvsidecar.sidecar.prefetch.estimates import (EXPLORE_AFTER, EXPLORE_MAX, MAX_WAITING, MAY_READ, STALE_AFTER,
                                                  awaited_reads, drain_budget, held_ahead, outlook)
from kvsidecar.sidecar.prefetch.executor import SessionExecutor
from kvsidecar.sidecar.prefetch.records import Record
from kvsidecar.sidecar.prefetch.waits import SessionWaits, satisfied
from kvsidecar.sidecar.prefetch.events import (Abort, ChunkDone, Demand, Finish, Policy, QueryDone, Replan,
                                               Start, State, Status, Tick)
from kvsidecar.sidecar.prefetch.machine import Params, Session

class SessionManager(Service):
    def __init__(self, core: KVCore, tier: SessionTier | None, cfg, clock=time.monotonic,
                 observer: SessionObserver | None = None):
        self.clock = clock  # injected: the executor bench drives a fake clock
        # told of every terminal session (default: the structured log line, kvsidecar.sidecar.observe)
        self.observer = observer if observer is not None else SessionLog()
        self.core = core
        self.pool = core.pool  # owns every session's block state (and counts it in the books)
        self.tier = tier
        self.cfg = cfg
        self.host = core.host
        self.index = core.index  # (read only: what is resident)
        self.records: dict[tuple, Record] = {}
        self.by_id: dict[int, Record] = {}
        self._open: dict[int, Record] = {}  # not yet terminal, in creation order (snapshot: bounded work)
        self._ids = itertools.count(1)
        self._counters = collections.Counter()
        self.waits = SessionWaits(self.host, self.clock)  # deferred ``wait`` replies
        self.executor = SessionExecutor(self.pool, tier, self.host, self.clock, self._counters,
                                        query_done=self._query_done, chunk_done=self._chunk_done,
                                        finished=self._finish, session_of=self.by_id.get,
                                        read_ended=self.evidence_landed)
        self._awaiting_evidence: set[int] = set()  # cost_aware sessions open for an L3 measurement
        self._unread = 0  # cost_aware sessions in a row that ended reading nothing, since an L3 read ended
        # ... and since the last exploration began: the next one explores after _explore_after of
        # them (estimates.EXPLORE_AFTER).  Not _unread: an exploration whose query finds nothing
        # in L3 reads nothing, so _unread stayed past the cap and every later session explored
        self._quiet = 0
        self._explore_after = EXPLORE_AFTER
        self._explorer: int | None = None  # the session exploring now (one at a time)
        self._active: set[int] = set()  # sessions in estimates.MAY_READ (forgotten ones leave): estimates.held_ahead

    @property
    def counters(self) -> collections.Counter:
        """What sessions did (started, terminal by status, blocks restored, withdrawn, ...), with the
        results handed off to a GET (counted where the hand-off happens, the pool manager)."""
        if self.pool.handoffs:
            self._counters["handoffs"] = self.pool.handoffs
        return self._counters

    @property
    def orphans(self) -> dict:
        """Reads a stopped session stopped waiting for (the drain budget ran out, e.g. a dead L3
        master, or handed over to waiters): their blocks stay STAGING until the read really
        ends, then the pool manager publishes them (data landed, parent still resident) or frees
        them.  (sid, chunk) -> ChunkPlan"""
        return self.pool.orphans

    def ops(self) -> dict:
        return {"prefetch": self.op_prefetch, "demand": self.op_demand, "abort": self.op_abort,
                "poll": self.op_poll, "poll_scan": self.op_poll_scan, "wait": self.op_wait}

    # -- ops --------------------------------------------------------------------------------------
    def _key(self, conn, msg) -> tuple:
        return (conn.info.group, msg["req"], msg.get("attempt", 0))

    def op_prefetch(self, conn, msg) -> dict:
        key = self._key(conn, msg)
        view = self._start_or_join(conn, msg, key)
        # (only a prefetch taken: a refused one leaves the rank done with the request, if it was)
        self.core.request_started(conn, key[1], key[2])
        return view

    def _start_or_join(self, conn, msg, key) -> dict:
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
        sid = next(self._ids)
        # the resident prefix must not shrink while the session runs: pinned for it now
        rec = Record(sid, key, None, chain, msg.get("ns") or "", policy.value, now,
                     self.pool.open_hold(sid, chain, resident))
        if policy == Policy.COST_AWARE:
            rec.eta = now + msg["eta_s"] if msg.get("eta_s") is not None else None
            rec.prefill_s_per_block = msg.get("prefill_s_per_block") or c.prefill_s_per_block
            self._take_waiting(rec, msg)
            if self._explorer is None and self._quiet >= self._explore_after and not msg.get("fixed_hit"):
                # (not an engine that waits for the whole hit it was told: it would wait for the probe)
                self._explorer = sid
                self._quiet = 0
                self._explore_after = min(2 * self._explore_after, EXPLORE_MAX)
                self._counters["cost_explorations"] += 1
        params = Params(policy, total, resident, chunk, c.window, deadline,
                        checkpoint_every=msg.get("checkpoint_every") or 0,
                        checkpoints=frozenset(msg.get("checkpoints") or ()), outlook=self._outlook(rec, now, resident),
                        fixed_hit=bool(msg.get("fixed_hit")), read_with_query=c.read_with_query and self.tier is not None)
        rec.machine = Session(params)
        self.records[key] = rec
        self.by_id[rec.id] = rec
        self._open[rec.id] = rec
        rec.events.append(("created", now, resident))
        self._counters[f"started_{policy.value}"] += 1
        if deadline is not None:
            self.host.call_at(deadline, self._deadline_due, rec.id)
        self._run(rec, rec.machine.handle(Start(now, eta_given=rec.eta is not None)))
        if rec.machine.with_query >= 0:
            self._counters["reads_with_query"] += 1  # (its first chunk is read with the L3 query)
        return self._view(rec)

    def op_demand(self, conn, msg) -> dict:
        rec = self.records.get(self._key(conn, msg))
        if rec is None:
            raise OpError(ErrorCode.UNKNOWN_ID, f"no prefetch for request {msg['req']!r}")
        drain_s = msg.get("drain_s")
        self._take_waiting(rec, msg)
        self._demand(rec, admitted=drain_s is not None)
        if drain_s is not None and rec.machine.state == State.DRAINING and not rec.machine.reads_outlast_admission:
            # the engine admits the request within drain_s: a read landing later is of no use to
            # it (SGLang would hold the request a whole forward pass for it), so the session
            # waits no longer than that (its own drain budget is for an engine that waits)
            self._counters["demands_drain_bounded"] += 1
            if drain_s <= 0:
                self._drain_expired(rec.id, demanded=True)
            else:
                self.host.call_at(self.clock() + drain_s, self._drain_expired, rec.id, True)
        return self._view(rec)

    def _take_waiting(self, rec: Record, msg: dict) -> None:
        """cost_aware: how many queued requests the engine says this one's prefill would hold up
        (``waiting`` of a ``prefetch``, ``demand`` or ``poll``; kept until the next says otherwise).  Used by the
        next decision (:attr:`cost.Outlook.saving_per_block`); ignored without
        ``sessions.queue_aware``; capped at :data:`MAX_WAITING`."""
        if self.cfg.queue_aware and msg.get("waiting") is not None and rec.policy == Policy.COST_AWARE.value:
            rec.waiting = min(msg["waiting"], MAX_WAITING)

    def _demand(self, rec: Record, admitted: bool = False) -> None:
        """The request became a scheduling candidate (``demand``, or a ``poll`` with ``demand``);
        idempotent: every rank of the group sends it.  ``admitted``: the engine admits it now
        with what has landed (``Demand.admitted``)."""
        self._trigger(rec, "demand")
        if not rec.demanded:  # its queued reads go ahead of every request not yet a candidate
            for io in rec.chunks.values():
                if io.reading and io.job is not None:
                    io.job.raise_priority(read_priority(True, rec.id))
        rec.demanded = True
        now = self.clock()
        if rec.eta is None or rec.eta > now:
            rec.eta = now  # a scheduling candidate: its prefill could start now
        if rec.machine.state == State.TERMINAL:
            return  # (the machine ignores it: no outlook to build, nothing to carry out -- the scan's path)
        self._run(rec, rec.machine.handle(Demand(now, self._outlook(rec, now), admitted=admitted)))

    def op_abort(self, conn, msg) -> dict:
        key = self._key(conn, msg)
        self.core.request_ended(conn, key[1], key[2])  # (a GET share kept for this rank goes)
        rec = self.records.get(key)
        if rec is None:
            return {"state": "unknown"}  # idempotent: nothing to abort
        self._trigger(rec, "abort")
        self._run(rec, rec.machine.handle(Abort(self.clock())))
        self.pool.drop_result(rec.key, rec.id, "aborted")  # the request left: its result is not needed
        return self._view(rec)

    def op_poll(self, conn, msg) -> dict:
        """The session's view (with ``step``, the group's first answer for that step).  With
        ``demand`` the request became a scheduling candidate first (``demand`` and this poll in
        one round trip: a scheduler demands and checks a request in the same scan)."""
        def compute(grouped):
            rec = self.records.get(self._key(conn, msg))
            if rec is None:
                return {"state": "unknown"}
            self._take_waiting(rec, msg)
            if msg.get("demand"):
                self._demand(rec)
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

    def op_poll_scan(self, conn, msg) -> dict:
        """A scheduler's scan of its waiting queue in one round trip: each entry is exactly a
        ``poll`` (the same group decision per request and step, so ranks that scan and ranks that
        poll one by one get the same answers), taken in order.  With ``until_ready`` the scan
        stops after the first entry that is ready to admit (terminal or unknown session, or a
        refused entry), so nothing behind it is demanded — as the scheduler's own scan, which
        starts that request, never reaches them.  ``views``: one per entry taken, in order; a
        refused entry's view is ``{"state": "error", "err", "msg"}`` (the scan goes on past it
        only without ``until_ready``).

        With ``get`` (and ``until_ready``) the scan that stops at a terminal session also leases
        it: the view carries ``get``, exactly the answer of a ``get`` of the session's chain
        with the request and the scan's ``step`` (the group's decision, this rank's share and
        checksums, the session's result handed over), or ``{"err", "msg"}`` where that ``get``
        is refused — so the engine admits with one round trip, not a scan and then a ``get``."""
        step, until_ready = msg.get("step"), bool(msg.get("until_ready"))
        views = []
        for entry in msg["polls"]:
            one = dict(entry)
            if step is not None:
                one["step"] = step
            try:
                view = self.op_poll(conn, one)
            except OpError as exc:
                self._counters["scan_refused"] += 1
                view = {"state": "error", "err": int(exc.code), "msg": exc.message}
            views.append(view)
            if until_ready and view["state"] in ("terminal", "unknown", "error"):
                if msg.get("get") and view["state"] == "terminal":
                    view["get"] = self._lease_ready(conn, one)
                break
        return {"views": views}

    def _lease_ready(self, conn, entry: dict) -> dict:
        """``get`` of the chain of the terminal session ``entry`` names (:meth:`op_poll_scan`)."""
        rec = self.records.get(self._key(conn, entry))
        if rec is None:  # (terminal, so not forgotten: a view said so in this same step)
            return {"err": int(ErrorCode.UNKNOWN_ID), "msg": f"no session for {entry['req']!r}"}
        get = {"chain": rec.chain, "req": entry["req"], "attempt": entry.get("attempt", 0), "step": entry.get("step")}
        try:
            return self.core.op_get(conn, get)
        except OpError as exc:
            self._counters["scan_get_refused"] += 1
            return {"err": int(exc.code), "msg": exc.message}

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
               "target": m.target, "planned": m.planned, "existed": existed}
        if rec.policy == Policy.COST_AWARE.value:
            out["waiting"] = rec.waiting  # (what its decisions weigh a block's prefill by: queue_aware)
            out["held"] = round(rec.held, 3)  # (and the older requests still reading it would hold up: ahead_aware)
        if m.state == State.TERMINAL:
            lease = self.pool.result_of(rec.key, rec.id)
            out.update(status=m.status.value, prefix=m.prefix, reason=m.reason,
                       lease=lease.id if lease is not None else 0,
                       restored=rec.restored, chunks=len(rec.chunk_times),
                       chunk_ms_max=round(max(rec.chunk_times), 3) if rec.chunk_times else 0.0,
                       transfer_ms_max=round(max(rec.transfer_times), 3) if rec.transfer_times else 0.0,
                       stop_ms=round((rec.terminal_at - rec.trigger_at) * 1e3, 3) if rec.trigger_at else None,
                       drain_ms=round((rec.terminal_at - rec.sealed_at) * 1e3, 3) if rec.sealed_at else None)
        return out

    # -- event plumbing ---------------------------------------------------------------------------
    def _outlook(self, rec: Record, now: float, start: int | None = None) -> Outlook | None:
        """cost_aware's inputs now (None for other policies), the blocks other sessions are
        reading counted from ``start`` (default: where the session's next claim starts)."""
        if rec.policy != Policy.COST_AWARE.value or self.tier is None:
            return outlook(rec, now, self.tier, self.cfg)
        pos = (rec.machine.next_pos if rec.machine is not None else 0) if start is None else start
        if self.cfg.queue_aware and self.cfg.ahead_aware:
            rec.held = held_ahead(rec, pos, now, (self.by_id[s] for s in self._active), self.tier)
        return outlook(rec, now, self.tier, self.cfg,
                       awaited=awaited_reads(rec.chain, pos, now, self.pool, self.tier, self.by_id.get),
                       stale=self._unread >= STALE_AFTER, held=rec.held, explore=rec.id == self._explorer)

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
        """Carry out actions (the executor), answer the waits, arm the drain budget."""
        if rec.machine.sealed and rec.sealed_at is None:
            rec.sealed_at = self.clock()
            rec.events.append(("sealed", rec.sealed_at, rec.machine.reason or ""))
        self.executor.carry_out(rec, actions)
        if rec.machine.state in MAY_READ:
            self._active.add(rec.id)
        else:
            self._active.discard(rec.id)
        if rec.machine.awaiting_evidence:
            self._awaiting_evidence.add(rec.id)
        else:
            self._awaiting_evidence.discard(rec.id)
        wake = rec.machine.probe_wake_at
        if wake is not None and not rec.probe_timer:
            rec.probe_timer = True
            self.host.call_at(wake, self._probe_due, rec.id)
        self.waits.wake(rec.id, rec.machine, lambda: self._view(rec))
        if rec.machine.state == State.DRAINING and not rec.drain_timer:
            rec.drain_timer = True
            self.host.call_at(self.clock() + self._drain_budget(rec), self._drain_expired, rec.id)

    def _probe_due(self, sid: int) -> None:
        """A probe that pays would have landed by now: a candidate stops waiting for it."""
        rec = self.by_id.get(sid)
        if rec is not None and rec.machine.probe_wake_at is not None:
            now = self.clock()
            self._run(rec, rec.machine.handle(Replan(now, self._outlook(rec, now))))

    def evidence_landed(self) -> None:
        """An L3 read ended (a session's, a detached probe's, the tier's calibration at start):
        once the estimate is measured, the sessions that were waiting for it re-plan (oldest
        first: the read lane's order).  Control thread."""
        self._unread = self._quiet = 0  # the estimate has new evidence (stale: see estimates.pessimistic)
        if not self._awaiting_evidence or self.tier is None or not self.tier.read_outlook().estimate.measured:
            return
        now = self.clock()
        for sid in sorted(self._awaiting_evidence):
            rec = self.by_id.get(sid)
            self._awaiting_evidence.discard(sid)
            if rec is not None and rec.machine.awaiting_evidence:
                self._counters["replans_on_evidence"] += 1
                self._run(rec, rec.machine.handle(Replan(now, self._outlook(rec, now))))

    def _drain_budget(self, rec: Record) -> float:
        return drain_budget(rec, self.tier, self.cfg)

    def _drain_expired(self, sid: int, demanded: bool = False) -> None:
        """The drain budget (or the engine's ``drain_s``: ``demanded``) ran out: stop waiting on
        reads still in flight (they become orphans)."""
        rec = self.by_id.get(sid)
        if rec is None or rec.machine.state != State.DRAINING:
            return
        # the engine's bound also takes the reads queued behind (a stop whose claims still paid
        # kept them): none would land in time either
        actions = self.executor.withdraw_queued(rec) if demanded else []
        actions += self.executor.abandon_in_flight(rec, expected=demanded)
        self._run(rec, actions)  # (through _run: its waiters are woken)

    def _finish(self, rec: Record, a: Finish) -> None:
        now = self.clock()
        rec.terminal_at = now
        self._open.pop(rec.id, None)
        rec.events.append(("terminal", now, [a.status.value, a.prefix]))
        lease = self.pool.finish(rec.hold, a.prefix, rec.key, retain=a.status != Status.ABORTED,
                                 ttl_s=self.cfg.retained_ttl_s, now=now)
        if lease is not None:
            self.core.arm_reaper(lease.deadline)
        self._counters[f"terminal_{a.status.value}"] += 1
        self._counters["restored_blocks"] += rec.restored
        if rec.policy == Policy.COST_AWARE.value and a.status == Status.COST and not rec.chunk_times:
            self._unread += 1  # it decided on the estimate and read nothing: no evidence came of it
            self._quiet += 1
            if self._unread == STALE_AFTER:
                self._counters["cost_estimate_stale"] += 1
        if rec.id == self._explorer:  # (every session ends here, an aborted one too: it never stays the explorer)
            self._explorer = None
        elif rec.policy == Policy.COST_AWARE.value and rec.chunk_times and rec.machine.probe_chunk < 0:
            self._explore_after = EXPLORE_AFTER  # it read on the estimate: explorations need not back off
        self.host.call_at(now + self.cfg.retained_ttl_s, self._forget, rec.id)
        # observed after the replies of this pass (metrics, log line, write-behind gate): not on
        # the path of the request whose session ended, nor of the ranks' ops behind it
        self.host.post(self.observer.session_ended, self._outcome(rec, a, now))

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
            tokens_per_block=self.core.layout.tokens_per_block, prefill_s_per_block=rec.prefill_s_per_block)

    def _forget(self, sid: int) -> None:
        self._active.discard(sid)
        rec = self.by_id.pop(sid, None)
        self._open.pop(sid, None)
        if rec is not None:
            self.waits.forget(sid, lambda: self._view(rec))
            self.pool.forget_result(rec.key, rec.id)
        if rec is not None and self.records.get(rec.key) is rec:
            del self.records[rec.key]

    # -- cleanup ----------------------------------------------------------------------------------
    def client_gone(self, conn) -> None:
        if conn.info is None:
            return
        group = conn.info.group
        if any(c is not conn and c.info is not None and c.info.group == group
               for c in self.host.clients.values()):
            return  # other ranks of the group are still here
        for rec in list(self.records.values()):
            if rec.key[0] == group:
                self._trigger(rec, "abort")
                self._run(rec, rec.machine.handle(Abort(self.clock())))
                self.pool.drop_result(rec.key, rec.id, "client_gone")
                # the key is free at once: a new incarnation of the group reusing the request
                # id starts its own session (this one finishes its drain under its id)
                if self.records.get(rec.key) is rec:
                    del self.records[rec.key]

    def stats(self) -> dict:
        return self.snapshot().stats()

    def check(self) -> str:
        """The session books: every record a request names is known by id (a departed group's
        may be known by id only, while it drains), and the open ones are exactly those not yet
        terminal (what a snapshot counts and shows)."""
        if any(self.by_id.get(rec.id) is not rec for rec in self.records.values()):
            return "sessions: a request's record is not known by its id"
        running = [sid for sid, rec in self.by_id.items() if rec.machine.state != State.TERMINAL]
        if running != list(self._open):
            return f"sessions: open {sorted(self._open)} but not terminal {running}"
        return ""

    def snapshot(self):
        """Live sessions and the counters as one typed snapshot (``kvsidecar.sidecar.observe.snapshot``;
        the stats op, the inspector and Prometheus render it)."""
        from kvsidecar.sidecar.observe.snapshot import Policy, SessionsSnapshot, session_rows, session_states

        running = self._open.values()
        ended = (rec for rec in reversed(self.by_id.values()) if rec.id not in self._open)  # (ids only grow)
        return SessionsSnapshot(rows=session_rows(running, ended, self.clock()),
                                states=session_states(running, len(self.by_id) - len(self._open)),
                                started={p: self.counters.get(f"started_{p.value}", 0) for p in Policy},
                                counters={**self.counters, "blocks_superseded": self.pool.superseded_blocks,
                                          "blocks_superseded_in_flight": self.pool.superseded_in_flight},
                                orphans=len(self.pool.orphans),
                                outstanding_staging=self.pool.staged_blocks())
