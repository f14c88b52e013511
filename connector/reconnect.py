"""The one connector seam: degrade to a miss, back off, re-attach.

Every engine-side user of the sidecar runs its calls through :meth:`ReconnectPolicy.run`:
the engine adapter and vLLM's two connector halves through one :class:`SidecarLink` each, the
SGLang HiCache backend through its per-thread pool (:class:`~kvsidecar.connector.thread_conns.ConnectionPool`).
"Degrade and re-attach" is written here once:

* A call that raises :class:`~kvsidecar.shm.errors.SidecarUnavailable` answers the caller's
  default (a miss), and the error's :class:`~kvsidecar.shm.errors.UnavailableCause` decides
  what comes next:

  ===================  ==================================================================
  cause                next
  ===================  ==================================================================
  RESTARTED, BROKEN    the connection is dead: re-attach at once and run the call once
                       more (a restarted sidecar serves the very call that noticed)
  NOT_RUNNING          hold off ``every_s``, then attach again; flat, because an attach
                       to an absent sidecar costs one failed ``shm_open``
  SLOTS_EXHAUSTED,     hold off ``every_s``, doubling with each failed attach in a row up
  REFUSED              to ``max_s`` (each attempt costs the sidecar work and a log line)
  TIMED_OUT            the connection stays attached; for ``every_s`` every call is a miss
                       at once instead of waiting out its own deadline on a stuck sidecar
  ===================  ==================================================================

* A :class:`~kvsidecar.shm.errors.RemoteError` is a live sidecar refusing one op: a miss,
  counted; the connection is fine -- except ``NOT_ATTACHED`` (the sidecar no longer knows this
  slot: BROKEN).  Any error from ``attach`` itself that is not a SidecarUnavailable (a layout
  mismatch, a bad version) is REFUSED.
* One warning per outage (an error for REFUSED), one info line when attached again.

Invariants: nothing here waits (the waits are the client's deadline-bounded calls); a
hold-off bounds how often an attach is tried; the policy's state changes under its lock, so
one policy may serve several threads (the pool's).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time

from kvsidecar.shm.errors import ErrorCode, KvSidecarError, RemoteError, SidecarUnavailable, UnavailableCause

log = logging.getLogger(__name__)

Cause = UnavailableCause
REATTACH_NOW = frozenset({Cause.RESTARTED, Cause.BROKEN})
GROWS = frozenset({Cause.SLOTS_EXHAUSTED, Cause.REFUSED})


def cause_of(exc: BaseException, attaching: bool = False) -> UnavailableCause | None:
    """The cause of a failed call (None: a live sidecar refused it, the connection is fine)."""
    if isinstance(exc, SidecarUnavailable):
        return exc.cause
    if attaching:
        return Cause.REFUSED
    if isinstance(exc, RemoteError) and exc.code == ErrorCode.NOT_ATTACHED:
        return Cause.BROKEN
    return None


@dataclasses.dataclass(frozen=True)
class Backoff:
    """How long calls are held off after a failure of ``cause``, the ``failures``-th in a row."""

    every_s: float = 1.0
    max_s: float | None = None  # cap of a growing hold-off (None: 4 x every_s)

    def delay(self, cause: UnavailableCause, failures: int = 1) -> float:
        if cause in REATTACH_NOW:
            return 0.0
        if cause in GROWS:
            cap = self.max_s if self.max_s is not None else 4 * self.every_s
            return min(cap, self.every_s * 2 ** min(max(failures, 1) - 1, 30))
        return self.every_s


class ReconnectPolicy:
    """When a call may go out, and what a failure means: shared by every connection of one user."""

    def __init__(self, every_s: float = 1.0, *, max_s: float | None = None, name: str = "kvsidecar",
                 clock=time.monotonic):
        if every_s < 0 or (max_s is not None and max_s < 0):
            raise ValueError("reattach intervals must be >= 0")
        self.backoff = Backoff(every_s, max_s)
        self.name = name
        self._clock = clock
        self._lock = threading.Lock()
        self._until = float("-inf")  # no call (and no attach) before this
        self._failures = 0  # failed attaches in a row
        self._warned = False  # one warning per outage, one info line when it is back
        self.last_cause: UnavailableCause | None = None
        self.causes: collections.Counter = collections.Counter()  # UnavailableCause -> failures seen
        self.misses = 0  # calls answered with the caller's default
        self.errors = 0  # error replies from a live sidecar (the connection stayed)
        self.attaches = 0

    # -- the gate ---------------------------------------------------------------------------------
    def held_off(self) -> bool:
        """True while calls answer miss without trying (after a failure, for its hold-off)."""
        return self._clock() < self._until

    def hold_off(self, cause: UnavailableCause) -> float:
        """Hold calls off for ``cause``'s delay from now; returns it."""
        with self._lock:
            if cause in GROWS:
                self._failures += 1
            d = self.backoff.delay(cause, self._failures)
            self._until = self._clock() + d
            return d

    # -- attach -----------------------------------------------------------------------------------
    def attach(self, conn, *, sharing=None) -> UnavailableCause | None:
        """Attach ``conn`` (a ``KVConnector``; a previous incarnation's mapping is dropped first).
        None when attached; else the cause, logged and held off.  ``sharing()`` (the pool) says
        whether other attached connections can serve instead: then a slot refusal is not an
        outage and holds nothing off."""
        conn.close()
        try:
            conn.attach()
        except KvSidecarError as exc:
            conn.close()
            cause = cause_of(exc, attaching=True)
            shared = cause is Cause.SLOTS_EXHAUSTED and sharing is not None and sharing()
            with self._lock:
                self.causes[cause] += 1
                self.last_cause = cause
            if shared:
                self._warn(f"cannot add a connection ({exc}); this process' threads share the ones it has", cause,
                           quiet=True)
            else:
                self.hold_off(cause)
                until = "a slot is free" if cause is Cause.SLOTS_EXHAUSTED else "it is back"
                self._warn(f"unavailable ({exc}): misses until {until}", cause)
            return cause
        with self._lock:
            self._until = float("-inf")
            self._failures = 0
            self.attaches += 1
            back, self._warned = self._warned, False
        if back:
            log.info("%s: attached again", self.name)
        return None

    # -- calls ------------------------------------------------------------------------------------
    def failed(self, conn, exc: KvSidecarError) -> UnavailableCause | None:
        """Record a failed call on ``conn``; returns its cause (None: refused by a live sidecar)."""
        cause = cause_of(exc)
        with self._lock:
            if cause is None:
                self.errors += 1
            else:
                self.causes[cause] += 1
                self.last_cause = cause
        if cause is None:
            log.warning("%s refused %s; a miss", self.name, exc)
            return None
        if cause in REATTACH_NOW:
            conn.client.mark_broken(str(exc), cause)  # (already so when the client found it dead)
            log.info("%s: %s; re-attaching", self.name, exc)
        else:
            self.hold_off(cause)
            self._warn(f"call failed ({exc}): misses for {self.backoff.delay(cause, 1):g} s", cause)
        return cause

    def run(self, acquire, fn, default, *, retry: bool = True, on_miss=None):
        """``fn(conn)`` on a connection from ``acquire()`` (a context manager yielding an attached
        connection or None), or ``default`` when the sidecar cannot answer; never raises a sidecar
        error.  A connection found dead (RESTARTED, BROKEN) is re-attached by the next ``acquire``
        and, with ``retry``, ``fn`` runs once more from the start -- so ``retry=False`` for a call
        bound to what the old incarnation handed out (a lease or staging id)."""
        for again in (retry, False):
            with acquire() as conn:
                if conn is None:
                    break
                try:
                    return fn(conn)
                except KvSidecarError as exc:
                    cause = self.failed(conn, exc)
            if not (again and cause in REATTACH_NOW):
                break
        with self._lock:
            self.misses += 1
        if on_miss is not None:
            on_miss()
        return default

    def stats(self) -> dict:
        with self._lock:
            return {"misses": self.misses, "errors": self.errors, "attaches": self.attaches,
                    "held_off": self._clock() < self._until,
                    "causes": {c.value: self.causes.get(c, 0) for c in Cause}}

    def _warn(self, msg: str, cause: UnavailableCause, quiet: bool = False) -> None:
        with self._lock:
            first, self._warned = not self._warned, True
        if first:
            level = logging.ERROR if cause is Cause.REFUSED else logging.WARNING
            log.log(level, "%s in thread %s: %s", self.name, threading.current_thread().name, msg)
        elif not quiet:
            log.debug("%s still unavailable: %s", self.name, msg)


class SidecarLink:
    """One connection that degrades to a miss (the engine adapter; vLLM's scheduler and worker).

    Used by one thread.  ``on_reattach()`` runs after an attach that follows an earlier one (a
    new sidecar generation: the owner forgets what the old one held -- it released all of it);
    ``may_reattach()`` defers a re-attach (a worker whose copy still reads the old mapping)."""

    def __init__(self, conn, reattach_every_s: float = 1.0, *, on_reattach=None, may_reattach=None,
                 max_s: float | None = None, clock=time.monotonic):
        self.conn = conn
        self.policy = ReconnectPolicy(reattach_every_s, max_s=max_s, clock=clock,
                                      name=f"kvsidecar {conn.client.instance!r} (rank {conn.client.rank})")
        self._on_reattach = on_reattach
        self._may_reattach = may_reattach or (lambda: True)
        self._ever_attached = False

    @property
    def attached(self) -> bool:
        return self.conn.client.attached

    @property
    def misses(self) -> int:
        return self.policy.misses

    @property
    def errors(self) -> int:
        return self.policy.errors

    def start(self) -> bool:
        """Attach now (whatever the hold-off); False (logged) when the sidecar cannot be attached."""
        if self.policy.attach(self.conn) is not None:
            return False
        if self._ever_attached and self._on_reattach is not None:
            self._on_reattach()
        self._ever_attached = True
        return True

    def ready(self) -> bool:
        """Attached now, or attached again unless held off or deferred."""
        if self.conn.client.attached:
            return not self.policy.held_off()
        if self.policy.held_off() or not self._may_reattach():
            return False
        return self.start()

    @contextlib.contextmanager
    def acquire(self):
        yield self.conn if self.ready() else None

    def call(self, fn, default=None, *, retry: bool = True):
        """``fn()``, or ``default`` when the sidecar cannot answer (see :meth:`ReconnectPolicy.run`)."""
        return self.policy.run(self.acquire, lambda _conn: fn(), default, retry=retry)

    def close(self) -> None:
        try:
            self.conn.detach()
        except KvSidecarError:
            self.conn.close()
