"""Where a kvsidecar storage hit's TTFT goes inside genuine SGLang: the per-request timeline.

    python -m scripts.sglang_timeline FILE.json [--rank 0] [--kind probe-hit|stream]

Reads a ``scripts.sglang_ttft`` JSON (each request's client send time and TTFT, on
CLOCK_MONOTONIC) and the kvsidecar server's log (``timeline = true``: one ``kvsidecar-timeline``
line per storage phase, same clock; ``scripts.sglang_ttft --timeline``), and splits each request's TTFT into:

* ``to_query``: client send -> SGLang's prefetch thread starts ``_storage_hit_query`` (HTTP,
  tokenizer, scheduler queue entry, prefetch thread pick-up);
* ``query``: ``_storage_hit_query`` (kvsidecar ``batch_exists``: ``prefetch`` op + ``query_wait``
  for L3 metadata; then SGLang's MIN all-reduce);
* ``to_transfer``: query done -> the I/O thread starts ``_page_transfer`` (SGLang allocates host
  pages for the hit, hands the operation over);
* ``transfer``: ``_page_transfer`` (``batch_get_v1``: ``get_wait`` for the session, group ``get``,
  ``verify``, ``copy`` into SGLang's host pages, ``release``);
* ``after``: transfer done -> first token at the client (SGLang's readiness check, host->device
  load-back, prefill of what was not restored, first decode step, streaming);
* on SGLang's scheduler thread (inside the phases above): ``demand`` and ``end`` (the plugin's
  sidecar round trips at the first ``check_prefetch_progress`` and when the prefetch is over),
  ``settle_query`` / ``settle_copy`` (the settler's bounded waits, :mod:`kvsidecar.connector.sglang_settle`),
  and ``checks``: how many ``check_prefetch_progress`` calls found the request's prefetch still open
  (0: admitted in the iteration that first saw it).

The log also holds the write-through's cost, which no request's breakdown shows: one ``set`` record
per ``batch_set_v1`` of SGLang's backup thread (rid ``backup:<pages>:<first key>``; store, copy
into the pool, commit).

Pure parsing (:func:`parse_log`, :func:`breakdown`) is separate from the file handling.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
from pathlib import Path

from scripts.common import write_json

LINE = re.compile(r"kvsidecar-timeline (\{.*\})")
INNER = ("prefetch", "query_wait", "get_wait", "get", "verify", "copy", "release", "demand", "check_progress", "end",
         "settle_query", "settle_copy")


def parse_log(lines, rank: int = 0) -> dict:
    """rid -> phase -> list of (t0, t1) for one rank."""
    out: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for line in lines:
        m = LINE.search(line)
        if not m:
            continue
        try:
            ev = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if ev.get("rank") == rank:
            out[ev["rid"]][ev["phase"]].append((ev["t0"], ev["t1"]))
    return out


def breakdown(sent_at: float, ttft_s: float, phases: dict) -> dict | None:
    """One request's TTFT split into phases (ms); None without a storage query."""
    q = phases.get("storage_hit_query")
    if not q:
        return None
    q0, q1 = q[0]
    first = sent_at + ttft_s
    out = {"ttft": ttft_s, "to_query": q0 - sent_at, "query": q1 - q0}
    tr = sorted(phases.get("page_transfer", ()))
    if tr:
        out["to_transfer"] = tr[0][0] - q1
        out["transfer"] = sum(b - a for a, b in tr)
        out["after"] = first - tr[-1][1]
    else:
        out["to_transfer"] = out["transfer"] = 0.0
        out["after"] = first - q1
    for name in INNER:
        out[name] = sum(b - a for a, b in phases.get(name, ()))
    res = {k: round(v * 1e3, 2) for k, v in out.items()}
    res["checks"] = len(phases.get("check_progress", ()))
    return res


def median_breakdown(rows: list) -> dict:
    if not rows:
        return {}
    return {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0]} | {"n": len(rows)}


def analyse(doc: dict, rank: int = 0) -> dict:
    """Per kvsidecar arm: the median breakdown of its hit-probe hits and of its stream requests."""
    out = {}
    for t, trial in enumerate(doc["trials"]):
        lines = []
        for p in trial.get("server_logs", ()):
            try:
                lines.extend(Path(p).read_text(errors="replace").splitlines())
            except OSError:
                continue
        phases = parse_log(lines, rank)
        for key, arm in trial.items():
            if not isinstance(arm, dict) or "client_timeline" not in arm or "@" not in key:
                continue
            for rid, (sent, ttft) in arm["client_timeline"].items():
                b = breakdown(sent, ttft, phases.get(rid, {}))
                if b is None:
                    continue
                kind = "probe_hit" if rid.endswith("-hit") else "probe_cold" if rid.endswith("-cold") else "stream"
                out.setdefault(key, {}).setdefault(kind, []).append(b)
    return {key: {kind: median_breakdown(v) for kind, v in kinds.items()} for key, kinds in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the breakdown as JSON here")
    a = ap.parse_args(argv)
    res = analyse(json.loads(Path(a.json).read_text()), a.rank)
    cols = ("ttft", "to_query", "query", "prefetch", "query_wait", "to_transfer", "transfer", "get_wait", "get",
            "verify", "copy", "after", "demand", "end", "settle_query", "settle_copy", "checks", "n")
    print(f"{'arm':18s} {'kind':10s} " + " ".join(f"{c:>10s}" for c in cols))
    for key, kinds in sorted(res.items()):
        for kind, b in sorted(kinds.items()):
            print(f"{key:18s} {kind:10s} " + " ".join(f"{b.get(c, 0):10.1f}" for c in cols))
    if a.out:
        write_json(a.out, res, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
