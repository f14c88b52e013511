"""KV ops across real processes: 2-4 TP ranks store, evict, refill, get and load byte-exact."""

from __future__ import annotations

import os
import signal

import pytest

from kvsidecar.connector.client import SidecarClient
from kvsidecar.connector.kv_client import KVConnector
from kvsidecar.shm.errors import ErrorCode, RemoteError
from kvsidecar.shm.layout import KVLayout

from .. import procs
from ..waiting import wait_until


def layout_overrides(lay: KVLayout, num_blocks: int, **extra) -> dict:
    d = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    d["pool.num_blocks"] = num_blocks
    d.update(extra)
    return d


class Ranks:
    """A TP group of rank processes driven over pipes."""

    def __init__(self, ctx, instance, lay: KVLayout, group: str, namespace: str = ""):
        self.pipes, self.procs = [], []
        for r in range(lay.tp_size):
            a, b = ctx.Pipe()
            p = ctx.Process(target=procs.kv_rank_worker, args=(instance, lay.as_dict(), r, group, b, namespace))
            p.start()
            self.pipes.append(a)
            self.procs.append(p)

    def ask(self, rank, cmd, **args):
        self.pipes[rank].send((cmd, args))
        assert self.pipes[rank].poll(60), f"rank {rank} did not answer {cmd}"
        ok, res = self.pipes[rank].recv()
        if not ok:
            raise AssertionError(f"rank {rank} {cmd}: {res}")
        return res

    def ask_err(self, rank, cmd, **args):
        self.pipes[rank].send((cmd, args))
        assert self.pipes[rank].poll(60)
        ok, res = self.pipes[rank].recv()
        assert not ok, f"expected an error from {cmd}, got {res}"
        return res

    def all(self, cmd, **args):
        return [self.ask(r, cmd, **args) for r in range(len(self.pipes))]

    def close(self):
        for r, p in enumerate(self.procs):
            if p.is_alive():
                try:
                    self.pipes[r].send(("detach", {}))
                    self.pipes[r].poll(10) and self.pipes[r].recv()
                except (BrokenPipeError, EOFError, OSError):
                    pass
            p.join(10)


@pytest.fixture
def group_factory(spawn_ctx, instance):
    made = []

    def make(lay, group="engine", namespace=""):
        g = Ranks(spawn_ctx, instance, lay, group, namespace)
        made.append(g)
        g.all("attach")
        return g

    yield make
    for g in made:
        g.close()


def checked_stats(instance, lay):
    with SidecarClient(instance, group="checker") as c:  # an observer: no layout needed
        r = c.call("stats", check=True)
    assert r["invariants"] == "", r["invariants"]
    return r["stats"]


@pytest.mark.parametrize("tp,mla", [(2, False), (4, False), (2, True)], ids=["tp2", "tp4", "tp2-mla"])
def test_store_evict_refill_get_load_byte_exact(sidecar_factory, instance, group_factory, tp, mla):
    lay = KVLayout(num_layers=3, num_kv_heads=4, head_dim=8, tokens_per_block=4, tp_size=tp, mla=mla)
    sidecar_factory(**layout_overrides(lay, num_blocks=24))
    g = group_factory(lay)
    g.all("fill", pages=20, seed=1)
    toks = list(range(1000, 1000 + 4 * 16))  # 16 blocks
    stored = [g.ask(r, "store", tokens=toks, req="r1", step=1) for r in range(tp)]
    assert len({(s["staging"], s["start"], s["count"]) for s in stored}) == 1  # one group decision
    assert stored[0]["count"] == 16
    assert [s["published"] for s in stored].count(True) == 1  # the last writer publishes
    assert g.all("lookup", tokens=toks, req="r1", step=2) == [16] * tp
    loaded = [g.ask(r, "get_load", tokens=toks, req="r1", step=3) for r in range(tp)]
    expected = [g.ask(r, "digest", pages=list(range(16))) for r in range(tp)]
    assert [x["digest"] for x in loaded] == expected  # byte-exact per shard
    assert len({x["lease"] for x in loaded}) == 1
    # Evict: another group's chain fills the pool, then the first chain is refilled.
    other = list(range(5000, 5000 + 4 * 20))
    g.all("fill", pages=20, seed=2)
    for r in range(tp):
        g.ask(r, "store", tokens=other, req="r2", step=4)
    hit = g.ask(0, "lookup", tokens=toks)
    assert hit < 16  # evicted (LRU, leaves first)
    g.all("fill", pages=20, seed=1)
    for r in range(tp):
        g.ask(r, "store", tokens=toks, req="r3", step=5)
    loaded = [g.ask(r, "get_load", tokens=toks, req="r3", step=6) for r in range(tp)]
    assert [x["count"] for x in loaded] == [16] * tp
    assert [x["digest"] for x in loaded] == expected
    s = checked_stats(instance, lay)
    assert s["pool"]["staging"] == 0 and s["pool"]["pinned"] == 0 and s["leases"]["live"] == 0


def test_ranks_out_of_step_get_identical_decisions(sidecar_factory, instance, group_factory):
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4, tp_size=2)
    sidecar_factory(**layout_overrides(lay, num_blocks=32))
    g = group_factory(lay)
    g.all("fill", pages=16, seed=3)
    toks = list(range(40))  # 10 blocks
    a = g.ask(0, "store", tokens=toks[:24], req="q", step=1)  # rank 0 stores 6 blocks...
    assert a["published"] is False
    # rank 0 runs ahead: at step 2 it looks up while rank 1 has not even committed step 1
    r0 = g.ask(0, "lookup", tokens=toks, req="q", step=2)
    b = g.ask(1, "store", tokens=toks[:24], req="q", step=1)
    assert b["staging"] == a["staging"] and b["published"] is True
    r1 = g.ask(1, "lookup", tokens=toks, req="q", step=2)  # later, more is resident, same answer
    assert r0 == r1 == 0
    assert g.ask(1, "lookup", tokens=toks, req="q", step=3) == 6
    # rank 1 takes the step-4 GET first; rank 0 gets the identical lease later
    x1 = g.ask(1, "get_load", tokens=toks, req="q", step=4)
    g.all("fill", pages=16, seed=4)
    for r in range(2):
        g.ask(r, "store", tokens=toks, req="q", step=5)  # more blocks now resident
    x0 = g.ask(0, "get_load", tokens=toks, req="q", step=4)
    assert (x0["lease"], x0["count"], x0["blocks"]) == (x1["lease"], x1["count"], x1["blocks"])
    assert x0["count"] == 6
    s = checked_stats(instance, lay)
    assert s["decisions"]["replayed"] >= 4 and s["leases"]["live"] == 0


def test_kill9_rank_holding_leases_releases_them(sidecar_factory, instance, group_factory):
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4, tp_size=2)
    sidecar_factory(**layout_overrides(lay, num_blocks=32))
    g = group_factory(lay)
    g.all("fill", pages=16, seed=5)
    toks = list(range(32))
    for r in range(2):
        g.ask(r, "store", tokens=toks, req="k", step=1)
    held = g.ask(0, "get_load", tokens=toks, req="k", step=2, release=False)
    plain = g.ask(1, "get_load", tokens=toks, release=False)  # a plain lease owned by rank 1
    assert held["count"] == 8 and plain["count"] == 8
    s = checked_stats(instance, lay)
    assert s["pool"]["pinned"] == 8 and s["leases"]["live"] == 2
    os.kill(g.procs[1].pid, signal.SIGKILL)
    g.procs[1].join(5)
    s = wait_until(lambda: checked_stats(instance, lay), 10, "the killed rank's plain lease dropped",
                   until=lambda s: s["leases"]["live"] == 1)
    # rank 1's plain lease is gone; the group lease keeps rank 0's share only
    assert s["leases"]["live"] == 1 and s["pool"]["pinned"] == 8
    assert g.ask(0, "release", lease=held["lease"]) is True
    s = checked_stats(instance, lay)
    assert s["leases"]["live"] == 0 and s["pool"]["pinned"] == 0


def test_concurrent_groups_and_namespace_isolation(sidecar_factory, instance, group_factory):
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4, tp_size=2)
    sidecar_factory(**layout_overrides(lay, num_blocks=64))
    ga = group_factory(lay, group="A", namespace="tenant-a")
    gb = group_factory(lay, group="B", namespace="tenant-b")
    ga.all("fill", pages=16, seed=7)
    gb.all("fill", pages=16, seed=8)
    toks = list(range(64))  # the same tokens in both namespaces
    assert ga.ask(0, "chain", tokens=toks) != gb.ask(0, "chain", tokens=toks)
    for step in range(1, 4):  # interleave the two groups' operations
        for g, req in ((ga, "a"), (gb, "b")):
            for r in range(2):
                g.ask(r, "store", tokens=toks[:16 * step], req=req, step=step)
    assert ga.ask(0, "lookup", tokens=toks) == 12 and gb.ask(1, "lookup", tokens=toks) == 12
    la = [ga.ask(r, "get_load", tokens=toks, req="a", step=9) for r in range(2)]
    lb = [gb.ask(r, "get_load", tokens=toks, req="b", step=9) for r in range(2)]
    assert [x["digest"] for x in la] == [ga.ask(r, "digest", pages=list(range(12))) for r in range(2)]
    assert [x["digest"] for x in lb] == [gb.ask(r, "digest", pages=list(range(12))) for r in range(2)]
    assert set(la[0]["blocks"]).isdisjoint(lb[0]["blocks"])
    s = checked_stats(instance, lay)
    assert s["pool"]["resident"] == 24


def test_limits_refuse_cleanly(sidecar_factory, instance, group_factory):
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=4, tp_size=1)
    bb = lay.block_bytes
    sidecar_factory(**layout_overrides(lay, num_blocks=16, **{"limits.pinned_bytes_limit": 4 * bb,
                                                               "limits.reserved_bytes_limit": 6 * bb}))
    g = group_factory(lay)
    g.all("fill", pages=16, seed=9)
    toks = list(range(40))  # 10 blocks
    s = g.ask(0, "store", tokens=toks, commit=False)
    assert s["count"] == 6  # reserved limit caps the staging
    err = g.ask_err(0, "store", tokens=list(range(100, 140)))
    assert err[1] == ErrorCode.LIMIT  # nothing left to reserve: a clear refusal
    assert g.ask(0, "commit", staging=s["staging"]) is True
    err = g.ask_err(0, "get_load", tokens=toks)
    assert err[1] == ErrorCode.LIMIT  # 6 blocks would exceed the 4-block pin limit
    x = g.ask(0, "get_load", tokens=toks, max_blocks=4, release=False)
    assert x["count"] == 4
    g.ask(0, "release", lease=x["lease"])
    st = checked_stats(instance, lay)
    assert st["pool"]["staging"] == 0 and st["pool"]["pinned"] == 0 and st["pool"]["resident"] == 6


def test_bad_ids_foreign_leases_and_oversize_chains(sidecar_factory, instance):
    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=4, tp_size=1)
    sidecar_factory(**layout_overrides(lay, num_blocks=16))
    import torch

    a = KVConnector(instance, lay, group="A")
    b = KVConnector(instance, lay, group="B")
    a.attach()
    b.attach()
    chain = a.hasher.chain(list(range(16)))
    st = a.store(chain)
    kv = [(torch.ones(8, 4, 1, 8, dtype=torch.float16), torch.ones(8, 4, 1, 8, dtype=torch.float16))]
    a.save(st, kv, list(range(st.count)))
    with pytest.raises(RemoteError) as ei:
        b.commit(st)
    assert ei.value.code == ErrorCode.NOT_OWNER
    a.commit(st)
    lease = a.get(chain)
    for bad, code in ((lambda: b.release(lease), ErrorCode.NOT_OWNER),
                      (lambda: a.release(999), ErrorCode.UNKNOWN_ID),
                      (lambda: a.commit(st), ErrorCode.UNKNOWN_ID),
                      (lambda: a.client.call("get", chain=b"\0" * 16 * 9000), ErrorCode.TOO_LARGE),
                      (lambda: a.client.call("lookup", chain=b"\0" * 17), ErrorCode.MALFORMED)):
        try:
            with pytest.raises(RemoteError) as ei:
                bad()
        except Exception as exc:  # the client-side encoder may refuse first: also typed
            from kvsidecar.shm.errors import ProtocolError

            assert isinstance(exc, ProtocolError) and exc.code == code
            continue
        assert ei.value.code == code
    assert a.release(lease) is True and a.release(lease) is False
    a.detach()
    b.detach()
    checked_stats(instance, lay)


def test_layout_mismatch_names_the_field(sidecar_factory, instance):
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4, tp_size=1)
    sidecar_factory(**layout_overrides(lay, num_blocks=8))
    wrong = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=4, tp_size=1)
    with pytest.raises(RemoteError) as ei:
        KVConnector(instance, wrong).attach()
    assert ei.value.code == ErrorCode.LAYOUT_MISMATCH and "head_dim" in str(ei.value)
    with KVConnector(instance, lay) as ok:
        assert ok.lookup(ok.hasher.chain(range(8))) == 0
    with SidecarClient(instance) as observer:  # no layout: ping and stats only
        with pytest.raises(RemoteError) as ei:
            observer.call("lookup", chain=b"")
        assert ei.value.code == ErrorCode.NOT_ATTACHED


def test_concurrent_groups_with_skewed_ranks_agree_and_verify(sidecar_factory, instance, spawn_ctx):
    """2 groups x 2 ranks running at once, ranks skewed: identical decisions, exact data, no leaks."""
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4, tp_size=2)
    sidecar_factory(**layout_overrides(lay, num_blocks=64))  # small: evictions and refusals happen
    jobs = []
    for gi, group in enumerate(("G0", "G1")):
        for rank in range(2):
            a, b = spawn_ctx.Pipe()
            p = spawn_ctx.Process(target=procs.kv_stress_worker,
                                  args=(instance, lay.as_dict(), rank, group, 100 + gi, 40, 0.003, b))
            p.start()
            jobs.append((group, rank, a, p))
    for _, _, a, _ in jobs:
        assert a.poll(60) and a.recv() == "attached"
    for _, _, a, _ in jobs:
        a.send("go")
    results = {}
    for group, rank, a, p in jobs:
        assert a.poll(120), f"{group}/{rank} hung"
        results[(group, rank)] = a.recv()
        p.join(10)
        assert p.exitcode == 0
    for group in ("G0", "G1"):
        d0, bad0, lim0 = results[(group, 0)]
        d1, bad1, lim1 = results[(group, 1)]
        assert bad0 == 0 and bad1 == 0 and lim0 == lim1 < 40  # refusals are group decisions too
        assert d0 == d1  # every store and get decision identical across the group's ranks
        assert any(len(d) == 5 and d[4] > 0 for d in d0), d0
    s = checked_stats(instance, lay)
    assert s["leases"]["live"] == 0 and s["pool"]["staging"] == 0 and s["pool"]["pinned"] == 0
