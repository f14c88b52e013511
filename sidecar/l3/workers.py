"""Worker threads that run L3 calls off the control thread.

Each :class:`Lane` is one thread (or ``threads`` threads) draining one ordered job queue; a job runs a backend
call and hands its result back to the control thread with ``post`` (a deque plus the
sidecar doorbell), so the control thread never blocks on L3.  The sidecar runs three
lanes: **metadata** (existence queries), **read** (restores into the pool) and
**write** (PUTs), so a long store never delays a prefetch read.

A job that has not started can be **cancelled** (atomically with the lane picking it
up): its work never runs, so the pool blocks it would have filled were never touched
and can be freed at once.  A started job always runs to completion.

Several threads on one lane (``l3.read_lanes``) start jobs in priority order and run them
side by side; one is the default for reads: restores of 8 chains at once from one thread
kept up with a raw client reading the same objects from 8 threads on TCP loopback
(``scripts.bench l3``, concurrent row), and one thread keeps the "older request first"
order strict (two chunks running side by side delay both).

A lane sleeps in ``queue.get`` (woken by the next job or the stop sentinel); nothing
polls.  ``stop`` lets the job in progress finish (a backend call is bounded), then
exits; jobs still queued are completed with ``cancelled=True`` so their owners can
release what they reserved.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time

log = logging.getLogger(__name__)

_STOP = object()


class Job:
    __slots__ = ("work", "done", "state", "lock", "priority", "weight", "reaped")

    def __init__(self, work, done, priority: int = 1, weight: int = 0):
        self.work, self.done, self.priority, self.weight = work, done, priority, weight
        self.reaped = False  # (lane thread) a cancelled job's queue entry was seen
        self.state = "queued"  # queued -> started | cancelled
        self.lock = threading.Lock()

    def cancel(self) -> bool:
        """Withdraw the job if it has not started; True when it will never run."""
        with self.lock:
            if self.state == "queued":
                self.state = "cancelled"
                return True
            return False


class Lane:
    def __init__(self, name: str, post, threads: int = 1, around=None):
        """``around``: a context-manager factory entered around every job's work (the sidecar's
        background populate of the pool pauses while a read lands)."""
        self.name = name
        self._post = post
        self._around = around
        self._q: queue.PriorityQueue = queue.PriorityQueue()  # (priority, seq, job): FIFO within a priority
        self._seq = itertools.count()
        self._threads = [threading.Thread(target=self._run, name=f"kvsidecar-{name}" + (f"-{i}" if threads > 1 else ""),
                                          daemon=True) for i in range(max(1, threads))]
        self._stats_lock = threading.Lock()
        self.running = 0  # jobs running now (lane threads)
        self.queued = 0
        self.jobs_done = 0
        self.cancelled = 0
        self.busy_s = 0.0
        # work not finished yet (queued or running), by priority: (jobs, weight) — control thread
        self.pending: dict[int, list] = {}

    @property
    def busy(self) -> bool:
        return self.running > 0

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def submit(self, work, done, priority: int = 1, weight: int = 0) -> Job:
        """Run ``work()`` on this lane, then ``done(result, error)`` on the control thread.

        Lower ``priority`` runs first (FIFO among equals): the request at the head of the
        engine's queue must not wait behind chunks of requests queued after it.  ``weight``
        (e.g. blocks) is counted in :meth:`ahead` until the job finishes or is cancelled.
        """
        self.queued += 1
        job = Job(work, done, priority, weight)
        p = self.pending.setdefault(priority, [0, 0])
        p[0] += 1
        p[1] += weight
        self._q.put((priority, next(self._seq), job))
        return job

    def _run(self) -> None:
        while True:
            item = self._q.get()[2]
            if item is _STOP:
                break
            with item.lock:
                state = item.state
                if state == "queued":
                    item.state = "started"
            if state == "started":
                continue  # the stale entry of a job whose priority was raised: it ran already
            if state == "cancelled":  # withdrawn while queued: its owner already cleaned up
                if not item.reaped:
                    item.reaped = True
                    self._post(self._forget_cancelled, item)
                continue
            work, done = item.work, item.done
            with self._stats_lock:
                self.running += 1
            t0 = time.monotonic()
            try:
                if self._around is not None:
                    with self._around():
                        result, error = work(), None
                else:
                    result, error = work(), None
            except Exception as exc:  # a backend failure becomes a result, never a dead lane
                log.exception("%s lane job failed", self.name)
                result, error = None, exc
            with self._stats_lock:
                self.busy_s += time.monotonic() - t0
                self.running -= 1
                self.jobs_done += 1
            self._post(self._finish, item, result, error)
        # cancel whatever is still queued; another thread's stop sentinel goes back for it
        stops = 0
        while True:
            try:
                item = self._q.get_nowait()[2]
            except queue.Empty:
                break
            if item is _STOP:
                stops += 1
            elif item.cancel():
                self._post(self._finish, item, None, RuntimeError("lane stopped"))
        for _ in range(stops):
            self._q.put((1 << 30, next(self._seq), _STOP))

    def _unpend(self, job: Job) -> None:
        p = self.pending[job.priority]
        p[0] -= 1
        p[1] -= job.weight
        if not p[0]:
            del self.pending[job.priority]  # priorities are per session: keep only live ones

    def _settle(self, job: Job) -> None:
        self.queued -= 1
        self._unpend(job)

    def cancel(self, job: Job) -> bool:
        """Withdraw ``job`` if it has not started (control thread); True when it will never run.
        Its weight leaves :meth:`ahead` at once, not when the lane reaches it."""
        if not job.cancel():
            return False
        self._unpend(job)
        job.weight = -1  # settled
        return True

    def raise_priority(self, job: Job, priority: int) -> None:
        """Run a queued ``job`` at ``priority`` if that is sooner (control thread).  The job is
        queued again; its old entry is skipped when the lane reaches it."""
        if job.state != "queued" or priority >= job.priority or job.weight < 0:
            return
        self._unpend(job)
        job.priority = priority
        p = self.pending.setdefault(priority, [0, 0])
        p[0] += 1
        p[1] += job.weight
        self._q.put((priority, next(self._seq), job))

    def _forget_cancelled(self, job: Job) -> None:  # control thread
        self.queued -= 1
        self.cancelled += 1
        if job.weight >= 0:  # cancelled without Lane.cancel (e.g. directly on the job)
            self._unpend(job)

    def _finish(self, job: Job, result, error) -> None:  # control thread
        self._settle(job)
        job.done(result, error)

    def ahead(self, priority: int) -> tuple[int, int]:
        """(jobs, weight) not finished that run before a new job of ``priority`` (control thread)."""
        jobs = weight = 0
        for p, (j, w) in self.pending.items():
            if p <= priority:
                jobs += j
                weight += w
        return jobs, weight

    def stop(self, timeout_s: float = 10.0) -> None:
        for _ in self._threads:  # one sentinel per thread, after everything already queued
            self._q.put((1 << 30, next(self._seq), _STOP))
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            if t.is_alive() or t.ident is not None:
                t.join(max(0.0, deadline - time.monotonic()))

    def stats(self) -> dict:
        return {"queued": self.queued, "busy": self.busy, "running": self.running, "threads": len(self._threads),
                "jobs": self.jobs_done, "cancelled": self.cancelled, "busy_s": round(self.busy_s, 3)}
