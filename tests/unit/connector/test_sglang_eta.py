"""The pure core of cost_aware's SGLang ETA (kvsidecar.connector.sglang_eta): work ahead in
admission order, SGLang's prefill rate, the material-change rule, and the scheduler glue's
hand-off to a sender thread (it never blocks the scheduler; a full queue drops and counts)."""

import threading
import types

import pytest

from kvsidecar.connector.sglang_eta import (Ahead, EtaPlanner, PrefillRate, Queued, SchedulerEta, batch_start,
                                            material, prefill_budget, shared_prefix, work_ahead)


def test_work_ahead_in_admission_order_after_the_chunked_request():
    q = [Queued("a", 0, 100), Queued("b", 1, 0), Queued("c", 0, 50), Queued("d", 0, -3)]
    assert work_ahead(30, q) == [Ahead("a", 0, 30, 3), Ahead("b", 1, 130, 2), Ahead("c", 0, 130, 1),
                                 Ahead("d", 0, 180, 0)]  # (no first page known: every one behind counts)
    assert work_ahead(0, []) == []


def test_work_ahead_counts_behind_each_request_those_its_prefill_holds_up():
    """``waiting``: the requests behind that do not start with its first page (one that does
    gets the shared pages from this one's prefill or restore either way)."""
    q = [Queued("a", 0, 100, (1, 2)), Queued("b", 0, 100, (3, 4)), Queued("a2", 0, 40, (1, 2)),
         Queued("c", 0, 100, None)]
    assert [a.waiting for a in work_ahead(0, q)] == [2, 2, 1, 0]


def test_planner_sends_a_material_change_of_what_a_prefill_holds_up():
    p = EtaPlanner()
    rate = 1e-3
    assert [(u.rid, u.waiting) for u in p.plan([Ahead("a", 0, 400, 0)], rate, now=1.0)] == [("a", 0)]
    assert p.plan([Ahead("a", 0, 400, 0)], rate, now=1.0) == []
    sent = p.plan([Ahead("a", 0, 400, 5)], rate, now=1.0)  # weight 1 -> 6: sent, with the same ETA
    assert [(u.rid, u.eta_s, u.waiting) for u in sent] == [("a", pytest.approx(0.4), 5)]
    assert p.plan([Ahead("a", 0, 400, 6)], rate, now=1.0) == []  # 6 -> 7: +17 %, not material
    assert p.last_waiting("a", 0) == 5
    assert [u.waiting for u in p.plan([Ahead("a", 0, 400, 8)], rate, now=1.0)] == [8]  # 6 -> 9: sent


def test_shared_prefix_is_whole_pages_any_request_ahead_starts_with():
    sys_prompt = list(range(100, 164))  # 64 tokens: 4 pages of 16
    a = sys_prompt + [1] * 20
    b = sys_prompt[:40] + [2] * 30  # shares 2 whole pages (and 8 tokens of a third)
    assert shared_prefix(a, [], 16) == 0
    assert shared_prefix(a, [b], 16) == 32
    assert shared_prefix(a, [b, sys_prompt + [1] * 16 + [9]], 16) == 80  # the longest, whole pages only
    assert shared_prefix([5] * 64, [a, b], 16) == 0


def test_a_request_sharing_a_prefix_with_one_ahead_counts_only_the_rest():
    """The ETA's work ahead: a request starting with the pages of one queued before it (or the
    chunked one) computes only the rest -- the radix cache holds that prefix by its turn."""
    sysp = list(range(1000, 1064))  # 4 pages of 16
    sched = _scheduler([("a", 0, 0, sysp + [1] * 16), ("b", 0, 0, sysp + [2] * 16), ("c", 0, 16, sysp[:16] + [3] * 48),
                        ("d", 0, 0, [4] * 80)], chunked=("x", 0, 0, sysp[:32] + [5] * 8))
    eta = SchedulerEta(16, sender=False, send=lambda b: [], tracked=lambda r, a: True, history=4,
                       skip_warm_up=False)
    eta.on_iteration(sched)
    # chunked x: 40 tokens, none computed; a shares 32 with x, b shares 64 with a, c shares 16
    # (which its own device match already covers), d shares nothing
    assert eta.history[-1][1] == (("a", 40), ("b", 40 + 48), ("c", 40 + 48 + 16), ("d", 40 + 48 + 16 + 48))
    got, _ = eta.at_queue_entry(sched, "e", 0)
    assert got is None  # (no prefill rate yet)
    eta.rate.s_per_token = 1e-3
    assert eta.at_queue_entry(sched, "e", 0)[0] == pytest.approx((40 + 48 + 16 + 48 + 80) * 1e-3)


def test_prefill_rate_skips_the_warm_up_increment():
    """SGLang's warm-up (two batches of 3 and 1 tokens, seconds of compilation) merges with the
    first real prompt's batch into the first complete increment: not counted."""
    r = PrefillRate(window=16, min_tokens=64)
    assert r.observe(0, 0) is None  # the first look: before the warm-up
    assert r.observe(2_000_000, 3) is None and r.observe(3_000_000, 4) is None  # warm-up: too few tokens
    assert r.observe(3_010_000, 68) is None  # warm-up + a 64-token prompt: dropped
    assert r.observe(3_050_000, 708) == pytest.approx(40e-3 / 640)
    assert r.observe(3_090_000, 1348) == pytest.approx(80e-3 / 1280)


def test_prefill_rate_is_sglangs_recent_ratio_and_the_warm_up_ages_out():
    r = PrefillRate(window=2, min_tokens=64, skip_first=False)
    assert r.observe(5_000_000, 8) is None  # the first look is a baseline (here: SGLang's warm-up)
    assert r.observe(5_000_500, 40) is None and r.per_block(16) is None  # 32 tokens: too few to judge
    assert r.observe(5_040_000, 1064) == pytest.approx(40e-3 / 1056)  # merged with the small one
    assert r.observe(5_060_000, 2088) == pytest.approx(60e-3 / 2080)
    assert r.observe(5_070_000, 3112) == pytest.approx(30e-3 / 2048)  # the window slid
    assert r.per_block(16) == pytest.approx(16 * 30e-3 / 2048)
    assert r.observe(0, 0) == pytest.approx(30e-3 / 2048)  # counters reset: a new baseline, rate kept
    assert r.observe(20_000, 1024) == pytest.approx(30e-3 / 2048)  # (10 ms + 20 ms) / 2,048 tokens


@pytest.mark.parametrize("prev,new,sent", [(None, 0.0, True), (1.0, 1.19, False), (1.0, 1.21, True),
                                           (0.1, 0.14, False), (0.1, 0.16, True), (0.01, 0.0, False),
                                           (0.3, 0.24, False), (0.3, 0.23, True)])
def test_material_change_is_20_percent_or_50_ms(prev, new, sent):
    assert material(prev, new) is sent


def test_planner_sends_only_material_moves_and_counts_the_last_eta_down():
    p = EtaPlanner()
    rate = 1e-3  # 1 ms per token
    ahead = [Ahead("a", 0, 0), Ahead("b", 0, 400)]
    assert [(u.rid, u.eta_s) for u in p.plan(ahead, rate, now=10.0)] == [("a", 0.0), ("b", pytest.approx(0.4))]
    assert p.plan(ahead, rate, now=10.0) == []  # nothing moved
    # 0.2 s later b's last ETA stands at 0.2 s: unchanged work ahead (0.4 s) is a material move
    assert [(u.rid, u.eta_s) for u in p.plan(ahead, rate, now=10.2)] == [("b", pytest.approx(0.4))]
    assert p.plan([Ahead("b", 0, 430)], rate, now=10.2) == []  # +30 ms, +7.5 %: not material
    assert p.plan(ahead, None, now=11.0) == []  # no rate yet: no ETA
    assert p.plan(ahead, rate, now=12.0, tracked=lambda rid, a: rid == "a") == []  # a's ETA is 0 still
    p.forget([("a", 0)])
    assert p.last("b", 0, 12.0) is None and p.last("a", 0, 12.0) == 0.0


def _scheduler(queue, busy_us=0, tokens=0, chunked=None, **budget):
    def req(rid, n, prefix=0, ids=None):
        ids = ids if ids is not None else [ord(rid[0])] * n  # (distinct requests share no page)
        return types.SimpleNamespace(rid=rid, origin_input_ids=ids, output_ids=[], prefix_len=prefix,
                                     host_hit_length=0, cache_request_handle=types.SimpleNamespace(attempt_id=0))
    return types.SimpleNamespace(waiting_queue=[req(*q) for q in queue], total_prefill_busy_us=busy_us,
                                 total_prefill_uncached_tokens=tokens,
                                 chunked_req=req(*chunked) if chunked else None, **budget)


def test_batch_start_counts_whole_batches_ahead():
    assert [batch_start(t, 100) for t in (0, 1, 99, 100, 101, 250)] == [0, 0, 0, 100, 100, 200]
    assert batch_start(250, 0) == 250 and batch_start(-5, 100) == 0  # unknown budget: every token ahead
    assert prefill_budget(types.SimpleNamespace(chunked_prefill_size=4096, max_prefill_tokens=16384)) == 4096
    assert prefill_budget(types.SimpleNamespace(chunked_prefill_size=-1, max_prefill_tokens=16384)) == 16384
    assert prefill_budget(types.SimpleNamespace()) == 0


def test_a_request_within_the_next_batch_starts_now_and_later_ones_wait_whole_batches():
    """SGLang fills a prefill batch with up to ``chunked_prefill_size`` tokens in admission order
    (the last request cut into a chunk), and every request of the batch starts with it: the ETA
    is 0 for exactly the requests ``admissible_now`` admits, then one batch's prefill per batch
    ahead -- not every token ahead (the second request of a batch was told one prefill too long)."""
    from kvsidecar.connector.sglang_plugin import admissible_now

    sent = []
    queue = [("a", 60), ("b", 60), ("c", 60), ("d", 60), ("e", 60)]
    sched = _scheduler(queue, chunked=("x", 30), chunked_prefill_size=100, max_prefill_tokens=1000)
    eta = SchedulerEta(16, sender=True, send=lambda b: sent.extend((u.rid, u.eta_s) for u in b) or [], tracked=lambda r, a: True,
                       history=2, skip_warm_up=False)
    eta.planner = EtaPlanner(rel=-1.0, abs_s=-1.0)
    eta._hand_off = lambda updates: sent.extend((u.rid, u.eta_s) for u in updates)  # (the plan, not the thread)
    eta.rate.s_per_token = 1e-3
    eta.on_iteration(sched)
    # tokens ahead: x's 30, then 60 per request: a 30, b 90, c 150, d 210, e 270
    assert eta.history[-1][1] == (("a", 30), ("b", 90), ("c", 150), ("d", 210), ("e", 270))
    assert sent == [("a", 0.0), ("b", 0.0), ("c", pytest.approx(0.1)), ("d", pytest.approx(0.2)), ("e", pytest.approx(0.2))]
    now = admissible_now(sched)
    assert [r for r, _ in queue if now(types.SimpleNamespace(rid=r))] == [r for r, e in sent if e == 0.0]
    # a request joining the queue: 330 tokens ahead, so it starts with the fourth batch
    assert eta.at_queue_entry(sched, "f", 0)[0] == pytest.approx(0.3)
    sched.chunked_prefill_size = -1  # no chunking: the budget is max_prefill_tokens, one batch for all
    assert eta.at_queue_entry(sched, "f", 0)[0] == 0.0


def test_scheduler_glue_sends_from_rank_0_only_on_its_sender_thread():
    sent, done, threads = [], threading.Event(), set()

    def send(batch):
        threads.add(threading.current_thread().name)
        sent.extend((u.rid, round(u.eta_s, 6)) for u in batch)
        if len(sent) == 2:
            done.set()
        return ["running"] * len(batch)

    now = [100.0]
    sched = _scheduler([("a", 1024, 0), ("b", 2048, 1024)], busy_us=20_000, tokens=1024, chunked=("c", 512, 256))
    before = _scheduler([], busy_us=0, tokens=0)
    r0 = SchedulerEta(16, sender=True, send=send, tracked=lambda rid, a: True, clock=lambda: now[0], history=8,
                       skip_warm_up=False)
    r1 = SchedulerEta(16, sender=False, send=send, tracked=lambda rid, a: True, clock=lambda: now[0], history=8,
                       skip_warm_up=False)
    for eta in (r0, r1):
        eta.on_iteration(before)  # the rate's baseline
        eta.on_iteration(sched)
    assert done.wait(5.0)
    rate = 20e-3 / 1024
    assert sorted(sent) == [("a", round(256 * rate, 6)), ("b", round((256 + 1024) * rate, 6))]
    assert threads == {"kvsidecar-eta"}
    assert r0.history == r1.history == type(r0.history)([(2, (("a", 256), ("b", 1280)))])
    # queue entry: the new request waits for everything queued; its prefetch gets that ETA
    eta, per_block = r0.at_queue_entry(sched, "d", 0)
    assert eta == pytest.approx((256 + 1024 + 1024) * rate) and per_block == pytest.approx(16 * rate)
    now[0] += 0.01
    assert r0.prefetch_inputs("d", 0) == (pytest.approx(eta - 0.01), pytest.approx(per_block))
    r0.close()
    r1.close()


def test_a_blocked_sender_never_blocks_the_scheduler():
    gate = threading.Event()
    eta = SchedulerEta(16, sender=True, send=lambda batch: [gate.wait(5.0)] * len(batch), tracked=lambda r, a: True, queue_batches=2,
                       skip_warm_up=False)
    sched = _scheduler([("a", 1024)], busy_us=10_000, tokens=1000, chunked=("c", 512))
    eta.on_iteration(_scheduler([], busy_us=0, tokens=0))
    eta.planner = EtaPlanner(rel=-1.0, abs_s=-1.0)  # every iteration is material: one batch each
    for _ in range(10):
        eta.on_iteration(sched)  # returns at once although the sender is stuck
    assert eta.counters["batches"] + eta.counters["batches_dropped"] == 10
    assert eta.counters["batches_dropped"] >= 7
    gate.set()
    eta.close()


def test_an_iterations_updates_go_in_one_round_trip_and_a_failed_one_leaves_the_books_straight():
    calls, done = [], threading.Event()
    answers = [lambda b: ["running", "terminal"], lambda b: 1 / 0, lambda b: ["running"]]

    def send(batch):
        calls.append([u.rid for u in batch])
        try:
            return answers[len(calls) - 1](batch)
        finally:
            if len(calls) == 3:
                done.set()

    eta = SchedulerEta(16, sender=True, send=send, tracked=lambda r, a: True, skip_warm_up=False)
    eta.planner = EtaPlanner(rel=-1.0, abs_s=-1.0)  # every iteration is material: one batch each
    eta.on_iteration(_scheduler([], busy_us=0, tokens=0))
    for ahead in (512, 1024, 2048):  # the chunked prefill ahead grows: both ETAs move every time
        eta.on_iteration(_scheduler([("a", 1024), ("b", 2048)], busy_us=10_000, tokens=1000, chunked=("c", ahead)))
    assert done.wait(5.0)
    eta.close()
    assert calls == [["a", "b"]] * 3  # one send per iteration, every update of it in order
    c = eta.counters
    assert (c["batches"], c["round_trips"], c["sent"], c["send_failed"]) == (3, 2, 4, 2)
    assert (c["sent_running"], c["sent_terminal"]) == (2, 1)
    # a short answer: the update it did not cover is logged without a state
    assert [state for _rid, _eta, _w, state in eta.sent_log] == ["running", "terminal", "running", None]
