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

Adaptive spin (the waiter's side, per doorbell object): a spin pays only when the
peer runs on another CPU at the same time and answers within the spin.  When it
does not — the peer was asleep and needs a wake-up, or both share one busy CPU and
the spin only delays the peer — spinning costs the peer its CPU (measured: 76 µs
back-to-back on a loaded 2-vCPU VM, against 10 µs blocking).  So a spin counts as
*paid* when ``ready()`` turned true before the waiter first yielded; after
``SPIN_MISSES`` unpaid spins in a row the next ``SPIN_SKIP`` waits sleep at once,
then one spin probes again.  Back-to-back traffic on free CPUs keeps spinning;
idle or CPU-starved traffic sleeps like a socket.  Spinning never changes what a
wait returns, only how soon.

After a wake-up every line here runs cold (the idle gap let other work evict it), so a wait
that does not spin goes straight to sleep (the native ``Bell.sleep``: publish, fence, re-check,
``futex_wait``, clear), and a caller that
re-checks its own condition at once passes ``recheck=False`` (the control loop: its next
step serves what woke it, so a second scan inside the wait would only delay that).

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
from kvsidecar._native import ring as _native

DOORBELL_BYTES = 8
_YIELD_AFTER_S = 30e-6  # spin this long before yielding the CPU between chunks
_SPIN_CHUNK = 64  # relax-hinted loads between clock checks (~1-5 µs)
SPIN_MISSES = 2  # unpaid spins in a row before spinning is skipped
SPIN_SKIP = 16  # waits that then sleep at once before the next probe spin


class Doorbell(_native.Bell):
    """The waiter's side of the protocol (spin, then sleep), over the native :class:`Bell`
    (``seq_addr``, ``sleeping_addr``, ``wakeups_posted``, and ``ring()``: the poster's side, one
    native call that returns True when a futex wake-up was posted).  A waiter whose condition is
    "this ring has a frame" sleeps by ``RingConsumer.wait_pop`` instead: the same protocol, native."""

    __slots__ = ("spin_s", "_misses", "_skip", "spins_paid", "spins_unpaid", "spins_skipped")

    def __init__(self, base_address: int, offset: int, spin_s: float = 50e-6):
        self.spin_s = spin_s
        self._misses = 0
        self._skip = 0
        self.spins_paid = self.spins_unpaid = self.spins_skipped = 0

    def _spin_result(self, paid: bool) -> None:
        if paid:
            self.spins_paid += 1
            self._misses = 0
            return
        self.spins_unpaid += 1
        self._misses += 1
        if self._misses >= SPIN_MISSES:
            self._misses = 0
            self._skip = SPIN_SKIP

    def wait(self, ready, timeout_s: float, spin_s: float | None = None, recheck: bool = True) -> bool:
        """Block until ``ready()`` is true or ``timeout_s`` passes; returns ``ready()``.

        Spins for up to ``spin_s`` (default: the doorbell's) before sleeping.  A
        ring does not imply readiness (several events share one doorbell), so the
        caller loops on its own condition.  ``recheck=False``: after a sleep, return
        True without calling ``ready()`` again (for a caller that re-checks its own
        condition at once: the first thing after a wake-up is its own work, not a
        second scan).  A wait that sleeps at once (no spin) takes the shortest path:
        after a wake-up this code runs cold, and every line of it is latency.
        """
        observed = _a.load_acquire_u32(self.seq_addr)
        if ready():
            return True
        spin = self.spin_s if spin_s is None else spin_s
        if spin > 0 and self._skip > 0:
            self._skip -= 1
            self.spins_skipped += 1
            spin = 0.0
        if spin <= 0:
            return self.sleep(ready, observed, timeout_s, recheck)  # native: the shortest path
        spin = min(spin, timeout_s)
        start = time.perf_counter()
        end = start + spin
        yielded = False
        while True:
            cur = _a.spin_until_u32_ne(self.seq_addr, observed, _SPIN_CHUNK)
            if cur != observed:
                if ready():
                    self._spin_result(not yielded)
                    return True
                observed = cur
            now = time.perf_counter()
            if now >= end:
                break
            if now - start < _YIELD_AFTER_S:
                continue
            # A peer we just woke may have been queued on this CPU (wake-affine
            # placement); yielding lets it run instead of waiting out our spin.
            yielded = True
            os.sched_yield()
        self._spin_result(False)
        remaining = timeout_s - (time.perf_counter() - start)
        if remaining <= 0:
            return ready()
        return self.sleep(ready, observed, remaining, recheck)

    def sleep_rings(self, ready, consumers: tuple, timeout_s: float) -> int:
        """Sleep at once (no spin) until ``ready()`` or a frame in one of ``consumers``' rings;
        returns the index of the first of them with a frame after the wake-up, else -1 (the
        caller then checks its own condition, as after :meth:`wait` with ``recheck=False``).
        The rings are re-checked natively (``Bell.sleep_scan``): a waiter that serves the ring
        that woke it before anything else starts on it without a scan in Python."""
        observed = _a.load_acquire_u32(self.seq_addr)
        if ready():
            return -1
        return self.sleep_scan(consumers, observed, timeout_s)

    def sleeping(self) -> bool:
        return bool(_a.load_acquire_u32(self.sleeping_addr))
