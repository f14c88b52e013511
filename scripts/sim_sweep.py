"""The policy sweep on the virtual-time simulator: every arm against the serial bound on the same
request stream, over L3 speed x budget x prefix length x TP x load, several seeds per row.

    python -m scripts.sim_sweep [--quick] [--json PATH] [--requests N] [--seeds K] [--calibration TABLE.json]

With ``--calibration``, each arm pays the fixed costs per request (queue entry, scan, wake-up,
GET, L3 query) that the real-process table measured for that TP (``scripts.ttft_calibrate``
checks the model against that table row by row).

A row passes when ``cost_aware``'s TTFT p50 and p90 (over every request of every seed) are
<= 1.10 x the serial bound's and <= 1.05 x min(whole_task, no_prefetch)'s, with zero corrupt
blocks, ranks in agreement and books balanced (no lease, staging or pin left).  Arms whose
behaviour does not depend on the budget (all but the timeout ones) run once per budget pair:
the simulator is deterministic, so the second run would repeat the first exactly.
A final row drops L3 bandwidth 4x halfway through the stream and counts how many reads the
estimator needs to follow it.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import time

from scripts import sim_virtual as sv
from scripts.common import percentile, write_json

RATIOS = (0.4, 0.8, 1.7)  # L3 restore / recompute cost per block
BUDGETS = (0.15, 0.6)
PREFIXES = (4096, 16384, 65536)
TPS = (2, 4)
LOADS = (0.0, 0.8)  # idle; ~0.8 utilisation of an engine that recomputes everything
BUDGET_FREE = {"no_prefetch", "whole_task", "best_effort", "cost_aware"}


pct = percentile  # (the nearest-rank quantile every benchmark shares)


def summarize(ttfts: list) -> dict:
    return {"p50_ms": pct(ttfts, 0.5) * 1e3, "p90_ms": pct(ttfts, 0.9) * 1e3, "p99_ms": pct(ttfts, 0.99) * 1e3,
            "mean_ms": statistics.fmean(ttfts) * 1e3 if ttfts else 0.0}


def arm_totals(runs: list, p: sv.SimParams) -> dict:
    """One arm over several seeds: TTFT percentiles (pooled), the per-seed p50 spread, the
    restored split, L3 reads vs use, the time split (means per request) and the checks."""
    res = [r for run in runs for r in run["results"]]
    ttfts = [r["ttft_s"] for r in res]
    per_seed = [pct([r["ttft_s"] for r in run["results"]], 0.5) * 1e3 for run in runs]
    hit_l3 = sum(r["hit_l3"] for r in res)
    n = max(1, len(res))
    out = summarize(ttfts)
    out.update(
        p50_seed_min_ms=min(per_seed), p50_seed_max_ms=max(per_seed), requests=len(res),
        restored_tokens_pool=sum(r["hit_pool"] for r in res) * p.tokens_per_block,
        restored_tokens_l3=hit_l3 * p.tokens_per_block,
        recomputed_tokens=sum(r["recomputed"] for r in res) * p.tokens_per_block,
        l3_blocks_read=sum(run["l3_blocks_read"] for run in runs), l3_blocks_used=hit_l3,
        time_split_ms={
            "queue": sum(r["queue_s"] for r in res) / n * 1e3,
            "metadata": p.meta_latency_s * 1e3 if runs[0]["results"] and "status" in runs[0]["results"][0] else 0.0,
            "lane_wait": sum(max(0.0, r.get("chunk_s", 0.0) - r.get("read_s", 0.0)) for r in res) / n * 1e3,
            "read": sum(r.get("read_s", 0.0) for r in res) / n * 1e3,
            "drain": sum(r.get("drain_s", 0.0) for r in res) / n * 1e3,
            "get_load": sum((r["hit_pool"] + r["hit_l3"]) * p.copy_s_per_block for r in res) / n * 1e3,
            "recompute": sum(r["recomputed"] * p.compute_s_per_block for r in res) / n * 1e3,
        },
        statuses=_count(r.get("status") for r in res),
        corrupt=sum(run["corrupt"] for run in runs),
        ranks_agree=all(run["ranks_agree"] for run in runs),
        books_balanced=all(run["books"] == "ok" and run["leases_left"] == 0 and run["staging_left"] == 0
                           for run in runs),
        estimator_error=statistics.fmean(run["estimator_error"] for run in runs),
    )
    return out


def _count(xs) -> dict:
    out: dict = {}
    for x in xs:
        if x is not None:
            out[x] = out.get(x, 0) + 1
    return out


def verdict(row: dict) -> dict:
    arms, sb = row["arms"], row["serial_bound"]
    c = arms["cost_aware"]
    base = {q: min(arms["whole_task"][q], arms["no_prefetch"][q]) for q in ("p50_ms", "p90_ms")}
    out = {}
    for q in ("p50_ms", "p90_ms"):
        out[f"{q[:3]}_vs_serial"] = c[q] / sb[q]
        out[f"{q[:3]}_vs_best_of_whole_none"] = c[q] / base[q]
    clean = all(a["corrupt"] == 0 and a["ranks_agree"] and a["books_balanced"] for a in arms.values())
    out["clean"] = clean
    out["pass"] = (clean and out["p50_vs_serial"] <= 1.10 and out["p90_vs_serial"] <= 1.10
                   and out["p50_vs_best_of_whole_none"] <= 1.05 and out["p90_vs_best_of_whole_none"] <= 1.05)
    return out


TABLE_ARM_FOR = {"one_graph_timeout": "timeout_long", "timeout_chunk128": "timeout_long",
                 "timeout_chunk32": "timeout_short"}  # sweep arm -> the real table's arm it is costed like


def calibration(table_json: str) -> dict:
    """``{tp: {arm: {enter_s, create_s, scan_s, wake_s, admit_s, turnaround_s, skew_s, skew_queued_s, publish_s,
    meta_latency_s, lane_pickup_s, cost_samples}}}``: the fixed costs per
    request the real-process table measured (``scripts.simulate --table --json``), medians over
    that TP's rows, for each sweep arm (timeout arms: the table's timeout arm of that kind)."""
    import json
    from pathlib import Path

    from scripts.ttft_calibrate import arrivals_of, cost_samples, fixed_costs, timed_trials

    table = json.loads(Path(table_json).read_text())
    rows = table["rows"]
    out: dict = {}
    for tp in sorted({r["tp"] for r in rows}):
        mine = [(run, arrivals_of(r, table["requests"])) for r in rows if r["tp"] == tp for run in timed_trials(r)]
        out[tp] = {}
        for arm in sv.ARMS:
            costs = [fixed_costs(run, TABLE_ARM_FOR.get(arm, arm), arr) for run, arr in mine]
            known = {k: [c[k] for c in costs if c[k] is not None] for k in costs[0]}
            med = {k: statistics.median(xs) if xs else None for k, xs in known.items()}  # (None: no row measured it)
            med["meta_latency_s"] = med.pop("query_s")
            med["lane_pickup_s"] = med.pop("pickup_s")
            pooled: dict = {}  # the jittered costs' samples, over that TP's rows
            for run, arr in mine:
                for name, xs in cost_samples(run, TABLE_ARM_FOR.get(arm, arm), arr):
                    pooled.setdefault(name, []).extend(xs)
            med["cost_samples"] = tuple((name, tuple(xs)) for name, xs in sorted(pooled.items()))
            out[tp][arm] = med
    return out


def run_row(p: sv.SimParams, seeds: int, cache: dict, fixed: dict | None = None) -> dict:
    """All arms on one parameter set; arms are interleaved within each seed.  ``fixed``: per
    arm, the measured fixed costs (``calibration``) that replace ``p``'s."""
    runs: dict = {a: [] for a in sv.ARMS}
    serial, oracle = [], []
    for s in range(seeds):
        ps = dataclasses.replace(p, seed=p.seed + s)
        b = sv.bounds(ps)
        serial += b["serial"]
        oracle += b["oracle"]
        for arm in sv.ARMS:
            pa = dataclasses.replace(ps, **(fixed or {}).get(arm, {}))
            key = (arm, dataclasses.replace(pa, budget_s=0.0)) if arm in BUDGET_FREE else None
            if key is not None and key in cache:
                runs[arm].append(cache[key])
                continue
            r = sv.run_arm(pa, arm)
            r.pop("estimates", None)
            if key is not None:
                cache[key] = r
            runs[arm].append(r)
    row = {"params": dataclasses.asdict(p), "serial_bound": summarize(serial), "overlap_oracle": summarize(oracle),
           "arms": {a: arm_totals(rs, p) for a, rs in runs.items()}}
    row["verdict"] = verdict(row)
    return row


def bandwidth_drop_row(p: sv.SimParams, seeds: int) -> dict:
    """L3 slows down 4x halfway: how many reads until cost_aware's estimate is within 20 %."""
    out = []
    for s in range(seeds):
        ps = dataclasses.replace(p, seed=p.seed + s, bandwidth_drop_at=0.5)
        e = sv.Engine(ps, "cost_aware", sv.request_stream(ps))
        r = e.run()
        after = [(t, true, est) for t, true, est in r["estimates"] if t >= (r["drop_at_s"] or 0) and true > ps.l3_s_per_block]
        reads = next((i + 1 for i, (_, true, est) in enumerate(after) if abs(est - true) / true <= 0.2), None)
        res = r["results"]
        drop = r["drop_at_s"]
        b = sv.bounds(ps)
        after_req = [i for i, x in enumerate(res) if x["arrival"] >= drop]
        by_req = {x["req"]: x for x in res}
        serial_after = [b["serial"][int(x["req"][1:])] for x in res if x["arrival"] >= drop]
        out.append({"seed": ps.seed, "reads_after_drop": len(after), "reads_to_converge": reads,
                    "ttft_after_p50_ms": pct([res[i]["ttft_s"] for i in after_req], 0.5) * 1e3,
                    "serial_after_p50_ms": pct(serial_after, 0.5) * 1e3,
                    "corrupt": r["corrupt"], "books": r["books"], "requests": len(by_req)})
    return {"params": dataclasses.asdict(p), "seeds": out,
            "pass": all(o["reads_to_converge"] is not None and o["reads_to_converge"] <= 3 for o in out)}


def sweep(quick: bool, requests: int, seeds: int, fixed_by_tp: dict | None = None) -> dict:
    """``fixed_by_tp``: :func:`calibration` (None: the model's defaults, no fixed costs)."""
    rows, cache = [], {}
    t0 = time.monotonic()
    ratios, budgets, prefixes, tps, loads = (RATIOS, BUDGETS, (4096, 16384), (2,), LOADS) if quick else \
        (RATIOS, BUDGETS, PREFIXES, TPS, LOADS)
    for prefix in prefixes:
        for tp in tps:
            for load in loads:
                for ratio in ratios:
                    for budget in budgets:
                        p = sv.SimParams(tp=tp, prefix_tokens=prefix, l3_ratio=ratio, budget_s=budget, load=load,
                                         requests=requests, n_prefixes=max(2, requests // 4), seed=1)
                        row = run_row(p, seeds, cache, (fixed_by_tp or {}).get(tp))
                        rows.append(row)
                        print_row(row)
    drop = bandwidth_drop_row(sv.SimParams(tp=2, prefix_tokens=16384, l3_ratio=0.4, load=0.8,
                                           requests=requests, n_prefixes=max(2, requests // 4), seed=1), seeds)
    return {"rows": rows, "bandwidth_drop": drop, "seeds": seeds, "requests_per_seed": requests,
            "wall_s": time.monotonic() - t0, "passed": sum(r["verdict"]["pass"] for r in rows), "total": len(rows)}


def print_row(row: dict) -> None:
    p, v = row["params"], row["verdict"]
    arms = row["arms"]
    cols = " ".join(f"{a[:11]:>11}" for a in arms)
    vals = " ".join(f"{arms[a]['p50_ms']:>5.0f}/{arms[a]['p90_ms']:<5.0f}" for a in arms)
    head = (f"prefix {p['prefix_tokens'] // 1024:>2}K tp {p['tp']} load {p['load']:.1f} ratio {p['l3_ratio']:.1f} "
            f"budget {p['budget_s']:.2f}")
    sb = row["serial_bound"]
    print(f"{head} | serial {sb['p50_ms']:.0f}/{sb['p90_ms']:.0f} | cost_aware vs serial "
          f"{v['p50_vs_serial']:.2f}/{v['p90_vs_serial']:.2f} vs best(whole,none) {v['p50_vs_best_of_whole_none']:.2f}/"
          f"{v['p90_vs_best_of_whole_none']:.2f} {'PASS' if v['pass'] else 'MISS'}{'' if v['clean'] else ' UNCLEAN'}")
    print(f"    p50/p90 ms: {cols}\n                {vals}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4K and 16K prefixes, TP 2 only")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--calibration", metavar="TABLE.json",
                    help="the fixed costs per request a real-process table measured (scripts.simulate --table)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the executor's drain warnings are expected here
    fixed = calibration(a.calibration) if a.calibration else None
    out = sweep(a.quick, a.requests, a.seeds, fixed)
    out["calibration"] = {"table": a.calibration, "fixed_by_tp": fixed}
    d = out["bandwidth_drop"]
    print(f"\nbandwidth drop 4x at half the stream: reads to re-converge per seed "
          f"{[s['reads_to_converge'] for s in d['seeds']]} (target <= 3): {'PASS' if d['pass'] else 'MISS'}")
    print(f"rows passing: {out['passed']}/{out['total']}  ({out['wall_s']:.0f} s)")
    if a.json:
        write_json(a.json, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
