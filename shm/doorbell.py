"""A cross-process doorbell: a futex word plus a "sleeping" flag, in shared memory.

Layout at ``offset`` (8 bytes, on a cache line of its own): ``seq: u32``, ``sleeping: u32``.

Protocol (no lost wake-ups, no idle polling):

* **Waiter** (one thread at a time per doorbell): spin briefly on its ``ready()``
  check; then read ``seq``, publish ``sleeping = 1``, **full fence**, re-check
  ``ready()``; only if still nothing, ``futex_wait(seq, observed)`` with a deadline.
* **Poster**: after publishing its data (a ring tail store-release), **full
  fence**, then if ``sleeping`` is set: increment ``seq`` and ``futex_wake``.

Why both fences: the waiter stores ``sleeping`` then loads the ring; the poster
stores the ring then loads ``sleeping``.  Acquire/release does not order a store
before a later load (store-load reordering is allowed even on x86), so without
the seq_cst fences both sides could miss each other.  With them, at least one
side sees the other: either the waiter sees the data in its re-check, or the
poster sees ``sleeping`` and bumps ``seq``; the bump makes ``futex_wait`` return
at once if it happens between the waiter's read of ``seq`` and its sleep.
"""

from __future__ import annotations

import time

from native import atomics as _a

DOORBELL_BYTES = 8
_INT_MAX = 2**31 - 1


class Doorbell:
    __slots__ = ("seq_addr", "sleeping_addr", "spin_s", "wakeups_posted")

    def __init__(self, base_address: int, offset: int, spin_s: float = 50e-6):
        self.seq_addr = base_address + offset
        self.sleeping_addr = base_address + offset + 4
        self.spin_s = spin_s
        self.wakeups_posted = 0

    def ring(self) -> bool:
        """Wake the waiter if it sleeps.  Returns True when a wake-up was posted."""
        _a.fence()
        if _a.load_acquire_u32(self.sleeping_addr):
            _a.fetch_add_u32(self.seq_addr, 1)
            _a.futex_wake(self.seq_addr, _INT_MAX)
            self.wakeups_posted += 1
            return True
        return False

    def wait(self, ready, timeout_s: float, spin_s: float | None = None) -> bool:
        """Block until ``ready()`` is true or ``timeout_s`` passes; returns ``ready()``.

        Spins for ``spin_s`` (default: the doorbell's) before sleeping.  A wake-up
        does not imply readiness (another event may share the doorbell), so the
        caller loops on its own condition.
        """
        if ready():
            return True
        spin = self.spin_s if spin_s is None else spin_s
        now = time.perf_counter()
        if spin > 0:
            spin_end = now + min(spin, timeout_s)
            while True:
                if ready():
                    return True
                now = time.perf_counter()
                if now >= spin_end:
                    break
        remaining = timeout_s - spin if spin > 0 else timeout_s
        if remaining <= 0:
            return ready()
        observed = _a.load_acquire_u32(self.seq_addr)
        _a.store_release_u32(self.sleeping_addr, 1)
        _a.fence()
        try:
            if ready():
                return True
            _a.futex_wait(self.seq_addr, observed, remaining)
        finally:
            _a.store_release_u32(self.sleeping_addr, 0)
        return ready()

    def sleeping(self) -> bool:
        return bool(_a.load_acquire_u32(self.sleeping_addr))
