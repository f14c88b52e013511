# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Block states, refcounts and the prefix index in flat C arrays (the sidecar's hot path).

One object holds, for ``n`` pool blocks:

* ``state``     FREE / STAGING / RESIDENT, plus a free-block stack;
* ``refcount``  pins by leases (non-zero only while RESIDENT);
* the **prefix index**: an open-addressing hash table (linear probing, at least twice
  as many slots as blocks, **no tombstones**: erase shifts later entries of the probe
  run back, so the table never fills with deleted slots under unbounded churn and
  every probe stays short and is bounded by the table size) from 128-bit chained
  keys to RESIDENT blocks, each block's ``parent`` (previous
  block of its chain, -1 for a head) and its count of resident ``children``;
* an intrusive doubly-linked **LRU list of evictable blocks** = RESIDENT, unpinned,
  no resident children.  Eviction takes from the old end and, when a parent loses its
  last child, puts the parent at the old end too.  Hence eviction never removes a
  block while a descendant stays matchable: along any chain the resident blocks form
  a prefix (given that ``publish`` is only called with a resident parent).

Keys are the connector's chained hashes, already uniformly random, so the low 64
bits index the table directly.  All loops over a chain run in C: a 512-block match,
pin or unpin costs a few microseconds.  Not thread-safe: the control thread owns it.
"""

from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

DEF EMPTY = -1

cdef enum:
    S_FREE = 0
    S_STAGING = 1
    S_RESIDENT = 2

FREE = S_FREE
STAGING = S_STAGING
RESIDENT = S_RESIDENT


class IndexError_(RuntimeError):
    """A transition the block table does not allow (a bug in the caller)."""


cdef inline uint64_t _lo(const uint8_t *k) nogil:
    cdef uint64_t v
    memcpy(&v, k, 8)
    return v


cdef inline uint64_t _hi(const uint8_t *k) nogil:
    cdef uint64_t v
    memcpy(&v, k + 8, 8)
    return v


cdef class BlockIndex:
    cdef readonly int32_t num_blocks
    cdef uint8_t *state_
    cdef int32_t *refcnt
    cdef int32_t *parent_
    cdef int32_t *children_
    cdef uint64_t *keys  # 2 per block
    cdef int32_t *prev
    cdef int32_t *nxt
    cdef uint8_t *in_lru
    cdef int32_t lru_head, lru_tail
    cdef readonly int32_t lru_len
    cdef int32_t *table
    cdef uint64_t mask
    cdef int32_t *free_stack
    cdef int32_t nfree
    cdef readonly int32_t n_staging, n_resident, n_pinned

    def __cinit__(self, int32_t num_blocks):
        if num_blocks <= 0:
            raise ValueError("need at least one block")
        self.num_blocks = num_blocks
        cdef uint64_t cap = 16
        while cap < <uint64_t>num_blocks * 2:
            cap <<= 1
        self.mask = cap - 1
        self.state_ = <uint8_t*>calloc(num_blocks, 1)
        self.refcnt = <int32_t*>calloc(num_blocks, 4)
        self.parent_ = <int32_t*>malloc(num_blocks * 4)
        self.children_ = <int32_t*>calloc(num_blocks, 4)
        self.keys = <uint64_t*>calloc(num_blocks * 2, 8)
        self.prev = <int32_t*>malloc(num_blocks * 4)
        self.nxt = <int32_t*>malloc(num_blocks * 4)
        self.in_lru = <uint8_t*>calloc(num_blocks, 1)
        self.table = <int32_t*>malloc(cap * 4)
        self.free_stack = <int32_t*>malloc(num_blocks * 4)
        if not (self.state_ and self.refcnt and self.parent_ and self.children_ and self.keys and self.prev
                and self.nxt and self.in_lru and self.table and self.free_stack):
            raise MemoryError()
        cdef uint64_t i
        for i in range(cap):
            self.table[i] = EMPTY
        for i in range(num_blocks):
            self.free_stack[i] = num_blocks - 1 - <int32_t>i  # pop hands out low ids first
            self.parent_[i] = -1
        self.nfree = num_blocks
        self.lru_head = self.lru_tail = -1

    def __dealloc__(self):
        free(self.state_); free(self.refcnt); free(self.parent_); free(self.children_); free(self.keys)
        free(self.prev); free(self.nxt); free(self.in_lru); free(self.table); free(self.free_stack)

    # -- LRU list -------------------------------------------------------------------------------
    cdef inline void _lru_unlink(self, int32_t b) nogil:
        if not self.in_lru[b]:
            return
        if self.prev[b] >= 0:
            self.nxt[self.prev[b]] = self.nxt[b]
        else:
            self.lru_head = self.nxt[b]
        if self.nxt[b] >= 0:
            self.prev[self.nxt[b]] = self.prev[b]
        else:
            self.lru_tail = self.prev[b]
        self.in_lru[b] = 0
        self.lru_len -= 1

    cdef inline void _lru_push_new(self, int32_t b) nogil:  # most recently used end
        self.prev[b] = self.lru_tail
        self.nxt[b] = -1
        if self.lru_tail >= 0:
            self.nxt[self.lru_tail] = b
        else:
            self.lru_head = b
        self.lru_tail = b
        self.in_lru[b] = 1
        self.lru_len += 1

    cdef inline void _lru_push_old(self, int32_t b) nogil:  # least recently used end
        self.nxt[b] = self.lru_head
        self.prev[b] = -1
        if self.lru_head >= 0:
            self.prev[self.lru_head] = b
        else:
            self.lru_tail = b
        self.lru_head = b
        self.in_lru[b] = 1
        self.lru_len += 1

    cdef inline bint _evictable(self, int32_t b) nogil:
        return self.state_[b] == S_RESIDENT and self.refcnt[b] == 0 and self.children_[b] == 0

    # -- hash table -----------------------------------------------------------------------------
    cdef inline int32_t _find(self, uint64_t lo, uint64_t hi) nogil:
        # Load factor <= 1/2 and no tombstones: a miss ends at the first EMPTY slot.  The
        # loop is still bounded by the table size so a broken table can never spin.
        cdef uint64_t i = lo & self.mask, probes = 0
        cdef int32_t b
        while probes <= self.mask:
            b = self.table[i]
            if b == EMPTY:
                return -1
            if self.keys[2 * b] == lo and self.keys[2 * b + 1] == hi:
                return b
            i = (i + 1) & self.mask
            probes += 1
        return -1

    cdef void _insert(self, uint64_t lo, uint64_t hi, int32_t b) nogil:
        # Never more resident blocks than half the slots, so an EMPTY slot always exists.
        cdef uint64_t i = lo & self.mask
        while self.table[i] != EMPTY:
            i = (i + 1) & self.mask
        self.table[i] = b
        self.keys[2 * b] = lo
        self.keys[2 * b + 1] = hi

    cdef void _erase(self, int32_t b) nogil:
        """Backward-shift deletion (Knuth 6.4, algorithm R): no tombstones are left.

        After emptying slot ``i``, each later entry of the same probe run whose home
        slot does not lie cyclically in ``(i, j]`` moves back into the hole, which
        keeps every remaining key reachable from its home slot without a gap.
        """
        cdef uint64_t mask = self.mask
        cdef uint64_t i = self.keys[2 * b] & mask, j, home, probes = 0
        while self.table[i] != b:
            i = (i + 1) & mask
            probes += 1
            if probes > mask:
                return  # not in the table (cannot happen for a resident block)
        j = i
        while True:
            j = (j + 1) & mask
            if self.table[j] == EMPTY:
                break
            home = self.keys[2 * self.table[j]] & mask
            # entry j stays iff its home lies cyclically in (i, j]
            if ((j - home) & mask) < ((j - i) & mask):
                continue
            self.table[i] = self.table[j]
            i = j
        self.table[i] = EMPTY

    def max_probe(self):
        """Longest probe run of any resident key (diagnostics and churn tests)."""
        cdef uint64_t s, d, worst = 0
        cdef int32_t b
        for s in range(self.mask + 1):
            b = self.table[s]
            if b >= 0:
                d = (s - (self.keys[2 * b] & self.mask)) & self.mask
                if d > worst:
                    worst = d
        return worst

    # -- queries --------------------------------------------------------------------------------
    def find(self, const uint8_t[::1] key):
        """Block resident under ``key``, or -1."""
        if key.shape[0] != 16:
            raise ValueError("keys are 16 bytes")
        return self._find(_lo(&key[0]), _hi(&key[0]))

    def match(self, const uint8_t[::1] chain, Py_ssize_t limit=-1):
        """Number of leading blocks of ``chain`` resident now."""
        cdef Py_ssize_t n = chain.shape[0] // 16, i = 0
        if limit >= 0 and limit < n:
            n = limit
        while i < n and self._find(_lo(&chain[16 * i]), _hi(&chain[16 * i])) >= 0:
            i += 1
        return i

    def resident_ids(self, const uint8_t[::1] chain, Py_ssize_t count):
        """Packed uint32 ids of the first ``count`` blocks of ``chain`` (all must be resident)."""
        cdef bytearray out = bytearray(4 * count)
        cdef uint32_t *o = <uint32_t*>(<char*>out)
        cdef Py_ssize_t i
        cdef int32_t b
        if count * 16 > chain.shape[0]:
            raise ValueError("count exceeds the chain")
        for i in range(count):
            b = self._find(_lo(&chain[16 * i]), _hi(&chain[16 * i]))
            if b < 0:
                raise IndexError_(f"block {i} of the chain is not resident")
            o[i] = <uint32_t>b
        return bytes(out)

    def state(self, int32_t b):
        return self.state_[b]

    def refcount(self, int32_t b):
        return self.refcnt[b]

    def children(self, int32_t b):
        return self.children_[b]

    def parent(self, int32_t b):
        return self.parent_[b]

    def key(self, int32_t b):
        return (<char*>&self.keys[2 * b])[:16]

    @property
    def n_free(self):
        return self.nfree

    def memory_bytes(self):
        """Bytes of the native arrays and hash table (the whole index footprint)."""
        return self.num_blocks * (1 + 4 + 4 + 4 + 16 + 4 + 4 + 1 + 4) + (self.mask + 1) * 4

    # -- transitions ----------------------------------------------------------------------------
    def alloc(self, Py_ssize_t n):
        """Take up to ``n`` S_FREE blocks into S_STAGING; packed uint32 ids."""
        if n > self.nfree:
            n = self.nfree
        cdef bytearray out = bytearray(4 * n)
        cdef uint32_t *o = <uint32_t*>(<char*>out)
        cdef Py_ssize_t i
        cdef int32_t b
        for i in range(n):
            self.nfree -= 1
            b = self.free_stack[self.nfree]
            self.state_[b] = S_STAGING
            o[i] = <uint32_t>b
        self.n_staging += <int32_t>n
        return bytes(out)

    cdef void _to_free(self, int32_t b) nogil:
        self.state_[b] = S_FREE
        self.free_stack[self.nfree] = b
        self.nfree += 1

    def release_staging(self, int32_t b):
        self._check_id(b)
        if self.state_[b] != S_STAGING:
            raise IndexError_(f"block {b} is not staging")
        self._to_free(b)
        self.n_staging -= 1

    def publish(self, const uint8_t[::1] key, int32_t b, int32_t parent):
        """S_STAGING → S_RESIDENT under ``key``; ``parent`` must be resident (or -1)."""
        if key.shape[0] != 16:
            raise ValueError("keys are 16 bytes")
        self._check_id(b)
        if self.state_[b] != S_STAGING:
            raise IndexError_(f"block {b} is not staging")
        if parent >= 0 and (parent >= self.num_blocks or self.state_[parent] != S_RESIDENT):
            raise IndexError_(f"parent {parent} of block {b} is not resident")
        cdef uint64_t lo = _lo(&key[0]), hi = _hi(&key[0])
        if self._find(lo, hi) >= 0:
            raise IndexError_("key already resident")
        self._insert(lo, hi, b)
        self.state_[b] = S_RESIDENT
        self.n_staging -= 1
        self.n_resident += 1
        self.parent_[b] = parent
        self.children_[b] = 0
        if parent >= 0:
            self.children_[parent] += 1
            self._lru_unlink(parent)
        self._lru_push_new(b)

    def pin(self, const uint8_t[::1] ids):
        """+1 reference on every packed id (all S_RESIDENT); returns how many became pinned."""
        cdef const uint32_t *p = <const uint32_t*>&ids[0] if ids.shape[0] else NULL
        cdef Py_ssize_t i, n = ids.shape[0] // 4
        cdef int32_t b
        cdef int32_t newly = 0
        for i in range(n):
            b = <int32_t>p[i]
            if b >= self.num_blocks or self.state_[b] != S_RESIDENT:
                for i in range(i):  # undo the pins taken so far
                    self._unpin1(<int32_t>p[i])
                raise IndexError_(f"block {b} is not resident")
            if self.refcnt[b] == 0:
                newly += 1
                self.n_pinned += 1
                self._lru_unlink(b)
            self.refcnt[b] += 1
        return newly

    cdef inline void _unpin1(self, int32_t b) nogil:
        self.refcnt[b] -= 1
        if self.refcnt[b] == 0:
            self.n_pinned -= 1
            if self.children_[b] == 0:
                self._lru_push_new(b)

    def unpin(self, const uint8_t[::1] ids):
        """-1 reference on every packed id."""
        cdef const uint32_t *p = <const uint32_t*>&ids[0] if ids.shape[0] else NULL
        cdef Py_ssize_t i, n = ids.shape[0] // 4
        for i in range(n):
            if p[i] >= <uint32_t>self.num_blocks or self.refcnt[p[i]] <= 0:
                raise IndexError_(f"block {p[i]} is not pinned")
        for i in range(n):
            self._unpin1(<int32_t>p[i])

    def count_unpinned(self, const uint8_t[::1] ids):
        """How many of the packed ids have no pin yet (for pin admission)."""
        cdef const uint32_t *p = <const uint32_t*>&ids[0] if ids.shape[0] else NULL
        cdef Py_ssize_t i, n = ids.shape[0] // 4
        cdef int32_t c = 0
        for i in range(n):
            if self.refcnt[p[i]] == 0:
                c += 1
        return c

    def touch(self, const uint8_t[::1] ids):
        """Mark blocks as just used (evictable ones move to the recent end)."""
        cdef const uint32_t *p = <const uint32_t*>&ids[0] if ids.shape[0] else NULL
        cdef Py_ssize_t i, n = ids.shape[0] // 4
        cdef int32_t b
        with nogil:
            for i in range(n):
                b = <int32_t>p[i]
                if self.in_lru[b]:
                    self._lru_unlink(b)
                    self._lru_push_new(b)

    def evict(self, Py_ssize_t want):
        """Evict up to ``want`` least recently used evictable blocks; returns how many."""
        cdef Py_ssize_t done = 0
        cdef int32_t b, par
        while done < want and self.lru_head >= 0:
            b = self.lru_head
            self._lru_unlink(b)
            self._erase(b)
            par = self.parent_[b]
            self.parent_[b] = -1
            self._to_free(b)
            self.n_resident -= 1
            done += 1
            if par >= 0:
                self.children_[par] -= 1
                if self._evictable(par):
                    self._lru_push_old(par)  # used no later than its child: among the oldest
        return done

    cdef _check_id(self, int32_t b):
        if b < 0 or b >= self.num_blocks:
            raise IndexError_(f"block id {b} outside the pool")

    # -- invariants -----------------------------------------------------------------------------
    def check(self):
        """'' when every invariant holds, else a description of the first broken one."""
        cdef int32_t b, c, free_n = 0, st = 0, res = 0, pinned = 0, lru = 0
        cdef int32_t *kids = <int32_t*>calloc(self.num_blocks, 4)
        cdef uint8_t *seen = <uint8_t*>calloc(self.num_blocks, 1)
        try:
            for b in range(self.num_blocks):
                if self.state_[b] == S_FREE:
                    free_n += 1
                elif self.state_[b] == S_STAGING:
                    st += 1
                else:
                    res += 1
                    if self._find(self.keys[2 * b], self.keys[2 * b + 1]) != b:
                        return f"resident block {b} is not findable under its key"
                    if self.parent_[b] >= 0:
                        if self.state_[self.parent_[b]] != S_RESIDENT:
                            return f"block {b} has non-resident parent {self.parent_[b]} (a hole)"
                        kids[self.parent_[b]] += 1
                if self.refcnt[b] < 0 or (self.refcnt[b] and self.state_[b] != S_RESIDENT):
                    return f"block {b}: refcount {self.refcnt[b]} in state {self.state_[b]}"
                if self.refcnt[b]:
                    pinned += 1
            if free_n != self.nfree or st != self.n_staging or res != self.n_resident:
                return f"counts free={self.nfree}/{free_n} staging={self.n_staging}/{st} resident={self.n_resident}/{res}"
            if free_n + st + res != self.num_blocks:
                return "free + staging + resident != pool size"
            if pinned != self.n_pinned:
                return f"pinned count {self.n_pinned} != {pinned}"
            for c in range(self.nfree):
                b = self.free_stack[c]
                if self.state_[b] != S_FREE or seen[b]:
                    return f"free stack holds block {b} wrongly"
                seen[b] = 1
            for b in range(self.num_blocks):
                if self.state_[b] == S_RESIDENT and kids[b] != self.children_[b]:
                    return f"block {b}: children {self.children_[b]} != {kids[b]}"
                if self._evictable(b) != self.in_lru[b]:
                    return f"block {b}: evictable={self._evictable(b)} but in_lru={self.in_lru[b]}"
            b = self.lru_head
            while b >= 0:
                lru += 1
                if lru > self.num_blocks:
                    return "LRU list has a cycle"
                b = self.nxt[b]
            if lru != self.lru_len:
                return f"LRU length {self.lru_len} != {lru}"
            return ""
        finally:
            free(kids)
            free(seen)
