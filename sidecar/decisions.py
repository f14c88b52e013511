"""TP-consistent decisions (DESIGN §6): the first answer wins for the whole group.

Every rank of a TP group asks the sidecar the same question in the same scheduler
step; the first answer for ``(group, op, request, attempt, step)`` is recorded and
returned verbatim to every rank of that group, so ranks never need a collective and
never disagree.  A record is dropped once every rank of the group has read it, or
after its TTL (a rank that never asks must not pin memory forever).
"""

from __future__ import annotations

import dataclasses
import heapq


@dataclasses.dataclass
class Decision:
    result: dict
    readers: set
    group_size: int
    expires: float


class DecisionBook:
    def __init__(self, ttl_s: float = 30.0):
        self.ttl_s = ttl_s
        self.records: dict[tuple, Decision] = {}
        self._expiry: list = []
        self.hits = 0
        self.made = 0

    def lookup(self, key: tuple, rank: int) -> dict | None:
        """The recorded answer for ``key`` (and mark ``rank`` as having read it), or None."""
        rec = self.records.get(key)
        if rec is None:
            return None
        rec.readers.add(rank)
        self.hits += 1
        if len(rec.readers) >= rec.group_size:
            del self.records[key]
        return rec.result

    def record(self, key: tuple, rank: int, group_size: int, result: dict, now: float) -> None:
        self.made += 1
        if group_size <= 1:
            return
        self.records[key] = Decision(result, {rank}, group_size, now + self.ttl_s)
        heapq.heappush(self._expiry, (now + self.ttl_s, key))

    def expire(self, now: float) -> int:
        n = 0
        while self._expiry and self._expiry[0][0] <= now:
            _, key = heapq.heappop(self._expiry)
            rec = self.records.get(key)
            if rec is not None and rec.expires <= now:
                del self.records[key]
                n += 1
        return n

    def next_expiry(self) -> float | None:
        while self._expiry and self._expiry[0][1] not in self.records:
            heapq.heappop(self._expiry)
        return self._expiry[0][0] if self._expiry else None
