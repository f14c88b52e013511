"""The engine ranks of the real-process simulator (``scripts.simulate``): the request stream,
the simulated model's KV (a pure function of the block key, so every load can be checked), one
TP rank's scheduler copy (adapter, paged KV pool, waiting queue) and the pool of rank processes
the leader drives one SPMD step at a time.

A rank's prefill runs "on the device" (modelled busy time) while its loop goes on receiving and
polling; filling the pages it computes runs on a helper thread in that time, and the check of
every page it restored waits until the arm's timed loop has ended (:class:`PageChecks`): the
simulator's own work is kept off the CPU the engine and the sidecar share.
"""

from __future__ import annotations

import collections
import concurrent.futures
import gc
import logging
import multiprocessing as mp
import random
import time

from kvsidecar.shm.layout import KVLayout

from scripts import ttft_bounds


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
    """The page of each key, as raw 16-bit words: the layer's base pattern XOR the key's seed
    (integer ops: ~10x cheaper to build and compare than fp16 arithmetic on a CPU)."""
    import torch

    s = torch.tensor(seeds, dtype=torch.int16).view(-1, 1, 1, 1)
    return base_t.view(torch.int16).unsqueeze(0) ^ s


def fill_pages(kv, base, pages: list, keys: list) -> None:
    """Write the model's KV for ``keys`` into ``pages`` (one vectorised copy per tensor)."""
    if not pages:
        return
    import torch

    idx, seeds = torch.tensor(pages), [_seed(k) for k in keys]
    for layer, tensors in enumerate(kv):
        for k, t in enumerate(tensors):
            t.view(torch.int16).index_copy_(0, idx, _expected(base[layer][k], seeds))


def bad_pages(kv, base, pages: list, keys: list) -> int:
    """How many of ``pages`` do not hold the model's KV for ``keys`` (bit for bit)."""
    if not pages:
        return 0
    import torch

    idx, seeds = torch.tensor(pages), [_seed(k) for k in keys]
    bad = torch.zeros(len(pages), dtype=torch.bool)
    for layer, tensors in enumerate(kv):
        for k, t in enumerate(tensors):
            got = t.view(torch.int16).index_select(0, idx)
            bad |= (got != _expected(base[layer][k], seeds)).flatten(1).any(1)
    return int(bad.sum())


# the most memory one rank's engine pages may take: enough to keep every page of a table arm
# (48 requests) unchecked until the arm ends; a longer stream checks its oldest pages in the run
ENGINE_BYTES_MAX = 512 << 20


def engine_pages(layout: KVLayout, stream: list, floor: int = 0) -> int:
    """Pages for one rank: every block of ``stream`` (``[(arrival, rid, tokens)]``) with none
    reused -- so a restored page can wait, unchecked, until the arm ends -- within
    :data:`ENGINE_BYTES_MAX` (and at least ``floor``)."""
    page = layout.tokens_per_block * layout.heads_per_shard * layout.head_dim * 2 * layout.kv_factor * layout.num_layers
    need = sum(len(toks) // layout.tokens_per_block for _, _, toks in stream)
    return max(floor, 1, min(need, ENGINE_BYTES_MAX // page))


class PageChecks:
    """The simulator's check of every page a request restored (each against the KV the model
    would have produced: ``corrupt``), kept out of the measured run.  A finished request's
    restored pages stay out of the free list, unchecked, until :meth:`drain` (after the arm's
    timed loop), unless the engine runs short of pages: then :meth:`make_room` checks the oldest
    in the run (``in_run`` counts those pages: the check is then on the measured path, as an
    engine short of memory would wait).  Checked on a helper thread while the run went on, they
    took the CPU the ranks and the sidecar share: at 0.9 load, where most of a request is
    restored and little prefill hides the check, cost_aware's p50 was 15-16 % longer (r2-load0.9-tp2,
    two interleaved trials each: 19.0 / 18.7 ms against 16.4 / 16.3 without the concurrent check)."""

    def __init__(self, kv, base):
        self.kv, self.base = kv, base
        self.pending: collections.deque = collections.deque()  # (restored pages, their keys), oldest first
        self.corrupt = self.checked = self.in_run = 0

    def hold(self, pages: list, keys: list) -> None:
        """``pages`` (holding ``keys``' KV) wait for their check; freed only by it."""
        if pages:
            self.pending.append((list(pages), list(keys)))

    def _check_oldest(self) -> list:
        pages, keys = self.pending.popleft()
        self.corrupt += bad_pages(self.kv, self.base, pages, keys)
        self.checked += len(pages)
        return pages

    def make_room(self, short: int) -> list:
        """Check the oldest held pages now until at least ``short`` are freed (or none is held);
        returns the freed pages."""
        freed: list = []
        while len(freed) < short and self.pending:
            pages = self._check_oldest()
            self.in_run += len(pages)
            freed.extend(pages)
        return freed

    def drain(self) -> list:
        """Check every held page (the arm's timed loop has ended); returns them, freed."""
        freed: list = []
        while self.pending:
            freed.extend(self._check_oldest())
        return freed


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
        policy = (kw or {}).get("policy", "timeout")
        budget = (kw or {}).get("budget_s", args.get("budget_s"))
        cfg = AdapterConfig(policy=policy, chunk_max_blocks=(kw or {}).get("chunk_max_blocks"),
                            budget_s=budget if policy == "timeout" else None,
                            store_to_l3=args["store_to_l3"],
                            prefill_s_per_block=self.compute_s_per_block() or None)
        self.ad = EngineAdapter(args["instance"], lay, rank=rank, group=f"sim-{args['arm']}", config=cfg)
        stream = stream_of(args)
        pages = engine_pages(lay, stream, args.get("engine_pages") or 0)
        shape = (pages, self.T, lay.heads_per_shard, lay.head_dim)
        # (zeros are written: every page is faulted in here, not by the first copy into it)
        self.kv = [tuple(torch.zeros(shape, dtype=torch.float16) for _ in range(lay.kv_factor))
                   for _ in range(lay.num_layers)]
        self.ad.kv_caches = self.kv
        self.base = _base(lay, rank)
        self.free_pages = list(range(pages - 1, -1, -1))
        self.stream = {rid: (arr, toks) for arr, rid, toks in stream}
        self.queue: list = []
        self.demanded: set = set()
        self.running: dict | None = None  # the prefill on the device: rid, modelled end, pages
        self.filler = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sim-fill")
        self.checks = PageChecks(self.kv, self.base)
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

    def compute_s_per_block(self) -> float:
        return self.args["compute_ms_per_ktok"] * self.T / 1024 / 1e3

    def alloc(self, n):
        if n > len(self.free_pages):
            self.free_pages.extend(reversed(self.checks.make_room(n - len(self.free_pages))))
        if n > len(self.free_pages):
            return None
        return [self.free_pages.pop() for _ in range(n)]

    def end_arm(self) -> dict:
        """After the arm's timed loop: check every page still held (a prefill still running
        is checked too), free them; this rank's totals."""
        if self.running is not None:
            self.start_fill()
            self.running["fill"].result(timeout=60)
            self.checks.hold(self.running["pages"][:self.running["restored"]],
                             self.running["keys"][:self.running["restored"]])
        self.free_pages.extend(self.checks.drain())
        self.filler.shutdown(wait=True)
        c = self.checks
        return {"rank": self.rank, "corrupt": c.corrupt, "checked_pages": c.checked, "checked_in_run": c.in_run,
                "degraded": self.ad.misses_degraded, "left": len(self.queue)}

    def step(self, step: int, arrivals: list, t0: float) -> dict:
        """One loop iteration: requests that arrived enter the queue (and prefetch); a free
        engine scans the queue and starts the first ready request (a prefill that ended was
        completed and stored by :meth:`finish` before this step).  The prefill itself runs "on
        the device" (modelled as busy time) while the loop goes on, as with an overlapping
        scheduler: arrivals during a prefill enter the queue at once."""
        for rid in arrivals:
            self.queue.append(rid)
            if self.prefetch:
                self.ad.on_queue_entry(rid, self.stream[rid][1], eta_s=self.eta_s(len(self.queue) - 1))
            self.marks[rid]["entered"] = time.monotonic()
        out = {"admitted": None, "end": None}
        if self.running is not None:  # the device is busy: no scan
            return out
        # a scanned request is a scheduling candidate (SGLang's terminate_prefetch check): it
        # could have started now.  (Demanding only the one an ETA puts at "now" was tried: the
        # virtual replay of the measured rows says it is worse — cost_aware kept reading for
        # requests the engine then waited on.)  The demand rides on the scan's check, and the
        # whole scan is one round trip, stopping at the first ready request as the loop would.
        scan = [(rid, eta, rid not in self.demanded) for rid, eta in zip(self.queue, self.etas())]
        pos, _ = self.ad.check_queue(scan, step, lease=True)  # (admitted at this step: leased by the scan)
        now = time.monotonic()
        for rid, _, demand in scan[:len(scan) if pos is None else pos + 1]:
            if demand:
                self.demanded.add(rid)
                self.marks[rid]["candidate"] = now
        if pos is not None:
            rid = self.queue.pop(pos)
            out["admitted"] = self.admit(rid, step)
            out["end"] = self.running["end"]
        return out

    def finish(self, t0: float, end: float) -> dict:
        """The running prefill ended at ``end`` (the group's, its slowest rank's): complete it,
        its store committed, before the next scan."""
        self.running["end"] = end
        return self.complete(t0)

    def wait_ready(self, budget_s: float) -> bool:
        """The leader's wake-up while nothing queued is ready and the device is free: until the
        first queued request still prefetching ends, at most ``budget_s`` (False: none is)."""
        return self.ad.wait_for_queue(self.queue, budget_s)

    def busy_s(self) -> float:
        return max(0.0, self.running["end"] - time.monotonic()) if self.running else 0.0

    def eta_s(self, position: int) -> float | None:
        """When the request at ``position`` can start: what the device still runs, plus the
        prefills ahead of it in the queue — less what a request ahead will not compute (the
        blocks its session already holds, from that request's last poll)."""
        ahead = sum(len(self.stream[r][1]) // self.T - self.ad.restorable_blocks(r) for r in self.queue[:position])
        return self.ad.eta_s(ahead, busy_s=self.busy_s())

    def etas(self) -> list:
        """:meth:`eta_s` of every queued request, in queue order (one pass)."""
        out, ahead, busy = [], 0, self.busy_s()
        for r in self.queue:
            out.append(self.ad.eta_s(ahead, busy_s=busy))
            ahead += len(self.stream[r][1]) // self.T - self.ad.restorable_blocks(r)
        return out

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
        # filling what is computed runs on a helper thread (torch releases the GIL), so the loop
        # goes on receiving and polling (start_fill); what was loaded is checked after the arm
        keys = [chain[j * 16:(j + 1) * 16] for j in range(len(pages))]
        self.running = {"rid": rid, "end": end, "over": 0.0, "slot": slot, "pages": pages,
                        "compute_tokens": compute_tokens, "step": step, "fill": None,
                        "keys": keys, "restored": restored}
        return (rid, slot.tokens)

    def start_fill(self, run: dict | None = None) -> None:
        """On the helper thread: fill the pages ``run`` (default: the running prefill) computes
        (its store reads them).  The leader asks once every rank has admitted: work started at a
        rank's own admission took the CPU from a rank still admitting (2 cores: the group's
        prefill started up to 4 ms late)."""
        run = self.running if run is None else run
        if run is not None and run["fill"] is None:
            pages, keys, r = run["pages"], run["keys"], run["restored"]
            run["fill"] = self.filler.submit(fill_pages, self.kv, self.base, pages[r:], keys[r:])

    def complete(self, t0: float) -> dict:
        """The running prefill ended (at its modelled end: TTFT is stamped there)."""
        run, self.running = self.running, None
        rid, slot, pages = run["rid"], run["slot"], run["pages"]
        waited = time.monotonic()
        self.start_fill(run)  # (if the leader's ask has not come first)
        if run["restored"] < len(pages):
            run["fill"].result(timeout=60)  # (bounded) the store below reads the computed pages
        run["over"] = max(0.0, time.monotonic() - max(waited, run["end"]))  # reported, not charged
        arr, toks = self.stream[rid]
        m = self.marks[rid]
        t_end = m["prefill_end"] = run["end"]
        ttft = t_end - t0 - arr
        status, events, asked = "none", None, None
        if self.rank == 0 and rid in self.ad.prefetching:
            # observability (the session's status and events), not the product's path: sent, not
            # waited for -- it rides the ring ahead of the lease's release, read before the
            # session is forgotten, and its answer has come by the time the commit's has (the ring
            # keeps order).  Waited for here, it cost rank 0 a round trip in every completion of a
            # prefetching arm while the engine loop entered no arrival and scanned nothing (prefill
            # end -> stored, r1-load0.9-tp4, medians of 3 interleaved trials: 0.6 ms shorter for
            # whole_task and cost_aware, 1.3 for timeout_long; no_prefetch's 2.8)
            asked = self.ad._call(lambda: self.ad.conn.client.send("poll", req=rid, events=self.timeline or None),
                                  None)
        self.ad.commit_restore(rid)
        self.ad.store_after_prefill(rid, toks, pages, run["step"])
        m["stored"] = time.monotonic()  # this rank's commit answered (the group's: the last rank's)
        if asked is not None:  # (arrived with the calls above; bounded if none was made)
            view = self.ad._call(lambda: self.ad.conn.client.wait(asked, timeout_s=5.0), {}, retry=False)
            status, events = view.get("status", "none"), view.get("events")
        r = run["restored"]
        self.checks.hold(pages[:r], run["keys"][:r])  # freed once checked (after the arm, see PageChecks)
        self.free_pages.extend(reversed(pages[r:]))  # (stored: the store above read them)
        out = {"req": rid, "ttft_ms": ttft * 1e3, "queue_ms": (m["admit"] - t0 - arr) * 1e3,
               "stored_ms": (m["stored"] - t0 - arr) * 1e3,
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
    r = None
    while True:
        msg = conn.recv()
        if msg[0] == "exit":
            break
        args = msg[1]
        # the last arm's rank is freed here, between arms: it sits in reference cycles (its
        # connector's wrappers), so the cyclic collector freed it -- and its engine pages, ~100 MB
        # -- at some allocation inside a later arm's timed loop, stalling that rank ~60 ms
        # (cost_aware's last requests on the r0.3 load rows entered the queue 15-128 ms late)
        r = None
        gc.collect()
        r = _Rank(args, rank)
        gc.collect()
        conn.send("ready")
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "wait":
                conn.send(r.wait_ready(msg[1]))
                continue
            if msg[0] == "fill":  # (no answer: the leader goes on)
                r.start_fill()
                continue
            if msg[0] == "complete":  # the group's prefill ended at msg[2]: finish and store it
                conn.send(r.finish(msg[1], msg[2]))
                continue
            _, step, arrivals, t0 = msg
            conn.send(r.step(step, arrivals, t0))
        conn.send(r.end_arm())
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
