"""One sidecar connection per calling thread.

A :class:`~kvsidecar.connector.client.SidecarClient` owns one SPSC submit ring and one SPSC
completion ring: exactly one thread may use it.  An engine that calls its storage backend
from several threads (SGLang: the prefetch, I/O, backup and scheduler threads of each rank)
gives each thread its own :class:`~kvsidecar.connector.kv_client.KVConnector` (its own client slot and
its own mapping of the pool, in which the leases it gets are valid).

Invariants: a connector is only ever used by the thread that created it; a thread whose
sidecar is down gets ``None`` (a miss) and retries at most every ``reattach_every_s``;
``close_all`` detaches every thread's connector (any thread may call it, once the engine's
threads are stopped).
"""

from __future__ import annotations

import logging
import threading
import time

from kvsidecar.shm.errors import KvSidecarError

from .kv_client import KVConnector

log = logging.getLogger(__name__)


class _Slot:
    __slots__ = ("conn", "down_since")

    def __init__(self):
        self.conn: KVConnector | None = None
        self.down_since: float | None = None


class PerThreadConnectors:
    def __init__(self, make, reattach_every_s: float):
        self._make = make  # () -> a new, unattached KVConnector
        self.reattach_every_s = reattach_every_s
        self._local = threading.local()
        self._lock = threading.Lock()
        self._all: list[KVConnector] = []
        self.attaches = 0

    def current(self) -> KVConnector | None:
        """This thread's attached connector, or None while the sidecar is unavailable."""
        slot = getattr(self._local, "slot", None)
        if slot is None:
            slot = self._local.slot = _Slot()
        if slot.conn is not None and slot.conn.client.attached:
            return slot.conn
        if slot.down_since is not None and time.monotonic() - slot.down_since < self.reattach_every_s:
            return None
        if slot.conn is not None:
            slot.conn.close()  # a dead incarnation: map the new one's pool
        else:
            slot.conn = self._make()
            with self._lock:
                self._all.append(slot.conn)
        try:
            slot.conn.attach()
        except KvSidecarError as exc:
            if slot.down_since is None:
                log.warning("kvsidecar unavailable in thread %s (%s): storage misses until it is back",
                            threading.current_thread().name, exc)
            slot.conn.close()
            slot.down_since = time.monotonic()
            return None
        slot.down_since = None
        with self._lock:
            self.attaches += 1
        return slot.conn

    def broken(self) -> None:
        """The current thread's call failed: if its client is gone, back off before re-attaching."""
        slot = getattr(self._local, "slot", None)
        if slot is not None and (slot.conn is None or not slot.conn.client.attached):
            slot.down_since = time.monotonic()

    def count(self) -> int:
        with self._lock:
            return len(self._all)

    def close_all(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            try:
                conn.detach()
            except KvSidecarError:
                conn.close()
