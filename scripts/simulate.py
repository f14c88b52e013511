#!/usr/bin/env python3
"""Engine simulator: N TP ranks as processes, each with a paged KV pool of CPU tensors and an
SPMD scheduler loop, restoring prefixes through kvsidecar under each prefetch policy arm.

    python scripts/simulate.py [--quick] [--json PATH] [--sweep]

Each arm runs the same request stream (same seed) against a cold CPU pool and a warm L3
(a shaped file store, or Mooncake with --mooncake).  A request's TTFT = first token time -
arrival: queueing + prefetch wait + load + the prefill of everything not restored
(``compute_ms_per_ktok``).  Every loaded page is checked against the KV the simulated model
would have produced for it (``corrupt`` counts mismatches).  The oracle per request is the
best TTFT the same L3 and compute speeds allow: restore k blocks and recompute the rest
with perfect overlap, ``min_k max(transfer(k), compute(n - k))``.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import multiprocessing as mp
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from shm.layout import KVLayout

ARMS = {
    "whole_task": dict(policy="wait_complete"),
    "one_graph_timeout": dict(policy="timeout", chunk_max_blocks=1 << 20),
    "timeout_chunk128": dict(policy="timeout", chunk_max_blocks=128),
    "timeout_chunk32": dict(policy="timeout", chunk_max_blocks=32),
    "best_effort": dict(policy="best_effort", chunk_max_blocks=32),
}


def make_layout(tp: int) -> KVLayout:
    return KVLayout(model="sim", num_layers=4, num_kv_heads=4, head_dim=32, dtype="float16",
                    tokens_per_block=64, tp_size=tp)


def request_stream(seed: int, n: int, n_prefixes: int, prefix_tokens: int, suffix_tokens: int, gap_s: float):
    """(arrival_s, req_id, tokens): shared system prompts, unique suffixes, some multi-turn follow-ups."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 32000) for _ in range(prefix_tokens)] for _ in range(n_prefixes)]
    out, t = [], 0.0
    for i in range(n):
        if out and rng.random() < 0.25:  # a follow-up turn of an earlier conversation
            base = rng.choice(out)[2]
        else:
            base = prefixes[rng.randrange(n_prefixes)]
        toks = base + [rng.randrange(1, 32000) for _ in range(suffix_tokens)]
        out.append((t, f"r{i}", toks))
        t += rng.expovariate(1.0 / gap_s)
    return out


# -- the simulated model's KV: a pure function of the block key, so every load can be checked ----
def _base(layout: KVLayout, rank: int):
    import torch

    g = torch.Generator().manual_seed(1234 + layout.shard_of(rank))
    shape = (layout.tokens_per_block, layout.heads_per_shard, layout.head_dim)
    return [[torch.randint(-100, 100, shape, generator=g).to(torch.float16) for _ in range(layout.kv_factor)]
            for _ in range(layout.num_layers)]


def _seed(key: bytes) -> int:
    return int.from_bytes(key[:4], "little") % 997


def fill_page(kv, base, page: int, key: bytes) -> None:
    s = float(_seed(key))
    for layer, tensors in enumerate(kv):
        for k, t in enumerate(tensors):
            t[page].copy_(base[layer][k] + s)


def page_ok(kv, base, page: int, key: bytes) -> bool:
    s = float(_seed(key))
    import torch

    return all(torch.equal(t[page], base[layer][k] + s) for layer, tensors in enumerate(kv)
               for k, t in enumerate(tensors))


def rank_main(args: dict, rank: int, conn) -> None:
    import torch

    from connector.adapter import AdapterConfig, EngineAdapter

    logging.basicConfig(level=logging.WARNING)
    lay = make_layout(args["tp"])
    T = lay.tokens_per_block
    cfg = AdapterConfig(policy=args["policy"], chunk_max_blocks=args.get("chunk_max_blocks"),
                        budget_s=args.get("budget_s"), store_to_l3=args["store_to_l3"])
    ad = EngineAdapter(args["instance"], lay, rank=rank, group=f"sim-{args['arm']}", config=cfg)
    pages_total = args["engine_pages"]
    shape = (pages_total, T, lay.heads_per_shard, lay.head_dim)
    kv = [tuple(torch.zeros(shape, dtype=torch.float16) for _ in range(lay.kv_factor)) for _ in range(lay.num_layers)]
    ad.kv_caches = kv
    base = _base(lay, rank)
    free_pages = list(range(pages_total - 1, -1, -1))

    def alloc(n):
        if n > len(free_pages):
            return None
        return [free_pages.pop() for _ in range(n)]

    ad.start()
    stream = request_stream(args["seed"], args["requests"], args["n_prefixes"], args["prefix_tokens"],
                            args["suffix_tokens"], args["gap_s"])
    conn.send("ready")
    t0 = conn.recv()  # a common start time for every rank
    while time.time() < t0:
        time.sleep(0.0005)
    queue, results, step, i = [], [], 0, 0
    demanded = set()
    while i < len(stream) or queue:
        step += 1
        now = time.time() - t0
        while i < len(stream) and stream[i][0] <= now:
            arr, rid, toks = stream[i]
            queue.append((arr, rid, toks))
            ad.on_queue_entry(rid, toks)
            i += 1
        if not queue:
            time.sleep(min(0.002, max(0.0, stream[i][0] - now)) if i < len(stream) else 0.001)
            continue
        arr, rid, toks = queue[0]
        if rid not in demanded:
            ad.on_candidate(rid)
            demanded.add(rid)
        ready, _ = ad.check_progress(rid, step)
        if not ready:
            time.sleep(0.001)  # the scheduler would run decode batches meanwhile
            continue
        # (observability totals) the terminal session's status, asked by rank 0 outside the group
        # decisions (no step), so the ranks' own decisions are untouched
        status = "none"
        if rank == 0 and rid in ad.prefetching:
            status = ad.conn.poll(rid).get("status", "none")
        n_blocks = len(toks) // T
        chain = ad.chain(rid, toks)
        slot = ad.admit(rid, toks, step, alloc)
        corrupt = 0
        for j, p in enumerate(slot.pages[: slot.tokens // T]):
            if not page_ok(kv, base, p, chain[j * 16:(j + 1) * 16]):
                corrupt += 1
        restored_blocks = slot.tokens // T
        rest = alloc(n_blocks - restored_blocks) or []
        pages = slot.pages[:restored_blocks] + rest
        compute_tokens = len(toks) - slot.tokens
        time.sleep(compute_tokens * args["compute_ms_per_ktok"] / 1024 / 1e3)  # prefill of the rest
        for j in range(restored_blocks, len(pages)):
            fill_page(kv, base, pages[j], chain[j * 16:(j + 1) * 16])
        ttft = time.time() - t0 - arr
        ad.commit_restore(rid)
        ad.store_after_prefill(rid, toks, pages, step)
        free_pages.extend(reversed(pages))
        queue.pop(0)
        results.append({"req": rid, "ttft_ms": ttft * 1e3, "restored_tokens": slot.tokens,
                        "recomputed_tokens": compute_tokens, "corrupt": corrupt, "tokens": len(toks),
                        "status": status})
    conn.send({"rank": rank, "results": results, "degraded": ad.misses_degraded})
    ad.close()


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def run_ranks(args: dict) -> list:
    """Start ``tp`` rank processes on one shared start time; returns each rank's report."""
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for r in range(args["tp"]):
        a, b = ctx.Pipe()
        p = ctx.Process(target=rank_main, args=(args, r, b))
        p.start()
        pipes.append(a)
        procs.append(p)
    for a in pipes:
        assert a.poll(120) and a.recv() == "ready"
    t0 = time.time() + 0.2
    for a in pipes:
        a.send(t0)
    outs = [a.recv() if a.poll(900) else None for a in pipes]
    for p in procs:
        p.join(30)
    return outs


def run_arm(arm: str, base_args: dict, sidecar_overrides: dict, arm_kw: dict | None = None,
            before_stop=None, while_running=None) -> dict:
    """``while_running(arm, instance, ranks_done)``: run in a thread from the sidecar's start until
    it returns (joined, bounded, before the sidecar stops); ``ranks_done`` is set once the ranks
    finished and the final stats were taken."""
    import threading

    from sidecar.spawn import SidecarProcess

    args = dict(base_args, arm=arm, **(ARMS[arm] if arm_kw is None else arm_kw))
    args["instance"] = f"kvssim{os.getpid()}"
    with SidecarProcess(args["instance"], overrides=sidecar_overrides):
        ranks_done, watcher = threading.Event(), None
        if while_running is not None:
            watcher = threading.Thread(target=while_running, args=(arm, args["instance"], ranks_done), daemon=True)
            watcher.start()
        outs = run_ranks(args)
        from connector.client import SidecarClient

        with SidecarClient(args["instance"]) as c:
            stats = c.call("stats", check=True)
        ranks_done.set()
        if watcher is not None:
            watcher.join(60)
        if before_stop is not None:
            before_stop(args["instance"])
    res0 = outs[0]["results"]
    corrupt = sum(r["corrupt"] for o in outs for r in o["results"])
    same = all(o["results"] and [(r["restored_tokens"]) for r in o["results"]] ==
               [(r["restored_tokens"]) for r in res0] for o in outs)
    ttft = [r["ttft_ms"] for r in res0]
    return {"ttft_p50_ms": _pct(ttft, 0.5), "ttft_p99_ms": _pct(ttft, 0.99), "ttft_mean_ms": sum(ttft) / len(ttft),
            "restored_tokens": sum(r["restored_tokens"] for r in res0),
            "recomputed_tokens": sum(r["recomputed_tokens"] for r in res0), "corrupt": corrupt,
            "ranks_agree": same, "requests": len(res0), "invariants": stats.get("invariants", "?"),
            "sessions": stats["stats"].get("sessions", {}), "degraded_misses": sum(o["degraded"] for o in outs),
            # observability totals, as the engine saw them (rank 0): policy, final status per request
            "policy": args["policy"], "statuses": dict(collections.Counter(r["status"] for r in res0))}


def oracle(base_args: dict, l3_bytes_per_s: float, latency_s: float, block_bytes: int) -> dict:
    T = 64
    ttfts = []
    for _, _, toks in request_stream(base_args["seed"], base_args["requests"], base_args["n_prefixes"],
                                     base_args["prefix_tokens"], base_args["suffix_tokens"], base_args["gap_s"]):
        n = len(toks) // T
        best = float("inf")
        for k in range(0, n + 1):
            transfer = (latency_s + k * block_bytes / l3_bytes_per_s) if k else 0.0
            compute = (len(toks) - k * T) * base_args["compute_ms_per_ktok"] / 1024 / 1e3
            best = min(best, max(transfer, compute))
        ttfts.append(best * 1e3)
    return {"ttft_p50_ms": _pct(ttfts, 0.5), "ttft_p99_ms": _pct(ttfts, 0.99)}


def warm_l3(base_args: dict, sidecar_overrides: dict) -> None:
    """Compute every distinct prompt once and write it to L3 (through the same engine path)."""
    args = dict(base_args, store_to_l3=True, gap_s=1e-6, compute_ms_per_ktok=0.0)
    run_arm("warmup", args, sidecar_overrides, arm_kw={"policy": "timeout", "budget_s": 0.0})


def mooncake_available() -> bool:
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return False
    return shutil.which("mooncake_master") is not None


class _MooncakeL3:
    """A local master plus a long-lived "holder" sidecar (another node) that keeps the L3 objects."""

    def __init__(self, common: dict, base_args: dict):
        from sidecar.l3.master import MooncakeMaster
        from sidecar.spawn import SidecarProcess

        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        self.master = MooncakeMaster()
        mc = {"l3.backend": "mooncake", "l3.mooncake_master": self.master.address,
              "l3.mooncake_local_buffer_bytes": 16 << 20}
        holder = dict(common, **mc, **{"l3.mooncake_global_segment_bytes": 512 << 20})
        self.holder = SidecarProcess(f"kvssimholder{os.getpid()}", overrides=holder)
        args = dict(base_args, store_to_l3=True, gap_s=1e-6, compute_ms_per_ktok=0.0)
        self._store_via(self.holder.instance, args)
        self.reader = dict(common, **mc, **{"l3.mooncake_global_segment_bytes": 0})

    @staticmethod
    def _store_via(instance: str, args: dict) -> None:
        # the warm-up arm runs its own sidecar; here the holder must do the writing itself
        run_ranks(dict(args, arm="warmup", policy="timeout", budget_s=0.0, instance=instance))
        from connector.client import SidecarClient

        with SidecarClient(instance) as c:  # wait for the write-behind to land in Mooncake
            deadline = time.monotonic() + 120
            while c.call("stats")["stats"]["l3"]["puts_in_flight"] and time.monotonic() < deadline:
                time.sleep(0.02)

    def close(self) -> None:
        self.holder.stop()
        self.master.stop()


def simulate(quick: bool, l3_mbps: float | None = None, budget_s: float | None = None, arms=None,
             l3: str = "file", before_stop=None, prefix_tokens: int = 16384, requests: int | None = None,
             sidecar_overrides: dict | None = None, while_running=None) -> dict:
    """``sidecar_overrides``: extra config for the arms' sidecars (not the warm-up's), e.g. metrics;
    ``while_running``: see :func:`run_arm` (every arm)."""
    lay = make_layout(2)
    base_args = dict(tp=2, seed=11, requests=requests or (6 if quick else 16), n_prefixes=2,
                     prefix_tokens=prefix_tokens, suffix_tokens=128,
                     gap_s=(0.8 if quick else 0.9) * prefix_tokens / 16384,
                     compute_ms_per_ktok=50.0, engine_pages=600, store_to_l3=False, budget_s=budget_s)
    mbps = l3_mbps if l3_mbps is not None else 200.0  # 25 MB/s: a 16K prefix (32 MiB) restores in ~1.3 s
    tmp = tempfile.mkdtemp(prefix="kvssim-")
    common = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    common.update({"pool.num_blocks": 1400, "l3.file_dir": os.path.join(tmp, "l3")})
    mc = None
    try:
        if l3 == "mooncake":
            mc = _MooncakeL3(common, base_args)
            shaped = dict(mc.reader, **{"l3.bandwidth_mbps": mbps, "l3.latency_ms": 2.0})
        else:
            warm_l3(base_args, common)
            shaped = dict(common, **{"l3.bandwidth_mbps": mbps, "l3.latency_ms": 2.0})
        out = {"quick": quick, "l3": l3, "l3_mbps": mbps, "budget_s": budget_s, "compute_ms_per_ktok": 50.0,
               "prefix_tokens": 16384, "tp": 2, "arms": {}}
        arm_list = arms or list(ARMS)
        shaped.update(sidecar_overrides or {})
        for arm in arm_list:
            out["arms"][arm] = run_arm(arm, base_args, shaped, while_running=while_running,
                                       before_stop=before_stop if arm == arm_list[-1] else None)
        out["prefix_tokens"] = prefix_tokens
        out["oracle"] = oracle(base_args, mbps * 1e6 / 8, 0.002, lay.block_bytes)
        w = out["arms"].get("whole_task")
        if w:
            for a in out["arms"].values():
                a["ttft_p50_vs_whole_task"] = a["ttft_p50_ms"] / w["ttft_p50_ms"]
        return out
    finally:
        if mc is not None:
            mc.close()
        shutil.rmtree(tmp, ignore_errors=True)


def print_table(res: dict) -> None:
    print(f"\nengine simulator: TP={res['tp']}, {res['prefix_tokens']}-token shared prefixes, L3 {res.get('l3', 'file')} "
          f"shaped to {res['l3_mbps']:.0f} Mbit/s, "
          f"prefill {res['compute_ms_per_ktok']:.0f} ms/Ktok, budget {res['budget_s'] or 'sidecar default'}")
    print(f"{'arm':<20} {'TTFT p50':>9} {'TTFT p99':>9} {'vs whole':>8} {'restored':>9} {'recomputed':>10} "
          f"{'corrupt':>7} {'ranks agree':>11}")
    for arm, a in res["arms"].items():
        print(f"{arm:<20} {a['ttft_p50_ms']:>8.0f}ms {a['ttft_p99_ms']:>8.0f}ms {a.get('ttft_p50_vs_whole_task', 0):>8.2f} "
              f"{a['restored_tokens']:>9} {a['recomputed_tokens']:>10} {a['corrupt']:>7} {str(a['ranks_agree']):>11}")
    o = res["oracle"]
    print(f"{'oracle':<20} {o['ttft_p50_ms']:>8.0f}ms {o['ttft_p99_ms']:>8.0f}ms  (per request, no queueing)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    p.add_argument("--sweep", action="store_true", help="three L3 speeds x two timeout budgets")
    p.add_argument("--l3-mbps", type=float)
    p.add_argument("--budget-s", type=float, default=0.25)
    p.add_argument("--l3", choices=["file", "mooncake", "auto"], default="file",
                   help="warm L3 on the embedded file store, or on a local Mooncake cluster (auto: if installed)")
    args = p.parse_args(argv)
    if args.l3 == "auto":
        args.l3 = "mooncake" if mooncake_available() else "file"
    logging.basicConfig(level=logging.WARNING)
    if args.sweep:
        results = []
        for mbps in (800.0, 400.0, 200.0):  # restore faster than, about equal to, slower than recompute
            for budget in (0.15, 0.6):
                r = simulate(args.quick, mbps, budget, arms=["whole_task", "timeout_chunk128", "timeout_chunk32"])
                print_table(r)
                results.append(r)
        out = {"sweep": results}
    else:
        out = simulate(args.quick, args.l3_mbps, args.budget_s, l3=args.l3)
        print_table(out)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, sort_keys=True))
        print(f"\nJSON written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
