"""One TP rank's KV connector: the sidecar ops plus copies into and out of engine tensors.

    conn = KVConnector("kvs0", layout, rank=r, group="engine-A")
    conn.attach()
    chain = conn.hasher.chain(tokens)
    lease = conn.get(chain, req="r1", step=s)        # held GET: the group's one decision
    conn.load(lease, kv_caches, pages[:lease.count])  # this rank's shard, straight from shm
    conn.release(lease)
    st = conn.store(chain, req="r1", step=s)          # staging for the non-resident tail
    conn.save(st, kv_caches, pages[st.start:st.start + st.count])
    conn.commit(st)                                   # published when every writer committed

Requests that carry ``req`` and ``step`` get the group's first answer (DESIGN §6).

Integrity (DESIGN §7): ``commit`` sends the XXH3-64 of this rank's shard of every staged
block, computed over the bytes in the shared pool after ``save``; a GET hands back the
checksums of this rank's shards, and ``load`` verifies the leased bytes against them before
copying: ``verify_loads="all"`` every block, ``"sample"`` (default) one block in
``SAMPLE_EVERY`` (rotating, so every position is covered over consecutive loads), ``"off"``
none.  A mismatch raises :class:`~kvsidecar.shm.errors.CorruptBlock` (nothing of that load is copied)
and is counted in ``integrity_stats()``.

At attach the connector maps the pool and, in a background thread, gives every page
of its mapping a page-table entry (on CUDA: ``cudaHostRegister``s it), so restores
never fault; ``populate="sync"`` does it inside ``attach``, ``"off"`` not at all.
``wait_populated`` / ``populate_stats`` say where it stands.
"""

from __future__ import annotations

import array
import dataclasses
import logging

from kvsidecar._native.checksum import first_mismatch, region_sums
from kvsidecar.shm.chain import KEY_BYTES
from kvsidecar.shm.errors import CorruptBlock, RemoteError
from kvsidecar.shm.layout import KVLayout
from kvsidecar.shm.protocol import MAX_SCAN
from kvsidecar.shm.segment import Segment

from .client import SidecarClient
from .hashing import BlockHasher
from .kv_copy import KVCopier
from .pool_populate import PoolPopulator, cuda_device_for_attach

log = logging.getLogger(__name__)

POPULATE_MODES = ("background", "sync", "off")
VERIFY_MODES = ("off", "sample", "all")
SAMPLE_EVERY = 8


@dataclasses.dataclass(frozen=True)
class Lease:
    id: int
    blocks: tuple
    count: int
    stale: bool = False  # a replayed group decision whose lease was gone for this rank: a miss
    sums: bytes = b""  # XXH3-64 of this rank's shard of each block (8 B each; empty: not checked)
    keys: bytes = b""  # the chain keys of the leased blocks (what the checksums are bound to)


@dataclasses.dataclass(frozen=True)
class Staging:
    id: int
    start: int  # chain index of the first staged block
    blocks: tuple
    count: int
    resident: int  # blocks resident before this store
    stale: bool = False  # a replayed group decision whose staging was gone: nothing to write
    keys: bytes = b""  # the chain keys of the staged blocks (their checksums are bound to them)


def _ids(blob: bytes) -> tuple:
    a = array.array("I")
    a.frombytes(blob)
    return tuple(a)


class KVConnector:
    def __init__(self, instance: str, layout: KVLayout, *, rank: int = 0, group: str = "engine",
                 namespace: str = "", timeout_s: float = 5.0, populate: str = "background",
                 cuda_register="auto", verify_loads: str = "sample", **client_kw):
        """``populate``: "background" (default), "sync" or "off" — making this rank's mapping
        fault-free at attach.  ``cuda_register``: "auto" (when torch already initialised CUDA
        in this process), True or False — register the mapping with CUDA at attach instead."""
        if populate not in POPULATE_MODES:
            raise ValueError(f"populate must be one of {POPULATE_MODES}")
        if verify_loads not in VERIFY_MODES:
            raise ValueError(f"verify_loads must be one of {VERIFY_MODES}")
        self.verify_loads = verify_loads
        self.checksums = True  # what the attached sidecar says (integrity.checksums)
        self._sample_phase = 0
        self.integrity = {"verified_blocks": 0, "corrupt_blocks": 0, "loads_refused": 0}
        self.populate = populate
        self.cuda_register = cuda_register
        self.populator: PoolPopulator | None = None
        self.layout = layout
        self.rank = rank
        self.client = SidecarClient(instance, group=group, rank=rank, group_size=layout.tp_size,
                                    layout=layout.as_dict(), timeout_s=timeout_s, **client_kw)
        self.hasher = BlockHasher(layout, namespace)
        self.pool: Segment | None = None
        self.copier: KVCopier | None = None

    def attach(self) -> dict:
        self._unmap()  # a re-attach (sidecar restart) maps the new incarnation's pool
        info = self.client.attach()
        self.checksums = bool(info.get("checksums", False))
        try:
            self.pool = Segment.attach(info["pool"])
        except BaseException:
            self.client.close()
            raise
        if self.populate != "off":
            device = cuda_device_for_attach(self.cuda_register)
            self.populator = PoolPopulator(self.pool, cuda_device=device)
        self.copier = KVCopier(self.layout, self.rank, self.pool.address, self.pool.size,
                               registration=self.populator)
        if self.populator is not None:
            if self.populate == "sync":
                self.populator.run()
            else:
                self.populator.start()
        return info

    def wait_populated(self, timeout_s: float | None = None) -> bool:
        """True once this rank's mapping is populated (or registered), or there is nothing to wait for."""
        return self.populator is None or self.populator.wait(timeout_s)

    def populate_stats(self) -> dict:
        """{method, done, bytes, size, seconds, error, cuda_registered} of the attach-time populate."""
        return {"method": "off", "done": True} if self.populator is None else self.populator.stats()

    def detach(self) -> None:
        self.client.detach()
        self._unmap()

    def close(self) -> None:
        self.client.close()
        self._unmap()

    def _unmap(self) -> None:
        if self.populator is not None:
            self.populator.stop()  # within one chunk; never populate an address about to be unmapped
            self.populator = None
        if self.copier is not None:
            self.copier.close()
            self.copier = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def __enter__(self):
        self.attach()
        return self

    def __exit__(self, *exc):
        self.detach()

    # -- ops ------------------------------------------------------------------------------------
    def lookup(self, chain: bytes, **group) -> int:
        return self.client.call("lookup", chain=chain, **group)["hit"]

    def get(self, chain: bytes, max_blocks: int | None = None, **group) -> Lease:
        return self.lease_of(self.client.call("get", chain=chain, max_blocks=max_blocks, **group), chain)

    @staticmethod
    def lease_of(r: dict, chain: bytes) -> Lease:
        """The :class:`Lease` a ``get`` answer of ``chain`` grants (also a scan's, ``poll_scan(get=True)``)."""
        return Lease(r["lease"], _ids(r["blocks"]), r["count"], bool(r.get("stale")), r.get("sums") or b"",
                     chain[:KEY_BYTES * r["count"]])

    def release(self, lease) -> bool:
        lid = lease.id if isinstance(lease, Lease) else lease
        if not lid:
            return False
        return self.client.call("release", lease=lid)["held"]

    def store(self, chain: bytes, l3: bool = False, **group) -> Staging:
        r = self.client.call("store", chain=chain, l3=l3 or None, ns=self.hasher.namespace or None, **group)
        return Staging(r["staging"], r["start"], _ids(r["blocks"]), r["count"], r["resident"], bool(r.get("stale")),
                       chain[KEY_BYTES * r["start"]:KEY_BYTES * (r["start"] + r["count"])])

    def commit(self, staging, ok: bool = True) -> dict:
        """Commit this rank's shard.  A non-writer rank (MLA, rank > 0) has nothing to commit."""
        sid = staging.id if isinstance(staging, Staging) else staging
        if not sid:
            return {"published": False, "nothing_to_write": True}
        if not self.layout.writes(self.rank) and ok:
            return {"published": None, "writer": False}
        sums = None
        if ok and self.checksums and isinstance(staging, Staging):  # (a bare id: the sidecar refuses it)
            sums = region_sums(self.pool.address, self._shard_offsets(staging.blocks), self.layout.shard_bytes,
                               staging.keys, self.layout.shard_of(self.rank))
        return self.client.call("commit", staging=sid, ok=ok, sums=sums)

    def _shard_offsets(self, blocks) -> array.array:
        L = self.layout
        base, bb = L.shard_of(self.rank) * L.shard_bytes, L.block_bytes
        return array.array("q", (b * bb + base for b in blocks))

    def integrity_stats(self) -> dict:
        """{verified_blocks, corrupt_blocks, loads_refused} of this connector's loads."""
        return dict(self.integrity)

    def verified(self, lease: Lease, start: int, n: int) -> int:
        """How many of leased blocks ``[start, start + n)`` may be copied: ``n``, or the offset of
        the first whose bytes do not match its checksum (per ``verify_loads``; counted)."""
        if self.verify_loads == "off" or n <= 0:
            return max(n, 0)
        if len(lease.sums) < 8 * (start + n) or len(lease.keys) < KEY_BYTES * (start + n):
            if self.checksums:  # a sidecar that checksums always sends them: treat as corrupt
                self.integrity["corrupt_blocks"] += 1
                log.warning("lease %d carries %d checksums for %d blocks", lease.id, len(lease.sums) // 8, start + n)
                return 0
            return n  # the sidecar runs with integrity.checksums = false: nothing to check against
        every = 1 if self.verify_loads == "all" else SAMPLE_EVERY
        phase = self._sample_phase
        self._sample_phase = (phase + 1) % SAMPLE_EVERY
        bad = first_mismatch(self.pool.address, self._shard_offsets(lease.blocks[start:start + n]),
                             self.layout.shard_bytes, lease.keys[KEY_BYTES * start:KEY_BYTES * (start + n)],
                             self.layout.shard_of(self.rank), lease.sums[8 * start:8 * (start + n)], every, phase)
        if bad >= 0:
            self.integrity["corrupt_blocks"] += 1
            self.integrity["verified_blocks"] += len(range((-phase) % every, bad, every))
            log.error("leased block %d (chain position %d) does not match its checksum: not loaded",
                      lease.blocks[start + bad], start + bad)
            return bad
        self.integrity["verified_blocks"] += len(range((-phase) % every, n, every))
        return n

    def restore(self, chain: bytes, timeout_s: float | None = None) -> dict:
        """Whole-chain restore from L3 into the pool (waits until done); then lookup/get."""
        return self.client.call("restore", chain=chain, ns=self.hasher.namespace or None, timeout_s=timeout_s)

    # -- prefetch sessions (DESIGN §5) ----------------------------------------------------------
    def prefetch(self, chain: bytes, req: str, *, policy: str | None = None, attempt: int = 0,
                 budget_s: float | None = None, chunk_max_blocks: int | None = None, tokens: int | None = None,
                 checkpoints=None, checkpoint_every: int | None = None, eta_s: float | None = None,
                 prefill_s_per_block: float | None = None, fixed_hit: bool = False, waiting: int | None = None,
                 wait: bool = True):
        """Start (or join) the session for (group, req, attempt) at queue entry, with the full chain.

        ``budget_s`` overrides the timeout policy's budget (default: the sidecar's
        ``min(max, base + per_ki_token × tokens / 1024)``; for ``cost_aware`` an optional cap).
        ``eta_s`` (seconds until the engine expects to start this request's prefill) and
        ``prefill_s_per_block`` are ``cost_aware``'s engine inputs; ``fixed_hit``: this engine fetches
        exactly the hit it is told when the query answers (``planned``), so nothing is read beyond
        that plan for it; ``waiting``: the queued requests its prefill would hold up (:meth:`poll`).
        Returns the session's view;
        with ``wait=False`` the request id at once (its view then comes with ``client.take``: the
        ring keeps order, so it has arrived once any later call on this connection returned)."""
        fields = dict(req=req, chain=chain, ns=self.hasher.namespace or None,
                      attempt=attempt or None, policy=policy, budget_s=budget_s,
                      chunk_max_blocks=chunk_max_blocks, tokens=tokens,
                      checkpoints=list(checkpoints) if checkpoints is not None else None,
                      checkpoint_every=checkpoint_every, eta_s=eta_s, prefill_s_per_block=prefill_s_per_block,
                      fixed_hit=fixed_hit or None, waiting=waiting)
        return self.client.call("prefetch", **fields) if wait else self.client.send("prefetch", **fields)

    def demand(self, req: str, attempt: int = 0, drain_s: float | None = None) -> dict:
        """The request became a scheduling candidate (stops best_effort, and cost_aware where
        nothing more pays).  ``drain_s``: the engine admits it within that many seconds -- a
        session the demand stopped (or that was already stopping) waits no longer than that for
        its reads in flight: it hands over what landed and leaves the rest behind."""
        return self.client.call("demand", req=req, attempt=attempt or None, drain_s=drain_s)

    def abort(self, req: str, attempt: int = 0) -> dict:
        """The request left: stop, drain, release everything its session held."""
        return self.client.call("abort", req=req, attempt=attempt or None)

    def poll(self, req: str, attempt: int = 0, step: int | None = None, eta_s: float | None = None,
             demand: bool = False, waiting: int | None = None) -> dict:
        """Session state; with ``step`` the group's first answer for that step.  ``eta_s``: a new
        estimate of when the prefill can start (``cost_aware`` re-plans with it, once per step).
        ``demand``: the request became a scheduling candidate, as :meth:`demand` (one round trip).
        ``waiting``: the queued requests its prefill would hold up now (``cost_aware`` weighs a
        block's prefill by them: :func:`kvsidecar.connector.adapter.waiting_behind`)."""
        return self.client.call("poll", req=req, attempt=attempt or None, step=step, eta_s=eta_s,
                                demand=demand or None, waiting=waiting)

    def poll_scan(self, polls: list, step: int | None = None, until_ready: bool = True, get: bool = False) -> list[dict]:
        """A scheduler's scan of its queue in one round trip: ``polls`` are ``(req, eta_s, demand)``,
        ``(req, eta_s, demand, attempt)`` or ``(req, eta_s, demand, attempt, waiting)`` in queue
        order (``waiting``: as :meth:`poll`'s), each answered exactly as
        :meth:`poll` would (same step, same group
        decision).  With ``until_ready`` the sidecar stops after the first request ready to admit
        (its session terminal or unknown), so nothing behind it is demanded.  Returns the views of
        the entries taken, in order (a refused entry: ``{"state": "error", ...}``).  ``get``: a
        terminal session the scan stops at is leased in the same round trip — its view's ``get``
        is a ``get`` answer (:meth:`lease_of` makes the lease; the caller releases it) or
        ``{"err", "msg"}``."""
        entries = []
        for req, eta_s, demand, *more in polls:
            e = {"req": req}
            if more and more[0]:
                e["attempt"] = more[0]
            if eta_s is not None:
                e["eta_s"] = eta_s
            if demand:
                e["demand"] = True
            if len(more) > 1 and more[1] is not None:
                e["waiting"] = more[1]
            entries.append(e)
        views = []
        for i in range(0, len(entries), MAX_SCAN):  # (a queue longer than one frame: in pieces)
            part = self.client.call("poll_scan", polls=entries[i:i + MAX_SCAN], step=step,
                                    until_ready=until_ready or None, get=(get and until_ready) or None)["views"]
            views.extend(part)
            if until_ready and len(part) < len(entries[i:i + MAX_SCAN]):
                break
        return views

    def wait(self, req: str, attempt: int = 0, until: int | None = None, terminal: bool = False,
             timeout_s: float = 5.0) -> dict:
        """Block (bounded, no polling: the sidecar answers when it can) until the session's L3
        query is done — or, with ``until``, until that many blocks are published; with
        ``terminal``, until it ended — or it is terminal, or ``timeout_s`` passed (then
        ``timed_out`` is set).  Returns its view."""
        return self.client.call("wait", timeout_s=timeout_s + self.client.timeout_s, req=req,
                                attempt=attempt or None, until=until, terminal=terminal or None, wait_s=timeout_s)

    def flush(self) -> int:
        """Evict every unpinned block from the CPU pool; returns how many."""
        return self.client.call("flush")["evicted"]

    def stats(self, check: bool = False) -> dict:
        r = self.client.call("stats", check=check or None)
        if check:
            r["stats"]["invariants"] = r.get("invariants", "")
        return r["stats"]

    # -- copies ---------------------------------------------------------------------------------
    def load(self, lease: Lease, kv_caches, pages, layers=None) -> int:
        """Copy this rank's shard of the first ``len(pages)`` leased blocks into ``pages``, after
        verifying them (``verify_loads``); raises ``CorruptBlock`` before copying on a mismatch."""
        n = len(pages)
        good = self.verified(lease, 0, n)
        if good < n:
            self.integrity["loads_refused"] += 1
            raise CorruptBlock(good, lease.blocks[good] if good < len(lease.blocks) else -1)
        return self.copier.load(lease.blocks[:n], kv_caches, pages, layers)

    def save(self, staging: Staging, kv_caches, pages, layers=None) -> int:
        if not self.layout.writes(self.rank):
            return 0
        return self.copier.save(staging.blocks[:len(pages)], kv_caches, pages, layers)


__all__ = ["KVConnector", "Lease", "Staging", "RemoteError", "CorruptBlock"]
