"""A shaping and fault-injection wrapper around any backend (tests and benchmarks).

* ``latency_s``: added once per read/write call (a network round trip);
* ``bandwidth_bps``: bytes take ``bytes / bandwidth`` seconds (0 = unlimited; a read pays for
  the blocks the store holds: a missing key costs only the round trip);
* ``fail``: per-block read failures — ``"first"`` (block 0 of each call), ``"tail"``
  (the last block), ``"random"`` (each with ``fail_prob``), ``"keys"`` (keys containing
  any of ``fail_keys``) or ``""``;
* ``hang``: reads block until :meth:`release_hang` (or close), to test drains and aborts.
* ``read_gate``: the name of a POSIX named semaphore a test created (closed, value 0); every read
  waits until it can take the semaphore's token (and gives it back), so a test from another
  process holds reads "mid-flight" until it releases the token once.  ``stats()["gate_waiting"]``
  counts the reads held there.  Off ("") by default: then reads never touch it.

Delays wait on an event, so ``close`` cuts them short; nothing sleeps blindly.
"""

from __future__ import annotations

import random
import threading
import time

import posix_ipc

from kvsidecar.sidecar.l3.base import L3Backend


class ShapedBackend(L3Backend):
    def __init__(self, inner: L3Backend, *, latency_s: float = 0.0, bandwidth_bps: float = 0.0,
                 fail: str = "", fail_prob: float = 0.0, fail_keys: tuple = (), hang: bool = False,
                 read_gate: str = "", seed: int = 0):
        self.inner = inner
        self.name = f"shaped({inner.name})"
        self.max_batch = inner.max_batch
        self.latency_s = latency_s
        self.bandwidth_bps = bandwidth_bps
        self.fail = fail
        self.fail_prob = fail_prob
        self.fail_keys = tuple(fail_keys)
        self._rng = random.Random(seed)
        self._closed = threading.Event()
        self._hang = threading.Event()
        if not hang:
            self._hang.set()
        self.calls = 0
        self.in_flight = 0
        # the test made the semaphore before starting the sidecar: a missing one is its error
        self._gate = posix_ipc.Semaphore(read_gate) if read_gate else None
        self.gate_waiting = 0
        self._lock = threading.Lock()
        self._gate_idle = threading.Condition(self._lock)  # notified when a held read leaves the gate

    def release_hang(self) -> None:
        self._hang.set()

    def register_pool(self, address, size):
        self.inner.register_pool(address, size)

    def _delay(self, nbytes: int) -> None:
        t = self.latency_s + (nbytes / self.bandwidth_bps if self.bandwidth_bps else 0.0)
        if t > 0:
            end = time.monotonic() + t
            while not self._closed.is_set():
                left = end - time.monotonic()
                if left <= 0:
                    break
                self._closed.wait(left)

    def exists(self, keys):
        if self.latency_s:
            self._closed.wait(self.latency_s)
        return self.inner.exists(keys)

    def read(self, keys, addrs, size, tails=None, tail_size=0):
        with self._lock:
            self.calls += 1
            self.in_flight += 1
        try:
            while not self._hang.is_set() and not self._closed.is_set():
                self._hang.wait(0.5)
            if self._gate is not None:
                self._pass_gate()
            ok = self.inner.read(keys, addrs, size, tails, tail_size)
            self._delay(size * sum(1 for o in ok if o))  # a key the store does not hold moves no bytes
            return [o and not self._fails(i, len(keys), k) for i, (o, k) in enumerate(zip(ok, keys))]
        finally:
            with self._lock:
                self.in_flight -= 1

    def _pass_gate(self) -> None:
        """Wait until the gate's token can be taken (then give it back: the gate stays open), or
        close; the semaphore wakes the waiter, the timeout only re-checks close."""
        with self._lock:
            if self._closed.is_set():  # closing: the handle may be gone; nothing more is held
                return
            self.gate_waiting += 1
        try:
            while not self._closed.is_set():
                try:
                    self._gate.acquire(0.5)
                except posix_ipc.BusyError:
                    continue
                self._gate.release()
                return
        finally:
            with self._lock:
                self.gate_waiting -= 1
                self._gate_idle.notify_all()

    def _fails(self, i: int, n: int, key: str) -> bool:
        if self.fail == "first":
            return i == 0
        if self.fail == "tail":
            return i == n - 1
        if self.fail == "random":
            return self._rng.random() < self.fail_prob
        if self.fail == "keys":
            return any(s in key for s in self.fail_keys)
        return False

    def write(self, keys, addrs, size, tails=None, tail_size=0):
        self._delay(size * len(keys))
        return self.inner.write(keys, addrs, size, tails, tail_size)

    def stats(self):
        out = {**self.inner.stats(), "shaped": True, "calls": self.calls}
        if self._gate is not None:
            out["gate_waiting"] = self.gate_waiting
        return out

    def interrupt(self):
        self._closed.set()
        self._hang.set()

    def close(self):
        self.interrupt()
        if self._gate is not None:
            self._close_gate()
        self.inner.close()

    def _close_gate(self) -> None:
        """Wake the held reads (one token: each passing read gives it back to the next), wait
        (bounded) until none is inside ``acquire``, then close our handle; the test unlinks the
        semaphore.  (Closing it under a waiting thread would be undefined behaviour.)"""
        self._gate.release()
        with self._lock:
            idle = self._gate_idle.wait_for(lambda: self.gate_waiting == 0, timeout=2.0)
        if idle:
            self._gate.close()
