"""The inspector's tables: live sessions, leases, pool by state, clients (control thread).

Mounted as a service whose :meth:`status` the control loop publishes, with the stats, into the
control segment's seqlocked blob (``kvsidecar.shm.control``) — never per request, at most every
``transport.stats_interval_ms`` after work.  The read-only inspector renders what is published
and never sends a request.  Tables are bounded (``MAX_ROWS`` each, oldest first, with the
total count beside them) so the blob always fits its region.
"""

from __future__ import annotations

import time

from kvsidecar.sidecar.service import Host, Service

MAX_ROWS = 48
MAX_TEXT = 64  # characters of a request id / group name shown (the blob's size stays bounded)


def owner_text(lease) -> str:
    """Who holds a lease, for people: a client slot, a TP group, a session, an L3 PUT, ..."""
    if lease.group is not None:
        return f"group {lease.group}"
    owner = lease.owner
    if isinstance(owner, tuple) and len(owner) == 2:
        who, what = owner
        if isinstance(who, int):
            return f"slot {who}"
        return f"{who} {what}"
    return str(owner)


class StatusTables(Service):
    def __init__(self, host: Host, core, sessions=None, clock=time.monotonic):
        self.host = host
        self.core = core
        self.sessions = sessions
        self.clock = clock

    def status(self) -> dict:
        now = self.clock()
        return {"published_at": time.time(), "sessions": self._sessions(now), "leases": self._leases(now),
                "pool": self._pool(), "clients": self._clients(now)}

    def _sessions(self, now: float) -> dict:
        if self.sessions is None:
            return {"total": 0, "rows": []}
        recs = sorted(self.sessions.records.values(), key=lambda r: r.created)
        rows = []
        for rec in recs[:MAX_ROWS]:
            m = rec.machine
            rows.append({"session": rec.id, "request": str(rec.key[1])[:MAX_TEXT], "group": rec.key[0][:MAX_TEXT],
                         "policy": rec.policy,
                         "state": m.state.value, "status": m.status.value if m.status is not None else "",
                         "published": m.published, "target": m.target, "total": m.p.total,
                         "age_s": round(now - rec.created, 3), "demanded": rec.demanded})
        return {"total": len(recs), "rows": rows}

    def _leases(self, now: float) -> dict:
        leases = sorted(self.core.leases.leases.values(), key=lambda lease: lease.created)
        rows = [{"lease": lease.id, "kind": lease.kind, "owner": owner_text(lease)[:MAX_TEXT], "blocks": lease.count,
                 "age_s": round(now - lease.created, 3),
                 "ttl_s": round(lease.deadline - now, 3) if lease.deadline != float("inf") else -1.0}
                for lease in leases[:MAX_ROWS]]
        return {"total": len(leases), "rows": rows}

    def _pool(self) -> dict:
        idx, pool = self.core.index, self.core.pool
        st = idx.stats()
        bb = idx.block_bytes
        return {"blocks": st["blocks"], "block_bytes": bb,
                "by_state": {"free": st["free"], "staging": st["staging"],
                             "resident_pinned": st["pinned"], "resident_unpinned": st["resident"] - st["pinned"]},
                "reserved_bytes": st["staging"] * bb, "reserved_limit_bytes": pool.reserved_limit_blocks * bb,
                "pinned_bytes": st["pinned"] * bb, "pinned_limit_bytes": pool.pinned_limit_blocks * bb}

    def _clients(self, now: float) -> list:
        out = []
        for conn in self.host.clients.values():
            info = conn.info
            out.append({"slot": conn.slot, "pid": conn.pid, "group": info.group[:MAX_TEXT] if info else "",
                        "rank": info.rank if info else -1, "requests": conn.requests, "errors": conn.errors,
                        "connected_s": round(now - conn.created, 3)})
        return out
