"""The checksum table: one XXH3-64 per (pool block, shard), recorded with the block (DESIGN §7).

Each checksum is seeded with the block's chain key and the shard (``kvsidecar._native.checksum``): it
verifies the bytes *as that key's block*, so a block handed out under another chain's key (a
stale id, a reused block) fails verification exactly like flipped bits.

Row ``b`` (``shards × 8`` bytes, little-endian u64 per shard) belongs to pool block ``b`` and
is valid while the block is RESIDENT.  It is written by exactly one path per block life:

* an engine store: each writer rank's ``commit`` carries its shard's checksums (computed by
  the rank over the bytes it saved); they are scattered into the rows before publication;
* an L3 read: the object's trailer (the same row, written with it by write-behind) lands in
  the row by the same zero-copy transfer as the block, and the read lane verifies the block
  against it before anything is published.

Readers: a GET reply carries the asking rank's column for its blocks (pinned, so the rows
cannot change under it); write-behind sends each row as the L3 object's trailer.

The table is one anonymous, page-aligned mapping so that a zero-copy L3 backend can register
it next to the pool.  Only the control thread writes rows of STAGING blocks; the read lane
writes rows of blocks it is reading (STAGING, owned by that read) — never two writers at once.
"""

from __future__ import annotations

import ctypes
import mmap

from kvsidecar._native import checksum as _native

SUM_BYTES = 8


class ChecksumTable:
    def __init__(self, num_blocks: int, shards: int):
        self.num_blocks = num_blocks
        self.shards = shards
        self.row_bytes = shards * SUM_BYTES
        self.size = max(num_blocks * self.row_bytes, 1)
        self._map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._anchor = ctypes.c_char.from_buffer(self._map)  # keeps the address valid and known
        self.address = ctypes.addressof(self._anchor)

    def row_address(self, block: int) -> int:
        return self.address + block * self.row_bytes

    def row_addresses(self, blocks) -> list[int]:
        base, rb = self.address, self.row_bytes
        return [base + b * rb for b in blocks]

    def record(self, blocks: bytes, shard: int, sums: bytes) -> None:
        """Write ``shard``'s checksums (``8 × n`` bytes) for packed ``blocks``."""
        _native.scatter(self.address, blocks, self.shards, shard, sums)

    def column(self, blocks: bytes, shard: int) -> bytes:
        """``shard``'s checksums of packed ``blocks`` (``8 × n`` bytes, in order)."""
        return _native.gather(self.address, blocks, self.shards, shard)

    def verify(self, pool_address: int, block_bytes: int, blocks: bytes, keys: bytes) -> bytearray:
        """Per block of ``blocks`` (as chain ``keys``): 1 when every shard's bytes in the pool
        match its row."""
        return _native.verify_blocks(pool_address, blocks, keys, block_bytes, self.shards, self.address)

    def close(self) -> None:
        del self._anchor
        self._map.close()
