"""One rank's table of request <-> prefetch session, for a host that calls from several threads.

SGLang's threads each see one side of a request: the prefetch thread queries its chain (and
starts the session), the scheduler demands and ends it, the I/O thread reads pages by key.
They race, so the table answers each of them consistently:

* a session is **opened** before its prefetch is sent, so a demand or an end from the
  scheduler that arrives while the prefetch is on its way finds it (and the query thread then
  sends what it missed: :meth:`SessionRegistry.flags`);
* a demand or an end that arrives **before** the query ran is remembered (bounded) and
  applied when the query opens the session -- an ended request never starts one;
* an end is final: a request ended recently (bounded LRU) does not leave an early "abort"
  behind, and its session is no longer found by key.

Invariants: every table changes under one lock, never held across a sidecar call; each table
is bounded (``max_early``, ``max_ended``); a page key maps to the latest open session that
holds it.  Used by ``kvsidecar.connector.hicache_backend``.  The engine adapter keeps its own
set: it is driven by one thread with one hook per request at a time, and needs none of this.
"""

from __future__ import annotations

import collections
import dataclasses
import threading


@dataclasses.dataclass
class SessionRef:
    """What this rank knows about one request's prefetch session."""

    rid: str
    attempt: int
    chain: bytes  # the full kvsidecar chain of the queried span
    positions: dict  # host page key -> position in ``chain``
    demanded: bool = False  # the scheduler saw the request as a candidate
    ended: bool = False  # the scheduler is done with it (consumed, terminated, aborted)
    resident: bool = False  # the hit the query reported was resident in the pool when it answered
    # the prefix of a session that was already terminal when this rank started it at queue entry
    # (cost_aware under SGLang): its query answers that without a second round trip
    terminal_prefix: int | None = None


DEMAND, ABORT = "demand", "abort"


class SessionRegistry:
    def __init__(self, *, max_early: int = 65536, max_ended: int = 4096):
        self._lock = threading.Lock()
        self._sessions: dict[tuple, SessionRef] = {}
        self._by_key: dict[str, SessionRef] = {}
        self._early: dict[tuple, str] = {}  # (rid, attempt) -> DEMAND | ABORT before the query ran
        self._ended: collections.OrderedDict = collections.OrderedDict()  # recently ended (rid, attempt)
        self.max_early = max_early
        self.max_ended = max_ended

    def open(self, ref: SessionRef) -> bool:
        """Register ``ref`` (replacing an older session of the same request: the one its queue
        entry opened, which its query then re-opens); False, and nothing registered, when the
        request already ended.  An early demand, or one the replaced session had, sets
        ``ref.demanded``."""
        key = (ref.rid, ref.attempt)
        with self._lock:
            early = self._early.pop(key, None)
            if early == ABORT:
                return False
            old = self._sessions.pop(key, None)
            ref.demanded = ref.demanded or early == DEMAND or (old is not None and old.demanded)
            if old is not None:
                self._unindex(old)
            self._sessions[key] = ref
            for k in ref.positions:
                self._by_key[k] = ref
            return True

    def get(self, rid: str, attempt: int = 0) -> SessionRef | None:
        with self._lock:
            return self._sessions.get((rid, attempt))

    def for_keys(self, keys, bound: tuple | None = None) -> SessionRef | None:
        """The session whose chain holds ``keys`` as one consecutive span: request ``bound``'s
        (``(rid, attempt)``), else the latest one opened with ``keys[0]``."""
        with self._lock:
            ref = self._sessions.get(bound) if bound is not None else None
            if ref is None or keys[0] not in ref.positions:
                ref = self._by_key.get(keys[0])
        if ref is None:
            return None
        off = ref.positions[keys[0]]
        return ref if ref.positions.get(keys[-1]) == off + len(keys) - 1 else None

    def demand(self, rid: str, attempt: int = 0) -> bool:
        """Mark the request demanded.  True when the caller should send the demand now (its
        session is open and was not demanded yet); an unopened one gets it when it opens."""
        key = (rid, attempt)
        with self._lock:
            ref = self._sessions.get(key)
            if ref is None:
                self._early.setdefault(key, DEMAND)
                self._bound_early()
                return False
            if ref.demanded:
                return False
            ref.demanded = True
            return True

    def end(self, rid: str, attempt: int = 0) -> SessionRef | None:
        """The request is over: its open session (now ``ended`` and unregistered), or None -- then
        a query still to come must not start one (unless it ended recently)."""
        key = (rid, attempt)
        with self._lock:
            ref = self._sessions.pop(key, None)
            if ref is None:
                if key not in self._ended:
                    self._early[key] = ABORT
                    self._bound_early()
                return None
            ref.ended = True
            self._unindex(ref)
            self._ended[key] = None
            while len(self._ended) > self.max_ended:
                self._ended.popitem(last=False)
            return ref

    def discard(self, ref: SessionRef) -> None:
        """Forget ``ref`` if it is still its request's open session (its prefetch never reached a sidecar)."""
        key = (ref.rid, ref.attempt)
        with self._lock:
            if self._sessions.get(key) is ref:
                del self._sessions[key]
                self._unindex(ref)

    def flags(self, ref: SessionRef) -> tuple[bool, bool]:
        """(demanded, ended) of ``ref`` now."""
        with self._lock:
            return ref.demanded, ref.ended

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def sizes(self) -> dict:
        with self._lock:
            return {"open": len(self._sessions), "keys": len(self._by_key), "early": len(self._early),
                    "ended": len(self._ended)}

    # -- under the lock -------------------------------------------------------------------------------
    def _unindex(self, ref: SessionRef) -> None:
        for k in ref.positions:
            if self._by_key.get(k) is ref:
                del self._by_key[k]

    def _bound_early(self) -> None:
        if len(self._early) > self.max_early:  # bounded: requests that never query are forgotten
            self._early.clear()
