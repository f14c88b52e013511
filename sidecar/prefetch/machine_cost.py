"""cost_aware's rules in the session machine (:mod:`kvsidecar.sidecar.prefetch.machine`).

:class:`CostRules` is a mixin of :class:`~kvsidecar.sidecar.prefetch.machine.Session`: the
machine keeps the lifecycle (states, chunks, publication order, the transition table) and asks
these rules when it may claim, what a stop keeps, and whether an L3 query can pay; the
arithmetic is :mod:`kvsidecar.sidecar.prefetch.cost`.  Pure, like the machine: no I/O, no clock
(``self.now`` is the event's).

What the rules own (initialised by :meth:`CostRules._init_cost`): the latest
:class:`~kvsidecar.sidecar.prefetch.cost.Outlook`, when what is claimed is expected to land
(``expected_end``) and the read time claimed since the outlook (``queued_s``), which chunks have
reads of their own (``own_reads``; the others only await another session's read), the plan's reach
(``plan_end``, ``plan_claimed``: :attr:`Session.planned`), the probe (``probe_chunk``,
``probe_deadline``), ``keep_admitted`` after a cost stop and ``hit_cap`` (``fixed_hit``).
What they use of the session: ``p``, ``now``, ``state``, ``sealed``, ``target``, ``next_pos``,
``chunks``, ``_ids``, ``in_flight``, ``pending_blocks``, ``chunk_pending``,
``_reads_beside_query`` and ``_seal`` (a cost stop).

Invariants (the machine's property tests check them with these rules in place):

* a claim is only made where :func:`cost.plan` says it lowers the request's expected TTFT (or,
  queued and without ``fixed_hit``, a whole chunk up to the demand: :func:`cost.queued_chunk`),
  and its bookkeeping (:meth:`_commit_claim`) is done exactly once per claim;
* a decision of "nothing more" seals with ``Status.COST`` -- except while a probe is out, while
  what is in flight still pays (decided again when it lands), or while the session awaits
  another session's measurement; a claim decision never seals before the L3 query's answer
  set the target (the chunk read beside the query is decided on a provisional target,
  :meth:`_cost_first_claim`) -- the one stop before the query is :meth:`_query_pays` at the
  start, where not even the best case could pay;
* a probe (claimed for the estimator's evidence) holds a scheduling candidate no longer than a
  probe that pays would take (``probe_deadline``); then it is detached and the session seals.
"""

from __future__ import annotations

from kvsidecar.sidecar.prefetch import cost
from kvsidecar.sidecar.prefetch.cost import Outlook
from kvsidecar.sidecar.prefetch.events import Detach, Policy, State, Status

# cost_aware reads its first chunk with the L3 query only where a restore clearly pays
# (cost.CLEAR_SAVING), and while the read lane's backlog estimate is under this many L3 query times
# (see CostRules._cost_reads_beside_query)
CLEAR_SAVING = cost.CLEAR_SAVING
BESIDE_QUERY_BACKLOG = 3.0


class CostRules:
    def _init_cost(self, p) -> None:
        self.outlook = p.outlook
        self.query_asked_at: float | None = None  # when the L3 existence query was sent
        self.expected_end = 0.0  # when what is claimed is expected to land
        self.queued_s = 0.0  # read time claimed since the outlook was taken (not in its backlog)
        self.claimed_any = False
        self.probe_deadline = 0.0  # a candidate waits for its probe until then (see probe_wake_at)
        self.probe_chunk = -1  # the first claim was a probe (read for the estimate: planned on the prior, or no gain)
        self.plan_end = p.resident  # where the last cost decision meant to restore to (``planned``)
        self.plan_claimed = p.resident  # the end of what was claimed as part of a plan
        self.keep_admitted = False  # after the seal: chunks already claimed are still read
        self.hit_cap: int | None = None  # fixed_hit: the hit the engine was told (nothing is read past it)
        self.own_reads: set = set()  # chunks claimed with blocks of its own to read (not only awaited ones)

    def _query_pays(self, now: float, asked_at: float | None = None) -> bool:
        """cost_aware: could the L3 query's answer lead to a read — one that lowers TTFT
        (:func:`cost.worth_querying`; at the start, with ``read_with_query``, the first read goes
        out beside the query), or, queued, the chunk read beyond the plan?"""
        remaining, chunk = self.p.total - self.p.resident, self.p.chunk_max_blocks
        beside = self.state == State.CREATED and self._reads_beside_query
        if cost.worth_querying(self.outlook, now, remaining, chunk, asked_at, read_with_query=beside,
                               hide_behind_queue=not self.p.fixed_hit,
                               awaited=self.outlook.awaited(self.p.resident, remaining)):
            return True
        return not self.p.fixed_hit and cost.queued_chunk(self.outlook, now, remaining, chunk) > 0

    def _awaits_evidence(self, o: Outlook) -> bool:
        """cost_aware, queued, nothing claimed: while no read has measured L3 (another session's
        probe is out) the session neither plans on the prior nor gives up its queue time; it
        stays open for the Replan the measurement brings.  A scheduling candidate does not wait."""
        return o.unmeasured and not o.probe_blocks and not self.claimed_any and o.eta > self.now

    @property
    def awaiting_evidence(self) -> bool:
        """Open only for an L3 measurement (the session manager re-plans it when one lands)."""
        return (self.p.policy == Policy.COST_AWARE and self.state == State.RUNNING and not self.sealed
                and not self.chunks and self.next_pos < self.target and self._awaits_evidence(self.outlook))

    def _probe_holds_candidate(self) -> bool:
        """cost_aware: the probe is in flight past the time a probe that pays would have landed
        (``probe_deadline``: its blocks' prefill time), and the request's prefill could start now."""
        return (self.chunk_pending(self.probe_chunk) and self.outlook.eta <= self.now
                and self.now >= self.probe_deadline)

    @property
    def probe_wake_at(self) -> float | None:
        """When a re-plan must come (a timer of the caller's) so that a scheduling candidate
        stops waiting for a probe that does not pay: None when no probe is pending."""
        if self.p.policy != Policy.COST_AWARE or self.sealed or not self.chunk_pending(self.probe_chunk):
            return None
        return self.probe_deadline

    def _detach_probe(self) -> list:
        """Let the probe's read go on without the session (it was claimed for the estimator, and a
        scheduling candidate must not wait for it), and stop: nothing is planned on the prior,
        and blocks after the probe could not be published in order without it."""
        c = self.chunks.pop(self.probe_chunk)
        self.next_pos = c.start
        self._seal(Status.COST, "cost")
        self.keep_admitted = False
        return [Detach(c.id)]

    def _cost_decision(self) -> tuple[int, int, float]:
        """cost_aware's next claim as the lane stands now, without side effects: ``(n, planned,
        current_end)`` -- the next chunk's size (0: claim nothing now), how far the plan reaches
        past ``next_pos``, and when what is in flight is expected to land."""
        o, now = self.outlook, self.now
        current_end = self._claims_land(now + o.backlog_s)
        end = self.target if self.hit_cap is None else min(self.target, self.hit_cap)
        planned = cost.plan(o, now, end - self.next_pos, self.p.chunk_max_blocks, current_end,
                            self.claimed_any, self.queued_s, hide_behind_queue=not self.p.fixed_hit,
                            awaited=o.awaited(self.next_pos, end - self.next_pos))
        n = min(planned, cost.chunk_size(o, self.p.chunk_max_blocks))
        if not self.p.fixed_hit:
            # queued, a whole chunk is read even where the plan (what lands by the ETA) ends
            # inside it: the chunk beyond the plan would be read next anyway, and cutting reads
            # at an estimate only adds a read's latency (measured under load: p90 1.08x best_effort)
            n = max(n, cost.queued_chunk(o, now, self.target - self.next_pos, self.p.chunk_max_blocks))
        return n, planned, current_end

    def _cost_claim(self, commit: bool) -> int:
        """cost_aware: the next chunk's size, or 0 (after sealing with Status.COST when the
        next chunk would not pay; without sealing when it would but the window is full)."""
        o, now = self.outlook, self.now
        if self.chunk_pending(self.probe_chunk):
            return 0  # a probe is out: decide once its read has measured L3
        n, planned, current_end = self._cost_decision()
        # (a plan of nothing more ends where the plan's claims end: not at a chunk read beyond it)
        self.plan_end = self.next_pos + planned if planned else self.plan_claimed
        if n == 0 and self._awaits_evidence(o):
            return 0  # another session's probe is out: its measurement decides (Replan), not the prior
        if n == 0:
            # what is claimed lands when the lane's work up to it is done, as the lane stands
            # now (its backlog counts this session's pending reads; ``queued_s``: those claimed
            # since) -- not the estimate made at the claim, which is stale once reads land early
            pending_end = self._claims_land(now + o.backlog_s + self.queued_s, floor_at_claim=False)
            keep = cost.keep_admitted(o, now, pending_end, self.pending_blocks)
            if keep and self.in_flight:
                return 0  # what is in flight still pays: decide again when it lands (a later ETA may)
            self._seal(Status.COST, "cost")
            self.keep_admitted = keep  # False: withdraw what has not started
            return 0
        if not commit:
            return 0
        if not self.claimed_any and o.probe_blocks and (
                o.unmeasured or cost.gain(o, now, n, current_end, self.queued_s,
                                          awaited=o.awaited(self.next_pos, n)) <= 0):
            self.probe_chunk = self._ids  # the id the claim gets
            # a probe that pays (L3 cheaper than prefill, latency included) lands by then
            self.probe_deadline = now + n * o.saving_per_block
        self._commit_claim(n, planned, current_end)
        return n

    def _claims_land(self, lane_end: float, floor_at_claim: bool = True) -> float:
        """When what this session claimed and is still in flight lands (``now`` when nothing is):
        a read of its own, once the lane has done its work up to it (``lane_end``: the lane's
        backlog counts this session's own reads, last among equals), with ``floor_at_claim``
        never before the estimate made when it was claimed (``expected_end``); reads it only
        awaits (another session's: no lane work of its own), when that estimate said."""
        if not self.in_flight:
            return self.now
        if any(c.ok is None and c.id in self.own_reads for c in self.chunks.values()):
            return max(self.expected_end, lane_end) if floor_at_claim else lane_end
        return self.expected_end

    def _commit_claim(self, n: int, planned: int, current_end: float) -> None:
        """The bookkeeping of a cost_aware claim of ``n`` blocks at ``next_pos``."""
        o, now = self.outlook, self.now
        self.claimed_any = True
        self.plan_claimed = max(self.plan_claimed, self.next_pos + min(n, planned))
        awaited = o.awaited(self.next_pos, n)  # (another session's read: no lane time of ours)
        land = cost.lands(o, now, n, current_end, self.queued_s, awaited=awaited)
        if n > awaited:
            self.queued_s += o.l3_latency_s + (n - awaited) * o.l3_s_per_block
            self.own_reads.add(self._ids)  # (the id the claim gets)
        self.expected_end = max(current_end, land)

    def _cost_first_claim(self) -> int:
        """cost_aware, ``read_with_query``: the first chunk to read beside the L3 query -- the one
        its plan for the whole chain starts with, as if L3 held all of it (0: none; the answer
        plans).  Committed here (its bookkeeping) only when it is claimed; nothing is sealed:
        the target is only provisional until the answer."""
        self.target = self.p.total  # (for this one decision: the answer sets the target)
        try:
            n, planned, current_end = self._cost_decision()
            if n > 0:
                self.plan_end = self.next_pos + planned
                self._commit_claim(n, planned, current_end)
        finally:
            self.target = self.p.resident
        return n

    @property
    def _cost_reads_beside_query(self) -> bool:
        """cost_aware reads its first chunk beside the L3 query only on a measured estimate (never
        a probe), where restoring clearly pays per block (at most ``CLEAR_SAVING`` of the prefill
        it saves: its reads are then what the request waits for; dearer, it reads only what hides
        behind the queue, which gains nothing from starting a round trip sooner -- measured under
        load, p50 1.04-1.08x -- and near break-even the round trip saved is worth little while a
        read started early holds the shared lane: p90 1.2-1.3x measured at L3/prefill 1 under
        load), and while the read lane's backlog estimate is under ``BESIDE_QUERY_BACKLOG``
        query times.  Past that the claim adds to a lane already saturated and the request's
        read, last by age, waits behind it (under a burst: for a tail it would have
        recomputed).  The estimate is an upper one (every read not finished counts whole, the
        one in progress too, and reads on parallel lanes add up), so the bound is three query
        times, not one: measured at L3/prefill 0.32 under 0.9 load, two request streams, 9
        interleaved trials per TP size, against a bound of one query time: p50 0.85-0.87x, p90
        0.98-1.02x; with no bound at all p90 went to 1.02-1.11x."""
        o = self.outlook
        return (not (o.unmeasured or o.probe_blocks) and o.restore_clearly_pays
                and o.backlog_s < BESIDE_QUERY_BACKLOG * (o.query_s or o.l3_latency_s))

    def _new_outlook(self, o) -> None:
        if o is not None and self.p.policy == Policy.COST_AWARE:
            self.outlook = o
            self.queued_s = 0.0  # the new backlog counts what was claimed before it

    @property
    def reads_outlast_admission(self) -> bool:
        """cost_aware's reads are cheaper per block than prefill: worth the engine's next
        admission (the recompute they save outweighs a late start), so an engine's admission
        neither stops them (``Demand.admitted``) nor bounds their drain (``demand`` with
        ``drain_s``)."""
        return self.outlook is not None and self.outlook.restore_pays_per_block
