"""Death words: a client's death seen before its address space is torn down.

A pidfd becomes readable only when the process has fully exited, i.e. after the
kernel tore down its address space.  For a rank that mapped (and populated) a large
pool with 4 KiB pages that takes ~50-90 ms per GiB, so the sidecar would reclaim a
killed rank's leases seconds late on a big node pool.

The kernel processes a dying thread's *robust futex list* in ``exit_mm`` before it
drops the address space, for SIGKILL too.  So each client holds a robust,
process-shared pthread mutex in its control slot, locked by a thread of its own
(:class:`DeathSentinel`) for as long as it is attached.  When that thread dies, the
kernel sets ``FUTEX_OWNER_DIED`` in the mutex word and wakes a waiter — the sidecar's
:class:`DeathWordWatch` — whatever the pool size.  The watcher then checks that the
whole process is exiting (every thread has ``PF_EXITING``) before it reports; if not
it gives up and the pidfd decides, as before.

The word lives at ``slot + DEATH_WORD_OFFSET`` (40 bytes: a glibc x86-64
``pthread_mutex_t``; the futex word is its first u32).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

from kvsidecar._native import atomics as _a

log = logging.getLogger(__name__)

DEATH_WORD_OFFSET = 16
MUTEX_BYTES = 40
FUTEX_WAITERS = 0x80000000
FUTEX_OWNER_DIED = 0x40000000
FUTEX_TID_MASK = 0x3FFFFFFF
PF_EXITING = 0x4
PTHREAD_PROCESS_SHARED = 1
PTHREAD_MUTEX_ROBUST = 1

_libc = ctypes.CDLL(None, use_errno=True)
for _fn in ("pthread_mutexattr_init", "pthread_mutexattr_setpshared", "pthread_mutexattr_setrobust",
            "pthread_mutexattr_destroy", "pthread_mutex_init", "pthread_mutex_lock", "pthread_mutex_unlock"):
    getattr(_libc, _fn).restype = ctypes.c_int


class DeathSentinel:
    """Client side: a daemon thread that locks the robust mutex at ``address`` and holds it
    until :meth:`release` (or until the process dies, which is the point)."""

    def __init__(self, address: int):
        self.address = address
        self._release = threading.Event()
        self._locked = threading.Event()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="kvsidecar-death-sentinel", daemon=True)
        self._thread.start()
        if not self._locked.wait(5.0):
            self.error = self.error or "sentinel did not lock in time"

    @property
    def held(self) -> bool:
        return self._locked.is_set() and self.error is None

    def _run(self) -> None:
        attr = ctypes.create_string_buffer(16)  # pthread_mutexattr_t is 4 bytes
        m = ctypes.c_void_p(self.address)
        try:
            rc = (_libc.pthread_mutexattr_init(attr)
                  or _libc.pthread_mutexattr_setpshared(attr, PTHREAD_PROCESS_SHARED)
                  or _libc.pthread_mutexattr_setrobust(attr, PTHREAD_MUTEX_ROBUST)
                  or _libc.pthread_mutex_init(m, attr))
            _libc.pthread_mutexattr_destroy(attr)
            if rc == 0:
                rc = _libc.pthread_mutex_lock(m)
            if rc != 0:
                self.error = f"robust mutex: {os.strerror(rc)}"
                return
            _a.futex_wake(self.address)  # a watcher that looked before we locked
        finally:
            self._locked.set()
        self._release.wait()
        _libc.pthread_mutex_unlock(m)  # EPERM if the slot was re-initialised meanwhile: harmless

    def release(self, timeout_s: float = 5.0) -> None:
        """Unlock (the slot must still be ours) and end the thread."""
        self._release.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)


def _threads_all_exiting(pid: int) -> bool:
    """True when every remaining thread of ``pid`` has PF_EXITING set (or none is left)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        except OSError:
            return False
        if rest[0] in ("Z", "X"):
            continue
        if not int(rest[6]) & PF_EXITING:
            return False
    return True


class DeathWordWatch:
    """Sidecar side: one thread waiting (futex, no polling) on one client's death word.

    ``on_death()`` is called once if the holder died and its whole process is exiting.
    :meth:`stop` ends the wait without a lost wake-up (it clears the waiters bit it set
    before waking, so a waiter about to sleep sees a changed word)."""

    LOCK_WAIT_S = 1.0  # a client locks its word right after claiming the slot
    EXIT_CHECK_S = 0.2  # sibling threads take the kill within microseconds

    def __init__(self, address: int, pid: int, on_death, name: str = ""):
        self.address = address
        self.pid = pid
        self._on_death = on_death
        self._stopped = False
        self.tid = 0
        self._thread = threading.Thread(target=self._run, name=f"kvsidecar-deathword-{name or pid}", daemon=True)
        self._thread.start()

    def _word(self) -> int:
        return _a.load_acquire_u32(self.address)

    def _holder_is_client(self, v: int) -> bool:
        tid = v & FUTEX_TID_MASK
        return bool(tid) and not v & FUTEX_OWNER_DIED and os.path.exists(f"/proc/{self.pid}/task/{tid}")

    def _set_waiters(self, v: int) -> None:
        w = _a.load_acquire_u64(self.address)
        if w & 0xFFFFFFFF == v:
            _a.cas_u64(self.address, w, (w & ~0xFFFFFFFF) | (v | FUTEX_WAITERS))

    def _run(self) -> None:
        deadline = time.monotonic() + self.LOCK_WAIT_S
        v = self._word()
        while not self._holder_is_client(v):
            # The client locks its word right after claiming the slot and then wakes us, so this
            # only waits when we looked first; a slot claimed without a sentinel times out once.
            left = deadline - time.monotonic()
            if self._stopped or left <= 0:
                return  # no early signal for this client; the pidfd still decides
            _a.futex_wait(self.address, v, left)
            if self._stopped:
                return
            v = self._word()
        self.tid = v & FUTEX_TID_MASK
        while not self._stopped:
            v = self._word()
            if v & FUTEX_OWNER_DIED:
                break
            if v & FUTEX_TID_MASK != self.tid:
                return  # unlocked (detach) or re-initialised: not a death
            if not v & FUTEX_WAITERS:
                self._set_waiters(v)
                continue
            _a.futex_wait(self.address, v, 3600.0)
        if self._stopped:
            return
        deadline = time.monotonic() + self.EXIT_CHECK_S
        while not _threads_all_exiting(self.pid):
            if self._stopped or time.monotonic() > deadline:
                log.info("death word of pid %d fired but the process is not exiting; the pidfd decides", self.pid)
                return
            time.sleep(0.001)
        if not self._stopped:
            self._on_death()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def stop(self, join_s: float = 1.0) -> None:
        """Stop waiting.  The caller must keep the word mapped until the thread ended (``join``)."""
        self._stopped = True
        w = _a.load_acquire_u64(self.address)
        if w & FUTEX_WAITERS and not w & FUTEX_OWNER_DIED:
            _a.cas_u64(self.address, w, w & ~FUTEX_WAITERS)
        _a.futex_wake(self.address)
        if self._thread is not threading.current_thread():
            self._thread.join(join_s)
