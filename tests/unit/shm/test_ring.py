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


def test_try_push_takes_bytes_in_place_and_any_contiguous_buffer(ring_seg):
    cap = 1024
    prod, cons = RingProducer(ring_seg, 0, cap), RingConsumer(ring_seg, 0, cap)
    for payload in (b"bytes", bytearray(b"bytearray"), memoryview(b"view"), b"", bytearray()):
        assert prod.try_push(payload)
    assert cons.pop_batch() == [b"bytes", b"bytearray", b"view", b"", b""]
    with pytest.raises(ValueError):
        prod.try_push(b"x" * cap)  # over half the ring: refused whatever its type
    with pytest.raises(TypeError):
        prod.try_push("not a buffer")


def _exchange_rig(seg, cap=1024):
    """A client's view of a request/completion ring pair and both doorbells in one segment."""
    region = ring_region_bytes(cap)
    submit = RingProducer(seg, 0, cap)
    completions = RingConsumer(seg, region, cap)
    peer, own = _native_bell(seg, 2 * region), _native_bell(seg, 2 * region + 64)
    # the other ends, as the sidecar holds them
    return submit, completions, peer, own, RingConsumer(seg, 0, cap), RingProducer(seg, region, cap)


def test_exchange_returns_false_true_or_the_frames_by_what_the_push_and_ring_found(ring_seg):
    import threading

    from kvsidecar._native import atomics

    from ...waiting import wait_until

    submit, completions, peer, own, peer_in, peer_out = _exchange_rig(ring_seg)
    seq = lambda: atomics.load_acquire_u32(peer.seq_addr)  # noqa: E731
    # the peer is awake (not sleeping): pushed and rung, nothing waited for
    before = seq()
    assert completions.exchange(submit, b"req1", peer, own, 10.0) is True
    assert peer_in.pop_batch() == [b"req1"] and seq() == before + 1 and peer.wakeups_posted == 0
    # the peer sleeps: the ring is its futex wake, then the answer is waited for on our bell
    atomics.store_release_u32(peer.sleeping_addr, 1)
    answered = []

    def sidecar():
        wait_until(own.sleeping, 5, "the client asleep on its doorbell", interval_s=0.001)
        answered.append(peer_in.pop_batch())
        assert peer_out.try_push(b"done2")
        own.ring()

    t = threading.Thread(target=sidecar)
    t.start()
    assert completions.exchange(submit, b"req2", peer, own, 10.0) == [b"done2"]
    t.join(5)
    assert answered == [[b"req2"]] and peer.wakeups_posted == 1 and not own.sleeping()
    # asleep and nobody answers: the slice ends with no frames and our flag cleared
    assert completions.exchange(submit, b"req3", peer, own, 0.01) == [] and not own.sleeping()
    assert peer_in.pop_batch() == [b"req3"]
    atomics.store_release_u32(peer.sleeping_addr, 0)
    # no room: nothing written, nobody rung
    while submit.try_push(b"f" * 100):
        pass
    before, depth = seq(), submit.depth()
    assert completions.exchange(submit, b"f" * 100, peer, own, 10.0) is False
    assert seq() == before and submit.depth() == depth
    with pytest.raises(ValueError):
        completions.exchange(submit, b"x", peer, own, -1.0)


def test_sleep_scan_names_the_first_ring_with_a_frame(ring_seg):
    import threading

    from ...waiting import wait_until

    cap = 256
    region = ring_region_bytes(cap)
    prods = [RingProducer(ring_seg, i * region, cap) for i in range(3)]
    cons = tuple(RingConsumer(ring_seg, i * region, cap) for i in range(3))
    bell = _native_bell(ring_seg, 3 * region)
    never = lambda: False  # noqa: E731
    assert prods[2].try_push(b"two")
    assert bell.sleep_rings(never, cons, 10.0) == 2  # a frame already there: no sleep
    assert cons[2].pop_batch() == [b"two"]
    assert bell.sleep_rings(never, cons, 0.01) == -1 and not bell.sleeping()  # a timeout
    assert bell.sleep_rings(lambda: True, cons, 10.0) == -1  # the caller's own condition first

    def client():
        wait_until(bell.sleeping, 5, "the loop asleep on its doorbell", interval_s=0.001)
        assert prods[1].try_push(b"one")
        bell.ring()

    t = threading.Thread(target=client)
    t.start()
    assert bell.sleep_rings(never, cons, 10.0) == 1
    t.join(5)
    assert not bell.sleeping() and cons[1].pop_batch() == [b"one"]
    # woken for something else (a post with no frame): -1, the caller checks its own condition
    t = threading.Thread(target=lambda: (wait_until(bell.sleeping, 5, "asleep", interval_s=0.001), bell.ring()))
    t.start()
    assert bell.sleep_rings(never, cons, 10.0) == -1
    t.join(5)
    assert bell.sleep_rings(never, (), 0.0) == -1  # no clients at all
