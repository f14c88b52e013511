"""The session executor's L3 contract (``kvsidecar.sidecar.l3.interface.SessionTier``), checked
the same way against the real ``L3Tier`` (file-store backend, real worker lanes, a real pool
mapping) and both fakes (``scripts.fake_tier``: the executor bench's ``HeldTier`` and the
simulator's ``VirtualL3``).  A fake that drifts from the real tier fails here.

Each harness gives the tier a "control thread" — the test's own thread, running what the tier
posts — and ``settle(until)``, which lets the tier answer what it owes (the real lanes run; the
held fake answers as L3 would; virtual time advances).  The real tier's lanes start only at the
first ``settle``, so reads submitted before it are still queued (cancellable) in all three.
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import queue
import threading
import time

import pytest

from kvsidecar.sidecar.kv.index import KEY, pack_ids
from kvsidecar.sidecar.l3.cost_model import ReadEstimate
from kvsidecar.sidecar.l3.filestore import FileStore
from kvsidecar.sidecar.l3.interface import DEMANDED, QUEUED, ReadJob, ReadOutlook, ReadResult, SessionTier
from kvsidecar.sidecar.l3.tier import L3Tier
from scripts import sim_virtual as sv
from scripts.fake_tier import HeldTier, VirtualL3

NS = "ns"
BLOCKS = 16
BLOCK_BYTES = 256


def key(name: str) -> bytes:
    return name.encode().ljust(KEY, b".")[:KEY]


def data_of(k: bytes) -> bytes:
    return (k * (BLOCK_BYTES // KEY + 1))[:BLOCK_BYTES]


class RealHarness:
    """``L3Tier`` over a ``FileStore`` in a temporary directory and an anonymous pool mapping."""

    name = "real"

    def __init__(self, tmp_path, held: list[bytes]):
        self.pool = mmap.mmap(-1, BLOCKS * BLOCK_BYTES)
        self._buf = ctypes.c_char.from_buffer(self.pool)
        self.address = ctypes.addressof(self._buf)
        self._posted: queue.Queue = queue.Queue()
        self.backend = FileStore(str(tmp_path / "l3"))
        self.tier = L3Tier(self.backend, lambda fn, *a: self._posted.put((fn, a)), fingerprint=b"\x01" * 8,
                           pool_address=self.address, block_bytes=BLOCK_BYTES)
        scratch = ctypes.create_string_buffer(b"".join(data_of(k) for k in held), max(1, len(held)) * BLOCK_BYTES)
        base = ctypes.addressof(scratch)
        keys = self.tier.keys(NS, b"".join(held))
        assert all(self.backend.write(keys, [base + i * BLOCK_BYTES for i in range(len(held))], BLOCK_BYTES))
        self.started = False

    def settle(self, until, timeout_s: float = 10.0) -> None:
        if not self.started:
            self.tier.start()
            self.started = True
        deadline = time.monotonic() + timeout_s
        while not until():
            left = deadline - time.monotonic()
            assert left > 0, "the real tier did not answer in time"
            fn, args = self._posted.get(timeout=left)
            fn(*args)
        while True:  # and whatever else it posted by now (e.g. a cancelled job's bookkeeping)
            try:
                fn, args = self._posted.get_nowait()
            except queue.Empty:
                return
            fn(*args)

    def block(self, b: int) -> bytes:
        return bytes(self.pool[b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES])

    def landed(self, b: int, k: bytes) -> bool:
        return self.block(b) == data_of(k)

    def untouched(self, b: int) -> bool:
        return self.block(b) == bytes(BLOCK_BYTES)

    def close(self) -> None:
        if not self.started:
            self.tier.start()
        self.tier.stop()
        del self._buf
        self.pool.close()


class _Loop:
    """A control loop for the held fake: posted events run when the harness settles."""

    def __init__(self):
        self.events = collections.deque()

    def post(self, fn, *args):
        self.events.append((fn, args))

    def settle(self):
        while self.events:
            fn, args = self.events.popleft()
            fn(*args)


class HeldHarness:
    """``HeldTier``: the harness answers every lookup and read as L3 would (what it holds)."""

    name = "held"

    def __init__(self, tmp_path, held: list[bytes]):
        self.loop = _Loop()
        self.tier = HeldTier(self.loop, set(held))

    def settle(self, until) -> None:
        while self.tier.lookups or self.tier.pending or self.loop.events:
            self.tier.answer_lookups()
            for r in list(self.tier.pending):
                self.tier.land(r, None, 0.01)
            self.loop.settle()
        assert until(), "the held tier left a call unanswered"

    def landed(self, b: int, k: bytes) -> bool:
        return True  # (no bytes in this fake)

    def untouched(self, b: int) -> bool:
        return True

    def close(self) -> None:
        pass


class VirtualHarness:
    """``VirtualL3`` on the simulator's virtual loop; ``contents`` says what each block holds."""

    name = "virtual"

    def __init__(self, tmp_path, held: list[bytes]):
        self.loop = sv.VirtualLoop()
        self.contents: dict = {}
        self.tier = VirtualL3(self.loop, set(held), self.contents, {}, sv.SimParams(), None)

    def settle(self, until) -> None:
        while self.loop.next_timer():
            pass
        assert until(), "the virtual tier left a call unanswered"

    def landed(self, b: int, k: bytes) -> bool:
        return self.contents.get(b) == k

    def untouched(self, b: int) -> bool:
        return b not in self.contents

    def close(self) -> None:
        pass


@pytest.fixture(params=[RealHarness, HeldHarness, VirtualHarness], ids=lambda h: h.name)
def make(request, tmp_path):
    made = []

    def _make(held: list[bytes]):
        h = request.param(tmp_path, held)
        made.append(h)
        return h

    yield _make
    for h in made:
        h.close()


class Answers:
    """Records each callback's arguments and the thread it ran on."""

    def __init__(self):
        self.calls: list = []

    def __call__(self, value):
        self.calls.append((value, threading.get_ident()))

    @property
    def values(self) -> list:
        return [v for v, _ in self.calls]

    def on(self, thread_id: int) -> bool:
        return all(t == thread_id for _, t in self.calls)


def test_every_tier_has_the_session_facing_members(make):
    h = make([])
    assert isinstance(h.tier, SessionTier)
    assert h.tier.read_s_per_block is None  # no read landed yet
    assert h.tier.query_s >= 0.0 and h.tier.read_cost_error >= 0.0


def test_lookup_counts_the_leading_blocks_l3_holds_and_answers_later_on_the_control_thread(make):
    k = [key(f"a{i}") for i in range(4)]
    h = make([k[0], k[1], k[3]])  # a gap at 2: the prefix ends there
    got, none = Answers(), Answers()
    h.tier.lookup(NS, b"".join(k), got)
    h.tier.lookup(NS, key("zz") + k[0], none)
    assert got.calls == [] and none.calls == []  # never answered from inside the call
    h.settle(lambda: got.calls and none.calls)
    assert got.values == [2] and none.values == [0]
    assert got.on(threading.get_ident()) and none.on(threading.get_ident())
    assert h.tier.query_s >= 0.0


def test_load_lands_held_blocks_fails_the_rest_and_learns_a_per_block_time(make):
    k = [key(f"b{i}") for i in range(3)]
    h = make(k[:2])
    got = Answers()
    job = h.tier.load(NS, b"".join(k), pack_ids([5, 6, 7]), got, priority=QUEUED)
    assert isinstance(job, ReadJob) and got.calls == []
    h.settle(lambda: got.calls)
    (result,) = got.values
    assert isinstance(result, ReadResult) and result.ok == [True, True, False] and result.landed == 2
    assert result.seconds >= 0.0 and got.on(threading.get_ident())
    assert h.landed(5, k[0]) and h.landed(6, k[1]) and h.untouched(7)
    assert h.tier.read_s_per_block is not None and h.tier.read_s_per_block > 0
    assert job.cancel() is False  # it ran: too late to withdraw
    job.raise_priority(DEMANDED)  # a no-op once ended
    assert len(got.calls) == 1


def test_a_read_that_lands_nothing_does_not_change_the_estimate(make):
    h = make([])
    got = Answers()
    h.tier.load(NS, key("m0") + key("m1"), pack_ids([1, 2]), got)
    h.settle(lambda: got.calls)
    assert got.values[0].ok == [False, False] and h.tier.read_s_per_block is None
    assert h.untouched(1) and h.untouched(2)


def test_a_cancelled_read_never_runs_and_never_answers(make):
    k = [key(f"c{i}") for i in range(4)]
    h = make(k)
    first, second = Answers(), Answers()
    a = h.tier.load(NS, b"".join(k[:2]), pack_ids([0, 1]), first, priority=QUEUED + 1)
    b = h.tier.load(NS, b"".join(k[2:]), pack_ids([2, 3]), second, priority=QUEUED + 2)
    b.raise_priority(QUEUED + 3)  # not sooner: a no-op
    assert b.cancel() is True  # queued behind the first read: withdrawn
    assert b.cancel() is False  # once
    h.settle(lambda: first.calls)
    assert [r.ok for r in first.values] == [[True, True]] and second.calls == []
    assert h.untouched(2) and h.untouched(3)
    assert a.cancel() is False


def test_read_outlook_counts_the_work_ahead_and_never_more_for_a_sooner_priority(make):
    k = [key(f"d{i}") for i in range(4)]
    h = make(k)
    idle = h.tier.read_outlook(QUEUED)
    assert isinstance(idle, ReadOutlook) and isinstance(idle.estimate, ReadEstimate) and idle.backlog_s == 0.0
    got = Answers()
    h.tier.load(NS, b"".join(k[:2]), pack_ids([0, 1]), got, priority=QUEUED + 1)
    h.tier.load(NS, b"".join(k[2:]), pack_ids([2, 3]), got, priority=QUEUED + 1)
    behind = h.tier.read_outlook(QUEUED + 5).backlog_s
    assert behind > 0.0  # two reads run before it
    assert 0.0 <= h.tier.read_outlook(DEMANDED).backlog_s <= behind
    h.settle(lambda: len(got.calls) == 2)
    assert h.tier.read_outlook(QUEUED + 5).backlog_s == 0.0  # nothing left ahead


def test_real_tier_estimate_rests_on_its_writes_until_a_read_is_measured(tmp_path):
    """The write-behind's measured puts are the read estimate of a tier no read has measured
    (``write_samples``); the first read replaces them."""
    h = RealHarness(tmp_path, [])
    try:
        assert not h.tier.read_outlook(QUEUED).estimate.measured
        k = [key(f"w{i}") for i in range(4)]
        for i, kk in enumerate(k):
            h.pool[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES] = data_of(kk)
        stored = []
        h.tier.store(NS, b"".join(k), pack_ids([0, 1, 2, 3]), stored.append)
        h.settle(lambda: len(stored) == 1)
        assert stored == [[True] * 4]
        e = h.tier.read_outlook(QUEUED).estimate
        assert e.measured and e.samples == 0 and e.write_samples == 1
        assert h.tier.snapshot().stats()["l3"]["cost"]["write_samples"] == 1
        got = Answers()
        h.tier.load(NS, b"".join(k[:2]), pack_ids([8, 9]), got, priority=QUEUED)
        h.settle(lambda: len(got.calls) == 1)
        e = h.tier.read_outlook(QUEUED).estimate
        assert e.samples == 1 and e.write_samples == 0
        assert "write_samples" not in h.tier.snapshot().stats()["l3"]["cost"]  # reported only while it decides
    finally:
        h.close()


class _CountingStore(FileStore):
    """The file store, recording the keys of every write and optionally failing existence queries."""

    def __init__(self, path, fail_exists: bool = False):
        super().__init__(path)
        self.written: list[str] = []
        self.fail_exists = fail_exists

    def exists(self, keys):
        if self.fail_exists:
            raise OSError("existence query refused")
        return super().exists(keys)

    def write(self, keys, addrs, size, tails=None, tail_size=0):
        self.written.extend(keys)
        return super().write(keys, addrs, size, tails, tail_size)


@pytest.mark.parametrize("fail_exists", [False, True], ids=["query", "query-fails"])
def test_real_tier_writes_only_the_blocks_l3_lacks(tmp_path, fail_exists):
    """A store of a chain L3 partly holds writes only the missing blocks (keys name content); each
    block still reports written, the present ones are counted, the bytes read back are the pool's,
    and only what was written is a write sample.  A failed existence query writes every block."""
    h = RealHarness(tmp_path, [])
    store = _CountingStore(str(tmp_path / "l3c"), fail_exists=fail_exists)
    h.tier.backend = store
    try:
        k = [key(f"p{i}") for i in range(6)]
        for i, kk in enumerate(k):
            h.pool[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES] = data_of(kk)
        keys = h.tier.keys(NS, b"".join(k))
        first = []  # blocks 0, 2 and 3 reach L3 first (a gap at 1: any subset, not only a prefix)
        for ids in ([0], [2, 3]):
            h.tier.store(NS, b"".join(k[i] for i in ids), pack_ids(ids), first.append)
        h.settle(lambda: len(first) == 2)
        assert first == [[True], [True, True]]
        store.written.clear()
        done = []
        h.tier.store(NS, b"".join(k), pack_ids(list(range(6))), done.append)
        h.settle(lambda: len(done) == 1)
        assert done == [[True] * 6]
        c = h.tier.counters
        if fail_exists:
            assert store.written == keys
            assert c["put_exists_errors"] >= 1 and c["put_blocks_present"] == 0
        else:
            assert store.written == [keys[1], keys[4], keys[5]]
            assert c["put_blocks_present"] == 3 and c["put_exists_errors"] == 0
        assert c["put_blocks_ok"] == 3 + 6 and c["put_blocks_failed"] == 0
        store.written.clear()
        samples = h.tier.read_outlook(QUEUED).estimate.write_samples
        again = []  # everything present now: nothing written, and no write sample of nothing
        h.tier.store(NS, b"".join(k), pack_ids(list(range(6))), again.append)
        h.settle(lambda: len(again) == 1)
        assert again == [[True] * 6]
        assert store.written == ([] if not fail_exists else keys)
        assert h.tier.read_outlook(QUEUED).estimate.write_samples == samples + (1 if fail_exists else 0)
        got = Answers()
        h.tier.load(NS, b"".join(k), pack_ids(list(range(8, 14))), got, priority=QUEUED)
        h.settle(lambda: len(got.calls) == 1)
        assert got.values[0].ok == [True] * 6
        assert all(h.landed(8 + i, kk) for i, kk in enumerate(k))
    finally:
        h.close()
