"""The storage backend's connections across the lifecycle events of a host that starts and ends
threads (issue 20: SGLang's ``/flush_cache`` restarts its cache controller's threads, and the
per-thread clients of ended threads used to keep their slots until none were left).

Real sidecar processes, SGLang's own host pool and ``HybridCacheController``; every page read
back is compared byte for byte; the slots this process holds are read live from the control
segment's slot table (the read-only inspector: no request, no slot of its own).

* threads started and ended 1,000 times (4 alive at once), each a full read cycle;
* 32 threads alive at once, calling together: the pool stays at its cap and nobody misses;
* slots scarce: the pool shares the connections it has; all taken: misses, the refusal counted
  (backend and sidecar), one log line naming the pid that holds the most slots, the inspector's
  slots per pid;
* SGLang's controller ``reset`` (what ``/flush_cache`` runs) 20 times, prefetching back after each;
* the storage backend detached and attached at runtime (SGLang's admin endpoints);
* the sidecar restarted (SIGTERM and kill -9) under the backend: misses while it is down, the
  pool re-attaches, data from L3 bit-exact;
* abort storms: 200 requests ended while their sessions run, from the scheduler thread, with
  the prefetch threads restarted between storms.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from array import array

import pytest

sglang = pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from kvsidecar.connector.client import SidecarClient  # noqa: E402
from kvsidecar.connector.hicache_backend import KvSidecarHiCacheStorage, layout_for_host_pool  # noqa: E402
from kvsidecar.connector.kv_client import KVConnector  # noqa: E402
from kvsidecar.sidecar import inspector  # noqa: E402
from kvsidecar.sidecar.spawn import SidecarProcess  # noqa: E402
from tests.sglang.test_backend_threads import config, host_pool, indices, page_bytes  # noqa: E402
from tests.sglang.test_hicache_controller import build, tp_group, wait_get  # noqa: E402,F401
from tests.sglang.test_hicache_controller import page_bytes as token_bytes  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

pytestmark = pytest.mark.sglang

PAGE = 16
CHAIN_PAGES = 8
ME = os.getpid()


def my_slots(instance: str) -> int:
    """Client slots this process holds now (claimed or active), read live from the slot table."""
    return sum(h["slots"] for h in inspector.snapshot(instance)["slots_by_pid"] if h["pid"] == ME)


def overrides(pool, tmp_path, **extra) -> dict:
    lay = layout_for_host_pool(pool, "tiny-llama", False)
    d = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    d.update({"pool.num_blocks": 1024, "l3.file_dir": str(tmp_path / "l3")})
    d.update(extra)
    return d


def filled_pool():
    pool = host_pool()
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.kv_buffer.dtype))
    return pool


def backend(instance, pool, **cfg) -> KvSidecarHiCacheStorage:
    b = KvSidecarHiCacheStorage(config(instance, timeout_s=5.0, reattach_every_s=0.05, **cfg), {})
    b.register_mem_pool_host(pool)
    b.plugin_driven = True  # requests carry their rid (the plugin's binding)
    return b


def chains(n: int, salt: str) -> list:
    return [[f"{salt}{c:03d}{i:058d}" for i in range(CHAIN_PAGES)] for c in range(n)]


def books(b) -> dict:
    with b.connection() as c:
        s = c.stats(check=True)
    return s


def assert_clean(s: dict) -> None:
    assert s["invariants"] == "", s["invariants"]
    assert s["leases"]["live"] == 0 and s["pool"]["pinned"] == 0 and s["pool"]["staging"] == 0, s
    assert s["counters"].get("errors_ring_corrupted", 0) == 0, s["counters"]


def read_cycle(b, keys, rid, dst) -> tuple[int, list, bytes]:
    """What SGLang's threads do for one request: query (prefetch thread), demand (scheduler),
    read (I/O thread), end (scheduler)."""
    with b.bind(rid):
        hit = b.batch_exists(keys)
    b.demand(rid)
    with b.bind(rid):
        got = b.batch_get_v1(keys, indices(dst))
    b.end(rid)
    return hit, got, page_bytes(b.mem_pool_host, dst)


def test_threads_started_and_ended_1000_times(sidecar_factory, instance, tmp_path):
    pool = filled_pool()
    sidecar_factory(**overrides(pool, tmp_path))
    b = backend(instance, pool, sessions={"policy": "best_effort"})
    cs = chains(4, "t")
    want = []
    for c, keys in enumerate(cs):
        src = range(c * CHAIN_PAGES, (c + 1) * CHAIN_PAGES)
        assert b.batch_set_v1(keys, indices(src)) == [True] * CHAIN_PAGES
        want.append(page_bytes(pool, src))
    base_slots = my_slots(instance)
    assert base_slots == 1  # the registering call's connection
    THREADS, ALIVE = 1000, 4
    wrong: list = []
    slot_samples = []

    def one(t: int):
        c = t % len(cs)
        dst = range(64 + (t % ALIVE) * CHAIN_PAGES, 64 + (t % ALIVE + 1) * CHAIN_PAGES)
        hit, got, data = read_cycle(b, cs[c], f"thr-{t}", dst)
        if hit != CHAIN_PAGES or got != [True] * CHAIN_PAGES or data != want[c]:
            wrong.append((t, hit, got.count(True), data == want[c]))

    t0 = time.monotonic()
    for wave in range(THREADS // ALIVE):
        ths = [threading.Thread(target=one, args=(wave * ALIVE + i,), name=f"churn-{wave}-{i}") for i in range(ALIVE)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(30)
        assert not any(th.is_alive() for th in ths)
        if wave % 25 == 0:
            slot_samples.append(my_slots(instance))
    elapsed = time.monotonic() - t0
    slot_samples.append(my_slots(instance))
    assert b.flush_aborts(30.0)  # end's aborts go out on the backend's abort thread
    st = b.stats()
    assert not wrong, wrong[:10]
    assert st["degraded_calls"] == 0, st
    cap = b.config.max_connections
    assert st["conn_connections"] <= min(ALIVE, cap) and st["conn_in_use"] == 0, st
    assert st["conn_attaches"] == st["conn_connections"], st  # attached once each: no churn
    assert st["conn_slot_exhaustions"] == 0 and st["conn_wait_timeouts"] == 0, st
    assert max(slot_samples) <= min(ALIVE, cap), slot_samples  # bounded all along
    s = books(b)
    assert_clean(s)
    assert s["counters"].get("slot_exhaustions", 0) == 0
    b.close()
    wait_until(lambda: my_slots(instance) == 0, 5, "the backend's slots were not given back at close")
    print(f"\n{THREADS} threads ({ALIVE} alive at once) in {elapsed:.1f} s: slots before {base_slots}, "
          f"during max {max(slot_samples)}, connections {st['conn_connections']}, checkouts {st['conn_checkouts']}")


def test_many_live_threads_share_a_bounded_pool(sidecar_factory, instance, tmp_path):
    """32 threads alive at once, released together, 10 reads each: at most max_connections
    connections, and nobody misses (a thread waits, bounded, for one to come free)."""
    pool = filled_pool()
    sidecar_factory(**overrides(pool, tmp_path, **{"l3.backend": "none"}))
    b = backend(instance, pool, l3=False)
    keys = chains(1, "live")[0]
    assert b.batch_set_v1(keys, indices(range(CHAIN_PAGES))) == [True] * CHAIN_PAGES
    want = page_bytes(pool, range(CHAIN_PAGES))
    N, ROUNDS = 32, 10
    go = threading.Barrier(N)
    wrong, peak_slots = [], []

    def worker(t):
        go.wait(30)
        dst = range(64 + t * CHAIN_PAGES, 64 + (t + 1) * CHAIN_PAGES)
        for _ in range(ROUNDS):
            got = b.batch_get_v1(keys, indices(dst))  # no session: a held GET + copy + release
            if got != [True] * CHAIN_PAGES or page_bytes(pool, dst) != want:
                wrong.append(t)
        peak_slots.append(my_slots(instance))

    ths = [threading.Thread(target=worker, args=(t,)) for t in range(N)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    st = b.stats()
    assert not wrong and st["degraded_calls"] == 0, (wrong, st)
    assert st["conn_connections"] <= b.config.max_connections and max(peak_slots) <= b.config.max_connections, st
    assert st["conn_peak_in_use"] <= b.config.max_connections and st["conn_wait_timeouts"] == 0, st
    assert_clean(books(b))
    b.close()


def test_scarce_slots_are_shared_and_exhaustion_is_reported(sidecar_factory, instance, tmp_path, caplog):
    pool = filled_pool()
    sidecar_factory(**overrides(pool, tmp_path, **{"l3.backend": "none", "transport.num_slots": 3}))
    hogs = [SidecarClient(instance, group="hog", rank=0) for _ in range(2)]
    for h in hogs:
        h.attach()  # observers: two of the three slots
    b = backend(instance, pool, l3=False)  # the third
    keys = chains(1, "scarce")[0]
    assert b.batch_set_v1(keys, indices(range(CHAIN_PAGES))) == [True] * CHAIN_PAGES
    want = page_bytes(pool, range(CHAIN_PAGES))
    wrong = []

    def worker(t):
        dst = range(64 + t * CHAIN_PAGES, 64 + (t + 1) * CHAIN_PAGES)
        for _ in range(20):
            if b.batch_get_v1(keys, indices(dst)) != [True] * CHAIN_PAGES or page_bytes(pool, dst) != want:
                wrong.append(t)

    ths = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    st = b.stats()
    # the pool could not grow: the threads shared its one connection and nobody missed
    assert not wrong and st["degraded_calls"] == 0, (wrong, st)
    assert st["conn_connections"] == 1 and st["conn_slot_exhaustions"] >= 1, st
    assert my_slots(instance) == 3
    # every slot taken, a second backend (a new process's rank would be the same): misses, counted, logged
    shared_lines = [r.getMessage() for r in caplog.records if "share the ones it has" in r.getMessage()]
    assert len(shared_lines) == 1 and f"pid {ME} holds 3 (this process)" in shared_lines[0], shared_lines
    caplog.clear()
    caplog.set_level(logging.WARNING, logger="kvsidecar.connector.thread_conns")
    b2 = KvSidecarHiCacheStorage(config(instance, timeout_s=1.0), {})
    b2.register_mem_pool_host(pool)
    t0 = time.monotonic()
    assert b2.batch_get_v1(keys, indices(range(100, 108))) == [False] * CHAIN_PAGES
    assert time.monotonic() - t0 < 1.0  # a miss at once, not a wait
    assert b2.stats()["degraded_calls"] >= 1 and b2.stats()["conn_slot_exhaustions"] >= 1
    lines = [r.getMessage() for r in caplog.records if "slots" in r.getMessage()]
    assert len(lines) == 1 and f"pid {ME} holds 3 (this process)" in lines[0], lines  # one line per outage
    assert b2.batch_get_v1(keys, indices(range(100, 108))) == [False] * CHAIN_PAGES
    assert len([r for r in caplog.records if "slots" in r.getMessage()]) == 1
    # the sidecar counted every refusal and says who holds the slots; so does the inspector
    refused = st["conn_slot_exhaustions"] + b2.stats()["conn_slot_exhaustions"]
    view = wait_until(lambda: (lambda v: v if v["counters"].get("slot_exhaustions") == refused else None)(
        inspector.snapshot(instance)), 10, "the sidecar did not count the refusals")
    assert view["sidecar"]["slot_exhaustions"] == refused and view["sidecar"]["slots_in_use"] == 3
    assert view["slots_by_pid"] == [{"pid": ME, "slots": 3, "active": 3, "claimed": 0}]
    text = inspector.render(view)
    assert "SLOTS BY PID (3 of 3 in use, %d attaches refused" % refused in text
    # a slot comes free: the starved backend attaches at its next call (after reattach_every_s)
    hogs.pop().detach()
    wait_until(lambda: b2.batch_get_v1(keys, indices(range(100, 108))) == [True] * CHAIN_PAGES, 10,
               "the starved backend never attached")
    assert page_bytes(pool, range(100, 108)) == want
    for x in (b, b2):
        x.close()
    hogs[0].detach()
    wait_until(lambda: my_slots(instance) == 0, 5, "slots left after close")


def test_controller_reset_20_times_keeps_slots_bounded(sidecar_factory, instance, tmp_path, tp_group):
    """``/flush_cache`` runs the cache controller's ``reset``: its four storage threads are
    joined and new ones started.  20 resets, each followed by a prefetch back through the
    controller: every one a full hit, bit-exact, and the slots this process holds never grow."""
    from tests.sglang.test_hicache_controller import sidecar_overrides

    sidecar_factory(**sidecar_overrides(tmp_path, "layer_first"))
    host, ctrl = build("layer_first", instance, tp_group)
    b = ctrl.storage_backend
    try:
        n_pages = 24
        tokens = torch.randint(0, 32000, (n_pages * PAGE,)).tolist()
        hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
        src = host.alloc(n_pages * PAGE)
        host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).to(host.kv_buffer.dtype))
        want = token_bytes(host, src)  # (token indices)
        ctrl.write_storage(src, tokens, hashes, None, extra_pools=None)
        assert wait_get(ctrl.ack_backup_queue).completed_tokens == n_pages * PAGE
        host.free(src)
        slots = [my_slots(instance)]
        names = set()
        for cycle in range(20):
            ctrl.reset()  # joins the storage threads, starts new ones
            names.add(ctrl.prefetch_thread.name)
            host.kv_buffer.zero_()
            handle = CacheRequestHandle(rid=f"reset-{cycle}", attempt_id=0)
            pre = ctrl.submit_prefetch(handle, RadixKey(array("q", tokens)), None, None, [], None).operation
            assert wait_get(ctrl.prefetch_hit_queue) is pre and pre.storage_hit_count == n_pages * PAGE, cycle
            idx, n = ctrl.allocate_storage_hit(pre, pre.storage_hit_count, allow_partial=True,
                                               min_tokens=ctrl.prefetch_threshold, evict_host=lambda n: 0)
            assert n == n_pages * PAGE
            pre.host_indices = idx
            ctrl.prefetch_buffer.put(pre)
            completed = 0
            while True:
                ack = wait_get(ctrl.ack_prefetch_queue)
                completed = max(completed, ack.completed_tokens or 0)
                if ack.completed_req:
                    break
            assert completed == n_pages * PAGE and token_bytes(host, idx) == want, (cycle, completed)
            host.free(idx)
            slots.append(my_slots(instance))
        st = b.stats()
        assert len(names) == 20  # new threads every time
        assert max(slots) <= b.config.max_connections and slots[-1] <= max(slots[:3]), slots
        assert st["degraded_calls"] == 0 and st["conn_slot_exhaustions"] == 0, st
        assert st["conn_attaches"] == st["conn_connections"], st
        assert_clean(books(b))
        print(f"\n20 controller resets: slots held {slots[0]} before, {slots[-1]} after, max {max(slots)}")
    finally:
        ctrl.detach_storage_backend()
    wait_until(lambda: my_slots(instance) == 0, 5, "slots left after the backend was detached")


def test_storage_backend_detached_and_attached_at_runtime(sidecar_factory, instance, tmp_path, tp_group):
    """SGLang's runtime detach / attach of the storage backend: the old backend's connections
    are given back (close), the new one starts with one."""
    from tests.sglang.test_hicache_controller import sidecar_overrides

    sidecar_factory(**sidecar_overrides(tmp_path, "layer_first"))
    host, ctrl = build("layer_first", instance, tp_group)
    extra = dict(ctrl.storage_config.extra_config)
    try:
        for cycle in range(5):
            assert my_slots(instance) >= 1
            ctrl.detach_storage_backend()
            wait_until(lambda: my_slots(instance) == 0, 5, f"cycle {cycle}: slots left after detach")
            ctrl.attach_storage_backend("dynamic", model_name="tiny-llama", storage_backend_extra_config=extra)
            assert ctrl.storage_backend.batch_exists(["never-stored" * 4]) == 0  # a working connection
            assert my_slots(instance) <= ctrl.storage_backend.config.max_connections
    finally:
        ctrl.detach_storage_backend()
    wait_until(lambda: my_slots(instance) == 0, 5, "slots left after the last detach")


def test_sidecar_restarts_under_the_backend(sidecar_factory, instance, tmp_path):
    """Stopped (SIGTERM) and killed (-9) under a busy backend: misses while it is down (no hang),
    then the pool's connections re-attach to the new incarnation; L3 survives, data bit-exact;
    the new sidecar sees no more slots than the pool's connections."""
    pool = filled_pool()
    over = overrides(pool, tmp_path)
    sc = sidecar_factory(**over)
    b = backend(instance, pool, sessions={"policy": "wait_complete"})
    cs = chains(3, "rs")
    want = []
    for c, keys in enumerate(cs):
        src = range(c * CHAIN_PAGES, (c + 1) * CHAIN_PAGES)
        assert b.batch_set_v1(keys, indices(src)) == [True] * CHAIN_PAGES
        want.append(page_bytes(pool, src))
    with b.connection() as c:
        wait_until(lambda: c.stats()["l3"]["puts_in_flight"] == 0, 20, "write-behind did not land")
    results = []

    def hammer(tag, stop):
        rng = random.Random(tag)
        n = 0
        while not stop.is_set():
            c = rng.randrange(len(cs))
            dst = range(64 + tag * CHAIN_PAGES, 64 + (tag + 1) * CHAIN_PAGES)
            t0 = time.monotonic()
            hit, got, data = read_cycle(b, cs[c], f"h{tag}-{n}", dst)
            n += 1
            k = got.count(True)
            assert got == [True] * k + [False] * (CHAIN_PAGES - k)  # a prefix, page by page
            per_page = len(want[c]) // CHAIN_PAGES
            results.append((hit, k, data[:k * per_page] == want[c][:k * per_page], time.monotonic() - t0))

    for how in ("stop", "kill", "stop"):
        stop = threading.Event()
        ths = [threading.Thread(target=hammer, args=(t, stop)) for t in range(3)]
        for th in ths:
            th.start()
        wait_until(lambda: len(results) >= 6, 30, "no reads before the restart")
        if how == "kill":
            sc.kill()
        else:
            sc.stop()
        down_from = len(results)
        wait_until(lambda: len(results) >= down_from + 3, 30, "calls hang while the sidecar is down")
        sc = sidecar_factory(**over)  # a new incarnation (generation bumped); its CPU pool is empty
        wait_until(lambda: sum(1 for r in results[down_from:] if r[1] == CHAIN_PAGES) >= 6, 30,
                   f"after {how}: no full hit from the restarted sidecar")
        stop.set()
        for th in ths:
            th.join(30)
        assert not any(th.is_alive() for th in ths)
        assert all(r[2] for r in results), "a page read back differs from what was written"
        assert max(r[3] for r in results) < 15.0, "a call took longer than its deadlines"
        st = b.stats()
        assert st["conn_connections"] <= b.config.max_connections, st
        assert my_slots(instance) <= st["conn_connections"]
        assert_clean(books(b))
        results.clear()
    st = b.stats()
    assert st["conn_slot_exhaustions"] == 0 and st["conn_attaches"] > st["conn_connections"], st
    b.close()
    wait_until(lambda: my_slots(instance) == 0, 5, "slots left after close")


def test_abort_storms(sidecar_factory, instance, tmp_path):
    """200 requests per storm start sessions over a slow L3 from 4 prefetch threads while the
    scheduler thread ends them (before, during and after their query); between storms the
    prefetch threads are replaced, as a reset does.  Every session ends aborted or complete,
    nothing is left held, the connections stay bounded, and the next request is a full hit."""
    pool = filled_pool()
    over = overrides(pool, tmp_path, **{"l3.latency_ms": 10.0})
    sidecar_factory(**over)
    b = backend(instance, pool, sessions={"policy": "best_effort", "chunk_max_blocks": 1, "query_wait_s": 0.5})
    cs = chains(40, "ab")
    for c, keys in enumerate(cs):
        assert b.batch_set_v1(keys, indices(range(c * CHAIN_PAGES, (c + 1) * CHAIN_PAGES))) == [True] * CHAIN_PAGES
    want0 = page_bytes(pool, range(CHAIN_PAGES))
    with b.connection() as c:
        wait_until(lambda: c.stats()["l3"]["puts_in_flight"] == 0, 20, "write-behind did not land")
    slots, terminal = [], []
    for storm in range(3):
        with b.connection() as c:
            c.flush()  # sessions restore from the slow L3
        rids = [f"s{storm}-{i}" for i in range(200)]
        queried: queue.Queue = queue.Queue()

        def prefetcher(part):
            for i in range(part, len(rids), 4):
                with b.bind(rids[i]):
                    b.batch_exists(cs[i % len(cs)])
                queried.put(rids[i])

        rng = random.Random(storm)
        early = [rid for rid in rids if rng.random() < 0.3]
        ths = [threading.Thread(target=prefetcher, args=(p,), name=f"prefetch-{storm}-{p}") for p in range(4)]
        for th in ths:
            th.start()
        for rid in early:  # the scheduler: these leave before their query ran (or while it runs)
            b.end(rid)
        done = 0
        while done < len(rids):  # ... and the others as soon as their query answered: mid-restore
            b.end(queried.get(timeout=60))
            done += 1
        for th in ths:
            th.join(60)
        assert not any(th.is_alive() for th in ths)
        for rid in rids:  # again: idempotent
            b.end(rid)
        slots.append(my_slots(instance))
        with b.connection() as c:
            s = wait_until(lambda: (lambda s: s if s["leases"]["live"] == 0 and s["pool"]["pinned"] == 0
                                    and s["pool"]["staging"] == 0 else None)(c.stats(check=True)), 30,
                           f"storm {storm}: something still held")
        assert s["invariants"] == ""
        sess = s["sessions"]
        running = {k: v for k, v in sess["by_state"].items() if k != "terminal" and v}
        assert not running and sess["outstanding_staging"] == 0 and sess["orphans"] == 0, sess
        terminal.append({k: v for k, v in sess.items() if k.startswith("terminal_")})
    st = b.stats()
    assert st["degraded_calls"] == 0 and st["conn_slot_exhaustions"] == 0, st
    assert max(slots) <= b.config.max_connections and st["conn_connections"] <= b.config.max_connections, (slots, st)
    assert terminal[-1].get("terminal_aborted", 0) > 0, terminal  # the storms did cut running sessions
    print(f"\nabort storms: slots {slots}, sessions by outcome {terminal[-1]}, backend {st}")
    # a request after the storms: a full hit, bit-exact (not demanded: best_effort would stop at
    # a demand with what is published by then, and the storms left chain 0 partly restored)
    with b.bind("after-storms"):
        hit = b.batch_exists(cs[0])
        got = b.batch_get_v1(cs[0], indices(range(400, 400 + CHAIN_PAGES)))
    b.end("after-storms")
    data = page_bytes(pool, range(400, 400 + CHAIN_PAGES))
    assert hit == CHAIN_PAGES and got == [True] * CHAIN_PAGES and data == want0
    assert_clean(books(b))
    b.close()


def test_pool_checkout_is_exclusive_and_reentrant(sidecar_factory, instance, tmp_path):
    """The one-producer-per-ring contract, directly: no connection is ever checked out to two
    threads at once; a thread's nested checkout gets its own connection back."""
    from kvsidecar.connector.thread_conns import ConnectionPool
    from kvsidecar.shm.layout import KVLayout

    lay = KVLayout(model="m", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", tokens_per_block=4, tp_size=1)
    sidecar_factory(**{f"layout.{k}": v for k, v in lay.as_dict().items()}, **{"pool.num_blocks": 16,
                                                                               "l3.backend": "none"})
    pool = ConnectionPool(lambda: KVConnector(instance, lay, populate="off"), max_connections=3, wait_s=5.0)
    holders: dict = {}
    clash = []
    lock = threading.Lock()

    def worker(t):
        for _ in range(200):
            with pool.checkout() as c:
                assert c is not None
                with lock:
                    if id(c) in holders:
                        clash.append((t, holders[id(c)]))
                    holders[id(c)] = t
                with pool.checkout() as inner:
                    assert inner is c
                c.lookup(b"\0" * 16)  # one round trip on this connection's rings
                with lock:
                    del holders[id(c)]

    ths = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    assert not clash, clash[:5]
    st = pool.stats()
    assert st["connections"] <= 3 and st["in_use"] == 0 and st["wait_timeouts"] == 0, st
    pool.close_all()
    wait_until(lambda: my_slots(instance) == 0, 5, "slots left after close_all")


def test_cost_aware_is_not_demanded_at_sglangs_first_readiness_check(sidecar_factory, instance, tmp_path):
    """SGLang checks every waiting request's prefetch at every iteration, so its first check
    says nothing about when the request's prefill starts: with the plugin's ETA stream
    (``eta_source``) a cost_aware backend sends no demand there (the session keeps the plan its
    ETA allows); without one, and for the other policies, the check is a demand as before."""
    from tests.helpers import wait_l3_idle

    pool = filled_pool()
    sidecar_factory(**overrides(pool, tmp_path, **{"l3.latency_ms": 50.0}))
    keys = chains(1, "eta")[0]
    seed = backend(instance, pool, sessions={"policy": "timeout"})
    assert seed.batch_set_v1(keys, indices(range(CHAIN_PAGES))) == [True] * CHAIN_PAGES
    with seed.connection() as c:
        wait_l3_idle(c)
        c.flush()  # the chain is in L3 only: every session has something to read
    seed.close()
    for rid, with_eta in (("eta", True), ("no-eta", False)):
        b = backend(instance, pool, sessions={"policy": "cost_aware"})
        if with_eta:
            b.eta_source = lambda rid, attempt: (5.0, 0.05)  # far behind the queue, prefill dear
        with b.bind(rid):
            b.batch_exists(keys)
        b.demand(rid)
        with b.connection() as c:
            events = c.client.call("poll", req=rid, events=True).get("events") or []
        stops = [e for e in events if e[0] == "stop"]
        if with_eta:
            assert (b.counters["demands"], b.counters["demands_left_to_eta"]) == (0, 1)
            assert not any(e[2] == "demand" for e in stops), events
        else:
            assert (b.counters["demands"], b.counters["demands_left_to_eta"]) == (1, 0)
        b.end(rid)
        with b.connection() as c:
            wait_until(lambda: c.poll(rid)["state"] in ("terminal", "unknown"), 10, f"{rid}'s session ended")
        b.close()
    with KVConnector(instance, layout_for_host_pool(pool, "tiny-llama", False)) as c:
        wait_until(lambda: c.stats(check=True)["pool"]["staging"] == 0, 10, "no staging left")
        assert_clean(c.stats(check=True))
