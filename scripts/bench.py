#!/usr/bin/env python3
"""kvsidecar benchmarks: each suite prints a table and writes JSON, with its baseline
measured in the same run (ratios; these machines are noisy).

    python scripts/bench.py ring  [--quick] [--json PATH]
    python scripts/bench.py startup [--quick]   # pool ready time, first vs second pass, exits
    python scripts/bench.py metrics [--quick]   # Prometheus on vs off: ring RTT, get+release of 512
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
from pathlib import Path

SUITES = {
    "ring": "bench_ring",
    "load": "bench_load",
    "l3": "bench_l3",
    "stop": "bench_stop",
    "startup": "bench_startup",
    "metrics": "bench_metrics",
}


def print_table(title: str, rows: list[tuple[str, object, str]]) -> None:
    print(f"\n{title}")
    width = max(len(r[0]) for r in rows)
    for name, value, note in rows:
        v = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"  {name:<{width}}  {v:>14}  {note}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--quick", action="store_true", help="fewer samples (CI-sized)")
    p.add_argument("--json", help="write results to this path")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    # a sibling module: ``python scripts/bench.py`` has this folder first on sys.path,
    # ``python -m scripts.bench`` (from the repo root) has the ``scripts`` package
    module = importlib.import_module(f".{SUITES[args.suite]}", __package__) if __package__ \
        else importlib.import_module(SUITES[args.suite])
    result = module.run(quick=args.quick)
    print_table(f"kvsidecar bench: {args.suite}{' (quick)' if args.quick else ''}", module.table(result))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2, sort_keys=True))
        print(f"\nJSON written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
