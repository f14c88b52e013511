"""One kvsidecar storage-backend instance called from several threads at once, the way SGLang
calls it (prefetch thread: ``batch_exists``; I/O thread: ``batch_get_v1``; backup thread:
``batch_set_v1``; scheduler thread: demand / end), with SGLang's own host pool: each thread has
its own sidecar connection.  Every page read back is checked byte for byte, every reply against
what the thread knows it wrote; no ring error, no degraded call, nothing left behind.  Also: the
request namespace (SGLang's ``extra_key``, which carries the LoRA id, and ``cache_salt``)
isolates chains."""

from __future__ import annotations

import ctypes
import random
import threading
import time
from array import array

import pytest

sglang = pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from kvsidecar.connector.hicache_backend import KvSidecarHiCacheStorage, layout_for_host_pool  # noqa: E402

pytestmark = pytest.mark.sglang

PAGE, HEADS, DIM, LAYERS = 16, 2, 32, 4
THREADS, CHAINS, CHAIN_PAGES, SECONDS = 4, 4, 8, 10.0
HOST_PAGES = 512


def host_pool():
    dev = MHATokenToKVPool(HOST_PAGES * PAGE, PAGE, torch.float16, HEADS, DIM, LAYERS, "cpu", False, start_layer=0,
                           end_layer=LAYERS)
    return MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 1, 0, PAGE, "layer_first",
                                pin_memory=False, device="cpu", device_capacity_tokens=dev.size, start_layer=0,
                                end_layer=LAYERS, write_back_staging=dev.hicache_write_back_staging)


def indices(pages):
    return torch.tensor([p * PAGE + i for p in pages for i in range(PAGE)], dtype=torch.int64)


def page_bytes(pool, pages):
    ptrs, sizes = pool.get_page_buffer_meta(indices(pages))
    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))


def config(instance, **extra):
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                model_name="tiny-llama", extra_config={"instance": instance, "verify_loads": "all", **extra})


def test_four_threads_hammer_one_backend(sidecar_factory, instance, tmp_path):
    pool = host_pool()
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.kv_buffer.dtype))
    lay = layout_for_host_pool(pool, "tiny-llama", False)
    over = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    over.update({"pool.num_blocks": 1024, "l3.file_dir": str(tmp_path / "l3")})
    sidecar_factory(**over)
    b = KvSidecarHiCacheStorage(config(instance, timeout_s=5.0, sessions={"policy": "best_effort"}), {})
    b.register_mem_pool_host(pool)
    b.plugin_driven = True  # the hooks' binding: requests carry their rid
    per_thread = CHAINS * CHAIN_PAGES
    stop_at = time.monotonic() + SECONDS
    stats = [dict(sets=0, exists=0, gets=0, pages_checked=0, wrong_bytes=0, wrong_replies=0) for _ in range(THREADS)]
    errors: list = []

    def worker(t: int):
        rng = random.Random(t)
        src0 = t * per_thread  # this thread's source pages, then its read-back pages
        dst0 = THREADS * per_thread + t * CHAIN_PAGES
        chains = [[f"{t:02d}{c:02d}{i:060d}" for i in range(CHAIN_PAGES)] for c in range(CHAINS)]
        want = [page_bytes(pool, range(src0 + c * CHAIN_PAGES, src0 + (c + 1) * CHAIN_PAGES)) for c in range(CHAINS)]
        written = [False] * CHAINS
        st = stats[t]
        n = 0
        try:
            while time.monotonic() < stop_at:
                c = rng.randrange(CHAINS)
                keys = chains[c]
                op = rng.choice(("set", "read", "read"))
                if op == "set" or not written[c]:
                    res = b.batch_set_v1(keys, indices(range(src0 + c * CHAIN_PAGES, src0 + (c + 1) * CHAIN_PAGES)))
                    st["sets"] += 1
                    st["wrong_replies"] += res != [True] * CHAIN_PAGES
                    written[c] = True
                    continue
                rid = f"t{t}-{n}"
                n += 1
                with b.bind(rid):  # the prefetch thread's query
                    hit = b.batch_exists(keys)
                st["exists"] += 1
                st["wrong_replies"] += hit != CHAIN_PAGES
                b.demand(rid)  # the scheduler's first readiness check
                with b.bind(rid):  # the I/O thread's read
                    got = b.batch_get_v1(keys, indices(range(dst0, dst0 + CHAIN_PAGES)))
                st["gets"] += 1
                st["wrong_replies"] += got != [True] * CHAIN_PAGES
                data = page_bytes(pool, range(dst0, dst0 + CHAIN_PAGES))
                st["pages_checked"] += CHAIN_PAGES
                st["wrong_bytes"] += sum(x != y for x, y in zip(data, want[c]))
                b.end(rid)  # done: the session's clean-up
        except BaseException as exc:  # reported, never swallowed
            errors.append(repr(exc))

    threads = [threading.Thread(target=worker, args=(t,), name=f"kvs-hammer-{t}") for t in range(THREADS)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join(SECONDS + 60)
    elapsed = time.monotonic() - t0
    assert not any(th.is_alive() for th in threads)
    assert not errors, errors
    total = {k: sum(s[k] for s in stats) for k in stats[0]}
    assert elapsed >= SECONDS
    assert total["wrong_bytes"] == 0 and total["wrong_replies"] == 0, total
    assert all(s["gets"] > 10 and s["sets"] > 0 for s in stats), stats
    assert b.stats()["degraded_calls"] == 0
    assert b.flush_aborts(30.0)  # end's aborts go out on the backend's abort thread
    conns = b.conns.stats()
    # the pool: at most one connection per thread inside a call at once, never over the cap
    assert 1 <= conns["connections"] == conns["peak_in_use"] <= min(THREADS, b.config.max_connections), conns
    assert conns["in_use"] == 0 and conns["wait_timeouts"] == 0 and conns["slot_exhaustions"] == 0, conns
    with b.connection() as c:
        s = c.stats(check=True)
    assert s["invariants"] == ""
    assert s["counters"].get("errors_ring_corrupted", 0) == 0 and s["counters"].get("errors", 0) == 0, s["counters"]
    assert s["leases"]["live"] == 0 and s["pool"]["pinned"] == 0 and s["pool"]["staging"] == 0, s
    print(f"\n{THREADS} threads x {elapsed:.1f} s: {total}")
    b.close()


def test_request_namespace_isolates_chains(sidecar_factory, instance, tmp_path):
    """SGLang seeds a chain with the request's (extra_key, cache_salt); the LoRA id is part of
    extra_key.  The backend serves such requests, each in its own key space."""
    pool = host_pool()
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.kv_buffer.dtype))
    lay = layout_for_host_pool(pool, "tiny-llama", False)
    over = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    over.update({"pool.num_blocks": 256, "l3.file_dir": str(tmp_path / "l3")})
    sidecar_factory(**over)
    b = KvSidecarHiCacheStorage(config(instance), {})
    b.register_mem_pool_host(pool)
    tokens = list(range(100, 100 + 6 * PAGE))
    plain = get_storage_hash_str(RadixKey(array("q", tokens)), None, page_size=PAGE)
    lora = get_storage_hash_str(RadixKey(array("q", tokens), extra_key="lora-7"), None, page_size=PAGE)
    salted = get_storage_hash_str(RadixKey(array("q", tokens), cache_salt="tenant-b"), None, page_size=PAGE)
    assert len({plain[0], lora[0], salted[0]}) == 3
    assert all(b.batch_set_v1(lora, indices(range(6))))
    assert b.batch_exists(lora) == 6  # served, not skipped
    assert b.batch_exists(plain) == 0 and b.batch_exists(salted) == 0  # isolated
    assert all(b.batch_get_v1(lora, indices(range(10, 16))))
    assert page_bytes(pool, range(10, 16)) == page_bytes(pool, range(6))
    b.close()
