"""The scheduler half of the vLLM connector: prefetch sessions, load and store plans.

One instance in vLLM's scheduler (the EngineCore process), deciding for every TP rank.

Per request (:class:`ReqState`), driven by vLLM's scheduler hooks:

* ``get_num_new_matched_tokens`` — the request is a scheduling candidate.  Its first call
  starts a prefetch session with the prompt's full chain and answers ``None`` (vLLM skips the
  request and asks again next step) until the session is terminal; then the session's
  drained prefix ``P`` (pinned on the sidecar under its prefetch lease) gives
  ``(P × block_size − num_computed_tokens, True)``: an asynchronous load.  No prefix beyond
  the local hit, or the sidecar unavailable: ``(0, False)``, a miss.
* ``update_state_after_alloc`` — vLLM's blocks for those tokens: a :class:`LoadSpec`.
* ``build_connector_meta`` — this step's loads, and a :class:`StoreSpec` for every request
  whose computed prompt blocks grew, under one step number (the workers' decision key).
* ``update_connector_output`` — ``finished_recving`` (every rank is done, vLLM aggregates):
  the session is ended, which drops its prefetch lease.
* ``request_finished`` and preemption (``preempted_req_ids``) — the session is aborted
  (stop, drain, release); a preempted request starts a new attempt when it comes back.

**Lease hand-off** (see the README's vLLM section).  This client is the group
``<group>#scheduler`` on the sidecar, apart from the worker ranks' group ``<group>``: it owns
the sessions, and its death aborts them and drops their prefetch leases at once (the sidecar
reclaims a dead client's group when no other client of it remains).  The prefix stays pinned
by the prefetch lease until every rank reported its load finished; each worker rank pins it
again under its own share of a group GET before copying, so the two pins overlap and the
blocks can never be evicted under a copy, and a dead rank's share dies with it.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid

from kvsidecar.shm.chain import length as chain_len, span as chain_span
from kvsidecar.shm.layout import KVLayout

from .kv_client import KVConnector
from .vllm_config import VllmConnectorConfig
from .reconnect import SidecarLink
from .vllm_meta import LoadSpec, StepPlan, StoreSpec

log = logging.getLogger(__name__)

NEW, PREFETCHING, READY, LOADING, DONE = "new", "prefetching", "ready", "loading", "done"


@dataclasses.dataclass
class ReqState:
    req_id: str
    sreq: str
    chain: bytes  # keys of the prompt's full blocks
    prompt_tokens: int
    attempt: int = 0
    phase: str = NEW
    session: bool = False  # a session of this attempt exists on the sidecar
    prefix: int = 0  # blocks of the terminal session's prefix
    local_blocks: int = 0  # vLLM's local hit (blocks) when the load was decided
    block_ids: list = dataclasses.field(default_factory=list)  # vLLM's blocks of this request (group 0)
    stored: int = 0  # prompt blocks offered to the pool so far


class SchedulerSide:
    def __init__(self, cfg: VllmConnectorConfig, layout: KVLayout, group: str):
        self.cfg = cfg
        self.layout = layout
        self.tpb = layout.tokens_per_block
        self.group = group
        # the request ids this incarnation gives the sidecar: vLLM's own ids repeat across engine
        # restarts (LLM() numbers them from 0), the sidecar's records must not
        self.nonce = uuid.uuid4().hex[:12]
        self.conn = KVConnector(cfg.instance, layout, rank=0, group=f"{group}#scheduler",
                                namespace=_namespace(cfg), timeout_s=cfg.call_timeout_s, populate="off")
        self.link = SidecarLink(self.conn, cfg.reattach_every_s, on_reattach=self._new_generation)
        self.reqs: dict[str, ReqState] = {}
        self.step = 0
        self._loads: list[LoadSpec] = []
        self.counters = {"sessions": 0, "hits": 0, "hit_tokens": 0, "misses": 0, "stores": 0}
        self.link.start()

    # -- vLLM hooks -------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self.reqs.get(request.request_id)
        if st is None:
            st = self._track(request)
        if st.phase == NEW:
            if chain_len(st.chain) * self.tpb <= num_computed_tokens:
                return self._miss(st)  # nothing beyond the local hit to restore
            view = self.link.call(lambda: self.conn.prefetch(
                st.chain, st.sreq, attempt=st.attempt, policy=self.cfg.policy, budget_s=self.cfg.budget_s,
                chunk_max_blocks=self.cfg.chunk_max_blocks, tokens=st.prompt_tokens))
            if view is None:
                return self._miss(st)
            st.session = True
            self.counters["sessions"] += 1
            st.phase = PREFETCHING
        else:
            view = None
        if st.phase == PREFETCHING:
            if view is None:
                view = self.link.call(lambda: self.conn.poll(st.sreq, attempt=st.attempt))
            if view is None or view.get("state") == "unknown":
                return self._miss(st)
            if view["state"] != "terminal":
                return None, False  # ask again next step; the request is skipped meanwhile
            st.prefix = int(view.get("prefix", 0))
            st.phase = READY
        if st.phase == READY:
            tokens = st.prefix * self.tpb - num_computed_tokens
            if tokens <= 0:
                return self._miss(st)
            st.local_blocks = num_computed_tokens // self.tpb
            return tokens, True
        return 0, False  # loading / done: nothing more from here

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        st = self.reqs.get(request.request_id)
        if st is None or num_external_tokens <= 0 or st.phase != READY:
            return
        n = num_external_tokens // self.tpb
        start, end = st.local_blocks, st.local_blocks + n
        ids = list(blocks.get_block_ids()[0])
        if len(ids) < end:
            log.error("vLLM gave %d blocks for a load of blocks [%d, %d) of %s; not loading",
                      len(ids), start, end, st.req_id)
            return
        self._loads.append(LoadSpec(st.req_id, st.sreq, st.attempt, chain_span(st.chain, 0, end), start,
                                    tuple(ids[start:end])))
        st.phase = LOADING
        self.counters["hits"] += 1
        self.counters["hit_tokens"] += num_external_tokens

    def build_connector_meta(self, so) -> StepPlan:
        self.step += 1
        for rid in getattr(so, "preempted_req_ids", None) or ():
            st = self.reqs.get(rid)
            if st is not None:
                self._end_session(st)
                st.attempt += 1
                st.phase = NEW
        self._track_blocks(so)
        loads, self._loads = tuple(self._loads), []
        return StepPlan(self.step, loads, tuple(self._stores(so)) if self.cfg.store else ())

    def update_connector_output(self, output) -> None:
        for rid in getattr(output, "finished_recving", None) or ():
            st = self.reqs.get(rid)
            if st is not None and st.phase == LOADING:
                self._end_session(st)  # every rank holds its own pin or is done: drop the prefetch lease
                st.phase = DONE

    def request_finished(self, request) -> tuple[bool, None]:
        st = self.reqs.pop(request.request_id, None)
        if st is not None:
            self._end_session(st)
        return False, None  # stores are synchronous (wait_for_save): vLLM may free the blocks now

    def close(self) -> None:
        for st in self.reqs.values():
            self._end_session(st)
        self.reqs.clear()
        self.link.close()

    # -- internals --------------------------------------------------------------------------------
    def _track(self, request) -> ReqState:
        prompt = request.prompt_token_ids or []
        chain = self.conn.hasher.chain(prompt) if prompt else b""
        st = ReqState(request.request_id, f"{self.nonce}:{request.request_id}", chain, len(prompt))
        self.reqs[request.request_id] = st
        return st

    def _miss(self, st: ReqState) -> tuple[int, bool]:
        self._end_session(st)
        st.phase = DONE
        self.counters["misses"] += 1
        return 0, False

    def _end_session(self, st: ReqState) -> None:
        """Abort the attempt's session: stop, drain, drop its prefetch lease (idempotent)."""
        if st.session:
            st.session = False
            self.link.call(lambda: self.conn.abort(st.sreq, attempt=st.attempt))

    def _new_generation(self) -> None:
        """A restarted sidecar holds nothing of ours: sessions are gone, stores start over."""
        for st in self.reqs.values():
            st.session = False
            st.stored = 0
            if st.phase in (PREFETCHING, READY):
                st.phase = DONE

    def _track_blocks(self, so) -> None:
        for new in so.scheduled_new_reqs:
            st = self.reqs.get(new.req_id)
            if st is not None:
                st.block_ids = list(new.block_ids[0]) if new.block_ids else []
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for rid, new_ids in zip(cached.req_ids, cached.new_block_ids):
            st = self.reqs.get(rid)
            if st is None:
                continue
            if rid in resumed:
                st.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                st.block_ids.extend(new_ids[0])

    def _stores(self, so):
        computed = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for rid, scheduled in so.num_scheduled_tokens.items():
            st = self.reqs.get(rid)
            if st is None or rid not in computed:
                continue
            # prompt blocks whose KV this step's forward completes (generated tokens are not
            # stored: speculative ones may still be rejected)
            n = min(computed[rid] + scheduled, st.prompt_tokens) // self.tpb
            n = min(n, chain_len(st.chain), len(st.block_ids))
            if n > st.stored:
                st.stored = n
                self.counters["stores"] += 1
                yield StoreSpec(rid, st.sreq, st.attempt, chain_span(st.chain, 0, n), tuple(st.block_ids[:n]))


def _namespace(cfg: VllmConnectorConfig) -> str:
    """vLLM's blocks live in their own key space (their page bytes are vLLM's page order)."""
    return f"vllm/{cfg.namespace}"
