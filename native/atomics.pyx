# cython: language_level=3, boundscheck=False, wraparound=False
"""Atomic operations on addresses inside a mapped shared-memory segment.

Every function takes a raw address (``int``) of a naturally aligned 32- or
64-bit word that lives in a mapping shared between processes.  The orderings
are the C11 ones, implemented with GCC ``__atomic`` builtins so they are
correct on weakly ordered CPUs (ARM) as well as on x86:

* ``load_acquire`` - no later load/store may be reordered before it.
* ``store_release`` - no earlier load/store may be reordered after it.
* ``cas`` / ``fetch_add`` - sequentially consistent read-modify-write.
* ``fence`` - a full sequentially consistent fence (needed for the
  store-then-load "Dekker" pattern of the doorbell protocol, which acquire /
  release alone do not order).

``futex_wait`` / ``futex_wake`` use the shared (not ``FUTEX_PRIVATE``) futex
so a waiter in one process is woken by a poster in another.  ``futex_wait``
releases the GIL and always has a deadline.

Callers are responsible for passing addresses inside live mappings; the
functions do no bounds checking (that is what ``kvsidecar.shm.segment`` is for).
"""

from libc.stdint cimport uint32_t, uint64_t, int64_t, uintptr_t

cdef extern from "kvs_sync.h":
    uint64_t kvs_load_acq64(uintptr_t a) nogil
    void kvs_store_rel64(uintptr_t a, uint64_t v) nogil
    uint32_t kvs_load_acq32(uintptr_t a) nogil
    void kvs_store_rel32(uintptr_t a, uint32_t v) nogil
    int kvs_cas64(uintptr_t a, uint64_t expected, uint64_t desired) nogil
    uint64_t kvs_fetch_add64(uintptr_t a, uint64_t d) nogil
    uint32_t kvs_fetch_add32(uintptr_t a, uint32_t d) nogil
    void kvs_fence() nogil
    void kvs_cpu_relax() nogil
    int kvs_futex_wait(uintptr_t a, uint32_t expected, int64_t timeout_ns) nogil
    long kvs_futex_wake(uintptr_t a, int n) nogil


def load_acquire_u64(uintptr_t addr):
    return kvs_load_acq64(addr)

def store_release_u64(uintptr_t addr, uint64_t value):
    kvs_store_rel64(addr, value)

def load_acquire_u32(uintptr_t addr):
    return kvs_load_acq32(addr)

def store_release_u32(uintptr_t addr, uint32_t value):
    kvs_store_rel32(addr, value)

def cas_u64(uintptr_t addr, uint64_t expected, uint64_t desired):
    """Compare-and-swap; True when ``*addr`` was ``expected`` and is now ``desired``."""
    return kvs_cas64(addr, expected, desired) != 0

def fetch_add_u64(uintptr_t addr, uint64_t delta):
    """Atomically add ``delta`` (mod 2**64); returns the previous value."""
    return kvs_fetch_add64(addr, delta)

def fetch_add_u32(uintptr_t addr, uint32_t delta):
    return kvs_fetch_add32(addr, delta)

def fence():
    """Full sequentially consistent fence."""
    kvs_fence()

def futex_wait(uintptr_t addr, uint32_t expected, double timeout_s):
    """Sleep while ``*addr == expected`` for at most ``timeout_s`` seconds.

    Returns True when woken or the value already differed, False on timeout.
    A negative timeout is refused: every wait in this project has a deadline.
    """
    if timeout_s < 0:
        raise ValueError("futex_wait needs a non-negative timeout")
    cdef int64_t ns = <int64_t>(timeout_s * 1e9)
    cdef int r
    with nogil:
        r = kvs_futex_wait(addr, expected, ns)
    if r < 0:
        raise OSError(-r, "futex wait failed")
    return r == 0

def futex_wake(uintptr_t addr, int n=2147483647):
    """Wake up to ``n`` waiters on the shared futex word at ``addr``."""
    cdef long r = kvs_futex_wake(addr, n)
    if r < 0:
        raise OSError("futex wake failed")
    return r

def buffer_address(const unsigned char[::1] buf):
    """Base address of a contiguous buffer (read-only buffers allowed)."""
    if buf.shape[0] == 0:
        raise ValueError("empty buffer has no address")
    return <uintptr_t>&buf[0]

def spin_until_u32_ne(uintptr_t addr, uint32_t value, unsigned int spins):
    """Spin (CPU relax hint, GIL released) while ``*addr == value``; returns the last value read."""
    cdef unsigned int i
    cdef uint32_t cur = value
    with nogil:
        for i in range(spins):
            cur = kvs_load_acq32(addr)
            if cur != value:
                break
            kvs_cpu_relax()
    return cur
