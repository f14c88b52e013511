"""L3 benchmark: restores through the sidecar (L3 → pool, Mooncake over TCP loopback) against the
raw Mooncake client reading the same objects the same way, in the same run, like against like.

Every L3 object is a block followed by its checksum row (``shards × 8`` bytes; issue 19), under
``kvs2/<fingerprint>/<namespace>/<hash>``; the sidecar reads each with
``batch_get_into_multi_buffers`` into [pool block, checksum row] and verifies it; the raw client
reads the same keys with the same call into [buffer block, row buffer] (no verification).

Before its timed reads every reader (each fresh sidecar, and the raw client once) restores a
small warm-up chain untimed, so no row charges one side the Mooncake client's first-use set-up
(the handshake and TCP connections to the holder) that the other paid earlier.

Rows, each a ratio of raw time to sidecar time per repetition (> 1: the sidecar is faster), the
arms interleaved within every repetition:

* **warm** (``sidecar_vs_raw``): the sidecar restoring into pool pages its background populate
  has mapped (``pool.sidecar_populate``, waited for), against raw into a buffer it has just
  ``memset`` (mapped and resident);
* **cold** (``cold_sidecar_vs_raw``): both into memory the reader never touched — a fresh
  sidecar with ``pool.sidecar_populate = "off"`` against raw into a freshly mapped buffer;
* **concurrent** (``concurrent_vs_raw``): 8 clients each restoring a different chain at once
  (the default, one read lane), against the raw client reading the same 8 chains' objects from
  8 threads at once into a warm buffer; ``concurrent_lanes8_vs_raw``: the same with
  ``l3.read_lanes = 8`` (the evidence for the default).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import statistics
import threading
import time

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

from kvsidecar.connector.kv_client import KVConnector  # noqa: E402
from kvsidecar.shm.layout import KVLayout  # noqa: E402
from kvsidecar.sidecar.l3.master import MooncakeMaster  # noqa: E402
from kvsidecar.sidecar.spawn import SidecarProcess  # noqa: E402

from scripts.common import wait_puts_done
from scripts.trials import median as med

SUM_BYTES = 8
CONCURRENT = 8
WARMUP_BLOCKS = 4  # a chain each reader sidecar restores untimed first (see ``_warm_up``)


def _store(c: KVConnector, lay: KVLayout, tokens: list, n_blocks: int) -> bytes:
    import torch

    kv = [tuple(torch.randn(n_blocks, lay.tokens_per_block, lay.num_kv_heads, lay.head_dim).half()
                for _ in range(2)) for _ in range(lay.num_layers)]
    chain = c.hasher.chain(tokens)
    st = c.store(chain, l3=True)
    c.save(st, kv, list(range(st.count)))
    c.commit(st)
    return chain


def _wait_puts(c: KVConnector, want: int) -> None:
    got = wait_puts_done(c)["counters"].get("l3_published_blocks", 0)
    assert got == want, f"{got} of {want} blocks reached L3"


def _wait_populated(c: KVConnector, timeout_s: float = 300) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        p = c.stats()["l3"]["pool_populate"]
        if p.get("done"):
            return p.get("seconds") or 0.0
        time.sleep(0.05)
    raise RuntimeError("the sidecar's pool populate did not finish")


def _keys(lay: KVLayout, chain: bytes) -> list[str]:
    return [f"kvs2/{lay.fingerprint().hex()}//{chain[i:i + 16].hex()}" for i in range(0, len(chain), 16)]


def _restore_at_once(instance: str, lay: KVLayout, chains: list[bytes]) -> float:
    """Every chain restored by its own client at the same moment; seconds until the last is done."""
    conns = [KVConnector(instance, lay, group=f"bench-c{i}", populate="off") for i in range(len(chains))]
    for c in conns:
        c.attach()
    barrier = threading.Barrier(len(chains) + 1)
    results: list = [None] * len(chains)

    def one(i):
        barrier.wait()
        results[i] = conns[i].restore(chains[i], timeout_s=120)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(chains))]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    for c, r, ch in zip(conns, results, chains):
        assert r is not None and r["restored"] == len(ch) // 16, r
        c.detach()
    return dt


def _warm_up(instance: str, lay: KVLayout, chain: bytes) -> None:
    """Restore the small warm-up chain, untimed: a fresh sidecar's first read opens its Mooncake
    client's connections to the holder (handshake, TCP), which the long-lived raw client did
    once, before its first timed read.  The chain's few blocks leave the rest of the pool as
    the row found it (populated or never touched)."""
    with KVConnector(instance, lay, group="bench-warmup", populate="off") as c:
        r = c.restore(chain, timeout_s=120)
        assert r["restored"] == len(chain) // 16, r


def _reader(instance: str, lay: KVLayout, chain: bytes, warmup: bytes) -> float:
    _warm_up(instance, lay, warmup)
    with KVConnector(instance, lay, group="bench-reader", populate="off") as c:
        t0 = time.perf_counter()
        r = c.restore(chain, timeout_s=120)
        dt = time.perf_counter() - t0
        assert r["restored"] == len(chain) // 16, r
    return dt


def run(quick: bool = False) -> dict:
    lay = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, tokens_per_block=16, tp_size=1)  # 512 KiB blocks
    n_blocks = 128 if quick else 256
    n_conc = 16 if quick else 32  # blocks per chain of the concurrent row
    reps = 2 if quick else 3
    row = lay.num_shards * SUM_BYTES
    nbytes = n_blocks * lay.block_bytes
    total_blocks = n_blocks + CONCURRENT * n_conc + WARMUP_BLOCKS
    base = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    base.update({"pool.num_blocks": total_blocks + 16, "l3.backend": "mooncake",
                 "l3.mooncake_local_buffer_bytes": 16 << 20})
    res = {"quick": quick, "blocks": n_blocks, "block_bytes": lay.block_bytes, "bytes": nbytes,
           "concurrent_chains": CONCURRENT, "concurrent_blocks_per_chain": n_conc}
    tok = lay.tokens_per_block
    # a lease long enough for a loaded 2-core machine (the tests' 200 ms is for fast eviction)
    with MooncakeMaster(kv_lease_ttl_ms=5000) as master:
        holder_cfg = dict(base, **{"l3.mooncake_master": master.address, "pool.sidecar_populate": "off",
                                   "l3.max_put_backlog_blocks": total_blocks,  # every block goes to L3
                                   "l3.mooncake_global_segment_bytes": total_blocks * (lay.block_bytes + row)
                                   + (64 << 20)})
        reader_cfg = dict(base, **{"l3.mooncake_master": master.address, "l3.mooncake_global_segment_bytes": 0})
        with SidecarProcess(f"kvsbl3a{os.getpid()}", overrides=holder_cfg) as a:
            with KVConnector(a.instance, lay, populate="off") as c:
                chain = _store(c, lay, list(range(n_blocks * tok)), n_blocks)
                # different chains (their first token differs), so no two share a block
                conc = [_store(c, lay, [10_000_000 + i] + list(range(1, n_conc * tok)), n_conc)
                        for i in range(CONCURRENT)]
                warmup = _store(c, lay, [20_000_000] + list(range(1, WARMUP_BLOCKS * tok)), WARMUP_BLOCKS)
                _wait_puts(c, total_blocks)
            keys = _keys(lay, chain)
            conc_keys = [_keys(lay, ch) for ch in conc]
            raw = _RawReader(master.address, lay.block_bytes, row, max(n_blocks, CONCURRENT * n_conc))
            raw.read_warm([_keys(lay, warmup)])  # its connections opened, as each reader sidecar's are
            t = {k: [] for k in ("warm", "raw_warm", "cold", "raw_cold", "conc", "raw_conc", "conc8")}
            populate_s = []
            try:
                for _ in range(reps):  # interleaved: every arm once per repetition
                    name = f"kvsbl3b{os.getpid()}"
                    with SidecarProcess(name, overrides=dict(reader_cfg, **{"pool.sidecar_populate": "off"})) as b:
                        t["cold"].append(_reader(b.instance, lay, chain, warmup))
                    t["raw_cold"].append(raw.read_cold(keys))
                    with SidecarProcess(name, overrides=dict(reader_cfg, **{"pool.sidecar_populate": "background"})) as b:
                        with KVConnector(b.instance, lay, group="bench-wait", populate="off") as w:
                            populate_s.append(_wait_populated(w))
                        t["warm"].append(_reader(b.instance, lay, chain, warmup))
                        t["conc"].append(_restore_at_once(b.instance, lay, conc))
                    t["raw_warm"].append(raw.read_warm([keys]))
                    t["raw_conc"].append(raw.read_warm(conc_keys))
                    with SidecarProcess(name, overrides=dict(reader_cfg, **{"pool.sidecar_populate": "background",
                                                                            "l3.read_lanes": CONCURRENT})) as b:
                        with KVConnector(b.instance, lay, group="bench-wait", populate="off") as w:
                            _wait_populated(w)
                        _warm_up(b.instance, lay, warmup)
                        t["conc8"].append(_restore_at_once(b.instance, lay, conc))
            finally:
                raw.close()

    def ratio(raw_key, side_key):
        return statistics.median(r / s for r, s in zip(t[raw_key], t[side_key]))

    cbytes = CONCURRENT * n_conc * lay.block_bytes
    res.update({
        "sidecar_gbps": nbytes / statistics.median(t["warm"]) / 1e9,
        "raw_gbps": nbytes / statistics.median(t["raw_warm"]) / 1e9,
        "sidecar_vs_raw": ratio("raw_warm", "warm"),
        "cold_sidecar_gbps": nbytes / statistics.median(t["cold"]) / 1e9,
        "cold_raw_gbps": nbytes / statistics.median(t["raw_cold"]) / 1e9,
        "cold_sidecar_vs_raw": ratio("raw_cold", "cold"),
        "concurrent_sidecar_gbps": cbytes / statistics.median(t["conc"]) / 1e9,
        "concurrent_raw_gbps": cbytes / statistics.median(t["raw_conc"]) / 1e9,
        "concurrent_vs_raw": ratio("raw_conc", "conc"),
        "concurrent_lanes8_gbps": cbytes / statistics.median(t["conc8"]) / 1e9,
        "concurrent_lanes8_vs_raw": ratio("raw_conc", "conc8"),
        "sidecar_populate_s_per_gib": statistics.median(populate_s) / ((total_blocks + 16) * lay.block_bytes / (1 << 30)),
    })
    return res


class _RawReader:
    """The same objects read by a raw Mooncake client the way the sidecar reads them: one
    ``batch_get_into_multi_buffers`` per chain (≤ 1024 keys), each object into [block, row]."""

    def __init__(self, master: str, size: int, row: int, max_blocks: int):
        from mooncake.store import MooncakeDistributedStore

        self.s = MooncakeDistributedStore()
        assert self.s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", master) == 0
        self.size, self.row, self.n = size, row, max_blocks
        self.buf = ctypes.create_string_buffer(max_blocks * size)
        self.rows = ctypes.create_string_buffer(max_blocks * row)
        self.addr, self.rows_addr = ctypes.addressof(self.buf), ctypes.addressof(self.rows)
        assert self.s.register_buffer(self.addr, max_blocks * size) == 0
        assert self.s.register_buffer(self.rows_addr, max_blocks * row) == 0

    def _get(self, keys, addr: int, rows_addr: int) -> None:
        size, row = self.size, self.row
        for a in range(0, len(keys), 1024):
            b = min(len(keys), a + 1024)
            codes = self.s.batch_get_into_multi_buffers(
                keys[a:b], [[addr + i * size, rows_addr + i * row] for i in range(a, b)], [[size, row]] * (b - a))
            assert all(x == size + row for x in codes), codes[:4]

    def read_warm(self, chains: list[list[str]]) -> float:
        """Every chain's objects into the warm buffer, one thread per chain, all at once."""
        ctypes.memset(self.addr, 0, self.n * self.size)
        starts, off = [], 0
        for keys in chains:
            starts.append(off)
            off += len(keys)
        if len(chains) == 1:
            t0 = time.perf_counter()
            self._get(chains[0], self.addr, self.rows_addr)
            return time.perf_counter() - t0
        barrier = threading.Barrier(len(chains) + 1)

        def one(keys, start):
            barrier.wait()
            self._get(keys, self.addr + start * self.size, self.rows_addr + start * self.row)

        threads = [threading.Thread(target=one, args=(k, s)) for k, s in zip(chains, starts)]
        for th in threads:
            th.start()
        barrier.wait()
        t0 = time.perf_counter()
        for th in threads:
            th.join()
        return time.perf_counter() - t0

    def read_cold(self, keys: list[str]) -> float:
        """Into a freshly mapped buffer no one has touched (registered, read, unregistered, unmapped)."""
        n = len(keys)
        m = mmap.mmap(-1, n * self.size)
        anchor = ctypes.c_char.from_buffer(m)
        addr = ctypes.addressof(anchor)
        assert self.s.register_buffer(addr, n * self.size) == 0
        try:
            t0 = time.perf_counter()
            self._get(keys, addr, self.rows_addr)
            return time.perf_counter() - t0
        finally:
            self.s.unregister_buffer(addr)
            del anchor
            m.close()

    def close(self) -> None:
        self.s.unregister_buffer(self.addr)
        self.s.unregister_buffer(self.rows_addr)
        self.s.close()


def table(r: dict):
    blocks, kib = med(r["blocks"]), int(med(r["block_bytes"])) >> 10
    conc = f"{int(med(r['concurrent_chains']))} chains x {int(med(r['concurrent_blocks_per_chain']))} blocks"
    return [
        ("sidecar_gbps", r["sidecar_gbps"], f"warm: restore op, L3 -> populated pool ({blocks:.0f} x {kib} KiB)"),
        ("raw_gbps", r["raw_gbps"], "baseline: raw batch_get_into_multi_buffers, same objects, warm buffer"),
        ("sidecar_vs_raw", r["sidecar_vs_raw"], "warm row; target >= 0.95"),
        ("cold_sidecar_gbps", r["cold_sidecar_gbps"], "cold: a sidecar that never populated its mapping"),
        ("cold_raw_gbps", r["cold_raw_gbps"], "baseline: raw into a freshly mapped, never-touched buffer"),
        ("cold_sidecar_vs_raw", r["cold_sidecar_vs_raw"], "cold row (reported)"),
        ("concurrent_sidecar_gbps", r["concurrent_sidecar_gbps"], f"{conc} restored at once, 1 read lane (default)"),
        ("concurrent_raw_gbps", r["concurrent_raw_gbps"], "baseline: raw, the same objects from 8 threads at once"),
        ("concurrent_vs_raw", r["concurrent_vs_raw"], "concurrent row; target >= 0.95"),
        ("concurrent_lanes8_gbps", r["concurrent_lanes8_gbps"], "the same with l3.read_lanes = 8"),
        ("concurrent_lanes8_vs_raw", r["concurrent_lanes8_vs_raw"], "(evidence for the read-lane default)"),
        ("sidecar_populate_s_per_gib", r["sidecar_populate_s_per_gib"], "the sidecar's background populate after ready"),
    ]
