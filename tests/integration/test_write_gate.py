"""The write-behind gate on a real sidecar (file-store L3 shaped slow, real rings, real pool):
stores are kept in the pool only while a block reads in more than ``l3.write_behind_max_ratio``
times the prefill the engine reported (counted; bytes still served from the pool), the tier is
re-measured while it is paused, writing resumes when the ratio falls (the next store lands in L3
and restores from it byte for byte), and ``write_behind_max_ratio = 0`` writes regardless."""

from __future__ import annotations

import pytest
import torch

from kvsidecar.connector.kv_client import KVConnector
from kvsidecar.shm.layout import KVLayout

from ..helpers import file_l3_overrides, small_kv, wait_l3_idle, wait_terminal
from ..waiting import wait_until
from .test_metrics import METRICS_ON, metrics_port, scrape, value

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=4, tp_size=1)
N = 8
SLOW = {"l3.bandwidth_mbps": 8.0}  # a 1 KiB block in ~1 ms: ~100x the 10 us prefill reported below


def overrides(tmp_path, **extra):
    return file_l3_overrides(tmp_path, LAY, 160, **{**SLOW, **extra})


def books(c):
    s = c.stats(check=True)
    assert s["invariants"] == "", s["invariants"]
    assert s["pool"]["staging"] == 0 and s["pool"]["pinned"] == 0 and s["leases"]["live"] == 0, s
    return s


def store(c, kv, base: int) -> bytes:
    chain = c.hasher.chain(list(range(base, base + 4 * N)))
    st = c.store(chain, l3=True)
    c.save(st, kv, list(range(st.count)))
    c.commit(st)
    return chain


def read_back(c, chain, kv) -> int:
    lease = c.get(chain, req=f"check-{chain[:4].hex()}", step=1)
    out = [tuple(torch.zeros_like(t) for t in layer) for layer in kv]
    c.load(lease, out, list(range(lease.count)))
    c.release(lease)
    assert lease.count == N
    assert all(torch.equal(a, b) for la, lb in zip(kv, out) for a, b in zip(la, lb))
    return lease.count


def engine_reports(c, prefill_s_per_block: float, req: str) -> None:
    """A cost_aware session that carries the engine's prefill cost (for a chain L3 does not hold)."""
    c.prefetch(c.hasher.chain(list(range(900_000, 900_000 + 4 * N))), req, policy="cost_aware", eta_s=1.0,
               prefill_s_per_block=prefill_s_per_block)
    wait_terminal(c, req)


def calibrated(c, runs: int) -> dict:
    """Stats once ``runs`` calibrations have read (two reads each) and none is running."""
    return wait_until(c.stats, 20.0, f"{runs} L3 calibration(s)",
                      until=lambda s: s["l3"]["cost"]["samples"] >= 2 * runs and not s["l3"]["puts_in_flight"])


def test_a_slow_l3_is_not_written_behind_remeasured_while_paused_and_written_again_when_it_pays(
        sidecar_factory, instance, tmp_path):
    sidecar_factory(**overrides(tmp_path, **{"l3.recalibrate_s": 0.05, **METRICS_ON}))
    port = metrics_port(instance)
    kv = small_kv(N)
    with KVConnector(instance, LAY) as c:
        s = calibrated(c, 1)
        assert s["l3"]["write_gate"] == {"open": True, "max_ratio": 10.0, "ratio": None, "prefill_ms_per_block": 0.0,
                                         "closed_s": 0.0, "paused_s": 0.0, "closings": 0, "remeasures": 0}
        engine_reports(c, 1e-5, "e1")
        a = store(c, kv, 0)
        s = books(c)
        gate = s["l3"]["write_gate"]
        assert gate["open"] is False and gate["closings"] == 1 and gate["ratio"] > 10, gate
        assert s["counters"]["l3_put_gated_blocks"] == N and s["counters"].get("l3_published_blocks", 0) == 0
        assert s["l3"]["puts_in_flight"] == 0 and s["store"]["published_blocks"] == N
        assert read_back(c, a, kv) == N  # in the pool, byte for byte
        m = scrape(port)
        assert value(m, "kvsidecar_l3_write_behind_open") == 0
        assert value(m, "kvsidecar_l3_put_blocks_total", result="gated") == N
        assert value(m, "kvsidecar_l3_put_blocks_total", result="published") == 0

        # paused: a refused store past recalibrate_s measures the tier again (the write lane is idle)
        base = [1000]

        def refused_until_remeasured():
            store(c, kv, base[0])
            base[0] += 1000
            return c.stats()["l3"]["write_gate"]["remeasures"]

        wait_until(refused_until_remeasured, 20.0, "a re-measurement while paused", until=lambda n: n >= 1)
        s = calibrated(c, 2)
        assert s["l3"]["write_gate"]["open"] is False  # still ~100x: still paused
        assert s["counters"].get("l3_published_blocks", 0) == 0
        assert s["counters"]["l3_put_gated_blocks"] == N * (1 + (base[0] - 1000) // 1000)
        assert "calibration_failed" not in s["l3"]

        # an engine whose prefill is dear (L3 now ~0.01x it): the next store is written behind
        engine_reports(c, 0.1, "e2")
        b = store(c, kv, 500_000)
        s = wait_l3_idle(c)
        assert s["l3"]["write_gate"]["open"] is True and s["counters"]["l3_published_blocks"] == N
        assert value(scrape(port), "kvsidecar_l3_write_behind_open") == 1
        books(c)
        c.flush()
        assert c.restore(b)["restored"] == N  # it is in L3: restored into the emptied pool
        assert read_back(c, b, kv) == N
        assert c.restore(a)["restored"] == 0  # the paused one never reached L3
        books(c)


def test_write_behind_max_ratio_zero_writes_every_store(sidecar_factory, instance, tmp_path):
    sidecar_factory(**overrides(tmp_path, **{"l3.write_behind_max_ratio": 0.0}))
    kv = small_kv(N)
    with KVConnector(instance, LAY) as c:
        calibrated(c, 1)
        engine_reports(c, 1e-5, "e1")
        a = store(c, kv, 0)
        s = wait_l3_idle(c)
        assert s["counters"]["l3_published_blocks"] == N and "l3_put_gated_blocks" not in s["counters"]
        assert s["l3"]["write_gate"]["open"] is True and s["l3"]["write_gate"]["ratio"] > 10
        c.flush()
        assert c.restore(a)["restored"] == N
        assert read_back(c, a, kv) == N
        books(c)


@pytest.mark.parametrize("bad", ["-1", "nan"])
def test_a_bad_bound_is_refused_at_start(tmp_path, bad):
    from kvsidecar.sidecar.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="write_behind_max_ratio"):
        load_config(None, overrides={"l3.write_behind_max_ratio": bad})
