"""Repeated trials for benchmarks: run a measurement several times and report, for every numeric
figure, the median with its spread (min, max, and the spread relative to the median).

A benchmark's ``run()`` measures its arm and its baseline inside one call, so repeating the
call interleaves them (arm, baseline, arm, baseline, ...): a slow phase of a noisy machine lands
on both instead of on one.  One sample is not a figure; the median of several, with how far the
samples spread, is.
"""

from __future__ import annotations

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
