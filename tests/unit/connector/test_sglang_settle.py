"""HitSettler on a deterministic bench: SGLang's storage hand-offs modelled with real
``queue.Queue`` objects and real threads (the prefetch thread's answers, the I/O thread's
completions), and a TP group of two such caches whose collective drain takes the MIN of the
ranks' queue sizes, as SGLang's does.  The genuine-SGLang path is covered by
tests/sglang/test_full_server.py (slow) and measured by scripts.sglang_ttft."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time

import pytest

from kvsidecar.connector.sglang_settle import HitSettler, answered, completed, lazily, wait_in_queue


@dataclasses.dataclass(frozen=True)
class Handle:
    rid: str
    attempt_id: int = 0


class Op:
    def __init__(self, rid):
        self.request_id = rid
        self.hit = 0


@dataclasses.dataclass
class Info:
    host_indices: object
    operation: Op


@dataclasses.dataclass
class Ack:
    operation: Op
    completed_req: bool | None = None


class Group:
    """The collective: every rank's drain meets here; each takes MIN(queue sizes) items."""

    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=5)
        self.sizes = [None] * n
        self.lock = threading.Lock()

    def min_sizes(self, rank, sizes):
        with self.lock:
            self.sizes[rank] = sizes
        self.barrier.wait()
        out = tuple(min(s[i] for s in self.sizes) for i in range(len(sizes)))
        self.barrier.wait()
        return out


class Cache:
    """What the settler touches of SGLang's UnifiedRadixCache: ``ongoing_prefetch``, the
    controller's two queues, and the collective ``drain_storage_control_queues``."""

    def __init__(self, rank=0, group=None):
        self.rank = rank
        self.group = group
        self.cache_controller = type("CC", (), {})()
        self.cache_controller.prefetch_hit_queue = queue.Queue()
        self.cache_controller.ack_prefetch_queue = queue.Queue()
        self.ongoing_prefetch: dict = {}
        self.drains = 0
        self.ready: list = []  # requests whose prefetch finished (left ongoing_prefetch), in order

    def enter(self, rid):
        h, op = Handle(rid), Op(rid)
        self.ongoing_prefetch[h] = Info(None, op)
        return h, op

    def drain_storage_control_queues(self):
        cc = self.cache_controller
        sizes = (cc.prefetch_hit_queue.qsize(), cc.ack_prefetch_queue.qsize())
        n_hit, n_ack = self.group.min_sizes(self.rank, sizes) if self.group else sizes
        self.drains += 1
        for _ in range(n_hit):
            op = cc.prefetch_hit_queue.get_nowait()
            h = Handle(op.request_id)
            if op.hit == 0:
                del self.ongoing_prefetch[h]  # revoked: a miss
                self.ready.append(h)
            else:
                self.ongoing_prefetch[h] = Info(["pages"], op)
        for _ in range(n_ack):
            ack = cc.ack_prefetch_queue.get_nowait()
            if ack.completed_req:
                h = Handle(ack.operation.request_id)
                del self.ongoing_prefetch[h]
                self.ready.append(h)


def later(delay_s, fn):
    t = threading.Timer(delay_s, fn)
    t.start()
    return t


def answer(cache, op, hit, delay_s=0.0):
    def put():
        op.hit = hit
        cache.cache_controller.prefetch_hit_queue.put(op)
    return later(delay_s, put) if delay_s else put()


def complete(cache, op, delay_s=0.0):
    def put():
        cache.cache_controller.ack_prefetch_queue.put(Ack(op))  # a progress ack first, then the completion
        cache.cache_controller.ack_prefetch_queue.put(Ack(op, completed_req=True))
    return later(delay_s, put) if delay_s else put()


def test_a_resident_hit_is_ready_in_the_iteration_that_sent_its_query():
    cache = Cache()
    h, op = cache.enter("r1")
    s = HitSettler(1.0, resident=lambda req: True)
    timers = [answer(cache, op, 4, delay_s=0.02)]
    # the I/O thread starts when the drain allocates: model it as completing 20 ms after the answer
    timers.append(later(0.05, lambda: complete(cache, op)))
    t0 = time.monotonic()
    s.settle(cache)
    took = time.monotonic() - t0
    assert cache.ready == [h] and not cache.ongoing_prefetch
    assert cache.drains == 2 and s.stats.rounds_query == 1 and s.stats.rounds_copy == 1
    assert s.stats.waits_met == 2 and s.stats.waits_timed_out == 0
    assert took < 0.9  # woken by the puts, not by the deadline
    for t in timers:
        t.join()


def test_a_miss_is_revoked_in_the_same_iteration_with_no_copy_round():
    cache = Cache()
    h, op = cache.enter("r1")
    s = HitSettler(1.0, resident=lambda req: True)
    t = answer(cache, op, 0, delay_s=0.01)
    s.settle(cache)
    t.join()
    assert cache.ready == [h] and cache.drains == 1 and s.stats.rounds_copy == 0


def test_a_hit_not_resident_is_not_waited_for_but_still_drained():
    cache = Cache()
    h, op = cache.enter("r1")
    answer(cache, op, 4)
    s = HitSettler(1.0, resident=lambda req: False)
    t0 = time.monotonic()
    s.settle(cache)
    assert time.monotonic() - t0 < 0.5
    assert cache.ongoing_prefetch[h].host_indices is not None and cache.ready == []
    assert cache.drains == 2 and s.stats.waits_met == 1 and s.stats.rounds_copy == 1
    # the next iteration: no round for it again (each operation gets one of each kind)
    s.settle(cache)
    assert cache.drains == 2
    complete(cache, op)  # SGLang's own drain takes the completion at a later iteration
    cache.drain_storage_control_queues()
    assert cache.ready == [h]


def test_an_admissible_hit_still_reading_is_stopped_and_its_copy_waited_for():
    """Not resident, but the request can prefill now: the settler tells the session (``stop``)
    and, as the session is ending, waits for the copy -- the request is ready in this iteration
    instead of a forward pass later."""
    cache = Cache()
    h, op = cache.enter("r1")
    answer(cache, op, 4)
    timers = []

    def stop(req):
        assert req == h
        timers.append(later(0.03, lambda: complete(cache, op)))  # its last read lands, then the copy
        return True
    s = HitSettler(2.0, resident=lambda req: False, stop=stop)
    t0 = time.monotonic()
    s.settle(cache)
    assert time.monotonic() - t0 < 1.5  # woken by the completion, not the deadline
    assert cache.ready == [h] and cache.drains == 2
    assert (s.stats.stops, s.stats.stops_ended, s.stats.waits_met) == (1, 1, 2)
    for t in timers:
        t.join()


def test_a_session_that_goes_on_is_not_waited_for():
    """``stop`` says the session goes on (``wait_complete``, ``timeout``): drained, not waited for."""
    cache = Cache()
    h, op = cache.enter("r1")
    answer(cache, op, 4)
    s = HitSettler(2.0, resident=lambda req: False, stop=lambda req: False)
    t0 = time.monotonic()
    s.settle(cache)
    assert time.monotonic() - t0 < 1.0 and cache.ready == [] and cache.drains == 2
    assert (s.stats.stops, s.stats.stops_ended, s.stats.waits_timed_out) == (1, 0, 0)


def test_stop_is_asked_only_of_admissible_requests_whose_hit_is_not_resident():
    cache = Cache()
    (h1, op1), (h2, op2), (h3, op3) = cache.enter("r1"), cache.enter("r2"), cache.enter("r3")
    for op in (op1, op2, op3):
        answer(cache, op, 4)
    asked = []

    def stop(req):
        asked.append(req.rid)
        return False
    s = HitSettler(0.05, resident=lambda req: req.rid == "r1", stop=stop)
    s.settle(cache, admissible=lambda req: req.rid != "r3")
    assert asked == ["r2"]  # r1 resident (waited for), r3 not a candidate this iteration
    s.settle(cache, admissible=lambda req: True)  # r3's turn; r2 had its round
    assert asked == ["r2", "r3"]


def test_a_late_answer_costs_at_most_the_budget_once():
    cache = Cache()
    h, op = cache.enter("r1")
    s = HitSettler(0.05, resident=lambda req: True)
    t0 = time.monotonic()
    s.settle(cache)
    assert 0.04 <= time.monotonic() - t0
    assert s.stats.waits_timed_out == 1 and cache.drains == 1 and h in cache.ongoing_prefetch
    t0 = time.monotonic()
    s.settle(cache)  # already given its query round: no second wait, no drain
    assert time.monotonic() - t0 < 0.04 and cache.drains == 1
    answer(cache, op, 0)
    cache.drain_storage_control_queues()  # SGLang's own drain, next iteration
    assert cache.ready == [h]


def test_nothing_in_flight_costs_no_drain():
    cache = Cache()
    s = HitSettler(1.0, resident=lambda req: True)
    s.settle(cache)
    assert cache.drains == 0 and s.stats.rounds_query == 0


def test_the_admissible_walk_is_built_only_when_something_is_in_flight_and_once_per_iteration():
    """The plugin's ``admissible`` walks SGLang's waiting queue; built ``lazily``, an iteration
    with no prefetch in flight (most of them) never builds it, and one with several requests in
    flight builds it once and asks it of each."""
    builds, asked = [], []

    def build():
        builds.append(1)
        return lambda req: asked.append(req.rid) or req.rid != "r2"

    cache = Cache()
    s = HitSettler(0.05, resident=lambda req: True)
    s.settle(cache, lazily(build))
    assert builds == [] and asked == [] and cache.drains == 0
    (h1, op1), (h2, op2) = cache.enter("r1"), cache.enter("r2")
    answer(cache, op1, 0)  # a miss: revoked at the drain
    s.settle(cache, lazily(build))
    assert builds == [1] and sorted(asked) == ["r1", "r2"]  # one walk, asked of both
    assert cache.ready == [h1] and s.stats.rounds_query == 1 and h2 in cache.ongoing_prefetch
    asked.clear()
    drains = cache.drains
    s.settle(cache, lazily(build))  # r2 still in flight: the next iteration builds its own walk
    assert builds == [1, 1] and asked == ["r2"] and cache.drains == drains  # (still not admissible: no round)


@pytest.mark.parametrize("failing", ["resident", "stop"])
def test_a_failing_callback_is_a_no_not_a_crash(failing):
    """The residency check or the stop raising (the backend gone) counts as a no: only the
    query is waited for, and the scheduler goes on."""
    cache = Cache()
    h, op = cache.enter("r1")
    answer(cache, op, 4)

    def boom(req):
        raise RuntimeError("backend gone")
    s = (HitSettler(1.0, resident=boom) if failing == "resident"
         else HitSettler(1.0, resident=lambda req: False, stop=boom))
    s.settle(cache)
    assert cache.drains == 2 and cache.ready == [] and s.stats.waits_met == 1  # the query wait only


def test_tp_ranks_make_the_same_collective_calls_when_one_rank_waits_in_vain():
    """Rank 1's answer never comes within the budget: both ranks still call the drain the same
    number of times (the decision is made from ``ongoing_prefetch``), the MIN takes nothing
    from either, and the request stays for a later iteration on both ranks."""
    group = Group(2)
    caches = [Cache(r, group) for r in range(2)]
    ops = [c.enter("r1")[1] for c in caches]
    answer(caches[0], ops[0], 4)  # rank 0 answers; rank 1 does not
    settlers = [HitSettler(0.1, resident=lambda req: True) for _ in range(2)]
    errors = []

    def run(r):
        try:
            settlers[r].settle(caches[r])
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert not errors and not any(t.is_alive() for t in ts)
    assert [c.drains for c in caches] == [1, 1]
    assert all(c.ongoing_prefetch[Handle("r1")].host_indices is None for c in caches)  # MIN(1, 0) = 0 taken
    assert settlers[0].stats.waits_met == 1 and settlers[1].stats.waits_timed_out == 1


def test_tp_ranks_both_settle_a_hit_whose_copy_lands_on_each():
    group = Group(2)
    caches = [Cache(r, group) for r in range(2)]
    handles_ops = [c.enter("r1") for c in caches]
    timers = []
    for c, (_h, op) in zip(caches, handles_ops):
        timers.append(answer(c, op, 4, delay_s=0.01))
        timers.append(later(0.04, lambda c=c, op=op: complete(c, op)))
    settlers = [HitSettler(2.0, resident=lambda req: True) for _ in range(2)]
    ts = [threading.Thread(target=settlers[r].settle, args=(caches[r],)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    for t in timers:
        t.join()
    assert [c.ready for c in caches] == [[Handle("r1")], [Handle("r1")]]
    assert [c.drains for c in caches] == [2, 2]


def test_wait_in_queue_is_woken_by_a_put_and_bounded():
    q = queue.Queue()
    op = Op("x")
    later(0.02, lambda: q.put(op))
    t0 = time.monotonic()
    assert wait_in_queue(q, answered([op]), time.monotonic() + 5)
    assert time.monotonic() - t0 < 2
    other = Op("y")
    assert not wait_in_queue(q, answered([other]), time.monotonic() + 0.02)
    q.put(Ack(other))  # progress only: not a completion
    assert not wait_in_queue(q, completed([other]), time.monotonic() + 0.02)
    q.put(Ack(other, completed_req=True))
    assert wait_in_queue(q, completed([other]), time.monotonic())


def test_the_budget_must_be_positive():
    with pytest.raises(ValueError):
        HitSettler(0, resident=lambda req: True)


def test_a_request_that_cannot_start_this_iteration_gets_no_round_and_no_drain():
    cache = Cache()
    h, op = cache.enter("deep")
    answer(cache, op, 4)
    s = HitSettler(1.0, resident=lambda req: True)

    def admissible(req):
        return req.rid != "deep"
    s.settle(cache, admissible)
    assert cache.drains == 0 and s.stats.rounds_query == 0 and cache.ongoing_prefetch[h].host_indices is None
    h2, op2 = cache.enter("head")
    answer(cache, op2, 0)
    s.settle(cache, admissible)  # the head one is settled (and the drain takes whatever every rank has)
    assert cache.drains == 1 and h2 in cache.ready


@dataclasses.dataclass
class Req:
    rid: str
    origin_input_ids: list
    prefix_len: int = 0


class Sched:
    def __init__(self, waiting, chunked=None, chunked_prefill_size=4096, max_prefill_tokens=16384):
        self.waiting_queue = waiting
        self.chunked_req = chunked
        self.chunked_prefill_size = chunked_prefill_size
        self.max_prefill_tokens = max_prefill_tokens


def test_admissible_now_counts_the_uncached_tokens_ahead_against_one_iterations_budget():
    from kvsidecar.connector.sglang_plugin import admissible_now

    q = [Req("a", [1] * 2048), Req("b", [1] * 2048, prefix_len=1024), Req("c", [1] * 2048), Req("d", [1] * 16)]
    now = admissible_now(Sched(q))
    assert [now(Handle(r)) for r in "abcd"] == [True, True, True, False]  # 0, 2048, 3072, 5120 ahead
    assert admissible_now(Sched(q, chunked=Req("x", [1] * 4096)))(Handle("a")) is False
    assert admissible_now(Sched(q, chunked_prefill_size=-1, max_prefill_tokens=1000))(Handle("b")) is False
    assert admissible_now(None)(Handle("a")) is True  # before the scheduler is known
    assert now(Handle("gone")) is True
