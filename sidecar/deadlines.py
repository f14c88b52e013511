"""A lazy-deletion deadline heap over a dict of live records (leases, stagings, decisions).

Entries are ``(due, key)``; a record that left the dict (released, published, read by every
rank) is simply skipped when its entry surfaces, so removal is O(1) and nothing is forgotten:
a due record still present is always handed to the caller's reaper.

Stale entries are bounded: when they outnumber the live records (plus a small slack), the
heap is rebuilt from the live ones, so its size stays O(live) however many records come and
go within one TTL (amortised O(1) per push).
"""

from __future__ import annotations

import heapq


class DeadlineHeap:
    def __init__(self, live: dict, deadline_of):
        self._heap: list = []
        self._live = live
        self._deadline_of = deadline_of  # record -> its current deadline

    def push(self, due: float, key) -> None:
        if due != float("inf"):
            heapq.heappush(self._heap, (due, key))
            if len(self._heap) > 2 * len(self._live) + 64:
                self._compact()

    def _compact(self) -> None:
        """Keep only entries whose record is live (its latest deadline); O(n) once per n pushes."""
        keep = [(due, key) for due, key in self._heap
                if (rec := self._live.get(key)) is not None and self._deadline_of(rec) == due]
        heapq.heapify(keep)
        self._heap = keep

    def pop_due(self, now: float) -> list:
        """Live records whose deadline has passed (each once)."""
        out, seen = [], set()
        while self._heap and self._heap[0][0] <= now:
            _, key = heapq.heappop(self._heap)
            rec = self._live.get(key)
            if rec is not None and self._deadline_of(rec) <= now and key not in seen:
                seen.add(key)  # (a renewed deadline leaves earlier entries of the same key)
                out.append(rec)
        return out

    def next_due(self) -> float | None:
        while self._heap and self._heap[0][1] not in self._live:
            heapq.heappop(self._heap)
        return self._heap[0][0] if self._heap else None
