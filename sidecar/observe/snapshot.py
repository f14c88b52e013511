"""One typed snapshot per service, taken on the control thread; every view renders from it.

Each service's ``snapshot()`` returns one of the frozen dataclasses below (its ``PART`` names the
field of :class:`SidecarSnapshot` it fills).  The three readers render the same object:

* the ``stats`` op and the published stats blob: :meth:`SidecarSnapshot.stats` (each part's
  ``stats()``: the wire format, unchanged);
* the inspector's tables: ``kvsidecar.sidecar.observe.status.render_tables``;
* Prometheus: the table in ``kvsidecar.sidecar.observe.metrics`` (name, help, getter, labels).

Counters that a label is taken from are keyed by enums here (``ErrorCode``, ``Policy``,
``State``, ``Status``, :class:`LeaseKind`, :class:`LeaseCause`, :class:`PoolState`), so no
reader parses a counter's name.  A snapshot is a copy: it never aliases a service's state.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
import operator

from kvsidecar.shm.errors import ErrorCode

from kvsidecar.sidecar.prefetch.events import Policy, State, Status

RING_CORRUPTED = "ring_corrupted"  # the one error that is not a wire code: a client's ring broke


class PoolState(str, enum.Enum):
    FREE = "free"
    STAGING = "staging"
    RESIDENT_PINNED = "resident_pinned"
    RESIDENT_UNPINNED = "resident_unpinned"


class Resource(str, enum.Enum):
    """What an admission ran out of (``PoolManager.refusals``' keys)."""

    RESERVED = "reserved"
    PINNED = "pinned"
    ALLOCATOR = "allocator"


class LeaseKind(str, enum.Enum):
    GET = "get"
    PREFETCH = "prefetch"
    L3_PUT = "l3_put"
    STORE_PREFIX = "store_prefix"
    RESTORE_PREFIX = "restore_prefix"


class LeaseCause(str, enum.Enum):
    """Why a lease ended, as an operator asks about it (``LeaseTable.drop``'s reasons grouped)."""

    RELEASED = "released"
    HANDED_OFF = "handed_off"
    TTL = "ttl"
    CLIENT_GONE = "client_gone"
    ABORTED = "aborted"
    INTERNAL = "internal"  # a store / restore / L3 PUT ended its own lease

    @classmethod
    def of(cls, reason: str) -> "LeaseCause":
        return _CAUSES.get(reason, cls.INTERNAL)


_CAUSES = {"released": LeaseCause.RELEASED, "handed_off": LeaseCause.HANDED_OFF, "expired": LeaseCause.TTL,
           "client_gone": LeaseCause.CLIENT_GONE, "group_gone": LeaseCause.CLIENT_GONE,
           "aborted": LeaseCause.ABORTED}


def _names(counter: dict, prefix: str) -> dict:
    return {f"{prefix}{k.name.lower() if isinstance(k, ErrorCode) else k}": v for k, v in counter.items()}


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


ROWS_MAX = 48  # rows a snapshot carries per table (leases, sessions: the inspector's); every one is counted


def lease_rows(leases, now: float, limit: int | None = None) -> tuple:
    """The oldest ``limit`` (default :data:`ROWS_MAX`) live leases
    (``kvsidecar.sidecar.kv.leases.Lease``), oldest first: bounded work however many live
    (every lease is counted by :func:`lease_kinds`)."""
    oldest = heapq.nsmallest(ROWS_MAX if limit is None else limit, leases, key=operator.attrgetter("created"))
    return tuple(LeaseRow(lease=x.id, kind=x.kind, owner=owner_text(x), blocks=x.count, age_s=now - x.created,
                          ttl_s=x.deadline - now if x.deadline != float("inf") else None)
                 for x in oldest)


def lease_kinds(leases, now: float) -> dict:
    """kind -> (live leases, the oldest one's age s) over every live lease; every
    :class:`LeaseKind` present, and any other kind seen."""
    count: dict = {k.value: 0 for k in LeaseKind}
    first: dict = {}
    for x in leases:
        count[x.kind] = count.get(x.kind, 0) + 1
        if x.kind not in first or x.created < first[x.kind]:
            first[x.kind] = x.created
    return {k: (n, now - first[k] if k in first else 0.0) for k, n in count.items()}


def session_rows(running, ended, now: float, limit: int = ROWS_MAX) -> tuple:
    """The live sessions an operator looks at, at most ``limit``: ``running`` (not yet terminal,
    oldest first), then ``ended`` (terminal, kept for their GET, newest first; taken lazily).
    Records are ``kvsidecar.sidecar.prefetch.records.Record``.

    Bounded work: a busy node keeps thousands of terminal sessions for their GET
    (``retained_ttl_s``), and a row for every one of them, sorted, cost the control thread
    ~20 ms for 3,000 at every publish and every ``stats`` op."""
    picked = list(itertools.islice(running, limit))
    picked += itertools.islice(ended, limit - len(picked))
    return tuple(SessionRow(session=rec.id, request=str(rec.key[1]), group=str(rec.key[0]), policy=rec.policy,
                            state=rec.machine.state, status=rec.machine.status, published=rec.machine.published,
                            target=rec.machine.target, total=rec.machine.p.total, age_s=now - rec.created,
                            demanded=rec.demanded)
                 for rec in picked)


def session_states(running, ended: int) -> dict:
    """How many live sessions are in each :class:`State` (zeros included): ``running`` counted one
    by one, ``ended`` the number of terminal ones."""
    out = {st: 0 for st in State}
    for rec in running:
        out[rec.machine.state] += 1
    out[State.TERMINAL] += ended
    return out


# -- the loop ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ClientSnapshot:
    slot: int
    pid: int
    attached: bool
    group: str
    rank: int
    requests: int
    errors: int
    outbox: int
    detaching: bool
    submit_depth: int
    completion_depth: int
    connected_s: float

    def stats(self) -> dict:
        return {"slot": self.slot, "pid": self.pid, "attached": self.attached, "group": self.group,
                "rank": self.rank, "requests": self.requests, "errors": self.errors, "outbox": self.outbox,
                "detaching": self.detaching}


@dataclasses.dataclass(frozen=True)
class LoopSnapshot:
    """The control loop's own state: clients and counters.  ``counters`` holds the free-form
    ones (services add theirs to the loop's bag); ops and errors are keyed by what they count."""

    PART = "loop"
    instance: str
    generation: int
    pid: int
    clients: tuple[ClientSnapshot, ...]
    counters: dict  # name -> count (requests, errors, attaches, and the services' own)
    ops: dict  # op name -> requests dispatched to it
    errors: dict  # ErrorCode -> error completions
    rings_corrupted: int
    # the control thread's time by what it ran (``op:<op>``, ``event:<fn>``, ``timer:<fn>``):
    # name -> (count, seconds, max seconds); see ``kvsidecar.sidecar.runtime.loop.BusyTime``
    busy: dict = dataclasses.field(default_factory=dict)

    def busy_stats(self) -> dict:
        """``busy`` for the wire: name -> ``{"n", "ms", "max_ms"}``, the busiest first."""
        rows = sorted(self.busy.items(), key=lambda kv: -kv[1][1])
        return {k: {"n": n, "ms": round(s * 1e3, 3), "max_ms": round(mx * 1e3, 3)} for k, (n, s, mx) in rows}

    def error_counts(self) -> dict:
        """Error completions by label value: every wire code (0 when none) and ``ring_corrupted``."""
        out = {code.name.lower(): self.errors.get(code, 0) for code in ErrorCode}
        out[RING_CORRUPTED] = self.rings_corrupted
        return out

    def stats(self) -> dict:
        counters = dict(self.counters)
        counters.update(_names(self.ops, "op_"))
        counters.update(_names(self.errors, "errors_"))
        if self.rings_corrupted:
            counters[f"errors_{RING_CORRUPTED}"] = self.rings_corrupted
        return {"instance": self.instance, "generation": self.generation, "pid": self.pid,
                "clients": [c.stats() for c in self.clients], "counters": counters, "busy": self.busy_stats()}


# -- kv ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PoolSnapshot:
    blocks: int
    block_bytes: int
    free: int
    staging: int
    resident: int
    pinned: int
    evictable: int
    evicted: int
    reserved_limit_blocks: int
    pinned_limit_blocks: int

    def by_state(self) -> dict:
        return {PoolState.FREE: self.free, PoolState.STAGING: self.staging,
                PoolState.RESIDENT_PINNED: self.pinned, PoolState.RESIDENT_UNPINNED: self.resident - self.pinned}

    def stats(self) -> dict:
        return {"blocks": self.blocks, "block_bytes": self.block_bytes, "free": self.free, "staging": self.staging,
                "resident": self.resident, "pinned": self.pinned, "evictable": self.evictable,
                "evicted": self.evicted}


@dataclasses.dataclass(frozen=True)
class LeaseRow:
    lease: int
    kind: str
    owner: str
    blocks: int
    age_s: float
    ttl_s: float | None  # None: no deadline


@dataclasses.dataclass(frozen=True)
class KVSnapshot:
    PART = "kv"
    pool: PoolSnapshot
    leases: tuple[LeaseRow, ...]  # the oldest ones, oldest first, at most ROWS_MAX (lease_rows)
    lease_kinds: dict  # kind -> (live, oldest age s), every live lease counted (lease_kinds)
    lease_counters: dict  # LeaseTable's own counters (wire)
    lease_drops: dict  # LeaseCause -> leases dropped
    refusals: dict  # resource -> admissions refused or cut
    store: dict
    decisions: dict

    def leases_by_kind(self) -> dict:
        """kind -> (live, oldest age s); every :class:`LeaseKind` present, and any other kind seen."""
        return dict(self.lease_kinds)

    @property
    def leases_live(self) -> int:
        return sum(n for n, _ in self.lease_kinds.values())

    def stats(self) -> dict:
        ages = [age for n, age in self.lease_kinds.values() if n]
        return {"pool": self.pool.stats(),
                "leases": {"live": self.leases_live, "oldest_age_s": round(max(ages), 3) if ages else 0.0,
                           **self.lease_counters},
                "store": dict(self.store), "decisions": dict(self.decisions)}


# -- prefetch sessions ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SessionRow:
    session: int
    request: str
    group: str
    policy: str
    state: State
    status: Status | None
    published: int
    target: int
    total: int
    age_s: float
    demanded: bool


@dataclasses.dataclass(frozen=True)
class SessionsSnapshot:
    PART = "sessions"
    rows: tuple[SessionRow, ...]  # at most ROWS_MAX (session_rows: which ones)
    started: dict  # Policy -> sessions started
    counters: dict  # SessionManager's own counters (wire; ``started_*`` included)
    orphans: int
    outstanding_staging: int
    states: dict  # State -> live sessions in it, every one counted (session_states)

    @property
    def total(self) -> int:
        """Every live session (``rows`` shows at most ``ROWS_MAX`` of them)."""
        return sum(self.states.values())

    def by_state(self) -> dict:
        return dict(self.states)

    def count(self, name: str) -> int:
        return self.counters.get(name, 0)

    def stats(self) -> dict:
        by_state = {st.value: n for st, n in self.by_state().items() if n}
        return {"sessions": {"by_state": by_state, "outstanding_staging": self.outstanding_staging,
                             "orphans": self.orphans, **self.counters}}


# -- L3 ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CostSnapshot:
    latency_s: float
    s_per_block: float
    samples: int
    error: float
    write_samples: int = 0  # writes the estimate rests on while no read is measured


@dataclasses.dataclass(frozen=True)
class L3Snapshot:
    PART = "l3"
    block_bytes: int
    counters: dict  # the tier's counters (read_blocks_ok, lookup_errors, ...)
    backend: dict  # the backend's own stats (its name under "backend")
    read_s_per_block: float | None
    cost: CostSnapshot
    lanes: dict  # meta / read / write / pool_populate: free-form, for debugging
    puts_in_flight: int
    put_backlog_blocks: int
    loads_in_flight: int
    write_gate: dict | None = None  # kvsidecar.sidecar.l3.write_gate's stats (None: no gate)

    @property
    def backend_name(self) -> str:
        return str(self.backend.get("backend", "l3"))

    def stats(self) -> dict:
        c = self.cost
        cost = {"latency_ms": round(c.latency_s * 1e3, 3), "s_per_block_us": round(c.s_per_block * 1e6, 3),
                "mb_per_s": round(self.block_bytes / c.s_per_block / 1e6, 3) if c.s_per_block > 0 else 0.0,
                "samples": c.samples, "error": round(c.error, 4)}
        if c.write_samples:  # only while the estimate rests on writes (no read measured yet)
            cost["write_samples"] = c.write_samples
        return {"l3": {**self.counters, "cost": cost, **self.lanes, "backend": dict(self.backend),
                       "puts_in_flight": self.puts_in_flight, "put_backlog_blocks": self.put_backlog_blocks,
                       "loads_in_flight": self.loads_in_flight,
                       **({"write_gate": dict(self.write_gate)} if self.write_gate is not None else {})}}


# -- metrics (its own bookkeeping) ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MetricsSnapshot:
    PART = "metrics"
    port: int
    scrapes: int
    stale_scrapes: int
    terminal: dict  # (Policy value, Status value) -> sessions ended
    tokens: dict  # ("requested", "") | ("hit", tier) -> tokens

    def stats(self) -> dict:
        return {"metrics": {"port": self.port, "scrapes": self.scrapes, "stale_scrapes": self.stale_scrapes}}


# -- the whole sidecar ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SidecarSnapshot:
    """Every mounted service's snapshot, taken in one control-thread pass (consistent)."""

    loop: LoopSnapshot
    kv: KVSnapshot | None = None
    sessions: SessionsSnapshot | None = None
    l3: L3Snapshot | None = None
    metrics: MetricsSnapshot | None = None

    @classmethod
    def of(cls, loop: LoopSnapshot, parts) -> "SidecarSnapshot":
        fields = {}
        for part in parts:
            if part is None:
                continue
            if part.PART in fields:
                raise ValueError(f"two services snapshot {part.PART!r}")
            fields[part.PART] = part
        return cls(loop=loop, **fields)

    def parts(self) -> list:
        return [p for p in (self.loop, self.kv, self.sessions, self.l3, self.metrics) if p is not None]

    def stats(self) -> dict:
        """The ``stats`` op's answer (its wire format)."""
        out: dict = {}
        for part in self.parts():
            out.update(part.stats())
        return out


__all__ = ["ClientSnapshot", "CostSnapshot", "KVSnapshot", "L3Snapshot", "LeaseCause", "LeaseKind", "LeaseRow",
           "LoopSnapshot", "MetricsSnapshot", "Policy", "PoolSnapshot", "PoolState", "Resource", "SessionRow",
           "SessionsSnapshot", "SidecarSnapshot", "State", "Status", "RING_CORRUPTED", "ROWS_MAX", "lease_kinds",
           "lease_rows", "owner_text", "session_rows", "session_states"]
