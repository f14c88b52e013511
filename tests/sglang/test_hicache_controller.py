"""SGLang's own cache controller -- ``HybridCacheController``, the one the server instantiates
(``UnifiedRadixCache.init_hicache`` -> ``hybrid_pool_assembler.build_kv_only_stack`` for a plain
MHA model), with its backup, prefetch, IO and sync threads and gloo all-reduces -- and kvsidecar
as the storage backend: write-through, a reset of SGLang's host tier, prefetch back bit-exact, on
every host layout SGLang offers for MHA on CPU.  The test drives the controller the way
``UnifiedRadixCache`` does (``write_storage`` / ``submit_prefetch`` / ``prefetch_hit_queue`` /
``allocate_storage_hit`` / ``prefetch_buffer``)."""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from array import array

import pytest

sglang = pytest.importorskip("sglang")
torch = pytest.importorskip("torch")

from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host import HostPoolGroup  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from kvsidecar.connector.hicache_backend import layout_for_host_pool  # noqa: E402
from kvsidecar.sidecar.l3.master import free_port  # noqa: E402

pytestmark = pytest.mark.sglang

PAGE, HEADS, DIM, LAYERS = 16, 2, 32, 4
DEV_TOKENS = 64 * PAGE
HOST_PAGES = 512


@pytest.fixture(scope="module")
def tp_group():
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, attn_dcp_size=1,
                                        attn_dcp_rank=0)
    return dist.group.WORLD


def build(layout: str, instance: str, tp_group):
    """The server's stack for a plain MHA model (``build_kv_only_stack``), from the same pieces:
    the anchor-only ``HostPoolGroup`` of one KV host pool, and ``HybridCacheController`` over it.
    The host pool itself is built directly (unpinned, on CPU) instead of by
    ``build_kv_host_pool``, which reads the server's global args and pins its memory."""
    # the class the server's assembler instantiates
    assert hybrid_pool_assembler.HybridCacheController is HybridCacheController
    dev = MHATokenToKVPool(DEV_TOKENS, PAGE, torch.float16, HEADS, DIM, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS)
    alloc = PagedTokenToKVPoolAllocator(DEV_TOKENS, PAGE, torch.float16, "cpu", dev, need_sort=False)
    host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, HOST_PAGES * PAGE // DEV_TOKENS, 0, PAGE, layout,
                                pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                start_layer=dev.start_layer, end_layer=dev.end_layer,
                                write_back_staging=dev.hicache_write_back_staging)
    mapping = {i: i for i in range(dev.layer_num)}
    group = HostPoolGroup([build_pool_entry(name=PoolName.KV, host_pool=host, device_pool=dev, layer_mapping=mapping,
                                            transfer_layer_id_max=len(mapping), is_anchor=True)])
    ctrl = HybridCacheController(
        alloc, group, PAGE, tp_group, load_cache_event=threading.Event(), write_policy="write_through",
        io_backend="direct", storage_backend="dynamic", model_name="tiny-llama", transfer_layer_id_max=len(mapping),
        storage_backend_extra_config={"backend_name": "kvsidecar", "module_path": "kvsidecar.connector.hicache_backend",
                                      "class_name": "KvSidecarHiCacheStorage", "interface_v1": 1,
                                      "instance": instance, "verify_loads": "all"})
    return host, ctrl


def page_bytes(host, indices):
    ptrs, sizes = host.get_page_buffer_meta(indices)
    return b"".join(ctypes.string_at(p, s) for p, s in zip(ptrs, sizes))


def sidecar_overrides(tmp_path, layout):
    dev = MHATokenToKVPool(PAGE * 4, PAGE, torch.float16, HEADS, DIM, LAYERS, "cpu", False, start_layer=0, end_layer=LAYERS)
    host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE, layout,
                                pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                start_layer=0, end_layer=LAYERS, write_back_staging=dev.hicache_write_back_staging)
    lay = layout_for_host_pool(host, "tiny-llama", False)
    d = {f"layout.{k}": v for k, v in lay.as_dict().items()}
    d.update({"pool.num_blocks": 1024, "l3.file_dir": str(tmp_path / "l3")})
    return d


def wait_get(q, timeout_s=30):
    try:
        return q.get(timeout=timeout_s)
    except queue.Empty:
        raise AssertionError("controller did not answer in time") from None


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_write_through_reset_prefetch_back(sidecar_factory, instance, tmp_path, tp_group, layout):
    sidecar_factory(**sidecar_overrides(tmp_path, layout))
    host, ctrl = build(layout, instance, tp_group)
    try:
        n_pages = 208
        tokens = torch.randint(0, 32000, (n_pages * PAGE,)).tolist()
        hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
        assert len(hashes) == n_pages
        src = host.alloc(n_pages * PAGE)
        host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape).to(host.kv_buffer.dtype))
        want = page_bytes(host, src)
        # write-through of >= 200 pages via SGLang's backup thread (as write_backup_storage calls it)
        op_id = ctrl.write_storage(src, tokens, hashes, None, extra_pools=None)
        op = wait_get(ctrl.ack_backup_queue)
        assert op.id == op_id and op.completed_tokens == n_pages * PAGE
        # reset SGLang's host tier (what /flush_cache does to it)
        host.free(src)
        host.kv_buffer.zero_()
        # prefetch back, as UnifiedRadixCache does: submit, the prefetch thread queries (and
        # all-reduces the hit), the scheduler step allocates the hit, the IO thread reads
        handle = CacheRequestHandle(rid="req-1", attempt_id=0)
        submission = ctrl.submit_prefetch(handle, RadixKey(array("q", tokens)), None, None, [], None)
        pre = submission.operation
        assert pre is not None and submission.decision is None
        hit = wait_get(ctrl.prefetch_hit_queue)
        assert hit is pre and hit.handle == handle and pre.storage_hit_count == n_pages * PAGE
        indices, alloc_len = ctrl.allocate_storage_hit(pre, pre.storage_hit_count, allow_partial=True,
                                                       min_tokens=ctrl.prefetch_threshold, evict_host=lambda n: 0)
        assert indices is not None and alloc_len == n_pages * PAGE
        pre.host_indices = indices
        ctrl.prefetch_buffer.put(pre)
        done = False
        deadline = time.monotonic() + 30
        while not done and time.monotonic() < deadline:
            ack = wait_get(ctrl.ack_prefetch_queue)
            done = bool(ack.completed_req)
        assert done
        got = page_bytes(host, pre.host_indices)
        assert got == want  # bit-exact on this layout
        stats = ctrl.storage_backend.stats()
        assert stats["get_pages_ok"] == n_pages and stats["set_pages_ok"] == n_pages
    finally:
        ctrl.detach_storage_backend()
