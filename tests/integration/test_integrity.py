"""Integrity end to end (DESIGN §7): every shard's bytes carry the XXH3-64 its writer computed;
the sidecar verifies blocks read from L3 before publishing them, ranks verify what they load.

Corruption is injected where it could really happen — a byte of a resident block flipped in the
shared pool, an L3 object whose container is intact but whose block bytes are not what the
writer saved — and each is caught: never published, never loaded, counted."""

from __future__ import annotations

import array
import ctypes
import os
import struct

import pytest
import torch

from kvsidecar.connector.kv_client import SAMPLE_EVERY, KVConnector
from kvsidecar._native import checksum as native_sums
from kvsidecar._native.hashing import murmur3_128
from kvsidecar.shm.errors import CorruptBlock, ErrorCode, RemoteError
from kvsidecar.shm.layout import KVLayout

from ..helpers import file_l3_overrides, small_kv, store_to_l3, wait_terminal

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=4, tp_size=1)
N = 12
TOKENS = list(range(4 * N))


# -- the native primitives -----------------------------------------------------------------------
def test_xxh3_is_the_reference_function_seeded_by_key_and_shard():
    assert native_sums.xxh3_64(b"") == 0x2D06800538D394C2  # XXH3_64bits("", 0), seed 0
    data = bytes(range(256)) * 64
    buf = (ctypes.c_char * len(data)).from_buffer_copy(data)
    offs = array.array("q", [0, 256, 1024])
    keys = bytes(range(48))
    sums = native_sums.region_sums(ctypes.addressof(buf), offs, 512, keys, 1)
    seeds = [native_sums.shard_seed(keys[16 * i:16 * i + 16], 1) for i in range(3)]
    assert [int.from_bytes(sums[i:i + 8], "little") for i in range(0, 24, 8)] == \
        [native_sums.xxh3_64(data[o:o + 512], seed) for o, seed in zip(offs, seeds)]
    assert native_sums.first_mismatch(ctypes.addressof(buf), offs, 512, keys, 1, sums) == -1
    # the same bytes as another key's block, or as another shard, do not verify
    other = keys[16:32] + keys[:16] + keys[32:]
    assert native_sums.first_mismatch(ctypes.addressof(buf), offs, 512, other, 1, sums) == 0
    assert native_sums.first_mismatch(ctypes.addressof(buf), offs, 512, keys, 0, sums) == 0
    bad = bytearray(sums)
    bad[16] ^= 1
    assert native_sums.first_mismatch(ctypes.addressof(buf), offs, 512, keys, 1, bytes(bad)) == 2
    # sampling: only i with (i + phase) % every == 0 are checked
    assert native_sums.first_mismatch(ctypes.addressof(buf), offs, 512, keys, 1, bytes(bad), 2, 0) == 2
    assert native_sums.first_mismatch(ctypes.addressof(buf), offs, 512, keys, 1, bytes(bad), 2, 1) == -1
    with pytest.raises(ValueError):
        native_sums.first_mismatch(ctypes.addressof(buf), offs, 512, keys, 1, sums[:8])
    with pytest.raises(ValueError):
        native_sums.region_sums(ctypes.addressof(buf), offs, 512, keys[:16], 1)


def test_checksum_table_scatter_gather_verify():
    from kvsidecar.sidecar.kv.checksums import ChecksumTable

    blocks, shards, bb = 6, 2, 256
    pool = (ctypes.c_char * (blocks * bb))()
    for i in range(blocks * bb):
        pool[i] = bytes([i % 251])
    base = ctypes.addressof(pool)
    t = ChecksumTable(blocks, shards)
    ids = array.array("I", [4, 1]).tobytes()
    keys = bytes(range(100, 132))
    for shard in range(shards):
        offs = array.array("q", [4 * bb + shard * 128, bb + shard * 128])
        t.record(ids, shard, native_sums.region_sums(base, offs, 128, keys, shard))
    assert t.column(ids, 1) == native_sums.region_sums(base, array.array("q", [4 * bb + 128, bb + 128]), 128,
                                                       keys, 1)
    assert list(t.verify(base, bb, ids, keys)) == [1, 1]
    assert list(t.verify(base, bb, ids, keys[16:] + keys[:16])) == [0, 0]  # as each other's key
    pool[bb + 130] = b"\xff" if pool[bb + 130] != b"\xff" else b"\x00"  # block 1, shard 1
    assert list(t.verify(base, bb, ids, keys)) == [1, 0]
    with pytest.raises(ValueError):
        t.record(ids, 0, b"\0" * 8)
    t.close()


# -- stores: the commit carries the rank's checksums ---------------------------------------------
def test_a_commit_without_or_with_wrong_checksums_is_refused_and_counted(sidecar_factory, instance, tmp_path):
    sidecar_factory(**file_l3_overrides(tmp_path, LAY, 64, **{"l3.backend": "none"}))
    kv = small_kv(N)
    with KVConnector(instance, LAY, populate="off") as c:
        chain = c.hasher.chain(TOKENS)
        st = c.store(chain)
        c.save(st, kv, list(range(st.count)))
        for sums in (None, b"\0" * 8):
            with pytest.raises(RemoteError) as exc:
                c.client.call("commit", staging=st.id, sums=sums)
            assert exc.value.code == ErrorCode.BAD_FIELD and "sums" in exc.value.message
        assert c.lookup(chain) == 0  # nothing published
        assert c.commit(st)["published"] is True  # the staging is intact: a good commit publishes it
        lease = c.get(chain)
        assert lease.count == N and len(lease.sums) == 8 * N
        out = [tuple(torch.zeros_like(t) for t in layer) for layer in kv]
        c.load(lease, out, list(range(N)))
        assert all(torch.equal(a, b) for la, lb in zip(kv, out) for a, b in zip(la, lb))
        c.release(lease)
        s = c.stats(check=True)
        assert s["counters"]["commit_bad_checksums"] == 2 and s["invariants"] == ""
        assert c.integrity_stats()["verified_blocks"] == N


# -- loads: the rank verifies before it copies ---------------------------------------------------
def _flip_byte(c: KVConnector, block: int, offset: int = 3) -> None:
    addr = c.pool.address + block * LAY.block_bytes + offset
    v = ctypes.c_uint8.from_address(addr)
    v.value ^= 0x5A


@pytest.mark.parametrize("mode", ["all", "sample", "off"])
def test_a_corrupted_resident_block_is_never_loaded_silently(sidecar_factory, instance, tmp_path, mode):
    sidecar_factory(**file_l3_overrides(tmp_path, LAY, 64, **{"l3.backend": "none"}))
    kv = small_kv(N)
    with KVConnector(instance, LAY, populate="off", verify_loads=mode) as c:
        chain = c.hasher.chain(TOKENS)
        st = c.store(chain)
        c.save(st, kv, list(range(st.count)))
        c.commit(st)
        lease = c.get(chain)
        bad = 5
        _flip_byte(c, lease.blocks[bad])
        refused = 0
        for _ in range(SAMPLE_EVERY):  # the sampling phase rotates: one full turn covers every block
            out = [tuple(torch.zeros_like(t) for t in layer) for layer in kv]
            try:
                c.load(lease, out, list(range(N)))
            except CorruptBlock as exc:
                refused += 1
                assert exc.position == bad and exc.block == lease.blocks[bad]
                assert all(not t.any() for layer in out for t in layer)  # nothing of it was copied
        assert refused == {"all": SAMPLE_EVERY, "sample": 1, "off": 0}[mode]
        assert c.integrity_stats()["corrupt_blocks"] == refused
        c.release(lease)


# -- L3: the sidecar verifies every block it reads before publishing it --------------------------
def _corrupt_file_block(l3_dir: str, key_suffix: str) -> None:
    """Change one byte of the block data of the file whose name ends with ``key_suffix`` and fix
    up the file store's own digest: the container is intact, only the block's bytes are wrong."""
    (path,) = [os.path.join(r, f) for r, _d, fs in os.walk(l3_dir) for f in fs if f.endswith(key_suffix)]
    hdr = struct.Struct("<QQQ16s")
    with open(path, "r+b") as f:
        magic, size, tail, _digest = hdr.unpack(f.read(hdr.size))
        data = bytearray(f.read(size))
        data[7] ^= 0xFF
        f.seek(0)
        f.write(hdr.pack(magic, size, tail, murmur3_128(bytes(data))))
        f.write(data)


def test_a_corrupt_l3_object_is_not_published_and_ends_the_prefix(sidecar_factory, instance, tmp_path):
    kv = small_kv(N)
    ov = file_l3_overrides(tmp_path, LAY, 64)
    sp = sidecar_factory(**ov)
    with KVConnector(instance, LAY) as c:
        chain, _ = store_to_l3(c, kv, TOKENS)
    sp.stop()
    bad = 7
    _corrupt_file_block(str(tmp_path / "l3"), chain[16 * bad:16 * bad + 16].hex())
    sidecar_factory(**ov)  # a cold pool: everything comes from L3
    with KVConnector(instance, LAY) as c:
        c.prefetch(chain, "r", policy="timeout", budget_s=10.0, chunk_max_blocks=4)
        p = wait_terminal(c, "r")
        assert p["prefix"] == bad, p
        lease = c.get(chain, req="r", step=1)
        assert lease.count == bad
        out = [tuple(torch.zeros_like(t) for t in layer) for layer in kv]
        c.load(lease, out, list(range(bad)))
        assert all(torch.equal(a[:bad], b[:bad]) for la, lb in zip(kv, out) for a, b in zip(la, lb))
        c.release(lease)
        r = c.restore(chain)  # the legacy whole-chain restore stops at the same block
        assert r["resident"] == bad and r["failed"] >= 1
        s = c.stats(check=True)
        assert s["l3"]["read_blocks_corrupt"] == 2 and s["invariants"] == ""
        assert s["leases"]["live"] == 0 and s["pool"]["staging"] == 0
