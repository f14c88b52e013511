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
from kvsidecar._native import ring as _native

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
    def __init__(self, segment, offset: int, capacity: int):
        if capacity & (capacity - 1) or capacity < 64:
            raise ValueError("ring capacity must be a power of two >= 64")
        self.capacity = capacity
        self.mask = capacity - 1
        base = segment.address + offset
        self.base = base
        self.head_addr = base + _HEAD
        self.tail_addr = base + _TAIL
        self.waiting_addr = base + _WAITING
        self.data_off = offset + RING_HEADER_BYTES
        self.view = segment.view
        self.max_payload = capacity // 2 - 8

    def depth(self) -> int:
        """Bytes in flight (a snapshot; exact only for the calling side's own index)."""
        return _a.load_acquire_u64(self.tail_addr) - _a.load_acquire_u64(self.head_addr)

    def reset(self) -> None:
        _a.store_release_u64(self.head_addr, 0)
        _a.store_release_u64(self.tail_addr, 0)
        _a.store_release_u32(self.waiting_addr, 0)


class RingProducer(_RingBase):
    """The writing side.  Exactly one producer per ring."""

    def __init__(self, segment, offset: int, capacity: int):
        super().__init__(segment, offset, capacity)
        self._tail = _a.load_acquire_u64(self.tail_addr)

    def try_push(self, payload) -> bool:
        """Append one frame; False (and nothing written) when it does not fit now.

        Raises :class:`RingCorrupted` when the consumer's ``head`` is impossible (behind
        by more than ``capacity``, ahead of ``tail``, unaligned): a hostile consumer then
        loses its ring instead of wedging the producer's back-pressure.  The frame is
        written by ``kvsidecar._native.ring.push`` (one call: this runs cold after idle).
        """
        if len(payload) > self.max_payload:
            raise ValueError(f"frame of {len(payload)} bytes exceeds ring bound {self.max_payload}")
        try:
            tail = _native.push(self.base, self.capacity, self._tail, payload)
        except RuntimeError as exc:
            raise RingCorrupted(str(exc)) from None
        if not tail:
            return False
        self._tail = tail
        return True

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


class RingConsumer(_RingBase):
    """The reading side.  Exactly one consumer per ring."""

    def __init__(self, segment, offset: int, capacity: int, max_frame: int | None = None):
        super().__init__(segment, offset, capacity)
        self._head = _a.load_acquire_u64(self.head_addr)
        self.max_frame = min(max_frame or self.max_payload, self.max_payload)

    def has_data(self) -> bool:
        return _a.load_acquire_u64(self.tail_addr) != self._head

    def pop_batch(self, limit: int = 64) -> list:
        """Copy out up to ``limit`` frames (as bytes) and release their space.

        Raises :class:`RingCorrupted` on anything a correct producer cannot write:
        indices out of order or more than ``capacity`` apart, a length running past
        the data area or past ``tail``, a wrap marker where a frame would have fitted
        (at offset 0, or with ``tail`` inside the skipped bytes).  Nothing of a batch
        that turns out corrupt is returned (no stale or torn frame is ever executed);
        the ring is then unusable until ``reset``.  Every loop iteration consumes
        bytes and counts against ``limit`` (a wrap skip included), so a hostile
        producer cannot keep the caller here.  The batch is copied by
        ``kvsidecar._native.ring.pop_batch`` (one call: this runs cold after idle).
        """
        try:
            self._head, out = _native.pop_batch(self.base, self.capacity, self._head, limit, self.max_frame, Oversize)
        except RuntimeError as exc:
            raise RingCorrupted(str(exc)) from None
        return out

    def producer_waiting(self) -> bool:
        """After consuming: True (and the flag cleared) when the producer asked for a wake-up."""
        _a.fence()  # rule 3
        if _a.load_acquire_u32(self.waiting_addr):
            _a.store_release_u32(self.waiting_addr, 0)
            return True
        return False

    def resync(self) -> None:
        """Re-read ``head`` after an external ``reset``."""
        self._head = _a.load_acquire_u64(self.head_addr)
