# cython: language_level=3, boundscheck=False, wraparound=False
"""The hot halves of ``kvsidecar.shm.ring`` and ``kvsidecar.shm.doorbell``: the ring's two ends
and the doorbell's post, as native classes the Python layer subclasses (see those modules for the
layouts and the memory-ordering rules; this file implements exactly those).

Why native: a command's round trip is a client push and ring, a sidecar wake, pop and push and
ring, a client wake and pop.  After an idle gap every line of that runs cold, and cold, each
interpreted line costs about half a microsecond (``scripts/bench_ring.py``: the ring's wake path
was 1.6x a Unix socket's with the same codec, and the difference was the bytecode around the
native calls).  Here each step is one method call on a native object, with no Python wrapper.

* :class:`Bell` — a doorbell's address pair and its post (rule: seq_cst increment of ``seq``, a
  full fence, then ``futex_wake`` only if the waiter published ``sleeping``).
* :class:`Producer` — ``try_push`` (rules 1 and 2 of the ring).
* :class:`Consumer` — ``has_data``, ``pop_batch`` (rules 1 and 2, and rule 3 when it knows the
  producer's bell: after releasing ``head``, full fence, read ``waiting``; if set, clear it and
  ring the producer), and ``wait_pop``: the doorbell's sleep (``sleeping = 1``, full fence,
  re-check, ``futex_wait``) specialised to "this ring has a frame", then the pop.

Addresses are raw (a ring's region inside a live mapping); nothing here checks bounds beyond
what the ring's own indices and capacity imply, which is what the Python layer guarantees.
Corruption raises the exception class the Python layer passes in (``RingCorrupted``).
"""

from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdint cimport uint32_t, uint64_t, int64_t, uintptr_t
from libc.string cimport memcpy

cdef extern from "kvs_sync.h":
    uint64_t kvs_load_acq64(uintptr_t a) nogil
    void kvs_store_rel64(uintptr_t a, uint64_t v) nogil
    uint32_t kvs_load_acq32(uintptr_t a) nogil
    void kvs_store_rel32(uintptr_t a, uint32_t v) nogil
    uint32_t kvs_fetch_add32(uintptr_t a, uint32_t d) nogil
    void kvs_fence() nogil
    int kvs_futex_wait(uintptr_t a, uint32_t expected, int64_t timeout_ns) nogil
    long kvs_futex_wake(uintptr_t a, int n) nogil

cdef extern from *:
    """
    static inline uint32_t kvr_load32(uintptr_t a) { uint32_t v; __builtin_memcpy(&v, (void*)a, 4); return v; }
    static inline void kvr_store32(uintptr_t a, uint32_t v) { __builtin_memcpy((void*)a, &v, 4); }
    """
    uint32_t kvr_load32(uintptr_t a) nogil
    void kvr_store32(uintptr_t a, uint32_t v) nogil

DEF HEAD = 0
DEF TAIL = 64
DEF WAITING = 72
DEF DATA = 128
DEF WRAP = 0xFFFFFFFF


cdef class Bell:
    """A doorbell in shared memory: ``seq: u32`` at ``seq_addr``, ``sleeping: u32`` 4 bytes on."""

    cdef readonly uintptr_t seq_addr
    cdef readonly uintptr_t sleeping_addr
    cdef public uint64_t wakeups_posted

    def __cinit__(self, uintptr_t base_address, uintptr_t offset, *args, **kwargs):
        self.seq_addr = base_address + offset
        self.sleeping_addr = base_address + offset + 4
        self.wakeups_posted = 0

    cdef bint post(self) except -1:
        kvs_fetch_add32(self.seq_addr, 1)  # seq_cst RMW: also the full fence before the load
        if kvs_load_acq32(self.sleeping_addr):
            if kvs_futex_wake(self.seq_addr, 2147483647) < 0:
                raise OSError("futex wake failed")
            self.wakeups_posted += 1
            return True
        return False

    def ring(self):
        """Signal the waiter.  Returns True when a futex wake-up was posted."""
        return self.post()

    # The waiter's protocol, in the two steps around its own re-check of its condition (which
    # ``sleep`` calls in Python and ``Consumer.wait_pop`` reads natively):
    cdef inline void announce(self) noexcept nogil:
        """Publish ``sleeping``, then a full fence: the poster's RMW and this store are ordered,
        so either the poster sees ``sleeping`` and wakes, or the waiter's re-check sees the data."""
        kvs_store_rel32(self.sleeping_addr, 1)
        kvs_fence()

    cdef inline int doze(self, uint32_t observed, int64_t ns) noexcept nogil:
        """``futex_wait(seq, observed)`` for at most ``ns``, then clear ``sleeping`` (also the
        way out when the re-check found the condition true: pass ``ns = 0``).  0 woken, 1
        timeout, -errno."""
        cdef int r = 0
        if ns > 0:
            r = kvs_futex_wait(self.seq_addr, observed, ns)
        kvs_store_rel32(self.sleeping_addr, 0)
        return r

    def sleep(self, ready, uint32_t observed, double timeout_s, bint recheck=True):
        """The waiter's sleep, after it read ``seq`` as ``observed`` and found ``ready()`` false:
        publish ``sleeping``, full fence, re-check ``ready()``, then ``futex_wait(seq, observed)``
        for at most ``timeout_s`` (GIL released) and clear ``sleeping``.  Returns ``ready()``;
        after a wake-up with ``recheck`` false, True without calling it (the caller re-checks
        its own condition at once).  Native because everything after the wake-up is latency."""
        if timeout_s <= 0:
            return bool(ready())
        self.announce()
        try:
            if ready():
                self.doze(observed, 0)
                return True
        except BaseException:
            self.doze(observed, 0)
            raise
        cdef int64_t ns = <int64_t>(timeout_s * 1e9)
        cdef int r
        with nogil:
            r = self.doze(observed, ns)
        if r < 0:
            raise OSError(-r, "futex wait failed")
        if r == 0 and not recheck:
            return True
        return bool(ready())

    def sleep_scan(self, tuple consumers, uint32_t observed, double timeout_s):
        """The waiter's sleep with "one of ``consumers``' rings has a frame" as its condition,
        read natively: returns the index of the first consumer whose ring has a frame, or -1
        (woken for something else, or the timeout).  The caller read ``seq`` as ``observed``
        before it checked its other conditions; their posters ring this bell, so ``seq`` has
        moved and ``futex_wait`` returns at once if one came true since (nothing is lost).
        The control loop's idle sleep: what it needs first after the wake-up, natively."""
        cdef int64_t ns = <int64_t>(timeout_s * 1e9)
        cdef Py_ssize_t i = _first_with_data(consumers)
        cdef int r
        if i >= 0 or ns <= 0:
            return i
        self.announce()
        i = _first_with_data(consumers)
        if i >= 0:
            self.doze(observed, 0)
            return i
        with nogil:
            r = self.doze(observed, ns)
        if r < 0:
            raise OSError(-r, "futex wait failed")
        return _first_with_data(consumers)


cdef Py_ssize_t _first_with_data(tuple consumers):
    """Index of the first :class:`Consumer` in ``consumers`` whose ring holds a frame, or -1."""
    cdef Py_ssize_t i
    cdef Consumer c
    for i in range(len(consumers)):
        c = <Consumer>consumers[i]
        if kvs_load_acq64(c.base + TAIL) != c._head:
            return i
    return -1


cdef class Producer:
    """The writing end of one ring (exactly one per ring)."""

    cdef readonly uintptr_t base
    cdef readonly uint64_t capacity
    cdef readonly uint64_t max_payload
    cdef public uint64_t _tail  # the producer's own index (only it writes ``tail``)
    cdef object _corrupt

    def __cinit__(self, uintptr_t base, uint64_t capacity, corrupt, *args, **kwargs):
        self.base = base
        self.capacity = capacity
        self.max_payload = capacity // 2 - 8
        self._tail = kvs_load_acq64(base + TAIL)
        self._corrupt = corrupt

    def try_push(self, payload):
        """Append one frame (``bytes``, or any contiguous buffer); False (and nothing written)
        when it does not fit now.  Raises the corruption class when the consumer's ``head`` is
        impossible (behind by more than ``capacity``, ahead of ``tail``, unaligned),
        ``ValueError`` for a frame over half the ring.  ``bytes`` (every frame the codec makes)
        is read in place: no buffer export, which was most of this call's cold cost."""
        return self._push_obj(payload)

    cdef object _push_obj(self, payload):
        if type(payload) is bytes:
            return self._push(PyBytes_AS_STRING(payload), PyBytes_GET_SIZE(payload))
        cdef const unsigned char[::1] view = payload
        if view.shape[0] == 0:
            return self._push(b"", 0)
        return self._push(<const char*>&view[0], view.shape[0])

    cdef object _push(self, const char* src, uint64_t n):
        if n > self.max_payload:
            raise ValueError(f"frame of {n} bytes exceeds ring bound {self.max_payload}")
        cdef uint64_t tail = self._tail
        cdef uint64_t capacity = self.capacity
        cdef uint64_t need = (4 + n + 7) & ~(<uint64_t>7)
        cdef uint64_t head = kvs_load_acq64(self.base + HEAD)  # rule 2
        if tail < head or tail - head > capacity or head & 7:
            raise self._corrupt(f"consumer index head={head} is impossible (tail={tail})")
        cdef uint64_t free = capacity - (tail - head)
        cdef uint64_t pos = tail & (capacity - 1)
        cdef uint64_t room = capacity - pos
        cdef bint wrap = need > room
        if (need + room if wrap else need) > free:
            return False
        cdef uintptr_t data = self.base + DATA
        if wrap:
            kvr_store32(data + pos, WRAP)
            tail += room
            pos = 0
        kvr_store32(data + pos, <uint32_t>n)
        if n:
            memcpy(<void*>(data + pos + 4), src, n)
        tail += need
        kvs_store_rel64(self.base + TAIL, tail)  # rule 1
        self._tail = tail
        return True


cdef class Consumer:
    """The reading end of one ring (exactly one per ring).  ``waker``: the producer's
    :class:`Bell`, rung by ``pop_batch`` when the producer asked for space (rule 3); None leaves
    rule 3 to the caller (``producer_waiting`` in the Python layer)."""

    cdef readonly uintptr_t base
    cdef readonly uint64_t capacity
    cdef readonly uint64_t max_frame
    cdef public uint64_t _head  # the consumer's own index (only it writes ``head``)
    cdef object _corrupt
    cdef object _oversize
    cdef Bell _waker

    def __cinit__(self, uintptr_t base, uint64_t capacity, uint64_t max_frame, corrupt, oversize,
                  Bell waker=None, *args, **kwargs):
        self.base = base
        self.capacity = capacity
        self.max_frame = max_frame
        self._head = kvs_load_acq64(base + HEAD)
        self._corrupt = corrupt
        self._oversize = oversize
        self._waker = waker

    def has_data(self):
        return kvs_load_acq64(self.base + TAIL) != self._head

    def pop_batch(self, unsigned int limit=64):
        """Copy out up to ``limit`` frames (as bytes) and release their space.  A frame over
        ``max_frame`` is ``oversize(length)`` (skipped, not copied).  Nothing of a corrupt batch is
        returned and ``head`` is not moved; every iteration consumes bytes and counts against
        ``limit`` (a wrap skip included), so a hostile producer cannot keep the caller here."""
        return self._pop(limit)

    cdef list _pop(self, unsigned int limit):
        cdef uint64_t head = self._head
        cdef uint64_t tail = kvs_load_acq64(self.base + TAIL)  # rule 1
        if head == tail:
            return []
        cdef uint64_t capacity = self.capacity
        if tail < head or tail - head > capacity or (head | tail) & 7:
            raise self._corrupt(f"ring indices head={head} tail={tail} are inconsistent")
        cdef list out = []
        cdef uintptr_t data = self.base + DATA
        cdef uint64_t mask = capacity - 1
        cdef unsigned int steps = 0
        cdef uint64_t pos, room, need
        cdef uint32_t n
        while head != tail and steps < limit:
            steps += 1
            pos = head & mask
            room = capacity - pos
            n = kvr_load32(data + pos)
            if n == WRAP:
                # legal only where a frame header fits but the next frame did not
                if pos == 0 or tail - head <= room:
                    raise self._corrupt(f"wrap marker at ring offset {pos} with {tail - head} bytes in flight")
                head += room
                continue
            need = (4 + <uint64_t>n + 7) & ~(<uint64_t>7)
            if need > room:
                raise self._corrupt(f"frame length {n} at ring offset {pos} is out of bounds")
            if need > tail - head:
                raise self._corrupt(f"frame length {n} at ring offset {pos} runs past tail")
            if n > self.max_frame:
                out.append(self._oversize(n))  # the caller answers TOO_LARGE
            else:
                out.append(PyBytes_FromStringAndSize(<char*>(data + pos + 4), n))
            head += need
        kvs_store_rel64(self.base + HEAD, head)  # rule 2
        self._head = head
        if self._waker is not None:
            kvs_fence()  # rule 3: the head store before the flag load
            if kvs_load_acq32(self.base + WAITING):
                kvs_store_rel32(self.base + WAITING, 0)
                self._waker.post()
        return out

    def wait_pop(self, Bell bell, double timeout_s, unsigned int limit=64):
        """Sleep on ``bell`` until this ring has a frame or ``timeout_s`` passes, then
        :meth:`pop_batch` (empty on a timeout).  The doorbell's waiter protocol with the ring as
        its condition: read ``seq``; data already there returns at once; else publish
        ``sleeping``, full fence, re-check, ``futex_wait(seq, observed)`` (GIL released), clear
        ``sleeping``.  One waiter per bell at a time."""
        if timeout_s < 0:
            raise ValueError("wait_pop needs a non-negative timeout")
        return self._wait_pop(bell, timeout_s, limit)

    def exchange(self, Producer submit, payload, Bell peer, Bell own, double slice_s,
                 unsigned int limit=256):
        """A request's round trip to a peer that sleeps, in one call: push ``payload`` into
        ``submit`` and ring ``peer``; when that ring woke it (it was asleep, so the answer is a
        wake-up away and nothing is spun for), :meth:`wait_pop` on ``own`` for at most
        ``slice_s`` and return the frames (empty: none within the slice).  ``True``: pushed and
        rung, but the peer was awake (the caller waits its own way).  ``False``: it did not fit
        (nothing written, nobody rung).  The client's common case after an idle gap."""
        if slice_s < 0:
            raise ValueError("exchange needs a non-negative slice")
        if not submit._push_obj(payload):
            return False
        if not peer.post():
            return True
        return self._wait_pop(own, slice_s, limit)

    cdef list _wait_pop(self, Bell bell, double timeout_s, unsigned int limit):
        cdef uintptr_t tail_addr = self.base + TAIL
        cdef uint64_t head = self._head
        cdef int64_t ns = <int64_t>(timeout_s * 1e9)
        cdef uint32_t observed = kvs_load_acq32(bell.seq_addr)
        cdef int r = 0
        if kvs_load_acq64(tail_addr) == head and ns > 0:
            with nogil:
                bell.announce()
                r = bell.doze(observed, ns if kvs_load_acq64(tail_addr) == head else 0)
            if r < 0:
                raise OSError(-r, "futex wait failed")
        return self._pop(limit)
