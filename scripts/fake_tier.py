"""Fake L3 tiers that keep the session executor's contract
(:class:`kvsidecar.sidecar.l3.interface.SessionTier`) without a backend or threads.

:class:`FakeTier` is the mechanics both fakes share: a set of keys L3 holds, reads recorded as
:class:`FakeRead` jobs (queued → started → done, or cancelled), cancellation and priority
changes, and :meth:`FakeTier.land` — the one place a read's answer is counted and posted.  Two
drivers decide *when* answers come:

* :class:`HeldTier` (the executor bench, ``tests/unit/sidecar/prefetch/test_executor.py``):
  lookups and reads wait until the test answers them, one by one, in any order.
* :class:`VirtualL3` (``scripts.sim_virtual``): one metadata lane with a fixed latency and one
  serial read lane (``latency + blocks x s_per_block``, the bandwidth may drop mid-run) on the
  simulator's virtual clock, with the real read-cost estimator.

Both answer through the loop's ``post`` (or a virtual timer), never from inside the call, as the
real tier does.  ``tests/unit/sidecar/l3/test_tier_contract.py`` holds them and the real
``L3Tier`` to the same checks.
"""

from __future__ import annotations

import heapq
import itertools

from kvsidecar.sidecar.kv.index import KEY, unpack_ids
from kvsidecar.sidecar.l3.cost_model import ReadCostModel, ReadEstimate
from kvsidecar.sidecar.l3.interface import QUEUED, ReadOutlook, ReadResult


class FakeRead:
    """One read (a :class:`~kvsidecar.sidecar.l3.interface.ReadJob`): ``state`` is queued →
    started → done, or queued → cancelled (then its ``done`` is never called)."""

    __slots__ = ("keys", "blocks", "done", "priority", "seq", "state", "n", "tier")

    def __init__(self, tier: "FakeTier", keys: bytes, blocks: bytes, done, priority: int, seq: int):
        self.tier, self.keys, self.blocks, self.done, self.priority, self.seq = tier, keys, blocks, done, priority, seq
        self.state = "queued"
        self.n = len(keys) // KEY

    def cancel(self) -> bool:
        if self.state != "queued":
            return False
        self.state = "cancelled"
        self.tier.pending.remove(self)
        return True

    def raise_priority(self, priority: int) -> None:
        if self.state == "queued" and priority < self.priority:
            self.priority = priority
            self.tier._reprioritised(self)


class FakeTier:
    """What both fakes share; a driver subclass decides when lookups and reads are answered."""

    def __init__(self, holds: set, post):
        self.holds = holds  # keys L3 has
        self._post = post  # the loop's post: every answer goes through it
        self._seq = itertools.count()
        self.pending: list[FakeRead] = []  # submitted, not cancelled, not yet landed (submission order)
        self.read_s_per_block: float | None = None
        self.query_s = 0.0
        self.blocks_read = 0
        self.reads_done = 0

    @property
    def read_cost_error(self) -> float:
        return 0.0

    def hits(self, chain: bytes) -> int:
        """How many leading blocks of ``chain`` L3 holds (what a lookup answers)."""
        hits = 0
        while hits < len(chain) // KEY and chain[hits * KEY:(hits + 1) * KEY] in self.holds:
            hits += 1
        return hits

    def load(self, ns, keys, blocks, done, priority=QUEUED) -> FakeRead:
        r = FakeRead(self, keys, blocks, done, priority, next(self._seq))
        self.pending.append(r)
        self._submitted(r)
        return r

    def land(self, r: FakeRead, ok: list | None, seconds: float) -> ReadResult:
        """``r`` ends: ``ok`` per block (None: what L3 holds), counted and posted to its ``done``."""
        assert r.state in ("queued", "started"), r.state
        r.state = "done"
        self.pending.remove(r)
        ok = [r.keys[i * KEY:(i + 1) * KEY] in self.holds for i in range(r.n)] if ok is None else list(ok)
        self.blocks_read += r.n
        self.reads_done += 1
        if any(ok):
            self.read_s_per_block = seconds / r.n
        result = ReadResult(ok, seconds)
        self._post(r.done, result)
        return result

    # -- driver hooks ---------------------------------------------------------------------------
    def _submitted(self, r: FakeRead) -> None:
        """A read was queued."""

    def _reprioritised(self, r: FakeRead) -> None:
        """A queued read's priority was lowered (it runs sooner)."""


class HeldTier(FakeTier):
    """Every answer is given by the test: lookups and reads wait until it answers them."""

    def __init__(self, loop, holds: set):
        super().__init__(holds, loop.post)
        self.loop = loop
        self.lookups: list = []
        self.estimate = ReadEstimate(0.005, 0.001, 0)  # cost_aware's L3 input (the test sets it)
        self.error = 0.0  # the estimate's measured prediction error (the test sets it)

    @property
    def read_cost_error(self) -> float:
        return self.error

    def lookup(self, ns, chain, done):
        self.lookups.append((chain, done))

    def read_outlook(self, priority=QUEUED):
        e = self.estimate
        return ReadOutlook(e, sum(e.seconds(r.n) for r in self.pending if r.priority <= priority))

    @property
    def reads(self) -> list[FakeRead]:
        """Reads not withdrawn and not landed (a cancelled job never runs: the real lane drops it)."""
        return list(self.pending)

    # -- the test's side -------------------------------------------------------------------------
    def answer_lookups(self):
        while self.lookups:
            chain, done = self.lookups.pop(0)
            self.loop.post(done, self.hits(chain))  # the real tier answers through post, too
        self.loop.settle()

    def start(self, r: FakeRead):
        assert r.state == "queued"
        r.state = "started"

    def finish(self, r: FakeRead, ok=None, seconds=0.01):
        """Land ``r`` (``ok``: per-block success, default every block) and run what it posts."""
        if r.state == "queued":
            r.state = "started"
        assert r.state == "started"
        self.land(r, [True] * r.n if ok is None else ok, seconds)
        self.loop.settle()

    def run_all(self, ok_fn=None):
        """Finish every read (in submission order) until none is left."""
        while self.pending:
            r = self.pending[0]
            self.finish(r, None if ok_fn is None else ok_fn(r))


class VirtualL3(FakeTier):
    """A metadata lane and one serial read lane on the simulator's virtual clock, with the real
    read-cost estimator; ``contents`` / ``source`` record what each pool block holds."""

    def __init__(self, loop, holds: set, contents: dict, source: dict, p, drop_at_s: float | None, cost=None):
        """``cost(name)``: the seconds of one use of a fixed cost of ``p`` (the simulator may draw
        each use from a measured distribution); by default ``p``'s constant."""
        super().__init__(holds, loop.post)
        self.loop, self.contents, self.source, self.p = loop, contents, source, p
        self.cost_of = cost or (lambda name: getattr(p, name, 0.0))
        self.drop_at_s = drop_at_s
        self.cost = ReadCostModel(0.005, 0.020)  # a conservative prior (slower than every regime here)
        n = getattr(p, "calibration_blocks", 0)
        if n:  # the real tier writes scratch objects as it starts and reads them back, 1 then all
            for k in (1, n):  # (kvsidecar.sidecar.l3.calibrate), before any traffic
                self.cost.observe(k, p.l3_latency_s + k * p.l3_s_per_block)
        self._queue: list = []
        self.busy: FakeRead | None = None
        self.busy_until = 0.0
        self.estimates: list = []  # (t, true s/block, estimated s/block) after each read

    @property
    def read_cost_error(self) -> float:
        return self.cost.error

    def true_s_per_block(self, t: float) -> float:
        s = self.p.l3_s_per_block
        return s * self.p.bandwidth_drop if self.drop_at_s is not None and t >= self.drop_at_s else s

    def lookup(self, ns, chain, done):
        self.query_s = self.p.meta_latency_s  # (the real tier's running mean of what a session waits)
        self.loop.call_at(self.loop.t + self.cost_of("meta_latency_s"), done, self.hits(chain))

    def _submitted(self, r: FakeRead) -> None:
        heapq.heappush(self._queue, (r.priority, r.seq, r))
        self._kick()

    def _reprioritised(self, r: FakeRead) -> None:
        heapq.heappush(self._queue, (r.priority, next(self._seq), r))  # the old entry is skipped

    def _kick(self, woken: bool = True) -> None:
        """Start the next read if the lane is free.  ``woken``: the lane was idle and a submit wakes
        its thread, which takes the job up once the control thread lets it run (not so for the
        next job of a lane that just finished one: its thread goes straight on)."""
        while self.busy is None and self._queue:
            _, _, r = heapq.heappop(self._queue)
            if r.state != "queued":
                continue
            pickup = self.cost_of("lane_pickup_s") if woken else 0.0
            if pickup > 0:
                self.busy, self.busy_until = r, self.loop.t + pickup
                self.loop.call_at(self.busy_until, self._start, r)
                return
            self._start(r)

    def _start(self, r: FakeRead) -> None:
        if r.state != "queued":  # withdrawn before the lane took it up (the real job's cancel wins too)
            self.busy = None
            self._kick()
            return
        r.state = "started"
        held = sum(r.keys[i * KEY:(i + 1) * KEY] in self.holds for i in range(r.n))  # (as the shaped store:
        seconds = self.p.l3_latency_s + held * self.true_s_per_block(self.loop.t)  # a missing key moves no bytes)
        self.busy, self.busy_until = r, self.loop.t + seconds
        self.loop.call_at(self.busy_until, self._finish, r, seconds)

    def _finish(self, r: FakeRead, seconds: float) -> None:
        self.busy = None
        result = self.land(r, None, seconds)
        for i, b in enumerate(unpack_ids(r.blocks)):
            if result.ok[i]:
                self.contents[b] = r.keys[i * KEY:(i + 1) * KEY]  # the data lands
                self.source[b] = "l3"
        if all(result.ok):
            self.cost.observe(r.n, seconds)  # as the real tier: only a read that landed whole
        self.estimates.append((self.loop.t, self.true_s_per_block(self.loop.t - seconds),
                               self.cost.estimate().s_per_block))
        self._kick(woken=False)

    def read_outlook(self, priority=QUEUED) -> ReadOutlook:
        est = self.cost.estimate()
        backlog = max(0.0, self.busy_until - self.loop.t) if self.busy is not None else 0.0
        for pr, _, r in self._queue:
            if pr <= priority and r.state == "queued" and pr == r.priority:
                backlog += est.seconds(r.n)
        return ReadOutlook(est, backlog)


__all__ = ["FakeRead", "FakeTier", "HeldTier", "VirtualL3"]
