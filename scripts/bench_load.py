"""Load benchmark: get + load of leased blocks into engine tensors vs plain memcpy, the
sidecar's CPU per get + release of 512 blocks, and index memory per resident block."""

from __future__ import annotations

import collections
import os
import time

import torch

from kvsidecar.connector.kv_client import KVConnector
from kvsidecar._native.copy import copy_bytes
from kvsidecar.shm.layout import KVLayout
from kvsidecar.sidecar.spawn import SidecarProcess

from scripts.trials import median as med


def _bench_load(quick: bool) -> dict:
    lay = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, tokens_per_block=64, tp_size=1)
    n_blocks = 64 if quick else 128
    instance = f"kvsbenchload{os.getpid()}"
    over = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    over["pool.num_blocks"] = n_blocks + 8
    res = {}
    with SidecarProcess(instance, overrides=over) as _sc:
        c = KVConnector(instance, lay)
        c.attach()
        shape = (n_blocks, lay.tokens_per_block, lay.heads_per_shard, lay.head_dim)
        src = [tuple(torch.randn(shape).half() for _ in range(2)) for _ in range(lay.num_layers)]
        dst = [tuple(torch.zeros(shape, dtype=torch.float16) for _ in range(2)) for _ in range(lay.num_layers)]
        chain = c.hasher.chain(list(range(n_blocks * lay.tokens_per_block)))
        st = c.store(chain)
        c.save(st, src, list(range(st.count)))
        c.commit(st)
        pages = list(range(n_blocks))
        nbytes = n_blocks * lay.block_bytes
        reps = 5 if quick else 10
        best_load = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            lease = c.get(chain)
            c.load(lease, dst, pages)
            c.release(lease)
            best_load = min(best_load, time.perf_counter() - t0)
        ok = all(torch.equal(dst[i][j], src[i][j]) for i in range(lay.num_layers) for j in range(2))
        # baseline: one plain memcpy of the same number of bytes, pool -> a pre-touched buffer
        buf = torch.zeros(nbytes, dtype=torch.uint8)
        best_cpy = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            copy_bytes(buf.data_ptr(), c.pool.address, nbytes)
            best_cpy = min(best_cpy, time.perf_counter() - t0)
        res.update(load_gbps=nbytes / best_load / 1e9, memcpy_gbps=nbytes / best_cpy / 1e9,
                   load_bytes=nbytes, load_blocks=n_blocks, load_correct=ok)
        res["load_vs_memcpy"] = res["load_gbps"] / res["memcpy_gbps"]
        c.detach()
    return res


class _FakeConn:
    def __init__(self):
        from kvsidecar.sidecar.runtime.clients import ClientInfo

        self.slot, self.token = 0, 1
        self.info = ClientInfo("bench", 0, 1, os.getpid())


def _bench_get_release(quick: bool) -> dict:
    """Sidecar CPU of the get and release handlers themselves (no transport), 512 blocks."""
    from kvsidecar.sidecar.config import load_config
    from kvsidecar.sidecar.kv.ops import KVCore

    class _Host:  # kvsidecar.sidecar.service.Host: what a service may use of the loop (no loop here)
        clients: dict = {}
        counters = collections.Counter()

        def post(self, fn, *a):
            fn(*a)

        def call_at(self, due, fn, *a):
            pass

        def reply(self, conn, rid, result=None, error=None):
            return True

    cfg = load_config(None, {"layout.num_layers": 1, "layout.head_dim": 8, "pool.num_blocks": 1024})
    lay = cfg.kv_layout()
    core = KVCore(_Host(), lay, 1024, cfg.limits)
    assert core.index.free == 1024
    conn = _FakeConn()
    from kvsidecar.connector.hashing import BlockHasher

    chain = BlockHasher(lay).chain(list(range(512 * lay.tokens_per_block)))
    st = core.op_store(conn, {"chain": chain})
    # the checksums a rank would send (their values do not matter to a GET's cost, only their size)
    core.op_commit(conn, {"staging": st["staging"], "sums": bytes(8 * 512)})
    n = 2000 if quick else 10000
    t0 = time.process_time()
    for _ in range(n):
        r = core.op_get(conn, {"chain": chain})
        core.op_release(conn, {"lease": r["lease"]})
    cpu = (time.process_time() - t0) / n
    assert core.check() == ""
    return {"get_release_us_512": cpu * 1e6}


def _bench_index_memory(quick: bool) -> dict:
    from kvsidecar._native.blockindex import BlockIndex
    from kvsidecar.sidecar.kv.index import unpack_ids

    n = 200_000 if quick else 1_000_000
    index = BlockIndex(n)
    chain_len = 1000
    blocks = unpack_ids(index.alloc(n))
    for i, b in enumerate(blocks):
        parent = -1 if i % chain_len == 0 else blocks[i - 1]
        index.publish(os.urandom(16), b, parent)
    assert index.check() == ""
    return {"index_blocks": n, "index_bytes_per_block": index.memory_bytes() / n}


def run(quick: bool = False) -> dict:
    res = {"quick": quick}
    res.update(_bench_load(quick))
    res.update(_bench_get_release(quick))
    res.update(_bench_index_memory(quick))
    res.update(_bench_teardown(quick))
    return res


def table(r: dict):
    return [
        ("load_gbps", r["load_gbps"], f"get + load of {med(r['load_blocks']):.0f} blocks ({int(med(r['load_bytes'])) >> 20} MiB) into engine tensors"),
        ("memcpy_gbps", r["memcpy_gbps"], "baseline: one plain memcpy of the same bytes"),
        ("load_vs_memcpy", r["load_vs_memcpy"], "target >= 0.80"),
        ("load_correct", r["load_correct"], "loaded tensors equal the stored ones"),
        ("get_release_us_512", r["get_release_us_512"], "sidecar CPU per get + release of 512 blocks; target <= 50"),
        ("index_bytes_per_block", r["index_bytes_per_block"], f"at {med(r['index_blocks']):.0f} resident blocks (native arrays + hash table)"),
        ("teardown_ms_per_gib_4k", r["teardown_ms_per_gib_4k"], "kill -9 of a process that touched the pool -> exit observed, 4 KiB pages"),
        ("teardown_ms_per_gib_huge", r["teardown_ms_per_gib_huge"] if r["teardown_ms_per_gib_huge"] is not None else "n/a",
         "same, hugetlbfs 2 MiB pages (n/a: no huge pages on this machine)"),
    ]


def _toucher(pool_name: str, conn) -> None:
    """Map the pool and touch every 4 KiB page, then wait to be killed."""
    from kvsidecar.shm.segment import Segment

    seg = Segment.attach(pool_name)
    view = seg.view
    total = 0
    for off in range(0, seg.size, 4096):
        total += view[off]
    conn.send(total)
    conn.recv()


def _teardown_ms(pool_name: str, size: int) -> float:
    """kill -9 of a process that mapped and touched the pool → its exit observable (pidfd)."""
    import multiprocessing as mp
    import select
    import signal

    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_toucher, args=(pool_name, b))
    p.start()
    a.recv()
    fd = os.pidfd_open(p.pid)
    t0 = time.perf_counter()
    os.kill(p.pid, signal.SIGKILL)
    select.select([fd], [], [], 10)
    dt = time.perf_counter() - t0
    os.close(fd)
    p.join(5)
    return dt * 1e3 / (size / (1 << 30))


def _bench_teardown(quick: bool) -> dict:
    size_gib = 0.5 if quick else 1.0
    lay = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, tokens_per_block=64, tp_size=1)
    blocks = int(size_gib * (1 << 30)) // lay.block_bytes
    over = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    over["pool.num_blocks"] = blocks
    res = {"teardown_pool_gib": size_gib}
    with SidecarProcess(f"kvsbenchtd{os.getpid()}", overrides=over) as sc:
        from kvsidecar.shm.control import ControlSegment
        from kvsidecar.shm.segment import Segment

        seg = Segment.attach(f"/kvsbenchtd{os.getpid()}.ctl", readonly=True)
        pool_name = ControlSegment(seg).pool_name
        seg.close()
        res["teardown_ms_per_gib_4k"] = min(_teardown_ms(pool_name, blocks * lay.block_bytes) for _ in range(3))
        del sc
    huge = _hugetlbfs_dir(blocks * lay.block_bytes)
    if huge:
        over["pool.hugepage_dir"] = huge
        with SidecarProcess(f"kvsbenchtdh{os.getpid()}", overrides=over):
            path = os.path.join(huge, f"kvsbenchtdh{os.getpid()}.pool")
            res["teardown_ms_per_gib_huge"] = min(_teardown_ms(path, blocks * lay.block_bytes) for _ in range(3))
    else:
        res["teardown_ms_per_gib_huge"] = None
    return res


def _hugetlbfs_dir(size: int):
    from kvsidecar.sidecar.kv.pool_memory import hugetlbfs_mount

    return hugetlbfs_mount(size)
