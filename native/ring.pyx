# cython: language_level=3, boundscheck=False, wraparound=False
"""The hot halves of ``kvsidecar.shm.ring``: push one frame, pop a batch (see that module for the
layout, the memory-ordering rules and every check; this file implements exactly those).

Why native: a command's round trip runs four of these (client push, sidecar pop, sidecar push,
client pop), and after an idle gap every one of them runs cold.  Interpreted, each was ~15-25
lines of bytecode with several calls into ``atomics``; cold, that was most of the gap between
the ring and a Unix socket after 2 ms idle (``scripts/bench_ring.py``).  Here each is one call.

Addresses are raw (the ring's region inside a live mapping); nothing here checks bounds beyond
what the ring's own indices and capacity imply, which is what the Python layer guarantees.
Corruption raises ``RuntimeError(message)``; the Python layer turns it into ``RingCorrupted``.
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.stdint cimport uint32_t, uint64_t, uintptr_t
from libc.string cimport memcpy

cdef extern from *:
    """
    #include <stdint.h>
    static inline uint64_t kvr_load_acq64(uintptr_t a) { return __atomic_load_n((uint64_t*)a, __ATOMIC_ACQUIRE); }
    static inline void kvr_store_rel64(uintptr_t a, uint64_t v) { __atomic_store_n((uint64_t*)a, v, __ATOMIC_RELEASE); }
    static inline uint32_t kvr_load32(uintptr_t a) { uint32_t v; __builtin_memcpy(&v, (void*)a, 4); return v; }
    static inline void kvr_store32(uintptr_t a, uint32_t v) { __builtin_memcpy((void*)a, &v, 4); }
    """
    uint64_t kvr_load_acq64(uintptr_t a) nogil
    void kvr_store_rel64(uintptr_t a, uint64_t v) nogil
    uint32_t kvr_load32(uintptr_t a) nogil
    void kvr_store32(uintptr_t a, uint32_t v) nogil

DEF HEAD = 0
DEF TAIL = 64
DEF DATA = 128
DEF WRAP = 0xFFFFFFFF


def push(uintptr_t base, uint64_t capacity, uint64_t tail, const unsigned char[::1] payload):
    """Append one frame at ``tail`` (the producer's own index); returns the new tail, or 0 when it
    does not fit now (nothing written; a real tail after a push is never 0)."""
    cdef uint64_t n = payload.shape[0]
    cdef uint64_t need = (4 + n + 7) & ~(<uint64_t>7)
    cdef uint64_t head = kvr_load_acq64(base + HEAD)  # rule 2
    if tail < head or tail - head > capacity or head & 7:
        raise RuntimeError(f"consumer index head={head} is impossible (tail={tail})")
    cdef uint64_t free = capacity - (tail - head)
    cdef uint64_t pos = tail & (capacity - 1)
    cdef uint64_t room = capacity - pos
    cdef bint wrap = need > room
    if (need + room if wrap else need) > free:
        return 0
    cdef uintptr_t data = base + DATA
    if wrap:
        kvr_store32(data + pos, WRAP)
        tail += room
        pos = 0
    kvr_store32(data + pos, <uint32_t>n)
    if n:
        memcpy(<void*>(data + pos + 4), &payload[0], n)
    tail += need
    kvr_store_rel64(base + TAIL, tail)  # rule 1
    return tail


def pop_batch(uintptr_t base, uint64_t capacity, uint64_t head, unsigned int limit, uint64_t max_frame,
              oversize):
    """Copy out up to ``limit`` frames from ``head`` (the consumer's own index) and release their
    space; returns ``(new_head, frames)``.  A frame over ``max_frame`` is ``oversize(length)``.
    Nothing of a corrupt batch is returned and ``head`` is not moved."""
    cdef uint64_t tail = kvr_load_acq64(base + TAIL)  # rule 1
    if head == tail:
        return head, []
    if tail < head or tail - head > capacity or (head | tail) & 7:
        raise RuntimeError(f"ring indices head={head} tail={tail} are inconsistent")
    cdef list out = []
    cdef uintptr_t data = base + DATA
    cdef uint64_t mask = capacity - 1
    cdef unsigned int steps = 0
    cdef uint64_t pos, room, need
    cdef uint32_t n
    while head != tail and steps < limit:
        steps += 1
        pos = head & mask
        room = capacity - pos
        n = kvr_load32(data + pos)
        if n == WRAP:
            # legal only where a frame header fits but the next frame did not
            if pos == 0 or tail - head <= room:
                raise RuntimeError(f"wrap marker at ring offset {pos} with {tail - head} bytes in flight")
            head += room
            continue
        need = (4 + <uint64_t>n + 7) & ~(<uint64_t>7)
        if need > room:
            raise RuntimeError(f"frame length {n} at ring offset {pos} is out of bounds")
        if need > tail - head:
            raise RuntimeError(f"frame length {n} at ring offset {pos} runs past tail")
        if n > max_frame:
            out.append(oversize(n))  # skipped, not copied: the caller answers TOO_LARGE
        else:
            out.append(PyBytes_FromStringAndSize(<char*>(data + pos + 4), n))
        head += need
    kvr_store_rel64(base + HEAD, head)  # rule 2
    return head, out
