r"""Single-producer single-consumer byte ring of length-prefixed frames in shared memory.

Layout at ``offset``:

====================  =================================================
``+0``    u64 head    bytes consumed (free-running); written by consumer
``+64``   u64 tail    bytes produced (free-running); written by producer
``+72``   u32 waiting producer found the ring full and wants a wake-up
``+128``  data        ``capacity`` bytes, a power of two
====================  =================================================

A frame is ``[u32 length][payload]`` padded to 8 bytes.  When a frame does not fit
in the bytes left before the end of the data area, the producer writes the wrap
marker ``0xFFFFFFFF`` there and the frame starts at offset 0; the skipped bytes
count as consumed when the consumer passes them.  ``head`` and ``tail`` never wrap
(64 bits of bytes), so ``tail - head`` is the fill level and ``x & (capacity-1)``
the position.

Memory ordering (the rules the code below relies on):

1. Producer writes frame bytes with plain stores, then **store-release** ``tail``.
   Consumer **load-acquire**\s ``tail`` before reading any frame byte, so it sees
   complete frames only.
2. Consumer copies a frame out, then **store-release**\s ``head``.  Producer
   **load-acquire**\s ``head`` before computing free space, so it never overwrites
   bytes the consumer is still reading.
3. Back-pressure: a producer that finds the ring full sets ``waiting = 1``, full
   fence, re-reads ``head``; the consumer, after advancing ``head``, full fence,
   reads ``waiting`` and if set clears it and rings the producer's doorbell.
   (The same store-then-load pattern as the doorbell: both fences are needed.)

Each side caches its own index locally (only it writes it).  ``reset`` is only
legal while neither side is using the ring (slot free or being reclaimed).
"""

from __future__ import annotations


from kvsidecar._native import atomics as _a
from kvsidecar._native import ring as _native  # the hot halves: push, pop, wait-and-pop

from .errors import ProtocolError, ErrorCode

RING_HEADER_BYTES = 128
_HEAD = 0
_TAIL = 64
_WAITING = 72
WRAP_MARKER = 0xFFFFFFFF


def frame_bytes(payload_len: int) -> int:
    """Bytes a frame of ``payload_len`` occupies in the ring (header + padding)."""
    return (4 + payload_len + 7) & ~7


def ring_region_bytes(capacity: int) -> int:
    return RING_HEADER_BYTES + capacity


class RingCorrupted(ProtocolError):
    """The peer wrote a frame header that cannot be valid (length over bounds)."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.MALFORMED, message)


class Oversize(int):
    """Stands in ``pop_batch`` output for a well-formed frame over ``max_frame`` (its length)."""


class _RingBase:
    """What both ends share: the addresses and the segment's view (the native end keeps ``base``,
    ``capacity`` and its own index)."""

    def _setup(self, segment, offset: int) -> None:
        self.mask = self.capacity - 1
        self.head_addr = self.base + _HEAD
        self.tail_addr = self.base + _TAIL
        self.waiting_addr = self.base + _WAITING
        self.data_off = offset + RING_HEADER_BYTES
        self.view = segment.view

    def depth(self) -> int:
        """Bytes in flight (a snapshot; exact only for the calling side's own index)."""
        return _a.load_acquire_u64(self.tail_addr) - _a.load_acquire_u64(self.head_addr)

    def reset(self) -> None:
        _a.store_release_u64(self.head_addr, 0)
        _a.store_release_u64(self.tail_addr, 0)
        _a.store_release_u32(self.waiting_addr, 0)


def _checked(capacity: int) -> int:
    if capacity & (capacity - 1) or capacity < 64:
        raise ValueError("ring capacity must be a power of two >= 64")
    return capacity


class RingProducer(_native.Producer, _RingBase):
    """The writing side.  Exactly one producer per ring.

    ``try_push(payload)`` (native) appends one frame, or returns False with nothing written when it
    does not fit now; it raises :class:`RingCorrupted` when the consumer's ``head`` is impossible
    (behind by more than ``capacity``, ahead of ``tail``, unaligned): a hostile consumer then loses
    its ring instead of wedging the producer's back-pressure."""

    def __new__(cls, segment, offset: int, capacity: int):
        return super().__new__(cls, segment.address + offset, _checked(capacity), RingCorrupted)

    def __init__(self, segment, offset: int, capacity: int):
        self._setup(segment, offset)

    def mark_waiting(self) -> bool:
        """Ask for a wake-up when space frees (rule 3).  True if space appeared meanwhile."""
        _a.store_release_u32(self.waiting_addr, 1)
        _a.fence()
        head = _a.load_acquire_u64(self.head_addr)
        return self.capacity - (self._tail - head) >= self.capacity // 2

    def free_bytes(self) -> int:
        return self.capacity - (self._tail - _a.load_acquire_u64(self.head_addr))

    def drained(self) -> bool:
        """True when the consumer has read everything; raises RingCorrupted on an impossible head."""
        used = self._tail - _a.load_acquire_u64(self.head_addr)
        if not 0 <= used <= self.capacity:
            raise RingCorrupted(f"consumer index is {used} bytes off the producer's (capacity {self.capacity})")
        return used == 0


class RingConsumer(_native.Consumer, _RingBase):
    """The reading side.  Exactly one consumer per ring.

    Native: ``has_data()``; ``pop_batch(limit)`` copies out up to ``limit`` frames (as bytes; one
    over ``max_frame`` as :class:`Oversize`) and releases their space, raising
    :class:`RingCorrupted` on anything a correct producer cannot write (indices out of order or
    more than ``capacity`` apart, a length running past the data area or past ``tail``, a wrap
    marker where a frame would have fitted) with nothing of that batch returned, the ring then
    unusable until ``reset``; ``wait_pop(bell, timeout_s)`` sleeps on ``bell`` until a frame is
    there, then pops.  With ``waker`` (the producer's doorbell) ``pop_batch`` also does rule 3:
    it clears the producer's ``waiting`` flag and rings it; without, the caller asks
    :meth:`producer_waiting`."""

    def __new__(cls, segment, offset: int, capacity: int, max_frame: int | None = None, waker=None):
        bound = _checked(capacity) // 2 - 8
        return super().__new__(cls, segment.address + offset, capacity, min(max_frame or bound, bound),
                               RingCorrupted, Oversize, waker)

    def __init__(self, segment, offset: int, capacity: int, max_frame: int | None = None, waker=None):
        self._setup(segment, offset)

    def producer_waiting(self) -> bool:
        """After consuming (a consumer without ``waker``): True (and the flag cleared) when the
        producer asked for a wake-up."""
        _a.fence()  # rule 3
        if _a.load_acquire_u32(self.waiting_addr):
            _a.store_release_u32(self.waiting_addr, 0)
            return True
        return False

    def resync(self) -> None:
        """Re-read ``head`` after an external ``reset``."""
        self._head = _a.load_acquire_u64(self.head_addr)
