/* The atomics and futex calls every native module of kvsidecar shares (``atomics.pyx`` exposes
 * them to Python; ``ring.pyx`` uses them on the ring and doorbell hot paths).  C11 orderings via
 * GCC ``__atomic`` builtins: correct on weakly ordered CPUs as well as x86.  The futex is the
 * shared (not FUTEX_PRIVATE) one, so a waiter in one process is woken by a poster in another. */
#ifndef KVS_SYNC_H
#define KVS_SYNC_H
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

#endif
