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
joins ``waiting_queue``) each rank starts the request's session (``start_at_entry``: the same
chain and parameters as the query SGLang's prefetch thread sends later, which joins it).  The
sidecar's session machine decides as it starts (``CREATED -> TERMINAL`` when neither the resident
prefix nor an L3 read can pay, :func:`kvsidecar.sidecar.prefetch.cost.worth_querying`).

Invariants:

* **Every rank takes the same decision**: SGLang's storage drains are collective, so a request
  with an operation on one rank and none on another would hang the group.  Whether the gate runs
  at all depends only on the call's arguments and the configuration (:func:`gate_applies`:
  identical on SPMD ranks); each rank's own answer (its sidecar call, or "run it" when the call
  fails) then goes through one collective MAX over the TP group, on the scheduler thread, with the
  radix cache's own helper (``_all_reduce_attn_groups``: the thread and group of SGLang's own
  drains, called in the same order on every rank).  A rank that could not reach the sidecar can
  only make every rank run the operation, never split them.
* **Nothing that could be restored is skipped**: the answer is "skip" only for a session that
  ended as it started with no prefix (:meth:`KvSidecarHiCacheStorage.start_at_entry`).
* **The gate never raises into SGLang** between the collective calls: the local answer is
  computed under ``try`` (an error means "run it"), and the collective is always reached.
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


class EntryGate:
    """One rank's gate (built by the plugin for ``cost_aware`` with ``sessions.decide_at_entry``)."""

    def __init__(self, backend):
        self.backend = backend

    def _count(self, name: str) -> None:
        self.backend._count(f"entry_{name}")  # in the backend's get_stats

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

    def local_answer(self, cache, request, new_input_tokens, last_hash, extra_key, cache_salt,
                     eta_s, prefill_s_per_block) -> bool:
        """This rank's answer: True (run SGLang's operation) unless the sidecar says nothing can be
        restored; True on any error."""
        try:
            t0 = time.perf_counter()
            keys = self.keys(cache, new_input_tokens, last_hash, extra_key, cache_salt)
            if self.backend.trace is not None:
                self.backend.trace(request.rid, "entry_keys", t0, time.perf_counter())
            return self.backend.start_at_entry(request.rid, request.attempt_id, keys, eta_s, prefill_s_per_block)
        except Exception:  # a bug here must not stop SGLang (nor split the group)
            self._count("errors")
            log.exception("kvsidecar entry gate failed; SGLang runs the storage operation")
            return True

    def decide(self, cache, request, new_input_tokens, last_hash, extra_key, cache_salt,
               eta_s, prefill_s_per_block) -> bool:
        """The group's decision for the request: run SGLang's storage operation (True) or not."""
        import torch

        self._count("asked")
        trace = self.backend.trace
        t0 = time.perf_counter()
        mine = self.local_answer(cache, request, new_input_tokens, last_hash, extra_key, cache_salt,
                                 eta_s, prefill_s_per_block)
        t1 = time.perf_counter()
        agreed = mine
        if getattr(cache, "tp_world_size", 1) > 1:
            flag = torch.tensor(int(mine), dtype=torch.int)
            cache._all_reduce_attn_groups(flag, torch.distributed.ReduceOp.MAX)
            agreed = bool(int(flag.item()))
        if trace is not None:  # the timeline: this rank's own answer, then the wait for the group's
            trace(request.rid, "entry_ask", t0, t1)
            trace(request.rid, "entry_agree", t1, time.perf_counter())
        if not agreed:
            self._count("skipped")
            self.backend.end(request.rid, request.attempt_id)  # (terminal already: unregisters it)
        elif not mine:
            self._count("kept_by_group")  # another rank's sidecar answer (or failure) kept it
        return agreed

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
