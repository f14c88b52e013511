"""The engine adapter: the scheduler hooks an SGLang-style engine calls, per TP rank.

Every hook degrades to a **miss** when the sidecar is absent, dead or slow: the
engine recomputes and never hangs (every call has a deadline; what a failure means and when
the connection is tried again is the connector's one policy, ``kvsidecar.connector.reconnect``:
a restarted sidecar is re-attached by the call that notices, an absent one tried again every
``reattach_every_s``, a stuck one skipped for that long).  All ranks of a TP group call the
same hooks with the same scheduler ``step``; the sidecar returns the group's first
answer, so ranks never disagree and never wait for each other.

SGLang mapping (``scheduler.py`` / HiCache controller):

=========================================  ==========================================
SGLang                                      adapter
=========================================  ==========================================
``prefetch_from_storage`` (queue entry)     :meth:`on_queue_entry`
``check_prefetch_progress`` (each step)     :meth:`check_progress`
``terminate_prefetch`` (candidate)          :meth:`on_candidate` (or ``check_progress(demand=True)``)
``release_aborted_request``                 :meth:`on_abort`
``init_load_back`` (admission)              :meth:`admit` → :class:`RestoreSlot`
load-back done / rollback                   :meth:`commit_restore` / :meth:`rollback_restore`
``write_backup_storage`` (after prefill)    :meth:`store_after_prefill`
=========================================  ==========================================

A scheduler that checks its whole waiting queue each step (stopping at the first ready request)
does it in one round trip with :meth:`check_queue`, with the same answers and effects.
"""

from __future__ import annotations

import collections
import dataclasses
import logging

from kvsidecar.shm.chain import key as chain_key, length as chain_len, span as chain_span
from kvsidecar.shm.layout import KVLayout

from .kv_client import KVConnector, Lease
from .reconnect import SidecarLink

log = logging.getLogger(__name__)


def blocks_not_computed(view: dict | None) -> int:
    """Of a queued request, the blocks its prefill will not compute, as far as its session's view
    says: an ended session's prefix; a running one's plan (``planned``: where it means to restore
    to, the L3 hit's end for every policy but cost_aware's current plan), not only what has landed.
    The ETA of the requests queued behind it counts only the rest: a request ahead that is still
    reading is skipped by the scan and computes only what it will not restore (counting its
    unlanded blocks as prefill told cost_aware a request behind it would start a whole prefill
    later than it could, and it read on behind the lane while the engine recomputed others)."""
    if not view:
        return 0
    if view.get("state") == "terminal":
        return view.get("prefix", 0) or 0
    return max(view.get("planned", 0) or 0, view.get("published", 0) or 0)


def waiting_behind(firsts: list) -> list[int]:
    """Per request of a waiting queue (``firsts``: each one's first block, in queue order, as any
    hashable key: its chain's first key, the first page's token ids; empty or None: unknown), how
    many of the requests queued behind it its prefill delays: those that do not start with its
    first block.
    cost_aware weighs a block's prefill by them (``waiting``: a read runs on the L3 lane beside
    the engine, a prefill holds every one of them up).  A request of the same prefix is not
    counted: this one's prefill or restore puts the shared blocks in the pool for it either way
    (counted, a request read its prefix while the engine, freed, recomputed its followers that
    would have been pool hits: virtual replay, L3/prefill 1 at 0.9 load, 4 of 12 streams worse
    against 2).  One pass from the back: linear in the queue."""
    out, behind, seen = [0] * len(firsts), 0, collections.Counter()
    for i in range(len(firsts) - 1, -1, -1):
        first = firsts[i]
        out[i] = behind - (seen[first] if first else 0)
        behind += 1
        if first:
            seen[first] += 1
    return out


def first_block(chain: bytes) -> bytes:
    """A chain's first key (:func:`waiting_behind`'s key; empty for an empty chain)."""
    return chain_key(chain, 0) if chain else b""


@dataclasses.dataclass
class RestoreSlot:
    """Pages restored for one request, held (with the lease) until committed or rolled back."""

    req: str
    lease: Lease | None
    pages: list
    tokens: int  # restored tokens (multiple of tokens_per_block)


@dataclasses.dataclass
class AdapterConfig:
    policy: str = "timeout"  # wait_complete | timeout | best_effort | cost_aware
    chunk_max_blocks: int | None = None
    budget_s: float | None = None  # timeout policy budget (None: the sidecar's formula); cost_aware: a cap
    # cost_aware: the engine's prefill cost of one block (None: learnt from observe_prefill)
    prefill_s_per_block: float | None = None
    store_to_l3: bool = True
    call_timeout_s: float = 2.0
    reattach_every_s: float = 1.0
    verify_loads: str | None = None  # off | sample | all (None: the connector's default, sample)


class EngineAdapter:
    def __init__(self, instance: str, layout: KVLayout, *, rank: int, group: str, namespace: str = "",
                 config: AdapterConfig | None = None):
        self.cfg = config or AdapterConfig()
        self.layout = layout
        self.rank = rank
        verify = {"verify_loads": self.cfg.verify_loads} if self.cfg.verify_loads else {}
        self.conn = KVConnector(instance, layout, rank=rank, group=group, namespace=namespace,
                                timeout_s=self.cfg.call_timeout_s, **verify)
        self.slots: dict[str, RestoreSlot] = {}
        self.prefetching: set[str] = set()
        self._chains: dict[str, bytes] = {}
        self.link = SidecarLink(self.conn, self.cfg.reattach_every_s, on_reattach=self._new_generation)
        self._prefill_s_per_block = self.cfg.prefill_s_per_block  # EWMA of observed prefills
        self._held: dict[str, int] = {}  # req -> blocks its session holds (last poll): the ETA of those behind
        self._sent: dict[str, int] = {}  # req -> id of its prefetch, whose answer is not taken yet
        self._ready: dict[str, Lease] = {}  # req -> the lease its scan took (check_queue(lease=True)), for admit

    # -- connection management (kvsidecar.connector.reconnect) -------------------------------------
    @property
    def available(self) -> bool:
        return self.conn.client.attached

    @property
    def misses_degraded(self) -> int:
        """Hook calls answered as a miss because the sidecar could not answer."""
        return self.link.misses

    def start(self) -> bool:
        """Attach now; False (logged) when the sidecar is not there: every hook is a miss until it is."""
        return self.link.start()

    def close(self) -> None:
        for req in list(self.slots):
            self.rollback_restore(req)
        self._drop_ready()
        self.link.close()

    def _new_generation(self) -> None:
        """Re-attached to a new sidecar: nothing we held survived the old one."""
        self.slots.clear()
        self.prefetching.clear()
        self._sent.clear()
        self._ready.clear()

    def _drop_ready(self, req: str | None = None) -> None:
        """Release the lease a scan took for ``req`` (None: every one) that no admission used."""
        for r in ([req] if req is not None else list(self._ready)):
            lease = self._ready.pop(r, None)
            if lease is not None and lease.id:
                self._call(lambda: self.conn.release(lease), None, retry=False)

    def _call(self, fn, default, *, retry: bool = True):
        """``fn()`` or ``default`` (a miss).  ``retry=False`` for a call bound to an id the old
        incarnation handed out (a lease or staging): never sent again to a new sidecar."""
        return self.link.call(fn, default, retry=retry)

    def chain(self, req: str, token_ids) -> bytes:
        ch = self._chains.get(req)
        if ch is None:
            ch = self.conn.hasher.chain(token_ids)
            self._chains[req] = ch
        return ch

    # -- hooks ------------------------------------------------------------------------------------
    @property
    def prefill_s_per_block(self) -> float | None:
        return self._prefill_s_per_block

    def observe_prefill(self, blocks: int, seconds: float) -> None:
        """The engine computed ``blocks`` blocks in ``seconds``: refines cost_aware's prefill cost."""
        if blocks <= 0 or not seconds > 0:
            return
        sample = seconds / blocks
        prev = self._prefill_s_per_block
        self._prefill_s_per_block = sample if prev is None else 0.7 * prev + 0.3 * sample

    def eta_s(self, blocks_ahead: int, busy_s: float = 0.0) -> float | None:
        """cost_aware's ETA: when a request can start its prefill, given the blocks the engine
        will prefill before it (queue ahead) and what the running batch still needs (``busy_s``).
        None while the prefill cost is unknown."""
        c = self._prefill_s_per_block
        return None if c is None else max(0.0, busy_s) + max(0, blocks_ahead) * c

    def restorable_blocks(self, req: str) -> int:
        """Blocks ``req`` will not prefill, as far as the engine knows (:func:`blocks_not_computed`
        of its last poll; 0 before one): an ETA for the requests queued behind it counts only the rest."""
        return self._held.get(req, 0)

    def on_queue_entry(self, req: str, token_ids, eta_s: float | None = None) -> None:
        """Start prefetching the request's full chain as it enters the waiting queue.

        ``eta_s``: when the engine expects to start this request's prefill (cost_aware)."""
        chain = self.chain(req, token_ids)
        if not chain:
            return
        c = self.cfg
        # sent, not waited for: the engine's loop goes on (the session starts as the sidecar reads
        # it; a demand or poll sent next rides the same wake-up).  Its answer is taken by the next
        # hook for this request (``_settle``): the ring keeps order, so it has arrived by then.
        rid = self._call(lambda: self.conn.prefetch(chain, req, policy=c.policy, budget_s=c.budget_s,
                                                    chunk_max_blocks=c.chunk_max_blocks,
                                                    tokens=len(token_ids), eta_s=eta_s,
                                                    prefill_s_per_block=self._prefill_s_per_block, wait=False),
                         None)
        if rid is not None:
            self.prefetching.add(req)
            self._sent[req] = rid

    def _settle(self, req: str) -> bool:
        """Take the answer of ``req``'s prefetch if it is still unread; False when that answer was
        an error (no session: the request is no longer prefetching, a miss).  Called after the
        hook's own call, whose answer came after the prefetch's; an answer that has not come
        (no call, or a sidecar gone) is dropped when it does — the next poll says the rest."""
        rid = self._sent.pop(req, None)
        if rid is None:
            return True
        reply = self._call(lambda: self.conn.client.take(rid), None, retry=False)
        if reply is None:  # not here yet (a hook that made no call first): drop it when it comes
            self.conn.client.discard(rid)
        elif not reply.get("ok"):
            log.warning("prefetch for %s refused: %s", req, reply.get("msg", ""))
            self.prefetching.discard(req)
            return False
        return True  # answered, or lost with a sidecar that is gone (its poll then says "unknown")

    def on_candidate(self, req: str) -> None:
        """The request became a scheduling candidate (stops best_effort)."""
        if req in self.prefetching:
            self._call(lambda: self.conn.demand(req), None)
            self._settle(req)

    def check_progress(self, req: str, step: int, eta_s: float | None = None,
                       demand: bool = False, waiting: int | None = None) -> tuple[bool, int]:
        """(ready to admit, tokens restorable).  Identical on every rank for the same step.
        ``demand``: the request just became a scheduling candidate — :meth:`on_candidate` and this
        check in one round trip (a scheduler that demands and checks in the same scan).
        ``waiting``: the queued requests its prefill would hold up (:func:`waiting_behind`;
        cost_aware weighs a block's prefill by them)."""
        if req not in self.prefetching:
            return True, 0
        view = self._call(lambda: self.conn.poll(req, step=step, eta_s=eta_s, demand=demand, waiting=waiting),
                          None)
        if not self._settle(req):  # (after the poll: its answer came with or before the poll's)
            return True, 0
        if view is not None:
            self._held[req] = blocks_not_computed(view)
        if view is None or view.get("state") in ("terminal", "unknown"):
            return True, (view or {}).get("prefix", 0) * self.layout.tokens_per_block
        return False, 0

    def check_queue(self, scan: list, step: int, lease: bool = False) -> tuple[int | None, int]:
        """:meth:`check_progress` for a scheduler's scan of its waiting queue, in one round trip.

        ``scan``: ``(req, eta_s, demand)`` for the whole waiting queue, in order (each entry also
        tells its session how many requests queued behind it its prefill would hold up:
        :func:`waiting_behind`).  Returns ``(position of the first
        request ready to admit, or None; its tokens restorable)`` — exactly what checking them
        one by one, stopping at the first ready one, returns, and with the same effect on the
        sidecar: a request behind the first ready one is neither polled nor demanded.  Identical
        on every rank for the same step.

        ``lease``: the caller admits the ready request at this ``step`` (:meth:`admit`): a
        terminal session the scan stops at is leased in the same round trip, and that admit
        sends no ``get`` of its own (a scan's lease that no admission takes is released by the
        next scan, an abort or :meth:`close`)."""
        self._drop_ready()
        asked = []
        behind = waiting_behind([first_block(self._chains.get(req, b"")) for req, _, _ in scan])
        for pos, (req, eta_s, demand) in enumerate(scan):
            if req not in self.prefetching:
                break  # ready without asking: the scan stops here
            asked.append((req, eta_s, demand, 0, behind[pos]))
        views = self._call(lambda: self.conn.poll_scan(asked, step=step, get=lease), None) if asked else []
        for pos, (req, *_) in enumerate(asked):
            view = views[pos] if views is not None and pos < len(views) else None
            if not self._settle(req):
                return pos, 0
            if view is not None and view.get("state") != "error":
                self._held[req] = blocks_not_computed(view)
            if view is None or view.get("state") in ("terminal", "unknown", "error"):
                got = (view or {}).get("get")
                if got is not None and "lease" in got:
                    self._ready[req] = self.conn.lease_of(got, self.chain_of(req))
                return pos, (view or {}).get("prefix", 0) * self.layout.tokens_per_block
        return (len(asked), 0) if len(asked) < len(scan) else (None, 0)

    def chain_of(self, req: str) -> bytes:
        """The chain :meth:`chain` made for ``req`` (empty when none was)."""
        return self._chains.get(req, b"")

    def wait_for_queue(self, reqs, timeout_s: float) -> bool:
        """An engine loop with nothing ready to admit: block until the first of ``reqs`` (queue
        order) whose prefetch is still running has ended, at most ``timeout_s`` (the sidecar
        answers when it ends: a wake-up, not a poll).  False, at once, when none is prefetching.
        The next :meth:`check_queue` says what is ready (identical on every rank), so one rank
        may wait for the group."""
        for req in reqs:
            if req in self.prefetching:
                self._call(lambda: self.conn.wait(req, terminal=True, timeout_s=max(0.0, timeout_s)), None)
                self._settle(req)
                return True
        return False

    def admit(self, req: str, token_ids, step: int, alloc_pages) -> RestoreSlot:
        """Lookup + held GET + load into freshly allocated engine pages.

        ``alloc_pages(n)`` returns ``n`` engine page indices (or None if the engine
        pool cannot take them now: the slot then restores nothing).  The slot stays
        pending — lease held — until :meth:`commit_restore` or :meth:`rollback_restore`.
        """
        chain = self.chain(req, token_ids)
        slot = RestoreSlot(req, None, [], 0)
        lease = self._ready.pop(req, None)  # taken by the scan that found it ready (check_queue)
        if lease is None and chain:
            lease = self._call(lambda: self.conn.get(chain, req=req, step=step), None)
        if lease is not None and lease.count:
            pages = alloc_pages(lease.count)
            if pages is None:
                self._call(lambda: self.conn.release(lease), None, retry=False)
            else:
                try:
                    self.conn.load(lease, self.kv_caches, pages)
                    slot = RestoreSlot(req, lease, list(pages), lease.count * self.layout.tokens_per_block)
                except Exception:
                    log.exception("load failed; recomputing")
                    self._call(lambda: self.conn.release(lease), None, retry=False)
                    slot = RestoreSlot(req, None, list(pages), 0)
        self.slots[req] = slot
        return slot

    def commit_restore(self, req: str) -> None:
        """The restored pages are now the engine's (inserted in its radix cache): drop the lease."""
        slot = self.slots.pop(req, None)
        self.prefetching.discard(req)
        self._held.pop(req, None)
        if slot is not None and slot.lease is not None:
            self._call(lambda: self.conn.release(slot.lease), None, retry=False)
        self._settle(req)

    def rollback_restore(self, req: str) -> list:
        """Admission failed after loading: release the lease; returns the pages to free."""
        slot = self.slots.pop(req, None)
        if slot is None:
            return []
        if slot.lease is not None:
            self._call(lambda: self.conn.release(slot.lease), None, retry=False)
        return slot.pages

    def on_abort(self, req: str) -> list:
        """The request left at any stage: abort its prefetch, release its slot; returns pages to free."""
        pages = self.rollback_restore(req)
        self._drop_ready(req)
        if req in self.prefetching:
            self._call(lambda: self.conn.abort(req), None)
            self.prefetching.discard(req)
        self._settle(req)
        self._chains.pop(req, None)
        self._held.pop(req, None)
        return pages

    def store_after_prefill(self, req: str, token_ids, pages: list, step: int) -> int:
        """Offer the request's full blocks (engine pages in chain order) to the pool (and L3)."""
        chain = self.chain(req, token_ids)
        n = min(chain_len(chain), len(pages))
        if n == 0:
            return 0
        st = self._call(lambda: self.conn.store(chain_span(chain, 0, n), l3=self.cfg.store_to_l3, req=req, step=step), None)
        if st is None or not st.count:
            return 0
        try:
            self.conn.save(st, self.kv_caches, pages[st.start:st.start + st.count])
            ok = True
        except Exception:
            log.exception("save failed")
            ok = False
        r = self._call(lambda: self.conn.commit(st, ok=ok), None, retry=False)
        self._chains.pop(req, None)
        return st.count if r and ok else 0

    # the engine sets its paged KV tensors here (per layer: (K, V) or (latent,))
    kv_caches: list = []
