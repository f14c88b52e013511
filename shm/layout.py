"""The KV block layout: the contract between the sidecar's pool and each rank's copies.

A block holds ``tokens_per_block`` tokens of every layer of every TP shard, **block-first**:

    block = [shard 0][shard 1]...         (one shard for replicated / MLA KV)
    shard = [layer 0][layer 1]...
    layer = [K region][V region]          (MLA: one latent region)
    region = tokens_per_block × heads_per_shard × head_dim elements, contiguous

so a rank's shard of one (block, layer, K/V) is one contiguous region — one memcpy — and a rank's
whole shard of a block is contiguous too (one L3 object per shard if wanted).  The engine's paged
KV tensors are ``[num_pages, tokens_per_block, heads_per_shard, head_dim]`` per layer and K/V, so
page ``p`` of one layer is also one contiguous region of the same size.
"""

from __future__ import annotations

import dataclasses

import msgpack

from kvsidecar._native.hashing import murmur3_128

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
               "uint8": 1}


class LayoutError(ValueError):
    """An impossible or inconsistent KV layout."""


@dataclasses.dataclass(frozen=True)
class KVLayout:
    model: str = "model"
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float16"
    tokens_per_block: int = 64
    tp_size: int = 1
    mla: bool = False  # replicated latent KV: one shard every rank reads, rank 0 writes

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise LayoutError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_block", "tp_size"):
            if getattr(self, name) <= 0:
                raise LayoutError(f"{name} must be positive")
        if not self.mla and self.num_kv_heads % self.tp_size:
            raise LayoutError(f"num_kv_heads {self.num_kv_heads} is not divisible by tp_size {self.tp_size}")

    # -- derived sizes --------------------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def num_shards(self) -> int:
        return 1 if self.mla else self.tp_size

    @property
    def heads_per_shard(self) -> int:
        return self.num_kv_heads if self.mla else self.num_kv_heads // self.tp_size

    @property
    def kv_factor(self) -> int:
        return 1 if self.mla else 2

    @property
    def region_bytes(self) -> int:
        return self.tokens_per_block * self.heads_per_shard * self.head_dim * self.itemsize

    @property
    def shard_bytes(self) -> int:
        return self.num_layers * self.kv_factor * self.region_bytes

    @property
    def block_bytes(self) -> int:
        return self.num_shards * self.shard_bytes

    def shard_of(self, rank: int) -> int:
        return 0 if self.mla else rank

    def writes(self, rank: int) -> bool:
        """Whether ``rank`` writes its shard on store (MLA: only rank 0)."""
        return rank == 0 if self.mla else True

    def writers(self) -> int:
        return 1 if self.mla else self.tp_size

    def region_offset(self, shard: int, layer: int, kv: int) -> int:
        """Byte offset of (shard, layer, K=0/V=1) inside a block."""
        return ((shard * self.num_layers + layer) * self.kv_factor + kv) * self.region_bytes

    # -- identity -------------------------------------------------------------------------------
    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "KVLayout":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise LayoutError(f"unknown layout fields {sorted(unknown)}")
        return cls(**d)

    def fingerprint(self) -> bytes:
        """16 bytes identifying the layout; part of every chain seed and L3 key."""
        canon = msgpack.packb(sorted(self.as_dict().items()), use_bin_type=True)
        return murmur3_128(b"kvsidecar-layout-v1" + canon)
