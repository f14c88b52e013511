"""shm/ring.py: wraparound, back-pressure and ordering, in one process and across two."""

import multiprocessing as mp
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.shm.ring import RingConsumer, RingCorrupted, RingProducer, frame_bytes, ring_region_bytes
from kvsidecar.shm.segment import Segment

from ...conftest import SHM_PREFIX


@pytest.fixture
def ring_seg(instance):
    s = Segment.create(instance + ".ring", ring_region_bytes(1 << 16) + 4096)
    yield s
    s.unlink()
    s.close()


@settings(max_examples=150, deadline=None)
@given(cap_log=st.integers(6, 10),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 400)), min_size=1, max_size=300))
def test_ring_matches_a_fifo_model(cap_log, ops):
    """Random pushes/pops over tiny rings: FIFO order, no loss, refusal only when really full."""
    cap = 1 << cap_log
    seg = Segment.create(f"{SHM_PREFIX}prop-{cap_log}", ring_region_bytes(cap))
    try:
        prod, cons = RingProducer(seg, 0, cap), RingConsumer(seg, 0, cap)
        model: list[bytes] = []
        seq = 0
        for push, size in ops:
            if push:
                size = size % (prod.max_payload + 1)
                payload = struct.pack("<I", seq) * (size // 4 + 1)
                payload = payload[:size]
                ok = prod.try_push(payload)
                if ok:
                    model.append(payload)
                    seq += 1
                else:
                    # Refused only when it truly did not fit, counting the wrap skip.
                    need = frame_bytes(size)
                    room_to_end = cap - (prod._tail & (cap - 1))
                    if need > room_to_end:
                        need += room_to_end
                    assert need > prod.free_bytes()
            else:
                got = cons.pop_batch(1 + size % 5)
                want, model = model[: len(got)], model[len(got):]
                assert got == want
        assert cons.pop_batch(10**6) == model
        assert cons.depth() == 0
    finally:
        seg.unlink()
        seg.close()


def test_full_ring_refuses_and_writes_nothing(ring_seg):
    cap = 1024
    prod, cons = RingProducer(ring_seg, 0, cap), RingConsumer(ring_seg, 0, cap)
    frames = []
    while True:
        f = bytes([len(frames) % 256]) * 100
        if not prod.try_push(f):
            break
        frames.append(f)
    assert len(frames) == cap // frame_bytes(100)
    before = bytes(ring_seg.view[:ring_region_bytes(cap)])
    assert not prod.try_push(b"z" * 100)
    assert bytes(ring_seg.view[:ring_region_bytes(cap)]) == before
    assert cons.pop_batch(1) == frames[:1]
    assert prod.try_push(b"y" * 100)  # space came back
    assert cons.pop_batch(100) == frames[1:] + [b"y" * 100]


def test_wrap_marker_and_waiting_flag(ring_seg):
    cap = 256
    prod, cons = RingProducer(ring_seg, 0, cap), RingConsumer(ring_seg, 0, cap)
    for i in range(10):  # frames of 56 B + 4 + pad = 64: wrap every 4
        assert prod.try_push(bytes([i]) * 50)
        assert cons.pop_batch() == [bytes([i]) * 50]
    assert prod.try_push(b"a" * 100)  # 104 B: does not fit before the end, wraps
    assert cons.pop_batch() == [b"a" * 100]
    assert not cons.producer_waiting()
    prod.mark_waiting()
    assert cons.producer_waiting()
    assert not cons.producer_waiting()  # cleared by the consumer
    with pytest.raises(ValueError):
        prod.try_push(b"x" * cap)


def test_corrupt_length_is_detected(ring_seg):
    cap = 1024
    prod, cons = RingProducer(ring_seg, 0, cap), RingConsumer(ring_seg, 0, cap, max_frame=200)
    assert prod.try_push(b"x" * 10)
    struct.pack_into("<I", ring_seg.view, cons.data_off, 5000)  # a hostile peer rewrites the header
    with pytest.raises(RingCorrupted):
        cons.pop_batch()


def _producer(name, n, cap):
    seg = Segment.attach(name)
    prod = RingProducer(seg, 0, cap)
    i = 0
    while i < n:
        payload = struct.pack("<Q", i) + bytes((i * 7) % 251 for _ in range(i % 24))
        if prod.try_push(payload):
            i += 1
    seg.close()


def test_million_messages_across_processes(instance):
    """10**6 frames through one ring between two processes: none lost, duplicated or reordered."""
    n, cap = 1_000_000, 1 << 16
    name = instance + ".mill"
    seg = Segment.create(name, ring_region_bytes(cap))
    try:
        cons = RingConsumer(seg, 0, cap)
        p = mp.get_context("spawn").Process(target=_producer, args=(name, n, cap))
        p.start()
        expect = 0
        while expect < n:
            for f in cons.pop_batch(4096):
                (seq,) = struct.unpack_from("<Q", f)
                assert seq == expect
                body = f[8:]
                assert body == bytes((seq * 7) % 251 for _ in range(seq % 24))
                expect += 1
            if not p.is_alive() and not cons.has_data() and expect < n:
                pytest.fail(f"producer exited after {expect} frames")
        p.join(30)
        assert p.exitcode == 0
        assert cons.depth() == 0
    finally:
        seg.unlink()
        seg.close()


def _native_bell(seg, offset):
    from kvsidecar.shm.doorbell import Doorbell

    return Doorbell(seg.address, offset)


def test_pop_batch_rings_a_waiting_producer_through_its_waker(ring_seg):
    """Rule 3 inside the native pop: a consumer that knows the producer's bell clears the
    producer's ``waiting`` flag and rings it; with no flag set it rings nothing."""
    cap = 1024
    bell = _native_bell(ring_seg, ring_region_bytes(cap))
    prod, cons = RingProducer(ring_seg, 0, cap), RingConsumer(ring_seg, 0, cap, waker=bell)
    seq = lambda: struct.unpack_from("<I", ring_seg.view, ring_region_bytes(cap))[0]  # noqa: E731
    assert prod.try_push(b"a")
    before = seq()
    assert cons.pop_batch() == [b"a"]
    assert seq() == before  # nobody asked
    assert prod.try_push(b"b")
    prod.mark_waiting()
    struct.pack_into("<I", ring_seg.view, ring_region_bytes(cap) + 4, 1)  # the producer sleeps on it
    assert cons.pop_batch() == [b"b"]
    assert seq() == before + 1 and bell.wakeups_posted == 1  # rung, with a futex wake
    assert struct.unpack_from("<I", ring_seg.view, cons.waiting_addr - cons.base)[0] == 0  # flag cleared
    assert cons.pop_batch() == [] and seq() == before + 1


def test_wait_pop_returns_frames_at_once_times_out_empty_and_wakes_on_a_ring(ring_seg):
    import threading

    from ...waiting import wait_until

    cap = 1024
    bell = _native_bell(ring_seg, ring_region_bytes(cap))
    prod, cons = RingProducer(ring_seg, 0, cap), RingConsumer(ring_seg, 0, cap)
    assert prod.try_push(b"here")
    assert cons.wait_pop(bell, 10.0) == [b"here"]  # data already there: no sleep
    assert cons.wait_pop(bell, 0.01) == [] and not bell.sleeping()  # a timeout, flag cleared
    posted = []

    def poster():
        wait_until(bell.sleeping, 5, "the consumer asleep on the bell", interval_s=0.001)
        assert prod.try_push(b"late")
        posted.append(bell.ring())

    t = threading.Thread(target=poster)
    t.start()
    assert cons.wait_pop(bell, 10.0) == [b"late"]
    t.join(5)
    assert posted == [True] and not bell.sleeping()  # it really slept, and the ring woke it
    with pytest.raises(ValueError):
        cons.wait_pop(bell, -1.0)
