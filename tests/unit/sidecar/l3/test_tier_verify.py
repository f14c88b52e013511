"""The read lane's checksum pass (``L3Tier._verify``): every landed block is checked against
its row whether the pass runs in one piece or split across the lane and the checker thread
(``SPLIT_VERIFY_BYTES``), and a block whose bytes do not match, or that is not in L3, is never
reported as loaded."""

from __future__ import annotations

import array
import ctypes
import mmap
import queue

import pytest

from kvsidecar._native import checksum as native
from kvsidecar.sidecar.kv.checksums import ChecksumTable
from kvsidecar.sidecar.kv.index import KEY, pack_ids
from kvsidecar.sidecar.l3 import tier as tier_module
from kvsidecar.sidecar.l3.filestore import FileStore
from kvsidecar.sidecar.l3.tier import L3Tier

N, BLOCK, SHARDS = 9, 4096, 2
BAD = (1, 7)  # one in each half of a split pass
MISSING = (3, 5)  # never written to L3


@pytest.mark.parametrize("split_from", [0, 1 << 40], ids=["split", "whole"])
def test_every_landed_block_is_verified_whether_the_pass_is_split_or_not(tmp_path, monkeypatch, split_from):
    monkeypatch.setattr(tier_module, "SPLIT_VERIFY_BYTES", split_from)
    chain = b"".join(bytes([i + 1]) * KEY for i in range(N))
    shard = BLOCK // SHARDS
    # the objects: each block's bytes and its row, the row computed over the good bytes
    src = ctypes.create_string_buffer(bytes((i * 7 + j) % 251 for i in range(N) for j in range(BLOCK)), N * BLOCK)
    src_at = ctypes.addressof(src)
    rows = ctypes.create_string_buffer(N * SHARDS * 8)
    for s in range(SHARDS):
        sums = native.region_sums(src_at, array.array("q", [i * BLOCK + s * shard for i in range(N)]), shard, chain, s)
        for i in range(N):
            ctypes.memmove(ctypes.addressof(rows) + (i * SHARDS + s) * 8, sums[8 * i:8 * i + 8], 8)
    good = src.raw
    for i in BAD:  # L3 holds other bytes than the row says (the file itself is consistent)
        src[i * BLOCK + 5] = bytes([src.raw[i * BLOCK + 5] ^ 0xFF])
    pool = mmap.mmap(-1, N * BLOCK)
    anchor = ctypes.c_char.from_buffer(pool)
    table = ChecksumTable(N, SHARDS)
    posted: queue.Queue = queue.Queue()
    backend = FileStore(str(tmp_path / "l3"))
    tier = L3Tier(backend, lambda fn, *a: posted.put((fn, a)), fingerprint=b"\x02" * 8,
                  pool_address=ctypes.addressof(anchor), block_bytes=BLOCK, sums=table)
    keys = tier.keys("ns", chain)
    held = [i for i in range(N) if i not in MISSING]
    assert all(backend.write([keys[i] for i in held], [src_at + i * BLOCK for i in held], BLOCK,
                             [ctypes.addressof(rows) + i * SHARDS * 8 for i in held], SHARDS * 8))
    tier.start()
    try:
        results = []
        tier.load("ns", chain, pack_ids(list(range(N))), results.append)
        fn, args = posted.get(timeout=10)
        fn(*args)
        assert [r.ok for r in results] == [[i not in BAD + MISSING for i in range(N)]]
        assert tier.counters["read_blocks_corrupt"] == len(BAD)
        assert tier.counters["read_blocks_ok"] == N - len(BAD) - len(MISSING)
        assert tier.counters["read_blocks_failed"] == len(BAD) + len(MISSING)
        for i in range(N):
            if i not in BAD + MISSING:
                assert pool[i * BLOCK:(i + 1) * BLOCK] == good[i * BLOCK:(i + 1) * BLOCK]
    finally:
        tier.stop()
        del anchor
        pool.close()
