"""Which ranks of a TP group are done with which request (DESIGN §6, group leases).

A group GET lease holds one share per rank from the moment the first rank's answer is
recorded, so a rank that asks later still finds the blocks pinned.  A rank whose engine has
ended the request (SGLang's ``terminate_prefetch`` -> the plugin's ``abort``) will not ask:
its I/O thread stops between batches, and which batch it stops before is a race between
ranks.  A share kept for it would pin the blocks until the lease's TTL.  So, per
``(group, request, attempt)``:

* ``end`` records the rank; a GET decision made afterwards holds no share for it, and a GET
  it sends itself afterwards (its I/O thread racing its scheduler) is answered as a miss —
  the request is over for that rank, SGLang discards what it would copy;
* the rank's shares of decisions made *before* its end that it has not yet received are
  given up by the caller (``KVCore.request_ended``); a share it received stays until it
  releases (its copy may still run);
* ``start`` (a prefetch of the same request by that rank that is taken: it starts or joins
  the session) clears the mark; a mark expires ``ttl_s`` (the decision TTL: nothing recorded
  before it can still be replayed) after the last end or GET of the request by another rank
  (``renew``), or goes with its group (a new incarnation reuses request ids).

Control thread only; no I/O.
"""

from __future__ import annotations

import dataclasses

from kvsidecar.sidecar.deadlines import DeadlineHeap


@dataclasses.dataclass
class _Ended:
    key: tuple  # (group, req, attempt)
    ranks: set
    expires: float


class RequestEnds:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self.records: dict[tuple, _Ended] = {}
        self._expiry = DeadlineHeap(self.records, lambda rec: rec.expires)

    def end(self, key: tuple, rank: int, now: float) -> None:
        rec = self.records.get(key)
        if rec is None:
            rec = self.records[key] = _Ended(key, set(), now + self.ttl_s)
        rec.ranks.add(rank)
        self.renew(key, now)

    def renew(self, key: tuple, now: float) -> None:
        """Another rank still fetches the request: its marks last ``ttl_s`` from now."""
        rec = self.records.get(key)
        if rec is not None:
            rec.expires = now + self.ttl_s
            self._expiry.push(rec.expires, key)

    def start(self, key: tuple, rank: int) -> None:
        rec = self.records.get(key)
        if rec is not None:
            rec.ranks.discard(rank)
            if not rec.ranks:
                del self.records[key]

    def ended(self, key: tuple) -> frozenset:
        rec = self.records.get(key)
        return frozenset(rec.ranks) if rec is not None else frozenset()

    def forget_group(self, group: str) -> None:
        for key in [k for k in self.records if k[0] == group]:
            del self.records[key]

    def expire(self, now: float) -> int:
        due = self._expiry.pop_due(now)
        for rec in due:
            self.records.pop(rec.key, None)
        return len(due)

    def next_expiry(self) -> float | None:
        return self._expiry.next_due()
