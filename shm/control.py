"""Layout of the control segment: header, client slot table, a ring pair per slot.

::

    [header: HEADER_BYTES]
        0   u64 magic            b"KVSIDEC1"
        8   u32 layout version   LAYOUT_VERSION
        12  u32 protocol version
        16  u64 generation       bumped by every sidecar start; clients compare
        24  u64 sidecar pid
        32  u64 sidecar start    process start time (clock ticks), defeats PID reuse
        40  u32 num slots
        44  u32 ring capacity    bytes of data per ring
        48  u64 state            STATE_* below
        56  u64 slot epoch       bumped (fetch-add) by a client after it claims a slot
        64  doorbell             the sidecar's (clients post after submitting)
        120 u64 slot exhaustions a client that found every slot taken adds 1 (fetch-add), then
                                 bumps the slot epoch so the sidecar notices (counts, logs)
        128 64s instance name
        192 64s pool segment name ("" until a pool exists)
        256 u64 stats seqlock    odd while the sidecar rewrites the stats blob
        264 u32 stats length
        272 ..  stats blob       msgpack map, read by the inspector without a round trip: the
                                 sidecar's stats plus its bounded status tables (sessions,
                                 leases, pool, clients); see write_stats for the ordering
    [slot table: num_slots × SLOT_BYTES]
        0   u64 state word       0 = free, else (pid << 8) | SLOT_*
        8   u64 client start     client process start time (clock ticks)
        16  death word           40 B robust pthread mutex the client holds while attached
                                 (kvsidecar.shm.deathword: its death is seen before its teardown)
        64  doorbell             the client's (sidecar posts after completing)
    [rings: num_slots × (submit ring, completion ring)]

A client claims a slot with one compare-and-swap ``0 → (pid << 8) | SLOT_CLAIMED``
and then bumps the slot epoch and rings the sidecar.  Only the sidecar moves a
slot to ACTIVE (on a valid ``attach``) or back to free (after detach or client
death, having reset both rings first).  A client never writes its slot word after
claiming, so the sidecar's reclaim cannot race with it.
"""

from __future__ import annotations

import os
import struct

import msgpack

from kvsidecar._native import atomics as _a

from .doorbell import Doorbell
from .errors import SegmentError
from .protocol import PROTOCOL_VERSION
from .ring import RingConsumer, RingProducer, ring_region_bytes
from .segment import Segment

MAGIC = int.from_bytes(b"KVSIDEC1", "little")
LAYOUT_VERSION = 1
HEADER_BYTES = 64 * 1024
SLOT_BYTES = 128
STATS_OFFSET = 272
STATS_CAPACITY = HEADER_BYTES - STATS_OFFSET

STATE_STARTING, STATE_READY, STATE_STOPPING, STATE_STOPPED = 0, 1, 2, 3
STATE_NAMES = {0: "starting", 1: "ready", 2: "stopping", 3: "stopped"}
SLOT_FREE, SLOT_CLAIMED, SLOT_ACTIVE, SLOT_RECLAIMING = 0, 1, 2, 3
SLOT_NAMES = {0: "free", 1: "claimed", 2: "active", 3: "reclaiming"}

_HDR = struct.Struct("<QIIQQQIIQQ")  # up to offset 64
_EXHAUSTIONS_OFFSET = 120  # on the doorbell's line: written only when an attach is refused


def control_segment_bytes(num_slots: int, ring_capacity: int) -> int:
    return HEADER_BYTES + num_slots * (SLOT_BYTES + 2 * ring_region_bytes(ring_capacity))


def process_start_ticks(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (0 when it does not exist)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return 0
    # comm may contain spaces/parens: fields after the last ')' are fixed.
    rest = data[data.rindex(b")") + 2 :].split()
    return int(rest[19])


def slot_word(pid: int, state: int) -> int:
    return (pid << 8) | state


def split_slot_word(word: int) -> tuple[int, int]:
    return word >> 8, word & 0xFF


class ControlSegment:
    """Typed view of a mapped control segment (either side)."""

    def __init__(self, segment: Segment):
        self.segment = segment
        self.base = segment.address
        magic, layout, proto, gen, pid, start, nslots, ringcap, state, epoch = _HDR.unpack_from(
            segment.view, 0
        )
        if magic != MAGIC:
            raise SegmentError(f"{segment.name}: not a kvsidecar control segment")
        if layout != LAYOUT_VERSION:
            raise SegmentError(f"{segment.name}: layout version {layout}, expected {LAYOUT_VERSION}")
        self.protocol_version = proto
        self.num_slots = nslots
        self.ring_capacity = ringcap
        if segment.size < control_segment_bytes(nslots, ringcap):
            raise SegmentError(f"{segment.name}: truncated control segment")
        self.sidecar_doorbell = Doorbell(self.base, 64)
        self._slots_off = HEADER_BYTES
        self._rings_off = HEADER_BYTES + nslots * SLOT_BYTES

    # -- creation (sidecar) -------------------------------------------------------------------
    @classmethod
    def initialize(cls, segment: Segment, *, generation: int, num_slots: int, ring_capacity: int,
                   instance: str) -> "ControlSegment":
        if segment.size < control_segment_bytes(num_slots, ring_capacity):
            raise SegmentError("control segment too small for the requested slots/rings")
        view = segment.view
        # Zero every page now: the rings' first lap must not take page faults inside
        # requests, and the sidecar's resident size is then flat from the start.
        zeros = bytes(1 << 20)
        for off in range(0, segment.size, len(zeros)):
            n = min(len(zeros), segment.size - off)
            view[off:off + n] = zeros[:n]
        _HDR.pack_into(view, 0, MAGIC, LAYOUT_VERSION, PROTOCOL_VERSION, generation, os.getpid(),
                       process_start_ticks(os.getpid()), num_slots, ring_capacity, STATE_STARTING, 0)
        _put_str(view, 128, instance)
        self = cls(segment)
        for i in range(num_slots):
            _a.store_release_u64(self.slot_addr(i), 0)
            self.submit_producer(i).reset()
            self.completion_producer(i).reset()
        return self

    # -- header fields ------------------------------------------------------------------------
    @property
    def generation(self) -> int:
        return _a.load_acquire_u64(self.base + 16)

    @property
    def sidecar_pid(self) -> int:
        return _a.load_acquire_u64(self.base + 24)

    @property
    def sidecar_start_ticks(self) -> int:
        return _a.load_acquire_u64(self.base + 32)

    @property
    def state(self) -> int:
        return _a.load_acquire_u64(self.base + 48)

    def set_state(self, state: int) -> None:
        _a.store_release_u64(self.base + 48, state)

    @property
    def slot_epoch(self) -> int:
        return _a.load_acquire_u64(self.base + 56)

    def bump_slot_epoch(self) -> None:
        _a.fetch_add_u64(self.base + 56, 1)

    @property
    def slot_exhaustions(self) -> int:
        """Attaches refused because every slot was taken, over this segment's life."""
        return _a.load_acquire_u64(self.base + _EXHAUSTIONS_OFFSET)

    def count_slot_exhaustion(self) -> None:
        """A client found no free slot: count it and wake the sidecar (a slot-table rescan)."""
        _a.fetch_add_u64(self.base + _EXHAUSTIONS_OFFSET, 1)
        self.bump_slot_epoch()

    @property
    def instance(self) -> str:
        return _get_str(self.segment.view, 128)

    @property
    def pool_name(self) -> str:
        return _get_str(self.segment.view, 192)

    def set_pool_name(self, name: str) -> None:
        _put_str(self.segment.view, 192, name)

    # -- slots ----------------------------------------------------------------------------------
    def slot_addr(self, i: int) -> int:
        return self.base + self._slots_off + i * SLOT_BYTES

    def slot_state(self, i: int) -> tuple[int, int]:
        return split_slot_word(_a.load_acquire_u64(self.slot_addr(i)))

    def client_start_ticks(self, i: int) -> int:
        return _a.load_acquire_u64(self.slot_addr(i) + 8)

    def try_claim(self, i: int, pid: int, start_ticks: int) -> bool:
        if not _a.cas_u64(self.slot_addr(i), 0, slot_word(pid, SLOT_CLAIMED)):
            return False
        _a.store_release_u64(self.slot_addr(i) + 8, start_ticks)
        return True

    def slots_by_pid(self) -> dict[int, int]:
        """{pid: slots it holds (claimed or active)}, read live from the slot table."""
        held: dict[int, int] = {}
        for i in range(self.num_slots):
            pid, state = self.slot_state(i)
            if state != SLOT_FREE:
                held[pid] = held.get(pid, 0) + 1
        return held

    def set_slot(self, i: int, pid: int, state: int) -> None:
        _a.store_release_u64(self.slot_addr(i), slot_word(pid, state) if state else 0)

    def client_doorbell(self, i: int) -> Doorbell:
        return Doorbell(self.base, self._slots_off + i * SLOT_BYTES + 64)

    # -- rings ----------------------------------------------------------------------------------
    def _ring_off(self, i: int, which: int) -> int:
        return self._rings_off + (2 * i + which) * ring_region_bytes(self.ring_capacity)

    def submit_producer(self, i: int) -> RingProducer:
        return RingProducer(self.segment, self._ring_off(i, 0), self.ring_capacity)

    def submit_consumer(self, i: int, max_frame: int | None = None, waker=None) -> RingConsumer:
        """``waker``: the client's doorbell, rung by ``pop_batch`` when the client waits for space."""
        return RingConsumer(self.segment, self._ring_off(i, 0), self.ring_capacity, max_frame, waker)

    def completion_producer(self, i: int) -> RingProducer:
        return RingProducer(self.segment, self._ring_off(i, 1), self.ring_capacity)

    def completion_consumer(self, i: int, waker=None) -> RingConsumer:
        """``waker``: the sidecar's doorbell, rung by ``pop_batch`` when the sidecar waits for space."""
        return RingConsumer(self.segment, self._ring_off(i, 1), self.ring_capacity, waker=waker)

    # -- stats blob (seqlock: writer is the sidecar's control thread only) ----------------------
    # Memory ordering (one writer, any number of read-only readers in other processes):
    #   writer: seq := s+1 (store-release; odd = writing), full fence, write length + blob,
    #           seq := s+2 (store-release: the blob's bytes are visible before the even value).
    #   reader: s1 := seq (load-acquire; retry while odd), copy length + blob, full fence,
    #           s2 := seq (load-acquire); the copy is consistent iff s1 == s2, else retry.
    # A reader never writes the segment (it may map it read-only) and never blocks the writer;
    # after ``tries`` torn reads it gives up with {} (bounded, no waiting on the writer).
    def write_stats(self, stats: dict) -> None:
        blob = msgpack.packb(stats, use_bin_type=True)
        if len(blob) > STATS_CAPACITY:
            blob = msgpack.packb({"truncated": True}, use_bin_type=True)
        seq_addr = self.base + 256
        seq = _a.load_acquire_u64(seq_addr)
        _a.store_release_u64(seq_addr, seq + 1)  # odd: writing
        _a.fence()
        view = self.segment.view
        struct.pack_into("<I", view, 264, len(blob))
        view[STATS_OFFSET : STATS_OFFSET + len(blob)] = blob
        _a.store_release_u64(seq_addr, seq + 2)

    def read_stats(self, tries: int = 100) -> dict:
        seq_addr = self.base + 256
        view = self.segment.view
        for _ in range(tries):
            s1 = _a.load_acquire_u64(seq_addr)
            if s1 & 1:
                continue
            (n,) = struct.unpack_from("<I", view, 264)
            blob = bytes(view[STATS_OFFSET : STATS_OFFSET + min(n, STATS_CAPACITY)])
            _a.fence()
            if _a.load_acquire_u64(seq_addr) == s1:
                return msgpack.unpackb(blob, raw=False) if n else {}
        return {}


def describe_slot_holders(held: dict[int, int], me: int | None = None, top: int = 3) -> str:
    """``pid 123 holds 12 (this process), pid 456 holds 4`` -- the biggest holders first."""
    if not held:
        return "no holder left"
    ranked = sorted(held.items(), key=lambda kv: (-kv[1], kv[0]))
    parts = [f"pid {pid} holds {n}{' (this process)' if pid == me else ''}" for pid, n in ranked[:top]]
    if len(ranked) > top:
        parts.append(f"{len(ranked) - top} more pids")
    return ", ".join(parts)


def _put_str(view, off: int, s: str) -> None:
    b = s.encode()[:63]
    view[off : off + 64] = b + bytes(64 - len(b))


def _get_str(view, off: int) -> str:
    return bytes(view[off : off + 64]).split(b"\0", 1)[0].decode(errors="replace")
