"""BackgroundCalls: hand-off without waiting, in order, never lost; bounded flush and close."""

from __future__ import annotations

import threading

import pytest

from kvsidecar.connector.background_calls import BackgroundCalls


def test_calls_run_once_each_in_submission_order():
    bg = BackgroundCalls("t-order")
    seen = []
    for i in range(200):
        assert bg.submit(lambda i=i: seen.append(i))
    assert bg.flush(10.0)
    assert seen == list(range(200)) and bg.pending() == 0 and bg.failed == 0
    assert bg.close(10.0)


def test_no_thread_until_the_first_submit():
    before = {t.name for t in threading.enumerate()}
    bg = BackgroundCalls("t-lazy-unique")
    assert "t-lazy-unique" not in {t.name for t in threading.enumerate()} - before
    assert bg.close(1.0)  # closing an unused one is immediate and starts nothing
    assert "t-lazy-unique" not in {t.name for t in threading.enumerate()}


def test_submit_does_not_wait_for_a_call_that_blocks():
    bg = BackgroundCalls("t-block")
    gate, ran = threading.Event(), []
    assert bg.submit(lambda: gate.wait(30))
    assert bg.submit(lambda: ran.append(1))  # queued behind the blocked call, returned at once
    assert bg.pending() == 2 and ran == []
    assert not bg.flush(0.05)  # bounded: the deadline passes while the first call blocks
    gate.set()
    assert bg.flush(10.0) and ran == [1]
    assert bg.close(10.0)


def test_a_full_hand_off_says_so_and_the_caller_runs_the_call():
    bg = BackgroundCalls("t-full", limit=2)
    gate = threading.Event()
    started = threading.Event()
    assert bg.submit(lambda: (started.set(), gate.wait(30)))
    assert started.wait(10)  # the first call left the queue: two more fit
    assert bg.submit(lambda: None) and bg.submit(lambda: None)
    assert not bg.submit(lambda: None)  # full: not queued, never lost silently
    gate.set()
    assert bg.close(10.0) and bg.dropped == 0


def test_a_failing_call_is_counted_and_the_next_ones_run():
    bg = BackgroundCalls("t-fail")
    seen = []

    def boom():
        raise RuntimeError("sidecar said no")

    assert bg.submit(boom) and bg.submit(lambda: seen.append("after"))
    assert bg.flush(10.0)
    assert bg.failed == 1 and seen == ["after"]
    assert bg.close(10.0)


def test_close_runs_what_is_queued_then_refuses():
    bg = BackgroundCalls("t-close")
    seen = []
    for i in range(50):
        bg.submit(lambda i=i: seen.append(i))
    assert bg.close(10.0)
    assert seen == list(range(50)) and bg.pending() == 0
    assert not bg.submit(lambda: seen.append("late"))
    assert seen[-1] == 49


def test_close_at_its_deadline_drops_what_did_not_start_and_returns():
    bg = BackgroundCalls("t-deadline")
    gate, seen = threading.Event(), []
    bg.submit(lambda: gate.wait(30))
    bg.submit(lambda: seen.append("never"))
    assert not bg.close(0.05)
    assert bg.dropped == 1
    gate.set()  # the blocked call finishes; the dropped one never runs
    assert bg.flush(10.0) and bg.pending() == 0 and seen == []


def test_many_submitting_threads_lose_nothing_and_keep_each_threads_order():
    bg = BackgroundCalls("t-threads")
    seen, lock = [], threading.Lock()

    def producer(t):
        for i in range(300):
            assert bg.submit(lambda t=t, i=i: seen.append((t, i)))

    ths = [threading.Thread(target=producer, args=(t,)) for t in range(4)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(30)
    assert bg.flush(30.0)
    with lock:
        assert len(seen) == 1200
        for t in range(4):
            assert [i for tt, i in seen if tt == t] == list(range(300))
    assert bg.close(10.0)


@pytest.mark.parametrize("limit", [0, -1])
def test_a_limit_below_one_is_refused(limit):
    with pytest.raises(ValueError, match="limit"):
        BackgroundCalls("t-bad", limit=limit)
