"""What every benchmark and simulator repeats: a percentile, a process's CPU time, waiting for the
sidecar's write-behind to land, and writing the result JSON.  (Repeated trials and their
``median [min..max]`` live in :mod:`scripts.trials`.)"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def percentile(xs, q: float, empty: float = 0.0) -> float:
    """The nearest-rank ``q`` quantile (0 <= q <= 1) of ``xs``: the sample at index ``int(q * n)``
    of the sorted samples (the last one for q = 1); ``empty`` when there are none."""
    if not xs:
        return empty
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _stat_after_comm(pid) -> list:
    """The fields of ``/proc/<pid>/stat`` after the command name (which may hold spaces)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` has used so far (from /proc/<pid>/stat)."""
    rest = _stat_after_comm(pid)
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def session_cpu_seconds(sid: int) -> float:
    """User + system CPU seconds used so far by every live process of session ``sid`` (a server
    started with ``start_new_session``: its ranks and helpers)."""
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            rest = _stat_after_comm(name)
        except OSError:  # exited meanwhile
            continue
        if int(rest[3]) == sid:
            total += int(rest[11]) + int(rest[12])
    return total / os.sysconf("SC_CLK_TCK")


def wait_puts_done(conn, timeout_s: float = 120.0) -> dict:
    """Benchmark set-up (outside every measured interval): wait, bounded, until the sidecar behind
    ``conn`` (a KVConnector) has no L3 PUT in flight; returns its stats then.  Raises
    TimeoutError past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = conn.stats()
        if not s["l3"]["puts_in_flight"]:
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(f"L3 PUTs still in flight after {timeout_s} s: {s['l3']['puts_in_flight']}")
        time.sleep(0.02)


def write_json(path, result, indent: int = 2, default=None) -> None:
    """The tail of every benchmark's main(): ``result`` as sorted JSON at ``path`` (its folder
    made), and one line saying where (``default``: as ``json.dumps``' for values it cannot encode)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=indent, sort_keys=True, default=default))
    print(f"\nJSON written to {path}")
