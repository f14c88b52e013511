"""The native prefix index stays O(1) under unbounded churn (issue: tombstones filled the table).

Before the fix, alloc -> find(missing) -> publish with eviction hung after 40-60 thousand
cycles: erased slots became tombstones, no EMPTY slot was left, and a probe for a missing key
never ended.  Erase is now backward-shift deletion: no tombstones, probe runs stay short.
"""

from __future__ import annotations

import os
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar._native.blockindex import BlockIndex
from kvsidecar._native.hashing import first_duplicate


def _key(rng: random.Random) -> bytes:
    return rng.getrandbits(128).to_bytes(16, "little")


def test_churn_one_hundred_times_the_pool_never_degrades():
    """300k publish/evict cycles through a 2,048-block pool: every op answers, probes stay short."""
    n = 2048
    idx = BlockIndex(n)
    rng = random.Random(7)
    live: dict[bytes, int] = {}
    order: list[bytes] = []
    cycles = 300_000
    for i in range(cycles):
        if idx.n_free == 0:
            assert idx.evict(1) == 1
        key = _key(rng)
        assert idx.find(key) == -1  # a miss must end (this is where the old table spun forever)
        b = int.from_bytes(idx.alloc(1), "little")
        idx.publish(key, b, -1)
        live[key] = b
        order.append(key)
        if i % 50_000 == 0 or i == cycles - 1:
            assert idx.max_probe() < 64, idx.max_probe()
    assert idx.check() == ""
    assert idx.n_resident == n
    # The survivors are exactly the n most recent keys (LRU of unpinned leaves) and findable.
    for key in order[-n:]:
        assert idx.find(key) == live[key]
    for key in order[:1000]:
        assert idx.find(key) == -1


def test_chained_churn_with_pins_keeps_prefixes():
    """Chains of 8 with random pins and evictions: the index check holds throughout."""
    n = 256
    idx = BlockIndex(n)
    rng = random.Random(11)
    pinned = []
    for step in range(20_000):
        want = 8
        if idx.n_free < want:
            idx.evict(want - idx.n_free)
        got = idx.alloc(min(want, idx.n_free))
        parent = -1
        for j in range(len(got) // 4):
            b = int.from_bytes(got[4 * j:4 * j + 4], "little")
            idx.publish(_key(rng), b, parent)
            parent = b
        if parent >= 0 and rng.random() < 0.1:
            blob = parent.to_bytes(4, "little")
            idx.pin(blob)
            pinned.append(blob)
        if pinned and (len(pinned) > 8 or rng.random() < 0.1):
            idx.unpin(pinned.pop(rng.randrange(len(pinned))))
        if step % 2000 == 0:
            assert idx.check() == ""
            assert idx.max_probe() < 64
    assert idx.check() == ""


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 15), st.integers(0, 3)), max_size=200))
def test_table_matches_a_dict_model(ops):
    """Tiny table (8 blocks, 16 slots), keys forced to collide on few home slots: insert/erase
    in any order keeps every live key findable and every dead key missing."""
    idx = BlockIndex(8)
    model: dict[bytes, int] = {}
    fifo: list[bytes] = []
    for insert, low, high in ops:
        key = bytes([low]) + bytes(7) + bytes([high]) + bytes(7)  # low 64 bits pick the home slot
        if insert and key not in model:
            if idx.n_free == 0:
                idx.evict(1)
                del model[fifo.pop(0)]
            b = int.from_bytes(idx.alloc(1), "little")
            idx.publish(key, b, -1)
            model[key] = b
            fifo.append(key)
        elif not insert and fifo:
            idx.evict(1)  # LRU: the oldest published key leaves
            del model[fifo.pop(0)]
        for k, b in model.items():
            assert idx.find(k) == b
        assert idx.check() == ""
    for low in range(16):
        for high in range(4):
            key = bytes([low]) + bytes(7) + bytes([high]) + bytes(7)
            assert (idx.find(key) >= 0) == (key in model)


def test_first_duplicate():
    rng = random.Random(3)
    keys = [_key(rng) for _ in range(600)]
    assert first_duplicate(b"".join(keys)) == -1
    assert first_duplicate(b"") == -1
    assert first_duplicate(keys[0]) == -1
    assert first_duplicate(b"".join(keys + [keys[17]])) == 600
    assert first_duplicate(keys[0] + keys[0]) == 1
    dup = keys[:300] + [keys[5]] + keys[300:]
    assert first_duplicate(b"".join(dup)) == 300
    assert first_duplicate(os.urandom(16) * 3) == 1


def test_deadline_heap_stays_bounded_under_churn():
    """Records that come and go within their TTL leave no stale heap entries behind (it grew by
    one entry per lease for a whole TTL before), and a due live record is still always reaped."""
    from kvsidecar.sidecar.deadlines import DeadlineHeap

    live: dict[int, float] = {}
    heap = DeadlineHeap(live, lambda due: due)
    for i in range(100_000):
        live[i] = 1000.0 + i
        heap.push(live[i], i)
        if i % 10 != 0:
            del live[i]  # released long before its deadline
        assert len(heap._heap) <= 2 * (len(live) + 1) + 65  # compaction runs at push time
    due = heap.pop_due(1000.0 + 50_000)
    assert sorted(due) == [1000.0 + i for i in range(0, 50_001, 10)]
    assert heap.next_due() == 1000.0 + 50_010
