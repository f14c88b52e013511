"""Repeated trials for benchmarks: run a measurement several times and report, for every numeric
figure, the median with its spread (min, max, and the spread relative to the median).

A benchmark's ``run()`` measures its arm and its baseline inside one call, so repeating the
call interleaves them (arm, baseline, arm, baseline, ...): a slow phase of a noisy machine lands
on both instead of on one.  One sample is not a figure; the median of several, with how far the
samples spread, is.
"""

from __future__ import annotations

import random
import statistics


def repeat(run, trials: int, **kw) -> list:
    """``trials`` results of ``run(**kw)``, in order."""
    if trials < 1:
        raise ValueError("trials must be >= 1")
    return [run(**kw) for _ in range(trials)]


def aggregate(samples: list) -> dict:
    """Merge results of the same shape: each number becomes {median, min, max, spread, n};
    booleans must agree in every trial (else the list of values); other leaves come from the
    first trial; nested dicts are merged recursively."""
    first = samples[0]
    if isinstance(first, dict):
        return {k: aggregate([s[k] for s in samples if isinstance(s, dict) and k in s]) for k in first}
    if isinstance(first, bool):
        return first if all(s is first for s in samples) else list(samples)
    if isinstance(first, (int, float)):
        xs = [float(s) for s in samples]
        med = statistics.median(xs)
        return {"median": med, "min": min(xs), "max": max(xs), "n": len(xs),
                "spread": (max(xs) - min(xs)) / abs(med) if med else 0.0}
    return first


def median(v):
    """The median of an aggregated figure (or the value itself)."""
    return v["median"] if isinstance(v, dict) and "median" in v else v


def fmt(v, digits: int = 3) -> str:
    """``median [min..max]`` of an aggregated figure (or the plain value)."""
    if isinstance(v, dict) and "median" in v:
        if v["n"] == 1:
            return f"{v['median']:.{digits}f}"
        return f"{v['median']:.{digits}f} [{v['min']:.{digits}f}..{v['max']:.{digits}f}]"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def pooled_ratio(arms: dict, num: str, dens: tuple, quantile, *, reps: int = 2000, seed: int = 0,
                 level: float = 0.90) -> dict | None:
    """An arm's quantile over **every request of every trial** against the best of ``dens``, with a
    bootstrap over trials.

    ``arms``: name -> per-trial lists of samples, trial ``k`` of every arm measured together
    (interleaved), so a resample draws the same trials for every arm.  ``quantile(xs)`` maps the
    pooled samples to the figure (a p50, a p90).  Returns ``{num, best, ratio, ci: [lo, hi], n_trials,
    n}`` (``best``: min over ``dens`` of their pooled figure; ``ci``: the ``level`` interval of the
    ratio over ``reps`` resamples of the trials, seeded: the same input gives the same interval),
    or None unless ``num`` and at least one of ``dens`` have the same number of trials (> 0).

    Why: a trial's p50 over a few dozen requests from a bimodal distribution (hits and misses)
    jumps between the modes; the figure over every request is the arm's own quantile, and the
    bootstrap says how far the trials' drift and the sample size leave it uncertain."""
    own = arms.get(num)
    others = [arms[d] for d in dens if d in arms and len(arms[d]) == len(own or ())]
    if not own or not others:
        return None

    def ratio(ks):
        pick = lambda trials: [x for k in ks for x in trials[k]]  # noqa: E731
        mine = quantile(pick(own))
        best = min(quantile(pick(o)) for o in others)
        return mine, best, mine / best if best > 0 else float("inf")

    n = len(own)
    mine, best, point = ratio(range(n))
    rng = random.Random(seed)
    boots = sorted(ratio([rng.randrange(n) for _ in range(n)])[2] for _ in range(reps))
    lo = boots[int((1 - level) / 2 * (reps - 1))]
    hi = boots[int((1 + level) / 2 * (reps - 1))]
    return {num: mine, "best": best, "ratio": point, "ci": [lo, hi], "level": level, "n_trials": n,
            "n": sum(len(t) for t in own)}
