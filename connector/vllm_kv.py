"""vLLM's paged KV tensors seen as the regions :class:`kvsidecar.connector.kv_copy.KVCopier` copies.

vLLM hands ``register_kv_caches`` one tensor per attention layer, logically ``[B, H, N, C]``
(blocks, this rank's KV heads, ``block_size`` tokens, content: K and V side by side, or the
latent for MLA).  Each block's ``H × N × C`` elements are one dense run of bytes (any order
inside), and block ``b`` starts ``b × stride(0)`` elements from the layer's base.  A pool
block's shard of one layer is ``kv_factor`` regions of ``page_bytes / kv_factor`` (kvsidecar.shm.layout),
so this module gives the copier, per layer, ``kv_factor`` views over the same storage:
region-sized "pages" starting at the layer's base (K) and one region further (V).  vLLM block
``b`` is then copier page ``b × factor`` in both views, one memcpy per (block, layer, K/V).

The bytes are moved as they are: engines sharing a pool must use one attention backend
(one page order inside a block); :func:`page_order` names it for the logs.
"""

from __future__ import annotations

from kvsidecar.shm.layout import KVLayout

from .kv_copy import KVShapeError


def _dense(t) -> bool:
    """Whether ``t`` (one block) covers exactly ``numel`` consecutive elements, in any order."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expect = 1
    for s, n in dims:
        if s != expect:
            return False
        expect *= n
    return True


def page_order(t) -> str:
    """The physical order of the [H, N, C] axes inside one block, e.g. 'HNC'."""
    axes = sorted(zip(t.stride()[1:], "HNC"), reverse=True)
    return "".join(a for _, a in axes)


class PageViews:
    """Copier views over vLLM's KV tensors (``kv_caches``: layer name -> tensor, model order)."""

    def __init__(self, kv_caches: dict, layout: KVLayout, rank: int):
        if len(kv_caches) != layout.num_layers:
            raise KVShapeError(f"vLLM registered {len(kv_caches)} KV layers, the layout has {layout.num_layers}")
        L = layout
        self.names = list(kv_caches)
        self.layers = []
        self.factor = None
        self.num_blocks = None
        self.order = None
        region = L.region_bytes
        for name, t in kv_caches.items():
            if t.element_size() != L.itemsize:
                raise KVShapeError(f"{name}: {t.dtype} is not the layout's {L.dtype}")
            if t.dim() < 2:
                raise KVShapeError(f"{name}: a KV tensor of shape {tuple(t.shape)} has no block axis")
            block = t[0]
            page_bytes = block.numel() * t.element_size()
            if page_bytes != L.kv_factor * region or not _dense(block):
                raise KVShapeError(f"{name}: a vLLM block of shape {tuple(block.shape)} / strides {block.stride()} "
                                   f"is not {L.kv_factor} dense region(s) of {region} bytes "
                                   f"({L.tokens_per_block} tokens x {L.heads_per_shard} heads x {L.head_dim})")
            s0 = t.stride(0) * t.element_size()
            if s0 % region:
                raise KVShapeError(f"{name}: block stride {s0} B is not a multiple of the region size {region} B")
            factor = s0 // region
            if self.factor not in (None, factor) or self.num_blocks not in (None, t.shape[0]):
                raise KVShapeError(f"{name}: layers differ in block stride or count")
            self.factor, self.num_blocks = factor, t.shape[0]
            self.order = self.order or (page_order(t) if t.dim() == 4 else "?")
            elems = region // t.element_size()
            shape = (L.tokens_per_block, L.heads_per_shard, L.head_dim)
            strides = (L.heads_per_shard * L.head_dim, L.head_dim, 1)
            span = ((t.shape[0] - 1) * s0 + page_bytes) // region  # regions from the base to the end
            views = []
            for kv in range(L.kv_factor):
                views.append(t.as_strided((span - kv,) + shape, (elems,) + strides, t.storage_offset() + kv * elems))
            self.layers.append(tuple(views))
        self.is_cuda = self.layers[0][0].is_cuda
        self.device = self.layers[0][0].device

    def pages(self, block_ids) -> list:
        """Copier page indices of vLLM blocks ``block_ids``."""
        for b in block_ids:
            if not 0 <= b < self.num_blocks:
                raise KVShapeError(f"vLLM block {b} outside the KV cache of {self.num_blocks} blocks")
        return [b * self.factor for b in block_ids]
