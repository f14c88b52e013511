"""The real-process TTFT benchmark (scripts.simulate), quick: TP=2 rank processes, a real
sidecar, a warm shaped file L3, Poisson arrivals; per-request timelines joined with the
sessions' own events, bounds from the rates the run achieved, and the gap breakdown."""

from __future__ import annotations

from scripts import simulate
from scripts.ttft_bounds import PHASES


def test_quick_real_process_run_has_timelines_bounds_and_exact_data():
    res = simulate.simulate(True, l3_mbps=400.0, arms=["no_prefetch", "cost_aware"], prefix_tokens=1024,
                            requests=8, load=0.9, compute_ms_per_ktok=25.0, n_prefixes=3, pool_blocks=64,
                            l3_latency_ms=1.0, timeline=True)
    for arm, a in res["arms"].items():
        assert a["corrupt"] == 0 and a["ranks_agree"] and a["invariants"] == "", (arm, a)
        assert a["requests"] == 8 and a["leases_live"] == 0
        # every restored page of every rank was checked, after the timed loop (none in the run)
        T = simulate.make_layout(2).tokens_per_block
        assert a["checked_pages"] == 2 * a["restored_tokens"] // T and a["checked_in_run"] == 0, (arm, a)
        for r in a["results"]:
            t = r["timeline"]
            order = [t["entered"], t["admit"], t["got"], t["loaded"], t["prefill_start"], t["prefill_end"]]
            assert order == sorted(order), (arm, t)
            assert abs(t["prefill_end"] - r["ttft_ms"]) < 1e-3 * max(1.0, r["ttft_ms"])
            assert t["stored"] >= t["prefill_end"] and abs(r["stored_ms"] - t["stored"]) < 1e-3  # every rank's commit
        g = a["gap"]
        assert g["n"] == 8 and set(g["gap"]) == set(PHASES)
    ca = res["arms"]["cost_aware"]["results"]
    names = {e[0] for r in ca for e in r["events"]}
    assert {"created", "terminal"} <= names  # the session's own events came back with poll
    # (the poll is sent ahead of the commit, not waited for: every answer was still read)
    assert all(r["status"] not in ("none", "unknown") and r["events"] for r in ca)
    assert all(not r["events"] for r in res["arms"]["no_prefetch"]["results"])
    rates = res["rates"]
    assert rates["compute_s_per_block"] > 0 and rates["l3_s_per_block"] > 0
    assert res["oracle"]["ttft_mean_ms"] <= res["serial_bound"]["ttft_mean_ms"] + 1e-9
    assert len(res["bounds_ms"]["serial"]) == 8
