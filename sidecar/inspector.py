"""Read-only view of a running sidecar: header, clients, ring depths, published stats.

    kvsidecar-inspect [--instance NAME] [--json] [--watch SECONDS]
    python scripts/inspect_shm.py [--instance NAME] [--json] [--watch SECONDS]

It maps the control segment read-only and never sends a request, so it cannot
disturb the sidecar or its clients.  It imports ``shm`` only (no client, no
connector), so nothing here can attach or post.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from shm.control import SLOT_NAMES, STATE_NAMES, ControlSegment, process_start_ticks
from shm.errors import SegmentError
from shm.segment import Segment


def snapshot(instance: str) -> dict:
    seg = Segment.attach(f"/{instance}.ctl", readonly=True)
    try:
        ctl = ControlSegment(seg)
        pid = ctl.sidecar_pid
        alive = process_start_ticks(pid) == ctl.sidecar_start_ticks
        slots = []
        for i in range(ctl.num_slots):
            cpid, state = ctl.slot_state(i)
            if state == 0:
                continue
            sub = ctl.submit_consumer(i)
            comp = ctl.completion_consumer(i)
            slots.append({"slot": i, "pid": cpid, "state": SLOT_NAMES.get(state, str(state)),
                          "submit_depth": sub.depth(), "completion_depth": comp.depth()})
        return {
            "instance": ctl.instance, "generation": ctl.generation, "sidecar_pid": pid,
            "sidecar_alive": alive, "state": STATE_NAMES.get(ctl.state, str(ctl.state)),
            "num_slots": ctl.num_slots, "ring_bytes": ctl.ring_capacity, "pool": ctl.pool_name,
            "slots": slots, "stats": ctl.read_stats(),
        }
    finally:
        seg.close()


def render(s: dict) -> str:
    lines = [
        f"sidecar {s['instance']}  pid {s['sidecar_pid']} ({'alive' if s['sidecar_alive'] else 'DEAD'})"
        f"  state {s['state']}  generation {s['generation']}",
        f"slots {len(s['slots'])}/{s['num_slots']} in use, ring {s['ring_bytes']} B, pool {s['pool'] or '-'}",
        "",
        f"{'slot':>4} {'pid':>8} {'state':<10} {'group':<16} {'rank':>4} {'requests':>9} {'errors':>6}"
        f" {'submit B':>9} {'compl B':>8}",
    ]
    by_slot = {c["slot"]: c for c in s["stats"].get("clients", [])}
    for sl in s["slots"]:
        c = by_slot.get(sl["slot"], {})
        lines.append(f"{sl['slot']:>4} {sl['pid']:>8} {sl['state']:<10} {c.get('group', ''):<16}"
                     f" {c.get('rank', ''):>4} {c.get('requests', ''):>9} {c.get('errors', ''):>6}"
                     f" {sl['submit_depth']:>9} {sl['completion_depth']:>8}")
    for section in ("pool", "leases", "sessions", "l3"):
        if section in s["stats"]:
            lines += ["", f"{section}:"]
            for k, v in sorted(s["stats"][section].items()):
                lines.append(f"  {k:<28} {v}")
    counters = s["stats"].get("counters", {})
    if counters:
        lines += ["", "counters:"]
        for k, v in sorted(counters.items()):
            lines.append(f"  {k:<28} {v}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instance", default="kvsidecar")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS")
    args = p.parse_args(argv)
    while True:
        try:
            snap = snapshot(args.instance)
        except SegmentError as exc:
            print(f"no sidecar {args.instance!r}: {exc}", file=sys.stderr)
            return 1
        if args.json:
            print(json.dumps(snap, indent=2, sort_keys=True, default=str))
        else:
            if args.watch:
                print("\033[2J\033[H", end="")
            print(render(snap))
        if not args.watch:
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:  # Ctrl-C ends a watch
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
