"""Plots for the issue-22 table (``--plot FILE.png``): per row, the TTFT distribution (CDF) of
every arm beside the serial bound and the overlap oracle, and each arm's mean TTFT split by
phase (stacked bars: enter, queue, own prefetch, GET, copy, prefill) beside the bound's parts.

Uses the first trial's per-request results (a table keeps every trial's; older ones kept only the first's).
"""

from __future__ import annotations

from scripts.ttft_bounds import PHASES


def plot(out: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = out["rows"]
    fig, axes = plt.subplots(len(rows), 2, figsize=(13, 3.2 * len(rows)), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, row in enumerate(rows):
        run = row["timeline_trial"]
        cdf, bars = axes[i][0], axes[i][1]
        for j, (arm, a) in enumerate(run["arms"].items()):
            xs = sorted(r["ttft_ms"] for r in a.get("results", ()))
            if xs:
                cdf.step(xs, [(k + 1) / len(xs) for k in range(len(xs))], where="post", label=arm,
                         color=colors[j % len(colors)])
        for name, style in (("serial", "k--"), ("oracle", "k:")):
            xs = sorted(run.get("bounds_ms", {}).get(name, ()))
            if xs:
                cdf.plot(xs, [(k + 1) / len(xs) for k in range(len(xs))], style, label=f"{name} bound")
        cdf.set_xscale("log")
        cdf.set_xlabel("TTFT (ms)")
        cdf.set_ylabel("CDF")
        cdf.set_title(f"{row['name']} (measured L3/prefill {run['rates']['ratio']:.2f})", fontsize=9)
        cdf.legend(fontsize=6, loc="lower right")
        names = [a for a in run["arms"] if run["arms"][a].get("gap")]
        bottom = [0.0] * (len(names) + 1)
        for k, ph in enumerate(PHASES):
            vals = [run["arms"][a]["gap"]["measured"][ph] for a in names]
            first = run["arms"][names[0]]["gap"]["bound"] if names else {}
            vals.append(first.get(ph, 0.0))
            bars.bar(range(len(vals)), vals, bottom=bottom, label=ph, color=colors[k % len(colors)])
            bottom = [b + v for b, v in zip(bottom, vals)]
        bars.set_xticks(range(len(names) + 1))
        bars.set_xticklabels(names + ["bound"], fontsize=7, rotation=20)
        bars.set_ylabel("mean ms per request")
        bars.legend(fontsize=6, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
