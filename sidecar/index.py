"""Prefix index over resident blocks, with LRU eviction that never leaves a hole.

Keys are chained 128-bit hashes (16 bytes), so a key names a whole prefix; the index
remembers each resident block's parent (the previous key in its chain) and how many
resident children it has.  Invariants:

* a block is published only when its parent is resident (or it is the first block),
  so along any chain the resident blocks form a prefix;
* only **leaves** (no resident children) that are **unpinned** are evictable, so
  eviction can never remove a block while a descendant stays matchable;
* the evictable set is ordered by last use (LRU first).

Staging blocks are tracked separately (``staging``: key → block) so a second writer
of the same key can see it is already being written; they are invisible to lookups.
"""

from __future__ import annotations

import collections

from .pool import BlockPool

KEY = 16


class PrefixIndex:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.blocks: dict[bytes, int] = {}  # key -> resident block
        self.key_of: dict[int, bytes] = {}
        self.parent: dict[int, int] = {}  # block -> parent block (-1 for a chain head)
        self.children = collections.Counter()  # block -> resident children
        self.staging: dict[bytes, int] = {}
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # evictable leaves

    # -- queries --------------------------------------------------------------------------------
    def match(self, chain: bytes, limit: int | None = None) -> int:
        """Number of leading blocks of ``chain`` resident now."""
        n = len(chain) // KEY
        if limit is not None:
            n = min(n, limit)
        blocks = self.blocks
        i = 0
        while i < n and chain[i * KEY:(i + 1) * KEY] in blocks:
            i += 1
        return i

    def resident_ids(self, chain: bytes, count: int) -> list[int]:
        return [self.blocks[chain[i * KEY:(i + 1) * KEY]] for i in range(count)]

    # -- mutation -------------------------------------------------------------------------------
    def touch(self, block_ids) -> None:
        """Mark blocks as just used (moves evictable ones to the MRU end)."""
        lru = self._lru
        for b in block_ids:
            if b in lru:
                lru.move_to_end(b)

    def publish(self, key: bytes, block: int, parent: int) -> None:
        """Make a STAGING block resident under ``key``; ``parent`` must be resident (or -1)."""
        if self.staging.get(key) == block:
            del self.staging[key]
        self.pool.publish(block)
        self.blocks[key] = block
        self.key_of[block] = key
        self.parent[block] = parent
        if parent >= 0:
            self.children[parent] += 1
            self._lru.pop(parent, None)
        self._maybe_evictable(block, mru=True)

    def on_pinned(self, block: int) -> None:
        self._lru.pop(block, None)

    def on_unpinned(self, block: int) -> None:
        self._maybe_evictable(block, mru=True)

    def evict(self, want: int) -> int:
        """Evict up to ``want`` LRU unpinned leaves (cascading to parents); returns how many."""
        done = 0
        lru = self._lru
        while done < want and lru:
            b, _ = lru.popitem(last=False)
            self._remove(b)
            done += 1
        return done

    def _remove(self, b: int) -> None:
        key = self.key_of.pop(b)
        del self.blocks[key]
        parent = self.parent.pop(b)
        self.children.pop(b, None)
        self.pool.evict(b)
        if parent >= 0:
            self.children[parent] -= 1
            if self.children[parent] == 0:
                del self.children[parent]
                # The parent was used no later than its child: it is now among the oldest.
                if self.pool.refcount[parent] == 0:
                    self._lru[parent] = None
                    self._lru.move_to_end(parent, last=False)

    def _maybe_evictable(self, b: int, mru: bool) -> None:
        if self.pool.refcount[b] == 0 and not self.children.get(b) and b in self.key_of:
            self._lru[b] = None
            if not mru:
                self._lru.move_to_end(b, last=False)

    def evictable(self) -> int:
        return len(self._lru)

    def check(self) -> None:
        """Raise AssertionError if the no-hole / LRU invariants are broken."""
        for b, p in self.parent.items():
            assert p == -1 or p in self.key_of, f"block {b} has non-resident parent {p}"
        kids = collections.Counter(p for p in self.parent.values() if p >= 0)
        assert kids == +self.children, "children counts disagree"
        for b in self._lru:
            assert self.pool.refcount[b] == 0 and not self.children.get(b), f"block {b} wrongly evictable"
        for b in self.key_of:
            if self.pool.refcount[b] == 0 and not self.children.get(b):
                assert b in self._lru, f"block {b} is an unpinned leaf but not evictable"
