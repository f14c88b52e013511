"""Soak: sustained churn by several client processes against one sidecar (see ``soak.py``).

Default suite: >= 10^5 evictions (a few seconds).  Slow: >= 10^6 evictions, with the latency
and memory figures the product promises (p99 in the last tenth <= 1.5x the first, RSS +-5 %).
"""

from __future__ import annotations

import pytest

from kvsidecar.connector.client import SidecarClient

from . import soak


def _soak(sidecar_factory, instance, tmp_path, evictions: int) -> dict:
    sp = sidecar_factory(**soak.sidecar_overrides(str(tmp_path / "l3")))
    obs = SidecarClient(instance, group="observer")
    obs.attach()
    try:
        result = soak.run(instance, str(tmp_path), target_evictions=evictions, workers=3,
                          sidecar_pid_of=sp.pid, observer=obs, max_s=1800)
    finally:
        obs.detach()
    print("\n" + soak.table(result))
    assert sp.stop() == 0  # books balanced at shutdown too (exit 3 otherwise)
    # answers kept coming, nothing wrong was ever loaded, nothing leaked
    assert result["reported"] == 3
    assert result["evictions"] >= evictions
    assert result["bad_bytes"] == 0
    assert not result["errors"], result["errors"]
    assert result["invariants"] == ""
    assert result["leases_live"] == 0 and result["pool"]["pinned"] == 0 and result["pool"]["staging"] == 0
    assert result["counts"]["prefetch"] > 0 and result["counts"]["loaded_blocks"] > 0
    # every policy ran, cost_aware with its engine inputs and demands (its estimate, explorations)
    assert all(result["sessions"].get(f"started_{p}", 0) > 0
               for p in ("timeout", "best_effort", "wait_complete", "cost_aware")), result["sessions"]
    return result


def test_soak_bounded(sidecar_factory, instance, tmp_path):
    r = _soak(sidecar_factory, instance, tmp_path, 100_000)
    # An O(n) degradation (the old tombstone table) shows as 10x and more against the first
    # tenth (5x and more against the median of the first three); this bound only catches that on
    # a noisy shared machine.  The reference is the median of the first three tenths: in the
    # first one L3 holds nothing yet, so no read lands beside a GET, and its p99 alone swung
    # 0.17-4.0 ms between runs of the same code (a get ratio of 12.8 in one CI run, 0.3-0.7 in
    # others).  The slow run checks the real 1.5x target against the first tenth.
    assert soak.p99_ratio(r, "store", 3) < 4.0 and soak.p99_ratio(r, "get", 3) < 4.0
    assert r["rss_end_kib"] <= 1.10 * r["rss_warm_kib"]


@pytest.mark.slow
def test_soak_one_million_evictions(sidecar_factory, instance, tmp_path):
    r = _soak(sidecar_factory, instance, tmp_path, 1_000_000)
    assert soak.p99_ratio(r, "store") <= 1.5 and soak.p99_ratio(r, "get") <= 1.5
    assert abs(r["rss_end_kib"] - r["rss_warm_kib"]) <= 0.05 * r["rss_warm_kib"]
