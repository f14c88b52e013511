"""The pool's block accounting and prefix index (state lives in ``kvsidecar._native.blockindex``).

Block ids travel as **packed uint32 blobs** (``bytes``), the same form the wire uses,
so a 512-block get never builds a Python list.  Every block is in exactly one state::

    FREE --alloc--> STAGING --publish--> RESIDENT --evict--> FREE
                       \\--release_staging----------------------^

Invariants (``check``): free + staging + resident == pool size; refcounts only on
RESIDENT blocks; along any chain the resident blocks form a prefix (eviction takes
only unpinned leaves, LRU first); the LRU holds exactly the evictable blocks.
Staging blocks are tracked by key in ``staging`` so a second writer of the same key
sees it is already being written; they are invisible to lookups.
"""

from __future__ import annotations


from kvsidecar.shm.chain import KEY_BYTES, pack_ids, unpack_ids  # noqa: F401 (re-exported)
from kvsidecar._native.blockindex import FREE, RESIDENT, STAGING, BlockIndex, IndexError_

KEY = KEY_BYTES  # (the chain layout lives in kvsidecar.shm.chain)
STATE_NAMES = {FREE: "free", STAGING: "staging", RESIDENT: "resident"}
PoolError = IndexError_




class PrefixIndex:
    def __init__(self, num_blocks: int, block_bytes: int):
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.native = BlockIndex(num_blocks)
        self.staging: dict[bytes, int] = {}
        n = self.native
        # hot-path methods, bound once
        self.match = n.match
        self.resident_ids = n.resident_ids
        self.alloc = n.alloc
        self.pin = n.pin
        self.unpin = n.unpin
        self.count_unpinned = n.count_unpinned
        self.touch = n.touch
        self.evicted = 0  # blocks evicted since start (churn figures)
        self.release_staging = n.release_staging
        self.find = n.find

    def evict(self, want: int) -> int:
        """Evict up to ``want`` LRU unpinned leaves; returns how many."""
        done = self.native.evict(want)
        self.evicted += done
        return done

    def stage(self, key: bytes, block: int) -> None:
        self.staging[key] = block

    def publish(self, key: bytes, block: int, parent: int) -> bool:
        """STAGING -> RESIDENT; True when ``key`` was staged under ``block`` (its waiters resolve)."""
        staged = self.staging.get(key) == block
        if staged:
            del self.staging[key]
        self.native.publish(key, block, parent)
        return staged

    def drop_staging(self, key: bytes, block: int) -> bool:
        """A staged block whose data never landed (or was abandoned) goes back to FREE; True when
        ``key`` was staged under ``block``."""
        staged = self.staging.get(key) == block
        if staged:
            del self.staging[key]
        self.native.release_staging(block)
        return staged

    # -- counts ---------------------------------------------------------------------------------
    @property
    def free(self) -> int:
        return self.native.n_free

    @property
    def staged(self) -> int:
        return self.native.n_staging

    @property
    def resident(self) -> int:
        return self.native.n_resident

    @property
    def pinned(self) -> int:
        return self.native.n_pinned

    @property
    def evictable(self) -> int:
        """Resident blocks nobody pins (the LRU): what an allocation may evict."""
        return self.native.lru_len

    def refcount(self, b: int) -> int:
        return self.native.refcount(b)

    def stats(self) -> dict:
        n = self.native
        return {"blocks": self.num_blocks, "block_bytes": self.block_bytes, "free": n.n_free,
                "staging": n.n_staging, "resident": n.n_resident, "pinned": n.n_pinned,
                "evictable": n.lru_len, "evicted": self.evicted}

    def check(self) -> str:
        broken = self.native.check()
        if broken:
            return broken
        for key, b in self.staging.items():
            if self.native.state(b) != STAGING:
                return f"staging key maps to block {b} in state {STATE_NAMES[self.native.state(b)]}"
        return ""
