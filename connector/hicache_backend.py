"""kvsidecar as an SGLang HiCache storage backend (``--hicache-storage-backend dynamic``).

SGLang loads it with::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name": "kvsidecar", "module_path": "connector.hicache_backend",
        "class_name": "KvSidecarHiCacheStorage", "interface_v1": 1, "instance": "kvs0"}'

Each TP rank attaches to the node's sidecar as its own client.  SGLang's page keys are
chained SHA-256 hex strings without the TP rank; the backend maps each one to a 16-byte
kvsidecar key seeded with the layout fingerprint and the **shard** (``r<rank>/<tp>`` for MHA,
one shared shard for MLA, where only the storage writer writes).  A block holds one host-pool
page of this rank, gathered from / scattered to the buffers ``get_page_buffer_meta`` names —
one memcpy per buffer, straight between SGLang's host pool and the shared pool.

* ``batch_exists``: consecutive hits in the CPU pool; if short and L3 is configured, the
  sidecar restores the rest from L3 into the pool first (its read lanes, per-block results).
* ``batch_get_v1``: held GET of the leading resident blocks, copy into the host pages,
  release; the result is page by page.
* ``batch_set_v1``: staging for the non-resident pages, copy from the host pages, commit
  (and write behind to L3).
* When the sidecar is absent, dies or is slow, every call answers miss / False promptly
  and SGLang keeps serving; the backend re-attaches on a later call.

Importable without SGLang (then it derives from a small stand-in base).
"""

from __future__ import annotations

import array
import logging
import time

from native.copy import copy_regions
from native.hashing import murmur3_128
from shm.errors import ErrorCode, KvSidecarError, RemoteError
from shm.layout import KVLayout

from .kv_client import KVConnector

try:  # pragma: no cover - exercised in the SGLang virtualenv
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except ImportError:  # the rest of the project does not need SGLang
    class _Base:
        """Stand-in for ``HiCacheStorage`` when SGLang is not installed."""

        def register_mem_pool_host(self, mem_pool_host):
            self.mem_pool_host = mem_pool_host

log = logging.getLogger(__name__)

_DTYPES = {"torch.float16": "float16", "torch.bfloat16": "bfloat16", "torch.float32": "float32",
           "torch.float8_e4m3fn": "float8_e4m3fn", "torch.float8_e5m2": "float8_e5m2", "torch.uint8": "uint8",
           "torch.int8": "int8"}


def layout_for_host_pool(pool, model_name: str | None, is_mla: bool) -> KVLayout:
    """The kvsidecar layout whose block is exactly one page of this rank's host pool."""
    dtype = _DTYPES.get(str(pool.dtype))
    if dtype is None:
        raise ValueError(f"unsupported host pool dtype {pool.dtype}")
    if is_mla:
        head_dim = getattr(pool, "kv_lora_rank", 0) + getattr(pool, "qk_rope_head_dim", 0)
        return KVLayout(model=model_name or "model", num_layers=pool.layer_num, num_kv_heads=1,
                        head_dim=head_dim, dtype=dtype, tokens_per_block=pool.page_size, tp_size=1, mla=True)
    return KVLayout(model=model_name or "model", num_layers=pool.layer_num, num_kv_heads=pool.head_num,
                    head_dim=pool.head_dim, dtype=dtype, tokens_per_block=pool.page_size, tp_size=1)


class KvSidecarHiCacheStorage(_Base):
    def __init__(self, storage_config, kwargs=None):
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self.instance = extra.get("instance", "kvsidecar")
        self.namespace = extra.get("namespace", "")
        self.use_l3 = bool(extra.get("l3", True))
        self.timeout_s = float(extra.get("timeout_s", 2.0))
        self.reattach_every_s = float(extra.get("reattach_every_s", 1.0))
        self.rank = storage_config.tp_rank
        self.tp_size = storage_config.tp_size
        self.is_mla = storage_config.is_mla_model
        self.writer = storage_config.is_storage_writer
        # a stable model id for the layout fingerprint (default: SGLang's model name / path)
        self.model_name = extra.get("model") or storage_config.model_name
        self.shard = "mla" if self.is_mla else f"r{self.rank}/{self.tp_size}"
        self.mem_pool_host = None
        self.conn: KVConnector | None = None
        self._down_since: float | None = None
        self.counters = {"exists_calls": 0, "get_pages_ok": 0, "get_pages_missed": 0, "set_pages_ok": 0,
                         "set_pages_failed": 0, "degraded_calls": 0}

    # -- set-up -------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.layout = layout_for_host_pool(mem_pool_host, self.model_name, self.is_mla)
        ptrs, sizes = mem_pool_host.get_page_buffer_meta(_indices(mem_pool_host, [0]))
        if sum(sizes) != self.layout.block_bytes:
            raise ValueError(f"host pool page is {sum(sizes)} bytes, layout block is {self.layout.block_bytes}")
        self.entries_per_page = len(ptrs)
        self.entry_bytes = sizes[0]
        self.seed = murmur3_128(b"kvsidecar-hicache-v1" + self.layout.fingerprint() + self.shard.encode()
                                + self.namespace.encode())
        self._attach()

    def _attach(self) -> bool:
        self.conn = KVConnector(self.instance, self.layout, rank=0, group=f"hicache-{self.shard}",
                                namespace=self.namespace, timeout_s=self.timeout_s)
        try:
            self.conn.attach()
            self._down_since = None
            return True
        except KvSidecarError as exc:
            log.warning("kvsidecar %s unavailable (%s): storage misses until it is back", self.instance, exc)
            self.conn.close()
            self._down_since = time.monotonic()
            return False

    def _ready(self) -> bool:
        if self.conn is not None and self.conn.client.attached:
            return True
        if self._down_since is not None and time.monotonic() - self._down_since < self.reattach_every_s:
            return False
        if self.conn is not None:
            self.conn.close()
        return self._attach()

    def _call(self, fn, default):
        if self.mem_pool_host is None or not self._ready():
            self.counters["degraded_calls"] += 1
            return default
        try:
            return fn()
        except KvSidecarError as exc:
            log.warning("kvsidecar call failed (%s); answering miss", exc)
            self.counters["degraded_calls"] += 1
            if not self.conn.client.attached:
                self._down_since = time.monotonic()
            return default

    # -- keys and copies ----------------------------------------------------------------------------
    def _chain(self, keys) -> bytes:
        seed = self.seed
        return b"".join(murmur3_128(seed + k.encode()) for k in keys)

    def _copy(self, blocks, host_indices, n_pages: int, to_host: bool) -> None:
        """One memcpy per host-pool buffer of each page, between pool block and host page."""
        ptrs, _sizes = self.mem_pool_host.get_page_buffer_meta(host_indices[: n_pages * self.layout.tokens_per_block])
        e, eb = self.entries_per_page, self.entry_bytes
        pool_base = self.conn.pool.address
        bb = self.layout.block_bytes
        block_offs = array.array("q", (b * bb + j * eb for b in blocks[:n_pages] for j in range(e)))
        host_ptrs = array.array("q", ptrs)
        if to_host:
            copy_regions(0, host_ptrs, pool_base, block_offs, eb)
        else:
            copy_regions(pool_base, block_offs, 0, host_ptrs, eb)

    # -- the v1 interface -------------------------------------------------------------------------
    def batch_exists(self, keys, extra_info=None) -> int:
        self.counters["exists_calls"] += 1
        if not keys:
            return 0
        chain = self._chain(keys)

        def run():
            hit = self.conn.lookup(chain)
            if hit < len(keys) and self.use_l3:
                try:
                    self.conn.restore(chain)  # L3 -> CPU pool for the rest, then count again
                except RemoteError as exc:
                    if exc.code != ErrorCode.UNKNOWN_OP:
                        raise
                    self.use_l3 = False  # this sidecar runs without an L3 tier
                    return hit
                hit = self.conn.lookup(chain)
            return hit

        return self._call(run, 0)

    def batch_get_v1(self, keys, host_indices, extra_info=None) -> list:
        n = len(keys)
        if n == 0:
            return []
        chain = self._chain(keys)

        def run():
            lease = self.conn.get(chain)
            try:
                if lease.count:
                    self._copy(lease.blocks, host_indices, lease.count, to_host=True)
            finally:
                self.conn.release(lease)
            return lease.count

        got = self._call(run, 0)
        self.counters["get_pages_ok"] += got
        self.counters["get_pages_missed"] += n - got
        return [i < got for i in range(n)]

    def batch_set_v1(self, keys, host_indices, extra_info=None) -> list:
        n = len(keys)
        if n == 0:
            return []
        if not self.writer:  # MLA: rank 0 writes the one replicated shard
            return [True] * n
        chain = self._chain(keys)

        def run():
            st = self.conn.store(chain, l3=self.use_l3)
            if st.count:
                ok = True
                try:
                    idx = host_indices[st.start * self.layout.tokens_per_block:]
                    self._copy(st.blocks, idx, st.count, to_host=False)
                except Exception:
                    log.exception("copy into staging failed")
                    ok = False
                self.conn.commit(st, ok=ok)
                if not ok:
                    return [i < st.start for i in range(n)]
            # resident before, written now, or being written by another store: all present
            return [True] * n

        res = self._call(run, [False] * n)
        self.counters["set_pages_ok"] += sum(res)
        self.counters["set_pages_failed"] += n - sum(res)
        return res

    # -- the generic interface --------------------------------------------------------------------
    def exists(self, key) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key, target_location=None, target_sizes=None):
        out = self.batch_get([key], [target_location] if target_location is not None else None)
        return out[0] if out else None

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        """Values as uint8 tensors (or copied into ``target_locations`` tensors); None per miss."""
        import torch

        chain = self._chain(keys)

        def run():
            lease = self.conn.get(chain)
            out = []
            try:
                pool = self.conn.pool.view
                bb = self.layout.block_bytes
                for i in range(len(keys)):
                    if i >= lease.count:
                        out.append(None)
                        continue
                    b = lease.blocks[i]
                    data = torch.frombuffer(bytearray(pool[b * bb:(b + 1) * bb]), dtype=torch.uint8)
                    if target_locations is not None and target_locations[i] is not None:
                        target_locations[i].view(torch.uint8).view(-1).copy_(data)
                        out.append(target_locations[i])
                    else:
                        out.append(data)
            finally:
                self.conn.release(lease)
            return out

        return self._call(run, [None] * len(keys))

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value] if value is not None else None,
                              [target_location] if target_location is not None else None)

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        """Store whole-block values (tensors of exactly ``block_bytes``)."""
        src = values if values is not None else target_locations
        if src is None or len(src) != len(keys):
            return False
        if not self.writer:
            return True
        chain = self._chain(keys)

        def run():
            st = self.conn.store(chain, l3=self.use_l3)
            if not st.count:
                return True
            bb = self.layout.block_bytes
            view = self.conn.pool.view
            for i, b in enumerate(st.blocks):
                t = src[st.start + i].contiguous().view(-1)
                raw = t.view(__import__("torch").uint8).numpy().tobytes()
                if len(raw) != bb:
                    self.conn.commit(st, ok=False)
                    return False
                view[b * bb:(b + 1) * bb] = raw
            return bool(self.conn.commit(st).get("published"))

        return self._call(run, False)

    def clear(self) -> None:
        """Drop every unpinned block of the CPU pool (L3 keeps its copies)."""
        self._call(lambda: self.conn.flush(), 0)

    def get_stats(self):
        return dict(self.counters)

    def close(self) -> None:
        if self.conn is not None:
            try:
                self.conn.detach()
            except KvSidecarError:
                self.conn.close()
            self.conn = None


def _indices(pool, pages):
    import torch

    ps = pool.page_size
    return torch.tensor([p * ps + i for p in pages for i in range(ps)], dtype=torch.int64)
