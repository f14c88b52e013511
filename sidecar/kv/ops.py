"""KV ops on the control thread: lookup, held GET, release, store → commit.

The pool's block state (index, leases, staging, the pool manager: ``kvsidecar.sidecar.kv.state``) is
shared with L3 ops and changed only through ``kv/``; the decisions are owned here; all of it is
touched only from the control thread.  Group-consistent decisions (DESIGN §6) apply when a
request carries ``req`` and ``step``: the first rank's answer is replayed to the others.
"""

from __future__ import annotations

import collections
import logging
import time

from kvsidecar._native.hashing import murmur3_128
from kvsidecar.shm.chain import count as id_count, length as chain_len
from kvsidecar.shm.errors import ErrorCode
from kvsidecar.shm.layout import KVLayout

from kvsidecar.sidecar.kv.decisions import DecisionBook
from kvsidecar.sidecar.kv.leases import LeaseError
from kvsidecar.sidecar.kv.request_ends import RequestEnds
from kvsidecar.sidecar.kv.state import KVState
from kvsidecar.sidecar.service import Host, OpError, Service
from kvsidecar.sidecar.kv.admission import Refusal

log = logging.getLogger(__name__)


def _question(msg: dict) -> bytes:
    """What a group decision answered: a digest of the chain and the bound it was asked with."""
    chain = msg.get("chain")
    if chain is None:
        return b""
    return murmur3_128(chain + str(msg.get("max_blocks")).encode())


class KVCore(Service):
    def __init__(self, host: Host, layout: KVLayout, num_blocks: int, limits, clock=time.monotonic,
                 checksums: bool = True, *, state: KVState | None = None, after_publish=None):
        """``state``: the pool's block state (built here when not given; the composition root
        builds it first, as L3 shares it); ``after_publish(staging)``: what follows a published
        engine store (L3 write-behind; ``kvsidecar.sidecar.l3.ops``)."""
        self.clock = clock  # injected: the executor bench drives a fake clock
        self.host = host
        self.layout = layout
        self.limits = limits
        if state is None:
            state = KVState.build(layout, num_blocks, limits, checksums)
        elif state.num_blocks != num_blocks:
            raise ValueError(f"state has {state.num_blocks} blocks, not {num_blocks}")
        self.state = state
        self.index = state.index
        self.leases = state.leases
        self.pool = state.pool  # also owns prefetch sessions' block state (holds, plans, results)
        self.staging = state.staging
        self.decisions = DecisionBook(limits.decision_ttl_s)
        self.request_ends = RequestEnds(limits.decision_ttl_s)  # ranks done with a request
        # one XXH3-64 per (block, shard), written by the block's writer (integrity.checksums)
        self.sums = state.sums
        self._reaper_due = float("inf")
        # Every holder of pins or staging, so the books balance: each provides
        # ``pins_per_block() -> Counter`` and ``staged_blocks() -> int`` (the pool manager holds
        # what prefetch sessions pin and stage).
        self.holders: tuple = (self.leases, self.staging, self.pool)
        # Ranks of a group that left (died or detached) and have not attached again: a
        # group lease made now is not held on their behalf (nobody would release it).
        self.departed: dict[str, set] = {}
        self._after_publish = after_publish

    def ops(self) -> dict:
        return {"lookup": self.op_lookup, "get": self.op_get, "release": self.op_release,
                "store": self.op_store, "commit": self.op_commit, "flush": self.op_flush}

    # -- helpers --------------------------------------------------------------------------------
    def validate_attach(self, conn, msg) -> None:
        if msg["group_size"] != self.layout.tp_size:
            raise OpError(ErrorCode.LAYOUT_MISMATCH,
                          f"group_size {msg['group_size']} != layout tp_size {self.layout.tp_size}")
        gone = self.departed.get(msg["group"])
        if gone is not None:  # the last check of an attach: it succeeds from here
            gone.discard(msg["rank"])
            if not gone:
                del self.departed[msg["group"]]

    def group_holders(self, conn) -> set:
        """Ranks that hold a share of a group lease made now: the group minus departed ranks."""
        info = conn.info
        return set(range(info.group_size)) - self.departed.get(info.group, set())

    def request_ended(self, conn, req, attempt) -> None:
        """``conn``'s rank is done with the request (its engine ended it): no group GET share is
        kept for it from now on, and the shares of earlier decisions it has not received are
        given up (``kvsidecar.sidecar.kv.request_ends``)."""
        info = conn.info
        if info is None or info.group_size <= 1:
            return
        now = self.clock()
        self.request_ends.end((info.group, req, attempt), info.rank, now)
        self.arm_reaper(self.request_ends.next_expiry())
        for rec in self.decisions.skip(info.group, "get", req, attempt, info.rank):
            lease = rec.result.get("lease")
            if lease and self.leases.release(lease, None, info.group, info.rank):
                self.host.counters["get_shares_given_up"] += 1

    def request_started(self, conn, req, attempt) -> None:
        """``conn``'s rank prefetches the request (again): its GETs are answered again."""
        if conn.info is not None:
            self.request_ends.start((conn.info.group, req, attempt), conn.info.rank)

    @staticmethod
    def _owner(conn) -> tuple:
        return (conn.slot, conn.token)

    def _decision_key(self, conn, op: str, msg: dict):
        if msg.get("req") is None or msg.get("step") is None:
            return None
        return (conn.info.group, op, msg["req"], msg.get("attempt", 0), msg["step"])

    def decided(self, conn, op, msg, compute):
        """Replay the group's recorded answer for this step, or compute and record it."""
        key = self._decision_key(conn, op, msg)
        question = _question(msg) if key is not None else b""
        if key is not None:
            read_before = self.decisions.has_read(key, conn.info.rank)
            rec = self.decisions.lookup(key, conn.info.rank)
            if rec is not None:
                if rec.question != question:  # the same (req, step) asked about another chain
                    if op == "get" and rec.result.get("lease") and not read_before:
                        # the share kept for it would never be released (one it received and
                        # may still be copying from stays until it releases)
                        self.leases.release(rec.result["lease"], None, conn.info.group, conn.info.rank)
                    return self._stale(conn, op, rec.result, "conflicting")
                if "error" in rec.result:
                    raise OpError(rec.result["error"][0], rec.result["error"][1])
                return self._replayable(conn, op, rec.result)
        try:
            result = compute(key is not None)
        except OpError as exc:
            if key is not None:  # a refusal is a decision too: every rank gets it
                self.decisions.record(key, conn.info.rank, conn.info.group_size,
                                      {"error": (exc.code, exc.message)}, self.clock(), question)
            raise
        if key is not None:
            self.decisions.record(key, conn.info.rank, conn.info.group_size, result, self.clock(), question)
            self.arm_reaper(self.decisions.next_expiry())
        return dict(result)

    def _replayable(self, conn, op: str, prior: dict) -> dict:
        """The group's recorded answer as this rank may receive it (DESIGN §6).

        The rule, enforced here for every replay: block ids in a reply are backed by a pin
        the receiving rank holds until it releases.  A GET's ids are replayed only while
        their group lease lives, and the rank gets a share of it if it had none (it was
        away when the lease was made, or came back after dying); a store's ids only while
        the staging is open and still waits for this rank's shard (a rank that writes
        nothing, MLA, gets the decision without ids).  Otherwise the rank gets a *stale
        miss* — ``count`` 0, no ids, ``stale: True`` — and ``decisions_stale`` counts it:
        every caller already recomputes on a miss (SGLang's MIN all-reduce of the completed
        pages then makes the whole group recompute that request), so a rank that came back
        can neither load another chain's bytes nor write into them.  ``lookup`` and ``poll``
        answers carry no block ids and replay as recorded."""
        out = dict(prior)
        if not out.get("count"):
            return out
        info = conn.info
        if op == "get":
            if self.leases.join(out["lease"], info.group, info.rank):
                return out
        elif op == "store":
            if not self.layout.writes(info.rank):  # (MLA) it writes nothing: the ids are not its to use
                out["blocks"] = b""
                return out
            st = self.staging.records.get(out["staging"])
            if st is not None and st.group == info.group and info.rank in st.writers:
                return out
        else:  # an op whose answer carries ids must say here how they stay backed
            raise AssertionError(f"replay of {op!r} with a block count has no backing rule")
        return self._stale(conn, op, prior, "stale")

    def _stale(self, conn, op: str, prior: dict, why: str) -> dict:
        """The miss a rank gets instead of a replay it may not follow (``decisions_<why>``):
        ``stale`` — what the record points at is gone for it; ``conflicting`` — it asked this
        (req, step) about another chain than the rank that decided (a reused request id)."""
        if op == "get":
            out = {"lease": 0, "blocks": b"", "count": 0}
        elif op == "store":
            out = {"staging": 0, "blocks": b"", "count": 0, "start": prior.get("start", 0),
                   "resident": prior.get("resident", 0)}
        elif op == "lookup":
            out = {"hit": 0}
        else:
            raise AssertionError(f"no stale answer for {op!r}")
        out["stale"] = True
        self.host.counters[f"decisions_{why}"] += 1
        log.info("%s %s replay for group %r rank %d: answered as a miss", why, op, conn.info.group, conn.info.rank)
        return out

    def arm_reaper(self, due) -> None:
        if due is not None and due < self._reaper_due:
            self._reaper_due = due
            self.host.call_at(due, self._reap)

    def _reap(self) -> None:
        now = self.clock()
        self._reaper_due = float("inf")
        expired = self.leases.reap(now)
        aborted = self.staging.reap(now)
        self.decisions.expire(now)
        self.request_ends.expire(now)
        if expired or aborted:
            log.info("reaper: %d leases expired, %d stagings aborted", expired, aborted)
        for due in (self.leases.next_deadline(), self.staging.next_deadline(), self.decisions.next_expiry(),
                    self.request_ends.next_expiry()):
            self.arm_reaper(due)

    def client_gone(self, conn) -> None:
        if conn.info is None:
            return
        owner = self._owner(conn)
        info = conn.info
        # A rank may hold several connections (a host's connection pool, one per concurrent
        # call): the rank's shares of group leases and its pending shards belong to the rank,
        # so they go only with its last connection; this connection's plain leases go now.
        rank_stays = info.kv and any(c is not conn and c.info is not None and c.info.kv
                                     and c.info.group == info.group and c.info.rank == info.rank
                                     for c in self.host.clients.values())
        self.leases.client_gone(owner, info.group, None if rank_stays else info.rank)
        if not rank_stays:
            self.staging.client_gone(info.group, info.rank)
            if info.kv:
                self.departed.setdefault(info.group, set()).add(info.rank)
        if info.kv and not any(c is not conn and c.info is not None and c.info.kv and c.info.group == info.group
                               for c in self.host.clients.values()):
            # the whole group left: shares and commits owed by ranks that never attached die with it
            self.leases.group_gone(info.group)
            self.staging.group_gone(info.group)
            # and its decisions: a new incarnation (an engine restarted under the same group
            # name) reuses request ids and steps, and must never be answered from the old one
            self.decisions.forget_group(info.group)
            self.request_ends.forget_group(info.group)

    # -- ops ------------------------------------------------------------------------------------
    def op_lookup(self, conn, msg) -> dict:
        def compute(grouped: bool) -> dict:
            chain = msg["chain"]
            hit = self.index.match(chain)
            counters = self.host.counters  # (once per group decision, like every ranked answer)
            counters["lookup_requested_blocks"] += chain_len(chain)
            counters["lookup_hit_blocks"] += hit
            return {"hit": hit}

        return self.decided(conn, "lookup", msg, compute)

    def op_get(self, conn, msg) -> dict:
        req = msg.get("req")
        ended = frozenset()
        if req is not None and conn.info.group_size > 1:
            ended = self.request_ends.ended((conn.info.group, req, msg.get("attempt", 0)))
            if conn.info.rank in ended:  # its I/O thread raced its scheduler's end: nothing to copy
                self.host.counters["gets_after_end"] += 1
                return {"lease": 0, "blocks": b"", "count": 0, "ended": True}
            if ended:  # the others still fetch it: the marks last as long as they do
                self.request_ends.renew((conn.info.group, req, msg.get("attempt", 0)), self.clock())

        def compute(grouped: bool) -> dict:
            chain = msg["chain"]
            limit = msg.get("max_blocks")
            n = self.index.match(chain, -1 if limit is None else limit)
            if n == 0:
                return {"lease": 0, "blocks": b"", "count": 0}
            blocks = self.index.resident_ids(chain, n)
            new_pins = self.index.count_unpinned(blocks)
            if not self.pool.pins_fit(new_pins):
                raise OpError(ErrorCode.LIMIT, f"pinning {new_pins} more blocks exceeds pinned_bytes_limit")
            now = self.clock()
            self.index.touch(blocks)
            if grouped:
                lease = self.leases.new(blocks, ttl_s=self.limits.lease_ttl_s, now=now, kind="get",
                                        group=conn.info.group, holders=self.group_holders(conn) - ended)
            else:
                lease = self.leases.new(blocks, ttl_s=self.limits.lease_ttl_s, now=now, kind="get",
                                        owner=self._owner(conn))
            self.arm_reaper(lease.deadline)
            return {"lease": lease.id, "blocks": blocks, "count": n}

        result = self.decided(conn, "get", msg, compute)
        self.host.counters["get_blocks"] += result["count"]  # leased to this rank (its shard is copied)
        if self.sums is not None and result["count"]:  # this rank's column: its blocks are pinned
            result["sums"] = self.sums.column(result["blocks"], self.layout.shard_of(conn.info.rank))
        if req is not None:  # the request's prefetch result is no longer needed (its
            # pins moved to this GET's lease above, in the same control-thread step)
            self.pool.hand_off((conn.info.group, msg["req"], msg.get("attempt", 0)))
        return result

    def op_release(self, conn, msg) -> dict:
        try:
            held = self.leases.release(msg["lease"], self._owner(conn), conn.info.group, conn.info.rank)
        except LeaseError as exc:
            raise OpError(exc.code, exc.message) from None
        return {"held": held}

    def op_store(self, conn, msg) -> dict:
        if self._decision_key(conn, "store", msg) is None and self.layout.writers() > 1:
            raise OpError(ErrorCode.BAD_FIELD, "store from a TP group needs req and step (every shard must be written)")

        def compute(grouped: bool) -> dict:
            chain = msg["chain"]
            start = self.index.match(chain)
            now = self.clock()
            plan = self.pool.prepare_stage(chain, start, None, "store", prefix_ttl_s=self.limits.staging_ttl_s,
                                           owner=("store", conn.info.group), now=now)
            if isinstance(plan, Refusal):
                raise OpError(plan.code, plan.message)
            if plan.count == 0:
                return {"staging": 0, "start": start, "count": 0, "blocks": b"", "resident": start}
            writers = {r for r in range(conn.info.group_size) if self.layout.writes(r)} if grouped \
                else {conn.info.rank}
            st = self.staging.open(plan, group=conn.info.group, writers=writers, ttl_s=self.limits.staging_ttl_s,
                                   now=now, ns=msg.get("ns") or "", l3=bool(msg.get("l3")))
            self.arm_reaper(st.deadline)
            return {"staging": st.id, "start": start, "count": plan.count, "blocks": plan.blocks, "resident": start}

        return self.decided(conn, "store", msg, compute)

    def op_commit(self, conn, msg) -> dict:
        st = self.staging.records.get(msg["staging"])
        if st is None:
            raise OpError(ErrorCode.UNKNOWN_ID, f"staging {msg['staging']} is not open (published, aborted or never issued)")
        if st.group != conn.info.group:
            raise OpError(ErrorCode.NOT_OWNER, f"staging {st.id} belongs to another group")
        if conn.info.rank not in st.writers:
            return {"published": False, "pending": len(st.writers)}
        if msg.get("ok", True) is False:
            self.staging.abort(st, "failed")
            return {"published": False, "aborted": True}
        if self.sums is not None:
            sums = msg.get("sums")
            if sums is None or len(sums) != 8 * st.count:
                self.host.counters["commit_bad_checksums"] += 1
                raise OpError(ErrorCode.BAD_FIELD, f"commit of staging {st.id} needs 'sums': 8 bytes per block "
                                                   f"({8 * st.count}), got {None if sums is None else len(sums)}")
            self.sums.record(st.blocks, self.layout.shard_of(conn.info.rank), sums)
        done = self.staging.commit(st, conn.info.rank)
        if done and self._after_publish is not None:
            self._after_publish(st)
        return {"published": done, "pending": len(st.writers), "count": id_count(st.blocks) if done else 0}

    def op_flush(self, conn, msg) -> dict:
        """Evict every unpinned resident block (the engine's ``/flush_cache`` for this tier)."""
        return {"evicted": self.index.evict(self.index.num_blocks)}

    # -- observability --------------------------------------------------------------------------
    def stats(self) -> dict:
        return self.snapshot().stats()

    def check(self) -> str:
        """Accounting invariants; '' when they hold, else what broke."""
        broken = self.index.check() or self.pool.check()
        if broken:
            return broken
        pins = collections.Counter()
        staged = 0
        for holder in self.holders:
            pins.update(holder.pins_per_block())
            staged += holder.staged_blocks()
        for b in range(self.index.num_blocks):
            if self.index.refcount(b) != pins.get(b, 0):
                return f"block {b}: refcount {self.index.refcount(b)} != pins held {pins.get(b, 0)}"
        if staged != self.index.staged:
            return f"staging holders account for {staged} blocks, pool {self.index.staged}"
        keyed = staged - self.pool.unkeyed_blocks()  # (a superseded read in flight writes into keyless ones)
        if keyed != len(self.index.staging):
            return f"staging holders account for {keyed} keyed blocks, staged keys {len(self.index.staging)}"
        return ""

    def snapshot(self):
        """Pool, leases, stores and decisions as one typed snapshot (``kvsidecar.sidecar.observe.snapshot``;
        the stats op, the inspector and Prometheus render it)."""
        from kvsidecar.sidecar.observe.snapshot import KVSnapshot, LeaseCause, PoolSnapshot, lease_kinds, lease_rows

        now = self.clock()
        pool = PoolSnapshot(**self.index.stats(), reserved_limit_blocks=self.pool.reserved_limit_blocks,
                            pinned_limit_blocks=self.pool.pinned_limit_blocks)
        drops: dict = {cause: 0 for cause in LeaseCause}
        for reason, n in self.leases.drops.items():
            drops[LeaseCause.of(reason)] += n
        return KVSnapshot(
            pool=pool, leases=lease_rows(self.leases.leases.values(), now),
            lease_kinds=lease_kinds(self.leases.leases.values(), now), lease_counters=dict(self.leases.counters),
            lease_drops=drops, refusals=dict(self.pool.refusals),
            store={"open": len(self.staging.records), "staged_blocks": self.staging.staged_blocks(),
                   "published_blocks": self.staging.published_blocks, "aborted_blocks": self.staging.aborted_blocks},
            decisions={"open": len(self.decisions.records), "made": self.decisions.made,
                       "replayed": self.decisions.hits})

