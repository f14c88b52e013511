"""The engine simulator in virtual time: kvsidecar's real control plane, a simulated engine and L3.

What is real: ``KVCore`` (pool manager, prefix index, leases, staging, group decisions),
``SessionManager`` and the pure session machine (every policy, ``cost_aware`` included), and the
L3 read-cost estimator — the code the sidecar runs, driven through its op handlers exactly as
the control thread drives them.  What is simulated, on one virtual clock: the engine (an SPMD
scheduler shared by its TP ranks, one prefill at a time, ``compute_s_per_block``), the L3 tier
(one metadata lane, one serial read lane: ``latency + blocks x s_per_block``, the bandwidth may
drop mid-run: ``scripts.fake_tier.VirtualL3``, held to the real tier's contract by
``tests/unit/sidecar/l3/test_tier_contract.py``), and block contents (a block "holds" the key
written into it; every GET is checked against the chain, so a block handed out before its data landed, or another key's, is *corrupt*).

The scheduler is SPMD like a real engine: one decision per step, replayed to every rank
(each rank sends the same ``poll`` / ``get`` with the same ``step``; the sidecar's group
decisions must give identical answers — ``ranks_agree``).  A request enters the queue (and
prefetches) ``enter_s`` after it arrives — after the loop's thread is free: an admission's
scan, GET and copy, and a finished prefill's completion (``publish_s``: every rank's store) hold
it — and is scanned in that iteration; when the engine is
free it scans the queue in order, *skipping* a request whose prefetch is still running (SGLang
continues to the next request), and admits the first ready one.  A prefill's end is followed
by a scan ``turnaround_s`` later; with nothing ready the engine waits for a queued session to
end and scans ``wake_s`` after it.  An admission's
prefill starts after the scan's round trip (``scan_s``) and the GET's (``admit_s``).  These
fixed costs are what the real-process run measured (``scripts.ttft_calibrate``).  A scanned
request is a scheduling candidate (``demand``, once).

Deterministic: the same arguments give the same result, on any machine, at any load.
The real-process simulator (``scripts.simulate``) runs the same engine loop against a real
sidecar process and real bytes; this one makes a wide sweep possible.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import heapq
import itertools
import random

from kvsidecar.connector.adapter import blocks_not_computed, first_block, waiting_behind
from kvsidecar.shm.layout import KVLayout
from kvsidecar.sidecar.config import LimitsConfig, SessionsConfig
from kvsidecar.sidecar.kv.index import KEY, unpack_ids
from kvsidecar.sidecar.kv.ops import KVCore
from kvsidecar.sidecar.prefetch.sessions import SessionManager
from kvsidecar.sidecar.runtime.clients import ClientInfo
from kvsidecar.sidecar.service import OpError
from scripts.fake_tier import VirtualL3

from scripts import ttft_bounds

ARMS = {
    "no_prefetch": None,
    "whole_task": dict(policy="wait_complete"),
    "one_graph_timeout": dict(policy="timeout", chunk_max_blocks=1 << 20),
    "timeout_chunk128": dict(policy="timeout", chunk_max_blocks=128),
    "timeout_chunk32": dict(policy="timeout", chunk_max_blocks=32),
    "best_effort": dict(policy="best_effort", chunk_max_blocks=32),
    "cost_aware": dict(policy="cost_aware", chunk_max_blocks=32),
}


@dataclasses.dataclass(frozen=True)
class SimParams:
    tp: int = 2
    prefix_tokens: int = 16384
    suffix_tokens: int = 128
    tokens_per_block: int = 64
    n_prefixes: int = 4
    requests: int = 64
    seed: int = 1
    load: float = 0.8  # offered load: mean prefill time of no_prefetch / mean inter-arrival gap
    compute_s_per_block: float = 0.0032  # prefill of one block (50 ms per 1K tokens at 64 tokens/block)
    copy_s_per_block: float = 0.00005  # loading a restored block into the engine
    l3_ratio: float = 0.8  # L3 per-block read time / compute_s_per_block
    l3_latency_s: float = 0.002  # per read
    meta_latency_s: float = 0.001  # per existence query
    bandwidth_drop_at: float | None = None  # fraction of the stream after which L3 slows down
    bandwidth_drop: float = 4.0
    budget_s: float = 0.6  # timeout arms (cost_aware: no cap)
    pool_blocks: int = 0  # 0: six times the longest request
    follow_up: float = 0.25  # share of requests that continue an earlier conversation
    admit_s: float = 0.0  # fixed engine-side cost per admission: the GET's round trip (calibration)
    enter_s: float = 0.0  # arrival -> in the waiting queue, its prefetch sent (calibration)
    scan_s: float = 0.0  # a scan's round trip before the admission it decides (calibration)
    wake_s: float = 0.0  # a queued request's session ended, the engine idle -> its next scan (calibration)
    turnaround_s: float = 0.0  # a prefill's end -> the next scan (the end noticed, the store; calibration)
    skew_s: float = 0.0  # the group's prefill ends with its slowest rank's: after rank 0's by this (calibration)
    # the same for an admission of a request that queued behind the prefill just ended: the ranks
    # come to it in step (no rank woken from idle), and the real skew is smaller (calibration; None: skew_s)
    skew_queued_s: float | None = None
    # a prefill's end -> its blocks published (every rank's store committed; calibration).  The
    # engine scans again only once they are (the real ranks complete and store a prefill before
    # any scans: a scan that raced the last rank's commit lost the hit on a 0.2 ms coin flip)
    publish_s: float = 0.0
    calibration_blocks: int = 4  # the tier measured itself at start (l3.calibration_blocks; 0: the prior, probes)
    read_with_query: bool = True  # sessions.read_with_query (the sidecar's default: on)
    queue_aware: bool = True  # sessions.queue_aware (the sidecar's default: on)
    ahead_aware: bool = True  # sessions.ahead_aware (the sidecar's default: on)
    # the read lane's thread takes a job up only once the control thread has finished its batch
    # (the GIL): a read withdrawn within that time never starts (real timelines: a read claimed with
    # the query and withdrawn by a demand 0.1 ms later had not started)
    lane_pickup_s: float = 0.0003
    # a request in the queue -> its session created: the sidecar reads the prefetch (sent, not
    # waited for) in its next pass (calibration; a scan of the request before then is read after
    # it: the ring keeps the engine's order)
    create_s: float = 0.0
    # ((name, (seconds, ...)), ...): each use of the fixed cost ``name`` (a field above) draws one of
    # the seconds the real run measured, instead of the constant (calibration: the costs jitter,
    # and the sum of their medians is not the median of their sum).  Seeded by ``seed``.
    cost_samples: tuple = ()

    @property
    def l3_s_per_block(self) -> float:
        return self.l3_ratio * self.compute_s_per_block


# -- the request stream (block level) -------------------------------------------------------------
def _key(*parts) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=KEY).digest()


def request_stream(p: SimParams) -> list:
    """[(arrival_s, req_id, chain)] — shared prefixes, unique suffixes, follow-up turns.

    A chain's keys are chained by construction (a block's key names everything before it),
    so two requests share exactly their common prefix.  Arrivals are Poisson at the rate that
    offers ``load`` to an engine that recomputes everything; ``load == 0`` means idle (each
    request arrives after the previous one could have finished)."""
    rng = random.Random(p.seed)
    prefix_blocks = p.prefix_tokens // p.tokens_per_block
    suffix_blocks = max(1, p.suffix_tokens // p.tokens_per_block)
    prefixes = [[_key("p", p.seed, i, j) for j in range(prefix_blocks)] for i in range(p.n_prefixes)]
    out, keys, t = [], [], 0.0
    for i in range(p.requests):
        if keys and rng.random() < p.follow_up:
            base = list(rng.choice(keys))
        else:
            base = list(prefixes[rng.randrange(p.n_prefixes)])
        chain = base + [_key("s", p.seed, i, j) for j in range(suffix_blocks)]
        keys.append(chain)
        out.append((t, f"r{i}", b"".join(chain)))
        mean_service = len(chain) * p.compute_s_per_block
        gap = mean_service / p.load if p.load > 0 else 4.0 * mean_service
        t += rng.expovariate(1.0 / gap) if p.load > 0 else gap
    return out


# -- the virtual host ---------------------------------------------------------------------------
class VirtualLoop:
    """kvsidecar.sidecar.service.Host on a virtual clock: posted events run first, then timers in order."""

    def __init__(self):
        self.t = 0.0
        self.clients: dict = {}
        self.counters = collections.Counter()
        self._posted = collections.deque()
        self._timers: list = []
        self._seq = itertools.count()

    def clock(self) -> float:
        return self.t

    def post(self, fn, *args):
        self._posted.append((fn, args))

    def call_at(self, due, fn, *args):
        heapq.heappush(self._timers, (max(due, self.t), next(self._seq), fn, args))

    def reply(self, conn, rid, result=None, error=None):
        return True

    def run_posted(self) -> None:
        while self._posted:
            fn, args = self._posted.popleft()
            fn(*args)

    def next_timer(self) -> bool:
        """Advance to the next timer and run it (and what it posted); False when none is left."""
        self.run_posted()
        if not self._timers:
            return False
        due, _, fn, args = heapq.heappop(self._timers)
        self.t = due
        fn(*args)
        self.run_posted()
        return True


class _Conn:
    def __init__(self, group: str, rank: int, size: int, slot: int):
        self.slot, self.token = slot, slot + 1
        self.info = ClientInfo(group, rank, size, 1000 + slot)


# -- the engine -----------------------------------------------------------------------------------
@dataclasses.dataclass
class _Req:
    arrival: float
    rid: str
    chain: bytes
    blocks: int
    prefetching: bool = False
    starting: bool = False  # its prefetch sent, not yet read by the sidecar (create_s)
    demand_after_start: bool = False  # scanned while starting: the sidecar reads the demand right after
    demanded: bool = False
    session_t0: float | None = None
    admitted_at: float | None = None
    entered_at: float | None = None


_ARMS_ENTRY = object()  # Engine's default arm settings: the arm's entry in ARMS


class Engine:
    def __init__(self, p: SimParams, arm: str, stream: list, arm_kw=_ARMS_ENTRY):
        """``arm_kw``: the arm's prefetch settings (None: no prefetch); by default ``ARMS[arm]``."""
        self.p, self.arm = p, arm
        self.kw = ARMS[arm] if arm_kw is _ARMS_ENTRY else arm_kw
        self.loop = VirtualLoop()
        lay = KVLayout(model="vsim", num_layers=1, num_kv_heads=p.tp, head_dim=8,
                       tokens_per_block=p.tokens_per_block, tp_size=p.tp)
        longest = max(len(c) // KEY for _, _, c in stream)
        self.pool_blocks = p.pool_blocks or 6 * longest
        self.core = KVCore(self.loop, lay, self.pool_blocks, LimitsConfig(), clock=self.loop.clock,
                           checksums=False)  # block contents are modelled here, not written
        self.contents: dict = {}  # pool block -> the key whose data it holds
        self.source: dict = {}  # pool block -> who wrote it last: "l3" | "engine"
        holds = {c[i:i + KEY] for _, _, c in stream for i in range(0, len(c), KEY)}  # a warm L3
        drop_at = stream[int(len(stream) * p.bandwidth_drop_at)][0] if p.bandwidth_drop_at is not None else None
        self.drop_at_s = drop_at
        self._samples = {name: tuple(xs) for name, xs in p.cost_samples if xs}
        self._cost_rng = random.Random(f"fixed-costs:{p.seed}")
        self.l3 = VirtualL3(self.loop, holds, self.contents, self.source, p, drop_at, cost=self.cost)
        sess = SessionsConfig(chunk_max_blocks=(self.kw or {}).get("chunk_max_blocks", 128), window=2,
                              retained_ttl_s=30.0, prefill_s_per_block=p.compute_s_per_block,
                              load_s_per_block=p.copy_s_per_block, read_with_query=p.read_with_query,
                              queue_aware=p.queue_aware, ahead_aware=p.ahead_aware)
        self.sm = SessionManager(self.core, self.l3, sess, clock=self.loop.clock)
        self.group = f"vsim-{arm}"
        self.ranks = [_Conn(self.group, r, p.tp, r) for r in range(p.tp)]
        for c in self.ranks:
            self.loop.clients[c.slot] = c
        self.stream = [_Req(a, rid, ch, len(ch) // KEY) for a, rid, ch in stream]
        self.queue: list[_Req] = []
        self.busy_until = 0.0
        # the engine loop's own thread is taken (an admission's scan, GET and copy; a finished
        # prefill's completion and store) until then: an arrival meanwhile enters after it
        self.loop_free_at = 0.0
        self.last_end = float("-inf")  # the last prefill's end
        self.step = 0
        self.step_armed = False
        self.results: list = []
        self.corrupt = 0
        self.disagreements = 0
        self._held: dict = {}  # rid -> blocks its session holds (last poll): the ETA of those behind

    def cost(self, name: str) -> float:
        """One use of the fixed cost ``name``: a draw from its measured samples, else the constant."""
        xs = self._samples.get(name)
        return self._cost_rng.choice(xs) if xs else getattr(self.p, name)

    # -- SPMD calls: every rank sends the same op with the same step --------------------------------
    def _spmd(self, fn, msg: dict) -> dict:
        answers = []
        for c in self.ranks:
            try:
                answers.append(fn(c, dict(msg)))
            except OpError as exc:
                answers.append({"error": exc.code})
        first = answers[0]
        for a in answers[1:]:
            if a != first:
                self.disagreements += 1
        return first

    def _eta_s(self, position: int) -> float:
        """The adapter's estimate of when the request at ``position`` can start its prefill."""
        now = self.loop.t
        ahead = sum(r.blocks - self._held.get(r.rid, 0) for r in self.queue[:position]) * self.p.compute_s_per_block
        return max(0.0, self.busy_until - now) + ahead

    # -- events ----------------------------------------------------------------------------------------
    def _arrival(self, r: _Req) -> None:
        """``r`` arrived: the loop takes it up once its thread is free, ``enter_s`` later."""
        self.loop.call_at(max(self.loop.t, self.loop_free_at) + self.cost("enter_s"), self.arrive, r)

    def arrive(self, r: _Req) -> None:
        r.entered_at = self.loop.t
        self.queue.append(r)
        if self.kw is not None:
            r.prefetching, r.session_t0 = True, self.loop.t
            delay = self.cost("create_s")
            if delay > 0:
                r.starting = True
                self.loop.call_at(self.loop.t + delay, self._start_session, r)
            else:
                self._start_session(r)
        self._arm_step()  # the iteration that took the arrival scans the queue

    def _start_session(self, r: _Req) -> None:
        """The sidecar reads the request's prefetch (every rank's), ``create_s`` after it entered
        the queue, then the demand of a scan that came meanwhile (the ring keeps the engine's
        order; until then a scan skips the request, as its prefetch is running)."""
        r.starting = False
        pos = self.queue.index(r) if r in self.queue else 0
        msg = {"req": r.rid, "chain": r.chain, "policy": self.kw["policy"],
               "prefill_s_per_block": self.p.compute_s_per_block, "eta_s": self._eta_s(pos)}
        if "chunk_max_blocks" in self.kw:
            msg["chunk_max_blocks"] = self.kw["chunk_max_blocks"]
        if self.kw["policy"] == "timeout":
            msg["budget_s"] = self.p.budget_s
        for c in self.ranks:  # every rank's scheduler sees the request enter its queue
            self.sm.op_prefetch(c, dict(msg))
        if r.demand_after_start:  # (a scan's demand, sent after the prefetch on the same ring)
            r.demand_after_start = False
            waiting = waiting_behind([first_block(q.chain) for q in self.queue])[pos] if r in self.queue else 0
            self._spmd(self.sm.op_demand, {"req": r.rid, "waiting": waiting})
            if self._ready(r):  # that scan's poll is read next: it finds the session ended
                self._arm_step()

    def _arm_step(self, delay: float = 0.0) -> None:
        """The engine's next scan, ``delay`` from now: at once after an arrival or a prefill's
        end (the loop iteration that saw it), ``wake_s`` after a queued session ended."""
        if self.step_armed or self.loop.t < self.busy_until or not self.queue:
            return
        self.step_armed = True
        self.loop.call_at(self.loop.t + delay, self._step)

    def _step(self) -> None:
        self.step_armed = False
        if self.loop.t < self.busy_until:
            return
        self.step += 1
        behind = waiting_behind([first_block(r.chain) for r in self.queue])  # (what the adapter's scan tells each session)
        for pos, r in enumerate(self.queue):
            if r.starting:  # its prefetch not read yet: this scan's demand and poll come after it
                if not r.demanded:
                    r.demanded = r.demand_after_start = True
                continue
            if r.prefetching:
                eta = self._eta_s(pos)
                waiting = behind[pos]
                if not r.demanded:
                    r.demanded = True
                    self._spmd(self.sm.op_demand, {"req": r.rid, "waiting": waiting})
                view = self._spmd(self.sm.op_poll, {"req": r.rid, "step": self.step, "eta_s": eta, "waiting": waiting})
                self._held[r.rid] = blocks_not_computed(view)  # (the adapter's ETA input)
                if view.get("state") not in ("terminal", "unknown"):
                    continue  # skipped: the scheduler goes on to the next request
            self.queue.pop(pos)
            self._admit(r)
            return
        # nothing ready: the next step comes when a session ends (see run)

    def _ready(self, r: _Req) -> bool:
        if r.starting:
            return False
        if not r.prefetching:
            return True
        rec = self.sm.records.get((self.group, r.rid, 0))
        return rec is None or rec.machine.state.value == "terminal"

    def _admit(self, r: _Req) -> None:
        now = self.loop.t
        r.admitted_at = now
        get = self._spmd(self.core.op_get, {"chain": r.chain, "req": r.rid, "step": self.step})
        n = get.get("count", 0)
        blocks = list(unpack_ids(get["blocks"])) if n else []
        for j, b in enumerate(blocks):
            if self.contents.get(b) != r.chain[j * KEY:(j + 1) * KEY]:
                self.corrupt += 1
        rec = self.sm.records.get((self.group, r.rid, 0))
        # restored from L3 by this request's own session; the rest of the GET was in the pool
        # (resident at queue entry, stored by an earlier prefill, or read by another session)
        restored_l3 = min(n, rec.restored) if rec is not None else 0
        in_loop = self.cost("scan_s") + self.cost("admit_s") + n * self.p.copy_s_per_block
        queued = r.entered_at is not None and r.entered_at < self.last_end <= now < self.last_end + 0.010
        skew = self.cost("skew_queued_s") if queued and self.p.skew_queued_s is not None else self.cost("skew_s")
        prefill = in_loop + (r.blocks - n) * self.p.compute_s_per_block + skew
        self.busy_until = now + prefill
        self.loop_free_at = max(self.loop_free_at, now + in_loop)
        info = {"req": r.rid, "arrival": r.arrival, "blocks": r.blocks, "hit_pool": n - restored_l3,
                "hit_l3": restored_l3, "recomputed": r.blocks - n, "queue_s": now - r.arrival,
                "prefill_s": prefill, "ttft_s": now + prefill - r.arrival}
        if rec is not None:
            m = rec.machine
            info.update(status=m.status.value if m.status else None, target=m.target,
                        session_s=(rec.terminal_at or now) - rec.created,
                        drain_s=(rec.terminal_at - rec.sealed_at) if rec.sealed_at and rec.terminal_at else 0.0,
                        read_s=sum(rec.transfer_times) / 1e3, chunk_s=sum(rec.chunk_times) / 1e3)
        self.results.append(info)
        self.loop.call_at(self.busy_until, self._done, r, get.get("lease", 0))

    def _done(self, r: _Req, lease: int) -> None:
        self.last_end = self.loop.t
        publish = self.cost("publish_s")
        self.loop_free_at = max(self.loop_free_at, self.loop.t + publish)  # every rank completes it first
        if lease:
            self._spmd(self.core.op_release, {"lease": lease})
        st = self._spmd(self.core.op_store, {"chain": r.chain, "req": r.rid, "step": self.step})
        if st.get("staging"):
            for j, b in enumerate(unpack_ids(st["blocks"])):  # the engine writes its shard of each block
                pos = st["start"] + j
                self.contents[b] = r.chain[pos * KEY:(pos + 1) * KEY]
                self.source[b] = "engine"
            if publish > 0:  # every rank's commit lands publish_s after the prefill's end
                self.loop.call_at(self.loop.t + publish, self._commit, st["staging"])
            else:
                self._commit(st["staging"])
        self._arm_step(max(self.cost("turnaround_s"), publish))  # (a timer at the same time runs after)

    def _commit(self, staging: int) -> None:
        for c in self.ranks:
            self.core.op_commit(c, {"staging": staging})

    # -- the run -----------------------------------------------------------------------------------------
    def run(self) -> dict:
        for r in self.stream:
            self.loop.call_at(r.arrival, self._arrival, r)
        while self.loop.next_timer():
            # idle with work queued: the next iteration runs once a queued session has ended
            # (the engine waits for it: iterations in between would skip the same way)
            if not self.step_armed and self.loop.t >= self.busy_until and any(map(self._ready, self.queue)):
                self._arm_step(self.cost("wake_s"))
        books = self.core.check() or self.sm.check()
        return {"results": self.results, "corrupt": self.corrupt, "ranks_agree": self.disagreements == 0,
                "books": books or "ok", "leases_left": len(self.core.leases.leases),
                "staging_left": self.core.index.staged, "l3_blocks_read": self.l3.blocks_read,
                "l3_reads": self.l3.reads_done, "estimator_error": self.l3.cost.error,
                "estimates": self.l3.estimates, "drop_at_s": self.drop_at_s,
                "sessions": dict(self.sm.counters)}


def run_arm(p: SimParams, arm: str) -> dict:
    return Engine(p, arm, request_stream(p)).run()


# -- bounds on the same stream --------------------------------------------------------------------------
def bounds(p: SimParams) -> dict:
    """``bounds_for`` this simulator's own request stream."""
    return bounds_for(request_stream(p), p)


def bounds_for(stream: list, p: SimParams) -> dict:
    """Per-request TTFTs (seconds, stream order) of the serial bound and the overlap oracle on
    ``stream`` (``[(arrival_s, req, chain)]``) with ``p``'s costs, by the one replay every bound
    uses (:func:`scripts.ttft_bounds.replay_bounds`; its L3 slows by ``bandwidth_drop`` from the
    arrival at ``bandwidth_drop_at`` of the stream on)."""
    longest = max(len(c) // KEY for _, _, c in stream)
    drop_at = stream[int(len(stream) * p.bandwidth_drop_at)][0] if p.bandwidth_drop_at is not None else None
    per_block = p.l3_s_per_block

    def s_per_block_at(start: float) -> float:
        return per_block * (p.bandwidth_drop if drop_at is not None and start >= drop_at else 1.0)

    rows = ttft_bounds.replay_bounds(stream, latency_s=p.l3_latency_s, s_per_block_at=s_per_block_at,
                                     compute_s_per_block=p.compute_s_per_block, copy_s_per_block=p.copy_s_per_block,
                                     pool_blocks=p.pool_blocks or 6 * longest, key_bytes=KEY)
    return {kind: [r[kind] for r in rows] for kind in ("serial", "oracle")}
