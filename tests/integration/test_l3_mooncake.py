"""Real Mooncake Store (a real mooncake_master and real clients over TCP on 127.0.0.1)."""

from __future__ import annotations

import time

import pytest
import torch

from kvsidecar.connector.kv_client import KVConnector
from kvsidecar.shm.errors import ErrorCode, RemoteError
from kvsidecar.shm.layout import KVLayout
from kvsidecar.sidecar.spawn import SidecarProcess

from ..helpers import store_to_l3, wait_l3_idle, wait_terminal
from ..waiting import wait_read_held, wait_until

pytestmark = pytest.mark.mooncake

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, tokens_per_block=8, tp_size=1)


def mc_overrides(master, **extra):
    d = {f"layout.{k}": v for k, v in LAY.as_dict().items()}
    d.update({"pool.num_blocks": 64, "l3.backend": "mooncake", "l3.mooncake_master": master.address,
              "l3.mooncake_global_segment_bytes": 32 << 20, "l3.mooncake_local_buffer_bytes": 8 << 20})
    d.update(extra)
    return d


@pytest.fixture
def node_pair(instance, mooncake_master):
    """Two sidecars ("nodes") with distinct segment names on one Mooncake cluster."""
    started = []

    def start(name, **extra):
        sp = SidecarProcess(f"{instance}{name}", overrides=mc_overrides(mooncake_master, **extra))
        started.append(sp)
        return sp

    yield start
    for sp in started:
        assert sp.stop(timeout_s=15) in (0, -9)
    import os

    for name in os.listdir("/dev/shm"):  # segments of the nodes the test killed
        if name.startswith(instance):
            os.unlink(os.path.join("/dev/shm", name))


def kv_data(n=12):
    return [tuple(torch.randn(n, 8, 2, 32).half() for _ in range(2)) for _ in range(2)]


def store_l3(instance, kv, tokens):
    with KVConnector(instance, LAY) as c:
        return store_to_l3(c, kv, tokens)[1]


def test_node_a_stores_node_b_restores_byte_exact(node_pair, instance):
    a = node_pair("a")
    b = node_pair("b")
    kv = kv_data()
    tokens = list(range(8 * 12))
    s = store_l3(a.instance, kv, tokens)
    assert s["counters"]["l3_published_blocks"] == 12
    with KVConnector(b.instance, LAY) as c:
        chain = c.hasher.chain(tokens)
        assert c.lookup(chain) == 0
        r = c.restore(chain)
        assert r["restored"] == 12 and r["l3_hits"] == 12
        lease = c.get(chain)
        out = [tuple(torch.zeros_like(t) for t in layer) for layer in kv]
        c.load(lease, out, list(range(lease.count)))
        c.release(lease)
        assert all(torch.equal(x, y) for lx, ly in zip(kv, out) for x, y in zip(lx, ly))
        st = c.stats(check=True)
        assert st["invariants"] == "" and st["l3"]["backend"]["backend"] == "mooncake"
        # another namespace does not see node A's blocks
        other = KVConnector(b.instance, LAY, namespace="other")
        other.attach()
        assert other.restore(other.hasher.chain(tokens))["l3_hits"] == 0
        other.detach()


def _restore_async(c, chain):
    return c.client.send("restore", chain=chain)


def test_holder_killed_mid_transfer_fails_cleanly(node_pair, instance, read_gate):
    a = node_pair("a")
    # B contributes no memory to the cluster, so every object lives on A;
    # B's reads are held at its read gate until A is dead
    b = node_pair("b", **{"l3.mooncake_global_segment_bytes": 0}, **read_gate.overrides())
    kv = kv_data()
    tokens = list(range(8 * 12))
    store_l3(a.instance, kv, tokens)
    with KVConnector(b.instance, LAY) as c:
        chain = c.hasher.chain(tokens)
        rid = _restore_async(c, chain)
        wait_read_held(c)
        a.kill()  # the node holding the objects dies while B's transfer is pending
        read_gate.open()
        r = c.client.wait(rid, timeout_s=20)
        assert r["ok"] and r["restored"] == 0 and r["failed"] == 12
        assert c.lookup(chain) == 0  # nothing corrupt was published
        assert c.client.call("ping")["ok"]
        st = c.stats(check=True)
        assert st["invariants"] == "" and st["pool"]["staging"] == 0 and st["pool"]["resident"] == 0
        assert any(k.startswith("err_") for k in st["l3"]["backend"])


def test_master_killed_mid_transfer_sidecar_keeps_serving(node_pair, instance, mooncake_master, read_gate):
    a = node_pair("a")
    b = node_pair("b", **read_gate.overrides())  # B's reads are held until the master is dead
    kv = kv_data()
    tokens = list(range(8 * 12))
    store_l3(a.instance, kv, tokens)
    with KVConnector(b.instance, LAY) as c:
        chain = c.hasher.chain(tokens)
        rid = _restore_async(c, chain)
        wait_read_held(c)
        mooncake_master.kill()
        read_gate.open()
        r = c.client.wait(rid, timeout_s=20)
        assert r["ok"] and r["resident"] == r["restored"]
        # whatever landed is intact: compare what was published
        lease = c.get(chain)
        out = [tuple(torch.zeros_like(t) for t in layer) for layer in kv]
        c.load(lease, out, list(range(lease.count)))
        c.release(lease)
        n = lease.count
        assert all(torch.equal(x[:n], y[:n]) for lx, ly in zip(kv, out) for x, y in zip(lx, ly))
        # the sidecar still answers everything, and L3 failures are per block, not fatal
        assert c.client.call("ping")["ok"]
        r2 = c.restore(c.hasher.chain(list(range(1000, 1000 + 8 * 4))))
        assert r2["restored"] == 0
        st = c.stats(check=True)
        assert st["invariants"] == "" and st["pool"]["staging"] == 0
        # the master comes back on the same port: the sidecar is still serving, nothing broke
        from kvsidecar.sidecar.l3.master import MooncakeMaster

        again = MooncakeMaster(rpc_port=mooncake_master.rpc_port)
        try:
            assert c.client.call("ping")["ok"]
            r3 = c.restore(c.hasher.chain(list(range(2000, 2000 + 8 * 4))))
            assert r3["restored"] == 0  # a new master knows no objects: a clean miss
            st = c.stats(check=True)
            assert st["invariants"] == "" and st["pool"]["staging"] == 0
        finally:
            again.stop()
    a.kill()


def test_unreachable_master_is_a_clear_startup_error(instance, timing):
    from kvsidecar.sidecar.l3.master import free_port
    from kvsidecar.sidecar.spawn import SidecarStartError

    d = {f"layout.{k}": v for k, v in LAY.as_dict().items()}
    d.update({"l3.backend": "mooncake", "l3.mooncake_master": f"127.0.0.1:{free_port()}",
              "l3.setup_timeout_s": 1.0})
    t0 = time.monotonic()
    with pytest.raises(SidecarStartError, match="exit code 2"):
        SidecarProcess(instance, overrides=d, start_timeout_s=20)
    timing.within(t0, 10, "a refused start (setup_timeout_s = 1)")


def test_store_accounting_counts_only_written_blocks(node_pair, instance, mooncake_master):
    b = node_pair("b")
    kv = kv_data()
    mooncake_master.kill()  # every PUT now fails
    with KVConnector(b.instance, LAY) as c:
        chain = c.hasher.chain(list(range(8 * 4)))
        st = c.store(chain, l3=True)
        c.save(st, kv, list(range(st.count)))
        c.commit(st)
        wait_l3_idle(c)
        s = c.stats(check=True)
        assert s["counters"].get("l3_published_blocks", 0) == 0
        assert s["counters"]["l3_put_failed_blocks"] == 4
        assert c.lookup(chain) == 4  # still resident in the CPU pool
        with pytest.raises(RemoteError) as ei:
            c.client.call("release", lease=5)
        assert ei.value.code == ErrorCode.UNKNOWN_ID


def test_sessions_against_real_mooncake(node_pair, instance, read_gate):
    """Deadline-cut, full and best-effort sessions reading from a real Mooncake cluster."""
    a = node_pair("a")
    b = node_pair("b", **{"l3.mooncake_global_segment_bytes": 0, "sessions.drain_timeout_s": 10.0},
                  **read_gate.overrides())
    kv = kv_data(40)
    tokens = list(range(8 * 40))
    store_l3(a.instance, kv, tokens)
    with KVConnector(b.instance, LAY) as c:
        chain = c.hasher.chain(tokens)
        c.prefetch(chain, "short", policy="timeout", budget_s=0.2, chunk_max_blocks=4)
        # the deadline cuts the session while its first chunk's read is held in flight: it
        # drains that chunk, and the rest is never read (not a race with a 20 ms budget)
        wait_read_held(c)
        wait_until(lambda: c.poll("short")["state"], 10, "the deadline sealing 'short'",
                   until=lambda s: s == "draining")
        read_gate.open()
        p = wait_terminal(c, "short")
        assert p["status"] == "timeout" and 0 < p["prefix"] < 40
        c.prefetch(chain, "long", policy="timeout", budget_s=30.0, chunk_max_blocks=8)
        p = wait_terminal(c, "long")
        assert p["status"] == "complete" and p["prefix"] == 40
        lease = c.get(chain, req="long", step=1)
        out = [tuple(torch.zeros_like(t) for t in layer) for layer in kv]
        c.load(lease, out, list(range(lease.count)))
        c.release(lease)
        assert all(torch.equal(x, y) for lx, ly in zip(kv, out) for x, y in zip(lx, ly))
        c.abort("short")
        st = c.stats(check=True)
        assert st["invariants"] == "" and st["pool"]["staging"] == 0 and st["leases"]["live"] == 0


def test_every_sidecar_measures_the_cluster_at_start(node_pair, instance):
    """The tier's calibration at start (scratch objects written from the sidecar's own mapping)
    and read back measures a real Mooncake cluster: the estimate rests on two reads before any request, and a
    second node (the same calibration keys already in the cluster) measures it too."""
    for name in ("a", "b"):
        node_pair(name)
        with KVConnector(f"{instance}{name}", LAY) as c:
            l3 = wait_until(lambda: c.stats()["l3"], 15.0, f"node {name}'s calibration",
                            until=lambda l3: l3["cost"]["samples"] >= 2 or "calibration_failed" in l3)
            assert "calibration_failed" not in l3 and l3["cost"]["samples"] == 2, l3
            assert 0 < l3["cost"]["s_per_block_us"] < 10_000, l3["cost"]  # (the prior: 1,638 us)
