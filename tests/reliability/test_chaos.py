"""Chaos: kill -9 at chosen points of a TP=2 workload (ranks are real processes), of the
sidecar, of the Mooncake master and of a Mooncake holder node.

After each fault: the books balance (``stats(check=True)``), no lease, pin or staging is left,
surviving ranks get typed errors within their deadline, a restart re-attaches, and no page a
rank loads is ever wrong (every loaded page is compared with what was stored).  Each scenario
records injected / survived / data lost; the slow variant repeats every kind more often.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from kvsidecar.connector.client import SidecarClient
from kvsidecar.connector.kv_client import KVConnector
from kvsidecar.shm.layout import KVLayout
from kvsidecar.sidecar.spawn import SidecarProcess

from ..waiting import wait_until
from .chaos_procs import chaos_rank

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=4, tp_size=2)
N = 16
PAGES = N
SEED = 5
TALLY: dict[str, dict] = {}


def _tally(kind: str, survived: bool, lost: int) -> None:
    t = TALLY.setdefault(kind, {"injected": 0, "survived": 0, "data_lost": 0})
    t["injected"] += 1
    t["survived"] += int(survived)
    t["data_lost"] += lost


@pytest.fixture(scope="module", autouse=True)
def chaos_table():
    yield
    if TALLY:
        print("\nchaos: kind / injected / survived / data lost")
        for kind, t in TALLY.items():
            print(f"  {kind:<28} {t['injected']:>3} {t['survived']:>3} {t['data_lost']:>3}")


def overrides(tmp_path, **extra):
    d = {f"layout.{k}": v for k, v in LAY.as_dict().items()}
    d.update({"pool.num_blocks": 128, "l3.file_dir": str(tmp_path / "l3"), "limits.lease_ttl_s": 600.0})
    d.update(extra)
    return d


class Rank:
    """A chaos rank process and its command pipe."""

    def __init__(self, ctx, instance: str, rank: int, group: str = "g"):
        self.parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=chaos_rank, args=(instance, LAY.as_dict(), rank, group, PAGES, SEED, child),
                                daemon=True)
        self.proc.start()
        child.close()

    def send(self, cmd: str, **args) -> None:
        self.parent.send((cmd, args))

    def until(self, what: str, timeout_s: float = 30.0):
        """Next message; ``what`` is a phase name or "done"."""
        assert self.parent.poll(timeout_s), f"rank silent waiting for {what}"
        kind, value = self.parent.recv()
        if what == "done":
            assert kind == "done", (kind, value)
            return value
        assert (kind, value) == ("phase", what), (kind, value)
        return value

    def call(self, cmd: str, **args):
        self.send(cmd, **args)
        return _next_non_phase(self)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("detach")
            except (AssertionError, OSError, EOFError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()


def tokens(i: int) -> list:
    return [i * 100_000 + t for t in range(4 * N)]


def observer_stats(instance: str) -> dict:
    with SidecarClient(instance, group="observer") as obs:
        r = obs.call("stats", check=True)
    r["stats"]["invariants"] = r["invariants"]
    return r["stats"]


def wait_reclaimed(instance: str, n: int, timeout_s: float = 10.0) -> dict:
    """The stats once ``n`` clients were reclaimed -- or, past ``timeout_s``, the stats as they are
    (the caller's checks then fail and are tallied)."""
    try:
        return wait_until(lambda: observer_stats(instance), timeout_s, f"{n} clients reclaimed",
                          until=lambda s: s["counters"].get("clients_reclaimed", 0) >= n)
    except AssertionError:
        return observer_stats(instance)


def clean(s: dict) -> bool:
    return (s["invariants"] == "" and s["leases"]["live"] == 0 and s["pool"]["pinned"] == 0
            and s["pool"]["staging"] == 0)


def both(ranks, cmd, **args):
    for r in ranks:
        r.send(cmd, **args)
    return [_next_non_phase(r) for r in ranks]


def _next_non_phase(r: Rank):
    while True:
        assert r.parent.poll(30)
        kind, value = r.parent.recv()
        if kind != "phase":
            return kind, value


def store_both(ranks, i: int, step: int, l3: bool = False, instance: str | None = None) -> None:
    res = both(ranks, "store", tokens=tokens(i), req=f"s{i}-{step}", step=step, l3=l3)
    assert all(k == "done" for k, _ in res), res
    if l3:  # wait (bounded) until the write-behind PUT is done
        wait_until(lambda: observer_stats(instance)["l3"]["puts_in_flight"], 10, "no L3 PUT in flight",
                   until=lambda n: n == 0)


def load_both(ranks, i: int, step: int, expect: int | None = None) -> int:
    res = both(ranks, "get_load", tokens=tokens(i), req=f"l{i}-{step}", step=step)
    assert all(k == "done" for k, _ in res), res
    counts = {v["count"] for _, v in res}
    assert len(counts) == 1, res  # ranks agree (the group's one decision)
    if expect is not None:
        assert counts == {expect}, res
    return sum(v["corrupt_pages"] for _, v in res)


@pytest.fixture
def ctx():
    return mp.get_context("spawn")


# one trial of every kind in the default suite, four more of each in the slow run
TRIALS = [0] + [pytest.param(i, marks=pytest.mark.slow) for i in range(1, 5)]


@pytest.mark.parametrize("trial", TRIALS)
def test_rank_killed_mid_load_mid_store_mid_prefetch(sidecar_factory, instance, tmp_path, ctx, trial):
    sidecar_factory(**overrides(tmp_path, **{"l3.latency_ms": 20.0}))
    r0, r1 = Rank(ctx, instance, 0), Rank(ctx, instance, 1)
    reclaimed = 0
    try:
        assert r0.call("attach")[0] == "done" and r1.call("attach")[0] == "done"
        store_both([r0, r1], 1, step=1, l3=True, instance=instance)
        lost = load_both([r0, r1], 1, step=2, expect=N)
        assert lost == 0

        # -- mid-load: rank 1 dies between its GET and the end of its copy
        r0.send("get_load", tokens=tokens(1), req="k1", step=3)
        r1.send("get_load", tokens=tokens(1), req="k1", step=3, hold=True)
        r1.until("loading")  # it holds its share of the group lease, the copy not done
        r1.kill()
        reclaimed += 1
        kind, v = _next_non_phase(r0)
        s = wait_reclaimed(instance, reclaimed)
        lost = v["corrupt_pages"] if kind == "done" else 0
        ok = kind == "done" and v["count"] == N and clean(s)
        assert ok, (kind, v, s["invariants"], str(s["leases"]), str(s["pool"]), str(s.get("l3")))
        r1 = Rank(ctx, instance, 1)
        ok = r1.call("attach")[0] == "done"
        lost += load_both([r0, r1], 1, step=4, expect=N)
        _tally("rank_mid_load", ok and clean(observer_stats(instance)), lost)
        assert ok and lost == 0

        # -- mid-store: rank 1 dies while saving its shard; nothing of that chain is published
        r0.send("store", tokens=tokens(2), req="st2", step=5)
        r1.send("store", tokens=tokens(2), req="st2", step=5, hold=True)
        r1.until("saving")  # staging open, its shard not written, not committed
        r1.kill()
        reclaimed += 1
        kind, v = _next_non_phase(r0)
        s = wait_reclaimed(instance, reclaimed)
        ok = kind in ("done", "error") and clean(s) and s["store"]["open"] == 0
        assert ok, (kind, v, s["invariants"], str(s["leases"]), str(s["pool"]), str(s["store"]))
        r1 = Rank(ctx, instance, 1)
        ok = r1.call("attach")[0] == "done"
        res = both([r0, r1], "get_load", tokens=tokens(2), req="g2", step=6)
        ok = ok and all(k == "done" and val["count"] == 0 for k, val in res)  # never published half-written
        assert ok, res
        store_both([r0, r1], 2, step=7)
        lost = load_both([r0, r1], 2, step=8, expect=N)
        _tally("rank_mid_store", ok and clean(observer_stats(instance)), lost)
        assert ok and lost == 0

        # -- mid-prefetch: rank 1 dies while the group's session reads from L3
        with KVConnector(instance, LAY, group="flusher") as f:
            f.flush()
        r0.send("prefetch", tokens=tokens(1), req="p1", policy="timeout", budget_s=30.0, chunk=2)
        r1.send("prefetch", tokens=tokens(1), req="p1", policy="timeout", budget_s=30.0, chunk=2)
        r0.until("prefetching")
        r1.until("prefetching")
        assert _next_non_phase(r1)[0] == "done"
        r1.kill()
        reclaimed += 1
        assert _next_non_phase(r0)[0] == "done"
        kind, p = r0.call("poll_terminal", req="p1")
        s = wait_reclaimed(instance, reclaimed)
        ok = kind == "done" and p["status"] == "complete" and p["prefix"] == N
        kind, v = r0.call("get_load", tokens=tokens(1), req="p1", step=9)
        lost = v["corrupt_pages"] if kind == "done" else 0
        ok = ok and kind == "done" and v["count"] == N and clean(observer_stats(instance))
        _tally("rank_mid_prefetch", ok, lost)
        assert ok and lost == 0
    finally:
        r0.close()
        r1.close()


@pytest.mark.parametrize("trial", TRIALS)
def test_sidecar_killed_mid_drain_then_restarted(sidecar_factory, instance, tmp_path, ctx, trial, timing):
    slow = {"l3.latency_ms": 300.0}
    sp = sidecar_factory(**overrides(tmp_path))
    ranks = [Rank(ctx, instance, 0), Rank(ctx, instance, 1)]
    try:
        for r in ranks:
            assert r.call("attach")[0] == "done"
        store_both(ranks, 3, step=1, l3=True, instance=instance)
        sp.stop()
        sp = sidecar_factory(**overrides(tmp_path, **slow))  # same L3 directory, empty CPU pool
        for r in ranks:
            assert r.call("attach")[0] == "done"
        for r in ranks:
            # the L3 query takes 300 ms, each chunk read 300 ms on the one read lane: the deadline
            # (0.45 s) seals the session while its first chunk is in flight -> it drains
            r.send("prefetch", tokens=tokens(3), req="d", policy="timeout", budget_s=0.45, chunk=4)
        for r in ranks:
            r.until("prefetching")
            assert _next_non_phase(r)[0] == "done"
        with SidecarClient(instance, group="observer") as obs:  # wait (bounded) for the drain
            wait_until(lambda: obs.call("stats")["stats"]["sessions"]["by_state"].get("draining", 0), 10,
                       "the session draining", interval_s=0.002)
        sp.kill()  # kill -9 while the session drains its read in flight
        typed = []
        for r in ranks:
            kind, v = r.call("lookup_timed", tokens=tokens(3))
            typed.append(kind == "done" and v["error"] == "SidecarUnavailable")
            timing.below(v["ms"] / 1e3, 1.0, "a lookup against the killed sidecar")
        sp = sidecar_factory(**overrides(tmp_path))  # restart: replaces the stale segments, new generation
        gens = [r.call("attach") for r in ranks]
        ok = all(typed) and all(k == "done" and g == sp.generation for k, g in gens)
        for r in ranks:
            r.send("prefetch", tokens=tokens(3), req="d2", policy="timeout", budget_s=30.0, chunk=4)
        for r in ranks:
            r.until("prefetching")
            assert _next_non_phase(r)[0] == "done"
        kind, p = ranks[0].call("poll_terminal", req="d2")
        ok = ok and kind == "done" and p["status"] == "complete" and p["prefix"] == N
        res = both(ranks, "get_load", tokens=tokens(3), req="d2", step=2)
        lost = sum(v["corrupt_pages"] for k, v in res if k == "done")
        ok = ok and all(k == "done" and v["count"] == N for k, v in res) and clean(observer_stats(instance))
        _tally("sidecar_mid_drain", ok, lost)
        assert ok and lost == 0, (typed, gens, p, res)
    finally:
        for r in ranks:
            r.close()


# -- Mooncake faults (one TP=1 connector in this process; the fault is in the L3 cluster) ----
MLAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, tokens_per_block=8, tp_size=1)


def mc_overrides(master, **extra):
    d = {f"layout.{k}": v for k, v in MLAY.as_dict().items()}
    d.update({"pool.num_blocks": 64, "l3.backend": "mooncake", "l3.mooncake_master": master.address,
              "l3.mooncake_global_segment_bytes": 32 << 20, "l3.mooncake_local_buffer_bytes": 8 << 20,
              "sessions.drain_timeout_s": 1.0})
    d.update(extra)
    return d


def _kv(n):
    import torch

    torch.manual_seed(3)
    return [tuple(torch.randn(n, 8, 2, 32).half() for _ in range(2)) for _ in range(2)]


def _store_l3(c, kv, toks):
    from ..helpers import store_to_l3

    return store_to_l3(c, kv, toks)


def _session_then_fault(c, kv, toks, fault, timing) -> tuple[bool, int, dict]:
    """Flush, prefetch in chunks, inject ``fault`` while a read is in flight; check the result."""
    import torch

    from ..helpers import wait_terminal

    chain = c.hasher.chain(toks)
    c.flush()
    c.prefetch(chain, "m", policy="timeout", budget_s=30.0, chunk_max_blocks=4)
    # a chunk is staged: its read is queued or running
    wait_until(lambda: c.stats(), 10, "a chunk staged", until=lambda s: s["pool"]["staging"], interval_s=0.002)
    t0 = time.monotonic()
    fault()
    p = wait_terminal(c, "m", timeout_s=30)
    stop_s = time.monotonic() - t0
    lease = c.get(chain, req="m", step=1)
    out = [tuple(torch.zeros_like(t) for t in layer) for layer in kv]
    c.load(lease, out, list(range(lease.count)))
    c.release(lease)
    n = lease.count
    lost = sum(int(not torch.equal(a[q], b[q])) for la, lb in zip(kv, out) for a, b in zip(la, lb) for q in range(n))
    s = c.stats(check=True)
    # the GET takes what is resident: the session's prefix, and more only where a read it left
    # behind (an orphan: its chunk, after the fault ended the session) landed meanwhile and was
    # published -- those bytes are checked like the rest (``lost``)
    orphans = s["sessions"].get("orphan_blocks_published", 0)
    ok = (s["invariants"] == "" and s["leases"]["live"] == 0
          and (n == p["prefix"] or p["prefix"] < n <= p["prefix"] + orphans))
    timing.below(stop_s, 10, f"fault to terminal ({p})")
    return ok, lost, {"status": p["status"], "prefix": n, "stop_s": round(stop_s, 3),
                      "wait_timed_out": bool(p.get("timed_out"))}


@pytest.mark.mooncake
@pytest.mark.parametrize("trial", TRIALS)
def test_mooncake_master_killed_mid_restore(instance, mooncake_master, trial, timing):
    from kvsidecar.sidecar.l3.master import MooncakeMaster

    sp = SidecarProcess(instance, overrides=mc_overrides(mooncake_master, **{"l3.latency_ms": 150.0}))
    try:
        kv = _kv(24)
        toks = list(range(8 * 24))
        with KVConnector(instance, MLAY) as c:
            _store_l3(c, kv, toks)
            ok, lost, info = _session_then_fault(c, kv, toks, mooncake_master.kill, timing)
            # the master comes back on the same port; the sidecar serves on (a clean miss now)
            again = MooncakeMaster(rpc_port=mooncake_master.rpc_port)
            try:
                ok = ok and c.client.call("ping")["ok"]
                r = c.restore(c.hasher.chain(list(range(5000, 5000 + 8 * 4))))
                ok = ok and r["restored"] == 0
            finally:
                again.stop()
            s = c.stats(check=True)
            ok = ok and s["invariants"] == ""
        print(f"\nmaster killed mid-restore: {info}")
        _tally("mooncake_master_mid_restore", ok, lost)
        assert ok and lost == 0, info
    finally:
        assert sp.stop(timeout_s=20) in (0, -9)


@pytest.mark.mooncake
@pytest.mark.parametrize("trial", TRIALS)
def test_mooncake_holder_killed_mid_read(instance, mooncake_master, trial, timing):
    a = SidecarProcess(instance + "a", overrides=mc_overrides(mooncake_master))
    b = SidecarProcess(instance + "b", overrides=mc_overrides(mooncake_master, **{
        "l3.latency_ms": 150.0, "l3.mooncake_global_segment_bytes": 0}))
    try:
        kv = _kv(24)
        toks = list(range(8 * 24))
        with KVConnector(a.instance, MLAY) as ca:
            _store_l3(ca, kv, toks)
        with KVConnector(b.instance, MLAY) as cb:
            ok, lost, info = _session_then_fault(cb, kv, toks, a.kill, timing)
            ok = ok and cb.client.call("ping")["ok"]
        print(f"\nholder killed mid-read: {info}")
        _tally("mooncake_holder_mid_read", ok, lost)
        assert ok and lost == 0, info
    finally:
        assert b.stop(timeout_s=20) in (0, -9)
        a.kill()
        for name in os.listdir("/dev/shm"):
            if name.startswith(instance + "a"):
                os.unlink(os.path.join("/dev/shm", name))


def _store_as_group(instance: str, group: str, chain_no: int) -> None:
    """Another engine (two in-process ranks of ``group``) stores chain ``chain_no``: it takes
    whatever blocks are free, i.e. reuses the blocks another chain was evicted from."""
    from ..procs import chain_kv

    ranks = [KVConnector(instance, LAY, rank=r, group=group, populate="off") for r in (0, 1)]
    try:
        for c in ranks:
            c.attach()
        chain = ranks[0].hasher.chain(tokens(chain_no))
        sts = [c.store(chain, req=f"{group}-{chain_no}", step=0) for c in ranks]
        for r, (c, st) in enumerate(zip(ranks, sts)):
            c.save(st, chain_kv(LAY.as_dict(), r, tokens(chain_no)), list(range(st.start, st.start + st.count)))
            c.commit(st)
    finally:
        for c in ranks:
            c.detach()


def _flush(instance: str) -> int:
    with KVConnector(instance, LAY, group="flusher", populate="off") as f:
        return f.flush()


def _refill_pool(instance: str, first_chain: int) -> None:
    """Evict everything unpinned and fill the pool with other chains (every block reused)."""
    _flush(instance)
    for j in range(128 // N):
        _store_as_group(instance, "other", first_chain + j)


@pytest.mark.parametrize("trial", TRIALS)
def test_rank_respawned_into_a_live_group_and_a_late_rank(sidecar_factory, instance, tmp_path, ctx, trial):
    """Ranks that come back (DESIGN §6): rank 1 killed mid-load and respawned while rank 0 kept
    serving replays the same (request, step); a rank attaching for the first time after its
    group decided.  Every loaded page is compared with its own chain's KV."""
    sidecar_factory(**overrides(tmp_path, **{"l3.backend": "none"}))
    r0, r1 = Rank(ctx, instance, 0), Rank(ctx, instance, 1)
    late = None
    reclaimed = 0
    try:
        assert r0.call("attach")[0] == "done" and r1.call("attach")[0] == "done"
        store_both([r0, r1], 1, step=1)
        # -- respawn: rank 1 dies holding its share of the group's lease, rank 0 finishes, releases
        r0.send("get_load", tokens=tokens(1), req="k1", step=2)
        r1.send("get_load", tokens=tokens(1), req="k1", step=2, hold=True)
        r1.until("loading")
        r1.kill()
        reclaimed += 1
        kind, v = _next_non_phase(r0)
        assert kind == "done" and v["count"] == N and v["corrupt_pages"] == 0, v
        wait_reclaimed(instance, reclaimed)
        # rank 0's engine keeps serving without it: the next step's decision is made while rank 1
        # is away (no share for it), then chain 1's blocks are evicted and reused
        kind, v = r0.call("get_load", tokens=tokens(1), req="k1", step=3)
        assert kind == "done" and v["count"] == N and v["corrupt_pages"] == 0, v
        _refill_pool(instance, 100)
        r1 = Rank(ctx, instance, 1)
        ok = r1.call("attach")[0] == "done"
        kind, v = r1.call("get_load", tokens=tokens(1), req="k1", step=3)  # it catches up: replays step 3
        lost = v["corrupt_pages"] if kind == "done" else 0
        ok = ok and kind == "done" and (v["count"], v["stale"], v["refused"]) == (0, True, 0)
        s = observer_stats(instance)
        ok = ok and clean(s) and s["counters"].get("decisions_stale", 0) == 1
        store_both([r0, r1], 2, step=3)  # and the group works on: a new chain, both ranks, checked
        lost += load_both([r0, r1], 2, step=4, expect=N)
        _tally("rank_respawned_replay", ok and clean(observer_stats(instance)), lost)
        assert ok and lost == 0, (kind, v)

        # -- late: group "late" decides with rank 1 never attached; rank 1 comes afterwards
        late = Rank(ctx, instance, 0, group="late")
        assert late.call("attach")[0] == "done"
        _store_as_group(instance, "writer", 3)
        kind, v = late.call("get_load", tokens=tokens(3), req="q3", step=5)
        ok = kind == "done" and v["count"] == N and v["corrupt_pages"] == 0
        _refill_pool(instance, 200)  # chain 3 stays pinned for the late rank's share; the rest is reused
        late1 = Rank(ctx, instance, 1, group="late")
        try:
            ok = ok and late1.call("attach")[0] == "done"
            kind, v = late1.call("get_load", tokens=tokens(3), req="q3", step=5)
            lost = v["corrupt_pages"] if kind == "done" else 0
            ok = ok and kind == "done" and v["count"] == N and not v["refused"]
        finally:
            late1.close()
        s = observer_stats(instance)
        ok = ok and clean(s)
        _tally("rank_late_first_attach", ok, lost)
        assert ok and lost == 0, (kind, v, str(s["leases"]), str(s["pool"]))
    finally:
        r0.close()
        r1.close()
        if late is not None:
            late.close()
