"""TP-consistent decisions (DESIGN §6): the first answer wins for the whole group.

Every rank of a TP group asks the sidecar the same question in the same scheduler
step; the first answer for ``(group, op, request, attempt, step)`` is recorded and
returned verbatim to every rank of that group, so ranks never need a collective and
never disagree.  A record is dropped once every rank of the group has read it (or is
done with the request and will not: ``skip``), after its TTL (a rank that never asks must
not pin memory forever), or when its group leaves (a new incarnation of the engine reuses
request ids and steps; it must compute afresh).

A record only says what was decided; whether it may still be handed to a rank is the
caller's check (``KVCore.decided``): block ids are replayed only under a pin the asking
rank holds.  The TTL is validated to be no longer than what the records point at
(``limits.decision_ttl_s <= lease_ttl_s, staging_ttl_s``).
"""

from __future__ import annotations

import dataclasses

from kvsidecar.sidecar.deadlines import DeadlineHeap


@dataclasses.dataclass
class Decision:
    key: tuple
    result: dict
    readers: set
    group_size: int
    expires: float
    question: bytes = b""  # a digest of what was asked (the chain): a replay must ask the same


class DecisionBook:
    def __init__(self, ttl_s: float = 30.0):
        self.ttl_s = ttl_s
        self.records: dict[tuple, Decision] = {}
        self._expiry = DeadlineHeap(self.records, lambda rec: rec.expires)
        # (group, req, attempt) -> its live records' keys: a request's end finds its records
        # without a scan (a lagging rank leaves records live for up to the TTL)
        self._by_request: dict[tuple, set] = {}
        self.hits = 0
        self.made = 0

    def has_read(self, key: tuple, rank: int) -> bool:
        """Whether ``rank`` has read (or decided) the live record ``key``."""
        rec = self.records.get(key)
        return rec is not None and rank in rec.readers

    def lookup(self, key: tuple, rank: int) -> Decision | None:
        """The record for ``key`` (and mark ``rank`` as having read it), or None."""
        rec = self.records.get(key)
        if rec is None:
            return None
        self.hits += 1
        self._read_by(rec, rank)
        return rec

    def _read_by(self, rec: Decision, rank: int) -> None:
        """``rank`` has the record (or never will): once every rank has, it goes."""
        rec.readers.add(rank)
        if len(rec.readers) >= rec.group_size:
            self._drop(rec.key)

    @staticmethod
    def _request(key: tuple) -> tuple:
        return (key[0], key[2], key[3])  # (group, req, attempt) of (group, op, req, attempt, step)

    def _drop(self, key: tuple) -> None:
        if self.records.pop(key, None) is not None:
            keys = self._by_request.get(self._request(key))
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_request[self._request(key)]

    def record(self, key: tuple, rank: int, group_size: int, result: dict, now: float,
               question: bytes = b"") -> None:
        self.made += 1
        if group_size <= 1:
            return
        self.records[key] = Decision(key, result, {rank}, group_size, now + self.ttl_s, question)
        self._by_request.setdefault(self._request(key), set()).add(key)
        self._expiry.push(now + self.ttl_s, key)

    def skip(self, group: str, op: str, req, attempt, rank: int) -> list:
        """``rank`` will never read the records of ``(group, op, req, attempt)`` it has not read
        yet (it is done with the request): count it as a reader of each (a record every rank
        has read goes); returns those records."""
        out = []
        for key in list(self._by_request.get((group, req, attempt), ())):
            rec = self.records[key]
            if key[1] == op and rank not in rec.readers:
                self._read_by(rec, rank)
                out.append(rec)
        return out

    def forget_group(self, group: str) -> int:
        """Drop every record of ``group`` (its last rank left); returns how many."""
        gone = [key for key in self.records if key[0] == group]
        for key in gone:
            self._drop(key)
        return len(gone)

    def expire(self, now: float) -> int:
        due = self._expiry.pop_due(now)
        for rec in due:
            self._drop(rec.key)
        return len(due)

    def next_expiry(self) -> float | None:
        return self._expiry.next_due()
