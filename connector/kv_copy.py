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
first copy.  By default (``cuda_copy="gather"``) the registered mapping is itself a CUDA tensor
(UVA: the device reads host memory over the bus) and each (layer, K/V) is one gather kernel
and one scatter kernel on the copier's stream; ``"regions"`` issues one async copy per region
(fallback where the mapping is not addressable).  Measured on an H200 (``scripts.gpu_copy_check``,
32 layers, 512 MiB to 1 GiB per load): gather 42-43 GB/s against 3.7 (16-token blocks) and 8.8
GB/s (64-token blocks) region by region, the bus 55 GB/s.  The CUDA path runs only where a GPU
exists.
"""

from __future__ import annotations

import array
import logging

from kvsidecar._native.copy import copy_regions, piece_offsets
from kvsidecar.shm.layout import KVLayout


CUDA_COPY_MODES = ("regions", "gather")
REGISTRATION_WAIT_S = 600.0  # bound on waiting for the attach-time cudaHostRegister

log = logging.getLogger(__name__)


class KVShapeError(ValueError):
    """Engine tensors do not match the layout."""


class KVCopier:
    def __init__(self, layout: KVLayout, rank: int, pool_address: int, pool_bytes: int, registration=None,
                 cuda_copy: str = "gather"):
        """``registration``: a ``PoolPopulator`` that may register the mapping with CUDA at attach.
        ``cuda_copy`` (CUDA tensors): "regions", one async copy per region, or "gather", one
        gather/scatter kernel pair per (layer, K/V) reading the registered mapping directly."""
        if cuda_copy not in CUDA_COPY_MODES:
            raise ValueError(f"cuda_copy must be one of {CUDA_COPY_MODES}")
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
        self.cuda_copy = cuda_copy
        self._device_shard = None  # CUDA: this rank's shard of the registered mapping, as a tensor

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

    def _block_offsets(self, blocks, per: int = 1, piece_bytes: int = 0, base: int = 0) -> array.array:
        """Pool offsets of ``per`` consecutive pieces of each block (checked ids), one C loop."""
        try:
            return piece_offsets(blocks, self.layout.block_bytes, base, per, piece_bytes, self.num_pool_blocks)
        except IndexError as exc:
            raise KVShapeError(str(exc)) from None

    def _offsets(self, blocks, pages, num_pages: int):
        L = self.layout
        block_off = self._block_offsets(blocks)
        for p in pages:
            if not 0 <= p < num_pages:
                raise KVShapeError(f"page {p} outside the engine pool of {num_pages}")
        rb = L.region_bytes
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
        host = array.array("q", host_ptrs)
        if min(host) <= 0:
            raise KVShapeError("a host piece has no address")
        block_off = self._block_offsets(blocks, per, piece_bytes, self.shard * L.shard_bytes)
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
        return self._block_offsets((block,), base=self.shard * self.layout.shard_bytes)[0]

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
        if self.cuda_copy == "gather":
            shard = self._pool_shard_on_device(kv_caches[0][0].device)
            if shard is not None:
                return self._gather_cuda(shard, blocks, kv_caches, pages, layers, to_engine)
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

    def _pool_shard_on_device(self, device):  # pragma: no cover
        """This rank's shard of every pool block as a CUDA tensor ``[blocks, layers x kv, region]``
        over the registered mapping itself (UVA: a kernel reads and writes host memory over the
        bus, no staging copy), or None (logged once) where CUDA cannot address it."""
        if self._device_shard is None:
            import torch

            L = self.layout
            try:
                whole = torch.as_tensor(_DeviceView(self.pool_address, self.num_pool_blocks * L.block_bytes),
                                        device=device).view(self.num_pool_blocks, L.block_bytes)
            except Exception as exc:  # noqa: BLE001 - any failure: the per-region copies instead
                log.warning("the pool mapping is not addressable from %s (%s): copying region by region",
                            device, exc)
                self.cuda_copy = "regions"
                return None
            lo = self.shard * L.shard_bytes
            self._device_shard = whole[:, lo:lo + L.shard_bytes].view(
                self.num_pool_blocks, L.num_layers * L.kv_factor, L.region_bytes)
        return self._device_shard

    def _gather_cuda(self, shard, blocks, kv_caches, pages, layers, to_engine: bool) -> int:  # pragma: no cover
        """Per (layer, K/V): one gather kernel and one scatter kernel on the copier's stream,
        reading (or writing) the pool's regions straight over the bus."""
        import torch

        L = self.layout
        dev = kv_caches[0][0].device
        with torch.cuda.stream(self._stream):
            b = torch.tensor(list(blocks), dtype=torch.int64).pin_memory().to(dev, non_blocking=True)
            p = torch.tensor(list(pages), dtype=torch.int64).pin_memory().to(dev, non_blocking=True)
            for layer in (range(L.num_layers) if layers is None else layers):
                for kv in range(L.kv_factor):
                    t = kv_caches[layer][kv]
                    t = t.view(torch.uint8).view(t.shape[0], L.region_bytes)
                    regions = shard[:, layer * L.kv_factor + kv]
                    if to_engine:
                        t.index_copy_(0, p, regions.index_select(0, b))
                    else:
                        regions.index_copy_(0, b, t.index_select(0, p))
        self._stream.synchronize()
        n_pairs = (L.num_layers if layers is None else len(layers)) * L.kv_factor
        return n_pairs * L.region_bytes * len(blocks)

    def close(self) -> None:
        """Unregister the mapping from CUDA if it was registered (here or at attach)."""
        if self._view is not None:
            self._view.release()
            self._view = None
        self._device_shard = None
        reg = self._registration
        if self._cuda_registered or (reg is not None and reg.cuda_registered):  # pragma: no cover
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.pool_address)
            self._cuda_registered = False
            if reg is not None:
                reg.cuda_registered = False


class _DeviceView:
    """``size`` bytes at ``address`` as a CUDA array (the ``__cuda_array_interface__``): valid
    where the mapping is registered with CUDA and the device may use the host pointer (UVA)."""

    def __init__(self, address: int, size: int):
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


def _ctypes_buffer(address: int, size: int):
    import ctypes

    return (ctypes.c_uint8 * size).from_address(address)
