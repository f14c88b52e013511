"""Engine simulator with real processes: N TP ranks, each with a paged KV pool of CPU tensors,
restoring prefixes through a real kvsidecar process under each prefetch policy arm.

    python -m scripts.simulate [--quick] [--json PATH] [--l3 file|mooncake|auto] [--requests N]
        [--load L] [--tp N] [--l3-mbps M] [--trials K] [--timeline]
    python -m scripts.simulate --table [--requests 48 --trials 3] [--json PATH] [--plot FILE.png]

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
and admits the first ready one; a scanned request is a scheduling candidate (``demand``).

What is measured is the product's path: TTFT = end of the modelled prefill - arrival, i.e.
queueing + prefetch wait + the GET (lease) + the copy into the engine's pages + the prefill of
everything not restored (``compute_ms_per_ktok``, a sleep).  The simulator's own checking
(every loaded page against the KV the model would have produced, ``corrupt``; filling the
recomputed pages) runs inside the modelled prefill's sleep, so it is not charged to TTFT
(``sim_overhead_ms`` reports any overrun).  Every rank must admit the same request with the same
restored length at every step (``ranks_agree``).  Rank 0 stamps a per-request timeline
(``--timeline``) joined with the session's own events from the sidecar (``poll`` with
``events``); bounds are computed from the rates this run achieved (``scripts.ttft_bounds``).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
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
from scripts import ttft_bounds
from scripts.sim_virtual import ARMS

STEP_S = 0.002  # one scheduler loop iteration while nothing is ready


def make_layout(tp: int) -> KVLayout:
    return KVLayout(model="sim", num_layers=4, num_kv_heads=4, head_dim=32, dtype="float16",
                    tokens_per_block=64, tp_size=tp)


def request_stream(seed: int, n: int, n_prefixes: int, prefix_tokens: int, suffix_tokens: int, gap_s: float,
                   load: float | None = None, compute_ms_per_ktok: float = 50.0, pool_blocks: int = 0,
                   follow_up: float = 0.25):
    """(arrival_s, req_id, tokens): shared system prompts, unique suffixes, follow-up turns.

    Arrivals: with ``load`` None, Poisson with mean gap ``gap_s``; with ``load`` > 0, Poisson at
    ``load`` x the capacity of the no-prefetch engine (its mean service: the prefill of what is
    not in an LRU pool of ``pool_blocks`` blocks); with ``load`` == 0 (idle), each request arrives
    1.2 x its full prefill after the one before."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 32000) for _ in range(prefix_tokens)] for _ in range(n_prefixes)]
    prompts = []
    for _ in range(n):
        if prompts and rng.random() < follow_up:  # a follow-up turn of an earlier conversation
            base = rng.choice(prompts)
        else:
            base = prefixes[rng.randrange(n_prefixes)]
        prompts.append(base + [rng.randrange(1, 32000) for _ in range(suffix_tokens)])
    if load is None:
        gaps = [rng.expovariate(1.0 / gap_s) for _ in range(n)]
    else:
        service = ttft_bounds.no_prefetch_service_s(prompts, 64, compute_ms_per_ktok, pool_blocks)
        arr = random.Random(seed * 7919 + 1)
        mean = sum(service) / len(service)
        full = [len(t) * compute_ms_per_ktok / 1024 / 1e3 for t in prompts]  # idle: even a miss has finished
        gaps = [1.2 * s for s in full] if load <= 0 else [arr.expovariate(load / mean) for _ in range(n)]
    out, t = [], 0.0
    for i, toks in enumerate(prompts):
        out.append((t, f"r{i}", toks))
        t += gaps[i]
    return out


def stream_of(args: dict) -> list:
    return request_stream(args["seed"], args["requests"], args["n_prefixes"], args["prefix_tokens"],
                          args["suffix_tokens"], args.get("gap_s", 1.0), load=args.get("load"),
                          compute_ms_per_ktok=args["compute_ms_per_ktok"], pool_blocks=args["pool_blocks"])


# -- the simulated model's KV: a pure function of the block key, so every load can be checked ----
def _base(layout: KVLayout, rank: int):
    import torch

    g = torch.Generator().manual_seed(1234 + layout.shard_of(rank))
    shape = (layout.tokens_per_block, layout.heads_per_shard, layout.head_dim)
    return [[torch.randint(-100, 100, shape, generator=g).to(torch.float16) for _ in range(layout.kv_factor)]
            for _ in range(layout.num_layers)]


def _seed(key: bytes) -> int:
    return int.from_bytes(key[:4], "little") % 997


def _expected(base_t, seeds):
    import torch

    s = torch.tensor(seeds, dtype=torch.float16).view(-1, 1, 1, 1)
    return base_t.unsqueeze(0) + s


def fill_pages(kv, base, pages: list, keys: list) -> None:
    """Write the model's KV for ``keys`` into ``pages`` (one vectorised copy per tensor)."""
    if not pages:
        return
    import torch

    idx, seeds = torch.tensor(pages), [_seed(k) for k in keys]
    for layer, tensors in enumerate(kv):
        for k, t in enumerate(tensors):
            t.index_copy_(0, idx, _expected(base[layer][k], seeds))


def bad_pages(kv, base, pages: list, keys: list) -> int:
    """How many of ``pages`` do not hold the model's KV for ``keys``."""
    if not pages:
        return 0
    import torch

    idx, seeds = torch.tensor(pages), [_seed(k) for k in keys]
    bad = torch.zeros(len(pages), dtype=torch.bool)
    for layer, tensors in enumerate(kv):
        for k, t in enumerate(tensors):
            got = t.index_select(0, idx)
            bad |= (got != _expected(base[layer][k], seeds)).flatten(1).any(1)
    return int(bad.sum())


def fill_page(kv, base, page: int, key: bytes) -> None:
    fill_pages(kv, base, [page], [key])


def page_ok(kv, base, page: int, key: bytes) -> bool:
    return bad_pages(kv, base, [page], [key]) == 0


class _Rank:
    """One TP rank for one arm: its adapter, its paged KV pool, its copy of the waiting queue."""

    def __init__(self, args: dict, rank: int):
        import torch

        from kvsidecar.connector.adapter import AdapterConfig, EngineAdapter

        self.args, self.rank = args, rank
        lay = self.layout = make_layout(args["tp"])
        self.T = lay.tokens_per_block
        kw = args.get("arm_kw")
        self.prefetch = kw is not None
        self.eta_aware = (kw or {}).get("policy") == "cost_aware"
        policy = (kw or {}).get("policy", "timeout")
        budget = (kw or {}).get("budget_s", args.get("budget_s"))
        cfg = AdapterConfig(policy=policy, chunk_max_blocks=(kw or {}).get("chunk_max_blocks"),
                            budget_s=budget if policy == "timeout" else None,
                            store_to_l3=args["store_to_l3"],
                            prefill_s_per_block=self.compute_s_per_block() or None)
        self.ad = EngineAdapter(args["instance"], lay, rank=rank, group=f"sim-{args['arm']}", config=cfg)
        shape = (args["engine_pages"], self.T, lay.heads_per_shard, lay.head_dim)
        self.kv = [tuple(torch.zeros(shape, dtype=torch.float16) for _ in range(lay.kv_factor))
                   for _ in range(lay.num_layers)]
        self.ad.kv_caches = self.kv
        self.base = _base(lay, rank)
        self.free_pages = list(range(args["engine_pages"] - 1, -1, -1))
        self.stream = {rid: (arr, toks) for arr, rid, toks in stream_of(args)}
        self.queue: list = []
        self.demanded: set = set()
        self.corrupt = 0
        self.running: dict | None = None  # the prefill on the device: rid, modelled end, pages
        self.checker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sim-check")
        self.timeline = rank == 0 and bool(args.get("timeline"))
        self.marks: dict = collections.defaultdict(dict)  # rid -> {phase: monotonic time}
        self._instrument()
        self.ad.start()

    def _instrument(self) -> None:
        """Stamp when the GET answered and the copy ended (wrapping the connector, not changing it)."""
        conn, marks, cur = self.ad.conn, self.marks, self

        def timed(fn, name):
            def call(*a, **kw):
                out = fn(*a, **kw)
                if cur._admitting is not None:
                    marks[cur._admitting][name] = time.monotonic()
                return out
            return call

        self._admitting = None
        conn.get, conn.load = timed(conn.get, "got"), timed(conn.load, "loaded")

    def _check_and_fill(self, pages: list, keys: list, restored: int) -> int:
        bad = bad_pages(self.kv, self.base, pages[:restored], keys[:restored])
        fill_pages(self.kv, self.base, pages[restored:], keys[restored:])
        return bad

    def compute_s_per_block(self) -> float:
        return self.args["compute_ms_per_ktok"] * self.T / 1024 / 1e3

    def alloc(self, n):
        if n > len(self.free_pages):
            return None
        return [self.free_pages.pop() for _ in range(n)]

    def step(self, step: int, arrivals: list, t0: float, busy_until: float | None = None) -> dict:
        """One loop iteration: requests that arrived enter the queue (and prefetch); a prefill
        that ended completes; a free engine scans the queue and starts the first ready request.
        The prefill itself runs "on the device" (modelled as busy time) while the loop goes on,
        as with an overlapping scheduler: arrivals during a prefill enter the queue at once."""
        for rid in arrivals:
            self.queue.append(rid)
            if self.prefetch:
                self.ad.on_queue_entry(rid, self.stream[rid][1], eta_s=self.eta_s(len(self.queue) - 1))
            self.marks[rid]["entered"] = time.monotonic()
        out = {"done": None, "admitted": None, "end": None}
        if self.running is not None:
            # the group's prefill ends when its slowest rank's does (the leader's verdict: SPMD)
            if busy_until is None:  # the leader's verdict for this step: not ended yet
                return out
            self.running["end"] = busy_until
            out["done"] = self.complete(t0)
        for pos, rid in enumerate(self.queue):
            eta = self.eta_s(pos)
            # a scanned request is a scheduling candidate (SGLang's terminate_prefetch check); an
            # engine that sends ETAs (cost_aware) says "now" only for one that could start now —
            # a request deep in the queue hears its real ETA from the poll instead
            if rid not in self.demanded and (not self.eta_aware or not eta):
                self.demanded.add(rid)
                self.ad.on_candidate(rid)
                self.marks[rid]["candidate"] = time.monotonic()
            ready, _ = self.ad.check_progress(rid, step, eta_s=eta)
            if not ready:
                continue  # skipped: the scheduler goes on to the next request
            del self.queue[pos]
            out["admitted"] = self.admit(rid, step)
            out["end"] = self.running["end"]
            break
        return out

    def busy_s(self) -> float:
        return max(0.0, self.running["end"] - time.monotonic()) if self.running else 0.0

    def eta_s(self, position: int) -> float | None:
        """When the request at ``position`` can start: what the device still runs, plus the
        prefills ahead of it in the queue — less what a request ahead will not compute (the
        blocks its session already holds, from that request's last poll)."""
        ahead = sum(len(self.stream[r][1]) // self.T - self.ad.restorable_blocks(r) for r in self.queue[:position])
        return self.ad.eta_s(ahead, busy_s=self.busy_s())

    def admit(self, rid: str, step: int) -> tuple:
        arr, toks = self.stream[rid]
        T = self.T
        n_blocks = len(toks) // T
        chain = self.ad.chain(rid, toks)
        m = self.marks[rid]
        self._admitting = rid
        m["admit"] = time.monotonic()
        slot = self.ad.admit(rid, toks, step, self.alloc)  # the product: GET (lease) + copy
        self._admitting = None
        m.setdefault("got", m["admit"])
        m.setdefault("loaded", m["got"])
        restored = slot.tokens // T
        pages = slot.pages[:restored] + (self.alloc(n_blocks - restored) or [])
        compute_tokens = len(toks) - slot.tokens
        t_c = m["prefill_start"] = time.monotonic()
        end = t_c + compute_tokens * self.args["compute_ms_per_ktok"] / 1024 / 1e3  # the modelled prefill
        # the simulator's own work, in the prefill's shadow on a helper thread (torch releases the
        # GIL), so the loop goes on receiving and polling: check what was loaded, fill the rest
        keys = [chain[j * 16:(j + 1) * 16] for j in range(len(pages))]
        check = self.checker.submit(self._check_and_fill, pages, keys, restored)
        self.running = {"rid": rid, "end": end, "over": 0.0, "slot": slot, "pages": pages,
                        "compute_tokens": compute_tokens, "step": step, "check": check}
        return (rid, slot.tokens)

    def complete(self, t0: float) -> dict:
        """The running prefill ended (at its modelled end: TTFT is stamped there)."""
        run, self.running = self.running, None
        rid, slot, pages = run["rid"], run["slot"], run["pages"]
        waited = time.monotonic()
        self.corrupt += run["check"].result(timeout=60)  # (bounded) its pages are freed below
        run["over"] = max(0.0, time.monotonic() - max(waited, run["end"]))  # reported, not charged
        arr, toks = self.stream[rid]
        m = self.marks[rid]
        t_end = m["prefill_end"] = run["end"]
        ttft = t_end - t0 - arr
        status, events = "none", None
        if self.rank == 0 and rid in self.ad.prefetching:  # observability, after TTFT was stamped
            view = self.ad._call(lambda: self.ad.conn.client.call("poll", req=rid, events=self.timeline or None), {})
            status, events = view.get("status", "none"), view.get("events")
        self.ad.commit_restore(rid)
        self.ad.store_after_prefill(rid, toks, pages, run["step"])
        self.free_pages.extend(reversed(pages))
        out = {"req": rid, "ttft_ms": ttft * 1e3, "queue_ms": (m["admit"] - t0 - arr) * 1e3,
               "restored_tokens": slot.tokens, "recomputed_tokens": run["compute_tokens"], "tokens": len(toks),
               "prefill_ms": (t_end - m["prefill_start"]) * 1e3, "load_ms": (m["loaded"] - m["got"]) * 1e3,
               "sim_overhead_ms": run["over"] * 1e3, "status": status}
        if self.timeline:
            rel = {k: round((v - t0 - arr) * 1e3, 3) for k, v in m.items()}
            rel["arrival"] = 0.0
            out["timeline"] = rel
            out["events"] = [[e[0], round((e[1] - t0 - arr) * 1e3, 3), e[2]] for e in events or ()]
        del self.marks[rid]
        return out


def rank_main(rank: int, conn) -> None:
    """A rank process: per arm, builds its rank and executes the leader's steps; stays up across arms."""
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(1)  # one core per rank: intra-op threads only thrash on a shared machine
    conn.send("up")
    while True:
        msg = conn.recv()
        if msg[0] == "exit":
            break
        args = msg[1]
        r = _Rank(args, rank)
        conn.send("ready")
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, step, arrivals, t0, busy_until = msg
            conn.send(r.step(step, arrivals, t0, busy_until))
        if r.running is not None:
            r.corrupt += r.running["check"].result(timeout=60)
        r.checker.shutdown(wait=True)
        conn.send({"rank": rank, "corrupt": r.corrupt, "degraded": r.ad.misses_degraded, "left": len(r.queue)})
        r.ad.close()


class RankPool:
    """``tp`` rank processes, started once and reused by every arm (a fresh adapter per arm)."""

    def __init__(self, tp: int):
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for r in range(tp):
            a, b = ctx.Pipe()
            p = ctx.Process(target=rank_main, args=(r, b), daemon=True)
            p.start()
            self.pipes.append(a)
            self.procs.append(p)
        for a in self.pipes:
            if not a.poll(120) or a.recv() != "up":
                self.close()
                raise RuntimeError("a simulator rank did not start")

    def close(self) -> None:
        for a in self.pipes:
            try:
                a.send(("exit",))
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


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
        for a in pipes:
            ended = busy_until if busy_until is not None and time.monotonic() >= busy_until else None
            a.send(("step", step, arrivals, t0, ended))
        replies = [a.recv() if a.poll(300) else "timeout" for a in pipes]
        if any(r == "timeout" for r in replies):
            raise RuntimeError("a simulator rank stopped answering")
        first = replies[0]
        if any(r["admitted"] != first["admitted"] or (r["done"] or {}).get("req") != (first["done"] or {}).get("req")
               for r in replies[1:]):
            disagreements += 1
        if first["done"] is not None:
            waiting -= 1
            results.append(first["done"])
            busy_until = None
        if first["admitted"] is not None:
            busy_until = max(r["end"] for r in replies if r["end"] is not None)
        if first["admitted"] is None and first["done"] is None and not arrivals:
            nxt = stream[i][0] - (time.monotonic() - t0) if i < len(stream) else STEP_S
            if busy_until is not None:
                nxt = min(nxt, busy_until - time.monotonic())
            queued = waiting - (busy_until is not None)
            # nothing queued: the loop blocks until the next arrival or the prefill's end (as an
            # engine's blocking receive would); else its next iteration polls the queue again
            time.sleep(max(0.0, nxt if queued <= 0 else min(STEP_S, nxt)))
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
    with SidecarProcess(args["instance"], overrides=sidecar_overrides):
        ranks_done, watcher = threading.Event(), None
        if while_running is not None:
            watcher = threading.Thread(target=while_running, args=(arm, args["instance"], ranks_done), daemon=True)
            watcher.start()
        run = run_ranks(args, pool)
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
            "sim_overhead_ms_max": max((r["sim_overhead_ms"] for r in res), default=0.0),
            "corrupt": sum(o["corrupt"] for o in ranks), "ranks_agree": run["disagreements"] == 0 and len(ranks) == args["tp"],
            "requests": len(res), "steps": run["steps"], "invariants": stats.get("invariants", "?"),
            "leases_live": st["leases"].get("live", st["leases"].get("count", 0)) if isinstance(st.get("leases"), dict) else None,
            "sessions": st.get("sessions", {}),
            "l3": {k: v for k, v in st.get("l3", {}).items() if k in ("cost", "read_blocks_ok")},
            "degraded_misses": sum(o["degraded"] for o in ranks), "results": res,
            # observability totals, as the engine saw them (rank 0): policy, final status per request
            "policy": (args["arm_kw"] or {}).get("policy", "none"),
            "statuses": dict(collections.Counter(r["status"] for r in res))}


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
                     compute_ms_per_ktok=compute_ms_per_ktok, engine_pages=600, store_to_l3=False, budget_s=budget_s,
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
        Path(args.json).write_text(json.dumps(out, indent=2, sort_keys=True))
        print(f"\nJSON written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
