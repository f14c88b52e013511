"""Prometheus exposition (kvsidecar.sidecar.observe.metrics) against real sidecars: the series an operator
reads, scraped over HTTP, checked against the simulator's own totals and the sidecar's books."""

from __future__ import annotations

import collections
import threading
import time
import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.connector.client import SidecarClient
from kvsidecar.connector.kv_client import KVConnector
from kvsidecar.shm.errors import RemoteError
from kvsidecar.shm.layout import KVLayout
from kvsidecar.sidecar import inspector

from ..helpers import file_l3_overrides, store_to_l3, wait_terminal
from ..waiting import wait_until

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=4, tp_size=1)
N = 48
TOKENS = list(range(4 * N))
METRICS_ON = {"metrics.enabled": True, "metrics.port": 0}


def scrape(port: int) -> dict:
    """{(name, sorted label items): value} of one /metrics scrape."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels) -> float:
    return m[(name, tuple(sorted(labels.items())))]


def total(m: dict, name: str, **labels) -> float:
    """Sum over every series of ``name`` whose labels include ``labels``."""
    return sum(v for (n, lab), v in m.items() if n == name and set(labels.items()) <= set(lab))


def metrics_port(instance: str, timeout_s: float = 20.0) -> int:
    """The bound port, read from the stats the sidecar publishes (read-only, no request)."""
    return wait_until(lambda: inspector.snapshot(instance)["stats"].get("metrics", {}).get("port"), timeout_s,
                      "the metrics port published")


def overrides(tmp_path, **extra):
    # (no calibration at start: these count every L3 read and error exactly; it has its own test)
    return file_l3_overrides(tmp_path, LAY, 160, **{"l3.calibration_blocks": 0, **extra})


def test_metrics_are_off_by_default(sidecar, instance):
    with SidecarClient(instance) as c:
        assert "metrics" not in c.call("stats")["stats"]


def test_series_follow_leases_sessions_errors_and_clients(sidecar_factory, instance, tmp_path):
    torch.manual_seed(0)
    kv = [tuple(torch.randn(N, 4, 2, 16).half() for _ in range(2)) for _ in range(2)]
    sidecar_factory(**overrides(tmp_path, **METRICS_ON))
    port = metrics_port(instance)
    m = scrape(port)
    assert value(m, "kvsidecar_up") == 1 and value(m, "kvsidecar_scrape_stale") == 0
    assert value(m, "kvsidecar_generation") > 0 and value(m, "kvsidecar_clients_attached") == 0
    assert value(m, "kvsidecar_pool_blocks", state="free") == 160
    with KVConnector(instance, LAY, group="m") as c:
        chain, _ = store_to_l3(c, kv, TOKENS)
        lease = c.get(chain)
        with pytest.raises(RemoteError):
            c.client.call("release", lease=12345)  # never issued: UNKNOWN_ID
        m = scrape(port)
        assert value(m, "kvsidecar_clients_attached") == 1
        assert value(m, "kvsidecar_leases", kind="get") == 1
        assert value(m, "kvsidecar_lease_oldest_age_seconds", kind="get") > 0
        assert value(m, "kvsidecar_pinned_bytes") == N * LAY.block_bytes
        assert value(m, "kvsidecar_pool_blocks", state="resident_pinned") == N
        assert value(m, "kvsidecar_protocol_errors_total", code="unknown_id") == 1
        assert value(m, "kvsidecar_engine_blocks_total") == N
        assert value(m, "kvsidecar_engine_bytes_total") == N * LAY.block_bytes
        assert value(m, "kvsidecar_l3_put_blocks_total", result="published") == N
        assert value(m, "kvsidecar_l3_put_blocks_total", result="present") == 0  # L3 had none of them
        assert value(m, "kvsidecar_l3_put_blocks_total", result="gated") == 0
        assert value(m, "kvsidecar_l3_write_behind_open") == 1  # (no engine reported a prefill cost)
        slot = c.client.slot
        assert ("kvsidecar_ring_depth_bytes", (("ring", "submit"), ("slot", str(slot)))) in m
        c.release(lease)
        assert c.lookup(chain) == N
        c.flush()  # the chain is only in L3 now
        c.prefetch(chain, "r1", policy="wait_complete")
        p = wait_terminal(c, "r1")
        assert p["status"] == "complete" and p["restored"] == N
        c.abort("r1")  # drops its result lease (cause: aborted)
        m = scrape(port)
    assert value(m, "kvsidecar_sessions_started_total", policy="wait_complete") == 1
    assert value(m, "kvsidecar_sessions_terminal_total", policy="wait_complete", status="complete") == 1
    assert total(m, "kvsidecar_sessions_terminal_total") == 1
    assert value(m, "kvsidecar_restored_blocks_total", path="session") == N
    assert value(m, "kvsidecar_restored_bytes_total", path="session") == N * LAY.block_bytes
    assert value(m, "kvsidecar_l3_read_bytes_total") == N * LAY.block_bytes
    assert value(m, "kvsidecar_lookup_requested_tokens_total", source="lookup") == N * 4
    assert value(m, "kvsidecar_lookup_hit_tokens_total", source="lookup", tier="cpu") == N * 4
    assert value(m, "kvsidecar_lookup_hit_tokens_total", source="prefetch", tier="l3") == N * 4
    assert value(m, "kvsidecar_lookup_hit_tokens_total", source="prefetch", tier="cpu") == 0
    assert value(m, "kvsidecar_session_elapsed_seconds_count", policy="wait_complete") == 1
    assert value(m, "kvsidecar_session_chunk_seconds_count", policy="wait_complete") == 1  # one whole read
    assert value(m, "kvsidecar_session_l3_read_seconds_per_block_count", policy="wait_complete") == 1
    assert value(m, "kvsidecar_l3_read_seconds_per_block_estimate") > 0
    assert value(m, "kvsidecar_l3_cost_samples") == 1 and value(m, "kvsidecar_l3_cost_seconds_per_block") > 0
    assert value(m, "kvsidecar_l3_cost_bandwidth_bytes_per_second") > 0
    assert value(m, "kvsidecar_leases_released_total", cause="released") == 1
    assert value(m, "kvsidecar_leases_released_total", cause="aborted") == 1
    assert total(m, "kvsidecar_leases") == 0 and value(m, "kvsidecar_reserved_bytes") == 0
    assert value(m, "kvsidecar_clients_attached") == 1
    assert total(m, "kvsidecar_l3_errors_total") == 0
    assert value(m, "kvsidecar_scrape_stale") == 0
    # the control thread's time: every op run once per call (the refused release too), the
    # session's landed read as a posted event, each with seconds beside its count
    assert value(m, "kvsidecar_control_busy_runs_total", work="op:release") == 2
    assert value(m, "kvsidecar_control_busy_runs_total", work="op:get") == 1
    assert value(m, "kvsidecar_control_busy_runs_total", work="op:prefetch") == 1
    assert value(m, "kvsidecar_control_busy_runs_total", work="event:SessionManager._chunk_done") == 1
    assert value(m, "kvsidecar_control_busy_seconds_total", work="op:get") > 0
    assert all(k[1][0][1].split(":", 1)[0] in ("op", "event", "timer")
               for k in m if k[0] == "kvsidecar_control_busy_seconds_total")
    # the slot is freed once the detach ack is consumed
    wait_until(lambda: value(scrape(port), "kvsidecar_clients_attached"), 10, "the detached client uncounted",
               until=lambda n: n == 0)


def test_scrape_during_simulator_run_matches_its_totals():
    """Two policy arms of the engine simulator (TP=2 rank processes, warm L3, cold pool) with
    metrics on; /metrics is scraped while the ranks run and once after, before the sidecar stops."""
    from scripts import simulate

    scrapes: dict = collections.defaultdict(list)  # arm -> [(ranks done?, metrics)]
    errors: list = []

    def watch(arm: str, instance: str, ranks_done: threading.Event) -> None:
        try:
            port = metrics_port(instance)
            while not ranks_done.wait(0.25):
                scrapes[arm].append((False, scrape(port)))
            scrapes[arm].append((True, scrape(port)))
        except Exception as exc:  # reported by the test thread
            errors.append(repr(exc))

    arms = ["timeout_chunk32", "best_effort"]
    res = simulate.simulate(True, budget_s=0.25, arms=arms, prefix_tokens=4096, requests=6,
                            sidecar_overrides=METRICS_ON, while_running=watch)
    assert errors == []
    T = 64
    for arm in arms:
        a = res["arms"][arm]
        assert a["invariants"] == "" and a["corrupt"] == 0 and a["ranks_agree"]
        runs = scrapes[arm]
        assert runs and runs[-1][0] and any(not done for done, _ in runs), "no scrape while the ranks ran"
        final = runs[-1][1]
        policy = a["policy"]
        assert all(value(m, "kvsidecar_scrape_stale") == 0 for _, m in runs)
        started = [value(m, "kvsidecar_sessions_started_total", policy=policy) for _, m in runs]
        assert started == sorted(started)  # counters only grow
        # sessions per policy and status: exactly what the engine saw
        assert started[-1] == a["requests"] == 6
        for status, n in a["statuses"].items():
            assert value(final, "kvsidecar_sessions_terminal_total", policy=policy, status=status) == n, status
        assert total(final, "kvsidecar_sessions_terminal_total") == a["requests"]
        assert total(final, "kvsidecar_sessions_terminal_total", policy=policy) == a["requests"]
        assert value(final, "kvsidecar_session_elapsed_seconds_count", policy=policy) == a["requests"]
        # restored blocks: the sidecar's own books agree; the engine got exactly the tokens it counted
        restored = a["sessions"]["restored_blocks"]
        assert value(final, "kvsidecar_restored_blocks_total", path="session") == restored
        # every rank leases the same blocks (ranks agree) and copies its own shard of each
        assert value(final, "kvsidecar_engine_blocks_total") * T == 2 * a["restored_tokens"]
        assert value(final, "kvsidecar_engine_bytes_total") == a["restored_tokens"] // T * simulate.make_layout(2).block_bytes
        # each session's hit (resident + L3, when its query answered) and each admission's lease
        # are within what it asked for.  The hit is no bound on the lease: the ranks store every
        # request's computed blocks after its prefill, and a later request's GET leases those too
        # when they were published after its own query answered (seen once in CI: 16,768 tokens
        # leased against a 12,416-token hit)
        hit = total(final, "kvsidecar_lookup_hit_tokens_total", source="prefetch")
        requested = value(final, "kvsidecar_lookup_requested_tokens_total", source="prefetch")
        assert 0 < hit <= requested and a["restored_tokens"] <= requested
        # leases back to 0, nothing staged, nothing pinned
        assert total(final, "kvsidecar_leases") == 0
        assert value(final, "kvsidecar_reserved_bytes") == 0 and value(final, "kvsidecar_pinned_bytes") == 0
        assert value(final, "kvsidecar_sessions", state="running") == 0
        assert total(final, "kvsidecar_protocol_errors_total") == 0
    # (a best_effort arm demanded at once may restore nothing; the timeout arm does)
    assert res["arms"]["timeout_chunk32"]["sessions"]["restored_blocks"] > 0
    assert res["arms"]["timeout_chunk32"]["restored_tokens"] > 0


class _StalledLoop:
    """The part of kvsidecar.sidecar.service.Host a scrape uses, for a control thread that is busy: posted
    work waits until the test runs it (the one way to hold a real loop deterministically)."""

    def __init__(self):
        import collections as _c

        self.clients: dict = {}
        self.counters = _c.Counter()
        self.posted: list = []
        self.services: list = []  # what snapshot() includes

    def snapshot(self):
        from kvsidecar.sidecar.observe.snapshot import LoopSnapshot, SidecarSnapshot

        loop = LoopSnapshot(instance="stalled", generation=7, pid=0, clients=(), counters=dict(self.counters),
                            ops={}, errors={}, rings_corrupted=0)
        return SidecarSnapshot.of(loop, [svc.snapshot() for svc in self.services])

    def post(self, fn, *args):
        self.posted.append((fn, args))

    def call_at(self, due, fn, *args):
        pass

    def run_posted(self):
        while self.posted:
            fn, args = self.posted.pop(0)
            fn(*args)


def test_a_scrape_never_waits_past_its_budget_and_says_stale(timing):
    from kvsidecar.sidecar.config import MetricsConfig, load_config
    from kvsidecar.sidecar.kv.ops import KVCore
    from kvsidecar.sidecar.observe.metrics import MetricsService

    cfg = load_config(None, {"layout.num_layers": 1, "layout.head_dim": 8, "pool.num_blocks": 64})
    loop = _StalledLoop()
    core = KVCore(loop, cfg.kv_layout(), 64, cfg.limits)
    svc = MetricsService(loop, MetricsConfig(enabled=True, port=0, scrape_timeout_s=0.05), core=core, generation=7)
    loop.services = [core]
    port = svc.start()
    try:
        t0 = time.monotonic()
        m = scrape(port)  # nothing answers: only up / generation / stale
        timing.within(t0, 5.0, "a scrape of a stalled loop")
        assert value(m, "kvsidecar_scrape_stale") == 1 and value(m, "kvsidecar_generation") == 7
        assert not any(name.startswith("kvsidecar_pool") for name, _ in m)
        m = scrape(port)
        assert value(m, "kvsidecar_scrape_stale") == 1
        assert len(loop.posted) == 1  # a stuck loop is asked once, however many scrapes come
        # the loop gets to it while the next scrape waits: a fresh snapshot
        loop.counters["requests"] = 5
        svc.cfg.scrape_timeout_s = 10.0
        threading.Timer(0.2, loop.run_posted).start()
        m = scrape(port)
        assert value(m, "kvsidecar_scrape_stale") == 0 and value(m, "kvsidecar_requests_total") == 5
        assert value(m, "kvsidecar_pool_blocks", state="free") == 64
        # stalled again: the last good snapshot is served, marked stale
        svc.cfg.scrape_timeout_s = 0.05
        loop.counters["requests"] = 6
        m = scrape(port)
        assert value(m, "kvsidecar_scrape_stale") == 1 and value(m, "kvsidecar_requests_total") == 5
        assert svc.stats()["metrics"] == {"port": port, "scrapes": 4, "stale_scrapes": 3}
    finally:
        svc.stop()


def test_a_taken_port_is_a_clear_startup_error(instance, tmp_path):
    import socket
    import subprocess

    from kvsidecar.sidecar.spawn import child_env, launcher_argv

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run(launcher_argv() + ["--instance", instance, "--set", "metrics.enabled=true",
                                              "--set", f"metrics.port={port}", "--set", f"run_dir=\"{tmp_path}\""],
                           capture_output=True, text=True, timeout=60, env=child_env())
    assert r.returncode == 2, r.stderr
    assert f"cannot serve metrics on 127.0.0.1:{port}" in r.stderr and "Traceback" not in r.stderr


def _attach_and_wait(instance, conn):
    c = KVConnector(instance, LAY, group="doomed")
    c.attach()
    conn.send("attached")
    conn.recv()  # killed while waiting here


def test_failed_puts_and_a_reclaimed_client_are_counted(sidecar_factory, instance, tmp_path, spawn_ctx):
    torch.manual_seed(0)
    kv = [tuple(torch.randn(N, 4, 2, 16).half() for _ in range(2)) for _ in range(2)]
    # a file store capped below one block: every PUT fails (write_too_big)
    sidecar_factory(**overrides(tmp_path, **METRICS_ON, **{"l3.file_cap_bytes": 1}))
    port = metrics_port(instance)
    with KVConnector(instance, LAY) as c:
        store_to_l3(c, kv, TOKENS)  # published in the pool; every PUT fails
    a, b = spawn_ctx.Pipe()
    p = spawn_ctx.Process(target=_attach_and_wait, args=(instance, b))
    p.start()
    try:
        assert a.poll(60) and a.recv() == "attached"
        assert value(scrape(port), "kvsidecar_clients_attached") == 1
    finally:
        p.kill()
        p.join(10)
    m = wait_until(lambda: scrape(port), 20, "the killed client reclaimed",
                   until=lambda m: value(m, "kvsidecar_clients_reclaimed_total") == 1)
    assert value(m, "kvsidecar_clients_attached") == 0
    assert value(m, "kvsidecar_l3_put_blocks_total", result="failed") == N
    assert value(m, "kvsidecar_l3_put_blocks_total", result="published") == 0
    assert value(m, "kvsidecar_l3_errors_total", backend="file", code="write_failed_blocks") == N
    assert value(m, "kvsidecar_l3_errors_total", backend="file", code="write_too_big") == N
    assert value(m, "kvsidecar_leases_released_total", cause="internal") >= 1  # the l3_put lease ended
    assert total(m, "kvsidecar_leases") == 0


def test_concurrent_scrapes_while_a_client_works(sidecar_factory, instance, tmp_path):
    """prometheus-client serves each scrape on its own thread: eight at once, while a client
    keeps the control thread busy, all get a fresh, consistent snapshot."""
    sidecar_factory(**overrides(tmp_path, **METRICS_ON))
    port = metrics_port(instance)
    results, errors = [], []

    def scraper():
        try:
            for _ in range(15):
                results.append(scrape(port))
        except Exception as exc:
            errors.append(repr(exc))

    with SidecarClient(instance, group="busy") as c:
        threads = [threading.Thread(target=scraper) for _ in range(8)]
        for t in threads:
            t.start()
        pings = 0
        while any(t.is_alive() for t in threads):
            c.call("ping")
            pings += 1
        for t in threads:
            t.join(30)
        final = scrape(port)
        stats = c.call("stats")["stats"]["metrics"]
    assert errors == [] and len(results) == 120 and pings > 0
    assert all(value(m, "kvsidecar_scrape_stale") == 0 for m in results)
    seen = [value(m, "kvsidecar_requests_total") for m in results]
    assert max(seen) <= value(final, "kvsidecar_requests_total") and min(seen) >= 1
    assert stats["scrapes"] == 121 and stats["stale_scrapes"] == 0
