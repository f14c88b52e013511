"""kvsidecar benchmarks: each suite prints a table and writes JSON, with its baseline
measured in the same run (ratios; these machines are noisy), repeated over interleaved trials:
every figure is the median of the trials with its spread ``[min..max]``.

    python -m scripts.bench ring    [--quick] [--trials N] [--json PATH]
    python -m scripts.bench load|l3|stop [--quick] [--trials N]
    python -m scripts.bench startup [--quick] [--trials N]   # pool ready time, first vs second pass, exits
    python -m scripts.bench metrics [--quick]   # Prometheus on vs off: ring RTT, get+release of 512
    python -m scripts.bench integrity [--quick] # block checksums on vs off: store, L3 restore, load
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging

from scripts import trials as trials_mod
from scripts.common import write_json

SUITES = {
    "ring": "bench_ring",
    "load": "bench_load",
    "l3": "bench_l3",
    "stop": "bench_stop",
    "startup": "bench_startup",
    "metrics": "bench_metrics",
    "integrity": "bench_integrity",
}
REPEATS_ITSELF = {"startup", "metrics"}  # their own interleaved trials (medians with [min-max])


def print_table(title: str, rows: list[tuple[str, object, str]]) -> None:
    print(f"\n{title}")
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        print(f"  {name:<{width}}  {trials_mod.fmt(value):>30}  {note}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--quick", action="store_true", help="fewer samples (CI-sized)")
    p.add_argument("--json", help="write results to this path")
    p.add_argument("--trials", type=int, help="interleaved repetitions (default 5, 3 with --quick)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    module = importlib.import_module(f"scripts.{SUITES[args.suite]}")
    if args.suite in REPEATS_ITSELF:  # their repetitions are their trials (--trials, where they take it)
        kw = {"trials": args.trials} if args.trials and "trials" in inspect.signature(module.run).parameters else {}
        result = module.run(quick=args.quick, **kw)
        t = result.get("trials", 1)
        n = len(t) if isinstance(t, list) else t
    else:
        n = args.trials or (3 if args.quick else 5)
        result = trials_mod.aggregate(trials_mod.repeat(module.run, n, quick=args.quick))
        result["trials"] = n
    title = f"kvsidecar bench: {args.suite}{' (quick)' if args.quick else ''}, median [min..max] of {n} trials"
    print_table(title, module.table(result))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
