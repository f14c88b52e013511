"""What the executor derives from the L3 tier's estimates and the config, per session: the
``cost_aware`` policy's inputs (an :class:`Outlook`) and a stopped session's drain budget.

Pure functions of (record, tier, config, and for the blocks other sessions are reading, the pool
manager's view) on the control thread; no state of their own.
"""

from __future__ import annotations

from kvsidecar.sidecar.kv.admission import PoolManager
from kvsidecar.sidecar.l3.interface import SessionTier, read_priority
from kvsidecar.sidecar.prefetch.cost import Outlook, block_saving
from kvsidecar.sidecar.prefetch.events import Policy
from kvsidecar.sidecar.prefetch.records import Record


STALE_AFTER = 3  # cost_aware sessions in a row that read nothing: the next plans without the error margin


def outlook(rec: Record, now: float, tier: SessionTier | None, cfg, awaited: tuple = (0, 0.0),
            stale: bool = False) -> Outlook | None:
    """cost_aware's inputs now: the engine's ETA and prefill cost, this L3's read cost and
    the read-lane backlog ahead of the session's next chunk (None for other policies);
    ``awaited``: ``(awaited_to, awaited_at)`` of :func:`awaited_reads`.  ``stale``: the last
    ``STALE_AFTER`` cost_aware sessions read nothing and no read has ended since — the estimate
    is planned on as it is, without :func:`pessimistic`'s margin (see there)."""
    if rec.policy != Policy.COST_AWARE.value:
        return None
    eta = now if rec.eta is None else rec.eta
    if tier is None:
        return Outlook(eta, rec.prefill_s_per_block, 0.0, 1.0, load_s_per_block=cfg.load_s_per_block)
    look = tier.read_outlook(read_priority(rec.demanded, rec.id))
    est = look.estimate
    probe = cfg.probe_blocks if not est.measured and look.backlog_s == 0 else 0
    s_per_block = est.s_per_block if stale else pessimistic(est.s_per_block, tier)
    backlog = look.backlog_s
    if s_per_block >= block_saving(rec.prefill_s_per_block, cfg.load_s_per_block, rec.waiting) and not rec.demanded:
        # restoring does not pay per block: a read is worth it only if it lands before the
        # prefill starts, and a queued request's read can still be overtaken by every read now
        # queued (an older session's next chunk, a request that becomes a candidate): plan
        # behind all of them, or a busy lane pushes the reads past the ETA and the request waits
        backlog = max(backlog, tier.read_outlook(ALL_QUEUED).backlog_s)
    return Outlook(eta, rec.prefill_s_per_block, est.latency_s, s_per_block,
                   backlog, cfg.load_s_per_block, probe, tier.query_s, unmeasured=not est.measured,
                   waiting=rec.waiting, awaited_to=awaited[0], awaited_at=awaited[1])


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
