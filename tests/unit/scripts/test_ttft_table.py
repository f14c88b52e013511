"""The real-process table's verdicts (``scripts.ttft_table``): the medians of per-trial figures and
the same targets on every request's figures with intervals over trials (pure parts; the table
itself takes ~15 minutes: ``python -m scripts.simulate --table``)."""

import pytest

from scripts import trials as trials_mod
from scripts.ttft_table import P50_VS_OTHERS, TABLE_ARMS, pooled_verdict, verdict


def _run(scale: float, cost_aware: list, bound: list) -> dict:
    base = [10.0 * scale] * 9 + [50.0 * scale]
    arms = {a: {"ttft_ms": list(base)} for a in TABLE_ARMS}
    arms["cost_aware"]["ttft_ms"] = [x * scale for x in cost_aware]
    for a in arms.values():
        xs = sorted(a["ttft_ms"])
        a["ttft_p50_ms"], a["ttft_p90_ms"] = xs[5], xs[9]
    return {"arms": arms, "bounds_ms": {"serial": [x * scale for x in bound]},
            "serial_bound": {"ttft_p50_ms": sorted(bound)[5] * scale, "ttft_p90_ms": sorted(bound)[9] * scale}}


def _agg(runs):
    strip = [{"arms": {a: {k: v for k, v in d.items() if k != "ttft_ms"} for a, d in r["arms"].items()},
              "serial_bound": r["serial_bound"]} for r in runs]
    return trials_mod.aggregate(strip)


def test_every_request_verdict_meets_when_cost_aware_matches_the_best_arm():
    runs = [_run(s, [10.0] * 9 + [50.0], [9.5] * 9 + [45.0]) for s in (1.0, 1.2, 0.9)]
    v = verdict(_agg(runs))
    p = pooled_verdict(runs, v["timeout_arm"], reps=300)
    assert v["met"] and p["met"] and p["met_ci"]
    assert p["p50"]["vs_others"] == pytest.approx(1.0) and p["p50"]["vs_bound"] == pytest.approx(10 / 9.5, abs=1e-3)
    assert p["p90"]["cost_aware"] == pytest.approx(50.0 * 0.9)  # nearest rank 27 of 30: the fastest trial's tail


def test_every_request_verdict_misses_a_slower_cost_aware_and_reports_its_interval():
    runs = [_run(s, [10.5] * 9 + [50.0], [10.0] * 10) for s in (1.0, 1.1, 0.95)]
    p = pooled_verdict(runs, "timeout_short", reps=300)
    assert p["p50"]["vs_others"] == pytest.approx(1.05) and p["p50"]["vs_others"] > P50_VS_OTHERS
    assert not p["met"] and not p["met_ci"]
    lo, hi = p["p50"]["vs_others_ci90"]
    assert lo == pytest.approx(1.05) and hi == pytest.approx(1.05)  # 5 % slower in every trial: every resample too
    assert pooled_verdict([{"arms": {}, "bounds_ms": {"serial": []}}], "timeout_short") == {}


def test_the_twin_is_reported_beside_the_verdict_and_never_judged(capsys):
    from scripts.ttft_table import TWIN, print_summary

    runs = [_run(s, [10.0] * 9 + [50.0], [9.5] * 9 + [45.0]) for s in (1.0, 1.2, 0.9)]
    alone = verdict(_agg(runs))
    for r in runs:  # the twin: 20 % slower at p50, as fast at p90, in every trial
        xs = [12.0 * (r["arms"]["no_prefetch"]["ttft_p50_ms"] / 10.0)] * 9 + [r["arms"]["no_prefetch"]["ttft_p90_ms"]]
        r["arms"][TWIN] = {"ttft_ms": xs, "ttft_p50_ms": sorted(xs)[5], "ttft_p90_ms": sorted(xs)[9]}
    v = verdict(_agg(runs))
    assert v["met"] == alone["met"] and v["arms"] == alone["arms"]  # not among the others, not judged
    assert v["p50_vs_others"] == alone["p50_vs_others"] and v["p90_vs_others"] == alone["p90_vs_others"]
    assert v["twin"] == {"p50_vs_others": 1.2, "p50_vs_cost_aware": 1.2, "p90_vs_others": 1.0, "p90_vs_cost_aware": 1.0}
    assert "twin" not in alone
    agg = _agg(runs)
    row = {"name": "r", "l3_mbps": 100.0, "aggregate": dict(agg, rates={"ratio": [1.0]}, oracle=agg["serial_bound"]), "verdict": v,
           "pooled": {}, "timeline_trial": {"arms": {}}}
    print_summary({"requests": 10, "trials": 3, "wall_s": 1.0, "rows": [row]})
    out = capsys.readouterr().out
    assert "A/A cost_aware_twin" in out and "1.200x best other, 1.200x cost_aware" in out
    assert "A/A: the twin (cost_aware again) within 1.03x the best other arm at p50 and p90 on 0 of 1 rows" in out
