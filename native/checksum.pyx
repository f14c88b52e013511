# cython: language_level=3, boundscheck=False, wraparound=False
"""64-bit block checksums (XXH3-64, seed 0) and their tables, with the GIL released.

Why XXH3: it is the fastest well-kept non-cryptographic 64-bit hash (tens of GB/s per core
with SSE2/AVX2, so hashing a shard costs a fraction of copying it), its output is stable
across versions and platforms (a checksum written to L3 today verifies tomorrow), and it is
BSD-licensed header plus its x86 dispatcher (``native/xxhash.h``, ``xxh_x86dispatch.c``, xxHash
0.8.4, compiled in: SSE2/AVX2/AVX-512 chosen at run time) — no run-time dependency.  Integrity here means "these are the bytes the writer saved", not authenticity.

A *shard* is one rank's contiguous part of a pool block (``shm.layout``); its checksum is
XXH3-64 of its bytes.  A checksum *table* holds ``stride`` little-endian u64 per block
(one per shard); block ids travel as packed uint32 blobs (``shm.chain`` ids).  Addresses must
lie inside live mappings the caller keeps alive; ranges are the caller's to check.
"""

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcpy

cdef extern from "kvs_xxh.h" nogil:
    ctypedef unsigned long long XXH64_hash_t
    XXH64_hash_t XXH3_64bits "kvs_xxh3_64" (const void* data, size_t length)


def xxh3_64(const uint8_t[::1] data) -> int:
    """XXH3-64 of a buffer (tests and tools)."""
    cdef XXH64_hash_t h
    with nogil:
        h = XXH3_64bits(&data[0] if data.shape[0] else NULL, data.shape[0])
    return h


def region_sums(uintptr_t base, const int64_t[::1] offsets, Py_ssize_t nbytes) -> bytes:
    """Checksums of ``nbytes`` at ``base + offsets[i]``, as ``8 × n`` bytes (u64 little-endian)."""
    if nbytes < 0:
        raise ValueError("negative size")
    cdef Py_ssize_t i, n = offsets.shape[0]
    out = bytearray(8 * n)
    cdef uint64_t[::1] view = memoryview(out).cast("Q") if n else None
    cdef const char *b = <const char*>base
    with nogil:
        for i in range(n):
            view[i] = XXH3_64bits(b + offsets[i], nbytes)
    return bytes(out)


def first_mismatch(uintptr_t base, const int64_t[::1] offsets, Py_ssize_t nbytes,
                   const uint8_t[::1] expected, Py_ssize_t every=1, Py_ssize_t phase=0):
    """The first ``i`` (among those with ``(i + phase) % every == 0``) whose region's checksum
    differs from ``expected[8i:8i+8]``, or -1.  ``every`` > 1 samples."""
    cdef Py_ssize_t i, n = offsets.shape[0]
    if expected.shape[0] != 8 * n:
        raise ValueError(f"{expected.shape[0]} checksum bytes for {n} regions")
    if every < 1:
        raise ValueError("every must be >= 1")
    cdef const char *b = <const char*>base
    cdef uint64_t want
    cdef Py_ssize_t bad = -1
    with nogil:
        for i in range(n):
            if (i + phase) % every:
                continue
            memcpy(&want, &expected[8 * i], 8)
            if XXH3_64bits(b + offsets[i], nbytes) != want:
                bad = i
                break
    return bad


def verify_blocks(uintptr_t pool, const uint8_t[::1] ids, Py_ssize_t block_bytes, Py_ssize_t shards,
                  uintptr_t table) -> bytearray:
    """Per block of ``ids``: 1 when every shard's checksum equals its table row's, else 0."""
    cdef Py_ssize_t n = ids.shape[0] // 4, i, s
    cdef Py_ssize_t shard_bytes = block_bytes // shards
    cdef uint32_t bid
    cdef uint64_t expected
    cdef const char *row
    out = bytearray(n)
    cdef uint8_t[::1] ok = out if n else None
    with nogil:
        for i in range(n):
            memcpy(&bid, &ids[4 * i], 4)
            row = <const char*>table + <Py_ssize_t>bid * shards * 8
            ok[i] = 1
            for s in range(shards):
                memcpy(&expected, row + 8 * s, 8)
                if XXH3_64bits(<const char*>pool + <Py_ssize_t>bid * block_bytes + s * shard_bytes,
                               shard_bytes) != expected:
                    ok[i] = 0
                    break
    return out


def gather(uintptr_t table, const uint8_t[::1] ids, Py_ssize_t stride, Py_ssize_t column) -> bytes:
    """``table[id * stride + column]`` for each id, as ``8 × n`` bytes."""
    cdef Py_ssize_t n = ids.shape[0] // 4, i
    cdef uint32_t bid
    out = bytearray(8 * n)
    cdef uint8_t[::1] o = out if n else None
    with nogil:
        for i in range(n):
            memcpy(&bid, &ids[4 * i], 4)
            memcpy(&o[8 * i], <const char*>table + (<Py_ssize_t>bid * stride + column) * 8, 8)
    return bytes(out)


def scatter(uintptr_t table, const uint8_t[::1] ids, Py_ssize_t stride, Py_ssize_t column,
            const uint8_t[::1] values) -> None:
    """``table[id * stride + column] = values[i]`` for each id (``values``: ``8 × n`` bytes)."""
    cdef Py_ssize_t n = ids.shape[0] // 4, i
    cdef uint32_t bid
    if values.shape[0] != 8 * n:
        raise ValueError(f"{values.shape[0]} checksum bytes for {n} blocks")
    with nogil:
        for i in range(n):
            memcpy(&bid, &ids[4 * i], 4)
            memcpy(<char*>table + (<Py_ssize_t>bid * stride + column) * 8, &values[8 * i], 8)
