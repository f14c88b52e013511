#!/usr/bin/env python3
"""The main job: start a sidecar on its embedded defaults beside a small simulated engine
and print what happened, then the inspector's view.

    python scripts/demo.py
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from connector.client import SidecarClient  # noqa: E402
from sidecar.spawn import SidecarProcess  # noqa: E402

import inspect_shm  # noqa: E402


def rank_main(instance: str, rank: int, n: int, conn) -> None:
    c = SidecarClient(instance, group="demo-engine", rank=rank, group_size=2)
    c.attach()
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        r = c.call("ping", payload=i.to_bytes(8, "little"))
        lat.append(time.perf_counter() - t0)
        assert r["payload"] == i.to_bytes(8, "little")
    lat.sort()
    conn.send({"rank": rank, "requests": n, "p50_us": lat[n // 2] * 1e6, "p99_us": lat[int(n * 0.99)] * 1e6})
    conn.recv()
    c.detach()


def main() -> int:
    logging.basicConfig(level=logging.WARNING)
    instance = f"kvsdemo{os.getpid()}"
    ctx = mp.get_context("spawn")
    print(f"starting sidecar {instance!r} (embedded defaults)")
    with SidecarProcess(instance) as sc:
        print(f"  pid {sc.pid}, generation {sc.generation}")
        pipes, procs = [], []
        for rank in range(2):
            a, b = ctx.Pipe()
            p = ctx.Process(target=rank_main, args=(instance, rank, 5000, b))
            p.start()
            pipes.append(a)
            procs.append(p)
        print("\nsimulated engine: 2 TP ranks, each 5000 round trips through the rings")
        for a in pipes:
            r = a.recv()
            print(f"  rank {r['rank']}: {r['requests']} requests, p50 {r['p50_us']:.1f} us, p99 {r['p99_us']:.1f} us")
        time.sleep(0.15)  # let the sidecar publish its stats blob
        print("\ninspector view (read-only):")
        print(inspect_shm.render(inspect_shm.snapshot(instance)))
        for a in pipes:
            a.send("done")
        for p in procs:
            p.join(10)
    print("\nsidecar stopped; segments unlinked:", not any(n.startswith(instance) for n in os.listdir("/dev/shm")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
