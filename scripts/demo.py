#!/usr/bin/env python3
"""The main job: kvsidecar on its embedded defaults beside a simulated TP=2 engine.

Runs the engine simulator's short workload (16K-token shared prefixes restored from a warm L3
into a cold CPU pool) under each prefetch policy arm, prints a table per arm, and the
inspector's read-only view of the sidecar at the end.  L3 is a real local Mooncake cluster
when Mooncake is installed, else the embedded file store.

    python -m scripts.demo [--l3 file|mooncake|auto]   (from the repo root)
"""

from __future__ import annotations

import argparse
import logging
import os
import time

from sidecar import inspector

if __package__:  # python -m scripts.demo, from the repo root
    from . import simulate
else:  # python scripts/demo.py: this folder is first on sys.path
    import simulate


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--l3", choices=["file", "mooncake", "auto"], default="auto")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    l3 = args.l3
    if l3 == "auto":
        l3 = "mooncake" if simulate.mooncake_available() else "file"
    t0 = time.time()
    print(f"kvsidecar demo: TP=2 engine simulator, L3 = {l3}"
          f"{' (local mooncake_master on 127.0.0.1, a holder node plus the serving node)' if l3 == 'mooncake' else ' (embedded file store)'}")
    print("warming L3 with the workload's prompts, then one cold-pool run per policy arm ...")
    views = []

    def inspect(instance: str) -> None:
        time.sleep(0.15)  # let the sidecar publish its stats blob
        views.append(inspector.render(inspector.snapshot(instance)))

    res = simulate.simulate(True, budget_s=0.25, l3=l3, before_stop=inspect)
    simulate.print_table(res)
    print("\nper-arm detail:")
    for arm, a in res["arms"].items():
        s = a["sessions"]
        print(f"  {arm:<18} sessions {s.get('by_state', {})}, terminal "
              f"{ {k[9:]: v for k, v in s.items() if k.startswith('terminal_')} }, "
              f"books {'balanced' if a['invariants'] == '' else a['invariants']}")
    if views:
        print("\ninspector view of the last arm's sidecar (read-only):")
        print(views[-1])
    print(f"\ndone in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
