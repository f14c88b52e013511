"""The embedded file store: atomic files, integrity, cap, full disk; restores through a sidecar."""

from __future__ import annotations

import ctypes
import os
import subprocess
import time

import pytest
import torch

from kvsidecar.connector.kv_client import KVConnector
from kvsidecar.shm.layout import KVLayout
from kvsidecar.sidecar.l3.filestore import FileStore
from kvsidecar.sidecar.l3.shaped import ShapedBackend

from .. import helpers
from ..waiting import wait_until


def buf(n):
    b = ctypes.create_string_buffer(n)
    return b, ctypes.addressof(b)


def test_write_read_exists_and_integrity(tmp_path):
    fs = FileStore(str(tmp_path / "l3"))
    src, sa = buf(4096)
    ctypes.memmove(sa, os.urandom(4096), 4096)
    assert fs.write(["a/k1", "a/k2"], [sa, sa], 2048) == [True, True]
    assert fs.exists(["a/k1", "a/k2", "a/k3"]) == [True, True, False]
    dst, da = buf(4096)
    assert fs.read(["a/k1", "a/k3"], [da, da + 2048], 2048) == [True, False]
    assert dst.raw[:2048] == src.raw[:2048]
    # corrupt one byte of k1's data, truncate k2: both become misses and are removed
    p1, p2 = fs._path("a/k1"), fs._path("a/k2")
    with open(p1, "r+b") as f:
        f.seek(100)
        flipped = bytes([f.read(1)[0] ^ 0xFF])  # (a different byte whatever the random data held)
        f.seek(100)  # (the read moved the position: write the byte that was read)
        f.write(flipped)
    with open(p2, "r+b") as f:
        f.truncate(1000)
    ctypes.memset(da, 0, 4096)
    assert fs.read(["a/k1", "a/k2"], [da, da + 2048], 2048) == [False, False]
    assert not os.path.exists(p1) and not os.path.exists(p2)
    assert fs.counters["read_corrupt"] == 2
    assert fs.read(["a/k1"], [da], 1024) == [False]  # wrong size = miss, not partial data
    assert fs.total == 0


def test_a_key_with_a_nul_or_a_long_name_is_a_block_like_any_other_or_a_miss(tmp_path):
    """A client's namespace is part of the key and may hold a NUL (the protocol fuzz sends one)
    or be longer than a file name: such a key is written and read back, or fails as a miss --
    never an exception out of the store (a read with the L3 query reaches it before any answer)."""
    fs = FileStore(str(tmp_path / "l3"))
    src, sa = buf(2048)
    ctypes.memmove(sa, os.urandom(2048), 2048)
    nul, long = "kvs2/ab/\x00/k1", "kvs2/ab/" + "a" * 300 + "/k1"
    assert fs.read([nul, long], [sa, sa], 2048) == [False, False]  # nothing there yet
    assert fs.write([nul], [sa], 2048) == [True]
    assert fs.exists([nul, long]) == [True, False]
    dst, da = buf(2048)
    assert fs.read([nul], [da], 2048) == [True] and dst.raw == src.raw
    assert fs.write([long], [sa], 2048) == [False] and fs.read([long], [da], 2048) == [False]


def test_size_cap_evicts_lru(tmp_path):
    fs = FileStore(str(tmp_path / "l3"), cap_bytes=5 * (1024 + 40))  # 40: the header
    _, sa = buf(1024)
    for i in range(5):
        assert fs.write([f"k{i}"], [sa], 1024) == [True]  # the LRU order is the store's own, not mtimes
    _, da = buf(1024)
    assert fs.read(["k0"], [da], 1024) == [True]  # k0 is now the most recently used
    assert fs.write(["k5"], [sa], 1024) == [True]
    assert fs.exists([f"k{i}" for i in range(6)]) == [True, False, True, True, True, True]
    assert fs.total <= fs.cap
    # a restart rebuilds the accounting from disk, dropping leftover temporaries
    open(os.path.join(fs.dir, "junk.tmp"), "wb").write(b"x")
    fs2 = FileStore(fs.dir, cap_bytes=fs.cap)
    assert fs2.total == fs.total and not os.path.exists(os.path.join(fs.dir, "junk.tmp"))


def test_full_disk_fails_blocks_not_the_store(tmp_path):
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        fs = FileStore(str(mnt / "l3"))
        _, sa = buf(16384)
        res = fs.write([f"k{i}" for i in range(8)], [sa] * 8, 16384)
        assert res[0] is True and res[-1] is False  # the disk filled up part way
        assert fs.counters["write_error"] >= 1
        _, da = buf(16384)
        assert fs.read(["k0"], [da], 16384) == [True]
        assert not [f for f in os.listdir(mnt / "l3") if f.endswith(".tmp")]
    finally:
        subprocess.run(["umount", str(mnt)])


def test_shaped_failures(tmp_path):
    inner = FileStore(str(tmp_path / "l3"))
    _, sa = buf(4096)
    keys = [f"k{i}" for i in range(4)]
    inner.write(keys, [sa] * 4, 1024)
    _, da = buf(4096)
    assert ShapedBackend(inner, fail="first").read(keys, [da] * 4, 1024) == [False, True, True, True]
    assert ShapedBackend(inner, fail="tail").read(keys, [da] * 4, 1024) == [True, True, True, False]
    assert ShapedBackend(inner, fail="keys", fail_keys=("k2",)).read(keys, [da] * 4, 1024) == [True, True, False, True]
    slow = ShapedBackend(inner, latency_s=0.05, bandwidth_bps=1e6)
    t0 = time.monotonic()
    slow.read(keys, [da] * 4, 1024)
    assert time.monotonic() - t0 >= 0.05 + 4096 / 1e6 * 0.9


LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=4, tp_size=1)


def overrides(tmp_path, **extra):
    d = {f"layout.{k}": v for k, v in LAY.as_dict().items()}
    d.update({"pool.num_blocks": 64, "l3.file_dir": str(tmp_path / "l3")})
    d.update(extra)
    return d


def store_to_l3(instance, kv, tokens):
    with KVConnector(instance, LAY) as c:
        return helpers.store_to_l3(c, kv, tokens)


def restore_and_load(instance, tokens, n_pages):
    with KVConnector(instance, LAY) as c:
        chain = c.hasher.chain(tokens)
        r = c.restore(chain)
        lease = c.get(chain)
        out = [tuple(torch.zeros(n_pages, 4, 2, 16, dtype=torch.float16) for _ in range(2)) for _ in range(2)]
        c.load(lease, out, list(range(lease.count)))
        c.release(lease)
        s = c.stats(check=True)
        assert s["invariants"] == ""
        return r, lease.count, out, s


def same(kv, out, n):
    return all(torch.equal(a[:n], b[:n]) for la, lb in zip(kv, out) for a, b in zip(la, lb))


def test_file_store_persists_across_sidecar_restart(sidecar_factory, instance, tmp_path):
    kv = [tuple(torch.randn(16, 4, 2, 16).half() for _ in range(2)) for _ in range(2)]
    tokens = list(range(4 * 12))
    sp = sidecar_factory(**overrides(tmp_path))
    _, s = store_to_l3(instance, kv, tokens)
    assert s["counters"]["l3_published_blocks"] == 12
    sp.stop()
    sidecar_factory(**overrides(tmp_path))  # a new process: the pool is empty, the files remain
    r, n, out, s = restore_and_load(instance, tokens, 16)
    assert r["restored"] == 12 and n == 12 and same(kv, out, 12)
    assert s["counters"]["l3_restored_blocks"] == 12


def test_restore_publishes_only_the_prefix_before_a_failure(sidecar_factory, instance, tmp_path):
    kv = [tuple(torch.randn(16, 4, 2, 16).half() for _ in range(2)) for _ in range(2)]
    tokens = list(range(4 * 10))
    sp = sidecar_factory(**overrides(tmp_path))
    store_to_l3(instance, kv, tokens)
    sp.stop()
    # corrupt block 6's file on disk: the restore must stop at block 6
    files = sorted((os.path.getmtime(os.path.join(r, f)), os.path.join(r, f))
                   for r, _, fs in os.walk(tmp_path / "l3") for f in fs if "_calibration_" not in f)
    assert len(files) == 10
    from kvsidecar.connector.hashing import BlockHasher

    chain = BlockHasher(LAY).chain(tokens)
    victim = next(p for _, p in files if chain[6 * 16:7 * 16].hex() in p)
    with open(victim, "r+b") as f:
        f.seek(64)
        f.write(b"corrupt!")
    sidecar_factory(**overrides(tmp_path))
    r, n, out, s = restore_and_load(instance, tokens, 16)
    assert r["l3_hits"] == 10 and r["restored"] == 6 and r["failed"] == 4 and n == 6
    assert same(kv, out, 6)
    assert s["pool"]["staging"] == 0 and s["pool"]["resident"] == 6


def test_a_store_of_what_l3_holds_writes_nothing_and_reads_back_the_same(sidecar_factory, instance, tmp_path):
    """An engine writes through a prefix it recomputed after the pool lost it (a flush): L3 holds
    every block, so the write-behind writes none (no file is rewritten), reports them published
    (``present``), and the restore still lands the same bytes."""
    kv = [tuple(torch.randn(16, 4, 2, 16).half() for _ in range(2)) for _ in range(2)]
    tokens = list(range(4 * 12))
    sidecar_factory(**overrides(tmp_path))
    _, s = store_to_l3(instance, kv, tokens)
    assert s["l3"]["put_blocks_ok"] == 12 and s["l3"].get("put_blocks_present", 0) == 0
    files = {os.path.join(r, f): os.stat(os.path.join(r, f)).st_mtime_ns
             for r, _, fs in os.walk(tmp_path / "l3") for f in fs if "_calibration_" not in f}
    assert len(files) == 12
    with KVConnector(instance, LAY) as c:
        assert c.flush() == 12  # the pool forgets the prefix; L3 keeps it
        kv2 = [tuple(t.clone() for t in layer) for layer in kv]
        _, s = helpers.store_to_l3(c, kv2, tokens)
        assert s["l3"]["put_blocks_present"] == 12 and s["l3"]["put_blocks_ok"] == 24
        assert c.stats()["counters"]["l3_published_blocks"] == 24
        assert c.flush() == 12
    now = {p: os.stat(p).st_mtime_ns for p in files}
    assert now == files  # not one file written again
    r, n, out, s = restore_and_load(instance, tokens, 16)
    assert r["restored"] == 12 and n == 12 and same(kv, out, 12)


@pytest.mark.parametrize("mode,expect", [("first", 0), ("tail", 9)])
def test_shaped_failures_through_the_sidecar(sidecar_factory, instance, tmp_path, mode, expect):
    kv = [tuple(torch.randn(16, 4, 2, 16).half() for _ in range(2)) for _ in range(2)]
    tokens = list(range(4 * 10))
    sp = sidecar_factory(**overrides(tmp_path))
    store_to_l3(instance, kv, tokens)
    sp.stop()
    sidecar_factory(**overrides(tmp_path, **{"l3.fail": mode, "l3.latency_ms": 5.0}))
    r, n, out, s = restore_and_load(instance, tokens, 16)
    assert r["restored"] == expect and n == expect and same(kv, out, expect)
    assert s["pool"]["staging"] == 0


def _l3_stats(instance) -> dict:
    with KVConnector(instance, LAY) as c:
        return c.stats()["l3"]


@pytest.mark.parametrize("blocks", [4, 0])
def test_the_tier_measures_itself_at_start(sidecar_factory, instance, tmp_path, blocks):
    """A fresh sidecar writes scratch objects to L3 and reads them back (1, then 4) before any
    request, all on its write lane: the read-cost estimate rests on two reads, not on the prior
    (5 ms + 10 MB/s), and predicts the shaped link (2 ms + 1 MB/s); the read lane ran nothing.
    With ``l3.calibration_blocks = 0`` nothing is written or read."""
    sidecar_factory(**overrides(tmp_path, **{"l3.calibration_blocks": blocks, "l3.latency_ms": 2.0,
                                             "l3.bandwidth_mbps": 8.0}))
    if blocks:
        l3 = wait_until(lambda: _l3_stats(instance), 10.0, "the calibration",
                        until=lambda l3: l3["cost"]["samples"] >= 2 or "calibration_failed" in l3)
    else:
        l3 = _l3_stats(instance)
    cost = l3["cost"]
    assert "calibration_failed" not in l3 and l3["read"]["jobs"] == 0, l3
    if not blocks:
        assert cost["samples"] == 0 and "write_samples" not in cost and l3["write"]["jobs"] == 0
        assert not os.path.exists(tmp_path / "l3") or not any(os.scandir(tmp_path / "l3"))
        return
    assert cost["samples"] == 2 and l3["write"]["jobs"] == 4
    per_block_ms = LAY.block_bytes / 1e6 * 1e3  # 1 MB/s
    for n in (1, 4):  # the reads it made, as the estimate predicts them (the prior says 5.1 / 5.4 ms)
        predicted = cost["latency_ms"] + n * cost["s_per_block_us"] / 1e3
        shaped = 2.0 + n * per_block_ms
        assert 0.65 * shaped <= predicted <= 1.5 * shaped, (n, predicted, shaped, cost)
    files = [f for _, _, fs in os.walk(tmp_path / "l3") for f in fs]
    assert len(files) == 4 and all("_calibration_" in f for f in files), files


def test_a_calibration_that_cannot_read_measures_what_it_could_and_never_fails_the_sidecar(
        sidecar_factory, instance, tmp_path):
    """Every read's first block fails: the calibration stops at its first read-back, counts the
    failure, and the estimate rests on its two writes; the sidecar serves on."""
    sidecar_factory(**overrides(tmp_path, **{"l3.fail": "first"}))
    l3 = wait_until(lambda: _l3_stats(instance), 10.0, "the calibration's end",
                    until=lambda l3: "calibration_failed" in l3)
    assert l3["calibration_failed"] == 1 and l3["cost"]["samples"] == 0 and l3["cost"]["write_samples"] == 2
    with KVConnector(instance, LAY) as c:
        assert c.stats(check=True)["invariants"] == ""
