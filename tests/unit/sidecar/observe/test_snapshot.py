"""One snapshot, three renderings (kvsidecar.sidecar.observe.snapshot): the stats op's wire format, the
inspector's tables and the Prometheus table, from a real KVCore; and the doorbell's wake path that the
control loop uses (recheck=False)."""

from __future__ import annotations

import ctypes
import mmap
import threading

from kvsidecar.shm.doorbell import Doorbell
from kvsidecar.shm.errors import ErrorCode
from kvsidecar.sidecar.config import load_config
from kvsidecar.sidecar.kv.ops import KVCore
from kvsidecar.sidecar.observe import metrics as M
from kvsidecar.sidecar.observe.snapshot import (
    ClientSnapshot,
    LeaseCause,
    LoopSnapshot,
    PoolState,
    SidecarSnapshot,
)
from kvsidecar.sidecar.observe.status import render_tables


class _Host:
    """The part of kvsidecar.sidecar.service.Host a KVCore uses while nothing is served."""

    def __init__(self):
        import collections

        self.clients: dict = {}
        self.counters = collections.Counter()

    def post(self, fn, *args):
        raise AssertionError("nothing is posted here")

    def call_at(self, due, fn, *args):
        pass


def _loop(**kw) -> LoopSnapshot:
    client = ClientSnapshot(slot=3, pid=42, attached=True, group="g", rank=1, requests=9, errors=2, outbox=0,
                            detaching=False, submit_depth=16, completion_depth=8, connected_s=1.5)
    base = dict(instance="x", generation=7, pid=1, clients=(client,), counters={"requests": 9, "errors": 2},
                ops={"ping": 5, "stats": 1}, errors={ErrorCode.UNKNOWN_ID: 2}, rings_corrupted=0)
    base.update(kw)
    return LoopSnapshot(**base)


def _core() -> KVCore:
    cfg = load_config(None, {"layout.num_layers": 1, "layout.head_dim": 8, "pool.num_blocks": 64})
    return KVCore(_Host(), cfg.kv_layout(), 64, cfg.limits)


def test_the_stats_op_keeps_its_wire_names_for_enum_keyed_counters():
    snap = SidecarSnapshot.of(_loop(rings_corrupted=1), [_core().snapshot()])
    wire = snap.stats()
    assert wire["counters"] == {"requests": 9, "errors": 2, "op_ping": 5, "op_stats": 1, "errors_unknown_id": 2,
                                "errors_ring_corrupted": 1}
    assert wire["clients"] == [{"slot": 3, "pid": 42, "attached": True, "group": "g", "rank": 1, "requests": 9,
                                "errors": 2, "outbox": 0, "detaching": False}]
    assert wire["pool"]["free"] == 64 and wire["pool"]["blocks"] == 64
    assert wire["leases"] == {"live": 0, "oldest_age_s": 0.0}
    assert set(wire) == {"instance", "generation", "pid", "clients", "counters", "busy", "pool", "leases", "store",
                         "decisions"}
    assert wire["busy"] == {}


def test_the_control_threads_time_goes_on_the_wire_busiest_first_in_ms():
    busy = {"op:ping": (5, 0.0005, 0.0002), "event:SessionManager._chunk_done": (2, 0.004, 0.003),
            "timer:SessionWaits._expired": (1, 0.001, 0.001)}
    wire = SidecarSnapshot.of(_loop(busy=busy), [_core().snapshot()]).stats()
    assert list(wire["busy"]) == ["event:SessionManager._chunk_done", "timer:SessionWaits._expired", "op:ping"]
    assert wire["busy"]["op:ping"] == {"n": 5, "ms": 0.5, "max_ms": 0.2}
    assert wire["busy"]["event:SessionManager._chunk_done"] == {"n": 2, "ms": 4.0, "max_ms": 3.0}


def test_tables_and_metrics_render_the_same_snapshot():
    snap = SidecarSnapshot.of(_loop(), [_core().snapshot()])
    tables = render_tables(snap)
    assert tables["pool"]["by_state"] == {"free": 64, "staging": 0, "resident_pinned": 0, "resident_unpinned": 0}
    assert tables["clients"] == [{"slot": 3, "pid": 42, "group": "g", "rank": 1, "requests": 9, "errors": 2,
                                  "connected_s": 1.5}]
    assert tables["sessions"] == {"total": 0, "rows": []}

    class _Svc:
        block_bytes, shard_bytes, tokens_per_block = 100, 50, 4

    fams = {}
    for metric in M.METRICS:
        if metric.part is not None and getattr(snap, metric.part) is None:
            continue
        value = metric.getter(snap, _Svc)
        if value is not None:
            fams[metric.name] = M.family(metric, value)
    assert len({m.name for m in M.METRICS}) == len(M.METRICS), "a metric name is in the table twice"
    assert not any(m.name in fams for m in M.METRICS if m.part == "l3")  # no L3 mounted: no L3 series
    assert fams["kvsidecar_l3_read_bytes"].samples[0].value == 0  # (a byte count is 0, as before)
    assert "kvsidecar_sessions" not in fams  # no session manager mounted
    series = {tuple(s.labels.values()): s.value for s in fams["kvsidecar_protocol_errors"].samples}
    # every wire code is a series (0 when none), plus the ring that broke: label values from the enum
    assert set(series) == {(c.name.lower(),) for c in ErrorCode} | {("ring_corrupted",)}
    assert series[("unknown_id",)] == 2 and series[("bad_field",)] == 0
    pool = {s.labels["state"]: s.value for s in fams["kvsidecar_pool_blocks"].samples}
    assert pool == {st.value: tables["pool"]["by_state"][st.value] for st in PoolState}
    causes = {s.labels["cause"] for s in fams["kvsidecar_leases_released"].samples}
    assert causes == {c.value for c in LeaseCause}
    depth = {tuple(s.labels.values()): s.value for s in fams["kvsidecar_ring_depth_bytes"].samples}
    assert depth == {("3", "submit"): 16, ("3", "completion"): 8}


def test_lease_drops_are_grouped_by_cause_without_parsing_counter_names():
    core = _core()
    core.leases.drops.update({"released": 2, "expired": 1, "group_gone": 1, "store_prefix_refused": 3})
    drops = core.snapshot().lease_drops
    assert drops[LeaseCause.RELEASED] == 2 and drops[LeaseCause.TTL] == 1
    assert drops[LeaseCause.CLIENT_GONE] == 1 and drops[LeaseCause.INTERNAL] == 3
    assert drops[LeaseCause.ABORTED] == 0


def _bell():
    m = mmap.mmap(-1, 4096)
    anchor = ctypes.c_char.from_buffer(m)
    return Doorbell(ctypes.addressof(anchor), 0, 0.0), (m, anchor)


def test_a_wake_without_recheck_returns_at_once_and_a_timeout_still_checks():
    bell, _keep = _bell()
    calls = []
    flag = threading.Event()
    ringer = []

    def ready():
        calls.append(1)
        if len(calls) == 2:  # the re-check after "sleeping" is published: the post lands now or while asleep
            ringer.append(threading.Thread(target=lambda: (flag.set(), bell.ring())))
            ringer[0].start()
            return False
        return flag.is_set()

    assert bell.wait(ready, 10.0, 0.0, recheck=False) is True
    ringer[0].join(10)
    assert len(calls) == 2  # before sleeping and the re-check; none after the wake-up
    calls.clear()
    ringer.clear()
    flag.clear()
    never = lambda: calls.append(1) or False  # noqa: E731
    assert bell.wait(never, 0.01, 0.0, recheck=False) is False  # timed out: ready() decides
    assert len(calls) == 3
    assert bell.wait(never, 0.01, 0.0) is False and len(calls) == 6
