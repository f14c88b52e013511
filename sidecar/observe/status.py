"""The inspector's tables: live sessions, leases, pool by state, clients, rendered from one
``SidecarSnapshot`` (``kvsidecar.sidecar.observe.snapshot``).

The loop's stats publisher (``kvsidecar.sidecar.runtime.builtins``) writes them, with the stats,
into the control segment's seqlocked blob (``kvsidecar.shm.control``) — never per request, at most
every ``transport.stats_interval_ms`` after work.  The read-only inspector renders what is
published and never sends a request.  Tables are bounded (``MAX_ROWS`` each, with the total count
beside them) so the blob always fits its region: leases oldest first; sessions the running ones
oldest first, then the newest terminal ones.
"""

from __future__ import annotations

import time

from kvsidecar.sidecar.observe.snapshot import SidecarSnapshot, owner_text  # noqa: F401 (owner_text: re-export)

MAX_ROWS = 48
MAX_TEXT = 64  # characters of a request id / group name shown (the blob's size stays bounded)


def render_tables(snap: SidecarSnapshot) -> dict:
    return {"published_at": time.time(), "sessions": _sessions(snap), "leases": _leases(snap),
            "pool": _pool(snap), "clients": _clients(snap)}


def _sessions(snap: SidecarSnapshot) -> dict:
    if snap.sessions is None:
        return {"total": 0, "rows": []}
    rows = [{"session": r.session, "request": r.request[:MAX_TEXT], "group": r.group[:MAX_TEXT], "policy": r.policy,
             "state": r.state.value, "status": r.status.value if r.status is not None else "",
             "published": r.published, "target": r.target, "total": r.total, "age_s": round(r.age_s, 3),
             "demanded": r.demanded}
            for r in snap.sessions.rows[:MAX_ROWS]]
    return {"total": snap.sessions.total, "rows": rows}


def _leases(snap: SidecarSnapshot) -> dict:
    if snap.kv is None:
        return {"total": 0, "rows": []}
    rows = [{"lease": r.lease, "kind": r.kind, "owner": r.owner[:MAX_TEXT], "blocks": r.blocks,
             "age_s": round(r.age_s, 3), "ttl_s": round(r.ttl_s, 3) if r.ttl_s is not None else -1.0}
            for r in snap.kv.leases[:MAX_ROWS]]
    return {"total": snap.kv.leases_live, "rows": rows}


def _pool(snap: SidecarSnapshot) -> dict | None:
    if snap.kv is None:
        return None
    p = snap.kv.pool
    bb = p.block_bytes
    return {"blocks": p.blocks, "block_bytes": bb, "by_state": {st.value: n for st, n in p.by_state().items()},
            "reserved_bytes": p.staging * bb, "reserved_limit_bytes": p.reserved_limit_blocks * bb,
            "pinned_bytes": p.pinned * bb, "pinned_limit_bytes": p.pinned_limit_blocks * bb}


def _clients(snap: SidecarSnapshot) -> list:
    return [{"slot": c.slot, "pid": c.pid, "group": c.group[:MAX_TEXT], "rank": c.rank, "requests": c.requests,
             "errors": c.errors, "connected_s": round(c.connected_s, 3)}
            for c in snap.loop.clients]
