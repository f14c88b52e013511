"""Prometheus exposition of the sidecar (``prometheus-client``), mounted as one more service.

Off by default (``[metrics] enabled``); serves ``http://<host>:<port>/metrics`` (127.0.0.1):
prometheus-client's WSGI app on a threaded ``wsgiref`` server whose accept loop blocks until a
connection arrives (no periodic wake-up; ``stop`` wakes it with one connection).  Nothing here
runs on the control thread's request path:

* **Histograms** (session stop latency, drain, chunk, L3 read per block, elapsed; by policy) are
  observed when a session ends (:meth:`MetricsService.session_ended`, a session observer), once
  per session, never per request.
* **Everything else** is computed at scrape time from one ``SidecarSnapshot``
  (``kvsidecar.sidecar.observe.snapshot``, the same one the ``stats`` op and the inspector render)
  that the control thread takes when a scrape asks for it (``Host.post``; the control thread owns
  all state, so the snapshot is consistent and nothing races it).  The series are one table,
  :data:`METRICS` (name, help, kind, getter, labels), label values taken from the enums.  The scrape waits at most ``scrape_timeout_s``; past that it
  serves the last good snapshot and ``kvsidecar_scrape_stale`` says so (1).  The per-session
  outcome counts kept by :meth:`session_ended` are plain counters owned by the control thread
  and copied into that snapshot.

Labels are bounded sets only (policy, status, state, kind, cause, resource, tier, code, backend,
slot number, the control thread's work -- op and function names from the code): never a request
id, a session id or exception text.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import socket
import socketserver
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvsidecar.shm.errors import KvSidecarError

from kvsidecar.sidecar.observe.outcome import SessionObserver, SessionOutcome
from kvsidecar.sidecar.observe.snapshot import LeaseCause, MetricsSnapshot, Policy, Resource, SidecarSnapshot, Status
from kvsidecar.sidecar.service import Host, Service

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PER_BLOCK_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0)


class MetricsError(KvSidecarError):
    """The metrics endpoint cannot be served (e.g. its port is taken)."""


class MetricsService(Service, SessionObserver):
    def __init__(self, host: Host, cfg, *, core, tier=None, l3ops=None, generation: int = 0):
        """``core`` gives the layout's sizes; every figure comes from ``host.snapshot()`` (``tier``,
        ``l3ops`` and the sessions wired by :meth:`connect` are mounted services: they are in it)."""
        self.host, self.cfg = host, cfg
        self.generation = generation
        self.block_bytes = core.index.block_bytes
        self.shard_bytes = core.layout.shard_bytes
        self.tokens_per_block = core.layout.tokens_per_block
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
    def snapshot(self) -> MetricsSnapshot:
        with self._lock:
            scrapes, stale = self.scrapes, self.stale_scrapes
        return MetricsSnapshot(port=self.port, scrapes=scrapes, stale_scrapes=stale, terminal=dict(self._terminal),
                               tokens=dict(self._tokens))

    # -- snapshots ---------------------------------------------------------------------------------
    def control_snapshot(self) -> SidecarSnapshot:
        """Everything a scrape reports, taken on the control thread (the owner of the state)."""
        return self.host.snapshot()

    def scrape_snapshot(self) -> tuple[SidecarSnapshot | None, bool]:
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
            return self._last, True

    def _take(self, pending) -> None:  # control thread
        done, box = pending
        try:
            box["snap"] = self.control_snapshot()
        finally:
            with self._lock:
                if self._pending is pending:
                    self._pending = None
            done.set()


@dataclasses.dataclass(frozen=True)
class Metric:
    """One series family: ``getter(snapshot, service)`` returns the value (no labels), a dict
    {label value(s): value} (with ``labels``), or None (not reported now).  ``part``: the snapshot
    part it needs (skipped when that service is not mounted)."""

    name: str
    help: str
    kind: str  # "gauge" | "counter"
    getter: object
    labels: tuple = ()
    part: str | None = None


def _g(name, doc, getter, labels=(), part=None):
    return Metric(name, doc, "gauge", getter, tuple(labels), part)


def _c(name, doc, getter, labels=(), part=None):
    return Metric(name, doc, "counter", getter, tuple(labels), part)


def _loop(s: SidecarSnapshot, name: str) -> int:
    return s.loop.counters.get(name, 0)


def _sess(s: SidecarSnapshot, name: str) -> int:
    return s.sessions.count(name) if s.sessions is not None else 0


def _tier(s: SidecarSnapshot, name: str) -> int:
    return s.l3.counters.get(name, 0) if s.l3 is not None else 0


def _terminal(s: SidecarSnapshot) -> dict:
    seen = s.metrics.terminal if s.metrics is not None else {}
    keys = {(p.value, st.value) for p in Policy for st in Status} | set(seen)
    return {k: seen.get(k, 0) for k in sorted(keys)}


def _tokens(s: SidecarSnapshot, key: tuple) -> int:
    return s.metrics.tokens.get(key, 0) if s.metrics is not None else 0


def _capacity_stops(s: SidecarSnapshot) -> dict:
    ref = s.kv.refusals
    return {r: ref.get(r, 0) for r in sorted({x.value for x in Resource} | set(ref))}


def _ring_depths(s: SidecarSnapshot) -> dict:
    out = {}
    for c in s.loop.clients:
        out[(str(c.slot), "submit")] = c.submit_depth
        out[(str(c.slot), "completion")] = c.completion_depth
    return out


# the L3 backend's own failure counters that are reported as codes (the backend names them)
_BACKEND_ERRORS = ("read_corrupt", "write_error", "write_too_big")


def _l3_errors(s: SidecarSnapshot) -> dict:
    name, tc, backend = s.l3.backend_name, s.l3.counters, s.l3.backend
    out = {(name, "lookup_error"): tc.get("lookup_errors", 0),
           (name, "read_failed_blocks"): tc.get("read_blocks_failed", 0),
           (name, "write_failed_blocks"): tc.get("put_blocks_failed", 0)}
    for k, v in sorted(backend.items()):
        if k.startswith("err_"):  # Mooncake's error codes, by the backend's own name for them
            out[(name, k[4:])] = v
        elif k in _BACKEND_ERRORS:
            out[(name, k)] = v
    return out


def _per_block(s: SidecarSnapshot):
    return s.l3.read_s_per_block or None


def _bandwidth(bb: int, s_per_block) -> float:
    return bb / s_per_block if s_per_block and s_per_block > 0 else 0.0


METRICS: tuple[Metric, ...] = (
    # -- sessions
    _c("kvsidecar_sessions_started", "Prefetch sessions started",
       lambda s, m: {p.value: s.sessions.started.get(p, 0) for p in Policy}, ["policy"], "sessions"),
    _c("kvsidecar_sessions_terminal", "Prefetch sessions ended, by policy and status",
       lambda s, m: _terminal(s), ["policy", "status"], "sessions"),
    _g("kvsidecar_sessions", "Sessions by state now (terminal: kept for their GET until retained_ttl_s)",
       lambda s, m: {st.value: n for st, n in s.sessions.by_state().items()}, ["state"], "sessions"),
    _c("kvsidecar_restored_blocks", "Blocks read from L3 and published (session: prefetch, restore: the restore op)",
       lambda s, m: {"session": _sess(s, "restored_blocks"), "restore": _loop(s, "l3_restored_blocks")}, ["path"]),
    _c("kvsidecar_restored_bytes", "Bytes of the restored blocks",
       lambda s, m: {"session": _sess(s, "restored_blocks") * m.block_bytes,
                     "restore": _loop(s, "l3_restored_blocks") * m.block_bytes}, ["path"]),
    _c("kvsidecar_blocks_withdrawn", "Blocks of queued reads withdrawn at a session's seal",
       lambda s, m: _sess(s, "blocks_withdrawn")),
    _c("kvsidecar_blocks_deduplicated", "Blocks a session awaited instead of reading twice",
       lambda s, m: _sess(s, "blocks_deduplicated")),
    _c("kvsidecar_reads_handed_over", "Queued reads a stopped session handed to waiters",
       lambda s, m: _sess(s, "reads_handed_over")),
    _c("kvsidecar_blocks_superseded", "Blocks of session reads an engine store took over (read: queued, withdrawn; "
       "in_flight, its blocks freed when it ends)",
       lambda s, m: {"queued": _sess(s, "blocks_superseded") - _sess(s, "blocks_superseded_in_flight"),
                     "in_flight": _sess(s, "blocks_superseded_in_flight")}, ["read"]),
    _c("kvsidecar_chunks_abandoned", "Reads left behind when the drain budget ran out",
       lambda s, m: _sess(s, "chunks_abandoned")),
    _c("kvsidecar_orphan_blocks", "Blocks of abandoned reads, resolved when the read ended",
       lambda s, m: {"published": _sess(s, "orphan_blocks_published"), "dropped": _sess(s, "orphan_blocks_dropped")},
       ["outcome"]),
    _g("kvsidecar_orphan_reads", "Abandoned reads still in flight",
       lambda s, m: s.sessions.orphans if s.sessions is not None else 0),
    # -- bytes in and out, hits
    _c("kvsidecar_l3_read_bytes", "Bytes read from L3 into the pool",
       lambda s, m: _tier(s, "read_blocks_ok") * m.block_bytes),
    _c("kvsidecar_engine_blocks", "Blocks leased to engine ranks by GET (each rank's answer)",
       lambda s, m: _loop(s, "get_blocks")),
    _c("kvsidecar_engine_bytes", "Bytes handed to the engine: each rank's leased blocks x the shard it copies",
       lambda s, m: _loop(s, "get_blocks") * m.shard_bytes),
    _c("kvsidecar_lookup_requested_tokens", "Tokens asked about (source: lookup op, prefetch session)",
       lambda s, m: {"lookup": _loop(s, "lookup_requested_blocks") * m.tokens_per_block,
                     "prefetch": _tokens(s, ("requested", ""))}, ["source"]),
    _c("kvsidecar_lookup_hit_tokens", "Tokens of the contiguous hit prefix, by tier (cpu: the pool; l3: beyond it)",
       lambda s, m: {("lookup", "cpu"): _loop(s, "lookup_hit_blocks") * m.tokens_per_block,
                     ("prefetch", "cpu"): _tokens(s, ("hit", "cpu")), ("prefetch", "l3"): _tokens(s, ("hit", "l3"))},
       ["source", "tier"]),
    # -- pool
    _g("kvsidecar_pool_blocks", "Pool blocks by state",
       lambda s, m: {st.value: n for st, n in s.kv.pool.by_state().items()}, ["state"], "kv"),
    _g("kvsidecar_reserved_bytes", "Staging not yet published", lambda s, m: s.kv.pool.staging * m.block_bytes,
       part="kv"),
    _g("kvsidecar_reserved_limit_bytes", "limits.reserved_bytes_limit",
       lambda s, m: s.kv.pool.reserved_limit_blocks * m.block_bytes, part="kv"),
    _g("kvsidecar_pinned_bytes", "Blocks pinned now", lambda s, m: s.kv.pool.pinned * m.block_bytes, part="kv"),
    _g("kvsidecar_pinned_limit_bytes", "limits.pinned_bytes_limit",
       lambda s, m: s.kv.pool.pinned_limit_blocks * m.block_bytes, part="kv"),
    _c("kvsidecar_capacity_stops", "Admissions refused or cut, by the resource that ran out",
       lambda s, m: _capacity_stops(s), ["resource"], "kv"),
    _c("kvsidecar_pool_evicted_blocks", "Blocks evicted (LRU, unpinned leaves)", lambda s, m: s.kv.pool.evicted,
       part="kv"),
    # -- leases
    _g("kvsidecar_leases", "Leases live, by kind",
       lambda s, m: {k: v[0] for k, v in sorted(s.kv.leases_by_kind().items())}, ["kind"], "kv"),
    _g("kvsidecar_lease_oldest_age_seconds", "Age of the oldest live lease, by kind (0: none)",
       lambda s, m: {k: v[1] for k, v in sorted(s.kv.leases_by_kind().items())}, ["kind"], "kv"),
    _c("kvsidecar_leases_released", "Leases dropped, by cause (internal: a store/restore/L3 PUT ended its own)",
       lambda s, m: {c.value: s.kv.lease_drops.get(c, 0) for c in LeaseCause}, ["cause"], "kv"),
    # -- clients and transport
    _g("kvsidecar_ring_depth_bytes", "Bytes queued per client slot ring", lambda s, m: _ring_depths(s),
       ["slot", "ring"]),
    _g("kvsidecar_clients_attached", "Clients attached now", lambda s, m: sum(1 for c in s.loop.clients if c.attached)),
    _c("kvsidecar_clients_reclaimed", "Clients whose death the sidecar saw and cleaned up",
       lambda s, m: _loop(s, "clients_reclaimed")),
    _c("kvsidecar_slot_exhaustions", "Attaches refused because every client slot was taken",
       lambda s, m: _loop(s, "slot_exhaustions")),
    _c("kvsidecar_requests", "Requests served (every op)", lambda s, m: _loop(s, "requests")),
    _c("kvsidecar_control_busy_seconds", "The control thread's time (wall) by what it ran: op:<op>, "
       "event:<function>, timer:<function> (names from the code: a bounded set)",
       lambda s, m: {k: v[1] for k, v in sorted(s.loop.busy.items())}, ["work"]),
    _c("kvsidecar_control_busy_runs", "How many times the control thread ran each of them",
       lambda s, m: {k: v[0] for k, v in sorted(s.loop.busy.items())}, ["work"]),
    _c("kvsidecar_protocol_errors", "Error completions, by code", lambda s, m: s.loop.error_counts(), ["code"]),
    # -- L3
    _c("kvsidecar_l3_errors", "L3 failures, by backend and code", lambda s, m: _l3_errors(s), ["backend", "code"],
       "l3"),
    _c("kvsidecar_l3_put_blocks", "Write-behind blocks: published, failed, skipped (L3 behind), gated (L3 too "
       "slow to pay); present: published without a write, L3 held them already",
       lambda s, m: {"published": _loop(s, "l3_published_blocks"), "failed": _loop(s, "l3_put_failed_blocks"),
                     "skipped": _loop(s, "l3_put_skipped_blocks"), "gated": _loop(s, "l3_put_gated_blocks"),
                     "present": _tier(s, "put_blocks_present")},
       ["result"], "l3"),
    _g("kvsidecar_l3_write_behind_open", "1 while stores are written behind to L3, 0 while paused because a "
       "block reads in more than l3.write_behind_max_ratio times its prefill",
       lambda s, m: int(s.l3.write_gate["open"]) if s.l3.write_gate is not None else 1, part="l3"),
    _g("kvsidecar_l3_read_seconds_per_block_estimate", "The cost model's running estimate of one block's L3 read "
       "(EWMA)", lambda s, m: _per_block(s), part="l3"),
    _g("kvsidecar_l3_read_bandwidth_bytes_per_second_estimate", "Block bytes over that estimate",
       lambda s, m: m.block_bytes / _per_block(s) if _per_block(s) else None, part="l3"),
    _g("kvsidecar_l3_cost_latency_seconds", "The read-cost model's fixed cost of one L3 read (cost_aware's input; "
       "the prior until reads are seen)", lambda s, m: s.l3.cost.latency_s, part="l3"),
    _g("kvsidecar_l3_cost_seconds_per_block", "The read-cost model's per-block cost",
       lambda s, m: s.l3.cost.s_per_block, part="l3"),
    _g("kvsidecar_l3_cost_bandwidth_bytes_per_second", "Block bytes over that per-block cost",
       lambda s, m: _bandwidth(m.block_bytes, s.l3.cost.s_per_block), part="l3"),
    _g("kvsidecar_l3_cost_samples", "Reads the read-cost model has seen (0: the prior alone)",
       lambda s, m: s.l3.cost.samples, part="l3"),
    _g("kvsidecar_l3_cost_relative_error", "Mean |predicted - measured| / measured of its predictions",
       lambda s, m: s.l3.cost.error, part="l3"),
    _g("kvsidecar_l3_puts_in_flight", "Write-behind PUTs in flight", lambda s, m: s.l3.puts_in_flight, part="l3"),
    _g("kvsidecar_l3_loads_in_flight", "Restore reads in flight", lambda s, m: s.l3.loads_in_flight, part="l3"),
)


def family(metric: Metric, value):
    """The prometheus-client family of one table row and its getter's value."""
    cls = GaugeMetricFamily if metric.kind == "gauge" else CounterMetricFamily
    if not metric.labels:
        return cls(metric.name, metric.help, value=value)
    fam = cls(metric.name, metric.help, labels=list(metric.labels))
    for key, v in value.items():
        fam.add_metric([str(k) for k in key] if isinstance(key, tuple) else [str(key)], v)
    return fam


class _SnapshotCollector:
    """Renders :data:`METRICS` from one control-thread snapshot (runs on the HTTP thread)."""

    def __init__(self, svc: MetricsService):
        self.svc = svc

    def collect(self):
        svc = self.svc
        snap, stale = svc.scrape_snapshot()
        yield GaugeMetricFamily("kvsidecar_up", "1 while the sidecar serves", value=1)
        yield GaugeMetricFamily("kvsidecar_generation", "This incarnation's generation (bumped by every start)",
                                value=svc.generation)
        yield GaugeMetricFamily("kvsidecar_scrape_stale", "1: the control thread did not answer in time; last "
                                "snapshot served", value=1 if stale else 0)
        if snap is None:
            return
        for metric in METRICS:
            if metric.part is not None and getattr(snap, metric.part) is None:
                continue
            value = metric.getter(snap, svc)
            if value is not None:
                yield family(metric, value)


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds up the sidecar's exit


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 (the stdlib's name)
        return None  # scrapes are not worth a log line each
