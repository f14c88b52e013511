"""The sidecar's own pool mapping, populated in the background after ready (issue 23).

Restores land in the pool through the sidecar's mapping; a page the populate has not reached
yet is faulted in by the read itself.  What must hold: the populate never changes a byte (data
that landed before, while or after it reached a page is intact), it ends with every page mapped,
it never delays ready, and a restore racing it publishes exactly the bytes that were stored.
"""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch

import kvsidecar.shm.populate as P
from kvsidecar.connector.kv_client import KVConnector
from kvsidecar.shm.layout import KVLayout
from kvsidecar.shm.mapping_populator import PoolPopulator
from kvsidecar.shm.segment import Segment

from ..helpers import file_l3_overrides, store_to_l3, wait_until

MiB = 1 << 20
# 64 KiB blocks: a 2048-block pool is 128 MiB, so the populate is still running just after ready
BIG = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, tokens_per_block=64, tp_size=1)


def _pattern(n: int, seed: int) -> bytes:
    return bytes((i * 31 + seed) & 0xFF for i in range(256)) * (n // 256)


def test_data_landing_before_during_and_after_the_populate_is_intact(instance, monkeypatch):
    """Deterministic race: the populate is held after its first chunk while "restores" land in a
    page it already mapped and in pages it has not reached; then it finishes."""
    owner = Segment.create(f"/{instance}.pool", 8 * MiB, init=lambda fd, size: P.fallocate(fd, size))
    seg = Segment.attach(owner.name)
    real = P.populate
    calls = [0]
    held, release = threading.Event(), threading.Event()

    def gated(*a, **kw):  # chunk 0 runs; chunk 1 waits until the test has written its data
        calls[0] += 1
        if calls[0] == 2:
            held.set()
            release.wait(10)
        return real(*a, **kw)

    monkeypatch.setattr(P, "populate", gated)
    before = _pattern(MiB, 1)
    ctypes.memmove(seg.address + 6 * MiB, before, MiB)  # landed before the populate started
    try:
        pop = PoolPopulator(seg, chunk=MiB).start()
        assert held.wait(10)
        during_mapped, during_ahead = _pattern(MiB, 2), _pattern(MiB, 3)
        ctypes.memmove(seg.address, during_mapped, MiB)  # a page the populate already mapped
        ctypes.memmove(seg.address + 3 * MiB, during_ahead, MiB)  # pages it has not reached
        release.set()
        assert pop.wait(10) and pop.error is None and pop.done_bytes == seg.size
        after = _pattern(MiB, 4)
        ctypes.memmove(seg.address + 7 * MiB, after, MiB)
        assert ctypes.string_at(seg.address, MiB) == during_mapped
        assert ctypes.string_at(seg.address + 3 * MiB, MiB) == during_ahead
        assert ctypes.string_at(seg.address + 6 * MiB, MiB) == before
        assert ctypes.string_at(seg.address + 7 * MiB, MiB) == after
        assert ctypes.string_at(seg.address + MiB, MiB) == bytes(MiB)  # untouched pages stay zero
        assert P.resident_bytes(seg.address) == seg.size
    finally:
        release.set()
        seg.close()
        owner.unlink()
        owner.close()


def _kv(n_blocks: int, seed: int) -> list:
    torch.manual_seed(seed)
    return [tuple(torch.randn(n_blocks, 64, 2, 64).half() for _ in range(2)) for _ in range(2)]


def test_restore_racing_the_sidecars_populate_publishes_the_stored_bytes(sidecar_factory, instance, tmp_path):
    n = 64
    kv = _kv(n, seed=7)
    tokens = list(range(n * BIG.tokens_per_block))
    over = file_l3_overrides(tmp_path, BIG, 2048)
    sp = sidecar_factory(**dict(over, **{"pool.sidecar_populate": "off"}))
    with KVConnector(instance, BIG, populate="off") as c:
        chain, s = store_to_l3(c, kv, tokens)
        assert s["counters"]["l3_published_blocks"] == n
        assert s["l3"]["pool_populate"] == {"method": "off", "done": True}  # asked off: none
    sp.stop()
    sidecar_factory(**over)  # the default: populate in the background because an L3 is configured
    with KVConnector(instance, BIG, populate="off", verify_loads="all") as c:
        r = c.restore(chain, timeout_s=30)  # at once after ready: usually before the populate ends
        raced = not c.stats()["l3"]["pool_populate"]["done"]
        assert r["restored"] == n and r.get("failed", 0) == 0, r
        lease = c.get(chain)
        assert lease.count == n
        out = [tuple(torch.zeros_like(t) for t in layer) for layer in kv]
        c.load(lease, out, list(range(n)))  # verify_loads=all: every block against its checksum
        c.release(lease)
        assert all(torch.equal(a, b) for la, lb in zip(kv, out) for a, b in zip(la, lb))
        st = wait_until(lambda: (lambda p: p if p["done"] else None)(c.stats()["l3"]["pool_populate"]), 60,
                        "the sidecar's populate to finish")
        pool_bytes = 2048 * BIG.block_bytes
        assert st["error"] is None and st["method"] == "madvise"
        assert st["bytes"] == st["size"] >= pool_bytes
        assert c.stats()["l3"]["read_blocks_corrupt"] == 0
    print(f"restore raced the populate: {raced}")


def test_no_l3_no_populate_and_config_is_checked(sidecar_factory, instance):
    from kvsidecar.sidecar.config import ConfigError, load_config

    for bad in ({"pool.sidecar_populate": "always"}, {"pool.cuda_register": "yes"}, {"l3.read_lanes": 0}):
        with pytest.raises(ConfigError):
            load_config(None, dict(bad, instance="x"))
    from kvsidecar.sidecar.kv.pool_memory import sidecar_populator

    cfg = load_config(None, {"instance": "x"})
    assert cfg.pool.populate == "fallocate" and cfg.pool.sidecar_populate == "auto"
    assert sidecar_populator(cfg, seg=None, l3_on=False) is None
    assert sidecar_populator(cfg, seg=None, l3_on=True) is not None
    cfg = load_config(None, {"instance": "x", "pool.sidecar_populate": "off"})
    assert sidecar_populator(cfg, seg=None, l3_on=True) is None
    over = {f"layout.{k}": v for k, v in BIG.as_dict().items()}
    sidecar_factory(**dict(over, **{"l3.backend": "none", "pool.num_blocks": 16}))
    with KVConnector(instance, BIG, populate="off") as c:
        assert "l3" not in c.stats()  # no L3: nothing lands through the sidecar's mapping


# -- read lanes ----------------------------------------------------------------------------------
def test_a_lane_with_several_threads_runs_jobs_side_by_side_and_stops_cleanly():
    """``l3.read_lanes``: N threads on one priority queue; every job's ``around`` is entered; a
    stop runs what was queued before it (each owner hears once) and every thread exits."""
    import collections

    from kvsidecar.sidecar.l3.workers import Lane

    posted = collections.deque()
    lane_box = []
    inside = [0, 0]  # (now, most at once)
    lock = threading.Lock()
    both = threading.Barrier(2)

    class Around:
        def __enter__(self):
            with lock:
                inside[0] += 1
                inside[1] = max(inside[1], inside[0])

        def __exit__(self, *exc):
            with lock:
                inside[0] -= 1

    lane = Lane("t", lambda fn, *a: posted.append((fn, a)), threads=2, around=Around)
    lane_box.append(lane)
    done = []
    for i in range(2):  # two jobs that only finish once both are running: needs two threads
        lane.submit(lambda i=i: (both.wait(5), i)[1], lambda r, e: done.append((r, e)))
    lane.start()
    wait_until(lambda: len(posted) == 2, 10, "both jobs to finish")
    while posted:
        fn, a = posted.popleft()
        fn(*a)
    assert sorted(r for r, e in done) == [0, 1] and all(e is None for r, e in done)
    assert inside == [0, 2]
    gate = threading.Event()
    lane.submit(lambda: gate.wait(5), lambda r, e: done.append(("slow", e)))
    lane.submit(lambda: gate.wait(5), lambda r, e: done.append(("slow", e)))
    for _ in range(3):
        lane.submit(lambda: "never", lambda r, e: done.append(("queued", e)))
    wait_until(lambda: lane.running == 2, 10, "two jobs running")
    stopper = threading.Thread(target=lane.stop)
    stopper.start()
    gate.set()
    stopper.join(10)
    assert not stopper.is_alive() and not any(t.is_alive() for t in lane._threads)
    while posted:
        fn, a = posted.popleft()
        fn(*a)
    assert [r for r, e in done].count("slow") == 2
    queued = [e for r, e in done if r == "queued"]
    assert len(queued) == 3 and all(e is None for e in queued)
    assert lane.queued == 0 and lane.running == 0
