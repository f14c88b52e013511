"""How tests wait: on an event the product signals, or (for what is only observable from outside)
on ``wait_until``'s bounded re-check -- never on a bare sleep.

* ``wait_until(pred, timeout, what)``: re-checks ``pred()`` until it is truthy; on timeout the
  AssertionError names ``what`` and the last value ``pred()`` returned, so a failure says what
  was seen, not only that time ran out.
* ``ReadGate``: a named POSIX semaphore the shaped L3 (``l3.read_gate``) holds every read on until
  the test opens it -- the deterministic "a read is mid-flight" point.  Closed on creation; the test
  opens it once (every read then passes) and it is unlinked on exit.
* ``timed``: the fixture behind the ``timing`` marker (see conftest.py).
"""

from __future__ import annotations

import os
import time
import uuid

import posix_ipc

def wait_until(pred, timeout: float, what: str, *, until=None, interval_s: float = 0.005):
    """Re-check ``pred()`` until it is truthy -- or, with ``until``, until ``until(pred())`` is --
    and return the value ``pred()`` gave; after ``timeout`` seconds raise AssertionError naming
    ``what`` and the last observed value.  The interval grows from ``interval_s`` to 50 ms (or
    stays at a longer ``interval_s``), so a long wait does not spin; every wait is bounded."""
    deadline = time.monotonic() + timeout
    pause, longest = interval_s, max(interval_s, 0.05)
    while True:
        last = pred()
        if (until(last) if until is not None else last):
            return last
        left = deadline - time.monotonic()
        if left <= 0:
            seen = repr(last)
            seen = seen if len(seen) <= 2000 else seen[:2000] + "..."
            raise AssertionError(f"timed out after {timeout} s waiting for {what}; last observed: {seen}")
        time.sleep(min(pause, left))  # re-check cadence of a bounded wait, not synchronisation
        pause = min(pause * 2, longest)


class ReadGate:
    """The test's end of the shaped L3's read gate: create it before the sidecar starts, pass
    ``overrides()`` to it, ``open()`` it when the held reads may go on."""

    def __init__(self, prefix: str = ""):
        # conftest's per-run prefix (kvst<pid>-), so its leak check sees a gate left behind
        self.name = f"/{prefix or f'kvst{os.getpid()}-gate'}-{uuid.uuid4().hex[:8]}"
        self._sem = posix_ipc.Semaphore(self.name, posix_ipc.O_CREX, initial_value=0)

    def overrides(self) -> dict:
        # (the tier's calibration at start is reads no request made: the gate would hold them
        # first, and "a read is held" would no longer mean a session's read)
        return {"l3.read_gate": self.name, "l3.calibration_blocks": 0}

    def open(self) -> None:
        """Let every read through (held ones and later ones): each read takes and gives back the
        one token."""
        self._sem.release()

    def close(self) -> None:
        try:
            self._sem.unlink()
        except posix_ipc.ExistentialError:
            pass
        self._sem.close()

    def __enter__(self) -> "ReadGate":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def reads_held(conn) -> int:
    """How many L3 reads the sidecar's shaped backend holds at its read gate now."""
    return conn.stats()["l3"]["backend"].get("gate_waiting", 0)


def wait_read_held(conn, timeout: float = 20.0) -> int:
    """Wait (bounded) until at least one L3 read is held at the gate: the session is mid-flight."""
    return wait_until(lambda: reads_held(conn), timeout, "an L3 read held at the read gate")


def wait_past_query(conn, req: str, timeout: float = 20.0) -> dict:
    """Wait (bounded) until ``req``'s session has its L3 query's answer (its state is no longer
    "querying"): with ``sessions.read_with_query`` its first read is in flight before that."""
    return wait_until(lambda: conn.poll(req), timeout, f"{req}'s L3 query answered",
                      until=lambda v: v.get("state") != "querying")
