"""Accounting while things are in flight: books balance with sessions running, a dead rank's
share of a group lease is never created, and a read stuck in L3 does not hold a stop hostage."""

from __future__ import annotations

import time

import pytest
import torch

from kvsidecar.connector.kv_client import KVConnector
from kvsidecar.shm.layout import KVLayout

from .. import procs
from ..helpers import file_l3_overrides, fill_l3, small_kv, wait_terminal, wait_until
from ..waiting import wait_past_query

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=4, tp_size=1)
N = 24
TOKENS = list(range(4 * N))


def overrides(tmp_path, lay=LAY, **extra):
    return file_l3_overrides(tmp_path, lay, 96, **extra)


@pytest.fixture
def l3_filled(sidecar_factory, instance, tmp_path):
    return fill_l3(sidecar_factory, instance, LAY, overrides(tmp_path), small_kv(N), TOKENS)


def test_books_balance_while_sessions_are_in_flight_and_a_stuck_read_is_left_behind(
        sidecar_factory, instance, tmp_path, l3_filled, timing):
    """Reads hang in L3: the session's staging and pins count in the books (they were ignored);
    after its deadline the drain budget runs out, the session ends with what landed, and its
    blocks stay staging (an orphan) until the read really ends (here: at shutdown)."""
    sp = sidecar_factory(**overrides(tmp_path, **{"l3.hang": True, "sessions.drain_timeout_s": 0.3}))
    with KVConnector(instance, LAY) as c:
        # (a budget past wait_terminal's bound: its deadline must not be what ends the wait)
        c.prefetch(l3_filled, "r", policy="timeout", budget_s=60.0, chunk_max_blocks=8)
        # wait (bounded) until the first chunk is staged and its read started (is on the lane,
        # not queued: a queued read would be withdrawn by the abort, not left behind)
        wait_until(lambda: c.stats()["l3"]["read"]["busy"], 10.0, "the first read in flight")
        wait_past_query(c, "r")  # (its first chunk is read with the query: the answer may come later)
        s = c.stats(check=True)
        assert s["invariants"] == "", s["invariants"]
        assert s["sessions"]["by_state"] == {"running": 1} and s["pool"]["staging"] > 0
        c.abort("r")  # seal: the queued chunk is withdrawn, the read in flight is drained...
        t0 = time.monotonic()
        p = wait_terminal(c, "r")
        timing.within(t0, 5.0, "abort to terminal")  # bounded by drain_timeout_s (0.3 s), not by the stuck read
        assert p["status"] == "aborted" and p["prefix"] == 0  # ...until the drain budget ran out
        s = c.stats(check=True)
        assert s["invariants"] == "", s["invariants"]
        assert s["sessions"]["orphans"] == 1 and s["sessions"]["chunks_abandoned"] == 1
        assert s["pool"]["staging"] == 8 and s["pool"]["pinned"] == 0 and s["leases"]["live"] == 0
        assert s["sessions"]["by_state"] == {"terminal": 1}
    assert sp.stop() == 0  # shutdown ends the stuck read; the orphan resolves; books balance


def test_timeout_session_with_stuck_read_stops_within_the_drain_budget(
        sidecar_factory, instance, tmp_path, l3_filled, timing):
    sidecar_factory(**overrides(tmp_path, **{"l3.hang": True, "sessions.drain_timeout_s": 0.2}))
    with KVConnector(instance, LAY) as c:
        c.prefetch(l3_filled, "r", policy="timeout", budget_s=0.05, chunk_max_blocks=8)
        p = wait_terminal(c, "r")
        assert p["status"] == "timeout" and p["prefix"] == 0
        assert p["stop_ms"] is not None
        timing.below(p["stop_ms"] / 1e3, 2.0, "the session's stop (drain_timeout_s = 0.2)")
        s = c.stats(check=True)
        assert s["invariants"] == ""


MLA = KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, tokens_per_block=4, tp_size=2, mla=True)


def test_group_lease_made_after_a_rank_died_is_not_held_for_it(sidecar_factory, instance, tmp_path, spawn_ctx):
    """TP=2: rank 1 is killed; a group GET made afterwards by rank 0 is released by rank 0 alone
    (before, the dead rank stayed a holder and the blocks stayed pinned for lease_ttl_s)."""
    sidecar_factory(**overrides(tmp_path, lay=MLA, **{"l3.backend": "none", "limits.lease_ttl_s": 600.0}))
    parent, child = spawn_ctx.Pipe()
    p = spawn_ctx.Process(target=procs.kv_attach_and_wait, args=(instance, MLA.as_dict(), 1, "g", child))
    p.start()
    try:
        assert parent.poll(30)
        parent.recv()
        with KVConnector(instance, MLA, rank=0, group="g") as c:
            chain = c.hasher.chain(TOKENS)
            st = c.store(chain, req="w", step=1)
            c.commit(st)
            p.kill()
            p.join(10)
            wait_until(lambda: c.stats()["counters"].get("clients_reclaimed", 0), 10, "the killed rank reclaimed")
            lease = c.get(chain, req="r", step=2)
            assert lease.count == N
            assert c.release(lease) is True
            s = c.stats(check=True)
            assert s["invariants"] == ""
            assert s["leases"]["live"] == 0 and s["pool"]["pinned"] == 0
            # a rank that comes back is a holder again
            parent2, child2 = spawn_ctx.Pipe()
            p2 = spawn_ctx.Process(target=procs.kv_attach_and_wait, args=(instance, MLA.as_dict(), 1, "g", child2))
            p2.start()
            assert parent2.poll(30)
            parent2.recv()
            lease = c.get(chain, req="r", step=3)
            c.release(lease)
            assert c.stats()["pool"]["pinned"] == N  # rank 1 still holds its share
            parent2.send("go")
            p2.join(10)
            assert c.stats(check=True)["pool"]["pinned"] == 0  # its detach released it
    finally:
        if p.is_alive():
            p.kill()
        p.join(5)


def test_write_behind_backlog_is_bounded(sidecar_factory, instance, tmp_path):
    """A slow L3: stores beyond the PUT backlog bound stay in the pool only (counted), so the
    sidecar's pins and memory never grow with the backlog."""
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 300.0, "l3.max_put_backlog_blocks": 8}))
    torch.manual_seed(1)
    kv = [tuple(torch.randn(8, 4, 2, 16).half() for _ in range(2)) for _ in range(2)]
    with KVConnector(instance, LAY) as c:
        for i in range(3):
            st = c.store(c.hasher.chain(list(range(1000 * i, 1000 * i + 32))), l3=True)
            c.save(st, kv, list(range(st.count)))
            c.commit(st)
        s = c.stats()
        assert s["l3"]["put_backlog_blocks"] == 8  # the first PUT is pending; the others were not queued
        assert s["counters"]["l3_put_skipped_blocks"] == 16
        from ..helpers import wait_l3_idle

        s = wait_l3_idle(c)
        assert s["counters"]["l3_published_blocks"] == 8 and s["l3"]["put_backlog_blocks"] == 0
        assert c.stats(check=True)["invariants"] == ""
