"""Stop latency: from the stop trigger (deadline, demand) to a terminal session, per policy arm,
against one chunk's transfer time + 5 ms, on a shaped L3 (file store with latency and a bandwidth cap)."""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time

from kvsidecar.connector.kv_client import KVConnector
from kvsidecar.shm.layout import KVLayout
from kvsidecar.sidecar.spawn import SidecarProcess

from scripts.common import cpu_seconds as _cpu
from scripts.common import percentile as _pct
from scripts.trials import median as med

LAY = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, tokens_per_block=16, tp_size=1)  # 32 KiB blocks
ARMS = {
    "whole_task": dict(policy="wait_complete"),
    "one_graph_timeout": dict(policy="timeout", chunk_max_blocks=4096),
    "timeout_chunk128": dict(policy="timeout", chunk_max_blocks=128),
    "timeout_chunk32": dict(policy="timeout", chunk_max_blocks=32),
    "best_effort": dict(policy="best_effort", chunk_max_blocks=32),
}


def run(quick: bool = False) -> dict:
    n_req = 8 if quick else 30
    blocks = 512
    bandwidth_mbps = 800.0  # 100 MB/s: 512 x 32 KiB = 16 MiB ~ 170 ms whole, chunk128 ~ 42 ms, chunk32 ~ 10 ms
    latency_ms = 2.0
    full_ms = blocks * LAY.block_bytes / (bandwidth_mbps * 1e6 / 8) * 1e3 + latency_ms
    tmp = tempfile.mkdtemp(prefix="kvsbench-stop-")
    base = {f"layout.{k}": v for k, v in LAY.as_dict().items()}
    base.update({"pool.num_blocks": 3 * blocks, "l3.file_dir": os.path.join(tmp, "l3")})
    inst = f"kvsbstop{os.getpid()}"
    rng = random.Random(7)
    chains = {}
    try:
        import torch

        # the warm-up writes every chain to L3: its backlog bound must admit a whole request (512
        # blocks; the default, a quarter of the pool, is 384 and skipped most PUTs)
        warm = dict(base, **{"l3.max_put_backlog_blocks": 3 * blocks})
        with SidecarProcess(inst, overrides=warm) as sp, KVConnector(inst, LAY) as c:
            kv = [tuple(torch.randn(blocks, 16, 2, 64).half() for _ in range(2)) for _ in range(4)]
            for arm in ARMS:
                for i in range(n_req):
                    toks = [rng.randrange(1, 1 << 30) for _ in range(blocks * LAY.tokens_per_block)]
                    chain = c.hasher.chain(toks)
                    st = c.store(chain, l3=True)
                    c.save(st, kv, list(range(st.count)))
                    c.commit(st)
                    chains[(arm, i)] = chain
                    while c.stats()["l3"]["puts_in_flight"] > 2:
                        time.sleep(0.01)
            while c.stats()["l3"]["puts_in_flight"]:
                time.sleep(0.01)
        shaped = dict(base, **{"l3.latency_ms": latency_ms, "l3.bandwidth_mbps": bandwidth_mbps,
                               "pool.num_blocks": 2 * blocks + 64})
        res = {"quick": quick, "requests_per_arm": n_req, "blocks_per_request": blocks,
               "block_bytes": LAY.block_bytes, "full_transfer_ms": full_ms, "arms": {}}
        with SidecarProcess(inst, overrides=shaped) as sp, KVConnector(inst, LAY) as c:
            for arm, kw in ARMS.items():
                stops, drains, restored, chunk_max, transfer_max = [], [], [], [], []
                cpu0 = _cpu(sp.pid)
                for i in range(n_req):
                    req = f"{arm}-{i}"
                    trigger_after = full_ms * rng.uniform(0.25, 0.6) / 1e3
                    extra = {}
                    if kw["policy"] == "timeout":
                        extra["budget_s"] = trigger_after
                    c.prefetch(chains[(arm, i)], req, **kw, **extra)
                    if kw["policy"] != "timeout":
                        time.sleep(trigger_after)
                        c.demand(req)
                    while True:
                        p = c.poll(req)
                        if p["state"] == "terminal":
                            break
                        time.sleep(0.001)
                    lease = c.get(chains[(arm, i)], req=req, step=1)
                    c.release(lease)
                    stops.append(p["stop_ms"] or 0.0)
                    drains.append(p["drain_ms"] or 0.0)
                    restored.append(p["restored"])
                    chunk_max.append(p["chunk_ms_max"])
                    transfer_max.append(p["transfer_ms_max"])
                cpu = _cpu(sp.pid) - cpu0
                chunk_ms = _pct(chunk_max, 0.99)
                res["arms"][arm] = {
                    "restored_blocks": sum(restored), "restored_blocks_mean": sum(restored) / n_req,
                    "stop_p50_ms": _pct(stops, 0.5), "stop_p99_ms": _pct(stops, 0.99),
                    "chunk_ms_p99": chunk_ms, "bound_ms": chunk_ms + 5.0,
                    "transfer_ms_p99": _pct(transfer_max, 0.99),
                    "within_transfer_bound": _pct(stops, 0.99) <= _pct(transfer_max, 0.99) + 5.0,
                    "drain_ms": _pct(drains, 0.5), "sidecar_cpu_s": cpu,
                    "sidecar_cpu_ms_per_request": cpu / n_req * 1e3,
                    "within_bound": _pct(stops, 0.99) <= chunk_ms + 5.0,
                }
        return res
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _yes(v, yes: str, no: str) -> str:
    """A per-trial verdict: the same in every trial, or 'mixed'."""
    return yes if v is True else no if v is False else f"mixed {v}"


def table(r: dict):
    rows = [("full_transfer_ms", r["full_transfer_ms"], f"{med(r['blocks_per_request']):.0f} blocks x {int(med(r['block_bytes'])) >> 10} KiB per request, shaped L3")]
    for arm, a in r["arms"].items():
        rows.append((f"{arm}.stop_p50_ms", a["stop_p50_ms"], "stop trigger -> terminal"))
        rows.append((f"{arm}.stop_p99_ms", a["stop_p99_ms"],
                     f"bound {med(a['bound_ms']):.1f} ms (one chunk claim->landed + 5): {_yes(a['within_bound'], 'OK', 'OVER')}"))
        rows.append((f"{arm}.transfer_ms_p99", a["transfer_ms_p99"],
                     f"one chunk's L3 read alone; stop p99 within it + 5 ms: {_yes(a['within_transfer_bound'], 'yes', 'no')}"))
        rows.append((f"{arm}.drain_ms", a["drain_ms"], "seal -> terminal, p50"))
        rows.append((f"{arm}.restored_blocks_mean", a["restored_blocks_mean"], "per request"))
        rows.append((f"{arm}.sidecar_cpu_ms_per_request", a["sidecar_cpu_ms_per_request"], ""))
    return rows
