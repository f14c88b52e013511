"""Prometheus exposition of the sidecar (``prometheus-client``), mounted as one more service.

Off by default (``[metrics] enabled``); serves ``http://<host>:<port>/metrics`` (127.0.0.1):
prometheus-client's WSGI app on a threaded ``wsgiref`` server whose accept loop blocks until a
connection arrives (no periodic wake-up; ``stop`` wakes it with one connection).  Nothing here
runs on the control thread's request path:

* **Histograms** (session stop latency, drain, chunk, L3 read per block, elapsed; by policy) are
  observed when a session ends (:meth:`MetricsService.session_ended`, a session observer), once
  per session, never per request.
* **Everything else** is computed at scrape time from one snapshot that the control thread takes
  when a scrape asks for it (``Host.post``; the control thread owns all state, so the snapshot is
  consistent and nothing races it).  The scrape waits at most ``scrape_timeout_s``; past that it
  serves the last good snapshot and ``kvsidecar_scrape_stale`` says so (1).  The per-session
  outcome counts kept by :meth:`session_ended` are plain counters owned by the control thread
  and copied into that snapshot.

Labels are bounded sets only (policy, status, state, kind, cause, resource, tier, code, backend,
slot number): never a request id, a session id or exception text.
"""

from __future__ import annotations

import collections
import logging
import socket
import socketserver
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvsidecar.shm.errors import KvSidecarError

from kvsidecar.sidecar.observe.outcome import SessionObserver, SessionOutcome
from kvsidecar.sidecar.service import Host, Service

log = logging.getLogger(__name__)

POLICIES = ("wait_complete", "timeout", "best_effort", "cost_aware")
STATUSES = ("complete", "timeout", "demanded", "aborted", "failed", "limit", "cost", "no_hit")
SESSION_STATES = ("created", "querying", "running", "draining", "terminal")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PER_BLOCK_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)
# lease drop reasons (kvsidecar.sidecar.kv.leases) -> the cause an operator asks about
LEASE_CAUSES = {"released": "released", "handed_off": "handed_off", "expired": "ttl", "client_gone": "client_gone",
                "group_gone": "client_gone", "aborted": "aborted"}


class MetricsError(KvSidecarError):
    """The metrics endpoint cannot be served (e.g. its port is taken)."""


class MetricsService(Service, SessionObserver):
    def __init__(self, host: Host, cfg, *, core, tier=None, l3ops=None, generation: int = 0):
        self.host, self.cfg, self.core, self.tier, self.l3ops = host, cfg, core, tier, l3ops
        self.sessions = None  # wired by the composition root (connect)
        self.generation = generation
        self.block_bytes = core.index.block_bytes
        self.registry = CollectorRegistry()
        self._hist = {
            "stop": Histogram("kvsidecar_session_stop_latency_seconds", "Stop trigger (deadline, demand, abort) "
                              "to terminal, per session", ["policy"], buckets=LATENCY_BUCKETS, registry=self.registry),
            "drain": Histogram("kvsidecar_session_drain_seconds", "Seal to terminal (draining reads in flight)",
                               ["policy"], buckets=LATENCY_BUCKETS, registry=self.registry),
            "chunk": Histogram("kvsidecar_session_chunk_seconds", "Chunk claim to its data landed",
                               ["policy"], buckets=LATENCY_BUCKETS, registry=self.registry),
            "read": Histogram("kvsidecar_session_l3_read_seconds_per_block", "One L3 read's time over its blocks",
                              ["policy"], buckets=PER_BLOCK_BUCKETS, registry=self.registry),
            "elapsed": Histogram("kvsidecar_session_elapsed_seconds", "Session start to terminal",
                                 ["policy"], buckets=LATENCY_BUCKETS, registry=self.registry),
        }
        self._children: dict = {}  # (histogram, policy) -> labelled child (labels() costs a lock)
        # control thread only (copied into the scrape snapshot there)
        self._terminal = collections.Counter()  # (policy, status) -> sessions
        self._tokens = collections.Counter()  # ("requested", "") | ("hit", tier) -> tokens, sessions
        self.registry.register(_SnapshotCollector(self))
        self._lock = threading.Lock()
        self._last: dict | None = None
        self._pending = None  # (answered, box) of the snapshot request the control thread has not run yet
        self.scrapes = 0
        self.stale_scrapes = 0
        self._server = None
        self._thread = None
        self.port = 0

    def connect(self, *, sessions) -> None:
        """Wire the prefetch session manager (once; it is built after this service)."""
        if self.sessions is not None:
            raise RuntimeError("MetricsService is connected already")
        self.sessions = sessions

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> int:
        """Serve /metrics; returns the bound port."""
        server_cls = _Server6 if ":" in self.cfg.host else _Server
        try:
            self._server = server_cls((self.cfg.host, self.cfg.port), _QuietHandler)
        except OSError as exc:
            raise MetricsError(f"cannot serve metrics on {self.cfg.host}:{self.cfg.port}: {exc}") from None
        self._server.set_app(make_wsgi_app(self.registry))
        self._server.timeout = None  # handle_request blocks until a connection: no idle wake-ups
        self.port = self._server.server_address[1]
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="kvsidecar-metrics", daemon=True)
        self._thread.start()
        log.info("metrics on http://%s:%d/metrics", self.cfg.host, self.port)
        return self.port

    def _serve(self) -> None:
        while not self._stopping:
            self._server.handle_request()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop serving (bounded): the flag, then one connection to wake the blocked accept."""
        if self._server is None:
            return
        self._stopping = True
        try:
            with socket.create_connection((self.cfg.host, self.port), timeout=timeout_s):
                pass
        except OSError:
            pass  # nothing to wake: the loop is not blocked in accept
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("metrics server thread did not stop within %.1f s", timeout_s)
        self._server.server_close()
        self._server = None

    # -- the session observer (control thread) -----------------------------------------------------
    def session_ended(self, o: SessionOutcome) -> None:
        self._terminal[(o.policy, o.status)] += 1
        t = o.tokens_per_block
        self._tokens[("requested", "")] += o.blocks_total * t
        self._tokens[("hit", "cpu")] += o.blocks_resident * t
        self._tokens[("hit", "l3")] += max(o.blocks_target - o.blocks_resident, 0) * t
        if o.stop_latency_s is not None:
            self._child("stop", o.policy).observe(o.stop_latency_s)
        if o.drain_s is not None:
            self._child("drain", o.policy).observe(o.drain_s)
        self._child("elapsed", o.policy).observe(o.elapsed_s)
        if o.chunk_s:
            h = self._child("chunk", o.policy)
            for s in o.chunk_s:
                h.observe(s)
        if o.read_s_per_block:
            h = self._child("read", o.policy)
            for s in o.read_s_per_block:
                h.observe(s)

    def _child(self, name: str, policy: str):
        key = (name, policy)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._hist[name].labels(policy=policy)
        return child

    # -- service contract --------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            return {"metrics": {"port": self.port, "scrapes": self.scrapes, "stale_scrapes": self.stale_scrapes}}

    # -- snapshots ---------------------------------------------------------------------------------
    def control_snapshot(self) -> dict:
        """Everything a scrape reports, taken on the control thread (the owner of the state)."""
        host, core = self.host, self.core
        now = core.clock()
        kinds: dict = {}
        for lease in core.leases.leases.values():
            n, oldest = kinds.get(lease.kind, (0, 0.0))
            kinds[lease.kind] = (n + 1, max(oldest, now - lease.created))
        clients = []
        for conn in host.clients.values():
            clients.append((conn.slot, conn.attached, conn.submit.depth(), conn.completion.depth()))
        sess = self.sessions
        snap = {
            "counters": dict(host.counters),
            "pool": core.index.stats(),
            "reserved_limit_blocks": core.pool.reserved_limit_blocks,
            "pinned_limit_blocks": core.pool.pinned_limit_blocks,
            "refusals": dict(core.pool.refusals),
            "leases": kinds,
            "lease_counters": dict(core.leases.counters),
            "clients": clients,
            "sessions": dict(sess.counters) if sess is not None else {},
            "sessions_by_state": dict(collections.Counter(r.machine.state.value for r in sess.records.values()))
            if sess is not None else {},
            "orphans": len(sess.orphans) if sess is not None else 0,
            "terminal": dict(self._terminal),
            "tokens": dict(self._tokens),
            "tier": None,
        }
        if self.tier is not None:
            backend = self.tier.backend.stats()
            est = self.tier.cost.estimate()
            snap["tier"] = {"counters": dict(self.tier.counters), "backend": backend,
                            "read_s_per_block": self.tier.read_s_per_block,
                            "cost": (est.latency_s, est.s_per_block, est.samples, self.tier.cost.error)}
        if self.l3ops is not None:
            snap["l3ops"] = {"puts_in_flight": self.l3ops.puts_in_flight, "put_backlog": self.l3ops.put_backlog,
                             "loads_in_flight": self.l3ops.loads_in_flight}
        return snap

    def scrape_snapshot(self) -> tuple[dict, bool]:
        """(snapshot, stale): asks the control thread, waits at most ``scrape_timeout_s``.

        At most one request is outstanding: scrapes that arrive while the control thread has not
        answered yet wait on that same request (a stuck loop never accumulates posted work)."""
        with self._lock:
            pending = self._pending
            ask = pending is None
            if ask:
                pending = self._pending = (threading.Event(), {})
        if ask:
            self.host.post(self._take, pending)
        done, box = pending
        fresh = done.wait(self.cfg.scrape_timeout_s) and "snap" in box
        with self._lock:
            self.scrapes += 1
            if fresh:
                self._last = box["snap"]
                return box["snap"], False
            self.stale_scrapes += 1
            return (self._last or {}), True

    def _take(self, pending) -> None:  # control thread
        done, box = pending
        try:
            box["snap"] = self.control_snapshot()
        finally:
            with self._lock:
                if self._pending is pending:
                    self._pending = None
            done.set()


class _SnapshotCollector:
    """Turns one control-thread snapshot into metric families (runs on the HTTP thread)."""

    def __init__(self, svc: MetricsService):
        self.svc = svc

    def collect(self):
        svc = self.svc
        snap, stale = svc.scrape_snapshot()
        bb = svc.block_bytes
        yield _gauge("kvsidecar_up", "1 while the sidecar serves", 1)
        yield _gauge("kvsidecar_generation", "This incarnation's generation (bumped by every start)", svc.generation)
        yield _gauge("kvsidecar_scrape_stale", "1: the control thread did not answer in time; last snapshot served",
                     1 if stale else 0)
        if not snap:
            return
        c = snap["counters"]
        s = snap["sessions"]
        # -- sessions
        started = CounterMetricFamily("kvsidecar_sessions_started", "Prefetch sessions started", labels=["policy"])
        for p in sorted(set(POLICIES) | {k[8:] for k in s if k.startswith("started_")}):
            started.add_metric([p], s.get(f"started_{p}", 0))
        yield started
        term = CounterMetricFamily("kvsidecar_sessions_terminal", "Prefetch sessions ended, by policy and status",
                                   labels=["policy", "status"])
        seen = snap["terminal"]
        keys = {(p, st) for p in POLICIES for st in STATUSES} | set(seen)
        for p, st in sorted(keys):
            term.add_metric([p, st], seen.get((p, st), 0))
        yield term
        yield _labelled(GaugeMetricFamily, "kvsidecar_sessions", "Sessions by state now (terminal: kept for "
                        "their GET until retained_ttl_s)", "state",
                        {st: snap["sessions_by_state"].get(st, 0) for st in SESSION_STATES})
        yield _counter("kvsidecar_restored_blocks", "Blocks read from L3 and published (session: prefetch, "
                       "restore: the restore op)", {"session": s.get("restored_blocks", 0),
                                                     "restore": c.get("l3_restored_blocks", 0)}, "path")
        yield _counter("kvsidecar_restored_bytes", "Bytes of the restored blocks", {
            "session": s.get("restored_blocks", 0) * bb, "restore": c.get("l3_restored_blocks", 0) * bb}, "path")
        yield _counter("kvsidecar_blocks_withdrawn", "Blocks of queued reads withdrawn at a session's seal",
                       s.get("blocks_withdrawn", 0))
        yield _counter("kvsidecar_blocks_deduplicated", "Blocks a session awaited instead of reading twice",
                       s.get("blocks_deduplicated", 0))
        yield _counter("kvsidecar_reads_handed_over", "Queued reads a stopped session handed to waiters",
                       s.get("reads_handed_over", 0))
        yield _counter("kvsidecar_chunks_abandoned", "Reads left behind when the drain budget ran out",
                       s.get("chunks_abandoned", 0))
        yield _counter("kvsidecar_orphan_blocks", "Blocks of abandoned reads, resolved when the read ended",
                       {"published": s.get("orphan_blocks_published", 0),
                        "dropped": s.get("orphan_blocks_dropped", 0)}, "outcome")
        yield _gauge("kvsidecar_orphan_reads", "Abandoned reads still in flight", snap["orphans"])
        # -- bytes in and out, hits
        tier = snap["tier"]
        tc = tier["counters"] if tier else {}
        yield _counter("kvsidecar_l3_read_bytes", "Bytes read from L3 into the pool", tc.get("read_blocks_ok", 0) * bb)
        yield _counter("kvsidecar_engine_blocks", "Blocks leased to engine ranks by GET (each rank's answer)",
                       c.get("get_blocks", 0))
        yield _counter("kvsidecar_engine_bytes", "Bytes handed to the engine: each rank's leased blocks x the "
                       "shard it copies", c.get("get_blocks", 0) * svc.core.layout.shard_bytes)
        t = svc.core.layout.tokens_per_block
        tok = snap["tokens"]
        yield _counter("kvsidecar_lookup_requested_tokens", "Tokens asked about (source: lookup op, prefetch "
                       "session)", {"lookup": c.get("lookup_requested_blocks", 0) * t,
                                    "prefetch": tok.get(("requested", ""), 0)}, "source")
        hit = CounterMetricFamily("kvsidecar_lookup_hit_tokens", "Tokens of the contiguous hit prefix, by tier "
                                  "(cpu: the pool; l3: beyond it)", labels=["source", "tier"])
        hit.add_metric(["lookup", "cpu"], c.get("lookup_hit_blocks", 0) * t)
        hit.add_metric(["prefetch", "cpu"], tok.get(("hit", "cpu"), 0))
        hit.add_metric(["prefetch", "l3"], tok.get(("hit", "l3"), 0))
        yield hit
        # -- pool
        pool = snap["pool"]
        yield _labelled(GaugeMetricFamily, "kvsidecar_pool_blocks", "Pool blocks by state", "state", {
            "free": pool["free"], "staging": pool["staging"], "resident_pinned": pool["pinned"],
            "resident_unpinned": pool["resident"] - pool["pinned"]})
        yield _gauge("kvsidecar_reserved_bytes", "Staging not yet published", pool["staging"] * bb)
        yield _gauge("kvsidecar_reserved_limit_bytes", "limits.reserved_bytes_limit", snap["reserved_limit_blocks"] * bb)
        yield _gauge("kvsidecar_pinned_bytes", "Blocks pinned now", pool["pinned"] * bb)
        yield _gauge("kvsidecar_pinned_limit_bytes", "limits.pinned_bytes_limit", snap["pinned_limit_blocks"] * bb)
        ref = snap["refusals"]
        yield _counter("kvsidecar_capacity_stops", "Admissions refused or cut, by the resource that ran out",
                       {r: ref.get(r, 0) for r in sorted({"reserved", "pinned", "allocator"} | set(ref))}, "resource")
        yield _counter("kvsidecar_pool_evicted_blocks", "Blocks evicted (LRU, unpinned leaves)", pool["evicted"])
        # -- leases
        kinds = snap["leases"]
        all_kinds = sorted({"get", "prefetch", "l3_put", "store_prefix", "restore_prefix"} | set(kinds))
        yield _labelled(GaugeMetricFamily, "kvsidecar_leases", "Leases live, by kind", "kind",
                        {k: kinds.get(k, (0, 0.0))[0] for k in all_kinds})
        yield _labelled(GaugeMetricFamily, "kvsidecar_lease_oldest_age_seconds", "Age of the oldest live lease, "
                        "by kind (0: none)", "kind", {k: kinds.get(k, (0, 0.0))[1] for k in all_kinds})
        causes = collections.Counter({v: 0 for v in LEASE_CAUSES.values()})
        causes["internal"] = 0
        for k, v in snap["lease_counters"].items():
            if k.startswith("dropped_"):
                causes[LEASE_CAUSES.get(k[8:], "internal")] += v
        yield _counter("kvsidecar_leases_released", "Leases dropped, by cause (internal: a store/restore/L3 PUT "
                       "ended its own)", dict(causes), "cause")
        # -- clients and transport
        ring = GaugeMetricFamily("kvsidecar_ring_depth_bytes", "Bytes queued per client slot ring",
                                 labels=["slot", "ring"])
        for slot, _attached, sub, comp in snap["clients"]:
            ring.add_metric([str(slot), "submit"], sub)
            ring.add_metric([str(slot), "completion"], comp)
        yield ring
        yield _gauge("kvsidecar_clients_attached", "Clients attached now", sum(1 for cl in snap["clients"] if cl[1]))
        yield _counter("kvsidecar_clients_reclaimed", "Clients whose death the sidecar saw and cleaned up",
                       c.get("clients_reclaimed", 0))
        yield _counter("kvsidecar_slot_exhaustions", "Attaches refused because every client slot was taken",
                       c.get("slot_exhaustions", 0))
        yield _counter("kvsidecar_requests", "Requests served (every op)", c.get("requests", 0))
        codes = {k[7:]: v for k, v in c.items() if k.startswith("errors_")}
        yield _counter("kvsidecar_protocol_errors", "Error completions, by code", codes, "code")
        # -- L3
        if tier:
            backend = tier["backend"]
            name = str(backend.get("backend", "l3"))
            errs = CounterMetricFamily("kvsidecar_l3_errors", "L3 failures, by backend and code", labels=["backend", "code"])
            errs.add_metric([name, "lookup_error"], tc.get("lookup_errors", 0))
            errs.add_metric([name, "read_failed_blocks"], tc.get("read_blocks_failed", 0))
            errs.add_metric([name, "write_failed_blocks"], tc.get("put_blocks_failed", 0))
            for k, v in sorted(backend.items()):
                if k.startswith("err_") or k in ("read_corrupt", "write_error", "write_too_big"):
                    errs.add_metric([name, k[4:] if k.startswith("err_") else k], v)
            yield errs
            yield _counter("kvsidecar_l3_put_blocks", "Write-behind blocks: published, failed, skipped (L3 behind)",
                           {"published": c.get("l3_published_blocks", 0), "failed": c.get("l3_put_failed_blocks", 0),
                            "skipped": c.get("l3_put_skipped_blocks", 0)}, "result")
            per_block = tier["read_s_per_block"]
            if per_block:
                yield _gauge("kvsidecar_l3_read_seconds_per_block_estimate", "The cost model's running estimate "
                             "of one block's L3 read (EWMA)", per_block)
                yield _gauge("kvsidecar_l3_read_bandwidth_bytes_per_second_estimate", "Block bytes over that "
                             "estimate", bb / per_block)
            latency, s_block, samples, error = tier["cost"]
            yield _gauge("kvsidecar_l3_cost_latency_seconds", "The read-cost model's fixed cost of one L3 read "
                         "(cost_aware's input; the prior until reads are seen)", latency)
            yield _gauge("kvsidecar_l3_cost_seconds_per_block", "The read-cost model's per-block cost", s_block)
            yield _gauge("kvsidecar_l3_cost_bandwidth_bytes_per_second", "Block bytes over that per-block cost",
                         bb / s_block if s_block > 0 else 0.0)
            yield _gauge("kvsidecar_l3_cost_samples", "Reads the read-cost model has seen (0: the prior alone)", samples)
            yield _gauge("kvsidecar_l3_cost_relative_error", "Mean |predicted - measured| / measured of its "
                         "predictions", error)
            ops = snap.get("l3ops")
            if ops:
                yield _gauge("kvsidecar_l3_puts_in_flight", "Write-behind PUTs in flight", ops["puts_in_flight"])
                yield _gauge("kvsidecar_l3_loads_in_flight", "Restore reads in flight", ops["loads_in_flight"])


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds up the sidecar's exit


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the stdlib's name)
        return None  # scrapes are not worth a log line each


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, values, label: str | None = None) -> CounterMetricFamily:
    if label is None:
        return CounterMetricFamily(name, doc, value=values)
    return _labelled(CounterMetricFamily, name, doc, label, values)


def _labelled(cls, name: str, doc: str, label: str, values: dict):
    fam = cls(name, doc, labels=[label])
    for k, v in values.items():
        fam.add_metric([str(k)], v)
    return fam
