"""The kvsidecar SGLang plugin at controller level, TP=2: two spawned rank processes (gloo
``world_size=2``), each with SGLang's own ``HybridCacheController`` and host pool, the plugin
loaded by SGLang's ``load_plugins()`` from the installed entry point
(``tests/sglang/plugin_workers.py``), one sidecar whose CPU pool is flushed before every arm so
the restores come from a shaped (slow) L3:

* ``timeout``: the acked ``completed_tokens`` is the session's drained prefix P, 0 < P < hit,
  and L3 read at most P + window x chunk blocks;
* ``best_effort``: ended by the demand at SGLang's first readiness check within about one
  chunk's transfer;
* ``terminate``: the request leaves mid-flight -> the session is ``aborted``;
* in every arm one session serves both ranks, both ranks get identical counts, the bytes SGLang
  took are each rank's own shard, and afterwards no lease, staging or pin is left and each
  rank's host pool is back to its starting free size.
"""

from __future__ import annotations


import pytest

pytest.importorskip("sglang")

from kvsidecar.connector.hicache_backend import layout_for_host_pool  # noqa: E402
from kvsidecar.sidecar.l3.master import free_port  # noqa: E402

from . import plugin_workers as W  # noqa: E402

pytestmark = pytest.mark.sglang

CHUNK, WINDOW, PAGES = 4, 2, 48


def sidecar_overrides(tmp_path):
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dev = MHATokenToKVPool(W.PAGE * 4, W.PAGE, torch.float16, W.HEADS, W.DIM, W.LAYERS, "cpu", False,
                           start_layer=0, end_layer=W.LAYERS)
    host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2, 0, W.PAGE, "layer_first",
                                pin_memory=False, device="cpu", device_capacity_tokens=dev.size, start_layer=0,
                                end_layer=W.LAYERS, write_back_staging=dev.hicache_write_back_staging)
    lay = layout_for_host_pool(host, "tiny-llama", False, tp_size=W.TP)  # one group: shard r = rank r's page
    d = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    d.update({"pool.num_blocks": 512, "l3.file_dir": str(tmp_path / "l3"), "l3.latency_ms": 60.0,
              "sessions.window": WINDOW, "sessions.read_with_query": True})
    return d


ARMS = [
    {"arm": "timeout", "pages": PAGES, "sessions": {"policy": "timeout", "chunk_max_blocks": CHUNK, "budget_s": 0.3}},
    {"arm": "best_effort", "pages": PAGES, "demand_after_blocks": 2 * CHUNK,
     "sessions": {"policy": "best_effort", "chunk_max_blocks": CHUNK}},
    {"arm": "terminate", "pages": PAGES, "terminate_after_blocks": CHUNK,
     "sessions": {"policy": "timeout", "budget_s": 30.0, "chunk_max_blocks": CHUNK}},
]


def test_plugin_drives_sessions_tp2(sidecar_factory, instance, tmp_path):
    sidecar_factory(**sidecar_overrides(tmp_path))
    port = free_port()
    out = W.run_ranks(W.rank_main, instance, port, ARMS)
    by_arm = {a["arm"]: [out[r][i] for r in range(W.TP)] for i, a in enumerate(ARMS)}
    hit = PAGES * W.PAGE
    for arm, (r0, r1) in by_arm.items():
        # one session served both ranks: identical answers, every byte each rank's own shard
        assert r0["hit_tokens"] == r1["hit_tokens"] == hit, (arm, r0["hit_tokens"], r1["hit_tokens"])
        assert r0["completed_tokens"] == r1["completed_tokens"], arm
        assert r0["data_ok"] and r1["data_ok"], arm
        assert r0["view"]["session"] == r1["view"]["session"], arm
        assert r0["started_delta"] == 1, (arm, r0["started_delta"])  # the sidecar started one session
        # nothing left behind: no lease, staging or pin in the sidecar; SGLang's host pools whole
        books = r0["sidecar"]
        assert books["invariants"] == "" and books["leases_live"] == 0 and books["pinned"] == 0, (arm, books)
        assert books["staging"] == 0 and books["session_staging"] == 0, (arm, books)
        for r in (r0, r1):
            assert r["host_free_after"] == r["host_free_before"], (arm, r["rank"])
    t0, _ = by_arm["timeout"]
    v = t0["view"]
    p = v["prefix"]
    assert v["status"] == "timeout" and 0 < p < PAGES, v
    assert t0["completed_tokens"] == p * W.PAGE, (t0["completed_tokens"], v)
    assert p <= t0["l3_read_blocks"] <= p + WINDOW * CHUNK, (t0["l3_read_blocks"], p)  # from L3, bounded
    b0, _ = by_arm["best_effort"]
    v = b0["view"]
    assert v["status"] == "demanded" and 2 * CHUNK <= v["prefix"] < PAGES, v
    assert b0["completed_tokens"] == v["prefix"] * W.PAGE
    assert v["stop_ms"] <= v["chunk_ms_max"] + 250.0, v  # one chunk's transfer (+ scheduling slack)
    a0, _ = by_arm["terminate"]
    v = a0["view"]
    assert v["status"] == "aborted" and v["prefix"] < PAGES, v
    assert a0["completed_tokens"] < PAGES * W.PAGE
    last = [by_arm[ARMS[-1]["arm"]][r]["counters"] for r in range(W.TP)]  # cumulative per rank
    assert sum(c["sessions_started"] for c in last) == len(ARMS)  # one rank started each session ...
    assert sum(c["sessions_joined"] for c in last) == len(ARMS)  # ... the other joined it
    assert all(c["demands"] == len(ARMS) - 1 and c["degraded_calls"] == 0 for c in last), last
    print("\nplugin controller TP=2: " + "; ".join(
        f"{arm}: hit {r0['hit_tokens']} completed {r0['completed_tokens']} status {r0['view']['status']} "
        f"prefix {r0['view']['prefix']} L3 blocks read {r0['l3_read_blocks']} stop_ms {r0['view'].get('stop_ms')} "
        f"chunk_ms_max {r0['view'].get('chunk_ms_max')}" for arm, (r0, _r1) in by_arm.items()))
