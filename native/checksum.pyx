# cython: language_level=3, boundscheck=False, wraparound=False
"""64-bit block checksums bound to their block's key and shard, with the GIL released.

A *shard* is one rank's contiguous part of a pool block (``kvsidecar.shm.layout``).  Its checksum is
``XXH3-64(shard bytes, seed = key_lo ^ (GOLDEN × (shard + 1)))`` where ``key_lo`` is the
first 8 bytes (little-endian) of the block's 16-byte chain key: a checksum verifies *these
bytes are what the writer saved for this key and this shard*, so a block of another chain,
another shard, or another object under a key fails it — not only flipped bits.

Why XXH3: the fastest well-kept non-cryptographic 64-bit hash (tens of GB/s per core), with
output stable across versions and platforms (a checksum written to L3 today verifies
tomorrow), in one BSD-licensed header plus its x86 dispatcher (``native/third_party/xxhash/``,
xxHash 0.8.4, compiled in: SSE2/AVX2/AVX-512 chosen at run time) — no run-time dependency.
Integrity here means "the writer's bytes", not authenticity.

A checksum *table* holds ``stride`` little-endian u64 per pool block (one per shard); block ids
travel as packed uint32 blobs and keys as 16-byte chain blobs (``kvsidecar.shm.chain``).  Addresses must
lie inside live mappings the caller keeps alive; ranges are the caller's to check.
"""

from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcpy

cdef extern from "kvs_xxh.h" nogil:
    ctypedef unsigned long long XXH64_hash_t
    XXH64_hash_t kvs_xxh3_64(const void* data, size_t length)
    XXH64_hash_t kvs_xxh3_64_seed(const void* data, size_t length, XXH64_hash_t seed)

DEF KEY = 16
cdef uint64_t GOLDEN = 0x9E3779B97F4A7C15


cdef inline uint64_t _seed(const uint8_t *key, Py_ssize_t shard) noexcept nogil:
    cdef uint64_t lo
    memcpy(&lo, key, 8)
    return lo ^ (GOLDEN * <uint64_t>(shard + 1))


def xxh3_64(const uint8_t[::1] data, uint64_t seed=0):
    """XXH3-64 of a buffer (tests and tools)."""
    cdef XXH64_hash_t h
    with nogil:
        h = kvs_xxh3_64_seed(&data[0] if data.shape[0] else NULL, data.shape[0], seed)
    return h


def shard_seed(const uint8_t[::1] key, Py_ssize_t shard):
    """The seed of ``key``'s block, shard ``shard``."""
    if key.shape[0] != KEY:
        raise ValueError("a key is 16 bytes")
    return _seed(&key[0], shard)


cdef _check_keys(const uint8_t[::1] keys, Py_ssize_t n):
    if keys.shape[0] != KEY * n:
        raise ValueError(f"{keys.shape[0]} key bytes for {n} blocks")


def region_sums(uintptr_t base, const int64_t[::1] offsets, Py_ssize_t nbytes, const uint8_t[::1] keys,
                Py_ssize_t shard):
    """Checksums of ``nbytes`` at ``base + offsets[i]`` as block ``keys[i]``'s ``shard``:
    ``8 × n`` bytes (u64 little-endian)."""
    cdef Py_ssize_t i, n = offsets.shape[0]
    if nbytes < 0:
        raise ValueError("negative size")
    _check_keys(keys, n)
    out = bytearray(8 * n)
    cdef uint8_t[::1] o = out if n else None
    cdef const char *b = <const char*>base
    cdef uint64_t h
    with nogil:
        for i in range(n):
            h = kvs_xxh3_64_seed(b + offsets[i], nbytes, _seed(&keys[KEY * i], shard))
            memcpy(&o[8 * i], &h, 8)
    return bytes(out)


def first_mismatch(uintptr_t base, const int64_t[::1] offsets, Py_ssize_t nbytes, const uint8_t[::1] keys,
                   Py_ssize_t shard, const uint8_t[::1] expected, Py_ssize_t every=1, Py_ssize_t phase=0):
    """The first ``i`` (among those with ``(i + phase) % every == 0``) whose region's checksum as
    ``keys[i]``'s ``shard`` differs from ``expected[8i:8i+8]``, or -1.  ``every`` > 1 samples."""
    cdef Py_ssize_t i, n = offsets.shape[0]
    _check_keys(keys, n)
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
            if kvs_xxh3_64_seed(b + offsets[i], nbytes, _seed(&keys[KEY * i], shard)) != want:
                bad = i
                break
    return bad


def verify_blocks(uintptr_t pool, const uint8_t[::1] ids, const uint8_t[::1] keys, Py_ssize_t block_bytes,
                  Py_ssize_t shards, uintptr_t table):
    """Per block of ``ids`` (as ``keys``): 1 when every shard's checksum equals its table row's."""
    cdef Py_ssize_t n = ids.shape[0] // 4, i, s
    _check_keys(keys, n)
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
                if kvs_xxh3_64_seed(<const char*>pool + <Py_ssize_t>bid * block_bytes + s * shard_bytes,
                                    shard_bytes, _seed(&keys[KEY * i], s)) != expected:
                    ok[i] = 0
                    break
    return out


def gather(uintptr_t table, const uint8_t[::1] ids, Py_ssize_t stride, Py_ssize_t column):
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
            const uint8_t[::1] values):
    """``table[id * stride + column] = values[i]`` for each id (``values``: ``8 × n`` bytes)."""
    cdef Py_ssize_t n = ids.shape[0] // 4, i
    cdef uint32_t bid
    if values.shape[0] != 8 * n:
        raise ValueError(f"{values.shape[0]} checksum bytes for {n} blocks")
    with nogil:
        for i in range(n):
            memcpy(&bid, &ids[4 * i], 4)
            memcpy(<char*>table + (<Py_ssize_t>bid * stride + column) * 8, &values[8 * i], 8)
