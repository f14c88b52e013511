"""kvsidecar as SGLang's HiCache storage backend, with SGLang's own host pools (real code, CPU).

Runs in the SGLang virtualenv (``scripts/sglang/setup_venv.sh``; ``.ci/run`` runs it with
``-m sglang``); skipped where SGLang is not installed.
"""

from __future__ import annotations

import time

import pytest

sglang = pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402

from kvsidecar.connector.hicache_backend import KvSidecarHiCacheStorage, layout_for_host_pool  # noqa: E402
from tests.helpers import wait_l3_idle  # noqa: E402
from tests.waiting import wait_until  # noqa: E402

pytestmark = pytest.mark.sglang

PAGE, HEADS, DIM, LAYERS = 16, 2, 32, 4
HOST_TOKENS = 256 * PAGE  # 256 pages


def host_pool(layout: str):
    dev = MHATokenToKVPool(HOST_TOKENS, PAGE, torch.float16, HEADS, DIM, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS)
    return MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout, pin_memory=False,
        device="cpu", device_capacity_tokens=dev.size, start_layer=dev.start_layer, end_layer=dev.end_layer,
        write_back_staging=dev.hicache_write_back_staging)


def storage_config(instance, rank=0, tp=1, mla=False, metrics=False, **extra):
    return HiCacheStorageConfig(tp_rank=rank, tp_size=tp, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=mla, enable_storage_metrics=metrics, is_page_first_layout=False,
                                model_name="tiny-llama", extra_config={"instance": instance, "verify_loads": "all", **extra})


def sidecar_overrides(pool, tmp_path, **extra):
    lay = layout_for_host_pool(pool, "tiny-llama", False)
    d = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    d.update({"pool.num_blocks": 1024, "l3.file_dir": str(tmp_path / "l3")})
    d.update(extra)
    return d


def page_indices(pages):
    return torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)], dtype=torch.int64)


def keys(n, salt="k"):
    return [f"{salt}{i:060d}" for i in range(n)]


def page_bytes(pool, pages):
    ptrs, sizes = pool.get_page_buffer_meta(page_indices(pages))
    import ctypes

    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_write_flush_prefetch_bit_exact(sidecar_factory, instance, tmp_path, layout):
    pool = host_pool(layout)
    pool.kv_buffer.copy_(torch.randn_like(pool.kv_buffer, dtype=torch.float32).to(pool.kv_buffer.dtype))
    sidecar_factory(**sidecar_overrides(pool, tmp_path))
    b = KvSidecarHiCacheStorage(storage_config(instance), {})
    assert isinstance(b, HiCacheStorage)
    b.register_mem_pool_host(pool)
    n = 210  # write-through of >= 200 pages
    ks = keys(n)
    want = page_bytes(pool, range(n))
    for start in range(0, n, 128):  # the controller sends at most 128 pages a call
        chunk = ks[start:start + 128]
        assert all(b.batch_set_v1(chunk, page_indices(range(start, start + len(chunk)))))
    pool.kv_buffer.zero_()  # SGLang's host tier is reset (/flush_cache)
    assert b.batch_exists(ks) == n
    dst = list(range(30, 30 + n))  # read back into different host pages
    got = []
    for start in range(0, n, 128):
        chunk = ks[start:start + 128]
        got += b.batch_get_v1(chunk, page_indices(dst[start:start + len(chunk)]))
    assert all(got)
    assert page_bytes(pool, dst) == want
    b.close()


def test_miss_in_the_middle_and_partial_get(sidecar_factory, instance, tmp_path):
    pool = host_pool("layer_first")
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.kv_buffer.dtype))
    sidecar_factory(**sidecar_overrides(pool, tmp_path, **{"l3.backend": "none"}))
    b = KvSidecarHiCacheStorage(storage_config(instance), {})
    b.register_mem_pool_host(pool)
    ks = keys(20)
    assert all(b.batch_set_v1(ks[:8], page_indices(range(8))))
    assert all(b.batch_set_v1(ks[9:20], page_indices(range(9, 20))))  # key 8 never stored
    assert b.batch_exists(ks) == 8  # the consecutive prefix only
    assert b.exists(ks[0]) and not b.exists(ks[8])
    res = b.batch_get_v1(ks[:12], page_indices(range(100, 112)))
    assert res == [True] * 8 + [False] * 4  # reported page by page
    assert page_bytes(pool, range(100, 108)) == page_bytes(pool, range(8))
    stats = b.stats()
    assert stats["get_pages_ok"] == 8 and stats["get_pages_missed"] == 4
    b.close()


def test_storage_metrics_are_sglangs_own_type_and_cleared_by_each_read(sidecar_factory, instance, tmp_path):
    """With ``--enable-metrics`` SGLang calls ``get_stats()`` every scheduler iteration and hands
    the result to its storage-metrics collector, which asserts a ``StorageMetrics`` (a dict there
    crashed genuine SGLang's scheduler at its first iteration).  Each call hands over the pages and
    GB/s of every batch_set ("backup") and batch_get ("prefetch") since the last, then clears
    them; without metrics it is None.  kvsidecar's own counters are ``stats()``."""
    from sglang.srt.observability.metrics_collector import StorageMetrics, StorageMetricsCollector

    pool = host_pool("layer_first")
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.kv_buffer.dtype))
    sidecar_factory(**sidecar_overrides(pool, tmp_path, **{"l3.backend": "none"}))
    off = KvSidecarHiCacheStorage(storage_config(instance), {})
    off.register_mem_pool_host(pool)
    assert off.get_stats() is None and isinstance(off.stats(), dict)
    off.close()
    b = KvSidecarHiCacheStorage(storage_config(instance, metrics=True), {})
    b.register_mem_pool_host(pool)
    ks = keys(20, salt="m")
    assert all(b.batch_set_v1(ks[:12], page_indices(range(12))))
    assert all(b.batch_set_v1(ks[12:], page_indices(range(12, 20))))
    assert b.batch_get_v1(ks[:16], page_indices(range(100, 116))) == [True] * 16
    m = b.get_stats()
    assert isinstance(m, StorageMetrics)
    assert m.backup_pgs == [12, 8] and m.prefetch_pgs == [16]
    assert len(m.backup_bandwidth) == 2 and all(x > 0 for x in m.backup_bandwidth + m.prefetch_bandwidth)
    StorageMetricsCollector({"storage_backend": "kvsidecar"}).log_storage_metrics(m)  # SGLang's consumer takes it
    assert b.get_stats() == StorageMetrics()  # handed over: cleared
    assert b.stats()["set_pages_ok"] == 20 and b.stats()["get_pages_ok"] == 16
    b.close()


def test_two_engines_share_blocks(sidecar_factory, instance, tmp_path):
    pool_a, pool_b = host_pool("layer_first"), host_pool("layer_first")
    pool_a.kv_buffer.copy_(torch.randn(pool_a.kv_buffer.shape).to(pool_a.kv_buffer.dtype))
    sidecar_factory(**sidecar_overrides(pool_a, tmp_path, **{"l3.backend": "none"}))
    a = KvSidecarHiCacheStorage(storage_config(instance), {})
    a.register_mem_pool_host(pool_a)
    b = KvSidecarHiCacheStorage(storage_config(instance), {})  # a second engine on the node
    b.register_mem_pool_host(pool_b)
    ks = keys(40)
    assert all(a.batch_set_v1(ks, page_indices(range(40))))
    assert b.batch_exists(ks) == 40
    assert all(b.batch_get_v1(ks, page_indices(range(40))))
    assert page_bytes(pool_b, range(40)) == page_bytes(pool_a, range(40))
    for x in (a, b):
        x.close()


def test_sidecar_absent_or_killed_answers_miss_promptly(sidecar_factory, instance, tmp_path):
    pool = host_pool("layer_first")
    b = KvSidecarHiCacheStorage(storage_config("kvst-no-such-sidecar"), {})
    b.register_mem_pool_host(pool)
    t0 = time.monotonic()
    assert b.batch_exists(keys(4)) == 0
    assert b.batch_get_v1(keys(4), page_indices(range(4))) == [False] * 4
    assert b.batch_set_v1(keys(4), page_indices(range(4))) == [False] * 4
    assert time.monotonic() - t0 < 1.0
    b.close()
    sp = sidecar_factory(**sidecar_overrides(pool, tmp_path))
    c = KvSidecarHiCacheStorage(storage_config(instance, reattach_every_s=0.0), {})
    c.register_mem_pool_host(pool)
    assert all(c.batch_set_v1(keys(4), page_indices(range(4))))
    sp.kill()
    t0 = time.monotonic()
    assert c.batch_exists(keys(4)) == 0
    assert c.batch_get_v1(keys(4), page_indices(range(4))) == [False] * 4
    assert time.monotonic() - t0 < 1.0
    c.close()


def test_with_real_mooncake_behind_the_sidecar(sidecar_factory, instance, tmp_path, mooncake_master):
    pool = host_pool("page_first")
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.kv_buffer.dtype))
    sidecar_factory(**sidecar_overrides(pool, tmp_path, **{"l3.backend": "mooncake",
                                                           "l3.mooncake_master": mooncake_master.address,
                                                           "l3.mooncake_global_segment_bytes": 64 << 20,
                                                           "l3.mooncake_local_buffer_bytes": 8 << 20}))
    b = KvSidecarHiCacheStorage(storage_config(instance), {})
    b.register_mem_pool_host(pool)
    ks = keys(64, salt="m")
    want = page_bytes(pool, range(64))
    assert all(b.batch_set_v1(ks, page_indices(range(64))))
    with b.connection() as c:
        wait_l3_idle(c, 10)
    b.clear()  # the CPU pool forgets; Mooncake keeps them
    with b.connection() as c:
        assert c.lookup(b._chain(ks)) == 0
    pool.kv_buffer.zero_()
    assert b.batch_exists(ks) == 64  # Mooncake's metadata: the session reads behind the answer
    assert all(b.batch_get_v1(ks, page_indices(range(64))))  # waits for the session's published prefix
    assert page_bytes(pool, range(64)) == want
    with b.connection() as c:
        s = c.stats(check=True)
    assert s["invariants"] == "" and s["sessions"]["restored_blocks"] == 64
    b.close()


def test_cost_aware_reports_its_plan_not_the_whole_l3_hit(sidecar_factory, instance, tmp_path):
    """SGLang fetches exactly the hit ``batch_exists`` reports, on its one I/O thread, and waits
    for all of it (``fixed_hit``).  So cost_aware tells it its plan, not the L3 hit: with L3
    dearer than prefill (10 ms a block against 5 ms) nothing is planned, not even the ~45 blocks
    that would land before the request's prefill 500 ms away (an early ETA would make SGLang
    wait for them all, and every request behind it): the hit is 0, the session ends ``cost``
    with nothing read.  With L3 cheaper (10 ms against 20 ms) the whole 64-block hit is
    planned, told and restored bit-exact.  (Before any read, the write-behind's measured puts
    are the estimate: the first request plans on them, no probe; the calibration at start is
    off, its reads would be that evidence.)"""
    pool = host_pool("layer_first")
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.kv_buffer.dtype))
    block_bytes = layout_for_host_pool(pool, "tiny-llama", False).block_bytes
    mb_per_s = block_bytes / 0.010 / 1e6  # 10 ms a block, the estimator's prior and the shaped tier
    sidecar_factory(**sidecar_overrides(pool, tmp_path, **{
        "l3.cost_prior_latency_ms": 1.0, "l3.cost_prior_mb_per_s": mb_per_s,
        "l3.bandwidth_mbps": mb_per_s * 8, "sessions.probe_blocks": 2,
        "l3.calibration_blocks": 0}))  # (no read at start: the calibration's reads raced the stats below)
    b = KvSidecarHiCacheStorage(storage_config(instance, sessions={"policy": "cost_aware", "chunk_max_blocks": 4}), {})
    b.register_mem_pool_host(pool)
    n = 64
    ks, warm = keys(n, salt="plan"), keys(8, salt="warm")
    assert all(b.batch_set_v1(ks, page_indices(range(n))))
    assert all(b.batch_set_v1(warm, page_indices(range(n, n + 8))))
    want = page_bytes(pool, range(n))
    with b.connection() as c:
        wait_l3_idle(c)
        c.flush()  # only L3 holds the chains now
        cost = c.stats()["l3"]["cost"]
        assert cost["samples"] == 0 and cost["write_samples"] > 0, cost  # measured by the writes alone
    b.eta_source = lambda rid, attempt: (0.5, 0.020)  # the plugin's ETA: prefill in 500 ms, 20 ms a block
    with b.bind("r-warm", 0):
        assert b.batch_exists(warm) == 8  # cheaper than prefill: all of them, no probe
    assert all(b.batch_get_v1(warm, page_indices(range(200, 208))))
    b.end("r-warm", 0, abort=False)
    with b.connection() as c:
        wait_until(lambda: c.stats()["l3"]["cost"]["samples"] > 0, 10, "the warm read to measure L3")
        restored = c.stats()["sessions"]["restored_blocks"]
    assert restored == 8

    b.eta_source = lambda rid, attempt: (0.5, 0.005)  # prefill 5 ms a block: L3 is dearer
    with b.bind("r-dear", 0):
        assert b.batch_exists(ks) == 0  # nothing planned, though ~45 blocks would land by the ETA
    assert b.batch_get_v1(ks[:1], page_indices(range(100, 101))) == [False]
    with b.connection() as c:
        final = c.wait("r-dear", attempt=0, terminal=True, timeout_s=10.0)
        assert final["state"] == "terminal" and final["status"] == "cost" and final["prefix"] == 0, final
        assert c.stats()["sessions"]["restored_blocks"] == restored  # not one block read for it
    b.end("r-dear", 0, abort=False)

    b.eta_source = lambda rid, attempt: (0.5, 0.020)
    with b.bind("r-plan", 0):
        assert b.batch_exists(ks) == n  # the whole hit: each block's read saves 10 ms
    assert all(b.batch_get_v1(ks, page_indices(range(100, 100 + n))))
    assert page_bytes(pool, range(100, 100 + n)) == want
    with b.connection() as c:
        final = c.wait("r-plan", attempt=0, terminal=True, timeout_s=10.0)
        assert final["state"] == "terminal" and final["status"] == "complete" and final["prefix"] == n, final
        s = c.stats(check=True)
    assert s["invariants"] == "" and s["sessions"]["restored_blocks"] == restored + n
    b.end("r-plan", 0, abort=False)
    b.close()


@pytest.mark.parametrize("policy,prefill_s,ends", [("best_effort", 0.005, True), ("cost_aware", 0.05, False),
                                                   ("wait_complete", 0.005, False)])
def test_a_request_that_can_prefill_now_stops_its_l3_read(sidecar_factory, instance, tmp_path, policy,
                                                         prefill_s, ends):
    """The settler's ``stop_for_prefill`` (the request can start its prefill in this iteration):
    a session that stops on a demand, still reading its hit from L3 (best_effort: 64 blocks at
    ~10 ms), ends on it with the prefix that landed -- SGLang's get then takes exactly those
    pages, bit-exact, and no more.  A cost_aware session reads only what is cheaper than
    prefill for SGLang (the fixed-hit rule: ``test_cost_aware_reports_its_plan_not_the_whole_l3_hit``),
    and such reads (50 ms of prefill a block) are worth SGLang's next admission: it reads on
    (False) and restores the whole hit, as a wait_complete session does."""
    pool = host_pool("layer_first")
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.kv_buffer.dtype))
    block_bytes = layout_for_host_pool(pool, "tiny-llama", False).block_bytes
    mb_per_s = block_bytes / 0.010 / 1e6
    sidecar_factory(**sidecar_overrides(pool, tmp_path, **{
        "l3.cost_prior_latency_ms": 1.0, "l3.cost_prior_mb_per_s": mb_per_s,
        "l3.bandwidth_mbps": mb_per_s * 8, "l3.calibration_blocks": 0}))
    b = KvSidecarHiCacheStorage(storage_config(instance, sessions={"policy": policy, "chunk_max_blocks": 2}), {})
    b.register_mem_pool_host(pool)
    n = 64
    ks = keys(n, salt="stop")
    assert all(b.batch_set_v1(ks, page_indices(range(n))))
    want = page_bytes(pool, range(n))
    with b.connection() as c:
        wait_l3_idle(c)
        c.flush()  # only L3 holds the chain now
    b.eta_source = lambda rid, attempt: (30.0, prefill_s)  # far from its prefill: cost_aware plans the whole hit
    with b.bind("r-stop", 0):
        assert b.batch_exists(ks) == n
    if policy != "wait_complete":  # (wait_complete reads the whole hit as one claim: asked while reading it)
        with b.connection() as c:
            wait_until(lambda: c.poll("r-stop")["published"] >= 4, 10, "the first blocks to land")
    assert b.stop_for_prefill("r-stop", 0) is ends
    assert b.counters["settle_demands"] == 1 and b.counters["settle_demands_ending"] == int(ends)
    res = b.batch_get_v1(ks, page_indices(range(100, 100 + n)))
    got = res.count(True)
    assert res == [True] * got + [False] * (n - got), res
    assert page_bytes(pool, range(100, 100 + got)) == want[:got * (len(want) // n)]
    with b.connection() as c:
        final = c.wait("r-stop", attempt=0, terminal=True, timeout_s=10.0)
        if ends:
            assert final["status"] == "demanded" and 4 <= final["prefix"] == got < n, final
        else:
            assert final["status"] == "complete" and got == n, final
    b.end("r-stop", 0, abort=False)
    assert b.stop_for_prefill("r-stop", 0) is False  # over: nothing to stop or wait for
    with b.connection() as c:
        s = c.stats(check=True)
    assert s["invariants"] == "", s["invariants"]
    b.close()
