"""Client liveness: one thread blocked in ``poll`` on a pidfd per attached client.

A pidfd refers to one process, not a PID number, so it is immune to PID reuse
once opened; the remaining window (the client dies and its PID is reused before
we open the pidfd) is closed by comparing the process start time the client
wrote into its slot with the one ``/proc`` reports for the pidfd's process.

When a pidfd becomes readable (the process exited) the monitor calls
``on_dead(key)`` from its own thread; the callback must only enqueue an event
and ring the control thread.  No timeouts are needed: the thread sleeps until a
process dies or the watch set changes (an eventfd).

A pidfd fires only after the dead process's address space is torn down, which for
a rank that mapped a large pool with 4 KiB pages takes ~50-90 ms per GiB.  With
``death_word_of`` (a constructor argument: key -> address) the monitor also waits on each client's death word
(``kvsidecar.shm.deathword``: a robust mutex the client holds in its slot), which the kernel
releases *before* that teardown, so a killed rank is reclaimed within milliseconds
whatever the pool size.  Whichever fires first reports; ``on_dead`` runs once per watch.
"""

from __future__ import annotations

import logging
import os
import select
import threading

from kvsidecar.shm.control import process_start_ticks
from kvsidecar.shm.deathword import DeathWordWatch

log = logging.getLogger(__name__)


class LivenessMonitor:
    def __init__(self, on_dead, death_word_of=None):
        self._on_dead = on_dead
        self._lock = threading.Lock()
        self._watches: dict[int, tuple[object, int]] = {}  # pidfd -> (key, pid)
        self._by_key: dict[object, int] = {}
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._stop = False
        self._death_word_of = death_word_of  # key -> address of the client's death word (None: pidfds only)
        self._death_watches: dict[object, DeathWordWatch] = {}
        self._retired: list[DeathWordWatch] = []  # stopped, maybe still running: joined in stop()
        self.early_deaths = 0  # deaths reported by a death word before the pidfd
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
            address = self._death_word_of(key) if self._death_word_of is not None else None
            if address:
                self._death_watches[key] = DeathWordWatch(address, pid, lambda: self._early_death(key, fd, pid),
                                                          name=str(pid))
        os.eventfd_write(self._wake_fd, 1)
        return True

    def _retire(self, dw: DeathWordWatch) -> None:  # with self._lock held
        dw.stop(join_s=0.0)  # wakes it; it exits without reporting
        self._retired = [w for w in self._retired if w.alive]
        self._retired.append(dw)

    def _early_death(self, key, fd: int, pid: int) -> None:  # a DeathWordWatch thread
        with self._lock:
            if self._by_key.get(key) != fd:
                return  # already reported or unwatched
            self._by_key.pop(key)
            self._watches.pop(fd, None)
            os.close(fd)
            me = self._death_watches.pop(key, None)
            if me is not None:
                self._retired.append(me)  # this very thread: joined in stop()
            self.early_deaths += 1
        os.eventfd_write(self._wake_fd, 1)
        log.info("client pid %d exiting (death word, before its address space is torn down)", pid)
        self._on_dead(key)

    def unwatch(self, key, _locked: bool = False) -> None:
        if not _locked:
            with self._lock:
                return self.unwatch(key, _locked=True)
        fd = self._by_key.pop(key, None)
        dw = self._death_watches.pop(key, None)
        if dw is not None:
            self._retire(dw)
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
            watches = list(self._death_watches.values())
            self._death_watches.clear()
            retired, self._retired = self._retired, []
        for dw in watches:
            dw.stop(join_s=1.0)  # before the control segment they read is unmapped
        for dw in retired:
            dw.join(1.0)
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
                        dw = self._death_watches.pop(entry[0], None)
                        if dw is not None:
                            self._retire(dw)
                if entry is not None:
                    log.info("client pid %d exited", entry[1])
                    self._on_dead(entry[0])
