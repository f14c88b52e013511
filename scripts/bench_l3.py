"""L3 benchmark: restore through the sidecar (L3 → pool, Mooncake over TCP loopback) vs the raw
Mooncake client reading the same objects in the same run."""

from __future__ import annotations

import ctypes
import os
import statistics
import time

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

from kvsidecar.connector.kv_client import KVConnector  # noqa: E402
from kvsidecar.shm.layout import KVLayout  # noqa: E402
from kvsidecar.sidecar.l3.master import MooncakeMaster  # noqa: E402
from kvsidecar.sidecar.spawn import SidecarProcess  # noqa: E402

if __package__:
    from .trials import median as med
else:  # run from this folder (python scripts/bench.py)
    from trials import median as med


def run(quick: bool = False) -> dict:
    lay = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, tokens_per_block=16, tp_size=1)  # 512 KiB blocks
    n_blocks = 128 if quick else 256
    reps = 3 if quick else 5
    nbytes = n_blocks * lay.block_bytes
    base = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    base.update({"pool.num_blocks": n_blocks + 16, "l3.backend": "mooncake",
                 "l3.mooncake_local_buffer_bytes": 16 << 20})
    res = {"quick": quick, "blocks": n_blocks, "block_bytes": lay.block_bytes, "bytes": nbytes}
    tokens = list(range(n_blocks * lay.tokens_per_block))
    # a lease long enough for a loaded 2-core machine (the tests' 200 ms is for fast eviction)
    with MooncakeMaster(kv_lease_ttl_ms=5000) as master:
        holder_cfg = dict(base, **{"l3.mooncake_master": master.address,
                                   "l3.mooncake_global_segment_bytes": nbytes + (64 << 20)})
        reader_cfg = dict(base, **{"l3.mooncake_master": master.address, "l3.mooncake_global_segment_bytes": 0})
        with SidecarProcess(f"kvsbl3a{os.getpid()}", overrides=holder_cfg) as a:
            with KVConnector(a.instance, lay) as c:
                import torch

                kv = [tuple(torch.randn(n_blocks, 16, 8, 128).half() for _ in range(2)) for _ in range(8)]
                chain = c.hasher.chain(tokens)
                st = c.store(chain, l3=True)
                c.save(st, kv, list(range(st.count)))
                c.commit(st)
                deadline = time.monotonic() + 60
                while c.stats()["l3"]["puts_in_flight"] and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert c.stats()["counters"]["l3_published_blocks"] == n_blocks
                keys = [f"kvs1/{lay.fingerprint().hex()}//{chain[i:i + 16].hex()}" for i in range(0, len(chain), 16)]
            side, raw = [], []
            reader = _RawReader(master.address, keys, lay.block_bytes)
            try:
                for _ in range(reps):  # interleaved: sidecar restore, then the raw read, per repetition
                    with SidecarProcess(f"kvsbl3b{os.getpid()}", overrides=reader_cfg) as b:
                        with KVConnector(b.instance, lay) as c:
                            t0 = time.perf_counter()
                            r = c.restore(chain, timeout_s=120)
                            side.append(time.perf_counter() - t0)
                            assert r["restored"] == n_blocks, r
                    raw.append(reader.read())
            finally:
                reader.close()
    ratios = sorted(r / s for s, r in zip(side, raw))
    res["sidecar_gbps"] = nbytes / statistics.median(side) / 1e9
    res["raw_gbps"] = nbytes / statistics.median(raw) / 1e9
    res["sidecar_vs_raw"] = statistics.median(ratios)  # per repetition, then the median
    return res


class _RawReader:
    """The same objects read by a raw Mooncake client into a registered buffer, same batching."""

    def __init__(self, master: str, keys, size: int):
        from mooncake.store import MooncakeDistributedStore

        self.s = MooncakeDistributedStore()
        assert self.s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) == 0
        self.keys, self.size = keys, size
        n = len(keys)
        self.buf = ctypes.create_string_buffer(n * size)
        self.addr = ctypes.addressof(self.buf)
        assert self.s.register_buffer(self.addr, n * size) == 0

    def read(self) -> float:
        n, size, addr = len(self.keys), self.size, self.addr
        ctypes.memset(addr, 0, n * size)
        t0 = time.perf_counter()
        out = []
        for a in range(0, n, 1024):
            b = min(n, a + 1024)
            out += self.s.batch_get_into(self.keys[a:b], [addr + i * size for i in range(a, b)], [size] * (b - a))
        dt = time.perf_counter() - t0
        assert all(x == size for x in out), out[:4]
        return dt

    def close(self) -> None:
        self.s.unregister_buffer(self.addr)
        self.s.close()


def table(r: dict):
    return [
        ("sidecar_gbps", r["sidecar_gbps"], f"restore op: L3 -> pool via the sidecar ({med(r['blocks']):.0f} x {int(med(r['block_bytes'])) >> 10} KiB)"),
        ("raw_gbps", r["raw_gbps"], "baseline: raw Mooncake batch_get_into of the same objects"),
        ("sidecar_vs_raw", r["sidecar_vs_raw"], "target >= 0.90"),
    ]
