"""A real SGLang server (CPU, tiny dummy-weight Llama, TP=2) with kvsidecar as its HiCache storage
backend.  Slow (startup 30-90 s): outside the default suite; run with
``.sglang-venv/bin/python -m pytest -m "sglang and slow" tests/sglang``.

Three stand-ins outside the L2<->L3 path live in ``server_standins/`` (see its sitecustomize).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import os
import signal
import subprocess
import time
import urllib.error
from pathlib import Path

import pytest

pytest.importorskip("sglang")

from kvsidecar.sidecar import inspector  # noqa: E402
from kvsidecar.sidecar.l3.master import free_port  # noqa: E402
from kvsidecar.sidecar.spawn import SidecarProcess  # noqa: E402
from kvsidecar.connector.kv_client import KVConnector  # noqa: E402
from kvsidecar.shm.layout import KVLayout  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

from scripts.sglang_server import clean_shm, http  # noqa: E402,F401  (the benchmark's server harness; the flush test imports it from here)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TP = 2
PAGE = 16


def generate(port, ids, rid=None):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    if rid is not None:
        body["rid"] = rid
    out = http(port, "/generate", body)
    return out["output_ids"], out["meta_info"]


def storage_tokens(meta) -> int:
    return (meta.get("cached_tokens_details") or {}).get("storage", 0)


def sidecar_overrides(tmp_path, **extra) -> dict:
    """One TP group for both ranks: a tp_size=2 layout whose shard r is one host page of rank r."""
    cfg = json.loads((HERE / "tiny_llama" / "config.json").read_text())
    d = {"layout.model": "tiny", "layout.num_layers": cfg["num_hidden_layers"],
         "layout.num_kv_heads": cfg["num_key_value_heads"], "layout.tp_size": TP,
         "layout.head_dim": cfg["hidden_size"] // cfg["num_attention_heads"], "layout.dtype": "bfloat16",
         "layout.tokens_per_block": PAGE, "pool.num_blocks": 2048, "l3.file_dir": str(tmp_path / "l3")}
    d.update(extra)
    return d


def start_server(instance, tmp_path, sidecar_over: dict, *, plugin: bool, timeline: bool = False,
                 policy: str = "timeout", extra_args: tuple = ()):
    """The sidecar and ``sglang.launch_server --device cpu`` (TP=2, HiCache, kvsidecar storage,
    SGLang's ``wait_complete``); with ``plugin`` the kvsidecar radix cache (``--radix-cache-backend
    kvsidecar``); without it SGLang does not load the plugin (``SGLANG_PLUGINS``) and kvsidecar runs
    with sessions disabled."""
    since = time.time()  # what SGLang leaves in /dev/shm from here on is this server's
    sc = SidecarProcess(instance, overrides=sidecar_over)
    port = free_port()
    plugin_cfg = tmp_path / "kvsidecar-sglang.toml"
    plugin_cfg.write_text(f'instance = "{instance}"\nmodel = "tiny"\ntimeout_s = 2.0\nreattach_every_s = 0.2\n'
                          f'verify_loads = "all"\ntimeline = {"true" if timeline else "false"}\n'
                          f'[sessions]\nenabled = {"true" if plugin else "false"}\npolicy = "{policy}"\n'
                          'chunk_max_blocks = 2\nget_wait_s = 20.0\n')
    env = dict(os.environ, PYTHONPATH=f"{HERE / 'server_standins'}:{ROOT}", SGLANG_USE_CPU_ENGINE="1",
               SGLANG_CPU_OMP_THREADS_BIND="0|1", MC_TCP_BIND_ADDRESS="127.0.0.1",
               TORCH_EXTENSIONS_DIR=str(ROOT / ".cache" / "torch_extensions"),
               SGLANG_CACHE_DIR=str(ROOT / ".cache" / "sglang"), TMPDIR=str(tmp_path),
               SGLANG_PLUGINS="kvsidecar" if plugin else "none-of-them")
    extra = {"backend_name": "kvsidecar", "module_path": "kvsidecar.connector.hicache_backend",
             "class_name": "KvSidecarHiCacheStorage", "interface_v1": 1, "config_file": str(plugin_cfg)}
    args = [str(ROOT / ".sglang-venv" / "bin" / "python"), "-m", "sglang.launch_server",
            "--model-path", str(HERE / "tiny_llama"), "--device", "cpu", "--load-format", "dummy",
            "--skip-tokenizer-init", "--tp", str(TP), "--port", str(port), "--host", "127.0.0.1",
            "--page-size", str(PAGE), "--max-total-tokens", "8192", "--enable-hierarchical-cache",
            "--hicache-io-backend", "direct", "--hicache-mem-layout", "layer_first",
            "--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps(extra)]
    # SGLang waits for its storage transfer in both (its best_effort would race a blocking restore)
    args += ["--hicache-storage-prefetch-policy", "wait_complete"]
    if plugin:
        args += ["--radix-cache-backend", "kvsidecar"]
    args += list(extra_args)
    log_path = tmp_path / "server.log"
    log = open(log_path, "wb")
    t0 = time.monotonic()
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            cwd=str(ROOT))
    try:
        def healthy() -> bool:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                http(port, "/health", method="GET", timeout=2)
                return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                return False

        wait_until(healthy, 300, "the server up (/health)", interval_s=1.0)
    except BaseException:
        stop_server(proc, log, sc, instance, since)
        raise
    return Server(proc, log, sc, port, time.monotonic() - t0, log_path, since)


@dataclasses.dataclass
class Server:
    proc: subprocess.Popen
    log: object
    sc: SidecarProcess  # the current sidecar (a test may replace it)
    port: int
    startup_s: float
    log_path: Path
    since: float  # wall clock before it started (its /dev/shm leftovers are newer)


def stop_server(proc, log, sc, instance, since: float) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
    log.close()
    sc.stop()
    # a killed sidecar's segments, and SGLang's own leftovers (its multiprocessing semaphores
    # ``sem.mp-*`` among them) created since the server started; never one a live process maps
    clean_shm(instance, since)


@pytest.fixture
def server_factory(instance, tmp_path):
    started = []

    def start(sidecar_over: dict, plugin: bool, timeline: bool = False, policy: str = "timeout", extra_args=()):
        s = start_server(instance, tmp_path, sidecar_over, plugin=plugin, timeline=timeline, policy=policy,
                         extra_args=extra_args)
        started.append(s)
        return s

    yield start
    for srv in started:
        stop_server(srv.proc, srv.log, srv.sc, instance, srv.since)


def flush(port):
    wait_until(lambda: http(port, "/flush_cache"), 60, "the server flushing its cache", interval_s=1.0,
               until=lambda msg: "flushed" in str(msg).lower() and "not" not in str(msg).lower().split("flushed")[0])


def published_blocks(instance) -> int:
    """Blocks the sidecar has published from stores, read from its shared stats (the read-only
    inspector: no request, no client slot, nothing the server's ranks could notice)."""
    return inspector.snapshot(instance)["stats"].get("store", {}).get("published_blocks", 0)


def wait_published(instance, at_least: int, timeout_s: float, what: str) -> int:
    """Bounded wait until the sidecar has published ``at_least`` blocks (SGLang writes through to
    its storage backend from each rank's backup thread, asynchronously: possibly after the request
    has returned)."""
    return wait_until(lambda: published_blocks(instance), timeout_s, f"{what}: {at_least} blocks published",
                      until=lambda n: n >= at_least, interval_s=0.1)




GROUP = f"sglang:tiny:tp{TP}:pp0:dp0"  # the servers' TP group in the sidecar (both ranks)
SLOW_L3 = {"l3.latency_ms": 80.0}  # per read call: 2-page chunks, 40 pages ~ 1.6 s
SHORT = {"sessions.timeout_base_s": 0.2, "sessions.timeout_per_ki_token_s": 0.0, "sessions.timeout_max_s": 0.2}
LONG = {"sessions.timeout_base_s": 30.0, "sessions.timeout_per_ki_token_s": 0.0, "sessions.timeout_max_s": 30.0}


def probe(instance, over) -> KVConnector:
    """A client of the servers' group (rank 0's layout): polls sessions by SGLang's rid, reads the books."""
    lay = KVLayout(**{k.split(".", 1)[1]: v for k, v in over.items() if k.startswith("layout.")})
    c = KVConnector(instance, lay, rank=0, group=GROUP, populate="off")
    c.attach()
    return c


def test_full_server_plugin_drives_sessions(server_factory, instance, tmp_path):
    import random

    over = sidecar_overrides(tmp_path, **SLOW_L3, **SHORT)
    srv = server_factory(over, plugin=True)
    port = srv.port
    log_text = srv.log_path.read_text()
    assert log_text.count("kvsidecar plugin active") == TP, log_text[-3000:]  # each rank checked its set-up
    rng = random.Random(1)
    warm = [rng.randrange(3, 500) for _ in range(64)]
    generate(port, warm)
    t_warm = time.monotonic()
    base = wait_published(instance, len(warm) // PAGE, 240, "the warm prompt's write-through")
    t_warm = time.monotonic() - t_warm
    ids = [rng.randrange(3, 500) for _ in range(640)]
    first, meta1 = generate(port, ids)  # the cold run
    written = wait_published(instance, base + len(ids) // PAGE, 60, "the prompt's write-through")
    c = probe(instance, over)
    timings = {}
    try:
        # short kvsidecar budget: SGLang takes exactly the session's drained prefix
        flush(port)
        c.flush()  # restores come from the (slow) L3
        t0 = time.monotonic()
        out, meta = generate(port, ids, rid="short-1")
        timings["short_s"] = time.monotonic() - t0
        v = c.wait("short-1", terminal=True, timeout_s=10.0)
        assert v["state"] == "terminal" and v["status"] == "timeout" and 0 < v["prefix"] < v["target"], v
        assert storage_tokens(meta) == v["prefix"] * PAGE, (meta, v)
        assert out == first
        short_view = v
        # a long budget (a sidecar restarted with it; the ranks re-attach): all of it
        c.close()
        srv.sc.stop()
        srv.sc = SidecarProcess(instance, overrides=sidecar_overrides(tmp_path, **SLOW_L3, **LONG))
        c = probe(instance, over)
        flush(port)
        t0 = time.monotonic()
        out, meta = generate(port, ids, rid="long-1")
        timings["long_s"] = time.monotonic() - t0
        v = c.wait("long-1", terminal=True, timeout_s=10.0)
        assert v["state"] == "terminal" and v["status"] == "complete" and v["prefix"] == v["target"], v
        assert storage_tokens(meta) == v["prefix"] * PAGE and v["prefix"] >= len(ids) // PAGE - 1, (meta, v)
        assert out == first
        long_view = v
        # /abort_request while the request is queued (waiting on its prefetch): no lease left
        flush(port)
        c.flush()
        done = {}
        th = threading.Thread(target=lambda: done.update(r=http(port, "/generate", {
            "input_ids": ids, "rid": "abort-1", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})))
        th.start()
        wait_until(lambda: c.poll("abort-1")["state"] == "running", 30, "the queued request's session never ran")
        http(port, "/abort_request", {"rid": "abort-1"})
        th.join(60)
        assert not th.is_alive()
        v = c.wait("abort-1", terminal=True, timeout_s=10.0)
        assert v["state"] == "terminal" and v["status"] == "aborted" and v["prefix"] < v["target"], v
        books = wait_until(lambda: (lambda s: s if s["leases"]["live"] == 0 and s["pool"]["pinned"] == 0
                                    and s["pool"]["staging"] == 0 else None)(c.stats()), 30,
                           "leases, pins or staging left after the abort")
        abort_view = v
        sessions = books["sessions"]
        # the sidecar dies mid-run: the server keeps serving (misses, recompute)
        c.close()
        other = [rng.randrange(3, 500) for _ in range(320)]
        res = {}
        th = threading.Thread(target=lambda: res.update(r=generate(port, other)))
        th.start()
        srv.sc.kill()
        th.join(120)
        assert not th.is_alive() and len(res["r"][0]) == 8
        third, _ = generate(port, [rng.randrange(3, 500) for _ in range(200)])
        assert len(third) == 8
        flush(port)
        again, _ = generate(port, ids)
        assert again == first
    finally:
        c.close()
    print(f"\nfull-server plugin test: startup {srv.startup_s:.1f} s, warm-up write-through {t_warm:.1f} s "
          f"({base} blocks), prompt {len(ids)} tokens ({written - base} blocks written through); "
          f"short budget: storage {short_view['prefix'] * PAGE} tokens = prefix {short_view['prefix']} of "
          f"{short_view['target']} in {timings['short_s']:.2f} s; long budget: {long_view['prefix']} of "
          f"{long_view['target']} in {timings['long_s']:.2f} s; abort: prefix {abort_view['prefix']}, "
          f"sessions {sessions}")


def test_full_server_plugin_disabled_starts_no_session(server_factory, instance, tmp_path):
    import random

    over = sidecar_overrides(tmp_path)
    srv = server_factory(over, plugin=False)
    port = srv.port
    assert "kvsidecar plugin active" not in srv.log_path.read_text()
    rng = random.Random(2)
    warm = [rng.randrange(3, 500) for _ in range(64)]
    generate(port, warm)
    base = wait_published(instance, len(warm) // PAGE, 240, "the warm prompt's write-through")
    ids = [rng.randrange(3, 500) for _ in range(320)]
    first, _ = generate(port, ids)
    wait_published(instance, base + len(ids) // PAGE, 60, "the prompt's write-through")
    c = probe(instance, over)
    try:
        flush(port)
        c.flush()
        second, meta = generate(port, ids)
        assert second == first
        st = c.stats()
        # Without sessions each rank restores on its own: when both restore the chain at once, the
        # rank that finds it staging by the other answers short and SGLang's MIN drops the hit
        # (recompute, never wrong).  Sessions answer every rank alike; here only zero sessions count.
        assert st["counters"].get("op_restore", 0) >= TP, sorted(st["counters"].items())  # the legacy path ran
        s = st["sessions"]
        assert not any(v for k, v in s.items() if k.startswith("started_")), s  # zero sessions
    finally:
        c.close()
    print(f"\nfull-server, plugin disabled: startup {srv.startup_s:.1f} s, storage {storage_tokens(meta)} tokens, "
          f"no session started")


def test_full_server_pool_hit_is_admitted_in_the_iteration_of_its_query(server_factory, instance, tmp_path):
    """A prompt again after SGLang's ``/flush_cache`` is a hit resident in kvsidecar's pool.  The
    settler (``connector/sglang_settle.py``) brings its query answer and its copy in within the
    scheduler iteration that sent the query, so no ``check_prefetch_progress`` ever finds it still
    prefetching (before it, three or four did); every request's session is ended on both ranks
    (before, a hit finished by SGLang's drain was never ended: the rank's session table grew)."""
    import random

    from scripts.sglang_timeline import parse_log

    over = sidecar_overrides(tmp_path)
    srv = server_factory(over, plugin=True, timeline=True)
    port = srv.port
    rng = random.Random(7)
    ids = [rng.randrange(3, 500) for _ in range(640)]
    first, meta = generate(port, ids, rid="cold-1")
    assert storage_tokens(meta) == 0
    wait_published(instance, len(ids) // PAGE, 120, "the prompt's write-through")
    hits = [f"hit-{j}" for j in range(3)]
    for rid in hits:
        flush(port)
        out, meta = generate(port, ids, rid=rid)
        assert out == first
        assert storage_tokens(meta) >= (len(ids) // PAGE - 1) * PAGE, meta
    c = probe(instance, over)
    try:
        wait_until(lambda: (lambda s: s if s["leases"]["live"] == 0 and s["pool"]["pinned"] == 0 else None)(c.stats()),
                   30, "leases or pins left after the hits")
    finally:
        c.close()
    text = srv.log_path.read_text(errors="replace").splitlines()
    for rank in range(TP):
        phases = parse_log(text, rank)
        for rid in hits:
            p = phases.get(rid, {})
            assert p.get("page_transfer") and p.get("settle_copy"), (rank, rid, sorted(p))
            assert not p.get("check_progress"), (rank, rid, p.get("check_progress"))  # ready before its first check
            assert len(p.get("end", ())) >= 1, (rank, rid, sorted(p))
        assert phases.get("cold-1", {}).get("end"), (rank, sorted(phases.get("cold-1", {})))


def test_full_server_cost_aware_runs_no_storage_operation_that_cannot_pay(server_factory, instance, tmp_path):
    """cost_aware decides at queue entry (``connector/sglang_entry.py``).  Over an L3 measured far
    dearer per block than this model's prefill (2 Mbit/s: 16 ms a block, against well under 1 ms
    to recompute it), a prompt only in L3 gets no SGLang storage operation on either rank: its
    timeline has the entry decision and no storage query, no storage tokens, the cold run's
    output, and its session ended as it started (``cost``, prefix 0).  A prompt resident in the
    pool still goes through SGLang's storage on both ranks and is restored.  The server runs with
    ``--enable-metrics``: SGLang then reads the backend's storage metrics every iteration (a dict
    there crashed its scheduler at the first one), and exports kvsidecar's backups and restores."""
    import random

    from scripts.sglang_timeline import parse_log

    over = sidecar_overrides(tmp_path, **{"l3.bandwidth_mbps": 2.0})
    srv = server_factory(over, plugin=True, timeline=True, policy="cost_aware", extra_args=("--enable-metrics",))
    port = srv.port
    rng = random.Random(11)
    # the pooled prompt spans more than 128 pages: the entry's session must hold the very chain
    # SGLang's single query sends (a session over its first 128 keys was refused by that query)
    in_l3, in_pool = ([rng.randrange(3, 500) for _ in range(n)] for n in (640, 2176))
    warm = [rng.randrange(3, 500) for _ in range(64)]
    generate(port, warm)  # (the ETA hook's prefill rate needs a few prefills)
    base = wait_published(instance, len(warm) // PAGE, 120, "the warm prompt's write-through")
    cold_l3, _ = generate(port, in_l3, rid="cold-l3")
    base = wait_published(instance, base + len(in_l3) // PAGE, 60, "the first prompt's write-through")
    c = probe(instance, over)
    try:
        wait_until(lambda: c.stats()["l3"].get("puts_in_flight", 0), 60, "the write-behind", until=lambda n: n == 0)
        c.flush()  # the first prompt is in L3 only
        cold_pool, _ = generate(port, in_pool, rid="cold-pool")
        wait_published(instance, len(in_pool) // PAGE, 60, "the second prompt's write-through")
        flush(port)
        out, meta = generate(port, in_l3, rid="again-l3")
        assert out == cold_l3 and storage_tokens(meta) == 0, meta
        v = c.poll("again-l3")
        assert v["state"] == "terminal" and v["status"] == "cost" and v["prefix"] == 0, v
        out, meta = generate(port, in_pool, rid="again-pool")
        assert out == cold_pool and storage_tokens(meta) >= (len(in_pool) // PAGE - 1) * PAGE, meta
        wait_until(lambda: (lambda s: s if s["leases"]["live"] == 0 and s["pool"]["pinned"] == 0 else None)(c.stats()),
                   30, "leases or pins left")
        assert c.stats(check=True)["invariants"] == ""
    finally:
        c.close()
    text = srv.log_path.read_text(errors="replace").splitlines()
    for rank in range(TP):
        phases = parse_log(text, rank)
        skipped, hit = phases.get("again-l3", {}), phases.get("again-pool", {})
        assert skipped.get("entry_gate") and not skipped.get("storage_hit_query"), (rank, sorted(skipped))
        assert hit.get("entry_gate") and hit.get("storage_hit_query") and hit.get("page_transfer"), (rank, sorted(hit))
        # the group agreed on each request in SGLang's own drain collective, none in one of its own
        batches = {rid: p for rid, p in phases.items() if rid.startswith("entry:")}
        assert any(rid.endswith(":again-l3") for rid in batches) and any(rid.endswith(":again-pool") for rid in batches)
        assert all("entry_agree" in p and "entry_agree_own" not in p for p in batches.values()), (rank, batches)
    metrics = http(port, "/metrics", method="GET")
    for name in ("sglang:backup_pgs_count", "sglang:prefetch_pgs_count"):
        counts = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{")]
        assert counts and sum(counts) >= 1, (name, counts)
