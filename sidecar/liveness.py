"""Client liveness: one thread blocked in ``poll`` on a pidfd per attached client.

A pidfd refers to one process, not a PID number, so it is immune to PID reuse
once opened; the remaining window (the client dies and its PID is reused before
we open the pidfd) is closed by comparing the process start time the client
wrote into its slot with the one ``/proc`` reports for the pidfd's process.

When a pidfd becomes readable (the process exited) the monitor calls
``on_dead(key)`` from its own thread; the callback must only enqueue an event
and ring the control thread.  No timeouts are needed: the thread sleeps until a
process dies or the watch set changes (an eventfd).
"""

from __future__ import annotations

import logging
import os
import select
import threading

from shm.control import process_start_ticks

log = logging.getLogger(__name__)


class LivenessMonitor:
    def __init__(self, on_dead):
        self._on_dead = on_dead
        self._lock = threading.Lock()
        self._watches: dict[int, tuple[object, int]] = {}  # pidfd -> (key, pid)
        self._by_key: dict[object, int] = {}
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvsidecar-liveness", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watch(self, key, pid: int, start_ticks: int = 0) -> bool:
        """Watch ``pid`` under ``key``.  False when it is already dead (or a different process)."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        except OSError as exc:
            log.warning("pidfd_open(%d) failed: %s", pid, exc)
            return False
        if start_ticks and process_start_ticks(pid) != start_ticks:
            os.close(fd)  # the PID was reused: the client we knew is gone
            return False
        with self._lock:
            self.unwatch(key, _locked=True)
            self._watches[fd] = (key, pid)
            self._by_key[key] = fd
        os.eventfd_write(self._wake_fd, 1)
        return True

    def unwatch(self, key, _locked: bool = False) -> None:
        if not _locked:
            with self._lock:
                return self.unwatch(key, _locked=True)
        fd = self._by_key.pop(key, None)
        if fd is not None:
            self._watches.pop(fd, None)
            os.close(fd)
            os.eventfd_write(self._wake_fd, 1)

    def stop(self) -> None:
        self._stop = True
        os.eventfd_write(self._wake_fd, 1)
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        with self._lock:
            for fd in list(self._watches):
                os.close(fd)
            self._watches.clear()
            self._by_key.clear()
        os.close(self._wake_fd)

    def _run(self) -> None:
        while not self._stop:
            poller = select.poll()
            poller.register(self._wake_fd, select.POLLIN)
            with self._lock:
                fds = list(self._watches)
            for fd in fds:
                poller.register(fd, select.POLLIN)
            try:
                events = poller.poll()  # woken by a death or by the eventfd
            except InterruptedError:
                continue
            for fd, _ev in events:
                if fd == self._wake_fd:
                    try:
                        os.eventfd_read(self._wake_fd)
                    except BlockingIOError:
                        pass
                    continue
                if not _ev & select.POLLIN:
                    continue  # POLLNVAL: closed by unwatch since this poll set was built
                with self._lock:
                    entry = self._watches.pop(fd, None)
                    if entry is not None:
                        self._by_key.pop(entry[0], None)
                        os.close(fd)
                if entry is not None:
                    log.info("client pid %d exited", entry[1])
                    self._on_dead(entry[0])
