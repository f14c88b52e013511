"""What the executor derives from the L3 tier's estimates and the config, per session: the
``cost_aware`` policy's inputs (an :class:`Outlook`) and a stopped session's drain budget.

Pure functions of (record, tier, config, and for the blocks other sessions are reading, the pool
manager's view) on the control thread; no state of their own.
"""

from __future__ import annotations

import dataclasses

from kvsidecar.shm.chain import length as chain_len
from kvsidecar.sidecar.kv.admission import PoolManager
from kvsidecar.sidecar.l3.interface import SessionTier, read_priority
from kvsidecar.sidecar.prefetch.cost import Outlook, block_saving
from kvsidecar.sidecar.prefetch.events import Policy, State
from kvsidecar.sidecar.prefetch.records import Record


STALE_AFTER = 3  # cost_aware sessions in a row that read nothing: the next plans without the error margin


def outlook(rec: Record, now: float, tier: SessionTier | None, cfg, awaited: tuple = (0, 0.0),
            stale: bool = False, more: Ahead | None = None) -> Outlook | None:
    """cost_aware's inputs now: the engine's ETA and prefill cost, this L3's read cost and
    the read-lane backlog ahead of the session's next chunk (None for other policies);
    ``awaited``: ``(awaited_to, awaited_at)`` of :func:`awaited_reads`.  ``stale``: the last
    ``STALE_AFTER`` cost_aware sessions read nothing and no read has ended since — the estimate
    is planned on as it is, without :func:`pessimistic`'s margin (see there).  ``more``: what
    the other sessions plan (:func:`ahead`): their unclaimed reads join the backlog, and the
    older requests its prefill would hold up are weighed like the ``waiting`` the engine counts
    behind it."""
    if rec.policy != Policy.COST_AWARE.value:
        return None
    eta = now if rec.eta is None else rec.eta
    more = more or Ahead()
    waiting = min(rec.waiting + more.held, MAX_WAITING)
    if tier is None:
        return Outlook(eta, rec.prefill_s_per_block, 0.0, 1.0, load_s_per_block=cfg.load_s_per_block)
    look = tier.read_outlook(read_priority(rec.demanded, rec.id))
    est = look.estimate
    probe = cfg.probe_blocks if not est.measured and look.backlog_s == 0 else 0
    s_per_block = est.s_per_block if stale else pessimistic(est.s_per_block, tier)
    backlog = look.backlog_s + more.planned_s
    if s_per_block >= block_saving(rec.prefill_s_per_block, cfg.load_s_per_block, waiting) and not rec.demanded:
        # restoring does not pay per block: a read is worth it only if it lands before the
        # prefill starts, and a queued request's read can still be overtaken by every read now
        # queued (an older session's next chunk, a request that becomes a candidate): plan
        # behind all of them, or a busy lane pushes the reads past the ETA and the request waits
        backlog = max(backlog, tier.read_outlook(ALL_QUEUED).backlog_s + more.planned_all_s)
    return Outlook(eta, rec.prefill_s_per_block, est.latency_s, s_per_block,
                   backlog, cfg.load_s_per_block, probe, tier.query_s, unmeasured=not est.measured,
                   waiting=waiting, awaited_to=awaited[0], awaited_at=awaited[1])


# cost_aware's ``waiting`` is taken up to this: a longer queue changes no decision (every read
# already pays many times over), and the weight stays a small finite factor in every deadline
MAX_WAITING = 4096


@dataclasses.dataclass(frozen=True)
class Ahead:
    """What other sessions mean to do that one session's decision must count (:func:`ahead`)."""

    held: float = 0.0  # older requests still reading its prefill would hold up (a share each)
    planned_s: float = 0.0  # lane time of reads sessions ahead of it plan but have not claimed yet
    planned_all_s: float = 0.0  # the same over every other session (a read planned behind them all)


def ahead(rec: Record, pos: int, now: float, others, tier: SessionTier) -> Ahead:
    """Two things the lane's queue does not show yet, from the other live sessions (``others``,
    any order): the reads they plan but have not claimed, and the older requests of ``rec``'s
    engine that ``rec``'s prefill would hold up.

    **Planned reads.**  A session claims a window of chunks at a time; the rest of its plan
    (:attr:`Session.planned` past ``next_pos``) is claimed as those land, at its own priority,
    so it runs before every later read of a lower class or a younger session.  The lane's
    backlog counts only what is claimed: a request arriving while an older one was 64 blocks
    into a 258-block read saw 162 ms ahead of it where 660 were, and planned a read that
    landed 500 ms after its own prefill would have (virtual sweep, 16K prefixes, L3/prefill
    0.8).  ``planned_s``: those sessions' unclaimed plans ahead of ``rec``'s priority, at the
    estimate's per-block cost; ``planned_all_s``: every other session's.

    **Held.**  The engine's scan skips a request whose prefetch still runs and admits the first
    ready one, so a younger request that recomputes at an idle engine goes first, and the older
    ones, ready a moment later, wait for the rest of its prefill.  ``waiting`` (the engine's
    count) holds only the requests queued *behind* it; without these, a request arriving while
    two older ones read found its own read would land after a prefill it could start now,
    recomputed, and held both of them for ~150 ms each (the virtual sweep's 4K-prefix rows at
    0.8 load, L3/prefill 0.4: p90 1.10x whole_task, the sweep's last four misses).  Such a
    request counts when it is older (a lower session id: the engine's queue order), of the same
    group, not ended, has a read of its own in flight, and its reads (claimed and planned) are
    expected to land after ``rec``'s prefill of everything from ``pos`` could start (its ETA)
    and before it would end -- one that lands sooner is admitted first, one later is not held
    -- weighed by the share of that prefill it would wait for, ``(end - ready) / (end - start)``:
    restoring everything spares it exactly that wait, less than the whole prefill a request
    queued behind waits (counted whole, reads looked better-paying than they were)."""
    plans = []  # (priority, unclaimed blocks, record) of the sessions that will claim more
    for o in others:
        if o is rec or o.machine is None or o.machine.state == State.TERMINAL:
            continue
        m = o.machine
        unclaimed = max(0, m.planned - m.next_pos) if m.state == State.RUNNING else 0
        plans.append((read_priority(o.demanded, o.id), unclaimed, o))
    if not plans:
        return Ahead()
    plans.sort(key=lambda t: t[0])
    s_per_block = tier.read_outlook().estimate.s_per_block
    mine = read_priority(rec.demanded, rec.id)
    c = rec.prefill_s_per_block
    remaining = chain_len(rec.chain) - pos
    start = max(now, now if rec.eta is None else rec.eta)
    span = remaining * c
    end = start + span
    held, cum, planned = 0.0, 0.0, 0.0
    for prio, unclaimed, o in plans:
        cum += unclaimed * s_per_block
        if prio < mine:
            planned = cum
        if span <= 0 or o.id >= rec.id or o.key[0] != rec.key[0] or not o.chunks:
            continue
        if not any(io.reading for io in o.chunks.values()):
            continue
        ready = now + tier.read_outlook(prio).backlog_s + cum
        if start < ready < end:
            held += (end - ready) / span
    return Ahead(held, planned, cum)


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
    costing no more than the margin it ignored)."""
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
