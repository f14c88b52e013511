"""Ring decoding treats any impossible index, marker or length as a corrupt ring (unit level).

Reproductions of two defects: a wrap marker at data offset 0 sent ``pop_batch`` into an
endless loop (the skip landed on the same marker again and was not counted); a ``tail``
short of a frame made the reader run past it and hand back stale frames.
"""

from __future__ import annotations

import struct
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar._native import atomics as a
from kvsidecar.shm.ring import WRAP_MARKER, RingConsumer, RingCorrupted, RingProducer, ring_region_bytes
from kvsidecar.shm.segment import Segment

from ..conftest import SHM_PREFIX

CAP = 1024


@pytest.fixture
def ring(instance):
    seg = Segment.create(instance + ".ring", ring_region_bytes(CAP))
    yield seg, RingProducer(seg, 0, CAP), RingConsumer(seg, 0, CAP)
    seg.unlink()
    seg.close()


def _pop_bounded(cons, limit=64, timeout_s=5.0):
    """pop_batch on a thread with a deadline: a hang is a test failure, not a stuck suite."""
    box = {}

    def run():
        try:
            box["frames"] = cons.pop_batch(limit)
        except RingCorrupted as exc:
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "pop_batch did not return (endless loop on a hostile ring)"
    return box


def test_wrap_marker_at_offset_zero_is_corrupt_not_a_hang(ring):
    seg, prod, cons = ring
    struct.pack_into("<I", seg.view, 128, WRAP_MARKER)
    a.store_release_u64(prod.tail_addr, 64)  # tail past the marker
    box = _pop_bounded(cons)
    assert "error" in box and "wrap marker" in str(box["error"])


def test_tail_short_of_a_frame_returns_nothing_stale(ring):
    seg, prod, cons = ring
    # A full lap of frames so the ring holds stale but well-formed frames everywhere.
    sent = 0
    while prod.try_push(struct.pack("<I", sent) * 25):
        sent += 1
    got = cons.pop_batch(10**6)
    assert len(got) == sent
    assert prod.try_push(b"x" * 100)  # one fresh frame of 104 bytes...
    a.store_release_u64(prod.tail_addr, a.load_acquire_u64(prod.tail_addr) - 96)  # ...tail inside it
    box = _pop_bounded(cons)
    assert "error" in box and "past tail" in str(box["error"])
    assert "frames" not in box


def test_wrap_marker_with_tail_inside_the_skip_is_corrupt(ring):
    seg, prod, cons = ring
    for _ in range(2):  # 2 x 408 bytes: the next frame (208) must wrap at offset 816
        assert prod.try_push(b"a" * 400)
    assert cons.pop_batch() == [b"a" * 400] * 2
    assert prod.try_push(b"b" * 200)  # marker at 816, frame at 0
    head = a.load_acquire_u64(cons.head_addr)
    a.store_release_u64(prod.tail_addr, head + 64)  # tail inside the skipped bytes
    box = _pop_bounded(cons)
    assert "error" in box


def test_unaligned_or_backwards_indices_are_corrupt(ring):
    seg, prod, cons = ring
    assert prod.try_push(b"ok")
    a.store_release_u64(prod.tail_addr, 12)
    assert "error" in _pop_bounded(cons)
    a.store_release_u64(prod.tail_addr, 2**63)
    assert "error" in _pop_bounded(cons)


@settings(max_examples=400, deadline=None)
@given(data=st.binary(min_size=0, max_size=CAP), head=st.integers(0, 4 * CAP), fill=st.integers(0, 2 * CAP),
       words=st.lists(st.tuples(st.integers(0, CAP // 4 - 1), st.sampled_from(
           [0, 1, 4, 8, 100, CAP // 2, CAP, WRAP_MARKER, 2**31])), max_size=8))
def test_random_ring_bytes_never_hang_or_overrun(data, head, fill, words):
    """Any bytes and indices: pop_batch returns promptly, and every frame it returns lies
    wholly inside [head, tail) of the data it was given."""
    seg = Segment.create(f"{SHM_PREFIX}fuzzring", ring_region_bytes(CAP))
    try:
        head &= ~7
        a.store_release_u64(seg.address, head)
        a.store_release_u64(seg.address + 64, head + fill)
        seg.view[128:128 + len(data)] = data
        for off, val in words:
            struct.pack_into("<I", seg.view, 128 + 4 * off, val)
        cons = RingConsumer(seg, 0, CAP)
        for _ in range(2 * CAP // 8 + 2):  # each successful pop consumes >= 8 bytes
            try:
                frames = cons.pop_batch(16)
            except RingCorrupted:
                break
            if not frames:
                break
            assert a.load_acquire_u64(seg.address) <= head + fill
        else:
            raise AssertionError("ring never drained")
    finally:
        seg.unlink()
        seg.close()
