"""The calibration's fixed costs, read from a real run's per-request timelines."""

import pytest

from scripts.ttft_calibrate import fixed_costs


def _req(i, prefill_end, stored=None, skew=0.2):
    t = {"entered": 0.2, "candidate": 0.3, "admit": 0.3, "got": 0.5, "loaded": 0.6, "prefill_start": 0.7,
         "prefill_end": prefill_end}
    if stored is not None:
        t["stored"] = stored
    return {"req": f"r{i}", "timeline": t, "events": [], "rank_skew_ms": skew}


def test_publish_latency_is_the_mean_of_the_last_ranks_store_after_the_prefill():
    run = {"arms": {"no_prefetch": {"results": [_req(0, 100.0, 101.0), _req(1, 100.0, 103.0), _req(2, 50.0, 52.0)]},
                    "cost_aware": {"results": [_req(3, 80.0, 90.0)]}}}
    assert fixed_costs(run, "no_prefetch")["publish_s"] == pytest.approx(0.002)
    assert fixed_costs(run, "cost_aware")["publish_s"] == pytest.approx(0.010)  # the arm's own when it has any
    assert fixed_costs(run)["publish_s"] == pytest.approx(0.004)  # all arms: 1, 3, 2, 10 ms
    old = {"arms": {"no_prefetch": {"results": [_req(0, 100.0)]}}}  # a table from before it was measured
    assert fixed_costs(old, "no_prefetch")["publish_s"] == 0.0


def test_session_creation_lane_pickup_and_scan_are_read_from_the_events():
    """create_s: entered -> created; pickup_s: a read claimed beside the query counts from the
    session's creation, one claimed after the answer from its claim (a lane busy for 2 ms or more
    is not a pick-up); scan_s: a first-scan admission's answer from its session's creation."""
    def req(i, events, t):
        return {"req": f"r{i}", "timeline": {"entered": 0.5, "candidate": 1.5, "admit": 1.5, "got": 1.5,
                                             "loaded": 1.6, "prefill_start": 1.6, "prefill_end": 2.0, **t},
                "events": events, "rank_skew_ms": 0.0}
    with_query = [["created", 0.7, 32], ["claim", 0.9, [0, 32, 2, 2]], ["query", 2.5, 2],
                  ["read", 4.7, [0, 2, 0.0035]]]  # the read started at 1.2: 0.5 after creation
    after_query = [["created", 0.6, 32], ["query", 2.0, 2], ["claim", 2.1, [0, 32, 2, 2]],
                   ["read", 5.4, [0, 2, 0.003]]]  # started at 2.4: 0.3 after its claim
    queued = [["created", 0.6, 32], ["claim", 0.7, [0, 32, 2, 2]], ["read", 9.0, [0, 2, 0.003]]]  # 5.3 late
    run = {"arms": {"cost_aware": {"results": [req(0, with_query, {}), req(1, after_query, {}), req(2, queued, {}),
                                               req(3, [["created", 0.9, 32], ["terminal", 1.0, ["cost", 32]]], {})]}}}
    f = fixed_costs(run, "cost_aware")
    assert f["create_s"] == pytest.approx(0.0002)  # mean of 0.2, 0.1, 0.1, 0.4 ms
    assert f["pickup_s"] == pytest.approx(0.0004)  # mean of 0.5 and 0.3 ms (the queued read is left out)
    assert f["scan_s"] == pytest.approx(0.0008)  # candidate 1.5 less creation: 0.8, 0.9, 0.9, 0.6 ms


def test_cost_samples_are_the_control_paths_under_their_simulator_names():
    from scripts.ttft_calibrate import JITTERED, cost_samples

    events = [["created", 0.7, 32], ["claim", 0.9, [0, 32, 2, 2]], ["query", 2.5, 2], ["read", 4.7, [0, 2, 0.0035]]]
    run = {"arms": {"cost_aware": {"results": [
        {"req": "r0", "events": events, "rank_skew_ms": 0.3,
         "timeline": {"entered": 0.5, "candidate": 1.5, "admit": 1.5, "got": 1.5, "loaded": 1.6,
                      "prefill_start": 1.6, "prefill_end": 2.0}}]}}}
    got = dict(cost_samples(run, "cost_aware"))
    assert got["create_s"] == pytest.approx((0.0002,)) and got["meta_latency_s"] == pytest.approx((0.0018,))
    assert got["lane_pickup_s"] == pytest.approx((0.0005,))
    assert got["skew_s"] == pytest.approx((0.0003,))  # the group's skew: two-valued, drawn
    assert "scan_s" not in got and "turnaround_s" not in got  # the engine loop's costs stay constants
    assert set(JITTERED) >= {"query_s", "create_s", "pickup_s", "skew_s"}


def _timed(req, admit, prefill_end, stored, entered=0.2, candidate=None):
    """A request's timeline (ms from its own arrival) with its first scan at ``candidate``."""
    cand = admit if candidate is None else candidate
    return {"req": req, "events": [], "rank_skew_ms": 0.0,
            "timeline": {"entered": entered, "candidate": cand, "admit": admit, "got": admit, "loaded": admit,
                         "prefill_start": admit, "prefill_end": prefill_end, "stored": stored}}


def test_a_skewed_cost_is_paid_at_its_mean_not_its_median():
    """What loads the engine's queue is the mean service time: three 0.5 ms completions and one
    that lost the CPU for 3.5 ms cost the engine 1.25 ms each on average, not the median 0.5."""
    arrivals = {f"r{i}": i * 0.1 for i in range(4)}
    reqs = []
    for i, late in enumerate((0.5, 0.5, 3.5, 0.5)):
        reqs.append(_timed(f"r{i}", admit=0.5, prefill_end=4.0, stored=4.0 + late))
    run = {"arms": {"no_prefetch": {"results": reqs}}}
    assert fixed_costs(run, "no_prefetch", arrivals)["publish_s"] == pytest.approx(0.00125)


def test_with_arrivals_a_first_scan_after_a_busy_engine_is_not_a_scan_sample():
    """r1 entered while r0's prefill ran (no scan then): its first scan came 4 ms later, the
    engine's busy time, not a round trip; r2 entered at an idle engine: its 0.6 ms is one."""
    arrivals = {"r0": 0.0, "r1": 0.001, "r2": 0.100}
    run = {"arms": {"no_prefetch": {"results": [
        _timed("r0", admit=0.5, prefill_end=4.0, stored=4.5),
        _timed("r1", admit=4.2, prefill_end=8.0, stored=8.5),  # (ms from its arrival, 1 ms after r0's)
        _timed("r2", admit=0.8, prefill_end=5.0, stored=5.5)]}}}
    assert fixed_costs(run, "no_prefetch", arrivals)["scan_s"] == pytest.approx(0.00045)  # r0 0.3, r2 0.6
    assert fixed_costs(run, "no_prefetch")["scan_s"] == pytest.approx(0.0049 / 3)  # without arrivals: r1's 4.0 kept


def test_with_arrivals_publish_is_measured_on_the_completions_a_queued_request_waited_for():
    """r0's completion held r1 (queued when r0's prefill ended): its 1 ms is the sample; r1's 6 ms
    (nothing queued behind it) is not, as it held no scan."""
    arrivals = {"r0": 0.0, "r1": 0.001, "r2": 0.100}
    run = {"arms": {"no_prefetch": {"results": [
        _timed("r0", admit=0.5, prefill_end=4.0, stored=5.0),
        _timed("r1", admit=4.5, prefill_end=8.0, stored=14.0),  # (admitted 1.5 ms after r0 ended)
        _timed("r2", admit=0.8, prefill_end=5.0, stored=5.5)]}}}
    assert fixed_costs(run, "no_prefetch", arrivals)["publish_s"] == pytest.approx(0.001)
    assert fixed_costs(run, "no_prefetch", arrivals)["turnaround_s"] == pytest.approx(0.0015 - 0.00045)  # less the scan
    assert fixed_costs(run, "no_prefetch")["publish_s"] == pytest.approx(0.0025)  # every prefill: 1, 6, 0.5 ms


def test_with_arrivals_the_skew_of_a_queued_admission_is_its_own_sample():
    """The ranks come to a request queued behind the prefill that just ended in step: its skew
    (r1's 0.1 ms) is ``skew_queued_s``; ``skew_s`` is every admission's (0.8, 0.1, 0.9 ms: 0.6)."""
    arrivals = {"r0": 0.0, "r1": 0.001, "r2": 0.100}
    reqs = [_timed("r0", admit=0.5, prefill_end=4.0, stored=5.0), _timed("r1", admit=4.5, prefill_end=8.0, stored=9.0),
            _timed("r2", admit=0.8, prefill_end=5.0, stored=5.5)]
    for r, skew in zip(reqs, (0.8, 0.1, 0.9)):
        r["rank_skew_ms"] = skew
    run = {"arms": {"no_prefetch": {"results": reqs}}}
    got = fixed_costs(run, "no_prefetch", arrivals)
    assert got["skew_queued_s"] == pytest.approx(0.0001) and got["skew_s"] == pytest.approx(0.0006)
    assert fixed_costs(run, "no_prefetch")["skew_queued_s"] is None  # (without arrivals: not known; skew_s is used)


def test_with_arrivals_and_nothing_ever_queued_publish_is_every_prefills():
    """An idle row: no prefill had a request queued behind it, so publish_s is every prefill's."""
    arrivals = {"r0": 0.0, "r1": 0.100}
    run = {"arms": {"no_prefetch": {"results": [_timed("r0", admit=0.5, prefill_end=4.0, stored=5.0),
                                                _timed("r1", admit=0.5, prefill_end=4.0, stored=7.0)]}}}
    assert fixed_costs(run, "no_prefetch", arrivals)["publish_s"] == pytest.approx(0.002)  # mean of 1 and 3 ms


def test_every_timed_trial_is_replayed_with_its_own_rates():
    """A table that kept every trial's timelines: each trial is replayed with its own rates, and the
    virtual p50 is the median over trials.  A trial whose prefill was twice as dear predicts a
    dearer no_prefetch; the median over (1x, 1x, 2x) is the 1x trials'."""
    from scripts.ttft_calibrate import timed_trials, virtual_row, virtual_ttfts

    def trial(c):
        return {"arms": {}, "rates": {"compute_s_per_block": c, "copy_s_per_block": 1e-5,
                                      "l3_s_per_block": c, "l3_latency_s": 0.001}}
    arms = {a: {"ttft_p50_ms": {"median": 100.0}} for a in ("no_prefetch", "whole_task", "timeout_short",
                                                             "timeout_long", "best_effort", "cost_aware")}
    row = {"name": "r1-idle-tp2", "tp": 2, "load": 0.0, "timeline_trial": trial(0.003),
           "more_trials": [trial(0.003), trial(0.006)],
           "aggregate": {"rates": {"compute_s_per_block": {"median": 0.003}, "copy_s_per_block": 1e-5,
                                   "l3_s_per_block": 0.003, "l3_latency_s": 0.001}, "arms": arms}}
    assert len(timed_trials(row)) == 3 and len(timed_trials({"timeline_trial": trial(0.003)})) == 1
    from scripts.ttft_bounds import _pct

    one = _pct(virtual_ttfts(row, 8, trial=0)["no_prefetch"], 0.5)
    dear = _pct(virtual_ttfts(row, 8, trial=2)["no_prefetch"], 0.5)
    assert dear > 1.5 * one
    assert _pct(virtual_ttfts(row, 8, trial=1)["no_prefetch"], 0.5) == one
    assert virtual_row(row, 8)["no_prefetch"]["virtual_p50_ms"] == one  # the median over the three trials


def test_the_real_runs_own_a_a_error_is_the_twins_p50_over_cost_awares():
    """``--twin`` tables: the twin's median p50 over cost_aware's, the same trials; None without a
    twin (or a zero p50), so older tables print as before."""
    from scripts.ttft_calibrate import real_aa

    def row(arms):
        return {"aggregate": {"arms": {a: {"ttft_p50_ms": {"median": v}} for a, v in arms.items()}}}
    assert real_aa(row({"cost_aware": 10.0, "cost_aware_twin": 11.4})) == pytest.approx(1.14)
    assert real_aa(row({"cost_aware": 10.0, "no_prefetch": 9.0})) is None
    assert real_aa(row({"cost_aware": 0.0, "cost_aware_twin": 3.0})) is None


def _prefills(skew_ms):
    """Two recomputing requests of a modelled 3.125 ms a block, each ending ``skew_ms`` late on its
    slowest rank, and a pool hit (no block recomputed: not a prefill sample)."""
    return {"no_prefetch": {"results": [
        {"recomputed_tokens": 128, "prefill_ms": 6.25 + skew_ms, "rank_skew_ms": skew_ms, "restored_tokens": 0},
        {"recomputed_tokens": 640, "prefill_ms": 31.25 + skew_ms, "rank_skew_ms": skew_ms, "restored_tokens": 0},
        {"recomputed_tokens": 32, "prefill_ms": 1.0, "rank_skew_ms": 0.0, "restored_tokens": 2048}]}}


def test_the_prefill_rate_leaves_the_groups_rank_skew_out():
    """The skew is a cost per request (the virtual model adds it per admission): in the rate too it
    was paid twice, and spread per block.  No recomputed block: None."""
    from scripts.ttft_bounds import prefill_rate

    assert prefill_rate(_prefills(0.7), 64) == pytest.approx(3.125e-3)
    assert prefill_rate(_prefills(0.0), 64) == pytest.approx(3.125e-3)
    assert prefill_rate({"a": {"results": [{"recomputed_tokens": 32, "prefill_ms": 1.0}]}}, 64) is None


def test_a_trial_is_replayed_with_the_prefill_rate_its_requests_measured():
    """A table's stored rate included the skew (3.3 ms a block here): the replay takes the rate
    from the trial's own requests (3.125), the same as a table whose stored rate was right."""
    from scripts.ttft_calibrate import virtual_ttfts

    def row(stored_c):
        t = {"arms": _prefills(0.7), "rates": {"compute_s_per_block": stored_c, "copy_s_per_block": 1e-5,
                                                "l3_s_per_block": 0.003, "l3_latency_s": 0.001}}
        arms = {a: {"ttft_p50_ms": {"median": 100.0}} for a in ("no_prefetch", "cost_aware")}
        return {"name": "r1-idle-tp2", "tp": 2, "load": 0.0, "timeline_trial": t, "more_trials": [],
                "aggregate": {"rates": {"compute_s_per_block": {"median": stored_c}, "copy_s_per_block": 1e-5,
                                        "l3_s_per_block": 0.003, "l3_latency_s": 0.001}, "arms": arms}}
    for trial in (None, 0):
        inflated = virtual_ttfts(row(3.3e-3), 8, trial=trial, jitter=False)["no_prefetch"]
        assert inflated == virtual_ttfts(row(3.125e-3), 8, trial=trial, jitter=False)["no_prefetch"]
