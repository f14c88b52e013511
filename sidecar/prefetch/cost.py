"""The ``cost_aware`` policy's arithmetic: is restoring the next chunk worth its time?

Pure functions over an :class:`Outlook` (what the executor knows when the machine decides):
no clock, no I/O.  The request's prefill can start at ``eta`` (the engine's estimate; *now*
when it is a scheduling candidate).  Restoring ``k`` more blocks lands them at

    land(k) = max(now + backlog, current_end) + latency + k x s_per_block

(``backlog``: the read-lane work queued ahead; ``current_end``: when this session's own claims
land — one lane reads in order), and the prefill then starts at
``max(eta, land)`` instead of ``max(eta, land_current)`` (when what is already claimed lands).
It saves ``k x (prefill_s_per_block - load_s_per_block)`` of prefill, for the request itself and
for each of the ``waiting`` queued requests its prefill would hold up (:attr:`Outlook.saving_per_block`: the
engine is the one shared resource a queue waits on; a read holds only the L3 lane, and a
scheduler that skips a request still reading serves the others meanwhile).  A chunk is claimed only
while the saving exceeds the delay, which is exactly the marginal form of the serial optimum
``min_k max(eta, land(k)) + prefill(n - k)`` for a linear transfer cost:

* restore cheaper per block than prefill: keep claiming (every chunk pays for itself);
* restore dearer: claim what lands before ``eta`` (hidden behind the queue); and while the
  request is still queued (``eta`` later than now) whole chunks beyond it
  (:func:`queued_chunk`), because the ETA is only an estimate and a queued read costs nothing
  until the request is a candidate; the demand (ETA now) stops it, and keeps what is claimed
  only where the prefill it saves exceeds the wait for it (:func:`keep_admitted`).  Not for an
  engine that waits for the whole hit it was told (SGLang's ``fixed_hit``): there a dearer
  restore is never planned (:func:`hides_behind_queue`).

Chunk size bounds the regret of a stop: a wrong decision costs at most one chunk's transfer.

Blocks another session is already reading (a request of the same prompt ahead of this one) are
not read again: a claim awaits that read.  They land when it does (``Outlook.awaited_at``) and
take no lane time, so the plans are priced with them apart (``awaited``): restoring just them is
a plan, and the reads of a plan are only of the blocks past them.

While the L3 existence query is still out, a scheduling candidate is blocked on it:
:func:`worth_querying` ends the session at once (``Status.COST``) when even the best case
(L3 holds every remaining block, the query answers ``query_s`` after it was sent) cannot lower TTFT — a pool
hit with a short tail, or an L3 dearer than prefill with no queue to hide behind.  Without
evidence about L3 (``probe_blocks``) it keeps waiting: the probe is how the estimator learns.
"""

from __future__ import annotations

import dataclasses
import math


def block_saving(prefill_s_per_block: float, load_s_per_block: float, waiting: float) -> float:
    """:attr:`Outlook.saving_per_block` from its inputs (also for a decision taken before the
    outlook is built: ``estimates.outlook``'s backlog rule)."""
    return (prefill_s_per_block - load_s_per_block) * (1 + waiting)


@dataclasses.dataclass(frozen=True)
class Outlook:
    """The cost inputs at one instant (seconds; ``eta`` and times on the machine's clock)."""

    eta: float  # when the request's prefill can start (now for a scheduling candidate)
    prefill_s_per_block: float  # the engine's prefill cost of one block (0: unknown)
    l3_latency_s: float  # per read: fixed cost of one L3 call
    l3_s_per_block: float  # per block: bytes / bandwidth
    backlog_s: float = 0.0  # read-lane work ahead of this session's next chunk (its own pending reads too)
    load_s_per_block: float = 0.0  # copying a restored block into the engine
    probe_blocks: int = 0  # the L3 estimate has no evidence yet: one small chunk may be read to learn it
    query_s: float = 0.0  # how long an L3 existence query takes (measured; 0: unknown)
    unmeasured: bool = False  # the L3 estimate is still the configured prior (no read has landed)
    # requests this one's prefill holds up, each by as long (a read does not): the queue behind
    # it, and a share for each older one still reading that would be ready meanwhile
    waiting: float = 0
    # blocks another session is already reading from L3: the chain's positions up to ``awaited_to``
    # from where the next claim starts, expected to land at ``awaited_at`` (the lane's work up to
    # that session's reads).  Claimed, they are awaited, not read again (one publication serves
    # both): they cost this session no lane time, only the wait for that read
    awaited_to: int = 0
    awaited_at: float = 0.0

    def __post_init__(self):
        for f in ("prefill_s_per_block", "l3_latency_s", "l3_s_per_block", "backlog_s", "load_s_per_block",
                  "query_s"):
            v = getattr(self, f)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"Outlook.{f} must be a finite non-negative number, not {v!r}")
        if not (isinstance(self.waiting, (int, float)) and self.waiting >= 0 and math.isfinite(self.waiting)):
            raise ValueError(f"Outlook.waiting must be a finite non-negative number, not {self.waiting!r}")
        if not math.isfinite(self.eta):
            raise ValueError("Outlook.eta must be finite")
        if not (isinstance(self.awaited_to, int) and self.awaited_to >= 0 and math.isfinite(self.awaited_at)):
            raise ValueError(f"Outlook.awaited_to must be a non-negative int and awaited_at finite, not "
                             f"{self.awaited_to!r} / {self.awaited_at!r}")

    def awaited(self, pos: int, remaining: int) -> int:
        """How many of the ``remaining`` blocks from chain position ``pos`` another session's
        read will land (at ``awaited_at``): a claim awaits them instead of reading them."""
        return max(0, min(remaining, self.awaited_to - pos))

    @property
    def saving_per_block(self) -> float:
        """What restoring a block instead of computing it saves, in request-seconds of TTFT: the
        request's own prefill of it, and the same for each of the ``waiting`` requests its prefill
        would hold up (the engine computes one prefill at a time, so every one of them starts that
        much later; a read runs on the L3 lane, beside the engine)."""
        return block_saving(self.prefill_s_per_block, self.load_s_per_block, self.waiting)

    @property
    def restore_pays_per_block(self) -> bool:
        """Restoring is cheaper per block than recomputing (latency aside)."""
        return self.l3_s_per_block < self.saving_per_block

    @property
    def restore_clearly_pays(self) -> bool:
        """A block's read costs at most :data:`CLEAR_SAVING` of the prefill it saves: far enough
        from break-even that the estimate moving will not flip the decision."""
        return self.l3_s_per_block <= CLEAR_SAVING * self.saving_per_block


CLEAR_SAVING = 0.5  # a restore "clearly pays" where a block's read costs at most this share of the prefill it saves
LATENCY_SHARE = 0.02  # a chunk is made large enough that its read's fixed cost is at most this share
MAX_GROWTH = 8  # ... but never more than this many times chunk_max_blocks


def chunk_size(o: Outlook, chunk_max: int) -> int:
    """The chunk to claim.  ``chunk_max`` bounds the regret of a stop; where restoring clearly
    pays per block (a block's read at most ``CLEAR_SAVING`` of the prefill it saves) a stop is
    unlikely (only a wrong estimate causes one), so the chunk grows until the per-read latency
    is a small share of it: one lane reads chunks in order and pays the latency of each.  Near
    break-even it does not grow: the estimate moves across break-even (a stop is likely), and a
    grown chunk holds the one read lane from every other session's small reads for its whole
    length -- measured in the calibrated virtual model at L3/prefill 1 under 0.9 load (seven
    request streams, three calibrations): p90 1.10-1.33x the best other arm with chunks grown to
    22 blocks, 0.70-0.93x kept at chunk_max; the 72-row sweep no worse on any row."""
    if not o.restore_clearly_pays or o.l3_s_per_block <= 0:
        return chunk_max
    k = math.ceil(o.l3_latency_s / (LATENCY_SHARE * o.l3_s_per_block))
    return max(chunk_max, min(k, MAX_GROWTH * chunk_max))


def lands(o: Outlook, now: float, blocks: int, current_end: float, queued_s: float = 0.0,
          reads: int = 1, awaited: int = 0) -> float:
    """When ``blocks`` claimed now (in ``reads`` reads) land: behind the lane's backlog (and
    what this session claimed since ``o`` was taken, ``queued_s``), never before its own claims
    land (one lane reads in order).  The first ``awaited`` of them are another session's read
    (:meth:`Outlook.awaited`): they land at ``o.awaited_at`` and take no lane time."""
    if awaited:
        own = blocks - min(blocks, awaited)
        if not own:
            return max(current_end, o.awaited_at)
        return max(o.awaited_at, lands(o, now, own, current_end, queued_s, reads))
    base = max(now + o.backlog_s + queued_s, current_end)
    return base + reads * o.l3_latency_s + blocks * o.l3_s_per_block


def gain(o: Outlook, now: float, blocks: int, current_end: float, queued_s: float = 0.0,
         reads: int = 1, awaited: int = 0) -> float:
    """Seconds of TTFT saved by restoring ``blocks`` more (negative: it would cost)."""
    start_now = max(o.eta, current_end)
    start_then = max(start_now, lands(o, now, blocks, current_end, queued_s, reads, awaited))
    return blocks * o.saving_per_block - (start_then - start_now)


def plan(o: Outlook, now: float, remaining: int, chunk_max: int, current_end: float,
         claimed_before: bool, queued_s: float = 0.0, hide_behind_queue: bool = True, awaited: int = 0) -> int:
    """How many more blocks the policy means to restore now (0: none), over several chunks.

    Plans compared: restore everything that remains (in chunks: the wait for the lane is paid
    once for all of it), one more chunk, and the most that still lands by ``eta``; the plan
    with the best positive gain wins.  ``current_end``: when what this session already claimed
    is expected to land (``now`` when nothing is in flight).  Without evidence about L3
    (``unmeasured``) nothing is planned on the prior: only a probe (``probe_blocks``), by a
    session that has claimed nothing yet.
    This is what an engine that fetches the hit itself is told the hit is (``planned`` in the
    session's view): more may follow only if a later decision finds it pays.
    ``hide_behind_queue`` False (an engine that waits for the whole hit it was told, SGLang's
    ``fixed_hit``): a restore dearer per block than prefill is never planned, not even what
    would land before ``eta`` — see :func:`hides_behind_queue`.
    ``awaited``: the first so many of the ``remaining`` blocks are another session's read
    (:meth:`Outlook.awaited`); restoring just them is a plan too, and the reads of a plan are
    only of the blocks past them.
    """
    cap = min(remaining, chunk_size(o, chunk_max))
    if cap <= 0:
        return 0
    if o.unmeasured or not hides_behind_queue(o, hide_behind_queue):
        # The prior is a guess (measured: 40x off at 2 Mbit/s), and what is planned on it is
        # read in full, ahead of every later session.  So nothing is planned on it: one session
        # probes (``probe_blocks``: the lane was idle), the others restore nothing until it lands.
        # Likewise a dearer restore an engine with a fixed hit would wait for in full.
        return min(cap, o.probe_blocks) if o.probe_blocks and not claimed_before else 0
    awaited = min(awaited, remaining)
    plans = {cap, remaining}
    if 0 < awaited < remaining:
        plans.add(awaited)
    if o.l3_s_per_block > 0:
        base = max(now + o.backlog_s + queued_s, current_end) + o.l3_latency_s
        fit = awaited + math.floor((o.eta - base) / o.l3_s_per_block)
        if 0 < fit < remaining:
            plans.add(fit)
    best, best_gain = 0, 0.0
    for k in sorted(plans, reverse=True):
        g = gain(o, now, k, current_end, queued_s, reads=-(-max(0, k - awaited) // cap), awaited=awaited)
        if g > best_gain:
            best, best_gain = k, g
    if best == 0 and o.probe_blocks and not claimed_before:
        return min(cap, o.probe_blocks)
    return best


def hides_behind_queue(o: Outlook, allowed: bool) -> bool:
    """May a restore be planned at all?  Always where it pays per block; dearer than prefill, only
    where a read that lands before ``eta`` costs nothing (``allowed``).  An engine that waits
    for the whole hit it was told (SGLang's ``fixed_hit``: ``wait_complete`` on the planned
    pages) pays the read's whole remaining time when the ETA was early, and its storage
    threads serve requests in order, so the requests behind wait too: measured in genuine
    SGLang at 8 Mbit/s (a block's read ~16 ms against ~0.5 ms of prefill), the 11 trials where
    cost_aware read 8-24 blocks had TTFT p90 455-1,137 ms (median 743); the 39 where it read
    nothing, 112-506 (median 208); no_prefetch's 32, median 138."""
    return allowed or o.restore_pays_per_block


def queued_chunk(o: Outlook, now: float, remaining: int, chunk_max: int) -> int:
    """Where :func:`plan` restores nothing more: a chunk read anyway while the request is queued
    (``eta`` later than now), 0 otherwise.  The ETA is an estimate (a request ahead that
    restores, or is skipped while it prefetches, moves it earlier: measured off by 2x under
    load), and until the request becomes a scheduling candidate a read costs it nothing; the
    demand re-plans with the ETA at now and withdraws what has not started (``keep_admitted``),
    so the request waits at most for the chunk in flight (the chunk bounds the regret).  Not part of the plan an
    engine that fetches the hit itself is told (it would wait for it): the block lands in the
    pool, for this request's GET where the engine takes what is resident, and for the next
    request of the prefix (a session whose engine fetches a fixed hit — ``fixed_hit``, SGLang —
    reads none: the chunk could not help it, and would hold the read lane from the plans of the
    requests behind it).  Nothing without evidence about L3 or anything to save."""
    if o.eta <= now or o.unmeasured or o.saving_per_block <= 0 or remaining <= 0:
        return 0
    return min(remaining, chunk_size(o, chunk_max))


def next_claim(o: Outlook, now: float, remaining: int, chunk_max: int, current_end: float,
               claimed_before: bool, queued_s: float = 0.0, awaited: int = 0) -> int:
    """How many blocks to claim next (0: stop claiming): the first chunk of :func:`plan`."""
    return min(plan(o, now, remaining, chunk_max, current_end, claimed_before, queued_s, awaited=awaited),
               chunk_size(o, chunk_max))


def keep_admitted(o: Outlook, now: float, current_end: float, pending_blocks: int) -> bool:
    """After a cost stop: are the ``pending_blocks`` already claimed (and possibly still queued)
    worth reading?  Yes while they land before the prefill could start anyway, or while the
    prefill they save exceeds the wait for them to land (``current_end``: behind the lane's
    backlog).  Per-block cost alone does not decide it: two cheap blocks queued behind 80 ms of
    other sessions' reads hold a scheduling candidate for 80 ms to save 6 (measured, r1 load)."""
    if current_end <= o.eta:
        return True
    return pending_blocks * o.saving_per_block > current_end - max(o.eta, now)


def worth_querying(o: Outlook, now: float, remaining: int, chunk_max: int, asked_at: float | None = None,
                   read_with_query: bool = False, hide_behind_queue: bool = True, awaited: int = 0) -> bool:
    """While the L3 query is out: could restoring some of the ``remaining`` blocks (all of them
    in L3, at best) still lower TTFT, once the query answered?  It answers ``query_s`` (as
    measured; one L3 read's latency while unmeasured) after it was sent (``asked_at``; None:
    now) — a query already out for a while answers sooner, and one overdue, about now.  False:
    stop now, the prefill starts at ``max(eta, now)``.  ``read_with_query``: the reads start
    now, beside the query (a block counts once both its read and the answer are in), not after
    the answer.  ``hide_behind_queue``, ``awaited``: as for :func:`plan` (another session's
    read of the first ``awaited`` blocks lands whatever this one does)."""
    if remaining <= 0:
        return False
    if o.probe_blocks:
        return True  # no evidence yet: the answer (and a probe) is how the estimate is learnt
    if o.unmeasured:
        return False  # another session's probe is out: nothing is planned until it lands
    if not hides_behind_queue(o, hide_behind_queue):
        return False  # nothing dearer than prefill is planned: the answer could not change that
    took = o.query_s if o.query_s > 0 else o.l3_latency_s
    answered = max(now, (now if asked_at is None else asked_at) + took)
    reads_from = now if read_with_query else answered
    cap = max(1, chunk_size(o, chunk_max))
    awaited = min(awaited, remaining)
    plans = {remaining}
    if awaited:
        plans.add(awaited)
    if o.l3_s_per_block > 0:
        fit = awaited + math.floor((o.eta - (reads_from + o.backlog_s + o.l3_latency_s)) / o.l3_s_per_block)
        if 0 < fit < remaining:
            plans.add(fit)
    start_now = max(o.eta, now)
    for k in plans:
        own = k - min(k, awaited)
        land = max(answered, o.awaited_at) if awaited else answered
        if own:
            land = max(land, reads_from + o.backlog_s + -(-own // cap) * o.l3_latency_s + own * o.l3_s_per_block)
        if k * o.saving_per_block - (max(start_now, land) - start_now) > 0:
            return True
    return False
