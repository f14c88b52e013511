"""CPU block pool accounting (the bytes live in a shm segment owned by the host).

Every block is in exactly one state::

    FREE --alloc--> STAGING --publish--> RESIDENT --evict--> FREE
                       \\--abort------------------------------^

Invariants (checked by :meth:`check`):

* ``free + staging + resident == num_blocks``;
* a block's ``refcount`` (leases pinning it) is non-zero only while RESIDENT;
* the free list holds exactly the FREE blocks.
"""

from __future__ import annotations

import array

FREE, STAGING, RESIDENT = 0, 1, 2
STATE_NAMES = {FREE: "free", STAGING: "staging", RESIDENT: "resident"}


class PoolError(RuntimeError):
    """A state transition the pool does not allow (a bug in the caller)."""


class BlockPool:
    def __init__(self, num_blocks: int, block_bytes: int):
        if num_blocks <= 0:
            raise ValueError("pool needs at least one block")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.state = bytearray(num_blocks)  # all FREE
        self.refcount = array.array("i", bytes(4 * num_blocks))
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.counts = {FREE: num_blocks, STAGING: 0, RESIDENT: 0}
        self.pinned_blocks = 0  # blocks with refcount > 0

    # -- transitions ----------------------------------------------------------------------------
    def free_count(self) -> int:
        return self.counts[FREE]

    def alloc(self, n: int) -> list[int]:
        """Take up to ``n`` FREE blocks into STAGING (fewer if fewer are free)."""
        n = min(n, len(self._free))
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self.state[b] = STAGING
        self.counts[FREE] -= n
        self.counts[STAGING] += n
        return out

    def publish(self, b: int) -> None:
        self._expect(b, STAGING)
        self.state[b] = RESIDENT
        self.counts[STAGING] -= 1
        self.counts[RESIDENT] += 1

    def release_staging(self, b: int) -> None:
        """A staging block whose data never landed goes straight back to FREE."""
        self._expect(b, STAGING)
        self.state[b] = FREE
        self._free.append(b)
        self.counts[STAGING] -= 1
        self.counts[FREE] += 1

    def evict(self, b: int) -> None:
        self._expect(b, RESIDENT)
        if self.refcount[b]:
            raise PoolError(f"block {b} is pinned ({self.refcount[b]})")
        self.state[b] = FREE
        self._free.append(b)
        self.counts[RESIDENT] -= 1
        self.counts[FREE] += 1

    def pin(self, b: int) -> None:
        self._expect(b, RESIDENT)
        if self.refcount[b] == 0:
            self.pinned_blocks += 1
        self.refcount[b] += 1

    def unpin(self, b: int) -> bool:
        """Drop one reference; True when the block became unpinned."""
        if self.refcount[b] <= 0:
            raise PoolError(f"block {b} is not pinned")
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            self.pinned_blocks -= 1
            return True
        return False

    def _expect(self, b: int, state: int) -> None:
        if self.state[b] != state:
            raise PoolError(f"block {b} is {STATE_NAMES[self.state[b]]}, expected {STATE_NAMES[state]}")

    # -- observability --------------------------------------------------------------------------
    def stats(self) -> dict:
        return {"blocks": self.num_blocks, "block_bytes": self.block_bytes, "free": self.counts[FREE],
                "staging": self.counts[STAGING], "resident": self.counts[RESIDENT],
                "pinned": self.pinned_blocks}

    def check(self) -> None:
        """Raise PoolError if any accounting invariant is broken."""
        tally = {FREE: 0, STAGING: 0, RESIDENT: 0}
        pinned = 0
        for b in range(self.num_blocks):
            s = self.state[b]
            tally[s] += 1
            if self.refcount[b] < 0 or (self.refcount[b] and s != RESIDENT):
                raise PoolError(f"block {b}: refcount {self.refcount[b]} in state {STATE_NAMES[s]}")
            pinned += self.refcount[b] > 0
        if tally != self.counts or sum(tally.values()) != self.num_blocks:
            raise PoolError(f"counts {self.counts} disagree with states {tally}")
        if sorted(self._free) != [b for b in range(self.num_blocks) if self.state[b] == FREE]:
            raise PoolError("free list does not match FREE blocks")
        if pinned != self.pinned_blocks:
            raise PoolError(f"pinned count {self.pinned_blocks} != {pinned}")
