"""Prefetch sessions through real processes and a shaped L3 (file store with latency)."""

from __future__ import annotations

import time

import pytest
import torch

from kvsidecar.connector.kv_client import KVConnector
from kvsidecar.shm.chain import span as chain_span
from kvsidecar.sidecar.prefetch.sessions import MAX_WAITING
from kvsidecar.shm.errors import ErrorCode, RemoteError
from kvsidecar.shm.layout import KVLayout

from ..helpers import file_l3_overrides, fill_l3, small_kv, wait_l3_idle, wait_terminal
from ..waiting import wait_past_query, wait_read_held, wait_until

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=4, tp_size=1)
N = 48  # blocks in the test chain
TOKENS = list(range(4 * N))


def overrides(tmp_path, **extra):
    return file_l3_overrides(tmp_path, LAY, 160, **extra)


@pytest.fixture
def kv():
    return small_kv(N)


@pytest.fixture
def l3_filled(sidecar_factory, instance, tmp_path, kv):
    """Write the test chain to the file store through one sidecar, then stop it."""
    return fill_l3(sidecar_factory, instance, LAY, overrides(tmp_path), kv, TOKENS)


def get_and_check(c, chain, req, kv):
    lease = c.get(chain, req=req, step=1)
    out = [tuple(torch.zeros_like(t) for t in layer) for layer in kv]
    c.load(lease, out, list(range(lease.count)))
    c.release(lease)
    n = lease.count
    assert all(torch.equal(a[:n], b[:n]) for la, lb in zip(kv, out) for a, b in zip(la, lb))
    return n


def books(c):
    s = c.stats(check=True)
    assert s["invariants"] == "", s["invariants"]
    return s


def test_short_deadline_returns_a_drained_short_prefix(sidecar_factory, instance, tmp_path, kv, l3_filled):
    # (a budget well past the metadata query, so a loaded machine still claims a first chunk)
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 40.0}))
    with KVConnector(instance, LAY) as c:
        c.prefetch(l3_filled, "r", policy="timeout", budget_s=0.06, chunk_max_blocks=4)
        p = wait_terminal(c, "r")
        assert p["status"] == "timeout" and 0 < p["prefix"] < N
        assert p["published"] == p["prefix"]  # the drain published what was claimed, nothing more
        n = get_and_check(c, l3_filled, "r", kv)
        assert n == p["prefix"]  # the engine recomputes blocks [n, N)
        s = books(c)
        assert s["pool"]["staging"] == 0 and s["pool"]["pinned"] == 0 and s["leases"]["live"] == 0


def test_long_timeout_restores_everything(sidecar_factory, instance, tmp_path, kv, l3_filled):
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 5.0}))
    with KVConnector(instance, LAY) as c:
        c.prefetch(l3_filled, "r", policy="timeout", budget_s=30.0, chunk_max_blocks=8)
        p = wait_terminal(c, "r")
        assert p["status"] == "complete" and p["prefix"] == N
        assert get_and_check(c, l3_filled, "r", kv) == N
        s = books(c)
        assert s["sessions"]["handoffs"] == 1 and s["leases"]["live"] == 0


def test_best_effort_stops_on_demand_and_completes_when_queued(sidecar_factory, instance, tmp_path, kv,
                                                                  l3_filled, timing, read_gate):
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 20.0}, **read_gate.overrides()))
    with KVConnector(instance, LAY) as c:
        c.prefetch(l3_filled, "a", policy="best_effort", chunk_max_blocks=4)
        wait_read_held(c)  # a chunk's read is in flight
        t0 = time.monotonic()
        c.demand("a")
        read_gate.open()
        p = wait_terminal(c, "a")
        timing.within(t0, 2.0, "demand to terminal")  # one chunk's transfer (stop latency: bench.py stop)
        assert p["status"] == "demanded" and p["prefix"] < N
        get_and_check(c, l3_filled, "a", kv)
    with KVConnector(instance, LAY, namespace="") as c:
        c.prefetch(l3_filled, "b", policy="best_effort", chunk_max_blocks=4)  # never demanded
        p = wait_terminal(c, "b")
        assert p["status"] == "complete" and p["prefix"] == N
        assert get_and_check(c, l3_filled, "b", kv) == N
        books(c)


@pytest.mark.parametrize("with_query", [True, False], ids=["read_with_query", "read_after_query"])
def test_the_first_chunk_is_read_with_the_l3_query(sidecar_factory, instance, tmp_path, kv, l3_filled, with_query):
    """``sessions.read_with_query``: the first chunk is claimed (its read sent) before the L3
    query's answer, which takes 20 ms here; the hit is restored with its own bytes and the books
    balance.  Off: nothing is claimed before the answer."""
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 20.0, "sessions.read_with_query": with_query}))
    with KVConnector(instance, LAY) as c:
        c.prefetch(l3_filled, "a", policy="timeout", budget_s=30.0, chunk_max_blocks=4)
        p = wait_terminal(c, "a")
        assert p["status"] == "complete" and p["prefix"] == N
        events = c.client.call("poll", req="a", events=True)["events"]
        first = {name: t for name, t, *_ in reversed(events)}  # (the first of each kind)
        assert (first["claim"] < first["query"]) == with_query, events
        assert get_and_check(c, l3_filled, "a", kv) == N
        s = books(c)
        assert s["sessions"].get("reads_with_query", 0) == int(with_query)
        assert s["pool"]["staging"] == 0 and s["pool"]["pinned"] == 0 and s["leases"]["live"] == 0


def test_a_miss_read_with_the_query_ends_the_session_at_its_answer(sidecar_factory, instance, tmp_path, read_gate):
    """A chain L3 does not hold: the first chunk's read went out with the query and is held at the
    read gate; the answer (no hit) ends the session at once, without waiting for that read,
    which is taken back or left behind; once it ends nothing is left over."""
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 5.0, "sessions.read_with_query": True},
                                **read_gate.overrides()))
    with KVConnector(instance, LAY) as c:
        miss = c.hasher.chain([7] * (4 * 8))
        c.prefetch(miss, "m", policy="best_effort", chunk_max_blocks=4)
        p = wait_terminal(c, "m")  # (the read gate is shut)
        assert p["status"] == "no_hit" and p["prefix"] == 0
        s = books(c)["sessions"]
        assert s.get("reads_with_query") == 1
        assert s.get("reads_with_query_withdrawn", 0) + s.get("reads_with_query_left", 0) == 1
        read_gate.open()
        wait_until(lambda: books(c), 10, "the read past the hit ended and left nothing over",
                   until=lambda s: s["sessions"]["orphans"] == 0 and s["pool"]["staging"] == 0)
        s = books(c)
        assert s["pool"]["resident"] == 0 and s["pool"]["pinned"] == 0 and s["leases"]["live"] == 0


def test_a_poll_with_demand_is_a_demand_in_one_round_trip(sidecar_factory, instance, tmp_path, kv, l3_filled,
                                                            read_gate):
    """``poll(demand=True)``: the scheduler demands and checks a request in the same scan.  It
    stops best_effort as ``demand`` does (the read in flight drains; the prefix is what landed),
    answers the poll in the same reply, and is idempotent; for a request without a session it
    is the plain poll's "unknown", not an error.  ``poll`` without it leaves best_effort reading."""
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 20.0}, **read_gate.overrides()))
    with KVConnector(instance, LAY) as c:
        c.prefetch(l3_filled, "a", policy="best_effort", chunk_max_blocks=4)
        wait_read_held(c)  # a chunk's read is in flight
        wait_past_query(c, "a")
        assert c.poll("a", step=1)["state"] == "running"  # a plain poll does not stop it
        v = c.poll("a", step=2, demand=True)
        assert v["state"] == "draining"  # stopped by this very call: it waits for the held read
        assert c.poll("a", step=3, demand=True)["state"] == "draining"  # idempotent
        read_gate.open()
        p = wait_terminal(c, "a")
        assert p["status"] == "demanded" and p["prefix"] < N
        get_and_check(c, l3_filled, "a", kv)
        assert c.poll("never-started", step=4, demand=True)["state"] == "unknown"
        books(c)


def test_a_demand_with_drain_s_hands_over_what_landed_and_leaves_its_reads_behind(
        sidecar_factory, instance, tmp_path, kv, l3_filled, read_gate):
    """``demand(drain_s=...)``: the engine admits the request within ``drain_s`` (SGLang's
    settler).  A session the demand stops waits no longer than that for its reads in flight:
    with 0 it is terminal in the same reply, holding what landed (nothing: its read is held at
    the gate), and the held read is left behind -- when it lands its blocks are published with
    their own bytes, and nothing is left over.  A session the demand does not stop (``timeout``)
    reads its whole hit, ``drain_s`` or not."""
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 20.0}, **read_gate.overrides()))
    with KVConnector(instance, LAY) as c:
        c.prefetch(l3_filled, "a", policy="best_effort", chunk_max_blocks=4)
        wait_read_held(c)  # a chunk's read is in flight
        wait_past_query(c, "a")
        for bad in (-1.0, float("nan"), float("inf")):  # refused, typed; the session is untouched
            with pytest.raises(RemoteError) as err:
                c.demand("a", drain_s=bad)
            assert err.value.code == ErrorCode.BAD_FIELD
        assert c.poll("a")["state"] == "running"
        v = c.demand("a", drain_s=0.0)
        assert v["state"] == "terminal" and v["status"] == "demanded" and v["prefix"] == 0, v
        assert get_and_check(c, l3_filled, "a", kv) == 0
        s = books(c)
        assert s["sessions"]["demands_drain_bounded"] == 1 and s["sessions"]["chunks_left_at_demand"] == 1
        assert s["sessions"]["orphans"] == 1 and s["pool"]["staging"] > 0
        read_gate.open()
        s = wait_until(lambda: books(c), 10, "the left-behind read landed and left nothing over",
                       until=lambda s: s["sessions"]["orphans"] == 0 and s["pool"]["staging"] == 0)
        published = s["sessions"].get("orphan_blocks_published", 0)
        assert published > 0 and get_and_check(c, l3_filled, "after", kv) == published
        c.prefetch(l3_filled, "b", policy="timeout", budget_s=30.0, chunk_max_blocks=4)
        c.demand("b", drain_s=0.0)  # timeout reads on: the bound is for a session the demand stops
        p = wait_terminal(c, "b")
        assert p["status"] == "complete" and p["prefix"] == N
        assert get_and_check(c, l3_filled, "b", kv) == N
        s = books(c)
        assert s["sessions"]["demands_drain_bounded"] == 1 and s["leases"]["live"] == 0
        assert s["pool"]["staging"] == 0 and s["pool"]["pinned"] == 0


def test_a_poll_scan_is_the_schedulers_scan_in_one_round_trip(sidecar_factory, instance, tmp_path, kv, l3_filled,
                                                                read_gate):
    """``poll_scan``: each entry is exactly a ``poll`` (demand, the group's decision per request
    and step); with ``until_ready`` the scan stops after the first request ready to admit, so a
    request behind it is neither polled nor demanded; a refused entry does not fail the scan.
    (b and c are still querying at the scan: none of their first chunk is read with the query,
    which would await a's read in flight and take it over when a stops.)"""
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 20.0, "sessions.read_with_query": False},
                                **read_gate.overrides()))
    with KVConnector(instance, LAY) as c:
        c.prefetch(l3_filled, "a", policy="best_effort", chunk_max_blocks=4)
        wait_read_held(c)  # a's chunk read is in flight: a is running
        for r in ("b", "c"):  # (their first chunk is a's, in flight: they wait for it)
            c.prefetch(l3_filled, r, policy="best_effort", chunk_max_blocks=4)
        views = c.poll_scan([("a", 0.5, True), ("ghost", None, True), ("b", None, True)], step=1)
        assert [v["state"] for v in views] == ["draining", "unknown"]  # stopped at the ready "ghost"
        again = c.poll("a", step=1)  # the same request and step as a plain poll: the recorded answer
        again.pop("id"), again.pop("ok")
        assert again == views[0]
        live = ("querying", "running")
        assert c.poll("b", step=2)["state"] in live  # behind the ready one: not demanded
        views = c.poll_scan([("b", None, False), ("ghost", None, False), ("c", None, True)], step=3,
                            until_ready=False)
        assert views[0]["state"] in live and views[1]["state"] == "unknown" and len(views) == 3
        assert views[2]["state"] in ("draining", "terminal")  # demanded (terminal: it held no read of its own)
        with pytest.raises(RemoteError) as ei:  # a malformed entry: the whole request is refused, typed
            c.client.call("poll_scan", polls=[{"req": "a"}, {"eta_s": 1.0}])
        assert ei.value.code == ErrorCode.MALFORMED
        assert c.poll_scan([], step=4) == []
        read_gate.open()
        for r in ("a", "b", "c"):
            p = wait_terminal(c, r)
            assert p["status"] == ("complete" if r == "b" else "demanded"), (r, p)
        assert [v["state"] for v in c.poll_scan([(r, None, True) for r in "abc"], step=5)] == ["terminal"]
        for r in ("a", "b", "c"):
            get_and_check(c, l3_filled, r, kv)
        s = books(c)
        assert s["pool"]["staging"] == 0 and s["pool"]["pinned"] == 0 and s["leases"]["live"] == 0


def test_an_engine_store_takes_over_a_read_in_flight(sidecar_factory, instance, tmp_path, kv, l3_filled, read_gate):
    """The engine computed the prefix a session is reading from L3 (its read held in flight at
    the gate): the engine's store stages every key all the same, the session completes on the
    store's blocks once it commits -- without waiting for the read -- and the read, when it
    lands, writes into blocks that were never published and are freed then.  The bytes a GET
    hands over are the store's (different from L3's here: any block of the read would show),
    and nothing is left over."""
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 20.0}, **read_gate.overrides()))
    computed = small_kv(N, seed=1)
    with KVConnector(instance, LAY) as c:
        c.prefetch(l3_filled, "a", policy="timeout", budget_s=30.0, chunk_max_blocks=4)
        wait_read_held(c)  # a chunk's read is in flight
        st = c.store(l3_filled)
        assert (st.start, st.count) == (0, N)
        c.save(st, computed, list(range(N)))
        c.commit(st)
        p = wait_terminal(c, "a")
        assert (p["status"], p["prefix"]) == ("complete", N), p
        s = books(c)
        assert s["sessions"]["blocks_superseded_in_flight"] >= 4 and s["pool"]["staging"] > 0  # the held read's
        assert get_and_check(c, l3_filled, "a", computed) == N
        read_gate.open()
        s = wait_until(lambda: books(c), 10, "the superseded read landed and its blocks were freed",
                       until=lambda s: s["pool"]["staging"] == 0)
        assert s["sessions"]["superseded_blocks_freed"] == s["sessions"]["blocks_superseded_in_flight"]
        assert get_and_check(c, l3_filled, "after", computed) == N
        s = books(c)
        assert s["pool"]["pinned"] == 0 and s["leases"]["live"] == 0 and s["sessions"]["outstanding_staging"] == 0


def test_abort_mid_flight_leaves_nothing_behind(sidecar_factory, instance, tmp_path, kv, l3_filled, read_gate):
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 30.0}, **read_gate.overrides()))
    with KVConnector(instance, LAY) as c:
        c.prefetch(l3_filled, "r", policy="timeout", budget_s=30.0, chunk_max_blocks=4)
        wait_read_held(c)  # a chunk's read is in flight
        v = c.abort("r")
        assert v["state"] == "draining"  # it waits for the held read
        read_gate.open()
        p = wait_terminal(c, "r")
        assert p["status"] == "aborted" and p["lease"] == 0
        assert c.abort("r")["status"] == "aborted"  # idempotent
        assert c.abort("never-started")["state"] == "unknown"
        s = books(c)
        assert s["pool"]["staging"] == 0 and s["pool"]["pinned"] == 0 and s["leases"]["live"] == 0
        assert s["sessions"]["outstanding_staging"] == 0


def test_two_ranks_one_session_and_consistent_polls(sidecar_factory, instance, tmp_path):
    """TP=2: rank 0 and rank 1 of one group start one session; polls and the GET carry the
    scheduler step and give both ranks the same answer; each rank releases its share."""
    lay2 = KVLayout(**{**LAY.as_dict(), "tp_size": 2})
    sidecar_factory(**{**{f"layout.{k}": v for k, v in lay2.as_dict().items()}, "pool.num_blocks": 160,
                       "l3.file_dir": str(tmp_path / "l3"), "l3.latency_ms": 10.0})
    ranks = [KVConnector(instance, lay2, rank=r, group="G") for r in (0, 1)]
    for c in ranks:
        c.attach()
    torch.manual_seed(2)
    kvs = [[tuple(torch.randn(N, 4, 1, 16).half() for _ in range(2)) for _ in range(2)] for _ in ranks]
    chain = ranks[0].hasher.chain(TOKENS)
    assert ranks[1].hasher.chain(TOKENS) == chain
    sts = [c.store(chain, l3=True, req="w", step=1) for c in ranks]
    assert sts[0].id == sts[1].id  # one group decision
    for c, st, kv in zip(ranks, sts, kvs):
        c.save(st, kv, list(range(st.count)))
        c.commit(st)
    wait_l3_idle(ranks[0])
    ranks[0].flush()
    va = ranks[0].prefetch(chain, "r", policy="timeout", budget_s=30.0, chunk_max_blocks=8)
    vb = ranks[1].prefetch(chain, "r", policy="timeout", budget_s=30.0, chunk_max_blocks=8)
    assert va["session"] == vb["session"] and vb["existed"] is True
    step = 10
    while True:  # one scheduler loop: both ranks poll with the same step, get the same answer
        step += 1
        pa, pb = ranks[0].poll("r", step=step), ranks[1].poll("r", step=step)
        pa.pop("id"), pb.pop("id")  # the completion's own request id differs per client
        assert pa == pb
        if pa["state"] == "terminal":
            break
        assert step < 10_000
        ranks[0].wait("r", until=pa["published"] + 1, timeout_s=5.0)  # the next step once a block lands
    assert pa["status"] == "complete" and pa["prefix"] == N
    leases = [c.get(chain, req="r", step=step + 1) for c in ranks]
    assert leases[0].id == leases[1].id and leases[0].count == leases[1].count == N
    for c, lease, kv in zip(ranks, leases, kvs):
        out = [tuple(torch.zeros_like(t) for t in layer) for layer in kv]
        c.load(lease, out, list(range(lease.count)))
        assert all(torch.equal(a, b) for la, lb in zip(kv, out) for a, b in zip(la, lb))
    assert ranks[0].release(leases[0]) is True
    assert ranks[0].stats()["pool"]["pinned"] == N  # rank 1 still holds its share
    assert ranks[1].release(leases[1]) is True
    s = books(ranks[0])
    assert s["leases"]["live"] == 0 and s["pool"]["pinned"] == 0
    for c in ranks:
        c.detach()


def test_shared_prefix_is_read_once(sidecar_factory, instance, tmp_path, kv, l3_filled):
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 20.0}))
    with KVConnector(instance, LAY) as c:
        c.prefetch(l3_filled, "x", policy="timeout", budget_s=30.0, chunk_max_blocks=8)
        c.prefetch(l3_filled, "y", policy="timeout", budget_s=30.0, chunk_max_blocks=8)
        px, py = wait_terminal(c, "x"), wait_terminal(c, "y")
        assert px["prefix"] == py["prefix"] == N
        s = books(c)
        assert s["l3"]["read_blocks_ok"] == N  # every block read from L3 exactly once
        assert s["sessions"]["blocks_deduplicated"] > 0
        assert get_and_check(c, l3_filled, "y", kv) == N


def test_limits_stop_claiming_and_end_with_what_it_has(sidecar_factory, instance, tmp_path, kv, l3_filled):
    bb = LAY.block_bytes
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 5.0, "limits.pinned_bytes_limit": 20 * bb}))
    with KVConnector(instance, LAY) as c:
        c.prefetch(l3_filled, "r", policy="timeout", budget_s=30.0, chunk_max_blocks=8)
        p = wait_terminal(c, "r")
        assert (p["status"], p["reason"]) == ("limit", "limit") and 0 < p["prefix"] <= 20  # healthy, not failed
        assert get_and_check(c, l3_filled, "r", kv) == p["prefix"]
        s = books(c)
        assert s["pool"]["staging"] == 0 and s["pool"]["pinned"] == 0


def test_checkpoints_and_failure_cut(sidecar_factory, instance, tmp_path, kv, l3_filled):
    sidecar_factory(**overrides(tmp_path, **{"l3.fail": "keys", "l3.fail_keys": [l3_filled[30 * 16:31 * 16].hex()]}))
    with KVConnector(instance, LAY) as c:
        c.prefetch(l3_filled, "r", policy="timeout", budget_s=30.0, chunk_max_blocks=8, checkpoint_every=7)
        p = wait_terminal(c, "r")
        assert p["status"] == "failed" and p["published"] == 30 and p["prefix"] == 28  # last checkpoint <= 30
        assert get_and_check(c, l3_filled, "r", kv) >= 28
        s = books(c)
        assert s["pool"]["staging"] == 0


def test_client_death_aborts_its_sessions(sidecar_factory, instance, tmp_path, kv, l3_filled, spawn_ctx):
    from .. import procs

    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 30.0}))
    a, b = spawn_ctx.Pipe()
    p = spawn_ctx.Process(target=procs.prefetch_and_block, args=(instance, LAY.as_dict(), l3_filled, b))
    p.start()
    assert a.poll(30) and a.recv() == "started"
    p.kill()
    p.join(5)
    with KVConnector(instance, LAY, group="observer") as c:
        s = wait_until(lambda: books(c), 5, "the dead client's session aborted and its staging dropped",
                       until=lambda s: s["sessions"].get("terminal_aborted") == 1 and s["pool"]["staging"] == 0)
        assert s["pool"]["staging"] == 0 and s["pool"]["pinned"] == 0 and s["leases"]["live"] == 0


def test_client_killed_while_its_detached_probe_is_in_flight(sidecar_factory, instance, tmp_path, kv, l3_filled,
                                                            spawn_ctx, read_gate):
    """cost_aware with no L3 measurement yet: a scheduling candidate's probe read is held; past
    the time a paying probe would take, the session ends and the read goes on without it (an
    orphan).  The client is then killed (-9).  When the read lands, its blocks are published with
    their own bytes and nothing is left behind: no staging, pins, leases or orphans."""
    from .. import procs

    sidecar_factory(**overrides(tmp_path, **read_gate.overrides()))  # (no calibration read at start)
    a, b = spawn_ctx.Pipe()
    p = spawn_ctx.Process(target=procs.prefetch_cost_aware_and_block, args=(instance, LAY.as_dict(), l3_filled, b))
    p.start()
    try:
        assert a.poll(30) and a.recv() == "started"
        with KVConnector(instance, LAY, group="observer") as c:
            wait_read_held(c)  # the probe's read is in flight, held at the gate
            s = wait_until(lambda: books(c), 10, "the candidate stopped waiting for its probe",
                           until=lambda s: s["sessions"].get("probes_detached") == 1)
            assert s["sessions"]["orphans"] == 1 and s["pool"]["staging"] > 0
            p.kill()
            p.join(5)
            assert p.exitcode is not None
            read_gate.open()
            s = wait_until(lambda: books(c), 10, "the orphaned probe landed and left nothing behind",
                           until=lambda s: s["sessions"]["orphans"] == 0 and s["pool"]["staging"] == 0)
            assert s["pool"]["pinned"] == 0 and s["leases"]["live"] == 0
            assert s["sessions"].get("orphan_blocks_published", 0) > 0
            assert get_and_check(c, l3_filled, "after", kv) == s["sessions"]["orphan_blocks_published"]
            s = books(c)
            assert s["leases"]["live"] == 0 and s["pool"]["pinned"] == 0
    finally:
        if p.is_alive():
            p.kill()
            p.join(5)


def test_unknown_request_and_bad_policy(sidecar_factory, instance, tmp_path):
    sidecar_factory(**overrides(tmp_path))
    with KVConnector(instance, LAY) as c:
        with pytest.raises(RemoteError) as ei:
            c.demand("nope")
        assert ei.value.code == ErrorCode.UNKNOWN_ID
        with pytest.raises(RemoteError) as ei:
            c.prefetch(c.hasher.chain(TOKENS), "r", policy="yolo")
        assert ei.value.code == ErrorCode.BAD_FIELD
        assert c.poll("nope")["state"] == "unknown"
        p = c.prefetch(c.hasher.chain(TOKENS), "empty", policy="timeout")
        assert wait_terminal(c, "empty")["status"] == "no_hit"
        assert p["session"] > 0


def test_config_policy_override_and_retained_ttl(sidecar_factory, instance, tmp_path, kv, l3_filled):
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 10.0, "sessions.policy_override": "wait_complete",
                                             "sessions.retained_ttl_s": 0.3}))
    with KVConnector(instance, LAY) as c:
        v = c.prefetch(l3_filled, "r", policy="timeout", budget_s=0.001, chunk_max_blocks=4)
        assert v["policy"] == "wait_complete"  # the sidecar's setting wins when set
        p = wait_terminal(c, "r")
        assert p["status"] == "complete" and p["prefix"] == N and p["chunks"] == 1  # one graph
        assert books(c)["leases"]["live"] == 1  # the retained result
        # past retained_ttl_s the reaper releases it (nobody took it)
        s = wait_until(lambda: books(c), 10, "the reaper releasing the retained lease",
                       until=lambda s: s["leases"]["live"] == 0)
        assert s["pool"]["pinned"] == 0
        assert s["leases"].get("dropped_expired", 0) == 1
        assert c.poll("r")["state"] == "unknown"  # and the record is forgotten


@pytest.mark.parametrize("budget_s", [0.04, 0.12])
def test_a_short_session_does_not_cut_a_long_one_on_a_shared_prefix(sidecar_factory, instance, tmp_path, kv,
                                                                     l3_filled, budget_s):
    """Issue 13's reproduction: two requests on the same 48-block prefix, one with a short
    timeout, one with 30 s, 30 ms L3 latency.  The long one used to end `failed` with prefix
    8-12 (the short one withdrew the reads it waited on); the reads are now handed over."""
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 30.0}))
    with KVConnector(instance, LAY) as c:
        c.prefetch(l3_filled, "short", policy="timeout", budget_s=budget_s, chunk_max_blocks=4)
        c.prefetch(l3_filled, "long", policy="timeout", budget_s=30.0, chunk_max_blocks=4)
        ps, pl = wait_terminal(c, "short"), wait_terminal(c, "long")
        assert ps["status"] == "timeout" and ps["prefix"] < N
        assert (pl["status"], pl["prefix"]) == ("complete", N), pl
        assert get_and_check(c, l3_filled, "long", kv) == N
        c.abort("short")
        s = books(c)
        assert s["l3"]["read_blocks_ok"] == N  # every block read once
        assert s["pool"]["staging"] == 0 and s["leases"]["live"] == 0 and s["sessions"]["orphans"] == 0


def test_wait_answers_at_the_query_at_a_published_count_and_at_its_deadline(sidecar_factory, instance, tmp_path,
                                                                            kv, l3_filled, timing):
    """The deferred ``wait`` op (what the SGLang backend blocks on instead of polling): it answers
    once the L3 query is done (target known, nothing read yet), once ``until`` blocks are
    published, or at its own deadline with ``timed_out`` -- and for an unknown request at once."""
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 20.0}))
    with KVConnector(instance, LAY) as c:
        assert c.wait("nobody")["state"] == "unknown"
        c.prefetch(l3_filled, "w", policy="wait_complete")
        q = c.wait("w", timeout_s=5.0)
        assert q["target"] == N and q["state"] in ("running", "terminal") and not q.get("timed_out")
        w = c.wait("w", until=N, timeout_s=10.0)
        assert w["published"] == N and not w.get("timed_out")
        assert get_and_check(c, l3_filled, "w", kv) == N
        c.prefetch(l3_filled, "t", policy="best_effort", chunk_max_blocks=2)
        t0 = time.monotonic()
        late = c.wait("t", until=N + 1, timeout_s=0.05)  # more than the chain: only the deadline ends it
        assert late.get("timed_out") or late["state"] == "terminal"
        timing.within(t0, 5.0, "a wait past its deadline answering")
        c.abort("t")
        wait_terminal(c, "t")
        s = books(c)
        assert s["pool"]["staging"] == 0 and s["pool"]["pinned"] == 0 and s["leases"]["live"] == 0


def test_wait_for_terminal_outlasts_the_query(sidecar_factory, instance, tmp_path, kv, l3_filled):
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 20.0}))
    with KVConnector(instance, LAY) as c:
        c.prefetch(l3_filled, "e", policy="timeout", budget_s=30.0, chunk_max_blocks=4)
        v = c.wait("e", terminal=True, timeout_s=20.0)
        assert v["state"] == "terminal" and v["status"] == "complete" and v["prefix"] == N and not v.get("timed_out")
        assert get_and_check(c, l3_filled, "e", kv) == N


@pytest.mark.parametrize("queue_aware", [True, False])
def test_waiting_reaches_a_cost_aware_session_and_a_bad_count_is_refused(sidecar_factory, instance, tmp_path,
                                                                        kv, l3_filled, queue_aware):
    """``waiting`` (a prefetch's, a poll's, a scan entry's): how many queued requests the
    session's prefill would hold up; a cost_aware session's view says what its decisions weigh
    (0 with ``sessions.queue_aware`` off), other policies ignore it.  A count that is not a
    non-negative int is refused, typed, and the sessions go on; data and books exact."""
    sidecar_factory(**overrides(tmp_path, **{"sessions.queue_aware": queue_aware}))
    on = 1 if queue_aware else 0
    with KVConnector(instance, LAY) as c:
        assert c.prefetch(l3_filled, "a", policy="cost_aware", eta_s=5.0, prefill_s_per_block=0.01,
                          waiting=2)["waiting"] == 2 * on
        assert "waiting" not in c.prefetch(l3_filled, "b", policy="best_effort", waiting=2)
        assert c.poll("a", waiting=3)["waiting"] == 3 * on
        assert c.poll("a")["waiting"] == 3 * on  # kept until the engine says otherwise
        views = c.poll_scan([("a", None, False, 0, 5), ("b", None, False, 0, 4)], step=1, until_ready=False)
        assert views[0]["waiting"] == 5 * on and "waiting" not in views[1]
        # (and the older requests still reading it would hold up, ahead_aware: none is older than a)
        assert views[0]["held"] == 0 and "held" not in views[1]
        for bad in (-1, 1.5, "3", True):
            with pytest.raises(RemoteError) as ei:
                c.client.call("poll", req="a", waiting=bad)
            assert ei.value.code == ErrorCode.MALFORMED
        with pytest.raises(RemoteError) as ei:
            c.client.call("poll_scan", polls=[{"req": "a", "waiting": -2}])
        assert ei.value.code == ErrorCode.MALFORMED
        assert c.poll("a")["waiting"] == 5 * on  # refused: nothing changed
        assert c.poll("a", waiting=2**63 - 1)["waiting"] == MAX_WAITING * on  # taken up to the cap
        for r in ("a", "b"):
            wait_terminal(c, r)
            get_and_check(c, l3_filled, r, kv)
        s = books(c)
        assert s["pool"]["staging"] == 0 and s["pool"]["pinned"] == 0 and s["leases"]["live"] == 0


@pytest.mark.parametrize("fixed_hit", [False, True])
def test_a_dearer_l3_is_read_behind_the_queue_only_for_an_engine_that_takes_what_is_resident(
        sidecar_factory, instance, tmp_path, kv, l3_filled, fixed_hit):
    """cost_aware, L3 dearer per block than prefill (the L3 measured at start), a far ETA: an
    engine that takes what is resident gets what lands behind its queue; one that waits for the
    whole hit it was told (``fixed_hit``, SGLang) is told the resident prefix -- here none -- and
    nothing is read for it.  Bytes and books exact either way."""
    sidecar_factory(**overrides(tmp_path, **{"l3.bandwidth_mbps": 8.0}))  # ~1 ms a block: 100x the prefill
    with KVConnector(instance, LAY) as c:
        # the start-up calibration measured L3 (before it, a session probes: that is not this test)
        wait_until(lambda: c.stats()["l3"]["cost"]["samples"], 10.0, "the L3 calibration", until=lambda n: n >= 2)
        reads = c.stats()["l3"].get("read_blocks_ok", 0)
        c.prefetch(l3_filled, "r", policy="cost_aware", eta_s=5.0, prefill_s_per_block=1e-5, fixed_hit=fixed_hit)
        view = wait_terminal(c, "r")
        s = books(c)
        if fixed_hit:
            assert view["status"] == "cost" and view["prefix"] == 0 and view["planned"] == 0
            assert s["l3"].get("read_blocks_ok", 0) == reads
        else:
            assert view["prefix"] == N and s["l3"].get("read_blocks_ok", 0) == reads + N
        assert get_and_check(c, l3_filled, "r", kv) == view["prefix"]
        s = books(c)
        assert s["pool"]["staging"] == 0 and s["pool"]["pinned"] == 0 and s["leases"]["live"] == 0


def test_pool_hits_whose_tail_l3_lacks_explore_on_the_backoff_over_hundreds_of_requests(
        sidecar_factory, instance, tmp_path, kv):
    """A long run of pool hits at an idle engine whose new tail block was never stored (a
    follow-up turn), L3 dearer than prefill (measured at start): cost_aware ends each at once on
    its resident prefix, and one in EXPLORE_AFTER, 2x, 4x ... (up to EXPLORE_MAX) explores -- its
    query finds nothing, nothing is read.  It once counted the wait from the last L3 read, so
    from the ~200th such request on every one explored, each held for the L3 query.  Every
    request gets its resident prefix, byte for byte; books exact."""
    from kvsidecar.sidecar.prefetch.estimates import EXPLORE_AFTER, EXPLORE_MAX

    sidecar_factory(**overrides(tmp_path, **{"l3.bandwidth_mbps": 8.0}))  # ~1 ms a block: 100x the prefill
    n, waits, w = 400, [], EXPLORE_AFTER
    while sum(waits) + len(waits) + w + 1 <= n:
        waits.append(w)
        w = min(2 * w, EXPLORE_MAX)
    with KVConnector(instance, LAY) as c:
        wait_until(lambda: c.stats()["l3"]["cost"]["samples"], 10.0, "the L3 calibration", until=lambda s: s >= 2)
        reads = c.stats()["l3"].get("read_blocks_ok", 0)
        statuses = []
        for i in range(n):
            tokens = [7, i, 7, i] * 2 + [i, 9, 9, i]  # 3 blocks: 2 stored now, the third never
            chain = c.hasher.chain(tokens)
            st = c.store(chain_span(chain, 0, 2), l3=False)
            c.save(st, kv, [0, 1][:st.count])
            c.commit(st)
            c.prefetch(chain, f"r{i}", policy="cost_aware", eta_s=0.0, prefill_s_per_block=1e-5)
            view = wait_terminal(c, f"r{i}")
            statuses.append(view["status"])
            assert get_and_check(c, chain, f"r{i}", kv) == view["prefix"] == 2  # (its bytes as stored)
        explored = [i for i, s in enumerate(statuses) if s != "cost"]
        expect, at = [], -1
        for w in waits:
            at += w + 1
            expect.append(at)
        assert explored == expect and {statuses[i] for i in explored} == {"no_hit"}
        s = books(c)
        assert s["sessions"]["cost_explorations"] == len(waits) == 6
        assert s["l3"].get("read_blocks_ok", 0) == reads  # nothing was read
        assert s["pool"]["staging"] == 0 and s["leases"]["live"] == 0
