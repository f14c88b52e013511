"""The ops every sidecar serves whatever is mounted (attach, detach, ping, stats), and the
publishing of the stats blob the read-only inspector renders.

:class:`BuiltinOps` is a service like any other (mounted first, by the loop itself): it uses the
loop only through what it is given at construction.  :class:`StatsPublisher` writes one
snapshot (``SidecarSnapshot``: the stats op's answer plus the inspector's tables) into the
control segment's seqlocked blob, at most every ``transport.stats_interval_ms`` after work and
never on the request path (the loop calls it only when it is about to sleep).
"""

from __future__ import annotations

import logging

from kvsidecar.shm.control import SLOT_ACTIVE, ControlSegment
from kvsidecar.shm.errors import ErrorCode

from kvsidecar.sidecar.observe.status import render_tables
from kvsidecar.sidecar.runtime.clients import ClientConn, ClientInfo
from kvsidecar.sidecar.service import OpError, Service

log = logging.getLogger(__name__)

MAX_GROUP_SIZE = 1024


class BuiltinOps(Service):
    """attach / detach / ping / stats.  ``host`` gives the snapshot, the invariants check and the
    mounted services (attach asks each to validate a KV attach)."""

    def __init__(self, host, ctl: ControlSegment, *, instance: str, layout: dict | None, checksums: bool):
        self.host = host
        self.ctl = ctl
        self.instance = instance
        self.layout = layout
        self.checksums = checksums

    def ops(self) -> dict:
        return {"attach": self.op_attach, "detach": self.op_detach, "ping": self.op_ping, "stats": self.op_stats}

    def op_attach(self, conn: ClientConn, msg: dict) -> dict:
        if conn.attached:
            raise OpError(ErrorCode.BAD_FIELD, "already attached")
        if msg["instance"] != self.instance:
            raise OpError(ErrorCode.BAD_FIELD, f"instance {msg['instance']!r} is not {self.instance!r}")
        if msg["pid"] != conn.pid:
            raise OpError(ErrorCode.NOT_OWNER, f"pid {msg['pid']} did not claim slot {conn.slot}")
        if not 1 <= msg["group_size"] <= MAX_GROUP_SIZE or msg["rank"] >= msg["group_size"]:
            raise OpError(ErrorCode.BAD_FIELD, f"rank must be < group_size <= {MAX_GROUP_SIZE}")
        theirs = msg.get("layout")
        if self.layout is not None and theirs is not None:
            for key in sorted(set(self.layout) | set(theirs)):
                if self.layout.get(key) != theirs.get(key):
                    raise OpError(
                        ErrorCode.LAYOUT_MISMATCH,
                        f"layout field {key!r}: sidecar has {self.layout.get(key)!r}, client has {theirs.get(key)!r}",
                    )
        if theirs is not None:
            for svc in self.host.services:
                svc.validate_attach(conn, msg)
        conn.attached_as(ClientInfo(msg["group"], msg["rank"], msg["group_size"], msg["pid"], kv=theirs is not None))
        self.ctl.set_slot(conn.slot, conn.pid, SLOT_ACTIVE)
        self.host.counters["attaches"] += 1
        return {"slot": conn.slot, "generation": self.ctl.generation, "pool": self.ctl.pool_name,
                "layout": self.layout or {}, "checksums": self.checksums}

    def op_detach(self, conn: ClientConn, msg: dict) -> dict:
        conn.detaching = True  # the loop drops the client once it consumed this completion
        self.host.counters["detaches"] += 1
        return {}

    def op_ping(self, conn: ClientConn, msg: dict) -> dict:
        payload = msg.get("payload")
        return {"payload": payload} if payload is not None else {}

    def op_stats(self, conn: ClientConn, msg: dict) -> dict:
        out = {"stats": self.host.snapshot().stats()}
        if msg.get("check"):
            out["invariants"] = self.host.check()
        return out


class StatsPublisher:
    """Writes the snapshot into the control segment: at most every ``interval_s`` after work."""

    def __init__(self, ctl: ControlSegment, take_snapshot, interval_s: float):
        self.ctl = ctl
        self.take_snapshot = take_snapshot
        self.interval_s = interval_s
        self.dirty = True
        self.last = 0.0

    def timeout(self, now: float, bound: float) -> float:
        """Before sleeping: publish if due; returns how long the loop may sleep (at most ``bound``)."""
        if not self.dirty:
            return bound
        due = self.last + self.interval_s
        if now >= due:
            self.publish(now)
            return bound
        return min(bound, due - now)

    def publish(self, now: float) -> None:
        self.last = now
        self.dirty = False
        try:
            snap = self.take_snapshot()
            blob = snap.stats()
            blob["status"] = render_tables(snap)
            self.ctl.write_stats(blob)
        except Exception:
            log.exception("publishing stats failed")
