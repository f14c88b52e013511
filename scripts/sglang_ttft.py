"""TTFT through genuine SGLang (CPU, TP=2): kvsidecar's policies against HiCache without storage
and SGLang's own ``file`` storage backend.

    .sglang-venv/bin/python -m scripts.sglang_ttft [--quick] [--trials K] [--dtype auto|bfloat16|float32]
        [--mean-gap-ms MS] --json FILE
    python -m scripts.sglang_ttft --combine RUN1.json RUN2.json ... --json FILE   (no server: pools runs)

Slow (server starts of 30-90 s each): not in the default suite.  Per trial, in an order that
rotates between trials (interleaved), one server per storage set-up:

* ``no_prefetch``: HiCache without a storage backend (every prefix recomputed);
* ``sglang_file``: SGLang's own ``file`` backend with its own prefetch policy;
* per kvsidecar arm and L3 speed, a fresh kvsidecar server (``--radix-cache-backend kvsidecar``,
  plugin policy ``cost_aware`` so the ETA flows) and a fresh sidecar with ``sessions.policy_override``
  (``--shared-server``: one server per trial, only the sidecar restarted per arm -- faster, but an
  arm then inherits what the one before left in the server):
  ``whole_task`` (``wait_complete``), ``timeout`` (a short fixed budget) and ``cost_aware``; its
  file L3 is shaped with ``l3.bandwidth_mbps`` (a speed faster and one slower than recompute).

With ``--trials`` > 1 one more trial runs first and is discarded (``--warmup``): a run's first trial
was its slowest in 13 of 13 runs.  Each arm: seed the shared prefixes into storage (one request each, written through), flush
SGLang's cache (and kvsidecar's pool: the prefixes are L3 hits), then the measured stream:
``--requests`` requests, each a shared prefix plus its own suffix, at Poisson arrivals; TTFT at the
client from the streaming response, cached tokens from storage per request, outputs compared with
the cold (``no_prefetch``) run of the same trial.  Then the **hit probe**: prompts sent cold, then
again after SGLang's ``/flush_cache`` -- a kvsidecar pool hit, a ``file`` hit, or (no_prefetch)
recompute.  JSON: ``{"rows": [{"l3": ..., "arms": {name: {"ttft_p50_ms", "ttft_p90_ms", ...}}}],
"probe": ..., "trials": [...]}``; aggregated figures are ``median [min..max]`` over trials.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import random
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

from scripts.trials import aggregate, fmt, pooled_ratio
from scripts.common import write_json

log = logging.getLogger("sglang_ttft")

TIMEOUT_BUDGET = {"sessions.timeout_base_s": 0.2, "sessions.timeout_per_ki_token_s": 0.0,
                  "sessions.timeout_max_s": 0.2}
ARMS = ("no_prefetch", "whole_task", "timeout", "cost_aware", "cost_aware_twin", "cost_aware_write_all",
        "cost_aware_held_off", "sglang_file")
# cost_aware_twin: cost_aware again, as a second arm of the same trials (--kvs-arms
# cost_aware,cost_aware_twin): the A/A check of how far two identical arms drift apart; no verdict.
# cost_aware_write_all: cost_aware with every store written behind to L3 however slow it is
# (l3.write_behind_max_ratio = 0, the behaviour before the write-behind gate): the gate's A/B; no verdict
# cost_aware_held_off: cost_aware not counting the older requests still reading that a prefill
# would hold up (sessions.ahead_aware = false, the policy before it): its A/B; no verdict
SETUPS = ("no_prefetch", "sglang_file", "kvsidecar")  # the servers a trial runs (--setups)
KVS_POLICY = {"whole_task": "wait_complete", "timeout": "timeout", "cost_aware": "cost_aware",
              "cost_aware_twin": "cost_aware", "cost_aware_write_all": "cost_aware", "cost_aware_held_off": "cost_aware"}
ARM_SIDECAR = {"timeout": TIMEOUT_BUDGET, "cost_aware_write_all": {"l3.write_behind_max_ratio": 0.0},
               "cost_aware_held_off": {"sessions.ahead_aware": False}}


# -- pure parts (smoke-tested in the default suite) --------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Request:
    at_s: float  # arrival, from the stream's start
    ids: tuple
    prefix: int  # which shared prefix


@dataclasses.dataclass(frozen=True)
class Workload:
    prefixes: tuple  # token tuples, each a whole number of pages
    requests: tuple  # Request, in arrival order
    probes: tuple  # token tuples for the hit probe


def make_workload(seed: int, *, requests: int = 32, prefixes: int = 8, prefix_tokens: int = 2048,
                  suffix_tokens: int = 128, mean_gap_s: float = 0.15, probes: int = 4, probe_tokens: int = 2048,
                  vocab: int = 500) -> Workload:
    """Shared system prompts, each request one of them plus its own suffix, Poisson arrivals."""
    rnd = random.Random(seed)

    def toks(n):
        return tuple(rnd.randrange(3, vocab) for _ in range(n))

    pre = tuple(toks(prefix_tokens) for _ in range(prefixes))
    t, reqs = 0.0, []
    for i in range(requests):
        p = rnd.randrange(prefixes)
        reqs.append(Request(round(t, 4), pre[p] + toks(suffix_tokens), p))
        t += rnd.expovariate(1.0 / mean_gap_s) if mean_gap_s > 0 else 0.0
    return Workload(pre, tuple(reqs), tuple(toks(probe_tokens) for _ in range(probes)))


def percentile(xs, q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty sequence."""
    s = sorted(xs)
    if not s:
        raise ValueError("percentile of nothing")
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(ttfts_s, storage_tokens, outputs_match) -> dict:
    ms = [t * 1e3 for t in ttfts_s]
    return {"ttft_p50_ms": round(percentile(ms, 50), 2), "ttft_p90_ms": round(percentile(ms, 90), 2),
            "ttft_mean_ms": round(statistics.fmean(ms), 2), "requests": len(ms),
            "storage_tokens_mean": round(statistics.fmean(storage_tokens), 1) if storage_tokens else 0.0,
            "storage_tokens": list(storage_tokens), "outputs_match_cold": bool(outputs_match),
            "ttft_ms": [round(x, 2) for x in ms]}


PHASES = ("entry", "queue", "prefill", "rest")  # SGLang's own time stats per request (--server-times)


def rows(trials: list, speeds: list) -> list:
    """The JSON rows: per L3 speed, every arm's figures aggregated over trials (``no_prefetch``
    and ``sglang_file`` do not use kvsidecar's L3: the same measurement serves every row)."""
    out = []
    for mbps in speeds:
        arms = {}
        for arm in ARMS:
            key = arm if arm in ("no_prefetch", "sglang_file") else f"{arm}@{mbps:g}"
            samples = [t[key] for t in trials if key in t]
            if samples:
                agg = aggregate([{k: v for k, v in s.items()
                                  if k not in ("storage_tokens", "probe", "client_timeline", "sidecar", "ttft_ms",
                                               "server_s")}
                                 for s in samples])
                every = [x for s in samples for x in s.get("ttft_ms", ())]
                arms[arm] = {**agg, "ttft_p50_ms": agg["ttft_p50_ms"]["median"],
                             "ttft_p90_ms": agg["ttft_p90_ms"]["median"], "trials": agg}
                times = [x for s in samples for x in (s.get("server_s") or ()) if x]
                if times:  # SGLang's own time stats (--server-times), median over every request
                    arms[arm]["server_ms"] = {k: round(statistics.median(x[k] for x in times) * 1e3, 2)
                                              for k in PHASES}
                if every:  # the arm's quantiles over every request of every trial (see pooled())
                    arms[arm]["pooled"] = {"ttft_p50_ms": round(percentile(every, 50), 2),
                                           "ttft_p90_ms": round(percentile(every, 90), 2), "requests": len(every)}
        out.append({"l3": {"bandwidth_mbps": mbps}, "arms": arms})
    return out


def paired(trials: list, mbps: float) -> dict:
    """Per quantile: cost_aware's ratio to min(no_prefetch, whole_task) **within each trial**
    (the same workload, minutes apart), median [min..max] over trials.  The machine's speed
    drifts between trials (no_prefetch's p50 on one workload: 440 and 1,051 ms in two runs), so
    a ratio of medians over trials mixes that drift in; this pairs what was measured together.
    Empty without the three arms."""
    key = f"{mbps:g}"
    out = {}
    for q in ("ttft_p50_ms", "ttft_p90_ms"):
        ratios = []
        for t in trials:
            ca, nop, wt = t.get(f"cost_aware@{key}"), t.get("no_prefetch"), t.get(f"whole_task@{key}")
            if ca and nop and wt:
                ratios.append(ca[q] / max(1e-9, min(nop[q], wt[q])))
        if ratios:
            out[q] = {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
                      "max": round(max(ratios), 3), "n": len(ratios)}
    return out


def paired_phases(trials: list, mbps: float) -> dict:
    """Where a kvsidecar arm's requests lose or gain against ``no_prefetch``: per arm at this L3
    speed, each request's TTFT and SGLang's own phases (``--server-times``: entry, queue,
    prefill, rest) minus the same request's in ``no_prefetch`` of the same trial (the same
    workload, minutes apart), as median and mean over every paired request (ms).  A request's
    place in the stream is its index, identical across the arms of a trial.  Empty without
    ``server_s`` on both sides (the stats are not made up)."""
    key = f"@{mbps:g}"
    out = {}
    for name in sorted({k for t in trials for k in t if k.endswith(key)}):
        deltas = {p: [] for p in ("ttft", *PHASES)}
        for t in trials:
            arm, base = t.get(name) or {}, t.get("no_prefetch") or {}
            a_s, b_s = arm.get("server_s") or (), base.get("server_s") or ()
            for i, (a, b) in enumerate(zip(a_s, b_s)):
                if not (a and b):
                    continue
                deltas["ttft"].append(arm["ttft_ms"][i] - base["ttft_ms"][i])
                for p in PHASES:
                    deltas[p].append((a[p] - b[p]) * 1e3)
        if deltas["ttft"]:
            out[name.removesuffix(key)] = {
                p: {"median": round(statistics.median(xs), 2), "mean": round(statistics.fmean(xs), 2)}
                for p, xs in deltas.items()} | {"requests": len(deltas["ttft"])}
    return out


def pooled(trials: list, mbps: float, slack: float = 1.05, reps: int = 2000) -> dict:
    """Per quantile: cost_aware's quantile over every request of every trial against min(no_prefetch,
    whole_task)'s (:func:`scripts.trials.pooled_ratio`), with a 90 % bootstrap interval over the
    trials; ``met``: the ratio is within ``slack``; ``met_ci``: the whole interval is.  Beside the
    median over trials of each trial's quantile (:func:`verdicts`): with 32 requests a trial's p50
    falls between the hits' and the misses' modes and swings +-10 % between trials of one arm.
    Uses the trials that ran cost_aware; an arm missing from any of them is left out of the min.
    Empty without cost_aware and one of the others."""
    key = f"{mbps:g}"
    names = {"cost_aware": f"cost_aware@{key}", "no_prefetch": "no_prefetch", "whole_task": f"whole_task@{key}"}
    ran = [t for t in trials if "ttft_ms" in t.get(names["cost_aware"], {})]
    per_arm = {arm: [t[k]["ttft_ms"] for t in ran] for arm, k in names.items()
               if ran and all("ttft_ms" in t.get(k, {}) for t in ran)}
    out = {}
    for q in (50, 90):
        r = pooled_ratio(per_arm, "cost_aware", ("no_prefetch", "whole_task"), lambda xs, q=q: percentile(xs, q),
                         reps=reps, seed=int(mbps) * 100 + q)
        if r is not None:
            out[f"ttft_p{q}_ms"] = {"cost_aware": round(r["cost_aware"], 2), "best_other": round(r["best"], 2),
                                    "ratio": round(r["ratio"], 3), "ci90": [round(x, 3) for x in r["ci"]],
                                    "n_trials": r["n_trials"], "requests": r["n"],
                                    "met": r["ratio"] <= slack, "met_ci": r["ci"][1] <= slack}
    return out


def verdicts(row: dict, slack: float = 1.05) -> dict:
    """cost_aware <= slack x min(no_prefetch, whole_task), at p50 and p90 (met or missed)."""
    arms = row["arms"]
    out = {}
    for q in ("ttft_p50_ms", "ttft_p90_ms"):
        if not all(a in arms for a in ("cost_aware", "no_prefetch", "whole_task")):
            continue
        bound = min(arms["no_prefetch"][q], arms["whole_task"][q])
        out[q] = {"cost_aware": arms["cost_aware"][q], "bound": round(slack * bound, 2),
                  "met": arms["cost_aware"][q] <= slack * bound}
    return out


# -- the measured parts ---------------------------------------------------------------------------------
def run_stream(port: int, wl: Workload, tag: str, max_new_tokens: int = 4) -> list:
    """The measured stream: each request sent at its arrival time from its own thread."""
    from scripts.sglang_server import stream_generate

    replies: list = [None] * len(wl.requests)
    errors: list = []
    t0 = time.perf_counter() + 0.05

    def one(i, r):
        delay = t0 + r.at_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # the arrival schedule, not a synchronisation
        try:
            replies[i] = stream_generate(port, list(r.ids), max_new_tokens, rid=f"{tag}-{i}")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"request {i}: {exc!r}")

    threads = [threading.Thread(target=one, args=(i, r), daemon=True) for i, r in enumerate(wl.requests)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 600
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if errors or any(r is None for r in replies):
        raise RuntimeError(f"{tag}: {len(errors)} requests failed: {errors[:3]}")
    return replies


@dataclasses.dataclass
class Bench:
    work: Path
    model: object
    speeds: list
    trials: int
    wl_args: dict
    setups: tuple = SETUPS
    kvs_arms: tuple = ("whole_task", "timeout", "cost_aware")
    chunk_max_blocks: int = 0  # kvsidecar sessions' chunk (0: the sidecar's default, 128 blocks)
    shared_server: bool = False  # one SGLang server for every kvsidecar arm of a trial (faster, not independent)
    instance_prefix: str = "kvsttft"
    server_times: bool = False  # every server with --enable-metrics: SGLang's own per-request time stats
    # kvsidecar's per-phase timeline (a log line per storage phase of every request, written on the
    # scheduler thread: the bench's instrumentation, not the product's path) -- diagnosis only
    timeline: bool = False
    started: float = dataclasses.field(default_factory=time.time)

    @property
    def server_args(self) -> tuple:
        # SGLang's --dtype auto would turn a float32 config into a half type: the model's, always
        return ("--dtype", self.model.dtype) + (("--enable-metrics",) if self.server_times else ())

    def __post_init__(self):
        self.model_dir = self.model.write(self.work / "model")
        self.n = 0

    def _instance(self) -> str:
        self.n += 1
        return f"{self.instance_prefix}{os.getpid()}x{self.n}"

    # storage set-ups --------------------------------------------------------------------------------
    def arm_no_prefetch(self, wl, tag):
        from scripts.sglang_server import start_server

        srv = start_server(self.model_dir, self.work, storage="none", extra_args=self.server_args)
        try:
            return {"no_prefetch": self._measure(srv.port, wl, tag, lambda: None, None, "no_prefetch",
                                                 cpu=_cpu_meter(srv))}
        finally:
            srv.stop()

    def arm_sglang_file(self, wl, tag):
        from scripts.sglang_server import start_server

        fdir = self.work / f"file-{tag}"
        fdir.mkdir(parents=True)
        srv = start_server(self.model_dir, self.work, storage="file", file_dir=fdir, extra_args=self.server_args)

        def stored():  # one file per page and rank
            return sum(1 for n in os.listdir(fdir) if n.endswith(".bin")) // 2

        try:
            return {"sglang_file": self._measure(srv.port, wl, tag, lambda: None, stored, "sglang_file",
                                                 cpu=_cpu_meter(srv))}
        finally:
            srv.stop()

    def arm_kvsidecar(self, wl, tag, order):
        from kvsidecar.connector.kv_client import KVConnector
        from kvsidecar.shm.layout import KVLayout
        from kvsidecar.sidecar.spawn import SidecarProcess
        from scripts.sglang_server import TP, start_server

        instance = self._instance()
        cfg = self.work / f"kvsidecar-{tag}.toml"
        cfg.write_text(f'instance = "{instance}"\nmodel = "tiny"\ntimeout_s = 2.0\nreattach_every_s = 0.05\n'
                       f'timeline = {str(self.timeline).lower()}\n[sessions]\npolicy = "cost_aware"\nget_wait_s = 20.0\n'
                       f'chunk_max_blocks = {self.chunk_max_blocks}\n')
        side_log = open(self.work / f"sidecar-{tag}.log", "ab")
        holder = {}

        def sidecar(l3, **over):
            if "sc" in holder:
                holder["probe"].close()
                holder["sc"].stop()
            o = self.model.sidecar_overrides(l3, **over)
            holder["sc"] = SidecarProcess(instance, overrides=o, stderr=side_log)
            lay = KVLayout(**{k.split(".", 1)[1]: v for k, v in o.items() if k.startswith("layout.")})
            c = KVConnector(instance, lay, rank=0, group=f"sglang:tiny:tp{TP}:pp0:dp0", populate="off")
            c.attach()
            holder["probe"] = c
            return c

        srv = None
        if self.shared_server:
            sidecar(self.work / f"l3-{tag}-start")
            srv = start_server(self.model_dir, self.work, storage="kvsidecar", kvsidecar_cfg=cfg,
                                   extra_args=self.server_args)
        out = {}
        try:
            for mbps, arm in order:
                over = {"l3.bandwidth_mbps": float(mbps), "sessions.policy_override": KVS_POLICY[arm],
                        **ARM_SIDECAR.get(arm, {})}
                if not self.shared_server and srv is not None:
                    srv.stop()  # (before its sidecar goes: no re-attach churn in a server about to stop)
                    srv = None
                c = sidecar(self.work / f"l3-{tag}-{arm}-{mbps:g}", **over)  # a fresh pool and L3
                if srv is None:  # a fresh server per arm: nothing an arm left behind reaches the next
                    srv = start_server(self.model_dir, self.work, storage="kvsidecar", kvsidecar_cfg=cfg,
                                   extra_args=self.server_args)

                def flush_pool(c=c):
                    _drain_puts(c)
                    c.flush()

                def stored(c=c):  # published, and written behind to L3
                    s = c.stats()
                    return s["store"].get("published_blocks", 0) if not s["l3"].get("puts_in_flight", 0) else -1

                def puts(c=c):  # blocks written behind to L3 and kept from it by the gate
                    n = c.stats()["counters"]
                    return {"written": n.get("l3_published_blocks", 0), "gated": n.get("l3_put_gated_blocks", 0)}

                res = self._measure(srv.port, wl, f"{tag}-{arm}-{mbps:g}", flush_pool, stored, arm,
                                    cpu=_cpu_meter(srv, holder["sc"].pid), puts=puts)
                st = c.stats()
                res["sidecar"] = {"sessions": st.get("sessions", {}), "l3": st.get("l3", {}),
                                  "l3_put": {k: v for k, v in st.get("counters", {}).items() if k.startswith("l3_")}}
                out[f"{arm}@{mbps:g}"] = res
        finally:
            if srv is not None:
                srv.stop()
            if "sc" in holder:
                holder["probe"].close()
                holder["sc"].stop()
            side_log.close()
        return out

    # one arm on a running server -----------------------------------------------------------------
    def _measure(self, port, wl, tag, flush_pool, stored_count, arm, cpu=None, puts=None) -> dict:
        """``stored_count()``: pages the storage holds (kvsidecar: published blocks; file: files
        per rank); ``flush_pool()``: empties kvsidecar's CPU pool (the next hits come from L3);
        ``cpu()``: CPU seconds used so far per process group; ``puts()``: kvsidecar's write-behind
        counters so far (the stream's share of both is reported)."""
        from scripts.sglang_server import flush_cache, stream_generate

        # seed the shared prefixes (one request each; write-through to storage), then flush
        count = stored_count or (lambda: 0)
        base = count()
        for p in wl.prefixes:
            stream_generate(port, list(p), 1)
        self._wait_stored(stored_count, base + sum(_pages(p) for p in wl.prefixes), arm)
        flush_cache(port)
        flush_pool()
        # the kernel writes dirty file pages back ~30 s after they were written: the seeding's and
        # an earlier arm's tier files (L3, SGLang's file backend) would otherwise be flushed during
        # whichever stream runs then, on the 2 cores both ranks need; the stream's own writes stay
        os.sync()
        cpu0, puts0 = (cpu() if cpu else {}), (puts() if puts else {})
        replies = run_stream(port, wl, tag)
        cpu1, puts1 = (cpu() if cpu else {}), (puts() if puts else {})
        res = {"cpu_s": {k: round(cpu1[k] - cpu0[k], 3) for k in cpu1},"ttft_s": [r.ttft_s for r in replies], "storage": [r.storage_tokens for r in replies],
               "outputs": [r.output_ids for r in replies],
               "timeline": {f"{tag}-{i}": [round(r.sent_at, 6), round(r.ttft_s, 6)] for i, r in enumerate(replies)},
               "server_s": [r.server_s for r in replies] if any(r.server_s for r in replies) else None,
               "stream_l3_blocks": {k: puts1[k] - puts0.get(k, 0) for k in puts1}}
        # the hit probe: cold, then after SGLang's flush a storage hit (kvsidecar: its pool)
        cold, hit, ok, hit_storage, hit_server = [], [], True, [], []
        for j, p in enumerate(wl.probes):
            flush_cache(port)
            base = count()
            a = stream_generate(port, list(p), 4, rid=f"{tag}-probe{j}-cold")
            self._wait_stored(stored_count, base + _pages(p), arm)
            flush_cache(port)
            b = stream_generate(port, list(p), 4, rid=f"{tag}-probe{j}-hit")
            cold.append(a.ttft_s)
            hit.append(b.ttft_s)
            res["timeline"][f"{tag}-probe{j}-cold"] = [round(a.sent_at, 6), round(a.ttft_s, 6)]
            res["timeline"][f"{tag}-probe{j}-hit"] = [round(b.sent_at, 6), round(b.ttft_s, 6)]
            hit_storage.append(b.storage_tokens)
            hit_server.append(b.server_s)
            ok = ok and a.output_ids == b.output_ids
        res["probe"] = {"cold_ms": [round(x * 1e3, 2) for x in cold], "hit_ms": [round(x * 1e3, 2) for x in hit],
                        "hit_storage_tokens": hit_storage, "outputs_match": ok}
        if any(hit_server):  # SGLang's own phases of each hit (--server-times)
            res["probe"]["hit_server_s"] = hit_server
        return res

    @staticmethod
    def _wait_stored(stored_count, want: int, arm: str, timeout_s: float = 60.0) -> None:
        """Bounded: storage holds ``want`` pages (SGLang writes through asynchronously)."""
        if stored_count is None:
            return
        deadline = time.monotonic() + timeout_s
        while stored_count() < want:
            if time.monotonic() > deadline:
                log.warning("%s: storage holds %d of %d pages after %.0f s", arm, stored_count(), want, timeout_s)
                return
            time.sleep(0.02)

    def trial(self, k: int) -> dict:
        wl = make_workload(1000 + k, **self.wl_args)
        tag = f"t{k}"
        kvs_order = [(m, a) for m in self.speeds for a in self.kvs_arms]
        rot = k % len(kvs_order)
        kvs_order = kvs_order[rot:] + kvs_order[:rot]
        setups = [("no_prefetch", lambda: self.arm_no_prefetch(wl, tag)),
                  ("sglang_file", lambda: self.arm_sglang_file(wl, tag)),
                  ("kvsidecar", lambda: self.arm_kvsidecar(wl, tag, kvs_order))]
        setups = [s for s in setups if s[0] in self.setups]
        r = k % len(setups)
        if r:  # interleaved: the set-ups rotate between trials; cold first needs no_prefetch earlier
            setups = setups[r:] + setups[:r]
        raw = {}
        for name, run in setups:
            t = time.monotonic()
            raw.update(run())
            log.info("trial %d: %s done in %.0f s", k, name, time.monotonic() - t)
        cold = raw["no_prefetch"]["outputs"] if "no_prefetch" in raw else None
        out = {}
        for key, res in raw.items():
            out[key] = {**summarize(res["ttft_s"], res["storage"], cold is None or res["outputs"] == cold),
                        "probe": res["probe"], "client_timeline": res["timeline"]}
            if "sidecar" in res:
                out[key]["sidecar"] = res["sidecar"]
            if res.get("cpu_s"):
                out[key]["cpu_s"] = res["cpu_s"]
            if res.get("stream_l3_blocks"):
                out[key]["stream_l3_blocks"] = res["stream_l3_blocks"]
            if res.get("server_s"):
                out[key]["server_s"] = res["server_s"]
        out["server_logs"] = [str(p) for p in sorted(self.work.glob("server-*.log"))]
        return out


def _cpu_meter(srv, sidecar_pid: int | None = None):
    """CPU seconds so far of the server's processes and (kvsidecar) the sidecar's."""
    from scripts.common import cpu_seconds, session_cpu_seconds

    def meter():
        out = {"server": session_cpu_seconds(srv.proc.pid)}
        if sidecar_pid is not None:
            out["sidecar"] = cpu_seconds(sidecar_pid)
        return out

    return meter


def _pages(ids) -> int:
    """Pages SGLang writes through for a prompt (its last token is not cached)."""
    from scripts.sglang_server import PAGE

    return (len(ids) - 1) // PAGE


def _drain_puts(c, deadline=None):
    deadline = deadline or time.monotonic() + 60
    while c.stats()["l3"].get("puts_in_flight", 0) and time.monotonic() < deadline:
        time.sleep(0.02)


def probe_table(trials: list) -> dict:
    """Per arm: median cold / hit TTFT of the hit probe (all trials pooled)."""
    out = {}
    for key in sorted({k for t in trials for k in t if k != "server_logs"}):
        cold = [x for t in trials if key in t for x in t[key]["probe"]["cold_ms"]]
        hit = [x for t in trials if key in t for x in t[key]["probe"]["hit_ms"]]
        st = [x for t in trials if key in t for x in t[key]["probe"]["hit_storage_tokens"]]
        out[key] = {"cold_p50_ms": round(statistics.median(cold), 1), "hit_p50_ms": round(statistics.median(hit), 1),
                    "hit_over_cold": round(statistics.median(hit) / statistics.median(cold), 3),
                    "hit_storage_tokens": st,
                    "outputs_match": all(t[key]["probe"]["outputs_match"] for t in trials if key in t)}
    return out


def _quartiles(xs: list) -> dict:
    q = statistics.quantiles(xs, n=4) if len(xs) >= 2 else [xs[0]] * 3
    return {"q1_ms": round(q[0], 1), "median_ms": round(q[1], 1), "q3_ms": round(q[2], 1), "n": len(xs)}


def pool_hit_verdict(trials: list) -> dict:
    """A kvsidecar pool hit against recompute and ``sglang_file``'s hit.  The hit probe's prompt is
    resident in kvsidecar's pool whatever the policy or L3 speed, so every kvsidecar arm's hits are
    pooled (a larger sample than one arm's; the spread of one arm's 12 hits was 105-257 ms here);
    recompute is the no_prefetch server's TTFT for the same prompt after ``/flush_cache``."""
    kvs = [x for t in trials for k, v in t.items() if "@" in k for x in v["probe"]["hit_ms"]]
    file_ = [x for t in trials if "sglang_file" in t for x in t["sglang_file"]["probe"]["hit_ms"]]
    rec = [x for t in trials if "no_prefetch" in t for x in t["no_prefetch"]["probe"]["hit_ms"]]
    out = {name: _quartiles(xs) for name, xs in (("kvsidecar_pool_hit", kvs), ("sglang_file_hit", file_),
                                                  ("recompute", rec)) if xs}
    if "kvsidecar_pool_hit" in out:
        m = out["kvsidecar_pool_hit"]["median_ms"]
        out["verdict"] = {f"beats_{name}": m < out[name]["median_ms"]
                          for name in ("sglang_file_hit", "recompute") if name in out}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one L3 speed, one trial (under 8 minutes)")
    ap.add_argument("--trials", type=int, default=None)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--probes", type=int, default=4, help="hit probes per arm and trial (cold, then a hit)")
    ap.add_argument("--mean-gap-ms", type=float, default=150.0,
                    help="the stream's mean Poisson inter-arrival gap (sized for a 2K-token prefill of ~100 ms; "
                         "scale it with this machine's: a slower CPU at 150 ms overloads no_prefetch's queue)")
    ap.add_argument("--fast-mbps", type=float, default=2000.0, help="L3 faster than recompute")
    ap.add_argument("--slow-mbps", type=float, default=8.0,
                    help="L3 slower than recompute (a 16 KiB block: ~16 ms, against ~0.5 ms to recompute its 16 tokens)")
    ap.add_argument("--work", default=None, help="scratch folder (default: .cache/sglang_ttft)")
    ap.add_argument("--setups", default="no_prefetch,sglang_file,kvsidecar", help="which servers (diagnosis)")
    ap.add_argument("--kvs-arms", default="whole_task,timeout,cost_aware",
                    help="kvsidecar arms, in order (cost_aware_twin: cost_aware again, an A/A check of the noise; "
                         "cost_aware_write_all: cost_aware writing every store behind to L3, the gate's A/B; "
                         "cost_aware_held_off: cost_aware not counting the older requests it would hold up)")
    ap.add_argument("--chunk-max-blocks", type=int, default=8,
                    help="kvsidecar's chunk (bounds a stop's regret: 8 blocks = 128 KiB, 130 ms at 8 Mbit/s)")
    ap.add_argument("--shared-server", action="store_true",
                    help="one kvsidecar-backed SGLang server per trial for all its kvsidecar arms (sidecar restarted "
                         "per arm): faster, but an arm inherits the server state the one before left (measured: "
                         "cost_aware at 2 Mbit/s 1.6-2.5x no_prefetch right after whole_task's 5 s waits, 0.92 first)")
    ap.add_argument("--server-times", action="store_true",
                    help="run every server with --enable-metrics and split each TTFT with SGLang's own time stats "
                         "(entry: sent -> queued, queue, prefill, rest: the token back to the client); diagnosis")
    ap.add_argument("--timeline", action="store_true",
                    help="kvsidecar's per-phase timeline in the server logs (for scripts.sglang_timeline): a log line "
                         "per storage phase of every request, written on the scheduler threads; diagnosis, off by default")
    ap.add_argument("--keep-data", action="store_true",
                    help="keep the L3 and file-tier stores (~500 MiB a run); logs are always kept")
    ap.add_argument("--warmup", type=int, default=None,
                    help="whole trials run first and discarded (default: 1 when --trials > 1, else 0): the first "
                         "trial of a run was the slowest in 13 of 13 runs, its arms' median p50 1.1-2.6x the other "
                         "trials' (first server starts, cold caches), whichever arm it ran first")
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="the model's weights and KV (auto: bf16 where the CPU has it natively, AVX512-BF16 / AMX, "
                         "else float32: emulated bf16 made the prefill ~4x slower and overloaded the server)")
    ap.add_argument("--combine", nargs="+", metavar="RUN.json",
                    help="run nothing: pool the trials of these runs' JSONs (same workload and model) and write "
                         "every figure recomputed over them to --json")
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    if a.combine:
        try:
            return main_combine(a.combine, a.json)
        except CombineError as exc:
            ap.error(str(exc))
    for flag, given, known in (("--setups", a.setups, SETUPS), ("--kvs-arms", a.kvs_arms, tuple(KVS_POLICY))):
        unknown = [x for x in given.split(",") if x not in known]
        if unknown:  # a misspelt name would otherwise run a trial with that set-up silently left out
            ap.error(f"{flag}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks: stop every server
    from scripts.sglang_server import ROOT, Model, clean_shm, default_dtype

    speeds = [a.fast_mbps] if a.quick else [a.fast_mbps, a.slow_mbps]
    trials = a.trials or (1 if a.quick else 3)
    work = Path(a.work or ROOT / ".cache" / "sglang_ttft") / f"run-{os.getpid()}"
    work.mkdir(parents=True)
    model = Model(dtype=default_dtype() if a.dtype == "auto" else a.dtype)
    log.info("model dtype %s (%s)", model.dtype, "given" if a.dtype != "auto" else "this CPU's")
    wl_args = {"requests": a.requests, "probes": a.probes, "mean_gap_s": a.mean_gap_ms / 1e3}
    bench = Bench(work, model, speeds, trials, wl_args, tuple(a.setups.split(",")),
                  tuple(a.kvs_arms.split(",")), a.chunk_max_blocks, a.shared_server, server_times=a.server_times,
                  timeline=a.timeline)
    warmup = a.warmup if a.warmup is not None else (1 if trials > 1 else 0)
    results = []
    try:
        for w in range(warmup):  # (its own workload seed and arm order; nothing of it is kept)
            t0 = time.monotonic()
            bench.trial(-1 - w)
            log.info("warm-up trial %d done in %.0f s (discarded)", w + 1, time.monotonic() - t0)
        for k in range(trials):
            results.append(bench.trial(k))
    finally:
        removed = clean_shm(bench.instance_prefix, bench.started)
        log.info("removed %d leftovers from /dev/shm", len(removed))
        if not a.keep_data:
            freed = prune_tier_data(work)
            log.info("removed %.0f MiB of L3 / file-tier data under %s (logs kept)", freed / 2**20, work)
    doc = report(results, speeds, {"warmup_trials": warmup, "model": dataclasses.asdict(model),
                                   "block_bytes": model.block_bytes, "requests": a.requests,
                                   "mean_gap_ms": a.mean_gap_ms})
    write_json(a.json, doc, indent=1)
    print_table(doc)
    return 0


def report(results: list, speeds: list, meta: dict) -> dict:
    """The JSON document of a run (or of several combined): every figure is computed from
    ``results`` (the trials), ``meta`` is carried as it is."""
    doc = {"rows": rows(results, speeds), "probe": probe_table(results), "pool_hit": pool_hit_verdict(results),
           "trials": results, **meta}
    for row in doc["rows"]:
        row["verdict"] = verdicts(row)
        row["paired"] = paired(results, row["l3"]["bandwidth_mbps"])
        row["pooled"] = pooled(results, row["l3"]["bandwidth_mbps"])
        row["paired_phases"] = paired_phases(results, row["l3"]["bandwidth_mbps"])
    return doc


# what must agree for trials of several runs to be pooled: the same stream and model
COMBINE_KEYS = ("requests", "mean_gap_ms", "model", "block_bytes")


class CombineError(ValueError):
    """Runs that cannot be pooled (another workload or model), or a file that is not a run's JSON."""


def combine(docs: list, names: list) -> dict:
    """One document over the trials of several runs' JSONs (``docs``, from files ``names``): a 5 %
    question needs more trials than one run of minutes gives (two identical arms drifted 12 %
    apart over 8 trials here), so the runs' trials are pooled and every figure recomputed from
    them, exactly as a run computes its own.  Trial ``k`` of every run streams the same workload
    (seed ``1000 + k``); runs must agree on :data:`COMBINE_KEYS`, or :class:`CombineError`.
    The rows are the L3 speeds any run measured (fastest first)."""
    if not docs:
        raise CombineError("nothing to combine")
    for name, d in zip(names, docs):
        if not isinstance(d, dict) or not isinstance(d.get("trials"), list) or not d["trials"]:
            raise CombineError(f"{name}: not a scripts.sglang_ttft JSON with trials")
        for k in COMBINE_KEYS:
            if d.get(k) != docs[0].get(k):
                raise CombineError(f"{name}: {k} {d.get(k)!r} differs from {names[0]}'s {docs[0].get(k)!r}: "
                                   "another workload or model, its trials do not pool")
    trials = [t for d in docs for t in d["trials"]]
    speeds = sorted({float(k.rsplit("@", 1)[1]) for t in trials for k in t if "@" in k}, reverse=True)
    meta = {k: docs[0].get(k) for k in COMBINE_KEYS}
    meta["combined_from"] = [{"file": str(n), "trials": len(d["trials"])} for n, d in zip(names, docs)]
    return report(trials, speeds, meta)


def main_combine(files: list, out: str) -> int:
    import json

    docs = []
    for f in files:
        try:
            with open(f) as fh:
                docs.append(json.load(fh))
        except (OSError, ValueError) as exc:
            raise CombineError(f"{f}: {exc}") from None
    doc = combine(docs, files)
    write_json(out, doc, indent=1)
    print(f"{len(doc['trials'])} trials from {len(files)} runs")
    print_table(doc)
    return 0


def prune_tier_data(work: Path) -> int:
    """Remove the run's tier stores (``l3-*``, ``file-*``), keep its logs, configs and model.

    Returns the bytes freed.  The stores are what fills a disk: a few hundred MiB a run.
    """
    import shutil
    freed = 0
    for d in [*work.glob("l3-*"), *work.glob("file-*")]:
        if d.is_dir():
            freed += sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            shutil.rmtree(d, ignore_errors=True)
    return freed


def print_table(doc: dict) -> None:
    for row in doc["rows"]:
        print(f"L3 {row['l3']['bandwidth_mbps']:g} Mbit/s")
        for arm, v in row["arms"].items():
            t = v["trials"]
            every = v.get("pooled") or {}
            over = f"  every request p50 {every['ttft_p50_ms']:.1f} p90 {every['ttft_p90_ms']:.1f}" if every else ""
            cpu = "".join(f"  cpu {name} {fmt(secs, 2)} s" for name, secs in (t.get("cpu_s") or {}).items())
            if t.get("stream_l3_blocks"):
                cpu += "  L3 blocks " + " ".join(f"{k} {fmt(n, 0)}" for k, n in t["stream_l3_blocks"].items())
            if v.get("server_ms"):
                cpu += "  SGLang ms (median) " + " ".join(f"{k} {x:.1f}" for k, x in v["server_ms"].items())
            print(f"  {arm:12s} p50 {fmt(t['ttft_p50_ms'], 1):>28s}  p90 {fmt(t['ttft_p90_ms'], 1):>28s}  "
                  f"storage tok {fmt(t['storage_tokens_mean'], 0):>18s}  match {t['outputs_match_cold']}{over}{cpu}")
        for q, v in row.get("verdict", {}).items():
            print(f"  cost_aware {q}: {v['cost_aware']} vs 1.05 x min = {v['bound']}: {'met' if v['met'] else 'MISSED'}")
        for q, v in row.get("paired", {}).items():
            print(f"  cost_aware {q} / min(no_prefetch, whole_task), paired within each trial: "
                  f"{v['median']:.3f} [{v['min']:.3f}..{v['max']:.3f}] (n={v['n']})")
        for q, v in row.get("pooled", {}).items():
            print(f"  cost_aware {q} over every request ({v['requests']} in {v['n_trials']} trials): {v['cost_aware']} vs "
                  f"min {v['best_other']}: {v['ratio']:.3f}, 90 % interval over trials [{v['ci90'][0]:.3f}.."
                  f"{v['ci90'][1]:.3f}]: {'met' if v['met'] else 'MISSED'}"
                  f"{'' if v['met_ci'] == v['met'] else (' (the interval reaches past 1.05)' if v['met'] else ' (the interval reaches under 1.05)')}")
        for arm, v in row.get("paired_phases", {}).items():
            print(f"  {arm} - no_prefetch, paired per request ({v['requests']}), median / mean ms: "
                  + "  ".join(f"{p} {v[p]['median']:+.1f} / {v[p]['mean']:+.1f}" for p in ("ttft", *PHASES)))
    print("hit probe (median over probes and trials): cold / hit TTFT ms")
    for key, v in doc["probe"].items():
        print(f"  {key:18s} cold {v['cold_p50_ms']:8.1f}  hit {v['hit_p50_ms']:8.1f}  x{v['hit_over_cold']:.2f}  "
              f"match {v['outputs_match']}")
    ph = doc.get("pool_hit") or {}
    if ph:
        print("pool hit (all kvsidecar arms pooled) vs sglang_file's hit vs recompute: q1 / median / q3 ms (n)")
        for name in ("kvsidecar_pool_hit", "sglang_file_hit", "recompute"):
            if name in ph:
                v = ph[name]
                print(f"  {name:20s} {v['q1_ms']:7.1f} / {v['median_ms']:7.1f} / {v['q3_ms']:7.1f}  ({v['n']})")
        for k, ok in ph.get("verdict", {}).items():
            print(f"  kvsidecar pool hit {k.replace('_', ' ')}: {'met' if ok else 'MISSED'}")


if __name__ == "__main__":
    sys.exit(main())
