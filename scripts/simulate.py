"""Engine simulator with real processes: N TP ranks, each with a paged KV pool of CPU tensors,
restoring prefixes through a real kvsidecar process under each prefetch policy arm.

    python -m scripts.simulate [--quick] [--json PATH] [--l3 file|mooncake|auto] [--requests N]
        [--load L] [--tp N] [--l3-mbps M] [--trials K] [--timeline]
    python -m scripts.simulate --table [--requests 48 --trials 3] [--twin] [--json PATH] [--plot FILE.png]

(The wide policy sweep runs on the virtual-time simulator: ``python -m scripts.sim_sweep``.)

Each arm runs the same request stream (same seed) against a cold CPU pool and a warm L3
(a shaped file store, or Mooncake with --l3 mooncake).  The stream has shared system prompts,
follow-up turns (a conversation's next turn extends its previous prompt) and a sidecar pool
smaller than the working set (pool hits and evictions).  ``--load`` sets Poisson arrivals at
that fraction of the no-prefetch engine's capacity (0: idle, each request arrives after the
previous could have finished).  The scheduler is SPMD like a real engine: the leader (this
process) runs one loop iteration at a time and every rank executes the same step (same
``step``, same arrivals), replying before the next.  Requests enter the queue (and prefetch) at
the first iteration after they arrive; a scan skips a request whose prefetch is still running
and admits the first ready one; a scanned request is a scheduling candidate (``demand``).  With
nothing ready and the device free, the loop sleeps until the first queued request still
prefetching has ended (rank 0's ``wait``: the sidecar's answer wakes it), at most one 2 ms step.

What is measured is the product's path: TTFT = end of the modelled prefill - arrival, i.e.
queueing + prefetch wait + the GET (lease) + the copy into the engine's pages + the prefill of
everything not restored (``compute_ms_per_ktok``, a sleep).  The simulator's own checking
(every loaded page against the KV the model would have produced, ``corrupt``; filling the
recomputed pages) is not charged to TTFT: the fill runs on a helper thread of each rank once every
rank has admitted (started earlier, it took the CPU from a rank still admitting) and ends before
the request's store (``sim_overhead_ms`` reports any wait for it past the prefill); the check of
the restored pages runs after the arm's timed loop (each rank's engine pages hold a whole table
arm's unchecked: ``sim_ranks.PageChecks``; ``checked_in_run`` counts pages a longer stream had
to check in the run).  The group's
prefill ends with its slowest rank's (``rank_skew_ms``: how much after rank 0's).  Every rank
must admit the same request with the same restored length at every step (``ranks_agree``).  Rank 0 stamps a per-request timeline
(``--timeline``) joined with the session's own events from the sidecar (``poll`` with
``events``); bounds are computed from the rates this run achieved (``scripts.ttft_bounds``).
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import shutil
import tempfile
import time

from scripts import trials as trials_mod
from scripts import ttft_bounds
from scripts.sim_ranks import (RankPool, bad_pages, fill_page, fill_pages, make_layout, page_ok,  # noqa: F401
                               rank_main, request_stream, stream_of)
from scripts.sim_virtual import ARMS
from scripts.common import percentile, write_json

STEP_S = 0.002  # one scheduler loop iteration while nothing is ready


_pct = percentile  # (the nearest-rank quantile every benchmark shares: scripts.common)


def _ask_ranks(pipes, msg, timeout_s: float = 300.0) -> list:
    """``msg`` to every rank, then every rank's answer (each wait bounded)."""
    for a in pipes:
        a.send(msg)
    replies = []
    for a in pipes:
        if not a.poll(timeout_s):
            raise RuntimeError("a simulator rank stopped answering")
        replies.append(a.recv())
    return replies


def run_ranks(args: dict, pool: RankPool | None = None) -> dict:
    """The leader: drive the ranks (``pool``, or ``tp`` fresh ones) one SPMD step at a time."""
    if pool is None:
        with RankPool(args["tp"]) as own:
            return run_ranks(args, own)
    pipes = pool.pipes
    for a in pipes:
        a.send(("arm", args))
    for a in pipes:
        if not a.poll(120) or a.recv() != "ready":
            raise RuntimeError("a simulator rank did not start its arm")
    stream = stream_of(args)
    t0 = time.monotonic()
    i, step, waiting, results, disagreements = 0, 0, 0, [], 0
    skews: dict = {}  # admitted request -> the slowest rank's prefill end after rank 0's (ms)
    busy_until = None  # when the running prefill ends on every rank
    deadline = t0 + 900
    while (i < len(stream) or waiting) and time.monotonic() < deadline:
        now = time.monotonic() - t0
        arrivals = []
        while i < len(stream) and stream[i][0] <= now:
            arrivals.append(stream[i][1])
            i += 1
        waiting += len(arrivals)
        step += 1
        # one verdict for every rank: has the running prefill ended (SPMD: the same step for all)
        if busy_until is not None and time.monotonic() >= busy_until:
            # every rank completes it, its store committed, before any rank scans again: the next
            # admission sees what the prefill computed, as an engine's own prefix cache would (when
            # the scan raced the last rank's commit, a request admitted right after the first of
            # its prefix recomputed it on a coin flip: 0.2 ms either way at TP 2 and 4)
            dones = _ask_ranks(pipes, ("complete", t0, busy_until))
            done = dones[0]
            if any(d["req"] != done["req"] for d in dones[1:]):
                disagreements += 1
            waiting -= 1
            done["rank_skew_ms"] = skews.pop(done["req"], 0.0)
            # its blocks are published once every rank's store committed: the last rank's
            done["stored_ms"] = max(d["stored_ms"] for d in dones)
            if "timeline" in done:
                done["timeline"]["stored"] = round(done["stored_ms"], 3)
            results.append(done)
            busy_until = None
        replies = _ask_ranks(pipes, ("step", step, arrivals, t0))
        first = replies[0]
        if any(r["admitted"] != first["admitted"] for r in replies[1:]):
            disagreements += 1
        if first["admitted"] is not None:
            for a in pipes:  # every rank admitted: now each fills what it computes (not charged)
                a.send(("fill",))
            busy_until = max(r["end"] for r in replies if r["end"] is not None)
            # the group's prefill ends with its slowest rank's: how much later than rank 0's
            skews[first["admitted"][0]] = (busy_until - first["end"]) * 1e3
        if first["admitted"] is None and not arrivals:
            nxt = stream[i][0] - (time.monotonic() - t0) if i < len(stream) else STEP_S
            if busy_until is not None:
                nxt = min(nxt, busy_until - time.monotonic())
            queued = waiting - (busy_until is not None)
            # nothing queued: the loop blocks until the next arrival or the prefill's end (as an
            # engine's blocking receive would).  Requests queued, none ready, the device free:
            # rank 0 waits for the first one still prefetching to end (the sidecar's answer wakes
            # it), at most one loop step; else the next iteration looks at the queue again.
            budget = max(0.0, nxt if queued <= 0 else min(STEP_S, nxt))
            if queued > 0 and busy_until is None and budget > 0:
                pipes[0].send(("wait", budget))
                if not pipes[0].poll(budget + 30):
                    raise RuntimeError("a simulator rank stopped answering")
                if pipes[0].recv():
                    continue
            time.sleep(budget)
    for a in pipes:
        a.send(("stop",))
    outs = [a.recv() if a.poll(60) else None for a in pipes]
    return {"results": results, "ranks": outs, "disagreements": disagreements, "steps": step}


def run_arm(arm: str, base_args: dict, sidecar_overrides: dict, arm_kw: dict | None = None,
            before_stop=None, while_running=None, pool: RankPool | None = None, arms: dict | None = None) -> dict:
    """``while_running(arm, instance, ranks_done)``: run in a thread from the sidecar's start until
    it returns (joined, bounded, before the sidecar stops); ``ranks_done`` is set once the ranks
    finished and the final stats were taken."""
    import threading

    from kvsidecar.sidecar.spawn import SidecarProcess

    table = arms or ARMS
    args = dict(base_args, arm=arm, arm_kw=table[arm] if arm_kw is None else arm_kw)
    args["instance"] = f"kvssim{os.getpid()}"
    # an arm may set sidecar config of its own (``"sidecar": {...}`` in its table entry: an A/B of
    # a sidecar setting under one policy, interleaved like every other arm)
    overrides = dict(sidecar_overrides, **((args["arm_kw"] or {}).get("sidecar") or {}))
    with SidecarProcess(args["instance"], overrides=overrides):
        ranks_done, watcher = threading.Event(), None
        if while_running is not None:
            watcher = threading.Thread(target=while_running, args=(arm, args["instance"], ranks_done), daemon=True)
            watcher.start()
        from kvsidecar.connector.client import SidecarClient

        with SidecarClient(args["instance"]) as c:  # (its start-up work is not the arm's)
            busy0 = c.call("stats")["stats"].get("busy") or {}
        run = run_ranks(args, pool)
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
            "sim_overhead_ms_max": max((r["sim_overhead_ms"] for r in res), default=0.0),
            "corrupt": sum(o["corrupt"] for o in ranks),
            "checked_pages": sum(o["checked_pages"] for o in ranks),
            "checked_in_run": sum(o["checked_in_run"] for o in ranks),
            "ranks_agree": run["disagreements"] == 0 and len(ranks) == args["tp"],
            "requests": len(res), "steps": run["steps"], "invariants": stats.get("invariants", "?"),
            "leases_live": st["leases"].get("live", st["leases"].get("count", 0)) if isinstance(st.get("leases"), dict) else None,
            "sessions": st.get("sessions", {}),
            "l3": {k: v for k, v in st.get("l3", {}).items() if k in ("cost", "read_blocks_ok")},
            "degraded_misses": sum(o["degraded"] for o in ranks), "results": res,
            # observability totals, as the engine saw them (rank 0): policy, final status per request
            "policy": (args["arm_kw"] or {}).get("policy", "none"),
            "statuses": dict(collections.Counter(r["status"] for r in res)),
            "sidecar_busy": busy_per_request(st.get("busy") or {}, len(res), since=busy0)}


def busy_per_request(busy: dict, requests: int, since: dict | None = None, top: int = 6) -> dict:
    """The sidecar control thread's time over an arm (the ``stats`` op's ``busy``: by op, posted
    event and timer; ``since``: the same taken before the arm, subtracted), in ms per request:
    all of it, and its ``top`` busiest items.  The thread is serial: its work is what every other
    op, landed read and wake-up waits behind."""
    n = max(1, requests)
    since = since or {}
    ms = {k: v["ms"] - since.get(k, {}).get("ms", 0.0) for k, v in busy.items()}
    rows = sorted(((k, v) for k, v in ms.items() if v > 0), key=lambda kv: -kv[1])
    return {"ms_per_request": round(sum(v for _, v in rows) / n, 4), "top": {k: round(v / n, 4) for k, v in rows[:top]}}


def warm_l3(base_args: dict, sidecar_overrides: dict, pool: RankPool | None = None) -> None:
    """Compute every distinct prompt once and write it to L3 (through the same engine path)."""
    args = dict(base_args, store_to_l3=True, gap_s=1e-6, load=None, compute_ms_per_ktok=0.0, budget_s=0.0,
                timeline=False)
    blocks = sum(len(t) // 64 for _, _, t in stream_of(base_args))  # room for every block: none evicted unwritten
    over = dict(sidecar_overrides, **{"pool.num_blocks": max(sidecar_overrides.get("pool.num_blocks", 0), blocks + 64)})
    run_arm("warmup", args, over, arm_kw={"policy": "timeout"}, pool=pool, before_stop=_wait_puts)


def _wait_puts(instance: str) -> None:
    """Until the write-behind to L3 has landed (bounded)."""
    from kvsidecar.connector.client import SidecarClient

    with SidecarClient(instance) as c:
        deadline = time.monotonic() + 120
        while c.call("stats")["stats"]["l3"].get("puts_in_flight") and time.monotonic() < deadline:
            time.sleep(0.02)


def mooncake_available() -> bool:
    try:
        import mooncake.store  # noqa: F401
    except ImportError:
        return False
    return shutil.which("mooncake_master") is not None


class _MooncakeL3:
    """A local master plus a long-lived "holder" sidecar (another node) that keeps the L3 objects."""

    def __init__(self, common: dict, base_args: dict, pool: RankPool | None = None):
        from kvsidecar.sidecar.l3.master import MooncakeMaster
        from kvsidecar.sidecar.spawn import SidecarProcess

        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        self.master = MooncakeMaster()
        mc = {"l3.backend": "mooncake", "l3.mooncake_master": self.master.address,
              "l3.mooncake_local_buffer_bytes": 16 << 20}
        holder = dict(common, **mc, **{"l3.mooncake_global_segment_bytes": 512 << 20})
        self.holder = SidecarProcess(f"kvssimholder{os.getpid()}", overrides=holder)
        args = dict(base_args, store_to_l3=True, gap_s=1e-6, load=None, compute_ms_per_ktok=0.0, budget_s=0.0,
                    timeline=False)
        self._store_via(self.holder.instance, args, pool)
        self.reader = dict(common, **mc, **{"l3.mooncake_global_segment_bytes": 0})

    @staticmethod
    def _store_via(instance: str, args: dict, pool) -> None:
        # the warm-up arm runs its own sidecar; here the holder must do the writing itself
        run_ranks(dict(args, arm="warmup", arm_kw={"policy": "timeout"}, budget_s=0.0, instance=instance), pool)

        _wait_puts(instance)  # the write-behind must land in Mooncake

    def close(self) -> None:
        self.holder.stop()
        self.master.stop()


def simulate(quick: bool, l3_mbps: float | None = None, budget_s: float | None = None, arms=None,
             l3: str = "file", before_stop=None, prefix_tokens: int = 16384, requests: int | None = None,
             sidecar_overrides: dict | None = None, while_running=None, *, load: float | None = None,
             tp: int = 2, compute_ms_per_ktok: float = 50.0, n_prefixes: int = 2, pool_blocks: int = 1400,
             l3_latency_ms: float = 2.0, timeline: bool = False, arm_table: dict | None = None,
             seed: int = 11, pool: RankPool | None = None, l3_dir: str | None = None) -> dict:
    """One run of every arm on one stream.  ``sidecar_overrides``: extra config for the arms'
    sidecars (not the warm-up's), e.g. metrics; ``while_running``: see :func:`run_arm` (every
    arm); ``load``: Poisson arrivals at that fraction of the no-prefetch capacity (None: the
    historical fixed mean gap); ``pool``/``l3_dir``: reuse rank processes / an already warm
    file L3 (the table does; ``l3_dir`` must have been warmed with the same stream's prompts)."""
    if pool is None:
        with RankPool(tp) as own:
            return simulate(quick, l3_mbps, budget_s, arms, l3, before_stop, prefix_tokens, requests,
                            sidecar_overrides, while_running, load=load, tp=tp, compute_ms_per_ktok=compute_ms_per_ktok,
                            n_prefixes=n_prefixes, pool_blocks=pool_blocks, l3_latency_ms=l3_latency_ms,
                            timeline=timeline, arm_table=arm_table, seed=seed, pool=own, l3_dir=l3_dir)
    lay = make_layout(tp)
    table = arm_table or ARMS
    base_args = dict(tp=tp, seed=seed, requests=requests or (6 if quick else 16), n_prefixes=n_prefixes,
                     prefix_tokens=prefix_tokens, suffix_tokens=128,
                     gap_s=(0.8 if quick else 0.9) * prefix_tokens / 16384 * compute_ms_per_ktok / 50.0, load=load,
                     compute_ms_per_ktok=compute_ms_per_ktok, store_to_l3=False, budget_s=budget_s,
                     pool_blocks=pool_blocks, timeline=True)
    mbps = l3_mbps if l3_mbps is not None else 200.0  # 25 MB/s: a 16K prefix (32 MiB) restores in ~1.3 s
    tmp = tempfile.mkdtemp(prefix="kvssim-")
    common = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    common.update({"pool.num_blocks": pool_blocks, "l3.file_dir": l3_dir or os.path.join(tmp, "l3")})
    mc = None
    try:
        if l3 == "mooncake":
            mc = _MooncakeL3(common, base_args, pool)
            shaped = dict(mc.reader, **{"l3.bandwidth_mbps": mbps, "l3.latency_ms": l3_latency_ms})
        else:
            if l3_dir is None or not os.path.isdir(l3_dir):  # (a given l3_dir is warmed once, then reused)
                warm_l3(base_args, common, pool)
            shaped = dict(common, **{"l3.bandwidth_mbps": mbps, "l3.latency_ms": l3_latency_ms})
        out = {"quick": quick, "l3": l3, "l3_mbps": mbps, "budget_s": budget_s, "compute_ms_per_ktok": compute_ms_per_ktok,
               "prefix_tokens": prefix_tokens, "tp": tp, "load": load, "requests": base_args["requests"], "arms": {}}
        arm_list = arms or list(table)
        shaped.update(sidecar_overrides or {})
        for arm in arm_list:
            out["arms"][arm] = run_arm(arm, base_args, shaped, while_running=while_running, pool=pool, arms=table,
                                       before_stop=before_stop if arm == arm_list[-1] else None)
        rates = ttft_bounds.measured_rates(out["arms"], lay, nominal_l3_s_per_block=lay.block_bytes * 8 / (mbps * 1e6),
                                           nominal_latency_s=l3_latency_ms / 1e3,
                                           nominal_compute_s_per_block=compute_ms_per_ktok * 64 / 1024 / 1e3)
        keyed = ttft_bounds.keyed_stream(stream_of(base_args), lay)
        per_req = ttft_bounds.per_request_bounds(keyed, rates, pool_blocks)
        out["rates"] = rates
        out["bounds_ms"] = {k: [round(b[k], 3) for b in per_req.values()] for k in ("serial", "oracle")}
        out["serial_bound"] = ttft_bounds.summary([b["serial"] for b in per_req.values()])
        out["oracle"] = ttft_bounds.summary([b["oracle"] for b in per_req.values()])
        for a in out["arms"].values():
            a["gap"] = ttft_bounds.gap_breakdown(a["results"], per_req)
            if not timeline:
                for r in a["results"]:
                    r.pop("timeline", None)
                    r.pop("events", None)
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
    r = res.get("rates", {})
    print(f"\nengine simulator: TP={res['tp']}, {res['prefix_tokens']}-token shared prefixes, L3 {res.get('l3', 'file')} "
          f"shaped to {res['l3_mbps']:.0f} Mbit/s, prefill {res['compute_ms_per_ktok']:.0f} ms/Ktok, load {res.get('load')}, "
          f"budget {res['budget_s'] or 'sidecar default'}")
    if r:
        print(f"  measured: L3 {r['l3_s_per_block'] * 1e3:.3f} ms/block + {r['l3_latency_s'] * 1e3:.2f} ms/read, "
              f"prefill {r['compute_s_per_block'] * 1e3:.3f} ms/block, copy {r['copy_s_per_block'] * 1e3:.3f} ms/block "
              f"(L3/prefill {r['ratio']:.2f})")
    print(f"{'arm':<18} {'TTFT p50':>9} {'TTFT p90':>9} {'TTFT p99':>9} {'vs whole':>8} {'restored':>9} "
          f"{'recomputed':>10} {'corrupt':>7} {'ranks agree':>11}")
    for arm, a in res["arms"].items():
        print(f"{arm:<18} {a['ttft_p50_ms']:>7.0f}ms {a['ttft_p90_ms']:>7.0f}ms {a['ttft_p99_ms']:>7.0f}ms "
              f"{a.get('ttft_p50_vs_whole_task', 0):>8.2f} {a['restored_tokens']:>9} {a['recomputed_tokens']:>10} "
              f"{a['corrupt']:>7} {str(a['ranks_agree']):>11}")
    for name in ("serial_bound", "oracle"):
        o = res[name]
        print(f"{name:<18} {o['ttft_p50_ms']:>7.0f}ms {o['ttft_p90_ms']:>7.0f}ms {o['ttft_p99_ms']:>7.0f}ms"
              f"  ({'measured rates, same stream' if name == 'serial_bound' else 'needs compute/load overlap; report only'})")
    ttft_bounds.print_gaps(res["arms"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json")
    p.add_argument("--l3-mbps", type=float)
    p.add_argument("--budget-s", type=float, default=0.25)
    p.add_argument("--arms", help="comma-separated subset of the arms")
    p.add_argument("--trials", type=int, default=1, help="repeat the whole run (arms interleaved); median [min..max]")
    p.add_argument("--requests", type=int, help="requests per arm (default 6 quick, 16 full; table 48)")
    p.add_argument("--load", type=float, help="Poisson arrivals at this fraction of the no-prefetch capacity (0: idle)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--timeline", action="store_true", help="keep each request's timeline in the JSON")
    p.add_argument("--table", action="store_true", help="the issue-22 table: L3/prefill 0.3, 1, 2 x idle, 0.9 x TP 2, 4")
    p.add_argument("--twin", action="store_true",
                   help="with --table: cost_aware again as cost_aware_twin in the same trials (an A/A check of the "
                        "table's noise; reported, never judged)")
    p.add_argument("--rows", help="table: comma-separated row names to run (default all)")
    p.add_argument("--plot", help="table: write the TTFT CDFs and gap breakdowns here (PNG)")
    p.add_argument("--l3", choices=["file", "mooncake", "auto"], default="file",
                   help="warm L3 on the embedded file store, or on a local Mooncake cluster (auto: if installed)")
    args = p.parse_args(argv)
    if args.l3 == "auto":
        args.l3 = "mooncake" if mooncake_available() else "file"
    logging.basicConfig(level=logging.WARNING)
    import signal

    # a SIGTERM (a stopped benchmark) unwinds like Ctrl-C: the sidecars and rank processes stop
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    if args.table:
        from scripts import ttft_table

        return ttft_table.main(args)
    arms = args.arms.split(",") if args.arms else None
    runs = []
    for _ in range(args.trials):  # each trial runs every arm in turn: the arms are interleaved
        runs.append(simulate(args.quick, args.l3_mbps, args.budget_s, l3=args.l3, arms=arms, requests=args.requests,
                             load=args.load, tp=args.tp, timeline=args.timeline))
        print_table(runs[-1])
        if not args.timeline:
            for a in runs[-1]["arms"].values():
                a.pop("results", None)
    out = runs[0] if args.trials == 1 else {"trials": args.trials, "aggregate": trials_mod.aggregate(runs)}
    if args.trials > 1:
        agg = out["aggregate"]["arms"]
        print(f"\nmedian [min..max] over {args.trials} interleaved trials:")
        for arm, a in agg.items():
            print(f"  {arm:<20} p50 {trials_mod.fmt(a['ttft_p50_ms'], 0):>20}  p90 {trials_mod.fmt(a['ttft_p90_ms'], 0):>20}"
                  f"  corrupt {trials_mod.fmt(a['corrupt'], 0)}  ranks agree {a['ranks_agree']}")
    if args.json:
        write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
