"""Sustained churn against one real sidecar: several client processes, a pool of a few thousand
blocks, stores, held GETs with checked loads, and prefetch sessions with random aborts, deadlines
and demands, until the pool has evicted ``target_evictions`` blocks.

Used by ``test_soak.py`` (a bounded run in the default suite, the long one marked slow) and
runnable on its own for the figures::

    .venv/bin/python -m tests.reliability.soak --evictions 1000000 [--workers 3] [--json out.json]

What it reports: evictions, ops by kind, wrong bytes (must be 0), typed errors by code, per-op
latency p50/p99 for every tenth of the run (by time), the sidecar's RSS after warm-up and at the
end, and the books (``stats(check=True)``) at the end.
"""

from __future__ import annotations

import argparse
import array
import json
import multiprocessing as mp
import os
import random
import time

from scripts.common import percentile as _pct

LAYOUT = dict(model="soak", num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", tokens_per_block=4,
              tp_size=1, mla=False)
POOL_BLOCKS = 2048
MAX_CHAIN = 128


def sidecar_overrides(l3_dir: str) -> dict:
    d = {f"layout.{k}": v for k, v in LAYOUT.items()}
    d.update({"pool.num_blocks": POOL_BLOCKS, "l3.backend": "file", "l3.file_dir": l3_dir,
              "l3.file_cap_bytes": 2 << 20, "l3.latency_ms": 1.0, "limits.lease_ttl_s": 60.0,
              "sessions.retained_ttl_s": 5.0, "sessions.chunk_max_blocks": 16})
    return d


def _key_values(chain: bytes):
    import torch

    n = len(chain) // 16
    vals = [int.from_bytes(chain[16 * i:16 * i + 2], "little") % 1500 for i in range(n)]
    return torch.tensor(vals, dtype=torch.float32).view(n, 1, 1, 1)


def _fill(kv, chain: bytes) -> None:
    """Pages [0, n) get a pattern that identifies the block's key (and the element position)."""
    n = len(chain) // 16
    vals = _key_values(chain)
    for li, (k, v) in enumerate(kv):
        base = _PATTERN[li]
        k[:n] = (base + vals).half()
        v[:n] = (base - vals).half()


def _check(kv, chain: bytes, count: int) -> int:
    """Wrong elements in pages [0, count) against the pattern of ``chain``'s first blocks."""
    if count == 0:
        return 0
    vals = _key_values(chain[:16 * count])
    bad = 0
    for li, (k, v) in enumerate(kv):
        base = _PATTERN[li]
        bad += int(((k[:count].float() - (base + vals)).abs() > 0).sum())
        bad += int(((v[:count].float() - (base - vals)).abs() > 0).sum())
    return bad


_PATTERN: list = []


def worker(instance: str, wid: int, seed: int, stop, conn) -> None:
    """One client process; runs until ``stop`` is set; sends its summary through ``conn``."""
    import torch

    from kvsidecar.connector.kv_client import KVConnector
    from kvsidecar.shm.errors import KvSidecarError, RemoteError
    from kvsidecar.shm.layout import KVLayout

    lay = KVLayout(**LAYOUT)
    shape = (MAX_CHAIN, lay.tokens_per_block, lay.heads_per_shard, lay.head_dim)
    _PATTERN[:] = [(torch.arange(shape[1] * shape[2] * shape[3]).view(1, *shape[1:]) % 7).float() * (li + 1)
                   for li in range(lay.num_layers)]
    src = [tuple(torch.zeros(shape, dtype=torch.float16) for _ in range(2)) for _ in range(lay.num_layers)]
    dst = [tuple(torch.zeros(shape, dtype=torch.float16) for _ in range(2)) for _ in range(lay.num_layers)]
    rng = random.Random(seed)
    t_ops = array.array("d")
    kind_ops = array.array("b")
    lat_ops = array.array("f")
    counts = {"store": 0, "get": 0, "prefetch": 0, "abort": 0, "demand": 0, "loaded_blocks": 0}
    errors: dict[str, int] = {}
    bad = 0
    l3_chains: list[bytes] = []
    c = KVConnector(instance, lay, group=f"soak{wid}", timeout_s=10.0)
    c.attach()
    t_start = 0.0  # CLOCK_MONOTONIC is system-wide: the parent splits every worker's ops by time

    def timed(kind: int, fn):
        t0 = time.monotonic()
        out = fn()
        t_ops.append(t0 - t_start)
        kind_ops.append(kind)
        lat_ops.append(time.monotonic() - t0)
        return out

    def load_and_check(lease, chain) -> None:
        nonlocal bad
        if lease.count:
            for layer in dst:
                for t in layer:
                    t[:lease.count].zero_()
            c.load(lease, dst, list(range(lease.count)))
            bad += _check(dst, chain, lease.count)
            counts["loaded_blocks"] += lease.count
        c.release(lease)

    try:
        seq = 0
        while not stop.is_set():
            seq += 1
            n = rng.randint(16, MAX_CHAIN)
            tokens = [rng.getrandbits(31) for _ in range(n * lay.tokens_per_block)]
            chain = c.hasher.chain(tokens)
            r = rng.random()
            try:
                if r < 0.85 or not l3_chains:
                    to_l3 = rng.random() < 0.05
                    _fill(src, chain)

                    def store():
                        st = c.store(chain, l3=to_l3)
                        c.save(st, src, list(range(st.start, st.start + st.count)))
                        c.commit(st)
                        return st

                    timed(0, store)
                    counts["store"] += 1
                    if to_l3:
                        l3_chains.append(chain)
                        del l3_chains[:-32]
                    lease = timed(1, lambda: c.get(chain))
                    load_and_check(lease, chain)
                    counts["get"] += 1
                else:
                    # a prefetch session for a chain written to L3 earlier (likely evicted by now)
                    chain = rng.choice(l3_chains)
                    req = f"w{wid}-{seq}"
                    policy = rng.choice(["timeout", "best_effort", "wait_complete", "cost_aware"])
                    budget = rng.choice([0.002, 0.01, 0.05, 1.0]) if policy == "timeout" else None
                    # cost_aware: the engine's ETA and prefill cost (cheap or dear against this L3)
                    cost = dict(eta_s=rng.choice([0.0, 0.005, 0.05]), prefill_s_per_block=rng.choice([1e-5, 1e-3]),
                                waiting=rng.choice([None, 0, 3])) if policy == "cost_aware" else {}
                    timed(2, lambda: c.prefetch(chain, req, policy=policy, budget_s=budget,
                                                chunk_max_blocks=rng.choice([4, 16, 64]), **cost))
                    counts["prefetch"] += 1
                    fate = rng.random()
                    if fate < 0.2:
                        c.abort(req)
                        counts["abort"] += 1
                    elif (fate < 0.4 and policy == "best_effort") or policy == "cost_aware":
                        c.demand(req)  # (cost_aware: the engine scans it sooner or later)
                        counts["demand"] += 1
                    p = c.wait(req, terminal=True, timeout_s=10.0)  # answered when it ends (bounded)
                    if p["state"] != "terminal":
                        errors["session_not_terminal"] = errors.get("session_not_terminal", 0) + 1
                        c.abort(req)
                    lease = timed(1, lambda: c.get(chain, req=req, step=0))
                    load_and_check(lease, chain)
            except RemoteError as exc:
                errors[exc.code_name] = errors.get(exc.code_name, 0) + 1
            except KvSidecarError as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                break
        c.detach()
    finally:
        conn.send({"wid": wid, "counts": counts, "errors": errors, "bad": bad, "t": t_ops.tobytes(),
                   "kind": kind_ops.tobytes(), "lat": lat_ops.tobytes()})


def _rss_kib(pid: int, field: str = "VmRSS") -> int:
    """Resident KiB of ``pid``: VmRSS (all), RssAnon (heap), RssShmem (the shared segments)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def run(instance: str, l3_dir: str, *, target_evictions: int, workers: int = 3, seed: int = 1,
        max_s: float = 3600.0, sidecar_pid_of=None, observer=None) -> dict:
    """Drive ``workers`` processes against the running sidecar until ``target_evictions``.

    ``observer`` is an attached ``SidecarClient`` (stats), ``sidecar_pid_of`` the sidecar pid.
    """
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    pipes, procs = [], []
    for w in range(workers):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=worker, args=(instance, w, seed * 100 + w, stop, child), daemon=True)
        p.start()
        child.close()
        pipes.append(parent)
        procs.append(p)
    t0 = time.monotonic()
    rss_warm = None
    samples = []
    try:
        while True:
            st = observer.call("stats")["stats"]
            ev = st["pool"]["evicted"]
            now = time.monotonic() - t0
            rss = _rss_kib(sidecar_pid_of)
            samples.append((round(now, 2), ev, rss, _rss_kib(sidecar_pid_of, "RssAnon"),
                            _rss_kib(sidecar_pid_of, "RssShmem")))
            if rss_warm is None and ev >= target_evictions // 10:
                rss_warm = rss
            if ev >= target_evictions or now > max_s or not all(p.is_alive() for p in procs):
                break
            time.sleep(0.25)  # sampling cadence, not synchronisation
    finally:
        stop.set()
    results = []
    for parent, p in zip(pipes, procs):
        if parent.poll(60):
            results.append(parent.recv())
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join(5)
    elapsed = time.monotonic() - t0
    final = observer.call("stats", check=True)
    st = final["stats"]
    rss_end = _rss_kib(sidecar_pid_of)
    # latency over time: every tenth of the run (first op to last, all workers together)
    lat_by_tenth = [[[] for _ in range(10)] for _ in range(3)]
    ops = []
    for r in results:
        ts, ks, ls = array.array("d"), array.array("b"), array.array("f")
        ts.frombytes(r["t"])
        ks.frombytes(r["kind"])
        ls.frombytes(r["lat"])
        ops.append((ts, ks, ls))
    first = min((o[0][0] for o in ops if len(o[0])), default=0.0)
    last = max((o[0][-1] for o in ops if len(o[0])), default=1.0)
    span = max(last - first, 1e-9)
    for ts, ks, ls in ops:
        for t, k, lat in zip(ts, ks, ls):
            lat_by_tenth[k][min(9, int(10 * (t - first) / span))].append(lat * 1e6)
    tenths = {}
    for k, name in enumerate(("store", "get", "prefetch")):
        tenths[name] = [{"n": len(b), "p50_us": round(_pct(b, 0.5), 1), "p99_us": round(_pct(b, 0.99), 1)}
                        for b in lat_by_tenth[k]]
    errors: dict[str, int] = {}
    counts: dict[str, int] = {}
    for r in results:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
        for k, v in r["counts"].items():
            counts[k] = counts.get(k, 0) + v
    return {
        "evictions": st["pool"]["evicted"], "elapsed_s": round(elapsed, 2), "workers": workers,
        "reported": len(results), "bad_bytes": sum(r["bad"] for r in results), "counts": counts,
        "errors": errors, "tenths": tenths, "rss_warm_kib": rss_warm, "rss_end_kib": rss_end,
        "invariants": final.get("invariants", ""), "leases_live": st["leases"]["live"],
        "pool": st["pool"], "sessions": st.get("sessions", {}), "samples": samples,
    }


def p99_ratio(result: dict, kind: str = "store", reference_tenths: int = 1) -> float:
    """The last tenth's p99 over the first one's, or over the median of the first
    ``reference_tenths`` tenths' p99s."""
    t = result["tenths"][kind]
    ref = sorted(x["p99_us"] for x in t[:reference_tenths])[(reference_tenths - 1) // 2]
    return t[-1]["p99_us"] / max(ref, 1e-9)


def table(result: dict) -> str:
    lines = [f"evictions {result['evictions']} in {result['elapsed_s']} s, {result['workers']} workers, "
             f"bad bytes {result['bad_bytes']}, errors {result['errors']}",
             f"ops {result['counts']}",
             f"sidecar RSS after warm-up {result['rss_warm_kib']} KiB, at end {result['rss_end_kib']} KiB",
             "tenth   store n   p50 us   p99 us |   get n   p50 us   p99 us"]
    for i in range(10):
        s, g = result["tenths"]["store"][i], result["tenths"]["get"][i]
        lines.append(f"{i + 1:>5} {s['n']:>9} {s['p50_us']:>8} {s['p99_us']:>8} | {g['n']:>7} {g['p50_us']:>8} "
                     f"{g['p99_us']:>8}")
    lines.append(f"p99 last/first tenth: store {p99_ratio(result, 'store'):.2f}, get {p99_ratio(result, 'get'):.2f}")
    lines.append(f"books: {result['invariants'] or 'balanced'}, leases live {result['leases_live']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import tempfile
    import uuid

    from kvsidecar.connector.client import SidecarClient
    from kvsidecar.sidecar.spawn import SidecarProcess

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--evictions", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    instance = "kvsoak-" + uuid.uuid4().hex[:8]
    with tempfile.TemporaryDirectory() as tmp:
        sp = SidecarProcess(instance, overrides=sidecar_overrides(os.path.join(tmp, "l3")))
        try:
            obs = SidecarClient(instance, group="observer")
            obs.attach()
            result = run(instance, tmp, target_evictions=args.evictions, workers=args.workers,
                         sidecar_pid_of=sp.pid, observer=obs)
            obs.detach()
        finally:
            result_rc = sp.stop()
    result["sidecar_exit"] = result_rc
    print(table(result))
    print(f"sidecar exit code {result_rc}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
