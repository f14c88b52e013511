"""Start-up benchmark: how fast a pool is ready, whether a freshly attached rank's first pass
over it runs at the speed of its second, and what exits cost.

Arms, interleaved within each repetition (same machine, same run):

* ``old``: ``pool.populate = "touch"`` (the original single-threaded Python pre-fault loop) and
  a connector that does not populate its mapping (the behaviour before issue 15);
* ``new``: the defaults — ``pool.populate = "fallocate"`` (every page reserved, zeroed by its
  first toucher), the connector's background populate;
* ``write``: ``pool.populate = "write"`` (the default before issue 23: zeros written through the
  file before ready);
* ``map``: ``pool.populate = "map"`` (fallocate + parallel MADV_POPULATE_READ in the sidecar);
* ``huge``: ``new`` on 2 MiB pages (``pool.hugepages = "on"``), only where the machine has
  enough free huge pages (``vm.nr_hugepages``);
* ``tiny``: a 64 MiB pool, the launcher's fixed cost (interpreter, imports).

``KVSBENCH_SIZES_GIB``, ``KVSBENCH_ARMS`` and ``KVSBENCH_REPS`` narrow a run (e.g. the
hugepage figure on a machine where ``vm.nr_hugepages`` was raised for it).

Floors measured by this process in the same run: a bare ``posix_fallocate`` and a bare
zero-write of the same size on /dev/shm (what the kernel and the VM charge, no sidecar).

Per trial: ready time (spawn → ready line), the pool's own time (from the sidecar's log),
the sidecar's RSS at ready, then a rank process that was spawned beforehand attaches as soon
as the sidecar is ready (its delay is recorded), copies the whole pool out of its mapping
twice (first / second pass), takes a lease and is killed with SIGKILL: its exit (pidfd) and
the sidecar's reclaim of its lease are timed; finally the sidecar is killed (its exit) and
its segments unlinked (freeing the pages), each timed per GiB.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import re
import select
import signal
import statistics
import tempfile
import time

from kvsidecar.shm.layout import KVLayout

GiB = 1 << 30
LAYOUT = dict(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, tp_size=1)  # 2 MiB blocks
CHUNK = 64 << 20


# -- the rank -----------------------------------------------------------------------------------
def _rank(instance: str, layout: dict, populate: str, conn) -> None:
    """Attach as soon as told the sidecar is ready; two full passes over the pool per variant.

    ``wait``: the first pass after the connector's background populate finished (an engine's
    first restore comes after its model load); ``race``: the first pass at once, while the
    populate runs (a second mapping, attached after the first was measured).  Without a
    populate (the old connector) there is one variant, ``race``."""
    import ctypes

    from kvsidecar.connector.kv_client import KVConnector
    from kvsidecar._native.copy import copy_bytes
    from kvsidecar.shm.populate import resident_bytes

    scratch = ctypes.create_string_buffer(CHUNK)
    ctypes.memset(scratch, 1, CHUNK)
    dst = ctypes.addressof(scratch)
    conn.send("armed")
    t_ready = conn.recv()
    out = {}
    conns = []
    for variant in (["wait", "race"] if populate != "off" else ["race"]):
        c = KVConnector(instance, KVLayout(**layout), group=f"bench-rank-{variant}", populate=populate,
                        cuda_register=False)
        t0 = time.monotonic()
        c.attach()
        t_attached = time.monotonic()
        if variant == "wait":
            c.wait_populated(120)
        size, base = c.pool.size, c.pool.address
        v = {"attach_delay_s": t_attached - t_ready, "attach_s": t_attached - t0,
             "populated_at_pass1": c.populate_stats()["done"], "wait_s": time.monotonic() - t_attached}
        passes = []
        for _ in range(2):
            # what KVConnector.load does: the attach-time populate pauses while the engine copies
            pause = c.populator.copying() if c.populator is not None else contextlib.nullcontext()
            t = time.perf_counter()
            with pause:
                for off in range(0, size, CHUNK):
                    copy_bytes(dst, base + off, min(CHUNK, size - off))
            passes.append(time.perf_counter() - t)
        c.wait_populated(120)
        v.update(pass1_s=passes[0], pass2_s=passes[1], populate_s=c.populate_stats().get("seconds"),
                 resident=resident_bytes(base))
        out[variant] = v
        out["size"] = size
        conns.append(c)
    for c in conns[:-1]:  # one mapping left for the kill; time the others' unmap
        t = time.perf_counter()
        c.detach()
        out["unmap_s"] = time.perf_counter() - t
    c = conns[-1]
    chain = c.hasher.chain(list(range(4 * layout["tokens_per_block"])))
    staging = c.store(chain)
    c.commit(staging)
    c.get(chain)
    conn.send(out)
    conn.recv()  # killed here


# -- helpers ------------------------------------------------------------------------------------
def _floor(kind: str, size: int) -> float:
    name = f"/dev/shm/kvsbenchfloor{os.getpid()}"
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        t = time.perf_counter()
        if kind == "fallocate":
            os.posix_fallocate(fd, 0, size)
        else:
            zero = bytes(2 << 20)
            for off in range(0, size, len(zero)):
                os.pwrite(fd, zero, off)
        return time.perf_counter() - t
    finally:
        os.close(fd)
        os.unlink(name)


def _wait_exit(pid: int, t0: float, timeout_s: float = 60.0) -> float:
    fd = os.pidfd_open(pid)
    try:
        select.select([fd], [], [], timeout_s)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


_READY = re.compile(r"pool (\S+) ready: (\d+) MiB, (\S+ \S+) pages \(([^)]*)\), populate=([^,]+(?:, \d+ threads)?)"
                    r".* in ([\d.]+) s")
_RSS = re.compile(r"VmRSS (\d+) MiB, RssAnon (\d+) MiB, RssShmem (\d+) MiB")
_SETUP = re.compile(r"ready: pid \d+.*?([\d.]+) s after process start")


def _parse_log(path: str) -> dict:
    text = open(path).read()
    out = {"log": [line for line in text.splitlines() if "INFO" in line or "WARNING" in line][:12]}
    m = _READY.search(text)
    if m:
        out.update(pool_name=m.group(1), pages=m.group(3), backing=m.group(4), pool_s=float(m.group(6)))
    m = _RSS.search(text)
    if m:
        out.update(rss_mib=int(m.group(1)), rss_anon_mib=int(m.group(2)), rss_shmem_mib=int(m.group(3)))
    m = _SETUP.search(text)
    if m:
        out["process_age_at_ready_s"] = float(m.group(1))
    return out


ARMS = {
    "old": ({"pool.populate": "touch", "pool.hugepages": "off"}, "off"),
    "new": ({}, "background"),
    "map": ({"pool.populate": "map", "pool.hugepages": "off"}, "background"),
    "write": ({"pool.populate": "write", "pool.hugepages": "off"}, "background"),
    "huge": ({"pool.hugepages": "on"}, "background"),
}


def _trial(arm: str, size: int, ctx, tag: str) -> dict:
    from kvsidecar.connector.kv_client import KVConnector
    from kvsidecar.shm.control import ControlSegment
    from kvsidecar.shm.segment import Segment, unlink_segment
    from kvsidecar.sidecar.spawn import SidecarProcess

    lay = KVLayout(**LAYOUT)
    instance = f"kvsbst{os.getpid()}{tag}"
    extra, conn_populate = ARMS[arm]
    over = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    over.update({"pool.num_blocks": size // lay.block_bytes, "l3.backend": "none",
                 "run_dir": tempfile.gettempdir() + "/kvsbench"})
    over.update(extra)
    if arm == "new":
        over["pool.hugepages"] = "off"  # the 4 KiB figure; "huge" is the 2 MiB one
    a, b = ctx.Pipe()
    rank = ctx.Process(target=_rank, args=(instance, LAYOUT, conn_populate, b), daemon=True)
    rank.start()
    assert a.poll(60) and a.recv() == "armed"
    log_path = tempfile.mktemp(prefix="kvsbench-startup-", suffix=".log")
    res = {"arm": arm, "size": size}
    with open(log_path, "w") as logf:
        t0 = time.perf_counter()
        sc = SidecarProcess(instance, overrides=over, log_level="INFO", stderr=logf, start_timeout_s=600)
        res["ready_s"] = time.perf_counter() - t0
        a.send(time.monotonic())
        try:
            if not a.poll(300):
                raise RuntimeError("rank did not report")
            res.update(a.recv())
            seg = Segment.attach(f"/{instance}.ctl", readonly=True)
            pool_name = ControlSegment(seg).pool_name
            seg.close()
            mon = KVConnector(instance, lay, group="bench-monitor", populate="off")
            mon.attach()
            assert mon.stats()["leases"]["live"] == 1
            t0 = time.perf_counter()
            fd = os.pidfd_open(rank.pid)
            os.kill(rank.pid, signal.SIGKILL)
            exit_s = reclaim_s = None
            deadline = t0 + 60
            while (exit_s is None or reclaim_s is None) and time.perf_counter() < deadline:
                if exit_s is None and select.select([fd], [], [], 0)[0]:
                    exit_s = time.perf_counter() - t0
                if reclaim_s is None and mon.stats()["leases"]["live"] == 0:
                    reclaim_s = time.perf_counter() - t0
                time.sleep(0.0005)
            os.close(fd)
            rank.join(10)
            mon.detach()
            res.update(rank_exit_s=exit_s, reclaim_s=reclaim_s)
            t0 = time.perf_counter()
            os.kill(sc.pid, signal.SIGKILL)
            res["sidecar_exit_s"] = _wait_exit(sc.pid, t0)
            sc.proc.wait(10)
            t0 = time.perf_counter()
            unlink_segment(f"/{instance}.ctl")
            if pool_name.startswith("/proc/"):
                res["unlink_s"] = 0.0  # memfd: freed by the last exit, counted above
            else:
                unlink_segment(pool_name)
                res["unlink_s"] = time.perf_counter() - t0
        finally:
            if rank.is_alive():
                rank.kill()
                rank.join(10)
            sc.kill()
            for name in (f"/{instance}.ctl", f"/{instance}.pool"):
                unlink_segment(name)
    res.update(_parse_log(log_path))
    os.unlink(log_path)
    return res


def _room(size: int) -> bool:
    from kvsidecar.shm.populate import _meminfo

    avail = _meminfo().get("MemAvailable", 0) << 10
    st = os.statvfs("/dev/shm")
    return size + GiB <= min(avail, st.f_bavail * st.f_frsize)


def run(quick: bool = False, trials: int | None = None) -> dict:
    """``trials``: repetitions (each runs every arm once, rotated; default 2 quick, 3 full)."""
    from kvsidecar.shm.populate import hugepages_available

    sizes = [GiB // 2, GiB] if quick else [4 * GiB, 16 * GiB]
    reps = trials or (2 if quick else 3)
    arms = ["old", "new", "write"] if quick else ["old", "new", "write", "map"]
    # e.g. KVSBENCH_SIZES_GIB=4 KVSBENCH_ARMS=new,huge for a run with huge pages reserved
    if os.environ.get("KVSBENCH_SIZES_GIB"):
        sizes = [int(float(x) * GiB) for x in os.environ["KVSBENCH_SIZES_GIB"].split(",")]
    if os.environ.get("KVSBENCH_ARMS"):
        arms = [a for a in os.environ["KVSBENCH_ARMS"].split(",") if a != "huge"]
    if os.environ.get("KVSBENCH_REPS"):
        reps = int(os.environ["KVSBENCH_REPS"])
    huge_ok = {s: hugepages_available() >= s + (64 << 20) for s in sizes}
    ctx = mp.get_context("spawn")
    trials: list[dict] = []
    floors: dict = {}
    room = {s: _room(s) for s in sizes}  # 4 KiB arms need free memory; "huge" needs free huge pages
    skipped = [s for s in sizes if not room[s] and not huge_ok[s]]
    tag = 0
    for rep in range(reps):
        for size in sizes:
            if size in skipped:
                continue
            order = (arms if room[size] else []) + (["huge"] if huge_ok[size] else [])
            order = order[rep % len(order):] + order[:rep % len(order)]  # rotate: no arm always first
            for arm in order:
                tag += 1
                trials.append(_trial(arm, size, ctx, str(tag)))
            if room[size]:
                for kind in ("fallocate", "zero-write"):
                    floors.setdefault((kind, size), []).append(_floor(kind, size))
        tag += 1
        trials.append(_trial("new", 64 << 20, ctx, str(tag)) | {"arm": "tiny"})
    return _summarise(trials, floors, sizes, skipped, huge_ok, quick)


def _med(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _summarise(trials, floors, sizes, skipped, huge_ok, quick) -> dict:
    res = {"quick": quick, "sizes": sizes, "skipped_sizes": skipped, "hugepages_available": huge_ok,
           "layout": LAYOUT, "trials": [{k: v for k, v in t.items() if k != "log"} for t in trials]}
    tiny = [t for t in trials if t["arm"] == "tiny"]
    res["tiny_ready_s"] = _med([t["ready_s"] for t in tiny])
    summary = {}
    for t in trials:
        if t["arm"] == "tiny":
            continue
        key = f"{t['arm']}@{t['size'] // GiB if t['size'] >= GiB else t['size'] / GiB:g}GiB"
        summary.setdefault(key, []).append(t)
    out = {}
    for key, ts in summary.items():
        gib = ts[0]["size"] / GiB
        out[key] = {
            "ready_s_per_gib": _med([t["ready_s"] / gib for t in ts]),
            "pool_s_per_gib": _med([t.get("pool_s", float("nan")) / gib for t in ts]),
            "variants": {var: {
                "pass_ratio": _med([t[var]["pass1_s"] and t[var]["pass2_s"] / t[var]["pass1_s"] for t in ts]),
                "pass1_gbps": _med([t["size"] / t[var]["pass1_s"] / 1e9 for t in ts]),
                "pass2_gbps": _med([t["size"] / t[var]["pass2_s"] / 1e9 for t in ts]),
                "attach_delay_s": _med([t[var]["attach_delay_s"] for t in ts]),
                "attach_s": _med([t[var]["attach_s"] for t in ts]),
                "wait_s": _med([t[var]["wait_s"] for t in ts]),
                "resident_fraction": _med([t[var]["resident"] / t["size"] for t in ts]),
                "rank_populate_s_per_gib": _med([t[var]["populate_s"] / gib if t[var].get("populate_s") else None
                                                 for t in ts]),
            } for var in ("wait", "race") if var in ts[0]},
            "rank_unmap_ms_per_gib": _med([t["unmap_s"] * 1e3 / gib if t.get("unmap_s") else None for t in ts]),
            "rank_exit_ms_per_gib": _med([t["rank_exit_s"] * 1e3 / gib if t.get("rank_exit_s") else None for t in ts]),
            "reclaim_ms": _med([t["reclaim_s"] * 1e3 if t.get("reclaim_s") else None for t in ts]),
            "sidecar_exit_ms_per_gib": _med([t["sidecar_exit_s"] * 1e3 / gib for t in ts]),
            "unlink_ms_per_gib": _med([t["unlink_s"] * 1e3 / gib for t in ts]),
            "rss_mib": _med([t.get("rss_mib") for t in ts]),
            "rss_shmem_mib": _med([t.get("rss_shmem_mib") for t in ts]),
            "pages": ts[0].get("pages"), "backing": ts[0].get("backing"),
        }
    res["summary"] = out
    res["floors_s_per_gib"] = {f"{k}@{s / GiB:g}GiB": _med([v / (s / GiB) for v in vals])
                               for (k, s), vals in floors.items()}
    # the issue-23 figures: the default mode's pool time against a bare fallocate of the same
    # size (same run), and a rank's first pass after its background populate against its second
    for size in sizes:
        key = f"new@{size // GiB if size >= GiB else size / GiB:g}GiB"
        floor = res["floors_s_per_gib"].get(f"fallocate@{size / GiB:g}GiB")
        new = out.get(key)
        if new is None or floor is None or new["pool_s_per_gib"] is None:
            continue
        per = [t.get("pool_s", float("nan")) / (size / GiB) for t in summary[key]]
        res.setdefault("ready_vs_fallocate_by_size", {})[key] = _ratio_of(per, floor["median"])
        res["ready_vs_fallocate"] = res["ready_vs_fallocate_by_size"][key]  # the largest size, last
        if "wait" in new["variants"]:
            res["first_pass_vs_second"] = new["variants"]["wait"]["pass_ratio"]
    largest = [t for t in trials if t["arm"] == "new" and t["size"] == max(sizes)]
    if largest:
        res["startup_log_largest_new"] = largest[-1].get("log", [])
    return res


def _ratio_of(values, floor: float) -> dict:
    m = _med([v / floor for v in values])
    m["spread"] = (m["max"] - m["min"]) / m["median"] if m["median"] else 0.0
    return m


def _fmt(m, unit="", digits=3):
    if m is None:
        return "n/a"
    return f"{m['median']:.{digits}f}{unit} [{m['min']:.{digits}f}-{m['max']:.{digits}f}]"


def table(r: dict):
    rows = []
    rows.append(("tiny_ready_s", _fmt(r["tiny_ready_s"], " s"), "launcher fixed cost: a 64 MiB pool, spawn -> ready"))
    for key, v in r["summary"].items():
        rows.append((f"{key} ready", _fmt(v["ready_s_per_gib"], " s/GiB"),
                     f"spawn -> ready line; {v['pages']} pages ({v['backing']}); median [min-max]"))
        rows.append((f"{key} pool", _fmt(v["pool_s_per_gib"], " s/GiB"), "the pool's own allocation (sidecar log)"))
        for var, w in v["variants"].items():
            what = ("first pass after the background populate finished" if var == "wait"
                    else "first pass at once after attach" + (", racing the populate" if not key.startswith("old")
                                                             else " (no populate)"))
            rows.append((f"{key} pass1/pass2 {var}", _fmt(w["pass_ratio"]),
                         f"{what}: {_fmt(w['pass1_gbps'], '', 1)} vs {_fmt(w['pass2_gbps'], '', 1)} GB/s;"
                         f" attached {_fmt(w['attach_delay_s'], ' s', 2)} after ready, attach() "
                         f"{_fmt(w['attach_s'], ' s', 4)}"))
            if w["rank_populate_s_per_gib"] is not None:
                rows.append((f"{key} rank populate {var}", _fmt(w["rank_populate_s_per_gib"], " s/GiB"),
                             f"the rank's background populate (attach -> fault-free; waited "
                             f"{_fmt(w['wait_s'], ' s', 2)}); resident {_fmt(w['resident_fraction'], '', 2)}"))
        if v["rank_unmap_ms_per_gib"] is not None:
            rows.append((f"{key} rank unmap", _fmt(v["rank_unmap_ms_per_gib"], " ms/GiB", 1),
                         "detach of a populated mapping (munmap)"))
        rows.append((f"{key} rank exit", _fmt(v["rank_exit_ms_per_gib"], " ms/GiB", 1),
                     f"kill -9 of the rank -> exit (pidfd); lease reclaimed after {_fmt(v['reclaim_ms'], ' ms', 1)}"))
        rows.append((f"{key} sidecar exit", _fmt(v["sidecar_exit_ms_per_gib"], " ms/GiB", 1),
                     f"kill -9 of the sidecar -> exit; then unlink {_fmt(v['unlink_ms_per_gib'], ' ms/GiB', 1)}"))
        rows.append((f"{key} sidecar RSS", _fmt(v["rss_mib"], " MiB", 0),
                     f"at ready (RssShmem {_fmt(v['rss_shmem_mib'], ' MiB', 0)})"))
    for key, v in r["floors_s_per_gib"].items():
        rows.append((f"floor {key}", _fmt(v, " s/GiB"), "bare syscalls from this process, same run"))
    for key, v in r.get("ready_vs_fallocate_by_size", {}).items():
        rows.append((f"ready_vs_fallocate {key}", _fmt(v), "the default mode's pool time / a bare fallocate; target <= 1.2"))
    if r.get("first_pass_vs_second") is not None:
        rows.append(("first_pass_vs_second", _fmt(r["first_pass_vs_second"]),
                     "a rank's pass2/pass1 time after its background populate (largest size); target >= 0.9"))
    for s, ok in r["hugepages_available"].items():
        if not ok:
            rows.append((f"huge@{s / GiB:g}GiB", "n/a", "not enough free 2 MiB pages (vm.nr_hugepages)"))
    for s in r["skipped_sizes"]:
        rows.append((f"size {s / GiB:g} GiB", "skipped", "not enough free memory or /dev/shm"))
    return rows
