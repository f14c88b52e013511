#!/usr/bin/env python3
"""Engine simulator with real processes: N TP ranks, each with a paged KV pool of CPU tensors,
restoring prefixes through a real kvsidecar process under each prefetch policy arm.

    python -m scripts.simulate [--quick] [--json PATH] [--l3 file|mooncake|auto]

(The wide policy sweep runs on the virtual-time simulator: ``python -m scripts.sim_sweep``;
both share the arms, the request model and the bounds.)

Each arm runs the same request stream (same seed) against a cold CPU pool and a warm L3
(a shaped file store, or Mooncake with --l3 mooncake).  The scheduler is SPMD like a real
engine: the leader (this process) runs one loop iteration at a time and every rank executes
the same step (same ``step`` number, same arrivals), replying before the next — the barrier a
real engine's collectives give.  Requests enter the queue (and prefetch) when they arrive; a
scan skips a request whose prefetch is still running and admits the first ready one (SGLang
continues to the next request); a scanned request is a scheduling candidate (``demand``).
A request's TTFT = first token time - arrival: queueing + prefetch wait + load + the prefill
of everything not restored (``compute_ms_per_ktok``).  Every loaded page is checked against
the KV the simulated model would have produced for it (``corrupt`` counts mismatches); every
rank must admit the same request with the same restored length at every step (``ranks_agree``).
Bounds on the same stream: the serial bound and the overlap oracle (scripts.sim_virtual.bounds_for).
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

from kvsidecar.shm.layout import KVLayout

from scripts import trials as trials_mod
from scripts.sim_virtual import ARMS, SimParams, bounds_for

STEP_S = 0.002  # one scheduler loop iteration while nothing is ready


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


class _Rank:
    """One TP rank: its adapter, its paged KV pool, its copy of the waiting queue."""

    def __init__(self, args: dict, rank: int):
        import torch

        from kvsidecar.connector.adapter import AdapterConfig, EngineAdapter

        self.args, self.rank = args, rank
        lay = self.layout = make_layout(args["tp"])
        self.T = lay.tokens_per_block
        kw = args.get("arm_kw")
        self.prefetch = kw is not None
        cfg = AdapterConfig(policy=(kw or {}).get("policy", "timeout"), chunk_max_blocks=(kw or {}).get("chunk_max_blocks"),
                            budget_s=args.get("budget_s") if (kw or {}).get("policy") in ("timeout", None) else None,
                            store_to_l3=args["store_to_l3"],
                            prefill_s_per_block=self.compute_s_per_block() or None)
        self.ad = EngineAdapter(args["instance"], lay, rank=rank, group=f"sim-{args['arm']}", config=cfg)
        shape = (args["engine_pages"], self.T, lay.heads_per_shard, lay.head_dim)
        self.kv = [tuple(torch.zeros(shape, dtype=torch.float16) for _ in range(lay.kv_factor))
                   for _ in range(lay.num_layers)]
        self.ad.kv_caches = self.kv
        self.base = _base(lay, rank)
        self.free_pages = list(range(args["engine_pages"] - 1, -1, -1))
        self.stream = {rid: (arr, toks) for arr, rid, toks in request_stream(
            args["seed"], args["requests"], args["n_prefixes"], args["prefix_tokens"], args["suffix_tokens"],
            args["gap_s"])}
        self.queue: list = []
        self.demanded: set = set()
        self.corrupt = 0
        self.ad.start()

    def compute_s_per_block(self) -> float:
        return self.args["compute_ms_per_ktok"] * self.T / 1024 / 1e3

    def alloc(self, n):
        if n > len(self.free_pages):
            return None
        return [self.free_pages.pop() for _ in range(n)]

    def eta_s(self, position: int) -> float | None:
        """When the request at ``position`` can start: the prefills ahead of it (the engine is idle now)."""
        return self.ad.eta_s(sum(len(self.stream[r][1]) // self.T for r in self.queue[:position]))

    def step(self, step: int, arrivals: list, t0: float):
        for rid in arrivals:
            self.queue.append(rid)
            if self.prefetch:
                self.ad.on_queue_entry(rid, self.stream[rid][1], eta_s=self.eta_s(len(self.queue) - 1))
        for pos, rid in enumerate(self.queue):
            if rid not in self.demanded:
                self.demanded.add(rid)
                self.ad.on_candidate(rid)
            ready, _ = self.ad.check_progress(rid, step, eta_s=self.eta_s(pos))
            if not ready:
                continue  # skipped: the scheduler goes on to the next request
            del self.queue[pos]
            return self.admit(rid, step, t0)
        return None

    def admit(self, rid: str, step: int, t0: float) -> dict:
        arr, toks = self.stream[rid]
        T = self.T
        n_blocks = len(toks) // T
        chain = self.ad.chain(rid, toks)
        t_admit = time.time() - t0
        slot = self.ad.admit(rid, toks, step, self.alloc)
        for j, p in enumerate(slot.pages[: slot.tokens // T]):
            if not page_ok(self.kv, self.base, p, chain[j * 16:(j + 1) * 16]):
                self.corrupt += 1
        restored = slot.tokens // T
        pages = slot.pages[:restored] + (self.alloc(n_blocks - restored) or [])
        compute_tokens = len(toks) - slot.tokens
        t_c = time.time()
        time.sleep(compute_tokens * self.args["compute_ms_per_ktok"] / 1024 / 1e3)  # prefill of the rest
        for j in range(restored, len(pages)):
            fill_page(self.kv, self.base, pages[j], chain[j * 16:(j + 1) * 16])
        ttft = time.time() - t0 - arr
        # (observability totals) the terminal session's status, asked by rank 0 outside the group
        # decisions (no step), so the ranks' own decisions are untouched
        status = "none"
        if self.rank == 0 and rid in self.ad.prefetching:
            status = self.ad.conn.poll(rid).get("status", "none")
        self.ad.commit_restore(rid)
        self.ad.store_after_prefill(rid, toks, pages, step)
        self.free_pages.extend(reversed(pages))
        return {"req": rid, "ttft_ms": ttft * 1e3, "queue_ms": (t_admit - arr) * 1e3, "restored_tokens": slot.tokens,
                "recomputed_tokens": compute_tokens, "tokens": len(toks), "prefill_ms": (time.time() - t_c) * 1e3,
                "status": status}


def rank_main(args: dict, rank: int, conn) -> None:
    """A rank process: executes the leader's steps until told to stop."""
    logging.basicConfig(level=logging.WARNING)
    r = _Rank(args, rank)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        _, step, arrivals, t0 = msg
        conn.send(r.step(step, arrivals, t0))
    conn.send({"rank": rank, "corrupt": r.corrupt, "degraded": r.ad.misses_degraded, "left": len(r.queue)})
    r.ad.close()


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def run_ranks(args: dict) -> dict:
    """The leader: start ``tp`` rank processes and drive them one SPMD step at a time."""
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for r in range(args["tp"]):
        a, b = ctx.Pipe()
        p = ctx.Process(target=rank_main, args=(args, r, b))
        p.start()
        pipes.append(a)
        procs.append(p)
    try:
        for a in pipes:
            if not a.poll(120) or a.recv() != "ready":
                raise RuntimeError("a simulator rank did not start")
        stream = request_stream(args["seed"], args["requests"], args["n_prefixes"], args["prefix_tokens"],
                                args["suffix_tokens"], args["gap_s"])
        t0 = time.time()
        i, step, waiting, results, disagreements = 0, 0, 0, [], 0
        deadline = t0 + 900
        while (i < len(stream) or waiting) and time.time() < deadline:
            now = time.time() - t0
            arrivals = []
            while i < len(stream) and stream[i][0] <= now:
                arrivals.append(stream[i][1])
                i += 1
            waiting += len(arrivals)
            step += 1
            for a in pipes:
                a.send(("step", step, arrivals, t0))
            replies = [a.recv() if a.poll(300) else "timeout" for a in pipes]
            if any(r == "timeout" for r in replies):
                raise RuntimeError("a simulator rank stopped answering")
            first = replies[0]
            if any((r or {}).get("req") != (first or {}).get("req") or
                   (r or {}).get("restored_tokens") != (first or {}).get("restored_tokens") for r in replies[1:]):
                disagreements += 1
            if first is not None:
                waiting -= 1
                results.append(first)
            elif not arrivals:
                nxt = stream[i][0] - (time.time() - t0) if i < len(stream) else STEP_S
                time.sleep(max(0.0, min(STEP_S, nxt)))  # the engine's next loop iteration
        for a in pipes:
            a.send(("stop",))
        outs = [a.recv() if a.poll(60) else None for a in pipes]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return {"results": results, "ranks": outs, "disagreements": disagreements, "steps": step}


def run_arm(arm: str, base_args: dict, sidecar_overrides: dict, arm_kw: dict | None = None,
            before_stop=None, while_running=None) -> dict:
    """``while_running(arm, instance, ranks_done)``: run in a thread from the sidecar's start until
    it returns (joined, bounded, before the sidecar stops); ``ranks_done`` is set once the ranks
    finished and the final stats were taken."""
    import threading

    from kvsidecar.sidecar.spawn import SidecarProcess

    args = dict(base_args, arm=arm, arm_kw=ARMS[arm] if arm_kw is None else arm_kw)
    args["instance"] = f"kvssim{os.getpid()}"
    with SidecarProcess(args["instance"], overrides=sidecar_overrides):
        ranks_done, watcher = threading.Event(), None
        if while_running is not None:
            watcher = threading.Thread(target=while_running, args=(arm, args["instance"], ranks_done), daemon=True)
            watcher.start()
        run = run_ranks(args)
        from kvsidecar.connector.client import SidecarClient

        with SidecarClient(args["instance"]) as c:
            stats = c.call("stats", check=True)
        ranks_done.set()
        if watcher is not None:
            watcher.join(60)
        if before_stop is not None:
            before_stop(args["instance"])
    res = run["results"]
    ttft = [r["ttft_ms"] for r in res]
    ranks = [o for o in run["ranks"] if o is not None]
    st = stats["stats"]
    return {"ttft_p50_ms": _pct(ttft, 0.5), "ttft_p90_ms": _pct(ttft, 0.9), "ttft_p99_ms": _pct(ttft, 0.99),
            "ttft_mean_ms": sum(ttft) / max(1, len(ttft)),
            "restored_tokens": sum(r["restored_tokens"] for r in res),
            "recomputed_tokens": sum(r["recomputed_tokens"] for r in res),
            "queue_mean_ms": sum(r["queue_ms"] for r in res) / max(1, len(res)),
            "corrupt": sum(o["corrupt"] for o in ranks), "ranks_agree": run["disagreements"] == 0 and len(ranks) == args["tp"],
            "requests": len(res), "steps": run["steps"], "invariants": stats.get("invariants", "?"),
            "leases_live": st["leases"].get("live", st["leases"].get("count", 0)) if isinstance(st.get("leases"), dict) else None,
            "sessions": st.get("sessions", {}), "l3": {k: v for k, v in st.get("l3", {}).items() if k in ("cost", "read_blocks_ok")},
            "degraded_misses": sum(o["degraded"] for o in ranks), "results": res,
            # observability totals, as the engine saw them (rank 0): policy, final status per request
            "policy": (args["arm_kw"] or {}).get("policy", "none"),
            "statuses": dict(collections.Counter(r["status"] for r in res))}


def bounds(base_args: dict, l3_bytes_per_s: float, latency_s: float, block_bytes: int) -> dict:
    """The serial bound and the overlap oracle on this stream, with this run's costs."""
    lay = make_layout(base_args["tp"])
    T = lay.tokens_per_block
    stream = request_stream(base_args["seed"], base_args["requests"], base_args["n_prefixes"],
                            base_args["prefix_tokens"], base_args["suffix_tokens"], base_args["gap_s"])
    from kvsidecar.connector.hashing import BlockHasher

    h = BlockHasher(lay)
    keyed = [(arr, rid, h.chain(toks)) for arr, rid, toks in stream]
    c = base_args["compute_ms_per_ktok"] * T / 1024 / 1e3
    p = SimParams(tokens_per_block=T, compute_s_per_block=c, copy_s_per_block=0.0,
                  l3_ratio=(block_bytes / l3_bytes_per_s) / c, l3_latency_s=latency_s,
                  pool_blocks=base_args["pool_blocks"])
    b = bounds_for(keyed, p)
    return {k: {"ttft_p50_ms": _pct(v, 0.5) * 1e3, "ttft_p90_ms": _pct(v, 0.9) * 1e3, "ttft_p99_ms": _pct(v, 0.99) * 1e3}
            for k, v in b.items()}


def warm_l3(base_args: dict, sidecar_overrides: dict) -> None:
    """Compute every distinct prompt once and write it to L3 (through the same engine path)."""
    args = dict(base_args, store_to_l3=True, gap_s=1e-6, compute_ms_per_ktok=0.0, budget_s=0.0)
    run_arm("warmup", args, sidecar_overrides, arm_kw={"policy": "timeout"})


def mooncake_available() -> bool:
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return False
    return shutil.which("mooncake_master") is not None


class _MooncakeL3:
    """A local master plus a long-lived "holder" sidecar (another node) that keeps the L3 objects."""

    def __init__(self, common: dict, base_args: dict):
        from kvsidecar.sidecar.l3.master import MooncakeMaster
        from kvsidecar.sidecar.spawn import SidecarProcess

        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        self.master = MooncakeMaster()
        mc = {"l3.backend": "mooncake", "l3.mooncake_master": self.master.address,
              "l3.mooncake_local_buffer_bytes": 16 << 20}
        holder = dict(common, **mc, **{"l3.mooncake_global_segment_bytes": 512 << 20})
        self.holder = SidecarProcess(f"kvssimholder{os.getpid()}", overrides=holder)
        args = dict(base_args, store_to_l3=True, gap_s=1e-6, compute_ms_per_ktok=0.0, budget_s=0.0)
        self._store_via(self.holder.instance, args)
        self.reader = dict(common, **mc, **{"l3.mooncake_global_segment_bytes": 0})

    @staticmethod
    def _store_via(instance: str, args: dict) -> None:
        # the warm-up arm runs its own sidecar; here the holder must do the writing itself
        run_ranks(dict(args, arm="warmup", arm_kw={"policy": "timeout"}, budget_s=0.0, instance=instance))
        from kvsidecar.connector.client import SidecarClient

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
                     compute_ms_per_ktok=50.0, engine_pages=600, store_to_l3=False, budget_s=budget_s,
                     pool_blocks=1400)
    mbps = l3_mbps if l3_mbps is not None else 200.0  # 25 MB/s: a 16K prefix (32 MiB) restores in ~1.3 s
    tmp = tempfile.mkdtemp(prefix="kvssim-")
    common = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    common.update({"pool.num_blocks": base_args["pool_blocks"], "l3.file_dir": os.path.join(tmp, "l3")})
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
        b = bounds(base_args, mbps * 1e6 / 8, 0.002, lay.block_bytes)
        out["serial_bound"], out["oracle"] = b["serial"], b["oracle"]
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
    print(f"{'arm':<20} {'TTFT p50':>9} {'TTFT p90':>9} {'TTFT p99':>9} {'vs whole':>8} {'restored':>9} "
          f"{'recomputed':>10} {'corrupt':>7} {'ranks agree':>11}")
    for arm, a in res["arms"].items():
        print(f"{arm:<20} {a['ttft_p50_ms']:>7.0f}ms {a['ttft_p90_ms']:>7.0f}ms {a['ttft_p99_ms']:>7.0f}ms "
              f"{a.get('ttft_p50_vs_whole_task', 0):>8.2f} {a['restored_tokens']:>9} {a['recomputed_tokens']:>10} "
              f"{a['corrupt']:>7} {str(a['ranks_agree']):>11}")
    for name in ("serial_bound", "oracle"):
        o = res[name]
        print(f"{name:<20} {o['ttft_p50_ms']:>7.0f}ms {o['ttft_p90_ms']:>7.0f}ms {o['ttft_p99_ms']:>7.0f}ms"
              f"  ({'same stream and queueing' if name == 'serial_bound' else 'needs compute/load overlap; report only'})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    p.add_argument("--l3-mbps", type=float)
    p.add_argument("--budget-s", type=float, default=0.25)
    p.add_argument("--arms", help="comma-separated subset of " + ",".join(ARMS))
    p.add_argument("--trials", type=int, default=1, help="repeat the whole run (arms interleaved); median [min..max]")
    p.add_argument("--l3", choices=["file", "mooncake", "auto"], default="file",
                   help="warm L3 on the embedded file store, or on a local Mooncake cluster (auto: if installed)")
    args = p.parse_args(argv)
    if args.l3 == "auto":
        args.l3 = "mooncake" if mooncake_available() else "file"
    logging.basicConfig(level=logging.WARNING)
    arms = args.arms.split(",") if args.arms else None
    runs = []
    for _ in range(args.trials):  # each trial runs every arm in turn: the arms are interleaved
        runs.append(simulate(args.quick, args.l3_mbps, args.budget_s, l3=args.l3, arms=arms))
        for a in runs[-1]["arms"].values():
            a.pop("results", None)
        print_table(runs[-1])
    out = runs[0] if args.trials == 1 else {"trials": args.trials, "aggregate": trials_mod.aggregate(runs)}
    if args.trials > 1:
        agg = out["aggregate"]["arms"]
        print(f"\nmedian [min..max] over {args.trials} interleaved trials:")
        for arm, a in agg.items():
            print(f"  {arm:<20} p50 {trials_mod.fmt(a['ttft_p50_ms'], 0):>20}  p90 {trials_mod.fmt(a['ttft_p90_ms'], 0):>20}"
                  f"  corrupt {trials_mod.fmt(a['corrupt'], 0)}  ranks agree {a['ranks_agree']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, sort_keys=True))
        print(f"\nJSON written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
