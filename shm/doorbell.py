r"""A cross-process doorbell: a futex word plus a "sleeping" flag, in shared memory.

Layout at ``offset`` (8 bytes, on a cache line of its own): ``seq: u32``, ``sleeping: u32``.

Protocol (no lost wake-ups, no idle polling):

* **Poster**: after publishing its data (a ring tail store-release), atomically
  increments ``seq`` (a seq_cst read-modify-write, which is also a full fence),
  then, only if ``sleeping`` is set, ``futex_wake``\s.  The increment is what a
  spinning waiter watches, so a ring costs one atomic and no syscall unless the
  waiter really sleeps.
* **Waiter** (one thread at a time per doorbell): reads ``seq`` *before* checking
  its ``ready()`` condition; spins (natively, GIL released, CPU relax hint) while
  ``seq`` is unchanged; then publishes ``sleeping = 1``, **full fence**, re-checks
  ``ready()``, and only then ``futex_wait(seq, observed)`` with a deadline.

Why no wake-up is lost: a post that happens after the waiter read ``seq`` changes
``seq``, so the spin ends or ``futex_wait`` returns at once (the kernel compares
the word atomically).  A post whose data landed before that read is seen by the
``ready()`` check that follows it.  The waiter's store of ``sleeping`` and the
poster's increment are ordered by the fence / RMW on each side (store→load
reordering is otherwise allowed, even on x86), so either the poster sees
``sleeping`` and wakes, or the waiter's re-check sees the data.
"""

from __future__ import annotations

import os
import time

from kvsidecar._native import atomics as _a

DOORBELL_BYTES = 8
_INT_MAX = 2**31 - 1
_YIELD_AFTER_S = 30e-6  # spin this long before yielding the CPU between chunks
_SPIN_CHUNK = 64  # relax-hinted loads between clock checks (~1-5 µs)


class Doorbell:
    __slots__ = ("seq_addr", "sleeping_addr", "spin_s", "wakeups_posted")

    def __init__(self, base_address: int, offset: int, spin_s: float = 50e-6):
        self.seq_addr = base_address + offset
        self.sleeping_addr = base_address + offset + 4
        self.spin_s = spin_s
        self.wakeups_posted = 0

    def ring(self) -> bool:
        """Signal the waiter.  Returns True when a futex wake-up was posted."""
        _a.fetch_add_u32(self.seq_addr, 1)
        if _a.load_acquire_u32(self.sleeping_addr):
            _a.futex_wake(self.seq_addr, _INT_MAX)
            self.wakeups_posted += 1
            return True
        return False

    def wait(self, ready, timeout_s: float, spin_s: float | None = None) -> bool:
        """Block until ``ready()`` is true or ``timeout_s`` passes; returns ``ready()``.

        Spins for up to ``spin_s`` (default: the doorbell's) before sleeping.  A
        ring does not imply readiness (several events share one doorbell), so the
        caller loops on its own condition.
        """
        observed = _a.load_acquire_u32(self.seq_addr)
        if ready():
            return True
        spin = min(self.spin_s if spin_s is None else spin_s, timeout_s)
        start = time.perf_counter()
        if spin > 0:
            end = start + spin
            while True:
                cur = _a.spin_until_u32_ne(self.seq_addr, observed, _SPIN_CHUNK)
                if cur != observed:
                    if ready():
                        return True
                    observed = cur
                now = time.perf_counter()
                if now >= end:
                    break
                if now - start < _YIELD_AFTER_S:
                    continue
                # A peer we just woke may have been queued on this CPU (wake-affine
                # placement); yielding lets it run instead of waiting out our spin.
                os.sched_yield()
        remaining = timeout_s - (time.perf_counter() - start)
        if remaining <= 0:
            return ready()
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
