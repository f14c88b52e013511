"""Copies between leased pool blocks and one rank's engine KV tensors.

Engine KV for this rank: per layer, a K and a V tensor of shape
``[num_pages, tokens_per_block, heads_per_shard, head_dim]`` (MLA: one latent tensor per
layer), page size == ``tokens_per_block``.  Page ``p`` of one (layer, K/V) is one
contiguous region of ``layout.region_bytes``, and so is this rank's shard of that
(layer, K/V) in pool block ``b`` (see ``kvsidecar.shm.layout``) — one memcpy each.

A host that keeps its own page buffers (SGLang's HiCache host pool) copies this rank's
shard of each block as ``pieces`` consecutive pieces, to or from host addresses it names
(:meth:`KVCopier.load_pieces` / :meth:`KVCopier.save_pieces`), or whole shards as bytes
(:meth:`KVCopier.read_shard` / :meth:`KVCopier.write_shard`).  Every copy checks its block
ids against the pool and its sizes against the layout before a byte moves.

CPU tensors: ``kvsidecar._native.copy.copy_regions`` copies all regions of one (layer, K/V) in a
single C loop with the GIL released, straight out of the shared mapping.
CUDA tensors: the pool mapping is ``cudaHostRegister``-ed once — at attach, in the
connector's background thread (``kvsidecar.connector.pool_populate``), or else here before the
first copy — and each region is an async host↔device copy on the copier's stream (the
caller synchronises per layer or at the end).  The CUDA path is exercised only where a
GPU exists.
"""

from __future__ import annotations

import array

from kvsidecar._native.copy import copy_regions
from kvsidecar.shm.layout import KVLayout


REGISTRATION_WAIT_S = 600.0  # bound on waiting for the attach-time cudaHostRegister


class KVShapeError(ValueError):
    """Engine tensors do not match the layout."""


class KVCopier:
    def __init__(self, layout: KVLayout, rank: int, pool_address: int, pool_bytes: int, registration=None):
        """``registration``: a ``PoolPopulator`` that may register the mapping with CUDA at attach."""
        self.layout = layout
        self._registration = registration
        self.rank = rank
        self.shard = layout.shard_of(rank)
        self.pool_address = pool_address
        self.pool_bytes = pool_bytes
        self.num_pool_blocks = pool_bytes // layout.block_bytes
        self._cuda_registered = False
        self._stream = None
        self._view: memoryview | None = None  # the pool as bytes (whole-shard reads and writes)

    # -- validation -----------------------------------------------------------------------------
    def check_kv(self, kv_caches) -> None:
        """``kv_caches[layer]`` is a tuple of kv_factor tensors of the layout's page shape."""
        L = self.layout
        if len(kv_caches) != L.num_layers:
            raise KVShapeError(f"{len(kv_caches)} layers given, layout has {L.num_layers}")
        for layer, tensors in enumerate(kv_caches):
            if len(tensors) != L.kv_factor:
                raise KVShapeError(f"layer {layer}: {len(tensors)} tensors, layout needs {L.kv_factor}")
            for t in tensors:
                if t.dim() != 4 or tuple(t.shape[1:]) != (L.tokens_per_block, L.heads_per_shard, L.head_dim):
                    raise KVShapeError(f"layer {layer}: shape {tuple(t.shape)} does not match "
                                       f"[pages, {L.tokens_per_block}, {L.heads_per_shard}, {L.head_dim}]")
                if t.element_size() != L.itemsize or not t.is_contiguous():
                    raise KVShapeError(f"layer {layer}: dtype/contiguity does not match the layout")

    def _check_blocks(self, blocks) -> None:
        for b in blocks:
            if not 0 <= b < self.num_pool_blocks:
                raise KVShapeError(f"block id {b} outside the pool")

    def _offsets(self, blocks, pages, num_pages: int):
        L = self.layout
        self._check_blocks(blocks)
        for p in pages:
            if not 0 <= p < num_pages:
                raise KVShapeError(f"page {p} outside the engine pool of {num_pages}")
        bb, rb = L.block_bytes, L.region_bytes
        block_off = array.array("q", (b * bb for b in blocks))
        page_off = array.array("q", (p * rb for p in pages))
        return block_off, page_off

    # -- copies ---------------------------------------------------------------------------------
    def load(self, blocks, kv_caches, pages, layers=None) -> int:
        """Pool blocks → engine pages (this rank's shard).  Returns bytes copied."""
        return self._copy(blocks, kv_caches, pages, layers, to_engine=True)

    def save(self, blocks, kv_caches, pages, layers=None) -> int:
        """Engine pages → staging pool blocks (this rank's shard).  Returns bytes copied."""
        return self._copy(blocks, kv_caches, pages, layers, to_engine=False)

    def _copy(self, blocks, kv_caches, pages, layers, to_engine: bool) -> int:
        return self._paused(lambda: self._copy_now(blocks, kv_caches, pages, layers, to_engine))

    def _paused(self, copy):
        reg = self._registration
        if reg is None or reg.done:
            return copy()
        with reg.copying():  # the attach-time populate pauses: two threads faulting one mapping are slower
            return copy()

    # -- host page buffers (SGLang's host pool) -------------------------------------------------
    def load_pieces(self, blocks, host_ptrs, piece_bytes: int) -> int:
        """This rank's shard of ``blocks`` → host memory: ``host_ptrs`` lists, block by block, the
        address of each of the shard's ``len(host_ptrs) // len(blocks)`` consecutive pieces of
        ``piece_bytes``.  Returns bytes copied."""
        return self._pieces(blocks, host_ptrs, piece_bytes, to_host=True)

    def save_pieces(self, blocks, host_ptrs, piece_bytes: int) -> int:
        """Host memory → this rank's shard of (staging) ``blocks``; the inverse of :meth:`load_pieces`."""
        return self._pieces(blocks, host_ptrs, piece_bytes, to_host=False)

    def _pieces(self, blocks, host_ptrs, piece_bytes: int, to_host: bool) -> int:
        L = self.layout
        n = len(blocks)
        if n == 0:
            return 0
        if len(host_ptrs) % n:
            raise KVShapeError(f"{len(host_ptrs)} host pieces for {n} blocks")
        per = len(host_ptrs) // n
        if piece_bytes <= 0 or per * piece_bytes != L.shard_bytes:
            raise KVShapeError(f"{per} pieces of {piece_bytes} B per block; a shard is {L.shard_bytes} B")
        self._check_blocks(blocks)
        if any(p <= 0 for p in host_ptrs):
            raise KVShapeError("a host piece has no address")
        base = self.shard * L.shard_bytes
        bb = L.block_bytes
        block_off = array.array("q", (b * bb + base + j * piece_bytes for b in blocks for j in range(per)))
        host = array.array("q", host_ptrs)
        if to_host:
            self._paused(lambda: copy_regions(0, host, self.pool_address, block_off, piece_bytes))
        else:
            self._paused(lambda: copy_regions(self.pool_address, block_off, 0, host, piece_bytes))
        return n * L.shard_bytes

    def read_shard(self, block: int) -> bytes:
        """A copy of this rank's shard of pool block ``block``."""
        at = self._shard_at(block)
        return self._paused(lambda: bytes(self._pool_view()[at:at + self.layout.shard_bytes]))

    def write_shard(self, block: int, data) -> None:
        """Write exactly one shard's bytes into this rank's shard of (staging) block ``block``."""
        raw = memoryview(data).cast("B")
        if raw.nbytes != self.layout.shard_bytes:
            raise KVShapeError(f"{raw.nbytes} B given; a shard is {self.layout.shard_bytes} B")
        at = self._shard_at(block)

        def write():
            self._pool_view()[at:at + raw.nbytes] = raw
        self._paused(write)

    def _shard_at(self, block: int) -> int:
        self._check_blocks((block,))
        return block * self.layout.block_bytes + self.shard * self.layout.shard_bytes

    def _pool_view(self) -> memoryview:
        if self._view is None:
            self._view = memoryview(_ctypes_buffer(self.pool_address, self.pool_bytes)).cast("B")
        return self._view

    def _copy_now(self, blocks, kv_caches, pages, layers, to_engine: bool) -> int:
        if len(blocks) != len(pages):
            raise KVShapeError(f"{len(blocks)} blocks but {len(pages)} pages")
        if not blocks:
            return 0
        self.check_kv(kv_caches)
        L = self.layout
        num_pages = kv_caches[0][0].shape[0]
        block_off, page_off = self._offsets(blocks, pages, num_pages)
        if kv_caches[0][0].is_cuda:
            return self._copy_cuda(blocks, kv_caches, pages, layers, to_engine)
        total = 0
        rb = L.region_bytes
        for layer in (range(L.num_layers) if layers is None else layers):
            for kv in range(L.kv_factor):
                t = kv_caches[layer][kv]
                base = self.pool_address + L.region_offset(self.shard, layer, kv)
                if to_engine:
                    copy_regions(t.data_ptr(), page_off, base, block_off, rb)
                else:
                    copy_regions(base, block_off, t.data_ptr(), page_off, rb)
                total += rb * len(blocks)
        return total

    # -- CUDA (runs only where a GPU exists) ----------------------------------------------------
    def _copy_cuda(self, blocks, kv_caches, pages, layers, to_engine: bool) -> int:  # pragma: no cover
        import torch

        L = self.layout
        reg = self._registration
        if not self._cuda_registered and reg is not None and reg.cuda_device is not None:
            reg.wait_registration(REGISTRATION_WAIT_S)  # registering at attach: wait, don't register twice
            if reg.cuda_registered:
                self._cuda_registered = True
                self._stream = torch.cuda.Stream()
        if not self._cuda_registered:
            rc = torch.cuda.cudart().cudaHostRegister(self.pool_address, self.pool_bytes, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister failed ({rc})")
            self._cuda_registered = True
            self._stream = torch.cuda.Stream()
        pool = torch.frombuffer((_ctypes_buffer(self.pool_address, self.pool_bytes)), dtype=torch.uint8)
        total = 0
        with torch.cuda.stream(self._stream):
            for layer in (range(L.num_layers) if layers is None else layers):
                for kv in range(L.kv_factor):
                    t = kv_caches[layer][kv].view(torch.uint8).view(kv_caches[layer][kv].shape[0], -1)
                    off = L.region_offset(self.shard, layer, kv)
                    for b, p in zip(blocks, pages):
                        region = pool[b * L.block_bytes + off: b * L.block_bytes + off + L.region_bytes]
                        if to_engine:
                            t[p].copy_(region, non_blocking=True)
                        else:
                            region.copy_(t[p], non_blocking=True)
                        total += L.region_bytes
        self._stream.synchronize()
        return total

    def close(self) -> None:
        """Unregister the mapping from CUDA if it was registered (here or at attach)."""
        if self._view is not None:
            self._view.release()
            self._view = None
        reg = self._registration
        if self._cuda_registered or (reg is not None and reg.cuda_registered):  # pragma: no cover
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.pool_address)
            self._cuda_registered = False
            if reg is not None:
                reg.cuda_registered = False


def _ctypes_buffer(address: int, size: int):
    import ctypes

    return (ctypes.c_uint8 * size).from_address(address)
