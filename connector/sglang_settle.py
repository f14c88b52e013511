"""A storage hit admitted in the scheduler iteration that first sees it, not two iterations later.

SGLang 0.5.23 takes a request with a storage query through two hand-offs between threads, and
its scheduler picks each up only at the start of an iteration (``check_hicache_events``, the
TP-synchronised drain of the storage queues):

1. the prefetch thread answers the existence query (``batch_exists``) into ``prefetch_hit_queue``;
   the drain allocates host pages for the hit and hands the operation to the I/O thread (or
   revokes it: a miss, or below SGLang's threshold);
2. the I/O thread copies the pages (``batch_get_v1``) and the sync thread puts the completion
   into ``ack_prefetch_queue``; the drain puts the pages into the radix tree and the request
   leaves ``ongoing_prefetch``: it is ready.

The query is sent as the request joins the queue, in the iteration that receives it, and its
answer comes a millisecond or two after that iteration's drain; the copy of a hit already
resident in kvsidecar's pool takes a few milliseconds after the next.  So every request with a
storage query waits one more iteration than without (a miss, to be revoked) and every hit two
(measured in genuine SGLang: three to four ``check_prefetch_progress`` calls for an idle pool
hit against one or two for a cold request).  Under load an iteration is a forward pass, 100-400
ms here: that, not kvsidecar's few milliseconds, was the fixed cost of a storage hit.

:class:`HitSettler`, run right after SGLang's own drain, closes both gaps within the iteration:
for the operations whose query is still out it waits (bounded) for the answers, drains; for the
hits that drain just handed to the I/O thread and whose data is resident in the sidecar's pool,
it waits (bounded) for the completions, drains again.  A hit still being read from L3 is
waited for too once the request can start its prefill: the settler first tells the sidecar
(``stop``: a demand, a scheduling candidate now), and waits when that ended the session or left
it draining its last reads (``cost_aware`` stops planning at once; the demand bounds the drain,
reads that would land later are left behind).  That stop used to come
from the ETA hook on ``get_new_batch_prefill``, later in the same iteration: the session ended a
few milliseconds after this drain, and the request waited a whole forward pass for the next
(measured in genuine SGLang at 2 Mbit/s: a read that landed 4 ms late cost its request 570 ms).
Only for requests that could start their
prefill in this iteration (``admissible``: the uncached tokens queued ahead of them fit in one
iteration's prefill budget): any other waits an iteration anyway, and holding the scheduler for
it would delay every running request for nothing (measured: 7 ms per request at 2 Mbit/s,
where nothing was restored).  A request whose hit landed is then ready
at this iteration's ``check_prefetch_progress``.

**TP rule.**  Whether a round runs -- and so whether every rank calls SGLang's collective
``drain_storage_control_queues`` -- depends only on the scheduler's own state
(``ongoing_prefetch``, changed only by the synchronised drains and by requests every rank sees),
identical on every rank.  How long a rank waits is its own affair (bounded by ``budget_s``;
whether the data is resident is what that rank's backend knows; every rank sends its own
``stop``, an idempotent demand, so no rank's wait hangs on another rank's message); the drain's MIN all-reduce of
the queue sizes takes only what every rank has, so a rank that waited in vain leaves the rest
to the next iteration, as without the settler.  Each operation gets at most one round of each
kind, so a slow query or an L3 read costs the scheduler at most ``budget_s`` once per request.

Waits are on the queues' own condition (``Queue.not_empty``, notified by every ``put``): a
wake-up, not a poll.  Only this (the scheduler) thread consumes these queues.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SettleStats:
    rounds_query: int = 0  # iterations that waited for query answers, then drained
    rounds_copy: int = 0  # iterations that waited for resident hits' copies, then drained
    waits_met: int = 0  # waits whose condition held before the deadline
    waits_timed_out: int = 0
    stops: int = 0  # admissible requests whose hit was not resident: their sessions told to stop
    stops_ended: int = 0  # ... that had ended or were draining (their copies waited for)
    wait_s: float = 0.0  # total time the scheduler thread spent waiting


def wait_in_queue(q, present: Callable[[list], bool], deadline: float) -> bool:
    """Wait until ``present(items of q)`` holds, at most until ``deadline`` (time.monotonic):
    woken by every ``put``.  Only the caller consumes ``q``, so what is present stays."""
    with q.not_empty:
        while not present(list(q.queue)):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            q.not_empty.wait(left)
    return True


def answered(ops: list) -> Callable[[list], bool]:
    """Every operation of ``ops`` has its query answer among ``items``."""
    want = {id(op) for op in ops}
    return lambda items: want <= {id(op) for op in items}


def completed(ops: list) -> Callable[[list], bool]:
    """Every operation of ``ops`` has its completion (``completed_req``) among ``items``."""
    want = {id(op) for op in ops}
    return lambda items: want <= {id(a.operation) for a in items if getattr(a, "completed_req", None)}


def lazily(build: Callable[[], Callable[[object], bool]]) -> Callable[[object], bool]:
    """The predicate ``build()`` returns, built at its first question and reused after.  For
    :meth:`HitSettler.settle`'s ``admissible``, which the plugin builds by walking the waiting
    queue: most iterations have nothing to settle and never ask, so they never pay the walk
    (O(queue) on every iteration of every rank otherwise)."""
    built = []

    def ask(request) -> bool:
        if not built:
            built.append(build())
        return built[0](request)

    return ask


class HitSettler:
    """Run :meth:`settle` after each ``check_hicache_events`` (see the module docstring).

    ``resident(request)`` (SGLang's ``CacheRequestHandle``): this rank's backend knows the
    request's hit is resident in the sidecar's pool (its copy is a memcpy, worth waiting for).
    ``stop(request)``: the request can start its prefill now -- tell its session; True when the
    session has ended or only drains its reads in flight (its copy follows shortly, worth
    waiting for).  Asked only of an admissible request whose hit is not resident.
    ``trace(rid, phase, t0, t1)``: optional timeline (time.perf_counter)."""

    def __init__(self, budget_s: float, resident: Callable[[object], bool], trace=None,
                 stop: Callable[[object], bool] | None = None):
        if not budget_s > 0:
            raise ValueError(f"budget_s must be positive, not {budget_s!r}")
        self.budget_s = budget_s
        self.resident = resident
        self.stop = stop
        self.trace = trace
        self.stats = SettleStats()
        self._queried: set = set()  # operations given their query round (strong refs, pruned to live ones)
        self._copied: set = set()  # operations given their copy round

    def settle(self, cache, admissible: Callable[[object], bool] | None = None) -> None:
        """One iteration's rounds.  ``admissible(request)``: the request could start its prefill
        in this iteration (near the head of the waiting queue; built by the caller at most once
        per iteration, :func:`lazily`: asked only when something is in flight); one that cannot
        waits an iteration anyway, and SGLang's own next drain brings
        its answer in for free, so waiting for it would only hold up the iteration.  It must be
        identical on every rank (the scheduler's queue is).  None: every request."""
        if not cache.ongoing_prefetch:  # the common iteration: nothing in flight, nothing asked
            self._queried.clear()
            self._copied.clear()
            return
        admissible = admissible or (lambda request: True)
        cc = cache.cache_controller
        if cc is None or getattr(cc, "prefetch_hit_queue", None) is None:
            return
        live = [info.operation for info in cache.ongoing_prefetch.values()]
        self._queried = {op for op in live if op in self._queried}
        self._copied = {op for op in live if op in self._copied}
        deadline = time.monotonic() + self.budget_s

        ops = [i.operation for h, i in cache.ongoing_prefetch.items()
               if i.host_indices is None and i.operation not in self._queried and admissible(h)]
        if ops:  # identical on every rank: so is the collective drain below
            self._queried.update(ops)
            self._wait(cc.prefetch_hit_queue, ops, answered(ops), deadline, "settle_query")
            cache.drain_storage_control_queues()
            self.stats.rounds_query += 1

        new = [(h, i.operation) for h, i in cache.ongoing_prefetch.items()
               if i.host_indices is not None and i.operation not in self._copied and admissible(h)]
        if new:
            ops = [op for _h, op in new]
            self._copied.update(ops)
            mine = [op for h, op in new if self._resident(h) or self._stopped(h)]
            if mine:
                self._wait(cc.ack_prefetch_queue, mine, completed(mine), deadline, "settle_copy")
            cache.drain_storage_control_queues()
            self.stats.rounds_copy += 1

    def _resident(self, request) -> bool:
        try:
            return bool(self.resident(request))
        except Exception:  # noqa: BLE001 - a question, never a failure of the scheduler
            log.exception("kvsidecar settle: residency check failed")
            return False

    def _stopped(self, request) -> bool:
        if self.stop is None:
            return False
        try:
            ended = bool(self.stop(request))
        except Exception:  # noqa: BLE001 - a request to the sidecar, never a failure of the scheduler
            log.exception("kvsidecar settle: stopping the prefetch failed")
            return False
        self.stats.stops += 1
        self.stats.stops_ended += ended
        return ended

    def _wait(self, q, ops, present, deadline, phase) -> None:
        t0 = time.perf_counter()
        ok = wait_in_queue(q, present, deadline)
        t1 = time.perf_counter()
        self.stats.wait_s += t1 - t0
        if ok:
            self.stats.waits_met += 1
        else:
            self.stats.waits_timed_out += 1
        if self.trace is not None:
            for op in ops:
                self.trace(str(getattr(op, "request_id", "?")), phase, t0, t1)
