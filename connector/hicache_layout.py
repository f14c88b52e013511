"""SGLang's host KV pool as a kvsidecar layout: one TP group whose shard ``r`` is exactly one
host-pool page of rank ``r`` (MLA: one replicated shard), and the token indices of host pages.

Pure mapping: no sidecar, no SGLang import (the pool is read through its attributes); used by
:mod:`kvsidecar.connector.hicache_backend`, the benchmark and the tests.
"""

from __future__ import annotations

from kvsidecar.shm.layout import KVLayout

_DTYPES = {"torch.float16": "float16", "torch.bfloat16": "bfloat16", "torch.float32": "float32",
           "torch.float8_e4m3fn": "float8_e4m3fn", "torch.float8_e5m2": "float8_e5m2", "torch.uint8": "uint8",
           "torch.int8": "int8"}


def layout_for_host_pool(pool, model_name: str | None, is_mla: bool, tp_size: int = 1) -> KVLayout:
    """The kvsidecar layout of a TP group whose shard ``r`` is one page of rank ``r``'s host pool
    (MLA: one replicated shard)."""
    dtype = _DTYPES.get(str(pool.dtype))
    if dtype is None:
        raise ValueError(f"unsupported host pool dtype {pool.dtype}")
    if is_mla:
        head_dim = getattr(pool, "kv_lora_rank", 0) + getattr(pool, "qk_rope_head_dim", 0)
        return KVLayout(model=model_name or "model", num_layers=pool.layer_num, num_kv_heads=1,
                        head_dim=head_dim, dtype=dtype, tokens_per_block=pool.page_size, tp_size=tp_size, mla=True)
    return KVLayout(model=model_name or "model", num_layers=pool.layer_num, num_kv_heads=pool.head_num * tp_size,
                    head_dim=pool.head_dim, dtype=dtype, tokens_per_block=pool.page_size, tp_size=tp_size)


def host_page_indices(pool, pages):
    """The token indices (int64 tensor) of host pool ``pages``, in order."""
    import torch

    ps = pool.page_size
    return torch.tensor([p * ps + i for p in pages for i in range(ps)], dtype=torch.int64)
