"""L3 on the control thread: write-behind after a store is published, and whole-chain restore.

* **Write-behind**: when a store flagged ``l3`` is published, its blocks are pinned by
  an ``l3_put`` lease (so they cannot be evicted or recycled while being read for the
  PUT) and written on the write lane.  Only blocks whose PUT succeeded count as
  published to L3.  Two things keep a store in the pool only, each counted: a full backlog
  (``l3_put_skipped_blocks``: L3 is behind) and the gate (``l3_put_gated_blocks``: L3 is too
  slow for a read of it to pay, ``kvsidecar.sidecar.l3.write_gate``).
* **Restore** (``restore`` op, answered when done): query L3 for the blocks beyond the
  resident prefix **before** reserving any staging; stage the contiguous hit range
  (pinning the resident prefix so the first restored block's parent stays); read on
  the read lane; publish the leading blocks whose data landed; free the rest.  The
  staging has no deadline: a block is never recycled while its read may be in flight.
"""

from __future__ import annotations

import time

from kvsidecar.shm.chain import count as id_count, length as chain_len, span as chain_span
from kvsidecar.sidecar.kv.admission import Refusal
from kvsidecar.sidecar.kv.state import KVState
from kvsidecar.sidecar.l3.tier import L3Tier
from kvsidecar.sidecar.l3.write_gate import WriteBehindGate
from kvsidecar.sidecar.service import DEFERRED, Host, Service


class L3Ops(Service):
    def __init__(self, host: Host, kv: KVState, tier: L3Tier, max_put_backlog_blocks: int = 0,
                 gate: WriteBehindGate | None = None):
        """``kv``: the pool's block state (``kvsidecar.sidecar.kv.state``); :meth:`write_behind` is
        given to ``KVCore`` as what follows a published store; ``gate``: None writes every store."""
        self.kv = kv
        self.gate = gate
        self.max_put_backlog = max_put_backlog_blocks or max(kv.num_blocks // 4, 1)
        self.put_backlog = 0  # blocks pinned by PUTs in flight
        self.tier = tier
        self.host = host
        self.counters = host.counters
        self.puts_in_flight = 0
        self.loads_in_flight = 0

    def ops(self) -> dict:
        return {"restore": self.op_restore}

    def stats(self) -> dict:
        return self.snapshot().stats()

    # -- write-behind ---------------------------------------------------------------------------
    def write_behind(self, st) -> None:
        if not st.l3:
            return
        n = id_count(st.blocks)
        if self.gate is not None and not self.gate.admits():
            self.counters["l3_put_gated_blocks"] += n  # no read of L3 could pay: the pool only
            return
        if self.put_backlog and self.put_backlog + n > self.max_put_backlog:  # (one store always fits)
            self.counters["l3_put_skipped_blocks"] += n  # L3 is behind: keep it in the pool only
            return
        self.put_backlog += n
        lease = self.kv.leases.new(st.blocks, ttl_s=float("inf"), now=time.monotonic(), kind="l3_put",
                                     owner=("l3", st.id))
        self.puts_in_flight += 1

        def done(ok):
            self.puts_in_flight -= 1
            self.put_backlog -= n
            self.kv.leases.drop(lease, "l3_put_done")
            self.counters["l3_published_blocks"] += sum(ok)
            self.counters["l3_put_failed_blocks"] += len(ok) - sum(ok)

        self.tier.store(st.ns, st.chain, st.blocks, done)

    # -- restore --------------------------------------------------------------------------------
    def op_restore(self, conn, msg):
        chain, ns = msg["chain"], msg.get("ns") or ""
        total = chain_len(chain)
        resident = self.kv.index.match(chain)
        if resident == total:
            return {"restored": 0, "resident": resident, "l3_hits": 0}
        rid = msg["id"]
        self.tier.lookup(ns, chain_span(chain, resident),
                         lambda hits: self._stage(conn, rid, chain, ns, resident, hits))
        return DEFERRED

    def _stage(self, conn, rid, chain, ns, queried_from, hits) -> None:
        kv = self.kv
        start = kv.index.match(chain)  # may have grown while L3 was queried
        end = queried_from + hits
        if end <= start:
            self.host.reply(conn, rid, {"restored": 0, "resident": start, "l3_hits": hits})
            return
        plan = kv.pool.prepare_stage(chain, start, end - start, "restore", prefix_ttl_s=float("inf"),
                                       owner=("load", rid), now=time.monotonic())
        if isinstance(plan, Refusal):
            self.host.reply(conn, rid, error=(plan.code, f"no staging room for the restore ({plan.message})"))
            return
        if plan.count == 0:
            self.host.reply(conn, rid, {"restored": 0, "resident": start, "l3_hits": hits})
            return
        # no deadline: a block is never recycled while its read may be in flight
        st = kv.staging.open(plan, group="", writers=set(), ttl_s=None, now=time.monotonic(), ns=ns, source="l3")
        self.loads_in_flight += 1
        count = plan.count

        def loaded(result):
            self.loads_in_flight -= 1
            n = kv.staging.complete_load(st, result.ok)
            self.counters["l3_restored_blocks"] += n
            self.host.reply(conn, rid, {"restored": n, "resident": start + n, "l3_hits": hits,
                                           "failed": count - n})

        self.tier.load(ns, st.chain, st.blocks, loaded)

    def snapshot(self):
        """The tier's snapshot with this service's in-flight counts (``kvsidecar.sidecar.observe.snapshot``)."""
        return self.tier.snapshot(puts_in_flight=self.puts_in_flight, put_backlog_blocks=self.put_backlog,
                                  loads_in_flight=self.loads_in_flight,
                                  write_gate=self.gate.stats() if self.gate is not None else None)


__all__ = ["L3Ops"]
