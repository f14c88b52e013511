"""The worker half of the vLLM connector: one instance per TP rank.

* ``register_kv_caches``: the rank's KV tensors become copier views (``kvsidecar.connector.vllm_kv``)
  and the rank attaches to the sidecar as rank ``r`` of the group ``<group>``.
* ``start_load_kv``: for each :class:`LoadSpec` of the step, a GET under the group decision of
  ``(request, attempt, step)`` — this rank's own share of one group lease, taken while the
  scheduler's prefetch lease still pins the prefix — then a background copy of this rank's
  shard straight out of the shared mapping (``KVCopier``: the GIL-free CPU loop, or async
  host→device copies on its stream where CUDA is), after checking the leased bytes against
  their checksums (``verify_loads``).  Blocks the GET did not cover (evicted, sidecar gone, a
  stale replay), blocks that fail verification and copies that fail are load errors.
* ``get_finished`` (each step): finished copies release their share and report the request in
  ``finished_recving``; their failed vLLM blocks go to ``get_block_ids_with_load_errors`` in
  the same pass (vLLM asks right after), so ``kv_load_failure_policy: "recompute"`` recomputes
  from the first bad block.
* ``wait_for_save`` (after the forward): for each :class:`StoreSpec`, a group ``store``
  decision gives the staging blocks this rank writes its shard of; the blocks are published
  when every writer rank committed (the sidecar counts the commits).

All sidecar calls run on vLLM's worker thread (a client is single-threaded); the copy thread
touches only the mapping and vLLM's tensors.  A re-attach (new sidecar, new mapping) waits
until no copy reads the old mapping.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging

from kvsidecar.shm.layout import KVLayout

from .kv_client import KVConnector, Lease
from .vllm_config import VllmConnectorConfig
from .vllm_kv import PageViews
from .reconnect import SidecarLink
from .vllm_meta import LoadSpec, StepPlan

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Load:
    spec: LoadSpec
    lease: Lease | None
    job: concurrent.futures.Future | None
    failed: tuple  # vLLM block ids not covered by the lease


class WorkerSide:
    def __init__(self, cfg: VllmConnectorConfig, layout: KVLayout, rank: int, group: str, namespace: str):
        self.cfg = cfg
        self.layout = layout
        self.rank = rank
        self.conn = KVConnector(cfg.instance, layout, rank=rank, group=group, namespace=namespace,
                                timeout_s=cfg.call_timeout_s, populate=cfg.populate, verify_loads=cfg.verify_loads)
        self._loads: dict[str, _Load] = {}
        self.link = SidecarLink(self.conn, cfg.reattach_every_s, may_reattach=lambda: not self._loads)
        self.views: PageViews | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"kvsidecar-load{rank}")
        self._errors: set[int] = set()
        self._done: set[str] = set()
        self.counters = {"loaded_blocks": 0, "failed_blocks": 0, "stored_blocks": 0, "store_failures": 0}

    def register_kv_caches(self, kv_caches: dict) -> None:
        self.views = PageViews(kv_caches, self.layout, self.rank)
        log.info("kvsidecar rank %d: %d layers, %d vLLM blocks, page order %s, group %r",
                 self.rank, len(self.views.layers), self.views.num_blocks, self.views.order,
                 self.conn.client.group)
        self.link.start()

    # -- loads ------------------------------------------------------------------------------------
    def start_loads(self, plan: StepPlan) -> None:
        for spec in plan.loads:
            self._start(spec, plan.step)

    def _start(self, spec: LoadSpec, step: int) -> None:
        end = spec.start + len(spec.block_ids)
        lease = self.link.call(lambda: self.conn.get(spec.chain, max_blocks=end, req=spec.sreq,
                                                     attempt=spec.attempt or None, step=step))
        have = 0 if lease is None or lease.stale else max(0, min(lease.count, end) - spec.start)
        if have:  # the leased bytes against their checksums (integrity.verify_loads): a bad block cuts it
            have = self.conn.verified(lease, spec.start, have)
        failed = tuple(spec.block_ids[have:])
        job = None
        if have:
            blocks = lease.blocks[spec.start:spec.start + have]
            pages = self.views.pages(spec.block_ids[:have])
            job = self._pool.submit(self.conn.copier.load, blocks, self.views.layers, pages)
        self._loads[spec.req_id] = _Load(spec, lease, job, failed)
        if failed:
            log.warning("kvsidecar rank %d: %d of %d blocks of %s not available; vLLM recomputes them",
                        self.rank, len(failed), len(spec.block_ids), spec.req_id)

    def finished(self) -> set[str]:
        """Requests whose load ended since the last call (their errors are now reported)."""
        for rid, ld in list(self._loads.items()):
            if ld.job is not None and not ld.job.done():
                continue
            del self._loads[rid]
            failed = set(ld.failed)
            if ld.job is not None:
                exc = ld.job.exception()
                if exc is not None:
                    log.error("kvsidecar rank %d: copy for %s failed (%s); vLLM recomputes it", self.rank, rid, exc)
                    failed.update(ld.spec.block_ids)
            if ld.lease is not None and ld.lease.id:
                lease = ld.lease
                self.link.call(lambda: self.conn.release(lease))
            self.counters["loaded_blocks"] += len(ld.spec.block_ids) - len(failed)
            self.counters["failed_blocks"] += len(failed)
            self._errors |= failed
            self._done.add(rid)
        done, self._done = self._done, set()
        return done

    def take_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    @property
    def loads_in_flight(self) -> int:
        return len(self._loads)

    # -- stores -----------------------------------------------------------------------------------
    def save(self, plan: StepPlan) -> None:
        if not plan.stores or self.views is None:
            return
        if self.views.is_cuda:  # pragma: no cover - GPU hosts: the forward's KV must be written
            import torch

            torch.cuda.current_stream(self.views.device).synchronize()
        for spec in plan.stores:
            st = self.link.call(lambda: self.conn.store(spec.chain, l3=self.cfg.store_to_l3, req=spec.sreq,
                                                        attempt=spec.attempt or None, step=plan.step))
            if st is None or st.stale or not st.count:
                continue
            ok = st.start + st.count <= len(spec.block_ids)
            try:
                if ok:
                    self.conn.save(st, self.views.layers, self.views.pages(spec.block_ids[st.start:st.start + st.count]))
            except Exception:
                log.exception("kvsidecar rank %d: saving %s failed; its blocks are not published", self.rank, spec.req_id)
                ok = False
            r = self.link.call(lambda: self.conn.commit(st, ok=ok))
            if ok and r is not None:
                self.counters["stored_blocks"] += st.count
            else:
                self.counters["store_failures"] += 1

    def close(self) -> None:
        self._pool.shutdown(wait=True)  # no copy may read a mapping about to be unmapped
        self.finished()
        self.link.close()
