"""A client slot claimed by hand: direct access to its ring memory (for hostile-client tests)."""

from __future__ import annotations

import contextlib
import os
import time

from kvsidecar.shm import protocol
from kvsidecar.shm.control import ControlSegment, process_start_ticks
from kvsidecar.shm.segment import Segment


class RawSlot:
    """One claimed slot of a running sidecar, driven without the connector's safety nets."""

    def __init__(self, ctl: ControlSegment, slot: int):
        self.ctl = ctl
        self.slot = slot
        self.submit = ctl.submit_producer(slot)
        self.completions = ctl.completion_consumer(slot)
        self.doorbell = ctl.client_doorbell(slot)

    def push(self, frame: bytes) -> bool:
        ok = self.submit.try_push(frame)
        self.ctl.sidecar_doorbell.ring()
        return ok

    def request(self, msg: dict) -> None:
        self.push(protocol.encode({"v": 1, **msg}))

    def replies(self, want: int, timeout_s: float = 5.0) -> list[dict]:
        """Wait (bounded, on the slot's doorbell) for ``want`` completions."""
        out: list[dict] = []
        deadline = time.monotonic() + timeout_s
        while len(out) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.doorbell.wait(self.completions.has_data, min(left, 0.05))
            for data in self.completions.pop_batch(256):
                out.append(protocol.decode_completion(data))
        return out


@contextlib.contextmanager
def raw_slot(instance: str):
    seg = Segment.attach(f"/{instance}.ctl")
    try:
        ctl = ControlSegment(seg)
        me, start = os.getpid(), process_start_ticks(os.getpid())
        slot = next(i for i in range(ctl.num_slots) if ctl.try_claim(i, me, start))
        ctl.bump_slot_epoch()
        ctl.sidecar_doorbell.ring()
        yield RawSlot(ctl, slot)
    finally:
        seg.close()
