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

cdef extern from *:
    """
    #include <stdint.h>
    #include <errno.h>
    #include <time.h>
    #include <unistd.h>
    #include <sys/syscall.h>
    #include <linux/futex.h>

    static inline uint64_t kvs_load_acq64(uintptr_t a) { return __atomic_load_n((uint64_t*)a, __ATOMIC_ACQUIRE); }
    static inline void kvs_store_rel64(uintptr_t a, uint64_t v) { __atomic_store_n((uint64_t*)a, v, __ATOMIC_RELEASE); }
    static inline uint32_t kvs_load_acq32(uintptr_t a) { return __atomic_load_n((uint32_t*)a, __ATOMIC_ACQUIRE); }
    static inline void kvs_store_rel32(uintptr_t a, uint32_t v) { __atomic_store_n((uint32_t*)a, v, __ATOMIC_RELEASE); }
    static inline int kvs_cas64(uintptr_t a, uint64_t expected, uint64_t desired) {
        return __atomic_compare_exchange_n((uint64_t*)a, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    }
    static inline uint64_t kvs_fetch_add64(uintptr_t a, uint64_t d) { return __atomic_fetch_add((uint64_t*)a, d, __ATOMIC_SEQ_CST); }
    static inline uint32_t kvs_fetch_add32(uintptr_t a, uint32_t d) { return __atomic_fetch_add((uint32_t*)a, d, __ATOMIC_SEQ_CST); }
    static inline void kvs_fence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
    static inline void kvs_cpu_relax(void) {
    #if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
    #elif defined(__aarch64__)
        __asm__ __volatile__("yield");
    #endif
    }
    /* Returns 0 when woken (or value changed), 1 on timeout, -errno otherwise. */
    static int kvs_futex_wait(uintptr_t a, uint32_t expected, int64_t timeout_ns) {
        struct timespec ts, *tsp = NULL;
        if (timeout_ns >= 0) { ts.tv_sec = timeout_ns / 1000000000LL; ts.tv_nsec = timeout_ns % 1000000000LL; tsp = &ts; }
        long r = syscall(SYS_futex, (uint32_t*)a, FUTEX_WAIT, expected, tsp, NULL, 0);
        if (r == 0) return 0;
        if (errno == EAGAIN || errno == EINTR) return 0;
        if (errno == ETIMEDOUT) return 1;
        return -errno;
    }
    static long kvs_futex_wake(uintptr_t a, int n) {
        return syscall(SYS_futex, (uint32_t*)a, FUTEX_WAKE, n, NULL, NULL, 0);
    }
    """
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

def doorbell_ring(uintptr_t seq_addr, uintptr_t sleeping_addr):
    """The doorbell's post in one call (``kvsidecar.shm.doorbell``): increment ``seq`` (seq_cst RMW,
    a full fence), then ``futex_wake`` only if the waiter published ``sleeping``.  Returns True
    when a wake-up was posted."""
    kvs_fetch_add32(seq_addr, 1)
    if kvs_load_acq32(sleeping_addr):
        if kvs_futex_wake(seq_addr, 2147483647) < 0:
            raise OSError("futex wake failed")
        return True
    return False

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
