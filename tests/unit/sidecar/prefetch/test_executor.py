"""A deterministic bench for the prefetch session executor: ``SessionManager`` + ``KVCore`` (pool
manager, index, leases) in this process, a fake L3 tier whose lookups and reads the test answers
one by one (``scripts.fake_tier.HeldTier``), a fake loop (posted events and timers) and an injected clock.  No sleeps, no threads.

Scenarios in the spirit of FlexKV #291's coordinator suite (read, not copied), then randomized
completion/stop schedules over many seeds checking the invariants after every step.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import random
import types

import pytest

from kvsidecar.shm.errors import ErrorCode
from kvsidecar.shm.layout import KVLayout
from kvsidecar.sidecar.runtime.clients import ClientInfo
from kvsidecar.sidecar.config import LimitsConfig, SessionsConfig
from kvsidecar.sidecar.kv.ops import KVCore
from kvsidecar.sidecar.kv.index import KEY, unpack_ids
from kvsidecar.sidecar.l3.cost_model import ReadEstimate
from kvsidecar.sidecar.l3.interface import QUEUED, read_priority
from kvsidecar.sidecar.service import OpError
from kvsidecar.sidecar.prefetch.sessions import SessionManager
from scripts.fake_tier import HeldTier

LAY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=4, tp_size=1)


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Loop:
    """kvsidecar.sidecar.service.Host over a fake clock: posted events and timers run when the test says."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.clients: dict = {}
        self.counters = collections.Counter()
        self.events = collections.deque()
        self.timers: list = []
        self._seq = itertools.count()

    def post(self, fn, *args):
        self.events.append((fn, args))

    def call_at(self, due, fn, *args):
        heapq.heappush(self.timers, (due, next(self._seq), fn, args))

    def reply(self, conn, rid, result=None, error=None):
        return True

    def settle(self):
        """Run posted events and every timer due now, until nothing is left to run."""
        while True:
            if self.events:
                fn, args = self.events.popleft()
                fn(*args)
            elif self.timers and self.timers[0][0] <= self.clock.t:
                _, _, fn, args = heapq.heappop(self.timers)
                fn(*args)
            else:
                return

    def advance(self, dt: float):
        self.clock.t += dt
        self.settle()


class Conn:
    _tokens = itertools.count(1)

    def __init__(self, group="g", rank=0, size=1, slot=0):
        self.slot, self.token = slot, next(self._tokens)
        self.info = ClientInfo(group, rank, size, 4242)


class Bench:
    def __init__(self, blocks=64, reserved=0, pinned=0, **sess):
        self.clock = Clock()
        self.loop = Loop(self.clock)
        bb = LAY.block_bytes
        limits = LimitsConfig(reserved_bytes_limit=reserved * bb, pinned_bytes_limit=pinned * bb)
        self.core = KVCore(self.loop, LAY, blocks, limits, clock=self.clock, checksums=False)  # no bytes here
        # (the tests here script the query, then the claims; reading with the query has its own)
        self.cfg = SessionsConfig(**{"chunk_max_blocks": 4, "window": 2, "retained_ttl_s": 5.0,
                                     "read_with_query": False, **sess})
        self.holds: set = set()
        self.tier = HeldTier(self.loop, self.holds)
        self.sm = SessionManager(self.core, self.tier, self.cfg, clock=self.clock)
        self.conn = Conn()
        self.loop.clients[0] = self.conn

    # helpers ---------------------------------------------------------------------------------
    def chain(self, name: str, n: int, in_l3: bool = True) -> bytes:
        keys = [f"{name}:{i}".encode().ljust(KEY, b".")[:KEY] for i in range(n)]
        if in_l3:
            self.holds.update(keys)
        return b"".join(keys)

    def resident(self, chain: bytes, n: int):
        """Make the first ``n`` blocks of ``chain`` resident (an engine store)."""
        st = self.core.op_store(self.conn, {"chain": chain[:n * KEY]})
        self.core.op_commit(self.conn, {"staging": st["staging"]})

    def prefetch(self, req, chain, conn=None, **kw):
        out = self.sm.op_prefetch(conn or self.conn, {"req": req, "chain": chain, **kw})
        self.loop.settle()
        return out

    def poll(self, req, conn=None):
        return self.sm.op_poll(conn or self.conn, {"req": req})

    def books(self) -> dict:
        broken = self.core.check() or self.sm.check()
        assert broken == "", broken
        idx = self.core.index
        assert idx.staged <= self.core.pool.reserved_limit_blocks
        return {"staging": idx.staged, "pinned": idx.pinned, "resident": idx.resident, "free": idx.free,
                "leases": len(self.core.leases.leases), "orphans": len(self.sm.orphans)}

    def take(self, req, chain):
        """The engine's GET for ``req`` (hand-off), then its release; returns the count."""
        r = self.core.op_get(self.conn, {"chain": chain, "req": req})
        if r["lease"]:
            self.core.op_release(self.conn, {"lease": r["lease"]})
        return r["count"]


def terminal(b: Bench, req: str) -> dict:
    p = b.poll(req)
    assert p["state"] == "terminal", p
    return p


# -- deterministic scenarios ------------------------------------------------------------------
def test_complete_in_window_order_and_hand_off():
    b = Bench()
    c = b.chain("a", 10)
    b.prefetch("r", c, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    assert len(b.tier.reads) == 2  # window of 2 chunks of 4
    b.tier.finish(b.tier.reads[1])  # out of order: waits for chunk 0
    assert b.poll("r")["published"] == 0
    b.tier.run_all()
    p = terminal(b, "r")
    assert (p["status"], p["prefix"], p["restored"]) == ("complete", 10, 10)
    assert b.books()["leases"] == 1  # the prefetch lease
    assert b.take("r", c) == 10
    assert b.books() == {"staging": 0, "pinned": 0, "resident": 10, "free": 54, "leases": 0, "orphans": 0}


def test_timeout_while_querying_rolls_back_and_ignores_the_late_answer():
    b = Bench()
    c = b.chain("a", 8)
    b.prefetch("r", c, policy="timeout", budget_s=0.05)
    b.loop.advance(0.06)  # the deadline fires before L3 answered
    p = terminal(b, "r")
    assert (p["status"], p["prefix"]) == ("timeout", 0)
    b.tier.answer_lookups()  # late: ignored
    assert not b.tier.reads and b.books()["staging"] == 0 and b.books()["leases"] == 0


def test_abort_during_metadata_has_nothing_to_drain():
    b = Bench()
    c = b.chain("a", 8)
    b.prefetch("r", c, policy="best_effort")
    b.sm.op_abort(b.conn, {"req": "r"})
    p = terminal(b, "r")
    assert p["status"] == "aborted" and p["drain_ms"] == 0.0
    b.tier.answer_lookups()
    assert not b.tier.reads and b.books()["staging"] == 0


@pytest.mark.parametrize("fail_at,expect", [(0, 4), (1, 5), (3, 7)])
def test_partial_second_chunk_never_counts_success_after_the_hole(fail_at, expect):
    b = Bench()
    c = b.chain("a", 12)
    b.prefetch("r", c, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    first, second = b.tier.reads[0], b.tier.reads[1]
    b.tier.finish(second, ok=[i != fail_at for i in range(4)])
    b.tier.finish(first)
    b.tier.run_all()
    p = terminal(b, "r")
    assert (p["status"], p["prefix"]) == ("failed", expect)
    assert b.core.index.match(c) == expect  # nothing after the hole was published
    s = b.books()
    assert s["staging"] == 0 and s["resident"] == expect


def test_abort_never_recycles_a_block_whose_read_is_in_flight():
    b = Bench(blocks=8)
    c = b.chain("a", 8)
    b.prefetch("r", c, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    r0, r1 = b.tier.reads
    b.tier.start(r0)  # in flight; r1 still queued
    b.sm.op_abort(b.conn, {"req": "r"})
    b.loop.settle()
    assert r1.state == "cancelled"  # withdrawn: never touched, freed at once
    s = b.books()
    assert s["staging"] == 4 and b.poll("r")["state"] == "draining"
    # the pool is full of other blocks wanting room: the 4 in-flight blocks are not handed out
    other = b.chain("o", 8, in_l3=False)
    st = b.core.op_store(b.conn, {"chain": other})
    assert set(unpack_ids(st["blocks"])).isdisjoint(unpack_ids(r0.blocks))
    b.core.op_commit(b.conn, {"staging": st["staging"]})
    b.tier.finish(r0)
    p = terminal(b, "r")
    assert p["status"] == "aborted" and b.books()["staging"] == 0


def test_late_read_completion_after_the_drain_budget_becomes_an_orphan_then_publishes():
    b = Bench(drain_timeout_s=0.2)
    c = b.chain("a", 8)
    b.prefetch("r", c, policy="timeout", budget_s=0.05)
    b.tier.answer_lookups()
    r0, r1 = b.tier.reads
    b.tier.start(r0)
    b.loop.advance(0.06)  # deadline: r1 withdrawn, r0 drains
    assert b.poll("r")["state"] == "draining"
    b.loop.advance(0.25)  # drain budget (no read estimate yet: drain_timeout_s) runs out
    p = terminal(b, "r")
    assert (p["status"], p["prefix"]) == ("timeout", 0)
    assert b.books()["orphans"] == 1 and b.books()["staging"] == 4
    b.tier.finish(r0)  # the read really ends: its landed blocks are published (chain head)
    s = b.books()
    assert s["orphans"] == 0 and s["staging"] == 0 and b.core.index.match(c) == 4


def test_orphan_whose_parent_was_evicted_is_freed_not_published():
    b = Bench(drain_timeout_s=0.2)
    c = b.chain("a", 8)
    b.prefetch("r", c, policy="timeout", budget_s=0.05, chunk_max_blocks=4)
    b.tier.answer_lookups()
    r0, r1 = b.tier.reads
    b.tier.finish(r0)  # chunk 0 published (pinned by the session)
    b.tier.start(r1)
    b.loop.advance(0.06)
    b.loop.advance(0.25)
    p = terminal(b, "r")
    assert p["prefix"] == 4
    b.sm.op_abort(b.conn, {"req": "r"})  # result lease dropped
    b.core.op_flush(b.conn, {})  # chunk 0 evicted
    b.tier.finish(r1)
    assert b.core.index.match(c) == 0 and b.books()["staging"] == 0


def test_retained_result_expires_and_releases_its_pins():
    b = Bench()
    c = b.chain("a", 4)
    b.prefetch("r", c, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    b.tier.run_all()
    assert b.books()["pinned"] == 4
    b.loop.advance(5.1)  # retained_ttl_s
    assert b.books()["pinned"] == 0 and b.books()["leases"] == 0
    assert b.poll("r")["state"] == "unknown"  # forgotten


def test_capacity_stop_under_the_pinned_limit_does_not_deadlock():
    b = Bench(pinned=6)
    c = b.chain("a", 16)
    b.prefetch("r", c, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    b.tier.run_all()
    p = terminal(b, "r")
    assert (p["status"], p["reason"]) == ("limit", "limit") and p["prefix"] == 6
    assert b.core.pool.refusals["pinned"] >= 1
    assert b.take("r", c) == 6 and b.books()["pinned"] == 0


def test_capacity_stop_under_the_reserved_limit():
    b = Bench(reserved=3)
    c = b.chain("a", 8)
    b.prefetch("r", c, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    assert sum(len(r.keys) // KEY for r in b.tier.reads) == 3
    b.tier.run_all()
    p = terminal(b, "r")
    assert (p["status"], p["reason"]) == ("limit", "limit") and p["prefix"] == 3 and b.core.pool.refusals["reserved"] >= 1


def test_allocator_stop_when_everything_is_pinned():
    b = Bench(blocks=8, reserved=1000, pinned=1000)  # limits above the pool: the allocator binds
    other = b.chain("o", 6, in_l3=False)
    b.resident(other, 6)
    held = b.core.op_get(b.conn, {"chain": other})
    c = b.chain("a", 8)
    b.prefetch("r", c, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    b.tier.run_all()
    p = terminal(b, "r")
    assert p["prefix"] == 2 and b.core.pool.refusals["allocator"] >= 1
    b.core.op_release(b.conn, {"lease": held["lease"]})
    assert b.take("r", c) == 2 and b.books()["pinned"] == 0


def test_fairness_demanded_session_reads_first():
    b = Bench()
    x, y = b.chain("x", 8), b.chain("y", 8)
    b.prefetch("x", x, policy="best_effort")
    b.prefetch("y", y, policy="best_effort")
    b.tier.answer_lookups()
    # the older request's chunks go first; then a demanded one's go ahead of every queued read
    assert [r.priority for r in b.tier.reads] == [QUEUED + 1] * 2 + [QUEUED + 2] * 2
    b.sm.op_demand(b.conn, {"req": "y"})  # y is now a scheduling candidate: it stops claiming
    b.loop.settle()
    p = terminal(b, "y") if b.poll("y")["state"] == "terminal" else None
    assert p is None or p["status"] == "demanded"
    b.tier.run_all()
    assert terminal(b, "x")["status"] == "complete" and terminal(b, "y")["status"] == "demanded"


def test_a_demanded_session_chunks_run_before_queued_ones():
    b = Bench(chunk_max_blocks=2)
    x, y = b.chain("x", 8), b.chain("y", 8)
    b.prefetch("x", x, policy="timeout", budget_s=30.0)
    b.prefetch("y", y, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    b.sm.op_demand(b.conn, {"req": "y"})  # timeout ignores demand, but its next reads jump ahead
    b.tier.finish(b.tier.reads[2])  # one of y's chunks lands: y claims its next chunk
    assert min(r.priority for r in b.tier.reads) == read_priority(True, 2) < read_priority(False, 1)
    b.tier.run_all()
    assert terminal(b, "x")["prefix"] == 8 and terminal(b, "y")["prefix"] == 8


def test_two_sessions_share_blocks_and_read_them_once():
    b = Bench()
    c = b.chain("a", 8)
    b.prefetch("x", c, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    b.prefetch("y", c, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    b.tier.run_all()
    assert terminal(b, "x")["prefix"] == terminal(b, "y")["prefix"] == 8
    assert b.tier.blocks_read == 8 and b.sm.counters["blocks_deduplicated"] > 0
    assert b.take("x", c) == 8 and b.take("y", c) == 8 and b.books()["pinned"] == 0


def test_best_effort_demand_stops_and_timeout_ignores_demand():
    b = Bench()
    c, d = b.chain("a", 12), b.chain("d", 12)
    b.prefetch("be", c, policy="best_effort")
    b.prefetch("to", d, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    b.sm.op_demand(b.conn, {"req": "be"})
    b.sm.op_demand(b.conn, {"req": "to"})
    b.loop.settle()
    b.tier.run_all()
    be, to = terminal(b, "be"), terminal(b, "to")
    assert be["status"] == "demanded" and be["prefix"] < 12
    assert to["status"] == "complete" and to["prefix"] == 12


def test_wait_complete_is_one_read():
    b = Bench()
    c = b.chain("a", 20)
    b.prefetch("r", c, policy="wait_complete")
    b.tier.answer_lookups()
    assert len(b.tier.reads) == 1 and len(b.tier.reads[0].keys) // KEY == 20
    b.loop.advance(100.0)
    b.sm.op_demand(b.conn, {"req": "r"})
    b.tier.run_all()
    assert terminal(b, "r")["prefix"] == 20


def test_l3_miss_is_no_hit_and_resident_prefix_counts():
    b = Bench()
    c = b.chain("a", 8, in_l3=False)
    b.resident(c, 3)
    b.prefetch("r", c, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    p = terminal(b, "r")
    assert (p["status"], p["prefix"]) == ("no_hit", 3)
    assert b.take("r", c) == 3 and b.books()["pinned"] == 0


def test_fully_resident_needs_no_query():
    b = Bench()
    c = b.chain("a", 6)
    b.resident(c, 6)
    b.prefetch("r", c, policy="timeout", budget_s=30.0)
    assert not b.tier.lookups
    assert terminal(b, "r")["status"] == "complete"


def test_checkpoints_bound_the_prefix():
    b = Bench()
    c = b.chain("a", 12)
    b.prefetch("r", c, policy="timeout", budget_s=30.0, checkpoint_every=5)
    b.tier.answer_lookups()
    b.tier.run_all(ok_fn=lambda r: [True] * (len(r.keys) // KEY) if r.keys[:1] != b"a" or b"a:8" not in r.keys
                   else [k != 0 for k in range(len(r.keys) // KEY)])
    p = terminal(b, "r")
    assert p["prefix"] == 5  # block 8 failed -> 8 published, the prefix ends on the checkpoint at 5


def test_client_gone_aborts_the_groups_sessions():
    b = Bench()
    c = b.chain("a", 8)
    b.prefetch("r", c, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    r0 = b.tier.reads[0]
    b.tier.start(r0)
    del b.loop.clients[0]
    b.sm.client_gone(b.conn)
    b.core.client_gone(b.conn)
    assert b.poll("r")["state"] == "unknown"  # the key is free for a new incarnation of the group
    (rec,) = b.sm.by_id.values()  # while the session itself drains its read
    assert rec.machine.state.value == "draining"
    b.tier.finish(r0)
    assert rec.machine.status.value == "aborted" and b.books()["pinned"] == 0


def test_one_session_per_group_request_attempt():
    b = Bench()
    c = b.chain("a", 4)
    first = b.prefetch("r", c, policy="timeout", budget_s=30.0)
    again = b.prefetch("r", c, policy="timeout", budget_s=30.0)
    other_attempt = b.prefetch("r", c, policy="timeout", budget_s=30.0, attempt=1)
    other_group = b.prefetch("r", c, conn=Conn(group="h", slot=1), policy="timeout", budget_s=30.0)
    assert again["session"] == first["session"] and again["existed"]
    assert len({first["session"], other_attempt["session"], other_group["session"]}) == 3


def test_bad_policy_and_unknown_request_are_typed_errors():
    b = Bench()
    with pytest.raises(OpError):
        b.prefetch("r", b.chain("a", 4), policy="nope")
    with pytest.raises(OpError):
        b.sm.op_demand(b.conn, {"req": "never"})
    assert b.sm.op_abort(b.conn, {"req": "never"}) == {"state": "unknown"}  # idempotent


def test_reads_ahead_is_the_run_another_sessions_reads_stage():
    """What cost_aware counts as awaited (``PoolManager.reads_ahead``): the chain's positions from
    a start that sessions' reads stage, up to the first that is not -- resident, free, a store's
    staging, or a read that ended without it."""
    b = Bench()
    c = b.chain("a", 10)
    b.prefetch("x", c, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    sid = b.sm.records[("g", "x", 0)].id
    first, second = b.tier.reads  # window 2: positions 0-3 and 4-7 are staged, 8-9 not yet
    ahead = b.core.pool.reads_ahead
    assert ahead(c, 0) == (8, {sid}) and ahead(c, 2) == (6, {sid}) and ahead(c, 8) == (0, set())
    b.tier.finish(second, ok=[True, False, True, True])  # landed first: waits for the first to publish
    assert ahead(c, 0) == (5, {sid}) and ahead(c, 5) == (0, set())  # block 5 failed: it will be dropped
    other = b.chain("s", 3)
    b.core.op_store(b.conn, {"chain": other})  # an engine store's staging: not a read
    assert ahead(other, 0) == (0, set())
    b.tier.finish(first)
    b.tier.run_all()
    assert ahead(c, 0) == (0, set())  # resident now (0-4) or never staged again by a read
    assert terminal(b, "x")["prefix"] == 5


def test_shared_block_waiter_sees_the_owners_failure():
    b = Bench()
    c = b.chain("a", 4)
    b.prefetch("x", c, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    b.prefetch("y", c, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    b.tier.finish(b.tier.reads[0], ok=[True, False, True, True])
    b.tier.run_all()
    assert terminal(b, "x")["prefix"] == terminal(b, "y")["prefix"] == 1
    assert b.books()["staging"] == 0


@pytest.mark.parametrize("policy", ["timeout", "best_effort", "wait_complete"])
@pytest.mark.parametrize("stop", ["abort", "demand", "deadline"])
def test_every_policy_and_stop_leaves_the_books_exact(policy, stop):
    b = Bench()
    c = b.chain("a", 16)
    b.prefetch("r", c, policy=policy, budget_s=0.5 if policy == "timeout" else None)
    b.tier.answer_lookups()
    b.tier.finish(b.tier.reads[0])
    if stop == "abort":
        b.sm.op_abort(b.conn, {"req": "r"})
    elif stop == "demand":
        b.sm.op_demand(b.conn, {"req": "r"})
    else:
        b.loop.advance(1.0)
    b.loop.settle()
    b.tier.run_all()
    p = terminal(b, "r")
    b.take("r", c)
    b.sm.op_abort(b.conn, {"req": "r"})
    s = b.books()
    assert s["staging"] == 0 and s["pinned"] == 0 and s["leases"] == 0
    assert p["prefix"] == b.core.index.match(c) or p["status"] == "aborted"


@pytest.mark.parametrize("stop", ["deadline", "abort", "demand"])
def test_a_stopped_session_does_not_wait_on_another_sessions_queued_read(stop):
    """y's chunks only await x's staged blocks (x's reads sit in the lane queue): a stop ends y
    at once, instead of waiting for a read it neither started nor can hurry; x is unaffected,
    and y leaves no waiter behind."""
    b = Bench(window=2)
    c = b.chain("a", 8)
    x = Conn(group="o", slot=1)
    b.loop.clients[1] = x
    b.prefetch("x", c, conn=x, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    b.prefetch("y", c, policy="best_effort" if stop == "demand" else "timeout", budget_s=0.05)
    b.tier.answer_lookups()
    assert len(b.tier.reads) == 2 and all(r.state == "queued" for r in b.tier.reads)  # x's only
    if stop == "deadline":
        b.loop.advance(0.06)
    elif stop == "abort":
        b.sm.op_abort(b.conn, {"req": "y"})
    else:
        b.sm.op_demand(b.conn, {"req": "y"})
    b.loop.settle()
    y = b.poll("y")
    assert y["state"] == "terminal" and y["prefix"] == 0, y  # no read of x's had to land
    assert all(r.state == "queued" for r in b.tier.reads)
    assert not b.core.pool.waiters  # y stopped awaiting x's blocks
    b.tier.run_all()
    px = b.poll("x", conn=x)
    assert (px["state"], px["status"], px["prefix"]) == ("terminal", "complete", 8)
    assert b.core.index.match(c) == 8
    b.sm.op_abort(x, {"req": "x"})
    b.sm.op_abort(b.conn, {"req": "y"})
    s = b.books()
    assert s["staging"] == 0 and s["pinned"] == 0 and s["leases"] == 0 and s["orphans"] == 0


# -- a store supersedes a read that has not started -------------------------------------------
def _store(b, chain):
    st = b.core.op_store(b.conn, {"chain": chain})
    return st


def test_a_store_supersedes_a_queued_session_read_and_its_waiters_follow():
    """x's reads of c sit in the lane queue and y awaits them; the engine computed c meanwhile:
    its store withdraws x's reads and stages every key, and x and y complete on the store's
    blocks when it commits -- nothing is read from L3, nothing is lost."""
    b = Bench(window=2)
    c = b.chain("a", 8)
    b.prefetch("x", c, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    y = Conn(group="h", slot=1)
    b.loop.clients[1] = y
    b.prefetch("y", c, conn=y, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    reads = list(b.tier.reads)
    assert len(reads) == 2  # x's two chunks; y's await them
    st = _store(b, c)
    assert (st["start"], st["count"]) == (0, 8)
    assert [r.state for r in reads] == ["cancelled", "cancelled"] and not b.tier.reads
    assert b.core.pool.superseded_blocks == 8
    b.loop.settle()
    assert b.poll("x")["state"] != "terminal"  # it waits for the store now
    b.core.op_commit(b.conn, {"staging": st["staging"]})
    b.loop.settle()
    px, py = terminal(b, "x"), b.poll("y", conn=y)
    assert (px["status"], px["prefix"]) == ("complete", 8)
    assert (py["state"], py["status"], py["prefix"]) == ("terminal", "complete", 8)
    assert b.tier.blocks_read == 0
    assert b.take("x", c) == 8
    b.sm.op_abort(y, {"req": "y"})
    s = b.books()
    assert s["staging"] == 0 and s["pinned"] == 0 and s["leases"] == 0 and s["orphans"] == 0
    assert not b.core.pool.waiters and not b.core.pool.staged_by


@pytest.mark.parametrize("read_ends", ["before_commit", "after_commit", "failed"])
def test_a_store_takes_over_a_read_in_flight_whose_blocks_stay_keyless_until_it_ends(read_ends):
    """x's first read is in flight, its second queued, y awaits both; the engine computed the
    chain meanwhile.  Its store stages every key: the queued read is withdrawn, the one in flight
    writes on into blocks that stay STAGING without a key (nobody finds or reuses them) and are
    freed, never published, when it ends -- however it ends, before or after the store commits.
    x and y complete on the store's blocks when it commits, without waiting for that read."""
    b = Bench(window=2)
    c = b.chain("a", 8)
    b.prefetch("x", c, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    y = Conn(group="h", slot=1)
    b.loop.clients[1] = y
    b.prefetch("y", c, conn=y, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    first, second = b.tier.reads
    b.tier.start(first)
    in_flight = set(unpack_ids(first.blocks))
    st = _store(b, c)
    assert (st["start"], st["count"]) == (0, 8)
    assert first.state == "started" and second.state == "cancelled"
    assert b.core.pool.superseded_blocks == 8 and b.core.pool.superseded_in_flight == 4
    stored = set(unpack_ids(st["blocks"]))
    assert not stored & in_flight  # the store writes into blocks of its own
    s = b.books()  # the keyless blocks are accounted for (staging: the store's 8 and the read's 4)
    assert s["staging"] == 12 and len(b.core.index.staging) == 8
    if read_ends == "before_commit":
        b.tier.finish(first)
        b.loop.settle()
        assert b.books()["staging"] == 8 and b.poll("x")["state"] != "terminal"  # it awaits the store
    b.core.op_commit(b.conn, {"staging": st["staging"]})
    b.loop.settle()
    px, py = terminal(b, "x"), b.poll("y", conn=y)
    assert (px["status"], px["prefix"]) == ("complete", 8)
    assert (py["state"], py["status"], py["prefix"]) == ("terminal", "complete", 8)
    resident = set(unpack_ids(b.core.index.resident_ids(c, 8)))
    assert not resident & in_flight  # what is published is the store's, never the read's blocks
    if read_ends != "before_commit":
        assert b.books()["staging"] == 4  # still written into by the read
        b.tier.finish(first, ok=[read_ends == "after_commit"] * 4)
        b.loop.settle()
    assert b.sm.counters["superseded_blocks_freed"] == 4
    assert b.core.index.match(c) == 8
    assert b.take("x", c) == 8
    b.sm.op_abort(y, {"req": "y"})
    s = b.books()
    assert s["staging"] == 0 and s["pinned"] == 0 and s["leases"] == 0 and s["orphans"] == 0
    assert not b.core.pool.waiters and not b.core.pool.staged_by and not b.core.pool.unkeyed
    assert s["free"] + s["resident"] == b.core.index.num_blocks


def test_a_store_takes_over_only_a_read_it_stages_whole():
    """A store that would stage only part of a read's keys -- its chain stops inside the read,
    or the reserved limit leaves no room for the run to the read's end while the read in flight
    keeps its blocks -- stops at the read's first key, and the read goes on."""
    b = Bench(window=2, reserved=12)
    c = b.chain("a", 8)
    b.prefetch("x", c, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()
    first, second = b.tier.reads
    b.tier.start(first)
    st = _store(b, c[:2 * KEY])  # covers only half of the first read's keys
    assert (st["start"], st["count"]) == (0, 0) and first.state == "started" and second.state == "queued"
    st = _store(b, c[:6 * KEY])  # covers the first read, half of the second: takes over the first
    assert (st["start"], st["count"]) == (0, 4) and second.state == "queued"
    b.core.op_commit(b.conn, {"staging": st["staging"]})
    b.tier.finish(first)
    b.loop.settle()
    b.tier.start(second)  # x's second read in flight now; 4 blocks staged by it
    other = b.chain("o", 5, in_l3=False)
    st_o = _store(b, other)  # 9 of 12 reserved: 3 left, the run to the read's end needs 4
    assert st_o["count"] == 5
    st = _store(b, c)
    assert (st["start"], st["count"]) == (4, 0) and second.state == "started"
    assert b.core.pool.superseded_in_flight == 4  # the first read's, not this one
    b.core.op_commit(b.conn, {"staging": st_o["staging"]})
    st = _store(b, c)  # room now: taken over
    assert (st["start"], st["count"]) == (4, 4) and b.core.pool.superseded_in_flight == 8
    b.core.op_commit(b.conn, {"staging": st["staging"]})
    b.tier.finish(second)
    b.loop.settle()
    assert (terminal(b, "x")["status"], terminal(b, "x")["prefix"]) == ("complete", 8)
    assert b.sm.counters["superseded_blocks_freed"] == 8 and b.take("x", c) == 8
    s = b.books()
    assert s["staging"] == 0 and s["pinned"] == 0 and s["leases"] == 0 and not b.core.pool.unkeyed


def test_a_superseding_store_that_fails_fails_the_waiters_not_the_books():
    """The store took x's keys, then dies before committing (its staging expires): x's
    positions resolve as failed, like a failed read; every block is accounted for."""
    b = Bench(window=2)
    c = b.chain("a", 8)
    b.prefetch("x", c, policy="timeout", budget_s=300.0)
    b.tier.answer_lookups()
    st = _store(b, c)
    assert st["count"] == 8
    b.loop.advance(b.core.limits.staging_ttl_s + 1)  # the writer never commits: reaped
    px = terminal(b, "x")
    assert (px["status"], px["prefix"]) == ("failed", 0)
    b.take("x", c)
    s = b.books()
    assert s["staging"] == 0 and s["pinned"] == 0 and s["leases"] == 0
    assert not b.core.pool.waiters and not b.core.pool.staged_by


# -- randomized schedules ---------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(60))
def test_random_schedules_keep_the_invariants(seed):
    rng = random.Random(seed)
    b = Bench(blocks=rng.choice([12, 24, 48]), pinned=rng.choice([0, 0, 10]), reserved=rng.choice([0, 0, 6]),
              chunk_max_blocks=rng.choice([1, 2, 4]), window=rng.choice([1, 2, 3]), drain_timeout_s=0.3)
    chains = [b.chain(f"c{i}", rng.randint(2, 10), in_l3=rng.random() < 0.9) for i in range(3)]
    shared = chains[0][:4 * KEY]
    chains.append(shared + b"".join(f"s:{i}".encode().ljust(KEY, b".") for i in range(4)))
    b.holds.update(chains[3][i * KEY:(i + 1) * KEY] for i in range(8))
    # cost_aware's L3 input: measured or the prior, restoring cheaper or dearer than its prefill
    b.tier.estimate = ReadEstimate(0.002, rng.choice([0.001, 0.02]), rng.choice([0, 5]))
    reqs = {}
    left = set()  # requests aborted (their result, if any, is released: no longer pinned)
    stores = []  # the engine's open stores (they may take over sessions' reads, queued or in flight)
    for step in range(120):
        r = rng.random()
        if r < 0.1:
            if stores and rng.random() < 0.75:  # one ends: committed, or failed
                b.core.op_commit(b.conn, {"staging": stores.pop(rng.randrange(len(stores))), "ok": rng.random() < 0.8})
            else:  # (mostly a chain sessions read: the engine computed what they restore)
                chain = rng.choice(list(reqs.values()) if reqs and rng.random() < 0.8 else chains)
                n = len(chain) // KEY if rng.random() < 0.6 else rng.randint(1, len(chain) // KEY)
                try:
                    st = b.core.op_store(b.conn, {"chain": chain[:n * KEY]})
                except OpError as exc:  # no room to stage: a typed refusal, the engine keeps its KV
                    assert exc.code == ErrorCode.LIMIT
                else:
                    if st["count"]:
                        stores.append(st["staging"])
        elif r < 0.2 and len(reqs) < 6:
            req = f"r{step}"
            chain = rng.choice(chains)
            policy = rng.choice(["timeout", "best_effort", "wait_complete", "cost_aware"])
            if policy == "cost_aware":  # (it awaits what another session reads of a shared chain)
                b.prefetch(req, chain, policy=policy, prefill_s_per_block=0.01, eta_s=rng.choice([None, 0.0, 0.3]))
            else:
                b.prefetch(req, chain, policy=policy,
                           budget_s=rng.choice([0.01, 0.1, 5.0]) if policy == "timeout" else None)
            reqs[req] = chain
        elif r < 0.35:
            b.tier.answer_lookups()
        elif r < 0.6 and b.tier.reads:
            rd = rng.choice(b.tier.reads)
            if rng.random() < 0.5 and rd.state == "queued":
                b.tier.start(rd)
            else:
                n = len(rd.keys) // KEY
                b.tier.finish(rd, ok=[rng.random() > 0.1 for _ in range(n)], seconds=rng.uniform(0.001, 0.05))
        elif r < 0.7 and reqs:
            req = rng.choice(list(reqs))
            b.sm.op_abort(b.conn, {"req": req})
            left.add(req)
        elif r < 0.8 and reqs:
            req = rng.choice(list(reqs))
            if b.poll(req)["state"] != "unknown":
                b.sm.op_demand(b.conn, {"req": req})
        elif r < 0.9 and reqs:
            req = rng.choice(list(reqs))
            if b.poll(req)["state"] == "terminal":
                try:
                    b.take(req, reqs[req])
                    reqs.pop(req)
                except OpError as exc:  # a GET over the pinned limit is a typed refusal: recompute
                    assert exc.code == ErrorCode.LIMIT
        else:
            b.loop.advance(rng.uniform(0.0, 0.2))
        b.loop.settle()
        b.books()  # books exact, reserved within its limit, after every step
        for req, chain in reqs.items():
            p = b.poll(req)
            if p["state"] == "terminal" and p["prefix"] and req not in left:
                assert b.core.index.match(chain) >= p["prefix"]  # the result is resident (pinned)
    # drain everything: answer, commit, finish, abort, expire
    b.tier.answer_lookups()
    for staging in stores:
        b.core.op_commit(b.conn, {"staging": staging})
    for req in list(reqs):
        b.sm.op_abort(b.conn, {"req": req})
    b.loop.settle()
    b.tier.run_all()
    b.loop.advance(10.0)
    s = b.books()
    assert s["staging"] == 0 and s["pinned"] == 0 and s["leases"] == 0 and s["orphans"] == 0
    assert s["free"] + s["resident"] == b.core.index.num_blocks  # every block FREE or RESIDENT


@pytest.mark.parametrize("stop", ["deadline", "abort", "demand", "client_gone"])
def test_shared_blocks_survive_the_owners_stop(stop):
    """Two requests on one prefix: the owner of the reads stops early; the other still gets
    every block, each read once (its waiters were told the blocks failed, before)."""
    b = Bench(window=2)
    c = b.chain("a", 12)
    policy = "best_effort" if stop == "demand" else "timeout"
    owner = Conn(group="o", slot=1)
    b.loop.clients[1] = owner
    b.prefetch("x", c, conn=owner, policy=policy, budget_s=0.05 if policy == "timeout" else None)
    b.tier.answer_lookups()
    b.prefetch("y", c, policy="timeout", budget_s=30.0)
    b.tier.answer_lookups()  # y's chunks wait on x's staged blocks (de-dup)
    r0 = b.tier.reads[0]
    b.tier.start(r0)
    if stop == "deadline":
        b.loop.advance(0.06)
    elif stop == "abort":
        b.sm.op_abort(owner, {"req": "x"})
    elif stop == "demand":
        b.sm.op_demand(owner, {"req": "x"})
    else:
        del b.loop.clients[1]
        b.sm.client_gone(owner)
        b.core.client_gone(owner)
    b.loop.settle()
    assert b.sm.counters["reads_handed_over"] >= 1
    b.tier.run_all()
    b.tier.answer_lookups()
    b.tier.run_all()
    y = terminal(b, "y")
    assert (y["status"], y["prefix"]) == ("complete", 12), y
    assert b.tier.blocks_read == 12  # nothing read twice
    assert b.take("y", c) == 12
    b.sm.op_abort(owner, {"req": "x"}) if stop != "client_gone" else None
    s = b.books()
    assert s["staging"] == 0 and s["orphans"] == 0 and s["pinned"] == 0


# -- the first chunk read with the L3 query (sessions.read_with_query) ------------------------
def test_read_with_query_reads_before_the_answer_and_completes():
    b = Bench(read_with_query=True)
    c = b.chain("a", 10)
    b.prefetch("r", c, policy="timeout", budget_s=30.0)
    assert len(b.tier.lookups) == 1 and len(b.tier.reads) == 1  # the read went out with the query
    b.tier.finish(b.tier.reads[0])  # lands before the answer: nothing published yet
    assert b.poll("r")["published"] == 0
    b.tier.answer_lookups()
    assert b.poll("r")["published"] == 4
    b.tier.run_all()
    p = terminal(b, "r")
    assert (p["status"], p["prefix"], p["restored"]) == ("complete", 10, 10)
    assert b.sm._counters["reads_with_query"] == 1
    assert b.take("r", c) == 10
    assert b.books() == {"staging": 0, "pinned": 0, "resident": 10, "free": 54, "leases": 0, "orphans": 0}


@pytest.mark.parametrize("started", [False, True])
def test_read_with_query_on_a_miss_is_taken_back_or_left_and_ends_at_once(started):
    b = Bench(read_with_query=True)
    c = b.chain("a", 8, in_l3=False)
    b.prefetch("r", c, policy="best_effort")
    (read,) = b.tier.reads
    if started:
        b.tier.start(read)
    b.tier.answer_lookups()  # nothing in L3: the session does not wait for the read
    p = terminal(b, "r")
    assert (p["status"], p["prefix"]) == ("no_hit", 0)
    counters = b.sm._counters
    if not started:
        assert counters["reads_with_query_withdrawn"] == 1 and not b.tier.reads
        assert b.books()["staging"] == 0
    else:
        assert counters["reads_with_query_left"] == 1 and b.books()["orphans"] == 1
        b.tier.finish(read, ok=[False] * 4)  # its keys are not in L3: nothing lands
    s = b.books()
    assert (s["staging"], s["pinned"], s["resident"], s["orphans"], s["leases"]) == (0, 0, 0, 0, 0)


def test_read_with_query_past_a_short_hit_publishes_the_hit_without_failing():
    b = Bench(read_with_query=True)
    c = b.chain("a", 8)
    b.holds.difference_update({c[i * KEY:(i + 1) * KEY] for i in range(2, 8)})  # L3 holds 2 blocks
    b.prefetch("r", c, policy="timeout", budget_s=30.0)
    (read,) = b.tier.reads
    b.tier.answer_lookups()
    b.tier.finish(read)  # (what L3 holds: blocks 2 and 3 fail)
    p = terminal(b, "r")
    assert (p["status"], p["prefix"]) == ("complete", 2)
    assert b.core.index.match(c) == 2
    assert b.take("r", c) == 2
    s = b.books()
    assert (s["staging"], s["pinned"], s["resident"], s["leases"], s["orphans"]) == (0, 0, 2, 0, 0)


def test_read_with_query_abort_before_the_answer_drains_the_read():
    b = Bench(read_with_query=True)
    c = b.chain("a", 8)
    b.prefetch("r", c, policy="best_effort")
    (read,) = b.tier.reads
    b.tier.start(read)
    b.sm.op_abort(b.conn, {"req": "r"})
    assert b.poll("r")["state"] == "draining"
    b.tier.answer_lookups()  # late: ignored
    b.tier.finish(read)
    p = terminal(b, "r")
    assert p["status"] == "aborted"
    s = b.books()
    assert (s["staging"], s["pinned"], s["leases"], s["orphans"]) == (0, 0, 0, 0)


def test_a_snapshot_of_thousands_of_retained_sessions_counts_them_all_and_shows_a_bounded_table():
    """A busy node keeps every terminal session (and its lease) for its GET (``retained_ttl_s``):
    the snapshot (every publish, every ``stats`` op) counts them all but builds at most
    ``ROWS_MAX`` rows of each table -- the sessions still running, oldest first, then the newest
    terminal ones; the oldest leases -- where it once built and sorted a row for each (~20 ms of
    the control thread for 3,000 sessions, ~10 ms for their leases)."""
    from kvsidecar.sidecar.observe.snapshot import ROWS_MAX
    from kvsidecar.sidecar.observe.status import render_tables

    b = Bench(blocks=4096)
    for i in range(3):  # running: their L3 queries are held
        b.prefetch(f"q{i}", b.chain(f"q{i}", 4, in_l3=False), policy="timeout")
    for i in range(1000):  # terminal at once: all resident
        c = b.chain(f"t{i}", 2, in_l3=False)
        b.resident(c, 2)
        assert b.prefetch(f"t{i}", c, policy="timeout")["state"] == "terminal"
        b.clock.t += 0.001
    snap = b.sm.snapshot()
    assert snap.total == 1003 and snap.stats()["sessions"]["by_state"] == {"querying": 3, "terminal": 1000}
    assert [r.request for r in snap.rows] == ["q0", "q1", "q2"] + [f"t{i}" for i in range(999, 999 - ROWS_MAX + 3, -1)]
    table = render_tables(types.SimpleNamespace(sessions=snap, kv=None, loop=types.SimpleNamespace(clients=())))
    assert table["sessions"]["total"] == 1003 and len(table["sessions"]["rows"]) == ROWS_MAX
    kv = b.core.snapshot()  # each result kept for its GET: a lease; the table shows the oldest
    assert kv.stats()["leases"]["live"] == 1000 and kv.leases_by_kind()["prefetch"][0] == 1000
    ages = [round(r.age_s, 6) for r in kv.leases]
    assert len(kv.leases) == ROWS_MAX and ages == [round(1.0 - i * 0.001, 6) for i in range(ROWS_MAX)]
    assert kv.leases[0].lease == min(b.core.leases.leases)
    b.tier.answer_lookups()
    b.loop.settle()
    assert b.sm.snapshot().stats()["sessions"]["by_state"] == {"terminal": 1003}
    assert b.books()["leases"] == 1000  # (the three found nothing to keep)
