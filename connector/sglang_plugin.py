"""The SGLang plugin: SGLang's request lifecycle drives kvsidecar's prefetch sessions.

Loaded by SGLang 0.5.23 in every scheduler process through the ``sglang.srt.plugins`` entry
point ``kvsidecar = kvsidecar.connector.sglang_plugin:load`` (installed with kvsidecar's metadata;
``scripts/sglang/setup_venv.sh``).  ``load`` does two things:

1. **Public extension point**: registers the radix-cache backend ``kvsidecar``
   (``mem_cache/registry.py::register_radix_cache_backend``, selected with
   ``--radix-cache-backend kvsidecar``) -- SGLang's own ``UnifiedRadixCache`` built by
   SGLang's own ``create_unified_radix_cache``, subclassed the way SGLang's LMCache
   integration does, overriding the public lifecycle methods:

   ======================================================  ==================================
   SGLang event                                             kvsidecar op
   ======================================================  ==================================
   queue entry (``prefetch_from_storage``); cost_aware:     ``prefetch`` with the first ETA
   SGLang's call deferred to the next drain, where the      (one round for the iteration's
   TP group agrees (riding SGLang's own collective)         requests); nothing to restore: no
   whether to run each (:mod:`.sglang_entry`)               SGLang operation (ended, ``cost``)
   prefetch thread ``batch_exists`` (whole tail chain)      ``prefetch`` (rid, full chain,
                                                            policy / chunk / budget; joins the
                                                            entry's session) + ``wait`` for the
                                                            L3 query (metadata only)
   I/O thread ``batch_get_v1`` (per 128-page batch)         ``wait`` (published >= batch end
                                                            or stopped) + group ``get`` (hands
                                                            the prefetch lease over) + copy
   first ``check_prefetch_progress``; for ``cost_aware``,   ``demand``
   the settler once the request can prefill this
   iteration (after the drain, before SGLang's checks)
   ``check_prefetch_progress`` done, or the request's       ``abort`` (clean-up: drops what
   prefetch finished by ``check_hicache_events``'s drain    the session still holds; sent by
                                                            the backend's abort thread, not
                                                            waited for)
   ``release_aborted_request`` (incl. terminate)            ``abort``
   ``revoke_pending_prefetch``                              ``abort``
   backup thread ``batch_set_v1``                           group ``store`` + ``commit``
   ======================================================  ==================================

2. **Hooks where the public points do not suffice**: SGLang's storage calls carry no request
   identity (``batch_exists`` / ``batch_get_v1`` get page keys only), so two AROUND hooks
   (``HookRegistry``) on ``HybridCacheController._storage_hit_query`` and ``._page_transfer``
   bind the operation's ``rid`` / attempt to the calling thread for the duration of the call
   (:meth:`KvSidecarHiCacheStorage.bind`).  They do nothing for another storage backend, or
   when the radix cache is not kvsidecar's.

SGLang must run ``--hicache-storage-prefetch-policy wait_complete``: kvsidecar's policy decides
when a prefetch stops and SGLang then takes exactly the drained prefix.  SGLang's own
``best_effort`` / ``timeout`` would terminate the transfer between batches and discard what
kvsidecar drained, so the cache refuses them at start (:class:`KvSidecarPluginError`).  At start
the cache checks that the storage backend is kvsidecar's and both hooks are applied, and logs
it.  Without the plugin the storage backend still works alone (degraded: sessions without
demand or abort, stopped by kvsidecar's deadline).

3. **A hit admitted in the iteration that sent its query** (:mod:`kvsidecar.connector.sglang_settle`):
   after SGLang's per-iteration drain (``check_hicache_events``) the cache waits, bounded by
   ``sessions.settle_wait_s``, for the queries just sent and the copies of hits resident in the
   pool, and drains again, identically on every rank; a hit still read from L3 for a request
   that can prefill in this iteration is stopped there (a demand) and its copy waited for alike.
   Without it every storage hit waited two scheduler iterations (forward passes, under load) for
   SGLang's thread hand-offs, and a hit stopped by the ETA hook one more.

4. **ETA for cost_aware** (:mod:`kvsidecar.connector.sglang_eta`): a BEFORE hook on
   ``Scheduler.get_new_batch_prefill`` (every iteration, every rank) computes each queued
   request's ETA from SGLang's ``waiting_queue`` (admission order), ``chunked_req`` and its
   cumulative ``total_prefill_busy_us / total_prefill_uncached_tokens``; the cache's
   ``prefetch_from_storage`` (scheduler thread, just before the request joins the queue) gives
   the session its first ETA and the prefill cost per block.  Rank 0 sends material changes
   (``poll`` with ``eta_s``) from a sender thread.  ``sessions.policy = "cost_aware"`` needs this
   hook; it is checked at start like the others.
"""

from __future__ import annotations

import functools
import json
import logging
import sys
import time

from .hicache_backend import KvSidecarHiCacheStorage
from .sglang_entry import EntryGate, gate_applies
from .sglang_eta import SchedulerEta, chunked_remaining, prefill_budget, queued_of
from .sglang_settle import HitSettler, lazily

log = logging.getLogger(__name__)

RADIX_CACHE_BACKEND = "kvsidecar"
CONTROLLER = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller.HybridCacheController"
HOOKED_METHODS = ("_storage_hit_query", "_page_transfer")
REQUIRED_PREFETCH_POLICY = "wait_complete"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
ETA_HOOKED_METHOD = "get_new_batch_prefill"

_originals: dict[str, object] = {}  # hooked method -> SGLang's own function (to check the hooks took)


class KvSidecarPluginError(RuntimeError):
    """SGLang is configured in a way the kvsidecar plugin cannot serve (raised at start)."""


# -- the hooks ------------------------------------------------------------------------------------
def _driven_backend(controller) -> KvSidecarHiCacheStorage | None:
    backend = getattr(controller, "storage_backend", None)
    if isinstance(backend, KvSidecarHiCacheStorage) and backend.plugin_driven:
        return backend
    return None


def _bound_call(original, controller, operation, *args, **kwargs):
    """AROUND hook: the storage calls ``original`` makes belong to ``operation``'s request."""
    backend = _driven_backend(controller)
    if backend is None:
        return original(controller, operation, *args, **kwargs)
    handle = operation.handle
    t0 = time.perf_counter()
    try:
        with backend.bind(handle.rid, getattr(handle, "attempt_id", 0)):
            return original(controller, operation, *args, **kwargs)
    finally:
        if backend.trace is not None:
            backend.trace(handle.rid, original.__name__.lstrip("_"), t0, time.perf_counter())


def hooks_applied() -> dict[str, bool]:
    """Which of the plugin's hooks are in place on SGLang's controller class."""
    import pkgutil

    cls = pkgutil.resolve_name(CONTROLLER)
    return {m: m in _originals and cls.__dict__.get(m) is not _originals[m] for m in HOOKED_METHODS}


def _eta_before_prefill(scheduler, *args, **kwargs):
    """BEFORE hook on ``Scheduler.get_new_batch_prefill``: this iteration's ETA updates.

    Never raises into the scheduler loop and never waits on the sidecar (the updates go to a
    sender thread)."""
    cache = getattr(scheduler, "tree_cache", None)
    if getattr(cache, "_kvs_settle", None) is not None:
        cache._kvs_scheduler = scheduler  # the settler asks where a request stands in the queue
    eta = getattr(cache, "_kvs_eta", None)
    if eta is not None:
        try:
            eta.scheduler = scheduler  # lives as long as the process
            eta.on_iteration(scheduler)
        except Exception:  # pragma: no cover - a bug here must not stop SGLang
            eta.counters["hook_errors"] += 1
            log.exception("kvsidecar ETA hook failed; cost_aware keeps its last ETA")
    return None


def eta_hook_applied() -> bool:
    """Whether the ETA hook wraps ``Scheduler.get_new_batch_prefill`` (SGLang's scheduler
    module imported and its hooks applied)."""
    mod = sys.modules.get(SCHEDULER.rsplit(".", 1)[0])
    fn = getattr(getattr(mod, "Scheduler", None), ETA_HOOKED_METHOD, None)
    for _ in range(32):  # the chain of wrappers HookRegistry built (bounded)
        if fn is None:
            return False
        if any(getattr(c, "cell_contents", None) is _eta_before_prefill for c in (fn.__closure__ or ())):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


# -- the radix cache ------------------------------------------------------------------------------
@functools.cache
def radix_cache_class():
    """``UnifiedRadixCache`` with kvsidecar's lifecycle (built lazily: imports SGLang)."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    class KvSidecarRadixCache(UnifiedRadixCache):
        _kvs: KvSidecarHiCacheStorage | None = None
        _kvs_eta = None
        _kvs_entry = None

        def init_hicache(self, server_args, params) -> None:
            super().init_hicache(server_args, params)
            self._kvs = activate(self.cache_controller, self.prefetch_stop_policy)
            self._kvs_demanded: set = set()
            self._kvs_eta = eta_for(self._kvs)
            self._kvs_scheduler = None  # SGLang's Scheduler, bound by the BEFORE hook on get_new_batch_prefill
            self._kvs_settle = settler_for(self, self._kvs)
            self._kvs_entry = entry_gate_for(self, self._kvs)

        def check_hicache_events(self) -> None:
            """SGLang's per-iteration drain of the storage queues, then (:mod:`.sglang_settle`) the
            same iteration's queries and resident hits brought in; a request whose prefetch the
            drains finished (its pages joined the tree, it left ``ongoing_prefetch`` without
            passing ``check_prefetch_progress``) has its session ended here."""
            kvs = self._kvs
            entry = self._kvs_entry
            if entry is not None:  # the requests received since the last drain (every rank): asked now,
                entry.ask()  # agreed in the drain's own collective (_all_reduce_attn_groups), decided after it
            before = list(self.ongoing_prefetch) if kvs is not None else ()
            super().check_hicache_events()
            if entry is not None:
                entry.decide(self)
            if self._kvs_settle is not None:
                self._kvs_settle.settle(self, lazily(lambda: admissible_now(self._kvs_scheduler)))
            for request in before:
                if request not in self.ongoing_prefetch:
                    self._kvs_demanded.discard(request)
                    t0 = time.perf_counter()
                    kvs.end(request.rid, request.attempt_id)
                    if kvs.trace is not None:
                        kvs.trace(request.rid, "end", t0, time.perf_counter())

        def prefetch_from_storage(self, request, last_host_node_id, new_input_tokens, last_hash=None,
                                  *args, **kwargs):
            eta = self._kvs_eta
            eta_s = per_block = None
            if eta is not None:  # the scheduler thread, just before the request joins waiting_queue
                eta_s, per_block = eta.at_queue_entry(eta.scheduler, request.rid, request.attempt_id)
            gate = self._kvs_entry
            if gate is not None and self.enable_storage and gate_applies(
                    len(new_input_tokens), self.page_size, self.prefetch_threshold, kwargs.get("storage_hit_end")):
                # the anchor stays until the decision: the drain before it may evict host nodes
                hold = self.inc_host_lock_ref(last_host_node_id).to_dec_params()

                def release():
                    self.dec_host_lock_ref(last_host_node_id, hold)

                def run():  # after the next drain, if the group runs it: SGLang's call as it was
                    try:
                        super(KvSidecarRadixCache, self).prefetch_from_storage(
                            request, last_host_node_id, new_input_tokens, last_hash, *args, **kwargs)
                    finally:
                        release()  # (SGLang's call holds the anchor itself from here)
                    gate.after_prefetch(self, request)

                gate.defer(self, request, new_input_tokens, last_hash, kwargs.get("extra_key"),
                           kwargs.get("cache_salt"), eta_s, per_block, run, release)
                return None  # (SGLang's callers do not use the answer)
            return super().prefetch_from_storage(request, last_host_node_id, new_input_tokens, last_hash,
                                                 *args, **kwargs)

        def _all_reduce_attn_groups(self, tensor, op):
            """SGLang's TP collective; the entry gate's flags ride the first one of a drain (its
            ready-count sync, every iteration on every rank) instead of a collective of their own."""
            entry = self._kvs_entry
            extra = entry.ride(op) if entry is not None else None
            if extra is None:
                return super()._all_reduce_attn_groups(tensor, op)
            import torch

            n = tensor.numel()
            both = torch.cat([tensor.reshape(-1), extra.to(tensor.dtype)])
            super()._all_reduce_attn_groups(both, op)
            tensor.copy_(both[:n].reshape(tensor.shape))
            entry.rode(both[n:])
            return None

        def check_prefetch_progress(self, request) -> bool:
            kvs = self._kvs
            live = kvs is not None and request in self.ongoing_prefetch
            if live and request not in self._kvs_demanded:
                self._kvs_demanded.add(request)
                t0 = time.perf_counter()
                kvs.demand(request.rid, request.attempt_id)
                if kvs.trace is not None:  # a sidecar round trip on SGLang's scheduler thread
                    kvs.trace(request.rid, "demand", t0, time.perf_counter())
            t0 = time.perf_counter()
            done = super().check_prefetch_progress(request)
            if live and kvs.trace is not None:
                kvs.trace(request.rid, "check_progress", t0, time.perf_counter())
            if live and done:
                self._kvs_demanded.discard(request)
                t0 = time.perf_counter()
                kvs.end(request.rid, request.attempt_id)
                if kvs.trace is not None:
                    kvs.trace(request.rid, "end", t0, time.perf_counter())
            return done

        def release_aborted_request(self, request) -> None:
            if self._kvs_entry is not None:
                self._kvs_entry.drop(request)  # aborted before its entry decision: its call is never made
            live = self._kvs is not None and request in self.ongoing_prefetch
            super().release_aborted_request(request)
            if live:
                self._kvs_demanded.discard(request)
                self._kvs.end(request.rid, request.attempt_id)

        def revoke_pending_prefetch(self, request) -> None:
            live = self._kvs is not None and request in self.ongoing_prefetch
            super().revoke_pending_prefetch(request)
            if live:
                self._kvs_demanded.discard(request)
                self._kvs.end(request.rid, request.attempt_id)

    return KvSidecarRadixCache


def entry_gate_for(cache, backend: KvSidecarHiCacheStorage | None) -> EntryGate | None:
    """The cache's :class:`EntryGate`, or None: not ``cost_aware`` (only its sessions decide at
    start), off in the config, no sessions or no L3, or a set-up whose storage operations are not
    the plain TP-synchronised ones (pipeline parallel, buffer-only host memory, a cache linker)."""
    if backend is None:
        return None
    s = backend.config.sessions
    if s.policy != "cost_aware" or not s.decide_at_entry or not s.enabled or not backend.use_l3:
        return None
    if (getattr(cache, "pp_size", 1) > 1 or getattr(cache, "buffer_pipeline", None) is not None
            or getattr(cache, "linker", None) is not None):
        log.info("kvsidecar plugin: entry decisions off (pipeline parallel, buffer-only host memory or a cache linker)")
        return None
    return EntryGate(backend)


def settler_for(cache, backend: KvSidecarHiCacheStorage | None) -> HitSettler | None:
    """The cache's :class:`HitSettler`, or None: off in the config, no sessions, or a set-up whose
    drains are not the plain TP-synchronised ones it was measured with (pipeline parallel, SGLang's
    buffer-only host memory, an external cache linker)."""
    if backend is None or not backend.config.sessions.enabled or backend.config.sessions.settle_wait_s <= 0:
        return None
    if (getattr(cache, "pp_size", 1) > 1 or getattr(cache, "buffer_pipeline", None) is not None
            or getattr(cache, "linker", None) is not None):
        log.info("kvsidecar plugin: hit settling off (pipeline parallel, buffer-only host memory or a cache linker)")
        return None
    return HitSettler(backend.config.sessions.settle_wait_s,
                      lambda request: backend.resident(request.rid, request.attempt_id), trace=backend.trace,
                      stop=lambda request: backend.stop_for_prefill(request.rid, request.attempt_id))


def admissible_now(scheduler):
    """This iteration's predicate: could a request start its prefill now, i.e. are the uncached
    tokens ahead of it (the chunked request's rest, then the waiting queue in SGLang's FCFS
    admission order) fewer than one iteration's prefill budget (``chunked_prefill_size``, else
    ``max_prefill_tokens``)?  One walk of the queue's head per iteration, however many requests
    are asked about.  The same on every rank (SPMD queue).  True for every request before the
    scheduler is known, and for one not in the queue."""
    if scheduler is None:
        return lambda request: True
    budget = prefill_budget(scheduler)
    if budget <= 0:
        return lambda request: True
    waiting = list(getattr(scheduler, "waiting_queue", ()))
    queued = {str(r.rid) for r in waiting}
    can, ahead = set(), chunked_remaining(scheduler)
    for r in waiting:
        if ahead >= budget:
            break
        can.add(str(r.rid))
        ahead += queued_of(r).tokens
    return lambda request: str(request.rid) in can or str(request.rid) not in queued


def activate(controller, prefetch_stop_policy: str) -> KvSidecarHiCacheStorage:
    """Check at start that everything the plugin needs is in place; mark the backend driven.

    Raises :class:`KvSidecarPluginError` naming what is missing or refused."""
    backend = getattr(controller, "storage_backend", None) if controller is not None else None
    if not isinstance(backend, KvSidecarHiCacheStorage):
        raise KvSidecarPluginError(
            f"--radix-cache-backend {RADIX_CACHE_BACKEND} needs --enable-hierarchical-cache with kvsidecar as "
            "the storage backend (--hicache-storage-backend dynamic, module_path kvsidecar.connector.hicache_backend, "
            f"class_name KvSidecarHiCacheStorage); got {type(backend).__name__}")
    if prefetch_stop_policy != REQUIRED_PREFETCH_POLICY:
        raise KvSidecarPluginError(
            f"--hicache-storage-prefetch-policy {prefetch_stop_policy} would terminate SGLang's transfer "
            "between batches and discard the prefix kvsidecar drained; run "
            f"--hicache-storage-prefetch-policy {REQUIRED_PREFETCH_POLICY} and choose the stop policy in "
            "kvsidecar's config (sessions.policy)")
    missing = [m for m, ok in hooks_applied().items() if not ok]
    if backend.config.sessions.policy == "cost_aware" and not eta_hook_applied():
        missing.append(f"{SCHEDULER.rsplit('.', 1)[1]}.{ETA_HOOKED_METHOD} (cost_aware's ETA)")
    if missing:
        raise KvSidecarPluginError(f"kvsidecar plugin hooks not applied on {CONTROLLER}: {missing} "
                                   "(is the sglang.srt.plugins entry point installed? SGLANG_PLUGINS?)")
    backend.plugin_driven = True
    if backend.config.timeline:
        backend.trace = _timeline_logger(backend.rank)
    s = backend.config.sessions
    log.info("kvsidecar plugin active (rank %d/%d, group %r): radix cache %s, hooks %s applied, SGLang policy "
             "%s, kvsidecar policy %s, chunk_max_blocks %s, budget %s", backend.rank, backend.tp_size, backend.group,
             RADIX_CACHE_BACKEND, "+".join(HOOKED_METHODS + ((ETA_HOOKED_METHOD,) if eta_hook_applied() else ())),
             prefetch_stop_policy, s.policy,
             s.chunk_max_blocks or "sidecar default", s.budget_s or "sidecar formula")
    return backend


def _timeline_logger(rank: int):
    """``config.timeline``: one log line per storage phase of a request (time.perf_counter, i.e.
    CLOCK_MONOTONIC: comparable with a client's clock on the same host)."""
    def trace(rid, phase, t0, t1):
        log.info("kvsidecar-timeline %s", json.dumps({"rank": rank, "rid": str(rid), "phase": phase,
                                                      "t0": round(t0, 6), "t1": round(t1, 6)}))
    return trace


def eta_for(backend: KvSidecarHiCacheStorage) -> SchedulerEta | None:
    """cost_aware's ETA source for this rank (None for the other policies): rank 0 sends."""
    if backend.config.sessions.policy != "cost_aware":
        return None

    def send(updates):
        t0 = time.perf_counter()
        views = backend._call(lambda c: c.poll_scan([(u.rid, u.eta_s, False, u.attempt, u.waiting) for u in updates],
                                                    until_ready=False), None) or []
        if backend.trace is not None:
            t1 = time.perf_counter()
            for u in updates:
                backend.trace(u.rid, "eta_sent", t0, t1)
        return [v.get("state", "unavailable") for v in views] + ["unavailable"] * (len(updates) - len(views))

    def tracked(rid, attempt):
        return backend.session(rid, attempt) is not None

    eta = SchedulerEta(backend.layout.tokens_per_block, sender=backend.rank == 0, send=send, tracked=tracked)
    backend.eta_source = eta.prefetch_inputs
    if backend.trace is not None:  # timeline: the ETA inputs each session starts with (-1: unknown)
        def traced(rid, attempt):
            eta_s, per_block = eta.prefetch_inputs(rid, attempt)
            backend.trace(rid, "eta_input", -1.0 if eta_s is None else eta_s, -1.0 if per_block is None else per_block)
            return eta_s, per_block
        backend.eta_source = traced
    return eta


def _factory(ctx):
    from sglang.srt.mem_cache.registry import create_unified_radix_cache

    if not ctx.enable_hierarchical_cache:
        raise KvSidecarPluginError(f"--radix-cache-backend {RADIX_CACHE_BACKEND} needs --enable-hierarchical-cache "
                                   "(and kvsidecar as the HiCache storage backend)")
    return create_unified_radix_cache(ctx, cache_class=radix_cache_class())


# -- the entry point ------------------------------------------------------------------------------
def load() -> None:
    """``sglang.srt.plugins`` entry point: register the radix-cache backend and the hooks."""
    import pkgutil

    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if RADIX_CACHE_BACKEND not in registered_radix_cache_backends():
        register_radix_cache_backend(RADIX_CACHE_BACKEND, _factory)
    cls = pkgutil.resolve_name(CONTROLLER)
    for m in HOOKED_METHODS:
        if m in _originals:
            continue  # idempotent
        _originals[m] = cls.__dict__[m]
        HookRegistry.register(f"{CONTROLLER}.{m}", _bound_call, HookType.AROUND)
    if "eta" not in _originals:
        _originals["eta"] = True
        HookRegistry.register(f"{SCHEDULER}.{ETA_HOOKED_METHOD}", _eta_before_prefill, HookType.BEFORE)
    log.info("kvsidecar plugin loaded: radix-cache backend %r registered, hooks on %s", RADIX_CACHE_BACKEND,
             ", ".join(f"{CONTROLLER.rsplit('.', 1)[1]}.{m}" for m in HOOKED_METHODS))
