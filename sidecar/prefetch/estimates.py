"""What the executor derives from the L3 tier's estimates and the config, per session: the
``cost_aware`` policy's inputs (an :class:`Outlook`) and a stopped session's drain budget.

Pure functions of (record, tier, config, and for the blocks other sessions are reading, the pool
manager's view) on the control thread; no state of their own.
"""

from __future__ import annotations

from kvsidecar.shm.chain import length as chain_len
from kvsidecar.sidecar.kv.admission import PoolManager
from kvsidecar.sidecar.l3.interface import SessionTier, read_priority
from kvsidecar.sidecar.prefetch.cost import Outlook, block_saving
from kvsidecar.sidecar.prefetch.events import Policy, State
from kvsidecar.sidecar.prefetch.records import Record


STALE_AFTER = 3  # cost_aware sessions in a row that read nothing: the next plans without the error margin
# ... and after this many, one session explores: it may probe L3 (``Outlook.probe_blocks``) where
# the estimate says no read pays.  Each exploration doubles the count the next one waits for (up to
# EXPLORE_MAX); a read on the estimate (not a probe) brings it back to EXPLORE_AFTER.
EXPLORE_AFTER = 6
EXPLORE_MAX = 192
# ... with a probe of one block: it holds the request at most one block's prefill (measured at
# L3/prefill 1, idle, against no_prefetch on the same request: +4 to +6 ms on each of the three
# requests in 48 that explored; with the 4 blocks of an unmeasured tier's probe, +7 to +15 ms)
EXPLORE_BLOCKS = 1


def outlook(rec: Record, now: float, tier: SessionTier | None, cfg, awaited: tuple = (0, 0.0),
            stale: bool = False, held: float = 0.0, explore: bool = False) -> Outlook | None:
    """cost_aware's inputs now: the engine's ETA and prefill cost, this L3's read cost and
    the read-lane backlog ahead of the session's next chunk (None for other policies);
    ``awaited``: ``(awaited_to, awaited_at)`` of :func:`awaited_reads`.  ``stale``: the last
    ``STALE_AFTER`` cost_aware sessions read nothing and no read has ended since — the estimate
    is planned on as it is, without :func:`pessimistic`'s margin (see there).  ``held``: the
    older requests still reading its prefill would hold up (:func:`held_ahead`), weighed like
    the ``waiting`` the engine counts behind it.  ``explore``: the session explores (see
    :data:`EXPLORE_AFTER`): with the read lane idle it may probe :data:`EXPLORE_BLOCKS` blocks
    where no read pays on the estimate, as a session probes a tier not yet measured."""
    if rec.policy != Policy.COST_AWARE.value:
        return None
    eta = now if rec.eta is None else rec.eta
    waiting = min(rec.waiting + held, MAX_WAITING)
    if tier is None:
        return Outlook(eta, rec.prefill_s_per_block, 0.0, 1.0, load_s_per_block=cfg.load_s_per_block)
    look = tier.read_outlook(read_priority(rec.demanded, rec.id))
    est = look.estimate
    probe = 0  # (only with the read lane idle)
    if look.backlog_s == 0 and not est.measured:
        probe = cfg.probe_blocks  # a tier not measured yet: the probe is how the estimate is learnt
    elif look.backlog_s == 0 and explore:
        probe = min(EXPLORE_BLOCKS, cfg.probe_blocks)  # the estimate itself may be what is wrong
    s_per_block = est.s_per_block if stale else pessimistic(est.s_per_block, tier)
    backlog = look.backlog_s
    if s_per_block >= block_saving(rec.prefill_s_per_block, cfg.load_s_per_block, waiting) and not rec.demanded:
        # restoring does not pay per block: a read is worth it only if it lands before the
        # prefill starts, and a queued request's read can still be overtaken by every read now
        # queued (an older session's next chunk, a request that becomes a candidate): plan
        # behind all of them, or a busy lane pushes the reads past the ETA and the request waits
        backlog = max(backlog, tier.read_outlook(ALL_QUEUED).backlog_s)
    return Outlook(eta, rec.prefill_s_per_block, est.latency_s, s_per_block,
                   backlog, cfg.load_s_per_block, probe, tier.query_s, unmeasured=not est.measured,
                   waiting=waiting, awaited_to=awaited[0], awaited_at=awaited[1])


# a session in these states may have, or claim, a read on the lane (what :func:`held_ahead` looks at)
MAY_READ = frozenset((State.QUERYING, State.RUNNING, State.DRAINING))

# cost_aware's ``waiting`` is taken up to this: a longer queue changes no decision (every read
# already pays many times over), and the weight stays a small finite factor in every deadline
MAX_WAITING = 4096


def held_ahead(rec: Record, pos: int, now: float, others, tier: SessionTier) -> float:
    """The older requests of ``rec``'s engine still reading from L3 that ``rec``'s prefill would
    hold up, each weighed by the share of that prefill it would wait for (``others``: the live
    sessions, any order).  cost_aware adds it to the engine's ``waiting``.

    The engine's scan skips a request whose prefetch still runs and admits the first ready one,
    so a younger request that recomputes at an idle engine goes first, and the older ones, ready
    a moment later, wait for the rest of its prefill.  ``waiting`` (the engine's count) holds
    only the requests queued *behind* it; without these, a request arriving while two older ones
    read found its own read would land after a prefill it could start now, recomputed, and held
    both of them for ~150 ms each (the virtual sweep's 4K-prefix rows at 0.8 load, L3/prefill
    0.4: p90 1.10x whole_task, the sweep's last four misses).

    Such a request counts when it is older (a lower session id: the engine's queue order), of
    the same group, not ended, has a read of its own in flight, and is expected to be ready
    after ``rec``'s prefill of everything from ``pos`` could start (its ETA) and before it would
    end -- one ready sooner is admitted first, one later is not held -- weighed by
    ``(end - ready) / (end - start)``: restoring everything spares it exactly that wait, less
    than the whole prefill a request queued behind waits (counted whole, as a first try did,
    reads looked better-paying than they were: the sweep's 16K rows at L3/prefill 0.8 lost p90,
    0.78 -> 0.94).  It is ready when the lane has done the claimed reads up to its priority and
    then the reads every session up to that priority still plans (a session claims a window of
    chunks at a time and the rest of its plan as those land: the lane's queue alone put an
    older request 64 blocks into a 258-block read ready in 162 ms, where 660 were left).

    (Those planned reads are not added to ``rec``'s own backlog: that made the 72-row sweep's
    rows better still, but cost_aware worse on the real table's streams in the model calibrated
    with them -- p50 medians over seven streams 0.34 -> 0.42 and 0.40 -> 0.50 of the best other
    arm at L3/prefill 1 under 0.9 load, streams over 1.03x 5 -> 11 on the six load rows -- so
    the estimate a read is planned on stays the lane's queue.)"""
    plans = []  # (priority, unclaimed blocks, record) of the sessions that may read
    for o in others:
        m = o.machine
        if o is rec or m is None or m.state not in MAY_READ:
            continue
        unclaimed = max(0, m.planned - m.next_pos) if m.state == State.RUNNING else 0
        plans.append((read_priority(o.demanded, o.id), unclaimed, o))
    if not plans:
        return 0.0
    plans.sort(key=lambda t: t[0])  # (priorities are per session: no ties)
    s_per_block = tier.read_outlook().estimate.s_per_block
    cum, older = 0.0, []
    for prio, unclaimed, o in plans:
        cum += unclaimed * s_per_block
        if o.id < rec.id and o.key[0] == rec.key[0] and any(io.reading for io in o.chunks.values()):
            older.append((prio, cum))
    return _held(rec, pos, now, older, tier)


def _held(rec: Record, pos: int, now: float, older: list, tier: SessionTier) -> float:
    """:func:`held_ahead` over ``older`` (``(priority, unclaimed lane seconds up to it)`` in
    priority order).  When each is ready -- the lane's claimed work up to its priority, then the
    unclaimed plans up to it -- grows with the priority (the tier's backlog never shrinks for a
    later priority), so those ready within the prefill are one run of the list, found by
    bisection: a few backlog queries per decision, not one per session (a scan polls every
    queued request, and each poll re-plans)."""
    c = rec.prefill_s_per_block
    span = (chain_len(rec.chain) - pos) * c
    if span <= 0 or not older:
        return 0.0
    start = max(now, now if rec.eta is None else rec.eta)
    end = start + span

    def ready(i: int) -> float:
        prio, unclaimed_s = older[i]
        return now + tier.read_outlook(prio).backlog_s + unclaimed_s

    lo, hi = 0, len(older)
    while lo < hi:  # the first one ready after the prefill could start
        mid = (lo + hi) // 2
        if ready(mid) <= start:
            lo = mid + 1
        else:
            hi = mid
    held = 0.0
    for i in range(lo, len(older)):
        r = ready(i)
        if r >= end:
            break
        held += (end - r) / span
    return held


ALL_QUEUED = 1 << 62  # a read priority behind every queued read (see read_priority)


def awaited_reads(chain: bytes, start: int, now: float, pool: PoolManager, tier: SessionTier,
                  session_of) -> tuple[int, float]:
    """``(awaited_to, awaited_at)`` for an :class:`Outlook`: the chain's blocks from ``start`` that
    other sessions' L3 reads are staging (:meth:`PoolManager.reads_ahead`: claimed, they are
    awaited, not read again) end at ``awaited_to`` and land by ``awaited_at`` -- when the lane
    has done every read that runs before a new one of those sessions' priority (their own
    later reads too: an upper estimate).  ``(0, 0.0)`` when the next block is not being read.
    ``session_of(sid)``: a session's record, or None (an orphaned read: its queued priority).

    Without it a request arriving while an earlier one reads their shared prefix planned its own
    read of those blocks behind that one, found it would not pay, and recomputed the whole
    prefix: the engine, free while the earlier request was still reading, started that long
    prefill and the earlier request, ready soon after, waited behind it (the virtual sweep's
    4K-prefix rows at 0.8 load, L3/prefill 0.4: p90 1.16-1.17x whole_task)."""
    n, sessions = pool.reads_ahead(chain, start)
    if not n:
        return 0, 0.0
    backlog = 0.0
    for sid in sessions:
        other = session_of(sid)
        backlog = max(backlog, tier.read_outlook(read_priority(other is not None and other.demanded, sid)).backlog_s)
    return start + n, now + backlog


def pessimistic(s_per_block: float, tier: SessionTier) -> float:
    """The per-block read cost the policy plans with: the estimate, inflated by the estimator's
    own measured prediction error (capped at 2x).  Where restoring and recomputing cost about
    the same, a noisy estimate would flip the decision read by read, and a read that runs slow
    costs TTFT while one that runs fast saves little: the margin makes cost_aware restore at an
    idle engine only when it pays clearly (restores hidden behind the queue are unaffected:
    they land before the prefill could start either way).

    The margin widens with every miss and narrows only with reads, so where it decides against
    reading it can keep every read away that would narrow it: after one 2-block tail slowed to
    5.3 ms by a busy CPU (tails take 3.4 ms) it made each next tail look dearer than its prefill
    at an idle engine, and 13 requests in a row recomputed theirs (real table, r0.3-idle-tp4).
    So once ``STALE_AFTER`` cost_aware sessions in a row read nothing (``outlook``'s ``stale``),
    the next plans on the estimate alone: near break-even it reads, and that read corrects the
    estimate or confirms it (at most one such read in every ``STALE_AFTER + 1`` requests, each
    costing no more than the margin it ignored).

    Planning on the estimate alone does not help where the estimate itself is what is wrong: two
    2-block tails slowed in a row to 5.9 and 8.4 ms by a busy CPU (tails take 3.5 ms) read as a
    change of regime, the estimate became 3.2 ms a block against a prefill of 3.1, and the last
    15 requests of the run recomputed their tails; in another run the tails were never read
    (real table ``table40``, r0.3-idle-tp2: cost_aware p50 1.25x the best other arm).  So after
    :data:`EXPLORE_AFTER` such sessions one explores (``outlook``'s ``explore``): it probes the
    tail where no read pays on the estimate, and a probe holds the request at most as long as
    recomputing the probed blocks takes (``Session.probe_deadline``).  Explorations back off
    (each doubles the wait for the next) while the estimate was right, so where no read pays they
    cost a few requests a probe's wait each."""
    err = tier.read_cost_error
    return s_per_block * (1.0 + min(1.0, max(0.0, err)))


def drain_budget(rec: Record, tier: SessionTier | None, cfg) -> float:
    """How long a stopped session waits for its reads in flight.

    ``drain_floor_s + drain_slack x`` the expected time of the blocks still being read
    (from the tier's running per-block estimate), capped at ``drain_timeout_s`` (also the
    budget while no read has completed yet).  A healthy read always fits; a read stuck
    behind a dead master (seconds) does not, and the session hands over what landed.
    """
    per_block = tier.read_s_per_block if tier is not None else None
    if per_block is None:
        return cfg.drain_timeout_s
    blocks = sum(len(io.own_blocks) for io in rec.chunks.values() if io.read_ok is None)
    return min(cfg.drain_timeout_s, cfg.drain_floor_s + cfg.drain_slack * per_block * blocks)
