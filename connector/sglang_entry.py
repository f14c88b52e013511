"""cost_aware at queue entry: SGLang runs a storage operation for a request only when the
sidecar says it can restore something.

Why: SGLang's storage protocol costs a request that goes through it, whatever it restores --
the prefetch thread's query, the TP-collective drains of the storage queues, and the
``wait_complete`` gate that admits the request only once its operation is over (measured on the
benchmark's TP=2 CPU server: 5-10 ms per request, against a 2K-token prefill of ~100 ms).  When
the L3 is dearer per block than prefill and nothing is resident in the pool, cost_aware restores
nothing, and the request paid that cost for nothing: the first request of every shared prompt
was the slow tail (p90) of the 8 Mbit/s row.

So at queue entry (``prefetch_from_storage``, SGLang's scheduler thread, just before the request
joins ``waiting_queue``) the plugin defers SGLang's call and sends the request's session start
(:class:`~kvsidecar.connector.hicache_requests.EntryRound`: the same chain and parameters as the
query SGLang's prefetch thread sends later, which joins it), not waiting for the answer.  At the
start of the next drain (``check_hicache_events``, the first thing the scheduler's next batch
selection does, before any admission) each rank reads the answers of every start sent since the
last one (:meth:`EntryGate.ask`); the sidecar's session machine decided as each started
(``CREATED -> TERMINAL`` when neither the resident prefix nor an L3 read can pay,
:func:`kvsidecar.sidecar.prefetch.cost.worth_querying`).  The group agrees without a collective of
its own: the answers ride the drain's first TP collective (:meth:`EntryGate.ride`: SGLang's
ready-count sync, a MIN every iteration), and after the drain :meth:`EntryGate.decide` makes the
deferred calls the group keeps.  Why: the gate holds the scheduler thread, and every request in
the queue with it; one ask and one MAX per request cost 1.7-2.6 ms each (TP=2 CPU server, 8 Mbit/s),
and one blocking round at the drain's start still ~0.8 ms per drain.

Invariants:

* **Every rank takes the same decision**: SGLang's storage drains are collective, so a request
  with an operation on one rank and none on another would hang the group.  Whether the gate runs
  at all depends only on the call's arguments and the configuration (:func:`gate_applies`:
  identical on SPMD ranks), so every rank defers the same requests in the same order and decides them
  at the same point; each rank's own answers (its sidecar round, or "run it" when that fails)
  then go through one reduction over the TP group: riding SGLang's own drain collective (flags
  "skip" under its MIN, "run" under a MAX, appended to its tensor and cut off again before SGLang
  reads it), or, where the drain ran none, one MAX of the gate's own (the radix cache's
  ``_all_reduce_attn_groups``: the thread and group of SGLang's own drains).  Every rank takes
  the same branch: the drain's collectives are SPMD.  A rank that could not reach the sidecar can
  only make every rank run the operation, never split them.
* **A deferred call is made as SGLang would have made it**: with the arguments of the queue
  entry, after the drain that decides it and before the admission that follows.  The drain may
  allocate host memory (backups, storage hits) and so evict: the plugin holds the request's
  anchor node (a host lock, taken at entry) until SGLang's own call has taken its lock, or until
  the request is skipped or dropped, so what the entry matched is still there.  A request aborted
  before its decision is dropped (:meth:`EntryGate.drop`): its call is never made.
* **Nothing that could be restored is skipped**: the answer is "skip" only for a session that
  ended as it started with no prefix (:meth:`KvSidecarHiCacheStorage.start_at_entry_many`).
* **The gate never raises into SGLang** between the collective calls: the local answers are
  computed under ``try`` (an error means "run it"), and the reduction is always reached.
* A request that leaves before its decision (:meth:`EntryGate.drop`) has its session, started at
  entry, ended at the next drain, once its start's answer is read (the end cannot overtake it).
* A session started here whose request SGLang then gives no operation (its own declines) and no
  retry is ended at once; a skipped request's session ended itself (terminal, nothing held).
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


def gate_applies(n_new_tokens: int, page_size: int, threshold: int, storage_hit_end) -> bool:
    """Whether the gate decides for this call: a first query (no ``storage_hit_end``: SGLang's
    re-queries after a device-hit loss keep their own path) long enough for SGLang to prefetch it
    (its page-aligned length reaches ``prefetch_threshold``).  A pure function of the call's
    arguments and the configuration, so every rank answers it alike."""
    if storage_hit_end is not None or page_size <= 0:
        return False
    return n_new_tokens // page_size * page_size >= max(threshold, page_size)


class Deferred:
    """One request's deferred ``prefetch_from_storage``: its slot in the rank's
    :class:`~kvsidecar.connector.hicache_requests.EntryRound` (its session's start, sent at
    entry), ``run()``, SGLang's call with the entry's arguments (it lets the entry's hold on the
    anchor go once SGLang's call took its own), and ``release()``, that hold's end for a request
    that gets no call (skipped, or aborted before its decision)."""

    __slots__ = ("request", "slot", "run", "release", "t_entry")

    def __init__(self, request, slot, run, release, t_entry):
        self.request, self.slot, self.run, self.release, self.t_entry = request, slot, run, release, t_entry


class _Asked:
    """The requests one drain decides: their entries, this rank's answers, the group's."""

    __slots__ = ("entries", "mine", "t0", "t1", "op", "agreed", "t_agreed")

    def __init__(self, entries, mine, t0, t1):
        self.entries, self.mine, self.t0, self.t1 = entries, mine, t0, t1
        self.op = self.agreed = self.t_agreed = None


class EntryGate:
    """One rank's gate (built by the plugin for ``cost_aware`` with ``sessions.decide_at_entry``)."""

    def __init__(self, backend):
        self.backend = backend
        self._round = backend.entry_round()  # the starts sent since the last drain
        self._pending: dict = {}  # request handle -> Deferred, in SGLang's call order (SPMD)
        self._dropped: list = []  # requests that left after their start was sent: ended at the drain
        self._asked: _Asked | None = None  # asked at this drain's start, decided at its end
        self.drains = 0  # drains that decided something

    def _count(self, name: str) -> None:
        self.backend._count(f"entry_{name}")  # in the backend's stats()

    def keys(self, cache, new_input_tokens, last_hash, extra_key, cache_salt) -> list:
        """The page keys SGLang's prefetch thread will query: ``get_storage_hash_str`` over the
        page-aligned span, as ``prefetch_from_storage`` builds it; the hybrid controller's
        ``_storage_hit_query`` sends them all in one ``batch_exists`` (no 128-page batches: a
        session over the first 128 keys of a longer span was refused by that query as another
        chain, measured on 2,176-token prompts)."""
        from sglang.srt.mem_cache.radix_cache import RadixKey
        from sglang.srt.mem_cache.utils import get_storage_hash_str

        key = RadixKey(new_input_tokens, extra_key=extra_key, is_bigram=cache.tree_core.is_eagle,
                       cache_salt=cache_salt).page_aligned(cache.page_size)
        return list(get_storage_hash_str(key, last_hash, page_size=cache.cache_controller.page_size))

    @property
    def pending(self) -> int:
        return len(self._pending)

    def defer(self, cache, request, new_input_tokens, last_hash, extra_key, cache_salt,
              eta_s, prefill_s_per_block, run, release=lambda: None) -> None:
        """Hold the request's storage operation (``run()``) until the next drain decides it, and
        start its session now (sent, not waited for: :meth:`ask` reads the answer)."""
        self._count("asked")
        t0 = time.perf_counter()
        try:
            keys = self.keys(cache, new_input_tokens, last_hash, extra_key, cache_salt)
        except Exception:  # a bug here must not stop SGLang: the operation runs
            self._count("errors")
            log.exception("kvsidecar entry gate: no keys; SGLang runs the storage operation")
            keys = None
        old = self._pending.pop(request, None)
        if old is not None:  # (deferred again before its decision: the newer call stands)
            old.release()
            self._round.withdraw(old.slot)
        try:
            slot = self._round.send(request.rid, request.attempt_id, keys, eta_s, prefill_s_per_block)
        except Exception:  # a bug here must not stop SGLang: the operation runs (slot None: "run")
            self._count("errors")
            log.exception("kvsidecar entry gate: the start was not sent; SGLang runs the storage operation")
            slot = None
        if self.backend.trace is not None:
            self.backend.trace(request.rid, "entry_start", t0, time.perf_counter())  # keys, and the start sent
        self._pending[request] = Deferred(request, slot, run, release, t0)

    def drop(self, request) -> bool:
        """The request left before its decision (aborted in the queue): forget its deferred call;
        its session, started at entry, is ended once the drain has read its start's answer."""
        e = self._pending.pop(request, None)
        if e is None:
            return False
        e.release()
        if e.slot is not None:
            self._round.withdraw(e.slot)
            self._dropped.append(request)
        self._count("dropped")
        return True

    def local_answers(self, entries: list) -> list:
        """This rank's answers, one per entry: True (run SGLang's operation) unless the sidecar
        says nothing can be restored; True on any error.  Reads the round's answers (every start
        sent since the last drain, withdrawn ones included) and ends the sessions of requests
        that left meanwhile."""
        try:
            got = self._round.answers() if self._round.pending else []
        except Exception:  # a bug here must not stop SGLang (nor split the group)
            self._count("errors")
            log.exception("kvsidecar entry gate failed; SGLang runs the storage operations")
            got = []
        dropped, self._dropped = self._dropped, []
        for request in dropped:
            self.backend.end(request.rid, request.attempt_id)
        return [got[e.slot] if e.slot is not None and e.slot < len(got) else True for e in entries]

    def ask(self) -> None:
        """Read the answers for every deferred request (every rank, at the start of the drain,
        same order): the starts went out at queue entry, so this waits at most for the rest of
        their round.  Their agreement rides the drain's own collective (:meth:`ride`), and
        :meth:`decide` acts on it."""
        if self._asked is not None or not (self._pending or self._dropped):
            return
        entries = list(self._pending.values())
        self._pending.clear()
        t0 = time.perf_counter()
        mine = self.local_answers(entries)
        if entries:
            self._asked = _Asked(entries, mine, t0, time.perf_counter())

    def ride(self, op):
        """The flags the asked requests' agreement adds to a collective with ``op`` (this rank's
        answers: "skip" under MIN, "run" under MAX), or None: nothing asked, agreed already, or
        another reduction.  Called by the cache's collective on the scheduler thread."""
        import torch

        asked = self._asked
        if asked is None or asked.agreed is not None:
            return None
        if op == torch.distributed.ReduceOp.MIN:
            asked.op = "min"
            return torch.tensor([0 if run else 1 for run in asked.mine])
        if op == torch.distributed.ReduceOp.MAX:
            asked.op = "max"
            return torch.tensor([1 if run else 0 for run in asked.mine])
        return None

    def rode(self, values) -> None:
        """The group's reduction of :meth:`ride`'s flags: run unless every rank said skip."""
        asked = self._asked
        flags = [int(x) for x in values.tolist()]
        asked.agreed = [f == 0 for f in flags] if asked.op == "min" else [f == 1 for f in flags]
        asked.t_agreed = time.perf_counter()

    def decide(self, cache) -> None:
        """Act on the agreement (every rank): SGLang's deferred call for each request the group
        runs, the end of each skipped one's session.  Where no collective carried the flags (a
        drain without one), the group agrees here, in one MAX of its own."""
        asked, self._asked = self._asked, None
        if asked is None:
            return
        self.drains += 1
        agree = "entry_agree"  # the flags rode SGLang's collective (the time between: its drain)
        if asked.agreed is None:
            agree = "entry_agree_own"
            asked.agreed = asked.mine
            if getattr(cache, "tp_world_size", 1) > 1:
                import torch

                flags = torch.tensor([int(m) for m in asked.mine], dtype=torch.int)
                cache._all_reduce_attn_groups(flags, torch.distributed.ReduceOp.MAX)
                asked.agreed = [bool(x) for x in flags.tolist()]
                self._count("own_collectives")
            asked.t_agreed = time.perf_counter()
        trace = self.backend.trace
        if trace is not None:  # the round, and the group's agreement (SGLang's drain in between)
            batch = f"entry:{len(asked.entries)}:{asked.entries[0].request.rid}"
            trace(batch, "entry_ask", asked.t0, asked.t1)
            trace(batch, agree, asked.t1, asked.t_agreed)
        for e, run, own in zip(asked.entries, asked.agreed, asked.mine):
            if run:
                if not own:
                    self._count("kept_by_group")  # another rank's sidecar answer (or failure) kept it
                e.run()
            else:
                self._count("skipped")
                e.release()
                self.backend.end(e.request.rid, e.request.attempt_id)  # (terminal already: unregisters it)
            if trace is not None:  # the request's wait from its entry to its decision
                trace(e.request.rid, "entry_gate", e.t_entry, asked.t_agreed)

    def after_prefetch(self, cache, request) -> None:
        """After SGLang's own ``prefetch_from_storage``: a request it gave no operation and no
        retry has its entry session ended (nothing will query, demand or end it)."""
        if request in cache.ongoing_prefetch:
            return
        pending = getattr(getattr(cache, "storage_prefetch_retries", None), "_pending", None)
        if pending is None or request.rid in pending:
            return  # a retry will query (and join) it
        self._count("ended_unsubmitted")
        self.backend.end(request.rid, request.attempt_id)
