"""Calls that a latency-critical thread hands off and does not wait for: one daemon thread runs
them in submission order.

Contract:

* :meth:`BackgroundCalls.submit` never blocks: it returns False when the hand-off is full
  (``limit`` calls waiting) or closed, and the caller decides -- run the call itself (the SGLang
  backend's aborts) or drop it, counted (the ETA sender's batches, stale by the next one).  A call
  it accepted runs, unless :meth:`close`'s deadline passes first (below).
* Calls run one at a time, in the order they were submitted; a call that raises is counted
  (``failed``) and logged, and the next one runs.
* :meth:`flush` waits, at most ``timeout_s``, until every call submitted before it has run.
* :meth:`close` flushes (bounded), then stops the thread; later submits return False.  Calls
  still queued at its deadline are not run (``dropped``): close is for shutdown, where the other
  side has a deadline of its own.

The thread waits on a condition that every submit and close notifies (a wake-up, never a poll);
it starts with the first submit, so an object that is never used costs no thread.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)


class BackgroundCalls:
    def __init__(self, name: str, limit: int = 4096):
        if limit < 1:
            raise ValueError(f"limit must be at least 1, not {limit!r}")
        self.name = name
        self.limit = limit
        self._cv = threading.Condition()
        self._q: collections.deque = collections.deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._submitted = 0
        self._done = 0
        self.failed = 0
        self.dropped = 0  # still queued when close's deadline passed

    def submit(self, fn: Callable[[], object]) -> bool:
        """Queue ``fn()``; False (not queued: run it yourself) when full or closed."""
        with self._cv:
            if self._closed or len(self._q) >= self.limit:
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._q.append(fn)
            self._submitted += 1
            self._cv.notify_all()
        return True

    def pending(self) -> int:
        """Calls submitted and not yet finished (the one running included)."""
        with self._cv:
            return self._submitted - self._done

    def flush(self, timeout_s: float) -> bool:
        """True once every call submitted before this one has run; False at the deadline."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            target = self._submitted
            while self._done < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout_s: float) -> bool:
        """Run what is queued (at most ``timeout_s``), then stop; True when nothing was left."""
        deadline = time.monotonic() + timeout_s
        ok = self.flush(timeout_s)
        with self._cv:
            self._closed = True
            if not ok:
                left = len(self._q)
                self._q.clear()
                self.dropped += left
                self._done += left
                if left:
                    log.warning("%s: %d calls not run at close (deadline)", self.name, left)
            self._cv.notify_all()
            t = self._thread
        if t is not None:
            t.join(max(0.0, deadline - time.monotonic()))
        return ok

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()  # woken by submit and close
                if not self._q:
                    return
                fn = self._q.popleft()
            try:
                fn()
            except Exception:  # noqa: BLE001 - one failed call never stops the ones after it
                log.warning("%s: a background call failed", self.name, exc_info=True)
                with self._cv:
                    self.failed += 1
            with self._cv:
                self._done += 1
                self._cv.notify_all()
