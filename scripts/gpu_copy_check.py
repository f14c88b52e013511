"""GPU-host check of the connector's CUDA copy path (needs CUDA; not run on CPU-only machines).

What the CPU suite cannot cover: a rank whose KV lives on the GPU, loading a leased prefix
straight out of the sidecar's shared mapping (``cudaHostRegister``-ed at attach) and saving
pages into staging blocks.  One run, about a minute:

    python -m scripts.gpu_copy_check [--layers 32 --kv-heads 8 --head-dim 128 --tokens-per-block 16]
        [--blocks 512] [--trials 7] [--json FILE]

1. starts a real sidecar (no L3) with that layout and attaches a ``KVConnector`` from a process
   whose torch already initialised CUDA (the attach registers the pool mapping);
2. saves ``--blocks`` blocks of random GPU pages into staging blocks and commits them (each
   ``cuda_copy`` mode in turn, checked byte for byte), then GETs the prefix;
3. per trial, interleaved: loads the leased prefix into fresh GPU pages with each mode (the
   per-region async copies, the gather kernels reading the registered mapping, and
   ``KVConnector.load`` as a rank calls it: default mode, loads verified), and the
   baselines measured in the same run: one contiguous host-to-device copy of the same bytes
   from pinned memory and from the registered mapping itself (what the bus can do);
4. checks every load against the saved pages (outside the timed interval) and the books;
   prints a table and one JSON: GB/s median [min..max] per path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid


def _stats(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--json")
    a = ap.parse_args(argv)

    import torch

    from kvsidecar.connector.kv_client import KVConnector
    from kvsidecar.shm.layout import KVLayout
    from kvsidecar.sidecar.spawn import SidecarProcess

    assert torch.cuda.is_available(), "this check needs CUDA"
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    torch.zeros(1, device=dev)  # CUDA initialised: the attach registers the mapping
    lay = KVLayout(model="gpu-copy-check", num_layers=a.layers, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
                   dtype="float16", tokens_per_block=a.tokens_per_block, tp_size=1)
    n = a.blocks
    over = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    over["pool.num_blocks"] = 2 * n + 16  # one chain saved by each mode
    instance = f"kvsgpu{uuid.uuid4().hex[:8]}"
    out = {"layout": lay.as_dict(), "blocks": n, "bytes": n * lay.shard_bytes, "device": torch.cuda.get_device_name(dev)}
    with SidecarProcess(instance, overrides=over):
        conn = KVConnector(instance, lay, rank=0)
        t = time.monotonic()
        conn.attach()
        assert conn.wait_populated(600)
        out["attach"] = dict(conn.populate_stats(), wall_s=time.monotonic() - t)
        assert out["attach"].get("cuda_registered"), out["attach"]
        pages = 2 * n + 8
        src = [tuple(torch.randint(-1000, 1000, (pages, lay.tokens_per_block, lay.heads_per_shard, lay.head_dim),
                                   device=dev).half() for _ in range(lay.kv_factor)) for _ in range(lay.num_layers)]
        dst = [tuple(torch.zeros_like(t) for t in layer) for layer in src]
        src_pages = list(range(n))
        perm = torch.randperm(pages - n, generator=torch.Generator().manual_seed(1)).tolist()
        dst_pages = [n + p for p in perm[:n]]  # scattered engine pages, as a real allocator hands out

        def same(kv_a, pa, kv_b, pb) -> bool:
            ia, ib = torch.tensor(pa, device=dev), torch.tensor(pb, device=dev)
            return all(torch.equal(x.index_select(0, ia), y.index_select(0, ib))
                       for la, lb in zip(kv_a, kv_b) for x, y in zip(la, lb))

        # save (GPU pages -> staging blocks), each mode into its own chain, checked on the way back
        out["save"] = {}
        leases = {}
        for i, mode in enumerate(("regions", "gather")):
            conn.copier.cuda_copy = mode
            chain = conn.hasher.chain([i * 7 + 1] * (n * lay.tokens_per_block))
            took = 0.0
            while True:  # a store stages at most a bounded span per call: the chain in pieces
                st = conn.store(chain)
                if st.count == 0:
                    break
                torch.cuda.synchronize()
                t = time.perf_counter()
                conn.save(st, src, src_pages[st.start:st.start + st.count])
                took += time.perf_counter() - t
                assert conn.commit(st)["published"]
            out["save"][mode] = {"s": took, "GBps": n * lay.shard_bytes / took / 1e9}
            leases[mode] = conn.get(chain)
            assert leases[mode].count == n
        lease = leases["regions"]
        for mode in ("regions", "gather"):  # what each mode saved reads back identically
            conn.copier.cuda_copy = "regions"
            for layer in dst:
                for t_ in layer:
                    t_.zero_()
            conn.copier.load(leases[mode].blocks, dst, dst_pages)
            assert same(src, src_pages, dst, dst_pages), f"{mode} save did not round-trip"

        nbytes = n * lay.shard_bytes
        pinned = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
        gpu_buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        from kvsidecar.connector.kv_copy import _DeviceView

        pool_dev = torch.as_tensor(_DeviceView(conn.pool.address, conn.pool.size), device=dev)
        lo = lease.blocks[0] * lay.block_bytes
        contiguous = all(b == lease.blocks[0] + j for j, b in enumerate(lease.blocks))
        timings = {k: [] for k in ("regions", "gather", "connector_load", "pinned_h2d", "mapping_h2d")}
        bad = 0
        for _ in range(a.trials):
            for path in timings:
                for layer in dst:
                    for t_ in layer:
                        t_.zero_()
                torch.cuda.synchronize()
                t = time.perf_counter()
                if path in ("regions", "gather"):
                    conn.copier.cuda_copy = path
                    conn.copier.load(lease.blocks, dst, dst_pages)
                elif path == "connector_load":  # what a rank calls: the default mode, loads verified
                    conn.copier.cuda_copy = "gather"
                    conn.load(lease, dst, dst_pages)
                elif path == "pinned_h2d":
                    gpu_buf.copy_(pinned, non_blocking=True)
                else:
                    gpu_buf.copy_(pool_dev[lo:lo + nbytes])
                torch.cuda.synchronize()
                timings[path].append(time.perf_counter() - t)
                if path in ("regions", "gather", "connector_load") and not same(src, src_pages, dst, dst_pages):
                    bad += 1
        out["load"] = {k: {"s": _stats(v), "GBps": _stats([nbytes / x / 1e9 for x in v])} for k, v in timings.items()}
        out["load_corrupt"] = bad
        out["lease_blocks_contiguous"] = contiguous
        for ls in leases.values():
            conn.release(ls)
        s = conn.stats(check=True)
        out["invariants"] = s["invariants"]
        out["leases_live"] = s["leases"]["live"]
        conn.close()
    print(f"\nGPU copy check: {out['device']}, {lay.num_layers} layers x {lay.kv_factor} x region {lay.region_bytes} B, "
          f"{n} blocks = {nbytes / 2**20:.0f} MiB; attach registered the pool in {out['attach'].get('seconds', 0):.2f} s")
    print(f"{'path':<14} {'GB/s median':>12} {'[min..max]':>18}")
    for k, v in out["load"].items():
        g = v["GBps"]
        print(f"{k:<14} {g['median']:>12.2f} {'[' + format(g['min'], '.2f') + '..' + format(g['max'], '.2f') + ']':>18}")
    for k, v in out["save"].items():
        print(f"save {k:<9} {v['GBps']:>12.2f}  (one sample)")
    print(f"corrupt loads {bad}; leases live {out['leases_live']}; invariants {out['invariants'] or 'ok'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if bad == 0 and not out["invariants"] and out["leases_live"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
