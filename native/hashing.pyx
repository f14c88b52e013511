# cython: language_level=3, boundscheck=False, wraparound=False
"""Chained 128-bit block keys.

``h_0 = H(seed ‖ tokens[0:T])``, ``h_i = H(h_{i-1} ‖ tokens[iT:(i+1)T])`` where
``H`` is MurmurHash3 x64-128 and ``seed`` is a 16-byte digest of the namespace
and the layout fingerprint (see ``kvsidecar.connector.hashing``).  A block key therefore
identifies the whole prefix up to and including that block, in that namespace
and for that KV layout.  Only full blocks are hashed; a trailing partial block
is ignored.  The output is one ``bytes`` blob of ``16 × n`` bytes, which is also
the wire form of a chain.
"""

from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy
from libc.stdlib cimport malloc, free

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    static inline uint64_t kvs_rotl64(uint64_t x, int8_t r) { return (x << r) | (x >> (64 - r)); }
    static inline uint64_t kvs_fmix64(uint64_t k) {
        k ^= k >> 33; k *= 0xff51afd7ed558ccdULL; k ^= k >> 33; k *= 0xc4ceb9fe1a85ec53ULL; k ^= k >> 33; return k;
    }
    /* MurmurHash3_x64_128 (public domain, Austin Appleby), little-endian loads. */
    static void kvs_murmur3_128(const uint8_t *data, size_t len, uint64_t seed, uint64_t out[2]) {
        const size_t nblocks = len / 16;
        uint64_t h1 = seed, h2 = seed;
        const uint64_t c1 = 0x87c37b91114253d5ULL, c2 = 0x4cf5ad432745937fULL;
        for (size_t i = 0; i < nblocks; i++) {
            uint64_t k1, k2;
            memcpy(&k1, data + i * 16, 8); memcpy(&k2, data + i * 16 + 8, 8);
            k1 *= c1; k1 = kvs_rotl64(k1, 31); k1 *= c2; h1 ^= k1;
            h1 = kvs_rotl64(h1, 27); h1 += h2; h1 = h1 * 5 + 0x52dce729;
            k2 *= c2; k2 = kvs_rotl64(k2, 33); k2 *= c1; h2 ^= k2;
            h2 = kvs_rotl64(h2, 31); h2 += h1; h2 = h2 * 5 + 0x38495ab5;
        }
        const uint8_t *tail = data + nblocks * 16;
        uint64_t k1 = 0, k2 = 0;
        switch (len & 15) {
            case 15: k2 ^= ((uint64_t)tail[14]) << 48;
            case 14: k2 ^= ((uint64_t)tail[13]) << 40;
            case 13: k2 ^= ((uint64_t)tail[12]) << 32;
            case 12: k2 ^= ((uint64_t)tail[11]) << 24;
            case 11: k2 ^= ((uint64_t)tail[10]) << 16;
            case 10: k2 ^= ((uint64_t)tail[9]) << 8;
            case 9:  k2 ^= ((uint64_t)tail[8]);
                     k2 *= c2; k2 = kvs_rotl64(k2, 33); k2 *= c1; h2 ^= k2;
            case 8:  k1 ^= ((uint64_t)tail[7]) << 56;
            case 7:  k1 ^= ((uint64_t)tail[6]) << 48;
            case 6:  k1 ^= ((uint64_t)tail[5]) << 40;
            case 5:  k1 ^= ((uint64_t)tail[4]) << 32;
            case 4:  k1 ^= ((uint64_t)tail[3]) << 24;
            case 3:  k1 ^= ((uint64_t)tail[2]) << 16;
            case 2:  k1 ^= ((uint64_t)tail[1]) << 8;
            case 1:  k1 ^= ((uint64_t)tail[0]);
                     k1 *= c1; k1 = kvs_rotl64(k1, 31); k1 *= c2; h1 ^= k1;
        }
        h1 ^= len; h2 ^= len; h1 += h2; h2 += h1;
        h1 = kvs_fmix64(h1); h2 = kvs_fmix64(h2); h1 += h2; h2 += h1;
        out[0] = h1; out[1] = h2;
    }
    """
    void kvs_murmur3_128(const uint8_t *data, size_t length, uint64_t seed, uint64_t out[2]) nogil


cdef enum:
    KB = 16
KEY_BYTES = KB


def murmur3_128(const uint8_t[::1] data, uint64_t seed=0):
    """One MurmurHash3 x64-128 digest (16 bytes, little endian h1 ‖ h2)."""
    cdef uint64_t out[2]
    with nogil:
        kvs_murmur3_128(&data[0] if data.shape[0] else NULL, data.shape[0], seed, out)
    return (<char*>out)[:16]


def chain_hashes(const uint8_t[::1] seed, const uint32_t[::1] tokens, Py_ssize_t tokens_per_block):
    """Return the chained keys of every full block of ``tokens`` as one ``bytes`` blob.

    ``seed`` is 16 bytes; ``tokens`` is a contiguous uint32 buffer.
    """
    if seed.shape[0] != KB:
        raise ValueError("seed must be 16 bytes")
    if tokens_per_block <= 0:
        raise ValueError("tokens_per_block must be positive")
    cdef Py_ssize_t n = tokens.shape[0] // tokens_per_block
    cdef Py_ssize_t tb = tokens_per_block * 4
    cdef Py_ssize_t i
    cdef bytearray out = bytearray(n * KB)
    cdef uint8_t *o = <uint8_t*>(<char*>out)
    cdef uint8_t *buf = <uint8_t*>malloc(KB + tb)
    if buf == NULL:
        raise MemoryError()
    cdef uint64_t h[2]
    try:
        with nogil:
            memcpy(buf, &seed[0], KB)
            for i in range(n):
                memcpy(buf + KB, &tokens[i * tokens_per_block], tb)
                kvs_murmur3_128(buf, KB + tb, 0, h)
                memcpy(o + i * KB, h, KB)
                memcpy(buf, h, KB)
    finally:
        free(buf)
    return bytes(out)


cdef inline uint64_t _k64(const uint8_t *p) nogil:
    cdef uint64_t v
    memcpy(&v, p, 8)
    return v


def first_duplicate(const uint8_t[::1] chain):
    """Index of the first 16-byte key of ``chain`` that repeats an earlier one, or -1.

    O(n) with a scratch open-addressing table of 2n..4n slots (keys are uniformly random
    hashes, so the low 64 bits index it directly).  A genuine chained-hash chain never
    repeats a key; a repeat is malformed input and must be refused before any state changes.
    """
    cdef Py_ssize_t n = chain.shape[0] // 16, i
    if n < 2:
        return -1
    cdef uint64_t cap = 16, mask, slot, lo, hi
    while cap < <uint64_t>n * 2:
        cap <<= 1
    mask = cap - 1
    cdef long *tab = <long*>malloc(cap * sizeof(long))
    if tab == NULL:
        raise MemoryError()
    cdef long e
    cdef Py_ssize_t found = -1
    try:
        for slot in range(cap):
            tab[slot] = -1
        for i in range(n):
            lo = _k64(&chain[16 * i])
            hi = _k64(&chain[16 * i + 8])
            slot = lo & mask
            while True:
                e = tab[slot]
                if e < 0:
                    tab[slot] = <long>i
                    break
                if _k64(&chain[16 * e]) == lo and _k64(&chain[16 * e + 8]) == hi:
                    found = i
                    break
                slot = (slot + 1) & mask
            if found >= 0:
                break
    finally:
        free(tab)
    return found



