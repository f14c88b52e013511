"""The cost_aware policy: its arithmetic (kvsidecar.sidecar.prefetch.cost), the session machine driving it
with a fake clock (every trigger x estimate regime), the L3 read-cost estimator, and the
executor feeding it (the deterministic bench of test_executor)."""

from __future__ import annotations

import pytest

from kvsidecar.shm.errors import ErrorCode, ProtocolError
from kvsidecar.shm.protocol import PROTOCOL_VERSION, decode_request, encode
from kvsidecar.sidecar.l3.cost_model import ReadCostModel, ReadEstimate
from kvsidecar.sidecar.prefetch import cost
from kvsidecar.sidecar.prefetch.cost import Outlook
from kvsidecar.sidecar.prefetch.events import (Abort, ChunkDone, ChunkWithdrawn, Claim, Demand, Detach, Finish, IllegalEvent,
                                               Policy, Query, QueryDone, Replan, Start, State, Status, Tick)
from kvsidecar.sidecar.prefetch.machine import Params, Session
from tests.unit.sidecar.prefetch.test_executor import Bench, Conn, terminal

# regimes: one block costs 10 ms to prefill
PREFILL = 0.010
FAST = dict(l3_latency_s=0.002, l3_s_per_block=0.004)  # restore ~0.4x prefill
SLOW = dict(l3_latency_s=0.002, l3_s_per_block=0.017)  # restore ~1.7x prefill


def ol(eta=0.0, regime=FAST, **kw) -> Outlook:
    return Outlook(eta=eta, prefill_s_per_block=PREFILL, **{**regime, **kw})


# -- the arithmetic ------------------------------------------------------------------------------
def test_restore_cheaper_than_prefill_claims_a_full_chunk():
    assert cost.next_claim(ol(), 0.0, remaining=100, chunk_max=32, current_end=0.0, claimed_before=False) == 32


def test_blocks_another_session_reads_are_planned_at_its_landing_without_lane_time():
    """10 blocks remain; another session's read of the first 8 lands at 50 ms while the lane is
    busy for 200 ms: reading all 10 behind the lane would not pay (100 ms saved, 210 ms wait),
    awaiting the 8 does (80 ms saved, 50 ms wait), and the 2 past them are not read."""
    busy = ol(backlog_s=0.2, awaited_to=8, awaited_at=0.05)
    assert cost.plan(busy, 0.0, 10, 32, 0.0, claimed_before=True) == 0
    assert not cost.worth_querying(busy, 0.0, remaining=10, chunk_max=32)
    assert cost.plan(busy, 0.0, 10, 32, 0.0, claimed_before=True, awaited=8) == 8
    assert cost.worth_querying(busy, 0.0, remaining=10, chunk_max=32, awaited=8)
    assert cost.lands(busy, 0.0, 8, 0.0, awaited=8) == 0.05  # no lane time, no read latency
    assert cost.lands(busy, 0.0, 10, 0.0, awaited=8) == pytest.approx(0.2 + 0.002 + 2 * 0.004)
    assert cost.lands(busy, 0.0, 8, 0.07, awaited=8) == 0.07  # never before its own claims land
    # an awaited read that lands after the prefill it saves would end does not pay either
    late = ol(backlog_s=0.2, awaited_to=8, awaited_at=0.09)
    assert cost.plan(late, 0.0, 10, 32, 0.0, claimed_before=True, awaited=8) == 0
    assert not cost.worth_querying(late, 0.0, remaining=10, chunk_max=32, awaited=8)
    # from a position past the awaited run there is nothing to await
    assert busy.awaited(8, 2) == 0 and busy.awaited(3, 2) == 2 and busy.awaited(3, 10) == 5


def test_restore_dearer_than_prefill_and_no_slack_claims_nothing():
    assert cost.next_claim(ol(regime=SLOW), 0.0, 100, 32, 0.0, False) == 0


def test_restore_dearer_claims_only_what_lands_before_the_eta():
    o = ol(eta=0.2, regime=SLOW)  # (0.2 - 0.002) / 0.017 = 11.6 -> 11 blocks land by the eta
    k = cost.next_claim(o, 0.0, 100, 32, 0.0, False)
    assert k == 11 and cost.lands(o, 0.0, k, 0.0) <= 0.2 < cost.lands(o, 0.0, k + 1, 0.0)


def test_a_queued_request_reads_one_chunk_even_when_nothing_lands_before_its_eta():
    """The backlog eats the slack: nothing lands by the ETA.  Queued, the request still reads
    one chunk (the ETA is an estimate and a queued read costs nothing until the demand); a
    scheduling candidate (ETA now) reads nothing."""
    queued = ol(eta=0.2, regime=SLOW, backlog_s=0.25)
    assert cost.next_claim(queued, 0.0, 100, 32, 0.0, False) == 0  # the plan: nothing pays
    assert cost.queued_chunk(queued, 0.0, 100, 32) == 32  # read anyway, outside the plan
    assert cost.queued_chunk(queued, 0.0, 5, 32) == 5
    assert cost.queued_chunk(ol(eta=0.0, regime=SLOW, backlog_s=0.25), 0.0, 100, 32) == 0  # a candidate
    assert cost.queued_chunk(ol(eta=0.2, regime=SLOW, unmeasured=True), 0.0, 100, 32) == 0  # no evidence
    unknown = Outlook(eta=0.2, prefill_s_per_block=0.0, **SLOW)  # nothing to save: no read
    assert cost.queued_chunk(unknown, 0.0, 100, 32) == 0


def test_latency_larger_than_the_saving_of_a_short_tail_is_not_paid():
    o = ol(l3_latency_s=0.050)  # 2 blocks save 12 ms, the read costs 58 ms
    assert cost.next_claim(o, 0.0, 2, 32, 0.0, False) == 0
    assert cost.next_claim(o, 0.0, 32, 32, 0.0, False) == 32  # 32 blocks save 192 ms > 178 ms


def test_unknown_prefill_cost_restores_only_behind_the_queue():
    o = Outlook(eta=0.1, prefill_s_per_block=0.0, **FAST)
    assert cost.next_claim(o, 0.0, 100, 32, 0.0, False) == 0  # nothing is saved by restoring
    o = Outlook(eta=0.1, prefill_s_per_block=0.0, **FAST)
    assert cost.gain(o, 0.0, 10, 0.0) == 0.0


def test_a_probe_without_evidence_reads_one_small_chunk_once():
    o = ol(regime=SLOW, probe_blocks=4)
    assert cost.next_claim(o, 0.0, 100, 32, 0.0, claimed_before=False) == 4
    assert cost.next_claim(o, 0.0, 100, 32, 0.0, claimed_before=True) == 0


def test_nothing_is_planned_on_the_prior_only_a_probe():
    """Unmeasured, the prior is a guess: even one that says everything pays (FAST) plans only a
    probe, and a session that finds another's probe out (no ``probe_blocks``) plans nothing and
    does not wait for its query."""
    o = ol(probe_blocks=4, unmeasured=True)
    assert cost.plan(o, 0.0, 100, 8, 0.0, claimed_before=False) == 4
    assert cost.plan(o, 0.0, 100, 8, 0.0, claimed_before=True) == 0
    busy = ol(unmeasured=True)
    assert cost.plan(busy, 0.0, 100, 8, 0.0, claimed_before=False) == 0
    assert not cost.worth_querying(busy, 0.0, remaining=100, chunk_max=8)
    assert cost.plan(ol(), 0.0, 100, 8, 0.0, claimed_before=False) == 100  # measured: the whole tail


def test_a_pool_hit_with_a_short_tail_does_not_wait_for_the_query():
    # 2 blocks would save 12 ms; the query alone takes 15 ms: the candidate must not wait for it
    assert not cost.worth_querying(ol(query_s=0.015), 0.0, remaining=2, chunk_max=8)
    # ... while a long tail pays for the wait (32 blocks save 192 ms)
    assert cost.worth_querying(ol(query_s=0.015), 0.0, remaining=32, chunk_max=8)


def test_a_read_with_the_query_does_not_wait_for_its_answer():
    """With the first read beside the query, a short tail pays where the query alone would eat
    its saving: the blocks count once both the read and the answer are in."""
    o = ol(query_s=0.015)
    lat, per = o.l3_latency_s, o.l3_s_per_block
    assert lat + 2 * per < 0.015 < 2 * o.saving_per_block  # (the read is in before the answer)
    assert not cost.worth_querying(o, 0.0, remaining=2, chunk_max=8)
    assert cost.worth_querying(o, 0.0, remaining=2, chunk_max=8, read_with_query=True)
    # ... but never where the answer itself comes after the prefill could have run
    assert not cost.worth_querying(ol(query_s=0.5), 0.0, remaining=2, chunk_max=8, read_with_query=True)
    # the machine: the session started with the engine's ETA queries (and reads) with it, or ends at once
    for with_query, queries in ((False, False), (True, True)):
        s = Session(Params(Policy.COST_AWARE, 34, 32, 8, 2, None, outlook=o, read_with_query=with_query))
        out = s.handle(Start(0.0, eta_given=True))
        assert (s.state == State.QUERYING) == queries, out
        assert bool([a for a in out if isinstance(a, Claim)]) == with_query


def test_a_dearer_l3_with_no_queue_to_hide_behind_does_not_wait_for_the_query():
    assert not cost.worth_querying(ol(regime=SLOW), 0.0, remaining=100, chunk_max=8)
    # with the eta 0.2 s away some blocks land in its shadow: worth the answer
    assert cost.worth_querying(ol(eta=0.2, regime=SLOW), 0.0, remaining=100, chunk_max=8)
    # ... unless the lane's backlog eats that slack
    assert not cost.worth_querying(ol(eta=0.2, regime=SLOW, backlog_s=0.25), 0.0, remaining=100, chunk_max=8)


def test_without_evidence_the_query_is_always_awaited_so_the_estimator_learns():
    assert cost.worth_querying(ol(regime=SLOW, probe_blocks=4), 0.0, remaining=2, chunk_max=8)
    assert not cost.worth_querying(ol(), 0.0, remaining=0, chunk_max=8)


def test_unknown_query_latency_counts_one_l3_round_trip():
    o = ol(l3_latency_s=0.004)  # 1 block saves 6 ms; query >= 4 ms + read 4 + 4 ms = 12 ms
    assert not cost.worth_querying(o, 0.0, remaining=1, chunk_max=8)
    assert cost.worth_querying(o, 0.0, remaining=4, chunk_max=8)  # 24 ms saved > 4 + 4 + 16


def test_chunks_grow_only_while_restoring_pays_and_never_past_eight_times():
    assert cost.chunk_size(ol(regime=SLOW), 8) == 8  # a stop is likely: chunk_max bounds its regret
    assert cost.chunk_size(ol(l3_latency_s=1.0), 8) == 64
    assert cost.chunk_size(ol(l3_latency_s=0.0), 8) == 8


def test_chunks_grow_only_where_restoring_clearly_pays():
    """Near break-even (a block's read more than half the prefill it saves) a chunk stays at
    chunk_max: there a stop is likely (the estimate moves across break-even), and a grown chunk
    holds the one read lane from every other session's small reads for its whole length (the
    calibrated virtual model at L3/prefill 1 under 0.9 load: p90 1.10-1.33x the best other arm
    with chunks grown to 22 blocks, 0.70-0.93x without)."""
    saving = PREFILL  # (waiting 0, no copy cost)
    assert cost.chunk_size(ol(l3_s_per_block=0.5 * saving, l3_latency_s=0.002), 8) == 20  # clearly: grows
    assert cost.chunk_size(ol(l3_s_per_block=0.6 * saving, l3_latency_s=0.002), 8) == 8  # pays, not clearly
    # the queue behind makes a block's saving larger: the same read then clearly pays
    assert cost.chunk_size(ol(l3_s_per_block=0.6 * saving, l3_latency_s=0.002, waiting=1), 8) == 17


def test_second_chunk_in_the_window_queues_behind_the_first():
    o = ol(eta=0.2, regime=SLOW)
    first = cost.next_claim(o, 0.0, 100, 8, 0.0, False)
    assert first == 8
    queued = o.l3_latency_s + 8 * o.l3_s_per_block
    end = cost.lands(o, 0.0, 8, 0.0)
    second = cost.next_claim(o, 0.0, 92, 8, end, True, queued)
    assert second == 3 and cost.lands(o, 0.0, 3, end, queued) <= 0.2  # what still fits before the eta


def test_a_fixed_hit_engine_plans_no_restore_dearer_than_prefill_not_even_behind_the_queue():
    """An engine that waits for the whole hit it was told (SGLang) pays a dearer read's whole time
    when the ETA was early: nothing dearer than prefill is planned for it, however far the ETA
    (the 11 blocks an engine that takes what is resident would read by it), and the L3 query is
    not worth waiting for.  Cheaper than prefill, it plans as any engine; a probe still reads."""
    far = ol(eta=0.2, regime=SLOW)
    assert cost.plan(far, 0.0, 100, 32, 0.0, False) == 11
    assert cost.plan(far, 0.0, 100, 32, 0.0, False, hide_behind_queue=False) == 0
    assert cost.worth_querying(far, 0.0, 100, 32)
    assert not cost.worth_querying(far, 0.0, 100, 32, hide_behind_queue=False)
    for fast in (ol(regime=FAST), ol(eta=0.2, regime=FAST)):
        assert cost.plan(fast, 0.0, 100, 32, 0.0, False, hide_behind_queue=False) == cost.plan(fast, 0.0, 100, 32, 0.0, False) > 0
        assert cost.worth_querying(fast, 0.0, 100, 32, hide_behind_queue=False)
    # held-up requests make a read pay per block (the engine's time): then it is planned again
    held = ol(eta=0.2, regime=SLOW, waiting=1)  # saving 2 x 10 ms > 17 ms a block
    assert held.restore_pays_per_block and cost.plan(held, 0.0, 100, 32, 0.0, False, hide_behind_queue=False) > 0
    probing = ol(eta=0.2, regime=SLOW, probe_blocks=4)
    assert cost.plan(probing, 0.0, 100, 32, 0.0, False, hide_behind_queue=False) == 4
    assert cost.worth_querying(probing, 0.0, 100, 32, hide_behind_queue=False)


def test_outlook_refuses_nonsense():
    with pytest.raises(ValueError):
        Outlook(eta=0.0, prefill_s_per_block=-1, l3_latency_s=0, l3_s_per_block=0)
    with pytest.raises(ValueError):
        Outlook(eta=float("nan"), prefill_s_per_block=0, l3_latency_s=0, l3_s_per_block=0)


# -- the machine with a fake clock ---------------------------------------------------------------
def session(total=64, chunk=8, window=2, deadline=None, outlook=None) -> Session:
    s = Session(Params(Policy.COST_AWARE, total, 0, chunk, window, deadline, outlook=outlook or ol()))
    s.handle(Start(0.0))
    return s


def claims(actions):
    return [a for a in actions if isinstance(a, Claim)]


def finish(actions):
    f = [a for a in actions if isinstance(a, Finish)]
    return f[0] if f else None


def run_to_end(s: Session, now: float, outlook=None) -> Finish | None:
    """Complete every chunk in flight (successfully) until the session ends."""
    out = None
    while s.chunks and out is None:
        c = min((c for c in s.chunks.values() if c.ok is None), key=lambda c: c.start)
        out = finish(s.handle(ChunkDone(c.id, (True,) * c.count, now, outlook)))
        now += 0.01
    return out


def lane_backlog(s: Session, regime=FAST) -> float:
    """The read-lane backlog the tier reports to ``s`` (its own pending reads: they run before its
    next chunk), so an outlook built by hand is one the executor could have built."""
    return sum(regime["l3_latency_s"] + c.count * regime["l3_s_per_block"] for c in s.chunks.values() if c.ok is None)


def test_machine_an_engine_eta_that_leaves_nothing_to_gain_sends_no_query():
    """Given the engine's ETA at start, a session whose best case cannot lower TTFT (L3 dearer
    than prefill and the prefill could start now) ends at once with the resident prefix: no L3
    query, and a scan finds it ready at once.  Where some of it can pay, or without an ETA (it
    is only assumed "now"), it queries as before."""
    for regime, eta, given, queries in [(SLOW, 0.0, True, False), (SLOW, 0.0, False, True),
                                        (SLOW, 0.2, True, True), (FAST, 0.0, True, True)]:
        s = Session(Params(Policy.COST_AWARE, 64, 5, 8, 2, None, outlook=ol(eta=eta, regime=regime)))
        a = s.handle(Start(0.0, eta_given=given))
        if queries:
            assert a == [Query(5)] and s.state == State.QUERYING, (regime, eta, given)
        else:
            assert a == [Finish(Status.COST, 5, "cost")] and s.state == State.TERMINAL and s.prefix == 5
    # no evidence about L3 yet: the query (and its probe) is how the estimate is learnt; and
    # while another session's probe is out (unmeasured, no probe of its own) the estimate that
    # probe brings decides, when this query answers -- not the prior, now
    s = Session(Params(Policy.COST_AWARE, 64, 5, 8, 2, None, outlook=ol(regime=SLOW, probe_blocks=4)))
    assert s.handle(Start(0.0, eta_given=True)) == [Query(5)]
    s = Session(Params(Policy.COST_AWARE, 64, 5, 8, 2, None, outlook=ol(regime=FAST, unmeasured=True)))
    assert s.handle(Start(0.0, eta_given=True)) == [Query(5)]
    # other policies ignore it
    w = Session(Params(Policy.WAIT_COMPLETE, 64, 5, 8, 2, None))
    assert w.handle(Start(0.0, eta_given=True)) == [Query(5)]


def test_machine_fast_l3_restores_everything_and_completes():
    s = session()
    a = s.handle(QueryDone(64, 0.0, ol()))
    # the window; chunks grow past chunk_max until the 2 ms latency is 2 % of a read (25 blocks)
    assert cost.chunk_size(ol(), 8) == 25
    assert [c.count for c in claims(a)] == [25, 25]
    f = run_to_end(s, 0.01, ol())
    assert f == Finish(Status.COMPLETE, 64, "")


def test_machine_slow_l3_on_an_idle_engine_reads_nothing():
    s = session(outlook=ol(regime=SLOW))
    a = s.handle(QueryDone(64, 0.0, ol(regime=SLOW)))
    assert claims(a) == [] and finish(a) == Finish(Status.COST, 0, "cost")


def test_machine_slow_l3_with_slack_reads_behind_the_queue_until_the_demand():
    s = session(chunk=8, outlook=ol(eta=0.2, regime=SLOW))
    a = s.handle(QueryDone(64, 0.0, ol(eta=0.2, regime=SLOW)))
    # 11 blocks land by the eta (the plan); queued, whole chunks are read: the rest of the second
    # one would be read next anyway, and a read cut at an estimate only adds a read's latency
    assert [c.count for c in claims(a)] == [8, 8] and s.planned == 11
    assert not s.sealed  # they still pay: no stop while they are in flight (a later ETA may want more)
    first = min(s.chunks.values(), key=lambda c: c.start)
    a = s.handle(ChunkDone(first.id, (True,) * 8, 0.15, ol(eta=0.2, regime=SLOW)))
    assert [c.count for c in claims(a)] == [8]  # still queued: one more chunk
    a = s.handle(Demand(0.2, ol(eta=0.2, regime=SLOW, backlog_s=lane_backlog(s, SLOW))))  # a candidate: stop
    assert claims(a) == [] and s.sealed and s.status == Status.COST and not s.keep_admitted
    f = run_to_end(s, 0.21)
    assert f == Finish(Status.COST, 24, "cost")  # (here nothing withdraws the chunks not started)


def test_machine_a_fixed_hit_session_with_a_dearer_l3_keeps_its_pool_hit_and_reads_nothing():
    """SGLang's session (``fixed_hit``) with L3 dearer than prefill and a far ETA: no L3 query is
    sent, it ends at once with what the pool holds (the hit SGLang is told), no claim ever; the
    same session for an engine that takes what is resident reads behind the queue as before."""
    far = ol(eta=0.2, regime=SLOW)
    s = Session(Params(Policy.COST_AWARE, 64, 5, 8, 2, None, outlook=far, fixed_hit=True))
    a = s.handle(Start(0.0, eta_given=True))
    assert a == [Finish(Status.COST, 5, "cost")] and s.planned == 5 and not s.chunks
    # the query already out (sent before the outlook was known): its answer claims nothing
    s = Session(Params(Policy.COST_AWARE, 64, 5, 8, 2, None, outlook=far, fixed_hit=True))
    assert s.handle(Start(0.0)) == [Query(5)]
    a = s.handle(QueryDone(64, 0.001, far))
    assert claims(a) == [] and finish(a) == Finish(Status.COST, 5, "cost") and s.planned == 5
    s = Session(Params(Policy.COST_AWARE, 64, 5, 8, 2, None, outlook=far))
    s.handle(Start(0.0))
    assert [c.count for c in claims(s.handle(QueryDone(64, 0.001, far)))] == [8, 8]


def test_machine_planned_is_what_cost_aware_will_restore_not_the_whole_hit():
    """An engine that fetches the hit itself (SGLang's batch_exists) is told ``planned``: here
    the 11 of 64 hit blocks that land by the eta (not the chunk it reads beyond them while
    queued: the engine would wait for it), so it never waits for the other 53."""
    s = session(chunk=8, outlook=ol(eta=0.2, regime=SLOW))
    s.handle(QueryDone(64, 0.0, ol(eta=0.2, regime=SLOW)))
    assert (s.target, s.planned) == (64, 11)
    s.handle(Demand(0.2, ol(eta=0.2, regime=SLOW, backlog_s=lane_backlog(s, SLOW))))
    run_to_end(s, 0.21)
    assert s.planned == 11 and s.published == 16  # the whole second chunk landed: not planned


def test_machine_planned_is_the_whole_hit_when_it_pays_none_when_nothing_does_and_always_for_other_policies():
    s = session()
    assert s.planned == s.target  # while querying: the hit is not known yet
    s.handle(QueryDone(64, 0.0, ol()))
    assert s.planned == 64
    s = session(outlook=ol(regime=SLOW))
    s.handle(QueryDone(64, 0.0, ol(regime=SLOW)))
    assert (s.target, s.planned) == (64, 0)
    w = Session(Params(Policy.WAIT_COMPLETE, 64, 0, 8, 2, None))
    w.handle(Start(0.0))
    w.handle(QueryDone(40, 0.0))
    assert w.planned == w.target == 40


@pytest.mark.parametrize("regime,sealed", [(FAST, False), (SLOW, True)])
def test_machine_demand_replans_with_the_eta_at_now(regime, sealed):
    s = session(chunk=8, outlook=ol(eta=1.0, regime=regime))
    s.handle(QueryDone(64, 0.0, ol(eta=1.0, regime=regime)))
    assert len(s.chunks) == 2
    a = s.handle(Demand(0.05, ol(eta=0.05, regime=regime, backlog_s=lane_backlog(s, regime))))
    assert not finish(a)
    assert s.sealed is sealed
    if sealed:  # restoring is dearer than prefill and the engine could start now: stop, withdraw
        assert s.status == Status.COST and not s.keep_admitted
    else:  # a demand is not a seal: every further chunk still lowers TTFT
        assert s.state == State.RUNNING
        assert run_to_end(s, 0.1, ol(eta=0.05, regime=regime)).status == Status.COMPLETE


def test_machine_an_admitted_demand_stops_reads_dearer_than_prefill_even_where_they_would_pay():
    """The engine admits the request now with what has landed (SGLang's settler: ``demand`` with
    ``drain_s``).  Restoring dearer per block than prefill, cost_aware stops and lets what has
    not started go even where the read in flight would still pay at the ETA (a plain demand keeps
    it: ``keep_admitted``) -- landing after the admission, it is of no use to the request.
    Restoring cheaper than prefill, the reads are worth the engine's next admission: re-planned as
    a plain demand."""
    slow = dict(l3_latency_s=0.002, l3_s_per_block=0.012)  # dearer than prefill, but a short tail pays
    plain = session(chunk=8, outlook=ol(eta=1.0, regime=slow))
    plain.handle(QueryDone(64, 0.0, ol(eta=1.0, regime=slow)))
    first = min(plain.chunks.values(), key=lambda c: c.start)
    plain.handle(ChunkDone(first.id, (True,) * first.count, 0.095, ol(eta=0.9, regime=slow)))
    admitted = session(chunk=8, outlook=ol(eta=1.0, regime=slow))
    admitted.handle(QueryDone(64, 0.0, ol(eta=1.0, regime=slow)))
    first = min(admitted.chunks.values(), key=lambda c: c.start)
    admitted.handle(ChunkDone(first.id, (True,) * first.count, 0.095, ol(eta=0.9, regime=slow)))
    at = ol(eta=0.1, regime=slow, backlog_s=0.002)  # the next read almost done: it pays at the ETA
    plain.handle(Demand(0.1, at))
    a = admitted.handle(Demand(0.1, at, admitted=True))
    assert not finish(a) and not claims(a)
    assert admitted.sealed and admitted.status == Status.COST and admitted.reason == "admitted"
    assert not admitted.keep_admitted and admitted.state == State.DRAINING
    assert plain.state == State.RUNNING and not plain.sealed  # a plain demand reads on: the reads pay
    pending = sorted((c for c in admitted.chunks.values() if c.ok is None), key=lambda c: c.start)
    out = admitted.handle(ChunkDone(pending[0].id, (True,) * pending[0].count, 0.105))
    for c in pending[1:]:  # (the executor withdraws the ones not started)
        out += admitted.handle(ChunkWithdrawn(c.id, 0.105))
    f = finish(out)
    assert f is not None and f.status == Status.COST and f.prefix == first.count + pending[0].count
    assert not admitted.handle(Demand(0.2, ol(eta=0.2, regime=slow), admitted=True))  # terminal: ignored
    fast = session(chunk=8, outlook=ol(eta=1.0, regime=FAST))
    fast.handle(QueryDone(64, 0.0, ol(eta=1.0, regime=FAST)))
    fast.handle(Demand(0.05, ol(eta=0.05, regime=FAST, backlog_s=lane_backlog(fast, FAST)), admitted=True))
    assert not fast.sealed and fast.state == State.RUNNING
    assert run_to_end(fast, 0.1, ol(eta=0.05, regime=FAST)).status == Status.COMPLETE


def test_machine_demand_without_an_outlook_is_a_caller_bug():
    s = session()
    with pytest.raises(IllegalEvent):
        s.handle(Demand(0.0))


def test_machine_replan_with_a_later_eta_claims_more():
    s = session(chunk=8, outlook=ol(eta=0.0, regime=SLOW, probe_blocks=0), window=2)
    s2 = Session(Params(Policy.COST_AWARE, 64, 0, 8, 2, None, outlook=ol(regime=SLOW)))
    s2.handle(Start(0.0))
    # still querying: a re-plan only updates the outlook; the answer then decides with it
    assert s2.handle(Replan(0.0, ol(eta=0.5, regime=SLOW))) == []
    a = s2.handle(QueryDone(64, 0.0))
    assert sum(c.count for c in claims(a)) == 16 and not s2.sealed
    del s


def test_machine_replan_after_a_cost_stop_changes_nothing():
    s = session(outlook=ol(eta=0.0, regime=SLOW))
    s.handle(QueryDone(64, 0.0, ol(eta=0.0, regime=SLOW)))
    assert s.sealed and s.state == State.TERMINAL
    assert s.handle(Replan(0.01, ol(eta=9.0, regime=SLOW))) == []


def test_machine_budget_is_a_cap_on_new_claims():
    s = session(chunk=8, deadline=0.05)
    s.handle(QueryDone(64, 0.0, ol()))
    assert finish(s.handle(Tick(0.06))) is None and s.status == Status.TIMEOUT
    f = run_to_end(s, 0.07, ol())
    assert f.status == Status.TIMEOUT and f.prefix == 50  # only what was in flight at the deadline


def test_machine_abort_wins():
    s = session(chunk=8)
    s.handle(QueryDone(64, 0.0, ol()))
    s.handle(Abort(0.01))
    assert run_to_end(s, 0.02).status == Status.ABORTED


def test_machine_a_stop_regrets_at_most_one_chunk():
    """Demand in the slow regime: what was already claimed is at most window chunks, and the
    stop never claims after it."""
    s = session(chunk=4, window=1, outlook=ol(eta=10.0, regime=SLOW))
    s.handle(QueryDone(64, 0.0, ol(eta=10.0, regime=SLOW)))
    in_flight = sum(c.count for c in s.chunks.values())
    assert in_flight == 4
    a = s.handle(Demand(0.01, ol(eta=0.01, regime=SLOW, backlog_s=lane_backlog(s, SLOW))))
    assert claims(a) == [] and s.sealed


# -- the estimator -------------------------------------------------------------------------------
def test_estimator_learns_latency_and_bandwidth_from_mixed_sizes():
    m = ReadCostModel(0.005, 0.01)
    assert m.estimate() == ReadEstimate(0.005, 0.01, 0)  # the prior before any read
    for k in [32, 8, 32, 4, 32, 16, 32, 32, 8]:
        m.observe(k, 0.003 + k * 0.0005)
    e = m.estimate()
    assert e.latency_s == pytest.approx(0.003, rel=0.15) and e.s_per_block == pytest.approx(0.0005, rel=0.05)
    assert m.error < 0.5


@pytest.mark.parametrize("prior", [(0.005, 0.020), (0.005, 32768 / 10e6)])
def test_estimator_a_small_probe_then_similar_large_reads_is_not_a_new_regime(prior):
    """The reads of one cost_aware arm of the real table (r0.3-idle-tp2): a 4-block probe, then
    reads of 30 and 34 blocks, all ~1.05 ms per block + ~1.3 ms.  The estimate of a 2-block
    read must stay near the 3.4 ms it takes (it was 14.7 ms: the probe's per-block cost taken
    with the prior's 5 ms latency whole, a false change of regime, a latency extrapolated from
    30 and 34 blocks)."""
    m = ReadCostModel(*prior)
    for k, sec in [(4, .00538), (30, .03353), (34, .03607), (34, .03546), (34, .0357), (34, .03704), (34, .03618)]:
        m.observe(k, sec)
        assert m.estimate().seconds(2) < 0.006, (k, m.estimate())
    e = m.estimate()
    assert e.latency_s < 0.003 and e.s_per_block == pytest.approx(0.00105, rel=0.1)
    assert e.seconds(34) == pytest.approx(0.036, rel=0.05)


def test_estimator_one_slow_small_read_does_not_double_the_per_block_cost():
    """The reads of a cost_aware arm of the real table (r0.3-idle-tp4): whole 34-block prefixes
    (~36 ms) and 2-block tails (~3.3 ms), ~1.0 ms per block + ~1.3 ms; one tail took 8 ms (the
    two cores busy).  A 2-block read's per-block sample is mostly its latency's noise: taken at
    the weight of a 34-block read's, that one tail doubled the per-block cost (2.1 ms), every
    tail after it looked dearer than its prefill, was recomputed, and no read came to correct
    it.  Per block, each read weighs by its blocks."""
    m = ReadCostModel(0.005, 32768 / 10e6)
    for k, sec in [(34, .0362), (34, .0364), (2, .0033), (34, .0363), (2, .0035), (2, .0033), (2, .0080)]:
        m.observe(k, sec)
    e = m.estimate()
    assert e.s_per_block == pytest.approx(0.00105, rel=0.25), e
    assert e.seconds(2) < 0.0055 and e.seconds(34) == pytest.approx(0.0362, rel=0.15), e
    for k, sec in [(2, .0033), (2, .0034), (2, .0033)]:  # then tails as usual: back to what they take
        m.observe(k, sec)
    assert m.estimate().seconds(2) == pytest.approx(0.0034, rel=0.2), m.estimate()


def test_estimator_reads_of_one_size_keep_the_prior_split_scaled_to_them():
    m = ReadCostModel(0.005, 0.001)  # the prior says 37 ms for 32 blocks
    m.observe(32, 0.0037)  # 10x faster: the prior's latency scaled down with it
    e = m.estimate()
    assert e.latency_s == pytest.approx(0.0005, rel=0.01) and e.seconds(32) == pytest.approx(0.0037)
    m2 = ReadCostModel(0.005, 0.001)
    m2.observe(32, 0.074)  # slower than the prior: the prior latency, the data sets the per-block cost
    assert m2.estimate().latency_s == 0.005 and m2.estimate().seconds(32) == pytest.approx(0.074)


def test_estimator_rests_on_writes_until_the_first_read():
    """Before any read the tier's own writes (the write-behind, over the same link) are the
    estimate, fitted the same way; the first read takes over and writes count no more."""
    m = ReadCostModel(0.005, 0.01)  # a prior 20x slow per block
    assert not m.estimate().measured
    for k in [8, 32, 8, 32, 16]:
        m.observe_write(k, 0.002 + k * 0.0005)
    e = m.estimate()
    assert e.measured and e.samples == 0 and e.write_samples == 5
    assert e.seconds(32) == pytest.approx(0.002 + 32 * 0.0005, rel=0.15)
    m.observe(16, 0.001 + 16 * 0.002)  # reads are 4x slower than the writes said: reads decide
    e = m.estimate()
    assert e.samples == 1 and e.write_samples == 0 and e.s_per_block == pytest.approx(0.002, rel=0.3)
    m.observe_write(16, 16 * 0.0001)  # ignored now
    assert m.estimate() == e
    m.observe_write(0, 1.0)  # and nonsense is ignored before a read too
    m2 = ReadCostModel(0.005, 0.01)
    m2.observe_write(0, 1.0)
    m2.observe_write(4, float("inf"))
    assert not m2.estimate().measured


def test_estimator_follows_a_four_times_bandwidth_drop_within_three_reads():
    m = ReadCostModel(0.005, 0.01)
    for _ in range(20):
        m.observe(32, 0.002 + 32 * 0.001)
    for _ in range(3):
        m.observe(32, 0.002 + 32 * 0.004)
    assert m.estimate().seconds(32) == pytest.approx(0.002 + 32 * 0.004, rel=0.15)


def test_estimator_follows_a_bandwidth_drop_with_reads_of_mixed_sizes():
    """Reads of mixed sizes across a 4x drop: two reads in a row far slower than predicted start
    the fit again from them, so the drop is not taken for latency (without it the per-block cost
    was still 25 % low after four reads and the latency 2x high)."""
    m = ReadCostModel(0.005, 0.01)
    for k in [2, 66, 2, 8, 2, 66, 2, 2]:
        m.observe(k, 0.002 + k * 0.00128)
    for k in [2, 14]:
        m.observe(k, 0.002 + k * 0.00512)
    e = m.estimate()
    assert e.s_per_block == pytest.approx(0.00512, rel=0.2) and e.latency_s == pytest.approx(0.002, rel=0.5)


def test_estimator_one_slow_read_is_noise_not_a_new_regime(monkeypatch):
    """One read 3x slow between normal ones is not a change of regime, and until the next read
    says so it stays out of the fit: the estimate does not move (without change detection it
    enters whole) and stays within 10 % of the truth after normal reads; the same read twice in
    a row is a new regime, fitted from both."""
    from kvsidecar.sidecar.l3 import cost_model

    def run(reads):
        m = ReadCostModel(0.005, 0.01)
        for k in [4, 32, 4, 16, 32, 8, 32]:
            m.observe(k, 0.002 + k * 0.001)
        for k, slow in reads:
            m.observe(k, slow * (0.002 + k * 0.001))
        return m.estimate()

    truth = 0.002 + 32 * 0.001
    hiccup, after = [(32, 3)], [(32, 3), (8, 1), (32, 1)]
    twice = [(32, 3), (8, 3)]
    clipped, recovered, regime = run(hiccup), run(after), run(twice)
    assert clipped.seconds(32) == pytest.approx(truth, rel=0.02)
    assert recovered.seconds(32) == pytest.approx(truth, rel=0.1)
    assert regime.seconds(8) == pytest.approx(3 * (0.002 + 8 * 0.001), rel=0.15)  # the new regime
    monkeypatch.setattr(cost_model, "CHANGE", float("inf"))
    assert run(hiccup).seconds(32) > clipped.seconds(32)  # without detection the hiccup enters whole
    assert run(twice).seconds(8) < regime.seconds(8)  # and a new regime is learnt slower


def test_estimator_one_slow_tail_does_not_make_the_next_tails_look_dear():
    """The reads of table33's r0.3-idle-tp2 cost_aware arm (3 of its 34-block prefixes, then
    2-block tails of ~3.4 ms), up to the tail that took 7.3 ms (the CPU busy).  Counted as
    ``CHANGE`` over its prediction it raised the per-block cost 44 %; with the error margin
    (``pessimistic``) the next 2-block tail at an idle engine no longer paid beside the query
    (prefill 3.2 ms a block, query 2.1 ms) and the next nine requests recomputed it, no read
    coming to correct the estimate.  Held out of the fit, the estimate does not move, the next
    tail is read, and when it takes what tails take the slow one is dropped as noise."""
    from kvsidecar.sidecar.prefetch.cost import Outlook, worth_querying
    from kvsidecar.sidecar.prefetch.estimates import pessimistic

    class Tier:
        read_cost_error = 0.0

    m = ReadCostModel(0.005, 0.003)
    reads = [(34, .03678), (34, .03627), (34, .03614), (34, .03661), (2, .00346), (2, .00336), (34, .03858)]
    reads += [(2, s) for s in (.00341, .00333, .00337, .00362)] + [(34, .03865)]
    reads += [(2, s) for s in (.00493, .00348, .00335, .00354, .00357, .00359, .00340, .00376, .00336, .00366,
                               .00446, .00333, .00333, .00360, .00356, .00365, .00400, .00389, .00348, .00349,
                               .00333)]
    for k, sec in reads:
        m.observe(k, sec)
    before = m.estimate()

    def tail_pays(est, err) -> bool:
        Tier.read_cost_error = err
        o = Outlook(10.0, 0.0032, est.latency_s, pessimistic(est.s_per_block, Tier), 0.0, 0.0, 0, 0.0021)
        return worth_querying(o, 10.0, 2, 32, read_with_query=o.restore_clearly_pays)

    assert tail_pays(before, m.error)
    m.observe(2, .00726)  # the slow one
    after = m.estimate()
    assert after.latency_s == before.latency_s and after.s_per_block == before.s_per_block
    assert m.error > 0.2  # a miss all the same: the margin widens
    assert tail_pays(after, m.error)  # but the next tail is still read
    m.observe(2, .00341)  # and takes what tails take: the slow one was noise
    assert m.estimate().seconds(2) == pytest.approx(0.0034, rel=0.1)


def test_estimator_ignores_empty_and_negative_reads():
    m = ReadCostModel(0.005, 0.01)
    m.observe(0, 1.0)
    m.observe(4, float("nan"))
    assert m.samples == 0


# -- the executor feeding it -------------------------------------------------------------------------
def test_executor_cost_aware_fast_l3_completes():
    b = Bench(blocks=64, chunk_max_blocks=4)
    b.tier.estimate = ReadEstimate(0.001, 0.001, 5)
    c = b.chain("a", 12)
    b.prefetch("r", c, policy="cost_aware", prefill_s_per_block=0.01)
    b.tier.answer_lookups()
    assert [len(r.keys) // 16 for r in b.tier.reads] == [12]  # one read: latency is 50 blocks' worth
    b.tier.run_all()
    p = terminal(b, "r")
    assert (p["status"], p["prefix"]) == ("complete", 12)
    assert b.take("r", c) == 12 and b.books()["leases"] == 0


def test_executor_cost_aware_does_not_starve_its_estimate_behind_the_error_margin():
    """Idle engine, 32 blocks resident and a 2-block tail in L3 per request; the estimate says a
    tail's read (query 2.1 ms, then 1.6 ms + 2 x 1.2 ms) lands before its prefill (2 x 3.2 ms)
    would end, but its error margin (0.5: 1.8 ms a block) says not.  Three requests in a row
    recompute their tail and nothing is read that could narrow the margin: the fourth plans on
    the estimate alone and reads (one read, 2 blocks, prefix 34); the read resets the count, so
    the next three recompute again.  A request wholly resident between them ends `complete`
    (nothing to read, no decision on the estimate) and does not count.  Books balanced
    throughout."""
    b = Bench(blocks=512, chunk_max_blocks=4)
    b.tier.estimate = ReadEstimate(0.0016, 0.0012, 10)
    b.tier.error = 0.5
    b.tier.query_s = 0.0021
    outcomes = []
    for i in range(8):
        c = b.chain(f"p{i}", 34)
        b.resident(c, 32)
        if i == 1:  # a pool hit of all it asks for, between them
            full = b.chain("full", 8)
            b.resident(full, 8)
            b.prefetch("full", full, policy="cost_aware", prefill_s_per_block=0.0032, eta_s=0.0)
            f = terminal(b, "full")
            assert (f["status"], f["prefix"]) == ("complete", 8) and b.take("full", full) == 8
        b.prefetch(f"r{i}", c, policy="cost_aware", prefill_s_per_block=0.0032, eta_s=0.0)
        b.tier.answer_lookups()
        b.tier.run_all()
        p = terminal(b, f"r{i}")
        outcomes.append((p["status"], p["prefix"]))
        assert b.take(f"r{i}", c) == p["prefix"]
    assert outcomes == [("cost", 32)] * 3 + [("complete", 34)] + [("cost", 32)] * 3 + [("complete", 34)]
    assert b.tier.blocks_read == 4 and b.sm.counters["cost_estimate_stale"] == 2
    b.tier.error = 0.0  # (with no margin every tail is read)
    c = b.chain("q", 34)
    b.resident(c, 32)
    b.prefetch("q", c, policy="cost_aware", prefill_s_per_block=0.0032, eta_s=0.0)
    b.tier.answer_lookups()
    b.tier.run_all()
    assert terminal(b, "q")["prefix"] == 34 and b.take("q", c) == 34
    s = b.books()
    assert s["staging"] == 0 and s["pinned"] == 0 and s["leases"] == 0


def _tail_request(b: Bench, name: str, tail_in_l3: bool = True, **kw) -> tuple:
    """A request at an idle engine: 32 blocks resident, a 2-block tail (in L3 unless
    ``tail_in_l3`` is False: never stored); (status, prefix)."""
    c = b.chain(name, 32) + b.chain(f"{name}-tail", 2, in_l3=tail_in_l3)
    b.resident(c, 32)
    b.prefetch(name, c, policy="cost_aware", prefill_s_per_block=0.0032, eta_s=0.0, **kw)
    b.tier.answer_lookups()
    b.tier.run_all()
    p = terminal(b, name)
    assert b.take(name, c) == p["prefix"]
    return p["status"], p["prefix"]


def test_executor_cost_aware_explores_where_its_estimate_says_no_read_pays():
    """The estimate itself is wrong (4 ms a block, dearer than the 3.2 ms prefill, where a tail is
    read in 2 ms): no tail's read pays on it, with or without the error margin, so no read comes
    to correct it.  After EXPLORE_AFTER requests in a row that read nothing one explores: it
    queries and probes one block of its tail (prefix 33; the next block still does not pay on the
    estimate); its read resets the count and doubles the wait for the next exploration (12 more),
    and so on.  A read on the estimate (once it says reads pay) brings the wait back to
    EXPLORE_AFTER.  Books balanced throughout."""
    from kvsidecar.sidecar.prefetch.estimates import EXPLORE_AFTER

    b = Bench(blocks=1024, chunk_max_blocks=4)
    b.tier.estimate = ReadEstimate(0.0016, 0.004, 10)
    b.tier.query_s = 0.0021
    got = [_tail_request(b, f"r{i}") for i in range(EXPLORE_AFTER + 1 + 2 * EXPLORE_AFTER + 1)]
    miss, probe = ("cost", 32), ("cost", 33)
    assert got == [miss] * EXPLORE_AFTER + [probe] + [miss] * (2 * EXPLORE_AFTER) + [probe]
    assert b.sm.counters["cost_explorations"] == 2 and b.tier.blocks_read == 2
    b.tier.estimate = ReadEstimate(0.0016, 0.0012, 10)  # corrected: every tail is read on it
    assert _tail_request(b, "s0") == ("complete", 34)
    b.tier.estimate = ReadEstimate(0.0016, 0.004, 10)  # dear again: the wait is EXPLORE_AFTER again
    got = [_tail_request(b, f"t{i}") for i in range(EXPLORE_AFTER + 1)]
    assert got == [miss] * EXPLORE_AFTER + [probe] and b.sm.counters["cost_explorations"] == 3
    s = b.books()
    assert s["staging"] == 0 and s["pinned"] == 0 and s["leases"] == 0


def test_executor_cost_aware_explorations_back_off_when_l3_holds_nothing():
    """Pool hits whose tail L3 does not hold (a follow-up turn: its new blocks were never
    stored): an exploration's query answers "no hit", nothing is read, no evidence comes.  The
    wait for the next exploration still counts from this one and doubles up to EXPLORE_MAX --
    it once counted from the last L3 read, so past EXPLORE_MAX sessions in a row every request
    explored, each held for the L3 query an idle engine would not wait for (a long-running
    server with a warm pool: 1,308 of 1,500 pool hits in a row waited for it)."""
    from kvsidecar.sidecar.prefetch.estimates import EXPLORE_AFTER, EXPLORE_MAX

    b = Bench(blocks=1024, chunk_max_blocks=4)
    b.tier.estimate = ReadEstimate(0.0016, 0.004, 10)
    b.tier.query_s = 0.0021
    waits, w = [], EXPLORE_AFTER
    while len(waits) < 7:
        waits.append(w)
        w = min(2 * w, EXPLORE_MAX)
    expected = []
    for w in waits:
        expected += [("cost", 32)] * w + [("no_hit", 32)]
    got = [_tail_request(b, f"r{i}", tail_in_l3=False) for i in range(len(expected))]
    explored = [i for i, g in enumerate(got) if g != ("cost", 32)]
    assert explored == [i for i, g in enumerate(expected) if g != ("cost", 32)]
    assert got == expected and b.sm.counters["cost_explorations"] == len(waits) and b.tier.blocks_read == 0
    s = b.books()
    assert s["staging"] == 0 and s["pinned"] == 0 and s["leases"] == 0


def test_executor_cost_aware_never_explores_for_an_engine_that_waits_for_its_whole_hit():
    """``fixed_hit`` (SGLang): the engine waits for every block it was told it would get, so a
    probe would hold it for the whole read; such sessions never explore, however many in a row
    read nothing."""
    b = Bench(blocks=1024, chunk_max_blocks=4)
    b.tier.estimate = ReadEstimate(0.0016, 0.004, 10)
    b.tier.query_s = 0.0021
    got = [_tail_request(b, f"r{i}", fixed_hit=True) for i in range(20)]
    assert got == [("cost", 32)] * 20 and b.sm.counters["cost_explorations"] == 0 and b.tier.blocks_read == 0


@pytest.mark.parametrize("awaits", [True, False])
def test_executor_cost_aware_awaits_the_blocks_another_session_reads(awaits, monkeypatch):
    """A request arriving while an earlier one reads their shared prefix from L3 awaits that read
    (its blocks are neither read twice nor planned behind the lane).  Without counting that read
    (``awaits`` False: the policy before) its own read of the prefix, behind the lane's other
    work, did not pay, and it recomputed all of it while the earlier request was still reading."""
    from kvsidecar.sidecar.prefetch import sessions

    if not awaits:
        monkeypatch.setattr(sessions, "awaited_reads", lambda *a, **k: (0, 0.0))
    b = Bench(blocks=96, chunk_max_blocks=8)
    b.tier.estimate = ReadEstimate(0.001, 0.004, 5)  # restore 0.4x prefill
    shared = b.chain("p", 8)
    cx, cz, cy = shared + b.chain("x", 2), b.chain("z", 26), shared + b.chain("y", 2)
    b.prefetch("x", cx, policy="cost_aware", prefill_s_per_block=0.01, eta_s=1.0)
    b.tier.answer_lookups()
    (x_read,) = b.tier.reads  # the shared prefix and x's own 2 blocks, one read (~41 ms)
    b.prefetch("z", cz, policy="cost_aware", prefill_s_per_block=0.01, eta_s=1.0)  # another prompt: ~106 ms
    b.tier.answer_lookups()
    assert len(b.tier.reads) == 3
    # y could start now: reading its 10 blocks behind ~147 ms of lane work saves only 100 ms
    b.prefetch("y", cy, policy="cost_aware", prefill_s_per_block=0.01, eta_s=0.0)
    b.tier.answer_lookups()
    if not awaits:
        p = terminal(b, "y")
        assert (p["status"], p["prefix"]) == ("cost", 0)
    else:
        assert b.poll("y")["state"] != "terminal" and len(b.tier.reads) == 3  # awaited: no read of its own
        b.tier.finish(x_read)
        p = terminal(b, "y")  # the 2 blocks past the prefix would wait behind z: not read
        assert (p["status"], p["prefix"]) == ("cost", 8)
        assert b.sm.counters["blocks_deduplicated"] >= 8
    b.tier.run_all()
    assert b.tier.blocks_read == 10 + 26  # y read nothing in either case
    assert b.take("y", cy) == 8 and b.take("x", cx) == 10 and b.take("z", cz) == 26  # (the GET: what is resident)
    assert b.books()["leases"] == 0 and b.books()["staging"] == 0 and b.books()["pinned"] == 0


def test_executor_cost_aware_slow_l3_demand_withdraws_queued_reads():
    b = Bench(blocks=64, chunk_max_blocks=4)
    b.tier.estimate = ReadEstimate(0.001, 0.02, 5)
    c = b.chain("a", 40)
    b.prefetch("r", c, policy="cost_aware", prefill_s_per_block=0.01, eta_s=1.0)
    b.tier.answer_lookups()
    first, second = b.tier.reads
    b.tier.start(first)
    b.sm.op_demand(b.conn, {"req": "r"})
    b.loop.settle()
    assert second.state == "cancelled"  # dearer than prefill, nothing left to hide behind
    b.tier.finish(first)
    p = terminal(b, "r")  # (the read in flight was waited for)
    assert (p["status"], p["prefix"], p["reason"]) == ("cost", 4, "cost")
    assert b.take("r", c) == 4
    assert b.books()["staging"] == 0 and b.books()["leases"] == 0


def test_executor_cost_aware_fully_claimed_demand_withdraws_queued_reads():
    """Every remaining block is claimed (the ETA left room) and the reads are still queued when
    the request becomes a candidate: at a read cost above recomputing, they are withdrawn and
    the session ends at once, rather than making the engine wait for them."""
    b = Bench(blocks=64, chunk_max_blocks=4)
    b.tier.estimate = ReadEstimate(0.001, 0.02, 5)
    c = b.chain("a", 8)
    b.prefetch("r", c, policy="cost_aware", prefill_s_per_block=0.01, eta_s=1.0)
    b.tier.answer_lookups()
    reads = list(b.tier.reads)
    assert [len(r.keys) // 16 for r in reads] == [4, 4]  # all of it lands by the ETA
    b.sm.op_demand(b.conn, {"req": "r"})
    b.loop.settle()
    assert [r.state for r in reads] == ["cancelled", "cancelled"] and not b.tier.reads
    p = terminal(b, "r")
    assert (p["status"], p["prefix"], p["reason"]) == ("cost", 0, "cost")
    b.take("r", c)
    assert b.books()["staging"] == 0 and b.books()["leases"] == 0


def test_executor_cost_aware_fully_claimed_keeps_reads_that_still_pay():
    """The same, with restoring cheaper than recomputing: the claimed reads go on."""
    b = Bench(blocks=64, chunk_max_blocks=4)
    b.tier.estimate = ReadEstimate(0.001, 0.002, 5)
    c = b.chain("a", 8)
    b.prefetch("r", c, policy="cost_aware", prefill_s_per_block=0.01, eta_s=1.0)
    b.tier.answer_lookups()
    b.sm.op_demand(b.conn, {"req": "r"})
    b.loop.settle()
    assert b.tier.reads and all(r.state == "queued" for r in b.tier.reads)
    b.tier.run_all()
    p = terminal(b, "r")
    assert (p["status"], p["prefix"]) == ("complete", 8)
    assert b.take("r", c) == 8 and b.books()["leases"] == 0


def test_executor_poll_with_an_eta_replans_once_per_step():
    b = Bench(blocks=64, chunk_max_blocks=4)
    b.tier.estimate = ReadEstimate(0.001, 0.02, 5)
    c = b.chain("a", 40)
    b.prefetch("r", c, policy="cost_aware", prefill_s_per_block=0.01, eta_s=0.0)
    b.tier.answer_lookups()
    assert terminal(b, "r")["status"] == "cost"  # slow and no slack: nothing to read
    b2 = Bench(blocks=64, chunk_max_blocks=4)
    b2.tier.estimate = ReadEstimate(0.001, 0.02, 5)
    c2 = b2.chain("a", 40)
    b2.prefetch("r", c2, policy="cost_aware", prefill_s_per_block=0.01, eta_s=0.1)
    b2.tier.answer_lookups()
    # 4 land by 0.1 s (0.081 s); queued, the next chunk is read too (the window: 2 chunks)
    assert [len(r.keys) // 16 for r in b2.tier.reads] == [4, 4]
    r0 = b2.tier.reads[0]
    b2.loop.advance(0.081)
    b2.tier.start(r0)
    b2.tier.finish(r0)
    assert [len(r.keys) // 16 for r in b2.tier.reads] == [4, 4]  # still queued: one more chunk
    b2.loop.advance(0.02)
    b2.sm.op_demand(b2.conn, {"req": "r"})  # a candidate: the chunk not yet started is withdrawn
    b2.loop.settle()
    assert terminal(b2, "r")["prefix"] == 4 and not b2.tier.reads
    # a poll moving the ETA later re-plans: more hides behind the queue
    b3 = Bench(blocks=64, chunk_max_blocks=4)
    b3.tier.estimate = ReadEstimate(0.001, 0.02, 5)
    c3 = b3.chain("a", 40)
    b3.prefetch("r", c3, policy="cost_aware", prefill_s_per_block=0.01, eta_s=0.1)
    b3.tier.answer_lookups()
    b3.sm.op_poll(b3.conn, {"req": "r", "step": 1, "eta_s": 1.0})
    b3.loop.settle()
    assert sum(len(r.keys) for r in b3.tier.reads) // 16 == 8  # a second chunk (the window)
    del c


def test_executor_a_candidate_waits_for_its_probe_only_as_long_as_a_paying_probe_takes():
    """A scheduling candidate (ETA now) probes L3 and waits for the probe as long as a probe
    that pays would take (its 2 blocks' prefill: 20 ms); then the session ends with what is
    resident, the read goes on without it (an orphan), and when it lands its blocks are
    published for the next request and the tier has measured it."""
    b = Bench(blocks=64, chunk_max_blocks=8, probe_blocks=2)
    b.tier.estimate = ReadEstimate(0.005, 0.05, 0)  # the prior: slow, no evidence
    c = b.chain("a", 40)
    b.prefetch("r", c, policy="cost_aware", prefill_s_per_block=0.01)
    b.tier.answer_lookups()
    assert [len(r.keys) // 16 for r in b.tier.reads] == [2]
    b.loop.advance(0.019)
    assert b.poll("r")["state"] == "running"  # a paying probe could still land
    b.loop.advance(0.002)
    p = terminal(b, "r")
    assert (p["status"], p["prefix"]) == ("cost", 0)
    assert b.sm.counters["probes_detached"] == 1
    assert b.take("r", c) == 0
    assert b.books()["orphans"] == 1 and b.books()["staging"] == 2
    b.tier.run_all()
    s = b.books()
    assert s["orphans"] == 0 and s["staging"] == 0 and s["leases"] == 0 and b.core.index.match(c) == 2


def test_executor_a_candidates_probe_that_lands_in_time_decides_its_restore():
    """The probe lands before its deadline (L3 fast): the candidate plans on the measurement and
    restores the rest of its prefix (what waiting for the probe was for)."""
    b = Bench(blocks=64, chunk_max_blocks=8, probe_blocks=2)
    b.tier.estimate = ReadEstimate(0.005, 0.05, 0)
    c = b.chain("a", 40)
    b.prefetch("r", c, policy="cost_aware", prefill_s_per_block=0.01)
    b.tier.answer_lookups()
    b.loop.advance(0.005)
    b.tier.estimate = ReadEstimate(0.001, 0.001, 1)  # what the probe measures: fast
    b.tier.run_all()
    b.tier.run_all()
    p = terminal(b, "r")
    assert (p["status"], p["prefix"]) == ("complete", 40) and b.sm.counters["probes_detached"] == 0
    assert b.take("r", c) == 40 and b.books()["leases"] == 0


def test_executor_a_queued_requests_probe_is_detached_when_it_becomes_a_candidate():
    """Queued (ETA later), the request waits for its probe; demanded before the probe landed, it
    stops waiting (the probe goes on as an orphan).  If the probe lands first, the session
    plans on the measurement as before."""
    b = Bench(blocks=64, chunk_max_blocks=8, probe_blocks=2)
    b.tier.estimate = ReadEstimate(0.005, 0.05, 0)
    c = b.chain("a", 40)
    b.prefetch("r", c, policy="cost_aware", prefill_s_per_block=0.01, eta_s=1.0)
    b.tier.answer_lookups()
    assert [len(r.keys) // 16 for r in b.tier.reads] == [2]
    assert b.poll("r")["state"] == "running"  # queued: the probe may still pay for it
    b.loop.advance(0.03)  # past the probe's deadline (a paying probe would have landed)
    assert b.poll("r")["state"] == "running"  # queued: nothing holds a candidate yet
    b.sm.op_demand(b.conn, {"req": "r"})
    b.loop.settle()
    p = terminal(b, "r")
    assert (p["status"], p["prefix"]) == ("cost", 0)
    b.tier.run_all()
    assert b.core.index.match(c) == 2 and b.take("r", c) == 2  # (the probe landed before the GET)
    s = b.books()
    assert s["orphans"] == 0 and s["staging"] == 0 and s["leases"] == 0
    # the probe lands before the demand: the session keeps what it read
    b2 = Bench(blocks=64, chunk_max_blocks=8, probe_blocks=2)
    b2.tier.estimate = ReadEstimate(0.005, 0.05, 0)
    c2 = b2.chain("a", 40)
    b2.prefetch("r", c2, policy="cost_aware", prefill_s_per_block=0.01, eta_s=1.0)
    b2.tier.answer_lookups()
    b2.tier.run_all()
    b2.sm.op_demand(b2.conn, {"req": "r"})
    b2.loop.settle()
    assert terminal(b2, "r")["prefix"] >= 2 and b2.sm.counters["probes_detached"] == 0


def test_executor_plans_on_an_estimate_measured_by_writes_without_a_probe():
    """No read measured yet, but the write-behind measured the tier (fast): the first session
    restores everything at once (no probe, no request lost to it)."""
    b = Bench(blocks=64, chunk_max_blocks=8, probe_blocks=2)
    b.tier.estimate = ReadEstimate(0.001, 0.0001, 0, write_samples=4)
    c = b.chain("a", 40)
    b.prefetch("r", c, policy="cost_aware", prefill_s_per_block=0.01)
    b.tier.answer_lookups()
    assert sum(len(r.keys) for r in b.tier.reads) // 16 > 2
    b.tier.run_all()
    assert terminal(b, "r")["prefix"] == 40


def test_executor_sessions_that_start_during_the_first_probe_restore_nothing():
    """The prior says L3 is fast; the first session only probes, the second (its query answered
    while the probe is out) restores nothing from L3, and once the probe measured L3 a third
    session plans on the measurement."""
    b = Bench(blocks=256, chunk_max_blocks=8, probe_blocks=2)
    b.tier.estimate = ReadEstimate(0.001, 0.0001, 0)  # an optimistic prior, no evidence
    first, second = b.chain("a", 40), b.chain("b", 40)
    b.prefetch("r1", first, policy="cost_aware", prefill_s_per_block=0.01)
    b.tier.answer_lookups()
    b.prefetch("r2", second, policy="cost_aware", prefill_s_per_block=0.01)
    b.tier.answer_lookups()
    assert [len(r.keys) // 16 for r in b.tier.reads] == [2]  # r1's probe only
    b.tier.run_all()
    assert terminal(b, "r2")["prefix"] == 0
    b.tier.estimate = ReadEstimate(0.001, 0.0001, 3)  # measured now
    third = b.chain("c", 40)
    b.prefetch("r3", third, policy="cost_aware", prefill_s_per_block=0.01)
    b.tier.answer_lookups()
    b.tier.run_all()
    assert terminal(b, "r3")["prefix"] == 40


def test_eta_and_prefill_cost_are_validated_on_the_wire():
    def frame(**m):
        return encode({"v": PROTOCOL_VERSION, "id": 1, **m})

    with pytest.raises(ProtocolError) as e:
        decode_request(frame(op="prefetch", req="r", chain=b"k" * 16, eta_s=-1.0))
    assert e.value.code == ErrorCode.BAD_FIELD
    with pytest.raises(ProtocolError) as e:
        decode_request(frame(op="poll", req="r", eta_s="soon"))
    assert e.value.code == ErrorCode.MALFORMED
    assert decode_request(frame(op="poll", req="r", eta_s=0.25))["eta_s"] == 0.25


# -- every trigger x estimate regime -------------------------------------------------------------
REGIMES = {
    "fast": dict(eta=0.0, regime=FAST),
    "slow_idle": dict(eta=0.0, regime=SLOW),
    "slow_slack": dict(eta=0.2, regime=SLOW),
    "unknown_prefill": dict(eta=0.2, regime=FAST, prefill_s_per_block=0.0),
    "no_evidence": dict(eta=0.0, regime=SLOW, probe_blocks=4),  # a candidate: waits for the probe a while
    "no_evidence_queued": dict(eta=0.2, regime=SLOW, probe_blocks=4, unmeasured=True),  # queued: waits for it
}
TRIGGERS = ("chunk_done", "demand", "replan_later", "tick", "abort")
EXPECT = {  # (regime, trigger) -> final status; unlisted: the regime's default
    ("fast", "tick"): Status.TIMEOUT, ("fast", "abort"): Status.ABORTED,
    ("slow_slack", "tick"): Status.TIMEOUT, ("slow_slack", "abort"): Status.ABORTED,
    ("no_evidence_queued", "abort"): Status.ABORTED, ("no_evidence_queued", "tick"): Status.TIMEOUT,
    ("no_evidence", "abort"): Status.ABORTED, ("no_evidence", "tick"): Status.TIMEOUT,
}
DEFAULT = {"fast": Status.COMPLETE, "slow_idle": Status.COST, "slow_slack": Status.COST,
           "unknown_prefill": Status.COST, "no_evidence": Status.COST, "no_evidence_queued": Status.COST}


def _outlook(spec, **over):
    kw = dict(spec)
    regime = kw.pop("regime")
    kw.update(over)
    return Outlook(eta=kw.pop("eta"), prefill_s_per_block=kw.pop("prefill_s_per_block", PREFILL),
                   **{**regime, **kw})


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("trigger", TRIGGERS)
def test_every_trigger_in_every_estimate_regime(regime, trigger):
    spec = REGIMES[regime]
    o = _outlook(spec)
    s = Session(Params(Policy.COST_AWARE, 64, 0, 8, 2, 0.005 if trigger == "tick" else None, outlook=o))
    out = s.handle(Start(0.0)) + s.handle(QueryDone(64, 0.0, o))
    claimed = sum(c.count for c in claims(out))
    if regime == "slow_idle":
        assert claimed == 0 and s.state == State.TERMINAL  # nothing is worth reading
    elif regime == "no_evidence":
        # one probe; a candidate waits for it until 4 blocks' prefill (40 ms) have passed
        assert claimed == 4 and not any(isinstance(a, Detach) for a in out) and s.probe_wake_at == 0.04
    elif regime == "no_evidence_queued":
        assert claimed == 4 and not any(isinstance(a, Detach) for a in out)  # the probe, awaited
    elif regime in ("slow_slack",):
        assert claimed == 16 and s.planned == 11  # what lands by the ETA, read in whole chunks
    elif regime == "unknown_prefill":
        assert claimed == 0  # nothing to save: restoring only costs
    now = 0.01
    if trigger == "chunk_done" and s.chunks:
        c = min(s.chunks.values(), key=lambda c: c.start)
        out += s.handle(ChunkDone(c.id, (True,) * c.count, now, o))
    elif trigger == "demand":
        out += s.handle(Demand(now, _outlook(spec, eta=now, backlog_s=lane_backlog(s, spec["regime"]))))
    elif trigger == "replan_later":
        out += s.handle(Replan(now, _outlook(spec, eta=spec["eta"] + 1.0)))
    elif trigger == "tick":
        out += s.handle(Tick(now))
    else:
        out += s.handle(Abort(now))
    while s.state != State.TERMINAL:  # complete whatever is in flight, in chain order
        c = min((c for c in s.chunks.values() if c.ok is None), key=lambda c: c.start)
        now += 0.05
        out += s.handle(ChunkDone(c.id, (True,) * c.count, now, o))
    fins = [a for a in out if isinstance(a, Finish)]
    assert len(fins) == 1 and fins[0].prefix <= s.published
    assert fins[0].status == EXPECT.get((regime, trigger), DEFAULT[regime]), (fins[0], s.published)
    if regime == "slow_slack" and trigger == "replan_later":
        assert s.published > 11  # a later ETA hides more behind the queue
    if regime == "slow_slack" and trigger == "demand":
        assert s.published <= 16 and not s.keep_admitted  # the engine could start now: nothing more
    assert not s.chunks and s.in_flight == 0


def test_a_candidate_whose_restore_cannot_pay_ends_while_querying():
    """Demand during the L3 query with an L3 dearer than prefill: the session ends at once
    (cost), claims nothing, and the late answer is ignored."""
    s = Session(Params(Policy.COST_AWARE, 64, 30, 8, 2, None, outlook=ol(eta=1.0, regime=SLOW)))
    s.handle(Start(0.0))
    assert s.state == State.QUERYING
    acts = s.handle(Demand(0.001, ol(eta=0.001, regime=SLOW)))
    assert s.state == State.TERMINAL and s.status == Status.COST and not claims(acts)
    fin = [a for a in acts if isinstance(a, Finish)]
    assert fin and fin[0].prefix == 30  # the resident prefix is the result
    assert s.handle(QueryDone(34, 0.01, ol(regime=SLOW))) == []


def test_a_queued_request_keeps_querying_when_its_eta_leaves_room():
    s = Session(Params(Policy.COST_AWARE, 64, 0, 8, 2, None, outlook=ol(eta=1.0, regime=SLOW)))
    s.handle(Start(0.0))
    assert s.handle(Replan(0.001, ol(eta=0.5, regime=SLOW))) == [] and s.state == State.QUERYING
    acts = s.handle(QueryDone(64, 0.002, ol(eta=0.5, regime=SLOW)))
    assert claims(acts)  # restores in the queue's shadow


def test_the_policy_plans_with_the_read_cost_inflated_by_the_estimators_error():
    from kvsidecar.sidecar.prefetch.estimates import pessimistic

    class Tier:
        cost = ReadCostModel(0.002, 0.004)

        @property
        def read_cost_error(self):
            return self.cost.error

    T = Tier()
    assert pessimistic(0.004, T) == 0.004  # no prediction made yet: the estimate as it is
    for blocks, seconds in ((8, 0.034), (8, 0.050), (8, 0.020)):  # noisy reads
        T.cost.observe(blocks, seconds)
    err = T.cost.error
    assert 0 < err and pessimistic(0.004, T) == pytest.approx(0.004 * (1 + min(1.0, err)))
    T.cost._err_num, T.cost._err_den = 5.0, 1.0  # a wild estimator: capped at twice the estimate
    assert pessimistic(0.004, T) == pytest.approx(0.008)
    # a large error (here 2x: 11 ms) turns "restore at an idle engine" into "recompute"
    o = ol(l3_s_per_block=0.0055)  # 5.5 ms to read vs 10 ms saved per block: restore
    assert cost.next_claim(o, 0.0, 100, 32, 0.0, False) > 0
    o = ol(l3_s_per_block=pessimistic(0.0055, T))
    assert cost.next_claim(o, 0.0, 100, 32, 0.0, False) == 0


def test_a_dear_l3_plans_a_queued_request_behind_every_queued_read():
    """L3 dearer than prefill: a queued request's restore pays only if it lands before its
    prefill, and younger sessions' reads may not overtake it but older ones' next chunks and new
    candidates will: its outlook counts the whole queue; a cheap L3 counts only what runs first."""
    from types import SimpleNamespace

    from kvsidecar.sidecar.l3.tier import ReadOutlook
    from kvsidecar.sidecar.prefetch.estimates import outlook

    class FakeTier:  # (only what ``outlook`` reads: SessionTier's estimates)
        read_cost_error = 0.0
        query_s = 0.0

        def __init__(self, s_per_block):
            self.s = s_per_block

        def read_outlook(self, priority):
            est = ReadEstimate(0.002, self.s, 5)
            return ReadOutlook(est, 0.05 if priority < (1 << 50) else 0.40)  # ahead of it vs all queued

    cfg = SimpleNamespace(load_s_per_block=0.0, probe_blocks=4)
    rec = SimpleNamespace(policy="cost_aware", eta=1.0, prefill_s_per_block=PREFILL, demanded=False, id=7, waiting=0)
    assert outlook(rec, 0.0, FakeTier(0.017), cfg).backlog_s == 0.40  # dear: behind everything queued
    assert outlook(rec, 0.0, FakeTier(0.004), cfg).backlog_s == 0.05  # cheap: what runs before it
    rec.waiting = 2  # dear for the request alone, but its prefill would hold two more: a read pays
    look = outlook(rec, 0.0, FakeTier(0.017), cfg)
    assert look.waiting == 2 and look.restore_pays_per_block and look.backlog_s == 0.05
    rec.waiting = 0
    rec.demanded = True  # a candidate's reads go first: only what is ahead of it counts
    assert outlook(rec, 0.0, FakeTier(0.017), cfg).backlog_s == 0.05


def test_a_query_out_for_a_while_answers_sooner():
    """The query answers ``query_s`` after it was sent, not after the demand: a tail that does not
    pay for a whole query from now pays for the rest of one already out."""
    o = ol(query_s=0.012)  # 2 blocks save 20 ms; their read takes 2 + 2 x 4 ms once the query answered
    assert not cost.worth_querying(o, 0.004, remaining=2, chunk_max=8)  # answered at 16 ms: 22 ms later
    assert cost.worth_querying(o, 0.004, remaining=2, chunk_max=8, asked_at=0.0)  # at 12 ms: 18 ms later
    assert cost.worth_querying(o, 0.020, remaining=2, chunk_max=8, asked_at=0.0)  # overdue: about now
    assert not cost.worth_querying(o, 0.004, remaining=2, chunk_max=8, asked_at=0.004)  # just sent: as before


def test_a_candidate_counts_only_what_is_left_of_the_query_already_out():
    """The machine measures the query from when it was sent (Start): a short tail that the rest of
    the query pays for keeps waiting for the answer; demanded as early as the query, it ends."""
    def demanded_at(now):
        s = Session(Params(Policy.COST_AWARE, 32, 30, 8, 2, None, outlook=ol(eta=1.0, query_s=0.012)))
        s.handle(Start(0.0))
        s.handle(Demand(now, ol(eta=now, query_s=0.012)))
        return s

    # 2 blocks save 20 ms; the query answers at 12 ms, their read lands 10 ms later
    assert demanded_at(0.004).state == State.QUERYING  # 18 ms from now: still pays (from now: 22)
    early = demanded_at(0.0)
    assert early.state == State.TERMINAL and early.status == Status.COST  # 22 ms from now: it does not


# -- while another session's probe is out ----------------------------------------------------------
def test_machine_a_queued_session_waits_for_the_evidence_not_the_prior():
    """Queued (ETA later) while another session's probe is out: nothing is planned on the prior,
    but the session stays open; the re-plan the measurement brings decides.  A candidate (ETA
    now) stops instead."""
    waiting = ol(eta=0.5, regime=FAST, unmeasured=True)
    s = Session(Params(Policy.COST_AWARE, 64, 0, 8, 2, None, outlook=waiting))
    s.handle(Start(0.0, eta_given=True))
    a = s.handle(QueryDone(64, 0.01, waiting))
    assert claims(a) == [] and not s.sealed and s.state == State.RUNNING and s.awaiting_evidence
    a = s.handle(Replan(0.02, ol(eta=0.5, regime=FAST, unmeasured=True)))  # still no evidence
    assert a == [] and s.awaiting_evidence
    a = s.handle(Replan(0.03, ol(eta=0.5, regime=FAST)))  # measured: fast, restore it all
    assert sum(c.count for c in claims(a)) > 0 and not s.awaiting_evidence
    # a candidate does not wait for the evidence
    s = Session(Params(Policy.COST_AWARE, 64, 0, 8, 2, None, outlook=waiting))
    s.handle(Start(0.0, eta_given=True))
    s.handle(QueryDone(64, 0.01, waiting))
    a = s.handle(Demand(0.02, ol(eta=0.02, regime=FAST, unmeasured=True)))
    assert finish(a) == Finish(Status.COST, 0, "cost") and not s.awaiting_evidence


def test_executor_queued_sessions_replan_when_the_probe_lands():
    """r1 (a candidate) probes; r2, queued while the probe is out, restores nothing on the
    prior but stays open, and once the probe has measured L3 (fast) both restore their whole
    prefix (r2 re-planned by the measurement, r1 by its own chunk); the books balance."""
    b = Bench(blocks=256, chunk_max_blocks=8, probe_blocks=2)
    b.tier.estimate = ReadEstimate(0.001, 0.0001, 0)  # an optimistic prior, no evidence
    first, second = b.chain("a", 40), b.chain("b", 40)
    b.prefetch("r1", first, policy="cost_aware", prefill_s_per_block=0.01)
    b.tier.answer_lookups()
    b.prefetch("r2", second, policy="cost_aware", prefill_s_per_block=0.01, eta_s=1.0)
    b.tier.answer_lookups()
    assert [len(r.keys) // 16 for r in b.tier.reads] == [2]  # r1's probe only
    assert b.poll("r1")["state"] == "running" and b.poll("r2")["state"] == "running"
    b.tier.estimate = ReadEstimate(0.001, 0.0001, 1)  # what the probe's read measures
    b.tier.run_all()
    assert b.sm.counters["replans_on_evidence"] == 1
    b.tier.run_all()
    assert terminal(b, "r2")["prefix"] == 40 and terminal(b, "r1")["prefix"] == 40
    assert b.take("r2", second) == 40 and b.take("r1", first) == 40
    s = b.books()
    assert s["staging"] == 0 and s["leases"] == 0 and s["orphans"] == 0


def test_machine_a_candidate_detaches_its_probe_at_the_deadline():
    o = ol(eta=0.0, regime=SLOW, probe_blocks=4, unmeasured=True)
    s = Session(Params(Policy.COST_AWARE, 64, 0, 8, 2, None, outlook=o))
    s.handle(Start(0.0))
    a = s.handle(QueryDone(64, 0.0, o))
    assert [c.count for c in claims(a)] == [4] and s.probe_wake_at == pytest.approx(0.04)
    assert s.handle(Replan(0.039, ol(eta=0.039, regime=SLOW, unmeasured=True))) == []  # it may still pay
    a = s.handle(Replan(0.04, ol(eta=0.04, regime=SLOW, unmeasured=True)))
    assert a == [Detach(0), Finish(Status.COST, 0, "cost")] and s.probe_wake_at is None


def test_executor_a_cost_stop_whose_reads_still_pay_waits_for_them():
    """Restoring cheaper than prefill: a demand keeps the reads (they pay), nothing is left."""
    b = Bench(blocks=64, chunk_max_blocks=4)
    b.tier.estimate = ReadEstimate(0.001, 0.002, 5)
    c = b.chain("a", 8)
    b.prefetch("r", c, policy="cost_aware", prefill_s_per_block=0.01, eta_s=1.0)
    b.tier.answer_lookups()
    b.tier.start(b.tier.reads[0])
    b.sm.op_demand(b.conn, {"req": "r"})
    b.loop.settle()
    b.tier.run_all()
    assert terminal(b, "r")["prefix"] == 8


def test_machine_a_fixed_hit_session_reads_nothing_beyond_its_plan():
    """An engine that fetches exactly the hit it was told (SGLang) gets no chunk read beyond the
    plan while queued: it could not help the request, and it would hold the read lane."""
    o = ol(eta=0.2, regime=SLOW, backlog_s=0.25)  # nothing lands by the ETA
    free = Session(Params(Policy.COST_AWARE, 64, 0, 8, 2, None, outlook=o))
    fixed = Session(Params(Policy.COST_AWARE, 64, 0, 8, 2, None, outlook=o, fixed_hit=True))
    assert free.handle(Start(0.0, eta_given=True)) == [Query(0)]  # the answer may lead to a read
    a = free.handle(QueryDone(64, 0.0, o))
    assert [c.count for c in claims(a)] == [8, 8]  # queued: read beyond the (empty) plan
    a = fixed.handle(Start(0.0, eta_given=True))  # (and for it the query cannot pay: not sent)
    assert a == [Finish(Status.COST, 0, "cost")]
    # nor does a far ETA make it read: 11 blocks would land by it (hides_behind_queue), but the
    # engine waits for all it was told, and a later ETA changes nothing
    s = Session(Params(Policy.COST_AWARE, 64, 0, 8, 2, None, outlook=ol(eta=0.2, regime=SLOW), fixed_hit=True))
    s.handle(Start(0.0))
    a = s.handle(QueryDone(64, 0.0, ol(eta=0.2, regime=SLOW)))
    assert claims(a) == [] and finish(a) == Finish(Status.COST, 0, "cost") and s.planned == 0
    assert claims(s.handle(Replan(0.001, ol(eta=1.0, regime=SLOW)))) == []


def test_executor_fixed_hit_comes_over_the_wire():
    b = Bench(blocks=64, chunk_max_blocks=4)
    b.tier.estimate = ReadEstimate(0.001, 0.02, 5)
    c = b.chain("a", 40)
    b.prefetch("r", c, policy="cost_aware", prefill_s_per_block=0.01, eta_s=0.05, fixed_hit=True)
    b.tier.answer_lookups()
    assert b.tier.reads == []  # L3 dearer than prefill: nothing for an engine that waits for its hit
    b.prefetch("q", b.chain("b", 40), policy="cost_aware", prefill_s_per_block=0.01, eta_s=0.05)
    b.tier.answer_lookups()
    assert [len(r.keys) // 16 for r in b.tier.reads] == [4, 4]  # the other: chunks behind its queue (window 2)
    with pytest.raises(ProtocolError):
        decode_request(encode({"v": PROTOCOL_VERSION, "id": 1, "op": "prefetch", "req": "r", "chain": b"k" * 16,
                               "fixed_hit": "yes"}))


@pytest.mark.parametrize("backlog,kept", [(0.0, True), (0.08, False)])
def test_a_candidate_keeps_cheap_claimed_reads_only_if_the_wait_for_them_pays(backlog, kept):
    """A pool hit's 2-block L3 tail, claimed while queued: L3 cheaper than prefill per block.
    At the demand, with the lane free the read is worth waiting for (it lands in 10 ms and saves
    20); behind 80 ms of other sessions' reads it is not: the session stops and withdraws it
    (``keep_admitted`` False), whatever the per-block cost (measured: such tails held candidates
    for 80-160 ms under load)."""
    s = Session(Params(Policy.COST_AWARE, 34, 32, 8, 2, None, outlook=ol(eta=0.5)))
    s.handle(Start(0.0))
    a = s.handle(QueryDone(2, 0.0, ol(eta=0.5)))
    assert [c.count for c in claims(a)] == [2]
    a = s.handle(Demand(0.01, ol(eta=0.01, backlog_s=backlog)))
    assert claims(a) == [] and s.sealed is (not kept)
    if kept:
        assert run_to_end(s, 0.02, ol(eta=0.01)).status == Status.COMPLETE
    else:
        assert s.status == Status.COST and not s.keep_admitted


def test_keep_admitted_weighs_the_wait_against_the_saving():
    o = ol(eta=1.0)  # restore ~0.4x prefill per block
    assert cost.keep_admitted(o, 0.5, 0.9, 1)  # lands before the prefill could start: always
    o = ol(eta=0.0)
    assert cost.keep_admitted(o, 0.0, 0.010, 2)  # 10 ms to save 2 x PREFILL
    assert not cost.keep_admitted(o, 0.0, 0.080, 2)  # 80 ms to save 2 x PREFILL
    assert not cost.keep_admitted(ol(eta=0.0, regime=SLOW), 0.0, 0.2, 8)  # dearer per block and late


@pytest.mark.parametrize("aware", [True, False])
def test_executor_cost_aware_weighs_the_older_reads_its_prefill_would_hold_up(aware):
    """Two older requests of the engine read 20 blocks each (L3 0.4x prefill: ready in ~81 and
    ~162 ms); a younger one arrives at the idle engine with 18 blocks of another prompt.  Its own
    read would land behind theirs (~235 ms), after a prefill it could start now (180 ms), so on
    its own TTFT it recomputes -- but the engine's scan, skipping the two while they read, would
    admit it first, and both would wait for the rest of its prefill.  With ``ahead_aware`` the
    session counts them (``held``: 99/180 + 18/180 of the prefill) and reads; without it, the
    policy before, it ends ``cost`` at once.  Books exact either way."""
    b = Bench(blocks=128, chunk_max_blocks=32, ahead_aware=aware)
    b.tier.estimate = ReadEstimate(0.001, 0.004, 5)
    cx, cz, cy = b.chain("x", 20), b.chain("z", 20), b.chain("y", 18)
    for req, c in (("x", cx), ("z", cz)):
        b.prefetch(req, c, policy="cost_aware", prefill_s_per_block=0.01, eta_s=0.0)
        b.tier.answer_lookups()
    assert [len(r.keys) // 16 for r in b.tier.reads] == [20, 20]  # each reads its own, one chunk
    b.prefetch("y", cy, policy="cost_aware", prefill_s_per_block=0.01, eta_s=0.0)
    b.tier.answer_lookups()
    view = b.poll("y")
    if aware:
        assert view["state"] != "terminal" and [len(r.keys) // 16 for r in b.tier.reads] == [20, 20, 18]
        assert view["held"] == pytest.approx((0.180 - 0.081) / 0.180 + (0.180 - 0.162) / 0.180, abs=1e-3)
        b.tier.run_all()
        p = terminal(b, "y")
        assert (p["status"], p["prefix"]) == ("complete", 18) and b.take("y", cy) == 18
    else:
        assert (view["state"], view["status"], view["prefix"], view["held"]) == ("terminal", "cost", 0, 0)
        assert len(b.tier.reads) == 2
        b.tier.run_all()
        assert b.take("y", cy) == 0
    assert b.take("x", cx) == 20 and b.take("z", cz) == 20
    s = b.books()
    assert s["staging"] == 0 and s["pinned"] == 0 and s["leases"] == 0


def test_executor_cost_aware_holds_no_one_whose_read_lands_after_its_prefill():
    """Only an older request of the same engine that would be ready *during* the younger one's
    prefill is held up by it.  Another engine's request (group ``h``: its own scheduler) reading
    20 blocks, ready in ~81 ms, inside the younger one's 100 ms prefill, is not; an older request
    of this engine whose 60-block read lands after it (~322 ms) is not.  So ``held`` is 0 and
    the younger request recomputes, as it would alone (its own read would land in ~363 ms)."""
    b = Bench(blocks=256, chunk_max_blocks=64)
    b.tier.estimate = ReadEstimate(0.001, 0.004, 5)
    other = Conn(group="h", slot=1)
    b.loop.clients[1] = other
    co, cx, cy = b.chain("o", 20), b.chain("x", 60), b.chain("y", 10)
    b.prefetch("o", co, conn=other, policy="cost_aware", prefill_s_per_block=0.01, eta_s=0.0)
    b.tier.answer_lookups()
    b.prefetch("x", cx, policy="cost_aware", prefill_s_per_block=0.01, eta_s=0.0)
    b.tier.answer_lookups()
    assert [len(r.keys) // 16 for r in b.tier.reads] == [20, 60]
    assert b.poll("x")["held"] == 0  # (o is older, but of the other engine)
    b.prefetch("y", cy, policy="cost_aware", prefill_s_per_block=0.01, eta_s=0.0)
    b.tier.answer_lookups()
    p = terminal(b, "y")
    assert (p["status"], p["prefix"], p["held"]) == ("cost", 0, 0)
    b.tier.run_all()
    assert b.take("x", cx) == 60 and b.take("y", cy) == 0
    got = b.core.op_get(other, {"chain": co, "req": "o"})  # (o's engine takes its own result)
    assert got["count"] == 20
    b.core.op_release(other, {"lease": got["lease"]})
    s = b.books()
    assert s["staging"] == 0 and s["pinned"] == 0 and s["leases"] == 0


def test_executor_cost_aware_counts_an_older_request_ready_when_its_whole_plan_has_landed():
    """An older request reads 40 blocks a window (2 chunks of 4) at a time (L3 0.6x prefill: the
    chunk does not grow): the lane holds 8 of them (~50 ms); the other 32 (~192 ms) are claimed
    as those land.  It is ready when its whole plan has landed (~242 ms), after a younger
    request's 10-block prefill (100 ms, the engine idle) would end, so that prefill holds it up
    not at all: ``held`` 0, and the younger request, whose own read would land after its
    prefill (~113 ms), recomputes.  Counting only the lane's queue, the older one would look
    ready in ~50 ms, held half the prefill, and the younger one would read for it."""
    b = Bench(blocks=128, chunk_max_blocks=4)
    b.tier.estimate = ReadEstimate(0.001, 0.006, 5)
    cx, cy = b.chain("x", 40), b.chain("y", 10)
    b.prefetch("x", cx, policy="cost_aware", prefill_s_per_block=0.01, eta_s=0.0)
    b.tier.answer_lookups()
    assert [len(r.keys) // 16 for r in b.tier.reads] == [4, 4]
    b.prefetch("y", cy, policy="cost_aware", prefill_s_per_block=0.01, eta_s=0.0)
    b.tier.answer_lookups()
    p = terminal(b, "y")
    assert (p["status"], p["prefix"], p["held"]) == ("cost", 0, 0)
    assert len(b.tier.reads) == 2
    b.tier.run_all()
    assert b.take("x", cx) == 40 and b.take("y", cy) == 0
    s = b.books()
    assert s["staging"] == 0 and s["pinned"] == 0 and s["leases"] == 0


def test_a_session_ended_at_its_start_is_observed_after_the_pass_and_its_scan_plans_nothing():
    """Idle engine, 32 blocks resident and a 2-block tail in an L3 dearer per block than prefill:
    the session ends at its start (`cost`, prefix 32; nothing is read, not even queried).  The
    observers (metrics, the log line, the write-behind gate) see it once the loop runs what was
    posted -- after the replies of the pass it ended in, not on the path of the ops behind it --
    and exactly once.  The engine's scan that then demands it (a poll with demand and an ETA of
    now, from every rank) plans nothing: no outlook is built (the tier's estimates are not
    asked), and the view is the same terminal one."""
    b = Bench(blocks=512, chunk_max_blocks=4)
    b.tier.estimate = ReadEstimate(0.002, 0.010, 10)
    seen = []
    b.sm.observer = type("Seen", (), {"session_ended": lambda self, o: seen.append((o.status, o.prefix))})()
    c = b.chain("r", 34)
    b.resident(c, 32)
    v = b.sm.op_prefetch(b.conn, {"req": "r", "chain": c, "policy": "cost_aware", "prefill_s_per_block": 0.0032,
                                  "eta_s": 0.0})
    assert (v["state"], v["status"], v["prefix"]) == ("terminal", "cost", 32)
    assert seen == [] and b.tier.lookups == []  # (ended at its start: no L3 query)
    b.loop.settle()
    assert seen == [("cost", 32)]
    asked = []
    look = b.tier.read_outlook
    b.tier.read_outlook = lambda *a, **k: (asked.append(a), look(*a, **k))[1]
    for rank in range(2):
        p = b.sm.op_poll(Conn(rank=rank, size=2), {"req": "r", "demand": True, "eta_s": 0.0, "waiting": 0})
        assert {k: p[k] for k in ("state", "status", "prefix")} == {"state": "terminal", "status": "cost", "prefix": 32}
    assert asked == [] and b.sm.records[("g", "r", 0)].demanded
    b.loop.settle()
    assert seen == [("cost", 32)]
    assert b.take("r", c) == 32 and b.books()["leases"] == 0
