"""scripts.ttft_seeds: cost_aware's standing over several draws of a table row's stream."""

import math

import pytest

from scripts import ttft_seeds


def test_ratios_are_cost_aware_over_the_best_other_arm_at_each_percentile():
    ttfts = {"cost_aware": [10.0] * 9 + [100.0], "no_prefetch": [20.0] * 10,
             "best_effort": [5.0] * 9 + [200.0]}
    p50, p90 = ttft_seeds.ratios(ttfts)
    assert p50 == pytest.approx(10.0 / 5.0)  # best other p50: best_effort
    assert p90 == pytest.approx(ttft_seeds.ttft_bounds._pct(ttfts["cost_aware"], 0.9) / 20.0)  # no_prefetch


def test_a_row_is_replayed_once_per_seed_with_its_measured_rates():
    row = {"name": "r1-idle-tp2", "tp": 2, "load": 0.0, "timeline_trial": {"arms": {}},
           "aggregate": {"rates": {"compute_s_per_block": {"median": 0.003}, "copy_s_per_block": 1e-5,
                                   "l3_s_per_block": 0.003, "l3_latency_s": 0.001}, "arms": {}}}
    out = ttft_seeds.row_robustness(row, requests=8, seeds=[1, 2])
    assert out["seeds"] == [1, 2] and len(out["p50_ratio"]) == len(out["p90_ratio"]) == 2
    assert all(math.isfinite(x) and x > 0 for x in out["p50_ratio"] + out["p90_ratio"])
    assert out["met"] == (out["p50_median"] <= ttft_seeds.SLACK and out["p90_median"] <= ttft_seeds.SLACK)
    # another seed is another stream: the same seed twice gives the same figures (deterministic)
    again = ttft_seeds.row_robustness(row, requests=8, seeds=[1])
    assert again["p50_ratio"][0] == out["p50_ratio"][0] and again["p90_ratio"][0] == out["p90_ratio"][0]
