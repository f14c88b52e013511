"""cost_aware's engine inputs from SGLang's own scheduler: each queued request's ETA and the
prefill cost per block.

Invariants:

* **Pure core** (:func:`work_ahead`, :class:`PrefillRate`, :class:`EtaPlanner`): no clock, no
  I/O, no SGLang import; the scheduler-side glue (:class:`SchedulerEta`) only reads SGLang's
  state and hands the plan to a sender.
* **Work ahead is deterministic**: a request's prefill starts once the scheduler has prefilled
  what is ahead of it -- the rest of ``chunked_req`` and the uncached tokens of every request
  before it in ``waiting_queue`` (admission order).  A request that starts with the same
  pages as one ahead of it (a shared system prompt whose first request is still queued)
  computes only the rest: the radix cache holds that prefix by its turn
  (:func:`shared_prefix`, taken once per request when first seen; counting it in full made the
  ETA of every request behind it too long, and cost_aware then planned reads the request
  waited for).  SPMD ranks hold the same queue in the same order, so every rank computes the
  same tokens ahead (checked in tests/sglang).
* **A request starts with its batch**: SGLang fills each prefill batch with up to one budget
  of tokens (``chunked_prefill_size``, else ``max_prefill_tokens``: :func:`prefill_budget`), in
  admission order, the last request cut into a chunk; every request of a batch starts when the
  batch does.  So the ETA counts the whole batches ahead of the request's own
  (:func:`batch_start`), not every token ahead: a request within the next batch's budget starts
  *now* (the plugin's ``admissible_now`` walks the same budget, over tokens not reduced by a
  shared prefix: without shared prefixes the two agree request for request, tested).  Counting every token ahead made
  the ETA of the second request of a batch one prefill too long; cost_aware kept reading for it,
  and SGLang, which admits a request only once its prefetch is over, held it back meanwhile.
* **The rate is SGLang's**: ``total_prefill_busy_us / total_prefill_uncached_tokens`` (the
  scheduler's own cumulative prefill accounting), over its recent increments (:class:`PrefillRate`).  It is measured per rank (wall time), so it
  differs slightly between ranks; therefore **one rank sends** (the TP group's rank 0): the
  session is the group's, so a single ETA stream is identical for every rank by construction.
* **What a prefill holds up**: each update also says how many requests queued behind the
  request do not share its first page (:func:`kvsidecar.connector.adapter.waiting_behind`, over
  ``waiting_queue``): cost_aware weighs a block's prefill by them, as for any engine.
* An update is sent only when the ETA moved materially (by more than ``rel`` of the last sent
  *and* more than ``abs_s``; the last sent ETA counts down as time passes), or the weight of
  what the prefill holds up (``1 + waiting``) by more than ``rel``; one batch per scheduler iteration, handed to a sender thread (:class:`~kvsidecar.connector.background_calls.BackgroundCalls`; the scheduler loop
  never waits on the sidecar: a full hand-off queue drops the batch and counts it).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable, Iterable, Sequence

from .adapter import waiting_behind
from .background_calls import BackgroundCalls

log = logging.getLogger(__name__)

REL_CHANGE = 0.2  # an ETA update is sent when the ETA moved by more than this share ...
ABS_CHANGE_S = 0.05  # ... or by more than this


@dataclasses.dataclass(frozen=True)
class Queued:
    """One waiting request: its identity and the tokens its prefill will compute."""

    rid: str
    attempt: int
    tokens: int
    first: tuple | None = None  # its first page's token ids (None: shorter than a page)


@dataclasses.dataclass(frozen=True)
class Ahead:
    rid: str
    attempt: int
    tokens_ahead: int  # tokens the scheduler prefills before this request's prefill starts
    waiting: int = 0  # requests queued behind it that its prefill holds up (waiting_behind)


def shared_prefix(ids: Sequence[int], others: Iterable[Sequence[int]], page: int) -> int:
    """The leading tokens of ``ids``, in whole pages, that one of ``others`` starts with too."""
    best = 0
    for o in others:
        n = min(len(ids), len(o)) // page
        if n * page <= best:
            continue
        k = 0
        while k < n and ids[k * page:(k + 1) * page] == o[k * page:(k + 1) * page]:
            k += 1
        best = max(best, k * page)
    return best


def work_ahead(chunked_remaining: int, waiting: Sequence[Queued]) -> list[Ahead]:
    """Tokens prefilled before each waiting request starts (admission order, FCFS), and the
    requests behind it that its prefill holds up."""
    out, acc = [], max(0, int(chunked_remaining))
    behind = waiting_behind([q.first for q in waiting])
    for q, w in zip(waiting, behind):
        out.append(Ahead(q.rid, q.attempt, acc, w))
        acc += max(0, int(q.tokens))
    return out


def batch_start(tokens_ahead: int, budget: int) -> int:
    """The tokens prefilled before the batch a request starts in: the whole batches of
    ``budget`` tokens ahead of it (``tokens_ahead`` itself when the budget is unknown, <= 0)."""
    tokens_ahead = max(0, int(tokens_ahead))
    if budget <= 0:
        return tokens_ahead
    return tokens_ahead // budget * budget


class PrefillRate:
    """Seconds per prefilled token from SGLang's cumulative counters, over the recent prefill
    batches: the ratio of the last ``window`` increments (each at least ``min_tokens`` tokens;
    smaller ones are merged into the next).  The first increment after the first look is not
    counted (``skip_first``): it holds SGLang's server warm-up, whose batches of a few tokens
    take seconds of compilation -- counted, the rate stayed 10-100x too high until it aged out of
    the window (measured in genuine SGLang: 89 ms a 16-token block after the warm-up and three
    prompts, against ~1 ms; cost_aware then restored from an L3 far dearer than recompute).
    None until known."""

    def __init__(self, window: int = 16, min_tokens: int = 64, skip_first: bool = True):
        self.window, self.min_tokens = window, min_tokens
        self._base: tuple[int, int] | None = None  # (busy_us, tokens) where the pending increment starts
        self._samples: collections.deque = collections.deque(maxlen=window)  # (busy_us, tokens)
        self._skip = skip_first  # the next complete increment is the warm-up's: dropped
        self.s_per_token: float | None = None

    def observe(self, total_busy_us: int, total_uncached_tokens: int) -> float | None:
        if self._base is None or total_uncached_tokens < self._base[1] or total_busy_us < self._base[0]:
            self._base = (total_busy_us, total_uncached_tokens)  # first look, or the counters were reset
            return self.s_per_token
        d_us, d_tok = total_busy_us - self._base[0], total_uncached_tokens - self._base[1]
        if d_tok >= self.min_tokens and d_us > 0:
            self._base = (total_busy_us, total_uncached_tokens)
            if self._skip:
                self._skip = False
                return self.s_per_token
            self._samples.append((d_us, d_tok))
            us = sum(b for b, _ in self._samples)
            tok = sum(t for _, t in self._samples)
            self.s_per_token = us * 1e-6 / tok
        return self.s_per_token

    def per_block(self, tokens_per_block: int) -> float | None:
        return None if self.s_per_token is None else self.s_per_token * tokens_per_block


@dataclasses.dataclass(frozen=True)
class EtaUpdate:
    rid: str
    attempt: int
    eta_s: float  # seconds from now until the request's prefill can start
    waiting: int = 0  # requests queued behind it that its prefill holds up


def material(prev: float | None, new: float, rel: float = REL_CHANGE, abs_s: float = ABS_CHANGE_S) -> bool:
    """Whether ``new`` moved enough from the last sent ``prev`` to be worth a message: by more
    than ``rel`` of it and more than ``abs_s`` (a short ETA jittering by a few ms, or a long one
    by a few per cent, sends nothing)."""
    if prev is None:
        return True
    return abs(new - prev) > max(rel * prev, abs_s)


class EtaPlanner:
    """Remembers the last ETA sent per request; plans the updates of one iteration."""

    def __init__(self, rel: float = REL_CHANGE, abs_s: float = ABS_CHANGE_S, limit: int = 65536):
        self.rel, self.abs_s, self.limit = rel, abs_s, limit
        self._sent: dict[tuple, tuple[float, float, int]] = {}  # (rid, attempt) -> (eta_s, sent at, waiting)
        self._lock = threading.Lock()  # the scheduler thread plans, SGLang's prefetch thread reads

    def __len__(self) -> int:
        return len(self._sent)

    def note_sent(self, rid: str, attempt: int, eta_s: float, now: float, waiting: int = 0) -> None:
        with self._lock:
            if len(self._sent) >= self.limit:
                self._sent.clear()  # bounded; a forgotten request just gets a fresh update
            self._sent[(rid, attempt)] = (eta_s, now, waiting)

    def last_waiting(self, rid: str, attempt: int) -> int | None:
        with self._lock:
            got = self._sent.get((rid, attempt))
        return None if got is None else got[2]

    def last(self, rid: str, attempt: int, now: float) -> float | None:
        """The last sent ETA as it stands now (it counts down as time passes)."""
        with self._lock:
            got = self._sent.get((rid, attempt))
        return None if got is None else max(0.0, got[0] - (now - got[1]))

    def forget(self, keep: Iterable[tuple]) -> None:
        keep = set(keep)
        with self._lock:
            for k in [k for k in self._sent if k not in keep]:
                del self._sent[k]

    def plan(self, ahead: Iterable[Ahead], s_per_token: float | None, now: float,
             tracked: Callable[[str, int], bool] = lambda rid, attempt: True, budget: int = 0) -> list[EtaUpdate]:
        """The updates to send now: requests ``tracked`` whose ETA (the batches ahead of the
        request's own, :func:`batch_start`, at ``s_per_token``) moved materially, or the weight of
        what their prefill holds up (``1 + waiting``)."""
        if s_per_token is None:
            return []
        out = []
        for a in ahead:
            if not tracked(a.rid, a.attempt):
                continue
            eta = batch_start(a.tokens_ahead, budget) * s_per_token
            w = self.last_waiting(a.rid, a.attempt)
            if (material(self.last(a.rid, a.attempt, now), eta, self.rel, self.abs_s)
                    or (w is not None and material(1 + w, 1 + a.waiting, self.rel, 0.0))):
                out.append(EtaUpdate(a.rid, a.attempt, eta, a.waiting))
                self.note_sent(a.rid, a.attempt, eta, now, a.waiting)
        return out


# -- SGLang glue (reads the scheduler; never waits on the sidecar) -----------------------------------
def queued_of(req, shared: int = 0, page: int = 0) -> Queued:
    """A waiting SGLang ``Req``: the tokens its prefill computes (beyond its device and host
    match, and beyond the ``shared`` prefix a request ahead of it computes first), and its first
    ``page`` token ids (its first block: :func:`work_ahead`'s ``waiting``)."""
    handle = getattr(req, "cache_request_handle", None)
    attempt = getattr(handle, "attempt_id", 0) if handle is not None else 0
    total = len(req.origin_input_ids) + len(getattr(req, "output_ids", ()))
    done = int(getattr(req, "prefix_len", 0) or 0) + int(getattr(req, "host_hit_length", 0) or 0)
    ids = req.origin_input_ids
    first = tuple(ids[:page]) if page > 0 and len(ids) >= page else None
    return Queued(str(req.rid), int(attempt or 0), max(0, total - max(done, shared)), first)


def prefill_budget(scheduler) -> int:
    """One prefill batch's token budget: ``chunked_prefill_size``, else ``max_prefill_tokens``
    (0: unknown)."""
    budget = getattr(scheduler, "chunked_prefill_size", None)
    if not budget or budget <= 0:
        budget = getattr(scheduler, "max_prefill_tokens", None) or 0
    return max(0, int(budget))


def chunked_remaining(scheduler) -> int:
    req = getattr(scheduler, "chunked_req", None)
    return 0 if req is None else queued_of(req).tokens


class SchedulerEta:
    """Per rank: computes ETAs at every ``get_new_batch_prefill`` (BEFORE hook) and at queue
    entry (``prefetch_from_storage``), and sends them (rank 0 only) from a sender thread.

    ``send(updates)`` runs on the sender thread with one iteration's updates and returns one
    state per update, in order (one sidecar ``poll_scan`` carrying every ``eta_s``: an
    iteration's updates cost one round trip, not one each);
    ``tracked(rid, attempt)`` says whether the request has a live cost_aware session."""

    def __init__(self, tokens_per_block: int, *, sender: bool,
                 send: Callable[[list[EtaUpdate]], list],
                 tracked: Callable[[str, int], bool], clock: Callable[[], float] = time.monotonic,
                 queue_batches: int = 64, history: int = 0, skip_warm_up: bool = True):
        self.tokens_per_block = tokens_per_block
        self.is_sender = sender
        self.rate = PrefillRate(skip_first=skip_warm_up)  # (tests without SGLang's warm-up: False)
        self.planner = EtaPlanner()
        self.clock = clock
        self._send, self._tracked = send, tracked
        self._sender = BackgroundCalls("kvsidecar-eta", limit=queue_batches)  # one batch per iteration
        self._closed = False
        self.counters = collections.Counter()
        # (iteration, tuple of (rid, tokens_ahead)) of the last ``history`` iterations (tests)
        self.history: collections.deque = collections.deque(maxlen=history or None) if history else None
        self.iteration = 0
        self.sent_log: collections.deque = collections.deque(maxlen=256)  # (rid, eta_s, waiting, state), newest last
        self.scheduler = None  # SGLang's Scheduler, bound by the BEFORE hook
        self._shared: dict[str, int] = {}  # rid -> its prefix a request ahead computes first (when first seen)

    # -- the queue as SGLang holds it ----------------------------------------------------------
    def _queued(self, scheduler) -> list[Queued]:
        """``waiting_queue`` in admission order, each request's tokens less the prefix it shares
        with a request ahead of it (or the chunked one), taken the first time it is seen."""
        chunked = getattr(scheduler, "chunked_req", None)
        ahead = [chunked.origin_input_ids] if chunked is not None else []
        out = []
        for r in scheduler.waiting_queue:
            rid = str(r.rid)
            shared = self._shared.get(rid)
            if shared is None:
                if len(self._shared) >= 65536:
                    self._shared.clear()  # bounded; a request seen again is measured again
                shared = self._shared[rid] = shared_prefix(r.origin_input_ids, ahead, self.tokens_per_block)
            out.append(queued_of(r, shared, self.tokens_per_block))
            ahead.append(r.origin_input_ids)
        return out

    def _forget_shared(self, waiting: list[Queued]) -> None:
        if len(self._shared) > 4 * max(16, len(waiting)):
            keep = {q.rid for q in waiting}
            self._shared = {r: v for r, v in self._shared.items() if r in keep}

    # -- scheduler thread ------------------------------------------------------------------------
    def on_iteration(self, scheduler) -> None:
        """BEFORE ``Scheduler.get_new_batch_prefill``: plan and hand off this iteration's updates."""
        self.iteration += 1
        self.rate.observe(int(getattr(scheduler, "total_prefill_busy_us", 0) or 0),
                          int(getattr(scheduler, "total_prefill_uncached_tokens", 0) or 0))
        waiting = self._queued(scheduler)
        self._forget_shared(waiting)
        ahead = work_ahead(chunked_remaining(scheduler), waiting)
        if self.history is not None and ahead:
            self.history.append((self.iteration, tuple((a.rid, a.tokens_ahead) for a in ahead)))
        if not self.is_sender:
            return
        updates = self.planner.plan(ahead, self.rate.s_per_token, self.clock(), self._tracked,
                                    prefill_budget(scheduler))
        if len(self.planner) > 4 * max(16, len(ahead)):
            self.planner.forget((a.rid, a.attempt) for a in ahead)
        if updates:
            self._hand_off(updates)

    def at_queue_entry(self, scheduler, rid: str, attempt: int) -> tuple[float | None, float | None]:
        """``prefetch_from_storage`` (scheduler thread, just before the request joins
        ``waiting_queue``): (ETA in seconds, prefill seconds per block) for its prefetch."""
        if scheduler is None:
            return None, None
        tokens = chunked_remaining(scheduler) + sum(q.tokens for q in self._queued(scheduler))
        s = self.rate.s_per_token
        if s is None:
            return None, None
        eta = batch_start(tokens, prefill_budget(scheduler)) * s
        self.planner.note_sent(str(rid), int(attempt or 0), eta, self.clock())
        return eta, s * self.tokens_per_block

    def prefetch_inputs(self, rid: str, attempt: int) -> tuple[float | None, float | None]:
        """For the session's ``prefetch`` (SGLang's prefetch thread, a little after queue entry):
        the queue-entry ETA counted down to now, and the prefill cost per block."""
        return self.planner.last(str(rid), int(attempt or 0), self.clock()), self.rate.per_block(self.tokens_per_block)

    # -- sender thread ---------------------------------------------------------------------------
    def _hand_off(self, updates: list[EtaUpdate]) -> None:
        """Never waits: a full hand-off (the sender stuck on the sidecar) drops the batch, counted;
        the next material change sends fresher ETAs anyway."""
        if self._closed:
            return
        if self._sender.submit(lambda: self._send_batch(updates)):
            self.counters["batches"] += 1
            self.counters["planned"] += len(updates)
        else:
            self.counters["batches_dropped"] += 1

    def _send_batch(self, batch: list[EtaUpdate]) -> None:
        """On the sender thread: one round trip for an iteration's updates."""
        try:
            states = list(self._send(batch))
        except Exception:  # a failed batch only leaves the sidecar's older ETAs in place
            self.counters["send_failed"] += len(batch)
            log.debug("kvsidecar ETA updates (%d) failed", len(batch), exc_info=True)
            return
        self.counters["round_trips"] += 1
        for u, state in zip(batch, states + [None] * (len(batch) - len(states))):
            self.sent_log.append((u.rid, round(u.eta_s, 6), u.waiting, state))
            self.counters["sent"] += 1
            if isinstance(state, str):  # the session's state as the sidecar answered
                self.counters[f"sent_{state}"] += 1

    def close(self, timeout_s: float = 2.0) -> None:
        self._closed = True
        self._sender.close(timeout_s)
