"""The HiCache backend's seam without SGLang: its copies through ``KVCopier`` (bounds checked),
its session registry, and a sidecar restarted under it while several threads call.

The host pool here is a stand-in with SGLang's ``layer_first`` buffer layout and its
``get_page_buffer_meta`` (one pointer per (layer, K/V) of each page); tests/sglang runs the same
backend on SGLang's own host pool.  The sidecar, rings, pool and L3 are real.
"""

from __future__ import annotations

import ctypes
import threading
import types

import pytest
import torch

from kvsidecar.connector.hicache_backend import KvSidecarHiCacheStorage, layout_for_host_pool
from kvsidecar.connector.kv_copy import KVCopier, KVShapeError
from kvsidecar.connector.session_registry import SessionRef, SessionRegistry
from kvsidecar.shm.errors import UnavailableCause as Cause
from kvsidecar.shm.layout import KVLayout

from ..helpers import wait_l3_idle, wait_until

PAGE, HEADS, DIM, LAYERS, PAGES = 4, 2, 8, 2, 64
CHAIN = 6


class HostPool:
    """SGLang's MHA host pool, ``layer_first``: ``kv_buffer[2, layers, tokens, heads, dim]``."""

    def __init__(self, seed: int = 0):
        self.dtype, self.layer_num, self.head_num = torch.float16, LAYERS, HEADS
        self.head_dim, self.page_size = DIM, PAGE
        self.size = PAGES * PAGE
        self.null_pages = False  # a host pool bug: no address for the pages' first buffer
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer = torch.randn(2, LAYERS, self.size, HEADS, DIM, generator=g).half()

    def get_page_buffer_meta(self, indices):
        item = self.kv_buffer.element_size()
        tok, v_off = HEADS * DIM * item, LAYERS * self.size * HEADS * DIM * item
        base, idx = self.kv_buffer.data_ptr(), indices.tolist()
        ptrs = []
        for i in range(0, len(idx), PAGE):
            for layer in range(LAYERS):
                k = base + idx[i] * tok + layer * self.size * tok
                ptrs += [k, k + v_off]
        if self.null_pages:
            ptrs[0] = 0
        return ptrs, [PAGE * tok] * len(ptrs)

    def page_bytes(self, pages) -> bytes:
        ptrs, sizes = self.get_page_buffer_meta(indices(pages))
        return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))


def indices(pages):
    return torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)], dtype=torch.int64)


def storage_config(instance, **extra):
    return types.SimpleNamespace(tp_rank=0, tp_size=1, is_mla_model=False, model_name="standin",
                                 extra_config={"instance": instance, "verify_loads": "all", **extra})


def overrides(pool, tmp_path, **extra):
    lay = layout_for_host_pool(pool, "standin", False)
    d = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    d.update({"pool.num_blocks": 256, "l3.file_dir": str(tmp_path / "l3")})
    d.update(extra)
    return d


def keys(tag: str, n: int = CHAIN):
    return [f"{tag}-{i:060d}" for i in range(n)]


def backend(instance, pool, **cfg):
    b = KvSidecarHiCacheStorage(storage_config(instance, **{"timeout_s": 2.0, "reattach_every_s": 0.02, **cfg}))
    b.register_mem_pool_host(pool)
    return b


# -- KVCopier: the host-piece copies and their bounds ---------------------------------------------------
def test_copier_cuda_copy_mode_is_checked_and_defaults_to_gather():
    """The CUDA copy mechanism is chosen at construction (gather: measured 4.9-11.5x faster than
    region by region on an H200, scripts.gpu_copy_check); an unknown one is refused there."""
    lay = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, tokens_per_block=4, tp_size=2)
    pool = (ctypes.c_uint8 * (lay.block_bytes * 2))()
    assert KVCopier(lay, 0, ctypes.addressof(pool), len(pool)).cuda_copy == "gather"
    assert KVCopier(lay, 0, ctypes.addressof(pool), len(pool), cuda_copy="regions").cuda_copy == "regions"
    with pytest.raises(ValueError, match="cuda_copy"):
        KVCopier(lay, 0, ctypes.addressof(pool), len(pool), cuda_copy="dma")


def test_copier_pieces_round_trip_and_refuse_out_of_bounds():
    lay = KVLayout(num_layers=2, num_kv_heads=4, head_dim=8, tokens_per_block=4, tp_size=2)
    pool = (ctypes.c_uint8 * (lay.block_bytes * 8))()
    cp = KVCopier(lay, 1, ctypes.addressof(pool), len(pool))
    pieces = lay.num_layers * lay.kv_factor
    piece = lay.shard_bytes // pieces
    src = [bytes([(b * 7 + j) % 256]) * piece for b in range(3) for j in range(pieces)]
    bufs = [ctypes.create_string_buffer(x, piece) for x in src]
    assert cp.save_pieces([5, 0, 7], [ctypes.addressof(x) for x in bufs], piece) == 3 * lay.shard_bytes
    # rank 1's shard of block 5 holds block 0's pieces, in order; rank 0's shard is untouched
    at = 5 * lay.block_bytes + lay.shard_bytes
    assert bytes(pool[at:at + lay.shard_bytes]) == b"".join(src[:pieces])
    assert bytes(pool[5 * lay.block_bytes:at]) == bytes(lay.shard_bytes)
    assert cp.read_shard(7) == b"".join(src[2 * pieces:])
    out = [ctypes.create_string_buffer(piece) for _ in range(pieces)]
    cp.load_pieces([0], [ctypes.addressof(x) for x in out], piece)
    assert [x.raw for x in out] == src[pieces:2 * pieces]
    cp.write_shard(3, bytes([9]) * lay.shard_bytes)
    assert cp.read_shard(3) == bytes([9]) * lay.shard_bytes
    ptrs = [ctypes.addressof(x) for x in out]
    for bad, msg in [(lambda: cp.load_pieces([8], ptrs, piece), "outside the pool"),
                     (lambda: cp.load_pieces([-1], ptrs, piece), "outside the pool"),
                     (lambda: cp.load_pieces([0], ptrs, piece // 2), "a shard is"),
                     (lambda: cp.load_pieces([0, 1], ptrs[:3], piece), "host pieces"),
                     (lambda: cp.save_pieces([0], [0] * pieces, piece), "no address"),
                     (lambda: cp.write_shard(1, b"x" * (lay.shard_bytes + 1)), "a shard is"),
                     (lambda: cp.read_shard(8), "outside the pool")]:
        with pytest.raises(KVShapeError, match=msg):
            bad()
    # a refused copy copies nothing, not even the pieces of the blocks before the bad one
    before = bytes(pool)
    two = [ctypes.addressof(x) for x in bufs[:2 * pieces]]
    with pytest.raises(KVShapeError, match="block id 8 outside the pool"):
        cp.save_pieces([1, 8], two, piece)
    with pytest.raises(KVShapeError, match="no address"):
        cp.save_pieces([1, 2], two[:-1] + [0], piece)
    assert bytes(pool) == before
    cp.close()


# -- the session registry -------------------------------------------------------------------------------
def ref(rid, ks, attempt=0):
    return SessionRef(rid, attempt, b"", {k: i for i, k in enumerate(ks)})


def test_registry_orders_demand_end_and_query_races():
    reg = SessionRegistry(max_early=4, max_ended=2)
    ks = keys("a")
    assert reg.demand("r1") is False  # before the query: remembered
    r1 = ref("r1", ks)
    assert reg.open(r1) and r1.demanded and reg.demand("r1") is False  # the query sends it, once
    assert reg.for_keys(ks[2:4]) is r1 and reg.for_keys([ks[3], ks[1]]) is None  # a consecutive span only
    assert reg.for_keys(ks[:2], bound=("r1", 0)) is r1
    assert reg.end("r1") is r1 and r1.ended and reg.for_keys(ks[:2]) is None and len(reg) == 0
    assert reg.end("r1") is None and reg.open(ref("r1", ks))  # ended recently: no early abort left behind
    assert reg.end("r2") is None and reg.open(ref("r2", ks)) is False  # ended before its query: no session
    r3, r3b = ref("r3", ks), ref("r3", ks[:3])
    assert reg.open(r3) and reg.open(r3b) and reg.get("r3") is r3b and reg.for_keys(ks[4:]) is None
    reg.discard(r3)  # not the open one any more: nothing changes
    assert reg.get("r3") is r3b
    reg.discard(r3b)
    assert reg.get("r3") is None
    for i in range(10):
        reg.end(f"never{i}")  # requests that never query: the early table stays bounded
    s = reg.sizes()
    assert s["early"] <= 4 and s["ended"] <= 2, s


def test_registry_reopen_keeps_the_demand_of_the_session_it_replaces():
    """The query re-opens the session the queue entry opened (cost_aware's entry decision): a
    demand the entry's session already sent is not sent again."""
    reg = SessionRegistry()
    ks = keys("d")
    assert reg.open(ref("r", ks)) and reg.demand("r") is True
    query = ref("r", ks)
    assert reg.open(query) and query.demanded and reg.demand("r") is False
    assert reg.get("r") is query and reg.for_keys(ks[:2]) is query and len(reg) == 1


def test_registry_from_many_threads():
    """Query, demand and end of 400 requests race from three threads: every request ends with no
    open session, and every open session was demanded exactly once."""
    reg = SessionRegistry()
    sent = []
    lock = threading.Lock()
    n = 400

    def query():
        for i in range(n):
            r = ref(f"q{i}", keys(f"q{i}", 2))
            if reg.open(r) and r.demanded:
                with lock:
                    sent.append(i)

    def demand():
        for i in range(n):
            if reg.demand(f"q{i}"):
                with lock:
                    sent.append(i)

    def end():
        for i in range(n):
            reg.end(f"q{i}")

    ths = [threading.Thread(target=f) for f in (query, demand)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(30)
    assert sorted(sent) == list(range(n))  # one demand per request, from whichever thread saw it first
    end()
    assert len(reg) == 0 and reg.sizes()["keys"] == 0


# -- the backend on a real sidecar ------------------------------------------------------------------------
def test_backend_pages_go_through_the_copier_bit_exact(sidecar_factory, instance, tmp_path):
    pool = HostPool()
    sidecar_factory(**overrides(pool, tmp_path))
    b = backend(instance, pool)
    ks = keys("bx")
    traced = []
    b.trace = lambda rid, phase, t0, t1: traced.append((rid, phase, t0, t1))  # the timeline (benchmarks)
    assert b.batch_set_v1(ks, indices(range(CHAIN))) == [True] * CHAIN
    assert [(rid, phase) for rid, phase, _, _ in traced] == [(f"backup:{CHAIN}:{ks[0][:16]}", "set")]
    assert 0 < traced[0][3] - traced[0][2] < 5.0
    b.trace = None
    assert b.batch_get_v1(ks, indices(range(32, 32 + CHAIN))) == [True] * CHAIN
    assert pool.page_bytes(range(32, 32 + CHAIN)) == pool.page_bytes(range(CHAIN))
    # the generic interface: whole pages as tensors, through the copier's shard reads and writes
    vals = b.batch_get(ks[:2])
    assert [bytes(v.numpy()) for v in vals] == [pool.page_bytes([0]), pool.page_bytes([1])]
    assert b.batch_set(keys("gen", 1), [torch.frombuffer(bytearray(pool.page_bytes([5])), dtype=torch.uint8)])
    assert bytes(b.batch_get(keys("gen", 1))[0].numpy()) == pool.page_bytes([5])
    assert b.batch_set(keys("short", 1), [torch.zeros(3, dtype=torch.uint8)]) is False  # refused, not stored
    assert b.batch_exists(keys("short", 1)) == 0
    # the copier refuses a copy it cannot bound: a miss (not an exception in SGLang's thread), counted
    before = pool.page_bytes(range(40, 40 + CHAIN))
    pool.null_pages = True
    assert b.batch_get_v1(ks, indices(range(40, 40 + CHAIN))) == [False] * CHAIN
    assert b.batch_set_v1(keys("null"), indices(range(CHAIN))) == [False] * CHAIN
    pool.null_pages = False
    assert pool.page_bytes(range(40, 40 + CHAIN)) == before and b.stats()["copies_refused"] == 2
    with b.connection() as c:
        assert c.lookup(b._chain(keys("null"))) == 0  # the refused store published nothing
    with b.connection() as c:
        wait_l3_idle(c)  # (the stores' write-behind PUTs hold their blocks until they land)
        s = c.stats(check=True)
    assert s["invariants"] == "" and s["leases"]["live"] == 0 and s["pool"]["staging"] == 0
    b.close()


def test_sidecar_restarted_under_the_backend_from_three_threads(sidecar_factory, instance, tmp_path):
    """Killed (-9) and stopped (SIGTERM) while three threads read through the backend: every call
    returns within its deadlines (misses while down), the pool re-attaches (RESTARTED counted),
    the data served from L3 afterwards is bit-exact, and the books are clean."""
    pool = HostPool(seed=1)
    over = overrides(pool, tmp_path)
    sc = sidecar_factory(**over)
    b = backend(instance, pool, sessions={"policy": "wait_complete"})
    ks = keys("rs")
    assert b.batch_set_v1(ks, indices(range(CHAIN))) == [True] * CHAIN
    want = pool.page_bytes(range(CHAIN))
    with b.connection() as c:
        wait_until(lambda: c.stats()["l3"]["puts_in_flight"] == 0, 20, "write-behind did not land")
    stop = threading.Event()
    results, errors = [], []

    def reader(t):
        dst = range(16 + t * CHAIN, 16 + (t + 1) * CHAIN)
        n = 0
        try:
            while not stop.is_set():
                n += 1
                rid = f"t{t}-{n}"
                with b.bind(rid):
                    b.batch_exists(ks)
                b.demand(rid)
                with b.bind(rid):
                    got = b.batch_get_v1(ks, indices(dst))
                b.end(rid)
                k = got.count(True)
                per = len(want) // CHAIN
                results.append((k, got == [True] * k + [False] * (CHAIN - k)
                                and pool.page_bytes(dst)[:k * per] == want[:k * per]))
        except BaseException as exc:
            errors.append(exc)

    ths = [threading.Thread(target=reader, args=(t,)) for t in range(3)]
    for th in ths:
        th.start()
    try:
        for how in ("kill", "stop"):
            wait_until(lambda: sum(1 for k, _ in results if k == CHAIN) >= 6, 30, "no full reads")
            sc.kill() if how == "kill" else sc.stop()
            mark = len(results)
            wait_until(lambda: len(results) >= mark + 3, 30, f"calls hang after {how}")
            sc = sidecar_factory(**over)
            results.clear()
            wait_until(lambda: sum(1 for k, _ in results if k == CHAIN) >= 6, 30, f"no full read after {how}")
    finally:
        stop.set()
        for th in ths:
            th.join(30)
    assert not errors and not any(th.is_alive() for th in ths)
    assert all(ok for _, ok in results), "a page read back differs from what was written"
    st = b.stats()
    assert st["conn_connections"] <= b.config.max_connections, st
    assert st["conn_unavailable_restarted"] >= 2 and st["degraded_calls"] > 0, st
    assert st["conn_slot_exhaustions"] == 0 and st["conn_attaches"] > st["conn_connections"], st
    assert b.sessions.sizes()["open"] == 0
    with b.connection() as c:
        wait_l3_idle(c)  # (the stores' write-behind PUTs hold their blocks until they land)
        s = c.stats(check=True)
        assert c.client.generation == sc.generation
    assert s["invariants"] == "" and s["leases"]["live"] == 0 and s["pool"]["pinned"] == 0
    assert s["pool"]["staging"] == 0
    b.close()


def test_backend_without_a_sidecar_is_a_prompt_miss(instance):
    pool = HostPool()
    b = backend(instance, pool, reattach_every_s=60.0)  # one hold-off covers the whole test
    assert b.batch_exists(keys("no")) == 0
    assert b.batch_get_v1(keys("no"), indices(range(CHAIN))) == [False] * CHAIN
    assert b.batch_set_v1(keys("no"), indices(range(CHAIN))) == [False] * CHAIN
    st = b.stats()
    assert st["degraded_calls"] >= 3 and st["conn_unavailable_not_running"] == 1, st  # one attach per hold-off
    assert b.conns.policy.last_cause is Cause.NOT_RUNNING
    b.close()


def test_end_hands_its_abort_to_a_thread_and_the_sidecar_still_gets_it(sidecar_factory, instance, tmp_path,
                                                                        read_gate):
    """``end`` (SGLang's scheduler thread) does not wait for the sidecar: with the sidecar frozen
    (SIGSTOP) it returns with its abort still pending, and a second request's abort queues behind
    it; once the sidecar runs again both arrive, in order: both sessions end ``aborted`` with
    nothing held, and the books are clean."""
    import os
    import signal

    pool = HostPool(seed=3)
    sc = sidecar_factory(**overrides(pool, tmp_path, **read_gate.overrides()))
    b = backend(instance, pool, timeout_s=60.0, sessions={"policy": "wait_complete"})
    ks = keys("ab")
    assert b.batch_set_v1(ks, indices(range(CHAIN))) == [True] * CHAIN
    with b.connection() as c:
        wait_l3_idle(c)
        c.flush()  # the chain is in L3 only: a session's reads wait at the closed gate
    for rid in ("a1", "a2"):
        with b.bind(rid):
            assert b.batch_exists(ks) == CHAIN  # the session runs, its reads held
    os.kill(sc.pid, signal.SIGSTOP)
    try:
        b.end("a1")
        b.end("a2")
        st = b.stats()  # returned while the sidecar could not answer: both still to send
        assert st["aborts"] == 2 and st["aborts_pending"] == 2 and st["aborts_inline"] == 0, st
    finally:
        os.kill(sc.pid, signal.SIGCONT)
    assert b.flush_aborts(30.0)
    read_gate.open()
    with b.connection() as c:
        s = wait_until(lambda: (lambda s: s if s["sessions"]["by_state"].get("terminal", 0) == 2
                                and s["leases"]["live"] == 0 and s["pool"]["staging"] == 0
                                and s["sessions"]["orphans"] == 0 else None)(c.stats(check=True)),
                       30, "the aborted sessions still hold something")
    assert s["sessions"].get("terminal_aborted") == 2, s["sessions"]
    assert s["invariants"] == "" and s["pool"]["pinned"] == 0
    st = b.stats()
    assert st["aborts_pending"] == 0 and st["aborts_failed"] == 0 and st["degraded_calls"] == 0, st
    b.close()


def cold_in_l3_hot_in_pool(sidecar_factory, instance, tmp_path, pool, salt: str):
    """A cost_aware backend over an L3 measured far dearer per block than prefill (0.2 Mbit/s: a
    512-byte block takes ~20 ms to read, against 0.1 ms to recompute it), with one chain in L3
    only (``cold``) and one resident in the pool (``hot``)."""
    sidecar_factory(**overrides(pool, tmp_path, **{"l3.bandwidth_mbps": 0.2, "l3.latency_ms": 2.0}))
    b = backend(instance, pool, sessions={"policy": "cost_aware", "query_wait_s": 5.0})
    cold, hot = keys("cold" + salt), keys("hot" + salt)
    assert b.batch_set_v1(cold, indices(range(CHAIN))) == [True] * CHAIN
    with b.connection() as c:
        wait_l3_idle(c)
        c.flush()  # the cold chain is in L3 only
        wait_until(lambda: c.stats()["l3"]["cost"]["samples"], 10.0, "the L3 calibration", until=lambda n: n >= 2)
    assert b.batch_set_v1(hot, indices(range(CHAIN, 2 * CHAIN))) == [True] * CHAIN  # resident
    return b, cold, hot


def test_cost_aware_decides_at_queue_entry_and_the_query_joins_it(sidecar_factory, instance, tmp_path):
    """``start_at_entry`` (SGLang's queue entry, cost_aware): over an L3 measured dearer per
    block than prefill, a chain nothing of which is resident has nothing to restore: the session
    ends as it starts (``cost``, prefix 0), the answer is False, and nothing is held (the ref
    stays registered until the plugin, once the group agreed, ends it).  A chain resident in the
    pool is a hit: True, and the query SGLang's prefetch thread sends later answers the session's
    final prefix without a second round trip.  The same L3 chain for a request queued for 10 s
    is not read either (SGLang waits for the whole hit it is told: ``cost.hides_behind_queue``);
    where a block's read costs less than its prefill it is: True, and the query joins the
    running session and answers its plan.  Without a sidecar: True (SGLang runs its operation
    as without this)."""
    pool = HostPool(seed=5)
    b, cold, hot = cold_in_l3_hot_in_pool(sidecar_factory, instance, tmp_path, pool, "")
    assert b.start_at_entry("r-cold", 0, cold, eta_s=0.0, prefill_s_per_block=1e-4) is False
    st = b.stats()
    assert st["entry_sessions"] == 1 and st["entry_nothing_to_restore"] == 1, st
    assert b.session("r-cold") is not None  # registered until the plugin ends it (the group agreed)
    b.end("r-cold")
    assert b.session("r-cold") is None
    assert b.start_at_entry("r-hot", 0, hot, eta_s=0.0, prefill_s_per_block=1e-4) is True
    with b.bind("r-hot"):
        # the prefetch thread's query: the entry's session was terminal (the whole chain resident,
        # nothing to read), so its prefix is the answer, without a second round trip
        assert b.batch_exists(hot) == CHAIN
    st = b.stats()
    assert st["sessions_started"] == 2 and st["sessions_joined"] == 0 and st["queries_answered_at_entry"] == 1, st
    assert st["entry_nothing_to_restore"] == 1 and b.resident("r-hot"), st
    assert b.start_at_entry("r-behind", 0, cold, eta_s=10.0, prefill_s_per_block=1e-4) is False
    assert b.stats()["entry_nothing_to_restore"] == 2
    b.end("r-behind")
    assert b.start_at_entry("r-queued", 0, cold, eta_s=10.0, prefill_s_per_block=1.0) is True
    with b.bind("r-queued"):
        assert b.batch_exists(cold) == CHAIN  # joins the running session: the plan lands within 10 s
    assert b.stats()["sessions_joined"] == 1
    got = b.batch_get_v1(hot, indices(range(2 * CHAIN, 3 * CHAIN)))
    assert got == [True] * CHAIN
    assert pool.page_bytes(range(2 * CHAIN, 3 * CHAIN)) == pool.page_bytes(range(CHAIN, 2 * CHAIN))
    b.end("r-hot")
    b.end("r-queued")
    assert b.flush_aborts(10.0)
    with b.connection() as c:
        for rid in ("r-cold", "r-behind"):
            v = c.poll(rid)
            assert v["state"] == "terminal" and v["status"] == "cost" and v["prefix"] == 0, v
        assert c.poll("r-hot")["prefix"] == CHAIN
        s = wait_until(lambda: c.stats(check=True), 10.0, "leases or pins left",
                       until=lambda s: s["leases"]["live"] == 0 and s["pool"]["pinned"] == 0)
        assert s["invariants"] == "" and s["pool"]["staging"] == 0 and s["sessions"]["orphans"] == 0, s
    assert b.sessions.sizes()["open"] == 0
    b.close()


def test_entry_decisions_of_one_iteration_take_one_round(sidecar_factory, instance, tmp_path):
    """``start_at_entry_many`` (the gate's flush: the requests one scheduler iteration received):
    every start is sent, then every answer read, on one connection, each answer what
    ``start_at_entry`` alone would have said -- an L3-only chain has nothing to restore (False)
    at an idle engine and 10 s behind the queue alike while L3 is dearer per block than prefill,
    a resident one is a hit, the same L3 chain where a block's read costs less than its prefill
    is worth reading.  A start the sidecar refuses (bad input) answers True for that request alone and
    leaves no session behind; a request without keys is not sent."""
    pool = HostPool(seed=7)
    b, cold, hot = cold_in_l3_hot_in_pool(sidecar_factory, instance, tmp_path, pool, "2")
    got = b.start_at_entry_many([("a-cold", 0, cold, 0.0, 1e-4), ("a-hot", 0, hot, 0.0, 1e-4),
                                 ("a-bad", 0, keys("bad"), "soon", 1e-4), ("a-none", 0, [], 0.0, 1e-4),
                                 ("a-behind", 0, cold, 10.0, 1e-4), ("a-queued", 1, cold, 10.0, 1.0)])
    assert got == [False, True, True, True, False, True]
    st = b.stats()
    assert st["entry_sessions"] == 4 and st["entry_nothing_to_restore"] == 2 and st["entry_errors"] == 1, st
    assert st["sessions_started"] == 4 and b.session("a-bad") is None and b.session("a-none") is None, st
    assert b.resident("a-hot") is False  # (no query yet: residency is the query's report)
    with b.bind("a-queued", 1):
        assert b.batch_exists(cold) == CHAIN  # joins the running session
    with b.bind("a-hot"):
        assert b.batch_exists(hot) == CHAIN and b.resident("a-hot")
    for rid, attempt in (("a-cold", 0), ("a-hot", 0), ("a-behind", 0), ("a-queued", 1)):
        b.end(rid, attempt)
    assert b.flush_aborts(10.0)
    with b.connection() as c:
        for rid in ("a-cold", "a-behind"):
            v = c.poll(rid)
            assert v["state"] == "terminal" and v["status"] == "cost" and v["prefix"] == 0, v
        s = wait_until(lambda: c.stats(check=True), 10.0, "leases or pins left",
                       until=lambda s: s["leases"]["live"] == 0 and s["pool"]["pinned"] == 0)
        assert s["invariants"] == "" and s["sessions"]["orphans"] == 0, s
    assert b.sessions.sizes()["open"] == 0
    b.close()


def test_entry_round_sends_at_queue_entry_and_reads_at_the_drain(sidecar_factory, instance, tmp_path):
    """``EntryRound`` (the SGLang gate's starts): each start is sent as its request enters the
    queue and read at the drain.  In between, the scheduler thread's other calls re-enter the
    held connection (a backup here) and another thread's call gets a connection of its own; the
    answers are what one blocking round says; a withdrawn slot answers True and is not settled;
    the connection goes back to the pool at the drain.  After the sidecar died between the sends
    and the drain, every answer is True (SGLang runs its operation), nothing raises, no ref stays
    registered, the connection is back, and the next call re-attaches to a new sidecar."""
    pool, started = HostPool(seed=11), []

    def factory(**o):
        started.append(sidecar_factory(**o))
        return started[-1]

    b, cold, hot = cold_in_l3_hot_in_pool(factory, instance, tmp_path, pool, "3")
    r = b.entry_round()
    slots = [r.send("e-cold", 0, cold, 0.0, 1e-4), r.send("e-hot", 0, hot, 0.0, 1e-4)]
    assert b.conns.in_use() == 1  # held by this (the scheduler) thread until the drain
    assert b.batch_set_v1(keys("more3"), indices(range(2 * CHAIN, 3 * CHAIN))) == [True] * CHAIN  # re-entrant
    other = []
    t = threading.Thread(target=lambda: other.append(b.batch_set_v1(keys("thr3"), indices(range(CHAIN)))))
    t.start()
    t.join(10.0)
    assert other == [[True] * CHAIN] and b.conns.in_use() == 1  # another thread: a connection of its own
    slots.append(r.send("e-gone", 0, hot, 0.0, 1e-4))
    slots.append(r.send("e-none", 0, [], 0.0, 1e-4))  # no keys: nothing to start
    r.withdraw(slots[2])
    assert slots == [0, 1, 2, 3] and r.pending == 4
    assert r.answers() == [False, True, True, True] and r.pending == 0
    assert b.conns.in_use() == 0
    st = b.stats()
    assert st["entry_sessions"] == 2 and st["entry_nothing_to_restore"] == 1 and st.get("entry_errors", 0) == 0, st
    for rid in ("e-cold", "e-hot", "e-gone"):
        b.end(rid)
    assert b.flush_aborts(10.0)
    with b.connection() as c:
        assert c.poll("e-cold")["status"] == "cost" and c.poll("e-hot")["prefix"] == CHAIN
        s = wait_until(lambda: c.stats(check=True), 10.0, "leases or pins left",
                       until=lambda s: s["leases"]["live"] == 0 and s["pool"]["pinned"] == 0)
        assert s["invariants"] == "" and s["sessions"]["orphans"] == 0, s
    assert b.sessions.sizes()["open"] == 0

    r.send("d-cold", 0, cold, 0.0, 1e-4)
    r.send("d-hot", 0, hot, 0.0, 1e-4)
    started[0].kill()  # the sidecar dies with two answers owed
    assert r.answers() == [True, True]
    assert b.conns.in_use() == 0 and b.sessions.sizes()["open"] == 0
    assert b.stats()["entry_errors"] >= 1
    sidecar_factory(**overrides(pool, tmp_path, **{"l3.bandwidth_mbps": 0.2, "l3.latency_ms": 2.0}))
    assert wait_until(lambda: b.batch_set_v1(keys("after3"), indices(range(CHAIN))), 10.0,
                      "the backend re-attached", until=lambda got: got == [True] * CHAIN)
    b.close()


def test_entry_decision_without_a_sidecar_runs_sglangs_operation(instance):
    b = backend(instance, HostPool(), sessions={"policy": "cost_aware"}, timeout_s=0.2)
    assert b.start_at_entry("r", 0, keys("x"), eta_s=0.0, prefill_s_per_block=1e-4) is True
    assert b.sessions.sizes()["open"] == 0 and b.stats()["degraded_calls"] >= 1
    b.close()
