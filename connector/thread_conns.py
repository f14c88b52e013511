"""Sidecar connections for a host that calls from many threads: a bounded pool, checked out per call.

A :class:`~kvsidecar.connector.client.SidecarClient` owns one SPSC submit ring and one SPSC completion
ring: one producer per ring.  An engine that calls its storage backend from several threads
(SGLang: the prefetch, I/O, backup and scheduler threads of each rank, restarted by every
``/flush_cache`` and controller reset) needs several connections, but must never hold more
than a few, whatever it does with its threads.

**Mechanism: a connection is checked out for one call and checked back in when the call
returns** (:meth:`ConnectionPool.checkout`, a context manager).  A thread therefore holds a
connection only while it is inside a call -- so a thread that ends holds none, and ended
threads cost nothing.  Why this and not a per-thread connection released by a finalizer:

* **Bounded by construction.**  The pool holds at most ``max_connections`` (and never more
  than the peak number of threads inside a call at once), however many threads the host
  starts, ends or keeps alive; a finalizer bounds nothing for a host that keeps 64 threads.
* **Nothing depends on when a thread's locals are torn down** (interpreter internals, a
  daemon thread at exit, a reference cycle that keeps a ``threading.local`` value alive).
* **Connections do not churn.**  A detach is not free for the sidecar: it releases the
  *rank's* share of group leases and aborts the rank's unfinished group stores (they are
  keyed by (group, rank), not by client), so a connection that leaves while another of the
  same rank is mid-store would cut that store.  Pooled connections stay attached until
  :meth:`close_all` (the backend's ``close``); a thread's end detaches nothing.
* **Slot scarcity degrades to sharing, not to misses**: when the sidecar has no free slot,
  the pool stops growing (for ``reattach_every_s``) and the thread waits, bounded, for a
  connection another thread checks in.  Only a pool with no connection at all answers
  ``None`` (a miss) -- and then the refusal is counted and logged with the biggest holder.

Invariants:

* **One producer per ring**: a connection is checked out to at most one thread at a time
  (the free list and the in-use set change only under the pool's lock; the lock's
  acquire/release orders one holder's ring writes before the next holder's).  A nested
  checkout by the thread that already holds one gets the same connection (re-entrant), so a
  call never waits for itself.
* Connections held ≤ ``max_connections``; in use ≤ held.  A connection checked in is
  attached, or is re-attached by its next checkout (a sidecar restart: a new incarnation,
  its own pool mapping); while the sidecar is down every checkout answers ``None`` at once
  and an attach is retried per the pool's one
  :class:`~kvsidecar.connector.reconnect.ReconnectPolicy` (all threads together; its
  :meth:`run` is the backend's degrade-and-re-attach).
* Every wait is bounded (``wait_s`` for a free connection; then ``None`` and a counter).
* ``close_all`` detaches every connection (any thread; call it once the host's threads are
  stopped -- a connection still checked out is detached when it is checked in).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from kvsidecar.shm.errors import KvSidecarError, UnavailableCause

from .kv_client import KVConnector
from .reconnect import ReconnectPolicy

log = logging.getLogger(__name__)

DEFAULT_MAX_CONNECTIONS = 4  # SGLang calls from 4 threads per rank: prefetch, I/O, backup, scheduler


class ConnectionPool:
    def __init__(self, make, *, max_connections: int = DEFAULT_MAX_CONNECTIONS, reattach_every_s: float = 1.0,
                 wait_s: float = 2.0, name: str = "kvsidecar"):
        """``make() -> KVConnector`` builds a new, unattached connection."""
        if max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        self._make = make
        self.max_connections = max_connections
        self.reattach_every_s = reattach_every_s
        self.wait_s = wait_s
        self.name = name
        self._cond = threading.Condition(threading.Lock())
        self._all: list[KVConnector] = []  # every connection the pool holds (attached or not)
        self._free: list[KVConnector] = []  # checked in; last in, first out (a small hot set)
        self._holder: dict[int, list] = {}  # thread ident -> [conn, depth] while inside a call
        self.policy = ReconnectPolicy(reattach_every_s, name=name)  # one gate for every thread
        self._grow_after = float("-inf")  # no new connection before this (the sidecar had no slot)
        self._closed = False
        self.counters = {"attaches": 0, "checkouts": 0, "waited": 0, "wait_timeouts": 0, "unavailable": 0,
                         "slot_exhaustions": 0, "peak_in_use": 0}

    # -- the one entry point --------------------------------------------------------------------
    @contextlib.contextmanager
    def checkout(self):
        """``with pool.checkout() as conn:`` -- an attached connection for this thread alone, or
        ``None`` (the sidecar is unavailable, or no connection came free within ``wait_s``)."""
        me = threading.get_ident()
        with self._cond:
            held = self._holder.get(me)
            if held is not None:  # re-entrant: this thread's call already holds one
                held[1] += 1
        if held is not None:
            try:
                yield held[0]
            finally:
                with self._cond:
                    held[1] -= 1
            return
        conn = self._acquire()
        if conn is None:
            yield None
            return
        with self._cond:
            self._holder[me] = [conn, 1]
        try:
            yield conn
        finally:
            self._checkin(me, conn)

    def run(self, fn, default, *, retry: bool = True, on_miss=None):
        """``fn(conn)`` on a connection checked out for this thread, or ``default`` (a miss): the
        policy's degrade-and-re-attach (:meth:`ReconnectPolicy.run`)."""
        return self.policy.run(self.checkout, fn, default, retry=retry, on_miss=on_miss)

    # -- internals --------------------------------------------------------------------------------
    def _acquire(self) -> KVConnector | None:
        deadline = time.monotonic() + self.wait_s
        while True:
            conn = self._take(deadline)
            if conn is None or conn.client.attached:
                return conn
            outcome = self._attach(conn)
            if outcome == "ok":
                return conn
            if outcome == "busy":
                continue  # the pool stopped growing: wait for one of ours
            return None

    def _take(self, deadline: float) -> KVConnector | None:
        """A free connection, a new one (under the cap), or after a bounded wait ``None``."""
        waited = False
        with self._cond:
            while True:
                now = time.monotonic()
                if self._closed:
                    return None
                if self.policy.held_off():
                    self.counters["unavailable"] += 1
                    return None
                if self._free:
                    conn = self._free.pop()
                    break
                if len(self._all) < self.max_connections and (now >= self._grow_after or not self._all):
                    conn = self._make()
                    self._all.append(conn)
                    self._mark_in_use()
                    return conn
                if now >= deadline:
                    self.counters["wait_timeouts"] += 1
                    return None
                if not waited:
                    waited = True
                    self.counters["waited"] += 1
                self._cond.wait(deadline - now)
            self._mark_in_use()
            return conn

    def _mark_in_use(self) -> None:
        self.counters["checkouts"] += 1
        in_use = len(self._all) - len(self._free)
        if in_use > self.counters["peak_in_use"]:
            self.counters["peak_in_use"] = in_use

    def _attach(self, conn: KVConnector) -> str:
        """Attach ``conn`` (outside the lock: a round trip and a pool mapping).  "ok", "busy"
        (no free slot, but the pool has other connections to share) or "down"."""
        def sharing() -> bool:
            with self._cond:
                return any(c is not conn for c in self._all)

        cause = self.policy.attach(conn, sharing=sharing)
        with self._cond:
            if cause is None:
                self.counters["attaches"] += 1
                return "ok"
            if cause is UnavailableCause.SLOTS_EXHAUSTED:
                self.counters["slot_exhaustions"] += 1
                self._all.remove(conn)
                self._grow_after = time.monotonic() + self.reattach_every_s
                shared = bool(self._all)
            else:
                self._free.append(conn)  # kept: re-attached by a later checkout
                shared = False
            self._cond.notify_all()
        return "busy" if shared else "down"

    def _checkin(self, me: int, conn: KVConnector) -> None:
        with self._cond:
            del self._holder[me]
            closed = self._closed
            if closed:
                if conn in self._all:
                    self._all.remove(conn)
            else:
                self._free.append(conn)
                self._cond.notify()
        if closed:
            _detach(conn)

    # -- for the host ---------------------------------------------------------------------------
    def count(self) -> int:
        """Connections this process holds (each is one client slot while attached)."""
        with self._cond:
            return len(self._all)

    def in_use(self) -> int:
        with self._cond:
            return len(self._all) - len(self._free)

    def stats(self) -> dict:
        with self._cond:
            out = {**self.counters, "connections": len(self._all), "in_use": len(self._all) - len(self._free),
                   "attached": sum(1 for c in self._all if c.client.attached), "max": self.max_connections}
        p = self.policy.stats()
        out.update({"misses": p["misses"], "errors": p["errors"], "held_off": p["held_off"],
                    **{f"unavailable_{k}": v for k, v in p["causes"].items()}})
        return out

    def close_all(self) -> None:
        """Detach every connection checked in now; one still checked out is detached at check-in."""
        with self._cond:
            self._closed = True
            free, self._free = self._free, []
            self._all = [c for c in self._all if c not in free]
            self._cond.notify_all()
        for conn in free:
            _detach(conn)


def _detach(conn: KVConnector) -> None:
    try:
        conn.detach()
    except KvSidecarError:
        conn.close()
