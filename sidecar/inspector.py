"""Read-only view of a running sidecar: sessions, leases, pool by state, clients.

    kvsidecar-inspect [--instance NAME] [--json] [--watch SECONDS]
    python -m kvsidecar.sidecar.inspector [--instance NAME] [--json] [--watch SECONDS]

It maps the control segment read-only and never sends a request, so it cannot disturb the
sidecar or its clients.  It imports ``shm`` only (no client, no connector), so nothing here can
attach or post.  What it shows of sessions, leases and the pool is what the sidecar's control
thread published into the segment's seqlocked stats blob (``kvsidecar.shm.control``: at most every
``transport.stats_interval_ms`` after work); slots and ring depths are read live.

``--watch`` redraws in place (plain ANSI: cursor home, clear to end of line / screen) until
Ctrl-C; a sidecar that goes away is shown as such and picked up again when it comes back.

JSON schema (``--json``), version 1 — ``SCHEMA`` below is the machine-readable form::

    schema            "kvsidecar.inspect/1"
    taken_at          unix seconds when this view was read
    sidecar           {instance, generation, pid, alive, state, num_slots, ring_bytes, pool_segment,
                       slots_in_use, slot_exhaustions}   (attaches refused because every slot was taken)
    published_age_s   seconds since the sidecar published the tables (null: nothing published yet)
    sessions          {total, rows: [{session, request, group, policy, state, status, published,
                       target, total, age_s, demanded}]}   (at most 48 rows: the running sessions
                       oldest first, then the newest terminal ones)
    leases            {total, rows: [{lease, kind, owner, blocks, age_s, ttl_s}]}  (ttl_s -1: none)
    pool              {blocks, block_bytes, by_state: {free, staging, resident_pinned,
                       resident_unpinned}, reserved_bytes, reserved_limit_bytes, pinned_bytes,
                       pinned_limit_bytes} or null (no KV pool)
    clients           [{slot, pid, state, group, rank, submit_depth, completion_depth, requests,
                       requests_per_s}]   (requests_per_s: since the previous view under --watch,
                       else since the client connected)
    slots_by_pid      [{pid, slots, active, claimed}]   (biggest holder first; read live)
    counters          {name: int}, the sidecar's own counters
    stats             the whole published stats blob (every service's stats; free-form, for
                      debugging: only its being an object is part of the schema)

Ages are as of ``taken_at``.  A new field may be added within a version; a field is never
removed or changes meaning without a new version.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvsidecar.shm.control import SLOT_ACTIVE, SLOT_CLAIMED, SLOT_NAMES, STATE_NAMES, ControlSegment, process_start_ticks
from kvsidecar.shm.errors import SegmentError
from kvsidecar.shm.segment import Segment

SCHEMA_VERSION = 1
SCHEMA_ID = f"kvsidecar.inspect/{SCHEMA_VERSION}"

_num = {"type": "number"}
_int = {"type": "integer"}
_str = {"type": "string"}
_bool = {"type": "boolean"}


def _obj(props: dict) -> dict:
    return {"type": "object", "required": sorted(props), "properties": props}


def _table(row: dict) -> dict:
    return _obj({"total": _int, "rows": {"type": "array", "items": _obj(row)}})


# JSON Schema (the draft 2020-12 subset: type, required, properties, items, const, oneOf)
SCHEMA = {
    "$id": SCHEMA_ID,
    **_obj({
        "schema": {"const": SCHEMA_ID},
        "taken_at": _num,
        "sidecar": _obj({"instance": _str, "generation": _int, "pid": _int, "alive": _bool, "state": _str,
                         "num_slots": _int, "ring_bytes": _int, "pool_segment": _str, "slots_in_use": _int,
                         "slot_exhaustions": _int}),
        "published_age_s": {"type": ["number", "null"]},
        "sessions": _table({"session": _int, "request": _str, "group": _str, "policy": _str, "state": _str,
                            "status": _str, "published": _int, "target": _int, "total": _int, "age_s": _num,
                            "demanded": _bool}),
        "leases": _table({"lease": _int, "kind": _str, "owner": _str, "blocks": _int, "age_s": _num,
                          "ttl_s": _num}),
        "pool": {"type": ["object", "null"]},
        "clients": {"type": "array", "items": _obj({
            "slot": _int, "pid": _int, "state": _str, "group": _str, "rank": _int, "submit_depth": _int,
            "completion_depth": _int, "requests": _int, "requests_per_s": _num})},
        "slots_by_pid": {"type": "array", "items": _obj({"pid": _int, "slots": _int, "active": _int,
                                                         "claimed": _int})},
        "counters": {"type": "object"},
        "stats": {"type": "object"},
    }),
}
POOL_SCHEMA = _obj({"blocks": _int, "block_bytes": _int, "reserved_bytes": _int, "reserved_limit_bytes": _int,
                    "pinned_bytes": _int, "pinned_limit_bytes": _int,
                    "by_state": _obj({"free": _int, "staging": _int, "resident_pinned": _int,
                                      "resident_unpinned": _int})})
SCHEMA["properties"]["pool"] = {"oneOf": [{"type": "null"}, POOL_SCHEMA]}


def snapshot(instance: str, previous: dict | None = None) -> dict:
    """One read-only view (the ``--json`` document).  ``previous``: the last view, for rates."""
    seg = Segment.attach(f"/{instance}.ctl", readonly=True)
    try:
        ctl = ControlSegment(seg)
        taken = time.time()
        pid = ctl.sidecar_pid
        stats = ctl.read_stats()
        status = stats.get("status", {})
        published = status.get("published_at")
        lag = max(taken - published, 0.0) if published else None
        by_slot = {c["slot"]: c for c in status.get("clients", [])}
        before = {c["slot"]: c for c in (previous or {}).get("clients", [])} if previous else {}
        dt = taken - previous["taken_at"] if previous else 0.0
        clients = []
        per_pid: dict[int, dict] = {}
        for i in range(ctl.num_slots):
            cpid, state = ctl.slot_state(i)
            if state == 0:
                continue
            held = per_pid.setdefault(cpid, {"pid": cpid, "slots": 0, "active": 0, "claimed": 0})
            held["slots"] += 1
            if state in (SLOT_ACTIVE, SLOT_CLAIMED):
                held["active" if state == SLOT_ACTIVE else "claimed"] += 1
            c = by_slot.get(i, {})
            requests = int(c.get("requests", 0))
            prev = before.get(i)
            if prev is not None and prev["pid"] == cpid and dt > 0:
                rate = max(requests - prev["requests"], 0) / dt
            else:
                age = c.get("connected_s", 0.0) + (lag or 0.0)
                rate = requests / age if age > 0 else 0.0
            clients.append({"slot": i, "pid": cpid, "state": SLOT_NAMES.get(state, str(state)),
                            "group": c.get("group", ""), "rank": int(c.get("rank", -1)),
                            "submit_depth": ctl.submit_consumer(i).depth(),
                            "completion_depth": ctl.completion_consumer(i).depth(),
                            "requests": requests, "requests_per_s": round(rate, 1)})
        return {
            "schema": SCHEMA_ID,
            "taken_at": taken,
            "sidecar": {"instance": ctl.instance, "generation": ctl.generation, "pid": pid,
                        "alive": bool(pid) and process_start_ticks(pid) == ctl.sidecar_start_ticks,
                        "state": STATE_NAMES.get(ctl.state, str(ctl.state)), "num_slots": ctl.num_slots,
                        "ring_bytes": ctl.ring_capacity, "pool_segment": ctl.pool_name,
                        "slots_in_use": len(clients), "slot_exhaustions": ctl.slot_exhaustions},
            "published_age_s": round(lag, 3) if lag is not None else None,
            "sessions": _aged(status.get("sessions"), lag),
            "leases": _aged(status.get("leases"), lag),
            "pool": status.get("pool"),
            "clients": clients,
            "slots_by_pid": sorted(per_pid.values(), key=lambda h: (-h["slots"], h["pid"])),
            "counters": dict(stats.get("counters", {})),
            "stats": {k: v for k, v in stats.items() if k != "status"},
        }
    finally:
        seg.close()


def _aged(table: dict | None, lag: float | None) -> dict:
    """A published table with ages brought forward to now (ttl_s counted down)."""
    if not table:
        return {"total": 0, "rows": []}
    rows = []
    for r in table.get("rows", []):
        r = dict(r)
        r["age_s"] = round(r["age_s"] + (lag or 0.0), 3)
        if "ttl_s" in r and r["ttl_s"] >= 0:
            r["ttl_s"] = round(max(r["ttl_s"] - (lag or 0.0), 0.0), 3)
        rows.append(r)
    return {"total": int(table.get("total", len(rows))), "rows": rows}


def _bar(n: int, total: int, width: int = 30) -> str:
    fill = round(width * n / total) if total else 0
    return "#" * fill + "." * (width - fill)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def render(s: dict) -> str:
    sc = s["sidecar"]
    age = s["published_age_s"]
    lines = [
        f"sidecar {sc['instance']}  pid {sc['pid']} ({'alive' if sc['alive'] else 'DEAD'})  state {sc['state']}"
        f"  generation {sc['generation']}  tables {'not published yet' if age is None else f'{age:.1f} s old'}",
        "",
    ]
    sess = s["sessions"]
    lines.append(f"SESSIONS ({sess['total']})")
    if sess["rows"]:
        lines.append(f"  {'request':<18} {'group':<16} {'policy':<14} {'state':<9} {'status':<9}"
                     f" {'published/target':>17} {'age s':>7} demanded")
        for r in sess["rows"]:
            lines.append(f"  {r['request'][:18]:<18} {r['group'][:16]:<16} {r['policy']:<14} {r['state']:<9}"
                         f" {r['status'] or '-':<9} {str(r['published']) + '/' + str(r['target']):>17}"
                         f" {r['age_s']:>7.1f} {'yes' if r['demanded'] else 'no'}")
        if sess["total"] > len(sess["rows"]):
            lines.append(f"  ... {sess['total'] - len(sess['rows'])} more")
    else:
        lines.append("  (no sessions)")
    leases = s["leases"]
    lines += ["", f"LEASES ({leases['total']})"]
    if leases["rows"]:
        lines.append(f"  {'lease':>14} {'kind':<16} {'owner':<24} {'blocks':>7} {'age s':>7} {'ttl s':>7}")
        for r in leases["rows"]:
            ttl = "-" if r["ttl_s"] < 0 else f"{r['ttl_s']:.1f}"
            lines.append(f"  {r['lease']:>14} {r['kind']:<16} {r['owner'][:24]:<24} {r['blocks']:>7}"
                         f" {r['age_s']:>7.1f} {ttl:>7}")
        if leases["total"] > len(leases["rows"]):
            lines.append(f"  ... {leases['total'] - len(leases['rows'])} more")
    else:
        lines.append("  (no leases)")
    pool = s["pool"]
    lines += ["", "POOL"]
    if pool:
        total = pool["blocks"]
        for state, n in pool["by_state"].items():
            lines.append(f"  {state:<18} {_bar(n, total)} {n:>7} ({100 * n / total if total else 0:5.1f}%)")
        lines.append(f"  reserved {_mib(pool['reserved_bytes'])} of {_mib(pool['reserved_limit_bytes'])},"
                     f" pinned {_mib(pool['pinned_bytes'])} of {_mib(pool['pinned_limit_bytes'])},"
                     f" {total} blocks of {pool['block_bytes']} B")
    else:
        lines.append("  (not published)")
    lines += ["", f"CLIENTS ({len(s['clients'])} of {sc['num_slots']} slots, ring {sc['ring_bytes']} B)"]
    if s["clients"]:
        lines.append(f"  {'slot':>4} {'pid':>8} {'state':<9} {'group':<16} {'rank':>4} {'submit B':>9}"
                     f" {'compl B':>8} {'requests':>9} {'req/s':>8}")
        for c in s["clients"]:
            lines.append(f"  {c['slot']:>4} {c['pid']:>8} {c['state']:<9} {c['group'][:16]:<16} {c['rank']:>4}"
                         f" {c['submit_depth']:>9} {c['completion_depth']:>8} {c['requests']:>9}"
                         f" {c['requests_per_s']:>8.1f}")
    else:
        lines.append("  (no clients)")
    lines += ["", f"SLOTS BY PID ({sc['slots_in_use']} of {sc['num_slots']} in use,"
                  f" {sc['slot_exhaustions']} attaches refused for want of a slot)"]
    if s["slots_by_pid"]:
        lines.append(f"  {'pid':>8} {'slots':>6} {'active':>7} {'claimed':>8}")
        for h in s["slots_by_pid"]:
            lines.append(f"  {h['pid']:>8} {h['slots']:>6} {h['active']:>7} {h['claimed']:>8}")
    else:
        lines.append("  (none)")
    return "\n".join(lines)


def _watch(instance: str, every: float, out) -> int:
    out.write("\033[2J")
    previous = None
    try:
        while True:
            try:
                view = snapshot(instance, previous)
                text = render(view)
                previous = view
            except SegmentError as exc:
                text, previous = f"no sidecar {instance!r} ({exc}); waiting for it", None
            stamp = time.strftime("%H:%M:%S")
            frame = f"kvsidecar-inspect --watch {every:g}   {stamp}   (Ctrl-C to quit)\n\n{text}"
            out.write("\033[H" + "\n".join(line + "\033[K" for line in frame.split("\n")) + "\n\033[J")
            out.flush()
            time.sleep(every)
    except KeyboardInterrupt:  # Ctrl-C ends a watch
        out.write("\n")
        return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instance", default="kvsidecar")
    p.add_argument("--json", action="store_true", help=f"machine-readable output (schema {SCHEMA_ID})")
    p.add_argument("--watch", type=float, metavar="SECONDS", help="redraw in place every SECONDS")
    args = p.parse_args(argv)
    if args.watch and not args.json:
        return _watch(args.instance, max(args.watch, 0.05), sys.stdout)
    previous = None
    while True:
        try:
            previous = snapshot(args.instance, previous)
        except SegmentError as exc:
            print(f"no sidecar {args.instance!r}: {exc}", file=sys.stderr)
            return 1
        print(json.dumps(previous, indent=2, sort_keys=True) if args.json else render(previous), flush=True)
        if not args.watch:
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
