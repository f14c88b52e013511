"""kvsidecar as an SGLang HiCache storage backend (``--hicache-storage-backend dynamic``).

SGLang loads it with::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvsidecar", "module_path": "kvsidecar.connector.hicache_backend",
        "class_name": "KvSidecarHiCacheStorage", "interface_v1": 1, "instance": "kvs0"}'

(configuration: ``kvsidecar.connector.sglang_config``; the lifecycle plugin: ``kvsidecar.connector.sglang_plugin``).

**One TP group for all ranks.**  Every rank of a server attaches to the same sidecar group
with a ``tp_size = N`` layout whose shard ``r`` is exactly one host-pool page of rank ``r``
(gathered from / scattered to the buffers ``get_page_buffer_meta`` names, one memcpy per
buffer).  SGLang's page keys (chained SHA-256, seeded by SGLang with the request's
``extra_key`` -- which carries the LoRA id -- and ``cache_salt``; no rank) map to one
kvsidecar key per page, seeded with the layout fingerprint and the configured namespace, so
one block holds every rank's shard and one prefetch session serves all ranks; group ops
(``req`` + ``step``) give every rank the same count, so SGLang's own MIN all-reduces agree
trivially.

* ``batch_exists`` (SGLang's prefetch thread, the whole tail chain at once): starts -- or
  joins, for the other ranks -- the request's prefetch session with the full chain and
  kvsidecar's policy, and answers from metadata only: the pool's resident prefix plus L3's
  hit (``wait`` on the session's query, bounded by ``sessions.query_wait_s``).  It never
  waits for data.
* ``batch_get_v1`` (SGLang's I/O thread, per 128-page batch): waits (bounded by
  ``sessions.get_wait_s``, woken by the sidecar) until the session has published the batch
  or stopped, takes a group-consistent held GET (which hands the session's prefetch lease
  over), copies what is resident into the host pages, releases.  Pages past the session's
  drained prefix answer False, so SGLang's ``completed_tokens`` is exactly that prefix.
* ``batch_set_v1`` (backup thread): a group-consistent store (every rank writes its shard of
  the same staging; published when all have committed, then written behind to L3).
* The request identity (SGLang's ``rid`` / attempt) comes from the plugin, which binds the
  operation to the calling thread (:meth:`bind`).  Without the plugin (degraded) a session
  gets an id derived from its chain, policy ``timeout``: no demand, no abort, the sidecar's
  deadline stops it.
* **Threads**: a call checks a sidecar connection out of the rank's bounded pool
  (:class:`kvsidecar.connector.thread_conns.ConnectionPool`, at most ``max_connections``) for its
  duration, so SGLang's threads -- restarted by every ``/flush_cache`` and controller reset --
  never pile up client slots; the request <-> session table is
  :class:`kvsidecar.connector.session_registry.SessionRegistry`, whose lock (like the backend's
  counters' lock) is never held across a sidecar call.  Host pages are copied by the
  connection's ``KVCopier`` (block ids and piece sizes checked before a byte moves).
* ``sessions.enabled = false``: no sessions -- ``batch_exists`` restores the whole chain from
  L3 itself (SGLang's prefetch thread waits for the data), the behaviour before the plugin.
* When the sidecar is absent, dies or is slow, every call answers miss / False within its
  deadline and SGLang keeps serving; when to re-attach is the connector's one policy
  (``kvsidecar.connector.reconnect``, shared by the pool's threads): a restart is re-attached by
  the call that notices it, an absent sidecar tried again every ``reattach_every_s``.

The module holds the storage interface SGLang's threads call and what it shares (set-up,
the connection pool, keys, copies).  The request lifecycle the plugin drives from the scheduler
thread (``start_at_entry``, ``demand``, ``stop_for_prefill``, ``end``) is
:mod:`kvsidecar.connector.hicache_requests`; the generic whole-page interface (``exists``,
``get``, ``set`` and their batches) is :mod:`kvsidecar.connector.hicache_generic`.

Importable without SGLang (then it derives from a small stand-in base).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time

from kvsidecar._native.hashing import murmur3_128
from kvsidecar.shm.chain import span as chain_span
from kvsidecar.shm.layout import KVLayout

from .kv_client import KVConnector
from .hicache_layout import host_page_indices, layout_for_host_pool  # noqa: F401  (layout_for_host_pool: part of this API)
from .kv_copy import KVShapeError
from .hicache_generic import GenericPageInterface
from .hicache_requests import STOPS_ON_DEMAND, RequestLifecycle  # noqa: F401  (STOPS_ON_DEMAND: part of this API)
from .session_registry import SessionRef, SessionRegistry  # noqa: F401  (SessionRef: part of this API)
from .sglang_config import PluginConfig, load_plugin_config
from .background_calls import BackgroundCalls
from .thread_conns import ConnectionPool

try:  # pragma: no cover - exercised in the SGLang virtualenv
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except ImportError:  # the rest of the project does not need SGLang
    class _Base:
        """Stand-in for ``HiCacheStorage`` when SGLang is not installed."""

        def register_mem_pool_host(self, mem_pool_host):
            self.mem_pool_host = mem_pool_host

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class Binding:
    rid: str
    attempt: int


class KvSidecarHiCacheStorage(RequestLifecycle, GenericPageInterface, _Base):
    def __init__(self, storage_config, kwargs=None):
        self.config: PluginConfig = load_plugin_config(getattr(storage_config, "extra_config", None))
        cfg = self.config
        self.instance = cfg.instance
        self.namespace = cfg.namespace
        self.use_l3 = cfg.l3
        self.rank = storage_config.tp_rank
        self.tp_size = storage_config.tp_size
        self.is_mla = storage_config.is_mla_model
        self.writer = getattr(storage_config, "is_storage_writer", True)
        self.model_name = cfg.model or storage_config.model_name
        self.group = cfg.group or (f"sglang:{self.model_name}:tp{self.tp_size}"
                                   f":pp{getattr(storage_config, 'pp_rank', 0)}:dp{getattr(storage_config, 'dp_rank', 0)}")
        self.mem_pool_host = None
        self.layout: KVLayout | None = None
        self.conns: ConnectionPool | None = None
        self.plugin_driven = False  # set by kvsidecar.connector.sglang_plugin once its hooks are applied
        self.eta_source = None  # cost_aware: (rid, attempt) -> (eta_s, prefill_s_per_block), set by the plugin
        self.trace = None  # timeline: (rid, phase, t_start, t_end) on time.perf_counter, set by the plugin
        self._bound = threading.local()
        self._lock = threading.Lock()  # counters and _anon
        self.sessions = SessionRegistry()
        # end's abort is clean-up nobody waits for: off SGLang's scheduler thread (a round trip
        # there cost 0.2-6 ms per request under load), in order, never dropped
        self._aborts = BackgroundCalls(f"kvsidecar-abort-r{self.rank}")
        self._anon: dict[str, int] = {}
        self.counters = {"exists_calls": 0, "get_pages_ok": 0, "get_pages_missed": 0, "set_pages_ok": 0,
                         "set_pages_failed": 0, "degraded_calls": 0, "sessions_started": 0, "sessions_joined": 0,
                         "demands": 0, "demands_left_to_eta": 0, "settle_demands": 0, "settle_demands_ending": 0, "aborts": 0,
                         "aborts_inline": 0, "query_wait_timeouts": 0, "get_wait_timeouts": 0,
                         "copies_refused": 0, "entry_sessions": 0, "entry_nothing_to_restore": 0,
                         "entry_asked": 0, "entry_skipped": 0, "entry_kept_by_group": 0, "entry_errors": 0,
                         "entry_ended_unsubmitted": 0, "queries_answered_at_entry": 0}
        # SGLang's storage metrics (--enable-metrics): per batch_get / batch_set, the pages and
        # GB/s of this rank, handed over and cleared by each get_stats()
        self.storage_metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._io = {"prefetch_pgs": [], "prefetch_bandwidth": [], "backup_pgs": [], "backup_bandwidth": []}

    # -- set-up -------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.layout = layout_for_host_pool(mem_pool_host, self.model_name, self.is_mla, self.tp_size)
        ptrs, sizes = mem_pool_host.get_page_buffer_meta(host_page_indices(mem_pool_host, [0]))
        if sum(sizes) != self.layout.shard_bytes:
            raise ValueError(f"host pool page is {sum(sizes)} bytes, a layout shard is {self.layout.shard_bytes}")
        if len(set(sizes)) != 1:
            raise ValueError(f"host pool page buffers differ in size ({sorted(set(sizes))}); a shard is copied"
                             " as equal pieces")
        self.entries_per_page = len(ptrs)
        self.entry_bytes = sizes[0]
        self.seed = murmur3_128(b"kvsidecar-hicache-v2" + self.layout.fingerprint() + self.namespace.encode())
        cfg = self.config
        self.conns = ConnectionPool(
            lambda: KVConnector(self.instance, self.layout, rank=self.rank, group=self.group,
                                namespace=self.namespace, timeout_s=cfg.timeout_s, populate=cfg.populate,
                                verify_loads=cfg.verify_loads),
            max_connections=cfg.max_connections, reattach_every_s=cfg.reattach_every_s, wait_s=cfg.timeout_s,
            name=f"kvsidecar {self.instance!r} (rank {self.rank})")
        with self.conns.checkout() as conn:
            if conn is not None:
                log.info("kvsidecar backend: rank %d/%d attached to %s as group %r (sessions: policy %s, "
                         "chunk_max_blocks %s, budget %s; at most %d connections)", self.rank, self.tp_size,
                         self.instance, self.group, cfg.sessions.policy,
                         cfg.sessions.chunk_max_blocks or "sidecar default", cfg.sessions.budget_s or "sidecar formula",
                         cfg.max_connections)

    @contextlib.contextmanager
    def connection(self):
        """``with backend.connection() as c:`` -- a connection of this rank's pool for the
        calling thread (tools and tests); ``None`` while the sidecar is unavailable."""
        if self.conns is None:
            yield None
            return
        with self.conns.checkout() as conn:
            yield conn

    def _call(self, fn, default):
        """``fn(a connection checked out for this thread)``, or ``default`` (a miss) when the sidecar
        is unavailable: the pool's degrade-and-re-attach (``kvsidecar.connector.reconnect``)."""
        conns = self.conns
        if conns is None or self.mem_pool_host is None:
            self._count("degraded_calls")
            return default
        return conns.run(fn, default, on_miss=lambda: self._count("degraded_calls"))

    # -- request identity (bound by kvsidecar.connector.sglang_plugin around SGLang's storage calls) ------
    @contextlib.contextmanager
    def bind(self, rid: str, attempt: int = 0):
        """Calls from this thread inside the block belong to request ``rid`` (attempt ``attempt``)."""
        prev = getattr(self._bound, "value", None)
        self._bound.value = Binding(str(rid), int(attempt or 0))
        try:
            yield
        finally:
            self._bound.value = prev

    def _binding(self) -> Binding | None:
        return getattr(self._bound, "value", None)

    # -- keys and copies ----------------------------------------------------------------------------
    def _chain(self, keys) -> bytes:
        seed = self.seed
        return b"".join(murmur3_128(seed + k.encode()) for k in keys)

    def _copy(self, conn, blocks, host_indices, n_pages: int, to_host: bool) -> bool:
        """This rank's shard of ``blocks[:n_pages]`` to / from the host pages, one memcpy per buffer
        of each page, by the connection's ``KVCopier``, which checks block ids and piece sizes
        first: False (logged, counted; nothing copied) when it refuses."""
        ptrs, _sizes = self.mem_pool_host.get_page_buffer_meta(host_indices[: n_pages * self.layout.tokens_per_block])
        try:
            if to_host:
                conn.copier.load_pieces(blocks[:n_pages], ptrs, self.entry_bytes)
            else:
                conn.copier.save_pieces(blocks[:n_pages], ptrs, self.entry_bytes)
        except KVShapeError as exc:
            log.error("kvsidecar backend: copy %s the host pool refused: %s", "into" if to_host else "out of", exc)
            self._count("copies_refused")
            return False
        return True

    # -- sessions -------------------------------------------------------------------------------------
    def _identity(self, keys) -> tuple[str, int, bool]:
        """(rid, attempt, plugin-driven) for a query: the plugin's binding, else an id every rank
        derives alike (SPMD ranks query the same chains in the same order)."""
        b = self._binding()
        if b is not None:
            return b.rid, b.attempt, True
        tail = keys[-1]
        with self._lock:
            n = self._anon[tail] = self._anon.get(tail, -1) + 1
            if len(self._anon) > 65536:  # bounded: old chains are not queried again by this id
                self._anon.clear()
        return f"anon:{tail}:{len(keys)}:{n}", 0, False

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _session_for(self, keys) -> SessionRef | None:
        """The session whose chain holds ``keys`` as one consecutive span (the bound request's,
        else the latest one queried with them)."""
        b = self._binding()
        return self.sessions.for_keys(keys, (b.rid, b.attempt) if b is not None else None)

    # -- the v1 interface -------------------------------------------------------------------------
    def batch_exists(self, keys, extra_info=None) -> int:
        self._count("exists_calls")
        if not keys:
            return 0
        chain = self._chain(keys)
        if not self.use_l3:
            return self._call(lambda c: c.lookup(chain), 0)
        if not self.config.sessions.enabled:
            return min(len(keys), self._call(lambda c: _restore_then_lookup(c, chain, len(keys)), 0))
        rid, attempt, driven = self._identity(keys)
        s = self.config.sessions
        policy = s.policy if driven else "timeout"
        known = self.sessions.get(rid, attempt)
        if known is not None and known.terminal_prefix is not None and known.chain == chain:
            # started at queue entry and already terminal then (a pool hit cost_aware reads nothing
            # for): its prefix is final, so no second prefetch round trip on SGLang's query path
            self._count("queries_answered_at_entry")
            known.resident = True
            return min(len(keys), known.terminal_prefix)
        ref = SessionRef(rid, attempt, chain, {k: i for i, k in enumerate(keys)})
        if not self.sessions.open(ref):  # before the prefetch: a demand or end from the scheduler finds it
            return 0  # the request left before its query ran

        eta_s, prefill_s_per_block = (None, None)
        if policy == "cost_aware" and self.eta_source is not None:
            eta_s, prefill_s_per_block = self.eta_source(rid, attempt)

        trace = self.trace

        def run(c):
            t0 = time.perf_counter()
            view = self._start_session(c, ref, policy, len(keys), eta_s, prefill_s_per_block)
            demanded, ended = self.sessions.flags(ref)
            if ended:  # the scheduler was done with it while the prefetch was on its way
                c.abort(rid, attempt=attempt)
                return 0
            if demanded:  # (again: a demand sent before the prefetch arrived found no session)
                c.demand(rid, attempt=attempt)
            t1 = time.perf_counter()
            if view["state"] in ("created", "querying"):
                view = c.wait(rid, attempt=attempt, timeout_s=s.query_wait_s)
                if view.get("timed_out"):
                    self._count("query_wait_timeouts")
            if trace is not None:
                trace(rid, "prefetch", t0, t1)
                trace(rid, "query_wait", t1, time.perf_counter())
            if view["state"] == "terminal":
                ref.resident = True
                return view["prefix"]
            if view["state"] in ("created", "querying", "unknown"):
                ref.resident = True
                return view.get("published", 0)  # L3 did not answer in time: the resident prefix only
            # what the policy means to restore: SGLang fetches (and waits on its one I/O thread for)
            # exactly the hit it is told, so cost_aware's plan, not the whole L3 hit
            hit = view.get("planned", view["target"])
            ref.resident = view.get("published", 0) >= hit
            return hit

        hit = self._call(run, None)
        if hit is None:  # no sidecar: nothing to track
            self.sessions.discard(ref)
            return 0
        return min(len(keys), hit)

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list:
        n = len(keys)
        if n == 0:
            return []
        ref = self._session_for(keys)
        if ref is None:
            chain = self._chain(keys)

            def run(c):
                lease = c.get(chain)
                try:
                    got = c.verified(lease, 0, lease.count)  # a corrupt block cuts the hit there
                    if got and not self._copy(c, lease.blocks, host_indices, got, to_host=True):
                        got = 0
                finally:
                    c.release(lease)
                return got
        else:
            off = ref.positions[keys[0]]
            end = off + n

            trace = self.trace

            def run(c):
                t = [time.perf_counter()]
                view = c.wait(ref.rid, attempt=ref.attempt, until=end, timeout_s=self.config.sessions.get_wait_s)
                if view.get("timed_out"):
                    self._count("get_wait_timeouts")
                t.append(time.perf_counter())
                # group-consistent: every rank gets the same blocks for this batch of this request
                lease = c.get(chain_span(ref.chain, 0, end), req=ref.rid, attempt=ref.attempt or None, step=off)
                t.append(time.perf_counter())
                try:
                    got = c.verified(lease, off, max(0, min(lease.count, end) - off))
                    t.append(time.perf_counter())
                    if got and not self._copy(c, lease.blocks[off:off + got], host_indices, got, to_host=True):
                        got = 0
                    t.append(time.perf_counter())
                finally:
                    c.release(lease)
                if trace is not None and len(t) == 5:
                    t.append(time.perf_counter())
                    for phase, a, b in zip(("get_wait", "get", "verify", "copy", "release"), t, t[1:]):
                        trace(ref.rid, phase, a, b)
                return got

        t0 = time.perf_counter()
        got = self._call(run, 0)
        self._count("get_pages_ok", got)
        self._count("get_pages_missed", n - got)
        self._record_io("prefetch", got, time.perf_counter() - t0)
        return [i < got for i in range(n)]

    def _store(self, c, chain: bytes, keys):
        if self.layout.writers() > 1:  # every rank writes its shard of one staging: a group decision
            return c.store(chain, l3=self.use_l3, req=f"w:{keys[0][:24]}:{keys[-1][:24]}:{len(keys)}", step=0)
        return c.store(chain, l3=self.use_l3)

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list:
        n = len(keys)
        if n == 0:
            return []
        if not self.writer:  # MLA: rank 0 writes the one replicated shard
            return [True] * n
        t0 = time.perf_counter()
        chain = self._chain(keys)

        def run(c):
            st = self._store(c, chain, keys)
            if st.count:
                ok = True
                try:
                    idx = host_indices[st.start * self.layout.tokens_per_block:]
                    ok = self._copy(c, st.blocks, idx, st.count, to_host=False)
                except Exception:
                    log.exception("copy into staging failed")
                    ok = False
                c.commit(st, ok=ok)
                if not ok:
                    return [i < st.start for i in range(n)]
            # resident before, written now, or being written by another store: all present
            return [True] * n

        res = self._call(run, [False] * n)
        self._count("set_pages_ok", sum(res))
        self._count("set_pages_failed", n - sum(res))
        self._record_io("backup", sum(res), time.perf_counter() - t0)
        trace = self.trace
        if trace is not None:  # the timeline: a backup has no request id here (SGLang's backup thread)
            trace(f"backup:{n}:{keys[0][:16]}", "set", t0, time.perf_counter())
        return res

    def clear(self) -> None:
        """Drop every unpinned block of the CPU pool (L3 keeps its copies)."""
        self._call(lambda c: c.flush(), 0)

    def _record_io(self, kind: str, pages: int, seconds: float) -> None:
        """One batch_get ("prefetch") or batch_set ("backup") for SGLang's storage metrics."""
        if not self.storage_metrics or pages <= 0 or self.layout is None:
            return
        gbps = pages * self.layout.shard_bytes / max(seconds, 1e-9) / (1 << 30)
        with self._lock:
            self._io[f"{kind}_pgs"].append(pages)
            self._io[f"{kind}_bandwidth"].append(gbps)

    def get_stats(self):
        """SGLang's storage-metrics hook (called each scheduler iteration with ``--enable-metrics``):
        a ``StorageMetrics`` of the pages and bandwidth of every batch_get / batch_set since the
        last call (then cleared), or None without metrics.  kvsidecar's own counters: :meth:`stats`."""
        if not self.storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            io, self._io = self._io, {k: [] for k in self._io}
        return StorageMetrics(**io)

    def stats(self) -> dict:
        """kvsidecar's counters for this rank (calls, pages, sessions, entry decisions, aborts)
        and its connection pool's."""
        with self._lock:
            out = dict(self.counters)
        out["aborts_pending"] = self._aborts.pending()
        out["aborts_failed"] = self._aborts.failed
        if self.conns is not None:
            out.update({f"conn_{k}": v for k, v in self.conns.stats().items()})  # conn_connections, ...
        return out

    def close(self) -> None:
        self._aborts.close(self.config.timeout_s)
        if self.conns is not None:
            self.conns.close_all()
            self.conns = None


def _restore_then_lookup(c, chain: bytes, n: int) -> int:
    """Sessions disabled: the whole-chain restore on the calling thread (it waits for the data)."""
    hit = c.lookup(chain)
    if hit < n:
        c.restore(chain)
        hit = c.lookup(chain)
    return hit
