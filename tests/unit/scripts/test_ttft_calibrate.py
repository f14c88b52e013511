"""The calibration's fixed costs, read from a real run's per-request timelines."""

import pytest

from scripts.ttft_calibrate import fixed_costs


def _req(i, prefill_end, stored=None, skew=0.2):
    t = {"entered": 0.2, "candidate": 0.3, "admit": 0.3, "got": 0.5, "loaded": 0.6, "prefill_start": 0.7,
         "prefill_end": prefill_end}
    if stored is not None:
        t["stored"] = stored
    return {"req": f"r{i}", "timeline": t, "events": [], "rank_skew_ms": skew}


def test_publish_latency_is_the_median_of_the_last_ranks_store_after_the_prefill():
    run = {"arms": {"no_prefetch": {"results": [_req(0, 100.0, 101.0), _req(1, 100.0, 103.0), _req(2, 50.0, 52.0)]},
                    "cost_aware": {"results": [_req(3, 80.0, 90.0)]}}}
    assert fixed_costs(run, "no_prefetch")["publish_s"] == pytest.approx(0.002)
    assert fixed_costs(run, "cost_aware")["publish_s"] == pytest.approx(0.010)  # the arm's own when it has any
    assert fixed_costs(run)["publish_s"] == pytest.approx(0.0025)  # all arms
    old = {"arms": {"no_prefetch": {"results": [_req(0, 100.0)]}}}  # a table from before it was measured
    assert fixed_costs(old, "no_prefetch")["publish_s"] == 0.0
