"""The prefetch session lifecycle as a pure state machine: events in, actions out.

No I/O, no clock of its own (every event carries ``now``), no knowledge of pools or
L3 — in the spirit of h11: typed events in (:meth:`Session.handle`), typed actions out
(the vocabulary, data only, is :mod:`kvsidecar.sidecar.prefetch.events`).
Which event each state accepts is one explicit table, :data:`TRANSITIONS` ((state, event
type) → ``LEGAL`` or ``IGNORED``); a pair not in it raises :class:`IllegalTransition` (an
:class:`IllegalEvent`), as does a legal pair whose data cannot be (a chunk not in flight).  The control thread
(``kvsidecar.sidecar.prefetch.sessions``) feeds events and its executor
(``kvsidecar.sidecar.prefetch.executor``) carries out the actions.  Positions are block
indices in the request's chain.  ``cost_aware``'s rules (when to claim, what a stop keeps,
whether a query can pay) are a mixin of their own, :mod:`kvsidecar.sidecar.prefetch.machine_cost`.

::

    CREATED → QUERYING → RUNNING → (SEALED) → DRAINING → TERMINAL
                 │          │         a stop trigger: no new claims
                 │          └──────── terminal directly when nothing is in flight
                 └─────────────────── sealed while querying: DRAINING with the chunk read with
                                      the query in flight, else TERMINAL (the answer is ignored)

Guarantees (checked by the property tests):

* a chunk is claimed at most once and is dropped or published only after its read
  completed (``Drop`` / ``Publish`` never name an in-flight chunk);
* publication is in chain order: ``Publish`` always extends the contiguous prefix;
  out-of-order completions wait for their predecessors; a failed block cuts the
  prefix there and every later block is dropped;
* ``Finish`` is emitted exactly once, when sealed (or done) and nothing is in flight;
  later events are ignored;
* with ``chunk_max_blocks`` ≥ the span (and always for ``wait_complete``) the whole
  span is one claim;
* ``cost_aware`` claims a chunk only while :func:`kvsidecar.sidecar.prefetch.cost.next_claim` says it
  lowers the request's expected TTFT, from the latest :class:`Outlook` an event brought
  (``Demand`` is a re-plan with the ETA at *now*, not a seal, unless the engine admits the request
  at once, ``Demand.admitted``, and restoring is dearer per block than prefill: then it seals and
  withdraws what has not started) -- and, while the request is
  queued and its engine takes what is resident (no ``fixed_hit``), whole chunks until the demand
  (:func:`kvsidecar.sidecar.prefetch.cost.queued_chunk`); when it stops claiming it seals
  with ``Status.COST`` and says (``keep_admitted``) whether chunks already claimed are still
  worth reading: the prefill they save against the wait for them behind the lane's backlog
  (reads in flight are always waited for: under load the engine serves other
  requests meanwhile, and recomputing would add to the engine's work, the bottleneck).
  ``budget_s`` (the deadline) is an optional cap, as for ``timeout``.
  While another session's probe is out (no read has measured L3), a queued session plans
  nothing on the prior and stays open (``awaiting_evidence``) until a re-plan brings the
  measurement; a scheduling candidate stops then with what it has.
  A probe (the read that teaches the estimator, claimed for its evidence, not its gain) holds a
  scheduling candidate only as long as a probe that pays would take (its blocks' prefill time):
  then it is detached (``Detach``: the read goes on without the session; the caller re-plans at
  ``probe_wake_at``) and the session seals with ``Status.COST`` on what it has.
  Started with the engine's ETA (``Start.eta_given``) and a measured L3 estimate it sends no
  L3 query when even the best case (:func:`kvsidecar.sidecar.prefetch.cost.worth_querying`)
  cannot pay: it is terminal from the start (``CREATED → TERMINAL``), holding the resident
  prefix.
* ``read_with_query`` (not ``wait_complete``, whose hit is one claim): the first chunk is
  claimed with the L3 query, as if L3 held it (for ``cost_aware`` only where the measured
  estimate says that chunk pays, never a probe, where a block's read costs at most half the
  prefill it saves, and while the read lane's backlog is under three query times), so a hit's
  first read does not wait one L3 round trip for the answer.  Nothing of it is published before the answer (a block that did
  not land may only be past the hit); the answer then fits it to the hit: blocks past it are
  dropped, not failures, and a chunk wholly past it still in flight is detached (``Detach``
  with ``withdraw``: taken back if its read has not started).
"""

from __future__ import annotations

import dataclasses

from kvsidecar.sidecar.prefetch.cost import Outlook
from kvsidecar.sidecar.prefetch.machine_cost import CLEAR_SAVING, CostRules  # noqa: F401 (re-exported)
from kvsidecar.sidecar.prefetch.events import (  # noqa: F401 (the vocabulary, re-exported)
    Policy, State, Status, Query, Claim, Publish, Drop, Detach, Finish, Start, QueryDone, ClaimShort,
    ChunkDone, ChunkWithdrawn, ChunkAbandoned, Demand, Replan, Tick, Abort, IllegalEvent,
    IllegalTransition, LEGAL, IGNORED, EVENTS, TRANSITIONS)


@dataclasses.dataclass
class Chunk:
    id: int
    start: int
    count: int
    ok: list | None = None  # None while in flight
    valid: int | None = None  # read with the query past L3's hit: only its first ``valid`` blocks count


@dataclasses.dataclass(frozen=True)
class Params:
    policy: Policy
    total: int  # blocks in the chain
    resident: int  # leading blocks resident when the session started
    chunk_max_blocks: int
    window: int = 2
    deadline: float | None = None  # timeout policy: bounds new claims, not the drain
    checkpoint_every: int = 0  # 0: every block boundary is valid
    checkpoints: frozenset = frozenset()  # explicit block indices whose end is a valid stop
    outlook: Outlook | None = None  # cost_aware: the cost inputs at start (required for it)
    # cost_aware: the engine fetches exactly the hit it is told when the query answers (``planned``:
    # SGLang's batch_exists), so a block read beyond that plan cannot help this request: nothing
    # past it is claimed, neither a chunk while queued nor a later plan that would reach further
    fixed_hit: bool = False
    # the first chunk is claimed with the L3 query (see the module docstring)
    read_with_query: bool = False


class Session(CostRules):
    def __init__(self, params: Params):
        p = params
        if p.policy == Policy.WAIT_COMPLETE:
            p = dataclasses.replace(p, chunk_max_blocks=max(p.total, 1), window=1, deadline=None)
        if p.chunk_max_blocks <= 0 or p.window <= 0:
            raise ValueError("chunk_max_blocks and window must be positive")
        if p.policy == Policy.COST_AWARE and p.outlook is None:
            raise ValueError("cost_aware needs an Outlook")
        self.p = p
        self.state = State.CREATED
        self.status: Status | None = None
        self.reason = ""
        self.published = p.resident  # contiguous resident prefix this session vouches for
        self.target = p.resident  # end of the L3 hit range
        self.next_pos = p.resident
        self.chunks: dict[int, Chunk] = {}  # claimed and not yet resolved, by id
        self._ids = 0
        self.sealed = False
        self.cut = False  # a block failed: nothing after it can be published
        self.prefix = None
        self.now = 0.0  # the clock of the event being handled
        self._init_cost(p)  # cost_aware's bookkeeping (machine_cost)
        self.with_query = -1  # the chunk claimed with the L3 query (read_with_query), or -1

    # -- helpers --------------------------------------------------------------------------------
    @property
    def planned(self) -> int:
        """Where this session means to restore to: the end of the L3 hit for every policy but
        cost_aware, whose current plan may stop short of it (never below what it claimed as
        part of a plan; a chunk read beyond the plan while queued is not in it).
        An engine that fetches the hit itself (SGLang's ``batch_exists``) is told this, so it
        does not wait for blocks the policy will not read."""
        if self.p.policy != Policy.COST_AWARE or self.state in (State.CREATED, State.QUERYING):
            return self.target
        return min(self.target, max(self.plan_claimed, self.plan_end))

    @property
    def pending_blocks(self) -> int:
        """Blocks claimed whose read has not landed (in flight or still queued)."""
        return sum(c.count for c in self.chunks.values() if c.ok is None)

    @property
    def in_flight(self) -> int:
        return sum(1 for c in self.chunks.values() if c.ok is None)

    def valid_prefix(self, n: int) -> int:
        """Largest prefix length <= n that ends on a complete checkpoint."""
        p = self.p
        if p.checkpoint_every:
            return n - n % p.checkpoint_every
        if p.checkpoints:
            best = 0
            for i in p.checkpoints:
                if i + 1 <= n and i + 1 > best:
                    best = i + 1
            return best
        return n

    def _seal(self, status: Status, reason: str = "") -> None:
        if not self.sealed:
            self.sealed = True
            self.status = status
            self.reason = reason

    def _claims(self) -> list:
        out = []
        if self.sealed or self.cut or self.state != State.RUNNING:
            return out
        cost_aware = self.p.policy == Policy.COST_AWARE
        if cost_aware and self._probe_holds_candidate():
            return self._detach_probe()
        if cost_aware and self.next_pos >= self.target and self.in_flight:
            # everything is claimed: what is still in flight is reviewed like a stop (a read
            # that would land after the prefill could start, at a cost above recomputing, is
            # withdrawn if it has not started) -- a demand must not wait for queued reads
            self._cost_claim(commit=False)
            return out
        while self.next_pos < self.target and (self.in_flight < self.p.window or cost_aware):
            n = min(self.p.chunk_max_blocks, self.target - self.next_pos)
            if cost_aware:
                # decided even with a full window: a stop must not wait for a free slot
                n = self._cost_claim(commit=self.in_flight < self.p.window)
                if n == 0:
                    break
            c = Chunk(self._ids, self.next_pos, n)
            self._ids += 1
            self.chunks[c.id] = c
            self.next_pos += n
            out.append(Claim(c.id, c.start, n))
            if cost_aware and self._probe_holds_candidate():
                return out + self._detach_probe()  # claimed for the estimate, not for this request
        return out

    def _advance(self) -> list:
        """Publish what is publishable in order, drop what a cut strands, maybe finish."""
        out = []
        for c in sorted(self.chunks.values(), key=lambda c: c.start):
            if c.ok is None:
                if not self.cut:
                    break  # an earlier chunk is in flight: later ones wait
                continue
            if self.cut:
                out.append(Drop(c.id, 0))
                del self.chunks[c.id]
                continue
            if c.start != self.published:
                break
            limit = c.count if c.valid is None else c.valid  # (past L3's hit: not a failure)
            k = 0
            while k < limit and c.ok[k]:
                k += 1
            if k:
                out.append(Publish(c.id, k))
                self.published += k
            if k < c.count:
                out.append(Drop(c.id, k))
            if k < limit:
                self.cut = True
                self._seal(Status.FAILED, "block read failed")
            del self.chunks[c.id]
        out += self._claims()
        out += self._maybe_finish()
        return out

    def _maybe_finish(self) -> list:
        if self.state == State.TERMINAL:
            return []
        done_naturally = self.state == State.RUNNING and self.next_pos >= self.target and not self.chunks
        if not (self.sealed or done_naturally) or self.in_flight:
            if self.sealed and self.state in (State.RUNNING, State.QUERYING) and self.in_flight:
                self.state = State.DRAINING  # (from QUERYING: the chunk read with the query)
            return []
        # (a session sealed while QUERYING without a chunk in flight ends at once; the late
        # query answer is then ignored)
        if not self.sealed:
            self._seal(Status.COMPLETE if self.published >= self.target else Status.FAILED)
        # leftovers resolved but unpublishable (e.g. sealed with a gap) are dropped
        out = [Drop(c.id, 0) for c in sorted(self.chunks.values(), key=lambda c: c.start)]
        self.chunks.clear()
        self.state = State.TERMINAL
        self.prefix = self.valid_prefix(self.published)
        return out + [Finish(self.status, self.prefix, self.reason)]

    # -- events ---------------------------------------------------------------------------------
    def handle(self, event) -> list:
        """Feed one event; returns the actions to carry out (in order).

        The pair (state, event type) must be in :data:`TRANSITIONS` (else
        :class:`IllegalTransition`); ``IGNORED`` pairs (late events after TERMINAL) return no
        action.
        """
        try:
            on = self._HANDLERS[type(event)]
        except KeyError:
            raise IllegalEvent(f"not a session event: {event!r}") from None
        rule = TRANSITIONS.get((self.state, type(event)))
        if rule is None:
            raise IllegalTransition(self.state, event)
        self.now = event.now
        if rule is IGNORED:
            return []
        return on(self, event)

    def _pending(self, chunk: int, what: str) -> Chunk:
        c = self.chunks.get(chunk)
        if c is None or c.ok is not None:
            raise IllegalEvent(f"{what} for chunk {chunk}, which is not in flight")
        return c

    def _on_start(self, e: Start) -> list:
        if self.p.resident >= self.p.total:
            self.state = State.RUNNING
            return self._maybe_finish()
        if (self.p.policy == Policy.COST_AWARE and e.eta_given and not self.outlook.unmeasured
                and not self._query_pays(e.now)):
            # (unmeasured: another session's probe is out and lands before this query answers;
            # its estimate decides then — ending now would restore nothing until the next request)
            self.state = State.RUNNING  # (no query out: it ends now, holding only what is resident)
            self._seal(Status.COST, "cost")
            return self._maybe_finish()
        self.state = State.QUERYING
        self.query_asked_at = e.now
        return [Query(self.p.resident)] + self._claim_with_query()

    @property
    def _reads_beside_query(self) -> bool:
        """``read_with_query`` applies: not ``wait_complete`` (one claim); for ``cost_aware``,
        :meth:`CostRules._cost_reads_beside_query`."""
        p = self.p
        if not p.read_with_query or p.policy == Policy.WAIT_COMPLETE:
            return False
        return p.policy != Policy.COST_AWARE or self._cost_reads_beside_query

    def _claim_with_query(self) -> list:
        """``read_with_query``: claim the first chunk now, as if L3 held it (the query's answer
        fits it to the hit).  ``cost_aware`` claims it only on a measured estimate, where its
        plan for the whole chain starts with it -- never a probe, which is planned on the answer."""
        p = self.p
        if not self._reads_beside_query:
            return []
        n = min(p.chunk_max_blocks, p.total - p.resident)
        if p.policy == Policy.COST_AWARE:
            n = self._cost_first_claim()
            if n <= 0:
                return []
        c = Chunk(self._ids, p.resident, n)
        self._ids += 1
        self.chunks[c.id] = c
        self.next_pos = c.start + n
        self.with_query = c.id
        return [Claim(c.id, c.start, n)]

    def _fit_to_hit(self) -> list:
        """The query answered: the chunk read with it counts only up to L3's hit.  One wholly
        past the hit and still in flight is detached (taken back if its read has not started)."""
        c = self.chunks.get(self.with_query)
        if c is None or c.start + c.count <= self.target:
            return []
        if self.target <= c.start and c.ok is None:
            del self.chunks[c.id]
            self.next_pos = c.start
            return [Detach(c.id, withdraw=True)]
        c.valid = max(0, self.target - c.start)
        return []

    def _on_query_done(self, e: QueryDone) -> list:
        self.target = min(self.p.total, self.p.resident + max(e.hits, 0))
        self.state = State.RUNNING
        self._new_outlook(e.outlook)
        out = self._fit_to_hit()
        if self.target == self.p.resident and not self.sealed:
            self._seal(Status.NO_HIT)
        if self.p.deadline is not None and e.now >= self.p.deadline:
            self._seal(Status.TIMEOUT, "deadline")
        out += self._advance()
        if self.p.fixed_hit and self.p.policy == Policy.COST_AWARE:
            self.hit_cap = self.planned  # what the engine is told now is all it will ever fetch
        return out

    def _on_claim_short(self, e: ClaimShort) -> list:
        """The executor reserved only ``granted`` of the claimed blocks (a limit): shrink, stop claiming."""
        c = self._pending(e.chunk, "ClaimShort")
        if not 0 <= e.granted < c.count:
            raise IllegalEvent(f"ClaimShort {e.granted} of a {c.count}-block claim")
        if e.granted == 0:
            del self.chunks[e.chunk]
            self.next_pos = c.start
        else:
            c.count = e.granted
            if c.valid is not None:  # (read with the query, fitted to L3's hit before the shrink)
                c.valid = min(c.valid, c.count)
            self.next_pos = c.start + e.granted
        self.target = self.next_pos
        self._seal(Status.LIMIT, "limit")  # over a budget: stop claiming, end with what it has
        self.keep_admitted = self.status == Status.LIMIT  # a capacity stop reads what was admitted
        return self._advance()

    def _on_chunk_done(self, e: ChunkDone) -> list:
        c = self._pending(e.chunk, "ChunkDone")
        if len(e.ok) != c.count:
            raise IllegalEvent(f"chunk {e.chunk}: {len(e.ok)} results for {c.count} blocks")
        c.ok = list(e.ok)
        self._new_outlook(e.outlook)
        if self.p.deadline is not None and e.now >= self.p.deadline:
            self._seal(Status.TIMEOUT, "deadline")
        if self.state == State.QUERYING and not self.sealed:
            return []  # read with the query: published once the answer says how much L3 holds
        return self._advance()

    def _on_withdrawn(self, e) -> list:
        """After a stop: a chunk whose read never started was withdrawn from the sender, or one
        still in flight was left behind when the drain budget ran out (the pool manager keeps its
        blocks staging until the read really ends).  Either way its positions are not part of
        the result.  Only legal once sealed (DRAINING: see :data:`TRANSITIONS`)."""
        self._pending(e.chunk, type(e).__name__)
        del self.chunks[e.chunk]
        return self._advance()

    def _on_demand(self, e: Demand) -> list:
        if self.p.policy == Policy.COST_AWARE:
            if e.outlook is None:
                raise IllegalEvent("Demand for a cost_aware session without an Outlook")
            self._new_outlook(e.outlook)
            if not e.admitted or self.reads_outlast_admission:
                return self._on_replan(Replan(e.now, e.outlook))
            self._seal(Status.COST, "admitted")  # (an earlier stop keeps its own status)
            self.keep_admitted = False  # withdraw what has not started: it cannot land in time
            return self._advance()
        if self.p.policy != Policy.BEST_EFFORT:
            return []  # demand is a normal engine event; only best_effort stops on it
        self._seal(Status.DEMANDED, "demand")
        return self._advance()

    def _on_replan(self, e: Replan) -> list:
        if self.p.policy != Policy.COST_AWARE:
            return []
        self._new_outlook(e.outlook)
        # (with a chunk read with the query, the start's plan chose it: the answer re-plans it --
        # the lane's backlog now counts that read, so the best case below would count it twice)
        if (self.state == State.QUERYING and not self.sealed and not self.chunks
                and not self._query_pays(e.now, self.query_asked_at)):
            self._seal(Status.COST, "cost")  # nothing the answer could bring would pay: end now
            return self._advance()  # (what the chunk read with the query landed is kept)
        if self.state != State.RUNNING or self.sealed:
            return []  # still querying (the answer re-plans) or already stopping
        return self._advance()

    def _on_tick(self, e: Tick) -> list:
        if self.state == State.CREATED or self.p.deadline is None or e.now < self.p.deadline:
            return []  # a timer may fire early or for a session without a deadline
        self._seal(Status.TIMEOUT, "deadline")
        return self._advance()

    def _on_abort(self, e: Abort) -> list:
        self._seal(Status.ABORTED, "abort")
        self.status, self.reason = Status.ABORTED, "abort"  # abort wins over an earlier trigger
        if self.state == State.CREATED:
            self.state = State.RUNNING
        return self._advance()

    def chunk_pending(self, chunk: int) -> bool:
        """True while ``chunk`` is claimed and its results are not in."""
        c = self.chunks.get(chunk)
        return c is not None and c.ok is None

    _HANDLERS = {Start: _on_start, QueryDone: _on_query_done, ClaimShort: _on_claim_short,
                 ChunkDone: _on_chunk_done, ChunkWithdrawn: _on_withdrawn, ChunkAbandoned: _on_withdrawn,
                 Demand: _on_demand, Replan: _on_replan, Tick: _on_tick, Abort: _on_abort}
