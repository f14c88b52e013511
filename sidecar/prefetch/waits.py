"""Deferred waits on a prefetch session (the ``wait`` op): no polling on either side.

A ``wait`` completes when the session can answer what the caller needs, or at its deadline:

* ``until`` absent: the session's L3 query is done (it knows its target: resident + L3 hit),
* ``until = n``: ``n`` blocks of its chain are published (or it can publish no more),
* ``terminal``: only when the session has ended,
* in every case: the session is terminal.

The reply is the session's view at that moment (the same fields as ``poll``).  The executor
calls :meth:`SessionWaits.wake` after every step of a session (the only place its machine
changes), and one timer per wait bounds it (``wait_s``, at most ``MAX_WAIT_S``).  A wait
whose client left is dropped at its wake-up or deadline.  Invariant: a waiter is answered
exactly once.
"""

from __future__ import annotations

import dataclasses
import itertools

from kvsidecar.sidecar.prefetch.events import State

MAX_WAIT_S = 60.0
DEFAULT_WAIT_S = 5.0


@dataclasses.dataclass
class Waiter:
    id: int
    conn: object
    rid: int
    until: int | None
    terminal: bool = False


def satisfied(machine, until: int | None, terminal: bool = False) -> bool:
    if machine.state == State.TERMINAL:
        return True
    if terminal:
        return False
    if until is None:
        return machine.state not in (State.CREATED, State.QUERYING)
    return machine.published >= until


class SessionWaits:
    def __init__(self, host, clock):
        self.host = host  # call_at / reply
        self.clock = clock
        self.by_session: dict[int, list[Waiter]] = {}
        self._ids = itertools.count(1)
        self.answered = 0
        self.timed_out = 0

    def add(self, conn, rid: int, sid: int, until: int | None, terminal: bool, timeout_s: float | None,
            view) -> None:
        budget = DEFAULT_WAIT_S if timeout_s is None else max(0.0, min(float(timeout_s), MAX_WAIT_S))
        w = Waiter(next(self._ids), conn, rid, until, terminal)
        self.by_session.setdefault(sid, []).append(w)
        self.host.call_at(self.clock() + budget, self._expired, sid, w.id, view)

    def wake(self, sid: int, machine, view) -> None:
        """After a step of session ``sid``: answer every waiter it now satisfies."""
        waiters = self.by_session.get(sid)
        if not waiters:
            return
        keep = []
        for w in waiters:
            if satisfied(machine, w.until, w.terminal):
                self.answered += 1
                self.host.reply(w.conn, w.rid, view())
            else:
                keep.append(w)
        if keep:
            self.by_session[sid] = keep
        else:
            del self.by_session[sid]

    def forget(self, sid: int, view) -> None:
        """The session record is dropped: answer whoever still waits on it."""
        for w in self.by_session.pop(sid, ()):
            self.answered += 1
            self.host.reply(w.conn, w.rid, view())

    def _expired(self, sid: int, wid: int, view) -> None:
        waiters = self.by_session.get(sid)
        if not waiters:
            return
        for i, w in enumerate(waiters):
            if w.id == wid:
                del waiters[i]
                if not waiters:
                    del self.by_session[sid]
                self.timed_out += 1
                self.host.reply(w.conn, w.rid, {**view(), "timed_out": True})
                return

    def pending(self) -> int:
        return sum(len(v) for v in self.by_session.values())
