"""Integrity benchmark: what the block checksums (DESIGN §7) cost on the product's paths.

One trial measures every arm once, interleaved, on the same bytes:

* **store**: a rank's ``store`` + ``save`` + ``commit`` of ``n`` blocks into a sidecar with
  ``integrity.checksums`` on (the rank hashes its shard, the commit carries the sums) and one
  with it off — throughput and the ratio on/off (target ≥ 0.95).
* **L3 restore**: the whole chain restored from Mooncake (TCP loopback, objects held by another
  sidecar) into a cold pool: with checksums each object carries its row and the read lane
  verifies every block before publishing; without, neither — ratio on/off (target ≥ 0.95).
* **load**: ``get`` + ``load`` of the restored chain with ``verify_loads`` off, sample and all
  (report: the ratio of each to off).
"""

from __future__ import annotations

import os
import statistics
import time

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import torch  # noqa: E402

from kvsidecar.connector.kv_client import KVConnector  # noqa: E402
from kvsidecar.shm.layout import KVLayout  # noqa: E402
from kvsidecar.sidecar.l3.master import MooncakeMaster  # noqa: E402
from kvsidecar.sidecar.spawn import SidecarProcess  # noqa: E402
from scripts.common import wait_puts_done  # noqa: E402

LAY = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, tokens_per_block=16, tp_size=1)  # 512 KiB blocks


def _wait_puts(c: KVConnector, n: int) -> None:
    assert wait_puts_done(c)["counters"]["l3_published_blocks"] >= n


def _store_s(c: KVConnector, kv, chain) -> float:
    """Seconds of one store + save + commit of ``chain`` (the pool is flushed first)."""
    c.flush()
    t0 = time.perf_counter()
    st = c.store(chain)
    c.save(st, kv, list(range(st.count)))
    r = c.commit(st)
    dt = time.perf_counter() - t0
    assert st.count == len(chain) // 16 and r["published"], (st.count, r)
    return dt


def _restore_s(c: KVConnector, chain, n: int) -> float:
    c.flush()
    t0 = time.perf_counter()
    r = c.restore(chain, timeout_s=120)
    dt = time.perf_counter() - t0
    assert r["restored"] == n, r
    return dt


def _load_s(c: KVConnector, chain, dst, pages) -> float:
    t0 = time.perf_counter()
    lease = c.get(chain)
    c.load(lease, dst, pages)
    c.release(lease)
    return time.perf_counter() - t0


def run(quick: bool = False) -> dict:
    n = 64 if quick else 128
    reps = 3
    nbytes = n * LAY.block_bytes
    shape = (n, LAY.tokens_per_block, LAY.heads_per_shard, LAY.head_dim)
    kv = [tuple(torch.randn(shape).half() for _ in range(2)) for _ in range(LAY.num_layers)]
    dst = [tuple(torch.zeros(shape, dtype=torch.float16) for _ in range(2)) for _ in range(LAY.num_layers)]
    pages = list(range(n))
    tokens = list(range(n * LAY.tokens_per_block))
    base = {f"layout.{k}": v for k, v in LAY.as_dict().items()}
    base.update({"pool.num_blocks": n + 16, "l3.backend": "mooncake", "l3.mooncake_local_buffer_bytes": 16 << 20})
    times = {k: [] for k in ("store_on", "store_off", "restore_on", "restore_off", "load_off", "load_sample",
                             "load_all")}
    pid = os.getpid()
    with MooncakeMaster(kv_lease_ttl_ms=5000) as master:
        holder = dict(base, **{"l3.mooncake_master": master.address,
                               "l3.mooncake_global_segment_bytes": 2 * nbytes + (64 << 20)})
        reader = dict(base, **{"l3.mooncake_master": master.address, "l3.mooncake_global_segment_bytes": 0})
        arms = {}
        procs = []
        try:
            for on in (True, False):
                flag = {"integrity.checksums": on}
                h = SidecarProcess(f"kvsbi{'h' + str(int(on))}{pid}", overrides=dict(holder, **flag))
                r = SidecarProcess(f"kvsbi{'r' + str(int(on))}{pid}", overrides=dict(reader, **flag))
                procs += [h, r]
                hc = KVConnector(h.instance, LAY, populate="sync", verify_loads="off", namespace=f"ns{int(on)}")
                hc.attach()
                rc = KVConnector(r.instance, LAY, populate="sync", verify_loads="off", namespace=f"ns{int(on)}")
                rc.attach()
                chain = hc.hasher.chain(tokens)
                st = hc.store(chain, l3=True)  # the objects the readers restore (set-up, not timed)
                hc.save(st, kv, pages)
                hc.commit(st)
                _wait_puts(hc, n)
                arms[on] = (hc, rc, chain)
            (hon, ron, chain_on), (hoff, roff, chain_off) = arms[True], arms[False]
            ron_sample = KVConnector(procs[1].instance, LAY, populate="sync", verify_loads="sample", namespace="ns1")
            ron_all = KVConnector(procs[1].instance, LAY, populate="sync", verify_loads="all", namespace="ns1")
            ron_sample.attach()
            ron_all.attach()
            store_chain = hon.hasher.chain([t + 10**7 for t in tokens])  # not in L3: a plain store
            for _ in range(reps):  # arms interleaved within every repetition
                times["store_on"].append(_store_s(hon, kv, store_chain))
                times["store_off"].append(_store_s(hoff, kv, hoff.hasher.chain([t + 10**7 for t in tokens])))
                times["restore_on"].append(_restore_s(ron, chain_on, n))
                times["restore_off"].append(_restore_s(roff, chain_off, n))
                for name, c in (("load_off", ron), ("load_sample", ron_sample), ("load_all", ron_all)):
                    times[name].append(_load_s(c, chain_on, dst, pages))
            ok = all(torch.equal(a, b) for la, lb in zip(kv, dst) for a, b in zip(la, lb))
            verified = ron_all.integrity_stats()["verified_blocks"]
            for c in (ron_sample, ron_all, hon, ron, hoff, roff):
                c.detach()
        finally:
            for p in procs:
                p.stop()
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    return {"quick": quick, "blocks": n, "block_bytes": LAY.block_bytes, "bytes": nbytes, "loads_correct": ok,
            "verified_blocks_all": verified, **{f"{k}_gbps": v for k, v in gbps.items()},
            "store_checksums_vs_none": gbps["store_on"] / gbps["store_off"],
            "restore_checksums_vs_none": gbps["restore_on"] / gbps["restore_off"],
            "load_sample_vs_off": gbps["load_sample"] / gbps["load_off"],
            "load_all_vs_off": gbps["load_all"] / gbps["load_off"]}


def table(res: dict) -> list:
    return [
        ("store, checksums on (GB/s)", res["store_on_gbps"], "store + save + commit, the rank hashes its shard"),
        ("store, checksums off (GB/s)", res["store_off_gbps"], ""),
        ("store on / off", res["store_checksums_vs_none"], "target >= 0.95"),
        ("L3 restore, checksums on (GB/s)", res["restore_on_gbps"], "Mooncake TCP; object + row, verified"),
        ("L3 restore, checksums off (GB/s)", res["restore_off_gbps"], ""),
        ("L3 restore on / off", res["restore_checksums_vs_none"], "target >= 0.95"),
        ("load, verify off (GB/s)", res["load_off_gbps"], "get + load + release"),
        ("load, verify sample / off", res["load_sample_vs_off"], "1 block in 8 verified"),
        ("load, verify all / off", res["load_all_vs_off"], "every block verified"),
    ]
