"""A TP rank for ``test_plugin_eta.py`` (spawned twice, gloo ``world_size=2``): SGLang's own
``load_plugins()`` applies the plugin's hooks, among them the BEFORE hook on SGLang's genuine
``Scheduler.get_new_batch_prefill``; SGLang's ``HybridCacheController`` carries kvsidecar's
backend (``sessions.policy = "cost_aware"``); the waiting queue holds genuine SGLang ``Req``
objects.  The method runs on a scheduler stand-in whose batch builder (``_get_new_batch_prefill_raw``,
the part that needs a model) returns no batch.  Results go back through a pipe; waits are bounded.
"""

from __future__ import annotations

import threading
import traceback
import types
from array import array

from tests.waiting import wait_until

from . import plugin_workers as W

PAGES = 32
REQS = 3
BUSY_US = 400_000  # rank 0's prefill accounting before the test's requests: 1,024 tokens in 0.4 s


def rank_main(rank: int, instance: str, port: int, conn) -> None:
    try:
        conn.send(("ok", _rank_main(rank, instance, port)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _rank_main(rank: int, instance: str, port: int) -> dict:
    import collections

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=W.TP, rank=rank)
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_size=W.TP, tp_rank=rank, pp_size=1, pp_rank=0, attn_dcp_size=1,
                                        attn_dcp_rank=0)
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.srt.plugins import load_plugins
    from sglang.srt.sampling.sampling_params import SamplingParams

    from kvsidecar.connector import sglang_plugin

    load_plugins()
    from sglang.srt.managers.scheduler import Scheduler

    out = {"eta_hook_applied": sglang_plugin.eta_hook_applied(), "hooks": sglang_plugin.hooks_applied()}
    host, ctrl = W.build(rank, instance, {"model": "tiny-llama", "timeout_s": 5.0,
                                          "sessions": {"policy": "cost_aware", "chunk_max_blocks": 2}})
    backend = ctrl.storage_backend
    try:
        assert sglang_plugin.activate(ctrl, "wait_complete") is backend
        eta = sglang_plugin.eta_for(backend)
        eta.history = collections.deque(maxlen=64)
        now = [1000.0]
        eta.clock = lambda: now[0]  # the scheduler's time, advanced by the test below
        # every request's chain in L3 (write-through of this rank's shard), then the pool flushed
        g = torch.Generator().manual_seed(11)
        prompts = [torch.randint(3, 500, (PAGES * W.PAGE,), generator=g).tolist() for _ in range(REQS)]
        for tokens in prompts:
            src = host.alloc(PAGES * W.PAGE)
            ctrl.write_storage(src, tokens, get_storage_hash_str(tokens, None, page_size=W.PAGE), None,
                               extra_pools=None)
            assert W.wait_get(ctrl.ack_backup_queue).completed_tokens == PAGES * W.PAGE
            host.free(src)
        dist.barrier()
        with backend.connection() as c:
            if rank == 0:
                wait_until(lambda: c.stats()["l3"]["puts_in_flight"] == 0, 30, "the L3 write-through to land")
                c.flush()
        dist.barrier()
        # SGLang's scheduler as the hook sees it: genuine Reqs in admission order; this rank's
        # own (slightly different) wall-clock prefill accounting
        busy = BUSY_US if rank == 0 else BUSY_US * 103 // 100
        sched = _Scheduler(waiting_queue=[], chunked_req=None, prefill_delayer=None,
                                      total_prefill_busy_us=0, total_prefill_uncached_tokens=0,
                                      _get_new_batch_prefill_raw=lambda prefill_delayer_single_pass, running_batch:
                                      (None, running_batch))
        sched.tree_cache = _Scheduler(_kvs_eta=eta)
        plans = []

        def iteration():
            plan = Scheduler.get_new_batch_prefill(sched, None)  # SGLang's method, hooks applied
            plans.append(plan.batch_to_run)

        iteration()  # the rate's baseline
        sched.total_prefill_busy_us, sched.total_prefill_uncached_tokens = 3_000_000, 68
        iteration()  # SGLang's server warm-up (compilation): not counted
        sched.total_prefill_busy_us, sched.total_prefill_uncached_tokens = 3_000_000 + busy, 68 + 1024
        iteration()  # learns the rate from SGLang's counters
        reqs = []
        for i, tokens in enumerate(prompts):
            req = Req(f"eta-req-{i}", "", array("q", tokens), SamplingParams(max_new_tokens=1))
            # prefetch_from_storage (scheduler thread, before the request joins the queue)
            out.setdefault("queue_entry_eta", []).append(eta.at_queue_entry(sched, req.rid, 0)[0])
            keys = get_storage_hash_str(tokens, None, page_size=W.PAGE)
            hit = []
            t = threading.Thread(target=lambda: hit.append(_exists(backend, req.rid, keys)))  # SGLang's prefetch thread
            t.start()
            t.join(30)
            out.setdefault("hits", []).append(hit[0] if hit else None)
            with backend.connection() as c:
                out.setdefault("views", []).append(c.poll(req.rid))
            sched.waiting_queue.append(req)
            reqs.append(req)
        iteration()  # queue of three: their ETAs
        iteration()  # nothing moved: no update
        now[0] += 0.3
        sched.waiting_queue.pop(0)  # the first request was prefilled, in 0.3 s
        sched.total_prefill_busy_us += 300_000 if rank == 0 else 309_000
        sched.total_prefill_uncached_tokens += PAGES * W.PAGE
        iteration()
        sched.chunked_req = Req("eta-chunked", "", array("q", prompts[0] * 2), SamplingParams(max_new_tokens=1))
        iteration()  # a chunked prefill of 1,024 tokens runs ahead of both
        wait_until(lambda: eta.counters["sent"] >= eta.counters["planned"], 10, "the ETA sender to send every planned update")
        out["plans"] = plans
        out["history"] = [list(map(list, h[1])) for h in eta.history]
        out["counters"] = dict(eta.counters)
        out["sent_log"] = getattr(eta, "sent_log", [])
        dist.barrier()
        for req in reqs:
            backend.end(req.rid, 0)
        dist.barrier()
        if rank == 0:
            with backend.connection() as c:
                # aborted sessions drain the reads they have in flight
                wait_until(lambda: c.stats()["sessions"]["outstanding_staging"] == 0, 10, "aborted sessions to drain")
                s = c.stats(check=True)
                out["books"] = {"invariants": s["invariants"], "leases_live": s["leases"]["live"],
                                "pinned": s["pool"]["pinned"], "session_staging": s["sessions"]["outstanding_staging"]}
        eta.close()
        return out
    finally:
        ctrl.detach_storage_backend()
        dist.destroy_process_group()


class _Scheduler(types.SimpleNamespace):
    """What the hook reads of SGLang's Scheduler (a plain object, like the real one)."""


def _exists(backend, rid, keys):
    with backend.bind(rid, 0):
        return backend.batch_exists(keys)
