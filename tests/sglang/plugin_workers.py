"""A TP rank of SGLang's server-side cache stack with the kvsidecar plugin applied (spawned
twice by ``test_plugin_controller.py``: gloo ``world_size=2``).

Each rank builds what the server builds for a plain MHA model -- SGLang's
``HybridCacheController`` over an anchor-only ``HostPoolGroup`` of one KV host pool, with
kvsidecar as its dynamic storage backend -- loads the plugin through SGLang's own
``load_plugins()`` (the ``sglang.srt.plugins`` entry point), and drives the controller the way
``UnifiedRadixCache`` does, calling the plugin's lifecycle at the points its
``KvSidecarRadixCache`` does (``demand`` at the first ``check_prefetch_progress``, ``end`` when
it is done or the request is released).  Every wait is bounded; results go back through a pipe.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import queue
import threading
import time
import traceback
from array import array

PAGE, HEADS, DIM, LAYERS = 16, 2, 32, 4  # HEADS per rank
DEV_TOKENS = 64 * PAGE
HOST_PAGES = 256
TP = 2


def run_ranks(target, *args, tp: int = TP, report_s: float = 240.0) -> list:
    """Run ``target(rank, *args, pipe)`` in ``tp`` spawned rank processes (genuine SGLang ranks
    of one TP group); each sends ``("ok", payload)`` or ``("error", traceback)`` once.  Returns
    the payloads in rank order; every process is joined (killed if it outlives the test)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(tp):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=target, args=(rank, *args, child), daemon=True)
        p.start()
        pipes.append(parent)
        procs.append(p)
    out = []
    try:
        for rank, pipe in enumerate(pipes):
            assert pipe.poll(report_s), f"rank {rank} did not report"
            status, payload = pipe.recv()
            assert status == "ok", payload
            out.append(payload)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(10)
    return out


def page_bytes(host, indices) -> bytes:
    ptrs, sizes = host.get_page_buffer_meta(indices)
    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))


def build(rank: int, instance: str, extra: dict):
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host import HostPoolGroup
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dev = MHATokenToKVPool(DEV_TOKENS, PAGE, torch.float16, HEADS, DIM, LAYERS, "cpu", False, start_layer=0,
                           end_layer=LAYERS)
    alloc = PagedTokenToKVPoolAllocator(DEV_TOKENS, PAGE, torch.float16, "cpu", dev, need_sort=False)
    host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, HOST_PAGES * PAGE // DEV_TOKENS, 0, PAGE,
                                "layer_first", pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                start_layer=0, end_layer=LAYERS, write_back_staging=dev.hicache_write_back_staging)
    mapping = {i: i for i in range(dev.layer_num)}
    group = HostPoolGroup([build_pool_entry(name=PoolName.KV, host_pool=host, device_pool=dev, layer_mapping=mapping,
                                            transfer_layer_id_max=len(mapping), is_anchor=True)])
    import torch.distributed as dist

    ctrl = HybridCacheController(
        alloc, group, PAGE, dist.group.WORLD, load_cache_event=threading.Event(), write_policy="write_through",
        io_backend="direct", storage_backend="dynamic", model_name="tiny-llama", transfer_layer_id_max=len(mapping),
        storage_backend_extra_config={"backend_name": "kvsidecar", "module_path": "kvsidecar.connector.hicache_backend",
                                      "class_name": "KvSidecarHiCacheStorage", "interface_v1": 1,
                                      "instance": instance, "verify_loads": "all", **extra})
    return host, ctrl


def wait_get(q, timeout_s=30.0):
    try:
        return q.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError("controller did not answer in time") from None


@dataclasses.dataclass
class ArmResult:
    arm: str
    rank: int
    hit_tokens: int
    completed_tokens: int
    data_ok: bool
    host_free_before: int
    host_free_after: int
    view: dict
    counters: dict
    sidecar: dict | None = None  # rank 0: the sidecar's books after both ranks finished the arm
    l3_read_blocks: int = 0
    started_delta: int = 0


def _books(conn) -> dict:
    s = conn.stats(check=True)
    return {"invariants": s["invariants"], "leases_live": s["leases"]["live"], "pinned": s["pool"]["pinned"],
            "staging": s["pool"]["staging"], "session_staging": s["sessions"]["outstanding_staging"],
            "started": sum(v for k, v in s["sessions"].items() if k.startswith("started_")),
            "l3_read_blocks": s["l3"].get("read_blocks_ok", 0)}  # a counter: absent = 0


def rank_main(rank: int, instance: str, port: int, arms: list, conn) -> None:
    try:
        conn.send(("ok", _rank_main(rank, instance, port, arms)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _rank_main(rank: int, instance: str, port: int, arms: list) -> list:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=TP, rank=rank)
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_size=TP, tp_rank=rank, pp_size=1, pp_rank=0, attn_dcp_size=1,
                                        attn_dcp_rank=0)
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.srt.plugins import load_plugins

    from kvsidecar.connector import sglang_plugin
    from kvsidecar.connector.sglang_config import SessionConfig

    load_plugins()  # SGLang's own loader: finds kvsidecar's entry point in the installed metadata
    assert all(sglang_plugin.hooks_applied().values()), sglang_plugin.hooks_applied()
    assert sglang_plugin.RADIX_CACHE_BACKEND in registered_radix_cache_backends()
    host, ctrl = build(rank, instance, {"model": "tiny-llama", "timeout_s": 5.0})
    backend = ctrl.storage_backend
    held = contextlib.ExitStack()
    try:
        refused = None
        try:
            sglang_plugin.activate(ctrl, "best_effort")
        except sglang_plugin.KvSidecarPluginError as exc:
            refused = str(exc)
        assert refused and "wait_complete" in refused, refused
        assert sglang_plugin.activate(ctrl, "wait_complete") is backend and backend.plugin_driven
        c = held.enter_context(backend.connection())  # checked out of the rank's pool for this thread
        results = []
        for i, spec in enumerate(arms):
            arm = spec["arm"]
            n_pages = spec["pages"]
            g = torch.Generator().manual_seed(1000 * i + 7)
            tokens = torch.randint(0, 32000, (n_pages * PAGE,), generator=g).tolist()
            hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
            # write-through of this rank's shard (SGLang's backup thread -> a group store)
            src = host.alloc(n_pages * PAGE)
            torch.manual_seed(97 * i + rank)
            host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).to(host.kv_buffer.dtype))
            want = page_bytes(host, src)
            ctrl.write_storage(src, tokens, hashes, None, extra_pools=None)
            op = wait_get(ctrl.ack_backup_queue)
            assert op.completed_tokens == n_pages * PAGE, op.completed_tokens
            host.free(src)
            host.kv_buffer.zero_()
            dist.barrier()
            if rank == 0:  # both shards published and written behind: flush the CPU pool
                from tests.helpers import wait_l3_idle

                wait_l3_idle(c, 30)
                assert c.lookup(backend._chain(hashes)) == n_pages
                c.flush()
                assert c.lookup(backend._chain(hashes)) == 0
                before = _books(c)
            dist.barrier()
            backend.config = dataclasses.replace(backend.config, sessions=SessionConfig(**spec["sessions"]))
            results.append(_prefetch_arm(rank, arm, spec, c, ctrl, host, backend, tokens, want,
                                         CacheRequestHandle, RadixKey))
            dist.barrier()  # both ranks are done with the arm (and have ended their sessions)
            if rank == 0:
                after = _books(c)
                results[-1].sidecar = after
                results[-1].l3_read_blocks = after["l3_read_blocks"] - before["l3_read_blocks"]
                results[-1].started_delta = after["started"] - before["started"]
            dist.barrier()
        return [dataclasses.asdict(r) for r in results]
    finally:
        held.close()
        ctrl.detach_storage_backend()
        dist.destroy_process_group()


def _prefetch_arm(rank, arm, spec, c, ctrl, host, backend, tokens, want, CacheRequestHandle, RadixKey):
    rid = f"req-{arm}"
    handle = CacheRequestHandle(rid=rid, attempt_id=0)
    free0 = host.available_size()
    sub = ctrl.submit_prefetch(handle, RadixKey(array("q", tokens)), None, None, [], None)
    pre = sub.operation
    hit = wait_get(ctrl.prefetch_hit_queue)  # the prefetch thread queried (kvsidecar: metadata) + MIN
    assert hit is pre, (hit, pre)
    hit_tokens = pre.storage_hit_count
    indices, alloc_len = ctrl.allocate_storage_hit(pre, hit_tokens, allow_partial=True,
                                                   min_tokens=ctrl.prefetch_threshold, evict_host=lambda n: 0)
    assert indices is not None and alloc_len == hit_tokens, (alloc_len, hit_tokens)
    pre.host_indices = indices
    ctrl.prefetch_buffer.put(pre)  # the I/O thread: batch_get_v1 waits on the session
    # the scheduler's first check_prefetch_progress (KvSidecarRadixCache): demand
    if arm == "best_effort":
        c.wait(rid, until=spec["demand_after_blocks"], timeout_s=10.0)  # some chunks landed first
    if arm == "terminate":
        c.wait(rid, until=spec["terminate_after_blocks"], timeout_s=10.0)
        # the request leaves mid-flight: release_aborted_request -> terminate_prefetch + end
        ctrl.terminate_prefetch(pre)
        backend.end(rid, 0)
    else:
        backend.demand(rid, 0)
    completed = 0
    deadline = time.monotonic() + 30
    while True:
        ack = wait_get(ctrl.ack_prefetch_queue)
        if ack.completed_tokens is not None:
            completed = max(completed, ack.completed_tokens)
        if ack.completed_req:
            break
        assert time.monotonic() < deadline
    view = c.wait(rid, terminal=True, timeout_s=10.0)  # terminal (read before the clean-up below)
    backend.end(rid, 0)  # check_prefetch_progress done (or the release): the plugin's clean-up
    got = page_bytes(host, indices[:completed]) if completed else b""
    data_ok = got == want[:len(got)]  # every page SGLang took is this rank's shard, bit-exact
    host.free(indices)
    return ArmResult(arm, rank, hit_tokens, completed, data_ok, free0, host.available_size(), view,
                     backend.stats(), None)

