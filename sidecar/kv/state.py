"""The pool's block state, built once and shared by the services that change it through ``kv/``.

:class:`KVState` is what the composition root (``kvsidecar.sidecar.app``) builds first: the prefix
index, the lease table, the pool manager (admission, sessions' block state), the engine-store
staging table and the per-block checksums.  The KV ops (``KVCore``), L3 write-behind and restore
(``L3Ops``) and the L3 tier (the checksums) are each given it at construction, so nothing needs
another service wired in after the fact.
"""

from __future__ import annotations

import dataclasses

from kvsidecar.shm.layout import KVLayout

from kvsidecar.sidecar.kv.admission import PoolManager
from kvsidecar.sidecar.kv.checksums import ChecksumTable
from kvsidecar.sidecar.kv.index import PrefixIndex
from kvsidecar.sidecar.kv.leases import LeaseTable
from kvsidecar.sidecar.kv.staging import StagingTable


@dataclasses.dataclass(frozen=True)
class KVState:
    index: PrefixIndex
    leases: LeaseTable
    pool: PoolManager
    staging: StagingTable
    sums: ChecksumTable | None  # one XXH3-64 per (block, shard), or None (integrity.checksums off)

    @classmethod
    def build(cls, layout: KVLayout, num_blocks: int, limits, checksums: bool = True) -> "KVState":
        index = PrefixIndex(num_blocks, layout.block_bytes)
        leases = LeaseTable(index)
        pool_bytes = num_blocks * layout.block_bytes
        pool = PoolManager(index, leases, reserved_limit_bytes=limits.reserved_bytes_limit or pool_bytes,
                           pinned_limit_bytes=limits.pinned_bytes_limit or pool_bytes)
        sums = ChecksumTable(num_blocks, layout.num_shards) if checksums else None
        return cls(index, leases, pool, StagingTable(pool), sums)

    @property
    def num_blocks(self) -> int:
        return self.index.num_blocks
